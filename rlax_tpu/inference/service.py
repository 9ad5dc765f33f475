"""The gRPC face of :class:`InferenceWorker` (same calls) and its client.

Errors map to statuses: InvalidRequest -> INVALID_ARGUMENT, UnknownVersion -> NOT_FOUND,
VersionMismatch -> FAILED_PRECONDITION, WorkerShutdown -> UNAVAILABLE. The client raises the same
Python exceptions back, so the controller sees one API in local and distributed mode.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Sequence

import grpc
import numpy as np

from rlax_tpu.inference.engine import InvalidRequest
from rlax_tpu.inference.sampler import SamplingParams
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.inference.worker import (
    InferenceWorker,
    UnknownVersion,
    VersionMismatch,
    WorkerShutdown,
    WorkerStatus,
)
from rlax_tpu.rpc import common_pb2, inference_pb2_grpc
from rlax_tpu.rpc import inference_pb2 as pb
from rlax_tpu.rpc.transport import Credentials, make_channel, make_server, wait_ready
from rlax_tpu.types import FinishReason, Rollout

COMPONENT = "inference"
_QUEUED = "rlax-queued"  # Generate's initial metadata: the worker queued the requests
NO_CREDENTIALS = Credentials()  # loopback only (the config refuses other addresses without)
_STATUS = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownVersion: grpc.StatusCode.NOT_FOUND,
    VersionMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    WorkerShutdown: grpc.StatusCode.UNAVAILABLE,
}
_ERRORS = {code: error for error, code in _STATUS.items()}


def _statuses(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self, request, context):  # noqa: ANN001, ANN202
        try:
            return method(self, request, context)
        except tuple(_STATUS) as e:
            context.abort(_STATUS[type(e)], str(e))

    return wrapper


# -- conversions ------------------------------------------------------------------------------


def _optional(msg: pb.SamplingParams, name: str) -> float | int | None:
    return getattr(msg, name) if msg.HasField(name) else None


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    """Unset fields stay None: the worker's config defaults."""
    return SamplingParams(
        temperature=_optional(msg, "temperature"),
        top_k=_optional(msg, "top_k"),
        top_p=_optional(msg, "top_p"),
        max_new_tokens=_optional(msg, "max_new_tokens"),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        seed=msg.seed,
        logprob_policy=msg.logprob_policy or "temperature_scaled",
        stop_sequences=tuple(tuple(q.ids) for q in msg.stop_sequences),
        stop=tuple(msg.stop),
    )


def sampling_to_pb(s: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        max_new_tokens=s.max_new_tokens,
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        seed=s.seed & 0xFFFFFFFFFFFFFFFF,
        logprob_policy=s.logprob_policy,
        stop_sequences=[pb.TokenSequence(ids=list(q)) for q in s.stop_sequences],
        stop=list(s.stop),
    )


def rollout_to_pb(r: Rollout) -> pb.Rollout:
    return pb.Rollout(
        prompt_id=r.prompt_id,
        sample_index=r.sample_index,
        prompt_tokens=r.prompt_tokens.tolist(),
        tokens=r.tokens.tolist(),
        logprobs=r.logprobs.tolist(),
        versions=r.versions.tolist(),
        finish_reason=r.finish_reason.value,
        logprob_policy=r.logprob_policy,
        **(
            {}
            if r.routes is None
            else dict(
                routes=np.asarray(r.routes, "<i2").tobytes(), routes_shape=list(r.routes.shape)
            )
        ),
    )


def rollout_from_pb(m: pb.Rollout) -> Rollout:
    return Rollout(
        prompt_id=m.prompt_id,
        sample_index=m.sample_index,
        prompt_tokens=np.asarray(m.prompt_tokens, np.int32),
        tokens=np.asarray(m.tokens, np.int32),
        logprobs=np.asarray(m.logprobs, np.float32),
        versions=np.asarray(m.versions, np.int64),
        finish_reason=FinishReason(m.finish_reason),
        logprob_policy=m.logprob_policy,
        routes=_routes_from_pb(m),
    )


