"""BLEU against the target's own greedy continuation, which is the reference of every prompt.

References are computed once per (pair, prompt, max_new_tokens) with target-only decoding and
kept on disk, so later episodes, runs and processes reuse them. A references file that cannot be
read (cut short, garbled) is reported (``logging.warning`` naming it and why), moved aside to
``<name>.bad-<time>-<pid>`` and its references computed again, as the replay trees' are. BLEU is sacreBLEU's sentence
BLEU (effective n-gram order, as sacreBLEU recommends at sentence level) of the text generated
so far against the reference cut to the same number of tokens, in [0, 100].
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from sacrebleu.metrics import BLEU

from bild_env.decoding.batched import generate_batched_target_only
from bild_env.decoding.decoders import generate_target_only
from bild_env.models.pairs import ModelPair
from bild_env.paths import cache_dir, digest, prompt_key, set_aside, signature, write_atomic

_BLEU = BLEU(effective_order=True)
logger = logging.getLogger(__name__)


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

    def __init__(self, pair: ModelPair, max_new_tokens: int, folder: Path | None = None, recorded=None) -> None:
        self.pair, self.max_new_tokens = pair, max_new_tokens
        self.path = (folder or cache_dir("references")) / f"{digest(pair.key, str(max_new_tokens))}.json"
        self.refs: dict[str, list[int]] = self._recorded(recorded) | self._read()

    def _recorded(self, dataset) -> dict[str, list[int]]:
        """The references of ``dataset`` (the pair's decoding dataset, ``bild_env.replay.dataset``; None: none), cut to
        ``max_new_tokens``: a greedy continuation's first tokens are the shorter one's. None beyond the recorded
        length."""
        if dataset is None or self.max_new_tokens > dataset.manifest["max_new_tokens"]:
            return {}
        return {key: ids[: self.max_new_tokens] for key, ids in dataset.references.items()}

    def get(self, prompt_ids: list[int]) -> list[int]:
        """The target's greedy continuation of ``prompt_ids`` (computed and stored on first use)."""
        key = prompt_key(prompt_ids)
        if key not in self.refs:  # another env or process may have computed it since
            self.refs.update(self._read())
        if key not in self.refs:
            self.refs[key] = generate_target_only(self.pair, prompt_ids, self.max_new_tokens).new_ids
            self._save()
        return self.refs[key]

    def prefetch(self, prompts: list[list[int]], batch_size: int = 16, progress: bool = True) -> int:
        """Compute the references ``prompts`` lack, ``batch_size`` prompts per batched target-only decode
        (``batched.generate_batched_target_only``).

        Equal to ``get`` one by one (the same greedy decoding; a batched forward differs from a
        batch-1 one only in float rounding, so a token could differ only where the target's two
        best logits tie to rounding). Returns how many were computed.
        """
        from tqdm import tqdm

        self.refs.update(self._read())
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
                for p, g in zip(part, generate_batched_target_only(self.pair, part, self.max_new_tokens)):
                    self.refs[prompt_key(p)] = g.new_ids
                self._save()
                bar.update(len(part))
        return len(todo)

    def _save(self) -> None:
        # merge with what other processes wrote meanwhile, then replace the file atomically
        on_disk = self._read()
        on_disk.update(self.refs)
        self.refs = on_disk
        write_atomic(self.path, json.dumps(on_disk))

    def _read(self) -> dict[str, list[int]]:
        """The references on disk ({} when there are none; a damaged file is reported and moved aside)."""
        seen = signature(self.path)
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        try:
            refs = json.loads(text)
            if not (isinstance(refs, dict) and all(isinstance(v, list) for v in refs.values())):
                raise ValueError("not a JSON object of token lists")
        except ValueError as err:  # JSONDecodeError is one
            reason = f"{type(err).__name__}: {err}"
            try:
                aside = set_aside(self.path, seen)
            except OSError as move_err:
                logger.warning("references file %s is damaged (%s) and could not be moved aside (%s); its references "
                               "are computed again", self.path, reason, move_err)
                return {}
            if aside is not None:
                logger.warning("references file %s is damaged (%s): moved aside to %s; its references are computed "
                               "again (target-only decoding)", self.path, reason, aside.name)
            return {}
        wrong = [key for key, ids in refs.items() if not self._fits(ids)]
        if wrong:
            logger.warning("references file %s holds %d reference(s) that no greedy decode of this pair makes (empty, "
                           "longer than %d tokens, or token ids outside [0, %d)): they are computed again", self.path,
                           len(wrong), self.max_new_tokens, self.pair.vocab_size)
        return {key: ids for key, ids in refs.items() if key not in wrong}

    def _fits(self, ids: list) -> bool:
        """Whether ``ids`` can be a greedy continuation of this pair: 1 to ``max_new_tokens`` token ids of its
        vocabulary."""
        return (0 < len(ids) <= self.max_new_tokens
                and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.pair.vocab_size for t in ids))
