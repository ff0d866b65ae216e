"""Serving run folders (``train.py --env serve``): checkpoints written as one unit, resumes past torn ones, logs
that continue.

A checkpoint at step ``s`` is three files under ``checkpoints/``, written in this order, each whole (a temporary
file renamed, ``agents.runs.write_atomic``):

1. ``dqn_replay_buffer_<s>_steps.pkl``: the replay buffer (compressed, filled rows only);
2. ``dqn_<s>_steps.zip``: the model;
3. ``serving_state_<s>_steps.json``: the evaluations so far, the best one, the next evaluation's step. Written
   last, it marks the checkpoint complete, and a resume reads it first.

Only after the state is written are older checkpoints pruned: the newest ``KEEP`` complete ones keep their buffer
and state (their model zips all stay: they are small). ``resume_point`` takes the newest complete checkpoint whose
three files load, and says which one it skipped and why; ``discard_after`` removes what a killed run wrote after it.

The logs continue across a resume: ``make_logger`` keeps the rows of ``progress.csv`` up to the checkpoint's step
(``ResumableCSV``: appended line by line, a new column rewrites the file whole) and hides the TensorBoard events a
killed run wrote after it (``purge_step``), so no step is logged twice and none before the checkpoint is lost.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stable_baselines3.common.logger import KVWriter, Logger, TensorBoardOutputFormat, filter_excluded_keys

from agents.runs import CHECKPOINT_PREFIX, read_replay_buffer, save_replay_buffer, write_atomic

KEEP = 2  # complete checkpoints kept whole (the newest and the one before, to fall back to)
STEP_KEY = "time/total_timesteps"  # the column of progress.csv that says a row's step (every row has it)
PROGRESS = "progress.csv"
RUN_FILES = ("config.json", PROGRESS, "evaluations.json", "best_model.zip", "best_model.json", "model.zip")
_STEPS = re.compile(r"_(\d+)_steps\.(?:zip|pkl|json)$")


@dataclass(frozen=True)
class ServingCheckpoint:
    """The three files of the checkpoint after ``steps`` env steps (which may or may not exist)."""

    steps: int
    model: Path
    replay_buffer: Path
    state: Path

    @property
    def files(self) -> tuple[Path, Path, Path]:
        return self.replay_buffer, self.model, self.state  # the order they are written in


def checkpoint_at(run_dir: Path, steps: int) -> ServingCheckpoint:
    folder = run_dir / "checkpoints"
    return ServingCheckpoint(steps, folder / f"{CHECKPOINT_PREFIX}_{steps}_steps.zip",
                             folder / f"{CHECKPOINT_PREFIX}_replay_buffer_{steps}_steps.pkl",
                             folder / f"serving_state_{steps}_steps.json")


def file_steps(path: Path) -> int | None:
    """The step a checkpoint file's name says (``..._<steps>_steps.zip|pkl|json``), or None."""
    match = _STEPS.search(path.name)
    return int(match.group(1)) if match else None


def complete_checkpoints(run_dir: Path) -> list[ServingCheckpoint]:
    """The checkpoints whose three files exist (unread), newest first."""
    found = [checkpoint_at(run_dir, s) for s in {file_steps(p) for p in (run_dir / "checkpoints").glob("serving_state_*")}
             if s is not None]
    return sorted((c for c in found if all(f.is_file() for f in c.files)), key=lambda c: c.steps, reverse=True)


# -- the state file ------------------------------------------------------------------------------------
def state_of(steps: int, history: list[dict], best: float, next_eval_at: int) -> dict:
    """What a checkpoint's state file holds; ``best`` -inf (no evaluation yet) is saved as null: standard JSON."""
    return {"steps": int(steps), "history": history, "best": best if math.isfinite(best) else None,
            "next_eval_at": int(next_eval_at)}


def read_state(path: Path, steps: int) -> dict:
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


# -- writing and pruning -------------------------------------------------------------------------------
def save_checkpoint(model, run_dir: Path, state: dict, keep: int = KEEP) -> ServingCheckpoint:
    """Write the checkpoint at ``model.num_timesteps`` (buffer, model, then the state that marks it complete), then
    prune all but the newest ``keep`` complete checkpoints."""
    cp = checkpoint_at(run_dir, int(model.num_timesteps))
    cp.model.parent.mkdir(parents=True, exist_ok=True)
    save_replay_buffer(model.replay_buffer, cp.replay_buffer)
    write_atomic(cp.model, model.save)
    text = json.dumps(state, allow_nan=False) + "\n"
    write_atomic(cp.state, lambda f: f.write(text.encode()))
    prune(run_dir, keep)
    return cp


