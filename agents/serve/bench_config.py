"""The serving evaluation's options (``ServingBenchConfig``, ``QUICK``: what ``python evaluate.py --env serve`` starts
from), the envs they make, and the checks of the options that need no model (counts, load levels, actions, outputs).
"""

from __future__ import annotations


import argparse
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path


from agents.common.checks import check_outputs
from agents.spec import preset
from bild_env import SERVE_ID
from bild_env.cli import add_options, field_help, given, setup_logging
from bild_env import command
from bild_env.command import UsageExit, writable_file
from bild_env.config import over
from bild_env.migrate import refuse_moved, refuse_renamed
from bild_env.replay.dataset import LN2, load_where_needed
from bild_env.serving.env import ServingConfig, ServingEnv
from bild_env.serving.load import MAX_UTILISATION, LoadProfile



SPEED_REPEATS = 5  # timed warm episodes per level of --speed


EVERY_S = 30.0  # seconds between the progress line's reports


DEFAULT_OUT = "results/serving_headroom.json"  # --out where no run folder is given
COUNTS = ("select_episodes", "episodes", "threads")  # each >= 1 (the env's own counts: its validate)


# An agent's env settings that give its observation or action their meaning (observation 0-2 are shares of
# max_batch, 5 of max_draft_len + 1, 11 of max_new_tokens): refused when this evaluation's differ from its run's
MEANING = {"max_batch": "the batch size, queue and load trend it observes are shares of max_batch",
           "max_new_tokens": "the progress of the requests it observes is a share of max_new_tokens",
           "max_draft_len": "the tokens per request-step it observes are a share of max_draft_len + 1"}


# ... and those that make it act in another system than it learnt in (other models, prompts or reward): warned
SYSTEM = ("pair", "draft", "target", "tokenizer", "dtype", "lean", "draft_vocab", "prompt_tokens", "latency_weight",
          "regret_weight")


@dataclass
class ServingBenchConfig:
    """Options of the serving evaluation (the CLI is generated from it and from the env's ``ServingConfig``): the env
    the rules and agents are run in (``env``, but its split and load, which each episode's set gives), and the
    evaluation's own."""

    env: ServingConfig = field(default_factory=ServingConfig, metadata={"cli": False, "help": (
        "the env the rules run in (BiLD-Serve-v0's arguments; its split and load set per run); agents keep their run's "
        "grid and observation")})
    test_mix: str = field(default="", metadata={"help": (
        "the test episodes' workload (default: the env's mix): rules chosen on mix's validation, agents as trained, "
        "met with another")})
    test_code_source: str = field(default="", metadata={"help": (
        "the test episodes' code prompts (default: the env's code_source), e.g. a code corpus nothing was chosen on")})
    levels: tuple[float, ...] = field(default=(0.05, 0.2, 0.4, 0.7, 1.0), metadata={"help": (
        "load levels (utilisation) of the validation and test runs")})
    moving: tuple[str, ...] = field(default=("burst:0.1,1.0", "daily:0.05,1.0"), metadata={"help": (
        "moving loads for the test runs")})
    domains: tuple[str, ...] = field(default=(), metadata={"help": (
        "also the per-domain table on these single-domain workloads (e.g. prose code chat)")})
    select_episodes: int = field(default=8, metadata={"help": (
        "validation episodes per load level (choosing the rules)")})
    episodes: int = field(default=8, metadata={"help": "test episodes per load level"})
    fixed_actions: tuple[int, ...] = field(default=(), metadata={"help": (
        "the fixed actions the rules run, indices of the env's grid (default: all); the off switch is always among "
        "them")})
    model: tuple[str, ...] = field(default=(), metadata={"help": (
        'SB3 model files or run folders trained on BiLD-Serve-v0 ("pretrained": the agent shipped in '
        "bild_env/assets/serve-agent)")})
    select_profiles: tuple[str, ...] = field(default=(), metadata={"help": (
        "choose the rules on validation episodes charged by these cost profiles (one drawn per episode) instead of "
        "the test's cost model: rules tuned on other hardware, met on this one; empty: the test's own")})
    threads: int = field(default=1, metadata={"help": "torch CPU threads"})
    step_oracle: bool = field(default=False, metadata={"help": (
        "also the per-step hindsight oracle (agents.serve.rules.StepHindsight; |actions| peeks a step)")})
    bandits: bool = field(default=True, metadata={"help": (
        "also UCBSpec and EXP3Spec over the actions (agents.common.bandits: online per episode, chosen on "
        "validation)")})
    speed: bool = field(default=False, metadata={"help": (
        "only measure env steps per second on warm trees (each level: one episode to fill, 5 timed)")})
    out: str | None = field(default=None, metadata={"help": (
        "the report's JSON, its goodput plot beside it as .png (default: evaluation.json in the first --model's run "
        f"folder; without one, or for the shipped agent, {DEFAULT_OUT})")})
    force: bool = field(default=False, metadata={"help": (
        "replace the results of an earlier evaluation at --out (the JSON and its .png)")})


