"""The input layouts of pcops, one package: every public function reads

    resolve its numbers -> lay out its inputs here -> call its custom op -> unflatten the result

and every shape, dtype, device, finiteness and range check of its inputs happens in this layer
(:mod:`pcops._validate` holds the checks themselves), with messages that name the arguments as
the caller typed them. Four layouts:

* :mod:`.points` -- point clouds, single, padded (PyTorch3D) or packed (PyTorch Geometric):
  :func:`pair` (two clouds), :func:`single` (one cloud), :func:`unflatten`, :func:`local_index`,
  the plain clouds that ops may take without it (:func:`plain_clouds`),
  and the sample count of a pair of clouds, :func:`sample_count`;
* :mod:`.sites` -- integer sites with sample ids, and the value checks of integer data
  (:func:`sites`, :func:`values`);
* :mod:`.meshes` -- triangle meshes and the points queried against them (:func:`mesh`,
  :func:`mesh_points`, the number of meshes :func:`mesh_count`);
* :mod:`.grids` -- dense grids of values with their origin and voxel size (:func:`grid`).

``validate`` has one meaning everywhere: True checks the values too, in one host read per call
in eager mode (:func:`pcops._validate.checks`); False skips what reads values, and a bad value
then gives an unspecified result, never a crash or a hang.
"""

from .grids import Grid, grid
from .meshes import FlatMesh, FlatPoints, every_in, local_faces, mesh, mesh_count, mesh_points, points_have_meshes
from .points import Flat, Names, local_index, names, padded_groups, pair, plain_clouds, sample_count, select_rows, single, unflatten
from .sites import sites, values

__all__ = [
    "Flat", "FlatMesh", "Grid", "grid", "FlatPoints", "Names", "every_in", "local_faces", "local_index", "mesh", "mesh_count", "mesh_points", "names",
    "padded_groups", "pair", "plain_clouds", "points_have_meshes", "sample_count", "select_rows", "single", "sites", "unflatten", "values",
]
