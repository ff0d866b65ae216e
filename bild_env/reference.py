"""BLEU against the target's own greedy continuation, which is the reference of every prompt.

References are computed once per (pair, prompt, max_new_tokens) with target-only decoding and
kept on disk, so later episodes, runs and processes reuse them. BLEU is sacreBLEU's sentence
BLEU (effective n-gram order, as sacreBLEU recommends at sentence level) of the text generated
so far against the reference cut to the same number of tokens, in [0, 100].
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from sacrebleu.metrics import BLEU

from bild_env.decoding.decoders import batched_greedy, generate_target_only
from bild_env.models.pairs import ModelPair
from bild_env.paths import cache_dir, digest, prompt_key

_BLEU = BLEU(effective_order=True)


def prefix_bleu(pair: ModelPair, output: list[int], reference: list[int]) -> float:
    """Sentence BLEU (0-100) of ``output`` against the first ``len(output)`` tokens of ``reference``."""
    if not output:
        return 100.0
    hyp = pair.decode(output)
    ref = pair.decode(reference[: len(output)])
    if hyp == ref:
        return 100.0
    return min(100.0, _BLEU.sentence_score(hyp, [ref]).score)


class ReferenceStore:
    """Target greedy continuations keyed by prompt, for one pair and ``max_new_tokens``, on disk."""

    def __init__(self, pair: ModelPair, max_new_tokens: int, folder: Path | None = None) -> None:
        self.pair, self.max_new_tokens = pair, max_new_tokens
        self.path = (folder or cache_dir("references")) / f"{digest(pair.key, str(max_new_tokens))}.json"
        self.refs: dict[str, list[int]] = json.loads(self.path.read_text()) if self.path.exists() else {}

    def get(self, prompt_ids: list[int]) -> list[int]:
        """The target's greedy continuation of ``prompt_ids`` (computed and stored on first use)."""
        key = prompt_key(prompt_ids)
        if key not in self.refs and self.path.exists():  # another env or process may have computed it since
            self.refs.update(json.loads(self.path.read_text()))
        if key not in self.refs:
            self.refs[key] = generate_target_only(self.pair, prompt_ids, self.max_new_tokens).new_ids
            self._save()
        return self.refs[key]

    def prefetch(self, prompts: list[list[int]], batch_size: int = 16, progress: bool = True) -> int:
        """Compute the references ``prompts`` lack, ``batch_size`` prompts per batched greedy decode.

        Equal to ``get`` one by one (the same greedy decoding; a batched forward differs from a
        batch-1 one only in float rounding, so a token could differ only where the target's two
        best logits tie to rounding). Returns how many were computed.
        """
        from tqdm import tqdm

        if self.path.exists():
            self.refs.update(json.loads(self.path.read_text()))
        todo, seen = [], set()
        for p in prompts:
            key = prompt_key(p)
            if key not in self.refs and key not in seen:
                seen.add(key)
                todo.append(list(p))
        if not todo:
            return 0
        with tqdm(total=len(todo), desc="references", unit="prompt", disable=not progress, leave=False) as bar:
            for start in range(0, len(todo), batch_size):
                part = todo[start : start + batch_size]
                outs = batched_greedy(self.pair.target, part, self.max_new_tokens, self.pair.eos_token_ids)
                for p, out in zip(part, outs):
                    self.refs[prompt_key(p)] = out
                self._save()
                bar.update(len(part))
        return len(todo)

    def _save(self) -> None:
        # merge with what other processes wrote meanwhile, then replace the file atomically
        on_disk = json.loads(self.path.read_text()) if self.path.exists() else {}
        on_disk.update(self.refs)
        self.refs = on_disk
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(on_disk, f)
        os.replace(tmp, self.path)
