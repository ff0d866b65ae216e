"""Teacher text from the workload users send (the ``domains`` command): the serving workload's TRAIN
prompts per domain (prose, code, chat through the target's chat template), each continued by the
target (or by the exported draft: on-policy text) to a full chunk, then labelled by the teacher like
any text; and a validation set made the way acceptance is read at decode time: VALIDATION prompts
continued greedily by the target.

Prompts come from :func:`bild_env.prompts.domains.load_domain` with the workload's own settings, so
the student sees the prompts' exact token layout (a chat prompt ends with the assistant header).
Code prompts alternate between the HumanEval TRAIN problems (the workload's ``code`` domain) and
Python standard-library TRAIN snippets (many more of them, the same kind of text).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from bild_env.prompts.domains import load_domain, parse_mix
from distill.config import DistillConfig, logger, pick_device, target_dir, work_dir
from distill.data import missing_shards, save_shard, shard_name
from distill.samples import continue_prompts, load_sampler
from distill.teacher import write_shards

SOURCES = {"target": ("domain_chunks", "domains", "teacher_domains"),
           "draft": ("draft_domain_chunks", "domains_draft", "teacher_domains_draft"),
           "greedy": ("greedy_domain_chunks", "domains_greedy", "teacher_domains_greedy")}
VAL_DIR = ("domains_val", "teacher_domains_val")


def domain_prompts(tokenizer, domain: str, split: str) -> list[list[int]]:
    """The workload's prompts of ``domain`` for ``split``; code: HumanEval and stdlib snippets interleaved."""
    if domain != "code":
        return load_domain(tokenizer, domain, split)
    humaneval = load_domain(tokenizer, "code", split)
    stdlib = load_domain(tokenizer, "code", split, code_source="stdlib")
    out = [p for pair in zip(stdlib, humaneval * (len(stdlib) // len(humaneval) + 1)) for p in pair]
    return out


def plan(cfg: DistillConfig, n: int, seed: int, split: str, tokenizer,
         distinct: bool = False) -> list[tuple[str, list[int]]]:
    """``n`` (domain, prompt) draws: domains by ``cfg.domain_mix`` weights, prompts uniform within a domain.

    ``distinct``: each domain's prompts drawn without replacement (a shuffled pass over its pool, then another
    where more are asked for than it holds), so greedy continuations repeat only past the pool's size."""
    mix = parse_mix(cfg.domain_mix)
    names = sorted(mix)
    pools = {d: domain_prompts(tokenizer, d, split) for d in names}
    rng = np.random.default_rng(seed)
    weights = np.array([mix[d] for d in names], dtype=float)
    picks = rng.choice(len(names), size=n, p=weights / weights.sum())
    if not distinct:
        return [(names[i], pools[names[i]][int(rng.integers(len(pools[names[i]])))]) for i in picks]
    orders: dict[str, list[int]] = {d: [] for d in names}
    out = []
    for i in picks:
        d = names[i]
        if not orders[d]:
            orders[d] = rng.permutation(len(pools[d])).tolist()
        out.append((d, pools[d][orders[d].pop()]))
    return out


def _build(cfg: DistillConfig, model_source: str, n: int, split: str, temperature: float, seed: int,
           gen_dir: Path, teacher_dir: Path, desc: str) -> None:
    """Continue ``n`` planned prompts of ``split`` with ``model_source``'s model, in resumable shards; label them.

    The target labels its own text while sampling it (its shards are written at once); the draft's
    text is labelled by the teacher afterwards, like any text.
    """
    tokenizer = AutoTokenizer.from_pretrained(target_dir(cfg))
    draws = plan(cfg, n, seed, split, tokenizer, distinct=temperature == 0.0)
    gen_dir.mkdir(parents=True, exist_ok=True)
    teacher_dir.mkdir(parents=True, exist_ok=True)
    starts = range(0, n, cfg.shard_chunks)
    todo = missing_shards(gen_dir, "gen", starts)
    top_k = cfg.top_k if model_source == "target" else 0
    if todo:
        model = load_sampler(cfg, model_source, pick_device(cfg))
        batch = cfg.sample_batch if model_source == "target" else cfg.draft_sample_batch
        bar = tqdm(total=sum(min(cfg.shard_chunks, n - s) for s in todo), desc=desc, unit="chunk", smoothing=0.05)
        for start in todo:
            part = draws[start : start + cfg.shard_chunks]
            # one domain per sampling batch: similar prompt lengths, little padding
            order = sorted(range(len(part)), key=lambda i: (part[i][0], len(part[i][1])))
            rows = torch.empty(len(part), cfg.seq_len, dtype=torch.long)
            labels: dict[str, torch.Tensor] = {}
            for b in range(0, len(order), batch):
                idx = torch.tensor(order[b : b + batch])
                rows[idx], got = continue_prompts(model, [part[i][1] for i in idx.tolist()], cfg.seq_len,
                                                  temperature, seed + start + b, top_k)
                for key, value in (got or {}).items():
                    labels.setdefault(key, torch.empty((len(part), *value.shape[1:]), dtype=value.dtype))[idx] = value
                bar.update(len(idx))
            if top_k:
                save_shard({**labels, "ids": rows.int()}, teacher_dir, shard_name("shard", start))
            save_shard({"ids": rows.int(), "domains": [d for d, _ in part]}, gen_dir, shard_name("gen", start))
        bar.close()
    shards = [torch.load(gen_dir / shard_name("gen", s)) for s in starts]
    chunks = torch.cat([s["ids"] for s in shards]).long()[:n]
    counts = {d: sum(s["domains"].count(d) for s in shards) for d in sorted(parse_mix(cfg.domain_mix))}
    logger.info(f"{desc}: {chunks.shape[0]} chunks ({counts}), {chunks.numel():,} tokens")
    write_shards(cfg, chunks, teacher_dir, f"teacher ({desc})")  # only shards not written yet


def build_domain_data(cfg: DistillConfig) -> None:
    """The workload text ``cfg`` asks for: target and draft continuations of TRAIN prompts, and validation."""
    work = work_dir(cfg)
    if cfg.domain_val > 0:
        _build(cfg, "target", cfg.domain_val, "validation", 0.0, cfg.seed * 1_000_003 + 7,
               work / VAL_DIR[0], work / VAL_DIR[1], "domain validation (target, greedy)")
    for source, (field, gen_dir, teacher_dir) in SOURCES.items():
        n = getattr(cfg, field)
        if n > 0:
            offset = {"target": 0, "draft": 700_000_001, "greedy": 350_000_003}[source]
            greedy = source == "greedy"  # the target's greedy path: where lossless greedy decoding asks the draft
            _build(cfg, "target" if greedy else source, n, "train", 0.0 if greedy else cfg.sample_temperature,
                   cfg.seed * 1_000_003 + offset, work / gen_dir, work / teacher_dir, f"domain samples ({source})")


def workload_token_counts(cfg: DistillConfig) -> dict[str, np.ndarray]:
    """Per domain, token counts (vocab,) int64 of the target's continuations of TRAIN prompts (``domains``' target
    shards: every row, its prompt and the target's continuation of it); {} before ``domains`` ran."""
    gen_dir = work_dir(cfg) / SOURCES["target"][1]
    rows: dict[str, list[torch.Tensor]] = {}
    for path in sorted(gen_dir.glob("gen_*.pt")):
        shard = torch.load(path)
        for row, domain in zip(shard["ids"].long(), shard["domains"]):
            rows.setdefault(domain, []).append(row)
    return {domain: torch.bincount(torch.cat(r)).numpy().astype(np.int64) for domain, r in rows.items()}


def write_workload_counts(cfg: DistillConfig, folder: Path) -> Path | None:
    """Write ``workload_token_counts`` into the draft folder ``folder`` (``bild_env.models.draft_head.COUNTS_FILE``,
    which a restricted draft head reads: ``load_pair(..., draft_vocab=K)``); None where there are none."""
    from bild_env.models.draft_head import COUNTS_FILE

    if not Path(folder).is_dir():
        raise ValueError(f"{folder} is not a folder: give --out an exported draft folder (default: the committed one)")
    counts = workload_token_counts(cfg)
    if not counts:
        return None
    path = Path(folder) / COUNTS_FILE
    np.savez_compressed(path, **dict(sorted(counts.items())))
    logger.info(f"token counts of the target's TRAIN continuations ({', '.join(f'{d}: {int(c.sum()):,}' for d, c in sorted(counts.items()))}) -> {path}")
    return path


def domain_dirs(cfg: DistillConfig) -> list[tuple[int, Path]]:
    """(chunks asked for, teacher folder) of each kind of domain text ``cfg`` trains on."""
    work = work_dir(cfg)
    return [(getattr(cfg, field), work / teacher_dir) for field, _, teacher_dir in SOURCES.values()
            if getattr(cfg, field) > 0]


def domain_val_dir(cfg: DistillConfig) -> Path:
    """The teacher folder of the domain validation set."""
    return work_dir(cfg) / VAL_DIR[1]
