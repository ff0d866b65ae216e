"""``python -m distill lookup``: fit the lookup acceptance predictor and compare it with the max probability.

    python -m distill lookup --pair smollm2 --out results/acceptance_lookup_smollm2.json
    python -m distill lookup --pair tiny-random --train-prompts 3 --eval-prompts 2 --max-new-tokens 12   # seconds

1. Collect (``distill.positions``, cached: the target's greedy continuations
   of TRAIN, VALIDATION and TEST prompts of every domain, both models teacher-forced; the label is draft proposal ==
   target argmax). The context of row r is the prompt and the continuation's first r tokens (the target's argmax
   after the prompt, then its teacher-forced argmax at each row: the continuation up to bfloat16 near-ties).
2. Fit ``bild_env.models.lookup.LookupPredictor`` (a logistic regression on the max probability and the context's
   n-gram lookups) on TRAIN positions of every domain.
3. Report per domain on VALIDATION and once on TEST, over every position and over the continuations' first
   ``early`` tokens (where a short answer lives): AUC, expected calibration error and Brier score, beside the
   max probability's; and the predictor's cost per call beside a draft forward, on one thread.
   ``unseen_domains`` (default the long inputs) are reported beside them, never fitted on nor adopted by.
4. Adopt it only if its VALIDATION AUC over every position beats the max probability's in every domain: then it is
   written beside the draft (``LOOKUP_FILE``, read by ``lookup_for``), else into the cache (``--lookup-out``
   overrides both).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from bild_env.cli import report_main
from bild_env.decoding.kv import Row, crop_cache, single_forward
from bild_env.models.device import machine_description
from bild_env.models.draft_head import proposal_logits
from bild_env.models.lookup import (FEATURES, NGRAMS, LookupPredictor, context_features, draft_key, lookup_path,
                                    save_lookup)
from bild_env.models.pairs import DEFAULT_PAIR, ModelPair, check_held_out, load_pair
from bild_env.prompts.domains import load_domain
from distill.positions import PositionsConfig, collect, scores
from distill.positions import check_config as check_positions

SPLITS = ("train", "validation", "test")


@dataclass
class LookupConfig:
    pair: str = field(default=DEFAULT_PAIR, metadata={"help": (
        "the pair whose draft gets a lookup predictor (its default draft vocabulary and dtype)")})
    domains: tuple[str, ...] = ("prose", "code", "chat")
    unseen_domains: tuple[str, ...] = field(default=("long",), metadata={"help": (
        "reported on VALIDATION and TEST, never fitted or adopted on")})
    train_prompts: int = field(default=224, metadata={"help": (
        "TRAIN prompts per domain (distill.positions: the cached positions)")})
    eval_prompts: int = field(default=24, metadata={"help": "VALIDATION and TEST prompts per domain"})
    max_new_tokens: int = field(default=192, metadata={"help": "tokens the target continues each prompt by"})
    batch: int = field(default=48, metadata={"help": "prompts per batched greedy forward"})
    max_block: int = field(default=8, metadata={"help": (
        "distill.positions' simulated draft blocks (part of its cache key; not read here)")})
    seed: int = 0
    early: int = field(default=64, metadata={"help": "also report over the continuations' first `early` tokens"})
    weight_decay: float = field(default=1e-4, metadata={"help": (
        "L2 penalty of the logistic regression (standardised features)")})
    threads: int = field(default=1, metadata={"help": "torch threads (timings always on one)"})
    timing_repeats: int = field(default=300, metadata={"help": "draft forwards and predictor calls timed (medians)"})
    lookup_out: str = field(default="", metadata={"help": (
        'where the predictor goes ("": beside the draft if adopted, else the cache)')})
    out: str = field(default="", metadata={"help": "results JSON"})


def positions_config(cfg: LookupConfig) -> PositionsConfig:
    return PositionsConfig(pair=cfg.pair, domains=cfg.domains, train_prompts=cfg.train_prompts,
                            eval_prompts=cfg.eval_prompts, max_new_tokens=cfg.max_new_tokens, batch=cfg.batch,
                            max_block=cfg.max_block, seed=cfg.seed)


def check_config(cfg: LookupConfig) -> None:
    check_positions(positions_config(cfg))
    if cfg.unseen_domains:
        check_held_out(cfg.pair, cfg.unseen_domains, "test")
    if set(cfg.unseen_domains) & set(cfg.domains):
        raise ValueError(f"--unseen-domains {list(cfg.unseen_domains)} must not be among --domains {list(cfg.domains)}")
    if cfg.early < 1 or cfg.weight_decay < 0 or cfg.timing_repeats < 1:
        raise ValueError("--early and --timing-repeats must be at least 1 and --weight-decay >= 0")


@torch.inference_mode()
def context_rows(pair: ModelPair, cfg: LookupConfig, domain: str, split: str) -> dict[str, np.ndarray]:
    """``FEATURES`` (N, F), labels, each row's place in its continuation (1, 2, ...), its proposal and the token before
    it, the other per-position numbers ``collect`` keeps (``extra``: entropy, margin, depth, ...) and each prompt's
    text (``texts``: prompt index -> the prompt and the continuation the rows read) for ``domain``'s ``split``."""
    data = collect(pair, positions_config(cfg), domain, split)
    limit = cfg.train_prompts if split == "train" else cfg.eval_prompts
    prompts = load_domain(pair.tokenizer, domain, split, limit)
    which, argmax, proposal = data["prompt"].numpy(), data["target_argmax"].numpy(), data["proposal"].numpy()
    features = np.zeros((len(which), len(FEATURES)), dtype=np.float32)
    features[:, 0] = data["max_prob"].numpy()
    place, last = np.zeros(len(which), dtype=np.int64), np.zeros(len(which), dtype=np.int64)
    texts = {}
    for i in tqdm(np.unique(which), desc=f"{domain}/{split}: lookups", unit="prompt", leave=False):
        rows = np.flatnonzero(which == i)
        ids = torch.tensor([prompts[i]], device=pair.device)
        first = int(pair.target(ids, logits_to_keep=1).logits[0, -1].argmax())
        text = np.array([*prompts[i], first, *argmax[rows]], dtype=np.int64)
        start = len(prompts[i]) + 1  # row r's context: the prompt and the continuation's first r tokens
        for r, row in enumerate(rows):
            features[row, 1:] = context_features(text[: start + r], int(proposal[row]))
        place[rows] = np.arange(1, len(rows) + 1)
        last[rows] = text[start - 1: start - 1 + len(rows)]
        texts[int(i)] = text
    extra = {k: v.float().numpy() for k, v in data.items()
             if torch.is_tensor(v) and v.dim() == 1 and v.is_floating_point() and k not in ("max_prob", "label")}
    return {"features": features, "label": data["label"].numpy(), "place": place, "prompts": int(data["prompts"]),
            "proposal": proposal, "last": last, "prompt": which, "extra": extra, "texts": texts}


