"""Probe every command with bad input, as a new user would, and classify what each does (tiny-random pair).

    python scripts/analysis/probe_inputs.py                                   # every case, a few minutes on 2 cores
    python scripts/analysis/probe_inputs.py --only distill --out /tmp/p.json  # the cases whose command has this word

Each case runs one command line in a fresh process (a private ``BILD_ENV_CACHE`` shared by the cases, the working
folder the repository, every file it writes in a temporary folder) and is classified:

* ``clear error``: exit status 1 or 2, no stack trace, and the last line of stderr names the problem;
* ``fine``: exit status 0 where the input is good (a case marked ``ok``);
* ``clean stop``: a case that sends Ctrl-C or SIGTERM once the command has started its work (``signal``, ``after``):
  exit status 130, no stack trace, a last line that says what to do;
* ``traceback``: a stack trace (no ``--debug`` is given), or a crash by a signal (a stopped command that ends in
  another status than 130 too);
* ``silently wrong``: exit status 0 where the input is bad, or a file left that misleads (a lock of an ``--out``, a
  half-written temporary file: a case's ``absent``);
* ``stuck``: still running after ``--timeout`` seconds (killed);
* ``lost``: a file a case's ``keep`` names is gone: neither in place nor moved aside whole (a run folder's model,
  logs, evaluations);
* ``skipped``: a fault of the machine that cannot be made here (``disk`` needs a private mount namespace:
  ``unshare --mount``, as root or with unprivileged user namespaces).

Faults of the machine are real: a case with a ``disk`` runs its command in a mount namespace of its own on a fresh
tmpfs at ``{disk}``, filled to the last block (``full``), to 400 KB free (``small``) or mounted read-only (``ro``);
``move`` carries a run folder onto it first and back after, so that ``keep`` checks what the command left there.

Prints a table and writes it as JSON with ``--out``; exits 1 when any case is a traceback, silently wrong, stuck or
lost.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
BAD_OUTCOMES = ("traceback", "silently wrong", "lost", "stuck")
GOOD_OUTCOMES = ("clear error", "fine", "clean stop", "skipped")


@dataclass
class Case:
    name: str
    argv: list[str]  # after the python executable; "{tmp}" becomes the case's temporary folder
    ok: bool = False  # the input is good: exit 0 is right
    setup: str = ""  # a function of SETUPS that prepares {tmp} before the run
    keep: list[str] = field(default_factory=list)  # files under {tmp} whose bytes must still be there after the run
    # (in place, or moved aside whole, e.g. into the run's set_aside/<n>/)
    env: dict[str, str] = field(default_factory=dict)  # environment variables of the command ("{tmp}", "{disk}" filled)
    disk: str = ""  # "full", "small" or "ro": a tmpfs of this command's own at {disk} (module docstring)
    move: str = ""  # a folder under {tmp} moved onto that disk before it is filled, and back after the command
    signal: str = ""  # "SIGINT" (Ctrl-C) or "SIGTERM", sent once ``after`` shows in the command's output
    after: str = ""
    absent: list[str] = field(default_factory=list)  # globs under {tmp} that must match nothing after the command


TINY = ["--pair", "tiny-random"]
SMALL_RUN = ["--pair", "tiny-random", "--n-envs", "2", "--eval-freq", "60", "--eval-episodes", "1",
             "--max-new-tokens", "8", "--max-batch", "4", "--episode-steps", "12", "--hyperparams", "learning_starts=40",
             "batch_size=16", "--mix", "prose:1", "--no-progress-bar", "--checkpoint-freq", "60"]
SERVE_RUN = ["train.py", "--env", "serve", "--resume", "{tmp}/r", "--no-progress-bar"]
REAL_PAIR_ENV = """
import sys, gymnasium
from bild_env.command import UsageError
try:
    env = gymnasium.make("bild_env:BiLD-Serve-v0", pair="qwen2.5-coder", split="test", cost_profile="h200-opt-eager", {})
    env.reset(seed=0); env.action_space.seed(0); done = False
    while not done:
        _, _, terminated, truncated, _ = env.step(env.action_space.sample()); done = terminated or truncated
except UsageError as err:
    sys.exit(f"error: {{err}}")
