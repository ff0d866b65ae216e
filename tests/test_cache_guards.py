"""What the caches and the envs' arguments refuse: cost tables that are no timings (re-timed, saying why), cache keys
that hold the cache folder's path, batches beyond the timed ones, strings given for booleans, non-standard JSON."""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import gymnasium
import numpy as np
import pytest

from bild_env.decoding import costs
from bild_env.decoding.costs import BatchCost, CostFormatError, CostModel, ForwardCost

# Measured tables (BILD_SPEC.md sections 5-7): real ones the load check must keep.
ZEN5_FP32 = ForwardCost((1, 2, 3, 4, 8), (40.5, 66.0, 80.8, 62.2, 58.7), 0.02, 96)  # fed 4 below fed 3: a kernel dip
ZEN5_BF16 = ForwardCost((1, 2, 3, 4, 8), (20.8, 20.9, 21.2, 21.7, 23.9), 0.02, 96)  # nearly flat
ZEN3_FP32 = ForwardCost((1, 2, 4, 8), (87.0, 163.1, 163.4, 167.1), 0.02, 96)
SERVED = BatchCost.from_table({(1, 1): 20.6, (1, 8): 23.7, (8, 1): 30.2, (8, 8): 48.8, (32, 1): 58.7, (32, 8): 129.9},
                              0.01, 64)


