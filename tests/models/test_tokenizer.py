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


# Chat templates in the shape of Llama 3's and Qwen 3's (written here, not copied): header tokens
# per role with bos, and a thinking switch passed as a template option.
LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN3_STYLE = (
    "{%- for m in messages %}\n"
    "  {%- if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m.role) }}{% endif %}\n"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{%- endif %}"
)


def test_the_models_own_template_without_a_system_message(smollm2_tokenizer, reference):
    """SmolLM2's GGUF template adds its default system prompt when the conversation has none
    (plain ChatML did not: prompts the model was not trained on)."""
    user_only = MESSAGES[1:]
    ours = smollm2_tokenizer.apply_chat_template(user_only)
    theirs = reference.apply_chat_template(user_only, tokenize=False, add_generation_prompt=True)
    assert ours == theirs and "SmolLM" in ours


@pytest.mark.parametrize(
    ("template", "options"),
    [
        (LLAMA3_STYLE, {}),
        (QWEN3_STYLE, {}),
        (QWEN3_STYLE, {"enable_thinking": False}),
    ],
)
def test_templates_render_as_transformers_renders_them(
    smollm2_tokenizer, tmp_path, template, options
):
    tok = Tokenizer(
        smollm2_tokenizer.backend, bos="<|im_start|>", eos="<|im_end|>", chat_template=template
    )
    tok.save(tmp_path)
    again = Tokenizer.from_file(tmp_path)  # the template travels in tokenizer_config.json
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
    )
    for generation in (True, False):
        want = hf.apply_chat_template(
            MESSAGES,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=generation,
            **options,
        )
        assert (
            tok.apply_chat_template(MESSAGES, add_generation_prompt=generation, **options) == want
        )
        assert (
            again.apply_chat_template(MESSAGES, add_generation_prompt=generation, **options) == want
        )
    if template is QWEN3_STYLE:
        with pytest.raises(ValueError, match="unknown role tool"):
            tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_end_of_turn_tokens_stop_a_generation():
    import tokenizers

    vocab = {"a": 0, "<|eot_id|>": 1, "<|end_of_text|>": 2}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="a"))
    tok = Tokenizer(backend, eos="<|end_of_text|>")
    assert tok.stop_ids == {1, 2}


def test_an_environment_turn_is_what_the_template_renders(smollm2_tokenizer, reference):
    """prompt + the model's tokens + turn_ids(feedback) are the ids of the whole conversation as
    transformers renders and tokenizes it, whether or not the model's turn ended with its end
    marker; the model's own tokens are never re-encoded."""
    tok, im_end = smollm2_tokenizer, smollm2_tokenizer.backend.token_to_id("<|im_end|>")
    question, answer = MESSAGES[1:], "```python\ndef f(x):\n    return x\n```"
    feedback = "test 3: expected 5, got 4. Fix the program."
    conversation = [
        *question,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": feedback},
    ]
    whole = reference.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
    whole = list(getattr(whole, "input_ids", whole))
    prompt = tok.encode(tok.apply_chat_template(question))
    stopped = tok.encode(answer) + [im_end]  # the turn ended by its stop token
    assert prompt + stopped + tok.turn_ids(feedback, after=stopped) == whole
    cut = tok.encode(answer)  # a turn without it (cut by a length budget)
    assert tok.turn_ids(feedback, after=cut)[0] == im_end
    assert prompt + cut + tok.turn_ids(feedback, after=cut) == whole

    # Sampled ids need not be the canonical encoding of their text ("return" drawn letter by
    # letter): decoding and re-encoding the episode would change them; building it does not.
    letters = [tok.encode(c)[0] for c in "return"]
    sampled = tok.encode("def f(x):\n    ") + letters + tok.encode(" x") + [im_end]
    episode = prompt + sampled + tok.turn_ids(feedback, after=sampled)
    assert episode[len(prompt) : len(prompt) + len(sampled)] == sampled
    assert tok.encode(tok.decode(episode, skip_special_tokens=False)) != episode


def test_a_template_that_rewrites_earlier_turns_cannot_be_extended(smollm2_tokenizer):
    rewrites = (  # the last assistant turn rendered apart from earlier ones (as Qwen3 strips thoughts)
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}[earlier]{% else %}{{ m.content }}"
        "{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = Tokenizer(smollm2_tokenizer.backend, eos="<|im_end|>", chat_template=rewrites)
    with pytest.raises(ValueError, match="cannot be extended turn by turn"):
        tok.turn_ids("feedback")
