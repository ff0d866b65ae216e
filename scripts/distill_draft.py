"""Distil the ``smollm2`` draft model from SmolLM2-135M-Instruct on Wikipedia text.

Subcommands (every hyperparameter is a field of :class:`DistillConfig`, and each field
is a ``--flag`` of every subcommand):

* ``teacher``  run the target over the TRAIN split (packed into ``seq_len`` chunks) and
  the first validation chunks, storing per position the teacher's top-k logits, their
  token ids and the log-sum-exp over the full vocabulary (resumable shards).
* ``samples``  more teacher text: the target *samples* ``sample_chunks`` continuations
  (temperature ``sample_temperature``) of ``sample_prompt``-token windows of the TRAIN
  split, each ``seq_len`` tokens long, then teacher top-k over them like ``teacher``
  (resumable shards in ``<work>/samples`` and ``<work>/teacher_samples``).
  With ``draft_sample_chunks`` > 0 the exported draft (``--out``) samples that many
  more continuations of other windows, which the teacher labels the same way: text
  from the student's own distribution, sampled in a fraction of the target's time
  (``<work>/samples_draft``, ``<work>/teacher_samples_draft``).
* ``train``    distil a small Llama student with the same tokenizer (runs ``teacher``,
  and ``samples`` when sample chunks are asked for, first if needed); resumable from
  ``<work>/ckpt.pt``; keeps ``<work>/best.pt``; ``--init`` starts from the weights of a checkpoint
  or of an exported draft folder (e.g. the committed one, on a machine without the earlier work).
* ``export``   write ``best.pt`` (``--from-ckpt last``: ``ckpt.pt``; ``average``: ``average.pt``)
  to ``--out`` as a Hugging Face folder (safetensors, ``save_dtype``) with the target's tokenizer files.
* ``average``  average the weights of the checkpoints ``--average a.pt,b.pt,...`` (runs of one
  shape, e.g. the last checkpoints of one run, or a run and the run it started from) into
  ``<work>/average.pt`` (with the step and config of the last one listed) and print its
  validation acceptance; ``export --from-ckpt average`` exports it.
* ``measure``  on the held-out TEST split: greedy acceptance (draft argmax == target
  argmax, teacher-forced, float32) and per-token decode latency of both models side by
  side (batch 1, KV cache, float32); prints and writes JSON. ``--measure-split validation``
  measures validation articles instead, to choose between drafts without looking at TEST.

Run from the repository root, e.g.::

    PYTHONPATH=. nice -n 19 python scripts/distill_draft.py train
    PYTHONPATH=. python scripts/distill_draft.py measure
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from bild_env.paths import cache_dir
from bild_env.models.smollm2 import draft_path, ensure_target, greedy_acceptance
from bild_env.prompts.wiki import load_wiki_texts

DOC_SEP = 0  # "<|endoftext|>" in the SmolLM2 tokenizer: put before every article
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class DistillConfig:
    """Every setting of the distillation, with its default."""

    # paths ("" = default: ensure_target(), cache_dir("smollm2", "distill"), draft_path())
    target: str = ""
    work: str = ""
    out: str = ""
    seed: int = 0
    device: str = ""  # "" = cuda if available else cpu
    threads: int = 0  # torch CPU threads for teacher/train (0 = torch default); measure uses the default
    # student shape (Llama, tied embeddings, same vocab as the target)
    layers: int = 6
    hidden: int = 256
    intermediate: int = 1024
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    init_embed: str = "pca"  # "pca": target embedding projected on its top singular vectors
    init: str = ""  # a checkpoint (.pt) or an exported draft folder whose weights start a new run (fresh optimiser and schedule)
    # teacher data
    seq_len: int = 256
    max_train_tokens: int = 393_216  # 0 = the whole TRAIN split (850,944 tokens in full chunks)
    # "packed": the article stream cut into chunks; "docs": every chunk starts at an article start
    # (DOC_SEP at position 0, as in `measure` and in the env's prompts), then the next whole articles
    layout: str = "packed"
    val_chunks: int = 48
    top_k: int = 32
    teacher_batch: int = 16
    teacher_dtype: str = "bfloat16"  # the target as teacher and as sampler, and the draft as sampler
    shard_chunks: int = 256
    # teacher samples (the target's own continuations of TRAIN windows; 0 = none)
    sample_chunks: int = 0
    sample_prompt: int = 32
    sample_temperature: float = 1.0
    sample_batch: int = 64
    # draft samples: the exported draft's own continuations of other TRAIN windows (on-policy
    # text, cheap to sample; the teacher labels them like any text; 0 = none)
    draft_sample_chunks: int = 0
    draft_sample_batch: int = 256
    # optimisation
    steps: int = 700
    batch_size: int = 8
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 50
    weight_decay: float = 0.01
    beta2: float = 0.98
    grad_clip: float = 1.0
    hard_weight: float = 0.0  # extra cross-entropy on the teacher's argmax
    autocast_bf16: bool = True
    ckpt_every: int = 50
    eval_every: int = 50
    save_dtype: str = "bfloat16"
    # measure
    measure_split: str = "test"  # "validation" to choose between drafts without looking at TEST
    measure_texts: int = 200
    measure_max_tokens: int = 512
    latency_prompt: int = 32
    latency_tokens: int = 64
    latency_rounds: int = 5
    measure_json: str = ""  # "" = <work>/measure.json (TEST) or <work>/measure_<split>.json
    from_ckpt: str = "best"  # export: "best", "last" or "average"
    average: str = ""  # average: comma-separated checkpoint paths (.pt) whose weights are averaged


# ----------------------------------------------------------------------------- config


def parse_args(argv: list[str] | None = None) -> tuple[str, DistillConfig]:
    """Parse ``<command> --field value ...`` into (command, DistillConfig)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["teacher", "samples", "train", "average", "export", "measure"])
    for field in dataclasses.fields(DistillConfig):
        flag = "--" + field.name.replace("_", "-")
        if isinstance(field.default, bool):
            parser.add_argument(flag, type=_parse_bool, default=field.default)
        else:
            parser.add_argument(flag, type=type(field.default), default=field.default)
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    return command, DistillConfig(**args)


