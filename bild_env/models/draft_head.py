"""A draft head restricted to the workload's most frequent tokens (FR-Spec's idea).

A small draft spends a large part of each forward in its output layer: a smollm2 draft's head is
its tied 49,152 x 256 embedding (12.6M of the 3-layer ``smollm2`` draft's 15.5M parameters, of the
6-layer ``smollm2-6l`` draft's 18.5M), read whole for every token it proposes (about a third of a
6-layer draft forward on one CPU core, ``scripts.analysis.draft_forward``). Speculative decoding stays exact
whatever the draft proposes (the target verifies every token), so the draft may propose only among
the ``K`` tokens the workload uses most: its head becomes the ``K`` rows of the full one, and the
logits of every other token are -inf.

What it changes: the draft's argmax is the most likely of the ``K`` tokens, and its confidence
(the max softmax probability BiLD's fallback rule reads) is taken over the ``K`` tokens only, so it
is never lower than the full head's at the same hidden state. A target token outside the ``K`` is
never proposed; ``scripts.analysis.draft_forward --agreement`` measures both effects on held-out prompts.

The decoders read only the K columns: within ``proposal_logits(model)`` a restricted head outputs its
K logits (..., K) instead of spreading them over a (..., vocabulary) tensor of -inf, and the readout
maps column j to token ``ids[j]``. Outside it (Hugging Face's ``generate``, distillation, any reader
of the full vocabulary) the head keeps the vocabulary's shape. The numbers read are the same, bit for
bit (tested); with the lean forward's trims made alongside, a 6-layer smollm2 draft step (``smollm2-6l``,
16,384 ids) went from 3.40 to 3.19 ms on one Zen 5 core (``scripts.analysis.draft_forward``, "before the trims").

The frequencies come from the TRAIN splits of the workload's domains only
(``bild_env.prompts.domains.load_domain(tokenizer, domain, "train")``): each domain's token counts
are normalised to sum to 1 and the domains are summed, so a small domain (code) counts as much as a
large one (prose). Where the draft's folder ships ``workload_token_counts.npz`` (``distill counts``:
per domain, the tokens of the target's own continuations of TRAIN prompts, which the distillation
sampled), each domain's share of those is added the same way: the draft must propose what the
target answers, and a chat instruction or a code docstring is not worded like its answer (at 16,384
ids, ``scripts.analysis.draft_forward`` on validation prompts: 0.926 of the target's chat tokens and 0.923 of its
code tokens from the prompts alone, 0.943 and 0.981 with the continuations counted). Validation and test prompts never choose the vocabulary they are measured on.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from bild_env.models.products import way_product
from bild_env.prompts import domains as prompt_domains

FREQUENCY_DOMAINS: tuple[str, ...] = ("prose", "code", "chat", "long")  # the domains whose train splits are counted
COUNTS_FILE = "workload_token_counts.npz"  # beside a draft: per domain, token counts of the target's TRAIN continuations


def load_workload_counts(folder: str | Path) -> dict[str, np.ndarray]:
    """The per-domain token counts a draft folder ships (``COUNTS_FILE``); {} where it has none (or is no folder)."""
    path = Path(folder) / COUNTS_FILE
    if not path.is_file():
        return {}
    with np.load(path) as saved:
        return {domain: np.asarray(saved[domain], dtype=np.int64) for domain in saved.files}


def token_frequencies(tokenizer, vocab_size: int, domains: Sequence[str] = FREQUENCY_DOMAINS,
                      continuations: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
    """Token frequencies (vocab_size,) float64: each domain's train-split share of every token, summed over domains,
    plus each domain's share in ``continuations`` (per domain, token counts of the target's continuations of TRAIN
    prompts: ``load_workload_counts``)."""

    def share(counts: np.ndarray) -> np.ndarray:
        counts = np.asarray(counts, dtype=np.float64)[:vocab_size]
        return np.pad(counts, (0, vocab_size - len(counts))) / max(1.0, counts.sum())

    total = np.zeros(vocab_size)
    for domain in domains:
        prompts = prompt_domains.load_domain(tokenizer, domain, "train")
        ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])
        total += share(np.bincount(ids[ids < vocab_size], minlength=vocab_size))
    for counts in (continuations or {}).values():
        total += share(counts)
    return total


def frequent_ids(frequencies: np.ndarray, k: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The ``k`` most frequent token ids, sorted (k,) int64; ``always`` (e.g. end-of-sequence ids) are among them.

    Ties go to the lower id. Raises ValueError unless ``len(always) <= k <= len(frequencies)``.
    """
    vocab = len(frequencies)
    always = sorted({int(t) for t in always})
    if not len(always) <= k <= vocab:
        raise ValueError(f"the draft vocabulary must hold {len(always)} to {vocab} tokens, got {k}")
    order = np.lexsort((np.arange(vocab), -np.asarray(frequencies)))  # by frequency, descending; then by id
    chosen = list(always)
    taken = set(always)
    for token in order:
        if len(chosen) == k:
            break
        if int(token) not in taken:
            chosen.append(int(token))
    return torch.tensor(sorted(chosen), dtype=torch.long)


