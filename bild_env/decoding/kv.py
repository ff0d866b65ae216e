"""One batched forward for several independent rows, each with its own KV cache.

The replay backend fills prefix trees with forwards of batch size 1 over a "shadow" KV cache
per env. When several envs step together (``agents.vec.BatchedReplayVecEnv``), their fills of
the same model run as one forward: on a CPU (and for small models on a GPU) a forward's cost is
mostly reading the weights, so B rows cost far less than B forwards.

Rows differ in cached length ``past`` and in new tokens ``n``. The batch lays each row out as::

    [pad x (P - past)] [its cache: past] [pad x (N - n)] [its new tokens: n]

with ``P``/``N`` the largest past/new length, an attention mask that hides the pads, and explicit
position ids (``past + j`` for the j-th new token), so every row attends to exactly what its own
forward would. Afterwards each row's cache gets its ``n`` new keys/values appended (pads dropped).
The logits match the row's own forward up to float rounding (different matrix shapes), which is
the same tolerance the replay backend already has against live decoding (its fills group tokens
differently from live forwards); argmax decisions agree except on exact near-ties.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Row:
    """One forward request: feed ``ids`` after ``cache``; return the last ``keep`` positions' logits."""

    ids: list[int]
    cache: object  # a transformers DynamicCache (updated in place)
    keep: int


def _layers(cache) -> list:
    return getattr(cache, "layers", [])


def _kv(cache, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Layer ``index``'s keys and values, or None when the cache holds nothing."""
    layers = _layers(cache)
    if index >= len(layers):
        return None
    layer = layers[index]
    keys = getattr(layer, "keys", None)
    if keys is None or not getattr(layer, "is_initialized", True) or keys.numel() == 0:
        return None
    return keys, layer.values


@torch.inference_mode()
def single_forward(model, row: Row) -> torch.Tensor:
    """The plain batch-1 forward: logits (keep, V) float32; ``row.cache`` grows by ``len(row.ids)``."""
    device = next(model.parameters()).device
    ids = torch.tensor([row.ids], device=device)
    out = model(input_ids=ids, past_key_values=row.cache, use_cache=True, logits_to_keep=row.keep)
    return out.logits[0].float()


@torch.inference_mode()
def batched_forward(model, rows: list[Row], pad_id: int = 0) -> list[torch.Tensor]:
    """One forward of ``model`` over all ``rows``; returns each row's logits (keep, V) float32.

    A single row runs ``single_forward`` (bit-identical to the unbatched path).
    """
    if not rows:
        return []
    if len(rows) == 1:
        return [single_forward(model, rows[0])]
    for row in rows:
        if not row.ids or not 1 <= row.keep <= len(row.ids):
            raise ValueError(f"a row needs new tokens and 1 <= keep <= their number (got {len(row.ids)}, {row.keep})")
    from transformers import DynamicCache

    device = next(model.parameters()).device
    pasts = [row.cache.get_seq_length() for row in rows]
    news = [len(row.ids) for row in rows]
    B, P, N = len(rows), max(pasts), max(news)
    ids = torch.full((B, N), pad_id, dtype=torch.long)
    mask = torch.zeros((B, P + N), dtype=torch.long)
    positions = torch.zeros((B, N), dtype=torch.long)
    for r, (row, past, n) in enumerate(zip(rows, pasts, news)):
        ids[r, N - n :] = torch.tensor(row.ids)
        mask[r, P - past : P] = 1
        mask[r, P + N - n :] = 1
        positions[r, N - n :] = torch.arange(past, past + n)
    batch_cache = DynamicCache(config=model.config)
    if P:
        n_layers = max(len(_layers(row.cache)) for row in rows)
        for layer in range(n_layers):
            template = next(kv for kv in (_kv(row.cache, layer) for row in rows) if kv is not None)
            shape = list(template[0].shape)
            shape[0], shape[-2] = B, P
            keys = template[0].new_zeros(shape)
            values = template[1].new_zeros(shape[:-1] + [template[1].shape[-1]])
            for r, row in enumerate(rows):
                kv = _kv(row.cache, layer)
                if kv is not None:
                    keys[r, :, P - pasts[r] :] = kv[0][0]
                    values[r, :, P - pasts[r] :] = kv[1][0]
            batch_cache.update(keys, values, layer)
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                past_key_values=batch_cache, use_cache=True, logits_to_keep=max(row.keep for row in rows))
    logits = out.logits.float()
    results = [logits[r, logits.shape[1] - row.keep :] for r, row in enumerate(rows)]
    for layer, batch_layer in enumerate(_layers(batch_cache)):
        for r, (row, n) in enumerate(zip(rows, news)):
            row.cache.update(batch_layer.keys[r : r + 1, :, P + N - n :].contiguous(),
                             batch_layer.values[r : r + 1, :, P + N - n :].contiguous(), layer)
    return results


def cache_prefix(cache, length: int, config) -> object:
    """A new DynamicCache holding copies of ``cache``'s first ``length`` positions."""
    from transformers import DynamicCache

    out = DynamicCache(config=config)
    if length > 0:
        for index in range(len(_layers(cache))):
            kv = _kv(cache, index)
            if kv is not None:
                out.update(kv[0][:, :, :length].clone(), kv[1][:, :, :length].clone(), index)
    return out


def cache_bytes(cache) -> int:
    """Bytes held by a cache's keys and values."""
    total = 0
    for index in range(len(_layers(cache))):
        kv = _kv(cache, index)
        if kv is not None:
            total += sum(t.numel() * t.element_size() for t in kv)
    return total


def plan_batches(lengths: list[int], fixed_ms: float, token_ms: float) -> list[list[int]]:
    """Split rows (their new-token counts) into batches that cost least under ``fixed + token * rows * longest``.

    A batched forward computes every row at the longest row's length (pads included), so a long
    row (e.g. a prompt) is better alone than padding many one-token rows. Rows are taken shortest
    first; one joins the current batch when that is cheaper than starting a new one. Returns
    lists of row indices.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches:
            group, n = batches[-1], lengths[i]  # n >= every length in group
            joined = fixed_ms + token_ms * (len(group) + 1) * n
            apart = fixed_ms + token_ms * len(group) * lengths[group[-1]] + fixed_ms + token_ms * n
            if joined <= apart:
                group.append(i)
                continue
        batches.append([i])
    return batches


@torch.inference_mode()
def batched_greedy(model, prompts: list[list[int]], max_new_tokens: int, eos_token_ids=()) -> list[list[int]]:
    """Greedy continuations of several prompts at once (one batched forward per token), KV-cached.

    Each row stops like target-only decoding (``decoders.generate_target_only``): after
    ``max_new_tokens`` tokens or at an end-of-sequence token (kept). Rows that stop leave the batch.
    """
    from transformers import DynamicCache

    eos = frozenset(eos_token_ids)
    caches = [DynamicCache(config=model.config) for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    feed = {i: list(p) for i, p in enumerate(prompts)}
    active = [i for i in range(len(prompts)) if max_new_tokens > 0]
    while active:
        logits = batched_forward(model, [Row(feed[i], caches[i], 1) for i in active])
        still = []
        for i, z in zip(active, logits):
            token = int(z[-1].argmax())
            outputs[i].append(token)
            if len(outputs[i]) < max_new_tokens and token not in eos:
                feed[i] = [token]
                still.append(i)
        active = still
    return outputs