def _routes_from_pb(m: pb.Rollout) -> np.ndarray | None:
    if not m.routes_shape:
        return None
    shape = tuple(m.routes_shape)
    if len(m.routes) != 2 * int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"Rollout.routes: {len(m.routes)} bytes do not hold int16{list(shape)}")
    return np.frombuffer(m.routes, "<i2").reshape(shape).astype(np.int16)


# -- server -----------------------------------------------------------------------------------


class InferenceService(inference_pb2_grpc.InferenceServicer):
    def __init__(self, worker: InferenceWorker, *, on_shutdown: Callable[[], None] = lambda: None):
        self._worker, self._on_shutdown = worker, on_shutdown

    @_statuses
    def Generate(self, request: pb.GenerateRequest, context) -> Iterator[pb.Rollout]:  # noqa: ANN001
        requests = [
            Request(
                prompt_id=p.prompt_id,
                prompt_tokens=tuple(p.prompt_tokens),
                continuation=tuple(p.continuation),
                keep_pages=p.keep_pages,
                num_samples=p.num_samples or 1,
                sampling=sampling_from_pb(p.sampling),
            )
            for p in request.prompts
        ]
        version = request.version if request.HasField("version") else None
        stream = self._worker.generate(requests, version=version)  # validates before streaming
        # Queued in the engine: the caller's generate returns now, not at the first sample (the
        # pool starts a newer version's jobs beside a version's queued ones).
        context.send_initial_metadata(((_QUEUED, "1"),))
        return (rollout_to_pb(r) for r in stream)

    @_statuses
    def LoadWeights(self, request: pb.LoadWeightsRequest, context) -> pb.LoadWeightsReply:  # noqa: ANN001
        self._relay_from(request.relay_sources)
        aborted = self._worker.load_weights(request.version)
        return pb.LoadWeightsReply(
            version=self._worker.version,
            aborted=aborted,
            weight_bytes_received=self._worker.weight_bytes_received,
        )

    @_statuses
    def StageWeights(self, request: pb.LoadWeightsRequest, context) -> common_pb2.Empty:  # noqa: ANN001
        self._relay_from(request.relay_sources)
        self._worker.stage(request.version)
        return common_pb2.Empty()

    def _relay_from(self, sources: Sequence[str]) -> None:
        """A relaying weight source (param_server/relay.py ``RelayedWeights``) takes the sources
        the controller names; any other source pulls as before."""
        source = self._worker.weight_source
        if sources and hasattr(source, "sources"):
            source.sources = tuple(sources)

    def Status(self, request: common_pb2.Empty, context) -> pb.StatusReply:  # noqa: ANN001
        return status_to_pb(self._worker.status())

    @_statuses
    def Profile(self, request: pb.ProfileRequest, context) -> common_pb2.Empty:  # noqa: ANN001
        self._worker.profile(request.step, start=request.start)
        return common_pb2.Empty()

    def Shutdown(self, request: common_pb2.Empty, context) -> common_pb2.Empty:  # noqa: ANN001
        self._worker.shutdown()
        threading.Thread(target=self._on_shutdown, daemon=True).start()  # after replying
        return common_pb2.Empty()

    def Health(self, request: common_pb2.Empty, context) -> common_pb2.HealthReply:  # noqa: ANN001
        s = self._worker.status()
        detail = f"version {s.version}, {s.running} running, {s.waiting} waiting"
        return common_pb2.HealthReply(component=COMPONENT, serving=s.serving, detail=detail)


def status_to_pb(s: WorkerStatus) -> pb.StatusReply:
    return pb.StatusReply(
        version=s.version,
        running=s.running,
        waiting=s.waiting,
        pages_total=s.pages_total,
        pages_free=s.pages_free,
        compilations=s.compilations,
        steps=s.steps,
        generated_tokens=s.generated_tokens,
        preemptions=s.preemptions,
        pages_shared=s.pages_shared,
        prefix_tokens_reused=s.prefix_tokens_reused,
        backend=s.backend,
        serving=s.serving,
        rows_bitwise=s.rows_bitwise,
    )