def draft_vocab_ids(tokenizer, vocab_size: int, k: int, always: Sequence[int] = (),
                    continuations: Mapping[str, np.ndarray] | None = None) -> torch.Tensor:
    """The ``k`` token ids (sorted, int64) a draft restricted to ``k`` tokens proposes among: ``frequent_ids`` of
    ``token_frequencies`` (what ``load_pair(..., draft_vocab=k)`` uses, with the draft folder's
    ``load_workload_counts``; ``always``: the pair's end-of-sequence ids)."""
    return frequent_ids(token_frequencies(tokenizer, vocab_size, continuations=continuations), k, always)


class SubsetHead(torch.nn.Module):
    """An output layer over ``ids`` only: logits (..., vocab_size), -inf outside ``ids``.

    ``weight`` (K, hidden) holds copies of the full head's rows ``ids`` (the same values); the output
    keeps the full vocabulary's shape, so every reader of the draft's logits works unchanged.
    """

    def __init__(self, full_weight: torch.Tensor, ids: torch.Tensor) -> None:
        super().__init__()
        self.vocab_size = int(full_weight.shape[0])
        self.register_buffer("ids", ids.to(full_weight.device))
        self.weight = torch.nn.Parameter(full_weight.detach()[self.ids].clone(), requires_grad=False)
        self._packed = None  # a product reading a oneDNN-packed copy of ``weight``, once ``pack()`` ran

    def pack(self) -> None:
        """Read a oneDNN-packed copy of ``weight`` from now on (``bild_env.models.products.way_product``)."""
        self._packed = way_product(self.weight, "packed")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        z = torch.nn.functional.linear(hidden, self.weight) if self._packed is None else self._packed(hidden)  # (..., K)
        if getattr(_columns, "depth", 0):  # within proposal_logits: the K columns alone
            return z
        out = z.new_full((*z.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.ids, z)


_columns = threading.local()  # depth > 0: this thread is within proposal_logits


@contextmanager
def proposal_logits(model: torch.nn.Module) -> Iterator[torch.Tensor | None]:
    """Within it, in this thread, a restricted head outputs only its K columns' logits (..., K).

    Yields ``proposal_ids(model)``: the token id of each column (None for a full head, whose logits keep
    the vocabulary's shape and whose columns are the token ids). Readers map column j to token ``ids[j]``
    (``bild_env.decoding.kv.draft_readout`` does). The values are those of the full-shape output at
    those ids, in the ids' order.
    """
    _columns.depth = getattr(_columns, "depth", 0) + 1
    try:
        yield proposal_ids(model)
    finally:
        _columns.depth -= 1


def proposal_ids(model: torch.nn.Module) -> torch.Tensor | None:
    """The token ids (K,) a draft with a restricted head proposes among; None for a full head."""
    head = model.get_output_embeddings()
    return head.ids if isinstance(head, SubsetHead) else None


def restrict_head(model: torch.nn.Module, ids: torch.Tensor) -> SubsetHead:
    """Replace ``model``'s output layer by a ``SubsetHead`` over ``ids`` (in place; the input embedding is kept)."""
    head = SubsetHead(model.get_output_embeddings().weight, ids)
    model.set_output_embeddings(head)
    return head
