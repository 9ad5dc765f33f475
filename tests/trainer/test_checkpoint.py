"""Save, SIGKILL, restore onto another mesh: the next step is bit-identical to an uninterrupted
run's; a checkpoint of another model is refused with the differing fields named."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tpu import models
from rlax_tpu.trainer import CheckpointMismatchError, NoCheckpointError, Trainer

from .helpers import host, random_batch, run_config

WORKER = Path(__file__).with_name("checkpoint_worker.py")
MESH_A, MESH_B = (2, 4, 1), (1, 4, 2)


def _assert_trees_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, host(a), host(b))


def test_kill_and_restore_on_another_mesh_is_bit_identical(tmp_path):
    killed_dir, ref_dir = tmp_path / "killed", tmp_path / "ref"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(killed_dir), *map(str, MESH_A)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Meanwhile, the uninterrupted run of the same two steps on the same mesh, in-process.
        ref = Trainer(run_config(MESH_A), checkpoint_dir=ref_dir)
        for s in range(2):
            ref.train_step(random_batch(s))
        ref.wait_for_checkpoints()
        ref_params, ref_opt = host(ref.params()), host(ref._opt_state)
        ref.close()
        for expected in ("SAVED 1", "SAVED 2"):
            line = proc.stdout.readline().strip()
            assert line == expected, (line, proc.stderr.read() if not line else "")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    b = Trainer(run_config(MESH_B), checkpoint_dir=tmp_path / "b")
    assert b.restore(2, directory=ref_dir) == 2
    expected = b.train_step(random_batch(2))
    expected_params = host(b.params())
    # Restoring the killed run's checkpoint onto mesh B gives bit-identical state...
    assert b.restore(2, directory=killed_dir) == 2
    _assert_trees_equal(b.params(), ref_params)
    _assert_trees_equal(b._opt_state, ref_opt)
    assert b.params()["embed"].sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    # ... and a bit-identical next step.
    got = b.train_step(random_batch(2))
    _assert_trees_equal(b.params(), expected_params)
    for name in ("loss", "grad_norm", "update_norm", "param_norm"):
        assert got[name] == expected[name], name
    # The newest checkpoint the killed run left is a complete one (partial saves are not listed).
    newest = b.restore(directory=killed_dir)
    assert newest >= 2
    b.close()


def test_checkpoint_of_another_model_is_refused(tmp_path):
    trainer = Trainer(run_config(), devices=jax.devices()[:1], checkpoint_dir=tmp_path)
    with pytest.raises(NoCheckpointError, match="no complete trainer checkpoint"):
        trainer.restore()
    trainer.save(wait=True)
    trainer.close()
    other_model = models.preset("tiny", num_layers=2, hidden_size=64, intermediate_size=128)
    other = Trainer(
        run_config(model=other_model), devices=jax.devices()[:1], checkpoint_dir=tmp_path
    )
    with pytest.raises(
        CheckpointMismatchError, match="different model: hidden_size: checkpoint 128, config 64"
    ):
        other.restore()
    other.close()
    # Same model, different objective head (PPO's value head): refused too.
    ppo = Trainer(
        dataclasses.replace(run_config(algorithm="ppo")),
        devices=jax.devices()[:1],
        checkpoint_dir=tmp_path,
    )
    with pytest.raises(
        CheckpointMismatchError, match="trainer.value_head: checkpoint False, config True"
    ):
        ppo.restore()
    ppo.close()


def test_gs_checkpoints_and_a_killed_saves_leftovers(gcs_emulator):
    """Checkpoints on gs:// (a GCS server on 127.0.0.1): Orbax writes them in place and commits
    with a marker, so a save killed midway leaves an uncommitted folder with a half-written
    OCDBT manifest. It is not listed as a checkpoint, and saving that step again starts from
    scratch (Orbax removes the folder first)."""
    import uuid

    from rlax_tpu import storage
    from rlax_tpu.trainer.checkpoint import Checkpointer

    from ..conftest import GCS_BUCKET

    directory = f"gs://{GCS_BUCKET}/ckpt-{uuid.uuid4().hex[:8]}"
    state = {"w": jax.numpy.arange(6.0).reshape(2, 3), "step": jax.numpy.int32(1)}
    ckpt = Checkpointer(directory, keep=2, signature={"m": 1})
    ckpt.save(1, state)
    ckpt.wait()
    # What a save of step 2 killed before its commit leaves: its files, no commit marker.
    done = storage.path(directory) / "1"
    for f in storage._files_under(done):
        rel = os.fspath(f)[len(os.fspath(done)) + 1 :]
        if "commit_success" not in rel:
            (storage.path(directory) / "2" / rel).parent.mkdir(parents=True, exist_ok=True)
            (storage.path(directory) / "2" / rel).write_bytes(f.read_bytes())
    stray = storage.path(directory) / "2" / "state" / "ocdbt.process_0" / "d" / "dead-save"
    stray.write_bytes(b"written by the killed save")
    assert ckpt.steps() == [1]
    ckpt.save(2, jax.tree.map(lambda x: x + 1, state))
    ckpt.wait()
    assert ckpt.steps() == [1, 2]
    assert not stray.exists()  # step 2 was written from scratch, not over the dead save
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    step, restored = ckpt.restore(None, abstract)
    ckpt.close()
    assert step == 2
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(6.0).reshape(2, 3) + 1)


def _flip_a_byte(step_dir: Path, seed: int) -> Path:
    """Flips one byte in the largest data file of a checkpoint's state (where the arrays are)."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    target = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    at = np.random.default_rng(seed).integers(len(data) // 4, len(data))
    data[at] ^= 0x10
    target.write_bytes(bytes(data))
    return target


