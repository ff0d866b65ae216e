"""BiLD (Big Little Decoder, Kim et al. 2023): the fallback and rollback rules, and a step-wise session.

One BiLD step = one SMALL phase (the draft proposes tokens autoregressively until its confidence
drops below the fallback threshold or it has proposed ``max_draft_len`` tokens) followed by the
LARGE phase (one target forward over all tokens its cache lacks, which rolls back the first draft
token it finds too unlikely and then emits its own next token). See ../shared/BILD_SPEC.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from bild_env.decoding.loop import Committed
from bild_env.decoding.runner import Runner
from bild_env.decoding.stats import DecodeStats

FIXED_FALLBACK = 0.103  # the BiLD paper's grid-searched thresholds (the fixed baseline)
FIXED_ROLLBACK = 4.697
MAX_DRAFT_LEN = 10
FORWARD_FIELDS = ("draft_forwards", "target_forwards", "draft_tokens_fed", "target_tokens_fed", "forward_ms", "model_ms")


SCORES = ("token", "cumulative", "lookup", "lookup_cumulative", "oracle")  # what the fallback threshold reads
LOOKUP_SCORES = ("lookup", "lookup_cumulative")  # read from the pair's lookup predictor (``bild_env.models.lookup``)


def should_fall_back(p_max: float, fallback_threshold: float) -> bool:
    """Fallback policy: hand over to the target when the draft's max probability is below the threshold."""
    return p_max < fallback_threshold


def check_score(score: str) -> str:
    """The kind of stopping score ``score`` names (``SCORES``; ``"oracle:W"`` is an oracle of weight W in (0, 1],
    ``DraftScore``); ValueError listing them otherwise."""
    if score in SCORES:
        return score
    kind, _, weight = str(score).partition(":")
    try:
        if kind == "oracle" and 0.0 < float(weight) <= 1.0:
            return kind
    except ValueError:
        pass
    raise ValueError(f"score must be one of {', '.join(SCORES)} or oracle:W with W in (0, 1] (what the draft's "
                     f"stopping threshold reads), got {score!r}")


class DraftScore:
    """What a draft run's stopping rule compares with its threshold, token by token along one run.

    - ``"token"``: the draft's max probability of the token just proposed (BiLD's fallback rule; transformers'
      ``assistant_confidence_threshold``). One unsure token stops the run, however sure the ones before were.
    - ``"cumulative"``: the product of the max probabilities of the run so far, the chance (if they were
      calibrated and independent) that every token of the run is kept. SpecDec++'s stopping rule stops when the
      predicted chance of at least one rejection, 1 - product, passes a threshold: the same rule. A long run of
      fairly sure tokens stops where a token rule would go on; a run's first token is judged as by ``"token"``.
    - ``"lookup"``: the pair's lookup predictor's chance that the target keeps the proposal (``bild_env.models.lookup``:
      the max probability and whether the proposal continues a span the context already holds);
      ``"lookup_cumulative"``: the product of those along the run. Both need ``predictor`` and, at ``next``, the
      context and the proposal.
    - ``"oracle"``: 1 if the target's greedy token equals the proposal, else 0 (``runner.target_agrees``): a
      perfect acceptance predictor, read from the replay trees at no charge, for measuring the room a
      predictor could reach (with any threshold in (0, 1], the run stops at its first rejected token). Live
      runners refuse it. ``"oracle:W"`` (W in (0, 1]) is a predictor between the max probability and the
      oracle: ``(1 - W) * p_max + W * agrees`` token by token (``"oracle:1"`` stops as ``"oracle"``), for
      measuring how the room grows with a predictor's quality (its AUC rises with W).

    ``start()`` at each run's first proposal; ``next(p_max, agrees, context, proposal)`` gives the score after the
    next token (``context``: the token ids before the proposal, read by the lookup scores only).
    """

    __slots__ = ("kind", "value", "weight", "predictor")

    def __init__(self, kind: str = "token", predictor=None) -> None:
        self.kind, self.value = check_score(kind), 1.0
        self.weight = float(kind.partition(":")[2] or 1.0) if self.kind == "oracle" else 0.0  # oracle:W's W
        if self.kind in LOOKUP_SCORES and predictor is None:
            raise ValueError(f"score {kind!r} reads the pair's lookup predictor: pass predictor= "
                             "(bild_env.models.lookup.lookup_for(pair); fit one with `python -m distill lookup`)")
        self.predictor = predictor

    def start(self) -> None:
        self.value = 1.0

    def next(self, p_max, agrees=None, context=None, proposal=None):
        """The score after a proposal of max probability ``p_max`` (floats or tensors alike; the lookup scores
        floats, with ``context`` and ``proposal``)."""
        if self.kind == "token":
            self.value = p_max
        elif self.kind == "cumulative":
            self.value = self.value * p_max
        elif self.kind == "lookup":
            self.value = self.predictor.probability(p_max, context, proposal)
        elif self.kind == "lookup_cumulative":
            self.value = self.value * self.predictor.probability(p_max, context, proposal)
        elif self.weight == 1.0:
            self.value = self.value * agrees
        else:  # a predictor between the max probability and the oracle, token by token
            self.value = (1.0 - self.weight) * p_max + self.weight * agrees
        return self.value


