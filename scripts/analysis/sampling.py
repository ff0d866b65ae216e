"""Time one step of the distillation sampler side by side: the model's forward and two ways to draw.

    python -m scripts.analysis.sampling --threads 2               # the smollm2 draft, batch 256
    python -m scripts.analysis.sampling --model <hf folder> --batch 64

Per decoding step at batch ``--batch`` with a KV cache of ``--context`` tokens: the forward
(``--dtype``), ``torch.multinomial(softmax(logits))`` (what ``generate(do_sample=True)`` does), and
``draw_tokens`` of ``distill.samples`` (the CDF inversion it samples with: softmax, cumsum,
searchsorted on one uniform per row). Rounds are interleaved; medians are reported and written as JSON.
"""

from __future__ import annotations

import sys

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bild_env.decoding.runner import crop_cache
from bild_env.models.compat import cache_kwarg, output_cache
from bild_env.models.smollm2 import draft_path
from distill.samples import draw_tokens


def _ms(fn, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1000


@torch.inference_mode()
def run(model_dir: str, batch: int, context: int, dtype: str, rounds: int, repeat: int) -> dict[str, object]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    ids = torch.randint(3, model.config.vocab_size, (batch, context))
    out = model(ids, use_cache=True, logits_to_keep=1)
    cache, token = output_cache(out), out.logits[:, -1:].argmax(-1)
    logits = out.logits[:, -1].float()
    gen = torch.Generator().manual_seed(0)

    def forward() -> None:
        model(token, **cache_kwarg(cache), use_cache=True)
        crop_cache(cache, context)  # keep the context length fixed across repeats

    def multinomial() -> None:
        torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)

    def cdf() -> None:
        draw_tokens(logits, gen)

    times = {"forward": [], "multinomial": [], "cdf": []}
    for fn in (forward, multinomial, cdf):
        fn()  # warm-up
    for _ in range(rounds):
        for name, fn in (("forward", forward), ("multinomial", multinomial), ("cdf", cdf)):
            times[name].append(_ms(fn, repeat))
    med = {f"{k}_ms": statistics.median(v) for k, v in times.items()}
    step_mult, step_cdf = med["forward_ms"] + med["multinomial_ms"], med["forward_ms"] + med["cdf_ms"]
    return {"model": model_dir, "batch": batch, "context": context, "dtype": dtype, "vocab": model.config.vocab_size,
            "threads": torch.get_num_threads(), **med,
            "tokens_per_s_multinomial": batch / step_mult * 1000, "tokens_per_s_cdf": batch / step_cdf * 1000,
            "rounds_ms": {k: [round(x, 2) for x in v] for k, v in times.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(draft_path()), help="Hugging Face model folder (default: smollm2 draft)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--out", default="results/bench_sampling.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args.model, args.batch, args.context, args.dtype, args.rounds, args.repeat)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rounds_ms"}, indent=1))


if __name__ == "__main__":
    from bild_env.command import run_command

    sys.exit(run_command("python -m scripts.analysis.sampling", main))
