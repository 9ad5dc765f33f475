"""Client of the parameter server: the trainer pushes, inference workers pull.

With several replicas (``endpoints[r]`` is replica r), replicas add availability:

* ``push`` publishes to every replica at once. A replica that cannot be reached (gRPC's own
  UNAVAILABLE or DEADLINE_EXCEEDED), or that refuses the version for its own state (no room
  after ``room_wait_s``, bytes that failed their check, a version number it cannot take, ...),
  is skipped for this push and logged with its reason; the version is committed once ``quorum``
  replicas hold it (below that, the first refusal is raised, else errors.Unavailable). A refusal
  that says the call itself is wrong (AlreadyExists: other content for an existing version,
  InvalidArgument, missing or wrong credentials) is raised even when a quorum took the version.
  Then every replica that took it is told which replicas hold the version (their progress, a
  lease on their say in GC: retention.py), so a replica that is dead or refused stops holding
  GC back once its last report lapses. A replica that returns has recovered its persisted
  versions and takes the next push; a version it missed is read from a peer.
* ``pull`` reads from this client's own replica (``replica``) and fails over to the others in
  turn (``replica + 1``, ``replica + 2``, ... modulo the count) when it is down, lacks the version
  (it was down when the version was pushed) or sends bytes that fail their checksum; every pull
  starts at its own replica again. Every pull is checked against CRC32C: whole arrays against the
  manifest's, slices against the checksums the server sends after them, taken from data it
  checked against the checksums it recorded when the version was published (blocks.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent import futures
from typing import Any, TypeVar

import grpc
import jax
import numpy as np

from rlax_tpu.config import ParamServerConfig
from rlax_tpu.param_server import buffers, errors, framing, wire
from rlax_tpu.param_server.codec import (
    ArraySpec,
    VersionManifest,
    as_bytes,
    checksum,
    describe_sharding,
    flatten,
    normalize_index,
    np_dtype,
    unflatten_nested,
)
from rlax_tpu.param_server.framing import SERVICE
from rlax_tpu.param_server.server import LATEST, Bounds, VersionInfo
from rlax_tpu.rpc import common_pb2, param_server_pb2_grpc
from rlax_tpu.rpc import param_server_pb2 as pb
from rlax_tpu.rpc.transport import (
    DEFAULT_MAX_MESSAGE_BYTES,
    WRITE_TOKEN_KEY,
    Credentials,
    make_channel,
    wait_ready,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

_NO_CREDENTIALS = Credentials()
# Refusals that pass: a reader's pin or lease, a persist, or a conflicting push in flight ends.
_TRANSIENT = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED)
# gRPC's own statuses for a replica it cannot reach (the server never sends them itself).
_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_PEEK_TIMEOUT_S = 10.0  # asking a peer how far it is, while a push waits for room
# Refusals that say the CALLER is wrong, not the replica (the call is wrong wherever it goes):
# raised even when a quorum of other replicas took it. ALREADY_EXISTS: the version exists there
# with other content (taking it elsewhere would serve two contents under one number);
# INVALID_ARGUMENT: a malformed call or a tree unlike the served one; PERMISSION_DENIED and
# UNAUTHENTICATED (gRPC's, from rpc.transport's token checks): missing or wrong credentials.
# Every other refusal (RESOURCE_EXHAUSTED or ABORTED still after room_wait_s, DATA_LOSS,
# FAILED_PRECONDITION, NOT_FOUND, a server fault) is about that replica's own state: a write goes
# on without it, as without a replica that is down, when the others make the quorum.
_CALLER_WRONG = frozenset(
    c.name
    for c in (
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    )
)
# A pull that fails so on one replica is tried on the next: it lacks the version (it was down
# when it was pushed) or its copy is corrupt.
_PULL_ELSEWHERE = (errors.NotFound, errors.DataLoss)


def down(e: BaseException) -> bool:
    """``e`` says the replica could not be reached (not that it refused the call)."""
    return isinstance(e, grpc.RpcError) and e.code() in _DOWN and not _from_server(e)


def _caller_wrong(e: BaseException) -> bool:
    """``e`` is a refusal that says the call is wrong (``_CALLER_WRONG``), not the replica."""
    return _status(e) in _CALLER_WRONG


def _status(e: BaseException) -> str:
    """The status name of a failed call's error (gRPC's, or a ParamServerError's)."""
    if isinstance(e, grpc.RpcError) and e.code() is not None:
        return e.code().name
    return e.status if isinstance(e, errors.ParamServerError) else type(e).__name__


