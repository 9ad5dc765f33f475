"""Versions relayed from worker to worker in pipelined, checksummed buckets.

Every worker pulling the whole version from a few parameter-server replicas makes reload time
grow with the workers. Here a version travels as one flat byte layout cut into buckets; the
publisher makes the buckets available as it fills them (with a CRC32C each, computed once), and
every process that holds or is receiving a version serves the buckets it has already verified to
the next. Workers form a chain (worker k reads from worker k-1, the first from the publisher):
each bucket is forwarded as soon as it is verified, so the last worker finishes about one
bucket per hop after the first, and the publisher sends each version once whatever the number
of workers.

Failover: a reader's sources are tried in order (in runs: the worker before it, then the
parameter server); when one dies, sends a bucket that fails its checksum or sends nothing for
``IDLE_S``, the reader goes on from the next source at the first bucket it lacks. A buffer serves only buckets it verified, and
a version whose every source failed is marked failed: its readers fail over in turn, and its
arrays are never handed out.

Host copies per byte: the receiver's gRPC message and its copy into the buffer (then checked
against the bucket's CRC32C); the sender's message made from the buffer (gRPC core adds its own).
The publisher's device-to-host copy lands in its buffer after one more (``np.asarray``).

Deltas: a reader that holds version b asks for version v "against b"; the root encodes v against
b (``delta.py``) once, and the delta travels the chain like a version (its payload arrays in
buckets). The reader rebuilds v from its copy of b, checks every array against v's published
CRC32C, and serves the rebuilt v on as a whole version too. A reader that no source could give
the delta (or whose rebuild failed) asks for the whole version.

Wire: ``/rlax_tpu.Relay/Manifest`` (JSON {"version", "base"}) -> JSON {"layout", "base",
"meta"}; ``/rlax_tpu.Relay/Stream`` (JSON {"version", "base", "first"}) -> messages of a 12-byte header
(bucket index, CRC32C, length; little-endian uint32) and the bucket's bytes, from bucket
``first`` to the last, each sent once it is verified here.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import grpc
import jax
import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy
import numpy as np

from rlax_tpu.param_server import buffers, delta
from rlax_tpu.param_server.codec import checksum, flatten, np_dtype
from rlax_tpu.param_server.errors import DataLoss
from rlax_tpu.rpc.transport import Credentials, make_channel, make_server

log = logging.getLogger(__name__)

SERVICE = "rlax_tpu.Relay"
BUCKET_BYTES = 4 * 2**20
_HEADER = struct.Struct("<III")
_ALIGN = 64
_NO_CREDENTIALS = Credentials()
FULL = -1  # a buffer's base when it holds a whole version, not a delta
# Version buffers' memory, reused once nothing refers to a buffer (nor to arrays jax made from
# it without a copy): a first touch of fresh pages costs 1-3 s a GiB on the hosts measured, more
# than the transfer itself.
_SLABS = buffers.SlabPool(max_idle=1)
# A source silent this long is given up: a host gone without a reset leaves its streams open.
IDLE_S = 60.0


@dataclasses.dataclass(frozen=True)
class Layout:
    """A version's arrays (path, shape, dtype name) at byte offsets of one flat buffer."""

    paths: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    offsets: tuple[int, ...]
    total: int
    bucket_bytes: int

    @classmethod
    def of(cls, arrays: Sequence[tuple[str, Any]], bucket_bytes: int = BUCKET_BYTES) -> Layout:
        """``arrays``: (path, array or ShapeDtypeStruct), in the order they are laid out."""
        offsets, at = [], 0
        for _, a in arrays:
            offsets.append(at)
            at += -(-int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize // _ALIGN) * _ALIGN
        return cls(
            paths=tuple(p for p, _ in arrays),
            shapes=tuple(tuple(int(d) for d in a.shape) for _, a in arrays),
            dtypes=tuple(np.dtype(a.dtype).name for _, a in arrays),
            offsets=tuple(offsets),
            total=max(at, 1),
            bucket_bytes=bucket_bytes,
        )

    @property
    def buckets(self) -> int:
        return -(-self.total // self.bucket_bytes)

    def nbytes(self, i: int) -> int:
        return int(np.prod(self.shapes[i])) * np_dtype(self.dtypes[i]).itemsize

    def last_bucket(self, i: int) -> int:
        """The bucket holding array i's last byte."""
        last = (self.offsets[i] + max(self.nbytes(i), 1) - 1) // self.bucket_bytes
        return min(last, self.buckets - 1)  # an empty last array sits at the very end

    @classmethod
    def from_dict(cls, d: dict) -> Layout:
        """The inverse of ``dataclasses.asdict``."""
        return cls(
            paths=tuple(d["paths"]),
            shapes=tuple(tuple(s) for s in d["shapes"]),
            dtypes=tuple(d["dtypes"]),
            offsets=tuple(d["offsets"]),
            total=d["total"],
            bucket_bytes=d["bucket_bytes"],
        )


class RelayFailed(RuntimeError):
    """Every source of a version failed before it was whole."""


class VersionBuffer:
    """One version's bytes on this host, filled bucket by bucket in order; each bucket can be
    read (served, or used) once it is verified."""

    def __init__(self, version: int, layout: Layout, *, base: int = FULL, meta: Any = None):
        """``base``: FULL, or the version this buffer is a delta against (its arrays are the
        delta's payload, ``meta`` the rest of it: ``delta.to_payload``)."""
        self.version, self.layout, self.base, self.meta = version, layout, base, meta
        self.data = _SLABS.take(layout.total)  # 64-byte aligned: jax on CPU uses it as it is
        self.crcs: list[int] = []  # of the buckets filled so far
        self.error: BaseException | None = None
        self._cond = threading.Condition()

    @property
    def key(self) -> tuple[int, int]:
        return self.version, self.base

    @property
    def filled(self) -> int:
        return len(self.crcs)

    @property
    def complete(self) -> bool:
        return self.filled == self.layout.buckets

    def _span(self, k: int) -> tuple[int, int]:
        b = self.layout.bucket_bytes
        return k * b, min((k + 1) * b, self.layout.total)

    def put(self, k: int, payload: bytes | memoryview, crc: int) -> None:
        """Stores bucket k (the next one) after checking it against ``crc`` (DataLoss if not)."""
        if k != self.filled:
            raise DataLoss(f"version {self.version}: bucket {k} came where {self.filled} belongs")
        lo, hi = self._span(k)
        view = np.frombuffer(payload, np.uint8)
        if len(view) != hi - lo:
            raise DataLoss(
                f"version {self.version}: bucket {k} has {len(view)} bytes, not {hi - lo}"
            )
        self.data[lo:hi] = view
        if checksum(self.data[lo:hi]) != crc:
            raise DataLoss(f"version {self.version}: bucket {k} fails its checksum")
        with self._cond:
            self.crcs.append(crc)
            self._cond.notify_all()

    def fill(self, k: int) -> None:
        """Bucket k (the next) was written into ``data`` by its owner: checksums it."""
        lo, hi = self._span(k)
        with self._cond:
            self.crcs.append(checksum(self.data[lo:hi]))
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self.error = error
            self._cond.notify_all()

    def wait(self, k: int, timeout_s: float | None = None) -> None:
        """Blocks until bucket k is verified; raises the buffer's failure (RelayFailed)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self.filled <= k or self.error is not None:
                if self.error is not None:
                    raise RelayFailed(
                        f"version {self.version} failed at bucket {self.filled}: {self.error}"
                    ) from self.error
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"version {self.version}: bucket {k} not here in time")
                self._cond.wait(left)

    def bucket(self, k: int) -> tuple[int, memoryview]:
        """(CRC32C, bytes) of verified bucket k."""
        lo, hi = self._span(k)
        return self.crcs[k], memoryview(self.data[lo:hi])

    def array(self, i: int) -> np.ndarray:
        """Array i (a view of the buffer) once its bytes are verified."""
        self.wait(self.layout.last_bucket(i))
        return self.view(i)

    def view(self, i: int) -> np.ndarray:
        """Array i as a view of the buffer, verified or not (for its writer)."""
        lo = self.layout.offsets[i]
        dtype = np_dtype(self.layout.dtypes[i])
        flat = self.data[lo : lo + self.layout.nbytes(i)].view(dtype)
        return flat.reshape(self.layout.shapes[i])


class Egress:
    """A process's send rate held to ``bytes_per_s`` (0: unlimited), shared by its streams: the
    emulated NIC of a benchmark."""

    def __init__(self, bytes_per_s: float = 0.0):
        self.rate = bytes_per_s
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, nbytes: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + nbytes / self.rate
        if start > now:
            time.sleep(start - now)


class RelayService:
    """Serves the versions this process holds or is receiving (the newest ``keep``), on a gRPC
    server of its own (``RelayServer``) or beside another service (``handlers``).

    Buffers are keyed by (version, base): base FULL for a whole version, else the version a
    delta is against. ``missing(key)``: where a buffer this process does not hold comes from
    (the parameter server, the root of every chain, makes it from its store): None, not yet;
    KeyError, never."""

    def __init__(
        self,
        *,
        egress_bytes_per_s: float = 0.0,
        keep: int = 2,
        wait_s: float = 600.0,
        appear_s: float = 30.0,
        missing: Callable[[tuple[int, int]], VersionBuffer | None] | None = None,
    ):
        """``wait_s``: how long a stream waits for its next bucket; ``appear_s``: how long a
        reader waits for a version this relay has not started receiving."""
        self.egress = Egress(egress_bytes_per_s)
        self.keep, self.wait_s, self.appear_s = keep, wait_s, appear_s
        self.missing = missing
        self._versions: dict[tuple[int, int], VersionBuffer] = {}
        # key -> the missing() call making it: its other readers wait for that one
        self._making: dict[tuple[int, int], _Making] = {}
        # Keys this process has asked its sources for, before their manifests came: a reader
        # waits for them (up to wait_s) rather than leaving for its next source.
        self._expected: collections.Counter[tuple[int, int]] = collections.Counter()
        self._lock = threading.Lock()
        self._added = threading.Condition(self._lock)
        self.bytes_sent = 0

    def handlers(self) -> grpc.GenericRpcHandler:
        """The ``rlax_tpu.Relay`` methods, for ``server.add_generic_rpc_handlers``."""
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Manifest": grpc.unary_unary_rpc_method_handler(
                    self._manifest, request_deserializer=json.loads, response_serializer=None
                ),
                "Stream": grpc.unary_stream_rpc_method_handler(
                    self._stream, request_deserializer=json.loads, response_serializer=None
                ),
            },
        )

    def add(self, buffer: VersionBuffer) -> None:
        with self._added:
            self._add_locked(buffer)

    def _add_locked(self, buffer: VersionBuffer) -> None:
        self._versions[buffer.key] = buffer
        # The newest ``keep`` versions, each in every form held (whole, deltas); older ones go
        # once complete or failed (one still filling may be streamed on right now).
        oldest_kept = sorted({v for v, _ in self._versions})[-self.keep :][0]
        for key, held in list(self._versions.items()):
            done = held.complete or held.error is not None
            if key[0] < oldest_kept and key != buffer.key and done:
                del self._versions[key]
        self._added.notify_all()

    @contextlib.contextmanager
    def expecting(self, key: tuple[int, int]) -> Iterator[None]:
        """Readers of ``key`` wait for it while this process asks its own sources for it."""
        with self._added:
            self._expected[key] += 1
        try:
            yield
        finally:
            with self._added:
                self._expected[key] -= 1
                if not self._expected[key]:
                    del self._expected[key]
                self._added.notify_all()

    def get(self, version: int, base: int = FULL) -> VersionBuffer | None:
        """The buffer held for the key, unless it failed."""
        with self._lock:
            held = self._versions.get((version, base))
        return held if held is not None and held.error is None else None

    def newest(self) -> VersionBuffer | None:
        """The newest complete whole version held."""
        with self._lock:
            whole = [k for k, b in self._versions.items() if k[1] == FULL and b.complete]
            return self._versions[max(whole)] if whole else None

    def _buffer(self, request: dict, context: grpc.ServicerContext) -> VersionBuffer:
        """The buffer asked for, waited for up to ``appear_s``: the workers of a chain are told
        to load at about the same time, and a reader may ask before its source does. A failed
        buffer counts as absent (a root makes it again)."""
        key = int(request["version"]), int(request.get("base", FULL))
        what = f"version {key[0]}" + (f" as a delta against {key[1]}" if key[1] != FULL else "")
        deadline = time.monotonic() + self.appear_s
        give_up = time.monotonic() + self.wait_s
        while True:
            held = self.get(*key)
            if held is not None:
                return held
            with self._lock:
                # Held newer, or this version in another form: what is asked will not come.
                newer = any(v > key[0] or (v == key[0] and b != key[1]) for v, b in self._versions)
                if key in self._expected:  # asked upstream: it comes, or the asking ends
                    newer = False
                    deadline = max(deadline, min(give_up, time.monotonic() + 0.25))
            if self.missing is not None:
                try:
                    made = self._make(key)
                except KeyError as e:
                    context.abort(grpc.StatusCode.NOT_FOUND, f"no {what} here: {e}")
                except Exception as e:  # noqa: BLE001 - the reader tries its next source
                    context.abort(grpc.StatusCode.UNAVAILABLE, f"{what}: {type(e).__name__}: {e}")
                if made is not None:
                    return made
            left = deadline - time.monotonic()
            if left <= 0 or newer or not context.is_active():
                context.abort(grpc.StatusCode.NOT_FOUND, f"this relay has no {what}")
            with self._added:
                # A root asks its store again: a version may be committed meanwhile.
                self._added.wait(left if self.missing is None else min(left, 0.25))

    def _make(self, key: tuple[int, int]) -> VersionBuffer | None:
        """``missing(key)`` once for all the readers asking for the key at the same time (a
        delta is encoded once); the others wait for it. Raises what it raised."""
        with self._lock:
            making = self._making.get(key)
            mine = making is None
            if mine:
                making = self._making[key] = _Making()
        if not mine:
            making.done.wait()
        else:
            try:
                making.buffer = self.missing(key)
            except BaseException as e:  # noqa: BLE001 - raised to every reader below
                making.error = e
            with self._added:
                if making.buffer is not None:
                    self._add_locked(making.buffer)
                del self._making[key]
            making.done.set()
        if making.error is not None:
            raise making.error
        return making.buffer

    def _wait(self, buffer: VersionBuffer, k: int, context: grpc.ServicerContext) -> None:
        """Waits up to ``wait_s`` for bucket k, in short waits: a reader that went away (or a
        server stopping) ends the wait, rather than holding one of gRPC's threads."""
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                buffer.wait(k, min(1.0, max(0.0, deadline - time.monotonic())))
                return
            except RelayFailed as e:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            except TimeoutError as e:
                if not context.is_active() or time.monotonic() >= deadline:
                    context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    def _manifest(self, request: dict, context: grpc.ServicerContext) -> bytes:
        buffer = self._buffer(request, context)
        return json.dumps(
            {"layout": dataclasses.asdict(buffer.layout), "base": buffer.base, "meta": buffer.meta}
        ).encode()

    def _stream(self, request: dict, context: grpc.ServicerContext) -> Iterator[bytes]:
        buffer = self._buffer(request, context)
        for k in range(int(request["first"]), buffer.layout.buckets):
            self._wait(buffer, k, context)
            crc, data = buffer.bucket(k)
            self.egress.take(len(data))
            message = _HEADER.pack(k, crc, len(data)) + data
            with self._lock:
                self.bytes_sent += len(data)
            yield message


@dataclasses.dataclass
class _Making:
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    buffer: VersionBuffer | None = None
    error: BaseException | None = None


class RelayServer(RelayService):
    """A RelayService on a gRPC server of its own at ``address``."""

    def __init__(
        self,
        address: str = "127.0.0.1:0",
        *,
        credentials: Credentials = _NO_CREDENTIALS,
        **service: Any,
    ):
        """``service``: RelayService's arguments."""
        host = address.rsplit(":", 1)[0].strip("[]")
        if host not in ("127.0.0.1", "localhost", "::1") and not credentials.token():
            raise ValueError(
                f"a relay on {address} (beyond loopback) needs an auth token: it serves weights"
            )
        super().__init__(**service)
        self._server, self.port = make_server(
            address,
            lambda s: s.add_generic_rpc_handlers((self.handlers(),)),
            credentials=credentials,
            max_workers=32,
        )
        self.endpoint = f"{host}:{self.port}"

    def stop(self) -> None:
        """Stops serving at once (in-flight streams are cut: their readers fail over)."""
        self._server.stop(None).wait()


class Publisher:
    """The root of the chain (the trainer's host): a version's arrays copied into a buffer
    bucket by bucket on a thread, each bucket served as soon as it is filled."""

    def __init__(self, server: RelayServer, *, bucket_bytes: int = BUCKET_BYTES):
        self.server, self.bucket_bytes = server, bucket_bytes

    def publish(self, version: int, arrays: Sequence[tuple[str, Any]]) -> VersionBuffer:
        """Starts serving ``arrays`` ((path, jax or numpy array)) as ``version``; returns its
        buffer at once (``buffer.wait(buffer.layout.buckets - 1)`` waits for the last bucket)."""
        layout = Layout.of(arrays, self.bucket_bytes)
        buffer = VersionBuffer(version, layout)
        self.server.add(buffer)
        threading.Thread(
            target=fill_from_arrays, args=(buffer, [a for _, a in arrays]), daemon=True
        ).start()
        return buffer


def fill_from_arrays(buffer: VersionBuffer, arrays: Sequence[Any]) -> None:
    """Fills ``buffer`` with ``arrays`` (in layout order; jax or numpy), serving each bucket as
    soon as it is written. Marks the buffer failed on any error."""
    fill_from_pieces(buffer, ((i, 0, a) for i, a in enumerate(arrays)))


def fetch(
    version: int,
    sources: Sequence[str],
    into: RelayService,
    *,
    credentials: Credentials | Callable[[str], Credentials] = _NO_CREDENTIALS,
    timeout_s: float = 600.0,
    on_source: Callable[[str], None] | None = None,
    on_buffer: Callable[[VersionBuffer], None] | None = None,
    base: int = FULL,
    idle_s: float = IDLE_S,
) -> VersionBuffer:
    """Receives ``version`` into a buffer that ``into`` serves as it fills, from ``sources`` in
    order (failing over at the first bucket missing, to a source of the same publish: one
    relaying another publish of the version fails the fetch). Returns the whole, verified
    buffer; raises RelayFailed (the buffer marked failed) when every source failed.
    ``credentials``: one for every source, or a source's own (``credentials(endpoint)``).
    ``on_source(endpoint)``:
    called as each source is tried; ``on_buffer(buffer)``: once the buffer exists. ``base``: a
    delta against that version instead of the whole version. A source that answers nothing for
    ``idle_s`` is left for the next (a host gone without closing its connections)."""
    buffer: VersionBuffer | None = None
    errors: list[str] = []
    mixed: RelayFailed | None = None
    try:
        for source in sources:
            creds = credentials(source) if callable(credentials) else credentials
            channel = make_channel(source, credentials=creds)
            try:
                if buffer is None:
                    with into.expecting((version, base)):
                        buffer = _manifest(channel, version, base, min(timeout_s, idle_s))
                        into.add(buffer)
                    if on_buffer is not None:
                        on_buffer(buffer)
                else:
                    raw = _manifest_raw(channel, version, base, min(timeout_s, idle_s))
                    if (
                        origin(raw["meta"]) != origin(buffer.meta)
                        or Layout.from_dict(raw["layout"]) != buffer.layout
                    ):
                        if buffer.filled:  # its bytes may differ from those received
                            mixed = RelayFailed(
                                f"version {version}: {source} serves it from another publish "
                                f"than the {buffer.filled} buckets received; not resumed there"
                            )
                            break
                        buffer.meta = raw["meta"]
                if on_source is not None:
                    on_source(source)
                # No deadline on the whole stream (a long chain waits on its upstream hops), but
                # one on the silence between its messages.
                stream = channel.unary_stream(
                    f"/{SERVICE}/Stream", request_serializer=_json, response_deserializer=None
                )({"version": version, "base": base, "first": buffer.filled})
                with _Watchdog(stream, idle_s) as watchdog:
                    for message in stream:
                        watchdog.saw()
                        k, crc, n = _HEADER.unpack_from(message)
                        buffer.put(k, memoryview(message)[_HEADER.size : _HEADER.size + n], crc)
                if buffer.complete:
                    return buffer
                errors.append(f"{source}: the stream ended at bucket {buffer.filled}")
            except Exception as e:  # noqa: BLE001 - whatever a source did wrong, the next one is tried
                why = e.details() if isinstance(e, grpc.RpcError) else f"{type(e).__name__}: {e}"
                errors.append(f"{source}: {why}")
                log.warning(
                    "relay of version %d from %s failed (%s); next source", version, source, why
                )
            finally:
                channel.close()
        if mixed is not None:
            raise mixed
        raise RelayFailed(f"version {version}: every source failed: {'; '.join(errors)}")
    except BaseException as e:
        if buffer is not None and not buffer.complete:  # readers fail over, arrays stay hidden
            buffer.fail(e)
        raise


def _manifest_raw(channel: grpc.Channel, version: int, base: int, timeout_s: float) -> dict:
    raw = json.loads(
        channel.unary_unary(
            f"/{SERVICE}/Manifest", request_serializer=_json, response_deserializer=None
        )({"version": version, "base": base}, timeout=timeout_s)
    )
    if raw["base"] != base:
        raise DataLoss(f"asked for base {base}, the manifest says {raw['base']}")
    return raw


def _manifest(channel: grpc.Channel, version: int, base: int, timeout_s: float) -> VersionBuffer:
    """An empty buffer for what a source's Manifest describes."""
    raw = _manifest_raw(channel, version, base, timeout_s)
    return VersionBuffer(version, Layout.from_dict(raw["layout"]), base=base, meta=raw["meta"])


def origin(meta: Any) -> str | None:
    """Which publish a root made a buffer from (``meta["source"]``): a reader resumes only on
    a source of the same bytes (the parameter server relays a version as it arrives, before
    its checksums are known)."""
    return meta.get("source") if isinstance(meta, dict) else None


class _Watchdog:
    """Cancels ``call`` once nothing was ``saw()`` for ``idle_s``."""

    def __init__(self, call: Any, idle_s: float):
        self.call, self.idle_s = call, idle_s
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relay-watchdog", daemon=True)

    def saw(self) -> None:
        self.last = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.idle_s / 4)):
            if time.monotonic() - self.last > self.idle_s:
                self.call.cancel()
                return

    def __enter__(self) -> _Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()


