"""The serving environment's clock against a real batched decoder: the same schedule, modelled and timed.

    python -m scripts.analysis.serving_clock --pair smollm2 --levels 0.05 0.3 1.0 --threads 1
    python -m scripts.analysis.serving_clock --pair tiny-random --levels 0.3 1.0 --episode-steps 8   # seconds, a smoke run

For each load level, ``BiLD-Serve-v0`` (replay backend, constant load) runs one episode of the policy
(``--action``: one action of the env's grid, ``--table``: a per-load table) and one of speculation off
(target-only serving) from the same seed, so both meet the same requests at the same arrivals. Each
episode is recorded as a ``Schedule`` (``record_schedule``): the requests under way at reset (their
prompt and the tokens they had), then per step the requests that joined, its action, every
request's forwards (``ReplayRunner.trace``) and what the env charged. ``ScheduleReplay`` runs a
schedule through ``bild_env.decoding.batched.BatchedDecoder`` with real models: the same joins at the
same steps, the same actions, requests leaving when done; each step's wall time (join + step) is
measured, and its forwards are logged (``BatchedDecoder.forward_log``).

Each schedule runs twice (the second run is the noise floor), all four runs of a level interleaved
step by step (a drift of the machine hits them alike). Reported per level and per run, measured
against modelled ms (``bild_env.serving.clock.charge``) under four models:

* ``env``: what the env charges today (``info["step_ms"]``);
* ``shrinking``: the env's schedule (``clock.charge``'s default layout; the joining requests' target
  prefills included, as the env charges them since it stopped dropping them);
* ``padded``: ``layout="padded"``, idle rows riding along in every forward, as the padded decoder runs;
* ``padded+loop``: and the decoder's own work (``clock.BatchLoop``), fitted on the other levels' steps
  (leave one level out; in-sample, and said so, with one level).

The machine's drift is taken out by the ratio of ratios: (measured / modelled) of the policy over the
same for target-only serving at the same level in the same run. Goodput (committed tokens per second)
is given measured and modelled. Also: the forward tables on the decoder's own logged forwards against
the time of those forwards (in the JSON per kind: role, prefill or step, rows), each step's model
error spread, and how many requests' tokens equal the env's (exact per request in float32; bfloat16
may flip near-ties, and the schedule then drifts).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from bild_env.actions import Action
from bild_env.cli import parse_dataclass, setup_logging
from bild_env.decoding.batched import BatchedDecoder
from bild_env.models.device import machine_description
from bild_env.models.pairs import DEFAULT_PAIR
from bild_env.serving import clock
from bild_env.serving.env import DEFAULT_MIX, Join, ServingEnv, resume_join

MODELS = ("env", "shrinking", "padded", "padded+loop")


@dataclass
class ServingClockConfig:
    """Options of ``python -m scripts.analysis.serving_clock`` (the CLI is generated from it)."""

    pair: str = field(default=DEFAULT_PAIR, metadata={"help": "model pair preset"})
    mix: str = field(default=DEFAULT_MIX, metadata={"help": "the workload"})
    split: str = field(default="test", metadata={"help": "prompts of this split"})
    levels: tuple[float, ...] = field(default=(0.05, 0.3, 1.0), metadata={"help": (
        "constant load levels (utilisation), one episode each")})
    action: int | None = field(default=None, metadata={"help": (
        "the policy: one action of the env's grid (default: the fixed BiLD pair 0.103/4.697)")})
    table: str = field(default="", metadata={"help": (
        'or a per-load table "U:A,U:A,..." (agents.serve.rules.LoadTable)')})
    batch_table: str = field(default="", metadata={"help": (
        'or a per-batch-size table "B:A,B:A,..." (buckets 1, 2, 3, 5, 9, 17; off where absent: '
        "agents.serve.rules.BatchTable)")})
    score: str = field(default="token", metadata={"help": (
        'what each request\'s fallback threshold reads ("token" or "cumulative")')})
    episode_steps: int = 32
    max_batch: int = 32
    max_new_tokens: int = 32
    seed: int = field(default=0, metadata={"help": (
        "the episodes' seed (the same requests and arrivals for the policy and target-only)")})
    threads: int = field(default=1, metadata={"help": "torch CPU threads"})
    out: str = "results/bench_serving_clock.json"


# ---------------------------------------------------------------------------------------------- schedules


@dataclass
class ScheduledStep:
    """One env step: who joined before it, its action (``bild_env.actions.Action``), every request's
    forwards (``traces``, in batch order, a joining request's target prefill first), what the env charged
    (``env_ms``) and the tokens it committed."""

    joins: list[Join]
    action: Action
    batch: list[int]
    traces: list[list[tuple[str, int, int]]]
    env_ms: float
    tokens: int


@dataclass
class Schedule:
    """An episode of ``BiLD-Serve-v0`` as a batched decoder replays it: the requests under way at reset
    (``warm``, joined untimed: their prompt extended by the tokens they had, as the env does not charge
    them), the steps, and each request's tokens in the env (``tokens[rid]``, from ``offset[rid]`` on: what
    the decoder generates)."""

    level: float
    policy: str
    warm: list[Join] = field(default_factory=list)
    steps: list[ScheduledStep] = field(default_factory=list)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    offset: dict[int, int] = field(default_factory=dict)


def record_schedule(env: ServingEnv, policy, seed: int, name: str = "") -> Schedule:
    """One episode of ``policy`` (``predict(obs) -> (action, state)``) from ``env.reset(seed=seed)``, recorded."""
    env = env.unwrapped
    obs, _ = env.reset(seed=seed)
    rid: dict[int, int] = {}  # id(Request) -> request id
    requests = []
    schedule = Schedule(env.load.utilisation(0.0), name)

    def ident(request) -> int:
        if id(request) not in rid:
            rid[id(request)] = len(requests)
            requests.append(request)
        return rid[id(request)]

    for r in env.active:  # under way: generated new_ids so far
        i = ident(r)
        join, schedule.offset[i] = resume_join(r, i, env.config.max_new_tokens)
        schedule.warm.append(join)
    admitted: list = []
    env.server.on_admit = admitted.append  # the env's admissions, seen as they happen
    try:
        for _ in range(env.config.episode_steps):
            action, _ = policy.predict(obs, deterministic=True)
            action = int(np.asarray(action).reshape(-1)[0])
            before = list(env.active)
            admitted.clear()
            obs, _, terminated, truncated, info = env.step(action)
            batch = before + list(admitted)
            joins = [Join(ident(r), list(r.prompt), env.config.max_new_tokens, r.domain) for r in admitted]
            traces = [list(r.runner.trace) for r in batch]  # a joining request's target prefill first
            schedule.steps.append(ScheduledStep(joins, env.decode(action), [ident(r) for r in batch], traces,
                                                info["step_ms"], info["committed"]))
            if terminated or truncated:
                break
    finally:
        env.server.on_admit = None
    for r in requests:
        schedule.tokens[rid[id(r)]] = list(r.session.new_ids)
        schedule.offset.setdefault(rid[id(r)], 0)
    return schedule


@dataclass
class StepTime:
    """One replayed step: wall ms (join + step), ms inside the model calls, the forwards it ran
    (``bild_env.decoding.batched.Forward``), the tokens it committed and the rows it held."""

    wall_ms: float
    forward_ms: float
    forwards: list
    tokens: int
    rows: int


class ScheduleReplay:
    """Runs a ``Schedule`` through ``BatchedDecoder``: ``step()`` replays the next env step; ``done`` after the last."""

    def __init__(self, pair, schedule: Schedule, max_draft_len: int, score: str = "token") -> None:
        self.schedule, self.i = schedule, 0
        self.decoder = BatchedDecoder(pair, max_draft_len, score)
        if schedule.warm:
            self._join(schedule.warm)
        self.decoder.forward_log = []

    @property
    def done(self) -> bool:
        return self.i >= len(self.schedule.steps)

    def _join(self, joins: list[Join]) -> None:
        self.decoder.join([j.prompt for j in joins], [j.max_new_tokens for j in joins], [j.rid for j in joins])

    def step(self) -> StepTime:
        s, d = self.schedule.steps[self.i], self.decoder
        self.i += 1
        d.forward_log.clear()
        t0 = time.perf_counter()
        if s.joins:
            self._join(s.joins)
        stats = {}
        if len(d):
            stats = s.action.batch_step(d)
        wall = (time.perf_counter() - t0) * 1000.0
        log = list(d.forward_log)
        return StepTime(wall, sum(f.ms for f in log), log, sum(x.new_tokens for x in stats.values()),
                        max(len(stats), 1))

    def outputs(self) -> dict[int, list[int]]:
        """Each request's tokens generated by the decoder so far (finished or running)."""
        d = self.decoder
        out = {rid: list(g.new_ids) for rid, g in d.finished.items()}
        for row, rid in enumerate(d.ids):
            out[rid] = d.tokens[row, int(d.prompt_lens[row]) : int(d.lens[row])].tolist()
        return out

    def same_tokens(self) -> tuple[int, int]:
        """(requests whose decoder tokens equal the env's, requests)."""
        out, sched = self.outputs(), self.schedule
        same = sum(out.get(rid, []) == toks[sched.offset[rid]:] for rid, toks in sched.tokens.items())
        return same, len(sched.tokens)


