"""What a cheaper draft could win on a pair: the draft steps it could take, timed beside the target, against the limit.

    python -m scripts.analysis.draft_room --pair qwen2.5-coder --bench results/bench_decoders_qwen2.5-coder_test_zen3_float32.json \\
        --draft-vocab 16384 32768 --shapes 6x256 3x1536 --threads 1 --out results/draft_room_qwen2.5-coder_zen3_float32.json
    python -m scripts.analysis.draft_room --pair tiny-random --bench B.json --draft-vocab 100 --shapes 2x32 \\
        --agreement-prompts 1 --agreement-tokens 4 --repeats 3 --out /tmp/room.json                 # seconds (smoke run)

Naive SD's limit at acceptance ``a`` with ``k`` drafts is (1 - a^(k+1)) / (1 - a) tokens for k c + v target
forwards (``bench.decoders.limit_speedup``). ``--bench`` (a ``bench.decoders`` report of the pair) gives, per
domain, the measured ``a`` of each naive k and its verification cost ``v`` (target fed k + 1 / fed 1). This times,
interleaved in one run (``draft_forward.time_interleaved``: one draft or target step fed 1 token after
``--context`` cached ones, lean as the decoders load them), the pair's target and draft and the drafts a user
could put in the draft's place:

* the pair's draft with its head restricted to its ``--draft-vocab`` K most frequent workload tokens
  (``load_pair(..., draft_vocab=K)``), and its greedy agreement with the target on ``--agreement-prompts``
  validation prompts per domain (``draft_forward.agreement``): what the restriction costs in proposals;
* random-weight drafts of ``--shapes`` LxW (``distill``'s student: L Llama layers W wide, W/64 heads, 2 key/value
  heads, MLP 4W, the target's vocabulary, tied), with a full head and each restricted one: what a draft
  distilled for the target would cost a step (timings only: random weights propose nothing).

For each draft and domain: c (its step / the target's, this run), naive SD's limit at the pair's measured
acceptance (a draft that proposed as well as the pair's own), the acceptance it would need for 1.0x at each k, and
the limit of a free draft (c = 0). Writes JSON with the machine.
"""

from __future__ import annotations

import copy
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.decoders import limit_speedup
from bild_env.cli import parse_dataclass, setup_logging
from bild_env.command import UsageError, writable_file
from bild_env.models.device import machine_description
from bild_env.models.draft_head import SubsetHead, draft_vocab_ids, load_workload_counts, restrict_head
from bild_env.models.lean import make_lean
from bild_env.models.pairs import DEFAULT_PAIR, ModelPair, load_pair
from scripts.analysis.draft_forward import _summary, agreement, make_step, time_interleaved

logger = logging.getLogger(__name__)


@dataclass
class DraftRoomConfig:
    pair: str = field(default=DEFAULT_PAIR, metadata={"help": "model pair preset"})
    bench: str = field(default="", metadata={"help": "a bench.decoders JSON of the pair: acceptance and v per domain"})
    dtype: str = field(default="float32", metadata={"help": "the models' dtype (the bench's)"})
    draft_vocab: tuple[int, ...] = field(default=(16384,), metadata={"help": "restricted head sizes K"})
    shapes: tuple[str, ...] = field(default=("6x256",), metadata={"help": "random-weight draft shapes LxW"})
    context: int = field(default=64, metadata={"help": "cached tokens before each timed step"})
    repeats: int = field(default=20, metadata={"help": "timed rounds, every draft once a round"})
    agreement_prompts: int = field(default=6, metadata={"help": "validation prompts per domain (0: skip)"})
    agreement_tokens: int = field(default=32, metadata={"help": "target greedy tokens per prompt"})
    threads: int = field(default=1, metadata={"help": "torch CPU threads"})
    out: str = field(default="results/draft_room.json", metadata={"help": "where the JSON goes"})


def parse_shape(text: str) -> tuple[int, int]:
    """``"LxW"`` as (layers, width); ValueError naming the form."""
    try:
        layers, width = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--shapes {text!r}: give LxW, layers x width, e.g. 6x256") from None
    if layers < 1 or width < 64 or width % 64:
        raise UsageError(f"--shapes {text!r}: at least 1 layer, a width that is a multiple of 64")
    return layers, width


def random_draft(pair: ModelPair, layers: int, width: int) -> torch.nn.Module:
    """A random-weight draft of ``distill``'s student shape (a Llama, tied) over ``pair``'s vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=pair.vocab_size, hidden_size=width, intermediate_size=4 * width,
                         num_hidden_layers=layers, num_attention_heads=width // 64, num_key_value_heads=2 if width % 128 == 0 else 1,
                         head_dim=64, tie_word_embeddings=True)
    return LlamaForCausalLM(config).to(pair.dtype).eval().requires_grad_(False)


def breakeven(k: int, c: float, v: float) -> float | None:
    """The acceptance at which naive SD's limit is 1.0x (None where even a = 1 is slower)."""
    if limit_speedup(1.0, k, c, v) < 1.0:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if limit_speedup(mid, k, c, v) < 1.0 else (lo, mid)
    return hi


def naive_rows(bench: dict) -> dict[str, dict[int, tuple[float, float]]]:
    """Per domain, k -> (acceptance, v) of the bench's naive SD rows."""
    out = {}
    for report in bench["reports"]:
        for domain, rows in report["domains"].items():
            for name, row in rows["results"].items():
                if name.startswith("naive SD (k=") and row.get("limit_speedup") is not None:
                    out.setdefault(domain, {})[int(name[len("naive SD (k="):-1])] = (row["acceptance_rate"],
                                                                                    row["verify_ratio"])
    return out


