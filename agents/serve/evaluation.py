"""The ceiling and the hand-written rules of BiLD-Serve-v0, per load level and per domain.

    python evaluate.py --env serve --pair smollm2                           # rules and ceilings (= python -m bench.serving)
    python evaluate.py --env serve --pair smollm2 --model logs/<run1> logs/<run2>   # and agents beside them
    python -m bench.serving --pair tiny-random --speed                      # env steps per second, warm, per load
    python evaluate.py --env serve --load 0.05 0.3 1.0 --model logs/<run>  # on real models and the wall clock instead
                                                                            # (agents.serving_load_clock)

``python evaluate.py --env serve`` starts from ``QUICK`` where the command line is silent (the main job's four load
levels and lossless grid, 4 validation and 8 test episodes per level of 64 steps, one moving load, no bandits:
minutes on a 2-core CPU); ``--full`` starts from the defaults below instead, as ``python -m bench.serving`` does (26
actions, five levels, 8 and 8 episodes of 128 steps, two moving loads, the bandits: hours on a 2-core CPU). One
progress line counts the episodes of the whole evaluation, with the time left; each load's table is printed, and
the JSON at ``--out`` rewritten with the loads done so far (``"complete": false``), as that load is done.

On the replay backend, with the cost model's batched tables, every policy meets the same requests in
the same order (common random numbers: episode seeds shared by every policy):

1. **validation** (``--select-episodes`` per load level of ``--levels``, constant load each): every
   fixed action (the grid and speculation off); from them the best single fixed action over all levels
   (grid search), the per-load table (the best fixed action per level), the batch size above which
   speculation goes off (vLLM's rule; chosen among 1, 2, 4, ... max_batch), and the acceptance threshold
   below which it goes off (chosen among a few); and the settings of the training-free online bandits UCBSpec and
   EXP3Spec (``agents.bandits``: exploration constant or learning rate, and arm set; unless ``--no-bandits``);
2. **per domain** (``--domains``): the best fixed action per (load level, domain) with single-domain
   workloads, and what that table gains over the best single action per domain (headroom per domain);
   and the per-batch-size table per domain, from exact counterfactuals on the mixed workload (one
   domain's action varied at a time); on test both run per request (an env with ``per_domain``: each
   request takes its own domain's action);
3. **test** (``--episodes`` per level, test prompts, other seeds; on ``--test-mix`` where given, a workload the
   rules were not chosen on and the agents not trained on, e.g. with a domain neither saw): every rule, the bandits
   (each episode from scratch: they learn online within it, nothing across episodes), the per-episode oracle (the
   best of the fixed actions for each episode, knowing the returns), with ``--step-oracle`` the per-step
   hindsight oracle (at each step the fixed action whose reward is highest that step, knowing it: what adapting
   every step could win if acceptance were foreseen) and each ``--model`` (with several
   DQNs on one grid, also their Q-ensemble, ``agents.dqn.QEnsemble``); and on the moving loads of
   ``--moving`` (a burst, a daily curve), where the table follows the current level.

Each row: mean return with its 95% bootstrap interval, the difference to the best single fixed action
paired per episode with its interval, and the goodput ratio to target-only serving at the same load;
``overall``: every policy over all the constant levels' episodes together (paired the same way).
Writes ``--out`` (JSON), beside it a plot of goodput against load (``.png``: each policy's goodput
ratio to target-only serving at every constant level), and prints markdown tables.

Every option is checked before any model loads (``check``): counts >= 1, load levels in the range the load
profiles take, actions of the env's grid, the workload, ``--out`` writable and holding no earlier results (unless
``--force``), and every ``--model`` (``check_model``: a readable SB3 model of a BiLD-Serve-v0 run whose observation
and action mean here what they meant in training; a warning where it meets another system). No NaN reaches a
table or the JSON: an evaluation with nothing to measure exits with an error.
"""

from __future__ import annotations

import sys

import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from agents import bandits
from agents.checks import check_outputs, read_model_zip, report_json, trained_on
from agents.config import ConfigError
from agents.eval_progress import advance, counting, episodes
from agents.evaluation import mean_ci
from agents.phases import PhaseBar
from agents.serving_rules import (AcceptanceRule, BatchTable, DomainBatchTable, DomainTable, Fixed, LoadTable,
                                  OffAboveBatch, StepHindsight, TableGuard, bucket_label, choose_batch_table,
                                  choose_domain_batch_table, dqn_q_values, grid_map, returns_of)
from bild_env.decoding.profiles import MACHINE, charged
from bild_env import SERVE_ID
from bild_env.decoding.bild import check_score
from bild_env.cli import field_comments, parse_checked
from bild_env.models.device import explain_dtype
from bild_env.models.pairs import DEFAULT_PAIR, preset_names
from bild_env.prompts.code import check_code_source
from bild_env.serving.env import DEFAULT_MIX, ServingConfig, ServingEnv, validate
from bild_env.serving.load import MAX_UTILISATION, LoadProfile
from bild_env.serving.observations import N_BASE, N_COSTS, N_FORESEE
from bild_env.serving.workload import parse_mix

logger = logging.getLogger(__name__)

SPEED_REPEATS = 5  # timed warm episodes per level of --speed
EVERY_S = 30.0  # seconds between the progress line's reports
COUNTS = ("select_episodes", "episodes", "episode_steps", "max_new_tokens", "max_batch", "threads")  # each >= 1
# An agent's env settings that give its observation or action their meaning (observation 0-2 are shares of
# max_batch, 5 of max_draft_len + 1, 11 of max_new_tokens): refused when this evaluation's differ from its run's
MEANING = {"max_batch": "the batch size, queue and load trend it observes are shares of max_batch",
           "max_new_tokens": "the progress of the requests it observes is a share of max_new_tokens",
           "max_draft_len": "the tokens per request-step it observes are a share of max_draft_len + 1"}
# ... and those that make it act in another system than it learnt in (other models, prompts or reward): warned
SYSTEM = ("pair", "draft", "target", "tokenizer", "dtype", "lean", "draft_vocab", "prompt_tokens", "latency_weight",
          "regret_weight")


