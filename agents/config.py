"""Every default of a training run, in three dataclasses: run options, DQN hyperparameters, the env.

``train.py``'s command line is generated from these (``bild_env.cli``); a run saves the three of
them to ``logs/<run_name>/config.json`` and ``--resume`` reads them back. Each field's
``metadata["help"]`` is its ``--help`` text. (Over 450 lines: one declaration, with its help, per option of every
algorithm; no logic beyond the checks of each class.)
"""

from __future__ import annotations

import math
import typing
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from stable_baselines3.common.utils import LinearSchedule

from bild_env.cli import shown_fields
from agents.spec import RunSpec, preset_env
from bild_env.env import EnvConfig, validate
from bild_env.ids import ENV_ID
from bild_env.command import UsageError
from bild_env.models.pairs import DEFAULT_PAIR


class ConfigError(UsageError):
    """A bad run option; the message says what to change (the CLI prints it without a traceback)."""


@dataclass
class TrainConfig:
    """Options of one training run (what to run, where it logs, how often it saves and evaluates)."""

    FLAG_PREFIX: ClassVar[str] = field(default="", metadata={"help": "its command-line options are --<field-name>"})

    algo: str = field(default="dqn", metadata={"help": (
        "dqn (the paper's; discrete action), ppo or a2c (either action), sac (action continuous); its hyperparameters "
        "are in its own group")})
    total_timesteps: int = field(default=30_000, metadata={"help": (
        "env steps (BiLD steps) to train for in all, counting those of a resumed run")})
    seed: int = field(default=0, metadata={"help": (
        "seeds the Q-network, exploration and the training env's prompt order")})
    n_envs: int = field(default=32, metadata={"help": (
        "training envs stepped together (replay backend: their model forwards run batched); steps count over all")})
    exp_name: str = field(default="dqn", metadata={"help": "the experiment part of the default run name"})
    run_name: str | None = field(default=None, metadata={"help": (
        "folder under log_dir (default: <env id>-<pair>__<exp_name>__<seed>__<unix time>, BiLD-v0 in the paper's "
        "setting)")})
    log_dir: str = field(default="logs", metadata={"help": "runs are written to <log_dir>/<run_name>/"})
    checkpoint_freq: int = field(default=5_000, metadata={"help": (
        "env steps between checkpoints (model + replay buffer)")})
    keep_replay_buffers: int = field(default=2, metadata={"help": (
        "newest replay buffers kept in checkpoints/ (0: all); model checkpoints are all kept")})
    eval_freq: int = field(default=5_000, metadata={"help": (
        "env steps between evaluations on validation prompts (0: never)")})
    eval_episodes: int = field(default=30, metadata={"help": (
        "validation prompts per evaluation: the first N of the split, one episode each")})
    reward_scale: float = field(default=1.0, metadata={"help": (
        "training rewards are multiplied by this before the agent learns from them (evaluations and TensorBoard stay "
        "in the env's units)")})
    log_interval: int = field(default=1, metadata={"help": (
        "episodes between TensorBoard writes (bild/ scalars are means over them)")})
    torch_threads: int = field(default=1, metadata={"help": (
        "CPU threads for torch (0: torch's default); with 2+ threads a CPU shared with anything else (even "
        "TensorBoard) can run 10x slower")})
    policy_device: str = field(default="cpu", metadata={"help": (
        'device of the Q-network ("auto": cuda if available); a 128x128 MLP is fastest on cpu')})
    progress_bar: bool = field(default=True, metadata={"help": "show a tqdm/rich progress bar"})
    verbose: int = field(default=0, metadata={"help": (
        "SB3 verbosity: 0 quiet, 1 training tables and evaluation messages")})

    def __post_init__(self) -> None:
        _check_int(self, ("total_timesteps", "n_envs", "checkpoint_freq", "eval_episodes", "log_interval"), minimum=1)
        _check_int(self, ("eval_freq", "keep_replay_buffers", "torch_threads", "verbose"), minimum=0)
        _check_number(self, "reward_scale", low=0, low_open=True)
        if self.run_name is not None and (not self.run_name or "/" in self.run_name or self.run_name in (".", "..")):
            raise ConfigError(f"--run-name must be a non-empty folder name without '/', got {self.run_name!r}")
        check_device_name(self.policy_device, "--policy-device")


