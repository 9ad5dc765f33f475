"""``python -m rlax_tpu.aot`` on SmolLM2-135M's layer and vocab shapes (2 of its 30 layers,
unrolled, a 4-row micro-batch of 256 tokens) for v5e:2x2: the compiled gradient step against a
textbook count of FLOPs, the optimizer update against its bytes. The largest compile of the
suite (about 25 s of CPU), so a module and a timeout of its own; the whole 30-layer preset
compiles in `python benchmarks/aot_presets.py`.

Cost: 66 CPU-s in a clean `make test` on a 2-core AMD EPYC (2026-12-03; its process's start,
libtpu's initialization and the two compiles, under -n 3): TPU programs cannot come from the
CPU tests' cache."""

from __future__ import annotations

import pytest

from tests.aot.test_command import TRAINER_ONLY, check_fits, compile_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
# SmolLM2's shapes at 2 layers and a micro-batch of 4 rows x (192 + 64) tokens: its full micro-
# batch (16 x 448) takes 90 s of CPU to compile, this 25 s.
SMOLLM2 = {"layers": 2, "rows": 4, "prompt": 192, "completion": 64}
PROGRAMS = ("trainer.accumulate", "trainer.apply")


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> dict[str, dict]:
    """The two programs' reports by name, each asserted to fit."""
    flags = (
        TRAINER_ONLY,
        f"--programs={','.join(PROGRAMS)}",
        f"--config.model.num_layers={SMOLLM2['layers']}",
        f"--config.trainer.micro_batch_size={SMOLLM2['rows']}",
        f"--config.inference.max_prompt_len={SMOLLM2['prompt']}",
        f"--config.inference.max_new_tokens={SMOLLM2['completion']}",
    )
    compiles = {"smollm2": ("configs/smollm2_math.py:tpu", "v5e:2x2", flags)}
    code, err, report = compile_all(tmp_path_factory.mktemp("aot"), compiles, timeout_s=350)[
        "smollm2"
    ]
    assert code == 0, err[-3000:]
    got = check_fits(report, "v5e:2x2")
    assert set(got) == set(PROGRAMS)
    return got


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


def test_smollm2_step_matches_a_textbook_count(programs):
    """The compiled gradient step's FLOPs are the textbook count's to 10% (elementwise ops and
    the softmax add a few percent); the optimizer update's arguments are parameters, gradients
    and AdamW's two moments in f32, split over the 4 chips, plus TPU tile padding (the
    [144, 3, 64] shards of k_proj/v_proj pad to [144, 8, 128]): within +25%."""
    assert (
        "micro-batch [4 rows, 256 tokens, 64 completion]" in programs["trainer.accumulate"]["note"]
    )
    flops, params = _smollm2_counts(devices=4)
    assert programs["trainer.accumulate"]["flops"] == pytest.approx(flops, rel=0.10)
    optimizer_bytes = 4 * params * 4 / 4
    assert optimizer_bytes <= programs["trainer.apply"]["argument_bytes"] <= 1.25 * optimizer_bytes
