"""bench.decoders' limit, old and new, against every stored report's measured naive SD speedups: the textbook limit
at independent acceptance (``limit_speedup``) against the bound from the runs as measured, in the target-only
decoding's own time per token (``bound_speedup``), recomputed from what each report stored.

    python -m scripts.analysis.limits --out results/bench_limits_recomputed.json
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

from bench.decoders import bound_speedup, limit_speedup


def rows(path: str) -> list[dict]:
    report = json.loads(Path(path).read_text())
    out = []
    reports = report if isinstance(report, list) else report.get("reports", [report])
    for rep in reports if isinstance(reports, list) else [reports]:
        for domain, d in (rep.get("domains") or {}).items() if isinstance(rep, dict) else ():
            ms, res = d["forward_ms"], d["results"]
            base = res.get("target only")
            for name, r in res.items():
                if base is None or not name.startswith("naive SD (k=") or r.get("acceptance_rate") is None:
                    continue
                k = int(name.split("k=")[1].split(")")[0].split(",")[0])
                if f"target {k + 1}" not in ms:
                    continue
                c, v = ms["draft 1"] / ms["target 1"], ms[f"target {k + 1}"] / ms["target 1"]
                out.append({"report": Path(path).name, "domain": domain, "method": name, "speedup": r["speedup"],
                            "independent": limit_speedup(r["acceptance_rate"], k, c, v),
                            "bound": bound_speedup(r["mean_accepted_length"], k, ms["draft 1"],
                                                   ms[f"target {k + 1}"], 1000.0 / base["tokens_per_s"])})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reports", default="results/bench_decoders_*.json")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    table = [r for path in sorted(glob.glob(args.reports)) for r in rows(path)]
    summary = {"rows": len(table),
               "independent_below_measured": sum(r["speedup"] > r["independent"] for r in table),
               "bound_below_measured": sum(r["speedup"] > r["bound"] for r in table),
               "bound_below_measured_by_5pct": sum(r["speedup"] > 1.05 * r["bound"] for r in table),
               "max_measured_over_bound": max(r["speedup"] / r["bound"] for r in table)}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "rows": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
