"""The rules a serving engineer writes for BiLD-Serve-v0, and episodes of any policy on it.

Every rule is an SB3-style policy (``predict(observation, state, episode_start, deterministic)``), so
rules and trained agents run through the same ``run_serving_episode``:

- ``Fixed(a)``: one action always (the best single one over the mix is grid search's answer;
  ``fixed_bild_action(env)``: the grid's nearest to the BiLD paper's fixed thresholds);
- ``LoadTable(env, {utilisation: action})``: the best fixed action per load level, chosen on validation
  (an engineer knows the load of a deployment: the table reads the episode's current utilisation from
  the env, the nearest level's action);
- ``DomainTable(env, {utilisation: {domain: action}})``: the best fixed action per load level and per domain,
  each request taking its domain's (an env with ``per_domain``; a per-condition table);
- ``OffAboveBatch(on, batch)``: vLLM's ``speculative_disable_by_batch_size``: ``on`` while the batch holds
  at most ``batch`` requests, speculation off above it (reads the observation's batch size);
- ``BatchTable(table, off, max_batch, batch_scale)``: an action per batch-size bucket (1, 2, 3-4, 5-8, ...), each
  bucket's actions ranked on validation by exact counterfactual step rewards (``choose_batch_table``), whole episodes
  choosing among them and the ``OffAboveBatch`` rules (``refine_batch_table``); vLLM's and TensorRT-LLM's batch-size
  tables;
- ``DomainBatchTable(env, {(bucket, domain): action}, off)``: the per-batch-size table per domain, each request
  taking its domain's (``per_domain``), chosen the same way (``choose_domain_batch_table``);
- ``AcceptanceRule(on, threshold)``: ``on`` while the batch's recent acceptance (observation) is at least
  ``threshold``, off below it (an acceptance moving-average rule, as SmartSpec's history-driven choice).

And one policy no observation can drive, a ceiling: ``StepHindsight(env, actions)`` takes at every step the
action whose reward that step is highest, knowing it (``ServingEnv.peek``: each action tried on the same
batch, untaken). What per-step adaptation would win if a policy could foresee each step's acceptance; greedy,
so it does not bound what looking further ahead would win.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np

from agents.common.stats import mean_ci
from bild_env.serving.observations import batch_from_feature

BATCH_INDEX, ACCEPTANCE_INDEX = 0, 4  # in the serving observation (bild_env.serving.observations)


class Fixed:
    def __init__(self, action: int) -> None:
        self.action = int(action)

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        return np.int64(self.action), state


class StepHindsight:
    """At every step the action of ``actions`` with the highest reward that step, known in hindsight
    (``env.unwrapped.peek(actions)``: every action tried on the same admitted batch, the episode left as it was;
    ties go to the first in ``actions``). A ceiling, not a rule: it reads the outcome, not the observation."""

    def __init__(self, env: gym.Env, actions: Sequence[int]) -> None:
        self.env, self.actions = env.unwrapped, [int(a) for a in actions]
        if not self.actions:
            raise ValueError("StepHindsight needs at least one action to choose among")

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        _, rewards, _ = self.env.peek(self.actions)
        return np.int64(self.actions[int(np.argmax(rewards))]), state


def fixed_bild_action(env: gym.Env) -> int:
    """The env's grid action nearest to the BiLD paper's fixed thresholds (fallback 0.103, rollback 4.697 nats):
    the fixed baseline on a grid (on BiLD-v1's grid, action 4, those thresholds exactly)."""
    from bild_env.decoding.bild import FIXED_FALLBACK, FIXED_ROLLBACK

    env = env.unwrapped
    c = env.config
    n = len(c.actions.rollback_values)
    return min(range(env.n_grid), key=lambda i: abs(c.actions.fallback_values[i // n] - FIXED_FALLBACK)
               + abs(c.actions.rollback_values[i % n] - FIXED_ROLLBACK))


def nearest_level(env, levels) -> float:
    """The level of ``levels`` nearest to the episode's current utilisation (``env`` unwrapped)."""
    u = env.load.utilisation(env.steps / env.config.episode_steps)
    return min(levels, key=lambda v: abs(v - u))


class LoadTable:
    """The action of the load level nearest to the episode's current utilisation."""

    def __init__(self, env: gym.Env, table: dict[float, int]) -> None:
        self.env, self.levels = env.unwrapped, sorted(table)
        self.table = dict(table)

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        return np.int64(self.table[nearest_level(self.env, self.levels)]), state


class DomainTable:
    """The best fixed action per (load level, domain), each request taking its own domain's: for an env with
    ``per_domain`` (an endpoint that knows what each request is). ``table[level][domain]``; the level nearest to
    the episode's current utilisation, as ``LoadTable``."""

    def __init__(self, env: gym.Env, table: dict[float, dict[str, int]]) -> None:
        self.env, self.levels = env.unwrapped, sorted(table)
        if not self.env.config.actions.per_domain:
            raise ValueError("DomainTable acts per domain: make the env with actions={'per_domain': True}")
        missing = {u: sorted(set(self.env.workload.domains) - set(table[u])) for u in self.levels}
        if any(missing.values()):
            raise ValueError(f"DomainTable: no action for domain(s) {missing} of the env's workload")
        self.table = {u: np.array([table[u][d] for d in self.env.workload.domains], dtype=np.int64) for u in table}

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        return self.table[nearest_level(self.env, self.levels)].copy(), state


class OffAboveBatch:
    def __init__(self, on: int, off: int, batch: int, max_batch: int, batch_scale: str = "linear") -> None:
        self.on, self.off, self.limit, self.max_batch, self.batch_scale = int(on), int(off), batch, max_batch, batch_scale

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        on = observed_batch(observation, self.max_batch, self.batch_scale) <= self.limit
        return np.int64(self.on if on else self.off), state


class BatchTable:
    """An action per batch size (vLLM's batch-size-to-draft-length table, TensorRT-LLM's per-batch-size schedule):
    ``table[batch_bucket(b)]`` for the observation's batch size b (buckets 1, 2, 3-4, 5-8, 9-16, 17-32, ...), ``off``
    for a bucket the table lacks."""

    def __init__(self, table: dict[int, int], off: int, max_batch: int, batch_scale: str = "linear") -> None:
        self.table, self.off, self.max_batch = {int(k): int(a) for k, a in table.items()}, int(off), max_batch
        self.batch_scale = batch_scale  # the env's: how its observation holds the batch size

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        k = batch_bucket(observed_batch(observation, self.max_batch, self.batch_scale))
        return np.int64(self.table.get(k, self.off)), state


class TableGuard:
    """An agent that departs from a rule only where it is sure: the rule's action (``rule.predict``, mapped onto the
    agent's grid by ``to_agent``), unless the agent's best action has a Q-value above the rule's action's by more than
    ``margin`` (then that one). ``q_values(observation)`` -> (n_envs, n_actions) is the agent's (a ``QEnsemble``'s,
    or ``dqn_q_values`` of one DQN). ``margin`` 0 is the agent itself (up to ties), ``inf`` the rule: conservative
    policy improvement over a baseline, the margin chosen on validation (``agents.serve.evaluation``)."""

    def __init__(self, q_values, rule, to_agent: dict[int, int], margin: float) -> None:
        self.q_values, self.rule, self.to_agent, self.margin = q_values, rule, dict(to_agent), float(margin)

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        q = np.atleast_2d(self.q_values(observation))
        obs = np.atleast_2d(np.asarray(observation))
        out = np.empty(len(q), dtype=np.int64)
        for i, (row, o) in enumerate(zip(q, obs)):
            a = self.to_agent[int(self.rule.predict(o)[0])]
            best = int(row.argmax())
            out[i] = best if row[best] - row[a] > self.margin else a
        return (out if np.asarray(observation).ndim > 1 else out[0]), state


def dqn_q_values(model):
    """``q_values(observation)`` -> (n_envs, n_actions) of one SB3 DQN (``TableGuard``); a ``QEnsemble`` has its own."""
    import torch

    def q_values(observation) -> np.ndarray:
        obs, _ = model.policy.obs_to_tensor(observation)
        with torch.no_grad():
            return model.q_net(obs).cpu().numpy()

    return q_values


def grid_map(from_env: gym.Env, to_env: gym.Env) -> dict[int, int]:
    """The actions of ``from_env``'s grid that ``to_env``'s has too (the same thresholds, off as off, the same tree
    rule: equal ``Action``s), as {from action: to action}."""
    by_action = {to_env.unwrapped.decode(a): a for a in range(to_env.action_space.n)}
    return {a: by_action[d] for a in range(from_env.action_space.n)
            if (d := from_env.unwrapped.decode(a)) in by_action}


def observed_batch(observation, max_batch: int, batch_scale: str = "linear") -> int:
    """The batch size the serving observation holds (``ServingConfig.observe.batch_scale``: linear or log)."""
    return batch_from_feature(observation[BATCH_INDEX], max_batch, batch_scale)


def env_batch(env: gym.Env, observation) -> int:
    """The batch size ``env``'s observation holds, read on that env's scale."""
    cfg = env.unwrapped.config
    return observed_batch(observation, cfg.max_batch, cfg.observe.batch_scale)


def batch_bucket(batch: int) -> int:
    """0 for batch size <= 1, then 1 for 2, 2 for 3-4, 3 for 5-8, ... (powers of two)."""
    return max(0, int(batch) - 1).bit_length()


def bucket_label(k: int) -> str:
    lo, hi = (1 << (k - 1)) + 1 if k else 1, 1 << k
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def choose_batch_table(envs: Sequence[gym.Env], behaviour: Sequence, seeds: Sequence[int],
                       actions: Sequence[int]) -> tuple[dict[int, int], dict[int, dict[int, float]]]:
    """The best action per batch-size bucket, from exact counterfactuals: ``behaviour[i]`` plays ``envs[i]``'s
    episodes of ``seeds``, and at every state the env's ``peek`` gives each of ``actions``' step reward;
    each bucket takes the action with the highest mean. Returns (table, mean reward per bucket and action)."""
    sums: dict[int, np.ndarray] = {}
    counts: dict[int, int] = {}
    for env, policy in zip(envs, behaviour):
        for seed in seeds:
            obs, _ = env.reset(seed=seed)
            while True:
                k = batch_bucket(env_batch(env, obs))
                _, rewards, _ = env.unwrapped.peek(list(actions))
                sums[k] = sums.get(k, 0.0) + rewards
                counts[k] = counts.get(k, 0) + 1
                action, _ = policy.predict(obs, deterministic=True)
                obs, _, terminated, truncated, _ = env.step(int(action))
                if terminated or truncated:
                    break
    means = {k: {int(a): float(m) for a, m in zip(actions, sums[k] / counts[k])} for k in sorted(sums)}
    return {k: max(v, key=v.get) for k, v in means.items()}, means


REFINE_TRIES = 2  # per bucket, the best actions by step reward that whole episodes try (and off)


def off_above_tables(buckets: Sequence[int], on: int, off: int) -> list[dict[int, int]]:
    """``OffAboveBatch(on, b)`` for every b of 1, 2, 4, ... as per-batch-size tables over ``buckets`` (a bucket ends
    at a power of two, so each rule is a table exactly), from always off to always ``on``."""
    return [{k: (on if k <= top else off) for k in buckets} for top in range(-1, max(buckets, default=0) + 1)]


def refine_batch_table(envs: Sequence[gym.Env], seeds: Sequence[int], table: dict[int, int], off: int,
                       means: dict[int, dict[int, float]], starts: Sequence[dict[int, int]] = (),
                       tries: int = REFINE_TRIES, counted=None,
                       announce=None) -> tuple[dict[int, int], list[tuple[dict[int, int], float]]]:
    """The per-batch-size table chosen on whole validation episodes. ``choose_batch_table`` takes each bucket's best
    step reward at the behaviour's states: blind to what an action leaves in the queue (a tree at batch 3-4 can lose
    its own step yet empty the queue sooner), so it can fall below a rule of its own family ("off above batch 4").
    This starts from the best of ``table`` and ``starts`` (e.g. ``off_above_tables``) by mean return over ``envs``'
    episodes of ``seeds`` (the same episodes for every table), then sweeps the buckets once, smallest first, trying in
    each its ``tries`` best actions by step reward (``means``) and ``off``; a change is kept only where its gain, paired
    per episode, has a 95% interval above zero (a few validation prompts choose a bucket's action by noise otherwise:
    the conservative rule of ``agents.serve.selection.keep_where_it_helps``). ``announce(n)`` is told first of the
    episodes it will run at most, ``counted(n)`` of each ``n`` run. Returns (table, [(each table tried, its mean
    return)])."""
    cfg = envs[0].unwrapped.config
    runs: dict[str, np.ndarray] = {}
    tried: list[tuple[dict[int, int], float]] = []

    def returns(candidate: dict[int, int]) -> np.ndarray:
        key = table_label(candidate, off)
        if key not in runs:
            rule = BatchTable(candidate, off, cfg.max_batch, cfg.observe.batch_scale)
            runs[key] = np.concatenate([returns_of(e, rule, seeds)[0] for e in envs])
            tried.append((dict(candidate), float(runs[key].mean())))
            if counted is not None:
                counted(len(envs) * len(seeds))
        return runs[key]

    candidates = {k: dict.fromkeys([*sorted(means[k], key=lambda a, k=k: -means[k][a])[:tries], off]) for k in means}
    if announce is not None:
        firsts = {table_label(t, off) for t in [table, *starts]}
        announce(len(envs) * len(seeds) * (len(firsts) + sum(len(c) for c in candidates.values())))
    best = max([dict(table), *map(dict, starts)], key=lambda t: returns(t).mean())  # the first of equals
    for k in sorted(means):
        for a in candidates[k]:
            trial = best | {k: a}
            if mean_ci(returns(trial) - returns(best))[0] > 0:
                best = trial
    return best, tried


def refine_episodes(per_table: int, buckets: int) -> int:
    """At most the episodes ``refine_batch_table`` runs, ``per_table`` a table, from a table of ``buckets`` buckets
    and the ``off_above_tables`` of one action (each table run once)."""
    return per_table * (1 + (buckets + 1) + buckets * (REFINE_TRIES + 1))


def table_label(table: dict[int, int], off: int, name=str) -> str:
    """A per-batch-size table as text, one text for one policy: "1: 28, 2: 28, else 25" (``name`` each action; a
    bucket at ``off`` and one the table lacks read the same)."""
    on = "".join(f"{bucket_label(k)}: {name(a)}, " for k, a in sorted(table.items()) if a != off)
    return f"{on}else {name(off)}"


class DomainBatchTable:
    """An action per (batch-size bucket, domain), each request taking its own domain's: ``BatchTable`` for an env
    with ``per_domain`` (``table[(bucket, domain)]``, ``off`` where the table has none)."""

    def __init__(self, env: gym.Env, table: dict[tuple[int, str], int], off: int) -> None:
        env = env.unwrapped
        if not env.config.actions.per_domain:
            raise ValueError("DomainBatchTable acts per domain: make the env with actions={'per_domain': True}")
        self.domains, self.max_batch, self.off = tuple(env.workload.domains), env.config.max_batch, int(off)
        self.batch_scale = env.config.observe.batch_scale
        self.table = {(int(k), str(d)): int(a) for (k, d), a in table.items()}

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        k = batch_bucket(observed_batch(observation, self.max_batch, self.batch_scale))
        return np.array([self.table.get((k, d), self.off) for d in self.domains], dtype=np.int64), state


def choose_domain_batch_table(envs: Sequence[gym.Env], behaviour: Sequence, seeds: Sequence[int],
                              actions: Sequence[int]) -> tuple[dict[tuple[int, str], int], dict]:
    """The best action per (batch-size bucket, domain), from exact counterfactuals in envs with ``per_domain``:
    ``behaviour[i]`` (a batch-level rule, e.g. ``BatchTable``) plays ``envs[i]``'s episodes of ``seeds``; at every
    state, for each domain in the batch, ``peek`` gives the step reward of each of ``actions`` for that domain's
    requests, the others' at the behaviour's action (one domain varied at a time: the step's time couples the
    requests, so the choice is the best reply to the behaviour, not a joint optimum). Returns (table, mean reward
    per (bucket, domain) and action)."""
    sums: dict[tuple[int, str], np.ndarray] = {}
    counts: dict[tuple[int, str], int] = {}
    for env, policy in zip(envs, behaviour):
        inner = env.unwrapped
        domains = list(inner.workload.domains)
        for seed in seeds:
            obs, _ = env.reset(seed=seed)
            while True:
                k = batch_bucket(env_batch(inner, obs))
                base = int(np.asarray(policy.predict(obs, deterministic=True)[0]).reshape(-1)[0])
                inner.prepare()  # the step's arrivals and admissions (no action changes them): the batch peeked
                present = sorted({r.domain for r in inner.active}, key=domains.index)
                for d in present:
                    i = domains.index(d)
                    tries = [np.array([a if j == i else base for j in range(len(domains))]) for a in actions]
                    _, rewards, _ = inner.peek(tries)
                    sums[(k, d)] = sums.get((k, d), 0.0) + rewards
                    counts[(k, d)] = counts.get((k, d), 0) + 1
                obs, _, terminated, truncated, _ = env.step(np.full(len(domains), base, dtype=np.int64))
                if terminated or truncated:
                    break
    means = {key: {int(a): float(m) for a, m in zip(actions, sums[key] / counts[key])} for key in sorted(sums)}
    return {key: max(v, key=v.get) for key, v in means.items()}, means


class AcceptanceRule:
    def __init__(self, on: int, off: int, threshold: float) -> None:
        self.on, self.off, self.threshold = int(on), int(off), threshold

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        return np.int64(self.on if observation[ACCEPTANCE_INDEX] >= self.threshold else self.off), state


@dataclass
class ServingEpisode:
    episode_return: float
    summary: dict
    actions: list[int] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)  # decoded in each step (after that step's admissions)
    observed_batches: list[int] = field(default_factory=list)  # in the observation each action was chosen on
    rewards: list[float] = field(default_factory=list)


def run_serving_episode(env: gym.Env, policy, seed: int) -> ServingEpisode:
    """One episode of ``policy`` (deterministic) from ``env.reset(seed=seed)``: the same seed meets the same
    requests in the same order whatever the policy (common random numbers)."""
    obs, _ = env.reset(seed=seed)
    start = True
    ep = ServingEpisode(0.0, {})
    while True:
        action, _ = policy.predict(obs, episode_start=np.array([start]), deterministic=True)
        ep.observed_batches.append(env_batch(env, obs))
        start = False
        a = action if getattr(env.action_space, "shape", ()) else int(np.asarray(action).reshape(-1)[0])
        obs, reward, terminated, truncated, info = env.step(a)
        ep.episode_return += float(reward)
        ep.actions.append(a if isinstance(a, int) else -1)
        ep.batch_sizes.append(info["batch_size"])
        ep.rewards.append(float(reward))
        if terminated or truncated:
            ep.summary = info.get("episode_summary", {})
            return ep


def returns_of(env: gym.Env, policy, seeds: Sequence[int]) -> tuple[np.ndarray, np.ndarray, list[ServingEpisode]]:
    """Per seed: the return and the speedup over target-only serving at the same load."""
    eps = [run_serving_episode(env, policy, s) for s in seeds]
    return (np.array([e.episode_return for e in eps]), np.array([e.summary.get("speedup", 1.0) for e in eps]), eps)
