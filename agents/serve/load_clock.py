"""BiLD-Serve-v0's methods under load on the wall clock: real models, one batched decoder each, the same requests.

    python evaluate.py --env serve --clock --load 0.05 0.3 1.0 --pair smollm2 --model pretrained
    python evaluate.py --env serve --clock --load 0.3 1.0 --pair tiny-random --requests 8 --max-batch 4 --table 0.3:25,1:25
    python evaluate.py --env serve --clock --help                      # every option, with its default

``BiLD-Serve-v0`` charges its steps to a cost model; this runs the methods it compares on the real
models and the wall clock (``bild_env.decoding.batched.BatchedDecoder``, continuous batching, every
request exact), per load level of ``--load``:

* **target only**: the target alone, batched (``step(off=True)``): the baseline every ratio is to;
* **naive SD**: naive speculative decoding, ``--spec-k`` drafts a round (``step_speculative``, lossless);
* **BiLD fixed**: BiLD with the paper's thresholds, as the env's nearest grid action
  (``agents.serve.rules.fixed_bild_action``: (0.103, 4.697) on the default grid, the action
  ``scripts.analysis.serving_clock`` replays);
* **per-load table**: the best fixed action per load level, chosen on validation episodes of the env
  (``--select-episodes`` per level, the actions of ``--fixed-actions``) exactly as ``agents.serve.evaluation``
  chooses its per-load table, or given with ``--table U:A,U:A`` (the nearest level's action);
* **per-batch-size table**: an action per batch-size bucket (1, 2, 3-4, ...; off elsewhere), chosen as
  ``agents.serve.evaluation`` chooses it (exact counterfactuals on the same validation episodes), or given
  with ``--batch-table K:A,K:A``; it reads the batch size from the observation, so it acts on the decoder's;
* each **agent** of ``--model`` (a run folder or model file trained on BiLD-Serve-v0), on its own grid,
  acting on the observation the env would compute (below); with several DQNs on one grid, also their
  **Q-ensemble** (``agents.dqn.QEnsemble``: the action of the highest mean Q-value).

**Arrivals and the clock (online).** Per level, one arrival trace serves every method: the requests the
env's ``reset(seed)`` starts with (its warm batch: as many as target-only serving holds at that load,
each some tokens into its answer; they join the decoder with those tokens as part of their prompt, as
``scripts.analysis.serving_clock`` replays them, untimed), then ``--requests`` more arriving at times of a seeded
Poisson process at rate ``u x capacity``, with prompts drawn from the env's workload (test split). The
capacity is the env's target-only capacity for this machine (``ServingEnv.capacity_rps``: a full batch
of target-only decoding, from the batched forward tables timed here): modelled, not measured in the run, so
on a machine busier than when the tables were timed a level is a larger share of what target-only really
serves (compare target-only's measured ms per step with the tables'). Each method then serves the trace
on **its own clock**: a step is (1) the method's action, chosen on the observation so far, (2) the
requests that have arrived by the clock join while the batch has room (the target prefills them), (3)
one batched decoder step; the clock advances by the step's measured wall time (action, joins and step
together). When nothing is running or queued the clock jumps to the next arrival (idle time is not
spent waiting: nothing would run). So each method's own speed decides when requests are admitted and
how long they queue; a request's latency is its finish time minus its arrival on that method's clock.
Every method runs ``--repeats`` times (default 2), all runs of a level interleaved step by step (one
step of each in turn, each round starting one run further on), so a drift of the machine hits them alike and the repeats show the noise. A run
ends when every request of the trace has finished.

**The observation** of an agent is ``bild_env.serving.observations.ServingView`` updated after every
step with what the decoder did (batch, queue, proposed and accepted drafts, committed tokens, regret,
prompt lengths, progress, arrivals over the step) and the action's thresholds. Two entries are
approximate: the step-time ratio (index 6) is the batched tables' time of the forwards the decoder logged
over the tables' target-only time for the same tokens (the env's ratio, on the decoder's forwards; the
measured time would mix in the tables' error), and the draft's confidence where its runs stopped (index
13) is read from the requests still running after the step (a request that finished in it is missed).
An agent trained with ``observe_next`` (the next proposals' draft confidence, which the env reads ahead from
the replay trees at no charge) reads them here from one batched draft forward before its action
(``BatchedDecoder.peek_draft``): the forward the step would run first, run earlier, its logits kept for the step.
The clock charges it where it runs; a step the agent then turns off has paid for it without use.

**Reported** per level and method, per run: goodput (tokens committed per second of busy clock, idle
excluded, as the env counts it; every method serves the same requests, so a lossless method commits the
same tokens and goodput is the inverse of busy time), its ratio to target-only's run of the same repeat,
mean and 90th-percentile latency of the requests that arrived during the run (the warm batch is left out),
mean queueing time, mean batch, the actions taken, and exactness: how many requests' tokens equal (a)
the env's, a batch-of-one BiLD session on the replay trees under the same per-step thresholds (what the
env computes; not for naive SD, which the env does not run) and (b) the target's greedy tokens (every
lossless method: target only, naive SD, BiLD at rollback < ln 2). In float32 both hold for every request;
in bfloat16 a batched forward may flip a near-tie between the target's two best tokens, and the request
goes on from there. Writes ``--out`` (JSON), beside it ``.md`` and ``.png`` (goodput ratio to target-only
against load, one line per method, the repeats' range as bars).

**What this does not capture**: the warm batch starts decoded by the target alone (as the env's); a
server's own overheads beyond the decoder loop (tokenising, networking, its scheduler); requests
longer than ``--max-new-tokens``; real-time concurrency between arrivals and a running step (an
arrival during a step waits for its end, as in the env).
"""

