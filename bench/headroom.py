"""The ceiling an adaptive threshold policy is judged against, on the replay backend.

    python -m bench.headroom --pair smollm2 --prompts 100                       # validation prompts
    python -m bench.headroom --pair smollm2 --split test --prompts 200 --model logs/<run>   # and an agent

On ``--prompts`` prompts of ``--split`` (the same prompts for every policy):

1. every fixed action (threshold pair): mean return, latency (cost model, ms per sentence), BLEU,
   regret and fidelity;
2. the best single action, chosen on ``--select-split`` prompts (validation by default: what grid
   search finds; a test split never chooses its own baseline), and the paper's fixed 0.103 / 4.697;
3. the per-prompt oracle: the best fixed action of each prompt, picked knowing its returns (an upper
   bound for prompt-level adaptation);
4. with ``--lookahead``, a per-step oracle: at every step the action that maximises the return of
   "this action, then the best single action to the end", run on the replay trees (one-step
   lookahead with a rollout, which by the policy improvement theorem is never below the best single
   action). It knows the future, so it is an estimate of what per-step adaptation could reach;
5. unless ``--no-bandits``, the training-free online baselines UCBSpec and EXP3Spec over the grid
   (``agents.common.bandits``: each prompt's episode from scratch, learning within it only), their exploration
   constant / learning rate and arm set chosen on the ``--select-split`` prompts;
6. with ``--model`` (SB3 model files or run folders, several allowed): each agent, deterministic, in an env with
   its run's observation, grid and score; several DQNs of one env also as their Q-ensemble (``agents.dqn.QEnsemble``).

The env's own arguments, as ``train.py`` takes them (``ENV_OPTIONS``: ``--pair``, ``--pair-options dtype=...``,
``--dataset``, ``--max-new-tokens``, ``--reward quality=...``, ``--actions``, ``--cost-profile``), set the replayed
BiLD-v1 env every policy runs in; ``--actions`` sets what they all choose from: the grid, the off switch, tree
rules, and what a fallback threshold reads (``score=``, ``bild.DraftScore``).

Agents and oracles are reported with the mean difference to the best single action and its paired
95% bootstrap interval. Writes ``--out`` (JSON with every per-prompt number) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from agents.common import bandits
from agents.bild.baselines import FixedAction, FixedThresholds
from agents.config import ConfigError
from agents.dqn import q_ensemble
from agents.bild.evaluation import PromptResults, choose_bandits, lookahead_returns, returns_on_prompts
from agents.common.stats import mean_ci
from agents.bild.runs import run_config_of
from agents.common.trained import AGENT_ENV_FIELDS, choose_model, load_agent
from bild_env.cli import add_options, given, setup_logging
from bild_env.decoding.bild import FIXED_FALLBACK, FIXED_ROLLBACK, check_score
from bild_env.decoding.profiles import ProfileError, charged
from bild_env.config import over
from bild_env.env import BildEnv, EnvConfig
from bild_env.command import UsageError, UsageExit, check_counts, writable_file
from bild_env.migrate import refuse_moved
from bild_env.models.pairs import PairError
from bild_env.replay.dataset import load_where_needed
from bild_env.replay.store import TreeStore


@dataclass
class HeadroomConfig:
    """Options of the headroom benchmark (the CLI is generated from it)."""

    split: str = field(default="validation", metadata={"help": "prompts the policies are compared on"})
    prompts: int = field(default=100, metadata={"help": "how many (the first N of the split)"})
    select_split: str = field(default="validation", metadata={"help": "prompts the best single action is chosen on"})
    select_prompts: int = field(default=50, metadata={"help": "how many"})
    lookahead: bool = field(default=False, metadata={"help": (
        "also the per-step oracle (one rollout per action at every step: slower)")})
    lookahead_prompts: int | None = field(default=None, metadata={"help": (
        "run the per-step oracle on the first N prompts only (paired with the best single action there); default: "
        "all")})
    oracle_prompts: int | None = field(default=None, metadata={"help": (
        "run all fixed actions (for the per-prompt oracle and the table) on the first N prompts only; the best single "
        "action and the paper's pair run on all (default: all)")})
    bandits: bool = field(default=True, metadata={"help": (
        "also UCBSpec and EXP3Spec (agents.common.bandits), chosen on the select split")})
    model: tuple[str, ...] = field(default=(), metadata={"help": (
        "SB3 model files or run folders to judge against the ceiling")})
    threads: int = field(default=1, metadata={"help": "torch CPU threads"})
    out: str = field(default="results/headroom.json", metadata={"help": "JSON with every per-prompt number"})
    env: EnvConfig = field(default_factory=lambda: replace(BENCH_ENV), metadata={"cli": False, "help": (
        "the replayed env every policy runs in: BENCH_ENV with the env's arguments given (ENV_OPTIONS; a dict of some "
        "of them is read over BENCH_ENV); an agent's observation and actions, its run's")})

    def __post_init__(self) -> None:
        self.env = bench_env(self.env)
        every = ("oracle_prompts", "lookahead_prompts")  # None: all the prompts
        try:
            check_counts(self, dict.fromkeys(("prompts", "select_prompts", "threads", *every), 1),
                         dict.fromkeys(every, "or leave it out for all the prompts"), optional=every)
            check_counts(self.env, {"max_new_tokens": 1})
        except UsageError as err:  # the bench's own (run_bench: exit 2 with its name)
            raise ConfigError(str(err)) from None
        try:
            check_score(self.env.actions.score)
        except ValueError as err:
            raise ConfigError(f"--actions score: {err}") from None


# The env the replay benches run: BiLD-v1 (BildEnv) on its replay backend, max_new_tokens the main job's; and the env
# arguments they take
BENCH_ENV = EnvConfig(backend="replay", max_new_tokens=32)
ENV_OPTIONS = ("pair", "pair_options", "dataset", "max_new_tokens", "reward", "actions", "cost_profile")


def bench_env(env: EnvConfig | dict) -> EnvConfig:
    """``env`` as a bench runs it: a dict of env arguments read over ``BENCH_ENV`` (a ``ConfigError`` naming a key
    that is unknown or of the wrong type)."""
    if isinstance(env, EnvConfig):
        return env
    try:
        return over(BENCH_ENV, dict(env))
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from None


def env_report(env: EnvConfig, taken: tuple[str, ...] = ENV_OPTIONS) -> dict:
    """The env arguments a bench took (``taken``), as its report's ``config["env"]`` holds them."""
    return {name: asdict(value) if is_dataclass(value) else value
            for name in taken for value in [getattr(env, name)]}


