"""rlax_tpu: parameter-server RL post-training for LLMs in JAX (see README.md, docs/ and DESIGN.md)."""

import os as _os

from rlax_tpu.config import detect_accelerator as _detect_accelerator

__version__ = "0.1.0"

# libtpu is installed everywhere (the tpu extra compiles for TPU topologies on any host); on a
# host without accelerators JAX would probe it for chips at start-up and print warnings, so such
# a host runs JAX on the CPU unless JAX_PLATFORMS says otherwise.
if "JAX_PLATFORMS" not in _os.environ and _detect_accelerator() == "cpu":
    _os.environ["JAX_PLATFORMS"] = "cpu"
