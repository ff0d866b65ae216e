"""Time the three decoders side by side in one run: tokens/s, acceptance, speedup, engine overhead.

    python bench/decoders.py --pair tiny-random
    python bench/decoders.py --pair smollm2 --dtype float32,bfloat16   # both dtypes in one run, and their ratio
    python bench/decoders.py --pair smollm2 --k 1 2 3 4 --rollback 0.5 --fallback 0.35 --hf   # the lossless methods
    python bench/decoders.py --shapes opt --device cuda     # OPT-125M / OPT-6.7B shapes, random weights

Every method decodes the same prompts in the same order, interleaved per prompt (so drifts of the
machine hit all methods alike), after one warm-up generation each. With several dtypes
(``--dtype float32,bfloat16``, the default on a CPU with native bfloat16) each runs the same prompts,
interleaved too: one table per dtype, then a line of bfloat16/float32 tokens/s ratios. "overhead" is
the share of wall time spent outside model forwards (Python, sampling logic, cache crops). Random
weights give true forward timings but not true acceptance.
"""

from __future__ import annotations

import json
import statistics
import time
from types import SimpleNamespace
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from bild_env import generate_bild, generate_speculative, generate_target_only, load_pair
from bild_env.prompts.sources import load_prompts
from bild_env.models.device import DeviceError, cpu_has_native_bf16, default_device, log_dtype, resolve_dtype, sync
from bild_env.cli import parse_dataclass, setup_logging
from bild_env.models.pairs import DEFAULT_PAIR, ModelPair, preset_names
from bild_env.decoding.costs import load_or_calibrate
from bild_env.decoding.stats import DecodeStats

# Architecture of facebook/opt-125m and facebook/opt-6.7b (from their config.json).
OPT_SHAPES = {"draft": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, ffn_dim=3072),
              "target": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, ffn_dim=16384)}


@dataclass
class BenchConfig:
    pair: str = DEFAULT_PAIR  # preset (ignored with --shapes opt)
    shapes: str = ""  # "opt": random-weight models of OPT-125M/OPT-6.7B shape (timings only)
    device: str | None = None
    dtype: str | None = None  # comma-separated dtypes, one table each (default: float32,bfloat16 on a CPU with native bf16, else float32; float16 on cuda)
    dataset: str = "builtin"
    prompts: int = 6
    prompt_tokens: int = 32
    max_new_tokens: int = 64
    k: tuple[int, ...] = (4,)  # naive speculative decoding's draft length(s): one row each
    fallback: float = 0.103
    rollback: float = 4.697
    hf: bool = False  # also Hugging Face assisted generation (target.generate(assistant_model=draft), its defaults)
    threads: int = 0  # torch CPU threads (0: torch's default)
    out: str = ""  # optional JSON file for the results


def opt_shaped_pair(device: str | None, dtype: str | None) -> ModelPair:
    """OPT-125M/OPT-6.7B-shaped models with random weights (no download), on ``device``."""
    from transformers import OPTConfig, OPTForCausalLM

    from bild_env.models.tiny import TOKENIZER_DIR
    from transformers import AutoTokenizer

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
    dev = torch.device(cfg.device) if cfg.device else default_device()
    if dev.type == "cuda":
        return ["float16"]
    return ["float32", "bfloat16"] if cpu_has_native_bf16() else ["float32"]


def run(cfg: BenchConfig) -> dict[str, dict]:
    """Time the three decoders in ``cfg.dtype`` (one dtype; see ``run_dtypes`` for several)."""
    return run_dtypes(cfg, [cfg.dtype])[0]


