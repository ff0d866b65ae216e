"""Chaos test of the replay tree store and of ``--resume``: kill training runs at random moments, many times.

    python -m scripts.analysis.chaos_replay                        # about 8 minutes on a 2-core CPU
    python -m scripts.analysis.chaos_replay --rounds 3 --steps 800  # a quick look

Two training runs on the ``tiny-random`` pair (replay backend, one torch thread, small budgets)
share one private ``BILD_ENV_CACHE`` and run at the same time, so they fill and write the same
prompt trees:

* run ``a``: one env, run through ``agents.commands.train_main`` inside ``sharing(TreeStore(flush_seconds=
  --flush-seconds))``, so its trees reach disk every few seconds while it trains;
* run ``b``: two envs stepped together, plain ``python train.py`` (trees written at the default
  period, on close and at exit).

Each round starts (or resumes) both and kills each at a random moment: SIGKILL, SIGTERM (Ctrl-C's
path: checkpoint, close, flush), or SIGTERM then SIGKILL while it saves; now and then the newest
checkpoint is then cut short (as a kill while writing it would leave it), which ``--resume`` must
skip. After each round every
tree file must load and pass its checks, and every prefix (and every number of it) that was on
disk after an earlier round must still be there. At the end each run is resumed to its total,
its final model must hold that many steps (or up to 3 more: SB3 collects ``train_freq`` steps at a
time), no run may print a traceback, and every number stored in the trees is checked
against the models (one forward of each model per leaf path). Prints the figures; exits 1 if a
tree was damaged, a prefix lost, a number wrong or a run did not reach its total.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file: scripts/analysis/)
TRAIN_ARGS = ["--pair", "tiny-random", "--backend", "replay", "--max-new-tokens", "24", "--max-prompts", "16",
              "--checkpoint-freq", "200", "--eval-freq", "1000", "--eval-episodes", "2", "--hyperparams", "learning_starts=100",
              "batch_size=16", "--torch-threads", "1", "--no-progress-bar"]
RUNS = {"a": {"n_envs": 1, "short_flush": True}, "b": {"n_envs": 2, "short_flush": False}}
# run a: train.py's main with every store its envs make written every few seconds
WRAPPER = ("import sys\nfrom agents.commands import train_main as main\nfrom bild_env.replay import TreeStore, sharing\n"
           "with sharing(TreeStore(flush_seconds=float(sys.argv[1]))):\n    sys.exit(main(sys.argv[2:]))\n")
KILLS = ("SIGKILL", "SIGTERM", "SIGTERM+SIGKILL")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rounds", type=int, default=28, help="rounds of start-or-resume-then-kill (both runs each round)")
    p.add_argument("--steps", type=int, default=40_000, help="total env steps of each run")
    p.add_argument("--min-life", type=float, default=2.0, help="earliest kill, seconds after a start")
    p.add_argument("--max-life", type=float, default=18.0, help="latest kill, seconds after a start")
    p.add_argument("--flush-seconds", type=float, default=2.0, help="run a's store write period")
    p.add_argument("--damage-checkpoints", type=float, default=0.2,
                   help="chance, after each kill, of cutting the run's newest checkpoint file short (as a kill while "
                        "writing it would): --resume must skip it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", type=Path, default=None, help="BILD_ENV_CACHE of the runs (default: a new temp folder)")
    p.add_argument("--keep", action="store_true", help="keep the cache folder (logs, trees) afterwards")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# 1. runs
def command(name: str, run_dir: Path, steps: int, flush_seconds: float) -> list[str]:
    """Start run ``name``, or resume it from its newest readable checkpoint (a run without one starts again)."""
    from agents.bild.runs import checkpoints

    if (run_dir / "config.json").is_file() and checkpoints(run_dir):
        args = ["--resume", str(run_dir)]
    else:
        shutil.rmtree(run_dir, ignore_errors=True)  # killed before its first checkpoint: nothing to resume
        args = TRAIN_ARGS + ["--n-envs", str(RUNS[name]["n_envs"]), "--total-timesteps", str(steps),
                             "--log-dir", str(run_dir.parent), "--run-name", run_dir.name, "--seed", str(ord(name))]
    if RUNS[name]["short_flush"]:
        return [sys.executable, "-c", WRAPPER, str(flush_seconds), *args]
    return [sys.executable, "train.py", *args]


def finished(run_dir: Path, steps: int) -> bool:
    from agents.bild.runs import checkpoints

    found = checkpoints(run_dir)
    return (run_dir / "model.zip").is_file() and bool(found) and found[0].steps >= steps


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def kill(proc: subprocess.Popen, how: str, rng: random.Random) -> None:
    if how == "SIGKILL":
        proc.kill()
        return
    proc.terminate()
    if how == "SIGTERM+SIGKILL":  # while it saves its checkpoint and writes its trees
        time.sleep(rng.uniform(0.05, 0.8))
        proc.kill()
        return
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()


def play_round(names: list[str], dirs: dict[str, Path], args, env, rng: random.Random, figures: dict) -> None:
    """Start (or resume) each unfinished run, kill each at its random moment, wait for all to end."""
    procs, deadlines, modes = {}, {}, {}
    for name in names:
        cmd = command(name, dirs[name], args.steps, args.flush_seconds)
        procs[name] = start(cmd, env, dirs[name].parent / f"{name}.log")
        deadlines[name] = time.monotonic() + rng.uniform(args.min_life, args.max_life)
        modes[name] = rng.choice(KILLS)
    while procs:
        time.sleep(0.05)
        for name in list(procs):
            proc = procs[name]
            if proc.poll() is not None:
                figures["ended by themselves"] += 1
                del procs[name]
            elif time.monotonic() >= deadlines[name]:
                kill(proc, modes[name], rng)
                proc.wait()
                figures["runs killed"] += 1
                figures[modes[name]] += 1
                del procs[name]
                if rng.random() < args.damage_checkpoints:
                    figures["checkpoint files cut short"] += cut_newest_checkpoint(dirs[name], rng)


def cut_newest_checkpoint(run_dir: Path, rng: random.Random) -> bool:
    """Cut the newest checkpoint's model or replay buffer to a random length (when an older one remains)."""
    from agents.bild.runs import checkpoints

    found = checkpoints(run_dir)
    if len(found) < 2:
        return False
    path = rng.choice([found[0].model, found[0].replay_buffer])
    data = path.read_bytes()
    path.write_bytes(data[: rng.randrange(len(data))])
    return True


