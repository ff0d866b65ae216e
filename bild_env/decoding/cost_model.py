"""The pair's latency cost model: what each forward of the draft and the target costs, in milliseconds.

``CostModel`` holds one ``ForwardCost`` per model (``bild_env.decoding.forward_costs``: a batch of one),
optionally their ``BatchCost`` tables (``bild_env.decoding.batch_costs``: B sequences per forward) and
the decoding loop's own work around each forward (``LoopCost``), and saves and reads them as JSON
(``FORMAT``). Rewards computed with it are noise-free and reproducible (latency mode ``"model"``). A
plain ``(a, b, c)`` given for a model is the linear model ``ms = a + b * fed + c * context``.

The runners charge every forward to it (``bild_env.decoding.runner.count_forward``); it is timed,
stored and checked per machine by ``bild_env.decoding.costs`` (``load_or_calibrate``), which
re-exports these names.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bild_env.decoding.batch_costs import BatchCost
from bild_env.decoding.forward_costs import IMPOSSIBLE_FACTOR, ForwardCost
from bild_env.paths import write_atomic

FORMAT = 3  # of the saved JSON; 2 had no costs of the decoding loop; 1 (no "format" field) was one least-squares line (a, b, c) per model


class CostFormatError(ValueError):
    """A saved cost model of another format (or not one at all)."""


@dataclass(frozen=True)
class LoopCost:
    """Milliseconds of the decoding loop's own work: per draft forward, per target forward, per target row read.

    What a decoding step does beside the forwards (reading logits, turning tensors into Python numbers, the
    BiLD rules, cropping caches), charged per forward of each model and per target row read:

        loop_ms(draft forward)                = draft_ms
        loop_ms(target forward fed n, cached) = target_ms + row_ms * n   (a verification reads n rows)
        loop_ms(target prefill)               = target_ms + row_ms       (reads the last row only)

    Fitted on the clock by ``bild_env.decoding.loop_costs.calibrate_loop``.
    """

    draft_ms: float = 0.0
    target_ms: float = 0.0
    row_ms: float = 0.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"LoopCost.{name} must be a finite number >= 0, got {value!r}")

    def __call__(self, role: str, fed: int, context: int) -> float:
        """The loop's work around one forward of ``role`` fed ``fed`` tokens on ``context`` cached ones."""
        if role == "draft":
            return self.draft_ms
        return self.target_ms + self.row_ms * (fed if context else 1)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def of(cls, value) -> LoopCost | None:
        """A LoopCost from itself, its dict, or None."""
        if value is None or isinstance(value, LoopCost):
            return value
        if isinstance(value, dict):
            return cls(**{k: float(v) for k, v in value.items()})
        raise TypeError(f"a loop cost is a LoopCost or a dict of its fields, not {type(value).__name__}")


