"""What a cost profile charges for the forwards trees lean on: the draft against the target, and a verification's rise
with the tokens it is fed, alone and in a batch.

    python -m scripts.analysis.profile_shape h200-smollm2-eager-bf16 h200-opt-floor h200-opt-eager zen5-smollm2-bf16

For each profile (a shipped name or a file, ``bild_env.decoding.profiles.load_profile``), at ``--context`` cached
tokens: c, the draft's forward fed 1 token over the target's; the target fed 17 and 33 tokens over fed 1 (batch 1);
the same fed 17 over fed 1 at batches 8 and 32; the draft fed 4 over fed 1.
"""

from __future__ import annotations

import argparse
import sys

from bild_env.decoding.profiles import load_profile


def shape(spec: str, context: float) -> dict[str, float]:
    m = load_profile(spec).model

    def rise(role: str, batch: int, fed: int) -> float:
        return m.batch_ms(role, batch, fed, context) / m.batch_ms(role, batch, 1, context)

    return {"c": m.batch_ms("draft", 1, 1, context) / m.batch_ms("target", 1, 1, context),
            "v17": rise("target", 1, 17), "v33": rise("target", 1, 33), "b8_fed17": rise("target", 8, 17),
            "b32_fed17": rise("target", 32, 17), "draft_fed4": rise("draft", 1, 4)}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profiles", nargs="+", help="profile names or files")
    parser.add_argument("--context", type=float, default=48.0, help="cached tokens per row (default 48)")
    args = parser.parse_args(argv)
    out = {}
    for spec in args.profiles:
        out[spec] = s = shape(spec, args.context)
        print(f"{spec}: c {s['c']:.3f}; target fed 17 / fed 1 {s['v17']:.2f}, fed 33 {s['v33']:.2f}; at batch 8 fed 17 "
              f"{s['b8_fed17']:.2f}, at batch 32 {s['b32_fed17']:.2f}; draft fed 4 / fed 1 {s['draft_fed4']:.2f}")
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
