"""Every validation rule of rlax_tpu.config, each with a bad input and the exact error it gets."""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path

import pytest

from rlax_tpu import config as C
from rlax_tpu.config import ConfigError, MeshConfig, RunConfig, from_dict

REPO = Path(__file__).resolve().parents[2]


def _codeforces():
    spec = importlib.util.spec_from_file_location(
        "codeforces_cfg", REPO / "configs" / "codeforces.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def local_dict() -> dict:
    return _codeforces().get_config("local").to_dict()


def build(overrides: dict[str, object], base: dict | None = None) -> RunConfig:
    """The local preset with dotted-path overrides applied, validated."""
    d = copy.deepcopy(base if base is not None else local_dict())
    for path, value in overrides.items():
        node = d
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return from_dict(RunConfig, d)


def expect_error(overrides: dict[str, object], message: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        build(overrides)
    assert str(info.value) == message
    return info.value


# --------------------------------------------------------------------------------------------
# Presets


def test_smollm2_math_presets_validate_and_find_the_packaged_weights():
    spec = importlib.util.spec_from_file_location(
        "smollm2_cfg", REPO / "configs" / "smollm2_math.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for preset in mod.PRESETS:
        cfg = from_dict(RunConfig, mod.get_config(preset))
        assert cfg.model.weights_format == "gguf" and Path(cfg.model.weights_path).is_file()
        assert cfg.data.datasets == (mod.TWO_TERM_SUMS,)
    code = from_dict(RunConfig, _codeforces().get_config("smollm2"))
    assert code.model.weights_path == cfg.model.weights_path and code.data.datasets == (
        "functions",
    )
    assert code.prompt_style == "chat" and code.controller.warmup_steps == 0


def test_presets_validate():
    mod = _codeforces()
    local = from_dict(RunConfig, mod.get_config("local"))
    raw = mod.get_config("v5p")
    with pytest.raises(
        ConfigError,
        match=r"controller.bucket = '': required by .*model.weights_path "
        r"= '\{bucket\}/QwQ-32B'.*--config.controller.bucket=gs://my-bucket",
    ):
        from_dict(RunConfig, raw)
    raw.controller.bucket = "gs://rl-runs/"
    v5p = from_dict(RunConfig, raw)
    assert v5p.model.weights_path == "gs://rl-runs/QwQ-32B"
    assert v5p.controller.run_dir == "gs://rl-runs/runs/codeforces"
    assert v5p.data.data_dir == "gs://rl-runs/codeforces"
    assert v5p.param_server.persist_path == "gs://rl-runs/runs/codeforces/ps"
    assert local.preset == "local" and v5p.preset == "v5p"
    assert local.controller.transport == "local" and local.inference.backend == "auto"
    assert (v5p.controller.reload_staleness, v5p.controller.acceptance_staleness) == (16, 32)
    assert (
        v5p.model.arch == "qwen2" and v5p.model.hidden_size == 5120 and v5p.model.num_layers == 64
    )
    assert v5p.rollouts_per_step == v5p.controller.prompts_per_step * v5p.algorithm.group_size


def test_unknown_preset():
    with pytest.raises(
        ValueError, match=re.escape("unknown preset 'v6e' for configs/codeforces.py")
    ):
        _codeforces().get_config("v6e")


def test_default_preset_fits_this_cpu_machine():
    assert C.detect_accelerator() == "cpu"
    assert _codeforces().get_config().preset == "local"


def test_config_dict_is_locked_so_config_file_typos_fail_where_made():
    cfg = C.base_config_dict()
    with pytest.raises(AttributeError, match="learnig_rate"):
        cfg.trainer.learnig_rate = 1.0


def test_defaults_round_trip_and_diff():
    cfg = build({})
    assert from_dict(RunConfig, C.to_dict(cfg)) == cfg
    other = build({"trainer.learning_rate": 0.5, "controller.num_steps": 3})
    assert C.diff(cfg, other) == ["controller.num_steps", "trainer.learning_rate"]
    assert C.diff(cfg, cfg) == []


def test_configs_are_frozen_and_keyword_only():
    cfg = build({})
    with pytest.raises(AttributeError):
        cfg.trainer.learning_rate = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        C.TrainerConfig(1e-3)  # type: ignore[misc]


def test_int_is_accepted_for_float_fields():
    assert build({"trainer.learning_rate": 1}).trainer.learning_rate == 1.0


# --------------------------------------------------------------------------------------------
# Keys and types


@pytest.mark.parametrize(
    "data, message",
    [
        ({"bogus": 1}, "bogus: unknown field"),
        (
            {"trainer": {"learnig_rate": 1.0}},
            "trainer.learnig_rate: unknown field; did you mean 'learning_rate'?",
        ),
        ({"trainer": 3}, "trainer = 3: expected a section (mapping), got int"),
        (
            {"controller": {"num_steps": 2.5}},
            "controller.num_steps = 2.5: expected an int, got float",
        ),
        (
            {"controller": {"num_steps": True}},
            "controller.num_steps = True: expected an int, got bool",
        ),
        (
            {"trainer": {"learning_rate": "fast"}},
            "trainer.learning_rate = 'fast': expected a float, got str",
        ),
        (
            {"trainer": {"learning_rate": float("nan")}},
            "trainer.learning_rate = nan: must be a number",
        ),
        ({"controller": {"run_dir": 5}}, "controller.run_dir = 5: expected a str, got int"),
        ({"trainer": {"remat": 1}}, "trainer.remat = 1: expected a bool, got int"),
        (
            {"model": {"arch": "mistral"}},
            "model.arch = 'mistral': must be one of 'llama', 'qwen2', 'qwen3', 'qwen3_moe', "
            "'mixtral'; did you mean 'mixtral'?",
        ),
        (
            {"controller": {"mode": "determinstic"}},
            "controller.mode = 'determinstic': must be one of 'deterministic', 'throughput'; "
            "did you mean 'deterministic'?",
        ),
        (
            {"data": {"datasets": "procedural"}},
            "data.datasets = 'procedural': expected a tuple, got str",
        ),
        (
            {"data": {"datasets": ("a", "b"), "weights": (1.0, "x")}},
            "data.weights[1] = 'x': expected a float, got str",
        ),
    ],
)
def test_keys_and_types(data, message):
    with pytest.raises(ConfigError) as info:
        from_dict(RunConfig, data)
    assert str(info.value) == message


def test_error_carries_the_field_path():
    err = expect_error({"trainer.learning_rate": -1.0}, "trainer.learning_rate = -1.0: must be > 0")
    assert err.field == "trainer.learning_rate" and err.value == -1.0


# --------------------------------------------------------------------------------------------
# Ranges: every field that must be > 0 or >= 0.

POSITIVE = {
    "model": [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "rope_theta",
        "max_position_embeddings",
        "rms_norm_eps",
    ],
    "trainer": [
        "learning_rate",
        "micro_batch_size",
        "checkpoint_every",
        "keep_checkpoints",
        "adam_eps",
    ],
    "inference": [
        "num_workers",
        "max_concurrent_seqs",
        "page_size",
        "kv_cache_bytes",
        "prefill_chunk",
        "prefill_len",
        "max_prompt_len",
        "max_new_tokens",
        "temperature",
    ],
    "param_server": ["chunk_bytes", "max_message_bytes", "replicas"],
    "verifiers": [
        "workers",
        "max_pending",
        "time_limit_s",
        "memory_limit_mb",
        "compile_time_limit_s",
        "max_output_bytes",
        "request_deadline_s",
    ],
    "data": [
        "eval_samples",
        "eval_problems",
        "replay_recent_versions",
        "replay_temperature",
        "replay_per_prompt",
        "replay_max_items",
    ],
    "algorithm": ["group_size", "behaviour_cap", "overlong_penalty", "tb_beta", "dpo_beta"],
    "controller": [
        "num_steps",
        "prompts_per_step",
        "reload_staleness",
        "rpc_timeout_s",
        "snapshot_keep",
        "log_every",
    ],
}
NON_NEGATIVE = {
    "model": ["head_dim"],
    "trainer": ["warmup_steps", "decay_steps", "weight_decay", "grad_clip_norm"],
    "inference": ["top_k", "prefill_rows", "span_groups"],
    "param_server": ["persist_every"],
    "data": ["eval_every"],
    "algorithm": ["eps_high", "kl_coef", "is_cap", "overlong_buffer", "value_clip"],
    "controller": ["pipeline_depth"],
}


def _numeric_bad(section: str, name: str, value: float):
    default = C.to_dict(RunConfig())[section][name]
    return float(value) if isinstance(default, float) else int(value)


@pytest.mark.parametrize("section, name", [(s, n) for s, names in POSITIVE.items() for n in names])
def test_must_be_positive(section, name):
    bad = _numeric_bad(section, name, 0)
    expect_error({f"{section}.{name}": bad}, f"{section}.{name} = {bad!r}: must be > 0")


@pytest.mark.parametrize(
    "section, name", [(s, n) for s, names in NON_NEGATIVE.items() for n in names]
)
def test_must_be_non_negative(section, name):
    bad = _numeric_bad(section, name, -1)
    expect_error({f"{section}.{name}": bad}, f"{section}.{name} = {bad!r}: must be >= 0")


@pytest.mark.parametrize(
    "path, value, message",
    [
        ("trainer.adam_b1", 1.0, "trainer.adam_b1 = 1.0: must be in [0.0, 1.0)"),
        ("trainer.adam_b2", -0.1, "trainer.adam_b2 = -0.1: must be in [0.0, 1.0)"),
        ("inference.top_p", 0.0, "inference.top_p = 0.0: must be in (0, 1]"),
        ("inference.top_p", 1.5, "inference.top_p = 1.5: must be in (0, 1]"),
        ("data.replay_recency_prob", 1.5, "data.replay_recency_prob = 1.5: must be in [0.0, 1.0]"),
        ("algorithm.eps_low", 1.0, "algorithm.eps_low = 1.0: must be in [0.0, 1.0)"),
        ("algorithm.gamma", 1.1, "algorithm.gamma = 1.1: must be in [0.0, 1.0]"),
        ("algorithm.gae_lambda", -0.5, "algorithm.gae_lambda = -0.5: must be in [0.0, 1.0]"),
        (
            "controller.warmup_wrong_fraction",
            1.0,
            "controller.warmup_wrong_fraction = 1.0: must be in [0.0, 1.0)",
        ),
        ("model.rope_scaling_factor", 0.5, "model.rope_scaling_factor = 0.5: must be >= 1"),
        ("mesh.data", 0, "mesh.data = 0: must be >= 1, or -1 for 'the remaining devices'"),
        ("mesh.tensor", -2, "mesh.tensor = -2: must be >= 1, or -1 for 'the remaining devices'"),
        (
            "inference.mesh.fsdp",
            2,
            "inference.mesh.fsdp = 2: must be 1: an inference worker would all-gather its "
            "fsdp-sharded weights at every decode step; split them over mesh.tensor, or add "
            "workers",
        ),
        (
            "controller.acceptance_staleness",
            -2,
            "controller.acceptance_staleness = -2: must be >= 0, or -1 for unbounded",
        ),
        ("controller.run_dir", "", "controller.run_dir = '': must be set"),
        (
            "verifiers.sandbox_uid",
            0,
            "verifiers.sandbox_uid = 0: must not be 0: untrusted code never runs as root",
        ),
        ("verifiers.languages", (), "verifiers.languages = (): must name at least one language"),
        (
            "verifiers.languages",
            ("python", "go"),
            "verifiers.languages = ('python', 'go'): unknown language 'go'; supported: python, cpp, rust, java",
        ),
        ("data.weights", (1.0,), "data.weights = (1.0,): needs one weight per dataset (2), got 1"),
        ("data.weights", (1.0, 0.0), "data.weights = (1.0, 0.0): every mixture weight must be > 0"),
        (
            "param_server.in_memory_versions",
            1,
            "param_server.in_memory_versions = 1: must be >= 2 (a new version is written while the previous is read)",
        ),
        (
            "param_server.fanout",
            "tree",
            "param_server.fanout = 'tree': must be 'replicas' or 'relay', got 'tree'",
        ),
        (
            "algorithm.name",
            "grop",
            "algorithm.name = 'grop': unknown algorithm; did you mean 'grpo'?",
        ),
        (
            "algorithm.name",
            "zzz",
            "algorithm.name = 'zzz': unknown algorithm; built-in: grpo, dapo, dr_grpo, gspo, "
            "cispo, reinforce, rloo, reinforce_pp, ppo, aipo, tb, online_dpo, sapo, luspo, vespo "
            "(an algorithm of your own: name the module that registers it in algorithm.plugins)",
        ),
    ],
)
def test_value_rules(path, value, message):
    expect_error({path: value}, message)


def test_empty_datasets():
    expect_error(
        {"data.datasets": (), "data.weights": ()},
        "data.datasets = (): must name at least one dataset",
    )


# --------------------------------------------------------------------------------------------
# Inconsistent combinations inside one component.


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"model.num_heads": 4, "model.num_kv_heads": 3},
            "model.num_kv_heads = 3: must divide num_heads (4) for grouped-query attention",
        ),
        (
            {"model.hidden_size": 130},
            "model.hidden_size = 130: must be divisible by num_heads (4) when head_dim is 0",
        ),
        (
            {"model.rope_scaling_factor": 2.0},
            "model.rope_scaling_factor = 2.0: is set but rope_scaling is 'none'",
        ),
        (
            {"model.weights_format": "gguf"},
            "model.weights_path = '': required when weights_format is 'gguf'",
        ),
        (
            {"mesh.data": -1, "mesh.fsdp": -1},
            "mesh: at most one of data, fsdp, expert, tensor may be -1",
        ),
        (
            {"trainer.schedule": "warmup_stable_decay"},
            "trainer.decay_steps = 0: must be > 0 for the warmup_stable_decay schedule",
        ),
        (
            {"param_server.chunk_bytes": 2**27},
            "param_server.chunk_bytes = 134217728: must be <= max_message_bytes (67108864)",
        ),
        (
            {"algorithm.kl_coef": 0.05},
            "algorithm.kl_estimator = 'none': is 'none' but kl_coef is 0.05; pick k1, k2 or k3",
        ),
        (
            {"algorithm.name": "rloo", "algorithm.group_size": 1, "trainer.micro_batch_size": 8},
            "algorithm.group_size = 1: rloo compares samples within a group: needs >= 2",
        ),
        (
            {"controller.reload_staleness": 4, "controller.acceptance_staleness": 2},
            "controller.acceptance_staleness = 2: can never be met with reload_staleness 4: workers "
            "hold a version for 4 updates, so the trainer would need rollouts 3 versions old; set "
            "acceptance_staleness >= reload_staleness - 1",
        ),
        (
            {"controller.acceptance_staleness": 0},
            "controller.pipeline_depth = 1: in deterministic mode a rollout is consumed up to "
            "pipeline_depth + reload_staleness - 1 = 1 versions after its weights, more than "
            "acceptance_staleness 0",
        ),
        (
            {"controller.transport": "distributed"},
            "controller.verifier_endpoint = '': required when transport is 'distributed'",
        ),
        (
            {
                "controller.transport": "distributed",
                "controller.verifier_endpoint": "127.0.0.1:1",
                "controller.trainer_endpoint": "127.0.0.1:2",
                "controller.param_server_endpoints": ("127.0.0.1:3",),
            },
            "controller.inference_endpoints = (): required when transport is 'distributed'",
        ),
        (
            {
                "controller.transport": "distributed",
                "controller.inference_endpoints": ("10.0.0.5:50051",),
                "controller.verifier_endpoint": "127.0.0.1:1",
                "controller.trainer_endpoint": "127.0.0.1:2",
                "controller.param_server_endpoints": ("127.0.0.1:3",),
            },
            "controller.auth_token_file = '': required to reach non-loopback endpoints (e.g. '10.0.0.5:50051')",
        ),
        (
            {
                "controller.transport": "distributed",
                "controller.trainer_process": True,
                "controller.inference_endpoints": ("127.0.0.1:4",),
                "controller.verifier_endpoint": "127.0.0.1:1",
                "controller.trainer_endpoint": "127.0.0.1:2",
                "controller.param_server_endpoints": ("127.0.0.1:3",),
            },
            "controller.trainer_process = True: applies to the local transport only (the "
            "distributed one reaches the trainer at trainer_endpoint)",
        ),
    ],
)
def test_component_combinations(overrides, message):
    expect_error(overrides, message)


