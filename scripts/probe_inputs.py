"""Probe every command with bad input, as a new user would, and classify what each does (tiny-random pair).

    python scripts/probe_inputs.py                                   # every case, a few minutes on 2 cores
    python scripts/probe_inputs.py --only distill --out /tmp/p.json  # the cases whose command has this word

Each case runs one command line in a fresh process (a private ``BILD_ENV_CACHE`` shared by the cases, the working
folder the repository, every file it writes in a temporary folder) and is classified:

* ``clear error``: exit status 1 or 2, no stack trace, and the last line of stderr names the problem;
* ``fine``: exit status 0 where the input is good (a case marked ``ok``);
* ``traceback``: a stack trace (no ``--debug`` is given), or a crash by a signal;
* ``silently wrong``: exit status 0 where the input is bad;
* ``stuck``: still running after ``--timeout`` seconds (killed);
* ``lost``: a file a case's ``keep`` names is gone: neither in place nor moved aside whole (a run folder's model,
  logs, evaluations).

Prints a table and writes it as JSON with ``--out``; exits 1 when any case is a traceback, silently wrong, stuck or
lost.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
BAD_OUTCOMES = ("traceback", "silently wrong", "lost", "stuck")


@dataclass
class Case:
    name: str
    argv: list[str]  # after the python executable; "{tmp}" becomes the case's temporary folder
    ok: bool = False  # the input is good: exit 0 is right
    setup: str = ""  # a function of SETUPS that prepares {tmp} before the run
    keep: list[str] = field(default_factory=list)  # files under {tmp} whose bytes must still be there after the run
    # (in place, or moved aside whole, e.g. into the run's set_aside/<n>/)


TINY = ["--pair", "tiny-random"]
SMALL_RUN = ["--pair", "tiny-random", "--n-envs", "2", "--eval-freq", "60", "--eval-episodes", "1",
             "--max-new-tokens", "8", "--max-batch", "4", "--episode-steps", "12", "--learning-starts", "40",
             "--batch-size", "16", "--mix", "prose:1", "--no-progress-bar", "--checkpoint-freq", "60"]
SERVE_RUN = ["train.py", "--env", "serve", "--resume", "{tmp}/r", "--no-progress-bar"]
RUN_FILES = ["r/model.zip", "r/best_model.zip", "r/progress.csv", "r/evaluations.json", "r/config.json"]
CASES = [
    # train.py, BiLD-v1 and BiLD-Serve-v0
    Case("train: unknown --env", ["train.py", "--env", "nope"]),
    Case("train: unknown pair", ["train.py", "--pair", "nosuch", "--log-dir", "{tmp}"]),
    Case("train: unknown device", ["train.py", *TINY, "--device", "tpu", "--log-dir", "{tmp}"]),
    Case("train: --total-timesteps 0", ["train.py", *TINY, "--total-timesteps", "0", "--log-dir", "{tmp}"]),
    Case("train serve: --max-batch 0", ["train.py", "--env", "serve", *TINY, "--max-batch", "0", "--log-dir", "{tmp}"]),
    Case("train serve: unknown dtype", ["train.py", "--env", "serve", *TINY, "--dtype", "float9", "--log-dir", "{tmp}"]),
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
    Case("train: --learning-rate nan", ["train.py", *TINY, "--learning-rate", "nan", "--log-dir", "{tmp}"]),
    Case("train: --gamma 2", ["train.py", *TINY, "--gamma", "2", "--log-dir", "{tmp}"]),
    Case("train: --n-envs 0", ["train.py", *TINY, "--n-envs", "0", "--log-dir", "{tmp}"]),
    Case("train: --log-dir under a file", ["train.py", *TINY, "--log-dir", "/etc/passwd/logs"]),
    Case("train serve: --learning-rate inf", ["train.py", "--env", "serve", *TINY, "--learning-rate", "inf",
                                              "--log-dir", "{tmp}"]),
    Case("train serve: --total-timesteps -5", ["train.py", "--env", "serve", *TINY, "--total-timesteps", "-5",
                                               "--log-dir", "{tmp}"]),
    Case("train serve: unknown device", ["train.py", "--env", "serve", *TINY, "--device", "tpu", "--log-dir", "{tmp}"]),
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
    Case("bench.batched: --rollback -1", ["-m", "bench.batched", *TINY, "--rollback", "-1"]),
    Case("bench.batched: --threads 0", ["-m", "bench.batched", *TINY, "--threads", "0"]),
    Case("bench.clock: unknown pair", ["-m", "bench.clock", "--pair", "nosuch"]),
    Case("bench.headroom: --prompts 0", ["-m", "bench.headroom", *TINY, "--prompts", "0"]),
    Case("bench.serving: --episodes 0", ["-m", "bench.serving", *TINY, "--episodes", "0"]),
    Case("bench.batched: --batch 0", ["-m", "bench.batched", *TINY, "--batch", "0"]),
    Case("bench.batched: --fallback 2", ["-m", "bench.batched", *TINY, "--fallback", "2"]),
    Case("bench.batched: --out unwritable", ["-m", "bench.batched", *TINY, "--out", "/proc/b.json"]),
    Case("bench.headroom: --out a folder", ["-m", "bench.headroom", *TINY, "--out", "{tmp}"]),
    Case("bench.serving_clock: --out a folder", ["-m", "bench.serving_clock", *TINY, "--out", "{tmp}"]),
    Case("bench.front: --out unwritable", ["-m", "bench.front", *TINY, "--out", "/proc/front.json"]),
    Case("bench.draft_forward: --out a folder", ["-m", "bench.draft_forward", *TINY, "--out", "{tmp}"]),
    Case("bench.clock: --out a folder", ["-m", "bench.clock", *TINY, "--out", "{tmp}"]),
    Case("bench.agreement: --out a folder", ["-m", "bench.agreement", *TINY, "--out", "{tmp}"]),
    Case("bench.stop_rules: --out a folder", ["-m", "bench.stop_rules", *TINY, "--out", "{tmp}"]),
    Case("bench.forwards: --fed 0", ["-m", "bench.forwards", *TINY, "--fed", "0"]),
    Case("bench.decoders: unknown device", ["-m", "bench.decoders", *TINY, "--device", "tpu"]),
    Case("bench.serving: --max-batch 33", ["-m", "bench.serving", *TINY, "--max-batch", "33"]),
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
    Case("distill acceptance: --out a folder", ["-m", "distill", "acceptance", "--out", "{tmp}"]),
    Case("distill lookup: --out a folder", ["-m", "distill", "lookup", "--out", "{tmp}"]),
    # Ray's commands (the cluster extra)
    Case("agents.tune: --seeds 0 seeds", ["-m", "agents.tune", "--seeds"]),
    Case("agents.rllib_serve: unknown pair", ["-m", "agents.rllib_serve", "--pair", "nosuch"]),
]


# ------------------------------------------------------------------------------------------------
# setups: what a case finds in its temporary folder
def finished_run(tmp: Path, env: dict) -> None:
    """A serving run trained to its total (120 steps), then its checkpoints folder removed: none can be read."""
    subprocess.run([PY, "train.py", "--env", "serve", *SMALL_RUN, "--total-timesteps", "120", "--log-dir", str(tmp),
                    "--run-name", "r"], cwd=ROOT, env=env, capture_output=True, check=True, timeout=600)
    shutil.rmtree(tmp / "r" / "checkpoints")


def stopped_run(tmp: Path, env: dict) -> None:
    """The same, its total then raised to 180 steps: a run stopped before its end whose checkpoints are gone."""
    finished_run(tmp, env)
    config = json.loads((tmp / "r" / "config.json").read_text())
    config["train"]["total_timesteps"] = 180
    (tmp / "r" / "config.json").write_text(json.dumps(config))


def fake_run(tmp: Path) -> None:
    """A serving run's files, made by hand (for cases refused before any file is read but config.json)."""
    run = tmp / "r"
    run.mkdir()
    config = {"env_id": "BiLD-Serve-v0", "format": 2, "train": {"total_timesteps": 120},
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


SETUPS = {f.__name__: f for f in (finished_run, stopped_run, junk_config, max_batch_0, opt_target)}


# ------------------------------------------------------------------------------------------------
def digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def classify(case: Case, rc: int | None, err: str, kept: bool) -> str:
    if not kept:
        return "lost"
    if rc is None:
        return "stuck"
    if "Traceback (most recent call last)" in err or rc < 0:
        return "traceback"
    if rc == 0:
        return "fine" if case.ok else "silently wrong"
    return "clear error" if rc in (1, 2) and err.strip() else "traceback"


def run_case(case: Case, env: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="probe_") as folder:
        tmp = Path(folder)
        if case.setup:
            SETUPS[case.setup](tmp, env)
        before = {k: digest(tmp / k) for k in case.keep}
        argv = [a.replace("{tmp}", folder) for a in case.argv]
        start = time.perf_counter()
        try:
            out = subprocess.run([PY, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                                 stdin=subprocess.DEVNULL)
            rc, err = out.returncode, out.stderr
        except subprocess.TimeoutExpired:
            rc, err = None, f"timed out after {timeout:.0f} s"
        found = {digest(p) for p in tmp.rglob("*") if p.is_file()}  # kept in place, or moved aside whole
        kept = all(before[k] is not None and before[k] in found for k in case.keep)
        lines = [line for line in err.strip().splitlines() if line.strip()]
        return {"case": case.name, "command": "python " + " ".join(case.argv), "exit": rc,
                "outcome": classify(case, rc, err, kept), "message": lines[-1][:300] if lines else "",
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
    counts = {o: sum(r["outcome"] == o for r in rows) for o in ("clear error", "fine", *BAD_OUTCOMES)}
    print(" ".join(f"{k}: {v}" for k, v in counts.items()))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = " ".join(["python", "scripts/probe_inputs.py", *(sys.argv[1:] if argv is None else argv)])
        args.out.write_text(json.dumps({"command": command, "counts": counts, "cases": rows}, indent=1) + "\n")
    return 1 if any(counts[o] for o in BAD_OUTCOMES) else 0


if __name__ == "__main__":
    sys.exit(main())
