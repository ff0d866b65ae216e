"""Env steps per second: live vs replay cold vs replay warm, side by side in one run.

    python -m scripts.analysis.replay --pair tiny-random --episodes 40
    python -m scripts.analysis.replay --pair smollm2 --train-steps 5000    # also: a whole training run, live vs replay

All three run the same prompts with seeded random actions in a private cache folder. The BLEU
references (target greedy continuations, which every backend needs) are computed first and not
timed. "replay cold" starts with empty trees (fills and warm starts are timed); "replay warm" runs
new random actions on the same prompts over the trees the cold pass left; "replay warm, same
actions" repeats the cold pass exactly (pure lookups). Latency is the cost model throughout, so
all backends produce identical episodes for identical actions; the script checks that.

"replay cold, N envs batched" steps ``--n-envs`` replay envs together from empty trees
(``BatchedReplayVecEnv``: shared trees, misses of all envs run as one batched forward per model)
for as many steps as the live pass, with seeded random actions and prompts.

With ``--train-steps N`` it also times whole ``train.py`` runs of N steps with the default
config of ``agents.config`` (its ``n_envs`` training envs; same seed, same calibrated cost model,
so the same trajectory), one per backend, each starting with no BLEU references and no replay
trees on disk.
"""

from __future__ import annotations

import sys

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from stable_baselines3.common.env_util import make_vec_env
from tqdm import tqdm

from bild_env.cli import parse_dataclass, setup_logging
from bild_env.models.pairs import DEFAULT_PAIR

from agents.vec import BatchedReplayVecEnv


@dataclass
class ReplayBenchConfig:
    pair: str = field(default=DEFAULT_PAIR, metadata={"help": "model pair preset"})
    episodes: int = 40
    max_new_tokens: int = 64
    prompts: int = field(default=10, metadata={"help": "distinct prompts (episodes cycle over them)"})
    threads: int = 1
    device: str = "cpu"
    train_steps: int = field(default=0, metadata={"help": (
        "also time whole training runs of this many steps, live vs replay (0: skip)")})
    warm_runs: int = field(default=1, metadata={"help": (
        "with --train-steps: then this many replay runs with the next seeds, on the trees left on disk")})
    n_envs: int = field(default=8, metadata={"help": (
        "also: this many replay envs stepped together from empty trees, misses batched (1: skip)")})
    out: str = ""


def run_episodes(env, episodes: int, prompts: int, seed: int, desc: str) -> tuple[int, float, list]:
    rng = np.random.default_rng(seed)
    steps, trace = 0, []
    t0 = time.perf_counter()
    for ep in tqdm(range(episodes), desc=desc, leave=False):
        env.reset(options={"prompt_index": ep % prompts})
        done = False
        while not done:
            _, r, term, trunc, _ = env.step(int(rng.integers(env.action_space.n)))
            trace.append(r)
            steps += 1
            done = term or trunc
    return steps, time.perf_counter() - t0, trace


