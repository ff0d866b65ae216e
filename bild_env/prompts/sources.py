"""Prompt sources for the env and the evaluator: built-in, WikiText-2, offline Wikipedia, files, lists.

Every source yields paragraphs of text for a split; ``load_prompts`` tokenizes them and cuts
each non-empty paragraph to its first ``prompt_tokens`` tokens (paragraphs shorter than
``min_prompt_tokens`` are skipped).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bild_env.prompts.splits import check_split

# Short English paragraphs written for this project (public domain), so that the env runs with no
# download. 18 train / 6 validation / 6 test.
BUILTIN = [
    "The river rises in the northern hills and flows south through farmland before it reaches the sea.",
    "In the morning the market fills with traders selling bread, fish, cheese and fresh vegetables.",
    "The committee met on Tuesday to discuss the budget for the coming year and the new library.",
    "Early computers filled entire rooms and used thousands of vacuum tubes to perform calculations.",
    "The orchestra opened the concert with a short overture, followed by a symphony in four movements.",
    "Glaciers form when snow accumulates over many years and compresses into thick layers of ice.",
    "The novel follows a young sailor who leaves his village to search for his missing brother.",
    "Bees collect nectar from flowers and carry pollen between plants, helping them to reproduce.",
    "The bridge was completed in 1932 and was for many years the longest suspension bridge in the country.",
    "A good recipe for bread needs only flour, water, salt and yeast, and a great deal of patience.",
    "The team scored twice in the second half and won the championship for the first time in its history.",
    "Volcanoes release gases and molten rock from deep inside the earth through vents in its crust.",
    "The museum holds a collection of paintings, sculptures and manuscripts from the medieval period.",
    "Trains leave the central station every ten minutes during the day and every hour at night.",
    "The language has three grammatical genders and a rich system of noun cases and verb endings.",
    "Farmers in the valley grow wheat, barley and grapes, and many families also keep sheep and goats.",
    "The telescope was pointed at a distant galaxy whose light had travelled for billions of years.",
    "After the storm, volunteers cleared the roads and helped repair the roofs of damaged houses.",
    "The castle stands on a rocky hill above the town and was rebuilt several times after fires.",
    "Photosynthesis converts light energy into chemical energy stored in sugars made from water and air.",
    "The city council voted to extend the tram line to the airport and to build two new stations.",
    "She studied mathematics at the university and later worked on the design of early aircraft.",
    "The festival takes place every summer and attracts musicians and visitors from around the world.",
    "Salt was once so valuable that it was traded for gold and used to pay the wages of soldiers.",
    "The island has a mild climate, sandy beaches and a small harbour used by fishing boats.",
    "Engineers tested the new engine for several months before it was approved for passenger flights.",
    "The forest is home to deer, foxes, owls and hundreds of species of insects and fungi.",
    "Newspapers reported the discovery the next morning, and crowds gathered outside the laboratory.",
    "The old road crossed the mountains through a narrow pass that was closed by snow in winter.",
    "Children at the school learn to read and write in two languages from their first year.",
]
_BUILTIN_SPLITS = {"train": BUILTIN[:18], "validation": BUILTIN[18:24], "test": BUILTIN[24:]}
SOURCES = ("builtin", "wikitext", "wiki")  # the named datasets (any other string is a text file's path)


def _wikitext(split: str) -> list[str]:
    try:
        from datasets import load_dataset

        rows = load_dataset("wikitext", "wikitext-2-raw-v1", split=split)
    except Exception as err:  # the hub raises several types when offline (ConnectionError, OSError, ...)
        raise RuntimeError(
            f"Could not load WikiText-2 ({split}) through `datasets` ({type(err).__name__}): it needs the Hugging Face "
            "hub once (then it is cached). Offline, use dataset='builtin' (30 short paragraphs), dataset='wiki' "
            "(Wikipedia lead sections shipped with bild-gym), a text file path (one paragraph per blank-line-separated "
            "block), or a list of prompt strings."
        ) from err
    # skip section headings (" = Title = ") and blank lines
    return [t.strip() for t in rows["text"] if t.strip() and not t.strip().startswith("=")]


def _read_text(path: Path) -> str:
    """The UTF-8 text of ``path``; ``ValueError`` naming the file when it is not UTF-8 text."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"dataset {str(path)!r} is not a UTF-8 text file (byte {err.start}: {err.reason}): give a "
                         "text file of paragraphs separated by blank lines, or 'builtin', 'wikitext', 'wiki'") from None
    if "\x00" in text:
        raise ValueError(f"dataset {str(path)!r} is not a UTF-8 text file (it holds NUL bytes): give a text file of "
                         "paragraphs separated by blank lines, or 'builtin', 'wikitext', 'wiki'")
    return text


