"""The modular RL objective (RLAX Eq. 3) and its named instantiations: pure JAX functions."""
