"""What the decoding loop itself costs beside the forwards, calibrated from the decoders.

A cost model built from bare forwards charges what the models compute, not what the clock charges: a
decoding step also reads logits (the draft's max and log-sum-exp, the target's log-softmax over every
verified row of a 49,152-token vocabulary), turns tensors into Python numbers, applies the BiLD rules
and crops caches. Measured on the ``smollm2`` pair that work made the wall clock 18-27% slower than
the forward tables, more for methods that draft more, enough to rank policies the wrong way.

``LoopCost`` (``bild_env.decoding.cost_model``, beside the tables it is added to) charges it per forward
of each model and per target row read:

    loop_ms(draft forward)                = draft_ms
    loop_ms(target forward fed n, cached) = target_ms + row_ms * n   (a verification reads n rows)
    loop_ms(target prefill)               = target_ms + row_ms       (reads the last row only)

``calibrate_loop`` decodes a few prompts with several methods (target only, naive speculative decoding,
BiLD at thresholds that draft little and much), times each generation on the clock, and fits the three
numbers by non-negative least squares to what the clock took beyond the forward tables
(``wall_ms - model_ms``), right after those tables were timed, so the machine has not drifted between
the two. ``CostModel.ms`` adds them to every forward it charges (``CostModel.loop``). It runs the
decoders, so this module sits above them; ``bild_env.decoding.costs.calibrate`` calls it.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence

import numpy as np

from bild_env.decoding.cost_model import CostModel, LoopCost
from bild_env.decoding.decoders import decode_with
from bild_env.prompts.sources import load_prompts

logger = logging.getLogger(__name__)

# (name, decoder kwargs): methods whose mixes of draft forwards, target forwards and verified rows differ
LOOP_METHODS: tuple[tuple[str, dict], ...] = (
    ("target only", {}),
    ("naive k=1", {"k": 1}),
    ("naive k=4", {"k": 4}),
    ("bild 0.9/0.5", {"fallback": 0.9, "rollback": 0.5}),
    ("bild 0.3/0.5", {"fallback": 0.3, "rollback": 0.5}),
    ("bild 0.05/4.0", {"fallback": 0.05, "rollback": 4.0}),
)
LOOP_PROMPTS = 3  # prompts decoded by every method
LOOP_NEW_TOKENS = 32  # tokens per generation
LOOP_REPEATS = 1  # timed rounds, after one untimed round of the first prompt (was 2 after a whole untimed round: 54
# generations, 3-6 minutes of the main job in float32 on an AVX2 CPU; 24 now, 18 rows for the fit's 3 numbers)


def features(stats, prompt_len: int) -> list[float]:
    """(draft forwards, target forwards, target rows read) of one generation's ``DecodeStats``.

    Every target forward after the prefill reads as many rows as it was fed; the prefill reads one.
    """
    return [stats.draft_forwards, stats.target_forwards, stats.target_tokens_fed - prompt_len + 1]


def fit_loop(x: Sequence[Sequence[float]], y: Sequence[float]) -> LoopCost:
    """The non-negative least-squares LoopCost for rows ``x`` of :func:`features` and extra clock ms ``y``."""
    from scipy.optimize import nnls

    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if a.ndim != 2 or a.shape[1] != 3 or a.shape[0] != b.shape[0] or a.shape[0] < 3:
        raise ValueError(f"fit_loop needs at least 3 rows of 3 features and one value per row, got {a.shape} and {b.shape}")
    coef, _ = nnls(a, b)
    return LoopCost(*(float(c) for c in coef))


def calibration_prompts(pair, n: int = LOOP_PROMPTS, tokens: int = 24) -> list[list[int]]:
    """``n`` fixed prompts of ``tokens`` ids each: the pair's builtin prompts (no dataset needed)."""
    prompts = load_prompts(pair.tokenizer, "builtin", "train", tokens, 4, limit=n)
    if not prompts:
        raise RuntimeError("no builtin prompt to calibrate the decoding loop's costs with")
    return prompts


def calibrate_loop(pair, tables: CostModel, prompts: Sequence[list[int]] | None = None,
                   new_tokens: int = LOOP_NEW_TOKENS, repeats: int = LOOP_REPEATS,
                   progress=None) -> tuple[LoopCost, dict[str, object]]:
    """Fit the loop's costs of ``pair`` beside the forward ``tables`` (a CostModel without loop costs).

    Every method of ``LOOP_METHODS`` decodes the first prompt untimed (kernels chosen, caches warmed: the forward
    tables were timed moments before), then every prompt, interleaved per prompt, in ``repeats`` timed rounds. Returns the fitted LoopCost and a report: per method the clock's
    and the tables' mean ms per generation, and the share of the clock the fit leaves unexplained. ``progress`` (a
    tqdm-like bar of forwards, optional) grows by ``new_tokens`` per generation and is advanced by as many after each
    (a generation costs about as much as that many target forwards).
    """
    prompts = list(prompts) if prompts is not None else calibration_prompts(pair)
    if progress is not None:
        progress.total = (progress.total or 0) + (repeats * len(prompts) + 1) * len(LOOP_METHODS) * new_tokens
    x, y, per_method = [], [], {name: [] for name, _ in LOOP_METHODS}
    for round_ in range(repeats + 1):
        for prompt in prompts[:1] if round_ == 0 else prompts:
            for name, kwargs in LOOP_METHODS:
                stats = decode_with(pair, prompt, kwargs, tables, new_tokens).stats
                if progress is not None:
                    progress.update(new_tokens)
                if round_ == 0:
                    continue  # kernels chosen and caches warmed
                x.append(features(stats, len(prompt)))
                y.append(stats.wall_ms - stats.model_ms)
                per_method[name].append((stats.wall_ms, stats.model_ms, x[-1]))
    loop = fit_loop(x, y)
    report = {}
    for name, rows in per_method.items():
        wall = statistics.fmean(r[0] for r in rows)
        model = statistics.fmean(r[1] for r in rows)
        charged = statistics.fmean(r[1] + loop_of(loop, r[2]) for r in rows)
        report[name] = {"clock_ms": wall, "tables_ms": model, "with_loop_ms": charged,
                        "tables_error": model / wall - 1, "with_loop_error": charged / wall - 1}
    return loop, report


def loop_of(loop: LoopCost, feats: Sequence[float]) -> float:
    """The loop ms that ``loop`` charges a generation with :func:`features` ``feats``."""
    return loop.draft_ms * feats[0] + loop.target_ms * feats[1] + loop.row_ms * feats[2]
