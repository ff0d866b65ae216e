"""Training an agent (DQN by default, or PPO, A2C, SAC) on BiLD-v1: what ``python train.py`` runs.

This module owns the command line (``build_parser``, ``parse_config``: a new run's config, every
hyperparameter checked before anything is made, or ``--resume``'s saved one with the few options it
may change), the envs and callbacks of a run (``make_envs``, ``make_callbacks``), and the training
loop itself (``train``: Ctrl-C or SIGTERM stops it at the next checkpoint boundary with a checkpoint;
``main``: the run folder's lock, the messages and exit codes).

A resumed run goes on as the uninterrupted one would have: its callbacks count steps from the run's
start, its checkpoints hold the state of ``agents.bild.resume``, and what a killed run wrote after its
last checkpoint is removed (``agents.bild.runs.discard_after``). Where a run's files lie and how they are
read back is ``agents.bild.runs``'s, over what both trainers share (``agents.common``).
"""

from __future__ import annotations

import argparse
import json
import operator
import sys
import time
from dataclasses import dataclass, fields, replace
from collections.abc import Callable
from functools import partial
from pathlib import Path

import gymnasium as gym
import torch
from stable_baselines3.common.callbacks import BaseCallback, EvalCallback, ProgressBarCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv, VecEnv

from agents.algos import algo_class, make_model
from agents.bild import resume
from agents.bild.callbacks import EpisodeMetricsCallback, EvalMetricsCallback
from agents.bild.runs import (Evaluations, checkpoints, discard_after, latest_checkpoint, layout, resume_point,
                              save_config)
from agents.common.callbacks import (Checkpoints, KeepBestModel, StopAtCheckpoint, StopRequest, sigterm_as_ctrl_c,
                                     stop_on_signals)
from agents.common.checkpoints import Checkpoint, save_checkpoint
from agents.common.files import write_atomic
from agents.common.folders import (RESUMABLE, check_log_dir, check_resume, check_start, find_run, resume_hint,
                                   set_aside)
from agents.common.lock import RunInUse, RunLock, check_not_in_use
from agents.common.logs import make_logger
from agents.common.replay_buffer import load_replay_buffer
from agents.spec import preset as spec_preset
from agents.config import (HYPERPARAMS, ConfigError, RunConfig, TrainConfig, check_algo, hyperparams_help,
                           check_consistency, check_device_here)
from agents.vec import BatchedReplayVecEnv
from agents.wrappers import CyclePrompts, RecordEpisode, RecordSummaries
from bild_env.decoding.costs import CostModel
from bild_env import ENV_ID, preset_names
from agents.common.env_choice import add_env_option
from bild_env.cli import add_options, given, key_values
from bild_env.config import over
from bild_env.migrate import refuse_moved
from bild_env.draft_cap import AUTO
from bild_env.command import UsageError
from bild_env.env import BildEnv, EnvConfig, setting_id, validate
from bild_env.replay.dataset import load_where_needed

TRAIN_FIELDS = {f.name for f in fields(TrainConfig)}
ENV_NOT_CLI = ("split",)  # train.py trains on "train" and evaluates on "validation"


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    num_timesteps: int
    interrupted: bool  # stopped by Ctrl-C (a checkpoint was saved; --resume continues)
    checkpoint: Checkpoint


