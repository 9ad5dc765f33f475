"""What the controller needs from each component: one ``Protocol`` per component.

The in-process classes (InferenceWorker, VerifierService, Trainer, ParamServerClient) and the gRPC
clients (InferenceClient, VerifierClient, TrainerClient) both satisfy these, so the step loop is the
same for the ``local`` and ``distributed`` transports. Tests wrap real components in delays and
failures through the same interfaces.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from rlax_tpu.inference.scheduler import Request
from rlax_tpu.types import Rollout, TrainBatch, Verdict
from rlax_tpu.verifiers.api import Task


class InferencePort(Protocol):
    # Returns once the requests are queued on the worker (the pool overlaps a newer version's
    # load with them then: epochs.py), and yields their rollouts as they finish.
    def generate(
        self, requests: Sequence[Request], *, version: int | None = None
    ) -> Iterator[Rollout]: ...

    def load_weights(self, version: int) -> int: ...

    def status(self) -> Any: ...  # has .version

    # Starts or stops the worker's trace of update ``step`` (observability.profile_steps).
    def profile(self, step: int, *, start: bool) -> None: ...


class VerifierPort(Protocol):
    def verify(
        self, tasks: Sequence[Task], *, deadline_s: float | None = None
    ) -> list[Verdict]: ...

    def upload(self, data: bytes) -> str: ...

    def missing(self, links: Sequence[str]) -> list[str]: ...


class TrainerPort(Protocol):
    last_row_advantages: Any  # [B] float32: the last train_step's advantage per batch row

    def train_step(
        self, batch: TrainBatch, *, expect_step: int | None = None
    ) -> dict[str, float]: ...

    def publish(self) -> int: ...

    def wait_published(self, version: int) -> int: ...

    def save(self, *, wait: bool = False) -> int: ...

    def restore(self, step: int | None = None) -> int: ...

    def status(self) -> Any: ...  # has .step, .checkpoint_steps, .halted


class ParamServerPort(Protocol):
    def list_versions(self) -> tuple[list[Any], int | None]: ...

    def lease(self, consumer: str, versions: Sequence[int], ttl_s: float = 0.0) -> float: ...