def fit(x: np.ndarray, y: np.ndarray, weight_decay: float) -> tuple[np.ndarray, float]:
    """Logistic regression on ``x`` (N, F) standardised, by L-BFGS with an L2 penalty; returns the raw weights
    and bias (the standardisation folded in)."""
    xt, yt = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    mean, std = xt.mean(0), xt.std(0).clamp_min(1e-6)
    z = (xt - mean) / std
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimiser = torch.optim.LBFGS([w, b], max_iter=500, line_search_fn="strong_wolfe")

    def closure():
        optimiser.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z @ w + b, yt) + weight_decay * (w @ w)
        loss.backward()
        return loss

    with torch.enable_grad():
        optimiser.step(closure)
    raw = (w / std).detach()
    return raw.numpy(), float((b - (raw * mean).sum()).detach())


def evaluate(predictor: LookupPredictor, rows: dict[str, dict], cfg: LookupConfig) -> dict[str, dict]:
    out = {}
    for domain, r in rows.items():
        x, y = r["features"], r["label"]
        p = predictor.probabilities(x)
        early = r["place"] <= cfg.early
        out[domain] = {"positions": int(len(y)), "prompts": r["prompts"], "accepted": float(y.mean()),
                       "lookup": scores(p, y), "max_prob": scores(x[:, 0], y),
                       "early": {"positions": int(early.sum()), "lookup": scores(p[early], y[early]),
                                 "max_prob": scores(x[early, 0], y[early])},
                       "lookup_agrees": float((x[:, 1:1 + len(NGRAMS)] > 0).any(1).mean())}  # a lookup proposes it
    return out


