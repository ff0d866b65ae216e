"""``ReplayRunner``: the runner interface (``bild_env.decoding.runner``) answered from prefix trees.

Greedy BiLD (and naive speculative decoding) is a deterministic function of the token prefix, and
all a step needs at a prefix are the four numbers a ``PrefixTree`` stores. The replay runner keeps
the same virtual KV-cache lengths as ``LiveRunner`` and charges each would-be forward to the
calibrated cost model, so an env on replay produces exactly the tokens, observations, rewards and
infos of the live env in ``latency="model"`` mode.

Numbers a tree lacks are filled by running the model that lacks them over the part of the path
it has not seen, in one forward: the runner keeps a "shadow" KV cache of each model along the
current path (cropped where the path changes), so a fill costs at most the forward the live env
would have run, and a hit costs nothing. A new prompt starts warm: its tree is filled along the
target's greedy continuation (the BLEU reference, one forward of each model over it), where most
episodes go. Inside ``CoopBatcher.run`` (``BatchedReplayVecEnv``) a fill waits and joins the other
jobs' fills in one batched forward.

Trees live in a ``TreeStore`` (one per pair on disk; in memory the pair's process-wide store,
``TreeStore.for_folder``, unless one is handed in or the runner is made inside ``sharing(store)``).
"""

from __future__ import annotations

import math
import time

import torch

from bild_env.decoding.costs import CostModel
from bild_env.decoding.kv import Row, cache_prefix, crop_cache, draft_readout, single_forward, target_readout
from bild_env.decoding.runner import count_forward
from bild_env.decoding.stats import DecodeStats
from bild_env.models.pairs import ModelPair
from bild_env.paths import cache_dir, digest, prompt_key
from bild_env.replay.batching import Request, active_batcher
from bild_env.replay.store import TreeStore, scoped_store
from bild_env.replay.tree import MISSING, PrefixTree


