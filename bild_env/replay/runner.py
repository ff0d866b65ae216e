"""Exact replay: answer the runner's questions from a per-prompt prefix tree instead of the models.

Greedy BiLD (and naive speculative decoding) is a deterministic function of the token prefix.
All a step needs at a prefix x is four numbers:

    d_arg(x), d_p(x)   the draft's argmax and max probability after x
    t_arg(x)           the target's argmax after x
    t_logp(x)          the target's log-probability (nats) of d_arg(x) after x

``PrefixTree`` stores them for every prefix seen, one node per prefix, node 0 being the prompt.
``ReplayRunner`` implements the runner interface (bild_env.decoding.runner) on top of it: it keeps the
same virtual KV-cache lengths as ``LiveRunner`` and charges each would-be forward to the
calibrated cost model, so an env on replay produces exactly the tokens, observations, rewards
and infos of the live env in ``latency="model"`` mode. Numbers it lacks are filled by running the
model that lacks them over the part of the path it has not seen, in one forward: the runner keeps
a "shadow" KV cache of each model along the current path (cropped where the path changes), so a
fill costs at most the forward the live env would have run, and a hit costs nothing. A new prompt
starts warm: its tree is filled along the target's greedy continuation (the BLEU reference, one
forward of each model over it), where most episodes go.

Trees persist on disk per model pair and prompt (``cache_dir("replay")``), so later runs start
warm. Memory is capped in nodes: past the cap, whole least-recently-used prompt trees are written
to disk and dropped from memory (reloaded when their prompt comes back); nothing is lost.

Several runners can share one ``TreeStore`` (``ReplayRunner.share_store``), so what one env fills
every other env reads; with a ``batcher`` (``agents.vec.BatchedReplayVecEnv``) their fills of
the same model run as one batched forward (``bild_env.decoding.kv``).
"""

from __future__ import annotations

import hashlib
import math
import time
from array import array
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from bild_env.decoding.kv import Row, cache_bytes, cache_prefix, single_forward
from bild_env.decoding.costs import CostModel
from bild_env.models.pairs import ModelPair
from bild_env.paths import cache_dir
from bild_env.decoding.runner import count_forward, crop_cache
from bild_env.decoding.stats import DecodeStats

STRIDE = 1 << 20  # child key = node * STRIDE + token (vocabularies are far below 2**20)
MISSING = -1
NAN = float("nan")


class PrefixTree:
    """The four numbers of every stored prefix of one prompt, in flat arrays (node 0 = the prompt)."""

    def __init__(self) -> None:
        self.parent, self.token = array("i", [MISSING]), array("i", [MISSING])
        self.d_arg, self.t_arg = array("i", [MISSING]), array("i", [MISSING])
        self.d_p, self.t_logp = array("f", [0.0]), array("f", [NAN])  # t_logp NaN: not known yet
        self.children: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.parent)

    def child(self, node: int, token: int) -> int:
        """The node of prefix (node's prefix + token), created empty if new."""
        key = node * STRIDE + token
        found = self.children.get(key)
        if found is not None:
            return found
        new = len(self.parent)
        self.children[key] = new
        for arr, value in ((self.parent, node), (self.token, token), (self.d_arg, MISSING), (self.t_arg, MISSING)):
            arr.append(value)
        self.d_p.append(0.0)
        self.t_logp.append(NAN)
        return new

    def nbytes(self) -> int:
        """Memory held: the arrays plus the child index (dict table and its int keys/values)."""
        import sys

        arrays = sum(a.itemsize * len(a) for a in (self.parent, self.token, self.d_arg, self.t_arg, self.d_p, self.t_logp))
        ints = sum(sys.getsizeof(k) for k in list(self.children)[:64]) / max(1, min(64, len(self.children)))
        return int(arrays + sys.getsizeof(self.children) + len(self.children) * ints)

    def save(self, path: Path) -> None:
        names = ("parent", "token", "d_arg", "t_arg", "d_p", "t_logp")
        n = min(len(getattr(self, name)) for name in names)  # nodes complete in every array
        tmp = path.with_suffix(".tmp.npz")
        dtypes = {"i": np.int32, "f": np.float32}
        np.savez(tmp, **{name: np.frombuffer(getattr(self, name), dtypes[getattr(self, name).typecode])[:n]
                         for name in names})
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> PrefixTree:
        tree = cls()
        with np.load(path) as data:
            for name in ("parent", "token", "d_arg", "t_arg", "d_p", "t_logp"):
                getattr(tree, name)[:] = array(getattr(tree, name).typecode, data[name].tobytes())
        tree.children = {p * STRIDE + t: i for i, (p, t) in enumerate(zip(tree.parent, tree.token)) if i}
        return tree


