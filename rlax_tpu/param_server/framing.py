"""Chunk messages encoded and decoded without protobuf copies of the payload.

The bytes on the wire are exactly protobuf's (``PublishRequest.chunk`` and ``PullReply.chunk``
are field 2 holding a ``Chunk``): any protobuf client or server interoperates. Only the hot path
differs: encoding writes the tag bytes and the payload view in one join (protobuf would copy the
payload into a ``bytes`` and again when serializing), decoding hands out a ``memoryview`` into the
received buffer instead of a copy. Anything else (headers, trailers, unusual encodings) goes
through protobuf.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from rlax_tpu.rpc import param_server_pb2 as pb

SERVICE = "rlax_tpu.ParamServer"  # the proto's package and service name
_CHUNK_FIELD_TAG = 2 << 3 | 2  # field 2, length-delimited
_INDEX, _OFFSET, _DATA = 1 << 3 | 0, 2 << 3 | 0, 3 << 3 | 2


class ChunkView(NamedTuple):
    """Bytes [offset, offset + len(data)) of array or slice ``index``; ``data`` is a view."""

    index: int
    offset: int
    data: memoryview


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("malformed varint")
        b = buf[pos]
        value |= (b & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not b & 0x80:
            return value, pos


def encode_chunk(index: int, offset: int, data: memoryview) -> bytes:
    """A PublishRequest / PullReply holding one Chunk, with one copy of ``data``."""
    inner = (
        (bytes([_INDEX]) + _varint(index) if index else b"")
        + (bytes([_OFFSET]) + _varint(offset) if offset else b"")
        + (bytes([_DATA]) + _varint(len(data)) if len(data) else b"")
    )  # proto3 leaves out fields that hold their default
    head = bytes([_CHUNK_FIELD_TAG]) + _varint(len(inner) + len(data)) + inner
    return b"".join((head, data))


def _decode_chunk(buf: bytes) -> ChunkView | None:
    """The fast path: a message that is exactly one field-2 Chunk of fields 1-3; else None."""
    view = memoryview(buf)
    if not view or view[0] != _CHUNK_FIELD_TAG:
        return None
    length, pos = _read_varint(view, 1)
    if pos + length != len(view):
        return None
    index = offset = 0
    data = view[0:0]
    while pos < len(view):
        tag, pos = _read_varint(view, pos)
        if tag == _INDEX:
            index, pos = _read_varint(view, pos)
        elif tag == _OFFSET:
            offset, pos = _read_varint(view, pos)
        elif tag == _DATA:
            n, pos = _read_varint(view, pos)
            if pos + n > len(view):
                return None
            data, pos = view[pos : pos + n], pos + n
        else:
            return None
    return ChunkView(index, offset, data)


def _decoder(message: Any) -> Any:
    def decode(buf: bytes) -> Any:
        try:
            fast = _decode_chunk(buf)
        except ValueError:
            fast = None
        if fast is not None:
            return fast
        msg = message.FromString(buf)
        if msg.WhichOneof("part") == "chunk":
            return ChunkView(msg.chunk.index, msg.chunk.offset, memoryview(msg.chunk.data))
        return msg

    return decode


def encode(message: Any) -> bytes:
    """Serializer for PublishRequest / PullReply streams: ChunkView, a protobuf message, or a
    message already encoded (bytes, as ``encode_chunk`` gives)."""
    if isinstance(message, bytes):
        return message
    if isinstance(message, ChunkView):
        return encode_chunk(*message)
    return message.SerializeToString()


decode_publish_request = _decoder(pb.PublishRequest)
decode_pull_reply = _decoder(pb.PullReply)
