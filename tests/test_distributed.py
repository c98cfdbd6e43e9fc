"""pcops.distributed on 2 and 3 CPU processes (gloo): each rank's rows, global indices and
gradients equal the single-process op on the whole cloud, for random uneven shares (a rank
without queries, a rank without reference points) and for spatial shares from partition(), whose
halos move a fraction of the cloud (bytes counted)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

F64 = torch.float64
N = 500


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shares(owner: torch.Tensor, world: int) -> list[torch.Tensor]:
    return [(owner == r).nonzero().squeeze(1) for r in range(world)]


def _check_ops(rank: int, world: int, owner_q: torch.Tensor, owner_p: torch.Tensor, gen_seed: int) -> None:
    import pcops
    import pcops.distributed as pd

    g = torch.Generator().manual_seed(gen_seed)
    cloud = torch.rand(N, 3, generator=g, dtype=F64)
    queries = torch.rand(N // 2, 3, generator=g, dtype=F64)
    features = torch.rand(N, 4, generator=g, dtype=F64)
    weight = torch.rand(N // 2, 8, generator=g, dtype=F64)  # the loss's weights of each global query row
    qs, ps = _shares(owner_q, world), _shares(owner_p, world)
    q_order, p_order = torch.cat(qs), torch.cat(ps)  # global rows: the shares in rank order
    glob_q, glob_p, glob_f = queries[q_order], cloud[p_order], features[p_order]
    mine_q = torch.arange(len(qs[rank])) + sum(len(s) for s in qs[:rank])  # this rank's rows of the global queries
    mine_p = torch.arange(len(ps[rank])) + sum(len(s) for s in ps[:rank])

    def leaves(*ts):
        return [t.clone().requires_grad_() for t in ts]

    cases = {
        "knn": (lambda q, p, f: pcops.knn(q, p, 6), lambda q, p, f: pd.knn(q, p, 6)),
        "knn_aggregate": (lambda q, p, f: pcops.knn_aggregate(q, p, f, 5, 0.1), lambda q, p, f: pd.knn_aggregate(q, p, f, 5, 0.1)),
        "knn_interpolate": (lambda q, p, f: pcops.knn_interpolate(q, p, f), lambda q, p, f: pd.knn_interpolate(q, p, f)),
        "ball_query": (lambda q, p, f: pcops.ball_query(q, p, 0.15, 8), lambda q, p, f: pd.ball_query(q, p, 0.15, 8)),
        "radius_aggregate": (lambda q, p, f: pcops.radius_aggregate(q, p, f, 0.15, 0.1),
                             lambda q, p, f: pd.radius_aggregate(q, p, f, 0.15, 0.1)),
        "KNNAggregation": (lambda q, p, f: pcops.KNNAggregation(4, 0.1, weights="inverse_distance")(q, p, f),
                           lambda q, p, f: pd.KNNAggregation(4, 0.1, weights="inverse_distance")(q, p, f)),
        "RadiusAggregation": (lambda q, p, f: pcops.RadiusAggregation(0.2, reduce="max")(q, p, f),
                              lambda q, p, f: pd.RadiusAggregation(0.2, reduce="max")(q, p, f)),
        "radius_larger_than_a_domain": (lambda q, p, f: pcops.radius_aggregate(q, p, f, 2.0, 0.3),
                                        lambda q, p, f: pd.radius_aggregate(q, p, f, 2.0, 0.3)),
    }
    for name, (single, split) in cases.items():
        gq, gp, gf = leaves(glob_q, glob_p, glob_f)
        expected = single(gq, gp, gf)
        lq, lp, lf = leaves(glob_q[mine_q], glob_p[mine_p], glob_f[mine_p])
        got = split(lq, lp, lf)
        exp_t = tuple(expected) if isinstance(expected, tuple) else (expected,)
        got_t = tuple(got) if isinstance(got, tuple) else (got,)
        for e, o in zip(exp_t, got_t):
            e = e[mine_q]
            if e.dtype.is_floating_point:
                torch.testing.assert_close(o, e, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name} rank {rank}: {m}")
            else:
                assert torch.equal(o, e), f"{name} rank {rank}: global indices differ"
        floats = [t for t in exp_t if t.dtype.is_floating_point and t.requires_grad]
        if not floats:
            continue
        w = weight[:, : floats[0].shape[-1]] if floats[0].dim() == 2 else weight[:, 0]
        total = sum((torch.where(torch.isfinite(t), t, 0) * w).sum() for t in floats)
        total.backward()
        mine = [t for t in got_t if t.dtype.is_floating_point and t.requires_grad]
        sum((torch.where(torch.isfinite(t), t, 0) * w[mine_q]).sum() for t in mine).backward()  # a collective: every rank
        for what, a, b, rows in (("query", lq.grad, gq.grad, mine_q), ("ref", lp.grad, gp.grad, mine_p), ("features", lf.grad, gf.grad, mine_p)):
            if b is None:
                assert a is None or not a.any(), f"{name} rank {rank}: a gradient of {what} where the op has none"
                continue
            b = b[rows]
            torch.testing.assert_close(a if a is not None else torch.zeros_like(b), b, rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"{name} rank {rank}, gradient of {what}: {m}")
    # farthest point sampling: the same picks, global rows, gradients to each pick's owner
    gp_ = glob_p.clone().requires_grad_()
    expected = pcops.farthest_point_sample(gp_, 40)
    (expected.points * weight[:40, :3]).sum().backward()
    lp_ = glob_p[mine_p].clone().requires_grad_()
    got = pd.farthest_point_sample(lp_, 40)
    assert torch.equal(got.idx, expected.idx), f"rank {rank}: other picks"
    torch.testing.assert_close(got.points, expected.points.detach(), rtol=0, atol=0)
    (got.points * weight[:40, :3]).sum().backward()
    torch.testing.assert_close(lp_.grad, gp_.grad[mine_p], rtol=0, atol=0)
    # chamfer: one scalar of the whole clouds on every rank, gradients to each rank's points
    gx, gy = leaves(glob_q, glob_p)
    expected = pcops.chamfer_distance(gx, gy)
    expected.backward()
    lx, ly = leaves(glob_q[mine_q], glob_p[mine_p])
    got = pd.chamfer_distance(lx, ly)
    torch.testing.assert_close(got, expected.detach(), rtol=1e-12, atol=1e-14)
    got.backward()
    torch.testing.assert_close(lx.grad, gx.grad[mine_q], rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(ly.grad, gy.grad[mine_p], rtol=1e-10, atol=1e-14)


def _check_partition(rank: int, world: int) -> None:
    import pcops
    import pcops.distributed as pd

    g = torch.Generator().manual_seed(11)
    cloud = torch.rand(4000, 3, generator=g, dtype=F64)
    features = torch.rand(4000, 2, generator=g, dtype=F64)
    mine = torch.arange(rank, 4000, world)  # every world-th point: a share spread over the whole cube
    part = pd.partition(cloud[mine])
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([part.points.shape[0]]))
    assert sum(int(s) for s in sizes) == 4000 and max(int(s) for s in sizes) <= 1.3 * 4000 / world, sizes  # balanced
    moved = part.apply(features[mine])
    back = part.restore(moved)
    assert torch.equal(back, features[mine])  # there and back
    # the spatial share's halo: a fraction of the cloud, far less than the spread share's
    whole = 4000 * 3 * 8
    for share, f in ((part.points, moved), (cloud[mine], features[mine])):
        pd.traffic.reset()
        out = pd.radius_aggregate(share, share, f, 0.05, 0.1)
        received = pd.traffic.received
        pd.traffic.reset()
        nbrs = pd.knn(share, share, 8)
        knn_received = pd.traffic.received
        if share is part.points:
            spatial = (received, knn_received)
        else:
            spread = (received, knn_received)
        assert out.shape == (share.shape[0], 2) and nbrs.idx.shape == (share.shape[0], 8)
    assert spatial[0] < 0.35 * whole and spatial[1] < 0.5 * whole, (spatial, whole)  # kNN's reach: ~0.15 at 4,000 points
    assert spatial[0] < 0.5 * spread[0] and spatial[1] < 0.5 * spread[1], (spatial, spread)
    # and the result on the spatial share is the single-process op's on the concatenated shares
    shares = [None] * world
    dist.all_gather_object(shares, part.points)
    expected = pcops.knn(part.points, torch.cat(shares), 8)
    got = pd.knn(part.points, part.points, 8)
    assert torch.equal(got.idx, expected.idx)
    torch.testing.assert_close(got.dists, expected.dists, rtol=0, atol=0)


def _check_dtensors(rank: int, world: int) -> None:
    """DTensor inputs sharded unevenly on dimension 0: DTensor results, the local calls' values and gradients."""
    import pcops.distributed as pd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(5)
    sizes = [30 + 17 * r for r in range(world)]  # uneven shares
    parts = [torch.rand(n, 7, generator=g, dtype=F64) for n in sizes]
    mine = parts[rank]
    q, p, f = mine[:, :3].contiguous(), mine[:, 3:6].contiguous(), mine[:, 6:].contiguous()

    def shard(t):
        shape = (sum(sizes), *t.shape[1:])
        return DTensor.from_local(t.clone(), mesh, [Shard(0)], run_check=False, shape=shape,
                                  stride=(t.shape[1], 1) if t.dim() == 2 else (1,)).requires_grad_()

    dq, dp, df = shard(q), shard(p), shard(f)
    out = pd.knn(dq, dp, 5)
    assert isinstance(out.idx, DTensor) and out.idx.placements == (Shard(0),) and out.idx.shape == (sum(sizes), 5)
    assert torch.equal(out.idx.to_local(), pd.knn(q, p, 5).idx)
    lq, lp, lf = (t.clone().requires_grad_() for t in (q, p, f))
    expected = pd.radius_aggregate(lq, lp, lf, 0.3, 0.1)
    got = pd.radius_aggregate(dq, dp, df, 0.3, 0.1)
    torch.testing.assert_close(got.to_local(), expected, rtol=0, atol=0)
    expected.sum().backward()
    got.to_local().sum().backward()
    for a, b in ((dq, lq), (dp, lp), (df, lf)):
        torch.testing.assert_close(a.grad.to_local(), b.grad, rtol=0, atol=0)
    loss = pd.chamfer_distance(dq.detach(), dp.detach())
    assert isinstance(loss, DTensor) and loss.placements == (Replicate(),)
    torch.testing.assert_close(loss.to_local(), pd.chamfer_distance(q, p), rtol=0, atol=0)


