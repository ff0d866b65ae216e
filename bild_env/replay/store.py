"""``TreeStore``: the prefix trees of one model pair, in memory (LRU, capped) and on disk, shared by runners.

The store owns its trees privately. A runner ``open``s the tree of the prompt it decodes (loaded
from disk, or new) and ``release``s it when it moves on; an open tree is never evicted. Past
``max_nodes`` stored prefixes in memory, whole least-recently-used prompt trees are written to
disk and dropped (reloaded when their prompt comes back); nothing is lost. Trees persist on disk
under the pair's folder (``cache_dir("replay", digest(pair.key))``), one ``<prompt key>.npz`` each.

The store also keeps, per prompt and model, the KV cache of the first path filled for that
prompt (capped in bytes): an episode's first fill starts from its common prefix with that path
instead of feeding the prompt again. ``counts`` is the store's public ledger (``ReplayReport``):
runners and the batcher add their hits, misses and fills to it; ``report()`` adds the sizes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from bild_env.decoding.kv import cache_bytes, cache_prefix
from bild_env.paths import cache_dir
from bild_env.replay.tree import PrefixTree

logger = logging.getLogger(__name__)
_SCOPE = threading.local()  # .stores: the stack of stores that runners made in a ``sharing`` block use


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
    """The prefix trees of one model pair: in memory (LRU, capped in nodes) and on disk; shared by runners.

    ``folder`` may be left None and is then set by the first runner that ``attach``es (its pair's
    folder); a store holds one pair's trees only.
    """

    def __init__(self, folder: Path | None = None, max_nodes: int = 2_000_000, max_kv_bytes: int = 512 << 20) -> None:
        self.folder, self.max_nodes, self.max_kv_bytes = folder, max_nodes, max_kv_bytes
        self.counts = ReplayReport()
        self._trees: OrderedDict[str, PrefixTree] = OrderedDict()
        self._dirty: set[str] = set()
        self._open: Counter[str] = Counter()  # prompt key -> runners decoding it now (never evicted)
        # (prompt key, model) -> (tokens, KV cache over them, its bytes): the first path filled for that prompt
        self._paths: OrderedDict[tuple[str, str], tuple[list[int], object, int]] = OrderedDict()

    def attach(self, folder: Path) -> None:
        """Bind the store to a pair's folder (once); a runner of another pair is refused."""
        if self.folder is None:
            self.folder = Path(folder)
        elif Path(folder) != self.folder:
            raise ValueError(f"this replay store holds the trees of another model pair ({self.folder}); "
                             "give each pair its own TreeStore")

    @property
    def nodes(self) -> int:
        """Prefixes stored in memory (all open trees and the cached ones)."""
        return sum(len(t) for t in self._trees.values())

    # -- trees --------------------------------------------------------------------------------
    def open(self, key: str) -> tuple[PrefixTree, bool]:
        """The tree of prompt ``key`` (from memory, else disk, else new and empty), kept from eviction until
        ``release``; returns (tree, whether it is new)."""
        self._open[key] += 1
        if key in self._trees:
            self._trees.move_to_end(key)
            return self._trees[key], False
        path = self.folder / f"{key}.npz"
        if path.exists():
            self._trees[key] = PrefixTree.load(path)
            self.counts.loads += 1
            return self._trees[key], False
        self._trees[key] = PrefixTree()
        return self._trees[key], True

    def release(self, key: str) -> None:
        """A runner stopped decoding prompt ``key``: its tree may be evicted again."""
        self._open[key] -= 1
        if self._open[key] <= 0:
            del self._open[key]

    def changed(self, key: str) -> None:
        """Mark prompt ``key``'s tree as holding numbers the disk lacks."""
        self._dirty.add(key)

    def evict(self) -> None:
        """Write and drop least-recently-used trees not open by any runner until at most ``max_nodes`` remain."""
        total = self.nodes
        for key in [k for k in self._trees if k not in self._open]:  # least recently used first
            if total <= self.max_nodes:
                break
            tree = self._trees.pop(key)
            self._save(key, tree)
            total -= len(tree)
            self.counts.evictions += 1

    def flush(self) -> None:
        """Write every changed tree to disk."""
        for key, tree in list(self._trees.items()):
            self._save(key, tree)

    def _save(self, key: str, tree: PrefixTree) -> None:
        if key in self._dirty:
            tree.save(self.folder / f"{key}.npz")
            self._dirty.discard(key)

    # -- path caches ----------------------------------------------------------------------------
    def path_cache(self, key: str, role: str) -> tuple[list[int], object] | None:
        """The kept (tokens, KV cache) of prompt ``key``'s first path for model ``role``, or None."""
        entry = self._paths.get((key, role))
        if entry is None:
            return None
        self._paths.move_to_end((key, role))
        return entry[0], entry[1]

    def keep_path_cache(self, key: str, role: str, tokens: list[int], cache, config) -> None:
        """Keep a copy of ``cache`` (over ``tokens``) unless it alone exceeds the cap; drop the oldest past it."""
        size = cache_bytes(cache)
        if size > self.max_kv_bytes:
            return
        self._paths[(key, role)] = (tokens, cache_prefix(cache, len(tokens), config), size)
        self.counts.path_cache_bytes += size
        self.limit_path_caches(self.max_kv_bytes)

    def limit_path_caches(self, max_bytes: int) -> None:
        """Set the cap on kept path caches and drop the least recently used ones past it."""
        self.max_kv_bytes = max_bytes
        while self._paths and self.counts.path_cache_bytes > self.max_kv_bytes:
            _, (_, _, dropped) = self._paths.popitem(last=False)
            self.counts.path_cache_bytes -= dropped
        self.counts.path_caches = len(self._paths)

    # -- reports --------------------------------------------------------------------------------
    def report(self) -> dict[str, float | int]:
        """``counts`` with the memory held now, as a dict."""
        r = self.counts
        r.trees_in_memory = len(self._trees)
        r.nodes = self.nodes
        r.bytes = sum(t.nbytes() for t in self._trees.values())
        r.bytes_per_prefix = r.bytes / r.nodes if r.nodes else 0.0
        return asdict(r)


@contextlib.contextmanager
def sharing(store: TreeStore) -> Iterator[TreeStore]:
    """Within the block, every replay runner made on this thread without a store of its own uses ``store``.

    How envs built by thunks (``make_vec_env``) receive one shared store at construction.
    """
    stack = _SCOPE.__dict__.setdefault("stores", [])
    stack.append(store)
    try:
        yield store
    finally:
        stack.pop()


def scoped_store() -> TreeStore | None:
    """The store of the innermost ``sharing`` block on this thread, or None."""
    stack = getattr(_SCOPE, "stores", None)
    return stack[-1] if stack else None


def disk_report(root: Path | None = None) -> dict[str, float | int]:
    """Size of every stored prefix tree under ``root`` (default: this machine's replay cache), loaded."""
    root = root or cache_dir("replay")
    files = sorted(p for p in root.rglob("*.npz") if not p.name.endswith(".tmp.npz"))
    trees = [PrefixTree.load(f) for f in files]
    nodes = sum(len(t) for t in trees)
    memory = sum(t.nbytes() for t in trees)
    return {"pairs": len({f.parent for f in files}), "prompt_trees": len(files), "prefixes": nodes,
            "bytes_in_memory": memory, "bytes_per_prefix": memory / nodes if nodes else 0.0,
            "bytes_on_disk": sum(f.stat().st_size for f in files)}