# ------------------------------------------------------------------------------------------------
# 2. trees
def snapshot(root: Path) -> tuple[dict[str, dict[tuple[int, ...], int]], list[str]]:
    """Every tree file under ``root``: its prefixes and the numbers each holds; and the files failing their checks."""
    from bild_env.replay.tree import PrefixTree, TreeFileError

    trees, damaged = {}, []
    for f in sorted(root.rglob("*.npz")):
        if f.name.endswith(".tmp.npz"):
            continue
        try:
            trees[str(f.relative_to(root))] = PrefixTree.load(f).prefixes()
        except TreeFileError as err:
            damaged.append(str(err))
    return trees, damaged


def lost(before: dict, after: dict) -> tuple[int, int]:
    """(prefixes on disk before and gone after, prefixes that lost a number)."""
    prefixes = numbers = 0
    for name, paths in before.items():
        now = after.get(name, {})
        for path, bits in paths.items():
            if path not in now:
                prefixes += 1
            elif bits & ~now[path]:
                numbers += 1
    return prefixes, numbers


def wrong_numbers(root: Path) -> tuple[int, int, int]:
    """Every stored number against the models, one forward of each model per leaf path: (checked, wrong, ties).

    A stored argmax that differs where the model's two best logits are within rounding is a tie, not wrong.
    """
    import torch

    from bild_env.models.pairs import load_pair
    from bild_env.paths import prompt_key
    from bild_env.prompts.sources import load_prompts
    from bild_env.replay.tree import PrefixTree

    torch.set_num_threads(1)
    pair = load_pair("tiny-random", device="cpu")
    prompts = {prompt_key(p): p for split in ("train", "validation", "test")
               for p in load_prompts(pair.tokenizer, "builtin", split, 32)}
    counts = [0, 0, 0]
    for f in sorted(root.rglob("*.npz")):
        if f.name.endswith(".tmp.npz") or f.stem not in prompts:
            continue
        tree = PrefixTree.load(f)
        paths = list(tree.prefixes())  # in node order
        inner = set(tree.parent[1:])
        done: set[int] = set()
        for leaf in (node for node in range(len(tree)) if node not in inner):
            _check_path(pair, tree, prompts[f.stem], paths[leaf], {p: i for i, p in enumerate(paths)}, done, counts)
    return counts[0], counts[1], counts[2]


def _check_path(pair, tree, prompt, path, index, done, counts) -> None:
    """Compare the numbers of every node along ``path`` with one forward of each model over prompt + path."""
    import torch
    from transformers import DynamicCache

    from bild_env.decoding.kv import Row, draft_readout, single_forward, target_readout
    from bild_env.replay.tree import MISSING

    tokens = prompt + list(path)
    with torch.inference_mode():
        zd = single_forward(pair.draft, Row(tokens, DynamicCache(config=pair.draft.config), len(path) + 1))
        zt = single_forward(pair.target, Row(tokens, DynamicCache(config=pair.target.config), len(path) + 1))
    d_arg, d_p = draft_readout(zd)
    for depth in range(len(path) + 1):
        node = index[path[:depth]]
        if node in done:
            continue
        done.add(node)
        checks = []
        if tree.d_arg[node] != MISSING:
            checks.append((tree.d_arg[node] != d_arg[depth] or abs(tree.d_p[node] - d_p[depth]) > 1e-3, zd[depth]))
        if tree.t_arg[node] != MISSING:
            t_arg, logp, top = target_readout(zt[depth : depth + 1], [max(tree.d_arg[node], 0)])
            bad = tree.t_arg[node] != t_arg[0]
            if tree.t_logp[node] == tree.t_logp[node]:  # known (not NaN)
                bad |= abs(tree.t_logp[node] - logp[0]) > 1e-3
            if tree.t_top[node] == tree.t_top[node]:
                bad |= abs(tree.t_top[node] - top[0]) > 1e-3
            checks.append((bad, zt[depth]))
        for bad, logits in checks:
            counts[0] += 1
            if bad:
                top2 = torch.topk(logits, 2).values
                counts[2 if top2[0] - top2[1] < 1e-3 else 1] += 1