def _parse_bool(text: str) -> bool:
    """Parse a boolean flag value ("1/0", "true/false", "yes/no", "on/off"); refuse anything else."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a yes/no value: give 1/0, true/false, yes/no or on/off")


def work_dir(cfg: DistillConfig) -> Path:
    """Folder for teacher shards, checkpoints and measurements."""
    path = Path(cfg.work) if cfg.work else cache_dir("smollm2", "distill")
    path.mkdir(parents=True, exist_ok=True)
    return path


def target_dir(cfg: DistillConfig) -> Path:
    """The converted target folder (fetched and converted on first use)."""
    return Path(cfg.target) if cfg.target else ensure_target()


def out_dir(cfg: DistillConfig) -> Path:
    """Where the exported draft goes (default: the committed asset folder)."""
    return Path(cfg.out) if cfg.out else draft_path()


def pick_device(cfg: DistillConfig) -> torch.device:
    """cuda when available (unless ``--device`` says otherwise), else cpu."""
    if cfg.device:
        return torch.device(cfg.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def log(message: str) -> None:
    """Print a timestamped progress line to stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- data


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
    starts = range(0, chunks.shape[0], cfg.shard_chunks)
    todo = [s for s in starts if not (folder / f"shard_{s:07d}.pt").exists()]
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
        tmp = folder / f".shard_{start:07d}.pt.tmp"
        torch.save(shard, tmp)
        os.replace(tmp, folder / f"shard_{start:07d}.pt")
    bar.close()


def build_teacher_data(cfg: DistillConfig) -> None:
    """Tokenize TRAIN (and validation) text and write teacher shards for both."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir(cfg))
    train = split_chunks(cfg, tokenizer, "train", cfg.max_train_tokens)
    val = split_chunks(cfg, tokenizer, "validation")[: cfg.val_chunks]
    log(f"teacher data ({cfg.layout}): {train.numel():,} train tokens, {val.numel():,} validation tokens")
    train_dir, val_dir = teacher_dirs(cfg)
    write_shards(cfg, val, val_dir, "teacher (validation)")
    write_shards(cfg, train, train_dir, "teacher (train)")


def draw_tokens(logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token per row (B, 1) from ``softmax(logits)`` (B, V), by inverting the CDF at one seeded uniform.

    The same distribution as ``torch.multinomial(softmax(logits), 1)``, which over a 49k
    vocabulary is several times slower on CPU (``python -m bench.sampling``).
    """
    cdf = torch.softmax(logits, -1).cumsum(-1)
    u = torch.rand(logits.shape[0], 1, generator=gen).to(logits.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).clamp_max(cdf.shape[-1] - 1)