def _check_bad_inputs(rank: int, world: int) -> None:
    """A bad input on one rank: every rank raises (that rank its own error), none waits."""
    import pcops.distributed as pd

    g = torch.Generator().manual_seed(3)
    q, p, f = torch.rand(20, 3, generator=g), torch.rand(30, 3, generator=g), torch.rand(30, 2, generator=g)
    bad = q.clone()
    if rank == world - 1:
        bad[3, 1] = float("nan")
    calls = [(lambda: pd.knn(bad, p, 4), "query"), (lambda: pd.radius_aggregate(bad, p, f, 0.2, 0.1), "query"),
             (lambda: pd.ball_query(bad, p, 0.2, 4), "query"), (lambda: pd.farthest_point_sample(bad, 5), "points"),
             (lambda: pd.chamfer_distance(bad, p), "x")]
    for call, name in calls:
        own = f"{name} contains NaN or inf" if rank == world - 1 else f"the inputs of rank {world - 1} failed their checks"
        with pytest.raises(ValueError, match=own):
            call()
    with pytest.raises(TypeError if rank == 0 else ValueError, match="k must be an int" if rank == 0 else "the inputs of rank 0"):
        pd.knn(q, p, 2.5 if rank == 0 else 2)
    with pytest.raises(ValueError, match="k must be <= the number of reference points of all ranks"):
        pd.knn(q, p[:2], 2 * world + 1)
    # options, dtypes or channels that differ between ranks: every rank raises, naming them (a
    # dtype or a channel count aborted a rank inside gloo, n_samples deadlocked them)
    last = rank == world - 1
    mismatched = [(lambda: pd.knn(q.double() if last else q, p, 4), "query's dtype"),
                  (lambda: pd.knn_aggregate(q, p, f[:, :1] if last else f, 4, 0.1), "features' channels"),
                  (lambda: pd.farthest_point_sample(p, 6 if last else 5), "n_samples"),
                  (lambda: pd.radius_aggregate(q, p, f, 0.3 if last else 0.2, 0.1), "radius"),
                  (lambda: pd.chamfer_distance(q, p.double() if last else p), "y's dtype"),
                  (lambda: pd.knn_aggregate(q, p, f, 4, 0.2 if last else 0.1), "sigma"),
                  (lambda: pd.radius_aggregate(q, p, f, 0.2, None, weights="uniform" if last else "inverse_distance"), "weights"),
                  (lambda: pd.knn_aggregate(q, p, f, 4, None, reduce="max" if last else "mean", weights="uniform"), "reduce")]
    for call, name in mismatched:
        with pytest.raises(ValueError, match=f"{name} must be the same on every rank"):
            call()
    with pytest.raises(ValueError, match="'uniform' on rank"):  # the names spelled out
        pd.radius_aggregate(q, p, f, 0.2, None, weights="uniform" if last else "inverse_distance")
    # an aggregation's bad option on one rank: every rank raises before the exchange (the rank
    # raised after it, and the others' backward waited for it)
    for options, error in ((dict(weights="cosine"), ValueError), (dict(reduce="max"), ValueError), (dict(weight="uniform"), TypeError)):
        with pytest.raises(error if last else ValueError, match=None if last else f"the inputs of rank {world - 1}"):
            pd.knn_aggregate(q, p, f, 4, 0.1, **(options if last else {}))
    with pytest.raises(ValueError, match="sigma must be finite and > 0" if last else "the inputs of rank"):  # a tensor sigma, validate on
        pd.radius_aggregate(q, p, f, 0.2, torch.tensor(-0.1 if last else 0.1))
    # kNN's backend passes: the same neighbours; the torch backend's distances may differ from
    # Warp's by an ulp (its vector kernels differ between CPUs: equal on an Intel Xeon, not on an AMD EPYC)
    torch.testing.assert_close(pd.knn_aggregate(q, p, f, 4, 0.1, backend="torch"), pd.knn_aggregate(q, p, f, 4, 0.1))
    with pytest.raises(TypeError if last else ValueError):  # radius_aggregate has no backend
        pd.radius_aggregate(q, p, f, 0.2, 0.1, **({"backend": "torch"} if last else {}))
    with pytest.raises((ValueError, TypeError)):  # features on some ranks only: every rank raises (no all-gather of rows of two lengths)
        pd.radius_aggregate(q, p, None if last else f, 0.2, 0.1)
    with pytest.raises((ValueError, TypeError)):  # a k beyond float64 on one rank
        pd.knn(q, p, 10**400 if last else 3)
    assert pd.knn(q, p, 4).idx.shape == (20, 4)  # the group still works after the errors


