"""What an action means in both environments, decoded once: an ``Action`` (a BiLD pair of thresholds, speculation
off, or a token-tree rule) and, for a serving batch, a ``Plan`` (one action for every request, or one per domain).

``thresholds(action, ...)`` maps a grid index (``fallback_values[a // n], rollback_values[a % n]``, with
``n = len(rollback_values)``; the index after the grid is speculation off when ``off_switch``) or a
continuous action in [-1, 1] (fallback linear and rollback log-scale over the grids' spans; a third
number > 0 is speculation off when ``off_switch``) to ``(fallback, rollback)``, or None for off.
``EnvActions.decode`` (``grid_action`` for a grid's) makes the ``Action`` of a checked action (the tree rules' indices follow the grid and the
off switch); ``Action.run`` takes a session's step for it and ``Action.batch_step`` a batched decoder's, and ``Action`` / ``Plan`` say how a step of it shows
(the observation's previous thresholds, ``info``). No other module tells the kinds apart.
``check_grids`` refuses grids the envs cannot use.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from bild_env.decoding.bild import check_thresholds
from bild_env.decoding.stats import DecodeStats
from bild_env.decoding.tree import TreeRule, parse_tree_rule, session_tree_step

BILD, OFF, TREE = "bild", "off", "tree"  # the kinds of an ``Action``
OFF_THRESHOLDS = (1.0, 0.0)  # what an off step shows as its thresholds: never draft, roll back nothing
TREE_THRESHOLDS = (0.0, 0.0)  # what a tree step shows as its thresholds: draft without falling back, keep the target's


@dataclass(frozen=True)
class Action:
    """One decoded action: what one step of a session does (BiLD-v1's episode, or one request of a serving batch).

    ``kind``: ``BILD`` (a BiLD step with ``fallback``, a probability, and ``rollback``, nats), ``OFF`` (the target
    emits one token alone, no draft forward) or ``TREE`` (a lossless token-tree step by ``rule``, given as the text
    ``label``). ``fallback`` and ``rollback`` are what the step shows (the observation's previous thresholds): the
    pair, ``OFF_THRESHOLDS`` or ``TREE_THRESHOLDS``.
    """

    kind: str
    fallback: float
    rollback: float
    rule: TreeRule | None = None
    label: str | None = field(default=None, compare=False)  # two texts of one rule make equal actions

    @classmethod
    def bild(cls, fallback: float, rollback: float) -> Action:
        return cls(BILD, fallback, rollback)

    @classmethod
    def off(cls) -> Action:
        return cls(OFF, *OFF_THRESHOLDS)

    @classmethod
    def tree(cls, rule: TreeRule, label: str) -> Action:
        return cls(TREE, *TREE_THRESHOLDS, rule, label)

    @property
    def drafts_a_run(self) -> bool:
        """A BiLD step: its draft run stops somewhere (an off step drafts nothing; a tree step grows a tree)."""
        return self.kind == BILD

    @property
    def thresholds(self) -> tuple[float, float] | None:
        """(fallback, rollback) of a BiLD step; None for speculation off or a tree step (``env.thresholds``)."""
        return (self.fallback, self.rollback) if self.kind == BILD else None

    @property
    def name(self) -> str | None:
        """How a table names it: ``"off"``, ``"tree <rule text>"``, or None for a BiLD pair (named by its thresholds,
        which each table writes its own way)."""
        return "off" if self.kind == OFF else f"tree {self.label}" if self.kind == TREE else None

    @property
    def text(self) -> str:
        """The action in words: ``name``, or for a BiLD pair ``"(fallback, rollback)"``."""
        return self.name or f"({self.fallback:g}, {self.rollback:g})"

    @property
    def shown(self) -> tuple[float, float]:
        """The thresholds a step of it shows: the pair, ``OFF_THRESHOLDS`` or ``TREE_THRESHOLDS``."""
        return self.fallback, self.rollback

    def run(self, session) -> DecodeStats:
        """One step of ``session`` (a ``BildSession``) under this action."""
        if self.kind == OFF:
            return session.step_off()
        if self.kind == TREE:
            return session_tree_step(session, self.rule)
        return session.step(self.fallback, self.rollback)

    def batch_step(self, decoder) -> dict:
        """One step of every request of ``decoder`` (a ``BatchedDecoder``) under this action: its stats per request.
        A tree action has no batched step (ValueError)."""
        if self.kind == OFF:
            return decoder.step(off=True)
        if self.kind == TREE:
            raise ValueError(f"the batched decoder takes no token-tree step ({self.name}): serve this policy in the env")
        return decoder.step(self.fallback, self.rollback)

    def info(self) -> dict:
        """BiLD-v1's ``info`` of a step of it: the thresholds shown, whether it was off, the tree rule's text."""
        return {"fallback": self.fallback, "rollback": self.rollback, "off": self.kind == OFF, "tree": self.label}


@dataclass(frozen=True)
class Plan:
    """A serving step's action decoded for its batch: ``shared``, the ``Action`` every request takes, or with
    ``per_domain`` ``by_domain``, each domain's (a request takes its own domain's)."""

    shared: Action | None = None
    by_domain: Mapping[str, Action] | None = None

    def each(self, domains: Sequence[str]) -> list[Action]:
        """The action of each request of a batch whose domains are ``domains``."""
        if self.by_domain is not None:
            return [self.by_domain[d] for d in domains]
        return [self.shared] * len(domains)

    def shown(self, each: Sequence[Action], last: tuple[float, float, float]) -> tuple[float, float, float]:
        """(fallback, rollback, off) the step's observation shows: the shared action's (off 1 or 0), or per domain
        the batch's means over ``each`` (off steps counted as ``OFF_THRESHOLDS``; off the share of requests it was
        off for), ``last`` for an empty batch."""
        if self.by_domain is None:
            return self.shared.fallback, self.shared.rollback, float(self.shared.kind == OFF)
        if not each:
            return last
        n = len(each)
        return (sum(a.fallback for a in each) / n, sum(a.rollback for a in each) / n,
                sum(a.kind == OFF for a in each) / n)

    def info(self, shown: tuple[float, float, float]) -> dict:
        """``info`` of a serving step: the thresholds (None for speculation off; per domain the batch's means as
        ``shown``, and what each domain got in ``per_domain``), whether it was off, the tree rule's text."""
        if self.by_domain is not None:
            return {"off": shown[2] == 1.0, "fallback": shown[0], "rollback": shown[1], "tree": None,
                    "per_domain": {d: "off" if a.kind == OFF else (a.fallback, a.rollback)
                                   for d, a in self.by_domain.items()}}
        a = self.shared
        off = a.kind == OFF
        return {"off": off, "fallback": None if off else a.fallback, "rollback": None if off else a.rollback,
                "tree": a.label}


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


