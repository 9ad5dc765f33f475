"""What the AOT check holds beside each program (resident state and the transients of its
moment) and the headroom it keeps, on CPU devices (no libtpu compile needed)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest

from rlax_tpu import models
from rlax_tpu.aot.check import FITS, HEADROOM, TOO_BIG, compile_program
from rlax_tpu.aot.chips import CHIPS, DeviceSpec
from rlax_tpu.config import AlgorithmConfig, MeshConfig
from rlax_tpu.inference.aot import abstract_programs as inference_programs
from rlax_tpu.models.aot import AbstractProgram
from rlax_tpu.models.paged_cache import page_bytes
from rlax_tpu.trainer.aot import abstract_programs as trainer_programs

from ..trainer.helpers import ROWS, run_config


def _params(cfg) -> int:  # noqa: ANN001
    state = models.abstract_model(cfg.model)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


def test_trainer_holds_float32_masters_moments_and_the_steps_batches():
    # bf16 storage and compute, a KL term (so a frozen bf16 reference), 2 micro-batches.
    cfg = run_config(
        model=models.preset("tiny", num_layers=2, param_dtype="bfloat16", compute_dtype="bfloat16")
    )
    cfg = dataclasses.replace(
        cfg, algorithm=AlgorithmConfig(name="grpo", group_size=4, kl_estimator="k3")
    )
    programs = {p.name: p for p in trainer_programs(cfg, jax.devices()[:1])}
    n = _params(cfg)
    acc = programs["trainer.accumulate"].held
    # AdamW's two moments in float32 (and its step count), the reference in bf16.
    assert 8 * n <= acc["optimizer state"] <= 8 * n + 64
    assert acc["reference (bfloat16)"] == 2 * n
    micro = ROWS // cfg.trainer.micro_batch_size
    assert micro == 2 and "micro-batch arrays x1" in acc and "objective inputs" in acc
    apply = programs["trainer.apply"].held
    assert f"micro-batch arrays x{micro}" in apply and "optimizer state" not in apply
    assert apply[f"micro-batch arrays x{micro}"] == micro * acc["micro-batch arrays x1"]
    # The master copy is an argument of the update and the publish cast: float32.
    trainable = programs["trainer.apply"].args[0]["model"]
    assert {x.dtype for x in jax.tree.leaves(trainable)} == {jnp.dtype(jnp.float32)}
    assert programs["trainer.score_ref"].held["trainable (float32 master)"] == 4 * n
    # The step's arrays are freed before publish (trainer.train_step); the published version
    # the workers of this process take from the trainer's devices stays (controller/handoff.py,
    # param_server.device_versions, one by default), unless none is kept.
    kept = "published versions kept for the workers (x1)"
    held = programs["trainer.publish"].held
    assert set(held) == {"optimizer state", "reference (bfloat16)", kept}
    assert acc[kept] == jnp.dtype(cfg.trainer.publish_dtype).itemsize * n
    off = dataclasses.replace(
        cfg, param_server=dataclasses.replace(cfg.param_server, device_versions=0)
    )
    none = {p.name: p for p in trainer_programs(off, jax.devices()[:1])}
    assert kept not in none["trainer.publish"].held


def test_a_lora_trainer_holds_its_frozen_base_and_moments_of_the_adapters_only():
    """LoRA over a bf16 base with a KL term: AdamW's moments and the reference are the
    adapters' (float32), the frozen base is held in bf16 beside every forward, the publish
    program's output is the adapters alone, and every program compiles (CPU devices)."""
    from rlax_tpu.models.adapters import split_adapters

    model = models.preset(
        "tiny", num_layers=2, param_dtype="bfloat16", compute_dtype="bfloat16", lora_rank=4
    )
    cfg = dataclasses.replace(
        run_config(model=model),
        algorithm=AlgorithmConfig(name="grpo", group_size=4, kl_estimator="k3"),
    )
    adapters, base = split_adapters(nnx_pure(models.abstract_model(model)))
    n_a = sum(math.prod(x.shape) for x in jax.tree.leaves(adapters))
    n_b = sum(math.prod(x.shape) for x in jax.tree.leaves(base))
    assert 0 < n_a < n_b / 10
    programs = {p.name: p for p in trainer_programs(cfg, jax.devices()[:1])}
    acc = programs["trainer.accumulate"].held
    assert 8 * n_a <= acc["optimizer state"] <= 8 * n_a + 64
    assert acc["reference (float32)"] == 4 * n_a
    assert "frozen base (bfloat16)" not in acc  # an argument of the gradient step
    assert programs["trainer.apply"].held["frozen base (bfloat16)"] == 2 * n_b
    publish = programs["trainer.publish"]
    out = jax.eval_shape(publish.fn, *publish.args)
    assert jax.tree.structure(out) == jax.tree.structure(adapters)
    assert {x.dtype for x in jax.tree.leaves(out)} == {jnp.dtype(jnp.float32)}
    assert f"{4 * n_a / 2**20:.1f} MiB a version" in publish.note
    for program in programs.values():
        report = compile_program(
            program, component="trainer", topology="cpu", device=_device(2**34)
        )
        assert report.status == FITS, (program.name, report.error)


