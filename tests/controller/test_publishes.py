"""The controller's view of versions the trainer still pushes (controller/publishes.py): jobs
reach the pool once their version is published and in the order they were launched, throughput
admission steps back to the newest reload point published, and a failed push is raised as it
was raised (a component gone stays recoverable)."""

from __future__ import annotations

import concurrent.futures as cf
import threading

import pytest

from rlax_tpu.controller.publishes import Publishes
from rlax_tpu.rpc.transport import ComponentFailed
from rlax_tpu.trainer.publishing import PublishError


class Trainer:
    """Answers wait_published(v) once ``release(v)`` (or raises what ``fail(v, e)`` gave)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._answers: dict[int, BaseException | None] = {}

    def release(self, version: int, error: BaseException | None = None) -> None:
        with self._cond:
            self._answers[version] = error
            self._cond.notify_all()

    def wait_published(self, version: int) -> int:
        with self._cond:
            assert self._cond.wait_for(lambda: version in self._answers, timeout=30)
            if self._answers[version] is not None:
                raise self._answers[version]
        return version


class Pool:
    def __init__(self):
        self.log: list[tuple[str, int]] = []

    def published(self, version: int, seconds_ago: float) -> None:
        assert seconds_ago >= 0
        self.log.append(("published", version))

    def stage(self, version: int, *, holding: int) -> None:
        self.log.append(("stage", version, holding))

    def submit(self, version: int) -> cf.Future:
        self.log.append(("job", version))
        done: cf.Future = cf.Future()
        done.set_result(version)
        return done


def test_jobs_wait_for_their_version_in_launch_order():
    trainer, pool = Trainer(), Pool()
    publishes = Publishes(trainer, pool)
    try:
        publishes.published(1, 0.0, pending=True)
        first = publishes.after(1, lambda: pool.submit(1))
        second = publishes.after(0, lambda: pool.submit(0))  # launched after: goes after
        assert not first.done() and not second.done() and pool.log == []
        trainer.release(1)
        assert first.result(timeout=30) == 1 and second.result(timeout=30) == 0
        assert pool.log == [("published", 1), ("job", 1), ("job", 0)]
    finally:
        publishes.close()


def test_a_relayed_reload_point_is_staged_while_it_is_pushed_and_loaded_once_published():
    """``stage_early`` (the parameter server relays a version as it arrives): the workers are
    asked to fetch version 2, a reload point, as soon as its push starts; version 3 is not one.
    Their jobs still wait for the publish."""
    trainer, pool = Trainer(), Pool()
    publishes = Publishes(trainer, pool, stage_early=lambda v: v - 2 if v % 2 == 0 else None)
    try:
        publishes.published(2, 0.0, pending=True)
        job = publishes.after(2, lambda: pool.submit(2))
        publishes.published(3, 0.0, pending=True)
        assert pool.log == [("stage", 2, 0)] and not job.done()
        trainer.release(2)
        assert job.result(timeout=30) == 2
        assert pool.log == [("stage", 2, 0), ("published", 2), ("job", 2)]
        publishes.published(4, 0.0, pending=False)  # published already: loaded as usual
        assert pool.log[-1] == ("published", 4)
    finally:
        trainer.release(3)
        publishes.close()


def test_throughput_admission_steps_back_to_a_published_reload_point():
    trainer, pool = Trainer(), Pool()
    publishes = Publishes(trainer, pool)
    every4 = lambda v: 4 * (v // 4)  # noqa: E731 - a reload point every 4 versions
    publishes.published(8, 0.0, pending=True)
    assert publishes.newest_ready(9, every4) == 4  # 8 is still being pushed: not 7
    trainer.release(8)
    publishes.wait(8)
    assert publishes.newest_ready(9, every4) == 8
    publishes.close()


@pytest.mark.parametrize(
    "error",
    [ComponentFailed("trainer", "127.0.0.1:1", "UNAVAILABLE", "gone"), PublishError("no route")],
)
def test_a_failed_push_is_raised_as_it_was_raised(error):
    """A trainer gone stays a ComponentFailed (the controller's recovery resumes the run); a push
    that failed is the trainer's PublishError. Every later wait, job and check raises it."""
    trainer, pool = Trainer(), Pool()
    publishes = Publishes(trainer, pool)
    try:
        publishes.published(3, 0.0, pending=True)
        job = publishes.after(3, lambda: pool.submit(3))
        trainer.release(3, error)
        with pytest.raises(type(error)):
            job.result(timeout=30)
        for call in (lambda: publishes.wait(3), publishes.check, lambda: publishes.wait(2)):
            with pytest.raises(type(error)):
                call()
        assert pool.log == []
    finally:
        publishes.close()


def test_closing_ends_jobs_still_waiting_for_their_version():
    """A job held for a version still being pushed when the controller closes fails at once,
    so a thread waiting on it returns (its result would otherwise never come)."""
    trainer, pool = Trainer(), Pool()
    publishes = Publishes(trainer, pool)
    publishes.published(5, 0.0, pending=True)
    job = publishes.after(5, lambda: pool.submit(5))
    publishes.close()
    with pytest.raises(RuntimeError, match="closed"):
        job.result(timeout=30)
    trainer.release(5)
    assert pool.log in ([], [("published", 5)])  # the job never reached the pool
