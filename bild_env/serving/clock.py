"""What one batched decoding step costs: the forwards of many requests' BiLD steps, charged as batches.

Each request's step is run on its own replay runner, which records the forwards live decoding of that
request would run, ``(role, fed, context)`` in order (``ReplayRunner.trace``). A batched decoder runs
them together; ``step_ms`` charges them as it would, from the cost model's table of batched forwards
(``CostModel.batch_ms(role, batch, fed, context)``: one forward of ``batch`` sequences fed ``fed``
tokens each on ``context`` cached tokens):

- **prefills apart**: a forward on an empty cache (a request's prompt, for the target when it joins and
  for the draft at its first draft forward) runs as one batched forward of those requests, padded to the
  longest prompt among them, at context 0 (engines prefill joining requests in a pass of their own);
- **decode forwards padded**: the j-th remaining forward of each model in each request's step runs as one
  forward of the requests that have a j-th one, every row padded to the longest (``fed`` = the largest
  fed count among them), at their mean context. This is what a batched decoder with attention masks
  over a right-padded batch computes: a row fed 1 token beside one fed 8 costs a row of 8. Packing (no
  padding) would need ragged attention kernels that the CPU stack here does not have; padding is what
  the batched decoders in this project run, so the clock charges what they pay.

Draft runs of different lengths therefore shrink the draft batch as requests stop drafting (forward j
holds only the requests still drafting), and a verification feeds every request's whole draft run in
one target forward padded to the longest run; a request that rolled back and emits one more target
token makes a second, smaller target forward.

``layout="padded"`` charges what ``bild_env.decoding.batched.BatchedDecoder`` (one padded KV cache per
model) really runs, checked against it on the clock by ``scripts.analysis.serving_clock``:

- **idle rows ride along**: every forward other than a prefill runs every row of the batch; a row with
  nothing to feed (a request that stopped drafting, or did not roll back) is fed pad tokens. So forward
  i of a model costs ``batch = len(traces)`` rows fed the longest feed among the rows it serves;
- **draft position, not count**: a request whose draft cache is empty prefills it at draft position 0
  (apart), and its next draft forward is the batch's position-1 forward (``"shrinking"`` groups it with
  the others' first);
- **the attention reads the padded width**: every row attends over the cache's columns, at least the
  longest row's context; charged at the group's longest context (``"shrinking"``: the mean).

``BatchLoop`` charges the decoder's own work beside the forwards (the readouts of the logits, tensor
bookkeeping, stats): per step, per forward and per row read; ``charge(..., loop=)`` adds it, and
``fit_loop`` fits it to measured steps by non-negative least squares.

``step_charge`` is the env's step as charged: its time and target-only decoding's for the same tokens at the same
load (the reward's two times); ``capacity_rps`` and ``steady_batch`` are the load's unit and the batch target-only
serving holds at a load.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np


Trace = Sequence[tuple[str, int, int]]  # one request's forwards in a step: (role, tokens fed, tokens cached)
Forward = tuple[str, int, int, float]  # one batched forward: (role, batch, fed, context)
ROLES = ("draft", "target")
LAYOUTS = ("shrinking", "padded")


class BatchCosts(Protocol):
    def batch_ms(self, role: str, batch: int, fed: int, context: float) -> float: ...


def schedule(traces: Sequence[Trace], layout: str = "shrinking") -> list[Forward]:
    """The batched forwards that run ``traces`` (one per request): ``(role, batch, fed, context)`` each.

    Prefills (context 0) of a model form one forward, ``fed`` = the longest prompt. ``"shrinking"``: the j-th other
    forward of a model in every request forms another, ``batch`` = the requests that have one, at their mean context.
    ``"padded"`` (as the padded batched decoder runs them): every other forward runs all ``len(traces)`` rows at the
    longest context of the rows it serves; draft forwards are grouped by the request's draft position in the step (its
    prefill is position 0), target forwards by their order after the prefill (the verification, then the rollback's
    forward). Either way ``fed`` = the longest feed among the rows served (module docstring). Order: draft prefill,
    draft forwards, target prefill, target forwards.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    padded = layout == "padded"
    out: list[Forward] = []
    for role in ROLES:
        prefill: list[int] = []
        groups: list[list[tuple[int, int]]] = []
        for trace in traces:
            i = 0
            for r, fed, context in trace:
                if r != role:
                    continue
                if context == 0:
                    prefill.append(fed)
                    if padded and role == "draft":
                        i += 1  # the batch's position-0 draft forward runs beside it
                    continue
                while i >= len(groups):
                    groups.append([])
                groups[i].append((fed, context))
                i += 1
        if prefill:
            out.append((role, len(prefill), max(prefill), 0.0))
        for group in filter(None, groups):
            fed = max(f for f, _ in group)
            if padded:
                out.append((role, len(traces), fed, float(max(c for _, c in group))))
            else:
                out.append((role, len(group), fed, sum(c for _, c in group) / len(group)))
    return out


