"""code_repair through the real sandboxed verifier: a failing program gets its verdict back as
feedback, a fixed one ends the episode with reward 1, and the attempts are bounded."""

from __future__ import annotations

import math
import os

import pytest

from rlax_tpu.config import VerifierConfig
from rlax_tpu.controller.episodes import VerifierTools
from rlax_tpu.controller.tasks import NO_PROGRAM, SpecCache
from rlax_tpu.data.functions import load_functions
from rlax_tpu.environments import (
    Reply,
    environment,
    episode_reward,
    feedback,
    known_environments,
    register_environment,
)
from rlax_tpu.types import Verdict, VerdictKind
from rlax_tpu.verifiers.service import VerifierService

UID = 3_100_000 + (os.getpid() % 100_000) * 8  # a uid block of its own


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    config = VerifierConfig(sandbox_uid=UID, workers=1, languages=("python",))
    with VerifierService(config, scratch_dir=tmp_path_factory.mktemp("verifier")) as verifier:
        yield VerifierTools(verifier, SpecCache(verifier), style="chat")


def _answer(problem, body):
    return f"Here it is:\n```python\n{problem.prompt}{body}```\n"


def test_a_failed_program_gets_its_verdict_back_and_a_fix_ends_the_episode(tools):
    problem = next(p for p in load_functions()["train"] if p.id == "add_entry")
    env = environment("code_repair", max_turns=3)
    wrong = _answer(problem, "    return {}\n")
    first = env.reply(problem, [wrong], tools)
    assert first.reward == 0.0 and first.verdict.kind is VerdictKind.WRONG_ANSWER
    assert first.text == feedback(first.verdict)
    assert first.text.startswith("Your program failed: wrong answer.")
    assert first.text.endswith("answer with the complete corrected program in one code block.")

    none = env.reply(problem, [wrong, "I am not sure."], tools)
    assert none.verdict is NO_PROGRAM and none.reward == 0.0
    assert none.text.startswith("Your answer has no code block.")

    right = _answer(problem, problem.canonical_solution)
    fixed = env.reply(problem, [wrong, "I am not sure.", right], tools)
    assert fixed == Reply(text=None, reward=1.0, verdict=fixed.verdict) and fixed.verdict.accepted
    # The last attempt ends the episode whatever its verdict.
    last = env.reply(problem, [wrong, wrong, wrong], tools)
    assert last.text is None and last.reward == 0.0
    # Right at once: one turn.
    assert env.reply(problem, [right], tools).text is None


def test_feedback_reports_the_runtime_error_and_the_tests_passed():
    crash = Verdict(
        kind=VerdictKind.RUNTIME_ERROR,
        detail="Traceback ...\n" + "x" * 2000 + "\nNameError: name 'key' is not defined",
        tests_passed=2,
        tests_total=5,
    )
    text = feedback(crash)
    assert text.startswith("Your program failed: runtime error. It passed 2 of 5 tests.")
    assert "NameError: name 'key' is not defined" in text and "Traceback" not in text
    assert len(text) < 800


def test_an_internal_error_gives_no_reward_and_ends_the_episode():
    class Broken:
        def verify(self, problem, answer):
            return Verdict(kind=VerdictKind.INTERNAL_ERROR, detail="sandbox failed")

    reply = environment("code_repair", max_turns=2).reply(None, ["x"], Broken())
    assert reply.text is None and math.isnan(reply.reward)


def test_episode_rewards():
    assert episode_reward([0.0, 1.0], mode="last") == 1.0
    assert episode_reward([0.0, 1.0], mode="discounted", discount=0.5) == 0.5
    assert episode_reward([1.0], mode="discounted", discount=0.5) == 1.0
    with pytest.raises(ValueError, match="at least one turn"):
        episode_reward([], mode="last")
    with pytest.raises(ValueError, match="unknown episode reward 'sum'"):
        episode_reward([1.0], mode="sum")


def test_the_registry_refuses_what_it_cannot_use():
    assert "code_repair" in known_environments()
    with pytest.raises(ValueError, match="unknown environment 'nope'; known: \\['code_repair'"):
        environment("nope", max_turns=2)
    with pytest.raises(ValueError, match="max_turns >= 1"):
        environment("code_repair", max_turns=0)
    with pytest.raises(ValueError, match="exists already"):
        register_environment("code_repair", lambda n: None)
    with pytest.raises(TypeError, match="is not callable"):
        register_environment("mine", "not a factory")
