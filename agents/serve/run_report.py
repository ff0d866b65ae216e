"""What a serving run learned, in a table: its agent against the rules it was judged with, on the same validation
episodes, and the commands to look further. The main job (``python train.py --env serve``) prints it last and writes
it to the run's ``summary.json`` (``result``).

    rows = comparison(history, references)   # the agent's evaluations and the rules' episodes, named fields
    print(format_table(rows))                # one line each: goodput against target-only serving, return, intervals

Every figure is a mean over the run's validation episodes (``--eval-episodes`` per load level) with its 95%
bootstrap interval (``agents.common.stats.mean_ci``). The rules are chosen on those same episodes (the best fixed
action, the best per load, the best per batch size: ``agents.serve.validation.rule_references``), so their lines
are lines to reach, not estimates on new episodes; ``python evaluate.py --env serve --model <run>`` chooses them on
validation and judges every method on test episodes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from agents.common.stats import mean_ci

# The rules a serving run is judged with, in the table's order, with what each is.
RULES = {
    "batch_table": "per-batch-size table (the best action per batch size)",
    "load_table": "per-load table (the best fixed action per load)",
    "best_fixed": "best fixed action",
    "off": "speculation off (target-only serving)",
}


def episode_stats(returns: np.ndarray, speedups: np.ndarray) -> dict:
    """Named means and 95% intervals of per-episode returns and speedups (goodput over target-only serving, x)."""
    return {"return": float(np.mean(returns)), "return_ci": list(mean_ci(returns)),
            "speedup": float(np.mean(speedups)), "speedup_ci": list(mean_ci(speedups)), "episodes": len(returns)}


def reference_values(reference) -> tuple[float, float]:
    """(return, speedup) of one entry of a run's ``summary.json`` ``references``: named fields (``episode_stats``),
    or the bare ``[return, speedup]`` pair that runs wrote before."""
    if isinstance(reference, dict):
        return float(reference["return"]), float(reference["speedup"])
    ret, speed = reference
    return float(ret), float(speed)


def comparison(history: list[dict], references: dict, floor: dict | None = None) -> list[dict]:
    """The table's rows: the agent on the per-batch-size table's floor (``floor``, where the run chose one: the
    ``floor.json`` of ``agents.serve.training.put_on_floor``), the agent at its best evaluation (``best_model.zip``)
    and at its last one (where they differ), then every rule in ``RULES`` and any other fixed action the run drew;
    each row ``method``, ``what``,
    ``speedup`` (goodput over target-only serving, x), ``return``, their intervals (None where a run did not keep
    them), ``episodes`` and, for the agent, its ``step``."""
    rows = []
    if floor is not None:
        rows.append({"method": "agent on the floor", "what": (
            "the per-batch-size table itself: no departure cleared its interval on validation" if floor["margin"] == "inf"
            else f"the DQN at step {floor['step']} where its Q-values beat the table's by more than {floor['margin']}"),
            "step": floor["step"], "speedup": floor["speedup"], "speedup_ci": floor["speedup_ci"],
            "return": floor["return"], "return_ci": floor["return_ci"], "episodes": floor["episodes"]})
    if history:
        best = max(history, key=lambda row: row["return"])
        for label, row in (("agent (best)", best), ("agent (last)", history[-1])):
            if label == "agent (last)" and row is best:
                continue
            rows.append({"method": label, "what": f"the DQN at step {row['step']}"
                         + (" (best_model.zip)" if row is best else " (model.zip)"), "step": row["step"],
                         "speedup": row["speedup"], "speedup_ci": row.get("speedup_ci"), "return": row["return"],
                         "return_ci": row.get("return_ci"), "episodes": row.get("episodes")})
    for name in list(RULES) + sorted(set(references) - set(RULES)):
        if name not in references:
            continue
        ref = references[name]
        ret, speed = reference_values(ref)
        named = ref if isinstance(ref, dict) else {}
        rows.append({"method": name, "what": RULES.get(name, f"fixed action (fallback, rollback) {name[6:]}"),
                     "speedup": speed, "speedup_ci": named.get("speedup_ci"), "return": ret,
                     "return_ci": named.get("return_ci"), "episodes": named.get("episodes")})
    return rows


def _with_ci(value: float, ci, fmt: str) -> str:
    if not ci:
        return format(value, fmt)
    return f"{format(value, fmt)} [{format(ci[0], fmt)}, {format(ci[1], fmt)}]"


def format_table(rows: list[dict]) -> str:
    """The rows as aligned text: method, goodput over target-only serving (x) and return, each with its interval."""
    head = ("method", "goodput vs target-only (x)", "return", "episodes")
    body = [(r["method"], _with_ci(r["speedup"], r["speedup_ci"], ".3f"), _with_ci(r["return"], r["return_ci"], "+.3f"),
             "" if r.get("episodes") is None else str(r["episodes"])) for r in rows]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in [head, *body])


def next_commands(run_dir: Path) -> list[str]:
    """The commands that look further at the run in ``run_dir``: the evaluation takes the world the run was trained in
    (pair, dtype, cost profile, batch, draft cap, tree rules) from its ``config.json``
    (``agents.serve.evaluation_agents.trained_world``), so ``--model`` is all it needs."""
    return [f"python evaluate.py --env serve --model {run_dir}   # the agent beside the rules on test episodes",
            f"tensorboard --logdir {run_dir.parent}   # the curves; the \"serving\" tab draws the agent beside the rules"]
