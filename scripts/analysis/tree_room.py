"""The room for a per-step choice of the tree rule: an oracle schedule against the best fixed rule.

    python -m scripts.analysis.tree_room --pair smollm2 --dtype bfloat16 --split test --prompts 8 \\
        --rules 1,1,1,1 6:8:2:0.3 16:8:4:0.1 24:8:4:0.1 \\
        --profiles h200-opt-eager h200-smollm2-eager-bf16 \\
                   results/cpu_profile_smollm2_bfloat16_assembled.json:cost_model \\
        --out results/tree_room_smollm2_test.json
    python -m scripts.analysis.tree_room --pair tiny-random --prompts 1 --max-new-tokens 8 --rules 1,1 2,1   # a smoke run

Tree decoding is lossless (greedy): whatever rule a step uses, the committed text is the target's greedy continuation,
so the state before a step is only the position p in that continuation (the ``reference``, target-only decoding). For
every position p and rule r this runs one tree step (``bild_env.decoding.tree.tree_step``) from the prompt and the
reference's first p tokens, both caches holding all but the last committed token (the state a step starts from in
``generate_tree``; at p = 1 the draft's cache is empty, as in its first step), and records a(p, r), the tokens the step
advances, and its forwards (``scripts.analysis.stop_rules.Recorder``), priced afterwards under each ``--profiles`` cost model
(``scripts.analysis.stop_rules.price``, a hardware profile's name or ``FILE:key``, as ``scripts.analysis.stop_rules --profiles``). Then
(``schedule``) a dynamic programme over positions gives the least-cost schedule: the oracle's per-step choice, a
ceiling for any agent that chooses the rule each step from this set. Each fixed rule's cost is the same programme
restricted to that rule (its own path, which is ``generate_tree``'s steps). Every cost includes the target's prefill.

Reported per profile and domain: the cost of the best fixed rule over the oracle's (both commit the same tokens, so
it is the oracle's speedup over that rule), with a 95% bootstrap interval over prompts, for (a) the rule ``--chosen``
names for that profile (chosen on validation) and (b) the best fixed rule of this split in hindsight (the tighter
bound); the same over the chains alone (rules whose branching is all 1s, when there are two or more); and how often
the oracle uses each rule. In bfloat16 a step's tokens may differ from the reference's at a near-tie (forwards fed
different numbers of tokens round differently): a(p, r) counts the tokens that agree with the reference (at least 1)
and the share of such steps is reported (``mismatched_steps``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from agents.common.stats import ratio_interval
from scripts.analysis.stop_rules import Recorder, price, read_profile
from bild_env import generate_target_only, load_pair
from bild_env.cli import finite_json, parse_checked
from bild_env.decoding.decoders import prepare_prompt
from bild_env.decoding.loop import Committed
from bild_env.decoding.stats import DecodeStats
from bild_env.decoding.tree import TreeRule, TreeRunner, parse_tree_rule, tree_step
from bild_env.command import parse_each, writable_file
from bild_env.models.device import machine_description
from bild_env.models.pairs import DEFAULT_PAIR, check_held_out
from bild_env.prompts.domains import load_domain


# ---------------------------------------------------------------------------------------------------------------------
# The math: a dynamic programme over positions (pure, tested on hand-made tables)


def schedule(adv, cost, allowed=None) -> tuple[float, list[int]]:
    """The least-cost schedule over positions: (its cost, the rule chosen at each step along it).

    ``adv[i][r]`` (an integer >= 1) is how many tokens a step with rule r advances from state i, ``cost[i][r]`` what
    it costs; states 0 .. P-1 are the positions still to step from and any state >= P is the end (done). ``allowed``:
    the rules the schedule may use (None: all). C[i] = min over r of cost[i][r] + C[i + adv[i][r]], C[>= P] = 0;
    ties go to the rule listed first. With one rule allowed it is that rule's own path.
    """
    adv, cost = np.asarray(adv), np.asarray(cost, dtype=float)
    if adv.shape != cost.shape or adv.ndim != 2:
        raise ValueError(f"adv and cost must be tables of the same shape (positions, rules), got {adv.shape} and "
                         f"{cost.shape}")
    if adv.size and adv.min() < 1:
        raise ValueError("every step advances at least one token (adv >= 1)")
    positions, rules = adv.shape
    allowed = list(range(rules)) if allowed is None else list(allowed)
    if not allowed or any(not 0 <= r < rules for r in allowed):
        raise ValueError(f"allowed must name rules among 0..{rules - 1}, got {allowed}")
    best = np.zeros(positions + 1)
    choice = np.zeros(positions, dtype=int)
    for i in range(positions - 1, -1, -1):
        options = [cost[i, r] + best[min(i + int(adv[i, r]), positions)] for r in allowed]
        j = int(np.argmin(options))
        best[i], choice[i] = options[j], allowed[j]
    path, i = [], 0
    while i < positions:
        path.append(int(choice[i]))
        i += int(adv[i, choice[i]])
    return float(best[0]), path


# ---------------------------------------------------------------------------------------------------------------------
# The tables: one tree step per (position, rule)


def _reset_draft(runner: TreeRunner) -> None:
    """An empty draft cache (the state of ``generate_tree``'s first step)."""
    from transformers import DynamicCache

    runner.caches["draft"] = DynamicCache(config=runner.pair.draft.config)
    runner.lengths["draft"] = 0
    runner.columns["draft"] = []


@torch.inference_mode()
def step_tables(pair, prompt_ids: list[int], rules: list[TreeRule], max_new_tokens: int, recorder: Recorder,
                reference: list[int] | None = None) -> dict:
    """One prompt's tables: for each position p (1 .. len(reference) - 1 new tokens committed, the first from the
    target's prefill) and rule, the tokens a step advances along ``reference`` (default: target-only decoding) and the
    step's forwards ``(role, fed, context)``; also the prefill's forwards.

    Returns {"reference", "adv" (positions, rules), "calls" [[forwards of each rule] per position], "prefill",
    "committed" (what each step committed, agreeing or not), "mismatched" (steps whose tokens left the reference)}.
    """
    ids = prepare_prompt(pair, prompt_ids, max_new_tokens)
    ref = list(reference) if reference is not None else generate_target_only(pair, ids, max_new_tokens).new_ids
    runner = TreeRunner(pair, recorder)
    recorder.take()
    run = Committed(runner, ids, max_new_tokens, pair.eos_token_ids, pair.device)  # the target's prefill
    prefill = recorder.take()
    adv, calls, committed, mismatched = [], [], [], 0
    for p in range(1, len(ref)):
        prefix = ids + ref[:p]
        row_adv, row_calls, row_got = [], [], []
        for rule in rules:
            run.tokens = list(prefix)
            tree_step(run, rule, DecodeStats())
            got = run.tokens[len(prefix):]
            agree = next((j for j, (x, y) in enumerate(zip(got, ref[p:])) if x != y), min(len(got), len(ref) - p))
            mismatched += agree < len(got)
            row_adv.append(max(agree, 1))
            row_got.append(len(got))
            row_calls.append(recorder.take())
            runner.crop(len(prefix) - 1)  # both caches back to the state before the step (exact: a slice)
            if p == 1:
                _reset_draft(runner)
        adv.append(row_adv)
        calls.append(row_calls)
        committed.append(row_got)
        # the next position's state: both caches extended by the token just committed (not priced: not a step)
        runner._forward("target", prefix, keep=1)
        runner._forward("draft", prefix, keep=1)
    return {"reference": ref, "adv": adv, "calls": calls, "prefill": prefill, "committed": committed,
            "mismatched": mismatched}


def priced_tables(tables: dict, cost) -> tuple[np.ndarray, float]:
    """(cost[p][r] of each step, the prefill's cost) under the cost model ``cost``."""
    steps = np.array([[price(c, cost) for c in row] for row in tables["calls"]], dtype=float)
    return steps.reshape(len(tables["calls"]), -1), price(tables["prefill"], cost)


def prompt_costs(adv: np.ndarray, steps: np.ndarray, prefill: float, chains: list[int]) -> dict:
    """One prompt under one cost model: each fixed rule's cost (its own path), the oracle's over every rule and over
    the chains, and the oracle's choices; every cost with the prefill."""
    adv = np.asarray(adv).reshape(steps.shape)
    rules = steps.shape[1]
    fixed = [schedule(adv, steps, [r])[0] + prefill for r in range(rules)]
    oracle, path = schedule(adv, steps)
    out = {"fixed": fixed, "oracle": oracle + prefill, "oracle_path": path}
    if len(chains) >= 2:
        chain_cost, chain_path = schedule(adv, steps, chains)
        out |= {"oracle_chains": chain_cost + prefill, "oracle_chains_path": chain_path}
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The command


@dataclass
class TreeRoomConfig:
    """What to table, how to price it and where to write it."""

    pair: str = field(default=DEFAULT_PAIR, metadata={"help": "the model pair (a preset of bild_env.models.pairs)"})
    dtype: str | None = field(default=None, metadata={"help": (
        "default: the preset's (auto: bfloat16 on a CPU with native bf16, else float32)")})
    domains: tuple[str, ...] = ("prose", "code", "chat")
    split: str = field(default="test", metadata={"help": "validation or test"})
    prompts: int = field(default=8, metadata={"help": "per domain (fewer where the split has fewer)"})
    max_new_tokens: int = field(default=64, metadata={"help": "tokens generated per prompt"})
    rules: tuple[str, ...] = field(default=("1,1,1,1", "6:8:2:0.3", "16:8:4:0.1", "24:8:4:0.1"), metadata={"help": (
        "tree rules (bild_env.decoding.tree.parse_tree_rule): N:D:W[:F] dynamic, or a shape such as 3,2,1,1 "
        "(1,1,1,1 is naive SD's chain of 4)")})
    profiles: tuple[str, ...] = field(default=("h200-opt-eager", "h200-smollm2-eager-bf16"), metadata={"help": (
        "cost models to price the steps by, as scripts.analysis.stop_rules --profiles: a hardware cost profile (shipped name or "
        "file) or FILE / FILE:key.key of a JSON CostModel")})
    chosen: tuple[str, ...] = field(default=(), metadata={"help": (
        "PROFILE=RULE: the fixed rule chosen on validation for a profile (one of --rules), e.g. "
        "h200-opt-eager=24:8:4:0.1; a profile without one is compared with its best fixed rule in hindsight only")})
    threads: int = field(default=1, metadata={"help": "torch threads"})
    bootstrap: int = field(default=2000, metadata={"help": "bootstrap resamples of the 95% intervals (0: none)"})
    tables: str = field(default="", metadata={"help": (
        "summarise the tables of this JSON (an earlier run's --out, finished or not) again instead of decoding: its "
        "rules, profiles and prompts, with this command's --chosen when given and its --bootstrap")})
    out: str = field(default="", metadata={"help": (
        "the JSON to write (rewritten whole after every prompt, so a stopped run keeps what it did)")})


def _chosen(cfg: TreeRoomConfig) -> dict[str, str]:
    out = {}
    for item in cfg.chosen:
        spec, sep, rule = item.rpartition("=")
        if not sep or spec not in cfg.profiles or rule not in cfg.rules:
            raise ValueError(f"--chosen {item!r}: give PROFILE=RULE with PROFILE one of --profiles "
                             f"{list(cfg.profiles)} and RULE one of --rules {list(cfg.rules)}")
        out[spec] = rule
    return out


def check_config(cfg: TreeRoomConfig) -> None:
    if cfg.tables:
        if not Path(cfg.tables).is_file():
            raise ValueError(f"--tables {cfg.tables}: no such file; give an earlier run's --out")
        writable_file(cfg.out)
        return
    check_held_out(cfg.pair, cfg.domains, cfg.split)
    if cfg.prompts < 1 or cfg.max_new_tokens < 2:
        raise ValueError("--prompts must be at least 1 and --max-new-tokens at least 2")
    if not cfg.rules or len(set(cfg.rules)) != len(cfg.rules):
        raise ValueError(f"--rules: give one or more different tree rules, got {list(cfg.rules)}")
    parse_each("--rules", cfg.rules, parse_tree_rule)
    if not cfg.profiles:
        raise ValueError("--profiles: give at least one cost model, e.g. h200-opt-eager")
    for spec in cfg.profiles:
        read_profile(spec)
    _chosen(cfg)
    if cfg.threads < 1 or cfg.bootstrap < 0:
        raise ValueError("--threads must be at least 1 and --bootstrap at least 0")
    writable_file(cfg.out)


def is_chain(rule: TreeRule) -> bool:
    return bool(rule.branching) and all(b == 1 for b in rule.branching)


def summarise(cfg: TreeRoomConfig, per_prompt: list[dict]) -> dict:
    """Per profile, per domain and over all: fixed rules, the oracle, the ratios with intervals, the oracle's use of
    each rule."""
    rules = list(cfg.rules)
    chains = [i for i, r in enumerate(rules) if is_chain(parse_tree_rule(r))]
    chosen = _chosen(cfg)
    out = {}
    groups = {d: [x for x in per_prompt if x["domain"] == d] for d in cfg.domains}
    groups = {d: xs for d, xs in groups.items() if xs} | {"all": per_prompt}
    for spec in cfg.profiles:
        rows = {}
        for name, xs in groups.items():
            costs = [x["costs"][spec] for x in xs]
            tokens = np.array([x["new_tokens"] for x in xs], dtype=float)
            fixed = np.array([c["fixed"] for c in costs])  # (prompts, rules)
            oracle = np.array([c["oracle"] for c in costs])
            hindsight = int(np.argmin(fixed.sum(0)))
            row = {"prompts": len(xs), "new_tokens": int(tokens.sum()),
                   "ms_per_token": {"oracle": float(oracle.sum() / tokens.sum()),
                                    **{r: float(fixed[:, i].sum() / tokens.sum()) for i, r in enumerate(rules)}},
                   "best_fixed_hindsight": rules[hindsight],
                   "versus_best_fixed_hindsight": ratio_interval(fixed[:, hindsight], oracle, cfg.bootstrap)}
            if spec in chosen:
                c = rules.index(chosen[spec])
                row["chosen"] = chosen[spec]
                row["versus_chosen"] = ratio_interval(fixed[:, c], oracle, cfg.bootstrap)
            use = np.zeros(len(rules))
            for c in costs:
                for r in c["oracle_path"]:
                    use[r] += 1
            row["oracle_steps"] = int(use.sum())
            row["oracle_use"] = {r: float(use[i] / use.sum()) for i, r in enumerate(rules)}
            reference = rules.index(chosen[spec]) if spec in chosen else hindsight
            row["oracle_leaves_fixed"] = float(1 - use[reference] / use.sum())
            if "1" in rules and reference != rules.index("1"):  # the fixed rule, or a step drafting one token
                pick = [reference, rules.index("1")]
                skip = np.array([schedule(x["adv"], x["costs"][spec]["steps"], pick)[0] + x["costs"][spec]["prefill"]
                                 for x in xs])
                row["oracle_fixed_or_1"] = ratio_interval(fixed[:, reference], skip, cfg.bootstrap)
            if len(chains) >= 2:
                chain_oracle = np.array([c["oracle_chains"] for c in costs])
                best_chain = chains[int(np.argmin(fixed[:, chains].sum(0)))]
                row["chains"] = {"best_fixed_hindsight": rules[best_chain],
                                 "versus_best_fixed_hindsight": ratio_interval(fixed[:, best_chain], chain_oracle,
                                                                               cfg.bootstrap)}
            rows[name] = row
        out[spec] = rows
    return out


def run(cfg: TreeRoomConfig, pair=None, progress: bool = True) -> dict:
    """The tables of every prompt (domains interleaved, so a partial run stays balanced), priced and summarised;
    the JSON is rewritten after every prompt when ``cfg.out`` names a file. ``pair``: a loaded pair (tests)."""
    check_config(cfg)
    torch.set_num_threads(cfg.threads)
    pair = pair or load_pair(cfg.pair, dtype=cfg.dtype)
    profiles = {spec: read_profile(spec) for spec in cfg.profiles}
    rules = [parse_tree_rule(r) for r in cfg.rules]
    chains = [i for i, r in enumerate(rules) if is_chain(r)]
    recorder = Recorder(next(iter(profiles.values())))
    prompts = {d: load_domain(pair.tokenizer, d, cfg.split, cfg.prompts) for d in cfg.domains}
    order = [(d, i) for i in range(max(map(len, prompts.values()))) for d in cfg.domains if i < len(prompts[d])]
    result = {"machine": machine_description(pair.device), "dtype": str(pair.dtype), "config": asdict(cfg),
              "rule_names": [r.name for r in rules], "per_prompt": [], "summary": {}}
    for domain, i in tqdm(order, desc="prompts", unit="prompt", disable=not progress):
        tables = step_tables(pair, prompts[domain][i], rules, cfg.max_new_tokens, recorder)
        adv = np.array(tables["adv"], dtype=int).reshape(-1, len(rules))
        entry = {"domain": domain, "index": i, "prompt_tokens": len(prompts[domain][i]),
                 "new_tokens": len(tables["reference"]), "steps_tabled": int(adv.size),
                 "mismatched_steps": tables["mismatched"], "adv": adv.tolist(), "committed": tables["committed"],
                 "costs": {}}
        for spec, model in profiles.items():
            steps, prefill = priced_tables(tables, model)
            entry["costs"][spec] = {"prefill": prefill, "steps": steps.round(5).tolist(),
                                    **prompt_costs(adv, steps, prefill, chains)}
        result["per_prompt"].append(entry)
        result["summary"] = summarise(cfg, result["per_prompt"])
        result["mismatched_step_share"] = sum(x["mismatched_steps"] for x in result["per_prompt"]) / max(
            sum(x["steps_tabled"] for x in result["per_prompt"]), 1)
        if cfg.out:
            write_json(Path(cfg.out), result)
    return result


def resummarise(cfg: TreeRoomConfig) -> dict:
    """``cfg.tables``'s stored tables summarised again (``--tables``): no decoding."""
    result = json.loads(Path(cfg.tables).read_text())
    stored = TreeRoomConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in result["config"].items()
                               if k in TreeRoomConfig.__dataclass_fields__})
    stored.chosen = cfg.chosen or stored.chosen
    stored.bootstrap, stored.tables, stored.out = cfg.bootstrap, cfg.tables, cfg.out
    _chosen(stored)
    result["config"] = asdict(stored)
    result["summary"] = summarise(stored, result["per_prompt"])
    if cfg.out:
        write_json(Path(cfg.out), result)
    return result


