"""LoRA in the trainer: only the adapters change, the base has no optimizer state, a published
version is the trained adapters alone, and a checkpoint restores them."""

from __future__ import annotations

import jax
import numpy as np

from rlax_tpu import models
from rlax_tpu.models.adapters import split_adapters
from rlax_tpu.trainer import Trainer

from .helpers import host, random_batch, run_config


def _size(tree) -> int:
    return sum(int(np.size(x)) for x in jax.tree.leaves(tree))


def test_only_adapters_train_and_a_checkpoint_restores_them(tmp_path):
    cfg = run_config(model=models.preset("tiny", num_layers=2, lora_rank=4))
    trainer = Trainer(cfg, devices=jax.devices()[:1], checkpoint_dir=tmp_path)
    adapters0, base0 = split_adapters(host(trainer.params()))
    # The optimizer holds two moments of the adapters and nothing of the base.
    assert _size(trainer._opt_state) <= 2 * _size(adapters0) + 16
    for seed in (1, 2):
        trainer.train_step(random_batch(seed))
    adapters, base = split_adapters(host(trainer.params()))
    assert jax.tree.all(jax.tree.map(np.array_equal, base, base0))  # frozen, bitwise
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), adapters, adapters0)
    assert all(jax.tree.leaves(moved)), moved  # B at step 1 (A's gradient is 0 while B = 0), A at 2
    trainer.save(wait=True)
    trainer.close()

    again = Trainer(cfg, devices=jax.devices()[:1], checkpoint_dir=tmp_path)
    assert again.restore() == 2
    jax.tree.map(np.testing.assert_array_equal, host(again.params()), host(trainer.params()))
    again.close()


def test_a_version_is_the_adapters_alone_and_an_engine_serves_the_trained_policy(tmp_path):
    """Through a real parameter server: a LoRA trainer publishes the adapters alone (float32,
    as the engine's model holds them), so a version's bytes are the adapters'; a worker's
    weight source pulls exactly that tree, and an engine that loads it over its own base
    samples with the trained policy's log-probs (the full-sequence forward's, to the engine's
    1e-5 against another program)."""
    import jax.numpy as jnp

    from rlax_tpu.config import ParamServerConfig
    from rlax_tpu.inference.engine import Engine
    from rlax_tpu.inference.sampler import SamplingParams
    from rlax_tpu.inference.scheduler import Request
    from rlax_tpu.param_server.client import ParamServerClient, PulledWeights
    from rlax_tpu.param_server.service import serve

    server, port, _ = serve(ParamServerConfig(persist_every=0))
    client = ParamServerClient(f"127.0.0.1:{port}")
    client.wait_ready()
    cfg = run_config(model=models.preset("tiny", num_layers=2, lora_rank=4))
    trainer = Trainer(cfg, sink=client, devices=jax.devices()[:1], checkpoint_dir=tmp_path)
    adapters, base = split_adapters(host(trainer.params()))
    adapter_bytes = sum(4 * int(np.size(x)) for x in jax.tree.leaves(adapters))
    assert 0 < adapter_bytes < sum(x.nbytes for x in jax.tree.leaves(base)) / 10
    trainer.publish()
    trainer.train_step(random_batch(3))
    trainer.train_step(random_batch(4))  # each update publishes its version
    assert [v.version for v in client.list_versions()[0]] == [0, 1, 2]
    assert client.bytes_pushed == 3 * adapter_bytes  # adapters only

    engine = Engine(models.init_model(cfg.model), cfg.inference)
    pulled = PulledWeights(client, engine.weight_shardings()).fetch(2)
    assert jax.tree.structure(pulled) == jax.tree.structure(adapters)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(pulled))
    engine.load_weights(2, pulled)
    engine.submit(
        Request(
            prompt_id="p",
            prompt_tokens=(5, 9, 2, 7, 1),
            num_samples=2,
            sampling=SamplingParams(temperature=1.0, max_new_tokens=6, seed=1),
        )
    )
    policy = trainer.model()
    for ro in engine.run():
        assert (ro.versions == 2).all()
        seq = jnp.asarray([[*ro.prompt_tokens.tolist(), *ro.tokens.tolist()]], jnp.int32)
        logp = jax.nn.log_softmax(models.forward(policy, seq)[0, 4:-1])
        want = np.take_along_axis(np.asarray(logp), ro.tokens[:, None], axis=-1)[:, 0]
        np.testing.assert_allclose(ro.logprobs, want, rtol=0, atol=1e-5)
    trainer.close()
    client.close()
    server.stop(0)


def test_an_engine_refuses_part_of_a_model_that_is_not_its_adapters():
    """A partial tree would leave the rest of the old version served unnoticed: only the whole
    model, or a LoRA model's adapters alone, load."""
    import pytest
    from flax import nnx

    from rlax_tpu.inference.engine import Engine, InvalidWeights

    cfg = run_config(model=models.preset("tiny", num_layers=2, lora_rank=4))
    engine = Engine(models.init_model(cfg.model), cfg.inference)
    params = host(nnx.to_pure_dict(engine.state))
    adapters, base = split_adapters(params)
    engine.load_weights(1, params)
    engine.load_weights(2, adapters)
    with pytest.raises(InvalidWeights, match="or exactly its LoRA adapters"):
        engine.load_weights(3, base)
    with pytest.raises(InvalidWeights, match="or exactly its LoRA adapters"):
        engine.load_weights(3, {"layers": adapters["layers"], "embed": params["embed"]})
    plain = Engine(models.init_model(models.preset("tiny", num_layers=2)), cfg.inference)
    whole = host(nnx.to_pure_dict(plain.state))
    with pytest.raises(InvalidWeights, match="every parameter of the model$"):
        plain.load_weights(1, {k: v for k, v in whole.items() if k != "embed"})
    assert engine.version == 2 and plain.version == 0