def grid_action(action, config) -> Action:
    """The ``Action`` of a grid action of an env ``config`` (its ``actions``: threshold grids, space and off switch):
    the pair ``thresholds`` maps it to, or speculation off."""
    acts = config.actions
    pair = thresholds(action, acts.fallback_values, acts.rollback_values, acts.space == "continuous", acts.off_switch)
    return Action.off() if pair is None else Action.bild(*pair)


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
        raise ValueError("space='continuous' maps rollback on a log scale: rollback_values must all be above 0, "
                         f"got {tuple(rollback_values)}")


class EnvActions:
    """An env's actions, each decoded here: ``decode`` (any checked action: the grid's pair, the continuous one, off,
    a tree rule's), ``tree_rule`` and ``tree_action``, for an env whose discrete actions end with one per token-tree
    rule (both envs): it holds ``config.actions.tree_rules`` (the texts given), ``tree_rules`` (parsed) and
    ``first_tree`` (the first one's action)."""

    def decode(self, action) -> Action:
        """The ``Action`` of a checked ``action`` (of one request or the batch; with ``per_domain``, one domain's
        entry): a tree rule's, else the grid's pair (or the continuous one), else speculation off."""
        cfg = self.config
        rule = self.tree_rule(action)
        if rule is not None:
            return Action.tree(self.tree_rules[int(action) - self.first_tree], rule)
        return grid_action(action, cfg)

    def tree_rule(self, action) -> str | None:
        """The rule text (as given in ``tree_rules``) of a tree action, None for any other action."""
        cfg = self.config
        if not self.tree_rules or cfg.actions.space != "discrete" or getattr(cfg.actions, "per_domain", False):
            return None
        i = int(action) - self.first_tree
        return cfg.actions.tree_rules[i] if 0 <= i < len(self.tree_rules) else None

    def tree_action(self, rule: str) -> int:
        """The action of the tree rule ``rule`` (``tree_action_of``)."""
        return tree_action_of(self.config, rule)


def tree_action_of(config, rule: str) -> int:
    """The action of the tree rule ``rule`` (its text, or any text that parses to the same rule) among ``config``'s
    ``tree_rules``, which follow the threshold grid and the off switch; ValueError naming the rules if none is it."""
    wanted = parse_tree_rule(rule)
    rules = tuple(config.actions.tree_rules)
    first = config.actions.n_grid + int(config.actions.off_switch)
    for i, text in enumerate(rules):
        if parse_tree_rule(text) == wanted:
            return first + i
    raise ValueError(f"tree rule {rule!r} is not one of the env's tree_rules {rules}; give the env it "
                     "(actions={'tree_rules': (...)})")

