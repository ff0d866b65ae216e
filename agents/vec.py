"""Step several replay envs together and batch their model forwards: ``BatchedReplayVecEnv``.

A replay env runs a model only on a miss (a prefix its tree lacks), one forward of batch size 1.
On a CPU most of a forward's cost is reading the weights, so the misses of N envs cost far less
as one forward of N rows (``bild_env.decoding.kv``). ``BatchedReplayVecEnv`` is SB3's
``DummyVecEnv`` with two changes:

* its envs' replay runners share one ``TreeStore`` (what one env fills, all read), and
* ``step``/``reset`` run the envs as cooperative jobs (``CoopBatcher``): each env's step runs, in
  env order, until it finishes or needs a forward; when every unfinished env waits on one, the
  waiting forwards run as one batched forward per model and the envs resume, again in order.

Only one job runs at a time and always in the same order, so a run is reproducible, and every
env produces the same tokens, observations, rewards and infos as on its own (up to float rounding
in the batched forward, the tolerance replay already has against live decoding; see
``bild_env.decoding.kv``). Threads only hold each job's call stack while it waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from copy import deepcopy
from typing import Any

import numpy as np
from stable_baselines3.common.vec_env import DummyVecEnv

from bild_env.decoding.kv import Row, batched_forward, plan_batches


class _Job:
    """One cooperative job on its own (daemon) thread: runs only while the scheduler lets it."""

    def __init__(self, fn: Callable[[], Any], name: str, local: threading.local) -> None:
        self.fn, self.local = fn, local
        self.go, self.paused = threading.Event(), threading.Event()
        self.request: tuple[str, Row] | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished = False
        self.abort = False
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    def _main(self) -> None:
        self.local.job = self  # how CoopBatcher.forward, called on this thread, finds its job
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

    ``counts`` (a ``ReplayReport``) receives one fill per batched forward, its rows and its time.
    """

    def __init__(self, pair, counts, cost_model=None) -> None:
        self.pair, self.counts, self.cost_model = pair, counts, cost_model
        self.local = threading.local()
        self.batch_sizes: dict[int, int] = {}  # rows per batched forward -> how many forwards had that many

    def forward(self, role: str, row: Row):
        """Called by a job: wait until the forward of ``row`` (with others) has run; return its logits."""
        job: _Job | None = getattr(self.local, "job", None)
        if job is None:  # not inside run() (e.g. an env reset directly): a forward of its own
            return self._forward(role, [row])[0]
        job.request = (role, row)
        job.paused.set()
        job.go.wait()
        job.go.clear()
        if job.abort:
            raise _Aborted()
        result, job.result = job.result, None
        return result

    def run(self, fns: list[Callable[[], Any]]) -> list[Any]:
        """Run every ``fns[i]()`` as a cooperative job; return their results in order (re-raising the first error)."""
        jobs = [_Job(fn, f"bild-env-{i}", self.local) for i, fn in enumerate(fns)]
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
            jobs = [job for job, (r, _) in requests if r == role]
            if not jobs:
                continue
            # rows of very different lengths are cheaper apart than padded together (plan_batches)
            fixed, per_token, _ = getattr(self.cost_model, role) if self.cost_model else (1.0, 0.0, 0.0)
            for batch in plan_batches([len(job.request[1].ids) for job in jobs], fixed, per_token):
                group = [jobs[i] for i in sorted(batch)]
                for job, z in zip(group, self._forward(role, [job.request[1] for job in group])):
                    job.result, job.request = z, None

    def _forward(self, role: str, rows: list[Row]) -> list:
        """One (batched) forward of ``role`` over ``rows``, counted as one fill of ``len(rows)`` rows."""
        t0 = time.perf_counter()
        logits = batched_forward(getattr(self.pair, role), rows)
        self.counts.fills += 1
        self.counts.fill_rows += len(rows)
        self.counts.fill_ms += (time.perf_counter() - t0) * 1000.0
        self.batch_sizes[len(rows)] = self.batch_sizes.get(len(rows), 0) + 1
        return logits

    def _abort(self, jobs: list[_Job]) -> None:
        """Wake every unfinished job with ``abort`` set so its thread unwinds, then wait briefly for it."""
        for job in jobs:
            if not job.finished:
                job.abort = True
                job.go.set()
                job.thread.join(timeout=5.0)


class BatchedReplayVecEnv(DummyVecEnv):
    """``DummyVecEnv`` for BiLD-v0 envs on the replay backend: shared trees, batched fills (module docstring).

    Use it like ``DummyVecEnv``, e.g. ``make_vec_env("bild_env:BiLD-v0", n_envs=8,
    vec_env_cls=BatchedReplayVecEnv, env_kwargs={"backend": "replay", ...})``.
    """

    def __init__(self, env_fns: list[Callable[[], Any]]) -> None:
        super().__init__(env_fns)
        from bild_env.replay import ReplayRunner

        runners = [env.unwrapped.runner for env in self.envs]
        if not all(isinstance(r, ReplayRunner) for r in runners):
            raise ValueError("BatchedReplayVecEnv needs BiLD-v0 envs with backend='replay'; use DummyVecEnv for live envs")
        if len({r.pair.key for r in runners}) != 1:
            raise ValueError("BatchedReplayVecEnv: all envs must use the same model pair")
        self.batcher = CoopBatcher(runners[0].pair, runners[0].store.counts, runners[0].cost_model)
        for runner in runners:
            runner.share_store(runners[0].store)
            runner.batcher = self.batcher

    def step_wait(self):
        def step(i: int):
            def run():
                obs, reward, terminated, truncated, info = self.envs[i].step(self.actions[i])
                reset_info = None
                terminal = obs
                if terminated or truncated:
                    obs, reset_info = self.envs[i].reset()
                return obs, reward, terminated, truncated, info, terminal, reset_info
            return run

        results = self.batcher.run([step(i) for i in range(self.num_envs)])
        for i, (obs, reward, terminated, truncated, info, terminal, reset_info) in enumerate(results):
            self.buf_rews[i] = reward
            self.buf_dones[i] = terminated or truncated
            self.buf_infos[i] = info
            info["TimeLimit.truncated"] = truncated and not terminated  # as DummyVecEnv (gym 0.26 API change)
            if self.buf_dones[i]:
                info["terminal_observation"] = terminal
                self.reset_infos[i] = reset_info
            self._save_obs(i, obs)
        return self._obs_from_buf(), np.copy(self.buf_rews), np.copy(self.buf_dones), deepcopy(self.buf_infos)

    def reset(self):
        def reset(i: int):
            options = {"options": self._options[i]} if self._options[i] else {}
            return lambda: self.envs[i].reset(seed=self._seeds[i], **options)

        for i, (obs, info) in enumerate(self.batcher.run([reset(i) for i in range(self.num_envs)])):
            self.reset_infos[i] = info
            self._save_obs(i, obs)
        self._reset_seeds()
        self._reset_options()
        return self._obs_from_buf()
