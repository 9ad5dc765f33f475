"""``VerifierClient``: the verifier API over gRPC (the controller's distributed mode)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc

from rlax_tpu.rpc import common_pb2, transport
from rlax_tpu.rpc import verifiers_pb2 as pb
from rlax_tpu.rpc import verifiers_pb2_grpc as pb_grpc
from rlax_tpu.types import Verdict
from rlax_tpu.verifiers import wire
from rlax_tpu.verifiers.api import BACKPRESSURE_KEY, Overloaded, RequestTooLarge, Task

_CHUNK_BYTES = 1 << 20


class VerifierClient:
    def __init__(
        self,
        endpoint: str,
        *,
        credentials: transport.Credentials | None = None,
        connect_timeout_s: float = 30.0,
    ):
        self.endpoint = endpoint
        self._channel = transport.make_channel(
            endpoint, credentials=credentials or transport.Credentials()
        )
        transport.wait_ready(
            self._channel, component="verifiers", endpoint=endpoint, timeout_s=connect_timeout_s
        )
        self._stub = pb_grpc.VerifierStub(self._channel)

    def health(self) -> common_pb2.HealthReply:
        return self._stub.Health(common_pb2.Empty(), timeout=30)

    def upload(self, data: bytes) -> str:
        def chunks() -> Iterator[pb.UploadChunk]:
            for piece in transport.chunks(data, _CHUNK_BYTES) or [b""]:
                yield pb.UploadChunk(data=bytes(piece))

        return self._stub.Upload(chunks(), timeout=600).link

    def missing(self, links: Sequence[str]) -> list[str]:
        return list(self._stub.Missing(pb.Links(links=list(links)), timeout=60).links)

    def verify(self, tasks: Sequence[Task], *, deadline_s: float | None = None) -> list[Verdict]:
        request = pb.VerifyRequest(
            tasks=[wire.task_to_proto(t) for t in tasks], deadline_s=deadline_s or 0.0
        )
        timeout = (deadline_s + 30.0) if deadline_s else None
        try:
            reply = self._stub.Verify(request, timeout=timeout)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            if _is_backpressure(e):
                raise Overloaded(e.details()) from e
            raise RequestTooLarge(
                f"verify request of {len(tasks)} tasks ({request.ByteSize()} bytes) refused: "
                f"{e.details()}; send fewer tasks per call"
            ) from e
        return [wire.verdict_from_proto(v) for v in reply.verdicts]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> VerifierClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_backpressure(error: grpc.RpcError) -> bool:
    """The server's own RESOURCE_EXHAUSTED (retry later), not gRPC's message size limit."""
    metadata = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    return any(key == BACKPRESSURE_KEY for key, _ in metadata or ())
