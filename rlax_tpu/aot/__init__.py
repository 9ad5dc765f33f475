"""Ahead-of-time checks: compile every program of a config for a TPU topology on any machine.

    python -m rlax_tpu.aot --config=configs/codeforces.py:v5p --topology=v5p:4x8x8

JAX runs on the CPU here (``JAX_PLATFORMS=cpu`` unless set): the TPU programs are compiled by
libtpu for a described topology (``jax.experimental.topologies``), never run, so no TPU is needed
or touched. libtpu's one-process-per-host lock guards the chips; a compile-only client uses none,
so it is lifted (``ALLOW_MULTIPLE_LIBTPU_LOAD``) and checks can run beside a job or each other.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
