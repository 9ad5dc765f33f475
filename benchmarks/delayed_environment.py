"""A plugin for benchmarks/episode_schedule.py: ``delayed_code_repair``, the code_repair
environment with ``RLAX_ENV_DELAY_S`` seconds (default 0.5) slept before each reply, as an
environment that calls a remote service or runs a slow tool would take.

    --config.algorithm.plugins=delayed_environment --config.environment.name=delayed_code_repair
    (with benchmarks/ on PYTHONPATH)
"""

from __future__ import annotations

import os
import time

from rlax_tpu.environments import register_environment
from rlax_tpu.environments.code_repair import CodeRepair


class DelayedCodeRepair(CodeRepair):
    def reply(self, problem, answers, tools):
        time.sleep(float(os.environ.get("RLAX_ENV_DELAY_S", "0.5")))
        return super().reply(problem, answers, tools)


register_environment("delayed_code_repair", DelayedCodeRepair)