# ------------------------------------------------------------------------------------------------
# 1. options
def build_parser(preset: str = "bild") -> argparse.ArgumentParser:
    """``train.py``'s options for a BiLD-v1 run, the defaults shown those of ``preset`` (``agents.spec.PRESETS``)."""
    parser = argparse.ArgumentParser(
        prog="train.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a Stable-Baselines3 agent (DQN by default; --algo) to choose BiLD's fallback/rollback thresholds at every "
                    f"decoding step of {ENV_ID} (this page: --env {preset}). --env serve trains on BiLD-Serve-v0 "
                    "instead: python train.py --env serve --help lists its options.",
        epilog="examples:\n  python train.py --total-timesteps 2000 --seed 1\n"
               "  python train.py --env serve --seed 1                  # BiLD-Serve-v0 (python train.py --env serve --help)\n"
               "  python train.py --pair opt --pair-options device=cuda --dataset wikitext --run-name opt-dqn\n"
               "  python train.py --resume opt-dqn                      # or --resume logs/opt-dqn\n"
               "  tensorboard --logdir logs",
    )
    parser.add_argument("--resume", metavar="RUN", default=None,
                        help="continue a run (its folder, or its name under --log-dir) from its latest checkpoint "
                             "with its saved config; only " + ", ".join("--" + o.replace("_", "-") for o in RESUMABLE
                                                                        if o in TRAIN_FIELDS and o != "run_name")
                             + " may be given with it")
    defaults = RunConfig.from_spec(spec_preset(preset))
    add_options(parser, "train", TrainConfig, defaults.train, title="run")
    parser.add_argument("--hyperparams", metavar="KEY=VALUE", nargs="+", action="extend", default=[],
                        help="the hyperparameters of --algo (agents.config's DQNConfig, PPOConfig, A2CConfig, "
                             "SACConfig; RL Zoo's --hyperparams), e.g. --hyperparams learning_starts=500 gamma=0.9, "
                             "--algo ppo --hyperparams n_steps=32 net_arch=64,64. Keys and defaults: "
                             + hyperparams_help(defaults).replace("%", "%%"))
    add_env_option(parser, preset, "train.py")
    add_options(parser, "env", EnvConfig, defaults.env, skip=ENV_NOT_CLI, title=f"environment ({ENV_ID})")
    return parser


def parse_config(argv: list[str] | None = None, preset: str = "bild") -> tuple[RunConfig, Checkpoint | None]:
    """The run's config (a new one from ``preset``'s) and, for ``--resume``, the checkpoint to start from; exits with a
    message on bad options."""
    parser = build_parser(preset)
    refuse_moved(parser, argv, EnvConfig)
    namespace = parser.parse_args(argv)
    try:
        if namespace.resume is not None:
            return resume_config(namespace)
        return new_config(namespace, preset), None
    except ConfigError as err:
        parser.error(str(err))


def new_config(namespace: argparse.Namespace, preset: str = "bild") -> RunConfig:
    defaults = RunConfig.from_spec(spec_preset(preset))
    config = RunConfig(train=replace(defaults.train, **given(namespace, "train")),
                       env=over(defaults.env, given(namespace, "env")),
                       **{name: replace(getattr(defaults, name), **algo_hyperparams(namespace, name))
                          for name in HYPERPARAMS})
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
        pair = "custom" if env.pair_options.custom else env.pair
        name = f"{setting_id(env.arguments())}-{pair}__{config.train.exp_name}__{config.train.seed}__{int(time.time())}"
        config = replace(config, train=replace(config.train, run_name=name))
    check_log_dir(Path(config.train.log_dir))
    run_dir = Path(config.train.log_dir) / config.train.run_name
    if run_dir.exists():
        check_not_in_use(run_dir)
    check_start(run_dir, False, read_checkpoint(run_dir), config.train.total_timesteps, say, ENV_ID)
    return config


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


def say(message: str) -> None:
    print(f"train.py: {message}", flush=True)


