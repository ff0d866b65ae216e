"""When should the draft stop? Naive SD's stopping rules side by side, and the room a perfect predictor leaves.

    python -m scripts.analysis.stop_rules --split validation --rules 8:0.5 8:0.2:cumulative 8:0.1:cumulative --out val.json
    python -m scripts.analysis.stop_rules --split test --rules 8:0.5 8:0.2:cumulative --out test.json   # once, the chosen rule
    python -m scripts.analysis.stop_rules --pair tiny-random --prompts 2 --max-new-tokens 8              # seconds, a smoke run
    python -m scripts.analysis.stop_rules --rules 8:0.5 --trees 16:6:4 3,2,1,1 --profiles gpu.json:float16.single   # trees

Every rule is lossless naive speculative decoding (``generate_speculative``): at most K draft tokens a step,
stopping after the token whose score is below F (``K:F``: the token's max probability, transformers' adaptive
length; ``K:F:cumulative``: the run's product of them, SpecDec++'s rule). Each is also run with a perfect
acceptance predictor, the oracle (``--oracle K``): the draft stops at the first token the target rejects, a
forward it still pays, as any predictor that reads the draft's distribution would. It knows the target's greedy
output, decoded first (``oracle_speculative``).

Speed is read two ways, per domain, against target only on the same prompts:
- ``modelled``: the pair's cost model (the env's latency: each forward priced by fed tokens and context, timed
  once per machine and cached), summed over each method's forwards. Free of the noise of a busy machine, so this
  is what a rule is chosen by (on validation prompts, never on test).
- ``wall``: the clock, interleaved per prompt. Noisy on a shared CPU; ``bench.decoders`` is the wall-clock benchmark.
  None for the oracle, whose clock would include decoding the target's output it is told.
``--trees`` adds tree speculation's rules (``bild_env.decoding.tree``: ``N:D:W`` dynamic, ``3,2,1,1`` a fixed shape),
also lossless; the best tree (by the geometric mean over domains of the modelled speedup) is compared with the best
chain rule, paired by prompt (``best_tree``). ``--profiles`` prices the same forwards again by other cost models (a
hardware cost profile's name or file, ``bild_env.decoding.profiles``, or a JSON of ``CostModel.to_dict()``), each
forward's fed tokens and context recorded as it runs (``Recorder``): no decoding again, the same acceptance.
Every rule is also compared with the first rule listed, paired by prompt (``versus_first_rule``: the ratio of their
speeds and its bootstrap interval, modelled and wall), and each prompt's tokens and times are kept (``per_prompt``).
With each: the 95% bootstrap interval over prompts, acceptance, tokens per target forward and draft forwards per
token. ``room`` in the report: the share of the oracle's gain over the token rule that each rule recovers.
"""

from __future__ import annotations

import sys

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from bild_env import generate_speculative, generate_target_only, load_pair
from bild_env.cli import report_main
from bild_env.decoding.cost_model import CostModel
from bild_env.decoding.costs import load_or_calibrate
from bild_env.decoding.profiles import ProfileError, charged, load_profile
from bild_env.decoding.decoders import live_result, parse_stop_rule, start_live, stop_rule_name, verify_drafts
from bild_env.decoding.stats import DecodeStats
from bild_env.decoding.tree import generate_tree, parse_tree_rule
from bild_env.command import parse_each
from bild_env.models.device import machine_description
from bild_env.models.pairs import DEFAULT_PAIR, check_held_out
from bild_env.prompts.domains import load_domain

TARGET_ONLY = "target only"


@dataclass
class StopRulesConfig:
    pair: str = DEFAULT_PAIR
    dtype: str | None = field(default=None, metadata={"help": (
        "default: the preset's (auto: bfloat16 on a CPU with native bf16, else float32)")})
    domains: tuple[str, ...] = ("prose", "code", "chat")
    split: str = field(default="validation", metadata={"help": "validation chooses a rule; test reports it, once"})
    prompts: int = field(default=16, metadata={"help": "per domain (fewer where the split has fewer)"})
    max_new_tokens: int = 64
    rules: tuple[str, ...] = field(default=("8:0.5", "8:0.1:cumulative", "8:0.2:cumulative", "8:0.3:cumulative"),
                                   metadata={"help": "K:F[:cumulative]"})
    oracle: tuple[int, ...] = field(default=(8,), metadata={"help": (
        "K of the perfect predictor's runs (none: leave it out)")})
    trees: tuple[str, ...] = field(default=(), metadata={"help": (
        "tree speculation's rules: N:D:W (dynamic: N nodes, depth D, width W) or a shape 3,2,1,1")})
    profiles: tuple[str, ...] = field(default=(), metadata={"help": (
        "other cost models to price the same forwards by: a hardware cost profile (shipped name or file, "
        "bild_env.decoding.profiles), or FILE / FILE:key.key of a JSON CostModel")})
    threads: int = 1
    bootstrap: int = 2000
    cost_profile: str | None = field(default=None, metadata={"help": (
        "price the modelled speedups with a stored hardware cost profile (bild_env.decoding.profiles) instead of this "
        "machine's cost model; wall speedups stay this machine's clock")})
    out: str = ""


