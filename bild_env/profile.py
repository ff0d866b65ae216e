"""Time a pair's forwards on this machine and write them as a hardware cost profile that any machine can charge.

    python -m bild_env.profile --pair smollm2 --out my-cpu.json                      # this CPU, the pair's dtype
    python -m bild_env.profile --pair opt --device cuda --dtype float16 --name a100-opt-eager --out a100-opt-eager.json
    python -m bild_env.profile --pair tiny-random --batch-sizes 1 2 --out /tmp/tiny.json   # seconds

The profile holds the pair's cost tables as the env times them (``bild_env.decoding.costs.calibrate`` without the
decoding loop's own work, and ``calibrate_batched`` over ``--batch-sizes``) with the device, dtype, shapes and
software they were timed with. Hand it to anyone: ``gymnasium.make("bild_env:BiLD-v1", cost_profile="my-cpu.json")``,
``python train.py --cost-profile my-cpu.json``, ``python -m bench.headroom --cost-profile ...`` then charge those
timings instead of their own machine's (``bild_env.decoding.profiles``; docs: the cost model page).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from bild_env.cli import parse_dataclass, setup_logging
from bild_env.decoding.costs import BATCH_SIZES, calibrate, calibrate_batched
from bild_env.decoding.profiles import CostProfile, ProfileError, check_tables
from bild_env.decoding.timing import BUSY_CORES, busy_cores
from bild_env.command import Failure, UsageError, check_counts, run_command, writable_file
from bild_env.models.device import machine_description
from bild_env.models.pairs import DEFAULT_PAIR, load_pair

MAX_BATCH_SIZE = 256  # the largest --batch-sizes: 8x the envs' largest timed batch (costs.BATCH_SIZES); one forward
# over B sequences holds B x (160 cached + 64 fed) tokens of cache and B x 64 rows of logits (a batch of 100,000 on
# the tiny pair grew past 20 GB before the kernel killed it)
QUIET_WAIT_S = 20.0  # how long the command waits for other processes to leave the CPU before it refuses to time
QUIET_WINDOW_S = 2.0  # ... judged by the cores they kept busy over windows this long (a shared CPU's load is bursty)


@dataclass
class ProfileConfig:
    """What ``python -m bild_env.profile`` times and writes (every default of the command)."""

    out: str = field(default="", metadata={"help": "the profile file to write (.json); required"})
    pair: str = field(default=DEFAULT_PAIR, metadata={"help": "model pair preset whose shapes are timed"})
    name: str = field(default="", metadata={"help": "the profile's name (default: the file's stem)"})
    device: str | None = field(default=None, metadata={"help": "default: cuda if available, else cpu"})
    dtype: str | None = field(default=None, metadata={"help": (
        "default: the preset's (auto: float16 on cuda; on a cpu bfloat16 where native, else float32)")})
    batch_sizes: tuple[int, ...] = field(default=BATCH_SIZES, metadata={"help": (
        "sequences per forward in the batched tables (what BiLD-Serve-v0's max_batch may reach), each 1 to "
        f"{MAX_BATCH_SIZE}")})
    sampling: str = field(default="sparse", metadata={"help": (
        '"sparse": the fed counts where the cost curve bends (the env\'s own); "full": every one')})
    repeats: int = field(default=5, metadata={"help": "forwards per timed cell (the median is kept)"})
    note: str = field(default="", metadata={"help": "anything a reader of the profile must know"})


def check(cfg: ProfileConfig) -> Path:
    """Refuse options that make no sense before any model loads (a ``UsageError``); the output path."""
    if not cfg.out:
        raise UsageError("--out FILE is required: the profile file to write (.json)")
    if not cfg.batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_BATCH_SIZE
                                  for b in cfg.batch_sizes):
        raise UsageError(f"--batch-sizes must be whole numbers from 1 to {MAX_BATCH_SIZE} (the memory of a forward "
                         f"grows with the batch), got {' '.join(map(str, cfg.batch_sizes))}")
    if cfg.sampling not in ("sparse", "full"):
        raise UsageError(f"--sampling must be 'sparse' or 'full', got {cfg.sampling!r}")
    check_counts(cfg, {"repeats": 1})
    return writable_file(cfg.out)


def check_quiet(wait_s: float = QUIET_WAIT_S) -> None:
    """A ``Failure`` before any model loads where other processes keep the CPU busy for ``wait_s`` seconds: the
    timing would wait for them and keep slowed timings, minutes of work whose tables the check of every profile then
    refuses as noise; refused first, at no cost."""
    busy = busy_cores(wait_s, QUIET_WINDOW_S)
    if busy is not None and busy > BUSY_CORES:
        raise Failure(f"other processes keep {busy:.1f} CPU cores busy (for {wait_s:g} s): timings taken now would "
                      "take minutes and come out as noise, which a profile is refused for; run it when the machine is "
                      "quiet (nothing was timed or written)")


def _shapes(pair) -> str:
    def shape(model) -> str:
        c = model.config
        return (f"{type(model).__name__} {getattr(c, 'num_hidden_layers', '?')} layers x "
                f"{getattr(c, 'hidden_size', '?')} wide, vocabulary {getattr(c, 'vocab_size', '?')}")

    return f"draft {shape(pair.draft)} -> target {shape(pair.target)}"


def build(cfg: ProfileConfig, name: str, where: str) -> CostProfile:
    """Load the pair, time it (``calibrate`` without loop costs, ``calibrate_batched``) and describe it. The
    single-sequence tables are checked as soon as they are timed (``profiles.check_tables``, a ProfileError naming
    ``where``): noise found there costs no batched timing."""
    pair = load_pair(cfg.pair, device=cfg.device, dtype=cfg.dtype)
    model = calibrate(pair, repeats=cfg.repeats, loop=False, sampling=cfg.sampling)
    check_tables(model, f"{where} (its single-sequence tables, before the batched ones are timed)")
    batched = calibrate_batched(pair, batch_sizes=cfg.batch_sizes, sampling=cfg.sampling)
    model = model.__class__(model.draft, model.target, model.device, model.machine, batched)
    timed = (f"python -m bild_env.profile --pair {cfg.pair} (calibrate(pair, loop=False, sampling={cfg.sampling!r}, "
             f"repeats={cfg.repeats}) and calibrate_batched(pair, batch_sizes={tuple(cfg.batch_sizes)}, "
             f"sampling={cfg.sampling!r}))")
    return CostProfile(name, model, device=machine_description(pair.device),
                       dtype=str(pair.dtype).replace("torch.", ""), shapes=_shapes(pair),
                       software=f"torch {torch.__version__}, transformers {transformers.__version__}",
                       timed=timed, note=cfg.note or f"the {cfg.pair} pair's own forwards on this machine")


def main(argv: list[str] | None = None) -> int:
    """Exit 0 with the profile written; 2 for an option that makes no sense (before any work); 1 when the timing
    cannot be trusted (nothing is written then): other processes busy before it starts (``check_quiet``), or tables
    that the check of every profile refuses once timed."""
    setup_logging()
    cfg = parse_dataclass(ProfileConfig, argv, __doc__)
    out = check(cfg)
    check_quiet()
    try:
        checked = build(cfg, cfg.name or out.stem, str(out)).save(out)  # what every reader will check, before writing
    except ProfileError as err:
        raise Failure(f"{err} (nothing written; a busy machine times noise: run it when quiet)") from None
    print(f"wrote {out}: {checked.label}, batches up to {checked.largest_batch}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command("python -m bild_env.profile", main))
