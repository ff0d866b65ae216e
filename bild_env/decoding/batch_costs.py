"""What one batched forward of one model costs: a table over (sequences, tokens fed each), plus a slope.

A forward of B sequences, each fed n new tokens on ``context`` cached ones (``BatchCost``): a table
over B (``costs.BATCH_SIZES``: 1, 2, 4, ... 32) and n (1 .. 12 and the prefill lengths), bilinear
between its points, plus a slope per cached token per sequence:

    ms_M(B, n, context) = T_M(B, n) + s_M * B * (context - ref_M)

(on the 2-core AMD EPYC the slope measured grows with the batch, 0.012-0.022 ms per cached token per
sequence for smollm2's target fed 1 token at B = 1 to 32). ``fit_batched`` builds one from timed
forwards (``bild_env.decoding.costs.calibrate_batched`` times them); ``CostModel.batch_ms`` reads it.
The optional part of a cost model: only the batched decoder and the serving env need it
(``bild_env.decoding.costs.load_or_calibrate_batched``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bild_env.decoding.forward_costs import (ForwardCost, _bracket, _check_numbers, _dip, _impossible, _interp,
                                             _negative, _slope)


@dataclass(frozen=True)
class BatchCost:
    """The cost of one model's batched forward: a table over (batch, fed) at ``ref_context``, plus a slope.

    ``ms[i][j]`` is the median ms of one forward of ``batch[i]`` sequences, each fed ``fed[j]`` new tokens
    on ``ref_context`` cached tokens (equal-length rows; ``batch`` and ``fed`` ascending). Between the
    points it is bilinear: piecewise linear in ``fed`` (as ``ForwardCost``) within each batch row, then
    piecewise linear in ``batch`` between the two rows around it; beyond the table, linear from the last
    two points of each axis. ``per_context_ms`` is the cost per cached token **per sequence**: a forward of
    ``batch`` sequences on ``context`` cached tokens each costs ``per_context_ms * batch * (context -
    ref_context)`` more than the table (attention reads every row's cache: on the 2-core AMD EPYC, smollm2's
    target fed 1 token measured 0.022, 0.061, 0.19, 0.49 ms per cached token at B = 1, 4, 16, 32, i.e.
    0.012-0.022 per sequence). ``context`` may be a mean over the rows (the slope is linear in it).
    """

    batch: tuple[int, ...]
    fed: tuple[int, ...]
    ms: tuple[tuple[float, ...], ...]
    per_context_ms: float = 0.0
    ref_context: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch", tuple(int(b) for b in self.batch))
        object.__setattr__(self, "fed", tuple(int(f) for f in self.fed))
        object.__setattr__(self, "ms", tuple(tuple(float(m) for m in row) for row in self.ms))
        object.__setattr__(self, "per_context_ms", float(self.per_context_ms))
        object.__setattr__(self, "ref_context", int(self.ref_context))
        for name, axis in (("batch sizes", self.batch), ("fed counts", self.fed)):
            if not axis or axis[0] < 1 or any(b <= a for a, b in zip(axis, axis[1:])):
                raise ValueError(f"{name} must be ascending positive whole numbers, at least one: {axis}")
        if len(self.ms) != len(self.batch) or any(len(row) != len(self.fed) for row in self.ms):
            raise ValueError(f"a BatchCost table needs one row of {len(self.fed)} ms per batch size "
                             f"({len(self.batch)} rows): got {[len(row) for row in self.ms]}")
        _check_numbers("a BatchCost table's ms", (m for row in self.ms for m in row), positive=True)
        _check_numbers("per_context_ms", (self.per_context_ms,), positive=False)
        _check_numbers("ref_context", (self.ref_context,), positive=False)

    @classmethod
    def from_table(cls, points: dict[tuple[int, int], float], per_context_ms: float = 0.0,
                   ref_context: int = 0) -> BatchCost:
        """A BatchCost from ``{(batch, fed): ms}`` covering every batch size with every fed count."""
        batch = sorted({b for b, _ in points})
        fed = sorted({f for _, f in points})
        missing = [(b, f) for b in batch for f in fed if (b, f) not in points]
        if missing:
            raise ValueError(f"a BatchCost table needs every (batch, fed) pair; missing {missing}")
        return cls(tuple(batch), tuple(fed), tuple(tuple(points[b, f] for f in fed) for b in batch),
                   per_context_ms, ref_context)

    @classmethod
    def of(cls, value) -> BatchCost:
        """A BatchCost from itself or its saved dict."""
        if isinstance(value, BatchCost):
            return value
        return cls(tuple(value["batch"]), tuple(value["fed"]), tuple(tuple(row) for row in value["ms"]),
                   value["per_context_ms"], value["ref_context"])

    def __call__(self, batch: int, fed: int, context: float) -> float:
        """Milliseconds of one forward of ``batch`` sequences, each fed ``fed`` tokens on ``context`` cached ones."""
        i, j, w = _bracket(self.batch, batch)
        at = _interp(self.fed, self.ms[i], fed)
        if i != j:
            at += w * (_interp(self.fed, self.ms[j], fed) - at)
        return at + self.per_context_ms * batch * (context - self.ref_context)

    def implausible(self) -> str | None:
        """Why this table cannot be a timing, or None: ``TABLE_SLACK`` along each batch size's row (against its
        fewest tokens fed) and along each fed count's column (against the fewest sequences)."""
        for b, row in zip(self.batch, self.ms):
            if dip := _dip([(f"batch {b} fed {f}", m) for f, m in zip(self.fed, row)]):
                return dip
        for j, f in enumerate(self.fed):
            if dip := _dip([(f"batch {b} fed {f}", row[j]) for b, row in zip(self.batch, self.ms)]):
                return dip
        return None

    def impossible(self) -> str | None:
        """Why no machine could have timed this table (``forward_costs.IMPOSSIBLE_FACTOR``: a forward below 0 ms with
        no cached tokens, or off by that factor along a row or a column), or None."""
        for b, row in zip(self.batch, self.ms):
            for f, m in zip(self.fed, row):
                if why := _negative(f"batch {b} fed {f}", m, self.per_context_ms * b, self.ref_context):
                    return why
            if why := _impossible([(f"batch {b} fed {f}", f, m) for f, m in zip(self.fed, row)]):
                return why
        for j, f in enumerate(self.fed):
            if why := _impossible([(f"batch {b} fed {f}", b, row[j]) for b, row in zip(self.batch, self.ms)]):
                return why
        return None

    def table(self) -> dict[tuple[int, int], float]:
        return {(b, f): m for b, row in zip(self.batch, self.ms) for f, m in zip(self.fed, row)}

    def to_dict(self) -> dict[str, object]:
        return {"batch": list(self.batch), "fed": list(self.fed), "ms": [list(row) for row in self.ms],
                "per_context_ms": self.per_context_ms, "ref_context": self.ref_context}


