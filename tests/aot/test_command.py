"""``python -m rlax_tpu.aot`` as users run it: the local preset and SmolLM2-135M's layer and vocab
shapes (2 of its 30 layers) compiled for v5e:2x2 and v5p:2x2x1 through libtpu, checked against HBM
and against a textbook count of FLOPs and optimizer bytes; oversized and mismatched configs
refused.

The compilations run as concurrent processes (one module fixture). The whole 30-layer SmolLM2
preset (6 minutes of compiles here, scanned, with its FLOPs counted by depth) and every TPU preset
compile in `python benchmarks/aot_presets.py` (benchmarks/RESULTS.md); here the local preset's
scanned trainer checks the counting by depth against its unrolled compile.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlax_tpu.cli import EXIT_USAGE

REPO = Path(__file__).resolve().parents[2]
TOPOLOGIES = ("v5e:2x2", "v5p:2x2x1")
CONFIGS = {"local": "configs/codeforces.py:local", "smollm2": "configs/smollm2_math.py:tpu"}
# SmolLM2's widths, heads and vocab at 2 layers, unrolled: its gradient step's compile is as
# the preset's layer and LM head make it, in a fifth of the preset's compile time.
SMOLLM2_LAYERS = 2
FLAGS = {"local": (), "smollm2": (f"--config.model.num_layers={SMOLLM2_LAYERS}",)}
COMPILED = [("local", t) for t in TOPOLOGIES] + [("smollm2", "v5e:2x2")]


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlax_tpu.aot", *args]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(_command(*args), cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """(config, topology) -> (exit code, stderr, parsed JSON report)."""
    out = tmp_path_factory.mktemp("aot")
    procs = {}
    for name, topo in COMPILED:
        path = out / f"{name}-{topo.replace(':', '_')}.json"
        cmd = _command(
            f"--config={CONFIGS[name]}", f"--topology={topo}", f"--json={path}", *FLAGS[name]
        )
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        procs[name, topo] = (proc, path)
    # The local preset's trainer with scanned layers (FLOPs counted by depth, see below).
    path = out / "local-scan.json"
    cmd = _command(
        f"--config={CONFIGS['local']}",
        "--topology=v5e:2x2",
        "--component=trainer",
        "--config.trainer.scan_layers=true",
        f"--json={path}",
    )
    procs["local-scan", "v5e:2x2"] = (
        subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        path,
    )
    results = {}
    for key, (proc, path) in procs.items():
        _, err = proc.communicate(timeout=500)  # inside pytest-timeout's 600 s
        results[key] = (
            proc.returncode,
            err,
            json.loads(path.read_text()) if path.exists() else None,
        )
    return results


# On TPU the aligned π_old is the prefill-shaped recompute (trainer.old_logprobs "auto").
EXPECTED = {
    "trainer.accumulate",
    "trainer.apply",
    "trainer.prepare",
    "trainer.prefill_old",
    "trainer.publish",
    "inference.decode",
    "inference.prefill",
    "inference.copy_pages",
}


def test_scanned_layers_compile_and_count_every_layer(reports):
    """trainer.scan_layers: the scanned programs fit, and since XLA counts a loop body once their
    FLOPs come from unrolled 1- and 2-layer compiles extrapolated to the depth: within 10% of
    the unrolled program's own count (the local preset's 4 layers, same micro-batch)."""
    code, err, scanned = reports["local-scan", "v5e:2x2"]
    assert code == 0, err[-3000:]
    _, _, unrolled = reports["local", "v5e:2x2"]
    got = {p["name"]: p for p in scanned["programs"]}
    want = {p["name"]: p for p in unrolled["programs"]}
    for name in ("trainer.accumulate", "trainer.prefill_old"):
        assert got[name]["status"] == "fits"
        assert "extrapolated to 4 layers" in got[name]["note"]
        assert got[name]["flops"] == pytest.approx(want[name]["flops"], rel=0.10), name


@pytest.mark.parametrize(("config", "topology"), COMPILED)
def test_every_program_compiles_and_fits(reports, config, topology):
    code, err, report = reports[config, topology]
    assert code == 0, err[-3000:]
    programs = {p["name"]: p for p in report["programs"]}
    # SmolLM2's GRPO preset has a KL term, so a reference model to score.
    assert set(programs) == EXPECTED | ({"trainer.score_ref"} if config == "smollm2" else set())
    usable = report["devices"][topology]["usable_hbm_bytes"]
    for p in programs.values():
        assert p["status"] == "fits", p
        assert 0 < p["peak_bytes"] <= usable and p["hbm_bytes"] == usable
        assert p["argument_bytes"] > 0 and p["bytes_accessed"] > 0 and p["roofline_s"] > 0
    assert programs["trainer.accumulate"]["flops"] > 0


def _smollm2_counts(devices: int) -> tuple[float, float]:
    """Textbook FLOPs of one gradient step on the preset's largest micro-batch, per device, and
    the parameter count. Remat'd layers run forward twice, backward costs two forwards; the LM
    head runs on the completion positions only and is not remat'd. Attention runs in the splash
    kernel on TPU (trainer.attention auto), and a Pallas kernel declares no FLOPs to XLA, so
    the count leaves the scores out."""
    vocab, e, f, layers, h, hkv, d = 49152, 576, 1536, SMOLLM2_LAYERS, 9, 3, 64
    rows, length, width = 16, 448, 256  # micro_batch_size; 192 + 256 prompt + completion tokens
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
    _, _, report = reports["smollm2", "v5e:2x2"]
    programs = {p["name"]: p for p in report["programs"]}
    flops, params = _smollm2_counts(devices=4)
    assert programs["trainer.accumulate"]["flops"] == pytest.approx(flops, rel=0.10)
    optimizer_bytes = 4 * params * 4 / 4
    assert optimizer_bytes <= programs["trainer.apply"]["argument_bytes"] <= 1.25 * optimizer_bytes


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


def test_the_engine_compiles_on_its_mesh(tmp_path):
    """inference.mesh lays the engine over the slice's chips: weights and pages split over the
    tensor axis, so each chip's arguments shrink (the tiny model's 2 KV heads, 4 query heads)."""
    reports = {}
    for tensor in (1, 2):
        path = tmp_path / f"t{tensor}.json"
        out = run(
            "--config=configs/codeforces.py:local",
            "--topology=v5e:2x2",
            "--component=inference",
            f"--config.inference.mesh.tensor={tensor}",
            f"--json={path}",
        )
        assert out.returncode == 0, out.stderr[-2000:]
        reports[tensor] = {p["name"]: p for p in json.loads(path.read_text())["programs"]}
    one, two = reports[1]["inference.decode"], reports[2]["inference.decode"]
    assert one["note"].startswith("one chip of 4")
    assert two["note"] == "inference.mesh {'data': 1, 'fsdp': 1, 'tensor': 2} over 2 of 4 chips"
    # The cache dominates the arguments and splits over the 2 KV heads.
    assert two["argument_bytes"] < 0.6 * one["argument_bytes"]
