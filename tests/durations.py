"""Seconds each test module took (tests/durations.json), so the slowest start first.

pytest-xdist's loadscope hands whole modules to workers in collection order; longest first keeps
one worker from finishing a long module alone at the end. Refresh the table from a run's log:

    .venv/bin/python -m pytest -n 2 --dist loadscope --durations=0 > run.log
    .venv/bin/python tests/durations.py run.log
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

TABLE = Path(__file__).with_name("durations.json")
_LINE = re.compile(r"\s*([\d.]+)s (?:call|setup|teardown)\s+([^:\s]+)")


def module_seconds(log: str) -> dict[str, float]:
    """Module path -> seconds summed over its tests' phases in a ``--durations=0`` report."""
    total: collections.Counter[str] = collections.Counter()
    for line in log.splitlines():
        if m := _LINE.match(line):
            total[m.group(2)] += float(m.group(1))
    return {k: round(v, 1) for k, v in total.most_common()}


def load() -> dict[str, float]:
    return json.loads(TABLE.read_text()) if TABLE.exists() else {}


if __name__ == "__main__":
    seconds = module_seconds(Path(sys.argv[1]).read_text())
    TABLE.write_text(json.dumps(seconds, indent=0) + "\n")
    print(f"{TABLE}: {len(seconds)} modules, {sum(seconds.values()):.0f} s")
