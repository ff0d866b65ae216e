"""bild_env.command: one way every command fails (a line and an exit status; the trace with --debug or for a bug),
and the checks every command runs before any work."""

import math
from dataclasses import dataclass

import pytest

from bild_env.command import Failure, UsageError, UsageExit, check_counts, check_options, run_command, writable_file
from bild_env.models.device import DeviceError, usable_device


def raising(err):
    def main(argv):
        main.argv = argv
        if err is not None:
            raise err
        return 3

    return main


@pytest.mark.parametrize("err, status", [(UsageError("--x must be 1"), 2), (UsageExit("error: --x must be 1"), 2),
                                         (DeviceError("--x must be 1"), 2), (Failure("--x must be 1"), 1)])
def test_a_known_error_is_one_line_and_a_status(err, status, capsys):
    main = raising(err)
    assert run_command("prog", main, ["a", "b"]) == status and main.argv == ["a", "b"]
    assert capsys.readouterr().err == "prog: error: --x must be 1\n"
    with pytest.raises(type(err)):  # --debug: the trace, as raised
        run_command("prog", main, ["a", "--debug"])
    assert main.argv == ["a"]  # --debug is no option of the command


def test_a_bug_keeps_its_trace_and_a_result_is_a_status():
    with pytest.raises(ZeroDivisionError):
        run_command("prog", raising(ZeroDivisionError("division by zero")), [])
    assert run_command("prog", raising(None), []) == 3
    assert run_command("prog", lambda argv: {"a report": 1}, []) == 0


def test_out_is_checked_before_any_work(tmp_path):
    (tmp_path / "a-file").write_text("")
    assert writable_file(tmp_path / "new" / "r.json") == tmp_path / "new" / "r.json" and writable_file("") is None
    with pytest.raises(UsageError, match="is a folder"):
        writable_file(tmp_path)
    with pytest.raises(UsageError, match="a-file is a file"):
        writable_file(tmp_path / "a-file" / "r.json")
    with pytest.raises(UsageError, match="cannot write into /proc"):
        writable_file("/proc/r.json")


def test_counts_probabilities_and_finite_numbers_are_named():
    @dataclass
    class Options:
        batch: int = 1
        p: float = 0.5
        w: float = 1.0

    check_options(Options(), at_least_one=("batch",), probabilities=("p",))
    for bad, says in ((Options(batch=0), "--batch must be at least 1"), (Options(p=1.5), "--p is a probability"),
                      (Options(w=math.nan), "--w must be a finite number"), (Options(w=math.inf), "--w must be")):
        with pytest.raises(UsageError, match=says):
            check_options(bad, at_least_one=("batch",), probabilities=("p",))


def test_a_count_that_is_no_integer_or_too_small_is_named_with_its_note():
    @dataclass
    class Options:
        episodes: int = 1
        freq: int = 0
        limit: int | None = None

    least = {"episodes": 1, "freq": 0, "limit": 1}
    check_counts(Options(), least, optional=("limit",))
    for bad, says in ((Options(episodes=0), "--episodes must be an integer >= 1, got 0: per load"),
                      (Options(episodes=True), "--episodes must be an integer >= 1, got True"),
                      (Options(freq=-1), "--freq must be an integer >= 0, got -1$"),
                      (Options(freq=2.0), "--freq must be an integer >= 0, got 2.0"),
                      (Options(limit=0), "--limit must be an integer >= 1, got 0")):
        with pytest.raises(UsageError, match=says):
            check_counts(bad, least, {"episodes": "per load"}, optional=("limit",))
    with pytest.raises(UsageError, match="--limit must be an integer >= 1, got None"):
        check_counts(Options(), least)  # None only where optional


def test_a_device_torch_cannot_use_here_is_named_with_those_it_can():
    assert usable_device("cpu").type == "cpu"
    with pytest.raises(DeviceError, match="unknown device 'tpu': this machine can use cpu"):
        usable_device("tpu")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="device 'cuda:3' is not usable here"):
            usable_device("cuda:3")
