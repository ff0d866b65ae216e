"""Lossless tree speculation, batch size 1, greedy: the draft grows a tree, the target verifies it in one forward.

A chain (naive SD) lets the target check one draft token per position. Where a target forward fed many tokens
costs about what one fed one token does, a step can instead verify a *tree*: the children of a node are the
draft's top candidates after it, so the draft's second and third choices are checked where it is unsure
(SpecInfer, Medusa, Sequoia, EAGLE-2). One step:

1. propose (``_grow``): the draft, fed what its cache lacks, gives the root's children (the root is the last
   committed token); then level by level the nodes chosen for expansion are fed in one draft forward each, under a
   tree attention mask, and each gets its children. Two rules choose (``TreeRule``):
   - dynamic, in EAGLE-2's manner: at every level the ``width`` nodes of highest cumulative probability (the
     product of the draft's probabilities along the path) are expanded, each with its ``width`` most likely
     children; the tree verified is the ``budget`` nodes of highest cumulative probability among all proposed
     (closed under ancestors: a child's product never exceeds its parent's);
   - fixed: ``branching[d]`` children for every node at depth d (``(1, 1, 1, 1)`` is naive SD's chain of 4).
2. verify (``TreeRunner.tree_forward``): one target forward over the root and every node; node i sees the
   committed prefix, its ancestors and itself (``tree_mask``), at position ``root + depth`` (``position_ids``).
3. accept (``accept_path``): from the root, follow the child whose token is the target's argmax there, as long as
   there is one; the target's argmax after the last node followed is its own next token. The committed tokens are
   exactly the target's greedy continuation (each one is the target's argmax after the ones before it).
4. update (``TreeRunner.keep_path``): the nodes are not contiguous in the caches: both keep the committed prefix
   and the followed path's columns (gathered), nothing else.

The masks are 4-D (batch, 1, fed, cached + fed) additive float masks, which transformers' models take as given
(``masking_utils``: a 4-D mask is returned as-is) and the lean Llama forward runs itself
(``bild_env.models.lean``). Every forward is counted and priced as the chain decoders' (``runner.count_forward``):
by the tokens it is fed, tree nodes included.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from bild_env.decoding.cost_model import CostModel
from bild_env.decoding.decoders import live_result, prepare_prompt
from bild_env.decoding.kv import crop_cache
from bild_env.decoding.loop import Committed
from bild_env.decoding.runner import LiveRunner, count_forward
from bild_env.decoding.stats import DecodeStats, Generation
from bild_env.models.compat import cache_kwarg
from bild_env.models.draft_head import proposal_logits
from bild_env.models.pairs import ModelPair

MAX_TREE_NODES = 64  # the most nodes a rule may verify in one target forward (a guard against typos)


@dataclass(frozen=True)
class TreeRule:
    """How the draft grows its tree each step: dynamic (``budget``, ``depth``, ``width``) or a ``branching`` shape.

    Dynamic (``branching`` empty): at most ``depth`` levels; ``width`` nodes expanded per level (those of highest
    cumulative probability), ``width`` children each; the ``budget`` nodes of highest cumulative probability
    verified. Fixed: ``branching[d]`` children for every node at depth d (d = 0: the root), so
    ``len(branching)`` levels and every node verified. ``stop`` (dynamic): the tree stops growing at the first
    level whose most likely node has a cumulative probability below it (0: always ``depth`` levels), as naive SD's
    cumulative stopping rule stops a chain (``bild.DraftScore``), so that a step where the draft is unsure pays for
    fewer draft forwards.
    """

    budget: int = 0
    depth: int = 0
    width: int = 0
    branching: tuple[int, ...] = ()
    stop: float = 0.0  # dynamic: no level is grown once its most likely node's cumulative probability is below this

    def __post_init__(self) -> None:
        if self.branching:
            if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.branching):
                raise ValueError(f"a fixed tree's branching factors must be integers >= 1, got {self.branching}")
            if self.nodes > MAX_TREE_NODES:
                raise ValueError(f"the fixed tree {self.branching} has {self.nodes} nodes; at most {MAX_TREE_NODES}")
            return
        if isinstance(self.stop, bool) or not isinstance(self.stop, (int, float)) or not 0.0 <= self.stop < 1.0:
            raise ValueError(f"a dynamic tree's stop must be a probability in [0, 1), got {self.stop!r}")
        for name in ("budget", "depth", "width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"a dynamic tree's {name} must be an integer >= 1, got {value!r}")
        if self.budget > MAX_TREE_NODES:
            raise ValueError(f"a tree's budget is at most {MAX_TREE_NODES} nodes, got {self.budget}")

    @property
    def levels(self) -> int:
        return len(self.branching) or self.depth

    @property
    def nodes(self) -> int:
        """The most nodes a step verifies."""
        if not self.branching:
            return self.budget
        total, level = 0, 1
        for b in self.branching:
            level *= b
            total += level
        return total

    @property
    def name(self) -> str:
        """The row name: ``tree (16 nodes, depth<=6, top-4)`` or ``tree (3,2,1,1)``."""
        if self.branching:
            return f"tree ({','.join(map(str, self.branching))})"
        stop = f", cum<{self.stop:g}" if self.stop else ""
        return f"tree ({self.budget} nodes, depth<={self.depth}, top-{self.width}{stop})"


def parse_tree_rule(text: str) -> TreeRule:
    """``"N:D:W"`` -> a dynamic rule (budget N nodes, depth D, width W; ``"N:D:W:F"`` with its stop F);
    ``"3,2,1,1"`` -> a fixed shape (children per node at each depth). ValueError saying the forms for anything else."""
    try:
        if ":" in text:
            parts = text.split(":")
            if len(parts) not in (3, 4):
                raise ValueError("three or four parts")
            stop = float(parts[3]) if len(parts) == 4 else 0.0
            return TreeRule(int(parts[0]), int(parts[1]), int(parts[2]), stop=stop)
        return TreeRule(branching=tuple(int(x) for x in text.split(",")))
    except ValueError as err:
        raise ValueError(f"{text!r}: give N:D:W[:F] (a dynamic tree: N nodes verified, depth D, width W, growth stopped "
                         "below cumulative probability F, e.g. 16:6:4 or 8:8:2:0.2) or "
                         f"children per depth (a fixed tree, e.g. 3,2,1,1): {err}") from None


@dataclass
class Tree:
    """The nodes a step proposed, in the order made (parents before children). Node i: ``tokens[i]``,
    ``parents[i]`` (-1: a child of the root), ``depths[i]`` (1 for the root's children), ``scores[i]`` (the sum of
    the draft's log-probabilities along its path, nats)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]

    @classmethod
    def empty(cls) -> Tree:
        return cls([], [], [], [])

    def add(self, token: int, parent: int, score: float) -> None:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(score)

    def subset(self, keep: list[int]) -> tuple[Tree, dict[int, int]]:
        """The nodes ``keep`` (ancestor-closed, in order), renumbered, and the new number of each old one kept."""
        index = {old: new for new, old in enumerate(keep)}
        return Tree([self.tokens[i] for i in keep], [index.get(self.parents[i], -1) for i in keep],
                    [self.depths[i] for i in keep], [self.scores[i] for i in keep]), index

    def ancestry(self, i: int) -> list[int]:
        """Node i and its ancestors (nodes), from i up."""
        out = []
        while i >= 0:
            out.append(i)
            i = self.parents[i]
        return out


def tree_mask(tree: Tree, columns: list[int], fed_nodes: list[int], prefix: int, fed_tokens: int,
              dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask (1, 1, fed_tokens + len(fed_nodes), prefix + len(columns) + fed) of one forward.

    The cache holds ``prefix`` committed tokens, then the tree nodes ``columns`` (fed earlier this step). The forward
    feeds ``fed_tokens`` committed tokens (causal: each sees the prefix and those before it) and then the nodes
    ``fed_nodes``; a node sees every committed token and, of the tree's columns, its ancestors and itself.
    0 where a query sees a key, the dtype's lowest number elsewhere.
    """
    cached_nodes = len(columns)
    n = fed_tokens + len(fed_nodes)
    width = prefix + cached_nodes + n
    seen = torch.zeros(n, width, dtype=torch.bool)
    for i in range(fed_tokens):  # these come only before any tree column (a step feeds them first)
        seen[i, : prefix + i + 1] = True
    column_of = {node: prefix + j for j, node in enumerate(columns)}
    column_of |= {node: prefix + cached_nodes + fed_tokens + j for j, node in enumerate(fed_nodes)}
    for j, node in enumerate(fed_nodes):
        row = fed_tokens + j
        seen[row, :prefix] = True
        seen[row, prefix + cached_nodes : prefix + cached_nodes + fed_tokens] = True
        for a in tree.ancestry(node):
            seen[row, column_of[a]] = True
    mask = torch.zeros(n, width, dtype=dtype)
    mask.masked_fill_(~seen, torch.finfo(dtype).min)
    return mask[None, None]


def node_positions(tree: Tree, nodes: list[int], prefix: int, fed_tokens: int) -> list[int]:
    """The position ids of a forward that feeds ``fed_tokens`` committed tokens after ``prefix`` cached ones, then the
    tree ``nodes``: the committed tokens in order, each node at the root's position plus its depth."""
    root = prefix + fed_tokens - 1
    return list(range(prefix, prefix + fed_tokens)) + [root + tree.depths[i] for i in nodes]


def masked_forward(model: torch.nn.Module, cache, ids: list[int], positions: list[int], mask: torch.Tensor, keep: int,
                   device) -> torch.Tensor:
    """One forward of ``model`` on ``cache`` fed ``ids`` at ``positions`` under the 4-D additive ``mask``
    (``tree_mask``); float32 logits of the last ``keep`` tokens fed: (keep, vocabulary or a restricted head's K)."""
    out = model(input_ids=torch.tensor([ids], device=device), attention_mask=mask.to(device),
                position_ids=torch.tensor([positions], device=device), **cache_kwarg(cache), use_cache=True,
                logits_to_keep=keep)
    return out.logits[0].float()


class TreeRunner(LiveRunner):
    """A ``LiveRunner`` whose forwards can also feed tree nodes after the committed tokens.

    Each cache holds the committed tokens ``tokens[:lengths[role]]`` and then the tree nodes ``columns[role]`` fed
    this step (node numbers of the step's ``Tree``); ``keep_path`` leaves it holding committed tokens only.
    """

    def start(self) -> None:
        super().start()
        self.columns: dict[str, list[int]] = {"draft": [], "target": []}

    @torch.inference_mode()
    def tree_forward(self, role: str, tokens: list[int], tree: Tree, nodes: list[int]) -> torch.Tensor:
        """Feed ``role`` the committed tokens its cache lacks, then ``nodes`` of ``tree``; float32 logits of the
        last committed token fed (when one is) and of each node, in order: (rows, vocabulary or the head's K)."""
        model, cache = getattr(self.pair, role), self.caches[role]
        prefix, columns = self.lengths[role], self.columns[role]
        fed_tokens = len(tokens) - prefix
        if fed_tokens and columns:
            raise RuntimeError("internal error: committed tokens to feed after tree nodes")
        ids = tokens[prefix:] + [tree.tokens[i] for i in nodes]
        positions = node_positions(tree, nodes, prefix, fed_tokens)
        device = self.pair.device
        mask = tree_mask(tree, columns, nodes, prefix, fed_tokens, model.dtype)
        keep = len(nodes) + (1 if fed_tokens else 0)
        context = cache.get_seq_length()
        t0 = time.perf_counter()
        z = masked_forward(model, cache, ids, positions, mask, keep, device)
        count_forward(self.stats, self.cost_model, role, len(ids), context, (time.perf_counter() - t0) * 1000.0)
        self.lengths[role] = len(tokens)
        self.columns[role] = columns + list(nodes)
        return z

    def grow_tree(self, tokens: list[int], rule: TreeRule, levels: int, eos: frozenset[int]) -> Tree:
        """1. propose: the draft's tree after ``tokens`` (``_grow``), its forwards run and charged."""
        return _grow(self, tokens, rule, levels, eos)

    def verify_tree(self, tokens: list[int], tree: Tree, limit: int, eos: frozenset[int]) -> tuple[list[int], int]:
        """2. verify and 3. accept: one target forward over the root and every node of ``tree``, then the path the
        target agrees with and its own token after it (``accept_path``)."""
        argmax = self.tree_forward("target", tokens, tree, list(range(len(tree.tokens)))).argmax(-1).tolist()
        return accept_path(tree, argmax, limit, eos)

    def renumber(self, role: str, index: dict[int, int]) -> None:
        """The tree was cut to a subset (``Tree.subset``'s ``index``): its columns in ``role``'s cache take the new
        numbers; those of nodes cut stay in the cache, numbered None, until ``keep_path``."""
        self.columns[role] = [index.get(node) for node in self.columns[role]]

    @torch.inference_mode()
    def keep_path(self, path: list[int]) -> int:
        """Leave each cache holding its committed tokens and then the nodes of ``path`` it was fed (in path order;
        the nodes fed to a model along a path are always a prefix of it); returns how many the draft kept."""
        kept_draft = 0
        for role, cache in self.caches.items():
            prefix, columns = self.lengths[role], self.columns[role]
            where = {node: prefix + j for j, node in enumerate(columns) if node is not None}
            kept = [where[node] for node in path if node in where]
            if kept and kept != list(range(prefix, prefix + len(kept))):  # contiguous after the prefix: a crop alone
                index = torch.tensor(kept, device=self.pair.device)
                gathered = [(layer.keys.index_select(-2, index), layer.values.index_select(-2, index))
                            for layer in cache.layers]
                crop_cache(cache, prefix)
                for i, (k, v) in enumerate(gathered):
                    cache.update(k, v, i)
            else:
                crop_cache(cache, prefix + len(kept))
            self.lengths[role] = prefix + len(kept)
            self.columns[role] = []
            kept_draft = len(kept) if role == "draft" else kept_draft
        return kept_draft


def _children(z: torch.Tensor, ids: torch.Tensor | None, count: int) -> tuple[list[list[int]], list[list[float]]]:
    """The ``count`` most likely next tokens after each row of logits ``z`` (rows, columns) and their log-probabilities
    (nats), in one device sync; ``ids`` maps a restricted head's columns to token ids (``draft_readout``'s)."""
    logp = torch.log_softmax(z, -1)
    top, arg = logp.topk(count, -1)
    if ids is not None:
        arg = ids[arg]
    return arg.tolist(), top.tolist()


def grow(rule: TreeRule, levels: int, eos: frozenset[int], children) -> tuple[Tree, dict[int, int] | None]:
    """1. propose, whatever gives the draft's candidates: the root's children, then level by level those of the nodes
    ``rule`` expands, at most ``levels`` deep (a fixed tree: every node of the level but an end; EAGLE-2's dynamic
    one: the level's ``width`` most likely by cumulative probability, none once the best is under ``stop``). Returns
    the nodes verified: a fixed tree whole (index None); a dynamic one's ``budget`` nodes of highest cumulative
    probability, renumbered (``Tree.subset``'s index).
    ``children(tree, parents, count)`` gives the ``count`` most likely next tokens after each of ``parents`` (-1: the
    root) and their log-probabilities, one list each per parent: a ``TreeRunner`` runs the draft's forward of that
    level (``_grow``), a replay runner reads them from its prefix trees."""
    tree = Tree.empty()
    parents = [-1]
    for depth in range(levels):
        if depth:
            parents = [i for i, d in enumerate(tree.depths) if d == depth and tree.tokens[i] not in eos]
            if not rule.branching:
                parents = sorted(parents, key=lambda i: -tree.scores[i])[: rule.width]
                if rule.stop and parents and tree.scores[parents[0]] < math.log(rule.stop):
                    break  # the draft is unsure of every path this deep: no more draft forwards this step
                parents.sort()
            if not parents:
                break
        args, lps = children(tree, parents, rule.branching[depth] if rule.branching else rule.width)
        for node, arg, lp in zip(parents, args, lps):
            for token, p in zip(arg, lp):
                tree.add(token, node, (tree.scores[node] if node >= 0 else 0.0) + p)
    if rule.branching:
        return tree, None
    best = sorted(range(len(tree.tokens)), key=lambda i: (-tree.scores[i], tree.depths[i], i))[: rule.budget]
    return tree.subset(sorted(best))  # node order: parents first (a parent is made before its children)


def _grow(runner: TreeRunner, tokens: list[int], rule: TreeRule, levels: int, eos: frozenset[int]) -> Tree:
    """The draft's tree after ``tokens`` (1. propose): ``grow``, each level one draft forward (the first fed the
    committed tokens the draft's cache lacks, whose last row is the root's)."""
    with proposal_logits(runner.pair.draft) as ids:
        def children(tree: Tree, parents: list[int], count: int):
            root = parents == [-1]
            z = runner.tree_forward("draft", tokens, tree, [] if root else parents)
            return _children(z[-1:] if root else z, ids, count)

        tree, index = grow(rule, levels, eos, children)
    if index is not None:
        runner.renumber("draft", index)
    return tree


def accept_path(tree: Tree, argmax, limit: int, eos: frozenset[int]) -> tuple[list[int], int]:
    """3. accept: the nodes followed from the root and the target's own token after them.

    ``argmax[0]`` is the target's greedy token after the root, ``argmax[1 + i]`` after node i (a list, or a
    callable ``argmax(i)`` read only where the walk looks: a replay runner's, which knows the target's choices along
    the path it follows). From the root, the child whose token is the target's argmax is followed while there is one,
    at most ``limit`` nodes and never past an end-of-sequence token. Returns (path, the target's token after its
    last node).
    """
    at = argmax if callable(argmax) else argmax.__getitem__
    children: dict[int, dict[int, int]] = {}
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        children.setdefault(parent, {}).setdefault(token, i)
    path, here = [], -1
    while len(path) < limit:
        nxt = children.get(here, {}).get(at(here + 1))
        if nxt is None:
            break
        path.append(nxt)
        here = nxt
        if tree.tokens[nxt] in eos:
            break
    return path, at(here + 1)


def tree_step(run: Committed, rule: TreeRule, counts: DecodeStats) -> None:
    """One step of tree speculation on ``run``: propose, verify, accept, update. Its runner grows and verifies
    (``grow_tree``, ``verify_tree``, ``keep_path``): a ``TreeRunner`` runs the models, a replay runner
    (``bild_env.replay.runner.ReplayRunner``) answers from its prefix trees and charges the same forwards."""
    runner, tokens = run.runner, run.tokens
    levels = min(rule.levels, run.remaining - 1)  # room for the target's own token
    tree = runner.grow_tree(tokens, rule, levels, run.eos) if levels > 0 else Tree.empty()  # 1. propose
    nodes = list(range(len(tree.tokens)))
    path, token = runner.verify_tree(tokens, tree, levels, run.eos)  # 2. verify, 3. accept
    runner.keep_path(path)  # 4. update both caches
    tokens.extend(tree.tokens[i] for i in path)
    if not run.done:
        tokens.append(token)
    counts.steps += 1
    counts.proposed += len(nodes)
    counts.accepted += len(path)
    counts.full_accepts += bool(path) and path[-1] not in tree.parents  # the path ended at a leaf


def session_tree_step(session, rule: TreeRule) -> DecodeStats:
    """One lossless tree step (``tree_step``) with ``rule`` on a ``bild.BildSession`` (its runner a ``TreeRunner``, or
    a replay runner that answers it from its prefix trees): the draft grows a tree, the target verifies it in one
    forward, the path it agrees with and its own next token are committed. Counted as the session's ``step`` counts (``DecodeStats``: ``proposed`` the nodes verified,
    ``accepted`` those followed, regret 0), its forwards priced by the runner's cost model; BiLD steps and tree
    steps may alternate (each leaves both caches holding committed tokens only). Here, not a session method: the
    tree module builds on the decoders, which build on ``bild``."""
    if session.done:
        raise RuntimeError("the generation is finished (EOS or max_new_tokens); start a new session")
    if not hasattr(session.runner, "grow_tree"):
        raise TypeError(f"a tree step needs a runner that grows trees (bild_env.decoding.tree.TreeRunner, or the "
                        f"replay runner), got {type(session.runner).__name__}")
    t0 = time.perf_counter()
    before = session.runner.stats.copy()
    start_len = len(session.tokens)
    s = DecodeStats()
    tree_step(session, rule, s)
    s.new_tokens = len(session.tokens) - start_len
    return session._finish(s, t0, before)


def generate_tree(pair: ModelPair, prompt: str | list[int] | torch.Tensor, rule: TreeRule | str = "16:6:4",
                  max_new_tokens: int = 64, cost_model: CostModel | None = None) -> Generation:
    """Tree speculative decoding (module docstring): exactly the target's greedy output, fewer target forwards.

    ``rule``: a ``TreeRule`` or its text (``parse_tree_rule``: ``"16:6:4"`` dynamic, ``"3,2,1,1"`` fixed).
    ``DecodeStats``: ``proposed`` counts the nodes verified, ``accepted`` those on the followed paths (so the
    acceptance rate is per node, lower than a chain's), ``full_accepts`` the steps whose path reached a leaf.
    """
    rule = parse_tree_rule(rule) if isinstance(rule, str) else rule
    ids = prepare_prompt(pair, prompt, max_new_tokens)
    run = Committed(TreeRunner(pair, cost_model), ids, max_new_tokens, pair.eos_token_ids, pair.device)
    counts = DecodeStats()
    while not run.done:
        tree_step(run, rule, counts)
    return live_result(pair, run, counts)