# The env the serving evaluations start from: the main job's episodes (the ``serve`` preset's steps and prompts per
# domain, ``agents.spec.PRESETS``).
# What ``python evaluate.py --env serve`` starts from where the command line is silent (``--full``: the dataclass's
# defaults): the main job's setting (its four load levels, its episodes, the lossless grid it trains on: the five
# fallbacks at rollback 0.5 and speculation off), 4 validation and 8 test episodes per level, one moving load, no
# bandits. Minutes on a 2-core CPU where the full one takes hours.
MAIN_JOB_EPISODES = replace(ServingConfig(), **{k: preset("serve").env[k] for k in ("episode_steps", "max_prompts")})
QUICK = replace(ServingBenchConfig(), env=MAIN_JOB_EPISODES,
                levels=(0.05, 0.15, 0.3, 1.0), moving=("burst:0.05,1.0",), select_episodes=4, episodes=8,
                fixed_actions=(0, 5, 10, 15, 20), bandits=False)


def options_parser(defaults, description: str, prog: str) -> argparse.ArgumentParser:
    """A serving evaluation's command line (``defaults``: a config whose ``env`` field holds a ``ServingConfig``, its
    other fields the evaluation's own; their values shown): its own options, then the env's arguments as ``train.py
    --env serve`` takes them (``--pair``, ``--actions KEY=VALUE``...), but split and load, which each run sets."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, "options", type(defaults), defaults, title=f"{prog}: the evaluation")
    add_options(parser, "env", ServingConfig, defaults.env, skip=("split", "load"),
                title=f"{prog}: the environment ({SERVE_ID}, the rules' env; agents keep their run's grid and "
                      "observation)")
    return parser


def parse_options(argv: list[str] | None, defaults, description: str, prog: str, check=None):
    """``options_parser``'s options over ``defaults``: the evaluation's own replaced, the env's given over
    ``defaults.env`` (``bild_env.config.over``); an argument's name from before a sub-config held it, or ``--actions``
    given action indices (now ``--fixed-actions``) or ``--select-steps``, refused naming where it is now
    (``bild_env.migrate``). With ``check`` (a command's): logging set up, then ``--out`` writable (and claimed) and
    ``check`` passed before any work, a ValueError exiting with ``error: <message>`` (``UsageExit``)."""
    parser = options_parser(defaults, description, prog)
    refuse_moved(parser, argv, ServingConfig)
    refuse_renamed(argv)
    ns = parser.parse_args(argv)
    try:
        cfg = replace(defaults, **given(ns, "options"), env=over(defaults.env, given(ns, "env")))
    except (TypeError, ValueError) as err:
        parser.error(str(err))
    if check is not None:
        setup_logging()
        try:
            writable_file(cfg.out)  # before any work: a result that cannot be written is the work lost
            check(cfg)
        except ValueError as err:
            raise UsageExit(f"error: {err}") from None
    return cfg


def env_options(cfg: ServingBenchConfig, split: str, load: str, mix: str | None = None, **grid) -> dict:
    """``make_env``'s keyword arguments of ``ServingEnv``: ``cfg.env`` on ``split`` at ``load`` (the test split's
    workload and code prompts ``test_mix`` and ``test_code_source`` where given; validation's costs
    ``select_profiles`` where given), with ``grid`` (an agent's own actions and observation, ``evaluation_agents.GRID``'s
    keys by sub-config; or one key, e.g. ``actions={"max_draft_len": 2}``) over it. The env's actions are given whole, so a replayed env keeps the paper's rollback values the rules' action
    indices read rather than defaulting to its dataset's."""
    env, test = cfg.env, split == "test"
    given = {"split": split, "load": load, "mix": mix or (cfg.test_mix if test and cfg.test_mix else env.mix)}
    if test and cfg.test_code_source:
        given["code_source"] = cfg.test_code_source
    if split == "validation" and cfg.select_profiles:
        given |= {"cost_profile": None, "charging": {"train_profiles": tuple(cfg.select_profiles)}}
    env = over(over(env, given), grid)
    kw = {f.name: getattr(env, f.name) for f in fields(ServingConfig)}
    if not grid and not runs_lossy(cfg):  # the rules keep to lossless actions: nothing to load for them
        return kw
    # an agent's grid, or the lossy actions the rules run (--full), on a decoding dataset: their steps load the
    # models where the dataset lacks them, as construction says
    return kw | {"pair_options": load_where_needed(ServingConfig(**kw)).pair_options}


