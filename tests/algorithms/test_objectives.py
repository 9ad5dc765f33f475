"""For each algorithm, the gradient of our Eq.-3 form equals the gradient of a textbook loss.

The textbook losses below are written from the papers, one sequence at a time on unpadded
slices, with their own advantage code (numpy loops); they share nothing with the package but
the batch they read. Batches are float64, ragged, with NaN / -inf padding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tpu.algorithms import make_objective
from rlax_tpu.config import AlgorithmConfig

G, T = 4, 7
TOL = 1e-6


# ------------------------------------------------------------------------------------------
# Textbook advantages (numpy, loops).


def group_norm_adv(r):
    out = np.empty_like(r)
    for s in range(0, len(r), G):
        grp = r[s : s + G]
        out[s : s + G] = (grp - grp.mean()) / (np.std(grp, ddof=1) + 1e-6)
    return out


def group_center_adv(r):
    out = np.empty_like(r)
    for s in range(0, len(r), G):
        out[s : s + G] = r[s : s + G] - r[s : s + G].mean()
    return out


def loo_adv(r):
    out = np.empty_like(r)
    for i in range(len(r)):
        s = i - i % G
        others = [r[j] for j in range(s, s + G) if j != i]
        out[i] = r[i] - sum(others) / len(others)
    return out


def ppo_surrogate(lp, old, adv, eps_low, eps_high):
    ratio = jnp.exp(lp - old)
    return jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - eps_low, 1 + eps_high) * adv)


def seqs(batch, lengths, logp, i):
    n = lengths[i]
    return (
        logp[i, :n],
        jnp.asarray(batch.logp_old[i, :n]),
        jnp.asarray(batch.logp_behaviour[i, :n]),
        jnp.asarray(batch.logp_ref[i, :n]),
    )


# ------------------------------------------------------------------------------------------
# Textbook objectives, as losses (−J). Each returns a function of the padded logp.


def grpo_textbook(batch, lengths, *, beta, kl="k3", eps=0.2, correction=None):
    """DeepSeekMath Eq. 3: 1/G Σ_i 1/|o_i| Σ_t [min(ρA, clip(ρ)A) − β D_KL], mean over groups."""
    adv = group_norm_adv(batch.rewards)

    def loss(logp):
        total = 0.0
        for i in range(len(lengths)):
            lp, old, mu, ref = seqs(batch, lengths, logp, i)
            surr = ppo_surrogate(lp, old, adv[i], eps, eps)
            if correction is not None:
                surr = surr * correction(old, mu)
            log_r = ref - lp
            d_kl = {"k3": jnp.exp(log_r) - log_r - 1, "k2": 0.5 * log_r**2, "k1": -log_r}[kl]
            total = total + jnp.mean(surr - beta * d_kl)
        return -total / len(lengths)

    return loss


def dapo_textbook(batch, lengths, correction=None):
    """DAPO Eq. 8: token-level mean of min(ρA, clip(ρ, 1−0.2, 1+0.28)A) over all tokens."""
    adv = group_norm_adv(batch.rewards)

    def loss(logp):
        total = 0.0
        for i in range(len(lengths)):
            lp, old, mu, _ = seqs(batch, lengths, logp, i)
            surr = ppo_surrogate(lp, old, adv[i], 0.2, 0.28)
            if correction is not None:
                surr = surr * correction(old, mu)
            total = total + jnp.sum(surr)
        return -total / lengths.sum()

    return loss


def dr_grpo_textbook(batch, lengths):
    """Dr.GRPO: Σ_i Σ_t min(ρA, clip(ρ)A) / (B·L_max) with A = r − mean."""
    adv = group_center_adv(batch.rewards)

    def loss(logp):
        total = 0.0
        for i in range(len(lengths)):
            lp, old, _, _ = seqs(batch, lengths, logp, i)
            total = total + jnp.sum(ppo_surrogate(lp, old, adv[i], 0.2, 0.2))
        return -total / (len(lengths) * T)

    return loss


def gspo_textbook(batch, lengths):
    """GSPO: 1/G Σ_i min(s_i A_i, clip(s_i, 1−3e-4, 1+4e-4) A_i), s_i = exp(mean_t log ρ)."""
    adv = group_norm_adv(batch.rewards)

    def loss(logp):
        total = 0.0
        for i in range(len(lengths)):
            lp, old, _, _ = seqs(batch, lengths, logp, i)
            s = jnp.exp(jnp.mean(lp - old))
            total = total + jnp.minimum(s * adv[i], jnp.clip(s, 1 - 3e-4, 1 + 4e-4) * adv[i])
        return -total / len(lengths)

    return loss


def cispo_textbook(batch, lengths):
    """MiniMax-M1 Eq. 4: Σ sg(clip(ρ, −, 1+0.28)) A log π / Σ|o_i| (no lower bound)."""
    adv = group_norm_adv(batch.rewards)

    def loss(logp):
        total = 0.0
        for i in range(len(lengths)):
            lp, old, _, _ = seqs(batch, lengths, logp, i)
            w = jax.lax.stop_gradient(jnp.minimum(jnp.exp(lp - old), 1.28))
            total = total + jnp.sum(w * adv[i] * lp)
        return -total / lengths.sum()

    return loss


def reinforce_textbook(batch, lengths, adv):
    """RLAX Eq. 9 (token-level REINFORCE): 1/(G·L_max) Σ_i A_i Σ_t log π(o_{i,t})."""

    def loss(logp):
        total = 0.0
        for i in range(len(lengths)):
            total = total + adv[i] * jnp.sum(logp[i, : lengths[i]])
        return -total / (len(lengths) * T)

    return loss


def reinforce_pp_textbook(batch, lengths, coef=0.01):
    """REINFORCE++ Eqs. 11-12: r_t = −β·(log π_old − log π_ref)_t (+ r at EOS), A_t = Σ_{s≥t} r_s,
    normalized over the batch's tokens; PPO clip 0.2, token mean."""
    returns = []
    for i, n in enumerate(lengths):
        r_t = [-coef * (batch.logp_old[i, t] - batch.logp_ref[i, t]) for t in range(n)]
        r_t[-1] += batch.rewards[i]
        returns.append([sum(r_t[t:]) for t in range(n)])
    flat = np.concatenate(returns)
    adv = [(np.array(g) - flat.mean()) / (flat.std() + 1e-8) for g in returns]

    def loss(logp):
        total = 0.0
        for i in range(len(lengths)):
            lp, old, _, _ = seqs(batch, lengths, logp, i)
            total = total + jnp.sum(ppo_surrogate(lp, old, jnp.asarray(adv[i]), 0.2, 0.2))
        return -total / lengths.sum()

    return loss


