"""The phases of a long job, one progress line each: what runs, how long it took, how long is left, and peak memory.

    phases = Phases(("fetch and convert", "time the tables", "build trees", "train"))
    with phases.phase("time the tables", unit="forward", total=948) as bar:   # the work, counted before it starts
        ...; bar.update(n)
    phases.summary()                                                 # per phase wall and CPU seconds, peak memory

A phase prints a line when it starts, one every ``PhaseBar.every_s`` seconds while it reports progress (units done
of its total, elapsed, and the time left at the recent rate, or "estimating" until it can say), and one when it ends (its wall and CPU
time, and the job's so far). Lines, not a redrawn bar: they read the same in a terminal, a log file or CI. The CPU
time is this process's and its children's (``os.times``): on a shared CPU it says what the job itself used where the
wall time also holds the waiting. Peak memory is ``resource.getrusage``'s ``ru_maxrss`` of this process and of its
largest child (``peak_memory_mb``), and, where ``/proc`` exists, the largest sum of the resident memory of this
process and its live children together, sampled every second while a ``Phases`` lives (``MemorySampler``: what the
machine had to hold at once when a second process fills trees beside the job).
"""

from __future__ import annotations

import bisect
import contextlib
import os
import resource
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence

from tqdm import tqdm


def peak_memory_mb() -> dict[str, float]:
    """Peak resident memory in MB (``ru_maxrss``, kB on Linux): ``self``, ``children`` (the largest child waited for:
    a child forked by a large process, e.g. ``lscpu`` or ``pip``, counts the parent's pages it was forked with, so it
    can read as much as ``self`` without a second copy ever existing) and ``max`` of the two."""
    scale = 1 / 1024 if sys.platform != "darwin" else 1 / 2**20  # macOS reports bytes
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale
    return {"self": round(own, 1), "children": round(kids, 1), "max": round(max(own, kids), 1)}


def _proc_mb(path: str, key: str) -> float | None:
    """The kB figure of the line ``key`` (e.g. "VmRSS:") of ``path`` under ``/proc``, in MB; None where it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def resident_mb(pid: int | str = "self") -> float:
    """Resident memory (``VmRSS``) of process ``pid`` in MB, read from ``/proc`` (0 where it cannot be read)."""
    return _proc_mb(f"/proc/{pid}/status", "VmRSS:") or 0.0


def proportional_mb(pid: int | str = "self") -> float:
    """Proportional memory (``Pss``) of process ``pid`` in MB: its resident memory, with each page it shares with other
    processes (a weight file both the job and its child map, libraries) counted as its share, so that the sum over
    processes counts every page once. Read from ``/proc/<pid>/smaps_rollup``; ``resident_mb`` where that cannot be read."""
    pss = _proc_mb(f"/proc/{pid}/smaps_rollup", "Pss:")
    return resident_mb(pid) if pss is None else pss


def children_of(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (read from ``/proc``; empty where it cannot be read)."""
    kids = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return kids
    for name in names:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # after the command's name, which may hold spaces
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                kids.append(int(name))
    return kids


class MemorySampler:
    """The largest memory of this process and its live children together (``peak_mb``: the sum of their proportional
    memory, ``proportional_mb``, so that the pages they share are counted once; ``peak_rss_sum_mb``: the sum of their
    resident memory, which counts shared pages once per process), sampled every ``every_s`` seconds by a daemon thread
    (Linux: ``/proc``; elsewhere it samples nothing and ``peak_mb`` stays None). The main job's two processes both map
    the target's weight file: in float32 (the weights used where they lie in the file) about 640 MB of it each."""

    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s, self.peak_mb, self.peak_rss_sum_mb = every_s, None, None
        self._stop = threading.Event()
        if os.path.exists("/proc/self/status"):
            self.sample()
            threading.Thread(target=_sample_while, args=(weakref.ref(self), self._stop, every_s), name="memory-sampler",
                             daemon=True).start()

    def close(self) -> None:
        """Stop sampling (the thread also ends once the sampler is garbage: reading a large process's ``smaps_rollup``
        takes about 10 ms, so samplers left running in one process, a test session's, add up)."""
        self._stop.set()

    def sample(self) -> float:
        """This process and its children now: their proportional memory summed (MB); the peaks updated."""
        pids = [os.getpid(), *children_of(os.getpid())]
        total = sum(proportional_mb(pid) for pid in pids)
        self.peak_mb = max(self.peak_mb or 0.0, total)
        self.peak_rss_sum_mb = max(self.peak_rss_sum_mb or 0.0, sum(resident_mb(pid) for pid in pids))
        return total



