"""The copy-free chunk framing is byte-for-byte protobuf."""

from __future__ import annotations

import pytest

from rlax_tpu.param_server.framing import (
    ChunkView,
    decode_publish_request,
    decode_pull_reply,
    encode,
)
from rlax_tpu.rpc import param_server_pb2 as pb


@pytest.mark.parametrize(
    "index, offset, data",
    [
        (0, 0, b""),
        (0, 0, b"x"),
        (3, 0, b"abc"),
        (0, 2**40, b"\0" * 300),
        (2**31, 5, bytes(range(256)) * 70),
    ],
)
def test_chunks_encode_and_decode_like_protobuf(index, offset, data):
    encoded = encode(ChunkView(index, offset, memoryview(data)))
    assert (
        encoded
        == pb.PullReply(chunk=pb.Chunk(index=index, offset=offset, data=data)).SerializeToString()
    )
    assert (
        encoded
        == pb.PublishRequest(
            chunk=pb.Chunk(index=index, offset=offset, data=data)
        ).SerializeToString()
    )
    for decode in (decode_pull_reply, decode_publish_request):
        got = decode(encoded)
        assert isinstance(got, ChunkView)
        assert (got.index, got.offset, bytes(got.data)) == (index, offset, data)


def test_other_messages_and_odd_encodings_go_through_protobuf():
    header = pb.PullReply(header=pb.VersionHeader(version=4))
    assert decode_pull_reply(header.SerializeToString()) == header
    trailer = pb.PublishRequest(trailer=pb.PublishTrailer(crc32=[1, 2]))
    assert decode_publish_request(trailer.SerializeToString()) == trailer
    # Fields out of the usual order are still a valid encoding of the same chunk.
    odd = b"\x12\x08" + b"\x1a\x02hi" + b"\x08\x05" + b"\x10\x01"
    assert decode_pull_reply(odd) == (5, 1, memoryview(b"hi"))
    # A chunk field repeated (protobuf merges them) falls back to protobuf's reading.
    twice = pb.PullReply(chunk=pb.Chunk(index=1, data=b"a")).SerializeToString() * 2
    got = decode_pull_reply(twice)
    assert (got.index, bytes(got.data)) == (1, b"a")