def _check_compile(rank: int, world: int) -> None:
    """Default torch.compile of a model calling the ops: each op runs eagerly at a graph break
    (traced, the ranks' collectives would no longer match), values and gradients as eager."""
    import pcops.distributed as pd

    g = torch.Generator().manual_seed(20 + rank)
    q, f = torch.rand(60, 3, generator=g, dtype=F64), torch.rand(60, 2, generator=g, dtype=F64)

    def model(q, f):
        return (pd.radius_aggregate(q, q, f, 0.3, 0.1) * 2).sum() + pd.knn(q, q, 3).dists.sum()

    fe, fc = f.clone().requires_grad_(), f.clone().requires_grad_()
    eager = model(q, fe)
    eager.backward()
    compiled = torch.compile(model)(q, fc)
    compiled.backward()
    torch.testing.assert_close(compiled, eager.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fc.grad, fe.grad, rtol=1e-12, atol=1e-12)


def _check_few_points(rank: int, world: int) -> None:
    """A rank holding fewer than k reference points receives a bound's halo, not the whole cloud:
    its bound is the k-th distance among its own points and a sample of the others'."""
    import pcops
    import pcops.distributed as pd

    g = torch.Generator().manual_seed(12)
    cloud = torch.rand(6000, 3, generator=g, dtype=F64)
    cloud = cloud[torch.argsort(cloud[:, 0])]  # slabs along x: rank r holds the r-th
    slab = torch.arange(6000).chunk(world)
    queries = cloud[slab[rank][:100]] if rank == 0 else cloud[slab[rank]]  # rank 0: the 100 points of smallest x
    keep = slab[0][:2] if rank == 0 else torch.cat([slab[0][2:], slab[rank]]) if rank == 1 else slab[rank]
    pd.traffic.reset()
    got = pd.knn(queries, cloud[keep], 8)
    received = pd.traffic.received
    shares = [None] * world
    dist.all_gather_object(shares, cloud[keep])
    expected = pcops.knn(queries, torch.cat(shares), 8)
    assert torch.equal(got.idx, expected.idx)
    torch.testing.assert_close(got.dists, expected.dists, rtol=0, atol=0)
    if rank == 0:  # 2 points of its own, k = 8: the points near its queries (x < 0.02), not the cloud
        assert received < 0.25 * 6000 * (3 * 8 + 8), received  # rows of coordinates and a global index each
    # NaN points (validate=False) on the ranks: never neighbours (a -1 stays -1), no NaN spread
    # into the distances, and no rank left waiting
    mine = cloud[:2] if rank == 0 else torch.cat([cloud[2:3], torch.full((9, 3), float("nan"), dtype=F64)])
    shares = [None] * world
    dist.all_gather_object(shares, mine)
    got = pd.knn(cloud[:5], mine, 4, validate=False)
    expected = pcops.knn(cloud[:5], torch.cat(shares), 4, validate=False)
    assert torch.equal(got.idx, expected.idx)
    torch.testing.assert_close(got.dists, expected.dists, rtol=0, atol=0)


