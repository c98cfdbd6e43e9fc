"""pyg-lib's point-cloud operators on pcops, so that PyTorch Geometric (2.7+) runs its own ``fps``,
``knn``, ``knn_graph``, ``radius``, ``radius_graph``, ``nearest``, ``voxel_grid`` and the layers
built on them (``DynamicEdgeConv``, ``XConv``, ``GravNetConv``, ``knn_interpolate``) on pcops.
Installed by ``pcops.compat.install("pyg")`` (or ``install()``) where no real pyg-lib is.

Since 2.7 PyG calls ``torch.ops.pyg.fps`` / ``knn`` / ``radius`` / ``nearest`` / ``grid_cluster``
where its flags ``torch_geometric.typing.WITH_FPS`` / ``WITH_KNN`` / ``WITH_RADIUS`` /
``WITH_NEAREST`` / ``WITH_GRID_CLUSTER`` are True, and reads those flags at each call. Installing:

- ``register()`` defines the five operators in the ``pyg`` namespace with pyg-lib's schemas,
  names and defaults, as ``torch.library`` custom ops over ``pcops.compat.torch_cluster`` (whose
  results follow torch_cluster, pyg-lib's origin: same edge layout, ``ceil(float32(n) * ratio)``
  FPS picks, strict ``d^2 < r^2``), with exact fakes (``new_dynamic_size()`` where the result size
  depends on the data);
- :data:`FLAGS` are set True in ``torch_geometric.typing``, whenever PyG was imported.

Nothing else changes: ``import pyg_lib`` still fails and ``WITH_PYG_LIB`` stays False, so every
other PyG feature (``NeighborLoader``'s sampling, ``Node2Vec``, ``dropout_path``, PyG's own
``withPackage('pyg_lib')`` tests) behaves exactly as without pyg-lib. Batches are CSR pointers
``ptr`` (``ptr[0] = 0``, ``ptr[-1] =`` the number of rows); a pointer of one tensor and ``None``
for the other means no batching, as pyg-lib's CPU kernels read it.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Optional

import torch
from torch import Tensor

from . import torch_cluster as _tc

# pyg-lib's TORCH_LIBRARY_FRAGMENT(pyg, m) schemas (pyg_lib/csrc/ops/{fps,knn,radius,nearest,cluster}.cpp)
SCHEMAS = {
    "fps": "(Tensor src, Tensor ptr, float ratio=0.5, bool random_start=True) -> Tensor",
    "knn": "(Tensor x, Tensor y, Tensor? ptr_x=None, Tensor? ptr_y=None, int k=1, bool cosine=False, "
    "int num_workers=1) -> Tensor",
    "radius": "(Tensor x, Tensor y, Tensor? ptr_x=None, Tensor? ptr_y=None, float r=1.0, "
    "int max_num_neighbors=32, int num_workers=1, bool ignore_same_index=False) -> Tensor",
    "nearest": "(Tensor x, Tensor y, Tensor? ptr_x=None, Tensor? ptr_y=None) -> Tensor",
    "grid_cluster": "(Tensor pos, Tensor size, Tensor? start=None, Tensor? end=None) -> Tensor",
}
_registered = {}


def _batch_of(name: str, ptr: Tensor, n: int) -> Optional[Tensor]:
    """The example id of each of ``n`` rows from a CSR pointer (None for a single example)."""
    if ptr.dim() != 1 or ptr.numel() < 1 or ptr.dtype.is_floating_point or ptr.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer tensor of B + 1 offsets, got {ptr.dtype} of shape {tuple(ptr.shape)}")
    first, last, sorted_ = torch.stack([ptr[0], ptr[-1], (ptr.diff() >= 0).all().to(ptr.dtype)]).tolist()
    if first != 0 or last != n or not sorted_:
        raise ValueError(f"{name} must rise from 0 to the number of rows ({n}), got {first} ... {last}")
    if ptr.numel() == 2:
        return None
    ids = torch.arange(ptr.numel() - 1, device=ptr.device)
    return ids.repeat_interleave(ptr.diff().to(torch.int64), output_size=n)


def _batches(x: Tensor, y: Tensor, ptr_x: Optional[Tensor], ptr_y: Optional[Tensor]):
    if ptr_x is None:  # pyg-lib's kernels read ptr_y only with ptr_x
        return None, None
    if ptr_y is None:
        raise ValueError("ptr_y is required with ptr_x")
    bx, by = _batch_of("ptr_x", ptr_x, x.shape[0]), _batch_of("ptr_y", ptr_y, y.shape[0])
    if ptr_x.shape[0] != ptr_y.shape[0]:  # (pyg-lib reads ptr_y at ptr_x's examples: past its end, or some unread)
        raise ValueError(f"ptr_x and ptr_y must hold the offsets of the same number of examples, got {ptr_x.shape[0] - 1} and {ptr_y.shape[0] - 1}")
    if bx is None:
        return None, None
    return bx, by


def _fps(src: Tensor, ptr: Tensor, ratio: float = 0.5, random_start: bool = True) -> Tensor:
    src = src.view(src.shape[0], -1)
    batch = _batch_of("ptr", ptr, src.shape[0])
    return _tc.fps(src, batch, ratio=ratio, random_start=random_start)


def _knn(x, y, ptr_x=None, ptr_y=None, k: int = 1, cosine: bool = False, num_workers: int = 1) -> Tensor:
    bx, by = _batches(x, y, ptr_x, ptr_y)
    return _tc.knn(x, y, k, bx, by, cosine=cosine)


def _radius(x, y, ptr_x=None, ptr_y=None, r: float = 1.0, max_num_neighbors: int = 32, num_workers: int = 1,
            ignore_same_index: bool = False) -> Tensor:
    bx, by = _batches(x, y, ptr_x, ptr_y)
    return _tc.radius(x, y, r, bx, by, max_num_neighbors, ignore_same_index=ignore_same_index)


def _nearest(x, y, ptr_x=None, ptr_y=None) -> Tensor:
    x, y = x.view(x.shape[0], -1), y.view(y.shape[0], -1)
    bx, by = _batches(x, y, ptr_x, ptr_y)
    # the nearest point is the single nearest neighbour (ties by the smaller index); examples of
    # y without points of x are allowed, as in pyg-lib
    edges = _tc.knn(y, x, 1, by, bx)
    if edges.shape[1] != x.shape[0]:
        raise ValueError("every example of x must hold at least one point of y")
    return edges[1].clone()


def _grid_cluster(pos, size, start=None, end=None) -> Tensor:
    return _tc.grid_cluster(pos, size, start, end)


def _edges(x: Tensor) -> Tensor:
    return x.new_empty((2, torch.library.get_ctx().new_dynamic_size()), dtype=torch.int64)


def _fps_fake(src, ptr, ratio=0.5, random_start=True):
    return src.new_empty((torch.library.get_ctx().new_dynamic_size(),), dtype=torch.int64)


def _knn_fake(x, y, ptr_x=None, ptr_y=None, k=1, cosine=False, num_workers=1):
    if ptr_x is None:  # min(k, N) neighbours for each row of y
        return x.new_empty((2, y.shape[0] * torch.sym_min(k, x.shape[0])), dtype=torch.int64)
    if ptr_y is None:
        raise ValueError("ptr_y is required with ptr_x")
    return _edges(x)


def _radius_fake(x, y, ptr_x=None, ptr_y=None, r=1.0, max_num_neighbors=32, num_workers=1, ignore_same_index=False):
    return _edges(x)


def _rows_fake(x, y, start_or_ptr=None, end_or_ptr=None):
    return x.new_empty((x.shape[0],), dtype=torch.int64)


# The impls carry the schema's defaults: the dispatcher leaves out trailing arguments equal to
# their defaults when it calls back into Python.
_IMPLS = {
    "fps": (_fps, _fps_fake),
    "knn": (_knn, _knn_fake),
    "radius": (_radius, _radius_fake),
    "nearest": (_nearest, _rows_fake),
    "grid_cluster": (_grid_cluster, _rows_fake),
}


def _exists(name: str) -> bool:
    try:
        getattr(torch.ops.pyg, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def register() -> None:
    """Define ``torch.ops.pyg.{fps, knn, radius, nearest, grid_cluster}`` (once per process).

    Raises RuntimeError where a real pyg-lib is importable: its library defines these operators
    itself, and a second definition would make loading it fail.
    """
    if len(_registered) == len(SCHEMAS):
        return
    if importlib.util.find_spec("pyg_lib") is not None:
        raise RuntimeError("a real pyg_lib is installed; it defines torch.ops.pyg itself")
    for name, (impl, fake) in _IMPLS.items():
        if name in _registered:
            continue
        if _exists(name):
            raise RuntimeError(f"torch.ops.pyg.{name} is already defined by another library")
        op = torch.library.custom_op(
            f"pyg::{name}", impl, mutates_args=(), schema=SCHEMAS[name], tags=(torch.Tag.cudagraph_unsafe,)
        )
        op.register_fake(fake)
        _registered[name] = op


# PyG's flags for the operators above (torch_geometric/typing.py, 2.7+)
FLAGS = ("WITH_FPS", "WITH_KNN", "WITH_RADIUS", "WITH_NEAREST", "WITH_GRID_CLUSTER")
__in_sys_modules__ = False  # install() enters no module under pyg-lib's name: PyG keeps WITH_PYG_LIB = False


def __install__() -> str:
    """Run by ``pcops.compat.install("pyg")``: the operators, then PyG's flags; returns what it did."""
    register()
    pyg_typing = importlib.import_module("torch_geometric.typing")
    found = [name for name in FLAGS if hasattr(pyg_typing, name)]
    for name in found:
        setattr(pyg_typing, name, True)
    if not found:
        return ("torch.ops.pyg operators defined; this PyG (before 2.7) calls torch_cluster, not them: "
                "install('torch_cluster') for its point-cloud functions")
    return f"torch.ops.pyg.{{{', '.join(_IMPLS)}}} defined; torch_geometric.typing.{', '.join(found)} set True"