@dataclass
class DQNConfig:
    """DQN hyperparameters (Mnih et al. 2015: experience replay + a target network), sized for a slow env.

    A BiLD step runs two language models, so a run has tens of thousands of steps, not millions:
    learning starts, target updates and the exploration schedule are set in hundreds to thousands of
    steps (SB3's defaults assume Atari budgets, e.g. a 10,000-step target update interval).
    """

    FLAG_PREFIX: ClassVar[str] = "--hyperparams "  # its options: train.py --hyperparams KEY=VALUE (the default --algo)

    learning_rate: float = field(default=1e-4, metadata={"help": (
        "Adam step size (at the start, when learning_rate_final is given)")})
    learning_rate_final: float | None = field(default=1e-6, metadata={"help": (
        "if given, the step size decays linearly from learning_rate to this over total_timesteps (settles the policy "
        "at the end of a run)")})
    buffer_size: int = field(default=50_000, metadata={"help": (
        "replay buffer capacity in env steps (one transition each; with all_actions one per action of the grid); the "
        "default holds a whole default run")})
    learning_starts: int = field(default=2_000, metadata={"help": (
        "env steps of pure exploration before the first gradient step")})
    batch_size: int = field(default=256, metadata={"help": "transitions per gradient step"})
    gamma: float = field(default=0.99, metadata={"help": "discount; episodes are at most max_new_tokens steps"})
    n_steps: int = field(default=1, metadata={"help": (
        "n-step returns: rewards of n steps summed before bootstrapping from the target network (SB3's n_steps)")})
    tau: float = field(default=1.0, metadata={"help": "target network update coefficient (1: hard copy)"})
    train_freq: int = field(default=4, metadata={"help": "env steps (over all training envs) between gradient updates"})
    gradient_steps: int = field(default=1, metadata={"help": (
        "gradient steps per update (with several envs: per train_freq env steps, see sb3_kwargs)")})
    target_update_interval: int = field(default=2_000, metadata={"help": "env steps between target network updates"})
    exploration_fraction: float = field(default=0.3, metadata={"help": (
        "share of total_timesteps over which epsilon decays linearly")})
    exploration_initial_eps: float = field(default=1.0, metadata={"help": "epsilon at the start"})
    exploration_final_eps: float = field(default=0.05, metadata={"help": "epsilon after the decay"})
    max_grad_norm: float = field(default=10.0, metadata={"help": "gradient clipping (L2 norm)"})
    net_arch: tuple[int, ...] = field(default=(128, 128), metadata={"help": (
        "Q-network hidden layers (7 -> 128 -> 128 -> 25, as in the paper)")})
    all_actions: bool = field(default=True, metadata={"help": (
        "replay backend: at every step also store what each other action would have done there (read from the replay "
        "trees), so all actions are learned from the same states (all_actions=false: only the action taken)")})
    paired_actions: bool = field(default=False, metadata={"help": (
        "with all_actions: each gradient step samples states and fits every action's Q-value there together "
        "(agents.dqn), so noise common to a state's actions moves them alike")})

    def __post_init__(self) -> None:
        self.net_arch = tuple(self.net_arch)
        _check_int(self, ("buffer_size", "batch_size", "train_freq", "target_update_interval", "n_steps"), minimum=1)
        _check_int(self, ("learning_starts", "gradient_steps"), minimum=0)
        _check_number(self, "learning_rate", low=0, low_open=True)
        if self.learning_rate_final is not None:
            _check_number(self, "learning_rate_final", low=0, high=self.learning_rate, high_name="learning_rate")
        _check_number(self, "gamma", low=0, high=1)
        _check_number(self, "tau", low=0, high=1, low_open=True)
        _check_number(self, "exploration_fraction", low=0, high=1, low_open=True)
        _check_number(self, "exploration_initial_eps", low=0, high=1)
        _check_number(self, "exploration_final_eps", low=0, high=1)
        _check_number(self, "max_grad_norm", low=0, low_open=True)
        _check_net_arch(self)
        if self.paired_actions and not self.all_actions:
            raise ValueError("--hyperparams paired_actions fits every action of a sampled state together, so it needs "
                             "all_actions=true (every action's step stored at every state)")
        if self.paired_actions and self.n_steps != 1:
            raise ValueError(f"--hyperparams paired_actions bootstraps from the next state (1-step targets); got "
                             f"n_steps={self.n_steps}")

    def sb3_kwargs(self, n_envs: int = 1, n_actions: int = 1) -> dict[str, Any]:
        """Keyword arguments for ``stable_baselines3.DQN`` (policy_kwargs carries the MLP layers).

        ``train_freq`` and ``gradient_steps`` count env steps over all envs and are converted for
        SB3 by ``_per_vec_step`` (``target_update_interval`` and ``learning_starts`` SB3 already counts in env steps.)
        With ``all_actions`` every env step stores ``n_actions`` transitions: the buffer is sized for them.
        """
        kwargs = {f.name: getattr(self, f.name) for f in fields(self)
                  if f.name not in ("net_arch", "learning_rate_final", "all_actions", "paired_actions")}
        if self.all_actions:
            kwargs["buffer_size"] = self.buffer_size * n_actions
            if self.paired_actions and n_actions > 1:  # whole states: a multiple of n_envs rows per action
                kwargs["buffer_size"] = -(-self.buffer_size // max(n_envs, 1)) * max(n_envs, 1) * n_actions
                kwargs["paired_actions"] = True
        if self.learning_rate_final is not None:  # SB3 calls a schedule with the progress remaining (1 -> 0)
            kwargs["learning_rate"] = LinearSchedule(self.learning_rate, self.learning_rate_final, 1.0)
        kwargs["train_freq"], kwargs["gradient_steps"] = _per_vec_step(self.train_freq, self.gradient_steps, n_envs)
        return kwargs | {"policy_kwargs": {"net_arch": list(self.net_arch)}}


ALGOS = ("dqn", "ppo", "a2c", "sac")
ACTION_SPACES = {"dqn": ("discrete",), "ppo": ("discrete", "continuous"), "a2c": ("discrete", "continuous"),
                 "sac": ("continuous",)}


@dataclass
class _ActorCriticConfig:
    """What PPO and A2C share (SB3's defaults but the network)."""

    FLAG_PREFIX: ClassVar[str] = ""

    gamma: float = field(default=0.99, metadata={"help": "discount"})
    ent_coef: float = field(default=0.0, metadata={"help": "entropy bonus"})
    vf_coef: float = field(default=0.5, metadata={"help": "value loss weight"})
    max_grad_norm: float = field(default=0.5, metadata={"help": "gradient clipping (L2 norm)"})
    net_arch: tuple[int, ...] = field(default=(128, 128), metadata={"help": "policy and value MLP hidden layers"})

    def __post_init__(self) -> None:  # with the learning_rate, n_steps and gae_lambda every subclass has
        self.net_arch = tuple(self.net_arch)
        _check_int(self, ("n_steps",), minimum=1)
        _check_number(self, "learning_rate", low=0, low_open=True)
        _check_number(self, "gamma", low=0, high=1)
        _check_number(self, "gae_lambda", low=0, high=1)
        _check_number(self, "ent_coef", low=0)
        _check_number(self, "vf_coef", low=0)
        _check_number(self, "max_grad_norm", low=0, low_open=True)
        _check_net_arch(self)

    def sb3_kwargs(self, n_envs: int = 1) -> dict[str, Any]:
        return _kwargs(self)


@dataclass
class PPOConfig(_ActorCriticConfig):
    """PPO hyperparameters (Schulman et al. 2017; SB3's defaults but the rollout length and the network)."""

    FLAG_PREFIX: ClassVar[str] = "--hyperparams "  # its options: train.py --algo <it> --hyperparams KEY=VALUE

    learning_rate: float = field(default=3e-4, metadata={"help": "Adam step size"})
    n_steps: int = field(default=64, metadata={"help": (
        "steps per env per rollout (with 32 envs: 2,048 transitions per update)")})
    batch_size: int = field(default=256, metadata={"help": "minibatch size"})
    n_epochs: int = field(default=10, metadata={"help": "passes over each rollout"})
    gae_lambda: float = field(default=0.95, metadata={"help": "GAE's lambda"})
    clip_range: float = field(default=0.2, metadata={"help": "the policy ratio's clip"})

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_int(self, ("batch_size",), minimum=2)  # SB3 normalises the advantages over each minibatch
        _check_int(self, ("n_epochs",), minimum=1)
        _check_number(self, "clip_range", low=0, low_open=True)


@dataclass
class A2CConfig(_ActorCriticConfig):
    """A2C hyperparameters (Mnih et al. 2016; SB3's defaults but the network)."""

    FLAG_PREFIX: ClassVar[str] = "--hyperparams "  # its options: train.py --algo <it> --hyperparams KEY=VALUE

    learning_rate: float = field(default=7e-4, metadata={"help": "RMSprop step size"})
    n_steps: int = field(default=5, metadata={"help": "steps per env per update"})
    gae_lambda: float = field(default=1.0, metadata={"help": "GAE's lambda (1: plain n-step advantage)"})


@dataclass
class SACConfig:
    """SAC hyperparameters (Haarnoja et al. 2018), sized like the DQN's for a slow env."""

    FLAG_PREFIX: ClassVar[str] = "--hyperparams "  # its options: train.py --algo <it> --hyperparams KEY=VALUE

    learning_rate: float = field(default=3e-4, metadata={"help": "Adam step size"})
    buffer_size: int = field(default=50_000, metadata={"help": "replay buffer capacity (transitions)"})
    learning_starts: int = field(default=2_000, metadata={"help": (
        "env steps of random actions before the first gradient step")})
    batch_size: int = field(default=256, metadata={"help": "transitions per gradient step"})
    tau: float = field(default=0.005, metadata={"help": "target network soft update coefficient"})
    gamma: float = field(default=0.99, metadata={"help": "discount"})
    train_freq: int = field(default=4, metadata={"help": "env steps (over all training envs) between gradient updates"})
    gradient_steps: int = field(default=1, metadata={"help": (
        "gradient steps per update (converted like DQNConfig's for several envs)")})
    ent_coef: str = field(default="auto", metadata={"help": (
        'entropy coefficient: a number > 0 (fixed), "auto" (learned, SAC v2, from 1) or "auto_<x>" (learned, from x > '
        "0)")})
    net_arch: tuple[int, ...] = field(default=(128, 128), metadata={"help": "actor and critic MLP hidden layers"})

    def __post_init__(self) -> None:
        self.net_arch = tuple(self.net_arch)
        _check_int(self, ("buffer_size", "batch_size", "train_freq"), minimum=1)
        _check_int(self, ("learning_starts", "gradient_steps"), minimum=0)
        _check_number(self, "learning_rate", low=0, low_open=True)
        _check_number(self, "tau", low=0, high=1, low_open=True)
        _check_number(self, "gamma", low=0, high=1)
        _check_net_arch(self)
        self.ent_coef = str(self.ent_coef)
        if self.ent_coef != "auto":
            try:
                number = float(self.ent_coef.removeprefix("auto_"))
            except ValueError:
                number = float("nan")
            if not (math.isfinite(number) and number > 0):
                raise ConfigError(f"{_flag(self, 'ent_coef')} must be a number > 0 (fixed), 'auto' or 'auto_<x>' with "
                                  f"x > 0 (learned, starting from x), got {self.ent_coef!r}")

    def sb3_kwargs(self, n_envs: int = 1) -> dict[str, Any]:
        kwargs = _kwargs(self)
        if not self.ent_coef.startswith("auto"):
            kwargs["ent_coef"] = float(self.ent_coef)
        kwargs["train_freq"], kwargs["gradient_steps"] = _per_vec_step(self.train_freq, self.gradient_steps, n_envs)
        return kwargs


def _per_vec_step(train_freq: int, gradient_steps: int, n_envs: int) -> tuple[int, int]:
    """SB3's (train_freq, gradient_steps) for options counted per env step over all ``n_envs`` envs.

    SB3 counts ``train_freq`` in vectorised steps (``n_envs`` transitions each): the conversion keeps
    the same gradient steps per transition (rounded), e.g. 4 and 1 with 8 envs -> 1 and 2.
    """
    if n_envs <= 1:
        return train_freq, gradient_steps
    freq = max(1, train_freq // n_envs)
    return freq, max(1, round(gradient_steps * freq * n_envs / train_freq)) if gradient_steps else 0


def _kwargs(config: object) -> dict[str, Any]:
    kwargs = {f.name: getattr(config, f.name) for f in fields(config) if f.name != "net_arch"}
    return kwargs | {"policy_kwargs": {"net_arch": list(config.net_arch)}}


def check_consistency(config: RunConfig) -> list[str]:
    """What no single field can check: the hyperparameters of the run's algorithm against the run's other options.

    A ``ConfigError`` naming the options for a batch larger than the replay buffer or than a rollout, or a
    rollout of one transition; returned, the notes worth printing: learning that would start only after the
    last step (a smoke run may want that).
    """
    notes = []
    t, algo, hp = config.train, config.train.algo, config.algo_config

    def flag(name: str) -> str:
        return _flag(hp, name)

    if algo in ("dqn", "sac"):
        per_step = 1
        if algo == "dqn" and hp.all_actions and config.env.actions.space == "discrete":
            per_step = config.env.actions.n_grid + int(config.env.actions.off_switch)
        capacity = hp.buffer_size * per_step
        if hp.batch_size > capacity:
            raise ConfigError(f"{flag('batch_size')} {hp.batch_size} is larger than the replay buffer "
                              f"({flag('buffer_size')} {hp.buffer_size}" + (f" env steps x {per_step} actions" if per_step > 1 else "")
                              + f" = {capacity} transitions): give a smaller batch or a larger buffer")
        if hp.learning_starts >= t.total_timesteps:
            notes.append(f"{flag('learning_starts')} {hp.learning_starts} is not below --total-timesteps "
                         f"{t.total_timesteps}: the run takes random actions only and never learns")
    else:
        rollout = hp.n_steps * t.n_envs
        if rollout < 2:
            raise ConfigError(f"a rollout of {flag('n_steps')} {hp.n_steps} x --n-envs {t.n_envs} = {rollout} transition: "
                              "SB3 needs at least 2 (normalised advantages)")
        if algo == "ppo" and hp.batch_size > rollout:
            raise ConfigError(f"{flag('batch_size')} {hp.batch_size} is larger than a rollout ({flag('n_steps')} "
                              f"{hp.n_steps} x --n-envs {t.n_envs} = {rollout} transitions): give a smaller batch or "
                              "longer rollouts")
    return notes


def check_device_name(device: str, option: str) -> None:
    """A ``ConfigError`` unless ``device`` names a torch device ("cpu", "cuda", "cuda:1", ...) or is "auto"."""
    if device == "auto":
        return
    import torch

    try:
        torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"{option} {device!r} is not a device: give cpu, cuda, cuda:<index>, mps or auto") from None


def check_device_here(device: str, option: str) -> None:
    """A ``ConfigError`` when ``device`` is a CUDA device this machine does not have (SB3 would fall back to the CPU
    without a word)."""
    import torch

    if device == "auto" or torch.device(device).type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ConfigError(f"{option} {device}: this machine has no CUDA device (torch.cuda.is_available() is False); "
                          "give cpu, or auto (cuda where there is one)")
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise ConfigError(f"{option} {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def check_algo(algo: str, action: str) -> None:
    """A ``ConfigError`` saying what to change when ``algo`` is unknown or does not fit the env's action space."""
    if algo not in ALGOS:
        raise ConfigError(f"unknown --algo {algo!r}: choose one of {ALGOS}")
    if action not in ACTION_SPACES[algo]:
        fits = " or ".join(ACTION_SPACES[algo])
        raise ConfigError(f"--algo {algo} needs a {fits} action space, but the env's is {action!r}: give --actions "
                          f"space={ACTION_SPACES[algo][0]}"
                          + (" (or --algo ppo / a2c)" if algo in ("dqn", "sac") else ""))


@dataclass
class RunConfig:
    """The whole config of a run, as saved to ``config.json``."""

    train: TrainConfig = field(default_factory=TrainConfig)
    dqn: DQNConfig = field(default_factory=DQNConfig)
    env: EnvConfig = field(default_factory=lambda: preset_env("bild"))  # python train.py's (agents.spec.PRESETS)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    a2c: A2CConfig = field(default_factory=A2CConfig)
    sac: SACConfig = field(default_factory=SACConfig)

    @property
    def algo_config(self) -> DQNConfig | PPOConfig | A2CConfig | SACConfig:
        """The hyperparameters of the run's algorithm (``train.algo``)."""
        return getattr(self, self.train.algo)

    def spec(self, meta: dict | None = None) -> RunSpec:
        """The run as ``config.json`` saves it (``agents.spec.RunSpec``): the env's own config, the run's algorithm
        and its hyperparameters, the run options."""
        run = asdict(self.train)
        algo = run.pop("algo")
        return RunSpec(ENV_ID, self.env.arguments(), algo, asdict(self.algo_config), run, meta or {})

    @classmethod
    def from_spec(cls, spec: RunSpec) -> RunConfig:
        """The config of a BiLD-v1 run's spec (of any version: ``RunSpec.from_json``); the other algorithms'
        hyperparameters at their defaults. A ``ConfigError`` for a run of another env, or a key no config has."""
        if spec.env_id != ENV_ID:
            raise ConfigError(f"a {spec.env_id} run, not a {ENV_ID} one: its spec picks its trainer and "
                              "evaluation where --env is not given (python train.py --resume RUN, python evaluate.py "
                              "--model RUN)")
        if spec.algo not in ALGOS:
            raise ConfigError(f"its algorithm {spec.algo!r} is none of train.py's {ALGOS}")
        config = cls(train=_build(TrainConfig, spec.run | {"algo": spec.algo}),
                     env=_build(EnvConfig, spec.env, base=preset_env("bild")))
        return replace(config, **{spec.algo: _build(type(config.algo_config), spec.hyperparams)})

    def save(self, path: str | Path, meta: dict | None = None) -> None:
        Path(path).write_text(self.spec(meta).text())

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        """The config of the run whose spec is the file (or run folder) ``path``; a ``UsageError`` naming the file
        and what to do when it cannot be read or holds options that cannot be used."""
        spec = RunSpec.load(path)
        try:
            config = cls.from_spec(spec)
            validate(config.env)  # as the env will: its cost profile loaded and checked among the rest
            return config
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{path} holds options that cannot be used ({err}): correct them there, or train anew "
                              "under another --run-name") from None


# ------------------------------------------------------------------------------------------------
def _flag(obj: object, name: str) -> str:
    """The command-line option of field ``name`` of config ``obj``: ``--hyperparams n_steps`` for PPOConfig.n_steps
    (``FLAG_PREFIX``), ``--max-new-tokens`` for EnvConfig.max_new_tokens."""
    prefix = getattr(obj, "FLAG_PREFIX", "")
    return prefix + name if prefix else "--" + name.replace("_", "-")


def hyperparams_help(defaults: RunConfig) -> str:
    """``--hyperparams``' help: each algorithm's keys with their defaults."""
    return "; ".join(f"{name}: {shown_fields(getattr(defaults, name))}" for name in ALGOS)


def _check_int(obj: object, names: tuple[str, ...], minimum: int) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{_flag(obj, name)} must be an integer >= {minimum}, got {value!r}")


def _check_number(obj: object, name: str, low: float | None = None, high: float | None = None,
                  low_open: bool = False, high_open: bool = False, high_name: str | None = None) -> None:
    """A ``ConfigError`` naming the option unless field ``name`` is a finite number in the range given."""
    value = getattr(obj, name)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        top = f"{high_name} ({high})" if high_name else f"{high:g}" if high is not None else None
        if low is not None and high is not None:
            where = f"in {'(' if low_open else '['}{low:g}, {top}{')' if high_open else ']'}"
        elif low is not None:
            where = f"{'>' if low_open else '>='} {low:g}"
        else:
            where = f"{'<' if high_open else '<='} {top}"
        raise ConfigError(f"{_flag(obj, name)} must be a finite number {where}, got {value!r}")


def _check_net_arch(obj: object) -> None:
    sizes = obj.net_arch
    if not sizes or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
        raise ConfigError(f"{_flag(obj, 'net_arch')} must be one or more hidden layer sizes >= 1, got "
                          f"{' '.join(map(str, sizes)) or 'none'}")


def _build(cls: type, values: dict[str, Any], base: object | None = None):
    """``cls`` from JSON values: unknown keys refused, lists turned back into tuples where the field is one."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} key(s) {unknown} in the saved config")
    values = {k: tuple(v) if isinstance(v, list) and typing.get_origin(hints[k]) is tuple else v
              for k, v in values.items()}
    return replace(base, **values) if base is not None else cls(**values)