def to_device(buffer: VersionBuffer, shardings: Sequence[Any]) -> list[jax.Array]:
    """The buffer's arrays on ``shardings`` (in layout order), each uploaded as soon as its
    bytes are verified (while later buckets still arrive)."""
    if len(shardings) != len(buffer.layout.paths):
        raise ValueError(
            f"{len(shardings)} shardings for the {len(buffer.layout.paths)} arrays of version "
            f"{buffer.version}"
        )
    out = []
    for i, sharding in enumerate(shardings):
        host = buffer.array(i)
        out.append(
            jax.make_array_from_callback(host.shape, sharding, lambda index, h=host: h[index])
        )
    return out


def fetch_to_device(
    version: int,
    sources: Sequence[str],
    into: RelayService,
    shardings: Sequence[Any] | Mapping[str, Any],
    *,
    credentials: Credentials | Callable[[str], Credentials] = _NO_CREDENTIALS,
    timeout_s: float = 600.0,
    on_buffer: Callable[[VersionBuffer], None] | None = None,
) -> list[jax.Array] | dict[str, jax.Array]:
    """``fetch`` on a thread while ``to_device`` uploads each array as its bytes arrive:
    receiving, checking and uploading overlap. ``shardings``: in layout order, or by path (the
    layout's paths must be exactly its keys). Returns the arrays in layout order (a list), or by
    path (a dict) when ``shardings`` are by path; raises what the fetch raised, else RelayFailed
    when the version's arrays are not the ones asked for."""
    got: dict[str, Any] = {}
    started = threading.Event()

    def buffer_made(buffer: VersionBuffer) -> None:
        got["buffer"] = buffer
        if on_buffer is not None:
            on_buffer(buffer)
        started.set()

    def run() -> None:
        try:
            fetch(
                version,
                sources,
                into,
                credentials=credentials,
                timeout_s=timeout_s,
                on_buffer=buffer_made,
            )
        except BaseException as e:  # noqa: BLE001 - raised by the caller's thread
            got["error"] = e
        started.set()

    thread = threading.Thread(target=run, name=f"relay-v{version}", daemon=True)
    thread.start()
    started.wait()
    try:
        if "buffer" in got:
            buffer = got["buffer"]
            if isinstance(shardings, Mapping):
                arrays = to_device(buffer, _in_layout_order(buffer, shardings))
                arrays = dict(zip(buffer.layout.paths, arrays, strict=True))
            else:
                arrays = to_device(buffer, shardings)
    except RelayFailed as e:
        got["placing"] = e  # after the fetch's own error, if it had one
    thread.join()
    if "error" in got or "placing" in got:
        raise got.get("error", got.get("placing"))
    return arrays


