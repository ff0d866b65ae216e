"""``PrefixTree``: the four numbers greedy speculative decoding needs at every stored prefix of one prompt.

At a prefix x (prompt + generated tokens):

    d_arg(x), d_p(x)   the draft's argmax and max probability after x
    t_arg(x)           the target's argmax after x
    t_logp(x)          the target's log-probability (nats) of d_arg(x) after x
    t_top(x)           the target's log-probability of t_arg(x) (for the regret of keeping d_arg(x))

One node per prefix, node 0 being the prompt, in flat typed arrays; a node's children are found
through one dict keyed by ``node * STRIDE + token``. A node is identified across trees by its
path of tokens from the prompt (``merge`` maps one tree's nodes onto another's by it).

On disk a tree is one ``.npz`` (``save``/``load``), written atomically (a temporary file, then
``os.replace``): its arrays, their length (``nodes``) and a BLAKE2b ``checksum`` of them (format
2). ``load`` checks every file (``check_arrays``: lengths, parents before children, tokens and
argmaxes in the vocabulary, probabilities in [0, 1], log-probabilities <= 0, the checksum) and
raises ``TreeFileError`` naming the file and the reason: a damaged file is never read as numbers.
Format 1 files (no length, no checksum, maybe no ``t_top``) are refused: an altered one could not be told from a
whole one, so the store sets it aside and fills the tree again.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import uuid
from array import array
from pathlib import Path

import numpy as np

STRIDE = 1 << 20  # child key = node * STRIDE + token (vocabularies are far below 2**20)
MISSING = -1
NAN = float("nan")
ARRAYS = ("parent", "token", "d_arg", "t_arg", "d_p", "t_logp", "t_top")
DTYPES = {"i": np.dtype(np.int32), "f": np.dtype(np.float32)}  # array typecode -> the dtype on disk
# the draft's top candidates (``d_top``) of the nodes that hold them, ragged: node, count, then the ids and log-probs
TOPS = ("top_node", "top_len", "top_ids", "top_logp")
FORMAT = 3  # 1: the arrays only; 2: + "nodes", "checksum" and "format"; 3: + the draft's top candidates (``TOPS``)
LOGP_SLACK = 1e-4  # nats: a stored log-probability may exceed 0 (or t_top) by float rounding, no more
FLOAT_TOLERANCE = 1e-3  # merge: two fills' floats (batched or not) agree to rounding; further apart is a conflict


class TreeFileError(ValueError):
    """A tree file that cannot be read or fails its checks; ``path`` and ``reason`` say which and why."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason


