"""The batched decoder against one request at a time, on the clock: ms per step and where a step's time goes.

    python -m scripts.analysis.batched --pair tiny-random --batch 8 --max-new-tokens 32
    python -m scripts.analysis.batched --pair tiny-random --layout     # padded cache vs per-request caches, ms per forward

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

``--lean-padded`` times the lean forward (``bild_env.models.lean``) on the padded cache's forwards, per
model, for each B in ``--batches`` and each of ``--fed`` tokens per row, interleaved (each round runs every
variant once, in a rotating order; the median of ``--repeats`` rounds after two warm-up rounds):

- ``lean_masked``: a ``PaddedCache.forward`` of the lean model: rows of ``--context`` down to 2/3 of it cached
  tokens (left pads), the first row with a rolled-back slot (a hole), so even B = 1 passes a mask with a hole;
- ``fallback_masked``: the same forward of the lean model with its padded case handed to transformers'
  forward (``LeanLlamaModel.padded = False``: what a lean pair ran before the lean forward took masks; its
  output layer still the lean model's, packed where measured faster);
- ``original_masked``: the same forward of the model as transformers runs it (``lean="none"``); its output
  layer, an ``nn.Linear`` fed the last ``keep`` of n > keep columns, is a strided slice, for which torch
  2.13's CPU ``F.linear`` in bfloat16 was measured 30-200x slower than on a contiguous copy (it copies the
  weight per row), so its draft forwards fed 4 and its prefills pay that too;
- ``lean_plain``: the lean model fed the same number of tokens per row with no mask and no position ids,
  every row holding ``--context`` tokens in one ``DynamicCache`` (the case the cost model's tables time);

and, the same way, each model's prefill of B prompts of those lengths into an empty cache
(``PaddedCache.prefill``; ``lean_plain``: B prompts of ``--context`` tokens, no mask). Every call keeps the
logits of its last ``fed`` columns (1 for the draft's forwards) and converts them to float32, as
``PaddedCache`` does. Beside the times, untimed: the largest difference between the lean and the original
masked logits at the columns that hold a token, whether their argmaxes agree, and whether the lean plain
forward's logits equal the original's bit for bit.

    python -m scripts.analysis.batched --pair smollm2 --lean-padded --repeats 30 --out results/bench_padded_lean.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bild_env import generate_bild, generate_speculative, generate_target_only, load_pair
from bild_env.cli import parse_dataclass
from bild_env.decoding.batched import BatchedDecoder
from bild_env.decoding.rows import feed_rows
from bild_env.decoding.bild import FIXED_FALLBACK, FIXED_ROLLBACK
from bild_env.decoding.kv import Row, batched_forward, crop_cache
from bild_env.decoding.padded import PaddedCache
from bild_env.command import UsageError, check_options
from bild_env.models.compat import cache_kwarg
from bild_env.models.device import machine_description, sync, usable_device
from bild_env.models.pairs import get_preset
from bild_env.prompts import load_prompts


@dataclass
class BenchConfig:
    """Options of ``python -m scripts.analysis.batched``."""

    pair: str = field(default="tiny-random", metadata={"help": "a preset (bild_env.models.pairs)"})
    device: str = "cpu"
    batch: int = field(default=8, metadata={"help": "requests decoded together"})
    prompt_tokens: int = field(default=64, metadata={"help": (
        "prompts cut to at most this many tokens (shorter paragraphs stay shorter)")})
    max_new_tokens: int = 32
    methods: str = field(default="bild,sd,off", metadata={"help": "comma-separated: bild, sd, off"})
    k: int = field(default=4, metadata={"help": "drafts per naive SD round"})
    fallback: float = FIXED_FALLBACK
    rollback: float = FIXED_ROLLBACK
    threads: int = field(default=1, metadata={"help": "torch threads"})
    layout: bool = field(default=False, metadata={"help": "time the two cache layouts instead"})
    lean_padded: bool = field(default=False, metadata={"help": (
        "time the lean forward on padded forwards instead (module docstring)")})
    batches: str = field(default="1,8,32", metadata={"help": "--lean-padded: comma-separated batch sizes"})
    fed: str = field(default="1,4", metadata={"help": "--lean-padded: comma-separated tokens fed per row"})
    context: int = field(default=48, metadata={"help": "--lean-padded: cached tokens of the longest row"})
    prefill_repeats: int = field(default=10, metadata={"help": (
        "--lean-padded: rounds per prefill cell (0: no prefills)")})
    repeats: int = field(default=100, metadata={"help": (
        "forwards per layout cell (median); --lean-padded: rounds per forward cell")})
    note: str = field(default="", metadata={"help": "what else ran on the machine meanwhile (written to the JSON)"})
    out: str = "results/bench_batched.json"


def check_config(cfg: BenchConfig) -> None:
    """A ``UsageError`` for an option no benchmark can run with, before anything loads."""
    check_options(cfg, at_least_one=("batch", "prompt_tokens", "max_new_tokens", "k", "threads", "repeats"),
                  at_least_zero=("context", "prefill_repeats"), probabilities=("fallback",))
    if cfg.rollback < 0:
        raise UsageError(f"--rollback is a cross-entropy in nats: give a number >= 0, got {cfg.rollback}")
    unknown = set(cfg.methods.split(",")) - {"bild", "sd", "off"}
    if unknown:
        raise UsageError(f"--methods {cfg.methods!r}: {', '.join(sorted(unknown))} unknown; give a comma-separated "
                         "list of bild, sd, off")
    usable_device(cfg.device)


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
        model(torch.tensor([p]), **cache_kwarg(caches[-1]), use_cache=True)

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
    ids, real, pos, _ = feed_rows(tokens, torch.zeros_like(length), length)
    padded.prefill(torch.arange(B), ids, real, pos, keep=1)
    snap = padded.snapshot()
    calls = []

    def padded_forward() -> None:
        ids, real, pos, _ = feed_rows(tokens, padded.length, length + fed)
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


LEAN_VARIANTS = ("lean_masked", "fallback_masked", "original_masked", "lean_plain")


def lean_padded(cfg: BenchConfig) -> dict:
    """ms per padded forward and prefill: the lean forward with a mask vs transformers' vs the lean plain case."""
    import os

    original = load_pair(cfg.pair, device=cfg.device, lean="none")
    lean = load_pair(cfg.pair, device=cfg.device, lean="both")
    if lean.lean != ("draft", "target"):
        raise SystemExit(f"the {cfg.pair} pair's models cannot run the lean forward (lean roles: {lean.lean})")
    batches = [int(b) for b in cfg.batches.split(",")]
    feds = [int(n) for n in cfg.fed.split(",")]
    load = os.getloadavg()
    forwards, prefills = [], []
    for role in ("draft", "target"):
        models = (getattr(lean, role), getattr(original, role))
        for B in batches:
            for fed in feds:
                keep = 1 if role == "draft" else fed
                forwards.append({"model": role, "batch": B, "fed": fed, "keep": keep,
                                 **_lean_padded_cell(*models, B, fed, keep, cfg.context, cfg.repeats, prefill=False)})
                _print_lean_row(forwards[-1])
            if cfg.prefill_repeats:
                prefills.append({"model": role, "batch": B, **_lean_padded_cell(
                    *models, B, 0, 1, cfg.context, cfg.prefill_repeats, prefill=True)})
                _print_lean_row(prefills[-1])
    return {"config": asdict(cfg), "machine": machine_description(cfg.device), "dtype": str(lean.dtype),
            "packed": {role: getattr(lean, role).model.packed for role in ("draft", "target")},
            "load_average_before": load, "load_average_after": os.getloadavg(),
            "forwards": forwards, "prefills": prefills}


