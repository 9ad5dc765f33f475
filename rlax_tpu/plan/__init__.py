"""Planning a run before renting it (issue [planner]): models of the controller's schedule fed
by per-step costs: the deterministic schedule (``simulate``) and the throughput schedule
(``throughput``). The command, the AOT-derived costs and their calibration are not built yet."""

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
