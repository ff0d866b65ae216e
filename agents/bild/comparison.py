"""Compare a trained agent with the other decoding methods on the same held-out prompts (the methods side by side).

    python evaluate.py                                   # the latest run in logs/ for the default pair
    python evaluate.py --model logs/<run>/model.zip --num-prompts 50 --out results/mine

``EvalConfig`` (every option) and ``Comparison`` (BiLD-v1's evaluation, run by the evaluator of every env,
``agents.evaluation.evaluate``) live here. (Over 450 lines: every check made before a model loads, the methods' one
loop over the prompts, and its writers, for one command; the methods themselves are ``agents.bild.methods``' and the
tables ``agents.bild.report``'s.)

Methods, run one after another on every test prompt, in the same order (interleaved, so drifts of
the machine hit them alike), after one untimed warm-up each:
single model (target only), naive speculative decoding (k drafts; by default the k of K_CHOICES
fastest on the grid prompts under the cost model), Hugging Face assisted
generation (``target.generate(assistant_model=draft)`` with its defaults), BiLD with the paper's
fixed thresholds (0.103 / 4.697), BiLD with the best fixed pair found by grid search on validation
prompts, BiLD driven by the DQN, BiLD driven by any other SB3 model given (--extra-model), and BiLD driven by the
training-free online bandits UCBSpec and EXP3Spec (``agents.common.bandits``; each episode from scratch; their settings chosen
on the grid search's validation prompts; ``--no-bandits`` leaves them out). For an agent trained with token-tree rules
(``tree_rules``), each rule is a fixed row of its own (``tree <rule>``) and a row of the grid search (whose best may
then be a tree rule).

Latency is wall-clock on this device (the BiLD policies' own inference time included), per
sentence (``max_new_tokens`` tokens or up to EOS); the cost-model latency the env trains on is
reported beside it. BLEU is corpus BLEU (sacreBLEU) against the target's greedy outputs.
Writes results.md (also printed), results.json, results.csv, per_prompt.csv and three plots to
the output folder (``RESULT_FILES``).

Every option is checked before any model loads: counts, the output folder (writable, and holding no earlier
results unless ``--force``), the model files (readable SB3 zips of BiLD-v1 runs: a BiLD-Serve-v0 run is sent
to ``--env serve``). Options that make the agent act in another system than it learnt in (``--pair``,
``--dataset``, ...) are warned about; nothing non-finite is ever printed or written (``report_json``). Ctrl-C or
SIGTERM keeps the test prompts every method finished (``results.json`` with ``"complete": false``, ``per_prompt.csv``:
``stopped``) and exits with 130; every file is written whole or not at all.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from gymnasium import spaces
from tqdm import tqdm

from agents.bild.baselines import FixedThresholds, FixedTree, grid_search
from agents.bild.evaluation import choose_bandits
from agents.bild.methods import (Row, adaptive_methods, choose_k, decoder_method, hf_assisted_method,
                                 policy_method)
from agents.bild.report import markdown, plot_all, summarize
from agents.bild.runs import run_config_of, run_pair
from agents.common import bandits
from agents.common.checks import blocking_file, read_model_zip, report_json, trained_on
from agents.spec import spec_file
from agents.common.files import write_text_atomic
from bild_env import command
from bild_env.command import Stopped, UsageError, check_room, claim_output, release_outputs
from agents.common.trained import AGENT_ENV_FIELDS, choose_model, load_agent, zip_algo
from agents.config import ConfigError
from agents.evaluation import Evaluation
from bild_env import SERVE_ID, generate_speculative, generate_target_only
from bild_env.cli import add_options, given, setup_logging
from bild_env.decoding.decoders import parse_adaptive
from bild_env.config import over
from bild_env.migrate import refuse_moved
from bild_env.env import BildEnv, EnvConfig
from bild_env.command import UsageExit
from bild_env.models.device import device_name, machine_description
from bild_env.models.pairs import PairError, preset_names
from bild_env.replay.dataset import load_where_needed
from bild_env.observations import observation_space


@dataclass
class EvalConfig:
    """Options of one evaluation (every default lives here; the CLI is generated from it)."""

    model: str | None = field(default=None, metadata={"help": (
        "DQN model file or run folder (a folder: its best_model.zip, else model.zip; default: the newest run in "
        "--log-dir for the pair)")})
    extra_model: tuple[str, ...] = field(default=(), metadata={"help": (
        "other SB3 models (files or run folders: DQN, PPO, A2C or SAC, any action space or observation) to compare on "
        "the same prompts")})
    num_prompts: int = field(default=20, metadata={"help": "test prompts every method decodes"})
    grid_prompts: int = field(default=5, metadata={"help": (
        "validation prompts for the grid search over the 25 fixed pairs")})
    threshold_runs: int = field(default=100, metadata={"help": (
        "DQN episodes on test prompts whose thresholds are plotted (the paper's figure 2)")})
    k: int = field(default=0, metadata={"help": (
        "naive speculative decoding's draft length (0: the fastest of K_CHOICES on the grid prompts, cost model)")})
    adaptive: str = field(default="8:0.5", metadata={"help": (
        "naive SD's adaptive length K:F, a row of its own (at most K drafts, stop below confidence F; chosen on "
        'smollm2\'s validation prompts); "" leaves it out')})
    bandits: bool = field(default=True, metadata={"help": (
        "also UCBSpec and EXP3Spec (agents.common.bandits: online per episode, no training), chosen on the grid "
        "prompts")})
    log_dir: str = field(default="logs", metadata={"help": (
        "where to look for the newest run when --model is not given")})
    out: str | None = field(default=None, metadata={"help": (
        "output folder (default: evaluation/ in the model's run folder, beside its config.json; for a model of no run, "
        "results/<pair>__<time>)")})
    force: bool = field(default=False, metadata={"help": (
        "write into an --out folder holding an earlier evaluation's results (they are removed first)")})
    torch_threads: int = field(default=0, metadata={"help": "CPU threads for torch (0: torch's default)"})
    progress_bar: bool = field(default=True, metadata={"help": "show progress bars"})
    env: dict = field(default_factory=dict, metadata={"cli": False, "help": (
        "the env's arguments given (ENV_OPTIONS: --pair, --pair-options KEY=VALUE, --dataset, --cost-profile, as "
        "train.py takes them), over those of the model's run (else BiLD-v1's defaults); the env-side latency is always "
        "the cost model's (a cost_profile's, else this machine's), the wall-clock latency this machine's")})


RUN_ENV = replace(EnvConfig(), pair=None)  # the help's defaults: the model's run's (None shown as nothing)
OUT_LOCK = ".evaluate.lock"  # held in --out while an evaluation writes there (bild_env.command.claim_output)
RESULT_FILES = ("results.md", "results.json", "results.csv", "per_prompt.csv", "grid.json", "naive_sd_k.json",
                "thresholds.png", "latency.png", "plane.png")  # what an evaluation writes into --out
COUNTS = {"num_prompts": 1, "grid_prompts": 1, "threshold_runs": 0, "k": 0, "torch_threads": 0}  # option: least value
# The env's arguments this comparison takes (the run's otherwise; its agent's spaces keep the run's): which models, in
# what dtype and where, which prompts, what charges the cost model; those of SYSTEM_OPTIONS given are warned about
ENV_OPTIONS = ("pair", "pair_options", "dataset", "cost_profile")
SYSTEM_OPTIONS = ("pair", "draft", "target", "dataset", "dtype")  # override the run's when given: warned if they differ
RUN_ACTIONS = ("fallback_values", "rollback_values", "off_switch", "tree_rules", "max_draft_len")  # the run's, kept


# -- policies and models -------------------------------------------------------------------------
def _newest_run(log_dir: Path, pair: str | None) -> Path:
    """The BiLD-v1 run under ``log_dir`` with the newest ``model.zip`` (of ``pair``'s runs when given): serving runs,
    which this comparison cannot evaluate, are passed over."""
    runs = [p.parent for p in log_dir.glob("*/model.zip")
            if trained_on(p.parent)[1] != SERVE_ID and (not pair or run_pair(p.parent) == pair)]
    if not runs:
        raise UsageExit(f"evaluate.py: no trained model ({log_dir}/*/model.zip of a BiLD-v1 run"
                         f"{' for pair ' + pair if pair else ''}); train one first (python train.py) or pass "
                         "--model PATH")
    return max(runs, key=lambda r: (r / "model.zip").stat().st_mtime)


def _run_config(model_path: Path, option: str = "--model"):
    """The BiLD-v1 run config of a model (None without one); a clear exit for a serving run or an unreadable config."""
    config, env_id = trained_on(model_path)
    if env_id == SERVE_ID:
        raise UsageExit(f"evaluate.py: {option} {model_path} is a model of a {SERVE_ID} run ({config}), which this "
                         f"BiLD-v1 comparison cannot run: evaluate it with --env serve (python evaluate.py --env serve "
                         f"--model {config.parent})")
    try:
        return run_config_of(model_path)
    except ConfigError as err:
        raise UsageExit(f"evaluate.py: {err}") from err


def check_out(out: Path, force: bool = False) -> None:
    """Make the output folder now (with its lock; removed again if the evaluation writes nothing there), before any
    model loads, and check a file can be written into it; a clear exit
    when it cannot be one, or when it holds an earlier evaluation's results and ``force`` is not given."""
    if out.exists() and not out.is_dir():
        raise UsageExit(f"evaluate.py: --out {out} is a file; give a folder (made if missing)")
    if blocking_file(out):
        raise UsageExit(f"evaluate.py: cannot make the output folder --out {out}: {blocking_file(out)} is a file")
    try:  # a block really written in the nearest folder there is: a full disk is refused now, not at the end
        check_room(next(p for p in (out, *out.parents) if p.exists()), "--out", out)
    except UsageError as err:
        raise UsageExit(f"evaluate.py: {err}") from None
    try:  # a second evaluation into this folder is refused while this one runs; made for the lock, gone if left empty
        claim_output(out, lock=out / OUT_LOCK)
    except OSError as err:
        raise UsageExit(f"evaluate.py: cannot make the output folder --out {out}: {err.strerror or err}") from err
    earlier = [name for name in RESULT_FILES if (out / name).exists()]
    if earlier and not force:
        raise UsageExit(f"evaluate.py: --out {out} holds an earlier evaluation's results ({', '.join(earlier)}): give "
                         "another --out, or --force to replace them")


def clear_results(out: Path) -> None:
    """Remove an earlier evaluation's files from ``out`` (``--force``): none of them may stand beside this one's."""
    for name in RESULT_FILES:
        (out / name).unlink(missing_ok=True)


def check_counts(cfg: EvalConfig) -> None:
    try:
        command.check_counts(cfg, COUNTS)
    except UsageError as err:
        raise UsageExit(f"evaluate.py: {err}") from None


def warn_other_system(cfg: EvalConfig, run_env: EnvConfig | None, option: str = "--model") -> None:
    """Warn (stderr) where an option given overrides what the run was trained with (``SYSTEM_OPTIONS``): its
    observation and actions keep their meaning (they come from the run), but it acts on other models or prompts."""
    if run_env is None:
        return
    given = over(run_env, cfg.env)
    spelt = {name: f"--{name} " if name in ENV_OPTIONS else f"--pair-options {name}=" for name in SYSTEM_OPTIONS}
    differ = [f"{spelt[name]}{given.setting(name)} (trained with {run_env.setting(name)})" for name in SYSTEM_OPTIONS
              if given.setting(name) and str(given.setting(name)) != str(run_env.setting(name))
              and not (run_env.setting(name) is None and name in ("dtype", "dataset"))]  # None: the preset's
    if differ:
        print(f"evaluate.py: warning: {option}'s run was trained on other settings than this evaluation's "
              f"{', '.join(differ)}: the agent acts on models or prompts it never saw; its rows measure it there",
              file=sys.stderr, flush=True)


def load_sb3(path: Path, env: BildEnv):
    try:
        return load_agent(path, env)
    except ConfigError as err:
        raise UsageExit(f"evaluate.py: {err}") from err


def warn_other_extra(file: Path, extra_env: EnvConfig | None, run_env: EnvConfig | None) -> None:
    """Warn (stderr) where an ``--extra-model``'s run differs from the main run in what its env takes from the main
    run's (models, prompts, lengths, reward): it is compared in the main run's system, with its own spaces."""
    if extra_env is None or run_env is None:
        return
    compared = ("pair", "draft", "target", "dataset", "max_new_tokens", "quality", "latency_weight", "regret_weight",
                "bleu_weight")
    differ = [f"{k} {extra_env.setting(k)} (here {run_env.setting(k)})" for k in compared
              if str(extra_env.setting(k)) != str(run_env.setting(k))]
    if differ:
        print(f"evaluate.py: warning: --extra-model {file} was trained with {', '.join(differ)}: it runs in this "
              "evaluation's env (its own observation and actions), on settings it never saw", file=sys.stderr,
              flush=True)


# -- the whole evaluation --------------------------------------------------------------------------
def check_prompts(cfg: EvalConfig, test_env: BildEnv, grid_env: BildEnv) -> None:
    """A clear exit when a split has no prompt to measure on; a note when it has fewer than asked for."""
    for env, option, asked in ((test_env, "--num-prompts", cfg.num_prompts),
                               (grid_env, "--grid-prompts", cfg.grid_prompts)):
        split, source = env.config.split, env.config.dataset or "the preset dataset"
        if not env.prompts:
            raise SystemExit(f"evaluate.py: the {split} split of {source} has no prompt: nothing to measure; "
                             "give another --dataset")
        if len(env.prompts) < asked:
            print(f"evaluate.py: {option} {asked}, but the {split} split of {source} has {len(env.prompts)} prompts: "
                  f"measuring on those {len(env.prompts)}", file=sys.stderr, flush=True)


def env_kwargs(cfg: EvalConfig, run_env: EnvConfig | None, **extra) -> dict[str, Any]:
    """The keyword arguments of a ``BildEnv`` of this comparison: the run's env (else BiLD-v1's defaults) with the env
    arguments given over it, its actions' grid, cap and tree rules (``RUN_ACTIONS``), charged by the cost model, then
    ``extra`` over it (split, backend, ``actions={"space": ...}``...)."""
    run = over(run_env or EnvConfig(), cfg.env)
    env = EnvConfig(pair=run.pair, pair_options=run.pair_options, dataset=run.dataset, prompt_tokens=run.prompt_tokens,
                    max_new_tokens=run.max_new_tokens, observation=run.observation, reward=run.reward,
                    cost_profile=run.cost_profile, actions={k: getattr(run.actions, k) for k in RUN_ACTIONS},
                    latency="model")
    env = load_where_needed(over(env, extra))  # actions its decoding dataset lacks: their steps load the models
    return {f.name: getattr(env, f.name) for f in fields(EnvConfig)}


def agent_spaces(kw: dict[str, Any]) -> tuple[spaces.Space, spaces.Space]:
    """The observation and action spaces of ``BildEnv(**kw)`` from its options alone, as ``BildEnv`` makes them."""
    env = EnvConfig(**{k: v for k, v in kw.items() if k in {f.name for f in fields(EnvConfig)}})
    acts = env.actions
    action = (spaces.Box(-1.0, 1.0, (3 if acts.off_switch else 2,), dtype=np.float32) if acts.space == "continuous"
              else spaces.Discrete(acts.n_discrete))
    return observation_space(env.observation), action


def check_model_file(path: Path, kw: dict[str, Any], option: str = "--model") -> None:
    """A clear exit, before any model loads, for a model file that is missing, truncated or garbled, or was trained
    for other spaces than those of its env, ``BildEnv(**kw)`` (``load_agent``'s check, from the saved spaces)."""
    if not path.is_file():
        raise UsageExit(f"evaluate.py: {option}: no model file at {path}")
    try:
        saved = read_model_zip(path)
    except ConfigError as err:
        raise UsageExit(f"evaluate.py: {option}: {err}") from None
    obs, act = agent_spaces(kw)
    if saved["observation_space"] != obs or saved["action_space"] != act:
        raise UsageExit(f"evaluate.py: {path} was trained for observation space {saved['observation_space']} and "
                         f"action space {saved['action_space']}, but this env has {obs} and {act}: evaluate it with "
                         f"the env options it was trained with ({', '.join(AGENT_ENV_FIELDS)})")


def check_evaluation(cfg: EvalConfig) -> tuple[Path, EnvConfig | None, dict[str, tuple[Path, Any]], Path]:
    """Every option checked before any model loads (a clear exit otherwise): (the model file, its run's env options,
    ``{--extra-model: (file, its run config)}``, the output folder)."""
    check_counts(cfg)
    pair = cfg.env.get("pair")
    if pair and pair not in preset_names():
        raise UsageExit(f"evaluate.py: unknown --pair {pair!r}; choose one of {preset_names()}")
    if cfg.adaptive:
        try:
            parse_adaptive(cfg.adaptive)
        except ValueError as err:
            raise UsageExit(f"evaluate.py: --adaptive {err} (or \"\" to leave the row out)") from None
    if cfg.out is not None:
        check_out(Path(cfg.out), cfg.force)
    model_path, why = choose_model(cfg.model or _newest_run(Path(cfg.log_dir), pair))
    if not Path(cfg.model or "").is_file():
        print(f"evaluate.py: using {model_path} ({why}; pass --model <file> for another)", flush=True)
    if not model_path.is_file():
        raise UsageExit(f"evaluate.py: no model file at {model_path}")
    run = _run_config(model_path)
    run_env = run.env if run else None
    action = run_env.actions.space if run_env else "discrete"
    check_model_file(model_path, env_kwargs(cfg, run_env, actions={"space": action}))
    warn_other_system(cfg, run_env)
    extra_runs = {}
    for p in cfg.extra_model:
        file = choose_model(p)[0]
        extra_run = _run_config(file, "--extra-model")
        own = {k: getattr(extra_run.env, k) for k in AGENT_ENV_FIELDS} if extra_run else {}
        check_model_file(file, env_kwargs(cfg, run_env, **({} if own else {"actions": {"space": action}})) | own,
                         "--extra-model")
        warn_other_extra(file, extra_run.env if extra_run else None, run_env)
        extra_runs[p] = (file, extra_run)
    if cfg.out:
        out = Path(cfg.out)
    elif (spec := spec_file(model_path)) is not None:  # beside the run, as the serving evaluation's JSON
        out = spec.parent / "evaluation"
    else:
        out = Path(f"results/{env_kwargs(cfg, run_env)['pair']}__{time.strftime('%Y%m%d-%H%M%S')}")
    return model_path, run_env, extra_runs, out


class Comparison(Evaluation):
    """BiLD-v1's evaluation for ``agents.evaluation.evaluate`` (the module docstring): every option checked first,
    then the methods run on the same prompts, then the report written into the output folder."""

    def __init__(self, cfg: EvalConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.out) if cfg.out else None
        self.new = self.out is None or not self.out.exists()  # a folder this evaluation makes: no trace left on failure
        self.rows: list[Row] = []  # one per method and test prompt, in the order run: kept when it is stopped
        self.methods: dict[str, Callable[[int], Row]] = {}
        self.references: dict[int, list[int]] = {}
        self.test_env: BildEnv | None = None
        self.envs: set[BildEnv] = set()
        self.written = False

    @classmethod
    def from_argv(cls, argv: list[str] | None, **defaults) -> Comparison:
        parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--env", choices=("bild", "serve"), default="bild",
                            help="bild: BiLD-v1, one request at a time (this comparison); serve: BiLD-Serve-v0, rules "
                                 "and agents per load level (see `python evaluate.py --env serve --help`)")
        add_options(parser, "eval", EvalConfig, EvalConfig(), title="evaluation")
        add_options(parser, "env", EnvConfig, RUN_ENV, skip=tuple(f.name for f in fields(EnvConfig) if f.name not in
                                                                   ENV_OPTIONS),
                    title="environment (BiLD-v1): the env's arguments over the model's run's")
        refuse_moved(parser, argv, EnvConfig)  # --dtype, --draft...: keys of --pair-options now
        args = parser.parse_args(argv)
        try:
            over(EnvConfig(), given(args, "env"))  # each key known, of its sub-config's type
        except (TypeError, ValueError) as err:
            parser.error(str(err))
        setup_logging()
        return cls(replace(EvalConfig(), **given(args, "eval"), env=given(args, "env")))

    def check(self) -> None:
        self.model_path, self.run_env, self.extra_runs, self.out = check_evaluation(self.cfg)
        if self.cfg.out is None:  # the default folder, beside the run (a given --out was checked first, above)
            check_out(self.out, self.cfg.force)

    def close(self) -> None:
        release_outputs()
        out = self.out
        if not self.written and self.new and out is not None and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # the folder this evaluation made, left empty by a refusal or a failure: no trace of it
        for env in self.envs:
            env.close()

    def run(self) -> dict[str, Any]:
        """Every method on the same prompts (``check``'s checked options); the grid search's files written into the
        output folder as they are made."""
        cfg, model_path, run_env, extra_runs, out = self.cfg, self.model_path, self.run_env, self.extra_runs, self.out
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        try:
            test_env = BildEnv(**env_kwargs(cfg, run_env, split="test", max_prompts=cfg.num_prompts))
            cost = test_env.cost_model
            # the grid search and the trace on replay (exact, fast): the run's off switch and tree rules are rows of
            # the grid search too (each a fixed action), so its best may be one of them
            grid_env = BildEnv(**env_kwargs(cfg, run_env, split="validation", max_prompts=cfg.grid_prompts,
                                            backend="replay", cost_model=cost))
            trace_env = BildEnv(**env_kwargs(cfg, run_env, split="test", max_prompts=cfg.num_prompts,
                                             backend="replay", cost_model=cost))
            # an agent of a continuous action space acts in envs of its own; the baselines keep the grid
            action = run_env.actions.space if run_env else "discrete"
            trees = tuple(test_env.config.actions.tree_rules)  # the run's tree rules: fixed rows, its agent's actions
            if action == "discrete":
                agent_test, agent_grid, agent_trace = test_env, grid_env, trace_env
            else:
                agent_test, agent_grid, agent_trace = (
                    BildEnv(**env_kwargs(cfg, run_env, split="test", max_prompts=cfg.num_prompts, cost_model=cost,
                                         actions={"space": action})),
                    BildEnv(**env_kwargs(cfg, run_env, split="validation", max_prompts=cfg.grid_prompts,
                                         backend="replay", cost_model=cost, actions={"space": action})),
                    BildEnv(**env_kwargs(cfg, run_env, split="test", max_prompts=cfg.num_prompts, backend="replay",
                                         cost_model=cost, actions={"space": action})))
        except (PairError, ValueError, RuntimeError) as err:
            raise SystemExit(f"evaluate.py: {err}") from err
        self.envs |= {test_env, grid_env, trace_env, agent_test, agent_grid, agent_trace}
        self.test_env = test_env
        dqn = load_sb3(model_path, agent_test)
        # other agents (any algorithm, action space or observation): each in a test env with what it sees and does
        extra_envs: dict[tuple, BildEnv] = {}
        extras, extra_env = {}, {}
        for p in cfg.extra_model:
            file, extra_run = extra_runs[p]
            own = {k: getattr(extra_run.env, k) for k in AGENT_ENV_FIELDS} if extra_run else {}
            key = tuple(sorted((k, str(v)) for k, v in own.items()))
            try:
                if key not in extra_envs:
                    extra_envs[key] = BildEnv(**env_kwargs(cfg, run_env, split="test", max_prompts=cfg.num_prompts,
                                                           cost_model=cost) | own) if own else agent_test
            except (PairError, ValueError, RuntimeError) as err:
                raise SystemExit(f"evaluate.py: {err}") from err
            name = f"BiLD + {file.stem} ({file.parent.name})"
            self.envs.add(extra_envs[key])
            extras[name], extra_env[name] = load_sb3(file, extra_envs[key]), extra_envs[key]
        pair = test_env.pair
        check_prompts(cfg, test_env, grid_env)
        if cfg.force:
            clear_results(out)

        # 1. grid search over the 25 fixed pairs on validation prompts (cost model, replay: exact and fast)
        grid = grid_search(grid_env, prompts=cfg.grid_prompts, progress_bar=cfg.progress_bar)
        grid.save(out / "grid.json")
        dqn_val = [policy_method(agent_grid, "DQN", dqn)(i) for i in range(len(grid_env.prompts))]
        val_refs = {i: grid_env.references.get(grid_env.prompts[i]) for i in range(len(grid_env.prompts))}
        dqn_point = summarize(dqn_val, grid_env, val_refs)["DQN"]
        dqn_point = {"latency_ms": dqn_point["model_latency_ms_mean"], "bleu": dqn_point["bleu"]}
        k = cfg.k or choose_k(grid_env, cost, out, cfg.progress_bar)
        means = {p.action: -np.inf if p.errors else p.mean_return for p in grid.table}  # actions with errors last
        chosen_bandits = choose_bandits(grid_env, means) if cfg.bandits else {}

        # 2. every method on every test prompt, interleaved, after a warm-up
        fixed = FixedThresholds(test_env)
        algo = zip_algo(Path(model_path))
        agent = f"BiLD + {algo.upper() if algo else 'agent'}"  # the main agent, named by its algorithm
        tokens = test_env.config.max_new_tokens
        methods = self.methods = {
            "single model": decoder_method(test_env, "single model",
                                           lambda p: generate_target_only(pair, p, tokens, cost)),
            f"naive SD (k={k})": decoder_method(test_env, f"naive SD (k={k})",
                                                lambda p: generate_speculative(pair, p, k, tokens, cost)),
            **adaptive_methods(test_env, cfg.adaptive, cost),
            "HF assisted": hf_assisted_method(test_env),
            f"BiLD fixed ({fixed.fallback}/{fixed.rollback})": None,
            f"BiLD grid best ({grid.label})": None,
            **{f"tree {rule}": None for rule in trees},  # each of the run's tree rules as a fixed policy
            agent: None,
        }
        policies = {f"BiLD fixed ({fixed.fallback}/{fixed.rollback})": fixed, f"BiLD grid best ({grid.label})": grid,
                    **{f"tree {rule}": FixedTree(test_env, rule) for rule in trees}, agent: dqn} | extras
        for name, policy in policies.items():
            env = extra_env.get(name, agent_test if name == agent else test_env)
            methods[name] = policy_method(env, name, policy)
        for kind, entry in chosen_bandits.items():  # a fresh bandit, reset at every prompt's episode
            bandit = bandits.chosen_bandit(kind, entry)
            methods[f"BiLD + {kind}"] = policy_method(bandits.BanditFeedback(test_env, bandit), f"BiLD + {kind}", bandit)
        references = self.references = {i: test_env.references.get(test_env.prompts[i])
                                        for i in range(len(test_env.prompts))}
        for run in methods.values():
            run(0)  # warm-up, not recorded
        for i in tqdm(range(len(test_env.prompts)), desc="test prompts", disable=not cfg.progress_bar):
            for run in methods.values():
                self.rows.append(run(i))
        results = summarize(self.rows, test_env, references)

        # 3. the thresholds the DQN picks over many test runs (cost model, replay)
        trace_runner = policy_method(agent_trace, "DQN", dqn)
        trace = [trace_runner(r % len(trace_env.prompts)).thresholds
                 for r in tqdm(range(cfg.threshold_runs), desc="DQN threshold runs", disable=not cfg.progress_bar)]

        self.header = (
            f"Evaluation of {model_path} on {len(test_env.prompts)} test prompts of "
            f"{test_env.config.dataset or 'the preset dataset'} (pair {test_env.config.pair}: {pair.ids[0]} -> "
            f"{pair.ids[1]}, {test_env.config.max_new_tokens} new tokens), on {machine_description(pair.device)} "
            f"({str(pair.dtype).removeprefix('torch.')}). Latency: wall clock, per sentence; "
            + (f"reward and cost-model ms: {test_env.cost_profile.label} (timings of that device, not this one's)."
               if test_env.cost_profile else
               f"reward and cost-model ms: the env's cost model calibrated on this device "
               f"({cost.device}; coefficients in results.json)."))
        self.plots = (results, trace, grid, dqn_point, (fixed.fallback, fixed.rollback), agent.removeprefix("BiLD + "))
        return {"config": asdict(cfg), "model": str(model_path), "device": device_name(pair.device),
                "machine": machine_description(pair.device), "pair": list(pair.ids), "results": results,
                "grid_best": asdict(grid.best), "dqn_on_validation": dqn_point, "dqn_thresholds": trace,
                "cost_model": cost.to_dict(), "cost_profile": test_env.charged, "bandits": chosen_bandits}

    def write(self, report: dict[str, Any]) -> None:
        """``RESULT_FILES`` into the output folder, each whole; the table printed."""
        out = self.out
        try:
            text = report_json(report)  # before any table of them is printed or written
        except ValueError as err:
            raise SystemExit(f"evaluate.py: {err}") from None
        table = markdown(report["results"], self.header)
        write_text_atomic(out / "results.md", table + "\n")
        write_text_atomic(out / "results.json", text)
        write_text_atomic(out / "results.csv", results_csv(report["results"]))
        write_text_atomic(out / "per_prompt.csv", per_prompt_csv(self.rows, self.references))
        plot_all(out, *self.plots)
        self.written = True
        print(table)
        print(f"\nwrote {out}/: results.md results.json results.csv per_prompt.csv grid.json thresholds.png "
              "latency.png plane.png")

    def stopped(self, name: str) -> Stopped:
        """Stopped by signal ``name``: the test prompts every method finished are written to the output folder
        (``results.json`` with ``"complete": false`` and their summary, ``per_prompt.csv``)."""
        out, test_env = self.out, self.test_env
        rows = self.rows[:len(self.rows) - len(self.rows) % max(1, len(self.methods))]
        done = len({r.prompt_index for r in rows})
        if rows:
            report = {"config": asdict(self.cfg), "model": str(self.model_path), "complete": False, "stopped": name,
                      "prompts_done": done, "prompts": len(test_env.prompts)}
            try:
                text = report_json(report | {"results": summarize(rows, test_env, self.references)})
            except ValueError:  # a summary of too few prompts to be finite: the rows alone
                text = report_json(report)
            write_text_atomic(out / "results.json", text)
            write_text_atomic(out / "per_prompt.csv", per_prompt_csv(rows, self.references))
        kept = [n for n in RESULT_FILES if out is not None and (out / n).exists()]
        if not kept:
            return Stopped(f"stopped by {name} before any result was written: run the same command again")
        self.written = True
        measured = (f"the {done} of {len(test_env.prompts)} test prompts every method finished"
                    if rows else "no test prompt yet")
        return Stopped(f"stopped by {name}: {out} holds {', '.join(kept)} ({measured}; results.json says "
                       '"complete": false where it is written); to evaluate again, run the same command with --force')


def results_csv(results: dict[str, dict[str, Any]]) -> str:
    """``results.csv``: a line per method, its summary's numbers."""
    f = io.StringIO()
    w = csv.writer(f)
    keys = [k for k in next(iter(results.values())) if k != "latency_ms_ci95"]
    w.writerow(["method", *keys, "latency_ms_ci95_low", "latency_ms_ci95_high"])
    for name, m in results.items():
        w.writerow([name, *[m[k] for k in keys], *m["latency_ms_ci95"]])
    return f.getvalue()


def per_prompt_csv(rows: list[Row], references: dict[int, list[int]]) -> str:
    """``per_prompt.csv``: a line per method and test prompt."""
    f = io.StringIO()
    w = csv.writer(f)
    w.writerow(["method", "prompt_index", "latency_ms", "model_ms", "new_tokens", "proposed", "accepted",
                "target_forwards", "reward", "exact_match"])
    for r in rows:
        w.writerow([r.method, r.prompt_index, r.latency_ms, r.model_ms, r.new_tokens, r.proposed, r.accepted,
                    r.target_forwards, r.reward, r.new_ids == references[r.prompt_index]])
    return f.getvalue()
