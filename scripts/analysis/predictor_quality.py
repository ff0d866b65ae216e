"""How good is the predictor ``score="oracle:W"`` stands for? Its AUC per domain, beside the max probability's.

    python -m scripts.analysis.predictor_quality --weights 0.1 0.2 0.3 0.4 0.5 1 --out results/predictor_quality_smollm2.json

``oracle:W`` (``bild_env.decoding.bild.DraftScore``) scores a proposal ``(1 - W) * p_max + W * agrees``: between the
draft's max probability (W = 0) and a perfect predictor (W = 1). Running the serving rules under it
(``python evaluate.py --env serve --full --actions score=oracle:W``) measures what a predictor of that quality would win; this script
says which quality that is: the AUC of the score against the target's agreement on the positions
``distill.positions`` collects (teacher-forced continuations of VALIDATION and TEST prompts, the draft's
proposals in simulated blocks), per domain and split. From W = 0.5 on, every agreeing proposal scores above every
disagreeing one (AUC 1): the score then also carries a threshold that separates them, which the rules may or may not
hit. Reads the positions from the cache (``collect`` fills it on a miss, which runs the pair).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from distill.positions import PositionsConfig, auc, collect


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default=PositionsConfig.pair)
    parser.add_argument("--weights", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4, 0.5, 1.0])
    parser.add_argument("--splits", nargs="+", default=["validation", "test"], choices=("validation", "test"))
    parser.add_argument("--out", default="", help="also write the table as JSON here")
    args = parser.parse_args(argv)
    bad = [w for w in args.weights if not 0.0 < w <= 1.0]
    if bad:
        parser.error(f"--weights: {bad} not in (0, 1] (oracle:W's W)")
    from bild_env import load_pair

    cfg = PositionsConfig(pair=args.pair)
    pair = load_pair(args.pair, device="cpu")
    report: dict = {"pair": args.pair, "weights": [0.0] + list(args.weights), "auc": {}}
    print("split / domain: positions, AUC at W = " + ", ".join(f"{w:g}" for w in report["weights"]))
    for split in args.splits:
        for domain in cfg.domains:
            data = collect(pair, cfg, domain, split)
            p, y = data["max_prob"].double().numpy(), data["label"].numpy().astype(bool)
            row = {f"{w:g}": auc((1.0 - w) * p + w * y, y) for w in report["weights"]}
            report["auc"][f"{split}/{domain}"] = row | {"positions": int(len(y))}
            print(f"{split}/{domain}: {len(y)}, " + ", ".join(f"{v:.3f}" for v in row.values()))
    if args.out:
        report["command"] = "python -m scripts.analysis.predictor_quality " + " ".join(argv if argv is not None else sys.argv[1:])
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
