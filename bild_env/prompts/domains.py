"""Prompt domains of a mixed serving workload: prose, code, chat and long inputs, each split three ways.

The draft agrees with the target more on some text than on other: on the smollm2 pair (bfloat16, 12
validation prompts per domain, 64 new tokens, k=1 speculative decoding) its greedy acceptance was
0.47 on prose, 0.19 on code, 0.33 on chat and 0.22 on long inputs. A workload that mixes domains is
what a controller of BiLD's thresholds faces in serving. Each domain is cut into train / validation /
test with no text in two splits:

* "prose": English Wikipedia lead sections (``dataset="wiki"``), split by article; the first
  ``prompt_tokens`` (32) tokens.
* "code": HumanEval's problems (or, with ``code_source="stdlib"``, top-level defs of this Python's
  standard library), split by problem (file); the first ``prompt_tokens`` tokens.
* "chat": user requests, split by request, cut to ``prompt_tokens`` tokens and rendered with the
  tokenizer's chat template (whose tokens come on top: ~30 for SmolLM2's).
* "long": whole Wikipedia leads, and HumanEval problems with their solutions, each joined one after
  another up to ``long_min_tokens``-``long_max_tokens`` (256-512) tokens; a prose input, then a code
  input, and so on. Split as prose and code are.

``load_domain`` gives a domain's token-id prompts; ``parse_mix`` reads weights such as
"prose:1,code:1,chat:1"; ``Workload`` holds the prompts of a mix and draws (domain, prompt) pairs.
The lists are the same on every machine for the same tokenizer (``code_source="stdlib"``: for the
same Python version), in a fixed order, and ``load_domain(..., limit=n)`` is the first ``n`` of them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from bild_env.command import UsageError
from bild_env.prompts import prompt_cache
from bild_env.prompts.chat import INSTRUCTIONS_FILE, chat_prompt, instruction_texts
from bild_env.prompts.code import (
    HUMANEVAL_FILE, check_code_source, humaneval_problems, stdlib_modules, stdlib_snippets,
)
from bild_env.prompts.sources import load_prompts
from bild_env.prompts.splits import check_split
from bild_env.prompts.wiki import WIKI_FILE, load_wiki_texts

DOMAINS: tuple[str, ...] = ("prose", "code", "chat", "long")
LONG_SOURCES: tuple[str, ...] = ("prose", "code")  # where long inputs come from
_BATCH = 512  # texts tokenized per call
_CHARS_PER_TOKEN = 16  # a text is tokenized from a head of this many characters per token kept (tokens average 3-5)


@dataclass(frozen=True)
class DomainConfig:
    """How prompts are cut from each domain's text (every option of ``load_domain`` and ``Workload``)."""

    prompt_tokens: int = field(default=32, metadata={"help": (
        "prose and code: tokens per prompt; chat: tokens of the request (the template adds more)")})
    min_prompt_tokens: int = field(default=4, metadata={"help": "prose and code texts shorter than this are skipped"})
    long_min_tokens: int = field(default=256, metadata={"help": "long inputs have at least this many tokens ..."})
    long_max_tokens: int = field(default=512, metadata={"help": (
        "... and at most this many (the models need long_max_tokens + max_new_tokens positions)")})
    code_source: str = field(default="humaneval", metadata={"help": (
        '"humaneval" (shipped, same everywhere) or "stdlib" (this Python\'s library)')})
    long_sources: tuple[str, ...] = field(default=LONG_SOURCES, metadata={"help": (
        "taken in turn: a prose input, a code input, ...")})

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "min_prompt_tokens", "long_min_tokens", "long_max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.long_min_tokens > self.long_max_tokens:
            raise ValueError(f"long_min_tokens ({self.long_min_tokens}) must not exceed long_max_tokens "
                             f"({self.long_max_tokens})")
        check_code_source(self.code_source)
        sources = (self.long_sources,) if isinstance(self.long_sources, str) else tuple(self.long_sources)
        if not sources or any(s not in LONG_SOURCES for s in sources):
            raise ValueError(f"long_sources must name one or more of {', '.join(LONG_SOURCES)}; "
                             f"got {self.long_sources!r}")
        object.__setattr__(self, "long_sources", sources)