def runs_lossy(cfg: ServingBenchConfig) -> bool:
    """Whether the rules run a lossy action of the env's grid: all of them (no ``--fixed-actions``), or an index whose
    rollback threshold is ln 2 or more."""
    acts = cfg.env.actions
    n = len(acts.rollback_values)
    return not cfg.fixed_actions or any(a < acts.n_grid and acts.rollback_values[a % n] >= LN2
                                        for a in cfg.fixed_actions)


def make_env(cfg: ServingBenchConfig, split: str, load: str, mix: str | None = None, **grid) -> ServingEnv:
    """The benchmark's env; ``grid``: an agent's own action grid (fallback_values, rollback_values, off_switch).
    Test envs take ``test_mix`` and ``test_code_source`` where they are given."""
    return ServingEnv(**env_options(cfg, split, load, mix, **grid))


def check_counts(cfg: ServingBenchConfig) -> None:
    """Every count of the evaluation's own (``COUNTS``) an integer >= 1: a count of 0 measures nothing."""
    command.check_counts(cfg, dict.fromkeys(COUNTS, 1), field_help(ServingBenchConfig))


def check_loads(cfg: ServingBenchConfig) -> None:
    """``levels``: utilisations in (0, ``MAX_UTILISATION``], each once; ``moving``: load profiles
    (``bild_env.serving.load``)."""
    if not cfg.levels:
        raise ValueError("--levels: give at least one load level, e.g. --levels 0.05 0.2 1.0")
    for i, u in enumerate(cfg.levels):
        if not (math.isfinite(u) and 0.0 < u <= MAX_UTILISATION):
            raise ValueError(f"--levels: {u:g} is outside (0, {MAX_UTILISATION:g}] (a load level is a utilisation: "
                             "the arrival rate as a share of what target-only decoding of a full batch serves)")
        if u in cfg.levels[:i]:
            raise ValueError(f"--levels: {u:g} is given twice (each level is a table of its own)")
    for i, spec in enumerate(cfg.moving):
        LoadProfile.parse(spec, "--moving")
        if spec in cfg.moving[:i]:
            raise ValueError(f"--moving: {spec!r} is given twice (each moving load is a table of its own)")


def grid_size(env: ServingConfig) -> tuple[int, str]:
    """The number of actions the rules run in ``env`` (its grid and off switch), and which."""
    acts, n_grid = env.actions, env.actions.n_grid
    what = f"{len(acts.fallback_values)} fallbacks x {len(acts.rollback_values)} rollbacks: 0-{n_grid - 1}"
    return n_grid + int(acts.off_switch), what + (f", {n_grid} speculation off" if acts.off_switch else "")


def check_actions(cfg: ServingBenchConfig) -> None:
    n, what = grid_size(cfg.env)
    bad = [a for a in cfg.fixed_actions if not 0 <= a < n]
    if bad:
        raise ValueError(f"--fixed-actions: {bad} not in the env's action grid 0-{n - 1} ({what})")


def outputs(cfg: ServingBenchConfig) -> tuple[Path, Path]:
    """What an evaluation writes: ``--out`` (the JSON; default: ``evaluation.json`` beside the first ``--model``'s run,
    the folder given or the model file's, else ``DEFAULT_OUT``) and the goodput plot beside it."""
    from agents.common.trained import PRETRAINED

    if cfg.out:
        out = Path(cfg.out)
    else:
        given = next((Path(m) for m in cfg.model if not (m == PRETRAINED and not Path(m).exists())), None)
        run = None if given is None else given if given.is_dir() else given.parent
        if run is not None and run.name == "checkpoints":  # a checkpoint's model: its run folder
            run = run.parent
        out = Path(DEFAULT_OUT) if run is None else run / "evaluation.json"
    return out, out.with_suffix(".png")


def check_out(cfg: ServingBenchConfig) -> None:
    """``--out`` names a file whose folder can be written into, and no earlier evaluation's results lie there unless
    ``--force`` (they would be overwritten, or a stale plot left beside a new JSON)."""
    out, plot = outputs(cfg)
    if out == plot:
        raise ValueError(f"--out {out}: the goodput plot goes beside the JSON as .png; give another name, e.g. "
                         f"--out {out.with_suffix('.json')}")
    check_outputs([out, plot], cfg.force)