def _print_lean_row(row: dict) -> None:
    what = f"fed {row['fed']}" if "fed" in row else "prefill"
    print(f"{row['model']:6s} B={row['batch']:2d} {what:7s} ms: lean masked {row['lean_masked_ms']:7.2f}, fallback "
          f"{row['fallback_masked_ms']:7.2f} ({row['fallback_over_lean_masked']:.2f}x), original "
          f"{row['original_masked_ms']:7.2f} ({row['original_over_lean_masked']:.2f}x), lean plain "
          f"{row['lean_plain_ms']:7.2f} (masked/plain {row['lean_masked_over_lean_plain']:.2f}) | max |dz| "
          f"{row['max_abs_logit_diff']:.3g}, argmax agree {row['argmax_agree']:.3f}, plain bit-equal "
          f"{row['plain_bit_identical']}")


@torch.inference_mode()
def _lean_padded_cell(lean_model, base_model, B: int, fed: int, keep: int, context: int, repeats: int,
                      prefill: bool) -> dict:
    """One cell of ``--lean-padded`` (module docstring): median ms of each variant's model call and the checks."""
    from transformers import DynamicCache

    device = next(base_model.parameters()).device
    gen = torch.Generator().manual_seed(1000 * B + fed)
    tokens = torch.randint(0, base_model.config.vocab_size, (B, context + fed), generator=gen).to(device)
    # row 0 holds context tokens (one of them rolled back: a hole, except in a prefill); the others context down
    # to 2/3 of it (left pads)
    lengths = torch.tensor([context] + [context - (context // 3 * i) // max(1, B - 1) for i in range(1, B)],
                           device=device)
    held = lengths.clone()
    held[0] -= 0 if prefill else 1
    rows = torch.arange(B, device=device)
    caches = {}
    for name, model in (("lean_masked", lean_model), ("fallback_masked", lean_model), ("original_masked", base_model)):
        caches[name] = PaddedCache(model)
        caches[name].add_rows(B)
        if not prefill:
            ids, real, pos, _ = feed_rows(tokens, torch.zeros_like(lengths), lengths)
            caches[name].prefill(rows, ids, real, pos, keep=1)
            caches[name].crop(held)
    snaps = {name: cache.snapshot() for name, cache in caches.items()}
    ids, real, pos, width = feed_rows(tokens, torch.zeros_like(held), held) if prefill else feed_rows(tokens, held, held + fed)

    def masked(name: str, keep_: int) -> tuple[float, torch.Tensor]:
        cache = caches[name]
        lean_model.model.padded = name != "fallback_masked"
        if prefill:
            z = cache.prefill(rows, ids, real, pos, keep=keep_)
            ms = cache.last_ms
            cache.select(rows[:0])  # back to B empty rows
            cache.add_rows(B)
        else:
            z = cache.forward(ids, real, pos, keep=keep_)
            ms = cache.last_ms
            cache.restore(snaps[name])
        return ms, z

    plain_ids = tokens[:, :context] if prefill else tokens[:, context : context + fed]
    plain_caches = {"lean": DynamicCache(config=lean_model.config), "original": DynamicCache(config=base_model.config)}
    plain_models = {"lean": lean_model, "original": base_model}
    if not prefill:
        for name, model in plain_models.items():
            model(input_ids=tokens[:, :context], **cache_kwarg(plain_caches[name]), use_cache=True, logits_to_keep=1)

    def plain(name: str, keep_: int) -> tuple[float, torch.Tensor]:
        sync(device)
        t0 = time.perf_counter()
        z = plain_models[name](input_ids=plain_ids, **cache_kwarg(plain_caches[name]), use_cache=True,
                               logits_to_keep=keep_).logits.float()
        sync(device)
        ms = (time.perf_counter() - t0) * 1000.0
        crop_cache(plain_caches[name], 0 if prefill else context)
        return ms, z

    variants = {name: (lambda name=name: masked(name, keep)) for name in LEAN_VARIANTS if name.endswith("_masked")}
    variants["lean_plain"] = lambda: plain("lean", keep)
    times: dict[str, list[float]] = {name: [] for name in LEAN_VARIANTS}
    try:
        # untimed checks: the lean masked logits against transformers' at every column that holds a token
        za, zb = masked("original_masked", width)[1][real], masked("lean_masked", width)[1][real]
        diff = float((za - zb).abs().max())
        agree = float((za.argmax(-1) == zb.argmax(-1)).float().mean())
        bit_identical = torch.equal(plain("original", plain_ids.shape[1])[1], plain("lean", plain_ids.shape[1])[1])
        for r in range(repeats + 2):  # the first two rounds warm up
            for i in range(len(LEAN_VARIANTS)):
                name = LEAN_VARIANTS[(r + i) % len(LEAN_VARIANTS)]
                spent = variants[name]()[0]
                if r >= 2:
                    times[name].append(spent)
    finally:
        lean_model.model.padded = True
    ms = {f"{name}_ms": statistics.median(ts) for name, ts in times.items()}
    return {"row_lengths": held.tolist(), "columns": snaps["lean_masked"].columns + width, **ms,
            "fallback_over_lean_masked": ms["fallback_masked_ms"] / ms["lean_masked_ms"],
            "original_over_lean_masked": ms["original_masked_ms"] / ms["lean_masked_ms"],
            "lean_masked_over_lean_plain": ms["lean_masked_ms"] / ms["lean_plain_ms"],
            "max_abs_logit_diff": diff, "argmax_agree": agree, "plain_bit_identical": bit_identical, "rounds": repeats}


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_dataclass(BenchConfig, argv, __doc__)
    check_config(cfg)
    torch.set_num_threads(cfg.threads)
    report = layout(cfg) if cfg.layout else lean_padded(cfg) if cfg.lean_padded else run(cfg)
    default = "results/bench_batched_layout.json" if cfg.layout else "results/bench_padded_lean.json"
    out = Path(cfg.out if not (cfg.layout or cfg.lean_padded) or cfg.out != BenchConfig.out else default)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    from bild_env.command import run_command

    sys.exit(run_command("python -m scripts.analysis.batched", main))