def make_env(cfg: EnvConfig) -> BildEnv:
    """A ``BildEnv`` (BiLD-v1) with ``cfg``; a ``ConfigError`` saying what is wrong with an option (split, pair,
    dtype, ...)."""
    cfg = load_where_needed(cfg)  # actions its decoding dataset lacks: their steps load the models (said)
    try:
        return BildEnv(**{f.name: getattr(cfg, f.name) for f in fields(cfg)})
    except (ValueError, PairError, ProfileError) as err:
        raise ConfigError(str(err)) from err


def fixed_table(env: BildEnv, prompts: list[int], desc: str) -> dict[int, PromptResults]:
    """Every fixed action on every prompt."""
    table = {}
    for action in tqdm(range(env.action_space.n), desc=desc, leave=False):
        table[action] = returns_on_prompts(env, FixedAction(action, env.observation_space.shape), prompts)
    return table


def best_action(table: dict[int, PromptResults]) -> int:
    """The action with the highest mean return (the lowest index on ties): what grid search finds."""
    return max(table, key=lambda a: (table[a].returns.mean(), -a))


def agent_env_config(path: str, cfg: EnvConfig) -> EnvConfig:
    """``cfg`` with what the agent at ``path`` sees and acts with taken from its run (the reward stays the bench's)."""
    run = run_config_of(path)
    return cfg if run is None else replace(cfg, **{k: getattr(run.env, k) for k in AGENT_ENV_FIELDS})


def row(name: str, returns: np.ndarray, base: np.ndarray, means: dict[str, float] | None = None) -> dict:
    lo, hi = mean_ci(returns - base)
    return {"policy": name, "return": float(returns.mean()), "return_ci95": list(mean_ci(returns)),
            "minus_best_single": float((returns - base).mean()), "minus_best_single_ci95": [lo, hi]} | (means or {})