@dataclass
class ServingBenchConfig:
    """Options of the serving benchmark (the CLI is generated from it)."""

    pair: str = DEFAULT_PAIR  # model pair preset
    mix: str = DEFAULT_MIX  # the workload
    test_mix: str = ""  # the test episodes' workload (default: mix): rules chosen on mix's validation, agents as trained, met with another
    code_source: str = "humaneval"  # the code domain's prompts: "humaneval" (shipped) or "stdlib" (this Python's library)
    test_code_source: str = ""  # the test episodes' code prompts (default: code_source), e.g. a code corpus nothing was chosen on
    levels: tuple[float, ...] = (0.05, 0.2, 0.4, 0.7, 1.0)  # load levels (utilisation) of the validation and test runs
    moving: tuple[str, ...] = ("burst:0.1,1.0", "daily:0.05,1.0")  # moving loads for the test runs
    domains: tuple[str, ...] = ()  # also the per-domain table on these single-domain workloads (e.g. prose code chat)
    select_episodes: int = 8  # validation episodes per load level (choosing the rules)
    episodes: int = 8  # test episodes per load level
    episode_steps: int = 128
    max_new_tokens: int = 32
    max_batch: int = 32
    max_prompts: int | None = None  # per domain and split
    actions: tuple[int, ...] = ()  # the fixed actions to run (default: all); the off switch is always among them
    charge_loop: tuple[float, ...] = ()  # the batched decoder's own work (ms per step, per forward, per row read; bench.serving_clock fits it): every env charges it with padded rows (ServingConfig.charge_loop); empty: the forwards alone
    score: str = "token"  # what each request's fallback threshold reads in the rules' envs: "token", "cumulative", or on these replay envs "oracle" / "oracle:W" (a predictor of quality W, for measuring room); agents read their own run's
    allocate: bool = False  # the rules' fallback values are prices: each step's drafting depth allocated across the batch (ServingConfig.allocate); agents keep their run's
    model: tuple[str, ...] = ()  # SB3 model files or run folders trained on BiLD-Serve-v0
    dtype: str | None = None
    cost_profile: str | None = None  # charge a stored hardware cost profile (a shipped name or a file; bild_env.decoding.profiles) instead of this machine's cost model
    select_profiles: tuple[str, ...] = ()  # choose the rules on validation episodes charged by these cost profiles (one drawn per episode) instead of the test's cost model: rules tuned on other hardware, met on this one; empty: the test's own
    threads: int = 1  # torch CPU threads
    step_oracle: bool = False  # also the per-step hindsight oracle (agents.serving_rules.StepHindsight; |actions| peeks a step)
    bandits: bool = True  # also UCBSpec and EXP3Spec over the actions (agents.bandits: online per episode, chosen on validation)
    speed: bool = False  # only measure env steps per second on warm trees (each level: one episode to fill, 5 timed)
    out: str = "results/serving_headroom.json"
    force: bool = False  # replace the results of an earlier evaluation at --out (the JSON and its .png)


# What ``python evaluate.py --env serve`` starts from where the command line is silent (``--full``: the dataclass's
# defaults, as ``python -m bench.serving``): the main job's setting (its four load levels, 64-step episodes, 40 prompts
# per domain, the lossless grid it trains on: the five fallbacks at rollback 0.5 and speculation off), 4 validation
# and 8 test episodes per level, one moving load, no bandits. Minutes on a 2-core CPU where the full one takes hours.
QUICK = replace(ServingBenchConfig(), levels=(0.05, 0.15, 0.3, 1.0), moving=("burst:0.05,1.0",), select_episodes=4,
                episodes=8, episode_steps=64, max_prompts=40, actions=(0, 5, 10, 15, 20), bandits=False)


def env_options(cfg: ServingBenchConfig, split: str, load: str, mix: str | None = None, **grid) -> dict:
    """``make_env``'s keyword arguments of ``ServingEnv`` (the rest are ``ServingConfig``'s defaults)."""
    test = split == "test"
    mix = mix or (cfg.test_mix if test and cfg.test_mix else cfg.mix)
    code_source = cfg.test_code_source if test and cfg.test_code_source else cfg.code_source
    costs = ({"train_profiles": tuple(cfg.select_profiles)} if split == "validation" and cfg.select_profiles
             else {"cost_profile": cfg.cost_profile})
    return dict(pair=cfg.pair, dtype=cfg.dtype, split=split, load=load, mix=mix, code_source=code_source,
                episode_steps=cfg.episode_steps, max_new_tokens=cfg.max_new_tokens, max_batch=cfg.max_batch,
                max_prompts=cfg.max_prompts, charge_loop=tuple(cfg.charge_loop), **costs,
                **({"score": cfg.score, "allocate": cfg.allocate} | grid))


def make_env(cfg: ServingBenchConfig, split: str, load: str, mix: str | None = None, **grid) -> ServingEnv:
    """The benchmark's env; ``grid``: an agent's own action grid (fallback_values, rollback_values, off_switch).
    Test envs take ``test_mix`` and ``test_code_source`` where they are given."""
    return ServingEnv(**env_options(cfg, split, load, mix, **grid))


def action_set(env: ServingEnv, actions: tuple[int, ...]) -> list[int]:
    """``actions`` (all of the env's when empty; of one request with ``per_domain``) with speculation off among them."""
    n = env.n_actions
    bad = [a for a in actions if not 0 <= a < n]
    if bad:
        raise ValueError(f"--actions: {bad} not in [0, {n})")
    return sorted(set(actions) | {n - 1}) if actions else list(range(n))


def fixed_returns(env: ServingEnv, seeds: list[int],
                  actions: tuple[int, ...] = ()) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Every fixed action's (returns, speedups) over ``seeds``."""
    out = {}
    for a in action_set(env, actions):
        r, s, _ = episodes(env, Fixed(a), seeds)
        out[a] = (r, s)
    return out


def label(env: ServingEnv, a: int, thresholds_only: bool = False) -> str:
    """Action ``a`` in words: "off", "(fallback, rollback)", or with ``allocate`` (unless ``thresholds_only``)
    "(price P, rollback)"."""
    t = env.thresholds(a)
    price = env.config.allocate and not thresholds_only
    return "off" if t is None else f"({'price ' if price else ''}{t[0]:g}, {t[1]:g})"


def row(name: str, returns: np.ndarray, speedups: np.ndarray, base: np.ndarray | None) -> dict:
    lo, hi = mean_ci(returns)
    out = {"policy": name, "return": float(returns.mean()), "ci": [lo, hi], "speedup": float(speedups.mean()),
           "_episodes": (returns, speedups)}
    if base is not None:
        d = returns - base
        out["minus_best_single"] = float(d.mean())
        out["minus_best_single_ci"] = list(mean_ci(d))
    return out