@dataclass(frozen=True)
class CostModel:
    """The forward costs (ms) of the pair's draft and target on ``device``.

    ``CostModel(draft=(a, b, c), target=(a, b, c))`` is the linear model ``a + b * fed + c * context``;
    ``costs.calibrate`` builds measured tables. ``device`` is the cache key's name of the device
    (``device_name``), ``machine`` the machine it was timed on in words (``machine_description``; "" when
    not recorded), ``batched`` the optional tables of batched forwards, ``{"draft": BatchCost, "target":
    BatchCost}`` (``costs.load_or_calibrate_batched``; read by ``batch_ms``), ``loop`` the decoding loop's
    own work added to every forward ``ms`` charges (None: bare forwards).
    """

    draft: ForwardCost = field(default_factory=lambda: ForwardCost.linear(0.0, 0.0, 0.0))
    target: ForwardCost = field(default_factory=lambda: ForwardCost.linear(0.0, 0.0, 0.0))
    device: str = "unspecified"
    machine: str = ""
    batched: dict[str, BatchCost] | None = field(default=None, hash=False)
    loop: LoopCost | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "draft", ForwardCost.of(self.draft))
        object.__setattr__(self, "target", ForwardCost.of(self.target))
        object.__setattr__(self, "loop", LoopCost.of(self.loop))
        if self.batched is not None:
            if set(self.batched) != {"draft", "target"}:
                raise ValueError(f"batched tables are keyed 'draft' and 'target', not {sorted(self.batched)}")
            object.__setattr__(self, "batched", {role: BatchCost.of(self.batched[role]) for role in ("draft", "target")})

    def _role(self, role: str) -> ForwardCost:
        if role == "draft":
            return self.draft
        if role == "target":
            return self.target
        raise ValueError(f"role must be 'draft' or 'target', not {role!r}")

    def ms(self, role: str, fed: int, context: int) -> float:
        """Milliseconds of one forward of ``role`` fed ``fed`` tokens on ``context`` cached ones, with the
        decoding loop's own work around it when the model has loop costs (``loop``)."""
        forward = self._role(role)(fed, context)
        return forward if self.loop is None else forward + self.loop(role, fed, context)

    def target_only_ms(self, first_position: int, n: int) -> float:
        """Time of target-only decoding for the tokens at positions ``first_position .. +n-1`` (the sum of
        ``ms("target", 1, q - 1)`` over them, in closed form: the token at position q comes from a
        one-token forward over q - 1 cached tokens)."""
        loop = 0.0 if self.loop is None else n * self.loop("target", 1, 1)
        return self.target.one_token_sum(first_position - 1, n) + loop

    def forwards_only(self) -> CostModel:
        """This model without loop costs: what the bare forwards cost."""
        return replace(self, loop=None)

    def batch_ms(self, role: str, batch: int, fed: int, context: float) -> float:
        """Milliseconds of one forward of ``role`` over ``batch`` sequences, each fed ``fed`` tokens on ``context``
        cached ones (a mean over the rows will do): the batched table where the model has one; without one,
        ``ms`` for a batch of one, and a ValueError for larger batches."""
        self._role(role)
        if batch < 1:
            raise ValueError(f"a forward runs at least one sequence, not batch={batch}")
        if self.batched is not None:
            return self.batched[role](batch, fed, context)
        if batch == 1:
            return self.ms(role, fed, context)
        raise ValueError(f"this cost model has no batched table, so it cannot cost a forward of {batch} sequences: "
                         "get one with bild_env.decoding.costs.load_or_calibrate_batched(pair) (batched forwards "
                         "timed once per machine and cached), or build BatchCost tables and pass batched=")

    def batch_costs(self, role: str) -> tuple[float, float]:
        """(fixed_ms, per_token_ms) of ``role``'s forward: a two-number summary to plan batched forwards by."""
        return self._role(role).batch_costs()

    def to_dict(self) -> dict[str, object]:
        batched = None if self.batched is None else {role: cost.to_dict() for role, cost in self.batched.items()}
        return {"format": FORMAT, "device": self.device, "machine": self.machine, "draft": self.draft.to_dict(),
                "target": self.target.to_dict(), "batched": batched,
                "loop": None if self.loop is None else self.loop.to_dict()}

    def save(self, path: Path) -> None:
        """Write the model as JSON to ``path``, atomically (a reader sees the old file or the new one)."""
        _write_json(Path(path), self.to_dict())

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        found = d.get("format", 1) if isinstance(d, dict) else None
        if found != FORMAT:
            raise CostFormatError(f"cost model of format {found}, this version reads format {FORMAT}")
        try:
            roles = {role: _role_of(ForwardCost.of, d, role) for role in ("draft", "target")}
            batched = d.get("batched")
            if batched is not None:
                batched = {role: _role_of(BatchCost.of, batched, role, "batched ") for role in ("draft", "target")}
            return cls(roles["draft"], roles["target"], str(d["device"]), str(d.get("machine") or ""), batched,
                       d.get("loop"))
        except (KeyError, TypeError, ValueError) as err:
            raise CostFormatError(f"a malformed cost model of format {FORMAT}: {err}") from err

    @classmethod
    def load(cls, path: Path) -> CostModel:
        """The model saved in ``path``; CostFormatError when it is of another format or unreadable JSON."""
        try:
            d = json.loads(Path(path).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CostFormatError(f"not a cost model (no JSON): {err}") from err
        return cls.from_dict(d)


def _role_of(read: Callable[[object], object], d: dict, role: str, prefix: str = ""):
    """``read(d[role])``, its errors naming the table (``the batched target table: ...``)."""
    try:
        return read(d[role])
    except KeyError:
        raise ValueError(f"no {prefix}{role} table") from None
    except (TypeError, ValueError) as err:
        raise ValueError(f"the {prefix}{role} table: {err}") from None


def _implausible(tables: dict[str, ForwardCost | BatchCost]) -> str | None:
    """The first of ``tables`` (by name) that cannot be timings, and why, in words; None where all can."""
    for name, cost in tables.items():
        if why := cost.implausible():
            return f"its {name} table is no timing of forwards: {why}"
    return None


def impossible(tables: dict[str, ForwardCost | BatchCost], base: CostModel | None = None) -> str | None:
    """The first of ``tables`` (by name) that no machine could have timed, and why (``ForwardCost.impossible``,
    ``BatchCost.impossible``); with ``base``, also a batched table whose one sequence is ``IMPOSSIBLE_FACTOR`` off
    the base model's forward of the same role (timed in the same calibration). None where none is."""
    for name, cost in tables.items():
        if why := cost.impossible():
            return f"its {name} table cannot be a timing: {why}"
    for name, cost in tables.items():
        role = name.removeprefix("batched ")
        if base is None or not isinstance(cost, BatchCost) or role not in ("draft", "target"):
            continue
        for f in cost.fed:
            one, alone = cost(1, f, cost.ref_context), base._role(role)(f, cost.ref_context)
            if not alone / IMPOSSIBLE_FACTOR <= one <= alone * IMPOSSIBLE_FACTOR:
                return (f"its {name} table cannot be a timing: one sequence fed {f} takes {one:.4g} ms there and "
                        f"{alone:.4g} ms in the {role}'s forward timed with it")
    return None


def _write_json(path: Path, value: object) -> None:
    """``value`` as standard JSON in ``path`` (no NaN or Infinity: the tables hold finite numbers), written whole
    (``bild_env.paths.write_atomic``)."""
    write_atomic(path, json.dumps(value, indent=1, allow_nan=False))


def describe(model: CostModel) -> str:
    """The cost model in a line of words (ms by tokens fed, the slope, the loop's costs), for a log."""
    parts = []
    for role in ("draft", "target"):
        cost = model._role(role)
        parts.append(f"{role} ms by tokens fed " + " ".join(f"{f}:{cost(f, cost.ref_context):.1f}" for f in (1, 2, 4, 8, 12))
                     + f" at {cost.ref_context} cached, +{cost.per_context_ms:.4f}/cached token")
        if cost.line is not None:
            parts[-1] = f"{role} ms = {cost.line[0]:.2f} + {cost.line[1]:.2f}/token + {cost.per_context_ms:.4f}/cached token"
    if model.loop is not None:
        parts.append(f"loop ms per draft forward {model.loop.draft_ms:.2f}, per target forward {model.loop.target_ms:.2f}, "
                     f"per target row read {model.loop.row_ms:.3f}")
    return "; ".join(parts)
