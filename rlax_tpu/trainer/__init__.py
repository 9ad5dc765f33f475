"""Trainer service: sharded JAX train steps, aligned log-prob recompute, Orbax checkpoints."""
