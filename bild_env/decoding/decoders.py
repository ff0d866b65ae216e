"""The three decoders, batch size 1, greedy: target only, naive speculative decoding, BiLD.

Each takes a prompt (text or token ids) and returns a ``Generation`` (new token ids, text,
``DecodeStats``). EOS and ``max_new_tokens`` end a generation in every decoder alike; the EOS
token, when produced, is part of the output (as with ``generate``).
"""

from __future__ import annotations

import time

import torch

from bild_env.decoding.bild import FIXED_FALLBACK, FIXED_ROLLBACK, MAX_DRAFT_LEN, BildSession, check_thresholds
from bild_env.decoding.costs import CostModel
from bild_env.models.pairs import ModelPair
from bild_env.decoding.runner import LiveRunner
from bild_env.decoding.stats import DecodeStats, Generation


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def prepare_prompt(pair: ModelPair, prompt: str | list[int] | torch.Tensor, max_new_tokens: int) -> list[int]:
    """Token ids of ``prompt``, checked to leave room for ``max_new_tokens`` under the models' positions."""
    _positive_int("max_new_tokens", max_new_tokens)
    ids = pair.encode(prompt)
    if len(ids) + max_new_tokens > pair.max_positions:
        raise ValueError(
            f"the prompt has {len(ids)} tokens and max_new_tokens is {max_new_tokens}, but the models take at most "
            f"{pair.max_positions} positions: shorten the prompt to at most {pair.max_positions - max_new_tokens} "
            "tokens or lower max_new_tokens"
        )
    return ids


class _Loop:
    """Shared bookkeeping of the whole-generation loops: prefill, done test, timing, result."""

    def __init__(self, pair: ModelPair, prompt_ids: list[int], max_new_tokens: int, cost_model: CostModel | None):
        self.pair, self.max_new_tokens = pair, max_new_tokens
        self.eos = frozenset(pair.eos_token_ids)
        self.runner = LiveRunner(pair, cost_model)
        self.prompt_len = len(prompt_ids)
        self.stats = DecodeStats()
        self.t0 = time.perf_counter()
        argmax, _ = self.runner.target_verify(prompt_ids)  # target prefill emits the first token
        self.tokens = prompt_ids + [argmax[-1]]

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - (len(self.tokens) - self.prompt_len)

    @property
    def done(self) -> bool:
        return self.remaining <= 0 or self.tokens[-1] in self.eos

    def result(self) -> Generation:
        if self.pair.device.type == "cuda":
            torch.cuda.synchronize(self.pair.device)
        wall = (time.perf_counter() - self.t0) * 1000.0
        stats = self.runner.stats
        for name in ("proposed", "accepted", "full_accepts", "steps"):
            setattr(stats, name, getattr(self.stats, name))
        stats.new_tokens = len(self.tokens) - self.prompt_len
        stats.wall_ms = wall
        new = self.tokens[self.prompt_len :]
        return Generation(self.tokens[: self.prompt_len], new, self.pair.decode(new), stats)


def generate_target_only(
    pair: ModelPair, prompt: str | list[int] | torch.Tensor, max_new_tokens: int = 64, cost_model: CostModel | None = None
) -> Generation:
    """Greedy decoding with the target alone and its KV cache (the "single model" baseline)."""
    loop = _Loop(pair, prepare_prompt(pair, prompt, max_new_tokens), max_new_tokens, cost_model)
    while not loop.done:
        argmax, _ = loop.runner.target_verify(loop.tokens)
        loop.tokens.append(argmax[-1])
    return loop.result()


def generate_speculative(
    pair: ModelPair,
    prompt: str | list[int] | torch.Tensor,
    k: int = 4,
    max_new_tokens: int = 64,
    cost_model: CostModel | None = None,
) -> Generation:
    """Naive speculative decoding: the draft proposes k tokens, one target forward verifies them.

    The longest prefix equal to the target's argmax is kept, plus the target's own next token, so
    the output is exactly the target's greedy output.
    """
    _positive_int("k", k)
    loop = _Loop(pair, prepare_prompt(pair, prompt, max_new_tokens), max_new_tokens, cost_model)
    runner, tokens = loop.runner, loop.tokens
    while not loop.done:
        # 1. propose: up to k draft tokens, leaving room for the target's token
        budget, drafted = min(k, loop.remaining - 1), 0
        while drafted < budget and tokens[-1] not in loop.eos:
            token, _ = runner.draft_next(tokens)
            tokens.append(token)
            drafted += 1
        # 2. verify: one target forward over the tokens its cache lacks
        n = len(tokens)
        argmax, _ = runner.target_verify(tokens)
        off = len(argmax) - drafted - 1  # argmax[off + j] is the target's choice for draft token j
        # 3. accept the longest agreeing prefix
        accepted = 0
        while accepted < drafted and tokens[n - drafted + accepted] == argmax[off + accepted]:
            accepted += 1
        # 4. crop the rejected suffix from the output and both caches; add the target's token
        keep = n - drafted + accepted
        del tokens[keep:]
        runner.crop(keep)
        if not loop.done:
            tokens.append(argmax[off + accepted])
        loop.stats.steps += 1
        loop.stats.proposed += drafted
        loop.stats.accepted += accepted
        loop.stats.full_accepts += 0 < accepted == drafted
    return loop.result()


def generate_bild(
    pair: ModelPair,
    prompt: str | list[int] | torch.Tensor,
    fallback: float = FIXED_FALLBACK,
    rollback: float = FIXED_ROLLBACK,
    max_draft_len: int = MAX_DRAFT_LEN,
    max_new_tokens: int = 64,
    cost_model: CostModel | None = None,
) -> Generation:
    """BiLD with fixed thresholds: ``BildSession`` stepped to the end (see bild_env.decoding.bild)."""
    check_thresholds(fallback, rollback)
    _positive_int("max_draft_len", max_draft_len)
    session = new_bild_session(pair, prompt, max_new_tokens, max_draft_len, cost_model)
    while not session.done:
        session.step(fallback, rollback)
    new = session.new_ids
    return Generation(session.tokens[: session.prompt_len], new, pair.decode(new), session.total)


def new_bild_session(
    pair: ModelPair,
    prompt: str | list[int] | torch.Tensor,
    max_new_tokens: int = 64,
    max_draft_len: int = MAX_DRAFT_LEN,
    cost_model: CostModel | None = None,
) -> BildSession:
    """A step-wise BiLD session on live models (the target prefill has run)."""
    _positive_int("max_draft_len", max_draft_len)
    ids = prepare_prompt(pair, prompt, max_new_tokens)
    return BildSession(
        LiveRunner(pair, cost_model), ids, max_new_tokens, pair.eos_token_ids, max_draft_len,
        sync_cuda=pair.device.type == "cuda",
    )
