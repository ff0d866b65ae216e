"""Training a DQN on BiLD-Serve-v0: the options of ``python train.py --env serve`` (this text is its ``--help``).

    python train.py --env serve                                   # smollm2: the main job (README)
    python train.py --env serve --pair tiny-random --total-timesteps 2000
    tensorboard --logdir logs                                     # the "serving" tab: agent vs fixed policies

Every option is a field of ``ServeTrainConfig`` (the run and the DQN) or of
``bild_env.serving.env.ServingConfig`` (the env; trained on "train", evaluated on "validation"). Where the
command line is silent the env starts from the ``serve`` preset (``agents.spec.PRESETS``): the lossless grid (five
fallbacks at rollback 0.5, and speculation off), loads 0.05/0.15/0.3/1.0 drawn per episode, each episode its own mix
of the domains (``mix_draw`` 1: Dirichlet weights around the even mix), 64-step episodes, 40 prompts per domain.

The DQN learns from every action at every state it visits (``all_actions``, the default): the env's
``peek`` gives each action's exact step from the replay trees, and ``agents.dqn.AllActionsDQN`` stores
them all, so the actions are compared on the same batch rather than across batches. Each gradient step then samples
states and fits all their actions' Q-values together (``paired_actions``, the default): the noise their rewards
share moves them alike and leaves their differences to the differences of the targets. The DQN's hyperparameters
are ``--hyperparams KEY=VALUE`` (``SERVE_DQN``'s keys but ``DQN_FIXED``: ``DQNConfig`` under the preset's).

Evaluations run the greedy agent on the same ``--eval-episodes`` validation episodes every time (fixed
seeds: the same requests and arrivals; with a ``levels:`` load, that many at each level as a constant load), beside policies run once on those episodes at the start
(speculation off, the ``--reference-actions``, the best fixed action, the per-load and the per-batch-size table chosen
on them: ``rule_references``): TensorBoard's custom-scalars tab "serving" draws the
agent's speedup over target-only serving (x) and its return beside theirs, on one chart each.
``best_model.zip`` is the best evaluation's model. Every ``--checkpoint-freq`` steps a checkpoint holds
the model, its replay buffer (compressed; the newest only) and the evaluations so far; Ctrl-C or SIGTERM
stops training at the next rollout boundary with one (``model.zip`` is the model of a run that reached its end or its
time budget). ``--resume RUN`` (``logs/<run>``) goes on from the newest checkpoint
with the run's saved options (its step count, the replay buffer, the evaluations and the best model kept;
the training envs start new episodes, and the run ends at the first rollout boundary at or past the
total, up to ``train_freq`` steps later than an uninterrupted run would). ``train.lock`` keeps a run
folder to one process.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from agents.common.folders import check_log_dir
from agents.common.parse import TrainOptions, run_name
from agents.config import ConfigError, DQNConfig
from agents.spec import RunSpec, preset, preset_env
from bild_env import SERVE_ID
from bild_env.cli import given, key_values, shown_fields
from bild_env.command import check_counts
from bild_env.config import over
from bild_env.replay.dataset import load_where_needed
from bild_env.serving.env import ServingConfig, validate

# The run's length where --total-timesteps is not given, by the dtype the pair runs in: what a 2-core CPU trains in
# the main job's time. bfloat16 (native units, Zen 5): 20,000 steps in 7 min 37 s of 2-core wall time, tables
# included. float32 forwards cost 2-3x as much (an AVX2-only Zen 3: 32 min for 20,000 steps, 10 of them timing the
# full tables): 8,000 steps and the sparse tables keep the job under 15 minutes there.
TIMESTEPS_BY_DTYPE = {"bfloat16": 20_000, "float16": 20_000, "float32": 8_000}
DEFAULT_TIME_BUDGET_MIN = 9.5  # the job's minutes where --total-timesteps is not given (``ServeTrainConfig.time_budget``)
SERVE_DQN = replace(DQNConfig(), **preset("serve").hyperparams)  # where no --hyperparams are given
# ``DQNConfig`` fields this trainer keeps at their value (not options of ``train.py --env serve``).
DQN_FIXED = ("n_steps", "tau", "gradient_steps", "exploration_initial_eps", "max_grad_norm")


@dataclass
class ServeTrainConfig:
    """Options of a DQN run on BiLD-Serve-v0 (the run's own).

    Its DQN hyperparameters are ``dqn``, a ``DQNConfig`` (``SERVE_DQN`` by default; ``--hyperparams KEY=VALUE``);
    ``config.json`` holds them as its spec's ``"hyperparams"``, the rest as its ``"run"`` (``spec``)."""

    total_timesteps: int | None = field(default=None, metadata={"help": (
        "env steps (batched decoding steps) over all envs (default: by the pair's dtype, TIMESTEPS_BY_DTYPE)")})
    seed: int = field(default=0, metadata={"help": "seeds the Q-network, exploration and the training envs' episodes"})
    n_envs: int = field(default=4, metadata={"help": "training envs stepped together (each a whole batch of requests)"})
    run_name: str | None = field(default=None, metadata={"help": (
        "folder under log_dir (default: BiLD-Serve-v0-<pair>__dqn__<seed>__<unix time>)")})
    log_dir: str = field(default="logs", metadata={"help": "runs are written to <log_dir>/<run_name>/"})
    eval_freq: int = field(default=2_500, metadata={"help": (
        "env steps between evaluations on validation episodes (0: never)")})
    eval_episodes: int = field(default=8, metadata={"help": (
        "validation episodes per evaluation, per load level with a levels profile (the same seeds every time)")})
    reference_actions: tuple[int, ...] = field(default=(), metadata={"help": (
        "fixed actions drawn beside the agent in TensorBoard (off is always drawn; default: the grid's pairs with "
        "fallback 0.45 and rollback 0.5 or 1, e.g. 15 and 16)")})
    checkpoint_freq: int = field(default=5_000, metadata={"help": "env steps between checkpoints (model only)"})
    torch_threads: int = field(default=1, metadata={"help": "CPU threads for torch"})
    fill_trees: bool = field(default=True, metadata={"help": (
        "where the machine has 2+ cores: a second process fills the training prompts' replay trees during the tree "
        "phase (each prompt decoded alone by every action), so that training meets them filled")})
    progress_bar: bool = field(default=True, metadata={"help": "show the phases' progress bars"})
    time_budget: float | None = field(default=None, metadata={"help": (
        "minutes of the whole job (from its start: fetch, tables, trees, training) after which training ends at its "
        "next whole state, evaluated and saved as at its total, and never before exploration has ended "
        "(exploration_fraction of total_timesteps); what finishing takes (the longest evaluation so far) is kept "
        "aside. Default: 9.5 where --total-timesteps is not given (the default count is then the most a run trains: "
        "the main job under 10 minutes on a slower CPU), none where it is; 0: none. A run it ended goes on with "
        "--resume")})
    floor: bool = field(default=True, metadata={"help": (
        "after training, put the agent on the per-batch-size table's floor: it keeps the table's action wherever "
        "validation does not show its own better beyond the 95%% interval (agents.serve.selection."
        "keep_where_it_helps; floor.json, the final table's \"agent on the floor\" row)")})
    resume: bool = field(default=False, metadata={"help": (
        "set by --resume RUN: go on with the run from its newest checkpoint (its saved options are used)")})
    dqn: DQNConfig = field(default_factory=lambda: SERVE_DQN, metadata={"cli": False})

    def __post_init__(self) -> None:
        check_counts(self, {"total_timesteps": 1, "n_envs": 1, "eval_episodes": 1, "checkpoint_freq": 1,
                            "torch_threads": 1, "eval_freq": 0}, optional=("total_timesteps",))
        if self.time_budget is not None and (isinstance(self.time_budget, bool)
                                             or not isinstance(self.time_budget, (int, float))
                                             or not np.isfinite(self.time_budget) or self.time_budget < 0):
            raise ValueError(f"--time-budget must be minutes > 0, or 0 for none, got {self.time_budget!r}")
        if self.dqn.batch_size > self.dqn.buffer_size:  # a buffer of env steps, one state a row however many actions
            raise ValueError(f"--hyperparams batch_size={self.dqn.batch_size} is larger than buffer_size="
                             f"{self.dqn.buffer_size}")
        if self.run_name is not None and (not isinstance(self.run_name, str) or not self.run_name
                                          or any(c in self.run_name for c in "/\\") or self.run_name in (".", "..")):
            raise ValueError(f"--run-name must be a folder name inside --log-dir (no '/', not '.' or '..'), "
                             f"got {self.run_name!r}")

    def spec(self, env: ServingConfig) -> RunSpec:
        """The run as ``config.json`` saves it (``agents.spec.RunSpec``), on ``env``'s training split."""
        run = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "dqn"}
        return RunSpec(SERVE_ID, env.arguments(split="train"), "dqn", asdict(self.dqn), run)