@torch.inference_mode()
def time_predictor(pair: ModelPair, predictor: LookupPredictor, repeats: int) -> dict[str, float]:
    """Median ms of a draft forward fed one token after 64 cached ones and of the predictor scoring a proposal after
    contexts of 96 and 224 tokens (prompt 32 + 64 / 192 new), interleaved, on one thread."""
    from transformers import DynamicCache

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    contexts = {n: list(rng.integers(0, 1000, n)) for n in (96, 224)}
    try:
        cache = DynamicCache(config=pair.draft.config)
        single_forward(pair.draft, Row(list(range(10, 74)), cache, 1))
        times: dict[str, list[float]] = {"draft_forward_ms": [], "lookup_ms_96": [], "lookup_ms_224": []}
        for _ in tqdm(range(repeats), desc="timing", unit="call", leave=False):
            t0 = time.perf_counter()
            with proposal_logits(pair.draft):
                single_forward(pair.draft, Row([42], cache, 1))
            times["draft_forward_ms"].append((time.perf_counter() - t0) * 1e3)
            crop_cache(cache, 64)
            for n, context in contexts.items():
                t0 = time.perf_counter()
                predictor.probability(0.5, context, 7)
                times[f"lookup_ms_{n}"].append((time.perf_counter() - t0) * 1e3)
    finally:
        torch.set_num_threads(threads)
    result = {k: statistics.median(v) for k, v in times.items()}
    result["lookup_per_draft_forward"] = result["lookup_ms_224"] / result["draft_forward_ms"]
    return result


def run(cfg: LookupConfig) -> dict:
    check_config(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    pair = load_pair(cfg.pair)
    data = {s: {d: context_rows(pair, cfg, d, s) for d in cfg.domains + (() if s == "train" else cfg.unseen_domains)}
            for s in SPLITS}
    x = np.concatenate([data["train"][d]["features"] for d in cfg.domains])
    y = np.concatenate([data["train"][d]["label"] for d in cfg.domains])
    weights, bias = fit(x, y, cfg.weight_decay)
    key = draft_key(pair.fingerprints[0], pair.draft_vocab)
    predictor = LookupPredictor(tuple(weights), bias, key, {"train_positions": int(len(y)), "pair": cfg.pair,
                                                            "max_new_tokens": cfg.max_new_tokens})
    validation = evaluate(predictor, data["validation"], cfg)
    margins = {d: validation[d]["lookup"]["auc"] - validation[d]["max_prob"]["auc"] for d in cfg.domains}  # seen only
    adopted = all(m > 0 for m in margins.values())
    saved = save_lookup(predictor, cfg.lookup_out or lookup_path(pair, adopted))
    return {
        "machine": machine_description(pair.device), "dtype": str(pair.dtype), "pair": cfg.pair, "pair_key": pair.key,
        "config": asdict(cfg), "features": list(FEATURES),
        "weights": dict(zip(FEATURES, weights.tolist())), "bias": bias,
        "train_positions": {d: int(len(data["train"][d]["label"])) for d in cfg.domains},
        "validation": validation, "test": evaluate(predictor, data["test"], cfg),
        "validation_auc_margin": margins, "adopted": adopted, "lookup_file": str(saved),
        "cost": time_predictor(pair, predictor, cfg.timing_repeats),
    }


def report(result: dict) -> str:
    early = result["config"]["early"]
    lines = [f"{result['machine']}; {result['dtype']}; pair {result['pair']}",
             f"{'split':<11}{'domain':<7}{'n':>7}   {'AUC lookup / max':>17}   {'first ' + str(early) + ' tokens':>17}"
             f"   {'ECE lookup / max':>17}   {'Brier lookup / max':>19}"]
    for split in ("validation", "test"):
        for domain, row in result[split].items():
            h, m, e = row["lookup"], row["max_prob"], row["early"]
            lines.append(f"{split:<11}{domain:<7}{row['positions']:>7}   {h['auc']:.4f} / {m['auc']:.4f}   "
                         f"{e['lookup']['auc']:.4f} / {e['max_prob']['auc']:.4f}   "
                         f"{h['ece']:.4f} / {m['ece']:.4f}   {h['brier']:.4f} / {m['brier']:.4f}")
    cost = result["cost"]
    lines.append(f"lookup {cost['lookup_ms_224'] * 1e3:.0f} us after 224 tokens per draft forward of "
                 f"{cost['draft_forward_ms']:.3f} ms ({100 * cost['lookup_per_draft_forward']:.1f}%); adopted: "
                 f"{result['adopted']} (validation AUC margins "
                 f"{', '.join(f'{d} {m:+.4f}' for d, m in result['validation_auc_margin'].items())}); "
                 f"at {result['lookup_file']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    return report_main(LookupConfig, argv, __doc__.split("\n\n")[0], check_config, run, report)
