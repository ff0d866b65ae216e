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
* ``domains``  teacher text from the serving workload (distill/domains.py): ``domain_chunks`` TRAIN
  prompts of the workload's domains (``domain_mix``: prose, code, chat through the chat template)
  continued by the target at ``sample_temperature``, ``draft_domain_chunks`` more continued by the
  exported draft (on-policy), ``greedy_domain_chunks`` distinct ones continued greedily by the target (the
  states lossless greedy decoding asks the draft about), and ``domain_val`` VALIDATION prompts continued
  greedily by the target, which then choose ``best.pt`` (``--wiki 0`` trains on the workload text alone).
* ``train``    distil a small Llama student with the same tokenizer (runs ``teacher``,
  and ``samples`` when sample chunks are asked for, first if needed); resumable from
  ``<work>/ckpt.pt``; keeps ``<work>/best.pt``; ``--init`` starts from the weights of a checkpoint
  or of an exported draft folder (e.g. the committed one, on a machine without the earlier work);
  ``--init-layers 0,1,2`` with ``--layers 3`` starts a shallower student from those of its layers.
* ``export``   write ``best.pt`` (``--from-ckpt last``: ``ckpt.pt``; ``average``: ``average.pt``)
  to ``--out`` as a Hugging Face folder (safetensors, ``save_dtype``) with the target's tokenizer files.
* ``counts``   write ``workload_token_counts.npz`` into ``--out`` (default: the committed draft folder): per domain,
  the token counts of the target's continuations of TRAIN prompts (``domains``' text), which a draft head
  restricted to the workload's most frequent tokens counts (``load_pair(..., draft_vocab=K)``); ``export``
  writes them too.
* ``average``  average the weights of the checkpoints ``--average a.pt,b.pt,...`` (runs of one
  shape, e.g. the last checkpoints of one run, or a run and the run it started from) into
  ``<work>/average.pt`` (with the step and config of the last one listed) and print its
  validation acceptance; ``export --from-ckpt average`` exports it.
* ``lookup``  fit the lookup acceptance predictor (the max probability and whether the proposal continues a span
  the context already holds; :mod:`distill.lookup`, its own options) on positions teacher-forced along the target's
  greedy continuations (:mod:`distill.positions`), AUC / calibration / Brier per domain beside the draft's max
  probability; results JSON with ``--out``.
* ``measure``  on the held-out TEST split: greedy acceptance (draft argmax == target
  argmax, teacher-forced, float32) and per-token decode latency of both models side by
  side (batch 1, KV cache, float32); prints and writes JSON. ``--measure-split validation``
  measures validation articles instead, to choose between drafts without looking at TEST.

Run from the repository root, e.g.::

    nice -n 19 python -m distill train
    python -m distill measure
    python -m distill measure          # the same command line
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace

import torch

from bild_env.cli import add_options, given
from bild_env.command import UsageExit
from bild_env.models.device import cpu_has_native_bf16
from distill.lookup import main as lookup_main
from distill.config import DistillConfig, check_config, logger, out_dir, pick_device
from distill.export import average_checkpoints, export
from distill.measure import measure
from distill.domains import build_domain_data, write_workload_counts
from distill.samples import build_all_samples
from distill.teacher import build_teacher_data
from distill.training import train

COMMANDS = {"teacher": build_teacher_data, "samples": build_all_samples, "domains": build_domain_data, "train": train,
            "counts": lambda cfg: write_workload_counts(cfg, out_dir(cfg)), "average": average_checkpoints,
            "export": export, "measure": measure}
STANDALONE = {"lookup": lookup_main}  # commands with their own options dataclass: main(argv after the command)


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> tuple[str, DistillConfig]:
    """Parse ``<command> --field value ...`` into (command, DistillConfig); ``prog`` names the program in messages."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=[*COMMANDS, *STANDALONE])
    add_options(parser, "distill", DistillConfig, DistillConfig(), bool_values=True)
    namespace = parser.parse_args(argv)
    return namespace.command, replace(DistillConfig(), **given(namespace, "distill"))


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
    logger.warning(message)
    return message


def log_to_stderr() -> None:
    """Send the package's progress lines (INFO and up) to stderr as ``[distill] message``; once per process."""
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[distill] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Dispatch the subcommand."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in STANDALONE:
        STANDALONE[args[0]](args[1:])
        return
    command, cfg = parse_args(argv, prog)
    check_config(command, cfg)  # before anything loads: a UsageError naming the option
    log_to_stderr()
    if cfg.threads and command != "measure":
        torch.set_num_threads(cfg.threads)
    warn_if_bf16_is_emulated(command, cfg)
    try:
        COMMANDS[command](cfg)
    except ValueError as err:  # bad options or folders: the message says what to give (bild_env.command.run_command)
        raise UsageExit(f"python -m distill {command}: {err}") from err
