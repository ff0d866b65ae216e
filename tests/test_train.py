"""train.py (``agents.bild.training``, ``agents.bild.runs``): options generated from the configs, clear failures, and a real (tiny) run that is
interrupted with Ctrl-C and resumed, with its TensorBoard curves, config and models."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
from stable_baselines3 import DQN

from agents.bild import training as train
from agents.bild.runs import latest_checkpoint
from agents.commands import train_main
from agents.common.lock import RunInUse
from agents.bild.runs import checkpoint_paths
from agents.common.logs import make_logger
from agents.spec import ENV_NOT_CLI, RunSpec
from agents.config import DEFAULT_PAIR, A2CConfig, DQNConfig, PPOConfig, RunConfig, SACConfig, TrainConfig
from bild_env import ENV_ID
from bild_env.cli import shown_fields
from bild_env.env import EnvConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--max-new-tokens", "16", "--torch-threads", "1", "--no-progress-bar"]


# ------------------------------------------------------------------------------------------------
# options
def test_help_documents_every_option_with_its_config_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    names = [f.name for f in fields(TrainConfig)]
    names += [f.name for f in fields(EnvConfig) if f.metadata.get("cli", True) and f.name not in ENV_NOT_CLI]
    for name in names + ["resume", "hyperparams"]:
        assert "--" + name.replace("_", "-") in text, name
    for config in (DQNConfig(), PPOConfig(), A2CConfig(), SACConfig()):  # each algorithm's keys, with their defaults
        assert shown_fields(config) in text
    parser = train.build_parser()
    for action in parser._actions:  # words of its own, not only the default (inherited fields included)
        assert action.help and action.help.split("(default")[0].strip(), action.option_strings
    assert f"target_update_interval={DQNConfig().target_update_interval}," in text and f"(default: {DEFAULT_PAIR})" in text


def test_defaults_come_from_the_configs(tmp_path):
    config, resume = train.parse_config(["--log-dir", str(tmp_path)])
    assert resume is False
    assert re.fullmatch(rf"{ENV_ID}-{DEFAULT_PAIR}__dqn__0__\d+", config.train.run_name)
    expected = RunConfig()
    assert config.dqn == expected.dqn and config.env == expected.env and config.env.pair == DEFAULT_PAIR
    config, _ = train.parse_config(["--log-dir", str(tmp_path), "--hyperparams", "gamma=0.9", "net_arch=32,32,32",
                                    "all_actions=false", "--actions", "rollback_values=1,2", "--latency", "wall",
                                    "--backend", "live", "--seed", "4"])
    assert (config.dqn.gamma, config.dqn.net_arch, config.env.actions.rollback_values) == (0.9, (32, 32, 32), (1.0, 2.0))
    assert config.env.latency == "wall" and config.train.run_name.startswith(f"{ENV_ID}-{DEFAULT_PAIR}__dqn__4__")
    assert RunConfig.from_spec(RunSpec.from_json(json.loads(config.spec().text()))) == config


def test_reward_scale_scales_what_the_agent_learns_from_not_what_is_logged(tmp_path):
    from bild_env.decoding.costs import CostModel

    def rollout(scale: float):
        config, _ = train.parse_config(["--log-dir", str(tmp_path), "--pair", "tiny-random", "--n-envs", "2",
                                        "--reward-scale", str(scale), *TINY])
        config.env.cost_model = CostModel(draft=(1.0, 0.1, 0.0), target=(4.0, 0.5, 0.0), device="test")
        envs = train.make_envs(config)
        envs.train.seed(3)
        envs.train.reset()
        rewards, logged = [], []
        for _ in range(40):
            _, r, _, infos = envs.train.step(np.array([16, 11]))
            rewards.append(r)
            logged += [info["episode"]["r"] for info in infos if "episode" in info]  # Monitor's episode return
        envs.train.close()
        return np.array(rewards), np.array(logged)

    plain, plain_logged = rollout(1.0)
    scaled, scaled_logged = rollout(100.0)
    assert np.abs(plain).max() > 0 and len(plain_logged) >= 2
    np.testing.assert_allclose(scaled, 100 * plain, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(scaled_logged, plain_logged, rtol=1e-5)  # TensorBoard's episode rewards: env units
    with pytest.raises(ValueError, match="--reward-scale must be a finite number > 0, got 0"):
        TrainConfig(reward_scale=0)


@pytest.mark.parametrize("argv, message", [
    (["--pair", "nope"], "unknown --pair 'nope'"),
    (["--total-timesteps", "0"], "--total-timesteps must be an integer >= 1, got 0"),
    (["--hyperparams", "exploration_fraction=0"], "--hyperparams exploration_fraction must be a finite number in (0, 1], got 0.0"),
    (["--log-dir", "{file}/logs"], "cannot write to --log-dir"),
    (["--resume", "missing-run"], "no run folder with a config.json"),
    (["--resume", "{run}", "--hyperparams", "gamma=0.5", "--seed", "2"], "cannot change: --hyperparams, --seed"),
])
def test_bad_options_fail_with_a_clear_message(tmp_path, capsys, argv, message):
    (tmp_path / "file").write_text("not a folder")
    run = tmp_path / "old-run"
    run.mkdir()
    RunConfig().save(run / "config.json")
    argv = [a.format(file=tmp_path / "file", run=run, run_name=run.name) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        train_main(argv + ["--log-dir", str(tmp_path)] if "--log-dir" not in argv else argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--hyperparams", "learning_rate=inf"], "--hyperparams learning_rate must be a finite number > 0, got inf"),
    (["--algo", "ppo", "--hyperparams", "learning_starts=10"], "--hyperparams 'learning_starts=10': give KEY=VALUE, KEY one of"),
    (["--algo", "ppo", "--hyperparams", "n_steps=0"], "--hyperparams n_steps must be an integer >= 1, got 0"),
    (["--algo", "ppo", "--hyperparams", "learning_rate=nan"], "--hyperparams learning_rate must be a finite number > 0, got nan"),
    (["--algo", "sac", "--actions", "space=continuous", "--hyperparams", "ent_coef=foo"], "--hyperparams ent_coef must be a number > 0"),
    (["--policy-device", "foo"], "--policy-device 'foo' is not a device"),
    (["--algo", "a2c", "--hyperparams", "gamma=5"], "--hyperparams gamma must be a finite number in [0, 1], got 5.0"),
    (["--algo", "ppo", "--hyperparams", "net_arch=0"], "--hyperparams net_arch must be one or more hidden layer sizes >= 1, got 0"),
    (["--algo", "sac", "--actions", "space=continuous", "--hyperparams", "buffer_size=0"], "--hyperparams buffer_size must be an integer >= 1"),
    (["--algo", "sac", "--actions", "space=continuous", "--hyperparams", "buffer_size=100"],
     "--hyperparams batch_size 256 is larger than the replay buffer (--hyperparams buffer_size 100 = 100 transitions)"),
    (["--hyperparams", "buffer_size=10", "batch_size=300"], "--hyperparams batch_size 300 is larger than the replay buffer "
                                                           "(--hyperparams buffer_size 10 env steps x 25 actions = 250 transitions)"),
    (["--algo", "ppo", "--n-envs", "2", "--hyperparams", "n_steps=16"], "--hyperparams batch_size 256 is larger than a rollout "
                                                                 "(--hyperparams n_steps 16 x --n-envs 2 = 32 transitions)"),
    (["--algo", "a2c", "--n-envs", "1", "--hyperparams", "n_steps=1"], "a rollout of --hyperparams n_steps 1 x --n-envs 1 = 1 transition"),
])
def test_nonsense_hyperparameters_are_refused_before_a_run_folder_exists(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        train_main([*argv, "--log-dir", str(tmp_path), "--run-name", "r"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_a_run_that_would_never_learn_is_noted_not_refused(tmp_path, capsys):
    config, _ = train.parse_config(["--total-timesteps", "1000", "--log-dir", str(tmp_path)])
    assert config.train.total_timesteps == 1000
    assert "note: --hyperparams learning_starts 2000 is not below --total-timesteps 1000: the run takes random actions only" in (
        capsys.readouterr().err)


def test_a_cuda_policy_device_on_a_machine_without_one_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit):
        train_main(["--policy-device", "cuda", "--log-dir", str(tmp_path)])
    assert "--policy-device cuda: this machine has no CUDA device" in capsys.readouterr().err


def test_a_run_folder_without_a_config_is_reused_or_named_with_what_to_do(tmp_path, capsys):
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "train.lock").write_text('{"pid": 1}')  # a start killed before its config was written
    config, _ = train.parse_config(["--log-dir", str(tmp_path), "--run-name", "stale"])  # reused
    assert config.train.run_name == "stale"
    with pytest.raises(SystemExit):
        train_main(["--resume", "stale", "--log-dir", str(tmp_path)])
    assert "holds no config.json: that run stopped before it started" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert train_main(["--log-dir", str(tmp_path), "--run-name", "other"]) == 2
    assert "is no run folder of train.py (no config.json) but holds notes.txt" in capsys.readouterr().err


def test_a_run_folder_is_held_by_one_process(tmp_path, capsys):
    from agents.common.lock import RunLock, lock_holder

    run = tmp_path / "held"
    run.mkdir()
    RunConfig().save(run / "config.json")
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, json, os, sys, time\n"
                               f"fd = os.open({str(run / 'train.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX)\n"
                               "os.write(fd, json.dumps({'pid': os.getpid(), 'argv': ['train.py', '--resume', 'held']}).encode())\n"
                               "print('held', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for argv in (["--resume", str(run)], ["--log-dir", str(tmp_path), "--run-name", "held"]):
            started = time.monotonic()
            assert train_main(argv) == 2 and time.monotonic() - started < 5  # at once, nothing loaded
            err = capsys.readouterr().err
            assert f"is in use by process {holder.pid}" in err and "train.py --resume held" in err, err
    finally:
        holder.kill()
        holder.wait()
    assert lock_holder(run) is None  # the kernel dropped the dead process's lock; its file is left, and reused
    with RunLock.acquire(run) as lock:
        assert lock_holder(run)["pid"] == os.getpid()
        with pytest.raises(RunInUse, match=f"in use by process {os.getpid()}"):
            RunLock.acquire(run)
    assert lock_holder(run) is None and not (run / "train.lock").exists()


def test_bad_env_option_fails_before_loading_models_and_leaves_no_run_folder(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:  # refused with the other options, before a folder is made
        train_main(["--latency", "fast", "--log-dir", str(tmp_path / "logs"), "--run-name", "r"] + TINY)
    assert exit_.value.code == 2
    assert "bad environment option: latency must be one of" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


def test_a_bad_option_fails_at_once_from_the_command_line():
    out = subprocess.run([sys.executable, "train.py", "--pair", "nope"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "train.py: error: unknown --pair 'nope'" in out.stderr
    assert "Traceback" not in out.stderr


# ------------------------------------------------------------------------------------------------
# a real run: started, interrupted by Ctrl-C after its first checkpoint, resumed to the end
RUN_ARGS = ["--total-timesteps", "100000", "--n-envs", "8", "--checkpoint-freq", "40", "--eval-freq", "30", "--eval-episodes", "2",
            "--hyperparams", "learning_starts=20", "batch_size=8", "target_update_interval=20", "--seed", "1"]
EXTRA_STEPS = 40


@pytest.fixture(scope="module")
def interrupted_and_resumed(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    run_dir = log_dir / "tiny"
    command = [sys.executable, "train.py", "--pair", "tiny-random", "--log-dir", str(log_dir), "--run-name", "tiny"]
    command += RUN_ARGS + TINY
    # a child started from a background shell may ignore SIGINT; Ctrl-C in a terminal is never ignored
    first = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    while not (run_dir / "checkpoints" / "dqn_replay_buffer_40_steps.pkl").exists():
        assert first.poll() is None, first.communicate()[0]
        assert time.monotonic() < deadline, "no checkpoint after 240 s"
        time.sleep(0.2)
    time.sleep(0.3)
    first.send_signal(signal.SIGINT)  # what Ctrl-C does
    first_out = first.communicate(timeout=120)[0]
    stopped = latest_checkpoint(run_dir)
    stopped_files = [p for p in (stopped.model, stopped.replay_buffer, stopped.state) if p is not None and p.is_file()]
    events_before = sorted(run_dir.glob("events.out.tfevents.*"))
    final_model_before = (run_dir / "model.zip").exists()
    target = stopped.steps + EXTRA_STEPS
    second = subprocess.run([sys.executable, "train.py", "--resume", str(run_dir), "--total-timesteps", str(target)]
                            + TINY[2:], cwd=ROOT, capture_output=True, text=True, timeout=240)
    return {"run_dir": run_dir, "first": (first.returncode, first_out), "stopped": stopped, "target": target,
            "second": second, "events_before": events_before, "final_model_before": final_model_before,
            "stopped_files": stopped_files}


def test_ctrl_c_saves_a_checkpoint_with_the_replay_buffer(interrupted_and_resumed):
    rc, out = interrupted_and_resumed["first"]
    stopped = interrupted_and_resumed["stopped"]
    assert rc == 130, out
    assert f"interrupted at step {stopped.steps}" in out and "--resume" in out
    assert stopped.steps >= 40 and len(interrupted_and_resumed["stopped_files"]) == 3  # model, replay buffer, state
    assert not interrupted_and_resumed["final_model_before"]  # the final model.zip comes at the end only


def test_resume_continues_the_same_run_to_the_total(interrupted_and_resumed):
    r = interrupted_and_resumed
    assert r["second"].returncode == 0, r["second"].stdout + r["second"].stderr
    assert f"resuming at step {r['stopped'].steps}" in r["second"].stdout
    model = DQN.load(r["run_dir"] / "model.zip", device="cpu")
    assert model.num_timesteps == r["target"]
    assert latest_checkpoint(r["run_dir"]).steps == r["target"]
    action, _ = model.predict(np.zeros(7, dtype=np.float32), deterministic=True)
    assert 0 <= int(action) < 25
    best = DQN.load(r["run_dir"] / "best_model.zip", device="cpu")
    assert best.predict(np.zeros((2, 7), dtype=np.float32))[0].shape == (2,)
    evaluations = np.load(r["run_dir"] / "evaluations.npz")["timesteps"]
    assert evaluations.min() < r["stopped"].steps < evaluations.max()  # earlier evaluations are kept
    saved = RunConfig.load(r["run_dir"] / "config.json")
    from bild_env.decoding.costs import CostModel

    cost = CostModel.load(r["run_dir"] / "cost_model.json")  # the latency model the rewards came from
    # the toy pair's two models are about the same size, so their times are not ordered; only measured and positive
    assert cost.device.startswith("cpu") and cost.target(1, 32) > 0 and cost.draft(1, 32) > 0 and cost.target_only_ms(32, 4) > 0
    assert 12 in cost.target.fed and 12 in cost.draft.fed  # each model's own counts, where its curve bends
    assert saved.train.total_timesteps == r["target"] and saved.train.seed == 1 and saved.dqn.batch_size == 8
    buffers = sorted((r["run_dir"] / "checkpoints").glob("*_replay_buffer_*.pkl"))
    assert len(buffers) <= TrainConfig().keep_replay_buffers


def test_tensorboard_curves_hold_the_env_metrics_and_continue_after_resume(interrupted_and_resumed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = interrupted_and_resumed
    assert len(sorted(r["run_dir"].glob("events.out.tfevents.*"))) > len(r["events_before"])  # the same folder
    events = EventAccumulator(str(r["run_dir"]), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for key in ("latency_ms", "acceptance_rate", "mean_accepted_length", "bleu", "mean_fallback", "mean_rollback",
                "episode_reward"):
        assert f"bild/{key}" in tags, key
    assert {"rollout/ep_rew_mean", "rollout/exploration_rate", "train/loss", "eval/mean_reward",
            "eval/latency_ms", "eval/bleu"} <= tags
    # the default backend is replay: its hit rate per episode and the trees' size are curves too
    assert {"replay/hit_rate", "replay/prefixes", "replay/fill_seconds"} <= tags
    hit_rate = [e.value for e in events.Scalars("replay/hit_rate")]
    assert all(0.0 <= v <= 1.0 for v in hit_rate) and max(hit_rate) > 0.0
    prefixes = [e.value for e in events.Scalars("replay/prefixes")]
    assert prefixes[-1] > 0
    steps = [e.step for e in events.Scalars("bild/latency_ms")]
    assert steps == sorted(steps) and min(steps) < r["stopped"].steps < max(steps) <= r["target"]
    latency = [e.value for e in events.Scalars("bild/latency_ms")]
    assert all(v > 0 for v in latency)


def test_summarize_run_names_a_folder_without_events():
    out = subprocess.run([sys.executable, "-m", "scripts.analysis.summarize_run", "logs/nope"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "logs/nope: no such folder" in out.stderr and "Traceback" not in out.stderr


def test_summarize_run_gives_the_evaluations_and_the_tenths_of_the_training_curves(interrupted_and_resumed):
    from agents.bild.runs import summarize
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = str(interrupted_and_resumed["run_dir"])
    summary = summarize(run_dir)
    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    assert summary["eval/mean_reward"] == {e.step: round(e.value, 3) for e in events.Scalars("eval/mean_reward")}
    rewards = [e.value for e in events.Scalars("bild/episode_reward")]
    k = max(1, len(rewards) // 10)
    assert summary["bild/episode_reward"]["points"] == len(rewards)
    assert summary["bild/episode_reward"]["first tenth"] == round(sum(rewards[:k]) / k, 3)
    assert summary["bild/episode_reward"]["last tenth"] == round(sum(rewards[-k:]) / k, 3)


# ------------------------------------------------------------------------------------------------
# values refused before any model loads; checkpoints that cannot be read; TensorBoard on resume
@pytest.mark.parametrize("argv, message", [
    (["--reward", "latency_weight=nan"], "latency_weight must be a finite number >= 0, got nan"),
    (["--reward", "bleu_weight=inf"], "bleu_weight must be a finite number >= 0, got inf"),
    (["--max-prompts", "0"], "max_prompts must be an integer >= 1"),
    (["--max-prompts", "-3"], "max_prompts must be an integer >= 1"),
    (["--dataset", "{binary}"], "{binary}' is not a UTF-8 text file"),
])
def test_bad_env_values_fail_before_any_model_loads(tmp_path, capsys, monkeypatch, argv, message):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("bild_env.models.pairs.load_pair", refuse)  # both envs load the pair through it
    binary = tmp_path / "data.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    argv = [a.format(binary=binary) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        train_main(argv + ["--pair", "tiny-random", "--log-dir", str(tmp_path / "logs"), "--run-name", "r"] + TINY)
    assert exit_.value.code == 2
    assert message.format(binary=binary) in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


@pytest.fixture
def run_with_checkpoints(tmp_path):
    """A run folder with two complete checkpoints (40 and 80 steps) of a small DQN (parse_config reads, not trains)."""
    import gymnasium as gym
    from stable_baselines3 import DQN as SB3DQN

    run = tmp_path / "run"
    run.mkdir()
    RunConfig().save(run / "config.json")
    model = SB3DQN("MlpPolicy", gym.make("CartPole-v1"), buffer_size=64, learning_starts=0, device="cpu")
    for steps in (40, 80):
        checkpoint = checkpoint_paths(run, steps)
        checkpoint.model.parent.mkdir(exist_ok=True)
        model.save(checkpoint.model)
        model.save_replay_buffer(checkpoint.replay_buffer)
    return run


@pytest.mark.parametrize("damaged", ["model", "replay_buffer"])
def test_resume_skips_a_checkpoint_it_cannot_read_and_says_which(run_with_checkpoints, capsys, damaged):
    newest = getattr(checkpoint_paths(run_with_checkpoints, 80), damaged)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # killed while writing
    checkpoint = train.BildRoom(*train.parse_config(["--resume", str(run_with_checkpoints), "--total-timesteps",
                                                     "200"])).start_point()
    assert checkpoint.steps == 40
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1 and "skipping the checkpoint at step 80, which cannot be read" in lines[0], lines
    assert str(newest) in lines[0]


def test_where_a_run_starts_is_the_serving_trainers_rule(run_with_checkpoints, capsys):
    """``agents.common.folders.check_start`` for BiLD-v1: a new run in a run's folder is refused while it has a
    checkpoint; without a readable one a resume starts again from step 0 with the saved options (a finished run
    refused), and a new run starts again in place."""
    from agents.common.folders import check_start

    run, log_dir = run_with_checkpoints, run_with_checkpoints.parent
    assert train_main(["--log-dir", str(log_dir), "--run-name", "run", "--pair", "tiny-random"]) == 2
    assert (f"{run} is a run with a checkpoint at step 80 already: continue it with `python train.py --resume {run}`"
            in capsys.readouterr().err)
    for steps in (40, 80):
        checkpoint_paths(run, steps).model.write_bytes(b"garbage")
    room = train.BildRoom(*train.parse_config(["--resume", str(run), "--total-timesteps", "200"]))
    start = room.start_point()  # as agents.training.train finds it, under the run's lock
    check_start(run, room.resume, start, room.total, room.say, ENV_ID)
    out, err = capsys.readouterr()
    assert start is None and room.total == 200 and room.config.env == RunConfig().env
    assert "has no complete checkpoint (stopped before its first one): starting it again from step 0" in out
    assert err.count("skipping the checkpoint at step") == 2 and "Traceback" not in err
    room = train.BildRoom(*train.parse_config(["--log-dir", str(log_dir), "--run-name", "run", "--pair", "tiny-random"]))
    check_start(run, room.resume, room.start_point(), room.total, room.say, ENV_ID)
    assert room.config.env.pair == "tiny-random" and "starting it again in place" in capsys.readouterr().out
    import gymnasium as gym
    from stable_baselines3 import DQN as SB3DQN

    model = SB3DQN("MlpPolicy", gym.make("CartPole-v1"), buffer_size=64, learning_starts=0, device="cpu")
    model.num_timesteps = 200
    model.save(run / "model.zip")  # finished: its total reached, no checkpoint to go on from
    assert train_main(["--resume", str(run), "--total-timesteps", "200"]) == 2
    assert "finished training (model.zip at step 200) but none of its checkpoints can be read" in capsys.readouterr().err
    from agents.serve.options import ServeTrainConfig
    from agents.spec import preset_env

    serving = log_dir / "serving"  # a serving run stopped before its first checkpoint: not restarted as a BiLD-v1 one
    serving.mkdir()
    (serving / "config.json").write_text(ServeTrainConfig().spec(preset_env("serve")).text())
    assert train_main(["--log-dir", str(log_dir), "--run-name", "serving", "--pair", "tiny-random"]) == 2
    assert f"{serving} holds a BiLD-Serve-v0 run: give another --run-name" in capsys.readouterr().err


def test_a_restart_in_place_keeps_what_the_earlier_attempt_wrote(tmp_path, capsys):
    argv = ["--pair", "tiny-random", "--total-timesteps", "32", "--n-envs", "2", "--eval-freq", "0",
            "--log-dir", str(tmp_path), "--run-name", "r", *TINY]
    assert train_main(argv) == 0
    run = tmp_path / "r"
    first = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != "config.json"}
    for p in (run / "checkpoints").iterdir():
        p.write_bytes(b"torn")  # killed: no checkpoint can be read
    (run / "model.zip").unlink()
    del first["model.zip"]
    assert train_main(["--resume", str(run)]) == 0
    assert "kept in " + str(run / "set_aside" / "1") in capsys.readouterr().out
    aside = run / "set_aside" / "1"
    assert {name: (aside / name).read_bytes() for name in first} == first  # every file of the first attempt kept
    assert sorted(p.read_bytes() for p in (aside / "checkpoints").iterdir()) == [b"torn"] * 3
    assert (run / "model.zip").is_file() and latest_checkpoint(run).steps == 32


def test_tensorboard_keeps_the_points_of_the_resumed_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = make_logger(tmp_path, None)
    for step in (10, 20, 30):  # killed after step 30; its last checkpoint was at step 20
        logger.record("bild/x", float(step))
        logger.dump(step)
    logger.close()
    logger = make_logger(tmp_path, 20)
    logger.record("bild/x", 25.0)
    logger.dump(25)
    logger.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("bild/x")] == [10, 20, 25]
