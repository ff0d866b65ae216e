"""Logs that continue across a resume, for both trainers: TensorBoard events and ``progress.csv``.

``make_logger`` keeps the rows of ``progress.csv`` up to the checkpoint's step (``ResumableCSV``: appended line by
line, a new column rewrites the file whole) and hides the TensorBoard events a killed run wrote after it
(``purge_step``), so no step is logged twice and none before the checkpoint is lost.
"""

from __future__ import annotations

import csv
import io
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stable_baselines3.common.logger import (HumanOutputFormat, KVWriter, Logger, TensorBoardOutputFormat,
                                             filter_excluded_keys)

from agents.common.files import write_atomic

STEP_KEY = "time/total_timesteps"  # the column of progress.csv that says a row's step (every row has it)
PROGRESS = "progress.csv"

def progress_rows(path: Path, upto: int | None = None,
                  say: Callable[[str], None] | None = None) -> tuple[list[str], list[list[str]]]:
    """The header and rows of a ``progress.csv``; with ``upto``, the rows before the first one past step ``upto``
    (what follows belongs to a branch a resume throws away). A torn last line is left out, and so is a garbled row
    (bytes that are not text, a line the csv module cannot read, a step that is no number): that row only, never the
    rows after it; ``say`` tells how many were left out. A header that cannot be read: ``ValueError``."""
    if not path.is_file():
        return [], []
    text = path.read_bytes().decode("utf-8", errors="replace")  # junk bytes garble their row, not the file
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]  # the last line was cut by a kill
    lines = [line.rstrip("\r") for line in text.split("\n") if line.strip()]
    header = _csv_line(lines[0]) if lines else None
    if not lines:
        return [], []
    if not header or "\ufffd" in lines[0]:
        raise ValueError(f"{path}: its header line cannot be read")
    col = header.index(STEP_KEY) if STEP_KEY in header else None
    rows, garbled = [], 0
    for line in lines[1:]:
        row = _csv_line(line)
        step = _step(row[col]) if row is not None and col is not None and col < len(row) else None
        if row is None or "\ufffd" in line or (col is not None and step is None):
            garbled += 1
        elif upto is not None and col is not None and step > upto:
            break  # rows are in order: the rest is the branch the resume throws away
        else:
            rows.append(row)
    if garbled and say:
        say(f"{path}: left out {garbled} garbled row(s) (each alone; the rows around them are kept)")
    return header, rows


def _csv_line(line: str) -> list[str] | None:
    try:
        return next(csv.reader([line]))
    except (csv.Error, StopIteration):  # a NUL byte, an unclosed quote
        return None


def _step(cell: str) -> int | None:
    try:
        value = float(cell)
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and value >= 0 else None


class ResumableCSV(KVWriter):
    """SB3's ``progress.csv`` that a resume continues: started from the rows kept (``progress_rows``), each row
    appended and flushed; a row with new columns rewrites the file whole (renamed into place, so a kill leaves
    the old file or the new one, never half of each). SB3's own ``CSVOutputFormat`` truncates the file on open."""

    def __init__(self, path: Path, header: list[str] | None = None, rows: list[list[str]] | None = None) -> None:
        self.path, self.keys = Path(path), list(header or [])
        self._rewrite(rows or [])

    def _rewrite(self, rows: list[list[str]]) -> None:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        if self.keys:
            writer.writerow(self.keys)
        writer.writerows(r + [""] * (len(self.keys) - len(r)) for r in rows)
        text = buf.getvalue()
        write_atomic(self.path, lambda f: f.write(text.encode()))
        self.file = open(self.path, "a", newline="")  # noqa: SIM115 - held open for appends, closed by close()

    def write(self, key_values: dict[str, Any], key_excluded: dict[str, tuple[str, ...]], step: int = 0) -> None:
        key_values = filter_excluded_keys(key_values, key_excluded, "csv")
        extra = [k for k in key_values if k not in self.keys]
        if extra:
            self.file.close()
            _, rows = progress_rows(self.path)
            self.keys += sorted(extra)
            self._rewrite(rows)
        values = [key_values.get(k) for k in self.keys]
        csv.writer(self.file, lineterminator="\n").writerow("" if v is None else v for v in values)
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def make_logger(run_dir: Path, resumed_at: int | None, say: Callable[[str], None] | None = None,
                stdout: bool = False) -> Logger:
    """TensorBoard events and ``progress.csv`` in the run folder (and tables on stdout with ``stdout``); on resume at
    step ``resumed_at`` both continue from it: csv rows up to it kept, later events hidden (``purge_step``: every
    step >= resumed_at + 1; those at ``resumed_at`` itself stay)."""
    from torch.utils.tensorboard import SummaryWriter

    tensorboard = TensorBoardOutputFormat(str(run_dir))
    if resumed_at is not None:
        tensorboard.writer.close()
        tensorboard.writer = SummaryWriter(log_dir=str(run_dir), purge_step=resumed_at + 1)
    header, rows = [], []
    if resumed_at is not None:
        try:
            header, rows = progress_rows(run_dir / PROGRESS, resumed_at, say)
        except ValueError as err:  # kept beside, never overwritten; the TensorBoard events hold the same numbers
            aside = run_dir / f"progress.unreadable-{int(time.time())}.csv"
            os.replace(run_dir / PROGRESS, aside)
            (say or print)(f"{err}: moved to {aside.name}, and a new {PROGRESS} started")
    formats = [tensorboard, ResumableCSV(run_dir / PROGRESS, header, rows)]
    return Logger(folder=str(run_dir), output_formats=formats + ([HumanOutputFormat(sys.stdout)] if stdout else []))
