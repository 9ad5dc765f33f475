"""``python -m rlax_tpu.aot`` as users run it, through libtpu and checked against HBM: the local
preset's programs compiled for v5e:2x2, its engine laid over two chips of v5p:2x2x1 and its
trainer, with scanned layers, over two v5e:2x2 slices; oversized and mismatched configs refused;
the scanned trainer's FLOPs against the unrolled one's (XLA counts a loop body once, so the
scanned count is extrapolated by depth).

The compiles use the preset with 8 sequences in flight, not 64 (the TPU decode kernel's compile
grows with them) and each compiles only the programs its test reads: the module runs them one
after another in about 80 s of CPU. SmolLM2's shapes against a textbook count are in
test_smollm2_counts.py; the presets exactly as shipped (and the whole 30-layer SmolLM2) compile in
`python benchmarks/aot_presets.py` (benchmarks/RESULTS.md).

Cost: about 80 CPU-s in the first test (the module's three libtpu compiles): TPU programs
cannot come from the CPU tests' cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlax_tpu.cli import EXIT_USAGE
from tests.child_env import FAST_COMPILE

# The compiles run in the first test that asks for them.
pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]
LOCAL = "configs/codeforces.py:local"
TRAINER_ONLY = "--component=trainer"
SEQS_8 = "--config.inference.max_concurrent_seqs=8"
# name -> (config, topology, extra flags): each compiled once by the module fixture.
COMPILES = {
    "local": (LOCAL, "v5e:2x2", (SEQS_8,)),
    # The engine over 2 of the 4 chips (tensor-parallel), on v5p (its own chip spec and HBM).
    "local-tensor2": (
        LOCAL,
        "v5p:2x2x1",
        ("--component=inference", "--config.inference.mesh.tensor=2", SEQS_8),
    ),
    # The trainer over two slices joined by DCN (multislice; data-parallel across them), its
    # layers scanned.
    "local-2slices-scan": (
        LOCAL,
        "v5e:2x2",
        (
            TRAINER_ONLY,
            "--config.mesh.slices=2",
            "--config.trainer.scan_layers=true",
            "--programs=trainer.accumulate",
        ),
    ),
}


# As users run it: without the suite's CPU-compile shortcut (tests/conftest.py), which XLA
# would also apply to the TPU compiles.
ENV = os.environ | {
    "XLA_FLAGS": " ".join(
        f for f in os.environ["XLA_FLAGS"].split() if f not in FAST_COMPILE.split()
    )
}


def aot_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlax_tpu.aot", *args]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        aot_command(*args), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600
    )


def compile_all(
    out: Path, compiles: dict[str, tuple[str, str, tuple[str, ...]]], timeout_s: float
) -> dict[str, tuple[int, str, dict | None]]:
    """Runs ``name -> (config, topology, flags)`` as ``python -m rlax_tpu.aot`` processes, one
    at a time (libtpu's compiler threads spin against each other: run together, the same
    compiles took 30% more CPU); name -> (exit code, stderr, parsed JSON report)."""
    deadline = time.monotonic() + timeout_s
    results = {}
    for name, (config, topology, flags) in compiles.items():
        path = out / f"{name}.json"
        cmd = aot_command(f"--config={config}", f"--topology={topology}", f"--json={path}", *flags)
        done = subprocess.run(
            cmd,
            cwd=REPO,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=max(1.0, deadline - time.monotonic()),
        )
        report = json.loads(path.read_text()) if path.exists() else None
        results[name] = (done.returncode, done.stderr, report)
    return results


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """name of COMPILES -> (exit code, stderr, parsed JSON report)."""
    # Inside the module's pytest-timeout.
    return compile_all(tmp_path_factory.mktemp("aot"), COMPILES, timeout_s=800)


# On TPU the aligned π_old is the prefill-shaped recompute (trainer.old_logprobs "auto").
TRAINER = {
    "trainer.accumulate",
    "trainer.apply",
    "trainer.prepare",
    "trainer.prefill_old",
    "trainer.publish",
}
ENGINE = {"inference.decode", "inference.prefill", "inference.copy_pages"}


def check_fits(report: dict, topology: str) -> dict[str, dict]:
    """The report's programs by name, each asserted to fit with sane counts."""
    programs = {p["name"]: p for p in report["programs"]}
    usable = report["devices"][topology]["usable_hbm_bytes"]
    for p in programs.values():
        assert p["status"] == "fits", p
        assert 0 < p["peak_bytes"] <= usable and p["hbm_bytes"] == usable
        assert p["argument_bytes"] > 0 and p["bytes_accessed"] > 0 and p["roofline_s"] > 0
    return programs


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMPILES))
def test_every_program_compiles_and_fits(reports, name):
    code, err, report = reports[name]
    assert code == 0, err[-3000:]
    _, topology, flags = COMPILES[name]
    programs = check_fits(report, topology)
    components = {"--component=inference": ENGINE, TRAINER_ONLY: TRAINER}
    want = next((v for k, v in components.items() if k in flags), TRAINER | ENGINE)
    only = [f.removeprefix("--programs=").split(",") for f in flags if f.startswith("--programs=")]
    assert set(programs) == (set(only[0]) if only else want)
    if "trainer.accumulate" in programs:
        assert programs["trainer.accumulate"]["flops"] > 0


