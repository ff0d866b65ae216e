"""What a tree's width costs on this CPU: each model's forward by tokens fed, the least of many rounds, as a cost model.

    python -m scripts.analysis.tree_costs --pair smollm2 --dtype bfloat16 --out results/tree_costs_smollm2_bfloat16.json

A tree verification feeds the target the root and every node (8 to 64 tokens) where a chain feeds it k + 1; the
draft is fed a level's nodes at a time. The stored cost model (``load_or_calibrate``) times fed counts 1 to 12 and
the prefill lengths 16, 32, 64 as medians, which a CPU shared with other processes inflates unevenly (on a busy
2-core Zen 5 it held a 2-token target forward at 0.81x a 1-token one). Here every (model, fed) cell is timed in
``--rounds`` interleaved rounds at ``--context`` cached tokens and the least time kept: other processes only ever
add time, so the least of many rounds is the steadiest estimate of the forward alone. Written: ``v(n)`` (the target
fed n against fed 1), ``c`` (the draft fed 1 against the target fed 1), ``stored_v`` (the stored model's v(n)), and
``cost_model``, these tables as a cost model of bare forwards at one context (no slope per cached token, no loop
costs), for ``scripts.analysis.stop_rules --profiles FILE:cost_model``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from bild_env import load_pair
from bild_env.cli import parse_checked
from bild_env.decoding.cost_model import CostModel
from bild_env.decoding.costs import load_or_calibrate
from bild_env.decoding.forward_costs import ForwardCost
from bild_env.decoding.kv import crop_cache
from bild_env.models.compat import cache_kwarg
from bild_env.models.device import machine_description


@dataclass
class TreeCostsConfig:
    pair: str = "smollm2"
    dtype: str | None = field(default=None, metadata={"help": "default: the preset's"})
    fed: tuple[int, ...] = field(default=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64), metadata={"help": (
        "tokens fed per forward")})
    context: int = field(default=96, metadata={"help": (
        "cached tokens before each forward (the cost model's reference context)")})
    rounds: int = field(default=15, metadata={"help": "interleaved rounds; the least time of each cell is kept"})
    threads: int = 1
    stored: bool = field(default=True, metadata={"help": (
        "also the stored cost model's v(n) (load_or_calibrate: timed once per machine)")})
    out: str = ""


def check(cfg: TreeCostsConfig) -> None:
    if cfg.rounds < 1 or cfg.context < 1 or not cfg.fed or min(cfg.fed) < 1 or 1 not in cfg.fed:
        raise ValueError("--rounds and --context must be at least 1, and --fed whole numbers >= 1 that include 1")


@torch.inference_mode()
def least_ms(pair, fed: tuple[int, ...], context: int, rounds: int) -> dict[str, dict[int, float]]:
    """The least ms over ``rounds`` of each model's forward fed each of ``fed`` random tokens on ``context`` cached."""
    from transformers import DynamicCache

    device, generator = pair.device, torch.Generator().manual_seed(0)
    caches, least = {}, {"draft": {}, "target": {}}
    for role in least:
        model = getattr(pair, role)
        caches[role] = DynamicCache(config=model.config)
        model(torch.randint(0, 1000, (1, context), generator=generator).to(device), **cache_kwarg(caches[role]),
              use_cache=True)
    feeds = {n: torch.randint(0, 1000, (1, n), generator=generator).to(device) for n in fed}
    for _ in tqdm(range(rounds + 1), desc="rounds of forwards", unit="round"):  # the first round warms up
        for n in fed:
            for role in least:
                model, cache = getattr(pair, role), caches[role]
                t0 = time.perf_counter()
                model(feeds[n], **cache_kwarg(cache), use_cache=True, logits_to_keep=n)
                ms = (time.perf_counter() - t0) * 1000.0
                crop_cache(cache, context)
                if _ > 0:
                    least[role][n] = min(least[role].get(n, ms), ms)
    return least


def run(cfg: TreeCostsConfig) -> dict:
    torch.set_num_threads(cfg.threads)
    pair = load_pair(cfg.pair, dtype=cfg.dtype)
    fed = tuple(sorted(set(cfg.fed)))
    stored = load_or_calibrate(pair) if cfg.stored else None
    least = least_ms(pair, fed, cfg.context, cfg.rounds)
    tables = {role: ForwardCost(fed=fed, ms=tuple(least[role][n] for n in fed), ref_context=cfg.context)
              for role in least}
    model = CostModel(tables["draft"], tables["target"], device="least of rounds", machine=machine_description(pair.device))
    target, draft = least["target"], least["draft"]
    return {"machine": machine_description(pair.device), "dtype": str(pair.dtype), "config": asdict(cfg),
            "least_ms": {role: {str(n): ms for n, ms in cells.items()} for role, cells in least.items()},
            "v": {str(n): target[n] / target[1] for n in fed}, "c": draft[1] / target[1],
            "stored_v": None if stored is None else {str(n): stored.target(n, cfg.context) / stored.target(1, cfg.context)
                                                     for n in fed},
            "cost_model": model.to_dict()}


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_checked(TreeCostsConfig, argv, __doc__.split("\n\n")[0], check)
    result = run(cfg)
    print(result["machine"], result["dtype"])
    print("v(n), target fed n / fed 1: " + ", ".join(f"{n}: {v:.2f}" for n, v in result["v"].items()))
    if result["stored_v"]:
        print("the stored cost model's:     " + ", ".join(f"{n}: {v:.2f}" for n, v in result["stored_v"].items()))
    print(f"c = draft fed 1 / target fed 1: {result['c']:.3f}")
    if cfg.out:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