def test_trainer_cpus_need_the_trainer_process():
    expect_error(
        {"controller.trainer_cpus": (1,)},
        "controller.trainer_cpus = (1,): needs trainer_process = True",
    )
    expect_error(
        {"controller.trainer_process": True, "controller.trainer_cpus": (-1,)},
        "controller.trainer_cpus = (-1,): CPU numbers must be >= 0",
    )
    ok = build({"controller.trainer_process": True, "controller.trainer_cpus": (1,)})
    assert ok.controller.trainer_cpus == (1,)


def test_resume_needs_snapshots_and_checkpoints_that_meet():
    with pytest.raises(
        ConfigError,
        match=r"controller.snapshot_keep = 2: .* at least "
        r"trainer.checkpoint_every \+ 1 = 3",
    ):
        build({"trainer.checkpoint_every": 2, "controller.snapshot_keep": 2})
    with pytest.raises(
        ConfigError,
        match=r"trainer.keep_checkpoints = 2: .* republishes .* "
        r"pipeline_depth \+ reload_staleness = 3",
    ):
        build(
            {
                "controller.reload_staleness": 2,
                "controller.acceptance_staleness": 4,
                "trainer.keep_checkpoints": 2,
                "controller.snapshot_keep": 2,
            }
        )
    # Every kept snapshot has a kept checkpoint at or before it.
    with pytest.raises(
        ConfigError,
        match=r"controller.snapshot_keep = 4: the oldest of 4 "
        r"snapshots .* 3 x checkpoint_every 1 = 3 steps",
    ):
        build({"controller.snapshot_keep": 4})
    build({"controller.snapshot_keep": 6, "trainer.keep_checkpoints": 6})
    with pytest.raises(ConfigError, match=r"controller.warmup_steps = \d+: needs the local"):
        build(
            {
                "controller.transport": "distributed",
                "controller.trainer_endpoint": "h:1",
                "controller.verifier_endpoint": "h:1",
                "controller.param_server_endpoints": ("h:1",),
                "controller.inference_endpoints": ("h:1",),
                "controller.auth_token_file": "/t",
            }
        )
    with pytest.raises(ConfigError, match=r"data.language = 'java': the verifiers do not run it"):
        build({"data.language": "java", "verifiers.languages": ("python",)})


