"""Timing the pair's forwards into cost tables (``calibrate``, ``calibrate_batched``: which cells, how often, fitted
how), checking stored tables against a few quick forwards (``quick_check``, ``quick_check_batched``, ``fits``), and
the one check of every table of times, wherever it comes from (``faults``, ``model_faults``, ``number_faults``: a
cache, a profile shipped, written or varied). ``bild_env.decoding.costs`` stores what these build, per machine, and
reads it back; ``bild_env.decoding.profiles`` reads tables timed elsewhere."""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from bild_env.decoding.batch_costs import BatchCost, fit_batched, fit_table
from bild_env.decoding.cost_model import CostModel, _implausible, impossible
from bild_env.decoding.forward_costs import COARSE_FED, STEP_FED, ForwardCost, sparse_points
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
              loop: bool = True, sampling: str = "sparse", stats: dict | None = None) -> CostModel:
    """Time both models of ``pair`` and build their cost tables, then (``loop``) the decoding loop's costs.

    ``sampling`` "full": every count in ``fed`` at each of ``contexts`` (the slope per cached token comes from
    them); "sparse" (the default): the counts of ``fed`` where the curve bends (``forward_costs.sparse_points``) at
    the contexts' mean, and ``SLOPE_FED`` at the others for the slope. Either way each of ``prefill`` (longer
    fills) on an empty cache, every cell the median of ``repeats`` forwards timed round-robin (``time_batched_grid``,
    unmasked), after one untimed pass over every shape (kernels are chosen, and in bfloat16 made, per shape on first
    use). About 30 s for smollm2 in float32 on a 2-core CPU (full). ``progress``: True, a progress bar on a terminal (else a log line
    per model); a tqdm-like bar to advance instead; False, quiet. Then, right after (the machine has not drifted),
    the decoders decode a few prompts on the clock and the loop's own work is fitted to what the clock took beyond
    the tables (``bild_env.decoding.loop_costs.calibrate_loop``). ``stats``: a dict given receives the timing's
    counts (``time_batched_grid``'s: ``busy_rounds_kept`` the rounds other processes slowed that were kept).
    """
    contexts, prefill = fitting(pair, fed, contexts, prefill)
    costs, stats = {}, ({} if stats is None else stats)
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
                      sampling: str = "sparse", stats: dict | None = None) -> dict[str, BatchCost]:
    """Time batched forwards of both models of ``pair``: ``{"draft": BatchCost, "target": BatchCost}``.

    ``sampling`` "full": every batch size with every count in ``fed`` at each of ``contexts`` (the slope per cached
    token per sequence comes from them), and with each of ``prefill`` on an empty cache. "sparse" (the default): per
    batch size the counts of ``fed`` where its curve bends (``forward_costs.sparse_points``) at the contexts' mean,
    ``BATCH_SLOPE_FED`` at the contexts themselves for the slope, and the prefills up to ``PREFILL_MAX_BATCH``
    sequences; the cells left untimed are read off the lines through the timed ones (``fit_batched``). Each cell
    the median of ``repeats`` forwards, round-robin (``time_batched_grid``), after one untimed pass over every
    shape. Full: about a minute for smollm2 in bfloat16 on a 2-core CPU (62 s on a quiet AMD EPYC Zen 5 with the
    defaults; several times that while other processes use the CPU), seconds for tiny-random. ``progress`` and
    ``stats`` as ``calibrate``'s.
    """
    contexts, prefill = fitting(pair, fed, contexts, prefill)
    batch_sizes = tuple(sorted({int(b) for b in batch_sizes}))
    tables, stats = {}, ({} if stats is None else stats)
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


# --------------------------------------------------------------------------------------------------------------------
# The one check of every table of times, wherever it comes from: a cache this machine timed (``costs``), a profile
# shipped, written or scaled (``profiles``), a profile being written (``bild_env.profile``)

MAX_FORWARD_MS = 3_600_000.0  # an hour: no table holds a forward longer (each cell is the median of several forwards,
# a table hundreds of cells; the slowest real one here, a 2-core CPU's smollm2 target over 32 sequences fed 64, is ~2 s)
REACH_TOKENS = 2048  # the most cached tokens the check reads a table at where the pair is unknown (a profile): the OPT
# pair's positions; a cache is read up to its pair's own (``ModelPair.max_positions``)
COUNTS = ("fed", "batch", "ref_context")  # the fields of a saved table that count tokens or sequences: whole numbers
NUMBERS = ("ms", "per_context_ms", "line")  # ... that hold milliseconds: numbers


