"""Transport-loss benchmarks: pcops.sinkhorn_divergence against GeomLoss, earth_movers_distance against POT.

Run through ``scripts/benchmark.py --only transport`` (``--quick`` shrinks them). Rows are
medians of interleaved calls (scripts/bench_timer.py) and the peak memory of each call; the
ratio peer / pcops is what to read (> 1: pcops is faster or smaller).

* sinkhorn_divergence: float32 clouds of the op table's builder (``x`` 2n/3 points, ``y`` n),
  GeomLoss's defaults (p = 2, blur = 0.05, scaling = 0.5), a train step (the loss and its
  gradient to ``x``) against GeomLoss 0.3's ``SamplesLoss("sinkhorn", backend="tensorized")``
  while its four (N, M) matrices fit in memory (its "online" backend needs KeOps, which this
  machine does not have); the two values are checked equal (same definition, same settings,
  so equal accuracy). Above that size pcops runs alone: its memory stays linear in n.
Peak memory is the growth of the resident set during a call (a thread samples it every 0.5 ms
in a fresh process, after a warm-up call): what the call allocates beyond its inputs.

* earth_movers_distance: equal-size float64 clouds, the exact value, against POT's exact
  network simplex ``ot.emd2`` on the same (n, n) squared-distance matrix (built by POT's
  ``ot.dist``); the two values are checked equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from bench_timer import median_ms

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(SCRIPTS)
GEOMLOSS_MAX = 10_000  # its tensorized backend holds 4 (N, M) float32 matrices and as many temporaries: 3 GB here


def _sinkhorn_inputs(n: int):
    sys.path.insert(0, ROOT)
    from tests.op_table import BY_NAME

    made = BY_NAME["sinkhorn_divergence"].inputs(0, n=n, dtype=torch.float32)
    return made["x"], made["y"]


def _emd_inputs(n: int):
    sys.path.insert(0, ROOT)
    from tests.op_table import BY_NAME

    made = BY_NAME["earth_movers_distance"].inputs(0, n=n)
    return made["x"], made["y"]


def _calls(which: str, n: int) -> dict:
    """{library: function of no arguments} for one row."""
    import pcops

    if which == "sinkhorn":
        x, y = _sinkhorn_inputs(n)
        x.requires_grad_()

        def ours():
            loss = pcops.sinkhorn_divergence(x, y, blur=0.05, scaling=0.5, validate=False)
            loss.backward()
            return loss.detach()

        fns = {"pcops": ours}
        if n <= GEOMLOSS_MAX:
            from geomloss import SamplesLoss

            peer = SamplesLoss("sinkhorn", p=2, blur=0.05, scaling=0.5, backend="tensorized")

            def theirs():
                loss = peer(x, y)
                loss.backward()
                return loss.detach()

            fns["geomloss_tensorized"] = theirs
        return fns
    import numpy as np
    import ot

    x, y = _emd_inputs(n)
    uniform = np.full(n, 1.0 / n)
    return {"pcops": lambda: pcops.earth_movers_distance(x, y, p=2).distance,
            "pot_emd2": lambda: torch.tensor(ot.emd2(uniform, uniform, ot.dist(x.numpy(), y.numpy()), numItermax=10**8))}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_child(which: str, n: int, library: str) -> None:
    """In a fresh process, after a warm-up call: the growth (MB) of the resident set during one
    call over its size before (sampled every 0.5 ms by a thread), as one JSON line."""
    import threading
    import time

    fn = _calls(which, n)[library]
    fn()  # loads kernels, fills caches
    before = peak = _rss_mb()
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_mb())
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    fn()
    done.set()
    watcher.join()
    print(json.dumps({"peak_mb": round(max(peak, _rss_mb()) - before, 1)}))


def _peak_mb(which: str, n: int, library: str) -> float | None:
    out = subprocess.run([sys.executable, __file__, "--peak", which, str(n), library], capture_output=True, text=True, cwd=SCRIPTS)
    if out.returncode:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]


def run(quick: bool = False) -> list[dict]:
    sizes = {"sinkhorn": (300, 1_000) if quick else (1_000, 10_000, 30_000), "emd": (100, 300) if quick else (1_000, 4_096)}
    repeats = 2 if quick else 3
    rows = []
    for which, bench in (("sinkhorn", "sinkhorn_divergence"), ("emd", "earth_movers_distance")):
        for n in sizes[which]:
            fns = _calls(which, n)
            values = {name: float(fn()) for name, fn in fns.items()}
            ours = values["pcops"]
            for name, v in values.items():
                assert abs(v - ours) <= 1e-4 * abs(ours) + 1e-7, (bench, n, values)
            big = n > 10_000
            ms = median_ms(fns, repeats=1 if big else repeats, budget_s=float("inf"))
            ms = {name: round(t, 3) for name, t in ms.items()}
            measure = not quick or n == sizes[which][-1]  # (--quick: a fresh process per library for the last size only)
            peak = {name: _peak_mb(which, n, name) if measure else None for name in fns}
            peer = next((name for name in ms if name != "pcops"), None)
            memory = f"{peak['pcops']} MB" if peer is None else f"{peak['pcops']} / {peak[peer]} MB"
            rows.append({"bench": bench, "n": n, "peak memory pcops / peer": memory, "value": round(ours, 6), "ms": ms})
            line = f"{bench:<22} n={n:>7,}  pcops {ms['pcops']:>10,.1f} ms {peak['pcops'] or 0:>8,.1f} MB"
            if peer is not None:
                line += (f"  {peer} {ms[peer]:>10,.1f} ms {peak[peer] or 0:>8,.1f} MB  {peer} / pcops: time {ms[peer] / ms['pcops']:.2f}, "
                         f"memory {(peak[peer] or 0) / max(peak['pcops'] or 0, 0.1):.1f}")
            else:
                line += "  (GeomLoss tensorized: its (N, M) matrices do not fit)"
            print(line, flush=True)
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["--peak"]:
        _peak_child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        run("--quick" in sys.argv)
