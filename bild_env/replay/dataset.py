"""Decoding datasets: a pair's replay trees, recorded once, that both envs replay with no model loaded.

A decoding dataset is a folder::

    manifest.json        what was recorded: the pair (preset, key, dtype), the env options that shape a step (grids,
                         tree rules, max_draft_len, score, max_new_tokens, prompt_tokens), which prompts of which split
                         and domain, how far each prompt is covered, the machine that made it, and each file's
                         size and sha256
    trees/<key>.npz      one prefix tree per prompt (``bild_env.replay.tree``, with the draft's top candidates)
    prompts.json         the prompts' token ids, by split and source, as the envs load them
    references.json      the target's greedy continuation of every prompt (the BLEU reference)
    pieces.npz           the bytes each token id stands for (a byte-level tokenizer's), so BLEU decodes text

A prompt is covered (``python -m bild_env.fill --record``, ``bild_env.fill.cover``) by one step of every action of
the recorded grid, speculation off and each tree rule, from every prefix of the target's greedy continuation
("greedy"), and with ``cover="episodes"`` also the fixed actions' whole episodes and every action from every start of
theirs. Every step a lossless action takes (rollback below ln 2, speculation off, a tree) starts on the greedy path,
so any policy over lossless actions is answered whole; a lossy policy leaves the path and is answered as far as the
recording went.

An env whose pair has a dataset shipped with the package (``bild_env/assets/datasets/<preset>-<dtype>``, matched on
the preset, its dtype, lean forward and draft vocabulary) builds its pair as a ``RecordedPair``: the tokenizer's work
for the recorded prompts, the references and every answer come from the dataset, and the models load only when a step
needs what the dataset lacks (a miss, or timing this machine's costs when no ``cost_profile`` is given). Where they
cannot load (no network, no weights in the cache), such a step is refused in one line (``NotRecorded``). Trees the
models extend go to the cache (``replay/<digest of the pair key>``), the dataset itself is never written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import platform
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from bild_env.command import UsageError
from bild_env.paths import prompt_key, write_atomic
from bild_env.replay.tree import PrefixTree, TreeFileError

logger = logging.getLogger(__name__)
FORMAT = 1
LN2 = math.log(2.0)  # a BiLD step whose rollback threshold is below this commits only the target's argmax (lossless)
SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "datasets"
MANIFEST = "manifest.json"


class NotRecorded(UsageError):
    """A step, prompt or option the decoding dataset does not hold, where the models that would answer it cannot load."""


class DatasetError(UsageError):
    """A decoding dataset that cannot be read, or whose files do not match their manifest."""


# -- reading ----------------------------------------------------------------------------------------------------------
@dataclass
class DecodingDataset:
    """A decoding dataset on disk (module docstring); files are checked against their sha256 when first read."""

    folder: Path
    manifest: dict

    @classmethod
    def open(cls, folder: str | Path) -> DecodingDataset:
        folder = Path(folder)
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
        except (OSError, ValueError) as err:
            raise DatasetError(f"{folder} is not a decoding dataset ({MANIFEST}: {err})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise DatasetError(f"{folder / MANIFEST} is not a decoding dataset manifest of format {FORMAT}")
        return cls(folder, manifest)

    @property
    def name(self) -> str:
        return self.manifest["name"]

    def _file(self, relative: str) -> Path:
        """The path of ``relative``, its size and sha256 checked against the manifest (once per process)."""
        entry = self.manifest["files"].get(relative)
        path = self.folder / relative
        if entry is None:
            raise DatasetError(f"{path} is not listed in the manifest of the decoding dataset {self.name}")
        if relative not in _CHECKED.setdefault(str(self.folder), set()):
            try:
                data = path.read_bytes()
            except OSError as err:
                raise DatasetError(f"decoding dataset {self.name}: cannot read {path} ({err}); reinstall the "
                                   "package or record the dataset again") from None
            if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise DatasetError(f"decoding dataset {self.name}: {path} is altered (its size or sha256 is not the "
                                   "manifest's); reinstall the package or record the dataset again")
            _CHECKED[str(self.folder)].add(relative)
        return path

    def _json(self, relative: str) -> dict:
        return json.loads(self._file(relative).read_text())

    @cached_property
    def prompt_ids(self) -> dict[str, list[int]]:
        """Prompt key -> token ids, of every recorded prompt."""
        return self._json("prompts.json")

    @cached_property
    def references(self) -> dict[str, list[int]]:
        """Prompt key -> the target's greedy continuation (``max_new_tokens`` tokens, fewer at EOS); a manifest whose
        ``max_new_tokens`` its references do not bear out is refused."""
        references = self._json("references.json")
        m = self.manifest
        eos = set(m["eos_token_ids"])
        short = [k for k, ids in references.items() if len(ids) != m["max_new_tokens"] and not (ids and ids[-1] in eos)]
        if short:
            raise DatasetError(f"decoding dataset {self.name}: its manifest says {m['max_new_tokens']} new tokens a "
                               f"prompt, but {len(short)} of its {len(references)} references hold another count and "
                               "end before EOS; reinstall the package or record the dataset again")
        return references

    def tree(self, key: str, vocab_size: int | None = None) -> PrefixTree | None:
        """The recorded tree of prompt ``key``, or None when the dataset has no tree of it."""
        relative = f"trees/{key}.npz"
        if relative not in self.manifest["files"]:
            return None
        path = self._file(relative)
        try:
            return PrefixTree.load(path, vocab_size)
        except TreeFileError as err:
            raise DatasetError(f"decoding dataset {self.name}: {err}") from None

    def prompts(self, source: str, split: str, prompt_tokens: int, limit: int | None, **opts) -> list[list[int]]:
        """The recorded prompts of ``source`` (a domain or a prompt source) in ``split``: the first ``limit`` (all
        recorded ones when ``limit`` is None or more); ``NotRecorded`` for what the recording does not hold."""
        m = self.manifest
        if prompt_tokens != m["prompt_tokens"]:
            raise NotRecorded(f"the decoding dataset {self.name} holds prompts cut to {m['prompt_tokens']} tokens, "
                              f"not {prompt_tokens}; give prompt_tokens={m['prompt_tokens']}")
        differing = {k: v for k, v in opts.items()
                     if k in m["prompt_options"] and m["prompt_options"][k] != json.loads(json.dumps(v))}
        if differing:
            raise NotRecorded(f"the decoding dataset {self.name} holds prompts made with {m['prompt_options']}, "
                              f"not {differing}")
        keys = [k for k in m["prompts"].get(split, {}).get(source, []) if f"trees/{k}.npz" in m["files"]]  # covered
        if not keys:
            held = {s: sorted(src for src, ks in d.items() if any(f"trees/{k}.npz" in m["files"] for k in ks))
                    for s, d in m["prompts"].items()}  # what it holds covered
            held = {s: d for s, d in held.items() if d}
            raise NotRecorded(f"the decoding dataset {self.name} holds no {split} prompts of {source!r} (it holds "
                              f"{held}): record them with `python -m bild_env.fill --pair {m['pair']} --dtype "
                              f"{m['dtype']} --split {split} --max-new-tokens {m['max_new_tokens']} --cover greedy "
                              f"--record {self.folder}`, or give another split or dtype")
        if (limit is None or limit > len(keys)) and first_time((self.name, split, source)):
            logger.info("decoding dataset %s: the %d recorded %s prompts of %s", self.name, len(keys), split, source)
        return [list(self.prompt_ids[k]) for k in keys[:limit]]

    @cached_property
    def tokenizer(self) -> RecordedTokenizer:
        with np.load(self._file("pieces.npz"), allow_pickle=False) as data:
            return RecordedTokenizer(self, data["offsets"], data["blob"].tobytes(), data["skip"])


_CHECKED: dict[str, set[str]] = {}  # dataset folder -> files whose sha256 this process checked
_SAID: set[tuple] = set()  # what was said once in this process (``first_time``'s keys)


def first_time(key: tuple) -> bool:
    """True the first time ``key`` is asked of this process (then it is remembered): what is said once, not by
    each env of a vector env."""
    new = key not in _SAID
    _SAID.add(key)
    return new


class RecordedTokenizer:
    """The tokenizer's work for a recorded pair: the recorded prompts (``bild_env.prompts`` asks ``prompts``) and
    decoding (token ids -> text, as the real tokenizer decodes with ``skip_special_tokens=True``)."""

    def __init__(self, dataset: DecodingDataset, offsets: np.ndarray, blob: bytes, skip: np.ndarray) -> None:
        self.dataset, self.offsets, self.blob = dataset, offsets.tolist(), blob
        self.skip = set(np.flatnonzero(skip).tolist())

    def prompts(self, source: str, split: str, prompt_tokens: int, limit: int | None, **opts) -> list[list[int]]:
        return self.dataset.prompts(source, split, prompt_tokens, limit, **opts)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = b"".join(self.blob[self.offsets[i] : self.offsets[i + 1]] for i in ids
                       if not (skip_special_tokens and i in self.skip))
        return out.decode("utf-8", errors="replace")

    def __call__(self, text, **kwargs):
        raise NotRecorded(f"the decoding dataset {self.dataset.name} tokenizes only its recorded prompts; load the "
                          "models (their tokenizer) to tokenize other text")


# -- a pair whose models load on demand ---------------------------------------------------------------------------------
class RecordedPair:
    """A ``ModelPair`` read from a decoding dataset: what the envs ask of a pair before any forward (its key, dtype,
    vocabulary, EOS ids, positions, tokenizer work) comes from the manifest; anything else (``draft``, ``target``)
    loads the models first, with ``load`` (a ``load_pair`` call), once."""

    def __init__(self, dataset: DecodingDataset, load, device: torch.device, load_on_miss: bool = False) -> None:
        m = dataset.manifest
        self.dataset, self._load, self._models, self.load_on_miss = dataset, load, None, load_on_miss
        self.name, self.key, self.device = m["pair"], m["pair_key"], device
        self.dtype = getattr(torch, m["dtype"])
        self.ids, self.fingerprints = tuple(m["ids"]), tuple(m["fingerprints"])
        self.draft_vocab, self.lean = m["draft_vocab"], tuple(m["lean"])
        self.eos_token_ids, self.max_positions = tuple(m["eos_token_ids"]), m["max_positions"]
        self.vocab_size = m["vocab_size"]

    @property
    def tokenizer(self):
        return self._models.tokenizer if self._models is not None else self.dataset.tokenizer

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def loaded(self) -> bool:
        return self._models is not None

    def where_models(self) -> str:
        """Where the models a miss needs would come from, in words (this machine's cache, or the fetch and its size)."""
        from bild_env.models.pairs import PRESETS

        preset = PRESETS[self.name]
        if preset.fetched is not None and preset.fetched():
            return "on this machine"
        return f"not on this machine: a fetch of {preset.fetch or 'them from the Hugging Face hub'}"

    @property
    def covered_actions(self) -> str:
        """What the dataset answers whole with no model, in words (``covers`` checks an env's options against it)."""
        m = self.dataset.manifest
        lossless = [r for r in m["rollback_values"] if r < LN2]
        trees = f", the tree rules {', '.join(m['tree_rules'])}" if m["tree_rules"] else ""
        return (f"it answers every episode of the fallbacks {m['fallback_values']} at rollback "
                f"{' or '.join(map(str, lossless)) or 'none'}, speculation off{trees}")

    def models(self, step: str = ""):
        """The loaded pair (loaded now if not yet); ``NotRecorded`` naming why when it cannot load. ``step`` (where in
        an episode, in words) marks a load that a step needs: refused (``NotRecorded`` naming the step and the ways
        out) unless the env opted in (``pair_options={'load_on_miss': True}``), then announced with what it costs."""
        if self._models is None and step:
            where = self.where_models()
            if not self.load_on_miss:
                raise NotRecorded(
                    f"the decoding dataset {self.dataset.name} does not hold {step} ({self.covered_actions}); the "
                    f"{self.name} models that would answer it are {where}, and a step loads them only where the env "
                    "opted in: keep to the actions it answers, or pass pair_options={'load_on_miss': True}")
            if first_time((self.dataset.name, "loading")):  # once: every env of a vector env has its own pair
                logger.warning("the decoding dataset %s does not hold %s: loading the %s models (%s) to answer it; "
                               "their trees go to this machine's cache", self.dataset.name, step, self.name, where)
        if self._models is None:
            try:
                models = self._load()
            except (OSError, ValueError, RuntimeError) as err:
                reason = " ".join(str(err).split())
                raise NotRecorded(f"the decoding dataset {self.dataset.name} does not answer this (a step, prompt or "
                                  f"cost table it lacks), and the models that would could not load: {reason[:400]}. "
                                  "Keep to what the dataset covers (its manifest lists it), give a cost_profile, or "
                                  "make the models loadable") from None
            if models.key != self.key:
                logger.warning("the models loaded for %s are not those the decoding dataset %s was recorded with "
                               "(%s, not %s): their fills join the recorded trees", self.name, self.dataset.name,
                               models.key, self.key)
            self._models = models
        return self._models

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.models(), name)


