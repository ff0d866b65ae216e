"""The ceiling and the hand-written rules of BiLD-Serve-v0, per load level and per domain.

    python evaluate.py --env serve --pair smollm2                           # rules and ceilings (= python -m bench.serving)
    python evaluate.py --env serve --pair smollm2 --model logs/<run1> logs/<run2>   # and agents beside them
    python -m bench.serving --pair tiny-random --speed                      # env steps per second, warm, per load
    python evaluate.py --env serve --load 0.05 0.3 1.0 --model logs/<run>  # on real models and the wall clock instead
                                                                            # (agents.serving_load_clock)

On the replay backend, with the cost model's batched tables, every policy meets the same requests in
the same order (common random numbers: episode seeds shared by every policy):

1. **validation** (``--select-episodes`` per load level of ``--levels``, constant load each): every
   fixed action (the grid and speculation off); from them the best single fixed action over all levels
   (grid search), the per-load table (the best fixed action per level), the batch size above which
   speculation goes off (vLLM's rule; chosen among 1, 2, 4, ... max_batch), and the acceptance threshold
   below which it goes off (chosen among a few);
2. **per domain** (``--domains``): the best fixed action per (load level, domain) with single-domain
   workloads, and what that table gains over the best single action per domain (headroom per domain);
   and the per-batch-size table per domain, from exact counterfactuals on the mixed workload (one
   domain's action varied at a time); on test both run per request (an env with ``per_domain``: each
   request takes its own domain's action);
3. **test** (``--episodes`` per level, test prompts, other seeds; on ``--test-mix`` where given, a workload the
   rules were not chosen on and the agents not trained on, e.g. with a domain neither saw): every rule, the per-episode oracle (the
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
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from agents.evaluation import mean_ci
from agents.serving_rules import (AcceptanceRule, BatchTable, DomainBatchTable, DomainTable, Fixed, LoadTable,
                                  OffAboveBatch, StepHindsight, bucket_label, choose_batch_table,
                                  choose_domain_batch_table, returns_of)
from bild_env.cli import parse_checked
from bild_env.models.pairs import DEFAULT_PAIR
from bild_env.prompts.code import check_code_source
from bild_env.serving.env import DEFAULT_MIX, ServingEnv
from bild_env.serving.workload import parse_mix

SPEED_REPEATS = 5  # timed warm episodes per level of --speed


@dataclass
class ServingBenchConfig:
    """Options of the serving benchmark (the CLI is generated from it)."""

    pair: str = DEFAULT_PAIR  # model pair preset
    mix: str = DEFAULT_MIX  # the workload
    test_mix: str = ""  # the test episodes' workload (default: mix): rules chosen on mix's validation, agents as trained, met with another
    code_source: str = "humaneval"  # the code domain's prompts: "humaneval" (shipped) or "stdlib" (this Python's library)
    test_code_source: str = ""  # the test episodes' code prompts (default: code_source), e.g. a code corpus nothing was chosen on
    levels: tuple[float, ...] = (0.05, 0.2, 0.4, 0.7, 1.0)  # load levels (utilisation) of the validation and test runs
    moving: tuple[str, ...] = ("burst:0.1,1.0", "daily:0.05,1.0")  # moving loads for the test runs
    domains: tuple[str, ...] = ()  # also the per-domain table on these single-domain workloads (e.g. prose code chat)
    select_episodes: int = 8  # validation episodes per load level (choosing the rules)
    episodes: int = 8  # test episodes per load level
    episode_steps: int = 128
    max_new_tokens: int = 32
    max_batch: int = 32
    max_prompts: int | None = None  # per domain and split
    actions: tuple[int, ...] = ()  # the fixed actions to run (default: all); the off switch is always among them
    model: tuple[str, ...] = ()  # SB3 model files or run folders trained on BiLD-Serve-v0
    dtype: str | None = None
    threads: int = 1  # torch CPU threads
    step_oracle: bool = False  # also the per-step hindsight oracle (agents.serving_rules.StepHindsight; |actions| peeks a step)
    speed: bool = False  # only measure env steps per second on warm trees (each level: one episode to fill, 5 timed)
    out: str = "results/serving_headroom.json"


def make_env(cfg: ServingBenchConfig, split: str, load: str, mix: str | None = None, **grid) -> ServingEnv:
    """The benchmark's env; ``grid``: an agent's own action grid (fallback_values, rollback_values, off_switch).
    Test envs take ``test_mix`` and ``test_code_source`` where they are given."""
    test = split == "test"
    mix = mix or (cfg.test_mix if test and cfg.test_mix else cfg.mix)
    code_source = cfg.test_code_source if test and cfg.test_code_source else cfg.code_source
    return ServingEnv(pair=cfg.pair, dtype=cfg.dtype, split=split, load=load, mix=mix, code_source=code_source,
                      episode_steps=cfg.episode_steps, max_new_tokens=cfg.max_new_tokens, max_batch=cfg.max_batch,
                      max_prompts=cfg.max_prompts, **grid)


def action_set(env: ServingEnv, actions: tuple[int, ...]) -> list[int]:
    """``actions`` (all of the env's when empty; of one request with ``per_domain``) with speculation off among them."""
    n = env.n_actions
    bad = [a for a in actions if not 0 <= a < n]
    if bad:
        raise ValueError(f"--actions: {bad} not in [0, {n})")
    return sorted(set(actions) | {n - 1}) if actions else list(range(n))


def fixed_returns(env: ServingEnv, seeds: list[int], desc: str,
                  actions: tuple[int, ...] = ()) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Every fixed action's (returns, speedups) over ``seeds``."""
    out = {}
    for a in tqdm(action_set(env, actions), desc=desc, leave=False):
        r, s, _ = returns_of(env, Fixed(a), seeds)
        out[a] = (r, s)
    return out


def label(env: ServingEnv, a: int) -> str:
    t = env.thresholds(a)
    return "off" if t is None else f"({t[0]:g}, {t[1]:g})"


def row(name: str, returns: np.ndarray, speedups: np.ndarray, base: np.ndarray | None) -> dict:
    lo, hi = mean_ci(returns)
    out = {"policy": name, "return": float(returns.mean()), "ci": [lo, hi], "speedup": float(speedups.mean()),
           "_episodes": (returns, speedups)}
    if base is not None:
        d = returns - base
        out["minus_best_single"] = float(d.mean())
        out["minus_best_single_ci"] = list(mean_ci(d))
    return out


def fixed_by_level(cfg: ServingBenchConfig, seeds: list[int], **grid) -> tuple[dict, dict]:
    """Validation envs at each level of ``cfg.levels`` (constant load, left open) and every fixed action's
    (returns, speedups) on episodes ``seeds`` in each: ({level: env}, {level: {action: (returns, speedups)}})."""
    envs, by_level = {}, {}
    for u in cfg.levels:
        envs[u] = make_env(cfg, "validation", f"constant:{u}", **grid)
        by_level[u] = fixed_returns(envs[u], seeds, f"validation, load {u}", cfg.actions)
    return envs, by_level


def batch_table_from(envs: dict, table: dict[float, int], seeds: list[int], grid: list[int]) -> tuple[dict, dict]:
    """The per-batch-size table (``choose_batch_table``): exact step rewards of every action of ``grid`` at the states
    the per-load ``table`` visits in each of ``envs`` ({level: validation env}; a level ``table`` lacks plays its
    nearest level's action). Returns (table, mean reward per bucket and action)."""
    levels = list(envs)
    behaviour = [LoadTable(envs[u], {u: table[min(table, key=lambda v, u=u: abs(v - u))]}) for u in levels]
    return choose_batch_table([envs[u] for u in levels], behaviour, seeds, grid)


def best_per_level(by_level: dict) -> dict[float, int]:
    """The per-load table: at each level the fixed action with the best mean return (``fixed_by_level``'s runs)."""
    return {u: max(fixed, key=lambda a, fixed=fixed: fixed[a][0].mean()) for u, fixed in by_level.items()}


def choose(cfg: ServingBenchConfig, seeds: list[int]) -> dict:
    """Validation: every fixed action per level; the rules' settings chosen from them."""
    envs, by_level = fixed_by_level(cfg, seeds)
    env = envs[cfg.levels[0]]
    grid = action_set(env, cfg.actions)
    off = env.action_space.n - 1
    total = {a: float(np.mean([by_level[u][a][0].mean() for u in cfg.levels])) for a in grid}
    best = max(total, key=total.get)
    table = best_per_level(by_level)
    best_on = max((a for a in grid if a != off), key=total.get)
    rules = {}
    for b in sorted({min(cfg.max_batch, 2**k) for k in range(8)}):
        rules[("batch", b)] = OffAboveBatch(best_on, off, b, cfg.max_batch, env.config.batch_scale)
    for t in (0.2, 0.3, 0.4, 0.5):
        rules[("acceptance", t)] = AcceptanceRule(best_on, off, t)
    scores = {}
    for key, rule in tqdm(rules.items(), desc="validation: rules", leave=False):
        scores[key] = float(np.mean([returns_of(envs[u], rule, seeds)[0].mean() for u in cfg.levels]))
    batch_key = max((k for k in scores if k[0] == "batch"), key=scores.get)
    acc_key = max((k for k in scores if k[0] == "acceptance"), key=scores.get)
    batch_table, bucket_means = batch_table_from(envs, table, seeds, grid)
    for e in envs.values():
        e.close()
    return {"best_single": best, "best_on": best_on, "off": off, "table": table, "batch_table": batch_table,
            "batch_table_means": {bucket_label(k): {label(env, a): m for a, m in v.items()} for k, v in bucket_means.items()},
            "off_above_batch": batch_key[1],
            "acceptance_threshold": acc_key[1], "labels": {a: label(env, a) for a in range(env.action_space.n)},
            "validation_means": {str(u): {label(env, a): float(by_level[u][a][0].mean()) for a in grid}
                                 for u in cfg.levels},
            "rule_scores": {f"{k[0]}:{k[1]}": v for k, v in scores.items()}}


def per_domain(cfg: ServingBenchConfig, seeds: list[int]) -> tuple[dict, dict[float, dict[str, int]]]:
    """Headroom per domain: the best fixed action per (level, domain) against the best single one per domain, on
    single-domain validation workloads; and that table, {level: {domain: action}} (``DomainTable``'s)."""
    out, table = {}, {u: {} for u in cfg.levels}
    for d in cfg.domains:
        means = {}
        for u in cfg.levels:
            env = make_env(cfg, "validation", f"constant:{u}", mix=f"{d}:1")
            fixed = fixed_returns(env, seeds, f"{d}, load {u}", cfg.actions)
            means[u] = {a: fixed[a] for a in fixed}
            labels = {a: label(env, a) for a in fixed}
            env.close()
        single = max(labels, key=lambda a: np.mean([means[u][a][0].mean() for u in cfg.levels]))
        out[d] = {"best_single": labels[single], "levels": {}}
        for u in cfg.levels:
            best = max(labels, key=lambda a: means[u][a][0].mean())
            table[u][d] = best
            r_best, s_best = means[u][best]
            r_single, s_single = means[u][single]
            out[d]["levels"][str(u)] = {"table": labels[best], "table_return": float(r_best.mean()),
                                        "single_return": float(r_single.mean()),
                                        "table_minus_single": float((r_best - r_single).mean()),
                                        "table_speedup": float(s_best.mean()), "single_speedup": float(s_single.mean())}
    return out, table


def test_rows(cfg: ServingBenchConfig, chosen: dict, agents: list, seeds: list[int], load: str,
              raw: dict | None = None) -> list[dict]:
    """The test rows of every policy under ``load``; ``raw`` (when given) collects each policy's per-episode
    (returns, speedups) for the overall rows."""
    env = make_env(cfg, "test", load)
    fixed = fixed_returns(env, seeds, f"test, {load}", cfg.actions)
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
                    *returns_of(env, table, seeds)[:2], base_r))
    rows.append(row("per-batch-size table (" + ", ".join(f"{bucket_label(k)}: {labels[a]}"
                                                        for k, a in chosen["batch_table"].items()) + ")",
                    *returns_of(env, BatchTable(chosen["batch_table"], chosen["off"], cfg.max_batch, env.config.batch_scale), seeds)[:2],
                    base_r))
    rows.append(row(f"off above batch {chosen['off_above_batch']}, else {labels[chosen['best_on']]}",
                    *returns_of(env, OffAboveBatch(chosen["best_on"], chosen["off"], chosen["off_above_batch"],
                                                   cfg.max_batch, env.config.batch_scale), seeds)[:2], base_r))
    rows.append(row(f"off below acceptance {chosen['acceptance_threshold']:g}",
                    *returns_of(env, AcceptanceRule(chosen["best_on"], chosen["off"],
                                                    chosen["acceptance_threshold"]), seeds)[:2], base_r))
    if chosen.get("domain_table"):  # each request its domain's action: an env that takes an action per domain
        own = make_env(cfg, "test", load, per_domain=True)
        rows.append(row("per-domain-and-load table, per request ("
                        + "; ".join(f"{u:g}: " + ", ".join(f"{d} {labels[a]}" for d, a in t.items())
                                    for u, t in chosen["domain_table"].items()) + ")",
                        *returns_of(own, DomainTable(own, chosen["domain_table"]), seeds)[:2], base_r))
        rows.append(row("per-batch-size-and-domain table, per request ("
                        + ", ".join(f"{bucket_label(k)} {d}: {labels[a]}" for (k, d), a in chosen["domain_batch_table"].items()
                                    if a != chosen["off"]) + "; else off)",
                        *returns_of(own, DomainBatchTable(own, chosen["domain_batch_table"], chosen["off"]), seeds)[:2],
                        base_r))
        own.close()
    rows.append(row("per-episode oracle of the fixed actions", oracle_r, oracle_s, base_r))
    if cfg.step_oracle:
        rows.append(row("per-step hindsight oracle of the fixed actions",
                        *returns_of(env, StepHindsight(env, ids), seeds)[:2], base_r))
    agent_runs = []
    for name, agent, grid in agents:  # each in an env with its own action grid: the same requests and arrivals
        own = make_env(cfg, "test", load, **grid) if grid else env
        agent_runs.append(returns_of(own, agent, seeds)[:2])
        rows.append(row(name, *agent_runs[-1], base_r))
        if own is not env:
            own.close()
    ensemble = q_ensemble(agents)
    if ensemble is not None:  # one agent: the members' mean Q-values
        own = make_env(cfg, "test", load, **agents[0][2]) if agents[0][2] else env
        rows.append(row(f"agents' Q-ensemble of {len(agents)}", *returns_of(own, ensemble, seeds)[:2], base_r))
        if own is not env:
            own.close()
    if len(agent_runs) > 1:  # the seeds together: each episode's mean over the agents (an interval over episodes)
        rows.append(row(f"agents, mean of {len(agent_runs)}", np.mean([r for r, _ in agent_runs], axis=0),
                        np.mean([s for _, s in agent_runs], axis=0), base_r))
    env.close()
    add_minus_table(rows)
    for r in rows:
        episodes = r.pop("_episodes")
        if raw is not None:
            raw.setdefault(r["policy"].split(" (")[0].split(",")[0], []).append(episodes)
    return rows