def domain_config(**opts) -> DomainConfig:
    """A ``DomainConfig`` from keyword options; ValueError naming the valid ones for an unknown name."""
    fields = [f.name for f in dataclasses.fields(DomainConfig)]
    unknown = sorted(set(opts) - set(fields))
    if unknown:
        raise ValueError(f"unknown domain option(s) {', '.join(unknown)}; valid options are: {', '.join(fields)}")
    return DomainConfig(**opts)


def check_domain(domain: str) -> None:
    """Raise ValueError naming the domains when ``domain`` is not one."""
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; valid domains are: {', '.join(DOMAINS)}")


def _batches(texts: Sequence[str]) -> Iterable[Sequence[str]]:
    for i in range(0, len(texts), _BATCH):
        yield texts[i:i + _BATCH]


def _head(text: str, tokens: int) -> str:
    """The start of ``text`` that surely holds its first ``tokens`` tokens, cut at a line break or space.

    Tokenizing a long text (a whole module) only to keep its first tokens wastes seconds; the tokens of
    the head equal the text's up to the last word before the cut, far beyond the ``tokens`` kept.
    """
    chars = _CHARS_PER_TOKEN * tokens
    if len(text) <= chars:
        return text
    cut = max(text.rfind("\n", 0, chars), text.rfind(" ", 0, chars))
    return text[:cut if cut > chars // 2 else chars]


def _first_tokens(tokenizer, texts: Sequence[str], cfg: DomainConfig, limit: int | None) -> list[list[int]]:
    """Each text cut to its first ``prompt_tokens`` tokens, skipping those under ``min_prompt_tokens``."""
    least, out = min(cfg.min_prompt_tokens, cfg.prompt_tokens), []
    for batch in _batches(texts):
        for ids in tokenizer([_head(t, cfg.prompt_tokens) for t in batch])["input_ids"]:
            if len(ids) >= least:
                out.append(ids[:cfg.prompt_tokens])
                if limit is not None and len(out) >= limit:
                    return out
    return out


def _joined(tokenizer, texts: Sequence[str], cfg: DomainConfig, limit: int | None) -> list[list[int]]:
    """Long inputs: consecutive texts joined by a blank line until they reach ``long_min_tokens``.

    Texts are whole (a Wikipedia lead, a problem with its solution); a group is tokenized as one text
    and cut to ``long_max_tokens``, so a text longer than that is its own input, cut at a token boundary.
    """
    out: list[list[int]] = []
    group: list[str] = []
    count = 0
    for batch in _batches([_head(t, cfg.long_max_tokens) for t in texts]):
        for text, n in zip(batch, map(len, tokenizer(list(batch), add_special_tokens=False)["input_ids"])):
            group.append(text)
            count += n + 1  # the separator
            if count < cfg.long_min_tokens:
                continue
            ids = tokenizer("\n\n".join(group))["input_ids"][:cfg.long_max_tokens]
            if len(ids) >= cfg.long_min_tokens:  # else (rare: merges across the joins) take one more text
                out.append(ids)
                group, count = [], 0
                if limit is not None and len(out) >= limit:
                    return out
    return out


def _prose(tokenizer, split: str, cfg: DomainConfig, limit: int | None) -> list[list[int]]:
    return load_prompts(tokenizer, "wiki", split, cfg.prompt_tokens, cfg.min_prompt_tokens, limit=limit)


def _code_texts(split: str, cfg: DomainConfig) -> Sequence[str]:
    if cfg.code_source == "stdlib":
        return stdlib_snippets(split)
    return [p["prompt"] for p in humaneval_problems(split)]


def _code(tokenizer, split: str, cfg: DomainConfig, limit: int | None) -> list[list[int]]:
    return _first_tokens(tokenizer, _code_texts(split, cfg), cfg, limit)


def _chat(tokenizer, split: str, cfg: DomainConfig, limit: int | None) -> list[list[int]]:
    texts = instruction_texts(split)[:limit]
    return [chat_prompt(tokenizer, text, cfg.prompt_tokens) for text in texts]


def _long_texts(source: str, split: str, cfg: DomainConfig) -> Sequence[str]:
    if source == "prose":
        return load_wiki_texts(split)
    if cfg.code_source == "stdlib":
        return stdlib_modules(split)
    return [p["prompt"] + p["solution"] for p in humaneval_problems(split)]


def _long(tokenizer, split: str, cfg: DomainConfig, limit: int | None) -> list[list[int]]:
    """Long inputs of each of ``long_sources``, taken in turn (one of each, then the next of each, ...)."""
    per_source = [_joined(tokenizer, _long_texts(s, split, cfg), cfg, limit) for s in cfg.long_sources]
    longest = max(map(len, per_source))
    return [p[i] for i in range(longest) for p in per_source if i < len(p)]


_BUILDERS: dict[str, Callable[..., list[list[int]]]] = {"prose": _prose, "code": _code, "chat": _chat, "long": _long}


def _cache_key(tokenizer, domain: str, split: str, cfg: DomainConfig) -> str | None:
    """What a domain's prompts depend on (see ``prompt_cache``); None when the tokenizer cannot be keyed."""
    fingerprint = prompt_cache.tokenizer_fingerprint(tokenizer)
    if fingerprint is None:
        return None
    data = [prompt_cache.file_digest(f) for f in (WIKI_FILE, HUMANEVAL_FILE, INSTRUCTIONS_FILE)]
    if cfg.code_source == "stdlib":
        data.append(prompt_cache.python_source_key())
    return "|".join([fingerprint, domain, split, repr(cfg), *data])


def load_domain(tokenizer, domain: str, split: str, limit: int | None = None, **opts) -> list[list[int]]:
    """Token-id prompts of ``domain`` for ``split`` (a fixed order; ``limit``: only the first ``limit``).

    Args:
        tokenizer: the pair's tokenizer (a transformers tokenizer; its chat template renders "chat").
        domain: one of ``DOMAINS``.
        split: "train", "validation" or "test".
        limit: at most this many prompts (None: all).
        **opts: fields of ``DomainConfig`` (``prompt_tokens=32``, ``min_prompt_tokens=4``,
            ``long_min_tokens=256``, ``long_max_tokens=512``, ``code_source="humaneval"``,
            ``long_sources=("prose", "code")``).

    Raises ValueError for an unknown domain, split or option, and when the split has no prompt.
    """
    check_domain(domain)
    check_split(split)
    cfg = domain_config(**opts)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be an integer >= 1 or None, got {limit!r}")
    if hasattr(tokenizer, "prompts"):  # a decoding dataset's (bild_env.replay.dataset): the prompts it recorded
        opts = dataclasses.asdict(cfg)
        return tokenizer.prompts(domain, split, opts.pop("prompt_tokens"), limit, **opts)
    key = _cache_key(tokenizer, domain, split, cfg)
    prompts = prompt_cache.load(key) if key else None
    if prompts is None and limit is None:
        prompts = _BUILDERS[domain](tokenizer, split, cfg, None)
        if key and prompts:
            prompt_cache.store(key, prompts)
    elif prompts is None:  # a few prompts: build just those
        prompts = _BUILDERS[domain](tokenizer, split, cfg, limit)
    prompts = prompts[:limit]
    if not prompts:
        raise ValueError(f"the {split} split of the {domain} domain has no usable prompt with these options ({cfg}); "
                         "give other options or another split")
    return prompts


def _weight(name: str, value, spec) -> float:
    """One weight of a mix, checked: a finite number >= 0."""
    hint = "give finite weights >= 0 over the domains, e.g. mix='prose:1,code:1,chat:1'"
    try:
        if isinstance(value, bool):
            raise TypeError
        weight = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"mix {spec!r}: the weight of {name!r} is {value!r}, not a number; {hint}") from None
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"mix {spec!r}: the weight of {name!r} is {weight}; {hint}")
    return weight


