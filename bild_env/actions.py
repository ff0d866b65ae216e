"""What an action means in both environments: a threshold pair of a grid, a point of its span, or speculation off.

``thresholds(action, ...)`` maps a grid index (``fallback_values[a // n], rollback_values[a % n]``, with
``n = len(rollback_values)``; the index after the grid is speculation off when ``off_switch``) or a
continuous action in [-1, 1] (fallback linear and rollback log-scale over the grids' spans; a third
number > 0 is speculation off when ``off_switch``) to ``(fallback, rollback)``, or None for off.
``check_grids`` refuses grids the envs cannot use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from bild_env.decoding.bild import check_thresholds
from bild_env.decoding.tree import parse_tree_rule


def thresholds(action, fallback_values: Sequence[float], rollback_values: Sequence[float], continuous: bool,
               off_switch: bool) -> tuple[float, float] | None:
    """(fallback probability, rollback nats) of ``action``, or None for speculation off (module docstring)."""
    if continuous:
        raw = np.clip(np.asarray(action, dtype=np.float64).reshape(-1), -1.0, 1.0)
        if off_switch and raw[2] > 0:
            return None
        x = (raw[:2] + 1.0) / 2.0
        f_lo, f_hi = min(fallback_values), max(fallback_values)
        r_lo, r_hi = math.log(min(rollback_values)), math.log(max(rollback_values))
        return float(f_lo + x[0] * (f_hi - f_lo)), float(math.exp(r_lo + x[1] * (r_hi - r_lo)))
    n = len(rollback_values)
    if action >= len(fallback_values) * n:
        return None
    return fallback_values[action // n], rollback_values[action % n]


def check_grids(fallback_values: Sequence[float], rollback_values: Sequence[float], action: str) -> None:
    """ValueError for empty grids, invalid thresholds, or a rollback grid a log scale (continuous) cannot span."""
    if not fallback_values or not rollback_values:
        raise ValueError("fallback_values and rollback_values must each hold at least one threshold")
    for f in fallback_values:
        for r in rollback_values:
            check_thresholds(f, r)
    if not all(math.isfinite(r) for r in rollback_values) or max(rollback_values) <= 0:
        raise ValueError("rollback_values must be finite and not all 0 (the observation divides by their max)")
    if action == "continuous" and min(rollback_values) <= 0:
        raise ValueError("action='continuous' maps rollback on a log scale: rollback_values must all be above 0, "
                         f"got {tuple(rollback_values)}")


class TreeActions:
    """``tree_rule`` and ``tree_action`` of an env whose discrete actions end with one per token-tree rule (both envs):
    it holds ``config.tree_rules`` (the texts given), ``tree_rules`` (parsed) and ``first_tree`` (the first one's
    action)."""

    def tree_rule(self, action) -> str | None:
        """The rule text (as given in ``tree_rules``) of a tree action, None for any other action."""
        cfg = self.config
        if not self.tree_rules or cfg.action != "discrete" or getattr(cfg, "per_domain", False):
            return None
        i = int(action) - self.first_tree
        return cfg.tree_rules[i] if 0 <= i < len(self.tree_rules) else None

    def tree_action(self, rule: str) -> int:
        """The action of the tree rule ``rule`` (``tree_action_of``)."""
        return tree_action_of(self.config, rule)


def tree_action_of(config, rule: str) -> int:
    """The action of the tree rule ``rule`` (its text, or any text that parses to the same rule) among ``config``'s
    ``tree_rules``, which follow the threshold grid and the off switch; ValueError naming the rules if none is it."""
    wanted = parse_tree_rule(rule)
    rules = tuple(config.tree_rules)
    first = len(config.fallback_values) * len(config.rollback_values) + int(config.off_switch)
    for i, text in enumerate(rules):
        if parse_tree_rule(text) == wanted:
            return first + i
    raise ValueError(f"tree rule {rule!r} is not one of the env's tree_rules {rules}; give the env it (tree_rules=...)")
