"""Run folders, for both trainers: where a run may start, where ``--resume RUN`` finds it, what an earlier attempt
wrote (set aside, never deleted), and the best model kept beside its copy under ``checkpoints/``.

``find_run`` reads ``--resume RUN`` (a folder, or a name under ``--log-dir``); ``check_log_dir`` and
``check_start`` fail early when a run cannot start. A run started again in place (no readable checkpoint)
moves what its earlier attempt wrote into ``<run>/set_aside/<n>/`` (``set_aside``). ``save_best_model`` writes
``checkpoints/best_model_<steps>_steps.zip``, then ``best_model.zip`` and ``best_model.json``; ``restore_best_model``
goes back to the best model of the steps a resume keeps.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.save_util import load_from_zip_file

from agents.common.files import stale_temporaries, write_atomic
from agents.common.lock import LOCK_FILE
from agents.config import ConfigError
from agents.spec import run_env_id

BEST_PREFIX = "best_model"
SET_ASIDE = "set_aside"  # where a run started again in place keeps what its earlier attempt wrote
RUN_FILES = ("config.json", "progress.csv", "evaluations.json", "evaluations.npz", "best_model.zip", "best_model.json",
             "model.zip", "summary.json", "cost_model.json", "replay_report.json")


def find_run(run: str, log_dir: Path) -> Path:
    """A run folder given as a path or as a run name under ``log_dir``."""
    candidates = (Path(run), log_dir / run)
    for candidate in candidates:
        if (candidate / "config.json").is_file():
            return candidate
    for candidate in candidates:
        if candidate.is_dir():
            raise ConfigError(f"--resume {run!r}: {candidate} holds no config.json: that run stopped before it started, "
                              f"so there is nothing to resume; start it again (python train.py ... --run-name "
                              f"{candidate.name} --log-dir {candidate.parent}: an empty folder is reused)")
    raise ConfigError(f"--resume {run!r}: no run folder with a config.json at {run} or {log_dir / run}")


def resume_hint(run_dir: Path) -> str:
    """The command that continues the run in ``run_dir`` (``train.py`` picks its trainer by the run's spec)."""
    return f"python train.py --resume {run_dir}"


def check_start(run_dir: Path, resume: bool, start, total: int, say: Callable[[str], None], env_id: str) -> None:
    """Where a run of ``env_id`` starts, one rule for every env (``agents.training``). ``start``: the newest
    checkpoint a resume can start from (its files read), None where there is none.

    A run that finished (``model.zip`` at ``total``) but none of whose checkpoints can be read is refused, untouched.
    A resume without a checkpoint starts again from step 0 with the run's saved options, and a new run in the folder
    of one stopped before its first checkpoint starts again in place (``say`` tells; the trainer then sets aside what
    the earlier attempt wrote, ``set_aside``, under the run's lock). A new run in the folder of a run with a
    checkpoint, in the folder of another env's run, or in a folder of other files, is refused. Raises
    ``ConfigError``."""
    done = zip_steps(run_dir / "model.zip") if start is None and (run_dir / "model.zip").is_file() else None
    if done is not None and done >= total:
        raise ConfigError(f"{run_dir} finished training (model.zip at step {done}) but none of its checkpoints can be "
                          "read, so it cannot go on; its models and logs are kept as they are: evaluate it with "
                          f"`python evaluate.py --model {run_dir}`, or train anew under another --run-name")
    if resume and start is None:
        say(f"{run_dir} has no complete checkpoint (stopped before its first one): starting it again from step 0 with "
            "its saved options")
    elif not resume and start is not None:
        raise ConfigError(f"{run_dir} is a run with a checkpoint at step {start.steps} already: continue it with "
                          f"`{resume_hint(run_dir)}`, or give another --run-name")
    elif not resume and (run_dir / "config.json").is_file():
        if (other := run_env_id(run_dir)) not in (None, env_id):  # None: unreadable, set aside with the rest
            raise ConfigError(f"{run_dir} holds a {other} run: give another --run-name (or continue that run with "
                              f"`{resume_hint(run_dir)}`)")
        say(f"{run_dir} holds a run stopped before its first complete checkpoint: starting it again in place")
    elif not resume and run_dir.is_dir():
        others = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE)
        if others:
            shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
            raise ConfigError(f"{run_dir} is no run folder of train.py (no config.json) but holds {shown}: delete it "
                              "or give another --run-name")
    elif not resume and run_dir.exists():
        raise ConfigError(f"{run_dir} is a file, not a run folder: give another --run-name")


