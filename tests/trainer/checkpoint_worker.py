"""Subprocess for test_checkpoint: trains on a mesh, saving every step, until it is killed.

    python tests/trainer/checkpoint_worker.py CKPT_DIR DATA FSDP TENSOR

Prints "SAVED <step>" once checkpoint <step> is complete (steps 1 and 2), then keeps training and
saving (steps 3, 4, ...) so that the kill lands mid-run, usually mid-save.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Keep the parent's other XLA flags (e.g. --xla_cpu_max_isa): the bits compared are the parent's.
_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
os.environ["XLA_FLAGS"] = " ".join([*_flags, "--xla_force_host_platform_device_count=8"])
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rlax_tpu.trainer import Trainer  # noqa: E402
from tests.trainer.helpers import random_batch, run_config  # noqa: E402


def main() -> None:
    directory, mesh = sys.argv[1], tuple(int(x) for x in sys.argv[2:5])
    trainer = Trainer(run_config(mesh, keep_checkpoints=100), checkpoint_dir=directory)
    step = 0
    while True:
        trainer.train_step(random_batch(step))
        step += 1
        if step <= 2:
            trainer.wait_for_checkpoints()
            print(f"SAVED {step}", flush=True)


if __name__ == "__main__":
    main()