def test_a_flipped_byte_in_a_checkpoint_is_caught(tmp_path):
    from rlax_tpu.trainer.checkpoint import CorruptCheckpointError

    trainer = Trainer(run_config(), devices=jax.devices()[:1], checkpoint_dir=tmp_path)
    trainer.save(wait=True)
    trainer.train_step(random_batch(0))
    trainer.save(wait=True)
    want = host(trainer.params())
    trainer.close()
    _flip_a_byte(tmp_path / "1", seed=0)
    again = Trainer(run_config(), devices=jax.devices()[:1], checkpoint_dir=tmp_path)
    try:
        with pytest.raises(
            CorruptCheckpointError, match="checkpoint 1 in .* (is corrupt|does not)"
        ):
            again.restore(1)
        # An intact checkpoint still restores, and equals what was saved.
        again.restore(0)
        again.train_step(random_batch(0))
        _assert_trees_equal(again.params(), want)
    finally:
        again.close()


def test_a_checkpoint_restores_into_other_master_dtypes_verified(tmp_path):
    """Checksums are over the saved bits: a state saved with bf16 masters is read as saved,
    verified, then cast to the trainer's float32 (and back), never taken for a corrupt one."""
    bf16 = dataclasses.replace(run_config().trainer, master_dtype="bfloat16", learning_rate=1e-2)
    cfg_bf16 = dataclasses.replace(run_config(), trainer=bf16)
    a = Trainer(cfg_bf16, devices=jax.devices()[:1], checkpoint_dir=tmp_path)
    a.train_step(random_batch(0))
    a.save(wait=True)
    saved = host(a.params())
    assert {x.dtype for x in jax.tree.leaves(saved)} == {np.dtype(jnp.bfloat16)}
    a.close()
    b = Trainer(run_config(), devices=jax.devices()[:1], checkpoint_dir=tmp_path)
    assert b.restore() == 1
    for x, y in zip(jax.tree.leaves(host(b.params())), jax.tree.leaves(saved), strict=True):
        assert x.dtype == np.float32
        np.testing.assert_array_equal(x, y.astype(np.float32))
    b.train_step(random_batch(1))  # and it trains on from there
    b.close()


def test_fields_added_after_a_checkpoint_compare_as_their_defaults(tmp_path):
    """A checkpoint from before the model config had a field (the MoE fields, say) restores into
    a config that leaves it at its default, and only there; how the experts are computed
    (model.expert_kernel) is never part of the identity."""
    from rlax_tpu.trainer.checkpoint import Checkpointer, model_signature

    dense = models.preset("tiny")
    older = {
        k: v
        for k, v in model_signature(dense).items()
        if k not in ("num_experts", "experts_per_token", "expert_intermediate_size")
    }
    assert "expert_kernel" not in model_signature(
        dataclasses.replace(dense, expert_kernel="megablox")
    )
    ckpt = Checkpointer(tmp_path, keep=1, signature=model_signature(dense))
    ckpt._check_signature(3, older)  # a dense model then and now
    moe = models.preset("tiny", arch="qwen3_moe", num_experts=4)
    ckpt.signature = model_signature(moe)
    with pytest.raises(CheckpointMismatchError, match="num_experts: checkpoint 0, config 4"):
        ckpt._check_signature(3, older)
    ckpt.close()
