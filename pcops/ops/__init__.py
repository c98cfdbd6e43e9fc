"""pcops ops: one module per op family (Warp kernels, custom op, fake, autograd, public function)."""

from .radius import radius_aggregate

__all__ = ["radius_aggregate"]