"""
RUN_FILES = ["r/model.zip", "r/best_model.zip", "r/progress.csv", "r/evaluations.json", "r/config.json"]
RESUME_FILES = ["r/checkpoints/dqn_120_steps.zip", "r/checkpoints/dqn_replay_buffer_120_steps.pkl",
                "r/checkpoints/serving_state_120_steps.json"]  # what --resume goes on from
SERVE_EVAL = [*TINY, "--levels", "0.5", "1.0", "2.0", "--select-episodes", "1", "--episodes", "2", "--episode-steps",
              "16", "--max-new-tokens", "8", "--max-batch", "4", "--max-prompts", "6", "--out", "{tmp}/ev.json"]
BILD_EVAL = ["--model", "{tmp}/bild", "--num-prompts", "4", "--grid-prompts", "2", "--threshold-runs", "0",
             "--no-bandits", "--out", "{tmp}/ev"]
CASES = [
    # train.py, BiLD-v1 and BiLD-Serve-v0
    Case("train: unknown --env", ["train.py", "--env", "nope"]),
    Case("train: unknown pair", ["train.py", "--pair", "nosuch", "--log-dir", "{tmp}"]),
    Case("train: unknown device", ["train.py", *TINY, "--pair-options", "device=tpu", "--log-dir", "{tmp}"]),
    Case("train: --total-timesteps 0", ["train.py", *TINY, "--total-timesteps", "0", "--log-dir", "{tmp}"]),
    Case("train serve: --max-batch 0", ["train.py", "--env", "serve", *TINY, "--max-batch", "0", "--log-dir", "{tmp}"]),
    Case("train serve: unknown dtype", ["train.py", "--env", "serve", *TINY, "--pair-options", "dtype=float9", "--log-dir", "{tmp}"]),
    Case("train serve: --resume of no run", SERVE_RUN),
    Case("train serve: --resume, finished run, no checkpoint", SERVE_RUN, setup="finished_run", keep=RUN_FILES),
    Case("train serve: restart, finished run, no checkpoint", ["train.py", "--env", "serve", *SMALL_RUN,
                                                               "--total-timesteps", "120", "--run-name", "r",
                                                               "--log-dir", "{tmp}"], setup="finished_run",
         keep=RUN_FILES),
    Case("train serve: --resume, stopped run, no checkpoint", SERVE_RUN, ok=True, setup="stopped_run",
         keep=RUN_FILES[:4]),
    Case("train serve: --resume, config.json junk", SERVE_RUN, setup="junk_config", keep=RUN_FILES[:4]),
    Case("train serve: --resume, config.json max_batch 0", SERVE_RUN, setup="max_batch_0", keep=RUN_FILES),
    Case("train: --learning-rate nan", ["train.py", *TINY, "--hyperparams", "learning_rate=nan", "--log-dir", "{tmp}"]),
    Case("train: --gamma 2", ["train.py", *TINY, "--hyperparams", "gamma=2", "--log-dir", "{tmp}"]),
    Case("train: --n-envs 0", ["train.py", *TINY, "--n-envs", "0", "--log-dir", "{tmp}"]),
    Case("train: --log-dir under a file", ["train.py", *TINY, "--log-dir", "/etc/passwd/logs"]),
    Case("train serve: --learning-rate inf", ["train.py", "--env", "serve", *TINY, "--hyperparams", "learning_rate=inf",
                                              "--log-dir", "{tmp}"]),
    Case("train serve: --total-timesteps -5", ["train.py", "--env", "serve", *TINY, "--total-timesteps", "-5",
                                               "--log-dir", "{tmp}"]),
    Case("train serve: unknown device", ["train.py", "--env", "serve", *TINY, "--pair-options", "device=tpu",
                                             "--log-dir", "{tmp}"]),
    # evaluate.py
    Case("evaluate: --num-prompts 0", ["evaluate.py", *TINY, "--num-prompts", "0"]),
    Case("evaluate: unknown pair", ["evaluate.py", "--pair", "nosuch"]),
    Case("evaluate: a model file that is no model", ["evaluate.py", *TINY, "--model", "/etc/hostname"]),
    Case("evaluate: --out under a file", ["evaluate.py", *TINY, "--out", "/etc/passwd/x"]),
    Case("evaluate serve: --max-batch 33", ["evaluate.py", "--env", "serve", *TINY, "--max-batch", "33"]),
    Case("evaluate serve clock: --max-batch 33", ["evaluate.py", "--env", "serve", *TINY, "--load", "0.05",
                                                  "--max-batch", "33"]),
    Case("evaluate serve clock: --load nan", ["evaluate.py", "--env", "serve", *TINY, "--load", "nan"]),
    # the replay trees' fill
    Case("fill: --actions 99", ["-m", "bild_env.fill", *TINY, "--actions", "99"]),
    Case("fill: --split dev", ["-m", "bild_env.fill", *TINY, "--split", "dev"]),
    Case("fill: --out a folder", ["-m", "bild_env.fill", *TINY, "--out", "{tmp}"]),
    Case("fill: --out unwritable", ["-m", "bild_env.fill", *TINY, "--out", "/proc/fill.json"]),
    Case("fill: --prompts 0", ["-m", "bild_env.fill", *TINY, "--prompts", "0"]),
    Case("fill: unknown pair", ["-m", "bild_env.fill", "--pair", "nosuch"]),
    Case("fill: unknown dtype", ["-m", "bild_env.fill", *TINY, "--dtype", "float9"]),
    Case("fill: unknown device", ["-m", "bild_env.fill", *TINY, "--device", "tpu"]),
    Case("fill: one prompt", ["-m", "bild_env.fill", *TINY, "--prompts", "1", "--actions", "4", "--out", "{tmp}/f.json"],
         ok=True),
    Case("fill: --max-new-tokens 0", ["-m", "bild_env.fill", *TINY, "--max-new-tokens", "0"]),
    Case("fill: --torch-threads -1", ["-m", "bild_env.fill", *TINY, "--torch-threads", "-1"]),
    # benchmarks
    Case("scripts.analysis.batched: --rollback -1", ["-m", "scripts.analysis.batched", *TINY, "--rollback", "-1"]),
    Case("scripts.analysis.batched: --threads 0", ["-m", "scripts.analysis.batched", *TINY, "--threads", "0"]),
    Case("scripts.analysis.clock: unknown pair", ["-m", "scripts.analysis.clock", "--pair", "nosuch"]),
    Case("bench.headroom: --prompts 0", ["-m", "bench.headroom", *TINY, "--prompts", "0"]),
    Case("evaluate.py --env serve: --episodes 0", ["evaluate.py", "--env", "serve", "--full", *TINY, "--episodes", "0"]),
    Case("scripts.analysis.batched: --batch 0", ["-m", "scripts.analysis.batched", *TINY, "--batch", "0"]),
    Case("scripts.analysis.batched: --fallback 2", ["-m", "scripts.analysis.batched", *TINY, "--fallback", "2"]),
    Case("scripts.analysis.batched: --out unwritable", ["-m", "scripts.analysis.batched", *TINY, "--out", "/proc/b.json"]),
    Case("bench.headroom: --out a folder", ["-m", "bench.headroom", *TINY, "--out", "{tmp}"]),
    Case("scripts.analysis.serving_clock: --out a folder", ["-m", "scripts.analysis.serving_clock", *TINY, "--out", "{tmp}"]),
    Case("scripts.analysis.clock: --out a folder", ["-m", "scripts.analysis.clock", *TINY, "--out", "{tmp}"]),
    Case("scripts.analysis.stop_rules: --out a folder", ["-m", "scripts.analysis.stop_rules", *TINY, "--out", "{tmp}"]),
    Case("bench.forwards: --fed 0", ["-m", "bench.forwards", *TINY, "--fed", "0"]),
    Case("bench.decoders: unknown device", ["-m", "bench.decoders", *TINY, "--pair-options", "device=tpu"]),
    Case("evaluate.py --env serve: --max-batch 33", ["evaluate.py", "--env", "serve", "--full", *TINY, "--max-batch", "33"]),
    # the draft's distillation
    Case("distill: --seq-len 0", ["-m", "distill", "teacher", "--seq-len", "0"]),
    Case("distill: --teacher-dtype float8", ["-m", "distill", "teacher", "--teacher-dtype", "float8"]),
    Case("distill: --top-k 0", ["-m", "distill", "teacher", "--top-k", "0"]),
    Case("distill: --average ''", ["-m", "distill", "average", "--average", ""]),
    Case("distill: export, no checkpoint", ["-m", "distill", "export", "--work", "{tmp}"]),
    Case("distill: --target missing", ["-m", "distill", "train", "--target", "/no/such/folder"]),
    Case("distill: --target an OPT model", ["-m", "distill", "train", "--target", "{tmp}/opt"], setup="opt_target"),
    Case("distill: unknown device", ["-m", "distill", "train", "--device", "tpu"]),
    Case("distill: --lr nan", ["-m", "distill", "train", "--lr", "nan"]),
    Case("distill: --beta2 1", ["-m", "distill", "train", "--beta2", "1"]),
    Case("distill: --batch-size 0", ["-m", "distill", "train", "--batch-size", "0"]),
    Case("distill: export --from-ckpt foo", ["-m", "distill", "export", "--from-ckpt", "foo", "--work", "{tmp}"]),
    Case("distill: unknown command", ["-m", "distill", "nosuch"]),
    Case("distill lookup: --out a folder", ["-m", "distill", "lookup", "--out", "{tmp}"]),
    # Ray's commands (the cluster extra)
    Case("agents.tune: --seeds 0 seeds", ["-m", "agents.tune", "--seeds"]),
    Case("agents.rllib_serve: unknown pair", ["-m", "agents.rllib_serve", "--pair", "nosuch"]),
    # faults of the machine: a full disk, one nearly full, a read-only one, a cache folder that cannot be made
    Case("machine: evaluate serve, --out on a full disk", ["evaluate.py", "--env", "serve", *TINY, "--out",
                                                           "{disk}/ev.json"], disk="full"),
    Case("machine: evaluate, --out on a full disk", ["evaluate.py", *TINY, "--out", "{disk}/ev"], disk="full"),
    Case("machine: profile, --out on a full disk", ["-m", "bild_env.profile", *TINY, "--batch-sizes", "1",
                                                    "--out", "{disk}/p.json"], disk="full"),
    Case("machine: fill, --out on a full disk", ["-m", "bild_env.fill", *TINY, "--out", "{disk}/f.json"],
         disk="full"),
    Case("machine: evaluate.py --env serve, --out with 400 KB free", ["evaluate.py", "--env", "serve", "--full", *TINY, "--out", "{disk}/b.json"],
         disk="small"),
    Case("machine: evaluate serve, --out on a read-only disk", ["evaluate.py", "--env", "serve", *TINY, "--out",
                                                                "{disk}/ev.json"], disk="ro"),
    Case("machine: evaluate serve, BILD_ENV_CACHE on a read-only disk", ["evaluate.py", "--env", "serve", *TINY,
                                                                         "--out", "{tmp}/ev.json"],
         env={"BILD_ENV_CACHE": "{disk}"}, disk="ro"),
    Case("machine: train serve, BILD_ENV_CACHE on a full disk", ["train.py", "--env", "serve", *SMALL_RUN,
                                                                 "--log-dir", "{tmp}"],
         env={"BILD_ENV_CACHE": "{disk}/cache"}, disk="full"),
    Case("machine: fill, BILD_ENV_CACHE under a file", ["-m", "bild_env.fill", *TINY, "--prompts", "1"],
         env={"BILD_ENV_CACHE": "/etc/passwd/cache"}),
    Case("machine: train serve, --log-dir on a full disk", ["train.py", "--env", "serve", *SMALL_RUN,
                                                            "--log-dir", "{disk}/logs"], disk="full"),
    Case("machine: train serve, --resume on a full disk", ["train.py", "--env", "serve", "--resume", "{disk}/r",
                                                           "--no-progress-bar"], setup="resumable_run", disk="full",
         move="r", keep=RUN_FILES + RESUME_FILES, absent=["r/*.tmp-*", "r/train.lock"]),
    Case("machine: train serve, --resume with 400 KB free", ["train.py", "--env", "serve", "--resume", "{disk}/r",
                                                             "--no-progress-bar"], setup="resumable_run",
         disk="small", move="r", keep=["r/model.zip", "r/best_model.zip", "r/config.json", *RESUME_FILES],
         absent=["r/*.tmp-*", "r/checkpoints/*.tmp-*", "r/train.lock"]),  # progress.csv grows: rows of new steps
    # interrupts: Ctrl-C or SIGTERM once the work has started
    Case("stop: evaluate serve, SIGINT after the first load", ["evaluate.py", "--env", "serve", *SERVE_EVAL],
         signal="SIGINT", after="(written to", absent=[".ev.json.lock", "*.tmp-*"]),
    Case("stop: evaluate serve, SIGTERM after the first load", ["evaluate.py", "--env", "serve", *SERVE_EVAL],
         signal="SIGTERM", after="(written to", absent=[".ev.json.lock", "*.tmp-*"]),
    Case("stop: evaluate serve, SIGTERM while loading", ["evaluate.py", "--env", "serve", *SERVE_EVAL],
         signal="SIGTERM", after="dtype", absent=[".ev.json.lock", "ev.json"]),
    Case("stop: evaluate.py --env serve, SIGINT while loading", ["evaluate.py", "--env", "serve", "--full", *SERVE_EVAL],
         signal="SIGINT", after="dtype", absent=[".ev.json.lock", "ev.json"]),
    Case("stop: evaluate, SIGINT during the test prompts", ["evaluate.py", *BILD_EVAL], setup="bild_model",
         signal="SIGINT", after="test prompts", absent=["ev/.evaluate.lock", "ev/*.tmp-*"]),
    Case("stop: evaluate, SIGTERM during the grid search", ["evaluate.py", *BILD_EVAL], setup="bild_model",
         signal="SIGTERM", after="grid search", absent=["ev/.evaluate.lock"]),
    Case("stop: fill, SIGINT while filling", ["-m", "bild_env.fill", *TINY, "--prompts", "4", "--out",
                                              "{tmp}/f.json"], signal="SIGINT", after="dtype", absent=[".f.json.lock"]),
    Case("stop: scripts.analysis.batched, SIGTERM between its methods", ["-m", "scripts.analysis.batched", *TINY, "--out", "{tmp}/b.json"],
         signal="SIGTERM", after="bild  batched", absent=[".b.json.lock", "b.json"]),
    Case("stop: train serve, SIGTERM while timing the tables", ["train.py", "--env", "serve", *SMALL_RUN,
                                                                "--total-timesteps", "120", "--run-name", "r",
                                                                "--log-dir", "{tmp}"],
         signal="SIGTERM", after="[2/4]", absent=["r/train.lock"]),
    # cost profiles no machine could have timed, and options that must be refused before any work is done
    *[Case(f"profile: train serve, --cost-profile {name}", ["train.py", "--env", "serve", *SMALL_RUN,
                                                           "--total-timesteps", "40", "--cost-profile",
                                                           f"{{tmp}}/{name}.json", "--log-dir", "{tmp}/logs"],
           setup="damaged_profiles", absent=["logs"]) for name in ("steep", "huge", "jump", "text", "fraction")],
    Case("profile: train, --cost-profile steep", ["train.py", *TINY, "--total-timesteps", "40", "--cost-profile",
                                                   "{tmp}/steep.json", "--log-dir", "{tmp}/logs"],
         setup="damaged_profiles", absent=["logs"]),
    Case("profile: train serve, --charging vary_profiles=1e300", ["train.py", "--env", "serve", *SMALL_RUN, "--charging",
                                                                  "train_profiles=h200-opt-eager", "vary_profiles=1e300",
                                                                  "--log-dir", "{tmp}/logs"], absent=["logs"]),
    *[Case(f"profile: train serve, --time-budget {b}", ["train.py", "--env", "serve", *SMALL_RUN, "--time-budget", b,
                                                        "--log-dir", "{tmp}/logs"], absent=["logs"])
      for b in ("-1", "nan", "inf")],
    # a replayed real pair whose models are not on this machine: every action, lossy ones leave the recording
    Case("dataset: evaluate serve, qwen2.5-coder, every action, no models fetched",
         ["evaluate.py", "--env", "serve", "--pair", "qwen2.5-coder", "--cost-profile", "h200-opt-eager", "--levels",
          "0.3", "--moving", "burst:0.05,1.0", "--select-episodes", "1", "--episodes", "1", "--episode-steps", "32",
          "--max-prompts", "2", "--out", "{tmp}/ev.json"], ok=True, env={"BILD_ENV_CACHE": "{tmp}/cache"},
         absent=["cache/qwen*"]),  # replays every step, or refuses the first off the recording naming it
    # the README's real-pair env stepped by a random agent, then options that leave the recording (no models here)
    *[Case(f"dataset: gymnasium.make qwen2.5-coder, {what}", ["-c", REAL_PAIR_ENV.format(kwargs)], ok=what.startswith("random"),
           env={"BILD_ENV_CACHE": "{tmp}/cache"}, absent=["cache/qwen*"])
      for what, kwargs in (("random", ""), ("max_new_tokens=100", "max_new_tokens=100"),
                           ("lossy actions", "actions={'rollback_values': (0.5, 4.697)}"),
                           ("random, the draft cap chosen (auto)", "actions={'max_draft_len': 'auto'}"))],
    *[Case(f"draft cap: train.py --actions max_draft_len={v}", ["train.py", *TINY, "--actions", f"max_draft_len={v}",
                                                                 "--log-dir", "{tmp}/logs"], absent=["logs"])
      for v in ("four", "0")],
    Case("profile: bild_env.profile --batch-sizes 100000", ["-m", "bild_env.profile", *TINY, "--batch-sizes", "100000",
                                                            "--out", "{tmp}/p.json"]),
]


# ------------------------------------------------------------------------------------------------
# setups: what a case finds in its temporary folder
@functools.cache
def _trained_run(cache: str) -> Path:
    """A serving run trained to its total (120 steps, checkpoints at 60 and 120), once per probe (``cache``: its
    BILD_ENV_CACHE); each case copies it."""
    logs = Path(tempfile.mkdtemp(prefix="probe_run_"))
    atexit.register(shutil.rmtree, logs, True)
    subprocess.run([PY, "train.py", "--env", "serve", *SMALL_RUN, "--total-timesteps", "120", "--log-dir", str(logs),
                    "--run-name", "r"], cwd=ROOT, env=os.environ | {"BILD_ENV_CACHE": cache, "PYTHONPATH": str(ROOT)},
                   capture_output=True, check=True, timeout=600)
    return logs / "r"


def trained_run(tmp: Path, env: dict) -> None:
    shutil.copytree(_trained_run(env["BILD_ENV_CACHE"]), tmp / "r", symlinks=True)


def finished_run(tmp: Path, env: dict) -> None:
    """A serving run trained to its total (120 steps), then its checkpoints folder removed: none can be read."""
    trained_run(tmp, env)
    shutil.rmtree(tmp / "r" / "checkpoints")


def resumable_run(tmp: Path, env: dict) -> None:
    """A serving run stopped at step 120 of 180, with its checkpoints: ``--resume`` goes on from step 120."""
    trained_run(tmp, env)
    config = json.loads((tmp / "r" / "config.json").read_text())
    config["run"]["total_timesteps"] = 180
    (tmp / "r" / "config.json").write_text(json.dumps(config))


BILD_MODEL = """
import sys
import gymnasium as gym
from gymnasium import spaces
from stable_baselines3 import DQN
from agents import RunConfig
from bild_env.env import EnvConfig
from bild_env.observations import observation_space

