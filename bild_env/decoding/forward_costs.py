"""What one forward of one model costs: a table over the tokens it is fed, plus a slope per cached token.

Units: milliseconds of wall-clock time for one forward on the device the model was calibrated on;
``fed`` is the number of new tokens the forward is fed (per sequence), ``context`` the number of tokens
already in its KV cache (per sequence). For each model M (draft, target), ``ForwardCost`` (one sequence,
a batch of one):

    ms_M(fed, context) = T_M(fed) + s_M * (context - ref_M)

``T_M`` is the median measured time of a forward fed ``fed`` tokens on ``ref_M`` cached tokens, for
every fed count a decoding step can feed (``STEP_FED``, 1 .. 12: BiLD's max_draft_len of 10, plus one
for the token after a correction; naive SD's k + 1) and a few prefill lengths (16, 32, 64). Between
measured counts it is interpolated linearly; beyond the largest it is extrapolated linearly from the
last two. On a CPU the curve is no line (float32 matrix kernels: a 2-token forward can cost more
than an 8-token one), so it is a table, not a fit. ``s_M`` (ms per cached token) is fitted by least
squares on the residuals of forwards timed at a few contexts (``batch_costs.fit_table``). A linear model
``ms = a + b * fed + c * context`` (``ForwardCost.linear``) is an exact special case.

Not every fed count needs timing: where the curve is flat (or straight) between two timed counts, the line through
them predicts the ones between. ``sparse_points`` times the counts of ``COARSE_FED`` first, then the midpoint of
every gap between neighbours, and goes on bisecting only the gaps whose midpoint lies off the line by more than
``SPARSE_TOLERANCE``; the counts left untimed are read off the line (``_interp``), as between any two points of a
table. ``bild_env.decoding.costs`` times its tables so (``sampling="sparse"``, the default).

Nothing here times a forward (``bild_env.decoding.costs`` does). The piecewise-linear reading
(``_bracket``, ``_interp``), the checks of the numbers (``_check_numbers``, ``TABLE_SLACK``'s ``_dip``)
and the grouped slope (``_slope``) serve the batched tables too (``bild_env.decoding.batch_costs``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

STEP_FED = tuple(range(1, 13))  # tokens a BiLD step (max_draft_len 10, +1 after a correction) or naive SD feeds
COARSE_FED = (1, 2, 4, 8, 12)  # fed counts always timed (``sparse_points``); the gaps between them bisected where needed
SPARSE_TOLERANCE = 0.05  # a gap's midpoint within this share of its time off the line through the gap's ends: the
# gap is flat and its other counts are read off the line; else it is bisected further (shared-CPU noise of 5-10%
# only makes more points timed, never fewer)
TABLE_SLACK = 2.0  # a stored table is implausible where a forward costs less than 1/this of the one fed fewest tokens (or
# of one sequence fed as many): feeding more never does less work. Not a monotone rule: real tables dip between fed counts
# (float32 on a Zen 5: fed 3 80.8 ms, fed 4 62.2), but none measured dips below fed 1 (bfloat16 there, nearly flat:
# 20.8 / 20.9 / 21.2 ms), and the noise of a quiet or lightly shared CPU (10-20%; the tiny pair's cells up to 1.3x apart)
# stays well inside a factor 2. A heavily loaded CPU can exceed it (the tiny pair's ~1 ms cells 5x apart with two busy
# processes on 2 cores): tables timed during this boot are kept with a warning, older ones timed again
# (``bild_env.decoding.costs._usable``).


def _bracket(xs: Sequence[float], x: float) -> tuple[int, int, float]:
    """``(i, j, w)`` such that the piecewise-linear value at ``x`` is ``ys[i] + w * (ys[j] - ys[i])`` for any
    ``ys`` over ``xs`` (ascending): ``(i, i, 0)`` at a point; outside them, the line through the two nearest."""
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return i, i, 0.0
    if len(xs) == 1:
        return 0, 0, 0.0
    i = min(max(i, 1), len(xs) - 1)  # the segment xs[i-1] .. xs[i] (the first or last one outside)
    return i - 1, i, (x - xs[i - 1]) / (xs[i] - xs[i - 1])


def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs ascending), exact at the points; outside them, the line
    through the two nearest points."""
    i, j, w = _bracket(xs, x)
    return ys[i] if i == j else ys[i] + w * (ys[j] - ys[i])


