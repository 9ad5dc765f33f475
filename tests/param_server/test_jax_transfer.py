"""A fact the weight-sync design relies on: the pinned JAX ships ``jax.experimental.transfer``
(jax/experimental/transfer.py, "DCN cross slice transfer"): a ``TransferServer`` offers arrays
under a request id (``await_pull``) and a peer's connection fetches them as ShapeDtypeStructs with
shardings (``pull``), device to device without our code touching the bytes. It runs on the CPU
backend too, so a path built on it is testable here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import transfer


def test_a_peer_pulls_offered_arrays_bitwise_onto_the_asked_sharding():
    client = jax.devices()[0].client
    server = transfer.start_transfer_server(client, "127.0.0.1:0", ["127.0.0.1:0"])
    offered = [jnp.arange(1000, dtype=jnp.float32) * 0.1, jnp.ones((4, 3), jnp.bfloat16)]
    server.await_pull(7, offered)
    target = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target) for x in offered]
    got = server.connect(server.address()).pull(7, specs)
    for a, b in zip(got, offered, strict=True):
        assert a.sharding == target
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
