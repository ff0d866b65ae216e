"""Prompt domains and the mixed workload, on the tiny-random pair's tokenizer (no model runs)."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from bild_env.prompts import chat as chat_module
from bild_env.prompts.chat import FALLBACK_TEMPLATE, instruction_texts, render_chat
from bild_env.prompts.code import definitions, humaneval_problems, stdlib_files, stdlib_snippets
from bild_env.prompts.domains import DOMAINS, Workload, load_domain, parse_mix
from bild_env.prompts.splits import SPLITS, hash_split, read_splits
from bild_env.prompts.wiki import WIKI_FILE


@pytest.fixture(scope="module")
def tok(tiny_pair):
    return tiny_pair.tokenizer


def _disjoint(groups: dict[str, set]) -> None:
    names = list(groups)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not groups[a] & groups[b], f"{a} and {b} share {sorted(groups[a] & groups[b])[:3]}"


def test_source_texts_are_in_one_split_each():
    _disjoint({s: {p["task_id"] for p in humaneval_problems(s)} for s in SPLITS})
    _disjoint({s: set(stdlib_files(s)) for s in SPLITS})
    _disjoint({s: {" ".join(t.casefold().split()) for t in instruction_texts(s)} for s in SPLITS})
    _disjoint({s: {a["title"] for a in read_splits(WIKI_FILE)[s]} for s in SPLITS})
    assert [len(humaneval_problems(s)) for s in SPLITS] == [135, 13, 16]
    assert sum(len(instruction_texts(s)) for s in SPLITS) == 888


@pytest.mark.parametrize("domain", DOMAINS)
def test_validation_and_test_prompts_are_disjoint(tok, domain):
    val, test = (load_domain(tok, domain, s) for s in ("validation", "test"))
    assert val and test
    _disjoint({"validation": set(map(tuple, val)), "test": set(map(tuple, test))})


@pytest.mark.parametrize("domain", ["code", "chat"])
def test_train_prompts_are_disjoint_from_the_others(tok, domain):
    groups = {s: set(map(tuple, load_domain(tok, domain, s))) for s in SPLITS}
    _disjoint(groups)


def test_stdlib_code_is_split_by_file():
    for split in SPLITS:
        assert all(hash_split(f) == split for f in stdlib_files(split))
        assert list(stdlib_files(split)) == sorted(stdlib_files(split))
    snippets = stdlib_snippets("validation")
    assert snippets and all(s.startswith(("def ", "class ", "async ")) for s in snippets[:50])
    assert definitions("x = 1\ndef f():\n    return 1\n\nclass A:\n    pass\n") == [
        "def f():\n    return 1", "class A:\n    pass"]


@pytest.mark.parametrize("domain", DOMAINS)
def test_a_limit_gives_the_first_prompts_and_a_second_load_the_same(tok, domain):
    few = load_domain(tok, domain, "validation", limit=5)  # built (uncached: a limit builds only those)
    full = load_domain(tok, domain, "validation")  # built, then stored
    again = load_domain(tok, domain, "validation")  # read back from the cache
    assert few == full[:5] and full == again
    assert all(isinstance(t, int) for p in again for t in p)


def test_same_prompts_in_a_fresh_process(tok, tmp_path):
    """Nothing depends on hash seeds, dict order or the cache: a new process builds the same lists."""
    code = (
        "import json; from transformers import AutoTokenizer; from bild_env.models.tiny import TOKENIZER_DIR; "
        "from bild_env.prompts.domains import load_domain; t = AutoTokenizer.from_pretrained(TOKENIZER_DIR); "
        "print(json.dumps({d: load_domain(t, d, 'validation', limit=10) for d in ('prose', 'code', 'chat', 'long')}))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345", BILD_ENV_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    here = {d: load_domain(tok, d, "validation", limit=10) for d in ("prose", "code", "chat", "long")}
    assert json.loads(out.strip().splitlines()[-1]) == here


def test_known_first_prompts(tok):
    """The committed data and split: the first validation prompts are these texts on any machine."""
    assert tok.decode(load_domain(tok, "prose", "validation", limit=1)[0]).startswith("The 1970 Bhola cyclone")
    assert tok.decode(load_domain(tok, "code", "validation", limit=1)[0]).startswith(
        "from typing import List\n\n\ndef all_prefixes(")


def test_lengths(tok):
    for domain in ("prose", "code"):
        for p in load_domain(tok, domain, "validation", prompt_tokens=8):
            assert 4 <= len(p) <= 8
    for p in load_domain(tok, "long", "validation"):
        assert 256 <= len(p) <= 512
    short = load_domain(tok, "long", "validation", long_min_tokens=64, long_max_tokens=96)
    assert short and all(64 <= len(p) <= 96 for p in short)
    code_only = load_domain(tok, "long", "validation", long_sources=("code",))
    assert tok.decode(code_only[0]).startswith("from typing import List")


def test_chat_fallback_rendering_and_cut(tok, caplog):
    assert not tok.chat_template  # the GPT-2 tokenizer of tiny-random has none
    chat_module._warned.clear()
    text = "Tell me a joke about a cat who learns to play the piano in the evening after dinner."
    with caplog.at_level(logging.WARNING, logger=chat_module.__name__):
        ids = render_chat(tok, text)
        render_chat(tok, text)
    assert tok.decode(ids) == FALLBACK_TEMPLATE.format(text=text)
    assert sum("no chat template" in r.getMessage() for r in caplog.records) == 1  # logged once
    for p, full in zip(load_domain(tok, "chat", "validation", prompt_tokens=6), instruction_texts("validation")):
        decoded = tok.decode(p)
        assert decoded.startswith("User: ") and decoded.endswith("\nAssistant:")
        request = decoded[len("User: "):-len("\nAssistant:")]
        assert full.startswith(request) and len(tok(request)["input_ids"]) <= 6


def test_chat_template_renders_the_cut_request(tok):
    templated = copy.deepcopy(tok)
    templated.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    prompts = load_domain(templated, "chat", "validation", limit=20, prompt_tokens=5)
    for p, full in zip(prompts, instruction_texts("validation")):
        decoded = templated.decode(p)
        assert decoded.startswith("<|user|>\n") and decoded.endswith("\n<|assistant|>\n")  # the template is whole
        request = decoded[len("<|user|>\n"):-len("\n<|assistant|>\n")]
        assert full.startswith(request) and len(templated(request)["input_ids"]) <= 5


def test_parse_mix():
    assert parse_mix("prose:1,code:1,chat:1") == pytest.approx({"prose": 1 / 3, "code": 1 / 3, "chat": 1 / 3})
    assert parse_mix({"long": 1, "prose": 3}) == {"prose": 0.75, "long": 0.25}
    assert list(parse_mix({"long": 1, "prose": 3})) == ["prose", "long"]  # DOMAINS order
    assert parse_mix(" prose : 2 , code ") == pytest.approx({"prose": 2 / 3, "code": 1 / 3})
    assert parse_mix("prose:1,code:0") == {"prose": 1.0}


@pytest.mark.parametrize("spec, words", [
    ("", "empty"), ({}, "empty"), ("prose:-1", "-1"), ("prose:nan", "nan"), ({"code": math.inf}, "inf"),
    ("prose:0,code:0", "every weight is 0"), ("poetry:1", "unknown domain 'poetry'"),
    ("prose:1,prose:2", "twice"), ("prose:abc", "not a number"), ({"prose": True}, "not a number"),
    (3, "string or a mapping"),
])
def test_parse_mix_refusals(spec, words):
    with pytest.raises(ValueError, match="mix") as err:
        parse_mix(spec)
    assert words in str(err.value) and "prose:1,code:1,chat:1" in str(err.value)


def test_bad_names_are_refused(tok):
    with pytest.raises(ValueError, match="valid domains"):
        load_domain(tok, "poetry", "train")
    with pytest.raises(ValueError, match="valid splits"):
        load_domain(tok, "code", "dev")
    with pytest.raises(ValueError, match="valid options"):
        load_domain(tok, "code", "train", prompt_token=8)
    with pytest.raises(ValueError, match="code_source"):
        load_domain(tok, "code", "train", code_source="github")
    with pytest.raises(ValueError, match="long_min_tokens"):
        load_domain(tok, "long", "train", long_min_tokens=600)


def test_workload_draws_by_weight(tok):
    work = Workload(tok, "prose:3,code:1,chat:0", "validation", limit_per_domain=10)
    assert work.domains == ("prose", "code") and work.sizes == {"prose": 10, "code": 10}
    rng = np.random.default_rng(0)
    draws = [work.draw(rng) for _ in range(4000)]
    share = sum(d == "prose" for d, _, _ in draws) / len(draws)
    assert abs(share - 0.75) < 0.03
    for domain, index, ids in draws[:50]:
        assert ids == work.prompts[domain][index]
    indices = [i for d, i, _ in draws if d == "code"]
    assert set(indices) == set(range(10))  # uniform over the domain's prompts
    again = Workload(tok, {"prose": 3, "code": 1}, "validation", limit_per_domain=10)
    rng = np.random.default_rng(0)
    assert [again.draw(rng)[:2] for _ in range(100)] == [d[:2] for d in draws[:100]]
    rng = np.random.default_rng(0)  # an episode's own weights replace the mix's for a draw
    episode = [work.draw(rng, [0.2, 0.8]) for _ in range(4000)]
    assert abs(sum(d == "prose" for d, _, _ in episode) / len(episode) - 0.2) < 0.03


def test_workload_names_a_weighted_domain_without_prompts(tok):
    with pytest.raises(ValueError, match="domain 'code' has weight 0.5"):
        Workload(tok, "chat:1,code:1", "validation", limit_per_domain=5, prompt_tokens=5000, min_prompt_tokens=5000)
