"""BiLD-v1's part of ``python train.py`` (the trainer is ``agents.training``, one for both envs).

This module owns BiLD-v1's command line (``BildOptions`` on ``agents.common.parse``'s skeleton; ``build_parser``,
``parse_config``: a new run's config, every hyperparameter checked before anything is made, or ``--resume``'s saved
one with the few options it may change), the envs of a run (``make_envs``) and ``BildRoom``, what the trainer adds
for BiLD-v1: SB3's algorithms (DQN, PPO, A2C, SAC), ``EvalCallback`` on validation prompts, and an exact resume.

A resumed run goes on as the uninterrupted one would have: its callbacks count steps from the run's
start, its checkpoints hold the state of ``agents.bild.resume``, and what a killed run wrote after its
last checkpoint is removed (``agents.bild.runs.discard_after``). Where a run's files lie and how they are
read back is ``agents.bild.runs``'s, over what both envs' runs share (``agents.common``).
"""

from __future__ import annotations

import argparse
import json
import operator
import sys
from dataclasses import dataclass, fields, replace
from functools import partial
from pathlib import Path

import gymnasium as gym
import torch
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback, EvalCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv, VecEnv

from agents.algos import algo_class, make_model
from agents.bild import resume
from agents.bild.callbacks import EpisodeMetricsCallback, EvalMetricsCallback
from agents.bild.runs import Evaluations, discard_after, layout, save_config
from agents.common.callbacks import KeepBestModel, StopRequest
from agents.common.checkpoints import Checkpoint, Layout
from agents.common.folders import check_log_dir
from agents.common.parse import RESUMABLE, TrainOptions, run_name
from agents.common.replay_buffer import load_replay_buffer
from agents.spec import preset as spec_preset
from agents.training import Room, TrainResult
from agents.config import (ALGOS, ConfigError, RunConfig, TrainConfig, check_algo, hyperparams_help,
                           check_consistency, check_device_here)
from agents.vec import BatchedReplayVecEnv
from agents.wrappers import CyclePrompts, RecordEpisode, RecordSummaries
from bild_env.decoding.costs import CostModel
from bild_env import ENV_ID, preset_names
from bild_env.cli import given, key_values
from bild_env.config import over
from bild_env.draft_cap import AUTO
from bild_env.command import UsageError
from bild_env.env import BildEnv, EnvConfig, setting_id, validate
from bild_env.replay.dataset import load_where_needed

TRAIN_FIELDS = {f.name for f in fields(TrainConfig)}


# ------------------------------------------------------------------------------------------------
# 1. options
class BildOptions(TrainOptions):
    """BiLD-v1's options (``agents.common.parse``): the run's (``TrainConfig``), every algorithm's hyperparameters
    (``--hyperparams`` of ``--algo``) and the env's (``EnvConfig``)."""

    preset, env_id, run_class, env_class = "bild", ENV_ID, TrainConfig, EnvConfig
    resume_help = ("continue a run (its folder, or its name under --log-dir) from its latest checkpoint with its saved "
                   "config; only " + ", ".join("--" + o.replace("_", "-") for o in RESUMABLE
                                               if o in TRAIN_FIELDS and o != "run_name") + " may be given with it")

    def __init__(self, preset: str | None = None) -> None:
        super().__init__(preset)
        self.defaults = RunConfig.from_spec(spec_preset(self.preset))
        self.run_defaults, self.env_defaults = self.defaults.train, self.defaults.env
        self.page = dict(
            prog="train.py",
            description="Train a Stable-Baselines3 agent (DQN by default; --algo) to choose BiLD's fallback/rollback "
                        f"thresholds at every decoding step of {ENV_ID} (this page: --env {self.preset}). --env serve "
                        "trains on BiLD-Serve-v0 instead: python train.py --env serve --help lists its options.",
            epilog="examples:\n  python train.py --total-timesteps 2000 --seed 1\n"
                   "  python train.py --env serve --seed 1                  # BiLD-Serve-v0 (python train.py --env serve --help)\n"
                   "  python train.py --pair opt --pair-options device=cuda --dataset wikitext --run-name opt-dqn\n"
                   "  python train.py --resume opt-dqn                      # or --resume logs/opt-dqn\n"
                   "  tensorboard --logdir logs")
        self.hyperparams_help = ("the hyperparameters of --algo (agents.config's DQNConfig, PPOConfig, A2CConfig, "
                                 "SACConfig; RL Zoo's --hyperparams), e.g. --hyperparams learning_starts=500 "
                                 "gamma=0.9, --algo ppo --hyperparams n_steps=32 net_arch=64,64. Keys and defaults: "
                                 + hyperparams_help(self.defaults).replace("%", "%%"))

    def new(self, namespace: argparse.Namespace) -> tuple[RunConfig, bool]:
        defaults = self.defaults
        config = RunConfig(train=replace(defaults.train, **given(namespace, "train")),
                           env=over(defaults.env, given(namespace, "env")),
                           **{name: replace(getattr(defaults, name), **algo_hyperparams(namespace, name))
                              for name in ALGOS})
        env = config.env
        try:  # the env's own checks, before a folder is made (no model loads for them)
            validate(env)
        except ValueError as err:
            raise ConfigError(f"bad environment option: {err}") from None
        check_algo(config.train.algo, env.actions.space)
        check_all_actions(config)
        for note in check_consistency(config):
            print(f"train.py: note: {note}", file=sys.stderr, flush=True)
        check_device_here(config.train.policy_device, "--policy-device")
        if not env.pair_options.custom and env.pair not in preset_names():
            raise ConfigError(f"unknown --pair {env.pair!r}: choose one of {preset_names()} (or give --pair-options "
                              "draft=... target=...)")
        if config.train.run_name is None:
            name = run_name(setting_id(env.arguments()), env, config.train.exp_name, config.train.seed)
            config = replace(config, train=replace(config.train, run_name=name))
        check_log_dir(Path(config.train.log_dir))
        return config, False

    def load(self, run_dir: Path, changes: dict) -> tuple[RunConfig, bool]:
        saved = RunConfig.load(run_dir / "config.json")
        config = replace(saved, train=replace(saved.train, **changes))
        check_device_here(config.train.policy_device, "--policy-device")
        return config, True


