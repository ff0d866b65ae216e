"""Where a draft forward's time goes, and the draft forward against the target's, before and after.

    python -m scripts.analysis.draft_forward --pair smollm2 --threads 1 --out results/bench_draft_forward_smollm2.json
    python -m scripts.analysis.draft_forward --pair smollm2 --threads 1 --drafts /tmp/draft_l3 /tmp/draft_l4  # other drafts beside
    python -m scripts.analysis.draft_forward --pair tiny-random --repeats 5 --profile-steps 3 --agreement-prompts 2 \\
        --agreement-tokens 4 --domains prose --draft-vocab 1000 --out /tmp/df.json          # seconds (smoke run)

Three parts, all on one forward fed 1 token after ``--context`` cached ones (what a drafting step runs):

1. Breakdown, per model (draft and target, transformers' forward): ``torch.profiler`` splits a forward into
   the head's matrix product (the logits over the vocabulary), the layers' matrix products, attention, the
   other operators (norms, rotary embedding, cache concatenation, masks), and the time outside operators
   (Python, module calls, transformers' per-call bookkeeping: the forward's time minus its operators'). Beside
   it, timed without the profiler: the body (``model.model``), the head on one hidden state, the readout
   (``draft_readout``), and the same architecture with tiny matrices (4 dims per head, vocabulary 64): what
   a forward costs whatever the size of its matrices.
2. Forwards, interleaved: every variant runs once per round, ``--repeats`` rounds, so a slow spell of a
   shared machine falls on all alike; the median ms of each and its ratio to the target's (transformers'
   forward, then the lean one). A draft step is ``single_forward`` + ``draft_readout`` (``LiveRunner.draft_next``),
   a target step ``single_forward`` + ``target_readout`` (``target_verify`` fed 1 token). Variants: the target
   and the draft as loaded ("before"), with the lean forward (``bild_env.models.lean``; packed weights where
   measured faster, and unpacked), with the head restricted to each ``--draft-vocab`` K of the most frequent
   train-split tokens (``bild_env.models.draft_head``), and lean with each restricted head, and that again "before
   the trims" (``LeanLlamaModel.trimmed`` off: the norm modules and transformers' causal-LM forward, and the
   head's logits spread over the vocabulary then selected back for the readout); with ``--compile``
   also the draft under ``torch.compile`` (its compile time, and its argmaxes through a cache crop); with ``--drafts`` also other
   draft folders (a shallower one, say), lean with each restricted head, against the same target in the same rounds.
3. Agreement, per domain: on ``--agreement-prompts`` validation prompts, the target's greedy continuation of
   ``--agreement-tokens`` tokens; at each of its positions the draft's argmax with its full head and with each
   restricted head: how often it equals the target's token, the draft's mean confidence (max probability,
   what BiLD's fallback reads) where it agrees and where not, and how many target tokens the K ids hold.

Writes everything as JSON with the machine (``machine_description``) and the machine's load.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bild_env.cli import parse_dataclass, setup_logging
from bild_env.decoding.kv import Row, crop_cache, draft_readout, single_forward, target_readout
from bild_env.models.compat import cache_kwarg
from bild_env.models.device import machine_description
from bild_env.models.draft_head import (draft_vocab_ids, load_workload_counts, proposal_ids, proposal_logits,
                                        restrict_head)
from bild_env.models.lean import make_lean
from bild_env.models.pairs import DEFAULT_PAIR, ModelPair, load_pair

logger = logging.getLogger("scripts.analysis.draft_forward")


@dataclass(frozen=True)
class DraftForwardConfig:
    """Options of ``python -m scripts.analysis.draft_forward`` (every default lives here)."""

    pair: str = field(default=DEFAULT_PAIR, metadata={"help": "model pair preset"})
    dtype: str = field(default="", metadata={"help": (
        'the pair\'s dtype ("": the preset\'s; auto: bfloat16 on a CPU with native bfloat16)')})
    threads: int = field(default=1, metadata={"help": "torch CPU threads"})
    context: int = field(default=100, metadata={"help": "cached tokens before each timed forward (fed 1 token)"})
    repeats: int = field(default=200, metadata={"help": "timed rounds; each round runs every variant once"})
    draft_vocab: tuple[int, ...] = field(default=(4096, 8192, 16384), metadata={"help": (
        "sizes of the restricted draft heads to time and measure")})
    profile_steps: int = field(default=40, metadata={"help": "profiled forwards per model for the breakdown"})
    agreement_prompts: int = field(default=24, metadata={"help": (
        "validation prompts per domain for the greedy agreement (0: skip that part)")})
    agreement_tokens: int = field(default=32, metadata={"help": "target greedy tokens per prompt"})
    domains: tuple[str, ...] = field(default=("prose", "code", "chat"), metadata={"help": (
        "domains of the agreement part")})
    compile: bool = field(default=False, metadata={"help": (
        "also time torch.compile of the draft (dynamic shapes): its compile time and forwards")})
    drafts: tuple[str, ...] = field(default=(), metadata={"help": (
        "other draft folders (e.g. a shallower distilled draft) timed beside the preset's, lean with each "
        "--draft-vocab head")})
    note: str = field(default="", metadata={"help": "what else ran on the machine meanwhile (written to the JSON)"})
    out: str = field(default="results/bench_draft_forward.json", metadata={"help": "where the JSON goes"})


# ---------------------------------------------------------------- one timed step


def _prefilled(model: torch.nn.Module, context: int):
    """A DynamicCache holding ``context`` fixed tokens run through ``model``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = (torch.arange(context) * 7919 + 100) % model.get_input_embeddings().weight.shape[0]
    single_forward(model, Row(ids.tolist(), cache, 1))
    return cache


