"""An acceptance predictor that also reads the context: does the proposal continue what the text already said?

The draft's max probability ranks its proposals about as well as a head on its hidden states (AUC ~0.85 on the
``smollm2`` pair). What neither sees is repetition: where the text so far contains the last n tokens before, and
the token that followed them then is the draft's proposal now, the target keeps that proposal far more often than
the draft's confidence says (prompt lookup decoding drafts from exactly this). ``LookupPredictor`` is a logistic
regression on

- the draft's max probability of the proposal;
- for each n in ``NGRAMS``: +1 if the last earlier occurrence of the context's final n tokens was followed by the
  proposal, -1 if by another token, 0 if the n tokens did not occur before (as two indicator columns);
- whether the proposal occurs anywhere in the context, and whether it repeats the context's last token.

It needs no forward: ``context_features`` costs microseconds per proposal. ``python -m distill lookup`` fits it on
TRAIN prompts of every domain (labels from the target's greedy continuations, as ``distill.positions``
collects them), reports it beside the max probability on held-out prompts, and writes ``LOOKUP_FILE`` beside the
draft when it beats the max probability on validation in every domain. Decoders read it as the scores
``"lookup"`` and ``"lookup_cumulative"`` (``bild_env.decoding.bild.DraftScore``)::

    predictor = lookup_for(pair)
    p = predictor.probability(p_max, context_ids, proposal)
"""

from __future__ import annotations

import array
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bild_env.paths import cache_dir, digest

LOOKUP_FILE = "acceptance_lookup.json"
NGRAMS: tuple[int, ...] = (1, 2, 3, 4, 6)  # suffix lengths looked up in the context
FEATURES: tuple[str, ...] = (
    "max_prob", *(f"agrees_{n}" for n in NGRAMS), *(f"differs_{n}" for n in NGRAMS), "in_context", "repeats_last")


def draft_key(fingerprint: str, draft_vocab: str = "") -> str:
    """What names a draft for its predictor: ``ModelPair.fingerprints[0]`` and ``ModelPair.draft_vocab`` (the
    proposals change with the restricted head)."""
    return f"{fingerprint}|draft-vocab={draft_vocab or 'full'}"


class LookupMismatchError(ValueError):
    """A lookup predictor that is missing or was fitted for another draft; the message says what to do."""


def _rfind_aligned(text: bytes, pattern: bytes, end: int) -> int:
    """The highest byte offset, a multiple of 4 (a token boundary), where ``pattern`` lies whole in ``text[:end]``;
    -1 if none."""
    at = text.rfind(pattern, 0, end)
    while at > 0 and at % 4:
        at = text.rfind(pattern, 0, at + len(pattern) - 1)  # the next match starting before this one
    return at


def context_features(context: Sequence[int] | np.ndarray, proposal: int) -> np.ndarray:
    """``FEATURES`` after the max probability (float32, ``len(FEATURES) - 1``) for ``proposal`` after ``context``.

    For n in ``NGRAMS``: the context's last n tokens are looked up at their latest earlier occurrence (ending before
    the context's last token); ``agrees_n`` is 1 if the token that followed it is ``proposal``, ``differs_n`` 1 if
    it is another token (both 0 if there is none). The token ids are searched as 4-byte words (``bytes.rfind``, a
    few microseconds for a few hundred tokens).
    """
    if isinstance(context, np.ndarray):
        text = np.ascontiguousarray(context, dtype=np.int32).tobytes()
    else:
        text = array.array("i", context).tobytes()
    size, k = len(text) // 4, len(NGRAMS)
    out = np.zeros(2 * k + 2, dtype=np.float32)
    if not size:
        return out
    word = struct.pack("i", proposal)
    out[2 * k] = float(_rfind_aligned(text, word, len(text)) >= 0)
    out[2 * k + 1] = float(text[-4:] == word)
    for i, n in enumerate(NGRAMS):
        if size - 1 < n:
            break
        at = _rfind_aligned(text, text[-4 * n:], 4 * (size - 1))  # an occurrence ending before the last token
        if at < 0:
            break  # no earlier occurrence of these n tokens, so none of a longer suffix
        out[i if text[at + 4 * n: at + 4 * n + 4] == word else k + i] = 1.0
    return out


