"""How the lean forward's products read their weights: the ways (``WAYS``: plain, oneDNN-packed, a transposed copy,
the weight on the left), each timed per count of rows fed (``time_ways``, ``choose_ways``), and the plan chosen once per
model, machine, kernel caps and thread count, stored beside the cost tables (``cached_plan``); ``RowProduct`` reads a
weight by the plan. ``bild_env.models.lean`` (whose docstring says why and what was measured) builds on these.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

logger = logging.getLogger("bild_env.models.lean")  # the plan's messages, as they were named


Product = Callable[[torch.Tensor], torch.Tensor]  # x (..., in) -> x @ W.T (..., out)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether torch's oneDNN can pack ``weight`` for linear products here (a CPU tensor in float32 or bfloat16, on a
    CPU whose instructions oneDNN packs that dtype for: ``_packs``)."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and _packs(weight.dtype))


@functools.cache
def _packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs a weight of ``dtype`` on this CPU: bfloat16 needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT,
    and on an AVX2-only AMD EPYC Zen 3 the reorder raised a RuntimeError; tried once on a small weight."""
    try:
        way_product(torch.ones(8, 8, dtype=dtype), "packed")(torch.ones(1, 8, dtype=dtype))
    except RuntimeError:
        return False
    return True


# The ways a product x (..., in) -> x @ W.T can read its weight W (out, in); each fastest somewhere. One Zen 5 core,
# the 30 layers of smollm2's target (python -m scripts.analysis.products; least ms of 7 rounds, fed 1 / 2 / 4 / 8 rows): float32
# under the AVX2 emulation, plain 24.5 / 39.2 / 35.2 / 43.2, packed 19.0 / 35.4 / 38.5 / 44.0, transposed 18.9 / 28.9
# / 35.3 / 42.5, weight_left 24.8 / 21.7 / 22.4 / 48.0; bfloat16, packed fastest at every count (8.5 / 8.8 / 9.1 / 11.3).
WAYS = ("plain", "packed", "transposed", "weight_left")
COPIED = ("packed", "transposed")  # the ways that read a copy of the weight (``weight_copy``), not the weight itself
ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 32)  # rows (tokens over the batch) a way is timed at: a step's fed counts, batches


def way_product(weight: torch.Tensor, way: str, copy: torch.Tensor | None = None) -> Product:
    """``x -> F.linear(x, weight)`` computed one of ``WAYS``:

    - "plain": ``F.linear(x, W)``;
    - "packed": oneDNN's product on ``copy``, W packed in its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``);
    - "transposed": ``x @ copy``, ``copy`` a contiguous W.T;
    - "weight_left": ``(W @ x.T).T``, W itself on the left: BLAS reads W row by row and x transposed, the
      fastest float32 kernel at 2-4 rows measured (a GEMV-like pass over W for each few columns of x).
    ``copy`` as ``weight_copy`` makes it (made here when not given).
    """
    if way == "plain":
        return lambda x: F.linear(x, weight)
    if way == "weight_left":
        def left(x: torch.Tensor) -> torch.Tensor:
            rows = x.reshape(-1, x.shape[-1])
            return torch.mm(weight, rows.t()).t().contiguous().view(*x.shape[:-1], weight.shape[0])
        return left
    copy = weight_copy(weight, way) if copy is None else copy
    if way == "packed":
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, copy, None, "none", [], "")
    if way == "transposed":
        return lambda x: x @ copy
    raise ValueError(f"unknown product way {way!r}; one of {WAYS}")


def weight_copy(weight: torch.Tensor, way: str) -> torch.Tensor | None:
    """The copy of ``weight`` a way reads (None for the ways that read ``weight`` itself)."""
    if way == "packed":
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)  # laid out for batch-1 products
    if way == "transposed":
        return weight.detach().t().contiguous()
    return None