def prune(run_dir: Path, keep: int = KEEP) -> list[Path]:
    """Delete the buffers and states of every checkpoint older than the newest ``keep`` complete ones (complete or
    not: a buffer whose checkpoint never completed is of no use once a newer one is). Model zips stay."""
    complete = complete_checkpoints(run_dir)
    if len(complete) <= keep:
        return []
    oldest_kept = complete[keep - 1].steps
    doomed = [p for p in (run_dir / "checkpoints").glob("*_steps.*")
              if (p.name.startswith("serving_state_") or "_replay_buffer_" in p.name)
              and (file_steps(p) or 0) < oldest_kept]
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed


# -- resuming ---------------------------------------------------------------------------------------------
def unreadable(cp: ServingCheckpoint) -> str | None:
    """Why ``cp`` cannot be resumed from (the file and the error, on one line), or None when its three files load."""
    from agents.dqn import AllActionsDQN

    loaders = ((cp.state, lambda p: read_state(p, cp.steps)),
               (cp.model, lambda p: AllActionsDQN.load(p, device="cpu")),  # as the resume loads it (a zip cut short
               (cp.replay_buffer, read_replay_buffer))                     # may open but hold no data)
    for path, load in loaders:
        try:
            load(path)
        except Exception as err:  # noqa: BLE001 - a torn or garbled file raises many types (JSON, zip, zlib, pickle)
            return f"{path.name}: {type(err).__name__}: {' '.join(str(err).split())[:200]}"
    return None


def resume_point(run_dir: Path, say: Callable[[str], None]) -> ServingCheckpoint | None:
    """The newest complete checkpoint whose files load; ``say`` names each newer one skipped, and why."""
    for cp in complete_checkpoints(run_dir):
        why = unreadable(cp)
        if why is None:
            return cp
        say(f"skipping the checkpoint at step {cp.steps}, which cannot be read ({why})")
    return None


def stale_temporaries(run_dir: Path) -> list[Path]:
    """Temporary files (``*.tmp-<pid>``) a killed process left in the run folder or its checkpoints."""
    return [p for folder in (run_dir, run_dir / "checkpoints") for p in folder.glob("*.tmp-*")]


def discard_after(run_dir: Path, steps: int, say: Callable[[str], None]) -> None:
    """Before resuming at ``steps``: remove the checkpoint files (and best-model snapshots) of later steps, the
    branch this resume throws away, and stale temporary files."""
    later = [p for p in (run_dir / "checkpoints").glob("*_steps.*") if (file_steps(p) or 0) > steps]
    for path in later + stale_temporaries(run_dir):
        path.unlink(missing_ok=True)
    if later:
        say(f"removed {len(later)} file(s) written after step {steps} (the branch this resume throws away)")


SET_ASIDE = "set_aside"  # where a run started again in place keeps what its earlier attempt wrote


def earlier_attempt(run_dir: Path) -> list[Path]:
    """What a run's earlier attempt wrote that a new start in place would overwrite: its models, logs, evaluations,
    TensorBoard events and checkpoints (``config.json`` alone, and temporary files, are not worth keeping)."""
    found = [run_dir / n for n in RUN_FILES + ("summary.json",) if n != "config.json"]
    found = [p for p in found + sorted(run_dir.glob("events.out.tfevents.*")) if p.is_file()]
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_symlink() or (checkpoints.is_dir() and any(checkpoints.iterdir())):
        found.append(checkpoints)
    return found


def set_aside(run_dir: Path) -> Path | None:
    """Move what an earlier attempt of the run wrote (``earlier_attempt``, with its ``config.json``) into
    ``<run_dir>/set_aside/<n>/``, so that the run can start again in place and nothing is lost; stale temporary
    files are removed. Nothing is ever deleted: a ``checkpoints`` symbolic link is moved as a link (its target kept
    whole). Returns the folder, or None when there was nothing worth keeping."""
    for path in stale_temporaries(run_dir):
        path.unlink(missing_ok=True)
    keep = earlier_attempt(run_dir)
    if not keep:
        return None
    n = 1 + max((int(p.name) for p in (run_dir / SET_ASIDE).glob("*") if p.name.isdigit()), default=0)
    folder = run_dir / SET_ASIDE / str(n)
    folder.mkdir(parents=True)
    if (run_dir / "config.json").is_file():
        shutil.copy2(run_dir / "config.json", folder / "config.json")  # the new start writes its own
    for path in keep:
        os.replace(path, folder / path.name)  # a rename: a link moves as a link, a folder whole
    return folder


def best_of(history: list[dict]) -> tuple[int, float] | None:
    """(step, return) of the best evaluation by the rule that saved it (the first to beat all before it)."""
    best = None
    for row in history:
        if best is None or row["return"] > best[1]:
            best = (int(row["step"]), float(row["return"]))
    return best