def test_staleness_settings_that_can_progress():
    on_policy = build({"controller.acceptance_staleness": 0, "controller.pipeline_depth": 0})
    assert on_policy.controller.acceptance_bound == 0
    paper = build(
        {
            "controller.reload_staleness": 16,
            "controller.acceptance_staleness": 32,
            "trainer.keep_checkpoints": 17,
        }
    )
    assert paper.controller.acceptance_bound == 32
    unbounded = build(
        {
            "controller.acceptance_staleness": C.UNBOUNDED,
            "controller.pipeline_depth": 5,
            "trainer.keep_checkpoints": 6,
        }
    )
    assert unbounded.controller.acceptance_bound == float("inf")
    # Throughput mode has no pipeline formula to satisfy.
    build({"controller.acceptance_staleness": 0, "controller.mode": "throughput"})


# --------------------------------------------------------------------------------------------
# Addresses: loopback unless credentials are configured.


@pytest.mark.parametrize("section", ["trainer", "inference", "param_server", "verifiers"])
def test_non_loopback_address_needs_credentials(section):
    expect_error(
        {f"{section}.address": "0.0.0.0:50051"},
        f"{section}.address = '0.0.0.0:50051': a non-loopback address needs credentials: "
        "set auth_token_file (TLS alone does not authenticate clients)",
    )
    assert build({f"{section}.address": "0.0.0.0:50051", f"{section}.auth_token_file": "/t"})
    assert build(
        {
            f"{section}.address": "10.1.2.3:1",
            f"{section}.auth_token_file": "/t",
            f"{section}.tls_cert_file": "/c",
        }
    )
    with pytest.raises(ConfigError, match="TLS alone does not authenticate clients"):
        build({f"{section}.address": "10.1.2.3:1", f"{section}.tls_cert_file": "/c"})
    for loopback in ("127.0.0.1:0", "localhost:9000", "[::1]:9000", "127.0.0.2:80"):
        assert build({f"{section}.address": loopback})


