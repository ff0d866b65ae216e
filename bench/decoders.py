"""Time the three decoders side by side in one run: tokens/s, acceptance, speedup, engine overhead.

    python bench/decoders.py --pair tiny-random
    python bench/decoders.py --shapes opt --device cuda     # OPT-125M / OPT-6.7B shapes, random weights

Every method decodes the same prompts in the same order, interleaved per prompt (so drifts of the
machine hit all methods alike), after one warm-up generation each. "overhead" is the share of
wall time spent outside model forwards (Python, sampling logic, cache crops). Random weights give
true forward timings but not true acceptance.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from bild_env import generate_bild, generate_speculative, generate_target_only, load_pair
from bild_env.prompts.sources import load_prompts
from bild_env.cli import parse_dataclass, setup_logging
from bild_env.models.device import default_device, resolve_dtype
from bild_env.models.pairs import DEFAULT_PAIR, ModelPair, preset_names
from bild_env.decoding.stats import DecodeStats

# Architecture of facebook/opt-125m and facebook/opt-6.7b (from their config.json).
OPT_SHAPES = {"draft": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, ffn_dim=3072),
              "target": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, ffn_dim=16384)}


@dataclass
class BenchConfig:
    pair: str = DEFAULT_PAIR  # preset (ignored with --shapes opt)
    shapes: str = ""  # "opt": random-weight models of OPT-125M/OPT-6.7B shape (timings only)
    device: str | None = None
    dtype: str | None = None
    dataset: str = "builtin"
    prompts: int = 6
    prompt_tokens: int = 32
    max_new_tokens: int = 64
    k: int = 4  # naive speculative decoding's draft length
    fallback: float = 0.103
    rollback: float = 4.697
    threads: int = 0  # torch CPU threads (0: torch's default)
    out: str = ""  # optional JSON file for the results


def opt_shaped_pair(device: str | None, dtype: str | None) -> ModelPair:
    """OPT-125M/OPT-6.7B-shaped models with random weights (no download), on ``device``."""
    from transformers import OPTConfig, OPTForCausalLM

    from bild_env.models.pairs import _eos_ids
    from bild_env.models.tiny import TOKENIZER_DIR
    from transformers import AutoTokenizer

    dev = torch.device(device) if device else default_device()
    dt = resolve_dtype(dtype, dev)
    models = {}
    for role, shape in OPT_SHAPES.items():
        config = OPTConfig(vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=shape["hidden_size"],
                           eos_token_id=50256, bos_token_id=50256, pad_token_id=1, **shape)
        with torch.device(dev):
            models[role] = OPTForCausalLM(config).to(dt).eval().requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    return ModelPair("opt-shapes", models["draft"], models["target"], tok, dev, dt, (), 2048, ("opt-125m-shape", "opt-6.7b-shape"))


def run(cfg: BenchConfig) -> dict[str, dict]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    pair = opt_shaped_pair(cfg.device, cfg.dtype) if cfg.shapes == "opt" else load_pair(cfg.pair, device=cfg.device, dtype=cfg.dtype)
    prompts = load_prompts(pair.tokenizer, cfg.dataset, "test", cfg.prompt_tokens, limit=cfg.prompts)
    methods = {
        "target only": lambda p: generate_target_only(pair, p, cfg.max_new_tokens),
        f"naive SD (k={cfg.k})": lambda p: generate_speculative(pair, p, cfg.k, cfg.max_new_tokens),
        f"BiLD ({cfg.fallback}/{cfg.rollback})": lambda p: generate_bild(pair, p, cfg.fallback, cfg.rollback, 10, cfg.max_new_tokens),
    }
    for fn in methods.values():  # warm-up
        fn(prompts[0])
    totals = {name: DecodeStats() for name in methods}
    per_prompt = {name: [] for name in methods}
    for prompt in tqdm(prompts, desc="prompts"):
        for name, fn in methods.items():
            g = fn(prompt)
            totals[name] += g.stats
            per_prompt[name].append(g.stats.wall_ms)
    base = totals["target only"].tokens_per_s
    results = {}
    for name, s in totals.items():
        results[name] = {
            "tokens_per_s": s.tokens_per_s, "speedup": s.tokens_per_s / base if base else 0.0,
            "acceptance_rate": s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length,
            "overhead": s.overhead, "median_ms_per_prompt": statistics.median(per_prompt[name]),
            "new_tokens": s.new_tokens,
        }
    return {"device": str(pair.device), "dtype": str(pair.dtype), "pair": pair.name, "config": asdict(cfg),
            "torch_threads": torch.get_num_threads(), "results": results}


def table(report: dict) -> str:
    lines = [f"pair {report['pair']} on {report['device']} ({report['dtype']}, {report['torch_threads']} threads)",
             "| method | tokens/s | speedup | acceptance | tokens/target fwd | overhead |", "|---|---|---|---|---|---|"]
    for name, r in report["results"].items():
        acc = "n/a" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {acc} | "
                     f"{r['mean_accepted_length']:.2f} | {100 * r['overhead']:.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    cfg = parse_dataclass(BenchConfig, argv, __doc__)
    if cfg.pair not in preset_names():
        raise SystemExit(f"bench/decoders.py: unknown --pair {cfg.pair!r}; choose one of {preset_names()}")
    report = run(cfg)
    print(table(report))
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