def _describe(e: BaseException) -> str:
    return f"{_status(e)} {e.details() if isinstance(e, grpc.RpcError) else e}"


def _raise(e: grpc.RpcError) -> None:
    """Re-raises the server's refusal as the ParamServerError its status names (gRPC's own
    errors, e.g. an oversize message, as they are)."""
    raise _as_error(e)


def _as_error(e: grpc.RpcError) -> Exception:
    """The server's refusal as the ParamServerError its status names; gRPC's own errors as
    they are."""
    code = e.code()
    cls = errors.BY_STATUS.get(code.name) if code is not None and _from_server(e) else None
    if cls is None:
        return e
    error = cls(e.details())
    error.__cause__ = e
    return error


def _from_server(e: grpc.RpcError) -> bool:
    """The status is the parameter server's own refusal, not gRPC's."""
    metadata = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
    return any(key == errors.TRAILER_KEY for key, _ in metadata or ())


class ParamServerClient:
    """Calls one parameter server, or a set of replicas (push goes to all, pull to ``replica``)."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        credentials: Credentials = _NO_CREDENTIALS,
        chunk_bytes: int = 4 * 2**20,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        replica: int = 0,
        timeout_s: float = 600.0,
        publish_token_file: str = "",
        room_wait_s: float = 0.0,
        quorum: int = 1,
    ):
        """``publish_token_file``: the publish token pushes present (read when first needed:
        a client that only pulls never opens it). ``room_wait_s``: how long a push refused for
        room (ResourceExhausted: every hot version is read, persisted or leased) or for a
        conflicting push in flight (Aborted) is retried, with backoff; 0: not retried.
        ``quorum``: the replicas that must hold a pushed version (the others may be down)."""
        self._publish_token_file = publish_token_file
        self.room_wait_s = room_wait_s
        self._write_metadata: list[tuple[str, str]] | None = None
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not 0 <= replica < len(self.endpoints):
            raise ValueError(f"replica {replica} is not one of {len(self.endpoints)} endpoints")
        if not 1 <= quorum <= len(self.endpoints):
            raise ValueError(f"quorum {quorum} is not in [1, {len(self.endpoints)} endpoints]")
        self.quorum = quorum
        self.replica, self.chunk_bytes, self.timeout_s = replica, chunk_bytes, timeout_s
        self.bytes_pulled = 0  # payload bytes received by pulls, for metrics
        self.bytes_pushed = (
            0  # payload bytes sent by pushes (counted once per replica), for metrics
        )
        # The replicas that took the last push (or part): a version in parts is whole only on
        # the replicas every part reached, which the trainer's processes compare.
        self.last_replicas: tuple[int, ...] = ()
        # Pulled versions land in slabs, reused once the caller has dropped a version's arrays
        # (jax lets go of an aliased host array at its next call: a caller that drops each
        # version at once alternates between two slabs).
        self._slabs = buffers.SlabPool(max_idle=1)
        self._channels = [
            make_channel(e, credentials=credentials, max_message_bytes=max_message_bytes)
            for e in self.endpoints
        ]
        self._stubs = [param_server_pb2_grpc.ParamServerStub(c) for c in self._channels]
        # Publish and Pull carry chunks with copy-free framing (same bytes on the wire).
        self._publish = [
            c.stream_unary(
                f"/{SERVICE}/Publish",
                request_serializer=framing.encode,
                response_deserializer=pb.PublishReply.FromString,
            )
            for c in self._channels
        ]
        self._pull = [
            c.unary_stream(
                f"/{SERVICE}/Pull",
                request_serializer=pb.PullRequest.SerializeToString,
                response_deserializer=framing.decode_pull_reply,
            )
            for c in self._channels
        ]

    @classmethod
    def from_config(
        cls, config: ParamServerConfig, endpoints: str | Sequence[str], *, replica: int = 0
    ) -> ParamServerClient:
        creds = Credentials(
            auth_token_file=config.auth_token_file, tls_cert_file=config.tls_cert_file
        )
        count = 1 if isinstance(endpoints, str) else len(endpoints)
        return cls(
            endpoints,
            credentials=creds,
            chunk_bytes=config.chunk_bytes,
            max_message_bytes=config.max_message_bytes,
            replica=replica,
            publish_token_file=config.publish_token_file,
            room_wait_s=config.publish_room_wait_s,
            quorum=min(config.publish_quorum, count),
        )

    def _write(self) -> list[tuple[str, str]]:
        """Metadata of a publishing call (the publish token, if this client has one)."""
        if self._write_metadata is None:
            token = Credentials(auth_token_file=self._publish_token_file).token()
            self._write_metadata = [(WRITE_TOKEN_KEY, token)] if token else []
        return self._write_metadata

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Waits up to ``timeout_s`` for every replica (all at once); past it, goes on if
        ``quorum`` of them answer (a replica that is down does not stop a start, as it does not
        stop a push; it is logged), else raises rpc.transport.ComponentUnreachable for the first
        silent one."""

        def one(i: int) -> Exception | None:
            try:
                wait_ready(
                    self._channels[i],
                    component="param_server",
                    endpoint=self.endpoints[i],
                    timeout_s=timeout_s,
                )
            except ConnectionError as e:
                return e
            return None

        with futures.ThreadPoolExecutor(len(self._channels)) as pool:
            silent = [e for e in pool.map(one, range(len(self._channels))) if e is not None]
        if len(self._channels) - len(silent) < self.quorum:
            raise silent[0]
        for e in silent:
            log.warning("%s; going on with the other replicas", e)

    def close(self) -> None:
        for c in self._channels:
            c.close()
        self._slabs = buffers.SlabPool(max_idle=1)  # arrays still in use keep their own slabs

    def __enter__(self) -> ParamServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ push

    def push(self, params: Any, version: int, *, step: int | None = None) -> VersionInfo:
        """Publishes a pytree of arrays (jax or numpy) as ``version`` to every replica that is up;
        at least ``quorum`` must take it. A replica that refuses it for its own state (e.g. no
        room) is left out like one that is down; with fewer than ``quorum`` holders, the first
        refusal is raised, else errors.Unavailable.

        Idempotent: pushing the same content again is a no-op; different content for an existing
        version raises AlreadyExists, also when other replicas took it (as do InvalidArgument and
        refused credentials: the call is wrong, ``_CALLER_WRONG``).
        """
        paths, leaves, _ = flatten(params)
        if any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves):
            # Arrays over several processes: each process sends the boxes it owns.
            specs = [
                ArraySpec(path=p, shape=tuple(x.shape), dtype=np.dtype(x.dtype).name)
                for p, x in zip(paths, leaves, strict=True)
            ]
            boxes = [(i, b, d) for i, x in enumerate(leaves) for b, d in owned_boxes(x)]
            return self.push_part(
                specs,
                boxes,
                version,
                step=step,
                part=jax.process_index(),
                parts=jax.process_count(),
            )[0]
        specs, hosts = [], []
        for path, leaf in zip(paths, leaves, strict=True):
            sharding, block = describe_sharding(leaf)
            host = np.asarray(leaf)  # gathers a sharded jax.Array
            specs.append(
                ArraySpec(
                    path=path,
                    shape=tuple(host.shape),
                    dtype=host.dtype.name,
                    sharding=sharding,
                    shard_shape=block,
                )
            )
            hosts.append(host)
        header = wire.header_to_pb(
            VersionManifest(
                version=version, step=version if step is None else step, arrays=tuple(specs)
            )
        )
        replies = self._publish_all(header, hosts)
        self.last_replicas = tuple(sorted(replies))
        self.bytes_pushed += sum(h.nbytes for h in hosts) * len(replies)
        self._report_holders(replies, version)
        return wire.info_from_pb(self._own(replies).info)

    def push_part(
        self,
        specs: Sequence[ArraySpec],
        boxes: Sequence[tuple[int, Bounds, np.ndarray]],
        version: int,
        *,
        step: int | None = None,
        part: int,
        parts: int,
    ) -> tuple[VersionInfo, bool]:
        """Publishes part ``part`` of ``parts`` of ``version`` to every replica that is up:
        ``specs`` are the whole version's arrays, ``boxes`` (array index, bounds, data) this
        part's share, disjoint from the other parts'. Returns (info, complete): complete when the
        version is committed on every replica that took this part (this part was its last, or
        it was already). Whoever completes a replica's version tells the replicas, so GC learns
        of it as with a whole push. Idempotent, with a quorum and refusals, like ``push``; a
        replica down or refusing now misses the version even if it took the other parts (a newer
        version drops its unfinished one)."""
        header = wire.header_to_pb(
            VersionManifest(
                version=version,
                step=version if step is None else step,
                arrays=tuple(specs),
            )
        )
        header.part.index, header.part.count = part, parts
        for i, bounds, _ in boxes:
            header.part.boxes.add(
                array=i, start=[lo for lo, _ in bounds], stop=[hi for _, hi in bounds]
            )
        datas = [np.ascontiguousarray(d) for _, _, d in boxes]
        replies = self._publish_all(header, datas)
        self.last_replicas = tuple(sorted(replies))
        self._report_holders(replies, version)
        self.bytes_pushed += sum(d.nbytes for d in datas) * len(replies)
        complete = all(r.complete for r in replies.values())
        return wire.info_from_pb(self._own(replies).info), complete

    def _publish_all(
        self, header: pb.VersionHeader, datas: list[np.ndarray]
    ) -> dict[int, pb.PublishReply]:
        """Publishes to every replica at once: {replica: reply} of those that took it."""
        outcomes = self._each(
            lambda r: self._publish_retrying(r, lambda: self._publish_stream(header, datas))
        )
        return self._enough(outcomes, self.quorum, f"publish of version {header.version}")

    def _own(self, replies: dict[int, T]) -> T:
        return replies.get(self.replica, replies[min(replies)])

    def _publish_retrying(self, r: int, stream: Callable[[], Iterator]) -> pb.PublishReply:
        """Replica r's Publish call, retried while the refusal is transient (pushes are
        idempotent; the server refuses for room at the header, before any bytes move, or at the
        commit, keeping a version's other parts for the retried last one)."""
        deadline, delay = time.monotonic() + self.room_wait_s, 0.05
        while True:
            try:
                return self._publish[r](stream(), timeout=self.timeout_s, metadata=self._write())
            except grpc.RpcError as e:
                if not (e.code() in _TRANSIENT and _from_server(e)):
                    _raise(e)
                if time.monotonic() + delay > deadline:
                    cls = errors.BY_STATUS[e.code().name]
                    waited = f"still refused after {self.room_wait_s:g} s of retries"
                    raise cls(f"{e.details()} ({waited})") from e
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._share_progress(r)
            time.sleep(delay)
            delay = min(2 * delay, 2.0)

    def _publish_stream(
        self, header: pb.VersionHeader, hosts: list[np.ndarray]
    ) -> Iterator[pb.PublishRequest | bytes]:
        yield pb.PublishRequest(header=header)
        crcs = []
        for index, host in enumerate(hosts):
            flat, crc = as_bytes(host), 0
            for offset in range(0, len(flat), self.chunk_bytes):
                piece = flat[offset : offset + self.chunk_bytes]
                message = framing.encode_chunk(index, offset, memoryview(piece))
                # The checksum of the copy just made (still in cache, and exactly what is sent).
                crc = checksum(memoryview(message)[len(message) - len(piece) :], crc)
                yield message
            crcs.append(crc)
        yield pb.PublishRequest(trailer=pb.PublishTrailer(crc32=crcs))

    # ------------------------------------------------------------------------------ progress

    def _report_holders(self, replies: dict[int, pb.PublishReply], version: int) -> None:
        """Tells every replica that took ``version`` which of them hold it now (each report
        renews that replica's lease on GC) and which missed it (down or refused): those stop
        holding GC back at once, not after their lease (a replica killed in a drill held its
        peer full for a whole lease, refusing the next publish)."""
        holders = [(r, version) for r, reply in sorted(replies.items()) if reply.complete]
        missed = [r for r in range(len(self.endpoints)) if r not in replies]
        if holders or missed:
            self._enough(
                self._each(lambda r: self._progress_to(r, holders, missed), replies),
                1,
                "progress",
            )

    def _progress_to(
        self, r: int, reports: Sequence[tuple[int, int]], missed: Sequence[int] = ()
    ) -> None:
        """Sends replica r each (replica, version) of ``reports``, and that ``missed`` replicas
        missed a version."""
        requests = [pb.ProgressRequest(replica=q, version=v) for q, v in reports]
        requests += [pb.ProgressRequest(replica=q, missed=True) for q in missed]
        for request in requests:
            self._stubs[r].ReportProgress(request, timeout=self.timeout_s, metadata=self._write())

    def _share_progress(self, r: int) -> None:
        """Tells replica r, which refused a push for room, how far the other replicas are (each
        one's latest version, which it has committed). A replica that restarted knows nothing
        of its peers and would otherwise wait out a whole replica lease before it collects; a
        peer that is down is left out (it lapses). So is a peer behind r (it came back having
        missed versions): a report renews its lease on r's GC at a version r must collect past,
        and reported at every retry it never lapsed (a drill's publish waited 300 s)."""
        latest = {}
        for q in range(len(self.endpoints)):
            try:  # briefly: a peer that hangs must not stall the retry for the whole timeout
                latest[q] = (
                    self._stubs[q]
                    .ListVersions(common_pb2.Empty(), timeout=min(self.timeout_s, _PEEK_TIMEOUT_S))
                    .latest
                )
            except grpc.RpcError:
                continue  # down or refusing: it proves no progress
        if r not in latest:
            return
        reports = [(q, v) for q, v in latest.items() if q != r and v >= max(latest[r], 0)]
        try:
            self._progress_to(r, reports)
        except grpc.RpcError as e:
            log.info("could not tell replica %d its peers' progress: %s", r, e.details())

    def report_progress(self, replica: int, version: int) -> None:
        """Tells every replica that is up that replica ``replica`` has committed ``version``."""
        self._enough(
            self._each(lambda r: self._progress_to(r, [(replica, version)])),
            1,
            f"progress of replica {replica}",
        )

    # ------------------------------------------------------------------------------ replicas

    def _each(
        self, call: Callable[[int], T], replicas: Collection[int] | None = None
    ) -> dict[int, T | Exception]:
        """{replica: call(replica), or the error it raised (the server's as ParamServerError)},
        for every replica (or ``replicas``), concurrently."""

        def attempt(r: int) -> T | Exception:
            try:
                return call(r)
            except grpc.RpcError as e:
                return _as_error(e)
            except errors.ParamServerError as e:
                return e

        targets = sorted(range(len(self.endpoints)) if replicas is None else replicas)
        if len(targets) == 1:
            return {targets[0]: attempt(targets[0])}
        with futures.ThreadPoolExecutor(len(targets)) as pool:
            return dict(zip(targets, pool.map(attempt, targets), strict=True))

    def _enough(self, outcomes: dict[int, T | Exception], need: int, what: str) -> dict[int, T]:
        """The outcomes that succeeded, when there are at least ``need``.

        A refusal that says the call is wrong (``_CALLER_WRONG``) is raised whatever the other
        replicas did. Replicas that are down, or refused for their own state (any other refusal),
        are skipped and named in the log with their reason; when fewer than ``need`` succeeded,
        the first such refusal is raised, else errors.Unavailable naming the replicas down."""
        failed = {r: e for r, e in outcomes.items() if isinstance(e, Exception)}
        refused = [e for e in failed.values() if not down(e)]
        wrong = [e for e in refused if _caller_wrong(e)]
        if wrong:
            raise wrong[0]
        done = {r: o for r, o in outcomes.items() if r not in failed}
        if failed:
            if len(done) < need and refused:
                raise refused[0]
            skipped = "; ".join(
                f"replica {r} at {self.endpoints[r]}: {_describe(e)}" for r, e in failed.items()
            )
            if len(done) < need:
                raise errors.Unavailable(
                    f"{what}: {len(done)} of {len(self.endpoints)} replicas answered, "
                    f"{need} needed; down: {skipped}"
                ) from next(iter(failed.values()))
            log.warning("%s skipped the replicas that are down or refused it (%s)", what, skipped)
        return done

    def _failover(self, call: Callable[[int], T], what: str) -> T:
        """``call(replica)`` on this client's replica, else on the next ones in turn while it is
        down, lacks what was asked or sent corrupt bytes; raises the first replica's answer
        (a refusal before an unreachable replica's error) when none serves it."""
        n, failures = len(self.endpoints), []
        for k in range(n):
            r = (self.replica + k) % n
            try:
                return call(r)
            except grpc.RpcError as e:
                error: Exception = _as_error(e)
            except errors.ParamServerError as e:
                error = e
            if n == 1 or not (down(error) or isinstance(error, _PULL_ELSEWHERE)):
                raise error
            failures.append(error)
            log.warning(
                "%s: replica %d at %s failed (%s: %s)%s",
                what,
                r,
                self.endpoints[r],
                error.code().name if isinstance(error, grpc.RpcError) else type(error).__name__,
                error.details() if isinstance(error, grpc.RpcError) else error,
                ", trying the next" if k < n - 1 else "; no replica is left",
            )
        answered = [e for e in failures if not down(e)]
        raise (answered or failures)[0]

    # ------------------------------------------------------------------------------ pull

    def pull_arrays(
        self, version: int = LATEST, slices: Sequence[tuple[int, Bounds]] | None = None
    ) -> tuple[VersionManifest, list[np.ndarray]]:
        """(manifest, host arrays): whole arrays in manifest order, or one per requested box.

        Whole arrays are checked against the manifest's CRC32C, boxes against the CRC32C the
        server sends after them (DataLoss on mismatch). Fails over to the other replicas.
        """
        return self._failover(
            lambda r: self._pull_arrays_from(r, version, slices), f"pull of version {version}"
        )

    def _pull_arrays_from(
        self, r: int, version: int, slices: Sequence[tuple[int, Bounds]] | None
    ) -> tuple[VersionManifest, list[np.ndarray]]:
        request = pb.PullRequest(version=version)
        for i, bounds in slices or ():
            request.slices.add(
                array=i, start=[lo for lo, _ in bounds], stop=[hi for _, hi in bounds]
            )
        whole = not slices
        stream = self._pull[r](request, timeout=self.timeout_s)
        sent: list[int] | None = None  # the server's checksums of the boxes (sliced pulls)
        try:
            manifest = wire.header_from_pb(next(stream).header)
            boxes = slices or [(i, None) for i in range(len(manifest.arrays))]
            out = self._empty([(manifest.arrays[i], bounds) for i, bounds in boxes])
            flats = [as_bytes(o) for o in out]
            received, crcs = [0] * len(out), [0] * len(out)
            for c in stream:
                if not isinstance(c, framing.ChunkView):
                    if c.WhichOneof("part") != "trailer" or sent is not None:
                        raise errors.DataLoss(f"a pull sent an unexpected {c.WhichOneof('part')}")
                    sent = list(c.trailer.crc32c)
                    continue
                n, data = len(c.data), np.frombuffer(c.data, np.uint8)
                flats[c.index][c.offset : c.offset + n] = data
                crcs[c.index] = checksum(data, crcs[c.index])  # chunks of a box arrive in order
                received[c.index] += n
                self.bytes_pulled += n
        except grpc.RpcError as e:
            _raise(e)
        finally:
            stream.cancel()  # a no-op once complete; else the server stops at once
        short = [i for i, (n, f) in enumerate(zip(received, flats, strict=True)) if n != len(f)]
        if short:
            raise errors.DataLoss(f"pull of version {manifest.version} ended early (boxes {short})")
        if whole:
            bad = [s.path for s, c in zip(manifest.arrays, crcs, strict=True) if c != s.crc32c]
        elif sent is None or len(sent) != len(crcs):
            raise errors.DataLoss(
                f"a sliced pull of version {manifest.version} ended without a checksum per slice"
            )
        else:
            pairs = zip(slices, crcs, sent, strict=True)
            bad = [manifest.arrays[i].path for (i, _), c, s in pairs if c != s]
        if bad:
            raise errors.DataLoss(f"version {manifest.version}: checksum mismatch in {bad}")
        return manifest, out

    def _empty(self, boxes: list[tuple[ArraySpec, Bounds | None]]) -> list[np.ndarray]:
        """Uninitialized arrays for whole arrays or boxes, carved from one slab, each 64-byte
        aligned so that jax on CPU can use it without a copy."""
        shapes = [s.shape if b is None else tuple(hi - lo for lo, hi in b) for s, b in boxes]
        dtypes = [np_dtype(s.dtype) for s, _ in boxes]
        sizes = [math.prod(shape) * d.itemsize for shape, d in zip(shapes, dtypes, strict=True)]
        offsets, total = buffers.layout(sizes)
        slab = self._slabs.take(total)
        return [
            slab[o : o + n].view(d).reshape(shape)
            for o, n, d, shape in zip(offsets, sizes, dtypes, shapes, strict=True)
        ]

    def pull(self, version: int = LATEST, shardings: Any = None) -> Any:
        """A version as a pytree of jax.Arrays (from this client's replica, else another).

        ``shardings``: a pytree of jax.sharding.Sharding with the pushed tree's structure; each
        array is built from the per-device slices this process needs, and only those are pulled.
        None: whole arrays on the default device, as nested dicts/lists.
        """
        if shardings is None:
            manifest, arrays = self.pull_arrays(version)
            # One call for every array (a single dispatch; on CPU each aliases its host array).
            return unflatten_nested([a.path for a in manifest.arrays], jax.device_put(arrays))
        return self._failover(
            lambda r: self._pull_sharded_from(r, version, shardings), f"pull of version {version}"
        )

    def _pull_sharded_from(self, r: int, version: int, shardings: Any) -> Any:
        paths, leaf_shardings, treedef = flatten(shardings)
        manifest = self._manifest(r, version)
        position = {a.path: i for i, a in enumerate(manifest.arrays)}
        boxes = needed_slices(manifest, shardings)
        _, data = self._pull_arrays_from(r, manifest.version, boxes)
        held: dict[int, list[tuple[Bounds, np.ndarray]]] = {}
        for (i, bounds), array in zip(boxes, data, strict=True):
            held.setdefault(i, []).append((bounds, array))
        leaves = []
        for path, sharding in zip(paths, leaf_shardings, strict=True):
            i = position[path]
            shape = manifest.arrays[i].shape
            leaves.append(
                jax.make_array_from_callback(
                    shape,
                    sharding,
                    lambda idx, i=i, shape=shape: _cut(held[i], normalize_index(idx, shape)),
                )
            )
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def _manifest(self, r: int, version: int) -> VersionManifest:
        """The header of ``version`` on replica r (resolving LATEST), without its data.

        A header-only pull is read to its end (the header is all it has), so the call completes
        normally instead of being dropped half-read.
        """
        request = pb.PullRequest(version=version, header_only=True)
        try:
            replies = list(self._pull[r](request, timeout=self.timeout_s))
        except grpc.RpcError as e:
            _raise(e)
        if len(replies) != 1 or not isinstance(replies[0], pb.PullReply):
            raise errors.DataLoss(
                f"a header-only pull of version {version} sent {len(replies)} replies"
            )
        return wire.header_from_pb(replies[0].header)

    # ------------------------------------------------------------------------------ control

    def list_versions(self) -> tuple[list[VersionInfo], int | None]:
        """(hot versions of this client's replica, or the next one up; the latest or None)."""
        reply = self._failover(
            lambda r: self._stubs[r].ListVersions(common_pb2.Empty(), timeout=self.timeout_s),
            "listing versions",
        )
        latest = None if reply.latest < 0 else reply.latest
        return [wire.info_from_pb(v) for v in reply.versions], latest

    def lease(self, consumer: str, versions: Sequence[int], ttl_s: float = 0.0) -> float:
        """Sets the versions ``consumer`` holds on every replica that is up (empty releases);
        returns the TTL. A replica that lacks one of them (it was down when it was pushed) is
        left out; NotFound only when no replica holds them all.

        Renew before the TTL ends. 0: the server's default (param_server.lease_ttl_s).
        """
        request = pb.LeaseRequest(consumer=consumer, versions=list(versions), ttl_s=ttl_s)
        outcomes = self._each(lambda r: self._stubs[r].Lease(request, timeout=self.timeout_s))
        lacking = {r for r, o in outcomes.items() if isinstance(o, errors.NotFound)}
        if len(lacking) == len(outcomes):
            raise outcomes[min(lacking)]
        others = {r: o for r, o in outcomes.items() if r not in lacking}
        replies = self._enough(others, 1, f"lease of {consumer}")
        return min(r.ttl_s for r in replies.values())

    def health(self) -> list[common_pb2.HealthReply]:
        """One HealthReply per replica."""
        try:
            return self._on_all(
                lambda stub: stub.Health(common_pb2.Empty(), timeout=self.timeout_s)
            )
        except grpc.RpcError as e:
            _raise(e)

    def _on_all(self, call: Any) -> list[Any]:
        """``call(stub)`` for every replica's stub, concurrently; the first failure is raised."""
        if len(self._stubs) == 1:
            return [call(self._stubs[0])]
        with futures.ThreadPoolExecutor(len(self._stubs)) as pool:
            return list(pool.map(call, self._stubs))