class RowProduct:
    """A product that takes, for each number of rows it is fed (tokens over the batch), the way ``plan`` names
    (``plan[r]`` for r rows; the last entry beyond), reading the copies of its weight those ways need."""

    def __init__(self, weight: torch.Tensor, plan: tuple[str, ...]) -> None:
        self.plan = plan
        self.copies = {way: weight_copy(weight, way) for way in dict.fromkeys(plan[1:]) if way in COPIED}
        ways = {way: way_product(weight, way, self.copies.get(way)) for way in dict.fromkeys(plan[1:])}
        self._by_rows = [ways[way] for way in (plan[1],) + plan[1:]]  # index 0 (no rows) as 1

    @property
    def reads_weight(self) -> bool:
        """Whether a way of the plan reads the weight itself (not only a copy of it)."""
        return any(way not in COPIED for way in self.plan[1:])

    def original(self) -> torch.Tensor:
        """The weight (out, in), made again from a copy this product reads: the transposed copy's transpose (a view:
        no memory), else the packed copy's product with the identity (each output one weight times 1 plus zeros:
        the weight's own values). For a weight released where the plan reads only copies (``LeanLlamaModel.
        release_originals``)."""
        if "transposed" in self.copies:
            return self.copies["transposed"].t()
        packed = self.copies["packed"]
        eye = torch.eye(packed.shape[-1], dtype=packed.dtype, device=packed.device)  # (in, in): its product is W.T
        return torch.ops.mkldnn._linear_pointwise(eye, packed, None, "none", [], "").t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        return self._by_rows[rows if rows < len(self._by_rows) else -1](x)


def time_ways(weights: list[torch.Tensor], rows: tuple[int, ...] = ROWS, rounds: int = 5,
              ways: tuple[str, ...] = WAYS) -> dict[tuple[int, str], list[float]]:
    """Seconds each of ``ways`` takes for the products of all ``weights`` fed each count of ``rows``, in ``rounds``
    interleaved rounds (after one warm-up); "packed" only where oneDNN can pack every weight."""
    ways = tuple(w for w in ways if w != "packed" or all(can_pack(x) for x in weights))
    copies = {way: [weight_copy(w, way) for w in weights] for way in ways}
    products = {way: [way_product(w, way, c) for w, c in zip(weights, copies[way])] for way in ways}
    spent: dict[tuple[int, str], list[float]] = {(r, way): [] for r in rows for way in ways}
    with torch.inference_mode():
        xs = {r: [torch.randn(1, r, w.shape[1], dtype=w.dtype, device=w.device) for w in weights] for r in rows}
        for f, x in zip(products[ways[0]], xs[rows[0]]):
            f(x)  # warm up
        for _ in range(rounds):
            for r in rows:
                for way in ways:
                    t0 = time.perf_counter()
                    for f, x in zip(products[way], xs[r]):
                        f(x)
                    spent[(r, way)].append(time.perf_counter() - t0)
    return spent


TIMED_BYTES = 256 << 20  # the most weight bytes ``choose_ways`` times a way over (8x the L3 of a 2-core EPYC's share)


