"""Multi-turn code repair through the controller, with the real verifier and trainer.

A scripted policy (an InferencePort that answers from a script instead of a model: the test's
subject is what the controller does with the answers) writes a wrong function first; after the
environment's feedback sample 0 of each group writes the reference and sample 1 stays wrong.
Every episode must carry exactly the feedback the verifier's verdict gives, as the chat
template's turn, the rewards of its last attempt, and a loss mask with the replies out.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from rlax_tpu.controller.episodes import _SEP, VerifierTools
from rlax_tpu.controller.tasks import SpecCache
from rlax_tpu.data.functions import load_functions
from rlax_tpu.environments import feedback
from rlax_tpu.environments.python_tool import INSTRUCTIONS
from rlax_tpu.observability.metrics import read_metrics
from rlax_tpu.observability.samples import read_samples, sampled_steps
from rlax_tpu.types import FinishReason, Rollout, Verdict, VerdictKind
from rlax_tpu.verifiers.service import VerifierService
from tests.controller.test_scheduling import make_config, run_controller

FUNCTIONS = {p.entry_point: p for ps in load_functions().values() for p in ps}


class ScriptedPolicy:
    """Answers each request from the script; keeps the real worker for weights and status."""

    def __init__(self, worker, tokenizer):
        self.worker, self.tok = worker, tokenizer
        self.im_end = tokenizer.backend.token_to_id("<|im_end|>")
        self.turns: list[tuple[str, int, int]] = []  # (group key, sample, turn) as asked

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def generate(self, requests, *, version=None):
        out = []
        for r in requests:
            text = self.tok.decode(list(r.prompt_tokens), skip_special_tokens=False)
            name = re.findall(r"def (\w+)\(", text)[-1]
            problem = FUNCTIONS[name]
            turn = len(r.continuation) and self.tok.decode(
                list(r.continuation), skip_special_tokens=False
            ).count("<|im_start|>user")
            key, _, sample = r.prompt_id.partition(_SEP)
            for i in range(r.num_samples):
                s = int(sample) if sample else i
                self.turns.append((key, s, turn))
                body = problem.canonical_solution if turn == 1 and s == 0 else "    return None\n"
                ids = self.tok.encode(f"```python\n{problem.prompt}{body}```") + [self.im_end]
                out.append(_rollout(r, i, ids, version))
        return iter(out)


def _rollout(request, sample: int, ids: list[int], version) -> Rollout:
    """A scripted answer as the engine would return it (ended by the turn's end marker)."""
    return Rollout(
        prompt_id=request.prompt_id,
        sample_index=sample,
        prompt_tokens=np.asarray(request.prompt_tokens, np.int32),
        tokens=np.asarray(ids, np.int32),
        logprobs=np.full(len(ids), -1.0, np.float32),
        versions=np.full(len(ids), version or 0, np.int64),
        finish_reason=FinishReason.EOS,
    )


class CountingVerifier:
    """Forwards to the real verifier, counting the tasks it is given."""

    def __init__(self, verifier):
        self.verifier, self.tasks = verifier, 0

    def __getattr__(self, name):
        return getattr(self.verifier, name)

    def verify(self, tasks, **kw):
        self.tasks += len(tasks)
        return self.verifier.verify(tasks, **kw)


class Recording:
    def __init__(self, trainer):
        self.trainer, self.batches = trainer, []

    def __getattr__(self, name):
        return getattr(self.trainer, name)

    def train_step(self, batch, **kw):
        self.batches.append(batch)
        return self.trainer.train_step(batch, **kw)


def test_code_repair_episodes_get_the_verdicts_feedback_and_the_last_attempts_reward(tmp_path):
    config = make_config(tmp_path / "run", num_steps=2)
    config = dataclasses.replace(
        config,
        data=dataclasses.replace(
            config.data,
            datasets=("functions",),
            weights=(1.0,),
            prompt_style="chat",
            eval_samples=2,
        ),
        # The local preset's tokenizer has 512 ids: a function's prompt is ~700 of them.
        model=dataclasses.replace(config.model, max_position_embeddings=4096),
        inference=dataclasses.replace(config.inference, max_prompt_len=1536, max_new_tokens=1536),
        environment=dataclasses.replace(config.environment, name="code_repair", max_turns=2),
    )
    seen = {}

    def wrap(comps):
        from rlax_tpu.controller.app import build_prompter

        tok = build_prompter(config, tmp_path / "run").tokenizer
        seen["policy"] = ScriptedPolicy(comps.workers[0], tok)
        seen["trainer"] = Recording(comps.trainer)
        seen["tok"] = tok
        comps.workers[0] = seen["policy"]
        comps.trainer = seen["trainer"]
        seen["verifier"] = comps.verifier = CountingVerifier(comps.verifier)

    ctl = run_controller(config, wrap)
    tok, batches = seen["tok"], seen["trainer"].batches
    assert ctl.step == 2 and len(batches) == 2
    im_end = tok.backend.token_to_id("<|im_end|>")
    kinds = set()
    verifier = VerifierService(
        dataclasses.replace(config.verifiers, sandbox_uid=config.verifiers.sandbox_uid + 4),
        scratch_dir=tmp_path / "verifier",
    )
    tools = VerifierTools(verifier, SpecCache(verifier), style="chat")
    for batch in batches:
        assert batch.loss_mask is not None
        for row in range(batch.num_rows):
            p, c = int(batch.prompt_lengths[row]), int(batch.completion_lengths[row])
            prompt = batch.tokens[row, :p].tolist()
            episode = batch.tokens[row, p : p + c].tolist()
            name = re.findall(r"def (\w+)\(", tok.decode(prompt))[-1]
            problem = FUNCTIONS[name]
            wrong = tok.encode(f"```python\n{problem.prompt}    return None\n```") + [im_end]
            # The verdict the verifier gives the wrong function, as the template's user turn.
            assert episode[: len(wrong)] == wrong
            reply_len = int((batch.loss_mask[row, :c] == 0).sum())
            reply = episode[len(wrong) : len(wrong) + reply_len]
            # Exactly the feedback of the verdict a verifier of our own gives that answer.
            verdict = tools.verify(problem, tok.decode(wrong))
            assert not verdict.accepted
            assert reply == tok.turn_ids(feedback(verdict), after=wrong)
            text = tok.decode(reply, skip_special_tokens=False)
            assert text.startswith("\n<|im_start|>user\nYour program failed: ")
            assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
            kinds.add(verdict.kind)
            # Loss mask: the model's two turns in, the reply out.
            mask = batch.loss_mask[row, :c]
            assert mask[: len(wrong)].all() and not mask[len(wrong) : len(wrong) + reply_len].any()
            assert mask[len(wrong) + reply_len :].all()
            # Sample 0 fixed it at the second attempt (reward 1), sample 1 did not (0).
            assert batch.rewards[row] == (1.0 if row % 2 == 0 else 0.0)
    verifier.close()
    # A wrong answer ("return None") fails the tests by an assert or by a crash.
    assert kinds <= {VerdictKind.WRONG_ANSWER, VerdictKind.RUNTIME_ERROR}
    asked = seen["policy"].turns
    assert {t for _, _, t in asked} == {0, 1}
    steps = [r["scalars"] for r in read_metrics(tmp_path / "run") if "reward/mean" in r["scalars"]]
    assert len(steps) == 2
    for st in steps:  # every first attempt failed; half the second ones passed
        assert st["episode/first_turn_pass_rate"] == 0.0 and st["reward/pass_rate"] == 0.5
        assert st["episode/turns_mean"] == 2.0
        assert st["rollout/finish_eos"] == 1.0  # every turn ended by its end marker
    # Every trained episode had its second turn, and so did every evaluated one.
    evals = [r["scalars"] for r in read_metrics(tmp_path / "run") if "eval/pass@1" in r["scalars"]]
    assert len(evals) == 2
    k = config.data.eval_samples
    for ev in evals:  # first attempts all fail; sample 0 of each problem fixes its answer
        assert ev["eval/pass@1"] == 0.0 and ev["eval/episode_pass@1"] == 0.5
    evaluated = sum(int(ev["eval/problems"]) for ev in evals) * k
    assert sum(t == 1 for _, _, t in asked) == sum(b.num_rows for b in batches) + evaluated
    # Each attempt verified once, by the environment: an evaluation's pass@1 takes its first
    # turns' verdicts from the episodes instead of running them again.
    assert seen["verifier"].tasks == 2 * (sum(b.num_rows for b in batches) + evaluated)
    # Each update's training samples (observability.samples_per_step), with the episode's turns.
    assert sampled_steps(tmp_path / "run") == [1, 2]
    for step, batch in zip((1, 2), batches, strict=True):
        samples = read_samples(tmp_path / "run", step)
        assert len(samples) == min(config.observability.samples_per_step, batch.num_rows)
        for sample in samples:
            assert sample["step"] == step and sample["finish_reason"] == "eos"
            assert sample["reward"] == (1.0 if sample["sample"] == 0 else 0.0)
            # GRPO's advantage: each group's better sample above its mean, the other below.
            assert (sample["advantage"] > 0) == (sample["reward"] == 1.0), sample
            # The pipeline generates step 2's rollouts with version 0 (the metrics' "stale 1").
            assert sample["versions"] == [0] and sample["staleness"] == step - 1
            turns = sample["turns"]
            assert [t["role"] for t in turns] == ["model", "environment", "model"]
            assert turns[0]["text"].endswith("    return None\n```")
            assert "Your program failed: " in turns[1]["text"]
            assert sample["completion"].startswith(turns[0]["text"])
            assert "def " in sample["prompt"]


def test_feedback_is_the_verdict_rendered():
    v = Verdict(kind=VerdictKind.WRONG_ANSWER, detail="failed: assert candidate(1) == 2\ngot: None")
    assert feedback(v).startswith("Your program failed: wrong answer.\n\nfailed: assert")


class ToolPolicy(ScriptedPolicy):
    """Math with the tool: turn 0 prints the right answer from a ```python block; at turn 1
    sample 0 answers with what the tool printed, sample 1 with something else."""

    def generate(self, requests, *, version=None):
        out = []
        for r in requests:
            key, _, sample = r.prompt_id.partition(_SEP)
            held = self.tok.decode(list(r.continuation), skip_special_tokens=False)
            for i in range(r.num_samples):
                s = int(sample) if sample else i
                turn = held.count("<|im_start|>user")
                self.turns.append((key, s, turn))
                if turn == 0:
                    question = self.tok.decode(list(r.prompt_tokens), skip_special_tokens=False)
                    answer = self.answers[_question(question)]
                    text = f"Let me compute.\n```python\nprint({answer!r})\n```"
                else:
                    printed = re.findall(r"```output\n(.*?)\n```", held, re.S)[-1]
                    text = f"Answer: {printed if s == 0 else printed + '1'}"
                ids = self.tok.encode(text) + [self.im_end]
                out.append(_rollout(r, i, ids, version))
        return iter(out)


def _question(prompt: str) -> str:
    return prompt.split("<|im_start|>user\n")[-1].split("\n\n")[0]


def test_python_tool_episodes_get_the_printed_output_back_and_grade_the_final_answer(tmp_path):
    config = make_config(tmp_path / "run", num_steps=1)
    config = dataclasses.replace(
        config,
        data=dataclasses.replace(
            config.data,
            datasets=("reasoning_gym:basic_arithmetic",),
            weights=(1.0,),
            prompt_style="chat",
        ),
        model=dataclasses.replace(config.model, max_position_embeddings=4096),
        inference=dataclasses.replace(config.inference, max_prompt_len=1536, max_new_tokens=1536),
        environment=dataclasses.replace(config.environment, name="python_tool", max_turns=2),
    )
    seen = {}

    def wrap(comps):
        from rlax_tpu.controller.app import build_prompter

        prompter = build_prompter(config, tmp_path / "run")
        policy = ToolPolicy(comps.workers[0], prompter.tokenizer)
        every = [
            *prompter.datasets.held_out,
            *(p for ps in prompter.datasets.train.values() for p in ps),
        ]
        policy.answers = {p.question: p.answer for p in every}
        seen.update(policy=policy, trainer=Recording(comps.trainer), tok=prompter.tokenizer)
        comps.workers[0], comps.trainer = policy, seen["trainer"]

    ctl = run_controller(config, wrap)
    tok, [batch] = seen["tok"], seen["trainer"].batches
    assert ctl.step == 1
    for row in range(batch.num_rows):
        p, c = int(batch.prompt_lengths[row]), int(batch.completion_lengths[row])
        prompt = tok.decode(batch.tokens[row, :p].tolist(), skip_special_tokens=False)
        assert INSTRUCTIONS in prompt  # the environment told the model how to call the tool
        answer = seen["policy"].answers[_question(prompt)]
        episode = batch.tokens[row, p : p + c].tolist()
        call = tok.encode(f"Let me compute.\n```python\nprint({answer!r})\n```") + [
            tok.backend.token_to_id("<|im_end|>")
        ]
        assert episode[: len(call)] == call
        reply_len = int((batch.loss_mask[row, :c] == 0).sum())
        reply = episode[len(call) : len(call) + reply_len]
        # What the sandbox printed, as the template's user turn, out of the loss.
        assert reply == tok.turn_ids(f"```output\n{answer}\n```", after=call)
        assert batch.rewards[row] == (1.0 if row % 2 == 0 else 0.0)
    steps = [r["scalars"] for r in read_metrics(tmp_path / "run") if "reward/mean" in r["scalars"]]
    assert steps[0]["episode/turns_mean"] == 2.0 and steps[0]["reward/pass_rate"] == 0.5


def test_a_template_that_rewrites_earlier_turns_is_refused_at_start_up(tmp_path):
    """Before the run generates anything (the version-0 evaluation's episodes found it at their
    second turn before): the controller refuses an environment over such a template."""
    from rlax_tpu import models
    from rlax_tpu.controller.app import build_prompter
    from rlax_tpu.controller.components import build_local
    from rlax_tpu.controller.loop import Controller
    from rlax_tpu.models.tokenizer import Tokenizer

    config = make_config(tmp_path / "run", num_steps=1)
    config = dataclasses.replace(
        config,
        data=dataclasses.replace(config.data, prompt_style="chat"),
        environment=dataclasses.replace(config.environment, name="code_repair"),
    )
    prompter = build_prompter(config, tmp_path / "run")
    rewrites = (  # the last assistant turn rendered apart from earlier ones (as Qwen3's does)
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}[earlier]{% else %}{{ m.content }}"
        "{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    prompter.tokenizer = Tokenizer(
        prompter.tokenizer.backend, eos="<|im_end|>", chat_template=rewrites
    )
    comps = build_local(
        config,
        model=models.load_model(config.model),
        eos_ids=prompter.tokenizer.stop_ids,
        run_dir=tmp_path / "run",
    )
    try:
        with pytest.raises(ValueError, match="environment.name = 'code_repair': the model's chat"):
            Controller(config, comps, prompter, run_dir=tmp_path / "run", on_event=print)
    finally:
        comps.close()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
