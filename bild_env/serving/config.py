"""The arguments of ``BiLD-Serve-v0`` (``ServingConfig``) and their checks (``validate``), before any model loads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bild_env.base import check_common
from bild_env.config import ActionOptions, CommonConfig
from bild_env.decoding.costs import BATCH_SIZES
from bild_env.decoding.profiles import check_batch, check_variations, load_profile
from bild_env.prompts.code import check_code_source
from bild_env.serving import clock
from bild_env.serving.load import LoadProfile
from bild_env.serving.workload import Workload, parse_mix

DEFAULT_LOAD = "levels:0.05,0.2,0.4,0.7,1.0"
DEFAULT_MIX = "prose:1,code:1,chat:1"


@dataclass(frozen=True)
class Charging:
    """How a step is charged, beyond the cost model's forwards (``charging`` of ``BiLD-Serve-v0``: a ``Charging`` or a
    dict of its fields; ``--charging KEY=VALUE``): the decoder's own work, the read-ahead's draft forward, and a
    drawn machine per episode (a reset-time cost sampler). The defaults charge the forwards alone, on one machine."""

    read_ahead_batch: int = field(default=0, metadata={"help": (
        "with observe next: read the next proposals only while the running batch holds at most this many requests (0: "
        "always); above, their three entries read as for an empty batch and nothing is charged")})
    charge_loop: tuple[float, ...] = field(default=(), metadata={"help": (
        "the batched decoder's own work, ms per step, per forward and per row read (``scripts.analysis.serving_clock`` fits it "
        "on a machine): given, a step is charged as the padded decoder runs it (every row in every forward) plus this "
        "work, and target-only's reference gets the same work for its step; empty: the forwards alone, each of the "
        "rows it serves")})
    train_profiles: tuple[str, ...] = field(default=(), metadata={"help": (
        "hardware it must not depend on: each episode charges one of these cost profiles (names or files), drawn at "
        "reset, instead of cost_profile; empty: one cost model throughout")})
    vary_profiles: float = field(default=1.0, metadata={"help": (
        "with train_profiles: each episode's profile varied (bild_env.decoding.profiles.vary) by three factors drawn "
        "log-uniformly in [1/v, v]: the draft's cost, the growth with tokens fed, the growth with the batch; 1: as "
        "stored")})


@dataclass(frozen=True)
class Observe:
    """What ``BiLD-Serve-v0`` observes beyond its base numbers (``observe`` of the env: an ``Observe`` or a dict of its
    fields; ``--observe KEY=VALUE``)."""

    next: bool = field(default=False, metadata={"help": (
        "also the draft's score for each running request's next proposal (mean, spread, share at or above the last "
        "fallback threshold), read ahead from the replay trees; a step that then drafts nothing is charged the draft "
        "forward a server reads them with")})
    costs: bool = field(default=False, metadata={"help": (
        "also what the hardware charges (3 more numbers): the draft forward over the target's, the target's rise fed "
        "8 tokens, and its rise at max_batch sequences (log2), all at batch 1 unless said")})
    batch_scale: str = field(default="linear", metadata={"help": (
        'entry 0: "linear" batch / max_batch, or "log" log2(1 + batch) / log2(1 + max_batch)')})


@dataclass(frozen=True)
class ServingActions(ActionOptions):
    """``BiLD-Serve-v0``'s actions: both envs' (``bild_env.config.ActionOptions``; the off switch on here), then an
    action per domain."""

    off_switch: bool = field(default=True, metadata={"help": (
        "one more action: speculation off (the target decodes alone; no draft forward)")})
    per_domain: bool = field(default=False, metadata={"help": (
        "an action per domain (MultiDiscrete; each request takes its domain's): discrete only, observes the shares")})


@dataclass
class ServingConfig(CommonConfig):
    """Every argument of ``BiLD-Serve-v0`` with its default (``gymnasium.make`` keyword arguments): those both envs
    take (``bild_env.config.CommonConfig``; two with other defaults here: ``max_new_tokens``, and ``actions``, whose
    off switch is on), then its own."""

    max_new_tokens: int = field(default=32, metadata={"help": "tokens each request generates (or fewer, at EOS)"})
    actions: ServingActions = field(default_factory=ServingActions, metadata={"help": (
        "the actions: threshold grids, space, off switch (on here), tree rules, an action per domain (a dict of "
        "ServingActions' fields)")})
    mix: str = field(default=DEFAULT_MIX, metadata={"help": (
        'the workload: domains with weights, e.g. "prose:1,code:1,chat:1" (bild_env.prompts.domains)')})
    mix_draw: float = field(default=0.0, metadata={"help": (
        "0: every episode serves the mix; c > 0: each episode's weights drawn from Dirichlet(c * n * weights) (n "
        "domains)")})
    code_source: str = field(default="humaneval", metadata={"help": (
        'the code domain\'s prompts: "humaneval" (shipped) or "stdlib" (this Python\'s library)')})
    max_batch: int = field(default=32, metadata={"help": (
        "requests decoded together at most (<= the largest batch timed, costs.BATCH_SIZES); the rest queue")})
    load: str = field(default=DEFAULT_LOAD, metadata={"help": (
        "load profile (bild_env.serving.load): constant:U | levels:U1,U2.. | burst:B,P | daily:L,H | steps:U1,U2..")})
    episode_steps: int = field(default=128, metadata={"help": (
        "batched decoding steps per episode (then truncated: serving never terminates)")})
    observe: Observe = field(default_factory=Observe, metadata={"help": (
        "what the observation holds beyond its 14 numbers, and how entry 0 reads the batch (a dict of Observe's "
        "fields)")})
    charging: Charging = field(default_factory=Charging, metadata={"help": (
        "how a step is charged beyond the forwards (a dict of Charging's fields)")})
    workload: Workload | None = field(default=None, metadata={"cli": False, "help": (
        "default: built from mix, split, prompt_tokens")})


def _largest_timed_batch(cost_model) -> int | None:
    """The largest batch the cost model has timed forwards of: the default's (``costs.BATCH_SIZES``, timed with it)
    or, for a given model, the smaller of its batched tables' largest; None for a given model without batched tables
    (it costs a batch of one only, ``CostModel.batch_ms`` says so)."""
    if cost_model is None:
        return BATCH_SIZES[-1]
    batched = getattr(cost_model, "batched", None)
    return min(cost.batch[-1] for cost in batched.values()) if batched else None


def check_profiles(cfg: ServingConfig) -> None:
    """Refuse the cost profiles the env would charge (``cost_profile``, ``train_profiles`` and their variations by
    ``vary_profiles``) before any work: each loaded and checked as every table of times is (a ProfileError, a
    ValueError, naming the file and the cell), its batches covering ``max_batch``, and no variation one that no
    machine could time (``profiles.check_variations``)."""
    names = cfg.charging.train_profiles
    if isinstance(names, str) or not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"train_profiles must be a tuple of cost profile names or files, e.g. ('h200-opt-eager',), "
                         f"got {names!r}")
    if names and (cfg.cost_profile is not None or cfg.cost_model is not None):
        raise ValueError("train_profiles draws each episode's cost model: give it alone, without cost_profile or "
                         "cost_model")
    v = cfg.charging.vary_profiles
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 1:
        raise ValueError(f"vary_profiles must be a finite number >= 1 (1: the profiles as stored), got {v!r}")
    if v > 1 and not names:
        raise ValueError("vary_profiles varies the train_profiles: give train_profiles with it")
    for spec in [p for p in (cfg.cost_profile, *names) if p is not None]:
        profile = load_profile(spec)
        check_batch(profile, cfg.max_batch)  # an integer >= 1: checked before
        if v > 1:
            check_variations(profile, v)


def validate(cfg: ServingConfig) -> LoadProfile:
    """Refuse a configuration that makes no sense before any model loads; returns the parsed load profile."""
    from bild_env.models.device import usable_device
    from bild_env.models.pairs import LEAN_CHOICES

    check_common(cfg, counts=("max_batch", "episode_steps"), weights=("mix_draw",))
    if cfg.pair_options.device:
        usable_device(cfg.pair_options.device)  # a DeviceError (a ValueError) naming the devices this machine has
    if cfg.pair_options.lean is not None and cfg.pair_options.lean not in LEAN_CHOICES:
        raise ValueError(f"pair_options: lean must be one of {LEAN_CHOICES} (or None: the preset's), got "
                         f"{cfg.pair_options.lean!r}")
    check_profiles(cfg)
    profiled = cfg.cost_profile is not None or bool(cfg.charging.train_profiles)
    largest = None if profiled else _largest_timed_batch(cfg.cost_model)  # a profile: check_batch
    if largest is not None and cfg.max_batch > largest:
        raise ValueError(f"max_batch {cfg.max_batch} is above the largest batch the cost model has timed ({largest} "
                         f"sequences{'' if cfg.cost_model is not None else ': bild_env.decoding.costs.BATCH_SIZES'}); "
                         f"its costs would be extrapolated from smaller batches: give max_batch <= {largest}")
    profile = LoadProfile.parse(cfg.load, "load")
    if cfg.workload is None:
        parse_mix(cfg.mix)
    check_code_source(cfg.code_source)
    if isinstance(cfg.charging.read_ahead_batch, bool) or not isinstance(cfg.charging.read_ahead_batch, int) or cfg.charging.read_ahead_batch < 0:
        raise ValueError(f"read_ahead_batch must be an integer >= 0 (0: read ahead at every batch size), got "
                         f"{cfg.charging.read_ahead_batch!r}")
    if cfg.charging.charge_loop:
        if len(cfg.charging.charge_loop) != 3:
            raise ValueError(f"charge_loop takes 3 numbers (ms per step, per forward, per row read; scripts.analysis.serving_clock "
                             f"fits them), got {len(cfg.charging.charge_loop)}")
        clock.BatchLoop(*cfg.charging.charge_loop)  # finite, >= 0
    if cfg.observe.batch_scale not in ("linear", "log"):
        raise ValueError(f"observe: batch_scale must be 'linear' or 'log', got {cfg.observe.batch_scale!r}")
    if cfg.actions.per_domain and cfg.actions.space != "discrete":
        raise ValueError("per_domain takes a discrete action per domain: use actions={'space': 'discrete'} with it")
    if cfg.actions.tree_rules and cfg.actions.per_domain:
        raise ValueError("tree_rules are actions of the whole batch: give them without per_domain")
    if cfg.split not in ("train", "validation", "test"):
        raise ValueError(f"split must be 'train', 'validation' or 'test', got {cfg.split!r}")
    return profile