@pytest.mark.parametrize(
    "address, message",
    [
        ("localhost", "must be 'host:port' (port 0 picks a free port)"),
        ("127.0.0.1:http", "must be 'host:port' (port 0 picks a free port)"),
        (":50051", "must be 'host:port' (port 0 picks a free port)"),
        ("127.0.0.1:70000", "port must be <= 65535"),
    ],
)
def test_malformed_address(address, message):
    expect_error(
        {"param_server.address": address}, f"param_server.address = {address!r}: {message}"
    )


# --------------------------------------------------------------------------------------------
# Rules across components.


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"inference.max_new_tokens": 400},
            "inference.max_new_tokens = 400: max_prompt_len + max_new_tokens = 656 exceeds "
            "model.max_position_embeddings (512)",
        ),
        (
            {"trainer.micro_batch_size": 24},
            "trainer.micro_batch_size = 24: must divide the rollouts per step "
            "(controller.prompts_per_step * algorithm.group_size = 64)",
        ),
        (
            {"mesh.tensor": 3, "mesh.fsdp": 1},
            "mesh.tensor = 3: must divide model.num_heads (4) and divide or be a multiple of "
            "model.num_kv_heads (2)",
        ),
        (
            {"data.replay": True, "controller.acceptance_staleness": -1},
            "data.replay = True: replay with unbounded staleness draws from an unbounded past, which "
            "deterministic mode cannot schedule; use mode 'throughput'",
        ),
        (
            {"inference.overlap_reload": True},
            "inference.overlap_reload = True: overlapped reloads need controller.mode "
            "'throughput': deterministic mode runs one job at a time on a worker",
        ),
    ],
)
def test_cross_component_rules(overrides, message):
    expect_error(overrides, message)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"inference.mesh.slices": 2},
            "inference.mesh.slices = 2: must be 1: an inference worker runs on one slice (more "
            "workers scale inference)",
        ),
        (
            {
                "mesh.slices": 2,
                "trainer.distributed.coordinator_address": "10.0.0.1:8476",
                "trainer.distributed.num_processes": 3,
            },
            "trainer.distributed.num_processes = 3: must split evenly over mesh.slices = 2 "
            "(processes per slice)",
        ),
        (
            {
                "mesh.slices": 2,
                "trainer.distributed.coordinator_address": "10.0.0.1:8476",
                "trainer.distributed.num_processes": 4,
                "trainer.distributed.process_id": 2,
                "trainer.distributed.slice_index": 1,
            },
            "trainer.distributed.slice_index = 1: slice 1, process 2 is not one of the 4 "
            "processes over 2 slices",
        ),
        (
            {"inference.distributed.slice_index": 1},
            "inference.distributed.slice_index = 1: must be 0: an inference worker runs on one "
            "slice",
        ),
        (
            {"trainer.distributed.slice_index": 1},
            "trainer.distributed.slice_index = 1: must be 0 with mesh.slices = 1",
        ),
    ],
)
def test_multislice_rules(overrides, message):
    expect_error(overrides, message)