@torch.inference_mode()
def sample_continuations(model: PreTrainedModel, prompts: torch.Tensor, length: int, temperature: float,
                         seed: int) -> torch.Tensor:
    """Sample continuations of ``prompts`` (B, P) from ``model`` up to ``length`` tokens (B, length).

    Plain ancestral sampling (no top-k/top-p) at ``temperature`` with :func:`draw_tokens`;
    end-of-sequence ids are never drawn, so every row is a full chunk. The same inputs and
    seed give the same rows.
    """
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    eos = [model.config.eos_token_id, getattr(model.generation_config, "eos_token_id", None)]
    eos = torch.tensor(sorted({i for e in eos if e is not None for i in ([e] if isinstance(e, int) else e)}),
                       dtype=torch.long, device=device)
    ids = prompts.to(device)
    out = model(ids, use_cache=True, logits_to_keep=1)
    rows = [ids]
    for _ in range(length - prompts.shape[1]):
        logits = out.logits[:, -1].float() / temperature
        logits.index_fill_(-1, eos, float("-inf"))
        rows.append(draw_tokens(logits, gen))
        out = model(rows[-1], past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(rows, 1).cpu()


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
    n_chunks, batch = getattr(cfg, src.chunks_field), getattr(cfg, src.batch_field)
    if n_chunks <= 0:
        return
    if not 0 < cfg.sample_prompt < cfg.seq_len:
        raise ValueError(f"--sample-prompt must be in (0, {cfg.seq_len}), got {cfg.sample_prompt}")
    work = work_dir(cfg)
    folder = work / src.gen_dir
    folder.mkdir(parents=True, exist_ok=True)
    starts = range(0, n_chunks, cfg.shard_chunks)
    todo = [s for s in starts if not (folder / f"gen_{s:07d}.pt").exists()]
    if todo:
        stream = token_stream(AutoTokenizer.from_pretrained(target_dir(cfg)), load_wiki_texts("train"))
        device = pick_device(cfg)
        model = load_sampler(cfg, source, device)
        bar = tqdm(total=sum(min(cfg.shard_chunks, n_chunks - s) for s in todo) * (cfg.seq_len - cfg.sample_prompt),
                   desc=f"{source} samples", unit="tok", smoothing=0.05)
        for start in todo:
            n = min(cfg.shard_chunks, n_chunks - start)
            seed = window_seed(cfg, source, start)
            prompts = window_prompts(stream, n, cfg.sample_prompt, seed)
            rows = []
            for b in range(0, n, batch):
                rows.append(sample_continuations(model, prompts[b : b + batch], cfg.seq_len,
                                                 cfg.sample_temperature, seed + b))
                bar.update(rows[-1].shape[0] * (cfg.seq_len - cfg.sample_prompt))
            tmp = folder / f".gen_{start:07d}.pt.tmp"
            torch.save(torch.cat(rows).int(), tmp)
            os.replace(tmp, folder / f"gen_{start:07d}.pt")
        bar.close()
    chunks = torch.cat([torch.load(folder / f"gen_{s:07d}.pt") for s in starts]).long()[:n_chunks]
    log(f"{source} samples: {chunks.shape[0]} chunks, {chunks.numel():,} tokens "
        f"({chunks.shape[0] * (cfg.seq_len - cfg.sample_prompt):,} sampled by the {source})")
    write_shards(cfg, chunks, work / src.teacher_dir, f"teacher ({source} samples)")


def build_all_samples(cfg: DistillConfig) -> None:
    """Both kinds of sampled text that ``cfg`` asks for (nothing when both counts are 0)."""
    for source in SAMPLE_SOURCES:
        build_sample_data(cfg, source)


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


# ----------------------------------------------------------------------------- student


def student_config(cfg: DistillConfig, target: LlamaConfig) -> LlamaConfig:
    """The student's Llama config: target vocab, special ids and RoPE; small shape."""
    return LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=target.max_position_embeddings,
        rms_norm_eps=target.rms_norm_eps,
        rope_parameters=dict(target.rope_parameters),
        tie_word_embeddings=True,
        bos_token_id=target.bos_token_id,
        eos_token_id=target.eos_token_id,
        pad_token_id=target.pad_token_id,
    )


