"""One method serving one arrival trace on the wall clock: the trace (``arrival_trace``: the env's warm batch, then
Poisson arrivals), a way to serve (``Method``), and the online run (``OnlineRun``, ``run_level``): a batched decoder
stepped on its own clock, each request admitted when it has arrived and there is room. What is measured, and why,
is ``agents.serve.load_clock``'s docstring.
"""

from __future__ import annotations


import time
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from bild_env.actions import Action, Plan, grid_action
from bild_env.decoding.batched import BatchedDecoder
from bild_env.paths import prompt_key
from bild_env.serving import clock
from bild_env.serving.env import Join, ServingConfig, ServingEnv, resume_join
from bild_env.serving.observations import ServingView


@dataclass
class Arrival:
    """A request of the trace: ``join`` is what the decoder is given (for a warm request the prompt extended by
    the ``offset`` tokens it had), ``prompt`` the request's own, ``at_ms`` its arrival on the clock."""

    join: Join
    prompt: list[int]
    prompt_index: int
    at_ms: float
    offset: int = 0

    @property
    def warm(self) -> bool:
        """Under way when the run starts (the env's warm batch; ids < 0)."""
        return self.join.rid < 0


def arrival_trace(env: ServingEnv, level: float, requests: int, seed: int) -> list[Arrival]:
    """The env's warm batch of ``reset(seed)`` (rids < 0), then ``requests`` Poisson arrivals at ``level`` x capacity."""
    env = env.unwrapped
    env.reset(seed=seed)
    n = env.config.max_new_tokens
    trace = []
    for i, r in enumerate(env.active):  # under way: the target generated new_ids so far
        join, offset = resume_join(r, -1 - i, n)
        trace.append(Arrival(join, list(r.prompt), r.prompt_index, 0.0, offset))
    gaps, prompts = (np.random.default_rng([seed, k]) for k in (1, 2))
    rate = level * env.capacity_rps / 1000.0  # per ms
    at = 0.0
    for rid in range(requests):
        at += float(gaps.exponential(1.0 / rate))
        domain, index, prompt = env.workload.draw(prompts)
        trace.append(Arrival(Join(rid, list(prompt), n, domain), list(prompt), index, at))
    return trace


@dataclass
class Method:
    """A way to serve: naive SD (``spec_k`` > 0), or a policy (``predict(obs)``) over the grid ``grid``
    (ServingConfig fields; its actions decoded by ``bild_env.actions.grid_action``)."""

    name: str
    policy: object | None = None
    grid: ServingConfig = field(default_factory=ServingConfig)
    spec_k: int = 0

    def act(self, obs: np.ndarray) -> Action:
        """The step's action: the policy's, on ``grid``; naive SD's shows as speculation off (no thresholds)."""
        if self.spec_k:
            return Action.off()
        action, _ = self.policy.predict(obs, deterministic=True)
        return grid_action(int(np.asarray(action).reshape(-1)[0]), self.grid)

    def label(self, action: Action) -> str:
        """How ``actions_taken`` names a step of ``action``."""
        if self.spec_k:
            return "naive"
        return action.text


@dataclass
class Served:
    """What happened to one request in a run (clock ms)."""

    arrival: Arrival
    admitted_ms: float = -1.0
    finished_ms: float = -1.0
    actions: list[Action] = field(default_factory=list)  # per step it was in, its Action
    new_ids: list[int] = field(default_factory=list)
    equal_env: bool | None = None  # its tokens equal the env's (``OnlineRun.exactness``; None for naive SD)
    equal_greedy: bool | None = None  # ... the target's greedy tokens


