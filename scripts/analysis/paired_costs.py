"""Every method of an ``evaluate.py`` (BiLD-v1) run against one of them, paired by prompt: summed cost-model ms.

    python -m scripts.analysis.paired_costs results/bild_agents_smollm2_trees_zen5-smollm2-bf16/per_prompt.csv \
        --base "tree 6:8:2:0.3"

Reads the run's ``per_prompt.csv`` (one row per method and prompt) and prints, for each method, its speedup over the
single model and its speed against ``--base`` (the base's summed ms over the method's, on the prompts both decoded),
with a 95% percentile-bootstrap interval over prompts (``agents.common.stats.ratio_interval``).
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict

from agents.common.stats import ratio_interval


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="per_prompt.csv of an evaluate.py run")
    parser.add_argument("--base", required=True, help="the method the others are set against (its row name)")
    parser.add_argument("--column", default="model_ms", help="the per-prompt cost column (default: model_ms)")
    parser.add_argument("--resamples", type=int, default=2000)
    args = parser.parse_args(argv)
    ms: dict[str, dict[int, float]] = defaultdict(dict)
    with open(args.csv, newline="") as f:
        for row in csv.DictReader(f):
            if row[args.column]:
                ms[row["method"]][int(row["prompt_index"])] = float(row[args.column])
    if args.base not in ms:
        parser.error(f"--base {args.base!r} is not a method of {args.csv}: {sorted(ms)}")
    out = {}
    for method, costs in ms.items():
        prompts = sorted(set(costs) & set(ms[args.base]) & set(ms.get("single model", costs)))
        base = [ms[args.base][i] for i in prompts]
        mine = [costs[i] for i in prompts]
        single = [ms.get("single model", costs)[i] for i in prompts]
        out[method] = {"speedup": sum(single) / sum(mine), "versus_base": ratio_interval(base, mine, args.resamples)}
        r = out[method]["versus_base"]
        ci = "" if r["interval"] is None else f" [{r['interval'][0]:.3f}, {r['interval'][1]:.3f}]"
        print(f"{method:40s} {out[method]['speedup']:.3f}x the single model; {r['ratio']:.3f}x{ci} {args.base}'s speed")
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
