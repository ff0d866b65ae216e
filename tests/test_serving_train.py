"""train.py --env serve: a DQN on BiLD-Serve-v0, evaluated beside fixed policies on fixed validation episodes."""

import json
import subprocess
import sys

import pytest

from tests.test_serving import make_serve, workload  # noqa: F401 (fixtures)


def test_serving_training_writes_a_run_with_evaluations_and_references(tmp_path, monkeypatch):
    import bild_env.decoding.costs as costs
    from tests.test_serving import train_serve as main
    from tests.test_serving import toy_batch_costs

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair, **_: toy_batch_costs())  # no timing in a test
    args = ["--pair", "tiny-random", "--total-timesteps", "240", "--n-envs", "2", "--eval-freq", "120",
            "--eval-episodes", "2", "--max-new-tokens", "8", "--max-batch", "4", "--episode-steps", "12",
            "--hyperparams", "learning_starts=40", "batch_size=16", "--mix", "prose:1,code:1", "--no-progress-bar",
            "--log-dir", str(tmp_path), "--run-name", "r"]
    assert main(args) == 0
    run = tmp_path / "r"
    history = json.loads((run / "evaluations.json").read_text())
    assert [h["step"] for h in history] == [120, 240]
    assert (run / "best_model.zip").exists() and (run / "model.zip").exists()
    from stable_baselines3 import DQN

    model = DQN.load(run / "best_model.zip")
    assert model.paired_actions  # the default: every sampled state's actions fitted together (agents.dqn)
    assert model.action_space.n == 6 and model.observation_space.shape == (14,)  # the serve preset: lossless grid + off
    # SB3 counts the target update interval in env steps and divides by n_envs itself: given once, as configured
    assert model.target_update_interval == 250 and model.train_freq.frequency == 2  # train_freq 4 over 2 envs
    saved = json.loads((run / "config.json").read_text())
    assert saved["version"] == 3 and saved["env"]["mix_draw"] == 1.0  # the serve preset: each episode its own mix
    assert saved["hyperparams"]["target_update_interval"] == 250 and saved["run"]["n_envs"] == 2
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run))
    events.Reload()
    last = {t: events.Scalars(t)[-1].value for t in events.Tags()["scalars"]}
    # the per-level best fixed action can only beat the best single one, which can only beat off, on the same episodes
    assert last["serving/load_table_return"] >= last["serving/best_fixed_return"] - 1e-5
    assert last["serving/best_fixed_return"] >= last["serving/off_return"] - 1e-5
    assert "serving/agent_speedup_x" in last and "serving/load_table_speedup_x" in last
    assert "serving/batch_table_speedup_x" in last and "serving/batch_table_return" in last  # the rule to beat, drawn too
    assert main(args) == 2  # the same run folder again is refused


@pytest.mark.parametrize("bad", [["--hyperparams", "learning_rate=nan"], ["--load", "constant:0"], ["--mix", "prose:-1"],
                                 ["--hyperparams", "batch_size=512", "buffer_size=100"], ["--reference-actions", "40"],
                                 ["--hyperparams", "learning_rate_final=1"], ["--per-domain"],
                                 ["--hyperparams", "paired_actions=true", "all_actions=false"], ["--hyperparams", "tau=0.5"]])
def test_serving_training_refuses_bad_options_before_loading(bad, tmp_path):
    out = subprocess.run([sys.executable, "train.py", "--env", "serve", "--pair", "tiny-random", "--log-dir",
                          str(tmp_path), *bad], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "error:" in out.stderr and "Traceback" not in out.stderr
    assert not any(tmp_path.iterdir())


def test_train_py_refuses_an_unknown_env():
    out = subprocess.run([sys.executable, "train.py", "--env", "nope"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "argument --env: invalid choice: 'nope' (choose from 'bild', 'quick', 'paper', 'serve')" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("argv", [["--env", "serve"], ["--env=serve"], ["--pair", "tiny-random", "--env", "serve"]])
def test_train_py_hands_env_serve_to_the_serving_trainer(argv, monkeypatch):
    from agents import commands
    from agents.serve.training import ServeRoom

    seen = []
    monkeypatch.setattr(ServeRoom, "from_argv", classmethod(lambda cls, rest, preset: seen.append(rest) or cls))
    monkeypatch.setattr("agents.training.run", lambda room: 0)
    assert commands.train_main(argv) == 0
    assert seen == [[a for a in argv if a not in ("--env", "serve", "--env=serve")]]


def test_peek_all_reports_every_action_with_the_taken_one_as_the_step(make_serve):
    import numpy as np

    from agents.wrappers import PeekAll

    env = PeekAll(make_serve(load="burst:0.2,1.5"))
    env.reset(seed=1)
    n = env.action_space.n
    taken = []
    for a in (3, 25, 0, 12):
        obs, reward, terminated, truncated, info = env.step(a)
        rows, rewards, ended = info["peek"]
        assert rows.shape == (n, 14) and rewards.shape == (n,) and not ended.any()
        assert np.array_equal(rows[a], obs) and rewards[a] == reward
        assert rewards[25] == pytest.approx(0.0, abs=1e-12)  # off scores exactly 0
        for other in ((a + 7) % n, (a + 1) % n):  # another action's row is that action's step from the same state
            twin = make_serve(load="burst:0.2,1.5")
            twin.reset(seed=1)
            for b in taken:
                twin.step(b)
            twin_obs, twin_reward, *_ = twin.step(other)
            assert np.array_equal(rows[other], twin_obs) and rewards[other] == twin_reward
        taken.append(a)


def test_validation_weighs_every_load_level_the_same():
    from agents.serve.validation import eval_loads

    assert eval_loads("levels:0.05,0.3,1") == ["constant:0.05", "constant:0.3", "constant:1"]
    assert eval_loads("burst:0.1,1.0") == ["burst:0.1,1.0"]


def test_a_run_saved_before_config_format_2_resumes_with_the_target_updates_it_had(tmp_path):
    """Format 1 divided --target-update-interval by n_envs before SB3 divided it again: resumed, it keeps that."""
    from agents.serve.options import saved_configs

    saved = {"env_id": "BiLD-Serve-v0", "train": {"target_update_interval": 1000, "n_envs": 4, "seed": 3,
                                                  "run_name": "old"}, "env": {"pair": "tiny-random"}}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    train, env = saved_configs(tmp_path)
    assert (train.dqn.target_update_interval, train.seed, train.dqn.all_actions, env.pair) == (250, 3, False, "tiny-random")
    (tmp_path / "config.json").write_text(json.dumps(saved | {"format": 2}))
    assert saved_configs(tmp_path)[0].dqn.target_update_interval == 1000


def test_a_run_named_by_default_or_moved_loads_its_options_where_it_now_lies(tmp_path):
    """A run trained without --run-name saved run_name None; evaluating or resuming it must not ask for one."""
    from agents.serve.options import saved_configs

    run = tmp_path / "copied" / "BiLD-Serve-v0-tiny-random__dqn__0__1"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"env_id": "BiLD-Serve-v0", "format": 2, "train": {
        "seed": 0, "run_name": None, "log_dir": "/elsewhere/logs"}, "env": {"pair": "tiny-random"}}))
    train, env = saved_configs(run)
    assert (train.run_name, train.log_dir, train.resume, env.pair) == (run.name, str(run.parent), True, "tiny-random")


