"""Make the documentation's figures from the JSON in results/ (rerunnable; nothing is measured here).

    python -m scripts.build_assets figures                       # results/ -> docs/_static/figures/
    python -m scripts.build_assets figures --out /tmp/figures    # elsewhere
    python -m scripts.build_assets figures --list                # each figure, the JSON it reads and its command

``FIGURES`` is the one list of figures: its name, the result files it reads, the command that produced them
(the documentation's Reproducing page is generated from it) and the function that draws it. Each figure states
its machine, read from the JSON. The PNGs carry no timestamp, so rerunning on the same JSON gives the same files.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PNG_METADATA = {"Software": None}  # no matplotlib version in the file: the same JSON gives the same bytes


@dataclass(frozen=True)
class Figure:
    """One figure: ``draw(results folder)`` returns a matplotlib figure made from ``sources`` alone."""

    name: str  # file name under the output folder
    title: str
    sources: tuple[str, ...]  # files under results/
    command: str  # what produced the sources
    draw: Callable[[Path], plt.Figure]
    note: str = ""  # what the JSON does not say (e.g. the CPU of a run that did not record it)


def load(results: Path, name: str) -> dict:
    return json.loads((results / name).read_text())


def machine_of(report: dict) -> str:
    """The CPU a report names (``machine``), shortened to its model and threads."""
    text = report.get("machine") or report.get("device") or "machine not recorded"
    if ":unknown:" in text:  # the device key of an early run: the CPU's model was not read then
        return f"CPU model not recorded ({text})"
    return text.replace("; x86_64, AVX2, AVX-512, AVX512-BF16", ", AVX512-BF16").replace("torch 2.13.0+cpu, ", "")


# ----------------------------------------------------------------------------------------------------------------
# 1. lossless decoders: speedup over the target alone, per domain
DECODERS = "bench_decoders_smollm2_test_adaptive.json"
DECODER_ROWS = (  # (label, key in the report)
    ("naive SD, k=1", "naive SD (k=1)"),
    ("naive SD, k=2", "naive SD (k=2)"),
    ("naive SD, k=3", "naive SD (k=3)"),
    ("naive SD, adaptive (k<=8, stop<0.5)", "naive SD (k<=8, stop<0.5)"),
    ("BiLD 0.45/0.5 (lossless)", "BiLD (0.45/0.5)"),
    ("HF assisted generation", "HF assisted"),
)


def speedup_by_domain(results: Path) -> plt.Figure:
    report = load(results, DECODERS)
    domains = report["reports"][0]["domains"]
    names = list(domains)
    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    width = 0.8 / len(DECODER_ROWS)
    for i, (label, key) in enumerate(DECODER_ROWS):
        xs, ys, lo, hi = [], [], [], []
        for j, domain in enumerate(names):
            row = domains[domain]["results"].get(key)
            if row is None:
                continue
            low, high = row["speedup_interval"] or (row["speedup"], row["speedup"])
            xs.append(j + (i - (len(DECODER_ROWS) - 1) / 2) * width)
            ys.append(row["speedup"])
            lo.append(row["speedup"] - low)
            hi.append(high - row["speedup"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=label)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([f"{d}\n(target alone {domains[d]['results']['target only']['tokens_per_s']:.0f} tok/s)"
                        for d in names])
    ax.set_ylabel("speedup over the target alone (x)")
    ax.set_ylim(0.8, None)
    cfg = report["config"]
    ax.set_title(f"Lossless decoders, smollm2 pair, {cfg['split']} prompts ({cfg['prompts']} per domain, "
                 f"{cfg['max_new_tokens']} new tokens, 95% intervals)\n{machine_of(report)}, {cfg['dtype']}",
                 fontsize=9)
    ax.legend(fontsize=8, ncol=2, loc="upper left")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------------------------
# 2. goodput against load: in the env (replay, cost model) and on the wall clock
SERVING = "serving_agents_smollm2_paired.json"
SERVING_CLOCK = "serving_load_clock_smollm2_paired.json"
ENV_POLICIES = (  # (label, how the policy's name starts in the report)
    ("speculation off", "speculation off"),
    ("per-load table", "per-load table"),
    ("per-batch-size table", "per-batch-size table"),
    ("per-episode oracle", "per-episode oracle"),
    ("per-step hindsight oracle", "per-step hindsight oracle"),
    ("agents (Q-ensemble of 3 seeds)", "agents' Q-ensemble"),
)
CLOCK_METHODS = (
    ("target only", "target only"),
    ("naive SD, k=4", "naive SD"),
    ("BiLD fixed (0.103, 4.697), lossy", "BiLD fixed"),
    ("per-load table", "per-load table"),
    ("per-batch-size table", "per-batch-size table"),
    ("agents (Q-ensemble of 3 seeds)", "agents' Q-ensemble"),
)


def find(rows, prefix: str):
    """The first row (a dict with "policy") or key whose name starts with ``prefix``."""
    for row in rows:
        name = row["policy"] if isinstance(row, dict) else row
        if name.startswith(prefix):
            return row
    raise KeyError(f"no policy named {prefix!r}...")


def goodput_vs_load(results: Path) -> plt.Figure:
    env = load(results, SERVING)
    clock = load(results, SERVING_CLOCK)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.0, 4.2), sharey=True)
    levels = sorted(env["levels"], key=float)
    for label, prefix in ENV_POLICIES:
        ys = [find(env["levels"][lv], prefix)["speedup"] for lv in levels]
        left.plot([float(lv) for lv in levels], ys, marker="o", label=label)
    left.set_title(f"BiLD-Serve-v0 (cost model, replay), test episodes\n{machine_of(env)}", fontsize=9)
    left.set_ylabel("goodput / target-only goodput (x)")
    clock_levels = sorted(clock["levels"], key=float)
    for label, prefix in CLOCK_METHODS:
        ys, lo, hi = [], [], []
        for lv in clock_levels:
            methods = clock["levels"][lv]["methods"]
            m = methods[find(list(methods), prefix)]
            low, high = m.get("ratio_range") or (m["ratio_to_target_only"],) * 2
            ys.append(m["ratio_to_target_only"])
            lo.append(m["ratio_to_target_only"] - low)
            hi.append(high - m["ratio_to_target_only"])
        right.errorbar([float(lv) for lv in clock_levels], ys, yerr=[lo, hi], marker="o", capsize=3, label=label)
    right.set_title(f"the same methods on real models and the wall clock\n{machine_of(clock)}", fontsize=9)
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("load (share of target-only capacity)")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------------------------
# 3. the agents against every baseline, with 95% intervals
HEADROOM = "headroom_smollm2_test200_all_actions.json"
SERVE_ROWS = (
    ("per-load table", "per-load table"),
    ("per-(load, domain) table", "per-domain-and-load table"),
    ("off above batch 2", "off above batch"),
    ("per-(batch size, domain) table", "per-batch-size-and-domain table"),
    ("per-batch-size table", "per-batch-size table"),
    ("per-episode oracle", "per-episode oracle"),
    ("per-step hindsight oracle", "per-step hindsight oracle"),
    ("agent, seed 0", "agent paired_s0"),
    ("agent, seed 1", "agent paired_s1"),
    ("agent, seed 2", "agent paired_s2"),
    ("agents, Q-ensemble", "agents' Q-ensemble"),
)


def interval_rows(ax, rows: list[tuple[str, float, tuple[float, float]]], colour_of: Callable[[str], str]) -> None:
    for i, (label, value, (low, high)) in enumerate(rows):
        ax.errorbar(value, i, xerr=[[value - low], [high - value]], fmt="o", capsize=3, color=colour_of(label))
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r[0] for r in rows], fontsize=8)
    ax.axvline(0.0, color="black", lw=0.8)
    ax.invert_yaxis()


def agents_vs_baselines(results: Path) -> plt.Figure:
    serve = load(results, SERVING)
    bild = load(results, HEADROOM)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11.0, 4.6), gridspec_kw={"width_ratios": [1.2, 1]})
    overall = serve["overall"]
    rows = []
    for label, prefix in SERVE_ROWS:
        row = find(overall, prefix)
        rows.append((label, row["minus_best_single"], tuple(row["minus_best_single_ci"])))
    interval_rows(left, rows, lambda label: "tab:red" if label.startswith("agent") else
                  ("tab:gray" if "oracle" in label else "tab:blue"))
    acceptance = find(overall, "off below acceptance")
    left.set_xlabel("return above speculation off, all constant loads (95% interval)")
    left.set_title(f"BiLD-Serve-v0, test episodes (the acceptance rule, off-scale: "
                   f"{acceptance['minus_best_single']:+.2f})\n{machine_of(serve)}", fontsize=9)
    rows = []
    for row in bild["rows"]:
        name = row["policy"]
        if name.startswith("paper's fixed"):
            continue
        label = ("per-prompt oracle" if "oracle" in name else
                 f"agent, seed {name.split('aa_s')[1][0]}" if "aa_s" in name else
                 "agents, mean of 6" if name.startswith("agents given") else
                 name.split(" (chosen")[0].replace("best single action", "best fixed pair"))
        rows.append((label, row["minus_best_single"], tuple(row["minus_best_single_ci95"])))
    interval_rows(right, rows, lambda label: "tab:red" if label.startswith("agent") else
                  ("tab:gray" if "oracle" in label else "tab:blue"))
    right.set_xlabel("return minus the best fixed pair (95% paired CI)")
    right.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(5))
    right.set_title(f"BiLD-v1, {bild['config']['prompts']} test prompts, six DQN seeds\n"
                    f"(Wikipedia-only draft: the smollm2-wiki preset)", fontsize=9)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------------------------
# 4. the cost model against the clock
CLOCK = "bench_clock_smollm2_6l_columns.json"


def cost_model_vs_clock(results: Path) -> plt.Figure:
    report = load(results, CLOCK)
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    methods = report["methods"]
    for name, m in methods.items():
        colour = "tab:blue" if name.startswith("bild") else ("tab:green" if name.startswith("naive") else "black")
        ax.scatter(m["clock_ms_per_token"], m["model_ms_per_token"], s=18, color=colour)
    lows = [min(m["clock_ms_per_token"], m["model_ms_per_token"]) for m in methods.values()]
    highs = [max(m["clock_ms_per_token"], m["model_ms_per_token"]) for m in methods.values()]
    span = (min(lows) * 0.95, max(highs) * 1.05)
    ax.plot(span, span, color="gray", lw=0.8, label="model = clock")
    ax.scatter([], [], color="tab:blue", label="BiLD, the 25 fixed pairs")
    ax.scatter([], [], color="tab:green", label="naive SD, k = 1 and 3")
    ax.scatter([], [], color="black", label="target only (twice)")
    ax.set_xlabel("measured on the clock (ms per token)")
    ax.set_ylabel("charged by the cost model (ms per token)")
    ax.set_title(f"Cost model vs clock: Spearman {report['spearman_model_vs_clock']:.3f} "
                 f"(clock half vs half {report['noise_floor']['spearman_clock_half_vs_half']:.3f})\n"
                 f"{machine_of(report)}", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


DECODERS_CMD = ("python -m bench.decoders --pair smollm2 --dtype bfloat16 --domains prose code chat --split test "
                "--prompts 16 --k 1 2 3 --adaptive 8:0.5 --fallback 0.45 --rollback 0.5 --hf --threads 1 "
                "--out results/bench_decoders_smollm2_test_adaptive.json")
SERVING_CMD = ("python evaluate.py --env serve --full --pair smollm2 --levels 0.05 0.15 0.3 1.0 --moving burst:0.05,1.0 daily:0.05,1.0 "
               "--select-episodes 8 --episodes 16 --episode-steps 64 --max-prompts 40 --fixed-actions 0 4 5 10 15 16 20 21 "
               "--domains prose code chat --step-oracle --model results/serving_agents_smollm2_paired/s0 s1 s2 "
               "--out results/serving_agents_smollm2_paired.json")
SERVING_CLOCK_CMD = ("python evaluate.py --env serve --clock --load 0.05 0.3 1.0 --pair smollm2 --threads 1 --requests 32 "
                     "--select-episodes 4 --episode-steps 64 --fixed-actions 0 4 5 10 15 16 20 21 "
                     "--model results/serving_agents_smollm2_paired/s0 s1 s2 "
                     "--out results/serving_load_clock_smollm2_paired.json")
HEADROOM_CMD = ("python -m bench.headroom --pair smollm2 --split test --prompts 200 --oracle-prompts 100 "
                "--select-prompts 50 --threads 1 --model <six runs of python train.py --seed S, S = 0..5>")
CLOCK_CMD = "python -m scripts.analysis.clock --pair smollm2 --prompts 4 --threads 1 --out results/bench_clock_smollm2_6l_columns.json"

# ----------------------------------------------------------------------------------------------------------------
# 5. the paper's Table 2 under hardware cost profiles, beside the paper's own numbers
PAPER_TABLES = ("paper_table_smollm2_zen5-smollm2-bf16.json", "paper_table_smollm2_h200-opt-eager.json")
PAPER_TABLE_ROWS = (("single model", "single model"), ("naive SD", "naive speculative decoding"),
                    ("BiLD (0.103, 4.697)", "BiLD (0.103, 4.697)"), ("BiLD, best grid pair", "BiLD, best grid pair"),
                    ("BiLD + DQN", "BiLD + the agents' Q-ensemble"))
PAPER_TABLE_CMD = ("python -m bench.paper_table --cost-profile P --model <three runs of python train.py --cost-profile P "
                   "--seed S> --out results/paper_table_smollm2_P.json, P = zen5-smollm2-bf16 and h200-opt-eager")


def paper_table(results: Path) -> plt.Figure:
    reports = [load(results, name) for name in PAPER_TABLES]
    paper = reports[0]["paper_ms"]
    paper_speedup = {"single model": 1.0, "naive SD": paper["single model"] / paper["naive speculative decoding"],
                     "BiLD (0.103, 4.697)": paper["single model"] / paper["BiLD (0.103, 4.697)"],
                     "BiLD + DQN": paper["single model"] / paper["BiLD + DQN"]}
    fig, ax = plt.subplots(figsize=(9.5, 4.2))
    labels = [label for label, _ in PAPER_TABLE_ROWS]
    width = 0.26
    ax.bar([i - width for i in range(len(labels))], [paper_speedup.get(label, float("nan")) for label in labels], width,
           color="0.75", label="the paper: OPT-125M -> OPT-6.7B, WikiText-2, RTX 4090 (reported)")
    for k, report in enumerate(reports):
        rows = {label: next(r for r in report["rows"] if r["method"].startswith(key)) for label, key in PAPER_TABLE_ROWS}
        speedups = [rows[label]["speedup"] for label in labels]
        bars = ax.bar([i + k * width for i in range(len(labels))], speedups, width, color=f"C{k}",
                      label=f"smollm2 tokens, latency charged by {report['cost_profile']}")
        for bar, label in zip(bars, labels):
            r = rows[label]
            ax.annotate(f"BLEU {r['bleu']:.0f}\n{100 * r['exact_match']:.0f}% =", (bar.get_x() + bar.get_width() / 2,
                        bar.get_height()), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=6)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("speedup over the single model (x)")
    ax.set_ylim(0, 2.6)
    ax.set_title("The paper's Table 2 in structure: mean latency per generation (100 test prompts, 32 tokens); "
                 "quality: BLEU against the greedy reference, share equal to it", fontsize=8)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------------------------
# 6. the learner's room per hardware cost profile (scripts/analysis/profile_room.py gathers it)
ROOM = "profile_room_smollm2.json"
ROOM_CMD = ("python -m bench.headroom --cost-profile P --split test --prompts 100 --select-prompts 50 --oracle-prompts 20 "
            "--lookahead --lookahead-prompts 20 --no-bandits [--model <runs>] and python evaluate.py --env serve --full --cost-profile P "
            "--step-oracle ... for each profile P; python -m scripts.analysis.profile_room gathers them")


def room_vs_c(results: Path) -> plt.Figure:
    sys.path.insert(0, str(ROOT / "scripts" / "analysis"))
    from profile_room import draw

    return draw(load(results, ROOM))


FIGURES = (
    Figure("speedup_by_domain.png", "Lossless speculative decoding per domain", (DECODERS,), DECODERS_CMD,
           speedup_by_domain),
    Figure("goodput_vs_load.png", "Goodput against load, in the env and on the clock", (SERVING, SERVING_CLOCK),
           f"{SERVING_CMD}; then {SERVING_CLOCK_CMD}", goodput_vs_load),
    Figure("agents_vs_baselines.png", "The agents against every baseline, with intervals", (SERVING, HEADROOM),
           f"{SERVING_CMD}; and {HEADROOM_CMD}", agents_vs_baselines,
           note="the BiLD-v1 panel ran with the Wikipedia-only draft (now the smollm2-wiki preset) on a 2-core AMD EPYC "
                "Zen 4 (family 25 model 17), as the notes of its run say"),
    Figure("cost_model_vs_clock.png", "The cost model against the wall clock", (CLOCK,), CLOCK_CMD,
           cost_model_vs_clock),
    Figure("paper_table.png", "The paper's Table 2 under hardware cost profiles", PAPER_TABLES, PAPER_TABLE_CMD,
           paper_table),
    Figure("room_vs_c.png", "The learner's room above the best rule, per hardware cost profile", (ROOM,), ROOM_CMD,
           room_vs_c),
)


def make(results: Path, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for figure in FIGURES:
        fig = figure.draw(results)
        path = out / figure.name
        fig.savefig(path, dpi=110, metadata=PNG_METADATA)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=ROOT / "results", help="folder of result JSON (default: results/)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "_static" / "figures",
                        help="where the PNGs go (default: docs/_static/figures/)")
    parser.add_argument("--list", action="store_true", help="print each figure, its sources and command; draw nothing")
    args = parser.parse_args(argv)
    if args.list:
        for f in FIGURES:
            print(f"{f.name}: {f.title}\n  from: {', '.join(f.sources)}\n  made by: {f.command}"
                  + (f"\n  note: {f.note}" if f.note else ""))
        return 0
    missing = [s for f in FIGURES for s in f.sources if not (args.results / s).is_file()]
    if missing:
        print(f"error: missing result files in {args.results}: {missing}", file=sys.stderr)
        return 2
    for path in make(args.results, args.out):
        print(f"wrote {path}")
    return 0

