"""What both envs take alike: ``EnvConfig`` (``BiLD-v1``) and ``ServingConfig`` (``BiLD-Serve-v0``) inherit these fields.

The pair and how it loads, the prompts' split and length, the decoding limits, what the fallback threshold reads, the
actions (the threshold grids, the space over them, the off switch, the tree rules), the reward's weights and the cost
model charged. An env's own fields follow in its config class; a field whose default differs between the envs
(``max_new_tokens``, ``actions`` with the off switch on) is declared again there with its default (a dataclass keeps
the field's place). Grouped options are sub-configs (frozen dataclasses: ``PairOptions``, ``ActionOptions``,
``Reward``...), given as an instance or as a dict of some of their keys over the env's defaults.
"""

from __future__ import annotations

import functools
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass, replace

from bild_env.decoding.bild import MAX_DRAFT_LEN
from bild_env.decoding.cost_model import CostModel
from bild_env.decoding.tree import TreeRule, parse_tree_rule
from bild_env.command import parse_each
from bild_env.models.pairs import DEFAULT_PAIR
from bild_env.replay.store import TreeStore

# Threshold grids. BiLD-v1 (the default), chosen from `python -m bench.headroom` on the smollm2 pair:
# with the paper's grid, every rollback of 3.0 or more kept tokens the target would not have chosen
# (regret 0.07-0.78 nats per token, fidelity 0.61-0.90) and fallbacks below 0.2 were slower than
# the target alone at near-lossless rollback. So fallback (a probability) spans 0.25-0.6 around the
# best measured 0.35, plus BiLD's 0.103; rollback (nats; a token is undone when the target gives it
# p < exp(-x)) spans lossless 0.5 (< ln 2: exactly the target's greedy output), near-lossless 1.0
# and 1.5, and 2.5, plus BiLD's 4.697. The paper's fixed pair (0.103, 4.697) is action 4.
FALLBACK_VALUES = (0.103, 0.25, 0.35, 0.45, 0.6)
ROLLBACK_VALUES = (0.5, 1.0, 1.5, 2.5, 4.697)


@dataclass(frozen=True)
class PairOptions:
    """How the pair loads, where the preset's choice is not wanted (``pair_options`` of both envs: a ``PairOptions`` or
    a dict of its fields; ``--pair-options KEY=VALUE`` on the command line). Every field None takes the preset's."""

    draft: str | None = field(default=None, metadata={"help": "draft hub id or folder (overrides the preset's)"})
    target: str | None = field(default=None, metadata={"help": "target hub id or folder (overrides the preset's)"})
    tokenizer: str | None = field(default=None, metadata={"help": "shared tokenizer (default: the target's)"})
    device: str | None = field(default=None, metadata={"help": "cuda | cpu | ... (default: cuda if available, else cpu)"})
    dtype: str | None = field(default=None, metadata={"help": (
        "float32 | bfloat16 | float16 | auto (default: the preset's (tiny-random: float32); else auto: float16 on "
        "cuda, on a cpu bfloat16 where native (AVX512-BF16/AMX), else float32)")})
    lean: str | None = field(default=None, metadata={"help": (
        "lean forward for which models: none | draft | target | both (default: the preset's; smollm2: both)")})
    draft_vocab: int | None = field(default=None, metadata={"help": (
        "the draft proposes among its K most frequent workload tokens: None the preset's (smollm2: 16384), 0 full "
        "head")})
    load_on_miss: bool = field(default=False, metadata={"help": (
        "an env replaying the pair's decoding dataset with no model may load the models (fetching them if they are "
        "not on this machine, said with their size) when a step leaves the recording; its actions then default to "
        "the paper's grid. False: its actions default to those the dataset answers, and others are refused at "
        "construction")})

    @property
    def custom(self) -> bool:
        """Both models given: a custom pair, no preset's."""
        return bool(self.draft and self.target)

    def load(self, pair: str, dtype: str | None = None):
        """``load_pair`` of preset ``pair`` under these options (``custom``: the models given alone), in ``dtype``
        where given (a decoding dataset's), else in ``self.dtype``."""
        from bild_env.models.pairs import load_pair

        return load_pair(None if self.custom else pair, draft=self.draft, target=self.target,
                         tokenizer=self.tokenizer, device=self.device, dtype=dtype or self.dtype, lean=self.lean,
                         draft_vocab=self.draft_vocab)


