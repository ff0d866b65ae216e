"""The cluster extra (``pip install -e ".[cluster]"``) on a local Ray instance of 2 CPUs: the replay fill as Ray tasks
(equal to the serial fill node for node; a worker killed mid-task loses nothing written and its prompts are retried),
train.py's seeds under Ray Tune with a summary over seeds, and RLlib's PPO on BiLD-Serve-v0.

Skipped, saying why, where Ray is not installed. One Ray instance serves the whole module (started once, shut down at
the end); everything runs on tiny-random.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason='the cluster tests need Ray: pip install -e ".[cluster]"')

from bild_env.fill import FillConfig, fill_serial  # noqa: E402
from bild_env.fill.cluster import fill_on_ray  # noqa: E402
from bild_env.replay.tree import ARRAYS, FLOAT_TOLERANCE, PrefixTree  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FILL = FillConfig(pair="tiny-random", prompts=6, max_new_tokens=12, device="cpu", actions=(0, 12, 24), group=3)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One local Ray instance of 2 CPUs (2 workers) for the module."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def serial_trees(tmp_path_factory) -> Path:
    """The serial fill's store folder (a cache of its own)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BILD_ENV_CACHE", str(tmp_path_factory.mktemp("serial_cache")))
        return Path(fill_serial(FILL)[0].folder)


def tree_differences(a: Path, b: Path) -> list[str]:
    """How the trees in store folder ``a`` differ from those in ``b`` ([] when equal node for node): nodes matched by
    their token path, argmaxes equal, probabilities and log-probabilities to ``FLOAT_TOLERANCE`` (a fill from another
    KV-cache start differs in float rounding only)."""
    trees = [{p.name: PrefixTree.load(p) for p in folder.glob("*.npz") if not p.name.endswith(".tmp.npz")}
             for folder in (a, b)]
    problems = [f"{name}: in one folder only" for name in sorted(trees[0].keys() ^ trees[1].keys())]
    for name in sorted(trees[0].keys() & trees[1].keys()):
        x, y = trees[0][name], trees[1][name]
        nodes_x, nodes_y = ({path: i for i, path in enumerate(t.prefixes())} for t in (x, y))
        if nodes_x.keys() != nodes_y.keys():
            problems.append(f"{name}: other prefixes")
            continue
        i, j = list(nodes_x.values()), [nodes_y[path] for path in nodes_x]
        problems += [f"{name}: {k} differs" for k in ARRAYS[2:] if not np.allclose(
            np.asarray(getattr(x, k))[i], np.asarray(getattr(y, k))[j], rtol=0, atol=FLOAT_TOLERANCE, equal_nan=True)]
    return problems


def test_ray_fill_equals_serial_fill(serial_trees, tmp_path, monkeypatch):
    monkeypatch.setenv("BILD_ENV_CACHE", str(tmp_path))  # the driver's cache: handed to every task
    results = fill_on_ray(FILL, FILL.prompts)
    assert [r.prompts for r in results] == [[0, 1, 2], [3, 4, 5]]
    assert {r.folder for r in results} == {str(tmp_path / serial_trees.relative_to(serial_trees.parents[1]))}
    assert len(list(serial_trees.glob("*.npz"))) == FILL.prompts
    assert tree_differences(serial_trees, Path(results[0].folder)) == []


def test_killed_worker_loses_nothing_written_and_its_prompts_are_retried(serial_trees, tmp_path, monkeypatch):
    monkeypatch.setenv("BILD_ENV_CACHE", str(tmp_path))
    folder = tmp_path / serial_trees.relative_to(serial_trees.parents[1])
    killed: dict = {}
    watcher = threading.Thread(target=_kill_a_filling_worker, args=(folder, killed), daemon=True)
    watcher.start()
    results = fill_on_ray(FILL, FILL.prompts)
    watcher.join(timeout=5)
    assert killed.get("pid"), f"no worker was killed mid-task: {killed}"
    # every prefix on disk when the worker died is there at the end, and the fill equals the serial one
    for name, paths in killed["on_disk"].items():
        assert paths <= PrefixTree.load(folder / name).prefixes().keys(), f"{name} lost prefixes"
    assert tree_differences(serial_trees, folder) == []
    assert killed["pid"] not in {r.pid for r in results}, "the killed worker's task was not run again elsewhere"


