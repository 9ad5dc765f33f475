"""Prompts, program extraction, verifier tasks and rewards, graded by the real verifier."""

from __future__ import annotations

import os

import numpy as np
import pytest

from rlax_tpu.algorithms.rewards import RewardInput, reward_fn, score
from rlax_tpu.config import VerifierConfig
from rlax_tpu.controller.tasks import (
    FENCE,
    SpecCache,
    extract_function,
    extract_program,
    make_task,
    prompt_text,
)
from rlax_tpu.data.bundled import load_bundled
from rlax_tpu.data.loaders import load_human_eval
from rlax_tpu.data.problems import MathProblem
from rlax_tpu.data.procedural import TEMPLATES, make_problem
from rlax_tpu.types import Verdict, VerdictKind
from rlax_tpu.verifiers.service import VerifierService


def reward(verdict: Verdict) -> float | None:
    """The default reward (algorithm.reward = "verdict") of a rollout with this verdict."""
    return score(
        reward_fn("verdict"),
        RewardInput(
            verdict=verdict,
            tokens=np.zeros(0, np.int32),
            problem=None,
            finished=True,
            decode=lambda t: "",
        ),
    )


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    # A uid block of its own: tests/verifiers and tests/data use 300_000 + pid-based blocks.
    uid = 1_200_000 + (os.getpid() % 100_000) * 8
    config = VerifierConfig(sandbox_uid=uid, workers=2, time_limit_s=1.0, compile_time_limit_s=20.0)
    with VerifierService(config, scratch_dir=tmp_path_factory.mktemp("verifier")) as service:
        yield service


class ChatTokenizer:
    def encode(self, text: str, *, add_bos=None):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, **kwargs):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_raw_prompt_and_extraction():
    problem = make_problem(TEMPLATES[0], 7, 0)
    assert prompt_text(problem, style="raw") == f"{problem.statement}\n{FENCE}python\n"
    assert extract_program("print(1)\n```\ntrailing", style="raw") == "print(1)\n"
    assert (
        extract_program("print(1)\n", style="raw") == "print(1)\n"
    )  # ran out of tokens: still a program
    assert extract_program("  \n```", style="raw") is None


def test_chat_prompt_and_extraction():
    problem = make_problem(TEMPLATES[0], 7, 0)
    text = prompt_text(problem, style="chat", tokenizer=ChatTokenizer())
    assert (
        text.startswith("<system>") and problem.statement in text and text.endswith("<assistant>")
    )
    answer = "Idea first.\n```python\nprint(0)\n```\nBetter:\n```python\nprint(1)\n```\n"
    assert extract_program(answer, style="chat") == "print(1)\n"
    assert extract_program("no code here", style="chat") is None
    with pytest.raises(ValueError, match="needs a tokenizer"):
        prompt_text(problem, style="chat")


def test_a_function_answer_runs_its_defining_block_after_the_prompt(verifier):
    """Chat answers to a function problem: the block that defines the function counts, not the
    usage example after it; its usage lines are dropped, and the problem's own imports and stub
    come first."""
    human_eval = load_human_eval()[0]  # needs `from typing import List` from its prompt
    name = human_eval.entry_point
    solution = f"def {name}(numbers: List[float], threshold: float) -> bool:\n"
    solution += human_eval.canonical_solution
    usage = f"```python\nprint({name}([1.0, 2.0], 0.5))\n```\n"
    answer = f"Here:\n```python\n{solution}```\nUse it like this:\n{usage}"
    assert extract_function(answer, name) == solution
    assert extract_function(usage, name) == f"print({name}([1.0, 2.0], 0.5))\n"
    assert extract_function("def f(): pass", name) is None
    assert extract_function("```python\n\n```", name) is None  # an empty block is no code
    wrong = solution.replace("return True", "return False")
    assert extract_function(f"```python\n{wrong}```\n```python\n{solution}```", name) == solution
    renamed = answer.replace(f"def {name}(", f"def {name}_v2(")
    assert extract_function(renamed, name) == usage.split("\n", 1)[1].rsplit("```", 1)[0]
    in_class = f"```python\nclass A:\n    {solution.replace(chr(10), chr(10) + '    ')}```"
    listed = "1. The code:\n   ```python\n   " + solution.replace("\n", "\n   ") + "```"
    with_checks = (
        f"```python\n{solution}\nx = [1.0, 2.0]\nassert {name}(x, 0.5) is True\n"
        f"print({name}(x, int(input())))\nif __name__ == '__main__':\n    raise SystemExit(1)\n```"
    )
    body_only = f"```python\n{human_eval.canonical_solution}```"
    specs = SpecCache(verifier)
    cases = [
        (answer, 1.0),  # the defining block, its List from the prompt's import
        (body_only, 1.0),  # an indented block is the body: it completes the stub
        (usage, 0.0),  # no definition: the stub (returns None) is graded
        (renamed, 0.0),  # another name: the stub again
        (in_class, 0.0),  # a method is not the function
        (listed, 1.0),  # a block indented under a list item
        (answer.replace("\n", "\r\n"), 1.0),  # CRLF line ends
        (with_checks, 1.0),  # its own (wrong) check, input() and __main__ block are not run
    ]
    tasks = [make_task(human_eval, text, style="chat", specs=specs) for text, _ in cases]
    verdicts = verifier.verify(tasks)
    assert [reward(v) for v in verdicts] == [r for _, r in cases], [v.detail for v in verdicts]
    assert make_task(human_eval, solution, style="chat", specs=specs) is None  # no fence
    unclosed = f"```python\n{solution}"  # cut by the token limit: no program
    assert make_task(human_eval, unclosed, style="chat", specs=specs) is None


