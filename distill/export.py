"""From checkpoints to the draft: averaging checkpoints (the ``average`` command) and writing one as a
Hugging Face folder with the target's tokenizer files and its training history (the ``export`` command)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from bild_env.models.draft_head import COUNTS_FILE
from distill.config import CHECKPOINT_FILES, DistillConfig, logger, out_dir, pick_device, target_dir, work_dir
from distill.data import load_shards, teacher_dirs
from distill.domains import write_workload_counts
from distill.student import average_states, load_student
from distill.training import save_ckpt, val_acceptance

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
CHECKPOINTS = CHECKPOINT_FILES  # --from-ckpt: its file in <work>


def average_checkpoints(cfg: DistillConfig) -> dict[str, object]:
    """Average the weights of ``--average`` checkpoints into ``<work>/average.pt``; print its val acceptance."""
    paths = [Path(p) for p in cfg.average.split(",") if p.strip()]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"--average: no such checkpoint(s): {', '.join(missing)}")
    ckpts = [torch.load(p, weights_only=False) for p in paths]
    last = ckpts[-1]  # the record keeps the last listed checkpoint's step and config (its run's lineage)
    state = average_states([c["model"] for c in ckpts])
    student = load_student(cfg, last["config"], state)
    work = work_dir(cfg)
    acc = val_acceptance(student.to(pick_device(cfg)), load_shards(teacher_dirs(cfg)[1]), cfg)
    record = {"model": state, "step": last["step"], "val_acceptance": acc, "config": last["config"],
              "averaged": [{"path": str(p), "step": c["step"]} for p, c in zip(paths, ckpts)]}
    save_ckpt(work / "average.pt", record)
    logger.info(f"average of {len(paths)} checkpoints (steps {[c['step'] for c in ckpts]}): "
                f"val acceptance {acc:.4f} -> {work / 'average.pt'}")
    return record


def parent_record(config: dict[str, object], earlier: dict[str, object], history: list) -> dict[str, object] | None:
    """The record of the run whose weights a run with ``config`` (its evaluations so far: ``history``) started
    from, or None.

    ``earlier`` is the record of the draft exported before. A run started from ``--init`` weights
    was started from that export, unless ``earlier`` is an export of this same run, whose parent is
    then the one it names: same ``init`` and ``earlier``'s history the start of this run's (it went on
    from there). The ``init`` alone does not tell: two phases started from the same asset folder name
    the same path but different weights.
    """
    if not config.get("init"):
        return None
    same_init = earlier["config"].get("init") == config["init"]
    before = earlier.get("history", [])
    if same_init and history[: len(before)] == before:
        return earlier.get("init_from")
    return earlier


def export(cfg: DistillConfig) -> Path:
    """Write the chosen checkpoint as a Hugging Face folder at ``out`` (atomically)."""
    work, out = work_dir(cfg), out_dir(cfg)
    if cfg.from_ckpt not in CHECKPOINTS:
        raise ValueError(f"--from-ckpt must be one of {sorted(CHECKPOINTS)}, got {cfg.from_ckpt!r}")
    ckpt = torch.load(work / CHECKPOINTS[cfg.from_ckpt], weights_only=False)
    student = load_student(cfg, ckpt["config"], ckpt["model"]).to(getattr(torch, cfg.save_dtype))
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    student.save_pretrained(staging)
    _copy_companions(cfg, out, staging)
    write_workload_counts(cfg, staging)  # what a restricted head (draft_vocab) counts, where the work folder has them
    record = _history_record(ckpt, work, out)
    (staging / "distill_history.json").write_text(json.dumps(record, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    logger.info(f"exported step {ckpt['step']} to {out}")
    return out


def _copy_companions(cfg: DistillConfig, out: Path, staging: Path) -> None:
    """Into ``staging``: the target's tokenizer files, and the model card and token counts already at ``out`` (kept;
    the counts are written anew where the work folder has the workload text)."""
    for name in TOKENIZER_FILES:
        if (target_dir(cfg) / name).exists():
            shutil.copy(target_dir(cfg) / name, staging / name)
    for name in ("README.md", COUNTS_FILE):
        if (out / name).exists():
            shutil.copy(out / name, staging / name)


def _history_record(ckpt: dict[str, object], work: Path, out: Path) -> dict[str, object]:
    """The exported draft's ``distill_history.json``: step, config and history of its run, what was
    averaged, and the record of the run it started from (read from the draft exported before at ``out``)."""
    last = work / "ckpt.pt"
    history = torch.load(last, weights_only=False)["history"] if last.exists() else []
    record = {"exported_step": ckpt["step"], "config": ckpt["config"], "history": history}
    if "averaged" in ckpt:
        record["averaged"] = ckpt["averaged"]
    earlier = out / "distill_history.json"
    if earlier.exists():
        parent = parent_record(ckpt["config"], json.loads(earlier.read_text()), history)
        if parent is not None:
            record["init_from"] = parent
    return record
