"""The project's own function problems in the HumanEval layout (``functions.jsonl``).

161 functions of one line (one of two) on numbers, strings, lists, logic and dicts (the level of a programmer's
first week), written for this project (no published set), each with a stub and docstring
(``prompt``), its test code (``check(candidate)``) and a reference body. ``split`` puts each in
training (128) or held out (33). Held out are other tasks, not training ones with new constants:
no training reference passes a held-out function's tests or the reverse (tests/data/test_functions.py).
The split was made so: functions whose references pass each other's tests (``len`` of a list and
of a dict, ``a + b`` on numbers and on lists) are grouped and every group of two or more trains;
every third of the remaining ones, per topic in file order, is held out.

Chosen by measurement (4 samples per problem at temperature 1, 256 new tokens, the chat prompt;
``benchmarks/real_model.py --task code baseline``): SmolLM2-135M-Instruct passes 9.0% of samples
of the training functions and 3.8% of the held-out ones (36% and 30% of its answers hold no fenced
program), and none of the bundled or procedural stdin/stdout problems (0 of 148 and 0 of 640
samples). A first probe found 2.8% on a harder set of 2-5 line functions.

One record per line::

    {"id": "sum_of_evens", "entry_point": "sum_of_evens", "prompt": "def sum_of_evens(...",
     "test": "def check(candidate):\\n    assert ...", "canonical_solution": "    return ...",
     "topic": "lists", "split": "train"}
"""

from __future__ import annotations

import json
from pathlib import Path

from rlax_tpu.data.problems import DataError, UnitTestProblem, check_problem

FUNCTIONS_FILE = Path(__file__).with_name("functions.jsonl")
SOURCE = "functions"
SPLITS = ("train", "held_out")


def load_functions(path: str | Path = FUNCTIONS_FILE) -> dict[str, list[UnitTestProblem]]:
    """Split name -> its problems in file order. Raises DataError naming the line of a bad record."""
    path = Path(path)
    splits: dict[str, list[UnitTestProblem]] = {s: [] for s in SPLITS}
    seen: set[str] = set()
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            fields = ("id", "entry_point", "prompt", "test", "split")
            wrong = [f for f in fields if not isinstance(record[f], str)]
            if wrong:
                raise TypeError(f"{', '.join(wrong)} must be strings")
            problem = UnitTestProblem(
                id=record["id"],
                prompt=record["prompt"],
                entry_point=record["entry_point"],
                test=record["test"],
                canonical_solution=record.get("canonical_solution", ""),
                source=SOURCE,
            )
            split = record["split"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DataError(str(path), line_no, f"not a function record: {e!r}") from e
        if split not in splits:
            raise DataError(str(path), line_no, f"split {split!r} is not one of {SPLITS}")
        if problem.id in seen:
            raise DataError(str(path), line_no, f"problem id {problem.id!r} appears twice")
        seen.add(problem.id)
        splits[split].append(check_problem(problem, str(path), line_no))
    return splits
