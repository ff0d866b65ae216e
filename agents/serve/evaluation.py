"""The ceiling and the hand-written rules of BiLD-Serve-v0, per load level and per domain.

    python evaluate.py --env serve --pair smollm2                           # rules and ceilings (quick)
    python evaluate.py --env serve --full --pair smollm2                    # every rule, level and the bandits
    python evaluate.py --env serve --pair smollm2 --model logs/<run1> logs/<run2>   # and agents beside them
    python evaluate.py --env serve --model pretrained                       # the shipped serving agent beside them
    python evaluate.py --env serve --pair tiny-random --speed               # env steps per second, warm, per load
    python evaluate.py --env serve --clock --load 0.05 0.3 1.0 --model logs/<run>  # on real models and the wall
                                                                            # clock instead (agents.serve.load_clock)

``python evaluate.py --env serve`` starts from ``QUICK`` where the command line is silent (the main job's four load
levels and lossless grid, 4 validation and 8 test episodes per level of 64 steps, one moving load, no bandits:
minutes on a 2-core CPU); ``--full`` starts from the defaults below instead (26
actions, five levels, 8 and 8 episodes of 128 steps, two moving loads, the bandits: hours on a 2-core CPU). One
progress line counts the episodes of the whole evaluation, with the time left; each load's table is printed, and
the JSON at ``--out`` rewritten with the loads done so far (``"complete": false``), as that load is done. Ctrl-C
(or, under ``evaluate.py``, SIGTERM) stops it there: exit 130, those loads kept at ``--out`` (``"stopped"``), a line
saying what to run.

On the replay backend, with the cost model's batched tables, every policy meets the same requests in
the same order (common random numbers: episode seeds shared by every policy):

1. **validation** (``--select-episodes`` per load level of ``--levels``, constant load each): every
   fixed action (the grid and speculation off); from them the best single fixed action over all levels
   (grid search), the per-load table (the best fixed action per level), the per-batch-size table (step rewards
   rank each bucket's actions, whole episodes choose: ``rules.refine_batch_table``), the batch size above which
   speculation goes off (vLLM's rule; chosen among 1, 2, 4, ... max_batch), and the acceptance threshold
   below which it goes off (chosen among a few); and the settings of the training-free online bandits UCBSpec and
   EXP3Spec (``agents.common.bandits``: exploration constant or learning rate, and arm set; unless ``--no-bandits``);
2. **per domain** (``--domains``): the best fixed action per (load level, domain) with single-domain
   workloads, and what that table gains over the best single action per domain (headroom per domain);
   and the per-batch-size table per domain, from exact counterfactuals on the mixed workload (one
   domain's action varied at a time); on test both run per request (an env with ``per_domain``: each
   request takes its own domain's action);
3. **test** (``--episodes`` per level, test prompts, other seeds; on ``--test-mix`` where given, a workload the
   rules were not chosen on and the agents not trained on, e.g. with a domain neither saw): every rule, the bandits
   (each episode from scratch: they learn online within it, nothing across episodes), the per-episode oracle (the
   best of the fixed actions for each episode, knowing the returns), with ``--step-oracle`` the per-step
   hindsight oracle (at each step the fixed action whose reward is highest that step, knowing it: what adapting
   every step could win if acceptance were foreseen) and each ``--model`` (with several
   DQNs on one grid, also their Q-ensemble, ``agents.dqn.QEnsemble``); and on the moving loads of
   ``--moving`` (a burst, a daily curve), where the table follows the current level.

Each row: mean return with its 95% bootstrap interval, the difference to the best single fixed action
paired per episode with its interval, and the goodput ratio to target-only serving at the same load;
``overall``: every policy over all the constant levels' episodes together (paired the same way).
Writes ``--out`` (JSON), beside it a plot of goodput against load (``.png``: each policy's goodput
ratio to target-only serving at every constant level), and prints markdown tables.

Every option is checked before any model loads (``check``): counts >= 1, load levels in the range the load
profiles take, actions of the env's grid, the workload, ``--out`` writable and holding no earlier results (unless
``--force``), and every ``--model`` (``check_model``: a readable SB3 model of a BiLD-Serve-v0 run whose observation
and action mean here what they meant in training; a warning where it meets another system). No NaN reaches a
table or the JSON: an evaluation with nothing to measure exits with an error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict

import numpy as np
import torch

from agents.common import bandits
from agents.common.checks import report_json
from agents.common.files import write_text_atomic
from agents.common.phases import PhaseBar
from agents.evaluation import Evaluation
from agents.serve.bench_config import (EVERY_S, SPEED_REPEATS, ServingBenchConfig, check_actions, check_counts,
                                       check_loads, check_out, env_options, grid_size, make_env, options_parser,
                                       outputs, parse_options)
from agents.dqn import q_ensemble
from agents.serve.evaluation_agents import check_model, load_agents, trained_world
from agents.serve.evaluation_report import add_minus_table, markdown, overall_rows, plot_goodput, row
from agents.serve.progress import advance, counting, episodes
from agents.serve.rules import (AcceptanceRule, BatchTable, DomainBatchTable, DomainTable, Fixed, LoadTable,
                                OffAboveBatch, StepHindsight, batch_bucket, bucket_label, choose_domain_batch_table,
                                refine_episodes)
from agents.serve.selection import (GUARD_MARGINS, action_set, choose, choose_floors, fixed_returns, guard_for,
                                    per_domain)
from bild_env.command import Stopped
from bild_env.decoding.profiles import charged
from bild_env.models.device import explain_dtype
from bild_env.models.pairs import preset_names
from bild_env.prompts.code import check_code_source
from bild_env.serving.env import ServingConfig, validate
from bild_env.serving.workload import parse_mix


def test_rows(cfg: ServingBenchConfig, chosen: dict, agents: list, seeds: list[int], load: str,
              raw: dict | None = None) -> list[dict]:
    """The test rows of every policy under ``load``; ``raw`` (when given) collects each policy's per-episode
    (returns, speedups) for the overall rows."""
    env = make_env(cfg, "test", load)
    fixed = fixed_returns(env, seeds, cfg.fixed_actions)
    base_r, base_s = fixed[chosen["best_single"]]
    ids = list(fixed)
    stacked = np.stack([fixed[a][0] for a in ids])
    oracle_r, best = stacked.max(axis=0), stacked.argmax(axis=0)
    oracle_s = np.array([fixed[ids[int(k)]][1][i] for i, k in enumerate(best)])
    labels = chosen["labels"]
    rows = [row(f"best single fixed {labels[chosen['best_single']]}", base_r, base_s, base_r),
            row("speculation off", *fixed[chosen["off"]], base_r)]
    table = LoadTable(env, chosen["table"])
    rows.append(row("per-load table (" + ", ".join(f"{u:g}: {labels[a]}" for u, a in chosen["table"].items()) + ")",
                    *episodes(env, table, seeds)[:2], base_r))
    rows.append(row("per-batch-size table (" + ", ".join(f"{bucket_label(k)}: {labels[a]}"
                                                        for k, a in chosen["batch_table"].items()) + ")",
                    *episodes(env, BatchTable(chosen["batch_table"], chosen["off"], cfg.env.max_batch,
                                              env.config.observe.batch_scale), seeds)[:2],
                    base_r))
    rows.append(row(f"off above batch {chosen['off_above_batch']}, else {labels[chosen['best_on']]}",
                    *episodes(env, OffAboveBatch(chosen["best_on"], chosen["off"], chosen["off_above_batch"],
                                                   cfg.env.max_batch, env.config.observe.batch_scale), seeds)[:2], base_r))
    rows.append(row(f"off below acceptance {chosen['acceptance_threshold']:g}",
                    *episodes(env, AcceptanceRule(chosen["best_on"], chosen["off"],
                                                    chosen["acceptance_threshold"]), seeds)[:2], base_r))
    for kind, entry in chosen.get("bandits", {}).items():  # online per episode: a fresh bandit, reset every episode
        bandit = bandits.chosen_bandit(kind, entry)
        rows.append(row(bandits.describe(kind, entry, labels.__getitem__),
                        *episodes(bandits.BanditFeedback(env, bandit), bandit, seeds)[:2], base_r))
    if chosen.get("domain_table"):  # each request its domain's action: an env that takes an action per domain
        own = make_env(cfg, "test", load, actions={"per_domain": True})
        rows.append(row("per-domain-and-load table, per request ("
                        + "; ".join(f"{u:g}: " + ", ".join(f"{d} {labels[a]}" for d, a in t.items())
                                    for u, t in chosen["domain_table"].items()) + ")",
                        *episodes(own, DomainTable(own, chosen["domain_table"]), seeds)[:2], base_r))
        rows.append(row("per-batch-size-and-domain table, per request ("
                        + ", ".join(f"{bucket_label(k)} {d}: {labels[a]}" for (k, d), a in chosen["domain_batch_table"].items()
                                    if a != chosen["off"]) + "; else off)",
                        *episodes(own, DomainBatchTable(own, chosen["domain_batch_table"], chosen["off"]), seeds)[:2],
                        base_r))
        own.close()
    rows.append(row("per-episode oracle of the fixed actions", oracle_r, oracle_s, base_r))
    if cfg.step_oracle:
        rows.append(row("per-step hindsight oracle of the fixed actions",
                        *episodes(env, StepHindsight(env, ids), seeds)[:2], base_r))
    agent_runs = []
    for name, agent, grid in agents:  # each in an env with its own action grid: the same requests and arrivals
        own = make_env(cfg, "test", load, **grid) if grid else env
        agent_runs.append(episodes(own, agent, seeds)[:2])
        rows.append(row(name, *agent_runs[-1], base_r))
        if own is not env:
            own.close()
    ensemble = q_ensemble(agents)
    if ensemble is not None:  # one agent: the members' mean Q-values
        own = make_env(cfg, "test", load, **agents[0][2]) if agents[0][2] else env
        rows.append(row(f"agents' Q-ensemble of {len(agents)}", *episodes(own, ensemble, seeds)[:2], base_r))
        if own is not env:
            own.close()
    for name, (group, choice) in chosen.get("floors", {}).items():  # on the table's floor (TableGuard)
        own = make_env(cfg, "test", load, **group[0][2]) if group[0][2] else env
        margin = choice["margin"]
        rows.append(row(f"{name} on the per-batch-size table's floor (" + (
            "the table: no margin helped on validation" if math.isinf(margin) else
            f"margin {margin:g}, its gain on validation above its interval") + ")",
                        *episodes(own, guard_for(cfg, chosen, group, own, margin), seeds)[:2], base_r))
        if own is not env:
            own.close()
    if len(agent_runs) > 1:  # the seeds together: each episode's mean over the agents (an interval over episodes)
        rows.append(row(f"agents, mean of {len(agent_runs)}", np.mean([r for r, _ in agent_runs], axis=0),
                        np.mean([s for _, s in agent_runs], axis=0), base_r))
    env.close()
    add_minus_table(rows)
    for r in rows:
        per_episode = r.pop("_episodes")
        if raw is not None:
            raw.setdefault(r["policy"].split(" (")[0].split(",")[0], []).append(per_episode)
    return rows


def planned_episodes(cfg: ServingBenchConfig, agents: list, floors: int, tables: int | None = None) -> int:
    """The episodes ``run`` will run (its progress line's total): on validation every fixed action, the rules scored
    there, the per-batch-size table's (step rewards, then the tables it tries), the bandits' candidates, the margins
    of the ``floors`` agents put on the table's floor, per level; on test each row's, per constant and moving load.
    Exact once ``tables`` (the per-batch-size tables whole episodes tried) is known, at most before; but for
    ``--domains`` (the per-domain tables' own runs: about)."""
    n, _ = grid_size(cfg.env)
    fixed = len(set(cfg.fixed_actions) | {n - 1}) if cfg.fixed_actions else n
    rules = len({min(cfg.env.max_batch, 2**k) for k in range(8)}) + 4  # off above batch b; off below acceptance t
    one_grid = len({str(g) for _, _, g in agents}) == 1
    validation = fixed + rules + 1 + (len(bandits.candidates(list(range(fixed)))) if cfg.bandits else 0)
    validation += len(GUARD_MARGINS) * floors
    validation += (len(cfg.domains) * fixed + 1) if cfg.domains else 0
    test = (fixed + 4 + 2 * cfg.bandits + 2 * bool(cfg.domains) + cfg.step_oracle + len(agents)
            + (len(agents) > 1 and one_grid) + floors)
    per_table = len(cfg.levels) * cfg.select_episodes
    tried = (per_table * tables if tables is not None else
             refine_episodes(per_table, batch_bucket(cfg.env.max_batch) + 1))
    return (per_table * validation + tried
            + (len(cfg.levels) + len(cfg.moving)) * cfg.episodes * test)


def run(cfg: ServingBenchConfig, done: Callable[[dict, str, str], None] | None = None,
        say: Callable[[str], None] | None = None) -> dict:
    """Validation, then test at every level and moving load (the module's docstring): the report. One progress line
    (``say``, default stderr) counts every episode of the whole evaluation against ``planned_episodes``;
    ``done(report, section, load)`` is called as each load's test rows are in (``section`` "levels" or "moving")."""
    torch.set_num_threads(cfg.threads)
    agents = load_agents(cfg)  # before the validation runs: a model that does not fit fails now, not minutes later
    bar = PhaseBar("evaluation", "episode", say or (lambda text: print(text, file=sys.stderr, flush=True)), EVERY_S)
    bar.plan(planned_episodes(cfg, agents, floors=len(agents) + (len(agents) > 1)))  # at most
    with counting(bar):
        return _run(cfg, agents, bar, done or (lambda *_: None))


def _run(cfg: ServingBenchConfig, agents: list, bar: PhaseBar, done: Callable[[dict, str, str], None]) -> dict:
    t0 = time.perf_counter()
    select_seeds = list(range(1000, 1000 + cfg.select_episodes))
    test_seeds = list(range(cfg.episodes))
    chosen = choose(cfg, select_seeds)
    chosen["floors"] = choose_floors(cfg, chosen, agents, select_seeds)
    bar.plan(planned_episodes(cfg, agents, floors=len(chosen["floors"]),  # now known: which agents a floor takes,
                              tables=len(chosen["batch_table_scores"])))  # and the tables tried
    report = {"config": asdict(cfg), "chosen": {k: v for k, v in chosen.items() if k not in ("labels", "floors")},
              "levels": {}, "moving": {}, "cost_profile": charged(cfg.env.cost_profile),
              "rules_chosen_under": list(cfg.select_profiles) or charged(cfg.env.cost_profile)}
    report["chosen"]["table"] = {str(u): chosen["labels"][a] for u, a in chosen["table"].items()}
    report["chosen"]["best_single"] = chosen["labels"][chosen["best_single"]]
    if chosen["floors"]:  # each agent's margin ("inf": the table itself)
        report["chosen"]["floors"] = {name: choice | {"margin": f"{choice['margin']:g}"}
                                      for name, (_, choice) in chosen["floors"].items()}
    report["chosen"]["bandits"] = {kind: entry | {"arm_labels": [chosen["labels"][a] for a in entry["arms"]]}
                                   for kind, entry in chosen["bandits"].items()}
    if cfg.domains:  # the per-domain table first: on test it runs as a rule, each request its domain's action
        report["domains"], domain_table = per_domain(cfg, select_seeds)
        mix = parse_mix(cfg.env.mix)
        chosen["domain_table"] = {u: {d: domain_table[u].get(d, chosen["table"][u]) for d in mix} for u in cfg.levels}
        report["chosen"]["domain_table"] = {str(u): {d: chosen["labels"][a] for d, a in t.items()}
                                            for u, t in chosen["domain_table"].items()}
        # and the per-batch-size table per domain, from exact counterfactuals on the mixed validation episodes
        envs = [make_env(cfg, "validation", f"constant:{u}", actions={"per_domain": True}) for u in cfg.levels]
        grid = action_set(envs[0], cfg.fixed_actions)
        chosen["domain_batch_table"], means = choose_domain_batch_table(
            envs, [BatchTable(chosen["batch_table"], chosen["off"], cfg.env.max_batch,
                              envs[0].config.observe.batch_scale)] * len(envs), select_seeds, grid)
        advance(len(envs) * len(select_seeds))
        for e in envs:
            e.close()
        report["chosen"]["domain_batch_table"] = {f"{bucket_label(k)} {d}": chosen["labels"][a]
                                                  for (k, d), a in chosen["domain_batch_table"].items()}
        report["chosen"]["domain_batch_table_means"] = {
            f"{bucket_label(k)} {d}": {chosen["labels"][a]: m for a, m in v.items()} for (k, d), v in means.items()}
    from bild_env.models.device import machine_description

    report["machine"] = machine_description()
    raw: dict = {}
    for u in cfg.levels:
        report["levels"][str(u)] = test_rows(cfg, chosen, agents, test_seeds, f"constant:{u}", raw)
        report["seconds"] = time.perf_counter() - t0
        done(report, "levels", str(u))
    report["overall"] = overall_rows(raw)
    for r in report["overall"]:
        r.pop("_episodes")
    for load in cfg.moving:
        report["moving"][load] = test_rows(cfg, chosen, agents, test_seeds, load)
        report["seconds"] = time.perf_counter() - t0
        done(report, "moving", load)
    report["seconds"] = time.perf_counter() - t0
    return report


def speed(cfg: ServingBenchConfig) -> dict:
    """Env steps per second of a lossless fixed action, (0.45, 0.5), per load level on warm replay trees: each
    level's episode runs once to fill the trees, then ``SPEED_REPEATS`` more times (same seed, so every answer
    is a hit), each timed; the median and the range are reported (a busy machine shows as a wide range)."""
    torch.set_num_threads(cfg.threads)
    rows = {}
    for u in cfg.levels:
        env = make_env(cfg, "validation", f"constant:{u}")
        episodes(env, Fixed(15), [0])
        rates = []
        for _ in range(SPEED_REPEATS):
            t0 = time.perf_counter()
            _, _, eps = episodes(env, Fixed(15), [0])
            rates.append(len(eps[0].actions) / (time.perf_counter() - t0))
        rows[str(u)] = {"steps_per_s": float(np.median(rates)), "range": [min(rates), max(rates)],
                        "mean_batch": eps[0].summary["mean_batch"]}
        env.close()
    from bild_env.models.device import machine_description

    return {"config": asdict(cfg), "speed": rows, "machine": machine_description()}


def check(cfg: ServingBenchConfig) -> None:
    """Refuse options that make no sense before any model loads, naming the option and what it takes: counts, load
    levels, fixed actions, the models' settings (``--pair``, ``--pair-options dtype``), the test workload
    (``test_mix``, and per-domain tables that would meet a domain they have no action for), the env's options as the
    env checks them (``validate``), the output (``check_out``) and every ``--model`` (``check_model``)."""
    check_counts(cfg)
    check_loads(cfg)
    check_actions(cfg)
    if cfg.env.pair not in preset_names():
        raise ValueError(f"--pair: unknown pair {cfg.env.pair!r}; choose one of {', '.join(preset_names())}")
    try:
        explain_dtype(cfg.env.pair_options.dtype, "cpu")
    except ValueError as err:
        raise ValueError(f"--pair-options dtype: {err}") from None
    for d in cfg.domains:
        try:
            parse_mix(d)
        except ValueError as err:
            raise ValueError(f"--domains: {err}") from None
    for option, checker in (("test_mix", parse_mix), ("test_code_source", check_code_source)):
        if not getattr(cfg, option):
            continue  # empty: the test episodes take the env's mix and code source
        try:
            checker(getattr(cfg, option))
        except ValueError as err:
            raise ValueError(f"--{option.replace('_', '-')}: {err}") from None
    if cfg.test_mix:
        unseen = sorted(set(parse_mix(cfg.test_mix)) - set(cfg.domains)) if cfg.domains else []
        if unseen:
            raise ValueError(f"--test-mix {cfg.test_mix!r} has domain(s) {unseen} the per-domain tables of --domains "
                             f"{' '.join(cfg.domains)} have no action for: leave --domains out, or add them to it")
    for split in ("validation", "test"):  # what is left, as the env checks it (e.g. the mix with its code source)
        validate(ServingConfig(**env_options(cfg, split, f"constant:{cfg.levels[0]}")))
    if cfg.speed and cfg.model:
        raise ValueError("--speed measures the env's steps per second only: --model would not run; leave one out")
    check_out(cfg)
    for model in cfg.model:
        check_model(cfg, model)


def build_parser(defaults: ServingBenchConfig | None = None) -> argparse.ArgumentParser:
    """``python evaluate.py --env serve``'s options, showing ``defaults``' values (``ServingBenchConfig()``'s: the full
    evaluation's): the evaluation's own, then the env's arguments but its split and load (``options_parser``)."""
    return options_parser(defaults if defaults is not None else ServingBenchConfig(), __doc__, "evaluate.py --env serve")


def parse(argv: list[str] | None, defaults: ServingBenchConfig | None = None, check=None) -> ServingBenchConfig:
    """The evaluation's options over ``defaults`` (None: ``ServingBenchConfig()``), the env's over its ``env``, and
    with ``check`` checked (``parse_options``)."""
    return parse_options(argv, defaults if defaults is not None else ServingBenchConfig(), __doc__,
                         "evaluate.py --env serve", check)


class ServingEvaluation(Evaluation):
    """BiLD-Serve-v0's evaluation under the cost model for ``agents.evaluation.evaluate`` (the module docstring): each
    load's table printed, and the JSON at ``--out`` rewritten whole (``"complete": false``), as that load's test
    episodes are done; a stop leaves those loads there, marked ``"stopped"``."""

    prog = "evaluate.py --env serve"

    def __init__(self, cfg: ServingBenchConfig) -> None:
        self.cfg = cfg
        self.out, self.plot = outputs(cfg)
        self.written: list[tuple[str, str]] = []  # the loads whose rows are at --out so far, and that JSON

    @classmethod
    def from_argv(cls, argv: list[str] | None, defaults: ServingBenchConfig | None = None) -> ServingEvaluation:
        """``python evaluate.py --env serve`` (``defaults``: ``QUICK``; with ``--full`` None: ``ServingBenchConfig``'s
        defaults), its options checked before anything loads."""
        return cls(parse(argv, trained_world(argv, defaults), check))

    def run(self) -> dict:
        for path in (self.out, self.plot):  # --force: nothing of an earlier evaluation stays beside this one's
            path.unlink(missing_ok=True)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        return speed(self.cfg) if self.cfg.speed else run(self.cfg, self.done)

    def done(self, report: dict, section: str, load: str) -> None:
        try:
            text = report_json(report | {"complete": False}, indent=1)
        except ValueError:  # not a finite number: said at the end, when the whole report is checked
            return
        write_text_atomic(self.out, text)
        self.written.append((load, text))
        charged = {k: report[k] for k in ("cost_profile", "rules_chosen_under") if k in report}  # named as at the end
        print(markdown({"levels": {}, "moving": {}} | charged | {section: {load: report[section][load]}}), flush=True)
        print(f"(written to {self.out}: the loads done so far)", flush=True)

    def write(self, report: dict) -> None:
        speed_only = self.cfg.speed
        try:
            text = report_json(report | ({} if speed_only else {"complete": True}), indent=1)
        except ValueError as err:
            raise SystemExit(f"error: {err}") from None
        write_text_atomic(self.out, text)
        print(markdown(report if speed_only else report | {"levels": {}, "moving": {}}))  # the loads' were printed
        if not speed_only:
            print(f"goodput against load: {plot_goodput(report, self.plot)}")

    def stopped(self, name: str) -> Stopped:
        """The loads done stay at ``--out``, marked ``"stopped"`` beside ``"complete": false``."""
        out, written = self.out, self.written
        if not written:
            return Stopped(f"stopped by {name} before any load was done: nothing written to {out}; run the same "
                           "command again")
        write_text_atomic(out, json.dumps(json.loads(written[-1][1]) | {"stopped": name}, indent=1) + "\n")
        loads = ", ".join(load for load, _ in written)
        return Stopped(f"stopped by {name}: {out} holds the {len(written)} load(s) done so far ({loads}), with "
                       '"complete": false; to evaluate every load, run the same command again with --force')
