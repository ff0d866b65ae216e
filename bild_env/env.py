"""The Gymnasium environments ``BiLD-v1`` and ``BiLD-v0`` (the paper's setting): a step is one BiLD decoding step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, is_dataclass, replace

import numpy as np
import torch

from bild_env.actions import Action
from bild_env.base import BaseEnv, check_common
from bild_env.config import CommonConfig, Reward
from bild_env.decoding.bild import FIXED_FALLBACK, FIXED_ROLLBACK, BildSession, check_score
from bild_env.decoding.costs import CostModel, load_or_calibrate
from bild_env.prompts.sources import load_prompts
from bild_env.models.pairs import get_preset
from bild_env.reference import ReferenceStore, prefix_bleu
from bild_env.decoding.runner import LiveRunner
from bild_env.decoding.tree import TreeRunner
from bild_env.draft_cap import AUTO, choose_draft_cap
from bild_env.migrate import folded
from bild_env.observations import OBSERVATIONS, EpisodeView, observation_space, observe
from bild_env.replay.runner import ReplayRunner

# BiLD-v0, the paper's setting: its grid (fixed pair = action 7), 7-number state and BLEU reward.
PAPER_SETTING = {"actions": {"fallback_values": (0.03, 0.103, 0.2, 0.35, 0.6),
                             "rollback_values": (1.0, 3.0, 4.697, 6.0, 8.0)},
                 "reward": {"quality": "bleu"}, "observation": "paper"}
LATENCY_MODES = ("model", "wall")
QUALITY_SIGNALS = ("bleu", "regret")


@dataclass(frozen=True)
class BildReward(Reward):
    """``BiLD-v1``'s reward: both envs' weights (``bild_env.config.Reward``), then its quality term and the BLEU's
    weight (``quality="bleu"``)."""

    bleu_weight: float = field(default=2.0, metadata={"help": (
        'weight of the BLEU lost (per 100 BLEU points), with quality="bleu"')})
    quality: str = field(default="regret", metadata={"help": (
        'the quality term: "regret" (read from the verification) or "bleu" (vs the greedy reference)')})


@dataclass
class EnvConfig(CommonConfig):
    """Every argument of ``BiLD-v1`` with its default (``gymnasium.make`` keyword arguments; BiLD-v0: PAPER_SETTING's):
    those both envs take (``bild_env.config.CommonConfig``), then its own."""

    reward: BildReward = field(default_factory=BildReward, metadata={"help": (
        "the reward's weights and quality term (a dict of BildReward's fields)")})
    dataset: str | Sequence[str] | None = field(default=None, metadata={"help": (
        "builtin | wikitext | wiki | a text file | a list (default: the preset's)")})
    latency: str = field(default="model", metadata={"help": (
        '"model": calibrated cost model (deterministic); "wall": measured')})
    backend: str = field(default="live", metadata={"help": (
        '"live": run the models; "replay": answer from the prefix tree')})
    observation: str = field(default="paper", metadata={"help": (
        '"paper": the paper\'s 7 numbers; "rich": also what the last step did (14); "context": also the draft\'s '
        "calibration on this text (17)")})


class BildEnv(BaseEnv):
    """BiLD speculative decoding whose fallback and rollback thresholds are chosen at every step.

    An episode generates ``max_new_tokens`` tokens (or up to EOS) after one prompt with BiLD: a
    small draft model proposes tokens until its confidence drops below the *fallback* threshold
    (or it has proposed ``max_draft_len``), then the large target model verifies them in one
    forward and *rolls back* the first one whose cross-entropy exceeds the rollback threshold.
    Each step is one such draft phase plus verification, under the thresholds the action picks.

    ## Action Space
    Set by the ``actions`` argument (``bild_env.config.ActionOptions``: the grids, ``space``, ``off_switch``,
    ``tree_rules``). ``Discrete(25)``: ``fallback = fallback_values[a // 5]``, ``rollback = rollback_values[a % 5]``.
    BiLD-v1 (the defaults): fallback (probability) in ``(0.103, 0.25, 0.35, 0.45, 0.6)``, rollback
    (nats) in ``(0.5, 1.0, 1.5, 2.5, 4.697)``; action 4 is BiLD's fixed (0.103, 4.697). BiLD-v0 (the
    paper's): fallback in ``(0.03, 0.103, 0.2, 0.35, 0.6)``, rollback in ``(1.0, 3.0, 4.697, 6.0, 8.0)``;
    action 7 is the fixed pair. Grids of other sizes give ``Discrete(len(fallback_values) *
    len(rollback_values))``. With ``space="continuous"``: ``Box(-1, 1, (2,))``, mapped to a fallback
    linear over ``[min, max]`` of ``fallback_values`` and a rollback on a log scale over ``[min, max]``
    of ``rollback_values`` (v1: 0.103-0.6 and 0.5-4.697 nats; -1 the smallest, +1 the largest). On
    ``backend="replay"`` replaying a decoding dataset with no model, the rollback values default to the lossless ones it
    answers (``Discrete(5)``), unless ``pair_options={"load_on_miss": True}``.
    With ``off_switch=True`` one more action turns speculation off for the step (the target emits one
    token alone, no draft forward; the draft catches up on what it missed at its next forward): the
    last index of the grid (``Discrete(26)``), or with ``space="continuous"`` a third number > 0
    (``Box(3,)``). The observation then shows fallback 1 and rollback 0 as the previous thresholds.
    With ``tree_rules`` (discrete actions; live, or answered from the replay trees) one more action per rule follows (after the off switch):
    a lossless token-tree step by that rule (``bild_env.decoding.tree``: the draft grows a tree, the target
    verifies it in one forward and commits the path it agrees with and its own next token), so
    ``Discrete(25 + len(tree_rules))`` (+1 with ``off_switch``). The observation then shows fallback 0 and
    rollback 0 as the previous thresholds; ``info["tree"]`` names the rule (None on other steps).

    ## Observation Space
    ``Box(7,)`` float32 with ``observation="paper"`` (the paper's state), ``Box(14,)`` with ``"rich"``,
    ``Box(17,)`` with ``"context"``, ``Box(18,)`` with ``"foresee"`` (the replay backend only):

    | index | observation | min | max |
    |---|---|---|---|
    | 0 | mean accepted length so far: tokens per target forward / (max_draft_len + 1) | 0 | 1 |
    | 1 | BLEU so far / 100 (output vs the target's greedy output cut to the same length) | 0 | 1 |
    | 2 | latency per generated token so far / target-only latency for the same tokens (1 before the first step; clipped) | 0 | 2 |
    | 3 | previous fallback threshold (BiLD's 0.103 at reset) | 0 | 1 |
    | 4 | previous rollback threshold / max(rollback_values) (4.697 at reset) | 0 | 1 |
    | 5 | prompt length / prompt_tokens | 0 | 1 |
    | 6 | fraction of max_new_tokens generated | 0 | 1 |
    | 7 | rich: last step's draft tokens proposed / max_draft_len | 0 | 1 |
    | 8 | rich: last step's share of them the target kept (0 when none was proposed) | 0 | 1 |
    | 9 | rich: the last draft run ended by fallback (1) or not (0) | 0 | 1 |
    | 10 | rich: the last verification rolled a draft token back | 0 | 1 |
    | 11 | rich: the draft's max probability where its last run stopped (1 at reset) | 0 | 1 |
    | 12 | rich: recent acceptance, a moving average of the steps' kept shares (1/2 at reset) | 0 | 1 |
    | 13 | rich: regret so far, nats per generated token / 2 | 0 | 1 |
    | 14 | context: the draft's accuracy on this text so far (its predictions the verifications judged equal to the target's argmax; smoothed) | 0 | 1 |
    | 15 | context: the draft's mean max probability over those predictions (smoothed) | 0 | 1 |
    | 16 | context: the accuracy of its predictions made with max probability below 1/2 (smoothed) | 0 | 1 |
    | 17 | foresee: the draft's max probability for its next proposal, the first the next step drafts (1 when done; with a lookup ``score``, the lookup predictor's chance for it) | 0 | 1 |

    ## Rewards
    Per step, ``latency_weight * (T_ref - T_step) / T_norm - Q``, with the quality term ``Q`` chosen by
    ``reward``'s ``quality``: ``"bleu"`` (the paper's): ``bleu_weight * (BLEU_prev - BLEU_now) / 100``; ``"regret"``:
    ``regret_weight * R_step / max_new_tokens``, where ``R_step`` sums, over the draft tokens the step's
    verification kept, the target's log-probability gap (nats) between its own argmax and the kept
    token, read from that verifying forward (0 for a token equal to the argmax, so a lossless step is
    never charged, whatever the rounding of the dtype). Here ``T_step`` is the step's latency (cost
    model or wall clock, by ``latency``), ``T_ref`` the cost-model time target-only decoding takes for
    the tokens the step committed, and ``T_norm`` the target-only time for ``max_new_tokens`` tokens
    after the prompt. Over an episode the first term
    sums to the share of target-only time saved and the second to the BLEU lost at the end (or the
    mean regret per token), so the return ranks policies by latency per generated token, with lost
    quality charged. ``info`` carries both signals at every step (``bleu``, ``regret``, ``mismatches``).
    The prefill (the same for every policy) is not rewarded.

    ## Starting State
    ``reset`` draws a prompt from the split with the env's RNG (or takes ``options={"prompt_index": i}``),
    computes (or loads) its reference continuation, prefills the target, which commits the first token.

    ## Episode End
    ``terminated`` at EOS or when ``max_new_tokens`` tokens are committed (at most ``max_new_tokens``
    steps; when the prefill's token already ends the generation, the first step decodes nothing and
    terminates with reward 0). ``truncated`` only through a ``TimeLimit`` wrapper, or when the models fail during a step
    (e.g. out of memory): the episode then ends with ``info["error"]`` instead of the exception.
    At the end ``info["episode_summary"]`` holds the episode's latency per sentence (ms),
    acceptance rate, mean accepted length, BLEU, regret (nats per token), fidelity (share of tokens
    equal to the target's argmax) and mean thresholds.

    ## Rewinding
    With ``backend="replay"`` (a live env's KV caches cannot be rewound), ``snapshot()`` saves what a step changes and
    ``restore(saved)`` puts it back; ``peek(actions)`` returns what each action's step would give from the current
    state (observations, rewards, terminated), the episode left as it was. ``prepare()``, the part of a step no action
    changes, does nothing here. The protocol, ``peek`` and the argument, action and render checks are both envs'
    (``bild_env.base.BaseEnv``).

    ## Arguments
    See ``EnvConfig`` (every argument, with defaults). Three are sub-configs, each a dict of its keys (the env's
    defaults for those left out; or its class): ``pair_options``, how the pair loads (other models, device, dtype, lean
    forward, draft vocabulary; ``bild_env.config.PairOptions``), ``actions``, the action space (above;
    ``ActionOptions``), and ``reward``, its weights and quality term (``BildReward``). ``BiLD-v0`` is registered as
    ``paper_env``, which puts an ``actions`` or ``reward`` dict over the paper's keys (``gymnasium.make`` alone would
    drop them).
    ``gymnasium.make("bild_env:BiLD-v1", pair="tiny-random")`` runs offline in seconds on built-in prompts.

    ## Version History
    * v1: the reward's quality term is the regret read from the verification (``quality="regret"``,
      weight 10), not BLEU against a greedy reference that charges lossless decoding for rounding in
      bfloat16/float16; threshold grids chosen from measurement (above). ``observation="rich"`` is
      available in both versions, as are ``observation="foresee"``, ``score``, ``cost_profile`` (another
      machine's costs charged), ``tree_rules`` (token-tree steps as actions) and ``max_draft_len="auto"`` (the cap
      chosen on validation from the costs charged, ``bild_env.draft_cap``), added later as options (the default
      spaces unchanged). The grids, ``action`` (now ``space``), ``off_switch``, ``tree_rules``,
      ``max_draft_len`` and ``score`` moved into the ``actions`` sub-config, ``quality`` into ``reward`` (given flat,
      they are folded in with a DeprecationWarning).
    * v0: the paper's setting (``PAPER_SETTING``: its grids, the 7-number state, the BLEU reward).
    """

    Config = EnvConfig

    def __init__(self, render_mode: str | None = None, **kwargs) -> None:
        super().__init__(render_mode, **kwargs)  # the arguments, the pair, the references, the actions (``BaseEnv``)
        cfg = self.config
        dataset = cfg.dataset if cfg.dataset is not None else get_preset(cfg.pair).dataset
        self.prompts = load_prompts(self.pair.tokenizer, dataset, cfg.split, cfg.prompt_tokens, limit=cfg.max_prompts)
        too_long = cfg.prompt_tokens + cfg.max_new_tokens - self.pair.max_positions
        if too_long > 0:
            raise ValueError(f"prompt_tokens + max_new_tokens exceeds the models' {self.pair.max_positions} positions "
                             f"by {too_long}; lower one of them")
        self.cost_model = self._cost_model(load_or_calibrate)
        self.runner = _make_runner(cfg, self.pair, self.cost_model, self.references)
        if cfg.actions.max_draft_len == AUTO:  # the cap chosen on validation under the costs charged
            cfg.actions = replace(cfg.actions, max_draft_len=choose_draft_cap(self)[0])
        self._bleu_memo: dict[tuple, float] = {}
        self.action_space = self._action_space()
        self.observation_space = observation_space(cfg.observation)
        self.session: BildSession | None = None
        self.ended = False

    @classmethod
    def _id_for(cls, values: dict) -> str:
        return setting_id(values)

    def _cap_runs(self, kwargs: dict) -> list[tuple]:
        twin = type(self)(**kwargs)  # an episode per validation prompt
        return [(twin, [{"options": {"prompt_index": p}} for p in range(len(twin.prompts))])]

    def _validate(self, cfg: EnvConfig) -> None:
        validate(cfg)

    started = property(lambda self: self.session is not None, doc="``reset`` has run.")

    # ----------------------------------------------------------------------------------------
    def thresholds(self, action) -> tuple[float, float] | None:
        """(fallback, rollback) selected by ``action`` (a grid index, or with ``space="continuous"`` two numbers in
        [-1, 1]: -1 the smallest of ``fallback_values`` / ``rollback_values``, +1 the largest, fallback linear
        between them and rollback on a log scale); None for speculation off (``off_switch``) or a tree action
        (``tree_rule``). A ValueError, as ``step`` gives, for an action outside the action space."""
        return super().thresholds(self._check_action(action))

    def shown_thresholds(self, action) -> tuple[float, float]:
        """The thresholds a step of ``action`` shows (the observation's previous thresholds, ``info``): the grid's
        pair, ``OFF_THRESHOLDS`` for speculation off, ``TREE_THRESHOLDS`` for a tree action (``Action.shown``)."""
        return self.decode(action).shown

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        unknown = sorted(set(options) - {"prompt_index"})
        if unknown:  # a typo would otherwise draw a random prompt without a word
            raise ValueError(f"unknown reset option(s) {unknown}; the one option is 'prompt_index'")
        index = options.get("prompt_index")
        if index is None:
            index = int(self.np_random.integers(len(self.prompts)))
        elif isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < len(self.prompts):
            raise ValueError(f"options['prompt_index'] must be an integer in [0, {len(self.prompts)}) (a prompt of the "
                             f"{self.config.split} split), got {index!r}")
        self.prompt_index = int(index)
        prompt = self.prompts[self.prompt_index]
        self.reference = self.references.get(prompt)
        cfg = self.config
        self.session = BildSession(self.runner, prompt, cfg.max_new_tokens, self.pair.eos_token_ids,
                                   cfg.actions.max_draft_len, self.pair.device, cfg.actions.score, self.predictor)
        self.ended = False
        self.bleu = self._bleu()
        self.prev = (FIXED_FALLBACK, FIXED_ROLLBACK)
        self.view = EpisodeView(cfg.actions.max_draft_len, cfg.prompt_tokens, cfg.max_new_tokens,
                                max(cfg.actions.rollback_values), prompt_len=len(prompt), generated=len(self.session.new_ids), bleu=self.bleu,
                                fallback=FIXED_FALLBACK, rollback=FIXED_ROLLBACK)
        self.step_latency_ms, self.step_ref_ms = 0.0, 0.0
        self.sum_fallback, self.sum_rollback = 0.0, 0.0
        self.norm_ms = self.cost_model.target_only_ms(len(prompt), cfg.max_new_tokens)
        info = {"prompt_index": self.prompt_index, "prompt_tokens": len(prompt),
                "prefill_ms": self._latency(self.session.prefill), "cost_profile": self.charged}
        return self._obs(), info

    def _step(self, prepared: None, chosen: Action):
        """The step under ``chosen``: a BiLD pair, speculation off or a tree rule (``bild_env.actions.Action``)."""
        fallback, rollback = chosen.shown
        if self.session.done:  # the prefill's token was EOS (or max_new_tokens is 1): nothing left to decode
            self.ended = True
            return self._obs(), 0.0, True, False, {"fallback": fallback, "rollback": rollback, "tree": chosen.label,
                                                   "committed": 0, "episode_summary": self.summary()}
        start = len(self.session.tokens)
        try:
            st = chosen.run(self.session)
        except (RuntimeError, torch.OutOfMemoryError) as err:  # a model failure ends the episode, not the run
            self.ended = True
            return self._obs(), 0.0, False, True, {"error": f"{type(err).__name__}: {err}", "fallback": fallback,
                                                   "rollback": rollback, "tree": chosen.label}
        latency = self._latency(st)
        ref = self.cost_model.target_only_ms(start, st.new_tokens)
        self.step_latency_ms += latency
        self.step_ref_ms += ref
        bleu = self._bleu()
        if self.config.reward.quality == "bleu":
            quality = self.config.reward.bleu_weight * (self.bleu - bleu) / 100.0
        else:
            quality = self._regret_charge(st.regret)
        reward = self._reward(ref, latency, quality)
        self.bleu, self.prev = bleu, (fallback, rollback)
        self.view.after_step(st, self.session.draft_p)
        self.sum_fallback, self.sum_rollback = self.sum_fallback + fallback, self.sum_rollback + rollback
        terminated = self.ended = self.session.done
        info = {
            **chosen.info(),
            "committed": st.new_tokens,
            "proposed": st.proposed,
            "accepted": st.accepted, "fell_back": bool(st.fallbacks), "hit_max_draft": bool(st.max_draft_hits),
            "rolled_back": bool(st.rollbacks), "discarded": st.discarded, "draft_forwards": st.draft_forwards,
            "target_forwards": st.target_forwards, "latency_ms": latency, "bleu": bleu,
            "regret": st.regret, "mismatches": st.mismatches, "guesses": st.guesses, "guesses_right": st.guesses_right,
            "cost_profile": self.charged,
        }
        if terminated:
            info["episode_summary"] = self.summary()
        return self._obs(), float(reward), terminated, False, info

    STEP_STATE = ("bleu", "prev", "step_latency_ms", "step_ref_ms", "sum_fallback", "sum_rollback")  # values a step sets

    def snapshot(self) -> dict:
        """The state a step changes (the env's ``STEP_STATE`` and observation, the session's and the replay runner's),
        by name, for ``restore``: a caller may try steps on the running episode and put it back as it was (the replay
        backend's; a live env's KV caches are not in it)."""
        return {name: getattr(self, name) for name in self.STEP_STATE} | {
            "view": replace(self.view), "session": self.session.snapshot(), "runner": self.runner.snapshot()}

    def restore(self, saved: dict) -> None:
        """Put the episode back as ``snapshot`` saw it."""
        for name in self.STEP_STATE:
            setattr(self, name, saved[name])
        self.view = replace(saved["view"])
        self.session.restore(saved["session"])
        self.runner.restore(saved["runner"])
        self.ended = False

    def summary(self) -> dict[str, float | int | str]:
        """The episode so far: latency per sentence (ms, prefill included) and target-only decoding's for the same tokens
        (``target_only_ms``: the prefill and the reference each step is rewarded against), acceptance, BLEU,
        thresholds."""
        total = self.session.total
        steps = max(total.steps, 1)
        new = self.session.new_ids
        return {
            "latency_ms": self._latency(total), "latency_mode": self.config.latency, "new_tokens": len(new),
            "target_only_ms": self._latency(self.session.prefill) + self.step_ref_ms,
            "acceptance_rate": total.acceptance_rate or 0.0, "mean_accepted_length": total.mean_accepted_length,
            "bleu": self.bleu, "exact_match": float(new == self.reference),
            "regret": total.regret_per_token, "fidelity": total.fidelity,
            "mean_fallback": self.sum_fallback / steps, "mean_rollback": self.sum_rollback / steps,
            "steps": total.steps, "rollbacks": total.rollbacks, "fallbacks": total.fallbacks,
            "draft_accuracy": total.guesses_right / total.guesses if total.guesses else 0.0,
        }

    def _text(self) -> str:
        s = self.session
        return (f"prompt: {self.pair.decode(s.tokens[: s.prompt_len])!r}\n"
                f"output: {self.pair.decode(s.new_ids)!r}\n"
                f"tokens {len(s.new_ids)}/{self.config.max_new_tokens}  BLEU {self.bleu:.1f}  "
                f"thresholds fallback={self.prev[0]} rollback={self.prev[1]}")

    def _trees(self):
        return getattr(self.runner, "store", None)

    # ----------------------------------------------------------------------------------------
    def _bleu(self) -> float:
        """BLEU so far, memoised by (prompt, output): a pure function that replayed episodes revisit."""
        key = (self.prompt_index, tuple(self.session.new_ids))
        bleu = self._bleu_memo.get(key)
        if bleu is None:
            if len(self._bleu_memo) >= 200_000:
                self._bleu_memo.clear()
            bleu = self._bleu_memo[key] = prefix_bleu(self.pair, self.session.new_ids, self.reference)
        return bleu

    def _latency(self, stats) -> float:
        return stats.model_ms if self.config.latency == "model" else stats.wall_ms

    def _obs(self) -> np.ndarray:
        v, total = self.view, self.session.total
        v.mean_accepted_length, v.bleu = total.mean_accepted_length, self.bleu
        v.latency_ratio = self.step_latency_ms / self.step_ref_ms if self.step_ref_ms > 0 else 1.0
        v.fallback, v.rollback = self.prev
        v.generated, v.regret_per_token, v.guesses = len(self.session.new_ids), total.regret_per_token, total
        if self.config.observation == "foresee":
            v.next_p = 1.0 if self.session.done else self.runner.peek_score(self.session.tokens, self.predictor)
        return observe(self.config.observation, v)


def paper_env(render_mode: str | None = None, **kwargs) -> BildEnv:
    """``BiLD-v0``: ``BildEnv`` in ``PAPER_SETTING`` under the caller's arguments, a sub-config's dict (``actions``,
    ``reward``) over the paper's keys (registered as this function, not as keyword arguments: ``gymnasium.make``
    merges those shallowly, and an ``actions`` given would drop the paper's grids)."""
    kwargs = folded(EnvConfig, kwargs)
    for name, paper in PAPER_SETTING.items():
        given = kwargs.get(name)
        if isinstance(paper, dict) and (given is None or isinstance(given, dict)):  # an instance given is whole
            kwargs[name] = paper | (given or {})
    return BildEnv(render_mode, **(PAPER_SETTING | kwargs))


def setting_id(values: dict) -> str:
    """``BiLD-v0`` for argument values holding ``PAPER_SETTING``'s, else ``BiLD-v1`` (the defaults)."""
    from bild_env.ids import ENV_ID

    def holds(value, paper) -> bool:
        if not isinstance(paper, dict):
            return value == paper
        value = vars(value) if is_dataclass(value) else value if isinstance(value, dict) else {}
        return all(value.get(k) == v for k, v in paper.items())

    return "BiLD-v0" if all(holds(values.get(k), v) for k, v in PAPER_SETTING.items()) else ENV_ID


def validate(cfg: EnvConfig) -> None:
    """Refuse a configuration that makes no sense before any model loads (a ValueError saying what to give): what
    both envs check (``base.check_common``), then BiLD-v1's own options."""
    check_common(cfg, weights=("bleu_weight",))
    if cfg.latency not in LATENCY_MODES:
        raise ValueError(f"latency must be one of {LATENCY_MODES}, got {cfg.latency!r}")
    if cfg.backend not in ("live", "replay"):
        raise ValueError(f"backend must be 'live' or 'replay', got {cfg.backend!r}")
    if cfg.backend == "replay" and cfg.latency != "model":
        raise ValueError("backend='replay' runs no model forward to time: it needs latency='model' (the cost model)")
    if check_score(cfg.actions.score) == "oracle" and cfg.backend != "replay":
        raise ValueError("score='oracle' reads the target's choice from the replay trees before it verifies: give "
                         "backend='replay', or use score='token' or 'cumulative'")
    if cfg.dataset is not None:
        from bild_env.prompts.sources import check_dataset

        check_dataset(cfg.dataset)  # a missing or binary file fails now, before the models load
    if cfg.observation not in OBSERVATIONS:
        raise ValueError(f"observation must be one of {OBSERVATIONS}, got {cfg.observation!r}")
    if cfg.observation == "foresee" and cfg.backend != "replay":
        raise ValueError("observation='foresee' reads the draft's next proposal from the replay trees: give "
                         "backend='replay', or use observation='context'")
    if cfg.reward.quality not in QUALITY_SIGNALS:
        raise ValueError(f"reward: quality must be one of {QUALITY_SIGNALS}, got {cfg.reward.quality!r}")
    if cfg.cost_profile is not None:
        if cfg.latency != "model":
            raise ValueError("cost_profile charges a stored cost model: it needs latency='model' (latency='wall' "
                             "times this machine's clock)")


def _make_runner(cfg: EnvConfig, pair, cost_model: CostModel, references: ReferenceStore):
    if cfg.backend == "live":
        return TreeRunner(pair, cost_model) if cfg.actions.tree_rules else LiveRunner(pair, cost_model)
    return ReplayRunner(pair, cost_model, references, cfg.max_new_tokens, store=cfg.replay_store)