def test_multislice_numbers_processes_slice_by_slice_and_stacks_data():
    dist = {"coordinator_address": "10.0.0.1:8476", "num_processes": 8}
    ok = build(
        {"mesh.slices": 2, **{f"trainer.distributed.{k}": v for k, v in dist.items()}}
        | {"trainer.distributed.process_id": 3, "trainer.distributed.slice_index": 1}
    )
    assert ok.trainer.distributed.job_process_id(ok.mesh.slices) == 7
    mesh = MeshConfig(data=1, fsdp=-1, tensor=2, slices=2)
    assert mesh.shape(8) == (1, 4, 1, 2) and mesh.global_shape(16) == (2, 4, 1, 2)
    with pytest.raises(ConfigError, match="9 devices do not split into 2 slices"):
        mesh.global_shape(9)


def test_tensor_parallel_may_exceed_kv_heads_when_a_multiple():
    assert build({"mesh.tensor": 4, "mesh.fsdp": 1}).mesh.tensor == 4


# --------------------------------------------------------------------------------------------
# Mesh shape resolution.


def test_mesh_shape():
    assert MeshConfig(data=1, fsdp=-1, tensor=2).shape(8) == (1, 4, 1, 2)
    assert MeshConfig(data=2, fsdp=4, tensor=1).shape(8) == (2, 4, 1, 1)
    assert MeshConfig(data=1, fsdp=-1, expert=4, tensor=2).shape(16) == (1, 2, 4, 2)
    with pytest.raises(ConfigError, match="expert = -1: must be >= 1"):
        MeshConfig(data=1, fsdp=1, expert=-1)
    with pytest.raises(ConfigError) as info:
        MeshConfig(data=3, fsdp=-1, tensor=1).shape(8)
    assert str(info.value) == "mesh: 8 devices are not divisible by the fixed axes' product 3"
    with pytest.raises(ConfigError) as info:
        MeshConfig(data=2, fsdp=2, tensor=1).shape(8)
    assert str(info.value) == "mesh: data*fsdp*expert*tensor = 4 but 8 devices exist"