class Spaces(gym.Env):
    observation_space, action_space = observation_space("paper"), spaces.Discrete(25)

folder = sys.argv[1]
RunConfig(env=EnvConfig(pair="tiny-random", pair_options={"device": "cpu"}, max_new_tokens=8)).save(folder + "/config.json")
DQN("MlpPolicy", Spaces(), buffer_size=10, policy_kwargs={"net_arch": [8]}, device="cpu").save(folder + "/model.zip")
"""


def bild_model(tmp: Path, env: dict) -> None:
    """A BiLD-v1 run folder at {tmp}/bild: its config.json and an untrained DQN of its spaces (no training needed)."""
    (tmp / "bild").mkdir()
    subprocess.run([PY, "-c", BILD_MODEL, str(tmp / "bild")], cwd=ROOT, env=env, capture_output=True, check=True,
                   timeout=300)


def stopped_run(tmp: Path, env: dict) -> None:
    """The same, its total then raised to 180 steps: a run stopped before its end whose checkpoints are gone."""
    resumable_run(tmp, env)
    shutil.rmtree(tmp / "r" / "checkpoints")


def fake_run(tmp: Path) -> None:
    """A serving run's files, made by hand (for cases refused before any file is read but config.json)."""
    run = tmp / "r"
    run.mkdir()
    config = {"version": 3, "env_id": "BiLD-Serve-v0", "algo": "dqn", "run": {"total_timesteps": 120},
              "env": {"pair": "tiny-random", "max_batch": 4}}
    (run / "config.json").write_text(json.dumps(config))
    for name in ("model.zip", "best_model.zip"):
        (run / name).write_bytes(b"PK" + os.urandom(64))
    (run / "progress.csv").write_text("time/total_timesteps,x\n60,1\n120,2\n")
    (run / "evaluations.json").write_text('[{"step": 120, "return": -1.0}]\n')