build_parser, parse_config = BildOptions.build_parser, BildOptions.parse  # the page (docs/training.md), the config


def algo_hyperparams(namespace: argparse.Namespace, name: str) -> dict:
    """The ``--hyperparams`` given, as fields of algorithm ``name``'s config, where ``--algo`` is ``name``."""
    if not namespace.hyperparams or getattr(namespace, "train.algo", TrainConfig().algo) != name:
        return {}
    try:
        return key_values(type(getattr(RunConfig(), name)), namespace.hyperparams, "--hyperparams")
    except UsageError as err:
        raise ConfigError(str(err)) from None


def check_all_actions(config: RunConfig) -> None:
    """``all_actions`` reads every action's step from the replay trees into DQN's one-step replay buffer."""
    if config.train.algo != "dqn" or not config.dqn.all_actions:
        return
    if config.env.backend != "replay":
        raise ConfigError("the DQN learns from every action (all_actions, the default), read from the replay "
                          "trees: it needs --backend replay; to train on the live backend give --hyperparams "
                          "all_actions=false")
    if config.dqn.n_steps != 1:
        raise ConfigError(f"the DQN learns from every action (all_actions, the default): one-step transitions of "
                          f"actions not taken, which n-step returns cannot chain: give --hyperparams n_steps=1 (got "
                          f"{config.dqn.n_steps}) or all_actions=false")


# ------------------------------------------------------------------------------------------------
# 2. envs, logger, callbacks
@dataclass
class Envs:
    train: VecEnv  # n_envs Monitor(RecordEpisode(BiLD-v1)) on the training split (BatchedReplayVecEnv on replay, else DummyVecEnv)
    eval: gym.Env  # Monitor(RecordSummaries(CyclePrompts(BiLD-v1 on validation)))
    recorder: RecordSummaries
    eval_episodes: int  # one per validation prompt used
    cycle: CyclePrompts  # the evaluation env's validation prompts (its place in the cycle is saved with a checkpoint)

    @property
    def first(self) -> BildEnv:
        """The first training env (its runner's tree store and cost model are the ones all training envs share)."""
        return self.train.envs[0].unwrapped