def main(argv: list[str] | None = None) -> dict:
    setup_logging()
    cfg = parse_dataclass(ReplayBenchConfig, argv, __doc__)
    torch.set_num_threads(cfg.threads)
    os.environ["BILD_ENV_CACHE"] = tempfile.mkdtemp(prefix="bild_replay_bench_")
    from bild_env.env import BildEnv

    kw = dict(pair=cfg.pair, pair_options={"device": cfg.device}, max_new_tokens=cfg.max_new_tokens, max_prompts=cfg.prompts, latency="model")
    live = BildEnv(**kw)
    for i in tqdm(range(len(live.prompts)), desc="references (untimed)", leave=False):
        live.references.get(live.prompts[i])
    replay = BildEnv(backend="replay", cost_model=live.cost_model, **kw)
    n_prompts = len(live.prompts)
    rows = {}
    s, t, live_trace = run_episodes(live, cfg.episodes, n_prompts, 0, "live")
    rows["live"] = (s, t)
    s, t, cold_trace = run_episodes(replay, cfg.episodes, n_prompts, 0, "replay cold")
    rows["replay cold"] = (s, t)
    assert cold_trace == live_trace, "replay and live disagree"
    cold_report = replay.runner.store.report()
    s, t, _ = run_episodes(replay, cfg.episodes, n_prompts, 1, "replay warm")
    rows["replay warm (new actions)"] = (s, t)
    s, t, again = run_episodes(replay, cfg.episodes, n_prompts, 0, "replay warm same")
    rows["replay warm (same actions)"] = (s, t)
    assert again == live_trace
    report = replay.runner.store.report()
    batched = {}
    if cfg.n_envs > 1:  # the same number of steps, random actions and prompts, n_envs envs at once from empty trees
        import shutil

        from bild_env.paths import cache_dir

        shutil.rmtree(cache_dir("replay"), ignore_errors=True)
        vec = make_vec_env("bild_env:BiLD-v0", n_envs=cfg.n_envs, seed=0, vec_env_cls=BatchedReplayVecEnv,
                           env_kwargs=kw | {"render_mode": None, "backend": "replay", "cost_model": live.cost_model})
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        vec.reset()
        steps = 0
        with tqdm(total=rows["live"][0], desc=f"replay cold, {cfg.n_envs} envs", leave=False) as bar:
            while steps < rows["live"][0]:
                vec.step(rng.integers(vec.action_space.n, size=cfg.n_envs))
                steps += cfg.n_envs
                bar.update(cfg.n_envs)
        rows[f"replay cold, {cfg.n_envs} envs batched"] = (steps, time.perf_counter() - t0)
        batched = vec.envs[0].unwrapped.runner.store.report() | {"batch_sizes": dict(sorted(vec.batcher.batch_sizes.items()))}
        vec.close()
    live_rate = rows["live"][0] / rows["live"][1]
    print(f"pair {cfg.pair}, {cfg.episodes} episodes x {cfg.max_new_tokens} tokens over {n_prompts} prompts, "
          f"{cfg.device}, {cfg.threads} thread(s)")
    print("| backend | steps | seconds | steps/s | vs live |\n|---|---|---|---|---|")
    for name, (s, t) in rows.items():
        print(f"| {name} | {s} | {t:.2f} | {s / t:.0f} | {s / t / live_rate:.1f}x |")
    print(f"tree after the cold pass: {cold_report['nodes']} prefixes, {cold_report['misses']} misses filled by "
          f"{cold_report['fills']} forwards")
    print(f"tree at the end: {report['nodes']} prefixes in {report['trees_in_memory']} prompt trees, "
          f"{report['bytes'] / 1e6:.2f} MB, {report['bytes_per_prefix']:.0f} bytes per prefix; "
          f"hits {report['hits']}, misses {report['misses']}")
    if batched:
        print(f"{cfg.n_envs} envs batched: {batched['misses']} misses filled by {batched['fills']} forwards of "
              f"{batched['fill_rows']} rows ({batched['fill_rows'] / max(1, batched['fills']):.1f} rows per forward)")
    result = {"config": asdict(cfg), "rows": {k: {"steps": s, "seconds": t} for k, (s, t) in rows.items()},
              "cold": cold_report, "final": report, "batched": batched}
    if cfg.train_steps:
        result["training"] = compare_training(cfg)
    if cfg.out:
        with open(cfg.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


def compare_training(cfg: ReplayBenchConfig) -> dict:
    """Whole training runs (default config, ``train_steps`` steps), timed: live, then replay from empty
    trees, then ``warm_runs`` replay runs with the next seeds over the trees the earlier runs left on
    disk (what a seed sweep or a second experiment on the same prompts costs)."""
    import shutil
    from dataclasses import replace
    from pathlib import Path

    from agents.config import RunConfig
    from agents.bild.training import BildRoom
    from agents.training import train
    from bild_env.paths import cache_dir

    logs = Path(tempfile.mkdtemp(prefix="bild_replay_bench_logs_"))
    base = RunConfig()
    out = {}
    runs = [("live", "live", 0), ("replay", "replay", 0)]
    runs += [(f"replay warm (seed {i})", "replay", i) for i in range(1, cfg.warm_runs + 1)]
    for name, backend, seed in runs:
        if seed == 0:  # the first run of each backend starts without references or trees
            for folder in ("references", "replay"):
                shutil.rmtree(cache_dir(folder), ignore_errors=True)
        run_name = name.replace(" ", "_").replace("(", "").replace(")", "")
        config = RunConfig(
            train=replace(base.train, total_timesteps=cfg.train_steps, log_dir=str(logs), run_name=run_name,
                          seed=base.train.seed + seed, progress_bar=False, torch_threads=cfg.threads),
            dqn=base.dqn,
            env=replace(base.env, pair=cfg.pair, pair_options={"device": cfg.device}, backend=backend),
        )
        t0 = time.perf_counter()
        result = train(BildRoom(config))
        out[name] = {"seconds": time.perf_counter() - t0, "steps": result.steps}
        if backend == "replay":
            trees = sorted(cache_dir("replay").rglob("*.npz"))
            out[name]["tree_files"] = len(trees)
            out[name]["tree_bytes_on_disk"] = sum(p.stat().st_size for p in trees)
            report = logs / run_name / "replay_report.json"
            if report.is_file():
                out[name]["replay_report"] = json.loads(report.read_text())
        print(f"{name}: {out[name]['seconds']:.1f} s", flush=True)
    live, rep = out["live"]["seconds"], out["replay"]["seconds"]
    print(f"\nwhole training run, {cfg.train_steps} steps, default config, pair {cfg.pair}:")
    print("| backend | seconds | steps/s | vs live |\n|---|---|---|---|")
    for name, row in out.items():
        print(f"| {name} | {row['seconds']:.1f} | {row['steps'] / row['seconds']:.1f} | {live / row['seconds']:.1f}x |")
    print(f"replay is {live / rep:.1f}x faster; its trees on disk: {out['replay']['tree_files']} prompt files, "
          f"{out['replay']['tree_bytes_on_disk'] / 1e6:.2f} MB")
    return out


if __name__ == "__main__":
    from bild_env.command import run_command

    sys.exit(run_command("python -m scripts.analysis.replay", main))
