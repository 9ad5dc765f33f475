"""Other engines on decode_speed's workloads, each in the benchmark virtualenv (``make
bench-venv``: their dependencies stay out of the project's): run by ``decode_speed.py`` as

    .venv-bench/bin/python benchmarks/foreign_engines.py llama-cpp --gguf F --requests R.json
        --slots 64 --out O.json
    .venv-bench/bin/python benchmarks/foreign_engines.py tunix --weights W.npz --requests R.json
        --slots 64 --out O.json

The requests file is a list of {id, prompt (token ids), length}; every engine decodes greedily
(argmax) exactly ``length`` tokens per request (EOS ignored) and writes {tokens, seconds,
outputs {id: [token ids]}} with the wall time from the first prefill to the last token.

llama-cpp  llama.cpp (``llama-cpp-python``, built from source for this CPU) through its C API:
           continuous batching over ``--slots`` sequences, as its server does. Every step is one
           ``llama_decode`` of a batch holding each running sequence's last token and the
           prompts of the sequences just admitted; a finished sequence's cells are freed and the
           next request takes its slot. Weights as the GGUF stores them (Q4_1 for SmolLM2),
           by its AVX-512 kernels: the AMX ones crash here (see ``use_extra_bufts``).
tunix      Tunix's ``Sampler`` (``tunix.generate.sampler``) over its own Llama-3 model
           (``tunix.models.llama3``) holding the weights ``decode_speed.py`` exported from
           rlax_tpu's SmolLM2 (f32, ``W.npz`` and its ``.json`` config), greedy, static batches of
           ``--slots`` requests (left padding), each run to its longest request after a warm-up
           call of the same shapes (its compilation is not timed). Prompts reach it as
           space-separated token ids through a tokenizer that only parses them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import numpy as np

BATCH = 2048  # llama.cpp's n_batch: tokens per llama_decode (decode tokens + admitted prompts)


def run_llama_cpp(gguf: str, requests: list[dict], slots: int, threads: int) -> dict:
    import llama_cpp as L

    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    # No AMX repacking of the weights: ggml's AMX matmul segfaults in llama_decode on this
    # benchmark's hosts (KVM, Sapphire Rapids) for any batch of more than one token.
    mparams.use_extra_bufts = False
    model = L.llama_model_load_from_file(gguf.encode(), mparams)
    if not model:
        raise SystemExit(f"llama.cpp could not load {gguf}")
    if max(len(r["prompt"]) for r in requests) > BATCH - slots:
        raise SystemExit(
            f"llama-cpp: prompts must fit one batch beside the decode tokens "
            f"(<= {BATCH - slots} tokens)"
        )
    per_seq = max(len(r["prompt"]) + r["length"] for r in requests)
    per_seq = -(-per_seq // 256) * 256
    cparams = L.llama_context_default_params()
    cparams.n_ctx = per_seq * slots
    cparams.n_seq_max = slots
    cparams.n_batch = cparams.n_ubatch = BATCH
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        raise SystemExit("llama.cpp could not create a context")
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    memory = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(BATCH, 0, 1)

    def add(token: int, pos: int, seq: int, logits: bool) -> None:
        i = batch.n_tokens
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, int(logits)
        batch.n_tokens = i + 1

    queue = list(requests)
    free = list(range(slots))[::-1]
    running: dict[int, dict] = {}  # slot -> {req, out, pos}
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    while queue or running:
        batch.n_tokens = 0
        order: list[int] = []  # slots in the order of their logits rows
        for slot, s in running.items():  # one decode token each
            add(s["out"][-1], s["pos"], slot, True)
            s["pos"] += 1
            order.append(slot)
        while queue and free and batch.n_tokens + len(queue[0]["prompt"]) <= BATCH:
            req, slot = queue.pop(0), free.pop()
            L.llama_memory_seq_rm(memory, slot, -1, -1)
            for p, tok in enumerate(req["prompt"]):
                add(tok, p, slot, p == len(req["prompt"]) - 1)
            running[slot] = {"req": req, "out": [], "pos": len(req["prompt"])}
            order.append(slot)
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        ptr = L.llama_get_logits(ctx)
        logits = np.ctypeslib.as_array(ptr, shape=(len(order), vocab))
        best = logits.argmax(axis=1)
        for slot, tok in zip(order, best.tolist(), strict=True):
            s = running[slot]
            s["out"].append(int(tok))
            if len(s["out"]) == s["req"]["length"]:
                outputs[s["req"]["id"]] = s["out"]
                del running[slot]
                free.append(slot)
    seconds = time.perf_counter() - start
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return dict(
        tokens=sum(len(v) for v in outputs.values()),
        seconds=seconds,
        outputs=outputs,
        threads=threads,
        version=getattr(L, "__version__", "?"),
    )


class IdsTokenizer:
    """What Tunix's TokenizerAdapter asks of a tokenizer, over texts of space-separated ids."""

    def __init__(self, pad: int) -> None:
        self.pad = pad

    def encode(self, text: str, **_: object) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int], **_: object) -> str:
        return " ".join(str(int(t)) for t in ids)

    def bos_id(self) -> None:  # no BOS is prepended
        return None

    def eos_id(self) -> int:
        return -1  # never generated: every row runs its whole budget

    def pad_id(self) -> int:
        return self.pad


