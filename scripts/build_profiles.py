"""Write the shipped hardware cost profiles (``bild_env/assets/profiles/``) from measurements of other machines.

    python -m scripts.build_assets profiles --measurements ../shared/gpu --cpu-profiles ../shared/profiles

The measurements are JSON files the project's own calibration wrote on an NVIDIA H200 (their README says how):
``calibrate(pair, loop=False, sampling="full", repeats=9)`` and ``calibrate_batched(pair, batch_sizes=(1, 2, 4, 8, 16,
32, 64), sampling="sparse")`` of random-weight models of the pairs' shapes, Hugging Face eager forwards, as
``CostModel.to_dict()`` per dtype; and the weight products alone replayed as one CUDA graph (a floor). Each profile
says what it is (``bild_env.decoding.profiles``). ``--cpu-profiles`` adds profiles that ``python -m bild_env.profile``
wrote on CPUs the project's machines are not (``CPU_CARDS``: where and how each was timed, said in its card).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from bild_env.decoding.batch_costs import BatchCost, fill_sparse
from bild_env.decoding.cost_model import CostModel
from bild_env.decoding.forward_costs import ForwardCost
from bild_env.decoding.profiles import PROFILES_DIR, CostProfile, profile_from_dict

EAGER = ("the project's calibration on the GPU: bild_env.decoding.costs.calibrate(pair, loop=False, sampling='full', "
         "repeats=9) and calibrate_batched(pair, batch_sizes=(1, 2, 4, 8, 16, 32, 64), sampling='sparse'); Hugging Face "
         "eager forwards with a DynamicCache, median of 9 forwards per cell")
SHAPES_NOTE = ("Real timings of these shapes on that GPU (random weights: a forward's time does not depend on their "
               "values). The tokens and their acceptance come from the pair the env loads, never from these models.")


def _eager(measured: dict, dtype: str, name: str, shapes: str, note: str) -> CostProfile:
    tables = measured[dtype]
    model = CostModel.from_dict(dict(tables["single"], batched=tables["batched"]))
    return CostProfile(name, model, device="NVIDIA H200 (141 GB HBM3e)", dtype=dtype, shapes=shapes,
                       software=measured["device"].split(", ", 1)[-1], timed=EAGER, note=f"{SHAPES_NOTE} {note}".strip())


def _floor(rows: list[dict], draft: str, target: str, device: str) -> CostProfile:
    """The CUDA-graph floor: each model's weight products for B sequences x n tokens, one graph (no attention over
    the cache, no norms, no launches): per-context cost 0; batch sizes without a timed fed count read off the line
    through that batch size's timed ones (``fill_sparse``)."""
    def tables(model: str) -> tuple[ForwardCost, BatchCost]:
        points = {(r["batch"], r["fed"]): r["graph_ms"] for r in rows if r["model"] == model}
        single = sorted((f, m) for (b, f), m in points.items() if b == 1)
        batch = sorted({b for b, _ in points})
        fed = [f for f, _ in single]
        return (ForwardCost(tuple(f for f, _ in single), tuple(m for _, m in single), 0.0, 0),
                BatchCost.from_table(fill_sparse(points, batch, fed), 0.0, 0))

    (d1, db), (t1, tb) = tables(draft), tables(target)
    model = CostModel(d1, t1, device="NVIDIA H200", batched={"draft": db, "target": tb})
    return CostProfile("h200-opt-floor", model, device=device, dtype="float16", shapes="OPT-125M -> OPT-6.7B",
                       software="torch 2.11.0+cu130",
                       timed="each layer's weight products alone for B sequences x n tokens, replayed as one CUDA graph",
                       note="A floor, not a decoder: what a forward costs with no kernel launches, no attention over the "
                            "cache and no norms (what a tuned engine approaches). Batch sizes 8, 32, 64 were timed at "
                            "1 and 8 tokens fed; their other counts are read off that line. " + SHAPES_NOTE)


CPU_TABLE = Path(__file__).resolve().parent.parent / "results" / "bench_forwards_batched_smollm2.json"


def _cpu(path: Path) -> CostProfile:
    """A 2-core AMD EPYC Zen 5's cost model of the smollm2 pair in bfloat16 (2 torch threads), timed on a quiet machine
    by ``bench.forwards`` (its JSON holds the command); stored in format 2 (no loop costs), read as format 3 without
    them. Its draft is an earlier 6-layer stage of the smollm2 draft (larger than the 3-layer one: c 0.18 against ~0.08)."""
    measured = json.loads(path.read_text())
    model = CostModel.from_dict(dict(measured["cost_model"], format=3, loop=None))
    return CostProfile("zen5-smollm2-bf16", model, device=measured["machine"], dtype="bfloat16",
                       shapes="an earlier smollm2 draft -> SmolLM2-135M (the real weights)",
                       software=f"torch {measured['machine'].split('torch ')[-1].split(',')[0]}",
                       timed=f"{measured['command'].replace('/work/main/', '')} (bench.forwards: costs.calibrate and "
                             "calibrate_batched on a quiet machine)",
                       note="A CPU's economics as a profile: the real smollm2 pair timed on a 2-core AMD EPYC Zen 5 with "
                            "AVX512-BF16, 2 torch threads (the env's default is 1). Its draft is an earlier smollm2 "
                            "draft, not today's 3-layer one. The tokens and their acceptance come from the pair the env "
                            "loads.")