# ------------------------------------------------------------------------------------------------
# 3. the whole test
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    cache = args.cache or Path(tempfile.mkdtemp(prefix="bild_chaos_"))
    logs, trees_root = cache / "logs", cache / "replay"
    logs.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"BILD_ENV_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                        "PYTHONUNBUFFERED": "1"}
    dirs = {name: logs / f"chaos-{name}" for name in RUNS}
    figures = dict.fromkeys(["runs killed", *KILLS, "ended by themselves", "checkpoint files cut short",
                             "checkpoints skipped on resume", "rounds", "trees checked", "checks",
                             "prefixes lost", "numbers lost", "damaged files", "files set aside", "runs at total"], 0)
    t0 = time.monotonic()
    print(f"chaos: cache {cache}; {args.rounds} rounds of two runs sharing it, {args.steps} steps each", flush=True)
    # the tiny pair, its cost model and references are built once, unkilled (they are not what is tested here)
    warm = ["--total-timesteps", "10", "--eval-freq", "0", "--run-name", "warm-up", "--log-dir", str(logs)]
    subprocess.run([sys.executable, "train.py", *TRAIN_ARGS, *warm], cwd=ROOT, env=env, capture_output=True, check=True)
    shutil.rmtree(trees_root, ignore_errors=True)
    union: dict[str, dict[tuple[int, ...], int]] = {}
    for r in range(args.rounds):
        names = [n for n in RUNS if not finished(dirs[n], args.steps)]
        if not names:
            break
        play_round(names, dirs, args, env, rng, figures)
        figures["rounds"] += 1
        now, damaged = snapshot(trees_root)
        figures["checks"] += 1
        figures["damaged files"] += len(damaged)
        for line in damaged:
            print(f"  damaged: {line}", flush=True)
        gone, numbers = lost(union, now)
        figures["prefixes lost"] += gone
        figures["numbers lost"] += numbers
        for name, paths in now.items():  # what has reached disk so far
            union.setdefault(name, {}).update({p: union.get(name, {}).get(p, 0) | b for p, b in paths.items()})
        print(f"round {r + 1}: {figures['runs killed']} kills so far, {len(now)} trees, "
              f"{sum(len(t) for t in now.values())} prefixes on disk, lost {gone}, "
              f"{time.monotonic() - t0:.0f} s", flush=True)
    # every run resumed to its total, unkilled
    for name in RUNS:
        for _ in range(3):
            if finished(dirs[name], args.steps):
                break
            out = subprocess.run(command(name, dirs[name], args.steps, args.flush_seconds), cwd=ROOT, env=env,
                                 capture_output=True, text=True)
            with open(logs / f"{name}.log", "a") as f:
                f.write(out.stdout + out.stderr)
        steps = final_steps(dirs[name])
        figures["runs at total"] += steps >= args.steps  # SB3 collects train_freq steps at a time: up to 3 more
        figures[f"final steps of run {name}"] = steps
    final, damaged = snapshot(trees_root)
    gone, numbers = lost(union, final)
    figures["prefixes lost"] += gone
    figures["numbers lost"] += numbers
    figures["damaged files"] += len(damaged)
    figures["trees checked"] = len(final)
    figures["files set aside"] = len(list(trees_root.rglob("*.bad-*")))
    figures["checkpoints skipped on resume"] = sum((logs / f"{name}.log").read_text().count("skipping a checkpoint")
                                                   for name in RUNS)
    figures["tracebacks in the runs' output"] = sum((logs / f"{name}.log").read_text().count("Traceback")
                                                    for name in RUNS)
    checked, wrong, ties = wrong_numbers(trees_root)
    figures |= {"numbers checked against the models": checked, "wrong numbers": wrong, "argmax ties": ties,
                "prefixes on disk": sum(len(t) for t in final.values()), "seconds": round(time.monotonic() - t0)}
    for key, value in figures.items():
        print(f"{key:>36}: {value}")
    ok = (figures["prefixes lost"] == figures["numbers lost"] == figures["damaged files"] == wrong == 0
          and figures["tracebacks in the runs' output"] == 0 and figures["runs at total"] == len(RUNS))
    print("chaos: OK" if ok else f"chaos: FAILED (logs in {logs})")
    if not args.keep and ok:
        shutil.rmtree(cache, ignore_errors=True)
    return 0 if ok else 1


def final_steps(run_dir: Path) -> int:
    """The step count of the run's final model (0 if it has none or it cannot be read)."""
    from stable_baselines3 import DQN

    try:
        return DQN.load(run_dir / "model.zip", device="cpu").num_timesteps
    except Exception:  # a missing or unreadable model counts as not finished
        return 0


if __name__ == "__main__":
    sys.exit(main())