def make_step(role: str, model: torch.nn.Module, context: int, spread: bool = False) -> Callable[[], None]:
    """One decoding step of ``role`` fed 1 token after ``context`` cached ones (the cache is cropped back after it).

    ``spread``: a restricted head's logits spread over the vocabulary (-inf elsewhere) and its K columns selected
    back for the readout (the way the decoders once read them, kept for comparison)."""
    cache = _prefilled(model, context)
    ids = proposal_ids(model)

    def step() -> None:
        if spread:
            z = single_forward(model, Row([42], cache, 1))
            draft_readout(z if ids is None else z.index_select(-1, ids), ids)
        else:
            with proposal_logits(model) as columns:  # a restricted head's K columns, as LiveRunner.draft_next reads them
                z = single_forward(model, Row([42], cache, 1))
            draft_readout(z, columns) if role == "draft" else target_readout(z, [])
        crop_cache(cache, context)

    return step


def _ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_interleaved(steps: dict[str, Callable[[], None]], repeats: int, seed: int = 0) -> dict[str, list[float]]:
    """ms of every step, ``repeats`` rounds, each round running every step once (after one untimed round), in an
    order shuffled each round: a step right after one that read the same weights finds them in the CPU's caches,
    after a target's forward it does not, and a fixed order would hand one variant the warm place every round."""
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    order, rng = list(steps), random.Random(seed)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            times[name].append(_ms(steps[name]))
    return times


def _summary(ms: list[float]) -> dict[str, float]:
    q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return {"median_ms": statistics.median(ms), "q1_ms": q[0], "q3_ms": q[2]}


# ---------------------------------------------------------------- 1. breakdown


def _category(name: str, shapes: list, head_rows: int) -> str:
    if "scaled_dot_product" in name:
        return "attention"
    if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::mv"):  # weights come transposed: (in, out)
        return "head matmul" if any(s and s[-1] == head_rows for s in shapes) else "layer matmuls"
    if name == "mkldnn::_linear_pointwise":  # packed weights: (out, in)
        return "head matmul" if len(shapes) > 1 and shapes[1] and shapes[1][0] == head_rows else "layer matmuls"
    return "other ops"


def profile_forward(model: torch.nn.Module, context: int, steps: int) -> dict[str, float]:
    """ms per forward (fed 1 token) by category, from ``torch.profiler`` (operators' own time, and the rest)."""
    from torch.profiler import ProfilerActivity, profile

    cache = _prefilled(model, context)

    def forward() -> None:
        single_forward(model, Row([42], cache, 1))
        crop_cache(cache, context)

    for _ in range(3):
        forward()
    head_rows = model.get_output_embeddings().weight.shape[0]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        wall = sum(_ms(forward) for _ in range(steps))
    parts = {"head matmul": 0.0, "layer matmuls": 0.0, "attention": 0.0, "other ops": 0.0}
    for avg in prof.key_averages(group_by_input_shape=True):
        parts[_category(avg.key, avg.input_shapes, head_rows)] += avg.self_cpu_time_total / 1e3
    out = {name: ms / steps for name, ms in parts.items()}
    out["outside operators (Python, per-call bookkeeping)"] = wall / steps - sum(out.values())
    out["forward under the profiler"] = wall / steps
    return out