@pytest.fixture(autouse=True)
def private_cache(tiny_pair, monkeypatch, tmp_path):
    """A cache folder of this test's own (the session's tiny pair is made before, in the session's), nothing read
    earlier, this boot fixed (stored tables are not quick-checked)."""
    monkeypatch.setenv("BILD_ENV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(costs, "_LOADED", {})
    monkeypatch.setattr(costs, "_boot_id", lambda: "this boot")
    return tmp_path / "cache"


# -- 1. cost tables: finite, positive, and no forward far cheaper than the smallest --------------------------------
@pytest.mark.parametrize("make", [
    lambda: ForwardCost((1, 2), (1.0, float("nan"))),
    lambda: ForwardCost((1, 2), (1.0, float("inf"))),
    lambda: ForwardCost((1, 2), (0.0, 1.0)),
    lambda: ForwardCost((1, 2), (1.0, -2.0)),
    lambda: ForwardCost((1, 2), (1.0, 2.0), per_context_ms=float("nan")),
    lambda: ForwardCost((1, 2), (1.0, 2.0), per_context_ms=-0.1),
    lambda: ForwardCost.linear(float("nan"), 0.1, 0.0),
    lambda: ForwardCost.linear(1.0, -0.1, 0.0),
    lambda: BatchCost((1, 2), (1,), ((1.0,), (float("nan"),))),
    lambda: BatchCost((1, 2), (1,), ((1.0,), (0.0,))),
    lambda: BatchCost((1, 2), (1,), ((1.0,), (2.0,)), per_context_ms=float("-inf")),
])
def test_constructors_refuse_times_that_are_not_finite_and_positive(make):
    with pytest.raises(ValueError, match="must be finite numbers"):
        make()


def test_a_linear_model_of_zeros_still_builds():
    """The forward-free model (the loop calibration's, ``CostModel()``'s default) costs 0: coefficients may be 0."""
    assert CostModel().ms("target", 4, 10) == 0.0


def test_from_dict_names_the_table_that_holds_nan():
    d = CostModel(draft=ZEN5_BF16, target=ZEN5_FP32, device="test").to_dict()
    d["target"]["ms"][2] = float("nan")
    with pytest.raises(CostFormatError, match="the target table: .*finite.*nan"):
        CostModel.from_dict(json.loads(json.dumps(d)))  # Python's json writes and reads NaN: the file can hold it
    d = CostModel(draft=ZEN5_BF16, target=ZEN5_BF16, device="test", batched={"draft": SERVED, "target": SERVED}).to_dict()
    d["batched"]["draft"]["ms"][1][0] = -3.0
    with pytest.raises(CostFormatError, match="the batched draft table: .*finite numbers > 0.*-3.0"):
        CostModel.from_dict(d)


def test_measured_tables_pass_the_load_check_and_impossible_ones_do_not():
    for real in (ZEN5_FP32, ZEN5_BF16, ZEN3_FP32, ForwardCost.linear(0.0, 0.0, 0.0)):
        assert real.implausible() is None
    assert SERVED.implausible() is None
    noisy = ForwardCost((1, 2, 12), (20.8, 20.1, 21.0))  # fed 2 a little below fed 1: noise on a flat table
    assert noisy.implausible() is None
    assert ForwardCost((1, 2, 12), (40.0, 41.0, 12.0)).implausible() == \
        "fed 12 takes 12 ms, less than 1/2 of fed 1's 40 ms"
    swapped = BatchCost((1, 32), (1, 8), ((58.7, 129.9), (20.6, 23.7)))  # the rows of batch 1 and 32 exchanged
    assert "batch 32 fed 1 takes 20.6 ms" in swapped.implausible()
    assert "batched target" in costs.model_faults(CostModel(draft=ZEN5_BF16, target=ZEN5_BF16, device="t",
                                                          batched={"draft": SERVED, "target": swapped}))[1]


def _store_batched(pair, monkeypatch, tables: list[dict]) -> list:
    """A stored base model and ``calibrate_batched`` answering ``tables`` in turn; returns the list of timings."""
    base = CostModel(draft=ZEN5_BF16, target=ZEN5_BF16, device="base", machine="This CPU")
    monkeypatch.setattr(costs, "load_or_calibrate", lambda pair, refresh=False: base)
    timed = []
    monkeypatch.setattr(costs, "calibrate_batched", lambda pair, sizes, **_: timed.append(sizes) or tables[len(timed) - 1])
    return timed


NO_TIMING = r"no timing of forwards: batch 8 fed 1 takes 1 ms, less than 1/2 of batch 1 fed 1.s 20.6 ms"


@pytest.mark.parametrize("spoil, boot, why", [  # times that are no numbers > 0: refused whenever they were timed
    (lambda d: d["target"]["ms"][1].__setitem__(0, float("nan")), "this boot", r"batched target table: .*finite.*nan"),
    (lambda d: d["draft"]["ms"][0].__setitem__(1, -1.0), "this boot", r"batched draft table: .*finite.*-1\.0"),
    (lambda d: d["draft"]["ms"][1].__setitem__(1, 0.0), "this boot", r"batched draft table: .*> 0, got 0\.0"),
    (lambda d: d["target"].__setitem__("per_context_ms", float("inf")), "this boot", r"per_context_ms must be finite"),
    (lambda d: d["target"]["ms"][1].__setitem__(0, 1.0), "an earlier boot", NO_TIMING),  # batch 8 at 1 ms
])
def test_stored_batched_tables_that_are_no_timings_are_timed_again_saying_why(tiny_pair, monkeypatch, caplog,
                                                                              spoil, boot, why):
    good = {"draft": SERVED, "target": SERVED}
    timed = _store_batched(tiny_pair, monkeypatch, [good, good])
    assert costs.load_or_calibrate_batched(tiny_pair, (1, 8, 32)).batched == good and len(timed) == 1
    path = costs.batched_path(tiny_pair, (1, 8, 32))
    stored = json.loads(path.read_text())
    spoil(stored)
    path.write_text(json.dumps(stored | {"boot": boot}))  # NaN / Infinity as Python writes them
    costs._LOADED.clear()  # another process reads the file
    with caplog.at_level(logging.WARNING, logger="bild_env.decoding.costs"):
        assert costs.load_or_calibrate_batched(tiny_pair, (1, 8, 32)).batched == good
    assert len(timed) == 2  # timed again, not used
    (message,) = [r.getMessage() for r in caplog.records]
    assert str(path) in message and message.endswith("timing them again")
    assert re.search(why, message), message
    text = path.read_text()  # rewritten, as standard JSON
    assert "NaN" not in text and "Infinity" not in text and json.loads(text)["target"]["ms"] == [list(r) for r in SERVED.ms]


def test_implausible_tables_timed_during_this_boot_are_kept_with_a_warning(tiny_pair, monkeypatch, caplog):
    """A loaded machine can time a table that dips below TABLE_SLACK: re-timing it would change the rewards within
    the boot (and may come out as badly), so it is kept, saying so; after a reboot it is timed again (above)."""
    good = {"draft": SERVED, "target": SERVED}
    timed = _store_batched(tiny_pair, monkeypatch, [good, good])
    costs.load_or_calibrate_batched(tiny_pair, (1, 8, 32))
    path = costs.batched_path(tiny_pair, (1, 8, 32))
    stored = json.loads(path.read_text())
    stored["target"]["ms"][1][0] = 1.0
    path.write_text(json.dumps(stored))  # still this boot's
    costs._LOADED.clear()
    with caplog.at_level(logging.WARNING, logger="bild_env.decoding.costs"):
        kept = costs.load_or_calibrate_batched(tiny_pair, (1, 8, 32)).batched["target"]
    assert len(timed) == 1 and kept.ms[1][0] == 1.0
    (message,) = [r.getMessage() for r in caplog.records]
    assert re.search(NO_TIMING, message) and "kept: timed on this machine during this boot" in message


def test_a_stored_cost_model_with_an_impossible_table_is_recalibrated_saying_why(tiny_pair, monkeypatch, caplog):
    bad = ForwardCost((1, 2, 12), (40.0, 41.0, 0.5), 0.0, 16)  # fed 12 at 0.5 ms: no timing
    CostModel(draft=ZEN5_BF16, target=bad, device="older").save(costs.cost_path(tiny_pair))  # no boot: an older one
    fresh = CostModel(draft=ZEN5_BF16, target=ZEN5_FP32, device="fresh")
    calls = []
    monkeypatch.setattr(costs, "calibrate", lambda pair, **_: calls.append(pair) or fresh)
    with caplog.at_level(logging.WARNING, logger="bild_env.decoding.costs"):
        assert costs.load_or_calibrate(tiny_pair) == fresh
    (message,) = [r.getMessage() for r in caplog.records]
    assert str(costs.cost_path(tiny_pair)) in message and message.endswith("recalibrating")
    assert "its target table is no timing of forwards: fed 12 takes 0.5 ms" in message
    assert len(calls) == 1 and CostModel.load(costs.cost_path(tiny_pair)) == fresh


def test_a_stored_cost_model_holding_nan_is_recalibrated(tiny_pair, monkeypatch, caplog):
    d = CostModel(draft=ZEN5_BF16, target=ZEN5_FP32, device="older").to_dict()
    d["draft"]["per_context_ms"] = float("nan")
    costs.cost_path(tiny_pair).write_text(json.dumps(d | {"boot": "this boot"}))
    fresh = CostModel(draft=ZEN5_BF16, target=ZEN5_FP32, device="fresh")
    monkeypatch.setattr(costs, "calibrate", lambda pair, **_: fresh)
    with caplog.at_level(logging.WARNING, logger="bild_env.decoding.costs"):
        assert costs.load_or_calibrate(tiny_pair) == fresh
    (message,) = [r.getMessage() for r in caplog.records]
    assert "the draft table: per_context_ms must be finite" in message and "recalibrating" in message


def test_timings_other_processes_slowed_serve_their_run_and_are_timed_again_by_the_next(tiny_pair, monkeypatch,
                                                                                        caplog):
    """Rounds other processes slowed that a calibration kept (past its wait budget) make it the run's, stored as
    slowed, never the machine's: the next process that needs it times it again; one that times quietly is kept."""
    slowed = CostModel(draft=ZEN5_BF16, target=ZEN3_FP32, device="busy")
    quiet = CostModel(draft=ZEN5_BF16, target=ZEN5_FP32, device="quiet")
    calls = []

    def calibrate(pair, stats=None, **_):
        calls.append(pair)
        stats["busy_rounds_kept"] = 3 if len(calls) == 1 else 0
        return slowed if len(calls) == 1 else quiet

    monkeypatch.setattr(costs, "calibrate", calibrate)
    assert costs.load_or_calibrate(tiny_pair) == slowed  # this run's
    assert json.loads(costs.cost_path(tiny_pair).read_text())["slowed"] == 3
    assert costs.load_or_calibrate(tiny_pair) == slowed and len(calls) == 1  # within the process, one cost model
    costs._LOADED.clear()  # the next process
    with caplog.at_level(logging.WARNING, logger="bild_env.decoding.costs"):
        assert costs.load_or_calibrate(tiny_pair) == quiet
    assert "slowed 3 of its timing rounds: timing it again" in caplog.text and len(calls) == 2
    costs._LOADED.clear()
    assert costs.load_or_calibrate(tiny_pair) == quiet and len(calls) == 2  # quiet timings are the machine's


# -- 2. cache keys hold no folder --------------------------------------------------------------------------------
def test_a_moved_cache_keeps_its_keys_and_its_cost_model(tiny_pair, private_cache, monkeypatch, tmp_path):
    from bild_env import load_pair

    session_models = Path(tiny_pair.ids[0]).parent.parent  # <session cache>/models: the tiny pair's folders
    stored = CostModel(draft=ZEN5_BF16, target=ZEN5_FP32, device="timed here")
    shutil.copytree(session_models, private_cache / "models")
    costs._write_json(costs.cost_path(tiny_pair), stored.to_dict() | {"boot": "this boot"})  # timed during this boot
    moved = tmp_path / "moved"
    shutil.move(private_cache, moved)
    monkeypatch.setenv("BILD_ENV_CACHE", str(moved))
    monkeypatch.setattr(costs, "calibrate", lambda pair, **_: pytest.fail("a moved cache was timed again"))
    pair = load_pair("tiny-random", device="cpu")
    assert pair is not tiny_pair and Path(pair.ids[0]).is_relative_to(moved)  # the moved folders' models
    assert pair.key == tiny_pair.key and costs.cost_path(pair) == moved / "costs" / costs.cost_path(tiny_pair).name
    assert costs.load_or_calibrate(pair) == stored
    assert not any(part in pair.key for part in (str(moved), str(session_models)))


def test_a_local_model_is_named_by_its_files_wherever_they_lie(tiny_pair, tmp_path):
    from bild_env.models.pairs import _fingerprint

    here = _fingerprint(tiny_pair.ids[0], tiny_pair.draft)
    copy = shutil.copytree(tiny_pair.ids[0], tmp_path / "elsewhere" / "draft-copy")
    assert _fingerprint(str(copy), tiny_pair.draft) == here and here.startswith("local:") and here in tiny_pair.key
    (weights,) = copy.glob("*.safetensors")
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1  # one bit in the middle of the weights: other weights, another key
    weights.write_bytes(bytes(data))
    assert _fingerprint(str(copy), tiny_pair.draft) != here



def test_a_local_model_keeps_its_name_under_another_transformers_release(tiny_pair, tmp_path):
    """config.json notes the transformers that wrote it (5.24.0 -> 5.25.0 changed every converted model's key, so a
    fresh machine's smollm2 missed its own shipped decoding datasets and caches); the note is not the model, the rest
    of the config is."""
    import json

    from bild_env.models.pairs import SAVED_BY, _fingerprint

    copy = shutil.copytree(tiny_pair.ids[0], tmp_path / "draft-copy")
    here = _fingerprint(str(copy), tiny_pair.draft)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, SAVED_BY: "9.99.0"}, indent=4))
    assert _fingerprint(str(copy), tiny_pair.draft) == here
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.5}))
    assert _fingerprint(str(copy), tiny_pair.draft) != here