def ppo_textbook(batch, lengths, coef=0.05, gamma=1.0, lam=0.95):
    """PPO (Schulman 2017) as in TRL PPOv2: per-token KL reward, GAE, whitened advantages,
    clipped surrogate and clipped value loss (weight 0.1), token means."""
    advs, rets = [], []
    for i, n in enumerate(lengths):
        r_t = [-coef * (batch.logp_old[i, t] - batch.logp_ref[i, t]) for t in range(n)]
        r_t[-1] += batch.rewards[i]
        v = list(batch.values[i, :n]) + [0.0]
        a, last = [0.0] * n, 0.0
        for t in reversed(range(n)):
            last = r_t[t] + gamma * v[t + 1] - v[t] + gamma * lam * last
            a[t] = last
        advs.append(np.array(a))
        rets.append(np.array(a) + batch.values[i, :n])
    flat = np.concatenate(advs)
    advs = [(a - flat.mean()) / (flat.std() + 1e-8) for a in advs]

    def loss(logp, values):
        pg, vf = 0.0, 0.0
        for i, n in enumerate(lengths):
            lp, old, _, _ = seqs(batch, lengths, logp, i)
            pg = pg + jnp.sum(ppo_surrogate(lp, old, jnp.asarray(advs[i]), 0.2, 0.2))
            v, v_old = values[i, :n], batch.values[i, :n]
            v_clip = v_old + jnp.clip(v - v_old, -0.2, 0.2)
            vf = vf + jnp.sum(jnp.maximum((v - rets[i]) ** 2, (v_clip - rets[i]) ** 2))
        n_tok = lengths.sum()
        return -pg / n_tok + 0.1 * 0.5 * vf / n_tok

    return loss


