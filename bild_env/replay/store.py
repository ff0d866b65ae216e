"""``TreeStore``: the prefix trees of one model pair, in memory (LRU, capped) and on disk, shared by runners.

The store owns its trees privately. A runner ``open``s the tree of the prompt it decodes (loaded
from disk, or new) and ``release``s it when it moves on; an open tree is never evicted. Past
``max_nodes`` stored prefixes in memory, whole least-recently-used prompt trees are written to
disk and dropped (reloaded when their prompt comes back); nothing is lost. Trees persist on disk
under the pair's folder (``cache_dir("replay", digest(pair.key))``), one ``<prompt key>.npz`` each.

One store per pair and process: a runner given no store (and made outside a ``sharing`` block)
uses ``TreeStore.for_folder(its pair's folder)``, so every env of a pair in a process reads what
the others filled, as they share the models.

Nothing filled is lost for long, and nothing damaged is read (``TreeFiles``, the disk side):

* changed trees are written every ``flush_every`` changed prompts or ``flush_seconds`` seconds
  (checked at each change and each episode start), by ``flush()`` (``env.close()``), when evicted,
  and when the store is garbage-collected or the interpreter exits (``weakref.finalize``; Ctrl-C
  and, in ``train.py``, SIGTERM end through ``KeyboardInterrupt`` and reach it). A SIGKILL loses
  at most the fills of the last period.
* a write merges, under a lock file shared by processes (``<folder>/.lock``), the tree on disk
  (another process's or store's, if it changed since this store read or wrote it) into the one in
  memory, so the union of their prefixes survives (``PrefixTree.merge``; a number both know and
  disagree on keeps the memory's and counts a ``conflict``), then replaces the file atomically.
* a file that fails its checks (``PrefixTree.load``) is reported once (``logging.warning`` naming
  it and why), moved aside to ``<name>.bad-<time>-<pid>`` and its tree computed again from the
  models. Temporary files (``*.tmp.npz``) are never read, and those older than a minute (left by
  a killed writer) are deleted when a store attaches to the folder.

The store also keeps, per prompt and model, the KV cache of the first path filled for that
prompt (capped in bytes): an episode's first fill starts from its common prefix with that path
instead of feeding the prompt again. ``counts`` is the store's public ledger (``ReplayReport``):
runners and the batcher add their hits, misses and fills to it; ``report()`` adds the sizes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from bild_env.decoding.kv import cache_bytes, cache_prefix
from bild_env.paths import cache_dir, set_aside, signature
from bild_env.replay.tree import PrefixTree, TreeFileError

logger = logging.getLogger(__name__)
_SCOPE = threading.local()  # .stores: the stack of stores that runners made in a ``sharing`` block use
_SHARED: dict[Path, TreeStore] = {}  # folder -> the process-wide store of that pair (``TreeStore.for_folder``)
_SHARED_LOCK = threading.Lock()
STALE_TMP_SECONDS = 60.0  # a *.tmp.npz older than this was left by a killed writer: deleted


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
    writes: int = 0  # prompt trees written to disk
    merges: int = 0  # writes that first merged a tree another store or process had written meanwhile
    conflicts: int = 0  # nodes where a merged tree disagreed with memory (memory's numbers kept)
    damaged_files: int = 0  # tree files that failed their checks (moved aside, computed again)

    def count_fill(self, rows: int, t0: float) -> None:
        """One fill forward of ``rows`` rows, begun at ``t0`` (``time.perf_counter()``), ends now."""
        self.fills += 1
        self.fill_rows += rows
        self.fill_ms += (time.perf_counter() - t0) * 1000.0


class TreeFiles:
    """The disk side of a ``TreeStore``: checked reads, merged atomic writes under a lock file, damaged files set aside.

    Holds no reference to its store (so a store's finalizer can still write through it).
    """

    def __init__(self, counts: ReplayReport, lock_timeout: float = 60.0) -> None:
        self.counts, self.lock_timeout = counts, lock_timeout
        self.folder: Path | None = None
        self.vocab_size: int | None = None
        self._lock = threading.RLock()  # one disk operation at a time in this process (threads of a CoopBatcher)
        self._file_lock: FileLock | None = None
        self._seen: dict[str, tuple[int, int, int]] = {}  # key -> the file as this store last read or wrote it
        self.seed = None  # the pair's decoding dataset: its trees are read under (merged into) the folder's
        self._reported: set[Path] = set()

    def bind(self, folder: Path, vocab_size: int | None) -> None:
        self.folder, self.vocab_size = Path(folder), vocab_size
        self.folder.mkdir(parents=True, exist_ok=True)
        self._file_lock = FileLock(self.folder / ".lock", timeout=self.lock_timeout)
        self.clean_stale_tmp()

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.npz"

    def read(self, key: str) -> PrefixTree | None:
        """The checked tree of prompt ``key`` on disk (merged with the decoding dataset's, where the store has one), or
        None (no file and no recorded tree; a damaged file is reported and set aside)."""
        recorded = self.seed.tree(key, self.vocab_size) if self.seed is not None else None
        path = self.path(key)
        with self._lock:
            if not path.exists():
                return recorded
            seen = signature(path)
            try:
                tree = PrefixTree.load(path, self.vocab_size)
            except TreeFileError as err:
                self._set_aside(err, seen)
                return recorded
            self._seen[key] = seen
            self.counts.loads += 1
            if recorded is not None:
                tree.merge(recorded)
            return tree

    def write(self, key: str, tree: PrefixTree) -> bool:
        """Merge the file's tree into ``tree`` if another writer changed it, then replace the file; False on failure."""
        path = self.path(key)
        with self._lock:
            try:
                with self._file_lock:
                    if path.exists() and signature(path) != self._seen.get(key):
                        self._merge_from_disk(key, tree)
                    tree.save(path)
                    self._seen[key] = signature(path)
            except (OSError, Timeout) as err:
                logger.warning("could not write the replay tree %s (%s); it stays in memory and is tried again at "
                               "the next flush", path, err)
                return False
            self.counts.writes += 1
            return True

    def clean_stale_tmp(self) -> None:
        """Delete ``*.tmp.npz`` files older than a minute: a writer was killed before renaming them."""
        now = time.time()
        for tmp in self.folder.glob("*.tmp.npz"):
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime > STALE_TMP_SECONDS:
                    tmp.unlink()

    def _merge_from_disk(self, key: str, tree: PrefixTree) -> None:
        path = self.path(key)
        seen = signature(path)
        try:
            disk = PrefixTree.load(path, self.vocab_size)
        except TreeFileError as err:
            self._set_aside(err, seen)
            return
        self.counts.conflicts += tree.merge(disk)
        self.counts.merges += 1

    def _set_aside(self, err: TreeFileError, seen: tuple[int, int, int]) -> None:
        """Report a damaged file once and move it aside (unless another writer has replaced it meanwhile)."""
        path = err.path
        try:
            aside = set_aside(path, seen, self._file_lock)
        except (OSError, Timeout) as move_err:
            if path not in self._reported:
                logger.warning("replay tree file %s is damaged (%s) and could not be moved aside (%s); its tree is "
                               "computed again from the models", path, err.reason, move_err)
            self._reported.add(path)
            return
        if aside is None:
            return  # replaced by a writer since it was read: the next read or write sees the new file
        self.counts.damaged_files += 1
        logger.warning("replay tree file %s is damaged (%s): moved aside to %s; its tree is computed again from the "
                       "models", path, err.reason, aside.name)


def _write_dirty(files: TreeFiles, trees: OrderedDict[str, PrefixTree], dirty: set[str]) -> None:
    """Write every changed tree (the store's flush; also its finalizer's, at garbage collection and at exit)."""
    if files.folder is None:
        return
    for key in [k for k in trees if k in dirty]:
        if files.write(key, trees[key]):
            dirty.discard(key)


class TreeStore:
    """The prefix trees of one model pair: in memory (LRU, capped in nodes) and on disk; shared by runners.

    ``folder`` may be left None and is then set by the first runner that ``attach``es (its pair's
    folder); a store holds one pair's trees only. Changed trees reach disk every ``flush_every``
    changed prompts or ``flush_seconds`` seconds, and at ``flush()``, eviction, garbage collection
    and interpreter exit (module docstring).
    """

    def __init__(self, folder: Path | None = None, max_nodes: int = 2_000_000, max_kv_bytes: int = 512 << 20,
                 flush_every: int = 1_000, flush_seconds: float = 60.0) -> None:
        self.folder, self.max_nodes, self.max_kv_bytes = None, max_nodes, max_kv_bytes
        self.flush_every, self.flush_seconds = flush_every, flush_seconds
        self.counts = ReplayReport()
        self._trees: OrderedDict[str, PrefixTree] = OrderedDict()
        self._dirty: set[str] = set()
        self._open: Counter[str] = Counter()  # prompt key -> runners decoding it now (never evicted)
        self._membership = 0  # changes whenever a tree enters or leaves self._trees (for ``nodes``)
        self._nodes_key: tuple[int, int] | None = None
        self._nodes = 0
        # (prompt key, model) -> (tokens, KV cache over them, its bytes): the first path filled for that prompt
        self._paths: OrderedDict[tuple[str, str], tuple[list[int], object, int]] = OrderedDict()
        self._files = TreeFiles(self.counts)
        self._flushed_at = time.monotonic()
        weakref.finalize(self, _write_dirty, self._files, self._trees, self._dirty)  # at GC and at exit
        if folder is not None:
            self.attach(folder)

    @classmethod
    def for_folder(cls, folder: Path) -> TreeStore:
        """The process-wide store of the pair whose trees live in ``folder`` (made on first use)."""
        key = Path(folder).resolve()
        with _SHARED_LOCK:
            store = _SHARED.get(key)
            if store is None:
                store = _SHARED[key] = cls(folder)
            return store

    def attach(self, folder: Path, vocab_size: int | None = None, seed=None) -> None:
        """Bind the store to a pair's folder (once; stale temporary files there are deleted); a runner of another
        pair is refused. ``vocab_size``: the pair's, for checking the token ids of files read. ``seed``: the pair's
        decoding dataset (``bild_env.replay.dataset``), whose recorded trees every tree read starts from."""
        if self.folder is None:
            self.folder = Path(folder)
            self._files.bind(self.folder, vocab_size)
        elif Path(folder) != self.folder:
            raise ValueError(f"this replay store holds the trees of another model pair ({self.folder}); "
                             "give each pair its own TreeStore")
        if vocab_size is not None:
            self._files.vocab_size = vocab_size
        if seed is not None:
            self._files.seed = seed

    @property
    def nodes(self) -> int:
        """Prefixes stored in memory (all open trees and the cached ones).

        Counted again only when a tree grew or the set of trees changed since the last count (every admission
        of the serving env asks, and summing over hundreds of trees was a tenth of a warm step)."""
        key = (PrefixTree.grown, self._membership)
        if key != self._nodes_key:
            self._nodes_key, self._nodes = key, sum(len(t.parent) for t in self._trees.values())
        return self._nodes

    # -- trees --------------------------------------------------------------------------------
    def open(self, key: str) -> tuple[PrefixTree, bool]:
        """The tree of prompt ``key`` (from memory, else disk, else new and empty), kept from eviction until
        ``release``; returns (tree, whether it is new)."""
        self._open[key] += 1
        if key in self._trees:
            self._trees.move_to_end(key)
            return self._trees[key], False
        tree = self._files.read(key)
        self._trees[key] = tree or PrefixTree()
        self._membership += 1
        return self._trees[key], tree is None

    def release(self, key: str) -> None:
        """A runner stopped decoding prompt ``key``: its tree may be evicted again."""
        self._open[key] -= 1
        if self._open[key] <= 0:
            del self._open[key]

    def changed(self, key: str) -> None:
        """Mark prompt ``key``'s tree as holding numbers the disk lacks (written at the next flush)."""
        self._dirty.add(key)
        self._flush_if_due()

    def evict(self) -> None:
        """Write and drop least-recently-used trees not open by any runner until at most ``max_nodes`` remain
        (and write the changed ones if a flush is due)."""
        total = self.nodes
        if total <= self.max_nodes:
            self._flush_if_due()
            return
        for key in [k for k in self._trees if k not in self._open]:  # least recently used first
            if total <= self.max_nodes:
                break
            if key in self._dirty:
                if not self._files.write(key, self._trees[key]):
                    continue  # kept in memory until it can be written
                self._dirty.discard(key)
            total -= len(self._trees.pop(key))
            self._membership += 1
            self.counts.evictions += 1
        self._flush_if_due()

    def flush(self) -> None:
        """Write every changed tree to disk (merged with what other stores and processes wrote)."""
        _write_dirty(self._files, self._trees, self._dirty)
        self._flushed_at = time.monotonic()

    def _flush_if_due(self) -> None:
        if self._dirty and (len(self._dirty) >= self.flush_every
                            or time.monotonic() - self._flushed_at >= self.flush_seconds):
            self.flush()

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


def disk_report(root: Path | None = None) -> dict[str, float | int | list[str]]:
    """Size of every stored prefix tree under ``root`` (default: this machine's replay cache), loaded and checked.

    Temporary files are skipped; files that fail their checks are listed under ``damaged`` (left in place).
    """
    root = root or cache_dir("replay")
    files = sorted(p for p in root.rglob("*.npz") if not p.name.endswith(".tmp.npz"))
    trees, damaged = [], []
    for f in files:
        try:
            trees.append(PrefixTree.load(f))
        except TreeFileError as err:
            damaged.append(str(err))
    nodes = sum(len(t) for t in trees)
    memory = sum(t.nbytes() for t in trees)
    return {"pairs": len({f.parent for f in files}), "prompt_trees": len(trees), "prefixes": nodes,
            "bytes_in_memory": memory, "bytes_per_prefix": memory / nodes if nodes else 0.0,
            "bytes_on_disk": sum(f.stat().st_size for f in files), "damaged": damaged}

