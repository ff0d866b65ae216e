"""``python -m distill acceptance``: fit an acceptance head for a pair's draft and compare it with the max probability.

    python -m distill acceptance --pair smollm2 --out results/acceptance_smollm2.json
    python -m distill acceptance --pair tiny-random --train-prompts 3 --eval-prompts 2 --max-new-tokens 12   # seconds

1. Collect. The target continues prompts of every domain greedily (``batched_greedy``, the pair's dtype); both
   models then read prompt + continuation teacher-forced, as ``bench.decoders.draft_agreement`` does. At every
   position whose next token the draft could propose (the continuation's second token on) the label is draft argmax
   (among the restricted head's columns, the proposals the decoders use) == target argmax, and the features are
   those of ``bild_env.models.acceptance`` along simulated draft blocks of 1..``max_block`` proposals (depth in the
   block, the target's max probability at the row before the block, the running acceptance before it).
2. Fit heads on TRAIN prompts only, one per (feature set, width, weight decay) of the grid; VALIDATION picks the
   one with the best AUC averaged over the domains.
3. Report per domain, on VALIDATION and once on TEST: AUC, expected calibration error (10 equal bins) and Brier
   score of the head and of the draft's max probability, raw and calibrated on TRAIN (Platt, isotonic); the head's
   cost per draft forward, both timed side by side on one thread.
4. The head is adopted only if its VALIDATION AUC beats the max probability's in every domain: then it is written
   beside the draft (``HEAD_FILE``), else into the cache (``--head-out`` overrides both).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from bild_env.cli import report_main
from bild_env.decoding.decoders import batched_greedy
from bild_env.decoding.kv import Row, crop_cache, single_forward
from bild_env.models.acceptance import (
    HEAD_FILE, SCALARS, AcceptanceHead, HeadSpec, capture_final_hidden, confidence, draft_key, draft_shape, save_head,
)
from bild_env.models.device import machine_description
from bild_env.models.draft_head import proposal_logits
from bild_env.models.pairs import DEFAULT_PAIR, ModelPair, check_held_out, load_pair
from bild_env.paths import cache_dir, digest
from bild_env.prompts.domains import DOMAINS, load_domain

logger = logging.getLogger("distill")

# feature set -> (hidden states read: "" none, "last" the final normed state, "all" every layer's; scalars)
FEATURE_SETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "confidence": ("", ("max_prob", "entropy", "margin")),
    "context": ("", SCALARS),
    "probe": ("last", ()),  # the linear probe on the last hidden state
    "last": ("last", SCALARS),
    "layers": ("all", SCALARS),
}
SPLITS = ("train", "validation", "test")
ECE_BINS = 10


@dataclass
class AcceptanceConfig:
    pair: str = field(default=DEFAULT_PAIR, metadata={"help": (
        "the pair whose draft gets a head (its default draft vocabulary and dtype)")})
    domains: tuple[str, ...] = ("prose", "code", "chat")
    train_prompts: int = field(default=224, metadata={"help": (
        "TRAIN prompts per domain (fewer where the split has fewer)")})
    eval_prompts: int = field(default=24, metadata={"help": (
        "VALIDATION and TEST prompts per domain (fewer where the split has fewer)")})
    max_new_tokens: int = field(default=192, metadata={"help": "tokens the target continues each prompt by"})
    batch: int = field(default=48, metadata={"help": "prompts per batched greedy forward"})
    max_block: int = field(default=8, metadata={"help": "simulated draft blocks hold 1..max_block proposals (uniform)"})
    feature_sets: tuple[str, ...] = field(default=tuple(FEATURE_SETS), metadata={"help": "the grid: feature sets ..."})
    widths: tuple[int, ...] = field(default=(0, 64), metadata={"help": (
        "... x hidden units (0: logistic regression) ...")})
    weight_decays: tuple[float, ...] = field(default=(0.0, 0.01), metadata={"help": "... x AdamW weight decay"})
    epochs: int = field(default=8, metadata={"help": "passes over the TRAIN positions per fit"})
    lr: float = field(default=1e-3, metadata={"help": "AdamW learning rate"})
    fit_batch: int = field(default=1024, metadata={"help": "positions per optimiser step"})
    seed: int = field(default=0, metadata={"help": "the simulated blocks and the heads' initialisation"})
    threads: int = field(default=1, metadata={"help": "torch threads (timings always on one)"})
    timing_repeats: int = field(default=300, metadata={"help": "draft forwards and head calls timed (medians)"})
    head_out: str = field(default="", metadata={"help": (
        'where the head goes ("": beside the draft if adopted, else the cache)')})
    out: str = field(default="", metadata={"help": "results JSON"})


def check_config(cfg: AcceptanceConfig) -> None:
    check_held_out(cfg.pair, cfg.domains, "validation")
    unknown = [f for f in cfg.feature_sets if f not in FEATURE_SETS]
    if unknown or not cfg.feature_sets:
        raise ValueError(f"unknown --feature-sets {unknown or '(none)'}; choose from {', '.join(FEATURE_SETS)}")
    if min(cfg.train_prompts, cfg.eval_prompts, cfg.batch, cfg.max_block, cfg.epochs, cfg.fit_batch) < 1:
        raise ValueError("--train-prompts, --eval-prompts, --batch, --max-block, --epochs and --fit-batch must be >= 1")
    if cfg.max_new_tokens < 3 or not cfg.widths or min(cfg.widths) < 0 or not cfg.weight_decays:
        raise ValueError("--max-new-tokens must be at least 3, --widths non-negative, and a weight decay given")


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
    """Per proposal row r = 1..N-1 of one continuation ``new`` (N tokens): the draft's hidden states
    ``hidden`` (n, L, H) (layers 1..L, L the final normed one), its proposal and confidence, the target's argmax, the
    label, and the context scalars along simulated blocks. Row r sits at position len(prompt) - 1 + r."""
    ids = torch.tensor([prompt + new], device=pair.device)
    keep = len(new)  # rows 0..N-1: positions P-1 .. P+N-2 (row 0 is the target's prefill row)
    full = pair.target(ids[:, :-1], logits_to_keep=keep).logits[0].float()  # (N, V)
    target_argmax = full.argmax(-1)
    target_max_prob = torch.softmax(full, -1).max(-1).values
    with capture_final_hidden(pair.draft) as finals, proposal_logits(pair.draft) as columns:
        out = pair.draft(ids[:, :-1], output_hidden_states=True, logits_to_keep=keep)
    z = out.logits[0].float()  # (N, K)
    proposal = z.argmax(-1) if columns is None else columns[z.argmax(-1)]
    layers = [h[0, -keep:] for h in out.hidden_states[1:-1]] + [finals[-1][0]]
    hidden = torch.stack(layers, 1)[1:]  # (N-1, L, H), the model's dtype
    label = (proposal == target_argmax)[1:].float()  # (N-1,)
    starts = torch.from_numpy(simulate_blocks(keep - 1, max_block, rng))  # block start of rows 1..N-1
    rows = torch.arange(1, keep)
    hits = torch.cat([torch.zeros(1), label.cumsum(0)])  # hits[r - 1]: labels of rows 1..r-1
    verified = (starts - 1).float()  # proposals verified before the block
    conf = confidence(z[1:])
    return {"hidden": hidden.cpu(), "label": label.cpu(), **{k: v.cpu() for k, v in conf.items()},
            "depth": (rows - starts).float(), "target_max_prob": target_max_prob[starts - 1].cpu(),
            "running_acceptance": (hits[starts - 1] + 1) / (verified + 2),
            "proposal": proposal[1:].cpu(), "target_argmax": target_argmax[1:].cpu()}


def continuations(pair: ModelPair, prompts: list[list[int]], cfg: AcceptanceConfig, desc: str) -> list[list[int]]:
    """The target's greedy continuations of ``prompts`` (``max_new_tokens`` each, or up to end of sequence)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths batch together
    out: dict[int, list[int]] = {}
    for start in tqdm(range(0, len(order), cfg.batch), desc=desc, unit="batch", leave=False):
        chunk = order[start: start + cfg.batch]
        for i, new in zip(chunk, batched_greedy(pair.target, [prompts[i] for i in chunk], cfg.max_new_tokens,
                                                pair.eos_token_ids)):
            out[i] = new
    return [out[i] for i in range(len(prompts))]