def tunix_model(weights: str):  # noqa: ANN201
    from flax import nnx
    from tunix.models.llama3 import model as llama3

    cfg = json.loads(Path(weights).with_suffix(".json").read_text())
    w = np.load(weights)
    config = llama3.ModelConfig(
        num_layers=cfg["num_layers"],
        vocab_size=cfg["vocab_size"],
        embed_dim=cfg["hidden_size"],
        hidden_dim=cfg["intermediate_size"],
        num_heads=cfg["num_heads"],
        head_dim=cfg["head_dim"],
        num_kv_heads=cfg["num_kv_heads"],
        rope_theta=int(cfg["rope_theta"]),
        norm_eps=cfg["rms_norm_eps"],
        weight_tying=True,
    )
    # Tunix 0.1.7's attention calls apply_rope without the config's rope_theta (its default,
    # 1e6, is used whatever the model): bind SmolLM2's base so that the model is SmolLM2.
    llama3.apply_rope = functools.partial(llama3.apply_rope, rope_theta=config.rope_theta)
    model = llama3.Llama3(config, rngs=nnx.Rngs(0))
    model.embedder.input_embedding.value = w["embed"]
    model.final_norm.w.value = w["final_norm.weight"]
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(layer.attn, name).w.value = w[p + "attn." + name]
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).kernel.value = w[p + "mlp." + name]
        layer.input_layernorm.w.value = w[p + "input_norm.weight"]
        layer.post_attention_layernorm.w.value = w[p + "post_attn_norm.weight"]
    return model, config


def run_tunix(weights: str, requests: list[dict], slots: int) -> dict:
    import jax
    from tunix.generate import sampler as sampler_lib

    model, config = tunix_model(weights)
    used = {t for r in requests for t in r["prompt"]}
    pad = next(t for t in range(config.vocab_size) if t not in used)
    longest_prompt = max(len(r["prompt"]) for r in requests)
    cache = 1 << (longest_prompt - 1).bit_length()  # Tunix pads prompts to a power of two
    cache += max(r["length"] for r in requests)
    sampler = sampler_lib.Sampler(
        transformer=model,
        tokenizer=IdsTokenizer(pad),
        cache_config=sampler_lib.CacheConfig(
            cache_size=cache,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
        ),
    )
    outputs: dict[str, list[int]] = {}
    seconds = 0.0
    for w in range(0, len(requests), slots):
        batch = requests[w : w + slots]
        texts = [" ".join(map(str, r["prompt"])) for r in batch]
        steps = max(r["length"] for r in batch)

        def call(texts=texts, steps=steps):  # noqa: ANN001, ANN202
            out = sampler(
                input_strings=texts, max_generation_steps=steps, temperature=0.0, eos_tokens=[-1]
            )
            return jax.block_until_ready(out.tokens)

        call()  # compiles
        start = time.perf_counter()
        tokens = call()
        seconds += time.perf_counter() - start
        for r, t in zip(batch, tokens, strict=True):
            outputs[r["id"]] = [int(x) for x in np.asarray(t)[: r["length"]]]
    return dict(
        tokens=sum(len(v) for v in outputs.values()),
        seconds=seconds,
        outputs=outputs,
        waves=-(-len(requests) // slots),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", choices=("llama-cpp", "tunix"))
    ap.add_argument("--gguf", help="llama-cpp: the model file")
    ap.add_argument("--weights", help="tunix: the exported weights (.npz next to its .json)")
    ap.add_argument("--requests", required=True)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    requests = json.loads(Path(args.requests).read_text())
    if args.engine == "llama-cpp":
        result = run_llama_cpp(args.gguf, requests, args.slots, args.threads)
    else:
        result = run_tunix(args.weights, requests, args.slots)
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
