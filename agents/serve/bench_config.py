"""The serving evaluation's options (``ServingBenchConfig``, ``QUICK``: what ``python evaluate.py --env serve`` starts
from), the envs they make, and the checks of the options that need no model (counts, load levels, actions, outputs).
"""

from __future__ import annotations


import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path


from agents.common.checks import check_outputs
from bild_env.cli import field_help
from bild_env.config import FALLBACK_VALUES, ROLLBACK_VALUES
from bild_env.migrate import fold_flat
from bild_env.decoding.bild import MAX_DRAFT_LEN
from bild_env.models.pairs import DEFAULT_PAIR
from bild_env.replay.dataset import LN2, load_where_needed
from bild_env.serving.env import DEFAULT_MIX, ServingConfig, ServingEnv
from bild_env.serving.load import MAX_UTILISATION, LoadProfile



SPEED_REPEATS = 5  # timed warm episodes per level of --speed


EVERY_S = 30.0  # seconds between the progress line's reports


DEFAULT_OUT = "results/serving_headroom.json"  # --out where no run folder is given
COUNTS = ("select_episodes", "episodes", "episode_steps", "max_new_tokens", "max_batch", "threads")  # each >= 1


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
    """Options of the serving benchmark (the CLI is generated from it)."""

    pair: str = field(default=DEFAULT_PAIR, metadata={"help": "model pair preset"})
    mix: str = field(default=DEFAULT_MIX, metadata={"help": "the workload"})
    test_mix: str = field(default="", metadata={"help": (
        "the test episodes' workload (default: mix): rules chosen on mix's validation, agents as trained, met with "
        "another")})
    code_source: str = field(default="humaneval", metadata={"help": (
        'the code domain\'s prompts: "humaneval" (shipped) or "stdlib" (this Python\'s library)')})
    test_code_source: str = field(default="", metadata={"help": (
        "the test episodes' code prompts (default: code_source), e.g. a code corpus nothing was chosen on")})
    levels: tuple[float, ...] = field(default=(0.05, 0.2, 0.4, 0.7, 1.0), metadata={"help": (
        "load levels (utilisation) of the validation and test runs")})
    moving: tuple[str, ...] = field(default=("burst:0.1,1.0", "daily:0.05,1.0"), metadata={"help": (
        "moving loads for the test runs")})
    domains: tuple[str, ...] = field(default=(), metadata={"help": (
        "also the per-domain table on these single-domain workloads (e.g. prose code chat)")})
    select_episodes: int = field(default=8, metadata={"help": (
        "validation episodes per load level (choosing the rules)")})
    episodes: int = field(default=8, metadata={"help": "test episodes per load level"})
    episode_steps: int = 128
    max_new_tokens: int = 32
    max_batch: int = 32
    max_prompts: int | None = field(default=None, metadata={"help": "per domain and split"})
    actions: tuple[int, ...] = field(default=(), metadata={"help": (
        "the fixed actions to run (default: all); the off switch is always among them")})
    charge_loop: tuple[float, ...] = field(default=(), metadata={"help": (
        "the batched decoder's own work (ms per step, per forward, per row read; scripts.analysis.serving_clock fits it): every "
        "env charges it with padded rows (ServingConfig.charge_loop); empty: the forwards alone")})
    score: str = field(default="token", metadata={"help": (
        'what each request\'s fallback threshold reads in the rules\' envs: "token", "cumulative", or on these replay '
        'envs "oracle" / "oracle:W" (a predictor of quality W, for measuring room); agents read their own run\'s')})
    tree_rules: tuple[str, ...] = field(default=(), metadata={"help": (
        "token-tree rules (ServingConfig.tree_rules): one more fixed action each in the rules' envs, so the tables "
        "choose among them too; agents keep their run's")})
    max_draft_len: int | str = field(default=MAX_DRAFT_LEN, metadata={"help": (
        'the draft cap in the rules\' envs (ServingConfig\'s actions.max_draft_len; "auto": each load\'s envs choose it '
        "on validation, bild_env.draft_cap); agents keep their run's")})
    model: tuple[str, ...] = field(default=(), metadata={"help": (
        'SB3 model files or run folders trained on BiLD-Serve-v0 ("pretrained": the agent shipped in '
        "bild_env/assets/serve-agent)")})
    dtype: str | None = None
    cost_profile: str | None = field(default=None, metadata={"help": (
        "charge a stored hardware cost profile (a shipped name or a file; bild_env.decoding.profiles) instead of this "
        "machine's cost model")})
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


