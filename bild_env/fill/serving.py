"""Filling a serving env's replay trees ahead of training: each prompt of its workload decoded alone by every action
of its grid (each threshold pair, and the target alone), in a process of its own beside the caller's work.

    filler = WorkloadFill(env_kwargs)            # a child process (spawned) starts filling the training prompts
    ...                                           # the caller's own work, on the other core
    filler.wait(progress)                         # its decodes counted on ``progress`` as they end; then joined

A child whose caller was killed stops after the prompt it is on (it checks its parent after each).

A serving env answers each request's step from the prompt's prefix tree (``bild_env.replay``), and runs the models
only where the tree lacks a prefix; a request's step is the same BiLD step with the same thresholds whether it runs
alone or in a batch (the batch only prices it), so a prompt decoded alone by every action leaves in its tree the
paths the fixed policies take, which a learning agent starts from. The trees go to the pair's store on disk
(``store.flush`` after every prompt; merged on write under a lock, so the caller's process may fill the same store
at the same time); the caller's envs read a prompt's tree when they first meet it, after the fill.

Costs do not enter a tree, so the fill prices with ``UNIT_COSTS``. The child runs one torch thread: with the
caller's one, the two cores of a 2-core machine.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable

import torch

from bild_env.actions import Action
from bild_env.decoding.bild import LOOKUP_SCORES, BildSession
from bild_env.fill import UNIT_COSTS
from bild_env.models.lookup import lookup_for
from bild_env.reference import ReferenceStore
from bild_env.replay.runner import ReplayRunner
from bild_env.replay.store import TreeStore
from bild_env.serving.env import ServingConfig
from bild_env.serving.workload import Workload

PATH_KV_BYTES = 64 << 20  # the fill's store keeps at most this much of its prompts' path KV caches (the env's: 512 MiB)


def decodes(cfg: ServingConfig, prompts: int) -> int:
    """The one-request decodes a fill of ``prompts`` prompts runs: one per action of the grid and speculation off."""
    return prompts * (cfg.actions.n_grid + 1)


def workload_prompts(cfg: ServingConfig, pair) -> list[list[int]]:
    """Every prompt of ``cfg``'s workload (its split, its domains, ``max_prompts`` of each), as the env loads them."""
    workload = cfg.workload or Workload(pair.tokenizer, cfg.mix, cfg.split, cfg.prompt_tokens, cfg.max_prompts,
                                        code_source=cfg.code_source)
    return [p for d in workload.domains for p in workload.prompts[d]]


def fill_workload(env_kwargs: dict, done: Callable[[int], None] = lambda n: None, threads: int = 1) -> int:
    """Decode every prompt of the env ``env_kwargs`` describes (``ServingEnv``'s keyword arguments) alone with each
    action of its grid, on the replay backend, writing each prompt's tree when its decodes end; ``done(n)`` after each
    prompt (its decodes). Returns the decodes run."""
    torch.set_num_threads(threads)
    cfg = ServingConfig(**{k: v for k, v in env_kwargs.items() if k != "render_mode"})
    pair = cfg.pair_options.load(cfg.pair)  # as the env
    predictor = lookup_for(pair) if cfg.actions.score in LOOKUP_SCORES else None
    store = cfg.replay_store or TreeStore(max_kv_bytes=PATH_KV_BYTES)  # a prompt at a time: little KV to keep
    runner = ReplayRunner(pair, UNIT_COSTS, ReferenceStore(pair, cfg.max_new_tokens), cfg.max_new_tokens, store=store)
    grid = cfg.actions
    actions = [Action.bild(f, r) for f in grid.fallback_values for r in grid.rollback_values] + [Action.off()]
    n = 0
    for prompt in workload_prompts(cfg, pair):
        for action in actions:
            session = BildSession(runner, prompt, cfg.max_new_tokens, pair.eos_token_ids, grid.max_draft_len, None,
                                  grid.score, predictor)
            while not session.done:
                action.run(session)
        runner.start()  # the prompt's tree released
        runner.store.flush()  # on disk now, for the caller's envs
        n += len(actions)
        done(len(actions))
    return n


def _child(env_kwargs: dict, counter, parent: int) -> None:
    def done(n: int) -> None:
        with counter.get_lock():
            counter.value += n
        if os.getppid() != parent:  # the caller was killed: stop after this prompt (its tree is on disk)
            raise SystemExit(0)

    fill_workload(env_kwargs, done)


class WorkloadFill:
    """``fill_workload`` in a spawned child process, started at once; ``wait`` counts its decodes and joins it."""

    def __init__(self, env_kwargs: dict) -> None:
        context = multiprocessing.get_context("spawn")  # no copy of the caller's models and threads
        self.counter = context.Value("q", 0)
        self.process = context.Process(target=_child, args=(env_kwargs, self.counter, os.getpid()), daemon=True)
        self.process.start()
        self._seen = 0

    def take(self) -> int:
        """Decodes done since the last call."""
        with self.counter.get_lock():
            value = self.counter.value
        new, self._seen = value - self._seen, value
        return new

    def counted(self, progress) -> _Counted:
        """``progress`` (a tqdm-like bar) as a bar whose every update also counts the child's decodes done since."""
        return _Counted(progress, self)

    def wait(self, progress=None, poll_s: float = 1.0) -> bool:
        """Until the child ends, advancing ``progress`` (a tqdm-like bar) by its decodes; False when it failed (its
        traceback is on stderr; what it filled stays, and the envs fill the rest as they go)."""
        while self.process.is_alive():
            self.process.join(poll_s)
            if progress is not None:
                progress.update(self.take())
        if progress is not None:
            progress.update(self.take())
        return self.process.exitcode == 0

    def stop(self) -> None:
        """End the child now (the prompts it finished stay on disk)."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)


class _Counted:
    """A bar advanced by the caller's units and, at each of its updates, by the fill's decodes done since."""

    def __init__(self, bar, fill: WorkloadFill) -> None:
        self.bar, self.fill = bar, fill

    @property
    def total(self):
        return self.bar.total

    @total.setter
    def total(self, value) -> None:
        self.bar.total = value

    def update(self, n: float = 1) -> None:
        self.bar.update(n + self.fill.take())
