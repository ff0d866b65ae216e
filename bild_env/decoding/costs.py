"""A deterministic latency model of the pair's forwards, calibrated by timing them.

Each forward of model M that feeds ``fed`` new tokens on top of ``context`` cached tokens costs

    ms = a_M + b_M * fed + c_M * context

fitted by least squares to median timings on the current device. With it, env rewards are
noise-free and reproducible (latency mode ``"model"``); the fit is stored per pair and device.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from bild_env.decoding.kv import crop_cache
from bild_env.models.device import device_name, sync
from bild_env.paths import cache_dir, digest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CostModel:
    """Coefficients (a, b, c) in ms, ms/token, ms/cached-token for each model, and the device."""

    draft: tuple[float, float, float]
    target: tuple[float, float, float]
    device: str = "unspecified"

    def ms(self, model: str, fed: int, context: int) -> float:
        a, b, c = self.draft if model == "draft" else self.target
        return a + b * fed + c * context

    def target_only_ms(self, first_position: int, n: int) -> float:
        """Time of target-only decoding for the tokens at positions ``first_position .. +n-1`` (the sum of
        ``ms("target", 1, q - 1)`` over them, in closed form: the token at position q comes from a
        one-token forward over q - 1 cached tokens)."""
        a, b, c = self.target
        return n * (a + b) + c * (n * (first_position - 1) + n * (n - 1) / 2)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> CostModel:
        d = json.loads(path.read_text())
        return cls(tuple(d["draft"]), tuple(d["target"]), d["device"])


@torch.inference_mode()
def time_forwards(model: torch.nn.Module, fed: tuple[int, ...], context: int, device: torch.device,
                  repeats: int) -> list[tuple[int, int, float]]:
    """Median ms of forwards feeding each of ``fed`` tokens on ``context`` cached ones (one prefill)."""
    from transformers import DynamicCache

    vocab = model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(context)
    ids = torch.randint(0, vocab, (1, context + max(fed)), generator=gen).to(device)
    cache = DynamicCache(config=model.config)
    if context:
        model(ids[:, :context], past_key_values=cache, use_cache=True, logits_to_keep=1)
    rows = []
    for f in fed:
        times = []
        for _ in range(repeats):
            sync(device)
            t0 = time.perf_counter()
            out = model(ids[:, context : context + f], past_key_values=cache, use_cache=True, logits_to_keep=f)
            out.logits[0, -1].argmax().item()  # read a result, as the decoders do (synchronizes)
            times.append((time.perf_counter() - t0) * 1000.0)
            crop_cache(cache, context)
        rows.append((f, context, statistics.median(times)))
    return rows


def _fit(rows: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    x = np.array([[1.0, fed, ctx] for fed, ctx, _ in rows])
    y = np.array([ms for _, _, ms in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    a, b, c = (max(0.0, float(v)) for v in coef)  # a cost never decreases with more work
    if a == 0.0:
        a = float(min(y))
    return (a, b, c)


def calibrate(pair, fed: tuple[int, ...] = (1, 2, 4, 8, 12), contexts: tuple[int, ...] = (16, 96, 224),
              repeats: int = 3) -> CostModel:
    """Time both models of ``pair`` over a grid of (fed, context) and fit the cost model.

    Each context is prefilled once; after every timed forward the cache is cropped back to it.
    """
    contexts = tuple(c for c in contexts if c + max(fed) <= pair.max_positions) or (0,)
    coefs = {}
    for role in ("draft", "target"):
        model = getattr(pair, role)
        time_forwards(model, (1,), contexts[0], pair.device, 2)  # warm-up
        rows = [row for c in contexts for row in time_forwards(model, fed, c, pair.device, repeats)]
        coefs[role] = _fit(rows)
    return CostModel(coefs["draft"], coefs["target"], device_name(pair.device))


def load_or_calibrate(pair, refresh: bool = False) -> CostModel:
    """The stored cost model of ``pair`` on this device, calibrating (and storing) it once."""
    name = device_name(pair.device)
    path = cache_dir("costs") / f"{digest(pair.key, name)}.json"
    if path.exists() and not refresh:
        return CostModel.load(path)
    logger.info("timing the pair's forwards on %s to fit the latency cost model (once; cached in %s)", name, path)
    t0 = time.perf_counter()
    model = calibrate(pair)
    model.save(path)
    logger.info("cost model ready in %.0f s: draft ms = %.2f + %.2f/token + %.4f/cached token; target ms = %.2f + "
                "%.2f/token + %.4f/cached token", time.perf_counter() - t0, *model.draft, *model.target)
    return model
