"""``VerifierService``: the passive verifier component, in process (DESIGN.md §1, §9).

The controller hands it many rollouts at once (``verify``). Work runs on a bounded pool: one
sandbox slot (its own uid) per ``verifiers.workers``; coordinator threads compile, fan tests out
and collect verdicts. At most ``max_pending`` tasks are in flight: a batch that would exceed that
is refused with ``Overloaded`` (gRPC: RESOURCE_EXHAUSTED) rather than queued without bound. A
request past its deadline gets INTERNAL_ERROR verdicts for unfinished tasks (never a model failure)
and their remaining tests are skipped.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import pwd
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path

from rlax_tpu.config import VerifierConfig
from rlax_tpu.types import Verdict, VerdictKind
from rlax_tpu.verifiers import languages, scratch
from rlax_tpu.verifiers.api import (
    CodeTask,
    MathTask,
    Overloaded,
    RunTask,
    Task,
    UnitTestTask,
    UnknownLink,
    check_limits,
)
from rlax_tpu.verifiers.checkers import Checkers
from rlax_tpu.verifiers.compiler import Compiler, compile_limits
from rlax_tpu.verifiers.grading import Grader
from rlax_tpu.verifiers.math_answers import MathChecker
from rlax_tpu.verifiers.repository import Repository
from rlax_tpu.verifiers.sandbox import Sandbox
from rlax_tpu.verifiers.syntax_check import PythonSyntaxChecker
from rlax_tpu.verifiers.tool_runs import ToolRunner
from rlax_tpu.verifiers.unit_tests import UnitTestRunner

log = logging.getLogger(__name__)


class VerifierService:
    def __init__(self, config: VerifierConfig, *, scratch_dir: Path | None = None):
        self.config = config
        self._own_scratch = scratch_dir is None
        if self._own_scratch:
            scratch.sweep_dead()  # what SIGKILLed verifiers left behind
            self._scratch = scratch.make_owned()
        else:
            self._scratch = Path(scratch_dir)
            self._scratch.mkdir(parents=True, exist_ok=True, mode=0o700)
        wanted = tuple(dict.fromkeys((*config.languages, *languages.CHECKER_LANGUAGES)))
        self.toolchains = languages.detect(wanted)
        for name, why in self.toolchains.missing.items():
            role = "" if name in config.languages else " (problems' special checkers need it)"
            log.warning("verifier: %s is unavailable%s: %s", name, role, why)
        self.sandbox = Sandbox(
            uid_base=config.sandbox_uid,
            slots=config.workers,
            scratch_dir=self._scratch / "sandbox",
            toolchain_mounts=self.toolchains.mounts,
            use_seccomp=config.seccomp,
            memory_cgroups=config.memory_cgroups,
        )
        self._python_checker = None
        if config.python_check == "helper" and "python" in self.toolchains.languages:
            self._python_checker = PythonSyntaxChecker(
                uid=_nobody_uid(),
                memory_bytes=config.compile_memory_limit_mb << 20,
                timeout_s=config.compile_time_limit_s,
            )
        repo_dir = Path(config.repository_dir) if config.repository_dir else self._scratch / "repo"
        self.repository = Repository(repo_dir)
        self.compiler = Compiler(
            self.sandbox,
            self.toolchains,
            self._scratch / "build",
            compile_limits(
                time_limit_s=config.compile_time_limit_s,
                memory_mb=config.compile_memory_limit_mb,
                disk_bytes=max(config.disk_limit_mb, 256) << 20,
            ),
            python_checker=self._python_checker,
        )
        self._tests_pool = cf.ThreadPoolExecutor(config.workers * 2, "verifier-test")
        self._tasks_pool = cf.ThreadPoolExecutor(config.workers * 4, "verifier-task")
        checkers = Checkers(self.compiler, self.sandbox, self.repository, config.testlib_path)
        self._grader = Grader(
            config,
            sandbox=self.sandbox,
            compiler=self.compiler,
            checkers=checkers,
            repository=self.repository,
            tests_pool=self._tests_pool,
            scratch_dir=self._scratch / "outputs",
        )
        self._unit_tests = UnitTestRunner(
            config, sandbox=self.sandbox, compiler=self.compiler, scratch_dir=self._scratch / "unit"
        )
        self._tool_runs = ToolRunner(
            config, sandbox=self.sandbox, compiler=self.compiler, scratch_dir=self._scratch / "run"
        )
        self._math = MathChecker(config.workers)
        self._lock = threading.Lock()
        self._pending = 0
        self._closed = False

    # -- repository ---------------------------------------------------------------------------

    def upload(self, data: bytes) -> str:
        return self.repository.upload(data)

    def missing(self, links: Sequence[str]) -> list[str]:
        return self.repository.missing(links)

    # -- verification -------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Tasks accepted and not yet finished (what backpressure counts)."""
        with self._lock:
            return self._pending

    def verify(self, tasks: Sequence[Task], *, deadline_s: float | None = None) -> list[Verdict]:
        """One verdict per task, in order. Raises Overloaded beyond ``max_pending``, ValueError
        for a task whose limits are not finite numbers >= 0."""
        tasks = list(tasks)
        for task in tasks:
            check_limits(task)
        with self._lock:
            if self._closed:
                raise RuntimeError("the verifier service is closed")
            if self._pending + len(tasks) > self.config.max_pending:
                raise Overloaded(
                    f"{self._pending} tasks in flight; {len(tasks)} more would exceed "
                    f"max_pending={self.config.max_pending}"
                )
            self._pending += len(tasks)
        cancelled = threading.Event()
        jobs: list[tuple[cf.Future, list[int]]] = []
        math_at = [i for i, t in enumerate(tasks) if isinstance(t, MathTask)]
        try:
            if math_at:
                items = [(tasks[i].response, tasks[i].answer) for i in math_at]
                jobs.append((self._tasks_pool.submit(self._math.check_many, items), math_at))
            for i, task in enumerate(tasks):
                if not isinstance(task, MathTask):
                    jobs.append((self._tasks_pool.submit(self._one, task, cancelled), [i]))
        finally:
            submitted = sum(len(at) for _, at in jobs)
            self._release(len(tasks) - submitted)
        for fut, at in jobs:
            fut.add_done_callback(functools.partial(self._done, len(at)))
        deadline = deadline_s if deadline_s and deadline_s > 0 else self.config.request_deadline_s
        cf.wait([f for f, _ in jobs], timeout=deadline)
        verdicts: list[Verdict | None] = [None] * len(tasks)
        late = Verdict(
            kind=VerdictKind.INTERNAL_ERROR, detail=f"deadline of {deadline:g} s exceeded"
        )
        for fut, at in jobs:
            if not fut.done():
                cancelled.set()
                fut.cancel()
                got = [late] * len(at)
            elif fut.exception() is not None:
                log.exception("verifier task failed", exc_info=fut.exception())
                err = Verdict(
                    kind=VerdictKind.INTERNAL_ERROR, detail=f"verifier error: {fut.exception()}"
                )
                got = [err] * len(at)
            else:
                result = fut.result()
                got = result if isinstance(result, list) else [result]
            for i, v in zip(at, got, strict=True):
                verdicts[i] = v
        return verdicts  # type: ignore[return-value]

    def _done(self, n: int, _future: cf.Future) -> None:
        self._release(n)

    def _release(self, n: int) -> None:
        with self._lock:
            self._pending -= n

    def _one(self, task: Task, cancelled: threading.Event) -> Verdict:
        if cancelled.is_set():
            return Verdict(kind=VerdictKind.INTERNAL_ERROR, detail="cancelled (deadline exceeded)")
        try:
            if isinstance(task, CodeTask):
                return self._grader.grade(task, cancelled)
            if isinstance(task, UnitTestTask):
                return self._unit_tests.run(task)
            if isinstance(task, RunTask):
                return self._tool_runs.run(task)
        except UnknownLink as e:
            return Verdict(kind=VerdictKind.INTERNAL_ERROR, detail=str(e))
        raise TypeError(f"not a verifier task: {type(task).__name__}")

    def health(self) -> str:
        langs = ", ".join(sorted(set(self.toolchains.languages) & set(self.config.languages)))
        langs = langs or "none"
        groups = self.sandbox.memory_cgroups
        memory = f"per-run cgroups (v{groups.version})" if groups else "peak RSS"
        return (
            f"{self.config.workers} workers, {self.pending} tasks pending, languages: {langs}, "
            f"memory judged by {memory}"
        )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._tasks_pool.shutdown(wait=True, cancel_futures=True)
        self._tests_pool.shutdown(wait=True, cancel_futures=True)
        self._math.close()
        if self._python_checker is not None:
            self._python_checker.close()
        self.sandbox.close()
        if self._own_scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)

    def __enter__(self) -> VerifierService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nobody_uid() -> int:
    # The syntax-check helper runs no code and sets no RLIMIT_NPROC, so `nobody` suits it.
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534
