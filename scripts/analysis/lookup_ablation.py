"""What else, beside the lookups, predicts whether the target keeps the draft's proposal?

    python -m scripts.analysis.lookup_ablation --pair smollm2 --out results/lookup_ablation_smollm2.json

The lookup predictor (``python -m distill lookup``) is a logistic regression on the draft's max probability and the
context's n-gram lookups. This script fits the same regression (``distill.lookup.fit``, on the same TRAIN positions
of every domain) with more columns, one group at a time and all together, and reports each one's AUC per domain on
VALIDATION (every position, and the first ``--early`` tokens of each continuation) and on TEST, beside the lookup
predictor's and the max probability's:

- ``logit``: the max probability's log-odds (a bend the linear form lacks);
- ``draft``: the draft's entropy and top-2 margin at the proposal;
- ``running``: the request's running acceptance (the simulated draft blocks' hits so far, smoothed) and the depth in
  the block;
- ``target``: the target's max probability at the last verified position (free after a verification);
- ``tokens``: the proposal's and the previous token's acceptance rates on TRAIN (smoothed towards the mean by 20
  positions; out of fold on TRAIN itself, five folds by prompt);
- ``target_state``: the target's final hidden state at the last verified position (what its verification forward
  leaves) and its input embedding of the proposal, each reduced to its first 16 principal components on TRAIN.

Nothing is adopted: it says how much room is left in the features a decoder has without another forward.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from bild_env.models.device import machine_description
from bild_env.models.pairs import load_pair
from distill.positions import scores
from distill.lookup import LookupConfig, check_config, context_rows, fit

STATE_DIMS = 16  # principal components kept of the target's state and of the proposal's embedding
GROUPS = {"logit": ("logit",), "draft": ("entropy", "margin"), "running": ("running_acceptance", "depth"),
          "target": ("target_max_prob",), "tokens": ("proposal_rate", "last_rate"),
          "target_state": tuple(f"state_{i}" for i in range(STATE_DIMS)) + tuple(f"embedding_{i}" for i in range(STATE_DIMS))}
SMOOTHING = 20.0  # positions of prior weight in the token rates
FOLDS = 5


def log_odds(p: np.ndarray) -> np.ndarray:
    p = np.clip(np.asarray(p, dtype=np.float64), 1e-4, 1 - 1e-4)
    return np.log(p / (1 - p))


def rates(keys: np.ndarray, y: np.ndarray, prior: float, size: int) -> np.ndarray:
    """Each key's smoothed acceptance rate: (hits + SMOOTHING * prior) / (count + SMOOTHING), over ``size`` keys."""
    hits = np.bincount(keys, weights=y, minlength=size)
    counts = np.bincount(keys, minlength=size)
    return (hits + SMOOTHING * prior) / (counts + SMOOTHING)


