"""Tokenizers (all backed by HF ``tokenizers``): from tokenizer.json, from a GGUF file's embedded
vocabulary and merges, or a small byte-level BPE trained locally; plus special tokens and the
model's own chat template (the Jinja template a GGUF file or tokenizer_config.json carries,
rendered as HF transformers renders it), ChatML where the model has none.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from rlax_tpu import storage
from rlax_tpu.models.errors import ModelLoadError
from rlax_tpu.models.gguf_file import GGUFFile

IM_START, IM_END, ENDOFTEXT, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|pad|>"
# End-of-turn tokens of chat vocabularies (ChatML, Llama 3, Phi-3): a generation stops at them.
END_OF_TURN = (IM_END, "<|eot_id|>", "<|end|>")
TRAINED_SPECIALS = (PAD, ENDOFTEXT, IM_START, IM_END)

# Pre-tokenizer split patterns by GGUF ``tokenizer.ggml.pre`` (the regexes the vocabularies were
# trained with; llama.cpp keeps the same table).
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_TOKEN_CONTROL, _GGUF_TOKEN_USER_DEFINED = 3, 4


def _byte_level(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _pre_tokenizer_for(gguf_pre: str) -> pre_tokenizers.PreTokenizer:
    if gguf_pre == "smollm":  # digits one by one, then GPT-2 splitting
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if gguf_pre in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"):
        return _byte_level(_LLAMA3_PATTERN)
    if gguf_pre in ("qwen2", "deepseek-r1-qwen"):
        return _byte_level(_QWEN2_PATTERN)
    return _byte_level(_GPT2_PATTERN)


class Tokenizer:
    """Text <-> token ids, with bos/eos/pad ids and a chat template.

    ``stop_ids`` are the ids that end a generation (eos and the vocabulary's end-of-turn tokens).
    ``chat_template``: the model's Jinja chat template, or None (ChatML).
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos: str | None = None,
        eos: str | None = None,
        pad: str | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.add_bos = add_bos
        self.chat_template = chat_template or None
        self.bos_id, self.eos_id, self.pad_id = (self._id_of(t) for t in (bos, eos, pad))
        if self.pad_id is None:
            self.pad_id = self.eos_id
        stops = {self.eos_id, *(self.backend.token_to_id(t) for t in END_OF_TURN)}
        self.stop_ids = frozenset(i for i in stops if i is not None)

    def _id_of(self, token: str | None) -> int | None:
        if token is None:
            return None
        i = self.backend.token_to_id(token)
        if i is None:
            raise ModelLoadError("tokenizer", f"special token {token!r} is not in the vocabulary")
        return i

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; special-token strings in it (e.g. <|im_start|>) map to their ids."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def text_of(self, ids: Sequence[int]) -> str:
        """``ids`` as the model wrote them, special tokens as text (what stop strings match:
        one may be a special token, "</tool_call>")."""
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = True,
        **options: object,
    ) -> str:
        """The conversation as the model was trained to read it: its own chat template rendered
        as HF transformers' ``apply_chat_template(tokenize=False)`` renders it (``options``, e.g.
        ``enable_thinking=False`` for Qwen 3, go to the template), or, for a model without one,
        ChatML: ``<|im_start|>{role}`` newline ``{content}<|im_end|>`` newline per message, then
        ``<|im_start|>assistant`` newline when ``add_generation_prompt``."""
        if self.chat_template is not None:
            return render_chat_template(
                self.chat_template,
                messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._token_text(self.bos_id),
                eos_token=self._token_text(self.eos_id),
                **options,
            )
        for tok in (IM_START, IM_END):
            if self.backend.token_to_id(tok) is None:
                raise ValueError(f"this vocabulary has no {tok} token, so no ChatML template")
        text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
        return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")

    def turn_ids(
        self,
        content: str,
        *,
        role: str = "user",
        after: Sequence[int] = (),
        **options: object,
    ) -> list[int]:
        """Token ids that carry an environment's message into a conversation whose last tokens,
        ``after``, are the model's turn: the rest of that turn's end marker (none when ``after``
        ends with the marker's token, as a turn stopped by it does), ``content`` as a ``role``
        turn, and the header of the model's next turn, as the chat template renders them.

        Only this text is tokenized: the model's tokens are kept as sampled (decoding and
        re-encoding them may give other ids). ValueError for a template that renders a turn
        differently once another follows it (such templates cannot be extended turn by turn).
        """
        marker = "\x00rlax-turn\x00"  # stands for the model's content; no template emits it
        before = [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}]
        closed = self.apply_chat_template(before, add_generation_prompt=False, **options)
        extended = self.apply_chat_template(
            [*before, {"role": role, "content": content}], add_generation_prompt=True, **options
        )
        if closed.count(marker) != 1 or not extended.startswith(closed):
            raise ValueError(
                "this chat template renders a model turn differently once another turn follows "
                "it, so a conversation cannot be extended turn by turn"
            )
        text = closed[closed.index(marker) + len(marker) :] + extended[len(closed) :]
        added = self.backend.get_added_tokens_decoder()
        if after and int(after[-1]) in added:  # a special token such as <|im_end|>
            last = added[int(after[-1])].content
            if text.startswith(last):
                text = text[len(last) :]  # the model emitted the end marker itself
        return self.encode(text, add_bos=False)

    def _token_text(self, i: int | None) -> str:
        return "" if i is None else self.backend.id_to_token(i)

    # -- constructors -----------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """An HF ``tokenizer.json`` (or a directory holding it and tokenizer_config.json)."""
        path = storage.path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            backend = HFTokenizer.from_str(file.read_text())
        except FileNotFoundError:
            raise ModelLoadError(str(file), "no such file") from None
        except Exception as e:
            raise ModelLoadError(str(file), f"not a valid tokenizer.json ({e})") from None
        specials = _specials_from_config(file.parent / "tokenizer_config.json")
        return cls(backend, **specials)

    @classmethod
    def from_gguf(cls, path: str | Path | GGUFFile) -> Tokenizer:
        """The vocabulary and merges embedded in a GGUF file, as a byte-level BPE."""
        f = path if isinstance(path, GGUFFile) else GGUFFile(path)
        kind = f.require("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(
                f.path,
                f"field 'tokenizer.ggml.model' = {kind!r}: only byte-level BPE ('gpt2') is supported",
            )
        tokens: list[str] = list(f.require("tokenizer.ggml.tokens"))
        merges = [tuple(m.split(" ", 1)) for m in f.require("tokenizer.ggml.merges")]
        backend = HFTokenizer(
            models.BPE(
                vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=False
            )
        )
        backend.pre_tokenizer = _pre_tokenizer_for(f.field("tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()
        types = f.field("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, k in zip(tokens, types, strict=True)
                if k == _GGUF_TOKEN_CONTROL
            ]
        )
        backend.add_tokens(
            [
                AddedToken(t, normalized=False)
                for t, k in zip(tokens, types, strict=True)
                if k == _GGUF_TOKEN_USER_DEFINED
            ]
        )

        def token(key: str) -> str | None:
            i = f.field(key)
            return None if i is None else tokens[int(i)]

        return cls(
            backend,
            bos=token("tokenizer.ggml.bos_token_id"),
            eos=token("tokenizer.ggml.eos_token_id"),
            pad=token("tokenizer.ggml.padding_token_id"),
            add_bos=bool(f.field("tokenizer.ggml.add_bos_token", False)),
            chat_template=f.field("tokenizer.chat_template"),
        )

    @classmethod
    def train_bpe(
        cls,
        texts: Iterable[str],
        vocab_size: int = 512,
        specials: Sequence[str] = TRAINED_SPECIALS,
        *,
        split_digits: bool = False,
    ) -> Tokenizer:
        """A byte-level BPE trained on ``texts`` (deterministic; any text encodes, no unknowns).

        Specials take the first ids; eos = bos = <|endoftext|>, pad = <|pad|> when present.
        ``split_digits``: numbers become one token per digit (Qwen2's pre-tokenizer split, as in
        Llama / Qwen vocabularies), so numbers unseen in training are made of seen tokens.
        """
        backend = HFTokenizer(models.BPE())
        backend.pre_tokenizer = _byte_level(_QWEN2_PATTERN if split_digits else _GPT2_PATTERN)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(specials),
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        backend.train_from_iterator(texts, trainer=trainer)
        has = set(specials).__contains__
        return cls(
            backend,
            bos=ENDOFTEXT if has(ENDOFTEXT) else None,
            eos=ENDOFTEXT if has(ENDOFTEXT) else None,
            pad=PAD if has(PAD) else None,
        )

    def save(self, directory: str | Path) -> Path:
        """Write tokenizer.json + tokenizer_config.json (readable by ``from_file`` and HF); the
        directory may be gs://."""
        out = storage.path(directory)
        out.mkdir(parents=True, exist_ok=True)
        storage.write_atomic(out / "tokenizer.json", self.backend.to_str())
        name = self.backend.id_to_token
        config = {
            "bos_token": None if self.bos_id is None else name(self.bos_id),
            "eos_token": None if self.eos_id is None else name(self.eos_id),
            "pad_token": None if self.pad_id is None else name(self.pad_id),
            "add_bos_token": self.add_bos,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        storage.write_atomic(out / "tokenizer_config.json", json.dumps(config, indent=2))
        return out / "tokenizer.json"


def _specials_from_config(path: Path | storage.epath.Path) -> dict[str, object]:
    if not path.exists():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(str(path), f"not valid JSON ({e})") from None

    def content(key: str) -> str | None:
        v = cfg.get(key)
        return v.get("content") if isinstance(v, dict) else v

    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return {
        "bos": content("bos_token"),
        "eos": content("eos_token"),
        "pad": content("pad_token"),
        "add_bos": bool(cfg.get("add_bos_token", False)),
        "chat_template": template if isinstance(template, str) else None,
    }


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool,
    **variables: object,
) -> str:
    """A Jinja chat template rendered the way HF transformers does: a sandboxed environment
    (templates come with downloaded models) with trim_blocks and lstrip_blocks, loop controls,
    and ``raise_exception`` for a template's own checks."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"the chat template refused these messages: {message}")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = raise_exception
    try:
        compiled = env.from_string(template)
    except jinja2.TemplateError as e:
        raise ModelLoadError("chat template", f"not a valid Jinja template ({e})") from None
    return compiled.render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
    )