def check_config(cfg: StopRulesConfig) -> None:
    check_held_out(cfg.pair, cfg.domains, cfg.split)
    if cfg.prompts < 1 or cfg.max_new_tokens < 2:
        raise ValueError("--prompts must be at least 1 and --max-new-tokens at least 2")
    if not cfg.rules:
        raise ValueError("--rules: give at least one rule, e.g. 8:0.5 8:0.2:cumulative")
    parse_each("--rules", cfg.rules, parse_stop_rule)
    if any(k < 1 for k in cfg.oracle):
        raise ValueError(f"--oracle: every K must be at least 1, got {list(cfg.oracle)}")
    parse_each("--trees", cfg.trees, parse_tree_rule)
    for spec in cfg.profiles:
        read_profile(spec)


def read_profile(spec: str) -> CostModel:
    """A hardware cost profile's model (a shipped name or a profile file, ``bild_env.decoding.profiles``), else the
    cost model ``FILE`` holds, or ``FILE:a.b`` the one under keys a, b of the JSON in FILE; ValueError saying what is
    wrong otherwise."""
    import json
    from pathlib import Path

    if ":" not in spec:
        try:
            return load_profile(spec).model
        except ProfileError:
            pass  # a bare cost model's JSON, read below
    path, _, keys = spec.partition(":")
    try:
        d = json.loads(Path(path).read_text())
        for key in filter(None, keys.split(".")):
            d = d[key]
        return CostModel.from_dict(d)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--profiles {spec!r}: not a cost model ({type(err).__name__}: {err}); give a JSON file "
                         "of CostModel.to_dict(), or FILE:key.key naming one inside it") from None


class Recorder:
    """A cost model's stand-in for the runners (``runner.count_forward`` calls ``ms``): prices every forward by
    ``base`` and records it, ``(role, fed, context)``, so that the same generation can be priced by other cost
    models afterwards (``price``) without decoding again."""

    def __init__(self, base: CostModel) -> None:
        self.base, self.calls = base, []

    def ms(self, role: str, fed: int, context: int) -> float:
        self.calls.append((role, fed, context))
        return self.base.ms(role, fed, context)

    def take(self) -> list[tuple[str, int, int]]:
        """The forwards recorded since the last ``take``."""
        calls, self.calls = self.calls, []
        return calls


def price(calls: list[tuple[str, int, int]], cost: CostModel) -> float:
    """Milliseconds of the forwards ``calls`` under ``cost``."""
    return sum(cost.ms(role, fed, context) for role, fed, context in calls)


@torch.inference_mode()
def oracle_speculative(pair, prompt: list[int], reference: list[int], k: int, max_new_tokens: int, cost_model):
    """Naive SD whose draft stops at its first proposal that differs from the target's greedy token (``reference``,
    the target-only output of ``prompt``): a perfect acceptance predictor. That proposal's draft forward is paid and
    the token is not verified (the target's own token replaces it); at most ``k`` draft tokens a step. Counted and
    priced as ``generate_speculative``.

    In float32 its output is ``reference``. In bfloat16 a verification fed several tokens may break a near-tie the
    other way than target-only decoding did; from there the oracle follows the target's greedy continuation of its
    own output (decoded again, unpriced: the oracle knows it).
    """
    run = start_live(pair, prompt, max_new_tokens, cost_model)
    runner, tokens, counts = run.runner, run.tokens, DecodeStats()
    ahead = list(reference)  # the target's greedy continuation of the current output, as far as known
    while not run.done:
        new = len(tokens) - run.prompt_len
        if tokens[run.prompt_len:] != ahead[:new]:  # a near-tie broke the other way: what the target does from here
            ahead = tokens[run.prompt_len:] + generate_target_only(pair, tokens, run.remaining).new_ids
        budget, drafted = min(k, run.remaining - 1), 0
        while drafted < budget and tokens[-1] not in run.eos:
            token, _ = runner.draft_next(tokens)
            if token != ahead[len(tokens) - run.prompt_len]:
                counts.fallbacks += 1
                break
            tokens.append(token)
            drafted += 1
        verify_drafts(run, drafted, counts)  # all kept, but for a near-tie broken the other way (bfloat16)
    return live_result(pair, run, counts)


