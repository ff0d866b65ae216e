"""What every decoder shares: the committed tokens after the target's prefill, the end test, the clock.

``Committed`` starts a generation on a runner (empty caches, the target prefills the prompt and
emits the first token) and answers "how many tokens are left" and "is it done" (EOS or
``max_new_tokens``) the same way for target-only decoding, naive speculative decoding and BiLD.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from bild_env.decoding.runner import Runner
from bild_env.models.device import sync


class Committed:
    """The committed sequence of one generation (batch size 1): prompt + output, after the prefill.

    ``tokens`` is prompt + output (a list the decoder appends to and cuts on rollback); ``t0`` the
    clock before the prefill; ``started`` the runner's statistics before it (for differences).
    ``device``: synchronised before the clock is read (None: nothing to synchronise).
    """

    def __init__(self, runner: Runner, prompt_ids: Sequence[int], max_new_tokens: int,
                 eos_token_ids: Sequence[int] = (), device: torch.device | None = None) -> None:
        self.runner = runner
        self.prompt_len = len(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.eos = frozenset(eos_token_ids)
        self.device = device
        runner.start()
        self.started = runner.stats.copy()
        self.t0 = time.perf_counter()
        argmax = runner.target_verify(list(prompt_ids))[0]  # 0. the target's prefill emits the first token
        self.tokens = list(prompt_ids) + [argmax[-1]]

    @property
    def new_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def remaining(self) -> int:
        """Tokens still to generate before ``max_new_tokens``."""
        return self.max_new_tokens - (len(self.tokens) - self.prompt_len)

    @property
    def done(self) -> bool:
        return self.remaining <= 0 or self.tokens[-1] in self.eos

    def elapsed_ms(self, since: float) -> float:
        """Wall time since ``since`` (a ``time.perf_counter()`` reading), after synchronising the device."""
        if self.device is not None:
            sync(self.device)
        return (time.perf_counter() - since) * 1000.0