def fixed_by_level(cfg: ServingBenchConfig, seeds: list[int], **grid) -> tuple[dict, dict]:
    """Validation envs at each level of ``cfg.levels`` (constant load, left open) and every fixed action's
    (returns, speedups) on episodes ``seeds`` in each: ({level: env}, {level: {action: (returns, speedups)}})."""
    envs, by_level = {}, {}
    for u in cfg.levels:
        envs[u] = make_env(cfg, "validation", f"constant:{u}", **grid)
        by_level[u] = fixed_returns(envs[u], seeds, cfg.actions)
    return envs, by_level


def batch_table_from(envs: dict, table: dict[float, int], seeds: list[int], grid: list[int]) -> tuple[dict, dict]:
    """The per-batch-size table (``choose_batch_table``): exact step rewards of every action of ``grid`` at the states
    the per-load ``table`` visits in each of ``envs`` ({level: validation env}; a level ``table`` lacks plays its
    nearest level's action). Returns (table, mean reward per bucket and action)."""
    levels = list(envs)
    behaviour = [LoadTable(envs[u], {u: table[min(table, key=lambda v, u=u: abs(v - u))]}) for u in levels]
    out = choose_batch_table([envs[u] for u in levels], behaviour, seeds, grid)
    advance(len(levels) * len(seeds))
    return out


def best_per_level(by_level: dict) -> dict[float, int]:
    """The per-load table: at each level the fixed action with the best mean return (``fixed_by_level``'s runs)."""
    return {u: max(fixed, key=lambda a, fixed=fixed: fixed[a][0].mean()) for u, fixed in by_level.items()}


def choose(cfg: ServingBenchConfig, seeds: list[int]) -> dict:
    """Validation: every fixed action per level; the rules' settings chosen from them."""
    envs, by_level = fixed_by_level(cfg, seeds)
    env = envs[cfg.levels[0]]
    grid = action_set(env, cfg.actions)
    off = env.action_space.n - 1
    total = {a: float(np.mean([by_level[u][a][0].mean() for u in cfg.levels])) for a in grid}
    best = max(total, key=total.get)
    table = best_per_level(by_level)
    best_on = max((a for a in grid if a != off), key=total.get)
    rules = {}
    for b in sorted({min(cfg.max_batch, 2**k) for k in range(8)}):
        rules[("batch", b)] = OffAboveBatch(best_on, off, b, cfg.max_batch, env.config.batch_scale)
    for t in (0.2, 0.3, 0.4, 0.5):
        rules[("acceptance", t)] = AcceptanceRule(best_on, off, t)
    scores = {}
    for key, rule in rules.items():
        scores[key] = float(np.mean([episodes(envs[u], rule, seeds)[0].mean() for u in cfg.levels]))
    batch_key = max((k for k in scores if k[0] == "batch"), key=scores.get)
    acc_key = max((k for k in scores if k[0] == "acceptance"), key=scores.get)
    batch_table, bucket_means = batch_table_from(envs, table, seeds, grid)
    ranked = sorted(grid, key=lambda a: -total[a])  # the best fixed action over the levels first
    chosen_bandits = choose_bandits(cfg, envs, seeds, ranked) if cfg.bandits else {}
    for e in envs.values():
        e.close()
    return {"best_single": best, "best_on": best_on, "off": off, "table": table, "batch_table": batch_table,
            "batch_table_means": {bucket_label(k): {label(env, a): m for a, m in v.items()} for k, v in bucket_means.items()},
            "off_above_batch": batch_key[1],
            "acceptance_threshold": acc_key[1], "labels": {a: label(env, a) for a in range(env.action_space.n)},
            "validation_means": {str(u): {label(env, a): float(by_level[u][a][0].mean()) for a in grid}
                                 for u in cfg.levels},
            "rule_scores": {f"{k[0]}:{k[1]}": v for k, v in scores.items()}, "bandits": chosen_bandits}


GUARD_MARGINS = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, math.inf)  # TableGuard's margins tried on validation


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
    table = BatchTable(chosen["batch_table"], chosen["off"], cfg.max_batch, env.config.batch_scale)
    return TableGuard(q, table, to_agent, margin)


def choose_guard(cfg: ServingBenchConfig, chosen: dict, agents: list, seeds: list[int]) -> dict:
    """The margin of ``guard_for`` with the best mean return over the validation episodes ``seeds`` of every level
    (ties: the larger margin, closer to the table); {} where no guard applies."""
    if not agents or any(g != agents[0][2] for _, _, g in agents):
        return {}
    means = {}
    envs = {u: make_env(cfg, "validation", f"constant:{u}", **agents[0][2]) for u in cfg.levels}
    try:
        if guard_for(cfg, chosen, agents, envs[cfg.levels[0]], 0.0) is None:
            return {}
        for m in GUARD_MARGINS:
            means[m] = float(np.mean([episodes(envs[u], guard_for(cfg, chosen, agents, envs[u], m), seeds)[0].mean()
                                      for u in cfg.levels]))
    finally:
        for e in envs.values():
            e.close()
    best = max(sorted(means, reverse=True), key=lambda m: means[m])  # max keeps the first of equals: the larger
    return {"margin": best, "validation_means": {f"{m:g}": v for m, v in means.items()}}


