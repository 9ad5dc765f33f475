"""Shared helpers: the tiny model and small engine configs."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from rlax_tpu import models
from rlax_tpu.config import InferenceConfig
from rlax_tpu.inference.engine import Engine
from rlax_tpu.inference.sampler import SamplingParams
from rlax_tpu.inference.scheduler import Request

SMALL = InferenceConfig(
    max_concurrent_seqs=8,
    page_size=4,
    kv_cache_bytes=2**20,
    prefill_chunk=8,
    max_prompt_len=24,
    max_new_tokens=24,
)


@pytest.fixture(scope="session")
def tiny_model() -> models.Transformer:
    return models.init_model(models.preset("tiny"))


def make_engine(model: models.Transformer, **overrides) -> Engine:
    eos_ids = overrides.pop("eos_ids", ())
    return Engine(model, dataclasses.replace(SMALL, **overrides), eos_ids=eos_ids)


def random_requests(
    n: int,
    *,
    seed: int = 0,
    num_samples: int = 1,
    max_prompt: int = 24,
    max_new: int = 24,
    **sampling,
) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = tuple(
            int(t) for t in rng.integers(0, 512, size=int(rng.integers(1, max_prompt + 1)))
        )
        params = SamplingParams(
            max_new_tokens=int(rng.integers(1, max_new + 1)), seed=1000 + i, **sampling
        )
        out.append(
            Request(
                prompt_id=f"r{i}", prompt_tokens=prompt, num_samples=num_samples, sampling=params
            )
        )
    return out


def mixed_requests(sampled: int, greedy: int) -> list[Request]:
    """``sampled`` seeded temperature-1 requests of 2 samples, ``greedy`` greedy ones, and a group
    of 4 samples sharing an 18-token prompt's pages."""
    return [
        *random_requests(sampled, seed=21, num_samples=2, temperature=1.0),
        *(
            dataclasses.replace(r, prompt_id=f"greedy{i}")
            for i, r in enumerate(random_requests(greedy, seed=22, temperature=0.0))
        ),
        Request(
            prompt_id="group",
            prompt_tokens=tuple(range(1, 19)),
            num_samples=4,
            sampling=SamplingParams(temperature=1.0, max_new_tokens=8, seed=7),
        ),
    ]


def by_key(rollouts) -> dict:
    return {(r.prompt_id, r.sample_index): r for r in rollouts}


def assert_same_samples(got, want, *, bitwise: bool, atol: float = 1e-5) -> None:
    """A request's rollouts from two runs agree: bit for bit where the engine promises it
    (``Engine.rows_bitwise``: this host's start-up row check passed), else its log-probs to f32
    round-off up to the first token where a near-tie was drawn the other way."""
    if bitwise:
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.logprobs, want.logprobs)
        return
    same = np.cumprod(got.tokens[: len(want.tokens)] == want.tokens[: len(got.tokens)]).sum()
    np.testing.assert_allclose(got.logprobs[: same + 1], want.logprobs[: same + 1], atol=atol)


def run_with_an_overlapped_reload(engine: Engine) -> list:
    """8 greedy requests on version 0; after two steps version 1 (the weights x 1.5) loads
    under them and 3 more run on it beside them (``overlap_reload``): every process makes the
    same calls."""
    for r in random_requests(8, seed=5, temperature=0.0):
        engine.submit(r)
    done = engine.step() + engine.step()
    engine.load_weights(1, jax.tree.map(lambda x: x * 1.5, engine.state))
    for r in random_requests(3, seed=6, temperature=0.0):
        engine.submit(dataclasses.replace(r, prompt_id=f"v1.{r.prompt_id}"))
    return done + engine.run()
