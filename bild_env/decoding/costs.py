"""The pair's latency cost model on this machine: its forwards timed once, the tables stored, checked when read.

The tables live below the decoders, which charge every forward to them: ``ForwardCost``
(``bild_env.decoding.forward_costs``: one sequence), ``BatchCost`` (``bild_env.decoding.batch_costs``:
B sequences) and ``CostModel`` with its ``LoopCost`` (``bild_env.decoding.cost_model``); their names
can be imported from here too. This module times the pair's forwards and fits those tables:

- ``calibrate``: the fed counts a decoding step can feed (``STEP_FED``, 1 .. 12) where the curve bends
  (``sampling="sparse"``, the default: ``forward_costs.sparse_points``, 8 of the 12 where it is flat or straight;
  "full": every one) at the mean of a few contexts, ``SLOPE_FED`` at the contexts themselves (``CONTEXTS``: the slope
  per cached token comes from them), and a few prefill lengths (``PREFILL_FED``: 16, 32, 64), the cells of each
  call round-robin (``time_grid``), each the median of a few forwards; then the decoding loop's own work, fitted
  on the clock (``bild_env.decoding.loop_costs.calibrate_loop``);
- ``calibrate_batched`` (optional, ``load_or_calibrate_batched``): one forward of B sequences fed n
  tokens each, over B (``BATCH_SIZES``: 1, 2, 4, ... 32) and n (1 .. 12 and the prefill lengths), sparse as
  ``calibrate`` per batch size (prefills up to ``PREFILL_MAX_BATCH`` sequences, larger ones read off the line
  along the batch), with the attention mask and positions the padded decoder gives (``BATCHED_LAYOUT``). Sparse
  tables are stored in the full tables' format (a ``"sampling"`` field says which); tables stored before it, every
  cell timed, are read as they are.

A round of timings during which other processes kept the CPU busy (Linux /proc) is thrown away and
timed again after waiting for them, up to a budget (``MAX_WAIT_S``).

Stored per machine: a calibrated model is kept under a key of the pair (``ModelPair.key``: its weights, not
their folders, and its dtype; a moved or copied cache folder keeps its models), the
device (``device_name``: the CPU's model, family, instruction sets and torch's kernel level, the
thread count) and the torch version, and records the machine in words (``machine_description``). A
model loaded from the cache that was calibrated before this boot of the machine (home folders outlive
machines) is checked by a few quick forwards (``quick_check``, well under a second for smollm2); off
by more than ``CHECK_FACTOR`` either way it is recalibrated, with a message naming both machines. One
calibrated during this boot is not checked: on one machine the rewards stay those of one cost model.
A stored model whose times are not finite numbers > 0 (the constructors refuse them) is timed again with a warning
saying why; so is one from an earlier boot whose table has a forward costing less than 1/``TABLE_SLACK`` of the
smallest one (no timing on a quiet machine does that; one of this boot is kept, with the warning). One process
calibrates per key at a time (a file lock): another one that needs the same model waits and loads what the first
one stored, so concurrent runs share one cost model.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from filelock import FileLock, Timeout

from bild_env.decoding.batch_costs import BatchCost, describe_batched, fit_batched
from bild_env.decoding.cost_model import (  # noqa: F401 (LoopCost: re-exported)
    FORMAT, CostFormatError, CostModel, LoopCost, _implausible, _role_of, _write_json, describe, impossible,
)
from bild_env.decoding.forward_costs import (  # noqa: F401 (re-exported)
    COARSE_FED, STEP_FED, TABLE_SLACK, ForwardCost, fit_table, sparse_points,
)
from bild_env.decoding.kv import crop_cache
from bild_env.decoding.loop_costs import calibrate_loop
from bild_env.models.compat import cache_kwarg
from bild_env.models.device import device_name, machine_description, sync
from bild_env.models.draft_head import proposal_logits
from bild_env.paths import cache_dir, digest

logger = logging.getLogger(__name__)

TIMED = "draft proposal columns"  # in the cache key: a restricted draft head is timed as the decoders read it
# (its K logits alone, ``draft_head.proposal_logits``; tables keyed without it spread them over the vocabulary)
BATCHED_LAYOUT = "masked"  # batched tables timed with a mask and positions, as the padded decoder runs (time_batched_grid)
PREFILL_FED = (16, 32, 64)  # prompt fills (~32 tokens) and replay fills (prompt + reference)
CONTEXTS = (32, 96, 160)  # cached tokens the step forwards are timed on; the table is kept at their mean
BATCH_SIZES = (1, 2, 4, 8, 16, 32)  # sequences per forward in the batched tables (larger where the device allows)
BATCH_CONTEXTS = (32, 160)  # cached tokens per sequence the batched grid is timed on (the slope needs two; ref 96)
SAMPLINGS = ("sparse", "full")  # how a table's cells are chosen (``calibrate``'s ``sampling``)
SLOPE_FED = (1, 4, 12)  # sparse tables: the fed counts timed at every context (for the slope per cached token)
BATCH_SLOPE_FED = (1, 4)  # ... of the batched tables, at every batch size
PREFILL_MAX_BATCH = 8  # sparse batched tables time prefills up to this many sequences; larger batches' prefills are read
# off the line through the two largest timed (the forwards there are bound by their arithmetic: linear in the batch)
REPEATS = 5  # timed rounds of the one-request tables (after one warm-up round)
BATCH_REPEATS = 3  # timed rounds of the batched grid (after one warm-up round): ~1 min for smollm2 on 2 CPU cores
CHECK_FACTOR = 1.5  # a cached model whose quick check times forwards more than this many times off (either way) is recalibrated
CHECK_FED = (1, 4, 12)  # fed counts of the quick check, at the table's reference context
CHECK_REPEATS = 2  # timed rounds of the quick check (after one warm-up round)
CHECK_MAX_WAIT_S = 1.0  # the most the quick check waits for other processes to leave the CPU
CHECK_TRIES = 3  # quick checks before a cached model is judged off (a slow spell of a shared CPU passes)


class _OtherLoad:
    """How many CPU cores other processes (and the hypervisor: steal) kept busy since the last ``take()``.

    Read from Linux's /proc (jiffies); ``take()`` returns None where that cannot be read.
    """

    TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __init__(self) -> None:
        self.last = self._read()

    @staticmethod
    def _read() -> tuple[int, int, float] | None:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:9]]
            with open("/proc/self/stat") as f:
                text = f.read()
            mine = text[text.rindex(")") + 2 :].split()
            return v[0] + v[1] + v[2] + v[5] + v[6] + v[7], int(mine[11]) + int(mine[12]), time.perf_counter()
        except (OSError, ValueError, IndexError):
            return None

    def take(self) -> float | None:
        now, last = self._read(), self.last
        self.last = now
        if now is None or last is None or now[2] <= last[2]:
            return None
        return max(0.0, (now[0] - last[0]) - (now[1] - last[1])) / self.TICK / (now[2] - last[2])


BUSY_CORES = 0.15  # a round during which other processes kept more of a core busy than this is timed again
MAX_WAIT_S = 60.0  # the most one timing waits (idle) for other processes to finish; less for short timings


def _wait_until_quiet(others: _OtherLoad, budget_s: float) -> float:
    """Sleep in half-second steps until other processes leave the CPU (or ``budget_s`` runs out); seconds slept."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < budget_s:
        time.sleep(min(0.5, budget_s))
        busy = others.take()
        if busy is None or busy <= BUSY_CORES:
            break
    others.take()
    return time.perf_counter() - t0


