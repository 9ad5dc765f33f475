"""Test-wide setup. XLA_FLAGS must be set before jax is imported anywhere, so it is set here."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def free_port() -> int:
    """A port nothing listens on right now (for a server that must be told its port up front,
    such as jax.distributed's coordinator)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
