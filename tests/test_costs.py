"""The latency cost model: linear special case, measured and batched tables, persistence, the machine key and
its quick check, one calibration per machine across processes, calibration on the tiny pair.

Timings are never compared with each other here (which of two near-equal times wins is noise): measured
tables are checked for shape and for positive finite numbers; what costs more is bench.forwards' to report.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bild_env.decoding import calibration, costs, timing
from bild_env.decoding.costs import BatchCost, CostModel, ForwardCost, calibrate, load_or_calibrate
from bild_env.models import device as dev_mod


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch):
    """Time without waiting for other processes to leave the CPU (what is timed here is never judged by speed)."""
    monkeypatch.setattr(timing, "MAX_WAIT_S", 0.0)
    monkeypatch.setattr(calibration, "CHECK_MAX_WAIT_S", 0.0)


LINEAR = CostModel(draft=(1.0, 0.1, 0.001), target=(4.0, 0.5, 0.004), device="test")
TABLE = ForwardCost(fed=(1, 2, 3, 4, 8, 12, 16, 32), ms=(40.5, 66.0, 80.8, 62.2, 58.7, 70.0, 90.0, 150.0),
                    per_context_ms=0.02, ref_context=64)


def test_a_linear_model_is_exactly_a_plus_b_fed_plus_c_context():
    for fed in range(1, 70):
        for context in (0, 1, 7, 64, 333):
            assert LINEAR.ms("draft", fed, context) == 1.0 + 0.1 * fed + 0.001 * context
            assert LINEAR.ms("target", fed, context) == 4.0 + 0.5 * fed + 0.004 * context
    assert LINEAR == CostModel(draft=ForwardCost.linear(1.0, 0.1, 0.001), target=ForwardCost.linear(4.0, 0.5, 0.004),
                               device="test")
    assert LINEAR.target.line == (4.0, 0.5) and LINEAR.target.per_context_ms == 0.004
    assert LINEAR.batch_costs("draft") == (1.0, 0.1) and LINEAR.batch_costs("target") == (4.0, 0.5)
    with pytest.raises(ValueError, match="role"):
        LINEAR.ms("drafter", 1, 0)


def test_a_table_reproduces_its_points_and_interpolates_between_them():
    model = CostModel(draft=TABLE, target=TABLE, device="test")
    for fed, ms in zip(TABLE.fed, TABLE.ms):
        assert model.ms("target", fed, 64) == ms  # exactly, at the reference context
        assert model.ms("target", fed, 164) == pytest.approx(ms + 100 * 0.02)
        assert model.ms("target", fed, 14) == pytest.approx(ms - 50 * 0.02)
    assert model.ms("target", 6, 64) == pytest.approx((62.2 + 58.7) / 2)  # halfway from 4 to 8
    assert model.ms("target", 5, 64) == pytest.approx(62.2 + (58.7 - 62.2) / 4)
    assert model.ms("target", 24, 64) == pytest.approx(120.0)  # halfway from 16 to 32
    assert model.ms("target", 64, 64) == pytest.approx(150.0 + 32 * (150.0 - 90.0) / 16)  # beyond: the last two points
    fixed, per_token = model.batch_costs("target")
    assert per_token == pytest.approx((70.0 - 40.5) / 11) and fixed == pytest.approx(40.5 - per_token)
    with pytest.raises(ValueError, match="ascending"):
        ForwardCost(fed=(2, 1), ms=(1.0, 2.0))


@pytest.mark.parametrize("model", [LINEAR, CostModel(draft=TABLE, target=TABLE, device="test")])
def test_target_only_ms_is_the_sum_of_one_token_forwards(model):
    for first, n in ((1, 1), (5, 1), (33, 64), (200, 17)):
        assert model.target_only_ms(first, n) == pytest.approx(sum(model.ms("target", 1, q - 1) for q in range(first, first + n)))
    assert LINEAR.target_only_ms(33, 64) == 64 * (4.0 + 0.5) + 0.004 * (64 * 32 + 64 * 63 / 2)  # as before, exactly


def test_save_and_load_round_trip_to_an_equal_model(tmp_path):
    for model in (LINEAR, CostModel(draft=TABLE, target=ForwardCost.linear(4.0, 0.5, 0.004), device="cpu:x:2threads")):
        path = tmp_path / "costs.json"
        model.save(path)
        assert json.loads(path.read_text())["format"] == 3
        again = CostModel.load(path)
        assert again == model and hash(again) == hash(model)
        assert again.ms("draft", 7, 99) == model.ms("draft", 7, 99)


@pytest.mark.parametrize("stored", ['{"draft": [1, 2, 3], "target": [4, 5, 6], "device": "cpu"}',  # format 1
                                    '{"format": 2, "draft": {}, "target": {}, "device": "cpu"}',  # no loop costs
                                    '{"format": 4, "draft": {}, "target": {}, "device": "cpu"}',
                                    "not json at all {"])
def test_a_stored_model_of_another_format_is_recalibrated_with_a_message(tiny_pair, monkeypatch, caplog, stored,
                                                                         tmp_path):
    monkeypatch.setenv("BILD_ENV_CACHE", str(tmp_path))  # the fake model below must not reach other tests
    path = costs.cost_path(tiny_pair)
    assert path.is_relative_to(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(stored)
    fresh = CostModel(draft=TABLE, target=TABLE, device="fresh")
    calls = []
    monkeypatch.setattr(costs, "calibrate", lambda pair, **_: calls.append(pair) or fresh)
    with caplog.at_level(logging.WARNING, logger="bild_env.decoding.costs"):
        assert load_or_calibrate(tiny_pair) == fresh
    assert calls == [tiny_pair]
    message = " ".join(r.getMessage() for r in caplog.records)
    assert str(path) in message and "format 3" in message
    if "format" in stored:
        assert f"format {json.loads(stored).get('format', 1)}" in message
    assert CostModel.load(path) == fresh  # replaced by the new one
    assert load_or_calibrate(tiny_pair) == fresh and len(calls) == 1  # and that one is reused


def test_calibrate_times_every_fed_count_on_the_tiny_pair(tiny_pair):
    model = calibrate(tiny_pair, contexts=(8, 24), repeats=2, prefill=(16, 32), progress=False, sampling="full")
    for role in ("draft", "target"):
        cost = getattr(model, role)
        assert cost.fed == tuple(range(1, 13)) + (16, 32) and cost.ref_context == 16
        assert all(ms > 0 for ms in cost.ms) and cost.per_context_ms >= 0
        assert [model.forwards_only().ms(role, f, 16) for f in cost.fed] == list(cost.ms)
        fixed, per_token = model.batch_costs(role)
        assert fixed > 0 and per_token >= 0
    assert model.device.startswith("cpu")
    assert model.loop is not None  # then the loop costs, fitted on the decoders


def test_fit_table_moves_each_count_to_the_reference_context():
    # ms = T(fed) + 0.5 * context, timed at contexts 10 and 30 (reference 20); a prefill of 16 at context 0
    t = {1: 5.0, 2: 9.0, 3: 7.0}
    rows = [(f, c, t[f] + 0.5 * c) for c in (10, 30) for f in t]
    cost = costs.fit_table(rows, [(16, 0, 40.0)])
    assert cost.ref_context == 20 and cost.per_context_ms == pytest.approx(0.5)
    for f in t:
        assert cost(f, 10) == pytest.approx(t[f] + 5.0)
    assert cost(16, 0) == pytest.approx(40.0)


# ms[i][j]: batch BATCH[i], fed FED[j]; the table is no plane (a kink at batch 4 and fed 4)
BATCH, FED = (1, 4, 16), (1, 4, 12)
MS = ((10.0, 12.0, 20.0), (13.0, 18.0, 40.0), (30.0, 60.0, 150.0))
GRID = BatchCost(BATCH, FED, MS, per_context_ms=0.01, ref_context=100)


def test_a_batched_table_is_exact_at_its_points_and_bilinear_between():
    for i, b in enumerate(BATCH):
        for j, f in enumerate(FED):
            assert GRID(b, f, 100) == MS[i][j]
    assert GRID(1, 2, 100) == pytest.approx(10.0 + (12.0 - 10.0) / 3)  # along fed, in a measured row
    assert GRID(2, 4, 100) == pytest.approx(12.0 + (18.0 - 12.0) / 3)  # along batch, at a measured fed count
    assert GRID(10, 8, 100) == pytest.approx(((18.0 + 40.0) / 2 + (60.0 + 150.0) / 2) / 2)  # both halfway
    assert GRID(10, 8, 100) == pytest.approx(GRID.from_table(GRID.table(), 0.01, 100)(10, 8, 100))


def test_a_batched_table_extrapolates_linearly_from_its_last_two_points():
    assert GRID(32, 1, 100) == pytest.approx(30.0 + 16 * (30.0 - 13.0) / 12)  # batch beyond 16
    assert GRID(1, 20, 100) == pytest.approx(20.0 + 8 * (20.0 - 12.0) / 8)  # fed beyond 12
    row16, row4 = 150.0 + 8 * (150.0 - 60.0) / 8, 40.0 + 8 * (40.0 - 18.0) / 8
    assert GRID(32, 20, 100) == pytest.approx(row16 + 16 * (row16 - row4) / 12)  # both
    one_row = BatchCost((8,), (1, 2), ((5.0, 7.0),))
    assert one_row(1, 3, 0) == one_row(64, 3, 0) == pytest.approx(9.0)  # one batch size: flat in batch


def test_the_context_slope_of_a_batched_table_counts_every_sequence():
    assert GRID(1, 1, 150) == pytest.approx(10.0 + 0.01 * 50)
    assert GRID(16, 12, 150) == pytest.approx(150.0 + 0.01 * 16 * 50)
    assert GRID(4, 4, 40) == pytest.approx(18.0 - 0.01 * 4 * 60)
    assert GRID(4, 4, 40.5) - GRID(4, 4, 40) == pytest.approx(0.01 * 4 * 0.5)  # a mean context may be fractional


def test_batched_tables_are_checked_when_built():
    assert BatchCost.from_table({(1, 1): 2.0, (1, 3): 4.0, (2, 1): 3.0, (2, 3): 5.0}) == BatchCost(
        (1, 2), (1, 3), ((2.0, 4.0), (3.0, 5.0)))
    with pytest.raises(ValueError, match=r"missing \[\(2, 3\)\]"):
        BatchCost.from_table({(1, 1): 2.0, (1, 3): 4.0, (2, 1): 3.0})
    with pytest.raises(ValueError, match="ascending"):
        BatchCost((2, 1), (1,), ((1.0,), (2.0,)))
    with pytest.raises(ValueError, match="one row of 2 ms per batch size"):
        BatchCost((1, 2), (1, 2), ((1.0, 2.0), (3.0,)))
    with pytest.raises(ValueError, match="keyed 'draft' and 'target'"):
        CostModel(batched={"draft": GRID})


def test_batch_ms_reads_the_table_or_says_how_to_get_one():
    plain = CostModel(draft=TABLE, target=ForwardCost.linear(4.0, 0.5, 0.004), device="test")
    for role in ("draft", "target"):
        assert plain.batch_ms(role, 1, 7, 99) == plain.ms(role, 7, 99)
    with pytest.raises(ValueError, match="no batched table.*load_or_calibrate_batched"):
        plain.batch_ms("target", 2, 1, 40)
    batched = CostModel(draft=TABLE, target=TABLE, device="test", batched={"draft": GRID, "target": BatchCost(
        BATCH, FED, tuple(tuple(2 * m for m in row) for row in MS), 0.0, 100)})
    assert batched.batch_ms("draft", 10, 8, 150) == GRID(10, 8, 150)
    assert batched.batch_ms("target", 1, 4, 0) == 24.0  # the table's B=1 row, not ``ms``
    with pytest.raises(ValueError, match="role"):
        batched.batch_ms("drafter", 1, 1, 0)
    with pytest.raises(ValueError, match="at least one sequence"):
        batched.batch_ms("draft", 0, 1, 0)


def test_save_and_load_round_trip_with_batched_tables_and_machine(tmp_path):
    model = CostModel(draft=TABLE, target=TABLE, device="cpu:x:2threads", machine="Some CPU (x86_64, AVX2), torch 9, "
                      "2 threads", batched={"draft": GRID, "target": GRID})
    path = tmp_path / "costs.json"
    model.save(path)
    saved = json.loads(path.read_text())
    assert saved["machine"] == model.machine and saved["batched"]["target"]["batch"] == list(BATCH)
    again = CostModel.load(path)
    assert again == model and again.batched["draft"] == GRID and hash(again) == hash(model)
    assert again.batch_ms("target", 3, 5, 77) == model.batch_ms("target", 3, 5, 77)
    del saved["machine"], saved["batched"]  # a file written before either field existed still loads
    path.write_text(json.dumps(saved))
    old = CostModel.load(path)
    assert old.batched is None and old.machine == "" and old.target == TABLE
    assert [p.name for p in tmp_path.iterdir()] == ["costs.json"]  # written atomically, no temporary left


def test_fit_batched_counts_the_context_slope_per_sequence():
    t = {(b, f): 3.0 * b + f for b in (1, 2, 8) for f in (1, 5)}
    rows = [(b, f, c, t[b, f] + 0.02 * b * c) for c in (10, 50) for (b, f) in t]
    fitted = costs.fit_batched(rows, [(b, 16, 0, 100.0 * b) for b in (1, 2, 8)])
    assert fitted.ref_context == 30 and fitted.per_context_ms == pytest.approx(0.02)
    assert fitted.batch == (1, 2, 8) and fitted.fed == (1, 5, 16)
    for (b, f), ms in t.items():
        assert fitted(b, f, 10) == pytest.approx(ms + 0.02 * b * 10)
    assert fitted(8, 16, 0) == pytest.approx(800.0)  # a prefill reproduced at the context it was timed on


def test_calibrate_batched_times_a_full_table_on_the_tiny_pair(tiny_pair):
    tables = costs.calibrate_batched(tiny_pair, (4, 1, 2), fed=(1, 2, 3), contexts=(8, 24), repeats=1, prefill=(16,),
                                     progress=False)
    assert set(tables) == {"draft", "target"}
    for cost in tables.values():
        assert cost.batch == (1, 2, 4) and cost.fed == (1, 2, 3, 16) and cost.ref_context == 16
        assert len(cost.ms) == 3 and all(len(row) == 4 for row in cost.ms)
        assert all(math.isfinite(ms) and ms > 0 for row in cost.ms for ms in row)
        assert math.isfinite(cost.per_context_ms) and cost.per_context_ms >= 0


@pytest.fixture
def private_cache(monkeypatch, tmp_path):
    """A cache folder of this test's own, and no cost model read earlier in this process."""
    monkeypatch.setenv("BILD_ENV_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "_LOADED", {})
    return tmp_path


def _calibrate_returning(monkeypatch, model):
    calls = []
    monkeypatch.setattr(costs, "calibrate", lambda pair, **_: calls.append(pair) or model)
    return calls


def test_load_or_calibrate_batched_times_once_and_stores_beside_the_model(tiny_pair, private_cache, monkeypatch):
    base = CostModel(draft=TABLE, target=TABLE, device="base")
    monkeypatch.setattr(costs, "load_or_calibrate", lambda pair, refresh=False: base)
    timed = []
    real = costs.calibrate_batched
    monkeypatch.setattr(costs, "calibrate_batched", lambda pair, sizes, **_: timed.append(sizes) or real(
        pair, sizes, fed=(1, 2), contexts=(8,), repeats=1, prefill=(), progress=False))
    model = costs.load_or_calibrate_batched(tiny_pair, (2, 1))
    assert timed == [(1, 2)] and model.draft == base.draft and model.batched["target"].batch == (1, 2)
    assert costs.batched_path(tiny_pair, (1, 2)).exists() and not costs.batched_path(tiny_pair, (1, 2, 4)).exists()
    costs._LOADED.clear()  # another process: read from the file (its quick check is tested below)
    monkeypatch.setattr(costs, "quick_check_batched", lambda pair, tables: costs.QuickCheck({"draft": 1.0}, False, 0.1))
    assert costs.load_or_calibrate_batched(tiny_pair, (1, 2)) == model and len(timed) == 1
    base = CostModel(draft=TABLE, target=ForwardCost.linear(1.0, 2.0, 0.0), device="recalibrated")
    again = costs.load_or_calibrate_batched(tiny_pair, (1, 2))  # tables of an older cost model are timed again
    assert len(timed) == 2 and again.target == base.target and again.batched is not None
    path = costs.batched_path(tiny_pair, (1, 2))
    stored = json.loads(path.read_text())
    assert stored["layout"] == costs.BATCHED_LAYOUT == "masked"
    del stored["layout"]  # tables timed before they were timed on the padded decoder's (masked) path
    path.write_text(json.dumps(stored))
    costs._LOADED.clear()
    costs.load_or_calibrate_batched(tiny_pair, (1, 2))
    assert len(timed) == 3


def test_batched_tables_whose_quick_check_finds_faster_forwards_are_timed_again(tiny_pair, private_cache, monkeypatch,
                                                                               caplog):
    base = CostModel(draft=TABLE, target=TABLE, device="base", machine="This CPU")
    monkeypatch.setattr(costs, "load_or_calibrate", lambda pair, refresh=False: base)
    slow = BatchCost((1, 4), (1, 4), ((1e3, 1e3), (1e3, 1e3)), 0.0, 16)  # 1 s a forward: any real one is faster
    fast = BatchCost((1, 4), (1, 4), ((1.0, 2.0), (3.0, 4.0)), 0.0, 16)
    timed = []
    monkeypatch.setattr(costs, "calibrate_batched", lambda pair, sizes, **_: timed.append(sizes) or (
        {"draft": slow, "target": slow} if len(timed) == 1 else {"draft": fast, "target": fast}))
    monkeypatch.setattr(costs, "_boot_id", lambda: "an earlier boot")
    assert costs.load_or_calibrate_batched(tiny_pair, (1, 4)).batched["target"] == slow and len(timed) == 1
    monkeypatch.setattr(costs, "_boot_id", lambda: "this boot")
    costs._LOADED.clear()  # another process, after a reboot: reads the stored tables and checks them
    with caplog.at_level(logging.WARNING, logger="bild_env.decoding.costs"):
        assert costs.load_or_calibrate_batched(tiny_pair, (1, 4)).batched["target"] == fast and len(timed) == 2
    (message,) = [r.getMessage() for r in caplog.records]
    assert "batched tables" in message and "does not fit this machine" in message and "This CPU" in message


def test_a_model_calibrated_during_this_boot_is_not_checked_and_one_of_an_earlier_boot_is(tiny_pair, private_cache,
                                                                                           monkeypatch):
    boot = ["one boot"]
    monkeypatch.setattr(costs, "_boot_id", lambda: boot[0])
    first = CostModel(draft=(1.0, 0.1, 0.0), target=(2.0, 0.2, 0.0), device="first")
    calls = _calibrate_returning(monkeypatch, first)
    assert load_or_calibrate(tiny_pair) == first and len(calls) == 1
    assert json.loads(costs.cost_path(tiny_pair).read_text())["boot"] == "one boot"
    checks = []
    passing = costs.QuickCheck({"draft": 1.0, "target": 1.0}, False, 0.1)
    monkeypatch.setattr(costs, "quick_check", lambda pair, model: checks.append(model) or passing)
    costs._LOADED.clear()  # another process, same boot: no check
    assert load_or_calibrate(tiny_pair) == first and not checks
    boot[0] = "the next boot"  # the home folder outlived the machine: the next one checks it
    costs._LOADED.clear()
    assert load_or_calibrate(tiny_pair) == first and checks == [first] and len(calls) == 1


def test_a_cache_written_under_another_cpus_key_is_not_used(tiny_pair, private_cache, monkeypatch):
    here = costs.cost_path(tiny_pair)
    info = dict(dev_mod.cpu_info(), model="Intel(R) Xeon(R) Platinum 8480+", isa=["AVX2", "AVX-512", "AMX"])
    monkeypatch.setattr(dev_mod, "cpu_info", lambda: info)
    there = costs.cost_path(tiny_pair)
    other = CostModel(draft=TABLE, target=TABLE, device=dev_mod.device_name(tiny_pair.device),
                      machine=dev_mod.machine_description(tiny_pair.device))
    other.save(there)
    assert "Xeon" in CostModel.load(there).machine
    monkeypatch.undo()
    monkeypatch.setenv("BILD_ENV_CACHE", str(private_cache))
    assert costs.cost_path(tiny_pair) == here != there
    fresh = CostModel(draft=(1.0, 0.1, 0.0), target=(2.0, 0.2, 0.0), device="fresh")
    calls = _calibrate_returning(monkeypatch, fresh)
    assert load_or_calibrate(tiny_pair) == fresh and len(calls) == 1
    assert CostModel.load(here) == fresh and CostModel.load(there) == other  # the other CPU's file is left alone


def _stored(pair, ms: float) -> CostModel:
    """A cost model of ``pair`` whose every forward takes ``ms``, stored under this machine's key."""
    flat = ForwardCost(fed=(1, 12), ms=(ms, ms), per_context_ms=0.0, ref_context=16)
    model = CostModel(draft=flat, target=flat, device="an older machine", machine="Old CPU (x86_64), torch 1, 2 threads")
    model.save(costs.cost_path(pair))
    return model


def test_a_cache_whose_quick_check_finds_faster_forwards_is_recalibrated(tiny_pair, private_cache, monkeypatch, caplog):
    _stored(tiny_pair, 1e5)  # 100 s a forward: any real forward is faster, whatever else runs on the machine
    fresh = CostModel(draft=(1.0, 0.1, 0.0), target=(2.0, 0.2, 0.0), device="fresh")
    calls = _calibrate_returning(monkeypatch, fresh)
    with caplog.at_level(logging.WARNING, logger="bild_env.decoding.costs"):
        assert load_or_calibrate(tiny_pair) == fresh
    assert len(calls) == 1 and CostModel.load(costs.cost_path(tiny_pair)) == fresh
    (message,) = [r.getMessage() for r in caplog.records]
    assert "does not fit this machine" in message and "Old CPU (x86_64), torch 1, 2 threads" in message
    assert dev_mod.machine_description(tiny_pair.device) in message and "recalibrating" in message


@pytest.mark.parametrize("busy", [False, True])
def test_slower_forwards_recalibrate_on_a_quiet_cpu_only(tiny_pair, private_cache, monkeypatch, caplog, busy):
    stored = _stored(tiny_pair, 1e-6)  # a nanosecond a forward: any real forward is slower
    monkeypatch.setattr(timing.OtherLoad, "take", lambda self: 1.0 if busy else 0.0)  # other processes' CPU use
    fresh = CostModel(draft=(1.0, 0.1, 0.0), target=(2.0, 0.2, 0.0), device="fresh")
    calls = _calibrate_returning(monkeypatch, fresh)
    with caplog.at_level(logging.WARNING, logger="bild_env.decoding.costs"):
        model = load_or_calibrate(tiny_pair)
    (message,) = [r.getMessage() for r in caplog.records]
    if busy:  # load slows forwards down: no proof that the machine differs
        assert model == stored and not calls and "keeping it" in message
    else:
        assert model == fresh and len(calls) == 1 and "does not fit this machine" in message


def test_the_quick_check_passes_a_model_just_calibrated(tiny_pair):
    model = calibrate(tiny_pair, fed=costs.CHECK_FED, contexts=(16,), repeats=3, prefill=(), progress=False)
    check = costs.quick_check(tiny_pair, model)
    assert set(check.ratio) == {"draft", "target"} and all(math.isfinite(r) and r > 0 for r in check.ratio.values())
    assert check.seconds > 0  # a few forwards (their speed against the model's is noise here: not asserted)


CHILD = textwrap.dedent("""
    import json, os, sys, time
    import torch
    torch.set_num_threads(1)
    from bild_env import load_pair
    from bild_env.decoding import costs, timing

    pair = load_pair("tiny-random", device="cpu")
    calibrations = []
    real = costs.calibrate
    timing.MAX_WAIT_S = 0.0  # time on a busy machine without waiting for it (the timings are not judged here)
    costs.calibrate = lambda pair, **kw: calibrations.append(1) or real(pair, contexts=(8, 24), repeats=2, prefill=(16,), **kw)
    ready = sys.argv[1]
    open(os.path.join(ready, str(os.getpid())), "w").close()
    while len(os.listdir(ready)) < 2:  # start together
        time.sleep(0.01)
    model = costs.load_or_calibrate(pair)
    print(json.dumps({"calibrated": len(calibrations), "model": model.to_dict()}))
""")


def test_two_processes_on_an_empty_cache_share_one_calibration(tiny_pair, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(Path(os.environ["BILD_ENV_CACHE"]) / "models")  # the tiny pair, built already
    ready = tmp_path / "ready"
    ready.mkdir()
    env = os.environ | {"BILD_ENV_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(ready)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [child.communicate(timeout=300) for child in children]
    for child, (_, err) in zip(children, outs):
        assert child.returncode == 0, err
    a, b = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert a["calibrated"] + b["calibrated"] == 1  # one calibrated, the other waited and loaded it
    assert a["model"] == b["model"]
    assert list((cache / "costs").glob("*.json")) and not list((cache / "costs").glob(".*.tmp"))


LOOP = costs.LoopCost(draft_ms=0.5, target_ms=2.0, row_ms=0.25)


def test_loop_costs_are_charged_per_forward_and_per_row_read():
    model = CostModel(draft=TABLE, target=ForwardCost.linear(4.0, 0.5, 0.004), device="test", loop=LOOP)
    bare = model.forwards_only()
    assert bare.loop is None and bare.ms("target", 3, 40) == 4.0 + 1.5 + 0.16
    assert model.ms("draft", 1, 40) == bare.ms("draft", 1, 40) + 0.5
    assert model.ms("target", 3, 40) == pytest.approx(bare.ms("target", 3, 40) + 2.0 + 3 * 0.25)  # verification: 3 rows
    assert model.ms("target", 32, 0) == pytest.approx(bare.ms("target", 32, 0) + 2.0 + 0.25)  # prefill: the last row
    assert model.target_only_ms(33, 64) == pytest.approx(bare.target_only_ms(33, 64) + 64 * 2.25)
    assert model.target_only_ms(33, 64) == pytest.approx(sum(model.ms("target", 1, q - 1) for q in range(33, 97)))
    again = CostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert again == model and again.loop == LOOP
    with pytest.raises(ValueError, match="row_ms must be a finite number >= 0"):
        costs.LoopCost(row_ms=-1.0)


def test_fit_loop_recovers_the_loop_costs_of_exact_rows():
    from bild_env.decoding.loop_costs import fit_loop, loop_of

    x = [[0, 33, 33], [32, 17, 48], [10, 11, 60], [40, 9, 41], [5, 30, 34]]
    y = [loop_of(LOOP, row) for row in x]
    fitted = fit_loop(x, y)
    for name in ("draft_ms", "target_ms", "row_ms"):
        assert getattr(fitted, name) == pytest.approx(getattr(LOOP, name), abs=1e-9)
    assert fit_loop(x, [-v for v in y]) == costs.LoopCost()  # a clock faster than the tables: nothing to charge
    with pytest.raises(ValueError, match="at least 3 rows"):
        fit_loop(x[:2], y[:2])


def test_calibrating_the_loop_decodes_every_method_and_explains_the_clock(tiny_pair):
    """On the tiny pair: the fit is finite and non-negative, and the report covers every method; which
    residual is larger is not asserted (timing)."""
    from bild_env.decoding.loop_costs import LOOP_METHODS, calibrate_loop

    tables = CostModel(draft=(0.0, 0.0, 0.0), target=(0.0, 0.0, 0.0), device="zero")  # the clock is all loop
    loop, report = calibrate_loop(tiny_pair, tables, new_tokens=8, repeats=1)
    assert set(report) == {name for name, _ in LOOP_METHODS}
    assert loop.target_ms + loop.row_ms > 0  # a forward-free model leaves the whole clock to the loop
    for r in report.values():
        assert r["tables_ms"] == 0 and r["clock_ms"] > 0 and math.isfinite(r["with_loop_error"])


def test_batched_tables_time_forwards_as_the_padded_decoder_gives_them(tiny_pair):
    """masked=True: every forward has an attention mask (one hole in each row's cache) and explicit positions."""
    seen = []

    class Recorder(torch.nn.Module):  # the model, with every call's inputs written down
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

        def forward(self, *args, **kwargs):
            ids = args[0] if args else kwargs["input_ids"]
            seen.append((kwargs.get("attention_mask"), kwargs.get("position_ids"), tuple(ids.shape)))
            return self.inner(*args, **kwargs)

    model = Recorder(tiny_pair.target)
    costs.time_batched_grid(model, [(2, 3, 8)], tiny_pair.device, 1, max_wait_s=0.0, masked=True)
    timed = [s for s in seen if s[2] == (2, 3)]  # the timed forwards (not the prefill of the cache, (1, 8))
    assert timed and all(m.shape == (2, 11) and m[:, 0].eq(0).all() and m[:, 1:].eq(1).all()
                         and p.tolist() == [[8, 9, 10]] * 2 for m, p, _ in timed)
    seen.clear()
    costs.time_batched_grid(model, [(2, 3, 8)], tiny_pair.device, 1, max_wait_s=0.0)
    assert seen and all(m is None and p is None for m, p, _ in seen)


def test_the_forwards_a_calibration_times_are_counted_before_it_starts(tiny_pair, private_cache, monkeypatch):
    """The main job's "time the tables" phase knows its count first: ``forwards_to_time`` is what the calibration
    advances its bar by, but for the bisections of sparse tables past the first (announced before they are timed,
    each cell a warm-up and ``repeats`` forwards); the count never passes the total; once stored, nothing is left."""
    from agents.common.phases import PhaseBar
    from bild_env.decoding import forward_costs

    calls: list[list[int]] = []  # per sparse table: the cells of each of its grid calls

    def counting(time_cells, rows, coarse=forward_costs.COARSE_FED, tolerance=forward_costs.SPARSE_TOLERANCE):
        calls.append([])
        return forward_costs.sparse_points(lambda cells: calls[-1].append(len(cells)) or time_cells(cells), rows,
                                           coarse, tolerance)

    monkeypatch.setattr(calibration, "sparse_points", counting)
    lines = []
    bar = PhaseBar("time", "forward", say=lines.append, every_s=0.0)
    planned = costs.forwards_to_time(tiny_pair, (1, 2))
    bar.plan(planned)
    costs.load_or_calibrate_batched(tiny_pair, (1, 2), progress=bar)
    assert len(calls) == 4  # draft and target: one-request tables (5 repeats), then batched ones (3)
    beyond = [sum(c[2:]) for c in calls]
    assert bar.n == bar.total == planned + (1 + costs.REPEATS) * sum(beyond[:2]) + (1 + costs.BATCH_REPEATS) * sum(beyond[2:])
    counts = [line.split(": ", 1)[1].split(" ", 1)[0].split("/") for line in lines]
    assert counts and all(int(done) <= int(total) for done, total in counts)
    assert costs.forwards_to_time(tiny_pair, (1, 2)) == 0


@pytest.mark.parametrize("damage", ["slope", "cell x 1e4", "decreasing", "all x 1e6"])
def test_impossible_batched_tables_are_timed_again_even_when_timed_during_this_boot(damage, tiny_pair, private_cache,
                                                                                     monkeypatch, caplog):
    base = CostModel(draft=TABLE, target=TABLE, device="base", machine="This CPU")
    monkeypatch.setattr(costs, "load_or_calibrate", lambda pair, refresh=False: base)
    good = BatchCost((1, 4), (1, 4), ((40.0, 62.0), (60.0, 90.0)), 0.02, 16)
    bad = {"slope": BatchCost((1, 4), (1, 4), good.ms, 1e12, 16),  # -1.6e13 ms with no cached tokens
           "cell x 1e4": BatchCost((1, 4), (1, 4), ((40.0, 62.0 * 1e4), (60.0, 90.0)), 0.02, 16),
           "decreasing": BatchCost((1, 4), (1, 4), ((40.0, 0.2), (60.0, 90.0)), 0.02, 16),
           "all x 1e6": BatchCost((1, 4), (1, 4), tuple(tuple(m * 1e6 for m in row) for row in good.ms), 0.02, 16)}
    assert bad[damage].impossible() or damage == "all x 1e6"  # a table scaled whole is impossible against its base
    assert good.impossible() is None and TABLE.impossible() is None
    timed = []
    monkeypatch.setattr(costs, "calibrate_batched", lambda pair, sizes, **_: timed.append(sizes) or (
        {"draft": bad[damage], "target": good} if len(timed) == 1 else {"draft": good, "target": good}))
    monkeypatch.setattr(costs, "_boot_id", lambda: "this boot")
    costs.load_or_calibrate_batched(tiny_pair, (1, 4))
    costs._LOADED.clear()  # another process of the same boot reads them
    with caplog.at_level(logging.WARNING, logger="bild_env.decoding.costs"):
        assert costs.load_or_calibrate_batched(tiny_pair, (1, 4)).batched["draft"] == good and len(timed) == 2
    assert any("cannot be a timing" in r.getMessage() for r in caplog.records)