from __future__ import annotations


import argparse
import json
import math
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from agents.evaluation import Evaluation
from agents.serve.bench_config import MAIN_JOB_EPISODES, ServingBenchConfig, make_env, options_parser, parse_options
from agents.serve.evaluation_agents import check_model as check_served_model, load_agents, serve_run_env, trained_world
from agents.serve.evaluation_report import save_goodput_plot
from agents.serve.online import Arrival, Method, arrival_trace, run_level
from agents.serve.rules import bucket_label, fixed_bild_action
from agents.serve.selection import (action_set, batch_table_from, best_per_level, fixed_by_level, label,
                                   off_and_on)
from bild_env.config import over
from bild_env.paths import prompt_key
from bild_env.serving.env import ServingConfig, ServingEnv
from bild_env.serving.load import MAX_UTILISATION

TARGET_ONLY, TABLE, BATCH_TABLE = "target only", "per-load table", "per-batch-size table"


@dataclass
class LoadClockConfig:
    """Options of ``python evaluate.py --env serve --clock`` (the CLI is generated from it and from the env's
    ``ServingConfig``): the env whose validation episodes choose the tables and whose test prompts, arrivals and
    capacity the clock serves (``env``, ``MAIN_JOB_EPISODES`` by default: validation episodes of the main job's
    length and prompts choose the tables), and the run's own."""

    env: ServingConfig = field(default_factory=lambda: replace(MAIN_JOB_EPISODES), metadata={"cli": False, "help": (
        "the env (BiLD-Serve-v0's arguments; its split and load set per run): the validation episodes choosing the "
        "tables (of episode_steps steps), the test prompts and the cost tables the capacity is read from")})

    load: tuple[float, ...] = field(default=(0.05, 0.3, 1.0), metadata={"help": (
        "load levels (utilisation: a share of target-only capacity)")})
    requests: int = field(default=32, metadata={"help": (
        "requests arriving per level after the warm batch (the env's reset)")})
    repeats: int = field(default=2, metadata={"help": (
        "runs of every method per level, interleaved step by step (the noise)")})
    seed: int = field(default=0, metadata={"help": (
        "the arrival trace's seed (the warm batch: env.reset(seed); then the arrivals)")})
    spec_k: int = field(default=4, metadata={"help": "naive speculative decoding's drafts per round"})
    table: str = field(default="", metadata={"help": (
        'the per-load table "U:A,U:A,..." (actions of the env\'s grid); default: chosen on validation')})
    batch_table: str = field(default="", metadata={"help": (
        'the per-batch-size table "K:A,..." (bucket K: 0 = batch 1, 1 = 2, 2 = 3-4, ...; off elsewhere); default: '
        "chosen on validation")})
    select_episodes: int = field(default=4, metadata={"help": (
        "validation episodes per level choosing the per-load table")})
    fixed_actions: tuple[int, ...] = field(default=(), metadata={"help": (
        "the fixed actions the table chooses among, indices of the env's grid (default: all; off always among them)")})
    model: tuple[str, ...] = field(default=(), metadata={"help": (
        'SB3 model files or run folders trained on BiLD-Serve-v0 ("pretrained": the agent shipped in '
        "bild_env/assets/serve-agent)")})
    threads: int = field(default=1, metadata={"help": "torch CPU threads"})
    out: str = "results/serving_load_clock.json"
    force: bool = field(default=False, metadata={"help": (
        "replace the results of an earlier run at --out (the JSON, its .md and .png)")})