# -- logs that continue ----------------------------------------------------------------------------------
def progress_rows(path: Path, upto: int | None = None,
                  say: Callable[[str], None] | None = None) -> tuple[list[str], list[list[str]]]:
    """The header and rows of a ``progress.csv``; with ``upto``, the rows before the first one past step ``upto``
    (what follows belongs to a branch a resume throws away). A torn last line is left out, and so is a garbled row
    (bytes that are not text, a line the csv module cannot read, a step that is no number): that row only, never the
    rows after it; ``say`` tells how many were left out. A header that cannot be read: ``ValueError``."""
    if not path.is_file():
        return [], []
    text = path.read_bytes().decode("utf-8", errors="replace")  # junk bytes garble their row, not the file
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]  # the last line was cut by a kill
    lines = [line.rstrip("\r") for line in text.split("\n") if line.strip()]
    header = _csv_line(lines[0]) if lines else None
    if not lines:
        return [], []
    if not header or "\ufffd" in lines[0]:
        raise ValueError(f"{path}: its header line cannot be read")
    col = header.index(STEP_KEY) if STEP_KEY in header else None
    rows, garbled = [], 0
    for line in lines[1:]:
        row = _csv_line(line)
        step = _step(row[col]) if row is not None and col is not None and col < len(row) else None
        if row is None or "\ufffd" in line or (col is not None and step is None):
            garbled += 1
        elif upto is not None and col is not None and step > upto:
            break  # rows are in order: the rest is the branch the resume throws away
        else:
            rows.append(row)
    if garbled and say:
        say(f"{path}: left out {garbled} garbled row(s) (each alone; the rows around them are kept)")
    return header, rows


def _csv_line(line: str) -> list[str] | None:
    try:
        return next(csv.reader([line]))
    except (csv.Error, StopIteration):  # a NUL byte, an unclosed quote
        return None


def _step(cell: str) -> int | None:
    try:
        value = float(cell)
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and value >= 0 else None


class ResumableCSV(KVWriter):
    """SB3's ``progress.csv`` that a resume continues: started from the rows kept (``progress_rows``), each row
    appended and flushed; a row with new columns rewrites the file whole (renamed into place, so a kill leaves
    the old file or the new one, never half of each). SB3's own ``CSVOutputFormat`` truncates the file on open."""

    def __init__(self, path: Path, header: list[str] | None = None, rows: list[list[str]] | None = None) -> None:
        self.path, self.keys = Path(path), list(header or [])
        self._rewrite(rows or [])

    def _rewrite(self, rows: list[list[str]]) -> None:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        if self.keys:
            writer.writerow(self.keys)
        writer.writerows(r + [""] * (len(self.keys) - len(r)) for r in rows)
        text = buf.getvalue()
        write_atomic(self.path, lambda f: f.write(text.encode()))
        self.file = open(self.path, "a", newline="")  # noqa: SIM115 - held open for appends, closed by close()

    def write(self, key_values: dict[str, Any], key_excluded: dict[str, tuple[str, ...]], step: int = 0) -> None:
        key_values = filter_excluded_keys(key_values, key_excluded, "csv")
        extra = [k for k in key_values if k not in self.keys]
        if extra:
            self.file.close()
            _, rows = progress_rows(self.path)
            self.keys += sorted(extra)
            self._rewrite(rows)
        values = [key_values.get(k) for k in self.keys]
        csv.writer(self.file, lineterminator="\n").writerow("" if v is None else v for v in values)
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def make_logger(run_dir: Path, resumed_at: int | None, say: Callable[[str], None] | None = None) -> Logger:
    """TensorBoard events and ``progress.csv`` in the run folder; on resume at step ``resumed_at`` both continue from
    it: csv rows up to it kept, later events hidden (``purge_step``: every step >= resumed_at + 1)."""
    from torch.utils.tensorboard import SummaryWriter

    tensorboard = TensorBoardOutputFormat(str(run_dir))
    if resumed_at is not None:
        tensorboard.writer.close()
        tensorboard.writer = SummaryWriter(log_dir=str(run_dir), purge_step=resumed_at + 1)
    header, rows = [], []
    if resumed_at is not None:
        try:
            header, rows = progress_rows(run_dir / PROGRESS, resumed_at, say)
        except ValueError as err:  # kept beside, never overwritten; the TensorBoard events hold the same numbers
            aside = run_dir / f"progress.unreadable-{int(time.time())}.csv"
            os.replace(run_dir / PROGRESS, aside)
            (say or print)(f"{err}: moved to {aside.name}, and a new {PROGRESS} started")
    return Logger(folder=str(run_dir), output_formats=[tensorboard, ResumableCSV(run_dir / PROGRESS, header, rows)])
