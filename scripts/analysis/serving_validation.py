"""Serving agents beside rules on VALIDATION episodes, for choosing an agent's configuration (never test).

    python -m scripts.analysis.serving_validation --episodes 8 --table 0.05:15 --batch-table 0:16 logs/<run1> logs/<run2>

Each load level of ``--levels`` runs ``--episodes`` episodes as a constant load (seeds 2000, 2001, ...: not the
seeds ``evaluate.py --env serve`` chooses its rules on, 1000+, nor the trainer's, 10000+), on the validation split's first
``--max-prompts`` prompts per domain of ``--mix`` (the env's default mix, or e.g. one with a domain the runs never
trained on). Rules are given, not chosen here: speculation off, the per-load table
``--table`` (``level:action`` pairs of the env's 26-action grid; off elsewhere) and the per-batch-size table
``--batch-table`` (``bucket:action``; buckets 0 = batch 1, 1 = batch 2, 2 = 3-4, ...). Every run is evaluated in an
env with its own action grid. Prints each policy's mean return over all episodes, its paired difference to the
per-load table with a 95% bootstrap interval, its mean return per level, and per level how many of its steps at
batch size 1 and 2 (as observed when acting, what the tables read) speculated ("b2 32/88": 32 of 88 such steps); with several runs on one grid,
also their Q-ensemble (``agents.dqn.QEnsemble``: the action of the highest mean Q-value).

``--override-margins M ...`` adds, per margin, the per-batch-size table overridden by that ensemble: the ensemble's
greedy action where its mean Q-value exceeds that of the table's action by more than M, else the table's (do the
agents' confident deviations from the rule pay?). ``--split train`` runs the episodes on the prompts the runs trained
on (an in-sample check; test is refused: choose on validation). ``--by-bucket`` prints, per level and batch-size
bucket, where that ensemble gains or loses against the best action there: each action's mean step reward at the
states it visits (every action peeked: ``choose_batch_table``'s means), its own actions there, and their mean reward.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from agents.common.stats import mean_ci
from agents.common.trained import choose_model, load_agent
from agents.dqn import q_ensemble
from agents.serve.evaluation_agents import agent_grid
from agents.serve.rules import (BatchTable, Fixed, LoadTable, TableGuard, batch_bucket, bucket_label,
                                  choose_batch_table, returns_of)
from bild_env.serving.env import DEFAULT_MIX, ServingEnv


def pairs(text: str, key=float) -> dict:
    return {key(k): int(a) for k, a in (item.split(":") for item in text.split(",") if item)}


def own_action(grid_env: ServingEnv, own: ServingEnv, action: int) -> int:
    """``action`` of ``grid_env``'s grid as the action of ``own``'s grid with the same thresholds (or off)."""
    want = grid_env.thresholds(action)
    for a in range(own.action_space.n):
        if own.thresholds(a) == want:
            return a
    raise SystemExit(f"--batch-table's action {action} {want} is not in the runs' grid: give actions they have")


def print_buckets(env: ServingEnv, policy, episodes: list, seeds: list[int], level: float) -> None:
    """Per batch-size bucket of ``policy``'s episodes: every action's mean step reward at the states it visits, the
    best of them, and the policy's own actions there with their mean reward."""
    _, means = choose_batch_table([env], [policy], seeds, list(range(env.action_space.n)))
    acts: dict[int, Counter] = {}
    for ep in episodes:
        for a, b in zip(ep.actions, ep.observed_batches):
            acts.setdefault(batch_bucket(b), Counter())[int(a)] += 1
    names = {a: env.decode(a).name or "({:g}, {:g})".format(*env.decode(a).thresholds) for a in range(env.action_space.n)}
    for k, m in means.items():
        taken = acts.get(k, Counter())
        own = sum(c * m[a] for a, c in taken.items()) / max(sum(taken.values()), 1)
        best = max(m, key=m.get)
        print(f"load {level:g} bucket {bucket_label(k)}: " + " ".join(f"{names[a]} {v:+.4f}" for a, v in m.items())
              + f" | best {names[best]}; Q-ensemble {own:+.4f} with " + ", ".join(f"{names[a]} {c}" for a, c in taken.most_common()))


