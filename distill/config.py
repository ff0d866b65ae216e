"""The distillation's settings and where they point: :class:`DistillConfig` (every hyperparameter, with
its default and its ``--help`` text), the folders and device it resolves to, and the package's logger."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bild_env.models.smollm2 import draft_path, ensure_target
from bild_env.paths import cache_dir

logger = logging.getLogger("distill")  # progress lines; `python -m distill` sends them to stderr


@dataclass(frozen=True)
class DistillConfig:
    """Every setting of the distillation, with its default."""

    # paths ("" = default)
    target: str = field(default="", metadata={"help": (
        'converted target folder ("" = ensure_target(): fetched and converted on first use)')})
    work: str = field(default="", metadata={"help": (
        'teacher shards, checkpoints, measurements ("" = cache_dir("smollm2", "distill"))')})
    out: str = field(default="", metadata={"help": 'exported draft folder ("" = the committed asset, draft_path())'})
    seed: int = field(default=0, metadata={"help": (
        "seeds the student's initialisation, the batch order and the sampled windows")})
    device: str = field(default="", metadata={"help": 'torch device ("" = cuda if available else cpu)'})
    threads: int = field(default=0, metadata={"help": (
        "torch CPU threads for teacher/train (0 = torch default); measure uses the default")})
    # student shape (Llama, tied embeddings, same vocab as the target)
    layers: int = field(default=6, metadata={"help": "student decoder layers"})
    hidden: int = field(default=256, metadata={"help": "student hidden size"})
    intermediate: int = field(default=1024, metadata={"help": "student MLP size"})
    heads: int = field(default=4, metadata={"help": "student attention heads"})
    kv_heads: int = field(default=2, metadata={"help": "student key/value heads"})
    head_dim: int = field(default=64, metadata={"help": "student head size"})
    init_embed: str = field(default="pca", metadata={"help": (
        '"pca": target embedding projected on its top singular vectors; else random')})
    init: str = field(default="", metadata={"help": (
        "a checkpoint (.pt) or an exported draft folder whose weights start a new run (fresh optimiser and schedule)")})
    init_layers: str = field(default="", metadata={"help": (
        'which of --init\'s layers the student starts from, e.g. "0,3,5" for a 3-layer student ("" = all, one to '
        "one)")})
    # teacher data
    seq_len: int = field(default=256, metadata={"help": "tokens per training chunk"})
    max_train_tokens: int = field(default=393_216, metadata={"help": (
        "TRAIN tokens taught (0 = the whole split: 850,944 tokens in full chunks)")})
    # "docs" chunks hold DOC_SEP at position 0 (as in `measure` and in the env's prompts), then the next whole articles
    layout: str = field(default="packed", metadata={"help": (
        '"packed": the article stream cut into chunks; "docs": every chunk starts at an article start')})
    val_chunks: int = field(default=48, metadata={"help": "validation chunks that choose best.pt"})
    top_k: int = field(default=32, metadata={"help": "teacher logits kept per position"})
    teacher_batch: int = field(default=16, metadata={"help": "chunks per teacher forward"})
    teacher_dtype: str = field(default="bfloat16", metadata={"help": (
        "the target as teacher and as sampler, and the draft as sampler")})
    shard_chunks: int = field(default=256, metadata={"help": "chunks per teacher (and samples) shard file"})
    # teacher samples: the target's own continuations of TRAIN windows
    sample_chunks: int = field(default=0, metadata={"help": (
        "continuations the target samples from TRAIN windows (0 = none)")})
    sample_prompt: int = field(default=32, metadata={"help": "tokens of TRAIN text that start every sampled chunk"})
    sample_temperature: float = field(default=1.0, metadata={"help": "sampling temperature (no top-k/top-p)"})
    sample_batch: int = field(default=64, metadata={"help": "continuations the target samples at once"})
    # draft samples: on-policy text, cheap to sample; the teacher labels them like any text
    draft_sample_chunks: int = field(default=0, metadata={"help": (
        "continuations the exported draft samples from other TRAIN windows (0 = none)")})
    draft_sample_batch: int = field(default=256, metadata={"help": "continuations the draft samples at once"})
    # the workload's text (distill/domains.py): TRAIN prompts of the serving workload's domains, continued
    domain_mix: str = field(default="prose,code,chat", metadata={"help": (
        "domains and weights of the workload text (bild_env.prompts.domains.parse_mix)")})
    domain_chunks: int = field(default=0, metadata={"help": (
        "chunks the target continues (at sample_temperature) from workload TRAIN prompts")})
    draft_domain_chunks: int = field(default=0, metadata={"help": (
        "chunks the exported draft continues (on-policy) from other TRAIN prompts")})
    greedy_domain_chunks: int = field(default=0, metadata={"help": (
        "chunks the target continues greedily from distinct TRAIN prompts (the states lossless greedy decoding "
        "visits)")})
    domain_val: int = field(default=0, metadata={"help": (
        "VALIDATION prompts continued greedily by the target; > 0: they choose best.pt")})
    wiki: bool = field(default=True, metadata={"help": (
        "also train on the wiki TRAIN split's chunks (and their validation, without domain_val)")})
    # optimisation
    steps: int = field(default=700, metadata={"help": "optimiser steps of the whole schedule"})
    batch_size: int = field(default=8, metadata={"help": "chunks per step (and per validation forward)"})
    lr: float = field(default=2e-3, metadata={"help": "peak learning rate (AdamW)"})
    min_lr_ratio: float = field(default=0.05, metadata={"help": "cosine decay ends at this fraction of lr"})
    warmup_steps: int = field(default=50, metadata={"help": "linear warm-up steps"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay"})
    beta2: float = field(default=0.98, metadata={"help": "AdamW beta2"})
    grad_clip: float = field(default=1.0, metadata={"help": "gradient norm clip"})
    hard_weight: float = field(default=0.0, metadata={"help": "extra cross-entropy on the teacher's argmax"})
    autocast_bf16: bool = field(default=True, metadata={"help": "train under bfloat16 autocast"})
    ckpt_every: int = field(default=50, metadata={"help": "steps between <work>/ckpt.pt saves"})
    eval_every: int = field(default=50, metadata={"help": "steps between validation acceptance checks"})
    save_dtype: str = field(default="bfloat16", metadata={"help": "dtype of the exported weights"})
    # measure
    measure_split: str = field(default="test", metadata={"help": (
        '"validation" to choose between drafts without looking at TEST')})
    measure_texts: int = field(default=200, metadata={"help": "articles measured"})
    measure_max_tokens: int = field(default=512, metadata={"help": "tokens per measured article at most"})
    latency_prompt: int = field(default=32, metadata={"help": "prompt tokens before the timed decode"})
    latency_tokens: int = field(default=64, metadata={"help": "tokens decoded per latency round"})
    latency_rounds: int = field(default=5, metadata={"help": "interleaved draft/target rounds (medians reported)"})
    measure_json: str = field(default="", metadata={"help": (
        'where measure writes ("" = <work>/measure.json (TEST) or <work>/measure_<split>.json)')})
    from_ckpt: str = field(default="best", metadata={"help": 'export: "best", "last" or "average"'})
    average: str = field(default="", metadata={"help": (
        "average: comma-separated checkpoint paths (.pt) whose weights are averaged")})


POSITIVE = ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "seq_len", "val_chunks", "top_k",
            "teacher_batch", "shard_chunks", "sample_prompt", "sample_batch", "draft_sample_batch", "steps", "batch_size",
            "ckpt_every", "eval_every", "measure_texts", "measure_max_tokens", "latency_prompt", "latency_tokens",
            "latency_rounds")  # counts of at least 1 (a teacher keeping --top-k 0 logits would teach nothing)
CHECKPOINT_FILES = {"best": "best.pt", "last": "ckpt.pt", "average": "average.pt"}  # --from-ckpt: its file in <work>
STUDENT_TARGETS = ("llama",)  # the model types whose config a student is shaped from (rms_norm_eps, rope_theta)


RATES = {"lr": ("> 0", lambda v: v > 0), "sample_temperature": ("> 0", lambda v: v > 0),
         "grad_clip": ("> 0", lambda v: v > 0), "beta2": ("in (0, 1)", lambda v: 0 < v < 1),
         "min_lr_ratio": ("in [0, 1]", lambda v: 0 <= v <= 1), "weight_decay": (">= 0", lambda v: v >= 0),
         "hard_weight": (">= 0", lambda v: v >= 0)}


def check_config(command: str, cfg: DistillConfig) -> None:
    """A ``UsageError`` naming the option and what to give, for a setting ``command`` cannot run with: checked before
    anything loads (counts, rates, dtypes, the device, the files the command reads)."""
    import math

    from bild_env.command import UsageError, check_options
    from bild_env.models.device import DTYPES, usable_device

    for name, (what, ok) in RATES.items():  # every float field, before check_options (whose NaN message names no range)
        if not (math.isfinite(getattr(cfg, name)) and ok(getattr(cfg, name))):
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number {what}, got {getattr(cfg, name)}")
    check_options(cfg, POSITIVE, ("threads", "max_train_tokens", "sample_chunks", "draft_sample_chunks",
                                  "domain_chunks", "draft_domain_chunks", "greedy_domain_chunks", "domain_val",
                                  "warmup_steps"))
    for name in ("teacher_dtype", "save_dtype"):
        if getattr(cfg, name) not in DTYPES:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(cfg, name)!r}: give one of "
                             f"{', '.join(sorted(DTYPES))}")
    if cfg.device:
        usable_device(cfg.device)  # a DeviceError (a UsageError) naming the devices this machine has
    if cfg.from_ckpt not in CHECKPOINT_FILES:
        raise UsageError(f"--from-ckpt must be one of {', '.join(CHECKPOINT_FILES)}, got {cfg.from_ckpt!r}")
    _check_files(command, cfg)


def _check_files(command: str, cfg: DistillConfig) -> None:
    """The files ``command`` reads exist and fit: the target folder, ``--average``'s checkpoints, export's one."""
    import json

    from bild_env.command import UsageError

    if cfg.target:
        folder = Path(cfg.target)
        if not (folder / "config.json").is_file():
            raise UsageError(f"--target {folder}: no model folder there (no config.json): give a converted target "
                             "folder, or leave --target out (the smollm2 target, fetched and converted on first use)")
        kind = json.loads((folder / "config.json").read_text()).get("model_type", "?")
        if command != "measure" and kind not in STUDENT_TARGETS:
            raise UsageError(f"--target {folder} is of model type {kind!r}: a student is shaped from the config of a "
                             f"target of model type {', '.join(STUDENT_TARGETS)}; give such a target")
    if command == "average":
        paths = [p.strip() for p in cfg.average.split(",") if p.strip()]
        if not paths:
            raise UsageError("average needs --average a.pt,b.pt,... (the checkpoints whose weights it averages)")
        missing = [p for p in paths if not Path(p).is_file()]
        if missing:
            raise UsageError(f"--average: no such checkpoint(s): {', '.join(missing)}")
    if command == "export":
        ckpt = (Path(cfg.work) if cfg.work else cache_dir("smollm2", "distill")) / CHECKPOINT_FILES[cfg.from_ckpt]
        if not ckpt.is_file():
            raise UsageError(f"export --from-ckpt {cfg.from_ckpt}: no checkpoint {ckpt}: train first (python -m "
                             "distill train), or give the --work folder that holds it")


def init_layers(cfg: DistillConfig) -> list[int] | None:
    """``--init-layers`` as layer indices (None when not given), checked against ``--layers`` and ``--init``.

    Raises ValueError, naming the option and what to give, for anything that is not ``--layers``
    distinct non-negative integers, or when there is no ``--init`` to take them from.
    """
    if not cfg.init_layers.strip():
        return None
    hint = f"give --layers ({cfg.layers}) distinct non-negative layer indices of the --init weights, comma-separated, e.g. --init-layers 0,3,5"
    try:
        layers = [int(part) for part in cfg.init_layers.split(",")]
    except ValueError:
        raise ValueError(f"--init-layers {cfg.init_layers!r} is not a list of integers; {hint}") from None
    if not cfg.init:
        raise ValueError(f"--init-layers {cfg.init_layers!r} needs --init (the weights whose layers it picks)")
    if len(layers) != cfg.layers or len(set(layers)) != len(layers) or min(layers) < 0:
        raise ValueError(f"--init-layers {cfg.init_layers!r}: {hint}")
    return layers


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
        return torch.device(cfg.device)  # checked usable by check_config before the command runs
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
