"""The Gymnasium environment ``BiLD-Serve-v0``: BiLD for a batch of concurrent requests under a moving load.

Its arguments and their checks are in ``bild_env.serving.config``, a request's life and the episode's totals in
``bild_env.serving.episode``, the batch's clock in ``bild_env.serving.clock``. Over 450 lines for a reason: the
class docstring is the env's specification (spaces, reward, episode; the documentation is generated from it), and
the steps' parts left here (arrivals, admissions, the requests' steps, read-ahead, snapshots) all change one
episode's state, which ``snapshot`` and ``restore`` must see whole.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import fields, replace

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces

from bild_env.actions import TreeActions, thresholds
from bild_env.decoding.allocation import allocate_depth
from bild_env.decoding.bild import LOOKUP_SCORES, BildSession, DraftScore
from bild_env.decoding.profiles import MACHINE, check_batch, load_profile, profile_for, vary
from bild_env.decoding.tree import TreeRule, parse_tree_rule, session_tree_step
from bild_env.models.lookup import lookup_for
from bild_env.models.pairs import load_pair
from bild_env.reference import ReferenceStore
from bild_env.replay.batching import CoopBatcher, active_batcher
from bild_env.replay.runner import ReplayRunner
from bild_env.serving import clock
from bild_env.serving.config import DEFAULT_LOAD, DEFAULT_MIX, ServingConfig, validate
from bild_env.serving.episode import Join, Request, StepTally, Totals, count, resume_join
from bild_env.serving.observations import ServingView, cost_features, observation_space
from bild_env.serving.workload import Workload

# what callers import from here: the env's config, its defaults and check, and a request as a decoder joins it
TREE_THRESHOLDS = (0.0, 0.0)  # what a tree step shows as its thresholds (as BiLD-v1's): draft on, keep the target's

__all__ = ["DEFAULT_LOAD", "DEFAULT_MIX", "Join", "Request", "ServingConfig", "ServingEnv", "resume_join", "validate"]


class ServingEnv(TreeActions, gym.Env):
    """BiLD serving a stream of requests: a batch decoded together, requests arriving and finishing.

    Requests (real prompts of a mixed workload: prose, code, chat, long inputs) arrive at a rate set by
    a load profile, wait in a queue and join the batch while it has room (continuous batching, at most
    ``max_batch`` together); each finishes after ``max_new_tokens`` tokens or EOS and leaves. Every
    request is decoded exactly (greedy BiLD answered from the replay trees, as ``BiLD-v1``'s replay
    backend: its tokens are those live BiLD would produce). A step is one BiLD step of every request in
    the batch (one draft phase each, then one batched verification) under the thresholds the action
    picks; its time is the cost model's time of those forwards run as batches (``bild_env.serving.clock``:
    prefills apart, decode rows padded to the longest, as a batched decoder with attention masks pays).
    The simulated clock advances by it, and arrivals follow it.

    ## Action Space
    ``Discrete(len(fallback_values) * len(rollback_values) + 1)`` with ``off_switch`` (the default;
    ``Discrete(26)``): ``a < 25`` is BiLD with ``fallback = fallback_values[a // 5]``, ``rollback =
    rollback_values[a % 5]`` (BiLD-v1's grid: fallback in (0.103, 0.25, 0.35, 0.45, 0.6), rollback in
    (0.5, 1.0, 1.5, 2.5, 4.697) nats); ``a = 25`` turns speculation off for the step: every request's
    target emits one token alone, no draft forward. With ``action="continuous"``: ``Box(-1, 1, (3,))``,
    fallback linear and rollback log-scale over the grids' spans, and the third number > 0 turns
    speculation off (``Box(2,)`` without ``off_switch``). With ``per_domain``: ``MultiDiscrete([26] * len(domains))``,
    one such action per domain of the workload (``workload.domains`` order); each request of the batch takes its
    own domain's (an endpoint that knows what each request is; the batch's verification stays one forward, its
    rows padded to the longest draft run). ``info["per_domain"]`` says what each domain got. With ``allocate``, the
    fallback value is a price in [0, 1] instead of a threshold: the batch drafts depth by depth while its requests'
    cumulative scores pay for what the batch spends on the depth (``bild_env.decoding.allocation``);
    ``info["depth"]`` is the depth drafted (None otherwise). With ``tree_rules`` (discrete, not ``per_domain``) one
    more action per rule follows the off switch: every request of the batch takes one lossless token-tree step by that
    rule (``bild_env.decoding.tree``: its draft grows a tree, the target verifies every request's tree in the step's
    batched verification, each request commits the path its target agrees with and its own next token), answered
    from the replay trees and charged as the batch's forwards (each level of the draft's tree one forward, fed that
    level's nodes; the verification fed the root and every node). Such a step shows thresholds (0, 0) and
    ``info["tree"]`` names its rule (None on other steps).

    ## Observation Space
    ``Box(14,)`` float32 (``+ len(domains)`` with ``observe_domain`` or ``per_domain``, ``+ 3`` with ``observe_next``);
    see ``bild_env.serving.observations``:

    | index | observation | min | max |
    |---|---|---|---|
    | 0 | batch size / max_batch (requests decoding this step) | 0 | 1 |
    | 1 | queue length / max_batch (waiting requests; clipped) | 0 | 2 |
    | 2 | load trend: fast minus slow moving average of the batch size, / max_batch | -1 | 1 |
    | 3 | arrivals per second, moving average / target-only capacity (clipped) | 0 | 2 |
    | 4 | the batch's recent acceptance: moving average of draft tokens kept / proposed (1/2 at reset) | 0 | 1 |
    | 5 | recent tokens committed per request-step / (max_draft_len + 1) | 0 | 1 |
    | 6 | recent step time / target-only time at the same load for the same tokens (clipped; 1 at reset) | 0 | 2 |
    | 7 | previous fallback threshold (1 when speculation was off; per_domain: the batch's mean) | 0 | 1 |
    | 8 | previous rollback threshold / max(rollback_values) (0 when off; per_domain: the batch's mean) | 0 | 1 |
    | 9 | speculation was off at the previous step (per_domain: the share of requests it was off for) | 0 | 1 |
    | 10 | mean prompt length of the batch / 512 (clipped) | 0 | 1 |
    | 11 | mean progress of the batch's requests (tokens generated / max_new_tokens) | 0 | 1 |
    | 12 | regret so far, nats per generated token / 2 (clipped) | 0 | 1 |
    | 13 | the draft's mean max probability where its runs stopped, last step (1 at reset) | 0 | 1 |
    | 14.. | with observe_domain or per_domain: share of each domain (``workload.domains`` order) in the batch | 0 | 1 |
    | then 3 | with observe_next: the draft's max probability for the running requests' next proposals (the first token each next drafts, read ahead from the replay trees; with a lookup ``score``, the lookup predictor's chance for it): mean, 2 x standard deviation, share at or above entry 7's fallback threshold | 0 | 1 |

    The domain of a request is in ``info``, not in the default observation (the agent must read the
    workload from acceptance, as a server that is not told what it is serving).

    ## Rewards
    Per step, ``latency_weight * (T_ref - T_step) / T_norm - regret_weight * R_step / max_new_tokens``.
    ``T_step``: the step's time (ms, cost model, batched as above). ``T_ref``: what target-only decoding
    at the same load takes for the same tokens: the tokens the step committed times the target's one-token
    forward over this batch size, divided by the batch size (``batch_ms("target", B, 1, context) / B`` per
    token), plus the same prefills. ``T_norm``: target-only time of one request (``max_new_tokens`` at
    batch 1). ``R_step``: the regret of the step, summed over the batch (nats; 0 for every lossless step).
    So the return is the time saved against target-only serving of the same requests at the same load, in
    single-request units, minus the quality charge: goodput against target-only, as servers count it.

    ## Starting State
    ``reset`` draws the episode's load (a level or phase of the profile) and, with ``mix_draw`` > 0, its own mix
    of the workload's domains (Dirichlet around the mix's weights, in ``info["mix"]``: an endpoint whose traffic
    changes from one period to the next; small ``mix_draw``, episodes dominated by one domain), fills the batch with the number
    of requests target-only serving would hold at that load (drawn Poisson), each already some tokens into
    its answer (drawn uniformly, decoded by the target alone and not charged), and an empty queue.

    ## Episode End
    Serving never terminates. ``truncated`` after ``episode_steps`` steps, or when every request of the
    batch failed. A request whose step fails (e.g. the model runs out of memory filling a tree) ends
    alone, with the error in ``info["errors"]``; the others go on. At truncation
    ``info["episode_summary"]`` has the goodput, speedup over target-only at the same load, regret,
    fidelity and mean batch size, overall and per domain.

    ## Arguments
    See ``ServingConfig`` (every argument, with defaults). ``gymnasium.make("bild_env:BiLD-Serve-v0",
    pair="tiny-random", mix="prose:1")`` runs offline in seconds.

    ## Version History
    * v0: batched BiLD steps under continuous batching, load profiles, a mixed workload and the off switch
      (``per_domain``, an action per domain, added later as an option; so were ``score``, what each request's
      fallback threshold reads, ``observe_next``, three more observations, and ``allocate``, the fallback values
      read as a price for the batch's drafting depth; ``cost_profile``, another machine's costs charged, and
      ``train_profiles`` / ``vary_profiles`` / ``observe_costs``, a drawn machine per episode and three more
      observations of what it charges; ``tree_rules``, token-tree steps as actions; the default spaces unchanged).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, render_mode: str | None = None, **kwargs) -> None:
        names = {f.name for f in fields(ServingConfig)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown BiLD-Serve-v0 argument(s) {unknown}; valid: {sorted(names)}")
        self.config = cfg = ServingConfig(**kwargs)
        self.profile = validate(cfg)
        cfg.tree_rules = tuple(cfg.tree_rules)  # a list (JSON, a caller's) as the tuple the field holds
        self.cost_profile = profile_for(cfg.cost_profile, cfg.cost_model)  # checked now, before any model loads
        self.train_profiles = [load_profile(p) for p in cfg.train_profiles]
        for profile in [self.cost_profile, *self.train_profiles]:
            if profile is not None:
                check_batch(profile, cfg.max_batch)
        self.cost_profile = self.cost_profile or (self.train_profiles[0] if self.train_profiles else None)
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.render_mode = render_mode
        self.pair = load_pair(None if (cfg.draft and cfg.target) else cfg.pair, draft=cfg.draft, target=cfg.target,
                              tokenizer=cfg.tokenizer, device=cfg.device, dtype=cfg.dtype, lean=cfg.lean,
                              draft_vocab=cfg.draft_vocab)
        self.predictor = lookup_for(self.pair) if cfg.score in LOOKUP_SCORES else None  # what the lookup scores read
        self.workload = cfg.workload or Workload(self.pair.tokenizer, cfg.mix, cfg.split, cfg.prompt_tokens,
                                                 cfg.max_prompts, code_source=cfg.code_source)
        longest = max((len(p) for d in self.workload.domains for p in self.workload.prompts[d]), default=0)
        if longest + cfg.max_new_tokens > self.pair.max_positions:
            raise ValueError(f"a prompt of {longest} tokens + max_new_tokens exceeds the models' "
                             f"{self.pair.max_positions} positions; lower max_new_tokens or leave long inputs out of the mix")
        if self.cost_profile is not None:
            self.cost_model = self.cost_profile.model
        elif cfg.cost_model is None:
            from bild_env.decoding.costs import load_or_calibrate_batched

            self.cost_model = load_or_calibrate_batched(self.pair)
        else:
            self.cost_model = cfg.cost_model
        self.references = ReferenceStore(self.pair, cfg.max_new_tokens)
        self._runners: list[ReplayRunner] = []  # a pool: one per request in the batch, reused
        self._missed = True  # the last step missed the replay trees (the next batches its fills)
        n_grid = len(cfg.fallback_values) * len(cfg.rollback_values)
        self.n_grid = n_grid
        self.n_actions = n_grid + (1 if cfg.off_switch else 0)  # of one request (or of the batch), the tree rules apart
        self.tree_rules: tuple[TreeRule, ...] = tuple(parse_tree_rule(text) for text in cfg.tree_rules)
        self.first_tree = self.n_actions  # the first tree action's index
        if cfg.action == "continuous":
            self.action_space = spaces.Box(-1.0, 1.0, (3 if cfg.off_switch else 2,), dtype=np.float32)
        elif cfg.per_domain:
            self.action_space = spaces.MultiDiscrete([self.n_actions] * len(self.workload.domains))
        else:
            self.action_space = spaces.Discrete(self.n_actions + len(self.tree_rules))
        self.observes_domain = cfg.observe_domain or cfg.per_domain
        self.observation_space = observation_space(len(self.workload.domains) if self.observes_domain else 0,
                                                   cfg.observe_next, cfg.observe_costs)
        self._charge(self.cost_model, self.cost_profile.name if self.cost_profile else None)
        self.loop = clock.BatchLoop(*cfg.charge_loop) if cfg.charge_loop else None  # the decoder's own work, charged
        self.view: ServingView | None = None
        self._prepared: tuple[float, float, float] | None = None  # a step's admissions done (by peek)
        self._runs: tuple | None = None  # with allocate: the runs read ahead at a state (``_depth``), for peek's tries
        # called with every request the batch admits, as it joins (reset's warm ones too; ``bench.serving_clock``
        # records schedules with it)
        self.on_admit: Callable[[Request], None] | None = None

    def _charge(self, cost_model, name: str | None) -> None:
        """Charge ``cost_model`` (named ``name``; None: this machine's) from now on: target-only capacity (requests per
        second a full batch of target-only decoding completes: the load's unit), the reward's normaliser, and what
        the hardware observation reads (``cost_features``)."""
        cfg = self.config
        self.cost_model, self.charged = cost_model, name or MACHINE
        for runner in self._runners:
            runner.cost_model = cost_model
        context = cfg.prompt_tokens + cfg.max_new_tokens / 2
        full = cost_model.batch_ms("target", cfg.max_batch, 1, context)
        self.capacity_rps = cfg.max_batch / (cfg.max_new_tokens * full / 1000.0)
        self.norm_ms = cfg.max_new_tokens * cost_model.batch_ms("target", 1, 1, context)
        self.costs_seen = cost_features(cost_model, cfg.max_batch, context)

    def _draw_costs(self) -> None:
        """With ``train_profiles``: this episode's hardware, one of them (varied with ``vary_profiles``)."""
        cfg = self.config
        profile = self.train_profiles[int(self.np_random.integers(len(self.train_profiles)))]
        if cfg.vary_profiles > 1.0:
            span = math.log(cfg.vary_profiles)
            profile = vary(profile, *np.exp(self.np_random.uniform(-span, span, size=3)).tolist())
        self._charge(profile.model, profile.name)

    # ----------------------------------------------------------------------------------------
    def thresholds(self, action) -> tuple[float, float] | None:
        """(fallback, rollback) that ``action`` (of one request or the batch; with ``per_domain``, one domain's
        entry) picks, or None for speculation off (module docstring)."""
        cfg = self.config
        return thresholds(action, cfg.fallback_values, cfg.rollback_values, cfg.action == "continuous", cfg.off_switch)

    def _plan(self, action):
        """What a checked action sets: one (fallback, rollback), None for the batch, or a ``TreeRule`` (a tree step
        for every request), or with ``per_domain`` a {domain: (fallback, rollback) or None} that each request looks
        its domain up in."""
        if self.config.per_domain:
            return {d: self.thresholds(int(a)) for d, a in zip(self.workload.domains, action)}
        if self.tree_rule(action) is not None:
            return self.tree_rules[int(action) - self.first_tree]
        return self.thresholds(action)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if options:
            raise ValueError(f"BiLD-Serve-v0 reset takes no options, got {sorted(options)}")
        cfg = self.config
        self.load = self.profile.start(self.np_random)
        self.clock_ms, self.steps, self._prepared = 0.0, 0, None
        self._runs = None
        # Arrivals and their prompts come from streams of their own, so that policies compared on one seed
        # meet the same requests in the same order (common random numbers): request k arrives when the
        # integrated arrival rate reaches the k-th point of a unit-rate Poisson process.
        seeds = self.np_random.integers(2**63, size=2)
        self._gaps, self._prompt_rng = np.random.default_rng(seeds[0]), np.random.default_rng(seeds[1])
        self.episode_mix = None  # with mix_draw: this episode's domain weights (from the env's seeded stream)
        if cfg.mix_draw > 0:
            w = np.array([self.workload.weights[d] for d in self.workload.domains], dtype=float)
            self.episode_mix = self.np_random.dirichlet(cfg.mix_draw * len(w) * w / w.sum())
        if self.train_profiles:
            self._draw_costs()
        self._integrated, self._next_arrival = 0.0, float(self._gaps.exponential())
        self.active: list[Request] = []
        self.queue: deque[Request] = deque()
        self._free = list(self._runners)
        self.view = ServingView(cfg.max_batch, cfg.max_draft_len, max(cfg.rollback_values), cfg.max_new_tokens,
                                self.workload.domains if self.observes_domain else (), cfg.batch_scale,
                                foresee=cfg.observe_next)
        self.totals = Totals(self.workload.domains)
        u = self.load.utilisation(0.0)
        for _ in range(min(cfg.max_batch, int(self._prompt_rng.poisson(self._steady_batch(u))))):
            request = self._arrive()
            self._admit(request, warm=True)
        self.view.begin([len(r.prompt) for r in self.active], self._progress(), [r.domain for r in self.active])
        self.view.arrivals(u * self.capacity_rps, self.capacity_rps)
        info = {"utilisation": u, "arrival_rate": u * self.capacity_rps, "batch_size": len(self.active),
                "cost_profile": self.charged}
        if self.episode_mix is not None:
            info["mix"] = dict(zip(self.workload.domains, self.episode_mix.tolist()))
        return self._obs(), info

    def step(self, action):
        if self.view is None:
            raise RuntimeError("BiLD-Serve-v0: call reset() before step()")
        if self.steps >= self.config.episode_steps:
            raise RuntimeError("BiLD-Serve-v0: the episode was truncated; call reset() before step()")
        return self._act(self._plan(self._check_action(action)), *self.prepare())

    def peek(self, actions=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What each of ``actions`` (default: every discrete action) would give from the current state, untaken.

        Returns ``(observations, rewards, truncated)``, one row per action: exactly what ``step(a)`` would
        return now (the same arrivals and admissions: they come before the action, and the arrival streams
        are restored after each try). The episode is left as it was; a ``step`` after it takes up the same
        admitted batch. Every request's step is answered from the replay trees (a miss fills them, as a
        step would), so this is exact. Training uses it to learn from every action at every visited state
        (``agents.dqn.AllActionsDQN``): the actions are compared on the same batch, not across batches.
        """
        if self.view is None:
            raise RuntimeError("BiLD-Serve-v0: peek() needs a running episode: call reset() first")
        if self.steps >= self.config.episode_steps:
            raise RuntimeError("BiLD-Serve-v0: the episode was truncated; call reset() before peek()")
        if actions is None:
            if self.config.action != "discrete" or self.config.per_domain:
                raise ValueError("BiLD-Serve-v0: peek() without actions enumerates the discrete actions of the "
                                 "batch; give the actions to try (continuous or per_domain)")
            actions = range(self.action_space.n)
        chosen = [self._plan(self._check_action(a)) for a in actions]
        prepared = self.prepare()
        saved = self.snapshot()
        observations, rewards, truncated = [], [], []
        for thresholds in chosen:
            try:
                obs, reward, _, trunc, _ = self._act(thresholds, *prepared)
            finally:
                self.restore(saved)
            observations.append(obs)
            rewards.append(reward)
            truncated.append(trunc)
        shape = (len(observations), *self.observation_space.shape)
        return (np.asarray(observations, dtype=np.float32).reshape(shape), np.asarray(rewards, dtype=np.float64),
                np.asarray(truncated, dtype=bool))

    def prepare(self) -> tuple[float, float, float]:
        """The part of a step no action changes: idle time to the next arrival, admissions (their prefills
        recorded). Done once per step (``peek`` and the ``step`` after it share it; calling it again before the
        step returns the same); returns (utilisation, arrival rate, idle ms). A caller that wants to see the
        batch the next step decodes (``self.active``) before choosing its action calls it first."""
        if self._prepared is None:
            u = self.load.utilisation(self.steps / self.config.episode_steps)
            rate = u * self.capacity_rps  # requests per second
            idle_ms = self._wait_for_work(rate)
            for request in self.active:
                request.runner.trace.clear()  # this step's forwards only (a joining request's prefill included)
            for request in self._admissions():
                self._admit(request)
            self._prepared = (u, rate, idle_ms)
        return self._prepared

    def snapshot(self) -> tuple:
        """Everything a step changes (the env's, the requests' sessions' and their runners'), for ``restore``: a
        caller may try things on the running episode (read ahead, step) and put it back as it was."""
        requests = [(r, r.regret, list(r.session.tokens), r.session.total.copy(), r.session.draft_p,
                     dict(r.runner.lengths), r.runner.stats.copy(), list(r.runner.trace)) for r in self.active]
        return (self.clock_ms, self.steps, self._integrated, self._next_arrival, self._gaps.bit_generator.state,
                self._prompt_rng.bit_generator.state, list(self.active), list(self.queue), list(self._free),
                replace(self.view, shares=list(self.view.shares)), self.totals.copy(), self._missed,
                self._prepared, requests)

    def restore(self, saved: tuple) -> None:
        """Put the episode back as ``snapshot`` saw it."""
        (self.clock_ms, self.steps, self._integrated, self._next_arrival, gaps, prompts, active, queue, free, view,
         totals, self._missed, self._prepared, requests) = saved
        self._gaps.bit_generator.state, self._prompt_rng.bit_generator.state = gaps, prompts
        self.active, self.queue, self._free = list(active), deque(queue), list(free)
        self.view, self.totals = replace(view, shares=list(view.shares)), totals.copy()
        for r, regret, tokens, total, draft_p, lengths, stats, trace in requests:
            r.regret, r.session.tokens, r.session.total, r.session.draft_p = regret, list(tokens), total.copy(), draft_p
            r.runner.lengths, r.runner.stats, r.runner.trace = dict(lengths), stats.copy(), list(trace)

    def _act(self, plan, u: float, rate: float, idle_ms: float):
        """The step under ``plan`` (``_plan``: thresholds for the batch, None for speculation off, a tree rule, or a
        dict of thresholds per domain) once ``prepare`` has run: every request's BiLD step, the step's time batched against
        target-only decoding's at this load, then the clock, arrivals and departures."""
        self._prepared = None
        batch = list(self.active)
        context = self._step_context(batch)
        depth = self._allocated_depth(plan, batch, context)
        results = self._run([self._step_fn(r, t, depth) for r, t in zip(batch, self._each(plan, batch))])
        done = self._tally(batch, results, isinstance(plan, TreeRule))
        step_ms, target_prefill = clock.charge(self.cost_model, done.traces, "padded" if self.loop else "shrinking",
                                               self.loop)
        step_ms = self._charge_read_ahead(step_ms, done.traces, context)
        ref_ms = self._reference_ms(done, len(batch), context, target_prefill)
        reward = (self.config.latency_weight * (ref_ms - step_ms) / self.norm_ms
                  - self.config.regret_weight * done.regret / self.config.max_new_tokens)
        finished, failed = self._advance(batch, results, plan, done, step_ms, ref_ms, rate, idle_ms)
        truncated = self.steps >= self.config.episode_steps or (bool(batch) and len(failed) == len(batch)
                                                                and not self.active and not self.queue)
        info = self._step_info(plan, batch, done, depth, step_ms, ref_ms, u, rate, idle_ms, finished)
        if truncated:
            info["episode_summary"] = self.totals.summary()
        return self._obs(), float(reward), False, truncated, info

    def _each(self, plan, batch: list[Request]) -> list:
        """The thresholds (or None: off) each request of ``batch`` steps under: the plan's, or with ``per_domain``
        its domain's."""
        return [plan[r.domain] for r in batch] if isinstance(plan, dict) else [plan] * len(batch)

    def _step_context(self, batch: list[Request]) -> float:
        """The context the step's forwards are charged at: the batch's mean (what each target cache holds: all but
        the last token), or with ``charge_loop`` the longest (the padded decoder's span it)."""
        start_context = [len(r.session.tokens) - 1 for r in batch]
        if not start_context:
            return self.config.prompt_tokens
        return max(start_context) if self.loop is not None else sum(start_context) / len(start_context)

    def _allocated_depth(self, plan, batch: list[Request], context: float) -> int | None:
        """With ``allocate``: the depth the batch drafts to at the plan's price (``_depth``); None otherwise."""
        return self._depth(batch, plan[0], context) if self.config.allocate and plan is not None and batch else None

    def _tally(self, batch: list[Request], results: list, tree: bool = False) -> StepTally:
        """What the requests' steps did, summed (and added to each request's regret and the episode's totals);
        ``tree``: tree steps, which have no draft run that stopped (observation 13 keeps its last value)."""
        done = StepTally()
        for request, result in zip(batch, results):
            done.traces.append(list(request.runner.trace))
            if isinstance(result, str):
                done.errors.append({"domain": request.domain, "prompt_index": request.prompt_index, "error": result})
                continue
            done.new_tokens += result.new_tokens
            done.regret += result.regret
            done.mismatches += result.mismatches
            done.proposed += result.proposed
            done.accepted += result.accepted
            request.regret += result.regret
            self.totals.add(request.domain, result)
            if (result.proposed or result.fallbacks) and not tree:
                done.stops.append(request.session.draft_p)
        return done

    def _charge_read_ahead(self, step_ms: float, traces: list, context: float) -> float:
        """``step_ms`` with, under ``observe_next``, the draft forward that read the running requests' next
        proposals when the step drafted nothing: a server reads them with the step's first draft forward, run
        before the action, so a step that drafts nothing has run it for nothing (``BatchedDecoder.peek_draft``)."""
        cfg = self.config
        read_ahead = len(self.view.next_p) if cfg.observe_next else 0  # rows whose next proposal was read ahead
        if read_ahead and not any(role == "draft" for trace in traces for role, _, _ in trace):
            step_ms += self.cost_model.batch_ms("draft", min(read_ahead, cfg.max_batch), 1, context)
            step_ms += self.loop((0, 1, read_ahead)) if self.loop is not None else 0.0
        return step_ms

    def _reference_ms(self, done: StepTally, decoding: int, context: float, target_prefill: float) -> float:
        """What target-only decoding at this load takes for the step's tokens: each at the target's one-token
        forward over the batch, shared by its rows, plus the same prefills; with ``charge_loop``, the decoder's own
        work for its prefills and its one forward too."""
        per_token = self.cost_model.batch_ms("target", max(decoding, 1), 1, context) / max(decoding, 1)
        ref_ms = done.new_tokens * per_token + target_prefill
        if self.loop is not None and decoding:
            joined = sum(any(role == "target" and c == 0.0 for role, _, c in trace) for trace in done.traces)  # prefilled
            ref_ms += self.loop((1, 1 + (joined > 0), decoding + joined))
        return ref_ms

    def _advance(self, batch: list[Request], results: list, plan, done: StepTally, step_ms: float, ref_ms: float,
                 rate: float, idle_ms: float) -> tuple[list[dict], list[Request]]:
        """The clock moves by the step; arrivals during it queue; finished and failed requests leave; the totals and
        what the agent observes take the step in. Returns the finished (as ``info`` lists them) and the failed."""
        self.clock_ms += step_ms
        arrived = self._arrivals(rate * step_ms / 1000.0)
        finished, failed = self._leave(batch, results)
        self.steps += 1
        self.totals.step(step_ms, ref_ms, done.new_tokens, len(batch))
        self.view.after_step(decoding=len(batch), queue=len(self.queue), proposed=done.proposed,
                             accepted=done.accepted, tokens=done.new_tokens, step_ms=step_ms, ref_ms=ref_ms,
                             thresholds=self._each(plan, batch) if isinstance(plan, dict) else
                             TREE_THRESHOLDS if isinstance(plan, TreeRule) else plan,
                             prompt_lens=[len(r.prompt) for r in self.active], progress=self._progress(),
                             regret=self.totals.regret, generated=self.totals.tokens, stops=done.stops,
                             domains=[r.domain for r in self.active])
        self.view.arrivals(arrived / (step_ms + idle_ms) * 1000.0 if step_ms + idle_ms > 0 else rate,
                           self.capacity_rps)
        return finished, failed

    def _step_info(self, plan, batch: list[Request], done: StepTally, depth: int | None, step_ms: float,
                   ref_ms: float, u: float, rate: float, idle_ms: float, finished: list[dict]) -> dict:
        """``info`` of a step: what it chose (with ``per_domain``, the batch's mean thresholds as observed and each
        domain's), what it cost and did."""
        if isinstance(plan, dict):
            fallback, rollback, off = self.view.fallback, self.view.rollback, self.view.off == 1.0
        elif isinstance(plan, TreeRule):
            (fallback, rollback), off = TREE_THRESHOLDS, False
        else:
            fallback, rollback = plan if plan is not None else (None, None)
            off = plan is None
        info = {
            "off": off, "fallback": fallback, "rollback": rollback, "batch_size": len(batch),
            "queue": len(self.queue), "utilisation": u, "arrival_rate": rate, "step_ms": step_ms, "ref_ms": ref_ms,
            "idle_ms": idle_ms, "committed": done.new_tokens, "proposed": done.proposed, "accepted": done.accepted,
            "regret": done.regret, "mismatches": done.mismatches, "depth": depth,
            "goodput_tok_s": done.new_tokens / step_ms * 1000.0 if step_ms > 0 else 0.0,
            "domains": count([r.domain for r in batch]), "finished": finished, "errors": done.errors,
            "cost_profile": self.charged,
            "tree": self.config.tree_rules[self.tree_rules.index(plan)] if isinstance(plan, TreeRule) else None,
        }
        if isinstance(plan, dict):
            info["per_domain"] = {d: "off" if t is None else t for d, t in plan.items()}
        return info

    def render(self) -> str | None:
        if self.render_mode != "ansi" or self.view is None:
            return None
        t = self.totals
        return (f"step {self.steps}/{self.config.episode_steps}  clock {self.clock_ms / 1000:.2f} s  "
                f"batch {len(self.active)}  queue {len(self.queue)}  tokens {t.tokens}  "
                f"speedup {t.ref_ms / t.step_ms if t.step_ms else 1.0:.3f}x")

    def close(self) -> None:
        if self._runners:
            self._runners[0].store.flush()  # replay trees to disk
        super().close()

    # ----------------------------------------------------------------------------------------
    def _steady_batch(self, utilisation: float) -> float:
        """Requests target-only serving holds at this load (Little's law, solved by fixed-point iteration)."""
        cfg, rate = self.config, utilisation * self.capacity_rps
        b = 1.0
        context = cfg.prompt_tokens + cfg.max_new_tokens / 2
        for _ in range(20):
            per_step = self.cost_model.batch_ms("target", max(1, round(b)), 1, context)
            b = min(float(cfg.max_batch), rate * cfg.max_new_tokens * per_step / 1000.0)
        return b

    def _arrive(self) -> Request:
        domain, index, prompt = self.workload.draw(self._prompt_rng, self.episode_mix)  # None: the mix's weights
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

    def _wait_for_work(self, rate: float) -> float:
        """With nothing to decode, the clock jumps to the next arrival; returns the idle ms (not charged)."""
        if self.active or self.queue:
            return 0.0
        idle = (self._next_arrival - self._integrated) / rate * 1000.0
        self.clock_ms += idle
        self._integrated = self._next_arrival  # exactly (no rounding short of it)
        self._arrivals(0.0)
        return idle

    def _admissions(self) -> list[Request]:
        room = self.config.max_batch - len(self.active)
        return [self.queue.popleft() for _ in range(min(room, len(self.queue)))]

    def _admit(self, request: Request, warm: bool = False) -> None:
        """Start ``request`` in the batch: the target prefills its prompt (recorded in its runner's trace)."""
        cfg = self.config
        if self._free:
            runner = self._free.pop()
        else:
            runner = ReplayRunner(self.pair, self.cost_model, self.references, cfg.max_new_tokens,
                                  store=cfg.replay_store)
            runner.trace, runner.price_forwards = [], False  # the env prices the batch's forwards (clock.charge)
            self._runners.append(runner)
        request.runner, request.started_ms = runner, self.clock_ms
        # the session's runner.start() empties the trace; then the target's prefill is recorded in it
        request.session = BildSession(runner, request.prompt, cfg.max_new_tokens, self.pair.eos_token_ids,
                                      cfg.max_draft_len, None, cfg.score, self.predictor)
        if warm:  # a request already under way when the episode starts: some tokens in, by the target alone
            for _ in range(int(self._prompt_rng.integers(cfg.max_new_tokens - 1))):
                if request.session.done:
                    break
                request.session.step_off()
            runner.trace.clear()
        self.active.append(request)
        if self.on_admit is not None:
            self.on_admit(request)

    def _step_fn(self, request: Request, thresholds, depth: int | None = None):
        session = request.session

        def run():
            try:
                if thresholds is None:
                    return session.step_off()
                if isinstance(thresholds, TreeRule):
                    return session_tree_step(session, thresholds)
                if depth is not None:  # allocated: the batch's depth stops the run, not the price
                    return session.step(0.0, thresholds[1], depth)
                return session.step(*thresholds)
            except (RuntimeError, torch.OutOfMemoryError) as err:  # this request ends; the batch goes on
                return f"{type(err).__name__}: {err}"
        return run

    def _depth(self, batch: list[Request], price: float, context: float) -> int:
        """With ``allocate``: the depth the batch drafts to at ``price`` (``allocate_depth``), from each running
        request's draft run read ahead along the replay trees (what the server learns depth by depth as it drafts),
        at the step's ``context`` (as its forwards are charged), and scored as ``score`` scores a token (the max probability; ``oracle:W`` its mix with the target's
        agreement; the lookup scores the lookup predictor's chance)."""
        cfg = self.config
        weight = DraftScore(cfg.score, self.predictor).weight  # oracle:W's W (0 for the max probability)
        state = (self.steps, tuple((id(r), len(r.session.tokens)) for r in batch))
        if self._runs is not None and self._runs[0] == state:  # peek tries every action from one state: read once
            runs = self._runs[1]
        else:
            runs = []
            for r in batch:
                s = r.session
                if s.done:
                    continue
                run = r.runner.peek_run(s.tokens, min(cfg.max_draft_len, s.remaining), s.eos, agrees=weight > 0)
                if self.predictor is not None:  # the lookup predictor's chance, each proposal after the ones before
                    text, scored = list(s.tokens), []
                    for token, p, _ in run:
                        scored.append(self.predictor.probability(p, text, token))
                        text.append(token)
                    runs.append(scored)
                    continue
                runs.append([p if not weight else (1.0 - weight) * p + weight * a for _, p, a in run])
            self._runs = (state, runs)
        return allocate_depth(runs, price, self.cost_model, len(batch), context, cfg.max_draft_len,
                              self.loop is not None, self.loop)

    def _run(self, fns: list) -> list:
        """Run the requests' steps. With ``batch_fills``, after a step that missed the replay trees, as cooperative
        jobs whose misses run as batched forwards (``CoopBatcher``; ~1 ms of thread hand-offs per step, so warm
        steps, which miss nothing, run plainly)."""
        if not fns:
            return []
        counts = self._runners[0].store.counts
        misses = counts.misses
        if self.config.batch_fills and self._missed and active_batcher() is None and len(fns) > 1:
            results = CoopBatcher().run(fns)
        else:
            results = [fn() for fn in fns]
        self._missed = counts.misses > misses
        return results

    def _leave(self, batch: list[Request], results: list) -> tuple[list[dict], list[Request]]:
        finished, failed = [], []
        for request, result in zip(batch, results):
            if isinstance(result, str):
                failed.append(request)
            elif not request.session.done:
                continue
            else:
                new = len(request.session.new_ids)
                finished.append({"domain": request.domain, "prompt_index": request.prompt_index, "new_tokens": new,
                                 "new_ids": list(request.session.new_ids), "latency_ms": self.clock_ms - request.arrived_ms,
                                 "queued_ms": request.started_ms - request.arrived_ms,
                                 "regret_per_token": request.regret / max(new, 1)})
            self.active.remove(request)
            self._free.append(request.runner)
        return finished, failed

    def _progress(self) -> float:
        if not self.active:
            return 0.0
        n = self.config.max_new_tokens
        return sum(len(r.session.new_ids) for r in self.active) / (n * len(self.active))

    def _obs(self) -> np.ndarray:
        if self.config.observe_next:  # each running request's next proposal, read ahead (``ReplayRunner.peek_draft``)
            running = [r for r in self.active if not r.session.done]
            up_to = self.config.read_ahead_batch
            self.view.next_p = ([r.runner.peek_score(r.session.tokens, self.predictor) for r in running]
                                if not up_to or len(running) <= up_to else [])
        obs = self.view.observe()
        return np.concatenate([obs, self.costs_seen]).astype(np.float32) if self.config.observe_costs else obs

    def _check_action(self, action):
        arr = np.asarray(action)
        if self.config.action == "continuous":
            shape = self.action_space.shape
            if (arr.shape != shape or not np.issubdtype(arr.dtype, np.number) or not np.all(np.isfinite(arr))
                    or np.any(np.abs(arr) > 1.0 + 1e-6)):
                raise ValueError(f"BiLD-Serve-v0 continuous action must be {shape[0]} finite numbers in [-1, 1] "
                                 f"(fallback, rollback{', off > 0' if shape[0] == 3 else ''}), got {action!r}")
            return arr
        if self.config.per_domain:
            n, domains = self.n_actions, self.workload.domains
            if (arr.shape != (len(domains),) or not np.issubdtype(arr.dtype, np.integer)
                    or np.any(arr < 0) or np.any(arr >= n)):
                raise ValueError(f"BiLD-Serve-v0 with per_domain takes one integer in [0, {n}) per domain "
                                 f"{list(domains)} (in that order), got {action!r}")
            return arr.astype(np.int64)
        if arr.shape != () or not np.issubdtype(arr.dtype, np.integer) or not self.action_space.contains(arr.item()):
            raise ValueError(f"BiLD-Serve-v0 action must be an integer in [0, {self.action_space.n}) (fallback index * "
                             f"{len(self.config.rollback_values)} + rollback index"
                             f"{f'; {self.n_grid} = speculation off' if self.config.off_switch else ''}"
                             f"{f'; {self.first_tree}-{self.action_space.n - 1} = the tree rules' if self.tree_rules else ''}"
                             f"), got {action!r}")
        return int(arr.item())


