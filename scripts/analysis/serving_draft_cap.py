"""What the cap on the draft's runs (``max_draft_len``) is worth to the serving rules, cap by cap.

    python -m scripts.analysis.serving_draft_cap --pair qwen2.5-coder --dtype bfloat16 \\
        --cost-profile xeon-amx-qwen2.5-coder-bf16 --max-batch 8 --max-prompts 4 --caps 1 2 3 4 6 10 \\
        --out results/serving_draft_cap_qwen2.5-coder-bfloat16_xeon-amx-qwen2.5-coder-bf16.json

For each cap, ``BiLD-Serve-v0`` (the main job's lossless grid, replayed) chooses the per-load table and the
per-batch-size table on the validation episodes exactly as ``evaluate.py --env serve`` does
(``agents.serve.load_clock.choose_tables``: seeds 1000+), then runs them and speculation off on the test episodes
of every level (constant loads). Reported per cap and level: the mean goodput against target-only serving at the
same load (the env's ``speedup``) with a 95% bootstrap interval over episodes, and the cap whose per-batch-size
table returned most on validation, chosen without the test episodes.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from agents.common.stats import mean_ci
from agents.serve.bench_config import QUICK, make_env
from agents.serve.load_clock import choose_tables
from agents.serve.progress import episodes
from agents.serve.rules import BatchTable, Fixed, LoadTable
from bild_env.config import over


def measure(bench, cap: int) -> dict:
    """The tables chosen on validation at ``cap``, their validation return, and every level's test goodput."""
    table, batch_table = choose_tables(bench, cap)
    val_seeds = list(range(1000, 1000 + bench.select_episodes))
    test_seeds = list(range(bench.episodes))
    out = {"per_load_table": {f"{u:g}": a for u, a in table.items()}, "per_batch_size_table": batch_table,
           "validation_return": 0.0, "levels": {}}
    for u in bench.levels:
        val = make_env(bench, "validation", f"constant:{u}", actions={"max_draft_len": cap})
        off = val.n_chain_actions - 1
        rule = BatchTable(batch_table, off, bench.env.max_batch, val.config.observe.batch_scale)
        out["validation_return"] += float(episodes(val, rule, val_seeds)[0].mean()) / len(bench.levels)
        val.close()
        env = make_env(bench, "test", f"constant:{u}", actions={"max_draft_len": cap})
        level = {}
        for name, policy in [("per-batch-size table", rule), ("per-load table", LoadTable(env, table)),
                             ("speculation off", Fixed(off))]:
            speedups = episodes(env, policy, test_seeds)[1]
            level[name] = {"goodput": float(speedups.mean()), "goodput_ci95": list(mean_ci(speedups))}
        env.close()
        out["levels"][f"{u:g}"] = level
    for name in ("per-batch-size table", "per-load table"):
        out[f"{name} over the levels"] = float(np.mean([v[name]["goodput"] for v in out["levels"].values()]))
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default=QUICK.env.pair)
    parser.add_argument("--dtype", default=QUICK.env.pair_options.dtype)
    parser.add_argument("--cost-profile", default=None)
    parser.add_argument("--max-batch", type=int, default=QUICK.env.max_batch)
    parser.add_argument("--max-prompts", type=int, default=QUICK.env.max_prompts)
    parser.add_argument("--levels", type=float, nargs="+", default=list(QUICK.levels))
    parser.add_argument("--caps", type=int, nargs="+", default=[1, 2, 3, 4, 6, 10])
    parser.add_argument("--select-episodes", type=int, default=QUICK.select_episodes)
    parser.add_argument("--episodes", type=int, default=QUICK.episodes)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    env = over(QUICK.env, {"pair": args.pair, "pair_options": {"dtype": args.dtype}, "cost_profile": args.cost_profile,
                           "max_batch": args.max_batch, "max_prompts": args.max_prompts})
    bench = replace(QUICK, env=env, levels=tuple(args.levels), select_episodes=args.select_episodes,
                    episodes=args.episodes)
    caps = {str(k): measure(bench, k) for k in tqdm(args.caps, desc="caps")}
    chosen = max(caps, key=lambda k: (caps[k]["validation_return"], -int(k)))
    report = {"command": vars(args), "chosen_on_validation": int(chosen), "caps": caps}
    for k, c in caps.items():
        print(f"cap {k:>2}: per-batch-size table {c['per-batch-size table over the levels']:.3f}x, per-load table "
              f"{c['per-load table over the levels']:.3f}x over the levels (validation return "
              f"{c['validation_return']:+.3f})" + ("  <- chosen on validation" if k == chosen else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
