"""pass@k with the unbiased estimator (Chen et al. 2021) and its mean over problems."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n, of which c are correct, passes).

    Equals 1 - C(n-c, k) / C(n, k), computed as a product to stay exact for large n.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(correct_counts: Sequence[int], n: int, k: int) -> float:
    """Mean pass@k over problems, each sampled ``n`` times with ``correct_counts[i]`` passing."""
    if not correct_counts:
        raise ValueError("no problems to evaluate")
    return float(np.mean([pass_at_k(n, c, k) for c in correct_counts]))
