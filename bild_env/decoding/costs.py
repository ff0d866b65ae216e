"""A deterministic latency model of the pair's forwards: a table of timed forwards per model.

Units: milliseconds of wall-clock time for one forward of one sequence (batch of one) on the
device the model was calibrated on; ``fed`` is the number of new tokens the forward is fed,
``context`` the number of tokens already in its KV cache.

For each model M (draft, target) the model holds ``ForwardCost``:

    ms_M(fed, context) = T_M(fed) + s_M * (context - ref_M)

``T_M`` is the median measured time of a forward fed ``fed`` tokens on ``ref_M`` cached tokens,
for every fed count a decoding step can feed (1 .. 12: BiLD's max_draft_len of 10, plus one for
the token after a correction; naive SD's k + 1) and a few prefill lengths (16, 32, 64). Between
measured counts it is interpolated linearly; beyond the largest it is extrapolated linearly from the
last two. On a CPU the curve is no line (float32 matrix kernels: a 2-token forward can cost more
than an 8-token one), so it is a table, not a fit. ``s_M`` (ms per cached token) is fitted by least
squares on the residuals of forwards timed at a few contexts. A linear model
``ms = a + b * fed + c * context`` (``ForwardCost.linear``; a plain ``(a, b, c)`` given to
``CostModel``) is an exact special case. Rewards computed with it are noise-free and reproducible
(latency mode ``"model"``); the calibrated model is stored per pair (dtype included) and device
(thread count included).
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bild_env.decoding.kv import crop_cache
from bild_env.models.device import device_name, sync
from bild_env.paths import cache_dir, digest

logger = logging.getLogger(__name__)

FORMAT = 2  # of the saved JSON; 1 (no "format" field) was one least-squares line (a, b, c) per model
STEP_FED = tuple(range(1, 13))  # tokens a BiLD step (max_draft_len 10, +1 after a correction) or naive SD feeds
PREFILL_FED = (16, 32, 64)  # prompt fills (~32 tokens) and replay fills (prompt + reference)
CONTEXTS = (32, 96, 160)  # cached tokens the step forwards are timed on; the table is kept at their mean


class CostFormatError(ValueError):
    """A saved cost model of another format (or not one at all)."""


def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs ascending), exact at the points; outside them, the line
    through the two nearest points."""
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]
    if len(xs) == 1:
        return ys[0]
    i = min(max(i, 1), len(xs) - 1)  # the segment xs[i-1] .. xs[i] (the first or last one outside)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (x - x0) * (y1 - y0) / (x1 - x0)


@dataclass(frozen=True)
class ForwardCost:
    """The cost of one model's forward: a table over fed counts at ``ref_context``, plus a slope per cached token.

    ``fed`` (ascending) and ``ms`` are the measured points (median ms at ``ref_context`` cached tokens);
    ``per_context_ms`` is added per cached token beyond ``ref_context`` (subtracted below it). A
    linear model has no table: ``line = (a, b)`` and ``ms = a + b * fed + per_context_ms * context``
    exactly (``ForwardCost.linear``).
    """

    fed: tuple[int, ...] = ()
    ms: tuple[float, ...] = ()
    per_context_ms: float = 0.0
    ref_context: int = 0
    line: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "fed", tuple(int(f) for f in self.fed))
        object.__setattr__(self, "ms", tuple(float(m) for m in self.ms))
        object.__setattr__(self, "per_context_ms", float(self.per_context_ms))
        object.__setattr__(self, "ref_context", int(self.ref_context))
        if self.line is not None:
            object.__setattr__(self, "line", tuple(float(v) for v in self.line))
            if len(self.line) != 2 or self.fed or self.ms:
                raise ValueError("a linear ForwardCost has line=(a, b) and no table")
            return
        if not self.fed or len(self.fed) != len(self.ms):
            raise ValueError(f"a ForwardCost table needs as many ms as fed counts, and at least one: {self.fed}, {self.ms}")
        if any(b <= a for a, b in zip(self.fed, self.fed[1:])) or self.fed[0] < 1:
            raise ValueError(f"fed counts must be ascending positive whole numbers: {self.fed}")

    @classmethod
    def linear(cls, a: float, b: float, c: float) -> ForwardCost:
        """``ms = a + b * fed + c * context``, exactly."""
        return cls(per_context_ms=c, line=(a, b))

    @classmethod
    def of(cls, value) -> ForwardCost:
        """A ForwardCost from itself, ``(a, b, c)`` (linear) or its saved dict."""
        if isinstance(value, ForwardCost):
            return value
        if isinstance(value, dict):
            return cls(tuple(value["fed"]), tuple(value["ms"]), value["per_context_ms"], value["ref_context"],
                       None if value.get("line") is None else tuple(value["line"]))
        a, b, c = value
        return cls.linear(a, b, c)

    def __call__(self, fed: int, context: int) -> float:
        """Milliseconds of a forward fed ``fed`` tokens on ``context`` cached ones."""
        if self.line is not None:
            a, b = self.line
            return a + b * fed + self.per_context_ms * context
        return _interp(self.fed, self.ms, fed) + self.per_context_ms * (context - self.ref_context)

    def one_token_sum(self, first_context: int, n: int) -> float:
        """Sum of ``self(1, ctx)`` for ctx = first_context .. first_context + n - 1 (closed form)."""
        c = self.per_context_ms
        if self.line is not None:
            a, b = self.line
            return n * (a + b) + c * (n * first_context + n * (n - 1) / 2)
        return n * self(1, self.ref_context) + c * (n * (first_context - self.ref_context) + n * (n - 1) / 2)

    def batch_costs(self) -> tuple[float, float]:
        """(fixed_ms, per_token_ms): the mean slope over fed 1..12 at ``ref_context`` and what is left at fed 1."""
        if self.line is not None:
            return self.line
        lo, hi = STEP_FED[0], STEP_FED[-1]
        per_token = max(0.0, (self(hi, self.ref_context) - self(lo, self.ref_context)) / (hi - lo))
        return max(0.0, self(lo, self.ref_context) - per_token), per_token

    def table(self) -> dict[int, float]:
        return dict(zip(self.fed, self.ms))

    def to_dict(self) -> dict[str, object]:
        return {"fed": list(self.fed), "ms": list(self.ms), "per_context_ms": self.per_context_ms,
                "ref_context": self.ref_context, "line": None if self.line is None else list(self.line)}