class PrefixTree:
    """The four numbers of every stored prefix of one prompt, in flat arrays (node 0 = the prompt)."""

    grown = 0  # nodes created in any tree of the process so far (lets a store know its node count is unchanged)

    def __init__(self) -> None:
        self.parent, self.token = array("i", [MISSING]), array("i", [MISSING])
        self.d_arg, self.t_arg = array("i", [MISSING]), array("i", [MISSING])
        self.d_p, self.t_logp = array("f", [0.0]), array("f", [NAN])  # t_logp NaN: not known yet
        self.t_top = array("f", [NAN])
        self.children: dict[int, int] = {}
        # the draft's most likely next tokens and their log-probabilities at a node (most likely first), for tree steps
        self.d_top: dict[int, tuple[list[int], list[float]]] = {}

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
        PrefixTree.grown += 1
        for arr, value in ((self.parent, node), (self.token, token), (self.d_arg, MISSING), (self.t_arg, MISSING)):
            arr.append(value)
        self.d_p.append(0.0)
        self.t_logp.append(NAN)
        self.t_top.append(NAN)
        return new

    def nbytes(self) -> int:
        """Memory held: the arrays plus the child index (dict table and its int keys/values)."""
        arrays = sum(getattr(self, name).itemsize * len(getattr(self, name)) for name in ARRAYS)
        ints = sum(sys.getsizeof(k) for k in list(self.children)[:64]) / max(1, min(64, len(self.children)))
        return int(arrays + sys.getsizeof(self.children) + len(self.children) * ints)

    # -- merging ------------------------------------------------------------------------------
    def merge(self, other: PrefixTree) -> int:
        """Add ``other``'s prefixes and the numbers this tree lacks; return the conflicts.

        Nodes are matched by their token path (``other`` must list parents before children, as
        every tree does). Where both trees know a number and they disagree (an argmax, or a float
        by more than rounding), this tree's is kept and the node counts as one conflict.
        """
        ids = [0] * len(other)  # other's node -> this tree's node
        conflicts = 0
        for i in range(len(other)):
            if i:
                ids[i] = self.child(ids[other.parent[i]], other.token[i])
            conflicts += self._merge_node(ids[i], other, i)
        for i, (top, logp) in other.d_top.items():  # the longer list of candidates (one forward's, or a wider one's)
            mine = self.d_top.get(ids[i])
            if mine is None or len(mine[0]) < len(top):
                self.d_top[ids[i]] = (list(top), list(logp))
        return conflicts

    def _merge_node(self, j: int, other: PrefixTree, i: int) -> bool:
        """Copy node ``i`` of ``other``'s numbers into node ``j`` where it lacks them; True on a disagreement."""
        conflict = False
        if other.d_arg[i] != MISSING:
            if self.d_arg[j] == MISSING:
                self.d_arg[j], self.d_p[j] = other.d_arg[i], other.d_p[i]
            else:
                conflict |= self.d_arg[j] != other.d_arg[i] or not _close(self.d_p[j], other.d_p[i])
        if other.t_arg[i] != MISSING:
            if self.t_arg[j] == MISSING:
                self.t_arg[j] = other.t_arg[i]
            else:
                conflict |= self.t_arg[j] != other.t_arg[i]
        same_token = self.d_arg[j] == other.d_arg[i]  # t_logp is the log-probability of d_arg: only of the same token
        if (same_token and math.isnan(self.t_logp[j]) and not math.isnan(other.t_logp[i])
                and not math.isnan(other.t_top[i])):
            # t_logp and t_top travel together, from the one forward that read both (so t_logp <= t_top; two
            # forwards of a low-precision dtype round differently)
            conflict |= not math.isnan(self.t_top[j]) and not _close(self.t_top[j], other.t_top[i])
            self.t_logp[j], self.t_top[j] = other.t_logp[i], other.t_top[i]
            return conflict
        if same_token:
            conflict |= _merge_float(self.t_logp, j, other.t_logp[i])
        conflict |= _merge_float(self.t_top, j, other.t_top[i])
        return conflict

    def prefixes(self) -> dict[tuple[int, ...], int]:
        """Every stored prefix (its generated tokens) -> the numbers it holds (bits 1 d_arg, 2 t_arg, 4 t_logp, 8 t_top)."""
        paths: list[tuple[int, ...]] = [()]
        out = {}
        for i in range(len(self)):
            if i:
                paths.append(paths[self.parent[i]] + (self.token[i],))
            out[paths[i]] = ((self.d_arg[i] != MISSING) | (self.t_arg[i] != MISSING) << 1
                             | (not math.isnan(self.t_logp[i])) << 2 | (not math.isnan(self.t_top[i])) << 3)
        return out

    # -- disk -----------------------------------------------------------------------------------
    def arrays(self) -> dict[str, np.ndarray]:
        """Copies of the arrays as ``save`` writes them: cut to the nodes complete in every array, and a number
        whose partner a write interrupted half-way lacks (d_p without d_arg, a log-probability without its
        argmax) read as unknown, so that a saved tree always passes ``check_arrays``."""
        n = min(len(getattr(self, name)) for name in ARRAYS)
        a = {name: np.frombuffer(getattr(self, name), DTYPES[getattr(self, name).typecode])[:n].copy()
             for name in ARRAYS}
        a["d_arg"][a["d_p"] == 0] = MISSING
        a["d_p"][a["d_arg"] == MISSING] = 0.0
        a["t_logp"][(a["d_arg"] == MISSING) | (a["t_arg"] == MISSING)] = NAN
        a["t_top"][a["t_arg"] == MISSING] = NAN
        tops = sorted((node, top) for node, top in self.d_top.items() if node < n and top[0])
        a["top_node"] = np.array([node for node, _ in tops], np.int32)
        a["top_len"] = np.array([len(top[0]) for _, top in tops], np.int32)
        a["top_ids"] = np.array([t for _, top in tops for t in top[0]], np.int32)
        a["top_logp"] = np.array([x for _, top in tops for x in top[1]], np.float32)
        return a

    def save(self, path: Path) -> None:
        """Write the tree to ``path`` atomically (a uniquely named ``*.tmp.npz`` beside it, synced, then renamed)."""
        path = Path(path)
        arrays = self.arrays()
        tmp = path.with_name(f"{path.stem}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp.npz")
        try:
            with open(tmp, "wb") as f:
                np.savez(f, **arrays, nodes=np.int64(len(arrays["parent"])), format=np.int64(FORMAT),
                         checksum=np.str_(checksum(arrays)))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: Path, vocab_size: int | None = None) -> PrefixTree:
        """The tree stored in ``path``, checked first (its checksum, ``check_arrays``); ``TreeFileError`` if it cannot be
        used (a file of the first format, without a checksum, is not)."""
        arrays = read_arrays(path)
        if "checksum" not in arrays:  # format 1: values altered within their ranges could not be told from whole ones
            raise TreeFileError(path, "a file of the first format, without a checksum: its values cannot be trusted")
        try:
            check_arrays(arrays, vocab_size)
        except ValueError as err:
            raise TreeFileError(path, str(err)) from None
        tree = cls()
        for name in ARRAYS:
            getattr(tree, name)[:] = array(getattr(tree, name).typecode, arrays[name].tobytes())
        tree.children = {p * STRIDE + t: i for i, (p, t) in enumerate(zip(tree.parent, tree.token)) if i}
        if "top_node" in arrays:
            ends = np.cumsum(arrays["top_len"]).tolist()
            ids, logp = arrays["top_ids"].tolist(), arrays["top_logp"].tolist()
            for node, end, count in zip(arrays["top_node"].tolist(), ends, arrays["top_len"].tolist()):
                tree.d_top[node] = (ids[end - count : end], logp[end - count : end])
        return tree


