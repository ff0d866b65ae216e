"""The serving evaluation's validation: every fixed action per load level, and the rules' settings chosen from them
(the best single action, the per-load and per-batch-size tables, the batch size and acceptance above and below which
speculation goes off, the guard's margin, the bandits' settings, the per-domain tables).
"""

from __future__ import annotations


import math

import numpy as np

from agents.common import bandits
from agents.common.stats import mean_ci
from agents.serve.progress import advance, episodes
from agents.serve.rules import (AcceptanceRule, BatchTable, Fixed, LoadTable, OffAboveBatch, TableGuard,
                                bucket_label, choose_batch_table, dqn_q_values, grid_map,
                                off_above_tables, refine_batch_table, table_label)
from agents.serve.bench_config import ServingBenchConfig, make_env
from agents.dqn import q_ensemble
from bild_env.serving.env import ServingEnv



def action_set(env: ServingEnv, actions: tuple[int, ...]) -> list[int]:
    """``actions`` (all of the env's when empty; of one request with ``per_domain``) with speculation off and every
    tree rule's action (``--actions tree_rules=R``) among them."""
    n = env.n_chain_actions + len(env.tree_rules)  # per_domain (an action per request) takes no tree rules
    bad = [a for a in actions if not 0 <= a < n]
    if bad:
        raise ValueError(f"--actions: {bad} not in [0, {n})")
    always = {env.n_chain_actions - 1, *range(env.n_chain_actions, n)}
    return sorted(set(actions) | always) if actions else list(range(n))


def fixed_returns(env: ServingEnv, seeds: list[int],
                  actions: tuple[int, ...] = ()) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Every fixed action's (returns, speedups) over ``seeds``."""
    out = {}
    for a in action_set(env, actions):
        r, s, _ = episodes(env, Fixed(a), seeds)
        out[a] = (r, s)
    return out


def label(env: ServingEnv, a: int) -> str:
    """Action ``a`` in words: "off", "(fallback, rollback)", "tree <rule>"."""
    chosen = env.decode(a)  # ``bild_env.actions.Action``
    return chosen.text


def fixed_by_level(cfg: ServingBenchConfig, seeds: list[int], **grid) -> tuple[dict, dict]:
    """Validation envs at each level of ``cfg.levels`` (constant load, left open) and every fixed action's
    (returns, speedups) on episodes ``seeds`` in each: ({level: env}, {level: {action: (returns, speedups)}})."""
    envs, by_level = {}, {}
    for u in cfg.levels:
        envs[u] = make_env(cfg, "validation", f"constant:{u}", **grid)
        by_level[u] = fixed_returns(envs[u], seeds, cfg.fixed_actions)
    return envs, by_level


def batch_table_from(envs: dict, table: dict[float, int], seeds: list[int], grid: list[int],
                     off: int, on: int, announce=None) -> tuple[dict, dict, list]:
    """The per-batch-size table: exact step rewards of every action of ``grid`` at the states the per-load ``table``
    visits in each of ``envs`` ({level: validation env}; a level ``table`` lacks plays its nearest level's action)
    rank each bucket's actions (``choose_batch_table``), then whole episodes choose (``refine_batch_table``, from the
    best of that table and every "off above batch b, else ``on``": so it is at least the ``OffAboveBatch`` rule of
    ``on`` on these episodes; ``announce``: ``refine_batch_table``'s). Returns (table, mean step reward per bucket and
    action, [(each table tried, its mean return)])."""
    levels = list(envs)
    behaviour = [LoadTable(envs[u], {u: table[min(table, key=lambda v, u=u: abs(v - u))]}) for u in levels]
    first, means = choose_batch_table([envs[u] for u in levels], behaviour, seeds, grid)
    advance(len(levels) * len(seeds))
    starts = off_above_tables(list(means), on, off) if on != off else []
    chosen, scores = refine_batch_table([envs[u] for u in levels], seeds, first, off, means, starts, counted=advance,
                                        announce=announce)
    return chosen, means, scores


def best_per_level(by_level: dict) -> dict[float, int]:
    """The per-load table: at each level the fixed action with the best mean return (``fixed_by_level``'s runs)."""
    return {u: max(fixed, key=lambda a, fixed=fixed: fixed[a][0].mean()) for u, fixed in by_level.items()}


