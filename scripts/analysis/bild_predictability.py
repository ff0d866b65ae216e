"""How much of the per-step room above the best fixed threshold pair can BiLD-v1's observation foresee?

    python -m scripts.analysis.bild_predictability --score lookup_cumulative --out results/bild_predictability_smollm2.json

The agents of ``BiLD-v1`` reach the best fixed pair and not above it, while a per-step oracle that knows the future
sits far above. This script measures what a learner with the env's observation could reach at best, with the
right target and far more data than a DQN run sees:

1. The base: the best fixed pair on the first ``--select-prompts`` VALIDATION prompts (what grid search finds).
2. On ``--train-prompts`` TRAIN prompts, along the base's episode, every step's observation and the return of each
   action played at that step with the base before and after it (``agents.bild.improvement.record_rollouts``: exact on
   the replay backend). Its return minus the base's is the advantage of deviating there.
3. ``agents.bild.improvement.RolloutImprovement``: each action's advantage fitted by ridge least squares on the
   observation, its squares and pairwise products (the previous thresholds left out: along the base's episodes
   they never vary), acting greedily where the fitted advantage is above a margin. Fitted on all TRAIN steps, and
   on ``--parts`` disjoint parts of the TRAIN prompts (the spread of the fit, in place of seeds). The ridge and the
   margin are chosen on the first ``--validation-prompts`` VALIDATION prompts, by the policy's mean return.
4. On the first ``--test-prompts`` TEST prompts: the base, the fitted policies, and (on the first
   ``--oracle-prompts``) the per-step oracle (one-step lookahead with the base's rollouts, knowing the future);
   each against the base with the paired 95% interval. Also the R^2 of the advantages on the TEST steps and the
   sum over a prompt's steps of the best one-step advantage (the room, to first order).

A fitted policy at the base with an R^2 near 0, and the oracle far above, say the room is in what the observation
does not show: which draft tokens the target keeps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from agents.bild.baselines import FixedThresholds
from agents.bild.evaluation import lookahead_returns, returns_on_prompts
from agents.common.stats import mean_ci
from agents.bild.improvement import RolloutImprovement, features, r_squared, record_rollouts
from bild_env.decoding.bild import check_score
from bild_env.env import BildEnv
from bild_env.models.device import machine_description
from bild_env.observations import OBSERVATIONS
from bild_env.replay.store import TreeStore

PREVIOUS_THRESHOLDS = (3, 4)  # observation entries that show the last action: constant along the base's episodes


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="smollm2")
    parser.add_argument("--score", default="lookup_cumulative", help="what the fallback threshold reads (the env's score)")
    parser.add_argument("--observation", default="foresee", choices=OBSERVATIONS)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--train-prompts", type=int, default=600)
    parser.add_argument("--select-prompts", type=int, default=50, help="VALIDATION prompts the base is chosen on")
    parser.add_argument("--validation-prompts", type=int, default=100, help="VALIDATION prompts the ridge and margin are chosen on")
    parser.add_argument("--test-prompts", type=int, default=200)
    parser.add_argument("--oracle-prompts", type=int, default=100, help="TEST prompts the per-step oracle runs on (0: none)")
    parser.add_argument("--parts", type=int, default=3, help="disjoint parts of the TRAIN prompts, each fitted alone")
    parser.add_argument("--ridges", type=float, nargs="+", default=[1e-4, 1e-3, 1e-2])
    parser.add_argument("--margins", type=float, nargs="+", default=[0.0, 0.002, 0.005, 0.01, 0.02, 0.05])
    parser.add_argument("--out", default="", help="also write the report as JSON here")
    args = parser.parse_args(argv)
    try:
        check_score(args.score)
    except ValueError as err:
        parser.error(f"--score: {err}")
    counts = ("train_prompts", "select_prompts", "validation_prompts", "test_prompts", "parts", "max_new_tokens")
    if any(getattr(args, name) < 1 for name in counts) or args.oracle_prompts < 0:
        parser.error("--train-prompts, --select-prompts, --validation-prompts, --test-prompts, --parts and "
                     "--max-new-tokens must be at least 1, --oracle-prompts at least 0")
    if args.parts > args.train_prompts:
        parser.error(f"--parts {args.parts}: more parts than --train-prompts {args.train_prompts}")
    torch.set_num_threads(1)
    store = TreeStore()

    def env_for(split: str, prompts: int, cost_model=None) -> BildEnv:
        return BildEnv(pair=args.pair, backend="replay", split=split, max_prompts=prompts,
                       actions={"score": args.score},
                       max_new_tokens=args.max_new_tokens, observation=args.observation, replay_store=store,
                       cost_model=cost_model)

    try:
        val = env_for("validation", max(args.select_prompts, args.validation_prompts))
        train = env_for("train", args.train_prompts, val.cost_model)
        test = env_for("test", args.test_prompts, val.cost_model)
    except ValueError as err:  # an option the env refuses (a score without its predictor, a pair, a split)
        raise SystemExit(f"bild_predictability: {err}") from None
    select = list(range(min(args.select_prompts, len(val.prompts))))
    fixed = {a: returns_on_prompts(val, FixedThresholds(val, *val.thresholds(a)), select).returns.mean()
             for a in tqdm(range(val.action_space.n), desc="fixed pairs (validation)", leave=False)}
    base = max(fixed, key=lambda a: (fixed[a], -a))
    print(f"base: {val.thresholds(base)} (action {base}), {fixed[base]:+.4f} on {len(select)} validation prompts")

    x_train, q_train, which = record_rollouts(train, base, range(len(train.prompts)), "rollouts (train)")
    x_test, q_test, which_test = record_rollouts(test, base, range(len(test.prompts)), "rollouts (test)")
    print(f"{len(x_train)} train steps ({len(train.prompts)} prompts), {len(x_test)} test steps ({len(test.prompts)} prompts)")

    fits = {ridge: RolloutImprovement.fit(x_train, q_train, base, ridge, drop=PREVIOUS_THRESHOLDS) for ridge in args.ridges}
    val_prompts = list(range(min(args.validation_prompts, len(val.prompts))))
    val_base = returns_on_prompts(val, FixedThresholds(val, *val.thresholds(base)), val_prompts).returns
    chosen, best = None, -np.inf
    grid = {}
    for ridge, fit in fits.items():
        for margin in args.margins:
            ret = returns_on_prompts(val, fit.with_margin(margin), val_prompts).returns.mean()
            grid[f"{ridge:g}/{margin:g}"] = float(ret - val_base.mean())
            if ret > best:
                chosen, best = (ridge, margin), ret
    ridge, margin = chosen
    print(f"chosen on {len(val_prompts)} validation prompts: ridge {ridge:g}, margin {margin:g} "
          f"({best - val_base.mean():+.4f} against the base there)")

    advantage = q_test - q_test[:, [base]]
    r2 = r_squared(advantage, fits[ridge].advantages(x_test))
    room = np.array([advantage[which_test == i].max(1).sum() for i in range(len(test.prompts))])
    test_prompts = list(range(len(test.prompts)))
    base_returns = returns_on_prompts(test, FixedThresholds(test, *test.thresholds(base)), test_prompts).returns
    policies = {"fitted on all train prompts": fits[ridge].with_margin(margin)}
    parts = np.array_split(np.arange(len(train.prompts)), args.parts)
    for k, part in enumerate(parts):
        rows = np.isin(which, part)
        policies[f"fitted on train part {k + 1} of {args.parts} ({len(part)} prompts)"] = RolloutImprovement.fit(
            x_train[rows], q_train[rows], base, ridge, margin, PREVIOUS_THRESHOLDS)
    rows = []

    def add(name: str, returns: np.ndarray, against: np.ndarray, extra: dict | None = None) -> None:
        lo, hi = mean_ci(returns - against)
        rows.append({"policy": name, "prompts": len(returns), "return": float(returns.mean()),
                     "minus_base": float((returns - against).mean()), "minus_base_ci95": [lo, hi]} | (extra or {}))
        print(f"{name:60s} {returns.mean():+.4f}  minus the base {(returns - against).mean():+.4f} [{lo:+.4f}, {hi:+.4f}]")

    add(f"base {test.thresholds(base)}", base_returns, base_returns)
    for name, policy in policies.items():
        result = returns_on_prompts(test, policy, test_prompts, desc=name)
        deviated = float(np.mean([a != base for actions in result.actions for a in actions]))
        add(name, result.returns, base_returns, {"steps_off_base": deviated})
    add("one-step room, to first order (sum of each step's best advantage)", base_returns + room, base_returns)
    if args.oracle_prompts:
        n = min(args.oracle_prompts, len(test_prompts))
        add(f"per-step oracle (one-step lookahead, first {n} prompts)",
            lookahead_returns(test, test_prompts[:n], base), base_returns[:n])
    labels = [str(test.thresholds(a)) for a in range(test.action_space.n)]
    print("R^2 of each action's advantage on the test steps: "
          + ", ".join(f"{label} {v:+.3f}" for a, (label, v) in enumerate(zip(labels, r2)) if a != base))
    report = {"base": {"action": base, "thresholds": list(test.thresholds(base)), "validation_return": float(fixed[base])},
              "chosen": {"ridge": ridge, "margin": margin}, "validation_grid": grid,
              "steps": {"train": len(x_train), "test": len(x_test)},
              "features": int(features(x_test[:1], PREVIOUS_THRESHOLDS).shape[1]),
              "r2_test": {label: float(v) for a, (label, v) in enumerate(zip(labels, r2)) if a != base},
              "rows": rows, "per_prompt": {"base": base_returns.tolist(), "room": room.tolist()}}
    for env in (val, train, test):
        env.close()
    if args.out:
        report |= {"command": "python -m scripts.analysis.bild_predictability " + " ".join(argv if argv is not None else sys.argv[1:]),
                   "machine": machine_description(torch.device("cpu"))}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
