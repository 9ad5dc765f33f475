"""The verifier's gRPC face: the same API as ``VerifierService``, served with ``rpc.transport``."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from rlax_tpu.config import VerifierConfig
from rlax_tpu.rpc import common_pb2, transport
from rlax_tpu.rpc import verifiers_pb2 as pb
from rlax_tpu.rpc import verifiers_pb2_grpc as pb_grpc
from rlax_tpu.verifiers import wire
from rlax_tpu.verifiers.api import BACKPRESSURE_KEY, Overloaded, UnknownLink
from rlax_tpu.verifiers.service import VerifierService

MAX_UPLOAD_BYTES = 1 << 30


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, service: VerifierService):
        self._service = service

    def Health(
        self, request: common_pb2.Empty, context: grpc.ServicerContext
    ) -> common_pb2.HealthReply:
        return common_pb2.HealthReply(
            component="verifiers", serving=True, detail=self._service.health()
        )

    def Upload(
        self, request_iterator: Iterator[pb.UploadChunk], context: grpc.ServicerContext
    ) -> pb.Link:
        data = bytearray()
        for chunk in request_iterator:
            data += chunk.data
            if len(data) > MAX_UPLOAD_BYTES:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "upload over 1 GiB")
        return pb.Link(link=self._service.upload(bytes(data)))

    def Missing(self, request: pb.Links, context: grpc.ServicerContext) -> pb.Links:
        try:
            return pb.Links(links=self._service.missing(list(request.links)))
        except UnknownLink as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def Verify(self, request: pb.VerifyRequest, context: grpc.ServicerContext) -> pb.VerifyReply:
        try:
            tasks = [wire.task_from_proto(t) for t in request.tasks]
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        deadline = request.deadline_s or None
        remaining = context.time_remaining()
        if remaining is not None and remaining < 1e6:  # answer before the caller gives up
            deadline = min(deadline or remaining, max(remaining - 0.5, 0.1))
        try:
            verdicts = self._service.verify(tasks, deadline_s=deadline)
        except Overloaded as e:
            # gRPC also says RESOURCE_EXHAUSTED for oversize messages: mark ours as backpressure.
            context.set_trailing_metadata(((BACKPRESSURE_KEY, "overloaded"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.VerifyReply(verdicts=[wire.verdict_to_proto(v) for v in verdicts])


def serve(config: VerifierConfig, service: VerifierService) -> tuple[grpc.Server, int]:
    """Starts serving ``service`` on ``config.address``; returns (server, bound port)."""
    servicer = VerifierServicer(service)
    return transport.make_server(
        config.address,
        lambda server: pb_grpc.add_VerifierServicer_to_server(servicer, server),
        credentials=transport.Credentials(
            auth_token_file=config.auth_token_file, tls_cert_file=config.tls_cert_file
        ),
        max_workers=max(8, config.workers * 4),
    )
