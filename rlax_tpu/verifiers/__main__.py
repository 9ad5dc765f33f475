"""Verifier service: sandboxed (bubblewrap) code execution, Codeforces-style checkers, math answers.

Serves batched verify requests over gRPC on verifiers.address, prints the bound address, and stops
cleanly on SIGTERM or SIGINT.
"""

from __future__ import annotations

import sys

from rlax_tpu import cli
from rlax_tpu.config import RunConfig
from rlax_tpu.verifiers.sandbox import SandboxUnavailable
from rlax_tpu.verifiers.server import serve
from rlax_tpu.verifiers.service import VerifierService


def run(config: RunConfig, args: list[str]) -> int:
    cfg = config.verifiers
    try:
        service = VerifierService(cfg)
    except SandboxUnavailable as e:
        print(f"rlax_tpu.verifiers: error: {e}", file=sys.stderr)
        return 1
    stop = cli.stop_event()
    try:
        server, port = serve(cfg, service)
        host = cfg.address.rsplit(":", 1)[0]
        print(f"verifiers serving on {host}:{port} ({service.health()})", flush=True)
        cli.wait_for(stop)
        server.stop(grace=5).wait()
    finally:
        service.close()
    print("verifiers stopped", flush=True)
    return cli.EXIT_STOPPED


if __name__ == "__main__":
    cli.main("verifiers", run)