def shipped(preset: str, dtype: str | None = None) -> DecodingDataset | None:
    """The dataset shipped for ``preset`` in ``dtype`` (None: the dtype "auto" picks on this machine if one is shipped
    in it, else the one shipped), or None."""
    from bild_env.models.device import DTYPES

    by_dtype = {folder.name.removeprefix(f"{preset}-"): folder for folder in sorted(SHIPPED.glob(f"{preset}-*"))
                if folder.is_dir() and folder.name.removeprefix(f"{preset}-") in DTYPES}
    if not by_dtype:
        return None
    if dtype is None or dtype == "auto":
        from bild_env.models.device import default_device, resolve_dtype

        auto = str(resolve_dtype("auto", default_device())).removeprefix("torch.")
        folder = by_dtype.get(auto) or (next(iter(by_dtype.values())) if len(by_dtype) == 1 else None)
    else:
        folder = by_dtype.get(str(dtype).removeprefix("torch."))
    if folder is None:
        return None
    dataset = DecodingDataset.open(folder)  # a shipped folder that cannot be read is an error, never skipped
    m = dataset.manifest
    named = {"pair": preset, "dtype": folder.name.removeprefix(f"{preset}-"), "name": folder.name}
    differing = {k: m.get(k) for k, v in named.items() if m.get(k) != v}
    if differing:
        raise DatasetError(f"the decoding dataset folder {folder} holds a manifest of {differing}, not of its name's "
                           f"{named}: reinstall the package, or record it again into a folder of its own name")
    return dataset


