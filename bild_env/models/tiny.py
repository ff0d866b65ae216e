"""The `tiny-random` pair: two OPT-architecture models with random weights, made locally.

Random language models are near-uniform (max probability ~1/vocab) and two independent ones
never agree, which would make every BiLD decision a fallback. So the pair is built to behave
like a real draft/target pair at toy size:

- target: 4 OPT layers, hidden 64, random weights from a fixed seed, with the final layer norm
  scaled by ``logit_scale`` so that its distributions are peaked (median max-probability ~0.7);
- draft: the target's embeddings, first 2 layers and final norm (so it is smaller: 2 layers of 4),
  while the target's two extra layers write into the residual stream scaled by ``alpha``.
  With alpha = 0.2 the draft's argmax equals the target's on about 60% of positions, so full
  acceptance, partial acceptance, fallback and rollback all happen.

Both are saved with ``save_pretrained`` once into the cache and loaded back through the same
``from_pretrained`` path as hub models, with the GPT-2 tokenizer committed in
``bild_env/assets/gpt2-tokenizer`` (rebuilt offline by ``python -m scripts.build_assets tokenizer``).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bild_env.paths import ASSETS, cache_dir

TOKENIZER_DIR = ASSETS / "gpt2-tokenizer"
GPT2_EOS = 50256


@dataclass(frozen=True)
class TinySpec:
    """Shape and seed of a tiny random OPT pair (every default of the `tiny-random` preset)."""

    seed: int = 0
    hidden: int = 64
    heads: int = 4
    target_layers: int = 4
    draft_layers: int = 2
    vocab_size: int = 50272  # OPT's padded vocabulary; ids >= 50257 decode to ""
    max_positions: int = 512
    init_std: float = 0.2
    logit_scale: float = 6.0
    alpha: float = 0.2  # scale of the target-only layers' residual writes: lower -> more agreement

    def folder_name(self) -> str:
        return "tiny-random-" + "-".join(f"{v}" for v in asdict(self).values())


def _config(spec: TinySpec, layers: int):
    from transformers import OPTConfig

    return OPTConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        word_embed_proj_dim=spec.hidden,
        num_hidden_layers=layers,
        ffn_dim=4 * spec.hidden,
        num_attention_heads=spec.heads,
        max_position_embeddings=spec.max_positions,
        init_std=spec.init_std,
        bos_token_id=GPT2_EOS,
        eos_token_id=GPT2_EOS,
        pad_token_id=GPT2_EOS,
    )


def build_tiny_pair(spec: TinySpec, out: Path) -> None:
    """Write ``out/draft``, ``out/target`` and ``out/tokenizer`` for ``spec`` (deterministic)."""
    from transformers import AutoTokenizer, OPTForCausalLM

    torch.manual_seed(spec.seed)
    target = OPTForCausalLM(_config(spec, spec.target_layers)).eval()
    with torch.no_grad():
        target.model.decoder.final_layer_norm.weight.mul_(spec.logit_scale)
        for layer in target.model.decoder.layers[spec.draft_layers :]:
            layer.self_attn.out_proj.weight.mul_(spec.alpha)
            layer.fc2.weight.mul_(spec.alpha)
    draft = OPTForCausalLM(_config(spec, spec.draft_layers)).eval()
    keep = {
        k: v
        for k, v in target.state_dict().items()
        if not any(f"layers.{i}." in k for i in range(spec.draft_layers, spec.target_layers))
    }
    draft.load_state_dict(keep, strict=True)
    target.save_pretrained(out / "target")
    draft.save_pretrained(out / "draft")
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(out / "tokenizer")


def ensure_tiny_pair(spec: TinySpec = TinySpec()) -> Path:
    """Return the cache folder of ``spec``'s pair, building it there once (atomically)."""
    folder = cache_dir("models") / spec.folder_name()
    if (folder / "target" / "config.json").exists():
        return folder
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        build_tiny_pair(spec, tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another process finished first
            if not (folder / "target" / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