def aipo_textbook(batch, lengths, cap):
    """LlamaRL: gradient Σ_t min(π/μ, ρ) A ∇log π, A = r − group mean. Written as a loss whose
    gradient is that: A·π/μ below the cap (∇(π/μ) = π/μ·∇log π), A·ρ·log π above it."""
    adv = group_center_adv(batch.rewards)

    def loss(logp):
        total = 0.0
        for i in range(len(lengths)):
            lp, _, mu, _ = seqs(batch, lengths, logp, i)
            w = jnp.exp(lp - mu)
            below = jax.lax.stop_gradient(w) < cap
            total = total + jnp.sum(adv[i] * jnp.where(below, w, cap * lp))
        return -total / (len(lengths) * T)

    return loss


def tb_textbook(batch, lengths, beta):
    """TBA Eq. 5 as VarGrad: per prompt, the population variance over its G samples of
    log π_θ(y) − log π_ref(y) − r/β (sequence sums), averaged over prompts."""

    def loss(logp):
        total = 0.0
        for s in range(0, len(lengths), G):
            d = []
            for i in range(s, s + G):
                lp, _, _, ref = seqs(batch, lengths, logp, i)
                d.append(jnp.sum(lp) - jnp.sum(ref) - batch.rewards[i] / beta)
            d = jnp.stack(d)
            total = total + jnp.mean((d - d.mean()) ** 2)
        return total / (len(lengths) // G)

    return loss


def dpo_textbook(batch, lengths, beta=0.1):
    """Online DPO on (best, worst) of each group: −log σ(β[(S_θ − S_ref)(y_w) − (S_θ − S_ref)(y_l)])."""

    def loss(logp):
        losses = []
        for s in range(0, len(lengths), G):
            r = list(batch.rewards[s : s + G])
            if max(r) == min(r):
                continue
            win, lose = s + r.index(max(r)), s + r.index(min(r))
            lw, _, _, rw = seqs(batch, lengths, logp, win)
            ll, _, _, rl = seqs(batch, lengths, logp, lose)
            h = beta * ((jnp.sum(lw) - jnp.sum(rw)) - (jnp.sum(ll) - jnp.sum(rl)))
            losses.append(-jnp.log(1 / (1 + jnp.exp(-h))))
        return sum(losses) / len(losses)

    return loss


def batch_scaled_adv(r):
    """TRL scale_rewards="batch" / PPO Lite: (r − group mean) / (std of all rewards + eps)."""
    return group_center_adv(r) / (np.std(r, ddof=1) + 1e-6)


def grpo_batch_scaled_textbook(batch, lengths):
    adv = batch_scaled_adv(batch.rewards)

    def loss(logp):
        total = 0.0
        for i in range(len(lengths)):
            lp, old, _, _ = seqs(batch, lengths, logp, i)
            total = total + jnp.mean(ppo_surrogate(lp, old, adv[i], 0.2, 0.2))
        return -total / len(lengths)

    return loss


def grpo_kl_is_textbook(batch, lengths, beta=0.04):
    """GRPO with the KL estimated under π_old's samples: ρ·k3, ρ = π_θ/π_old (differentiated)."""
    adv = group_norm_adv(batch.rewards)

    def loss(logp):
        total = 0.0
        for i in range(len(lengths)):
            lp, old, _, ref = seqs(batch, lengths, logp, i)
            log_r = ref - lp
            k3 = jnp.exp(log_r) - log_r - 1
            total = total + jnp.mean(
                ppo_surrogate(lp, old, adv[i], 0.2, 0.2) - beta * jnp.exp(lp - old) * k3
            )
        return -total / len(lengths)

    return loss


def dapo_delta_textbook(batch, lengths, delta):
    """INTELLECT-2's two-sided clip: min(min(ρ, δ)·A, clip(ρ, 1−0.2, 1+0.28)·A), token mean."""
    adv = group_norm_adv(batch.rewards)

    def loss(logp):
        total = 0.0
        for i in range(len(lengths)):
            lp, old, _, _ = seqs(batch, lengths, logp, i)
            rho = jnp.exp(lp - old)
            total = total + jnp.sum(
                jnp.minimum(jnp.minimum(rho, delta) * adv[i], jnp.clip(rho, 0.8, 1.28) * adv[i])
            )
        return -total / lengths.sum()

    return loss


def sapo_textbook(batch, lengths, tau_pos=1.0, tau_neg=1.05):
    """SAPO: 1/G Σ_i 1/|o_i| Σ_t f(ρ_{i,t}) A_i, f(ρ) = 4/τ · sigmoid(τ(ρ − 1)), τ by sign of A."""
    adv = group_norm_adv(batch.rewards)

    def loss(logp):
        total = 0.0
        for i in range(len(lengths)):
            lp, old, _, _ = seqs(batch, lengths, logp, i)
            tau = tau_pos if adv[i] > 0 else tau_neg
            f = 4.0 / tau / (1.0 + jnp.exp(-tau * (jnp.exp(lp - old) - 1.0)))
            total = total + jnp.mean(f * adv[i])
        return -total / len(lengths)

    return loss


def luspo_textbook(batch, lengths):
    """LUSPO: GSPO's clipped sequence term scaled by the sequence's length, mean over sequences."""
    adv = group_norm_adv(batch.rewards)

    def loss(logp):
        total = 0.0
        for i in range(len(lengths)):
            lp, old, _, _ = seqs(batch, lengths, logp, i)
            s = jnp.exp(jnp.mean(lp - old))
            term = jnp.minimum(s * adv[i], jnp.clip(s, 1 - 3e-4, 1 + 4e-4) * adv[i])
            total = total + lengths[i] * term
        return -total / len(lengths)

    return loss


def vespo_textbook(batch, lengths, k=(2.0, 3.0), lam=(3.0, 2.0)):
    """VESPO: Σ_i Σ_t sg(φ(w_i)) A_i log π / Σ|o_i|, φ(w) = e^λ w^k e^(−λw), w = Π_t π_θ/π_old."""
    adv = group_norm_adv(batch.rewards)

    def loss(logp):
        total = 0.0
        for i in range(len(lengths)):
            lp, old, _, _ = seqs(batch, lengths, logp, i)
            kk, ll = (k[0], lam[0]) if adv[i] >= 0 else (k[1], lam[1])
            w = jax.lax.stop_gradient(jnp.prod(jnp.exp(lp - old)))
            phi = jnp.exp(ll) * w**kk * jnp.exp(-ll * w)
            total = total + jnp.sum(phi * adv[i] * lp)
        return -total / lengths.sum()

    return loss


def token_truncate(cap):
    return lambda old, mu: jnp.minimum(jnp.exp(old - mu), cap)


def token_mask(cap, floor=0.0):
    def c(old, mu):
        w = jnp.exp(old - mu)
        return jnp.where((w >= floor) & (w <= cap), w, 0.0)

    return c


def seq_mask(cap, floor=0.0):
    def c(old, mu):
        w = jnp.exp(jnp.mean(old - mu))  # length-normalized: the geometric mean of π_old/μ
        return jnp.where((w >= floor) & (w <= cap), w, 0.0)

    return c


# (id, config overrides, textbook factory, logp spread, expect some clipping)
CASES = [
    (
        "grpo_k3",
        dict(name="grpo", kl_estimator="k3"),
        lambda b, n: grpo_textbook(b, n, beta=0.04),
        0.3,
        True,
    ),
    (
        "grpo_k2",
        dict(name="grpo", kl_estimator="k2", kl_coef=0.1),
        lambda b, n: grpo_textbook(b, n, beta=0.1, kl="k2"),
        0.3,
        True,
    ),
    (
        "grpo_k1_seq_mask",
        dict(name="grpo", kl_estimator="k1", behaviour_correction="seq_mask", behaviour_cap=1.5),
        lambda b, n: grpo_textbook(b, n, beta=0.04, kl="k1", correction=seq_mask(1.5)),
        0.3,
        True,
    ),
    (
        "grpo_k1_seq_band",
        dict(
            name="grpo",
            kl_estimator="k1",
            behaviour_correction="seq_mask",
            behaviour_cap=1.1,
            behaviour_floor=0.95,
        ),
        lambda b, n: grpo_textbook(b, n, beta=0.04, kl="k1", correction=seq_mask(1.1, 0.95)),
        0.3,
        True,
    ),
    (
        "dapo_token_band",
        dict(
            name="dapo", behaviour_correction="token_mask", behaviour_cap=1.25, behaviour_floor=0.8
        ),
        lambda b, n: dapo_textbook(b, n, correction=token_mask(1.25, 0.8)),
        0.3,
        True,
    ),
    # kl_estimator 'default' is DeepSeekMath's: k3 with β = 0.04; 'none' turns it off.
    ("grpo_default", dict(name="grpo"), lambda b, n: grpo_textbook(b, n, beta=0.04), 0.3, True),
    (
        "grpo_no_kl",
        dict(name="grpo", kl_estimator="none"),
        lambda b, n: grpo_textbook(b, n, beta=0.0),
        0.3,
        True,
    ),
    ("dapo", dict(name="dapo"), dapo_textbook, 0.3, True),
    (
        "dapo_token_truncate",
        dict(name="dapo", behaviour_correction="token_truncate", behaviour_cap=1.1),
        lambda b, n: dapo_textbook(b, n, token_truncate(1.1)),
        0.3,
        True,
    ),
    ("dr_grpo", dict(name="dr_grpo"), dr_grpo_textbook, 0.3, True),
    ("gspo", dict(name="gspo"), gspo_textbook, 1e-3, True),
    ("cispo", dict(name="cispo"), cispo_textbook, 0.3, True),
    (
        "reinforce",
        dict(name="reinforce"),
        lambda b, n: reinforce_textbook(b, n, b.rewards),
        0.3,
        False,
    ),
    (
        "rloo",
        dict(name="rloo"),
        lambda b, n: reinforce_textbook(b, n, loo_adv(b.rewards)),
        0.3,
        False,
    ),
    ("reinforce_pp", dict(name="reinforce_pp"), reinforce_pp_textbook, 0.3, True),
    ("aipo", dict(name="aipo"), lambda b, n: aipo_textbook(b, n, 5.0), 0.3, False),
    ("aipo_cap", dict(name="aipo", is_cap=1.2), lambda b, n: aipo_textbook(b, n, 1.2), 0.3, True),
    (
        "grpo_batch_scaled",
        dict(name="grpo", kl_estimator="none", reward_scaling="batch"),
        grpo_batch_scaled_textbook,
        0.3,
        True,
    ),
    (
        "grpo_kl_bias_corrected",
        dict(name="grpo", kl_bias_correction=True),
        grpo_kl_is_textbook,
        0.3,
        True,
    ),
    (
        "dapo_delta",
        dict(name="dapo", delta=1.2),
        lambda b, n: dapo_delta_textbook(b, n, 1.2),
        0.3,
        True,
    ),
    ("sapo", dict(name="sapo"), sapo_textbook, 0.3, False),
    (
        "sapo_tau",
        dict(name="sapo", sapo_tau_pos=2.0, sapo_tau_neg=0.5),
        lambda b, n: sapo_textbook(b, n, 2.0, 0.5),
        0.3,
        False,
    ),
    ("luspo", dict(name="luspo"), luspo_textbook, 1e-3, True),
    ("vespo", dict(name="vespo"), vespo_textbook, 0.1, False),
    (
        "vespo_k",
        dict(name="vespo", vespo_k_pos=1.0, vespo_lambda_neg=4.0),
        lambda b, n: vespo_textbook(b, n, (1.0, 3.0), (3.0, 4.0)),
        0.1,
        False,
    ),
    ("tb", dict(name="tb"), lambda b, n: tb_textbook(b, n, 0.012), 0.3, False),
    ("online_dpo", dict(name="online_dpo"), dpo_textbook, 0.3, False),
]


def _objective(overrides):
    return make_objective(AlgorithmConfig(group_size=G, **overrides), max_length=T)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gradient_matches_textbook(case, seed, x64, make_batch):
    _, overrides, textbook, spread, expect_clip = case
    batch, logp, lengths = make_batch(seed, group_size=G, length=T, spread=spread)
    if overrides["name"] == "online_dpo":  # one group without a preference
        rewards = batch.rewards.copy()
        rewards[G : 2 * G] = 0.5
        batch = dataclasses.replace(batch, rewards=rewards)
    obj = _objective(overrides)
    obj.validate(batch)
    inputs = obj.prepare(batch)
    logp = jnp.asarray(logp)

    ours, metrics = jax.grad(lambda lp: obj.loss(lp, inputs), has_aux=True)(logp)
    theirs = jax.grad(textbook(batch, lengths))(logp)

    assert ours.dtype == jnp.float64
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)
    assert np.abs(theirs).max() > 1e-3  # not vacuous
    if expect_clip:
        assert 0 < metrics["clip_fraction"] < 1
    if overrides.get("behaviour_floor"):  # the band's lower edge drops some tokens, not all
        one_sided = _objective({**overrides, "behaviour_floor": 0.0}).prepare(batch)
        real = np.asarray(batch.mask) > 0
        w, w1 = (
            np.asarray(inputs.behaviour_weight)[real],
            np.asarray(one_sided.behaviour_weight)[real],
        )
        assert (w == 0).sum() > (w1 == 0).sum() and (w > 0).any()


