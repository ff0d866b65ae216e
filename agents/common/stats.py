"""Evaluation statistics both envs report: the mean with its 95% percentile-bootstrap interval."""

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
