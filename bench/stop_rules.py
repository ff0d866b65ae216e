"""When should the draft stop? Naive SD's stopping rules side by side, and the room a perfect predictor leaves.

    python -m bench.stop_rules --split validation --rules 8:0.5 8:0.2:cumulative 8:0.1:cumulative --out val.json
    python -m bench.stop_rules --split test --rules 8:0.5 8:0.2:cumulative --out test.json   # once, the chosen rule
    python -m bench.stop_rules --pair tiny-random --prompts 2 --max-new-tokens 8              # seconds, a smoke run

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
Every rule is also compared with the first rule listed, paired by prompt (``versus_first_rule``: the ratio of their
speeds and its bootstrap interval, modelled and wall), and each prompt's tokens and times are kept (``per_prompt``).
With each: the 95% bootstrap interval over prompts, acceptance, tokens per target forward and draft forwards per
token. ``room`` in the report: the share of the oracle's gain over the token rule that each rule recovers.
"""

from __future__ import annotations

import sys

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch
from tqdm import tqdm

from bild_env import generate_speculative, generate_target_only, load_pair
from bild_env.cli import report_main
from bild_env.decoding.costs import load_or_calibrate
from bild_env.decoding.decoders import _result, _start, parse_stop_rule, stop_rule_name, verify_drafts
from bild_env.decoding.stats import DecodeStats
from bild_env.models.device import machine_description
from bild_env.models.pairs import DEFAULT_PAIR, check_held_out
from bild_env.prompts.domains import load_domain

TARGET_ONLY = "target only"


@dataclass
class StopRulesConfig:
    pair: str = DEFAULT_PAIR
    dtype: str | None = None  # default: the preset's (auto: bfloat16 on a CPU with native bf16, else float32)
    domains: tuple[str, ...] = ("prose", "code", "chat")
    split: str = "validation"  # validation chooses a rule; test reports it, once
    prompts: int = 16  # per domain (fewer where the split has fewer)
    max_new_tokens: int = 64
    rules: tuple[str, ...] = ("8:0.5", "8:0.1:cumulative", "8:0.2:cumulative", "8:0.3:cumulative")  # K:F[:cumulative]
    oracle: tuple[int, ...] = (8,)  # K of the perfect predictor's runs (none: leave it out)
    threads: int = 1
    bootstrap: int = 2000
    out: str = ""


def check_config(cfg: StopRulesConfig) -> None:
    check_held_out(cfg.pair, cfg.domains, cfg.split)
    if cfg.prompts < 1 or cfg.max_new_tokens < 2:
        raise ValueError("--prompts must be at least 1 and --max-new-tokens at least 2")
    if not cfg.rules:
        raise ValueError("--rules: give at least one rule, e.g. 8:0.5 8:0.2:cumulative")
    for rule in cfg.rules:
        try:
            parse_stop_rule(rule)
        except ValueError as err:
            raise ValueError(f"--rules {err}") from None
    if any(k < 1 for k in cfg.oracle):
        raise ValueError(f"--oracle: every K must be at least 1, got {list(cfg.oracle)}")


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
    run = _start(pair, prompt, max_new_tokens, cost_model)
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
    return _result(pair, run, counts)


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
    pair = load_pair(cfg.pair, dtype=cfg.dtype)
    cost = cost_model or load_or_calibrate(pair)
    n = cfg.max_new_tokens
    methods = {stop_rule_name(*parse_stop_rule(r)): parse_stop_rule(r) for r in cfg.rules}
    oracles = {f"oracle (k<={k})": k for k in dict.fromkeys(cfg.oracle)}
    result = {"machine": machine_description(pair.device), "dtype": str(pair.dtype), "config": asdict(cfg),
              "domains": {}}
    for domain in cfg.domains:
        prompts = load_domain(pair.tokenizer, domain, cfg.split, cfg.prompts)
        per = {name: [] for name in [TARGET_ONLY, *methods, *oracles]}
        same = dict.fromkeys(per, 0)
        for p in tqdm(prompts, desc=f"{domain} prompts", unit="prompt"):
            ref = generate_target_only(pair, p, n, cost)
            per[TARGET_ONLY].append(ref.stats)
            for name, (k, f, score) in methods.items():
                g = generate_speculative(pair, p, k, n, cost, confidence=f, score=score)
                per[name].append(g.stats)
                same[name] += g.new_ids == ref.new_ids
            for name, k in oracles.items():
                g = oracle_speculative(pair, p, ref.new_ids, k, n, cost)
                g.stats.wall_ms = math.nan  # its clock includes decoding the target's continuations it knows
                per[name].append(g.stats)
                same[name] += g.new_ids == ref.new_ids
        base = per[TARGET_ONLY]
        rows = {name: summarise(stats, base, same[name], cfg.bootstrap) for name, stats in per.items()
                if name != TARGET_ONLY}
        first = next(iter(methods))  # every rule against the first one listed, paired by prompt
        for name in [*methods, *oracles]:
            rows[name]["versus_first_rule"] = {
                field: {"ratio": ratio(per[name], per[first], attr),
                        "interval": interval(per[name], per[first], attr, cfg.bootstrap)}
                for field, attr in (("modelled", "model_ms"), ("wall", "wall_ms"))
                if all(math.isfinite(getattr(s, attr)) for s in per[name])}
        per_prompt = {name: [[s.new_tokens, s.model_ms, s.wall_ms] for s in stats] for name, stats in per.items()}
        result["domains"][domain] = {"prompts": len(prompts), "methods": rows,
                                     "per_prompt": per_prompt}  # [new tokens, modelled ms, wall ms] per prompt
    names = [*methods, *oracles]
    result["geomean_modelled"] = {
        name: math.exp(np.mean([math.log(result["domains"][d]["methods"][name]["modelled"]["speedup"])
                                for d in cfg.domains])) for name in names}
    best = max(methods, key=result["geomean_modelled"].get)
    result["best_rule"] = {"name": best, "rule": ":".join(str(x) for x in methods[best]),
                           "chosen_by": f"geometric mean over domains of the modelled speedup, {cfg.split} prompts"
                                        + ("" if cfg.split == "validation" else " (a test split reports; choose on validation)")}
    return result


def report(result: dict) -> str:
    lines = [f"{result['machine']}; {result['dtype']}; {result['config']['split']} prompts"]
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
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    return report_main(StopRulesConfig, argv, __doc__.split("\n\n")[0], check_config, run, report)


if __name__ == "__main__":
    from bild_env.errors import run_command

    sys.exit(run_command("python -m bench.stop_rules", main))
