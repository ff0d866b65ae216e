"""The Gymnasium environment ``BiLD-Serve-v0``: BiLD for a batch of concurrent requests under a moving load.

What it shares with ``BiLD-v1`` is in ``bild_env.base.BaseEnv``, its arguments and their checks in
``bild_env.serving.config``, what an action means in ``bild_env.actions`` (decoded once into a ``Plan``), the requests'
arrivals, queue and batch in ``bild_env.serving.server``, a request's life and the episode's totals in
``bild_env.serving.episode``, what a step is charged in ``bild_env.serving.clock``.
``step`` reads as its ladder: prepare (arrivals, admissions) -> decode -> run the requests -> charge -> reward ->
advance -> observation and info.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
from gymnasium import spaces

from bild_env.actions import Action, Plan
from bild_env.base import BaseEnv
from bild_env.decoding.costs import load_or_calibrate_batched
from bild_env.decoding.profiles import MACHINE, CostProfile, load_profile, vary
from bild_env.draft_cap import AUTO, SERVE_EPISODES, SERVE_STEPS, choose_draft_cap
from bild_env.ids import SERVE_ID
from bild_env.serving import clock
from bild_env.serving.config import DEFAULT_LOAD, DEFAULT_MIX, ServingConfig, validate
from bild_env.serving.load import LoadProfile
from bild_env.serving.episode import Failure, Join, Request, StepTally, Totals, resume_join
from bild_env.serving.observations import ServingView, cost_features, observation_space
from bild_env.replay.dataset import first_time
from bild_env.serving.server import Server
from bild_env.serving.workload import Workload

logger = logging.getLogger(__name__)

# what callers import from here: the env's config, its defaults and check, and a request as a decoder joins it
__all__ = ["DEFAULT_LOAD", "DEFAULT_MIX", "Join", "Request", "ServingConfig", "ServingEnv", "resume_join", "validate"]


class ServingEnv(BaseEnv):
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
    Set by the ``actions`` argument (``bild_env.config.ActionOptions``, as ``BiLD-v1``'s; ``off_switch`` on here).
    ``Discrete(len(fallback_values) * len(rollback_values) + 1)`` with ``off_switch`` (the default;
    ``Discrete(26)``; replaying a decoding dataset with no model, the rollback values default to the lossless ones it
    answers, ``Discrete(6)``, unless ``pair_options={"load_on_miss": True}``): ``a < 25`` is BiLD with ``fallback = fallback_values[a // 5]``, ``rollback =
    rollback_values[a % 5]`` (BiLD-v1's grid: fallback in (0.103, 0.25, 0.35, 0.45, 0.6), rollback in
    (0.5, 1.0, 1.5, 2.5, 4.697) nats); ``a = 25`` turns speculation off for the step: every request's
    target emits one token alone, no draft forward. With ``space="continuous"``: ``Box(-1, 1, (3,))``,
    fallback linear and rollback log-scale over the grids' spans, and the third number > 0 turns
    speculation off (``Box(2,)`` without ``off_switch``). With ``per_domain``: ``MultiDiscrete([26] * len(domains))``,
    one such action per domain of the workload (``workload.domains`` order); each request of the batch takes its own
    domain's (an endpoint that knows what each request is; the batch's verification stays one forward, its rows padded
    to the longest draft run). ``info["per_domain"]`` says what each domain got. With ``tree_rules`` (discrete, not
    ``per_domain``) one more action per rule follows the off switch: every request of the batch takes one lossless
    token-tree step by that rule (``bild_env.decoding.tree``: its draft grows a tree, the target verifies every
    request's tree in the step's batched verification, each request commits the path its target agrees with and its own
    next token), answered from the replay trees and charged as the batch's forwards (each level of the draft's tree one
    forward, fed that level's nodes; the verification fed the root and every node). Such a step shows thresholds (0, 0)
    and ``info["tree"]`` names its rule (None on other steps).

    ## Observation Space
    ``Box(14,)`` float32 (``+ len(domains)`` with ``per_domain``, ``+ 3`` with ``observe`` ``next``, ``+ 3`` with its
    ``costs``); see ``bild_env.serving.observations``:

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
    | 14.. | with per_domain: share of each domain (``workload.domains`` order) in the batch | 0 | 1 |
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

    ## Rewinding
    ``prepare()`` does the part of the next step no action changes (idle time to the next arrival, admissions) once: a
    caller that wants to see the batch (``active``) before it acts calls it first. ``snapshot()`` / ``restore(saved)``
    save and put back everything a step changes (the requests' sessions and runners, the arrival streams, the clock),
    and ``peek(actions)`` returns what each action's step would give on the same batch (observations, rewards,
    truncated), the episode left as it was. The protocol, ``peek`` and the argument, action and render checks are both
    envs' (``bild_env.base.BaseEnv``).

    ## Arguments
    See ``ServingConfig`` (every argument, with defaults). Five are sub-configs, each a dict of its keys (the env's
    defaults for those left out; or its class): ``pair_options`` and ``reward``, as ``BiLD-v1``'s, ``actions``, as
    ``BiLD-v1``'s with the off switch on and ``per_domain`` (``ServingActions``), ``charging``, what a step is charged
    beyond the forwards (the decoder's own work, the read-ahead, a machine drawn per episode; ``Charging``), and
    ``observe``, what the observation holds beyond its base numbers (the next proposals' scores, the hardware's costs)
    and how it reads the batch size (``Observe``).
    ``gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random", mix="prose:1")`` runs offline in seconds.

    ## Version History
    * v0: batched BiLD steps under continuous batching, load profiles, a mixed workload and the off switch
      (``per_domain``, an action per domain, added later as an option; so were ``score``, what each request's
      fallback threshold reads, and ``observe_next``, three more observations; ``cost_profile``, another machine's
      costs charged, and ``train_profiles`` / ``vary_profiles`` / ``observe_costs``, a drawn machine per episode and
      three more observations of what it charges; ``tree_rules``, token-tree steps as actions; the default spaces
      unchanged). ``action``, the grids, ``off_switch``, ``tree_rules``, ``per_domain``, ``max_draft_len`` and
      ``score`` are now keys of ``actions``, ``observe_next`` and ``observe_costs`` of ``observe`` (``next``,
      ``costs``); given flat, they are folded in with a DeprecationWarning.
    """

    Config = ServingConfig

    def __init__(self, render_mode: str | None = None, **kwargs) -> None:
        super().__init__(render_mode, **kwargs)  # the arguments, the pair, the references, the actions (``BaseEnv``)
        cfg = self.config
        self.workload = cfg.workload or Workload(self.pair.tokenizer, cfg.mix, cfg.split, cfg.prompt_tokens,
                                                 cfg.max_prompts, code_source=cfg.code_source)
        longest = max((len(p) for d in self.workload.domains for p in self.workload.prompts[d]), default=0)
        if longest + cfg.max_new_tokens > self.pair.max_positions:
            raise ValueError(f"a prompt of {longest} tokens + max_new_tokens exceeds the models' "
                             f"{self.pair.max_positions} positions; lower max_new_tokens or leave long inputs out of the mix")
        cost_model = self._cost_model(load_or_calibrate_batched)
        self.server = Server(cfg, self.pair, self.references, self.predictor, self.workload)
        self.action_space = self._action_space()
        self.observation_space = observation_space(len(self.workload.domains) if cfg.actions.per_domain else 0,
                                                   cfg.observe.next, cfg.observe.costs)
        self._charge(cost_model, self.cost_profile.name if self.cost_profile else None)
        if cfg.actions.max_draft_len == AUTO:  # the cap chosen on validation under the costs charged
            cfg.actions = replace(cfg.actions, max_draft_len=choose_draft_cap(self)[0])
        self.loop = clock.BatchLoop(*cfg.charging.charge_loop) if cfg.charging.charge_loop else None  # the decoder's own work, charged
        self.view: ServingView | None = None
        self._prepared: tuple[float, float, float] | None = None  # a step's admissions done (by peek)

    @classmethod
    def _id_for(cls, values: dict) -> str:
        return SERVE_ID

    def _arguments(self, kwargs: dict) -> ServingConfig:
        """``BaseEnv``'s, where ``max_batch`` is not given and the ``cost_profile`` timed smaller batches than its
        default: the profile's largest batch (said once); a ``max_batch`` given is checked against it as before."""
        spec, default = kwargs.get("cost_profile"), ServingConfig().max_batch
        if "max_batch" not in kwargs and isinstance(spec, str | Path):
            try:
                largest = load_profile(spec).largest_batch
            except (ValueError, OSError):  # a profile that cannot be read: validate names it
                largest = default
            if largest < default:
                if first_time(("max_batch", spec, largest)):
                    logger.warning("cost profile %s has timed batches of up to %d sequences: max_batch %d (the "
                                   "default is %d)", spec, largest, largest, default)
                kwargs = kwargs | {"max_batch": largest}
        return super()._arguments(kwargs)

    def _cap_runs(self, kwargs: dict) -> list[tuple]:
        steps = min(self.config.episode_steps, SERVE_STEPS)  # each level as a constant load, a moving profile as it is
        return [(type(self)(**kwargs | {"load": load, "episode_steps": steps}), [{"seed": s} for s in SERVE_EPISODES])
                for load in LoadProfile.level_loads(self.config.load)]

    def _validate(self, cfg: ServingConfig) -> None:
        self.load_shape = validate(cfg)  # the load profile (LoadProfile): how utilisation moves; not a cost profile

    def _cost_profile(self) -> CostProfile | None:
        """``cost_profile``'s, else with ``train_profiles`` the first of them (each episode draws its own; ``validate``
        checked each has timed batches of ``max_batch``)."""
        profile = super()._cost_profile()
        self.train_profiles = [load_profile(p) for p in self.config.charging.train_profiles]
        return profile or (self.train_profiles[0] if self.train_profiles else None)

    def _action_space(self) -> spaces.Space:
        if self.config.actions.per_domain:  # discrete (``validate``): one action of a request per domain
            return spaces.MultiDiscrete([self.n_chain_actions] * len(self.workload.domains))
        return super()._action_space()

    started = property(lambda self: self.view is not None, doc="``reset`` has run.")
    ended = property(lambda self: self.steps >= self.config.episode_steps, doc="The episode has run its steps.")

    # the episode's requests (``bild_env.serving.server``), as callers read them
    active = property(lambda self: self.server.active, doc="The requests in the batch (decoding).")
    queue = property(lambda self: self.server.queue, doc="The requests waiting to join the batch.")
    clock_ms = property(lambda self: self.server.clock_ms, doc="The simulated clock (ms since reset).")

    def _charge(self, cost_model, name: str | None) -> None:
        """Charge ``cost_model`` (named ``name``; None: this machine's) from now on: target-only capacity (requests per
        second a full batch of target-only decoding completes: the load's unit), the reward's normaliser, and what
        the hardware observation reads (``cost_features``)."""
        cfg = self.config
        self.cost_model, self.charged = cost_model, name or MACHINE
        self.server.use_costs(cost_model)
        context = cfg.prompt_tokens + cfg.max_new_tokens / 2
        self.capacity_rps = clock.capacity_rps(cost_model, cfg.max_batch, cfg.max_new_tokens, context)
        self.norm_ms = cfg.max_new_tokens * cost_model.batch_ms("target", 1, 1, context)
        self.costs_seen = cost_features(cost_model, cfg.max_batch, context)

    def _draw_costs(self) -> None:
        """With ``train_profiles``: this episode's hardware, one of them (varied with ``vary_profiles``)."""
        cfg = self.config
        profile = self.train_profiles[int(self.np_random.integers(len(self.train_profiles)))]
        if cfg.charging.vary_profiles > 1.0:
            span = math.log(cfg.charging.vary_profiles)
            profile = vary(profile, *np.exp(self.np_random.uniform(-span, span, size=3)).tolist())
        self._charge(profile.model, profile.name)

    # ----------------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if options:
            raise ValueError(f"BiLD-Serve-v0 reset takes no options, got {sorted(options)}")
        cfg = self.config
        self.load = self.load_shape.start(self.np_random)
        self.steps, self._prepared = 0, None
        seeds = self.np_random.integers(2**63, size=2)  # the arrivals' and the prompts' streams (``Server``)
        self.episode_mix = None  # with mix_draw: this episode's domain weights (from the env's seeded stream)
        if cfg.mix_draw > 0:
            w = np.array([self.workload.weights[d] for d in self.workload.domains], dtype=float)
            self.episode_mix = self.np_random.dirichlet(cfg.mix_draw * len(w) * w / w.sum())
        if self.train_profiles:
            self._draw_costs()
        self.server.start(seeds, self.episode_mix)
        self.view = ServingView(cfg.max_batch, cfg.actions.max_draft_len, max(cfg.actions.rollback_values),
                                cfg.max_new_tokens, self.workload.domains if cfg.actions.per_domain else (),
                                cfg.observe.batch_scale, foresee=cfg.observe.next)
        self.totals = Totals(self.workload.domains)
        u = self.load.utilisation(0.0)
        self.server.start_warm(clock.steady_batch(self.cost_model, u * self.capacity_rps, cfg.max_batch,
                                                  cfg.max_new_tokens, cfg.prompt_tokens + cfg.max_new_tokens / 2))
        active = self.server.active
        self.view.begin([len(r.prompt) for r in active], self.server.progress(), [r.domain for r in active])
        self.view.arrivals(u * self.capacity_rps, self.capacity_rps)
        info = {"utilisation": u, "arrival_rate": u * self.capacity_rps, "batch_size": len(active),
                "cost_profile": self.charged}
        if self.episode_mix is not None:
            info["mix"] = dict(zip(self.workload.domains, self.episode_mix.tolist()))
        return self._obs(), info

    def prepare(self) -> tuple[float, float, float]:
        """The part of a step no action changes: idle time to the next arrival, admissions (their prefills
        recorded). Done once per step (``peek`` and the ``step`` after it share it; calling it again before the
        step returns the same); returns (utilisation, arrival rate, idle ms). A caller that wants to see the
        batch the next step decodes (``self.active``) before choosing its action calls it first."""
        if self._prepared is None:
            u = self.load.utilisation(self.steps / self.config.episode_steps)
            rate = u * self.capacity_rps  # requests per second
            idle_ms = self.server.wait_for_work(rate)
            self.server.admit_waiting()
            self._prepared = (u, rate, idle_ms)
        return self._prepared

    def plan(self, action) -> Plan:
        """What a checked action sets for the batch (``bild_env.actions.Plan``): one ``Action`` for every request,
        or with ``per_domain`` one per domain, each request taking its domain's."""
        if self.config.actions.per_domain:
            return Plan(by_domain={d: self.decode(int(a)) for d, a in zip(self.workload.domains, action)})
        return Plan(shared=self.decode(action))

    def _step(self, prepared: tuple[float, float, float], plan: Plan):
        """The step under ``plan`` once ``prepare`` has run (its arrivals and admissions: ``prepared``)."""
        u, rate, idle_ms = prepared
        self._prepared, cfg = None, self.config
        batch = list(self.server.active)
        # 1. decode: each request's action
        each = plan.each([r.domain for r in batch])
        context = clock.step_context([len(r.session.tokens) - 1 for r in batch], self.loop is not None,
                                     cfg.prompt_tokens)
        # 2. run the requests' steps, each on its own replay runner, and sum what they did
        results = self.server.run(batch, each)
        done = self._tally(batch, each, results)
        # 3. charge: the step's batched forwards, and target-only decoding's for the same tokens
        read_ahead = len(self.view.next_p) if cfg.observe.next else 0  # rows whose next proposal was read ahead
        step_ms, ref_ms = clock.step_charge(self.cost_model, done.traces, done.new_tokens, context, self.loop,
                                            read_ahead, cfg.max_batch)
        # 4. reward: the time saved against target-only serving at this load, minus the quality charge
        reward = self._reward(ref_ms, step_ms, self._regret_charge(done.regret))
        # 5. advance: the clock, arrivals and departures; the totals and the view take the step in
        shown = plan.shown(each, (self.view.fallback, self.view.rollback, self.view.off))
        finished, failed = self._advance(batch, results, shown, done, step_ms, ref_ms, rate, idle_ms)
        truncated = self.steps >= cfg.episode_steps or (bool(batch) and len(failed) == len(batch)
                                                        and not self.active and not self.queue)
        # 6. observation and info: what the step chose (``Plan.info``), cost and did
        info = {**plan.info(shown), "batch_size": len(batch), "queue": len(self.queue), "utilisation": u,
                "arrival_rate": rate, "step_ms": step_ms, "ref_ms": ref_ms, "idle_ms": idle_ms,
                "committed": done.new_tokens, "proposed": done.proposed, "accepted": done.accepted,
                "regret": done.regret, "mismatches": done.mismatches,
                "goodput_tok_s": done.new_tokens / step_ms * 1000.0 if step_ms > 0 else 0.0,
                "domains": dict(Counter(r.domain for r in batch)), "finished": finished, "errors": done.errors,
                "cost_profile": self.charged}
        if truncated:
            info["episode_summary"] = self.totals.summary()
        return self._obs(), float(reward), False, truncated, info

    def _tally(self, batch: list[Request], each: list[Action], results: list) -> StepTally:
        """What the requests' steps did, summed (and added to each request's regret and the episode's totals); a
        BiLD step's draft run stopped somewhere (observation 13; off and tree steps keep its last value)."""
        done = StepTally()
        for request, action, result in zip(batch, each, results):
            done.traces.append(list(request.runner.trace))
            if isinstance(result, Failure):  # the models failed: this request ends
                done.errors.append({"domain": request.domain, "prompt_index": request.prompt_index,
                                    "error": result.error})
                continue
            done.new_tokens += result.new_tokens
            done.regret += result.regret
            done.mismatches += result.mismatches
            done.proposed += result.proposed
            done.accepted += result.accepted
            request.regret += result.regret
            self.totals.add(request.domain, result)
            if (result.proposed or result.fallbacks) and action.drafts_a_run:
                done.stops.append(request.session.draft_p)
        return done

    def _advance(self, batch: list[Request], results: list, shown: tuple[float, float, float], done: StepTally,
                 step_ms: float, ref_ms: float, rate: float, idle_ms: float) -> tuple[list[dict], list[Request]]:
        """The clock moves by the step; arrivals during it queue; finished and failed requests leave; the totals and
        what the agent observes take the step in (``shown``: the thresholds it shows, ``Plan.shown``). Returns the
        finished (as ``info`` lists them) and the failed."""
        arrived = self.server.advance(step_ms, rate)
        finished, failed = self.server.leave(batch, results)
        self.steps += 1
        self.totals.step(step_ms, ref_ms, done.new_tokens, len(batch))
        active = self.server.active
        self.view.after_step(decoding=len(batch), queue=len(self.queue), proposed=done.proposed,
                             accepted=done.accepted, tokens=done.new_tokens, step_ms=step_ms, ref_ms=ref_ms,
                             shown=shown, prompt_lens=[len(r.prompt) for r in active], progress=self.server.progress(),
                             regret=self.totals.regret, generated=self.totals.tokens, stops=done.stops,
                             domains=[r.domain for r in active])
        self.view.arrivals(arrived / (step_ms + idle_ms) * 1000.0 if step_ms + idle_ms > 0 else rate,
                           self.capacity_rps)
        return finished, failed

    def _obs(self) -> np.ndarray:
        if self.config.observe.next:  # each running request's next proposal, read ahead (``ReplayRunner.peek_draft``)
            running = [r for r in self.active if not r.session.done]
            up_to = self.config.charging.read_ahead_batch
            self.view.next_p = ([r.runner.peek_score(r.session.tokens, self.predictor) for r in running]
                                if not up_to or len(running) <= up_to else [])
        obs = self.view.observe()
        return np.concatenate([obs, self.costs_seen]).astype(np.float32) if self.config.observe.costs else obs

    def snapshot(self) -> dict:
        """Everything a step changes (the env's, and the server's: its requests' sessions and runners, its arrival
        streams), by name, for ``restore``: a caller may try things on the running episode (read ahead, step) and put
        it back as it was."""
        return {"steps": self.steps, "prepared": self._prepared,
                "view": replace(self.view, shares=list(self.view.shares)), "totals": self.totals.copy(),
                "server": self.server.snapshot()}

    def restore(self, saved: dict) -> None:
        """Put the episode back as ``snapshot`` saw it."""
        self.steps, self._prepared = saved["steps"], saved["prepared"]
        self.view = replace(saved["view"], shares=list(saved["view"].shares))
        self.totals = saved["totals"].copy()
        self.server.restore(saved["server"])

    def _text(self) -> str:
        t = self.totals
        return (f"step {self.steps}/{self.config.episode_steps}  clock {self.clock_ms / 1000:.2f} s  "
                f"batch {len(self.active)}  queue {len(self.queue)}  tokens {t.tokens}  "
                f"speedup {t.ref_ms / t.step_ms if t.step_ms else 1.0:.3f}x")

    def _trees(self):
        return self.server.runners[0].store if self.server.runners else None

    def _check_action(self, action):
        """``BaseEnv._check_action``; with ``per_domain``, one integer per domain, as int64."""
        if not self.config.actions.per_domain:
            return super()._check_action(action)
        arr, domains = np.asarray(action), self.workload.domains
        if (arr.shape != (len(domains),) or not np.issubdtype(arr.dtype, np.integer)
                or np.any(arr < 0) or np.any(arr >= self.n_chain_actions)):
            raise ValueError(f"{self.env_id} with per_domain takes one integer in [0, {self.n_chain_actions}) per domain "
                             f"{list(domains)} (in that order), got {action!r}")
        return arr.astype(np.int64)
