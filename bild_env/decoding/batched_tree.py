"""Lossless tree speculation in the batched decoder: every row grows its own tree, one target forward verifies them all.

``BatchedTreeDecoder`` is a ``BatchedDecoder`` (rows join, leave, keep one padded cache per model) whose step,
``step_tree(rule)``, is ``tree.tree_step`` for every running row at once:

1. propose: one batched draft forward feeds each row the committed tokens its draft cache lacks (a row whose draft
   cache is empty, its prompt, in a prefill of its own, as ``BatchedDecoder`` does) and gives its root's children;
   then level by level one batched draft forward feeds every row the nodes it expands at that depth
   (``tree._expand``, by the same ``TreeRule``), rows with fewer nodes padded, rows with none idle; the dynamic
   rule's ``budget`` cut is each row's own (``tree._verified``);
2. verify: ONE batched target forward feeds every row its root (the committed token the target lacks) and all its
   nodes, rows padded to the widest; node i of row r sees row r's committed tokens, its ancestors and itself, at
   position ``root + depth`` (the 4-D additive mask ``rows_tree_mask``, handed whole to the model:
   ``PaddedCache.forward(mask=)``);
3. accept: each row follows its own path (``tree.accept_path``);
4. update: in both padded caches every node column of the step off the row's path becomes a hole
   (``PaddedCache.drop``; the path's columns stay where they are, valid, at their positions), as rolled-back tokens
   do; holes are packed away by the batched decoder's compaction.

Each row's tokens are its target's greedy continuation, as with ``generate_tree`` (tested: equal to target-only
greedy of the prompt alone and to ``generate_tree``, and with a batch of one its counters equal ``generate_tree``'s).
Forwards are counted as the batched decoder counts them (each row fed a token in a forward counts it and the tokens
it was fed); with a ``cost_model`` each such row is charged ``cost_model.batch_ms(role, rows in the forward, columns
fed (the widest row's), mean tokens the rows' caches hold)`` as ``model_ms`` (a batch of one: ``ms``, as
``generate_tree``). ``proposed`` counts the nodes verified, ``accepted`` the nodes followed, ``full_accepts`` the
steps whose path ended at a leaf.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bild_env.decoding.batched import _C, BatchedDecoder
from bild_env.decoding.cost_model import CostModel
from bild_env.decoding.rows import feed_rows
from bild_env.decoding.stats import DecodeStats, Generation
from bild_env.decoding.tree import (Tree, TreeRule, _add_children, _children, _expand, _verified, accept_path,
                                    parse_tree_rule)
from bild_env.models.draft_head import proposal_logits
from bild_env.models.pairs import ModelPair


def rows_tree_mask(committed: torch.Tensor, fed_tokens: list[int], trees: list[Tree], fed_nodes: list[list[int]],
                   cached_nodes: list[dict[int, int]], N: int, dtype: torch.dtype) -> torch.Tensor:
    """``tree.tree_mask`` for B padded rows: the additive mask (B, 1, N, S + N) of one forward.

    ``committed`` (B, S) bool: the cache's slots holding a row's committed tokens (not pads, holes or this step's
    nodes). Row r is fed, right-aligned in the N new columns, ``fed_tokens[r]`` committed tokens (causal) and then
    the nodes ``fed_nodes[r]`` of ``trees[r]``; ``cached_nodes[r]`` maps the nodes fed earlier this step to their slots.
    A node sees the committed tokens, its ancestors and itself; a pad column sees itself only (its output unread).
    """
    B, S = committed.shape
    seen = torch.zeros((B, N, S + N), dtype=torch.bool)
    seen[:, torch.arange(N), S + torch.arange(N)] = True  # each new column sees itself (pads: that alone)
    committed = committed.cpu()
    for r in range(B):
        c, nodes = fed_tokens[r], fed_nodes[r]
        k0 = N - c - len(nodes)  # the row's first real column
        if c + len(nodes) == 0:
            continue
        seen[r, k0:, :S] = committed[r]
        for i in range(c):  # committed tokens: causal among themselves
            seen[r, k0 + i, S + k0 : S + k0 + i + 1] = True
        slot = dict(cached_nodes[r]) | {node: S + k0 + c + j for j, node in enumerate(nodes)}
        for j, node in enumerate(nodes):
            q = k0 + c + j
            seen[r, q, S + k0 : S + k0 + c] = True
            for a in trees[r].ancestry(node):
                seen[r, q, slot[a]] = True
    mask = torch.zeros((B, N, S + N), dtype=dtype)
    mask.masked_fill_(~seen, torch.finfo(dtype).min)
    return mask[:, None]


class BatchedTreeDecoder(BatchedDecoder):
    """The batched decoder with tree steps (module docstring): ``step_tree(rule)`` for every running request.

    ``cost_model``: prices every forward (``model_ms``) by its batched tables (``CostModel.batch_ms``; a cost model
    without them prices a batch of one only, and a ValueError says so at the first larger forward).
    """

    def __init__(self, pair: ModelPair, cost_model: CostModel | None = None) -> None:
        super().__init__(pair)
        self.cost_model = cost_model
        self._model_ms: list[float] | None = None

    @torch.inference_mode()
    def join(self, prompts: Sequence, max_new_tokens: int | Sequence[int] = 64,
             request_ids: Sequence | None = None) -> list:
        """``BatchedDecoder.join``; with a cost model, each joining request is charged the target's prefill (the
        joining rows fed the longest prompt's length on empty caches)."""
        ids = super().join(prompts, max_new_tokens, request_ids)
        if self.cost_model is not None and ids:
            stats = [self.totals[rid] if rid in self.totals else self.finished[rid].stats for rid in ids]
            fed = max(s.target_tokens_fed for s in stats)  # each joining request's prefill fed its prompt
            ms = self.cost_model.batch_ms("target", len(ids), fed, 0.0)
            for s in stats:
                s.model_ms = ms
        return ids

    @torch.inference_mode()
    def step_tree(self, rule: TreeRule | str = "16:6:4") -> dict:
        """One tree step of every running request by ``rule`` (a ``TreeRule`` or its text, ``parse_tree_rule``).
        Returns ``{request id: DecodeStats of this step}``; finished requests move to ``finished``."""
        rule = parse_tree_rule(rule) if isinstance(rule, str) else rule
        self._require_rows()
        self._model_ms = [0.0] * len(self.ids) if self.cost_model is not None else None
        return self._run_phases(lambda counts: self._tree_phases(rule, counts))

    def _row_stats(self, row: int, stats: DecodeStats) -> None:
        if self._model_ms is not None:
            stats.model_ms = self._model_ms[row]

    def _tree_phases(self, rule: TreeRule, counts: torch.Tensor) -> None:
        B = len(self.ids)
        eos = frozenset(self.pair.eos_token_ids)
        remaining = (self.max_new - self.new_count).tolist()
        levels = [max(0, min(rule.levels, left - 1)) for left in remaining]  # room for the target's own token
        trees = [Tree.empty() for _ in range(B)]
        slots = {role: [{} for _ in range(B)] for role in self.caches}  # the tree's node -> its cache slot, per row
        self._step_slots = {role: [set() for _ in range(B)] for role in self.caches}  # every slot a node took this step
        growing = [n > 0 for n in levels]
        # 1. propose
        with proposal_logits(self.pair.draft) as head:
            if any(growing):
                first = rule.branching[0] if rule.branching else rule.width
                z = self._root_forward(torch.tensor(growing, device=self.device), counts)
                rows = [r for r in range(B) if growing[r]]
                args, lps = _children(z[rows], head, first)
                for r, arg, lp in zip(rows, args, lps):
                    _add_children(trees[r], [-1], [arg], [lp])
            for depth in range(1, max(levels, default=0)):
                fed = [[] for _ in range(B)]
                for r in range(B):
                    if growing[r] and depth < levels[r]:
                        fed[r] = _expand(trees[r], depth, rule, eos)
                        growing[r] = bool(fed[r])
                if not any(fed):
                    break
                count = rule.branching[depth] if rule.branching else rule.width
                z, N = self._tree_forward("draft", trees, fed, slots["draft"], counts)
                flat = [r * N + N - len(nodes) + j for r, nodes in enumerate(fed) for j in range(len(nodes))]
                args, lps = _children(z.reshape(B * N, -1)[flat], head, count)
                at = 0
                for r, nodes in enumerate(fed):
                    _add_children(trees[r], nodes, args[at : at + len(nodes)], lps[at : at + len(nodes)])
                    at += len(nodes)
        for r in range(B):
            trees[r], index = _verified(trees[r], rule)
            if index is not None:  # the draft's slots of the nodes cut stay this step's, off every path (dropped below)
                slots["draft"][r] = {index[node]: s for node, s in slots["draft"][r].items() if node in index}
        # 2. verify: every row's root and all its nodes, in one target forward
        nodes = [list(range(len(tree.tokens))) for tree in trees]
        z, N = self._tree_forward("target", trees, nodes, slots["target"], counts)
        argmax = z.argmax(-1).tolist()
        # 3. accept
        lens = self.lens.tolist()
        paths = []
        for r, tree in enumerate(trees):
            path, token = accept_path(tree, argmax[r][N - len(tree.tokens) - 1 :], levels[r], eos)
            new = [tree.tokens[i] for i in path]
            if not (path and new[-1] in eos):  # the run is not done: the target's own token after the path
                new.append(token)
            self.tokens[r, lens[r] : lens[r] + len(new)] = torch.tensor(new, device=self.device)
            lens[r] += len(new)
            paths.append(path)
            counts[r, _C["proposed"]] = len(tree.tokens)
            counts[r, _C["accepted"]] = len(path)
            counts[r, _C["full_accepts"]] = bool(path) and path[-1] not in tree.parents
        self.lens = torch.tensor(lens, dtype=torch.long, device=self.device)
        # 4. update: each cache keeps its committed tokens and the path's nodes it was fed; the rest are holes
        for role, cache in self.caches.items():
            holes = torch.zeros(cache.valid.shape, dtype=torch.bool)
            for r, path in enumerate(paths):
                kept = {slots[role][r][node] for node in path if node in slots[role][r]}
                for s in self._step_slots[role][r] - kept:
                    holes[r, s] = True
            cache.drop(holes.to(self.device))

    def _root_forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The draft's logits (B, V or K) after each row in ``rows``'s committed tokens (its root), fed what its cache
        lacks: rows with an empty draft cache in a prefill of their own, the others in one batched forward."""
        cache, B = self.caches["draft"], len(self.ids)
        fresh = rows & (cache.length == 0)
        rest = rows & ~fresh
        z = None
        if bool(fresh.any()):
            index = fresh.nonzero()[:, 0]
            lengths = self.lens[index]
            ids, real, positions, N = feed_rows(self.tokens[index], torch.zeros_like(lengths), lengths)
            zf = cache.prefill(index, ids, real, positions, keep=1)[:, -1]
            self._count("draft", fresh, torch.where(fresh, self.lens, 0), cache.last_ms, counts)
            self._log("draft", len(index), N, 0, len(index), True)
            self._price("draft", fresh, len(index), N, 0.0)
            z = zf.new_zeros((B, zf.shape[-1]))
            z[index] = zf
        if bool(rest.any()):
            context = float(cache.length.double().mean())
            zr, ids = self._forward("draft", rest, counts, keep=1)
            self._price("draft", rest, B, ids.shape[1], context)
            z = zr[:, -1] if z is None else torch.where(rest[:, None], zr[:, -1], z)
        return z

    def _tree_forward(self, role: str, trees: list[Tree], fed: list[list[int]], slots: list[dict[int, int]],
                      counts: torch.Tensor) -> tuple[torch.Tensor, int]:
        """One batched forward of ``role``: row r fed the committed tokens its cache lacks (where it is fed nodes or
        is the target's: a verification feeds the root) and then the nodes ``fed[r]`` of ``trees[r]``, right-aligned;
        its new nodes' slots go into ``slots[r]``. Returns float32 logits of every new column (B, N, V or K) and N."""
        cache, B = self.caches[role], len(self.ids)
        S, lens, step = cache.columns, self.lens.tolist(), self._step_slots[role]
        held = [n - len(s) for n, s in zip(cache.length.tolist(), step)]  # the committed tokens each row's cache holds
        c = [lens[r] - held[r] if fed[r] or role == "target" else 0 for r in range(B)]
        if role == "draft" and any(c[r] and fed[r] for r in range(B)):
            raise RuntimeError("internal error: committed tokens to feed the draft after its root")
        width = [c[r] + len(fed[r]) for r in range(B)]
        N = max(width)
        committed = cache.valid.clone()
        for r in range(B):
            for s in step[r]:
                committed[r, s] = False
        mask = rows_tree_mask(committed, c, trees, fed, slots, N, cache.model.dtype)
        ids = torch.zeros((B, N), dtype=torch.long)
        real = torch.zeros((B, N), dtype=torch.bool)
        positions = torch.zeros((B, N), dtype=torch.long)
        tokens = self.tokens.tolist()
        for r in range(B):
            k0 = N - width[r]
            real[r, k0:] = True
            row = tokens[r][held[r] : held[r] + c[r]] + [trees[r].tokens[i] for i in fed[r]]
            ids[r, k0:] = torch.tensor(row, dtype=torch.long)
            positions[r, k0:] = torch.tensor(list(range(held[r], held[r] + c[r]))
                                             + [lens[r] - 1 + trees[r].depths[i] for i in fed[r]], dtype=torch.long)
        context = float(cache.length.double().mean())
        device = self.device
        z = cache.forward(ids.to(device), real.to(device), positions.to(device), N, mask=mask.to(device))
        for r in range(B):
            for j, node in enumerate(fed[r]):
                slots[r][node] = S + N - len(fed[r]) + j
                step[r].add(S + N - len(fed[r]) + j)
        rows = torch.tensor([w > 0 for w in width], device=device)
        self._count(role, rows, torch.tensor(width, device=device), cache.last_ms, counts)
        self._log(role, B, N, S, int(rows.sum()), False)
        self._price(role, rows, B, N, context)
        return z, N

    def _price(self, role: str, rows: torch.Tensor, batch: int, fed: int, context: float) -> None:
        """Charge each row in ``rows`` one forward of ``batch`` sequences fed ``fed`` columns (the cost model's)."""
        if self._model_ms is None:
            return
        ms = self.cost_model.batch_ms(role, batch, fed, context)
        for r in rows.nonzero()[:, 0].tolist():
            self._model_ms[r] += ms


def generate_batched_tree(pair: ModelPair, prompts: Sequence, rule="16:6:4", max_new_tokens: int | Sequence[int] = 64,
                          cost_model=None) -> list[Generation]:
    """Tree speculation (``rule``: a ``tree.TreeRule`` or its text) over all ``prompts`` as one batch, lossless: each
    row's tokens are its target's greedy ones (``batched_tree.BatchedTreeDecoder``); one ``Generation`` per prompt.
    ``cost_model``: prices each forward into ``model_ms`` by its batched tables (``CostModel.batch_ms``)."""
    rule = parse_tree_rule(rule) if isinstance(rule, str) else rule
    if not prompts:
        raise ValueError("no prompts: give at least one")
    if cost_model is not None:
        cost_model.batch_ms("target", len(prompts), 1, 0.0)  # a cost model that cannot price this batch says so now
    decoder = BatchedTreeDecoder(pair, cost_model)
    ids = decoder.join(list(prompts), max_new_tokens)
    while len(decoder):
        decoder.step_tree(rule)
    return [decoder.finished[i] for i in ids]
