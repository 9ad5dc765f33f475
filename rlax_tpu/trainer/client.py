"""A gRPC client with the Trainer's API (what the controller uses in distributed mode)."""

from __future__ import annotations

import grpc
import numpy as np

from rlax_tpu.rpc import common_pb2, trainer_pb2_grpc
from rlax_tpu.rpc import trainer_pb2 as pb
from rlax_tpu.rpc.transport import Credentials, make_channel, wait_ready
from rlax_tpu.trainer.checkpoint import CorruptCheckpointError
from rlax_tpu.trainer.publishing import PublishError
from rlax_tpu.trainer.trainer import TrainerStatus
from rlax_tpu.trainer.wire import batch_to_chunks
from rlax_tpu.types import TrainBatch

_NO_CREDENTIALS = Credentials()


class TrainerClient:
    def __init__(
        self,
        endpoint: str,
        *,
        credentials: Credentials = _NO_CREDENTIALS,
        timeout_s: float = 3600.0,
        chunk_bytes: int = 4 * 2**20,
    ):
        self.endpoint, self.timeout_s, self.chunk_bytes = endpoint, timeout_s, chunk_bytes
        self._channel = make_channel(endpoint, credentials=credentials)
        self._stub = trainer_pb2_grpc.TrainerStub(self._channel)
        self.last_row_advantages = np.zeros(0, np.float32)  # as Trainer's, of the last step

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        wait_ready(self._channel, component="trainer", endpoint=self.endpoint, timeout_s=timeout_s)

    def train_step(self, batch: TrainBatch, *, expect_step: int | None = None) -> dict[str, float]:
        """``expect_step``: the trainer refuses the batch (UNAVAILABLE, "TrainerStateLost") when
        it is at another step, i.e. it restarted since the caller restored it."""
        chunks = batch_to_chunks(batch, self.chunk_bytes)
        metadata = None if expect_step is None else (("rlax-expect-step", str(expect_step)),)
        reply = self._stub.TrainStep(chunks, timeout=self.timeout_s, metadata=metadata)
        self.last_row_advantages = np.asarray(reply.row_advantages, np.float32)
        return dict(reply.metrics)

    def publish(self) -> int:
        return self._stub.Publish(common_pb2.Empty(), timeout=self.timeout_s).step

    def wait_published(self, version: int) -> int:
        """As Trainer.wait_published: PublishError when the version was not published."""
        try:
            return self._stub.WaitPublished(
                pb.TrainerStep(step=version), timeout=self.timeout_s
            ).step
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION or "PublishError" not in e.details():
                raise
            raise PublishError(e.details()) from None

    def save(self, *, wait: bool = False) -> int:
        return self._stub.Save(pb.TrainerSaveRequest(wait=wait), timeout=self.timeout_s).step

    def restore(self, step: int | None = None) -> int:
        """As Trainer.restore; a damaged checkpoint raises CorruptCheckpointError here too."""
        request = pb.TrainerRestoreRequest(step=step or 0, latest=step is None)
        try:
            return self._stub.Restore(request, timeout=self.timeout_s).step
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.DATA_LOSS:
                raise
            raise CorruptCheckpointError(step if step is not None else -1, e.details()) from None

    def status(self) -> TrainerStatus:
        s = self._stub.Status(common_pb2.Empty(), timeout=self.timeout_s)
        return TrainerStatus(
            step=s.step,
            published_version=s.published_version,
            mesh=dict(s.mesh),
            process_count=s.process_count,
            halted=s.halted,
            checkpoint_steps=tuple(s.checkpoint_steps),
            last_metrics=dict(s.last_metrics),
            publishing=tuple(s.publishing),
            publish_failed=s.publish_failed,
        )

    def health(self) -> common_pb2.HealthReply:
        return self._stub.Health(common_pb2.Empty(), timeout=self.timeout_s)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
