"""Host-side input checks of the greedy decoder and the old-policy replay: bad token ids or
lengths raise a clear ValueError instead of NaN logits or silently dropped positions."""

from __future__ import annotations

import numpy as np
import pytest

from rlax_tpu.models.generate import greedy_generate
from rlax_tpu.models.presets import preset
from rlax_tpu.models.scoring import ReplayShape, replay_logprobs
from rlax_tpu.models.transformer import init_model

CFG = preset("tiny", num_layers=1)  # vocab 512


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=0)


def test_greedy_generate_checks_its_input(model):
    generated, logits = greedy_generate(model, [1, 2, 3], max_new_tokens=2)
    assert len(generated) == 2 and np.isfinite(logits).all()
    with pytest.raises(
        ValueError, match=r"token id 512 at index \(1,\) is outside the vocabulary \[0, 512\)"
    ):
        greedy_generate(model, [1, 512, 3], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"token id -1 at index \(0,\)"):
        greedy_generate(model, [-1], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt is empty"):
        greedy_generate(model, [], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        greedy_generate(model, [1], max_new_tokens=0)


def test_replay_logprobs_checks_its_input(model):
    shape = ReplayShape(slots=2, page_size=4, pages_per_seq=4, num_pages=9)
    tokens = np.array([[1, 2, 3, 4, 0, 0], [5, 6, 7, 0, 0, 0]])
    prompt, completion = np.array([2, 1]), np.array([2, 2])
    out = replay_logprobs(model, tokens, prompt, completion, shape=shape)
    assert out.shape == (2, 2) and np.isfinite(out).all() and (out < 0).all()

    # Ids past a row's rollout are padding and are not checked; inside it they are.
    padded = tokens.copy()
    padded[1, 5] = 10_000
    replay_logprobs(model, padded, prompt, completion, shape=shape)
    bad = tokens.copy()
    bad[1, 2] = 10_000
    with pytest.raises(ValueError, match=r"token id 10000 at index \(1, 2\) is outside"):
        replay_logprobs(model, bad, prompt, completion, shape=shape)
    with pytest.raises(ValueError, match=r"rollout of 7 tokens is longer than the tokens array"):
        replay_logprobs(model, tokens, prompt, np.array([5, 2]), shape=shape)
    with pytest.raises(ValueError, match=r"prompt lengths must be >= 1"):
        replay_logprobs(model, tokens, np.array([0, 1]), completion, shape=shape)
    with pytest.raises(ValueError, match=r"must be \[B\] = \(2,\)"):
        replay_logprobs(model, tokens, np.array([2]), np.array([2]), shape=shape)
