"""Inference worker service: paged-attention engine with continuous batching, served over gRPC.

Serves generate (streaming), load_weights(version), status and shutdown. It listens on
inference.address (127.0.0.1 unless credentials are configured).
"""

from __future__ import annotations

from rlax_tpu import cli
from rlax_tpu.config import RunConfig


def run(config: RunConfig, args: list[str]) -> int:
    # Not built yet: say so instead of pretending (#4 [inference]).
    return cli.not_built("inference", "#4 [inference]", config)


if __name__ == "__main__":
    cli.main("inference", run)
