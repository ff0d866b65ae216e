"""Sampled teacher text (the ``samples`` command): continuations of seeded TRAIN windows drawn from the
target, or from the exported draft (on-policy text), then labelled by the teacher like any text."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from bild_env.models.compat import cache_kwarg, output_cache
from bild_env.prompts.wiki import load_wiki_texts
from distill.config import DistillConfig, logger, out_dir, pick_device, target_dir, work_dir
from distill.data import missing_shards, save_shard, shard_name, token_stream
from distill.teacher import load_teacher, write_shards


def draw_tokens(logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token per row (B, 1) from ``softmax(logits)`` (B, V), by inverting the CDF at one seeded uniform.

    The same distribution as ``torch.multinomial(softmax(logits), 1)``, which over a 49k
    vocabulary is several times slower on CPU (``python -m scripts.analysis.sampling``).
    """
    cdf = torch.softmax(logits, -1).cumsum(-1)
    u = torch.rand(logits.shape[0], 1, generator=gen).to(logits.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).clamp_max(cdf.shape[-1] - 1)


def eos_ids(model: PreTrainedModel, device: torch.device) -> torch.Tensor:
    """The end-of-sequence ids of ``model``'s config and generation config (1-D int64 on ``device``)."""
    eos = [model.config.eos_token_id, getattr(model.generation_config, "eos_token_id", None)]
    return torch.tensor(sorted({i for e in eos if e is not None for i in ([e] if isinstance(e, int) else e)}),
                        dtype=torch.long, device=device)


