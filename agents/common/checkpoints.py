"""Checkpoints written as one unit, for both trainers (``train.py`` and ``train.py --env serve``), and the resume
point past torn ones.

A checkpoint at step ``s`` is up to three files under ``checkpoints/``, written in this order, each whole (a
temporary file renamed, ``agents.common.files.write_atomic``):

1. ``<prefix>_replay_buffer_<s>_steps.pkl``: the replay buffer of an off-policy algorithm (compressed, filled rows
   only: ``agents.common.replay_buffer``);
2. ``<prefix>_<s>_steps.zip``: the model;
3. ``<state>_state_<s>_steps.json``: what the trainer needs to go on as the uninterrupted run would (BiLD-v1: the
   generators, the episodes in progress and the evaluations, ``agents.bild.resume``; the serving env: the
   evaluations so far, the best one and the next evaluation's step). Written last, it marks the checkpoint complete.

How a run names them is its ``Layout``. Only after the state is written are older checkpoints pruned: the newest
``keep`` complete ones keep their buffer and state (model zips all stay: they are small). ``resume_point`` takes the
newest complete checkpoint whose files load, and says which one it skipped and why; ``discard_after`` removes what a
killed run wrote after it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from agents.common.files import stale_temporaries, write_atomic
from agents.common.replay_buffer import read_replay_buffer, save_replay_buffer

# <prefix>_<steps>_steps.zip (model), <prefix>_replay_buffer_<steps>_steps.pkl, <prefix>_state_<steps>_steps.json;
# best_model_<steps>_steps.zip: the best models (prefix best_model)
_CHECKPOINT_NAME = re.compile(r"(?P<prefix>.+?)_(?:replay_buffer_(?P<buffer>\d+)_steps\.pkl|state_(?P<state>\d+)_steps\.json"
                              r"|(?P<model>\d+)_steps\.zip)")


@dataclass(frozen=True)
class Layout:
    """How a run names its checkpoint files: ``<prefix>_<s>_steps.zip``, ``<prefix>_replay_buffer_<s>_steps.pkl``
    (with ``buffer``) and ``<state>_state_<s>_steps.json``. ``stateless`` (runs of an older BiLD-v1 version, which
    wrote no state): a checkpoint is complete with its model and buffer alone."""

    prefix: str = "dqn"
    state: str = "dqn"
    buffer: bool = True
    stateless: bool = False


@dataclass(frozen=True)
class Checkpoint:
    """The files of the checkpoint after ``steps`` env steps (which may or may not exist): the model, its replay
    buffer (None for an on-policy algorithm) and its state (None in checkpoints of a stateless ``Layout``)."""

    model: Path
    replay_buffer: Path | None
    steps: int
    state: Path | None = None

    @property
    def files(self) -> tuple[Path, ...]:
        """The order they are written in; the last marks the checkpoint complete."""
        return tuple(p for p in (self.replay_buffer, self.model, self.state) if p is not None)


@dataclass(frozen=True)
class CheckpointName:
    """What a checkpoint file's name says: its prefix, its step count, and its kind ("model", "replay_buffer", "state")."""

    prefix: str
    steps: int
    kind: str = "model"

    @property
    def replay_buffer(self) -> bool:
        return self.kind == "replay_buffer"


def parse_checkpoint_name(name: str) -> CheckpointName | None:
    """``<prefix>_<steps>_steps.zip``, ``<prefix>_replay_buffer_<steps>_steps.pkl`` or ``<prefix>_state_<steps>_steps.json``;
    None for other names."""
    match = _CHECKPOINT_NAME.fullmatch(name)
    if match is None:
        return None
    kind = next(k for k in ("buffer", "state", "model") if match.group(k) is not None)
    return CheckpointName(match.group("prefix"), int(match.group(kind)), "replay_buffer" if kind == "buffer" else kind)


def checkpoint_files(folder: str | Path) -> Iterator[tuple[Path, CheckpointName]]:
    """Every file in ``folder`` named as a checkpoint, with what its name says."""
    for path in Path(folder).glob("*_steps.*"):
        name = parse_checkpoint_name(path.name)
        if name is not None:
            yield path, name


