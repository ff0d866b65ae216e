"""Teacher-forced validation acceptance of a draft cut to fewer layers, before any training: which layers to keep.

    python -m scripts.analysis.layer_cuts --init bild_env/assets/smollm2-draft-6l --keep 4 3 \\
        --work ~/.cache/bild_env/smollm2/distill_mix --domain-val 240

For every choice of ``--keep`` of the ``--init`` draft's layers that keeps layer 0, the student built by
``distill train --layers N --init-layers ...`` would start from (``distill.student.init_state``) is scored on the
distillation's validation chunks (``distill.training.val_acceptance``: the student's argmax against the teacher's
top-1 at every position). The draft's own layers are scored first. Prints one line per choice.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import replace

import torch
from transformers import AutoConfig, LlamaForCausalLM

import distill as dd
from distill.domains import domain_val_dir


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init", required=True, help="an exported draft folder or a checkpoint (.pt)")
    parser.add_argument("--keep", type=int, nargs="+", required=True, help="how many layers to keep (each a line set)")
    parser.add_argument("--depth", type=int, default=6, help="layers of the --init draft")
    parser.add_argument("--work", default="", help="the distillation's work folder (its validation shards)")
    parser.add_argument("--domain-val", type=int, default=240, help="validation chunks of the workload (0: the wiki's)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = dd.DistillConfig(work=args.work, wiki=args.domain_val == 0, domain_val=args.domain_val, init=args.init)
    val = dd.load_shards(domain_val_dir(base), args.domain_val) if args.domain_val else dd.load_shards(dd.teacher_dirs(base)[1])
    target = AutoConfig.from_pretrained(dd.target_dir(base))
    choices = [tuple(range(args.depth))] + [c for n in args.keep for c in itertools.combinations(range(args.depth), n)
                                            if c[0] == 0]
    out = {}
    for keep in choices:
        cfg = replace(base, layers=len(keep), init_layers=",".join(map(str, keep)))
        student = LlamaForCausalLM(dd.student_config(cfg, target))
        student.load_state_dict(dd.init_state(args.init, student, dd.init_layers(cfg)))
        out[cfg.init_layers] = dd.val_acceptance(student, val, cfg)
        print(f"layers {cfg.init_layers}: {out[cfg.init_layers]:.4f}", flush=True)
    return out


if __name__ == "__main__":
    main()
