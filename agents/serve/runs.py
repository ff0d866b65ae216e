"""The serving env's run folders (``train.py --env serve``): what its checkpoints hold besides the model and the
replay buffer, and how they are named.

A checkpoint is ``agents.common.checkpoints``'s (``dqn_replay_buffer_<s>_steps.pkl``, ``dqn_<s>_steps.zip``, then
``serving_state_<s>_steps.json``, which marks it complete): its state holds the evaluations so far, the best one
and the next evaluation's step (``state_of``, ``read_serving_state``). The newest ``KEEP`` complete checkpoints keep
their buffer and state.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from agents.common import checkpoints as cps
from agents.common.checkpoints import Checkpoint, Layout

KEEP = 2  # complete checkpoints kept whole (the newest and the one before, to fall back to)
LAYOUT = Layout(prefix="dqn", state="serving", buffer=True)


def complete_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """The checkpoints whose three files exist (unread), newest first."""
    return cps.complete_checkpoints(run_dir, LAYOUT)


def state_of(steps: int, history: list[dict], best: float, next_eval_at: int) -> dict:
    """What a checkpoint's state file holds; ``best`` -inf (no evaluation yet) is saved as null: standard JSON."""
    return {"steps": int(steps), "history": history, "best": best if math.isfinite(best) else None,
            "next_eval_at": int(next_eval_at)}


def read_serving_state(path: Path, steps: int) -> dict:
    """A checkpoint's state, checked (``ValueError`` naming what is wrong); ``best`` back to -inf where null."""
    state = json.loads(Path(path).read_text())
    if not isinstance(state, dict) or not {"history", "best", "next_eval_at"} <= state.keys():
        raise ValueError("not a serving state (history, best, next_eval_at)")
    if state.get("steps", steps) != steps or not isinstance(state["history"], list):
        raise ValueError(f"holds step {state.get('steps')} and {type(state['history']).__name__} history, "
                         f"not step {steps}'s")
    best = state["best"]
    state["best"] = -math.inf if best is None else float(best)  # runs saved before null wrote -Infinity
    return state


def resume_point(run_dir: Path, say: Callable[[str], None]) -> Checkpoint | None:
    """The newest complete checkpoint whose files load; ``say`` names each newer one skipped, and why."""
    from agents.dqn import AllActionsDQN

    return cps.resume_point(run_dir, LAYOUT, lambda p: AllActionsDQN.load(p, device="cpu"), read_serving_state, say)


def best_of(history: list[dict]) -> tuple[int, float] | None:
    """(step, return) of the best evaluation by the rule that saved it (the first to beat all before it: ``max``'s)."""
    best = max(history, key=lambda row: row["return"], default=None)
    return None if best is None else (int(best["step"]), float(best["return"]))
