"""The student: its Llama config and shape, a fresh (PCA-initialised) student, a student rebuilt from a
checkpoint, the ``--init`` weights it may start from (a narrower MLP widened), and averaged weights."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from distill.config import DistillConfig, target_dir


def student_config(cfg: DistillConfig, target: LlamaConfig) -> LlamaConfig:
    """The student's Llama config: target vocab, special ids and RoPE; small shape."""
    return LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=target.max_position_embeddings,
        rms_norm_eps=target.rms_norm_eps,
        rope_parameters=dict(target.rope_parameters),
        tie_word_embeddings=True,
        bos_token_id=target.bos_token_id,
        eos_token_id=target.eos_token_id,
        pad_token_id=target.pad_token_id,
    )


@torch.no_grad()
def pca_embedding(target_embed: torch.Tensor, hidden: int) -> torch.Tensor:
    """Project the target embedding (V, D) on its top ``hidden`` right singular vectors.

    Returns (V, hidden) float32; with tied heads the student's logits then start as a
    rank-``hidden`` approximation of the target's ``h @ E.T``.
    """
    emb = target_embed.float()
    eigvals, eigvecs = torch.linalg.eigh(emb.T @ emb)  # ascending, (D,), (D, D)
    basis = eigvecs[:, -hidden:].flip(-1)
    return emb @ basis


SHAPE_FIELDS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim")


def saved_shape(cfg: DistillConfig, saved: dict[str, object]) -> DistillConfig:
    """``cfg`` with the student shape of a checkpoint saved with config ``saved``.

    ``export`` and ``average`` rebuild the student from the checkpoint's own shape, so a student
    trained with other shape flags needs none of them repeated.
    """
    return replace(cfg, **{f: saved[f] for f in SHAPE_FIELDS if f in saved})


def build_student(cfg: DistillConfig) -> LlamaForCausalLM:
    """A fresh student (seeded); embedding from the target's PCA if ``init_embed=pca``."""
    torch.manual_seed(cfg.seed)
    target = AutoModelForCausalLM.from_pretrained(target_dir(cfg), dtype=torch.float32)
    student = LlamaForCausalLM(student_config(cfg, target.config))
    if cfg.init_embed == "pca":
        student.model.embed_tokens.weight.data.copy_(pca_embedding(target.model.embed_tokens.weight, cfg.hidden))
        scale = target.model.norm.weight.detach().float().abs().mean().item()
        student.model.norm.weight.data.fill_(scale)
    student.tie_weights()
    return student


