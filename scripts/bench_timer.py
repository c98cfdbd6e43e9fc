"""The benchmarks' one timer (scripts/benchmark.py and every bench_* section use it) and the
wording of its ratios.

    median_ms({"pcops": ours, "peer": theirs}, repeats=7, budget_s=20.0)  # {"pcops": ms, "peer": ms}
    median_ms(step, device=torch.device("cuda"))                          # ms of one function

How a figure is made:

* warm-up: one call of each function first (compilation, caches, thread pools);
* turns: the functions take turns, so a drift in the machine's speed falls on all of them alike;
* with several functions, in its turn each runs twice and its second call is timed: a call right
  after another library's was slowed by that library's threads winding down (at 10^4 points,
  pcops.knn by 4-9% after open3d or cKDTree, pykdtree by 0-3%), and in a fixed order the same
  function always followed the same other;
* ``repeats`` turns; more (up to 8x) while the turns took under ``min_s`` seconds in all (fast
  rows: the median of a few-millisecond row over 7 turns moved by up to 20% between runs);
  fewer once they took ``budget_s`` (at least two turns, one when ``repeats`` is 1);
* the median of each function's timed calls, in milliseconds;
* on a CUDA ``device`` each timed call lies between two CUDA events and the device is
  synchronised after it (and after the warm-up); elsewhere ``clock`` measures it:
  ``time.perf_counter`` (wall time) or ``time.process_time`` (the process's CPU time: the work
  each implementation does, whatever else runs on the machine; with one thread for everyone).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Union

import torch


def _sync(device) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fns: Union[Callable, dict], *, repeats: int = 5, budget_s: float = 30.0, min_s: float = 0.0,
              device=None, clock: Callable[[], float] = time.perf_counter) -> Union[float, dict]:
    """Median milliseconds of each function of ``fns`` ({name: function}: {name: ms}), or of one
    function (its ms), measured as the module docs say."""
    single = callable(fns)
    table = {"fn": fns} if single else dict(fns)
    cuda = device is not None and torch.device(device).type == "cuda"
    settle = len(table) > 1
    for fn in table.values():
        fn()
    _sync(device)
    times = {name: [] for name in table}
    start = time.perf_counter()
    least = min(2, repeats)
    for turn in range(1, 8 * repeats + 1):
        for name, fn in table.items():
            if settle:
                fn()
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                _sync(device)
                begin.record()
                fn()
                end.record()
                torch.cuda.synchronize(device)
                times[name].append(begin.elapsed_time(end))
            else:
                t0 = clock()
                fn()
                times[name].append(1e3 * (clock() - t0))
        elapsed = time.perf_counter() - start
        if (turn >= least and elapsed > budget_s) or (turn >= repeats and elapsed >= min_s):
            break
    out = {name: statistics.median(v) for name, v in times.items()}
    return out["fn"] if single else out


def once_s(fn: Callable, device=None) -> float:
    """Wall seconds of one call of ``fn`` (a first, compiling call), the device synchronised."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def speed(ratio: float, digits: int = 1) -> str:
    """A peer / pcops time ratio in words: "1.3x faster", "1.2x slower" (never "0.8x faster")."""
    if ratio >= 1:
        return f"{ratio:.{digits}f}x faster"
    return f"{1 / ratio:.{digits}f}x slower"
