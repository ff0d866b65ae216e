"""The room each agent closes: from ``evaluate.py --env serve`` reports (their "all constant levels" rows, test
episodes), per policy its return and goodput with intervals, its paired difference from the per-batch-size table, and
the share of the table-to-oracle room it closes ((policy - table) / (per-step oracle - table), of the means).

    python -m scripts.analysis.room results/room_smollm2_bfloat16_xeon-amx-smollm2-bf16.json ... --out results/room.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ORACLE = "per-step hindsight oracle of the fixed actions"
TABLE = "per-batch-size table"


def rows_of(report: dict) -> list[dict]:
    """One report's policies (the overall rows), with the share of the table-to-oracle room closed."""
    by = {r["policy"]: r for r in report["overall"]}
    table, oracle = by[TABLE]["return"], by[ORACLE]["return"]
    out = []
    for r in report["overall"]:
        out.append({"policy": r["policy"], "return": r["return"], "ci": r["ci"], "speedup": r["speedup"],
                    "minus_table": r["minus_batch_table"], "minus_table_ci": r["minus_batch_table_ci"],
                    "room_closed": (r["return"] - table) / (oracle - table) if oracle > table else None})
    return out


def markdown(name: str, report: dict) -> str:
    head = (f"**{name}** (costs: {report.get('cost_profile')}; rules chosen under {report.get('rules_chosen_under')}; "
            f"{report['config']['episodes']} test episodes a load over {len(report['levels'])} loads)\n\n"
            "| policy | return [95% CI] | minus per-batch-size table [paired 95% CI] | goodput vs target-only | "
            "room closed |\n|---|---|---|---|---|")
    lines = [head]
    for r in rows_of(report):
        closed = "" if r["room_closed"] is None else f"{100 * r['room_closed']:+.0f}%"
        lines.append(f"| {r['policy']} | {r['return']:+.3f} [{r['ci'][0]:+.3f}, {r['ci'][1]:+.3f}] | "
                     f"{r['minus_table']:+.3f} [{r['minus_table_ci'][0]:+.3f}, {r['minus_table_ci'][1]:+.3f}] | "
                     f"{r['speedup']:.3f}x | {closed} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", help="evaluate.py --env serve JSONs (with --step-oracle)")
    parser.add_argument("--out", help="write the tables here (markdown) and beside it the rows (JSON)")
    args = parser.parse_args(argv)
    parts, rows = [], {}
    for path in args.reports:
        report = json.loads(Path(path).read_text())
        parts.append(markdown(Path(path).stem, report))
        rows[Path(path).stem] = rows_of(report)
    text = "\n\n".join(parts) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
