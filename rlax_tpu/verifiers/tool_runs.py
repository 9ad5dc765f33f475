"""Programs run for an environment's tool call (``RunTask``): compiled and sandboxed like a
graded program, with its stdout as the result instead of a comparison against answers."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from rlax_tpu.config import VerifierConfig
from rlax_tpu.types import Verdict, VerdictKind
from rlax_tpu.verifiers.api import RunTask
from rlax_tpu.verifiers.compiler import Compiler
from rlax_tpu.verifiers.outcomes import classify, whole_program_limits
from rlax_tpu.verifiers.sandbox import Mount, Sandbox

RUN_OUTPUT_CHARS = 4000  # of stdout in a verdict: a tool's answer, not a data channel
_STDERR_CHARS = 1000  # the tail of stderr on a failure (the traceback's end)


class ToolRunner:
    def __init__(
        self, config: VerifierConfig, *, sandbox: Sandbox, compiler: Compiler, scratch_dir: Path
    ):
        self._config, self._sandbox, self._compiler = config, sandbox, compiler
        self._scratch = Path(scratch_dir)
        self._scratch.mkdir(parents=True, exist_ok=True)

    def run(self, task: RunTask) -> Verdict:
        if task.language not in self._config.languages:
            return Verdict(
                kind=VerdictKind.COMPILE_ERROR,
                detail=f"language {task.language!r} is not enabled (verifiers.languages)",
            )
        built = self._compiler.compile(task.language, task.code)
        if isinstance(built, Verdict):
            return built
        memory_mb = self._config.memory_limit_mb
        limits = whole_program_limits(self._config, built, task.time_limit_s)
        tmp = Path(tempfile.mkdtemp(prefix="run-", dir=self._scratch))
        try:
            stdin = tmp / "input"
            stdin.write_text(task.stdin)
            result = self._sandbox.run(
                built.argv(memory_mb),
                limits=limits,
                mounts=[*built.mounts, Mount(stdin, "/input")],
                stdin="/input",
            )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        timing = dict(time_s=result.cpu_time_s, memory_bytes=result.max_rss_bytes)
        out = _clip(result.stdout.decode(errors="replace"), RUN_OUTPUT_CHARS)
        failure = classify(result, limits, memory_mb)
        if failure is None:
            return Verdict(kind=VerdictKind.ACCEPTED, detail=out, score=1.0, **timing)
        kind, why = failure
        err = result.stderr.decode(errors="replace").strip()
        err = err if len(err) <= _STDERR_CHARS else "..." + err[-_STDERR_CHARS:]
        detail = "\n".join(part for part in (why, out.rstrip(), err) if part)
        return Verdict(kind=kind, detail=detail, **timing)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n] + f"\n... ({len(text) - n} more characters)"
