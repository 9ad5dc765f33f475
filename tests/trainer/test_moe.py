"""A mixture-of-experts model in the trainer: it trains, and the load-balancing term is in the
loss and its metric."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tpu import models
from rlax_tpu.config import ConfigError, MeshConfig
from rlax_tpu.trainer import Trainer
from rlax_tpu.trainer.batching import MicroBatch, micro_arrays
from rlax_tpu.trainer.logprobs import completion_logprobs

from .helpers import WIDTH, host, random_batch, run_config


def test_a_moe_model_trains_with_the_load_balancing_term(tmp_path):
    model = models.preset(
        "tiny", arch="qwen3_moe", qk_norm=True, num_layers=2, num_experts=4, experts_per_token=2
    )
    cfg = run_config(model=model)
    cfg = dataclasses.replace(
        cfg, algorithm=dataclasses.replace(cfg.algorithm, router_aux_loss_coef=0.01)
    )
    trainer = Trainer(cfg, devices=jax.devices()[:1], checkpoint_dir=tmp_path)
    before = host(trainer.params())
    metrics = trainer.train_step(random_batch(1))
    after = host(trainer.params())
    trainer.close()
    # At init the router's softmax is near uniform (weights ~ N(0, 0.02²)): X·Σ f·P ≈ X·k·(1/X)
    # = k, the term's value for perfectly balanced routing.
    assert abs(metrics["router_aux_loss"] - 2.0) < 0.1
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), after, before)
    assert all(jax.tree.leaves(moved["layers"][0]["mlp"]))  # router and every expert weight


def test_the_term_needs_experts():
    cfg = run_config()
    with pytest.raises(ConfigError, match="router_aux_loss_coef.*has no experts"):
        dataclasses.replace(
            cfg, algorithm=dataclasses.replace(cfg.algorithm, router_aux_loss_coef=0.01)
        )


def _replay_case(tmp_path, replay: str) -> tuple[dict[str, float], np.ndarray]:
    """One update on a batch whose behaviour log-probs come from the model forced to routes
    its own router would not choose (each token's top k shifted by one expert), as a worker's
    would after its router rounded differently; returns the metrics and the batch's routes."""
    cfg = models.preset(
        "tiny", arch="qwen3_moe", qk_norm=True, num_layers=1, num_experts=4, experts_per_token=2
    )
    model = models.init_model(cfg)
    batch = random_batch(3)
    arrays = micro_arrays(batch, MicroBatch(np.arange(batch.num_rows), 64, WIDTH))
    tokens, positions = jnp.asarray(arrays["tokens"]), jnp.asarray(arrays["positions"])
    _, _, own = model.run(tokens, positions, models.NoCache())
    routes = np.asarray((own.experts + 1) % 4).transpose(1, 2, 0, 3).astype(np.int16)
    routes[np.asarray(arrays["positions"]) < 0] = -1
    length = batch.tokens.shape[1]
    logp, _, _ = completion_logprobs(
        model,
        tokens,
        positions,
        jnp.asarray(arrays["prompt_lengths"]),
        jnp.asarray(arrays["targets"]),
        jnp.float32(1.0),
        loop=models.UNROLLED,
        mesh=None,
        routes=jnp.asarray(routes),
    )
    batch = dataclasses.replace(
        batch, behaviour_logprobs=np.asarray(logp), routes=routes[:, :length]
    )
    trainer = Trainer(
        run_config(model=cfg, routing_replay=replay, micro_batch_size=16),  # one program each
        devices=jax.devices()[:1],
        checkpoint_dir=tmp_path / replay,
        model=model,
    )
    metrics = trainer.train_step(batch)
    trainer.close()
    return metrics, routes


def test_routing_replay_forces_the_workers_experts_on_the_chosen_forwards(tmp_path):
    got = {replay: _replay_case(tmp_path, replay)[0] for replay in ("off", "old", "both")}
    # π_old routed by the trainer's own router misses the worker's log-probs by far more than
    # f32 round-off; forced to the worker's experts it is the same computation (to ~1e-6).
    assert got["off"]["logp_old_behaviour_diff_max"] > 1e-2
    for replay in ("old", "both"):
        assert got[replay]["logp_old_behaviour_diff_max"] < 1e-4
        assert got[replay]["routing_replay"] == {"old": 1.0, "both": 2.0}[replay]
    # The update's π_θ: routed by its own router ("old") it is not π_old, so the first update's
    # importance ratio is off 1; forced as π_old was ("both"), the ratio is 1 to round-off.
    assert abs(got["old"]["ratio_max"] - 1.0) > 1e-2
    assert abs(got["both"]["ratio_max"] - 1.0) < 1e-4
    assert abs(got["both"]["ratio_mean"] - 1.0) < 1e-5


def test_routing_replay_needs_experts():
    with pytest.raises(ConfigError, match="routing_replay.*has no experts"):
        run_config(routing_replay="both")


def test_the_expert_axes_must_divide_the_experts():
    moe = models.preset("tiny", arch="qwen3_moe", num_experts=4)
    cfg = run_config(model=moe)
    for section in ("mesh", "inference.mesh"):
        mesh = MeshConfig(data=1, fsdp=1, expert=8, tensor=1)
        replace = (
            {"mesh": mesh}
            if section == "mesh"
            else {"inference": dataclasses.replace(cfg.inference, mesh=mesh)}
        )
        with pytest.raises(ConfigError, match=f"{section}.expert.*divide the model's 4 experts"):
            dataclasses.replace(cfg, **replace)
    dense = run_config()
    with pytest.raises(ConfigError, match="inference.mesh.expert.*the model has none"):
        dataclasses.replace(
            dense,
            inference=dataclasses.replace(
                dense.inference, mesh=MeshConfig(data=1, fsdp=1, expert=2, tensor=1)
            ),
        )
    # The trainer's axis on a dense model is one more fsdp: allowed.
    dataclasses.replace(dense, mesh=MeshConfig(data=1, fsdp=-1, expert=2, tensor=1))


def test_routes_that_do_not_fit_the_model_are_refused(tmp_path):
    cfg = models.preset("tiny", arch="qwen3_moe", num_layers=2, num_experts=4)
    trainer = Trainer(
        run_config(model=cfg, routing_replay="both"),
        devices=jax.devices()[:1],
        checkpoint_dir=tmp_path,
    )
    batch = random_batch(1)
    shape = batch.tokens.shape
    bad = {
        "no expert 4": np.full((*shape, 2, 2), 4, np.int16),
        r"\(3, 2\) \(layers, experts a token\)": np.zeros((*shape, 3, 2), np.int16),
    }
    for match, routes in bad.items():
        with pytest.raises(ValueError, match=match.replace("no expert 4", r"\[4, 4\]")):
            trainer.train_step(dataclasses.replace(batch, routes=routes))
    assert trainer.step == 0
    trainer.close()


def test_at_coefficient_zero_the_term_is_a_metric_that_holds_no_memory(tmp_path):
    """[pod-fidelity]: the load-balancing term was built into the gradient whatever its
    coefficient (a runtime scale), keeping the router logits ([layers, b, T, experts] float32)
    for the backward pass. At 0 it is a metric only: the gradient step's temporaries shrink
    (compiled on CPU), and the metric is still reported."""
    from rlax_tpu.trainer.aot import abstract_programs

    model = models.preset(
        "tiny", arch="qwen3_moe", qk_norm=True, num_layers=2, num_experts=4, experts_per_token=2
    )
    temps = {}
    for coef in (0.0, 0.01):
        cfg = run_config(model=model)
        cfg = dataclasses.replace(
            cfg, algorithm=dataclasses.replace(cfg.algorithm, router_aux_loss_coef=coef)
        )
        (program,) = [
            p for p in abstract_programs(cfg, jax.devices()[:1]) if p.name == "trainer.accumulate"
        ]
        with jax.set_mesh(program.mesh):
            compiled = program.fn.lower(*program.args, **program.kwargs).compile()
        temps[coef] = compiled.memory_analysis().temp_size_in_bytes
    assert temps[0.0] < temps[0.01], temps
    trainer = Trainer(run_config(model=model), devices=jax.devices()[:1], checkpoint_dir=tmp_path)
    metrics = trainer.train_step(random_batch(1))
    trainer.close()
    assert abs(metrics["router_aux_loss"] - 2.0) < 0.1  # near-uniform routing at init
