"""Time the ways the lean forward can read a weight (``bild_env.models.products.WAYS``) for each count of rows fed.

    python -m scripts.analysis.products --pair smollm2 --dtype float32 --threads 1
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python -m scripts.analysis.products --dtype float32
    python -m scripts.analysis.products --pair smollm2 --dtype bfloat16 --rows 1 2 4 8 --rounds 9

The products of every layer of the pair's target (its real weights, as the lean forward fuses them: q/k/v, o,
gate/up, down), fed 1 to n rows, each way in turn, interleaved over ``--rounds`` rounds: the least and the median
ms per way and count, and the way ``choose_ways`` would take there (it times every third layer only). Prints a
table, writes JSON with the machine in words (``--out``).
"""

from __future__ import annotations

import sys

import argparse
import json
import statistics
from pathlib import Path

import torch

from bild_env import load_pair
from bild_env.cli import setup_logging
from bild_env.models.device import machine_description
from bild_env.models.lean import LeanLlamaModel
from bild_env.models.products import WAYS, time_ways
from bild_env.models.pairs import preset_names


def run(pair_name: str, dtype: str | None, rows: tuple[int, ...], rounds: int) -> dict:
    pair = load_pair(pair_name, device="cpu", dtype=dtype)
    lean = getattr(pair.target, "model", None)
    if not isinstance(lean, LeanLlamaModel):
        raise SystemExit(f"scripts.analysis.products: the target of pair {pair_name} has no lean forward (a Llama model is needed)")
    lean.restore_originals()  # every way is timed from the weights themselves
    weights = [w for layer in lean.weights for w in layer]
    spent = time_ways(weights, rows, rounds)
    cells = {f"{r}:{way}": {"min_ms": 1e3 * min(ts), "median_ms": 1e3 * statistics.median(ts)}
             for (r, way), ts in spent.items()}
    fastest = {str(r): min((w for (n, w) in spent if n == r), key=lambda w: min(spent[(r, w)])) for r in rows}
    return {"pair": pair.name, "dtype": str(pair.dtype), "machine": machine_description("cpu"), "rows": list(rows),
            "rounds": rounds, "layers": len(lean.weights), "weights_mb": sum(w.numel() * w.element_size()
                                                                             for w in weights) / 1e6,
            "ms": cells, "fastest": fastest}


def table(report: dict) -> str:
    ways = [w for w in WAYS if any(k.endswith(f":{w}") for k in report["ms"])]
    lines = [f"{report['pair']} target, {report['layers']} layers' products ({report['weights_mb']:.0f} MB), "
             f"{report['dtype']}, {report['machine']}; least / median ms of {report['rounds']} rounds",
             "| rows | " + " | ".join(ways) + " | fastest |", "|---" * (len(ways) + 2) + "|"]
    for r in report["rows"]:
        cells = [f"{report['ms'][f'{r}:{w}']['min_ms']:.1f} / {report['ms'][f'{r}:{w}']['median_ms']:.1f}" for w in ways]
        lines.append(f"| {r} | " + " | ".join(cells) + f" | {report['fastest'][str(r)]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="smollm2", choices=preset_names())
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or auto (default: the preset's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 12], help="rows fed (tokens over the batch)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per cell")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", default=None, help="JSON report")
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or args.rounds < 1 or args.threads < 1:
        parser.error("--rows, --rounds and --threads must be at least 1")
    setup_logging()
    torch.set_num_threads(args.threads)
    report = run(args.pair, args.dtype, tuple(sorted(set(args.rows))), args.rounds)
    print(table(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    from bild_env.command import run_command

    sys.exit(run_command("python -m scripts.analysis.products", main))