def _dataset_of(cfg) -> DecodingDataset | None:
    """The shipped dataset an env of config ``cfg`` replays: a preset's, on the replay backend, asked nothing the
    recording was not made with (no custom models, tokenizer, lean forward or draft vocabulary); in the dtype asked,
    else in "auto"'s or the one dtype shipped (``shipped``). None otherwise."""
    from bild_env.models.pairs import PRESETS

    opts = cfg.pair_options
    if (opts.draft or opts.target or opts.tokenizer or opts.lean is not None or opts.draft_vocab is not None
            or cfg.pair not in PRESETS or getattr(cfg, "backend", "replay") != "replay"):
        return None
    return shipped(cfg.pair, opts.dtype or PRESETS[cfg.pair].dtype)


def pair_for(cfg, load) -> object:
    """The pair an env of config ``cfg`` decodes with (``load(dtype=None)``: ``load_pair`` of its options): a
    ``RecordedPair`` of its dataset (``_dataset_of``; the pair then runs in the dataset's dtype) when its models are
    not loaded in this process yet; else the models, whose replay trees still start from the dataset
    (``seed_for``)."""
    from bild_env.models.device import usable_device

    dataset = _dataset_of(cfg)
    if dataset is None:
        return load()
    dtype = dataset.manifest["dtype"]
    device = usable_device(cfg.pair_options.device)
    if _loaded(dataset, device) is not None:
        return load(dtype)
    return RecordedPair(dataset, lambda: load(dtype), device, cfg.pair_options.load_on_miss)


