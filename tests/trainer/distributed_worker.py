"""Subprocess for test_distributed: one of two jax.distributed processes (4 CPU devices each,
gloo collectives) running one train step on a (1, 8, 1) mesh over all 8 devices (parameters split
8 ways over fsdp: each process holds half), publishing version 1 to the parameter server at
PS_ENDPOINT in parts (each process its own slices).

    python tests/trainer/distributed_worker.py COORDINATOR PROCESS_ID OUT_DIR PS_ENDPOINT
"""

import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from rlax_tpu.param_server.client import ParamServerClient  # noqa: E402
from rlax_tpu.trainer import Trainer  # noqa: E402
from tests.trainer.helpers import random_batch, run_config  # noqa: E402

MESH = (1, 8, 1)


def main() -> None:
    coordinator, pid, out, endpoint = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=2, process_id=pid)
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    sink = ParamServerClient(endpoint)
    trainer = Trainer(run_config(MESH, adam_eps=1e-5), checkpoint_dir=out / "ckpt", sink=sink)
    metrics = trainer.train_step(random_batch(0))  # publishes version 1
    (out / f"pushed-{pid}").write_text(str(sink.bytes_pushed))
    trainer.wait_for_checkpoints()
    params = multihost_utils.process_allgather(trainer.params(), tiled=True)
    if pid == 0:
        leaves = {str(i): np.asarray(x) for i, x in enumerate(jax.tree.leaves(params))}
        np.savez(out / "params.npz", loss=metrics["loss"], grad_norm=metrics["grad_norm"], **leaves)
    trainer.close()
    sink.close()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