def _worker(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(world)
        # random uneven shares: the last rank holds no queries, the first no reference points
        owner_q = torch.randint(0, world - 1, (N // 2,), generator=g)
        owner_p = torch.randint(1, world, (N,), generator=g)
        _check_ops(rank, world, owner_q, owner_p, gen_seed=7)
        # random shares of every rank
        _check_ops(rank, world, torch.randint(0, world, (N // 2,), generator=g), torch.randint(0, world, (N,), generator=g), gen_seed=8)
        _check_partition(rank, world)
        _check_dtensors(rank, world)
        _check_bad_inputs(rank, world)
        _check_edges(rank, world)
        _check_compile(rank, world)
        _check_few_points(rank, world)
        dist.barrier()  # every rank done before any tears the group down (a rank that left early aborted once)
    finally:
        dist.destroy_process_group()


# three ranks (32 s on 2 cores; a rank between two others) run with `pytest -m slow`
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_each_rank_gets_its_rows_of_the_single_process_op(world):
    mp.spawn(_worker, args=(world, _free_port()), nprocs=world, join=True)


def _check_edges(rank: int, world: int) -> None:
    """The review's cases: a float64 radius that float32 rounds down, a rank with no queries and
    fewer than k points (with gradients), empty shares of both Chamfer clouds, half-precision FPS,
    the layers on DTensors."""
    import pcops
    import pcops.distributed as pd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    last = world - 1
    q = torch.zeros(1, 3, dtype=F64) if rank == 0 else torch.zeros(0, 3, dtype=F64)
    p = {0: torch.tensor([[5.0, 5.0, 5.0]], dtype=F64), last: torch.tensor([[0.69999999, 0.0, 0.0]], dtype=F64)}.get(rank, torch.zeros(0, 3, dtype=F64))
    out = pd.ball_query(q, p, 0.7, 2)
    if rank == 0:
        assert out.idx[0, 0] == 1 and out.counts[0] == 1, out  # rank last's point: row 1 of the whole cloud
    # a rank without queries and with fewer than k own points, gradients on
    g = torch.Generator().manual_seed(9)
    cloud = torch.rand(40, 3, generator=g, dtype=F64)
    mine = cloud[:38] if rank == 0 else cloud[37 + rank : 38 + rank]  # ranks 1, 2: one point each, no queries
    queries = torch.rand(10, 3, generator=g, dtype=F64) if rank == 0 else torch.zeros(0, 3, dtype=F64)
    leaf = mine.clone().requires_grad_()
    got = pd.knn(queries, leaf, 5)
    got.dists.sum().backward()  # every rank: a collective
    if rank == 0:
        assert torch.equal(got.idx, pcops.knn(queries, torch.cat([cloud[:38], cloud[38 : 38 + world - 1]]), 5).idx)
    # float16 halos whose sums overflow: the term that keeps the exchange in the graph stays 0, not NaN
    big = (torch.rand(400, 3, generator=torch.Generator().manual_seed(rank)) * 400).half()
    assert torch.isfinite(pd.ball_query(big[:20], big, 30.0, 4).dists[:, 0]).all()
    assert torch.isfinite(pd.radius_aggregate(big[:20], big, big, 30.0, reduce="max")).all()
    # a rank with neither queries nor points: its backward still joins the exchange's (ball_query's hung)
    mine, queries = (cloud[:20], cloud[20:26]) if rank != last else (cloud[:0], cloud[:0])
    feats = torch.rand(mine.shape[0], 2, generator=torch.Generator().manual_seed(rank), dtype=F64)
    calls = [lambda q, p, f: pd.ball_query(q, p, 0.3, 4).dists, lambda q, p, f: pd.radius_aggregate(q, p, f, 0.3, reduce="max"),
             lambda q, p, f: pd.radius_aggregate(q, p, f, 0.3, 0.1), lambda q, p, f: pd.knn(q, p, 3).dists,
             lambda q, p, f: pd.knn_aggregate(q, p, f, 3, 0.1), lambda q, p, f: pd.knn_interpolate(q, p, f, 3)]
    for call in calls:
        leaf, fl = mine.clone().requires_grad_(), feats.clone().requires_grad_()
        out = call(queries, leaf, fl)
        torch.where(torch.isfinite(out), out, 0).sum().backward()  # every rank: a collective
    gx = torch.Generator().manual_seed(4)
    whole_x, whole_y = torch.rand(5, 3, generator=gx, dtype=F64), torch.rand(6, 3, generator=gx, dtype=F64)
    x, y = (whole_x, whole_y) if rank == 0 else (whole_x[:0], whole_y[:0])  # other ranks: empty shares of both clouds
    torch.testing.assert_close(pd.chamfer_distance(x, y), pcops.chamfer_distance(whole_x, whole_y))
    for a, b in ((whole_x[:0], y), (x, whole_y[:0])):  # a cloud empty on every rank: 0, as the single-process op (a k error once)
        leaf = a.clone().requires_grad_()
        loss = pd.chamfer_distance(leaf, b)
        assert float(loss) == 0.0 == float(pcops.chamfer_distance(whole_x[:0], whole_y)) == float(pcops.chamfer_distance(whole_x, whole_y[:0]))
        loss.backward()
    # half precision FPS: the single-process op's picks (computed in float32)
    pts = torch.rand(400, 3, generator=torch.Generator().manual_seed(6)).half()  # the same on every rank
    share = pts[rank * 400 // world : (rank + 1) * 400 // world]
    assert torch.equal(pd.farthest_point_sample(share, 30).idx, pcops.farthest_point_sample(pts, 30).idx)
    # the layers take DTensors
    mesh = init_device_mesh("cpu", (world,))
    local = torch.rand(20 + rank, 3, generator=g, dtype=F64)
    feats = torch.rand(20 + rank, 2, generator=g, dtype=F64)
    rows = sum(20 + r for r in range(world))
    d = lambda t: DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=(rows, t.shape[1]), stride=(t.shape[1], 1))  # noqa: E731
    layer = pd.KNNAggregation(3, 0.1)
    torch.testing.assert_close(layer(d(local), d(local), d(feats)).to_local(), layer(local, local, feats), rtol=0, atol=0)