def junk_config(tmp: Path, env: dict) -> None:
    fake_run(tmp)
    (tmp / "r" / "config.json").write_bytes(b"\xff\xfe{not json")


def max_batch_0(tmp: Path, env: dict) -> None:
    fake_run(tmp)
    config = json.loads((tmp / "r" / "config.json").read_text())
    config["env"]["max_batch"] = 0
    (tmp / "r" / "config.json").write_text(json.dumps(config))


def opt_target(tmp: Path, env: dict) -> None:
    (tmp / "opt").mkdir()
    (tmp / "opt" / "config.json").write_text('{"model_type": "opt", "hidden_size": 64}')


def damaged_profiles(tmp: Path, env: dict) -> None:
    """Copies of the shipped h200-opt-eager profile that no machine could have timed, each in its own file."""
    shipped = json.loads((ROOT / "bild_env" / "assets" / "profiles" / "h200-opt-eager.json").read_text())

    def write(name: str, change) -> None:
        profile = json.loads(json.dumps(shipped))
        change(profile["cost_model"])
        (tmp / f"{name}.json").write_text(json.dumps(profile))

    def steep(m):  # only the draft's per-context slope raised: every forward below zero before the reference context
        m["draft"]["per_context_ms"] = 0.5

    def huge(m):
        for role in ("draft", "target"):
            m[role]["ms"] = [t * 1e300 for t in m[role]["ms"]]

    def jump(m):  # the target's times x1e6 from 8 tokens fed upward
        t = m["target"]
        t["ms"] = [ms * (1e6 if fed >= 8 else 1) for fed, ms in zip(t["fed"], t["ms"])]

    def text(m):
        m["target"]["ms"][0] = str(round(m["target"]["ms"][0], 1))

    def fraction(m):
        m["target"]["fed"][1] = 1.5

    for name, change in {"steep": steep, "huge": huge, "jump": jump, "text": text, "fraction": fraction}.items():
        write(name, change)