def serve(
    worker: InferenceWorker,
    address: str,
    *,
    credentials: Credentials = NO_CREDENTIALS,
    on_shutdown: Callable[[], None] = lambda: None,
    handlers: Sequence[grpc.GenericRpcHandler] = (),
) -> tuple[grpc.Server, int]:
    """Starts the service on ``address`` (with ``handlers``, other services on the same port:
    a relaying worker's); returns (server, bound port)."""
    service = InferenceService(worker, on_shutdown=on_shutdown)

    def add(server: grpc.Server) -> None:
        inference_pb2_grpc.add_InferenceServicer_to_server(service, server)
        if handlers:
            server.add_generic_rpc_handlers(tuple(handlers))

    # Generate streams hold a server thread each for their whole length; a relay's streams to
    # the next worker and its manifests get threads of their own beside them.
    workers = 8 + (16 if handlers else 0)
    return make_server(address, add, credentials=credentials, max_workers=workers)


# -- client -----------------------------------------------------------------------------------


def _raise(e: grpc.RpcError) -> None:
    error = _ERRORS.get(e.code())
    if error is not None:
        raise error(e.details()) from None
    raise e


class InferenceClient:
    """The worker's API over gRPC (the controller's ``distributed`` transport)."""

    def __init__(
        self,
        endpoint: str,
        *,
        credentials: Credentials = NO_CREDENTIALS,
        relay_sources: Sequence[str] = (),
    ):
        """``relay_sources``: where the worker receives versions from (a relay chain), sent with
        each load and stage."""
        self.endpoint = endpoint
        self.relay_sources = tuple(relay_sources)
        self._channel = make_channel(endpoint, credentials=credentials)
        self._stub = inference_pb2_grpc.InferenceStub(self._channel)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        wait_ready(self._channel, component=COMPONENT, endpoint=self.endpoint, timeout_s=timeout_s)

    def close(self) -> None:
        self._channel.close()

    def generate(
        self, requests: Sequence[Request], *, version: int | None = None
    ) -> Iterator[Rollout]:
        msg = pb.GenerateRequest(
            prompts=[
                pb.PromptRequest(
                    prompt_id=r.prompt_id,
                    prompt_tokens=list(r.prompt_tokens),
                    num_samples=r.num_samples,
                    sampling=sampling_to_pb(r.sampling),
                    continuation=list(r.continuation),
                    keep_pages=r.keep_pages,
                )
                for r in requests
            ],
            version=version,
        )
        stream = self._stub.Generate(msg)
        first = None
        try:  # returns once the worker queued the requests, or raises why it refused them
            if (_QUEUED, "1") not in tuple(stream.initial_metadata() or ()):
                first = next(stream, None)
        except grpc.RpcError as e:
            _raise(e)
        return self._rest(first, stream)

    @staticmethod
    def _rest(first: pb.Rollout | None, stream: Iterator[pb.Rollout]) -> Iterator[Rollout]:
        try:
            if first is not None:
                yield rollout_from_pb(first)
            for m in stream:
                yield rollout_from_pb(m)
        except grpc.RpcError as e:
            _raise(e)

    def load_weights(self, version: int) -> int:
        try:
            request = pb.LoadWeightsRequest(version=version, relay_sources=self.relay_sources)
            reply = self._stub.LoadWeights(request)
        except grpc.RpcError as e:
            _raise(e)
        self.weight_bytes_received = reply.weight_bytes_received  # as of this load
        return reply.aborted

    def stage(self, version: int) -> None:
        try:
            self._stub.StageWeights(
                pb.LoadWeightsRequest(version=version, relay_sources=self.relay_sources)
            )
        except grpc.RpcError as e:
            _raise(e)

    def status(self) -> WorkerStatus:
        try:
            m = self._stub.Status(common_pb2.Empty())
        except grpc.RpcError as e:
            _raise(e)
        return WorkerStatus(
            **{f.name: getattr(m, f.name) for f in dataclasses.fields(WorkerStatus)}
        )

    def profile(self, step: int, *, start: bool) -> None:
        try:
            self._stub.Profile(pb.ProfileRequest(step=step, start=start))
        except grpc.RpcError as e:
            _raise(e)

    def shutdown(self) -> None:
        try:
            self._stub.Shutdown(common_pb2.Empty())
        except grpc.RpcError as e:
            _raise(e)