def default_timesteps(env: ServingConfig) -> int:
    """``TIMESTEPS_BY_DTYPE`` for the dtype ``env``'s pair will run in (decided as ``load_pair`` decides, without
    loading it; 20,000 for any other dtype)."""
    from bild_env.models.device import default_device, resolve_dtype
    from bild_env.models.pairs import get_preset

    from bild_env.replay.dataset import dtype_for

    dtype = dtype_for(env) or ("auto" if env.pair_options.custom else get_preset(env.pair).dtype)
    name = str(resolve_dtype(dtype, env.pair_options.device or default_device())).removeprefix("torch.")
    return TIMESTEPS_BY_DTYPE.get(name, 20_000)


def preset_config(name: str = "serve") -> ServeTrainConfig:
    """The run options and DQN a new run of the serving preset ``name`` (``agents.spec.PRESETS``) starts from: the
    preset's over ``ServeTrainConfig``'s and ``DQNConfig``'s own."""
    spec = preset(name)
    return replace(ServeTrainConfig(), **spec.run, dqn=replace(DQNConfig(), **spec.hyperparams))


class ServeOptions(TrainOptions):
    """BiLD-Serve-v0's options (``agents.common.parse``): the run's and the DQN's (``ServeTrainConfig``) and the env's
    (``ServingConfig``)."""

    preset, env_id, run_class, env_class = "serve", SERVE_ID, ServeTrainConfig, ServingConfig
    resume_help = ("continue a run (its folder, or its name under --log-dir) from its newest complete checkpoint with "
                   "its saved options; only --total-timesteps, --progress-bar and --torch-threads may be given with it")
    resume_nargs = {"nargs": "?", "const": ""}
    errors = (TypeError, ValueError, KeyError)  # ConfigError is a ValueError
    run_name_resumes = env_option_last = True

    def __init__(self, preset: str | None = None) -> None:
        super().__init__(preset)
        self.run_defaults, self.env_defaults = preset_config(self.preset), preset_env(self.preset)
        self.page = {"prog": f"train.py --env {self.preset}", "description": __doc__}
        self.hyperparams_help = ("the DQN's hyperparameters (agents.config's DQNConfig; RL Zoo's --hyperparams), e.g. "
                                 "--hyperparams learning_starts=1000 gamma=0.95. Keys and defaults: "
                                 + shown_fields(self.run_defaults.dqn, skip=DQN_FIXED))

    def options(self, ns: argparse.Namespace) -> ServeTrainConfig:
        """The run options and the DQN given, over the preset's."""
        defaults = self.run_defaults
        return replace(defaults, **given(ns, "train"), dqn=dqn_of(dqn_given(ns.hyperparams), defaults.dqn))

    def new(self, ns: argparse.Namespace) -> tuple[ServeTrainConfig, ServingConfig]:
        train = self.options(ns)
        env = load_where_needed(over(self.env_defaults, given(ns, "env")))  # --actions its dataset lacks: loaded
        validate(env)  # before any model loads
        if env.actions.space != "discrete":
            raise ValueError(f"--actions space={env.actions.space} gives a Box action, and this trainer's DQN takes a "
                             "Discrete one: train such an env with SAC (gymnasium.make('bild_env:BiLD-Serve-v0', "
                             "actions={'space': 'continuous'})), or leave space at 'discrete'")
        if train.run_name is None:  # named now, so that every message can say where the run is
            train = replace(train, run_name=run_name(SERVE_ID, env, "dqn", train.seed))
        if env.actions.per_domain:
            raise ValueError("--actions per_domain=1 makes the action MultiDiscrete (one per domain), and this trainer's DQN "
                             "takes a Discrete one: train such an env with an SB3 algorithm for MultiDiscrete actions "
                             "(PPO, A2C) on gymnasium.make('bild_env:BiLD-Serve-v0', actions={'per_domain': True})")
        n = env.actions.n_discrete  # trees too
        if any(not 0 <= a < n for a in train.reference_actions):
            raise ValueError(f"--reference-actions must be actions of the env (0-{n - 1}"
                             f"{', the tree rules last' if env.actions.tree_rules else ''}), got "
                             f"{train.reference_actions}")
        check_log_dir(Path(train.log_dir))  # writable, before anything loads
        return train, env

    def resumed(self, ns: argparse.Namespace) -> tuple[ServeTrainConfig, ServingConfig]:
        self.options(ns)  # checked first, as a new run's are: a --run-name that is no folder name, --hyperparams' keys
        return super().resumed(ns)

    def load(self, run_dir: Path, changes: dict) -> tuple[ServeTrainConfig, ServingConfig]:
        saved, env = saved_configs(run_dir)
        return replace(saved, **changes), env


