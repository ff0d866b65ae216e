"""A lean forward for Llama and Qwen2 models: the same weights and arithmetic, less work per call.

Qwen2 is Llama's layer with biases on the q, k and v products (``LLAMA_LIKE``): the lean forward adds the fused
bias after the fused product, and the output layer may be untied (the Qwen2.5 1.5B and larger heads are).

A forward of the 6-layer smollm2 draft (hidden 256; the `smollm2-6l` preset's) fed one token spends more time in per-call work
than in its matrix products on one CPU core: transformers' ``LlamaModel`` builds a mask, runs output
hooks and config lookups, and every layer calls seven projections and a dozen modules
(``scripts.analysis.draft_forward`` measures it). ``LeanLlamaModel`` replaces a ``LlamaForCausalLM``'s inner
``model`` and runs the plain case itself, with:

- one product for q, k and v and one for gate and up (their weights concatenated; the original
  ``q_proj``/``k_proj``/... weights become views into the concatenation, so nothing is duplicated);
- q and k rotated together, with the products ``apply_rotary_pos_emb`` computes (cos and sin from
  transformers' own rotary embedding); transformers' ``LlamaRMSNorm`` modules and ``DynamicCache.update``,
  and torch's ``scaled_dot_product_attention`` as transformers' "sdpa" attention calls it (no mask for
  one new token; a causal mask offset by the cached length otherwise);
- each product reading its weight the way measured fastest for the number of rows it is fed (tokens over the
  batch; ``WAYS``, ``choose_ways``, ``RowProduct``), timed when the model is made lean at the counts the decoders
  feed (``ROWS``), never assumed (chosen once per model, machine, kernel caps and thread count, and stored beside
  the cost tables: ``cached_plan``): plain ``F.linear``; oneDNN's blocked layout (``torch.ops.mkldnn.
  _reorder_linear_weight``, ``_linear_pointwise``: what torch.compile's freezing uses; on a Zen 5 core it made the
  lean smollm2 target's bfloat16 forward 1.5x faster, and it was the fastest at every count there); a contiguous
  transposed copy (``x @ W.T``); or the weight on the left (``(W @ x.T).T``), which in float32 took 2-4 rows for
  about the price of one (18.5 and 21.3 ms against 17.5 for 30 layers' products, AVX-512 or AVX2 alike, where the
  other ways took 25-40). A copy (packed or transposed) is made only where a way chosen reads it. Where every way
  chosen reads a copy the weights themselves are released (``release_originals``: a transposed copy's views, or, for
  packed copies, placeholders made again from the copies when transformers' own layers are called), so each weight
  is held once; a plan that also reads the weights holds them and their copies. The output layer follows the layers' plan (``PackedLinear``, or a ``SubsetHead``'s
  packed rows). The products' ways and plans: ``bild_env.models.products``.

The lean forward runs ``input_ids`` (B, n) with a ``DynamicCache`` (empty or not) and no other option,
with or without an attention mask (2-D, B x past + n; or 4-D, B x 1 x n x past + n) and position ids (B or 1, n):

- the plain case, neither: what ``bild_env.decoding.kv.single_forward`` and the cost model's timings feed;
- the padded case: ``bild_env.decoding.padded.PaddedCache`` (the batched decoder) and ``kv.batched_forward``
  pass a mask of the columns holding a token (left pads, rolled-back holes) and each row's positions. The
  mask is built as transformers' sdpa mask (new token i sees column j iff the mask holds j and
  j <= past + i), the rotary embedding taken at the given positions; each new token also sees its own column,
  so no query sees nothing (``_mask``). A mask of all ones runs as the plain case, with the given positions.
  One new token with a mask attends as transformers' masked sdpa call does, each key/value head's query
  heads as its queries (``pack_gqa``): on a Zen 5 core in bfloat16 2.5-4x faster attention than SDPA's
  ``enable_gqa`` at B >= 8, and the same logits bit for bit on the smollm2 pair (``scripts.analysis.batched
  --lean-padded``). The plain case keeps ``enable_gqa``, as transformers' unmasked call does: packing there
  was 3x faster at B = 1 (12 vs 36 us at the draft's shapes) but moved the smollm2 target's logits by up to
  0.6 (``scripts.analysis.draft_forward``'s logit gap), and a target whose one-token forwards round otherwise than its
  verifying ones could break a greedy tie differently.
- the norms as plain functions (``rms_norm``: ``LlamaRMSNorm``'s operations, checked bit for bit against the
  module once), and the causal LM's own forward replaced, on the lean instance only, by one that runs the
  lean body and the head on the same slice of hidden states (``_lean_causal_forward``): transformers' wrapper
  and its decorators took about 0.2 ms a call in a hand timing on a Zen 5 core. With both, a smollm2 draft step
  (16,384-id head) took 3.19 ms against 3.40 (``scripts.analysis.draft_forward``, "before the trims").

- the tree case: a 4-D additive float mask (0 where a query sees a key; ``bild_env.decoding.tree``'s, each
  node seeing the committed tokens and its ancestors) and position ids, passed to SDPA as given, as transformers'
  sdpa attention passes a 4-D mask it is handed.

Anything else (a boolean 4-D mask, a mask of another shape, ``inputs_embeds``, other options, another cache) goes
to the original ``LlamaModel`` untouched. Logits are those of the original up to float rounding: within
~1e-6 in float32 in the plain case and within 1e-4 (logits up to ~50) in the padded one (tested, with
greedy and batched decoding giving the same tokens), and in the plain case bit-identical in bfloat16 for
the smollm2 pair on a Zen 5 core, packed or not (``scripts.analysis.draft_forward`` records the largest difference it
sees; ``scripts.analysis.batched --lean-padded`` the padded case's). Other kernels may round fused or packed products
differently.
Outputs at columns the mask marks empty (pads) differ from the original's and are not meant to be read.
``make_lean`` applies it where ``lean_unsupported`` finds nothing against it.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bild_env.models.compat import cache_kwarg
from bild_env.models.products import RowProduct, cached_plan, can_pack, describe_plan

logger = logging.getLogger(__name__)

@functools.cache
def llama_like() -> dict[type, tuple[type, type, bool]]:
    """The causal LMs the lean forward runs: class -> (its inner model's class, its norm's class, q/k/v biases)."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM
    from transformers.models.llama.modeling_llama import LlamaModel, LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Model, Qwen2RMSNorm

    return {LlamaForCausalLM: (LlamaModel, LlamaRMSNorm, False), Qwen2ForCausalLM: (Qwen2Model, Qwen2RMSNorm, True)}


