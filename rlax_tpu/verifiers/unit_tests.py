"""HumanEval-style problems: the completed function, then its test code, run in the sandbox.

The test code is trusted, the completion is not: ``unit_harness.py`` runs ``check(candidate)`` in
one process and the completion in another that returns plain data only (see there for why no
completion can forge a pass). The test code reaches the harness on stdin from a root-only file,
so the completion cannot read the expected answers either. Only the completion is "compiled" (a
syntax check), so identical completions share one check whatever their tests.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from rlax_tpu.config import VerifierConfig
from rlax_tpu.types import Verdict, VerdictKind
from rlax_tpu.verifiers.api import UnitTestTask
from rlax_tpu.verifiers.compiler import Compiler
from rlax_tpu.verifiers.languages import PROG
from rlax_tpu.verifiers.outcomes import classify, whole_program_limits
from rlax_tpu.verifiers.sandbox import Mount, Sandbox

_TIME_FACTOR = 5  # a whole test suite gets this many per-test time limits
HARNESS = Path(__file__).with_name("unit_harness.py")
_HARNESS_IN_SANDBOX = "/.rlax/unit_harness.py"
# What the harness may report; anything else (or nothing) is not a pass.
_REPORTED = {k.value: k for k in VerdictKind if k is not VerdictKind.COMPILE_ERROR}


class UnitTestRunner:
    def __init__(
        self, config: VerifierConfig, *, sandbox: Sandbox, compiler: Compiler, scratch_dir: Path
    ):
        self._config, self._sandbox, self._compiler = config, sandbox, compiler
        self._scratch = Path(scratch_dir)
        self._scratch.mkdir(parents=True, exist_ok=True)

    def run(self, task: UnitTestTask) -> Verdict:
        built = self._compiler.compile("python", task.code)
        if isinstance(built, Verdict):
            return built
        memory_mb = self._config.memory_limit_mb
        limits = whole_program_limits(self._config, built, task.time_limit_s, factor=_TIME_FACTOR)
        tmp = Path(tempfile.mkdtemp(prefix="unit-", dir=self._scratch))
        try:
            spec = tmp / "spec"  # root-only: the launcher opens it before dropping to the uid
            spec.write_text(json.dumps({"test": task.test, "entry_point": task.entry_point}))
            spec.chmod(0o400)
            result = self._sandbox.run(
                [
                    built.argv(memory_mb)[0],
                    "-I",
                    "-S",
                    _HARNESS_IN_SANDBOX,
                    f"{PROG}/{built.language.source_file}",
                ],
                limits=limits,
                mounts=[*built.mounts, Mount(HARNESS, _HARNESS_IN_SANDBOX), Mount(spec, "/input")],
                stdin="/input",
            )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        timing = dict(time_s=result.cpu_time_s, memory_bytes=result.max_rss_bytes, tests_total=1)
        failure = classify(result, limits, memory_mb)
        if failure is not None:
            return Verdict(kind=failure[0], detail=failure[1], **timing)
        kind, detail = _report(result.stdout)
        if kind is VerdictKind.ACCEPTED:
            return Verdict(kind=kind, tests_passed=1, score=1.0, **timing)
        return Verdict(kind=kind, detail=detail, **timing)


def _report(stdout: bytes) -> tuple[VerdictKind, str]:
    """The harness's one-line report; anything else fails closed (a model failure)."""
    try:
        report = json.loads(stdout)
        kind = _REPORTED[report["kind"]]
        detail = str(report["detail"])[:300]
    except (ValueError, KeyError, TypeError):
        return VerdictKind.WRONG_ANSWER, "the tests reported no result"
    return kind, detail
