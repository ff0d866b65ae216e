"""Run several replay runners' steps as cooperative jobs and batch the fills they ask for: ``CoopBatcher``.

A replay runner runs a model only on a miss (a prefix its tree lacks), one forward of batch size
1. On a CPU most of a forward's cost is reading the weights, so the misses of N envs cost far less
as one forward of N rows (``bild_env.decoding.kv.batched_forward``). ``CoopBatcher.run`` runs
callables (e.g. each env's ``step``) as cooperative jobs: each runs, in order, until it finishes or
asks for a forward; when every unfinished job waits on one, the waiting forwards run as one
batched forward per model (``plan_batches`` keeps long rows apart from padded short ones) and the
jobs resume, again in order. Only one job runs at a time and always in the same order, so a run is
reproducible. Threads only hold each job's call stack while it waits.

A runner finds the batcher it runs under with ``active_batcher()`` (None outside ``run``): nothing
has to be wired into it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bild_env.decoding.kv import Row, batched_forward

_ACTIVE = threading.local()  # on a job's thread: .job and .batcher


def active_batcher() -> CoopBatcher | None:
    """The batcher whose job runs on this thread, or None (not inside ``CoopBatcher.run``)."""
    return getattr(_ACTIVE, "batcher", None)


@dataclass
class Request:
    """A fill forward a job waits on: ``row`` through ``model`` (named ``role``), costed by ``costs``
    (fixed ms, ms per token: for ``plan_batches``), counted in ``counts`` (the store's ledger, a ``ReplayReport``)."""

    role: str
    model: torch.nn.Module
    row: Row
    costs: tuple[float, float]
    counts: Any


def plan_batches(lengths: list[int], fixed_ms: float, token_ms: float) -> list[list[int]]:
    """Split rows (their new-token counts) into batches that cost least under ``fixed + token * rows * longest``.

    A batched forward computes every row at the longest row's length (pads included), so a long
    row (e.g. a prompt) is better alone than padding many one-token rows. Rows are taken shortest
    first; one joins the current batch when that is cheaper than starting a new one. Returns
    lists of row indices.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches:
            group, n = batches[-1], lengths[i]  # n >= every length in group
            joined = fixed_ms + token_ms * (len(group) + 1) * n
            apart = fixed_ms + token_ms * len(group) * lengths[group[-1]] + fixed_ms + token_ms * n
            if joined <= apart:
                group.append(i)
                continue
        batches.append([i])
    return batches


class _Job:
    """One cooperative job on its own (daemon) thread: runs only while the scheduler lets it."""

    def __init__(self, fn: Callable[[], Any], name: str, batcher: CoopBatcher) -> None:
        self.fn, self.batcher = fn, batcher
        self.go, self.paused = threading.Event(), threading.Event()
        self.request: Request | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished = False
        self.abort = False
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    def _main(self) -> None:
        _ACTIVE.job, _ACTIVE.batcher = self, self.batcher  # how a runner on this thread finds them
        self.go.wait()
        self.go.clear()
        try:
            if not self.abort:
                self.result = self.fn()
        except BaseException as err:  # noqa: BLE001 - handed to the scheduler, which re-raises it
            self.error = err
        finally:
            self.finished = True
            self.paused.set()

    def resume(self) -> None:
        """Let the job run until it asks for a forward or finishes."""
        self.go.set()
        self.paused.wait()
        self.paused.clear()


class _Aborted(BaseException):
    """Unwinds a waiting job when the scheduler stops (e.g. Ctrl-C in the main thread)."""


class CoopBatcher:
    """Runs jobs cooperatively and batches the forwards they ask for (see the module docstring).

    Each batched forward is counted as one fill of its rows in the requesting store's ``counts``.
    """

    def __init__(self) -> None:
        self.batch_sizes: dict[int, int] = {}  # rows per batched forward -> how many forwards had that many

    def forward(self, request: Request):
        """Called by a job: wait until the forward of ``request.row`` (with others) has run; return its logits."""
        job: _Job | None = getattr(_ACTIVE, "job", None)
        if job is None or job.batcher is not self:  # not inside run(): a forward of its own
            return self._forward([request])[0]
        job.request = request
        job.paused.set()
        job.go.wait()
        job.go.clear()
        if job.abort:
            raise _Aborted()
        result, job.result = job.result, None
        return result

    def run(self, fns: list[Callable[[], Any]]) -> list[Any]:
        """Run every ``fns[i]()`` as a cooperative job; return their results in order (re-raising the first error)."""
        jobs = [_Job(fn, f"bild-env-{i}", self) for i, fn in enumerate(fns)]
        for job in jobs:
            job.thread.start()
        try:
            active = jobs
            while active:
                for job in active:
                    job.resume()
                active = [job for job in active if not job.finished]
                if active:
                    self._run_batch(active)
        except BaseException:
            self._abort(jobs)
            raise
        for job in jobs:
            if job.error is not None:
                raise job.error
        return [job.result for job in jobs]

    def _run_batch(self, waiting: list[_Job]) -> None:
        """One batched forward per model over the waiting jobs' rows (in job order)."""
        requests = [(job, job.request) for job in waiting]
        for role in ("draft", "target"):
            mine = [(job, request) for job, request in requests if request.role == role]
            if not mine:
                continue
            # rows of very different lengths are cheaper apart than padded together (plan_batches)
            fixed, per_token = mine[0][1].costs
            for batch in plan_batches([len(request.row.ids) for _, request in mine], fixed, per_token):
                group = [mine[i] for i in sorted(batch)]
                for (job, _), z in zip(group, self._forward([request for _, request in group])):
                    job.result, job.request = z, None

    def _forward(self, requests: list[Request]) -> list:
        """One (batched) forward over the requests' rows, counted as one fill of ``len(requests)`` rows."""
        t0 = time.perf_counter()
        logits = batched_forward(requests[0].model, [r.row for r in requests])
        requests[0].counts.count_fill(len(requests), t0)
        self.batch_sizes[len(requests)] = self.batch_sizes.get(len(requests), 0) + 1
        return logits

    def _abort(self, jobs: list[_Job]) -> None:
        """Wake every unfinished job with ``abort`` set so its thread unwinds, then wait briefly for it."""
        for job in jobs:
            if not job.finished:
                job.abort = True
                job.go.set()
                job.thread.join(timeout=5.0)