def first_rollback(
    distances: Sequence[float], draft_tokens: Sequence[int], target_argmax: Sequence[int], rollback_threshold: float
) -> int | None:
    """Rollback policy: index of the first draft token to undo, or None.

    ``distances[i] = -log p_L(draft_tokens[i])`` (nats) under the target's distribution at that
    position and ``target_argmax[i]`` is the target's greedy token there. A token is rolled back when
    its distance exceeds the threshold AND it differs from the target's choice (a token equal to the
    argmax is never "corrected" into itself; and every later token is still checked).
    """
    for i, (d, y, a) in enumerate(zip(distances, draft_tokens, target_argmax)):
        if d > rollback_threshold and y != a:
            return i
    return None


def check_thresholds(fallback: float, rollback: float) -> None:
    """Raise ValueError with the valid ranges for a bad threshold pair (0 is valid for both)."""
    if not (isinstance(fallback, (int, float)) and 0.0 <= fallback <= 1.0):
        raise ValueError(f"fallback threshold must be a probability in [0, 1], got {fallback!r}")
    if not isinstance(rollback, (int, float)) or math.isnan(rollback) or rollback < 0:
        raise ValueError(f"rollback threshold must be a distance in nats >= 0 (inf disables rollback), got {rollback!r}")


def _add_regret(s: DecodeStats, kept: Sequence[int], argmax: Sequence[int], logp: Sequence[float],
                top: Sequence[float]) -> None:
    """Charge the draft tokens a verification kept: ``mismatches`` counts those that differ from the target's
    argmax, ``regret`` adds their log-probability gap to it (nats, ``top - logp``) from that same forward.
    Tokens equal to the argmax cost 0 whatever the rounding, so lossless decoding has regret 0 on any dtype."""
    for y, a, lp, t in zip(kept, argmax, logp, top):
        if y != a:
            s.mismatches += 1
            s.regret += max(0.0, t - lp)