class OnlineRun:
    """One method serving one trace on its own clock (module docstring): ``step()`` until ``done``."""

    def __init__(self, env: ServingEnv, method: Method, trace: list[Arrival], repeat: int) -> None:
        cfg = env.config
        self.env, self.method, self.repeat, self.cfg = env, method, repeat, cfg
        self.costs, self.capacity = env.cost_model, env.capacity_rps
        self.level = env.load.utilisation(0.0)
        # the rules' score: the env's
        self.decoder = BatchedDecoder(env.pair, cfg.actions.max_draft_len, method.grid.actions.score)
        self.served = {a.join.rid: Served(a) for a in trace}
        self.pending = deque(a for a in trace if not a.warm)  # not arrived yet, by arrival time
        self.queue: deque[Arrival] = deque()
        self.clock_ms = self.busy_ms = self.idle_ms = 0.0
        self.steps, self.batch_sum, self.tokens, self.regret = 0, 0, 0, 0.0
        self.actions: Counter = Counter()
        g = method.grid
        self.view = ServingView(cfg.max_batch, cfg.actions.max_draft_len, max(g.actions.rollback_values),
                                cfg.max_new_tokens, (), g.observe.batch_scale, foresee=g.observe.next)
        warm = [a for a in trace if a.warm]
        if warm:  # under way at the start: joined untimed, as the env does not charge them
            self.decoder.join([a.join.prompt for a in warm], [a.join.max_new_tokens for a in warm],
                              [a.join.rid for a in warm])
            for a in warm:
                self.served[a.join.rid].admitted_ms = 0.0
            self._collect()
        self.decoder.forward_log = []
        self.view.begin([len(a.prompt) for a in warm], self._progress(), [a.join.domain for a in warm])
        self.view.arrivals(self.level * self.capacity, self.capacity)

    @property
    def done(self) -> bool:
        return not self.pending and not self.queue and not len(self.decoder)

    def step(self) -> int:
        """One step (action, joins, batched step); returns how many requests finished in it."""
        d, cfg = self.decoder, self.cfg
        t0 = time.perf_counter()
        # 1. the action, on the observation so far; a policy that observes the next proposals reads them ahead here
        # (the step's first draft forward, run before the action, inside this step's wall time)
        g = self.method.grid
        if g.observe.next:
            up_to = g.charging.read_ahead_batch
            self.view.next_p = d.peek_draft() if not up_to or len(d) <= up_to else []
        act = self.method.act(self.view.observe())
        # 2. nothing to do: the clock jumps to the next arrival; arrived requests join while the batch has room
        idle = 0.0
        if not len(d) and not self.queue and self.pending:
            idle = max(0.0, self.pending[0].at_ms - self.clock_ms)
            self.clock_ms += idle
            self._arrive()
        d.forward_log.clear()
        start_lens = d.lens.clone()
        joins = [self.queue.popleft() for _ in range(min(cfg.max_batch - len(d), len(self.queue)))]
        if joins:
            d.join([a.join.prompt for a in joins], [a.join.max_new_tokens for a in joins], [a.join.rid for a in joins])
        # 3. one batched step of every running request
        stats = {}
        if len(d):
            ids = list(d.ids)
            if self.method.spec_k:
                stats = d.step_speculative(self.method.spec_k)
            else:
                stats = act.batch_step(d)
            for rid in ids:
                self.served[rid].actions.append(act)
        wall = (time.perf_counter() - t0) * 1000.0
        # 4. the clock moves by the measured time; admissions and finishes are stamped with it
        for a in joins:
            self.served[a.join.rid].admitted_ms = self.clock_ms
        self.clock_ms += wall
        self.busy_ms += wall
        self.idle_ms += idle
        self.steps += 1
        self.batch_sum += len(stats)
        self.actions[self.method.label(act)] += 1
        finished = self._collect()
        arrived = self._arrive()
        self._observe(stats, act, start_lens, len(joins))
        self.view.arrivals(arrived / (wall + idle) * 1000.0 if wall + idle > 0 else 0.0, self.capacity)
        return finished

    def _arrive(self) -> int:
        n = 0
        while self.pending and self.pending[0].at_ms <= self.clock_ms:
            self.queue.append(self.pending.popleft())
            n += 1
        return n

    def _collect(self) -> int:
        """Stamp the requests the decoder finished (their tokens and finish time)."""
        d, n = self.decoder, 0
        for rid in list(d.finished):
            gen = d.finished.pop(rid)
            s = self.served[rid]
            s.new_ids, s.finished_ms = list(gen.new_ids), self.clock_ms
            self.tokens += len(gen.new_ids)
            n += 1
        return n

    def _progress(self) -> float:
        d = self.decoder
        if not len(d):
            return 0.0
        done = [self.served[rid].arrival.offset + int(c) for rid, c in zip(d.ids, d.new_count.tolist())]
        return sum(done) / (self.cfg.max_new_tokens * len(done))

    def _observe(self, stats: dict, act: Action, start_lens: torch.Tensor, joined: int) -> None:
        """The env's observation update from what the decoder did (module docstring: two entries approximate)."""
        d = self.decoder
        rows = len(stats)
        tokens = sum(s.new_tokens for s in stats.values())
        self.regret += sum(s.regret for s in stats.values())
        # charged as the env charges a step (bild_env.serving.clock), on the forwards the decoder ran
        modelled, prefill = clock.forwards_ms(self.costs, [(f.role, f.rows, f.fed, float(f.columns))
                                                           for f in d.forward_log])  # a prefill's columns: 0
        context = clock.step_context(start_lens.tolist(), False, self.cfg.prompt_tokens)
        ref = clock.reference_ms(self.costs, tokens, rows, context, prefill)
        running = {rid: row for row, rid in enumerate(d.ids)}
        stops = [float(d.draft_p[running[rid]]) for rid, s in stats.items()
                 if rid in running and (s.proposed or s.fallbacks)]
        active = [self.served[rid].arrival for rid in d.ids]
        self.view.after_step(
            decoding=rows, queue=len(self.queue), proposed=sum(s.proposed for s in stats.values()),
            accepted=sum(s.accepted for s in stats.values()), tokens=tokens, step_ms=modelled, ref_ms=ref,
            shown=Plan(shared=act).shown([act], (self.view.fallback, self.view.rollback, self.view.off)),
            prompt_lens=[len(a.prompt) for a in active],
            progress=self._progress(), regret=self.regret, generated=max(self.tokens + sum(
                int(c) for c in d.new_count.tolist()), 1), stops=stops, domains=[a.join.domain for a in active])

    # ------------------------------------------------------------------ afterwards (untimed)

    def exactness(self, references, runner) -> dict:
        """How many requests' tokens equal the env's (a batch-of-one BiLD session on the replay trees under the
        same per-step thresholds; None for naive SD) and the target's greedy tokens."""
        from bild_env.decoding.bild import BildSession

        eos = self.env.pair.eos_token_ids
        same_env = same_greedy = 0
        naive = self.method.spec_k > 0
        for s in self.served.values():
            a = s.arrival
            s.equal_greedy = s.new_ids == list(references.get(a.prompt))[a.offset:]
            same_greedy += s.equal_greedy
            if naive:
                continue
            session = BildSession(runner, a.prompt, self.cfg.max_new_tokens, eos, self.cfg.actions.max_draft_len,
                                  score=self.method.grid.actions.score)
            for _ in range(a.offset):  # the warm tokens, by the target alone (as the env's reset)
                session.step_off()
            for action in s.actions:
                if session.done:
                    break
                action.run(session)
            s.equal_env = s.new_ids == list(session.new_ids)[a.offset:]
            same_env += s.equal_env
        n = len(self.served)
        return {"equal_env": None if naive else f"{same_env}/{n}", "equal_greedy": f"{same_greedy}/{n}"}

    def summary(self) -> dict:
        arrived = [s for s in self.served.values() if not s.arrival.warm]
        latency = [s.finished_ms - s.arrival.at_ms for s in arrived]
        queued = [s.admitted_ms - s.arrival.at_ms for s in arrived]
        return {
            "method": self.method.name, "repeat": self.repeat, "busy_ms": self.busy_ms, "idle_ms": self.idle_ms,
            "tokens": self.tokens, "goodput_tok_s": 1000.0 * self.tokens / self.busy_ms if self.busy_ms else 0.0,
            "steps": self.steps, "mean_batch": self.batch_sum / max(self.steps, 1),
            "mean_latency_ms": float(np.mean(latency)) if latency else 0.0,
            "p90_latency_ms": float(np.percentile(latency, 90)) if latency else 0.0,
            "mean_queue_ms": float(np.mean(queued)) if queued else 0.0,
            "actions": dict(self.actions.most_common()),
            "requests": [{"rid": s.arrival.join.rid, "prompt_key": prompt_key(s.arrival.prompt),
                          "arrived_ms": round(s.arrival.at_ms, 1), "admitted_ms": round(s.admitted_ms, 1),
                          "finished_ms": round(s.finished_ms, 1), "new_tokens": len(s.new_ids),
                          "equal_env": s.equal_env, "equal_greedy": s.equal_greedy} for s in self.served.values()],
        }


def run_level(env: ServingEnv, methods: list[Method], trace: list[Arrival], repeats: int) -> list[OnlineRun]:
    """Every method ``repeats`` times on ``trace``, interleaved step by step (each round starting one run further
    on, so that no run always follows the same one); the runs, finished."""
    runs = [OnlineRun(env, m, trace, k + 1) for k in range(repeats) for m in methods]
    with tqdm(total=len(trace) * len(runs), desc=f"load {env.load.utilisation(0.0):g}", leave=False) as bar:
        bar.update(sum(len(trace) - len(r.pending) - len(r.queue) - len(r.decoder) for r in runs))
        turn = 0
        while not all(r.done for r in runs):
            for r in runs[turn:] + runs[:turn]:
                if not r.done:
                    bar.update(r.step())
            turn = (turn + 1) % len(runs)
    return runs
