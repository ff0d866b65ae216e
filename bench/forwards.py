"""Time one forward of each model by how many tokens it is fed, beside what the cost model predicts.

    python -m bench.forwards --pair smollm2 --threads 2                 # float32 and bfloat16 side by side
    python -m bench.forwards --pair smollm2 --dtype float32 --rounds 5  # one dtype, more rounds
    python -m bench.forwards --pair tiny-random --fed 1,2,4
    python -m bench.forwards --pair smollm2 --batch 1 2 4 8 16 32       # batched forwards (one dtype: auto)

For each dtype (float32 and bfloat16 where the CPU has native bfloat16; without, bfloat16 is emulated and left
out) and each model of the pair: the median ms of a forward that feeds ``n`` new tokens
(default every count 1..12 a decoding step can feed, and the prefill lengths 16, 32, 64) on each of
``--context`` cached ones (``bild_env.decoding.timing.time_batched_grid`` at batch 1, unmasked: all cells
round-robin), next to the pair's cost model on this device (``load_or_calibrate``: the one the env and
``evaluate.py`` use, calibrated once and cached; ``--refresh`` calibrates it again) and the relative error. The forwards
are timed here, after the cost model is loaded or calibrated, so the error is measured on samples the
cost model never saw. A shared CPU's speed drifts (10-20% over seconds on a 2-core cloud VM), so the
report also gives the error left once the level is evened out (the cost model scaled by the median
ratio measured / modelled of that model): what a better model could still remove. Each cell is timed
in ``--rounds`` independent rounds (default 3): the measured ms is the median of the rounds' medians and
``spread_pct`` (max - min over the rounds, % of it) says how much a median moves from run to run.
A round of forwards during which other processes used the CPU is timed again (the report counts
them). Prints a table, each model's ``v(n) = t(fed n) / t(fed 1)`` and ``c = t_draft(fed 1) / t_target(fed 1)``
(``ratios``: what verifying n tokens costs, what a draft step costs, against a target-only step), how the lean
products read their weights by rows fed (``plans``), and the largest |error| per model and dtype; writes
everything as JSON.

With ``--batch B1 B2 ...``: one forward of B sequences fed n tokens each (default n = 1..12) on each
``--context`` cached tokens per sequence (``time_batched_grid``), beside the pair's batched tables
(``load_or_calibrate_batched`` over those batch sizes, timed once per machine and cached), in one dtype
(``--dtype``, default auto). Prints, per model and context, a matrix of measured ms and the error of
the cost model by (B, n), and the largest errors; writes ``results/bench_forwards_batched.json``.
Every report names the machine (``machine_description``: CPU model and instruction sets, torch, threads).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
from pathlib import Path

import torch

from bild_env import load_pair
from bild_env.cli import setup_logging
from bild_env.decoding.costs import (PREFILL_FED, STEP_FED, load_or_calibrate, load_or_calibrate_batched,
                                     time_batched_grid)
from bild_env.models.device import cpu_has_native_bf16, explain_dtype, machine_description
from bild_env.models.pairs import preset_names

BOTH = ("float32", "bfloat16")
logger = logging.getLogger("bench.forwards")


def _cpu_pressure() -> float | None:
    """Linux's CPU pressure (share of the last 10 s some task waited for a CPU, %), None where unknown."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(dict(kv.split("=") for kv in line.split()[1:])["avg10"])
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _machine_load() -> dict[str, float | None]:
    return {"load_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "cpu_pressure_10s_pct": _cpu_pressure()}


def run(pair_name: str, fed: tuple[int, ...], context: int | tuple[int, ...], repeats: int, device: str | None = None,
        dtype: str | None = None, rounds: int = 1, refresh: bool = False, products: str = "measured") -> dict[str, object]:
    """One dtype: time every ``fed`` count at each ``context`` beside the cost model; a dict of rows."""
    contexts = (context,) if isinstance(context, int) else tuple(context)
    pair, rows, head, timing = _time_rows(pair_name, None, fed, contexts, repeats, device, dtype, rounds, refresh,
                                          products)

    def worst(key: str, most_fed: int = 10**9) -> dict[str, float]:
        return {role: max((abs(r[key]) for r in rows if r["model"] == role and r["fed"] <= most_fed), default=0.0)
                for role in ("draft", "target")}

    if timing["busy_rounds_dropped"]:
        logger.warning("%s: other processes used the CPU during %d of %d timing rounds (those were timed again after "
                       "waiting %.0f s for them)", pair.dtype, timing["busy_rounds_dropped"], timing["timing_rounds"],
                       timing["waited_for_quiet_s"])
    return {**head, "repeats": repeats, "rounds": rounds, "ratios": ratios(rows, contexts), "plans": plans(pair),
            "products": products,
            "contexts": list(contexts), "rows": rows, "max_abs_error_pct": worst("error_pct"),
            "max_abs_error_pct_fed_1_12": worst("error_pct", max(STEP_FED)),
            "max_abs_level_adjusted_error_pct_fed_1_12": worst("level_adjusted_error_pct", max(STEP_FED)),
            "max_spread_pct_fed_1_12": worst("spread_pct", max(STEP_FED)) if rounds > 1 else None, **timing}


def _time_rows(pair_name: str, batch_sizes: tuple[int, ...] | None, fed: tuple[int, ...], contexts: tuple[int, ...],
               repeats: int, device: str | None, dtype: str | None, rounds: int, refresh: bool,
               products: str) -> tuple[object, list[dict], dict[str, object], dict[str, object]]:
    """What ``run`` and ``run_batched`` share: load the pair (``use_products``) and its cost model, time every cell
    (``batch_sizes`` None: one sequence, unmasked, beside ``cost.ms``; else batched, masked as the padded decoder
    runs them, beside ``cost.batch_ms``), a warm-up round first, then ``rounds`` rounds of ``repeats``. Returns the
    pair, the rows (``_level_adjust``ed), the report's first fields and its timing fields (its last)."""
    pair = load_pair(pair_name, device=device, dtype=dtype)
    use_products(pair, products)
    if max(contexts) + max(fed) > pair.max_positions:
        raise ValueError(f"--context {max(contexts)} plus {max(fed)} fed tokens is more than the {pair.max_positions} "
                         f"positions of pair {pair.name}; lower --context or --fed")
    batched = batch_sizes is not None
    cost = (load_or_calibrate_batched(pair, batch_sizes, refresh=refresh) if batched
            else load_or_calibrate(pair, refresh=refresh))
    before, stats, rows = _machine_load(), {}, []
    for role in ("draft", "target"):
        model = getattr(pair, role)
        cells = [(b, n, ctx) for ctx in contexts for b in batch_sizes or (1,) for n in fed]
        # warm-up: every shape once (batched: without waiting for a busy machine)
        time_batched_grid(model, cells, pair.device, 1, max_wait_s=0.0 if batched else None, masked=batched)
        medians = [[] for _ in cells]
        for _ in range(rounds):  # batched: timed as the tables are, masked, as the padded decoder runs them
            for cell_medians, (*_, ms) in zip(medians, time_batched_grid(model, cells, pair.device, repeats, stats=stats,
                                                                         masked=batched)):
                cell_medians.append(ms)
        for (b, n, ctx), ms in zip(cells, medians):
            measured = statistics.median(ms)
            predicted = cost.batch_ms(role, b, n, ctx) if batched else cost.ms(role, n, ctx)
            row = {"model": role, **({"batch": b} if batched else {}), "fed": n, "context": ctx,
                   "measured_ms": measured, "cost_model_ms": predicted,
                   "error_pct": 100.0 * (predicted - measured) / measured}
            if rounds > 1:
                row["rounds_ms"] = ms
                row["spread_pct"] = 100.0 * (max(ms) - min(ms)) / measured
            rows.append(row)
    _level_adjust(rows)  # the error left once the machine's speed now and at calibration is evened out
    head = {"pair": pair.name, "device": cost.device, "machine": machine_description(pair.device),
            "dtype": str(pair.dtype)}
    return pair, rows, head, {
        "cost_model": cost.to_dict(), "timing_rounds": stats.get("rounds", 0),
        "busy_rounds_dropped": stats.get("busy_rounds_dropped", 0), "busy_rounds_kept": stats.get("busy_rounds_kept", 0),
        "waited_for_quiet_s": stats.get("waited_s", 0.0), "machine_load_before": before,
        "machine_load_after": _machine_load()}


def ratios(rows: list[dict], contexts: tuple[int, ...]) -> dict[str, dict]:
    """Per context: each model's ``v(n) = t(fed n) / t(fed 1)`` (what verifying n tokens costs against one step of
    target-only decoding; 1 is free) and ``c = t_draft(fed 1) / t_target(fed 1)``, from the measured medians."""
    out = {}
    for ctx in contexts:
        ms = {(r["model"], r["fed"]): r["measured_ms"] for r in rows if r["context"] == ctx}
        if ("target", 1) not in ms:
            continue
        v = {role: {n: ms[(role, n)] / ms[(role, 1)] for (m, n) in ms if m == role} for role in ("draft", "target")
             if (role, 1) in ms}
        out[str(ctx)] = {"v": v, "c": ms[("draft", 1)] / ms[("target", 1)] if ("draft", 1) in ms else None}
    return out


PRODUCTS = ("measured", "packed", "plain", "weight_left")  # --products: how the lean models' products read their weights


def use_products(pair, products: str) -> None:
    """``measured``: as loaded (``bild_env.models.products.choose_ways``); ``packed``, ``plain`` or ``weight_left``:
    that way at every count of rows (``lean.set_plan``), for a comparison side by side."""
    from bild_env.models.lean import LeanLlamaModel, set_plan

    if products == "measured":
        return
    for model in (pair.draft, pair.target):
        if isinstance(getattr(model, "model", None), LeanLlamaModel):
            set_plan(model, ("", products))


def plans(pair) -> dict[str, str | None]:
    """How each model's lean products read their weights by rows fed (``bild_env.models.products.describe_plan``);
    None for a model without the lean forward."""
    from bild_env.models.lean import LeanLlamaModel
    from bild_env.models.products import describe_plan

    return {role: describe_plan(m.model.plan) if isinstance(getattr(m, "model", None), LeanLlamaModel) else None
            for role, m in (("draft", pair.draft), ("target", pair.target))}


def run_all(pair_name: str, fed: tuple[int, ...], context: int | tuple[int, ...], repeats: int,
            device: str | None = None, dtypes: tuple[str | None, ...] = (None,), rounds: int = 1,
            refresh: bool = False, products: tuple[str, ...] = ("measured",)) -> dict[str, object]:
    """``run`` for each of ``dtypes`` and ``products`` in turn; one report holding each as ``runs``."""
    runs = [run(pair_name, fed, context, repeats, device, dt, rounds, refresh, way) for dt in dtypes for way in products]
    return {"pair": runs[0]["pair"], "device": runs[0]["device"], "machine": runs[0]["machine"],
            "threads": torch.get_num_threads(), "torch": torch.__version__, "command": " ".join(sys.argv), "runs": runs}


def _level_adjust(rows: list[dict]) -> None:
    """Add each row's error once the machine's speed level now and at calibration is evened out (per model)."""
    for role in ("draft", "target"):
        mine = [r for r in rows if r["model"] == role]
        level = statistics.median(r["measured_ms"] / r["cost_model_ms"] for r in mine)
        for r in mine:
            r["level_adjusted_error_pct"] = 100.0 * (r["cost_model_ms"] * level - r["measured_ms"]) / r["measured_ms"]


def run_batched(pair_name: str, batch_sizes: tuple[int, ...], fed: tuple[int, ...], contexts: tuple[int, ...],
                repeats: int, device: str | None = None, dtype: str | None = None, rounds: int = 1,
                refresh: bool = False, products: str = "measured") -> dict[str, object]:
    """Time one forward of B sequences fed n tokens each on every context, beside the batched tables; a dict of rows
    (``products``: how the lean models' products read their weights, ``use_products``)."""
    _, rows, head, timing = _time_rows(pair_name, batch_sizes, fed, contexts, repeats, device, dtype, rounds, refresh,
                                       products)

    def worst(key: str) -> dict[str, float]:
        return {role: max((abs(r[key]) for r in rows if r["model"] == role), default=0.0) for role in ("draft", "target")}

    def median_abs(key: str) -> dict[str, float]:
        return {role: statistics.median(abs(r[key]) for r in rows if r["model"] == role) for role in ("draft", "target")}

    return {**head, "batch_sizes": list(batch_sizes), "fed": list(fed), "contexts": list(contexts),
            "repeats": repeats, "rounds": rounds, "command": " ".join(sys.argv), "rows": rows,
            "max_abs_error_pct": worst("error_pct"), "median_abs_error_pct": median_abs("error_pct"),
            "max_abs_level_adjusted_error_pct": worst("level_adjusted_error_pct"),
            "max_spread_pct": worst("spread_pct") if rounds > 1 else None, **timing}


def batched_table(report: dict[str, object]) -> str:
    """Per model and context, a matrix by batch (rows) and tokens fed (columns): measured ms and the model's error %."""
    rows = {(r["model"], r["batch"], r["fed"], r["context"]): r for r in report["rows"]}
    fed, lines = report["fed"], []
    lines.append(f"pair {report['pair']} ({report['dtype'].removeprefix('torch.')}) on {report['machine']}; one forward "
                 f"of B sequences fed n tokens each: measured ms (median of {report['repeats']} forwards"
                 + (f", median of {report['rounds']} rounds" if report["rounds"] > 1 else "")
                 + ") and the batched cost model's error %")
    for role in ("draft", "target"):
        for ctx in report["contexts"]:
            lines += ["", f"{role}, {ctx} cached tokens per sequence",
                      "| B \\ n | " + " | ".join(str(n) for n in fed) + " |", "|---|" + "---|" * len(fed)]
            for b in report["batch_sizes"]:
                cells = [f"{rows[role, b, n, ctx]['measured_ms']:.1f} ({rows[role, b, n, ctx]['error_pct']:+.0f}%)"
                         for n in fed]
                lines.append(f"| {b} | " + " | ".join(cells) + " |")
    lines.append("")
    for role in ("draft", "target"):
        lines.append(f"{role}: |error| median {report['median_abs_error_pct'][role]:.1f}%, max "
                     f"{report['max_abs_error_pct'][role]:.1f}%; max once the machine's speed level is evened out: "
                     f"{report['max_abs_level_adjusted_error_pct'][role]:.1f}%"
                     + (f"; largest spread of a median between rounds: {report['max_spread_pct'][role]:.1f}%"
                        if report["max_spread_pct"] else ""))
    if report["busy_rounds_dropped"] or report["busy_rounds_kept"]:
        lines.append(f"other processes used the CPU: {report['busy_rounds_dropped']} timing rounds timed again, "
                     f"{report['busy_rounds_kept']} slowed rounds kept (of {report['timing_rounds']})")
    return "\n".join(lines)


def table(report: dict[str, object]) -> str:
    """The runs side by side: one column group (measured, cost model, error) per dtype."""
    runs = report["runs"]
    dts = [r["dtype"].removeprefix("torch.") + ("" if r.get("products", "measured") == "measured" else f" {r['products']}")
           for r in runs]
    head = "| model | fed | context | " + " | ".join(f"{d} measured ms | {d} model ms | {d} error %" for d in dts) + " |"
    rounds = f", median of {runs[0]['rounds']} rounds' medians (± half their spread)" if runs[0]["rounds"] > 1 else ""
    lines = [f"pair {report['pair']} on {report['machine']}; median of {runs[0]['repeats']} forwards{rounds}",
             head, "|" + "---|" * (3 + 3 * len(runs))]
    keyed = [{(r["model"], r["fed"], r["context"]): r for r in run["rows"]} for run in runs]
    for key in ((r["model"], r["fed"], r["context"]) for r in runs[0]["rows"]):
        cells = []
        for rows in keyed:
            r = rows.get(key)
            spread = f" (±{r['spread_pct'] / 2:.1f})" if r and "spread_pct" in r else ""
            if r is None:
                cells += ["", "", ""]
                continue
            cells += [f"{r['measured_ms']:.2f}{spread}", f"{r['cost_model_ms']:.2f}", f"{r['error_pct']:+.1f}"]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += ratio_lines(report)
    for run, d in zip(runs, dts):
        for role in ("draft", "target"):
            lines.append(f"max |error| {role} {d}: {run['max_abs_error_pct_fed_1_12'][role]:.1f}% over fed 1..12, "
                         f"{run['max_abs_error_pct'][role]:.1f}% over all fed counts; over fed 1..12 once the "
                         f"machine's speed level is evened out: {run['max_abs_level_adjusted_error_pct_fed_1_12'][role]:.1f}%"
                         + (f"; largest spread of a median between rounds over fed 1..12: "
                            f"{run['max_spread_pct_fed_1_12'][role]:.1f}%" if run["max_spread_pct_fed_1_12"] else ""))
    return "\n".join(lines)


def ratio_lines(report: dict[str, object]) -> list[str]:
    """``v(n)`` at 2, 4, 8 and 12 tokens and ``c`` per dtype, model and context, with the lean products' plans."""
    lines = []
    for run in report["runs"]:
        d = run["dtype"].removeprefix("torch.") + ("" if run.get("products", "measured") == "measured"
                                                   else f" ({run['products']} products)")
        for ctx, r in run["ratios"].items():
            for role, v in r["v"].items():
                v = {int(n): x for n, x in v.items()}  # keys are strings once read back from JSON
                shown = ", ".join(f"v({n}) {v[n]:.2f}" for n in (2, 4, 8, 12) if n in v)
                lines.append(f"{d} {role} at context {ctx}: {shown}")
            if r["c"] is not None:
                lines.append(f"{d} at context {ctx}: c = draft / target fed 1 = {r['c']:.3f}")
        for role, plan in run["plans"].items():
            if plan:
                lines.append(f"{d} {role} products: {plan}")
    return lines + [""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="smollm2", choices=preset_names())
    parser.add_argument("--fed", default=None,
                        help="comma-separated numbers of tokens fed per forward (default 1..12 and the prefill lengths; "
                             "with --batch 1..12)")
    parser.add_argument("--batch", type=int, nargs="+", default=None, metavar="B",
                        help="time batched forwards of these batch sizes beside the batched cost model (e.g. 1 2 4 8 16 32)")
    parser.add_argument("--context", default="64,160", help="comma-separated cached tokens under each timed forward")
    parser.add_argument("--repeats", type=int, default=8, help="forwards per cell in each round (their median)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="independent rounds per cell: the median of their medians, and their spread, are reported")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None,
                        help="float32, bfloat16, float16, auto, or both (float32 and bfloat16; the default on CPU "
                             "without --batch; with --batch the default is auto)")
    parser.add_argument("--products", nargs="+", choices=PRODUCTS, default=["measured"],
                        help="how the lean models' products read their weights, each a run of its own side by side: "
                             "measured (the way timed fastest for each count of rows; the default), packed, plain or "
                             "weight_left (one way at every count)")
    parser.add_argument("--refresh", action="store_true", help="calibrate the cost model again first")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--out", default=None,
                        help="JSON report (default results/bench_forwards.json, with --batch results/bench_forwards_batched.json)")
    args = parser.parse_args(argv)
    setup_logging()
    default_fed = STEP_FED if args.batch else STEP_FED + PREFILL_FED
    try:
        fed = tuple(int(x) for x in args.fed.split(",")) if args.fed else default_fed
        contexts = tuple(int(x) for x in args.context.split(","))
    except ValueError:
        parser.error(f"--fed {args.fed!r} / --context {args.context!r}: give whole numbers separated by commas, e.g. 1,2,4")
    if min(fed) < 1:
        parser.error(f"--fed {args.fed!r}: every forward feeds at least one token")
    if min(contexts) < 0 or args.repeats < 1 or args.rounds < 1:
        parser.error("--context must be >= 0, --repeats and --rounds >= 1")
    if args.batch and min(args.batch) < 1:
        parser.error(f"--batch {args.batch}: every forward runs at least one sequence")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batch:
        dtype = None if args.dtype in (None, "auto") else args.dtype
        if len(args.products) > 1:
            parser.error("--batch times one --products setting at a time")
        report = run_batched(args.pair, tuple(sorted(set(args.batch))), fed, contexts, args.repeats, args.device, dtype,
                             args.rounds, args.refresh, args.products[0])
        print(batched_table(report))
    else:
        on_cpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")
        dtype = args.dtype or ("both" if on_cpu else None)
        dtypes = BOTH if dtype == "both" else (dtype,)
        if dtype == "both" and on_cpu and cpu_has_native_bf16() is False:  # emulated bfloat16 is no figure to report
            logger.warning("bfloat16 left out: %s", explain_dtype("auto", "cpu")[1])
            dtypes = ("float32",)
        report = run_all(args.pair, fed, contexts, args.repeats, args.device, dtypes, args.rounds, args.refresh,
                         tuple(dict.fromkeys(args.products)))
        print(table(report))
    out = Path(args.out or ("results/bench_forwards_batched.json" if args.batch else "results/bench_forwards.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))

if __name__ == "__main__":
    from bild_env.command import run_command

    sys.exit(run_command("python -m bench.forwards", main))