@torch.inference_mode()
def time_batched_grid(model: torch.nn.Module, cells: Sequence[tuple[int, int, int]], device: torch.device, repeats: int,
                      progress=None, stats: dict | None = None,
                      max_wait_s: float | None = None, masked: bool = False) -> list[tuple[int, int, int, float]]:
    """Median ms of forwards of ``batch`` sequences each fed ``fed`` tokens on ``context`` cached ones, per
    ``(batch, fed, context)`` cell.

    Returns ``(batch, fed, context, median_ms)`` per cell, in the order given. One cache per context is
    prefilled with a random row, and repeated ``batch`` times for each batch size (equal-length rows);
    every row is fed its own random tokens, and the cache is cropped back after every timed forward. With
    ``masked`` (the batched tables) each forward is given an attention mask and position ids, as the padded
    batched decoder gives its forwards (``PaddedCache``: rows of different lengths, rolled-back holes): every
    column of every row holds a token but the first cached one, marked a hole, so a model whose masked forward
    runs other kernels than its plain one (the lean forward packs the query heads of each key/value head at
    one new token: 2.5-4x faster attention at B >= 8) is timed on the path the decoder runs; without, no
    mask (the one-request decoders' plain forwards). The cells are timed round-robin, ``repeats`` rounds, so that a slow spell of the
    machine falls on every cell alike; within a round from the smallest forward (``batch * fed``) to the
    largest, after one untimed forward of the smallest (a forward right after a much larger one is slow) (on a shared CPU the speed drifts by 10-20% over seconds). A round
    during which other processes kept more than ``BUSY_CORES`` of a CPU busy (Linux /proc) is thrown
    away; the timing sleeps until they stop and times it again (the rounds thrown away and the waiting
    together cost at most about as long as it has timed, up to ``max_wait_s``, default ``MAX_WAIT_S``; then
    it keeps what it measures; 0 for warm-ups).
    ``stats`` (a dict), when given, gets the
    counts of ``rounds``, ``busy_rounds_dropped``, ``busy_rounds_kept`` and ``waited_s`` added.
    ``progress`` (a tqdm bar) is advanced once per kept forward.
    """
    from transformers import DynamicCache

    vocab = model.get_output_embeddings().weight.shape[0]
    prefixes, caches, ids = {}, {}, {}
    for context in sorted({c for _, _, c in cells}):
        prefixes[context] = DynamicCache(config=model.config)
        if context:
            gen = torch.Generator().manual_seed(context)
            prompt = torch.randint(0, vocab, (1, context), generator=gen).to(device)
            model(prompt, **cache_kwarg(prefixes[context]), use_cache=True, logits_to_keep=1)
    for batch, context in sorted({(b, c) for b, _, c in cells}):
        longest = max(f for b, f, c in cells if (b, c) == (batch, context))
        gen = torch.Generator().manual_seed(1_000_003 * batch + context)
        ids[batch, context] = torch.randint(0, vocab, (batch, longest), generator=gen).to(device)
        cache = caches[batch, context] = copy.deepcopy(prefixes[context]) if batch > 1 else prefixes[context]
        if batch > 1 and context:
            cache.batch_repeat_interleave(batch)
    times: list[list[float]] = [[] for _ in cells]
    max_wait_s = MAX_WAIT_S if max_wait_s is None else max_wait_s
    others, kept, dropped, busy_kept, timing_s, waited_s, dropped_s = _OtherLoad(), 0, 0, 0, 0.0, 0.0, 0.0
    # Smallest forwards first: one right after a much larger one pays for it (on the 2-core EPYC a smollm2
    # draft forward fed 1 token took 19.7 ms after a forward of 32 x 64 tokens instead of 3.6), so each
    # round runs the cells by size and starts with an untimed forward of its smallest cell.
    order = sorted(range(len(cells)), key=lambda i: (cells[i][0] * cells[i][1], cells[i][0] * cells[i][2], i))

    masks: dict = {}
    for batch, f, context in cells if masked else ():
        mask = torch.ones((batch, context + f), dtype=torch.long, device=device)
        mask[:, 0] = 0  # a hole (a rolled-back or padded column), as nearly every padded batch has
        positions = torch.arange(context, context + f, device=device).expand(batch, f)
        masks[batch, f, context] = {"attention_mask": mask, "position_ids": positions}

    def forward(batch: int, f: int, context: int) -> float:
        cache = caches[batch, context]
        extra = masks.get((batch, f, context), {})
        sync(device)
        t0 = time.perf_counter()
        with proposal_logits(model):  # a restricted draft head's K columns, as the decoders read them
            out = model(ids[batch, context][:, :f], **cache_kwarg(cache), use_cache=True, logits_to_keep=f, **extra)
        out.logits[:, -1].argmax(-1).tolist()  # read a result, as the decoders do (synchronizes)
        ms = (time.perf_counter() - t0) * 1000.0
        crop_cache(cache, context)
        return ms

    while kept < repeats:
        round_ms = [0.0] * len(cells)
        started = time.perf_counter()
        forward(*cells[order[0]])  # settles after the previous round's largest forward; not timed
        for i in order:
            round_ms[i] = forward(*cells[i])
        round_s = time.perf_counter() - started
        timing_s += round_s
        busy = others.take()
        budget = min(max_wait_s, 2.0 + timing_s) - waited_s - dropped_s - round_s  # left to wait if this round goes
        if busy is not None and busy > BUSY_CORES and dropped < 3 * repeats and budget > 0:
            dropped += 1
            dropped_s += round_s
            waited_s += _wait_until_quiet(others, budget)
            continue
        kept += 1
        busy_kept += busy is not None and busy > BUSY_CORES
        for cell_times, ms in zip(times, round_ms):
            cell_times.append(ms)
        if progress is not None:
            progress.update(len(cells))
    if stats is not None:
        stats["rounds"] = stats.get("rounds", 0) + kept + dropped
        stats["busy_rounds_dropped"] = stats.get("busy_rounds_dropped", 0) + dropped
        stats["busy_rounds_kept"] = stats.get("busy_rounds_kept", 0) + busy_kept
        stats["waited_s"] = stats.get("waited_s", 0.0) + waited_s
    return [(b, f, c, statistics.median(t)) for (b, f, c), t in zip(cells, times)]