def choose_bandits(cfg: ServingBenchConfig, envs: dict, seeds: list[int], ranked: list[int]) -> dict:
    """UCBSpec's and EXP3Spec's settings (``agents.bandits.choose``): each candidate's mean return over the validation
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
            fixed = fixed_returns(env, seeds, cfg.actions)
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


def test_rows(cfg: ServingBenchConfig, chosen: dict, agents: list, seeds: list[int], load: str,
              raw: dict | None = None) -> list[dict]:
    """The test rows of every policy under ``load``; ``raw`` (when given) collects each policy's per-episode
    (returns, speedups) for the overall rows."""
    env = make_env(cfg, "test", load)
    fixed = fixed_returns(env, seeds, cfg.actions)
    base_r, base_s = fixed[chosen["best_single"]]
    ids = list(fixed)
    stacked = np.stack([fixed[a][0] for a in ids])
    oracle_r, best = stacked.max(axis=0), stacked.argmax(axis=0)
    oracle_s = np.array([fixed[ids[int(k)]][1][i] for i, k in enumerate(best)])
    labels = chosen["labels"]
    rows = [row(f"best single fixed {labels[chosen['best_single']]}", base_r, base_s, base_r),
            row("speculation off", *fixed[chosen["off"]], base_r)]
    table = LoadTable(env, chosen["table"])
    rows.append(row("per-load table (" + ", ".join(f"{u:g}: {labels[a]}" for u, a in chosen["table"].items()) + ")",
                    *episodes(env, table, seeds)[:2], base_r))
    rows.append(row("per-batch-size table (" + ", ".join(f"{bucket_label(k)}: {labels[a]}"
                                                        for k, a in chosen["batch_table"].items()) + ")",
                    *episodes(env, BatchTable(chosen["batch_table"], chosen["off"], cfg.max_batch, env.config.batch_scale), seeds)[:2],
                    base_r))
    if chosen.get("thresholds"):  # with --allocate: the thresholds' per-batch-size table, in an env of thresholds
        below = chosen["thresholds"]
        own = make_env(cfg, "test", load, allocate=False)
        rows.append(row("per-batch-size table of thresholds ("
                        + ", ".join(f"{bucket_label(k)}: {below['labels'][a]}" for k, a in below["batch_table"].items())
                        + ")", *episodes(own, BatchTable(below["batch_table"], below["off"], cfg.max_batch,
                                                          own.config.batch_scale), seeds)[:2], base_r))
        own.close()
    rows.append(row(f"off above batch {chosen['off_above_batch']}, else {labels[chosen['best_on']]}",
                    *episodes(env, OffAboveBatch(chosen["best_on"], chosen["off"], chosen["off_above_batch"],
                                                   cfg.max_batch, env.config.batch_scale), seeds)[:2], base_r))
    rows.append(row(f"off below acceptance {chosen['acceptance_threshold']:g}",
                    *episodes(env, AcceptanceRule(chosen["best_on"], chosen["off"],
                                                    chosen["acceptance_threshold"]), seeds)[:2], base_r))
    for kind, entry in chosen.get("bandits", {}).items():  # online per episode: a fresh bandit, reset every episode
        bandit = bandits.chosen_bandit(kind, entry)
        rows.append(row(bandits.describe(kind, entry, labels.__getitem__),
                        *episodes(bandits.BanditFeedback(env, bandit), bandit, seeds)[:2], base_r))
    if chosen.get("domain_table"):  # each request its domain's action: an env that takes an action per domain
        own = make_env(cfg, "test", load, per_domain=True)
        rows.append(row("per-domain-and-load table, per request ("
                        + "; ".join(f"{u:g}: " + ", ".join(f"{d} {labels[a]}" for d, a in t.items())
                                    for u, t in chosen["domain_table"].items()) + ")",
                        *episodes(own, DomainTable(own, chosen["domain_table"]), seeds)[:2], base_r))
        rows.append(row("per-batch-size-and-domain table, per request ("
                        + ", ".join(f"{bucket_label(k)} {d}: {labels[a]}" for (k, d), a in chosen["domain_batch_table"].items()
                                    if a != chosen["off"]) + "; else off)",
                        *episodes(own, DomainBatchTable(own, chosen["domain_batch_table"], chosen["off"]), seeds)[:2],
                        base_r))
        own.close()
    rows.append(row("per-episode oracle of the fixed actions", oracle_r, oracle_s, base_r))
    if cfg.step_oracle:
        rows.append(row("per-step hindsight oracle of the fixed actions",
                        *episodes(env, StepHindsight(env, ids), seeds)[:2], base_r))
    agent_runs = []
    for name, agent, grid in agents:  # each in an env with its own action grid: the same requests and arrivals
        own = make_env(cfg, "test", load, **grid) if grid else env
        agent_runs.append(episodes(own, agent, seeds)[:2])
        rows.append(row(name, *agent_runs[-1], base_r))
        if own is not env:
            own.close()
    ensemble = q_ensemble(agents)
    if ensemble is not None:  # one agent: the members' mean Q-values
        own = make_env(cfg, "test", load, **agents[0][2]) if agents[0][2] else env
        rows.append(row(f"agents' Q-ensemble of {len(agents)}", *episodes(own, ensemble, seeds)[:2], base_r))
        if own is not env:
            own.close()
    if chosen.get("guard"):  # the agents departing from the per-batch-size table only where sure (TableGuard)
        own = make_env(cfg, "test", load, **agents[0][2]) if agents[0][2] else env
        margin = chosen["guard"]["margin"]
        rows.append(row(f"agents guarded by the per-batch-size table (margin {margin:g}, chosen on validation)",
                        *episodes(own, guard_for(cfg, chosen, agents, own, margin), seeds)[:2], base_r))
        if own is not env:
            own.close()
    if len(agent_runs) > 1:  # the seeds together: each episode's mean over the agents (an interval over episodes)
        rows.append(row(f"agents, mean of {len(agent_runs)}", np.mean([r for r, _ in agent_runs], axis=0),
                        np.mean([s for _, s in agent_runs], axis=0), base_r))
    env.close()
    add_minus_table(rows)
    for r in rows:
        per_episode = r.pop("_episodes")
        if raw is not None:
            raw.setdefault(r["policy"].split(" (")[0].split(",")[0], []).append(per_episode)
    return rows


def overall_rows(raw: dict[str, list[tuple[np.ndarray, np.ndarray]]]) -> list[dict]:
    """Every policy over all levels' episodes together, paired with the best single fixed action's."""
    joined = {name: (np.concatenate([r for r, _ in parts]), np.concatenate([s for _, s in parts]))
              for name, parts in raw.items()}
    base = next(v for k, v in joined.items() if k.startswith("best single fixed"))[0]
    return add_minus_table([row(name, r, s, base) for name, (r, s) in joined.items()])


REFERENCES = (("minus_table", "per-load table"), ("minus_batch_table", "per-batch-size table"),
              ("minus_domain_batch_table", "per-batch-size-and-domain table"),
              ("minus_threshold_table", "per-batch-size table of thresholds"))  # (row key, the rule's row name)


def add_minus_table(rows: list[dict]) -> list[dict]:
    """Every row's paired difference (episode by episode, with its interval) to the per-load table's returns
    (``minus_table``), to the per-batch-size table's (``minus_batch_table``) and to the per-(batch size, domain)
    table's (``minus_domain_batch_table``), where those rules ran."""
    for key, name in REFERENCES:
        found = next((r for r in rows if r["policy"] == name or r["policy"].startswith((name + " (", name + ","))), None)
        if found is None:
            continue
        for r in rows:
            d = r["_episodes"][0] - found["_episodes"][0]
            r[key], r[key + "_ci"] = float(d.mean()), list(mean_ci(d))
    return rows


