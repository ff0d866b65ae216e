"""The draft's proposals read at every position of the target's greedy continuations, and the scores of a predictor of
which the target keeps: what ``python -m distill lookup`` fits the lookup predictor on and reports it by.

1. Collect. The target continues prompts of every domain greedily (``generate_batched_target_only``, the pair's
   dtype); both models then read prompt + continuation teacher-forced, as ``bench.decoders.draft_agreement`` does.
   At every position whose next token the draft could propose (the continuation's second token on) the label is
   draft argmax (among the restricted head's columns, the proposals the decoders use) == target argmax; beside it the
   draft's confidence (max probability, entropy, top-2 margin) and the context along simulated draft blocks of
   1..``max_block`` proposals (depth in the block, the target's max probability at the row before the block, the
   running acceptance before it). Cached on disk.
2. Scores: AUC, expected calibration error (10 equal bins) and Brier score.

A head trained on the draft's hidden states and these numbers (``distill acceptance``) did not beat the max
probability (docs/foresight.md) and was removed after commit 7229805.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from bild_env.decoding.batched import generate_batched_target_only
from bild_env.models.draft_head import proposal_logits
from bild_env.models.pairs import DEFAULT_PAIR, ModelPair, check_held_out
from bild_env.paths import cache_dir, digest
from bild_env.prompts.domains import DOMAINS, load_domain

SPLITS = ("train", "validation", "test")
ECE_BINS = 10


@dataclass
class PositionsConfig:
    """What the collected positions depend on (their cache key)."""

    pair: str = DEFAULT_PAIR
    domains: tuple[str, ...] = ("prose", "code", "chat")
    train_prompts: int = field(default=224, metadata={"help": "TRAIN prompts per domain (fewer where the split has fewer)"})
    eval_prompts: int = field(default=24, metadata={"help": (
        "VALIDATION and TEST prompts per domain (fewer where the split has fewer)")})
    max_new_tokens: int = field(default=192, metadata={"help": "tokens the target continues each prompt by"})
    batch: int = field(default=48, metadata={"help": "prompts per batched greedy forward"})
    max_block: int = field(default=8, metadata={"help": "simulated draft blocks hold 1..max_block proposals (uniform)"})
    seed: int = field(default=0, metadata={"help": "the simulated blocks"})


def check_config(cfg: PositionsConfig) -> None:
    check_held_out(cfg.pair, cfg.domains, "validation")
    if min(cfg.train_prompts, cfg.eval_prompts, cfg.batch, cfg.max_block) < 1:
        raise ValueError("--train-prompts, --eval-prompts, --batch and --max-block must be >= 1")
    if cfg.max_new_tokens < 3:
        raise ValueError("--max-new-tokens must be at least 3")


def confidence(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """The draft's max probability, entropy (nats) and top-2 margin (probability) per row of ``logits`` (n, C), each (n,)
    float32; columns at -inf (a restricted head spread over the vocabulary) count as probability 0."""
    logp = torch.log_softmax(logits.float(), -1)
    p = logp.exp()
    top = p.topk(2, -1).values
    entropy = -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)
    return {"max_prob": top[:, 0], "entropy": entropy, "margin": top[:, 0] - top[:, 1]}


# 1. collect --------------------------------------------------------------------------------------------------------

def simulate_blocks(n: int, max_block: int, rng: np.random.Generator) -> np.ndarray:
    """Block starts (n,) int64 of rows 1..n: consecutive draft blocks of 1..``max_block`` proposals (uniform),
    the first starting at row 1; row r's depth in its block is r - start[r - 1]."""
    starts = np.empty(n, dtype=np.int64)
    row = 1
    while row <= n:
        length = int(rng.integers(1, max_block + 1))
        starts[row - 1: row - 1 + length] = row
        row += length
    return starts