def number_faults(saved: object, prefix: str = "") -> str | None:
    """Where a saved cost model (``CostModel.to_dict``'s dict, or a batched cache's, its tables under "draft" and
    "target": ``prefix`` "batched ") holds a count that is no whole number (a fed count of 1.5) or a time that is no
    number (the text "17.9", true), in words naming the table and the cell; None where every one is. The constructors
    would read "17.9" as 17.9 and 1.5 as 1 without a word; tables missing or of another shape are left to them."""
    if not isinstance(saved, dict):
        return None
    tables = {f"{prefix}{role}": saved.get(role) for role in ("draft", "target")}
    if isinstance(saved.get("batched"), dict):
        tables |= {f"batched {role}": saved["batched"].get(role) for role in ("draft", "target")}
    for name, table in tables.items():
        for key, value in (table.items() if isinstance(table, dict) else ()):
            if key in COUNTS + NUMBERS and (why := _not_numbers(value, whole=key in COUNTS)):
                return f"its {name} table's {key}{why}"
    loop = saved.get("loop")
    for key, value in (loop.items() if isinstance(loop, dict) else ()):
        if why := _not_numbers(value, whole=False):
            return f"its loop costs' {key}{why}"
    return None


def _not_numbers(value: object, whole: bool, where: str = "") -> str | None:
    """`` {where} is {value!r}, not a ...`` for the first entry of ``value`` (a number or nested lists of them, None
    allowed) that is no number (``whole``: no whole number), else None."""
    if value is None:
        return None
    if isinstance(value, list):
        for i, v in enumerate(value):
            if why := _not_numbers(v, whole, f"{where}[{i}]"):
                return why
        return None
    if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
        return f"{where} is {value!r}, not a {'whole number' if whole else 'number'} (JSON numbers are unquoted)"
    return None


def faults(tables: dict[str, ForwardCost | BatchCost], base: CostModel | None = None,
           reach: int = REACH_TOKENS) -> tuple[str | None, str | None]:
    """``(broken, odd)``: why no machine could have timed ``tables`` (by name: "target", "batched draft"), and why no
    quiet one would have; None where it could. Every table of times is checked by this, wherever it comes from.

    Broken: ``cost_model.impossible`` (a slope that dwarfs the forward, a forward ``IMPOSSIBLE_FACTOR`` off its
    neighbour or its linear growth, along the tokens fed or the batch, a batched table that far off ``base``'s single
    forward), or a forward over ``MAX_FORWARD_MS`` or not finite where an env reads one (``_reach``: up to ``reach``
    cached tokens). Odd: ``TABLE_SLACK``'s dip (``cost_model._implausible``), or a forward of 0 ms or less where an
    env reads one (with no cached tokens: a prefill's). A profile is refused for either; a cache is timed again where
    broken, and where odd unless timed during this boot (``costs._usable``)."""
    broken = impossible(tables, base) or _beyond(tables, reach)
    return broken, _implausible(tables) or _below_zero(tables)


def model_faults(model: CostModel, reach: int = REACH_TOKENS) -> tuple[str | None, str | None]:
    """``faults`` of a cost model's tables, its batched ones against its own single forwards."""
    tables = {role: model._role(role) for role in ("draft", "target")}
    return faults(tables | {f"batched {role}": cost for role, cost in (model.batched or {}).items()}, model, reach)


def _reach(cost: ForwardCost | BatchCost) -> list[tuple[str, Callable[[float], float]]]:
    """The forwards an env can ask ``cost`` for, by label, each as a function of the cached tokens: every batch size
    from 1 to the largest the table holds, fed 1 to its largest count (piecewise linear between the points, so its
    points say all: beyond the largest batch a profile is refused, ``profiles.check_batch``)."""
    if isinstance(cost, BatchCost):
        return [(f"batch {b} fed {f}", lambda c, b=b, f=f: cost(b, f, c))
                for b in sorted({1, *cost.batch}) for f in sorted({1, *cost.fed})]
    feds = (1,) if cost.line is not None else sorted({1, *cost.fed})
    return [(f"fed {f}", lambda c, f=f: cost(f, c)) for f in feds]


def _beyond(tables: dict[str, ForwardCost | BatchCost], reach: int) -> str | None:
    """The first forward of ``tables`` that is not finite or is over ``MAX_FORWARD_MS`` at ``reach`` cached tokens
    (its most: the slope is >= 0), in words; None where none is."""
    for name, cost in tables.items():
        for context in (cost.ref_context, max(reach, cost.ref_context)):  # as timed first, then at its most
            for label, ms in _reach(cost):
                if not (math.isfinite(most := ms(context)) and most <= MAX_FORWARD_MS):
                    return (f"its {name} table cannot be a timing: {label} would take {most:.4g} ms at {context} "
                            f"cached tokens, over an hour ({MAX_FORWARD_MS:.4g} ms): no machine times forwards that "
                            "long")
    return None


def _below_zero(tables: dict[str, ForwardCost | BatchCost]) -> str | None:
    """The first forward of ``tables`` that costs 0 ms or less with no cached tokens (its least: the slope is >= 0),
    in words; None where none does."""
    for name, cost in tables.items():
        for label, ms in _reach(cost):
            if not (least := ms(0)) > 0:
                per = " per sequence" if isinstance(cost, BatchCost) else ""
                return (f"its {name} table is no timing of forwards: {label} would take {least:.4g} ms with no cached "
                        f"tokens (a prefill's; its slope of {cost.per_context_ms:.4g} ms per cached token{per} from "
                        f"{cost.ref_context} cached takes more than the forward)")
    return None
