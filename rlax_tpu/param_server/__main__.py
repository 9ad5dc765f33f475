"""Parameter server: TensorStore-backed, versioned weights served over gRPC.

Serves publish, pull, list_versions, report_progress/lease and health on param_server.address,
persisting every param_server.persist_every-th version.
"""

from __future__ import annotations

from rlax_tpu import cli
from rlax_tpu.config import RunConfig


def run(config: RunConfig, args: list[str]) -> int:
    # Not built yet: say so instead of pretending (#5 [param-server]).
    return cli.not_built("param_server", "#5 [param-server]", config)


if __name__ == "__main__":
    cli.main("param_server", run)