def off_and_on(env: ServingEnv, grid: list[int], by_level: dict,
               best_off: bool = False) -> tuple[int, int, dict[int, float]]:
    """Speculation off's action in ``env`` (the tree rules' actions follow it), the best other action of ``grid`` and
    every action's mean return over the levels of ``by_level`` (``fixed_by_level``'s runs). With ``best_off``, an env
    without the off switch takes its best action for off (``rule_references``' table's default), and for the best
    other that action itself where ``grid`` holds no other."""
    total = {a: float(np.mean([by_level[u][a][0].mean() for u in by_level])) for a in grid}
    off = (env.n_grid if env.config.actions.off_switch else max(total, key=total.get) if best_off
           else env.action_space.n - 1)
    return off, max([a for a in grid if a != off] or ([off] if best_off else []), key=total.get), total


def choose(cfg: ServingBenchConfig, seeds: list[int]) -> dict:
    """Validation: every fixed action per level; the rules' settings chosen from them."""
    envs, by_level = fixed_by_level(cfg, seeds)
    env = envs[cfg.levels[0]]
    grid = action_set(env, cfg.fixed_actions)
    off, best_on, total = off_and_on(env, grid, by_level)
    best = max(total, key=total.get)
    table = best_per_level(by_level)
    rules = {}
    for b in sorted({min(cfg.env.max_batch, 2**k) for k in range(8)}):
        rules[("batch", b)] = OffAboveBatch(best_on, off, b, cfg.env.max_batch, env.config.observe.batch_scale)
    for t in (0.2, 0.3, 0.4, 0.5):
        rules[("acceptance", t)] = AcceptanceRule(best_on, off, t)
    scores = {}
    for key, rule in rules.items():
        scores[key] = float(np.mean([episodes(envs[u], rule, seeds)[0].mean() for u in cfg.levels]))
    batch_key = max((k for k in scores if k[0] == "batch"), key=scores.get)
    acc_key = max((k for k in scores if k[0] == "acceptance"), key=scores.get)
    batch_table, bucket_means, table_scores = batch_table_from(envs, table, seeds, grid, off, best_on)
    ranked = sorted(grid, key=lambda a: -total[a])  # the best fixed action over the levels first
    chosen_bandits = choose_bandits(cfg, envs, seeds, ranked) if cfg.bandits else {}
    for e in envs.values():
        e.close()
    return {"best_single": best, "best_on": best_on, "off": off, "table": table, "batch_table": batch_table,
            "batch_table_means": {bucket_label(k): {label(env, a): m for a, m in v.items()} for k, v in bucket_means.items()},
            "batch_table_scores": {table_label(t, off, lambda a: label(env, a)): v for t, v in table_scores},
            "off_above_batch": batch_key[1],
            "acceptance_threshold": acc_key[1], "labels": {a: label(env, a) for a in range(env.action_space.n)},
            "validation_means": {str(u): {label(env, a): float(by_level[u][a][0].mean()) for a in grid}
                                 for u in cfg.levels},
            "rule_scores": {f"{k[0]}:{k[1]}": v for k, v in scores.items()}, "bandits": chosen_bandits}


GUARD_MARGINS = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, math.inf)  # TableGuard's margins tried on validation
FLOOR_MARGINS = (0.0, 0.01, 0.05, math.inf)  # ... at the end of a run (its validation episodes: fewer, in its time)


def keep_where_it_helps(rule: np.ndarray, by_margin: dict[float, np.ndarray]) -> dict:
    """The rule as the agent's floor: of ``TableGuard``'s margins, those whose per-episode gain over the rule
    (``rule``: the rule's returns; ``by_margin``: {margin: returns}, the same validation episodes in the same order)
    has a 95% interval above zero, the one with the best mean; else ``inf``, the rule itself. Where validation does
    not show a change helps beyond its noise, the agent keeps the rule (the conservative improvement over a baseline
    of SPIBB, Laroche et al. 2019, decided per policy rather than per state)."""
    rule = np.asarray(rule, dtype=float)
    gains = {m: np.asarray(r, dtype=float) - rule for m, r in by_margin.items() if not math.isinf(m)}
    ci = {m: mean_ci(g) for m, g in gains.items()}
    helps = [m for m in sorted(gains, reverse=True) if ci[m][0] > 0]  # max keeps the first of equals: the larger
    margin = max(helps, key=lambda m: gains[m].mean()) if helps else math.inf
    means = {f"{m:g}": float(np.mean(r)) for m, r in by_margin.items()} | {"inf": float(rule.mean())}
    return {"margin": margin, "validation_means": means,
            "gain_ci": {f"{m:g}": [float(gains[m].mean()), *ci[m]] for m in gains}}


