"""A quiet-CPU cost model for the smollm2 pair, assembled from measurements taken when the machine was quiet.

    python -m scripts.analysis.assemble_cpu_profile --out results/cpu_profile_smollm2_bfloat16_assembled.json

When the CPU is shared (other processes keeping both cores busy) no timing taken now is the forward's alone
(``scripts/analysis/tree_costs.py``: the least of 30 rounds still 3-4x a quiet forward). This writes a cost model from two
earlier quiet runs instead, for ``scripts.analysis.stop_rules --profiles FILE:cost_model``: the target fed 1 token as
``bench.decoders`` timed it on a Zen 5 core (bfloat16, 1 thread; ``--decoders``' prose ``target 1``), the shape of
its cost by tokens fed, ``v(n)``, from ``bench.forwards`` (bfloat16, fed 1-12, 16, 32, 64 at 64 and 160 cached
tokens; ``--forwards``: a Zen 4 run with 2 threads, the only quiet one timed beyond 12 tokens), and the draft flat at
``c`` target forwards fed 1 (``--decoders``' cost ratio). Assembled, not measured: it says what a quiet Zen 5 core
would charge if the target's width cost had the Zen 4 run's shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from bild_env.cli import parse_checked
from bild_env.decoding.cost_model import CostModel
from bild_env.decoding.forward_costs import ForwardCost


@dataclass
class AssembleConfig:
    forwards: str = field(default="results/bench_forwards_bf16_rerun.json", metadata={"help": (
        "bench.forwards, bfloat16: the target's cost by tokens fed")})
    decoders: str = field(default="results/bench_decoders_smollm2_test_adaptive.json", metadata={"help": (
        "bench.decoders: the target fed 1, the draft's c")})
    domain: str = "prose"
    out: str = ""


def check(cfg: AssembleConfig) -> None:
    for path in (cfg.forwards, cfg.decoders):
        if not Path(path).is_file():
            raise ValueError(f"{path} is not a file: give the bench.forwards and bench.decoders JSON to assemble from")


def assemble(cfg: AssembleConfig) -> dict:
    runs = [r for r in json.loads(Path(cfg.forwards).read_text())["runs"] if "bfloat16" in r["dtype"]]
    rows = {(r["fed"], r["context"]): r["measured_ms"] for r in runs[0]["rows"] if r["model"] == "target"}
    fed = sorted(f for f, c in rows if c == 64)
    decoders = json.loads(Path(cfg.decoders).read_text())
    domain = decoders["reports"][0]["domains"][cfg.domain]
    t1, c = domain["forward_ms"]["target 1"], domain["cost_ratio"]
    scale = t1 / rows[1, 64]
    slope = (rows[1, 160] - rows[1, 64]) / 96 * scale
    target = ForwardCost(fed=tuple(fed), ms=tuple(rows[f, 64] * scale for f in fed), per_context_ms=slope, ref_context=64)
    draft = ForwardCost.linear(c * t1, 0.0, 0.0)
    model = CostModel(draft, target, device="assembled", machine=f"{decoders['machine']} (target fed 1, c) with the "
                      f"shape by tokens fed of {runs[0]['device']} (bench.forwards)")
    return {"config": cfg.__dict__, "v": {str(f): rows[f, 64] / rows[1, 64] for f in fed}, "target_1_ms": t1, "c": c,
            "cost_model": model.to_dict()}


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_checked(AssembleConfig, argv, __doc__.split("\n\n")[0], check)
    result = assemble(cfg)
    print(f"target fed 1: {result['target_1_ms']:.2f} ms, c = {result['c']:.3f}; v(n): "
          + ", ".join(f"{n}: {v:.2f}" for n, v in result["v"].items()))
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
