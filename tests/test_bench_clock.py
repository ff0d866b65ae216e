"""scripts.analysis.clock: the env's fixed pairs charged by the cost model beside the clock (bookkeeping only: which
timing is larger is noise and never asserted)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from bild_env.decoding.costs import LoopCost

from tests.conftest import COSTS


def _runs(clock: dict[str, list[float]], model: dict[str, list[float]]) -> dict[str, list[dict]]:
    return {m: [{"tokens": 10, "clock_ms": c, "model_ms": model[m][i], "tables_ms": model[m][i] - 1.0}
                for i, c in enumerate(clock[m])] for m in clock}


def test_summary_errors_take_the_drift_out_and_rank_the_grid():
    from scripts.analysis.clock import TARGET, TARGET_AGAIN, summarise

    # the clock runs 20% slower than the model for every method (drift): no error once it is taken out
    model = {TARGET: [100.0, 100.0], TARGET_AGAIN: [100.0, 100.0], "a": [50.0, 60.0], "b": [70.0, 90.0], "c": [85.0, 85.0]}
    clock = {m: [1.2 * v for v in vs] for m, vs in model.items()}
    out = summarise(_runs(clock, model), ["a", "b", "c"])
    assert out["spearman_model_vs_clock"] == pytest.approx(1.0)
    for m, row in out["methods"].items():
        assert row["model_error"] == pytest.approx(1 / 1.2 - 1) and row["model_error_drift_removed"] == pytest.approx(0.0)
        assert row["clock_ms_per_token"] == pytest.approx(sum(clock[m]) / 20)
    assert out["methods"]["a"]["speedup_clock"] == pytest.approx(200 / 110)
    # the model ranks b and c the other way: Spearman of (1, 2, 3) against (1, 3, 2) = 0.5
    clock["b"], clock["c"] = [1.2 * 90, 1.2 * 90], [1.2 * 70, 1.2 * 80]
    out = summarise(_runs(clock, model), ["a", "b", "c"])
    assert out["spearman_model_vs_clock"] == pytest.approx(0.5)
    assert out["noise_floor"]["target_again_vs_target"] == pytest.approx(0.0)


def test_the_bench_times_every_method_on_the_same_prompts(tmp_path, monkeypatch):
    from scripts.analysis import clock

    costs = replace(COSTS, loop=LoopCost(draft_ms=0.5, target_ms=1.0, row_ms=0.1))
    monkeypatch.setattr(clock, "load_or_calibrate", lambda pair, refresh=False: costs)
    out = tmp_path / "clock.json"
    clock.main(["--pair", "tiny-random", "--domains", "prose", "--prompts", "2", "--max-new-tokens", "6",
                "--k", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    names = [name for name, _ in clock.methods(clock.ClockConfig(k=(2,)))]
    assert list(result["runs"]) == names and len(names) == 2 + 1 + 25 and result["prompts"] == 2
    for name, rows in result["runs"].items():
        assert len(rows) == 2 and all(r["tokens"] == 6 and r["clock_ms"] > 0 for r in rows), name
        assert all(r["tables_ms"] < r["model_ms"] for r in rows)  # the loop is charged on top of the tables
    assert result["runs"]["target only"][0]["model_ms"] == result["runs"]["target only (again)"][0]["model_ms"]
    assert -1 <= result["spearman_model_vs_clock"] <= 1 and math.isfinite(result["noise_floor"]["target_again_vs_target"])
    assert result["loop"] == {"draft_ms": 0.5, "target_ms": 1.0, "row_ms": 0.1} and "thread" in result["machine"]
    for bad in (["--prompts", "1"], ["--domains", "poetry"], ["--split", "train"], ["--trees", "3,x"]):
        with pytest.raises(SystemExit, match="error: "):
            clock.main(["--pair", "tiny-random", *bad])


def test_tree_rows_are_charged_as_generate_tree_charges_them(tmp_path, monkeypatch):
    """``--trees``: a row per rule, its tokens and modelled time those of ``generate_tree`` with the same cost model."""
    from scripts.analysis import clock
    from bild_env import load_pair
    from bild_env.decoding.tree import generate_tree
    from bild_env.prompts.domains import load_domain

    costs = replace(COSTS, loop=LoopCost(draft_ms=0.5, target_ms=1.0, row_ms=0.1))
    monkeypatch.setattr(clock, "load_or_calibrate", lambda pair, refresh=False: costs)
    out = tmp_path / "clock.json"
    clock.main(["--pair", "tiny-random", "--domains", "prose", "--prompts", "2", "--max-new-tokens", "6",
                "--k", "2", "--trees", "3,2,1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert "tree 3,2,1" in result["runs"] and "tree 3,2,1" in result["methods"]
    pair = load_pair("tiny-random")
    prompts = load_domain(pair.tokenizer, "prose", "test", 2)
    for row, prompt in zip(result["runs"]["tree 3,2,1"], prompts):
        want = generate_tree(pair, prompt, "3,2,1", 6, costs).stats
        assert row["tokens"] == want.new_tokens and row["model_ms"] == pytest.approx(want.model_ms)