def interval(rule: list[DecodeStats], base: list[DecodeStats], field: str, resamples: int) -> list[float] | None:
    """95% percentile-bootstrap interval over prompts of the speedup sum(base time) / sum(rule time) per token."""
    if resamples == 0 or len(rule) < 2:
        return None
    tok, ms = np.array([[s.new_tokens, getattr(s, field)] for s in rule], dtype=float).T
    btok, bms = np.array([[s.new_tokens, getattr(s, field)] for s in base], dtype=float).T
    idx = np.random.default_rng(0).integers(0, len(rule), size=(resamples, len(rule)))
    ratios = (tok[idx].sum(1) / ms[idx].sum(1)) / (btok[idx].sum(1) / bms[idx].sum(1))
    return [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]


def ratio(rule: list[DecodeStats], base: list[DecodeStats], field: str) -> float:
    """sum(base time) / sum(rule time) per token: how many times faster ``rule`` is than ``base``."""
    per_token = lambda stats: sum(getattr(s, field) for s in stats) / sum(s.new_tokens for s in stats)
    return per_token(base) / per_token(rule)


def summarise(stats: list[DecodeStats], base: list[DecodeStats], same: int, resamples: int) -> dict:
    total = DecodeStats(model_ms=0.0)
    for s in stats:
        total += s
    speed = {"wall": {"speedup": None, "interval": None}}  # the oracle's clock includes decoding what it knows
    for field in ("model_ms", "wall_ms") if all(math.isfinite(s.wall_ms) for s in stats) else ("model_ms",):
        speed["modelled" if field == "model_ms" else "wall"] = {"speedup": ratio(stats, base, field),
                                                               "interval": interval(stats, base, field, resamples)}
    return {**speed, "acceptance": total.accepted / total.proposed if total.proposed else None,
            "tokens_per_target_forward": total.new_tokens / max(total.target_forwards, 1),
            "draft_forwards_per_token": total.draft_forwards / max(total.new_tokens, 1),
            "same_as_target": same / len(stats), "new_tokens": total.new_tokens}


