"""Batched greedy decoding with continuous batching: BiLD, naive speculative decoding, target only.

``BatchedDecoder`` runs many requests (prompts of different lengths) with the draft and the target
together. Each request drafts, falls back, is verified and rolls back on its own, with its own KV
length, and its output and counters equal its batch-of-one run (``BildSession``,
``generate_speculative``, ``generate_target_only``) under the same thresholds, up to float rounding
near-ties. One step of the batch:

1. **SMALL phase**: one batched draft forward per draft position. Each request still drafting is fed
   the committed tokens its draft cache lacks; it stops at a fallback (max probability below its
   threshold), at ``max_draft_len``, at EOS or at its length limit. A request's first draft forward
   (an empty draft cache: its prompt) runs apart, with the other requests joining at that position.
2. **LARGE phase**: one batched target forward over every request's draft run (the target's last
   token plus the drafts, padded to the longest run), read once: the target's argmax, and each
   draft token's distance ``-log p_L`` (nats) and regret.
3. **accept**: a request whose drafts all pass keeps them and the target's token after them.
4. **rollback**: a request with a draft token above its rollback threshold that differs from the
   target's argmax is cut there in both caches, the target's token replaces it, and (BiLD) one more
   batched target forward, of the requests that rolled back, emits the token after it.

``step(fallback, rollback, off)`` takes, like ``BildSession.step``, the thresholds of this step, per
request (a number for all, or one per request in ``ids`` order); ``off`` (per request) decodes a
request with the target alone for this step (``BildSession.step_off``: no draft forward).
``step_speculative(k)`` is a naive speculative decoding round and ``step(off=True)`` target-only
decoding: the batched baselines. Requests join with ``add``/``join`` (the target prefills them in a
forward of their own) and leave when done (``finished``) or with ``remove``; each step returns every
request's ``DecodeStats`` of that step (``totals`` add them up, prefill included).

The rules are BiLD's (``bild.should_fall_back``, ``bild.first_rollback``), applied to all requests at
once by tensor operations (``first_rollback_rows`` is ``first_rollback`` row-wise; a test holds them
equal): the step has no per-request Python loop; the only ones build the per-request stats objects
and retire finished requests.

**Padding, not per-request cache views.** Each model keeps one padded cache for the batch
(``padded.PaddedCache``: attention mask over valid slots, explicit position ids, rollback by masking,
compaction when holes pile up). The alternative keeps one ``DynamicCache`` per request and builds the
padded batch for every forward (``kv.batched_forward``), which copies every request's whole cache
into the batch and each row's new keys back, in a loop over requests and layers. Measured on
tiny-random (float32, 1 thread, a busy 2-core AMD EPYC; 8 requests with 40 to 120 cached tokens,
median of 200 forwards; ``scripts/analysis/batched.py --layout``), ms per batched forward:

    ============  ==========================  =====================  =========================
    model, fed    per-request caches (kv)     padded (model call)    8 batch-of-one forwards
    ============  ==========================  =====================  =========================
    draft, 1      2.87                        2.09 (2.00)            5.79
    draft, 4      4.72                        3.68 (3.53)            6.41
    target, 1     3.56                        2.45 (2.35)            8.24
    target, 4     6.05                        4.55 (4.39)            9.22
    ============  ==========================  =====================  =========================

The padded cache spends ~0.1 ms per forward outside the model call, the per-request layout 0.9 to
1.5 ms (30-45% of the forward). Padding costs pad tokens where requests are fed different counts (an
idle request in a draft forward costs one pad token) and columns where prompt lengths differ; a
forward's cost is mostly reading the weights, so a few pad tokens cost less than copying every cache
at every forward.

Failures: bad input is refused before anything runs, naming the request (a prompt that does not fit
the context, empty, bad ids; thresholds out of range; an empty batch). A forward that fails (out of
memory) leaves every request as it was before the step (``BatchError`` names the requests and the one
holding the most cache); the caller removes one and steps again, the others' outputs intact.

Over 450 lines for a reason: ``BatchedDecoder``'s phases (draft, verify, roll back, join, leave) all read and write one
set of batch tensors and two padded caches, and undo them together when a forward fails; the row-wise rules and
readouts they apply are in ``bild_env.decoding.rows``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bild_env.decoding.bild import (FIXED_FALLBACK, FIXED_ROLLBACK, LOOKUP_SCORES, MAX_DRAFT_LEN, check_score,
                                    check_thresholds, should_fall_back)
from bild_env.decoding.decoders import _positive_int, prepare_prompt
from bild_env.decoding.padded import PaddedCache
from bild_env.decoding.rows import draft_readout_rows, feed_rows, first_rollback_rows, verify_readout
from bild_env.decoding.stats import LOW_CONFIDENCE, DecodeStats, Generation
from bild_env.models.device import sync
from bild_env.models.draft_head import proposal_logits
from bild_env.models.lookup import lookup_for
from bild_env.models.pairs import ModelPair

# Per-request counters of a step, as columns of one (B, F) float64 tensor, read back once per step.
COUNTERS = ("new_tokens", "proposed", "accepted", "full_accepts", "fallbacks", "max_draft_hits", "rollbacks",
            "discarded", "mismatches", "regret", "steps", "guesses", "guesses_right", "guess_p", "low_guesses",
            "low_guesses_right", "draft_forwards", "target_forwards", "draft_tokens_fed", "target_tokens_fed",
            "forward_ms")
_C = {name: i for i, name in enumerate(COUNTERS)}
_FLOATS = {"regret", "guess_p", "forward_ms"}
COMPACT_SLACK = 0.25  # compact a cache once its columns exceed the longest request's tokens by this share (+16)

Rows = float | bool | Sequence[float] | Sequence[bool] | torch.Tensor


class BatchError(RuntimeError):
    """A batched step or join failed; ``request_ids`` names the requests it ran. Nothing changed."""

    def __init__(self, message: str, request_ids: Sequence) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids)


@dataclass
class BatchStep:
    """What one batched step did as a whole: ``rows`` requests, forwards of each model, times in ms."""

    rows: int = 0
    draft_forwards: int = 0
    target_forwards: int = 0
    wall_ms: float = 0.0
    forward_ms: float = 0.0  # inside model calls (device synchronised)
    readout_ms: float = 0.0  # reading the logits: vocabulary-wide max and log-sum-exp (the rules' inputs)

    @property
    def overhead(self) -> float:
        """Share of the step's wall time outside the model forwards (readouts and bookkeeping)."""
        return max(0.0, 1.0 - self.forward_ms / self.wall_ms) if self.wall_ms > 0 else 0.0

    @property
    def bookkeeping(self) -> float:
        """Share of the step's wall time outside the forwards and the readouts: the loop's own work."""
        return max(0.0, 1.0 - (self.forward_ms + self.readout_ms) / self.wall_ms) if self.wall_ms > 0 else 0.0