def test_the_shipped_decoding_datasets_name_the_shipped_draft():
    """The smollm2 datasets and the draft's acceptance lookup were recorded with the draft shipped in assets: their
    keys are its key (a change of ``_fingerprint`` re-keys them, or every machine reads them as another pair's)."""
    import json

    from bild_env.models.lookup import LOOKUP_FILE
    from bild_env.models.pairs import _fingerprint
    from bild_env.paths import ASSETS

    draft = _fingerprint(str(ASSETS / "smollm2-draft"), None)
    for dtype in ("float32", "bfloat16"):
        manifest = json.loads((ASSETS / "datasets" / f"smollm2-{dtype}" / "manifest.json").read_text())
        assert manifest["fingerprints"][0] == draft and manifest["pair_key"].startswith(draft + "|")
    assert json.loads((ASSETS / "smollm2-draft" / LOOKUP_FILE).read_text())["draft"].startswith(draft + "|")

# -- 3. batches beyond the timed ones --------------------------------------------------------------------------
def test_a_profile_of_smaller_batches_lowers_the_default_max_batch_only(tiny_pair, caplog, monkeypatch):
    """A cost profile timed up to 8 sequences: max_batch not given is 8 (said), given above it is refused."""
    import bild_env.replay.dataset

    monkeypatch.setattr(bild_env.replay.dataset, "_SAID", set())
    with caplog.at_level(logging.WARNING, logger="bild_env.serving.env"):
        env = gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random", cost_profile="xeon-amx-qwen2.5-coder-bf16")
    assert env.unwrapped.config.max_batch == 8 and "max_batch 8 (the default is 32)" in caplog.text
    with pytest.raises(ValueError, match=r"max_batch 16 is above the largest batch cost profile .* give max_batch <= 8"):
        gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random", cost_profile="xeon-amx-qwen2.5-coder-bf16",
                       max_batch=16)


