"""``python -m rlax_tpu.aot`` as users run it, through libtpu and checked against HBM: the local
preset compiled for v5e:2x2 (every program) and v5p:2x2x1 (the engine), its engine laid over two
chips and its trainer over two v5e:2x2 slices; oversized and mismatched configs refused; and
compiled FLOPs and bytes against independent counts:

* SmolLM2-135M's layer and vocab shapes (2 of its 30 layers, unrolled, a 4-row micro-batch of
  256 tokens) for v5e:2x2: the gradient step against a textbook count of FLOPs, the optimizer
  update against its bytes;
* the local preset's trainer with scanned layers against its unrolled compile (XLA counts a loop
  body once, so the scanned count is extrapolated by depth).

Every compilation runs once, as concurrent processes started by one module fixture (about 2.5
minutes of CPU). The whole 30-layer SmolLM2 preset and every TPU preset compile in
`python benchmarks/aot_presets.py` (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlax_tpu.cli import EXIT_USAGE
from tests.child_env import FAST_COMPILE

# The compiles run in the first test that asks for them (about 2.5 minutes of CPU on 2 cores).
pytestmark = pytest.mark.timeout(900)
REPO = Path(__file__).resolve().parents[2]
LOCAL = "configs/codeforces.py:local"
TRAINER_ONLY = "--component=trainer"
# SmolLM2's shapes at 2 layers and a micro-batch of 4 rows x (192 + 64) tokens: its full micro-
# batch (16 x 448) takes 90 s of CPU to compile, this 40 s.
SMOLLM2 = {"layers": 2, "rows": 4, "prompt": 192, "completion": 64}
# name -> (config, topology, extra flags): each compiled once, concurrently, by the module fixture.
COMPILES = {
    "local": (LOCAL, "v5e:2x2", ()),
    # The engine on v5p (its own chip spec and HBM); the trainer is the same program.
    "local-v5p": (LOCAL, "v5p:2x2x1", ("--component=inference",)),
    # The engine over 2 of the 4 chips (tensor-parallel).
    "local-tensor2": (
        LOCAL,
        "v5e:2x2",
        ("--component=inference", "--config.inference.mesh.tensor=2"),
    ),
    # The trainer over two slices joined by DCN (multislice; data-parallel across them).
    "local-2slices": (LOCAL, "v5e:2x2", (TRAINER_ONLY, "--config.mesh.slices=2")),
    "local-scan": (LOCAL, "v5e:2x2", (TRAINER_ONLY, "--config.trainer.scan_layers=true")),
    "smollm2": (
        "configs/smollm2_math.py:tpu",
        "v5e:2x2",
        (
            TRAINER_ONLY,
            f"--config.model.num_layers={SMOLLM2['layers']}",
            f"--config.trainer.micro_batch_size={SMOLLM2['rows']}",
            f"--config.inference.max_prompt_len={SMOLLM2['prompt']}",
            f"--config.inference.max_new_tokens={SMOLLM2['completion']}",
        ),
    ),
}


# As users run it: without the suite's CPU-compile shortcut (tests/conftest.py), which XLA
# would also apply to the TPU compiles.
ENV = os.environ | {"XLA_FLAGS": os.environ["XLA_FLAGS"].replace(FAST_COMPILE, "")}


def aot_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlax_tpu.aot", *args]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        aot_command(*args), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600
    )


def compile_all(
    out: Path, compiles: dict[str, tuple[str, str, tuple[str, ...]]], timeout_s: float
) -> dict[str, tuple[int, str, dict | None]]:
    """Runs ``name -> (config, topology, flags)`` as concurrent ``python -m rlax_tpu.aot``
    processes; name -> (exit code, stderr, parsed JSON report)."""
    procs = {}
    for name, (config, topology, flags) in compiles.items():
        path = out / f"{name}.json"
        cmd = aot_command(f"--config={config}", f"--topology={topology}", f"--json={path}", *flags)
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        procs[name] = (proc, path)
    results = {}
    for name, (proc, path) in procs.items():
        _, err = proc.communicate(timeout=timeout_s)
        report = json.loads(path.read_text()) if path.exists() else None
        results[name] = (proc.returncode, err, report)
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
    # SmolLM2's GRPO has a KL term, so a reference model to score.
    assert set(programs) == want | ({"trainer.score_ref"} if name == "smollm2" else set())
    if "trainer.accumulate" in programs:
        assert programs["trainer.accumulate"]["flops"] > 0


def test_an_oversized_cache_is_refused_with_one_line_per_program():
    out = run(
        "--config=configs/codeforces.py:local",
        "--topology=v5e:2x2",
        "--component=inference",
        f"--config.inference.kv_cache_bytes={40 * 2**30}",
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


def test_the_engine_compiles_on_its_mesh(reports):
    """inference.mesh lays the engine over the slice's chips: weights and pages split over the
    tensor axis, so each chip's arguments shrink (the tiny model's 2 KV heads, 4 query heads)."""
    one, two = (
        {p["name"]: p for p in reports[name][2]["programs"]}["inference.decode"]
        for name in ("local", "local-tensor2")
    )
    assert one["note"].startswith("one chip of 4")
    assert two["note"].startswith(
        "inference.mesh {'data': 1, 'fsdp': 1, 'tensor': 2} over 2 of 4 chips; KV pages "
    )
    # The cache dominates the arguments and splits over the 2 KV heads.
    assert two["argument_bytes"] < 0.6 * one["argument_bytes"]


def test_a_trainer_over_two_slices_compiles_with_half_the_rows_per_chip(reports):
    """mesh.slices = 2 on 2 x v5e:2x2 (libtpu's topology with num_slices=2): the same
    micro-batch split over twice the chips (data 2 over the slices, fsdp 4 in each), so each
    chip's gradient step does about half the FLOPs of one slice's (within 10%: the parameters'
    and optimizer's share per chip stays the same)."""
    one, two = (
        {p["name"]: p for p in reports[name][2]["programs"]}["trainer.accumulate"]
        for name in ("local", "local-2slices")
    )
    assert two["topology"] == "2xv5e:2x2" and one["topology"] == "v5e:2x2"
    assert two["flops"] == pytest.approx(one["flops"] / 2, rel=0.10)


def _programs(reports: dict, name: str) -> dict[str, dict]:
    return {p["name"]: p for p in reports[name][2]["programs"]}


def test_scanned_layers_compile_and_count_every_layer(reports):
    """trainer.scan_layers: the scanned programs fit, and since XLA counts a loop body once their
    FLOPs come from unrolled 1- and 2-layer compiles extrapolated to the depth: within 10% of
    the unrolled program's own count (the local preset's 4 layers, same micro-batch)."""
    got, want = _programs(reports, "local-scan"), _programs(reports, "local")
    assert set(got) == TRAINER and set(want) >= TRAINER
    for name in ("trainer.accumulate", "trainer.prefill_old"):
        assert "extrapolated to 4 layers" in got[name]["note"]
        assert got[name]["flops"] == pytest.approx(want[name]["flops"], rel=0.10), name


def _smollm2_counts(devices: int) -> tuple[float, float]:
    """Textbook FLOPs of one gradient step on the SMOLLM2 micro-batch, per device, and the
    parameter count. Remat'd layers run forward twice, backward costs two forwards; the LM
    head runs on the completion positions only and is not remat'd. Attention runs in the splash
    kernel on TPU (trainer.attention auto), and a Pallas kernel declares no FLOPs to XLA, so
    the count leaves the scores out."""
    vocab, e, f, layers, h, hkv, d = 49152, 576, 1536, SMOLLM2["layers"], 9, 3, 64
    rows, width = SMOLLM2["rows"], SMOLLM2["completion"]
    length = SMOLLM2["prompt"] + width
    per_layer = e * h * d + 2 * e * hkv * d + h * d * e + 3 * e * f
    layer_fwd = 2 * rows * length * per_layer
    head_fwd = 2 * rows * width * e * vocab
    flops = (4 * layers * layer_fwd + 3 * head_fwd) / devices
    params = vocab * e + layers * (per_layer + 2 * e) + e
    return flops, params


def test_smollm2_step_matches_a_textbook_count(reports):
    """The compiled gradient step's FLOPs are the textbook count's to 10% (elementwise ops and
    the softmax add a few percent); the optimizer update's arguments are parameters, gradients
    and AdamW's two moments in f32, split over the 4 chips, plus TPU tile padding (the
    [144, 3, 64] shards of k_proj/v_proj pad to [144, 8, 128]): within +25%."""
    programs = _programs(reports, "smollm2")
    assert (
        "micro-batch [4 rows, 256 tokens, 64 completion]" in programs["trainer.accumulate"]["note"]
    )
    flops, params = _smollm2_counts(devices=4)
    assert programs["trainer.accumulate"]["flops"] == pytest.approx(flops, rel=0.10)
    optimizer_bytes = 4 * params * 4 / 4
    assert optimizer_bytes <= programs["trainer.apply"]["argument_bytes"] <= 1.25 * optimizer_bytes