def tiny_twin(model: torch.nn.Module) -> torch.nn.Module | None:
    """The same Llama architecture (layers, heads) with 4 dims per head, intermediate 16 and 64 tokens (None: not Llama)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = model.config
    if config.model_type != "llama":
        return None
    fields = config.to_dict() | {"hidden_size": 4 * config.num_attention_heads, "head_dim": 4, "intermediate_size": 16,
                                 "vocab_size": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    fields.pop("architectures", None)
    return LlamaForCausalLM(LlamaConfig(**fields)).to(model.dtype).eval().requires_grad_(False)


def time_parts(role: str, model: torch.nn.Module, context: int, repeats: int) -> dict[str, float]:
    """Median ms, interleaved: the whole step, the body (``model.model``), the head on one hidden state, the
    readout, and the tiny-matrix twin's step."""
    cache = _prefilled(model, context)
    hidden = torch.randn(1, 1, model.config.hidden_size, dtype=model.dtype)
    logits = torch.randn(1, model.get_output_embeddings().weight.shape[0])
    ids = torch.tensor([[42]])

    @torch.inference_mode()
    def body() -> None:
        model.model(input_ids=ids, **cache_kwarg(cache), use_cache=True)
        crop_cache(cache, context)

    @torch.inference_mode()
    def head() -> None:
        model.get_output_embeddings()(hidden).float()

    steps = {"step": make_step(role, model, context), "body (model.model)": body, "head (one hidden state)": head,
             "readout": (lambda: draft_readout(logits)) if role == "draft" else (lambda: target_readout(logits, []))}
    twin = tiny_twin(model)
    if twin is not None:
        steps["same architecture, tiny matrices (step)"] = make_step(role, twin, context)
    return {name: statistics.median(ms) for name, ms in time_interleaved(steps, repeats).items()}


# ---------------------------------------------------------------- 2. variants


def _lean_copy(model: torch.nn.Module, packed: bool | None = None) -> torch.nn.Module | None:
    lean = copy.deepcopy(model)
    return lean if make_lean(lean, packed) else None


