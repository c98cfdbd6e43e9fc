"""pcops' functions on PhysicsNeMo ShardTensors (pcops.distributed.shard_tensor), 2 and 3 gloo
processes, uneven shares, float64: ShardTensor results whose local rows, global indices and
gradients equal the single-process op's on the whole cloud. Runs where PhysicsNeMo is installed
(it is not a dependency: skipped elsewhere); the routing itself is tested everywhere below."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pcops
from pcops import _threads

F64 = torch.float64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        _check(rank, world)
    finally:
        dist.destroy_process_group()


def _check(rank: int, world: int) -> None:
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    import pcops.distributed.shard_tensor as st

    st.register()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(11)
    rows_q = [40 + 23 * r for r in range(world)]  # uneven shares
    rows_p = [90 - 25 * r for r in range(world)]
    queries = torch.rand(sum(rows_q), 3, generator=g, dtype=F64)
    cloud = torch.rand(sum(rows_p), 3, generator=g, dtype=F64)
    features = torch.rand(sum(rows_p), 4, generator=g, dtype=F64)
    weight = torch.rand(sum(rows_q), 8, generator=g, dtype=F64)
    mine_q = slice(sum(rows_q[:rank]), sum(rows_q[: rank + 1]))
    mine_p = slice(sum(rows_p[:rank]), sum(rows_p[: rank + 1]))

    def shard(local: torch.Tensor, rows: list) -> ShardTensor:
        shapes = {0: [torch.Size((n, *local.shape[1:])) for n in rows]}
        return ShardTensor.from_local(local, mesh, (Shard(0),), sharding_shapes=shapes)

    cases = {
        "knn": lambda q, p, f: pcops.knn(q, p, 6),
        "knn_aggregate": lambda q, p, f: pcops.knn_aggregate(q, p, f, 5, 0.1),
        "knn_interpolate": lambda q, p, f: pcops.knn_interpolate(q, p, f),
        "ball_query": lambda q, p, f: pcops.ball_query(q, p, 0.2, 8),
        "radius_aggregate": lambda q, p, f: pcops.radius_aggregate(q, p, f, 0.2, 0.1),
        "KNNAggregation": lambda q, p, f: pcops.KNNAggregation(4, 0.1, weights="inverse_distance")(q, p, f),
        "RadiusAggregation": lambda q, p, f: pcops.RadiusAggregation(0.25, reduce="max")(q, p, f),
    }
    for name, call in cases.items():
        gq, gp, gf = (t.clone().requires_grad_() for t in (queries, cloud, features))
        expected = call(gq, gp, gf)
        lq, lp, lf = (t.clone().requires_grad_() for t in (queries[mine_q], cloud[mine_p], features[mine_p]))
        got = call(shard(lq, rows_q), shard(lp, rows_p), shard(lf, rows_p))
        exp_t = tuple(expected) if isinstance(expected, tuple) else (expected,)
        got_t = tuple(got) if isinstance(got, tuple) else (got,)
        for e, o in zip(exp_t, got_t):
            assert isinstance(o, ShardTensor) and tuple(o.placements) == (Shard(0),), f"{name}: {type(o)}"
            assert tuple(o.shape) == tuple(e.shape), f"{name}: global shape {tuple(o.shape)}"
            if e.dtype.is_floating_point:
                torch.testing.assert_close(o.to_local(), e[mine_q], rtol=1e-12, atol=1e-12, msg=lambda m: f"{name} rank {rank}: {m}")
            else:
                assert torch.equal(o.to_local(), e[mine_q]), f"{name} rank {rank}: global indices differ"
        floats = [(e, o) for e, o in zip(exp_t, got_t) if e.dtype.is_floating_point and e.requires_grad]
        if not floats:
            continue
        w = weight[:, : floats[0][0].shape[-1]] if floats[0][0].dim() == 2 else weight[:, 0]
        finite = lambda t: torch.where(torch.isfinite(t), t, 0)  # noqa: E731
        sum(((finite(e) * w).sum() for e, _ in floats)).backward()
        sum(((finite(o.to_local()) * w[mine_q]).sum() for _, o in floats)).backward()
        for leaf, whole, rows in ((lq, gq, mine_q), (lp, gp, mine_p), (lf, gf, mine_p)):
            if whole.grad is not None:
                torch.testing.assert_close(leaf.grad, whole.grad[rows], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name} grad rank {rank}: {m}")

    # whole-cloud results, replicated: the Chamfer loss (its gradient) and FPS' picks
    gx, gy = queries.clone().requires_grad_(), cloud.clone().requires_grad_()
    expected = pcops.chamfer_distance(gx, gy)
    expected.backward()
    lx, ly = queries[mine_q].clone().requires_grad_(), cloud[mine_p].clone().requires_grad_()
    loss = pcops.chamfer_distance(shard(lx, rows_q), shard(ly, rows_p))
    assert isinstance(loss, ShardTensor) and tuple(loss.placements) == (Replicate(),)
    torch.testing.assert_close(loss.to_local(), expected, rtol=1e-12, atol=0)
    loss.to_local().backward()
    torch.testing.assert_close(lx.grad, gx.grad[mine_q], rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(ly.grad, gy.grad[mine_p], rtol=1e-10, atol=1e-14)
    picks = pcops.farthest_point_sample(shard(cloud[mine_p].clone(), rows_p), 12)
    assert torch.equal(picks.idx.to_local(), pcops.farthest_point_sample(cloud, 12).idx)

    # under torch.compile: the same ShardTensors (the call runs eagerly at a graph break)
    compiled = torch.compile(lambda q, p: pcops.knn(q, p, 6), backend="eager")
    out = compiled(shard(queries[mine_q].clone(), rows_q), shard(cloud[mine_p].clone(), rows_p))
    assert isinstance(out.idx, ShardTensor) and torch.equal(out.idx.to_local(), pcops.knn(queries, cloud, 6).idx[mine_q])

    # a plain tensor beside ShardTensors: refused, naming it, on every rank
    with pytest.raises(ValueError, match="every tensor argument must be a ShardTensor sharded on dimension 0: features"):
        pcops.knn_aggregate(shard(queries[mine_q].clone(), rows_q), shard(cloud[mine_p].clone(), rows_p), features[mine_p], 4, 0.1)

    # not sharded on the points' dimension: refused, on every rank
    with pytest.raises(ValueError, match="sharded on dimension 0"):
        pcops.knn(ShardTensor.from_local(queries.clone(), mesh, (Replicate(),), sharding_shapes="chunk", global_shape=tuple(queries.shape)),
                  shard(cloud[mine_p].clone(), rows_p), 4)


@pytest.mark.parametrize("world", [2, 3])
def test_shard_tensors_get_each_ranks_rows_of_the_single_process_op(world):
    pytest.importorskip("physicsnemo.domain_parallel", reason="PhysicsNeMo is not installed (not a dependency of pcops)")
    mp.spawn(_worker, args=(world, _free_port()), nprocs=world, join=True)


class _Routed(torch.Tensor):
    """A stand-in for ShardTensor: a subclass whose __torch_function__ records what it receives."""

    calls: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(func)
        if func is pcops.knn:
            return "handled"
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def test_a_registered_subclass_receives_the_public_function(monkeypatch):
    monkeypatch.setattr(_threads, "PROTOCOL_TYPES", {_Routed})
    _Routed.calls = []
    q, p = torch.rand(10, 3).as_subclass(_Routed), torch.rand(20, 3)
    assert pcops.knn(q, p, 3) == "handled"
    assert pcops.knn(p, ref=q, k=3) == "handled"  # found among the keywords too
    # not handled: the function runs on as usual, once
    out = pcops.ball_query(q, p, 0.5, 4)
    assert _Routed.calls == [pcops.knn, pcops.knn, pcops.ball_query]
    assert torch.equal(out.idx, pcops.ball_query(q.as_subclass(torch.Tensor), p, 0.5, 4).idx)


def test_a_registered_subclass_receives_the_public_function_under_compile(monkeypatch):
    monkeypatch.setattr(_threads, "PROTOCOL_TYPES", {_Routed})
    _Routed.calls = []
    q, p = torch.rand(10, 3).as_subclass(_Routed), torch.rand(20, 3)
    compiled = torch.compile(lambda a, b: pcops.knn(a, b, 3), backend="eager")
    assert compiled(q, p) == "handled" and pcops.knn in _Routed.calls  # (dynamo hands it attribute reads too)


class _Derived(_Routed):
    pass


def test_a_subclass_of_a_registered_type_is_routed_too(monkeypatch):
    monkeypatch.setattr(_threads, "PROTOCOL_TYPES", {_Routed})
    _Routed.calls = []
    assert pcops.knn(torch.rand(10, 3).as_subclass(_Derived), torch.rand(20, 3), 3) == "handled"


def test_other_subclasses_run_as_plain_tensors():
    _Routed.calls = []
    q, p = torch.rand(10, 3).as_subclass(_Routed), torch.rand(20, 3)
    out = pcops.knn(q, p, 3)  # not in PROTOCOL_TYPES: not routed (torch's own operations inside may see it)
    assert pcops.knn not in _Routed.calls
    assert torch.equal(torch.as_tensor(out.idx), pcops.knn(q.as_subclass(torch.Tensor), p, 3).idx)
