"""The planner's costs from program rooflines, against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

from rlax_tpu.controller.staleness import StalenessPolicy
from rlax_tpu.plan.costs import (
    Efficiency,
    Network,
    Roofline,
    Workload,
    plan_costs,
    share_time,
    version_bytes,
    with_eval,
    worker_slots,
)
from rlax_tpu.plan.lengths import GroupLengths
from rlax_tpu.plan.predict import predict
from rlax_tpu.plan.throughput import ThroughputCosts, simulate_throughput
from tests.config.test_validation import build

# The local preset: 8 prompts x 8 samples, micro-batches of 16 rows x 304 columns, a float32
# model of 853,120 parameters (4 layers, 2 KV heads of 32, padded to 128 in TPU pages: 131,072
# bytes a page of 16 tokens), 64 decode rows, prefill calls of 4 x 16 tokens.
ROOFLINE = Roofline(
    {
        "trainer.prepare": 0.1,
        "trainer.accumulate": 1.0,
        "trainer.prefill_old": 0.5,
        "trainer.apply": 0.2,
        "trainer.publish": 0.05,
        "inference.decode": 0.01,
        "inference.prefill": 0.04,
        "inference.copy_pages": 9.0,  # not a cost of the schedule
    }
)
WORKLOAD = Workload(prompt=100, completion=40)


def _costs(config, workers: int = 3):  # noqa: ANN001, ANN202
    return plan_costs(
        config,
        ROOFLINE,
        workload=WORKLOAD,
        efficiency=Efficiency(train=0.5, decode=0.25, prefill=0.8),
        network=Network(pull_bytes_per_s=2e6, server_bytes_per_s=1e6),
        workers=workers,
        compiled_rows=16,
        compiled_columns=304,
        check_s=0.5,
    )


def test_costs_of_the_local_preset_by_hand():
    config = build({})
    c = _costs(config)
    # 64 rollouts in 4 micro-batches of 16, each (100 + 40) / 304 full:
    # (0.1 + 4 * 140/304 * (1.0 + 0.5) + 0.2 + 0.05) / 0.5 = 6.2263157...
    assert c.detail["update_s"] == pytest.approx(6.226315789473684, rel=1e-12)
    # 853,120 float32 parameters = 3,412,480 bytes, received by the one replica at 1 MB/s.
    assert c.version_bytes == 3_412_480
    assert c.train_s == pytest.approx(6.226315789473684 + 3.41248, rel=1e-12)
    # 100 prompt tokens in calls of 64: 1.5625 * 0.04 / 0.8 = 0.078125 a prefill, 8 of them
    # while a group runs (its own and those of the 7 others that start meanwhile); 40 decode
    # steps of 0.01 / 0.25.
    assert c.group_s == pytest.approx(8 * 0.078125 + 1.6, rel=1e-12)
    # Three workers loading at once share the replica's 1 MB/s: 3 * 3.41248 s.
    assert c.reload_s == pytest.approx(10.23744, rel=1e-12)
    # One worker alone: the slower of its own 2 MB/s and the replica's 1 MB/s.
    assert _costs(config, workers=1).reload_s == pytest.approx(3.41248, rel=1e-12)
    # A relay chain (param_server.fanout "relay"): the replica sends the version once, at 0.97
    # of the slower link; each of the 2 workers after the first is one 4 MiB bucket behind (the
    # version is smaller than a bucket: the whole version).
    relayed = build({"param_server.fanout": "relay"})
    assert _costs(relayed).reload_s == pytest.approx(3 * 3.41248 / 0.97, rel=1e-12)
    assert _costs(relayed, workers=1).reload_s == pytest.approx(3.41248 / 0.97, rel=1e-12)
    # A push in flight (trainer.publish_in_flight) in throughput mode: beside the next update,
    # which is longer here. In deterministic mode the next generation waits for it: as before.
    pushing = {"trainer.publish_in_flight": 1}
    overlapped = _costs(build(pushing | {"controller.mode": "throughput"}))
    assert overlapped.train_s == pytest.approx(6.226315789473684, rel=1e-12)
    assert overlapped.reload_s == c.reload_s
    assert _costs(build(pushing)).train_s == c.train_s
    # 256 pages of 32 MiB hold 8 groups of 7 prompt + 8 * 3 completion pages; 64 rows hold 8.
    assert c.slots == 8
    # The local preset's verifier: 2 sandboxes (verifiers.workers) in 1 replica.
    assert (c.check_s, c.verifier_slots) == (0.5, 2)


def test_a_held_out_evaluation_is_its_samples_in_waves_then_verified():
    config = build({})  # 48 problems x 8 samples every 10 updates, groups of 8, 2 sandboxes
    c = _costs(config, workers=3)
    # 48 groups over 3 workers x 8 slots: 2 waves of a group's time; 384 samples on 2
    # sandboxes at 0.5 s: 96 s.
    three = with_eval(config, c, 3)
    assert (three.eval_s, three.eval_verify_s) == pytest.approx((2 * c.group_s, 96), rel=1e-12)
    assert with_eval(config, c, 1).eval_s == pytest.approx(6 * c.group_s, rel=1e-12)
    assert with_eval(build({"data.eval_every": 0}), c, 3).eval_s == 0


def test_kv_pages_bind_the_slots_before_the_decode_rows():
    # 8 MiB: 64 pages, 31 a group -> 2 groups, though 64 rows would hold 8.
    assert worker_slots(build({"inference.kv_cache_bytes": 2**23}), WORKLOAD) == 2
    # Room for less than one group still runs one (the engine preempts and recomputes).
    assert worker_slots(build({"inference.kv_cache_bytes": 2**20}), WORKLOAD) == 1


def test_a_lora_version_is_its_float32_adapters_and_bf16_publishing_halves_a_full_one():
    lora = build({"model.lora_rank": 4})
    assert version_bytes(lora) == 4 * lora.model.adapter_count()
    # rank 4 over 7 projections of a 128-wide model (k, v: 64 wide; MLP 384), 4 layers.
    assert lora.model.adapter_count() == 4 * 4 * (256 + 192 + 192 + 256 + 512 + 512 + 512)
    assert version_bytes(build({"trainer.publish_dtype": "bfloat16"})) == 2 * 853_120


def test_a_program_the_reports_lack_is_named():
    partial = Roofline({k: v for k, v in ROOFLINE.seconds.items() if k != "inference.decode"})
    with pytest.raises(KeyError, match="no program 'inference.decode'"):
        plan_costs(
            build({}),
            partial,
            workload=WORKLOAD,
            efficiency=Efficiency(),
            network=Network(),
            workers=1,
            compiled_rows=16,
            compiled_columns=304,
            check_s=0,
        )


def test_throughput_predictions_are_the_simulators_schedule_of_those_costs():
    """The wiring: policy, batch, slots, the freshest-first order and the queue cap of
    unbounded staleness go to the simulator as the controller would use them."""
    config = build(
        {
            "controller.mode": "throughput",
            "controller.acceptance_staleness": -1,
            "controller.pipeline_depth": 0,
            "controller.consume_order": "freshest_first",
            "verifiers.workers": 16,
            "data.eval_every": 0,
        }
    )
    c = _costs(config, workers=2)
    got = predict(config, c, WORKLOAD, workers=2, steps=40)
    want = simulate_throughput(
        40,
        ThroughputCosts(
            group_s=c.group_s, check_s=0.5, train_s=c.train_s, reload_s=c.reload_s, samples=8
        ),
        StalenessPolicy(reload_staleness=1, acceptance_staleness=math.inf),
        batch=8,
        slots=8,
        workers=2,
        queue_cap=2 * 8 + 8,  # every worker's slots plus one batch
        freshest_first=True,
        verifier_slots=16,
    )
    assert got.seconds_per_update == want.seconds_per_update(4)
    assert got.staleness == want.staleness_counts(4)
    assert got.tokens_per_s == pytest.approx(64 * 40 / got.seconds_per_update)
    # The trainer (9.6 s) is slower than two workers' 16 slots making 8 groups of 1.7 s, and
    # than 16 sandboxes checking 64 samples of 0.5 s (2 s).
    assert got.bottleneck == "trainer" and got.trainer_busy > 0.9
    assert got.verifier_busy == pytest.approx(2 / got.seconds_per_update)


def test_a_verifier_of_few_sandboxes_is_the_bottleneck():
    """The local preset's 2 sandboxes: 64 samples of 0.5 s are 16 s of verification an update,
    longer than the update (9.6 s) or the generation: with staleness enough to keep it fed
    (η_a = 4), one update every 16 s."""
    config = build(
        {
            "controller.mode": "throughput",
            "controller.pipeline_depth": 0,
            "controller.acceptance_staleness": 4,
        }
    )
    got = predict(config, _costs(config, workers=2), WORKLOAD, workers=2, steps=40)
    assert got.seconds_per_update == pytest.approx(16, rel=0.02)
    assert got.bottleneck == "verification" and got.verifier_busy > 0.98


def test_evaluations_are_modelled_and_named_where_they_bind():
    """An evaluation every update: 48 problems x 8 samples, 48 groups of 8 on 3 workers' 24
    slots (2 waves of a group's time) and 384 samples on 2 sandboxes. Without it generation is
    8 groups an update; with it the workers spend most of their time evaluating, and the label
    says so."""
    plain = build({"controller.mode": "throughput", "data.eval_every": 0})
    every = build({"controller.mode": "throughput", "data.eval_every": 1})
    base = predict(plain, with_eval(plain, _costs(plain), 3), WORKLOAD, workers=3, steps=40)
    c = with_eval(every, _costs(every), 3)
    assert (c.eval_s, c.eval_verify_s) == pytest.approx((2 * c.group_s, 96))
    # Spread lengths: of the 2 waves of 8 groups, the last ends with its slowest. Every group
    # here is a sample of 1 token and one of 3 (mean 2): done at 1.5 mean samples' time.
    spread = with_eval(every, _costs(every), 3, GroupLengths(((1.0, 3.0),), "one group"))
    assert spread.eval_s == pytest.approx((1 + 1.5) * c.group_s)
    got = predict(every, c, WORKLOAD, workers=3, steps=40)
    # The controller waits for each: its generation, then its verdicts. The 2 sandboxes bind:
    # 16 s of the update's samples and 96 s of the evaluation's an update.
    assert got.seconds_per_update > base.seconds_per_update + 0.9 * (c.eval_s + 96)
    assert got.bottleneck == "verification (86% of it evaluations')"


def test_a_share_is_its_waves_the_last_ending_with_its_slowest_group():
    """share_time in mean groups' times, on 8 slots: fixed-shape steps cost a whole wave for
    fewer groups; with spread lengths (every group a sample of 1 token and one of 3: done at 1.5
    mean samples' time) only the last wave waits for its slowest."""
    one = GroupLengths(((1.0, 3.0),), "one group")
    assert [share_time(k, 8) for k in (0, 1, 8, 9, 16, 17)] == [0, 1, 1, 2, 2, 3]
    assert [share_time(k, 8, one) for k in (1, 8, 12, 17)] == pytest.approx([1.5, 1.5, 2.5, 3.5])


def test_a_relay_chain_reloads_in_about_one_transfer_whatever_the_workers():
    """The v5p preset's 32B bf16 version at the default links (a worker 100 Gbit/s, a replica
    32): 64 workers pulling from 4 replicas share their egress; a chain sends it once."""
    net = Network()
    size = 65_527_000_000
    replicas = build({"param_server.replicas": 4})
    relay = build({"param_server.replicas": 4, "param_server.fanout": "relay"})
    assert net.reload_s(replicas, size, 64) == pytest.approx(size * 64 / (4 * 4e9), rel=1e-12)
    one = net.reload_s(relay, size, 1)
    assert one == pytest.approx(size / (4e9 * 0.97), rel=1e-12)
    # 63 more workers: 63 buckets of 4 MiB more, 1.6% here.
    assert net.reload_s(relay, size, 64) == pytest.approx(one + 63 * 2**22 / (4e9 * 0.97))
    with pytest.raises(ValueError, match="relay_efficiency"):
        Network(relay_efficiency=0.0)


def test_a_chain_beside_the_push_reloads_in_what_is_left_of_it_after_the_push():
    """The same version and links, the workers staging it as its push starts (relay over gRPC,
    pushes in flight: service.CutThrough). Push 16.4 s at 32 Gbit/s, the chain 16.9 s: after
    the push, 0.5 s (publish to serve 16.9 s, not 33.3). With 100 Gbit/s replicas the push
    (5.2 s) and the chain (5.4 s at 0.97 of 100) nearly match; with a slower chain the whole
    difference. A push slower than the chain leaves the last bucket's hops."""
    size = 65_527_000_000
    base = {"param_server.replicas": 4, "param_server.fanout": "relay"}
    grpc = {
        "controller.transport": "distributed",
        "controller.verifier_endpoint": "127.0.0.1:1",
        "controller.trainer_endpoint": "127.0.0.1:2",
        "controller.param_server_endpoints": tuple(f"127.0.0.1:{10 + r}" for r in range(4)),
        "controller.inference_endpoints": ("127.0.0.1:3",),
        "controller.warmup_steps": 0,
        "trainer.publish_in_flight": 1,
    }
    beside = build(base | grpc)
    assert beside.relays_while_pushed
    for gbps in (32, 100):
        net = Network(server_bytes_per_s=gbps * 1e9 / 8)
        chain = net.reload_s(build(base), size, 64)
        push = size / (gbps * 1e9 / 8)
        assert net.reload_s(beside, size, 64) == pytest.approx(chain - push, rel=1e-12)
        assert push + net.reload_s(beside, size, 64) < 0.52 * (push + chain)
    slow_push = Network(server_bytes_per_s=4e9, pull_bytes_per_s=8e9, relay_efficiency=1.0)
    # the chain at min(8, 4) = 4 GB/s, the push at 4: 64 buckets of 4 MiB after it
    assert slow_push.reload_s(beside, size, 64) == pytest.approx(64 * 2**22 / 4e9, rel=1e-12)
    # Not beside the push: pushes not in flight (the controller learns of a version once it
    # is published), or components in one process (no relay).
    for off in ({"trainer.publish_in_flight": 0}, {"controller.transport": "local"}):
        config = build(base | grpc | off)
        assert not config.relays_while_pushed


def test_environment_waits_by_schedule_by_hand():
    """Replies of 2 s, 3 turns, 10 calls at once. Lock-step: every turn waits for all of the
    job's replies: 24 episodes are 3 rounds a turn, 3 x 3 x 2 = 18 s. One by one: the last
    turns' replies only, 3 rounds, 6 s; a single group's episodes have nothing to overlap
    their replies with: its whole chain, 3 x 1 x 2 = 6 s for 8 episodes (one round)."""
    from rlax_tpu.plan.costs import env_wait_s

    base = {"environment.name": "code_repair", "environment.max_turns": 3}
    base |= {"environment.concurrency": 10, "data.prompt_style": "chat"}
    lock = build(base | {"environment.schedule": "lockstep"})
    each = build(base | {"environment.schedule": "episode"})
    group = each.algorithm.group_size
    assert env_wait_s(lock, 2.0, 24) == 18.0
    assert env_wait_s(each, 2.0, 24) == 6.0
    assert env_wait_s(each, 2.0, group) == 3 * math.ceil(group / 10) * 2.0
    assert env_wait_s(build({}), 2.0, 24) == 0.0  # no environment
    assert env_wait_s(lock, 0.0, 24) == 0.0


@pytest.mark.parametrize("mode", ["deterministic", "throughput"])
def test_a_slow_environment_costs_lock_step_more_than_one_by_one(mode):
    """Two-turn episodes with 5 s replies on the local preset (8 prompts x 8 samples, 64
    calls at once). Deterministic, d = 0 (the replies on each step's critical path): lock-step
    waits for 2 rounds of replies a job, one by one for 1. Throughput: a group's latency grows by
    2 rounds either way (lock-step: its launch's 32 episodes fit one round a turn; one by one:
    its own chain of 2 replies)."""
    import dataclasses

    def period(schedule: str, reply_s: float) -> float:
        config = build(
            {
                "controller.mode": mode,
                "controller.pipeline_depth": 0,
                "environment.name": "code_repair",
                "environment.max_turns": 2,
                "environment.schedule": schedule,
                "data.prompt_style": "chat",
            }
        )
        costs = dataclasses.replace(_costs(config), env_reply_s=reply_s)
        return predict(config, costs, WORKLOAD, workers=3, steps=40).seconds_per_update

    none = period("lockstep", 0.0)
    assert period("episode", 0.0) == pytest.approx(none)
    lock, each = period("lockstep", 5.0), period("episode", 5.0)
    if mode == "deterministic":
        assert (lock, each) == pytest.approx((none + 10.0, none + 5.0))
    else:
        assert lock == pytest.approx(each) and lock > none


def test_relay_deltas_reload_the_delta_after_its_encoding_and_every_nth_whole_by_hand():
    """relay_deltas 8 at delta_ratio 0.36 (a base 16 versions old, RESULTS (c)): 7 reloads in 8
    move 0.36 of the version after the root encodes it (8 GiB/s), the 8th the whole version."""
    net = Network(delta_ratio=0.36)
    size = 65_527_000_000
    rate = 4e9 * 0.97
    relay = {"param_server.replicas": 4, "param_server.fanout": "relay"}
    whole = (size + 63 * 2**22) / rate
    delta = size / 2**33 + (0.36 * size + 63 * 2**22) / rate
    deltas = build(relay | {"param_server.relay_deltas": 8})
    assert net.reload_s(deltas, size, 64) == pytest.approx((7 * delta + whole) / 8, rel=1e-12)
    # Off (0, or 1: every reload whole), or no measured saving: the whole version each time.
    assert net.reload_s(build(relay), size, 64) == pytest.approx(whole, rel=1e-12)
    assert net.reload_s(build(relay | {"param_server.relay_deltas": 1}), size, 64) == (
        pytest.approx(whole, rel=1e-12)
    )
    for bad in ({"delta_ratio": 0.0}, {"delta_ratio": 1.5}, {"delta_encode_bytes_per_s": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Network(**bad)
