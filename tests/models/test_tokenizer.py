"""Tokenizers: SmolLM2's GGUF vocabulary against transformers' own GGUF tokenizer, tokenizer.json
round trips, the locally trained BPE, special tokens and the ChatML template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rlax_tpu.models.errors import ModelLoadError
from rlax_tpu.models.tokenizer import Tokenizer

TEXTS = [
    "Hello world!",
    "The year 2024 has 365 days; pi = 3.14159.",
    "  leading spaces\n\nnewlines\ttabs   trailing  ",
    "naïve café, 東京, emoji 🙂",
    "def f(x):\n    return x**2  # square\n",
    "<|im_start|>user\nhi<|im_end|>\n",
]
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def reference(smollm2_path):
    """transformers builds its tokenizer from the same GGUF with its own converter."""
    return AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


def test_gguf_tokenizer_matches_reference(smollm2_tokenizer, reference):
    tok = smollm2_tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.vocab_size == 49152
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (
        reference.bos_token_id,
        reference.eos_token_id,
        reference.pad_token_id,
    )
    assert tok.backend.id_to_token(tok.eos_id) == "<|im_end|>" and tok.eos_id in tok.stop_ids


def test_chatml_matches_the_models_own_template(smollm2_tokenizer, reference):
    ours = smollm2_tokenizer.apply_chat_template(MESSAGES)
    theirs = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert smollm2_tokenizer.encode(ours)[:1] == [
        smollm2_tokenizer.backend.token_to_id("<|im_start|>")
    ]


def test_tokenizer_json_round_trip(smollm2_tokenizer, tmp_path):
    smollm2_tokenizer.save(tmp_path)
    again = Tokenizer.from_file(tmp_path)
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    for text in TEXTS:
        assert again.encode(text) == smollm2_tokenizer.encode(text)
        assert fast.encode(text, add_special_tokens=False) == smollm2_tokenizer.encode(text)
    assert (again.bos_id, again.eos_id, again.pad_id) == (1, 2, 2)


def test_trained_bpe_is_deterministic_and_lossless(tmp_path):
    corpus = [f"def solve(n):\n    return n * {i} + {i * i}\n" for i in range(200)] + TEXTS
    a = Tokenizer.train_bpe(corpus, vocab_size=512)
    b = Tokenizer.train_bpe(corpus, vocab_size=512)
    assert a.vocab_size == 512
    assert a.backend.to_str() == b.backend.to_str()
    for text in [*TEXTS, "unseen: ∑ ß \x00 bytes"]:
        ids = a.encode(text)
        assert max(ids) < 512
        assert a.decode(ids, skip_special_tokens=False) == text
    # Common code merges into fewer tokens than bytes.
    assert len(a.encode("def solve(n):\n    return n")) < len("def solve(n):\n    return n") / 2
    assert a.encode("x", add_bos=True)[0] == a.bos_id == a.backend.token_to_id("<|endoftext|>")
    chat = a.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = a.encode(chat)
    assert (
        ids[0] == a.backend.token_to_id("<|im_start|>")
        and a.backend.token_to_id("<|im_end|>") in ids
    )
    assert a.backend.token_to_id("<|im_end|>") in a.stop_ids
    a.save(tmp_path)
    assert Tokenizer.from_file(tmp_path).encode(chat) == ids


def test_bad_tokenizer_files(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: not a valid tokenizer\.json"):
        Tokenizer.from_file(tmp_path)


def test_trained_bpe_can_split_digits():
    corpus = [f"print(x + {i})\nprint(x * {i * 7})\n" for i in range(300)]
    default = Tokenizer.train_bpe(corpus, vocab_size=400)
    split = Tokenizer.train_bpe(corpus, vocab_size=400, split_digits=True)
    # By default numbers merge into multi-digit tokens; split, every digit is its own token.
    assert any(len(default.decode([i]).strip()) > 1 for i in default.encode(" 2024"))
    text = "print(x + 2024)\nprint(x - 93817)\n"
    ids = split.encode(text)
    assert split.decode(ids) == text
    digits = [split.decode([i]) for i in ids if any(c.isdigit() for c in split.decode([i]))]
    assert digits == list("202493817")
    again = Tokenizer.train_bpe(corpus, vocab_size=400, split_digits=True)
    assert split.backend.to_str() == again.backend.to_str()