class ReplayRunner:
    """The runner interface answered from prefix trees, filling them with the models on a miss.

    ``store``: the trees to read and fill (default: the store of an enclosing ``sharing`` block,
    else the pair's process-wide one). ``references`` gives each new prompt's warm-start path.
    """

    def __init__(self, pair: ModelPair, cost_model: CostModel, references, max_new_tokens: int,
                 store: TreeStore | None = None) -> None:
        self.pair, self.cost_model, self.references = pair, cost_model, references
        self.max_new_tokens = max_new_tokens
        folder = cache_dir("replay", digest(pair.key))
        self.store = store or scoped_store() or TreeStore.for_folder(folder)
        self.store.attach(folder, vocab_size=pair.vocab_size)
        self.prompt_key: str | None = None
        self.tree: PrefixTree | None = None
        # When a list: every would-be forward is also appended as (role, fed, context), for a caller that
        # charges forwards itself (the serving env batches the forwards of many requests' steps).
        self.trace: list[tuple[str, int, int]] | None = None
        # False: forwards are counted but not priced by the cost model (``stats.model_ms`` stays 0), for a
        # caller that prices the trace itself (the serving env: a fifth of a warm step went to prices it dropped).
        self.price_forwards = True
        self.start()

    # -- runner interface -------------------------------------------------------------------
    def start(self) -> None:
        """Forget the current prompt (its tree may be evicted again) and zero the statistics."""
        if self.prompt_key is not None:
            self.store.release(self.prompt_key)
        self.tree, self.prompt_key, self.prompt_len = None, None, 0
        self.seq: list[int] = []  # generated tokens whose nodes are in self.nodes
        self.nodes: list[int] = [0]  # nodes[i] = node of prompt + seq[:i]
        self.lengths = {"draft": 0, "target": 0}  # the caches live decoding would hold (for costs)
        self.shadow, self.shadow_len = {}, {}  # real caches along the current path, for fills
        self.stats = DecodeStats(model_ms=0.0)
        if self.trace is not None:
            self.trace.clear()

    def draft_next(self, tokens: list[int]) -> tuple[int, float]:
        self._sync(tokens)
        node, tree = self.nodes[-1], self.tree
        if tree.d_arg[node] == MISSING:
            self.store.counts.misses += 1
            self._fill("draft", tokens, len(tokens) - 1)
        else:
            self.store.counts.hits += 1
        self._count("draft", tokens)
        return tree.d_arg[node], tree.d_p[node]

    def peek_draft(self, tokens: list[int]) -> float:
        """The draft's max probability after ``tokens``: what the next ``draft_next`` there returns, read ahead for an
        observation. Filled by a draft forward on a miss; not charged (the next draft run's first forward is this
        one), and the live caches' lengths are untouched."""
        self._sync(tokens)
        node, tree = self.nodes[-1], self.tree
        if tree.d_arg[node] == MISSING:
            self.store.counts.misses += 1
            self._fill("draft", tokens, len(tokens) - 1)
        return float(tree.d_p[node])

    def peek_score(self, tokens: list[int], predictor=None) -> float:
        """``peek_draft``'s max probability for the next proposal after ``tokens``; with ``predictor`` (a lookup
        predictor, ``bild_env.models.lookup``) its chance that the target keeps that proposal."""
        if predictor is None:
            return self.peek_draft(tokens)
        token, p, _ = self.peek_run(tokens, 1)[0]
        return predictor.probability(p, tokens, token)

    def peek_run(self, tokens: list[int], n: int, eos=(), agrees: bool = False) -> list[tuple[int, float, float | None]]:
        """The draft's greedy run after ``tokens``: up to ``n`` proposals ``(token, max probability, agrees)``, ending
        after an ``eos`` token, read ahead as ``peek_draft`` reads one (filled on a miss, not charged; the next
        ``draft_next`` calls along it return the same). ``agrees``: also whether the target's greedy token there is
        the proposal (``target_agrees``; else None)."""
        path, out = list(tokens), []
        for _ in range(n):
            p = self.peek_draft(path)
            token = int(self.tree.d_arg[self.nodes[-1]])
            out.append((token, p, self.target_agrees(path, token) if agrees else None))
            path.append(token)
            if token in eos:
                break
        return out

    def target_agrees(self, tokens: list[int], token: int) -> float:
        """1.0 if the target's greedy token after ``tokens`` is ``token`` (the draft's proposal there), else 0.0: the
        oracle score (``bild.DraftScore``). Read from the tree, filled by a target forward on a miss; never charged
        (no live decoder could know it), and the live caches' lengths are untouched."""
        self._sync(tokens)
        node, tree = self.nodes[-1], self.tree
        if tree.t_arg[node] == MISSING:
            self.store.counts.misses += 1
            self._fill("target", tokens, len(tokens) - 1)
        return float(tree.t_arg[node] == token)

    def target_verify(self, tokens: list[int]) -> tuple[list[int], list[float], list[float]]:
        context = self.lengths["target"]
        if context == 0:
            self._open_prompt(tokens)
        self._sync(tokens)
        tree, p0 = self.tree, self.prompt_len - 1
        first = max(context, p0)  # prompt positions before the last are never verified
        nodes = self.nodes[first - p0 : len(tokens) - p0]
        missing = next((i for i, n in enumerate(nodes) if tree.t_arg[n] == MISSING
                        or (i < len(nodes) - 1 and (math.isnan(tree.t_logp[n]) or math.isnan(tree.t_top[n])))), None)
        if missing is None:
            self.store.counts.hits += 1
        else:
            self.store.counts.misses += 1
            self._fill("target", tokens, first + missing)
        argmax = [tree.t_arg[n] for n in nodes]
        logp, top = [], []
        for i, n in enumerate(nodes[:-1]):
            if tree.d_arg[n] != tokens[first + i + 1]:
                raise RuntimeError("internal error: replay verifies a token that is not the draft's argmax")
            logp.append(tree.t_logp[n])
            top.append(tree.t_top[n])
        self._count("target", tokens)
        return argmax, logp, top

    def crop(self, n: int) -> None:
        for role in self.lengths:
            self.lengths[role] = min(self.lengths[role], n)

    # -- bookkeeping ------------------------------------------------------------------------
    def _count(self, role: str, tokens: list[int]) -> None:
        """Charge the forward live decoding would run here (what its cache lacks) to the cost model."""
        context = self.lengths[role]
        count_forward(self.stats, self.cost_model if self.price_forwards else None, role, len(tokens) - context,
                      context)
        if self.trace is not None:
            self.trace.append((role, len(tokens) - context, context))
        self.lengths[role] = len(tokens)

    def node_at(self, tokens: list[int]) -> int:
        """The tree node of ``tokens`` (the open prompt's and what follows it), the last token's: its entries read
        what the models gave there (a node the tree lacked is made, empty: ``MISSING`` entries)."""
        self._sync(tokens)
        return self.nodes[-1]

    def _sync(self, tokens: list[int]) -> None:
        """Make ``self.nodes`` the node path of ``tokens`` (after appends and rollbacks)."""
        gen = tokens[self.prompt_len :]
        m = len(self.seq)
        if m > len(gen) or self.seq != gen[:m]:
            m = 0
            while m < min(len(self.seq), len(gen)) and self.seq[m] == gen[m]:
                m += 1
            del self.seq[m:], self.nodes[m + 1 :]
            self._crop_shadow(self.prompt_len + m)
        tree, nodes = self.tree, self.nodes
        for t in gen[m:]:
            nodes.append(tree.child(nodes[-1], t))
        self.seq.extend(gen[m:])

    def _open_prompt(self, prompt: list[int]) -> None:
        """Open the prompt's tree; a new one starts warm along the target's greedy continuation."""
        if self.prompt_key is not None:
            self.store.release(self.prompt_key)
        self.prompt_key, self.prompt_len = prompt_key(prompt), len(prompt)
        self.seq, self.nodes = [], [0]
        self.shadow, self.shadow_len = {}, {}  # made at the first fill of the episode
        self.tree, new = self.store.open(self.prompt_key)
        if new:  # one forward of each model along the reference
            reference = self.references.get(prompt)[: self.max_new_tokens]
            self._sync(prompt + reference)
            self._fill("draft", prompt + reference, self.prompt_len - 1)
            self._fill("target", prompt + reference, self.prompt_len - 1)
        self.store.evict()

    # -- filling ----------------------------------------------------------------------------
    @torch.inference_mode()
    def _fill(self, role: str, tokens: list[int], first: int) -> None:
        """One forward of ``role`` over ``tokens[first:]`` (or more, from where its shadow cache ends).

        Stores its numbers at every node from position ``first`` on that lacks them (positions
        before the prompt's last token have no node).
        """
        self._shadow_cache(role, tokens)
        if self.shadow_len[role] > first:
            crop_cache(self.shadow[role], first)
            self.shadow_len[role] = first
        keep = len(tokens) - max(self.shadow_len[role], self.prompt_len - 1)
        z = self._forward(role, Row(tokens[self.shadow_len[role] :], self.shadow[role], keep))
        self.shadow_len[role] = len(tokens)
        self._keep_first_path(role, tokens)
        self._store(role, z, self.nodes[len(tokens) - keep - self.prompt_len + 1 : len(tokens) - self.prompt_len + 1])
        self.store.changed(self.prompt_key)

    def _shadow_cache(self, role: str, tokens: list[int]) -> None:
        """This model's first fill in the episode starts from the prompt's kept path cache (or empty)."""
        if role in self.shadow:
            return
        from transformers import DynamicCache

        config = getattr(self.pair, role).config
        kept = self.store.path_cache(self.prompt_key, role)
        if kept is None:
            self.shadow[role], self.shadow_len[role] = DynamicCache(config=config), 0
            return
        common = 0
        for a, b in zip(kept[0], tokens):
            if a != b:
                break
            common += 1
        self.shadow[role], self.shadow_len[role] = cache_prefix(kept[1], common, config), common
        self.store.counts.path_cache_reuses += len(self.shadow) == 1  # counted once per episode

    def _forward(self, role: str, row: Row) -> torch.Tensor:
        """The fill forward: batched with other jobs' under a ``CoopBatcher``, else alone; counted as a fill."""
        model = getattr(self.pair, role)
        batcher = active_batcher()
        if batcher is not None:  # may wait while other runners' fills join the batch; the batcher counts it
            return batcher.forward(Request(role, model, row, self.cost_model.batch_costs(role), self.store.counts))
        t0 = time.perf_counter()
        z = single_forward(model, row)
        counts = self.store.counts
        counts.fills += 1
        counts.fill_rows += 1
        counts.fill_ms += (time.perf_counter() - t0) * 1000.0
        return z

    def _keep_first_path(self, role: str, tokens: list[int]) -> None:
        """The prompt's first filled path keeps its KV cache in the store (later episodes start from it)."""
        if self.store.path_cache(self.prompt_key, role) is None:
            config = getattr(self.pair, role).config
            self.store.keep_path_cache(self.prompt_key, role, list(tokens), self.shadow[role], config)

    def _store(self, role: str, z: torch.Tensor, nodes: list[int]) -> None:
        """Write the numbers read from logits ``z`` (one row per node) where the nodes lack them."""
        tree = self.tree
        if role == "draft":
            args, probs = draft_readout(z)
            for node, a, p in zip(nodes, args, probs):
                if tree.d_arg[node] == MISSING:
                    tree.d_arg[node], tree.d_p[node] = a, p
            return
        d_arg = [tree.d_arg[node] for node in nodes]
        argmax, logp, top = target_readout(z, [max(a, 0) for a in d_arg])
        for node, a, da, lp, t in zip(nodes, argmax, d_arg, logp, top):
            if tree.t_arg[node] == MISSING:
                tree.t_arg[node] = a
            if da != MISSING and (math.isnan(tree.t_logp[node]) or math.isnan(tree.t_top[node])):
                tree.t_logp[node], tree.t_top[node] = lp, t  # both from one forward: t_logp <= t_top
            elif math.isnan(tree.t_top[node]):
                tree.t_top[node] = t

    def _crop_shadow(self, n: int) -> None:
        for role, cache in self.shadow.items():
            if self.shadow_len[role] > n:
                crop_cache(cache, n)
                self.shadow_len[role] = n
