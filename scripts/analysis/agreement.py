"""How often drafts agree with the target along the target's own output, per workload domain.

    python -m scripts.analysis.agreement --drafts bild_env/assets/smollm2-draft path/to/other-draft --split validation
    python -m scripts.analysis.agreement --pair tiny-random --prompts 2 --max-new-tokens 8          # seconds, a smoke run

The target decodes each held-out prompt greedily (``generate_target_only``, the pair's dtype); every
draft is then read teacher-forced along that same output (``bench.decoders.draft_agreement``: at each
position whose next token a draft could propose, draft argmax == target argmax). The same outputs for
every draft, so the drafts' numbers are paired. Use ``--split validation`` to choose between drafts and
``--split test`` once, for the number reported. ``--split train`` reads the TRAIN prompts the drafts were
distilled from: a diagnostic of fit (how far a draft is from a bar where it has seen the prompts, and its gap
to held-out prompts), never a number to choose or report a draft by.
"""

from __future__ import annotations

import sys

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from bench.decoders import draft_agreement
from bild_env import generate_target_only, load_pair
from bild_env.cli import report_main
from bild_env.models.device import machine_description
from bild_env.models.pairs import DEFAULT_PAIR, check_held_out, get_preset
from bild_env.prompts.domains import load_domain


@dataclass
class AgreementConfig:
    pair: str = field(default=DEFAULT_PAIR, metadata={"help": (
        "its target and tokenizer; its own draft when --drafts is not given")})
    drafts: tuple[str, ...] = field(default=(), metadata={"help": (
        'draft folders read against the preset\'s target ("" or none: the preset\'s draft)')})
    dtype: str | None = None
    domains: tuple[str, ...] = ("prose", "code", "chat")
    split: str = "validation"
    prompts: int = field(default=24, metadata={"help": "per domain (fewer where the split has fewer)"})
    max_new_tokens: int = 64
    threads: int = 0
    draft_vocab: int = field(default=-1, metadata={"help": (
        "every draft's head: -1 the preset's (smollm2: 16,384 tokens), 0 full, K restricted")})
    out: str = ""


def check_config(cfg: AgreementConfig) -> None:
    check_held_out(cfg.pair, cfg.domains, "validation" if cfg.split == "train" else cfg.split)  # train: a diagnostic
    if cfg.prompts < 1 or cfg.max_new_tokens < 2:
        raise ValueError("--prompts must be at least 1 and --max-new-tokens at least 2")
    missing = [d for d in cfg.drafts if d and not (Path(d) / "config.json").is_file()]
    if missing:
        raise ValueError(f"no draft model folder (config.json) at {', '.join(missing)}")


def run(cfg: AgreementConfig) -> dict[str, object]:
    check_config(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    vocab = get_preset(cfg.pair).draft_vocab if cfg.draft_vocab < 0 else cfg.draft_vocab  # the same for every draft
    base = load_pair(cfg.pair, dtype=cfg.dtype, draft_vocab=vocab)
    drafts = list(cfg.drafts) or [""]
    tokenizer_id = get_preset(cfg.pair).resolve()[2]
    pairs = {d or cfg.pair: base if not d else load_pair(cfg.pair, draft=d, tokenizer=tokenizer_id, dtype=cfg.dtype,
                                                         draft_vocab=vocab)
             for d in drafts}
    result: dict[str, object] = {"machine": machine_description(base.device), "dtype": str(base.dtype),
                                 "config": asdict(cfg), "domains": {}}
    for domain in cfg.domains:
        prompts = load_domain(base.tokenizer, domain, cfg.split, cfg.prompts)
        outputs = [generate_target_only(base, p, cfg.max_new_tokens).new_ids
                   for p in tqdm(prompts, desc=f"{domain}: target outputs", unit="prompt", leave=False)]
        rows = {}
        for name, pair in pairs.items():
            per_prompt = [draft_agreement(pair, [p], [o]) for p, o in zip(prompts, outputs)]
            hits = sum(r["agreement"] * r["positions"] for r in per_prompt if r["positions"])
            positions = sum(r["positions"] for r in per_prompt)
            rows[name] = {"agreement": hits / positions if positions else None, "positions": positions,
                          "per_prompt": [r["agreement"] for r in per_prompt]}
        result["domains"][domain] = {"prompts": len(prompts), "drafts": rows}
    result["mean_over_domains"] = {name: statistics.fmean(result["domains"][d]["drafts"][name]["agreement"]
                                                          for d in cfg.domains) for name in pairs}
    return result


def report(result: dict) -> str:
    names = list(result["mean_over_domains"])
    lines = [f"{result['machine']}; {result['dtype']}; split {result['config']['split']}",
             "draft".ljust(48) + "".join(f"{d:>10}" for d in result["domains"]) + f"{'mean':>10}"]
    for name in names:
        cells = "".join(f"{result['domains'][d]['drafts'][name]['agreement']:>10.3f}" for d in result["domains"])
        lines.append(f"{name[-48:]:<48}{cells}{result['mean_over_domains'][name]:>10.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    return report_main(AgreementConfig, argv, __doc__.split("\n\n")[0], check_config, run, report)


if __name__ == "__main__":
    from bild_env.command import run_command

    sys.exit(run_command("python -m scripts.analysis.agreement", main))
