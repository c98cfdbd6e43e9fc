"""One mechanism for kNN search backends: each is a ``pcops::knn_<name>`` custom op with one fake.

A backend implements ``search(query (M, 3), ref (N, 3), k, query_group, ref_group)
-> (dists (M, k), idx (M, k) int64)`` on float32/float64 inputs of one dtype, sorted by distance
ascending, ties by the smaller index. With groups ((M,) and (N,) int32, or both None) a query
only sees reference points of its own group; a query with fewer than k such points gets
idx -1 and dist inf in the remaining columns. Search results are not differentiable
(distances for gradients are recomputed in torch by the public functions).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Optional

import torch

from .... import _threads, _validate

BACKENDS: dict[str, "Backend"] = {}


@dataclasses.dataclass(frozen=True)
class Backend:
    """A registered search backend: its custom op, the devices it runs on and what it needs."""

    name: str
    op: Callable
    devices: tuple[str, ...]
    requires: tuple[str, ...] = ()
    install: str = ""
    fn: Optional[Callable] = None  # the op's function: ``fn(query, ref, k, query_group, ref_group)``

    def available(self) -> bool:
        """All the modules it needs import (once they have, they stay imported: not tried again)."""
        if self.requires in _IMPORTED:
            return True
        try:
            for module in self.requires:
                importlib.import_module(module)
        except ImportError:
            return False
        _IMPORTED.add(self.requires)
        return True


_IMPORTED: set = set()  # the ``requires`` of backends whose modules have imported in this process


def backend(name: str, devices: tuple[str, ...], requires: tuple[str, ...] = (), install: str = ""):
    """Register ``fn(query, ref, k, query_group, ref_group)`` as the op ``pcops::knn_<name>``.

    All backends share the fake and the value check (NaN/inf in the points), which runs in the
    op's real implementation so that it never breaks a ``torch.compile`` graph.
    """

    def register(fn: Callable) -> Callable:
        def search(
            query: torch.Tensor,
            ref: torch.Tensor,
            k: int,
            validate: bool,
            query_group: Optional[torch.Tensor] = None,
            ref_group: Optional[torch.Tensor] = None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            _validate.groups_paired(query_group, ref_group)
            if validate:
                _validate.finite(query=query, ref=ref)
            return fn(query, ref, k, query_group, ref_group)

        # every backend syncs or allocates outside torch: CUDA graphs must not capture it
        op = _threads.custom_op(
            f"pcops::knn_{name}", search, mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
        )
        op.register_fake(_fake)
        BACKENDS[name] = Backend(name=name, op=op, devices=devices, requires=requires, install=install, fn=fn)
        return op

    return register


def _fake(query, ref, k, validate, query_group=None, ref_group=None):
    shape = (query.shape[0], k)
    return query.new_empty(shape), query.new_empty(shape, dtype=torch.int64)