@dataclass(frozen=True)
class BatchLoop:
    """Milliseconds of a batched decoder's own work beside its forwards: per step, per forward, per row read.

    A row read is one row of logits read for the rules (vocabulary-wide max and log-sum-exp): a draft
    forward reads one per row it serves (the rows still drafting), a target forward of ``batch`` rows fed
    ``fed`` reads ``batch * fed`` (its argmax over every column), a prefill reads ``batch``.
    """

    step_ms: float = 0.0
    forward_ms: float = 0.0
    row_ms: float = 0.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"BatchLoop.{name} must be a finite number >= 0, got {value!r}")

    def __call__(self, counts: Sequence[float]) -> float:
        """ms of a step whose ``loop_counts`` are ``counts`` (steps, forwards, row reads)."""
        return self.step_ms * counts[0] + self.forward_ms * counts[1] + self.row_ms * counts[2]

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def loop_counts(traces: Sequence[Trace], layout: str = "padded") -> tuple[int, int, int]:
    """(steps, forwards, row reads) of one step that runs ``traces`` (``BatchLoop``): what its loop work scales with."""
    forwards = schedule(traces, layout)
    reads = 0
    for role, batch, fed, context in forwards:
        if context == 0.0:
            reads += batch
        elif role == "target":
            reads += batch * fed
    # a draft forward reads the rows it serves: each draft forward of each request but its prefill
    reads += sum(1 for trace in traces for r, _, context in trace if r == "draft" and context)
    return (1 if traces else 0), len(forwards), reads


def fit_loop(counts: Sequence[Sequence[float]], loop_ms: Sequence[float]) -> BatchLoop:
    """The ``BatchLoop`` that best explains ``loop_ms`` (each step's measured ms outside the model calls) from
    its ``loop_counts``, by non-negative least squares."""
    from scipy.optimize import nnls

    x, y = np.asarray(counts, dtype=float), np.asarray(loop_ms, dtype=float)
    if x.ndim != 2 or x.shape[1] != 3 or len(x) != len(y) or not len(y):
        raise ValueError(f"fit_loop needs one (steps, forwards, row reads) row per measured step: got {x.shape}, "
                         f"{len(y)} times")
    scale = np.maximum(np.abs(x).max(0), 1.0)  # columns of comparable size for the solver
    coef, _ = nnls(x / scale, y)
    return BatchLoop(*(float(c) for c in coef / scale))


def charge(costs: BatchCosts, traces: Sequence[Trace], layout: str = "shrinking",
           loop: BatchLoop | None = None) -> tuple[float, float]:
    """``(step_ms, target_prefill_ms)``: milliseconds of the batched forwards that run ``traces`` (``schedule``),
    by the cost model, and the part of it the target's prefills take (what target-only serving pays too).
    ``loop``: also the decoder's own work (``BatchLoop``; part of ``step_ms`` only)."""
    total, target_prefill = forwards_ms(costs, schedule(traces, layout))
    if loop is not None and traces:
        total += loop(loop_counts(traces, layout))
    return total, target_prefill