def plot_goodput(report: dict, path: Path) -> Path:
    """Goodput (ratio to target-only serving at the same load) against the load level, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(report["levels"], key=float)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = [r["policy"] for r in report["levels"][levels[0]]]
    colors = plt.cm.tab20.colors  # more policies than the default cycle's 10 colours
    for i, name in enumerate(names):
        ys = [report["levels"][u][i]["speedup"] for u in levels]
        agent = name.startswith("agent")
        ax.plot([float(u) for u in levels], ys, marker="o", lw=2 if name.startswith("agents,") else 1,
                ls="--" if agent else "-", color=colors[(2 * i + i // 10) % 20],  # dark shades, then light
                label=name if len(name) < 60 else name[:57] + "...")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("load (utilisation of target-only capacity)")
    ax.set_ylabel("goodput / target-only goodput")
    ax.set_title(f"BiLD-Serve-v0 on test prompts ({report['config']['pair']}, mix {report['config']['mix']})")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def load_agents(cfg: ServingBenchConfig) -> list:
    """(name, model) of every ``--model``: a model file, or a run folder's best model on validation (else its
    last), checked against the env's spaces (a clear error otherwise)."""
    from agents.runs import choose_model, load_agent

    if not cfg.model:
        return []
    out = []
    for p in cfg.model:
        path = choose_model(p)[0]
        grid = agent_grid(path)
        env = make_env(cfg, "test", f"constant:{cfg.levels[0]}", **grid)
        try:
            names = {n for n, _, _ in out}  # rows are keyed by name: two runs of one folder name are told apart
            name = next(n for n in (f"agent {Path(p).name}", f"agent {p}", *(f"agent {p} #{i}" for i in range(2, 99)))
                        if n not in names)
            out.append((name, load_agent(path, env), grid))
        finally:
            env.close()
    return out


def q_ensemble(agents: list):
    """The agents as one ``QEnsemble`` (their mean Q-values) when there are several DQNs on one grid; else None."""
    from agents.dqn import QEnsemble

    if len(agents) < 2 or any(g != agents[0][2] for _, _, g in agents) or not all(hasattr(a, "q_net") for _, a, _ in agents):
        return None
    return QEnsemble([a for _, a, _ in agents])


GRID_FIELDS = ("fallback_values", "rollback_values", "off_switch", "observe_domain", "per_domain",
               "batch_scale", "observe_next", "read_ahead_batch", "score", "allocate", "observe_costs")  # an agent's spaces, how it reads its observation, what its thresholds read


def serve_run_env(model_path: Path) -> ServingConfig | None:
    """The env options of the serving run a model file belongs to (its ``config.json`` beside it or above
    ``checkpoints/``, read as a resume reads it); None for a model without one. A ``ConfigError`` naming the file for
    a run of another env (a BiLD-v1 run) or a config that cannot be read."""
    from agents.serving_training import saved_configs

    config, env_id = trained_on(model_path)
    if config is None:
        return None
    if env_id is not None and env_id != SERVE_ID:
        raise ConfigError(f"{model_path} is a model of a {env_id} run ({config}), not of a {SERVE_ID} one: evaluate "
                          f"it without --env serve (python evaluate.py --model {config.parent})")
    try:
        return saved_configs(config.parent)[1]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        raise ConfigError(f"cannot read the run's config {config} ({type(err).__name__}: {err}): repair it, or move it "
                          "away to run the model in this evaluation's env") from err


def agent_grid(model_path: Path) -> dict:
    """The action grid a serving run was trained with (``serve_run_env``), where it is not the env's default; {} for
    a model without a run config."""
    env, default = serve_run_env(model_path), ServingConfig()
    if env is None:
        return {}
    return {k: getattr(env, k) for k in GRID_FIELDS if getattr(env, k) != getattr(default, k) or k in ("score", "allocate")}


def planned_episodes(cfg: ServingBenchConfig, agents: list, guard: bool) -> int:
    """The episodes ``run`` will run (its progress line's total): on validation every fixed action, the rules scored
    there, the per-batch-size table's, the bandits' candidates, the guard's margins (``guard``), per level; on test
    each row's, per constant and moving load. Exact but for ``--domains`` (the per-domain tables' own runs: about)."""
    n, _ = grid_size()
    fixed = len(set(cfg.actions) | {n - 1}) if cfg.actions else n
    rules = len({min(cfg.max_batch, 2**k) for k in range(8)}) + 4  # off above batch b; off below acceptance t
    one_grid = len({str(g) for _, _, g in agents}) == 1
    validation = fixed + rules + 1 + (len(bandits.candidates(list(range(fixed)))) if cfg.bandits else 0)
    validation += (fixed + rules + 1) * cfg.allocate + len(GUARD_MARGINS) * guard
    validation += (len(cfg.domains) * fixed + 1) if cfg.domains else 0
    test = (fixed + 4 + 2 * cfg.bandits + cfg.allocate + 2 * bool(cfg.domains) + cfg.step_oracle + len(agents)
            + (len(agents) > 1 and one_grid) + guard)
    return (len(cfg.levels) * cfg.select_episodes * validation
            + (len(cfg.levels) + len(cfg.moving)) * cfg.episodes * test)


def run(cfg: ServingBenchConfig, done: Callable[[dict, str, str], None] | None = None,
        say: Callable[[str], None] | None = None) -> dict:
    """Validation, then test at every level and moving load (the module's docstring): the report. One progress line
    (``say``, default stderr) counts every episode of the whole evaluation against ``planned_episodes``;
    ``done(report, section, load)`` is called as each load's test rows are in (``section`` "levels" or "moving")."""
    torch.set_num_threads(cfg.threads)
    agents = load_agents(cfg)  # before the validation runs: a model that does not fit fails now, not minutes later
    bar = PhaseBar("evaluation", "episode", say or (lambda text: print(text, file=sys.stderr, flush=True)), EVERY_S)
    bar.plan(planned_episodes(cfg, agents, guard=bool(agents)))
    with counting(bar):
        return _run(cfg, agents, bar, done or (lambda *_: None))