def _entries(spec: str) -> list[tuple[str, str]]:
    """(domain, weight text) pairs of "prose:1,code:2" (a bare name weighs 1)."""
    pairs = []
    for part in spec.split(","):
        name, sep, value = part.partition(":")
        pairs.append((name.strip(), value.strip() if sep else "1"))
    return pairs


def parse_mix(spec: str | Mapping[str, float]) -> dict[str, float]:
    """Domain weights of a mix, normalised to sum to 1, in ``DOMAINS`` order; zero weights dropped.

    ``spec`` is "prose:1,code:1,chat:1" (a bare domain name weighs 1: "prose,code" is an even mix) or a
    mapping such as {"prose": 2, "long": 1}. Raises ValueError, naming the mix and what to give, for an
    empty mix, an unknown or repeated domain, a weight that is not a finite number >= 0, or all zeros.
    """
    hint = f"give weights over the domains {', '.join(DOMAINS)}, e.g. mix='prose:1,code:1,chat:1'"
    if isinstance(spec, str):
        pairs = _entries(spec) if spec.strip() else []
    elif isinstance(spec, Mapping):
        pairs = list(spec.items())
    else:
        raise ValueError(f"mix must be a string or a mapping of domain weights, got {type(spec).__name__}; {hint}")
    if not pairs:
        raise ValueError(f"mix {spec!r} is empty; {hint}")
    weights: dict[str, float] = {}
    for name, value in pairs:
        if name not in DOMAINS:
            raise ValueError(f"mix {spec!r}: unknown domain {name!r}; {hint}")
        if name in weights:
            raise ValueError(f"mix {spec!r}: domain {name!r} is given twice; {hint}")
        weights[name] = _weight(name, value, spec)
    total = sum(weights.values())
    if total <= 0:
        raise ValueError(f"mix {spec!r}: every weight is 0; {hint}")
    return {d: weights[d] / total for d in DOMAINS if weights.get(d, 0) > 0}


