"""An environment of a user's own that fails on some episodes, as a plugin module
(``--config.algorithm.plugins='("tests.environments.plugin_flaky",)'
--config.environment.name=flaky``): the verifier's verdict as feedback, as code_repair; but the
first reply to a problem whose id hashes to 0 mod 8 raises, and to 1 mod 8 hangs for a minute.
A pure function of the problem: a resumed run meets the same failures."""

from __future__ import annotations

import time

from rlax_tpu.environments import Reply, register_environment
from tests.environments.flaky_kinds import kind

HANG_S = 60.0


class Flaky:
    def reply(self, problem, answers, tools) -> Reply:
        verdict = tools.verify(problem, answers[-1])
        reward = 1.0 if verdict.accepted else 0.0
        if len(answers) == 1:
            what = kind(problem.id)
            if what == "raises":
                raise RuntimeError(f"flaky environment: problem {problem.id}")
            if what == "hangs":
                time.sleep(HANG_S)
        if verdict.accepted or len(answers) >= 2:
            return Reply(text=None, reward=reward, verdict=verdict)
        return Reply(text="Try again.", reward=reward, verdict=verdict)


register_environment("flaky", lambda max_turns: Flaky())