SETUPS = {f.__name__: f for f in (finished_run, stopped_run, resumable_run, bild_model, junk_config, max_batch_0,
                                   opt_target, damaged_profiles)}


# ------------------------------------------------------------------------------------------------
def digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def classify(case: Case, rc: int | None, err: str, kept: bool, left: list[str] = ()) -> str:
    if not kept:
        return "lost"
    if rc is None:
        return "stuck"
    if "Traceback (most recent call last)" in err or rc < 0:
        return "traceback"
    if left:
        return "silently wrong"
    if case.signal:
        return "clean stop" if rc == 130 and err.strip() else "silently wrong" if rc == 0 else "traceback"
    if rc == 0:
        return "fine" if case.ok else "silently wrong"
    return "clear error" if rc in (1, 2) and err.strip() else "traceback"


DISK_SCRIPT = r"""
disk="$1"; kind="$2"; moved="$3"; shift 3
mount -t tmpfs -o size=8m tmpfs "$disk" || exit 97
if [ -n "$moved" ]; then mv "$moved" "$disk/" || exit 97; fi
case "$kind" in
  full) head -c 16m /dev/zero > "$disk/.filler" 2>/dev/null ;;
  small) head -c 16m /dev/zero > "$disk/.filler" 2>/dev/null; truncate -s -400K "$disk/.filler" ;;
  ro) mount -o remount,ro "$disk" || exit 97 ;;
esac
"$@"; rc=$?
if [ -n "$moved" ]; then rm -f "$disk/.filler"; mv "$disk/$(basename "$moved")" "$(dirname "$moved")/"; fi
exit $rc
"""