def run_dtypes(cfg: BenchConfig, dtypes: list[str | None]) -> list[dict]:
    """One report per dtype, all from one run: the same prompts, interleaved per prompt across dtypes and methods
    (so drifts of the machine hit all alike), after one warm-up generation of each."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    pairs: list[ModelPair] = []
    for dtype in dtypes:
        pair = opt_shaped_pair(cfg.device, dtype) if cfg.shapes == "opt" else load_pair(cfg.pair, device=cfg.device, dtype=dtype)
        if all(pair.dtype != other.dtype for other in pairs):  # "auto" and its name are one run
            pairs.append(pair)
    prompts = load_prompts(pairs[0].tokenizer, cfg.dataset, "test", cfg.prompt_tokens, limit=cfg.prompts)

    def methods(pair: ModelPair) -> dict:
        fns = {"target only": lambda p: generate_target_only(pair, p, cfg.max_new_tokens)}
        for k in cfg.k:
            fns[f"naive SD (k={k})"] = lambda p, k=k: generate_speculative(pair, p, k, cfg.max_new_tokens)
        fns[f"BiLD ({cfg.fallback}/{cfg.rollback})"] = lambda p: generate_bild(pair, p, cfg.fallback, cfg.rollback, 10,
                                                                             cfg.max_new_tokens)
        if cfg.hf:
            fns["HF assisted"] = lambda p: hf_assisted(pair, p, cfg.max_new_tokens)
        return fns

    runs = [methods(pair) for pair in pairs]
    for fns in runs:  # warm-up
        for fn in fns.values():
            fn(prompts[0])
    totals = [{name: DecodeStats() for name in fns} for fns in runs]
    per_prompt = [{name: [] for name in fns} for fns in runs]
    for prompt in tqdm(prompts, desc="prompts"):
        for fns, total, ms in zip(runs, totals, per_prompt):
            for name, fn in fns.items():
                g = fn(prompt)
                total[name] += g.stats
                ms[name].append(g.stats.wall_ms)
    reports = []
    context = cfg.prompt_tokens + cfg.max_new_tokens // 2  # cached tokens at a typical step
    for pair, total, ms in zip(pairs, totals, per_prompt):
        base = total["target only"].tokens_per_s
        cost = load_or_calibrate(pair) if cfg.shapes != "opt" else None
        results = {}
        for name, s in total.items():
            results[name] = {
                "tokens_per_s": s.tokens_per_s, "speedup": s.tokens_per_s / base if base else 0.0,
                "acceptance_rate": s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length,
                "overhead": None if name == "HF assisted" else s.overhead, "median_ms_per_prompt": statistics.median(ms[name]),
                "new_tokens": s.new_tokens,
            }
            k = next((k for k in cfg.k if name == f"naive SD (k={k})"), None)
            if cost is not None and k is not None and s.acceptance_rate is not None:
                results[name]["limit_speedup"] = sd_limit_speedup(cost, s.acceptance_rate, k, context)
        config = asdict(cfg) | {"dtype": str(pair.dtype).removeprefix("torch.")}
        reports.append({"device": str(pair.device), "dtype": str(pair.dtype), "pair": pair.name, "config": config,
                        "torch_threads": torch.get_num_threads(), "results": results})
    return reports


def sd_limit_speedup(cost, a: float, k: int, context: int) -> float:
    """The speedup over target-only decoding that naive SD with draft length ``k`` reaches if every draft token
    is accepted with probability ``a`` independently: (1 - a^(k+1)) / (1 - a) tokens per step of k one-token
    draft forwards and one target forward fed k + 1 tokens, against one token per one-token target forward
    (forward times from the pair's cost model at ``context`` cached tokens)."""
    tokens = k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
    step_ms = k * cost.ms("draft", 1, context) + cost.ms("target", k + 1, context)
    return tokens * cost.ms("target", 1, context) / step_ms


@torch.inference_mode()
def hf_assisted(pair: ModelPair, prompt: list[int], max_new_tokens: int) -> SimpleNamespace:
    """``target.generate(assistant_model=draft)``, greedy, with transformers' defaults; timed like the decoders."""
    ids = torch.tensor([prompt], device=pair.device)
    calls = [0]
    hook = pair.target.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    sync(pair.device)
    t0 = time.perf_counter()
    try:
        out = pair.target.generate(ids, assistant_model=pair.draft, do_sample=False, max_new_tokens=max_new_tokens,
                                   pad_token_id=pair.tokenizer.pad_token_id or pair.tokenizer.eos_token_id)
        sync(pair.device)
    finally:
        hook.remove()
    wall = (time.perf_counter() - t0) * 1000.0
    new = out.shape[1] - ids.shape[1]
    return SimpleNamespace(stats=DecodeStats(new_tokens=new, target_forwards=calls[0], wall_ms=wall, forward_ms=wall))


def compare(reports: list[dict], slow: str = "torch.float32", fast: str = "torch.bfloat16") -> str:
    """A line of ``fast``/``slow`` tokens/s ratios per method (target only first), or "" without both dtypes."""
    by = {r["dtype"]: r["results"] for r in reports}
    if slow not in by or fast not in by:
        return ""
    ratios = [f"{name} {by[fast][name]['tokens_per_s'] / by[slow][name]['tokens_per_s']:.2f}x"
              for name in by[slow] if by[slow][name]["tokens_per_s"]]
    return f"{fast.removeprefix('torch.')}/{slow.removeprefix('torch.')} tokens/s: " + ", ".join(ratios)


def table(report: dict) -> str:
    lines = [f"pair {report['pair']} on {report['device']} ({report['dtype']}, {report['torch_threads']} threads)",
             "| method | tokens/s | speedup | limit speedup (acceptance, forward costs) | acceptance | tokens/target fwd "
             "| overhead |", "|---|---|---|---|---|---|---|"]
    for name, r in report["results"].items():
        acc = "n/a" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        limit = f"{r['limit_speedup']:.2f}x" if "limit_speedup" in r else ""
        overhead = "n/a" if r["overhead"] is None else f"{100 * r['overhead']:.1f}%"
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {limit} | {acc} | "
                     f"{r['mean_accepted_length']:.2f} | {overhead} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    cfg = parse_dataclass(BenchConfig, argv, __doc__)
    if cfg.pair not in preset_names():
        raise SystemExit(f"bench/decoders.py: unknown --pair {cfg.pair!r}; choose one of {preset_names()}")
    try:
        dtypes = dtype_list(cfg)
        dev = torch.device(cfg.device) if cfg.device else default_device()
        for d in dtypes:
            resolve_dtype(d, dev)
    except DeviceError as err:
        raise SystemExit(f"bench/decoders.py: --dtype: {err}") from None
    reports = run_dtypes(cfg, dtypes)
    print("\n\n".join(table(r) for r in reports))
    line = compare(reports)
    if line:
        print("\n" + line)
    if cfg.out:
        out = reports[0] if len(reports) == 1 else {"reports": reports, "comparison": line}
        Path(cfg.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