def rebuild(delta_buffer: VersionBuffer, base: VersionBuffer) -> VersionBuffer:
    """The whole version ``delta_buffer`` (complete) encodes against ``base`` (whole, complete),
    each array checked against the version's published CRC32C (DataLoss: not that base, or a
    damaged delta). The result is complete, its buckets checksummed for serving on."""
    if delta_buffer.base != base.version or base.base != FULL:
        raise DataLoss(
            f"a delta against version {delta_buffer.base} cannot be applied to "
            f"{base.version}{'' if base.base == FULL else ' (itself a delta)'}"
        )
    payload = {p: delta_buffer.array(i) for i, p in enumerate(delta_buffer.layout.paths)}
    tree = delta.from_payload(delta_buffer.meta, payload)
    base.wait(base.layout.buckets - 1)
    layout = base.layout
    out = VersionBuffer(delta_buffer.version, layout)
    out.data[:] = base.data
    delta.apply_tree_into([out.view(i) for i in range(len(layout.paths))], tree)
    for k in range(layout.buckets):
        out.fill(k)
    return out


class RelayedWeights:
    """An inference worker's weight source over a chain of relays: ``fetch(version)`` receives
    the version from ``sources`` in order (the controller names them with each load: the worker
    before this one, then the parameter server), serves it on from ``service`` while it arrives,
    and puts each array on its sharding (``shardings``: a pytree shaped like the published tree)
    once its bytes are verified. With ``deltas`` N > 1, a worker holding an older whole version
    asks for the new one as a delta against it first (at most N - 1 in a row, then a whole
    version), and for the whole version if no source has that delta or its rebuild fails.
    Without sources, or when every source failed, ``fallback.fetch(version)`` (a pull from the
    parameter server). Safe for fetches on several threads (a staged fetch beside a load)."""

    def __init__(
        self,
        service: RelayService,
        shardings: Any,
        fallback: Any,
        *,
        credentials: Credentials | Callable[[str], Credentials] = _NO_CREDENTIALS,
        timeout_s: float = 600.0,
        deltas: int = 0,
    ):
        self.service, self.shardings, self.fallback = service, shardings, fallback
        self.credentials, self.timeout_s, self.deltas = credentials, timeout_s, deltas
        self.sources: tuple[str, ...] = ()
        self.counts = {"relayed": 0, "as_deltas": 0, "pulled": 0, "bytes_received": 0}
        self._deltas_in_a_row = 0
        self._lock = threading.Lock()

    @property
    def bytes_received(self) -> int:
        """Bytes of weights received over the network so far: relayed, and pulled."""
        return self.counts["bytes_received"] + getattr(self.fallback, "bytes_received", 0)

    def _count(self, **add: int) -> None:
        with self._lock:
            for k, v in add.items():
                self.counts[k] += v

    def fetch(self, version: int) -> Any:
        sources = self.sources
        if sources:
            paths, leaves, treedef = flatten(self.shardings)
            by_path = dict(zip(paths, leaves, strict=True))
            try:
                placed = self._held(version, by_path) or self._from_delta(version, sources, by_path)
                if placed is None:
                    got: list[VersionBuffer] = []
                    placed = fetch_to_device(
                        version,
                        sources,
                        self.service,
                        by_path,
                        credentials=self.credentials,
                        timeout_s=self.timeout_s,
                        on_buffer=got.append,
                    )
                    self._count(bytes_received=got[0].layout.total)
                    with self._lock:
                        self._deltas_in_a_row = 0
            except RelayFailed as e:
                log.warning("version %d: %s; pulling it from the parameter server", version, e)
            else:
                self._count(relayed=1)
                return jax.tree_util.tree_unflatten(treedef, [placed[p] for p in paths])
        self._count(pulled=1)
        return self.fallback.fetch(version)

    def _held(self, version: int, by_path: dict[str, Any]) -> dict[str, jax.Array] | None:
        """The version from a whole copy this worker holds already (fetched ahead, say)."""
        held = self.service.get(version)
        if held is None or not held.complete:
            return None
        arrays = to_device(held, _in_layout_order(held, by_path))
        return dict(zip(held.layout.paths, arrays, strict=True))

    def _from_delta(
        self, version: int, sources: Sequence[str], by_path: dict[str, Any]
    ) -> dict[str, jax.Array] | None:
        """The version rebuilt from a delta against the newest whole version held, on its
        shardings; None when there is no such base, a whole version is due, or no source could
        give the delta or it did not rebuild."""
        with self._lock:
            if self._deltas_in_a_row >= self.deltas - 1:  # deltas off, or a whole one is due
                return None
        base = self.service.newest()
        if base is None or base.version >= version:
            return None
        try:
            got = fetch(
                version,
                sources,
                self.service,
                credentials=self.credentials,
                timeout_s=self.timeout_s,
                base=base.version,
            )
            whole = rebuild(got, base)
        except Exception as e:  # noqa: BLE001 - any failure of a delta: the whole version
            log.info(
                "version %d as a delta against %d: %s; fetching it whole", version, base.version, e
            )
            return None
        self.service.add(whole)  # served on as a whole version too
        self._count(as_deltas=1, bytes_received=got.layout.total)
        with self._lock:
            self._deltas_in_a_row += 1
        arrays = to_device(whole, _in_layout_order(whole, by_path))
        return dict(zip(whole.layout.paths, arrays, strict=True))