def run_agents(paths, env_cfg: EnvConfig, prompts: list[int], env: BildEnv | None = None) -> tuple[list, list]:
    """Each agent of ``paths`` (``--model``), deterministic, on ``prompts`` in ``env_cfg`` with what it sees and does
    taken from its run (``env`` itself where that is its config), and several DQNs of one env also as their
    Q-ensemble (``agents.dqn.q_ensemble``): ([(row name, results)], [(model, its env)])."""
    ran, models = [], []
    for path in paths:
        agent_cfg = agent_env_config(path, env_cfg)
        agent_env = env if env is not None and agent_cfg == env.config else make_env(agent_cfg)
        file, _ = choose_model(path)
        model = load_agent(file, agent_env)
        ran.append((f"agent {file}", returns_on_prompts(agent_env, model, prompts, desc=str(file))))
        models.append((model, agent_env))
    ensemble = q_ensemble([(m, e.config) for m, e in models])
    if ensemble is not None:  # their mean Q-values
        ran.append((f"agents' Q-ensemble of {len(models)}",
                    returns_on_prompts(models[0][1], ensemble, prompts, desc="Q-ensemble")))
    return ran, models


def check_models(paths) -> None:
    """Before the long part: every agent's model file and run config can be read (a ``ConfigError`` otherwise)."""
    for path in paths:
        file, _ = choose_model(path)
        if not file.is_file():
            raise ConfigError(f"--model {path}: no model file at {file}")
        run_config_of(path)


def run(cfg: HeadroomConfig) -> dict:
    check_models(cfg.model)
    torch.set_num_threads(cfg.threads)
    base_cfg = cfg.env
    store = TreeStore()  # both envs read and fill the same trees
    select_env = make_env(replace(base_cfg, split=cfg.select_split, max_prompts=cfg.select_prompts, replay_store=store))
    test_cfg = replace(base_cfg, split=cfg.split, max_prompts=cfg.prompts, cost_model=select_env.cost_model,
                       replay_store=store)
    env = make_env(test_cfg)
    prompts = list(range(len(env.prompts)))
    for e in (select_env, env):
        e.references.prefetch(e.prompts)
    choose = fixed_table(select_env, list(range(len(select_env.prompts))), f"fixed actions ({cfg.select_split})")
    best = best_action(choose)
    same = (cfg.split, cfg.prompts) == (cfg.select_split, cfg.select_prompts)
    try:  # the paper's pair, where the grid holds it
        paper = FixedThresholds(env, FIXED_FALLBACK, FIXED_ROLLBACK).action
    except ValueError:
        paper = None
    n_oracle = len(prompts) if cfg.oracle_prompts is None else min(cfg.oracle_prompts, len(prompts))
    if same:
        table = choose
    elif n_oracle == len(prompts):
        table = fixed_table(env, prompts, f"fixed actions ({cfg.split})")
    else:  # every action on the first n_oracle prompts, the two that rows compare against on all
        table = fixed_table(env, prompts[:n_oracle], f"fixed actions ({cfg.split}, first {n_oracle})")
        for a in {best, paper} - {None}:
            rest = returns_on_prompts(env, FixedAction(a, env.observation_space.shape), prompts[n_oracle:])
            table[a] = PromptResults.concat(table[a], rest)
    base = table[best].returns
    by_prompt = np.stack([table[a].returns[:n_oracle] for a in sorted(table)])  # actions x prompts
    oracle_name = "per-prompt oracle of fixed actions" + (f" (first {n_oracle} prompts)" if n_oracle < len(prompts) else "")
    rows = [row(f"best single action {env.decode(best).text} (chosen on {cfg.select_split})", base, base,
                table[best].means())]
    if paper is not None:
        rows.append(row(f"paper's fixed {env.thresholds(paper)}", table[paper].returns, base, table[paper].means()))
    rows.append(row(oracle_name, by_prompt.max(0), base[:n_oracle]))
    if cfg.lookahead:
        n_look = len(prompts) if cfg.lookahead_prompts is None else min(cfg.lookahead_prompts, len(prompts))
        rows.append(row("per-step oracle (one-step lookahead)" + (f" (first {n_look} prompts)" if n_look < len(prompts)
                                                                  else ""),
                        lookahead_returns(env, prompts[:n_look], best), base[:n_look]))
    means = {a: r.returns.mean() for a, r in choose.items()}
    chosen_bandits = choose_bandits(select_env, means, progress_bar=True) if cfg.bandits else {}
    for kind, entry in chosen_bandits.items():  # a fresh bandit, reset at every prompt's episode
        bandit = bandits.chosen_bandit(kind, entry)
        res = returns_on_prompts(bandits.BanditFeedback(env, bandit), bandit, prompts, desc=kind)
        rows.append(row(bandits.describe(kind, entry, lambda a: env.decode(a).text), res.returns, base, res.means()))
        entry["per_prompt_returns"] = res.returns.tolist()
    ran, models = run_agents(cfg.model, test_cfg, prompts, env)
    rows += [row(name, res.returns, base, res.means()) for name, res in ran]
    agents = {name.removeprefix("agent "): res for name, res in ran}  # per_prompt_returns' keys: the files
    floors = on_floor(cfg, select_env, best, models, prompts, store)
    for name, (res, kept) in floors.items():
        rows.append(row(f"{name} on the best fixed action's floor (" + (
            "the best fixed action: no margin helped on validation" if kept["margin"] == "inf" else
            f"margin {kept['margin']}, its gain on {cfg.select_split} above its interval") + ")", res.returns, base,
                        res.means()))
    seeds = [r for name, r in agents.items() if not name.startswith("agents' Q-ensemble")]
    if len(seeds) > 1:  # several training seeds: their mean and spread, and the mean per prompt against the baseline
        means = np.array([r.returns.mean() for r in seeds])
        mean_agent = np.mean([r.returns for r in seeds], axis=0)
        rows.append(row(f"agents given: mean of {len(seeds)} (spread across them, e.g. seeds: std {means.std(ddof=1):.4f}, "
                        f"min {means.min():+.4f}, max {means.max():+.4f})", mean_agent, base))
    env.close()
    select_env.close()
    return {
        "config": own_options(cfg) | {"env": env_report(cfg.env)}, "device": env.cost_model.device,
        "dtype": str(env.pair.dtype),
        "prompts_run": {cfg.split: len(prompts), cfg.select_split: len(select_env.prompts)},
        "cost_profile": charged(cfg.env.cost_profile), "cost_profile_label": env.cost_profile.label if env.cost_profile else None,
        "floors": {name: kept for name, (_, kept) in floors.items()},
        "best_single_action": best, "thresholds": {a: env.thresholds(a) for a in table},
        "names": {a: env.decode(a).text for a in table}, "bandits": chosen_bandits,
        "fixed": {a: table[a].means() | {"prompts": len(table[a].prompts)} for a in table}, "rows": rows,
        "per_prompt_returns": {a: table[a].returns.tolist() for a in table}
        | {name: r.returns.tolist() for name, r in agents.items()},
    }