@torch.no_grad()
def pca_embedding(target_embed: torch.Tensor, hidden: int) -> torch.Tensor:
    """Project the target embedding (V, D) on its top ``hidden`` right singular vectors.

    Returns (V, hidden) float32; with tied heads the student's logits then start as a
    rank-``hidden`` approximation of the target's ``h @ E.T``.
    """
    emb = target_embed.float()
    eigvals, eigvecs = torch.linalg.eigh(emb.T @ emb)  # ascending, (D,), (D, D)
    basis = eigvecs[:, -hidden:].flip(-1)
    return emb @ basis


SHAPE_FIELDS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim")


def saved_shape(cfg: DistillConfig, saved: dict[str, object]) -> DistillConfig:
    """``cfg`` with the student shape of a checkpoint saved with config ``saved``.

    ``export`` and ``average`` rebuild the student from the checkpoint's own shape, so a student
    trained with other shape flags needs none of them repeated.
    """
    return replace(cfg, **{f: saved[f] for f in SHAPE_FIELDS if f in saved})


def build_student(cfg: DistillConfig) -> LlamaForCausalLM:
    """A fresh student (seeded); embedding from the target's PCA if ``init_embed=pca``."""
    torch.manual_seed(cfg.seed)
    target = AutoModelForCausalLM.from_pretrained(target_dir(cfg), dtype=torch.float32)
    student = LlamaForCausalLM(student_config(cfg, target.config))
    if cfg.init_embed == "pca":
        student.model.embed_tokens.weight.data.copy_(pca_embedding(target.model.embed_tokens.weight, cfg.hidden))
        scale = target.model.norm.weight.detach().float().abs().mean().item()
        student.model.norm.weight.data.fill_(scale)
    student.tie_weights()
    return student


# ----------------------------------------------------------------------------- training


def distill_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor], hard_weight: float) -> torch.Tensor:
    """KL(teacher || student) over the teacher's top-k tokens plus one "rest" bin.

    ``logits`` (B, T, V) student logits; ``batch`` holds teacher ``values`` (B, T, k),
    ``indices`` (B, T, k) and ``lse`` (B, T). Exact KL between the two distributions
    coarsened to k+1 outcomes; mean over positions, in nats.
    """
    logits = logits.float()
    log_q = logits.gather(-1, batch["indices"]) - torch.logsumexp(logits, -1, keepdim=True)
    log_p = batch["values"].float() - batch["lse"].unsqueeze(-1)
    p = log_p.exp()
    kl_top = (p * (log_p - log_q)).sum(-1)
    p_rest = (1 - p.sum(-1)).clamp_min(1e-6)
    q_rest = (1 - log_q.exp().sum(-1)).clamp_min(1e-6)
    loss = (kl_top + p_rest * (p_rest.log() - q_rest.log())).mean()
    if hard_weight:
        loss = loss - hard_weight * log_q[..., 0].mean()
    return loss


def lr_at(step: int, cfg: DistillConfig) -> float:
    """Linear warm-up then cosine decay to ``min_lr_ratio * lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_rows(step: int, cfg: DistillConfig, n: int) -> torch.Tensor:
    """Row indices of ``step``'s batch: epoch-wise seeded permutations (resumable)."""
    rows = []
    for g in range(step * cfg.batch_size, (step + 1) * cfg.batch_size):
        epoch, pos = divmod(g, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 100_003 + epoch))
        rows.append(int(perm[pos]))
    return torch.tensor(rows)