def run_interleaved(replays: list[ScheduleReplay]) -> list[list[StepTime]]:
    """Step every replay in turn, one step each per round, until all are done; their step times."""
    times: list[list[StepTime]] = [[] for _ in replays]
    while not all(r.done for r in replays):
        for r, t in zip(replays, times):
            if not r.done:
                t.append(r.step())
    return times


# ---------------------------------------------------------------------------------------------- modelled


def modelled(costs, schedule: Schedule, loop: clock.BatchLoop | None) -> dict[str, list[float]]:
    """Per step, ms under each of ``MODELS`` (module docstring)."""
    out = {m: [] for m in MODELS}
    for s in schedule.steps:
        out["env"].append(s.env_ms if s.traces else 0.0)
        out["shrinking"].append(clock.charge(costs, s.traces)[0] if s.traces else 0.0)
        out["padded"].append(clock.charge(costs, s.traces, "padded")[0] if s.traces else 0.0)
        out["padded+loop"].append(clock.charge(costs, s.traces, "padded", loop or clock.BatchLoop())[0]
                                  if s.traces else 0.0)
    return out


def tables_on_forwards(costs, steps: list[StepTime]) -> tuple[float, float]:
    """(modelled, measured) ms of the forwards the decoder really ran: the batched tables on its own log."""
    model = sum(costs.batch_ms(f.role, f.rows, f.fed, float(f.columns)) for s in steps for f in s.forwards)
    return model, sum(s.forward_ms for s in steps)


