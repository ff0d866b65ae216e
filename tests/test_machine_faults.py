"""Faults of the machine end as one line naming the path and what to do, exit 1, nothing damaged: a full disk (at
an ``--out``'s check, in a write of a run folder, anywhere in a command), a read-only or unusable cache folder.
Simulated in-process (an ``OSError`` raised where the write would fail): no test needs root or a real full disk."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from bild_env import command
from bild_env.command import Failure, Stopped, UsageError, check_room, machine_fault, run_command, writable_file


def failing(err: BaseException):
    def main(argv):
        raise err

    return main


def full(path: Path | None = None) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *([str(path)] if path else []))


def test_a_full_disk_anywhere_in_a_command_is_one_line_naming_the_path(tmp_path, capsys):
    assert run_command("prog", failing(full(tmp_path / "r" / "model.zip")), []) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"prog: error: no space left on the device at {tmp_path / 'r' / 'model.zip'} (")
    assert "free there): free some space there, or give a path on another disk, and run it again" in err


@pytest.fixture(autouse=True)
def nothing_written_yet(monkeypatch):
    """The folders a command noted it writes into (``writing_into``) start empty in each test."""
    monkeypatch.setattr(command, "_WRITING", {})


def test_a_writer_s_own_error_from_a_full_disk_is_the_machine_s(tmp_path, capsys):
    """zipfile or torch may raise their own error from the OSError: its cause decides."""
    try:
        try:
            raise full()
        except OSError as cause:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0") from cause
    except RuntimeError as wrapped:
        err = wrapped
    assert machine_fault(err).errno == errno.ENOSPC
    assert run_command("prog", failing(err), []) == 1
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and line.startswith(  # no folder it writes is low on space here: none is named
        "prog: error: no space left on the device on a disk this command writes to (its outputs, its run folder, the "
        "cache, the working folder): free some space, and run it again")


def test_an_unnamed_full_disk_names_the_fullest_folder_the_command_writes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BILD_ENV_CACHE", str(tmp_path / "cache"))
    from bild_env.paths import cache_dir

    cache_dir()  # the cache used: noted as written into
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: real(p)._replace(free=4096) if Path(p).is_relative_to(tmp_path) else real(p))
    assert run_command("prog", failing(full()), []) == 1
    line = capsys.readouterr().err
    assert f"no space left on the device at {tmp_path / 'cache'} (4 KB free there)" in line
    assert "set BILD_ENV_CACHE to a folder on another disk" in line  # the cache's disk: move the cache


@pytest.mark.parametrize("code, says", [(errno.EROFS, "a read-only file system"), (errno.EACCES, "permission denied")])
def test_a_read_only_cache_is_named_with_the_variable_to_set(code, says, tmp_path, monkeypatch, capsys):
    command.writing_into(tmp_path, "BILD_ENV_CACHE")  # as bild_env.paths.cache_dir notes the cache
    path = tmp_path / "costs" / "x.json"
    assert run_command("prog", failing(OSError(code, os.strerror(code), str(path))), []) == 1
    verb = "write" if code == errno.EROFS else "use"
    assert capsys.readouterr().err == (f"prog: error: cannot {verb} at {path}: {says}: set BILD_ENV_CACHE to a "
                                       f"folder you can write (it is {tmp_path})\n")
    assert run_command("prog", failing(OSError(code, os.strerror(code), "/elsewhere/x.json")), []) == 1
    assert "give a path you can write" in capsys.readouterr().err  # outside the cache: another path


def test_other_os_errors_are_bugs_and_debug_shows_every_trace(tmp_path):
    with pytest.raises(FileNotFoundError):
        run_command("prog", failing(FileNotFoundError(errno.ENOENT, "No such file", "x")), [])
    with pytest.raises(OSError):
        run_command("prog", failing(full(tmp_path)), ["--debug"])
    with pytest.raises(KeyboardInterrupt):
        run_command("prog", failing(KeyboardInterrupt()), ["--debug"])


@pytest.mark.parametrize("err, line", [
    (KeyboardInterrupt(), "prog: stopped by SIGINT before it finished: run the same command again\n"),
    (KeyboardInterrupt("SIGTERM"), "prog: stopped by SIGTERM before it finished: run the same command again\n"),
    (Stopped("stopped by SIGINT: x.json holds 1 load"), "prog: stopped by SIGINT: x.json holds 1 load\n")])
def test_a_stop_is_exit_130_and_one_line(err, line, capsys):
    assert run_command("prog", failing(err), []) == 130
    assert capsys.readouterr().err == line


def test_an_out_on_a_full_disk_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """An empty file can be made on a full disk: the check writes and syncs a real block."""
    def no_room(fd):
        raise full()

    monkeypatch.setattr(command.os, "fsync", no_room)
    with pytest.raises(Failure, match=rf"--out {tmp_path / 'r.json'}: no space left on the device at {tmp_path}"):
        writable_file(tmp_path / "r.json", claim=False)
    assert run_command("prog", lambda argv: writable_file(tmp_path / "r.json", claim=False), []) == 1
    assert "free some space there, or give a path on another disk" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # the probe left nothing


def test_an_out_on_a_disk_with_under_the_stated_minimum_free_is_refused(tmp_path, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=400 * 1024))
    with pytest.raises(Failure, match=rf"400 KB free at {tmp_path}, under the {command.MIN_FREE_MB} MB"):
        check_room(tmp_path, "--out", tmp_path / "r.json")
    monkeypatch.setattr(shutil, "disk_usage", real)
    check_room(tmp_path, "--out", tmp_path / "r.json")  # room: nothing said


def test_an_out_where_no_file_can_be_made_stays_a_usage_error():
    with pytest.raises(UsageError, match="cannot write into /proc"):
        check_room(Path("/proc"), "--out", Path("/proc/r.json"))


def test_a_write_atomic_on_a_full_disk_keeps_the_file_and_names_it(tmp_path):
    from agents.common.files import stale_temporaries, write_atomic

    target = tmp_path / "model.zip"
    target.write_bytes(b"the checkpoint before")

    def half_then_full(f):
        f.write(b"half a zip")
        raise RuntimeError("file write failed") from full()  # as torch's writer raises it

    with pytest.raises(OSError) as caught:
        write_atomic(target, half_then_full)
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(target)
    assert target.read_bytes() == b"the checkpoint before" and not stale_temporaries(tmp_path)


def test_a_cache_folder_that_cannot_be_made_or_written_is_named(tmp_path, monkeypatch):
    from bild_env import paths

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("BILD_ENV_CACHE", str(tmp_path / "a-file" / "cache"))
    with pytest.raises(Failure, match=r"the cache folder .*a-file/cache/costs cannot be used \(Not a directory\): set "
                                      r"BILD_ENV_CACHE to a folder you can write \(it is now .*a-file/cache\)"):
        paths.cache_dir("costs")
    monkeypatch.setenv("BILD_ENV_CACHE", str(tmp_path / "cache"))
    assert paths.cache_dir("costs").is_dir()
    monkeypatch.setattr(paths.os, "access", lambda path, mode: False)  # as on a read-only mount (root passes chmod)
    with pytest.raises(Failure, match=r"cache folder .*cache/costs cannot be used \((a read-only file system|no "
                                      r"permission to write there)\): set BILD_ENV_CACHE"):
        paths.cache_dir("costs")


def test_sigterm_stops_any_command_as_ctrl_c_does(signals_not_ignored, capsys):
    """``finally`` blocks run and ``--out`` locks are given back: a SIGTERM is a ``KeyboardInterrupt`` in a command."""
    import signal
    import time

    cleaned = []

    def main(argv):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler raises before this ends
        finally:
            cleaned.append(True)

    assert run_command("prog", main, []) == 130 and cleaned == [True]
    assert capsys.readouterr().err == "prog: stopped by SIGTERM before it finished: run the same command again\n"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # given back after the command


def test_a_run_folder_whose_lock_cannot_be_written_is_named_and_left_as_it_was(tmp_path, monkeypatch):
    import agents.common.lock as lock

    def no_room(fd, data, offset):
        raise full()

    monkeypatch.setattr(lock.os, "pwrite", no_room)
    with pytest.raises(OSError) as caught:
        lock.RunLock.acquire(tmp_path / "new-run")
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(tmp_path / "new-run" / "train.lock")
    assert not (tmp_path / "new-run").exists()  # the folder it made for the run, removed again
    (tmp_path / "old-run").mkdir()
    (tmp_path / "old-run" / "model.zip").write_bytes(b"kept")
    with pytest.raises(OSError):
        lock.RunLock.acquire(tmp_path / "old-run")
    assert [p.name for p in (tmp_path / "old-run").iterdir()] == ["model.zip"]
