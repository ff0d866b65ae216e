"""The lean forward's products, each reading its weight the way measured fastest for the rows it is fed (issue:
speculation that pays on float32 CPUs). Only what each way computes and which way runs are asserted; which way is
faster is the machine's and never asserted."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from bild_env.models import lean, products
from bild_env.models.compat import cache_kwarg
from tests.test_draft_forward import prompt, tiny_llama


@pytest.mark.parametrize("way", products.WAYS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_way_computes_the_linear_product(way, dtype):
    if way == "packed" and not products.can_pack(torch.zeros(2, 2, dtype=dtype)):
        pytest.skip("oneDNN cannot pack here")
    w = torch.randn(96, 40, dtype=dtype)
    f = products.way_product(w, way)
    for shape in [(1, 1, 40), (1, 3, 40), (4, 2, 40), (5, 40)]:
        x = torch.randn(*shape, dtype=dtype)
        got = f(x)
        assert got.shape == (*shape[:-1], 96) and got.is_contiguous()  # views downstream (split, view) need it
        tol = 1e-5 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(got.float(), F.linear(x, w).float(), atol=tol, rtol=tol)


def test_a_plan_picks_the_way_chosen_at_the_next_timed_count_and_the_largest_beyond():
    plan = products.row_plan({1: "packed", 2: "weight_left", 4: "weight_left", 8: "transposed", 32: "plain"})
    assert plan[1:] == ("packed", "weight_left", "weight_left", "weight_left") + ("transposed",) * 4 + ("plain",) * 24
    assert products.describe_plan(plan) == "1 packed, 2-4 weight_left, 5-8 transposed, 9-32 plain rows (and beyond)"


def test_a_row_product_runs_the_planned_way_and_copies_only_what_its_ways_read(monkeypatch):
    made, ran = [], []
    real_copy, real_product = products.weight_copy, products.way_product
    monkeypatch.setattr(products, "weight_copy", lambda w, way: made.append(way) or real_copy(w, way))

    def way_product(w, way, copy=None):
        f = real_product(w, way, copy)
        return lambda x: ran.append(way) or f(x)

    monkeypatch.setattr(products, "way_product", way_product)
    w = torch.randn(16, 8)
    product = products.RowProduct(w, ("", "plain", "weight_left", "weight_left", "transposed"))
    assert made == ["transposed"]  # plain and weight_left read w itself
    for rows, way in ((1, "plain"), (2, "weight_left"), (3, "weight_left"), (4, "transposed"), (40, "transposed")):
        x = torch.randn(1, rows, 8)
        torch.testing.assert_close(product(x), F.linear(x, w), atol=1e-5, rtol=1e-5)
        assert ran[-1] == way


def test_choose_ways_names_a_way_for_every_count():
    layers = [tuple(torch.randn(32, 16) for _ in range(4)) for _ in range(4)]
    chosen = products.choose_ways(layers, rows=(1, 2, 5), rounds=1)
    assert set(chosen) == {1, 2, 5} and set(chosen.values()) <= set(products.WAYS)
    assert set(products.choose_ways(layers, rows=(1, 3), rounds=1, ways=("plain", "weight_left")).values()) <= {
        "plain", "weight_left"}


def test_choose_ways_times_again_a_count_where_two_passes_disagree(monkeypatch):
    """A busy CPU slows one way's rounds in one pass: where the two passes pick different ways the count is timed
    again, longer, and that timing decides; where they agree, no third timing."""
    passes = iter([{(1, "plain"): [1.0], (1, "packed"): [2.0], (6, "plain"): [1.0], (6, "packed"): [2.0]},
                   {(1, "plain"): [1.0], (1, "packed"): [2.0], (6, "plain"): [3.0], (6, "packed"): [2.0]},
                   {(6, "plain"): [3.0], (6, "packed"): [2.0]}])
    calls = []

    def fake_time_ways(weights, rows, rounds, ways):
        calls.append((tuple(rows), rounds))
        return next(passes)

    monkeypatch.setattr(products, "time_ways", fake_time_ways)
    layers = [tuple(torch.randn(4, 4) for _ in range(2))]
    assert products.choose_ways(layers, rows=(1, 6), rounds=5, ways=("plain", "packed")) == {1: "plain", 6: "packed"}
    assert calls == [((1, 6), 5), ((1, 6), 5), ((6,), 15)]


@pytest.mark.parametrize("plan", [("", "weight_left"), ("", "transposed", "weight_left", "weight_left", "plain"), None])
def test_the_lean_forward_matches_transformers_whatever_the_products_plan(plan, monkeypatch, tmp_path):
    """Prefill, one-token steps and multi-token verifications give transformers' logits (float32, within float
    rounding as the lean forward's other tests allow) and its argmax, with any plan; None: the plan measured here."""
    from transformers import DynamicCache

    monkeypatch.setenv("BILD_ENV_CACHE", str(tmp_path))  # no plan stored by another case (products.cached_plan)

    if plan is not None:
        monkeypatch.setattr(products, "choose_ways", lambda layers, **kw: {i: plan[min(i, len(plan) - 1)]
                                                                       for i in products.ROWS})
    base = tiny_llama(3)
    fast = copy.deepcopy(base)
    assert lean.make_lean(fast)
    assert set(fast.model.plan[1:]) <= set(products.WAYS)
    caches = [DynamicCache(config=base.config), DynamicCache(config=base.config)]
    with torch.inference_mode():
        for feed in (prompt(0, 20), [7], [8, 9], [10, 11, 12, 13], [14]):
            ids = torch.tensor([feed])
            want = base(ids, **cache_kwarg(caches[0]), use_cache=True).logits
            got = fast(ids, **cache_kwarg(caches[1]), use_cache=True).logits
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
            assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_form_of_the_weights_is_held_only_where_it_saves_five_percent_somewhere():
    """The float32 timings of a Zen 5 core under the AVX2 emulation (ms, scripts.analysis.products): the transposed copy, fastest
    at 6 and 16 rows by under 4%, is not held; the packed copy (25% at 1 row) and the weights (weight_left, 35-45% at
    2-4 rows) are. A bfloat16-like table where plain wins one count by 2% reads packed copies only."""
    f32 = {1: {"plain": 26.3, "packed": 19.8, "transposed": 20.9, "weight_left": 26.5},
           2: {"plain": 43.8, "packed": 37.3, "transposed": 30.7, "weight_left": 23.0},
           6: {"plain": 44.5, "packed": 44.3, "transposed": 42.6, "weight_left": 44.2},
           16: {"plain": 61.6, "packed": 62.9, "transposed": 59.7, "weight_left": 68.5},
           32: {"plain": 95.1, "packed": 89.3, "transposed": 92.8, "weight_left": 101.7}}
    least = {(r, w): t for r, ways in f32.items() for w, t in ways.items()}
    rows = tuple(f32)
    assert {r: min(f32[r], key=f32[r].get) for r in rows}[6] == "transposed"  # the fastest alone
    assert products.held_once(least, rows) == {1: "packed", 2: "weight_left", 6: "weight_left", 16: "plain", 32: "packed"}
    assert products.held_once(least, rows, gain=0.0)[6] == "transposed"  # no margin: the fastest everywhere
    bf16 = {(r, "packed"): 10.0 for r in rows} | {(r, "plain"): 15.0 for r in rows} | {(32, "plain"): 9.8}
    assert set(products.held_once(bf16, rows).values()) == {"packed"}


def test_no_more_forms_of_the_weights_are_held_than_the_memory_affords(monkeypatch):
    """The same float32 table: with room for one form, one is held (the one whose loss costs least); a model whose
    layers take more than an eighth of the memory gets one form, a small one three."""
    f32 = {1: {"plain": 26.3, "packed": 19.8, "transposed": 20.9, "weight_left": 26.5},
           2: {"plain": 43.8, "packed": 37.3, "transposed": 30.7, "weight_left": 23.0},
           32: {"plain": 95.1, "packed": 89.3, "transposed": 92.8, "weight_left": 101.7}}
    least = {(r, w): t for r, ways in f32.items() for w, t in ways.items()}
    rows = tuple(f32)
    assert len({products.FORMS[w] for w in products.held_once(least, rows).values()}) == 2
    one = products.held_once(least, rows, max_forms=1)
    assert one == {1: "plain", 2: "weight_left", 32: "plain"}  # the packed copy saved least where it was chosen
    monkeypatch.setattr(products.os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 6 << 20}[name])
    assert products.forms_affordable(4 << 30) == 1 and products.forms_affordable(1 << 30) == 3  # 24 GiB of memory
    assert products.forms_affordable(1536 << 20) == 2