@dataclass
class LookupPredictor:
    """P(the target's greedy token == the draft's proposal) = sigmoid(bias + weights . features) on ``FEATURES``."""

    weights: tuple[float, ...]
    bias: float
    draft: str = ""  # ``draft_key`` of the draft it was fitted on ("" = not checked)
    notes: dict = field(default_factory=dict, compare=False)  # how it was made (free form, saved)

    def __post_init__(self) -> None:
        self.weights = tuple(float(w) for w in self.weights)
        if len(self.weights) != len(FEATURES) or not all(math.isfinite(w) for w in (*self.weights, self.bias)):
            raise LookupMismatchError(f"a lookup predictor has {len(FEATURES)} finite weights ({', '.join(FEATURES)}) "
                                      f"and a finite bias; got {len(self.weights)} weights and bias {self.bias!r}")
        self._w = np.asarray(self.weights[1:], dtype=np.float64)

    def logit(self, p_max: float, context: Sequence[int] | np.ndarray, proposal: int) -> float:
        return float(self.bias + self.weights[0] * float(p_max) + self._w @ context_features(context, proposal))

    def probability(self, p_max: float, context: Sequence[int] | np.ndarray, proposal: int) -> float:
        """The predicted chance that the target keeps ``proposal`` (drafted with max probability ``p_max``) after
        ``context`` (the token ids before it: prompt, committed output and the run's earlier proposals)."""
        return 1.0 / (1.0 + math.exp(-self.logit(p_max, context, proposal)))

    def probabilities(self, features: np.ndarray) -> np.ndarray:
        """Vectorised over rows of ``FEATURES`` (N, F)."""
        z = self.bias + np.asarray(features, dtype=np.float64) @ np.asarray(self.weights)
        return 1.0 / (1.0 + np.exp(-z))


def save_lookup(predictor: LookupPredictor, path: str | Path) -> Path:
    """Write ``predictor`` as JSON to ``path`` (a folder gets ``LOOKUP_FILE``); returns the file."""
    path = Path(path)
    path = path / LOOKUP_FILE if path.is_dir() or not path.suffix else path
    path.parent.mkdir(parents=True, exist_ok=True)
    data = asdict(predictor) | {"features": list(FEATURES)}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def load_lookup(path: str | Path, key: str = "") -> LookupPredictor:
    """The predictor saved at ``path`` (a file, or a folder holding ``LOOKUP_FILE``); with ``key`` (the draft's
    ``draft_key``) ``LookupMismatchError`` unless it was fitted on that draft; always for a missing or foreign file."""
    path = Path(path)
    path = path / LOOKUP_FILE if path.is_dir() else path
    if not path.is_file():
        raise LookupMismatchError(f"no acceptance lookup predictor at {path}: fit one with `python -m distill lookup "
                                  "--pair <pair>`, or score by the draft's max probability (score 'token' or "
                                  "'cumulative')")
    try:
        data = json.loads(path.read_text())
        if data.pop("features") != list(FEATURES):
            raise ValueError(f"its features are not {list(FEATURES)}")
        predictor = LookupPredictor(**data)
    except Exception as err:  # a truncated or foreign file: say which
        raise LookupMismatchError(f"{path} is not an acceptance lookup predictor of this version "
                                  f"({type(err).__name__}: {err}); fit one again with `python -m distill lookup "
                                  "--pair <pair>`") from err
    if key and predictor.draft and key != predictor.draft:
        raise LookupMismatchError(f"{path} was fitted on draft {predictor.draft!r}, this pair's draft is {key!r}: "
                                  "fit one for it with `python -m distill lookup --pair <pair>`")
    return predictor


def lookup_path(pair, adopted: bool = True) -> Path:
    """Where ``pair``'s predictor lives: beside its draft (``LOOKUP_FILE`` in the draft's folder) when it was
    adopted, else in the cache under the draft's key."""
    folder = Path(pair.ids[0])
    if adopted and folder.is_dir():
        return folder / LOOKUP_FILE
    return cache_dir("acceptance") / f"lookup-{digest(draft_key(pair.fingerprints[0], pair.draft_vocab))}.json"


_LOADED: dict[tuple[str, int, str], LookupPredictor] = {}  # (file, its mtime, draft key) -> the predictor read


def lookup_for(pair) -> LookupPredictor:
    """``pair``'s lookup predictor: the one beside its draft, else the one ``python -m distill lookup`` left in the
    cache (not adopted: it did not beat the max probability on validation); ``LookupMismatchError`` saying what to
    do when there is none or it was fitted on another draft. A file is read once (again when it changes)."""
    key = draft_key(pair.fingerprints[0], pair.draft_vocab)
    for path in (lookup_path(pair, True), lookup_path(pair, False)):
        if path.is_file():
            at = (str(path), path.stat().st_mtime_ns, key)
            if at not in _LOADED:
                _LOADED[at] = load_lookup(path, key)
            return _LOADED[at]
    return load_lookup(lookup_path(pair, True), key)  # raises, naming the command
