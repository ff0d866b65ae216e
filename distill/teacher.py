"""The teacher: the target loaded in ``teacher_dtype``, its top-k logits over chunks of text, and the
resumable teacher shards of the TRAIN and validation splits (the ``teacher`` command)."""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from distill.config import DistillConfig, logger, pick_device, target_dir
from distill.data import missing_shards, save_shard, shard_name, split_chunks, teacher_dirs


@torch.inference_mode()
def teacher_topk(model: PreTrainedModel, ids: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Top-k teacher logits for a batch ``ids`` (B, T).

    Returns ``values`` (B, T, k) float16 logits, ``indices`` (B, T, k) int32 token ids
    and ``lse`` (B, T) float32 log-sum-exp over the full vocabulary.
    """
    logits = model(ids).logits.float()
    values, indices = logits.topk(k, dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    return {"values": values.half().cpu(), "indices": indices.int().cpu(), "lse": lse.cpu()}


def load_teacher(cfg: DistillConfig, device: torch.device) -> PreTrainedModel:
    """Load the target in ``teacher_dtype`` for computing distillation targets."""
    dtype = getattr(torch, cfg.teacher_dtype)
    return AutoModelForCausalLM.from_pretrained(target_dir(cfg), dtype=dtype).to(device).eval()


def write_shards(cfg: DistillConfig, chunks: torch.Tensor, folder: Path, desc: str) -> None:
    """Compute and save teacher top-k for ``chunks`` in resumable shards under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    todo = missing_shards(folder, "shard", range(0, chunks.shape[0], cfg.shard_chunks))
    if not todo:
        return
    device = pick_device(cfg)
    model = load_teacher(cfg, device)
    bar = tqdm(total=sum(min(cfg.shard_chunks, chunks.shape[0] - s) for s in todo) * cfg.seq_len,
               desc=desc, unit="tok", smoothing=0.05)
    for start in todo:
        part = chunks[start : start + cfg.shard_chunks]
        pieces = []
        for b in range(0, part.shape[0], cfg.teacher_batch):
            batch = part[b : b + cfg.teacher_batch]
            pieces.append(teacher_topk(model, batch.to(device), cfg.top_k))
            bar.update(batch.numel())
        shard = {key: torch.cat([p[key] for p in pieces]) for key in pieces[0]}
        shard["ids"] = part.int()
        save_shard(shard, folder, shard_name("shard", start))
    bar.close()


def build_teacher_data(cfg: DistillConfig) -> None:
    """Tokenize TRAIN (and validation) text and write teacher shards for both."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir(cfg))
    train = split_chunks(cfg, tokenizer, "train", cfg.max_train_tokens)
    val = split_chunks(cfg, tokenizer, "validation")[: cfg.val_chunks]
    logger.info(f"teacher data ({cfg.layout}): {train.numel():,} train tokens, {val.numel():,} validation tokens")
    train_dir, val_dir = teacher_dirs(cfg)
    write_shards(cfg, val, val_dir, "teacher (validation)")
    write_shards(cfg, train, train_dir, "teacher (train)")
