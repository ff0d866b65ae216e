"""Text into training chunks, and the shard files that hold them: tokenizing wiki splits into
``seq_len`` chunks (``packed`` or ``docs`` layout), the teacher shard folders, and resumable shard storage."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bild_env.prompts.wiki import load_wiki_texts
from distill.config import DistillConfig, work_dir

DOC_SEP = 0  # "<|endoftext|>" in the SmolLM2 tokenizer: put before every article


def token_stream(tokenizer: AutoTokenizer, texts: list[str]) -> torch.Tensor:
    """Concatenate ``[DOC_SEP] + tokens(text)`` for every text; shape (n_tokens,) int64."""
    ids: list[int] = []
    for row in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.append(DOC_SEP)
        ids.extend(row)
    return torch.tensor(ids, dtype=torch.long)


def chunk(stream: torch.Tensor, seq_len: int, max_tokens: int = 0) -> torch.Tensor:
    """Cut a token stream into full ``seq_len`` chunks; shape (n_chunks, seq_len)."""
    if max_tokens:
        stream = stream[:max_tokens]
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len)


def doc_chunks(tokenizer: AutoTokenizer, texts: list[str], seq_len: int, max_tokens: int = 0) -> torch.Tensor:
    """Chunks that each start at an article start; shape (n_chunks, seq_len) int64.

    A chunk is ``[DOC_SEP] + tokens(article)`` followed by the next articles (each with its
    ``DOC_SEP``) until ``seq_len`` tokens; the rest of the article that crosses the end is dropped
    and the next chunk starts with the article after it. An incomplete last chunk is dropped.
    """
    rows: list[list[int]] = []
    row: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        row += [DOC_SEP] + ids
        if len(row) >= seq_len:
            rows.append(row[:seq_len])
            row = []
            if max_tokens and len(rows) * seq_len >= max_tokens:
                break
    return torch.tensor(rows, dtype=torch.long).view(-1, seq_len)


def split_chunks(cfg: DistillConfig, tokenizer: AutoTokenizer, split: str, max_tokens: int = 0) -> torch.Tensor:
    """The chunks of a wiki split in ``cfg.layout`` (see :class:`DistillConfig`)."""
    texts = load_wiki_texts(split)
    if layout(cfg) == "docs":
        return doc_chunks(tokenizer, texts, cfg.seq_len, max_tokens)
    return chunk(token_stream(tokenizer, texts), cfg.seq_len, max_tokens)


def layout(cfg: DistillConfig) -> str:
    """``cfg.layout``, checked (one place for every command that reads teacher data)."""
    if cfg.layout not in ("packed", "docs"):
        raise ValueError(f"--layout must be 'packed' or 'docs', got {cfg.layout!r}")
    return cfg.layout


def teacher_dirs(cfg: DistillConfig) -> tuple[Path, Path]:
    """The train and validation teacher shard folders of ``cfg.layout`` (``docs`` has its own)."""
    suffix = "" if layout(cfg) == "packed" else f"_{cfg.layout}"
    work = work_dir(cfg)
    return work / f"teacher_train{suffix}", work / f"teacher_val{suffix}"


def missing_shards(folder: Path, prefix: str, starts: range) -> list[int]:
    """The ``starts`` whose shard ``<folder>/<prefix>_<start>.pt`` is not written yet (what a resumed run does)."""
    return [s for s in starts if not (folder / shard_name(prefix, s)).exists()]


def shard_name(prefix: str, start: int) -> str:
    """File name of the shard that begins at chunk ``start``."""
    return f"{prefix}_{start:07d}.pt"


def save_shard(value: object, folder: Path, name: str) -> None:
    """Save ``value`` as ``<folder>/<name>`` atomically (a hidden temp file, then rename)."""
    tmp = folder / f".{name}.tmp"
    torch.save(value, tmp)
    os.replace(tmp, folder / name)


def load_shards(folder: Path, limit: int = 0) -> dict[str, torch.Tensor]:
    """Concatenate the shards in ``folder`` (sorted) into one dict of tensors: all, or the first ``limit`` chunks."""
    shards, rows = [], 0
    for path in sorted(folder.glob("shard_*.pt")):
        if limit and rows >= limit:
            break
        shards.append(torch.load(path))
        rows += shards[-1]["ids"].shape[0]
    if not shards:
        raise FileNotFoundError(f"no teacher shards in {folder}; run the `teacher` command")
    return {key: torch.cat([s[key] for s in shards])[: limit or None] for key in shards[0]}