def overall_rows(raw: dict[str, list[tuple[np.ndarray, np.ndarray]]]) -> list[dict]:
    """Every policy over all levels' episodes together, paired with the best single fixed action's."""
    joined = {name: (np.concatenate([r for r, _ in parts]), np.concatenate([s for _, s in parts]))
              for name, parts in raw.items()}
    base = next(v for k, v in joined.items() if k.startswith("best single fixed"))[0]
    return add_minus_table([row(name, r, s, base) for name, (r, s) in joined.items()])


REFERENCES = (("minus_table", "per-load table"), ("minus_batch_table", "per-batch-size table"),
              ("minus_domain_batch_table", "per-batch-size-and-domain table"))  # (row key, the rule's row name)


def add_minus_table(rows: list[dict]) -> list[dict]:
    """Every row's paired difference (episode by episode, with its interval) to the per-load table's returns
    (``minus_table``), to the per-batch-size table's (``minus_batch_table``) and to the per-(batch size, domain)
    table's (``minus_domain_batch_table``), where those rules ran."""
    for key, name in REFERENCES:
        found = next((r for r in rows if r["policy"].startswith(name)), None)
        if found is None:
            continue
        for r in rows:
            d = r["_episodes"][0] - found["_episodes"][0]
            r[key], r[key + "_ci"] = float(d.mean()), list(mean_ci(d))
    return rows