def collect(pair: ModelPair, cfg: AcceptanceConfig, domain: str, split: str) -> dict[str, torch.Tensor]:
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


def feature_matrix(spec: HeadSpec, data: dict[str, torch.Tensor]) -> torch.Tensor:
    """``draft_features`` of collected rows (N, F) float32 (the same columns, in the same order)."""
    columns = [data["hidden"][:, i - 1].float() for i in spec.layers]
    columns += [data[name].float()[:, None] for name in spec.scalars]
    return torch.cat(columns, -1)


def head_spec(pair: ModelPair, features: str, width: int, notes: dict | None = None) -> HeadSpec:
    hidden_size, layers = draft_shape(pair.draft)
    which, scalars = FEATURE_SETS[features]
    read = {"": (), "last": (layers,), "all": tuple(range(1, layers + 1))}[which]
    return HeadSpec(hidden_size, layers, read, scalars, width, draft_key(pair.fingerprints[0], pair.draft_vocab),
                    notes or {"features": features})


# 2. fit ------------------------------------------------------------------------------------------------------------

def fit_head(spec: HeadSpec, x: torch.Tensor, y: torch.Tensor, cfg: AcceptanceConfig, weight_decay: float,
             desc: str = "fit") -> AcceptanceHead:
    """A head fitted by AdamW on binary cross-entropy over ``x`` (N, F), ``y`` (N,) in {0, 1}."""
    torch.manual_seed(cfg.seed)
    head = AcceptanceHead(spec)
    head.set_scale(x)
    optimiser = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(cfg.seed)
    for _ in tqdm(range(cfg.epochs), desc=desc, unit="epoch", leave=False):
        for batch in torch.randperm(len(y), generator=generator).split(cfg.fit_batch):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(head(x[batch]), y[batch])
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    return head.eval().requires_grad_(False)