def timed_layers(layers: list[tuple[torch.Tensor, ...]], limit: int = TIMED_BYTES) -> list[tuple[torch.Tensor, ...]]:
    """The layers ``choose_ways`` times: every third, and fewer (evenly spread, at least one) where those would hold
    more than ``limit`` bytes. Every third layer of the smollm2 target holds 140 MB in float32; of the qwen2.5-coder
    target 1.9 GB, which every way, row count and round would stream again (a plan took over 10 minutes to choose)."""
    timed = layers[::3] or layers
    size = sum(w.numel() * w.element_size() for w in timed[0])
    keep = max(1, min(len(timed), limit // max(size, 1)))
    return [timed[round(i * (len(timed) - 1) / max(keep - 1, 1))] for i in range(keep)] if keep < len(timed) else timed


def choose_ways(layers: list[tuple[torch.Tensor, ...]], rows: tuple[int, ...] = ROWS, rounds: int = 5,
                ways: tuple[str, ...] = WAYS) -> dict[int, str]:
    """For each count of ``rows``, the fastest of ``ways`` (the least of ``rounds`` interleaved timings, ``time_ways``:
    what other processes on a shared CPU add is never negative, so the least is the steadiest estimate), each way
    timed over the products of every third layer of ``layers`` (the weights streamed from memory, as a forward reads
    them, not from a cache that one layer's weights would fit in; at most ``TIMED_BYTES``: ``timed_layers``). Timed in two passes; a count where they pick
    different ways is timed again with three times the rounds (a plan chosen in one pass on a busy AMD EPYC Zen 5
    ran smollm2's target plain at 5-6 rows, where ``scripts.analysis.products`` measures packed 40% faster on a quiet core)."""
    timed = timed_layers(layers)
    weights = [w for layer in timed for w in layer]

    def fastest(spent: dict, r: int) -> str:
        return min((way for (n, way) in spent if n == r), key=lambda way: min(spent[(r, way)]))

    first, second = (time_ways(weights, rows, rounds, ways) for _ in range(2))
    least: dict[tuple[int, str], float] = {}  # (rows, way): the least time of the timing that decides the count
    for r in rows:
        deciding = [first, second]
        if fastest(first, r) != fastest(second, r):  # a busy CPU slowed one way's rounds: time that count again, longer
            deciding = [time_ways(weights, (r,), 3 * rounds, ways)]
        for way in ways:
            times = [t for spent in deciding for t in spent.get((r, way), [])]
            if times:
                least[(r, way)] = min(times)
    return held_once(least, rows, max_forms=forms_affordable(_bytes(layers)))


def _bytes(layers: list[tuple[torch.Tensor, ...]]) -> int:
    return sum(w.numel() * w.element_size() for layer in layers for w in layer)


FORMS = {"plain": "weight", "weight_left": "weight", "packed": "packed", "transposed": "transposed"}  # what a way reads
MEMORY_GAIN = 0.05  # the least a form of the weights must save somewhere to be held (``held_once``)


MEMORY_SHARE = 1 / 8  # the most of this machine's memory the forms of one model's weights may hold (``forms_affordable``)


def forms_affordable(weight_bytes: int, share: float = MEMORY_SHARE) -> int:
    """How many forms of weights of ``weight_bytes`` (1 to 3: the weights, a packed and a transposed copy) fit in
    ``share`` of this machine's physical memory; at least 1. The smollm2 target's layers (425 MB in float32) may hold
    all three on a 24 GB machine; the qwen2.5-coder target's (4.2 GB) one: three forms of it (12.6 GB) beside the draft's
    leave a 24 GB machine too little memory for anything else."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX memory count: as if plenty
        return 3
    return max(1, min(3, int(share * memory // max(weight_bytes, 1))))


def held_once(least: dict[tuple[int, str], float], rows: tuple[int, ...], gain: float = MEMORY_GAIN,
              max_forms: int = 3) -> dict[int, str]:
    """For each count of ``rows`` the fastest way by ``least`` ((rows, way): seconds), among ways reading forms of
    the weights (``FORMS``: the weights themselves, a packed copy, a transposed copy) that each pay for the memory
    they hold: while more than one form is read, the one that saves the least is dropped if at no count where it is
    chosen it is ``gain`` (5%) faster than the best way without it. Each form held costs the weights' size (a plan
    reading only copies releases the weights: ``LeanLlamaModel.release_originals``). On a Zen 5 core in float32
    under the AVX2 emulation (``scripts.analysis.products``) the transposed copy was fastest at 6, 12 and 16 rows by 0.4-3.8%
    (and packed at 32 by 6%, weight_left at 2-4 by 35-45%, packed at 1 by 25%): it is not held, 425 MB less per
    process for the smollm2 target. Beyond ``max_forms`` forms (``forms_affordable``) the weakest is dropped whatever
    it saves."""
    def choose(forms: set[str]) -> dict[int, str]:
        return {r: min((w for (n, w) in least if n == r and FORMS[w] in forms), key=lambda w: least[(r, w)])
                for r in rows}

    chosen = choose({FORMS[w] for (_, w) in least})
    while len(used := {FORMS[w] for w in chosen.values()}) > 1:
        saves = {}
        for form in used:
            without = choose(used - {form})
            saves[form] = max(least[(r, without[r])] / least[(r, chosen[r])] - 1 for r in rows if FORMS[chosen[r]] == form)
        weakest = min(saves, key=saves.get)
        if saves[weakest] >= gain and len(used) <= max_forms:
            break
        chosen = choose(used - {weakest})
    return chosen


ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")  # kernels' caps
PLAN_FORMAT = 4  # of a stored plan (``plan_path``); 4: no more forms than the memory affords (``forms_affordable``);
# 3: each form of the weights held pays for its memory (``held_once``);
# 2: chosen in two passes (``choose_ways``); earlier ones are chosen again


def plan_key(layers: list[tuple[torch.Tensor, ...]], rows: tuple[int, ...] = ROWS, ways: tuple[str, ...] = WAYS) -> str:
    """The key a plan chosen for ``layers`` is stored under: the model's digest (every weight's shape and dtype, and
    a sample of its values), the rows and ways timed, the machine (``device_name``: CPU, instruction sets, torch's
    kernel level, threads), torch's version and the variables that cap the kernels (``ISA_VARIABLES``)."""
    import hashlib

    from bild_env.models.device import device_name

    digest = hashlib.sha1()
    for layer in layers:
        for w in layer:
            flat = w.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 64)][:64].float().cpu().numpy().tobytes()
            digest.update(f"{tuple(w.shape)}:{w.dtype}:".encode() + sample)
    env = ",".join(f"{v}={os.environ.get(v, '')}" for v in ISA_VARIABLES)
    device = layers[0][0].device if layers and layers[0] else torch.device("cpu")
    return "|".join((digest.hexdigest()[:16], f"rows={','.join(map(str, rows))}", f"ways={','.join(ways)}",
                     device_name(device), f"torch {torch.__version__}", env, f"forms<={forms_affordable(_bytes(layers))}"))