# What ``python evaluate.py --env serve`` starts from where the command line is silent (``--full``: the dataclass's
# defaults): the main job's setting (its four load levels, 64-step episodes, 40 prompts
# per domain, the lossless grid it trains on: the five fallbacks at rollback 0.5 and speculation off), 4 validation
# and 8 test episodes per level, one moving load, no bandits. Minutes on a 2-core CPU where the full one takes hours.
QUICK = replace(ServingBenchConfig(), levels=(0.05, 0.15, 0.3, 1.0), moving=("burst:0.05,1.0",), select_episodes=4,
                episodes=8, episode_steps=64, max_prompts=40, actions=(0, 5, 10, 15, 20), bandits=False)


def env_options(cfg: ServingBenchConfig, split: str, load: str, mix: str | None = None, **grid) -> dict:
    """``make_env``'s keyword arguments of ``ServingEnv`` (the rest are ``ServingConfig``'s defaults; the paper's
    rollback values given, which the rules' action indices read, where a replayed env would default to its dataset's)."""
    test = split == "test"
    mix = mix or (cfg.test_mix if test and cfg.test_mix else cfg.mix)
    code_source = cfg.test_code_source if test and cfg.test_code_source else cfg.code_source
    costs = ({"train_profiles": tuple(cfg.select_profiles)} if split == "validation" and cfg.select_profiles
             else {"cost_profile": cfg.cost_profile})
    kw = fold_flat(ServingConfig, dict(  # the sub-configs' keys (dtype, charge_loop...) given here into them
        pair=cfg.pair, dtype=cfg.dtype, split=split, load=load, mix=mix, code_source=code_source,
        episode_steps=cfg.episode_steps, max_new_tokens=cfg.max_new_tokens, max_batch=cfg.max_batch,
        max_prompts=cfg.max_prompts, charge_loop=tuple(cfg.charge_loop), **costs,
        **({"score": cfg.score, "tree_rules": tuple(cfg.tree_rules), "rollback_values": ROLLBACK_VALUES,
            "max_draft_len": cfg.max_draft_len} | grid)))
    if not grid and not runs_lossy(cfg.actions):  # the rules keep to lossless actions: nothing to load for them
        return kw
    # an agent's grid, or the lossy actions the rules run (--full), on a decoding dataset: their steps load the
    # models where the dataset lacks them, as construction says
    return kw | {"pair_options": asdict(load_where_needed(ServingConfig(**kw)).pair_options)}


def runs_lossy(actions: tuple[int, ...]) -> bool:
    """Whether the rules run a lossy action of the paper's grid: all of them (no ``--actions``), or an index whose
    rollback threshold is ln 2 or more."""
    n = len(ROLLBACK_VALUES)
    return not actions or any(a < n * len(FALLBACK_VALUES) and ROLLBACK_VALUES[a % n] >= LN2 for a in actions)


def make_env(cfg: ServingBenchConfig, split: str, load: str, mix: str | None = None, **grid) -> ServingEnv:
    """The benchmark's env; ``grid``: an agent's own action grid (fallback_values, rollback_values, off_switch).
    Test envs take ``test_mix`` and ``test_code_source`` where they are given."""
    return ServingEnv(**env_options(cfg, split, load, mix, **grid))


def check_counts(cfg: ServingBenchConfig) -> None:
    """Every count (``COUNTS``, and ``max_prompts`` where given) an integer >= 1: a count of 0 measures nothing."""
    comments = field_help(ServingBenchConfig)
    for name in COUNTS + (("max_prompts",) if cfg.max_prompts is not None else ()):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            what = f": {comments[name]}" if name in comments else ""
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}{what}")


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


def grid_size() -> tuple[int, str]:
    """The number of actions of the env the rules run in (``ServingConfig``'s grid and off switch), and which."""
    env = ServingConfig()
    acts, n_grid = env.actions, env.actions.n_grid
    what = f"{len(acts.fallback_values)} fallbacks x {len(acts.rollback_values)} rollbacks: 0-{n_grid - 1}"
    return n_grid + int(acts.off_switch), what + (f", {n_grid} speculation off" if acts.off_switch else "")


def check_actions(actions: tuple[int, ...]) -> None:
    n, what = grid_size()
    bad = [a for a in actions if not 0 <= a < n]
    if bad:
        raise ValueError(f"--actions: {bad} not in the env's action grid 0-{n - 1} ({what})")


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
