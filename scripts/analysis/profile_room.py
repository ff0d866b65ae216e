"""The learner's room per hardware cost profile: one table and one figure from the benches' JSON.

    python -m scripts.analysis.profile_room --out results/profile_room_smollm2.json \\
        --headroom results/headroom_smollm2_test100_{zen5-smollm2-bf16,h200-smollm2-eager,h200-opt-eager,h200-opt-floor}.json \\
        --serving results/serving_room_smollm2_{zen5-smollm2-bf16,h200-smollm2-eager,h200-opt-eager,h200-opt-floor}.json

For each profile (read from each JSON's ``cost_profile``), with its c (draft forward / target forward) and v(8):
- ``BiLD-v1`` (``bench.headroom``): the best fixed pair (chosen on validation) and its return, the per-step oracle's
  and the agents' (seeds, Q-ensemble) return above it with the paired 95% interval;
- ``BiLD-Serve-v0`` (``evaluate.py --env serve``, all constant load levels): the best rule (the per-batch-size table chosen on
  validation) and its goodput against target-only serving, the per-step hindsight oracle above it.
Writes the JSON; ``scripts/make_figures.py`` draws it (``room_vs_c.png``: room above the best rule against c).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bild_env.decoding.profiles import MACHINE, load_profile

def _economics(name: str) -> dict:
    if name == MACHINE:
        return {"c": None, "v8": None}
    p = load_profile(name)
    return {"c": round(p.c, 4), "v8": round(p.v(8), 4)}


def bild_rows(path: Path) -> dict:
    report = json.loads(path.read_text())
    rows = report["rows"]
    best = next(r for r in rows if r["policy"].startswith("best single action"))
    out = {"best_fixed": best["policy"].split("(chosen")[0].replace("best single action ", "").strip(),
           "best_fixed_return": best["return"], "best_fixed_latency_ms": best.get("latency_ms"), "above_best": {}}
    for r in rows:
        name = r["policy"]
        if name.startswith(("per-step oracle", "per-prompt oracle", "paper's fixed", "agent", "agents' Q-ensemble")):
            key = "agent seed" if name.startswith("agent ") else name.split(" (")[0]
            out["above_best"].setdefault(key, []).append(
                {"policy": name, "diff": r["minus_best_single"], "ci95": r["minus_best_single_ci95"]})
    return {"cost_profile": report.get("cost_profile", MACHINE), **out}


def serving_rows(path: Path) -> dict:
    report = json.loads(path.read_text())
    rows = report["overall"]
    table = next(r for r in rows if r["policy"].startswith("per-batch-size table"))
    rules = [r for r in rows if r["policy"].startswith(("best single", "per-load table", "per-batch-size table"))]
    best = max(rules, key=lambda r: r["return"])
    oracle = next(r for r in rows if r["policy"].startswith("per-step hindsight oracle"))
    first = next(iter(report["levels"].values()))  # a level's rows name the table in full
    named = next(r["policy"] for r in first if r["policy"].startswith("per-batch-size table"))
    return {"cost_profile": report.get("cost_profile", MACHINE), "best_rule": best["policy"],
            "best_rule_goodput_x": best["speedup"], "table": named, "table_goodput_x": table["speedup"],
            "step_oracle_above_table": oracle["minus_batch_table"], "step_oracle_ci95": oracle["minus_batch_table_ci"],
            "step_oracle_goodput_x": oracle["speedup"]}


def markdown(result: dict) -> str:
    lines = ["| profile | c | v(8) | BiLD-v1 best fixed pair (return) | per-step oracle above it | agents above it | "
             "serving: per-batch-size table (goodput) | per-step oracle above it |", "|---|---|---|---|---|---|---|---|"]
    for name, r in result["profiles"].items():
        b, s = r.get("bild", {}), r.get("serving", {})
        fmt = lambda e: f"{e['diff']:+.3f} [{e['ci95'][0]:+.3f}, {e['ci95'][1]:+.3f}]"  # noqa: E731
        above = b.get("above_best", {})
        oracle = "; ".join(fmt(e) for e in above.get("per-step oracle", [])) or "n/a"
        agents = "; ".join([fmt(e) for e in above.get("agent seed", [])] + [
            "ensemble " + fmt(e) for e in above.get("agents' Q-ensemble of 3", [])]) or "not trained"
        lines.append(
            f"| {name} | {r['c']:.3f} | {r['v8']:.2f} | {b.get('best_fixed', 'n/a')} ({b.get('best_fixed_return', 0):+.3f}) | "
            f"{oracle} | {agents} | " + (f"{s['table']} ({s['table_goodput_x']:.3f}x) | {s['step_oracle_above_table']:+.3f} "
                                        f"[{s['step_oracle_ci95'][0]:+.3f}, {s['step_oracle_ci95'][1]:+.3f}] |" if s else "n/a | n/a |"))
    return "\n".join(lines)


def draw(result: dict):
    """The figure: room above the best rule against c, one panel per env."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, env, key in ((axes[0], "bild", "BiLD-v1 (one request)"), (axes[1], "serving", "BiLD-Serve-v0 (a batch)")):
        for name, r in sorted(result["profiles"].items(), key=lambda kv: kv[1]["c"]):
            part = r.get(env)
            if not part:
                continue
            if env == "bild":
                oracle = part["above_best"].get("per-step oracle", [])
                if not oracle:
                    continue
                y, (lo, hi) = oracle[0]["diff"], oracle[0]["ci95"]
                ax.errorbar(r["c"], y, yerr=[[y - lo], [hi - y]], fmt="o", color="C0", capsize=3)
                for e in part["above_best"].get("agents' Q-ensemble of 3", []):
                    d, (l2, h2) = e["diff"], e["ci95"]
                    ax.errorbar(r["c"], d, yerr=[[d - l2], [h2 - d]], fmt="s", color="C3", capsize=3)
            else:
                y, (lo, hi) = part["step_oracle_above_table"], part["step_oracle_ci95"]
                ax.errorbar(r["c"], y, yerr=[[y - lo], [hi - y]], fmt="o", color="C0", capsize=3)
            ax.annotate(name, (r["c"], 0), textcoords="offset points", xytext=(0, -14), ha="center", fontsize=7,
                        rotation=20)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xlim(0, 0.35)
        ax.set_xlabel("c = draft forward / target forward (the profile's)")
        ax.set_title(key, fontsize=10)
    axes[0].set_ylabel("return above the best rule (95% CI)")
    axes[0].plot([], [], "o", color="C0", label="per-step oracle")
    axes[0].plot([], [], "s", color="C3", label="DQN seeds' Q-ensemble")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--headroom", type=Path, nargs="*", default=[], help="bench.headroom JSONs, one per profile")
    parser.add_argument("--serving", type=Path, nargs="*", default=[], help="evaluate.py --env serve JSONs, one per profile")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    profiles: dict[str, dict] = {}
    for path in args.headroom:
        b = bild_rows(path)
        profiles.setdefault(b["cost_profile"], _economics(b["cost_profile"]))["bild"] = b
    for path in args.serving:
        s = serving_rows(path)
        profiles.setdefault(s["cost_profile"], _economics(s["cost_profile"]))["serving"] = s
    result = {"profiles": profiles, "sources": {"headroom": [str(p) for p in args.headroom],
                                                "serving": [str(p) for p in args.serving]}}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    print("the figure: python scripts/make_figures.py (room_vs_c.png)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