# --------------------------------------------------------------------------------------------
# ModelConfig RoPE scaling parameters (model issue #3).


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {
                "model.rope_scaling": "llama3",
                "model.rope_scaling_factor": 8.0,
                "model.rope_low_freq_factor": 4.0,
                "model.rope_high_freq_factor": 1.0,
            },
            "model.rope_high_freq_factor = 1.0: must be > rope_low_freq_factor (4.0) > 0 for "
            "llama3 RoPE",
        ),
        (
            {
                "model.rope_scaling": "yarn",
                "model.rope_scaling_factor": 4.0,
                "model.rope_beta_fast": 1.0,
                "model.rope_beta_slow": 2.0,
            },
            "model.rope_beta_fast = 1.0: must be > rope_beta_slow (2.0) > 0 for yarn RoPE",
        ),
        (
            {"model.rope_original_max_position_embeddings": -1},
            "model.rope_original_max_position_embeddings = -1: must be >= 0",
        ),
        (
            {"model.rope_attention_factor": -0.5},
            "model.rope_attention_factor = -0.5: must be >= 0",
        ),
    ],
)
def test_model_rope_scaling_rules(overrides, message):
    expect_error(overrides, message)


def test_model_rope_original_context_defaults_to_max_positions():
    cfg = build({"model.rope_scaling": "yarn", "model.rope_scaling_factor": 4.0})
    assert cfg.model.resolved_rope_original_max_position_embeddings == 512
    cfg = build({"model.rope_original_max_position_embeddings": 128})
    assert cfg.model.resolved_rope_original_max_position_embeddings == 128


# --------------------------------------------------------------------------------------------
# AlgorithmConfig rules added with rlax_tpu.algorithms (issue #7).


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"algorithm.tb_beta_final": 0.0}, "algorithm.tb_beta_final = 0.0: must be > 0"),
        ({"algorithm.reward_kl_coef": -1.0}, "algorithm.reward_kl_coef = -1.0: must be >= 0"),
        ({"algorithm.value_coef": -1.0}, "algorithm.value_coef = -1.0: must be >= 0"),
        ({"algorithm.tb_beta_decay_steps": -1}, "algorithm.tb_beta_decay_steps = -1: must be >= 0"),
        (
            {"algorithm.name": "aipo", "algorithm.group_size": 1, "trainer.micro_batch_size": 8},
            "algorithm.group_size = 1: aipo compares samples within a group: needs >= 2",
        ),
        (
            {"algorithm.is_cap": 2.0},
            "algorithm.is_cap = 2.0: only aipo truncates at a cap; grpo has none",
        ),
        (
            {"algorithm.reward_kl_coef": 0.1},
            "algorithm.reward_kl_coef = 0.1: only ppo and reinforce_pp fold a KL term into the reward",
        ),
        (
            {"algorithm.name": "aipo", "algorithm.behaviour_correction": "token_truncate"},
            "algorithm.behaviour_correction = 'token_truncate': must be 'none': aipo's truncated "
            "weight min(π/μ, c) already corrects for μ",
        ),
        (
            {"algorithm.name": "tb", "algorithm.behaviour_correction": "seq_mask"},
            "algorithm.behaviour_correction = 'seq_mask': must be 'none': tb is off-policy by "
            "construction and uses no importance weight",
        ),
        (
            {"algorithm.name": "online_dpo", "algorithm.behaviour_correction": "token_mask"},
            "algorithm.behaviour_correction = 'token_mask': must be 'none': online_dpo uses no "
            "importance weight",
        ),
        (
            {"algorithm.behaviour_correction": "seq_truncate", "algorithm.behaviour_floor": 0.5},
            "algorithm.behaviour_floor = 0.5: is the lower edge of a mask band: needs "
            "behaviour_correction token_mask or seq_mask, not 'seq_truncate'",
        ),
        (
            {"algorithm.behaviour_correction": "token_mask", "algorithm.behaviour_floor": 2.0},
            "algorithm.behaviour_floor = 2.0: must be in [0, behaviour_cap = 2.0)",
        ),
        (
            {"algorithm.dynamic_sampling": True},
            "algorithm.dynamic_sampling = True: must be one of 'default', 'on', 'off'",
        ),
    ],
)
def test_algorithm_rules(overrides, message):
    expect_error(overrides, message)


def test_algorithm_defaults_mean_paper_defaults():
    alg = build({}).algorithm
    assert (alg.eps_low, alg.eps_high, alg.kl_coef, alg.is_cap, alg.value_coef) == (0.0,) * 5
    assert alg.dynamic_sampling == alg.overlong_shaping == alg.aggregation == "default"
    assert alg.kl_estimator == "none"  # the local preset turns GRPO's default KL off explicitly
    assert C.AlgorithmConfig().kl_estimator == "default"  # the algorithm's paper choice
    assert build({"algorithm.kl_estimator": "default", "algorithm.kl_coef": 0.05}).algorithm
    ok = build({"algorithm.name": "reinforce_pp", "algorithm.reward_kl_coef": 0.02})
    assert ok.algorithm.reward_kl_coef == 0.02


# --------------------------------------------------------------------------------------------
# Verifiers (issue #6): one sandbox uid per worker, compiler and disk limits.


def test_verifier_sandbox_uids_must_fit():
    expect_error(
        {"verifiers.sandbox_uid": -5},
        "verifiers.sandbox_uid = -5: must be > 0 and leave room for one uid per worker "
        "(sandbox_uid + workers < 2^31)",
    )
    expect_error(
        {"verifiers.sandbox_uid": 2**31 - 2, "verifiers.workers": 4},
        f"verifiers.sandbox_uid = {2**31 - 2}: must be > 0 and leave room for one uid per worker "
        "(sandbox_uid + workers < 2^31)",
    )
    assert build({"verifiers.sandbox_uid": 100_000}).verifiers.sandbox_uid == 100_000