def platt(score: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(a, b) of p = sigmoid(a * logit(score) + b) fitted by maximum likelihood (LBFGS)."""
    s = torch.logit(torch.as_tensor(score, dtype=torch.float64).clamp(1e-6, 1 - 1e-6))
    t = torch.as_tensor(y, dtype=torch.float64)
    ab = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    optimiser = torch.optim.LBFGS([ab], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        optimiser.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(ab[0] * s + ab[1], t)
        loss.backward()
        return loss

    optimiser.step(closure)
    return float(ab[0].detach()), float(ab[1].detach())


def apply_platt(score: np.ndarray, ab: tuple[float, float]) -> np.ndarray:
    s = np.log(np.clip(score, 1e-6, 1 - 1e-6)) - np.log1p(-np.clip(score, 1e-6, 1 - 1e-6))
    return 1 / (1 + np.exp(-(ab[0] * s + ab[1])))


def isotonic(score: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A non-decreasing step function fitted to (score, y) by pooling adjacent violators: (thresholds, values),
    value[i] for scores from thresholds[i] up to the next threshold."""
    order = np.argsort(score, kind="stable")
    xs, ys = score[order], y[order].astype(np.float64)
    blocks: list[list[float]] = []  # [sum, count, first score]
    for x_i, y_i in zip(xs, ys):
        blocks.append([y_i, 1.0, x_i])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] >= blocks[-1][0] / blocks[-1][1]:
            total, count, _ = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return np.array([b[2] for b in blocks]), np.array([b[0] / b[1] for b in blocks])