def fit_batched(rows: list[tuple[int, int, int, float]], prefill_rows: list[tuple[int, int, int, float]] = (),
                fed: Sequence[int] = ()) -> BatchCost:
    """A BatchCost from timed ``(batch, fed, context, ms)``: ``rows`` time (batch, fed) cells at one context or more
    (at several: the slope); ``prefill_rows`` other fed counts at one context each.

    The slope per cached token per sequence (``batch * context`` the regressor) is the least-squares one with one
    intercept per (batch, fed) cell, floored at 0; the table holds each cell's mean time moved to the mean context
    (``ref_context``), so it reproduces a cell timed at one context only. A sparse timing leaves cells out
    (``fill_sparse``): a count of ``fed`` a batch size's row lacks is read off the line through its neighbours in that
    row, a prefill a batch size lacks off the line through the batch sizes that have it.
    """
    return BatchCost.from_table(*_fitted(rows, prefill_rows, fed))


def _fitted(rows: list[tuple[int, int, int, float]], prefill_rows: list[tuple[int, int, int, float]],
            fed: Sequence[int]) -> tuple[dict[tuple[int, int], float], float, int]:
    """``fit_batched``'s ``({(batch, fed): ms}, per_context_ms, ref_context)``."""
    contexts = sorted({ctx for _, _, ctx, _ in rows})
    by_cell: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for b, f, ctx, ms in rows:
        by_cell.setdefault((b, f), []).append((ctx, ms))
    slope = _slope([(b * c, m) for c, m in points] for (b, _), points in by_cell.items())
    ref = round(sum(contexts) / len(contexts)) if contexts else 0
    table = {cell: sum(m - slope * cell[0] * (c - ref) for c, m in points) / len(points)
             for cell, points in by_cell.items()}
    fills = {}
    for b, f, ctx, ms in prefill_rows:
        fills.setdefault((b, f), ms - slope * b * (ctx - ref))
    batch = sorted({b for b, _ in table} | {b for b, _ in fills})
    return fill_sparse(table, batch, fed) | fill_sparse(fills, batch, (), along_batch=True), slope, ref


