"""Math answers: extract the final answer from a response, then check equivalence with math-verify.

Parsing and simplifying arbitrary model output with sympy can take unbounded time, so checks run in
a small pool of worker processes: math-verify's own (signal-based) timeouts work there, and a
worker that still hangs is killed with its pool instead of wedging the service.
"""

from __future__ import annotations

import multiprocessing
import re
import threading
from collections.abc import Sequence

from rlax_tpu.types import Verdict, VerdictKind

_TIMEOUT_S = 5
_POOL_TIMEOUT_S = 30.0
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*:?\s*(.+)", re.IGNORECASE)
_HASHES = re.compile(r"^####\s*(.+)$", re.MULTILINE)


def _braced(text: str, start: int) -> str | None:
    """The content of the brace group opening at text[start - 1]."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def extract_answer(response: str) -> str | None:
    """The final answer: the last \\boxed{...}, else "answer: ..." / "answer is ...", else "#### ..."."""
    boxes = list(_BOXED.finditer(response))
    for m in reversed(boxes):
        content = _braced(response, m.end())
        if content is not None and content.strip():
            return content.strip()
    for pattern in (_ANSWER_IS, _HASHES):
        found = pattern.findall(response)
        if found:
            answer = found[-1].strip().rstrip(".").strip()
            answer = answer.strip("$").strip()
            if answer:
                return answer
    return None


def _as_latex(text: str) -> str:
    return text if "$" in text else f"${text}$"


def check_answer(response: str, answer: str) -> tuple[str, str]:
    """(verdict kind value, detail). Runs in a worker process."""
    from math_verify import parse, verify

    predicted = extract_answer(response)
    if predicted is None:
        return VerdictKind.WRONG_ANSWER.value, "no final answer found"
    if " ".join(predicted.split()) == " ".join(answer.split()):
        return VerdictKind.ACCEPTED.value, ""
    gold = parse(_as_latex(answer), parsing_timeout=_TIMEOUT_S)
    pred = parse(_as_latex(predicted), parsing_timeout=_TIMEOUT_S)
    if not gold:
        return (
            VerdictKind.INTERNAL_ERROR.value,
            f"could not parse the reference answer {answer[:60]!r}",
        )
    if pred and verify(gold, pred, timeout_seconds=_TIMEOUT_S):
        return VerdictKind.ACCEPTED.value, ""
    return VerdictKind.WRONG_ANSWER.value, f"answer {predicted[:60]!r} is not {answer[:60]!r}"


class MathChecker:
    """A lazily started pool of worker processes for math checks."""

    def __init__(self, workers: int):
        self._workers = workers
        self._lock = threading.Lock()
        self._pool = None

    def _get_pool(self):  # noqa: ANN202
        with self._lock:
            if self._pool is None:
                self._pool = multiprocessing.get_context("spawn").Pool(self._workers)
            return self._pool

    def _reset(self, pool) -> None:  # noqa: ANN001
        with self._lock:
            if self._pool is pool:
                self._pool = None
        pool.terminate()

    def check_many(self, items: Sequence[tuple[str, str]]) -> list[Verdict]:
        pool = self._get_pool()
        pending = [pool.apply_async(check_answer, item) for item in items]
        out, broken = [], False
        for p in pending:
            if broken and not p.ready():  # its pool was killed
                out.append(Verdict(kind=VerdictKind.INTERNAL_ERROR, detail="math check timed out"))
                continue
            try:
                kind, detail = p.get(timeout=_POOL_TIMEOUT_S)
                out.append(
                    Verdict(
                        kind=VerdictKind(kind),
                        detail=detail,
                        tests_total=1,
                        tests_passed=int(kind == "accepted"),
                        score=float(kind == "accepted"),
                    )
                )
            except multiprocessing.TimeoutError:
                self._reset(pool)
                broken = True
                out.append(Verdict(kind=VerdictKind.INTERNAL_ERROR, detail="math check timed out"))
            except Exception as e:  # a crashed worker says nothing about the answer
                out.append(
                    Verdict(kind=VerdictKind.INTERNAL_ERROR, detail=f"math check failed: {e}")
                )
        return out

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.terminate()
            pool.join()
