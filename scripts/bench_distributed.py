"""pcops.distributed on one machine: each rank's time and halo against the single-process op.

    python scripts/bench_distributed.py [--points 1000000] [--ranks 2] [--quick]

A cloud (uniform in the unit cube, float32) is split into spread shares (every ranks-th point,
as data arrives unsorted) and moved to spatial shares with ``pcops.distributed.partition``; on
the spatial shares each rank runs ``knn`` (k = 16, self-queries), ``radius_aggregate`` (radius
0.01 at 10^6 points, features of 8 channels) and ``ball_query``. Printed per op: the slowest
rank's median time (3 calls after a warm-up), the bytes each rank received (mean over ranks,
as a share of the whole cloud's coordinates and features), and the single-process op on the
whole cloud in the parent process with all of torch's threads. On one machine the ranks share
its cores (each rank runs on cores / ranks threads), so the times say what the exchange costs,
not what more machines would gain.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _cloud(n: int):
    g = torch.Generator().manual_seed(0)
    return torch.rand(n, 3, generator=g), torch.rand(n, 8, generator=g)


def _ops(radius: float):
    import pcops
    import pcops.distributed as pd

    return {
        "knn (k=16)": (lambda p, f: pcops.knn(p, p, 16), lambda p, f: pd.knn(p, p, 16)),
        f"radius_aggregate (r={radius:g})": (lambda p, f: pcops.radius_aggregate(p, p, f, radius, radius / 2),
                                             lambda p, f: pd.radius_aggregate(p, p, f, radius, radius / 2)),
        f"ball_query (r={radius:g}, 16)": (lambda p, f: pcops.ball_query(p, p, radius, 16),
                                            lambda p, f: pd.ball_query(p, p, radius, 16)),
    }


def _median_ms(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _rank(rank: int, ranks: int, port: int, n: int, radius: float, out) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    import pcops.distributed as pd

    points, features = _cloud(n)
    spread = torch.arange(rank, n, ranks)
    part = pd.partition(points[spread])
    mine, f = part.points, part.apply(features[spread])
    rows = {}
    with torch.no_grad():
        for name, (_, split) in _ops(radius).items():
            dist.barrier()
            ms = _median_ms(lambda: split(mine, f))
            pd.traffic.reset()
            split(mine, f)
            rows[name] = (ms, pd.traffic.received)
    out.put((rank, mine.shape[0], rows))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--points", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    n = 20_000 if args.quick else args.points
    radius = 0.01 * (1e6 / n) ** (1 / 3)  # about 4 neighbours per unit density times 4/3 pi r^3 n
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, n, radius, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    points, features = _cloud(n)
    whole = n * (3 + 8) * 4
    print(f"{n:,} points, {args.ranks} ranks on {os.cpu_count()} cores (torch {torch.__version__}); shares: "
          f"{sorted(rows for _, rows, _ in results)}")
    with torch.no_grad():
        for name, (single, _) in _ops(radius).items():
            one = _median_ms(lambda: single(points, features))
            slowest = max(rows[name][0] for _, _, rows in results)
            received = statistics.mean(rows[name][1] for _, _, rows in results)
            print(f"{name:<32} single process {one:9.1f} ms | {args.ranks} ranks (slowest) {slowest:9.1f} ms "
                  f"({slowest / one:.2f}x) | received per rank {received / 1e6:7.2f} MB ({100 * received / whole:.1f}% of the cloud)")


if __name__ == "__main__":
    main()
