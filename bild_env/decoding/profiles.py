"""Hardware cost profiles: a cost model timed on another machine, stored under a name and charged instead of this one's.

A decoding step costs what the machine charges for its forwards (``bild_env.decoding.cost_model.CostModel``), and
that decides which thresholds pay: on a 2-core bfloat16 CPU a draft forward costs ~7% of a target forward, on an
NVIDIA H200 in Hugging Face eager mode the OPT-125M / OPT-6.7B shapes cost 30%. A profile lets a machine without
that GPU train and judge agents under its economics. What a profile is, plainly:

- **real timings of the shapes** on the device it names (forwards of models with the shapes of the pair it names,
  random weights: a forward's time does not depend on the weights' values), in the cost model's own tables
  (one sequence by tokens fed, a slope per cached token, and batched tables over sequences x tokens fed);
- **not** a run of those weights: the tokens and their acceptance still come from the pair the env loads (its replay
  trees), so a profile changes what each step costs, never what it decodes.

Shipped profiles (``bild_env/assets/profiles/<name>.json``, ``profile_names()``) and any profile file a user wrote
with ``python -m bild_env.profile`` load the same way (``load_profile``: a name or a path). A profile is checked
when loaded as every table of times is, a cache this machine timed too (``calibration.model_faults``: numbers as
numbers, finite, above 0 ms at every context and batch an env reads, no growth with the tokens fed or the batch that
hardware cannot show, no forward over an hour), and for its format, both roles, and batched tables where a batched
env needs them; the batch sizes it covers are ``CostProfile.largest_batch``. Every output that charges one names it
(``CostProfile.label``).

``vary`` makes a profile's variations (the draft's cost, the verification's growth with tokens fed and with the
batch scaled), for agents trained across hardware.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from bild_env.decoding.batch_costs import BatchCost
from bild_env.decoding.calibration import model_faults, number_faults
from bild_env.decoding.cost_model import CostFormatError, CostModel, _write_json
from bild_env.decoding.forward_costs import ForwardCost
from bild_env.command import UsageError
from bild_env.paths import ASSETS

PROFILE_FORMAT = "bild-gym cost profile 1"
PROFILES_DIR = ASSETS / "profiles"
MACHINE = "machine"  # the label of this machine's own timed cost model, where no profile is charged


class ProfileError(UsageError):
    """A cost profile that cannot be read or used (a ``ValueError``); the message says what to do. A command exits
    with status 2 (``bild_env.command.run_command``)."""


@dataclass(frozen=True)
class CostProfile:
    """A stored cost model with what it is: ``name``; ``device`` and ``dtype`` it was timed on; ``shapes`` (the models'
    shapes, in words); ``software`` (torch and transformers versions); ``timed`` (how: the command, the mode);
    ``note`` (anything a reader must know); ``model`` the cost model charged."""

    name: str
    model: CostModel
    device: str
    dtype: str
    shapes: str
    software: str = ""
    timed: str = ""
    note: str = ""
    source: str = field(default="", compare=False)  # the file it was read from

    @property
    def largest_batch(self) -> int:
        """The largest batch of sequences both batched tables time (1 without batched tables)."""
        batched = self.model.batched
        return min(cost.batch[-1] for cost in batched.values()) if batched else 1

    @property
    def c(self) -> float:
        """Draft forward / target forward, both fed 1 token at the tables' reference context: the economics' key."""
        d, t = self.model.draft, self.model.target
        return d(1, d.ref_context) / t(1, t.ref_context)

    def v(self, n: int) -> float:
        """A target forward fed ``n`` tokens / one fed 1 (at the reference context): what verifying ``n`` costs."""
        t = self.model.target
        return t(n, t.ref_context) / t(1, t.ref_context)

    @property
    def label(self) -> str:
        """The profile in a few words, for every output that charges it."""
        return (f"cost profile {self.name} ({self.device}, {self.dtype}, {self.shapes}; "
                f"c {self.c:.3f}, v(8) {self.v(8):.2f})")

    def to_dict(self) -> dict[str, object]:
        return {"format": PROFILE_FORMAT, "name": self.name, "device": self.device, "dtype": self.dtype,
                "shapes": self.shapes, "software": self.software, "timed": self.timed, "note": self.note,
                "cost_model": self.model.to_dict()}

    def save(self, path: str | Path) -> CostProfile:
        """Write the profile as JSON to ``path`` (atomically) once it passes the check every reader makes
        (``profile_from_dict``: else a ProfileError naming ``path``, nothing written); the profile as read back."""
        checked = profile_from_dict(self.to_dict(), source=str(path))
        _write_json(Path(path), self.to_dict())
        return checked


def profile_names() -> list[str]:
    """The names of the shipped profiles."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def _path_of(spec: str) -> Path:
    """The file a profile name or path names; a ProfileError naming the shipped ones where there is none."""
    if not isinstance(spec, (str, Path)) or not str(spec).strip():
        raise ProfileError(f"a cost profile is a shipped name ({', '.join(profile_names())}) or a profile file's path, "
                           f"got {spec!r}")
    shipped = PROFILES_DIR / f"{spec}.json"
    if shipped.is_file():
        return shipped
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise ProfileError(f"cost profile {spec!r} is a folder: give a profile file (python -m bild_env.profile --out "
                           f"FILE writes one) or a shipped name: {', '.join(profile_names())}")
    raise ProfileError(f"no cost profile {spec!r}: give a shipped name ({', '.join(profile_names())}) or the path of a "
                       f"file that python -m bild_env.profile wrote")


