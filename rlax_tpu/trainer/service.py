"""The trainer's gRPC service: the in-process Trainer API over rlax_tpu/rpc/trainer.proto.

Calls are serialized (the trainer is one device program at a time). Bad input (a batch that does
not fit the mesh or the objective) answers INVALID_ARGUMENT; a halted trainer or a NaN step under
nan_policy 'stop' answers FAILED_PRECONDITION; a missing or foreign checkpoint NOT_FOUND /
FAILED_PRECONDITION. The message says why.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator

import grpc

from rlax_tpu.config import TrainerConfig
from rlax_tpu.rpc import common_pb2, trainer_pb2_grpc
from rlax_tpu.rpc import trainer_pb2 as pb
from rlax_tpu.rpc.transport import Credentials, make_server
from rlax_tpu.trainer.checkpoint import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    NoCheckpointError,
)
from rlax_tpu.trainer.trainer import Trainer, TrainerHalted, TrainerStateLost
from rlax_tpu.trainer.wire import batch_from_chunks

COMPONENT = "trainer"
EXPECT_STEP_KEY = "rlax-expect-step"  # call metadata of TrainStep: the step the caller expects
# Order matters: the first matching class decides the status.
_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (TrainerHalted, grpc.StatusCode.FAILED_PRECONDITION),
    (CorruptCheckpointError, grpc.StatusCode.DATA_LOSS),
    (CheckpointMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (NoCheckpointError, grpc.StatusCode.NOT_FOUND),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (RuntimeError, grpc.StatusCode.FAILED_PRECONDITION),
)
_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _answered(method: Callable) -> Callable:
    """The trainer's exceptions as statuses (the module docstring)."""

    @functools.wraps(method)
    def wrapper(self, request, context):  # noqa: ANN001, ANN202
        try:
            return method(self, request, context)
        except Exception as e:
            # From the weight sink, now or in a push on its own thread: a parameter server gone.
            gone = e if isinstance(e, grpc.RpcError) else e.__cause__
            if isinstance(gone, grpc.RpcError) and gone.code() in _GONE:
                context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"a parameter server did not answer ({gone.code().name}: {gone.details()})",
                )
            if isinstance(e, grpc.RpcError):
                raise
            for cls, code in _STATUS:
                if isinstance(e, cls):
                    context.abort(code, f"{type(e).__name__}: {e}")
            raise

    return wrapper


def _serialized(method: Callable) -> Callable:
    answered = _answered(method)

    @functools.wraps(method)
    def wrapper(self, request, context):  # noqa: ANN001, ANN202
        with self._lock:
            return answered(self, request, context)

    return wrapper


class TrainerService(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, trainer: Trainer):
        self._trainer = trainer
        self._lock = threading.Lock()

    @_serialized
    def TrainStep(self, requests: Iterator[pb.TrainBatchMessage], context) -> pb.TrainStepReply:  # noqa: ANN001
        expect = dict(context.invocation_metadata()).get(EXPECT_STEP_KEY)
        try:
            metrics = self._trainer.train_step(
                batch_from_chunks(requests), expect_step=None if expect is None else int(expect)
            )
        except TrainerStateLost as e:  # as gone as a dead trainer: the caller must restore it
            context.abort(grpc.StatusCode.UNAVAILABLE, f"TrainerStateLost: {e}")
        return pb.TrainStepReply(
            metrics=metrics, row_advantages=self._trainer.last_row_advantages.tolist()
        )

    @_serialized
    def Publish(self, request: common_pb2.Empty, context) -> pb.TrainerStep:  # noqa: ANN001
        return pb.TrainerStep(step=self._trainer.publish())

    @_answered
    def WaitPublished(self, request: pb.TrainerStep, context) -> pb.TrainerStep:  # noqa: ANN001
        return pb.TrainerStep(step=self._trainer.wait_published(request.step))

    @_serialized
    def Save(self, request: pb.TrainerSaveRequest, context) -> pb.TrainerStep:  # noqa: ANN001
        return pb.TrainerStep(step=self._trainer.save(wait=request.wait))

    @_serialized
    def Restore(self, request: pb.TrainerRestoreRequest, context) -> pb.TrainerStep:  # noqa: ANN001
        return pb.TrainerStep(step=self._trainer.restore(None if request.latest else request.step))

    @_serialized
    def Status(self, request: common_pb2.Empty, context) -> pb.TrainerStatusReply:  # noqa: ANN001
        s = self._trainer.status()
        return pb.TrainerStatusReply(
            step=s.step,
            published_version=s.published_version,
            mesh=s.mesh,
            process_count=s.process_count,
            halted=s.halted,
            checkpoint_steps=list(s.checkpoint_steps),
            last_metrics=s.last_metrics,
            publishing=list(s.publishing),
            publish_failed=s.publish_failed,
        )

    def Health(self, request: common_pb2.Empty, context) -> common_pb2.HealthReply:  # noqa: ANN001
        s = self._trainer.status()
        detail = f"step {s.step}, mesh {s.mesh}" + (f", halted: {s.halted}" if s.halted else "")
        detail += f", {s.publish_failed}" if s.publish_failed else ""
        return common_pb2.HealthReply(component=COMPONENT, serving=not s.halted, detail=detail)


def serve(trainer: Trainer, cfg: TrainerConfig) -> tuple[grpc.Server, int]:
    """Starts the service on ``cfg.address`` with its credentials; returns (server, port)."""
    creds = Credentials(auth_token_file=cfg.auth_token_file, tls_cert_file=cfg.tls_cert_file)
    service = TrainerService(trainer)
    return make_server(
        cfg.address,
        lambda server: trainer_pb2_grpc.add_TrainerServicer_to_server(service, server),
        credentials=creds,
    )