def test_verifier_compile_and_disk_limits_must_be_positive():
    expect_error({"verifiers.disk_limit_mb": 0}, "verifiers.disk_limit_mb = 0: must be > 0")
    expect_error(
        {"verifiers.compile_memory_limit_mb": -1},
        "verifiers.compile_memory_limit_mb = -1: must be > 0",
    )


# --------------------------------------------------------------------------------------------
# Parameter server (issue #5): which replica a server is, and how long a lease lives.


def test_param_server_replica_index_and_lease_ttl():
    expect_error(
        {"param_server.replicas": 2, "param_server.replica_index": 2},
        "param_server.replica_index = 2: must be in [0, replicas=2)",
    )
    expect_error({"param_server.lease_ttl_s": 0.0}, "param_server.lease_ttl_s = 0.0: must be > 0")
    ok = build({"param_server.replicas": 4, "param_server.replica_index": 3})
    assert ok.param_server.replica_index == 3


# --------------------------------------------------------------------------------------------
# Trainer (issue #8): micro-batch length buckets and the checkpoint directory.


def test_trainer_length_bucket_must_be_positive():
    expect_error({"trainer.length_bucket": 0}, "trainer.length_bucket = 0: must be > 0")
    ok = build({"trainer.length_bucket": 64, "trainer.checkpoint_dir": "/tmp/ckpt"})
    assert ok.trainer.length_bucket == 64 and ok.trainer.checkpoint_dir == "/tmp/ckpt"


# --------------------------------------------------------------------------------------------
# Inference (issue #4): the engine's fixed step width.


def test_inference_step_tokens_must_cover_every_running_sequence():
    expect_error(
        {"inference.max_concurrent_seqs": 8, "inference.step_tokens": 4},
        "inference.step_tokens = 4: must be 0 or >= max_concurrent_seqs (8): every running "
        "sequence decodes one token per step",
    )
    expect_error({"inference.step_tokens": -1}, "inference.step_tokens = -1: must be >= 0")
    ok = build({"inference.max_concurrent_seqs": 8, "inference.step_tokens": 24})
    assert ok.inference.step_tokens == 24 and build({}).inference.step_tokens == 0


def test_inference_span_groups_fit_the_batch_and_need_unaligned_logprobs():
    expect_error(
        {"inference.max_concurrent_seqs": 8, "inference.span_groups": 9},
        "inference.span_groups = 9: must be <= max_concurrent_seqs (8)",
    )
    expect_error({"inference.span_bucket_pages": 0}, "inference.span_bucket_pages = 0: must be > 0")
    expect_error(
        {"inference.span_groups": 2},
        "inference.span_groups = 2: span groups change the engine's f32 rounding with the batch, "
        "so the trainer's replay cannot reproduce its log-probs bitwise; set "
        "trainer.align_logprobs = False or span_groups = 0",
    )
    ok = build({"inference.span_groups": 2, "trainer.align_logprobs": False})
    assert ok.inference.span_groups == 2 and build({}).inference.span_groups == 0


def test_a_group_fits_one_data_shard_of_the_engine():
    """A group's samples share their prompt's pages, so they decode on one data shard's rows."""
    base = {"inference.mesh.data": 2, "inference.max_concurrent_seqs": 8}
    expect_error(
        base | {"algorithm.group_size": 8, "trainer.micro_batch_size": 8},
        "algorithm.group_size = 8: a group's samples share their prompt's pages on one of the "
        "engine's 2 data shards, one decode row each: at most step_tokens / inference.mesh.data "
        "= 4 (step_tokens 0: max_concurrent_seqs)",
    )
    ok = build(base | {"algorithm.group_size": 4, "inference.step_tokens": 16})
    assert ok.algorithm.group_size == 4
    assert build(base | {"algorithm.group_size": 8, "inference.step_tokens": 16})


# --------------------------------------------------------------------------------------------
# Parameter server (issue #5): how many persisted versions stay on disk.


def test_param_server_persist_keep_must_be_non_negative():
    expect_error({"param_server.persist_keep": -1}, "param_server.persist_keep = -1: must be >= 0")
    assert build({}).param_server.persist_keep == 3
    assert build({"param_server.persist_keep": 0}).param_server.persist_keep == 0  # keep all


# --------------------------------------------------------------------------------------------
# Verifiers (issue #6 review): limits a request may ask for, and the sandbox uid range.


def test_verifier_request_limit_maxima():
    cfg = build({}).verifiers
    assert (
        cfg.max_time_limit_s >= cfg.time_limit_s and cfg.max_memory_limit_mb >= cfg.memory_limit_mb
    )
    expect_error(
        {"verifiers.max_time_limit_s": 0.0}, "verifiers.max_time_limit_s = 0.0: must be > 0"
    )
    expect_error(
        {"verifiers.max_time_limit_s": float("inf")},
        "verifiers.max_time_limit_s = inf: must be finite and >= time_limit_s (2.0)",
    )
    expect_error(
        {"verifiers.max_time_limit_s": 1.0},
        "verifiers.max_time_limit_s = 1.0: must be finite and >= time_limit_s (2.0)",
    )
    expect_error(
        {"verifiers.max_memory_limit_mb": 128},
        "verifiers.max_memory_limit_mb = 128: must be >= memory_limit_mb (256)",
    )


