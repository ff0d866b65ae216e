"""The resident memory a loaded pair costs a process, by how its weights are held.

    python -m scripts.analysis.pair_memory --pair smollm2 --dtype bfloat16 float32

Each variant loads the pair in a fresh process (so nothing of another variant's heap is counted) and reports the
process's resident memory (``VmRSS``, and of it the anonymous and the file-backed parts) after loading, and after
one lossless speculative decode of a short prompt:

- ``plain``: no lean forward (``lean="none"``), the weights as transformers loads them;
- ``lean, weights and copies``: the lean forward with the layers' weights kept beside the copies its products read,
  and the heap as the loading left it (what every process held before the weights were released);
- ``lean, weights released``: the layers' weights released where the products read copies only
  (``LeanLlamaModel.release_originals``), the heap as the loading left it;
- ``lean (default)``: released, and the heap's free pages given back (``return_freed_memory``): what
  ``load_pair`` does.

Writes a JSON report (``--out``) naming the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

VARIANTS = {  # name: (lean, release the weights, give the heap back)
    "plain": ("none", True, True),
    "lean, weights and copies": (None, False, False),
    "lean, weights released": (None, True, False),
    "lean (default)": (None, True, True),
}

CHILD = r"""
import json, sys, torch
torch.set_num_threads(1)
pair_name, dtype, lean, release, give_back = json.loads(sys.argv[1])
from bild_env.models import lean as lean_module, pairs
if not release:
    lean_module.LeanLlamaModel.release_originals = lambda self: False
if not give_back:
    pairs.return_freed_memory = lambda: False
from bild_env.decoding.decoders import generate_speculative

def rss():
    out = {}
    for line in open("/proc/self/status"):
        key = line.split(":")[0]
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(line.split()[1]) / 1024
    return out

pair = pairs.load_pair(pair_name, dtype=dtype, lean=lean)
loaded = rss()
generate_speculative(pair, "The history of the city begins with", max_new_tokens=16)
print(json.dumps({"loaded_mb": loaded, "after_decode_mb": rss(), "lean": list(pair.lean)}))
"""


def measure(pair: str, dtype: str, variant: str) -> dict:
    lean, release, give_back = VARIANTS[variant]
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps([pair, dtype, lean, release, give_back])],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"scripts.analysis.pair_memory: the {variant!r} child failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    from bild_env.command import writable_file
    from bild_env.models.device import machine_description
    from bild_env.models.pairs import preset_names

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="smollm2", choices=preset_names())
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="VARIANT",
                        help=f"which ways of holding the weights to measure (default all: {', '.join(VARIANTS)})")
    parser.add_argument("--out", default="results/pair_memory.json", help="JSON report")
    args = parser.parse_args(argv)
    out = writable_file(args.out)
    from tqdm import tqdm

    report = {"pair": args.pair, "machine": machine_description("cpu"), "rss_mb": {}}
    cells = [(d, v) for d in args.dtype for v in args.variants]
    for dtype, variant in tqdm(cells, desc="scripts.analysis.pair_memory", unit="process"):
        report["rss_mb"].setdefault(dtype, {})[variant] = measure(args.pair, dtype, variant)
    print(f"{args.pair}, {report['machine']}: resident MB of one process (after loading / after a decode)")
    for dtype, rows in report["rss_mb"].items():
        for variant, r in rows.items():
            print(f"  {dtype:8s} {variant:26s} {r['loaded_mb']['VmRSS']:7.0f} / {r['after_decode_mb']['VmRSS']:7.0f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    from bild_env.command import run_command

    sys.exit(run_command("python -m scripts.analysis.pair_memory", main))