def on_floor(cfg: HeadroomConfig, select_env: BildEnv, best: int, models: list, prompts: list[int],
             store) -> dict[str, tuple[PromptResults, dict]]:
    """Each DQN agent (and several as their Q-ensemble) on the best fixed action's floor: ``TableGuard`` over
    ``FixedAction(best)``, its margin kept by ``keep_where_it_helps`` on the select split's prompts in the agent's own
    env, then run on the test ``prompts``: {name: (results, the choice)}."""
    from agents.serve.rules import TableGuard, dqn_q_values, grid_map
    from agents.serve.selection import GUARD_MARGINS, keep_where_it_helps

    groups = {f"agent {i}": (dqn_q_values(m), e) for i, (m, e) in enumerate(models) if hasattr(m, "q_net")}
    ensemble = q_ensemble([(m, e.config) for m, e in models])
    if ensemble is not None:
        groups[f"agents' Q-ensemble of {len(models)}"] = (lambda o: ensemble.q_values(o)[0], models[0][1])
    names = {f"agent {i}": f"agent {choose_model(p)[0]}" for i, p in enumerate(cfg.model)}
    out = {}
    for key, (q, agent_env) in groups.items():
        to_agent = grid_map(select_env, agent_env)
        if best not in to_agent:  # the agent's grid lacks the best fixed action
            continue
        own = make_env(replace(agent_env.config, split=cfg.select_split, max_prompts=cfg.select_prompts,
                               cost_model=select_env.cost_model, replay_store=store))
        n = int(own.action_space.n)
        guard = lambda m, e: TableGuard(q, FixedAction(to_agent[best], e.observation_space.shape),  # noqa: E731
                                        {a: a for a in range(n)}, m)
        chosen = list(range(len(own.prompts)))
        by_margin = {m: returns_on_prompts(own, guard(m, own), chosen).returns for m in GUARD_MARGINS}
        own.close()
        kept = keep_where_it_helps(by_margin.pop(np.inf), by_margin)  # the rule in the agent's env (its score, reward)
        res = returns_on_prompts(agent_env, guard(kept["margin"], agent_env), prompts, desc=f"{key} on the floor")
        name = names.get(key, key)
        out[name if name not in out else f"{name} #{len(out) + 1}"] = (res, kept | {"margin": f"{kept['margin']:g}"})
    return out


