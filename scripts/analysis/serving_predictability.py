"""How much of each step's best action can BiLD-Serve-v0's observation foresee?

    python -m scripts.analysis.serving_predictability --batch-table 0:10 --out results/serving_predictability_smollm2.json

The per-step hindsight oracle (``agents.serve.rules.StepHindsight``, ``evaluate.py --env serve --step-oracle``) takes at
every step the action whose reward is highest that step, knowing it; the rules and the agents act on the
observation alone. This script measures what separates them. Under a behaviour policy (the per-batch-size
table ``--batch-table``, ``bucket:action`` with buckets 0 = batch 1, 1 = batch 2, 2 = 3-4, ...; off elsewhere),
every step of ``--episodes`` episodes per load level records the observation and the reward of each of
``--actions`` (``ServingEnv.peek``: each tried on the same batch, untaken): on VALIDATION episodes to fit, on TEST
episodes (other prompts, other seeds) to judge. Each action's advantage over speculation off is fitted by ridge
least squares on the observation, its squares and pairwise products (``numpy.linalg.solve``): once on every
step, and once on the steps whose batch is at most ``--up-to-batch`` (where the table speculates or nearly
does). Printed, on the test steps:

- R^2 of each action's advantage (1: the observation foresees it; 0: no better than its mean) over all steps,
  and at batch 1 and batch 2 from the small-batch fit; the share of steps where the fitted choice (the action of
  highest predicted advantage at a batch up to ``--up-to-batch``, off where none is above 0 and above that batch)
  is the hindsight best;
- the mean return of the batch-size table, of the fitted choice acting as a policy, and of the hindsight
  oracle, on the same test episodes, with the paired difference to the table and its 95% interval.

An R^2 near 0 with the hindsight oracle far above the table says the room above the table is in foreseeing
acceptance, which the observation does not carry. The fitted choice is a one-step (contextual-bandit) policy:
what an agent with gamma 0 could learn at best from these features.

``--preview`` adds two numbers to the observation: the mean and the least of the draft's confidence (max
probability) on each batched request's next proposal, the first token the step would draft. A server reads them
by running the draft once for the batch before choosing (what a speculating step runs first anyway; a step that
then turns speculation off has paid one draft forward for nothing, which this script does not charge). Here they
are read from the replay trees (``ReplayRunner.draft_next``) and the episode is restored after reading.
``--observe-next`` uses the env's own read-ahead instead (``observe_next``: mean, spread, share at or above the last
fallback threshold). ``--score`` sets what each request's fallback threshold reads: ``cumulative`` (the run's
product of max probabilities) or ``oracle`` (a perfect acceptance predictor: the room per-token foresight leaves).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from agents.common.stats import mean_ci
from agents.bild.improvement import features, fit_ridge, r_squared
from agents.serve.rules import BatchTable, StepHindsight, observed_batch, returns_of
from bild_env.decoding.bild import check_score
from bild_env.models.device import machine_description
from bild_env.serving.env import DEFAULT_MIX, ServingEnv


def preview(env: ServingEnv) -> list[float]:
    """[mean, least] of the draft's confidence on each batched request's next proposal, once the step's admissions
    are done (``ServingEnv.prepare``, which the step after it shares); the episode is left as it was."""
    env.prepare()
    saved = env.snapshot()
    try:
        confidence = [r.runner.draft_next(list(r.session.tokens))[1] for r in env.active]
    finally:
        env.restore(saved)
    return [float(np.mean(confidence)), float(np.min(confidence))] if confidence else [0.0, 0.0]


class FittedChoice:
    """The action of highest predicted advantage over off (``weights`` (F, K) over ``actions``), off where none
    is predicted above 0 and wherever the observed batch is above ``up_to_batch`` (None: everywhere); with ``env``,
    the observation is extended by ``preview(env)`` first."""

    def __init__(self, weights: np.ndarray, actions: list[int], off: int, env: ServingEnv | None = None,
                 up_to_batch: int | None = None, with_preview: bool = False) -> None:
        self.weights, self.actions, self.off, self.env, self.up_to_batch = weights, actions, off, env, up_to_batch
        self.with_preview = with_preview  # extend the observation by preview(env) (--preview)

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        if self.up_to_batch is not None and self.env is not None:
            cfg = self.env.config
            if observed_batch(observation, cfg.max_batch, cfg.observe.batch_scale) > self.up_to_batch:
                return np.int64(self.off), state
        if self.env is not None and self.with_preview:
            observation = np.concatenate([np.asarray(observation, dtype=np.float64), preview(self.env)])
        advantage = features(observation) @ self.weights
        k = int(np.argmax(advantage[0]))
        return np.int64(self.actions[k] if advantage[0, k] > 0 else self.off), state


def record(env: ServingEnv, behaviour, seeds: list[int], actions: list[int], desc: str,
           with_preview: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Every step's observation (N, d; with ``with_preview`` extended by ``preview(env)``) and the rewards of
    ``actions`` there (N, K), under ``behaviour``."""
    observations, rewards = [], []
    for seed in tqdm(seeds, desc=desc, leave=False):
        obs, _ = env.reset(seed=seed)
        done = False
        while not done:
            _, r, _ = env.peek(actions)
            observations.append(np.concatenate([obs, preview(env)]) if with_preview else obs)
            rewards.append(r)
            action, _ = behaviour.predict(obs)
            obs, _, terminated, truncated, _ = env.step(int(action))
            done = terminated or truncated
    return np.asarray(observations, dtype=np.float64), np.asarray(rewards, dtype=np.float64)