def plot_goodput(report: dict, path: Path) -> Path:
    """Goodput (ratio to target-only serving at the same load) against the load level, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(report["levels"], key=float)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = [r["policy"] for r in report["levels"][levels[0]]]
    colors = plt.cm.tab20.colors  # more policies than the default cycle's 10 colours
    for i, name in enumerate(names):
        ys = [report["levels"][u][i]["speedup"] for u in levels]
        agent = name.startswith("agent")
        ax.plot([float(u) for u in levels], ys, marker="o", lw=2 if name.startswith("agents,") else 1,
                ls="--" if agent else "-", color=colors[(2 * i + i // 10) % 20],  # dark shades, then light
                label=name if len(name) < 60 else name[:57] + "...")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("load (utilisation of target-only capacity)")
    ax.set_ylabel("goodput / target-only goodput")
    ax.set_title(f"BiLD-Serve-v0 on test prompts ({report['config']['pair']}, mix {report['config']['mix']})")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def load_agents(cfg: ServingBenchConfig) -> list:
    """(name, model) of every ``--model``: a model file, or a run folder's best model on validation (else its
    last), checked against the env's spaces (a clear error otherwise)."""
    from agents.runs import choose_model, load_agent

    if not cfg.model:
        return []
    out = []
    for p in cfg.model:
        path = choose_model(p)[0]
        grid = agent_grid(path)
        env = make_env(cfg, "test", f"constant:{cfg.levels[0]}", **grid)
        try:
            names = {n for n, _, _ in out}  # rows are keyed by name: two runs of one folder name are told apart
            name = next(n for n in (f"agent {Path(p).name}", f"agent {p}", *(f"agent {p} #{i}" for i in range(2, 99)))
                        if n not in names)
            out.append((name, load_agent(path, env), grid))
        finally:
            env.close()
    return out


