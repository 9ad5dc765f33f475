"""Every bad input gets a clear gRPC status and leaves the store exactly as it was."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from rlax_tpu.param_server import errors
from rlax_tpu.param_server.codec import checksum, flatten
from rlax_tpu.rpc import param_server_pb2 as pb
from rlax_tpu.rpc import param_server_pb2_grpc
from rlax_tpu.rpc.transport import make_channel
from tests.param_server.conftest import assert_same_tree, make_tree


@pytest.fixture
def seeded(ps):
    """A server holding version 0 of the test tree, and a raw stub for hand-made streams."""
    ps.client.push(make_tree(0), 0)
    channel = make_channel(ps.endpoint)
    yield ps, param_server_pb2_grpc.ParamServerStub(channel)
    channel.close()
    # The store is unchanged: same versions, same bytes, no staged leftovers.
    versions, latest = ps.client.list_versions()
    assert [v.version for v in versions] == [0] and latest == 0
    assert_same_tree(ps.client.pull(0), make_tree(0))
    committed, stored = ps.store.stored_prefixes()
    assert committed == stored and len(committed) == 1


def header(version: int, arrays: list[tuple[str, list[int], str]]) -> pb.PublishRequest:
    metas = [pb.ArrayMeta(path=p, shape=s, dtype=d) for p, s, d in arrays]
    return pb.PublishRequest(header=pb.VersionHeader(version=version, step=version, arrays=metas))


def chunk(index: int, offset: int, data: bytes) -> pb.PublishRequest:
    return pb.PublishRequest(chunk=pb.Chunk(index=index, offset=offset, data=data))


def trailer(*crcs: int) -> pb.PublishRequest:
    return pb.PublishRequest(trailer=pb.PublishTrailer(crc32=crcs))


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


ONE = [("x", [4], "float32")]
DATA = np.arange(4, dtype=np.float32).tobytes()


def test_unknown_version(seeded):
    ps, stub = seeded
    code, details = status_of(lambda: list(stub.Pull(pb.PullRequest(version=9))))
    assert code == grpc.StatusCode.NOT_FOUND and "version 9 is not held (hot: [0])" in details
    with pytest.raises(errors.NotFound):
        ps.client.pull(9)


def test_duplicate_version_with_different_content(seeded):
    ps, _ = seeded
    with pytest.raises(errors.AlreadyExists, match="exists with different content"):
        ps.client.push(make_tree(1), 0)  # same tree and shapes, other values
    changed = make_tree(0)
    changed["head"] = changed["head"][:, :8]
    with pytest.raises(errors.AlreadyExists, match="different tree, shapes or dtypes"):
        ps.client.push(changed, 0)


def test_shape_or_dtype_mismatch_with_the_model_tree(seeded):
    ps, _ = seeded
    wrong_dtype = make_tree(0)
    wrong_dtype["embed"] = wrong_dtype["embed"].astype(np.float32)
    with pytest.raises(errors.InvalidArgument, match=r'\["embed"\] is float32\[64, 16\], expected'):
        ps.client.push(wrong_dtype, 1)
    wrong_shape = make_tree(0)
    wrong_shape["layers"][1]["norm"] = np.zeros(17, np.float32)
    with pytest.raises(errors.InvalidArgument, match="does not match the tree"):
        ps.client.push(wrong_shape, 1)


def tree_header(version: int) -> tuple[pb.PublishRequest, bytes]:
    """The header of the test tree as ``version``, and its first array's bytes."""
    paths, leaves, _ = flatten(make_tree(0))
    arrays = [(p, list(a.shape), a.dtype.name) for p, a in zip(paths, leaves, strict=True)]
    return header(version, arrays), leaves[0].tobytes()


