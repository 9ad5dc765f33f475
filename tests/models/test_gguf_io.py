"""SmolLM2-135M-Instruct from its GGUF (Q8_0/Q4_1, dequantized to f32): weights and logits against
HF transformers' own GGUF reader, greedy generation, cached decoding, and clear errors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from rlax_tpu.models.errors import ModelLoadError
from rlax_tpu.models.generate import greedy_generate
from rlax_tpu.models.gguf_io import load_gguf, unpermute_rope_rows
from rlax_tpu.models.presets import preset
from rlax_tpu.models.transformer import forward


def test_config_from_metadata_is_smollm2(smollm2):
    cfg, _ = smollm2
    expected = preset("smollm2-135m")
    for field in (
        "arch",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "rope_theta",
        "tie_embeddings",
        "qkv_bias",
    ):
        assert getattr(cfg, field) == getattr(expected, field), field
    assert cfg.resolved_head_dim == 64 and abs(cfg.rms_norm_eps - 1e-5) < 1e-9


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's converter, as its documentation states it: per head, rows (2, D/2) -> (D/2, 2).
    heads, d, cols = 3, 8, 5
    hf = np.arange(heads * d * cols, dtype=np.float32).reshape(heads * d, cols)
    permuted = hf.reshape(heads, 2, d // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, heads), hf)


def test_logits_match_transformers_gguf_reader(smollm2, smollm2_path):
    """transformers dequantizes and un-permutes the file with its own code: an independent
    reference for our reader, and its PyTorch Llama an independent forward."""
    _, model = smollm2
    meta = load_gguf_checkpoint(str(smollm2_path))["config"]
    hf_cfg = LlamaConfig(
        **{k: v for k, v in meta.items() if k not in ("model_type", "_model_name_or_path")}
    )
    with torch.device("meta"):  # no random init: every weight comes from the file
        hf = LlamaForCausalLM(hf_cfg).eval()
    tensors = load_gguf_checkpoint(str(smollm2_path), return_tensors=True, model_to_load=hf)[
        "tensors"
    ]
    hf.load_state_dict(
        {k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False, assign=True
    )
    hf.tie_weights()
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf_cfg)  # its buffers, off "meta"
    assert not any(p.is_meta for p in [*hf.parameters(), *hf.buffers()])
    tokens = np.random.default_rng(0).integers(0, hf_cfg.vocab_size, size=(1, 24))
    with torch.no_grad():
        reference = hf(torch.as_tensor(tokens)).logits.numpy()
    ours = np.asarray(forward(model, jnp.asarray(tokens, jnp.int32)))
    # 30 layers of f32 with different summation orders; logits reach |30|.
    assert np.abs(ours - reference).max() <= 5e-4


def test_greedy_answer_and_cached_decoding_match_full_forward(smollm2, smollm2_tokenizer):
    _, model = smollm2
    tok = smollm2_tokenizer
    prompt = tok.encode(
        tok.apply_chat_template(
            [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"},
            ]
        )
    )
    generated, step_logits = greedy_generate(
        model, prompt, max_new_tokens=12, stop_ids=tok.stop_ids
    )
    answer = tok.decode(generated)
    assert "Paris" in answer, answer

    full = np.asarray(forward(model, jnp.asarray([prompt + generated], jnp.int32)))[0]
    n = len(generated)
    # Logits that chose token t+1 by cached decoding == full forward at position t.
    assert np.abs(full[len(prompt) - 1 : len(prompt) - 1 + n] - step_logits).max() <= 5e-4
    # Tokens are the forward's argmax wherever its top two are not tied within that round-off.
    chosen = full[len(prompt) - 1 : len(prompt) - 1 + n]
    top2 = np.sort(chosen, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-3
    assert clear.sum() >= n - 1
    np.testing.assert_array_equal(chosen.argmax(-1)[clear], np.asarray(generated)[clear])


# ---------------------------------------------------------------------------------------------
# Bad input.


def test_corrupt_gguf(tmp_path, smollm2_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(ModelLoadError, match=rf"^{bad}: not a valid GGUF file"):
        load_gguf(bad)
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_path, "rb") as f:
        truncated.write_bytes(f.read(200_000))
    with pytest.raises(ModelLoadError, match=rf"^{truncated}: not a valid GGUF file"):
        load_gguf(truncated)
    with pytest.raises(ModelLoadError, match="file not found"):
        load_gguf(tmp_path / "absent.gguf")


def _write_gguf(path, arch: str, tensors: dict[str, np.ndarray], *, heads: int = 2) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_context_length(64)
    w.add_vocab_size(32)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny_llama_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = {  # numpy (HF) shapes
        "token_embd.weight": (32, 8),
        "output_norm.weight": (8,),
        "blk.0.attn_norm.weight": (8,),
        "blk.0.ffn_norm.weight": (8,),
        "blk.0.attn_q.weight": (8, 8),
        "blk.0.attn_k.weight": (8, 8),
        "blk.0.attn_v.weight": (8, 8),
        "blk.0.attn_output.weight": (8, 8),
        "blk.0.ffn_gate.weight": (16, 8),
        "blk.0.ffn_up.weight": (16, 8),
        "blk.0.ffn_down.weight": (8, 16),
    }
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def test_written_gguf_loads_and_errors_name_the_tensor(tmp_path):
    tensors = _tiny_llama_tensors()
    _write_gguf(tmp_path / "ok.gguf", "llama", tensors)
    cfg, model = load_gguf(tmp_path / "ok.gguf")
    assert (cfg.num_layers, cfg.hidden_size, cfg.tie_embeddings) == (1, 8, True)
    np.testing.assert_array_equal(
        np.asarray(model.layers[0].mlp.up_proj[...]), tensors["blk.0.ffn_up.weight"].T
    )

    missing = dict(tensors)
    del missing["blk.0.ffn_down.weight"]
    _write_gguf(tmp_path / "missing.gguf", "llama", missing)
    with pytest.raises(
        ModelLoadError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight' is missing"
    ):
        load_gguf(tmp_path / "missing.gguf")

    wrong = dict(tensors, **{"blk.0.ffn_up.weight": np.zeros((12, 8), np.float32)})
    _write_gguf(tmp_path / "wrong.gguf", "llama", wrong)
    with pytest.raises(
        ModelLoadError,
        match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(12, 8\), the config expects \(16, 8\)",
    ):
        load_gguf(tmp_path / "wrong.gguf")

    _write_gguf(tmp_path / "gpt2.gguf", "gpt2", tensors)
    with pytest.raises(
        ModelLoadError,
        match=r"field 'general.architecture' = 'gpt2' is not a supported architecture",
    ):
        load_gguf(tmp_path / "gpt2.gguf")
