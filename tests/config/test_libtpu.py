"""The TPU jobs' XLA flags (config/libtpu.py): what they are by config, that the pinned libtpu
reads them when it compiles (and refuses a flag it does not know), and that the AOT check and
the local launcher pass them. The TPU VM and GKE launchers' tests are tests/launch's."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

from rlax_tpu.config import ConfigError, RunConfig, from_dict
from rlax_tpu.config.libtpu import (
    COLLECTIVE_OVERLAP,
    DATA_PARALLEL_OVER_DCN,
    ENV,
    libtpu_init_args,
)

# An FSDP gradient (weights sharded over 4 v5p chips, all-gathered in the forward and
# reduce-scattered in the backward) compiled by libtpu for v5p:2x2x1; prints whether its
# collectives were made asynchronous (overlapped with compute).
COMPILE = textwrap.dedent(
    """
    import os
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    import jax, jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = topologies.make_mesh(topologies.get_topology_desc("v5p:2x2x1", "tpu"), (4,), ("f",))
    rows = NamedSharding(mesh, P("f", None))

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x.sum()

    w = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=rows)
    x = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16, sharding=rows)
    text = jax.jit(jax.grad(loss)).lower([w] * 4, x).compile().as_text()
    print("async" if "async-collective-start" in text else "sync")
    """
)


def _config(**overrides) -> RunConfig:
    return from_dict(RunConfig, overrides)


def test_the_flags_by_config_and_component():
    trainer = libtpu_init_args(_config())
    assert trainer.split() == [*COLLECTIVE_OVERLAP, "--xla_tpu_scoped_vmem_limit_kib=98304"]
    assert libtpu_init_args(_config(), "inference") == "--xla_tpu_scoped_vmem_limit_kib=98304"
    multislice = _config(mesh={"slices": 2, "data": 1})
    assert libtpu_init_args(multislice).split()[-3:-1] == list(DATA_PARALLEL_OVER_DCN)
    moe = _config(model={"arch": "qwen3_moe", "num_experts": 8, "experts_per_token": 2})
    assert libtpu_init_args(moe).endswith("--xla_tpu_scoped_vmem_limit_kib=81920")
    assert libtpu_init_args(_config(topology={"libtpu_init_args": ""})) == ""
    mine = "--xla_tpu_scoped_vmem_limit_kib=65536 --2a886c8_chip_config_name=megachip_tccontrol"
    assert libtpu_init_args(_config(topology={"libtpu_init_args": mine}), "inference") == mine
    # What a shell, or Kubernetes' $(VAR) expansion of a pod's env, would change is refused.
    for bad in ("xla_tpu_x=1", "--a=1;rm", "--x=$(JOB_INDEX)", "--a=`id`", "--xla_flag='q'"):
        with pytest.raises(ConfigError, match="libtpu_init_args"):
            _config(topology={"libtpu_init_args": bad})


def _compile(flags: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if flags is not None:
        env[ENV] = flags
    return subprocess.run(
        [sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300
    )


def test_libtpu_reads_the_flags_when_it_compiles_and_refuses_one_it_does_not_know():
    """The facts the module rests on, against the pinned libtpu: without the flags the FSDP
    gradient's collectives are synchronous, with ours they are async collective fusions
    (overlapped with compute); an unknown flag stops libtpu from loading at all."""
    plain, ours = _compile(None), _compile(libtpu_init_args(_config(), "trainer"))
    assert plain.returncode == 0 and ours.returncode == 0, (
        plain.stderr[-2000:] + ours.stderr[-2000:]
    )
    assert (plain.stdout.split()[-1], ours.stdout.split()[-1]) == ("sync", "async")
    unknown = _compile("--xla_tpu_no_such_flag_in_libtpu=true")
    assert unknown.returncode != 0
    assert "Unknown command line flag 'xla_tpu_no_such_flag_in_libtpu'" in unknown.stderr


def test_the_aot_check_and_the_local_launcher_pass_the_config_s_flags(monkeypatch, tmp_path):
    from jax._src.lib import xla_client

    from rlax_tpu.aot.__main__ import apply_libtpu_init_args
    from rlax_tpu.cli import UsageError
    from rlax_tpu.launch import local

    config = _config(controller={"run_dir": str(tmp_path)})
    monkeypatch.setenv(ENV, "set here so that monkeypatch restores its absence")
    monkeypatch.delenv(ENV)
    # Whether this test process loaded libtpu already (another test compiled for a TPU) is
    # not the claim: each case below is set.
    monkeypatch.setattr(xla_client, "pjrt_plugin_loaded", lambda name: True)
    with pytest.raises(UsageError, match="libtpu was loaded before"):
        apply_libtpu_init_args(config, "trainer")
    assert ENV not in os.environ
    monkeypatch.setattr(xla_client, "pjrt_plugin_loaded", lambda name: False)
    apply_libtpu_init_args(config, "trainer")
    assert os.environ[ENV] == libtpu_init_args(config)
    monkeypatch.setenv(ENV, "--xla_tpu_scoped_vmem_limit_kib=65536")  # the user's, kept
    apply_libtpu_init_args(config, "inference")
    assert os.environ[ENV] == "--xla_tpu_scoped_vmem_limit_kib=65536"
    monkeypatch.delenv(ENV)
    # The local launch: on a TPU host, the processes on the TPUs (the local transport's
    # controller runs the trainer and the workers); nothing elsewhere (JAX keys its compile
    # cache on the flags, CPU programs too).
    launch = local.Launch(config, [])
    assert ENV not in launch._env("trainer")
    monkeypatch.setattr(local, "detect_accelerator", lambda: "tpu")
    assert launch._env("trainer")[ENV] == libtpu_init_args(config)
    assert launch._env("inference")[ENV] == libtpu_init_args(config, "inference")
    assert launch._env("controller")[ENV] == libtpu_init_args(config)  # local transport
    assert ENV not in launch._env("param_server") and ENV not in launch._env("verifiers")
    monkeypatch.setenv(ENV, "--xla_tpu_scoped_vmem_limit_kib=65536")
    assert local.Launch(config, [])._env("trainer")[ENV] == "--xla_tpu_scoped_vmem_limit_kib=65536"
    none = dataclasses.replace(
        config, topology=dataclasses.replace(config.topology, libtpu_init_args="")
    )
    monkeypatch.delenv(ENV)
    assert ENV not in local.Launch(none, [])._env("trainer")
