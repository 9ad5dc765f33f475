"""Programs that start threads and reserve more address space than they touch, as judges accept,
earn their reward through the controller: the real controller sends them to the real sandboxed
verifier and trains on the verdicts. The policy is scripted (``ScriptedPolicy``, a test fake of the
model's output only): every sample of a problem is its reference solution behind a prologue that
starts threads and maps 300 MB it never touches (the default limit is 256 MB)."""

from __future__ import annotations

import json

import numpy as np

from rlax_tpu.config import RunConfig, from_dict, to_dict
from rlax_tpu.controller.app import build_prompter, reference_text
from tests.controller.test_scheduling import make_config, run_controller

PROLOGUE = (
    "import mmap, threading\n"
    "_reserved = mmap.mmap(-1, 300 << 20)\n"
    "_threads = [threading.Thread(target=lambda: None) for _ in range(3)]\n"
    "for _t in _threads: _t.start()\n"
    "for _t in _threads: _t.join()\n"
)


class ScriptedPolicy:
    """Replaces each generated completion with PROLOGUE + the problem's reference solution."""

    def __init__(self, inner, prompter):
        self._inner, self._prompter = inner, prompter
        datasets = prompter.datasets
        self._problems = {p.id: p for ps in datasets.train.values() for p in ps}
        self._problems |= {p.id: p for p in datasets.held_out}
        self.scripted = 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def generate(self, requests, **kwargs):
        for ro in self._inner.generate(requests, **kwargs):
            problem_id = ro.prompt_id.split("#")[0].split("/", 1)[1]
            code = reference_text(self._problems[problem_id], language="python")
            tokens = np.asarray(self._prompter.tokenizer.encode(PROLOGUE + code), np.int32)
            self.scripted += 1
            yield type(ro)(
                prompt_id=ro.prompt_id,
                sample_index=ro.sample_index,
                prompt_tokens=ro.prompt_tokens,
                tokens=tokens,
                logprobs=np.full(len(tokens), -0.5, np.float32),
                versions=np.full(len(tokens), ro.version, np.int64),
                finish_reason=ro.finish_reason,
                logprob_policy=ro.logprob_policy,
            )


def test_threaded_programs_that_reserve_memory_are_accepted_through_the_controller(tmp_path):
    d = to_dict(make_config(tmp_path, num_steps=1, prompts_per_step=2))
    d["trainer"] |= dict(align_logprobs=False)  # the scripted log-probs are not the model's
    d["inference"] |= dict(max_new_tokens=256)  # room for the scripted programs
    cfg = from_dict(RunConfig, d)
    held = {}

    def wrap(comps):  # the prompter the controller builds (the tokenizer saved in run_dir)
        held["policy"] = ScriptedPolicy(comps.workers[0], build_prompter(cfg, tmp_path))
        comps.workers = [held["policy"]]

    ctl = run_controller(cfg, wrap)
    assert held["policy"].scripted > 0
    steps = [
        json.loads(line)["scalars"]
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    train = [s for s in steps if "reward/mean" in s]
    assert len(train) == 1 and all(s["reward/mean"] == 1.0 for s in train), train
    assert ctl.evals[0]["eval/pass@1"] == 1.0
    # The eval's samples are kept as text beside their verdicts (run_dir/eval/version_<v>.jsonl).
    answers = [
        json.loads(line)
        for line in (tmp_path / "eval" / "version_000000.jsonl").read_text().splitlines()
    ]
    k = cfg.data.eval_samples
    assert len(answers) == k * ctl.evals[0]["eval/problems"]
    assert {a["verdict"] for a in answers} == {"accepted"}
    assert all(a["answer"].startswith(PROLOGUE) for a in answers)
