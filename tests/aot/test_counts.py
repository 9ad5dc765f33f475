"""Compiled TPU programs' FLOPs and bytes against independent counts (slow: about two minutes
of CPU, its compiles run concurrently by one module fixture):

* SmolLM2-135M's layer and vocab shapes (2 of its 30 layers, unrolled) for v5e:2x2: the gradient
  step against a textbook count of FLOPs, the optimizer update against its bytes;
* the local preset's trainer with scanned layers against its unrolled compile (XLA counts a loop
  body once, so the scanned count is extrapolated by depth).

The whole 30-layer SmolLM2 preset (6 minutes of compiles here) and every TPU preset compile in
`python benchmarks/aot_presets.py` (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import pytest

from .test_command import LOCAL, TRAINER, check_fits, compile_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SMOLLM2_LAYERS = 2
TRAINER_ONLY = ("--component=trainer",)
COMPILES = {
    "smollm2": (
        "configs/smollm2_math.py:tpu",
        "v5e:2x2",
        (*TRAINER_ONLY, f"--config.model.num_layers={SMOLLM2_LAYERS}"),
    ),
    "local": (LOCAL, "v5e:2x2", TRAINER_ONLY),
    "local-scan": (LOCAL, "v5e:2x2", (*TRAINER_ONLY, "--config.trainer.scan_layers=true")),
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """name of COMPILES -> (exit code, stderr, parsed JSON report), each asserted to fit."""
    out = compile_all(tmp_path_factory.mktemp("aot"), COMPILES, timeout_s=800)
    for name, (code, err, report) in out.items():
        assert code == 0, (name, err[-3000:])
        check_fits(report, COMPILES[name][1])
    return {
        name: {p["name"]: p for p in report["programs"]} for name, (_, _, report) in out.items()
    }


def test_scanned_layers_compile_and_count_every_layer(reports):
    """trainer.scan_layers: the scanned programs fit, and since XLA counts a loop body once their
    FLOPs come from unrolled 1- and 2-layer compiles extrapolated to the depth: within 10% of
    the unrolled program's own count (the local preset's 4 layers, same micro-batch)."""
    got, want = reports["local-scan"], reports["local"]
    assert set(got) == set(want) == TRAINER
    for name in ("trainer.accumulate", "trainer.prefill_old"):
        assert "extrapolated to 4 layers" in got[name]["note"]
        assert got[name]["flops"] == pytest.approx(want[name]["flops"], rel=0.10), name


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
    [144, 3, 64] shards of k_proj/v_proj pad to [144, 8, 128]): within +25%. Its GRPO has a KL
    term, so a reference model to score."""
    programs = reports["smollm2"]
    assert set(programs) == TRAINER | {"trainer.score_ref"}
    flops, params = _smollm2_counts(devices=4)
    assert programs["trainer.accumulate"]["flops"] == pytest.approx(flops, rel=0.10)
    optimizer_bytes = 4 * params * 4 / 4
    assert optimizer_bytes <= programs["trainer.apply"]["argument_bytes"] <= 1.25 * optimizer_bytes