def make_envs(config: RunConfig) -> Envs:
    env = load_where_needed(config.env)  # the paper's grid on a decoding dataset: its lossy steps load the models
    kwargs = {f.name: getattr(env, f.name) for f in fields(EnvConfig)}
    n_envs = config.train.n_envs
    check_all_actions(config)  # also for configs made in code, not by new_config
    peek = config.train.algo == "dqn" and config.dqn.all_actions  # every action's step, for AllActionsDQN
    batched = config.env.backend == "replay" and (n_envs > 1 or peek)
    try:  # the envs share the models (load_pair's cache), the cost model and the references (on disk)
        scale = config.train.reward_scale  # applied outside Monitor: episode rewards logged stay in env units
        train_env = make_vec_env(_recorded_env, n_envs=n_envs, env_kwargs=kwargs | {"render_mode": None},
                                 vec_env_cls=BatchedReplayVecEnv if batched else DummyVecEnv,
                                 vec_env_kwargs={"peek": True, "reward_scale": scale} if peek else None,
                                 wrapper_class=None if scale == 1 else gym.wrappers.TransformReward,
                                 wrapper_kwargs=None if scale == 1 else {"func": partial(operator.mul, scale)})
        eval_env = gym.make(ENV_ID, **(kwargs | {"split": "validation"}))
    except (ValueError, TypeError, RuntimeError) as err:  # RuntimeError: a model that could not be fetched
        raise ConfigError(f"bad environment option: {err}") from err
    n = min(config.train.eval_episodes, len(eval_env.unwrapped.prompts))
    cycle = CyclePrompts(eval_env, range(n))
    recorder = RecordSummaries(cycle)
    envs = Envs(train_env, Monitor(recorder), recorder, n, cycle)
    # the BLEU references of every prompt the run will use, several prompts per batched greedy decode
    envs.first.references.prefetch(envs.first.prompts, progress=config.train.progress_bar)
    eval_env.unwrapped.references.prefetch(eval_env.unwrapped.prompts[:n], progress=config.train.progress_bar)
    return envs


def _recorded_env(**kwargs) -> gym.Env:
    """A training env: BiLD-v1 with its episode in progress recorded (saved with each checkpoint)."""
    return RecordEpisode(gym.make(ENV_ID, **kwargs))


