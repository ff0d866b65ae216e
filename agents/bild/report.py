"""The comparison's report on BiLD-v1: each method's means with bootstrap intervals over the prompts
(``summarize``), the markdown table, and the plots (thresholds chosen, latency, the grid's plane).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from agents.bild.baselines import GridSearch
from bild_env.env import BildEnv
from agents.bild.methods import Row
from agents.common.stats import mean_ci


# -- aggregation -----------------------------------------------------------------------------------
def summarize(rows: list[Row], env: BildEnv, references: dict[int, list[int]]) -> dict[str, dict[str, Any]]:
    from sacrebleu.metrics import BLEU

    out: dict[str, dict[str, Any]] = {}
    for method in dict.fromkeys(r.method for r in rows):
        rs = [r for r in rows if r.method == method]
        lat = np.array([r.latency_ms for r in rs])
        tokens = sum(r.new_tokens for r in rs)
        proposed, accepted = sum(r.proposed for r in rs), sum(r.accepted for r in rs)
        hyps = [env.pair.decode(r.new_ids) for r in rs]
        refs = [env.pair.decode(references[r.prompt_index]) for r in rs]
        model_ms = [r.model_ms for r in rs]
        rewards = [r.reward for r in rs]
        read = None not in [r.regret for r in rs]
        lo, hi = mean_ci(lat)
        out[method] = {
            "latency_ms_mean": float(lat.mean()), "latency_ms_median": float(np.median(lat)),
            "latency_ms_ci95": [lo, hi], "tokens_per_s": 1000.0 * tokens / lat.sum(),
            "acceptance_rate": accepted / proposed if proposed else None,
            "mean_accepted_length": tokens / max(1, sum(r.target_forwards for r in rs)),
            "bleu": BLEU().corpus_score(hyps, [refs]).score,
            "exact_match": float(np.mean([r.new_ids == references[r.prompt_index] for r in rs])),
            "regret_per_token": sum(r.regret for r in rs) / max(1, tokens) if read else None,
            "fidelity": 1.0 - sum(r.mismatches for r in rs) / max(1, tokens) if read else None,
            "mean_reward": None if None in rewards else float(np.mean(rewards)),
            "model_latency_ms_mean": None if None in model_ms else float(np.mean(model_ms)),
            "prompts": len(rs),
        }
    base = out.get("single model", {}).get("tokens_per_s")
    for m in out.values():
        m["speedup"] = m["tokens_per_s"] / base if base else None
    return out


def markdown(results: dict[str, dict[str, Any]], header: str) -> str:
    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    lines = [header, "",
             "| method | latency ms/sentence (mean [95% CI]) | median | tokens/s | speedup | acceptance | tokens/target fwd "
             "| BLEU | exact match | regret nats/token | fidelity | reward | cost-model ms | cost-model error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in results.items():
        lo, hi = m["latency_ms_ci95"]
        model = m["model_latency_ms_mean"]
        error = None if model is None else model / m["latency_ms_mean"] - 1.0  # cost model vs the wall clock
        lines.append(
            f"| {name} | {m['latency_ms_mean']:.1f} [{lo:.1f}, {hi:.1f}] | {m['latency_ms_median']:.1f} | "
            f"{m['tokens_per_s']:.1f} | {f(m['speedup'], '.2f')}x | {f(m['acceptance_rate'], '.3f')} | "
            f"{m['mean_accepted_length']:.2f} | {m['bleu']:.1f} | {100 * m['exact_match']:.0f}% | "
            f"{f(m['regret_per_token'], '.4f')} | {f(m['fidelity'], '.3f')} | "
            f"{f(m['mean_reward'], '.3f')} | {f(m['model_latency_ms_mean'], '.1f')} | {f(error, '+.1%')} |")
    return "\n".join(lines)


# -- plots -----------------------------------------------------------------------------------------
def plot_all(out: Path, results: dict, threshold_trace: list[list[tuple[float, float]]], grid: GridSearch,
             dqn_point: dict | None, fixed: tuple[float, float], agent: str = "DQN") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, name: str) -> Path:
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        return out / name

    paths = []
    if threshold_trace:  # the paper's figure 2: thresholds the agent (the DQN by default) chose over the test runs
        fig, axes = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
        runs = np.arange(1, len(threshold_trace) + 1)
        for ax, k, name, ref in ((axes[0], 0, "fallback threshold", fixed[0]), (axes[1], 1, "rollback threshold (nats)", fixed[1])):
            means = [np.mean([t[k] for t in run]) for run in threshold_trace]
            ax.plot(runs, means, marker=".", lw=1, label=f"{agent} (mean over the run's steps)")
            ax.axhline(ref, ls="--", c="gray", label=f"fixed BiLD ({ref})")
            ax.set_ylabel(name)
            ax.legend(loc="best", fontsize=8)
        axes[1].set_xlabel("test run")
        fig.suptitle(f"Thresholds chosen by the {agent}")
        paths.append(save(fig, "thresholds.png"))

    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(results)
    means = [results[n]["latency_ms_mean"] for n in names]
    err = np.array([[m - results[n]["latency_ms_ci95"][0], results[n]["latency_ms_ci95"][1] - m] for n, m in zip(names, means)]).T
    ax.barh(names, means, xerr=err, color="tab:blue", alpha=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("latency per sentence, ms (wall clock, mean with 95% CI)")
    paths.append(save(fig, "latency.png"))

    fig, ax = plt.subplots(figsize=(7, 5))
    table = grid.table
    sc = ax.scatter([p.latency_ms for p in table], [p.bleu for p in table], c=[p.rollback for p in table],
                    s=[30 + 200 * p.fallback for p in table], cmap="viridis", alpha=0.8)
    for p in table:
        ax.annotate(p.label, (p.latency_ms, p.bleu), fontsize=6, alpha=0.7)
    fig.colorbar(sc, label="rollback threshold (nats); marker size: fallback")
    if dqn_point:
        ax.scatter([dqn_point["latency_ms"]], [dqn_point["bleu"]], marker="*", s=300, c="red", label=agent)
        ax.legend()
    ax.set_xlabel("latency per sentence, ms (cost model, validation prompts)")
    ax.set_ylabel("BLEU vs target greedy")
    ax.set_title(f"The 25 fixed threshold pairs and the {agent}")
    paths.append(save(fig, "plane.png"))
    return paths
