"""A run's saved spec (``agents.spec.RunSpec``, ``config.json``): one format for both trainers, and every run saved by
an earlier version read as it was read before the format changed.

``tests/data/run_configs_read_at_954badc.json.gz`` holds, for each run folder shipped under ``results/`` and the
shipped serving agent (136 runs of BiLD-v1's trainer and BiLD-Serve-v0's, online and offline, of every earlier format),
a digest of the option values the trainers read from it at commit 954badc, the last one before the spec, over the
options that commit had (``scripts/analysis/run_configs.py``, run with that commit's code); "refused" for the 6 that
commit refused (trained with an option removed since)."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

import pytest

from agents.config import ConfigError, RunConfig, TrainConfig
from agents.serve.options import ServeTrainConfig, saved_configs
from agents.spec import RunSpec, preset_env, spec_file
from scripts.analysis.run_configs import digest as digest_of, read

ROOT = Path(__file__).resolve().parents[1]
PINNED = json.loads(gzip.decompress((ROOT / "tests" / "data" / "run_configs_read_at_954badc.json.gz").read_bytes()))


def test_every_shipped_run_of_every_earlier_format_is_read_as_before_the_spec(monkeypatch):
    monkeypatch.chdir(ROOT)
    digests = PINNED["digests"]
    assert len(digests) == 136 and sum(v.startswith("refused") for v in digests.values()) == 6
    formats = set()
    for path, digest in digests.items():
        saved = json.loads(Path(path).read_text())
        formats.add((saved.get("env_id", "BiLD-v1"), saved.get("format", saved.get("version", 1))))
        if digest.startswith("refused"):
            with pytest.raises(ValueError, match="trained with [a-z_]+, an option removed after commit"):
                read(path)
        else:
            env_id, values = read(path)
            assert digest_of(values, PINNED["keys"][env_id]) == digest, path
    assert formats == {("BiLD-v1", 1), ("BiLD-Serve-v0", 1), ("BiLD-Serve-v0", 2)}  # all three earlier formats


def test_a_run_saved_again_as_a_spec_reads_back_the_same(tmp_path, monkeypatch):
    """Both trainers' runs, read from an earlier format and saved as today's spec, read back equal."""
    monkeypatch.chdir(ROOT)
    bild = RunConfig.load("results/smollm2-main-job/run/config.json")
    again = RunConfig.from_spec(RunSpec.from_json(json.loads(bild.spec().text())))
    assert (again.train, again.algo_config, again.env) == (bild.train, bild.algo_config, bild.env)
    run = tmp_path / "s0"
    run.mkdir()
    train, env = saved_configs(ROOT / "results" / "serving_floor_runs" / "qwen" / "s0")
    (run / "config.json").write_text(train.spec(env).text())
    spec = json.loads((run / "config.json").read_text())
    assert set(spec) == {"version", "env_id", "env", "algo", "hyperparams", "run", "meta"} and spec["version"] == 3
    assert spec["hyperparams"]["gamma"] == train.dqn.gamma and spec["run"]["seed"] == train.seed
    assert saved_configs(run) == (replace(train, log_dir=str(tmp_path), run_name="s0"), env)


def test_both_trainers_save_one_format():
    bild = json.loads(RunConfig(train=TrainConfig(algo="ppo", seed=4)).spec().text())
    serve = json.loads(ServeTrainConfig(seed=4).spec(preset_env("serve")).text())
    assert set(bild) == set(serve) == {"version", "env_id", "env", "algo", "hyperparams", "run", "meta"}
    assert (bild["env_id"], bild["algo"], serve["env_id"], serve["algo"]) == ("BiLD-v1", "ppo", "BiLD-Serve-v0", "dqn")
    assert bild["run"]["seed"] == serve["run"]["seed"] == 4 and "n_epochs" in bild["hyperparams"]  # PPO's own
    assert "algo" not in bild["run"] and "gamma" not in serve["run"] and serve["hyperparams"]["gamma"] == 0.9


@pytest.mark.parametrize("content, says", [
    ("{not json", "cannot be read (JSONDecodeError"),
    ("[1, 2]", "no JSON object"),
    ('{"version": 4, "env_id": "BiLD-v1", "env": {}}', "spec version 4, newer than this code's 3: update bild-gym"),
    ('{"version": 3, "env_id": "CartPole-v1", "env": {}}', "its env 'CartPole-v1' is none of"),
    ('{"version": 3, "env_id": "BiLD-v1", "env": [1]}', "its 'env' is no JSON object"),
    ('{"version": "3", "env_id": "BiLD-v1", "env": {}}', "its version '3' is no whole number"),
    ('{"train": 5, "env": {}}', "its 'train' is no JSON object"),  # an earlier version's BiLD-v1 run
])
def test_a_spec_that_cannot_be_read_is_refused_naming_the_file(tmp_path, content, says):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ValueError, match=f"^{tmp_path / 'config.json'}.*") as err:
        RunSpec.load(tmp_path)
    assert says in str(err.value)


def test_a_runs_spec_is_found_beside_its_model_or_above_its_checkpoints(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    assert spec_file(tmp_path / "checkpoints" / "dqn_10_steps.zip") is None
    (tmp_path / "config.json").write_text(RunConfig().spec().text())
    for model in (tmp_path, tmp_path / "model.zip", tmp_path / "checkpoints" / "dqn_10_steps.zip"):
        assert spec_file(model) == tmp_path / "config.json"
    with pytest.raises(ConfigError, match="a BiLD-v1 run, not a BiLD-Serve-v0 one: use it without --env serve"):
        saved_configs(tmp_path)
    (tmp_path / "config.json").write_text(ServeTrainConfig().spec(preset_env("serve")).text())
    with pytest.raises(ConfigError, match="a BiLD-Serve-v0 run, not a BiLD-v1 one: its spec picks its trainer"):
        RunConfig.load(tmp_path / "config.json")


def test_a_runs_spec_picks_the_trainer_and_the_evaluation_where_env_is_not_given(tmp_path):
    from agents.common.env_choice import split_env

    serve, bild = tmp_path / "logs" / "serve", tmp_path / "logs" / "bild"
    for run, text in ((serve, ServeTrainConfig().spec(preset_env("serve")).text()), (bild, RunConfig().spec().text())):
        run.mkdir(parents=True)
        (run / "config.json").write_text(text)
    assert split_env(["--resume", str(serve), "--total-timesteps", "9"], "--resume") == (
        "serve", ["--resume", str(serve), "--total-timesteps", "9"])
    assert split_env(["--log-dir", str(tmp_path / "logs"), "--resume", "serve"], "--resume")[0] == "serve"  # a name
    assert split_env(["--resume", str(bild)], "--resume")[0] == "bild"
    assert split_env(["--model", str(serve / "best_model.zip"), str(bild)], "--model")[0] == "serve"  # the first's
    assert split_env(["--model", "pretrained"], "--model")[0] == "serve"  # the shipped agent is a serving run
    assert split_env(["--model", str(tmp_path / "none.zip")], "--model")[0] == "bild"  # no spec: the default env
    assert split_env(["--env", "bild", "--resume", str(serve)], "--resume") == ("bild", ["--resume", str(serve)])
    assert split_env(["--resume", str(serve)]) == ("bild", ["--resume", str(serve)])  # a command without runs


def test_a_runs_spec_makes_its_env_as_gymnasium_make_does():
    import numpy as np

    from bild_env.env import EnvConfig
    from conftest import COSTS

    config = RunConfig(env=EnvConfig(pair="tiny-random", backend="live", max_new_tokens=8, max_prompts=3))
    spec = RunSpec.from_json(json.loads(config.spec().text()))
    given = {"split": "validation", "cost_model": COSTS, "pair_options": {"device": "cpu"}}
    made, direct = spec.make(**given), config.env.arguments(**given)
    import gymnasium

    direct = gymnasium.make("BiLD-v1", **direct)
    assert made.unwrapped.config == direct.unwrapped.config and made.unwrapped.config.split == "validation"
    (a, _), (b, _) = made.reset(seed=3), direct.reset(seed=3)
    assert np.array_equal(a, b)
    for action in (4, 0, 12, 24, 3, 7, 1, 2):
        a, b = made.step(action), direct.step(action)
        assert np.array_equal(a[0], b[0]) and a[1:4] == b[1:4]
        if a[2] or a[3]:
            break


def test_the_presets_are_the_settings_the_trainers_started_from_before_them():
    """Each preset against the literal setting it replaced (73eb7ff: ``default_env_config``, ``TRAIN_ENV``,
    ``SERVE_DQN``, the serving evaluation's episodes), and the paper's against the registered ``BiLD-v0``."""
    import gymnasium

    from agents.config import DQNConfig
    from agents.serve.bench_config import MAIN_JOB_EPISODES
    from agents.serve.options import SERVE_DQN
    from agents.spec import PRESETS, preset
    from bild_env.command import UsageError
    from bild_env.env import EnvConfig
    from bild_env.serving.env import ServingConfig

    assert list(PRESETS) == ["bild", "quick", "paper", "serve"]
    assert preset_env("bild") == EnvConfig(backend="replay", max_prompts=32, max_new_tokens=32) == RunConfig().env
    assert preset_env("serve") == replace(ServingConfig(), actions={"rollback_values": (0.5,)}, episode_steps=64,
                                          load="levels:0.05,0.15,0.3,1.0", max_prompts=40, mix_draw=1.0)
    assert SERVE_DQN == replace(DQNConfig(), buffer_size=100_000, learning_starts=500, gamma=0.9,
                                target_update_interval=250, paired_actions=True)
    assert (MAIN_JOB_EPISODES.episode_steps, MAIN_JOB_EPISODES.max_prompts) == (64, 40)
    assert preset("bild").hyperparams == {} and RunConfig.from_spec(preset("bild")) == RunConfig()
    paper = gymnasium.make("BiLD-v0", backend="replay", max_prompts=32, max_new_tokens=32, pair="tiny-random")
    assert paper.unwrapped.config == replace(preset_env("paper"), pair="tiny-random")
    for name in PRESETS:  # each preset's env as gymnasium.make builds it from the preset's arguments
        assert preset(name).make(pair="tiny-random").unwrapped.config == replace(preset_env(name), pair="tiny-random")
    quick = RunConfig.from_spec(preset("quick"))  # the README's first run: the toy pair, 2,000 steps
    assert quick == replace(RunConfig(), env=replace(RunConfig().env, pair="tiny-random"),
                            train=replace(TrainConfig(), total_timesteps=2_000))
    with pytest.raises(UsageError, match="choose one of bild, quick, paper, serve"):
        preset("fast")


def test_train_py_env_names_the_preset_a_new_run_starts_from(tmp_path, capsys):
    from agents.bild.training import parse_config
    from agents.commands import train_main

    with pytest.raises(SystemExit):
        train_main(["--env", "paper", "--help"])
    page = " ".join(capsys.readouterr().out.split())
    assert "(this page: --env paper)" in page and "--env {bild,quick,paper,serve}" in page
    assert "(17) (default: paper)" in page  # the preset's defaults shown
    argv = ["--pair", "tiny-random", "--log-dir", str(tmp_path), "--max-prompts", "4"]
    config, resume = parse_config(argv, "paper")
    assert resume is False and config.env == replace(preset_env("paper"), pair="tiny-random", max_prompts=4)
    assert config.train.run_name.startswith("BiLD-v0-tiny-random__dqn__0__")  # the setting's registered id
    assert parse_config(argv)[0].train.run_name.startswith("BiLD-v1-tiny-random__")
    saved = RunSpec.from_json(json.loads(config.spec().text()))
    assert saved.env_id == "BiLD-v1" and RunConfig.from_spec(saved) == config  # a run of the env, in its setting


def test_a_preset_added_is_a_new_runs_defaults_in_either_trainer(tmp_path, monkeypatch):
    """``PRESETS`` is where a setting is named: one added for either env is what ``train.py --env NAME`` starts from
    (its env, hyperparameters and run options), through the trainer of its env."""
    from agents import commands
    from agents.bild import training as bild_training
    from agents.serve import training as serve_training
    from agents.serve.options import SERVE_DQN, parse, preset_config
    from agents.spec import PRESETS
    from bild_env.serving.env import ServingConfig

    assert preset_config("serve") == ServeTrainConfig() and preset_config().dqn == SERVE_DQN
    monkeypatch.setitem(PRESETS, "serve-tiny", ("a toy serving run", RunSpec(
        "BiLD-Serve-v0", {"pair": "tiny-random", "max_batch": 4, "actions": {"off_switch": False}}, "dqn",
        {"gamma": 0.5}, {"n_envs": 2, "eval_episodes": 3})))
    monkeypatch.setitem(PRESETS, "bild-ppo", ("a toy PPO run", RunSpec(
        "BiLD-v1", {"pair": "tiny-random", "backend": "replay"}, "ppo", {"n_steps": 16}, {"total_timesteps": 64})))
    from agents.serve.options import build_parser

    page = " ".join(build_parser("serve-tiny").format_help().split())  # the other env's page: BiLD-v1's
    assert "This page lists --env serve-tiny's options; python train.py --env bild --help lists the other's" in page
    train, env = parse(["--log-dir", str(tmp_path), "--seed", "3"], "serve-tiny")
    assert (env.pair, env.max_batch, env.actions.off_switch, env.actions.rollback_values) == (
        "tiny-random", 4, False, ServingConfig().actions.rollback_values)  # over the env's own defaults
    assert (train.dqn.gamma, train.dqn.learning_starts, train.n_envs, train.eval_episodes, train.seed) == (
        0.5, 2_000, 2, 3, 3)  # over DQNConfig's and ServeTrainConfig's own, the command line over it
    from agents.bild.training import parse_config

    config, _ = parse_config(["--log-dir", str(tmp_path)], "bild-ppo")
    assert (config.train.algo, config.ppo.n_steps, config.train.total_timesteps, config.env.pair) == (
        "ppo", 16, 64, "tiny-random")
    seen = []
    for room in (serve_training.ServeRoom, bild_training.BildRoom):
        monkeypatch.setattr(room, "from_argv", classmethod(lambda cls, rest, preset: seen.append((cls, preset)) or cls))
    monkeypatch.setattr("agents.training.run", lambda room: 0)
    assert commands.train_main(["--env", "serve-tiny"]) == commands.train_main(["--env", "bild-ppo"]) == 0
    assert seen == [(serve_training.ServeRoom, "serve-tiny"), (bild_training.BildRoom, "bild-ppo")]


def test_a_preset_named_with_resume_is_noted_as_unused(monkeypatch, capsys):
    """``--resume`` goes on with the run's saved options: ``--env paper`` beside it changes nothing, and says so."""
    from agents import commands
    from agents.bild.training import BildRoom

    seen = []
    monkeypatch.setattr(BildRoom, "from_argv", classmethod(lambda cls, rest, preset: seen.append((rest, preset)) or cls))
    monkeypatch.setattr("agents.training.run", lambda room: 0)
    assert commands.train_main(["--env", "paper", "--resume", "logs/r"]) == 0
    assert "note: --env paper gives a new run's options; --resume goes on with the run's saved ones" in (
        capsys.readouterr().err)
    assert commands.train_main(["--env", "bild", "--resume", "logs/r"]) == 0  # the env's own name: nothing to say
    assert commands.train_main(["--env", "paper", "--run-name", "r"]) == 0  # a new run: the preset is used
    assert capsys.readouterr().err == "" and [p for _, p in seen] == ["paper", "bild", "paper"]