def main(argv: list[str] | None = None) -> dict[str, list[np.ndarray]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", help="serving run folders (their best model) or model files")
    parser.add_argument("--pair", default="smollm2")
    parser.add_argument("--mix", default=DEFAULT_MIX, help="the validation workload (e.g. with a domain the runs never trained on)")
    parser.add_argument("--levels", type=float, nargs="+", default=[0.05, 0.15, 0.3, 1.0])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--episode-steps", type=int, default=64)
    parser.add_argument("--max-prompts", type=int, default=40)
    parser.add_argument("--table", default="0.05:15", help="per-load table, level:action,... (off elsewhere)")
    parser.add_argument("--batch-table", default="0:16", help="per-batch-size table, bucket:action,...")
    parser.add_argument("--override-margins", type=float, nargs="*", default=[],
                        help="also the batch-size table overridden by the runs' Q-ensemble above each margin")
    parser.add_argument("--split", default="validation", choices=["validation", "train"])
    parser.add_argument("--by-bucket", action="store_true", help="where the runs' Q-ensemble gains or loses, per bucket")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    seeds, table, batch_table = list(range(2000, 2000 + args.episodes)), pairs(args.table), pairs(args.batch_table, int)

    def env_for(level: float, **grid) -> ServingEnv:
        return ServingEnv(pair=args.pair, split=args.split, mix=args.mix, max_prompts=args.max_prompts,
                          episode_steps=args.episode_steps, load=f"constant:{level}",
                          **grid)  # agent_grid's, by sub-config

    results: dict[str, list[np.ndarray]] = {}
    speculating: dict[str, list[str]] = {}  # per policy and level: steps speculating at batch 1 and 2, of all such

    def run_policy(name: str, env: ServingEnv, policy) -> list:
        returns, _, episodes = returns_of(env, policy, seeds)
        results.setdefault(name, []).append(returns)
        counts = {b: [0, 0] for b in (1, 2)}
        for ep in episodes:
            for a, b in zip(ep.actions, ep.observed_batches):
                if b in counts:
                    counts[b][0] += env.decode(a).kind != "off"  # a BiLD pair or a tree speculates
                    counts[b][1] += 1
        speculating.setdefault(name, []).append(" ".join(f"b{b} {on}/{n}" for b, (on, n) in counts.items()))
        return episodes

    grids = {run: (choose_model(run)[0], agent_grid(choose_model(run)[0])) for run in args.runs}
    for level in args.levels:
        env = env_for(level)
        off = env.action_space.n - 1
        rules = {"off": Fixed(off), "per-load table": LoadTable(env, {level: table.get(level, off)}),
                 "per-batch-size table": BatchTable(batch_table, off, env.config.max_batch, env.config.observe.batch_scale)}
        for name, rule in rules.items():
            run_policy(name, env, rule)
        env.close()
        agents = []
        for run, (path, grid) in grids.items():
            own = env_for(level, **grid)
            agents.append((Path(run).name, load_agent(path, own), grid))
            run_policy(Path(run).name, own, agents[-1][1])
            own.close()
        ensemble = q_ensemble(agents)
        if ensemble is not None:  # the runs as one agent: their mean Q-values
            own = env_for(level, **agents[0][2])
            episodes = run_policy("Q-ensemble", own, ensemble)
            if args.by_bucket:
                print_buckets(own, ensemble, episodes, seeds, level)
            rule = BatchTable({k: own_action(env, own, a) for k, a in batch_table.items()}, own.action_space.n - 1,
                              own.config.max_batch, own.config.observe.batch_scale)
            same = {a: a for a in range(own.action_space.n)}  # the rule already acts on the runs' grid
            for margin in args.override_margins:
                run_policy(f"table, ensemble > {margin:g}", own,
                           TableGuard(lambda o: ensemble.q_values(o)[0], rule, same, margin))
            own.close()
    base = np.concatenate(results["per-load table"])
    for name, parts in results.items():
        returns = np.concatenate(parts)
        lo, hi = mean_ci(returns - base)
        print(f"{name:24s} all {returns.mean():+.3f}  minus per-load table {np.mean(returns - base):+.3f} "
              f"[{lo:+.3f}, {hi:+.3f}]  per level {[round(float(p.mean()), 3) for p in parts]}  "
              f"speculating per level {speculating[name]}")
    return results


if __name__ == "__main__":
    main()