def _kill_a_filling_worker(folder: Path, killed: dict, timeout: float = 120.0) -> None:
    """Once a first prompt's tree is on disk, SIGKILL a Ray worker running a fill task (its process title says
    ``ray::bild_fill``) and note what was on disk then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if folder.is_dir() and any(not p.name.endswith(".tmp.npz") for p in folder.glob("*.npz")):
            pids = _processes_titled("ray::bild_fill")
            if pids:
                os.kill(pids[0], signal.SIGKILL)
                killed["pid"] = pids[0]
                killed["on_disk"] = {p.name: PrefixTree.load(p).prefixes().keys() for p in folder.glob("*.npz")
                                     if not p.name.endswith(".tmp.npz")}
                return
        time.sleep(0.05)
    killed["timeout"] = True


def _processes_titled(title: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(title.encode()):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def test_fill_command_refuses_bad_options_and_documents_ray():
    out = subprocess.run([sys.executable, "-m", "bild_env.fill", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "--ray [ADDRESS]" in out.stdout and "--gpus-per-task" in out.stdout
    out = subprocess.run([sys.executable, "-m", "bild_env.fill", "--prompts", "0"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "--prompts must be at least 1" in out.stderr



# ------------------------------------------------------------------------------------------------
# the core stays free of Ray
def test_the_core_and_the_readme_commands_never_import_ray_and_the_extra_says_what_to_install():
    core = ("import sys, bild_env, bild_env.env, bild_env.fill, bild_env.serving.env, agents, agents.bild.training, "
            "agents.serve.training, agents.tune, agents.rllib_serve\n"
            "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ray'))")
    out = subprocess.run([sys.executable, "-c", core], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    without_ray = ("import sys\nsys.modules['ray'] = None  # as if Ray were not installed\n"
                   "from bild_env.fill.cluster import import_ray\n"
                   "try:\n    import_ray()\nexcept ImportError as err:\n    print(err)\n")
    out = subprocess.run([sys.executable, "-c", without_ray], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert 'pip install -e ".[cluster]"' in out.stdout, out.stderr

# ------------------------------------------------------------------------------------------------
# 2. seeds under Ray Tune
TINY_RUN = ["--pair", "tiny-random", "--max-new-tokens", "8", "--torch-threads", "1", "--no-progress-bar",
            "--total-timesteps", "60", "--n-envs", "2", "--eval-freq", "30", "--eval-episodes", "2",
            "--hyperparams", "learning_starts=20", "--checkpoint-freq", "30", "--hyperparams", "batch_size=8", "--max-prompts", "4"]


def test_three_seeds_as_one_tune_call_with_a_summary_over_seeds_then_resumed(tmp_path):
    from agents.tune import SweepConfig, Trial, main, parse_args, run_trial, serving, trial_argv

    logs = tmp_path / "logs"
    argv = ["--seeds", "0", "1", "2", "--name", "tiny", "--log-dir", str(logs), "--storage", str(tmp_path / "tune"),
            "--", *TINY_RUN]
    cfg, train_args = parse_args(argv)
    assert cfg == SweepConfig(seeds=(0, 1, 2), name="tiny", log_dir=str(logs), storage=str(tmp_path / "tune"))
    assert train_args == TINY_RUN
    assert main(argv) == 0
    summary = json.loads((logs / "tiny.tune.json").read_text())
    assert summary["trials"] == 3 and summary["failed"] == []
    (row,) = summary["configs"]
    assert row["seeds"] == [0, 1, 2]
    final = row["eval_return_final"]
    assert len(final["per_seed"]) == 3 and all(math.isfinite(v) for v in final["per_seed"])
    assert final["ci95"][0] <= final["mean"] <= final["ci95"][1]
    for seed in (0, 1, 2):  # each trial is a normal run folder of train.py, finished, its lock released
        run_dir = logs / f"tiny__default__{seed}"
        saved = json.loads((run_dir / "config.json").read_text())
        assert saved["run"]["seed"] == seed and (run_dir / "model.zip").is_file() and not serving(run_dir)
        assert list(run_dir.glob("events.out.tfevents.*")) and not (run_dir / "train.lock").exists()
    # asked for more steps, a finished trial goes on from its newest checkpoint with train.py --resume
    trial, longer = Trial((), 0, logs / "tiny__default__0"), [*TINY_RUN, "--total-timesteps", "90"]
    assert trial_argv(longer, trial) == ["--resume", str(trial.run_dir), "--total-timesteps", "90"]
    metrics = run_trial(longer, trial, tmp_path / "train.log")
    assert "resuming at step 6" in (tmp_path / "train.log").read_text()  # its checkpoint at 60 (or 62: 2 envs)
    assert metrics["eval_step_final"] >= 90 and math.isfinite(metrics["eval_return_final"])
    assert run_trial(longer, trial, tmp_path / "again.log") == metrics and not (tmp_path / "again.log").exists()


# the serving trainer (train.py --env serve) under Ray Tune: its own run folders, resume and validation metric
SERVE_RUN = ["--env", "serve", "--pair", "tiny-random", "--total-timesteps", "120", "--n-envs", "2", "--eval-freq",
             "60", "--eval-episodes", "2", "--max-new-tokens", "8", "--max-batch", "4", "--episode-steps", "12",
             "--hyperparams", "learning_starts=20", "batch_size=16", "--load", "constant:0.5", "--mix", "prose:1,code:1",
             "--max-prompts", "4", "--checkpoint-freq", "60", "--no-progress-bar"]


@pytest.fixture
def fixed_serving_costs(monkeypatch, tmp_path):
    """tiny-random's cost model and batched tables stored as if timed on this machine (the hand-made toy ones of
    tests/test_serving.py), so that the trials' train.py processes time nothing: in a cache of the test's own, which
    no other test reads."""
    import bild_env.decoding.costs as costs
    from bild_env import load_pair
    from tests.test_serving import toy_batch_costs

    cache = tmp_path / "cache"  # the trials build the tiny models there again (seconds; the same cost key)
    monkeypatch.setenv("BILD_ENV_CACHE", str(cache))
    monkeypatch.setattr(costs, "_LOADED", {})
    toy = toy_batch_costs()
    monkeypatch.setattr(costs, "calibrate", lambda pair, **_: replace(toy, batched=None))
    monkeypatch.setattr(costs, "calibrate_batched", lambda pair, sizes, **_: toy.batched)
    costs.load_or_calibrate_batched(load_pair("tiny-random", device="cpu"))


def test_seeds_of_a_serving_run_as_one_tune_call_with_its_validation_metric_then_resumed(tmp_path,
                                                                                        fixed_serving_costs):
    from agents.tune import Trial, main, run_trial, serving, trial_argv

    logs = tmp_path / "logs"
    argv = ["--seeds", "0", "1", "--name", "serve", "--log-dir", str(logs), "--storage", str(tmp_path / "tune"),
            "--", *SERVE_RUN]
    assert main(argv) == 0
    summary = json.loads((logs / "serve.tune.json").read_text())
    assert summary["trials"] == 2 and summary["failed"] == []
    (row,) = summary["configs"]
    for seed in (0, 1):  # each trial is a normal serving run folder, finished, its lock released
        run_dir = logs / f"serve__default__{seed}"
        saved = json.loads((run_dir / "config.json").read_text())
        assert saved["env_id"] == "BiLD-Serve-v0" and saved["run"]["seed"] == seed and serving(run_dir)
        history = json.loads((run_dir / "evaluations.json").read_text())
        assert [h["step"] for h in history] == [60, 120] and not (run_dir / "train.lock").exists()
        assert row["eval_return_final"]["per_seed"][seed] == history[-1]["return"]
        assert row["eval_speedup_final"]["per_seed"][seed] == history[-1]["speedup"]
    for metric in ("eval_return_final", "eval_return_best", "eval_speedup_final", "eval_speedup_at_best"):
        assert row[metric]["ci95"][0] <= row[metric]["mean"] <= row[metric]["ci95"][1]
    assert {"off", "best_fixed", "load_table"} <= row["references"].keys()  # the fixed policies on the same episodes
    # asked for more steps, a finished trial goes on with the serving trainer's own resume
    trial, longer = Trial((), 0, logs / "serve__default__0"), [*SERVE_RUN, "--total-timesteps", "180"]
    assert trial_argv(longer, trial) == ["--resume", str(trial.run_dir), "--total-timesteps", "180"]  # by its spec
    metrics = run_trial(longer, trial, tmp_path / "train.log")
    assert "resuming at step 120: " in (tmp_path / "train.log").read_text()
    assert metrics["eval_step_final"] == 180 and math.isfinite(metrics["eval_return_final"])
    assert run_trial(longer, trial, tmp_path / "again.log") == metrics and not (tmp_path / "again.log").exists()


def test_tune_refuses_options_it_sets_itself():
    from agents.tune import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--seeds", "0", "--", "--seed", "3"])
    with pytest.raises(SystemExit):
        parse_args(["--grid", "learning-rate"])


# ------------------------------------------------------------------------------------------------
# 3. RLlib's PPO on BiLD-Serve-v0
def test_rllib_ppo_trains_on_the_serving_env_with_two_env_runners(tmp_path):
    from agents.rllib_serve import RLlibConfig, parse_args, train
    from bild_env.decoding.costs import BatchCost, CostModel

    cfg, env_kwargs = parse_args(["--env-runners", "2", "--pair", "tiny-random", "--episode-steps", "8"])
    assert cfg.env_runners == 2 and env_kwargs == {"pair": "tiny-random", "episode_steps": 8}
    from dataclasses import replace

    from agents.rllib_serve import env_config
    from agents.spec import preset_env

    assert env_config(env_kwargs) == replace(preset_env("serve"), pair="tiny-random", episode_steps=8)  # main's env
    table = {(b, n): 4.0 + 0.5 * n * b ** 0.7 + 0.2 * b for b in (1, 2, 4) for n in range(1, 9)}
    costs = CostModel(draft=(1.0, 0.1, 0.001), target=(4.0, 0.5, 0.004), device="test",  # fixed: no timing
                      batched={"draft": BatchCost.from_table({k: v / 4 for k, v in table.items()}, ref_context=64,
                                                             per_context_ms=0.001),
                               "target": BatchCost.from_table(table, ref_context=64, per_context_ms=0.004)})
    env_kwargs |= {"pair_options": {"device": "cpu"}, "max_new_tokens": 8, "max_batch": 4, "cost_model": costs}
    cfg = RLlibConfig(iterations=2, train_batch=32, minibatch=16, epochs=1, log_dir=str(tmp_path), run_name="ppo",
                      eval_every=2, eval_episodes=1)
    report = train(cfg, env_kwargs)
    returns = report["episode_return_mean"]
    assert len(returns) == 2 and math.isfinite(returns[-1])
    # the greedy policy on train.py --env serve's validation episodes, after the second iteration
    (row,) = report["evaluations"]
    assert row["iteration"] == 2 and row["step"] >= 64 and math.isfinite(row["return"]) and row["speedup"] > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "ppo"))
    events.Reload()
    logged = events.Scalars("env_runners/episode_return_mean")
    assert logged and math.isfinite(logged[-1].value)
    assert [e.value for e in events.Scalars("eval/mean_reward")] == pytest.approx([row["return"]])
    assert (tmp_path / "ppo" / "checkpoint").is_dir()
    from agents.config import ConfigError
    from agents.serve.options import saved_configs
    from agents.spec import RunSpec

    spec = RunSpec.load(tmp_path / "ppo")  # the run's config.json, in train.py's format
    assert (spec.env_id, spec.algo, spec.hyperparams["train_batch"], spec.run["iterations"]) == (
        "BiLD-Serve-v0", "rllib-ppo", 32, 2)
    assert spec.env["pair"] == "tiny-random" and spec.env["episode_steps"] == 8 and "cost_model" not in spec.env
    with pytest.raises(ConfigError, match="is a run of rllib-ppo .*not of train.py's DQN"):
        saved_configs(tmp_path / "ppo")
