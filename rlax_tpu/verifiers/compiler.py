"""Compile once, run many times: sandboxed compilation with a content-keyed cache.

Compilation is untrusted work too (template-recursion and constexpr bombs, ``#include
"/dev/zero"``), so it runs in the sandbox under its own time, memory and output limits; a failure
is a compile-error verdict, never an exception. Identical sources (common within a GRPO group) are
compiled once; concurrent requests for the same source wait for the first build.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import shutil
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

from rlax_tpu.types import Verdict, VerdictKind
from rlax_tpu.verifiers import languages
from rlax_tpu.verifiers.languages import PROG, Language, Toolchains
from rlax_tpu.verifiers.sandbox import Limits, Mount, Sandbox
from rlax_tpu.verifiers.syntax_check import CheckerUnavailable, PythonSyntaxChecker

MAX_SOURCE_BYTES = 512 << 10
_DETAIL_CHARS = 600


@dataclasses.dataclass(frozen=True)
class Executable:
    language: Language
    directory: Path  # host directory, mounted read-only at /prog
    run_argv: tuple[str, ...]

    def argv(self, memory_mb: int) -> list[str]:
        return languages.fill(self.run_argv, mem_mb=memory_mb)

    @property
    def mounts(self) -> list[Mount]:
        return [Mount(self.directory, PROG)]


def compile_limits(*, time_limit_s: float, memory_mb: int, disk_bytes: int) -> Limits:
    return Limits(
        cpu_time_s=time_limit_s,
        wall_time_s=time_limit_s * 2 + 5,
        memory_bytes=memory_mb << 20,
        output_bytes=256 << 20,
        disk_bytes=disk_bytes,
        processes=128,
        open_files=256,
        stack_bytes=64 << 20,
    )


class Compiler:
    def __init__(
        self,
        sandbox: Sandbox,
        toolchains: Toolchains,
        build_dir: Path,
        limits: Limits,
        *,
        cache_size: int = 2048,
        python_checker: PythonSyntaxChecker | None = None,
    ):
        """``python_checker``: checks Python syntax without a sandbox run (None: a sandbox run)."""
        self._sandbox, self._toolchains, self._limits = sandbox, toolchains, limits
        self._python_checker = python_checker
        self._dir = Path(build_dir)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, Future] = collections.OrderedDict()

    def compile(
        self,
        language: str,
        code: str,
        *,
        extra_flags: Sequence[str] = (),
        extra_mounts: Sequence[Mount] = (),
        cache_salt: str = "",
    ) -> Executable | Verdict:
        """An Executable, or a COMPILE_ERROR / INTERNAL_ERROR verdict."""
        lang = self._toolchains.languages.get(language)
        if lang is None:
            why = self._toolchains.missing.get(language, "not a supported language")
            return Verdict(kind=VerdictKind.INTERNAL_ERROR, detail=f"{language}: {why}")
        source = code.encode("utf-8", errors="replace")
        if len(source) > MAX_SOURCE_BYTES:
            return Verdict(
                kind=VerdictKind.COMPILE_ERROR,
                detail=f"source is {len(source)} bytes; the limit is {MAX_SOURCE_BYTES}",
            )
        key = hashlib.sha256(
            b"\0".join(
                [language.encode(), source, *(f.encode() for f in extra_flags), cache_salt.encode()]
            )
        ).hexdigest()
        with self._lock:
            fut = self._cache.get(key)
            owner = fut is None
            if owner:
                fut = self._cache[key] = Future()
                self._evict()
            else:
                self._cache.move_to_end(key)
        if owner:
            try:
                fut.set_result(self._build(key, lang, code, extra_flags, extra_mounts))
            except BaseException as e:
                fut.set_exception(e)
                with self._lock:
                    self._cache.pop(key, None)
        result = fut.result()
        if isinstance(result, Verdict) and result.kind is VerdictKind.INTERNAL_ERROR:
            with self._lock:  # an infrastructure hiccup is not cached
                if self._cache.get(key) is fut:
                    del self._cache[key]
        return result

    def _evict(self) -> None:
        while len(self._cache) > self._cache_size:
            key, old = self._cache.popitem(last=False)
            if old.done() and not old.exception() and isinstance(old.result(), Executable):
                shutil.rmtree(old.result().directory, ignore_errors=True)

    def _check_python(
        self, out: Path, lang: Language, src_name: str, source: bytes, run_argv: tuple[str, ...]
    ) -> Executable | Verdict:
        t0 = time.perf_counter()
        try:
            error = self._python_checker.check(source, f"{PROG}/{src_name}")
        except CheckerUnavailable as e:
            shutil.rmtree(out, ignore_errors=True)
            return Verdict(kind=VerdictKind.INTERNAL_ERROR, detail=f"compiler: {e}")
        if error is None:
            return Executable(language=lang, directory=out, run_argv=run_argv)
        shutil.rmtree(out, ignore_errors=True)
        return Verdict(
            kind=VerdictKind.COMPILE_ERROR,
            detail=error.strip()[:_DETAIL_CHARS],
            time_s=time.perf_counter() - t0,
        )

    def _build(
        self,
        key: str,
        lang: Language,
        code: str,
        extra_flags: Sequence[str],
        extra_mounts: Sequence[Mount],
    ) -> Executable | Verdict:
        out = self._dir / key[:40]
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(mode=0o755)
        src_name, run_argv = languages.source_and_run(lang, code)
        source = code.encode("utf-8", errors="replace")  # the bytes the program will run from
        (out / src_name).write_bytes(source)
        if lang.name == "python" and self._python_checker is not None and not extra_flags:
            return self._check_python(out, lang, src_name, source, run_argv)
        argv = languages.fill(lang.compile, src=src_name, mem_mb=self._limits.memory_bytes >> 21)
        argv[1:1] = list(extra_flags)
        result = self._sandbox.run(
            argv,
            limits=self._limits,
            mounts=[Mount(out, PROG, writable=True), *extra_mounts],
            cwd=PROG,
            writable_dirs=[out],
        )
        if result.error:
            shutil.rmtree(out, ignore_errors=True)
            return Verdict(kind=VerdictKind.INTERNAL_ERROR, detail=f"compiler: {result.error}")
        if result.ok:
            return Executable(language=lang, directory=out, run_argv=run_argv)
        shutil.rmtree(out, ignore_errors=True)
        timing = dict(time_s=result.cpu_time_s, memory_bytes=result.max_rss_bytes)
        if result.timed_out or result.cpu_time_s >= self._limits.cpu_time_s:
            return Verdict(
                kind=VerdictKind.COMPILE_ERROR,
                detail=f"compilation exceeded {self._limits.cpu_time_s:g} s",
                **timing,
            )
        message = (result.stderr or result.stdout).decode(errors="replace").strip()
        return Verdict(
            kind=VerdictKind.COMPILE_ERROR,
            detail=message[:_DETAIL_CHARS] or f"compiler exited with {result.exit_code}",
            **timing,
        )