build_parser, parse = ServeOptions.build_parser, ServeOptions.parse  # the page (docs/training.md), the options


def dqn_given(items: list[str]) -> dict:
    """``--hyperparams KEY=VALUE ...`` as ``DQNConfig`` fields; the keys of ``DQN_FIXED`` refused."""
    out = key_values(DQNConfig, items, "--hyperparams")
    if fixed := sorted(set(out) & set(DQN_FIXED)):
        raise ValueError(f"--hyperparams {', '.join(fixed)}: this trainer keeps "
                         f"{', '.join(f'{k}={getattr(SERVE_DQN, k)}' for k in DQN_FIXED)}")
    return out


def dqn_of(given: dict, base: DQNConfig = SERVE_DQN) -> DQNConfig:
    """``base`` (a preset's DQN) with the DQN options ``given``; ``all_actions=false`` alone leaves ``paired_actions``
    (which needs every action's step stored) off, and both given together are refused by ``DQNConfig``."""
    if given.get("all_actions") is False and "paired_actions" not in given:
        given = given | {"paired_actions": False}
    return replace(base, **given)


def dqn_config(cfg: ServeTrainConfig) -> DQNConfig:
    """The run's ``DQNConfig`` as it trains (its ``sb3_kwargs`` converts it for SB3: steps per vec step, the buffer one
    row per action with ``all_actions``, the step-size schedule): the buffer holds at most the run's steps (a buffer
    the run cannot fill is never allocated)."""
    return replace(cfg.dqn, buffer_size=min(cfg.dqn.buffer_size, cfg.total_timesteps))

