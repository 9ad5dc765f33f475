"""Planning a run before renting it (issue [planner], ``python -m rlax_tpu.plan``): models of the
controller's schedule (deterministic: ``simulate``; throughput: ``throughput``) fed by costs from
the AOT check's program rooflines (``costs``) or a run's metrics (``calibrate``), with groups'
lengths drawn from a distribution (``lengths``), summarized by ``predict``."""

from rlax_tpu.plan.simulate import Costs, Schedule, StepTimes, simulate_deterministic
from rlax_tpu.plan.throughput import ThroughputCosts, ThroughputSchedule, simulate_throughput

__all__ = [
    "Costs",
    "Schedule",
    "StepTimes",
    "ThroughputCosts",
    "ThroughputSchedule",
    "simulate_deterministic",
    "simulate_throughput",
]
