"""Generated tokens/s of two-turn episodes (code repair) vs single-turn generation, and what
keeping the first turn's KV pages saves.

    .venv/bin/python benchmarks/multi_turn.py                 # SmolLM2-135M, 8 problems x 4
    .venv/bin/python benchmarks/multi_turn.py --model tiny    # a smoke run

Workload: the first ``--problems`` functions problems (training split), chat prompts as the
smollm2 code preset renders them, G = ``--group`` samples each at T = 1, with the preset's engine
settings (``configs/codeforces.py:smollm2``). Every turn is ``--turn`` tokens long (``ignore_eos``,
so every configuration samples the same number of tokens), and the environment's reply is the
code_repair feedback for a failed assert, tokenized with the chat template's turn markers.
Measured in one run, on the same weights (f32), after a warm-up of every program:
  (a) single turn: one turn of 2 x ``--turn`` tokens per sample (the same tokens sampled as an
      episode's two turns);
  (b) two turns, the first turn's pages kept (``Request.keep_pages``): turn 2 computes only the
      reply and what follows;
  (c) two turns, recomputed: turn 2 feeds the prompt and turn 1 again first (what an engine
      without kept pages does; the prompt through the prefill program, the rest as decode rows).
Sampled tokens/s count the model's tokens only. (b) and (c) must give the same turn-2 tokens and
log-probs (bitwise where the engine promises it); the script checks it. The physical limit: the
model's matmul FLOP/s at (b)'s rate (2 x parameters per token) over a jitted ``jnp.dot``'s peak,
measured in the same run. Writes ``multi_turn.json`` next to this file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from common import dot_peak, smollm2_path
from flax import nnx

from rlax_tpu import models
from rlax_tpu.config import RunConfig, from_dict
from rlax_tpu.controller.tasks import prompt_text
from rlax_tpu.data.functions import load_functions
from rlax_tpu.environments import feedback
from rlax_tpu.inference.engine import Engine
from rlax_tpu.inference.sampler import SamplingParams
from rlax_tpu.inference.scheduler import Request
from rlax_tpu.types import Verdict, VerdictKind

HERE = Path(__file__).resolve().parent
FAILED = Verdict(
    kind=VerdictKind.WRONG_ANSWER,
    detail="failed: assert candidate([1, 2, 3]) == 6\ngot: None",
    tests_total=1,
)


def _engine(model: models.Transformer, cfg, eos: set[int]) -> Engine:
    return Engine(model, cfg, eos_ids=eos)


def _run(engine: Engine, requests: list[Request]) -> tuple[dict, float]:
    start = time.perf_counter()
    for r in requests:
        engine.submit(r)
    out = engine.run()
    return {(ro.prompt_id, ro.sample_index): ro for ro in out}, time.perf_counter() - start


def _first_turns(prompts, group: int, turn: int, *, keep: bool) -> list[Request]:
    return [
        Request(
            prompt_id=f"p{i}",
            prompt_tokens=tuple(p),
            num_samples=group,
            keep_pages=keep,
            sampling=SamplingParams(
                temperature=1.0, max_new_tokens=turn, ignore_eos=True, seed=100 + i
            ),
        )
        for i, p in enumerate(prompts)
    ]


def _second_turns(prompts, first: dict, tokenizer, turn: int) -> list[Request]:
    out = []
    for (key, s), ro in sorted(first.items()):
        said = ro.tokens.tolist()
        reply = tokenizer.turn_ids(feedback(FAILED), after=said)
        out.append(
            Request(
                prompt_id=f"{key}.{s}",
                prompt_tokens=tuple(prompts[int(key[1:])]),
                continuation=(*said, *reply),
                sampling=SamplingParams(
                    temperature=1.0,
                    max_new_tokens=turn,
                    ignore_eos=True,
                    seed=1000 + 10 * int(key[1:]) + s,
                ),
            )
        )
    return out


def measure(model, tokenizer, cfg, prompts, group: int, turn: int) -> dict:
    eos: set[int] = set()
    sampled_two = len(prompts) * group * 2 * turn
    # Warm-up: every program the runs below use, compiled once.
    warm = _engine(model, cfg, eos)
    first, _ = _run(warm, _first_turns(prompts[:1], group, turn, keep=True))
    _run(warm, _second_turns(prompts, first, tokenizer, turn))

    single = _engine(model, cfg, eos)
    _, t_single = _run(single, _first_turns(prompts, group, 2 * turn, keep=False))

    kept = _engine(model, cfg, eos)
    first, t1_kept = _run(kept, _first_turns(prompts, group, turn, keep=True))
    second_kept, t2_kept = _run(kept, _second_turns(prompts, first, tokenizer, turn))
    reused = kept.stats().prefix_tokens_reused

    again = _engine(model, cfg, eos)
    first_again, t1_again = _run(again, _first_turns(prompts, group, turn, keep=False))
    second_again, t2_again = _run(again, _second_turns(prompts, first_again, tokenizer, turn))

    same = all(
        np.array_equal(second_kept[k].tokens, second_again[k].tokens)
        and np.array_equal(second_kept[k].logprobs, second_again[k].logprobs)
        for k in second_kept
    )
    reply_tokens = sum(
        len(r.continuation) - turn for r in _second_turns(prompts, first, tokenizer, turn)
    )
    rate_kept = sampled_two / (t1_kept + t2_kept)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    peak = dot_peak()
    return dict(
        sequences=len(prompts) * group,
        prompt_tokens=int(sum(len(p) for p in prompts)),
        turn_tokens=turn,
        reply_tokens=int(reply_tokens),
        single_turn_s=t_single,
        single_turn_tok_s=sampled_two / t_single,
        kept_turn1_s=t1_kept,
        kept_turn2_s=t2_kept,
        kept_tok_s=rate_kept,
        recomputed_turn1_s=t1_again,
        recomputed_turn2_s=t2_again,
        recomputed_tok_s=sampled_two / (t1_again + t2_again),
        turn2_speedup=t2_again / t2_kept,
        positions_reused=int(reused),
        identical_turn2=bool(same),
        rows_bitwise=bool(kept.rows_bitwise),
        params=int(params),
        dot_peak_flops=peak,
        fraction_of_dot_peak=2 * params * rate_kept / peak,
        preemptions={
            "kept": kept.scheduler.num_preemptions,
            "recomputed": again.scheduler.num_preemptions,
        },
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--problems", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--turn", type=int, default=96)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from configs.codeforces import get_config

    config = from_dict(RunConfig, get_config("smollm2"))
    tokenizer = models.Tokenizer.from_gguf(smollm2_path())
    problems = load_functions()["train"][: args.problems]
    prompts = [
        tokenizer.encode(prompt_text(p, style="chat", tokenizer=tokenizer)) for p in problems
    ]
    if args.model == "tiny":
        model = models.init_model(
            dataclasses.replace(
                models.preset("tiny"), vocab_size=tokenizer.vocab_size, max_position_embeddings=2048
            )
        )
    else:
        model = models.load_gguf(smollm2_path())[1]
    cfg = dataclasses.replace(config.inference, max_concurrent_seqs=args.problems * args.group)
    result = measure(model, tokenizer, cfg, prompts, args.group, args.turn) | {
        "model": args.model,
        "command": f"benchmarks/multi_turn.py --model {args.model} --problems {args.problems} "
        f"--group {args.group} --turn {args.turn}",
    }
    if args.model == "smollm2":  # the tiny model's run is a smoke test, not a result
        (HERE / "multi_turn.json").write_text(json.dumps(result, indent=2))
    r = result
    print(
        f"| {r['sequences']} sequences, turns of {r['turn_tokens']} tokens | tokens/s |\n"
        f"|---|---:|\n"
        f"| single turn of {2 * r['turn_tokens']} | {r['single_turn_tok_s']:.1f} |\n"
        f"| two turns, pages kept | {r['kept_tok_s']:.1f} |\n"
        f"| two turns, recomputed | {r['recomputed_tok_s']:.1f} |\n\n"
        f"turn 2: {r['recomputed_turn2_s']:.1f} s recomputed vs {r['kept_turn2_s']:.1f} s kept "
        f"({r['turn2_speedup']:.2f}x); {r['positions_reused']} positions reused; identical "
        f"turn-2 samples: {r['identical_turn2']}; {r['fraction_of_dot_peak'] * 100:.1f}% of the "
        f"jnp.dot peak at the kept rate"
    )


if __name__ == "__main__":
    main()