# ---------------------------------------------------------------------------------------------- the options


def parse_table(spec: str, option: str = "--table", key=float) -> dict:
    """``"0.05:15,0.3:25"`` -> {0.05: 15, 0.3: 25} (``key`` converts the left side: ``int`` for ``--batch-table``'s
    buckets); a ValueError naming ``option`` otherwise."""
    out = {}
    example = "--table 0.05:15,0.3:25" if key is float else f"{option} 0:10,1:25"
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        try:
            u, a = part.split(":")
            k = key(u)
            out[k] = int(a)
        except ValueError:
            raise ValueError(f"{option}: {part!r} is not {'LEVEL' if key is float else 'BUCKET'}:ACTION "
                             f"(e.g. {example})") from None
        if key is int and k < 0:
            raise ValueError(f"{option}: bucket {k} is below 0 (0 = batch 1, 1 = batch 2, 2 = 3-4, ...)")
    if not out:
        raise ValueError(f"{option}: no pair in {spec!r} (e.g. {example})")
    return out


def check_config(cfg: LoadClockConfig) -> None:
    """Refuse bad options before any model loads, naming the option."""
    if not cfg.load:
        raise ValueError("--load: give at least one load level, e.g. --load 0.05 0.3 1.0")
    bad = [u for u in cfg.load if not (math.isfinite(u) and 0.0 < u <= MAX_UTILISATION)]
    if bad:
        raise ValueError(f"--load: level {bad[0]!r} is outside (0, {MAX_UTILISATION:g}] (a utilisation: a share of "
                         "what target-only decoding of a full batch serves)")
    for name in ("requests", "repeats", "spec_k", "select_episodes", "threads"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    from bild_env.decoding.costs import BATCH_SIZES
    from bild_env.serving.env import validate

    env = cfg.env
    cap = env.actions.max_draft_len
    if isinstance(cap, bool) or not isinstance(cap, int):
        raise ValueError(f"--actions max_draft_len={cap}: the clock's batched decoder drafts up to a fixed number of "
                         "tokens a run; give an integer (>= 1)")
    validate(replace(env, split="validation", load=f"constant:{cfg.load[0]}"))  # counts, score, mix, charge...
    if env.max_batch > max(BATCH_SIZES):
        raise ValueError(f"--max-batch {env.max_batch} is above the largest batch the cost model times "
                         f"({max(BATCH_SIZES)}): give --max-batch <= {max(BATCH_SIZES)}")
    if env.actions.score.startswith("oracle"):
        raise ValueError("--actions score: the oracle reads the target's choice from the replay trees; the clock "
                         "decodes live: give token or cumulative")
    n = env.actions.n_grid + 1
    for option, spec, key in (("--table", cfg.table, float), ("--batch-table", cfg.batch_table, int)):
        if spec:
            wrong = [a for a in parse_table(spec, option, key).values() if not 0 <= a < n]
            if wrong:
                raise ValueError(f"{option}: action {wrong[0]} is not in the env's grid [0, {n})")
    if [a for a in cfg.fixed_actions if not 0 <= a < n]:
        raise ValueError(f"--fixed-actions: {[a for a in cfg.fixed_actions if not 0 <= a < n]} not in [0, {n})")
    for path in cfg.model:
        check_model(cfg, path)
    from agents.common.checks import check_outputs

    check_outputs(outputs(cfg), cfg.force)


def outputs(cfg: LoadClockConfig) -> list[Path]:
    """What a run writes: ``--out`` (the JSON), and beside it the markdown tables and the plot."""
    out = Path(cfg.out)
    return [out, out.with_suffix(".md"), out.with_suffix(".png")]


def check_model(cfg: LoadClockConfig, given: str) -> None:
    """A ``--model`` as the cost model's evaluation checks it (``evaluation_agents.check_model``: a readable SB3 model
    of a BiLD-Serve-v0 run whose observation and actions mean here what they meant in training, no model of the pair
    loaded), after the clock's own refusals, from its run config alone: what the online loop does not run (tree rules,
    an action or observation per domain, the hardware's costs observed)."""
    from agents.common.trained import choose_model

    env = serve_run_env(choose_model(given)[0])  # its run's (a ConfigError for a run of another env)
    if env is not None and env.actions.tree_rules:  # the batched decoder steps chains (Action.batch_step)
        raise ValueError(f"--model {given} was trained with tree rules {list(env.actions.tree_rules)}; the wall "
                         "clock's batched decoder runs chains only (no token-tree step): evaluate it "
                         f"with the cost model instead, python evaluate.py --env serve --model {given}")
    if env is not None and (env.actions.per_domain or env.observe.costs):
        what = "actions per domain (per_domain)" if env.actions.per_domain else "the hardware's costs observed (costs)"
        raise ValueError(f"--model {given} was trained with {what}; the clock's online loop observes neither the "
                         "domains nor the hardware's costs: evaluate it with the cost model instead, python evaluate.py "
                         f"--env serve --model {given}")
    check_served_model(bench_config(cfg), given)


def bench_config(cfg: LoadClockConfig) -> ServingBenchConfig:
    """The serving benchmark's options these map to (its envs, its validation, its agents)."""
    return ServingBenchConfig(env=cfg.env, levels=tuple(cfg.load), select_episodes=cfg.select_episodes,
                              fixed_actions=tuple(cfg.fixed_actions), model=tuple(cfg.model), threads=cfg.threads)


def choose_tables(bench: ServingBenchConfig, max_draft_len: int, table: dict[float, int] | None = None,
                  batch_table: dict[int, int] | None = None) -> tuple[dict[float, int], dict[int, int]]:
    """The per-load table and the per-batch-size table as ``agents.serve.selection.choose`` chooses them (each
    unless given): per level the fixed action with the best mean return over the validation episodes (seeds
    1000+); per batch-size bucket, ranked by exact counterfactual step rewards at the states the per-load table
    visits, chosen on whole episodes (``batch_table_from``)."""
    if table is not None and batch_table is not None:
        return table, batch_table
    seeds = list(range(1000, 1000 + bench.select_episodes))
    envs, by_level = fixed_by_level(bench, seeds, actions={"max_draft_len": max_draft_len})
    table = best_per_level(by_level) if table is None else table
    if batch_table is None:
        env = envs[bench.levels[0]]
        grid = action_set(env, bench.fixed_actions)
        off, on, _ = off_and_on(env, grid, by_level)  # as ``choose``'s
        batch_table = batch_table_from(envs, table, seeds, grid, off, on)[0]
    for env in envs.values():
        env.close()
    return table, batch_table


# ---------------------------------------------------------------------------------------------- the methods


def methods_for(env: ServingEnv, level: float, table: dict[float, int], spec_k: int, agents: list,
                batch_table: dict[int, int] | None = None) -> list[Method]:
    """Target only, naive SD, BiLD fixed, the per-load table's action at ``level``, the per-batch-size table (when
    given), each agent, and with several DQNs on one grid their Q-ensemble (``agents.dqn.QEnsemble``)."""
    from agents.dqn import q_ensemble
    from agents.serve.rules import BatchTable, Fixed

    rules = replace(ServingConfig(), actions={"score": env.config.actions.score})  # the rules' grid, read as the env
    off = Method(TARGET_ONLY, Fixed(env.n_grid), rules)
    fixed = fixed_bild_action(env)
    nearest = min(table, key=lambda v: abs(v - level))
    out = [off, Method(f"naive SD (k={spec_k})", spec_k=spec_k, grid=rules),
           Method(f"BiLD fixed {label(env, fixed)}", Fixed(fixed), rules),
           Method(TABLE, Fixed(table[nearest]), rules)]  # the level's action: in the report's "table" and each run's actions
    if batch_table is not None:
        out.append(Method(BATCH_TABLE, BatchTable(batch_table, env.n_grid, env.config.max_batch,
                                                  env.config.observe.batch_scale), rules))
    out += [Method(name, model, over(ServingConfig(), grid)) for name, model, grid in agents]
    ensemble = q_ensemble(agents)
    if ensemble is not None:
        out.append(Method(f"agents' Q-ensemble of {len(agents)}", ensemble, over(ServingConfig(), agents[0][2])))
    return out


# ---------------------------------------------------------------------------------------------- the evaluation


def run(cfg: LoadClockConfig) -> dict:
    """Every level's trace served online by every method (module docstring); the report as a dict."""
    from bild_env.models.device import machine_description
    from bild_env.replay.runner import ReplayRunner

    check_config(cfg)
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    bench = bench_config(cfg)
    cap = cfg.env.actions.max_draft_len
    table, batch_table = choose_tables(bench, cap, parse_table(cfg.table) if cfg.table else None,
                                       parse_table(cfg.batch_table, "--batch-table", int) if cfg.batch_table else None)
    agents = load_agents(bench)
    chosen = f"chosen on validation ({cfg.select_episodes} episodes per level)"
    report = {"config": asdict(cfg), "table_source": "given (--table)" if cfg.table else chosen,
              "batch_table_source": "given (--batch-table)" if cfg.batch_table else chosen, "levels": {}}
    env = None
    for u in cfg.load:
        env = make_env(bench, "test", f"constant:{u}", actions={"max_draft_len": cap},
                       **({} if env is None else {"cost_model": env.cost_model}))
        trace = arrival_trace(env, u, cfg.requests, cfg.seed)
        methods = methods_for(env, u, table, cfg.spec_k, agents, batch_table)
        runs = run_level(env, methods, trace, cfg.repeats)
        runner = ReplayRunner(env.pair, env.cost_model, env.references, cfg.env.max_new_tokens)
        rows = [r.exactness(env.references, runner) | r.summary() for r in runs]
        report["levels"][f"{u:g}"] = level_report(u, env, trace, methods, rows)
        env.close()
        print(markdown_level(report["levels"][f"{u:g}"]))
    report["table"] = {f"{u:g}": label(env, a) for u, a in table.items()}
    report["batch_table"] = {bucket_label(k): label(env, a) for k, a in batch_table.items()}
    report["machine"] = machine_description(env.pair.device)
    report["seconds"] = time.perf_counter() - t0
    return report


def level_report(level: float, env: ServingEnv, trace: list[Arrival], methods: list[Method], rows: list[dict]) -> dict:
    """Per method: its runs, and goodput and its ratio to target-only's run of the same repeat."""
    base = {r["repeat"]: r["goodput_tok_s"] for r in rows if r["method"] == TARGET_ONLY}
    out = {}
    for m in methods:
        runs = [r for r in rows if r["method"] == m.name]
        for r in runs:
            r["ratio_to_target_only"] = r["goodput_tok_s"] / base[r["repeat"]] if base[r["repeat"]] else 0.0
        ratios = [r["ratio_to_target_only"] for r in runs]
        out[m.name] = {"goodput_tok_s": float(np.mean([r["goodput_tok_s"] for r in runs])),
                       "ratio_to_target_only": float(np.mean(ratios)), "ratio_range": [min(ratios), max(ratios)],
                       "mean_latency_ms": float(np.mean([r["mean_latency_ms"] for r in runs])), "runs": runs}
    return {"level": level, "capacity_rps": env.capacity_rps, "arrival_rate_rps": level * env.capacity_rps,
            "warm": sum(a.warm for a in trace), "arrivals": sum(not a.warm for a in trace), "methods": out,
            "trace": [{"rid": a.join.rid, "domain": a.join.domain, "prompt_index": a.prompt_index,
                       "prompt_key": prompt_key(a.prompt), "prompt_tokens": len(a.prompt), "offset": a.offset,
                       "arrived_ms": round(a.at_ms, 1)} for a in trace]}


def dump(report: dict) -> str:
    """The report as JSON, indented, each request's row (a dict starting with "rid") on one line."""
    text = json.dumps(report, indent=1, default=float, allow_nan=False)
    return re.sub(r'\{\n\s*("rid"[^{}]*?)\n\s*\}', lambda m: "{" + re.sub(r"\n\s*", " ", m.group(1)) + "}", text) + "\n"


def markdown_level(lv: dict) -> str:
    lines = [f"\n**load {lv['level']:g}** ({lv['arrival_rate_rps']:.2f} requests/s = {lv['level']:g} x target-only "
             f"capacity {lv['capacity_rps']:.1f}; {lv['warm']} warm + {lv['arrivals']} arriving requests)\n",
             "| method | goodput tok/s (runs) | vs target only (runs) | mean latency ms | p90 latency ms | mean queue ms "
             "| mean batch | equal env's | equal greedy | actions |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in lv["methods"].items():
        rs = m["runs"]

        def each(key: str, fmt: str, rs=rs) -> str:
            return " / ".join(format(r[key], fmt) for r in rs)
        acts = ", ".join(f"{k} {v}" for k, v in rs[0]["actions"].items())
        lines.append(f"| {name} | {m['goodput_tok_s']:.1f} ({each('goodput_tok_s', '.1f')}) | "
                     f"{m['ratio_to_target_only']:.3f}x ({each('ratio_to_target_only', '.3f')}) | "
                     f"{each('mean_latency_ms', '.0f')} | {each('p90_latency_ms', '.0f')} | {each('mean_queue_ms', '.0f')} "
                     f"| {each('mean_batch', '.1f')} | {' / '.join(str(r['equal_env'] or '-') for r in rs)} | "
                     f"{' / '.join(r['equal_greedy'] for r in rs)} | {acts} |")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    c = report["config"]
    head = (f"# BiLD-Serve-v0 methods under load on the clock ({c['env']['pair']}, mix {c['env']['mix']})\n\n"
            f"{report['machine']}; per-load table {report['table']} "
            f"({report['table_source']}); per-batch-size table {report.get('batch_table')} "
            f"({report.get('batch_table_source')}); {c['repeats']} runs per method, interleaved step by step; "
            f"{report['seconds']:.0f} s in all.")
    return head + "\n" + "\n".join(markdown_level(lv) for lv in report["levels"].values()) + "\n"


def plot(report: dict, path: Path) -> Path:
    """Goodput ratio to target-only against the load, one line per method, the runs' range as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(report["levels"].values())
    xs = [lv["level"] for lv in levels]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in levels[0]["methods"]:
        ms = [lv["methods"][name] for lv in levels]
        ys = [m["ratio_to_target_only"] for m in ms]
        err = np.array([[y - m["ratio_range"][0], m["ratio_range"][1] - y] for y, m in zip(ys, ms)]).T
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, ls="--" if name.startswith("agent") else "-",
                    label=name if len(name) < 60 else name[:57] + "...")
    ax.set_xscale("log")
    return save_goodput_plot(fig, ax, path, "goodput / target-only goodput (wall clock)",
                             f"BiLD-Serve-v0 methods on the clock ({report['config']['env']['pair']})")


def build_parser() -> argparse.ArgumentParser:
    """``python evaluate.py --env serve --clock``'s options (``bench_config.options_parser``), with their defaults."""
    return options_parser(LoadClockConfig(), __doc__, "evaluate.py --env serve --clock")


class ClockEvaluation(Evaluation):
    """The methods on the wall clock for ``agents.evaluation.evaluate`` (the module docstring): the report written
    whole at the end (``--out``, beside it ``.md`` and ``.png``)."""

    prog = "evaluate.py --env serve --clock"

    def __init__(self, cfg: LoadClockConfig) -> None:
        self.cfg = cfg

    @classmethod
    def from_argv(cls, argv: list[str] | None, **defaults) -> ClockEvaluation:
        return cls(parse_options(argv, trained_world(argv, LoadClockConfig()), __doc__, cls.prog,
                                 check_config))  # checked before any model loads

    def run(self) -> dict:
        return run(self.cfg)

    def write(self, report: dict) -> None:
        try:
            text = dump(report)  # standard JSON: a NaN is refused here, before anything is written
        except ValueError as err:
            raise SystemExit(f"error: nothing to report ({err}): no measurement is a finite number") from None
        out, md_path, png = outputs(self.cfg)
        for path in (out, md_path, png):  # --force: nothing of an earlier run stays beside this one's
            path.unlink(missing_ok=True)
        out.write_text(text)
        md = markdown(report)
        md_path.write_text(md)
        print(md)
        print(f"wrote {out}, {md_path}, {plot(report, png)}")
