"""Preemption drills: ``python -m rlax_tpu.drills``."""