@torch.inference_mode()
def target_states(pair, rows: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``rows`` (``context_rows``' output): the target's final hidden state at the row's last verified
    position (the row before its simulated draft block; teacher-forced, as the rows are) and the target's input
    embedding of the row's proposal, float32 (N, H) each."""
    which, depth = rows["prompt"], rows["extra"]["depth"].astype(np.int64)
    states = np.zeros((len(which), pair.target.config.hidden_size), dtype=np.float32)
    for i, text in tqdm(rows["texts"].items(), desc="target states", unit="prompt", leave=False):
        at = np.flatnonzero(which == i)  # continuation rows 1..n; text = prompt, then n + 1 continuation tokens
        out = pair.target(torch.tensor([text[:-1].tolist()], device=pair.device), output_hidden_states=True,
                          logits_to_keep=1)
        hidden = out.hidden_states[-1][0, -(len(at) + 1):].float().cpu().numpy()  # row r predicts continuation token r
        states[at] = hidden[np.arange(1, len(at) + 1) - depth[at] - 1]  # the row before each block
    embedding = pair.target.get_input_embeddings().weight
    proposals = torch.as_tensor(rows["proposal"], device=embedding.device)
    return states, embedding[proposals].float().cpu().numpy()


def principal(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The mean and the first ``k`` principal directions (H, k) of the rows of ``x`` (every fourth row)."""
    mean = x.mean(0)
    _, _, vt = np.linalg.svd(x[::4] - mean, full_matrices=False)
    return mean, vt[:k].T


def columns(rows: dict, groups: tuple[str, ...], proposal_rate: np.ndarray, last_rate: np.ndarray) -> np.ndarray:
    """The lookup predictor's features with the columns of ``groups`` appended."""
    extra = rows["extra"] | {"proposal_rate": log_odds(proposal_rate), "last_rate": log_odds(last_rate),
                             "logit": log_odds(rows["features"][:, 0])}
    added = [np.asarray(extra[name], dtype=np.float64)[:, None] for g in groups for name in GROUPS[g]]
    return np.hstack([rows["features"].astype(np.float64), *added])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="smollm2")
    parser.add_argument("--domains", nargs="+", default=["prose", "code", "chat"])
    parser.add_argument("--train-prompts", type=int, default=LookupConfig.train_prompts)
    parser.add_argument("--eval-prompts", type=int, default=LookupConfig.eval_prompts)
    parser.add_argument("--max-new-tokens", type=int, default=LookupConfig.max_new_tokens)
    parser.add_argument("--early", type=int, default=LookupConfig.early)
    parser.add_argument("--out", default="", help="also write the report as JSON here")
    args = parser.parse_args(argv)
    cfg = LookupConfig(pair=args.pair, domains=tuple(args.domains), unseen_domains=(), train_prompts=args.train_prompts,
                       eval_prompts=args.eval_prompts, max_new_tokens=args.max_new_tokens, early=args.early)
    try:
        check_config(cfg)
    except ValueError as err:
        parser.error(str(err))
    torch.set_num_threads(1)
    pair = load_pair(cfg.pair)
    data = {split: {d: context_rows(pair, cfg, d, split) for d in tqdm(cfg.domains, desc=split, leave=False)}
            for split in ("train", "validation", "test")}
    states = {split: {d: target_states(pair, rows) for d, rows in data[split].items()} for split in data}
    for which, name in enumerate(("state", "embedding")):
        mean, directions = principal(np.vstack([states["train"][d][which] for d in cfg.domains]), STATE_DIMS)
        for split in data:
            for d in cfg.domains:
                reduced = (states[split][d][which] - mean) @ directions
                data[split][d]["extra"] |= {f"{name}_{i}": reduced[:, i] for i in range(reduced.shape[1])}
    train = data["train"]
    y = np.concatenate([train[d]["label"] for d in cfg.domains]).astype(np.float64)
    prior = float(y.mean())
    size = 1 + int(max(max(r["proposal"].max(), r["last"].max()) for s in data.values() for r in s.values()))
    proposal, last = (np.concatenate([train[d][k] for d in cfg.domains]) for k in ("proposal", "last"))
    offsets = np.concatenate([np.full(len(train[d]["label"]), 100_000 * k) for k, d in enumerate(cfg.domains)])
    fold = (np.concatenate([train[d]["prompt"] for d in cfg.domains]) + offsets) % FOLDS  # by prompt
    out_of_fold = {k: np.zeros(len(y)) for k in ("proposal", "last")}
    for f in range(FOLDS):
        held = fold == f
        for k, keys in (("proposal", proposal), ("last", last)):
            out_of_fold[k][held] = rates(keys[~held], y[~held], prior, size)[keys[held]]
    full = {k: rates(keys, y, prior, size) for k, keys in (("proposal", proposal), ("last", last))}
    starts = np.cumsum([0] + [len(train[d]["label"]) for d in cfg.domains])
    sets = {"lookup predictor": ()} | {f"+ {g}": (g,) for g in GROUPS} | {"+ all": tuple(GROUPS)}
    report: dict = {"sets": {}, "train_positions": int(len(y))}
    for name, groups in tqdm(sets.items(), desc="fits", leave=False):
        x = np.vstack([columns(train[d], groups, out_of_fold["proposal"][a:b], out_of_fold["last"][a:b])
                       for d, a, b in zip(cfg.domains, starts[:-1], starts[1:])])
        weights, bias = fit(x, y, LookupConfig.weight_decay)
        entry = {}
        for split in ("validation", "test"):
            for d, rows in data[split].items():
                p = 1 / (1 + np.exp(-(bias + columns(rows, groups, full["proposal"][rows["proposal"]],
                                                     full["last"][rows["last"]]) @ weights)))
                early = rows["place"] <= cfg.early
                entry[f"{split}/{d}"] = {"auc": scores(p, rows["label"])["auc"],
                                         "auc_early": scores(p[early], rows["label"][early])["auc"]}
        report["sets"][name] = entry
    report["max_prob"] = {f"{split}/{d}": {"auc": scores(r["features"][:, 0], r["label"])["auc"],
                                           "auc_early": scores(r["features"][r["place"] <= cfg.early, 0],
                                                               r["label"][r["place"] <= cfg.early])["auc"]}
                          for split in ("validation", "test") for d, r in data[split].items()}
    keys = [f"{s}/{d}" for s in ("validation", "test") for d in cfg.domains]
    print(f"{'features':<18}" + "".join(f"{k:>22}" for k in keys))
    for name, entry in [("max probability", report["max_prob"])] + list(report["sets"].items()):
        print(f"{name:<18}" + "".join(f"{entry[k]['auc']:>13.4f} ({entry[k]['auc_early']:.3f})" for k in keys))
    if args.out:
        report |= {"command": "python -m scripts.analysis.lookup_ablation " + " ".join(argv if argv is not None else sys.argv[1:]),
                   "machine": machine_description(pair.device), "dtype": str(pair.dtype), "early": cfg.early}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
