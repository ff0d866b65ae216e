"""One model's KV cache for a batch of sequences of different lengths, kept padded between forwards.

``PaddedCache`` holds one transformers ``DynamicCache`` of shape (B, heads, S, head_dim) per layer for
B rows, and beside it which of the S columns (slots) hold a row's token (``valid``, (B, S) bool) and at
which position (``pos``, (B, S) long). A forward appends N columns to every row; a row fed n < N
tokens gets its tokens right-aligned after N - n pad columns, marked invalid. The attention mask is
``valid`` (plus the new columns' validity) and the position ids are explicit, so each row attends to
exactly its own tokens at their own positions, as its batch-of-one forward would.

- **rollback** (``crop``): a row keeps its first ``keep`` tokens by marking later slots invalid, a
  tensor operation over the whole batch; no data moves (``DynamicCache.crop`` cuts every row alike);
- **holes**: invalid columns stay until ``compact`` packs each row's valid slots to the right (one
  gather per layer), which the decoder calls when they exceed a share of the cache;
- **rows join** with an empty cache (``add_rows``) and fill it in a forward of their own, apart from
  the others (``prefill``: the prompts of the joining rows, padded among themselves); **rows leave**
  with ``select``;
- a failed forward is undone by ``restore(snapshot())``: forwards only append columns.

Masked slots get exactly zero attention weight, so a row's logits equal its batch-of-one forward's up
to float rounding (matrices of other shapes); argmax decisions agree except on exact near-ties.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from bild_env.models.compat import cache_kwarg
from bild_env.models.device import sync


@dataclass
class Snapshot:
    """What ``restore`` needs to undo forwards: the column count and the row bookkeeping."""

    columns: int
    widened: int  # columns added on the left so far (``PaddedCache._widen``)
    valid: torch.Tensor
    pos: torch.Tensor
    length: torch.Tensor


class PaddedCache:
    """KV cache of ``model`` for B rows with their own lengths (module docstring). Starts with no rows."""

    def __init__(self, model) -> None:
        from transformers import DynamicCache

        self.model = model
        self.device = next(model.parameters()).device
        self._new_cache = lambda: DynamicCache(config=model.config)
        self._cache = self._new_cache()
        self.valid = torch.zeros((0, 0), dtype=torch.bool, device=self.device)  # (B, S): slot holds a token
        self.pos = torch.zeros((0, 0), dtype=torch.long, device=self.device)  # (B, S): that token's position
        self.length = torch.zeros(0, dtype=torch.long, device=self.device)  # (B,): tokens each row holds
        self._widened = 0  # columns ever added on the left (for restore)
        self.last_ms = 0.0  # wall time of the last model call (device synchronised), ms

    def _call(self, **kwargs) -> torch.Tensor:
        """The model's forward, timed into ``last_ms``; float32 logits."""
        sync(self.device)
        t0 = time.perf_counter()
        logits = self.model(use_cache=True, **kwargs).logits
        sync(self.device)
        self.last_ms = (time.perf_counter() - t0) * 1000.0
        return logits.float()

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    @property
    def columns(self) -> int:
        """Slots per row (S), valid or not: the attention's key length."""
        return self.valid.shape[1]

    @property
    def waste(self) -> float:
        """Share of slots that hold no token (padding and rolled-back holes)."""
        return 1.0 - float(self.length.sum()) / (self.rows * self.columns) if self.rows * self.columns else 0.0

    def _layers(self) -> list:
        return [layer for layer in self._cache.layers if layer.is_initialized and layer.keys.numel()]

    def _map(self, fn) -> None:
        """Replace every layer's keys and values ``t`` by ``fn(t)``."""
        for layer in self._layers():
            layer.keys, layer.values = fn(layer.keys), fn(layer.values)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, new_valid: torch.Tensor, positions: torch.Tensor, keep: int) -> torch.Tensor:
        """One forward of every row: ``ids``, ``new_valid``, ``positions`` (B, N); float32 logits (B, keep, V).

        Row r's real tokens are the ``new_valid[r]`` columns (right-aligned); a row with none (idle this
        forward) costs N pad tokens and keeps nothing. The logits are of the last ``keep`` columns.
        """
        mask = torch.cat([self.valid, new_valid], 1).long()
        logits = self._call(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwarg(self._cache),
                            logits_to_keep=keep)
        self.valid = torch.cat([self.valid, new_valid], 1)
        self.pos = torch.cat([self.pos, positions], 1)
        self.length = self.length + new_valid.sum(1)
        return logits

    @torch.inference_mode()
    def prefill(self, rows: torch.Tensor, ids: torch.Tensor, new_valid: torch.Tensor, positions: torch.Tensor,
                keep: int) -> torch.Tensor:
        """A forward of only ``rows`` (R,), whose caches are empty, on a fresh cache; spliced in. Logits (R, keep, V).

        Rows joining the batch fill their cache apart (their prompts padded among themselves, not to the
        others' lengths), the way serving engines prefill.
        """
        if bool(self.length[rows].any()):
            raise RuntimeError("internal error: prefill of rows whose cache is not empty")
        fresh = self._new_cache()
        logits = self._call(input_ids=ids, attention_mask=new_valid.long(), position_ids=positions,
                            **cache_kwarg(fresh), logits_to_keep=keep)
        self._splice(rows, fresh, new_valid, positions)
        return logits

    def _splice(self, rows: torch.Tensor, fresh, valid: torch.Tensor, pos: torch.Tensor) -> None:
        """Write ``fresh`` (R rows, L columns) into the last L columns of ``rows``, widening the cache if L > S."""
        L, S = valid.shape[1], self.columns
        if L > S:  # widen every row on the left with L - S invalid slots
            self._widen(L - S, fresh)
            S = L
        for index, layer in enumerate(fresh.layers):
            mine = self._cache.layers[index]
            mine.keys[rows, :, S - L :] = layer.keys
            mine.values[rows, :, S - L :] = layer.values
        self.valid[rows] = False
        self.valid[rows, S - L :] = valid
        self.pos[rows, S - L :] = pos
        self.length[rows] = valid.sum(1)

    def _widen(self, extra: int, template) -> None:
        B = self.rows
        if not self._layers():  # nothing cached yet: zero layers shaped like the template's
            self._cache = self._new_cache()
            for index, layer in enumerate(template.layers):
                shape = (B, layer.keys.shape[1], extra)
                self._cache.update(layer.keys.new_zeros(shape + layer.keys.shape[3:]),
                                   layer.values.new_zeros(shape + layer.values.shape[3:]), index)
        else:
            self._map(lambda t: torch.cat([t.new_zeros(t.shape[:2] + (extra,) + t.shape[3:]), t], 2))
        self._widened += extra
        self.valid = torch.cat([self.valid.new_zeros((B, extra)), self.valid], 1)
        self.pos = torch.cat([self.pos.new_zeros((B, extra)), self.pos], 1)

    def add_rows(self, count: int) -> None:
        """Append ``count`` rows with empty caches (all their slots invalid)."""
        S = self.columns
        self._map(lambda t: torch.cat([t, t.new_zeros((count,) + t.shape[1:])], 0))
        self.valid = torch.cat([self.valid, self.valid.new_zeros((count, S))], 0)
        self.pos = torch.cat([self.pos, self.pos.new_zeros((count, S))], 0)
        self.length = torch.cat([self.length, self.length.new_zeros(count)], 0)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices, in their new order): requests that leave are dropped."""
        if rows.numel() == 0:
            self._cache = self._new_cache()
            self.valid, self.pos, self.length = self.valid[:0, :0], self.pos[:0, :0], self.length[:0]
            return
        self._map(lambda t: t[rows])
        self.valid, self.pos, self.length = self.valid[rows], self.pos[rows], self.length[rows]

    def crop(self, keep: torch.Tensor) -> None:
        """Row r keeps its first ``keep[r]`` tokens (a rollback); ``keep[r] >= length[r]`` leaves it as is."""
        self.valid = self.valid & (self.pos < keep[:, None])
        self.length = torch.minimum(self.length, keep)

    def compact(self) -> None:
        """Pack each row's valid slots into the last ``max(length)`` columns, in order (one gather per layer)."""
        L = int(self.length.max()) if self.rows else 0
        if L == self.columns:
            return
        if L == 0:
            self._cache = self._new_cache()
            self.valid, self.pos = self.valid[:, :0], self.pos[:, :0]
            return
        # a stable sort puts the invalid slots first and keeps the valid ones in column (= position) order
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices[:, self.columns - L :]

        def gather(t: torch.Tensor) -> torch.Tensor:
            index = order[:, None, :, None].expand(t.shape[0], t.shape[1], L, t.shape[3])
            return t.gather(2, index)

        self._map(gather)
        self.valid, self.pos = self.valid.gather(1, order), self.pos.gather(1, order)

    def snapshot(self) -> Snapshot:
        return Snapshot(self.columns, self._widened, self.valid.clone(), self.pos.clone(), self.length.clone())

    def restore(self, snap: Snapshot) -> None:
        """Undo the forwards, prefills and crops made since ``snap`` (no rows joined, left or compacted since)."""
        left = self._widened - snap.widened
        if snap.columns == 0:
            self._cache = self._new_cache()
        else:
            self._map(lambda t: t[:, :, left : left + snap.columns])
        self._widened = snap.widened
        self.valid, self.pos, self.length = snap.valid, snap.pos, snap.length
