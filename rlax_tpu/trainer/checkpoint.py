"""Orbax checkpoints of the trainer state: params, optimizer state, step and RNG.

Saves are asynchronous (the device-to-host copy happens in ``save``, the writes in the
background) and committed atomically by Orbax: a checkpoint killed mid-write is never listed, so
``latest_step`` only names complete ones. Restores take the *target* shardings, so a checkpoint
written on one mesh restores onto another. Each checkpoint records the model architecture; one
from a different model is refused with the differing fields named.

Each checkpoint also records two checksums of every array (wrapping uint32 sums of its bits as
words, plain and weighted by odd position factors, so any one flipped bit changes both; computed
on the devices where the array lives, integer sums being the same on any mesh), committed with
it in the same Orbax checkpoint. A restore recomputes them: a flipped bit
anywhere in the data, or a file that no longer decodes, is a :class:`CorruptCheckpointError`,
never a silently different model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from rlax_tpu import storage
from rlax_tpu.config import ModelConfig, to_dict

# Model fields that do not change what the checkpointed arrays mean.
_RUN_FIELDS = ("weights_format", "weights_path", "tokenizer_path", "seed")
_LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_targets")
# How the model is computed, not what it computes: never part of a checkpoint's identity.
_EXECUTION_FIELDS = ("expert_kernel",)


class CheckpointMismatchError(ValueError):
    """A checkpoint written for a different model (or objective head) than the trainer's."""


class NoCheckpointError(FileNotFoundError):
    """No complete checkpoint where one was asked for."""


class CorruptCheckpointError(RuntimeError):
    """A complete checkpoint whose data does not match its recorded checksums (or no longer
    decodes): storage damaged it after it was written. ``step``: which one."""

    def __init__(self, step: int, message: str):
        self.step = step
        super().__init__(message)


