"""Timing the pair's forwards into cost tables (``calibrate``, ``calibrate_batched``: which cells, how often, fitted
how) and checking stored tables against a few quick forwards (``quick_check``, ``quick_check_batched``, ``fits``).
``bild_env.decoding.costs`` stores what these build, per machine, and reads it back."""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from bild_env.decoding.batch_costs import BatchCost, fit_batched
from bild_env.decoding.cost_model import CostModel
from bild_env.decoding.forward_costs import COARSE_FED, STEP_FED, fit_table, sparse_points
from bild_env.decoding.loop_costs import calibrate_loop
from bild_env.decoding.timing import BUSY_CORES, OtherLoad, report_busy, time_batched_grid
from bild_env.models.device import device_name, machine_description

logger = logging.getLogger("bild_env.decoding.costs")  # the calibration's messages, as they were named

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


def fitting(pair, fed: tuple[int, ...], contexts: tuple[int, ...],
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
    contexts, prefill = fitting(pair, fed, contexts, prefill)
    costs, stats = {}, {}
    with _bar(progress, 2 * count_forwards((1,), fed, contexts, prefill, repeats, sampling, SLOPE_FED),
              "timing forwards for the cost model") as bar:
        for role in ("draft", "target"):
            if progress is True and bar is None:
                logger.info("timing %s forwards (%s): %d fed counts at %d contexts and %d prefill lengths, %d times each",
                            role, sampling, len(fed), len(contexts), len(prefill), repeats)
            steps, fills = _time_table(getattr(pair, role), pair.device, (1,), fed, contexts, prefill, repeats, bar, stats,
                                       sampling, SLOPE_FED, masked=False)
            costs[role] = fit_table([(f, c, ms) for _, f, c, ms in steps], [(f, c, ms) for _, f, c, ms in fills])
    report_busy(stats)
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
    contexts, prefill = fitting(pair, fed, contexts, prefill)
    batch_sizes = tuple(sorted({int(b) for b in batch_sizes}))
    tables, stats = {}, {}
    with _bar(progress, 2 * count_forwards(batch_sizes, fed, contexts, prefill, repeats, sampling, BATCH_SLOPE_FED),
              "timing batched forwards for the cost model") as bar:
        for role in ("draft", "target"):
            if progress is True and bar is None:
                logger.info("timing batched %s forwards (%s): batch sizes %s, %d fed counts at %d contexts and %d "
                            "prefill lengths, %d times each", role, sampling, batch_sizes, len(fed), len(contexts),
                            len(prefill), repeats)
            steps, fills = _time_table(getattr(pair, role), pair.device, batch_sizes, fed, contexts, prefill, repeats,
                                       bar, stats, sampling, BATCH_SLOPE_FED, masked=True)
            tables[role] = fit_batched(steps, fills, fed=fed if sampling == "sparse" else ())
    report_busy(stats)
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


def progress_kwarg(progress) -> dict:
    """``progress=`` for a call down the chain, given only where it is not the default (True)."""
    return {} if progress is True else {"progress": progress}


def _contiguous(fed: tuple[int, ...]) -> bool:
    return tuple(fed) == tuple(range(fed[0], fed[-1] + 1))


def _ref_context(contexts: tuple[int, ...]) -> int:
    """The context a sparse table is timed at: the contexts' mean (where ``fit_table`` keeps the table)."""
    return round(sum(contexts) / len(contexts))


def count_forwards(batch_sizes: tuple[int, ...], fed: tuple[int, ...], contexts: tuple[int, ...], prefill: tuple[int, ...],
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
    t0, stats, ratio, whole = time.perf_counter(), {}, {}, OtherLoad()
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


def fits(run_check: Callable[[], QuickCheck], tries: int = CHECK_TRIES) -> tuple[bool, list[QuickCheck]]:
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