# Profiles ``python -m bild_env.profile`` wrote on a CPU with native bfloat16 units (AVX512-BF16 and AMX), which a
# machine without them cannot time: their name -> the command that wrote them and what a reader must know.
XEON = "a 2-vCPU Intel Xeon (family 6 model 207: AVX-512, AVX512-BF16, AMX-BF16), torch 2.13.0+cpu, transformers 5.24.0"
CPU_CARDS = {
    "xeon-amx-qwen2.5-coder-bf16": (
        "python -m bild_env.profile --pair qwen2.5-coder --dtype bfloat16 --batch-sizes 1 2 4 8 --repeats 2 "
        "--name xeon-amx-qwen2.5-coder-bf16, 225 s:",
        f"The real qwen2.5-coder pair (Qwen2.5-Coder-0.5B -> 1.5B, dequantized) in bfloat16 on {XEON}, 2 threads, "
        "nothing else running. On native bfloat16 units verifying 8 tokens costs about what 1 costs (v(8) 0.93) and the "
        "draft about half the target (c 0.47): the economics where this pair's speculation pays, which an AVX2-only "
        "CPU (zen3-qwen2.5-coder-float32: v(8) 2.04) cannot show. Batches up to 8: give max_batch <= 8 when it prices "
        "BiLD-Serve-v0. The tokens and their acceptance come from the pair the env loads."),
    "xeon-amx-smollm2-bf16": (
        "python -m bild_env.profile --pair smollm2 --dtype bfloat16 --repeats 3 --name xeon-amx-smollm2-bf16, 59 s:",
        f"The real smollm2 pair (today's 3-layer draft -> SmolLM2-135M) in bfloat16 on {XEON}, 2 threads, nothing else "
        "running. The tokens and their acceptance come from the pair the env loads."),
}


def _cpu_written(path: Path) -> CostProfile:
    """A profile ``python -m bild_env.profile`` wrote on another CPU, its card (``CPU_CARDS``) added."""
    profile = profile_from_dict(json.loads(path.read_text()), source=str(path))
    timed, note = CPU_CARDS[profile.name]
    return replace(profile, timed=f"{timed} {profile.timed[profile.timed.find('('):]}", note=note, source="")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--measurements", type=Path, required=True, help="the folder of the GPU's JSON files")
    parser.add_argument("--cpu-table", type=Path, default=CPU_TABLE, help="bench.forwards' JSON of a CPU's batched costs")
    parser.add_argument("--cpu-profiles", type=Path, default=None, help=(
        "a folder of profiles python -m bild_env.profile wrote on other CPUs (those CPU_CARDS names)"))
    parser.add_argument("--out", type=Path, default=PROFILES_DIR, help="where the profiles go (default: the package's)")
    args = parser.parse_args(argv)
    read = lambda name: json.loads((args.measurements / name).read_text())  # noqa: E731
    opt, smol, floor = (read("h200_opt_shapes_eager.json"), read("h200_smollm2_shapes_eager.json"),
                        read("h200_floor_cuda_graph.json"))
    smol_shapes = "smollm2 draft (3 layers) -> SmolLM2-135M (30 layers, 576 wide)"
    profiles = [
        _eager(opt, "float16", "h200-opt-eager", "OPT-125M -> OPT-6.7B", "The paper's pair."),
        _eager(smol, "float16", "h200-smollm2-eager", smol_shapes, ""),
        _eager(smol, "bfloat16", "h200-smollm2-eager-bf16", smol_shapes, ""),
        _floor(floor["rows"], "opt-125m", "opt-6.7b", floor["device"]),
        _cpu(args.cpu_table),
    ] + [_cpu_written(args.cpu_profiles / f"{name}.json") for name in CPU_CARDS if args.cpu_profiles]
    args.out.mkdir(parents=True, exist_ok=True)
    for profile in profiles:
        path = args.out / f"{profile.name}.json"
        checked = profile.save(path)  # checked as every reader checks it, before it is written
        print(f"{path}: {checked.label}, batches up to {checked.largest_batch}")
    return 0

