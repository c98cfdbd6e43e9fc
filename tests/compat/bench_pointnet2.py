"""Side-by-side: one training step of PyG's PointNet++ classification example (tests/compat/
test_pyg_models.py's PointNet2) with pcops.compat.torch_cluster's ``fps`` and ``radius``
against the same model with torch-only fallbacks (a per-example FPS loop of torch ops, a
dense radius search with the first-K cap), as a user without torch_cluster / pyg-lib would
write them, and torch_cluster itself where it is installed. Not a test (pytest does not collect it): ``python -m tests.compat.bench_pointnet2``.

Prints the median step time of each, and of the searches alone, over interleaved rounds.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from tests.compat import test_pyg_models as m


def torch_fps(pos, batch, ratio=0.5, random_start=True):
    out = []
    for b in torch.unique(batch):
        rows = (batch == b).nonzero()[:, 0]
        p = pos[rows].detach()
        count = math.ceil(rows.numel() * ratio)
        pick = int(torch.randint(rows.numel(), ())) if random_start else 0
        dist = (p - p[pick]).square().sum(1)
        picks = [pick]
        for _ in range(1, count):
            pick = int(dist.argmax())
            picks.append(pick)
            dist = torch.minimum(dist, (p - p[pick]).square().sum(1))
        out.append(rows[torch.tensor(picks)])
    return torch.cat(out)


def torch_radius(x, y, r, batch_x, batch_y, max_num_neighbors=32):
    d2 = (y[:, None, :].detach() - x[None, :, :].detach()).square().sum(-1)
    within = (d2 < r * r) & (batch_y[:, None] == batch_x[None, :])
    within &= torch.cumsum(within, 1) <= max_num_neighbors  # the first K by index
    row, col = within.nonzero(as_tuple=True)
    return torch.stack([row, col])


def _step(model, opt, pos, batch, y):
    opt.zero_grad()
    loss = torch.nn.functional.nll_loss(model(pos, batch), y)
    loss.backward()
    opt.step()


def main(rounds: int = 10, clouds_per_class: int = 4) -> None:
    torch.manual_seed(0)
    pos, batch, y = m.shape_batch(clouds_per_class)
    pcops_fns = (m.fps, m.radius)
    variants = {"pcops.compat": pcops_fns, "torch-only": (torch_fps, torch_radius)}
    try:
        import torch_cluster

        variants["torch_cluster"] = (torch_cluster.fps, torch_cluster.radius)
    except ImportError:
        pass
    models = {name: m.PointNet2(len(m.KINDS)) for name in variants}
    opts = {name: torch.optim.Adam(models[name].parameters(), lr=1e-3) for name in variants}
    steps = {name: [] for name in variants}
    searches = {name: [] for name in variants}
    for r in range(rounds + 1):  # round 0 warms up
        for name, (fps_fn, radius_fn) in variants.items():
            m.fps, m.radius = fps_fn, radius_fn
            t = time.perf_counter()
            _step(models[name], opts[name], pos, batch, y)
            t1 = time.perf_counter()
            idx = fps_fn(pos, batch, ratio=0.5)
            radius_fn(pos, pos[idx], 0.2, batch, batch[idx], max_num_neighbors=64)
            t2 = time.perf_counter()
            if r:
                steps[name].append(t1 - t)
                searches[name].append(t2 - t1)
    m.fps, m.radius = pcops_fns
    print(f"{pos.shape[0]} points in {int(batch.max()) + 1} clouds, torch threads {torch.get_num_threads()}, {rounds} rounds")
    for name in variants:
        print(f"{name:>13}: train step {1e3 * statistics.median(steps[name]):8.1f} ms   "
              f"fps + radius (first level) {1e3 * statistics.median(searches[name]):8.1f} ms")


if __name__ == "__main__":
    main()
