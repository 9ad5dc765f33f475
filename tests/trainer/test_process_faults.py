"""The failure rule for a trainer over two processes (``python -m rlax_tpu.trainer`` twice, one
CPU device each): killing one process ends the other, non-zero, naming the dead one."""

from __future__ import annotations

import pytest

from tests.multihost_job import kill_and_wait, serving_endpoint, start, stop_all


@pytest.mark.slow
def test_killing_the_follower_ends_the_lead_naming_it(tmp_path):
    """The follower is SIGKILLed while the lead serves: the coordination service misses its
    heartbeats and ends the lead (within the bound kill_and_wait asserts), non-zero, saying
    which process stopped sending them. No process is left to serve half a trainer."""
    procs = start(
        "trainer",
        ["--config.model.num_layers=1", f"--config.controller.run_dir={tmp_path}"],
        [["--config.trainer.address=127.0.0.1:0"], []],
    )
    try:
        serving_endpoint(procs[0])
        errs, took = kill_and_wait(procs, victim=1)
    finally:
        stop_all(procs)
    assert procs[0].returncode not in (0, None), errs[0][-3000:]
    assert "stopped sending heartbeats):\n1\n" in errs[0], errs[0][-3000:]
    print(f"the lead ended {took:.1f} s after its follower was killed")