def q_ensemble(agents: list):
    """The agents as one ``QEnsemble`` (their mean Q-values) when there are several DQNs on one grid; else None."""
    from agents.dqn import QEnsemble

    if len(agents) < 2 or any(g != agents[0][2] for _, _, g in agents) or not all(hasattr(a, "q_net") for _, a, _ in agents):
        return None
    return QEnsemble([a for _, a, _ in agents])


GRID_FIELDS = ("fallback_values", "rollback_values", "off_switch", "observe_domain", "per_domain",
               "batch_scale")  # what an agent's spaces hang on and how it reads its observation


def agent_grid(model_path: Path) -> dict:
    """The action grid a serving run was trained with (its ``config.json``, read as a resume reads it), where it is
    not the env's default; {} for a model without a run config."""
    from agents.serving_training import saved_configs
    from bild_env.serving.env import ServingConfig

    for folder in (model_path.parent, model_path.parent.parent):
        if (folder / "config.json").is_file():
            env, default = saved_configs(folder)[1], ServingConfig()
            return {k: getattr(env, k) for k in GRID_FIELDS if getattr(env, k) != getattr(default, k)}
    return {}


def run(cfg: ServingBenchConfig) -> dict:
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    select_seeds = list(range(1000, 1000 + cfg.select_episodes))
    test_seeds = list(range(cfg.episodes))
    chosen = choose(cfg, select_seeds)
    agents = load_agents(cfg)
    report = {"config": asdict(cfg), "chosen": {k: v for k, v in chosen.items() if k != "labels"},
              "levels": {}, "moving": {}}
    report["chosen"]["table"] = {str(u): chosen["labels"][a] for u, a in chosen["table"].items()}
    report["chosen"]["best_single"] = chosen["labels"][chosen["best_single"]]
    if cfg.domains:  # the per-domain table first: on test it runs as a rule, each request its domain's action
        report["domains"], domain_table = per_domain(cfg, select_seeds)
        mix = parse_mix(cfg.mix)
        chosen["domain_table"] = {u: {d: domain_table[u].get(d, chosen["table"][u]) for d in mix} for u in cfg.levels}
        report["chosen"]["domain_table"] = {str(u): {d: chosen["labels"][a] for d, a in t.items()}
                                            for u, t in chosen["domain_table"].items()}
        # and the per-batch-size table per domain, from exact counterfactuals on the mixed validation episodes
        envs = [make_env(cfg, "validation", f"constant:{u}", per_domain=True) for u in cfg.levels]
        grid = action_set(envs[0], cfg.actions)
        chosen["domain_batch_table"], means = choose_domain_batch_table(
            envs, [BatchTable(chosen["batch_table"], chosen["off"], cfg.max_batch, envs[0].config.batch_scale)] * len(envs), select_seeds, grid)
        for e in envs:
            e.close()
        report["chosen"]["domain_batch_table"] = {f"{bucket_label(k)} {d}": chosen["labels"][a]
                                                  for (k, d), a in chosen["domain_batch_table"].items()}
        report["chosen"]["domain_batch_table_means"] = {
            f"{bucket_label(k)} {d}": {chosen["labels"][a]: m for a, m in v.items()} for (k, d), v in means.items()}
    raw: dict = {}
    for u in cfg.levels:
        report["levels"][str(u)] = test_rows(cfg, chosen, agents, test_seeds, f"constant:{u}", raw)
    report["overall"] = overall_rows(raw)
    for r in report["overall"]:
        r.pop("_episodes")
    for load in cfg.moving:
        report["moving"][load] = test_rows(cfg, chosen, agents, test_seeds, load)
    from bild_env.models.device import machine_description

    report["machine"] = machine_description()
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
        returns_of(env, Fixed(15), [0])
        rates = []
        for _ in range(SPEED_REPEATS):
            t0 = time.perf_counter()
            _, _, eps = returns_of(env, Fixed(15), [0])
            rates.append(len(eps[0].actions) / (time.perf_counter() - t0))
        rows[str(u)] = {"steps_per_s": float(np.median(rates)), "range": [min(rates), max(rates)],
                        "mean_batch": eps[0].summary["mean_batch"]}
        env.close()
    from bild_env.models.device import machine_description

    return {"config": asdict(cfg), "speed": rows, "machine": machine_description()}


