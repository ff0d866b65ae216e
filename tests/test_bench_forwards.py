"""bench.forwards --batch: batched forwards timed beside the batched cost model (shapes and bookkeeping only:
which timing is larger is noise and never asserted)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bild_env.decoding import costs, timing


def test_the_batched_bench_times_every_cell_beside_the_batched_tables(tiny_pair, tmp_path, monkeypatch):
    from bench import forwards

    monkeypatch.setattr(timing, "MAX_WAIT_S", 0.0)  # do not wait for a busy machine: nothing here is judged by speed
    out = tmp_path / "batched.json"
    forwards.main(["--pair", "tiny-random", "--device", "cpu", "--batch", "2", "1", "--fed", "1,3", "--context", "5,9",
                   "--repeats", "1", "--rounds", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    model = costs.load_or_calibrate_batched(tiny_pair, (1, 2))  # the one the bench read: timed once, then cached
    assert report["dtype"] == "torch.float32" and report["batch_sizes"] == [1, 2] and report["contexts"] == [5, 9]
    assert "unknown" not in report["machine"] and report["machine"].endswith("1 thread")
    assert [(r["model"], r["context"], r["batch"], r["fed"]) for r in report["rows"]] == [
        (m, c, b, n) for m in ("draft", "target") for c in (5, 9) for b in (1, 2) for n in (1, 3)]
    for r in report["rows"]:
        assert r["measured_ms"] > 0 and math.isfinite(r["measured_ms"]) and len(r["rounds_ms"]) == 2
        assert r["cost_model_ms"] == pytest.approx(model.batch_ms(r["model"], r["batch"], r["fed"], r["context"]))
        assert r["error_pct"] == pytest.approx(100 * (r["cost_model_ms"] - r["measured_ms"]) / r["measured_ms"])
    assert report["cost_model"]["batched"]["target"]["batch"] == [1, 2]
    printed = forwards.batched_table(report)
    assert printed.count("| B \\ n | 1 | 3 |") == 4 and "target, 9 cached tokens per sequence" in printed
    with pytest.raises(SystemExit):
        forwards.main(["--pair", "tiny-random", "--batch", "0"])


def test_the_bench_reports_each_models_cost_ratios_against_a_one_token_forward(tiny_pair, tmp_path, monkeypatch):
    """v(n) = t(fed n) / t(fed 1) per model and c = t_draft(fed 1) / t_target(fed 1), from the measured medians."""
    from bench import forwards

    monkeypatch.setattr(timing, "MAX_WAIT_S", 0.0)
    out = tmp_path / "forwards.json"
    forwards.main(["--pair", "tiny-random", "--device", "cpu", "--dtype", "float32", "--fed", "1,2,4", "--context", "5",
                   "--repeats", "1", "--rounds", "1", "--out", str(out)])
    run = json.loads(out.read_text())["runs"][0]
    ms = {(r["model"], r["fed"]): r["measured_ms"] for r in run["rows"]}
    ratios = run["ratios"]["5"]
    for role in ("draft", "target"):
        assert ratios["v"][role]["1"] == 1.0
        assert ratios["v"][role]["4"] == pytest.approx(ms[(role, 4)] / ms[(role, 1)])
    assert ratios["c"] == pytest.approx(ms[("draft", 1)] / ms[("target", 1)])
    assert run["plans"] == {"draft": None, "target": None}  # tiny-random is OPT: no lean forward
    assert "v(2)" in "\n".join(forwards.ratio_lines({"runs": [run]}))


def test_the_products_bench_times_every_way_for_every_count_on_a_lean_target(monkeypatch, tmp_path):
    """scripts.analysis.products on a lean tiny Llama (its pair stubbed): a cell per way and count, the fastest one of them."""
    import copy

    from scripts.analysis import products
    from bild_env.models.lean import make_lean
    from bild_env.models.products import WAYS
    from tests.test_draft_forward import tiny_llama

    target = copy.deepcopy(tiny_llama(2))
    assert make_lean(target, packed=False)

    class Pair:
        name, dtype = "tiny-llama", torch.float32

    Pair.target = target
    monkeypatch.setattr(products, "load_pair", lambda *a, **k: Pair)
    out = tmp_path / "p.json"
    report = products.main(["--rows", "1", "3", "--rounds", "2", "--out", str(out)])
    assert json.loads(out.read_text())["fastest"] == report["fastest"]
    ways = {k.split(":")[1] for k in report["ms"]}
    assert ways <= set(WAYS) and {"plain", "weight_left", "transposed"} <= ways
    assert set(report["fastest"]) == {"1", "3"} and all(report["ms"][f"{r}:{w}"]["min_ms"] > 0
                                                         for r in (1, 3) for w in ways)
    assert "| rows |" in products.table(report)


@pytest.mark.parametrize("way", ["weight_left", "packed"])
def test_products_one_way_reads_every_count_that_way_and_gives_the_same_logits(way):
    """bench.forwards --products W: the lean target's products (loaded plain at every count) read their weights W at
    every count of rows fed, and the logits of 1 and 3 tokens fed stay those of the plain plan."""
    import copy

    from bench import forwards
    from bild_env.models.lean import make_lean
    from bild_env.models.products import can_pack
    from tests.test_draft_forward import tiny_llama

    target = copy.deepcopy(tiny_llama(2))
    assert make_lean(target, packed=False) and set(target.model.plan[1:]) == {"plain"}
    if way == "packed" and not can_pack(target.model.weights[0][0]):
        pytest.skip("oneDNN cannot pack here")
    ids = torch.tensor([[5, 9, 2, 7]])
    with torch.inference_mode():
        before = [target(ids[:, :n]).logits for n in (1, 3)]

    class Pair:
        draft = None

    Pair.target = target
    forwards.use_products(Pair, way)
    assert set(target.model.plan[1:]) == {way}
    assert all(set(p.plan[1:]) == {way} for layer in target.model.products for p in layer)
    with torch.inference_mode():
        after = [target(ids[:, :n]).logits for n in (1, 3)]
    for a, b in zip(after, before):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