def forwards_ms(costs: BatchCosts, forwards: Sequence[Forward]) -> tuple[float, float]:
    """``(ms, target_prefill_ms)`` of batched ``forwards`` by the cost model: all of them, and the target's prefills
    (context 0) among them. The env charges its schedule of a step's traces; a batched decoder on the clock, the
    forwards it ran (``agents.serve.online``)."""
    total = target_prefill = 0.0
    for role, batch, fed, context in forwards:
        ms = costs.batch_ms(role, batch, fed, context)
        total += ms
        if role == "target" and context == 0.0:
            target_prefill += ms
    return total, target_prefill


def reference_ms(costs: BatchCosts, new_tokens: int, decoding: int, context: float, target_prefill: float) -> float:
    """What target-only decoding at this load takes for a step's ``new_tokens``: each at the target's one-token
    forward over the ``decoding`` rows, shared by them, plus the same prefills (``target_prefill`` ms)."""
    return new_tokens * costs.batch_ms("target", max(decoding, 1), 1, context) / max(decoding, 1) + target_prefill


def step_context(start_context: Sequence[int], padded: bool, empty: float) -> float:
    """The context a step's forwards are charged at, from each request's ``start_context`` (what its target cache
    holds: all but its last token): their mean, or ``padded`` (``charge_loop``: the padded decoder spans them) the
    longest; ``empty`` for an empty batch."""
    if not start_context:
        return empty
    return max(start_context) if padded else sum(start_context) / len(start_context)


def step_charge(costs: BatchCosts, traces: Sequence[Trace], new_tokens: int, context: float, loop: BatchLoop | None,
                read_ahead: int, max_batch: int) -> tuple[float, float]:
    """``(step_ms, ref_ms)`` of a serving step whose requests ran ``traces`` and committed ``new_tokens``, at
    ``context``. ``step_ms``: its batched forwards (``charge``: shrinking, or with ``loop`` padded plus the decoder's
    own work), plus, when ``read_ahead`` rows' next proposals were read ahead (``observe_next``) and the step drafted
    nothing, the draft forward that read them (a server reads them with the step's first draft forward, run before
    the action, so a step that drafts nothing has run it for nothing: ``BatchedDecoder.peek_draft``). ``ref_ms``:
    what target-only decoding at this load takes for the step's tokens: each at the target's one-token forward over
    the batch, shared by its rows, plus the same prefills; with ``loop``, the decoder's own work for its prefills and
    its one forward too."""
    step_ms, target_prefill = charge(costs, traces, "padded" if loop is not None else "shrinking", loop)
    if read_ahead and not any(role == "draft" for trace in traces for role, _, _ in trace):
        step_ms += costs.batch_ms("draft", min(read_ahead, max_batch), 1, context)
        step_ms += loop((0, 1, read_ahead)) if loop is not None else 0.0
    decoding = len(traces)
    ref_ms = reference_ms(costs, new_tokens, decoding, context, target_prefill)
    if loop is not None and decoding:
        joined = sum(any(role == "target" and c == 0.0 for role, _, c in trace) for trace in traces)  # prefilled
        ref_ms += loop((1, 1 + (joined > 0), decoding + joined))
    return step_ms, ref_ms


def capacity_rps(costs: BatchCosts, max_batch: int, max_new_tokens: int, context: float) -> float:
    """Requests per second a full batch of target-only decoding completes at ``context`` (the load's unit)."""
    full = costs.batch_ms("target", max_batch, 1, context)
    return max_batch / (max_new_tokens * full / 1000.0)


def steady_batch(costs: BatchCosts, rate: float, max_batch: int, max_new_tokens: int, context: float) -> float:
    """Requests target-only serving holds at ``rate`` requests per second (Little's law, solved by fixed-point
    iteration)."""
    b = 1.0
    for _ in range(20):
        per_step = costs.batch_ms("target", max(1, round(b)), 1, context)
        b = min(float(max_batch), rate * max_new_tokens * per_step / 1000.0)
    return b
