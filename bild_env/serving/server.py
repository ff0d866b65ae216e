"""The requests of a ``BiLD-Serve-v0`` episode (``Server``): their arrivals, the queue, the running batch with its pool
of replay runners, and the simulated clock, with a snapshot of their own.

Arrivals and their prompts come from streams of their own, so that policies compared on one seed meet the same
requests in the same order (common random numbers): request k arrives when the integrated arrival rate (requests, the
rate times the clock's time) reaches the k-th point of a unit-rate Poisson process.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from bild_env.decoding.bild import BildSession
from bild_env.replay.batching import CoopBatcher, active_batcher
from bild_env.replay.runner import ReplayRunner
from bild_env.serving.config import ServingConfig
from bild_env.serving.episode import Failure, Request


class Server:
    """The queue and the batch of one env (continuous batching, at most ``max_batch`` together), reused over episodes.

    ``start`` begins an episode; a step is ``wait_for_work`` and ``admit_waiting`` before the action (``prepare``),
    then ``run`` (the requests' steps), ``advance`` (the clock and the arrivals during the step) and ``leave`` (the
    finished and the failed). ``snapshot`` / ``restore`` save and put back all of it, the requests' sessions and
    runners included.
    """

    def __init__(self, config: ServingConfig, pair, references, predictor, workload) -> None:
        self.config, self.pair, self.references, self.predictor, self.workload = (config, pair, references, predictor,
                                                                                  workload)
        self.cost_model = None  # the cost model charged (``use_costs``)
        self.runners: list[ReplayRunner] = []  # a pool: one per request in the batch, reused
        # called with every request the batch admits, as it joins (reset's warm ones too; ``scripts.analysis.serving_clock``
        # records schedules with it)
        self.on_admit: Callable[[Request], None] | None = None
        self.clock_ms = 0.0
        self.active: list[Request] = []
        self.queue: deque[Request] = deque()
        self._missed = True  # the last step missed the replay trees (the next batches its fills)

    def use_costs(self, cost_model) -> None:
        """Price the runners' forwards with ``cost_model`` from now on (its runners and those made later)."""
        self.cost_model = cost_model
        for runner in self.runners:
            runner.cost_model = cost_model

    def start(self, seeds, mix) -> None:
        """A new episode: the clock at 0, the arrival and prompt streams seeded by ``seeds`` (two integers), the
        prompts drawn by the domain weights ``mix`` (None: the workload's), an empty queue and batch."""
        self.clock_ms, self._mix = 0.0, mix
        self._gaps, self._prompt_rng = np.random.default_rng(seeds[0]), np.random.default_rng(seeds[1])
        self._integrated, self._next_arrival = 0.0, float(self._gaps.exponential())
        self.active, self.queue = [], deque()
        self._free = list(self.runners)

    def start_warm(self, expected: float) -> None:
        """Fill the batch with requests already under way (Poisson of mean ``expected``, at most ``max_batch``), each
        some tokens into its answer (drawn uniformly, decoded by the target alone and not charged)."""
        for _ in range(min(self.config.max_batch, int(self._prompt_rng.poisson(expected)))):
            self._admit(self._arrive(), warm=True)

    # -- before the action ----------------------------------------------------------------
    def wait_for_work(self, rate: float) -> float:
        """With nothing to decode, the clock jumps to the next arrival (``rate``: requests per second); returns the
        idle ms (not charged)."""
        if self.active or self.queue:
            return 0.0
        idle = (self._next_arrival - self._integrated) / rate * 1000.0
        self.clock_ms += idle
        self._integrated = self._next_arrival  # exactly (no rounding short of it)
        self._arrivals(0.0)
        return idle

    def admit_waiting(self) -> None:
        """The step's admissions: the queue's first requests join while the batch has room (their prefills recorded
        in their runners' traces, which hold this step's forwards only)."""
        for request in self.active:
            request.runner.trace.clear()
        room = self.config.max_batch - len(self.active)
        for request in [self.queue.popleft() for _ in range(min(room, len(self.queue)))]:
            self._admit(request)

    # -- the requests' steps --------------------------------------------------------------------
    def run(self, batch: list[Request], each: list) -> list:
        """Each request of ``batch`` takes one step under its action of ``each`` (``bild_env.actions.Action.run``);
        returns each one's stats, or a ``Failure`` where the models failed (that request ends; the batch goes on). After
        a step that missed the replay trees, they run as cooperative jobs whose misses run as batched forwards (``CoopBatcher``; ~1 ms of
        thread hand-offs per step, so warm steps, which miss nothing, run plainly)."""
        if not batch:
            return []
        fns = [_step_fn(r.session, action) for r, action in zip(batch, each)]
        counts = self.runners[0].store.counts
        misses = counts.misses
        if self._missed and active_batcher() is None and len(fns) > 1:
            results = CoopBatcher().run(fns)
        else:
            results = [fn() for fn in fns]
        self._missed = counts.misses > misses
        return results

    # -- after the requests' steps ----------------------------------------------------------
    def advance(self, step_ms: float, rate: float) -> int:
        """The clock moves by the step; the requests arriving during it (at ``rate`` per second) queue. Returns how
        many arrived."""
        self.clock_ms += step_ms
        return self._arrivals(rate * step_ms / 1000.0)

    def leave(self, batch: list[Request], results: list) -> tuple[list[dict], list[Request]]:
        """Finished and failed requests (a ``Failure``) leave the batch, their runners back to
        the pool. Returns the finished (as ``info["finished"]`` lists them) and the failed."""
        finished, failed = [], []
        for request, result in zip(batch, results):
            if isinstance(result, Failure):
                failed.append(request)
            elif not request.session.done:
                continue
            else:
                new = len(request.session.new_ids)
                finished.append({"domain": request.domain, "prompt_index": request.prompt_index, "new_tokens": new,
                                 "new_ids": list(request.session.new_ids),
                                 "latency_ms": self.clock_ms - request.arrived_ms,
                                 "queued_ms": request.started_ms - request.arrived_ms,
                                 "regret_per_token": request.regret / max(new, 1)})
            self.active.remove(request)
            self._free.append(request.runner)
        return finished, failed

    def progress(self) -> float:
        """The batch's mean progress: tokens generated / max_new_tokens (0 for an empty batch)."""
        if not self.active:
            return 0.0
        n = self.config.max_new_tokens
        return sum(len(r.session.new_ids) for r in self.active) / (n * len(self.active))

    # -- rewind ---------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Everything a step changes here (the clock, the streams, the queue and batch, the requests' sessions and
        their runners), by name, for ``restore`` (on ``peek``'s path: one dict, no loop)."""
        return {"clock_ms": self.clock_ms, "integrated": self._integrated, "next_arrival": self._next_arrival,
                "missed": self._missed, "gaps": self._gaps.bit_generator.state,
                "prompts": self._prompt_rng.bit_generator.state, "active": list(self.active),
                "queue": list(self.queue), "free": list(self._free),
                "requests": [(r, r.regret, r.session.snapshot(), r.runner.snapshot()) for r in self.active]}

    def restore(self, saved: dict) -> None:
        """Put the requests back as ``snapshot`` saw them."""
        self.clock_ms, self._integrated = saved["clock_ms"], saved["integrated"]
        self._next_arrival, self._missed = saved["next_arrival"], saved["missed"]
        self._gaps.bit_generator.state, self._prompt_rng.bit_generator.state = saved["gaps"], saved["prompts"]
        self.active, self.queue, self._free = list(saved["active"]), deque(saved["queue"]), list(saved["free"])
        for r, regret, session, runner in saved["requests"]:
            r.regret = regret
            r.session.restore(session)
            r.runner.restore(runner)

    # ----------------------------------------------------------------------------------------
    def _arrive(self) -> Request:
        domain, index, prompt = self.workload.draw(self._prompt_rng, self._mix)  # None: the mix's weights
        return Request(domain, index, list(prompt), self.clock_ms)

    def _arrivals(self, expected: float) -> int:
        """Requests arriving while ``expected`` more arrivals were due (rate x time); queued. Returns how many."""
        self._integrated += expected
        n = 0
        while self._integrated >= self._next_arrival:
            self.queue.append(self._arrive())
            self._next_arrival += float(self._gaps.exponential())
            n += 1
        return n

    def _admit(self, request: Request, warm: bool = False) -> None:
        """Start ``request`` in the batch: the target prefills its prompt (recorded in its runner's trace)."""
        cfg = self.config
        if self._free:
            runner = self._free.pop()
        else:
            runner = ReplayRunner(self.pair, self.cost_model, self.references, cfg.max_new_tokens,
                                  store=cfg.replay_store)
            runner.trace, runner.price_forwards = [], False  # the env prices the batch's forwards (clock.charge)
            self.runners.append(runner)
        request.runner, request.started_ms = runner, self.clock_ms
        # the session's runner.start() empties the trace; then the target's prefill is recorded in it
        request.session = BildSession(runner, request.prompt, cfg.max_new_tokens, self.pair.eos_token_ids,
                                      cfg.actions.max_draft_len, None, cfg.actions.score, self.predictor)
        if warm:  # a request already under way when the episode starts: some tokens in, by the target alone
            for _ in range(int(self._prompt_rng.integers(cfg.max_new_tokens - 1))):
                if request.session.done:
                    break
                request.session.step_off()
            runner.trace.clear()
        self.active.append(request)
        if self.on_admit is not None:
            self.on_admit(request)


def _step_fn(session: BildSession, action) -> Callable:
    """``session``'s step under ``action``, to run: its stats, or a ``Failure`` when the models fail."""
    def run():
        try:
            return action.run(session)
        except (RuntimeError, torch.OutOfMemoryError) as err:  # this request ends; the batch goes on
            return Failure(f"{type(err).__name__}: {err}")
    return run
