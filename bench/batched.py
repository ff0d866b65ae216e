"""The batched decoder against one request at a time, on the clock: ms per step and where a step's time goes.

    python -m bench.batched --pair tiny-random --batch 8 --max-new-tokens 32
    python -m bench.batched --pair tiny-random --layout     # padded cache vs per-request caches, ms per forward

For each method (``bild``: fixed thresholds; ``sd``: naive speculative decoding, k drafts; ``off``:
target only) the same prompts (the pair's test prompts, cut to ``--prompt-tokens``, so their lengths
differ; used again, shorter, where there are fewer than ``--batch``) are decoded by ``BatchedDecoder`` as one batch and one at a time by the batch-1 decoders
(``generate_bild``, ``generate_speculative``, ``generate_target_only``); every output is checked equal.
Reported: wall ms per batched step, tokens per second both ways, and the batched step's time split
into model forwards, readouts (vocabulary-wide max and log-sum-exp over the logits: the rules'
inputs) and bookkeeping (the rest: the decoder's own work), as shares of the step. The batch-1
decoders count their readouts inside their forward time, so their "overhead" is bookkeeping only.

``--layout`` times one batched forward of ``--batch`` requests with 40 to 120 cached tokens, fed 1 and
4 tokens each, with the padded cache (``padded.PaddedCache``) and with one cache per request
(``kv.batched_forward``), beside ``--batch`` batch-of-one forwards (the table in
``bild_env/decoding/batched.py``). Writes JSON (``--out``).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bild_env import generate_bild, generate_speculative, generate_target_only, load_pair
from bild_env.cli import parse_dataclass
from bild_env.decoding.batched import BatchedDecoder, _feed
from bild_env.decoding.bild import FIXED_FALLBACK, FIXED_ROLLBACK
from bild_env.decoding.kv import Row, batched_forward, crop_cache
from bild_env.decoding.padded import PaddedCache
from bild_env.models.device import machine_description
from bild_env.models.pairs import get_preset
from bild_env.prompts import load_prompts


@dataclass
class BenchConfig:
    """Options of ``python -m bench.batched``."""

    pair: str = "tiny-random"  # a preset (bild_env.models.pairs)
    device: str = "cpu"
    batch: int = 8  # requests decoded together
    prompt_tokens: int = 64  # prompts cut to at most this many tokens (shorter paragraphs stay shorter)
    max_new_tokens: int = 32
    methods: str = "bild,sd,off"  # comma-separated: bild, sd, off
    k: int = 4  # drafts per naive SD round
    fallback: float = FIXED_FALLBACK
    rollback: float = FIXED_ROLLBACK
    threads: int = 1  # torch threads
    layout: bool = False  # time the two cache layouts instead
    repeats: int = 100  # forwards per layout cell (median)
    out: str = "results/bench_batched.json"


def _batched(pair, prompts, cfg: BenchConfig, method: str) -> dict:
    decoder = BatchedDecoder(pair)
    t0 = time.perf_counter()
    ids = decoder.join(prompts, cfg.max_new_tokens)
    steps = []
    while len(decoder):
        if method == "bild":
            decoder.step(cfg.fallback, cfg.rollback)
        elif method == "sd":
            decoder.step_speculative(cfg.k)
        else:
            decoder.step(off=True)
        steps.append(decoder.last_step)
    wall = (time.perf_counter() - t0) * 1000.0
    outputs = [decoder.finished[i].new_ids for i in ids]
    total = {name: sum(getattr(s, name) for s in steps) for name in ("wall_ms", "forward_ms", "readout_ms")}
    return {
        "outputs": outputs, "steps": len(steps), "wall_ms": wall,
        "tokens_per_s": 1000.0 * sum(map(len, outputs)) / wall,
        "ms_per_step": total["wall_ms"] / len(steps),
        "forward_share": total["forward_ms"] / total["wall_ms"],
        "readout_share": total["readout_ms"] / total["wall_ms"],
        "bookkeeping_share": 1.0 - (total["forward_ms"] + total["readout_ms"]) / total["wall_ms"],
        "mean_rows": statistics.mean(s.rows for s in steps),
    }


def _alone(pair, prompts, cfg: BenchConfig, method: str) -> dict:
    t0 = time.perf_counter()
    gens = []
    for p in prompts:
        if method == "bild":
            gens.append(generate_bild(pair, p, cfg.fallback, cfg.rollback, max_new_tokens=cfg.max_new_tokens))
        elif method == "sd":
            gens.append(generate_speculative(pair, p, cfg.k, cfg.max_new_tokens))
        else:
            gens.append(generate_target_only(pair, p, cfg.max_new_tokens))
    wall = (time.perf_counter() - t0) * 1000.0
    forward = sum(g.stats.forward_ms for g in gens)
    return {"outputs": [g.new_ids for g in gens], "wall_ms": wall,
            "tokens_per_s": 1000.0 * sum(len(g.new_ids) for g in gens) / wall,
            "overhead_share": 1.0 - forward / sum(g.stats.wall_ms for g in gens)}


def run(cfg: BenchConfig) -> dict:
    """Each method batched and one at a time (module docstring); the report as a dict."""
    pair = load_pair(cfg.pair, device=cfg.device)
    base = load_prompts(pair.tokenizer, get_preset(cfg.pair).dataset, "test", cfg.prompt_tokens, limit=cfg.batch)
    # fewer test prompts than requests: used again, each round cut 5 tokens shorter (lengths still differ)
    prompts = [base[i % len(base)][: max(1, len(base[i % len(base)]) - 5 * (i // len(base)))] for i in range(cfg.batch)]
    rows = []
    for method in cfg.methods.split(","):
        batched, alone = _batched(pair, prompts, cfg, method), _alone(pair, prompts, cfg, method)
        same = sum(a == b for a, b in zip(batched.pop("outputs"), alone.pop("outputs")))
        rows.append({"method": method, "same_outputs": same, "requests": len(prompts), "batched": batched,
                     "one_at_a_time": alone, "speedup": batched["tokens_per_s"] / alone["tokens_per_s"]})
        b = batched
        print(f"{method:5s} batched {b['ms_per_step']:7.2f} ms/step ({b['steps']} steps, {b['mean_rows']:.1f} rows): "
              f"forwards {b['forward_share']:.1%}, readouts {b['readout_share']:.1%}, bookkeeping "
              f"{b['bookkeeping_share']:.1%} | {b['tokens_per_s']:.0f} tok/s vs {alone['tokens_per_s']:.0f} one at a "
              f"time (bookkeeping {alone['overhead_share']:.1%}) | {same}/{len(prompts)} outputs equal")
    return {"config": asdict(cfg), "machine": machine_description(), "prompt_lengths": [len(p) for p in prompts],
            "methods": rows}


def layout(cfg: BenchConfig) -> dict:
    """ms per batched forward: the padded cache vs one cache per request vs batch-of-one forwards."""
    pair = load_pair(cfg.pair, device=cfg.device)
    B = cfg.batch
    lengths = [40 + (80 * i) // max(1, B - 1) for i in range(B)]
    prompts = [torch.randint(0, pair.vocab_size, (n,), generator=torch.Generator().manual_seed(i)).tolist()
               for i, n in enumerate(lengths)]
    rows = []
    for role in ("draft", "target"):
        model = getattr(pair, role)
        for fed in (1, 4):
            rows.append({"model": role, "fed": fed, **_layout_cell(model, prompts, fed, cfg.repeats)})
            print(" ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in rows[-1].items()))
    return {"config": asdict(cfg), "machine": machine_description(), "layout": rows}


@torch.inference_mode()
def _layout_cell(model, prompts: list[list[int]], fed: int, repeats: int) -> dict:
    from transformers import DynamicCache

    B, lens = len(prompts), [len(p) for p in prompts]
    caches = []
    for p in prompts:
        caches.append(DynamicCache(config=model.config))
        model(torch.tensor([p]), past_key_values=caches[-1], use_cache=True)

    def per_request() -> None:
        batched_forward(model, [Row([5] * fed, c, 1) for c in caches])

    def one_at_a_time() -> None:
        for c in caches:
            batched_forward(model, [Row([5] * fed, c, 1)])

    def undo() -> None:
        for c, n in zip(caches, lens):
            crop_cache(c, n)

    padded = PaddedCache(model)
    padded.add_rows(B)
    tokens = torch.full((B, max(lens) + fed), 5, dtype=torch.long)
    for r, p in enumerate(prompts):
        tokens[r, : len(p)] = torch.tensor(p)
    length = torch.tensor(lens)
    ids, real, pos, _ = _feed(tokens, torch.zeros_like(length), length)
    padded.prefill(torch.arange(B), ids, real, pos, keep=1)
    snap = padded.snapshot()
    calls = []

    def padded_forward() -> None:
        ids, real, pos, _ = _feed(tokens, padded.length, length + fed)
        padded.forward(ids, real, pos, keep=1)
        calls.append(padded.last_ms)

    out = {}
    for name, fn, reset in (("per_request_caches_ms", per_request, undo), ("padded_ms", padded_forward,
                            lambda: padded.restore(snap)), ("batch_of_one_forwards_ms", one_at_a_time, undo)):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000.0)
            reset()
        out[name] = statistics.median(times)
    out["padded_model_call_ms"] = statistics.median(calls)
    return out


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_dataclass(BenchConfig, argv, __doc__)
    torch.set_num_threads(cfg.threads)
    report = layout(cfg) if cfg.layout else run(cfg)
    out = Path(cfg.out if not cfg.layout or cfg.out != BenchConfig.out else "results/bench_batched_layout.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