def guard_for(cfg: ServingBenchConfig, chosen: dict, agents: list, env: ServingEnv, margin: float):
    """``TableGuard`` of the agents (their Q-ensemble, or one DQN's Q-values) over the per-batch-size table in
    ``env`` (an env of the agents' grid); None when the agents are not DQNs on one grid or the table's actions are
    not on it."""
    ensemble = q_ensemble(agents)
    if ensemble is not None:
        q = lambda o: ensemble.q_values(o)[0]  # noqa: E731
    elif len(agents) == 1 and hasattr(agents[0][1], "q_net"):
        q = dqn_q_values(agents[0][1])
    else:
        return None
    rules_env = make_env(cfg, "validation", "constant:0.1")
    try:
        to_agent = grid_map(rules_env, env)
    finally:
        rules_env.close()
    if not set(chosen["batch_table"].values()) | {chosen["off"]} <= set(to_agent):
        return None
    table = BatchTable(chosen["batch_table"], chosen["off"], cfg.env.max_batch, env.config.observe.batch_scale)
    return TableGuard(q, table, to_agent, margin)


def choose_guard(cfg: ServingBenchConfig, chosen: dict, agents: list, seeds: list[int]) -> dict:
    """The agents on the per-batch-size table's floor: the margin of ``guard_for`` that ``keep_where_it_helps``
    keeps over the validation episodes ``seeds`` of every level (``inf``, the table, unless one helps beyond its
    interval); {} where no guard applies."""
    if not agents or any(g != agents[0][2] for _, _, g in agents):
        return {}
    returns = {}
    envs = {u: make_env(cfg, "validation", f"constant:{u}", **agents[0][2]) for u in cfg.levels}
    try:
        if guard_for(cfg, chosen, agents, envs[cfg.levels[0]], 0.0) is None:
            return {}
        for m in GUARD_MARGINS:
            returns[m] = np.concatenate([episodes(envs[u], guard_for(cfg, chosen, agents, envs[u], m), seeds)[0]
                                         for u in cfg.levels])
    finally:
        for e in envs.values():
            e.close()
    return keep_where_it_helps(returns.pop(math.inf), returns)


def choose_floors(cfg: ServingBenchConfig, chosen: dict, agents: list, seeds: list[int]) -> dict[str, tuple[list, dict]]:
    """Every DQN agent on the per-batch-size table's floor, each alone, and their Q-ensemble where several share a
    grid: {name: (the agents it acts with, ``choose_guard``'s choice)}, for those a guard applies to."""
    groups = {name: [(name, a, g)] for name, a, g in agents if hasattr(a, "q_net")}
    if q_ensemble(agents) is not None:
        groups[f"agents' Q-ensemble of {len(agents)}"] = agents
    out = {}
    for name, group in groups.items():
        if choice := choose_guard(cfg, chosen, group, seeds):
            out[name] = (group, choice)
    return out


def choose_bandits(cfg: ServingBenchConfig, envs: dict, seeds: list[int], ranked: list[int]) -> dict:
    """UCBSpec's and EXP3Spec's settings (``agents.common.bandits.choose``): each candidate's mean return over the validation
    envs ({level: env}) and episodes ``seeds``, as the rules are scored; ``ranked``: the actions, best fixed first."""
    def score(bandit) -> float:
        return float(np.mean([episodes(bandits.BanditFeedback(envs[u], bandit), bandit, seeds)[0].mean()
                              for u in cfg.levels]))

    return bandits.choose(score, ranked)


def per_domain(cfg: ServingBenchConfig, seeds: list[int]) -> tuple[dict, dict[float, dict[str, int]]]:
    """Headroom per domain: the best fixed action per (level, domain) against the best single one per domain, on
    single-domain validation workloads; and that table, {level: {domain: action}} (``DomainTable``'s)."""
    out, table = {}, {u: {} for u in cfg.levels}
    for d in cfg.domains:
        means = {}
        for u in cfg.levels:
            env = make_env(cfg, "validation", f"constant:{u}", mix=f"{d}:1")
            fixed = fixed_returns(env, seeds, cfg.fixed_actions)
            means[u] = {a: fixed[a] for a in fixed}
            labels = {a: label(env, a) for a in fixed}
            env.close()
        single = max(labels, key=lambda a: np.mean([means[u][a][0].mean() for u in cfg.levels]))
        out[d] = {"best_single": labels[single], "levels": {}}
        for u in cfg.levels:
            best = max(labels, key=lambda a: means[u][a][0].mean())
            table[u][d] = best
            r_best, s_best = means[u][best]
            r_single, s_single = means[u][single]
            out[d]["levels"][str(u)] = {"table": labels[best], "table_return": float(r_best.mean()),
                                        "single_return": float(r_single.mean()),
                                        "table_minus_single": float((r_best - r_single).mean()),
                                        "table_speedup": float(s_best.mean()), "single_speedup": float(s_single.mean())}
    return out, table
