"""Subprocess for test_worker's multi-host test: one of two jax.distributed processes (4 CPU
devices each, gloo) of one inference worker on a data 2 x tensor 4 mesh. Process 0 is the
worker callers talk to; process 1 follows (``run_follower``). Process 0 generates, reloads
version 1 from the weight source (both processes pull it), generates again, shuts down.

    python tests/inference/distributed_worker.py COORDINATOR PROCESS_ID OUT_JSON
"""

import json
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import dataclasses  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from rlax_tpu import models  # noqa: E402
from rlax_tpu.config import MeshConfig  # noqa: E402
from rlax_tpu.inference.worker import DictWeightSource, InferenceWorker, run_follower  # noqa: E402
from tests.inference.conftest import SMALL, random_requests  # noqa: E402

CFG = dataclasses.replace(SMALL, mesh=MeshConfig(data=2, fsdp=1, tensor=4))


def source() -> DictWeightSource:
    """Version 1: another seed's weights (each process makes the same)."""
    return DictWeightSource({1: nnx.state(models.init_model(models.preset("tiny"), seed=1))})


def main() -> None:
    coordinator, pid, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=2, process_id=pid)
    model = models.init_model(models.preset("tiny"))
    if pid != 0:
        run_follower(model, CFG, weight_source=source())
    else:
        worker = InferenceWorker(model, CFG, weight_source=source())
        first = list(worker.generate(random_requests(6, seed=5, temperature=0.0)))
        worker.load_weights(1)
        second = list(worker.generate(random_requests(6, seed=6, temperature=0.0)))
        worker.shutdown()
        out.write_text(json.dumps({
            f"{i}:{r.prompt_id}": r.tokens.tolist() for i, batch in enumerate((first, second))
            for r in batch
        }))  # fmt: skip
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