def _run(cfg: ServingBenchConfig, agents: list, bar: PhaseBar, done: Callable[[dict, str, str], None]) -> dict:
    t0 = time.perf_counter()
    select_seeds = list(range(1000, 1000 + cfg.select_episodes))
    test_seeds = list(range(cfg.episodes))
    chosen = choose(cfg, select_seeds)
    chosen["guard"] = choose_guard(cfg, chosen, agents, select_seeds)
    bar.plan(planned_episodes(cfg, agents, guard=bool(chosen["guard"])))  # now known: whether a guard runs
    if cfg.allocate:  # the rules of thresholds beside the allocation's: their per-batch-size table, chosen alike
        below = choose(replace(cfg, allocate=False, bandits=False), select_seeds)
        chosen["thresholds"] = {k: below[k] for k in ("batch_table", "off", "labels")}
    report = {"config": asdict(cfg), "chosen": {k: v for k, v in chosen.items() if k != "labels"},
              "levels": {}, "moving": {}, "cost_profile": charged(cfg.cost_profile),
              "rules_chosen_under": list(cfg.select_profiles) or charged(cfg.cost_profile)}
    report["chosen"]["table"] = {str(u): chosen["labels"][a] for u, a in chosen["table"].items()}
    report["chosen"]["best_single"] = chosen["labels"][chosen["best_single"]]
    if "thresholds" in chosen:
        report["chosen"]["threshold_batch_table"] = {bucket_label(k): chosen["thresholds"]["labels"][a]
                                                     for k, a in chosen["thresholds"]["batch_table"].items()}
    if chosen["guard"]:
        report["chosen"]["guard"] = chosen["guard"] | {"margin": f"{chosen['guard']['margin']:g}"}  # inf: the table
    report["chosen"].pop("thresholds", None)
    report["chosen"]["bandits"] = {kind: entry | {"arm_labels": [chosen["labels"][a] for a in entry["arms"]]}
                                   for kind, entry in chosen["bandits"].items()}
    if cfg.domains:  # the per-domain table first: on test it runs as a rule, each request its domain's action
        report["domains"], domain_table = per_domain(cfg, select_seeds)
        mix = parse_mix(cfg.mix)
        chosen["domain_table"] = {u: {d: domain_table[u].get(d, chosen["table"][u]) for d in mix} for u in cfg.levels}
        report["chosen"]["domain_table"] = {str(u): {d: chosen["labels"][a] for d, a in t.items()}
                                            for u, t in chosen["domain_table"].items()}
        # and the per-batch-size table per domain, from exact counterfactuals on the mixed validation episodes
        envs = [make_env(cfg, "validation", f"constant:{u}", per_domain=True) for u in cfg.levels]
        grid = action_set(envs[0], cfg.actions)
        chosen["domain_batch_table"], means = choose_domain_batch_table(
            envs, [BatchTable(chosen["batch_table"], chosen["off"], cfg.max_batch, envs[0].config.batch_scale)] * len(envs), select_seeds, grid)
        advance(len(envs) * len(select_seeds))
        for e in envs:
            e.close()
        report["chosen"]["domain_batch_table"] = {f"{bucket_label(k)} {d}": chosen["labels"][a]
                                                  for (k, d), a in chosen["domain_batch_table"].items()}
        report["chosen"]["domain_batch_table_means"] = {
            f"{bucket_label(k)} {d}": {chosen["labels"][a]: m for a, m in v.items()} for (k, d), v in means.items()}
    from bild_env.models.device import machine_description

    report["machine"] = machine_description()
    raw: dict = {}
    for u in cfg.levels:
        report["levels"][str(u)] = test_rows(cfg, chosen, agents, test_seeds, f"constant:{u}", raw)
        report["seconds"] = time.perf_counter() - t0
        done(report, "levels", str(u))
    report["overall"] = overall_rows(raw)
    for r in report["overall"]:
        r.pop("_episodes")
    for load in cfg.moving:
        report["moving"][load] = test_rows(cfg, chosen, agents, test_seeds, load)
        report["seconds"] = time.perf_counter() - t0
        done(report, "moving", load)
    report["seconds"] = time.perf_counter() - t0
    return report


def speed(cfg: ServingBenchConfig) -> dict:
    """Env steps per second of a lossless fixed action, (0.45, 0.5), per load level on warm replay trees: each
    level's episode runs once to fill the trees, then ``SPEED_REPEATS`` more times (same seed, so every answer
    is a hit), each timed; the median and the range are reported (a busy machine shows as a wide range)."""
    torch.set_num_threads(cfg.threads)
    rows = {}
    for u in cfg.levels:
        env = make_env(cfg, "validation", f"constant:{u}")
        episodes(env, Fixed(15), [0])
        rates = []
        for _ in range(SPEED_REPEATS):
            t0 = time.perf_counter()
            _, _, eps = episodes(env, Fixed(15), [0])
            rates.append(len(eps[0].actions) / (time.perf_counter() - t0))
        rows[str(u)] = {"steps_per_s": float(np.median(rates)), "range": [min(rates), max(rates)],
                        "mean_batch": eps[0].summary["mean_batch"]}
        env.close()
    from bild_env.models.device import machine_description

    return {"config": asdict(cfg), "speed": rows, "machine": machine_description()}


def markdown(report: dict) -> str:
    if "speed" in report:
        return "\n".join(["| load | mean batch | env steps/s (warm, median) | range |", "|---|---|---|---|"]
                         + [f"| {u} | {r['mean_batch']:.1f} | {r['steps_per_s']:.0f} | {r['range'][0]:.0f}-{r['range'][1]:.0f} |"
                            for u, r in report["speed"].items()])
    lines = [f"costs charged: {report.get('cost_profile', MACHINE)}; rules chosen under: "
             f"{report.get('rules_chosen_under', report.get('cost_profile', MACHINE))}", ""]
    sections = [("levels", load, rows) for load, rows in report["levels"].items()]
    sections += [("overall", "all constant levels", report["overall"])] if report.get("overall") else []
    sections += [("moving", load, rows) for load, rows in report["moving"].items()]
    for kind, load, rows in sections:
        keys = ["minus_best_single", "minus_table", "minus_batch_table"]
        keys += [k for k in ("minus_domain_batch_table", "minus_threshold_table") if any(k in r for r in rows)]
        heads = {"minus_best_single": "best single", "minus_table": "per-load table",
                 "minus_batch_table": "per-batch-size table", "minus_domain_batch_table": "per-(batch size, domain) table",
                 "minus_threshold_table": "per-batch-size table of thresholds"}
        lines += [f"\n**{'load ' + load if kind == 'levels' else load}**\n",
                  "| policy | return [95% CI] | " + " | ".join(f"minus {heads[k]} [paired 95% CI]" for k in keys)
                  + " | speedup vs target-only |", "|---" * (len(keys) + 3) + "|"]
        for r in rows:
            cells = []
            for key in keys:
                if key in r:
                    lo, hi = r[key + "_ci"]
                    cells.append(f"{r[key]:+.3f} [{lo:+.3f}, {hi:+.3f}]")
                else:
                    cells.append("-")
            lines.append(f"| {r['policy']} | {r['return']:+.3f} [{r['ci'][0]:+.3f}, {r['ci'][1]:+.3f}] | "
                         + " | ".join(cells) + f" | {r['speedup']:.3f}x |")
    for d, v in report.get("domains", {}).items():
        lines += [f"\n**domain {d}** (best single: {v['best_single']})\n",
                  "| load | table's action | table minus single | table speedup | single speedup |", "|---|---|---|---|---|"]
        for u, x in v["levels"].items():
            lines.append(f"| {u} | {x['table']} | {x['table_minus_single']:+.3f} | {x['table_speedup']:.3f}x | "
                         f"{x['single_speedup']:.3f}x |")
    return "\n".join(lines)


