"""HumanEval-style problems: the completed function, then its test code, run in the sandbox.

A program that exits 0 before its asserts ran (``sys.exit(0)`` in the completion) must not pass,
so the harness prints a per-run nonce after ``check`` returns and only that proves success. The
nonce comes on stdin, not in the source, so identical sources still share one syntax check.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from pathlib import Path

from rlax_tpu.config import VerifierConfig
from rlax_tpu.types import Verdict, VerdictKind
from rlax_tpu.verifiers.api import UnitTestTask
from rlax_tpu.verifiers.compiler import Compiler
from rlax_tpu.verifiers.outcomes import classify, program_limits
from rlax_tpu.verifiers.sandbox import Mount, Sandbox

_TIME_FACTOR = 5  # a whole test suite gets this many per-test time limits


def program_text(task: UnitTestTask) -> str:
    lines = task.code.splitlines()
    future = [ln for ln in lines if ln.startswith("from __future__")]  # must stay first
    body = "\n".join(ln for ln in lines if not ln.startswith("from __future__"))
    call = f"check({task.entry_point})\n" if task.entry_point else ""
    return (
        "\n".join(future) + "\nimport sys as _rlax_sys\n"
        "_rlax_nonce = _rlax_sys.stdin.readline().strip()\n\n"
        f"{body}\n\n{task.test}\n\n{call}"
        '_rlax_sys.stdout.write("\\n" + _rlax_nonce + "\\n")\n'
    )


class UnitTestRunner:
    def __init__(
        self, config: VerifierConfig, *, sandbox: Sandbox, compiler: Compiler, scratch_dir: Path
    ):
        self._config, self._sandbox, self._compiler = config, sandbox, compiler
        self._scratch = Path(scratch_dir)
        self._scratch.mkdir(parents=True, exist_ok=True)

    def run(self, task: UnitTestTask) -> Verdict:
        built = self._compiler.compile("python", program_text(task))
        if isinstance(built, Verdict):
            return built
        memory_mb = self._config.memory_limit_mb
        limits = program_limits(
            built,
            time_limit_s=task.time_limit_s or self._config.time_limit_s * _TIME_FACTOR,
            memory_mb=memory_mb,
            output_bytes=self._config.max_output_bytes,
            disk_bytes=self._config.disk_limit_mb << 20,
        )
        nonce = secrets.token_hex(16)
        tmp = Path(tempfile.mkdtemp(prefix="unit-", dir=self._scratch))
        try:
            stdin = tmp / "nonce"
            stdin.write_text(nonce + "\n")
            stdin.chmod(0o444)
            result = self._sandbox.run(
                built.argv(memory_mb),
                limits=limits,
                mounts=[*built.mounts, Mount(stdin, "/input")],
                stdin="/input",
            )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        timing = dict(time_s=result.cpu_time_s, memory_bytes=result.max_rss_bytes, tests_total=1)
        failure = classify(result, limits, memory_mb)
        if failure is None:
            lines = result.stdout.decode(errors="replace").split()
            if lines and lines[-1] == nonce:
                return Verdict(kind=VerdictKind.ACCEPTED, tests_passed=1, score=1.0, **timing)
            return Verdict(
                kind=VerdictKind.WRONG_ANSWER, detail="exited before the tests finished", **timing
            )
        kind, detail = failure
        if kind is VerdictKind.RUNTIME_ERROR and b"AssertionError" in result.stderr:
            kind, detail = VerdictKind.WRONG_ANSWER, "a test assertion failed"
        return Verdict(kind=kind, detail=detail, **timing)