def replay_actions(cfg, given) -> object | None:
    """The actions an env of config ``cfg`` takes by default where it replays a decoding dataset with no opt-in to load
    the models (``PairOptions.load_on_miss``): the config's with the rollback values the dataset answers (its lossless
    ones) in place of the paper's grid, where ``given`` (the ``actions`` argument: absent, a dict or an
    ``ActionOptions``) did not choose rollback values. None where nothing changes."""
    from dataclasses import replace

    if cfg.pair_options.load_on_miss or not isinstance(given, dict | None) or "rollback_values" in (given or {}):
        return None
    dataset = _dataset_of(cfg)
    if dataset is None:
        return None
    lossless = tuple(r for r in dataset.manifest["rollback_values"] if r < LN2)
    if not lossless or set(cfg.actions.rollback_values) <= set(lossless):
        return None
    if first_time((dataset.name, "defaults")):
        logger.warning("replaying the decoding dataset %s: the actions default to those it answers with no model, "
                       "rollback %s (lossless), not the paper's grid; pair_options={'load_on_miss': True} gives the "
                       "paper's grid, whose lossy steps load the models", dataset.name, " or ".join(map(str, lossless)))
    return replace(cfg.actions, rollback_values=lossless)


def load_where_needed(cfg):
    """``cfg`` (either env's config) with ``pair_options.load_on_miss`` set where its options leave the decoding dataset
    it replays: what a command (a trainer, an evaluator) runs, whose actions it chose, loads the models for the steps
    the dataset lacks, as construction then says (with their size); a bare env refuses such steps instead."""
    from dataclasses import replace

    dataset = _dataset_of(cfg)
    if dataset is None or cfg.pair_options.load_on_miss or _outside(cfg, dataset.manifest) is None:
        return cfg
    return replace(cfg, pair_options=replace(cfg.pair_options, load_on_miss=True))