# ------------------------------------------------------------------------------------------------
# 3. the room of the trainer (agents.training)
class BildRoom(Room):
    """BiLD-v1's runs for ``agents.training.train``: SB3's algorithms (DQN by default, ``agents.algos``), evaluations
    on validation prompts by SB3's ``EvalCallback``, and an exact resume: a checkpoint holds the generators, the
    episodes in progress and the evaluations (``agents.bild.resume``), so a resumed run goes on as the uninterrupted one
    would."""

    env_id, options = ENV_ID, BildOptions

    def __init__(self, config: RunConfig, resume: bool = False) -> None:
        t = config.train
        self.config, self.resume = config, resume
        self.run_dir = Path(t.log_dir) / t.run_name
        self.total, self.n_envs, self.checkpoint_freq = t.total_timesteps, t.n_envs, t.checkpoint_freq
        self.progress_bar, self.log_interval, self.stdout = t.progress_bar, t.log_interval, t.verbose > 0
        self.keep = t.keep_replay_buffers
        self.envs: Envs | None = None
        self.state: dict | None = None  # the checkpoint's resume state (None: a new run, or an older version's)
        self.evaluation: EvalCallback | None = None
        self.evaluations = Evaluations()
        self.ended = False

    read_state = staticmethod(resume.read_state)

    @property
    def layout(self) -> Layout:
        """By the run's spec: its algorithm's names (an older version's run wrote no state)."""
        return layout(self.run_dir)

    @property
    def algorithm(self) -> type[BaseAlgorithm]:
        return algo_class(self.layout.prefix)

    def setup(self, start: Checkpoint | None) -> VecEnv:
        config, run_dir = self.config, self.run_dir
        if config.train.torch_threads:
            torch.set_num_threads(config.train.torch_threads)
        if start is not None and config.env.cost_model is None:  # the latency the run's rewards came from
            config = replace(config, env=replace(config.env, cost_model=run_cost_model(run_dir)))
        self.envs = make_envs(config)
        if config.env.actions.max_draft_len == AUTO:  # the cap the envs chose is the run's (its evaluations, a resume)
            config = replace(config, env=replace(config.env, actions=replace(
                config.env.actions, max_draft_len=self.envs.first.config.actions.max_draft_len)))
        self.config = config
        save_config(config, run_dir / "config.json")
        self.envs.first.cost_model.save(run_dir / "cost_model.json")  # the latency the rewards were computed with
        if self.envs.first.cost_profile is not None:  # nobody should take these rewards for this machine's clock
            self.say(f"costs charged by {self.envs.first.cost_profile.label}")
        return self.envs.train

    def make_model(self, env: VecEnv, start: Checkpoint | None):
        t = self.config.train
        if start is None:
            return make_model(self.config, env, seed=t.seed, device=t.policy_device, verbose=t.verbose)
        self.state = resume.read_state(start.state) if start.state is not None else None
        model = algo_class(t.algo).load(start.model, env=env, device=t.policy_device, force_reset=self.state is None)
        if start.replay_buffer is not None:
            load_replay_buffer(model, start.replay_buffer)
        if self.state is None:  # a checkpoint of an older version: new episodes, generators seeded anew
            self.warn("this checkpoint holds no resume state (an older version's): the envs start new episodes")
            model.set_random_seed(t.seed + model.num_timesteps)
        return model

    def restore(self, model, start: Checkpoint) -> None:
        state = self.state
        saved = state.get("evaluations") if state else None
        self.evaluations = (Evaluations.from_dict(saved) if saved is not None
                            else Evaluations.read(self.run_dir / "evaluations.npz")).upto(model.num_timesteps)
        discard_after(self.run_dir, model.num_timesteps, self.evaluations, self.say)

    def callbacks(self, model, stop: StopRequest) -> list[BaseCallback]:
        """The env's episode metrics, and the evaluations on validation prompts every ``eval_freq`` steps (SB3's
        ``EvalCallback``, the evaluations the run made so far given to it)."""
        t, envs = self.config.train, self.envs
        callbacks: list[BaseCallback] = [EpisodeMetricsCallback(replay_store=getattr(envs.first.runner, "store", None))]
        if t.eval_freq > 0:
            self.evaluation = EvalCallback(envs.eval, callback_on_new_best=KeepBestModel(self.run_dir),
                                           callback_after_eval=EvalMetricsCallback(envs.recorder),
                                           n_eval_episodes=envs.eval_episodes,
                                           eval_freq=max(1, t.eval_freq // t.n_envs),
                                           log_path=str(self.run_dir), best_model_save_path=None, deterministic=True,
                                           verbose=t.verbose)
            self.evaluations.to(self.evaluation)
            callbacks.append(self.evaluation)
        return callbacks

    def before_learn(self, model) -> None:
        if self.state is not None:
            changed = resume.restore(model, self.envs.train, self.envs.cycle, self.state)  # sets the generators
            if changed:
                self.warn(f"the episodes of envs {changed} did not end where the checkpoint's did (the env or its cost "
                          "model changed?): training goes on from where they are")

    def state_of(self, model) -> dict:
        saved = Evaluations.of(self.evaluation).to_dict() if self.evaluation is not None else None
        return resume.capture(model, self.envs.train, self.envs.cycle, saved)

    def finish(self, model, interrupted: str | None) -> list[dict]:
        self.ended = True
        return []

    def close(self) -> None:
        if self.envs is None:
            return
        self.envs.train.close()  # replay trees are written to disk here
        self.envs.eval.close()
        if self.ended:
            report_replay(self.envs, self.run_dir)

    def report(self, result: TrainResult) -> None:
        print(f"done at step {result.steps}: final model {result.run_dir / 'model.zip'}; "
              f"tensorboard --logdir {self.config.train.log_dir}", flush=True)


def run_cost_model(run_dir: Path) -> CostModel | None:
    """The cost model a run's rewards were computed with (``cost_model.json``), or None (the cache's is used then)."""
    path = run_dir / "cost_model.json"
    if not path.is_file():
        return None
    try:
        return CostModel.load(path)
    except Exception as err:  # noqa: BLE001 - a damaged file: say so, and use the cache's
        print(f"train.py: cannot read {path} ({type(err).__name__}: {err}); the cost model of the cache is used",
              file=sys.stderr, flush=True)
        return None


def report_replay(envs: Envs, run_dir: Path) -> None:
    """With the replay backend: how many prefixes the trees hold, their memory, hits and misses (printed and saved)."""
    reports = {name: env.runner.store.report() for name, env in (("train", envs.first), ("eval", envs.eval.unwrapped))
               if hasattr(env.runner, "store")}
    if not reports:
        return
    (run_dir / "replay_report.json").write_text(json.dumps(reports, indent=2) + "\n")
    r = reports["train"]
    print(f"replay (train env): {r['nodes']} prefixes in {r['trees_in_memory']} prompt trees, {r['bytes'] / 1e6:.2f} MB "
          f"({r['bytes_per_prefix']:.0f} bytes per prefix); {r['hits']} answers from the trees, {r['misses']} misses "
          f"filled by {r['fills']} model forwards")