def read_bench(path: str) -> dict[str, dict[int, tuple[float, float]]]:
    """``naive_rows`` of the ``--bench`` JSON; UsageError saying what to give for a missing or unreadable one."""
    hint = "give a bench.decoders JSON of the pair with naive SD rows (python -m bench.decoders --k 3 --out FILE)"
    try:
        rows = naive_rows(json.loads(Path(path).read_text())) if path else {}
    except KeyError as err:
        raise UsageError(f"--bench {path!r}: no key {err}; {hint}") from None
    except (OSError, ValueError, TypeError, AttributeError) as err:
        raise UsageError(f"--bench {path!r}: {err}; {hint}") from None
    if not rows:
        raise UsageError(f"--bench {path!r}: no naive SD row with a limit; {hint}")
    return rows


def drafts(pair: ModelPair, cfg: DraftRoomConfig, plain_draft: torch.nn.Module,
           ids: dict[int, torch.Tensor]) -> dict[str, torch.nn.Module]:
    """name -> lean draft: the pair's own with each restricted head (``ids``: K -> its token ids), and each random
    shape with a full head and each restricted one."""
    out = {}
    for k in cfg.draft_vocab:
        model = copy.deepcopy(plain_draft)
        restrict_head(model, ids[k])
        make_lean(model)
        out[f"draft vocab {k}"] = model
    for shape in cfg.shapes:
        layers, width = parse_shape(shape)
        base = random_draft(pair, layers, width)
        for k in (0, *cfg.draft_vocab):
            model = copy.deepcopy(base)
            if k:
                restrict_head(model, ids[k])
            make_lean(model)
            out[f"{shape} vocab {k or 'full'}"] = model
    return out


def run(cfg: DraftRoomConfig) -> dict:
    bench = read_bench(cfg.bench)
    for shape in cfg.shapes:
        parse_shape(shape)
    torch.set_num_threads(cfg.threads)
    pair = load_pair(cfg.pair, dtype=cfg.dtype, lean="none", draft_vocab=0)
    report = {"machine": machine_description(), "config": vars(cfg) | {"draft_vocab": list(cfg.draft_vocab),
                                                                      "shapes": list(cfg.shapes)}}
    counts = load_workload_counts(pair.ids[0])  # the K most frequent workload tokens, as load_pair picks them
    ids = {k: draft_vocab_ids(pair.tokenizer, pair.vocab_size, k, pair.eos_token_ids, counts) for k in cfg.draft_vocab}
    if cfg.agreement_prompts > 0:
        head = pair.draft.get_output_embeddings()
        heads = {"full": head} | {f"vocab {k}": SubsetHead(head.weight, ids[k]) for k in cfg.draft_vocab}
        logger.info("agreement of the draft's heads on %d validation prompts a domain", cfg.agreement_prompts)
        report["agreement"] = agreement(pair, heads, ("prose", "code", "chat"), cfg.agreement_prompts,
                                        cfg.agreement_tokens)
    make_lean(pair.target)  # first: its packed copy is made while little else is held
    others = drafts(pair, cfg, pair.draft, ids)  # from the plain draft (a head is restricted before the lean forward)
    make_lean(pair.draft)
    models = {"target": ("target", pair.target), "draft": ("draft", pair.draft)}
    models |= {name: ("draft", model) for name, model in others.items()}
    steps = {name: make_step(role, model, cfg.context) for name, (role, model) in models.items()}
    logger.info("%d steps interleaved, %d rounds", len(steps), cfg.repeats)
    timed = {name: _summary(ms) for name, ms in time_interleaved(steps, cfg.repeats).items()}
    target_ms = timed["target"]["median_ms"]
    report["steps_ms"] = timed
    report["limits"] = {}
    for name, row in timed.items():
        if name == "target":
            continue
        c = row["median_ms"] / target_ms
        report["limits"][name] = {"c": c, "domains": {domain: {k: {
            "acceptance": a, "v": v, "limit_at_acceptance": limit_speedup(a, k, c, v),
            "free_draft_limit": limit_speedup(a, k, 0.0, v), "breakeven_acceptance": breakeven(k, c, v)}
            for k, (a, v) in ks.items()} for domain, ks in bench.items()}}
    return report


def _print(report: dict) -> None:
    print(f"machine: {report['machine']}")
    for domain, heads in report.get("agreement", {}).items():
        print(f"agreement {domain}: " + "; ".join(f"{h} {r['agreement']:.3f} (in vocab {r['target_token_in_vocab']:.3f})"
                                               for h, r in heads.items()))
    print(f"{'draft':24s} {'ms':>8s} {'c':>6s}  limit at the pair's acceptance / acceptance for 1.0x, per domain and k")
    print(f"{'target':24s} {report['steps_ms']['target']['median_ms']:8.1f}")
    for name, row in report["limits"].items():
        cells = []
        for domain, ks in row["domains"].items():
            for k, r in ks.items():
                need = "-" if r["breakeven_acceptance"] is None else f"{r['breakeven_acceptance']:.2f}"
                cells.append(f"{domain} k={k} {r['limit_at_acceptance']:.2f}x/{need}")
        print(f"{name:24s} {report['steps_ms'][name]['median_ms']:8.1f} {row['c']:6.3f}  " + ", ".join(cells))


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    cfg = parse_dataclass(DraftRoomConfig, argv, description=__doc__)
    out = writable_file(cfg.out)
    report = run(cfg)
    _print(report)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    from bild_env.command import run_command

    sys.exit(run_command("python -m scripts.analysis.draft_room", main))
