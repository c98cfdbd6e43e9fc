"""DTensor inputs: tensors sharded on their first (points') dimension over a 1-D device mesh,
``Shard(0)``, uneven shares allowed. An op called with DTensors runs on their local shares with
the mesh's process group, and returns DTensors: per-query results sharded like the queries,
results of the whole cloud (a loss, FPS' picks) replicated."""

from __future__ import annotations

import functools

import torch

from .. import _warp


def _types():
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor, Replicate, Shard


class _Local(torch.autograd.Function):
    """A DTensor's local share; its gradient a DTensor of the same (possibly uneven) layout.
    (``DTensor.to_local``'s backward assumes even shares.)"""

    @staticmethod
    def forward(ctx, d):
        ctx.layout = (d.device_mesh, d.placements, d.shape, d.stride())
        return d._local_tensor.view_as(d._local_tensor)

    @staticmethod
    def backward(ctx, grad):
        DTensor, _, _ = _types()
        mesh, placements, shape, stride = ctx.layout
        return DTensor.from_local(grad, mesh, placements, run_check=False, shape=shape, stride=stride)


def sharded_mesh(given: list, first, per_query: bool, kind: type):
    """The one 1-D device mesh of the ``kind`` (DTensor or a subclass) inputs ``given``, each
    sharded on dimension 0; with ``per_query``, ``first`` (the queries) must be one of them."""
    _, _, Shard = _types()
    mesh = given[0].device_mesh
    for t in given:
        if t.device_mesh != mesh or mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
            raise ValueError(f"{kind.__name__} inputs must share one 1-D device mesh and be sharded on dimension 0 "
                             f"(placements (Shard(0),)), got {tuple(t.placements)} on a mesh of shape {tuple(mesh.shape)}")
    if per_query and not isinstance(first, kind):
        raise ValueError(f"with {kind.__name__} inputs the queries (the first argument) must be a {kind.__name__} too")
    return mesh


def accepts_dtensors(per_query: bool):
    """Decorator of an op of pcops.distributed: DTensor arguments as described above, and the op
    run eagerly under ``torch.compile`` (one graph break). ``per_query``: its tensors' rows are
    the first argument's (else whole-cloud results)."""

    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            try:
                DTensor, Replicate, Shard = _types()
            except ImportError:  # a torch without DTensor: nothing to unwrap
                return fn(*args, **kwargs)
            given = [a for a in (*args, *kwargs.values()) if isinstance(a, DTensor)]
            if not given:
                return fn(*args, **kwargs)
            if kwargs.pop("group", None) is not None:
                raise ValueError("group comes from the DTensors' device mesh: leave it None")
            first = args[0] if args else next(iter(kwargs.values()))
            mesh = sharded_mesh(given, first, per_query, DTensor)
            local = lambda a: _Local.apply(a) if isinstance(a, DTensor) else a  # noqa: E731
            out = fn(*map(local, args), **{k: local(v) for k, v in kwargs.items()}, group=mesh.get_group())
            rows = first.shape[0]

            def back(t):
                if not isinstance(t, torch.Tensor):
                    return t
                if per_query:
                    shape = (rows, *t.shape[1:])
                    return DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=shape, stride=_warp.contiguous_strides(shape))
                return DTensor.from_local(t, mesh, [Replicate()], run_check=False)

            return type(out)(*map(back, out)) if isinstance(out, tuple) else back(out)

        # collectives with data-dependent sizes and host reads: run eagerly, a graph break under
        # torch.compile (traced, the ranks' collectives would no longer match)
        return torch.compiler.disable(call)

    return wrap
