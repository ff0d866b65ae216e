"""Time one forward of each model by how many tokens it is fed, beside what the cost model predicts.

    python -m bench.forwards --pair smollm2 --threads 2
    python -m bench.forwards --pair tiny-random --fed 1,2,4

For each model of the pair: the median ms of a forward that feeds ``n`` new tokens on ``--context``
cached ones (``bild_env.decoding.costs.time_forwards``, the timing the cost model is fitted to), next to the
pair's cost model on this device (``load_or_calibrate``: the one the env and ``evaluate.py`` use,
calibrated once and cached). The cost model is one line in the number of fed tokens; on a CPU where a
forward fed two tokens costs far more than one fed one token (a matrix-vector product against a
matrix-matrix one), this shows how far that line is off, and so why naive speculative decoding with
k = 1 can lose there. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bild_env import load_pair
from bild_env.cli import setup_logging
from bild_env.decoding.costs import load_or_calibrate, time_forwards
from bild_env.models.pairs import preset_names


def run(pair_name: str, fed: tuple[int, ...], context: int, repeats: int, device: str | None = None,
        dtype: str | None = None) -> dict[str, object]:
    pair = load_pair(pair_name, device=device, dtype=dtype)
    if context + max(fed) > pair.max_positions:
        raise ValueError(f"--context {context} plus {max(fed)} fed tokens is more than the {pair.max_positions} "
                         f"positions of pair {pair.name}; lower --context or --fed")
    cost = load_or_calibrate(pair)
    rows = []
    for role in ("draft", "target"):
        model = getattr(pair, role)
        time_forwards(model, (1,), context, pair.device, 2)  # warm-up
        for n, ctx, ms in time_forwards(model, fed, context, pair.device, repeats):
            rows.append({"model": role, "fed": n, "context": ctx, "measured_ms": ms, "cost_model_ms": cost.ms(role, n, ctx)})
    return {"pair": pair.name, "device": cost.device, "dtype": str(pair.dtype), "repeats": repeats, "rows": rows}


def table(report: dict[str, object]) -> str:
    lines = [f"pair {report['pair']} on {report['device']} ({report['dtype']}), median of {report['repeats']}",
             "| model | fed tokens | measured ms | cost model ms |", "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['fed']} | {r['measured_ms']:.1f} | {r['cost_model_ms']:.1f} |" for r in report["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="smollm2", choices=preset_names())
    parser.add_argument("--fed", default="1,2,3,4,8", help="comma-separated numbers of tokens fed per forward")
    parser.add_argument("--context", type=int, default=64, help="cached tokens under each timed forward")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--out", default="results/bench_forwards.json")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        fed = tuple(int(x) for x in args.fed.split(","))
    except ValueError:
        parser.error(f"--fed {args.fed!r}: give positive whole numbers separated by commas, e.g. 1,2,4")
    if min(fed) < 1:
        parser.error(f"--fed {args.fed!r}: every forward feeds at least one token")
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args.pair, fed, args.context, args.repeats, args.device, args.dtype)
    print(table(report))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
