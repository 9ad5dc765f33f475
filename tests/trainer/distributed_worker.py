"""Subprocess for test_distributed: one of the jax.distributed processes (gloo collectives)
running one train step on a mesh over all 8 devices, publishing version 1 to the parameter
server at PS_ENDPOINT in parts (each process its own slices). By default two processes of 4 CPU
devices on a (1, 8, 1) mesh (parameters split 8 ways over fsdp: each process holds half); with
PROCESSES and MESH ("data,fsdp,tensor,slices"), e.g. 4 processes of 2 devices as 2 slices.
With FAIL_PUSH_ON=<pid> in the environment that process's pushes fail; each process then
writes what its step raised to OUT_DIR/failed-<pid>.

    python tests/trainer/distributed_worker.py COORDINATOR PROCESS_ID OUT_DIR PS_ENDPOINT \
        [PROCESSES MESH]
"""

import os
import sys
from pathlib import Path

PROCESSES = int(sys.argv[5]) if len(sys.argv) > 5 else 2
MESH = tuple(int(x) for x in sys.argv[6].split(",")) if len(sys.argv) > 6 else (1, 8, 1, 1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.child_env import xla_flags  # noqa: E402

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = xla_flags(8 // PROCESSES)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from rlax_tpu.param_server.client import ParamServerClient  # noqa: E402
from rlax_tpu.trainer import Trainer  # noqa: E402
from tests.trainer.helpers import random_batch, run_config  # noqa: E402


def _unreachable(*_: object, **__: object) -> None:
    raise ConnectionError("no route to the parameter server")


def main() -> None:
    coordinator, pid, out, endpoint = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=PROCESSES, process_id=pid)
    assert jax.device_count() == 8 and jax.local_device_count() == 8 // PROCESSES
    sink = ParamServerClient(endpoint)
    if os.environ.get("FAIL_PUSH_ON") == str(pid):
        sink.push = _unreachable  # this process cannot reach the parameter server
    config = run_config(MESH[:3], adam_eps=1e-5, slices=MESH[3])
    trainer = Trainer(config, checkpoint_dir=out / "ckpt", sink=sink)
    # Which processes' devices each data row (slice) holds, for the test to check.
    rows = [sorted({d.process_index for d in row.flat}) for row in trainer.mesh.devices]
    (out / f"mesh-{pid}").write_text(f"{dict(trainer.mesh.shape)} {rows}")
    try:
        metrics = trainer.train_step(random_batch(0))  # publishes version 1
    except Exception as e:  # noqa: BLE001 - every process says what its step raised
        (out / f"failed-{pid}").write_text(f"{type(e).__name__}: {e}")
        trainer.close()
        jax.distributed.shutdown()
        return
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