def forwards_by_kind(costs, steps: list[StepTime]) -> dict[str, dict]:
    """The logged forwards per kind (role; prefill or not; rows), measured and by the tables: where they differ."""
    out: dict[str, dict] = {}
    for f in (f for s in steps for f in s.forwards):
        key = f"{f.role} {'prefill' if f.prefill else 'step'} rows={f.rows}"
        row = out.setdefault(key, {"count": 0, "measured_ms": 0.0, "tables_ms": 0.0, "mean_fed": 0.0,
                                   "mean_columns": 0.0})
        row["count"] += 1
        row["measured_ms"] += f.ms
        row["tables_ms"] += costs.batch_ms(f.role, f.rows, f.fed, float(f.columns))
        row["mean_fed"] += (f.fed - row["mean_fed"]) / row["count"]
        row["mean_columns"] += (f.columns - row["mean_columns"]) / row["count"]
    return dict(sorted(out.items()))


def loop_rows(schedule: Schedule, steps: list[StepTime]) -> tuple[list[tuple[int, int, int]], list[float]]:
    """Per replayed step with requests: its ``clock.loop_counts`` and the measured ms outside the model calls."""
    x, y = [], []
    for s, t in zip(schedule.steps, steps):
        if s.traces:
            x.append(clock.loop_counts(s.traces, "padded"))
            y.append(max(0.0, t.wall_ms - t.forward_ms))
    return x, y


# ---------------------------------------------------------------------------------------------- the bench