@dataclass(frozen=True)
class CostModel:
    """The forward costs (ms) of the pair's draft and target on ``device``.

    ``CostModel(draft=(a, b, c), target=(a, b, c))`` is the linear model ``a + b * fed + c * context``;
    ``calibrate`` builds measured tables.
    """

    draft: ForwardCost = field(default_factory=lambda: ForwardCost.linear(0.0, 0.0, 0.0))
    target: ForwardCost = field(default_factory=lambda: ForwardCost.linear(0.0, 0.0, 0.0))
    device: str = "unspecified"

    def __post_init__(self) -> None:
        object.__setattr__(self, "draft", ForwardCost.of(self.draft))
        object.__setattr__(self, "target", ForwardCost.of(self.target))

    def _role(self, role: str) -> ForwardCost:
        if role == "draft":
            return self.draft
        if role == "target":
            return self.target
        raise ValueError(f"role must be 'draft' or 'target', not {role!r}")

    def ms(self, role: str, fed: int, context: int) -> float:
        """Milliseconds of one forward of ``role`` fed ``fed`` tokens on ``context`` cached ones."""
        return self._role(role)(fed, context)

    def target_only_ms(self, first_position: int, n: int) -> float:
        """Time of target-only decoding for the tokens at positions ``first_position .. +n-1`` (the sum of
        ``ms("target", 1, q - 1)`` over them, in closed form: the token at position q comes from a
        one-token forward over q - 1 cached tokens)."""
        return self.target.one_token_sum(first_position - 1, n)

    def batch_costs(self, role: str) -> tuple[float, float]:
        """(fixed_ms, per_token_ms) of ``role``'s forward: a two-number summary to plan batched forwards by."""
        return self._role(role).batch_costs()

    def to_dict(self) -> dict[str, object]:
        return {"format": FORMAT, "device": self.device, "draft": self.draft.to_dict(), "target": self.target.to_dict()}

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        found = d.get("format", 1) if isinstance(d, dict) else None
        if found != FORMAT:
            raise CostFormatError(f"cost model of format {found}, this version reads format {FORMAT}")
        try:
            return cls(ForwardCost.of(d["draft"]), ForwardCost.of(d["target"]), str(d["device"]))
        except (KeyError, TypeError, ValueError) as err:
            raise CostFormatError(f"a malformed cost model of format {FORMAT}: {err!r}") from err

    @classmethod
    def load(cls, path: Path) -> CostModel:
        """The model saved in ``path``; CostFormatError when it is of another format or unreadable JSON."""
        try:
            d = json.loads(Path(path).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CostFormatError(f"not a cost model (no JSON): {err}") from err
        return cls.from_dict(d)


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
def time_grid(model: torch.nn.Module, cells: Sequence[tuple[int, int]], device: torch.device, repeats: int,
              progress=None, stats: dict | None = None) -> list[tuple[int, int, float]]:
    """Median ms of forwards feeding ``fed`` tokens on ``context`` cached ones, for each ``(fed, context)`` cell.

    Returns ``(fed, context, median_ms)`` per cell, in the order given. One cache per context is
    prefilled with random tokens; after every timed forward it is cropped back. The cells are timed
    round-robin, ``repeats`` rounds, so that a slow spell of the machine falls on every cell alike
    (on a shared CPU the speed drifts by 10-20% over seconds). A round during which other processes
    kept more than ``BUSY_CORES`` of a CPU busy (Linux /proc) is thrown away; the timing sleeps until
    they stop and times it again (waiting at most about as long as it has timed, up to
    ``MAX_WAIT_S``; then it keeps what it measures). ``stats`` (a dict), when given, gets the counts
    of ``rounds``, ``busy_rounds_dropped``, ``busy_rounds_kept`` and ``waited_s`` added. ``progress``
    (a tqdm bar) is advanced once per kept forward.
    """
    from transformers import DynamicCache

    vocab = model.get_output_embeddings().weight.shape[0]
    caches, ids = {}, {}
    for context in sorted({c for _, c in cells}):
        longest = max(f for f, c in cells if c == context)
        gen = torch.Generator().manual_seed(context)
        ids[context] = torch.randint(0, vocab, (1, context + longest), generator=gen).to(device)
        caches[context] = DynamicCache(config=model.config)
        if context:
            model(ids[context][:, :context], past_key_values=caches[context], use_cache=True, logits_to_keep=1)
    times: list[list[float]] = [[] for _ in cells]
    others, kept, dropped, busy_kept, timing_s, waited_s = _OtherLoad(), 0, 0, 0, 0.0, 0.0
    while kept < repeats:
        round_ms = []
        started = time.perf_counter()
        for f, context in cells:
            sync(device)
            t0 = time.perf_counter()
            out = model(ids[context][:, context : context + f], past_key_values=caches[context], use_cache=True,
                        logits_to_keep=f)
            out.logits[0, -1].argmax().item()  # read a result, as the decoders do (synchronizes)
            round_ms.append((time.perf_counter() - t0) * 1000.0)
            crop_cache(caches[context], context)
        timing_s += time.perf_counter() - started
        busy = others.take()
        budget = min(MAX_WAIT_S, 2.0 + timing_s) - waited_s
        if busy is not None and busy > BUSY_CORES and dropped < 3 * repeats and budget > 0:
            dropped += 1
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
    return [(f, c, statistics.median(t)) for (f, c), t in zip(cells, times)]


def time_forwards(model: torch.nn.Module, fed: tuple[int, ...], context: int, device: torch.device,
                  repeats: int, progress=None, stats: dict | None = None) -> list[tuple[int, int, float]]:
    """Median ms of forwards feeding each of ``fed`` tokens on ``context`` cached ones (``time_grid`` at one context)."""
    return time_grid(model, [(f, context) for f in fed], device, repeats, progress, stats)


def fit_table(rows: list[tuple[int, int, float]], prefill_rows: list[tuple[int, int, float]] = ()) -> ForwardCost:
    """A ForwardCost from timed ``(fed, context, ms)``: ``rows`` time the same fed counts at several
    contexts; ``prefill_rows`` other counts at one context each.

    The slope per cached token is the least-squares one with one intercept per fed count (fitted on
    the residuals of each count from its mean), floored at 0; the table holds each count's mean
    time moved to the mean context (``ref_context``), so it reproduces a count measured at one context only.
    """
    contexts = sorted({ctx for _, ctx, _ in rows})
    by_fed: dict[int, list[tuple[int, float]]] = {}
    for f, ctx, ms in rows:
        by_fed.setdefault(f, []).append((ctx, ms))
    num = den = 0.0
    for points in by_fed.values():
        if len(points) < 2:
            continue
        c_mean = sum(c for c, _ in points) / len(points)
        m_mean = sum(m for _, m in points) / len(points)
        num += sum((c - c_mean) * (m - m_mean) for c, m in points)
        den += sum((c - c_mean) ** 2 for c, _ in points)
    slope = max(0.0, num / den) if den else 0.0
    ref = round(sum(contexts) / len(contexts)) if contexts else 0
    table: dict[int, float] = {}
    for f, points in by_fed.items():
        table[f] = sum(m - slope * (c - ref) for c, m in points) / len(points)
    for f, ctx, ms in prefill_rows:
        table.setdefault(f, ms - slope * (ctx - ref))
    fed = tuple(sorted(table))
    return ForwardCost(fed, tuple(table[f] for f in fed), slope, ref)


def calibrate(pair, fed: tuple[int, ...] = STEP_FED, contexts: tuple[int, ...] = CONTEXTS,
              repeats: int = 5, prefill: tuple[int, ...] = PREFILL_FED, progress: bool = True) -> CostModel:
    """Time both models of ``pair`` and build their cost tables.

    Every count in ``fed`` at each of ``contexts`` (the slope per cached token comes from them), and
    each of ``prefill`` (longer fills) on an empty cache: the median of ``repeats`` forwards, all
    cells timed round-robin (``time_grid``), after one untimed pass over every shape (kernels are
    chosen, and in bfloat16 made, per shape on first use). About 30 s for smollm2 in float32 on a
    2-core CPU. A progress bar on a terminal, else a log line per model.
    """
    import sys

    from tqdm import tqdm

    contexts = tuple(c for c in contexts if c + max(fed) <= pair.max_positions) or (0,)
    prefill = tuple(p for p in prefill if max(fed) < p <= pair.max_positions)
    steps = [(f, c) for c in contexts for f in fed]
    cells = steps + [(p, 0) for p in prefill]
    costs, stats = {}, {}
    bar_on = progress and sys.stderr.isatty()
    with tqdm(total=2 * len(cells) * (1 + repeats), desc="timing forwards for the cost model", unit="forward",
              disable=not bar_on, leave=False) as bar:
        for role in ("draft", "target"):
            if progress and not bar_on:
                logger.info("timing %s forwards: %d fed counts at %d contexts and %d prefill lengths, %d times each",
                            role, len(fed), len(contexts), len(prefill), repeats)
            model = getattr(pair, role)
            time_grid(model, cells, pair.device, 1, bar)  # warm-up: every shape once
            rows = time_grid(model, cells, pair.device, repeats, bar, stats)
            costs[role] = fit_table(rows[: len(steps)], rows[len(steps) :])
    if stats.get("busy_rounds_kept"):
        logger.warning("other processes kept using the CPU: %d of the %d timing rounds kept were slowed by them (and "
                       "%d more were timed again after waiting %.0f s); the cost model holds slowed timings: "
                       "recalibrate (refresh=True) when the machine is quiet", stats["busy_rounds_kept"],
                       stats["rounds"] - stats["busy_rounds_dropped"], stats["busy_rounds_dropped"], stats["waited_s"])
    elif stats.get("busy_rounds_dropped"):
        logger.info("other processes used the CPU during %d timing rounds; they were timed again after waiting %.0f s",
                    stats["busy_rounds_dropped"], stats["waited_s"])
    return CostModel(costs["draft"], costs["target"], device_name(pair.device))


def cost_path(pair) -> Path:
    """Where the cost model of ``pair`` on this device (and thread count) is stored."""
    return cache_dir("costs") / f"{digest(pair.key, device_name(pair.device))}.json"


def describe(model: CostModel) -> str:
    parts = []
    for role in ("draft", "target"):
        cost = model._role(role)
        parts.append(f"{role} ms by tokens fed " + " ".join(f"{f}:{cost(f, cost.ref_context):.1f}" for f in (1, 2, 4, 8, 12))
                     + f" at {cost.ref_context} cached, +{cost.per_context_ms:.4f}/cached token")
        if cost.line is not None:
            parts[-1] = f"{role} ms = {cost.line[0]:.2f} + {cost.line[1]:.2f}/token + {cost.per_context_ms:.4f}/cached token"
    return "; ".join(parts)


def load_or_calibrate(pair, refresh: bool = False) -> CostModel:
    """The stored cost model of ``pair`` on this device, calibrating (and storing) it once.

    A stored file of another format, or one that cannot be read, is recalibrated (and replaced), never reused.
    """
    name = device_name(pair.device)
    path = cost_path(pair)
    if path.exists() and not refresh:
        try:
            return CostModel.load(path)
        except (CostFormatError, OSError) as err:
            logger.warning("the stored cost model %s cannot be used (%s; expected format %d): recalibrating",
                           path, err, FORMAT)
    logger.info("timing the pair's forwards on %s to build the latency cost model (once; cached in %s)", name, path)
    t0 = time.perf_counter()
    model = calibrate(pair)
    model.save(path)
    logger.info("cost model ready in %.0f s: %s", time.perf_counter() - t0, describe(model))
    return model
