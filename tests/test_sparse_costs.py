"""Sparse cost tables: fed counts timed only where the curve bends, the others read off the lines between them.

Synthetic timings (a function of the cell) stand in for the clock, so what is checked is which cells are timed and
what the tables say between them, never which of two near-equal times wins.
"""

from __future__ import annotations

import json
import logging

import pytest

from bild_env.decoding import calibration, costs
from bild_env.decoding.batch_costs import BatchCost, fill_sparse, fit_batched, fit_table
from bild_env.decoding.costs import CostModel, ForwardCost
from bild_env.decoding.forward_costs import COARSE_FED, STEP_FED, sparse_points


def timer(curve, log):
    """``time_cells`` for ``sparse_points``: each cell's ms from ``curve(row, fed)``, every call logged."""
    def time_cells(cells):
        log.append(list(cells))
        return {cell: curve(*cell) for cell in cells}
    return time_cells


def test_a_flat_curve_is_timed_at_the_coarse_counts_and_one_midpoint_per_gap():
    log = []
    points = sparse_points(timer(lambda row, f: 40.0 if f == 1 else 60.0 + 0.5 * f, log), ["target"])
    assert sorted(f for _, f in points) == [1, 2, 3, 4, 6, 8, 10, 12]  # 8 of 12: COARSE_FED and 3, 6, 10
    assert [sorted(f for _, f in call) for call in log] == [list(COARSE_FED), [3, 6, 10]]


def test_a_bend_is_bisected_until_the_line_holds():
    log = []
    step = lambda row, f: 50.0 if f <= 5 else 90.0  # a jump between 5 and 6: the gap 4..8 bends
    points = sparse_points(timer(step, log), ["target"])
    timed = sorted(f for _, f in points)
    assert {5, 6, 7} <= set(timed) and 9 not in timed and 11 not in timed  # 8..12 is flat: 10 closed it
    table = ForwardCost(tuple(timed), tuple(points["target", f] for f in timed))
    assert all(table(f, 0) == step("target", f) for f in STEP_FED)  # the step is exact where it was found


def test_every_row_is_refined_on_its_own():
    log = []
    curve = lambda b, f: b * (10.0 + f) if b == 1 else b * (10.0 + (f if f < 6 else 3 * f))
    points = sparse_points(timer(curve, log), [1, 8])
    assert {f for b, f in points if b == 1} == {1, 2, 3, 4, 6, 8, 10, 12}
    assert {5, 7} <= {f for b, f in points if b == 8}


@pytest.mark.parametrize("curve", [lambda f: 40.0 + 2.0 * f, lambda f: 47.0 if f == 1 else 78.0 + 3 * f ** 0.5,
                                   lambda f: [47, 80, 86, 88, 95, 96, 97, 99, 100, 101, 103, 104][f - 1]])
def test_a_sparse_table_equals_the_timed_values_and_is_monotone_where_they_are(curve):
    points = sparse_points(lambda cells: {c: float(curve(c[1])) for c in cells}, [None])
    fed = sorted(f for _, f in points)
    table = ForwardCost(tuple(fed), tuple(points[None, f] for f in fed), per_context_ms=0.01, ref_context=96)
    assert [table(f, 96) for f in fed] == [curve(f) for f in fed]  # exact at the timed points
    values = [table(f, 96) for f in STEP_FED]
    for a, b in zip(fed, fed[1:]):  # between two timed points: between their values, and monotone
        seg = values[a - 1 : b]
        assert min(curve(a), curve(b)) - 1e-9 <= min(seg) and max(seg) <= max(curve(a), curve(b)) + 1e-9
        assert seg == sorted(seg) or seg == sorted(seg, reverse=True)


def test_fill_sparse_keeps_timed_cells_and_reads_the_others_off_the_lines():
    timed = {(1, 1): 10.0, (1, 4): 16.0, (2, 1): 12.0, (2, 2): 20.0, (2, 4): 22.0}
    out = fill_sparse(timed, (1, 2), (1, 2, 3, 4))
    assert all(out[cell] == ms for cell, ms in timed.items())
    assert out[1, 2] == pytest.approx(12.0) and out[1, 3] == pytest.approx(14.0) and out[2, 3] == pytest.approx(21.0)


def test_prefills_beyond_the_timed_batches_never_fall_nor_more_than_scale():
    noisy = {(1, 64): 100.0, (2, 64): 300.0, (4, 64): 290.0}  # noise: 4 sequences timed below 2
    out = fill_sparse(noisy, (1, 2, 4, 8, 32), (), along_batch=True)
    assert out[8, 64] == pytest.approx(290.0) and out[32, 64] == pytest.approx(290.0)  # not below the largest timed
    steep = {(1, 64): 10.0, (2, 64): 100.0}
    assert fill_sparse(steep, (1, 2, 8), (), along_batch=True)[8, 64] == pytest.approx(400.0)  # at most scaled by 8/2


def test_fit_batched_fills_a_sparse_grid_and_reproduces_its_timed_cells():
    ms = lambda b, f, c: 5.0 + b * f + 0.01 * b * c
    steps = [(b, f, 96, ms(b, f, 96)) for b in (1, 2, 4) for f in (1, 2, 4, 8, 12)]
    steps += [(b, f, c, ms(b, f, c)) for b in (1, 2, 4) for f in (1, 4) for c in (32, 160)]
    fills = [(b, 16, 0, 10.0 * b) for b in (1, 2)]
    table = fit_batched(steps, fills, fed=STEP_FED)
    assert table.ref_context == 96 and table.per_context_ms == pytest.approx(0.01)
    assert table.fed == STEP_FED + (16,) and table.batch == (1, 2, 4)
    for b, f, c, m in steps:
        assert table(b, f, c) == pytest.approx(m)
    assert table(4, 16, 0) == pytest.approx(40.0)  # a prefill of 4 read off the line through 1 and 2


