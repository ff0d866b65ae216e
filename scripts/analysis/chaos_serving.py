"""Chaos test of serving training (``train.py --env serve``): kill a run at random moments, many times, resume it.

    python -m scripts.analysis.chaos_serving                         # 60 kills, about 2 minutes on a 2-core CPU
    python -m scripts.analysis.chaos_serving --kills 200 --out results/chaos_serving.json
    python -m scripts.analysis.chaos_serving --in-writes --kills 30   # every signal sent while a file is being written

A tiny-random serving run (one torch thread, checkpoints every --checkpoint-freq steps, so that kills land in
checkpoint writes too) is started, then killed after a random time: SIGKILL mostly, sometimes SIGTERM (the stop
that saves a checkpoint) or SIGTERM then SIGKILL while it saves. Now and then the newest checkpoint is then cut
short (as a disk full or a kill of a copy leaves it), which a resume must skip. Then the same command with
``--resume`` goes on, and is killed again. A run that reaches its total is checked against an uninterrupted run
of the same options, and the next run starts, until --kills kills are done.

Checked, and counted:

* a run is lost when a resume (or a restart of a run killed before its first checkpoint) exits with an error
  or a traceback;
* a progress row is lost when a row of ``progress.csv`` that was on disk at a kill, at or before the step of the
  checkpoint the resume goes on from, is missing from the finished run's file (rows past a checkpoint that was then
  cut short, whose steps the resume does again, are counted apart as redone);
* the finished run's evaluation steps, its newest checkpoint and final step must equal the uninterrupted run's,
  and no step may be logged twice.

With ``--in-writes`` every signal is timed inside a write: the run folder is watched (every ~0.2 ms) for the
temporary file ``write_atomic`` writes a checkpoint's model, buffer or state, ``progress.csv``'s rewrite or an
evaluation into, and the signal (SIGTERM, SIGINT, or SIGTERM then SIGKILL) is sent the moment one appears. A
SIGTERM or SIGINT alone must end in the clean stop: exit 130 and the hint to go on in the output (``--resume``, or,
before the first checkpoint, "start it again") (counted as ``unclean_stops`` otherwise).

Each run is a forked child of this process (the libraries are imported once), in a private ``BILD_ENV_CACHE``.
Prints the figures and writes them as JSON with --out; exits 1 on any loss or mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file: scripts/analysis/)
KILLS = ("SIGKILL", "SIGKILL", "SIGKILL", "SIGTERM", "SIGTERM+SIGKILL")
IN_WRITES = ("SIGTERM", "SIGINT", "SIGTERM+SIGKILL")  # --in-writes: the stops a user or a scheduler sends


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--kills", type=int, default=60, help="kills in all (over as many runs as it takes)")
    p.add_argument("--steps", type=int, default=960, help="total env steps of each run")
    p.add_argument("--checkpoint-freq", type=int, default=40, help="env steps between checkpoints")
    p.add_argument("--eval-freq", type=int, default=120, help="env steps between evaluations")
    p.add_argument("--max-life", type=float, default=0.8, help="latest kill, seconds after training began")
    p.add_argument("--damage", type=float, default=0.15,
                   help="chance, after each kill, of cutting the newest complete checkpoint's model, buffer or state "
                        "short: the resume must skip it")
    p.add_argument("--in-writes", action="store_true",
                   help="send every signal while the run writes a file (a checkpoint, progress.csv, an evaluation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the figures here (JSON)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (runs, logs, cache)")
    args = p.parse_args(argv)
    for name in ("kills", "steps", "checkpoint_freq", "eval_freq"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.max_life > 0 or not 0 <= args.damage <= 1:
        p.error("--max-life must be above 0 and --damage in [0, 1]")
    return args


def train_args(args: argparse.Namespace, log_dir: Path, name: str) -> list[str]:
    return ["--pair", "tiny-random", "--n-envs", "2", "--max-new-tokens", "8", "--max-batch", "4",
            "--episode-steps", "12", "--hyperparams", "learning_starts=40", "batch_size=16", "--mix", "prose:1,code:1",
            "--eval-episodes", "1", "--eval-freq", str(args.eval_freq), "--checkpoint-freq", str(args.checkpoint_freq),
            "--total-timesteps", str(args.steps), "--no-progress-bar", "--no-fill-trees",  # resumes, not tree fills
            "--log-dir", str(log_dir), "--run-name", name]


# ------------------------------------------------------------------------------------------------
# 1. runs, each a forked child
def warm_up(args: argparse.Namespace, root: Path) -> None:
    """Import the libraries and load what the runs' envs load (the pair, its tokenizer, the prompts) once, here,
    with one torch thread (no thread pool to fork), so that each forked child starts in a fraction of a second."""
    import torch

    torch.set_num_threads(1)
    from agents.serve.options import parse
    from bild_env.serving.env import ServingEnv

    import bild_env.decoding.costs as costs

    costs.load_or_calibrate_batched = lambda pair, *a, **k: hand_made_costs()  # inherited by every child
    _, env_cfg = parse(train_args(args, root / "warm", "warm"))
    ServingEnv(**env_cfg.arguments(split="validation")).close()


def hand_made_costs():
    """A batched cost model made by hand (forwards cost more with more rows and tokens): the runs' rewards do not
    hang on timings taken on a machine this script keeps busy, and no child times anything."""
    from bild_env.decoding.costs import BATCH_SIZES, BatchCost, CostModel, ForwardCost

    target = {(b, n): 4.0 + 0.5 * n * b ** 0.7 + 0.2 * b for b in BATCH_SIZES for n in range(1, 13)}
    draft = {k: v / 4.0 for k, v in target.items()}
    return CostModel(ForwardCost.linear(1.0, 0.1, 0.0), ForwardCost.linear(4.0, 0.5, 0.0), "hand-made",
                     batched={"draft": BatchCost.from_table(draft, ref_context=64, per_context_ms=0.001),
                              "target": BatchCost.from_table(target, ref_context=64, per_context_ms=0.004)})


def start(argv: list[str], log: Path) -> int:
    """Fork a child that runs ``train.py --env serve`` with ``argv``, its output to ``log``; its pid."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        # Ctrl-C as a user's terminal sends it: a shell starts background jobs (nohup, `cmd &`) with SIGINT ignored and
        # a fork inherits that, so a chaos run started in the background would see its SIGINTs ignored, by design
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            from agents.commands import train_main

            code = train_main(["--env", "serve", *argv])
        except SystemExit as err:
            code = err.code if isinstance(err.code, int) else 1
        except BaseException:  # noqa: BLE001 - printed for the parent to find
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def wait(pid: int, timeout: float | None = None) -> int | None:
    """The child's exit code (negative: the signal that ended it), or None while it still runs after ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG if deadline is not None else 0)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


def wait_to_kill(pid: int, run_dir: Path, args: argparse.Namespace, rng: random.Random) -> int | None:
    """Wait for a moment to kill the child at: a fifth of the time while it starts (loading, checking, resuming),
    else a random time up to --max-life after its training began (``progress.csv`` written anew); None then, or
    the child's exit code when it ended first."""
    if rng.random() < 0.2:
        return wait(pid, rng.uniform(0.0, 0.6))
    began = time.time_ns()
    while True:
        try:
            if (run_dir / "progress.csv").stat().st_mtime_ns >= began:
                break
        except FileNotFoundError:
            pass
        code = wait(pid, 0.01)
        if code is not None:
            return code
    return wait(pid, rng.uniform(0.0, args.max_life))