def load_student(cfg: DistillConfig, saved: dict[str, object], state: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    """A float32 student in the shape of a checkpoint saved with config ``saved``, holding the weights ``state``."""
    target = AutoModelForCausalLM.from_pretrained(target_dir(cfg), dtype=torch.float32)
    student = LlamaForCausalLM(student_config(saved_shape(cfg, saved), target.config))
    student.load_state_dict(state)
    return student


def init_state(path: str, student: LlamaForCausalLM, layers: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """The weights ``--init`` names, as a float32 state dict for ``student``.

    ``path`` is a training checkpoint (``.pt``) or an exported draft folder (``config.json`` and
    safetensors, any dtype). ``layers`` (``--init-layers``): the student's layer ``j`` starts from
    the weights' layer ``layers[j]``, the embedding, final norm and head as they are (layer dropping,
    for a shallower and faster draft); None takes every layer one to one. Weights with a narrower MLP
    than ``student`` are widened without changing the function (:func:`widen_mlp`); any other shape
    difference is refused with the two shapes.
    """
    src = Path(path)
    if src.is_dir():
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        keys = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
        depth = model.config.num_hidden_layers if layers is None else student.config.num_hidden_layers
        if (any(getattr(model.config, k) != getattr(student.config, k) for k in keys)
                or depth != student.config.num_hidden_layers
                or model.config.intermediate_size > student.config.intermediate_size):
            raise ValueError(f"--init {path}: that draft is {_shape(model.config)}, the student is "
                             f"{_shape(student.config)}; pass the same --layers (or --init-layers to pick fewer)/"
                             "--hidden/--heads/--kv-heads/--head-dim and an --intermediate at least as large")
        state = model.state_dict()
    elif src.is_file():
        state = torch.load(src, weights_only=False)["model"]
    else:
        raise FileNotFoundError(f"--init {path}: no such checkpoint (.pt) or exported draft folder")
    if layers is not None:
        state = pick_layers(state, layers, f"--init {path}")
    depth, want = _depth(state), student.config.num_hidden_layers
    if depth != want:
        raise ValueError(f"--init {path} has {depth} layers, the student {want}; pass --layers {depth}, or "
                         f"--init-layers with {want} of its layers (e.g. {','.join(map(str, range(want)))})")
    return widen_mlp(state, student)


_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _depth(state: dict[str, torch.Tensor]) -> int:
    """How many decoder layers a Llama state dict holds."""
    return 1 + max((int(m.group(1)) for k in state if (m := _LAYER_KEY.match(k))), default=-1)


def pick_layers(state: dict[str, torch.Tensor], layers: Sequence[int], source: str = "the weights") -> dict[str, torch.Tensor]:
    """``state`` with only the decoder layers ``layers``, renumbered 0, 1, ... in that order; other weights as they are."""
    depth = _depth(state)
    if max(layers) >= depth:
        raise ValueError(f"--init-layers {','.join(map(str, layers))}: {source} has {depth} layers (0-{depth - 1})")
    out = {k: v for k, v in state.items() if not _LAYER_KEY.match(k)}
    for new, old in enumerate(layers):
        prefix = f"model.layers.{old}."
        out.update({f"model.layers.{new}.{k[len(prefix):]}": v for k, v in state.items() if k.startswith(prefix)})
    return out


_MLP_GROWING_AXIS = {".mlp.gate_proj.weight": 0, ".mlp.up_proj.weight": 0, ".mlp.down_proj.weight": 1}


@torch.no_grad()
def widen_mlp(state: dict[str, torch.Tensor], student: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """``state`` with every MLP widened to ``student``'s intermediate size, the function unchanged.

    The new units take ``student``'s own (seeded, random) gate and up rows and zero down-projection
    columns, so they add nothing to the output until training moves those columns. A state of
    ``student``'s shape is returned as it is.
    """
    own = student.state_dict()
    out = dict(state)
    for key, value in state.items():
        if key not in own or value.shape == own[key].shape:
            continue
        axis = next((a for suffix, a in _MLP_GROWING_AXIS.items() if key.endswith(suffix)), None)
        if axis is None or value.shape[1 - axis] != own[key].shape[1 - axis] or value.shape[axis] > own[key].shape[axis]:
            raise ValueError(f"--init: {key} is {tuple(value.shape)} there, {tuple(own[key].shape)} in the student; "
                             "only a wider MLP (--intermediate) can be started from narrower weights")
        wide = own[key].detach().clone().to(value.dtype)
        if axis == 1:
            wide.zero_()
        wide.narrow(axis, 0, value.shape[axis]).copy_(value)
        out[key] = wide
    return out


def _shape(config: LlamaConfig) -> str:
    """``layers x hidden (MLP, heads/kv heads x head_dim)`` of a Llama config, for messages."""
    return (f"{config.num_hidden_layers} layers x {config.hidden_size} (MLP {config.intermediate_size}, "
            f"{config.num_attention_heads}/{config.num_key_value_heads} heads x {config.head_dim})")


def average_states(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The element-wise mean of state dicts of one shape (float32 sums, each tensor's dtype kept)."""
    if len(states) < 2:
        raise ValueError(f"averaging needs at least two checkpoints, got {len(states)}")
    for i, state in enumerate(states[1:], 1):
        if state.keys() != states[0].keys() or any(state[k].shape != states[0][k].shape for k in state):
            raise ValueError(f"checkpoint {i} has other parameters or shapes than checkpoint 0; "
                             "only checkpoints of one student shape can be averaged")
    return {k: (sum(s[k].float() for s in states) / len(states)).to(states[0][k].dtype) for k in states[0]}