def checkpoint_at(run_dir: Path, steps: int, layout: Layout) -> Checkpoint:
    folder = run_dir / "checkpoints"
    buffer = folder / f"{layout.prefix}_replay_buffer_{steps}_steps.pkl" if layout.buffer else None
    state = None if layout.stateless else folder / f"{layout.state}_state_{steps}_steps.json"
    return Checkpoint(folder / f"{layout.prefix}_{steps}_steps.zip", buffer, steps, state)


def complete_checkpoints(run_dir: Path, layout: Layout) -> list[Checkpoint]:
    """The checkpoints whose files all exist (unread), newest first."""
    steps = {name.steps for _, name in checkpoint_files(run_dir / "checkpoints")
             if (name.prefix, name.kind) in ((layout.prefix, "model"), (layout.state, "state"))}
    found = [checkpoint_at(run_dir, s, layout) for s in steps]
    return sorted((c for c in found if all(f.is_file() for f in c.files)), key=lambda c: c.steps, reverse=True)


def save_checkpoint(model, run_dir: Path, layout: Layout, state: dict[str, Any], keep: int) -> Checkpoint:
    """Write the checkpoint at ``model.num_timesteps`` (buffer, model, then the state that marks it complete), then
    prune all but the newest ``keep`` complete checkpoints (0: keep all)."""
    cp = checkpoint_at(run_dir, int(model.num_timesteps), replace(layout, stateless=False))
    cp.model.parent.mkdir(parents=True, exist_ok=True)
    if cp.replay_buffer is not None:
        save_replay_buffer(model.replay_buffer, cp.replay_buffer)
    write_atomic(cp.model, model.save)
    text = json.dumps(state) + "\n"
    write_atomic(cp.state, lambda f: f.write(text.encode()))
    prune(run_dir, layout, keep)
    return cp


def prune(run_dir: Path, layout: Layout, keep: int) -> list[Path]:
    """Delete the buffers and states of every checkpoint older than the newest ``keep`` complete ones (complete or
    not: a buffer whose checkpoint never completed is of no use once a newer one is). Model zips stay. 0: none."""
    complete = complete_checkpoints(run_dir, layout)
    if keep < 1 or len(complete) <= keep:
        return []
    oldest_kept = complete[keep - 1].steps
    doomed = [p for p, name in checkpoint_files(run_dir / "checkpoints") if name.steps < oldest_kept
              and ((name.prefix, name.kind) == (layout.state, "state")
                   or (name.prefix, name.kind) == (layout.prefix, "replay_buffer"))]
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed


def unreadable(cp: Checkpoint, load_model: Callable[[Path], object],
               read_state: Callable[[Path, int], object]) -> str | None:
    """Why ``cp`` cannot be resumed from (the file and the error, on one line), or None when its files load.
    ``load_model`` loads as the resume will (a zip cut short may open but hold no data)."""
    loaders = [(cp.state, lambda p: read_state(p, cp.steps)), (cp.model, load_model),
               (cp.replay_buffer, read_replay_buffer)]
    for path, load in loaders:
        if path is None:
            continue
        try:
            load(path)
        except Exception as err:  # noqa: BLE001 - a torn or garbled file raises many types (JSON, zip, zlib, pickle)
            return f"{path}: {type(err).__name__}: {' '.join(str(err).split())[:200]}"
    return None


def resume_point(run_dir: Path, layout: Layout, load_model: Callable[[Path], object],
                 read_state: Callable[[Path, int], object], say: Callable[[str], None]) -> Checkpoint | None:
    """The newest complete checkpoint whose files load; ``say`` names each newer one skipped, and why."""
    for cp in complete_checkpoints(run_dir, layout):
        why = unreadable(cp, load_model, read_state)
        if why is None:
            return cp
        say(f"skipping the checkpoint at step {cp.steps}, which cannot be read ({why})")
    return None


def discard_after(run_dir: Path, steps: int, say: Callable[[str], None]) -> list[Path]:
    """Before resuming at ``steps``: remove the checkpoint files (and best-model snapshots) of later steps, the
    branch this resume throws away, and stale temporary files."""
    later = [path for path, name in checkpoint_files(run_dir / "checkpoints") if name.steps > steps]
    for path in later + stale_temporaries(run_dir):
        path.unlink(missing_ok=True)
    if later:
        say(f"removed {len(later)} file(s) written after step {steps} (the branch this resume throws away): "
            + ", ".join(sorted(p.name for p in later)[:6]) + (", ..." if len(later) > 6 else ""))
    return later