def check_replayed(pair, cfg, env_id: str) -> None:
    """Once the env's construction is done (its tables timed or not), for an env replaying ``pair``'s decoding dataset
    with no model loaded: options under which every episode leaves the recording (lengths it did not record) are
    refused in one line naming the option and both ways out, unless the env opted in to load the models on a miss
    (``PairOptions.load_on_miss``); actions that leave it (lossy, unrecorded) are said once, with what a step of
    theirs does: refused in one line, or where opted in, load the models (their size said)."""
    if not isinstance(pair, RecordedPair) or pair.loaded:
        return
    m, where = pair.dataset.manifest, pair.where_models()
    every = _outside(cfg, m, actions=False)
    if every is not None and not cfg.pair_options.load_on_miss:
        raise NotRecorded(f"{env_id} replays the decoding dataset {pair.dataset.name} with no model, and {every}; its "
                          f"episodes there need the {pair.name} models ({where}). Keep to what it records, or pass "
                          "pair_options={'load_on_miss': True} to load them when a step leaves the recording")
    some = every or _outside(cfg, m, lengths=False)
    if not first_time((pair.dataset.name, some, where, cfg.pair_options.load_on_miss)):
        return
    recorded = (f"{env_id} replays the decoding dataset {pair.dataset.name} (recorded on {m['machine']['machine']}) "
                f"with no model: {pair.covered_actions}")
    if some is None:
        logger.info("%s", recorded)
    elif cfg.pair_options.load_on_miss:
        logger.warning("%s; beyond it (%s) a step loads the %s models (%s)", recorded, some, pair.name, where)
    else:
        logger.warning("%s; beyond it (%s) a step is refused: the %s models are %s, and a step loads them only with "
                       "pair_options={'load_on_miss': True}", recorded, some, pair.name, where)


def dtype_for(cfg) -> str | None:
    """The dtype an env of config ``cfg`` will run its pair in as ``pair_for`` decides (its dataset's where it has
    one, else ``cfg.pair_options.dtype``), without loading anything: what a caller that loads the pair first (to time it) gives
    ``load_pair``."""
    dataset = _dataset_of(cfg)
    return dataset.manifest["dtype"] if dataset is not None else cfg.pair_options.dtype


def covers(cfg, split: str) -> bool:
    """Whether the dataset an env of serving config ``cfg`` replays (``dtype_for``) answers every episode of its
    ``split`` under every policy over its lossless actions (``not_covered`` says why not)."""
    return _dataset_of(cfg) is not None and cfg.max_prompts is not None and not_covered(cfg, split) is None


