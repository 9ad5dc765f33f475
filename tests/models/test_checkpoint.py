"""HF safetensors loading and export: logits parity with HF transformers (PyTorch, CPU) for tiny
random Llama / Qwen2 / Qwen3 models (and each RoPE scaling), round trips, and clear errors."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM

from rlax_tpu.models.checkpoint import load_safetensors, save_safetensors
from rlax_tpu.models.errors import ModelLoadError
from rlax_tpu.models.transformer import forward

from .conftest import hf_logits, random_hf_model

TOL = 1e-4  # max abs logit difference in f32 (the bound)
TOKENS = np.random.default_rng(0).integers(0, 96, size=(2, 24))

CASES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),  # QKV bias
    "qwen3": ("qwen3", {"head_dim": 24}),  # QK-norm, head_dim != hidden / heads
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    # HF attention_bias on Llama / Qwen3 biases q, k, v *and* o_proj (Qwen2: q, k, v only).
    "llama_attention_bias": ("llama", {"attention_bias": True}),
    "qwen3_attention_bias": ("qwen3", {"attention_bias": True}),
    "rope_linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}),
    # dynamic NTK only acts past max_position_embeddings: 24 tokens > 16.
    "rope_dynamic": (
        "llama",
        {"max_position_embeddings": 16, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
    ),
    "rope_llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            }
        },
    ),
    "rope_yarn": (
        "qwen3",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 1000.0,
            }
        },
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf_and_survive_a_safetensors_round_trip(case, tmp_path):
    arch, overrides = CASES[case]
    hf = random_hf_model(arch, **overrides)
    reference = hf_logits(hf, TOKENS)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")  # several shards + an index
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()

    cfg, model = load_safetensors(tmp_path / "hf")
    assert cfg.arch == arch
    ours = np.asarray(forward(model, jnp.asarray(TOKENS, jnp.int32)))
    assert ours.dtype == np.float32
    assert np.abs(ours - reference).max() <= TOL

    # Export, then HF transformers loads our files and computes the same logits.
    files = save_safetensors(model, tmp_path / "ours", max_shard_bytes=40_000)
    assert len(files) > 1
    reloaded_hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert np.abs(hf_logits(reloaded_hf, TOKENS) - reference).max() <= TOL
    # ... and so does our own loader, bit for bit.
    _, again = load_safetensors(tmp_path / "ours")
    np.testing.assert_array_equal(np.asarray(forward(again, jnp.asarray(TOKENS, jnp.int32))), ours)


def test_single_file_checkpoint_and_bf16_params(tmp_path):
    hf = random_hf_model("qwen2")
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    cfg, model = load_safetensors(tmp_path, param_dtype="bfloat16", compute_dtype="bfloat16")
    assert model.layers[0].attn.q_proj[...].dtype == jnp.bfloat16
    logits = np.asarray(forward(model, jnp.asarray(TOKENS, jnp.int32)))
    assert logits.dtype == np.float32  # logits are f32 even with bf16 compute
    # bf16 rounding of weights and activations: close to the f32 reference, not equal.
    assert np.abs(logits - hf_logits(hf, TOKENS)).max() < 0.1


# ---------------------------------------------------------------------------------------------
# Bad input gets a ModelLoadError that names the file and tensor/field.


@pytest.fixture
def checkpoint(tmp_path):
    random_hf_model("llama").save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_missing_tensor(checkpoint):
    file = checkpoint / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"
    ):
        load_safetensors(checkpoint)


def test_unused_tensor(checkpoint):
    file = checkpoint / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.ones(64, np.float32)  # config: no bias
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as info:
        load_safetensors(checkpoint)
    assert str(info.value).startswith(
        f"{checkpoint}: checkpoint tensor(s) 'model.layers.0.self_attn.o_proj.bias' are not used "
        "by the model config"
    )


def test_lm_head_in_a_tied_checkpoint(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["tie_word_embeddings"] = True  # the file still holds its own (different) lm_head
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelLoadError, match=r"'lm_head\.weight' is in the checkpoint but the config ties"
    ):
        load_safetensors(checkpoint)

    # A stored copy equal to the embeddings is what tying means: accepted.
    file = checkpoint / "model.safetensors"
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, file, metadata={"format": "pt"})
    cfg, _ = load_safetensors(checkpoint)
    assert cfg.tie_embeddings


def test_shape_mismatch(checkpoint):
    file = checkpoint / "model.safetensors"
    tensors = load_file(file)
    tensors["model.norm.weight"] = np.ones(32, np.float32)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as info:
        load_safetensors(checkpoint)
    assert str(info.value) == (
        f"{checkpoint}: tensor 'model.norm.weight' has shape (32,), the config expects (64,)"
    )


def test_unsupported_architecture(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["model_type"] = "gpt2"
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as info:
        load_safetensors(checkpoint)
    assert str(info.value) == (
        f"{checkpoint / 'config.json'}: field 'model_type' = 'gpt2' is not a supported "
        "architecture; supported: llama, qwen2, qwen3, qwen3_moe, mixtral"
    )


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupt_safetensors_file(checkpoint, damage):
    file = checkpoint / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64 + data[64:])
    with pytest.raises(ModelLoadError, match=rf"^{file}: not a valid safetensors file"):
        load_safetensors(checkpoint)


def test_corrupt_config_and_index(checkpoint, tmp_path):
    (checkpoint / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: not valid JSON"):
        load_safetensors(checkpoint)

    sharded = tmp_path / "sharded"
    random_hf_model("llama").save_pretrained(sharded, max_shard_size="40KB")
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(
        ModelLoadError, match=rf"^{victim}: file listed in the checkpoint does not exist"
    ):
        load_safetensors(sharded)
    shutil.rmtree(sharded)
