"""Planning a run before renting it (issue [planner]): a model of the controller's schedule fed
by per-step costs. So far the deterministic schedule's simulator (``simulate``); the command,
the AOT-derived costs and their calibration are not built yet."""

from rlax_tpu.plan.simulate import Costs, Schedule, StepTimes, simulate_deterministic

__all__ = ["Costs", "Schedule", "StepTimes", "simulate_deterministic"]