def profile_from_dict(d: object, name: str = "", source: str = "") -> CostProfile:
    """A profile from its saved dict, checked: its format, its text fields, and a cost model whose counts and times
    are numbers (``calibration.number_faults``), finite and > 0 (``CostModel`` refuses others), that a quiet machine
    could have timed (``calibration.model_faults``: refused where it finds anything, broken or odd)."""
    where = source or name or "the cost profile"
    if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
        found = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise ProfileError(f"{where} is not a cost profile of format {PROFILE_FORMAT!r} (found {found!r}): write one "
                           f"with python -m bild_env.profile, or use a shipped name: {', '.join(profile_names())}")
    try:
        if why := number_faults(d["cost_model"]):
            raise CostFormatError(why)
        model = CostModel.from_dict(d["cost_model"])
    except KeyError:
        raise ProfileError(f"{where} holds no cost_model: write it again with python -m bild_env.profile") from None
    except CostFormatError as err:
        raise ProfileError(f"{where}: {err}; write it again with python -m bild_env.profile") from None
    check_tables(model, where)
    texts = {k: d.get(k, "") for k in ("name", "device", "dtype", "shapes", "software", "timed", "note")}
    bad = [k for k, v in texts.items() if not isinstance(v, str)]
    if bad or not texts["device"] or not texts["dtype"]:
        raise ProfileError(f"{where}: fields {bad or ['device', 'dtype']} must be text (device and dtype not empty)")
    return CostProfile(name=texts["name"] or name, model=replace(model, device=f"profile {texts['name'] or name}"),
                       device=texts["device"], dtype=texts["dtype"], shapes=texts["shapes"],
                       software=texts["software"], timed=texts["timed"], note=texts["note"], source=source)


def check_tables(model: CostModel, where: str) -> None:
    """A ProfileError naming ``where`` (the file, or the profile) and the cell where ``model``'s tables are no timing
    of a quiet machine (``calibration.model_faults``, odd or broken)."""
    broken, odd = model_faults(model)
    if why := odd or broken:
        raise ProfileError(f"{where}: {why}; time it again with python -m bild_env.profile (on a quiet machine)")