def test_a_run_of_a_removed_option_loads_only_at_its_default_and_else_names_the_commit_that_had_it(tmp_path):
    from agents.config import ConfigError
    from agents.serve.options import saved_configs
    from bild_env.migrate import REMOVED

    default, last = REMOVED["allocate"]
    saved = {"env_id": "BiLD-Serve-v0", "format": 2, "train": {"seed": 0}, "env": {"pair": "tiny-random"}}
    (tmp_path / "config.json").write_text(json.dumps(saved | {"env": {"pair": "tiny-random", "allocate": default}}))
    assert saved_configs(tmp_path)[1].pair == "tiny-random"
    (tmp_path / "config.json").write_text(json.dumps(saved | {"env": {"pair": "tiny-random", "allocate": True}}))
    with pytest.raises(ConfigError, match=f"trained with allocate, an option removed after commit {last}.*git checkout"):
        saved_configs(tmp_path)


def test_the_time_budget_ends_training_after_exploration_as_a_whole_run_that_resume_takes_on(tmp_path, monkeypatch):
    """A budget already spent: training ends at the first whole state after exploration (30% of 240 steps), the run
    evaluated and saved as at its total and its summary saying so; --resume goes on to the total."""
    import bild_env.decoding.costs as costs
    from tests.test_serving import train_serve as main
    from tests.test_serving import toy_batch_costs

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair, **_: toy_batch_costs())
    args = ["--pair", "tiny-random", "--total-timesteps", "240", "--n-envs", "2", "--eval-freq", "0",
            "--eval-episodes", "2", "--max-new-tokens", "8", "--max-batch", "4", "--episode-steps", "12",
            "--hyperparams", "learning_starts=40", "batch_size=16", "--no-progress-bar", "--checkpoint-freq", "40",
            "--time-budget", "1e-6", "--log-dir", str(tmp_path), "--run-name", "r"]
    assert main(args) == 0
    run = tmp_path / "r"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["ended_by_time_budget"] and summary["interrupted"] is None
    assert 72 <= summary["steps"] < 240 and summary["total_timesteps"] == 240  # never before exploration's end
    history = json.loads((run / "evaluations.json").read_text())
    assert [h["step"] for h in history] == [summary["steps"]]  # the final model, evaluated once
    assert (run / "model.zip").exists()
    assert main(["--resume", str(run), "--time-budget", "0", "--no-progress-bar"]) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 240


def test_the_time_budget_asks_to_stop_once_the_deadline_less_the_reserve_is_reached_after_min_steps():
    from agents.common.callbacks import StopRequest, TimeBudget

    now = [0.0]
    stop = StopRequest()
    budget = TimeBudget(deadline=100.0, stop=stop, min_steps=50, reserve_s=lambda: 10.0, clock=lambda: now[0])
    budget.model = type("M", (), {"num_timesteps": 0})()
    for steps, t, asked in [(10, 95.0, False), (49, 200.0, False), (50, 89.0, False), (60, 90.0, True)]:
        budget.model.num_timesteps, now[0] = steps, t
        budget.on_step()
        assert stop.requested == asked and (budget.stopped_at == steps if asked else budget.stopped_at is None)
    assert stop.reason == TimeBudget.REASON


def test_a_tree_action_is_a_reference_action(tmp_path):
    """With tree rules the tree actions follow the grid and the off switch: --reference-actions takes them too."""
    from agents.serve.options import parse

    base = ["--pair", "tiny-random", "--actions", "tree_rules=6:8:2", "--log-dir", str(tmp_path)]
    train, env = parse(base + ["--reference-actions", "6", "0"])  # the lossless grid's 6 actions (0-5), then the tree
    assert train.reference_actions == (6, 0) and env.actions.tree_rules == ("6:8:2",)
    assert len(env.actions.fallback_values) * len(env.actions.rollback_values) + env.actions.off_switch == 6
    with pytest.raises(SystemExit):  # one past the tree action: refused
        parse(base + ["--reference-actions", "7"])