def markdown(report: dict) -> str:
    if "speed" in report:
        return "\n".join(["| load | mean batch | env steps/s (warm, median) | range |", "|---|---|---|---|"]
                         + [f"| {u} | {r['mean_batch']:.1f} | {r['steps_per_s']:.0f} | {r['range'][0]:.0f}-{r['range'][1]:.0f} |"
                            for u, r in report["speed"].items()])
    lines = []
    sections = [("levels", load, rows) for load, rows in report["levels"].items()]
    sections += [("overall", "all constant levels", report["overall"])] if report.get("overall") else []
    sections += [("moving", load, rows) for load, rows in report["moving"].items()]
    for kind, load, rows in sections:
        keys = ["minus_best_single", "minus_table", "minus_batch_table"]
        keys += ["minus_domain_batch_table"] if any("minus_domain_batch_table" in r for r in rows) else []
        heads = {"minus_best_single": "best single", "minus_table": "per-load table",
                 "minus_batch_table": "per-batch-size table", "minus_domain_batch_table": "per-(batch size, domain) table"}
        lines += [f"\n**{'load ' + load if kind == 'levels' else load}**\n",
                  "| policy | return [95% CI] | " + " | ".join(f"minus {heads[k]} [paired 95% CI]" for k in keys)
                  + " | speedup vs target-only |", "|---" * (len(keys) + 3) + "|"]
        for r in rows:
            cells = []
            for key in keys:
                if key in r:
                    lo, hi = r[key + "_ci"]
                    cells.append(f"{r[key]:+.3f} [{lo:+.3f}, {hi:+.3f}]")
                else:
                    cells.append("-")
            lines.append(f"| {r['policy']} | {r['return']:+.3f} [{r['ci'][0]:+.3f}, {r['ci'][1]:+.3f}] | "
                         + " | ".join(cells) + f" | {r['speedup']:.3f}x |")
    for d, v in report.get("domains", {}).items():
        lines += [f"\n**domain {d}** (best single: {v['best_single']})\n",
                  "| load | table's action | table minus single | table speedup | single speedup |", "|---|---|---|---|---|"]
        for u, x in v["levels"].items():
            lines.append(f"| {u} | {x['table']} | {x['table_minus_single']:+.3f} | {x['table_speedup']:.3f}x | "
                         f"{x['single_speedup']:.3f}x |")
    return "\n".join(lines)


