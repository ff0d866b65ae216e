"""What both environments do alike: ``BaseEnv``, under ``BiLD-v1`` (``bild_env.env.BildEnv``) and ``BiLD-Serve-v0``
(``bild_env.serving.env.ServingEnv``), each of which says only what is its own.

The base takes the arguments (unknown names refused, then the env's own checks, before any model loads), the render
mode and the cost profile; loads the pair, the lookup predictor (what the lookup scores read) and the target's greedy
references; lays out the actions (the threshold grid, the off switch, then one per token-tree rule; ``bild_env.actions``
decodes them) and checks each against the action space; gives the reward its form, ``latency_weight * (T_ref -
T_step) / T_norm - Q``; and owns the rewind protocol that ``peek`` rests on:

- ``prepare()``: the part of the next step no action changes (``BiLD-Serve-v0``: arrivals and admissions;
  ``BiLD-v1``: none), done once per step;
- ``snapshot()`` / ``restore(saved)``: everything a step changes, saved and put back as it was;
- ``peek(actions)``: each action's step from the current state, tried and rewound.

``step(action)`` is the action checked, the episode checked running, then ``_step(prepare(), plan(action))``: the
env's own step under the action decoded once (``plan``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import fields, replace

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from bild_env.actions import EnvActions
from bild_env.config import CommonConfig
from bild_env.decoding.bild import LOOKUP_SCORES
from bild_env.decoding.cost_model import CostModel
from bild_env.decoding.profiles import MACHINE, CostProfile, load_profile, profile_for
from bild_env.decoding.tree import TreeRule, parse_tree_rule
from bild_env.migrate import folded
from bild_env.models.lookup import lookup_for
from bild_env.reference import ReferenceStore
from bild_env.replay.dataset import NotRecorded, check_replayed, pair_for, replay_actions, seed_for


class BaseEnv(EnvActions, gym.Env):
    """The part of ``BiLD-v1`` and ``BiLD-Serve-v0`` they share (module docstring). A subclass names its arguments
    (``Config``) and their checks (``_validate``), then builds its own parts after ``super().__init__``; it has
    ``started`` (reset has run) and ``ended`` (no step may follow), ``_step``, ``snapshot`` and ``restore``, the
    ``ansi`` text (``_text``) and the replay trees it flushes on ``close`` (``_trees``)."""

    metadata = {"render_modes": ["ansi"], "render_fps": 4}
    Config: type[CommonConfig] = CommonConfig  # the env's arguments

    def __init__(self, render_mode: str | None = None, **kwargs) -> None:
        # 1. the arguments, the render mode and the costs charged: all checked before any model loads
        self.config = cfg = self._arguments(kwargs)
        self.cost_profile = self._cost_profile()
        self.charged = self.cost_profile.name if self.cost_profile else MACHINE  # named in every info
        if render_mode not in (None, "ansi"):
            hint = (" (stable_baselines3's make_vec_env asks for 'rgb_array' unless told otherwise: pass "
                    "env_kwargs={'render_mode': None, ...})") if render_mode == "rgb_array" else ""
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}{hint}")
        self.render_mode = render_mode
        # 2. the pair, what the lookup scores read, the target's greedy references
        self.pair = pair_for(cfg, lambda dtype=None: cfg.pair_options.load(cfg.pair, dtype))
        self.predictor = lookup_for(self.pair) if cfg.actions.score in LOOKUP_SCORES else None
        self.references = ReferenceStore(self.pair, cfg.max_new_tokens, recorded=seed_for(self.pair))
        # 3. the actions: the grid, the off switch (of one request, or the batch), then one per tree rule
        self.n_grid = cfg.actions.n_grid
        self.n_chain_actions = self.n_grid + (1 if cfg.actions.off_switch else 0)  # action_space.n adds the trees
        self.tree_rules: tuple[TreeRule, ...] = tuple(parse_tree_rule(text) for text in cfg.actions.tree_rules)
        self.first_tree = self.n_chain_actions  # the first tree action's index

    @property
    def env_id(self) -> str:
        """The id this env was made as (``gymnasium.make`` sets ``spec``), else that of its arguments."""
        return self.spec.id if self.spec is not None else self._id_for(vars(self.config))

    # -- what each env says of its own --------------------------------------------------------------------
    @classmethod
    def _id_for(cls, values: dict) -> str:
        """The env id of arguments ``values`` (messages name it)."""
        raise NotImplementedError

    def _validate(self, cfg: CommonConfig) -> None:
        """Refuse arguments that make no sense (a ValueError saying what to give), before any model loads."""
        raise NotImplementedError

    def _step(self, prepared, plan):
        """The step under ``plan`` once ``prepare`` has run (``prepared``: what it returned)."""
        raise NotImplementedError

    def snapshot(self) -> object:
        """Everything a step changes (opaque), for ``restore``: a caller may try things on the running episode (read
        ahead, step) and put it back as it was."""
        raise NotImplementedError

    def restore(self, saved: object) -> None:
        """Put the episode back as ``snapshot`` saw it."""
        raise NotImplementedError

    def _text(self) -> str:
        """The ``ansi`` rendering of the running episode."""
        raise NotImplementedError

    def _cap_runs(self, kwargs: dict) -> list[tuple]:
        """What ``max_draft_len="auto"`` is chosen on (``bild_env.draft_cap``): [(a validation twin made of ``kwargs``,
        the ``reset`` arguments of its episodes)], one for each load the choice averages over."""
        raise NotImplementedError

    def _trees(self):
        """The replay trees the env answers from (a ``TreeStore``), or None."""
        raise NotImplementedError

    # -- the construction's shared steps -------------------------------------------------------------------
    def _arguments(self, kwargs: dict) -> CommonConfig:
        """The env's ``Config`` of ``kwargs``: unknown names refused (a TypeError naming the valid ones), then checked
        (``_validate``); the ``actions``' ``tree_rules`` as the tuple the field holds (a list from JSON, or a
        caller's)."""
        names = {f.name for f in fields(self.Config)}
        kwargs = folded(self.Config, kwargs, stacklevel=5)
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown {self._id_for(vars(self.Config()) | kwargs)} argument(s) {unknown}; "
                            f"valid: {sorted(names)}")
        cfg = self.Config(**kwargs)
        self._validate(cfg)
        cfg.actions = replace(replay_actions(cfg, kwargs.get("actions")) or cfg.actions,
                              tree_rules=tuple(cfg.actions.tree_rules))
        return cfg

    def _cost_profile(self) -> CostProfile | None:
        """The stored cost profile charged (``cost_profile``, loaded and checked), or None: this machine's costs."""
        return profile_for(self.config.cost_profile, self.config.cost_model)

    def _cost_model(self, calibrate: Callable) -> CostModel:
        """What the env charges: the ``cost_model`` given, else the cost profile's, else ``calibrate(pair)`` (this
        machine's, timed and cached: the models may load for it). Then an env replaying a decoding dataset with no
        model whose options leave it is refused, unless it opted in to load them (``check_replayed``)."""
        cfg = self.config
        if cfg.cost_model is not None:
            model = cfg.cost_model
        else:
            model = self.cost_profile.model if self.cost_profile is not None else calibrate(self.pair)
        check_replayed(self.pair, cfg, self.env_id)
        return model

    def _action_space(self) -> spaces.Space:
        """``Box(-1, 1, (2,))`` (``(3,)`` with the off switch) for continuous actions, else ``Discrete`` over the grid,
        the off switch and the tree rules."""
        cfg = self.config
        if cfg.actions.space == "continuous":
            return spaces.Box(-1.0, 1.0, (3 if cfg.actions.off_switch else 2,), dtype=np.float32)
        return spaces.Discrete(self.first_tree + len(self.tree_rules))

    # -- actions ---------------------------------------------------------------------------------------------
    def plan(self, action):
        """What a checked action sets for the step: its ``Action`` (``bild_env.actions``; ``BiLD-Serve-v0``: a ``Plan``
        for the batch)."""
        return self.decode(action)

    def thresholds(self, action) -> tuple[float, float] | None:
        """(fallback, rollback) that ``action`` picks, or None for speculation off or a tree rule (``Action.thresholds``)."""
        return self.decode(action).thresholds

    def _check_action(self, action):
        """``action`` checked against the action space: the continuous numbers as an array, else the integer; a
        ValueError saying what the space takes otherwise."""
        cfg, space, arr = self.config, self.action_space, np.asarray(action)
        if cfg.actions.space == "continuous":
            n = space.shape[0]
            if (arr.shape != (n,) or not np.issubdtype(arr.dtype, np.number) or not np.all(np.isfinite(arr))
                    or np.any(np.abs(arr) > 1.0 + 1e-6)):
                raise ValueError(f"{self.env_id} continuous action must be {n} finite numbers in [-1, 1] (fallback, "
                                 f"rollback: -1 the smallest threshold, +1 the largest{'; off > 0' if n == 3 else ''}), "
                                 f"got {action!r}")
            return arr
        if arr.shape != () or not np.issubdtype(arr.dtype, np.integer) or not space.contains(arr.item()):
            off = f"; {self.n_grid} = speculation off" if cfg.actions.off_switch else ""
            if self.tree_rules:
                off += f"; {self.first_tree}-{space.n - 1} = the tree rules {tuple(cfg.actions.tree_rules)}"
            raise ValueError(f"{self.env_id} action must be an integer in [0, {space.n}) (a scalar: fallback index * "
                             f"{len(cfg.actions.rollback_values)} + rollback index{off}), got {action!r}")
        return int(arr.item())

    # -- a step, and the rewind protocol ------------------------------------------------------------------
    def step(self, action):
        checked = self._check_action(action)
        self._check_running("step")
        prepared = self.prepare()
        plan = self.plan(checked)
        try:
            return self._step(prepared, plan)
        except NotRecorded as err:  # said once, with the action: what to give instead is in the message
            shared = getattr(plan, "shared", plan)
            words = getattr(shared, "text", "per domain")
            raise NotRecorded(f"{self.env_id}, action {checked} {words}: {err}") from None

    def prepare(self):
        """The part of the next step no action changes, done once per step (``peek`` and the ``step`` after it share
        it; calling it again before the step returns the same). ``BiLD-v1``: none."""
        return None

    def peek(self, actions=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What each of ``actions`` (default: every discrete action) would give from the current state, untaken.

        Returns ``(observations, rewards, ends)``, one row per action: exactly what ``step(a)`` would return now
        (``ends``: the step ends the episode, ``BiLD-v1``'s terminated, ``BiLD-Serve-v0``'s truncated). The episode is
        left as it was: ``prepare`` runs once, before the tries (``BiLD-Serve-v0``: the same arrivals and admissions;
        a ``step`` after it takes up the same batch), and each try is put back (``snapshot`` / ``restore``). Every
        step is answered from the replay trees (a miss fills them, as a step would), so this is exact. Training uses
        it to learn from every action at every visited state (``DQNConfig.all_actions``, ``agents.dqn.AllActionsDQN``):
        the actions are compared on the same state, not across states. A try the models fail is a RuntimeError.
        ``BiLD-v0`` and ``BiLD-v1`` peek on the replay backend only: a live env's KV caches cannot be rewound for free.
        """
        if getattr(self.config, "backend", "replay") != "replay":  # BiLD-Serve-v0 replays always
            raise ValueError(f"{self.env_id}: peek() needs backend='replay' (a live env cannot rewind its KV caches)")
        self._check_running("peek")
        if actions is None:
            if not isinstance(self.action_space, spaces.Discrete):
                acts = self.config.actions
                kind = "per_domain" if getattr(acts, "per_domain", False) else f"space={acts.space!r}"
                raise ValueError(f"{self.env_id}: peek() without actions enumerates the discrete actions; give the "
                                 f"actions to try ({kind}: {self.action_space})")
            actions = range(self.action_space.n)
        actions = list(actions)
        plans = [self.plan(self._check_action(a)) for a in actions]
        prepared = self.prepare()
        saved = self.snapshot()
        observations, rewards, ends = [], [], []
        for action, plan in zip(actions, plans):
            try:
                obs, reward, terminated, truncated, info = self._step(prepared, plan)
            finally:
                self.restore(saved)
            if "error" in info:  # the models failed (BiLD-v1; a serving request's failure is in info["errors"])
                raise RuntimeError(f"{self.env_id}: peek() at action {action!r} failed: {info['error']}")
            observations.append(obs)
            rewards.append(reward)
            ends.append(terminated or truncated)
        shape = (len(observations), *self.observation_space.shape)  # no actions: empty rows, not numpy's error
        return (np.asarray(observations, dtype=np.float32).reshape(shape), np.asarray(rewards, dtype=np.float64),
                np.asarray(ends, dtype=bool))

    def _check_running(self, verb: str) -> None:
        """A RuntimeError before ``reset`` or once the episode has ended, naming ``verb`` (step, peek)."""
        if not self.started:
            raise RuntimeError(f"{self.env_id}: call reset() before {verb}()")
        if self.ended:
            raise RuntimeError(f"{self.env_id}: the episode has ended (terminated or truncated); call reset() before "
                               f"{verb}()")

    # -- the reward's form ---------------------------------------------------------------------------------
    def _reward(self, ref_ms: float, step_ms: float, quality: float) -> float:
        """``latency_weight * (T_ref - T_step) / T_norm - quality``: the time saved against target-only decoding of the
        same tokens (ms; ``norm_ms`` is ``T_norm``), minus the quality charge."""
        return self.config.reward.latency_weight * (ref_ms - step_ms) / self.norm_ms - quality

    def _regret_charge(self, regret: float) -> float:
        """The quality charge of ``regret`` nats: ``regret_weight * regret / max_new_tokens``."""
        return self.config.reward.regret_weight * regret / self.config.max_new_tokens

    # -- rendering and closing ------------------------------------------------------------------------------
    def render(self) -> str | None:
        """With ``render_mode="ansi"``, the episode so far as text; None otherwise or before ``reset``."""
        return self._text() if self.render_mode == "ansi" and self.started else None

    def close(self) -> None:
        store = self._trees()
        if store is not None:
            store.flush()  # replay trees to disk
        super().close()


SPACES = ("discrete", "continuous")  # the action spaces both envs take


def check_common(cfg: CommonConfig, counts: tuple[str, ...] = (), weights: tuple[str, ...] = ()) -> None:
    """What both envs' ``validate`` refuse alike, before any model loads (a ValueError saying what to give): a bool
    field holding no bool, a count below 1 (``max_new_tokens``, ``prompt_tokens`` and the env's ``counts``),
    ``max_prompts``, the draft cap, the score, a weight that is no finite number >= 0 (the reward's latency and regret
    weights and the env's ``weights``), the action space, its grids and the tree rules, a cost profile that cannot be
    read or charged (``profiles.load_profile``)."""
    from bild_env.actions import check_grids
    from bild_env.cli import check_bool_fields
    from bild_env.config import check_tree_rules
    from bild_env.decoding.bild import check_score
    from bild_env.draft_cap import check_max_draft_len

    check_bool_fields(cfg)
    for name in ("max_new_tokens", "prompt_tokens", *counts):
        v = cfg.setting(name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if cfg.max_prompts is not None and (isinstance(cfg.max_prompts, bool) or not isinstance(cfg.max_prompts, int)
                                        or cfg.max_prompts < 1):
        raise ValueError(f"max_prompts must be an integer >= 1 (the first N prompts of the split; BiLD-Serve-v0: of "
                         f"each domain's) or None (all), got {cfg.max_prompts!r}")
    check_max_draft_len(cfg)
    check_score(cfg.actions.score)
    for name in ("latency_weight", "regret_weight", *weights):
        v = cfg.setting(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}: give a weight such as "
                             f"{type(cfg)().setting(name)} (the default), or 0 to leave that term out")
    if cfg.actions.space not in SPACES:
        raise ValueError(f"actions: space must be one of {SPACES}, got {cfg.actions.space!r}")
    check_grids(cfg.actions.fallback_values, cfg.actions.rollback_values, cfg.actions.space)
    check_tree_rules(cfg)
    if cfg.cost_profile is not None:
        load_profile(cfg.cost_profile)  # a ProfileError (a ValueError) naming the file and the table at fault