@dataclass(frozen=True)
class Forward:
    """One model call as the decoder ran it (``BatchedDecoder.forward_log``): ``rows`` sequences (idle
    ones included: they are fed pads) fed ``fed`` columns each over ``columns`` cached slots (valid or
    not: the attention's key length before the call), ``real`` of the rows fed a token, ``ms`` its time."""

    role: str
    rows: int
    fed: int
    columns: int
    real: int
    prefill: bool
    ms: float


class BatchedDecoder:
    """Greedy BiLD / naive SD / target-only over a changing batch of requests (module docstring).

    ``ids``: the running requests, in row order (the order of per-request threshold sequences);
    ``totals[id]``: a running request's statistics so far; ``finished[id]``: a finished request's
    ``Generation``; ``draft_p`` (B,): each request's draft confidence where its last draft run stopped;
    ``last_step``: the batch's ``BatchStep`` of the last step; ``forward_log``: None, or a list to which
    every model call is appended as a ``Forward`` (set it to ``[]`` to record; nothing is recorded otherwise).
    ``score``: what each request's fallback threshold reads, ``"token"`` (the proposal's max probability, BiLD's
    rule) or ``"cumulative"`` (the product of them along the request's run: ``bild.DraftScore``), or the lookup
    predictor's chance in their place (``"lookup"``, ``"lookup_cumulative"``; ``predictor`` overrides the pair's).
    ``peek_draft()`` reads each request's next proposal's confidence ahead of a step (for a policy that observes it)
    with the forward the step would run first, which the step then takes instead of running it.
    """

    def __init__(self, pair: ModelPair, max_draft_len: int = MAX_DRAFT_LEN, score: str = "token",
                 predictor=None) -> None:
        _positive_int("max_draft_len", max_draft_len)
        if check_score(score) == "oracle":
            raise ValueError("the oracle score needs the replay trees (the envs); the batched decoder takes "
                             "score='token', 'cumulative', 'lookup' or 'lookup_cumulative'")
        self.pair, self.max_draft_len, self.score = pair, max_draft_len, score
        if predictor is None and score in LOOKUP_SCORES:
            predictor = lookup_for(pair)
        self.predictor = predictor if score in LOOKUP_SCORES else None  # the lookup scores' (bild_env.models.lookup)
        self.device = torch.device(pair.device)
        self.caches = {"draft": PaddedCache(pair.draft), "target": PaddedCache(pair.target)}
        self.ids: list = []
        self.tokens = torch.zeros((0, 1), dtype=torch.long, device=self.device)  # (B, T) prompt + output
        self.lens = torch.zeros(0, dtype=torch.long, device=self.device)  # (B,) committed tokens
        self.prompt_lens = torch.zeros_like(self.lens)
        self.max_new = torch.zeros_like(self.lens)
        self.draft_p = torch.ones(0, dtype=torch.float64, device=self.device)
        self.eos = torch.tensor(sorted(pair.eos_token_ids), dtype=torch.long, device=self.device)
        self.totals: dict = {}
        self.finished: dict = {}
        self.last_step = BatchStep()
        self.forward_log: list[Forward] | None = None
        self._next_id = 0
        self._peeked: dict = {}  # request id -> (committed length, draft logits, counts): peek_draft's, for the next step

    def __len__(self) -> int:
        return len(self.ids)

    # ------------------------------------------------------------------ requests join and leave

    def add(self, prompt: str | list[int] | torch.Tensor, max_new_tokens: int = 64, request_id=None):
        """Add one request (the target prefills it); returns its id."""
        return self.join([prompt], max_new_tokens, None if request_id is None else [request_id])[0]

    @torch.inference_mode()
    def join(self, prompts: Sequence, max_new_tokens: int | Sequence[int] = 64, request_ids: Sequence | None = None) -> list:
        """Add requests between steps: one target forward prefills them together, apart from the batch.

        Each prompt is checked first (a ValueError names the request; nothing joins). A request done
        after its first token (``max_new_tokens`` 1, or EOS) goes straight to ``finished``.
        """
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * len(prompts)
        if request_ids is None:
            request_ids = list(range(self._next_id, self._next_id + len(prompts)))
        if not (len(prompts) == len(max_new_tokens) == len(request_ids)):
            raise ValueError(f"{len(prompts)} prompts, {len(max_new_tokens)} max_new_tokens, {len(request_ids)} ids")
        if not prompts:
            return []
        taken = set(self.ids) | set(self.finished)
        prompt_ids = []
        for rid, prompt, limit in zip(request_ids, prompts, max_new_tokens):
            if rid in taken:
                raise ValueError(f"request {rid!r}: the id is already in use (running or finished)")
            taken.add(rid)
            try:
                prompt_ids.append(prepare_prompt(self.pair, prompt, limit))
            except ValueError as err:
                raise ValueError(f"request {rid!r}: {err}") from None
        self._next_id = max([self._next_id] + [r + 1 for r in request_ids if isinstance(r, int)])
        B, R = len(self.ids), len(prompts)
        lengths = torch.tensor([len(p) for p in prompt_ids], device=self.device)
        width = max(self.tokens.shape[1], max(len(p) + m for p, m in zip(prompt_ids, max_new_tokens)) + 1)
        new = torch.zeros((R, width), dtype=torch.long, device=self.device)
        for r, ids in enumerate(prompt_ids):
            new[r, : len(ids)] = torch.tensor(ids)
        t0 = time.perf_counter()
        state = self._snapshot()
        self.tokens = torch.cat([torch.nn.functional.pad(self.tokens, (0, width - self.tokens.shape[1])), new])
        self.lens = torch.cat([self.lens, lengths])
        self.prompt_lens = torch.cat([self.prompt_lens, lengths])
        self.max_new = torch.cat([self.max_new, torch.tensor(max_new_tokens, device=self.device)])
        self.draft_p = torch.cat([self.draft_p, torch.ones(R, dtype=torch.float64, device=self.device)])
        for cache in self.caches.values():
            cache.add_rows(R)
        rows = torch.arange(B, B + R, device=self.device)
        try:  # 0. the target's prefill emits each joining request's first token
            ids, real, positions, N = feed_rows(self.tokens[rows], torch.zeros_like(lengths), lengths)
            z = self.caches["target"].prefill(rows, ids, real, positions, keep=1)
            self._log("target", R, N, 0, R, True)
        except Exception as err:
            self._restore(state, keep=torch.arange(B, device=self.device))
            raise BatchError(f"requests {list(request_ids)} could not join ({type(err).__name__}: {err}); the running "
                             "batch is as it was", request_ids) from err
        self._append(z[:, -1].argmax(-1), torch.ones(R, dtype=torch.bool, device=self.device), rows)
        self.ids += list(request_ids)
        ms, wall = self.caches["target"].last_ms, (time.perf_counter() - t0) * 1000.0
        for rid, ids in zip(request_ids, prompt_ids):
            self.totals[rid] = DecodeStats(new_tokens=1, target_forwards=1, target_tokens_fed=len(ids), wall_ms=wall,
                                           forward_ms=ms)
        self._retire()
        return list(request_ids)

    @torch.inference_mode()
    def remove(self, request_id) -> Generation:
        """Take a running request out of the batch; returns what it has generated so far."""
        row = self.ids.index(request_id)
        out = self._generation(row)
        keep = torch.tensor([r for r in range(len(self.ids)) if r != row], dtype=torch.long, device=self.device)
        self._select(keep)
        return out

    # ------------------------------------------------------------------ steps

    @torch.inference_mode()
    def step(self, fallback: Rows = FIXED_FALLBACK, rollback: Rows = FIXED_ROLLBACK, off: Rows = False) -> dict:
        """One BiLD step of every running request with its thresholds; ``off``: target alone this step.

        Returns ``{request id: DecodeStats of this step}``; finished requests move to ``finished``.
        """
        fb, rb = self._per_row(fallback, torch.float64), self._per_row(rollback, torch.float64)
        off = self._per_row(off, torch.bool)
        bad = ~((fb >= 0) & (fb <= 1)) | rb.isnan() | (rb < 0)
        if bool(bad.any()):
            r = int(bad.nonzero()[0])
            try:
                check_thresholds(float(fb[r]), float(rb[r]))
            except ValueError as err:
                raise ValueError(f"request {self.ids[r]!r}: {err}") from None
        cap = torch.where(off, 0, self.max_draft_len)
        return self._run(cap, fb, rb, second_forward=True)

    @torch.inference_mode()
    def step_speculative(self, k: int = 4) -> dict:
        """One round of naive speculative decoding for every request (``generate_speculative``'s rule):
        up to k drafts (leaving room for the target's token), the longest prefix equal to the target's
        argmax kept, plus the target's own token. Lossless."""
        _positive_int("k", k)
        self._require_rows()
        cap = torch.clamp(torch.minimum(torch.full_like(self.lens, k), self.max_new - self.new_count - 1), min=0)
        zeros = torch.zeros(len(self.ids), dtype=torch.float64, device=self.device)
        return self._run(cap, zeros, zeros, second_forward=False)

    @torch.inference_mode()
    def peek_draft(self) -> list[float]:
        """The draft's max probability on each running request's next proposal (row order; [] with none running):
        what the next step's first draft forward reads, computed ahead so that a policy can observe it (the serving
        env's ``observe_next`` reads the same number from the replay trees). It runs that forward now (one batched
        draft forward for the rows not read ahead yet) and keeps its logits: the next step's first draft forward
        takes them instead of running again, and counts the forward in that step's per-request stats. So reading
        ahead costs a server nothing but the forward's place in time. Tokens are what they would be without it."""
        if not self.ids:
            return []
        self._ms, self._readout_ms, self._forwards = 0.0, 0.0, {"draft": 0, "target": 0}  # a step's tallies (_run resets them)
        lens = self.lens.tolist()
        need = torch.tensor([self._peeked.get(rid, (None,))[0] != n for rid, n in zip(self.ids, lens)],
                            dtype=torch.bool, device=self.device)
        with proposal_logits(self.pair.draft) as columns:
            if bool(need.any()):
                counts = torch.zeros((len(self.ids), len(COUNTERS)), dtype=torch.float64, device=self.device)
                z = self._draft_forward(need, counts, first=True, peeked=False)
                for row in need.nonzero()[:, 0].tolist():
                    self._peeked[self.ids[row]] = (lens[row], z[row].clone(), counts[row].clone())
            z = torch.stack([self._peeked[rid][1] for rid in self.ids])
            p = draft_readout_rows(z, torch.ones_like(need), columns)[1]
        return p.tolist()

    def _take_peeked(self, rows: torch.Tensor, counts: torch.Tensor):
        """The read-ahead logits (``peek_draft``) of the rows in ``rows`` whose committed length is still the one read
        ahead at, as (which rows (B,), logits (B, C)), their forward's counts added to ``counts``; None where there are
        none. Every read-ahead is used or dropped here (a row not drafting now has advanced by the next step)."""
        entries, self._peeked = self._peeked, {}
        lens, wanted = self.lens.tolist(), rows.tolist()
        have = [w and rid in entries and entries[rid][0] == n for rid, n, w in zip(self.ids, lens, wanted)]
        if not any(have):
            return None
        first = next(entries[rid][1] for rid, h in zip(self.ids, have) if h)
        z = first.new_zeros((len(self.ids), first.shape[-1]))
        for row, (rid, h) in enumerate(zip(self.ids, have)):
            if h:
                z[row] = entries[rid][1]
                counts[row] += entries[rid][2]
        return torch.tensor(have, dtype=torch.bool, device=self.device), z

    @property
    def new_count(self) -> torch.Tensor:
        """(B,) tokens each running request has generated."""
        return self.lens - self.prompt_lens

    def _run(self, cap: torch.Tensor, fb: torch.Tensor, rb: torch.Tensor, second_forward: bool) -> dict:
        """One step: ``cap`` (B,) most drafts per request (0: no draft forward), thresholds (B,)."""
        for cache in self.caches.values():
            if cache.rows and cache.columns > (1 + COMPACT_SLACK) * int(cache.length.max()) + 16:
                cache.compact()
        t0 = time.perf_counter()
        self._ms, self._readout_ms, self._forwards = 0.0, 0.0, {"draft": 0, "target": 0}
        state, peeked = self._snapshot(), dict(self._peeked)
        start = self.lens.clone()
        counts = torch.zeros((len(self.ids), len(COUNTERS)), dtype=torch.float64, device=self.device)
        try:
            drafts, probs, pending, withheld = self._small_phase(cap, fb, counts)
            self._large_phase(drafts, probs, pending, withheld, rb, counts, second_forward)
        except Exception as err:
            self._restore(state)
            self._peeked = peeked  # the caches keep what was read ahead: so must the logits
            longest = self.ids[int(self.lens.argmax())]
            raise BatchError(
                f"the batched step of requests {self.ids} failed ({type(err).__name__}: {err}); every request is as "
                f"it was before the step: remove one (request {longest!r} holds the most cache) and step again",
                self.ids) from err
        counts[:, _C["new_tokens"]] = (self.lens - start).double()
        counts[:, _C["steps"]] = 1
        sync(self.device)
        wall = (time.perf_counter() - t0) * 1000.0
        self.last_step = BatchStep(len(self.ids), self._forwards["draft"], self._forwards["target"], wall, self._ms,
                                   self._readout_ms)
        out = {}
        for rid, row in zip(self.ids, counts.tolist()):  # the per-request stats objects
            s = DecodeStats(wall_ms=wall, **{name: v if name in _FLOATS else int(v) for name, v in zip(COUNTERS, row)})
            self.totals[rid] += s
            out[rid] = s
        self._retire()
        return out

    def _small_phase(self, cap: torch.Tensor, fb: torch.Tensor, counts: torch.Tensor):
        """1. The draft proposes, one batched forward per position, until each request stops.

        Returns the drafts (B, D) and their max probabilities (B, D) (row r's first ``pending[r]`` real),
        ``pending`` (B,), and the prediction a fallback withheld (token, probability; token -1 if none).
        """
        B, D = len(self.ids), int(cap.max())
        drafts = torch.zeros((B, D), dtype=torch.long, device=self.device)
        probs = torch.zeros((B, D), dtype=torch.float64, device=self.device)
        pending = torch.zeros(B, dtype=torch.long, device=self.device)
        withheld_token = torch.full((B,), -1, dtype=torch.long, device=self.device)
        withheld_p = torch.zeros(B, dtype=torch.float64, device=self.device)
        drafting = cap > 0
        cumulative = self.score in ("cumulative", "lookup_cumulative")
        run_p = torch.ones(B, dtype=torch.float64, device=self.device) if cumulative else None
        with proposal_logits(self.pair.draft) as columns:  # a restricted head's K columns alone, for the whole phase
            for i in range(D):
                if not bool(drafting.any()):
                    break
                z = self._draft_forward(drafting, counts, first=i == 0)  # (B, V or K)
                t0 = self._clock()
                token, p = draft_readout_rows(z, drafting, columns)
                self._readout_ms += self._clock() - t0
                self.draft_p = torch.where(drafting, p, self.draft_p)
                score = p if self.predictor is None else self._lookup(token, p, drafting)
                if cumulative:
                    run_p = torch.where(drafting, run_p * score, run_p)
                fell = drafting & should_fall_back(run_p if cumulative else score, fb)
                commit = drafting & ~fell
                withheld_token = torch.where(fell, token, withheld_token)
                withheld_p = torch.where(fell, p, withheld_p)
                drafts[:, i], probs[:, i] = token, p
                self._append(token, commit)
                pending += commit
                hit = commit & (pending == cap)
                counts[:, _C["fallbacks"]] += fell
                counts[:, _C["max_draft_hits"]] += hit
                drafting = commit & ~hit & ~self._done()
        counts[:, _C["proposed"]] = pending.double()
        return drafts, probs, pending, (withheld_token, withheld_p)

    def _large_phase(self, drafts, probs, pending, withheld, rb, counts, second_forward: bool) -> None:
        """2. One target forward verifies every draft run; 3. accept; 4. roll back (module docstring)."""
        B = len(self.ids)
        everyone = torch.ones(B, dtype=torch.bool, device=self.device)
        z, ids = self._forward("target", everyone, counts, keep=None)  # (B, N, V), the fed ids (B, N)
        N = z.shape[1]
        D = N - 1  # the longest draft run
        t0 = self._clock()
        argmax, target, logp, top = verify_readout(z, drafts[:, :D], pending)
        self._readout_ms += self._clock() - t0
        last = argmax[:, -1]  # the target's token after each request's run
        m = pending
        if D:
            j = torch.arange(D, device=self.device)
            y, p = drafts[:, :D], probs[:, :D]
            m = first_rollback_rows(-logp, y, target, pending, rb)
            kept = j < m[:, None]
            wrong = kept & (y != target)
            counts[:, _C["mismatches"]] += wrong.sum(1)
            counts[:, _C["regret"]] += torch.where(wrong, (top - logp).clamp(min=0), 0).sum(1)
            judged = (j < pending[:, None]) & (j <= m[:, None])  # proposals up to a rollback
            self._count_guesses(counts, judged, p, y == target)
        rolled = m < pending
        token, p_w = withheld
        judged = (token >= 0) & ~rolled  # the prediction a fallback withheld, judged by the target's next token
        self._count_guesses(counts, judged[:, None], p_w[:, None], (token == last)[:, None])
        counts[:, _C["accepted"]] += m
        counts[:, _C["full_accepts"]] += ~rolled & (pending > 0)
        counts[:, _C["rollbacks"]] += rolled
        counts[:, _C["discarded"]] += pending - m
        # 3. accept: the target's own next token where every draft passed
        self._append(last, ~rolled & ~self._done())
        if not bool(rolled.any()):
            return
        # 4. rollback: keep the tokens before draft m, crop both caches there, the target's choice replaces it
        keep = self.lens - pending + m
        for cache in self.caches.values():
            cache.crop(torch.where(rolled, keep, self.lens))
        self.lens = torch.where(rolled, keep, self.lens)
        correction = target.gather(1, m.clamp(max=D - 1)[:, None])[:, 0]  # used where rolled: m < pending <= D
        self._append(correction, rolled)
        if second_forward:  # BiLD stays in LARGE: one more target token for those requests
            again = rolled & ~self._done()
            if bool(again.any()):
                z2, _ = self._forward("target", again, counts, keep=1)
                self._append(z2[:, -1].argmax(-1), again)

    @staticmethod
    def _count_guesses(counts, judged, p, right) -> None:
        low = judged & (p < LOW_CONFIDENCE)
        counts[:, _C["guesses"]] += judged.sum(1)
        counts[:, _C["guesses_right"]] += (judged & right).sum(1)
        counts[:, _C["guess_p"]] += torch.where(judged, p, 0).sum(1)
        counts[:, _C["low_guesses"]] += low.sum(1)
        counts[:, _C["low_guesses_right"]] += (low & right).sum(1)

    # ------------------------------------------------------------------ forwards

    def _forward(self, role: str, rows: torch.Tensor, counts: torch.Tensor, keep: int | None):
        """One batched forward of ``role``: rows in ``rows`` (B,) are fed what their cache lacks, the
        others idle. Returns float32 logits (B, keep or N, V) and the fed ids (B, N)."""
        cache = self.caches[role]
        ids, real, positions, N = feed_rows(self.tokens, cache.length, torch.where(rows, self.lens, cache.length))
        columns = cache.columns
        z = cache.forward(ids, real, positions, keep or N)
        self._count(role, rows, real.sum(1), cache.last_ms, counts)
        if self.forward_log is not None:
            self._log(role, len(self.ids), N, columns, int(rows.sum()), False)
        return z, ids

    def _draft_forward(self, rows: torch.Tensor, counts: torch.Tensor, first: bool, peeked: bool = True) -> torch.Tensor:
        """The draft's logits (B, V; within ``proposal_logits`` a restricted head's (B, K)) after each row's committed
        tokens; requests with an empty draft cache (their first draft forward: prompt + first token) are fed apart, in
        a forward of their own. A step's first forward takes the rows ``peek_draft`` read ahead from there."""
        taken = self._take_peeked(rows, counts) if first and peeked and self._peeked else None
        if taken is not None:
            rows = rows & ~taken[0]
        z = self._forward_draft_rows(rows, counts, first)
        if taken is not None:
            z = taken[1] if z is None else torch.where(taken[0][:, None], taken[1], z)
        return z

    def _forward_draft_rows(self, rows: torch.Tensor, counts: torch.Tensor, first: bool) -> torch.Tensor | None:
        cache = self.caches["draft"]
        fresh = rows & (cache.length == 0) if first else torch.zeros_like(rows)
        rest = rows & ~fresh
        z = None
        if first and bool(fresh.any()):
            index = fresh.nonzero()[:, 0]
            lengths = self.lens[index]
            ids, real, positions, N = feed_rows(self.tokens[index], torch.zeros_like(lengths), lengths)
            zf = cache.prefill(index, ids, real, positions, keep=1)[:, -1]
            self._count("draft", fresh, torch.where(fresh, self.lens, 0), cache.last_ms, counts)
            if self.forward_log is not None:
                self._log("draft", len(index), N, 0, len(index), True)
            z = zf.new_zeros((len(self.ids), zf.shape[-1]))
            z[index] = zf
        if bool(rest.any()):
            zr = self._forward("draft", rest, counts, keep=1)[0][:, -1]
            z = zr if z is None else torch.where(rest[:, None], zr, z)
        return z

    def _count(self, role: str, rows: torch.Tensor, fed: torch.Tensor, ms: float, counts: torch.Tensor) -> None:
        counts[:, _C[f"{role}_forwards"]] += rows
        counts[:, _C[f"{role}_tokens_fed"]] += torch.where(rows, fed, 0)
        counts[:, _C["forward_ms"]] += rows.double() * ms  # each request waited for the whole forward (in float64)
        self._ms += ms
        self._forwards[role] += 1

    def _log(self, role: str, rows: int, fed: int, columns: int, real: int, prefill: bool) -> None:
        if self.forward_log is not None:
            self.forward_log.append(Forward(role, rows, fed, columns, real, prefill, self.caches[role].last_ms))

    # ------------------------------------------------------------------ bookkeeping

    def _lookup(self, token: torch.Tensor, p: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The lookup predictor's chance (B,) float64 for each row's proposal ``token`` of max probability ``p``, after
        the row's tokens so far (rows outside ``rows``: ``p``)."""
        out, text = p.clone(), self.tokens.cpu().numpy()
        lens, proposals, confidence = self.lens.tolist(), token.tolist(), p.tolist()
        for r in torch.nonzero(rows)[:, 0].tolist():
            out[r] = self.predictor.probability(confidence[r], text[r, : lens[r]], proposals[r])
        return out

    def _append(self, token: torch.Tensor, where: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Commit ``token[r]`` to each row r with ``where[r]`` (rows: a subset of row indices)."""
        if rows is None:
            at = self.lens[:, None]
            self.tokens.scatter_(1, at, torch.where(where, token, self.tokens.gather(1, at)[:, 0])[:, None])
            self.lens = self.lens + where
        else:
            self.tokens[rows, self.lens[rows]] = token
            self.lens[rows] += 1

    def _done(self) -> torch.Tensor:
        """(B,) True where a request has reached its ``max_new_tokens`` or ended with EOS."""
        last = self.tokens.gather(1, (self.lens - 1)[:, None])[:, 0]
        return (self.lens - self.prompt_lens >= self.max_new) | torch.isin(last, self.eos)

    def _per_row(self, value: Rows, dtype: torch.dtype) -> torch.Tensor:
        """A per-request value as a (B,) tensor: one for all, or one per request in ``ids`` order."""
        self._require_rows()
        t = torch.as_tensor(value, dtype=dtype, device=self.device)
        if t.dim() == 0:
            return t.expand(len(self.ids))
        if t.shape != (len(self.ids),):
            raise ValueError(f"give one value for all requests or one per running request ({len(self.ids)}, in the "
                             f"order of .ids), got shape {tuple(t.shape)}")
        return t

    def _clock(self) -> float:
        """ms on a clock read after the device's queued work."""
        sync(self.device)
        return time.perf_counter() * 1000.0

    def _require_rows(self) -> None:
        if not self.ids:
            raise ValueError("the batch is empty: add requests (add, join) before stepping")

    def _generation(self, row: int) -> Generation:
        rid = self.ids[row]
        tokens = self.tokens[row, : int(self.lens[row])].tolist()
        prompt_len = int(self.prompt_lens[row])
        new = tokens[prompt_len:]
        text = self.pair.decode(new) if self.pair.tokenizer is not None else ""
        return Generation(tokens[:prompt_len], new, text, self.totals.pop(rid))

    def _retire(self) -> None:
        """Finished requests leave the batch for ``finished``."""
        done = self._done()
        if not bool(done.any()):
            return
        for row in done.nonzero()[:, 0].tolist():
            self.finished[self.ids[row]] = self._generation(row)
        self._select((~done).nonzero()[:, 0])

    def _select(self, keep: torch.Tensor) -> None:
        """Keep the requests in rows ``keep`` (the others leave)."""
        keep_list = keep.tolist()
        self.ids = [self.ids[r] for r in keep_list]
        for cache in self.caches.values():
            cache.select(keep)
        self.tokens, self.lens, self.draft_p = self.tokens[keep], self.lens[keep], self.draft_p[keep]
        self.prompt_lens, self.max_new = self.prompt_lens[keep], self.max_new[keep]

    def _snapshot(self) -> tuple:
        return (self.lens.clone(), self.draft_p.clone(), {r: c.snapshot() for r, c in self.caches.items()})

    def _restore(self, state: tuple, keep: torch.Tensor | None = None) -> None:
        """Undo a failed step (or join: ``keep`` the rows that were there before it)."""
        lens, draft_p, snaps = state
        if keep is not None:
            self._select(keep)  # the joining rows leave again; the caches' snapshots are of the old rows
            self.ids = self.ids[: len(keep)]
        for role, cache in self.caches.items():
            cache.restore(snaps[role])
        self.lens, self.draft_p = lens, draft_p


# ---------------------------------------------------------------------- whole batches, start to end


def _decode_all(pair: ModelPair, prompts: Sequence, max_new_tokens, step, max_draft_len: int = MAX_DRAFT_LEN) -> list[Generation]:
    if not prompts:
        raise ValueError("no prompts: give at least one")
    decoder = BatchedDecoder(pair, max_draft_len)
    ids = decoder.join(list(prompts), max_new_tokens)
    while len(decoder):
        step(decoder)
    return [decoder.finished[i] for i in ids]


def generate_batched_target_only(pair: ModelPair, prompts: Sequence,
                                 max_new_tokens: int | Sequence[int] = 64) -> list[Generation]:
    """Greedy decoding with the target alone over all ``prompts`` as one batch."""
    return _decode_all(pair, prompts, max_new_tokens, lambda d: d.step(off=True))

