"""The sampler against textbook definitions: draws follow softmax(z / T) (and only the top-k /
top-p survivors when filtered), greedy is the first argmax, forced tokens are kept, the two
log-probs are log_softmax's entries to f32 round-off, and a draw depends on its (seed, sample,
token) key alone, not on its row or the rest of the batch. Each sampler test runs both ways:
XLA's reductions and the native logit statistics (``native=True``, the CPU engine's default)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tpu.models import native_attention
from rlax_tpu.models.programs import idle_sampling
from rlax_tpu.models.sampling import first_max, inverse_cdf, sample, top_k_top_p

V = 7
LOGITS = np.array([1.0, 2.5, -1.0, 0.3, 2.5, -np.inf, 0.0], np.float32)
RUNS = {
    native: jax.jit(lambda z, s, native=native: sample(z, **s, native=native))
    for native in (False, True)
}
BOTH = pytest.mark.parametrize("native", [False, True], ids=["xla", "native"])


def _runner(native: bool):  # noqa: ANN202
    if native and not native_attention.available():
        pytest.skip("the native kernels cannot be built here (no C++ compiler)")
    return RUNS[native]


def _arrays(n: int, **fields) -> dict[str, jax.Array]:
    arrays = idle_sampling(n)
    for k, v in fields.items():
        arrays[k][:] = v
    return {k: jnp.asarray(v) for k, v in arrays.items()}


def _draws(temperature: float, n: int = 4000, native: bool = False, **fields) -> np.ndarray:
    """n draws of LOGITS, one per row, rows differing in token_index only."""
    s = _arrays(n, temperature=temperature, seeds=7, **fields)
    s["token_index"] = jnp.arange(n, dtype=jnp.int32)
    out = _runner(native)(jnp.broadcast_to(jnp.asarray(LOGITS), (n, V)), s)
    return np.asarray(out.tokens)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


@BOTH
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_draws_follow_the_softmax(temperature, native):
    tokens = _draws(temperature, native=native)
    freq = np.bincount(tokens, minlength=V) / len(tokens)
    p = _softmax(LOGITS.astype(np.float64) / temperature)
    # 5 binomial standard deviations; a zero-probability token is never drawn.
    np.testing.assert_array_less(np.abs(freq - p), 5 * np.sqrt(p * (1 - p) / len(tokens)) + 1e-9)
    assert freq[5] == 0


@BOTH
def test_filters_keep_only_their_survivors_and_renormalize(native):
    tokens = _draws(1.0, native=native, top_k=2)  # the tie at 2.5: exactly tokens 1 and 4
    assert set(np.unique(tokens)) == {1, 4}
    assert abs(np.mean(tokens == 1) - 0.5) < 5 * np.sqrt(0.25 / len(tokens))
    tokens = _draws(
        1.0, native=native, top_p=0.5
    )  # 1 and 4 hold 0.39 each: the first rank is not enough
    assert set(np.unique(tokens)) <= {1, 4}
    s = _arrays(1, top_k=3)
    narrowed = np.asarray(top_k_top_p(jnp.asarray(LOGITS)[None], s["top_k"], s["top_p"]))[0]
    assert (
        np.isinf(narrowed[[2, 3, 5, 6]]).all() and (narrowed[[0, 1, 4]] == LOGITS[[0, 1, 4]]).all()
    )


@BOTH
def test_log_probs_are_the_textbook_entries(native):
    run = _runner(native)
    n = 64
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((n, 1000)).astype(np.float32) * 4
    temps = rng.choice([0.0, 0.7, 1.0, 1.3], n).astype(np.float32)
    s = _arrays(n, seeds=3, top_k=np.where(np.arange(n) % 3 == 0, 50, 0))
    s["temperature"] = jnp.asarray(temps)
    s["token_index"] = jnp.arange(n, dtype=jnp.int32)
    out = run(jnp.asarray(logits), s)
    tokens = np.asarray(out.tokens)
    t = np.where(temps > 0, temps, 1.0)[:, None].astype(np.float64)
    scaled = logits.astype(np.float64) / t
    lse = np.log(np.exp(scaled - scaled.max(1, keepdims=True)).sum(1)) + scaled.max(1)
    want = scaled[np.arange(n), tokens] - lse
    np.testing.assert_allclose(np.asarray(out.logprob_temperature_scaled), want, atol=2e-5)
    greedy = temps == 0
    np.testing.assert_array_equal(tokens[greedy], logits[greedy].argmax(1))
    # top-k rows: the sampler's log-prob renormalizes over the 50 kept entries.
    kept = np.sort(scaled, axis=1)[:, -50:]
    lse_k = np.log(np.exp(kept - kept.max(1, keepdims=True)).sum(1)) + kept.max(1)
    rows = (np.arange(n) % 3 == 0) & ~greedy
    np.testing.assert_allclose(
        np.asarray(out.logprob_sampler)[rows],
        (scaled[np.arange(n), tokens] - lse_k)[rows],
        atol=2e-5,
    )
    assert (np.argsort(-scaled, 1)[rows, :50] == tokens[rows, None]).any(1).all()


@BOTH
def test_forced_tokens_and_the_key_alone_decide(native):
    run = _runner(native)
    n = 8
    logits = jnp.asarray(np.random.default_rng(2).standard_normal((n, 300)), jnp.float32)
    s = _arrays(n, seeds=11)
    s["sample_index"] = jnp.arange(n, dtype=jnp.int32)
    full = np.asarray(run(logits, s).tokens)
    # The same row's key and logits in another row, among other requests: the same token.
    perm = np.roll(np.arange(n), 3)
    moved = dict(s, sample_index=s["sample_index"][perm], seeds=s["seeds"].at[0].set(99))
    again = np.asarray(run(logits[perm], moved).tokens)
    np.testing.assert_array_equal(again[1:], full[perm][1:])
    forced = dict(s, forced=jnp.full(n, 5, jnp.int32))
    out = run(logits, forced)
    assert (np.asarray(out.tokens) == 5).all()
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))[:, 5]
    np.testing.assert_allclose(np.asarray(out.logprob_temperature_scaled), lp, atol=1e-6)


def test_inverse_cdf_edges_and_first_max():
    x = jnp.asarray([[-np.inf, 0.0, -np.inf, 0.0, -np.inf]] * 3, jnp.float32)
    top = jnp.zeros(3)
    u = jnp.asarray([0.0, 0.49, np.nextafter(np.float32(1), np.float32(0))], jnp.float32)
    np.testing.assert_array_equal(np.asarray(inverse_cdf(x, top, u)), [1, 1, 3])
    # Across the first-level blocks (the vocabulary is padded to a whole block).
    wide = np.full((2, 1500), -np.inf, np.float32)
    wide[:, [3, 700, 1499]] = 0.0
    got = inverse_cdf(jnp.asarray(wide), jnp.zeros(2), jnp.asarray([0.5, 0.9], jnp.float32))
    np.testing.assert_array_equal(np.asarray(got), [700, 1499])
    z = jnp.asarray([[1.0, 3.0, 3.0, 0.0], [np.nan, 1.0, 2.0, 2.0]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(first_max(z, jnp.max(z, axis=-1))), [1, 0])


def test_native_logit_stats_are_the_textbook_ones_edges_included():
    """Max, log-normalizer and first argmax of z / t per row against numpy (f64 sums), on rows
    of ties, -inf entries, +inf, NaN, and a vocabulary that is no multiple of the kernel's
    16-lane or 512-entry blocks; and a row's bits do not depend on the other rows."""
    if not native_attention.available():
        pytest.skip("the native kernels cannot be built here (no C++ compiler)")
    rng = np.random.default_rng(5)
    v = 1000 + 37
    z = (rng.standard_normal((7, v)) * 5).astype(np.float32)
    z[1, [10, 900]] = 40.0  # a tie: the first index wins
    z[2, ::3] = -np.inf
    z[3, 1030] = 60.0  # the max in the tail past the last whole 16-lane group
    z[4, 77] = np.inf
    z[5, 5] = np.nan
    t = np.array([1.0, 1.0, 0.7, 1.3, 1.0, 1.0, 2.0], np.float32)
    stats = jax.jit(native_attention.logit_stats)
    top, log_sum, best = (np.asarray(a) for a in stats(jnp.asarray(z), jnp.asarray(t)))
    y = z / t[:, None]  # numpy's division is IEEE, as the kernel's
    finite = [0, 1, 2, 3, 6]
    np.testing.assert_array_equal(top[finite], y[finite].max(1))
    np.testing.assert_array_equal(best[finite], y[finite].argmax(1))
    assert best[1] == 10 and best[3] == 1030
    want = np.log(np.exp(y[finite].astype(np.float64) - y[finite].max(1, keepdims=True)).sum(1))
    np.testing.assert_allclose(log_sum[finite], want, rtol=2e-6, atol=1e-6)
    # Not finite: top 0, the first entry equal to 0 (none: 0), sums of inf / NaN.
    assert top[4] == 0 and top[5] == 0 and log_sum[4] == np.inf and np.isnan(log_sum[5])
    assert best[4] == 0 and best[5] == 0
    alone = [np.asarray(a) for a in stats(jnp.asarray(z[3:4]), jnp.asarray(t[3:4]))]
    shuffled = [
        np.asarray(a) for a in stats(jnp.asarray(z[::-1]), jnp.asarray(t[::-1]))
    ]  # row 3 stays
    for a, b, c in zip(alone, (top, log_sum, best), shuffled, strict=True):
        assert a[0] == b[3] == c[3]  # bitwise: one fixed order per row