def writing(run_dir: Path, pid: int, skip: tuple[str, ...] = ()) -> str | None:
    """The name of a temporary file process ``pid`` is writing (``write_atomic``'s ``<name>.tmp-<pid>``) in the run
    folder or its checkpoints, if any (one an earlier, killed process left has another pid)."""
    suffix = f".tmp-{pid}"
    for folder in (run_dir, run_dir / "checkpoints"):
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.name.endswith(suffix) and not entry.name.startswith(skip):
                        return entry.name
        except (FileNotFoundError, NotADirectoryError):
            pass
    return None


def wait_in_write(pid: int, run_dir: Path, timeout: float, skip: tuple[str, ...] = ()) -> tuple[int | None, str | None]:
    """Watch the run folder until a file (not one named in ``skip``) is being written (``(None, its name)``: signal
    now), the child ends (``(exit code, None)``) or ``timeout`` seconds pass (``(None, None)``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        name = writing(run_dir, pid, skip)
        if name is not None:
            return None, name
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), None
        time.sleep(0.0002)
    return None, None


def kill(pid: int, how: str, rng: random.Random) -> int:
    if how == "SIGTERM+SIGKILL":
        os.kill(pid, signal.SIGTERM)
        code = wait(pid, rng.uniform(0.0, 0.3))  # SIGKILL while it saves the checkpoint the SIGTERM asked for
        if code is not None:
            return code
        how = "SIGKILL"
    os.kill(pid, getattr(signal, how))
    code = wait(pid, 60.0)
    if code is None:  # SIGTERM asks for a stop at the next rollout start: it may take a while
        os.kill(pid, signal.SIGKILL)
        code = wait(pid)
    return code


# ------------------------------------------------------------------------------------------------
# 2. what is on disk
def rows_upto(run_dir: Path, steps: int) -> list[dict]:
    """``progress.csv``'s rows at or before ``steps``, each as {column: value} without its empty cells."""
    from agents.common.logs import PROGRESS, progress_rows

    header, rows = progress_rows(run_dir / PROGRESS, steps)
    return [{k: v for k, v in zip(header, r) if v != ""} for r in rows]