def prompts_ran(report: dict) -> str:
    """"N <split> prompts" a report ran (``prompts_run``), saying so where that is fewer than asked: a decoding dataset
    replays only the prompts it recorded."""
    cfg = report["config"]
    ran = report.get("prompts_run", {}).get(cfg["split"], cfg["prompts"])
    fewer = f" (of {cfg['prompts']} asked: the split, or the decoding dataset replayed, holds {ran})"
    return f"{ran} {cfg['split']} prompts{fewer if ran < cfg['prompts'] else ''}"


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [f"pair {cfg['env']['pair']} ({report['dtype']}, "
             f"{report.get('cost_profile_label') or 'cost model of ' + report['device']}), {prompts_ran(report)}, "
             f"quality term {cfg['env']['reward']['quality']}", "",
             "| policy | return [95% CI] | minus best single [paired 95% CI] | latency ms | BLEU | regret | fidelity |",
             "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lo, hi = r["return_ci95"]
        dlo, dhi = r["minus_best_single_ci95"]
        extra = " | ".join("n/a" if k not in r else f"{r[k]:.1f}" if k in ("latency_ms", "bleu") else f"{r[k]:.4f}"
                           for k in ("latency_ms", "bleu", "regret", "fidelity"))
        lines.append(f"| {r['policy']} | {r['return']:+.4f} [{lo:+.4f}, {hi:+.4f}] | "
                     f"{r['minus_best_single']:+.4f} [{dlo:+.4f}, {dhi:+.4f}] | {extra} |")
    lines += ["", "every fixed action (mean return, latency ms, BLEU, regret, over the prompts it ran on):"]
    for a, m in sorted(report["fixed"].items(), key=lambda kv: -kv[1]["return"]):
        lines.append(f"  {a:2d} {report['names'][a]}: {m['return']:+.4f}  {m['latency_ms']:.1f} ms  BLEU {m['bleu']:.1f}  "
                     f"regret {m['regret']:.4f}  ({m.get('prompts', '?')} prompts)")
    return "\n".join(lines)


def own_options(cfg) -> dict:
    """A bench's own options (all but ``env``), as its report's ``config`` holds them."""
    return {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name != "env"}


def parse_bench(config: type, taken: tuple[str, ...], argv: list[str] | None, doc: str):
    """A replay bench's command line: ``config``'s own options, then the env's arguments it takes (``taken``), as
    ``train.py`` spells them, read over its default ``env``; an old spelling (``--dtype``, ``--quality``) is refused
    naming the option that holds it (``bild_env.migrate.refuse_moved``)."""
    defaults = config()
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, "options", config, defaults)
    add_options(parser, "env", EnvConfig, defaults.env, skip=tuple(f.name for f in fields(EnvConfig)
                                                                   if f.name not in taken),
                title="environment (BiLD-v1 on its replay backend): the env's arguments, as train.py takes them")
    refuse_moved(parser, argv, EnvConfig)
    args = parser.parse_args(argv)
    try:
        env = over(defaults.env, given(args, "env"))
    except (TypeError, ValueError) as err:
        parser.error(str(err))
    cfg = replace(defaults, **given(args, "options"), env=env)
    try:
        writable_file(cfg.out or ".")  # before any work, its folder made: a result that cannot be written is work lost
    except ValueError as err:
        raise UsageExit(f"error: {err}") from None
    return cfg


def run_bench(prog: str, config: type, taken: tuple[str, ...], run_report, show, argv: list[str] | None,
              doc: str) -> dict:
    """A replay bench's command: its options (``parse_bench``; ``--out`` checked before any work),
    ``run_report(cfg)``, its table (``show(report)``) printed and the report written as JSON to ``--out``; a
    ``ConfigError`` exits with 2."""
    setup_logging()
    try:
        cfg = parse_bench(config, taken, argv, doc)
        report = run_report(cfg)
    except ConfigError as err:
        raise UsageExit(f"{prog}: {err}") from err
    print(show(report))
    Path(cfg.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv: list[str] | None = None) -> dict:
    return run_bench("bench.headroom", HeadroomConfig, ENV_OPTIONS, run, markdown, argv, __doc__)


if __name__ == "__main__":
    from bild_env.command import run_command

    sys.exit(run_command("python -m bench.headroom", main))