def run(cfg: StopRulesConfig, cost_model=None) -> dict:
    """The comparison (module docstring); ``cost_model``: the prices (default: the pair's, timed once per machine)."""
    check_config(cfg)
    torch.set_num_threads(cfg.threads)
    profile = load_profile(cfg.cost_profile) if cfg.cost_profile else None  # checked before the models load
    pair = load_pair(cfg.pair, dtype=cfg.dtype)
    machine = cost_model or (profile.model if profile else load_or_calibrate(pair))
    cost = Recorder(machine)
    profiles = {spec: read_profile(spec) for spec in cfg.profiles}
    n = cfg.max_new_tokens
    methods = {stop_rule_name(*parse_stop_rule(r)): parse_stop_rule(r) for r in cfg.rules}
    oracles = {f"oracle (k<={k})": k for k in dict.fromkeys(cfg.oracle)}
    trees = {parse_tree_rule(r).name: parse_tree_rule(r) for r in cfg.trees}
    result = {"machine": machine_description(pair.device), "dtype": str(pair.dtype), "config": asdict(cfg),
              "cost_profile": charged(cfg.cost_profile), "cost_profile_label": profile.label if profile else None,
              "domains": {}}
    for domain in cfg.domains:
        prompts = load_domain(pair.tokenizer, domain, cfg.split, cfg.prompts)
        per = {name: [] for name in [TARGET_ONLY, *methods, *oracles, *trees]}
        forwards = {name: [] for name in per}  # each generation's forwards (role, fed, context), to price again
        same = dict.fromkeys(per, 0)
        for p in tqdm(prompts, desc=f"{domain} prompts", unit="prompt"):
            cost.take()
            ref = generate_target_only(pair, p, n, cost)
            per[TARGET_ONLY].append(ref.stats)
            forwards[TARGET_ONLY].append(cost.take())
            for name, (k, f, score) in methods.items():
                g = generate_speculative(pair, p, k, n, cost, confidence=f, score=score)
                per[name].append(g.stats)
                forwards[name].append(cost.take())
                same[name] += g.new_ids == ref.new_ids
            for name, k in oracles.items():
                g = oracle_speculative(pair, p, ref.new_ids, k, n, cost)
                g.stats.wall_ms = math.nan  # its clock includes decoding the target's continuations it knows
                per[name].append(g.stats)
                forwards[name].append(cost.take())
                same[name] += g.new_ids == ref.new_ids
            for name, rule in trees.items():
                g = generate_tree(pair, p, rule, n, cost)
                per[name].append(g.stats)
                forwards[name].append(cost.take())
                same[name] += g.new_ids == ref.new_ids
        base = per[TARGET_ONLY]
        rows = {name: summarise(stats, base, same[name], cfg.bootstrap) for name, stats in per.items()
                if name != TARGET_ONLY}
        first = next(iter(methods))  # every rule against the first one listed, paired by prompt
        for name in [*methods, *oracles, *trees]:
            rows[name]["versus_first_rule"] = {
                field: {"ratio": ratio(per[name], per[first], attr),
                        "interval": interval(per[name], per[first], attr, cfg.bootstrap)}
                for field, attr in (("modelled", "model_ms"), ("wall", "wall_ms"))
                if all(math.isfinite(getattr(s, attr)) for s in per[name])}
        per_prompt = {name: [[s.new_tokens, s.model_ms, s.wall_ms] for s in stats] for name, stats in per.items()}
        for name in rows:  # target tokens fed per token committed: what a tree's width costs
            rows[name]["target_tokens_fed_per_token"] = sum(s.target_tokens_fed for s in per[name]) / max(
                sum(s.new_tokens for s in per[name]), 1)
        result["domains"][domain] = {"prompts": len(prompts), "methods": rows,
                                     "per_prompt": per_prompt,  # [new tokens, modelled ms, wall ms] per prompt
                                     "profiles": {spec: priced(per, forwards, profile, first, cfg.bootstrap)
                                                  for spec, profile in profiles.items()}}
    chosen = f"geometric mean over domains of the modelled speedup, {cfg.split} prompts" + (
        "" if cfg.split == "validation" else " (a test split reports; choose on validation)")
    result["geomean_modelled"] = geomeans(result, [*methods, *oracles, *trees], lambda d: d["methods"])
    best = max(methods, key=result["geomean_modelled"].get)
    result["best_rule"] = {"name": best, "rule": ":".join(str(x) for x in methods[best]), "chosen_by": chosen}
    if trees:
        result["best_tree"] = best_tree(result, methods, trees, best, lambda d: d["methods"], cfg.bootstrap, per_name="")
    result["profiles"] = {}
    for spec in profiles:
        rows = lambda d, spec=spec: d["profiles"][spec]
        means = geomeans(result, [*methods, *oracles, *trees], rows)
        chain = max(methods, key=means.get)
        result["profiles"][spec] = {"geomean_modelled": means, "best_rule": chain,
                                    "best_tree": best_tree(result, methods, trees, chain, rows, cfg.bootstrap, spec)
                                    if trees else None}
    return result


def priced(per: dict[str, list[DecodeStats]], forwards: dict[str, list], cost: CostModel, first: str,
           resamples: int) -> dict:
    """Every method's modelled speedup over target only, and ratio to ``first``, with the forwards priced by ``cost``."""
    stats = {}
    for name, runs in per.items():
        stats[name] = [s.copy() for s in runs]
        for s, calls in zip(stats[name], forwards[name]):
            s.model_ms = price(calls, cost)
    base = stats[TARGET_ONLY]
    return {name: {"speedup": ratio(runs, base, "model_ms"), "interval": interval(runs, base, "model_ms", resamples),
                   "versus_first_rule": {"ratio": ratio(runs, stats[first], "model_ms"),
                                         "interval": interval(runs, stats[first], "model_ms", resamples)},
                   "per_prompt_ms": [s.model_ms for s in runs]}
            for name, runs in stats.items() if name != TARGET_ONLY}


def geomeans(result: dict, names: list[str], rows) -> dict[str, float]:
    """The geometric mean over domains of each method's modelled speedup (``rows(domain)[name]["speedup"]`` or its
    ``["modelled"]["speedup"]``)."""
    def speedup(row: dict) -> float:
        return row["modelled"]["speedup"] if "modelled" in row else row["speedup"]

    domains = result["domains"].values()
    return {name: math.exp(np.mean([math.log(speedup(rows(d)[name])) for d in domains])) for name in names}