def plan_path(key: str):
    """Where the plan of ``key`` is stored: beside the cost tables, under the bild-gym cache."""
    from bild_env.paths import cache_dir, digest

    return cache_dir("costs") / f"lean-plan-{digest(key)}.json"


def cached_plan(layers: list[tuple[torch.Tensor, ...]]) -> tuple[str, ...]:
    """``row_plan(choose_ways(layers))``, chosen once per ``plan_key`` (model, machine, kernel caps, threads) and
    stored (``plan_path``): 2.8 s of every float32 load of the smollm2 pair saved; a stored plan that cannot be read
    is chosen again (and replaced), with a warning."""
    import json

    from bild_env.paths import write_atomic

    key = plan_key(layers)
    path = plan_path(key)
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
            if stored.get("format") == PLAN_FORMAT and stored.get("key") == key:
                plan = tuple(stored["plan"])
                if plan and plan[0] == "" and all(way in WAYS for way in plan[1:]):
                    logger.debug("lean products plan read from %s", path)
                    return plan
            logger.warning("the stored lean products plan %s is of another key or format: choosing it again", path)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
            logger.warning("the stored lean products plan %s cannot be used (%s): choosing it again", path, err)
    plan = row_plan(choose_ways(layers))
    write_atomic(path, json.dumps({"format": PLAN_FORMAT, "key": key, "plan": list(plan)}, indent=1))
    return plan


def row_plan(chosen: dict[int, str]) -> tuple[str, ...]:
    """``RowProduct``'s plan from ``choose_ways``'s choice: for r rows the way chosen at the smallest timed count >= r
    (the largest's beyond it)."""
    counts = sorted(chosen)
    return ("",) + tuple(chosen[next((c for c in counts if c >= r), counts[-1])] for r in range(1, counts[-1] + 1))


def describe_plan(plan: tuple[str, ...]) -> str:
    """``row_plan``'s choice in words: "1 packed, 2-4 weight_left, 5-32 transposed"."""
    parts, start = [], 1
    for r in range(2, len(plan) + 1):
        if r == len(plan) or plan[r] != plan[start]:
            parts.append(f"{start}{'' if r - 1 == start else f'-{r - 1}'} {plan[start]}")
            start = r
    return ", ".join(parts) + " rows (and beyond)"
