"""Verifier service: sandboxed (bubblewrap) code execution, Codeforces-style checkers, math answers.

Serves batched verify requests over gRPC on verifiers.address.
"""

from __future__ import annotations

from rlax_tpu import cli
from rlax_tpu.config import RunConfig


def run(config: RunConfig, args: list[str]) -> int:
    # Not built yet: say so instead of pretending (#6 [verifiers]).
    return cli.not_built("verifiers", "#6 [verifiers]", config)


if __name__ == "__main__":
    cli.main("verifiers", run)
