"""A serving run folder is never wiped by a resume or a restart: a finished run whose checkpoints cannot be read is
refused untouched, a symbolic link is never half-removed, a garbled progress row costs that row only, a config.json
that cannot be read is named, and a signal that arrives inside a checkpoint write stops cleanly once it is written."""

import json
import os
import signal
import zipfile

import pytest

from tests.test_serving_resume import resume, run, toy_costs  # noqa: F401 - toy_costs: a fixture

KEPT = ("model.zip", "best_model.zip", "progress.csv", "evaluations.json", "config.json")


def snapshot(run_dir):
    return {name: (run_dir / name).read_bytes() for name in KEPT}


@pytest.fixture
def finished(tmp_path, toy_costs):  # noqa: F811
    assert run(tmp_path, total=120) == 0
    return tmp_path / "r"


@pytest.mark.parametrize("damage", ["cut", "removed", "symlink"])
def test_a_finished_run_whose_checkpoints_cannot_be_read_is_refused_untouched(damage, finished, tmp_path, capsys):
    checkpoints = finished / "checkpoints"
    if damage == "removed":
        for p in checkpoints.iterdir():
            p.unlink()
        checkpoints.rmdir()
    else:
        for p in checkpoints.glob("dqn_*_steps.zip"):
            p.write_bytes(p.read_bytes()[:200])  # cut short
    if damage == "symlink":
        elsewhere = tmp_path / "elsewhere"
        os.replace(checkpoints, elsewhere)
        checkpoints.symlink_to(elsewhere)
    before = snapshot(finished)
    listing = sorted(p.name for p in (tmp_path / "elsewhere" if damage == "symlink" else finished).iterdir())
    capsys.readouterr()
    assert resume(tmp_path) == 2
    assert run(tmp_path, total=120) == 2  # a plain restart of the same name too
    err = capsys.readouterr().err
    assert "none of its checkpoints can be read" in err and "python evaluate.py --model" in err
    assert snapshot(finished) == before
    assert sorted(p.name for p in (tmp_path / "elsewhere" if damage == "symlink" else finished).iterdir()) == listing
    if damage == "symlink":
        assert checkpoints.is_symlink()


def test_a_restart_in_place_moves_a_symlinked_checkpoints_folder_aside_as_a_link(tmp_path, toy_costs):  # noqa: F811
    r, elsewhere = tmp_path / "r", tmp_path / "elsewhere"
    r.mkdir()
    elsewhere.mkdir()
    (elsewhere / "dqn_40_steps.zip").write_bytes(b"torn")  # a checkpoint that never completed
    (r / "checkpoints").symlink_to(elsewhere)
    (r / "config.json").write_text(json.dumps({"env_id": "BiLD-Serve-v0", "format": 2, "train": {}, "env": {}}))
    assert run(tmp_path, total=120) == 0
    aside = r / "set_aside" / "1" / "checkpoints"
    assert aside.is_symlink() and (elsewhere / "dqn_40_steps.zip").read_bytes() == b"torn"
    assert (r / "checkpoints").is_dir() and not (r / "checkpoints").is_symlink()


def test_a_garbled_progress_row_costs_that_row_only(tmp_path):
    from agents.common.logs import progress_rows

    path = tmp_path / "progress.csv"
    rows = [[str(8 * i), f"{i / 10}"] for i in range(1, 8)]  # 7 data rows, steps 8..56
    lines = ["time/total_timesteps,x"] + [",".join(r) for r in rows]
    lines[2] = "1#6,0.2"  # row 2's step cell garbled
    told = []
    path.write_text("\n".join(lines) + "\n")
    assert progress_rows(path, upto=48, say=told.append)[1] == [rows[0]] + rows[2:6]
    assert "1 garbled row" in told[0]
    raw = path.read_bytes().replace(b"0.3", b"0\xff\xfe3").replace(b"40,", b"4\x000,")  # junk bytes, a NUL
    path.write_bytes(raw)
    assert progress_rows(path)[1] == [rows[0], rows[3], rows[5], rows[6]]
    path.write_bytes(b"\xff\xfe,x\n1,2\n")
    with pytest.raises(ValueError, match="header"):
        progress_rows(path)


@pytest.mark.parametrize("text, says", [(b"\xff\xfe{junk", "config.json cannot be read"),
                                        (None, "max_batch")])
def test_a_config_json_that_cannot_be_used_is_named(text, says, finished, tmp_path, capsys):
    config = finished / "config.json"
    if text is None:
        saved = json.loads(config.read_text())
        saved["env"]["max_batch"] = 0
        text = json.dumps(saved).encode()
    config.write_bytes(text)
    capsys.readouterr()
    from tests.test_serving import train_serve as main

    with pytest.raises(SystemExit) as stop:  # argparse's usage error: exit 2, one line
        main(["--resume", "--run-name", "r", "--log-dir", str(tmp_path)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert says in err and str(config) in err and "Traceback" not in err


def test_a_signal_inside_a_zip_write_acts_once_the_file_is_whole(tmp_path, signals_not_ignored):
    from agents.common.files import write_atomic
    from agents.common.callbacks import sigterm_as_ctrl_c

    path = tmp_path / "model.zip"

    def write(f):
        with zipfile.ZipFile(f, "w") as z, z.open("data", "w") as member:
            member.write(b"a" * 1000)
            os.kill(os.getpid(), signal.SIGTERM)  # arrives with the zip's member open
            member.write(b"b" * 1000)

    with sigterm_as_ctrl_c(), pytest.raises(KeyboardInterrupt):  # not zipfile's ValueError
        write_atomic(path, write)
    with zipfile.ZipFile(path) as z:
        assert z.read("data") == b"a" * 1000 + b"b" * 1000
    assert signal.getsignal(signal.SIGTERM) is not None


def test_a_run_stopped_before_its_total_whose_checkpoints_cannot_be_read_starts_again_keeping_all(finished, tmp_path,
                                                                                                  capsys):
    for p in (finished / "checkpoints").iterdir():
        p.write_bytes(p.read_bytes()[:100])  # three damaged checkpoints in a row: none left to resume from
    before = snapshot(finished)
    capsys.readouterr()
    assert resume(tmp_path, "--total-timesteps", "180") == 0  # its model.zip is at step 120: not finished
    out = capsys.readouterr().out
    assert "starting it again from step 0" in out and "set_aside/1" in out
    aside = finished / "set_aside" / "1"
    assert {name: (aside / name).read_bytes() for name in KEPT} == before  # every file of the first attempt kept
    assert json.loads((finished / "evaluations.json").read_text())[-1]["step"] == 180


def test_a_run_killed_while_writing_its_end_writes_it_again_on_resume(finished, tmp_path, capsys):
    """Its checkpoint at the total is complete, model.zip and summary.json are not there: a resume trains nothing
    and writes the end (the trainer's rule for either env), saying how to train longer."""
    (finished / "model.zip").unlink()
    (finished / "summary.json").unlink()
    evaluations = (finished / "evaluations.json").read_text()
    capsys.readouterr()
    assert resume(tmp_path) == 0
    out = capsys.readouterr().out
    assert "resuming at step 120" in out and "give --total-timesteps above 120 to train longer" in out
    assert (finished / "model.zip").is_file() and json.loads((finished / "summary.json").read_text())["steps"] == 120
    assert (finished / "evaluations.json").read_text() == evaluations  # the final model was evaluated already