def test_max_batch_above_the_timed_batches_is_refused_naming_the_largest():
    from bild_env.serving.env import ServingConfig, validate

    assert costs.BATCH_SIZES[-1] == 32
    validate(ServingConfig(max_batch=32))
    with pytest.raises(ValueError, match=r"max_batch 4096 is above the largest batch the cost model has timed \(32 "):
        gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random", pair_options={"device": "cpu"}, max_batch=4096)
    given = CostModel(draft=ZEN5_BF16, target=ZEN5_BF16, device="t", batched={"draft": SERVED, "target": replace(
        SERVED, batch=(1, 8), ms=SERVED.ms[:2])})
    validate(ServingConfig(max_batch=8, cost_model=given))
    with pytest.raises(ValueError, match=r"max_batch 9 .* \(8 sequences\).*max_batch <= 8"):
        validate(ServingConfig(max_batch=9, cost_model=given))


# -- 4. booleans ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("env_id, sub, name, value", [
    ("bild_env:BiLD-Serve-v0", "actions", "off_switch", "False"), ("bild_env:BiLD-Serve-v0", "actions", "per_domain", "no"),
    ("bild_env:BiLD-Serve-v0", "observe", "next", 1), ("bild_env:BiLD-Serve-v0", "actions", "off_switch", None),
    ("bild_env:BiLD-v1", "actions", "off_switch", "False"), ("bild_env:BiLD-v0", "actions", "off_switch", 0),
])
def test_a_bool_argument_that_is_no_bool_is_refused_naming_it(env_id, sub, name, value):
    with pytest.raises(ValueError, match=rf"^{sub}: {name} must be True or False, got {value!r}"):
        gymnasium.make(env_id, pair="tiny-random", pair_options={"device": "cpu"}, **{sub: {name: value}})