def time_grid(model: torch.nn.Module, cells: Sequence[tuple[int, int]], device: torch.device, repeats: int,
              progress=None, stats: dict | None = None, max_wait_s: float | None = None) -> list[tuple[int, int, float]]:
    """Median ms of forwards of one sequence feeding ``fed`` tokens on ``context`` cached ones, for each
    ``(fed, context)`` cell: ``(fed, context, median_ms)`` per cell (``time_batched_grid`` at batch 1)."""
    rows = time_batched_grid(model, [(1, f, c) for f, c in cells], device, repeats, progress, stats, max_wait_s)
    return [(f, c, ms) for _, f, c, ms in rows]


def time_forwards(model: torch.nn.Module, fed: tuple[int, ...], context: int, device: torch.device,
                  repeats: int, progress=None, stats: dict | None = None) -> list[tuple[int, int, float]]:
    """Median ms of forwards feeding each of ``fed`` tokens on ``context`` cached ones (``time_grid`` at one context)."""
    return time_grid(model, [(f, context) for f in fed], device, repeats, progress, stats)


def _report_busy(stats: dict) -> None:
    """Say whether other processes disturbed a calibration (a warning when slowed timings were kept)."""
    if stats.get("busy_rounds_kept"):
        logger.warning("other processes kept using the CPU: %d of the %d timing rounds kept were slowed by them (and "
                       "%d more were timed again after waiting %.0f s); the cost model holds slowed timings: "
                       "recalibrate (refresh=True) when the machine is quiet", stats["busy_rounds_kept"],
                       stats["rounds"] - stats["busy_rounds_dropped"], stats["busy_rounds_dropped"], stats["waited_s"])
    elif stats.get("busy_rounds_dropped"):
        logger.info("other processes used the CPU during %d timing rounds; they were timed again after waiting %.0f s",
                    stats["busy_rounds_dropped"], stats["waited_s"])


