"""The serving evaluation's tables: a row per policy (mean return with its interval, the paired difference to the best
single fixed action and to the tables, the goodput ratio), every policy over all levels, the markdown and the
goodput plot.
"""

from __future__ import annotations


from pathlib import Path

import numpy as np

from agents.common.stats import mean_ci
from bild_env.decoding.profiles import MACHINE



def row(name: str, returns: np.ndarray, speedups: np.ndarray, base: np.ndarray | None) -> dict:
    lo, hi = mean_ci(returns)
    out = {"policy": name, "return": float(returns.mean()), "ci": [lo, hi], "speedup": float(speedups.mean()),
           "_episodes": (returns, speedups)}
    if base is not None:
        d = returns - base
        out["minus_best_single"] = float(d.mean())
        out["minus_best_single_ci"] = list(mean_ci(d))
    return out


def overall_rows(raw: dict[str, list[tuple[np.ndarray, np.ndarray]]]) -> list[dict]:
    """Every policy over all levels' episodes together, paired with the best single fixed action's."""
    joined = {name: (np.concatenate([r for r, _ in parts]), np.concatenate([s for _, s in parts]))
              for name, parts in raw.items()}
    base = next(v for k, v in joined.items() if k.startswith("best single fixed"))[0]
    return add_minus_table([row(name, r, s, base) for name, (r, s) in joined.items()])


REFERENCES = (("minus_table", "per-load table"), ("minus_batch_table", "per-batch-size table"),
              ("minus_domain_batch_table", "per-batch-size-and-domain table"),
              ("minus_threshold_table", "per-batch-size table of thresholds"))  # (row key, the rule's row name)


def add_minus_table(rows: list[dict]) -> list[dict]:
    """Every row's paired difference (episode by episode, with its interval) to the per-load table's returns
    (``minus_table``), to the per-batch-size table's (``minus_batch_table``) and to the per-(batch size, domain)
    table's (``minus_domain_batch_table``), where those rules ran."""
    for key, name in REFERENCES:
        found = next((r for r in rows if r["policy"] == name or r["policy"].startswith((name + " (", name + ","))), None)
        if found is None:
            continue
        for r in rows:
            d = r["_episodes"][0] - found["_episodes"][0]
            r[key], r[key + "_ci"] = float(d.mean()), list(mean_ci(d))
    return rows


def plot_goodput(report: dict, path: Path) -> Path:
    """Goodput (ratio to target-only serving at the same load) against the load level, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(report["levels"], key=float)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = [r["policy"] for r in report["levels"][levels[0]]]
    colors = plt.cm.tab20.colors  # more policies than the default cycle's 10 colours
    for i, name in enumerate(names):
        ys = [report["levels"][u][i]["speedup"] for u in levels]
        agent = name.startswith("agent")
        ax.plot([float(u) for u in levels], ys, marker="o", lw=2 if name.startswith("agents,") else 1,
                ls="--" if agent else "-", color=colors[(2 * i + i // 10) % 20],  # dark shades, then light
                label=name if len(name) < 60 else name[:57] + "...")
    env = report["config"]["env"]
    return save_goodput_plot(fig, ax, path, "goodput / target-only goodput",
                             f"BiLD-Serve-v0 on test prompts ({env['pair']}, mix {env['mix']})")


def save_goodput_plot(fig, ax, path: Path, ylabel: str, title: str) -> Path:
    """A goodput-against-load figure finished (the target-only line at 1, labels, legend) and written to ``path``."""
    import matplotlib.pyplot as plt

    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("load (utilisation of target-only capacity)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def markdown(report: dict) -> str:
    if "speed" in report:
        return "\n".join(["| load | mean batch | env steps/s (warm, median) | range |", "|---|---|---|---|"]
                         + [f"| {u} | {r['mean_batch']:.1f} | {r['steps_per_s']:.0f} | {r['range'][0]:.0f}-{r['range'][1]:.0f} |"
                            for u, r in report["speed"].items()])
    lines = [f"costs charged: {report.get('cost_profile', MACHINE)}; rules chosen under: "
             f"{report.get('rules_chosen_under', report.get('cost_profile', MACHINE))}", ""]
    sections = [("levels", load, rows) for load, rows in report["levels"].items()]
    sections += [("overall", "all constant levels", report["overall"])] if report.get("overall") else []
    sections += [("moving", load, rows) for load, rows in report["moving"].items()]
    for kind, load, rows in sections:
        keys = ["minus_best_single", "minus_table", "minus_batch_table"]
        keys += [k for k in ("minus_domain_batch_table", "minus_threshold_table") if any(k in r for r in rows)]
        heads = {"minus_best_single": "best single", "minus_table": "per-load table",
                 "minus_batch_table": "per-batch-size table", "minus_domain_batch_table": "per-(batch size, domain) table",
                 "minus_threshold_table": "per-batch-size table of thresholds"}
        lines += [f"\n**{'load ' + load if kind == 'levels' else load}**\n",
                  "| policy | return [95% CI] | " + " | ".join(f"minus {heads[k]} [paired 95% CI]" for k in keys)
                  + " | speedup vs target-only |", "|---" * (len(keys) + 3) + "|"]
        for r in rows:
            cells = []
            for key in keys:
                if key in r:
                    lo, hi = r[key + "_ci"]
                    cells.append(f"{r[key]:+.3f} [{lo:+.3f}, {hi:+.3f}]")
                else:
                    cells.append("-")
            lines.append(f"| {r['policy']} | {r['return']:+.3f} [{r['ci'][0]:+.3f}, {r['ci'][1]:+.3f}] | "
                         + " | ".join(cells) + f" | {r['speedup']:.3f}x |")
    for d, v in report.get("domains", {}).items():
        lines += [f"\n**domain {d}** (best single: {v['best_single']})\n",
                  "| load | table's action | table minus single | table speedup | single speedup |", "|---|---|---|---|---|"]
        for u, x in v["levels"].items():
            lines.append(f"| {u} | {x['table']} | {x['table_minus_single']:+.3f} | {x['table_speedup']:.3f}x | "
                         f"{x['single_speedup']:.3f}x |")
    return "\n".join(lines)
