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
from bild_env.decoding.tree import Tree, TreeRule, _children, accept_path, grow, masked_forward, node_positions, tree_mask
from bild_env.models.draft_head import proposal_logits
from bild_env.models.pairs import ModelPair
from bild_env.paths import cache_dir, digest, prompt_key
from bild_env.replay.batching import Request, active_batcher
from bild_env.replay.dataset import seed_for
from bild_env.replay.store import TreeStore, scoped_store
from bild_env.replay.tree import MISSING, PrefixTree


TOP_KEPT = 8  # the draft's candidates a tree fill keeps per node (more when a rule asks for more children)


class _TreeStep:
    """The tree step under way: the prefix-tree node of its root and of the tree nodes looked up so far, and the
    tree nodes fed to the draft (``keep_path`` counts those the draft keeps)."""

    def __init__(self, root: int | None = None) -> None:
        self.root = root
        self.where: dict[int, int] = {}
        self.draft_fed: set[int] = set()


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
        self.store.attach(folder, vocab_size=pair.vocab_size, seed=seed_for(pair))
        self.prompt_key: str | None = None
        self.tree: PrefixTree | None = None
        # When a list: every would-be forward is also appended as (role, fed, context), for a caller that
        # charges forwards itself (the serving env batches the forwards of many requests' steps).
        self.trace: list[tuple[str, int, int]] | None = None
        # False: forwards are counted but not priced by the cost model (``stats.model_ms`` stays 0), for a
        # caller that prices the trace itself (the serving env: a fifth of a warm step went to prices it dropped).
        self.price_forwards = True
        self.start()

    def snapshot(self) -> tuple:
        """What a step changes in the runner's accounting (the caches' lengths, the statistics, the trace), for
        ``restore``; the path through the tree follows the session's tokens (``_sync``)."""
        return dict(self.lengths), self.stats.copy(), None if self.trace is None else list(self.trace)

    def restore(self, saved: tuple) -> None:
        lengths, stats, trace = saved
        self.lengths, self.stats = dict(lengths), stats.copy()
        if trace is not None:
            self.trace = list(trace)

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
        self._step_tree = _TreeStep()
        if self.trace is not None:
            self.trace.clear()

    def draft_next(self, tokens: list[int]) -> tuple[int, float]:
        node = self._filled("draft", tokens, count_hit=True)
        self._count("draft", tokens)
        return self.tree.d_arg[node], self.tree.d_p[node]

    def peek_draft(self, tokens: list[int]) -> float:
        """The draft's max probability after ``tokens``: what the next ``draft_next`` there returns, read ahead for an
        observation. Filled by a draft forward on a miss; not charged (the next draft run's first forward is this
        one), and the live caches' lengths are untouched."""
        return float(self.tree.d_p[self._filled("draft", tokens)])

    def peek_score(self, tokens: list[int], predictor=None) -> float:
        """``peek_draft``'s max probability for the next proposal after ``tokens``; with ``predictor`` (a lookup
        predictor, ``bild_env.models.lookup``) its chance that the target keeps that proposal."""
        if predictor is None:
            return self.peek_draft(tokens)
        token, p = self.peek_proposal(tokens)
        return predictor.probability(p, tokens, token)

    def peek_proposal(self, tokens: list[int]) -> tuple[int, float]:
        """The draft's proposal after ``tokens`` and its max probability, read ahead as ``peek_draft`` reads it (filled
        on a miss, not charged; the next ``draft_next`` there returns the same)."""
        node = self._filled("draft", tokens)
        return int(self.tree.d_arg[node]), float(self.tree.d_p[node])

    def target_agrees(self, tokens: list[int], token: int) -> float:
        """1.0 if the target's greedy token after ``tokens`` is ``token`` (the draft's proposal there), else 0.0: the
        oracle score (``bild.DraftScore``). Read from the tree, filled by a target forward on a miss; never charged
        (no live decoder could know it), and the live caches' lengths are untouched."""
        return float(self.tree.t_arg[self._filled("target", tokens)] == token)

    def _filled(self, role: str, tokens: list[int], count_hit: bool = False) -> int:
        """The node of ``tokens``, its ``role``'s argmax filled by a forward of that model on a miss (counted; a hit
        counted too with ``count_hit``)."""
        self._sync(tokens)
        node = self.nodes[-1]
        if (self.tree.d_arg if role == "draft" else self.tree.t_arg)[node] == MISSING:
            self.store.counts.misses += 1
            self._fill(role, tokens, len(tokens) - 1)
        elif count_hit:
            self.store.counts.hits += 1
        return node

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

    # -- tree steps (bild_env.decoding.tree.tree_step) ------------------------------------------
    # A tree step is answered as a chain step is: from what the prefix tree holds at each prefix (a tree node's path
    # from the committed tokens is a prefix), its forwards charged as ``TreeRunner`` runs them. It needs the draft's
    # top candidates at each node it expands (``PrefixTree.d_top``) and the target's argmax along the path it follows
    # (``t_arg``); a miss fills them with one forward of the model over the tree's nodes under a tree mask.
    def grow_tree(self, tokens: list[int], rule: TreeRule, levels: int, eos: frozenset[int]) -> Tree:
        """1. propose (``TreeRunner.grow_tree``): the draft's tree after ``tokens``, grown by ``rule`` from the draft's
        top candidates the prefix tree holds at each expanded node; charged as the live draft's forwards (the
        committed tokens its cache lacks, then one forward per level fed that level's expanded nodes)."""
        step = self._step_tree = _TreeStep(self.node_at(tokens))
        fed: list[int] = []  # the nodes fed to the draft (its columns), in order

        def children(tree: Tree, parents: list[int], count: int):
            if parents == [-1]:  # the committed tokens the draft's cache lacks, the root last
                self._count("draft", tokens)
            else:
                self._charge("draft", len(parents), len(tokens) + len(fed))
                fed.extend(parents)
            return self._draft_top(tokens, tree, parents, count)

        tree, index = grow(rule, levels, eos, children)
        if index is not None:  # the nodes kept, renumbered
            step.where = {index[old]: node for old, node in step.where.items() if old in index}
            fed = [index[n] for n in fed if n in index]
        step.draft_fed = set(fed)
        return tree

    def verify_tree(self, tokens: list[int], tree: Tree, limit: int, eos: frozenset[int]) -> tuple[list[int], int]:
        """2. verify and 3. accept (``TreeRunner.verify_tree``): charged as one target forward over the committed
        tokens its cache lacks and every node; the path followed reads the target's argmax at the root and at each
        node it reaches, from the prefix tree (filled, on a miss, by one target forward over the whole tree)."""
        if self._step_tree.root is None:  # no tree grown this step (no room for a draft token)
            self._step_tree = _TreeStep(self.node_at(tokens))
        self._charge("target", len(tokens) - self.lengths["target"] + len(tree.tokens), self.lengths["target"])
        self.lengths["target"] = len(tokens)
        filled = []

        def argmax(i: int) -> int:
            node = self._prefix_node(tree, i - 1)
            if self.tree.t_arg[node] == MISSING:
                if filled:
                    raise RuntimeError("internal error: a target fill left a node of its tree without an argmax")
                self._store("target", self._tree_fill("target", tokens, tree, [-1, *range(len(tree.tokens))]),
                            [self._prefix_node(tree, j) for j in range(-1, len(tree.tokens))])
                filled.append(True)
            return self.tree.t_arg[node]

        out = accept_path(tree, argmax, limit, eos)
        if not filled:
            self.store.counts.hits += 1
        return out

    def keep_path(self, path: list[int]) -> int:
        """4. update (``TreeRunner.keep_path``): the live caches' lengths after the step keep the committed tokens and
        the followed nodes each model was fed; returns how many the draft kept."""
        kept = sum(1 for node in path if node in self._step_tree.draft_fed)
        self.lengths["draft"] += kept
        self.lengths["target"] += len(path)
        self._step_tree = _TreeStep()
        return kept

    def _prefix_node(self, tree: Tree, i: int) -> int:
        """The prefix-tree node of tree node ``i`` (-1: the root, the committed tokens), made on first use."""
        step = self._step_tree
        if i < 0:
            return step.root
        node = step.where.get(i)
        if node is None:
            node = step.where[i] = self.tree.child(self._prefix_node(tree, tree.parents[i]), tree.tokens[i])
        return node

    def _draft_top(self, tokens: list[int], tree: Tree, parents: list[int], count: int):
        """The draft's ``count`` most likely next tokens after each of ``parents`` (-1: the root) and their
        log-probabilities, as ``tree._children`` reads them; the parents the prefix tree lacks filled in one forward."""
        d_top = self.tree.d_top
        nodes = [self._prefix_node(tree, i) for i in parents]
        lacking = [i for i, node in zip(parents, nodes) if len(d_top.get(node, ((), ()))[0]) < count]
        if lacking:
            k = max(count, TOP_KEPT)
            self._need_models(tokens)
            with proposal_logits(self.pair.draft) as ids:
                z = self._tree_fill("draft", tokens, tree, lacking)
                args, lps = _children(z, ids, min(k, z.shape[-1]))
            for i, a, lp in zip(lacking, args, lps):
                node = self._prefix_node(tree, i)
                d_top[node] = (a, lp)
                if self.tree.d_arg[node] == MISSING:
                    self.tree.d_arg[node], self.tree.d_p[node] = a[0], math.exp(lp[0])
        else:
            self.store.counts.hits += 1
        return [d_top[n][0][:count] for n in nodes], [d_top[n][1][:count] for n in nodes]

    @torch.inference_mode()
    def _tree_fill(self, role: str, tokens: list[int], tree: Tree, rows: list[int]) -> torch.Tensor:
        """One forward of ``role`` over the committed tokens its shadow cache lacks (the root at least) and the tree
        nodes ``rows`` need (their ancestors and themselves) under a tree mask; float32 logits of ``rows`` (-1: the
        root), in order. The shadow cache keeps the committed tokens only."""
        self._sync(tokens)
        self._need_models(tokens)
        self._shadow_cache(role, tokens)
        cache, model = self.shadow[role], getattr(self.pair, role)
        prefix = min(self.shadow_len[role], len(tokens) - 1)
        crop_cache(cache, prefix)
        nodes = sorted({a for i in rows if i >= 0 for a in tree.ancestry(i)})
        fed_tokens = len(tokens) - prefix
        t0 = time.perf_counter()
        try:
            z = masked_forward(model, cache, tokens[prefix:] + [tree.tokens[i] for i in nodes],
                               node_positions(tree, nodes, prefix, fed_tokens),
                               tree_mask(tree, [], nodes, prefix, fed_tokens, model.dtype), len(nodes) + 1,
                               self.pair.device)
        except BaseException:
            self.shadow.pop(role, None)  # its length unknown: the next fill starts it again
            raise
        crop_cache(cache, len(tokens))
        self.shadow_len[role] = len(tokens)
        self.store.counts.misses += 1
        self.store.counts.count_fill(1, t0)
        self.store.changed(self.prompt_key)
        row = {node: 1 + j for j, node in enumerate(nodes)} | {-1: 0}
        return z[[row[i] for i in rows]]

    # -- bookkeeping ------------------------------------------------------------------------
    def _count(self, role: str, tokens: list[int]) -> None:
        """Charge the forward live decoding would run here (what its cache lacks) to the cost model."""
        self._charge(role, len(tokens) - self.lengths[role], self.lengths[role])
        self.lengths[role] = len(tokens)

    def _charge(self, role: str, fed: int, context: int) -> None:
        """Count one forward of ``role`` fed ``fed`` tokens on ``context`` cached ones (priced unless the caller prices
        the trace)."""
        count_forward(self.stats, self.cost_model if self.price_forwards else None, role, fed, context)
        if self.trace is not None:
            self.trace.append((role, fed, context))

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
        self._need_models(tokens)
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

    def _need_models(self, tokens: list[int]) -> None:
        """A miss: a decoding dataset's pair (``RecordedPair``) loads its models for it, never downloading them."""
        if not getattr(self.pair, "loaded", True):
            self.pair.models(step=f"the step of prompt {self.prompt_key[:12]} after {len(tokens) - self.prompt_len} "
                                  "tokens generated")

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
        self.store.counts.count_fill(1, t0)
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
