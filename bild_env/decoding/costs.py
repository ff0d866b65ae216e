"""The pair's latency cost model on this machine: its forwards timed once, the tables stored, checked when read.

The tables live below the decoders, which charge every forward to them: ``ForwardCost``
(``bild_env.decoding.forward_costs``: one sequence), ``BatchCost`` (``bild_env.decoding.batch_costs``:
B sequences) and ``CostModel`` with its ``LoopCost`` (``bild_env.decoding.cost_model``); their names
can be imported from here too. ``bild_env.decoding.calibration`` times the pair's forwards and fits those tables
(``calibrate``: one sequence, then the decoding loop's own work; ``calibrate_batched``, optional, through
``load_or_calibrate_batched``: B sequences, with the attention mask and positions the padded decoder gives,
``BATCHED_LAYOUT``; which cells, how often and fitted how, their docstrings say). This module stores them per machine
and reads them back, checked. Sparse tables are stored in the full tables' format (a ``"sampling"`` field says which);
tables stored before it, every cell timed, are read as they are.

A round of timings during which other processes kept the CPU busy (Linux /proc) is thrown away and
timed again after waiting for them, up to a budget (``MAX_WAIT_S``): ``bild_env.decoding.timing``. Timings that
kept slowed rounds past it are used by the run that took them (and one that waited for it) and stored as slowed:
the next run that needs them times them again, so a busy moment is never the machine's cost model for good.

Stored per machine: a calibrated model is kept under a key of the pair (``ModelPair.key``: its weights, not
their folders, and its dtype; a moved or copied cache folder keeps its models), the
device (``device_name``: the CPU's model, family, instruction sets and torch's kernel level, the
thread count) and the torch version, and records the machine in words (``machine_description``). A
model loaded from the cache that was calibrated before this boot of the machine (home folders outlive
machines) is checked by a few quick forwards (``quick_check``, well under a second for smollm2); off
by more than ``CHECK_FACTOR`` either way it is recalibrated, with a message naming both machines. One
calibrated during this boot is not checked: on one machine the rewards stay those of one cost model.
A stored model whose times are not finite numbers > 0 (the constructors refuse them), or no numbers at all (the text
"17.9", a fed count of 1.5: ``calibration.number_faults``), is timed again with a warning saying why. Every stored
table is then checked as a cost profile is (``calibration.faults``, one check for every table of times): one that no
machine could have timed (a forward far below 0 ms, ``IMPOSSIBLE_FACTOR`` off its neighbours, over an hour) is timed
again wherever it was timed; one from an earlier boot that no quiet machine would have timed (a forward costing less
than 1/``TABLE_SLACK`` of the smallest one, or 0 ms or less with no cached tokens) too, while one of this boot is kept,
with the warning. One process calibrates per key at a time (a file lock): another one that needs the same model waits
and loads what the first one stored, so concurrent runs share one cost model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from filelock import FileLock, Timeout

from bild_env.decoding.batch_costs import BatchCost, describe_batched, fit_batched, fit_table  # noqa: F401 (re-exported)
from bild_env.decoding.calibration import (  # noqa: F401 (the calibration's names callers import from here: re-exported)
    BATCH_CONTEXTS, BATCH_REPEATS, BATCH_SIZES, BATCH_SLOPE_FED, CHECK_FACTOR, CHECK_FED, CONTEXTS, PREFILL_FED,
    REACH_TOKENS, REPEATS, SAMPLINGS, SLOPE_FED, QuickCheck, calibrate, calibrate_batched, count_forwards, faults,
    fits, fitting, model_faults, number_faults, progress_kwarg, quick_check, quick_check_batched,
)
from bild_env.decoding.cost_model import (  # noqa: F401 (LoopCost: re-exported)
    FORMAT, CostFormatError, CostModel, LoopCost, _role_of, _write_json, describe,
)
from bild_env.decoding.forward_costs import STEP_FED, ForwardCost  # noqa: F401 (re-exported)
from bild_env.decoding.timing import time_batched_grid  # noqa: F401 (re-exported)
from bild_env.models.device import device_name, machine_description
from bild_env.paths import cache_dir, digest

logger = logging.getLogger(__name__)

TIMED = "draft proposal columns"  # in the cache key: a restricted draft head is timed as the decoders read it
# (its K logits alone, ``draft_head.proposal_logits``; tables keyed without it spread them over the vocabulary)
BATCHED_LAYOUT = "masked"  # batched tables timed with a mask and positions, as the padded decoder runs (time_batched_grid)
def _judge(pair, path: Path, what: str, timed_on: str, run_check: Callable[[], QuickCheck]) -> bool:
    """``fits``, logged: a warning naming both machines when the stored ``what`` in ``path`` is recalibrated
    (False) or kept while a busy CPU ran slower."""
    ok, checks = fits(run_check)
    here = machine_description(pair.device)
    seen = "; ".join(c.words() for c in checks)
    if not ok:
        logger.warning("the stored %s %s (timed on %s) does not fit this machine (%s): forwards timed now take %s its "
                       "times (more than %.1fx off, in %d quick checks); recalibrating", what, path, timed_on, here,
                       seen, CHECK_FACTOR, len(checks))
    elif checks[-1].slower:
        logger.warning("forwards timed now take %s the times of the stored %s %s (timed on %s), but other processes "
                       "were using the CPU of this machine (%s) during the checks: keeping it; recalibrate "
                       "(refresh=True) on a quiet machine if it is off", seen, what, path, timed_on, here)
    else:
        logger.debug("%s %s checked in %.2f s: %s its times", what, path, sum(c.seconds for c in checks), seen)
    return ok


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


def _warn_implausible(found: tuple[str | None, str | None], what: str) -> None:
    """Say so when tables just timed fail the check of stored ones (``calibration.faults``); they are used."""
    if why := found[0] or found[1]:
        logger.warning("the timings just taken for the %s are implausible (%s): other processes may have disturbed "
                       "them; they are used during this boot of the machine (recalibrate, refresh=True, on a quiet "
                       "machine)", what, why)


def _usable(path: Path, what: str, found: tuple[str | None, str | None], timed_here: bool, redo: str) -> bool:
    """Whether the stored ``what`` in ``path`` is used, ``found`` what ``calibration.faults`` found in it: ``(broken,
    why)``, None for nothing.

    Tables timed on this machine during this boot (``_this_boot``, or just now by another process) are, with a
    warning: timed again they would change the rewards within a boot, as the quick check would (module docstring),
    and a machine whose other processes disturbed the timing (the tiny pair's cells up to 5x off with two busy
    processes on 2 cores) may time them as badly again. Others are timed again, the warning (ending in ``redo``)
    saying why. Tables no machine could have timed (``broken``: a forward far below 0 ms, ``IMPOSSIBLE_FACTOR`` off, or
    over an hour) are timed again wherever they were timed: rewards from them would be wrong, not noisy.
    """
    broken, why = found
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


def _reach(pair) -> int:
    """The most cached tokens an env of ``pair`` can read its tables at: its positions (``REACH_TOKENS`` where a model
    states none)."""
    positions = getattr(pair, "max_positions", REACH_TOKENS)
    return positions if positions < 1 << 30 else REACH_TOKENS  # 1 << 30: no limit stated (``pairs._max_positions``)


def _batched_faults(tables: dict[str, BatchCost], base: CostModel, pair) -> tuple[str | None, str | None]:
    """``calibration.faults`` of batched tables (named "batched draft", "batched target") against ``base``."""
    return faults({f"batched {role}": cost for role, cost in tables.items()}, base, _reach(pair))


def _slowed(path: Path, stored: dict, fresh: bool) -> bool:
    """Whether stored timings are not kept as this machine's because other processes slowed some of their rounds
    (``slowed``: the rounds kept slowed, ``timing.report_busy``): the process that timed them uses them, as does one
    that waited for it (``fresh``), and the next one times them again (again stored as slowed if it is no quieter)."""
    if not stored.get("slowed") or fresh:
        return False
    logger.warning("the stored %s was timed while other processes slowed %d of its timing rounds: timing it again",
                   path.name, stored["slowed"])
    return True


def _read_checked(pair, path: Path, fresh: bool) -> CostModel | None:
    """The cost model stored in ``path``, if it can be read and its quick check passes (not run for one
    another process just calibrated, ``fresh``, or one calibrated during this boot of the machine)."""
    try:
        stored = json.loads(path.read_text())
        if why := number_faults(stored):
            raise CostFormatError(why)
        model = CostModel.from_dict(stored)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        logger.warning("the stored cost model %s cannot be used (not a cost model (no JSON): %s; expected format %d): "
                       "recalibrating", path, err, FORMAT)
        return None
    except (CostFormatError, OSError) as err:
        logger.warning("the stored cost model %s cannot be used (%s; expected format %d): recalibrating",
                       path, err, FORMAT)
        return None
    if not _usable(path, "cost model", model_faults(model, _reach(pair)), fresh or _this_boot(stored),
                   "recalibrating") or _slowed(path, stored, fresh):
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
    path, stats = cost_path(pair), {}

    def build() -> CostModel:
        logger.info("timing the pair's forwards on %s to build the latency cost model (once; cached in %s)",
                    machine_description(pair.device), path)
        t0 = time.perf_counter()
        model = calibrate(pair, stats=stats, **progress_kwarg(progress))
        logger.info("cost model ready in %.0f s: %s", time.perf_counter() - t0, describe(model))
        _warn_implausible(model_faults(model, _reach(pair)), "cost model")
        return model

    def write(model: CostModel, p: Path) -> None:
        _write_json(p, model.to_dict() | {"boot": _boot_id(), "sampling": SAMPLINGS[0],
                                          "slowed": stats.get("busy_rounds_kept", 0)})

    return _load_or_build(path, lambda p, fresh: _read_checked(pair, p, fresh), build, write,
                          "the pair's forwards", refresh)


def forwards_to_time(pair, batch_sizes: Sequence[int] = BATCH_SIZES) -> int:
    """About the forwards ``load_or_calibrate_batched`` will time for ``pair`` (the units it advances a progress bar
    by): the cost model's tables and its loop's generations (``calibrate_loop``: ``LOOP_NEW_TOKENS`` each) where no
    stored cost model exists, and the batched tables where none are stored; 0 where both are (a stored file that
    fails its checks is timed again, and the bar's total grows then). Exact but for the bisections of sparse
    tables (``count_forwards``)."""
    from bild_env.decoding.loop_costs import LOOP_METHODS, LOOP_NEW_TOKENS, LOOP_REPEATS, calibration_prompts

    fed, sizes = STEP_FED, tuple(sorted({int(b) for b in batch_sizes}))
    n = 0
    if not cost_path(pair).is_file():
        contexts, prefill = fitting(pair, fed, CONTEXTS, PREFILL_FED)
        generations = (LOOP_REPEATS * len(calibration_prompts(pair)) + 1) * len(LOOP_METHODS)
        n += 2 * count_forwards((1,), fed, contexts, prefill, REPEATS, SAMPLINGS[0], SLOPE_FED) + generations * LOOP_NEW_TOKENS
    if not batched_path(pair, sizes).is_file():
        contexts, prefill = fitting(pair, fed, BATCH_CONTEXTS, PREFILL_FED)
        n += 2 * count_forwards(sizes, fed, contexts, prefill, BATCH_REPEATS, SAMPLINGS[0], BATCH_SLOPE_FED)
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
    base = load_or_calibrate(pair, refresh=refresh, **progress_kwarg(progress))
    base_key = digest(json.dumps(base.to_dict(), sort_keys=True))
    sizes = tuple(sorted({int(b) for b in batch_sizes}))
    path, stats = batched_path(pair, sizes), {}

    def read(p: Path, fresh: bool) -> dict[str, BatchCost] | None:
        try:
            d = json.loads(p.read_text())
            if d.get("format") != FORMAT or d.get("base") != base_key or d.get("layout") != BATCHED_LAYOUT:
                logger.info("the stored batched tables %s belong to another calibration of the pair: timing them again", p)
                return None
            if why := number_faults(d, prefix="batched "):
                raise ValueError(why)
            tables = {role: _role_of(BatchCost.of, d, role, "batched ") for role in ("draft", "target")}
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
            logger.warning("the stored batched tables %s cannot be used (%s): timing them again", p, err)
            return None
        if not _usable(p, "batched tables", _batched_faults(tables, base, pair), fresh or _this_boot(d),
                       "timing them again") or _slowed(p, d, fresh):
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
        tables = calibrate_batched(pair, sizes, stats=stats, **progress_kwarg(progress))
        logger.info("batched tables ready in %.0f s: %s", time.perf_counter() - t0, describe_batched(tables))
        _warn_implausible(_batched_faults(tables, base, pair), "batched tables")
        return tables

    def write(tables: dict[str, BatchCost], p: Path) -> None:
        _write_json(p, {"format": FORMAT, "base": base_key, "layout": BATCHED_LAYOUT, "sampling": SAMPLINGS[0],
                        "device": base.device,
                        "machine": base.machine, "boot": _boot_id(), "batch_sizes": list(sizes),
                        "slowed": stats.get("busy_rounds_kept", 0)}
                    | {role: cost.to_dict() for role, cost in tables.items()})

    tables = _load_or_build(path, read, build, write, "the pair's batched forwards", refresh, tag=base_key)
    return replace(base, batched=tables)
