"""evaluate.py on tiny-random with a just-trained tiny DQN: files, exactness of the exact methods, same prompts."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import gymnasium
import pytest

from agents import RunConfig, make_dqn
from agents.config import DQNConfig
from bild_env.env import EnvConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_pair):
    run = tmp_path_factory.mktemp("logs") / "tiny-run"
    run.mkdir()
    env_config = EnvConfig(pair="tiny-random", pair_options={"device": "cpu"}, max_new_tokens=12)
    env = gymnasium.make("bild_env:BiLD-v0", **{k: getattr(env_config, k) for k in ("pair", "pair_options",
                                                                                   "max_new_tokens")})
    model = make_dqn(env, DQNConfig(learning_starts=20, buffer_size=500, target_update_interval=20), seed=0)
    model.learn(total_timesteps=60)
    model.save(run / "model.zip")
    RunConfig(env=env_config).save(run / "config.json")
    return run


def test_evaluate_writes_everything_and_exact_methods_are_exact(trained_run, tmp_path):
    from agents.bild.comparison import Comparison, EvalConfig
    from agents.evaluation import evaluate

    out = tmp_path / "out"
    report = evaluate(Comparison(EvalConfig(model=str(trained_run), num_prompts=3, grid_prompts=2, threshold_runs=4, out=str(out),
                                 progress_bar=False)))
    for name in ("results.md", "results.json", "results.csv", "per_prompt.csv", "grid.json", "thresholds.png",
                 "latency.png", "plane.png"):
        assert (out / name).stat().st_size > 0, name
    results = report["results"]
    # naive SD's k: the fastest of K_CHOICES on the grid prompts under the cost model
    from agents.bild.methods import K_CHOICES

    chosen = json.loads((out / "naive_sd_k.json").read_text())
    times = {int(k): v for k, v in chosen["cost_model_ms_per_token"].items()}
    assert sorted(times) == sorted(K_CHOICES) and chosen["chosen"] == min(times, key=times.get)
    naive = f"naive SD (k={chosen['chosen']})"
    adaptive = "naive SD (k<=8, stop<0.5)"  # the adaptive length's default row
    assert set(results) >= {"single model", naive, adaptive, "HF assisted", "BiLD fixed (0.103/4.697)", "BiLD + DQN"}
    for exact in ("single model", naive, adaptive, "HF assisted"):
        assert results[exact]["bleu"] == pytest.approx(100.0) and results[exact]["exact_match"] == 1.0, exact
    assert results["single model"]["speedup"] == 1.0
    assert results[naive]["acceptance_rate"] is not None and results["BiLD + DQN"]["mean_reward"] is not None
    # every method saw the same prompts, in the same order
    seen = defaultdict(list)
    with open(out / "per_prompt.csv") as f:
        for row in csv.DictReader(f):
            seen[row["method"]].append(int(row["prompt_index"]))
    assert len(seen) == len(results) and all(v == [0, 1, 2] for v in seen.values())
    assert len(report["dqn_thresholds"]) == 4
    saved = json.loads((out / "results.json").read_text())["cost_model"]
    assert saved["format"] == 3 and saved["device"].startswith("cpu")
    assert all({1, 2, 4, 8, 12} <= set(saved[role]["fed"]) and len(saved[role]["ms"]) == len(saved[role]["fed"])
               for role in ("draft", "target"))  # a measured table per model, timed at least at the coarse counts
    paper = json.loads((out / "grid.json").read_text())["table"][4]  # BiLD-v1's grid: the paper's pair is action 4
    assert (paper["fallback"], paper["rollback"]) == (0.103, 4.697)
    assert "| BiLD + DQN |" in (out / "results.md").read_text()
    from bild_env.models.device import machine_description

    assert json.loads((out / "results.json").read_text())["machine"] == machine_description("cpu")
    assert f"on {machine_description('cpu')} (" in (out / "results.md").read_text()  # the CPU named, not "unknown"


def test_a_model_for_other_spaces_is_refused(tmp_path, tiny_pair):
    from stable_baselines3 import DQN

    from agents.bild.comparison import Comparison, EvalConfig
    from agents.evaluation import evaluate

    other = DQN("MlpPolicy", gymnasium.make("CartPole-v1"), learning_starts=0)
    other.save(tmp_path / "cartpole.zip")
    with pytest.raises(SystemExit, match=r"trained for observation space Box.*\(4,\).*this env has"):
        evaluate(Comparison(EvalConfig(model=str(tmp_path / "cartpole.zip"), env={"pair": "tiny-random", "pair_options": {
            "device": "cpu"}}, num_prompts=1, grid_prompts=1, threshold_runs=0, out=str(tmp_path / "o"),
                            progress_bar=False)))


def test_bad_options_fail_clearly(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "evaluate.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300)

    out = run("--help")
    assert out.returncode == 0 and "--num-prompts" in out.stdout and "--extra-model" in out.stdout
    out = run("--model", str(tmp_path / "missing.zip"), "--pair", "tiny-random")
    assert out.returncode != 0 and "no model file at" in out.stderr and "Traceback" not in out.stderr
    out = run("--pair", "nope")
    assert out.returncode != 0 and "unknown --pair 'nope'" in out.stderr and "Traceback" not in out.stderr
    out = run("--log-dir", str(tmp_path), "--pair", "tiny-random")
    assert out.returncode != 0 and "train one first" in out.stderr
    out = run("--dtype", "bfloat16")  # the env's arguments are the env's options, as on train.py
    assert out.returncode == 2 and "--dtype is now a key of --pair-options: give --pair-options dtype=VALUE" in out.stderr
    out = run("--pair-options", "colour=red")
    assert out.returncode == 2 and "colour" in out.stderr and "Traceback" not in out.stderr
    damaged = tmp_path / "damaged-run"
    damaged.mkdir()
    (damaged / "model.zip").write_bytes(b"")
    (damaged / "config.json").write_text('{"train": {"algo": ')  # cut short
    out = run("--model", str(damaged))
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert f"{damaged / 'config.json'} cannot be read (JSONDecodeError" in out.stderr
    (tmp_path / "a-file").write_text("")
    out = run("--model", str(damaged / "model.zip"), "--out", str(tmp_path / "a-file"))
    assert out.returncode != 0 and "--out" in out.stderr and "is a file" in out.stderr and "Traceback" not in out.stderr


def test_an_agent_of_the_continuous_action_is_compared_with_the_grid_baselines(tmp_path, tiny_pair, trained_run):
    from stable_baselines3 import PPO

    from agents.config import TrainConfig
    from agents.bild.comparison import Comparison, EvalConfig
    from agents.evaluation import evaluate

    run = tmp_path / "ppo-run"
    run.mkdir()
    env_config = EnvConfig(pair="tiny-random", pair_options={"device": "cpu"}, max_new_tokens=8, actions={"space": "continuous"})
    env = gymnasium.make("bild_env:BiLD-v0", **{k: getattr(env_config, k) for k in ("pair", "pair_options",
                                                                                   "max_new_tokens")},
                         actions={"space": "continuous"})
    model = PPO("MlpPolicy", env, n_steps=16, batch_size=16, n_epochs=1, seed=0)
    model.learn(total_timesteps=16)
    model.save(run / "model.zip")
    RunConfig(train=TrainConfig(algo="ppo"), env=env_config).save(run / "config.json")
    report = evaluate(Comparison(EvalConfig(model=str(run), extra_model=(str(trained_run),), num_prompts=2, grid_prompts=1,
                                 threshold_runs=2, out=str(tmp_path / "o"), progress_bar=False)))
    results = report["results"]
    assert {"BiLD fixed (0.103/4.697)", "BiLD + PPO", f"BiLD + model ({trained_run.name})"} <= set(results)  # named by its algorithm
    assert results[f"BiLD + model ({trained_run.name})"]["mean_reward"] is not None  # the discrete DQN beside it
    assert all(0.103 - 1e-6 <= f <= 0.6 + 1e-6 and 0.5 - 1e-6 <= r <= 4.697 + 1e-6
               for run_thresholds in report["dqn_thresholds"] for f, r in run_thresholds)  # the Box mapped onto the grid's span


def test_a_malformed_adaptive_row_is_refused_before_anything_loads(tmp_path):
    from agents.bild.comparison import Comparison, EvalConfig
    from agents.evaluation import evaluate

    for bad, words in (("8", "give K:F"), ("0:0.5", "K must be at least 1"), ("4:1.5", "F a probability in [0, 1]")):
        with pytest.raises(SystemExit, match=re.escape(f"evaluate.py: --adaptive '{bad}': ") + ".*" + re.escape(words)):
            evaluate(Comparison(EvalConfig(model=str(tmp_path / "missing.zip"), adaptive=bad, progress_bar=False)))
