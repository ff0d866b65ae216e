"""The cache keyword: chosen once for the installed transformers, and no forward of the decoders warns.

transformers 5.24 renamed the forwards' ``past_key_values`` keyword (and the outputs' field) to ``cache``
and warns at every call that uses the old name; 5.0-5.23 take only ``past_key_values``
(``bild_env.models.compat``). The decoders run on the OPT tiny pair (transformers' own forwards) and on a
Llama-shaped pair made lean (``bild_env.models.lean``: its own forward, and transformers' for what it refuses).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import warnings
from dataclasses import replace

import pytest
import torch

from bild_env import generate_bild, generate_speculative, generate_target_only
from bild_env.models.compat import CACHE_KEYWORD, cache_keyword, cache_kwarg, output_cache
from bild_env.models.lean import make_lean
from tests.batched_helpers import generate_batched_bild, generate_batched_speculative
from tests.test_batched_decoding import llama_pair  # noqa: F401 (the fixture)
from tests.test_batched_decoding import random_prompt


@pytest.mark.parametrize("version, keyword", [
    ("4.57.6", "past_key_values"),
    ("5.0.0", "past_key_values"),
    ("5.23.1", "past_key_values"),
    ("5.24.0.dev0", "cache"),
    ("5.24.0", "cache"),
    ("5.40.0", "cache"),
    ("6.0.0rc1", "cache"),
])
def test_the_cache_keyword_of_a_version(version, keyword):
    assert cache_keyword(version) == keyword


def test_the_chosen_keyword_is_the_installed_transformers_own():
    """The keyword read from the version is the one the forwards' signatures name and the outputs' field."""
    from transformers import LlamaForCausalLM, OPTForCausalLM
    from transformers.modeling_outputs import CausalLMOutputWithPast

    for cls in (LlamaForCausalLM, OPTForCausalLM):
        assert CACHE_KEYWORD in inspect.signature(cls.forward).parameters, cls.__name__
    assert CACHE_KEYWORD in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
    assert output_cache(CausalLMOutputWithPast(**cache_kwarg("the cache"))) == "the cache"


@pytest.fixture
def cache_warnings(monkeypatch):
    """Every warning about the old cache names while the test runs: ``FutureWarning``s (a deprecated keyword,
    5.24 on) and transformers' logged once-per-process notice (an output's ``past_key_values`` read)."""
    from transformers.utils import generic

    logged = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda message, *a, **k: logged.append(str(message)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield logged, caught


def _old_name_warnings(cache_warnings) -> list[str]:
    logged, caught = cache_warnings
    return [m for m in logged + [str(w.message) for w in caught] if "past_key_values" in m or "cache_params" in m]


def _decode_everything(pair) -> None:
    """Every decoder once on two short prompts: target-only, speculative, BiLD, and both batched ones."""
    prompts = [random_prompt(1, 7), random_prompt(2, 3)]
    generate_target_only(pair, prompts[0], 8)
    generate_speculative(pair, prompts[0], 3, 8)
    generate_bild(pair, prompts[0], 0.3, 0.5, 4, 8)
    generate_batched_speculative(pair, prompts, 3, 8)
    generate_batched_bild(pair, prompts, 0.3, 0.5, 4, 8)


def test_no_decoder_forward_warns_about_the_cache_keyword_on_the_tiny_pair(tiny_pair, cache_warnings):
    _decode_everything(tiny_pair)
    tiny_pair.target.generate(torch.tensor([random_prompt(3, 5)]), max_new_tokens=4, do_sample=False)
    assert _old_name_warnings(cache_warnings) == []


def test_no_decoder_forward_warns_about_the_cache_keyword_on_a_lean_pair(llama_pair, cache_warnings):  # noqa: F811
    pair = replace(llama_pair, draft=copy.deepcopy(llama_pair.draft), target=copy.deepcopy(llama_pair.target))
    assert make_lean(pair.draft, False) and make_lean(pair.target, False)
    _decode_everything(pair)
    pair.target.generate(torch.tensor([random_prompt(3, 5)]), max_new_tokens=4, do_sample=False)  # passes ``cache=``
    assert _old_name_warnings(cache_warnings) == []