def _call(name: str):
    return getattr(torch.ops.pyg, name)


def fps(src: Tensor, ptr: Tensor, ratio: float = 0.5, random_start: bool = True) -> Tensor:
    """pyg-lib's ``fps``: farthest point sampling per example of the CSR pointer ``ptr``."""
    return _call("fps")(src, ptr, ratio, random_start)


def knn(x: Tensor, y: Tensor, k: int = 1, ptr_x: Optional[Tensor] = None, ptr_y: Optional[Tensor] = None,
        cosine: bool = False, num_workers: int = 1) -> Tensor:
    """pyg-lib's ``knn``: (2, E) edges, row 0 indexes ``y``, row 1 ``x``."""
    return _call("knn")(x, y, ptr_x, ptr_y, k, cosine, num_workers)


def radius(x: Tensor, y: Tensor, r: float = 1.0, ptr_x: Optional[Tensor] = None, ptr_y: Optional[Tensor] = None,
           max_num_neighbors: int = 32, num_workers: int = 1, ignore_same_index: bool = False) -> Tensor:
    """pyg-lib's ``radius``: (2, E) edges, row 0 indexes ``y``, row 1 ``x``."""
    return _call("radius")(x, y, ptr_x, ptr_y, r, max_num_neighbors, num_workers, ignore_same_index)


def nearest(x: Tensor, y: Tensor, ptr_x: Optional[Tensor] = None, ptr_y: Optional[Tensor] = None) -> Tensor:
    """pyg-lib's ``nearest``: for each row of ``x`` the index of its nearest row of ``y``."""
    return _call("nearest")(x, y, ptr_x, ptr_y)


def grid_cluster(pos: Tensor, size: Tensor, start: Optional[Tensor] = None, end: Optional[Tensor] = None) -> Tensor:
    """pyg-lib's ``grid_cluster``: the voxel index of each point."""
    return _call("grid_cluster")(pos, size, start, end)