def load_profile(spec: str | Path) -> CostProfile:
    """The profile a shipped name (``profile_names()``) or a file path names, checked (``profile_from_dict``): read
    once per process while the file is unchanged (an env's checks and its construction ask for it several times)."""
    path = _path_of(spec)
    stat = path.stat()
    return _load(path, path.absolute(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=32)
def _load(path: Path, where: Path, mtime_ns: int, size: int) -> CostProfile:
    """``path``'s profile; ``where`` (its absolute path), ``mtime_ns`` and ``size`` key the cache."""
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ProfileError(f"cost profile {str(path)!r} is not JSON ({err}): write it again with "
                           f"python -m bild_env.profile") from None
    return profile_from_dict(d, name=path.stem, source=str(path))


def profile_for(cost_profile: str | None, cost_model: CostModel | None = None) -> CostProfile | None:
    """The profile an env's ``cost_profile`` names (loaded and checked), or None; refused beside a given
    ``cost_model`` that is not the profile's own (a bench hands its later envs the first env's model, which is)."""
    if cost_profile is None:
        return None
    profile = load_profile(cost_profile)
    if cost_model is not None and cost_model != profile.model:
        raise ProfileError(f"give cost_profile or cost_model, not both: each is what the env charges (the cost_model "
                           f"given is not {profile.label}'s)")
    return profile


def check_batch(profile: CostProfile, max_batch: int) -> None:
    """Refuse a batch beyond the profile's largest timed one (its costs would be extrapolated), naming both."""
    if profile.model.batched is None:
        if max_batch > 1:
            raise ProfileError(f"{profile.label} has no batched tables, so it cannot cost a batch of {max_batch}: "
                               "time one with python -m bild_env.profile (it times batched forwards) or use "
                               "max_batch=1")
        return
    if max_batch > profile.largest_batch:
        raise ProfileError(f"max_batch {max_batch} is above the largest batch cost profile {profile.name} has timed "
                           f"({profile.largest_batch} sequences): give max_batch <= {profile.largest_batch}")


def charged(cost_profile: str | Path | None) -> str:
    """What a run charges, for a log line or a JSON field: the profile's name (a file's: the name it holds), or
    ``MACHINE`` for this machine's own cost model."""
    if cost_profile is None:
        return MACHINE
    return str(cost_profile) if (PROFILES_DIR / f"{cost_profile}.json").is_file() else load_profile(cost_profile).name


# --------------------------------------------------------------------------------------------------------------------
# Variations of a profile, for agents trained across hardware

def _scale_growth(values: list[float], growth: float) -> list[float]:
    """``values`` (a row along fed counts or batch sizes, first the smallest) with its rise above the first scaled by
    ``growth`` (floored so no point falls below 1/4 of the first: a forward never gets much cheaper by doing more)."""
    first = values[0]
    return [max(first + growth * (v - first), 0.25 * first) for v in values]


def _vary_forward(cost: ForwardCost, scale: float, fed_growth: float) -> ForwardCost:
    if cost.line is not None:
        a, b = cost.line
        return ForwardCost(per_context_ms=cost.per_context_ms * scale, line=(a * scale, b * scale * fed_growth))
    return ForwardCost(cost.fed, tuple(m * scale for m in _scale_growth(list(cost.ms), fed_growth)),
                       cost.per_context_ms * scale, cost.ref_context)


def _vary_batched(cost: BatchCost, scale: float, fed_growth: float, batch_growth: float) -> BatchCost:
    rows = [_scale_growth(list(row), fed_growth) for row in cost.ms]  # along fed, per batch size
    cols = [_scale_growth([row[j] for row in rows], batch_growth) for j in range(len(cost.fed))]  # along the batch
    ms = tuple(tuple(cols[j][i] * scale for j in range(len(cost.fed))) for i in range(len(cost.batch)))
    return BatchCost(cost.batch, cost.fed, ms, cost.per_context_ms * scale, cost.ref_context)


def vary(profile: CostProfile, draft_scale: float = 1.0, fed_growth: float = 1.0, batch_growth: float = 1.0,
         name: str | None = None) -> CostProfile:
    """A variation of ``profile``: the draft's forwards cost ``draft_scale`` times as much; each model's rise in cost
    with the tokens fed (above fed 1) is scaled by ``fed_growth`` and, in the batched tables, its rise with the batch
    (above one sequence) by ``batch_growth``. The target's fed-1 forward at one sequence is unchanged, so goodput
    against target-only decoding stays comparable across variations. All three must be finite numbers > 0, and the
    tables they make are checked as every table is (``calibration.model_faults``): a ProfileError where no machine
    could time them (``check_variations`` refuses a span that can draw such factors)."""
    for what, v in (("draft_scale", draft_scale), ("fed_growth", fed_growth), ("batch_growth", batch_growth)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ProfileError(f"{what} must be a finite number > 0, got {v!r}")
    name = name or f"{profile.name}*draft{draft_scale:.3g}*fed{fed_growth:.3g}*batch{batch_growth:.3g}"
    model, broken = _varied(profile.model, (draft_scale, fed_growth, batch_growth))
    if broken:
        raise ProfileError(f"{name}, a variation of {profile.name}: {broken}: give smaller factors")
    note = (f"a variation of {profile.name}: draft x{draft_scale:g}, growth with tokens fed x{fed_growth:g}, "
            f"with the batch x{batch_growth:g}")
    return replace(profile, name=name, model=replace(model, device=f"profile {name}"), note=note, source="")


def _varied(m: CostModel, factors: tuple[float, float, float]) -> tuple[CostModel | None, str | None]:
    """``m`` varied by ``(draft_scale, fed_growth, batch_growth)`` (``vary``), and why no machine could time it
    (``calibration.model_faults``' broken: a dip below half the smallest forward, odd for a timing, is how
    ``_scale_growth`` scales the noise of a table's rise) or None."""
    draft_scale, fed_growth, batch_growth = factors
    try:
        batched = None if m.batched is None else {
            role: _vary_batched(cost, draft_scale if role == "draft" else 1.0, fed_growth, batch_growth)
            for role, cost in m.batched.items()}
        model = replace(m, draft=_vary_forward(m.draft, draft_scale, fed_growth),
                        target=_vary_forward(m.target, 1.0, fed_growth), batched=batched)
    except ValueError as err:  # a time scaled past a float's range
        return None, str(err)
    return model, model_faults(model)[0]


def check_variations(profile: CostProfile, span: float, option: str = "vary_profiles") -> None:
    """Refuse (a ProfileError naming ``option`` and the largest span that would do) a ``span`` whose variations of
    ``profile`` (each factor of ``vary`` drawn log-uniformly in [1/span, span]) can make tables no machine could time.
    The eight extreme variations are checked: each time moves one way with each factor, so they bound every draw."""

    def fault(s: float) -> str | None:
        return next(filter(None, (_varied(profile.model, f)[1] for f in itertools.product((1 / s, s), repeat=3))),
                    None)

    if not (why := fault(span)):
        return
    low, high = 1.0, span
    for _ in range(20):  # the largest span that would do, to a few digits
        mid = math.sqrt(low * high)
        low, high = (mid, high) if fault(mid) is None else (low, mid)
    raise ProfileError(f"{option} {span:g} varies {profile.name} beyond any hardware ({why}): give {option} <= "
                       f"{math.floor(low * 100) / 100:g}")
