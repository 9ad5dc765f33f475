"""The parameter-server section."""

from __future__ import annotations

from rlax_tpu.config.checks import bad, check_address, frozen, non_negative, positive

# param_server/relay.py's BUCKET_BYTES and its 12-byte header (tests/param_server/test_relay.py
# holds the two equal).
RELAY_MESSAGE_BYTES = 4 * 2**20 + 12


@frozen
class ParamServerConfig:
    address: str = "127.0.0.1:0"  # gRPC address the parameter server serves on
    auth_token_file: str = ""  # file holding the token callers must present; needed off loopback
    tls_cert_file: str = ""  # PEM certificate and key to serve TLS with; '' plain
    # A second token that publishing (Publish, ReportProgress) needs besides auth_token_file:
    # given to the trainer only, so a worker that may pull weights cannot write them. "": none.
    publish_token_file: str = ""
    in_memory_versions: int = 4  # K: versions kept hot in memory (older ones garbage-collected)
    persist_every: int = 1  # write every N-th version through to persistent storage; 0: never
    persist_path: str = ""  # local dir or gs:// path; "" means <run_dir>/param_server
    # Newest complete persisted versions kept; older ones are deleted after each persist. 0: all.
    persist_keep: int = 3
    chunk_bytes: int = 4 * 2**20  # weights stream in messages of this size
    max_message_bytes: int = 64 * 2**20  # largest gRPC message accepted
    replicas: int = 1  # parameter-server replicas; the trainer publishes to all that are up
    replica_index: int = 0  # which of the replicas this server is; its commits are its progress
    # A push succeeds once this many replicas hold the version; the replicas that are down
    # (unreachable) are skipped and catch up when they return.
    publish_quorum: int = 1
    # A replica's reported progress holds GC back on the others for this long after the report: a
    # dead replica stops counting then (the trainer waits for room at most this long; keep it
    # below publish_room_wait_s).
    replica_lease_s: float = 60.0
    lease_ttl_s: float = 600.0  # a consumer's lease lapses unless renewed within this
    # A publish refused for room (every hot version still read, persisted or leased) is
    # retried with backoff for this long before the trainer's publish fails. 0: not retried.
    publish_room_wait_s: float = 300.0
    # One process holding the trainer and the workers (local transport, trainer in process): the
    # newest versions handed to the workers device to device, held on the trainer's devices
    # (each one published copy of their memory); the parameter server gets every version from a
    # background copy and serves the older ones. 0: workers pull every version from it.
    device_versions: int = 1
    # How the inference workers of a distributed run get a version: "replicas", each pulls it
    # from its parameter-server replica; "relay", a chain: worker k receives it from worker k-1
    # (the first from the parameter server) in checksummed buckets forwarded as they arrive, so
    # the parameter server sends a version once whatever the workers. Each relaying worker keeps
    # a host copy of the newest version it received. A worker over several processes pulls.
    fanout: str = "replicas"
    # How long a relay waits for a version it has not started receiving before its reader tries
    # the next source (the workers of a chain are told to load at about the same time).
    relay_appear_s: float = 3.0
    # With fanout "relay": a worker that holds an older version receives the new one as a delta
    # against it (the changed values; a bf16 cast mostly unchanged at RL learning rates), rebuilt
    # and checked against the published CRC32C; at most N - 1 deltas in a row, then a whole
    # version (as whenever its base is gone or a rebuild fails). 0 or 1: whole versions only.
    # Off by default: the parameter server encodes a delta when its first reader asks (about a
    # second a GiB per core here), on the reload's path, and a worker reloading every η_r
    # versions holds a base η_r versions old (a bf16 delta: 4.9% of a version against the one
    # before, 36% against one 16 older: benchmarks/RESULTS.md "Weight sync" (c)).
    relay_deltas: int = 0

    def __post_init__(self) -> None:
        positive(
            self,
            "chunk_bytes",
            "max_message_bytes",
            "replicas",
            "lease_ttl_s",
            "replica_lease_s",
            "publish_quorum",
            "relay_appear_s",
        )
        non_negative(
            self,
            "persist_every",
            "persist_keep",
            "publish_room_wait_s",
            "device_versions",
            "relay_deltas",
        )
        if self.replicas > 1 and 0 < self.publish_room_wait_s <= self.replica_lease_s:
            # A publish refused for room while a dead replica still holds GC back waits for
            # its lease to lapse: a shorter wait fails the publish first.
            raise bad(
                self,
                "replica_lease_s",
                f"must be < publish_room_wait_s ({self.publish_room_wait_s:g} s) with replicas",
            )
        if not 0 <= self.replica_index < self.replicas:
            raise bad(self, "replica_index", f"must be in [0, replicas={self.replicas})")
        if self.publish_quorum > self.replicas:
            raise bad(self, "publish_quorum", f"must be <= replicas ({self.replicas})")
        if self.in_memory_versions < 2:
            raise bad(
                self,
                "in_memory_versions",
                "must be >= 2 (a new version is written while the previous is read)",
            )
        if self.chunk_bytes > self.max_message_bytes:
            raise bad(
                self, "chunk_bytes", f"must be <= max_message_bytes ({self.max_message_bytes})"
            )
        if self.fanout not in ("replicas", "relay"):
            raise bad(self, "fanout", f"must be 'replicas' or 'relay', got {self.fanout!r}")
        if self.fanout == "relay" and self.max_message_bytes < RELAY_MESSAGE_BYTES:
            raise bad(
                self,
                "max_message_bytes",
                f"must be >= {RELAY_MESSAGE_BYTES} with fanout 'relay' (a relay message is a "
                "4 MiB bucket and its header)",
            )
        check_address(self, "address", self.auth_token_file, self.tls_cert_file)