class BildSession(Committed):
    """Greedy BiLD over one prompt, driven one step at a time (the env's unit of action).

    Creating the session prefills the target on the prompt and commits its first token. Then each
    ``step(fallback, rollback)`` runs one draft phase and the target verification that ends it,
    with the thresholds given for this step, and returns that step's ``DecodeStats``.
    ``score`` (``SCORES``, ``DraftScore``) is what the fallback threshold is compared with: the token's max
    probability (BiLD's rule, the default) or the run's cumulative product of them.
    ``tokens`` is prompt + output; ``new_ids`` the output; ``done`` is True at EOS or
    ``max_new_tokens`` (``Committed``); ``total`` adds up the prefill and every step. ``device`` is
    synchronised before each step's clock is read.
    """

    def __init__(
        self,
        runner: Runner,
        prompt_ids: list[int],
        max_new_tokens: int,
        eos_token_ids: Sequence[int] = (),
        max_draft_len: int = MAX_DRAFT_LEN,
        device: torch.device | None = None,
        score: str = "token",
        predictor=None,
    ) -> None:
        if max_draft_len < 1:
            raise ValueError(f"max_draft_len must be >= 1, got {max_draft_len}")
        self.max_draft_len = max_draft_len
        self.score = DraftScore(score, predictor)  # what the fallback threshold reads (``SCORES``; predictor: lookup's)
        self.draft_p = 1.0
        super().__init__(runner, prompt_ids, max_new_tokens, eos_token_ids, device)  # the target's prefill
        self.total = DecodeStats(model_ms=self.started.model_ms)
        self.prefill = self._finish(DecodeStats(new_tokens=1), self.t0, self.started)

    def snapshot(self) -> tuple:
        """What a step changes here (the tokens, the running total, the draft's last probability), for ``restore``
        (the replay envs' rewind; the runner keeps its own: ``ReplayRunner.snapshot``)."""
        return list(self.tokens), self.total.copy(), self.draft_p

    def restore(self, saved: tuple) -> None:
        tokens, total, self.draft_p = saved
        self.tokens, self.total = list(tokens), total.copy()

    def _finish(self, step: DecodeStats, t0: float, before: DecodeStats) -> DecodeStats:
        """Fill ``step``'s forward counters and wall time, add it to ``total`` and return it."""
        step.wall_ms = self.elapsed_ms(t0)
        now, then, out = self.runner.stats.__dict__, before.__dict__, step.__dict__
        for name in FORWARD_FIELDS:  # forwards as the runner counted them
            a, b = now[name], then[name]
            out[name] = None if a is None or b is None else a - b
        self.total += step
        return step

    def step(self, fallback: float, rollback: float) -> DecodeStats:
        """One BiLD step with these thresholds; returns what it did."""
        if self.done:
            raise RuntimeError("the generation is finished (EOS or max_new_tokens); start a new session")
        check_thresholds(fallback, rollback)
        t0 = time.perf_counter()
        before = self.runner.stats.copy()
        start_len = len(self.tokens)
        s = DecodeStats(steps=1)
        guesses: list[tuple[int, float]] = []  # the draft's predictions this step: (token, max probability)

        # 1. SMALL phase: the draft proposes tokens until fallback, max_draft_len, EOS or the length limit.
        withheld = None  # the prediction a fallback kept back (judged by the verification all the same)
        score = self.score
        score.start()
        while not self.done:
            token, p_max = self.runner.draft_next(self.tokens)
            self.draft_p = p_max  # the draft's confidence where its run stops (read by the env's observation)
            agrees = self.runner.target_agrees(self.tokens, token) if score.kind == "oracle" else None
            stop = should_fall_back(score.next(p_max, agrees, self.tokens, token), fallback)
            if stop:
                s.fallbacks += 1
                withheld = (token, p_max)
                break
            self.tokens.append(token)
            guesses.append((token, p_max))
            s.proposed += 1
            if s.proposed == self.max_draft_len:
                s.max_draft_hits += 1
                break

        # 2. LARGE phase: one target forward over what its cache lacks; roll back or emit a token.
        pending = s.proposed  # draft tokens not yet verified: the last `pending` tokens
        while True:
            n = len(self.tokens)
            argmax, logp, top = self.runner.target_verify(self.tokens)
            m = None
            if pending:
                # fed positions p = n-len(argmax) .. n-1; draft token j sits at n-pending+j and is
                # judged by the logits at the position before it.
                off = len(argmax) - pending - 1
                m = first_rollback([-lp for lp in logp[off:]], self.tokens[n - pending :], argmax[off:-1], rollback)
                kept = pending if m is None else m
                _add_regret(s, self.tokens[n - pending : n - pending + kept], argmax[off:], logp[off:], top[off:])
                for (token, p_max), target in zip(guesses[: pending if m is None else m + 1], argmax[off:]):
                    s.add_guess(p_max, token == target)  # after a rolled-back token the prefixes are not kept
            if withheld is not None and m is None:  # the target's token where the draft held back (first verification)
                s.add_guess(withheld[1], withheld[0] == argmax[-1])
            withheld = None
            if m is None:
                s.accepted += pending
                s.full_accepts += pending > 0
                if not self.done:
                    self.tokens.append(argmax[-1])  # 3. accept: the target's own next token
                break
            # 4. rollback: keep the tokens before draft token m, replace it by the target's choice,
            # crop both KV caches to that prefix, and stay in LARGE for one more target token.
            keep = n - pending + m
            s.rollbacks += 1
            s.accepted += m
            s.discarded += n - keep
            correction = argmax[off + m]
            del self.tokens[keep:]
            self.runner.crop(keep)
            self.tokens.append(correction)
            pending = 0
            if self.done:
                break
        s.new_tokens = len(self.tokens) - start_len
        return self._finish(s, t0, before)

    def step_off(self) -> DecodeStats:
        """One step with speculation off: the target alone emits the next token (no draft forward).

        One target forward over what its cache lacks (one token after any BiLD step) commits its argmax:
        lossless, regret 0. The draft's cache falls behind and catches up on every committed token it lacks,
        in one parallel forward, at the next ``step``.
        """
        if self.done:
            raise RuntimeError("the generation is finished (EOS or max_new_tokens); start a new session")
        t0 = time.perf_counter()
        before = self.runner.stats.copy()
        s = DecodeStats(steps=1, new_tokens=1)
        argmax, _, _ = self.runner.target_verify(self.tokens)
        self.tokens.append(argmax[-1])
        return self._finish(s, t0, before)
