"""What every section's validation uses: the error type and small checks."""

from __future__ import annotations

import dataclasses
import glob
import ipaddress
from typing import Any, Literal

# Acceptance staleness meaning "no bound" (η_a = ∞, RLAX's fully off-policy mode).
UNBOUNDED = -1


NO_VALUE = object()


class ConfigError(ValueError):
    """A bad config value: ``<field> = <value>: <why>``, with ``field`` the dotted path."""

    def __init__(self, field: str, why: str, value: Any = NO_VALUE):
        self.field, self.why, self.value = field, why, value
        shown = "" if value is NO_VALUE else f" = {value!r}"
        super().__init__(f"{field}{shown}: {why}" if field else why)

    def prefixed(self, prefix: str) -> ConfigError:
        field = f"{prefix}.{self.field}" if self.field else prefix
        return ConfigError(field, self.why, self.value)


# ---------------------------------------------------------------------------------------------
# Small validation helpers used by the dataclasses' __post_init__.


def bad(obj: Any, name: str, why: str) -> ConfigError:
    return ConfigError(name, why, getattr(obj, name))


def positive(obj: Any, *names: str) -> None:
    for n in names:
        if not getattr(obj, n) > 0:
            raise bad(obj, n, "must be > 0")


def non_negative(obj: Any, *names: str) -> None:
    for n in names:
        if getattr(obj, n) < 0:
            raise bad(obj, n, "must be >= 0")


def in_range(obj: Any, name: str, lo: float, hi: float, *, hi_open: bool = False) -> None:
    v = getattr(obj, name)
    if not (lo <= v < hi if hi_open else lo <= v <= hi):
        raise bad(obj, name, f"must be in [{lo}, {hi}{')' if hi_open else ']'}")


def check_address(obj: Any, name: str, auth_token_file: str, tls_cert_file: str) -> None:
    """A service binds to loopback unless credentials are configured (no open doors)."""
    addr = getattr(obj, name)
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise bad(obj, name, "must be 'host:port' (port 0 picks a free port)")
    if int(port) > 65535:
        raise bad(obj, name, "port must be <= 65535")
    # TLS alone (server certificate) does not authenticate clients, so it is not enough.
    del tls_cert_file
    if not is_loopback(host) and not auth_token_file:
        raise bad(
            obj,
            name,
            "a non-loopback address needs credentials: set auth_token_file "
            "(TLS alone does not authenticate clients)",
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def detect_accelerator() -> Literal["tpu", "gpu", "cpu"]:
    """The accelerator this host has, from device nodes (cheap: does not start JAX)."""
    if glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"):
        return "tpu"
    if glob.glob("/dev/nvidia[0-9]*"):
        return "gpu"
    return "cpu"


frozen = dataclasses.dataclass(frozen=True, kw_only=True)