def sparse_points(time_cells: Callable[[list[tuple[Hashable, int]]], dict[tuple[Hashable, int], float]],
                  rows: Sequence[Hashable], coarse: Sequence[int] = COARSE_FED,
                  tolerance: float = SPARSE_TOLERANCE) -> dict[tuple[Hashable, int], float]:
    """Timed points of every row of ``rows`` over the fed counts ``coarse[0] .. coarse[-1]``, timing only where the
    curve bends: ``{(row, fed): ms}``.

    ``time_cells(cells)`` times ``(row, fed)`` cells (all of one call together, round-robin) and returns their ms.
    First every row at ``coarse``; then, call by call, the midpoint of every gap wider than one count whose midpoint
    has not shown it flat: a midpoint within ``tolerance`` of its time off the line through the gap's ends closes
    the gap, else both halves are bisected. At worst every count is timed; on a flat or straight curve
    ``len(coarse)`` plus one per gap (1, 2, 4, 8, 12 and 3, 6, 10: 8 of 12 counts).
    """
    coarse = sorted(set(coarse))
    timed = dict(time_cells([(row, f) for row in rows for f in coarse]))
    gaps = [(row, a, b) for row in rows for a, b in zip(coarse, coarse[1:]) if b - a > 1]
    while gaps:
        mids = {(row, a, b): (row, (a + b) // 2) for row, a, b in gaps}
        timed |= time_cells(sorted(set(mids.values()) - set(timed), key=lambda cell: (str(cell[0]), cell[1])))
        gaps = []
        for (row, a, b), (_, m) in mids.items():
            line = _interp((a, b), (timed[row, a], timed[row, b]), m)
            if abs(timed[row, m] - line) > tolerance * timed[row, m]:
                gaps += [(row, x, y) for x, y in ((a, m), (m, b)) if y - x > 1]
    return timed


def _check_numbers(what: str, values: Iterable[float], positive: bool) -> None:
    """ValueError naming ``what`` unless every value is finite and > 0 (``positive``) or >= 0."""
    for v in values:
        if not math.isfinite(v) or v < 0 or (positive and v == 0):
            raise ValueError(f"{what} must be finite numbers {'> 0' if positive else '>= 0'}, got {v!r}")


IMPOSSIBLE_FACTOR = 100.0  # a table is impossible, and timed again even when timed during this boot, where its
# cached tokens cost over this many times the forward (a slope that makes it far negative with none cached), or a
# forward costs less than 1/this of one with fewer tokens fed (or fewer sequences), or more than this many times its
# linear growth from it. The worst disturbance seen is 20x (the tiny pair's ~1.5 ms cells timed at 30 ms while three
# other test suites ran on 2 cores).


def _impossible(points: Sequence[tuple[str, float, float]]) -> str | None:
    """Where a table along one axis (``(label, x, ms)``, ``x`` ascending: tokens fed or sequences) cannot be a
    timing by ``IMPOSSIBLE_FACTOR``, in words; None where it can."""
    for (label0, x0, m0), (label1, x1, m1) in zip(points, points[1:]):
        if m1 * IMPOSSIBLE_FACTOR < m0:
            return f"{label1} takes {m1:.4g} ms, less than 1/{IMPOSSIBLE_FACTOR:g} of {label0}'s {m0:.4g} ms"
        if m1 > m0 * (x1 / x0) * IMPOSSIBLE_FACTOR:
            return (f"{label1} takes {m1:.4g} ms, over {IMPOSSIBLE_FACTOR:g} times {label0}'s {m0:.4g} ms grown "
                    f"linearly ({x1 / x0:.3g}x)")
    return None


def _negative(label: str, ms: float, per_context_ms: float, ref_context: int) -> str | None:
    """Why a forward of ``ms`` at ``ref_context`` cached tokens whose slope is ``per_context_ms`` is impossible (the
    cached tokens cost over ``IMPOSSIBLE_FACTOR`` times the forward: far below 0 ms with none cached), or None. A
    slope that makes a forward only somewhat negative with no cached tokens is timing noise (the tiny pair's, timed
    on a busy CPU from contexts 8 and 24, often is), and is kept."""
    if per_context_ms * ref_context > IMPOSSIBLE_FACTOR * ms:
        return (f"{label} would take {ms - per_context_ms * ref_context:.4g} ms with no cached tokens (its slope of "
                f"{per_context_ms:.4g} ms per cached token dwarfs the forward's {ms:.4g} ms at {ref_context})")
    return None


def _dip(points: Sequence[tuple[str, float]]) -> str | None:
    """Where a point of a table costs less than 1/``TABLE_SLACK`` of the first (``(label, ms)``, the first the
    smallest forward), in words; None where none does."""
    (first, floor), *rest = points
    for label, ms in rest:
        if ms * TABLE_SLACK < floor:
            return f"{label} takes {ms:.4g} ms, less than 1/{TABLE_SLACK:g} of {first}'s {floor:.4g} ms"
    return None


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
        _check_numbers("per_context_ms", (self.per_context_ms,), positive=False)
        _check_numbers("ref_context", (self.ref_context,), positive=False)
        if self.line is not None:
            object.__setattr__(self, "line", tuple(float(v) for v in self.line))
            if len(self.line) != 2 or self.fed or self.ms:
                raise ValueError("a linear ForwardCost has line=(a, b) and no table")
            _check_numbers("a linear ForwardCost's (a, b)", self.line, positive=False)  # (0, 0, 0): costs nothing
            return
        if not self.fed or len(self.fed) != len(self.ms):
            raise ValueError(f"a ForwardCost table needs as many ms as fed counts, and at least one: {self.fed}, {self.ms}")
        if any(b <= a for a, b in zip(self.fed, self.fed[1:])) or self.fed[0] < 1:
            raise ValueError(f"fed counts must be ascending positive whole numbers: {self.fed}")
        _check_numbers("a ForwardCost table's ms", self.ms, positive=True)

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

    def implausible(self) -> str | None:
        """Why this table cannot be a timing (``TABLE_SLACK``: a forward fed more tokens costing less than half of
        the one fed fewest), or None (always for a linear model: its coefficients are >= 0)."""
        return None if self.line is not None else _dip([(f"fed {f}", m) for f, m in zip(self.fed, self.ms)])

    def impossible(self) -> str | None:
        """Why no machine could have timed this table (``IMPOSSIBLE_FACTOR``), or None."""
        if self.line is not None:
            return None  # its coefficients are >= 0
        for f, m in zip(self.fed, self.ms):
            if why := _negative(f"fed {f}", m, self.per_context_ms, self.ref_context):
                return why
        return _impossible([(f"fed {f}", f, m) for f, m in zip(self.fed, self.ms)])

    def table(self) -> dict[int, float]:
        return dict(zip(self.fed, self.ms))

    def to_dict(self) -> dict[str, object]:
        return {"fed": list(self.fed), "ms": list(self.ms), "per_context_ms": self.per_context_ms,
                "ref_context": self.ref_context, "line": None if self.line is None else list(self.line)}


def _slope(groups: Iterable[list[tuple[float, float]]]) -> float:
    """The least-squares slope of ``ms`` on ``x`` over ``(x, ms)`` points with one intercept per group
    (fitted on each group's residuals from its means), floored at 0; 0 where no group has two points."""
    num = den = 0.0
    for points in groups:
        if len(points) < 2:
            continue
        x_mean = sum(x for x, _ in points) / len(points)
        m_mean = sum(m for _, m in points) / len(points)
        num += sum((x - x_mean) * (m - m_mean) for x, m in points)
        den += sum((x - x_mean) ** 2 for x, _ in points)
    return max(0.0, num / den) if den else 0.0