def step_of(row: dict) -> int:
    from agents.common.logs import STEP_KEY

    return int(float(row[STEP_KEY]))


def damage(run_dir: Path, rng: random.Random) -> str | None:
    """Cut a file of the newest complete checkpoint short; what was cut."""
    from agents.serve.runs import complete_checkpoints

    found = complete_checkpoints(run_dir)
    if not found:
        return None
    path = rng.choice(found[0].files)
    data = path.read_bytes()
    path.write_bytes(data[: rng.randrange(0, max(1, len(data)))])
    return path.name


def resumes_from(run_dir: Path) -> int | None:
    from agents.serve.runs import resume_point

    point = resume_point(run_dir, lambda _: None)
    return None if point is None else point.steps


def summary(run_dir: Path) -> dict:
    from agents.common.logs import STEP_KEY
    from agents.serve.runs import complete_checkpoints

    history = json.loads((run_dir / "evaluations.json").read_text())
    rows = rows_upto(run_dir, 10**12)
    steps = [int(float(r[STEP_KEY])) for r in rows]
    evals = [int(float(r[STEP_KEY])) for r in rows if "eval/mean_reward" in r]
    return {"evaluations": [h["step"] for h in history], "eval_rows": evals, "in_order": steps == sorted(steps),
            "newest_checkpoint": complete_checkpoints(run_dir)[0].steps, "rows": rows}


