"""Measuring the exported draft against the target (the ``measure`` command): greedy acceptance on
held-out articles and per-token decode latency of both models, printed and written as JSON."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from bild_env.models.compat import cache_kwarg, output_cache
from bild_env.models.smollm2 import greedy_acceptance
from bild_env.prompts.wiki import load_wiki_texts
from distill.config import DistillConfig, out_dir, target_dir, work_dir
from distill.data import DOC_SEP


@torch.inference_mode()
def decode_ms(model: PreTrainedModel, prompt: torch.Tensor, n_tokens: int) -> float:
    """Mean milliseconds per greedy token: batch 1, one token per forward, KV cache."""
    out = model(prompt.unsqueeze(0), use_cache=True)
    cache, token = output_cache(out), out.logits[:, -1:].argmax(-1)
    start = time.perf_counter()
    for _ in range(n_tokens):
        out = model(token, **cache_kwarg(cache), use_cache=True)
        cache, token = output_cache(out), out.logits[:, -1:].argmax(-1)
    return (time.perf_counter() - start) / n_tokens * 1000


def latency(draft: PreTrainedModel, target: PreTrainedModel, prompt: torch.Tensor, cfg: DistillConfig) -> dict[str, object]:
    """Per-token decode latency of both models, interleaved rounds; medians and ratio."""
    decode_ms(draft, prompt, 8), decode_ms(target, prompt, 8)  # warm-up
    rounds = [(decode_ms(draft, prompt, cfg.latency_tokens), decode_ms(target, prompt, cfg.latency_tokens))
              for _ in range(cfg.latency_rounds)]
    d, t = statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)
    return {"draft_ms_per_token": d, "target_ms_per_token": t, "ratio": d / t,
            "rounds_ms": [[round(x, 3) for x in r] for r in rounds], "torch_threads": torch.get_num_threads()}


def measure(cfg: DistillConfig) -> dict[str, object]:
    """Acceptance and latency ratio of the exported draft vs the target on ``measure_split`` text (TEST)."""
    texts = load_wiki_texts(cfg.measure_split)[: cfg.measure_texts]  # a bad split fails here, before loading
    tokenizer = AutoTokenizer.from_pretrained(target_dir(cfg))
    draft = AutoModelForCausalLM.from_pretrained(out_dir(cfg), dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir(cfg), dtype=torch.float32).eval()
    seqs = [torch.tensor([DOC_SEP] + row)[: cfg.measure_max_tokens]
            for row in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    started = time.time()
    result: dict[str, object] = {"split": cfg.measure_split, **greedy_acceptance(draft, target, seqs)}
    result.update(latency(draft, target, seqs[0][: cfg.latency_prompt], cfg))
    result.update({"draft": str(out_dir(cfg)), "seconds": time.time() - started, "torch": torch.__version__})
    default = "measure.json" if cfg.measure_split == "test" else f"measure_{cfg.measure_split}.json"
    path = Path(cfg.measure_json) if cfg.measure_json else work_dir(cfg) / default
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return result