def _policy(cfg: ServingClockConfig, env: ServingEnv):
    from agents.serve.rules import Fixed, LoadTable, fixed_bild_action

    if cfg.table:
        pairs = [p.split(":") for p in cfg.table.split(",") if p.strip()]
        return LoadTable(env, {float(u): int(a) for u, a in pairs}), f"table {cfg.table}"
    if cfg.batch_table:
        from agents.serve.rules import BatchTable

        pairs = [p.split(":") for p in cfg.batch_table.split(",") if p.strip()]
        return (BatchTable({int(b): int(a) for b, a in pairs}, env.n_grid, env.config.max_batch, env.config.observe.batch_scale),
                f"per-batch-size table {cfg.batch_table}")
    if cfg.action is not None:
        return Fixed(cfg.action), f"action {cfg.action}"
    a = fixed_bild_action(env)
    return Fixed(a), f"action {a} (fixed BiLD)"


def check_config(cfg: ServingClockConfig) -> None:
    if not cfg.levels or any(not 0.0 < u <= 4.0 for u in cfg.levels):
        raise ValueError(f"--levels must be utilisations in (0, 4], got {cfg.levels}")
    if sum((cfg.action is not None, bool(cfg.table), bool(cfg.batch_table))) > 1:
        raise ValueError("give one of --action or --table or --batch-table, not several")
    from bild_env.decoding.bild import check_score

    if check_score(cfg.score) == "oracle":
        raise ValueError("--score: the oracle needs the replay trees; the decoder takes 'token' or 'cumulative'")


def run(cfg: ServingClockConfig) -> dict:
    """Every level's schedules recorded and replayed (module docstring); the report as a dict."""
    check_config(cfg)
    levels = {}
    env = None
    for level in cfg.levels:
        env = ServingEnv(pair=cfg.pair, mix=cfg.mix, split=cfg.split, load=f"constant:{level:g}",
                         episode_steps=cfg.episode_steps, max_batch=cfg.max_batch, max_new_tokens=cfg.max_new_tokens,
                         actions={"score": cfg.score}, cost_model=None if env is None else env.cost_model)
        policy, name = _policy(cfg, env)
        from agents.serve.rules import Fixed

        schedules = {"policy": record_schedule(env, policy, cfg.seed, name),
                     "target only": record_schedule(env, Fixed(env.n_grid), cfg.seed, "off")}
        env.close()
        runs = [("policy", 1), ("target only", 1), ("policy", 2), ("target only", 2)]
        acts = env.config.actions
        replays = [ScheduleReplay(env.pair, schedules[k], acts.max_draft_len, acts.score) for k, _ in runs]
        times = run_interleaved(replays)
        levels[level] = {"schedules": schedules, "runs": list(zip(runs, replays, times))}
        print(f"level {level:g}: replayed {sum(len(t) for t in times)} steps")
    return report(cfg, env.cost_model, levels, machine_description(env.pair.device))


def _fit_excluding(levels: dict, skip) -> tuple[clock.BatchLoop, str]:
    x, y = [], []
    for level, lv in levels.items():
        if level == skip and len(levels) > 1:
            continue
        for (kind, _), replay, steps in lv["runs"]:
            a, b = loop_rows(replay.schedule, steps)
            x += a
            y += b
    return clock.fit_loop(x, y), ("other levels" if len(levels) > 1 else "in sample (one level)")


def report(cfg: ServingClockConfig, costs, levels: dict, machine: str) -> dict:
    rows = []
    for level, lv in levels.items():
        loop, fitted_on = _fit_excluding(levels, level)
        runs = {}
        for (kind, rep), replay, steps in lv["runs"]:
            sched = replay.schedule
            model = modelled(costs, sched, loop)
            measured = [t.wall_ms for t in steps]
            tokens = sum(t.tokens for t in steps)
            same, n = replay.same_tokens()
            tables, forwards = tables_on_forwards(costs, steps)
            runs[f"{kind} #{rep}"] = {
                "measured_ms": sum(measured), "modelled_ms": {m: sum(v) for m, v in model.items()},
                "tokens": tokens, "env_tokens": sum(s.tokens for s in sched.steps),
                "same_tokens": f"{same}/{n}",
                "forward_ms": forwards, "tables_on_logged_forwards_ms": tables,
                "forwards_by_kind": forwards_by_kind(costs, steps),
                "mean_rows": statistics.mean(t.rows for t in steps) if steps else 0.0,
                "per_step": [{"measured_ms": t.wall_ms, "forward_ms": t.forward_ms, "rows": t.rows,
                              **{m: v[i] for m, v in model.items()}} for i, t in enumerate(steps)],
            }
        rows.append(_level_row(level, runs, loop, fitted_on))
        _print_level(rows[-1])
    return {"config": asdict(cfg), "machine": machine, "models": list(MODELS), "levels": rows}