@dataclass(frozen=True)
class ActionOptions:
    """The env's actions (``actions`` of both envs: an ``ActionOptions`` or a dict of its fields, the env's defaults for
    those left out; ``--actions KEY=VALUE``): the threshold grids, the space over them, the off switch, the tree
    rules, and what a BiLD action's thresholds act on (the longest draft run, what the fallback threshold reads).
    Each action is decoded once, by ``bild_env.actions``."""

    fallback_values: tuple[float, ...] = field(default=FALLBACK_VALUES, metadata={"help": (
        "the fallback thresholds (probabilities) of the grid")})
    rollback_values: tuple[float, ...] = field(default=ROLLBACK_VALUES, metadata={"help": (
        "the rollback thresholds (nats) of the grid")})
    space: str = field(default="discrete", metadata={"help": (
        '"discrete": the grid, Discrete(len(fallback_values) * len(rollback_values)) (+ off); "continuous": Box in '
        "[-1, 1], fallback linear and rollback log-scale over the grids' spans (+ off > 0)")})
    off_switch: bool = field(default=False, metadata={"help": (
        "one more action: speculation off for the step (the target alone, no draft forward); continuous: Box(3,), the "
        "third number > 0")})
    tree_rules: tuple[str, ...] = field(default=(), metadata={"sep": " ", "help": (
        "token-tree rules, one more discrete action each after the grid (and the off switch): a lossless tree step "
        '(bild_env.decoding.tree): "N:D:W[:F]" dynamic (e.g. 6:8:2:0.3) or children per depth (e.g. 3,2,1,1); '
        'space="discrete" only; on the command line one rule a key, tree_rules=6:8:2:0.3 tree_rules=3,2,1,1')})
    max_draft_len: int | str = field(default=MAX_DRAFT_LEN, metadata={"help": (
        'BiLD\'s longest draft run; "auto" (replay, discrete actions): the cap whose best fixed action returns most on '
        "the validation split under the costs charged (BiLD-Serve-v0: at each level of its load), chosen when the env "
        "is made (bild_env.draft_cap)")})
    score: str = field(default="token", metadata={"help": (
        'what the fallback threshold reads (BiLD-Serve-v0: each request\'s): "token" (the proposal\'s max '
        'probability), "cumulative" (their product along the run), "lookup" / "lookup_cumulative" (the pair\'s '
        "lookup predictor, bild_env.models.lookup: the max probability and the context's repeats; BiLD-Serve-v0's "
        'observe next=1 then reads its chance for each next proposal), "oracle" (1 where the target agrees: a perfect '
        'predictor, for measuring the room; BiLD-v1: replay backend only), "oracle:W" (one of quality W in (0, 1]: '
        "(1 - W) p + W agrees)")})

    @property
    def n_grid(self) -> int:
        """The grid's (fallback, rollback) pairs."""
        return len(self.fallback_values) * len(self.rollback_values)

    @property
    def n_discrete(self) -> int:
        """The discrete actions: the grid, the off switch, the tree rules."""
        return self.n_grid + int(self.off_switch) + len(self.tree_rules)


@dataclass(frozen=True)
class Reward:
    """The reward's weights (``reward`` of both envs: a ``Reward`` or a dict of its fields; ``--reward KEY=VALUE``):
    ``latency_weight * (T_ref - T_step) / T_norm - regret_weight * regret / max_new_tokens``."""

    latency_weight: float = field(default=1.0, metadata={"help": (
        "weight of the time saved against target-only decoding (BiLD-Serve-v0: at the same load)")})
    regret_weight: float = field(default=10.0, metadata={"help": (
        'weight of the regret (nats per token of max_new_tokens; BiLD-v1: with quality="regret", BiLD-Serve-v0: '
        "summed over requests)")})


