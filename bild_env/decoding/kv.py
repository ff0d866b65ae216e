"""KV-cache helpers and the forwards every decoder and the replay backend run through.

``crop_cache`` (a rollback), ``cache_prefix``/``cache_bytes`` (copies and sizes of a cache),
``single_forward`` (one batch-1 forward of new tokens after a cache: every live decoder's forward),
``batched_forward`` (several independent rows, each with its own cache, as one forward), and the
two readings of logits that speculative decoding needs (``draft_readout``, ``target_readout``).

Batching. The replay backend fills prefix trees with forwards of batch size 1 over a "shadow" KV cache
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

from bild_env.models.compat import cache_kwarg


@dataclass
class Row:
    """One forward request: feed ``ids`` after ``cache``; return the last ``keep`` positions' logits."""

    ids: list[int]
    cache: object  # a transformers DynamicCache (updated in place)
    keep: int


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` positions of a transformers cache (``DynamicCache.crop``)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)  # a negative count removes that many tokens (transformers >= 4.36 and 5.x)


def draft_readout(z: torch.Tensor, ids: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
    """Argmax and max softmax probability of each row of logits ``z`` (positions, columns), in one device sync.

    max softmax probability = exp(z_max - logsumexp(z)): the draft's confidence, which the fallback
    rule compares with its threshold. ``ids`` (K,): the token id of each of z's K columns, as a
    restricted head outputs them within ``bild_env.models.draft_head.proposal_logits`` (returned
    arguments are token ids); None: column i is token i (a full head's logits, or a restricted one's
    spread over the vocabulary with -inf outside its ids, which gives the same answer).
    """
    if ids is not None and z.shape[-1] != ids.shape[0]:
        raise ValueError(f"draft_readout: logits of {z.shape[-1]} columns for {ids.shape[0]} ids; read a restricted "
                         "head's logits within draft_head.proposal_logits, or pass ids=None")
    z_max, arg = z.max(-1)
    if ids is not None:
        arg = ids[arg]
    p_max = torch.exp(z_max - torch.logsumexp(z, -1))
    both = torch.cat([arg.float(), p_max]).tolist()  # one device sync
    n = z.shape[0]
    return [int(a) for a in both[:n]], both[n:]


def target_readout(z: torch.Tensor, next_ids: list[int]) -> tuple[list[int], list[float], list[float]]:
    """What the target's verification reads from logits ``z`` (positions, vocab), in one device sync.

    Returns the argmax of every row and, for the first ``k = len(next_ids)`` rows, ``logp[i]``, the
    log-probability in nats of ``next_ids[i]`` under row i, and ``top[i]``, the log-probability of
    row i's own argmax. The BiLD rollback distance of a draft token is ``-logp``; its regret
    (what keeping it costs against the target's choice) is ``top - logp >= 0``.
    """
    argmax = z.argmax(-1)
    if not next_ids:
        return [int(a) for a in argmax.float().tolist()], [], []
    nxt = torch.tensor(next_ids, device=z.device)
    log_probs = torch.log_softmax(z[: len(next_ids)], -1)
    logp = log_probs.gather(-1, nxt[:, None])[:, 0]
    top = log_probs.max(-1).values
    out = torch.cat([argmax.float(), logp, top]).tolist()  # one device sync
    n, k = z.shape[0], len(next_ids)
    return [int(a) for a in out[:n]], out[n : n + k], out[n + k :]


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
    out = model(input_ids=ids, **cache_kwarg(row.cache), use_cache=True, logits_to_keep=row.keep)
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
                **cache_kwarg(batch_cache), use_cache=True, logits_to_keep=max(row.keep for row in rows))
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
