"""LoRA in the trainer: only the adapters change, the base has no optimizer state, the
published weights are the base with the trained adapters, and a checkpoint restores them."""

from __future__ import annotations

import jax
import numpy as np

from rlax_tpu import models
from rlax_tpu.trainer import Trainer
from rlax_tpu.trainer.lora import split_adapters

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


def test_the_published_model_carries_the_trained_adapters_to_an_engine(tmp_path):
    """The trainer publishes the whole model (base in publish_dtype, adapters float32, as the
    engine's model holds them); an engine that loads it samples with the trained policy's
    log-probs (the full-sequence forward's, to the engine's 1e-5 against another program)."""
    import jax.numpy as jnp

    from rlax_tpu.inference.engine import Engine
    from rlax_tpu.inference.sampler import SamplingParams
    from rlax_tpu.inference.scheduler import Request

    class Probe:
        def push(self, params, version):  # noqa: ANN001, ANN202
            self.pushed, self.version = params, version

    probe = Probe()
    cfg = run_config(model=models.preset("tiny", num_layers=2, lora_rank=4))
    trainer = Trainer(cfg, sink=probe, devices=jax.devices()[:1], checkpoint_dir=tmp_path)
    trainer.train_step(random_batch(3))
    trainer.train_step(random_batch(4))
    trainer.publish()
    adapters, base = split_adapters(host(probe.pushed))
    assert probe.version == 2 and _size(adapters) > 0
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(adapters))
    engine = Engine(models.init_model(cfg.model), cfg.inference)
    engine.load_weights(2, probe.pushed)
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
