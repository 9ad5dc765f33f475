"""python_tool through the real sandboxed verifier: a turn ending in a ```python block gets what
the block printed back, a final answer is graded, the turns are bounded, and the prompt says how
to call the tool."""

from __future__ import annotations

import math
import os

import pytest

from rlax_tpu.config import VerifierConfig
from rlax_tpu.controller.episodes import VerifierTools
from rlax_tpu.controller.tasks import SpecCache, prompt_text
from rlax_tpu.data.problems import MathProblem
from rlax_tpu.environments import Reply, environment, instructions, tool_call
from rlax_tpu.environments.python_tool import INSTRUCTIONS
from rlax_tpu.types import VerdictKind
from rlax_tpu.verifiers.service import VerifierService

UID = 3_300_000 + (os.getpid() % 100_000) * 8  # a uid block of its own
PROBLEM = MathProblem(id="p", question="What is the sum of the squares of 1 to 20?", answer="2870")


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    config = VerifierConfig(sandbox_uid=UID, workers=1, languages=("python",))
    with VerifierService(config, scratch_dir=tmp_path_factory.mktemp("verifier")) as verifier:
        yield VerifierTools(verifier, SpecCache(verifier), style="chat")


CALL = "Let me compute it.\n```python\nprint(sum(k * k for k in range(1, 21)))\n```"


def test_a_tool_call_gets_the_output_back_and_the_answer_is_graded(tools):
    env = environment("python_tool", max_turns=3)
    first = env.reply(PROBLEM, [CALL], tools)
    assert first == Reply(text="```output\n2870\n```", reward=0.0)
    right = env.reply(PROBLEM, [CALL, "The tool says 2870.\nAnswer: 2870"], tools)
    assert right.text is None and right.reward == 1.0 and right.verdict.accepted
    wrong = env.reply(PROBLEM, [CALL, "Answer: 2871"], tools)
    assert wrong.text is None and wrong.reward == 0.0
    assert wrong.verdict.kind is VerdictKind.WRONG_ANSWER


def test_a_failing_block_gets_its_error_back(tools):
    env = environment("python_tool", max_turns=2)
    crash = env.reply(PROBLEM, ["```python\nprint(1)\nprint(undefined_name)\n```"], tools)
    assert crash.text.startswith("```output\nError: exit code 1")
    assert "1\n" in crash.text and "NameError: name 'undefined_name' is not defined" in crash.text
    assert crash.reward == 0.0


def test_the_last_turn_is_graded_even_if_it_calls_the_tool(tools):
    env = environment("python_tool", max_turns=2)
    last = env.reply(PROBLEM, [CALL, CALL], tools)
    assert last.text is None and last.reward == 0.0 and last.verdict is not None


def test_what_counts_as_a_tool_call():
    assert tool_call(CALL) == "print(sum(k * k for k in range(1, 21)))\n"
    assert tool_call(CALL + "\nSo the answer is: 2870") is None  # answered after the block
    assert tool_call("Answer: 5\n```python\nprint(5)\n```") == "print(5)\n"  # code after it
    assert tool_call("```python\nprint(1)\n") is None  # unterminated: cut off, not a call
    assert tool_call("```\nprint(1)\n```") is None and tool_call("no code") is None
    first, last = "```python\nx = 1\n```\n", "```py\nprint(2)\n```"
    assert tool_call(first + last) == "print(2)\n"


class ChatTokenizer:  # renders roles plainly: where the instructions land is what is tested
    def apply_chat_template(self, messages, **kwargs):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_the_prompt_says_how_to_call_the_tool():
    tokenizer = ChatTokenizer()
    assert instructions("python_tool") == INSTRUCTIONS and instructions("code_repair") == ""
    assert instructions("none") == ""
    text = prompt_text(PROBLEM, style="chat", tokenizer=tokenizer, instructions=INSTRUCTIONS)
    user = text.split("<user>")[1].split("<assistant>")[0]
    assert user.startswith(PROBLEM.question) and user.endswith(f"\n\n{INSTRUCTIONS}")
    assert INSTRUCTIONS not in prompt_text(PROBLEM, style="chat", tokenizer=tokenizer)


def test_an_internal_error_gives_no_reward():
    class Broken:
        def run(self, code, **kw):
            from rlax_tpu.types import Verdict

            return Verdict(kind=VerdictKind.INTERNAL_ERROR, detail="sandbox down")

    reply = environment("python_tool", max_turns=2).reply(PROBLEM, [CALL], Broken())
    assert reply.text is None and math.isnan(reply.reward)