def check(cfg: ServingBenchConfig) -> None:
    """Refuse a workload that makes no sense before any model loads (``mix`` and ``test_mix``, and per-domain tables
    that would meet a domain they have no action for)."""
    for option, checker in (("mix", parse_mix), ("test_mix", parse_mix), ("code_source", check_code_source),
                            ("test_code_source", check_code_source)):
        if option.startswith("test_") and not getattr(cfg, option):
            continue  # empty: the test episodes take the option without "test_"
        try:
            checker(getattr(cfg, option))
        except ValueError as err:
            raise ValueError(f"--{option.replace('_', '-')}: {err}") from None
    if cfg.test_mix:
        unseen = sorted(set(parse_mix(cfg.test_mix)) - set(cfg.domains)) if cfg.domains else []
        if unseen:
            raise ValueError(f"--test-mix {cfg.test_mix!r} has domain(s) {unseen} the per-domain tables of --domains "
                             f"{' '.join(cfg.domains)} have no action for: leave --domains out, or add them to it")


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_checked(ServingBenchConfig, argv, __doc__, check)
    report = speed(cfg) if cfg.speed else run(cfg)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=lambda o: o.item() if hasattr(o, "item") else str(o)) + "\n")
    print(markdown(report))
    if not cfg.speed:
        print(f"goodput against load: {plot_goodput(report, out.with_suffix('.png'))}")
    return report


if __name__ == "__main__":
    main()