def _in_layout_order(buffer: VersionBuffer, by_path: Mapping[str, Any]) -> list[Any]:
    paths = buffer.layout.paths
    if set(paths) != set(by_path) or len(paths) != len(by_path):
        error = RelayFailed(
            f"version {buffer.version} has arrays {sorted(set(paths) ^ set(by_path))[:5]} where "
            "this reader's tree does not, or the other way round"
        )
        buffer.fail(error)  # its readers fail over; nothing is handed out
        raise error
    return [by_path[p] for p in paths]


class Feed:
    """Fills a buffer from whole arrays that complete in any order (a root relaying a version
    while it is still being published to it): each bucket is served once every array it holds is
    in, except the last, held back until ``release`` (the publisher's checksums matched and the
    version is committed), so that no reader completes a version that fails them. Thread-safe
    (parts of a version arrive on several streams at once)."""

    def __init__(self, buffer: VersionBuffer):
        self.buffer = buffer
        self._done = [False] * len(buffer.layout.paths)
        self._next = 0  # the first array not yet done
        self._bucket = 0  # the next bucket to serve
        self._lock = threading.Lock()

    def view(self, i: int) -> np.ndarray:
        """Array i in the buffer, for its writer (before ``done(i)``)."""
        return self.buffer.view(i)

    def done(self, i: int) -> None:
        """Array i's bytes are all written: serves the buckets that completes (the last held)."""
        layout, data = self.buffer.layout, self.buffer.data
        end = layout.offsets[i + 1] if i + 1 < len(layout.paths) else layout.total
        data[layout.offsets[i] + layout.nbytes(i) : end] = 0  # alignment padding
        with self._lock:
            self._done[i] = True
            while self._next < len(self._done) and self._done[self._next]:
                self._next += 1
            self._serve(last=False)

    def release(self) -> None:
        """Every array is in and checked: serves the rest, the last bucket included."""
        with self._lock:
            if self._next < len(self._done):
                missing = self.buffer.layout.paths[self._next]
                raise DataLoss(f"version {self.buffer.version}: {missing} was never completed")
            self._serve(last=True)

    def _serve(self, *, last: bool) -> None:
        layout = self.buffer.layout
        ready = layout.offsets[self._next] if self._next < len(self._done) else layout.total
        stop = layout.buckets if last else layout.buckets - 1
        while self._bucket < stop and (
            (self._bucket + 1) * layout.bucket_bytes <= ready or self._next == len(self._done)
        ):
            self.buffer.fill(self._bucket)
            self._bucket += 1

    def fail(self, error: BaseException) -> None:
        """Readers fail over; a buffer already whole stays as it is."""
        with self._lock:  # not beside a release
            if not self.buffer.complete:
                self.buffer.fail(error)


