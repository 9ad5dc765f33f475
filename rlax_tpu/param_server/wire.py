"""Conversions between the parameter server's Python types and its protobuf messages.

The proto's ``crc32`` fields (ArrayMeta, PublishTrailer) carry CRC32C values (codec.checksum).
"""

from __future__ import annotations

from rlax_tpu.param_server.codec import ArraySpec, VersionManifest
from rlax_tpu.param_server.server import VersionInfo
from rlax_tpu.rpc import param_server_pb2 as pb


def spec_to_pb(spec: ArraySpec) -> pb.ArrayMeta:
    return pb.ArrayMeta(
        path=spec.path,
        shape=spec.shape,
        dtype=spec.dtype,
        sharding=spec.sharding,
        shard_shape=spec.shard_shape,
        crc32=spec.crc32c,
    )


def spec_from_pb(meta: pb.ArrayMeta) -> ArraySpec:
    return ArraySpec(
        path=meta.path,
        shape=tuple(meta.shape),
        dtype=meta.dtype,
        crc32c=meta.crc32,
        sharding=meta.sharding,
        shard_shape=tuple(meta.shard_shape),
    )


def header_to_pb(manifest: VersionManifest) -> pb.VersionHeader:
    return pb.VersionHeader(
        version=manifest.version,
        step=manifest.step,
        arrays=[spec_to_pb(a) for a in manifest.arrays],
    )


def header_from_pb(header: pb.VersionHeader) -> VersionManifest:
    return VersionManifest(
        version=header.version,
        step=header.step,
        arrays=tuple(spec_from_pb(a) for a in header.arrays),
    )


def info_to_pb(info: VersionInfo) -> pb.VersionInfo:
    return pb.VersionInfo(
        version=info.version,
        step=info.step,
        nbytes=info.nbytes,
        persisted=info.persisted,
        leased_by=info.leased_by,
    )


def info_from_pb(info: pb.VersionInfo) -> VersionInfo:
    return VersionInfo(
        version=info.version,
        step=info.step,
        nbytes=info.nbytes,
        persisted=info.persisted,
        leased_by=tuple(info.leased_by),
    )
