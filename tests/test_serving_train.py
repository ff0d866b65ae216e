"""train.py --env serve: a DQN on BiLD-Serve-v0, evaluated beside fixed policies on fixed validation episodes."""

import json
import subprocess
import sys

import pytest


def test_serving_training_writes_a_run_with_evaluations_and_references(tmp_path, monkeypatch):
    import bild_env.decoding.costs as costs
    from agents.serving_training import main
    from tests.test_serving import toy_batch_costs

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair: toy_batch_costs())  # no timing in a test
    args = ["--pair", "tiny-random", "--total-timesteps", "240", "--n-envs", "2", "--eval-freq", "120",
            "--eval-episodes", "2", "--max-new-tokens", "8", "--max-batch", "4", "--episode-steps", "12",
            "--learning-starts", "40", "--batch-size", "16", "--mix", "prose:1,code:1", "--no-progress-bar",
            "--log-dir", str(tmp_path), "--run-name", "r"]
    assert main(args) == 0
    run = tmp_path / "r"
    history = json.loads((run / "evaluations.json").read_text())
    assert [h["step"] for h in history] == [120, 240]
    assert (run / "best_model.zip").exists() and (run / "model.zip").exists()
    from stable_baselines3 import DQN

    model = DQN.load(run / "best_model.zip")
    assert model.action_space.n == 26 and model.observation_space.shape == (14,)
    assert main(args) == 2  # the same run folder again is refused


@pytest.mark.parametrize("bad", [["--learning-rate", "nan"], ["--load", "constant:0"], ["--mix", "prose:-1"],
                                 ["--batch-size", "512", "--buffer-size", "100"], ["--reference-actions", "40"]])
def test_serving_training_refuses_bad_options_before_loading(bad, tmp_path):
    out = subprocess.run([sys.executable, "train.py", "--env", "serve", "--pair", "tiny-random", "--log-dir",
                          str(tmp_path), *bad], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "error:" in out.stderr and "Traceback" not in out.stderr
    assert not any(tmp_path.iterdir())


def test_train_py_refuses_an_unknown_env():
    out = subprocess.run([sys.executable, "train.py", "--env", "nope"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--env must be 'bild'" in out.stderr