@torch.inference_mode()
def read_positions(pair: ModelPair, prompt: list[int], new: list[int], max_block: int,
                   rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """Per proposal row r = 1..N-1 of one continuation ``new`` (N tokens): the draft's proposal and confidence, the
    target's argmax, the label, and the context scalars along simulated blocks. Row r sits at position
    len(prompt) - 1 + r."""
    ids = torch.tensor([prompt + new], device=pair.device)
    keep = len(new)  # rows 0..N-1: positions P-1 .. P+N-2 (row 0 is the target's prefill row)
    full = pair.target(ids[:, :-1], logits_to_keep=keep).logits[0].float()  # (N, V)
    target_argmax = full.argmax(-1)
    target_max_prob = torch.softmax(full, -1).max(-1).values
    with proposal_logits(pair.draft) as columns:
        z = pair.draft(ids[:, :-1], logits_to_keep=keep).logits[0].float()  # (N, K)
    proposal = z.argmax(-1) if columns is None else columns[z.argmax(-1)]
    label = (proposal == target_argmax)[1:].float()  # (N-1,)
    starts = torch.from_numpy(simulate_blocks(keep - 1, max_block, rng))  # block start of rows 1..N-1
    rows = torch.arange(1, keep)
    hits = torch.cat([torch.zeros(1), label.cumsum(0)])  # hits[r - 1]: labels of rows 1..r-1
    verified = (starts - 1).float()  # proposals verified before the block
    conf = confidence(z[1:])
    return {"label": label.cpu(), **{k: v.cpu() for k, v in conf.items()},
            "depth": (rows - starts).float(), "target_max_prob": target_max_prob[starts - 1].cpu(),
            "running_acceptance": (hits[starts - 1] + 1) / (verified + 2),
            "proposal": proposal[1:].cpu(), "target_argmax": target_argmax[1:].cpu()}


def continuations(pair: ModelPair, prompts: list[list[int]], cfg: PositionsConfig, desc: str) -> list[list[int]]:
    """The target's greedy continuations of ``prompts`` (``max_new_tokens`` each, or up to end of sequence)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths batch together
    out: dict[int, list[int]] = {}
    for start in tqdm(range(0, len(order), cfg.batch), desc=desc, unit="batch", leave=False):
        chunk = order[start: start + cfg.batch]
        for i, g in zip(chunk, generate_batched_target_only(pair, [prompts[i] for i in chunk], cfg.max_new_tokens)):
            out[i] = g.new_ids
    return [out[i] for i in range(len(prompts))]


def collect(pair: ModelPair, cfg: PositionsConfig, domain: str, split: str) -> dict[str, torch.Tensor]:
    """Every proposal row of ``domain``'s ``split`` prompts, concatenated (``read_positions``' fields), cached on disk
    by the pair's key and the settings that shape it."""
    limit = cfg.train_prompts if split == "train" else cfg.eval_prompts
    key = digest(pair.key, domain, split, str(limit), str(cfg.max_new_tokens), str(cfg.max_block), str(cfg.seed), "v1")
    path = cache_dir("acceptance") / f"{key}.pt"
    if path.is_file():
        return torch.load(path, weights_only=True)
    prompts = load_domain(pair.tokenizer, domain, split, limit)
    outputs = continuations(pair, prompts, cfg, f"{domain}/{split}: target continues")
    rows = []
    for i, (prompt, new) in enumerate(tqdm(list(zip(prompts, outputs)), desc=f"{domain}/{split}: teacher-forced",
                                           unit="prompt", leave=False)):
        if len(new) >= 2:
            rng = np.random.default_rng([cfg.seed, SPLITS.index(split), DOMAINS.index(domain), i])
            rows.append(read_positions(pair, prompt, new, cfg.max_block, rng) | {"prompt": torch.full((len(new) - 1,), i)})
    data = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
    data["prompts"] = torch.tensor(len(prompts))
    torch.save(data, path)
    return data


# 2. scores ---------------------------------------------------------------------------------------------------------

def auc(score: np.ndarray, y: np.ndarray) -> float | None:
    """Area under the ROC curve: P(score of a positive > score of a negative), ties counting half (Mann-Whitney);
    None with no positive or no negative."""
    from scipy.stats import rankdata

    y = np.asarray(y, dtype=bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if not n_pos or not n_neg:
        return None
    ranks = rankdata(score)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def ece(probability: np.ndarray, y: np.ndarray, bins: int = ECE_BINS) -> float:
    """Expected calibration error: over ``bins`` equal-width bins of probability ([0, 0.1), ..., [0.9, 1]), the
    share of positions in a bin times |mean probability - accepted share| there, summed."""
    probability, y = np.asarray(probability, dtype=np.float64), np.asarray(y, dtype=np.float64)
    which = np.clip((probability * bins).astype(int), 0, bins - 1)
    total = 0.0
    for b in range(bins):
        inside = which == b
        if inside.any():
            total += inside.mean() * abs(probability[inside].mean() - y[inside].mean())
    return float(total)


def brier(probability: np.ndarray, y: np.ndarray) -> float:
    """Mean squared difference between probability and the 0/1 outcome."""
    return float(np.mean((np.asarray(probability, dtype=np.float64) - np.asarray(y, dtype=np.float64)) ** 2))


def scores(probability: np.ndarray, y: np.ndarray) -> dict[str, float | None]:
    return {"auc": auc(probability, y), "ece": ece(probability, y), "brier": brier(probability, y)}
