"""The narrow interface between decoding algorithms and the models: forwards over KV caches.

A runner answers the only questions greedy speculative decoding asks, at a committed token
sequence ``tokens`` (prompt + output, a Python list):

- ``draft_next(tokens)``: the draft's argmax and max probability after ``tokens``;
- ``target_verify(tokens)``: for every position p the target's cache lacks, the target's argmax
  after ``tokens[:p+1]``, its log-probability (nats) of ``tokens[p+1]`` and of its own argmax (a
  prefill, with an empty cache, answers for the last position only);
- ``crop(n)``: forget everything after the first n tokens in both caches (a rollback).

Each model keeps a KV cache; a forward feeds exactly the tokens its cache lacks (the draft
catches up on committed tokens in one parallel forward). Every forward is counted in
``stats`` (forwards, tokens fed, measured time, cost-model time), so the statistics of all
decoders come from one place. ``LiveRunner`` runs real models; the replay backend answers the
same questions from a prefix tree.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from bild_env.decoding.cost_model import CostModel
from bild_env.decoding.kv import Row, crop_cache, draft_readout, single_forward, target_readout
from bild_env.models.draft_head import proposal_logits
from bild_env.models.pairs import ModelPair
from bild_env.decoding.stats import DecodeStats


class Runner(Protocol):
    stats: DecodeStats

    def start(self) -> None: ...
    def draft_next(self, tokens: list[int]) -> tuple[int, float]: ...
    def target_verify(self, tokens: list[int]) -> tuple[list[int], list[float], list[float]]: ...
    def crop(self, n: int) -> None: ...
    def target_agrees(self, tokens: list[int], token: int) -> float: ...


def count_forward(stats: DecodeStats, cost_model: CostModel | None, role: str, fed: int, context: int,
                  ms: float = 0.0) -> None:
    """Add one forward of ``role`` (``fed`` new tokens on ``context`` cached ones, ``ms`` measured) to ``stats``."""
    if role == "draft":
        stats.draft_forwards += 1
        stats.draft_tokens_fed += fed
    else:
        stats.target_forwards += 1
        stats.target_tokens_fed += fed
    stats.forward_ms += ms
    if cost_model is not None:
        stats.model_ms += cost_model.ms(role, fed, context)


class LiveRunner:
    """Runs the pair's two models with one ``DynamicCache`` each (batch size 1, greedy)."""

    def __init__(self, pair: ModelPair, cost_model: CostModel | None = None) -> None:
        self.pair = pair
        self.cost_model = cost_model
        self.start()

    def start(self) -> None:
        """Empty both caches and zero the statistics (a new prompt)."""
        from transformers import DynamicCache

        self.caches = {
            "draft": DynamicCache(config=self.pair.draft.config),
            "target": DynamicCache(config=self.pair.target.config),
        }
        self.lengths = {"draft": 0, "target": 0}
        self.stats = DecodeStats(model_ms=0.0 if self.cost_model else None)

    def _forward(self, role: str, tokens: list[int], keep: int) -> torch.Tensor:
        """Feed ``tokens[cache_len:]`` to ``role``; return float32 logits of the last ``keep`` positions."""
        context = self.lengths[role]
        if context >= len(tokens):
            raise RuntimeError(f"internal error: the {role} cache already holds all {len(tokens)} tokens")
        z = single_forward(getattr(self.pair, role), Row(tokens[context:], self.caches[role], keep))
        self.lengths[role] = len(tokens)
        return z

    @torch.inference_mode()
    def draft_next(self, tokens: list[int]) -> tuple[int, float]:
        """Draft argmax and max probability after ``tokens`` (one forward of the draft)."""
        context = self.lengths["draft"]
        t0 = time.perf_counter()
        with proposal_logits(self.pair.draft) as ids:  # a restricted head's K columns alone
            (arg,), (p,) = draft_readout(self._forward("draft", tokens, keep=1)[-1:], ids)
        count_forward(self.stats, self.cost_model, "draft", len(tokens) - context, context, (time.perf_counter() - t0) * 1000.0)
        return arg, p

    @torch.inference_mode()
    def target_verify(self, tokens: list[int]) -> tuple[list[int], list[float], list[float]]:
        """One target forward over every token its cache lacks.

        Returns, for each fed position p (in order): ``argmax[i]``, the target's greedy token after
        ``tokens[:p+1]``; and for all but the last position ``logp[i]`` = log softmax(z_p)[tokens[p+1]]
        in nats (the BiLD rollback distance is its negation) and ``top[i]`` = max log softmax(z_p),
        the log-probability of the target's own choice there. A prefill (empty cache) returns the
        last position only: no algorithm verifies prompt tokens.
        """
        context = self.lengths["target"]
        fed = len(tokens) - context
        keep = fed if context else 1
        t0 = time.perf_counter()
        z = self._forward("target", tokens, keep=keep)  # (keep, vocab)
        argmax, logp, top = target_readout(z, tokens[context + 1 :] if keep > 1 else [])
        count_forward(self.stats, self.cost_model, "target", fed, context, (time.perf_counter() - t0) * 1000.0)
        return argmax, logp, top

    def target_agrees(self, tokens: list[int], token: int) -> float:
        """The oracle score (``bild.DraftScore``) needs the target's choice before it is verified: only replay has it."""
        raise ValueError("the oracle score reads the target's greedy token from the replay trees, which live decoding "
                         "has not computed yet: use it with the replay backend (the envs), or use score='token' or "
                         "'cumulative'")

    @torch.inference_mode()
    def crop(self, n: int) -> None:
        """Roll both caches back to the first ``n`` tokens."""
        for role, cache in self.caches.items():
            if self.lengths[role] > n:
                crop_cache(cache, n)
                self.lengths[role] = n
