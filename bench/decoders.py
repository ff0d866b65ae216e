"""Time the lossless decoders side by side on held-out prompts of each workload domain, in one run.

    python -m bench.decoders --pair tiny-random --threads 1
    python -m bench.decoders --pair smollm2 --dtype bfloat16 --domains prose code chat --prompts 12 \\
        --k 1 2 3 4 --fallback 0.35 0.45 --rollback 0.5 --hf --out bench_decoders.json
    python -m bench.decoders --pair smollm2 --pair-options draft=path/to/another/draft   # another draft, the preset's target
    python -m bench.decoders --pair smollm2 --dtype float32,bfloat16   # both dtypes in one run, and their ratio
    python -m bench.decoders --shapes opt --pair-options device=cuda     # OPT-125M / OPT-6.7B shapes, random weights

For each domain (``--domains``, from ``bild_env.prompts.domains``: prose, code, chat, long) the first
``--prompts`` prompts of its ``--split`` ("test" or "validation"; never "train") are decoded by every
method: target only; naive speculative decoding for each ``--k`` (and with ``--adaptive K:F`` its adaptive
length: at most K draft tokens, the draft stopping after one whose max probability is below F; ``K:F:cumulative``
stops once the product of the run's max probabilities is below F, SpecDec++'s rule); BiLD at
each ``--fallback`` with ``--rollback`` (lossless below ln 2 = 0.693 nats); with ``--hf`` Hugging Face assisted
generation with the same draft. Every method decodes the same prompts in the same order, interleaved per prompt (so drifts of
the machine hit all methods alike), after one warm-up generation each. After each prompt's generations the
draft (fed 1 token) and the target (fed 1 and k + 1 tokens) are timed at the prompt's length plus half
the new tokens: their ratio c (draft / target forward) and the verify ratio v (target fed k + 1 / fed 1)
give naive SD's limit: the tokens per target forward it measured (its accepted runs as they came, not independent
tokens) over one step's k draft forwards and one verification, in the target-only decoding's own time per token
(``bound_speedup``: the speedup with no time outside those forwards, against the baseline as it ran, its overhead
included); a measured speedup above it is warned about (a cost timed below what the decoding paid). Beside it, the
textbook limit at the measured acceptance a, (1 - a^(k+1)) / (1 - a) tokens per k c + v target forwards
(``limit_speedup``), which misses what acceptance in runs adds. The draft's greedy agreement with the target is read
teacher-forced along the target's own outputs (``draft_agreement``).

(Over 450 lines: one benchmark's options, checks, timing, per-domain report with its intervals and limits, and
table; what it times is the decoders' own code.)

``--tree`` adds tree speculation (``bild_env.decoding.tree``; ``N:D:W`` dynamic, ``3,2,1,1`` a fixed shape), its
target also timed fed each tree's most nodes plus the root (its "v"). Each row is also set against the fastest
naive SD row of its domain, paired by prompt ("against the fastest chain").

Each row: tokens/s, speedup over target only in the same run (95% bootstrap interval over the
prompts), acceptance (accepted / proposed draft tokens), tokens per target forward, c, the limit,
the share of prompts whose tokens equal target-only's ("same", 1.0 for lossless methods in float32;
bfloat16 near-ties may flip), and "overhead": the share of wall time outside model forwards. With several
dtypes (``--dtype float32,bfloat16``, the default on a CPU with native bfloat16) each runs the same
prompts, interleaved too: one table per dtype and domain, then a line of bfloat16/float32 tokens/s
ratios per domain. ``--out`` writes everything as JSON, with the machine in words. Random weights
(``--shapes opt``) give true forward timings but not true acceptance.
"""

from __future__ import annotations

import sys