def fit_table(rows: list[tuple[int, int, float]], prefill_rows: list[tuple[int, int, float]] = ()) -> ForwardCost:
    """A ForwardCost from timed ``(fed, context, ms)``: ``fit_batched``'s fit at batch 1. ``rows`` time the same fed
    counts at several contexts; ``prefill_rows`` other counts at one context each (a count ``rows`` time is theirs)."""
    timed = {f for f, _, _ in rows}
    prefills = [(1, *row) for row in prefill_rows if row[0] not in timed]
    table, slope, ref = _fitted([(1, *row) for row in rows], prefills, ())
    fed = sorted(f for _, f in table)
    return ForwardCost(tuple(fed), tuple(table[1, f] for f in fed), slope, ref)


def fill_sparse(points: dict[tuple[int, int], float], batch: Sequence[int], fed: Sequence[int],
                along_batch: bool = False) -> dict[tuple[int, int], float]:
    """``points`` ``{(batch, fed): ms}`` with the cells a sparse timing left out read off the lines through timed ones:
    every count of ``fed`` (and every count timed in some row) in every row of ``batch``, from that row's own timed
    counts (``_interp``); with ``along_batch``, every timed count in every row, from the rows that have it (beyond the
    largest such row: the line through the two largest, kept between that row's time and that time scaled by the
    batch, so noise cannot make it fall or turn negative). Timed cells stay as they are."""
    out = dict(points)
    counts = sorted({f for _, f in points} | set(fed))
    for b in batch:
        for f in counts:
            if (b, f) in out:
                continue
            if along_batch:
                line = sorted((x, m) for (x, g), m in points.items() if g == f)
                out[b, f] = _interp([x for x, _ in line], [m for _, m in line], b)
                last, m_last = line[-1]
                if b > last:  # beyond the timed batches: no less than the largest, no more than it scaled up
                    out[b, f] = min(max(out[b, f], m_last), m_last * b / last)
            else:
                line = sorted((g, m) for (x, g), m in points.items() if x == b)
                if line:
                    out[b, f] = _interp([g for g, _ in line], [m for _, m in line], f)
    return out


def describe_batched(tables: dict[str, BatchCost]) -> str:
    """The batched tables in a line of words (ms fed 1 token, by batch size), for a log."""
    parts = []
    for role, cost in tables.items():
        parts.append(f"{role} ms fed 1 by batch " + " ".join(f"{b}:{cost(b, 1, cost.ref_context):.1f}" for b in cost.batch)
                     + f" at {cost.ref_context} cached, +{cost.per_context_ms:.4f}/cached token/sequence")
    return "; ".join(parts)