def best_tree(result: dict, methods: dict, trees: dict, chain: str, rows, resamples: int, per_name: str) -> dict:
    """The tree rule of the highest geometric-mean modelled speedup, and per domain its ratio to the best chain rule
    ``chain``, paired by prompt (modelled: the machine's tables, or the profile ``per_name``)."""
    means = geomeans(result, list(trees), rows)
    tree = max(trees, key=means.get)
    out = {"name": tree, "best_chain_rule": chain, "versus_best_chain": {}}
    for domain, d in result["domains"].items():
        tok = np.array([x[0] for x in d["per_prompt"][tree]], dtype=float)
        if per_name:
            a, b = np.array(d["profiles"][per_name][tree]["per_prompt_ms"]), np.array(d["profiles"][per_name][chain]["per_prompt_ms"])
        else:
            a, b = (np.array([x[1] for x in d["per_prompt"][name]], dtype=float) for name in (tree, chain))
        btok = np.array([x[0] for x in d["per_prompt"][chain]], dtype=float)
        out["versus_best_chain"][domain] = _paired(tok, a, btok, b, resamples)
    return out


def _paired(tok, ms, btok, bms, resamples: int) -> dict:
    """The ratio of tokens per ms (``tok``/``ms`` over ``btok``/``bms``) and its 95% bootstrap interval over prompts."""
    value = (tok.sum() / ms.sum()) / (btok.sum() / bms.sum())
    if resamples == 0 or len(tok) < 2:
        return {"ratio": float(value), "interval": None}
    idx = np.random.default_rng(0).integers(0, len(tok), size=(resamples, len(tok)))
    ratios = (tok[idx].sum(1) / ms[idx].sum(1)) / (btok[idx].sum(1) / bms[idx].sum(1))
    return {"ratio": float(value), "interval": [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]}


def report(result: dict) -> str:
    lines = [f"{result['machine']}; {result['dtype']}; {result['config']['split']} prompts; modelled by "
             f"{result.get('cost_profile_label') or 'this machine cost model'}"]
    for domain, d in result["domains"].items():
        rows = d["methods"]
        token = next((r for name, r in rows.items() if "stop<" in name), None)
        oracle = next((r for name, r in rows.items() if name.startswith("oracle")), None)
        lines += [f"\n{domain}: {d['prompts']} prompts",
                  "| method | modelled speedup (95% CI) | wall speedup (95% CI) | against the first rule, wall (95% CI) | "
                  "acceptance | tokens/target fwd | draft fwd/token | room | same |", "|---|---|---|---|---|---|---|---|---|"]
        for name, r in rows.items():
            m, w = r["modelled"], r["wall"]
            room = ""
            if token and oracle and oracle["modelled"]["speedup"] > token["modelled"]["speedup"]:
                room = f"{(m['speedup'] - token['modelled']['speedup']) / (oracle['modelled']['speedup'] - token['modelled']['speedup']):+.0%}"
            ci = lambda x: f" ({x['interval'][0]:.2f}-{x['interval'][1]:.2f})" if x["interval"] else ""
            acc = "n/a" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
            wall = "n/a" if w["speedup"] is None else f"{w['speedup']:.2f}x{ci(w)}"
            versus = r.get("versus_first_rule", {}).get("wall")
            versus = "n/a" if versus is None else f"{versus['ratio']:.3f}x{ci(versus)}"
            lines.append(f"| {name} | {m['speedup']:.3f}x{ci(m)} | {wall} | {versus} | {acc} | "
                         f"{r['tokens_per_target_forward']:.2f} | {r['draft_forwards_per_token']:.2f} | {room} | "
                         f"{r['same_as_target']:.2f} |")
    lines.append("\ngeometric mean of the modelled speedup over domains: " + ", ".join(
        f"{k} {v:.3f}x" for k, v in result["geomean_modelled"].items()))
    lines.append(f"best rule: {result['best_rule']['name']} ({result['best_rule']['chosen_by']})")
    for spec, tree in [("the machine's tables", result.get("best_tree"))] + [
            (spec, p["best_tree"]) for spec, p in result.get("profiles", {}).items()]:
        if spec in result.get("profiles", {}):
            means = result["profiles"][spec]["geomean_modelled"]
            lines.append(f"\npriced by {spec}: geometric mean of the modelled speedup over domains: "
                         + ", ".join(f"{k} {v:.3f}x" for k, v in means.items()))
        if tree:
            lines.append(f"best tree ({spec}): {tree['name']}, against the best chain rule {tree['best_chain_rule']}: "
                         + ", ".join(f"{d} {v['ratio']:.3f}x" + (f" ({v['interval'][0]:.3f}-{v['interval'][1]:.3f})"
                                                               if v["interval"] else "")
                                     for d, v in tree["versus_best_chain"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    return report_main(StopRulesConfig, argv, __doc__.split("\n\n")[0], check_config, run, report)


if __name__ == "__main__":
    from bild_env.command import run_command

    sys.exit(run_command("python -m scripts.analysis.stop_rules", main))