# AIPO's textbook is written for its gradient (a stop-gradient switch), not its value.
VALUE_CASES = [c for c in CASES if not c[0].startswith("aipo")]


@pytest.mark.parametrize("case", VALUE_CASES, ids=[c[0] for c in VALUE_CASES])
def test_logged_objective_is_the_textbook_value(case, x64, make_batch):
    # The loss is a gradient-equivalent surrogate; metrics["objective"] is the objective's own
    # value (the clipped min, SAPO's gate, ...), as the textbook (and TRL) computes it.
    _, overrides, textbook, spread, _ = case
    batch, logp, lengths = make_batch(0, group_size=G, length=T, spread=spread)
    if overrides["name"] == "online_dpo":
        rewards = batch.rewards.copy()
        rewards[G : 2 * G] = 0.5
        batch = dataclasses.replace(batch, rewards=rewards)
    obj = _objective(overrides)
    _, metrics = obj.loss(jnp.asarray(logp), obj.prepare(batch))
    np.testing.assert_allclose(
        metrics["objective"], textbook(batch, lengths)(jnp.asarray(logp)), atol=1e-9, rtol=1e-9
    )


def test_ppo_policy_and_value_gradients_match_textbook(x64, make_batch):
    batch, logp, lengths = make_batch(3, group_size=G, length=T, spread=0.3)
    shift = 0.4 * np.random.default_rng(3).normal(size=batch.values.shape)
    values = jnp.asarray(np.where(batch.mask > 0, batch.values + shift, np.nan))
    obj = _objective(dict(name="ppo"))
    obj.validate(batch)
    inputs = obj.prepare(batch)

    def ours_fn(lp, v):
        return obj.loss(lp, inputs, values=v)[0]

    ours = jax.grad(ours_fn, argnums=(0, 1))(jnp.asarray(logp), values)
    theirs = jax.grad(ppo_textbook(batch, lengths), argnums=(0, 1))(jnp.asarray(logp), values)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=0)
    # Both clipped and unclipped value updates occur.
    real_shift = np.abs(shift[batch.mask > 0])
    assert real_shift.max() > 0.2 > real_shift.min()