def apply_isotonic(score: np.ndarray, steps: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    thresholds, values = steps
    return values[np.clip(np.searchsorted(thresholds, score, side="right") - 1, 0, len(values) - 1)]


# 3. metrics --------------------------------------------------------------------------------------------------------

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


# 4. evaluate -------------------------------------------------------------------------------------------------------

def fit_grid(pair: ModelPair, data: dict[str, dict[str, dict]], cfg: AcceptanceConfig) -> tuple[list[dict], dict]:
    """Every head of the grid fitted on TRAIN and scored on VALIDATION; returns (grid rows, the heads by name)."""
    domains = cfg.domains
    train = {k: torch.cat([data[d]["train"][k] for d in domains]) for k in data[domains[0]]["train"] if k != "prompts"}
    rows, heads = [], {}
    for features in cfg.feature_sets:
        for width in cfg.widths:
            for decay in cfg.weight_decays:
                name = f"{features}/w{width}/wd{decay:g}"
                spec = head_spec(pair, features, width, {"features": features, "weight_decay": decay})
                head = fit_head(spec, feature_matrix(spec, train), train["label"], cfg, decay, desc=f"fit {name}")
                val = {d: auc(head.probability(feature_matrix(spec, data[d]["validation"])).numpy(),
                              data[d]["validation"]["label"].numpy()) for d in domains}
                rows.append({"head": name, "features": features, "width": width, "weight_decay": decay,
                             "validation_auc": val, "mean_validation_auc": statistics.fmean(val.values())})
                heads[name] = head
                logger.info("%s: validation AUC %s", name, " ".join(f"{d} {v:.4f}" for d, v in val.items()))
    return rows, heads


def evaluate(head: AcceptanceHead, data: dict[str, dict[str, dict]], cfg: AcceptanceConfig,
             split: str) -> dict[str, dict]:
    """Per domain on ``split``: the head's and the max probability's (raw, Platt, isotonic; fitted on TRAIN) AUC,
    ECE and Brier score, and the positions and prompts read."""
    train = {k: torch.cat([data[d]["train"][k] for d in cfg.domains]).numpy() for k in ("max_prob", "label")}
    ab = platt(train["max_prob"], train["label"])
    steps = isotonic(train["max_prob"], train["label"])
    out = {}
    for domain in cfg.domains:
        rows = data[domain][split]
        y, p_max = rows["label"].numpy(), rows["max_prob"].numpy()
        out[domain] = {
            "positions": int(len(y)), "prompts": int(rows["prompts"]), "accepted": float(y.mean()),
            "head": scores(head.probability(feature_matrix(head.spec, rows)).numpy(), y),
            "max_prob": scores(p_max, y),
            "max_prob_platt": scores(apply_platt(p_max, ab), y),
            "max_prob_isotonic": scores(apply_isotonic(p_max, steps), y),
        }
    return out


# 5. cost -----------------------------------------------------------------------------------------------------------

@torch.inference_mode()
def time_head(pair: ModelPair, head: AcceptanceHead, repeats: int, context: int = 64) -> dict[str, float]:
    """Median ms of one draft forward fed one token after ``context`` cached ones (as the decoders run it: lean
    where the pair is, restricted head) and of the head scoring that position from its outputs, interleaved, on
    one thread; with a head reading layers below the last, also the draft forward returning every hidden state."""
    from transformers import DynamicCache

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cache = DynamicCache(config=pair.draft.config)
        single_forward(pair.draft, Row(list(range(10, 10 + context)), cache, 1))
        one = torch.ones(1)
        needs_layers = any(i < head.spec.num_layers for i in head.spec.layers)
        forward_ms, head_ms, hidden_ms = [], [], []
        for _ in tqdm(range(repeats), desc="timing", unit="call", leave=False):
            t0 = time.perf_counter()
            with capture_final_hidden(pair.draft) as finals, proposal_logits(pair.draft):
                z = single_forward(pair.draft, Row([42], cache, 1))
            t1 = time.perf_counter()
            hidden = [finals[-1][0]] * len(head.spec.layers)  # (1, H) each: the shapes the head reads
            head.score(hidden, z, one * 2, one * 0.9, one * 0.5)
            t2 = time.perf_counter()
            crop_cache(cache, context)
            forward_ms.append((t1 - t0) * 1e3)
            head_ms.append((t2 - t1) * 1e3)
            if needs_layers:
                t3 = time.perf_counter()
                pair.draft(torch.tensor([[42]], device=pair.device), past_key_values=cache, output_hidden_states=True, logits_to_keep=1)
                hidden_ms.append((time.perf_counter() - t3) * 1e3)
                crop_cache(cache, context)
    finally:
        torch.set_num_threads(threads)
    result = {"draft_forward_ms": statistics.median(forward_ms), "head_ms": statistics.median(head_ms)}
    result["head_per_draft_forward"] = result["head_ms"] / result["draft_forward_ms"]
    if hidden_ms:
        result["draft_forward_all_hidden_ms"] = statistics.median(hidden_ms)
    return result


# the command -------------------------------------------------------------------------------------------------------

def run(cfg: AcceptanceConfig) -> dict:
    check_config(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    pair = load_pair(cfg.pair)
    data = {d: {s: collect(pair, cfg, d, s) for s in SPLITS} for d in cfg.domains}
    grid, heads = fit_grid(pair, data, cfg)
    best = max(grid, key=lambda row: row["mean_validation_auc"])
    head = heads[best["head"]]
    validation = evaluate(head, data, cfg, "validation")
    margins = {d: validation[d]["head"]["auc"] - validation[d]["max_prob"]["auc"] for d in cfg.domains}
    adopted = all(m > 0 for m in margins.values())
    where = Path(cfg.head_out) if cfg.head_out else (Path(pair.ids[0]) if adopted else cache_dir("acceptance", cfg.pair))
    saved = save_head(head, where)
    return {
        "machine": machine_description(pair.device), "dtype": str(pair.dtype), "pair": cfg.pair, "pair_key": pair.key,
        "config": asdict(cfg),
        "train_positions": {d: int(len(data[d]["train"]["label"])) for d in cfg.domains},
        "train_accepted": {d: float(data[d]["train"]["label"].mean()) for d in cfg.domains},
        "grid": grid, "best": best["head"], "spec": asdict(head.spec),
        "validation": validation, "test": evaluate(head, data, cfg, "test"),
        "validation_auc_margin": margins, "adopted": adopted, "head_file": str(saved),
        "cost": time_head(pair, head, cfg.timing_repeats),
    }


def report(result: dict) -> str:
    lines = [f"{result['machine']}; {result['dtype']}; pair {result['pair']}; best head {result['best']}",
             f"{'split':<11}{'domain':<7}{'n':>7}   {'AUC head / max':>15}   {'ECE head / max / iso':>22}"
             f"   {'Brier head / max / iso':>24}"]
    for split in ("validation", "test"):
        for domain, row in result[split].items():
            h, m, i = row["head"], row["max_prob"], row["max_prob_isotonic"]
            lines.append(f"{split:<11}{domain:<7}{row['positions']:>7}   {h['auc']:.4f} / {m['auc']:.4f}   "
                         f"{h['ece']:.4f} / {m['ece']:.4f} / {i['ece']:.4f}   "
                         f"{h['brier']:.4f} / {m['brier']:.4f} / {i['brier']:.4f}")
    cost = result["cost"]
    lines.append(f"head {cost['head_ms']:.3f} ms per draft forward of {cost['draft_forward_ms']:.3f} ms "
                 f"({100 * cost['head_per_draft_forward']:.1f}%); adopted: {result['adopted']} "
                 f"(validation AUC margins {', '.join(f'{d} {m:+.4f}' for d, m in result['validation_auc_margin'].items())}); "
                 f"head at {result['head_file']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    return report_main(AcceptanceConfig, argv, __doc__.split("\n\n")[0], check_config, run, report)