def _words(x: jax.Array) -> jax.Array:
    """The array's bits as uint32 words (any dtype up to 8 bytes)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = x.dtype.itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # a trailing axis of 2
    small = {1: jnp.uint8, 2: jnp.uint16}[size]
    return jax.lax.bitcast_convert_type(x, small).astype(jnp.uint32)


@jax.jit
def _checksum(x: jax.Array) -> jax.Array:
    """x (any shape) -> [sum, position-weighted sum] of its uint32 words (exact mod 2^32)."""
    w = _words(x).ravel()
    odd = jnp.arange(w.size, dtype=jnp.uint32) * np.uint32(2) + np.uint32(1)
    return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * odd, dtype=jnp.uint32)])


def checksums(state: Any) -> dict[str, list[int]]:
    """{leaf path: [sum, position-weighted sum]} (uint32) of a pytree of arrays."""
    # A program per leaf shape, not one over the tree: a model's layers repeat a few shapes, and
    # one program of every leaf took XLA:CPU time superlinear in the leaves (SmolLM2-135M's
    # state, 800 leaves: 43 s to compile). Each result is fetched before the next leaf's
    # program starts: XLA:CPU deadlocked on many small sharded programs in flight at once (their
    # all-reduces waited on device threads the others held).
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        v = jax.device_get(_checksum(x))
        out[jax.tree_util.keystr(path)] = [int(v[0]), int(v[1])]
    return out


def dtypes(state: Any) -> dict[str, str]:
    """{leaf path: dtype name} of a pytree of arrays (the paths ``checksums`` uses)."""
    return {
        jax.tree_util.keystr(path): jnp.dtype(x.dtype).name
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]
    }


def _with_dtypes(abstract: Any, names: dict[str, str]) -> Any:
    """``abstract`` (ShapeDtypeStructs) with each leaf's dtype from ``names`` where it has one."""

    def one(path: Any, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        name = names.get(jax.tree_util.keystr(path))
        if name is None or name == jnp.dtype(x.dtype).name:
            return x
        return jax.ShapeDtypeStruct(x.shape, jnp.dtype(name), sharding=x.sharding)

    return jax.tree_util.tree_map_with_path(one, abstract)


def model_signature(cfg: ModelConfig) -> dict[str, Any]:
    """The architecture fields a checkpoint must match (resolved, run-only fields dropped; as
    JSON keeps them, lists for tuples). A LoRA checkpoint holds the adapters alone, so where
    the base comes from is part of its identity: it keeps the weights' format, path and seed."""
    fields = json.loads(json.dumps(to_dict(cfg)))
    for name in _EXECUTION_FIELDS:
        fields.pop(name, None)
    if not cfg.lora_rank:
        for name in (*_RUN_FIELDS, *_LORA_FIELDS):  # as before LoRA: older checkpoints match
            fields.pop(name, None)
    else:
        fields.pop("tokenizer_path", None)
    fields["head_dim"] = cfg.resolved_head_dim
    return fields


_MODEL_DEFAULTS = json.loads(json.dumps(to_dict(ModelConfig())))


class Checkpointer:
    """Trainer checkpoints under ``directory`` (a local path or gs://: Orbax writes through
    TensorStore and commits a gs:// checkpoint with a marker object instead of a rename)."""

    def __init__(self, directory: str | os.PathLike, *, keep: int, signature: dict[str, Any]):
        self.directory = os.fspath(storage.path(directory))
        self.signature = signature
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True, create=True
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Starts an asynchronous save of ``state`` (a pytree of jax arrays) as ``step``."""
        meta = {
            "step": step,
            "signature": self.signature,
            "checksums": checksums(state),
            "dtypes": dtypes(state),
        }
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
        )

    def delete(self, step: int) -> None:
        """Removes checkpoint ``step`` (a corrupt one, so a later save of that step can land)."""
        self.wait()
        self._manager.delete(step)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def restore(self, step: int | None, abstract_state: dict[str, Any]) -> tuple[int, Any]:
        """(step, state) with every array placed as ``abstract_state``'s ShapeDtypeStruct says.

        ``step=None`` takes the newest complete checkpoint.
        """
        self.wait()
        step = self.latest_step() if step is None else step
        if step is None or step not in self.steps():
            raise NoCheckpointError(
                f"no complete trainer checkpoint {'' if step is None else step} in "
                f"{self.directory} (have: {self.steps()})"
            )
        try:
            meta = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )["meta"]
        except Exception as e:
            raise CorruptCheckpointError(
                step, f"checkpoint {step} in {self.directory}: its metadata does not read: {e}"
            ) from e
        self._check_signature(step, meta["signature"])
        # Read as saved (the checksums are over the saved bits), then cast to the trainer's
        # dtypes: a checkpoint of bf16 masters restores into float32 ones and back.
        # (Checkpoints from before "dtypes" were recorded restore in the target's dtypes.)
        saved_as = _with_dtypes(abstract_state, meta.get("dtypes", {}))
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(saved_as))
            )["state"]
        except (ValueError, KeyError) as e:
            raise CheckpointMismatchError(
                f"checkpoint {step} in {self.directory} does not fit this trainer's state "
                f"(a different objective or optimizer?): {e}"
            ) from e
        except Exception as e:
            raise CorruptCheckpointError(
                step, f"checkpoint {step} in {self.directory} does not decode: {e}"
            ) from e
        if "checksums" in meta:  # checkpoints from before checksums restore unverified
            got = checksums(restored)
            bad = sorted(k for k, v in meta["checksums"].items() if got.get(k) != v)
            if bad:
                raise CorruptCheckpointError(
                    step,
                    f"checkpoint {step} in {self.directory} is corrupt: {len(bad)} array(s) "
                    f"differ from their recorded checksums ({', '.join(bad[:3])})",
                )
        cast = lambda x, a: x if x.dtype == a.dtype else x.astype(a.dtype)  # noqa: E731
        return step, jax.tree.map(cast, restored, abstract_state)

    def _check_signature(self, step: int, saved: dict[str, Any]) -> None:
        # A field the checkpoint does not record was added to the model config after it was
        # written: its default is what the checkpoint's model was (a dense model has
        # num_experts 0), so only another value is a mismatch.
        saved = _MODEL_DEFAULTS | saved
        diffs = [
            f"{k}: checkpoint {saved.get(k)!r}, config {v!r}"
            for k, v in self.signature.items()
            if saved.get(k) != v
        ]
        if diffs:
            raise CheckpointMismatchError(
                f"checkpoint {step} in {self.directory} was written for a different model: "
                + "; ".join(diffs)
            )

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a pytree of jax arrays."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def signature_with(cfg: ModelConfig, **extra: Any) -> dict[str, Any]:
    return model_signature(cfg) | {f"trainer.{k}": v for k, v in extra.items()}


@dataclasses.dataclass(frozen=True)
class CheckpointReport:
    """What :func:`inspect_checkpoints` found for one step."""

    step: int
    complete: bool  # Orbax committed it and every array matches its recorded checksum
    detail: str  # why not, or ""
    sha256: str  # over every array of the state (paths, dtypes, shapes, bytes); "" if not complete


def inspect_checkpoints(directory: str | os.PathLike) -> list[CheckpointReport]:
    """Reads every committed checkpoint under ``directory`` as saved (no trainer needed),
    verifies it against its checksums and digests it; uncommitted leftovers (a save cut short)
    are reported as incomplete. For drills and audits: this loads each state in full."""
    root = storage.path(directory)
    found = []
    manager = ocp.CheckpointManager(os.fspath(root))
    try:
        committed = set(manager.all_steps())
        for step in sorted(committed):
            found.append(_inspect_one(manager, step))
    finally:
        manager.close()
    leftovers = sorted(
        int(p.name.split(".")[0])
        for p in root.iterdir()
        if p.name.split(".")[0].isdigit() and int(p.name.split(".")[0]) not in committed
    )
    found += [CheckpointReport(s, False, "not committed (a save cut short)", "") for s in leftovers]
    return sorted(found, key=lambda r: r.step)


def _inspect_one(manager: ocp.CheckpointManager, step: int) -> CheckpointReport:
    try:
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                # Onto this process's first device whatever topology saved it: Orbax refuses
                # a saved multi-process sharding here ("Topology mismatch") without a fallback.
                state=ocp.args.StandardRestore(
                    fallback_sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])
                ),
                meta=ocp.args.JsonRestore(),
            ),
        )
    except Exception as e:
        return CheckpointReport(step, False, f"does not read: {e}", "")
    state, meta = restored["state"], restored["meta"]
    # Read without the trainer's tree, named tuples come back as dicts and lists as dicts of
    # "0", "1", ...: paths are compared in one spelling.
    got = {_canonical(k): v for k, v in checksums(jax.tree.map(jnp.asarray, state)).items()}
    bad = sorted(k for k, v in meta.get("checksums", {}).items() if got.get(_canonical(k)) != v)
    if bad:
        return CheckpointReport(step, False, f"checksum mismatch in {', '.join(bad[:3])}", "")
    return CheckpointReport(step, True, "", tree_sha256(state))


def tree_sha256(tree: Any) -> str:
    """SHA-256 over a pytree's paths, dtypes, shapes and bytes (bitwise identity; arrays are
    fetched to the host)."""
    digest = hashlib.sha256()
    for path, leaf in sorted(
        jax.tree_util.tree_leaves_with_path(tree), key=lambda kv: jax.tree_util.keystr(kv[0])
    ):
        a = np.asarray(jax.device_get(leaf))
        digest.update(f"{jax.tree_util.keystr(path)}|{a.dtype}|{a.shape}".encode())
        digest.update(np.ascontiguousarray(a).tobytes())
    return digest.hexdigest()


def _canonical(path: str) -> str:
    """A keystr path with attributes and list indices spelled as dict keys: .mu[0] -> ['mu']['0']."""
    return re.sub(r"\[(\d+)\]", r"['\1']", re.sub(r"\.(\w+)", r"['\1']", path))