def not_covered(cfg, split: str) -> str | None:
    """Why the dataset an env of serving config ``cfg`` replays does not answer every episode of ``split``, in words
    that name the option to change; None where it does or no dataset is shipped for the pair in its dtype. It must
    hold each domain of the mix in ``split`` with ``max_prompts`` prompts or more, ``max_new_tokens`` and
    ``prompt_tokens`` as recorded or within, the grids and tree rules among the recorded ones, and every rollback
    threshold below ln 2."""
    from bild_env.prompts.domains import parse_mix

    dataset = _dataset_of(cfg)
    if dataset is None:
        return None
    m = dataset.manifest
    if cfg.max_prompts is None:
        return f"max_prompts None (every prompt of the source) asks for more than {dataset.name} records"
    held = m["prompts"].get(split, {})
    covered = set(m["covered"])
    for domain, weight in parse_mix(cfg.mix).items():
        keys = held.get(domain, [])[: cfg.max_prompts]
        if weight > 0 and len(keys) < cfg.max_prompts:
            return (f"it records {len(keys)} {split} prompts of {domain!r} and max_prompts is {cfg.max_prompts} "
                    f"(--max-prompts {min(len(v) for v in held.values()) if held else 0} keeps to them)")
        if weight > 0 and not covered.issuperset(keys):
            return f"{domain!r}'s {split} prompts are listed but not all recorded yet"
    return _outside(cfg, m)


def _outside(cfg, m: dict, lengths: bool = True, actions: bool = True) -> str | None:
    """Why an env of config ``cfg`` (either env's) takes steps a dataset of manifest ``m`` does not hold whatever its
    prompts, in words that name the option: the ``lengths`` it did not record (every episode leaves it), the
    ``actions`` (lossy, grids, tree rules: the episodes that take them leave it)."""
    acts, lossless = cfg.actions, tuple(r for r in m["rollback_values"] if r < LN2)
    checks = []
    if lengths:
        checks += [(cfg.max_new_tokens > m["max_new_tokens"],
                    f"max_new_tokens {cfg.max_new_tokens} is above the {m['max_new_tokens']} recorded"),
                   (cfg.prompt_tokens != m["prompt_tokens"],
                    f"prompt_tokens {cfg.prompt_tokens} is not the {m['prompt_tokens']} recorded"),
                   (isinstance(acts.max_draft_len, int) and acts.max_draft_len > m["max_draft_len"],
                    f"max_draft_len {acts.max_draft_len} is above the {m['max_draft_len']} recorded")]
    if actions:
        checks += [(not set(acts.fallback_values) <= set(m["fallback_values"]),
                    f"fallback values {acts.fallback_values} are not all among the recorded {m['fallback_values']}"),
                   (max(acts.rollback_values) >= LN2,
                    f"a rollback threshold of {max(acts.rollback_values):g} (ln 2 or above: lossy, off the recorded "
                    f"path; actions={{'rollback_values': {lossless}}} keeps to it)"),
                   (not set(acts.rollback_values) <= set(m["rollback_values"]),
                    f"rollback values {acts.rollback_values} are not all among the recorded {m['rollback_values']}"),
                   (not set(acts.tree_rules) <= set(m["tree_rules"]),
                    f"tree rules {acts.tree_rules} are not all among the recorded {m['tree_rules']}")]
    return next((why for wrong, why in checks if wrong), None)


def seed_for(pair) -> DecodingDataset | None:
    """The decoding dataset whose trees and references ``pair``'s replay starts from: a ``RecordedPair``'s own, else the
    one shipped for its preset in its dtype, lean forward and draft vocabulary (the same numbers), else None."""
    if isinstance(pair, RecordedPair):
        return pair.dataset
    name = getattr(pair, "name", None)
    if not name or name == "custom":
        return None
    dataset = shipped(name, str(pair.dtype))
    return dataset if dataset is not None and _same_numbers(dataset, pair) else None


def _same_numbers(dataset: DecodingDataset, pair) -> bool:
    m = dataset.manifest
    return (pair.name == m["pair"] and str(pair.dtype).removeprefix("torch.") == m["dtype"]
            and list(pair.lean) == m["lean"] and pair.draft_vocab == m["draft_vocab"])


def _loaded(dataset: DecodingDataset, device: torch.device):
    """The pair of ``dataset``'s numbers already loaded on ``device`` in this process, or None."""
    from bild_env.models.pairs import _CACHE

    return next((p for p in list(_CACHE.values()) if p.device == device and _same_numbers(dataset, p)), None)


# -- recording --------------------------------------------------------------------------------------------------------
def machine() -> dict:
    """What made a recording: the machine (``machine_description``: CPU, torch, threads) and the libraries."""
    import transformers

    from bild_env.models.device import machine_description

    return {"machine": machine_description("cpu"), "transformers": transformers.__version__,
            "python": platform.python_version()}


