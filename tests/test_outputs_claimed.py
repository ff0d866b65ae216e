"""Two evaluations given one --out: the second is refused at once, naming the first, instead of both running and the
first one's results silently replaced; the claim ends with the process that held it."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOLD = ("import sys; from pathlib import Path; from agents.{module} import {check}; {check}({arg}); "
        "print('held', flush=True); sys.stdin.read()")


@pytest.mark.parametrize("module, check, arg, out", [
    ("bild.comparison", "check_out", "Path(sys.argv[1])", "results"),  # evaluate.py: a folder
    ("common.checks", "check_outputs", "[Path(sys.argv[1])], False", "serving.json"),  # evaluate.py --env serve: a file
])
def test_a_second_writer_of_one_out_is_refused_while_the_first_runs(module, check, arg, out, tmp_path):
    from agents.bild import comparison
    from agents.common import checks
    from bild_env.command import UsageError, release_outputs

    out = tmp_path / out
    first = subprocess.Popen([sys.executable, "-c", HOLD.format(module=module, check=check, arg=arg), str(out)],
                             cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        second = (lambda: comparison.check_out(out)) if module == "bild.comparison" else (
            lambda: checks.check_outputs([out], False))
        with pytest.raises(UsageError, match=rf"another command \(pid {first.pid}\) is writing"):
            second()
    finally:
        first.stdin.close()
        first.wait(timeout=60)
    second()  # the first has ended: free
    release_outputs()
    assert not [p for p in tmp_path.rglob("*.lock")]


def test_a_second_command_given_one_out_is_refused_while_the_first_runs(tmp_path):
    """Every command's --out goes through bild_env.command.writable_file (the benchmarks', the fill's, the profile's):
    the file is claimed there, before any work, so a second command given it is refused at once."""
    from bild_env.command import UsageError, release_outputs, writable_file

    out = tmp_path / "new" / "bench.json"  # its folder is made by the claim
    hold = ("import sys; from bild_env.command import writable_file; writable_file(sys.argv[1]); "
            "print('held', flush=True); sys.stdin.read()")
    first = subprocess.Popen([sys.executable, "-c", hold, str(out)], cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        with pytest.raises(UsageError, match=rf"--out {out}: another command \(pid {first.pid}\) is writing"):
            writable_file(out)
        assert writable_file(out, claim=False) == out  # a check alone claims nothing
    finally:
        first.stdin.close()
        first.wait(timeout=60)
    assert writable_file(out) == out  # the first has ended: free
    writable_file(out)  # held by this process already: no error
    release_outputs()
    assert not list(tmp_path.rglob("*.lock"))