def nnx_pure(module):  # noqa: ANN001, ANN201
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(module))


def test_inference_holds_a_second_copy_of_the_weights_during_a_reload():
    cfg = run_config(model=models.preset("tiny", num_layers=2, param_dtype="bfloat16"))
    programs = {p.name: p for p in inference_programs(cfg, jax.devices()[:1])}
    weights = 2 * _params(cfg)
    assert programs["inference.decode"].held == {"next version's weights (reload)": weights}
    assert programs["inference.prefill"].resident_bytes == weights
    assert programs["inference.copy_pages"].held == {"weights": weights}


@pytest.mark.parametrize(("spare", "status"), [(0.06, FITS), (0.04, TOO_BIG)])
def test_a_program_fits_only_with_the_headroom_left(spare, status):
    """The same program and held bytes fit or not by whether 5% of the HBM stays free."""
    x = jax.ShapeDtypeStruct((1024,), jnp.float32)
    probe = compile_program(
        AbstractProgram("probe", jax.jit(lambda a: a * 2), (x,)),
        component="test",
        topology="cpu",
        device=_device(2**30),
    )
    usable = 2**30
    held = int(usable * (1 - spare)) - probe.footprint_bytes
    program = AbstractProgram("p", jax.jit(lambda a: a * 2), (x,), held={"state": held})
    report = compile_program(program, component="test", topology="cpu", device=_device(usable))
    assert report.status == status, (report.peak_bytes / usable, HEADROOM)
    assert report.limit_bytes == int(usable * (1 - HEADROOM))
    assert report.to_dict()["held"] == {"state": held}


def _device(usable: int) -> DeviceSpec:
    return DeviceSpec(CHIPS["v5e"], 1, usable, "table")


def test_pi_old_is_checked_on_the_published_cast_where_the_engine_sees_other_values():
    """bf16 published, float32 compute: π_old runs on the bf16 cast (the engine's values), so
    that copy is the program's argument and the float32 masters are held beside it."""
    model = models.preset("tiny", num_layers=2, param_dtype="bfloat16")
    cfg = run_config(model=model, align_logprobs=True, publish_dtype="bfloat16")
    programs = {p.name: p for p in trainer_programs(cfg, jax.devices()[:1])}
    decode = programs["trainer.replay.decode"]  # CPU: the token-by-token replay
    assert {x.dtype for x in jax.tree.leaves(decode.args[0])} == {jnp.dtype(jnp.bfloat16)}
    assert decode.held["trainable (float32 master)"] == 4 * _params(cfg)
    # With bf16 compute the masters cast at use are the engine's values: no copy.
    same = run_config(
        model=dataclasses.replace(model, compute_dtype="bfloat16"),
        align_logprobs=True,
        publish_dtype="bfloat16",
    )
    decode = {p.name: p for p in trainer_programs(same, jax.devices()[:1])}["trainer.replay.decode"]
    assert {x.dtype for x in jax.tree.leaves(decode.args[0])} == {jnp.dtype(jnp.float32)}
    assert "trainable (float32 master)" not in decode.held


def test_the_decode_programs_kv_pages_per_device_halve_on_two_data_shards():
    """inference.mesh.data 2 (engine.py's data shards): the compiled decode program's per-device
    arguments shrink by half the KV pages (the weights are replicated over data either way), as
    the report's note says; KV bytes from the cache's shapes (page_bytes x pages)."""
    base = run_config()
    kv = 64 * page_bytes(base.model, base.inference.page_size)  # 64 pages of the 2-layer tiny
    reports, notes = {}, {}
    for data in (1, 2):
        inference = dataclasses.replace(
            base.inference, kv_cache_bytes=kv, mesh=MeshConfig(data=data, fsdp=1, tensor=1)
        )
        cfg = dataclasses.replace(base, inference=inference)
        decode = {p.name: p for p in inference_programs(cfg, jax.devices()[:2])}["inference.decode"]
        reports[data] = compile_program(
            decode, component="inference", topology="cpu", device=_device(2**34)
        )
        notes[data] = decode.note
    assert reports[1].status == reports[2].status == FITS
    # Exactly: the cache's own block tables (split by row too) are not read by decode, which
    # takes the step's tables, and jit drops unused arguments.
    assert reports[1].argument_bytes - reports[2].argument_bytes == kv // 2
    assert f"KV pages {kv / 2**20:.1f} MiB per device" in notes[1]
    assert f"KV pages {kv / 2 / 2**20:.1f} MiB per device (1/2 of the pages" in notes[2]
