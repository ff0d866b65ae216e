"""Training a DQN on BiLD-Serve-v0: what ``python train.py --env serve`` runs.

    python train.py --env serve                                   # smollm2: the main job (README)
    python train.py --env serve --pair tiny-random --total-timesteps 2000
    tensorboard --logdir logs                                     # the "serving" tab: agent vs fixed policies

Every option is a field of ``ServeTrainConfig`` (the run and the DQN) or of
``bild_env.serving.env.ServingConfig`` (the env; trained on "train", evaluated on "validation"). Where the
command line is silent the env starts from ``TRAIN_ENV``: the lossless grid (five fallbacks at rollback 0.5,
and speculation off), loads 0.05/0.15/0.3/1.0 drawn per episode, each episode its own mix of the domains
(``mix_draw`` 1: Dirichlet weights around the even mix), 64-step episodes, 40 prompts per domain.

The DQN learns from every action at every state it visits (``--all-actions``, the default): the env's
``peek`` gives each action's exact step from the replay trees, and ``agents.dqn.AllActionsDQN`` stores
them all, so the actions are compared on the same batch rather than across batches. Each gradient step then samples
states and fits all their actions' Q-values together (``--paired-actions``, the default): the noise their rewards
share moves them alike and leaves their differences to the differences of the targets.

Evaluations run the greedy agent on the same ``--eval-episodes`` validation episodes every time (fixed
seeds: the same requests and arrivals; with a ``levels:`` load, that many at each level as a constant load), beside policies run once on those episodes at the start
(speculation off, the ``--reference-actions``, the best fixed action, the per-load and the per-batch-size table chosen
on them: ``rule_references``): TensorBoard's custom-scalars tab "serving" draws the
agent's speedup over target-only serving (x) and its return beside theirs, on one chart each.
``best_model.zip`` is the best evaluation's model. Every ``--checkpoint-freq`` steps a checkpoint holds
the model, its replay buffer (compressed; the newest only) and the evaluations so far; Ctrl-C or SIGTERM
saves one at once and ``model.zip``. ``--resume --run-name <name>`` goes on from the newest checkpoint
with the run's saved options (its step count, the replay buffer, the evaluations and the best model kept;
the training envs start new episodes, and the run ends at the first rollout boundary at or past the
total, up to ``train_freq`` steps later than an uninterrupted run would). ``train.lock`` keeps a run
folder to one process.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import torch
from stable_baselines3.common.callbacks import BaseCallback, CallbackList
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import DummyVecEnv

from agents import serving_runs
from agents.config import DQNConfig
from agents.dqn import AllActionsDQN
from agents.phases import Phases, peak_memory_mb
from agents.run_report import comparison, episode_stats, format_table, next_commands, reference_values
from agents.serving_runs import STEP_KEY
from agents.serving_rules import BatchTable, Fixed, choose_batch_table, returns_of
from agents.wrappers import PeekAll
from bild_env import SERVE_ID
from bild_env.cli import add_options, given
from bild_env.fill.serving import decodes
from bild_env.serving.env import ServingConfig, ServingEnv, validate

ENV_SKIP = ("split",)
PHASES = ("fetch and convert", "time the tables", "build trees", "train")  # the main job's, one progress line each
CONFIG_FORMAT = 2  # of a run's config.json (1: no "format"; its target_update_interval was divided by n_envs twice)
# The env options training starts from where the command line gives none (the env's own defaults otherwise):
# the lossless grid (rollback 0.5 < ln 2: every answer is the target's greedy one) and speculation off, 6 actions.
# On BiLD-v1's whole grid (26 actions) the same DQN lost to speculation off on validation (README, Serving).
# Each episode its own mix (mix_draw 1): chosen on validation over the fixed mix, on the mix and on one with a domain
# the agents never saw (README, Serving).
# The run's length where --total-timesteps is not given, by the dtype the pair runs in: what a 2-core CPU trains in
# the main job's time. bfloat16 (native units, Zen 5): 20,000 steps in 7 min 37 s of 2-core wall time, tables
# included. float32 forwards cost 2-3x as much (an AVX2-only Zen 3: 32 min for 20,000 steps, 10 of them timing the
# full tables): 8,000 steps and the sparse tables keep the job under 15 minutes there.
TIMESTEPS_BY_DTYPE = {"bfloat16": 20_000, "float16": 20_000, "float32": 8_000}
TRAIN_ENV = replace(ServingConfig(), rollback_values=(0.5,), load="levels:0.05,0.15,0.3,1.0", episode_steps=64,
                    max_prompts=40, mix_draw=1.0)


@dataclass
class ServeTrainConfig:
    """Options of a DQN run on BiLD-Serve-v0 (the run and the DQN's hyperparameters)."""

    total_timesteps: int | None = None  # env steps (batched decoding steps) over all envs (default: by the pair's dtype, TIMESTEPS_BY_DTYPE)
    seed: int = 0  # seeds the Q-network, exploration and the training envs' episodes
    n_envs: int = 4  # training envs stepped together (each a whole batch of requests)
    run_name: str | None = None  # folder under log_dir (default: BiLD-Serve-v0-<pair>__dqn__<seed>__<unix time>)
    log_dir: str = "logs"
    eval_freq: int = 2_500  # env steps between evaluations on validation episodes (0: never)
    eval_episodes: int = 8  # validation episodes per evaluation, per load level with a levels profile (the same seeds every time)
    reference_actions: tuple[int, ...] = ()  # fixed actions drawn beside the agent in TensorBoard (off is always drawn; default: the grid's pairs with fallback 0.45 and rollback 0.5 or 1, e.g. 15 and 16)
    checkpoint_freq: int = 5_000  # env steps between checkpoints (model only)
    learning_rate: float = 1e-4  # Adam step size (at the start, when learning_rate_final is given)
    learning_rate_final: float | None = 1e-6  # if given, the step size decays linearly to this over total_timesteps (settles the policy)
    buffer_size: int = 100_000  # env steps kept (each stores one transition per action with all_actions)
    learning_starts: int = 500
    batch_size: int = 256
    gamma: float = 0.9  # the load changes within tens of steps: a short horizon
    train_freq: int = 4
    target_update_interval: int = 250  # env steps (over all envs) between target network updates
    exploration_fraction: float = 0.3
    exploration_final_eps: float = 0.05
    net_arch: tuple[int, ...] = (128, 128)
    all_actions: bool = True  # learn from every action at every visited state (the env's exact peek; agents.dqn)
    paired_actions: bool = True  # with all_actions: a gradient step samples states and fits all their actions together (agents.dqn; --no-paired-actions: transitions one at a time, the earlier default; off without all_actions)
    torch_threads: int = 1
    fill_trees: bool = True  # where the machine has 2+ cores: a second process fills the training prompts' replay trees during the tree phase (each prompt decoded alone by every action), so that training meets them filled
    progress_bar: bool = True
    resume: bool = False  # go on with the run --run-name from its newest checkpoint (its saved options are used)

    def __post_init__(self) -> None:
        if self.total_timesteps is not None and (isinstance(self.total_timesteps, bool)
                                                 or not isinstance(self.total_timesteps, int) or self.total_timesteps < 1):
            raise ValueError(f"--total-timesteps must be an integer >= 1, got {self.total_timesteps!r}")
        for name in ("n_envs", "eval_episodes", "checkpoint_freq", "batch_size", "buffer_size",
                     "train_freq", "target_update_interval", "torch_threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        for name in ("eval_freq", "learning_starts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 0, got {v!r}")
        for name, lo, hi in (("learning_rate", 0.0, 1.0), ("gamma", 0.0, 1.0), ("exploration_fraction", 0.0, 1.0),
                             ("exploration_final_eps", 0.0, 1.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or not lo <= v <= hi:
                raise ValueError(f"--{name.replace('_', '-')} must be a number in [{lo}, {hi}], got {v!r}")
        if self.learning_rate == 0:
            raise ValueError("--learning-rate must be above 0")
        if self.learning_rate_final is not None and (
                isinstance(self.learning_rate_final, bool) or not isinstance(self.learning_rate_final, (int, float))
                or not np.isfinite(self.learning_rate_final) or not 0 < self.learning_rate_final <= self.learning_rate):
            raise ValueError(f"--learning-rate-final must be a number in (0, --learning-rate], got {self.learning_rate_final!r}")
        if not self.net_arch or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.net_arch):
            raise ValueError(f"--net-arch must be layer sizes >= 1, got {self.net_arch!r}")
        if self.batch_size > self.buffer_size:
            raise ValueError(f"--batch-size {self.batch_size} is larger than --buffer-size {self.buffer_size}")
        if self.resume and not self.run_name:
            raise ValueError("--resume needs --run-name: the run folder under --log-dir to go on with")
        if self.run_name is not None and (not isinstance(self.run_name, str) or not self.run_name
                                          or any(c in self.run_name for c in "/\\") or self.run_name in (".", "..")):
            raise ValueError(f"--run-name must be a folder name inside --log-dir (no '/', not '.' or '..'), "
                             f"got {self.run_name!r}")


def default_timesteps(env: ServingConfig) -> int:
    """``TIMESTEPS_BY_DTYPE`` for the dtype ``env``'s pair will run in (decided as ``load_pair`` decides, without
    loading it; 20,000 for any other dtype)."""
    from bild_env.models.device import default_device, resolve_dtype
    from bild_env.models.pairs import get_preset

    dtype = env.dtype or ("auto" if env.draft and env.target else get_preset(env.pair).dtype)
    name = str(resolve_dtype(dtype, env.device or default_device())).removeprefix("torch.")
    return TIMESTEPS_BY_DTYPE.get(name, 20_000)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="train.py --env serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, "train", ServeTrainConfig, ServeTrainConfig(), title="run and DQN")
    add_options(parser, "env", ServingConfig, TRAIN_ENV, skip=ENV_SKIP, title=f"environment ({SERVE_ID})")
    return parser


RESUME_OPTIONS = ("total_timesteps", "progress_bar", "torch_threads", "log_dir", "run_name", "resume")


def parse(argv: list[str] | None) -> tuple[ServeTrainConfig, ServingConfig]:
    """The run's options; with ``--resume``, the run's saved ones with the few a resume may change."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        train = replace(ServeTrainConfig(), **given(ns, "train"))
        if train.resume:
            other = sorted(set(given(ns, "train")) - set(RESUME_OPTIONS)) + sorted(given(ns, "env"))
            if other:
                raise ValueError(f"--resume goes on with the run's saved options; only --total-timesteps, "
                                 f"--progress-bar and --torch-threads may change, not --{', --'.join(o.replace('_', '-') for o in other)}")
            run_dir = Path(train.log_dir) / train.run_name
            if not (run_dir / "config.json").is_file():
                raise ValueError(f"--resume: no run in {run_dir} (no config.json): check --run-name and --log-dir")
            saved, env = saved_configs(run_dir)
            return replace(saved, **given(ns, "train")), env
        if given(ns, "train").get("paired_actions") and not train.all_actions:
            raise ValueError("--paired-actions fits every action of a sampled state together: it needs --all-actions")
        env = replace(TRAIN_ENV, **given(ns, "env"))
        validate(env)  # before any model loads
        if env.action != "discrete":
            raise ValueError(f"--action {env.action} gives a Box action, and this trainer's DQN takes a Discrete one: "
                             "train such an env with SAC (gymnasium.make('bild_env:BiLD-Serve-v0', action='continuous')), "
                             "or leave --action at 'discrete'")
        if train.run_name is None:  # named now, so that every message can say where the run is
            train = replace(train, run_name=f"{SERVE_ID}-{env.pair}__dqn__{train.seed}__{int(time.time())}")
        if env.per_domain:
            raise ValueError("--per-domain makes the action MultiDiscrete (one per domain), and this trainer's DQN "
                             "takes a Discrete one: train such an env with an SB3 algorithm for MultiDiscrete actions "
                             "(PPO, A2C) on gymnasium.make('bild_env:BiLD-Serve-v0', per_domain=True), or use "
                             "--observe-domain (one action for the batch, the domain shares observed)")
        n = len(env.fallback_values) * len(env.rollback_values) + env.off_switch
        if any(not 0 <= a < n for a in train.reference_actions):
            raise ValueError(f"--reference-actions must be actions of the env's grid (0-{n - 1}), "
                             f"got {train.reference_actions}")
        from agents.runs import check_log_dir

        check_log_dir(Path(train.log_dir))  # writable, before anything loads
    except (TypeError, ValueError, KeyError) as err:  # ConfigError is a ValueError
        parser.error(str(err))
    return train, env


def dqn_config(cfg: ServeTrainConfig) -> DQNConfig:
    """BiLD-v1's ``DQNConfig`` with the serving run's hyperparameters (its ``sb3_kwargs`` converts them for SB3: steps
    per vec step, the buffer one row per action with ``all_actions``, the step-size schedule); the buffer holds at
    most the run's steps (a buffer the run cannot fill is never allocated)."""
    names = {f.name for f in fields(DQNConfig)} & {f.name for f in fields(ServeTrainConfig)}
    return replace(DQNConfig(), **({n: getattr(cfg, n) for n in names}
                                   | {"buffer_size": min(cfg.buffer_size, cfg.total_timesteps), "gradient_steps": 1,
                                      "paired_actions": cfg.paired_actions and cfg.all_actions}))


def default_references(env: ServingEnv) -> tuple[int, ...]:
    """The grid's actions with fallback 0.45 and rollback 0.5 or 1 (BiLD-v1's best fixed pairs on smollm2)."""
    return tuple(a for a in range(env.n_grid) if env.thresholds(a) in ((0.45, 0.5), (0.45, 1.0)))


def env_kwargs(env: ServingConfig, split: str) -> dict:
    return {f.name: getattr(env, f.name) for f in fields(ServingConfig)
            if f.metadata.get("cli", True) and f.name != "split"} | {"split": split}


class ServingEval(BaseCallback):
    """Every ``freq`` steps: the greedy agent on fixed validation seeds, beside fixed policies run once on them."""

    def __init__(self, envs: list[ServingEnv], seeds: list[int], freq: int, references: dict[str, dict],
                 run_dir: Path) -> None:
        super().__init__()
        self.envs, self.seeds, self.freq, self.references, self.run_dir = envs, seeds, freq, references, run_dir
        self.best = -np.inf
        self.history: list[dict] = []
        self.next_at = freq

    def _on_step(self) -> bool:
        if self.freq and self.num_timesteps >= self.next_at:
            self.next_at += self.freq
            self.evaluate()
        return True

    def evaluate(self) -> dict:
        from agents.runs import save_best_model

        returns, speedups = returns_over(self.envs, self.model, self.seeds)
        row = {"step": self.num_timesteps} | episode_stats(returns, speedups)
        self.history.append(row)
        self.logger.record(STEP_KEY, self.num_timesteps)  # every progress.csv row says its step (resume keeps rows by it)
        self.logger.record("eval/mean_reward", row["return"])
        self.logger.record("serving/agent_speedup_x", row["speedup"])
        self.logger.record("serving/agent_return", row["return"])
        for name, ref in self.references.items():
            ret, speed = reference_values(ref)
            self.logger.record(f"serving/{name}_speedup_x", speed)
            self.logger.record(f"serving/{name}_return", ret)
        self.logger.dump(self.num_timesteps)
        if row["return"] > self.best:
            self.best = row["return"]
            save_best_model(self.model, self.run_dir, row["return"])  # a copy under checkpoints/, then best_model.zip
        write_evaluations(self.run_dir, self.history)
        return row


def write_evaluations(run_dir: Path, history: list[dict]) -> None:
    """``evaluations.json``: every evaluation so far (step, return, speedup, return_ci), standard JSON, written whole."""
    from agents.runs import write_atomic

    text = json.dumps(history, indent=1, allow_nan=False) + "\n"
    write_atomic(run_dir / "evaluations.json", lambda f: f.write(text.encode()))


def rule_references(envs: list[ServingEnv], seeds: list[int], extra: tuple[int, ...],
                    progress=None) -> dict[str, dict]:
    """What the agent is drawn beside, on the validation episodes (``run_report.episode_stats``: the mean return and
    speedup over the episodes, with their intervals): every fixed action is run once;
    ``best_fixed`` is the one with the best mean over the envs (grid search), ``load_table`` the best per env (load
    level), both chosen on these same episodes (a line for the agent to reach, not an estimate of either rule on
    new episodes: ``python evaluate.py --env serve`` chooses on validation and judges on test); ``batch_table`` the
    best action per batch-size bucket, from every action's exact step rewards at the states the per-load table visits
    there (``choose_batch_table``); plus "off" and the ``extra`` fixed actions. ``progress`` (a tqdm-like bar,
    optional) is advanced by one per episode run, as it ends."""
    env = envs[0]
    if progress is not None:
        progress.total = (progress.total or 0) + len(envs) * len(seeds) * (env.action_space.n + 2)

    def episodes(e: ServingEnv, policy) -> tuple[np.ndarray, np.ndarray]:
        parts = []
        for seed in seeds:  # returns_of(e, policy, seeds), each episode counted as it ends
            parts.append(returns_of(e, policy, [seed])[:2])
            if progress is not None:
                progress.update(1)
        return np.concatenate([r for r, _ in parts]), np.concatenate([s for _, s in parts])

    runs = {a: [episodes(e, Fixed(a)) for e in envs] for a in range(env.action_space.n)}
    mean = {a: float(np.mean([r.mean() for r, _ in runs[a]])) for a in runs}

    def name(a: int) -> str:
        t = env.thresholds(a)
        return "off" if t is None else "fixed_{:g}_{:g}".format(*t)

    def summary(parts) -> dict:
        return episode_stats(np.concatenate([r for r, _ in parts]), np.concatenate([s for _, s in parts]))

    best = max(mean, key=mean.get)
    table = [max(runs, key=lambda a, i=i: runs[a][i][0].mean()) for i in range(len(envs))]
    out = {"best_fixed": summary(runs[best]), "load_table": summary([runs[a][i] for i, a in enumerate(table)])}
    # the per-batch-size table, from every action's exact step rewards at the states the per-load table visits
    buckets, _ = choose_batch_table(envs, [Fixed(a) for a in table], seeds, list(runs))
    if progress is not None:
        progress.update(len(envs) * len(seeds))
    off = env.action_space.n - 1 if env.config.off_switch else best
    rule = BatchTable(buckets, off, env.config.max_batch, env.config.batch_scale)
    out["batch_table"] = summary([episodes(e, rule) for e in envs])
    for a in dict.fromkeys(((env.action_space.n - 1,) if env.config.off_switch else ()) + tuple(extra)):
        out[name(a)] = summary(runs[a])
    return out


def eval_loads(load: str) -> list[str]:
    """The loads validation runs at: each level of a ``levels:`` profile as a constant load (every level weighs the
    same, whatever the seeds would draw), else the profile itself."""
    from bild_env.serving.load import LoadProfile

    profile = LoadProfile.parse(load)
    return [f"constant:{u:g}" for u in profile.values] if profile.kind == "levels" else [load]


def returns_over(envs: list[ServingEnv], policy, seeds: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Returns and speedups of ``policy`` on every env's episodes of ``seeds``, together."""
    parts = [returns_of(env, policy, seeds)[:2] for env in envs]
    return np.concatenate([r for r, _ in parts]), np.concatenate([s for _, s in parts])


class EpisodeMetrics(BaseCallback):
    """Training episodes' summaries in TensorBoard under ``serve/`` (units in the names)."""

    def _on_step(self) -> bool:
        for info in self.locals.get("infos", []):
            s = info.get("episode_summary")
            if s:
                self.logger.record_mean("serve/speedup_x", s["speedup"])
                self.logger.record_mean("serve/goodput_tok_per_s", s["goodput_tok_s"])
                self.logger.record_mean("serve/regret_nats_per_token", s["regret"])
                self.logger.record_mean("serve/mean_batch_requests", s["mean_batch"])
                self.logger.record("serve/cost_profile", info.get("cost_profile", "machine"), exclude=("stdout", "log", "csv", "json"))
        return True


def custom_scalars(run_dir: Path, references: list[str]) -> None:
    """TensorBoard's custom-scalars layout: the agent beside the fixed policies, one chart per quantity."""
    from torch.utils.tensorboard import SummaryWriter

    layout = {"serving": {  # best_fixed, load_table and batch_table: chosen on the same validation episodes
        "speedup over target-only serving at the same load (x)": [
            "Multiline", ["serving/agent_speedup_x"] + [f"serving/{r}_speedup_x" for r in references]],
        "validation return (time saved in single-request units, minus regret)": [
            "Multiline", ["serving/agent_return"] + [f"serving/{r}_return" for r in references]],
    }}
    with SummaryWriter(str(run_dir)) as writer:
        writer.add_custom_scalars(layout)


def resume_hint(run_dir: Path) -> str:
    """The command that continues the run in ``run_dir``, as it can be pasted."""
    return f"python train.py --env serve --resume --run-name {run_dir.name} --log-dir {run_dir.parent}"


def train(cfg: ServeTrainConfig, env_cfg: ServingConfig, say=print, phases: Phases | None = None) -> TrainResult:
    """Train a new run, or (``cfg.resume``) go on with one from its newest complete checkpoint; the caller holds no
    lock (this takes ``train.lock``). A folder whose run stopped before its first complete checkpoint is started
    again in place (``say`` tells), what it wrote moved into ``set_aside/<n>/``, never deleted; so is one stopped
    later whose checkpoints all cannot be read. A finished run (``model.zip`` at its total) none of whose checkpoints
    can be read is refused, untouched. ``phases`` (default: new ones, saying through ``say``) times the job's ``PHASES``
    and prints a progress line per phase; their summary is written to the run's ``summary.json``."""
    from agents.runs import ConfigError, RunLock, zip_steps

    torch.set_num_threads(cfg.torch_threads)
    if cfg.total_timesteps is None:
        cfg = replace(cfg, total_timesteps=default_timesteps(env_cfg))
        say(f"training for {cfg.total_timesteps} steps (the default for the pair's dtype; --total-timesteps overrides)")
    if env_cfg.cost_profile or env_cfg.train_profiles:  # nobody should take these rewards for this machine's clock
        say("costs charged by " + (f"cost profile {env_cfg.cost_profile}" if env_cfg.cost_profile else
                                    f"one of the cost profiles {', '.join(env_cfg.train_profiles)} per episode"
                                    + (f", varied up to x{env_cfg.vary_profiles:g}" if env_cfg.vary_profiles > 1 else "")))
    run_dir = Path(cfg.log_dir) / (cfg.run_name or f"{SERVE_ID}-{env_cfg.pair}__dqn__{cfg.seed}__{int(time.time())}")
    fresh = not run_dir.exists()
    lock = RunLock.acquire(run_dir)  # RunInUse (a ConfigError) at once when another process trains it
    try:
        start = serving_runs.resume_point(run_dir, say) if (run_dir / "config.json").is_file() else None
        done = zip_steps(run_dir / "model.zip") if start is None and (run_dir / "model.zip").is_file() else None
        if done is not None and done >= cfg.total_timesteps:
            raise ConfigError(f"{run_dir} finished training (model.zip at step {done}) but none of its checkpoints can "
                              "be read, so it cannot go on; its models and logs are kept as they are: evaluate it with "
                              f"`python evaluate.py --env serve --model {run_dir}`, or train anew under another "
                              "--run-name")
        if cfg.resume and start is None:
            say(f"{run_dir} has no complete checkpoint (stopped before its first one): starting it again from step 0 "
                "with its saved options")
        elif not cfg.resume and start is not None:
            raise ConfigError(f"{run_dir} is a run with a checkpoint at step {start.steps} already: continue it with "
                              f"`{resume_hint(run_dir)}`, or give another --run-name")
        elif not cfg.resume and (run_dir / "config.json").is_file():
            say(f"{run_dir} holds a run stopped before its first complete checkpoint: starting it again in place")
        elif not cfg.resume and any(p.name != "train.lock" for p in run_dir.iterdir()):
            raise ConfigError(f"{run_dir} is no run folder of train.py (no config.json) but holds files: delete it "
                              "or give another --run-name")
        if start is None and (aside := serving_runs.set_aside(run_dir)) is not None:
            say(f"what the earlier attempt wrote (models, logs, evaluations, checkpoints) is kept in {aside}")
        return _train(cfg, env_cfg, run_dir, start, say, phases or Phases(PHASES, say))
    finally:
        lock.release(remove_empty_folder=fresh)


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    interrupted: str | None  # the signal that stopped training at a checkpoint, or None when the run reached its total
    table: list[dict] = field(default_factory=list)  # the agent against the rules (``run_report.comparison``)


def saved_configs(run_dir: Path) -> tuple[ServeTrainConfig, ServingConfig]:
    """A run's saved options (``config.json``), its ``log_dir`` and ``run_name`` where ``run_dir`` is now; a
    ``ConfigError`` naming the env when the folder is a BiLD-v1 run."""
    from agents.runs import ConfigError

    path = run_dir / "config.json"
    try:
        saved = json.loads(path.read_bytes())
        if not isinstance(saved, dict) or not all(isinstance(saved.get(k, {}), dict) for k in ("train", "env")):
            raise ValueError("not an object with 'train' and 'env' objects")
    except (OSError, ValueError) as err:  # JSON, bytes that are not text
        raise ConfigError(f"{path} cannot be read ({type(err).__name__}: {' '.join(str(err).split())[:120]}): restore "
                          "it from a copy of the run, or train anew under another --run-name") from None
    if saved.get("env_id", SERVE_ID) != SERVE_ID or "dqn" in saved or "env" not in saved or "train" not in saved:
        raise ConfigError(f"{run_dir} is a {saved.get('env_id', 'BiLD-v1')} run, not a {SERVE_ID} one: use it without "
                          "--env serve (python train.py --resume RUN, python evaluate.py --model RUN)")
    train_fields = {f.name for f in fields(ServeTrainConfig)}
    t = {k: tuple(v) if isinstance(v, list) else v for k, v in saved["train"].items() if k in train_fields - {"resume"}}
    # the run is this folder, wherever it now lies: a run named by default saved run_name None, and a copied run its old place
    t |= {"log_dir": str(run_dir.parent), "run_name": run_dir.name}
    t.setdefault("all_actions", False)  # runs saved before the option learned from the taken action only
    t.setdefault("learning_rate_final", None)  # ... at a constant step size
    t.setdefault("paired_actions", False)  # ... sampling transitions one at a time
    if saved.get("format", 1) < 2:  # format 1 divided the target update interval by n_envs before SB3 divided it again
        t["target_update_interval"] = max(1, t.get("target_update_interval", 1_000) // t.get("n_envs", 4))
    e = {k: tuple(v) if isinstance(v, list) else v for k, v in saved["env"].items() if k != "split"}
    e.setdefault("batch_scale", "linear")  # runs saved before the option read the batch size on a linear scale
    e.setdefault("draft_vocab", 0)  # runs saved before the option trained with the draft's full head
    try:
        train, env = replace(ServeTrainConfig(), **t, resume=True), replace(ServingConfig(), **e)
        validate(env)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{path} holds options that cannot be used ({err}): correct them there, or train anew under "
                          "another --run-name") from None
    return train, env




def prepare(env_cfg: ServingConfig, phases: Phases) -> None:
    """The job's first phases: 1. fetch and convert the pair's models (once per cache folder; a custom pair is used
    as given), 2. load them and time the cost tables the env charges (once per machine; ``bild_env.decoding.costs``),
    so that the envs made next find both cached."""
    from bild_env.decoding import costs
    from bild_env.models.pairs import get_preset, load_pair

    custom = bool(env_cfg.draft and env_cfg.target)
    if custom:
        phases.skip(PHASES[0], "a custom pair, used as given")
    else:
        with phases.phase(PHASES[0], unit="model"):
            get_preset(env_cfg.pair).resolve()
    with phases.phase(PHASES[1], unit="forward") as bar:
        pair = load_pair(None if custom else env_cfg.pair, draft=env_cfg.draft, target=env_cfg.target,
                         tokenizer=env_cfg.tokenizer, device=env_cfg.device, dtype=env_cfg.dtype, lean=env_cfg.lean,
                         draft_vocab=env_cfg.draft_vocab)  # as ServingEnv loads it: the envs get this one
        if env_cfg.cost_model is None and env_cfg.cost_profile is None and not env_cfg.train_profiles:
            bar.plan(costs.forwards_to_time(pair))  # the whole count before the first forward
            costs.load_or_calibrate_batched(pair, progress=bar)  # a profile charges its own tables: nothing to time


def start_fill(cfg: ServeTrainConfig, env_cfg: ServingConfig):
    """The fill of the training prompts' replay trees in a second process (``bild_env.fill.serving.WorkloadFill``),
    started; None without ``cfg.fill_trees`` or on a machine with one core."""
    import os

    from bild_env.fill.serving import WorkloadFill

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not cfg.fill_trees or cores < 2:
        return None
    return WorkloadFill(env_kwargs(env_cfg, "train"))


class PhaseProgress(BaseCallback):
    """Advances the train phase's bar by the env steps of every vectorised step."""

    def __init__(self, bar) -> None:
        super().__init__()
        self.bar = bar

    def _on_step(self) -> bool:
        self.bar.update(self.training_env.num_envs)
        return True


def write_summary(run_dir: Path, phases: Phases, result: dict) -> dict:
    """``summary.json``: the job's phases (wall and CPU seconds), peak memory, the machine, and ``result``."""
    from agents.runs import write_atomic
    from bild_env.models.device import machine_description

    summary = phases.summary() | {"machine": machine_description("cpu"), "command": sys.argv} | result
    text = json.dumps(summary, indent=1, default=str) + "\n"
    write_atomic(run_dir / "summary.json", lambda f: f.write(text.encode()))
    return summary


def _train(cfg: ServeTrainConfig, env_cfg: ServingConfig, run_dir: Path, start, say, phases: Phases) -> TrainResult:
    from agents.callbacks import Checkpoints, StopAtCheckpoint, StopRequest
    from agents.runs import load_replay_buffer, restore_best_model, write_atomic
    from agents.training import stop_on_signals

    prepare(env_cfg, phases)
    train_env, eval_envs, filler = None, [], None
    try:
        with phases.phase(PHASES[2], unit="episode") as bar:  # the fixed policies' episodes fill the replay trees
            filler = start_fill(cfg, env_cfg)  # the training prompts' trees, on the other core
            train_env = make_vec_env(SERVE_ID, n_envs=cfg.n_envs, seed=cfg.seed + (start.steps if start else 0),
                                     vec_env_cls=DummyVecEnv,
                                     env_kwargs=env_kwargs(env_cfg, "train") | {"render_mode": None},
                                     wrapper_class=PeekAll if cfg.all_actions else None)
            eval_envs = [ServingEnv(**env_kwargs(env_cfg, "validation") | {"load": load})
                         for load in eval_loads(env_cfg.load)]
            if start is None:
                config = {"env_id": SERVE_ID, "format": CONFIG_FORMAT, "train": asdict(cfg),
                          "env": env_kwargs(env_cfg, "train")}
                text = json.dumps(config, indent=1, default=str) + "\n"
                write_atomic(run_dir / "config.json", lambda f: f.write(text.encode()))
            seeds = [10_000 + i for i in range(cfg.eval_episodes)]
            if filler is not None:
                bar.total += decodes(env_cfg, sum(train_env.envs[0].unwrapped.workload.sizes.values()))
            references = rule_references(eval_envs, seeds,
                                         tuple(cfg.reference_actions or default_references(eval_envs[0])),
                                         filler.counted(bar) if filler is not None else bar)
            if filler is not None and not filler.wait(bar):
                say(f"the fill of the training prompts' replay trees stopped (exit code {filler.process.exitcode}; "
                    "its error is above): training fills what is missing as it goes")
        custom_scalars(run_dir, list(references))
        if start is None:
            model = AllActionsDQN("MlpPolicy", train_env, seed=cfg.seed, device="cpu",
                                  **dqn_config(cfg).sb3_kwargs(cfg.n_envs, train_env.action_space.n))
        else:
            model = AllActionsDQN.load(start.model, env=train_env, device="cpu")
            load_replay_buffer(model, start.replay_buffer)
        model.set_logger(serving_runs.make_logger(run_dir, None if start is None else start.steps, say))
        evaluator = ServingEval(eval_envs, seeds, cfg.eval_freq, references, run_dir)
        if start is not None:  # the run as it stood at the checkpoint; what a killed run wrote after it goes
            state = serving_runs.read_state(start.state, start.steps)
            evaluator.history, evaluator.best, evaluator.next_at = state["history"], state["best"], state["next_eval_at"]
            serving_runs.discard_after(run_dir, start.steps, say)
            write_evaluations(run_dir, evaluator.history)
            restore_best_model(run_dir, serving_runs.best_of(evaluator.history), say)
            say(f"resuming {run_dir.name} at step {start.steps} of {cfg.total_timesteps}")
        last = []

        def checkpoint():
            if not last or last[-1].steps != model.num_timesteps:  # not saved at this step already
                state = serving_runs.state_of(model.num_timesteps, evaluator.history, evaluator.best, evaluator.next_at)
                last.append(serving_runs.save_checkpoint(model, run_dir, state))
            return last[-1]

        every = max(1, cfg.checkpoint_freq // cfg.n_envs)  # vectorised steps; saved at the next rollout start
        stop = StopRequest()
        interrupted = None
        with phases.phase(PHASES[3], unit="step", total=max(0, cfg.total_timesteps - model.num_timesteps)) as bar:
            callbacks = [evaluator, EpisodeMetrics(), Checkpoints(checkpoint, every, stop), PhaseProgress(bar)]
            for callback in callbacks:
                callback.n_calls = model.num_timesteps // cfg.n_envs  # counted from the run's start, as uninterrupted
            try:
                with stop_on_signals(stop):
                    if model.num_timesteps < cfg.total_timesteps:
                        model.learn(cfg.total_timesteps - model.num_timesteps, callback=CallbackList(callbacks),
                                    progress_bar=cfg.progress_bar, reset_num_timesteps=start is None)
            except StopAtCheckpoint as why:
                interrupted = str(why)
            if interrupted is None and (not evaluator.history or evaluator.history[-1]["step"] != model.num_timesteps):
                evaluator.evaluate()  # the final model, once
            checkpoint()
            write_atomic(run_dir / "model.zip", model.save)
        model.logger.close()
        best = max(evaluator.history, key=lambda row: row["return"]) if evaluator.history else None
        table = comparison(evaluator.history, references)
        write_summary(run_dir, phases, {"steps": int(model.num_timesteps), "interrupted": interrupted,
                                        "references": references, "best_evaluation": best,
                                        "last_evaluation": evaluator.history[-1] if evaluator.history else None,
                                        "result": {"table": table, "next": next_commands(run_dir)}})
        return TrainResult(run_dir, int(model.num_timesteps), interrupted, table)
    finally:
        if filler is not None:  # ended already, unless the job stopped during the tree phase
            filler.stop()
        if train_env is not None:
            train_env.close()
        for env in eval_envs:
            env.close()


def main(argv: list[str] | None = None) -> int:
    from agents.runs import ConfigError
    from agents.training import sigterm_as_ctrl_c
    from bild_env.cli import setup_logging

    setup_logging()
    cfg, env_cfg = parse(argv)
    run_dir = Path(cfg.log_dir) / (cfg.run_name or "?")

    def say(message: str) -> None:
        print(f"train.py: {message}", flush=True)

    try:
        with sigterm_as_ctrl_c():
            result = train(cfg, env_cfg, say)
    except (FileExistsError, ConfigError) as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before training started, or a second Ctrl-C / SIGTERM during it
        then = (f"continue with `{resume_hint(run_dir)}` (from its newest complete checkpoint)"
                if cfg.run_name and serving_runs.complete_checkpoints(run_dir) else "start it again (the same command)")
        print(f"train.py: stopped at once, nothing saved since the last checkpoint; {then}", file=sys.stderr, flush=True)
        return 130
    if result.interrupted:
        print(f"train.py: {result.interrupted}: stopped at step {result.steps} with a checkpoint; continue with "
              f"`{resume_hint(result.run_dir)}`", file=sys.stderr, flush=True)
        return 130
    peak = peak_memory_mb()
    print(f"run written to {result.run_dir} (step {result.steps}); peak memory {peak['max']:.0f} MB (this process "
          f"{peak['self']:.0f} MB, its largest child {peak['children']:.0f} MB; in summary.json)")
    if result.table:
        print(f"\nthe agent against the rules on the run's {result.table[0]['episodes'] or ''} validation episodes "
              "(mean [95% interval]; the rules chosen on these same episodes):")
        print(format_table(result.table))
    print("\nnext:\n" + "\n".join(f"  {command}" for command in next_commands(result.run_dir)))
    return 0