def _level_row(level: float, runs: dict, loop: clock.BatchLoop, fitted_on: str) -> dict:
    def total(kind: str, what: str, model: str | None = None) -> float:
        rs = [r for name, r in runs.items() if name.startswith(kind)]
        return sum(r["measured_ms"] if model is None else r["modelled_ms"][model] for r in rs) if what == "ms" else \
            sum(r["tokens"] for r in rs)

    row = {"level": level, "loop": loop.to_dict(), "loop_fitted_on": fitted_on, "runs": runs, "models": {}}
    meas_p, meas_t = total("policy", "ms"), total("target only", "ms")
    tok_p = total("policy", "tok")
    for m in MODELS:
        mod_p, mod_t = total("policy", "ms", m), total("target only", "ms", m)
        per_step = [s["measured_ms"] / s[m] for r in runs.values() for s in r["per_step"] if s[m] > 0]
        row["models"][m] = {
            "policy_measured_over_model": meas_p / mod_p, "target_only_measured_over_model": meas_t / mod_t,
            "drift_out_error": (meas_p / mod_p) / (meas_t / mod_t) - 1.0,
            "goodput_measured_tok_s": 1000.0 * tok_p / meas_p, "goodput_modelled_tok_s": 1000.0 * tok_p / mod_p,
            "per_step_ratio_p10_p50_p90": list(np.percentile(per_step, [10, 50, 90])) if per_step else [],
        }
    p1, p2 = runs["policy #1"]["measured_ms"], runs["policy #2"]["measured_ms"]
    t1, t2 = runs["target only #1"]["measured_ms"], runs["target only #2"]["measured_ms"]
    row["noise_floor"] = {"policy_again": p2 / p1 - 1.0, "target_only_again": t2 / t1 - 1.0,
                          "ratio_of_ratios_again": (p2 / t2) / (p1 / t1) - 1.0}
    return row


def _print_level(row: dict) -> None:
    nf = row["noise_floor"]
    print(f"\nload {row['level']:g}  (noise floor: the same schedules again {nf['policy_again']:+.1%} policy, "
          f"{nf['target_only_again']:+.1%} target only, ratio of ratios {nf['ratio_of_ratios_again']:+.1%}; loop "
          f"fitted on {row['loop_fitted_on']}: {', '.join(f'{k} {v:.3f}' for k, v in row['loop'].items())})")
    print(f"  {'model':12s} {'policy meas/model':>18s} {'target-only':>12s} {'drift out':>10s} "
          f"{'goodput meas':>13s} {'modelled':>9s}  per-step meas/model p10/p50/p90")
    for m, r in row["models"].items():
        q = "/".join(f"{v:.2f}" for v in r["per_step_ratio_p10_p50_p90"])
        print(f"  {m:12s} {r['policy_measured_over_model']:18.3f} {r['target_only_measured_over_model']:12.3f} "
              f"{r['drift_out_error']:+10.1%} {r['goodput_measured_tok_s']:13.1f} "
              f"{r['goodput_modelled_tok_s']:9.1f}  {q}")
    for name, r in row["runs"].items():
        print(f"  {name:15s} {r['measured_ms']:9.0f} ms measured, forwards {r['forward_ms']:8.0f} ms (tables on the "
              f"logged forwards {r['tables_on_logged_forwards_ms']:8.0f}), {r['tokens']} tokens "
              f"(env {r['env_tokens']}), "
              f"{r['mean_rows']:.1f} rows, tokens equal the env's for {r['same_tokens']} requests")


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_dataclass(ServingClockConfig, argv, __doc__)
    setup_logging()
    torch.set_num_threads(cfg.threads)
    out = run(cfg)
    path = Path(cfg.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=float))
    print(f"\n{machine_description()}\nwrote {path}")
    return out


if __name__ == "__main__":
    from bild_env.command import run_command

    sys.exit(run_command("python -m scripts.analysis.serving_clock", main))
