"""``PrefixTree``: the four numbers greedy speculative decoding needs at every stored prefix of one prompt.

At a prefix x (prompt + generated tokens):

    d_arg(x), d_p(x)   the draft's argmax and max probability after x
    t_arg(x)           the target's argmax after x
    t_logp(x)          the target's log-probability (nats) of d_arg(x) after x
    t_top(x)           the target's log-probability of t_arg(x) (for the regret of keeping d_arg(x))

One node per prefix, node 0 being the prompt, in flat typed arrays; a node's children are found
through one dict keyed by ``node * STRIDE + token``. On disk a tree is one ``.npz`` of its six
arrays (``save``/``load``), written atomically.
"""

from __future__ import annotations

import sys
from array import array
from pathlib import Path

import numpy as np

STRIDE = 1 << 20  # child key = node * STRIDE + token (vocabularies are far below 2**20)
MISSING = -1
NAN = float("nan")
ARRAYS = ("parent", "token", "d_arg", "t_arg", "d_p", "t_logp", "t_top")
OPTIONAL = {"t_top": NAN}  # arrays added after the first file format: a file without one reads as unknown (filled on use)


class PrefixTree:
    """The four numbers of every stored prefix of one prompt, in flat arrays (node 0 = the prompt)."""

    def __init__(self) -> None:
        self.parent, self.token = array("i", [MISSING]), array("i", [MISSING])
        self.d_arg, self.t_arg = array("i", [MISSING]), array("i", [MISSING])
        self.d_p, self.t_logp = array("f", [0.0]), array("f", [NAN])  # t_logp NaN: not known yet
        self.t_top = array("f", [NAN])
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
        self.t_top.append(NAN)
        return new

    def nbytes(self) -> int:
        """Memory held: the arrays plus the child index (dict table and its int keys/values)."""
        arrays = sum(getattr(self, name).itemsize * len(getattr(self, name)) for name in ARRAYS)
        ints = sum(sys.getsizeof(k) for k in list(self.children)[:64]) / max(1, min(64, len(self.children)))
        return int(arrays + sys.getsizeof(self.children) + len(self.children) * ints)

    def save(self, path: Path) -> None:
        names = ARRAYS
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
            n = len(data["parent"])
            for name in ARRAYS:
                typecode = getattr(tree, name).typecode
                if name in data:
                    getattr(tree, name)[:] = array(typecode, data[name].tobytes())
                else:
                    getattr(tree, name)[:] = array(typecode, [OPTIONAL[name]] * n)
        tree.children = {p * STRIDE + t: i for i, (p, t) in enumerate(zip(tree.parent, tree.token)) if i}
        return tree