def pairs(text: str) -> dict[int, int]:
    return {int(k): int(a) for k, a in (item.split(":") for item in text.split(",") if item)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="smollm2")
    parser.add_argument("--mix", default=DEFAULT_MIX)
    parser.add_argument("--levels", type=float, nargs="+", default=[0.05, 0.15, 0.3, 1.0])
    parser.add_argument("--episodes", type=int, default=8, help="per level, validation (fit) and test (judge) each")
    parser.add_argument("--episode-steps", type=int, default=64)
    parser.add_argument("--max-prompts", type=int, default=40)
    parser.add_argument("--actions", type=int, nargs="+", default=[0, 4, 5, 10, 15, 16, 20, 21],
                        help="grid actions to choose among (speculation off is added)")
    parser.add_argument("--batch-table", default="0:10", help="the behaviour and the rule: bucket:action,...")
    parser.add_argument("--ridge", type=float, default=1e-3)
    parser.add_argument("--up-to-batch", type=int, default=2,
                        help="the fitted choice is fitted on, and acts at, steps whose batch is at most this; off above")
    parser.add_argument("--preview", action="store_true",
                        help="also observe the draft's confidence on the batch's next proposals (module docstring)")
    parser.add_argument("--observe-next", action="store_true",
                        help="the env's own read-ahead (observe_next: the next proposals' mean score, spread and share "
                             "at or above the last fallback threshold) in the observation")
    parser.add_argument("--score", default="token",
                        help="what each request's fallback threshold reads (the env's score: token, cumulative, oracle, "
                             "oracle:W): oracle is a perfect acceptance predictor, which measures the room per-token "
                             "foresight leaves; oracle:W one between it and the max probability")
    parser.add_argument("--cost-profile", default=None,
                        help="charge a stored hardware cost profile (a shipped name or a file; "
                             "bild_env.decoding.profiles) instead of this machine's cost model")
    parser.add_argument("--out", default="", help="also write the report as JSON here")
    args = parser.parse_args(argv)
    try:
        check_score(args.score)
    except ValueError as err:
        parser.error(f"--score: {err}")
    if args.episodes < 2:
        parser.error("--episodes: at least 2 (an interval needs them)")
    try:
        table_spec = pairs(args.batch_table)
    except ValueError:
        parser.error(f"--batch-table {args.batch_table!r}: give bucket:action pairs, e.g. 0:10,1:25")
    torch.set_num_threads(1)

    def env_for(split: str, level: float) -> ServingEnv:
        return ServingEnv(pair=args.pair, split=split, mix=args.mix, max_prompts=args.max_prompts,
                          episode_steps=args.episode_steps, load=f"constant:{level}", actions={"score": args.score},
                          observe={"next": args.observe_next}, cost_profile=args.cost_profile)

    data: dict[str, list] = {"validation": [], "test": []}
    seeds = {"validation": list(range(3000, 3000 + args.episodes)), "test": list(range(4000, 4000 + args.episodes))}
    envs = {split: {u: env_for(split, u) for u in args.levels} for split in data}
    first = next(iter(envs["test"].values()))
    off = first.n_chain_actions - 1
    actions = sorted(set(args.actions) - {off}) + [off]
    bad = [a for a in actions if not 0 <= a < first.n_chain_actions]
    if bad or first.config.actions.space != "discrete":
        parser.error(f"--actions: {bad} not in [0, {first.n_chain_actions})" if bad else "a discrete action grid is needed")
    table = BatchTable(table_spec, off, first.config.max_batch, first.config.observe.batch_scale)
    if not set(table.table.values()) <= set(actions):
        parser.error(f"--batch-table: its actions {sorted(set(table.table.values()) - set(actions))} are not among --actions")
    for split in data:
        for u, env in envs[split].items():
            data[split].append(record(env, table, seeds[split], actions, f"{split}, load {u:g}", args.preview))
    (x_fit, r_fit), (x_test, r_test) = ((np.vstack([o for o, _ in d]), np.vstack([r for _, r in d])) for d in data.values())
    advantage = r_test[:, :-1] - r_test[:, -1:]
    r2 = r_squared(advantage, features(x_test) @ fit_ridge(features(x_fit), r_fit[:, :-1] - r_fit[:, -1:], args.ridge))
    n_obs = first.observation_space.shape[0]
    batch_of = lambda x: np.array([observed_batch(o[:n_obs], first.config.max_batch, first.config.observe.batch_scale)  # noqa: E731
                                   for o in x])
    small = batch_of(x_fit) <= args.up_to_batch  # the fitted choice's steps
    weights = fit_ridge(features(x_fit[small]), r_fit[small, :-1] - r_fit[small, -1:], args.ridge)
    predicted = features(x_test) @ weights
    labels = [("off" if t is None else f"({t[0]:g}, {t[1]:g})") for t in map(first.thresholds, actions)]
    best = np.argmax(r_test, 1)
    report_rows: dict = {}
    fitted = np.where((predicted.max(1) > 0) & (batch_of(x_test) <= args.up_to_batch), predicted.argmax(1),
                      len(actions) - 1)
    print(f"{len(x_fit)} validation steps fitted, {len(x_test)} test steps judged; {features(x_test[:1]).shape[1]} features")
    print("R^2 of each action's advantage over off, all test steps (fitted on all validation steps): "
          + ", ".join(f"{label} {v:+.3f}" for label, v in zip(labels[:-1], r2)))
    batches = batch_of(x_test)
    for name, rows in (("batch 1", batches == 1), ("batch 2", batches == 2)):  # where speculating can pay
        if rows.sum() > 2:
            r2_rows = r_squared(advantage[rows], predicted[rows])
            report_rows[name] = {"steps": int(rows.sum()), "r2": dict(zip(labels[:-1], map(float, r2_rows))),
                                 "hindsight_speculates": float(np.mean(best[rows] != len(actions) - 1))}
            print(f"{name} (fitted on validation steps of batch <= {args.up_to_batch}; {rows.sum()} test steps; speculating best in hindsight on "
                  f"{np.mean(best[rows] != len(actions) - 1):.2f}): R^2 "
                  + ", ".join(f"{label} {v:+.3f}" for label, v in zip(labels[:-1], r2_rows)))
    print(f"fitted choice = hindsight best on {np.mean(fitted == best):.3f} of test steps "
          f"(the table's choice on {np.mean([actions.index(int(table.predict(o)[0])) == b for o, b in zip(x_test, best)]):.3f})")
    report: dict = {"preview": args.preview, "observe_next": args.observe_next, "score": args.score,
                    "cost_profile": args.cost_profile or "machine",
                    "up_to_batch": args.up_to_batch, "r2": dict(zip(labels[:-1], map(float, r2))),
                    "steps": {"fit": len(x_fit), "test": len(x_test)},
                    "by_batch": report_rows, "levels": {}}
    totals: dict[str, list[np.ndarray]] = {}
    for u, env in envs["test"].items():
        choice = FittedChoice(weights, actions, off, env, args.up_to_batch, args.preview)
        runs = {"per-batch-size table": table, "fitted choice": choice, "per-step hindsight oracle": StepHindsight(env, actions)}
        for name, policy in runs.items():
            totals.setdefault(name, []).append(returns_of(env, policy, seeds["test"])[0])
        report["levels"][u] = {name: float(parts[-1].mean()) for name, parts in totals.items()}
    base = np.concatenate(totals["per-batch-size table"])
    for name, parts in totals.items():
        returns = np.concatenate(parts)
        lo, hi = mean_ci(returns - base)
        report[name] = {"return": float(returns.mean()), "minus_table": float((returns - base).mean()), "ci": [lo, hi]}
        print(f"{name:28s} return {returns.mean():+.3f}, minus the table {(returns - base).mean():+.3f} [{lo:+.3f}, {hi:+.3f}]")
    for split in envs.values():
        for env in split.values():
            env.close()
    if args.out:
        report |= {"command": "python -m scripts.analysis.serving_predictability " + " ".join(argv if argv is not None else sys.argv[1:]),
                   "machine": machine_description(torch.device("cpu"))}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