def check(cfg: ServingBenchConfig) -> None:
    """Refuse options that make no sense before any model loads, naming the option and what it takes: counts, load
    levels, actions, the models' settings (``--pair``, ``--dtype``), the workload (``mix`` and ``test_mix``, and
    per-domain tables that would meet a domain they have no action for), the output (``check_out``) and every
    ``--model`` (``check_model``)."""
    check_counts(cfg)
    check_loads(cfg)
    check_actions(cfg.actions)
    try:
        check_score(cfg.score)
    except ValueError as err:
        raise ValueError(f"--score: {err}") from None
    if cfg.pair not in preset_names():
        raise ValueError(f"--pair: unknown pair {cfg.pair!r}; choose one of {', '.join(preset_names())}")
    try:
        explain_dtype(cfg.dtype, "cpu")
    except ValueError as err:
        raise ValueError(f"--dtype: {err}") from None
    for d in cfg.domains:
        try:
            parse_mix(d)
        except ValueError as err:
            raise ValueError(f"--domains: {err}") from None
    for option, checker in (("mix", parse_mix), ("test_mix", parse_mix), ("code_source", check_code_source),
                            ("test_code_source", check_code_source)):
        if option.startswith("test_") and not getattr(cfg, option):
            continue  # empty: the test episodes take the option without "test_"
        try:
            checker(getattr(cfg, option))
        except ValueError as err:
            raise ValueError(f"--{option.replace('_', '-')}: {err}") from None
    if cfg.test_mix:
        unseen = sorted(set(parse_mix(cfg.test_mix)) - set(cfg.domains)) if cfg.domains else []
        if unseen:
            raise ValueError(f"--test-mix {cfg.test_mix!r} has domain(s) {unseen} the per-domain tables of --domains "
                             f"{' '.join(cfg.domains)} have no action for: leave --domains out, or add them to it")
    for split in ("validation", "test"):  # what is left, as the env checks it (e.g. the mix with its code source)
        validate(ServingConfig(**env_options(cfg, split, f"constant:{cfg.levels[0]}")))
    if cfg.speed and cfg.model:
        raise ValueError("--speed measures the env's steps per second only: --model would not run; leave one out")
    check_out(cfg)
    for given in cfg.model:
        check_model(cfg, given)


def check_counts(cfg: ServingBenchConfig) -> None:
    """Every count (``COUNTS``, and ``max_prompts`` where given) an integer >= 1: a count of 0 measures nothing."""
    comments = field_comments(ServingBenchConfig)
    for name in COUNTS + (("max_prompts",) if cfg.max_prompts is not None else ()):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            what = f": {comments[name]}" if name in comments else ""
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}{what}")


def check_loads(cfg: ServingBenchConfig) -> None:
    """``levels``: utilisations in (0, ``MAX_UTILISATION``], each once; ``moving``: load profiles
    (``bild_env.serving.load``)."""
    if not cfg.levels:
        raise ValueError("--levels: give at least one load level, e.g. --levels 0.05 0.2 1.0")
    for i, u in enumerate(cfg.levels):
        if not (math.isfinite(u) and 0.0 < u <= MAX_UTILISATION):
            raise ValueError(f"--levels: {u:g} is outside (0, {MAX_UTILISATION:g}] (a load level is a utilisation: "
                             "the arrival rate as a share of what target-only decoding of a full batch serves)")
        if u in cfg.levels[:i]:
            raise ValueError(f"--levels: {u:g} is given twice (each level is a table of its own)")
    for i, spec in enumerate(cfg.moving):
        LoadProfile.parse(spec, "--moving")
        if spec in cfg.moving[:i]:
            raise ValueError(f"--moving: {spec!r} is given twice (each moving load is a table of its own)")


def grid_size() -> tuple[int, str]:
    """The number of actions of the env the rules run in (``ServingConfig``'s grid and off switch), and which."""
    env = ServingConfig()
    n_grid = len(env.fallback_values) * len(env.rollback_values)
    what = f"{len(env.fallback_values)} fallbacks x {len(env.rollback_values)} rollbacks: 0-{n_grid - 1}"
    return n_grid + int(env.off_switch), what + (f", {n_grid} speculation off" if env.off_switch else "")


def check_actions(actions: tuple[int, ...]) -> None:
    n, what = grid_size()
    bad = [a for a in actions if not 0 <= a < n]
    if bad:
        raise ValueError(f"--actions: {bad} not in the env's action grid 0-{n - 1} ({what})")


def outputs(cfg: ServingBenchConfig) -> tuple[Path, Path]:
    """What an evaluation writes: ``--out`` (the JSON) and the goodput plot beside it."""
    out = Path(cfg.out)
    return out, out.with_suffix(".png")


def check_out(cfg: ServingBenchConfig) -> None:
    """``--out`` names a file whose folder can be written into, and no earlier evaluation's results lie there unless
    ``--force`` (they would be overwritten, or a stale plot left beside a new JSON)."""
    out, plot = outputs(cfg)
    if out == plot:
        raise ValueError(f"--out {out}: the goodput plot goes beside the JSON as .png; give another name, e.g. "
                         f"--out {out.with_suffix('.json')}")
    check_outputs([out, plot], cfg.force)