def test_loss_is_jit_compatible_and_matches_eager(x64, make_batch):
    batch, logp, _ = make_batch(4, group_size=G, length=T)
    for name in ("grpo", "gspo", "ppo", "tb", "online_dpo"):
        obj = _objective(dict(name=name))
        values = jnp.asarray(np.nan_to_num(batch.values))

        def f(lp, b, obj=obj, values=values):
            return obj.loss(lp, obj.prepare(b), values=values)

        eager = jax.grad(lambda lp, f=f: f(lp, batch)[0])(jnp.asarray(logp))
        jitted = jax.jit(jax.grad(lambda lp, b, f=f: f(lp, b)[0]))(jnp.asarray(logp), batch)
        np.testing.assert_allclose(jitted, eager, atol=1e-12)


def test_micro_batches_sum_to_full_batch(x64, make_batch):
    """prepare normalizes over the full batch, so row-sliced losses add up (Eq.-3 objectives)."""
    batch, logp, _ = make_batch(5, group_size=G, length=T)
    obj = _objective(dict(name="dapo"))
    inputs = obj.prepare(batch)
    full = obj.loss(jnp.asarray(logp), inputs)[0]
    halves = [
        obj.loss(
            jnp.asarray(logp[s]), jax.tree.map(lambda x, s=s: x if x.ndim == 0 else x[s], inputs)
        )[0]
        for s in (slice(0, 5), slice(5, None))
    ]
    np.testing.assert_allclose(sum(halves), full, atol=1e-12)
