"""Checks both evaluations share (``evaluate.py``: BiLD-v1's ``agents.bild.comparison``, BiLD-Serve-v0's
``agents.serve.evaluation`` and ``agents.serve.load_clock``): which env a model's run trained on, a model file
read without building it, where results may be written, and results as standard JSON with nothing non-finite."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from agents.config import ConfigError
from agents.spec import RunSpec, spec_file
from bild_env.command import writable_file

def trained_on(model_path: str | Path) -> tuple[Path | None, str | None]:
    """The spec of the run a model file (or run folder) belongs to (``agents.spec.spec_file``) and the env its run
    trained on; (None, None) without a spec, (path, None) for one that cannot be read (its reader says why)."""
    path = spec_file(model_path)
    if path is None:
        return None, None
    try:
        return path, RunSpec.load(path).env_id
    except ValueError:
        return path, None


def read_model_zip(path: Path) -> dict:
    """The attributes an SB3 model file saved (its spaces among them), read without building the model; a
    ``ConfigError`` naming the file and what to do when it is truncated, garbled or no SB3 model."""
    from stable_baselines3.common.save_util import load_from_zip_file

    try:
        data = load_from_zip_file(path, device="cpu", print_system_info=False)[0]
    except Exception as err:  # noqa: BLE001 - a damaged zip raises many types (BadZipFile, EOFError, KeyError, ...)
        why = f"{type(err).__name__}: {' '.join(str(err).split())}"
        data = None
    else:
        why = "no SB3 attributes in it"
    if isinstance(data, dict) and "observation_space" in data and "action_space" in data:
        return data
    final = path.parent / "model.zip"
    if path.name != "model.zip" and final.is_file():
        hint = f"give the run's final model instead (--model {final}), or train again"
    elif (path.parent / "checkpoints").is_dir():
        hint = (f"give one of its checkpoints (--model {path.parent / 'checkpoints'}/<name>_<steps>_steps.zip), or "
                "train again")
    else:
        hint = "copy it again whole, or train again"
    raise ConfigError(f"cannot read the model {path} ({why}): it is truncated or garbled, or no SB3 model file; {hint}")


def blocking_file(folder: Path) -> Path | None:
    """The file that stands where ``folder`` or one of its parents should be a folder (None when none does)."""
    for path in (folder, *folder.parents):
        if path.exists():
            return None if path.is_dir() else path
    return None


def nonfinite(value: Any, where: str = "") -> list[str]:
    """Where ``value`` (nested dicts, lists, numbers, numpy arrays) holds a NaN or an infinity: ``"path = nan"``."""
    if isinstance(value, dict):
        return [w for k, v in value.items() for w in nonfinite(v, f"{where}.{k}" if where else str(k))]
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [w for i, v in enumerate(value) for w in nonfinite(v, f"{where}[{i}]")]
    if isinstance(value, (float, np.floating)) and not math.isfinite(value):
        return [f"{where} = {value}"]
    return []


def report_json(report: dict, indent: int = 2) -> str:
    """``report`` as standard JSON (numpy scalars as numbers; no NaN or Infinity, which strict readers refuse); a
    ``ValueError`` naming the non-finite values (what an evaluation with nothing to measure gives)."""
    bad = nonfinite(report)
    if bad:
        shown = "; ".join(bad[:4]) + (f"; ... ({len(bad)} in all)" if len(bad) > 4 else "")
        raise ValueError(f"the results hold values that are not finite numbers ({shown}): nothing was measured there, "
                         "so no table or file of them is written")
    return json.dumps(report, indent=indent, allow_nan=False,
                      default=lambda o: o.item() if hasattr(o, "item") else str(o)) + "\n"


def check_outputs(paths: list[Path], force: bool) -> None:
    """``--out`` (``paths[0]``, the others written beside it) names a file whose folder can be written into, with room
    (``check_room``: a ``Failure`` where the disk is full), and none of ``paths`` holds an earlier evaluation's results
    unless ``force``."""
    out = paths[0]
    if out.is_dir():
        raise ValueError(f"--out {out} is a folder; give a file name, e.g. --out {out / 'results.json'} (the other "
                         "files go beside it)")
    # a folder that can be made, with room (a block really written: a full disk is refused now, not at the end), and
    # claimed: its folder made for the lock, and removed again where nothing gets written there
    writable_file(out, "--out")
    earlier = [str(p) for p in paths if p.exists()]
    if earlier and not force:
        raise ValueError(f"--out {out}: {' and '.join(earlier)} hold an earlier evaluation's results; give another "
                         "--out, or --force to replace them")