class Workload:
    """The prompts of a weighted mix of domains, and draws of (domain, prompt) from it.

    Args:
        tokenizer: the pair's tokenizer.
        mix: weights, as ``parse_mix`` takes them ("prose:1,code:1,chat:1" or a mapping).
        split: "train", "validation" or "test".
        prompt_tokens: ``DomainConfig.prompt_tokens``.
        limit_per_domain: at most this many prompts per domain (None: all of the split's).
        **opts: the other fields of ``DomainConfig``.

    ``draw(rng)`` picks a domain with probability its weight, then one of its prompts uniformly.
    """

    def __init__(self, tokenizer, mix: str | Mapping[str, float], split: str = "train",
                 prompt_tokens: int = DomainConfig.prompt_tokens, limit_per_domain: int | None = None, **opts):
        check_split(split)
        self.split = split
        self.config = domain_config(prompt_tokens=prompt_tokens, **opts)
        self.weights = parse_mix(mix)
        self.domains: tuple[str, ...] = tuple(self.weights)
        self.prompts: dict[str, list[list[int]]] = {d: self._load(tokenizer, d, limit_per_domain) for d in self.domains}
        self._cumulative = np.cumsum([self.weights[d] for d in self.domains])

    def _load(self, tokenizer, domain: str, limit: int | None) -> list[list[int]]:
        try:
            return load_domain(tokenizer, domain, self.split, limit, **dataclasses.asdict(self.config))
        except ValueError as err:  # a UsageError (a dataset that lacks the split) stays one: one line, no traceback
            raise (type(err) if isinstance(err, UsageError) else ValueError)(
                f"domain {domain!r} has weight {self.weights[domain]:.3g} in the mix but no prompts in its "
                f"{self.split} split: {err}") from err

    @property
    def sizes(self) -> dict[str, int]:
        """Prompts per domain."""
        return {d: len(p) for d, p in self.prompts.items()}

    def draw(self, rng: np.random.Generator, weights: Sequence[float] | None = None) -> tuple[str, int, list[int]]:
        """(domain, prompt index within that domain, the prompt's token ids) for one request; ``weights`` (one per
        domain, ``domains`` order) replace the mix's for this draw (an episode's own mix)."""
        cumulative = self._cumulative if weights is None else np.cumsum(weights)
        k = min(int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right")), len(self.domains) - 1)
        domain = self.domains[k]
        index = int(rng.integers(len(self.prompts[domain])))
        return domain, index, list(self.prompts[domain][index])

    def __repr__(self) -> str:
        mix = ",".join(f"{d}:{w:.3g}" for d, w in self.weights.items())
        return f"Workload(mix={mix!r}, split={self.split!r}, sizes={self.sizes})"
