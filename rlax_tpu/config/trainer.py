"""The trainer section."""

from __future__ import annotations

import dataclasses
from typing import Literal

from rlax_tpu.config.checks import bad, check_address, frozen, in_range, non_negative, positive
from rlax_tpu.config.mesh import DistributedConfig


@frozen
class TrainerConfig:
    learning_rate: float = 1e-6  # AdamW peak learning rate
    # Learning-rate schedule over controller.num_steps.
    schedule: Literal["constant", "warmup_cosine", "warmup_stable_decay"] = "constant"
    warmup_steps: int = 0  # linear warm-up updates of the schedule
    decay_steps: int = 0  # for warmup_stable_decay: length of the final decay
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    adam_b1: float = 0.9  # AdamW beta1
    adam_b2: float = 0.999  # AdamW beta2
    adam_eps: float = 1e-8  # AdamW epsilon
    grad_clip_norm: float = 1.0  # global gradient-norm clip; 0 disables clipping
    micro_batch_size: int = 8  # rollouts per micro-batch (gradient accumulation)
    length_bucket: int = 16  # micro-batch lengths are padded to a multiple (bounds recompiles)
    # Compile the update for every micro-batch shape the inference limits allow during the first
    # step, so later steps never stall on a compile (costs one compile per shape up front).
    precompile: bool = False
    remat: bool = True  # each layer of the training forward under jax.checkpoint(remat_policy)
    # "nothing_saveable" keeps only layer inputs, so the forward fuses as at inference (RLAX §5).
    remat_policy: Literal[
        "nothing_saveable",
        "dots_saveable",
        "dots_with_no_batch_dims_saveable",
        "everything_saveable",
    ] = "nothing_saveable"
    # The trainer's forwards as one lax.scan over stacked layer parameters: one compiled layer
    # body whatever the depth (compile time and program size stay flat), at the price of one
    # copy of the layer parameters per call, in the compute dtype (the MoE's experts as
    # stored). Off: layers unrolled.
    scan_layers: bool = False
    # The training forward's attention: "splash" (JAX's TPU splash kernel: memory linear in the
    # sequence), "dense" (materializes [L, L] scores; the CPU reference), "auto" (splash on TPU).
    attention: Literal["auto", "dense", "splash"] = "auto"
    align_logprobs: bool = True  # recompute π_old with the inference graph (DESIGN §6)
    # How the aligned π_old is recomputed. "replay": token by token through the engine's own
    # programs at its shapes (bitwise the sampler's log-probs on CPU; cost grows with the
    # completion length and holds an engine-sized cache). "prefill": one prefill-shaped pass
    # per micro-batch on the trainer's mesh through the engine's paged-attention backend (the
    # ragged kernel on TPU; RLAX §5.1), to round-off. "auto": replay on CPU, prefill elsewhere.
    old_logprobs: Literal["auto", "replay", "prefill"] = "auto"
    # Routing replay (a mixture-of-experts model): the trainer's forwards use the experts the
    # inference worker chose for each token (TrainBatch.routes) instead of their own router's
    # top k, so a router that rounds differently cannot send a token elsewhere. "old": the π_old
    # forward only; "both": π_old and the π_θ training forward; "off": neither. (The CPU
    # "replay" π_old runs the engine's own programs, so its routes are the engine's anyway.)
    routing_replay: Literal["off", "old", "both"] = "off"
    # Publish dtype: the weights pushed to the parameter server (what inference workers pull).
    publish_dtype: Literal["float32", "bfloat16"] = "float32"
    # Versions whose push to the parameter server may still be under way while the next step
    # computes (0: each step returns once its version is published). Each holds a cast of the
    # weights on the devices; the controller lets workers load a version once it is published
    # (with param_server.fanout "relay" over gRPC, they receive it meanwhile, relayed as the
    # parameter server receives it). 0 or 1.
    publish_in_flight: int = 0
    # Master dtype: the trainer's trainable weights, AdamW moments and gradient accumulator,
    # whatever model.param_dtype is (mixed precision: float32 masters, model.compute_dtype
    # forward and backward). bfloat16 masters are refused when most AdamW steps of about
    # learning_rate would round to nothing (trainer/precision.py).
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    checkpoint_every: int = 1  # save an Orbax checkpoint every N versions
    # At least controller.snapshot_keep / checkpoint_every, so every kept snapshot has its
    # checkpoint (or an older one a resume falls back to).
    keep_checkpoints: int = 3
    checkpoint_dir: str = ""  # "" means <controller.run_dir>/trainer
    # Non-finite loss/grads: 'skip' drops the update, 'stop' halts.
    nan_policy: Literal["skip", "stop"] = "stop"
    # A trainer spanning several hosts (its mesh over all their devices): process 0 serves, the
    # others follow its calls (trainer/lockstep.py).
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    address: str = "127.0.0.1:0"  # gRPC address the trainer serves on (distributed transport)
    auth_token_file: str = ""  # file holding the token callers must present; needed off loopback
    tls_cert_file: str = ""  # PEM certificate and key to serve TLS with; '' plain

    def __post_init__(self) -> None:
        positive(self, "learning_rate", "micro_batch_size", "checkpoint_every", "keep_checkpoints")
        positive(self, "length_bucket")
        in_range(self, "publish_in_flight", 0, 1)  # one push at a time: the sink is not shared
        non_negative(self, "warmup_steps", "decay_steps", "weight_decay", "grad_clip_norm")
        positive(self, "adam_eps")
        in_range(self, "adam_b1", 0.0, 1.0, hi_open=True)
        in_range(self, "adam_b2", 0.0, 1.0, hi_open=True)
        if self.schedule == "warmup_stable_decay" and self.decay_steps == 0:
            raise bad(self, "decay_steps", "must be > 0 for the warmup_stable_decay schedule")
        check_address(self, "address", self.auth_token_file, self.tls_cert_file)