def needed_slices(
    manifest: VersionManifest, shardings: Any, devices: Collection[jax.Device] | None = None
) -> list[tuple[int, Bounds]]:
    """The (array index, box) slices to pull so that ``devices`` (default: this process's) get
    what they hold of a version laid out by ``shardings`` (a pytree of Sharding shaped like the
    pushed tree). Devices holding the same slice need it once; an array whose slices here cover
    all of it is one whole box (one contiguous read instead of strided ones)."""
    paths, leaf_shardings, _ = flatten(shardings)
    position = {a.path: i for i, a in enumerate(manifest.arrays)}
    missing = [p for p in paths if p not in position]
    if missing:
        raise errors.InvalidArgument(f"version {manifest.version} has no arrays at {missing}")
    boxes: list[tuple[int, Bounds]] = []
    for path, sharding in zip(paths, leaf_shardings, strict=True):
        i = position[path]
        shape = manifest.arrays[i].shape
        if devices is None:
            indices = sharding.addressable_devices_indices_map(shape).values()
        else:
            every = sharding.devices_indices_map(shape)
            indices = [every[d] for d in devices if d in every]
        tiles = list(dict.fromkeys(normalize_index(index, shape) for index in indices))
        # A sharding's distinct tiles are disjoint: they cover the array iff their sizes add up.
        if sum(math.prod(hi - lo for lo, hi in t) for t in tiles) == math.prod(shape):
            tiles = [tuple((0, n) for n in shape)]
        boxes += [(i, t) for t in tiles]
    return boxes


