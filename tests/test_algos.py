"""train.py --algo: PPO, A2C and SAC (and DQN) on the toy pair: train, save, resume, evaluate; clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from agents.commands import train_main
from agents.config import RunConfig
from agents.bild.evaluation import returns_on_prompts
from agents.bild.runs import checkpoints
from agents.common.trained import load_agent
from bild_env.env import BildEnv

TINY = ["--pair", "tiny-random", "--max-new-tokens", "8", "--n-envs", "2", "--torch-threads", "1", "--no-progress-bar",
        "--max-prompts", "4", "--eval-freq", "40", "--eval-episodes", "2", "--checkpoint-freq", "40"]
SMALL = {"ppo": ["--hyperparams", "n_steps=16", "batch_size=16", "n_epochs=2"],
         "a2c": [], "sac": ["--hyperparams", "learning_starts=20", "batch_size=16"],  # given twice: both kept
         "dqn": ["--hyperparams", "learning_starts=20", "batch_size=16"]}


@pytest.mark.parametrize("algo, action", [("ppo", "discrete"), ("ppo", "continuous"), ("a2c", "discrete"),
                                          ("sac", "continuous")])
def test_each_algorithm_trains_saves_resumes_and_evaluates(tmp_path, algo, action):
    args = ["--algo", algo, "--actions", f"space={action}", "--log-dir", str(tmp_path), "--run-name", "run", *TINY, *SMALL[algo]]
    assert train_main([*args, "--total-timesteps", "96"]) == 0
    run = tmp_path / "run"
    found = checkpoints(run)
    assert found and found[0].model.name.startswith(f"{algo}_") and (found[0].replay_buffer is not None) == (algo == "sac")
    assert RunConfig.load(run / "config.json").train.algo == algo
    assert train_main(["--resume", str(run), "--total-timesteps", "160", "--log-dir", str(tmp_path),
                       "--no-progress-bar", "--torch-threads", "1"]) == 0
    model_steps = [c.steps for c in checkpoints(run)]
    assert max(model_steps) >= 160
    config = RunConfig.load(run / "config.json").env
    env = BildEnv(**{name: getattr(config, name) for name in config.__dataclass_fields__} | {"split": "validation"})
    model = load_agent(run / "model.zip", env)
    assert model.num_timesteps >= 160 and type(model).__name__.lower() == algo
    result = returns_on_prompts(env, model, [0, 1])
    assert len(result.returns) == 2 and np.all(np.isfinite(result.returns))
    if action == "continuous":  # the agent's actions are Box points, mapped onto the grids' spans
        chosen = [env.thresholds(a) for a in result.actions[0]]
        assert all(0.103 - 1e-6 <= f <= 0.6 + 1e-6 and 0.5 - 1e-6 <= r <= 4.697 + 1e-6 for f, r in chosen)
    env.close()


@pytest.mark.parametrize("argv, message", [
    (["--algo", "sac"], "--algo sac needs a continuous action space"),
    (["--algo", "dqn", "--actions", "space=continuous"], "--algo dqn needs a discrete action space"),
    (["--algo", "nope"], "unknown --algo 'nope'"),
    (["--algo", "ppo", "--hyperparams", "learning_starts=10"], "--hyperparams 'learning_starts=10': give KEY=VALUE"),
    (["--hyperparams", "n_epochs=8"], "--hyperparams 'n_epochs=8': give KEY=VALUE, KEY one of learning_rate, "),
    (["--algo", "ppo", "--hyperparams", "n_step=8"], "--hyperparams 'n_step=8': give KEY=VALUE, KEY one of gamma, "),
    (["--algo", "ppo", "--hyperparams", "n_steps"], "--hyperparams 'n_steps': give KEY=VALUE"),
    (["--algo", "ppo", "--hyperparams", "n_steps=many"], "--hyperparams n_steps='many': not a value of n_steps"),
    (["--algo", "a2c", "--hyperparams", "net_arch=64,x"], "--hyperparams net_arch='64,x': not a value of net_arch"),
])
def test_an_algorithm_that_does_not_fit_is_refused_with_what_to_change(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        train_main([*argv, "--log-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