def _text_file(path: Path, split: str) -> list[str]:
    """Paragraphs of a text file (blank-line separated), split 80/10/10 in file order.

    A file too short to give a split any paragraph gives that split the whole file.
    """
    paragraphs = [p.strip() for p in _read_text(path).split("\n\n") if p.strip()]
    n = len(paragraphs)
    a, b = int(0.8 * n), int(0.9 * n)
    return {"train": paragraphs[:a], "validation": paragraphs[a:b], "test": paragraphs[b:]}[split] or paragraphs


def paragraphs(dataset: str | Sequence[str], split: str) -> list[str]:
    """The text paragraphs of ``dataset`` for ``split``.

    ``dataset`` is "builtin", "wikitext" (WikiText-2 raw through `datasets`), "wiki" (the offline
    Wikipedia lead sections in bild_env/assets/wiki), a path to a text file, or a list of prompt
    strings (used as given, for every split).
    """
    check_split(split)
    if not isinstance(dataset, str):
        return [str(p) for p in dataset]
    if dataset == "builtin":
        return list(_BUILTIN_SPLITS[split])
    if dataset == "wikitext":
        return _wikitext(split)
    if dataset == "wiki":
        from bild_env.prompts.wiki import load_wiki_texts

        return load_wiki_texts(split)
    return _text_file(_dataset_file(dataset), split)


def _dataset_file(dataset: str) -> Path:
    path = Path(dataset)
    if not path.is_file():
        raise ValueError(
            f"unknown dataset {dataset!r}: use 'builtin', 'wikitext', 'wiki', a path to an existing text file, "
            "or a list of prompt strings"
        )
    return path


def check_dataset(dataset: str | Sequence[str]) -> None:
    """Fail now (before any model loads) on a dataset name that is no source, or a file that is not UTF-8 text.

    Named sources are not fetched here ("wikitext" may need the hub: it fails when loaded).
    """
    if isinstance(dataset, str) and dataset not in SOURCES:
        _read_text(_dataset_file(dataset))


def load_prompts(
    tokenizer, dataset: str | Sequence[str], split: str, prompt_tokens: int, min_prompt_tokens: int = 4,
    limit: int | None = None,
) -> list[list[int]]:
    """Token-id prompts: each usable paragraph cut to its first ``prompt_tokens`` tokens (order kept)."""
    if prompt_tokens < 1 or min_prompt_tokens < 1:
        raise ValueError(f"prompt_tokens and min_prompt_tokens must be >= 1, got {prompt_tokens}, {min_prompt_tokens}")
    if hasattr(tokenizer, "prompts") and isinstance(dataset, str):  # a decoding dataset's: the prompts it recorded
        return tokenizer.prompts(dataset, split, prompt_tokens, limit, min_prompt_tokens=min_prompt_tokens)
    prompts = []
    for text in paragraphs(dataset, split):
        ids = tokenizer(text)["input_ids"][:prompt_tokens]
        if len(ids) >= min(min_prompt_tokens, prompt_tokens):
            prompts.append(ids)
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        name = dataset if isinstance(dataset, str) else "the given list"
        raise ValueError(
            f"the {split} split of {name} has no usable prompt (none of its paragraphs has {min_prompt_tokens} or "
            "more tokens); give another dataset or split"
        )
    return prompts
