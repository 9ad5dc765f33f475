"""rlax_tpu: parameter-server RL post-training for LLMs in JAX (see README.md and DESIGN.md)."""

__version__ = "0.1.0"
