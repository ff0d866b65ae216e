"""Distilling the ``smollm2`` draft from its target, SmolLM2-135M-Instruct, on Wikipedia text.

The package owns the whole recipe behind ``bild_env/assets/smollm2-draft``: teacher data
(:mod:`distill.teacher`, :mod:`distill.samples`), the student (:mod:`distill.student`), training
(:mod:`distill.training`), averaging and export (:mod:`distill.export`) and measurement
(:mod:`distill.measure`), all set by one :class:`DistillConfig` (:mod:`distill.config`).
Its command line (:mod:`distill.cli`, whose docstring lists the subcommands) runs as
``python -m distill <command> --flags``.
"""

from bild_env.models.device import cpu_has_native_bf16
from distill.cli import main, parse_args, warn_if_bf16_is_emulated
from distill.config import DistillConfig, init_layers, out_dir, pick_device, target_dir, work_dir
from distill.data import DOC_SEP, chunk, doc_chunks, layout, load_shards, split_chunks, teacher_dirs, token_stream
from distill.export import average_checkpoints, export, parent_record
from distill.measure import decode_ms, latency, measure
from distill.samples import (SAMPLE_SOURCES, SampleSource, build_all_samples, build_sample_data, draw_tokens,
                             continue_prompts, load_sampler, window_prompts, window_seed)
from distill.student import (SHAPE_FIELDS, average_states, build_student, init_state, load_student, pca_embedding,
                             pick_layers, saved_shape, student_config, widen_mlp)
from distill.teacher import build_teacher_data, load_teacher, teacher_topk, write_shards
from distill.training import (autocast, batch_rows, distill_loss, get_batch, lr_at, resumed_config, save_ckpt, train,
                              val_acceptance)

__all__ = [
    "DOC_SEP", "SAMPLE_SOURCES", "SHAPE_FIELDS", "DistillConfig", "SampleSource", "autocast", "average_checkpoints",
    "average_states", "batch_rows", "build_all_samples", "build_sample_data", "build_student", "build_teacher_data",
    "chunk", "cpu_has_native_bf16", "decode_ms", "distill_loss", "doc_chunks", "draw_tokens", "export", "get_batch",
    "init_layers", "init_state", "latency", "layout", "load_sampler", "load_shards", "load_student", "load_teacher", "lr_at", "main",
    "measure", "out_dir", "parent_record", "parse_args", "pca_embedding", "pick_device", "pick_layers", "resumed_config",
    "continue_prompts", "save_ckpt", "saved_shape", "split_chunks", "student_config", "target_dir",
    "teacher_dirs", "teacher_topk", "token_stream", "train", "val_acceptance", "warn_if_bf16_is_emulated",
    "widen_mlp", "window_prompts", "window_seed", "work_dir",
]