def get_batch(data: dict[str, torch.Tensor], rows: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    """Select rows of the teacher data and move them to ``device`` (ids as int64)."""
    out = {key: value[rows].to(device) for key, value in data.items()}
    out["ids"] = out["ids"].long()
    out["indices"] = out["indices"].long()
    return out


def autocast(cfg: DistillConfig, device: torch.device) -> torch.autocast:
    """bf16 autocast context on ``device`` (disabled when ``autocast_bf16`` is false)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast_bf16)


@torch.no_grad()
def val_acceptance(model: LlamaForCausalLM, val: dict[str, torch.Tensor], cfg: DistillConfig) -> float:
    """Fraction of validation positions where student argmax == teacher top-1."""
    device = next(model.parameters()).device
    model.eval()
    hits = total = 0
    for start in range(0, val["ids"].shape[0], cfg.batch_size):
        batch = get_batch(val, torch.arange(start, min(start + cfg.batch_size, val["ids"].shape[0])), device)
        with autocast(cfg, device):
            pred = model(batch["ids"]).logits.argmax(-1)
        hits += int((pred == batch["indices"][..., 0]).sum())
        total += pred.numel()
    model.train()
    return hits / total


def save_ckpt(path: Path, state: dict[str, object]) -> None:
    """Save a checkpoint atomically (temp file, then rename)."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def init_state(path: str, student: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The weights ``--init`` names, as a float32 state dict for ``student``.

    ``path`` is a training checkpoint (``.pt``) or an exported draft folder (``config.json`` and
    safetensors, any dtype). Weights with a narrower MLP than ``student`` are widened without
    changing the function (:func:`widen_mlp`); any other shape difference is refused with the two shapes.
    """
    src = Path(path)
    if src.is_dir():
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim")
        if (any(getattr(model.config, k) != getattr(student.config, k) for k in keys)
                or model.config.intermediate_size > student.config.intermediate_size):
            raise ValueError(f"--init {path}: that draft is {_shape(model.config)}, the student is "
                             f"{_shape(student.config)}; pass the same --layers/--hidden/--heads/--kv-heads/"
                             "--head-dim and an --intermediate at least as large")
        state = model.state_dict()
    elif src.is_file():
        state = torch.load(src, weights_only=False)["model"]
    else:
        raise FileNotFoundError(f"--init {path}: no such checkpoint (.pt) or exported draft folder")
    return widen_mlp(state, student)


_MLP_GROWING_AXIS = {".mlp.gate_proj.weight": 0, ".mlp.up_proj.weight": 0, ".mlp.down_proj.weight": 1}


@torch.no_grad()
def widen_mlp(state: dict[str, torch.Tensor], student: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """``state`` with every MLP widened to ``student``'s intermediate size, the function unchanged.

    The new units take ``student``'s own (seeded, random) gate and up rows and zero down-projection
    columns, so they add nothing to the output until training moves those columns. A state of
    ``student``'s shape is returned as it is.
    """
    own = student.state_dict()
    out = dict(state)
    for key, value in state.items():
        if key not in own or value.shape == own[key].shape:
            continue
        axis = next((a for suffix, a in _MLP_GROWING_AXIS.items() if key.endswith(suffix)), None)
        if axis is None or value.shape[1 - axis] != own[key].shape[1 - axis] or value.shape[axis] > own[key].shape[axis]:
            raise ValueError(f"--init: {key} is {tuple(value.shape)} there, {tuple(own[key].shape)} in the student; "
                             "only a wider MLP (--intermediate) can be started from narrower weights")
        wide = own[key].detach().clone().to(value.dtype)
        if axis == 1:
            wide.zero_()
        wide.narrow(axis, 0, value.shape[axis]).copy_(value)
        out[key] = wide
    return out


def _shape(config: LlamaConfig) -> str:
    """``layers x hidden (MLP, heads/kv heads x head_dim)`` of a Llama config, for messages."""
    return (f"{config.num_hidden_layers} layers x {config.hidden_size} (MLP {config.intermediate_size}, "
            f"{config.num_attention_heads}/{config.num_key_value_heads} heads x {config.head_dim})")


def resumed_config(cfg: DistillConfig, saved: dict[str, object]) -> DistillConfig:
    """``cfg`` for a run resumed from a checkpoint saved with config ``saved``.

    A resumed run keeps the ``init`` weights it was started from (the command line that resumes
    it need not repeat ``--init``), so its checkpoints, and ``export``'s history, still name them.
    An ``--init`` other than those would be ignored by the resume, so it is refused.
    """
    init = str(saved.get("init", ""))
    if cfg.init and cfg.init != init:
        raise ValueError(f"<work>/ckpt.pt is a run started from {init or 'scratch'!r}, not --init {cfg.init!r}; "
                         "move ckpt.pt (and best.pt) away to start a new run from --init, or drop --init to resume")
    return replace(cfg, init=init)


def train(cfg: DistillConfig) -> None:
    """Distil the student; resumes from ``<work>/ckpt.pt`` when present."""
    build_teacher_data(cfg)
    build_all_samples(cfg)
    work, device = work_dir(cfg), pick_device(cfg)
    data, val = (load_shards(d) for d in teacher_dirs(cfg))
    for src in SAMPLE_SOURCES.values():
        if getattr(cfg, src.chunks_field) > 0:
            samples = load_shards(work / src.teacher_dir, getattr(cfg, src.chunks_field))
            data = {key: torch.cat([data[key], samples[key]]) for key in data}
    student = build_student(cfg).to(device).train()
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, betas=(0.9, cfg.beta2), weight_decay=cfg.weight_decay)
    step, best, history = 0, -1.0, []
    if (work / "ckpt.pt").exists():
        ckpt = torch.load(work / "ckpt.pt", weights_only=False)
        cfg = resumed_config(cfg, ckpt["config"])
        student.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        step, best, history = ckpt["step"], ckpt["best"], ckpt["history"]
        log(f"resumed at step {step} (best val acceptance {best:.4f})")
    elif cfg.init:
        student.load_state_dict(init_state(cfg.init, student))
        log(f"started from the weights of {cfg.init} (fresh optimiser, schedule of {cfg.steps} steps)")
    n = data["ids"].shape[0]
    log(f"student {sum(p.numel() for p in student.parameters()) / 1e6:.2f}M params; "
        f"{n} chunks x {cfg.seq_len} tokens; {cfg.steps} steps of {cfg.batch_size} chunks")
    bar = tqdm(total=cfg.steps, initial=step, desc="distill", unit="step", smoothing=0.05)
    started = time.time()
    while step < cfg.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = get_batch(data, batch_rows(step, cfg, n), device)
        with autocast(cfg, device):
            logits = student(batch["ids"]).logits
        loss = distill_loss(logits, batch, cfg.hard_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", best=f"{best:.3f}")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            acc = val_acceptance(student, val, cfg)
            history.append({"step": step, "loss": loss.item(), "val_acceptance": acc,
                            "epoch": step * cfg.batch_size / n, "seconds": time.time() - started})
            log(f"step {step}: loss {loss.item():.4f}, val acceptance {acc:.4f}")
            if acc > best:
                best = acc
                save_ckpt(work / "best.pt", {"model": student.state_dict(), "step": step, "val_acceptance": acc,
                                             "config": asdict(cfg)})
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            save_ckpt(work / "ckpt.pt", {"model": student.state_dict(), "opt": opt.state_dict(), "step": step,
                                         "best": best, "history": history, "config": asdict(cfg)})
    bar.close()
    log(f"done: best val acceptance {best:.4f}")


# ----------------------------------------------------------------------------- average


def average_states(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The element-wise mean of state dicts of one shape (float32 sums, each tensor's dtype kept)."""
    if len(states) < 2:
        raise ValueError(f"averaging needs at least two checkpoints, got {len(states)}")
    for i, state in enumerate(states[1:], 1):
        if state.keys() != states[0].keys() or any(state[k].shape != states[0][k].shape for k in state):
            raise ValueError(f"checkpoint {i} has other parameters or shapes than checkpoint 0; "
                             "only checkpoints of one student shape can be averaged")
    return {k: (sum(s[k].float() for s in states) / len(states)).to(states[0][k].dtype) for k in states[0]}


def average_checkpoints(cfg: DistillConfig) -> dict[str, object]:
    """Average the weights of ``--average`` checkpoints into ``<work>/average.pt``; print its val acceptance."""
    paths = [Path(p) for p in cfg.average.split(",") if p.strip()]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"--average: no such checkpoint(s): {', '.join(missing)}")
    ckpts = [torch.load(p, weights_only=False) for p in paths]
    last = ckpts[-1]  # the record keeps the last listed checkpoint's step and config (its run's lineage)
    state = average_states([c["model"] for c in ckpts])
    target = AutoModelForCausalLM.from_pretrained(target_dir(cfg), dtype=torch.float32)
    student = LlamaForCausalLM(student_config(saved_shape(cfg, last["config"]), target.config))
    student.load_state_dict(state)
    work = work_dir(cfg)
    acc = val_acceptance(student.to(pick_device(cfg)), load_shards(teacher_dirs(cfg)[1]), cfg)
    record = {"model": state, "step": last["step"], "val_acceptance": acc, "config": last["config"],
              "averaged": [{"path": str(p), "step": c["step"]} for p, c in zip(paths, ckpts)]}
    save_ckpt(work / "average.pt", record)
    log(f"average of {len(paths)} checkpoints (steps {[c['step'] for c in ckpts]}): "
        f"val acceptance {acc:.4f} -> {work / 'average.pt'}")
    return record