def rms_norm(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module``'s forward as a plain function where it is transformers' ``LlamaRMSNorm`` or ``Qwen2RMSNorm`` (the
    same operations without a module call's work, 13 calls a smollm2 draft forward), checked bit for bit against the
    module on a random input once; else (another norm, or one whose forward computes otherwise) the module itself."""
    if type(module) not in {norm for _, norm, _ in llama_like().values()}:
        return module
    weight, eps = module.weight, module.variance_epsilon

    def norm(x: torch.Tensor) -> torch.Tensor:  # LlamaRMSNorm.forward, operation for operation
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    x = torch.randn(2, 3, weight.shape[-1], generator=torch.Generator().manual_seed(0)).to(weight)
    with torch.inference_mode():
        return norm if torch.equal(norm(x), module(x)) else module


class PackedLinear(torch.nn.Module):
    """A bias-free ``nn.Linear`` whose products read a packed copy of ``weight`` (kept, e.g. tied to an embedding), or
    with ``plan`` the way it names for each count of rows fed (``RowProduct``: the lean layers' measured plan)."""

    def __init__(self, weight: torch.nn.Parameter, plan: tuple[str, ...] = ("", "packed")) -> None:
        super().__init__()
        self.weight = weight
        self._product = RowProduct(weight, plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x)


def lean_unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run the lean forward (None when it can)."""
    kinds = llama_like()
    if type(model) not in kinds or type(model.model) is not kinds[type(model)][0]:
        return f"{type(model).__name__} is not a plain LlamaForCausalLM or Qwen2ForCausalLM"
    config = model.config
    biased = kinds[type(model)][2]
    attn = model.model.layers[0].self_attn if len(model.model.layers) else None
    checks = {
        "attention_bias": (attn is None or (attn.q_proj.bias is not None) == biased and attn.o_proj.bias is None)
        and (biased or not getattr(config, "attention_bias", False)),
        "use_sliding_window": not getattr(config, "use_sliding_window", False),
        "mlp_bias": not getattr(config, "mlp_bias", False),
        "hidden_act": getattr(config, "hidden_act", None) == "silu",
        "pretraining_tp": getattr(config, "pretraining_tp", 1) in (None, 1),
        "_attn_implementation": getattr(config, "_attn_implementation", None) == "sdpa",
        "num_hidden_layers": len(model.model.layers) == config.num_hidden_layers,
    }
    bad = [name for name, ok in checks.items() if not ok]
    return f"its config's {', '.join(bad)} differ from what the lean forward runs" if bad else None


def _fuse_bias(linears: list[torch.nn.Linear]) -> torch.Tensor | None:
    """The biases of ``linears`` concatenated (sum out_i,), None where they have none."""
    if linears[0].bias is None:
        return None
    return torch.cat([linear.bias.detach() for linear in linears])


def _fuse(linears: list[torch.nn.Linear]) -> torch.Tensor:
    """Concatenate the weights of ``linears`` (out_i, in) into one (sum out_i, in); each becomes a view of it."""
    fused = torch.cat([linear.weight.detach() for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = torch.nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


def _placeholder(weight: torch.Tensor) -> torch.Tensor:
    """A tensor of ``weight``'s shape, dtype and device holding NaN in one element's memory."""
    return torch.full((), float("nan"), dtype=weight.dtype, device=weight.device).expand(weight.shape)


def _given_cache(past_key_values, kwargs: dict) -> tuple[object, dict]:
    """The cache of a forward call and its other keyword arguments: transformers 5.24 renamed ``past_key_values``
    to ``cache`` (``generate`` and this project's calls pass ``cache=`` there, ``bild_env.models.compat``; 5.0-5.23
    ``past_key_values=``), so either name is the cache.
    Both given: returned as they came (``_handles`` then refuses the call: ``cache`` stays among the others)."""
    if "cache" not in kwargs or (past_key_values is not None and kwargs["cache"] is not None):
        return past_key_values, kwargs
    rest = {k: v for k, v in kwargs.items() if k != "cache"}
    return (past_key_values if kwargs["cache"] is None else kwargs["cache"]), rest


class LeanLlamaModel(torch.nn.Module):
    """A ``LlamaModel`` with a lean forward for the plain and padded cases; every other call goes to ``base``."""

    def __init__(self, base: torch.nn.Module, packed: bool | None = None) -> None:
        super().__init__()
        self.base = base
        config = base.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        weights = []  # per layer: qkv, o, gate_up, down (out, in); the fused ones not registered (the originals view them)
        self._linears = []  # per layer, per weight: the modules whose weights are its rows (``release_originals``)
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights.append((_fuse([attn.q_proj, attn.k_proj, attn.v_proj]), attn.o_proj.weight,
                            _fuse([mlp.gate_proj, mlp.up_proj]), mlp.down_proj.weight))
            self._linears.append(([attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj],
                                  [mlp.down_proj]))
        self.qkv = [w[0] for w in weights]
        # Qwen2: the q, k and v biases, added after the fused product (None: Llama's layers have none)
        self.qkv_bias = [_fuse_bias([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
                         for layer in base.layers]
        self.weights = weights  # per layer (qkv, o, gate_up, down): what the products read (``set_plan`` remakes them)
        if packed is None:  # measured once per machine: the fastest way for each count of rows, and the copies they read
            self.plan = cached_plan(weights)
        else:  # as given: packed (where oneDNN can) or plain at every count
            self.plan = ("", "packed" if packed and can_pack(weights[0][0]) else "plain")
        self.products = [tuple(RowProduct(w, self.plan) for w in layer) for layer in weights]
        self.released = False  # the originals released (``release_originals``); made again on demand
        self.packed = self.plan[1] == "packed"  # one token at a time reads packed copies (the output layer follows)
        # per layer (input, post-attention), and the final norm; a tuple, so no module is registered twice
        self.norms = ([(rms_norm(layer.input_layernorm), rms_norm(layer.post_attention_layernorm))
                       for layer in base.layers], rms_norm(base.norm))
        self.padded = True  # run the padded case (a mask, position ids) too; False hands it to ``base`` (benchmarks)
        self.trimmed = True  # False: the norm modules and transformers' causal-LM forward (the untrimmed forward, kept for comparison)
        # evening (``scripts.analysis.draft_forward``'s "before the trims" variant); the same logits either way

    def release_originals(self) -> bool:
        """Free the layers' weights where every product reads a copy of its weight (``RowProduct.reads_weight``), so
        the model holds each weight once, not twice: where the plan reads a transposed copy the weights become its
        views (no memory, nothing to restore); where it reads packed copies only (oneDNN's layout: bfloat16 on an
        AVX512-BF16 core, where the packed copies made a lean smollm2 process 1,332 MB against the pair's 742 MB),
        they become placeholders of their shapes holding NaN, so that anything reading them by mistake gives NaN,
        never plausible numbers, and ``restore_originals`` makes them again from the copies before any forward the
        lean body does not run (``forward``'s other calls, ``set_plan``). Returns whether anything was released."""
        if self.released or any(p.reads_weight for layer in self.products for p in layer):
            return False
        views = all("transposed" in p.copies for layer in self.products for p in layer)
        self._place([tuple(p.original() if views else _placeholder(w) for p, w in zip(products, layer))
                     for products, layer in zip(self.products, self.weights)])
        self.released = not views
        return True

    def restore_originals(self) -> None:
        """Make the released weights again from the copies the products read (``RowProduct.original``: the very
        values), so that transformers' own layers compute with them; they stay (the memory with them)."""
        if self.released:
            self._place([tuple(p.original() for p in products) for products in self.products])
            self.released = False
            logger.info("lean forward: the layers' weights made again from their packed copies for a call the lean "
                        "body does not run")

    def _place(self, weights: list[tuple[torch.Tensor, ...]]) -> None:
        """``weights`` (per layer: qkv, o, gate_up, down) as the layers' weights, the fused ones' rows as views."""
        for i, (layer, linears) in enumerate(zip(weights, self._linears)):
            for w, modules in zip(layer, linears):
                start = 0
                for linear in modules:
                    rows = linear.weight.shape[0]
                    linear.weight = torch.nn.Parameter(w[start : start + rows], requires_grad=False)
                    start += rows
            self.weights[i] = layer
            self.qkv[i] = layer[0]

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base"], name)

    def _handles(self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, kwargs) -> bool:
        """Whether the lean forward runs this call: ``input_ids`` (B, n) with a ``DynamicCache``, no other option,
        and optionally a 2-D ``attention_mask`` (B, past + n) and ``position_ids`` (B or 1, n)."""
        from transformers import DynamicCache

        if not (input_ids is not None and inputs_embeds is None and type(past_key_values) is DynamicCache
                and not kwargs and input_ids.dim() == 2):
            return False
        if not self.padded and (attention_mask is not None or position_ids is not None):
            return False
        batch, n = input_ids.shape
        width = past_key_values.get_seq_length() + n
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            return False
        if attention_mask is not None and attention_mask.dim() == 4:  # a tree's: additive, as SDPA takes it
            if tuple(attention_mask.shape) != (batch, 1, n, width) or not attention_mask.is_floating_point():
                return False
        elif attention_mask is not None and (attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, width)):
            return False
        return position_ids is None or (isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2
                                        and position_ids.shape[0] in (1, batch) and position_ids.shape[1] == n)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                use_cache=None, **kwargs):
        cache, rest = _given_cache(past_key_values, kwargs)
        if not self._handles(input_ids, attention_mask, position_ids, cache, inputs_embeds, rest):
            self.restore_originals()
            passed = {} if past_key_values is None else {"past_key_values": past_key_values}
            return self.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             inputs_embeds=inputs_embeds, use_cache=use_cache, **passed, **kwargs)
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=self._lean(input_ids, cache, attention_mask, position_ids),
                                       **cache_kwarg(cache))

    def _lean(self, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states (B, n, hidden) after the final norm for ``input_ids`` (B, n); ``cache`` grows by n.

        ``attention_mask`` (B, past + n; nonzero: the column holds a token) and ``position_ids`` (B or 1, n)
        as transformers reads them (``_mask``); None: every column, positions past, ..., past + n - 1.
        """
        base = self.base
        batch, n = input_ids.shape
        heads, d = self.heads + self.kv_heads, self.head_dim  # q and k heads are rotated together
        past = cache.get_seq_length()
        x = base.embed_tokens(input_ids)
        positions = torch.arange(past, past + n, device=x.device).unsqueeze(0) if position_ids is None else position_ids
        cos, sin = base.rotary_emb(x, positions)  # (1 or B, n, d)
        # transformers' apply_rotary_pos_emb: t * cos + rotate_half(t) * sin, rotate_half(t) = [-t2, t1]; the same
        # products, exactly: t * cos + [t2, t1] * [-sin1, sin2]
        sin = torch.cat([-sin[..., : d // 2], sin[..., d // 2 :]], -1)
        cos, sin = cos[:, :, None], sin[:, :, None]  # (1 or B, n, 1, d): over (B, n, heads, d)
        causal, mask = self._mask(attention_mask, n, past, x.device)
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        # one new token with a mask: the query heads of each key/value head as its queries (transformers' pack_gqa,
        # as its masked sdpa call does), measured 2.5-4x faster than enable_gqa at B >= 8 on a Zen 5 core
        groups = self.heads // self.kv_heads
        pack = mask is not None and n == 1 and groups > 1
        norms, final_norm = self.norms if self.trimmed else (
            [(layer.input_layernorm, layer.post_attention_layernorm) for layer in base.layers], base.norm)
        for layer, (qkv, o, gate_up, down), (norm_1, norm_2), bias in zip(base.layers, self.products, norms,
                                                                            self.qkv_bias):
            attn = layer.self_attn
            h = qkv(norm_1(x))
            qk, v = (h if bias is None else h + bias).split([q_size + kv_size, kv_size], -1)
            qk = qk.view(batch, n, heads, d)
            qk = qk * cos + qk.view(batch, n, heads, 2, d // 2).flip(3).view(batch, n, heads, d) * sin
            q, k = qk[:, :, : self.heads].transpose(1, 2), qk[:, :, self.heads :].transpose(1, 2)
            k, v = cache.update(k, v.view(batch, n, self.kv_heads, d).transpose(1, 2), attn.layer_idx)
            if pack:  # queries (B, kv_heads, groups, d): query head h = kv head h // groups, as enable_gqa pairs them
                a = F.scaled_dot_product_attention(q.reshape(batch, self.kv_heads, groups, d), k, v, attn_mask=mask,
                                                   scale=attn.scaling).reshape(batch, self.heads, 1, d)
            else:
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=attn.scaling,
                                                   enable_gqa=self.heads != self.kv_heads)
            x = x + o(a.transpose(1, 2).reshape(batch, n, q_size))
            gate, up = gate_up(norm_2(x)).chunk(2, -1)
            x = x + down(F.silu(gate) * up)
        return final_norm(x)

    @staticmethod
    def _mask(attention_mask: torch.Tensor | None, n: int, past: int, device) -> tuple[bool, torch.Tensor | None]:
        """SDPA's ``is_causal`` and ``attn_mask`` for n new tokens after ``past`` cached columns.

        New token i (column past + i) sees column j iff ``attention_mask[b, j]`` and j <= past + i: transformers'
        sdpa mask (causal by column index, as its ``cache_position``, and the 2-D mask's nonzero columns). Without
        a mask, or with one that holds every column, the plain case's: none for one token, torch's causal flag on
        an empty cache, a causal mask offset by ``past`` otherwise. With holes, each token also sees its own
        column, so that no query sees nothing: that changes only queries at columns the mask marks empty (their
        outputs are read by nobody), and keeps their hidden states, keys and values finite where a query seeing
        no key at all could give NaN (SDPA kernels differ there; torch 2.13's CPU kernels give zeros), which would
        reach valid tokens' outputs through 0 * NaN in later products.
        """
        if attention_mask is not None and attention_mask.dim() == 4:  # given whole (a tree's): SDPA adds it
            return False, attention_mask.to(device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(device=device, dtype=torch.bool)
            if bool(attention_mask.all()):
                attention_mask = None
        if attention_mask is None:
            causal = n > 1 and past == 0
            return causal, None if n == 1 or causal else torch.ones(n, past + n, dtype=torch.bool, device=device).tril(past)
        columns = torch.arange(past + n, device=device)
        queries = torch.arange(past, past + n, device=device)[:, None]
        mask = (attention_mask[:, None, None, :] & (columns <= queries)) | (columns == queries)  # (B, 1, n, past + n)
        return False, mask


def _lean_causal_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                         inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    """``LlamaForCausalLM.forward`` for the calls the lean body runs, without its per-call work (decorators, the
    output's other fields): the same body, the same slice of hidden states, the same head. Any other call (labels,
    other options, a tensor ``logits_to_keep``, ``use_cache=False``, what ``LeanLlamaModel._handles`` refuses) goes
    to ``LlamaForCausalLM.forward`` untouched. Bound to a lean model's instance by ``make_lean``."""
    lean = self.model
    cache, rest = _given_cache(past_key_values, kwargs)
    if (not lean.trimmed or labels is not None or use_cache is False or type(logits_to_keep) is not int
            or not lean._handles(input_ids, attention_mask, position_ids, cache, inputs_embeds, rest)):
        passed = {} if past_key_values is None else {"past_key_values": past_key_values}
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                                  logits_to_keep=logits_to_keep, **passed, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    hidden = lean._lean(input_ids, cache, attention_mask, position_ids)
    logits = self.lm_head(hidden[:, -logits_to_keep:, :])  # transformers' slice_logits_to_keep for an int (0: all)
    return CausalLMOutputWithPast(logits=logits, **cache_kwarg(cache))


def set_plan(model: torch.nn.Module, plan: tuple[str, ...]) -> None:
    """Make a lean model's products, and its output layer's where it is a ``PackedLinear``, read their weights by
    ``plan`` (``row_plan``'s form; ``("", way)``: one way at every count): benchmarks compare plans side by side."""
    lean = model.model
    lean.restore_originals()  # the new products' copies are made from the weights
    lean.plan = plan
    lean.products = [tuple(RowProduct(w, plan) for w in layer) for layer in lean.weights]
    lean.packed = plan[1] == "packed"
    head = model.get_output_embeddings()
    if isinstance(head, PackedLinear):
        head._product = RowProduct(head.weight, plan)


def make_lean(model: torch.nn.Module, packed: bool | None = None) -> bool:
    """Give a ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` the lean forward in place; False where unsupported.

    Its inner ``model`` is wrapped in a ``LeanLlamaModel``, whose products read their weights the way measured fastest
    for each count of rows fed (``packed`` None: ``choose_ways``; True or False: packed or plain at every count);
    its output layer follows: an ``nn.Linear`` becomes a ``PackedLinear`` over the same weight with the layers'
    plan, a ``SubsetHead`` packs its rows where one row is packed. Call it after ``draft_head.restrict_head`` and after
    moving the model to its device (the products hold the weights they were made with).
    """
    if isinstance(getattr(model, "model", None), LeanLlamaModel):
        return True
    if lean_unsupported(model) is not None:
        return False
    model.model = LeanLlamaModel(model.model, packed)
    model.forward = types.MethodType(_lean_causal_forward, model)  # this instance only
    head = model.get_output_embeddings()
    plan = model.model.plan
    if model.model.packed and callable(getattr(head, "pack", None)):  # draft_head.SubsetHead packs its rows
        head.pack()
    elif plan != ("", "plain") and type(head) is torch.nn.Linear and head.bias is None:
        model.set_output_embeddings(PackedLinear(head.weight, plan))  # the head reads its weight as the layers do
    released = model.model.release_originals()
    logger.info("lean forward for %s (%d layers), products by rows fed: %s%s", type(model).__name__,
                len(model.model.base.layers), describe_plan(model.model.plan),
                "; the layers' weights held once, as their copies" if released else "")
    return True