def test_numpy_bools_and_the_command_lines_bools_pass():
    import argparse

    from bild_env.cli import add_options, check_bool_fields, given
    from bild_env.env import EnvConfig
    from bild_env.env import validate as validate_env
    from bild_env.serving.env import ServingConfig, validate

    validate(ServingConfig(actions={"off_switch": np.bool_(False), "per_domain": np.True_}))
    validate_env(EnvConfig(actions={"off_switch": np.False_}))
    for bool_values, argv in ((False, ["--actions", "off_switch=no", "per_domain=1"]),
                              (True, ["--actions", "off_switch=0", "per_domain=yes"])):
        parser = argparse.ArgumentParser()
        add_options(parser, "env", ServingConfig, ServingConfig(), bool_values=bool_values)
        cfg = replace(ServingConfig(), **given(parser.parse_args(argv), "env"))
        assert cfg.actions.off_switch is False and cfg.actions.per_domain is True
        check_bool_fields(cfg)  # its sub-configs too


# -- 5. BiLD-v1 says BiLD-v1 ------------------------------------------------------------------------------------
def test_messages_name_the_version_the_env_was_made_as(tiny_pair):
    from bild_env.env import BildEnv
    from tests.conftest import COSTS

    for env_id in ("BiLD-v1", "BiLD-v0"):
        with pytest.raises(TypeError, match=f"unknown {env_id} argument"):
            gymnasium.make(f"bild_env:{env_id}", pair="tiny-random", pair_options={"device": "cpu"}, max_tokens=3)
        env = gymnasium.make(f"bild_env:{env_id}", pair="tiny-random", pair_options={"device": "cpu"}, cost_model=COSTS,
                             max_new_tokens=4)
        with pytest.raises(RuntimeError, match=f"^{env_id}: call reset"):
            env.unwrapped.step(0)
        with pytest.raises(ValueError, match=f"^{env_id} action must be an integer"):
            env.unwrapped.step(99)
        env.close()
    direct = BildEnv(pair="tiny-random", pair_options={"device": "cpu"}, cost_model=COSTS, max_new_tokens=4)
    assert direct.env_id == "BiLD-v1"
    direct.close()