def test_an_oversized_cache_is_refused_with_one_line_per_program():
    out = run(
        "--config=configs/codeforces.py:local",
        "--topology=v5e:2x2",
        "--component=inference",
        f"--config.inference.kv_cache_bytes={40 * 2**30}",
        SEQS_8,
    )
    assert out.returncode == 1, out.stderr[-2000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("rlax_tpu.aot: ")]
    assert lines and lines[0].startswith("rlax_tpu.aot: inference.decode does not fit on v5e:2x2: ")
    assert all(" does not fit on v5e:2x2: " in ln for ln in lines)
    assert "GiB" in lines[0] or "HBM" in lines[0]
    assert "Traceback" not in out.stderr


def test_a_mesh_that_does_not_fit_the_topology_is_refused():
    out = run(
        "--config=configs/codeforces.py:local",
        "--topology=v5e:2x2",
        "--component=trainer",
        "--config.mesh.data=8",
    )
    assert out.returncode == EXIT_USAGE
    assert (
        "rlax_tpu.aot: error: the config's trainer does not fit topology v5e:2x2 (4 devices)"
        in out.stderr
    )
    out = run("--config=configs/codeforces.py:local", "--topology=v9x:2x2")
    assert out.returncode == EXIT_USAGE and "no chip specs for 'v9x'" in out.stderr
    out = run("--config=configs/codeforces.py:local")
    assert out.returncode == EXIT_USAGE and "--topology is required" in out.stderr
    out = run(
        f"--config={LOCAL}",
        "--topology=v5e:2x2",
        TRAINER_ONLY,
        "--programs=trainer.apply,trainer.nope",
    )
    assert out.returncode == EXIT_USAGE, out.stderr[-2000:]
    assert "no program trainer.nope here; the programs: trainer.accumulate, " in out.stderr


def test_the_engine_compiles_on_its_mesh(reports):
    """inference.mesh lays the engine over the slice's chips: weights and pages split over the
    tensor axis, so each chip's arguments shrink (the tiny model's 2 KV heads, 4 query heads)."""
    one, two = (_programs(reports, name)["inference.decode"] for name in ("local", "local-tensor2"))
    assert one["note"].startswith("one chip of 4")
    assert two["note"].startswith(
        "inference.mesh {'data': 1, 'fsdp': 1, 'expert': 1, 'tensor': 2} over 2 of 4 chips; KV "
        "pages "
    )
    # The cache dominates the arguments and splits over the 2 KV heads.
    assert two["argument_bytes"] < 0.6 * one["argument_bytes"]


def test_a_scanned_trainer_over_two_slices_counts_every_layer_at_half_the_rows_per_chip(reports):
    """mesh.slices = 2 on 2 x v5e:2x2 (libtpu's topology with num_slices=2) with scanned layers:
    the same micro-batch split over twice the chips (data 2 over the slices, fsdp 4 in each), so
    each chip's gradient step does about half the FLOPs of one slice's unrolled step (within 10%:
    the parameters' and optimizer's share per chip stays the same). XLA counts a loop body once,
    so the scanned program's FLOPs come from unrolled 1- and 2-layer compiles extrapolated to the
    preset's 4 layers."""
    one = _programs(reports, "local")["trainer.accumulate"]
    two = _programs(reports, "local-2slices-scan")["trainer.accumulate"]
    assert two["topology"] == "2xv5e:2x2" and one["topology"] == "v5e:2x2"
    assert "extrapolated to 4 layers" in two["note"]
    assert two["flops"] == pytest.approx(one["flops"] / 2, rel=0.10)


def _programs(reports: dict, name: str) -> dict[str, dict]:
    return {p["name"]: p for p in reports[name][2]["programs"]}


def test_the_planner_plans_from_the_checks_own_report(reports, tmp_path):
    """``python -m rlax_tpu.plan --aot`` on the local preset's real report: the decode step
    and the update are the report's rooflines over the efficiency factors."""
    from rlax_tpu.plan.command import plan
    from tests.config.test_validation import build

    _, _, report = reports["local"]
    path = tmp_path / "local.json"
    path.write_text(json.dumps(report))
    config = build({"inference.max_concurrent_seqs": 8})
    _, out = plan(
        config,
        trainer_topology="v5e:2x2",
        inference_topology="v5e:2x2",
        aot=[str(path)],
        efficiency=["train=0.25", "decode=0.5", "prefill=0.5"],
        workers=["1", "2"],
        steps=12,
    )
    roofline = {p["name"]: p["roofline_s"] for p in report["programs"]}
    costs = out["predictions"][0]["costs"]
    assert costs["detail"]["decode_step_s"] == pytest.approx(roofline["inference.decode"] / 0.5)
    # 64 rollouts of 128 + 24 tokens in micro-batches of 16 x 304 columns: 4 half-full ones.
    per_micro = roofline["trainer.accumulate"] + roofline["trainer.prefill_old"]
    fixed = roofline["trainer.prepare"] + roofline["trainer.apply"] + roofline["trainer.publish"]
    assert costs["detail"]["update_s"] == pytest.approx((fixed + 4 * 0.5 * per_micro) / 0.25)
    assert [p["workers"] for p in out["predictions"]] == [1, 2]
