"""Subprocess for test_engine_mesh: one of two jax.distributed processes (4 CPU devices each,
gloo collectives) running one engine whose mesh (data 2 x tensor 4) spans both: every process
builds the same engine and submits the same requests, as the processes of a multi-host worker do.

    python tests/inference/distributed_engine.py COORDINATOR PROCESS_ID OUT_JSON
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.child_env import xla_flags  # noqa: E402

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = xla_flags(4)

import dataclasses  # noqa: E402

import jax  # noqa: E402

from rlax_tpu import models  # noqa: E402
from rlax_tpu.config import MeshConfig  # noqa: E402
from rlax_tpu.inference.engine import Engine  # noqa: E402
from tests.inference.conftest import SMALL, run_with_an_overlapped_reload  # noqa: E402

MESH = MeshConfig(data=2, fsdp=1, tensor=4)


def main() -> None:
    coordinator, pid, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=2, process_id=pid)
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    engine = Engine(
        models.init_model(models.preset("tiny")),
        dataclasses.replace(SMALL, mesh=MESH, overlap_reload=True),
    )
    assert {d.process_index for d in engine.mesh.devices.flat} == {0, 1}
    done = {
        r.prompt_id: {"tokens": r.tokens.tolist(), "logprobs": r.logprobs.tolist()}
        for r in run_with_an_overlapped_reload(engine)
    }
    if pid == 0:
        out.write_text(json.dumps(done))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
