"""The serving commands the README gives and the main job prints, run as a user runs them (subprocesses of train.py
and evaluate.py), on the default pair's shipped decoding datasets priced by a shipped profile: no model loads, no
network, seconds. Each shipped dtype is run, so that the dataset "auto" picks on any CPU is among them."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from bild_env.models.pairs import DEFAULT_PAIR
from bild_env.replay.dataset import SHIPPED

REPO = Path(__file__).resolve().parent.parent
PROFILE = "xeon-amx-smollm2-bf16"

# Runs one entry point with every way to a model shut: a load, a fetch or a conversion ends the command with this word.
NO_MODEL = r'''
import sys
import bild_env.models.pairs, bild_env.models.wheels, bild_env.models.smollm2

def refuse(*args, **kwargs):
    raise SystemExit(f"NO MODEL MAY LOAD: {args!r}")

bild_env.models.pairs.load_pair = bild_env.models.wheels.ensure_converted = refuse
bild_env.models.smollm2.ensure_target = refuse

from agents.commands import evaluate_main, train_main
from bild_env.command import run_command
prog, argv = sys.argv[1], sys.argv[2:]
sys.exit(run_command(prog, train_main if prog == "train.py" else evaluate_main, argv))
'''

# What the evaluation's defaults become in a test: one validation and one test episode at one load, short episodes.
SMALL_EVALUATION = ["--levels", "0.3", "--moving", "burst:0.05,1.0", "--select-episodes", "1", "--episodes", "1",
                    "--episode-steps", "16"]
DTYPES = sorted(p.name.removeprefix(f"{DEFAULT_PAIR}-") for p in SHIPPED.glob(f"{DEFAULT_PAIR}-*"))


def run(prog: str, argv: list[str], cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-c", NO_MODEL, prog, *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={"PYTHONPATH": str(REPO), **_env()})
    assert done.returncode == 0, f"{prog} {shlex.join(argv)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "NO MODEL MAY LOAD" not in done.stderr
    return done.stdout


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def evaluate_in(command: str, out: Path) -> list[str]:
    """A printed ``python evaluate.py ...`` command's arguments, with the small evaluation and ``out`` added."""
    words = shlex.split(command.split("#")[0])
    assert words[:2] == ["python", "evaluate.py"], command
    return words[2:] + SMALL_EVALUATION + ["--out", str(out)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_main_job_and_every_command_it_prints_run_on_the_shipped_dataset(dtype, tmp_path):
    """``python train.py --env serve`` (small) on the default pair's dataset of ``dtype``, then each command it prints
    under "next:", as printed: the evaluation of the run ends with its table, and the TensorBoard folder holds the
    run's curves."""
    out = run("train.py", ["--env", "serve", "--pair-options", f"dtype={dtype}", "--cost-profile", PROFILE,
                           "--total-timesteps", "128", "--eval-freq", "64", "--eval-episodes", "1",
                           "--episode-steps", "16", "--max-prompts", "4", "--hyperparams", "learning_starts=32",
                           "--log-dir", str(tmp_path / "logs"), "--run-name", "run", "--no-progress-bar"], cwd=tmp_path)
    assert "[1/4] fetch and convert: skipped" in out and "[2/4] time the tables: skipped" in out  # no model needed
    floor = json.loads((tmp_path / "logs" / "run" / "floor.json").read_text())  # the agent on the table's floor
    assert "agent on the floor" in out and floor["episodes"] == 4 and set(floor["validation_means"]) == {
        "0", "0.01", "0.05", "inf"}
    printed = out.split("\nnext:\n", 1)[1].strip().splitlines()
    evaluate = [line.strip() for line in printed if line.strip().startswith("python evaluate.py")]
    board = [line.strip() for line in printed if line.strip().startswith("tensorboard")]
    assert len(evaluate) == 1 and len(board) == 1, printed
    report = run("evaluate.py", evaluate_in(evaluate[0], tmp_path / "eval.json"), cwd=tmp_path)
    assert "agent" in report and "per-batch" in report
    written = json.loads((tmp_path / "eval.json").read_text())
    assert written["complete"] is True and PROFILE in json.dumps(written["cost_profile"])
    env = written["config"]["env"]
    assert (env["cost_profile"], env["pair_options"]["dtype"]) == (PROFILE, dtype)  # the run's, read
    logdir = Path(re.search(r"--logdir (\S+)", board[0]).group(1))
    assert list((tmp_path / logdir).rglob("events.out.tfevents.*"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_readme_evaluation_of_the_shipped_agent_runs_on_the_shipped_dataset(dtype, tmp_path):
    """The README's ``python evaluate.py --env serve --model pretrained`` on the dataset of ``dtype``: its table, no
    folder written before its work (it ran in an empty folder, and writes only ``--out``)."""
    out = tmp_path / "pretrained.json"
    report = run("evaluate.py", ["--env", "serve", "--model", "pretrained", "--cost-profile", PROFILE,
                                 "--pair-options", f"dtype={dtype}",
                                 *SMALL_EVALUATION, "--out", str(out)], cwd=tmp_path)
    assert "agent" in report and json.loads(out.read_text())["complete"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pretrained.json", "pretrained.png"]
