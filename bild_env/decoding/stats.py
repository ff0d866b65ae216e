"""Statistics every decoder reports, per BiLD step and per whole generation."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


LOW_CONFIDENCE = 0.5  # a draft prediction below this max probability counts as a low-confidence guess


@dataclass
class DecodeStats:
    """Counters of one decoding step or of a whole generation (they add up).

    Units: times in milliseconds; ``model_ms`` is the cost-model time of the same forwards
    (None when no cost model was given).
    """

    new_tokens: int = 0  # tokens committed to the output
    proposed: int = 0  # draft tokens proposed (committed before verification)
    accepted: int = 0  # proposed draft tokens that survived verification
    full_accepts: int = 0  # verifications that accepted every proposed token (at least one)
    fallbacks: int = 0  # draft runs ended by the fallback policy (max prob < fallback threshold)
    max_draft_hits: int = 0  # draft runs ended by reaching max_draft_len
    rollbacks: int = 0  # verifications that rolled back a draft token
    discarded: int = 0  # committed tokens undone by rollbacks
    mismatches: int = 0  # committed tokens that differ from the target's argmax at their position
    regret: float = 0.0  # nats: sum over committed tokens of log p_L(target's argmax) - log p_L(token), read from the verifying forward
    steps: int = 0  # BiLD steps (draft phase + verification); speculative: rounds
    guesses: int = 0  # BiLD: draft predictions the target judged (proposed tokens up to a rollback, and the one a fallback withheld)
    guesses_right: int = 0  # those equal to the target's argmax at their position
    guess_p: float = 0.0  # sum of the draft's max probability over those predictions
    low_guesses: int = 0  # those made with max probability below LOW_CONFIDENCE
    low_guesses_right: int = 0  # and right
    draft_forwards: int = 0
    target_forwards: int = 0
    draft_tokens_fed: int = 0
    target_tokens_fed: int = 0
    wall_ms: float = 0.0
    forward_ms: float = 0.0  # wall time inside model forwards (device synchronized)
    model_ms: float | None = None

    # The arithmetic reads and writes the instance dicts: it runs for every step of every request of the
    # serving env, where getattr/setattr per field was a tenth of a warm step.
    def __iadd__(self, other: DecodeStats) -> DecodeStats:
        mine, theirs = self.__dict__, other.__dict__
        for name in _NUMBERS:
            mine[name] += theirs[name]
        a, b = mine["model_ms"], theirs["model_ms"]
        mine["model_ms"] = None if a is None or b is None else a + b
        return self

    def __sub__(self, other: DecodeStats) -> DecodeStats:
        out = DecodeStats()
        mine, theirs, new = self.__dict__, other.__dict__, out.__dict__
        for name in _NUMBERS:
            new[name] = mine[name] - theirs[name]
        a, b = mine["model_ms"], theirs["model_ms"]
        new["model_ms"] = None if a is None or b is None else a - b
        return out

    def copy(self) -> DecodeStats:
        out = object.__new__(DecodeStats)  # every field is a scalar
        out.__dict__.update(self.__dict__)
        return out

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / proposed draft tokens; None when nothing was proposed (target only)."""
        return self.accepted / self.proposed if self.proposed else None

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target forward (1.0 for target-only decoding)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    def add_guess(self, p: float, right: bool) -> None:
        """Count one draft prediction (max probability ``p``) the target judged ``right`` or not."""
        self.guesses += 1
        self.guesses_right += right
        self.guess_p += p
        if p < LOW_CONFIDENCE:
            self.low_guesses += 1
            self.low_guesses_right += right

    @property
    def regret_per_token(self) -> float:
        """Mean regret in nats per committed token (0 for every lossless method, on any dtype)."""
        return self.regret / self.new_tokens if self.new_tokens else 0.0

    @property
    def fidelity(self) -> float:
        """Share of committed tokens equal to the target's argmax at their position (1 for lossless methods)."""
        return 1.0 - self.mismatches / self.new_tokens if self.new_tokens else 1.0

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.new_tokens / self.wall_ms if self.wall_ms > 0 else 0.0

    @property
    def overhead(self) -> float:
        """Share of wall time spent outside model forwards (engine overhead)."""
        return max(0.0, 1.0 - self.forward_ms / self.wall_ms) if self.wall_ms > 0 else 0.0

    def summary(self) -> dict[str, float | int | None]:
        """All counters plus the derived rates, for logs and JSON."""
        out: dict[str, float | int | None] = asdict(self)
        out.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            regret_per_token=self.regret_per_token,
            fidelity=self.fidelity,
            tokens_per_s=self.tokens_per_s,
            overhead=self.overhead,
        )
        return out


_FIELDS = tuple(f.name for f in fields(DecodeStats))
_NUMBERS = tuple(name for name in _FIELDS if name != "model_ms")  # never None (model_ms is None without a cost model)


@dataclass
class Generation:
    """What a decoder returns: the new token ids (after the prompt), their text, and statistics."""

    prompt_ids: list[int]
    new_ids: list[int]
    text: str
    stats: DecodeStats