@dataclass
class ReplayReport:
    """What the replay backend holds and did (for logs and the closing benchmark)."""

    trees_in_memory: int = 0
    nodes: int = 0
    bytes: int = 0
    bytes_per_prefix: float = 0.0
    hits: int = 0  # questions answered from the tree
    misses: int = 0  # questions that needed a fill
    fills: int = 0  # model forwards run to fill the trees (one per miss, two per new prompt's warm start; batched: one per batch)
    fill_rows: int = 0  # rows those forwards computed (= fills without batching; more when misses were batched)
    fill_ms: float = 0.0
    evictions: int = 0  # prompt trees dropped from memory (kept on disk)
    loads: int = 0  # prompt trees read back from disk
    path_caches: int = 0  # KV caches kept along a first path per prompt and model (start each episode's fills)
    path_cache_bytes: int = 0  # their memory (capped by max_kv_bytes; least recently used dropped first)
    path_cache_reuses: int = 0  # episodes whose first fill started from one instead of from an empty cache


class TreeStore:
    """The prefix trees of one model pair: in memory (LRU, capped in nodes) and on disk; shared by runners."""

    def __init__(self, folder: Path, max_nodes: int, max_kv_bytes: int = 512 << 20) -> None:
        self.folder, self.max_nodes, self.max_kv_bytes = folder, max_nodes, max_kv_bytes
        self.trees: OrderedDict[str, PrefixTree] = OrderedDict()
        self.dirty: set[str] = set()
        self.counts = ReplayReport()
        self.runners: list[ReplayRunner] = []  # their open prompts are never evicted
        # (prompt key, model) -> (tokens, KV cache over them): the first path filled for that prompt
        # (the reference, on a warm start); an episode's first fill starts from its common prefix
        # instead of feeding the prompt again. Memory only; capped in bytes.
        self.paths: OrderedDict[tuple[str, str], tuple[list[int], object, int]] = OrderedDict()

    def path_cache(self, key: str, role: str) -> tuple[list[int], object] | None:
        entry = self.paths.get((key, role))
        if entry is None:
            return None
        self.paths.move_to_end((key, role))
        return entry[0], entry[1]

    def keep_path_cache(self, key: str, role: str, tokens: list[int], cache, config) -> None:
        """Keep a copy of ``cache`` (over ``tokens``) unless it alone exceeds the cap; drop the oldest past it."""
        size = cache_bytes(cache)
        if size > self.max_kv_bytes:
            return
        self.paths[(key, role)] = (tokens, cache_prefix(cache, len(tokens), config), size)
        self.counts.path_cache_bytes += size
        while self.counts.path_cache_bytes > self.max_kv_bytes:
            _, (_, _, dropped) = self.paths.popitem(last=False)
            self.counts.path_cache_bytes -= dropped
        self.counts.path_caches = len(self.paths)

    def evict(self) -> None:
        in_use = {r.prompt_key for r in self.runners}
        total = sum(len(t) for t in self.trees.values())
        for key in [k for k in self.trees if k not in in_use]:  # least recently used first
            if total <= self.max_nodes:
                break
            tree = self.trees.pop(key)
            self.save(key, tree)
            total -= len(tree)
            self.counts.evictions += 1

    def save(self, key: str, tree: PrefixTree) -> None:
        if key in self.dirty:
            tree.save(self.folder / f"{key}.npz")
            self.dirty.discard(key)

    def flush(self) -> None:
        for key, tree in list(self.trees.items()):
            self.save(key, tree)

    def report(self) -> dict[str, float | int]:
        r = self.counts
        r.trees_in_memory = len(self.trees)
        r.nodes = sum(len(t) for t in self.trees.values())
        r.bytes = sum(t.nbytes() for t in self.trees.values())
        r.bytes_per_prefix = r.bytes / r.nodes if r.nodes else 0.0
        return asdict(r)


