"""Subprocess for test_sharded_gcs_load: one of two jax.distributed processes (gloo over
127.0.0.1, 4 CPU devices each) loading the safetensors checkpoint at WEIGHTS (gs://, the test's
emulator) over a (1, 4, 2) mesh whose fsdp axis spans both processes. The test names each
process's GCS requests by FSSPEC_GS (an X-Rlax-Reader header) to count on the server what each
read. Process 0 writes every parameter, gathered, to OUT_DIR/params.npz.

    python tests/models/sharded_load_worker.py COORDINATOR PROCESS_ID WEIGHTS OUT_DIR
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.child_env import xla_flags  # noqa: E402

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = xla_flags(4)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from rlax_tpu.config import MeshConfig  # noqa: E402
from rlax_tpu.models.loader import load_model  # noqa: E402
from rlax_tpu.models.sharding import make_mesh  # noqa: E402
from tests.models.test_sharded_gcs_load import model_config  # noqa: E402


def main() -> None:
    coordinator, pid, weights, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=2, process_id=pid)
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    # fsdp index 0-1 on process 0's devices, 2-3 on process 1's.
    assert [sorted({d.process_index for d in row}) for row in mesh.devices[0, :, 0]] == [
        [0]
    ] * 2 + [[1]] * 2
    model = load_model(model_config(weights), mesh=mesh)
    leaves = jax.tree.leaves(nnx.state(model))
    gathered = multihost_utils.process_allgather(leaves, tiled=True)
    if pid == 0:
        np.savez(out / "params.npz", *[np.asarray(x) for x in gathered])
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
