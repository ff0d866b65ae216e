"""Evaluation statistics both envs report: the mean with its 95% percentile-bootstrap interval, and a ratio of sums
paired over rows (prompts) with its interval."""

from __future__ import annotations

import numpy as np
from scipy.stats import bootstrap


def mean_ci(x: np.ndarray, seed: int = 0, n: int = 2000) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean of ``x`` (a point for fewer than 2 values)."""
    x = np.asarray(x, dtype=float)
    if len(x) < 2 or np.all(x == x[0]):
        return float(x.mean()), float(x.mean())
    res = bootstrap((x,), np.mean, confidence_level=0.95, n_resamples=n, method="percentile",
                    random_state=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def ratio_interval(num: np.ndarray, den: np.ndarray, resamples: int, seed: int = 0,
                   base: tuple[np.ndarray, np.ndarray] | None = None) -> dict:
    """sum(num) / sum(den) and its 95% percentile-bootstrap interval over the rows (prompts), paired; with ``base``
    ``(num, den)`` of the same rows, that ratio over ``base``'s (a speedup: tokens / ms over the baseline's)."""
    num, den = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    value = float(num.sum() / den.sum())
    if base is not None:
        base_num, base_den = np.asarray(base[0], dtype=float), np.asarray(base[1], dtype=float)
        value = float(value / (base_num.sum() / base_den.sum()))
    if resamples == 0 or len(num) < 2:
        return {"ratio": value, "interval": None}
    idx = np.random.default_rng(seed).integers(0, len(num), size=(resamples, len(num)))
    ratios = num[idx].sum(1) / den[idx].sum(1)
    if base is not None:
        ratios = ratios / (base_num[idx].sum(1) / base_den[idx].sum(1))
    return {"ratio": value, "interval": [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]}