def _sample_while(ref: weakref.ReferenceType, stop: threading.Event, every_s: float) -> None:
    """A ``MemorySampler``'s thread: a sample every ``every_s`` seconds until it is closed or garbage."""
    while not stop.wait(every_s):
        sampler = ref()
        if sampler is None:
            return
        sampler.sample()
        del sampler


def cpu_seconds() -> float:
    """User and system CPU seconds of this process and its children waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class PhaseBar:
    """A phase's progress: ``update(n)`` units of ``total``; prints a line at most every ``every_s`` seconds with the
    units done, elapsed time and time left.

    The total is known before the phase starts where the caller can count its work (``total=``); where the work is
    announced piece by piece on the way (``expect(n)``, or tqdm's ``bar.total += n``), a ``plan(n)`` made before it
    starts holds the whole count, and the announcements grow the total only where they go past it. The count shown never exceeds the total (work beyond it raises the
    total). Time left is read from the recent rate: the units done over the last ``RECENT`` of the elapsed time (at
    least the last two progress reports), so that slow first units (kernels chosen, trees filled) do not weigh on the
    estimate once the work runs at its own pace; until ``MIN_DONE`` of the total is done and two reports exist, the
    line says "estimating". ``clock`` (seconds, monotonic) is for tests."""

    RECENT = 0.5  # share of the units done (the latest ones) the rate is read over
    MIN_DONE = 0.02  # share of the total done before an estimate is shown

    def __init__(self, label: str, unit: str, say: Callable[[str], None], every_s: float, total: float = 0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.label, self.unit, self.say, self.every_s, self.clock = label, unit, say, every_s, clock
        self.n, self.planned, self.expected = 0.0, 0.0, float(total)
        self.start = self._last = clock()
        self._times, self._done = [self.start], [0.0]  # a mark per report: when, and the units done by then

    @property
    def total(self) -> float:
        """The units the phase will do: the plan, or what was announced, whichever is more (at least the units done)."""
        return max(self.planned, self.expected, self.n)

    @total.setter
    def total(self, value: float) -> None:  # tqdm's protocol: ``bar.total += n`` announces n more units
        self.expect(value - self.total)

    def plan(self, total: float) -> None:
        """The phase's whole count, known before its work starts (``expect`` then grows it only past this)."""
        self.planned = float(total)

    def expect(self, n: float) -> None:
        """``n`` more units announced on the way (the total grows only where they go past the plan)."""
        self.expected += max(0.0, n)

    def update(self, n: float = 1) -> None:
        self.n += n
        now = self.clock()
        self._times.append(now)
        self._done.append(self.n)
        if now - self._last >= self.every_s:
            self._last = now
            self.say(self.line())

    def refresh(self) -> None:  # tqdm's name: callers that grow ``total`` may call it
        pass

    def rate(self) -> float | None:
        """Units per second over the latest ``RECENT`` of the units done (from the report where the first of them was
        done, at least two reports back); None before two reports or where no time passed."""
        if len(self._done) < 3:  # the start and two reports
            return None
        first = (1 - self.RECENT) * self.n
        i = bisect.bisect_left(self._done, first)  # the report that finished the window's first unit ...
        i = i - 1 if self._done[i] > first else i  # ... began at the mark before it
        i = min(i, len(self._done) - 3)
        dt, dn = self._times[-1] - self._times[i], self.n - self._done[i]
        return dn / dt if dt > 0 and dn > 0 else None

    def left_s(self) -> float | None:
        """Seconds left at the recent rate (None while estimating: without a total, before ``MIN_DONE`` of it, or
        before the rate is known)."""
        if not self.total or self.n < self.MIN_DONE * self.total:
            return None
        rate = self.rate()
        return None if rate is None else (self.total - self.n) / rate

    def line(self) -> str:
        elapsed = self.clock() - self.start
        left = self.left_s()
        done = f"{self.n:.0f}/{self.total:.0f} {self.unit}s" if self.total else f"{self.n:.0f} {self.unit}s"
        return (f"{self.label}: {done}, {tqdm.format_interval(elapsed)} elapsed, "
                + ("estimating the time left" if left is None else f"~{tqdm.format_interval(left)} left"))


class Phases:
    """The named phases of a job, timed in order (``phase``; ``skip`` for one that has nothing to do)."""

    def __init__(self, names: Sequence[str], say: Callable[[str], None] | None = None, every_s: float = 30.0) -> None:
        self.names = tuple(names)
        self.say = say or (lambda text: print(text, file=sys.stderr, flush=True))
        self.every_s = every_s
        self.start, self.start_cpu = time.perf_counter(), cpu_seconds()
        self.records: dict[str, dict[str, object]] = {}
        self.memory = MemorySampler()

    def close(self) -> None:
        """Stop the memory sampler (its peaks stay readable)."""
        self.memory.close()

    def peak_memory(self) -> dict[str, float]:
        """``peak_memory_mb()`` and, where sampled, ``together``: this process and its children at once (MB, each page
        once: ``MemorySampler``), and ``together_rss_sum``: their resident memory summed (shared pages once per process)."""
        peak = peak_memory_mb()
        if self.memory.peak_mb is not None:
            peak["together"] = round(max(self.memory.peak_mb, self.memory.sample()), 1)
            peak["together_rss_sum"] = round(self.memory.peak_rss_sum_mb, 1)
        return peak

    def memory_words(self) -> str:
        """The peak memory in words: "2143 MB (3577 MB with the processes beside it)"."""
        peak = self.peak_memory()
        together = peak.get("together")
        return f"{peak['max']:.0f} MB" + (f" ({together:.0f} MB with its children at once)"
                                          if together and together > peak["max"] + 1 else "")

    def _label(self, name: str) -> str:
        return f"[{self.names.index(name) + 1}/{len(self.names)}] {name}"

    @contextlib.contextmanager
    def phase(self, name: str, unit: str = "step", total: float = 0) -> Iterator[PhaseBar]:
        """Time phase ``name`` (one of ``names``): a start line, progress lines from the bar it yields, an end line."""
        if name not in self.names:
            raise ValueError(f"unknown phase {name!r}: one of {self.names}")
        label = self._label(name)
        self.say(f"{label}: started ({tqdm.format_interval(time.perf_counter() - self.start)} into the job)")
        bar = PhaseBar(label, unit, self.say, self.every_s, total)
        cpu0, ended = cpu_seconds(), "stopped after"  # unless the block ends normally
        try:
            yield bar
            ended = "done in"
        finally:
            wall, cpu = time.perf_counter() - bar.start, cpu_seconds() - cpu0
            self.records[name] = {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "units": round(bar.n),
                                  "unit": unit} | ({} if ended == "done in" else {"stopped": True})
            self.say(f"{label}: {ended} {tqdm.format_interval(wall)} (CPU {tqdm.format_interval(cpu)}); job "
                     f"{tqdm.format_interval(time.perf_counter() - self.start)} so far, peak memory "
                     f"{self.memory_words()}")

    def skip(self, name: str, why: str) -> None:
        """Record phase ``name`` as having nothing to do, and say why."""
        self.records[name] = {"wall_s": 0.0, "cpu_s": 0.0, "skipped": why}
        self.say(f"{self._label(name)}: skipped ({why})")

    def summary(self) -> dict[str, object]:
        """The job so far: per phase wall and CPU seconds, the total, and peak memory (MB)."""
        return {"phases": {name: self.records[name] for name in self.names if name in self.records},
                "total_wall_s": round(time.perf_counter() - self.start, 1),
                "total_cpu_s": round(cpu_seconds() - self.start_cpu, 1), "peak_memory_mb": self.peak_memory()}