def saved_configs(run_dir: Path) -> tuple[ServeTrainConfig, ServingConfig]:
    """A run's saved options (its spec, ``config.json``), its ``log_dir`` and ``run_name`` where ``run_dir`` is now;
    a ``ConfigError`` naming the env when the folder is a BiLD-v1 run."""
    path = run_dir / "config.json"
    try:
        spec = RunSpec.load(path)
    except ValueError as err:  # a UsageError, as ConfigError is
        raise ConfigError(str(err)) from None
    if spec.env_id != SERVE_ID:
        raise ConfigError(f"{run_dir} is a {spec.env_id} run, not a {SERVE_ID} one: use it without --env serve "
                          "(python train.py --resume RUN, python evaluate.py --model RUN)")
    if spec.algo != "dqn":  # e.g. a run of python -m agents.rllib_serve ("rllib-ppo")
        raise ConfigError(f"{run_dir} is a run of {spec.algo} ({spec.meta.get('trainer', 'another trainer')}), not of "
                          "train.py's DQN: train.py cannot go on with it")
    run_fields = {f.name for f in fields(ServeTrainConfig)} - {"dqn", "resume"}
    # the run is this folder, wherever it now lies: a run named by default saved run_name None, and a copied run its old place
    run = {k: v for k, v in spec.run.items() if k in run_fields} | {"log_dir": str(run_dir.parent),
                                                                    "run_name": run_dir.name}
    try:
        train = replace(ServeTrainConfig(), **run, dqn=replace(SERVE_DQN, **spec.hyperparams), resume=True)
        env = replace(ServingConfig(), **{k: v for k, v in spec.env.items() if k != "split"})
        validate(env)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{path} holds options that cannot be used ({err}): correct them there, or train anew under "
                          "another --run-name") from None
    return train, env