def _fitting(pair, fed: tuple[int, ...], contexts: tuple[int, ...],
             prefill: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The contexts and prefill lengths of a calibration that fit in the pair's positions."""
    contexts = tuple(c for c in contexts if c + max(fed) <= pair.max_positions) or (0,)
    prefill = tuple(p for p in prefill if max(fed) < p <= pair.max_positions)
    return contexts, prefill


def calibrate(pair, fed: tuple[int, ...] = STEP_FED, contexts: tuple[int, ...] = CONTEXTS,
              repeats: int = REPEATS, prefill: tuple[int, ...] = PREFILL_FED, progress=True,
              loop: bool = True, sampling: str = "sparse") -> CostModel:
    """Time both models of ``pair`` and build their cost tables, then (``loop``) the decoding loop's costs.

    ``sampling`` "full": every count in ``fed`` at each of ``contexts`` (the slope per cached token comes from
    them); "sparse" (the default): the counts of ``fed`` where the curve bends (``forward_costs.sparse_points``) at
    the contexts' mean, and ``SLOPE_FED`` at the others for the slope. Either way each of ``prefill`` (longer
    fills) on an empty cache, every cell the median of ``repeats`` forwards timed round-robin (``time_grid``), after
    one untimed pass over every shape (kernels are chosen, and in bfloat16 made, per shape on first use). About 30 s
    for smollm2 in float32 on a 2-core CPU (full). ``progress``: True, a progress bar on a terminal (else a log line
    per model); a tqdm-like bar to advance instead; False, quiet. Then, right after (the machine has not drifted),
    the decoders decode a few prompts on the clock and the loop's own work is fitted to what the clock took beyond
    the tables (``bild_env.decoding.loop_costs.calibrate_loop``).
    """
    contexts, prefill = _fitting(pair, fed, contexts, prefill)
    costs, stats = {}, {}
    with _bar(progress, 2 * _forwards((1,), fed, contexts, prefill, repeats, sampling, SLOPE_FED),
              "timing forwards for the cost model") as bar:
        for role in ("draft", "target"):
            if progress is True and bar is None:
                logger.info("timing %s forwards (%s): %d fed counts at %d contexts and %d prefill lengths, %d times each",
                            role, sampling, len(fed), len(contexts), len(prefill), repeats)
            steps, fills = _time_table(getattr(pair, role), pair.device, (1,), fed, contexts, prefill, repeats, bar, stats,
                                       sampling, SLOPE_FED, masked=False)
            costs[role] = fit_table([(f, c, ms) for _, f, c, ms in steps], [(f, c, ms) for _, f, c, ms in fills])
    _report_busy(stats)
    model = CostModel(costs["draft"], costs["target"], device_name(pair.device), machine_description(pair.device))
    if not loop:
        return model
    fitted, report = calibrate_loop(pair, model, progress=None if isinstance(progress, bool) else progress)
    logger.info("the decoding loop's own work, fitted on the clock: %s", "; ".join(
        f"{name}: tables {r['tables_error']:+.0%} of the clock, with the loop {r['with_loop_error']:+.0%}"
        for name, r in report.items()))
    return replace(model, loop=fitted)


def calibrate_batched(pair, batch_sizes: Sequence[int] = BATCH_SIZES, fed: tuple[int, ...] = STEP_FED,
                      contexts: tuple[int, ...] = BATCH_CONTEXTS, repeats: int = BATCH_REPEATS,
                      prefill: tuple[int, ...] = PREFILL_FED, progress=True,
                      sampling: str = "sparse") -> dict[str, BatchCost]:
    """Time batched forwards of both models of ``pair``: ``{"draft": BatchCost, "target": BatchCost}``.

    ``sampling`` "full": every batch size with every count in ``fed`` at each of ``contexts`` (the slope per cached
    token per sequence comes from them), and with each of ``prefill`` on an empty cache. "sparse" (the default): per
    batch size the counts of ``fed`` where its curve bends (``forward_costs.sparse_points``) at the contexts' mean,
    ``BATCH_SLOPE_FED`` at the contexts themselves for the slope, and the prefills up to ``PREFILL_MAX_BATCH``
    sequences; the cells left untimed are read off the lines through the timed ones (``fit_batched``). Each cell
    the median of ``repeats`` forwards, round-robin (``time_batched_grid``), after one untimed pass over every
    shape. Full: about a minute for smollm2 in bfloat16 on a 2-core CPU (62 s on a quiet AMD EPYC Zen 5 with the
    defaults; several times that while other processes use the CPU), seconds for tiny-random. ``progress`` as
    ``calibrate``'s.
    """
    contexts, prefill = _fitting(pair, fed, contexts, prefill)
    batch_sizes = tuple(sorted({int(b) for b in batch_sizes}))
    tables, stats = {}, {}
    with _bar(progress, 2 * _forwards(batch_sizes, fed, contexts, prefill, repeats, sampling, BATCH_SLOPE_FED),
              "timing batched forwards for the cost model") as bar:
        for role in ("draft", "target"):
            if progress is True and bar is None:
                logger.info("timing batched %s forwards (%s): batch sizes %s, %d fed counts at %d contexts and %d "
                            "prefill lengths, %d times each", role, sampling, batch_sizes, len(fed), len(contexts),
                            len(prefill), repeats)
            steps, fills = _time_table(getattr(pair, role), pair.device, batch_sizes, fed, contexts, prefill, repeats,
                                       bar, stats, sampling, BATCH_SLOPE_FED, masked=True)
            tables[role] = fit_batched(steps, fills, fed=fed if sampling == "sparse" else ())
    _report_busy(stats)
    return tables


def _time_table(model: torch.nn.Module, device: torch.device, batch_sizes: tuple[int, ...], fed: tuple[int, ...],
                contexts: tuple[int, ...], prefill: tuple[int, ...], repeats: int, bar, stats: dict, sampling: str,
                slope_fed: tuple[int, ...], masked: bool) -> tuple[list[tuple[int, int, int, float]], list]:
    """The timed ``(batch, fed, context, ms)`` cells of one model's table: the steps' and the prefills' (``sampling``
    as ``calibrate``'s). Each call of the grid gets one untimed pass over its shapes first."""
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {SAMPLINGS}, not {sampling!r}")

    def grid(cells: list[tuple[int, int, int]]) -> list[tuple[int, int, int, float]]:
        if not cells:
            return []
        time_batched_grid(model, cells, device, 1, bar, max_wait_s=0.0, masked=masked)  # warm-up: every shape once
        return time_batched_grid(model, cells, device, repeats, bar, stats, masked=masked)

    slope, fills, coarse = _planned_cells(batch_sizes, fed, contexts, prefill, sampling, slope_fed)
    if coarse is None:
        rows = grid(slope + fills)
        return rows[: len(rows) - len(fills)], rows[len(rows) - len(fills):]
    ref = _ref_context(contexts)
    fixed = grid(slope + fills)
    planned, seen = coarse[1], 0  # the sparse cells counted in advance (the first bisection); timed so far

    def sparse(cells: list) -> dict:
        nonlocal seen
        beyond = max(0, seen + len(cells) - planned) - max(0, seen - planned)
        if beyond and bar is not None:  # bisected past the count announced: the bar's total grows first
            bar.total = (bar.total or 0) + beyond * (1 + repeats)
        seen += len(cells)
        return {(b, f): ms for b, f, _, ms in grid([(b, f, ref) for b, f in cells])}

    points = sparse_points(sparse, batch_sizes, coarse[0])
    steps = [(b, f, ref, ms) for (b, f), ms in sorted(points.items())]
    return fixed[: len(slope)] + steps, fixed[len(slope):]


def _planned_cells(batch_sizes: tuple[int, ...], fed: tuple[int, ...], contexts: tuple[int, ...],
                   prefill: tuple[int, ...], sampling: str, slope_fed: tuple[int, ...]):
    """What ``_time_table`` times: the step cells timed in full (every one for "full"; the slope's for "sparse"),
    the prefill cells, and for "sparse" (else None) the coarse fed counts with the number of step cells timed when
    each gap's first midpoint shows it flat (more where a curve bends)."""
    fills = [(b, p, 0) for b in batch_sizes for p in prefill]
    if sampling == "full" or not _contiguous(fed):
        return [(b, f, c) for c in contexts for b in batch_sizes for f in fed], fills, None
    ref = _ref_context(contexts)
    slope = [(b, f, c) for c in contexts if c != ref for b in batch_sizes for f in slope_fed if f in fed]
    fills = [cell for cell in fills if cell[0] <= max(PREFILL_MAX_BATCH, batch_sizes[0])]
    coarse = sorted(set([f for f in COARSE_FED if fed[0] < f < fed[-1]] + [fed[0], fed[-1]]))
    first = len(coarse) + sum(b - a > 1 for a, b in zip(coarse, coarse[1:]))
    return slope, fills, (coarse, len(batch_sizes) * first)


def _progress_kwarg(progress) -> dict:
    """``progress=`` for a call down the chain, given only where it is not the default (True)."""
    return {} if progress is True else {"progress": progress}


def _contiguous(fed: tuple[int, ...]) -> bool:
    return tuple(fed) == tuple(range(fed[0], fed[-1] + 1))


def _ref_context(contexts: tuple[int, ...]) -> int:
    """The context a sparse table is timed at: the contexts' mean (where ``fit_table`` keeps the table)."""
    return round(sum(contexts) / len(contexts))


def _forwards(batch_sizes: tuple[int, ...], fed: tuple[int, ...], contexts: tuple[int, ...], prefill: tuple[int, ...],
              repeats: int, sampling: str, slope_fed: tuple[int, ...]) -> int:
    """The forwards a table of one model times, warm-ups included (``_planned_cells``): exact for "full"; for
    "sparse" the count when every gap of ``COARSE_FED`` is flat at its first midpoint (``_time_table`` announces
    the bisections beyond it before timing them)."""
    slope, fills, coarse = _planned_cells(tuple(batch_sizes), fed, contexts, prefill, sampling, slope_fed)
    steps = coarse[1] if coarse else 0
    return ((len(slope) + len(fills)) + steps) * (1 + repeats)


@contextlib.contextmanager
def _bar(progress, total: int, desc: str):
    """The bar a calibration advances: ``progress`` itself when it is one (it then grows by ``total``), a new tqdm
    bar when True and stderr is a terminal, else None."""
    import sys

    from tqdm import tqdm

    if not isinstance(progress, bool) and progress is not None:
        progress.total = (progress.total or 0) + total
        yield progress
        return
    if not (progress and sys.stderr.isatty()):
        yield None
        return
    with tqdm(total=total, desc=desc, unit="forward", leave=False) as bar:
        yield bar


@dataclass(frozen=True)
class QuickCheck:
    """What a few quick forwards say of a stored cost model on this machine.

    ``ratio[role]``: the median over the checked cells of measured / modelled ms (1: as stored); ``busy``:
    other processes kept the CPU busy during timing rounds that were kept (slower forwards then prove
    nothing); ``seconds``: how long the check took.
    """

    ratio: dict[str, float]
    busy: bool
    seconds: float

    @property
    def faster(self) -> bool:
        """Forwards ran more than ``CHECK_FACTOR`` times faster than stored (other load cannot explain that)."""
        return any(r < 1.0 / CHECK_FACTOR for r in self.ratio.values())

    @property
    def slower(self) -> bool:
        return any(r > CHECK_FACTOR for r in self.ratio.values())

    def words(self) -> str:
        return ", ".join(f"{role} {r:.2f}x" for role, r in self.ratio.items())


def _quick(pair, cells: dict[str, list[tuple[int, int, int]]], predict: Callable[[str, int, int, int], float],
           repeats: int) -> QuickCheck:
    """Time ``cells[role]`` (``(batch, fed, context)``) of each model, one warm-up round and ``repeats`` timed
    ones, against ``predict(role, batch, fed, context)``. ``busy`` when other processes used more than
    ``BUSY_CORES`` over the whole check or during a kept round."""
    t0, stats, ratio, whole = time.perf_counter(), {}, {}, _OtherLoad()
    for role, mine in cells.items():
        model = getattr(pair, role)
        time_batched_grid(model, mine, pair.device, 1, max_wait_s=0.0, masked=True)  # warm-up: every shape once
        rows = time_batched_grid(model, mine, pair.device, repeats, stats=stats, max_wait_s=CHECK_MAX_WAIT_S,
                                 masked=True)
        ratio[role] = statistics.median(ms / m if (m := predict(role, b, f, c)) > 0 else math.inf
                                        for b, f, c, ms in rows)
    other = whole.take()
    busy = bool(stats.get("busy_rounds_kept")) or (other is not None and other > BUSY_CORES)
    return QuickCheck(ratio, busy, time.perf_counter() - t0)


def quick_check(pair, model: CostModel, fed: tuple[int, ...] = CHECK_FED, repeats: int = CHECK_REPEATS) -> QuickCheck:
    """Time a few forwards of each model of ``pair`` (each of ``fed`` at the table's reference context, one
    warm-up round and ``repeats`` timed ones) and compare them with ``model``: well under a second for smollm2."""
    cells = {}
    for role in ("draft", "target"):
        cost = model._role(role)
        context = min(cost.ref_context if cost.line is None else CONTEXTS[0], pair.max_positions - max(fed))
        cells[role] = [(1, f, context) for f in fed]
    bare = model.forwards_only()  # the quick check times bare forwards
    return _quick(pair, cells, lambda role, b, f, c: bare.ms(role, f, c), repeats)


def quick_check_batched(pair, tables: dict[str, BatchCost], fed: tuple[int, ...] = (1, 4),
                        repeats: int = CHECK_REPEATS) -> QuickCheck:
    """``quick_check`` of batched tables: the smallest and largest batch size, each fed ``fed`` tokens, at the
    table's reference context (about a second for smollm2 up to B = 32)."""
    cells = {}
    for role, cost in tables.items():
        mine = [f for f in fed if cost.fed[0] <= f <= cost.fed[-1]] or [cost.fed[0]]
        context = min(cost.ref_context, pair.max_positions - max(mine))
        cells[role] = [(b, f, context) for b in sorted({cost.batch[0], cost.batch[-1]}) for f in mine]
    return _quick(pair, cells, lambda role, b, f, c: tables[role](b, f, c), repeats)


def _fits(run_check: Callable[[], QuickCheck], tries: int = CHECK_TRIES) -> tuple[bool, list[QuickCheck]]:
    """Whether stored timings fit this machine: ``(fits, the checks run)``.

    Up to ``tries`` quick checks (``run_check()``), stopping at the first within ``CHECK_FACTOR`` either
    way. They do not fit when every check was off and at least one of them conclusively: faster than
    stored (other load cannot explain that), or slower on a quiet CPU. Checks that were only slower while
    other processes used the CPU prove nothing: the stored timings are kept.
    """
    checks = []
    for _ in range(tries):
        checks.append(run_check())
        if not (checks[-1].faster or checks[-1].slower):
            return True, checks
    return not any(c.faster or not c.busy for c in checks), checks


def _judge(pair, path: Path, what: str, timed_on: str, run_check: Callable[[], QuickCheck]) -> bool:
    """``_fits``, logged: a warning naming both machines when the stored ``what`` in ``path`` is recalibrated
    (False) or kept while a busy CPU ran slower."""
    fits, checks = _fits(run_check)
    here = machine_description(pair.device)
    seen = "; ".join(c.words() for c in checks)
    if not fits:
        logger.warning("the stored %s %s (timed on %s) does not fit this machine (%s): forwards timed now take %s its "
                       "times (more than %.1fx off, in %d quick checks); recalibrating", what, path, timed_on, here,
                       seen, CHECK_FACTOR, len(checks))
    elif checks[-1].slower:
        logger.warning("forwards timed now take %s the times of the stored %s %s (timed on %s), but other processes "
                       "were using the CPU of this machine (%s) during the checks: keeping it; recalibrate "
                       "(refresh=True) on a quiet machine if it is off", seen, what, path, timed_on, here)
    else:
        logger.debug("%s %s checked in %.2f s: %s its times", what, path, sum(c.seconds for c in checks), seen)
    return fits


def _machine_key(pair) -> str:
    """The cache key of ``pair`` on this machine: the pair (dtype included), device (CPU, thread count) and torch, and
    the products plan of each model running the lean forward (``bild_env.models.lean``: a plan chosen again runs
    other kernels, so its times are timed again)."""
    return digest(pair.key, device_name(pair.device), f"torch {torch.__version__}", TIMED, *_lean_plans(pair))


def _lean_plans(pair) -> tuple[str, ...]:
    """``"role plan way/way/..."`` for each model of ``pair`` with the lean forward (none: ``()``)."""
    out = []
    for role in getattr(pair, "lean", ()) or ():
        plan = getattr(getattr(getattr(pair, role, None), "model", None), "plan", None)
        if plan:
            out.append(f"{role} plan {'/'.join(plan[1:])}")
    return tuple(out)


def cost_path(pair) -> Path:
    """Where the cost model of ``pair`` on this device (CPU model and instruction sets, thread count, torch) is stored."""
    return cache_dir("costs") / f"{_machine_key(pair)}.json"


def batched_path(pair, batch_sizes: Sequence[int] = BATCH_SIZES) -> Path:
    """Where the batched tables of ``pair`` over ``batch_sizes`` on this device are stored."""
    sizes = "-".join(str(b) for b in sorted({int(b) for b in batch_sizes}))
    return cache_dir("costs") / f"{_machine_key(pair)}-batched-{sizes}.json"


def _boot_id() -> str | None:
    """This boot of this machine (Linux's random boot id), None where unknown. Timings stored during this
    boot were taken on this very hardware: they are not checked again (a check that found a calibration
    slowed by other processes would otherwise change the rewards between two runs on one machine)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _this_boot(stored: dict) -> bool:
    boot = _boot_id()
    return boot is not None and stored.get("boot") == boot


# What this process read or built per cache file (path, mtime, size, inode, tag): loaded once, checked once.
_LOADED: dict[tuple, object] = {}


def _stamp(path: Path) -> tuple | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return str(path), st.st_mtime_ns, st.st_size, st.st_ino


@contextlib.contextmanager
def _locked(path: Path, what: str) -> Iterator[None]:
    """Hold ``<path>.lock`` (one process at a time builds ``path``); say so when another one holds it."""
    lock = FileLock(f"{path}.lock")
    try:
        lock.acquire(blocking=False)
    except Timeout:
        logger.info("another process is timing %s (it holds %s): waiting for it, then using what it stores", what,
                    lock.lock_file)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _load_or_build(path: Path, read: Callable[[Path, bool], object | None], build: Callable[[], object],
                   write: Callable[[object, Path], None], what: str, refresh: bool = False, tag: str = ""):
    """What ``path`` holds, read once per process, else built (and stored) by one process per machine.

    Under the file lock: a file another process wrote while this one waited is read as fresh
    (``read(path, True)``: calibrated moments ago on this machine); another existing one is read with
    ``read(path, False)``, which returns None when it is unusable (then it is built again). ``refresh``
    builds anew unless another process just did. The file is replaced atomically.
    """
    before = _stamp(path)
    if not refresh and before is not None and (*before, tag) in _LOADED:
        return _LOADED[(*before, tag)]
    with _locked(path, what):
        now = _stamp(path)
        fresh = now is not None and now != before  # written by another process while this one waited
        if now is not None and (fresh or not refresh):
            value = read(path, fresh)
            if value is not None:
                _LOADED[(*now, tag)] = value
                return value
        value = build()
        write(value, path)
        _LOADED[(*_stamp(path), tag)] = value
        return value


def _warn_implausible(why: str | None, what: str) -> None:
    """Say so when tables just timed fail the check of stored ones (``TABLE_SLACK``); they are used."""
    if why:
        logger.warning("the timings just taken for the %s are implausible (%s): other processes may have disturbed "
                       "them; they are used during this boot of the machine (recalibrate, refresh=True, on a quiet "
                       "machine)", what, why)


def _usable(path: Path, what: str, why: str | None, timed_here: bool, redo: str, broken: str | None = None) -> bool:
    """Whether the stored ``what`` in ``path`` that ``implausible`` faults for ``why`` (None: nothing) is used.

    Tables timed on this machine during this boot (``_this_boot``, or just now by another process) are, with a
    warning: timed again they would change the rewards within a boot, as the quick check would (module docstring),
    and a machine whose other processes disturbed the timing (the tiny pair's cells up to 5x off with two busy
    processes on 2 cores) may time them as badly again. Others are timed again, the warning (ending in ``redo``)
    saying why. Tables no machine could have timed (``broken``, from ``cost_model.impossible``: a forward below 0 ms,
    or ``IMPOSSIBLE_FACTOR`` off) are timed again wherever they were timed: rewards from them would be wrong, not noisy.
    """
    if broken is not None:
        logger.warning("the stored %s %s cannot be used (%s): %s", what, path, broken, redo)
        return False
    if why is None:
        return True
    if timed_here:
        logger.warning("implausible timings in the stored %s %s (%s); kept: timed on this machine during this boot "
                       "(recalibrate, refresh=True, on a quiet machine)", what, path, why)
        return True
    logger.warning("the stored %s %s cannot be used (%s): %s", what, path, why, redo)
    return False


def _read_checked(pair, path: Path, fresh: bool) -> CostModel | None:
    """The cost model stored in ``path``, if it can be read and its quick check passes (not run for one
    another process just calibrated, ``fresh``, or one calibrated during this boot of the machine)."""
    try:
        stored = json.loads(path.read_text())
        model = CostModel.from_dict(stored)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        logger.warning("the stored cost model %s cannot be used (not a cost model (no JSON): %s; expected format %d): "
                       "recalibrating", path, err, FORMAT)
        return None
    except (CostFormatError, OSError) as err:
        logger.warning("the stored cost model %s cannot be used (%s; expected format %d): recalibrating",
                       path, err, FORMAT)
        return None
    if not _usable(path, "cost model", model.implausible(), fresh or _this_boot(stored), "recalibrating",
                   model.impossible()):
        return None
    if fresh:
        logger.info("using the cost model another process just calibrated (%s)", path)
        return model
    if _this_boot(stored):
        return model
    return model if _judge(pair, path, "cost model", model.machine or model.device,
                           lambda: quick_check(pair, model)) else None


def load_or_calibrate(pair, refresh: bool = False, progress=True) -> CostModel:
    """The stored cost model of ``pair`` on this machine, calibrating (and storing) it once per machine key.

    A stored file of another format, one that cannot be read, or one holding a time that is not a finite number
    > 0 is recalibrated (and replaced), never reused, with a warning saying why. So is one from an earlier boot
    of the machine whose tables are no timings (a forward below 1/``TABLE_SLACK`` of the smallest one's:
    ``_usable``), or (the hardware may differ) whose ``quick_check`` times forwards more than ``CHECK_FACTOR``
    times off (slower only counts on a quiet CPU). One process calibrates at a time: another one waits and uses
    its model. ``progress`` as ``calibrate``'s (a bar is advanced only when timing).
    """
    path = cost_path(pair)

    def build() -> CostModel:
        logger.info("timing the pair's forwards on %s to build the latency cost model (once; cached in %s)",
                    machine_description(pair.device), path)
        t0 = time.perf_counter()
        model = calibrate(pair, **_progress_kwarg(progress))
        logger.info("cost model ready in %.0f s: %s", time.perf_counter() - t0, describe(model))
        _warn_implausible(model.implausible(), "cost model")
        return model

    def write(model: CostModel, p: Path) -> None:
        _write_json(p, model.to_dict() | {"boot": _boot_id(), "sampling": SAMPLINGS[0]})

    return _load_or_build(path, lambda p, fresh: _read_checked(pair, p, fresh), build, write,
                          "the pair's forwards", refresh)


def forwards_to_time(pair, batch_sizes: Sequence[int] = BATCH_SIZES) -> int:
    """About the forwards ``load_or_calibrate_batched`` will time for ``pair`` (the units it advances a progress bar
    by): the cost model's tables and its loop's generations (``calibrate_loop``: ``LOOP_NEW_TOKENS`` each) where no
    stored cost model exists, and the batched tables where none are stored; 0 where both are (a stored file that
    fails its checks is timed again, and the bar's total grows then). Exact but for the bisections of sparse
    tables (``_forwards``)."""
    from bild_env.decoding.loop_costs import LOOP_METHODS, LOOP_NEW_TOKENS, LOOP_REPEATS, calibration_prompts

    fed, sizes = STEP_FED, tuple(sorted({int(b) for b in batch_sizes}))
    n = 0
    if not cost_path(pair).is_file():
        contexts, prefill = _fitting(pair, fed, CONTEXTS, PREFILL_FED)
        generations = (LOOP_REPEATS * len(calibration_prompts(pair)) + 1) * len(LOOP_METHODS)
        n += 2 * _forwards((1,), fed, contexts, prefill, REPEATS, SAMPLINGS[0], SLOPE_FED) + generations * LOOP_NEW_TOKENS
    if not batched_path(pair, sizes).is_file():
        contexts, prefill = _fitting(pair, fed, BATCH_CONTEXTS, PREFILL_FED)
        n += 2 * _forwards(sizes, fed, contexts, prefill, BATCH_REPEATS, SAMPLINGS[0], BATCH_SLOPE_FED)
    return n


def load_or_calibrate_batched(pair, batch_sizes: Sequence[int] = BATCH_SIZES, refresh: bool = False,
                              progress=True) -> CostModel:
    """The pair's cost model (``load_or_calibrate``) with its batched tables over ``batch_sizes``.

    The tables are timed once per machine key (``calibrate_batched``) and stored beside the cost model,
    under the same lock; they belong to the cost model they were timed with (recalibrated with it), and
    are checked when loaded as the cost model is (readable, finite times > 0, ``TABLE_SLACK`` and
    ``quick_check_batched`` for tables of an earlier boot); tables failing a check are timed again and replaced.
    ``refresh`` calibrates both again; ``progress`` as ``calibrate``'s.
    """
    base = load_or_calibrate(pair, refresh=refresh, **_progress_kwarg(progress))
    base_key = digest(json.dumps(base.to_dict(), sort_keys=True))
    sizes = tuple(sorted({int(b) for b in batch_sizes}))
    path = batched_path(pair, sizes)

    def read(p: Path, fresh: bool) -> dict[str, BatchCost] | None:
        try:
            d = json.loads(p.read_text())
            if d.get("format") != FORMAT or d.get("base") != base_key or d.get("layout") != BATCHED_LAYOUT:
                logger.info("the stored batched tables %s belong to another calibration of the pair: timing them again", p)
                return None
            tables = {role: _role_of(BatchCost.of, d, role, "batched ") for role in ("draft", "target")}
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
            logger.warning("the stored batched tables %s cannot be used (%s): timing them again", p, err)
            return None
        if not _usable(p, "batched tables", _implausible(tables), fresh or _this_boot(d), "timing them again",
                       impossible({f"batched {role}": cost for role, cost in tables.items()}, base)):
            return None
        if fresh:
            logger.info("using the batched tables another process just timed (%s)", p)
            return tables
        if _this_boot(d):
            return tables
        return tables if _judge(pair, p, "batched tables", d.get("machine") or d.get("device"),
                                lambda: quick_check_batched(pair, tables)) else None

    def build() -> dict[str, BatchCost]:
        logger.info("timing batched forwards (batch sizes %s) on %s for the cost model (once; cached in %s)", sizes,
                    machine_description(pair.device), path)
        t0 = time.perf_counter()
        tables = calibrate_batched(pair, sizes, **_progress_kwarg(progress))
        logger.info("batched tables ready in %.0f s: %s", time.perf_counter() - t0, describe_batched(tables))
        _warn_implausible(_implausible(tables), "batched tables")
        return tables

    def write(tables: dict[str, BatchCost], p: Path) -> None:
        _write_json(p, {"format": FORMAT, "base": base_key, "layout": BATCHED_LAYOUT, "sampling": SAMPLINGS[0],
                        "device": base.device,
                        "machine": base.machine, "boot": _boot_id(), "batch_sizes": list(sizes)}
                    | {role: cost.to_dict() for role, cost in tables.items()})

    tables = _load_or_build(path, read, build, write, "the pair's batched forwards", refresh, tag=base_key)
    return replace(base, batched=tables)