def byte_pieces(tokenizer, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets, bytes, skip) of every token id of a byte-level BPE tokenizer: the bytes id i stands for are
    ``bytes[offsets[i]:offsets[i+1]]``; ``skip`` marks the special tokens ``skip_special_tokens`` drops."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    added = {i: t for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}
    pieces, skip = [], np.zeros(vocab_size, np.bool_)
    tokens = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    for i in range(vocab_size):
        token = tokens[i] if i < len(tokens) else None
        if i in special or token is None:
            skip[i] = i in special
            pieces.append(b"")
        elif i in added:
            pieces.append(str(added[i].content).encode())
        elif all(c in to_byte for c in token):
            pieces.append(bytes(to_byte[c] for c in token))
        else:
            pieces.append(tokenizer.decode([i]).encode())
    offsets = np.zeros(vocab_size + 1, np.int64)
    offsets[1:] = np.cumsum([len(p) for p in pieces])
    return offsets, np.frombuffer(b"".join(pieces), np.uint8), skip


class Recording:
    """A decoding dataset being written (``python -m bild_env.fill --record``): ``add`` copies a covered prompt's tree
    in and rewrites the manifest (atomically), so a recording stopped at any point keeps every prompt it finished and
    goes on from there."""

    def __init__(self, folder: str | Path, header: dict) -> None:
        self.folder = Path(folder)
        (self.folder / "trees").mkdir(parents=True, exist_ok=True)
        header = json.loads(json.dumps(header))  # as the manifest holds it (lists, not tuples)
        path = self.folder / MANIFEST
        if path.exists():
            self.manifest = json.loads(path.read_text())
            fixed = {k: v for k, v in header.items() if k not in ("machine", "created")}
            differing = {k: (self.manifest.get(k), v) for k, v in fixed.items() if self.manifest.get(k) != v}
            if differing:
                raise UsageError(f"{self.folder} holds a recording of other settings ({differing}: recorded, asked); "
                                 "record into another folder")
        else:
            self.manifest = {"format": FORMAT, **header, "prompts": {}, "files": {}, "covered": {}}
        self.prompt_ids = self._read("prompts.json")
        self.references = self._read("references.json")

    def _read(self, name: str) -> dict:
        path = self.folder / name
        return json.loads(path.read_text()) if path.exists() else {}

    def done(self, key: str) -> bool:
        return f"trees/{key}.npz" in self.manifest["files"]

    def list_prompts(self, split: str, source: str, prompts: list[list[int]]) -> None:
        """Record that ``source``'s ``split`` prompts are these (in order), as the envs load them."""
        keys = [prompt_key(p) for p in prompts]
        self.manifest["prompts"].setdefault(split, {})[source] = keys
        for k, p in zip(keys, prompts):
            self.prompt_ids[k] = list(p)

    def add(self, prompt: list[int], tree: PrefixTree, reference: list[int], steps: int) -> None:
        key = prompt_key(prompt)
        tree.save(self.folder / "trees" / f"{key}.npz")
        self.prompt_ids[key], self.references[key] = list(prompt), list(reference)
        self.manifest["covered"][key] = steps
        self._entry(f"trees/{key}.npz")
        self.save()

    def set_pieces(self, offsets: np.ndarray, blob: np.ndarray, skip: np.ndarray) -> None:
        with open(self.folder / "pieces.npz", "wb") as f:
            np.savez_compressed(f, offsets=offsets, blob=blob, skip=skip)
        self._entry("pieces.npz")

    def save(self) -> None:
        """The prompts and references, then the manifest last: each file replaced atomically."""
        for name, table in (("prompts.json", self.prompt_ids), ("references.json", self.references)):
            write_atomic(self.folder / name, json.dumps(table, sort_keys=True))
            self._entry(name)
        files = self.manifest["files"]
        self.manifest["bytes"] = sum(f["bytes"] for f in files.values())
        self.manifest["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        write_atomic(self.folder / MANIFEST, json.dumps(self.manifest, indent=1, sort_keys=True) + "\n")

    def _entry(self, relative: str) -> None:
        data = (self.folder / relative).read_bytes()
        self.manifest["files"][relative] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


__all__ = ["DatasetError", "DecodingDataset", "NotRecorded", "RecordedPair", "RecordedTokenizer", "Recording",
           "dtype_for", "pair_for", "seed_for", "shipped"]
