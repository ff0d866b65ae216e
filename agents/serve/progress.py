"""One progress line for a whole serving evaluation: every episode any policy runs advances it.

    with counting(PhaseBar("evaluation", "episode", say, every_s=30, total=planned)):
        returns, speedups, eps = episodes(env, policy, seeds)   # returns_of, counted
        advance(len(envs) * len(seeds))                          # episodes run elsewhere (choose_batch_table)

The bar is this context's (a ``contextvars.ContextVar``, set by ``counting`` and reset when it ends), so the many
small functions of an evaluation count their episodes without a bar handed through each of them; outside
``counting`` nothing is counted.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import numpy as np

from agents.serve.rules import returns_of

_BAR: contextvars.ContextVar = contextvars.ContextVar("evaluation_bar", default=None)


@contextlib.contextmanager
def counting(bar) -> Iterator:
    """Count every episode run inside the block on ``bar`` (a ``agents.common.phases.PhaseBar`` or any tqdm-like bar)."""
    token = _BAR.set(bar)
    try:
        yield bar
    finally:
        _BAR.reset(token)


def advance(n: int) -> None:
    """``n`` episodes done (nothing outside ``counting``)."""
    bar = _BAR.get()
    if bar is not None and n:
        bar.update(n)


def episodes(env, policy, seeds):
    """``returns_of(env, policy, seeds)`` (the same episodes in the same order), each counted as it ends."""
    returns, speedups, eps = [], [], []
    for seed in seeds:
        r, s, e = returns_of(env, policy, [seed])
        returns.append(r)
        speedups.append(s)
        eps += e
        advance(1)
    return np.concatenate(returns), np.concatenate(speedups), eps
