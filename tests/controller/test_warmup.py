"""The demo's warm-up: a digit-splitting tokenizer and a supervised warm-up that learns,
is deterministic, and leaves the caller's model untouched."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlax_tpu import models
from rlax_tpu.controller.tasks import prompt_text
from rlax_tpu.controller.warmup import build_tokenizer, supervised_warmup
from rlax_tpu.data.procedural import procedural_problems

CFG = models.preset("tiny", num_layers=2)  # vocab 512


@pytest.fixture(scope="module")
def problems():
    return procedural_problems("train", k_max=12, templates=("add", "mul"))


@pytest.fixture(scope="module")
def tokenizer(problems):
    texts = [prompt_text(p, style="raw") + p.reference_solutions[0].code + "```" for p in problems]
    return build_tokenizer(texts, vocab_size=CFG.vocab_size)


def _examples(problems, tok):
    return [
        (
            tok.encode(prompt_text(p, style="raw")),
            tok.encode(p.reference_solutions[0].code + "```") + [tok.eos_id],
        )
        for p in problems
    ]


def _params(model):
    return jax.tree.leaves(jax.device_get(nnx.state(model)))


def test_tokenizer_splits_digits_and_round_trips(tokenizer):
    assert tokenizer.vocab_size <= CFG.vocab_size
    for text in ["Read an integer x. Print x + 1234.\n```python\n", "print(x * 58)\n```", "é 0"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode("print(x + 1234)")]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == ["1", "2", "3", "4"]
    assert tokenizer.eos_id is not None and tokenizer.eos_id in tokenizer.stop_ids


def test_warmup_learns_is_deterministic_and_leaves_the_input_alone(problems, tokenizer):
    examples = _examples(problems[:8], tokenizer)
    model = models.init_model(CFG, seed=0)
    before = _params(model)
    runs = []
    for _ in range(2):
        losses: list[float] = []
        trained = supervised_warmup(
            model,
            examples,
            steps=60,
            batch_size=8,
            learning_rate=3e-3,
            seed=1,
            on_step=lambda _, loss, losses=losses: losses.append(loss),
        )
        runs.append((trained, losses))
    (a, losses), (b, losses_b) = runs
    assert len(losses) == 60 and losses == losses_b
    assert losses[-1] < 0.1 * losses[0]
    for x, y in zip(_params(a), _params(b), strict=True):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(before, _params(model), strict=True):  # the caller's model is unchanged
        np.testing.assert_array_equal(x, y)
    # Greedy decoding reproduces a training completion.
    prompt, completion = examples[3]
    generated, _ = models.greedy_generate(
        a, prompt, max_new_tokens=len(completion) + 4, stop_ids=tokenizer.stop_ids
    )
    assert generated == completion


def test_warmup_rejects_bad_input(tokenizer):
    model = models.init_model(CFG, seed=0)
    with pytest.raises(ValueError, match="no examples"):
        supervised_warmup(model, [], steps=1, batch_size=1, learning_rate=1e-3, seed=0)
    with pytest.raises(ValueError, match="prompt and a completion"):
        supervised_warmup(model, [([1], [])], steps=1, batch_size=1, learning_rate=1e-3, seed=0)
    with pytest.raises(ValueError, match="must be >= 1"):
        supervised_warmup(model, [([1], [2])], steps=0, batch_size=1, learning_rate=1e-3, seed=0)


def _config(**controller):
    from rlax_tpu.config import RunConfig, base_config_dict, from_dict

    data = base_config_dict().to_dict()
    data["controller"].update(run_dir="unused", **controller)
    return from_dict(RunConfig, data)


def test_warmup_demonstrations_mix_in_wrong_programs_at_the_configured_rate():
    from rlax_tpu.controller.app import reference_text, warmup_demonstration, wrong_text

    problems = procedural_problems("train", k_max=60)
    clean = _config()
    assert all(
        warmup_demonstration(p, clean) == (reference_text(p, language="python"), False)
        for p in problems
    )
    noisy = _config(warmup_wrong_fraction=0.5, seed=3)
    picks = [warmup_demonstration(p, noisy) for p in problems]
    assert picks == [warmup_demonstration(p, noisy) for p in problems]  # seeded per problem id
    for p, (text, wrong) in zip(problems, picks, strict=True):
        expected = (
            wrong_text(p, language="python") if wrong else reference_text(p, language="python")
        )
        assert text == expected
        assert wrong == (text != reference_text(p, language="python"))
    n, k = len(problems), sum(w for _, w in picks)
    # Binomial(n, 0.5): 4 standard deviations either side (a false failure ~6e-5).
    assert abs(k - n / 2) <= 4 * (n * 0.25) ** 0.5, (k, n)
    other_seed = [
        warmup_demonstration(p, _config(warmup_wrong_fraction=0.5, seed=4))[1] for p in problems
    ]
    assert other_seed != [w for _, w in picks]


def test_warmup_of_a_bfloat16_model_trains_float32_masters(problems, tokenizer):
    """Steps of 1e-5 are far below a bf16 weight's rounding step (6e-5 at |w| = 0.02):
    updated in bf16 almost no weight would move; on float32 masters, cast back at the end,
    the loss falls and the weights come back in their storage dtype, moved."""
    cfg = models.preset("tiny", num_layers=2, param_dtype="bfloat16")
    model = models.init_model(cfg, seed=0)
    before = _params(model)
    losses: list[float] = []
    trained = supervised_warmup(
        model,
        _examples(problems[:8], tokenizer),
        steps=30,
        batch_size=8,
        learning_rate=1e-5,
        seed=1,
        on_step=lambda _, loss: losses.append(loss),
    )
    after = _params(trained)
    assert {x.dtype for x in after} == {np.dtype(jnp.bfloat16)}
    moved = np.mean(np.concatenate([(a != b).ravel() for a, b in zip(after, before, strict=True)]))
    assert moved > 0.8, moved  # 0.97 here; 0.15 with bf16 updates
    assert losses[-1] < losses[0]