def read_arrays(path: Path) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` at ``path`` (no pickled objects); ``TreeFileError`` if it cannot be read."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except Exception as err:  # numpy and zipfile raise many types (BadZipFile, EOFError, ValueError, ...)
        raise TreeFileError(path, f"unreadable ({type(err).__name__}: {err})") from None


def checksum(arrays: dict[str, np.ndarray]) -> str:
    """BLAKE2b (128 bits) of every array's name, dtype, length and bytes, in ``ARRAYS`` then ``TOPS`` order (the
    ``TOPS`` when present: a file of format 2 has none)."""
    h = hashlib.blake2b(digest_size=16)
    for name in ARRAYS + tuple(t for t in TOPS if t in arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype.str}:{len(a)};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def check_arrays(arrays: dict[str, np.ndarray], vocab_size: int | None = None) -> None:
    """Raise ``ValueError`` saying why ``arrays`` (as read from a file) are not a valid tree.

    Checked: every array present, one-dimensional, of its dtype,
    all of one length >= 1 (= ``nodes`` when stored); node 0 is the root; every other node's parent
    comes before it and no two nodes share a (parent, token); tokens in [0, vocab), argmaxes in
    [-1, vocab) (-1: unknown); d_p in [0, 1] and 0 exactly where d_arg is unknown; log-probabilities
    <= 0 or NaN (unknown), t_logp <= t_top, and known only where the argmaxes they belong to are;
    the checksum (format 2). ``vocab_size`` None: tokens below ``STRIDE``.
    """
    absent = [name for name in ARRAYS if name not in arrays]
    if absent:
        raise ValueError(f"arrays {absent} missing")
    for name in ARRAYS:
        a = arrays[name]
        want = DTYPES["i"] if name in ("parent", "token", "d_arg", "t_arg") else DTYPES["f"]
        if a.ndim != 1 or a.dtype != want:
            raise ValueError(f"array {name} is {a.dtype}{list(a.shape)}, not a 1-d {want} array")
    lengths = {name: len(arrays[name]) for name in ARRAYS}
    n = lengths["parent"]
    if len(set(lengths.values())) != 1 or n < 1:
        raise ValueError(f"arrays of different lengths {lengths}")
    if "nodes" in arrays and int(arrays["nodes"]) != n:
        raise ValueError(f"{n} nodes stored, {int(arrays['nodes'])} recorded")
    if "checksum" in arrays and str(arrays["checksum"]) != checksum(arrays):
        raise ValueError("checksum mismatch (the arrays changed after they were written)")
    _check_structure(arrays, n, vocab_size or STRIDE)
    _check_values(arrays, vocab_size or STRIDE)
    _check_tops(arrays, n, vocab_size or STRIDE)


def _check_tops(a: dict[str, np.ndarray], n: int, vocab: int) -> None:
    """The draft's top candidates (format 3): all four arrays or none; nodes of the tree, each once, in order; counts
    >= 1 that add up to the ids' and log-probabilities' lengths; ids in the vocabulary; log-probabilities <= 0."""
    present = [name for name in TOPS if name in a]
    if not present:
        return
    if len(present) != len(TOPS):
        raise ValueError(f"top-candidate arrays {sorted(set(TOPS) - set(present))} missing")
    node, count, ids, logp = (a[name] for name in TOPS)
    for name, arr, want in zip(TOPS, (node, count, ids, logp), ("i", "i", "i", "f")):
        if arr.ndim != 1 or arr.dtype != DTYPES[want]:
            raise ValueError(f"array {name} is {arr.dtype}{list(arr.shape)}, not a 1-d {DTYPES[want]} array")
    if len(count) != len(node) or np.any(count < 1) or int(count.sum()) != len(ids) or len(ids) != len(logp):
        raise ValueError("top-candidate counts do not match their ids and log-probabilities")
    if np.any(node < 0) or np.any(node >= n) or np.any(np.diff(node) <= 0):
        raise ValueError("a top-candidate node outside the tree, or listed twice")
    if np.any((ids < 0) | (ids >= vocab)) or not np.all(logp <= LOGP_SLACK):
        raise ValueError(f"a top candidate outside [0, {vocab}), or a log-probability above 0")


def _check_structure(a: dict[str, np.ndarray], n: int, vocab: int) -> None:
    parent, token = a["parent"].astype(np.int64), a["token"].astype(np.int64)
    if parent[0] != MISSING or token[0] != MISSING:
        raise ValueError("node 0 is not the prompt (parent and token -1)")
    if not np.all((parent[1:] >= 0) & (parent[1:] < np.arange(1, n))):
        raise ValueError("a node comes before its parent")
    if not np.all((token[1:] >= 0) & (token[1:] < vocab)):
        raise ValueError(f"a token outside [0, {vocab})")
    if len(np.unique(parent[1:] * STRIDE + token[1:])) != n - 1:
        raise ValueError("two nodes for one prefix")


def _check_values(a: dict[str, np.ndarray], vocab: int) -> None:
    d_arg, t_arg, d_p = a["d_arg"], a["t_arg"], a["d_p"]
    for name, arg in (("d_arg", d_arg), ("t_arg", t_arg)):
        if not np.all((arg >= MISSING) & (arg < vocab)):
            raise ValueError(f"{name} outside [-1, {vocab})")
    if not np.all((d_p >= 0) & (d_p <= 1)) or not np.array_equal(d_p == 0, d_arg == MISSING):
        raise ValueError("d_p outside [0, 1], or not 0 exactly where d_arg is unknown")
    t_logp = a["t_logp"]
    t_top = a["t_top"]
    with np.errstate(invalid="ignore"):
        if np.any(t_logp > LOGP_SLACK) or np.any(t_top > LOGP_SLACK) or np.any(t_logp > t_top + LOGP_SLACK):
            raise ValueError("a log-probability above 0, or t_logp above t_top")
    known_logp, known_top = ~np.isnan(t_logp), ~np.isnan(t_top)
    if np.any(known_logp & ((d_arg == MISSING) | (t_arg == MISSING))) or np.any(known_top & (t_arg == MISSING)):
        raise ValueError("a log-probability stored where its argmax is unknown")


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= FLOAT_TOLERANCE * (1.0 + abs(b))


def _merge_float(values: array, j: int, theirs: float) -> bool:
    """Fill ``values[j]`` from ``theirs`` if unknown (NaN); True when both are known and disagree."""
    if math.isnan(theirs):
        return False
    if math.isnan(values[j]):
        values[j] = theirs
        return False
    return not _close(values[j], theirs)