# -- 6. standard JSON -------------------------------------------------------------------------------------------
@dataclass
class _Report:
    """A report command's options."""

    out: str = ""  # where the result goes


def test_a_report_with_nan_and_infinity_is_written_as_standard_json(tmp_path):
    from bild_env.cli import report_main

    out = tmp_path / "report.json"
    result = {"speedup": float("nan"), "rows": [{"ms": float("-inf")}, (1.5, float("inf"))], "n": 3}
    report_main(_Report, ["--out", str(out)], "a report", lambda cfg: None, lambda cfg: result, lambda r: "done")

    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    assert json.loads(out.read_text(), parse_constant=refuse) == {"speedup": None, "rows": [{"ms": None}, [1.5, None]],
                                                                  "n": 3}
    assert math.isnan(result["speedup"])  # the caller's result is left as it was


def test_the_cost_key_follows_the_lean_products_plan():
    """Cost tables time the kernels a lean model runs: a products plan chosen again keys other tables; a pair
    without the lean forward keeps its key."""
    from types import SimpleNamespace

    from bild_env.decoding import costs

    def pair(plan, lean=("target",)):
        target = SimpleNamespace(model=SimpleNamespace(plan=plan))
        return SimpleNamespace(key="p", device="cpu", lean=lean, target=target, draft=SimpleNamespace())

    a = costs._machine_key(pair(("", "packed", "plain")))
    assert a == costs._machine_key(pair(("", "packed", "plain")))
    assert a != costs._machine_key(pair(("", "packed", "packed")))
    assert costs._machine_key(pair(None, ())) == costs._machine_key(SimpleNamespace(key="p", device="cpu"))