# ----------------------------------------------------------------------------- export


def parent_record(config: dict[str, object], earlier: dict[str, object]) -> dict[str, object] | None:
    """The record of the run whose weights a run with ``config`` started from, or None.

    ``earlier`` is the record of the draft exported before. A run started from ``--init`` weights
    was started from that export, unless ``earlier`` is an export of this same run (same ``init``),
    whose parent is then the one it names.
    """
    if not config.get("init"):
        return None
    if earlier["config"].get("init") == config["init"]:
        return earlier.get("init_from")
    return earlier


def export(cfg: DistillConfig) -> Path:
    """Write the chosen checkpoint as a Hugging Face folder at ``out`` (atomically)."""
    work, out = work_dir(cfg), out_dir(cfg)
    names = {"best": "best.pt", "last": "ckpt.pt", "average": "average.pt"}
    if cfg.from_ckpt not in names:
        raise ValueError(f"--from-ckpt must be one of {sorted(names)}, got {cfg.from_ckpt!r}")
    ckpt = torch.load(work / names[cfg.from_ckpt], weights_only=False)
    target = AutoModelForCausalLM.from_pretrained(target_dir(cfg), dtype=torch.float32)
    student = LlamaForCausalLM(student_config(saved_shape(cfg, ckpt["config"]), target.config))
    student.load_state_dict(ckpt["model"])
    student = student.to(getattr(torch, cfg.save_dtype))
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    student.save_pretrained(staging)
    for name in TOKENIZER_FILES:
        if (target_dir(cfg) / name).exists():
            shutil.copy(target_dir(cfg) / name, staging / name)
    keep = out / "README.md"
    if keep.exists():
        shutil.copy(keep, staging / "README.md")
    last = work / "ckpt.pt"
    history = torch.load(last, weights_only=False)["history"] if last.exists() else []
    record = {"exported_step": ckpt["step"], "config": ckpt["config"], "history": history}
    if "averaged" in ckpt:
        record["averaged"] = ckpt["averaged"]
    earlier = out / "distill_history.json"
    if earlier.exists():
        parent = parent_record(ckpt["config"], json.loads(earlier.read_text()))
        if parent is not None:
            record["init_from"] = parent
    (staging / "distill_history.json").write_text(json.dumps(record, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    log(f"exported step {ckpt['step']} to {out}")
    return out


# ----------------------------------------------------------------------------- measure


@torch.inference_mode()
def decode_ms(model: PreTrainedModel, prompt: torch.Tensor, n_tokens: int) -> float:
    """Mean milliseconds per greedy token: batch 1, one token per forward, KV cache."""
    out = model(prompt.unsqueeze(0), use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    start = time.perf_counter()
    for _ in range(n_tokens):
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
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


def cpu_has_native_bf16() -> bool | None:
    """Whether this CPU does bfloat16 arithmetic in hardware (AVX-512 BF16 or AMX), as torch detects it.

    None when this torch build cannot tell. Without it torch emulates bfloat16 on CPU: a bf16-autocast
    training step of the default student measured about 30x slower than float32 on a 2-core AVX2-only
    AMD EPYC (results/smollm2_draft.md).
    """
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:
        return None


def warn_if_bf16_is_emulated(command: str, cfg: DistillConfig) -> str | None:
    """Log (and return) a warning when ``command`` would run bfloat16 on a CPU that only emulates it."""
    if pick_device(cfg).type != "cpu" or cpu_has_native_bf16() is not False:
        return None
    uses = []
    if command == "train" and cfg.autocast_bf16:
        uses.append("bf16 autocast (--autocast-bf16 0 trains in float32)")
    if command in ("teacher", "samples", "train") and cfg.teacher_dtype == "bfloat16":
        uses.append("a bfloat16 teacher/sampler (--teacher-dtype float32)")
    if not uses:
        return None
    message = ("WARNING: this CPU has no native bfloat16 (no AVX-512 BF16 or AMX), so torch emulates it "
               "and it runs many times slower than float32: " + "; ".join(uses))
    log(message)
    return message


def main(argv: list[str] | None = None) -> None:
    """Dispatch the subcommand."""
    command, cfg = parse_args(argv)
    if cfg.threads and command != "measure":
        torch.set_num_threads(cfg.threads)
    warn_if_bf16_is_emulated(command, cfg)
    if command == "teacher":
        build_teacher_data(cfg)
    elif command == "samples":
        build_all_samples(cfg)
    elif command == "train":
        train(cfg)
    elif command == "average":
        average_checkpoints(cfg)
    elif command == "export":
        export(cfg)
    else:
        measure(cfg)


if __name__ == "__main__":
    main()