import json
import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from agents.common.stats import ratio_interval
from bench.forwards import PRODUCTS, plans, use_products
from bild_env import generate_bild, generate_speculative, generate_target_only
from bild_env.cli import parse_dataclass, setup_logging
from bild_env.config import PairOptions
from bild_env.decoding.bild import MAX_DRAFT_LEN
from bild_env.decoding.costs import time_batched_grid
from bild_env.decoding.decoders import generate_hf_assisted, parse_stop_rule, stop_rule_name
from bild_env.decoding.stats import DecodeStats
from bild_env.decoding.tree import TreeRule, generate_tree, parse_tree_rule
from bild_env.command import UsageExit, parse_each
from bild_env.models.device import (
    DeviceError, cpu_has_native_bf16, default_device, log_dtype, machine_description, resolve_dtype,
    usable_device,
)
from bild_env.models.pairs import DEFAULT_PAIR, ModelPair, preset_names
from bild_env.models.smollm2 import greedy_acceptance
from bild_env.prompts.domains import DOMAINS, load_domain

# Architecture of facebook/opt-125m and facebook/opt-6.7b (from their config.json).
OPT_SHAPES = {"draft": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, ffn_dim=3072),
              "target": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, ffn_dim=16384)}
LOSSLESS_ROLLBACK = math.log(2)  # BiLD with a rollback threshold below this (nats) keeps the target's greedy output
HELD_OUT_SPLITS = ("test", "validation")
TARGET_ONLY = "target only"
HF_ASSISTED = "HF assisted"

logger = logging.getLogger(__name__)


@dataclass
class BenchConfig:
    pair: str = field(default=DEFAULT_PAIR, metadata={"help": "preset (ignored with --shapes opt)"})
    pair_options: PairOptions = field(default_factory=PairOptions, metadata={"help": (
        "how the pair loads, as the envs take it (train.py's --pair-options): e.g. draft=<folder> with the preset's "
        "target and tokenizer, device, lean, draft_vocab; the dtypes are --dtype's")})
    shapes: str = field(default="", metadata={"help": (
        '"opt": random-weight models of OPT-125M/OPT-6.7B shape (timings only)')})
    dtype: str | None = field(default=None, metadata={"help": (
        "comma-separated dtypes, one table each (default: float32,bfloat16 on a CPU with native bf16, else float32; "
        "float16 on cuda)")})
    domains: tuple[str, ...] = field(default=("prose", "code", "chat"), metadata={"help": (
        "prompt domains (prose, code, chat, long): one table each")})
    split: str = field(default="test", metadata={"help": 'held-out prompts: "test" or "validation"'})
    prompts: int = field(default=6, metadata={"help": (
        "prompts per domain (the first of the split; fewer where the split has fewer)")})
    prompt_tokens: int = field(default=32, metadata={"help": (
        "prose and code: tokens per prompt; chat: of the request (see bild_env.prompts.domains)")})
    max_new_tokens: int = 64
    k: tuple[int, ...] = field(default=(1, 2, 3), metadata={"help": (
        "naive speculative decoding's draft length(s): one row each")})
    adaptive: tuple[str, ...] = field(default=(), metadata={"help": (
        '"K:F" naive SD proposing at most K tokens, stopping after one with max prob < F ("K:F:cumulative": once the '
        "run's product of them < F): one row each")})
    tree: tuple[str, ...] = field(default=(), metadata={"help": (
        "tree speculation (bild_env.decoding.tree): N:D:W (dynamic: N nodes, depth D, width W) or a shape 3,2,1,1: "
        "one row each")})
    fallback: tuple[float, ...] = field(default=(0.45,), metadata={"help": (
        "BiLD's fallback threshold(s), probability: one row each")})
    rollback: float = field(default=0.5, metadata={"help": (
        "BiLD's rollback threshold, nats (below ln 2 = 0.693: lossless)")})
    hf: bool = field(default=False, metadata={"help": (
        "also Hugging Face assisted generation (target.generate(assistant_model=draft), its defaults)")})
    timing_repeats: int = field(default=3, metadata={"help": (
        "timed forwards of each model and size per prompt, for the cost ratio c")})
    bootstrap: int = field(default=2000, metadata={"help": (
        "resamples of the prompts for the speedup's 95% interval (0: none)")})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch's default)"})
    products: str = field(default="measured", metadata={"help": (
        "how the lean models' products read their weights: measured (per count of rows), packed or plain at every "
        "count (bench.forwards --products)")})
    out: str = field(default="", metadata={"help": "optional JSON file for the results"})


