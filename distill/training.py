"""Distilling the student (the ``train`` command): the loss, the schedule, the batches, validation
acceptance, checkpoints and resuming, and the training loop itself."""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LlamaForCausalLM

from distill.config import DistillConfig, init_layers, logger, pick_device, work_dir
from distill.data import load_shards, teacher_dirs
from distill.domains import build_domain_data, domain_dirs, domain_val_dir
from distill.samples import SAMPLE_SOURCES, build_all_samples
from distill.student import build_student, init_state
from distill.teacher import build_teacher_data


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


def resumed_config(cfg: DistillConfig, saved: dict[str, object]) -> DistillConfig:
    """``cfg`` for a run resumed from a checkpoint saved with config ``saved``.

    A resumed run keeps the ``init`` weights it was started from (the command line that resumes
    it need not repeat ``--init``), so its checkpoints, and ``export``'s history, still name them.
    An ``--init`` other than those would be ignored by the resume, so it is refused.
    """
    init, picked = str(saved.get("init", "")), str(saved.get("init_layers", ""))
    if cfg.init and cfg.init != init:
        raise ValueError(f"<work>/ckpt.pt is a run started from {init or 'scratch'!r}, not --init {cfg.init!r}; "
                         "move ckpt.pt (and best.pt) away to start a new run from --init, or drop --init to resume")
    if cfg.init_layers and cfg.init_layers != picked:
        raise ValueError(f"<work>/ckpt.pt is a run started from layers {picked or 'all'!r}, not --init-layers "
                         f"{cfg.init_layers!r}; move ckpt.pt (and best.pt) away, or drop --init-layers to resume")
    return replace(cfg, init=init, init_layers=picked)


def train(cfg: DistillConfig) -> None:
    """Distil the student; resumes from ``<work>/ckpt.pt`` when present."""
    init_layers(cfg)  # a malformed --init-layers is refused before any model or shard loads
    if cfg.wiki:
        build_teacher_data(cfg)
    elif not cfg.domain_val:
        raise ValueError("--wiki 0 needs --domain-val > 0: validation comes from the wiki split otherwise")
    build_all_samples(cfg)
    build_domain_data(cfg)
    work, device = work_dir(cfg), pick_device(cfg)
    data, val = _training_data(cfg, work)
    student = build_student(cfg).to(device).train()
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, betas=(0.9, cfg.beta2), weight_decay=cfg.weight_decay)
    cfg, step, best, history = _resume_or_init(cfg, work, student, opt)
    if step == 0 and cfg.init:  # where the run starts: best.pt is never worse than the --init weights
        best = val_acceptance(student, val, cfg)
        history.append({"step": 0, "loss": None, "val_acceptance": best, "epoch": 0.0, "seconds": 0.0})
        logger.info(f"step 0 (the --init weights): val acceptance {best:.4f}")
        save_ckpt(work / "best.pt", {"model": student.state_dict(), "step": 0, "val_acceptance": best,
                                     "config": asdict(cfg)})
    n = data["ids"].shape[0]
    logger.info(f"student {sum(p.numel() for p in student.parameters()) / 1e6:.2f}M params; "
                f"{n} chunks x {cfg.seq_len} tokens; {cfg.steps} steps of {cfg.batch_size} chunks")
    bar = tqdm(total=cfg.steps, initial=step, desc="distill", unit="step", smoothing=0.05)
    started = time.time()
    while step < cfg.steps:
        loss = _train_step(cfg, step, student, opt, data, device)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", best=f"{best:.3f}")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            acc = val_acceptance(student, val, cfg)
            history.append({"step": step, "loss": loss.item(), "val_acceptance": acc,
                            "epoch": step * cfg.batch_size / n, "seconds": time.time() - started})
            logger.info(f"step {step}: loss {loss.item():.4f}, val acceptance {acc:.4f}")
            if acc > best:
                best = acc
                save_ckpt(work / "best.pt", {"model": student.state_dict(), "step": step, "val_acceptance": acc,
                                             "config": asdict(cfg)})
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            save_ckpt(work / "ckpt.pt", {"model": student.state_dict(), "opt": opt.state_dict(), "step": step,
                                         "best": best, "history": history, "config": asdict(cfg)})
    bar.close()
    logger.info(f"done: best val acceptance {best:.4f}")


def _training_data(cfg: DistillConfig, work: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The teacher data to train on (the split's chunks, then each kind of sampled text asked for) and validation's."""
    parts = [load_shards(teacher_dirs(cfg)[0])] if cfg.wiki else []
    val = load_shards(domain_val_dir(cfg), cfg.domain_val) if cfg.domain_val else load_shards(teacher_dirs(cfg)[1])
    sources = [(getattr(cfg, src.chunks_field), work / src.teacher_dir) for src in SAMPLE_SOURCES.values()]
    for n, folder in sources + domain_dirs(cfg):
        if n > 0:
            parts.append(load_shards(folder, n))
    if not parts:
        raise ValueError("nothing to train on: --wiki 0 with no --sample-chunks, --draft-sample-chunks, "
                         "--domain-chunks, --draft-domain-chunks or --greedy-domain-chunks")
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}, val


def _resume_or_init(cfg: DistillConfig, work: Path, student: LlamaForCausalLM,
                    opt: torch.optim.Optimizer) -> tuple[DistillConfig, int, float, list[dict[str, float]]]:
    """Load ``<work>/ckpt.pt`` into ``student`` and ``opt`` when there is one, else the ``--init`` weights.

    Returns the run's config (a resumed run's keeps its ``init``), its step, best validation
    acceptance and history so far.
    """
    if (work / "ckpt.pt").exists():
        ckpt = torch.load(work / "ckpt.pt", weights_only=False)
        cfg = resumed_config(cfg, ckpt["config"])
        student.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        logger.info(f"resumed at step {ckpt['step']} (best val acceptance {ckpt['best']:.4f})")
        return cfg, ckpt["step"], ckpt["best"], ckpt["history"]
    if cfg.init:
        student.load_state_dict(init_state(cfg.init, student, init_layers(cfg)))
        picked = f", layers {cfg.init_layers}" if cfg.init_layers else ""
        logger.info(f"started from the weights of {cfg.init}{picked} (fresh optimiser, schedule of {cfg.steps} steps)")
    return cfg, 0, -1.0, []


def _train_step(cfg: DistillConfig, step: int, student: LlamaForCausalLM, opt: torch.optim.Optimizer,
                data: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """One optimiser step on ``step``'s batch at ``step``'s learning rate; returns its loss."""
    for group in opt.param_groups:
        group["lr"] = lr_at(step, cfg)
    batch = get_batch(data, batch_rows(step, cfg, data["ids"].shape[0]), device)
    with autocast(cfg, device):
        logits = student(batch["ids"]).logits
    loss = distill_loss(logits, batch, cfg.hard_weight)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(student.parameters(), cfg.grad_clip)
    opt.step()
    return loss