def write_json(path: Path, result: dict) -> None:
    from agents.common.files import write_atomic

    result = finite_json(result)  # the summary indented; each prompt's tables on one line (their numbers are many)
    rows = ",\n".join(json.dumps(x, allow_nan=False, separators=(",", ":")) for x in result["per_prompt"])
    head = json.dumps({**result, "per_prompt": "@ROWS@"}, indent=1, allow_nan=False)
    text = head.replace('"@ROWS@"', f"[\n{rows}\n]" if rows else "[]") + "\n"
    write_atomic(path, lambda f: f.write(text.encode()))


def report(result: dict) -> str:
    cfg = result["config"]
    lines = [f"{result['machine']}; {result['dtype']}; {cfg['split']} prompts; {len(result['per_prompt'])} prompts "
             f"done; rules {', '.join(cfg['rules'])}; steps that left the reference (bfloat16 near-ties): "
             f"{result.get('mismatched_step_share', 0):.2%}"]
    ci = lambda x: f" [{x['interval'][0]:.3f}, {x['interval'][1]:.3f}]" if x["interval"] else ""
    for spec, rows in result["summary"].items():
        lines += [f"\npriced by {spec}", "| domain | prompts | fixed rule | fixed / oracle | best in hindsight | "
                  "hindsight / oracle | oracle leaves the fixed rule | oracle's use of each rule | "
                  "chains: best / oracle | fixed / oracle of {fixed, 1} |", "|---|---|---|---|---|---|---|---|---|---|"]
        for domain, r in rows.items():
            chosen = r.get("chosen", "")
            versus = r.get("versus_chosen")
            versus = f"{versus['ratio']:.3f}x{ci(versus)}" if versus else "-"
            chains = r.get("chains")
            lines.append(
                f"| {domain} | {r['prompts']} | {chosen or '-'} | {versus} | {r['best_fixed_hindsight']} | "
                f"{r['versus_best_fixed_hindsight']['ratio']:.3f}x{ci(r['versus_best_fixed_hindsight'])} | "
                f"{r['oracle_leaves_fixed']:.0%} | "
                + ", ".join(f"{k} {v:.0%}" for k, v in r["oracle_use"].items() if v >= 0.005) + " | "
                + (f"{chains['best_fixed_hindsight']} {chains['versus_best_fixed_hindsight']['ratio']:.3f}x"
                   f"{ci(chains['versus_best_fixed_hindsight'])}" if chains else "-") + " | "
                + (f"{r['oracle_fixed_or_1']['ratio']:.3f}x{ci(r['oracle_fixed_or_1'])}" if "oracle_fixed_or_1" in r
                   else "-") + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_checked(TreeRoomConfig, argv, __doc__.split("\n\n")[0], check_config)
    result = resummarise(cfg) if cfg.tables else run(cfg)
    print(report(result))
    return result


if __name__ == "__main__":
    from bild_env.command import run_command

    sys.exit(run_command("python -m scripts.analysis.tree_room", main))