def test_verifier_sandbox_uids_stay_clear_of_system_users_and_nobody():
    assert build({}).verifiers.sandbox_uid == 200_000
    expect_error(
        {"verifiers.sandbox_uid": 999},
        "verifiers.sandbox_uid = 999: must be >= 1000 (below are system users and daemons)",
    )
    for uid, workers, last in ((65534, 1, 65534), (65530, 8, 65537), (65535, 2, 65536)):
        expect_error(
            {"verifiers.sandbox_uid": uid, "verifiers.workers": workers},
            f"verifiers.sandbox_uid = {uid}: uids {uid}..{last} (one per worker) must not include "
            "65534 (nobody) or 65535 (-1 as a 16-bit uid)",
        )
    assert build({"verifiers.sandbox_uid": 65526, "verifiers.workers": 8}).verifiers.workers == 8
    assert build({"verifiers.sandbox_uid": 65536}).verifiers.sandbox_uid == 65536
    assert build({"verifiers.sandbox_uid": 1000}).verifiers.sandbox_uid == 1000


def test_a_dead_replicas_lease_must_lapse_before_a_publish_stops_waiting():
    from rlax_tpu.config import ParamServerConfig

    with pytest.raises(
        ConfigError, match=r"replica_lease_s = 300.0: must be < publish_room_wait_s"
    ):
        ParamServerConfig(replicas=2, replica_lease_s=300.0, publish_room_wait_s=300.0)
    ParamServerConfig(replicas=2, replica_lease_s=300.0, publish_room_wait_s=0.0)  # no wait
    ParamServerConfig(replicas=1, replica_lease_s=300.0, publish_room_wait_s=300.0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"environment.name": "chess"},
            "environment.name = 'chess': unknown environment; known: ['none', 'code_repair', "
            "'python_tool'] "
            "(an environment of your own is registered by a module in algorithm.plugins)",
        ),
        ({"environment.max_turns": 0}, "environment.max_turns = 0: must be > 0"),
        ({"environment.discount": 1.5}, "environment.discount = 1.5: must be in [0.0, 1.0]"),
        (
            {
                "environment.name": "code_repair",
                "data.prompt_style": "chat",
                "environment.turn_tokens": 10_000,
            },
            "environment.turn_tokens = 10000: exceeds the episode's budget "
            "inference.max_new_tokens (48)",
        ),
        (
            {"environment.name": "code_repair", "data.prompt_style": "raw"},
            "data.prompt_style = 'raw': an environment's replies are turns of the model's chat "
            "template: use 'chat'",
        ),
        (
            {"environment.name": "code_repair"},  # the local preset's 'auto' would be raw
            "data.prompt_style = 'auto': an environment's replies are turns of the model's chat "
            "template: use 'chat'",
        ),
        (
            {
                "environment.name": "code_repair",
                "data.prompt_style": "chat",
                "algorithm.name": "ppo",
            },
            "algorithm.name = 'ppo': its advantage walks each completion's tokens in order, "
            "and an episode's completion holds the environment's tokens between the model's "
            "turns; choose one without (grpo, dapo, rloo, ...)",
        ),
    ],
)
def test_environments_that_cannot_run(overrides, message):
    expect_error(overrides, message)


def test_an_environment_builds_and_old_runs_without_the_section_still_load():
    cfg = build({"environment.name": "code_repair", "data.prompt_style": "chat"})
    assert (cfg.environment.name, cfg.environment.max_turns) == ("code_repair", 2)
    saved = local_dict()
    del saved["environment"]  # a run directory written before the section existed
    assert from_dict(RunConfig, saved).environment.name == "none"


def test_a_gs_gguf_is_refused_for_a_multi_host_trainer_or_worker():
    """[pod-fidelity]: every host would copy the whole GGUF file; one process may."""
    gguf = {
        "model.weights_format": "gguf",
        "model.weights_path": "gs://bucket/model-q8",  # the format says GGUF, not the name
    }
    assert build(gguf).model.weights_path == "gs://bucket/model-q8"  # one process each
    for component in ("trainer", "inference"):
        with pytest.raises(ConfigError) as info:
            build(
                gguf
                | {
                    f"{component}.distributed.coordinator_address": "auto",
                    f"{component}.distributed.num_processes": 2,
                }
            )
        assert info.value.field == "model.weights_path"
        assert f"copied whole to every host ({component}.distributed.num_processes = 2)" in str(
            info.value
        )
    # The tokenizer alone from a gs:// GGUF is the same download.
    with pytest.raises(ConfigError, match="model.tokenizer_path"):
        build(
            {
                "model.tokenizer_path": "gs://bucket/tok.gguf",
                "inference.distributed.coordinator_address": "auto",
                "inference.distributed.num_processes": 2,
            }
        )
    # A local path per host is the user's own copy.
    build(
        gguf
        | {
            "model.weights_path": "/data/model.gguf",
            "trainer.distributed.coordinator_address": "auto",
            "trainer.distributed.num_processes": 2,
        }
    )
