"""Does the cost model rank policies as the clock does? The env's fixed threshold pairs on the clock.

    python -m scripts.analysis.clock --pair smollm2 --prompts 4 --out results/bench_clock_smollm2.json
    python -m scripts.analysis.clock --pair tiny-random --prompts 2 --max-new-tokens 16     # seconds, a smoke run
    python -m scripts.analysis.clock --pair smollm2 --prompts 4 --trees 6:8:2:0.3 16:8:4:0.1  # and token trees beside them

Every fixed pair of BiLD-v1's grid (25 by default), target-only decoding (twice: the second run is the
noise floor) and naive speculative decoding decode the same held-out prompts of every domain, all
methods interleaved per prompt in a seeded shuffled order (drifts of the machine hit all alike). Each
generation is charged by the pair's cost model (``load_or_calibrate``: forward tables plus the
decoding loop's own work) and timed on the clock; ``--trees`` adds a row per token-tree rule
(``bild_env.decoding.tree.generate_tree``), charged by the same model (its forwards by the tokens fed, tree nodes
included). Reported, per method and over the grid:

* ms per committed token on the clock, by the cost model, and by its forward tables alone;
* the model's error against the clock, raw and with the machine's drift taken out (each method's
  time divided by target-only's over the same prompts, on the clock and in the model alike);
* Spearman's rank correlation of the grid's pairs, model against clock (the bar: >= 0.9), with the
  tables alone beside it;
* the noise floor: target-only's second run against its first (the clock's own error), and the
  clock's Spearman between two halves of the prompts (how well the clock ranks the grid itself).
"""

from __future__ import annotations

import sys

import random
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from bild_env import load_pair
from bild_env.cli import report_main
from bild_env.decoding.costs import load_or_calibrate
from bild_env.decoding.decoders import decode_with
from bild_env.decoding.loop_costs import features, loop_of
from bild_env.config import FALLBACK_VALUES, ROLLBACK_VALUES
from bild_env.models.device import machine_description
from bild_env.models.pairs import DEFAULT_PAIR, check_held_out
from bild_env.prompts.domains import load_domain

TARGET, TARGET_AGAIN = "target only", "target only (again)"