def other_drafts(pair: ModelPair, folders: Sequence[str], vocabs: Sequence[int]) -> dict[str, tuple[str, torch.nn.Module]]:
    """name -> ("draft", model): each other draft folder, lean (where Llama), with each restricted head (its folder's
    workload counts choose the ids), named ``draft <folder name> lean vocab K``; timed in the same rounds as the rest
    (a shallower draft's step against the same target's, side by side)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for folder in folders:  # the draft alone: the pair's target and tokenizer are already loaded
        other = AutoModelForCausalLM.from_pretrained(folder, dtype=pair.dtype).to(pair.device).eval().requires_grad_(False)
        if other.get_output_embeddings().weight.shape[0] != pair.vocab_size:
            raise ValueError(f"--drafts {folder}: its vocabulary is not the target's ({pair.vocab_size} tokens)")
        counts = load_workload_counts(folder)
        for k in vocabs:
            model = copy.deepcopy(other)
            restrict_head(model, draft_vocab_ids(pair.tokenizer, pair.vocab_size, k, pair.eos_token_ids, counts))
            lean = " lean" if make_lean(model) else ""  # Llama drafts; others as they are
            out[f"draft {Path(folder).name}{lean} vocab {k}"] = ("draft", model)
    return out


def variants(pair: ModelPair, vocabs: Sequence[int]) -> dict[str, tuple[str, torch.nn.Module]]:
    """name -> (role, model): the pair's models as loaded, lean (packing measured, and unpacked), with each
    restricted draft head, and lean with each restricted head."""
    out = {"target": ("target", pair.target), "draft": ("draft", pair.draft)}
    for role in ("target", "draft"):
        model = getattr(pair, role)
        for name, packed in ((f"{role} lean", None), (f"{role} lean unpacked", False)):
            lean = _lean_copy(model, packed)
            if lean is not None:
                out[name] = (role, lean)
    lean_ok = "draft lean" in out
    for k in vocabs:
        ids = draft_vocab_ids(pair.tokenizer, pair.vocab_size, k, pair.eos_token_ids, load_workload_counts(pair.ids[0]))
        restricted = copy.deepcopy(pair.draft)
        restrict_head(restricted, ids)
        out[f"draft vocab {k}"] = ("draft", restricted)
        if lean_ok:
            both = copy.deepcopy(restricted)
            make_lean(both)
            out[f"draft lean vocab {k}"] = ("draft", both)
            before = copy.deepcopy(restricted)  # made lean apart: its own packed weights, not both's
            make_lean(before)
            before.model.trimmed = False
            out[f"draft lean vocab {k}, before the trims"] = ("draft", before)
    return out


@torch.inference_mode()
def logit_gap(base: torch.nn.Module, other: torch.nn.Module, context: int) -> float:
    """Largest |logit difference| of ``other`` against ``base`` over a prefill of ``context`` tokens, then 1 and 4
    fed tokens (finite logits only: a restricted head's others are -inf)."""
    caches = [_prefilled(base, context), _prefilled(other, context)]
    gap = 0.0
    for ids in ([42], [7, 8, 9, 10]):
        za, zb = (single_forward(m, Row(ids, c, len(ids))) for m, c in zip((base, other), caches))
        finite = torch.isfinite(zb)
        gap = max(gap, float((za[finite] - zb[finite]).abs().max()))
    return gap


def compare(models: dict[str, tuple[str, torch.nn.Module]], context: int, repeats: int) -> dict[str, dict[str, float]]:
    """Each variant's step, interleaved: median and quartiles (ms), ratio to the target's (and to the lean target's)."""
    steps = {name: make_step(role, model, context, spread=name.endswith("before the trims"))
             for name, (role, model) in models.items()}
    rows = {name: _summary(ms) for name, ms in time_interleaved(steps, repeats).items()}
    for name, row in rows.items():
        row["ratio_to_target"] = row["median_ms"] / rows["target"]["median_ms"]
        if "target lean" in rows:
            row["ratio_to_target_lean"] = row["median_ms"] / rows["target lean"]["median_ms"]
    return rows


def compiled_draft(pair: ModelPair, context: int) -> tuple[torch.nn.Module, dict[str, object]]:
    """The draft under ``torch.compile(dynamic=True)`` and what compiling it cost: seconds of the first forwards
    (a prefill, then fed 1, 1 and 3 tokens, the last after a crop: a rollback) and, per forward, whether its argmaxes
    equal the draft's (compiled kernels round bfloat16 differently: a near-tie can flip)."""
    from transformers import DynamicCache

    model = copy.deepcopy(pair.draft)
    model.forward = torch.compile(model.forward, dynamic=True)
    caches = [DynamicCache(config=model.config), DynamicCache(config=model.config)]
    feeds = [(list(range(100, 100 + context)), 1, None), ([42], 1, None), ([43], 1, None), ([7, 8, 9], 3, context - 5)]
    seconds, equal = [], []
    for ids, keep, crop_to in feeds:
        if crop_to is not None:
            for cache in caches:
                crop_cache(cache, crop_to)
        t0 = time.perf_counter()
        z = single_forward(model, Row(ids, caches[1], keep))
        seconds.append(time.perf_counter() - t0)
        equal.append(bool(torch.equal(single_forward(pair.draft, Row(ids, caches[0], keep)).argmax(-1), z.argmax(-1))))
    return model, {"first_forwards_s": seconds, "argmax_equal_per_forward": equal}


# ---------------------------------------------------------------- 3. agreement


@torch.inference_mode()
def target_greedy(pair: ModelPair, prompt: list[int], tokens: int) -> list[int]:
    """The target's greedy continuation of ``prompt`` (``tokens`` tokens)."""
    from transformers import DynamicCache

    cache, out, feed = DynamicCache(config=pair.target.config), [], prompt
    for _ in range(tokens):
        feed = [int(single_forward(pair.target, Row(feed, cache, 1))[-1].argmax())]
        out.append(feed[0])
    return out


@torch.inference_mode()
def agreement(pair: ModelPair, heads: dict[str, torch.nn.Module], domains: Sequence[str], prompts: int,
              tokens: int) -> dict[str, dict[str, dict[str, float]]]:
    """Per domain and head: the draft's greedy agreement with the target along the target's greedy path.

    ``heads`` maps a name to an output layer (the draft's own, or a ``SubsetHead``); all read the hidden
    states of the pair's draft. Returns rates in [0, 1] and mean probabilities.
    """
    from bild_env.prompts.domains import load_domain

    out = {}
    for domain in domains:
        sums = {name: {"agree": 0, "covered": 0, "p_agree": 0.0, "p_disagree": 0.0} for name in heads}
        n = 0
        for prompt in load_domain(pair.tokenizer, domain, "validation", limit=prompts):
            cont = target_greedy(pair, prompt, tokens)
            hidden = pair.draft.model(input_ids=torch.tensor([prompt + cont])).last_hidden_state[:, len(prompt) - 1 : -1]
            truth = torch.tensor(cont)
            n += len(cont)
            for name, head in heads.items():
                z = head(hidden)[0].float()  # (tokens, V); -inf outside a restricted head's ids
                arg, p = z.argmax(-1), torch.softmax(z, -1).amax(-1)
                hit = arg == truth
                s = sums[name]
                s["agree"] += int(hit.sum())
                s["covered"] += int(torch.isfinite(z.gather(-1, truth[:, None])).sum())
                s["p_agree"] += float(p[hit].sum())
                s["p_disagree"] += float(p[~hit].sum())
        out[domain] = {name: {"agreement": s["agree"] / n, "target_token_in_vocab": s["covered"] / n,
                              "mean_p_max_agree": s["p_agree"] / max(1, s["agree"]),
                              "mean_p_max_disagree": s["p_disagree"] / max(1, n - s["agree"]), "positions": n}
                       for name, s in sums.items()}
    return out


# ---------------------------------------------------------------- the whole run


def _machine_load() -> dict[str, float | None]:
    try:
        pressure = float(Path("/proc/pressure/cpu").read_text().split()[1].split("=")[1])
    except (OSError, IndexError, ValueError):
        pressure = None
    return {"load_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "cpu_pressure_10s_pct": pressure}


def run(cfg: DraftForwardConfig) -> dict[str, object]:
    """All three parts; a JSON-ready dict."""
    torch.set_num_threads(cfg.threads)
    pair = load_pair(cfg.pair, dtype=cfg.dtype or None, lean="none", draft_vocab=0)  # variants are made from plain models
    report: dict[str, object] = {"command": " ".join(sys.argv), "config": asdict(cfg),
                                 "machine": machine_description(pair.device), "dtype": str(pair.dtype),
                                 "machine_load_before": _machine_load()}
    logger.info("1/3 breakdown of one forward fed 1 token after %d cached", cfg.context)
    report["breakdown_profiler_ms"] = {role: profile_forward(getattr(pair, role), cfg.context, cfg.profile_steps)
                                       for role in ("draft", "target")}
    report["parts_ms"] = {role: time_parts(role, getattr(pair, role), cfg.context, max(5, cfg.repeats // 2))
                          for role in ("draft", "target")}
    logger.info("2/3 forwards of every variant, %d interleaved rounds", cfg.repeats)
    models = variants(pair, cfg.draft_vocab)
    if cfg.compile:
        model, report["compile"] = compiled_draft(pair, cfg.context)
        models["draft compiled"] = ("draft", model)
    others = other_drafts(pair, cfg.drafts, cfg.draft_vocab)
    report["forwards"] = compare(models | others, cfg.context, cfg.repeats)
    report["lean_packed"] = {name: m.model.packed for name, (_, m) in (models | others).items()
                             if hasattr(m.model, "packed")}
    report["max_abs_logit_diff_vs_as_loaded"] = {
        name: logit_gap(getattr(pair, role), m, cfg.context) for name, (role, m) in models.items() if role != name}
    for name in ("target lean", "draft lean", *(f"draft lean vocab {k}" for k in cfg.draft_vocab[:1])):
        if name in models:  # where the time goes after
            report["breakdown_profiler_ms"][name] = profile_forward(models[name][1], cfg.context, cfg.profile_steps)
    if cfg.agreement_prompts > 0:
        logger.info("3/3 agreement on %d validation prompts per domain", cfg.agreement_prompts)
        heads = {"full": pair.draft.get_output_embeddings()}
        heads |= {f"vocab {k}": models[f"draft vocab {k}"][1].get_output_embeddings() for k in cfg.draft_vocab}
        report["agreement"] = agreement(pair, heads, cfg.domains, cfg.agreement_prompts, cfg.agreement_tokens)
    report["machine_load_after"] = _machine_load()
    return report


def _print(report: dict) -> None:
    print(f"machine: {report['machine']}; {report['dtype']}")
    for role, parts in report["breakdown_profiler_ms"].items():
        print(f"{role}: " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
    for role, parts in report["parts_ms"].items():
        print(f"{role} parts: " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
    print(f"{'variant':28s} {'median ms':>10s} {'/ target':>9s} {'/ lean target':>14s}")
    for name, row in report["forwards"].items():
        print(f"{name:28s} {row['median_ms']:10.3f} {row['ratio_to_target']:9.3f} {row.get('ratio_to_target_lean', float('nan')):14.3f}")
    for domain, heads in report.get("agreement", {}).items():
        print(domain + ": " + "; ".join(f"{h} {r['agreement']:.3f} (in vocab {r['target_token_in_vocab']:.3f}, "
                                        f"p_max {r['mean_p_max_agree']:.2f}/{r['mean_p_max_disagree']:.2f})"
                                        for h, r in heads.items()))


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    cfg = parse_dataclass(DraftForwardConfig, argv, description=__doc__)
    report = run(cfg)
    _print(report)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    from bild_env.command import run_command

    sys.exit(run_command("python -m scripts.analysis.draft_forward", main))
