"""Problem files and uploading them: from data to a :class:`ProblemSpec` of links.

A problem directory holds ``problem.json``::

    {"id": "any_divisor", "title": "...", "statement": "...",
     "time_limit_s": 1.0, "memory_limit_mb": 256,
     "checker": {"language": "cpp", "file": "checker.cpp"}     # or {"language", "source"}, or null
     "tests": [{"input": "12\\n", "answer": "6\\n"}, ...],
     "solutions": [{"language": "python", "code": "...", "verdict": "accepted"}, ...]}

Checkers follow the testlib protocol (``checker input output answer``, exit 0/1/2/3). The bundled
problems in ``problems/`` have plain C++ or Python checkers; real Codeforces checkers include
``testlib.h``, which is supplied by ``verifiers.testlib_path`` or by the problem (``"testlib"``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from rlax_tpu.verifiers.api import ProblemSpec, TestLinks
from rlax_tpu.verifiers.repository import link_of

BUNDLED_DIR = Path(__file__).with_name("problems")


class Uploader(Protocol):
    def upload(self, data: bytes) -> str: ...

    def missing(self, links: Sequence[str]) -> list[str]: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class Solution:
    language: str
    code: str
    verdict: str  # the expected VerdictKind value
    note: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProblemFiles:
    """A problem as stored on disk (data, not links)."""

    id: str
    title: str
    statement: str
    tests: tuple[tuple[str, str], ...]  # (input, answer)
    time_limit_s: float
    memory_limit_mb: int
    checker_language: str = "cpp"
    checker_source: str = ""  # "" = token-wise comparison
    testlib_source: str = ""
    solutions: tuple[Solution, ...] = ()


def load_problem(directory: Path) -> ProblemFiles:
    directory = Path(directory)
    meta = json.loads((directory / "problem.json").read_text())
    checker = meta.get("checker") or {}
    source = checker.get("source", "")
    if "file" in checker:
        source = (directory / checker["file"]).read_text()
    testlib = (directory / meta["testlib"]).read_text() if meta.get("testlib") else ""
    return ProblemFiles(
        id=meta["id"],
        title=meta.get("title", meta["id"]),
        statement=meta.get("statement", ""),
        tests=tuple((t["input"], t["answer"]) for t in meta["tests"]),
        time_limit_s=float(meta.get("time_limit_s", 0.0)),
        memory_limit_mb=int(meta.get("memory_limit_mb", 0)),
        checker_language=checker.get("language", "cpp"),
        checker_source=source,
        testlib_source=testlib,
        solutions=tuple(Solution(**s) for s in meta.get("solutions", ())),
    )


def bundled_problems() -> list[ProblemFiles]:
    return [
        load_problem(d) for d in sorted(BUNDLED_DIR.iterdir()) if (d / "problem.json").is_file()
    ]


def upload_problem(
    uploader: Uploader,
    *,
    problem_id: str,
    tests: Sequence[tuple[str | bytes, str | bytes]],
    checker_source: str = "",
    checker_language: str = "cpp",
    testlib_source: str = "",
    time_limit_s: float = 0.0,
    memory_limit_mb: int = 0,
) -> ProblemSpec:
    """Uploads a problem's data (content-addressed) and returns the links to grade with.

    The controller calls this with a data component's problem fields. Links are computed locally
    and only content the repository lacks is sent.
    """
    blobs: dict[str, bytes] = {}

    def up(data: str | bytes) -> str:
        raw = data.encode() if isinstance(data, str) else data
        link = link_of(raw)
        blobs[link] = raw
        return link

    spec = ProblemSpec(
        problem_id=problem_id,
        tests=tuple(TestLinks(input=up(i), answer=up(a)) for i, a in tests),
        checker=up(checker_source) if checker_source else "",
        checker_language=checker_language,  # type: ignore[arg-type]
        testlib=up(testlib_source) if testlib_source else "",
        time_limit_s=time_limit_s,
        memory_limit_mb=memory_limit_mb,
    )
    for link in uploader.missing(list(blobs)):
        if uploader.upload(blobs[link]) != link:
            raise RuntimeError(f"the repository stored {link} under another link")
    return spec


def upload_files(uploader: Uploader, problem: ProblemFiles) -> ProblemSpec:
    return upload_problem(
        uploader,
        problem_id=problem.id,
        tests=problem.tests,
        checker_source=problem.checker_source,
        checker_language=problem.checker_language,
        testlib_source=problem.testlib_source,
        time_limit_s=problem.time_limit_s,
        memory_limit_mb=problem.memory_limit_mb,
    )