def test_bytes_beyond_the_declared_shape(seeded):
    _, stub = seeded
    head, first = tree_header(1)
    stream = [head, chunk(0, 0, first + b"\0\0")]
    code, details = status_of(lambda: stub.Publish(iter(stream)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "is declared bfloat16[64, 16]" in details


def test_unsupported_dtype_and_bad_stream_shapes(seeded):
    _, stub = seeded
    code, details = status_of(lambda: stub.Publish(iter([header(1, [("x", [4], "complex64")])])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unsupported dtype 'complex64'" in details
    code, _ = status_of(lambda: stub.Publish(iter([chunk(0, 0, DATA)])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT  # no header first
    head, first = tree_header(1)
    code, details = status_of(lambda: stub.Publish(iter([head, chunk(0, 4, first[4:])])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "chunk at offset 4, expected 0" in details
    code, details = status_of(lambda: stub.Publish(iter([head, chunk(2, 0, first)])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "while array 0" in details


@pytest.mark.parametrize(
    "stream_end",
    [[], [chunk(0, 0, DATA[:8])], [chunk(0, 0, DATA[:8]), trailer(0)]],
    ids=["header only", "no trailer", "missing bytes"],
)
def test_truncated_stream(ps, stream_end):
    # A fresh server: this tree is the first, so only the truncation is wrong.
    stub = param_server_pb2_grpc.ParamServerStub(make_channel(ps.endpoint))
    code, details = status_of(lambda: stub.Publish(iter([header(0, ONE), *stream_end])))
    assert code == grpc.StatusCode.DATA_LOSS and "truncated publish of version 0" in details
    assert ps.client.list_versions() == ([], None)
    committed, stored = ps.store.stored_prefixes()
    assert committed == stored == set()


def test_checksum_mismatch(ps):
    stub = param_server_pb2_grpc.ParamServerStub(make_channel(ps.endpoint))
    stream = [header(0, ONE), chunk(0, 0, DATA), trailer(checksum(DATA) ^ 1)]
    code, details = status_of(lambda: stub.Publish(iter(stream)))
    assert code == grpc.StatusCode.DATA_LOSS and "checksum mismatch in ['x']" in details
    assert ps.client.list_versions() == ([], None)
    good = [header(0, ONE), chunk(0, 0, DATA), trailer(checksum(DATA))]
    assert stub.Publish(iter(good)).info.version == 0  # the same stream with the right crc


def test_bad_slices(seeded):
    ps, _ = seeded
    with pytest.raises(errors.InvalidArgument, match="out of bounds"):
        ps.client.pull_arrays(0, [(0, ((0, 65), (0, 16)))])
    with pytest.raises(errors.InvalidArgument, match="array index 99"):
        ps.client.pull_arrays(0, [(99, ((0, 1),))])


def assert_nothing_staged(ps) -> None:
    assert ps.store._publishing == set()
    committed, stored = ps.store.stored_prefixes()
    assert committed == stored


def test_a_rank_beyond_32_is_refused_and_does_not_block_its_version_number(ps):
    too_deep = {"a": np.ones(8, np.float32), "b": np.zeros((1,) * 33, np.float32)}
    with pytest.raises(errors.InvalidArgument, match="rank 33"):
        ps.client.push(too_deep, 0)
    stub = param_server_pb2_grpc.ParamServerStub(make_channel(ps.endpoint))
    deep = [("a", [8], "float32"), ("b", [1] * 33, "float32")]
    code, details = status_of(lambda: stub.Publish(iter([header(0, deep)])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "rank 33" in details
    assert ps.client.list_versions() == ([], None)
    assert_nothing_staged(ps)
    assert ps.client.push(make_tree(0), 0).version == 0  # the number is free to use
    assert_same_tree(ps.client.pull(0), make_tree(0))
    assert_nothing_staged(ps)


@pytest.mark.parametrize("over_grpc", [True, False], ids=["grpc", "in-process"])
def test_a_publish_that_fails_to_start_leaves_nothing_behind(ps, monkeypatch, over_grpc):
    create = ps.store._hot.create_array

    def failing(prefix, i, spec):
        if i == 1:  # array 0's creation is already under way under the staging prefix
            raise ValueError("the store refuses this array")
        return create(prefix, i, spec)

    monkeypatch.setattr(ps.store._hot, "create_array", failing)
    tree = {"a": np.ones(8, np.float32), "b": np.zeros(4, np.float32)}
    if over_grpc:
        with pytest.raises(grpc.RpcError):
            ps.client.push(tree, 0)
    else:
        with pytest.raises(ValueError, match="refuses"):
            ps.store.publish(0, 0, ["a", "b"], [tree["a"], tree["b"]])
    assert_nothing_staged(ps)
    monkeypatch.setattr(ps.store._hot, "create_array", create)
    assert ps.client.push(tree, 0).version == 0  # a retry of the same number goes through
    assert_same_tree(ps.client.pull(0), tree)
    assert_nothing_staged(ps)