def test_function_problems_get_a_function_system_prompt():
    function = load_human_eval()[0]
    text = prompt_text(function, style="chat", tokenizer=ChatTokenizer())
    assert "complete function" in text.split("<user>")[0] and function.prompt in text


def test_a_math_chat_prompt_asks_for_an_answer_not_a_program():
    """Under the programming system prompt SmolLM2 answered sums with code (issue [real-model])."""
    math = MathProblem(id="m", question="Calculate 2 + 3.", answer="5")
    text = prompt_text(math, style="chat", tokenizer=ChatTokenizer())
    system = text.split("<user>")[0]
    assert "math" in system and "program" not in text
    assert "Calculate 2 + 3." in text and "Answer: <answer>" in text
    code = prompt_text(make_problem(TEMPLATES[0], 7, 0), style="chat", tokenizer=ChatTokenizer())
    assert "program" in code.split("<user>")[0]


def test_rewards_from_the_real_verifier(verifier):
    specs = SpecCache(verifier)
    procedural = make_problem(TEMPLATES[0], 7, 0)
    bundled = next(p for p in load_bundled() if p.checker is not None)
    human_eval = load_human_eval()[0]
    math = MathProblem(id="m1", question="What is 6*7?", answer="42")
    cases = [
        (procedural, procedural.reference_solutions[0].code + FENCE, 1.0),
        (procedural, procedural.wrong_solutions[0].code + FENCE, 0.0),
        (bundled, bundled.reference_solutions[0].code, 1.0),
        (bundled, bundled.wrong_solutions[0].code, 0.0),
        (human_eval, human_eval.canonical_solution, 1.0),
        (human_eval, "    return None\n", 0.0),
        (math, " 42", 1.0),
        (math, " 41", 0.0),
    ]
    tasks = [make_task(p, c, style="raw", specs=specs) for p, c, _ in cases]
    verdicts = verifier.verify(tasks)
    assert [reward(v) for v in verdicts] == [r for _, _, r in cases], [v.detail for v in verdicts]
    # The problem's data was uploaded once and reused.
    assert specs.spec(procedural) is specs.spec(procedural)
    assert make_task(procedural, "```", style="raw", specs=specs) is None


def test_internal_errors_are_not_rewards():
    assert reward(Verdict(kind=VerdictKind.INTERNAL_ERROR)) is None
    assert reward(Verdict(kind=VerdictKind.TIME_LIMIT)) == 0.0
    assert reward(Verdict(kind=VerdictKind.ACCEPTED)) == 1.0


class _Counting:
    """The real verifier, counting the tasks it is sent."""

    def __init__(self, inner):
        self.inner, self.sent = inner, 0

    def verify(self, tasks):
        self.sent += len(tasks)
        return self.inner.verify(tasks)


class _CharPrompter:
    style, language = "raw", "python"

    def completion(self, rollout):
        return "".join(chr(int(t)) for t in rollout.tokens)


def test_identical_programs_run_once(verifier):
    from rlax_tpu.controller.groups import verify
    from rlax_tpu.types import FinishReason, Rollout

    problem = make_problem(TEMPLATES[0], 7, 0)
    right = problem.reference_solutions[0].code + FENCE
    wrong = problem.wrong_solutions[0].code + FENCE
    texts = [right, wrong, right, FENCE, right, wrong]

    def rollout(i, text):
        ids = np.array([ord(c) for c in text], np.int32)
        return Rollout(
            prompt_id="p",
            sample_index=i,
            prompt_tokens=np.array([1], np.int32),
            tokens=ids,
            logprobs=np.zeros(len(ids), np.float32),
            versions=np.zeros(len(ids), np.int64),
            finish_reason=FinishReason.EOS,
        )

    counting = _Counting(verifier)
    verdicts = verify(
        counting,
        SpecCache(verifier),
        _CharPrompter(),
        [(problem, rollout(i, t)) for i, t in enumerate(texts)],
    )
    assert [reward(v) for v in verdicts] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert verdicts[3].detail == "no program in the completion"
    assert counting.sent == 2  # one run per distinct program


def test_parses_from_many_threads_take_turns(monkeypatch):
    """The controller's verify threads parse answers at once; CPython 3.11's ast.parse can then
    fail with "AST constructor recursion depth mismatch" (gh-106905; a repair run died of it),
    so parse_python serializes them: no two parses overlap."""
    import ast
    import threading
    import time

    from rlax_tpu.controller import tasks

    inside, most = [0], [0]
    lock = threading.Lock()
    real_parse = ast.parse

    def slow_parse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - ast.parse's own
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.01)  # long enough for another thread to enter, were it let in
        try:
            return real_parse(*args, **kwargs)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(tasks.ast, "parse", slow_parse)

    def parse_some() -> None:
        for _ in range(5):
            tasks.parse_python("def f():\n    return 1\n")

    threads = [threading.Thread(target=parse_some) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1