def fill_from_pieces(
    buffer: VersionBuffer,
    pieces: Iterator[tuple[int, int, Any]],
    crcs: Sequence[int] | None = None,
) -> None:
    """Fills ``buffer`` from whole arrays written in order in pieces (array index, byte offset
    in it, data), serving the buckets holding each array once it is whole; with ``crcs``, once
    it also matches its CRC32C there (the root of a chain: what it serves is what was
    published). Marks the buffer failed on any error."""
    layout, feed = buffer.layout, Feed(buffer)
    following = 0  # the next array to complete

    def complete(k: int) -> None:
        nonlocal following
        lo = layout.offsets[k]
        if crcs is not None and checksum(buffer.data[lo : lo + layout.nbytes(k)]) != crcs[k]:
            raise DataLoss(f"version {buffer.version}: {layout.paths[k]} fails its checksum")
        feed.done(k)
        following = k + 1

    def skip_to(k: int) -> None:
        """Arrays before k sent no piece: they must be empty."""
        for j in range(following, k):
            if layout.nbytes(j):
                raise DataLoss(f"version {buffer.version}: no bytes of {layout.paths[j]}")
            complete(j)

    try:
        for k, offset, data in pieces:
            if k < following:
                raise DataLoss(f"version {buffer.version}: {layout.paths[k]} read twice")
            skip_to(k)
            raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
            lo = layout.offsets[k] + offset
            buffer.data[lo : lo + raw.size] = raw
            if offset + raw.size >= layout.nbytes(k):
                complete(k)
        skip_to(len(layout.paths))
        feed.release()
    except BaseException as e:  # noqa: BLE001 - its readers fail over
        buffer.fail(e)


def _json(obj: dict) -> bytes:
    return json.dumps(obj).encode()