class ReplayRunner:
    """The runner interface answered from prefix trees, filling them with the models on a miss.

    ``batcher`` (set by ``BatchedReplayVecEnv``) is an object whose ``forward(role, row)`` runs the
    fill forward, possibly batched with other runners' fills; None runs it directly.
    """

    def __init__(self, pair: ModelPair, cost_model: CostModel, references, max_new_tokens: int,
                 max_nodes: int = 2_000_000, folder: Path | None = None) -> None:
        self.pair, self.cost_model, self.references = pair, cost_model, references
        self.max_new_tokens = max_new_tokens
        key = hashlib.sha1(pair.key.encode()).hexdigest()[:16]
        self.batcher = None
        self.prompt_key = None
        self.share_store(TreeStore(folder or cache_dir("replay", key), max_nodes))
        self.tree: PrefixTree | None = None
        self.start()

    def share_store(self, store: TreeStore) -> None:
        """Read and fill ``store``'s trees (another runner's, for envs stepped together) instead of this runner's own."""
        if getattr(self, "store", None) is not None:
            if self.store.trees and self.store is not store:
                raise RuntimeError("share_store: this runner already holds trees; share stores before any episode")
            self.store.runners.remove(self)
        self.store = store
        store.runners.append(self)
        self.folder, self.trees, self.dirty, self.counts = store.folder, store.trees, store.dirty, store.counts

    @property
    def max_nodes(self) -> int:
        """The memory cap (in stored prefixes) of this runner's store."""
        return self.store.max_nodes

    @max_nodes.setter
    def max_nodes(self, value: int) -> None:
        self.store.max_nodes = value

    # -- runner interface -------------------------------------------------------------------
    def start(self) -> None:
        self.tree, self.prompt_key, self.prompt_len = None, None, 0
        self.seq: list[int] = []  # generated tokens whose nodes are in self.nodes
        self.nodes: list[int] = [0]  # nodes[i] = node of prompt + seq[:i]
        self.lengths = {"draft": 0, "target": 0}  # the caches live decoding would hold (for costs)
        self.shadow, self.shadow_len = {}, {}  # real caches along the current path, for fills
        self.stats = DecodeStats(model_ms=0.0)

    def draft_next(self, tokens: list[int]) -> tuple[int, float]:
        self._sync(tokens)
        node, tree = self.nodes[-1], self.tree
        if tree.d_arg[node] == MISSING:
            self.counts.misses += 1
            self._fill("draft", tokens, len(tokens) - 1)
        else:
            self.counts.hits += 1
        self._count("draft", tokens)
        return tree.d_arg[node], tree.d_p[node]

    def target_verify(self, tokens: list[int]) -> tuple[list[int], list[float]]:
        context = self.lengths["target"]
        if context == 0:
            self._open_prompt(tokens)
        self._sync(tokens)
        tree, p0 = self.tree, self.prompt_len - 1
        first = max(context, p0)  # prompt positions before the last are never verified
        nodes = self.nodes[first - p0 : len(tokens) - p0]
        missing = next((i for i, n in enumerate(nodes) if tree.t_arg[n] == MISSING
                        or (i < len(nodes) - 1 and math.isnan(tree.t_logp[n]))), None)
        if missing is None:
            self.counts.hits += 1
        else:
            self.counts.misses += 1
            self._fill("target", tokens, first + missing)
        argmax = [tree.t_arg[n] for n in nodes]
        logp = []
        for i, n in enumerate(nodes[:-1]):
            if tree.d_arg[n] != tokens[first + i + 1]:
                raise RuntimeError("internal error: replay verifies a token that is not the draft's argmax")
            logp.append(tree.t_logp[n])
        self._count("target", tokens)
        return argmax, logp

    def crop(self, n: int) -> None:
        for role in self.lengths:
            self.lengths[role] = min(self.lengths[role], n)

    # -- bookkeeping ------------------------------------------------------------------------
    def _count(self, role: str, tokens: list[int]) -> None:
        """Charge the forward live decoding would run here (what its cache lacks) to the cost model."""
        context = self.lengths[role]
        count_forward(self.stats, self.cost_model, role, len(tokens) - context, context)
        self.lengths[role] = len(tokens)

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
        key = hashlib.sha1(",".join(map(str, prompt)).encode()).hexdigest()
        self.prompt_key, self.prompt_len = key, len(prompt)
        self.seq, self.nodes = [], [0]
        self.shadow, self.shadow_len = {}, {}  # made at the first fill of the episode
        if key in self.trees:
            self.trees.move_to_end(key)
        else:
            path = self.folder / f"{key}.npz"
            if path.exists():
                self.trees[key] = PrefixTree.load(path)
                self.counts.loads += 1
            else:  # warm start along the target's greedy continuation: one forward of each model
                self.trees[key] = PrefixTree()
                self.tree = self.trees[key]
                reference = self.references.get(prompt)[: self.max_new_tokens]
                self._sync(prompt + reference)
                self._fill("draft", prompt + reference, self.prompt_len - 1)
                self._fill("target", prompt + reference, self.prompt_len - 1)
        self.tree = self.trees[key]
        self._evict()

    # -- filling ----------------------------------------------------------------------------
    def _crop_shadow(self, n: int) -> None:
        for role, cache in self.shadow.items():
            if self.shadow_len[role] > n:
                crop_cache(cache, n)
                self.shadow_len[role] = n

    @torch.inference_mode()
    def _fill(self, role: str, tokens: list[int], first: int) -> None:
        """One forward of ``role`` over ``tokens[first:]`` (or more, from where its shadow cache ends).

        Stores its numbers at every node from position ``first`` on that lacks them (positions
        before the prompt's last token have no node).
        """
        from transformers import DynamicCache

        t0 = time.perf_counter()
        config = getattr(self.pair, role).config
        if role not in self.shadow:  # this model's first fill in the episode: from the prompt's kept path cache
            kept = self.store.path_cache(self.prompt_key, role)
            if kept is None:
                self.shadow[role], self.shadow_len[role] = DynamicCache(config=config), 0
            else:
                common = 0
                for a, b in zip(kept[0], tokens):
                    if a != b:
                        break
                    common += 1
                self.shadow[role], self.shadow_len[role] = cache_prefix(kept[1], common, config), common
                self.counts.path_cache_reuses += len(self.shadow) == 1  # counted once per episode
        if self.shadow_len[role] > first:
            crop_cache(self.shadow[role], first)
            self.shadow_len[role] = first
        context, p0, n = self.shadow_len[role], self.prompt_len - 1, len(tokens)
        keep = n - max(context, p0)
        row = Row(tokens[context:], self.shadow[role], keep)
        if self.batcher is None:
            z = single_forward(getattr(self.pair, role), row)
            self.counts.fills += 1
            self.counts.fill_rows += 1
            self.counts.fill_ms += (time.perf_counter() - t0) * 1000.0
        else:  # may wait while other runners' fills join the batch; the batcher counts the forward
            z = self.batcher.forward(role, row)
        self.shadow_len[role] = n
        if self.store.path_cache(self.prompt_key, role) is None:  # the prompt's first path: keep its cache
            self.store.keep_path_cache(self.prompt_key, role, list(tokens), self.shadow[role], config)
        nodes = self.nodes[n - keep - p0 : n - p0]
        tree = self.tree
        if role == "draft":
            z_max, arg = z.max(-1)
            p = torch.exp(z_max - torch.logsumexp(z, -1))  # the same formula as LiveRunner.draft_next
            for node, a, pv in zip(nodes, arg.tolist(), p.tolist()):
                if tree.d_arg[node] == MISSING:
                    tree.d_arg[node], tree.d_p[node] = a, pv
        else:
            d_arg = [tree.d_arg[node] for node in nodes]
            known = torch.tensor([max(a, 0) for a in d_arg], device=z.device)
            logp = torch.log_softmax(z, -1).gather(-1, known[:, None])[:, 0].tolist()
            for node, a, da, lp in zip(nodes, z.argmax(-1).tolist(), d_arg, logp):
                if tree.t_arg[node] == MISSING:
                    tree.t_arg[node] = a
                if math.isnan(tree.t_logp[node]) and da != MISSING:
                    tree.t_logp[node] = lp
        self.dirty.add(self.prompt_key)

    # -- memory and disk --------------------------------------------------------------------
    def _evict(self) -> None:
        self.store.evict()

    def flush(self) -> None:
        """Write every changed tree to disk."""
        self.store.flush()

    def report(self) -> dict[str, float | int]:
        return self.store.report()


def disk_report(root: Path | None = None) -> dict[str, float | int]:
    """Size of every stored prefix tree under ``root`` (default: this machine's replay cache), loaded."""
    root = root or cache_dir("replay")
    files = sorted(root.rglob("*.npz"))
    trees = [PrefixTree.load(f) for f in files]
    nodes = sum(len(t) for t in trees)
    memory = sum(t.nbytes() for t in trees)
    return {"pairs": len({f.parent for f in files}), "prompt_trees": len(files), "prefixes": nodes,
            "bytes_in_memory": memory, "bytes_per_prefix": memory / nodes if nodes else 0.0,
            "bytes_on_disk": sum(f.stat().st_size for f in files)}


if __name__ == "__main__":  # python -m bild_env.replay [folder]: what the replay cache holds
    import json
    import sys

    print(json.dumps(disk_report(Path(sys.argv[1]) if len(sys.argv) > 1 else None), indent=2))
