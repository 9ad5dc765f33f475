"""RoPE inverse frequencies and attention factors of every scaling against transformers'
``ROPE_INIT_FUNCTIONS`` (an independent implementation), at realistic model sizes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from rlax_tpu.models.hf_format import config_from_hf
from rlax_tpu.models.rope import inverse_frequencies, yarn_attention_factor

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 500_000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10_000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10_000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500_000.0,
    },
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32_768,
        "rope_theta": 1_000_000.0,
    },
}


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("seq_len", [100, 200_000])
def test_inverse_frequencies_match_transformers(name, seq_len):
    hf = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=1,
        vocab_size=32,
        intermediate_size=64,
        max_position_embeddings=131_072,
        rope_parameters=dict(ROPES[name]),
    )
    cfg = config_from_hf(hf.to_dict(), "test")
    positions = jnp.arange(seq_len, dtype=jnp.int32)[None, -1:]  # only the max matters
    ours = np.asarray(inverse_frequencies(cfg, positions))
    kind = ROPES[name]["rope_type"]
    if kind == "default":  # the textbook formula (transformers has no init function for it)
        theirs, attention_factor = 1.0 / 500_000.0 ** (np.arange(0, 128, 2) / 128), 1.0
    else:
        theirs, attention_factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu", seq_len=seq_len)
    np.testing.assert_allclose(ours, np.asarray(theirs, np.float64), rtol=2e-6, atol=0)
    assert yarn_attention_factor(cfg) == pytest.approx(attention_factor, rel=1e-6)
