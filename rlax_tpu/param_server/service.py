"""The gRPC face of :class:`ParamServer`: the same calls, data as chunked byte streams."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import hashlib
import json
import logging
import math
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import jax
import numpy as np

from rlax_tpu import storage
from rlax_tpu.config import ParamServerConfig, RunConfig
from rlax_tpu.param_server import delta, errors, framing, relay, wire
from rlax_tpu.param_server.codec import (
    ArraySpec,
    Bounds,
    VersionManifest,
    as_bytes,
    checksum,
    np_dtype,
)
from rlax_tpu.param_server.framing import SERVICE, ChunkView
from rlax_tpu.param_server.parts import cut
from rlax_tpu.param_server.server import ParamServer, VersionReader
from rlax_tpu.rpc import common_pb2, param_server_pb2_grpc
from rlax_tpu.rpc import param_server_pb2 as pb
from rlax_tpu.rpc.transport import Credentials, make_server

log = logging.getLogger(__name__)
COMPONENT = "param_server"
ROOT_APPEAR_S = 60.0


def _statuses(method: Callable) -> Callable:
    """Turns ParamServerError into its gRPC status; the store is left as it was."""

    @functools.wraps(method)
    def wrapper(self, request, context):  # noqa: ANN001, ANN202
        try:
            return method(self, request, context)
        except errors.ParamServerError as e:
            _abort(context, e)

    return wrapper


def _abort(context: grpc.ServicerContext, e: errors.ParamServerError) -> None:
    context.set_trailing_metadata(((errors.TRAILER_KEY, e.status),))
    context.abort(getattr(grpc.StatusCode, e.status), str(e))


class ParamServerService(param_server_pb2_grpc.ParamServerServicer):
    def __init__(
        self,
        server: ParamServer,
        *,
        chunk_bytes: int,
        relay_appear_s: float = 3.0,
        relay_deltas: int = 0,
        cut_through: bool = False,
    ):
        """``cut_through``: relay each new version while it is published here (CutThrough)."""
        self._server, self._chunk_bytes = server, chunk_bytes
        # The root of the workers' relay chains (param_server.fanout "relay"): a version is
        # served as it arrives (cut_through), else read from the store once, when its first
        # reader asks, and served as it is read. One version kept (the memory budget counts
        # it: launch/gke.py).
        root = RelayRoot(server, deltas=relay_deltas > 1)
        # A worker staged as a push starts may ask before the push's first bytes are here (its
        # trainer copies the version to the host first): the root waits for it longer.
        appear = max(relay_appear_s, ROOT_APPEAR_S) if cut_through else relay_appear_s
        self.relay = relay.RelayService(appear_s=appear, keep=1, missing=root)
        root.service = self.relay
        if cut_through:
            server.receiving = root.receiving

    @_statuses
    def Publish(self, request_iterator: Iterator[pb.PublishRequest], context) -> pb.PublishReply:  # noqa: ANN001
        first = next(request_iterator, None)
        if not isinstance(first, pb.PublishRequest) or first.WhichOneof("part") != "header":
            raise errors.InvalidArgument("a publish stream must start with a header")
        header = wire.header_from_pb(first.header)
        if first.header.HasField("part"):
            return self._publish_part(first.header, header, request_iterator)
        session = self._server.begin_publish(header.version, header.step, header.arrays)
        try:
            crcs = _receive(session, request_iterator, header.version)
            info, present = session.finish(crcs)
            return pb.PublishReply(
                info=wire.info_to_pb(info), already_present=present, complete=True
            )
        finally:
            session.abort()

    def _publish_part(
        self, raw: pb.VersionHeader, header: VersionManifest, request_iterator: Iterator
    ) -> pb.PublishReply:
        boxes = [(b.array, _bounds(b)) for b in raw.part.boxes]
        session = self._server.begin_part(
            header.version,
            header.step,
            header.arrays,
            part=raw.part.index,
            parts=raw.part.count,
            boxes=boxes,
        )
        try:
            info, present, complete = session.finish(
                _receive(session, request_iterator, header.version)
            )
        except BaseException as e:
            session.failed(e)
            raise
        return pb.PublishReply(
            info=wire.info_to_pb(info), already_present=present, complete=complete
        )

    @_statuses
    def Pull(self, request: pb.PullRequest, context) -> Iterator[pb.PullReply]:  # noqa: ANN001
        slices = [] if request.header_only else None
        if request.slices:
            slices = [(s.array, _bounds(s)) for s in request.slices]
        # Each piece is sent (serialized) before the next is asked for: buffers can be reused.
        manifest, pieces = self._server.pull(
            request.version, slices, piece_bytes=self._chunk_bytes, reuse_buffers=True
        )
        # Runs when the call ends in any way, also when the client hangs up before gRPC ever
        # iterates the stream (then no finally below would run): the pin is always released.
        if not context.add_callback(pieces.close):  # the call has ended already
            pieces.close()
        boxes = len(request.slices) if request.slices and not request.header_only else 0
        return self._stream(manifest, pieces, boxes, context)

    def _stream(
        self, manifest: VersionManifest, pieces: VersionReader, boxes: int, context: Any
    ) -> Iterator[pb.PullReply | ChunkView]:
        """The header, the pieces' bytes in chunks and, for ``boxes`` requested slices, a
        trailer with the CRC32C of the bytes sent for each (taken while they are in cache)."""
        crcs = [0] * boxes
        try:
            yield pb.PullReply(header=wire.header_to_pb(manifest))
            n = self._chunk_bytes
            for index, start, piece in pieces:
                flat = as_bytes(piece)
                if boxes:
                    crcs[index] = checksum(flat, crcs[index])
                for offset in range(0, max(len(flat), 1), n):
                    yield ChunkView(index, start + offset, memoryview(flat[offset : offset + n]))
            if boxes:
                yield pb.PullReply(trailer=pb.PullTrailer(crc32c=crcs))
        except errors.ParamServerError as e:  # raised while reading (a chunk failed its check)
            _abort(context, e)
        finally:
            pieces.close()  # unpins the version as soon as the stream ends or is abandoned

    @_statuses
    def ListVersions(self, request: common_pb2.Empty, context) -> pb.VersionList:  # noqa: ANN001
        latest = self._server.latest()
        return pb.VersionList(
            versions=[wire.info_to_pb(i) for i in self._server.list_versions()],
            latest=-1 if latest is None else latest,
        )

    @_statuses
    def ReportProgress(self, request: pb.ProgressRequest, context) -> common_pb2.Empty:  # noqa: ANN001
        self._server.report_progress(request.replica, request.version, request.missed)
        return common_pb2.Empty()

    @_statuses
    def Lease(self, request: pb.LeaseRequest, context) -> pb.LeaseReply:  # noqa: ANN001
        ttl = self._server.lease(request.consumer, list(request.versions), request.ttl_s)
        return pb.LeaseReply(versions=sorted(set(request.versions)), ttl_s=ttl)

    def Health(self, request: common_pb2.Empty, context) -> common_pb2.HealthReply:  # noqa: ANN001
        serving, detail = self._server.health()
        return common_pb2.HealthReply(component=COMPONENT, serving=serving, detail=detail)


def _bounds(s: pb.Slice) -> tuple[tuple[int, int], ...]:
    if len(s.start) != len(s.stop):
        raise errors.InvalidArgument(f"slice of array {s.array}: start/stop lengths differ")
    return tuple(zip(s.start, s.stop, strict=True))


def _receive(session: Any, requests: Iterator, version: int) -> list[int]:
    """Feeds a publish stream's chunks to ``session``; returns its trailer's checksums."""
    for request in requests:
        if isinstance(request, ChunkView):
            session.add(request.index, request.offset, request.data)
            continue
        part = request.WhichOneof("part")
        if part == "trailer":
            return list(request.trailer.crc32)
        raise errors.InvalidArgument(f"unexpected {part!r} in the middle of a publish")
    raise errors.DataLoss(
        f"truncated publish of version {version}: the stream ended without a trailer"
    )


def add_to_server(service: ParamServerService, server: grpc.Server) -> None:
    """Like the generated ``add_ParamServerServicer_to_server``, with copy-free chunk framing."""
    unary = lambda method, request: grpc.unary_unary_rpc_method_handler(
        method, request_deserializer=request.FromString, response_serializer=_serialize
    )
    handlers = {
        "Publish": grpc.stream_unary_rpc_method_handler(
            service.Publish,
            request_deserializer=framing.decode_publish_request,
            response_serializer=_serialize,
        ),
        "Pull": grpc.unary_stream_rpc_method_handler(
            service.Pull,
            request_deserializer=pb.PullRequest.FromString,
            response_serializer=framing.encode,
        ),
        "ListVersions": unary(service.ListVersions, common_pb2.Empty),
        "ReportProgress": unary(service.ReportProgress, pb.ProgressRequest),
        "Lease": unary(service.Lease, pb.LeaseRequest),
        "Health": unary(service.Health, common_pb2.Empty),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, handlers), service.relay.handlers())
    )


class RelayRoot:
    """Where the parameter server's relay gets a buffer it does not hold (``RelayService``'s
    ``missing``): a whole version read from the store, or a delta encoded against another."""

    def __init__(self, store: ParamServer, *, deltas: bool):
        self.store, self.deltas = store, deltas
        self.service: relay.RelayService | None = None  # set once the service exists

    def __call__(self, key: tuple[int, int]) -> relay.VersionBuffer | None:
        """Version ``key[0]`` whole (``key[1]`` FULL: filled from the store on a thread, each
        array checked against its published CRC32C before it is served; None while the store
        lacks it), or as a delta against version ``key[1]`` (KeyError when deltas are off or the
        store lacks either version)."""
        version, base = key
        if base == relay.FULL:
            return self._whole(version)
        if not self.deltas or not 0 <= base < version:
            raise KeyError(
                f"version {version} goes whole (deltas {'on' if self.deltas else 'off'})"
            )
        held = self.service.get(version) if self.service is not None else None
        arriving = held is not None and str(relay.origin(held.meta)).startswith("publish:")
        if arriving and not held.complete:
            # Still arriving (relayed as it is pushed): the reader takes it whole, rather than
            # hold a handler thread until the push ends for an encoding that waits for it.
            raise KeyError(f"version {version} is still arriving: it goes whole")
        new, old = self._complete(version), self._complete(base)
        count = len(new.layout.paths)
        encoded = delta.encode_tree(
            [old.view(i) for i in range(count)],
            [new.view(i) for i in range(count)],
            base_version=base,
            crcs=new.meta["crcs"],  # what the trainer published: the reader checks against it
        )
        arrays, meta = delta.to_payload(encoded)
        buffer = relay.VersionBuffer(version, relay.Layout.of(arrays), base=base, meta=meta)
        relay.fill_from_arrays(buffer, [a for _, a in arrays])
        log.info(
            "version %d as a delta against %d: %d of %d bytes",
            version,
            base,
            encoded.nbytes,
            new.layout.total,
        )
        return buffer

    def receiving(self, version: int, arrays: tuple[ArraySpec, ...]) -> CutThrough | None:
        """A buffer for ``version``, served from now on as its publish fills it."""
        if self.service is None:
            return None
        meta = {"crcs": None, "source": f"publish:{uuid.uuid4().hex}"}
        buffer = relay.VersionBuffer(version, _layout(arrays), meta=meta)
        receiver = CutThrough(relay.Feed(buffer), arrays)
        self.service.add(buffer)
        return receiver

    def _whole(self, version: int) -> relay.VersionBuffer | None:
        try:
            manifest, reader = self.store.pull(version)
        except errors.NotFound:
            return None
        crcs = [a.crc32c for a in manifest.arrays]
        # The same committed bytes on every replica: a reader may resume on another's.
        content = [(a.path, a.dtype, list(a.shape), a.crc32c) for a in manifest.arrays]
        digest = hashlib.sha256(json.dumps(content).encode()).hexdigest()[:32]
        meta = {"crcs": crcs, "source": f"store:{digest}"}
        buffer = relay.VersionBuffer(version, _layout(manifest.arrays), meta=meta)

        def fill() -> None:
            try:
                relay.fill_from_pieces(buffer, reader, crcs)
            finally:
                reader.close()

        threading.Thread(target=fill, name=f"relay-root-v{version}", daemon=True).start()
        return buffer

    def _complete(self, version: int) -> relay.VersionBuffer:
        """A whole version, checked, from the relay (the one being served) or the store."""
        held = self.service.get(version) if self.service is not None else None
        buffer = held or self._whole(version)
        if buffer is None:
            raise KeyError(f"the parameter server has no version {version}")
        buffer.wait(buffer.layout.buckets - 1)  # RelayFailed if its store copy is damaged
        if buffer.meta["crcs"] is None:  # relayed as it arrived in parts: checked, not summed
            count = len(buffer.layout.paths)
            buffer.meta["crcs"] = [checksum(buffer.view(i)) for i in range(count)]
        return buffer


def _layout(arrays: Sequence[ArraySpec]) -> relay.Layout:
    return relay.Layout.of(
        [(a.path, jax.ShapeDtypeStruct(a.shape, np_dtype(a.dtype))) for a in arrays]
    )


class CutThrough:
    """A version relayed while it is published to this replica (``param_server.fanout``
    "relay"): each array goes into the root's buffer once it is whole, and the buckets it
    completes are served at once, the last only after the publisher's checksums matched
    (``relay.Feed``). The copies and checksums run on a thread of their own, off the receiving
    streams'. Any failure of the publish fails the buffer (its readers fail over; the version is
    relayed from the store once committed). Never raises into the publish."""

    def __init__(self, feed: relay.Feed, arrays: Sequence[ArraySpec]):
        self.feed = feed
        self._sizes = [math.prod(a.shape) for a in arrays]
        self._covered = [0] * len(arrays)
        self._boxes: set[tuple[int, int]] = set()  # (part, box) written: a part sent again is not
        self._lock = threading.Lock()
        # In order: a release comes after every write the publish handed over before it.
        self._thread = cf.ThreadPoolExecutor(1, f"cut-through-v{feed.buffer.version}")
        for i, size in enumerate(self._sizes):
            if size == 0:
                self._later(self.feed.done, i)

    def array(self, index: int, data: np.ndarray) -> None:
        def write() -> None:
            lo = self.feed.buffer.layout.offsets[index]
            self.feed.buffer.data[lo : lo + data.size] = data
            self.feed.done(index)

        self._later(write)

    def box(self, part: int, k: int, index: int, bounds: Bounds, data: np.ndarray) -> None:
        with self._lock:
            again = (part, k) in self._boxes
            self._boxes.add((part, k))
        if again:  # which stream's bytes the version keeps is decided later: not relayed now
            self.failed(errors.Aborted(f"part {part} sent again while it was being relayed"))
            return

        def write() -> None:
            view = self.feed.view(index)
            view[cut(bounds)] = data.view(view.dtype).reshape([hi - lo for lo, hi in bounds])
            with self._lock:
                self._covered[index] += math.prod(hi - lo for lo, hi in bounds)
                whole = self._covered[index] == self._sizes[index]
            if whole:
                self.feed.done(index)

        self._later(write)

    def checked(self, crcs: Sequence[int] | None) -> None:
        def release() -> None:
            self.feed.buffer.meta["crcs"] = None if crcs is None else list(crcs)
            self.feed.release()

        self._later(release)
        self._thread.shutdown(wait=False)

    def failed(self, error: BaseException) -> None:
        self.feed.fail(error)
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _later(self, call: Callable[..., None], *args: Any) -> None:
        def run() -> None:
            if self.feed.buffer.error is not None:
                return
            try:
                call(*args)
            except Exception as e:  # noqa: BLE001 - the publish goes on; readers fail over
                version = self.feed.buffer.version
                log.warning("version %d: relaying it as it arrives failed: %s", version, e)
                self.feed.fail(e)

        try:
            self._thread.submit(run)
        except RuntimeError as e:  # shut down (the publish failed or ended), or no thread
            self.feed.fail(e)


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()


def persist_location(config: RunConfig) -> str:
    """Where versions are persisted; "" when persistence is off. Replicas (several) write apart,
    under replica-<index>: each persists what it received, and none overwrites another's files."""
    ps = config.param_server
    if ps.persist_every == 0:
        return ""
    base = ps.persist_path or storage.join(config.controller.run_dir, "param_server")
    return storage.join(base, f"replica-{ps.replica_index}") if ps.replicas > 1 else base


# What changes the store's versions (a lease only holds one); with publish_token_file set these
# need the publish token too.
WRITE_METHODS = ("/rlax_tpu.ParamServer/Publish", "/rlax_tpu.ParamServer/ReportProgress")


def serve(
    config: ParamServerConfig, *, persist_location: str = ""
) -> tuple[grpc.Server, int, ParamServer]:
    """Starts a ParamServer behind a gRPC server on ``config.address``: (server, port, store)."""
    store = ParamServer(config, persist_location=persist_location)
    service = ParamServerService(
        store,
        chunk_bytes=config.chunk_bytes,
        relay_appear_s=config.relay_appear_s,
        relay_deltas=config.relay_deltas,
        cut_through=config.fanout == "relay",
    )
    credentials = Credentials(
        auth_token_file=config.auth_token_file, tls_cert_file=config.tls_cert_file
    )
    try:
        write_token = Credentials(auth_token_file=config.publish_token_file).token()
        server, port = make_server(
            config.address,
            lambda s: add_to_server(service, s),
            credentials=credentials,
            max_message_bytes=config.max_message_bytes,
            max_workers=16,
            write_token=write_token,
            write_methods=WRITE_METHODS,
        )
    except Exception:
        store.close()
        raise
    return server, port, store
