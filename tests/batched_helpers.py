"""Whole batches of BiLD and naive speculative decoding, start to end, for the tests (the envs and commands step a
``BatchedDecoder`` themselves; ``batched.generate_batched_target_only`` is the library's one whole-batch decode)."""

from __future__ import annotations

from collections.abc import Sequence

from bild_env.decoding.batched import _decode_all
from bild_env.decoding.bild import FIXED_FALLBACK, FIXED_ROLLBACK, MAX_DRAFT_LEN
from bild_env.decoding.stats import Generation
from bild_env.models.pairs import ModelPair


def generate_batched_bild(pair: ModelPair, prompts: Sequence, fallback: float = FIXED_FALLBACK,
                          rollback: float = FIXED_ROLLBACK, max_draft_len: int = MAX_DRAFT_LEN,
                          max_new_tokens: int | Sequence[int] = 64) -> list[Generation]:
    """BiLD with fixed thresholds over all ``prompts`` as one batch; one ``Generation`` per prompt, in order."""
    return _decode_all(pair, prompts, max_new_tokens, lambda d: d.step(fallback, rollback), max_draft_len)


def generate_batched_speculative(pair: ModelPair, prompts: Sequence, k: int = 4,
                                 max_new_tokens: int | Sequence[int] = 64) -> list[Generation]:
    """Naive speculative decoding (k drafts a round) over all ``prompts`` as one batch (lossless)."""
    return _decode_all(pair, prompts, max_new_tokens, lambda d: d.step_speculative(k))