def read_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The newest checkpoint of the run in ``run_dir`` whose files all load (each newer one skipped is named); None
    where there is none (no run there, or none can be read)."""
    if not (run_dir / "config.json").is_file() or not checkpoints(run_dir):
        return None
    return resume_point(run_dir, lambda why: print(f"train.py: {why}", file=sys.stderr, flush=True))


def resume_config(namespace: argparse.Namespace) -> tuple[RunConfig, Checkpoint | None]:
    changes = given(namespace, "train")
    check_resume(list(changes), [*given(namespace, "env")] + (["hyperparams"] if namespace.hyperparams else [])
                 + (["run_name"] if "run_name" in changes else []), TRAIN_FIELDS - {"run_name"})  # --resume names it
    run_dir = find_run(namespace.resume, Path(changes.get("log_dir", TrainConfig().log_dir)))
    check_not_in_use(run_dir)  # at once, before reading the checkpoints
    saved = RunConfig.load(run_dir / "config.json")
    overrides = changes | {"log_dir": str(run_dir.parent), "run_name": run_dir.name}
    config = replace(saved, train=replace(saved.train, **overrides))
    check_device_here(config.train.policy_device, "--policy-device")
    checkpoint = read_checkpoint(run_dir)
    check_start(run_dir, True, checkpoint, config.train.total_timesteps, say, ENV_ID)
    if checkpoint is not None and checkpoint.steps >= config.train.total_timesteps:
        raise ConfigError(f"{run_dir.name} has run {checkpoint.steps} of its {config.train.total_timesteps} steps; "
                          f"give --total-timesteps above {checkpoint.steps} to train longer")
    return config, checkpoint


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


def make_callbacks(config: RunConfig, run_dir: Path, envs: Envs, num_timesteps: int, save: Callable[[], object],
                   stop: StopRequest, evaluations: Evaluations) -> tuple[list[BaseCallback], EvalCallback | None]:
    """The run's callbacks (and its evaluation callback, None without evaluations), scheduled from the run's start.

    SB3's callbacks count their calls (one per vectorised step of n_envs env steps) from 0 in each process; on
    resume at ``num_timesteps`` they are set to count from the run's start, so that evaluations and checkpoints
    fall at the steps of the uninterrupted run. ``evaluations`` are those the run has made so far.
    """
    t = config.train
    checkpoint_calls, eval_calls = max(1, t.checkpoint_freq // t.n_envs), max(1, t.eval_freq // t.n_envs)
    callbacks: list[BaseCallback] = [
        EpisodeMetricsCallback(replay_store=getattr(envs.first.runner, "store", None)),  # None: live backend
        Checkpoints(save, checkpoint_calls, stop),
    ]
    evaluation = None
    if t.eval_freq > 0:
        evaluation = EvalCallback(envs.eval, callback_on_new_best=KeepBestModel(run_dir),
                                  callback_after_eval=EvalMetricsCallback(envs.recorder),
                                  n_eval_episodes=envs.eval_episodes, eval_freq=eval_calls, log_path=str(run_dir),
                                  best_model_save_path=None, deterministic=True, verbose=t.verbose)
        evaluations.to(evaluation)
        callbacks.append(evaluation)
    if t.progress_bar:
        callbacks.append(ProgressBarCallback())
    for callback in callbacks:
        callback.n_calls = num_timesteps // t.n_envs  # the vectorised steps taken since the run's start
    return callbacks, evaluation


# ------------------------------------------------------------------------------------------------
# 3. training
def train(config: RunConfig, resume_from: Checkpoint | None = None) -> TrainResult:
    """Train (or continue, from ``resume_from``) until ``config.train.total_timesteps`` env steps.

    The caller holds the run folder (``RunLock``). A new start in the folder of an earlier attempt (``check_start``)
    first moves what that attempt wrote into ``set_aside/<n>/``. Ctrl-C or SIGTERM stops training at the next
    checkpoint boundary (``Checkpoints``) with a checkpoint; a second one stops it at once, without (the run then
    resumes from its last checkpoint). The result says which.
    """
    t = config.train
    run_dir = Path(t.log_dir) / t.run_name
    if resume_from is None and (aside := set_aside(run_dir)) is not None:
        say(f"what the earlier attempt wrote (models, logs, evaluations, checkpoints) is kept in {aside}")
    if t.torch_threads:
        torch.set_num_threads(t.torch_threads)
    if resume_from is not None and config.env.cost_model is None:  # the latency the run's rewards came from
        config = replace(config, env=replace(config.env, cost_model=run_cost_model(run_dir)))
    envs = make_envs(config)
    state = None
    if resume_from is None:
        model = make_model(config, envs.train, seed=t.seed, device=t.policy_device, verbose=t.verbose)
    else:
        state = resume.read_state(resume_from.state) if resume_from.state is not None else None
        model = algo_class(t.algo).load(resume_from.model, env=envs.train, device=t.policy_device,
                                        force_reset=state is None)
        if resume_from.replay_buffer is not None:
            load_replay_buffer(model, resume_from.replay_buffer)
        if state is None:  # a checkpoint of an older version: new episodes, generators seeded anew
            print("train.py: this checkpoint holds no resume state (an older version's): the envs start new episodes",
                  file=sys.stderr, flush=True)
            model.set_random_seed(t.seed + model.num_timesteps)
    if config.env.actions.max_draft_len == AUTO:  # the cap the envs chose is the run's (its evaluations, a resume)
        config = replace(config, env=replace(config.env, actions=replace(
            config.env.actions, max_draft_len=envs.first.config.actions.max_draft_len)))
    save_config(config, run_dir / "config.json")
    envs.first.cost_model.save(run_dir / "cost_model.json")  # the latency the rewards were computed with
    if envs.first.cost_profile is not None:  # nobody should take these rewards for this machine's clock
        print(f"train.py: costs charged by {envs.first.cost_profile.label}", flush=True)
    resumed_at = None if resume_from is None else model.num_timesteps
    model.set_logger(make_logger(run_dir, resumed_at, say, stdout=t.verbose > 0))
    evaluations = Evaluations()
    if resume_from is not None:
        evaluations = (Evaluations.from_dict(state["evaluations"]) if state and state.get("evaluations") is not None
                       else Evaluations.read(run_dir / "evaluations.npz")).upto(model.num_timesteps)
        discard_after(run_dir, model.num_timesteps, evaluations, say)
    stop = StopRequest()
    evaluation: EvalCallback | None = None

    last: list[Checkpoint] = []

    def checkpoint() -> Checkpoint:
        if last and last[-1].steps == model.num_timesteps:  # saved at this step already (a due one, then a stop)
            return last[-1]
        saved = Evaluations.of(evaluation).to_dict() if evaluation is not None else None
        last.append(save_checkpoint(model, run_dir, layout(run_dir, t.algo),
                                    resume.capture(model, envs.train, envs.cycle, saved), t.keep_replay_buffers))
        return last[-1]

    callbacks, evaluation = make_callbacks(config, run_dir, envs, model.num_timesteps, checkpoint, stop, evaluations)
    if state is not None:
        changed = resume.restore(model, envs.train, envs.cycle, state)  # last before training: sets the generators
        if changed:
            print(f"train.py: the episodes of envs {changed} did not end where the checkpoint's did (the env or its cost "
                  "model changed?): training goes on from where they are", file=sys.stderr, flush=True)
    interrupted, saved = None, None
    try:
        try:
            with stop_on_signals(stop):
                model.learn(t.total_timesteps - model.num_timesteps, callback=callbacks, log_interval=t.log_interval,
                            reset_num_timesteps=resume_from is None)
        except StopAtCheckpoint as why:
            interrupted = str(why)
        except KeyboardInterrupt:  # the second Ctrl-C or SIGTERM: stopped at once, in the middle of a step
            close_progress_bar(callbacks)
            raise
        close_progress_bar(callbacks)
        if interrupted is None and stop.requested:  # a signal in the last rollout: training ended before it could stop
            interrupted = stop.reason
        saved = checkpoint()
        if interrupted is None:
            write_atomic(run_dir / "model.zip", model.save)
    finally:
        model.logger.close()  # flushes the TensorBoard events
        envs.train.close()  # replay trees are written to disk here
        envs.eval.close()
    report_replay(envs, run_dir)
    return TrainResult(run_dir, model.num_timesteps, interrupted is not None, saved)


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


def close_progress_bar(callbacks: list[BaseCallback]) -> None:
    """After Ctrl-C, leave the terminal clean (SB3 closes the bar only when training ends normally)."""
    for callback in callbacks:
        if isinstance(callback, ProgressBarCallback) and hasattr(callback, "pbar"):
            callback.pbar.close()


def main(argv: list[str] | None = None, preset: str = "bild") -> int:
    """``train.py`` for a BiLD-v1 run: a new one from ``preset``'s options (``agents.spec.PRESETS``), or
    ``--resume``."""
    config, resume_from = parse_config(argv, preset)
    run_dir = Path(config.train.log_dir) / config.train.run_name
    try:
        lock = RunLock.acquire(run_dir)
    except RunInUse as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    start = "resuming at step %d" % resume_from.steps if resume_from else "new run"
    print(f"{start}: {run_dir} ({config.train.total_timesteps} steps in all)", flush=True)
    try:
        with sigterm_as_ctrl_c():
            result = train(config, resume_from)
    except ConfigError as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM before training started, or a second one during it
        found = latest_checkpoint(run_dir) if (run_dir / "config.json").exists() else None
        then = (f"continue from step {found.steps} with: {resume_hint(run_dir)}" if found else
                "start it again (the same command)")
        print(f"train.py: stopped at once, nothing saved; {then}", file=sys.stderr, flush=True)
        return 130
    finally:  # a new run that failed before its config was written leaves no folder behind
        lock.release(remove_empty_folder=not (run_dir / "config.json").exists())
    if result.interrupted:
        print(f"interrupted at step {result.num_timesteps}: saved {result.checkpoint.model.name}"
              + (" and its replay buffer" if result.checkpoint.replay_buffer else "")
              + f"; continue with: {resume_hint(result.run_dir)}", flush=True)
        return 130
    print(f"done at step {result.num_timesteps}: final model {result.run_dir / 'model.zip'}; "
          f"tensorboard --logdir {config.train.log_dir}", flush=True)
    return 0
