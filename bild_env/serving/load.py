"""Load profiles: how fast requests arrive, as a share of what the target alone can serve.

A load is a *utilisation* ``u``: the arrival rate as a share of the rate at which target-only decoding
of a full batch (``max_batch`` requests, ``max_new_tokens`` each) completes requests. ``u = 1`` keeps
target-only decoding saturated; above it the queue grows. Expressed this way a profile means the same
on a laptop CPU and on a GPU, whose absolute rates differ a hundredfold; ``info["arrival_rate"]`` gives
the rate in requests per second of the simulated clock.

A profile maps the episode's progress ``x`` (steps done / ``episode_steps``, in [0, 1)) to ``u``:

| spec | meaning |
|---|---|
| ``constant:U`` | ``u = U`` for the whole episode |
| ``levels:U1,U2,...`` | one of the levels, drawn uniformly per episode (the load an episode sees is constant) |
| ``burst:BASE,PEAK`` | ``BASE``, and ``PEAK`` over the middle third of the episode (1/3 <= x < 2/3) |
| ``daily:LOW,HIGH`` | one day compressed into the episode: ``LOW + (HIGH - LOW) * (1 - cos(2 pi (x + phase))) / 2``, the phase drawn per episode |
| ``steps:U1,U2,...`` | the episode cut into equal phases, one level each, in the order given |

Profiles are parsed (and refused with a message naming the option) before any model loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

KINDS = ("constant", "levels", "burst", "daily", "steps")
MAX_UTILISATION = 4.0  # beyond it the queue only grows; a spec above it is a typo more likely than a plan


@dataclass(frozen=True)
class LoadProfile:
    """A parsed load profile: ``kind`` (one of ``KINDS``) and its ``values`` (utilisations)."""

    kind: str
    values: tuple[float, ...]

    @classmethod
    def parse(cls, spec: str | LoadProfile, option: str = "load") -> LoadProfile:
        """``"constant:0.5"``, ``"levels:0.1,0.5,1"``, ... (module docstring); ValueError naming ``option`` otherwise."""
        if isinstance(spec, LoadProfile):
            return spec
        hint = (f"; give one of {', '.join(k + ':...' for k in KINDS)} with utilisations in (0, {MAX_UTILISATION}] "
                "(a share of what target-only decoding of a full batch serves), e.g. 'constant:0.5' or 'levels:0.1,0.5,1'")
        if not isinstance(spec, str) or ":" not in spec:
            raise ValueError(f"{option} must be a load profile 'kind:values', got {spec!r}{hint}")
        kind, _, rest = spec.partition(":")
        kind = kind.strip().lower()
        if kind not in KINDS:
            raise ValueError(f"{option}: unknown load profile kind {kind!r}{hint}")
        try:
            values = tuple(float(v) for v in rest.split(",") if v.strip())
        except ValueError:
            raise ValueError(f"{option}: {rest!r} is not a comma-separated list of numbers{hint}") from None
        need = {"constant": (1, 1), "levels": (1, 64), "burst": (2, 2), "daily": (2, 2), "steps": (1, 64)}[kind]
        if not need[0] <= len(values) <= need[1]:
            count = str(need[0]) if need[0] == need[1] else f"{need[0]}-{need[1]}"
            raise ValueError(f"{option}: {kind} takes {count} value(s), got {len(values)} in {spec!r}{hint}")
        bad = [v for v in values if not math.isfinite(v) or not 0.0 < v <= MAX_UTILISATION]
        if bad:
            raise ValueError(f"{option}: utilisation {bad[0]!r} in {spec!r} is out of range (an arrival rate of 0 or "
                             f"less never brings a request){hint}")
        return cls(kind, values)

    @classmethod
    def level_loads(cls, spec: str | LoadProfile) -> list:
        """Each level of a ``levels:`` profile ``spec`` as a constant load (every level weighs the same, whatever the
        seeds would draw: the loads validation and the draft cap's choice run at), else ``spec`` itself."""
        profile = cls.parse(spec)
        return [f"constant:{u:g}" for u in profile.values] if profile.kind == "levels" else [spec]

    def start(self, rng: np.random.Generator) -> EpisodeLoad:
        """This episode's load (a level or phase is drawn here, with the env's RNG)."""
        if self.kind == "levels":
            return EpisodeLoad(self, level=float(self.values[int(rng.integers(len(self.values)))]))
        if self.kind == "daily":
            return EpisodeLoad(self, phase=float(rng.random()))
        return EpisodeLoad(self)

    def __str__(self) -> str:
        return f"{self.kind}:{','.join(f'{v:g}' for v in self.values)}"


@dataclass(frozen=True)
class EpisodeLoad:
    """The load of one episode: ``utilisation(x)`` at progress ``x`` in [0, 1)."""

    profile: LoadProfile
    level: float | None = None  # the level drawn ("levels")
    phase: float = 0.0  # the phase drawn ("daily")

    def utilisation(self, x: float) -> float:
        kind, v = self.profile.kind, self.profile.values
        if kind == "constant":
            return v[0]
        if kind == "levels":
            return self.level
        if kind == "burst":
            return v[1] if 1 / 3 <= x < 2 / 3 else v[0]
        if kind == "daily":
            return v[0] + (v[1] - v[0]) * (1.0 - math.cos(2.0 * math.pi * (x + self.phase))) / 2.0
        return v[min(int(x * len(v)), len(v) - 1)]  # steps
