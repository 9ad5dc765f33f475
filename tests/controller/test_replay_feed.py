"""TBA replay (data.replay) through the controller, with the real local components: each update
trains on groups drawn from the buffer, within η_a, and a resumed run draws the same batches."""

from __future__ import annotations

import json

import numpy as np

from rlax_tpu.config import RunConfig, from_dict, to_dict
from rlax_tpu.controller.ledger import GroupState
from rlax_tpu.controller.replay import REPLAY_DIR
from rlax_tpu.controller.snapshots import SnapshotStore
from tests.controller.test_dynamic_sampling import Batches
from tests.controller.test_scheduling import make_config, run_controller


def replay_config(run_dir, num_steps: int) -> RunConfig:
    d = to_dict(
        make_config(
            run_dir,
            num_steps=num_steps,
            prompts_per_step=2,
            acceptance_staleness=2,
            snapshot_keep=2,
        )
    )
    d["trainer"] |= dict(keep_checkpoints=4)
    d["data"] |= dict(
        replay=True, replay_recency_prob=0.5, replay_recent_versions=1, replay_priority="uniform"
    )
    return from_dict(RunConfig, d)


def run(cfg):
    held = {}

    def wrap(comps):
        held["trainer"] = comps.trainer = Batches(comps.trainer)

    return run_controller(cfg, wrap), held["trainer"].batches


def test_updates_draw_from_the_replay_buffer_and_a_resumed_run_draws_the_same(tmp_path):
    cfg = replay_config(tmp_path / "a", num_steps=4)
    ctl, whole = run(cfg)
    assert ctl.version == 4 and len(whole) == 4
    # Every step's groups entered the buffer once; every update drew a full batch from it.
    assert ctl.counters.groups_trained == 8 == len(ctl.ledger.keys(GroupState.TRAINED))
    assert ctl.counters.groups_replayed == 8 and len(ctl.replay.buffer) > 0
    older = 0
    for v, batch in enumerate(whole):
        assert batch.tokens.shape[0] == 2 * cfg.algorithm.group_size
        assert ((v - batch.versions) <= 2).all() and (batch.versions <= v).all()  # η_a = 2
        older += int((batch.versions < max(0, v - 1)).any())  # older than the step's own (d = 1)
    assert older > 0  # the buffer served rollouts of earlier steps, not only the newest
    # Stopped at step 2 and resumed: the restored buffer (and its RNG) draws the same batches.
    _, first = run(replay_config(tmp_path / "b", num_steps=2))
    _, rest = run(replay_config(tmp_path / "b", num_steps=4))  # resumes at step 2
    assert len(first) == 2 and len(rest) == 2
    for a, b in zip(whole, first + rest, strict=True):
        for field in ("tokens", "behaviour_logprobs", "rewards", "versions"):
            assert np.array_equal(getattr(a, field), getattr(b, field)), field
    # Segments: every one a kept snapshot names is there, no others beyond the count.
    store = SnapshotStore(tmp_path / "b" / "snapshots", keep=2)
    named = set()
    for step in store.steps():
        state = json.loads(store.load(step)["json"])["replay"]
        named |= {f["payload"][0] for _, f in state["items"]}
    files = {int(p.stem.split("_")[1]) for p in (tmp_path / "b" / REPLAY_DIR).iterdir()}
    assert named <= files