@functools.cache
def private_mounts() -> list[str] | None:
    """The command line that runs a command in a mount namespace of its own (``unshare``), where it may mount a tmpfs;
    None where this machine allows none."""
    for prefix in (["unshare", "--mount"], ["unshare", "--mount", "--map-root-user"]):
        with tempfile.TemporaryDirectory() as folder:
            try:
                done = subprocess.run([*prefix, "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$1"', "sh", folder],
                                      capture_output=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if done.returncode == 0:
                return prefix
    return None


def run_signalled(command: list[str], env: dict, case: Case, timeout: float) -> tuple[int | None, str]:
    """``command``, sent ``case.signal`` once ``case.after`` shows in its output (stdout and stderr together): its
    exit status (None: stuck, killed) and output. SIGINT as a terminal's Ctrl-C (never ignored)."""
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines, seen = [], threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if case.after in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while not seen.wait(0.2) and proc.poll() is None and time.monotonic() < deadline:
        pass
    if seen.is_set():
        proc.send_signal(getattr(signal, case.signal))
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()) if not seen.is_set() else 120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = None
    reader.join(10)
    text = "".join(lines)
    if not seen.is_set():
        text += f"\n(no {case.after!r} in its output: no {case.signal} was sent)"
    return rc, text + (f"\ntimed out after {timeout:.0f} s" if rc is None else "")


def run_case(case: Case, env: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="probe_") as folder:
        tmp = Path(folder)
        disk = tmp / "disk"

        def fill(text: str) -> str:
            return text.replace("{tmp}", folder).replace("{disk}", str(disk))

        row = {"case": case.name, "command": " ".join(["python", *case.argv]), "exit": None}
        if case.disk and private_mounts() is None:
            return row | {"outcome": "skipped", "message": "no private mount namespace here (unshare --mount)",
                          "seconds": 0.0}
        if case.setup:
            SETUPS[case.setup](tmp, env)
        before = {k: digest(tmp / k) for k in case.keep}
        command = [PY, *(fill(a) for a in case.argv)]
        if case.disk:
            disk.mkdir()
            command = [*private_mounts(), "sh", "-c", DISK_SCRIPT, "sh", str(disk), case.disk,
                       str(tmp / case.move) if case.move else "", *command]
        run_env = env | {k: fill(v) for k, v in case.env.items()}
        start = time.perf_counter()
        if case.signal:
            rc, err = run_signalled(command, run_env, case, timeout)
        else:
            try:
                out = subprocess.run(command, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=timeout,
                                     stdin=subprocess.DEVNULL)
                rc, err = out.returncode, out.stderr
            except subprocess.TimeoutExpired:
                rc, err = None, f"timed out after {timeout:.0f} s"
        if rc == 97 and case.disk:
            return row | {"outcome": "skipped", "message": "the tmpfs could not be made", "seconds": 0.0}
        found = {digest(p) for p in tmp.rglob("*") if p.is_file()}  # kept in place, or moved aside whole
        kept = all(before[k] is not None and before[k] in found for k in case.keep)
        left = [str(p.relative_to(tmp)) for pattern in case.absent for p in tmp.glob(pattern)]
        lines = [line for line in err.strip().splitlines() if line.strip()]
        message = lines[-1][:300] if lines else ""
        return row | {"exit": rc, "outcome": classify(case, rc, err, kept, left),
                      "message": f"left {', '.join(left)}; {message}" if left else message,
                      "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="run the cases whose name holds this text")
    p.add_argument("--timeout", type=float, default=300, help="seconds a case may run")
    p.add_argument("--out", type=Path, default=None, help="write the table here (JSON)")
    args = p.parse_args(argv)
    cases = [c for c in CASES if args.only in c.name]
    if not cases:
        p.error(f"no case's name holds {args.only!r}")
    cache = tempfile.mkdtemp(prefix="probe_cache_")
    env = os.environ | {"BILD_ENV_CACHE": cache, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    env.pop("BILD_DEBUG", None)
    rows = []
    for case in cases:
        rows.append(run_case(case, env, args.timeout))
        r = rows[-1]
        print(f"{r['outcome']:15s} exit {r['exit']!s:>4} {r['seconds']:6.1f}s  {r['case']}: {r['message'][:140]}",
              flush=True)
    counts = {o: sum(r["outcome"] == o for r in rows) for o in (*GOOD_OUTCOMES, *BAD_OUTCOMES)}
    print(" ".join(f"{k}: {v}" for k, v in counts.items()))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = " ".join(["python", "scripts/analysis/probe_inputs.py", *(sys.argv[1:] if argv is None else argv)])
        args.out.write_text(json.dumps({"command": command, "counts": counts, "cases": rows}, indent=1) + "\n")
    return 1 if any(counts[o] for o in BAD_OUTCOMES) else 0


if __name__ == "__main__":
    sys.exit(main())