def owned_boxes(x: jax.Array) -> list[tuple[Bounds, np.ndarray]]:
    """The distinct slices of ``x`` this process publishes: each slice is owned by the lowest
    process holding it, so the processes' shares are disjoint and together cover ``x``."""
    me, shape = jax.process_index(), x.shape
    owner: dict[Bounds, int] = {}
    for device, index in x.sharding.devices_indices_map(shape).items():
        box = normalize_index(index, shape)
        owner[box] = min(owner.get(box, device.process_index), device.process_index)
    local = {normalize_index(s.index, shape): s for s in x.addressable_shards}
    return [(box, np.asarray(local[box].data)) for box, p in owner.items() if p == me]


def _cut(held: list[tuple[Bounds, np.ndarray]], want: Bounds) -> np.ndarray:
    """The part ``want`` of whichever pulled box contains it."""
    for bounds, array in held:
        if all(lo <= a and b <= hi for (a, b), (lo, hi) in zip(want, bounds, strict=True)):
            return array[
                tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(want, bounds, strict=True))
            ]
    raise errors.DataLoss(f"no pulled slice holds {want}")  # needed_slices covers every device


class PulledWeights:
    """An inference worker's weight source (``fetch(version)``): pulls a version into
    ``shardings`` (a pytree of jax.sharding.Sharding shaped like the tree the trainer publishes,
    e.g. the engine's ``weight_shardings()``), fetching only the slices this process's devices
    hold. A version the server does not have raises KeyError, which the worker reports as an
    unknown version."""

    def __init__(self, client: ParamServerClient, shardings: Any):
        self.client, self.shardings = client, shardings

    @property
    def bytes_received(self) -> int:
        """Bytes of weights the client pulled over the network so far (every pull of the
        client: a worker's own)."""
        return self.client.bytes_pulled

    def fetch(self, version: int) -> Any:
        try:
            return self.client.pull(version, self.shardings)
        except errors.NotFound as e:
            raise KeyError(f"the parameter server has no version {version}: {e}") from e