@dataclass
class ClockConfig:
    pair: str = DEFAULT_PAIR
    dtype: str | None = field(default=None, metadata={"help": "the preset's default when not given"})
    domains: tuple[str, ...] = ("prose", "code", "chat")
    split: str = field(default="test", metadata={"help": "held-out prompts"})
    prompts: int = field(default=4, metadata={"help": "per domain"})
    max_new_tokens: int = 48
    k: tuple[int, ...] = field(default=(1, 3), metadata={"help": "naive speculative decoding rows"})
    trees: tuple[str, ...] = field(default=(), metadata={"help": (
        'token-tree rules, a row each (bild_env.decoding.tree: "N:D:W[:F]" or children per depth, e.g. 3,2,1,1)')})
    seed: int = field(default=0, metadata={"help": "the order of methods within each prompt"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch's default)"})
    refresh: bool = field(default=False, metadata={"help": "calibrate the cost model again first (on a quiet machine)"})
    out: str = field(default="", metadata={"help": "JSON report"})


def check_config(cfg: ClockConfig) -> None:
    check_held_out(cfg.pair, cfg.domains, cfg.split)
    if cfg.prompts < 2 or cfg.max_new_tokens < 1:
        raise ValueError("--prompts must be at least 2 (the noise floor splits them in halves) and --max-new-tokens at least 1")
    from bild_env.decoding.tree import parse_tree_rule
    from bild_env.command import parse_each

    parse_each("--trees:", cfg.trees, parse_tree_rule)


def methods(cfg: ClockConfig) -> list[tuple[str, dict]]:
    """(name, decoder kwargs) of every method timed: target only twice, naive SD, the tree rules, the grid's pairs."""
    out = [(TARGET, {}), (TARGET_AGAIN, {})] + [(f"naive k={k}", {"k": k}) for k in cfg.k]
    out += [(f"tree {rule}", {"tree": rule}) for rule in cfg.trees]
    out += [(f"bild {f:g}/{r:g}", {"fallback": f, "rollback": r}) for f in FALLBACK_VALUES for r in ROLLBACK_VALUES]
    return out


def spearman(a: list[float], b: list[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def summarise(runs: dict[str, list[dict]], grid: list[str]) -> dict[str, object]:
    """Per-method times and errors, the grid's rank agreement and the noise floor, from per-prompt ``runs``."""
    def total(name: str, key: str, rows: slice = slice(None)) -> float:
        return sum(r[key] for r in runs[name][rows])

    per_method = {}
    for name in runs:
        tokens = total(name, "tokens")
        clock, model, tables = (total(name, k) for k in ("clock_ms", "model_ms", "tables_ms"))
        drift = {k: total(name, k) / total(TARGET, k) for k in ("clock_ms", "model_ms", "tables_ms")}
        per_method[name] = {
            "clock_ms_per_token": clock / tokens, "model_ms_per_token": model / tokens,
            "tables_ms_per_token": tables / tokens,
            "model_error": model / clock - 1, "tables_error": tables / clock - 1,
            "model_error_drift_removed": drift["model_ms"] / drift["clock_ms"] - 1,
            "tables_error_drift_removed": drift["tables_ms"] / drift["clock_ms"] - 1,
            "speedup_clock": total(TARGET, "clock_ms") / clock, "speedup_model": total(TARGET, "model_ms") / model,
        }
    clock = [per_method[m]["clock_ms_per_token"] for m in grid]
    n = len(runs[TARGET])
    halves = [[total(m, "clock_ms", part) / total(m, "tokens", part) for m in grid]
              for part in (slice(0, n // 2), slice(n // 2, n))]
    worst = max(abs(per_method[m]["model_error_drift_removed"]) for m in per_method if m != TARGET_AGAIN)
    return {
        "methods": per_method,
        "spearman_model_vs_clock": spearman([per_method[m]["model_ms_per_token"] for m in grid], clock),
        "spearman_tables_vs_clock": spearman([per_method[m]["tables_ms_per_token"] for m in grid], clock),
        "noise_floor": {"target_again_vs_target": per_method[TARGET_AGAIN]["clock_ms_per_token"]
                        / per_method[TARGET]["clock_ms_per_token"] - 1,
                        "spearman_clock_half_vs_half": spearman(*halves)},
        "worst_model_error_drift_removed": worst,
    }


def run(cfg: ClockConfig) -> dict[str, object]:
    check_config(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    pair = load_pair(cfg.pair, dtype=cfg.dtype)
    cost_model = load_or_calibrate(pair, refresh=cfg.refresh)
    if cost_model.loop is None:
        raise RuntimeError("the cost model has no loop costs; run again with --refresh")
    prompts = [p for d in cfg.domains for p in load_domain(pair.tokenizer, d, cfg.split, cfg.prompts)]
    todo = methods(cfg)
    runs: dict[str, list[dict]] = {name: [] for name, _ in todo}
    rng = random.Random(cfg.seed)
    def decode(prompt, kwargs: dict, limit: int):
        if "tree" in kwargs:
            from bild_env.decoding.tree import generate_tree

            return generate_tree(pair, prompt, kwargs["tree"], limit, cost_model)
        return decode_with(pair, prompt, kwargs, cost_model, limit)

    for name, kwargs in todo:  # warm-up: every method once, untimed
        decode(prompts[0], kwargs, min(8, cfg.max_new_tokens))
    for prompt in tqdm(prompts, desc="prompts (every method each)", unit="prompt"):
        for name, kwargs in rng.sample(todo, len(todo)):
            s = decode(prompt, kwargs, cfg.max_new_tokens).stats
            runs[name].append({"tokens": s.new_tokens, "clock_ms": s.wall_ms, "model_ms": s.model_ms,
                               "tables_ms": s.model_ms - loop_of(cost_model.loop, features(s, len(prompt)))})
    grid = [name for name, kwargs in todo if "fallback" in kwargs]
    result = {"machine": machine_description(pair.device), "pair": pair.name, "dtype": str(pair.dtype),
              "threads": torch.get_num_threads(), "config": asdict(cfg), "loop": cost_model.loop.to_dict(),
              "prompts": len(prompts), **summarise(runs, grid), "runs": runs}
    return result


def report(result: dict) -> str:
    lines = [f"{result['machine']}; {result['pair']} {result['dtype']}; {result['prompts']} prompts",
             f"{'method':<24}{'clock ms/tok':>13}{'model':>9}{'tables':>9}{'model err':>11}{'(drift out)':>12}"
             f"{'tables err':>12}{'(drift out)':>12}"]
    for name, m in result["methods"].items():
        lines.append(f"{name:<24}{m['clock_ms_per_token']:>13.2f}{m['model_ms_per_token']:>9.2f}"
                     f"{m['tables_ms_per_token']:>9.2f}{m['model_error']:>+11.1%}{m['model_error_drift_removed']:>+12.1%}"
                     f"{m['tables_error']:>+12.1%}{m['tables_error_drift_removed']:>+12.1%}")
    noise = result["noise_floor"]
    lines += [f"Spearman over the grid, model vs clock: {result['spearman_model_vs_clock']:.3f} "
              f"(tables alone {result['spearman_tables_vs_clock']:.3f}; bar 0.9)",
              f"worst |model error| with drift out: {result['worst_model_error_drift_removed']:.1%} (bar 10%)",
              f"noise floor: target-only again vs first {noise['target_again_vs_target']:+.1%}; "
              f"clock's own Spearman, half of the prompts vs the other half {noise['spearman_clock_half_vs_half']:.3f}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    return report_main(ClockConfig, argv, __doc__.split("\n\n")[0], check_config, run, report)


if __name__ == "__main__":
    from bild_env.command import run_command

    sys.exit(run_command("python -m scripts.analysis.clock", main))