def test_calibrate_batched_times_fewer_cells_sparse_and_agrees_with_full_on_a_straight_curve(tiny_pair, monkeypatch):
    """The clock replaced by a formula linear in the tokens (a forward bound by its arithmetic): the sparse tables
    time a fraction of the cells and predict every cell of the full table."""
    timed = []

    def fake_grid(model, cells, device, repeats, progress=None, stats=None, max_wait_s=None, masked=False):
        timed.extend(cells)
        return [(b, f, c, 2.0 + 0.5 * b * f + 0.001 * b * c) for b, f, c in cells]

    monkeypatch.setattr(calibration, "time_batched_grid", fake_grid)
    tables = {}
    for sampling in ("full", "sparse"):
        timed.clear()
        tables[sampling] = costs.calibrate_batched(tiny_pair, (1, 2, 4, 8, 16, 32), repeats=1, progress=False,
                                                   sampling=sampling)
        tables[sampling + " cells"] = len(timed)
        tables[sampling + " tokens"] = sum(b * f for b, f, _ in timed)  # what the forwards cost, roughly
    assert tables["sparse cells"] < 0.6 * tables["full cells"] and tables["sparse tokens"] < 0.35 * tables["full tokens"]
    full, sparse = tables["full"]["target"], tables["sparse"]["target"]
    for b in full.batch:
        for f in full.fed:
            for c in ((0,) if f > 12 else (32, 96, 160)):
                assert sparse(b, f, c) == pytest.approx(full(b, f, c), rel=1e-6)


def test_calibrate_sparse_single_tables_hold_the_timed_counts_only(tiny_pair, monkeypatch):
    monkeypatch.setattr(calibration, "time_batched_grid", lambda model, cells, *a, **k: [
        (b, f, c, 30.0 + f + 0.01 * c) for b, f, c in cells])
    model = costs.calibrate(tiny_pair, repeats=1, progress=False, loop=False)
    assert model.target.fed == (1, 2, 3, 4, 6, 8, 10, 12, 16, 32, 64) and model.target.ref_context == 96
    assert model.target.per_context_ms == pytest.approx(0.01)
    assert model.target(5, 96) == pytest.approx(35.96)  # read off the line from 4 to 6 (30 + 5 + 0.01 * 96)


@pytest.fixture
def private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("BILD_ENV_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "_LOADED", {})
    return tmp_path


def test_a_full_table_stored_the_old_way_is_loaded_as_it_is(tiny_pair, private_cache, monkeypatch):
    """Tables stored before sparse sampling (every fed count, no "sampling" field) are read, not timed again."""
    full = ForwardCost(STEP_FED, tuple(40.0 + f for f in STEP_FED), 0.01, 96)
    old = CostModel(full, full, costs.device_name(tiny_pair.device), "old machine")
    costs.cost_path(tiny_pair).write_text(json.dumps(old.to_dict() | {"boot": costs._boot_id()}))
    monkeypatch.setattr(costs, "calibrate", lambda pair, **_: pytest.fail("a stored full table was timed again"))
    assert costs.load_or_calibrate(tiny_pair) == old
    batched = BatchCost.from_table({(b, f): 10.0 * b + f for b in (1, 2) for f in STEP_FED}, 0.001, 96)
    base_key = costs.digest(json.dumps(old.to_dict(), sort_keys=True))
    path = costs.batched_path(tiny_pair, (1, 2))
    path.write_text(json.dumps({"format": costs.FORMAT, "base": base_key, "layout": costs.BATCHED_LAYOUT,
                                "device": old.device, "machine": old.machine, "boot": costs._boot_id(),
                                "batch_sizes": [1, 2], "draft": batched.to_dict(), "target": batched.to_dict()}))
    monkeypatch.setattr(costs, "calibrate_batched", lambda *a, **k: pytest.fail("stored full tables timed again"))
    assert costs.load_or_calibrate_batched(tiny_pair, (1, 2)).batched == {"draft": batched, "target": batched}


def test_new_tables_say_they_are_sparse_and_unknown_samplings_are_refused(tiny_pair, private_cache, monkeypatch, caplog):
    monkeypatch.setattr(calibration, "time_batched_grid", lambda model, cells, *a, **k: [
        (b, f, c, 30.0 + f) for b, f, c in cells])
    monkeypatch.setattr(calibration, "calibrate_loop", lambda pair, model, **_: (costs.LoopCost(), {}))
    with caplog.at_level(logging.INFO):
        costs.load_or_calibrate(tiny_pair)
    assert json.loads(costs.cost_path(tiny_pair).read_text())["sampling"] == "sparse"
    with pytest.raises(ValueError, match="sampling"):
        costs.calibrate(tiny_pair, loop=False, progress=False, sampling="dense")


def test_fit_table_keeps_a_sparse_table_at_the_contexts_mean():
    rows = [(f, 96, 40.0 + f) for f in (1, 2, 4, 8, 12)] + [(f, c, 40.0 + f + 0.02 * (c - 96))
                                                             for f in (1, 4, 12) for c in (32, 160)]
    table = fit_table(rows)
    assert table.ref_context == 96 and table.per_context_ms == pytest.approx(0.02)
    assert table.fed == (1, 2, 4, 8, 12) and table(6, 96) == pytest.approx(46.0)