@functools.cache
def sub_configs(cls: type) -> dict[str, type]:
    """``{field: its class}`` of config ``cls``'s sub-configs (the fields whose type is a dataclass)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls) if is_dataclass(hints[f.name])}


@functools.cache
def flat_names(cls: type) -> dict[str, tuple[str, str]]:
    """``{key: (the sub-config field holding it, the key)}`` for every key of config ``cls``'s sub-configs (what
    ``setting`` reads; ``bild_env.migrate`` reads the names the keys had when given flat)."""
    return {key.name: (name, key.name) for name, sub in sub_configs(cls).items() for key in fields(sub)}


def sub_config(sub: type, value, name: str, default=None):
    """``value`` (sub-config ``name`` as given: an instance, a dict of its keys over ``default``'s (the env's; else
    ``sub``'s defaults), or None for ``default``) as a ``sub``; lists (from JSON) become the tuples a field holds; a
    ValueError naming its keys for anything else."""
    default = sub() if default is None else default
    if value is None:
        return default
    if isinstance(value, sub):
        return value
    keys = [f.name for f in fields(sub)]
    if not isinstance(value, dict) or not set(value) <= set(keys):
        raise ValueError(f"{name} must be a dict (or a {sub.__name__}) of {', '.join(keys)}, got {value!r}")
    return replace(default, **{k: tuple(v) if isinstance(v, list) else v for k, v in value.items()})


def over(base, values: dict):
    """Config ``base`` with ``values`` (a command line's, ``bild_env.cli.given``) over it: a sub-config given as a dict
    of some of its keys keeps ``base``'s others (not the field's defaults, where ``base`` is no default config)."""
    subs = sub_configs(type(base))
    return replace(base, **{k: sub_config(subs[k], v, k, getattr(base, k)) if k in subs else v
                            for k, v in values.items()})


@dataclass
class CommonConfig:
    """The arguments both envs take (``gymnasium.make`` keyword arguments), with their defaults."""

    pair: str = field(default=DEFAULT_PAIR, metadata={"help": "model pair preset: see bild_env.models.preset_names()"})
    pair_options: PairOptions = field(default_factory=PairOptions, metadata={"help": (
        "how the pair loads where the preset's choice is not wanted (a dict of PairOptions' fields)")})
    split: str = field(default="train", metadata={"help": "train | validation | test"})
    prompt_tokens: int = field(default=32, metadata={"help": (
        "prompts are cut to this many tokens (BiLD-v1: paragraphs; BiLD-Serve-v0: prose, code and chat prompts, long "
        "inputs up to 512)")})
    max_prompts: int | None = field(default=None, metadata={"help": (
        "use only the first N prompts of the split (BiLD-Serve-v0: of each domain's)")})
    max_new_tokens: int = field(default=64, metadata={"help": (
        "tokens generated per episode (BiLD-Serve-v0: per request, or fewer at EOS)")})
    actions: ActionOptions = field(default_factory=ActionOptions, metadata={"help": (
        "the actions: threshold grids, space, off switch, tree rules, the longest draft run, what the fallback "
        "threshold reads (a dict of ActionOptions' fields)")})
    reward: Reward = field(default_factory=Reward, metadata={"help": "the reward's weights (a dict of Reward's fields)"})
    cost_profile: str | None = field(default=None, metadata={"help": (
        "charge a stored hardware cost profile instead of this machine's timed cost model: a shipped name "
        "(bild_env.decoding.profiles.profile_names(): GPU ones such as h200-opt-eager, bfloat16 CPUs' such as "
        "xeon-amx-qwen2.5-coder-bf16) or a file "
        "python -m bild_env.profile wrote; the tokens still come from the pair (bild_env.decoding.profiles)")})
    cost_model: CostModel | None = field(default=None, metadata={"cli": False, "help": (
        "default: calibrated and cached (BiLD-Serve-v0: with batched tables)")})
    replay_store: TreeStore | None = field(default=None, metadata={"cli": False, "help": (
        "replay trees (default: the enclosing ``sharing`` block's, else the pair's process-wide store)")})

    def __post_init__(self) -> None:
        for f in fields(self):  # a dict as JSON and gymnasium.make give it, over the env's defaults
            if (sub := sub_configs(type(self)).get(f.name)) is not None:
                default = f.default_factory() if f.default_factory is not MISSING else None
                setattr(self, f.name, sub_config(sub, getattr(self, f.name), f.name, default))

    def arguments(self, **overrides):
        """The env's keyword arguments, ``gymnasium.make(env_id, **config.arguments())``, as a run's spec saves them:
        each sub-config as the dict of its keys; the objects that are no option (``cli=False``: a cost model, a tree
        store) left out; ``overrides`` over them."""
        return {f.name: asdict(v) if is_dataclass(v := getattr(self, f.name)) else v for f in fields(self)
                if f.metadata.get("cli", True)} | overrides

    def setting(self, name: str):
        """The value of argument ``name``, a field or a key of a sub-config (what messages comparing two
        configurations read)."""
        owner, key = flat_names(type(self)).get(name, (None, name))
        return getattr(getattr(self, owner) if owner else self, key)


def check_tree_rules(cfg: CommonConfig) -> tuple[TreeRule, ...]:
    """The parsed ``tree_rules``; ValueError naming the field for rules that do not parse (or verify too many nodes),
    a rule given twice, a lone string, or a continuous action."""
    rules = cfg.actions.tree_rules
    if isinstance(rules, str) or not isinstance(rules, (tuple, list)) or not all(isinstance(r, str) for r in rules):
        raise ValueError(f"tree_rules must be a tuple of rule texts, e.g. ('6:8:2:0.3', '3,2,1,1'), got {rules!r}")
    if not rules:
        return ()
    parsed = parse_each("tree_rules:", rules, parse_tree_rule)
    for i, rule in enumerate(parsed):
        if rule in parsed[:i]:
            raise ValueError(f"tree_rules: {rules[i]!r} is the same rule as {rules[parsed.index(rule)]!r}: give each "
                             "rule once (each is an action)")
    if cfg.actions.space != "discrete":
        raise ValueError("tree_rules add discrete actions (one per rule): give space='discrete', or no tree_rules")
    return tuple(parsed)
