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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

Trace = Sequence[tuple[str, int, int]]  # one request's forwards in a step: (role, tokens fed, tokens cached)
ROLES = ("draft", "target")


class BatchCosts(Protocol):
    def batch_ms(self, role: str, batch: int, fed: int, context: float) -> float: ...


def schedule(traces: Sequence[Trace]) -> list[tuple[str, int, int, float]]:
    """The batched forwards that run ``traces`` (one per request): ``(role, batch, fed, mean context)`` each.

    Prefills (context 0) of a model form one forward; the j-th other forward of a model in every request
    forms another (module docstring). Order: draft prefill, draft forwards, target prefill, target forwards.
    """
    out: list[tuple[str, int, int, float]] = []
    for role in ROLES:
        prefill: list[int] = []
        decode: list[list[tuple[int, int]]] = []
        for trace in traces:
            j = 0
            for r, fed, context in trace:
                if r != role:
                    continue
                if context == 0:
                    prefill.append(fed)
                    continue
                if j == len(decode):
                    decode.append([])
                decode[j].append((fed, context))
                j += 1
        if prefill:
            out.append((role, len(prefill), max(prefill), 0.0))
        for group in decode:
            out.append((role, len(group), max(f for f, _ in group), sum(c for _, c in group) / len(group)))
    return out


def charge(costs: BatchCosts, traces: Sequence[Trace]) -> tuple[float, float]:
    """``(step_ms, target_prefill_ms)``: milliseconds of the batched forwards that run ``traces`` (``schedule``),
    by the cost model, and the part of it the target's prefills take (what target-only serving pays too)."""
    total = target_prefill = 0.0
    for role, batch, fed, context in schedule(traces):
        ms = costs.batch_ms(role, batch, fed, context)
        total += ms
        if role == "target" and context == 0.0:
            target_prefill += ms
    return total, target_prefill