def _topk(logits: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Teacher labels of logits (..., V), as :func:`distill.teacher.teacher_topk` stores them."""
    logits = logits.float()
    values, indices = logits.topk(k, dim=-1)
    return {"values": values.half().cpu(), "indices": indices.int().cpu(), "lse": torch.logsumexp(logits, -1).cpu()}


@torch.inference_mode()
def continue_prompts(model: PreTrainedModel, prompts: list[list[int]], length: int, temperature: float,
                     seed: int, top_k: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
    """Each prompt continued by ``model`` to exactly ``length`` tokens in all: (len(prompts), length) int64.

    Prompts of different lengths are left-padded, with an attention mask and explicit position ids,
    so each row is continued as its own batch-of-one would be (up to float rounding). ``temperature``
    0 is greedy; otherwise plain ancestral sampling (:func:`distill.samples.draw_tokens`, seeded).
    End-of-sequence ids are never drawn, so every row is a full chunk.

    With ``top_k`` > 0 (``model`` is the teacher) the second value holds the teacher labels of every
    position of every row, read from the forwards that sampled it (no second pass over the text):
    ``values``/``indices`` (rows, length, top_k) and ``lse`` (rows, length), as the teacher shards hold.
    """
    if not prompts or any(not 0 < len(p) < length for p in prompts):
        raise ValueError(f"every prompt must hold between 1 and {length - 1} tokens")
    device = next(model.parameters()).device
    lengths = [len(p) for p in prompts]
    width, steps = max(lengths), length - min(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    eos = eos_ids(model, device)
    gen = torch.Generator().manual_seed(seed)
    out = model(ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=0 if top_k else 1)
    labels = [_topk(out.logits, top_k)] if top_k else []  # (B, width, k): prompt positions
    pos = pos[:, -1:]
    new = []
    for step in range(steps):
        logits = out.logits[:, -1].float().index_fill(-1, eos, float("-inf"))  # a copy: the model's logits untouched
        token = logits.argmax(-1, keepdim=True) if temperature == 0 else draw_tokens(logits / temperature, gen)
        new.append(token)
        if step == steps - 1 and not top_k:
            break  # with labels, one more forward gives the last position's
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        pos = pos + 1
        out = model(token, **cache_kwarg(output_cache(out)), attention_mask=mask, position_ids=pos, use_cache=True)
        if top_k:
            labels.append(_topk(out.logits, top_k))
    new_ids = torch.cat(new, 1).cpu()
    rows = torch.stack([torch.cat([torch.tensor(p), new_ids[i]])[:length] for i, p in enumerate(prompts)])
    if not top_k:
        return rows, None
    full = {key: torch.cat([part[key] for part in labels], 1) for key in labels[0]}  # (B, width + steps, ...)
    return rows, {key: torch.stack([value[i, width - n : width - n + length] for i, n in enumerate(lengths)])
                  for key, value in full.items()}


class SampleSource(NamedTuple):
    """Where one kind of sampled text comes from and goes to."""

    chunks_field: str  # DistillConfig field: how many chunks
    batch_field: str  # DistillConfig field: sampling batch
    gen_dir: str  # <work>/<gen_dir>: the sampled token ids
    teacher_dir: str  # <work>/<teacher_dir>: their teacher shards
    seed_offset: int  # keeps the two sources' windows apart


SAMPLE_SOURCES = {
    "target": SampleSource("sample_chunks", "sample_batch", "samples", "teacher_samples", 0),
    "draft": SampleSource("draft_sample_chunks", "draft_sample_batch", "samples_draft", "teacher_samples_draft",
                          500_000_017),
}


def load_sampler(cfg: DistillConfig, source: str, device: torch.device) -> PreTrainedModel:
    """The model that samples ``source``'s text: the target (as the teacher) or the exported draft."""
    if source == "target":
        return load_teacher(cfg, device)
    if not (out_dir(cfg) / "config.json").exists():
        raise FileNotFoundError(f"no exported draft in {out_dir(cfg)} to sample from; run `export` first "
                                "or pass --draft-sample-chunks 0")
    return AutoModelForCausalLM.from_pretrained(out_dir(cfg), dtype=getattr(torch, cfg.teacher_dtype)).to(device).eval()


def window_prompts(stream: torch.Tensor, n: int, length: int, seed: int) -> torch.Tensor:
    """``n`` windows of ``length`` tokens at seeded random offsets of ``stream`` (n, length)."""
    offsets = torch.randint(0, stream.numel() - length, (n,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([stream[o : o + length] for o in offsets.tolist()])


def window_seed(cfg: DistillConfig, source: str, start: int) -> int:
    """Seed of the windows of ``source``'s shard starting at chunk ``start`` (apart between sources)."""
    return cfg.seed * 1_000_003 + SAMPLE_SOURCES[source].seed_offset + start


def build_sample_data(cfg: DistillConfig, source: str) -> None:
    """Sample continuations of seeded TRAIN windows with ``source`` and write their teacher shards."""
    src = SAMPLE_SOURCES[source]
    n_chunks = getattr(cfg, src.chunks_field)
    if n_chunks <= 0:
        return
    if not 0 < cfg.sample_prompt < cfg.seq_len:
        raise ValueError(f"--sample-prompt must be in (0, {cfg.seq_len}), got {cfg.sample_prompt}")
    work = work_dir(cfg)
    folder = work / src.gen_dir
    folder.mkdir(parents=True, exist_ok=True)
    starts = range(0, n_chunks, cfg.shard_chunks)
    todo = missing_shards(folder, "gen", starts)
    if todo:
        _sample_shards(cfg, source, folder, todo, n_chunks)
    chunks = torch.cat([torch.load(folder / shard_name("gen", s)) for s in starts]).long()[:n_chunks]
    logger.info(f"{source} samples: {chunks.shape[0]} chunks, {chunks.numel():,} tokens "
                f"({chunks.shape[0] * (cfg.seq_len - cfg.sample_prompt):,} sampled by the {source})")
    write_shards(cfg, chunks, work / src.teacher_dir, f"teacher ({source} samples)")


def _sample_shards(cfg: DistillConfig, source: str, folder: Path, todo: list[int], n_chunks: int) -> None:
    """Sample the chunks of the shards ``todo`` of ``source`` and save each as ``<folder>/gen_<start>.pt``."""
    batch = getattr(cfg, SAMPLE_SOURCES[source].batch_field)
    stream = token_stream(AutoTokenizer.from_pretrained(target_dir(cfg)), load_wiki_texts("train"))
    device = pick_device(cfg)
    model = load_sampler(cfg, source, device)
    sampled = cfg.seq_len - cfg.sample_prompt
    bar = tqdm(total=sum(min(cfg.shard_chunks, n_chunks - s) for s in todo) * sampled,
               desc=f"{source} samples", unit="tok", smoothing=0.05)
    for start in todo:
        n = min(cfg.shard_chunks, n_chunks - start)
        seed = window_seed(cfg, source, start)
        prompts = window_prompts(stream, n, cfg.sample_prompt, seed)
        rows = []
        for b in range(0, n, batch):
            rows.append(continue_prompts(model, prompts[b : b + batch].tolist(), cfg.seq_len,
                                         cfg.sample_temperature, seed + b)[0])
            bar.update(rows[-1].shape[0] * sampled)
        save_shard(torch.cat(rows).int(), folder, shard_name("gen", start))
    bar.close()


def build_all_samples(cfg: DistillConfig) -> None:
    """Both kinds of sampled text that ``cfg`` asks for (nothing when both counts are 0)."""
    for source in SAMPLE_SOURCES:
        build_sample_data(cfg, source)
