"""pcops ops, grouped by family; each module holds one op (Warp kernels, custom op, fake, autograd, public function).

- ``neighbours``: kNN search and aggregation, ball query, radius aggregation, graphs, interpolation, gather
- ``sampling``: farthest point sampling, voxel pooling, grid sampling
- ``geometry``: Chamfer distance, normal estimation
- ``sparse``: serialization, segment reductions, sparse convolution
- ``mesh``: distance and signed distance to triangle meshes
- ``transport``: the Sinkhorn divergence and the exact earth mover's distance

``_bound`` (the padded static-size forms' shared pieces) serves several families.
"""

from . import geometry, mesh, neighbours, sampling, sparse, transport
from .geometry import *  # noqa: F403  (each family lists its names once, in its own __all__)
from .mesh import *  # noqa: F403
from .neighbours import *  # noqa: F403
from .sampling import *  # noqa: F403
from .sparse import *  # noqa: F403
from .transport import *  # noqa: F403

FAMILIES = (neighbours, sampling, geometry, sparse, mesh, transport)
__all__ = [name for family in FAMILIES for name in family.__all__]