def check_config(cfg: BenchConfig) -> None:
    """Raise ValueError, saying what to give, for an option the run cannot use."""
    if cfg.pair_options.dtype:
        raise ValueError("give the dtypes to compare as --dtype (comma-separated, one table each), not "
                         "--pair-options dtype=...")
    if cfg.pair_options.device:
        usable_device(cfg.pair_options.device)  # a DeviceError naming the devices this machine has
    if cfg.products not in PRODUCTS:
        raise ValueError(f"--products must be one of {', '.join(PRODUCTS)}, got {cfg.products!r}")
    if cfg.shapes not in ("", "opt"):
        raise ValueError(f"--shapes {cfg.shapes!r}: the only shapes are 'opt'")
    if cfg.shapes == "opt" and (cfg.pair_options.draft or cfg.pair_options.target):
        raise ValueError("--pair-options draft=/target= and --shapes opt exclude each other: random-weight shapes have "
                         "no model folder")
    if not cfg.shapes and cfg.pair not in preset_names():
        raise ValueError(f"unknown --pair {cfg.pair!r}; choose one of {preset_names()}")
    unknown = [d for d in cfg.domains if d not in DOMAINS]
    if unknown or not cfg.domains:
        raise ValueError(f"unknown domain(s) {', '.join(unknown) or '(none given)'}; valid domains are: {', '.join(DOMAINS)}")
    if cfg.split not in HELD_OUT_SPLITS:
        raise ValueError(f"--split {cfg.split!r}: give a held-out split, one of {', '.join(HELD_OUT_SPLITS)}")
    for name in ("prompts", "prompt_tokens", "max_new_tokens", "timing_repeats"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.bootstrap < 0:
        raise ValueError(f"--bootstrap must be 0 (no interval) or more, got {cfg.bootstrap}")
    if not cfg.k or min(cfg.k) < 1:
        raise ValueError(f"--k: every draft length must be at least 1, got {list(cfg.k)}")
    adaptive_rows(cfg)
    tree_rules(cfg)
    if not cfg.fallback or not all(0.0 <= f <= 1.0 for f in cfg.fallback):
        raise ValueError(f"--fallback: every threshold must be a probability in [0, 1], got {list(cfg.fallback)}")
    if math.isnan(cfg.rollback) or cfg.rollback < 0:
        raise ValueError(f"--rollback must be a distance in nats >= 0 (below ln 2 = 0.693: lossless), got {cfg.rollback}")


def adaptive_rows(cfg: BenchConfig) -> list[tuple[int, float, str]]:
    """The ``(K, F, score)`` of ``--adaptive K:F[:cumulative] ...``; ValueError saying the form for a bad one."""
    return parse_each("--adaptive", cfg.adaptive, parse_stop_rule)


def tree_rules(cfg: BenchConfig) -> list[TreeRule]:
    """The rules of ``--tree N:D:W | 3,2,1,1 ...``; ValueError saying the forms for a bad one."""
    return parse_each("--tree", cfg.tree, parse_tree_rule)


def opt_shaped_pair(device: str | None, dtype: str | None) -> ModelPair:
    """OPT-125M/OPT-6.7B-shaped models with random weights (no download), on ``device``."""
    from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM

    from bild_env.models.tiny import TOKENIZER_DIR

    dev = torch.device(device) if device else default_device()
    dt = log_dtype(dtype, dev, "opt-shaped pair")
    models = {}
    for role, shape in OPT_SHAPES.items():
        config = OPTConfig(vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=shape["hidden_size"],
                           eos_token_id=50256, bos_token_id=50256, pad_token_id=1, **shape)
        with torch.device(dev):
            models[role] = OPTForCausalLM(config).to(dt).eval().requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    return ModelPair("opt-shapes", models["draft"], models["target"], tok, dev, dt, (), 2048, ("opt-125m-shape", "opt-6.7b-shape"))


def dtype_list(cfg: BenchConfig) -> list[str]:
    """The dtypes of ``cfg.dtype`` (comma-separated), or by default on a CPU both float32 and bfloat16 where
    bfloat16 is native (only float32 where torch would emulate it: ~30x slower), on CUDA float16."""
    if cfg.dtype:
        names = [d.strip() for d in cfg.dtype.split(",") if d.strip()]
        if not names:
            raise DeviceError(f"--dtype {cfg.dtype!r} names no dtype; give e.g. float32,bfloat16")
        return names
    dev = torch.device(cfg.pair_options.device) if cfg.pair_options.device else default_device()
    if dev.type == "cuda":
        return ["float16"]
    return ["float32", "bfloat16"] if cpu_has_native_bf16() else ["float32"]


def load_pairs(cfg: BenchConfig, dtypes: list[str | None]) -> list[ModelPair]:
    """One pair per distinct dtype: the preset's under ``cfg.pair_options`` (``PairOptions.load``, as the envs load
    it: another draft keeps the preset's target and tokenizer)."""
    pairs: list[ModelPair] = []
    for dtype in dtypes:
        if cfg.shapes == "opt":
            pair = opt_shaped_pair(cfg.pair_options.device, dtype)
        else:
            pair = cfg.pair_options.load(cfg.pair, dtype)
        use_products(pair, cfg.products)
        if all(pair.dtype != other.dtype for other in pairs):  # "auto" and its name are one run
            pairs.append(pair)
    return pairs


def load_workload(pair: ModelPair, cfg: BenchConfig) -> dict[str, list[list[int]]]:
    """The first ``cfg.prompts`` prompts of ``cfg.split`` per domain; ValueError when one leaves no room for the output."""
    workload = {}
    for domain in cfg.domains:
        prompts = load_domain(pair.tokenizer, domain, cfg.split, cfg.prompts, prompt_tokens=cfg.prompt_tokens)
        longest = max(map(len, prompts))
        if longest + cfg.max_new_tokens > pair.max_positions:
            raise ValueError(f"a {domain} prompt has {longest} tokens and --max-new-tokens is {cfg.max_new_tokens}, "
                             f"but the models take {pair.max_positions} positions: lower --max-new-tokens or drop "
                             f"{domain} from --domains")
        workload[domain] = prompts
    return workload


@dataclass(frozen=True)
class Method:
    """One decoder of the comparison: its row name, how to run it on a prompt, and what the limit needs."""

    name: str
    generate: Callable[[list[int]], object]  # prompt ids -> an object with .new_ids and .stats (DecodeStats)
    k: int | None = None  # naive SD's draft length (its limit speedup); None for the others
    lossless: bool = True
    nodes: int | None = None  # a tree's most nodes verified (its verification timed at nodes + 1 fed); None for the others


def methods(pair: ModelPair, cfg: BenchConfig) -> list[Method]:
    """Target only first (the baseline), then naive SD per k, BiLD per fallback, and HF assisted generation."""
    n = cfg.max_new_tokens
    out = [Method(TARGET_ONLY, lambda p: generate_target_only(pair, p, n))]
    for k in dict.fromkeys(cfg.k):
        out.append(Method(f"naive SD (k={k})", lambda p, k=k: generate_speculative(pair, p, k, n), k=k))
    for k, f, score in dict.fromkeys(adaptive_rows(cfg)):
        out.append(Method(stop_rule_name(k, f, score),
                          lambda p, k=k, f=f, score=score: generate_speculative(pair, p, k, n, confidence=f, score=score)))
    for rule in dict.fromkeys(tree_rules(cfg)):
        out.append(Method(rule.name, lambda p, rule=rule: generate_tree(pair, p, rule, n), nodes=rule.nodes))
    lossless = cfg.rollback < LOSSLESS_ROLLBACK
    for f in dict.fromkeys(cfg.fallback):
        name = f"BiLD ({f}/{cfg.rollback}{'' if lossless else ', lossy'})"
        bild = partial(generate_bild, pair, fallback=f, rollback=cfg.rollback, max_draft_len=MAX_DRAFT_LEN, max_new_tokens=n)
        out.append(Method(name, bild, lossless=lossless))
    if cfg.hf:
        out.append(Method(HF_ASSISTED, lambda p: generate_hf_assisted(pair, p, n)))
    return out


@dataclass
class DomainRecord:
    """What one pair's methods did on one domain's prompts, per prompt in order."""

    stats: dict[str, list[DecodeStats]] = field(default_factory=dict)  # method -> per prompt
    new_ids: dict[str, list[list[int]]] = field(default_factory=dict)  # method -> per prompt
    forward_ms: dict[str, list[float]] = field(default_factory=dict)  # "draft 1", "target 1", "target 3" -> per prompt
    timing: dict = field(default_factory=dict)  # the timing's round counts (rounds timed while the machine was busy)

    def add(self, name: str, generation) -> None:
        self.stats.setdefault(name, []).append(generation.stats)
        self.new_ids.setdefault(name, []).append(list(generation.new_ids))


def time_costs(pair: ModelPair, fed: tuple[int, ...], context: int, repeats: int, record: DomainRecord) -> None:
    """Median ms of the draft fed 1 token and of the target fed each of ``fed``, at ``context`` cached tokens."""
    for role, counts in (("draft", (1,)), ("target", fed)):  # one sequence, unmasked: as the one-request decoders run
        cells = [(1, f, context) for f in counts]
        for _, f, _, ms in time_batched_grid(getattr(pair, role), cells, pair.device, repeats, stats=record.timing,
                                             max_wait_s=0):
            record.forward_ms.setdefault(f"{role} {f}", []).append(ms)


def measure(cfg: BenchConfig, pairs: list[ModelPair], workload: dict[str, list[list[int]]]) -> dict:
    """Every method of every pair on every domain's prompts, interleaved per prompt; the JSON report."""
    runs = [methods(pair, cfg) for pair in pairs]
    first = next(iter(workload.values()))[0]
    for fns in runs:  # warm-up
        for m in fns:
            m.generate(first)
    fed = tuple(sorted({1, *(k + 1 for k in cfg.k), *(rule.nodes + 1 for rule in tree_rules(cfg))}))
    records: dict[str, list[DomainRecord]] = {}
    for domain, prompts in workload.items():
        records[domain] = [DomainRecord() for _ in pairs]
        for prompt in tqdm(prompts, desc=f"{domain} prompts"):
            for pair, fns, record in zip(pairs, runs, records[domain]):
                for m in fns:
                    record.add(m.name, m.generate(prompt))
                time_costs(pair, fed, len(prompt) + cfg.max_new_tokens // 2, cfg.timing_repeats, record)
    reports = []
    for i, (pair, fns) in enumerate(zip(pairs, runs)):
        domains = {d: domain_report(pair, fns, workload[d], records[d][i], cfg) for d in workload}
        reports.append({"pair": pair.name, "models": list(pair.ids), "device": str(pair.device),
                        "dtype": str(pair.dtype), "torch_threads": torch.get_num_threads(), "domains": domains})
    comparison = {d: compare({r["dtype"]: r["domains"][d]["results"] for r in reports}) for d in workload}
    return {"machine": machine_description(pairs[0].device), "config": asdict(cfg), "reports": reports,
            "plans": {str(p.dtype): plans(p) for p in pairs},
            "comparison": {d: line for d, line in comparison.items() if line}}


def domain_report(pair: ModelPair, fns: list[Method], prompts: list[list[int]], record: DomainRecord,
                  cfg: BenchConfig) -> dict:
    """Per-method rows of one domain, its forward times and cost ratio, and the draft's greedy agreement."""
    ms = {key: statistics.median(v) for key, v in record.forward_ms.items()}
    c = ms["draft 1"] / ms["target 1"]
    base = record.stats[TARGET_ONLY]
    reference = record.new_ids[TARGET_ONLY]
    chains = [m.name for m in fns if m.name.startswith("naive SD")]
    best_chain = max(chains, key=lambda name: _total(record.stats[name]).tokens_per_s) if chains else None
    results = {}
    for m in fns:
        per_prompt = record.stats[m.name]
        total = _total(per_prompt)
        row = {
            "tokens_per_s": total.tokens_per_s,
            "speedup": total.tokens_per_s / _total(base).tokens_per_s,
            "speedup_interval": None if m.name == TARGET_ONLY else
            ratio_interval(*_rates(per_prompt), cfg.bootstrap, base=_rates(base))["interval"],
            "acceptance_rate": total.acceptance_rate,
            "mean_accepted_length": total.mean_accepted_length,
            "cost_ratio": c,
            "verify_ratio": None, "limit_speedup": None, "limit_independent": None,
            "same_as_target": None if m.name == TARGET_ONLY else
            sum(a == b for a, b in zip(record.new_ids[m.name], reference)) / len(reference),
            "lossless": m.lossless,
            "overhead": None if m.name == HF_ASSISTED else total.overhead,
            "median_ms_per_prompt": statistics.median(s.wall_ms for s in per_prompt),
            "new_tokens": total.new_tokens,
            "versus_best_chain": None if best_chain in (None, m.name) or m.name == TARGET_ONLY else {
                "name": best_chain, "ratio": total.tokens_per_s / _total(record.stats[best_chain]).tokens_per_s,
                "interval": ratio_interval(*_rates(per_prompt), cfg.bootstrap,
                                           base=_rates(record.stats[best_chain]))["interval"]},
        }
        if m.k is not None and total.acceptance_rate is not None:
            row["verify_ratio"] = ms[f"target {m.k + 1}"] / ms["target 1"]
            row["limit_independent"] = limit_speedup(total.acceptance_rate, m.k, c, row["verify_ratio"])
            row["limit_speedup"] = bound_speedup(total.mean_accepted_length, m.k, ms["draft 1"], ms[f"target {m.k + 1}"],
                                                 1000.0 / _total(base).tokens_per_s)
            if row["speedup"] > 1.05 * row["limit_speedup"]:
                logger.warning(f"{m.name}: measured {row['speedup']:.2f}x, above its limit {row['limit_speedup']:.2f}x "
                               "by more than 5%: a forward of the decoding cost less than timed (warm caches, another "
                               "length), or the machine was busier while the target decoded alone")
        if m.nodes is not None:  # the widest verification's cost, in target forwards fed 1
            row["verify_ratio"] = ms[f"target {m.nodes + 1}"] / ms["target 1"]
        results[m.name] = row
    return {"prompts": len(prompts), "prompt_tokens_median": statistics.median(map(len, prompts)),
            "forward_ms": ms, "cost_ratio": c, "timing": record.timing,
            "draft_agreement": draft_agreement(pair, prompts, reference), "results": results}


def _total(stats: list[DecodeStats]) -> DecodeStats:
    total = DecodeStats()
    for s in stats:
        total += s
    return total


def limit_speedup(a: float, k: int, c: float, verify: float = 1.0) -> float:
    """Naive SD's speedup over target-only decoding when each of its ``k`` draft tokens is accepted with
    probability ``a`` independently: (1 - a^(k+1)) / (1 - a) tokens per step of k draft forwards (``c``
    target forwards each: the draft/target forward cost ratio) and one target forward fed k + 1 tokens
    (``verify`` target forwards fed 1; 1 where feeding more costs nothing), against one token per target
    forward."""
    tokens = k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
    return tokens / (k * c + verify)


def bound_speedup(tokens_per_forward: float, k: int, draft_ms: float, verify_ms: float,
                  target_ms_per_token: float) -> float:
    """Naive SD's speedup if a step took only its ``k`` draft forwards (``draft_ms`` each) and one verification
    (``verify_ms``: the target fed k + 1 tokens), committing ``tokens_per_forward`` tokens as measured (runs of
    accepted tokens as they came), against target-only decoding at ``target_ms_per_token`` as it ran."""
    return tokens_per_forward * target_ms_per_token / (k * draft_ms + verify_ms)


def _rates(stats: list[DecodeStats]) -> tuple[list[int], list[float]]:
    """Each prompt's tokens and wall ms: a speedup's rows for ``ratio_interval`` (prompts resampled together)."""
    return [s.new_tokens for s in stats], [s.wall_ms for s in stats]


@torch.inference_mode()
def draft_agreement(pair: ModelPair, prompts: list[list[int]], outputs: list[list[int]]) -> dict:
    """Teacher-forced greedy agreement of the draft with the target along the target's own outputs.

    One forward of each model over prompt + output; at every position whose next token a draft could
    propose (the output's second token on: the first comes from the target's prefill) the draft's argmax
    is compared with the target's (``greedy_acceptance`` keeping the logits of the output's positions; with
    all kept it counts the prompt's positions too). Returns ``agreement`` (matches / positions) and ``positions``.
    """
    pairs = [(prompt, new) for prompt, new in zip(prompts, outputs) if len(new) >= 2]
    got = greedy_acceptance(pair.draft, pair.target, [torch.tensor(p + new, device=pair.device) for p, new in pairs],
                            keep=[len(new) for _, new in pairs])
    return {"agreement": got["acceptance"] if got["positions"] else None, "positions": got["positions"]}


def compare(by_dtype: dict[str, dict], slow: str = "torch.float32", fast: str = "torch.bfloat16") -> str:
    """A line of ``fast``/``slow`` tokens/s ratios per method (target only first), or "" without both dtypes;
    ``by_dtype`` maps a dtype to one domain's results."""
    if slow not in by_dtype or fast not in by_dtype:
        return ""
    ratios = [f"{name} {by_dtype[fast][name]['tokens_per_s'] / r['tokens_per_s']:.2f}x"
              for name, r in by_dtype[slow].items() if r["tokens_per_s"]]
    return f"{fast.removeprefix('torch.')}/{slow.removeprefix('torch.')} tokens/s: " + ", ".join(ratios)


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def table(report: dict, domain: str) -> str:
    """One domain's rows of one report (a pair in one dtype), as a Markdown table under a header line."""
    d = report["domains"][domain]
    ms, agree = d["forward_ms"], d["draft_agreement"]["agreement"]
    lines = [f"{domain}: {d['prompts']} prompts, pair {report['pair']} on {report['device']} ({report['dtype']}, "
             f"{report['torch_threads']} threads); draft {ms['draft 1']:.1f} ms / target {ms['target 1']:.1f} ms per "
             f"1-token forward (c = {d['cost_ratio']:.3f}); draft greedy agreement {_num(agree, '.3f')}",
             "| method | tokens/s | speedup (95% CI) | acceptance | tokens/target fwd | limit speedup (v) | at independent "
             "acceptance | same as target | overhead | against the fastest chain (95% CI) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in d["results"].items():
        ci = r["speedup_interval"]
        speedup = f"{r['speedup']:.2f}x" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")
        limit = "" if r["limit_speedup"] is None else f"{r['limit_speedup']:.2f}x ({r['verify_ratio']:.2f})"
        limit = f"({r['verify_ratio']:.2f})" if r["limit_speedup"] is None and r["verify_ratio"] else limit
        chain, versus = r["versus_best_chain"], ""
        if chain:
            ci = chain["interval"]
            versus = f"{chain['ratio']:.2f}x" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")
        overhead = "n/a" if r["overhead"] is None else f"{100 * r['overhead']:.1f}%"
        same = "" if r["same_as_target"] is None else f"{r['same_as_target']:.2f}"
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {speedup} | {_num(r['acceptance_rate'], '.2f')} | "
                     f"{r['mean_accepted_length']:.2f} | {limit} | "
                     f"{'' if r.get('limit_independent') is None else format(r['limit_independent'], '.2f') + 'x'} | "
                     f"{same} | {overhead} | {versus} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    import argparse

    from bild_env.migrate import refuse_moved

    setup_logging()
    refuse_moved(argparse.ArgumentParser(prog="python -m bench.decoders"), argv, BenchConfig)  # --draft, --lean...
    cfg = parse_dataclass(BenchConfig, argv, __doc__)
    try:
        check_config(cfg)
    except ValueError as err:
        raise UsageExit(f"python -m bench.decoders: {err}") from None
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        dtypes = dtype_list(cfg)
        dev = usable_device(cfg.pair_options.device or None)
        for d in dtypes:
            resolve_dtype(d, dev)
        pairs = load_pairs(cfg, dtypes)
    except DeviceError as err:  # PairError is one
        raise UsageExit(f"python -m bench.decoders: {err}") from None
    try:
        workload = load_workload(pairs[0], cfg)
    except ValueError as err:
        raise UsageExit(f"python -m bench.decoders: {err}") from None
    out = measure(cfg, pairs, workload)
    print(f"machine: {out['machine']}")
    for domain in workload:
        print("\n" + "\n\n".join(table(r, domain) for r in out["reports"]))
        if domain in out["comparison"]:
            print(out["comparison"][domain])
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    from bild_env.command import run_command

    sys.exit(run_command("python -m bench.decoders", main))