def check_log_dir(log_dir: Path) -> None:
    """Fail now, not after loading the models, when runs cannot be written under ``log_dir``."""
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=log_dir):
            pass
    except OSError as err:
        raise ConfigError(f"cannot write to --log-dir {str(log_dir)!r}: {err.strerror or err}") from err




def earlier_attempt(run_dir: Path) -> list[Path]:
    """What a run's earlier attempt wrote that a new start in place would overwrite: its models, logs, evaluations,
    TensorBoard events and checkpoints (``config.json`` alone, and temporary files, are not worth keeping)."""
    found = [run_dir / n for n in RUN_FILES if n != "config.json"]
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


# -- the best model ----------------------------------------------------------------------------------
def best_snapshot(run_dir: Path, steps: int) -> Path:
    return run_dir / "checkpoints" / f"{BEST_PREFIX}_{steps}_steps.zip"


def save_best_model(model: BaseAlgorithm, run_dir: Path, mean_reward: float) -> None:
    """A new best model (evaluated at ``model.num_timesteps``): ``checkpoints/best_model_<steps>_steps.zip``, then
    ``best_model.zip`` and ``best_model.json`` (its step and mean return), each written whole."""
    steps = int(model.num_timesteps)
    snapshot = best_snapshot(run_dir, steps)
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(snapshot, model.save)
    _use_best(run_dir, snapshot, steps, mean_reward)


def _use_best(run_dir: Path, snapshot: Path, steps: int, mean_reward: float) -> None:
    write_atomic(run_dir / "best_model.zip", lambda f: f.write(snapshot.read_bytes()))
    meta = {"step": steps, "mean_reward": mean_reward, "copy": str(snapshot.relative_to(run_dir))}
    write_atomic(run_dir / "best_model.json", lambda f: f.write((json.dumps(meta) + "\n").encode()))


def best_model_info(run_dir: Path) -> dict | None:
    """``best_model.json`` (step, mean_reward) of a run folder, or None (none, or an older run without one)."""
    try:
        return json.loads((run_dir / "best_model.json").read_text())
    except (OSError, ValueError):
        return None



def restore_best_model(run_dir: Path, best: tuple[int, float] | None, say: Callable[[str], None]) -> None:
    path, info = run_dir / "best_model.zip", best_model_info(run_dir)
    if best is None:
        for p in (path, run_dir / "best_model.json"):
            if p.exists():
                p.unlink()
                say(f"removed {p.name}: no evaluation up to this step")
        return
    steps, mean_reward = best
    if info is not None and info.get("step") == steps and path.is_file():
        return
    snapshot = best_snapshot(run_dir, steps)
    if snapshot.is_file():
        _use_best(run_dir, snapshot, steps, mean_reward)
        say(f"best_model.zip is the model of step {steps} again (mean return {mean_reward:.4f})")
    elif path.is_file() and zip_steps(path) != steps:  # an older run, without copies of its best models
        aside = path.with_name(f"best_model.discarded-{zip_steps(path)}-steps.zip")
        os.replace(path, aside)
        say(f"best_model.zip was the model of step {zip_steps(aside)}, after this checkpoint: moved aside to "
            f"{aside.name}; the next evaluation above {mean_reward:.4f} saves a new one")



def zip_steps(path: Path) -> int | None:
    """The ``num_timesteps`` an SB3 model file was saved at, or None when it cannot be read."""
    try:
        data = load_from_zip_file(path, device="cpu", print_system_info=False)[0] or {}
    except Exception:  # noqa: BLE001 - not a readable SB3 zip
        return None
    return data.get("num_timesteps")
