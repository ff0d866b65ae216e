"""Drafting allocated across a batch: how deep a batch drafts when its requests' draft tokens are weighed against
what the batch pays for them (TETRIS's allocation, for a batch that drafts and verifies in lockstep).

``depth_pays`` judges one depth; ``allocate_depth`` runs it depth by depth over runs read ahead (the serving env's
``allocate``, on the replay trees); ``bild_env.decoding.batched.BatchedDecoder.step(price=)`` runs it live. ``costs``
is anything with ``batch_ms(role, batch, fed, context)`` (a cost model with batched tables), ``loop`` a
``bild_env.serving.clock.BatchLoop`` or None.
"""

from __future__ import annotations

from collections.abc import Sequence


def allocate_depth(runs: Sequence[Sequence[float]], price: float, costs, batch: int, context: float,
                   max_draft_len: int, padded: bool = False, loop=None) -> int:
    """How deep a batch drafts this step when every request's draft tokens are weighed against what the batch pays
    to draft and verify them (TETRIS's allocation, for a batch that drafts and verifies in lockstep).

    ``runs[i]``: request ``i``'s per-token acceptance scores along the run its draft would propose (its max
    probabilities, or a better predictor's), as far as it can draft (``max_draft_len``, its token budget, EOS).
    Depth by depth, as a server learns them, ``depth_pays`` judges each depth's tokens; the first depth that does
    not pay ends the run. Returns the depth proposed: 0 when the first tokens are already not worth it (the first
    draft forward has run; its tokens are withheld, as BiLD's fallback withholds one), at most ``max_draft_len``.
    """
    check_price(price)
    if batch < 1 or batch < len(runs):
        raise ValueError(f"batch must be >= 1 and hold every run ({len(runs)}), got {batch}")
    cumulative = [1.0] * len(runs)
    for j in range(1, max_draft_len + 1):
        live = [i for i, run in enumerate(runs) if len(run) >= j]
        if not live:
            return j - 1
        for i in live:
            cumulative[i] *= float(runs[i][j - 1])
        going_on = sum(len(run) > j for run in runs) if j < max_draft_len else 0
        if not depth_pays(costs, price, sum(cumulative[i] for i in live), j, going_on, batch, context, padded, loop):
            return j - 1
    return max_draft_len


def check_price(price: float) -> None:
    if isinstance(price, bool) or not isinstance(price, (int, float)) or not 0.0 <= price <= 1.0:
        raise ValueError(f"the allocation's price must be in [0, 1] (0.5: draft tokens pay for what they cost), got "
                         f"{price!r}")


def depth_pays(costs, price: float, expected: float, depth: int, going_on: int, batch: int,
               context: float, padded: bool = False, loop=None) -> bool:
    """Whether a batch proposes its draft tokens of ``depth`` (1 for the first) and drafts on: the allocation's rule
    (``allocate_depth``; ``BatchedDecoder.step(price=...)`` runs it live).

    The draft forward of ``depth`` has run; its tokens are worth ``expected`` accepted tokens (the sum of their
    requests' cumulative scores, the predicted chance that every token of the run up to them is kept), each worth
    target-only's time per token at this batch (``batch_ms(target, batch, 1) / batch``). Proposing them costs the
    verification's extra column (``batch`` rows fed one token more) and, where ``going_on`` requests could draft
    one more, the draft forward of ``depth + 1`` (``batch`` rows when ``padded``: idle rows ride along; else those
    requests), plus the decoder's work on them (``loop``). They are proposed while

        value * (1 - price) >= cost * price,

    a price in [0, 1] (0: always on to the longest run; 0.5: where the value pays for the cost; 1: never). The rule
    is greedy: a depth is judged by its own tokens (a price under 0.5 credits the depths it opens).
    """
    per_token = costs.batch_ms("target", batch, 1, context) / batch
    cost = costs.batch_ms("target", batch, depth + 1, context) - costs.batch_ms("target", batch, depth, context)
    cost += loop.row_ms * batch if loop is not None else 0.0
    if going_on:
        cost += costs.batch_ms("draft", batch if padded else going_on, 1, context)
        cost += loop.forward_ms + loop.row_ms * going_on if loop is not None else 0.0
    return per_token * expected * (1.0 - price) >= cost * price
