"""PhysicsNeMo's ShardTensor: pcops' neighbour ops on a cloud sharded across ranks.

Where PhysicsNeMo is installed (it is not a dependency of pcops), :func:`register` makes the
single-process functions take ShardTensors sharded on the points' dimension (``Shard(0)`` on a
1-D device mesh, uneven shares allowed): ``pcops.knn(queries, points, 16)`` with ShardTensor
queries and points runs :func:`pcops.distributed.knn` on each rank's local shares with the
mesh's process group, and returns ShardTensors: per-query results sharded like the queries
(each rank's rows, neighbours as global rows), whole-cloud results (a loss, FPS' picks)
replicated. Gradients reach each rank's shares. The layers built on these functions
(:class:`pcops.KNNAggregation`, :class:`pcops.RadiusAggregation`) follow::

    from physicsnemo.domain_parallel import ShardTensor
    import pcops, pcops.distributed.shard_tensor

    pcops.distributed.shard_tensor.register()
    out = pcops.knn(queries, points, 16)         # ShardTensors in, ShardTensors out

The handlers are registered with ``ShardTensor.register_function_handler``, keyed by the
public functions (which hand ShardTensor arguments to ShardTensor's ``__torch_function__``).
"""

from __future__ import annotations

import inspect

import torch

import pcops

from .. import _threads
from ._dtensor import sharded_mesh
from . import ball_query, chamfer_distance, farthest_point_sample, knn, knn_aggregate, knn_interpolate, radius_aggregate

# public function -> (its pcops.distributed form, whether its results are per query)
OPS = {
    pcops.knn: (knn, True),
    pcops.knn_aggregate: (knn_aggregate, True),
    pcops.knn_interpolate: (knn_interpolate, True),
    pcops.ball_query: (ball_query, True),
    pcops.radius_aggregate: (radius_aggregate, True),
    pcops.chamfer_distance: (chamfer_distance, False),
    pcops.farthest_point_sample: (farthest_point_sample, False),
}


def register() -> None:
    """Register the handlers of :data:`OPS` with PhysicsNeMo's ShardTensor (again: a no-op)."""
    from physicsnemo.domain_parallel import ShardTensor

    for public, (op, per_query) in OPS.items():
        ShardTensor.register_function_handler(public, _handler(op, per_query))
    _threads.PROTOCOL_TYPES.add(ShardTensor)


def _handler(op, per_query: bool):
    def handle(func, types, args, kwargs):
        from physicsnemo.domain_parallel import ShardTensor
        from torch.distributed.tensor import Replicate, Shard

        arguments = inspect.signature(func).bind(*args, **(kwargs or {})).arguments  # the call's, by name
        for name, value in arguments.items():  # (PhysicsNeMo hands plain tensors over as replicated DTensors)
            if isinstance(value, torch.Tensor) and not isinstance(value, ShardTensor):
                raise ValueError(f"with ShardTensor arguments every tensor argument must be a ShardTensor sharded on dimension 0: "
                                 f"{name} is a {type(value).__name__}")
        first = next(iter(arguments.values()))
        mesh = sharded_mesh([a for a in arguments.values() if isinstance(a, ShardTensor)], first, per_query, ShardTensor)
        local = lambda a: a.to_local() if isinstance(a, ShardTensor) else a  # noqa: E731
        out = op(**{name: local(value) for name, value in arguments.items()}, group=mesh.get_group())
        rows = [int(shape[0]) for shape in first._spec.sharding_shapes()[0]] if per_query else None

        def back(t):
            if not isinstance(t, torch.Tensor):
                return t
            if per_query:
                shapes = {0: [torch.Size((r, *t.shape[1:])) for r in rows]}
                return ShardTensor.from_local(t, mesh, (Shard(0),), sharding_shapes=shapes)
            return ShardTensor.from_local(t, mesh, (Replicate(),), sharding_shapes="chunk", global_shape=tuple(t.shape))

        return type(out)(*map(back, out)) if isinstance(out, tuple) else back(out)

    return handle


__all__ = ["OPS", "register"]