# ------------------------------------------------------------------------------------------------
# 3. the chaos
def chaos(args: argparse.Namespace, root: Path) -> dict:
    rng = random.Random(args.seed)
    logs = root / "logs"
    reference_log = root / "reference.log"
    pid = start(train_args(args, logs, "reference"), reference_log)
    t0 = time.monotonic()
    if wait(pid) != 0:
        raise SystemExit(f"the uninterrupted run failed: see {reference_log}\n" + reference_log.read_text()[-3000:])
    reference, reference_s = summary(logs / "reference"), time.monotonic() - t0
    figures = {"kills": 0, "by_signal": {}, "damaged": 0, "runs_finished": 0, "runs_lost": 0, "rows_checked": 0,
               "rows_lost": 0, "rows_redone": 0, "mismatches": [], "reference_s": round(reference_s, 1), "failures": [],
               "in_writes": {}, "unclean_stops": []}
    run_index = 0
    while figures["kills"] < args.kills:
        name = f"run{run_index}"
        run_dir, must_keep = logs / name, []
        while True:  # start, kill, resume, ... until the run reaches its total
            resume = (run_dir / "config.json").is_file()
            argv = (["--resume", str(run_dir), "--no-progress-bar"] if resume
                    else train_args(args, logs, name))
            log = root / f"{name}.log"
            mark = log.stat().st_size if log.exists() else 0
            pid = start(argv, log)
            file = how = None
            if figures["kills"] >= args.kills:
                code = wait(pid, None)
            elif args.in_writes:
                # config.json is written at every start: most signals wait for a checkpoint's or a log's write
                code, file = wait_in_write(pid, run_dir, 60.0, ("config.json",) if rng.random() < 0.8 else ())
            else:
                code = wait_to_kill(pid, run_dir, args, rng)
            if code is None:
                how = rng.choice(IN_WRITES if file else KILLS)
                code = kill(pid, how, rng)
                figures["kills"] += 1
                figures["by_signal"][how] = figures["by_signal"].get(how, 0) + 1
                if file:
                    kind = file.split(".tmp-")[0].split("_")[0]  # dqn / replay / state / progress.csv / ...
                    figures["in_writes"][kind] = figures["in_writes"].get(kind, 0) + 1
            out = log.read_text(errors="replace")[mark:]
            hint = "--resume" in out or "start it again" in out  # no complete checkpoint yet: the same command
            if file and how in ("SIGTERM", "SIGINT") and not (code == 130 and hint):
                figures["unclean_stops"].append({"run": name, "signal": how, "in": file, "exit": code,
                                                 "output": out[-800:]})
            if "Traceback" in out or code not in (0, 130, -signal.SIGKILL, -signal.SIGTERM):
                figures["runs_lost"] += 1
                figures["failures"].append({"run": name, "exit": code, "output": out[-1500:]})
                break
            if code == 0:
                break
            if rng.random() < args.damage and damage(run_dir, rng):
                figures["damaged"] += 1
            at = resumes_from(run_dir)
            if at is not None:  # rows past a damaged checkpoint are logged again by the steps redone: not kept
                redone = [r for r in must_keep if step_of(r) > at]
                figures["rows_redone"] += len(redone)
                must_keep = [r for r in must_keep if step_of(r) <= at] + rows_upto(run_dir, at)
        if figures["failures"] and figures["failures"][-1]["run"] == name:
            run_index += 1
            continue
        figures["runs_finished"] += 1
        done = summary(run_dir)
        final = [r for r in done["rows"]]
        unique = {json.dumps(r, sort_keys=True) for r in must_keep}
        figures["rows_checked"] += len(unique)
        lost = [r for r in unique if json.loads(r) not in final]
        figures["rows_lost"] += len(lost)
        for key in ("evaluations", "eval_rows", "newest_checkpoint"):
            if done[key] != reference[key]:
                figures["mismatches"].append({"run": name, key: done[key], "uninterrupted": reference[key]})
        if not done["in_order"]:
            figures["mismatches"].append({"run": name, "progress.csv": "steps out of order"})
        run_index += 1
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="chaos-serving-"))
    os.environ["BILD_ENV_CACHE"] = str(root / "cache")
    warm_up(args, root)

    try:
        figures = chaos(args, root)
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{figures['kills']} kills ({', '.join(f'{k} {v}' for k, v in sorted(figures['by_signal'].items()))}), "
          f"{figures['damaged']} checkpoints cut short, {figures['runs_finished']} runs finished: "
          f"{figures['runs_lost']} runs lost, {figures['rows_lost']} of {figures['rows_checked']} progress rows lost "
          f"({figures['rows_redone']} redone past a checkpoint cut short), "
          f"{len(figures['mismatches'])} mismatches with the uninterrupted run")
    if args.in_writes:
        print(f"signals sent inside writes of: {', '.join(f'{k} {v}' for k, v in sorted(figures['in_writes'].items()))}; "
              f"{len(figures['unclean_stops'])} SIGTERM/SIGINT without the clean stop (exit 130 and the resume hint)")
        for stop in figures["unclean_stops"][:3]:
            print(f"unclean stop: {stop}")
    for failure in figures["failures"][:3]:
        print(f"lost {failure['run']} (exit {failure['exit']}):\n{failure['output']}")
    for mismatch in figures["mismatches"][:5]:
        print(f"mismatch: {mismatch}")
    if args.out:
        from bild_env.models.device import machine_description

        args.out.parent.mkdir(parents=True, exist_ok=True)
        head = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine_description("cpu")}
        args.out.write_text(json.dumps(head | figures, indent=1) + "\n")
    ok = not figures["runs_lost"] and not figures["rows_lost"] and not figures["mismatches"] and not figures["unclean_stops"]
    return 0 if ok and figures["kills"] >= args.kills else 1


if __name__ == "__main__":
    sys.exit(main())
