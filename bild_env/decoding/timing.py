"""Timing a model's forwards on a machine others may share: cells of (batch, fed, context) timed round-robin, rounds
that other processes disturbed timed again (``bild_env.decoding.costs`` fits the cost tables on these timings)."""

from __future__ import annotations

import copy
import logging
import os
import statistics
import time
from collections.abc import Sequence

import torch

from bild_env.decoding.kv import crop_cache
from bild_env.models.compat import cache_kwarg
from bild_env.models.device import sync
from bild_env.models.draft_head import proposal_logits

logger = logging.getLogger("bild_env.decoding.costs")  # the calibration's messages, as they were named


class OtherLoad:
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


def _until_quiet(others: OtherLoad, budget_s: float, window_s: float) -> float | None:
    """Sleep window by window until other processes leave the CPU (at most ``BUSY_CORES``) or ``budget_s`` has
    passed; the cores they kept busy in the last window (None where /proc cannot be read or nothing was read)."""
    t0, busy = time.perf_counter(), None
    while time.perf_counter() - t0 < budget_s:
        time.sleep(min(window_s, budget_s))
        busy = others.take()
        if busy is None or busy <= BUSY_CORES:
            break
    return busy


def busy_cores(budget_s: float, window_s: float = 0.5) -> float | None:
    """The CPU cores other processes keep busy, measured over ``window_s`` windows until one is quiet (at most
    ``BUSY_CORES``) or ``budget_s`` has passed: the last window's (None where /proc cannot be read)."""
    return _until_quiet(OtherLoad(), budget_s, window_s)


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
    others, kept, dropped, busy_kept, timing_s, waited_s, dropped_s = OtherLoad(), 0, 0, 0, 0.0, 0.0, 0.0
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
            asleep = time.perf_counter()  # half-second steps until other processes leave the CPU (or the budget is out)
            _until_quiet(others, budget, 0.5)
            others.take()
            waited_s += time.perf_counter() - asleep
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


def report_busy(stats: dict) -> None:
    """Say whether other processes disturbed a calibration (a warning when slowed timings were kept)."""
    if stats.get("busy_rounds_kept"):
        logger.warning("other processes kept using the CPU: %d of the %d timing rounds kept were slowed by them (and "
                       "%d more were timed again after waiting %.0f s); the cost model holds slowed timings: "
                       "this run uses them, and they are stored as slowed (the next run that needs them times them "
                       "again)", stats["busy_rounds_kept"],
                       stats["rounds"] - stats["busy_rounds_dropped"], stats["busy_rounds_dropped"], stats["waited_s"])
    elif stats.get("busy_rounds_dropped"):
        logger.info("other processes used the CPU during %d timing rounds; they were timed again after waiting %.0f s",
                    stats["busy_rounds_dropped"], stats["waited_s"])
