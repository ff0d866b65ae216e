"""A request's life in ``BiLD-Serve-v0`` (``Request``; ``Join``, as a batched decoder takes it up; ``Failure``, a step
the models failed) and what the env's steps and episodes did (``StepTally``, ``Totals``)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

from bild_env.decoding.bild import BildSession
from bild_env.replay.runner import ReplayRunner


@dataclass
class Request:
    """One request in the system: its session (None while queued), where it came from, when it arrived."""

    domain: str
    prompt_index: int
    prompt: list[int]
    arrived_ms: float
    runner: ReplayRunner | None = None
    session: BildSession | None = None
    started_ms: float = 0.0
    regret: float = 0.0


@dataclass
class Join:
    """A request joining a batched decoder (``bild_env.decoding.batched.BatchedDecoder.join``): ``prompt`` (token
    ids) and ``max_new_tokens`` to generate from there; ``rid`` names it, ``domain`` is a label."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    domain: str = ""


def resume_join(request: Request, rid: int, max_new_tokens: int) -> tuple[Join, int]:
    """A request already under way (``reset``'s warm batch) as a decoder joins it: its prompt extended by all but the
    last token it has (the decoder's prefill emits that one again), and its tokens so far before the decoder's
    (the offset of the decoder's output in the request's)."""
    new = list(request.session.new_ids)
    return (Join(rid, list(request.prompt) + new[:-1], max_new_tokens - len(new) + 1, request.domain),
            len(new) - 1)


@dataclass(frozen=True)
class Failure:
    """A request's step the models failed (e.g. out of memory filling a tree): the request ends, the batch goes on.
    ``error``: ``"<exception type>: <message>"``, as ``info["errors"]`` lists it."""

    error: str


@dataclass
class StepTally:
    """What the requests' steps of one env step did, summed; each request's forwards (``traces``, for the clock)."""

    traces: list = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    stops: list[float] = field(default_factory=list)  # the draft's max probability where each run stopped
    new_tokens: int = 0
    regret: float = 0.0
    mismatches: int = 0
    proposed: int = 0
    accepted: int = 0


class Totals:
    """What an episode did, overall and per domain, for ``info["episode_summary"]``."""

    def __init__(self, domains: Sequence[str]) -> None:
        self.step_ms = self.ref_ms = 0.0
        self.tokens = self.steps = self.batch_sum = 0
        self.regret = 0.0
        self.mismatches = self.proposed = self.accepted = 0
        self.by_domain = {d: {"tokens": 0, "proposed": 0, "accepted": 0, "regret": 0.0} for d in domains}

    def copy(self) -> Totals:
        """An independent copy (``peek`` restores one after every action it tries)."""
        out = copy.copy(self)
        out.by_domain = {d: dict(v) for d, v in self.by_domain.items()}
        return out

    def add(self, domain: str, s) -> None:
        d = self.by_domain[domain]
        d["tokens"] += s.new_tokens
        d["proposed"] += s.proposed
        d["accepted"] += s.accepted
        d["regret"] += s.regret
        self.regret += s.regret
        self.mismatches += s.mismatches
        self.proposed += s.proposed
        self.accepted += s.accepted

    def step(self, step_ms: float, ref_ms: float, tokens: int, batch: int) -> None:
        self.step_ms += step_ms
        self.ref_ms += ref_ms
        self.tokens += tokens
        self.steps += 1
        self.batch_sum += batch

    def summary(self) -> dict:
        t = max(self.tokens, 1)
        return {
            "goodput_tok_s": self.tokens / self.step_ms * 1000.0 if self.step_ms else 0.0,
            "ref_goodput_tok_s": self.tokens / self.ref_ms * 1000.0 if self.ref_ms else 0.0,
            "speedup": self.ref_ms / self.step_ms if self.step_ms else 1.0,
            "tokens": self.tokens, "busy_ms": self.step_ms, "ref_ms": self.ref_ms,
            "regret": self.regret / t, "fidelity": 1.0 - self.mismatches / t,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "mean_batch": self.batch_sum / max(self.steps, 1),
            "domains": {d: {"tokens": v["tokens"], "acceptance_rate": v["accepted"] / v["proposed"] if v["proposed"] else 0.0,
                            "regret": v["regret"] / max(v["tokens"], 1)} for d, v in self.by_domain.items()},
        }