def check_model(cfg: ServingBenchConfig, given: str) -> None:
    """A ``--model`` must be a readable SB3 model of a BiLD-Serve-v0 run whose observation and action mean here what
    they meant in training (``MEANING``, the domains it observes, its spaces): a ``ValueError`` naming it otherwise;
    a warning where it acts in another system than it learnt in (``SYSTEM``) or its settings are unknown (no run
    config). Reads the run's config.json and the zip's saved spaces; no model of the pair loads."""
    from agents.runs import choose_model

    path = choose_model(given)[0]
    if not path.is_file():
        raise ValueError(f"--model {given}: no model file at {path}")
    config, env_id = trained_on(path)
    if env_id is not None and env_id != SERVE_ID:
        raise ValueError(f"--model {given} is a {env_id} run ({config}), not a {SERVE_ID} one: evaluate it without "
                         f"--env serve (python evaluate.py --model {given})")
    try:
        run_env = serve_run_env(path)
        saved = read_model_zip(path)
    except ConfigError as err:
        raise ValueError(f"--model {given}: {err}") from None
    grid = {k: getattr(run_env, k) for k in GRID_FIELDS} if run_env is not None else {}
    here = ServingConfig(**env_options(cfg, "test", f"constant:{cfg.levels[0]}", **grid))  # the env it will act in
    if run_env is not None:
        check_meaning(cfg, given, config, run_env, here)
    check_spaces(given, path, saved, here, run_env is not None)
    if run_env is None:
        logger.warning(f"--model {given}: no run config beside {path}: it runs in this evaluation's env (max_batch "
                       f"{here.max_batch}, max_new_tokens {here.max_new_tokens}, max_draft_len {here.max_draft_len}, "
                       f"batch_scale {here.batch_scale}, BiLD-v1's grid); its spaces fit, but whether it was trained "
                       "with these settings cannot be checked")
        return
    differ = [f"{k} {getattr(run_env, k)!r} (here {getattr(here, k)!r})" for k in SYSTEM
              if getattr(run_env, k) != getattr(here, k)]
    if differ:
        logger.warning(f"--model {given} was trained with {', '.join(differ)}: it acts on models, prompts or a reward "
                       "it never learnt on (its observation keeps its meaning); its rows measure it there")


def check_meaning(cfg: ServingBenchConfig, given: str, config: Path, run_env: ServingConfig,
                  here: ServingConfig) -> None:
    """Refuse a model whose observation or action would mean something else in the env it will act in (``here``)
    than in its run's (``run_env``): another action kind, other domains observed, other scales (``MEANING``)."""
    if run_env.action != "discrete":
        raise ValueError(f"--model {given} acts on a {run_env.action} action ({config}); this evaluation runs agents "
                         "of the discrete action only")
    if domains_of(run_env) != domains_of(here):
        raise ValueError(f"--model {given} observes{' and acts for' if run_env.per_domain else ''} each domain of its "
                         f"run's workload ({', '.join(domains_of(run_env))}), but this evaluation's test workload has "
                         f"{', '.join(domains_of(here))}: its observation would mean something else; give --mix (or "
                         f"--test-mix) over the domains it was trained on, e.g. --mix {run_env.mix}")
    for name, meaning in MEANING.items():
        if getattr(run_env, name) != getattr(here, name):
            fix = (f"give --{name.replace('_', '-')} {getattr(run_env, name)}" if hasattr(cfg, name)
                   else f"{name} is not an option of this evaluation (it runs {SERVE_ID}'s default)")
            raise ValueError(f"--model {given} was trained with {name} {getattr(run_env, name)} ({config}), this "
                             f"evaluation runs {name} {getattr(here, name)}: {meaning}, so its observation would mean "
                             f"something else; {fix}")


def space_name(space) -> str:
    """A space in short: ``Box(14,)``, ``Discrete(6)``, ``MultiDiscrete([6, 6])``."""
    if hasattr(space, "n"):
        return f"Discrete({space.n})"
    if hasattr(space, "nvec"):
        return f"MultiDiscrete({list(space.nvec)})"
    return f"{type(space).__name__}{getattr(space, 'shape', '')}"


def domains_of(env: ServingConfig) -> tuple[str, ...]:
    """The domains an env's agent observes the shares of (and with ``per_domain`` acts for), in their order."""
    return tuple(parse_mix(env.mix)) if env.observe_domain or env.per_domain else ()


def check_spaces(given: str, path: Path, saved: dict, here: ServingConfig, has_config: bool) -> None:
    """The model's saved spaces are those of the env it will act in (``here``): its observation's size (with the
    domains it observes) and its action grid."""
    n = len(here.fallback_values) * len(here.rollback_values) + int(here.off_switch)
    obs_shape = (N_BASE + len(domains_of(here)) + (N_FORESEE if here.observe_next else 0)
                 + (N_COSTS if here.observe_costs else 0),)
    obs, act = saved["observation_space"], saved["action_space"]
    act_fits = (tuple(getattr(act, "nvec", ())) == (n,) * len(domains_of(here)) if here.per_domain
                else getattr(act, "n", None) == n and not hasattr(act, "nvec"))
    if getattr(obs, "shape", None) == obs_shape and act_fits:
        return
    where = ("its run's config says it sees and does; the file is not that run's model?" if has_config
             else "no run config beside it: this evaluation's default grid (a model of another grid needs its run "
                  "folder)")
    raise ValueError(f"--model {given}: {path} was trained for observation space {space_name(obs)} and action space "
                     f"{space_name(act)}, but the env it would act in has Box{obs_shape} and {n} actions"
                     f"{f' per domain of {domains_of(here)}' if here.per_domain else ''} ({where})")


def main(argv: list[str] | None = None, defaults: ServingBenchConfig | None = None) -> dict:
    """``python -m bench.serving`` (``ServingBenchConfig``'s defaults) and ``python evaluate.py --env serve``
    (``defaults``: ``QUICK``, or with ``--full`` the same as the bench). Each load's table is printed, and the JSON
    at ``--out`` rewritten (``"complete": false``), as that load's test episodes are done."""
    cfg = parse_checked(ServingBenchConfig, argv, __doc__, check, defaults)
    out, plot = outputs(cfg)
    for path in (out, plot):  # --force: nothing of an earlier evaluation stays beside this one's
        path.unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)

    def done(report: dict, section: str, load: str) -> None:
        try:
            out.write_text(report_json(report | {"complete": False}, indent=1))
        except ValueError:  # not a finite number: said at the end, when the whole report is checked
            return
        print(markdown({"levels": {}, "moving": {}} | {section: {load: report[section][load]}}), flush=True)
        print(f"(written to {out}: the loads done so far)", flush=True)

    try:
        report = speed(cfg) if cfg.speed else run(cfg, done)
    except ConfigError as err:  # a model that cannot run here (agents.runs.load_agent)
        raise SystemExit(f"error: {err}") from None
    try:
        text = report_json(report | ({} if cfg.speed else {"complete": True}), indent=1)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    out.write_text(text)
    print(markdown(report if cfg.speed else report | {"levels": {}, "moving": {}}))  # the loads' were printed as done
    if not cfg.speed:
        print(f"goodput against load: {plot_goodput(report, plot)}")
    return report


if __name__ == "__main__":
    from bild_env.errors import run_command

    sys.exit(run_command("python -m agents.serving_evaluation", main))
