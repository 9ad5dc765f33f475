"""The CPU decode step's native kernels: ``native/decode_kernels.cpp``, XLA FFI custom calls
built with the host's C++ compiler on first use and cached: the paged decode attention and the
sampler's logit statistics (:func:`logit_stats`).

What it does that XLA:CPU's block attention cannot: it reads each row's keys and values where
they lie in the pages (XLA gathers a copy of every block first), keeps a query group's partial
sums in registers, and writes the step's new key/value into the pages in place (the page
buffers are aliased to its outputs, so no scatter). A (row, KV head) is computed in one fixed
order whatever thread runs it, so a row's bits depend on its own inputs only (the engine's
start-up check, ``programs.rows_are_independent``, still verifies it).

Built with ``-march=native`` for the CPU it runs on: the cached library's name carries a hash
of the source, the flags, jaxlib's version and the CPU's model and feature flags, so a home
directory shared between hosts of different CPUs keeps one build per CPU.

``inference.attention_kernel`` chooses: ``native`` (this kernel; an error where it cannot be
built), ``xla`` (:func:`rlax_tpu.models.paged_attention.block_attention`), ``auto`` (native
where a C++ compiler is found, else xla with one warning).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "native" / "decode_kernels.cpp"
TARGET = "rlax_tpu_paged_decode_attention"
STATS_TARGET = "rlax_tpu_logit_stats"
FLAGS = (
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-fopenmp-simd",
    "-std=c++17",
    "-shared",
    "-fPIC",
)
# Head dims and query heads per KV head the kernel is instantiated for (its Dispatch).
HEAD_DIMS = (16, 32, 64, 128, 256)
MAX_GROUP = 8
KERNELS = ("auto", "native", "xla")


class NativeUnavailable(RuntimeError):
    """The native kernel cannot be built or loaded here (the message says why)."""


def supports(head_dim: int, heads: int, kv_heads: int, dtype: jnp.dtype) -> bool:
    """Whether the kernel is instantiated for this attention shape (f32 pages only)."""
    return (
        jnp.dtype(dtype) == jnp.float32
        and head_dim in HEAD_DIMS
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_GROUP
    )


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (what ``-march=native`` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags")]
    return "\n".join(dict.fromkeys(keep))


# A build takes seconds; a compiler stuck longer than this falls back to XLA ("auto").
BUILD_TIMEOUT_S = float(os.environ.get("RLAX_TPU_NATIVE_BUILD_TIMEOUT_S", "600"))


def cache_dir() -> Path:
    """Where built kernels are kept: ``$RLAX_TPU_NATIVE_DIR``, else ~/.cache/rlax_tpu/native."""
    env = os.environ.get("RLAX_TPU_NATIVE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "rlax_tpu" / "native"


def build() -> Path:
    """The kernel's shared library for this host, compiled on first use (a few seconds).
    Raises NativeUnavailable when no compiler is found or the build fails."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise NativeUnavailable(
            "no C++ compiler (g++ or $CXX) to build the native decode "
            "attention; set inference.attention_kernel = 'xla'"
        )
    include = jax.ffi.include_dir()
    key = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        " ".join(FLAGS).encode(),
        jax.lib.__version__.encode(),
        _cpu_identity().encode(),
        compiler.encode(),
    ):
        key.update(part)
        key.update(b"\0")
    out = cache_dir() / f"decode_kernels-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the native decode kernels (once per CPU and version) into %s", out)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [compiler, *FLAGS, f"-I{include}", str(SOURCE), "-o", tmp]
    try:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise NativeUnavailable(
                f"building the native decode kernels took over {BUILD_TIMEOUT_S} s: {' '.join(cmd)}"
            ) from None
        if done.returncode != 0:
            raise NativeUnavailable(
                f"building the native decode kernels failed:\n"
                f"{' '.join(cmd)}\n{done.stderr[-4000:]}"
            )
        os.replace(tmp, out)  # atomic: concurrent builders each install a complete library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def _register() -> None:
    import ctypes

    library = ctypes.cdll.LoadLibrary(str(build()))
    jax.ffi.register_ffi_target(
        TARGET, jax.ffi.pycapsule(library.RlaxPagedDecodeAttention), platform="cpu"
    )
    jax.ffi.register_ffi_target(
        STATS_TARGET, jax.ffi.pycapsule(library.RlaxLogitStats), platform="cpu"
    )


@functools.cache
def available() -> bool:
    """Whether the kernel builds and loads here (tries once per process)."""
    try:
        _register()
    except (NativeUnavailable, OSError, AttributeError) as e:
        log.warning(
            "native decode kernels unavailable, using XLA (block attention, XLA sampler): %s", e
        )
        return False
    return True


def resolve(kernel: str) -> bool:
    """``inference.attention_kernel`` -> whether CPU decode rows use the native kernel."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {list(KERNELS)}")
    if kernel == "xla":
        return False
    if kernel == "native":
        _register()  # raises NativeUnavailable with the reason
        return True
    return available()


def decode_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    positions: jax.Array,
    *,
    layer: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Writes row b's new key/value at ``positions[b]`` of ``layer`` (rows with p < 0 or past
    their table write nothing), then attends each row over positions 0..p of its pages.

    q [B, H, D], k_new/v_new [B, Hkv, D], pages [L, Hkv, P, page, D] (all f32), tables [B, M],
    positions [B] int32 -> (out [B, H, D] (padding rows: zeros), k_pages, v_pages)."""
    _register()
    call = jax.ffi.ffi_call(
        TARGET,
        (
            jax.ShapeDtypeStruct(q.shape, jnp.float32),
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
        ),
        input_output_aliases={3: 1, 4: 2},
    )
    f32 = jnp.float32
    return call(
        q.astype(f32),
        k_new.astype(f32),
        v_new.astype(f32),
        k_pages,
        v_pages,
        block_tables.astype(jnp.int32),
        positions.astype(jnp.int32),
        layer=np.int64(layer),
    )


def logit_stats(
    logits: jax.Array, temperature: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per row of ``y = logits / temperature``: (top, log_sum, best), where top = max y (0 when
    that max is not finite), log_sum = log(sum(exp(y - top))) and best = the first index with
    y == top (0 when none): what the sampler needs of a row without materializing y.

    logits [N, V] f32, temperature [N] f32 (> 0) -> top [N] f32, log_sum [N] f32, best [N] int32."""
    _register()
    n = logits.shape[0]
    call = jax.ffi.ffi_call(
        STATS_TARGET,
        (
            jax.ShapeDtypeStruct((n,), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.int32),
        ),
    )
    return call(logits.astype(jnp.float32), temperature.astype(jnp.float32))
