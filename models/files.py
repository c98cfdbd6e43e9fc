"""The signed-distance task from files: meshes, point clouds and ModelNet-style HDF5.

* meshes (.ply, .off, .obj, .stl; ModelNet's .off included), read with trimesh: surface
  points and face normals sampled area-uniformly; targets are the exact distances to the
  mesh, negative inside, in float64 (``pcops.mesh_distance(..., signed=True)`` on the mesh's
  hierarchy, built once per mesh with ``pcops.mesh_bvh``). Inside means a generalised winding
  number >= 1/2, so the sign stays right on meshes that are not watertight (holes, gaps,
  non-manifold edges, self-intersections), where the ray tests of
  ``trimesh.proximity.signed_distance`` (the targets before) flip; the sign follows the
  orientation of the faces, so a mesh whose faces are not consistently oriented gets a
  warning (its sign is unreliable), and a mesh that is inside out (negative signed volume)
  has its faces flipped when it is read;
* point clouds: .npy (P, 3) or (P, 6) with normals, .npz with ``points`` (and ``normals``),
  .xyz text with 3 or 6 columns;
* HDF5 (.h5, .hdf5), read with h5py: ``data`` (S, P, 3), optional ``normal`` (S, P, 3) and
  ``label`` (S,): each row is one cloud.

Clouds without normals get PCA normals from their 16 nearest neighbours (``pcops.knn``),
oriented away from the centroid (right for star-shaped objects). A cloud's targets are
``sign((q - p) . n) * ||q - p||`` for its nearest point p with normal n.

Each item (a mesh or a cloud) gives ``draws`` samples, each with its own surface points and
queries (and, with ``rotate``, a random rotation); all of an item's samples go to the same
split. Everything is centred and scaled into [-0.9, 0.9]^3 (after the rotation) before
sampling.
"""

from __future__ import annotations

import glob
import pathlib
import warnings

import numpy as np
import torch

import pcops

from .data import Progress, TensorDictDataset, _Module, sdf_queries
from .shapes import _rotation, slice_grid

MESH = {".ply", ".off", ".obj", ".stl"}
CLOUD = {".npy", ".npz", ".xyz"}
HDF5 = {".h5", ".hdf5"}


def expand(paths: list[str]) -> list[pathlib.Path]:
    """Files named by paths or glob patterns; a clear error for a pattern matching nothing."""
    if isinstance(paths, str):
        paths = [paths]
    files: list[pathlib.Path] = []
    for pattern in paths:
        matches = sorted(glob.glob(str(pathlib.Path(pattern).expanduser()), recursive=True))
        if not matches:
            raise FileNotFoundError(f"data.paths: no file matches {pattern!r}")
        for match in matches:
            path = pathlib.Path(match)
            if path.suffix.lower() not in MESH | CLOUD | HDF5:
                raise ValueError(f"data.paths: {path} has an unsupported suffix; use one of {sorted(MESH | CLOUD | HDF5)}")
            files.append(path)
    return files


def _normalise(points: np.ndarray) -> tuple[np.ndarray, float]:
    lo, hi = points.min(0), points.max(0)
    centre, scale = (lo + hi) / 2, max(float((hi - lo).max()) / 1.8, 1e-12)
    return centre, scale


def read_clouds(path: pathlib.Path) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """(points, normals or None) of every cloud in a point-cloud or HDF5 file."""
    suffix = path.suffix.lower()
    if suffix in HDF5:
        import h5py

        with h5py.File(path, "r") as f:
            if "data" not in f:
                raise ValueError(f"{path}: an HDF5 file needs a 'data' dataset of shape (S, P, 3)")
            data = np.asarray(f["data"], dtype=np.float64)
            normals = np.asarray(f["normal"], dtype=np.float64) if "normal" in f else None
        return [(data[i], None if normals is None else normals[i]) for i in range(data.shape[0])]
    if suffix == ".npz":
        with np.load(path) as f:
            if "points" not in f:
                raise ValueError(f"{path}: an .npz cloud needs a 'points' array of shape (P, 3)")
            return [(f["points"].astype(np.float64), f["normals"].astype(np.float64) if "normals" in f else None)]
    array = np.load(path) if suffix == ".npy" else np.loadtxt(path, ndmin=2)
    if array.ndim != 2 or array.shape[1] not in (3, 6):
        raise ValueError(f"{path}: a point cloud must have 3 (xyz) or 6 (xyz + normal) columns, got shape {array.shape}")
    array = array.astype(np.float64)
    return [(array[:, :3], array[:, 3:] if array.shape[1] == 6 else None)]


NORMAL_K = 16  # neighbours of the PCA normals of a cloud without normals


def _problem(path: pathlib.Path, what: str) -> ValueError:
    return ValueError(f"data.paths: {path}: {what}")


def _check_cloud(path: pathlib.Path, points: np.ndarray, normals: np.ndarray | None, min_points: int, label: str = "") -> None:
    """A usable cloud: finite, at least ``min_points`` distinct points, not flat to a point, unit-able normals."""
    if points.ndim != 2 or points.shape[1] != 3:
        raise _problem(path, f"{label}points must have shape (P, 3), got {points.shape}")
    if not np.isfinite(points).all():
        raise _problem(path, f"{label}points contain NaN or inf")
    distinct = len(np.unique(points, axis=0))
    if distinct < min_points:
        raise _problem(path, f"{label}{distinct} distinct point(s); at least min_points={min_points} are needed")
    if normals is not None:
        if normals.shape != points.shape:
            raise _problem(path, f"{label}normals must have the shape of the points {points.shape}, got {normals.shape}")
        if not np.isfinite(normals).all() or (np.linalg.norm(normals, axis=1) == 0).any():
            raise _problem(path, f"{label}normals contain NaN, inf or zero vectors")


def _load_mesh(path: pathlib.Path):
    """A checked trimesh mesh: readable, finite, with faces of positive total area."""
    import trimesh

    try:
        mesh = trimesh.load(path, force="mesh")
    except Exception as err:  # trimesh raises many kinds for a malformed file
        raise _problem(path, f"cannot be read as a {path.suffix} mesh ({type(err).__name__}: {err})") from err
    vertices = np.asarray(getattr(mesh, "vertices", np.zeros((0, 3))), dtype=np.float64)
    faces = np.asarray(getattr(mesh, "faces", np.zeros((0, 3))))
    if not len(faces):
        raise _problem(path, "a mesh with no faces")
    if not np.isfinite(vertices).all():
        raise _problem(path, "vertices contain NaN or inf")
    if not float(mesh.area) > 0:
        raise _problem(path, "a mesh with zero surface area")
    if not mesh.is_winding_consistent:
        warnings.warn(f"{path}: its faces are not consistently oriented: the sign of its distances (winding number) is unreliable")
    elif _signed_volume(mesh.vertices, mesh.faces) < 0:
        mesh.invert()  # inside out: its inside would have winding number -1
    return mesh


def _signed_volume(vertices: np.ndarray, faces: np.ndarray) -> float:
    """The volume the faces enclose, positive for outward faces (about the bounding box centre,
    so that an open mesh gets a meaningful sign too)."""
    corners = np.asarray(vertices, dtype=np.float64)[np.asarray(faces)]
    corners = corners - (corners.reshape(-1, 3).min(0) + corners.reshape(-1, 3).max(0)) / 2
    return float(np.linalg.det(corners).sum() / 6)


def mesh_sdf(vertices: np.ndarray, faces: np.ndarray):
    """Signed distance to a triangle mesh in float64, negative inside (generalised winding number
    >= 1/2): ``pcops.mesh_distance`` on the mesh's hierarchy, built once here."""
    bvh = pcops.mesh_bvh(torch.from_numpy(np.asarray(vertices, dtype=np.float64)),
                         torch.from_numpy(np.asarray(faces, dtype=np.int64)))

    def sdf(queries: torch.Tensor) -> torch.Tensor:
        return pcops.mesh_distance(queries.double(), bvh, signed=True).dists

    return sdf


def load_items(files: list[pathlib.Path], min_points: int = NORMAL_K) -> list[tuple[str, object]]:
    """Read and check every file up front: (kind, payload) per item, ("mesh", (path, trimesh mesh)) or
    ("cloud", (points, normals)); a ValueError naming the file and the problem otherwise."""
    items = []
    for path in files:
        if path.suffix.lower() in MESH:
            items.append(("mesh", (path, _load_mesh(path))))
            continue
        try:
            clouds = read_clouds(path)
        except ValueError as err:
            if str(err).startswith(str(path)):
                raise _problem(path, str(err)[len(str(path)) + 2 :]) from err
            raise _problem(path, f"cannot be read as a {path.suffix} cloud ({err})") from err
        except Exception as err:  # numpy/h5py raise many kinds for a malformed file
            raise _problem(path, f"cannot be read as a {path.suffix} cloud ({type(err).__name__}: {err})") from err
        if not clouds:
            raise _problem(path, "no clouds")
        for i, (points, normals) in enumerate(clouds):
            _check_cloud(path, points, normals, min_points, f"cloud {i}: " if len(clouds) > 1 else "")
            items.append(("cloud", (points, normals)))
    return items


def estimate_normals(points: torch.Tensor, k: int = 16) -> torch.Tensor:
    """Unit normals by PCA over each point's k nearest neighbours (``pcops.estimate_normals``),
    oriented away from the centroid."""
    normals = pcops.estimate_normals(points, min(k, points.shape[0]))
    outward = ((points - points.mean(0)) * normals).sum(-1, keepdim=True) < 0
    return torch.where(outward, -normals, normals)


def cloud_sdf(points: torch.Tensor, normals: torch.Tensor):
    """Signed distance to an oriented cloud, from the nearest point and its normal."""

    def sdf(queries: torch.Tensor) -> torch.Tensor:
        dists, idx = pcops.knn(queries, points, 1)
        side = ((queries - points[idx[:, 0]]) * normals[idx[:, 0]]).sum(-1)
        return torch.where(side < 0, -dists[:, 0], dists[:, 0])

    return sdf


class FileSDFDataModule(_Module):
    """Surface clouds and signed distances from files (see the module docs).

    Args:
        paths: files or glob patterns (``**`` allowed), e.g. ["data/ModelNet10/*/train/*.off"].
            Every file is read and checked when the module is made (before a run directory
            exists): readable, finite, at least ``min_points`` distinct points.
        min_points: fewest distinct points a cloud may have (at least the model's largest k
            and the 16 neighbours of the estimated normals).
        n_points, n_queries, near_std, grid_resolution: as in ShapesSDFDataModule.
        val_fraction, test_fraction: share of the items held out (at least one each when
            there are 3 or more items; with fewer, every split uses all items, with a warning).
        draws: samples per item, each with its own surface points and queries; an item's
            samples all go to the split of the item.
        rotate: turn each sample (the first included) by its own uniformly random rotation
            before it is scaled into [-0.9, 0.9]^3.
    """

    def __init__(
        self,
        paths: list[str],
        n_points: int = 1024,
        n_queries: int = 1024,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        near_std: float = 0.05,
        grid_resolution: int = 24,
        batch_size: int = 8,
        seed: int = 0,
        num_workers: int = 0,
        min_points: int = NORMAL_K,
        draws: int = 1,
        rotate: bool = False,
    ):
        super().__init__(batch_size, seed, num_workers)
        if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
            raise ValueError(f"draws must be a positive integer, got {draws!r}")
        self.files = expand(paths)  # fail before any work on a missing file
        self.items = load_items(self.files, min_points)  # ... or on a malformed one
        self.save_hyperparameters()
        self._figure_sdf = None  # the first test sample's true field, for a mesh

    def _sample(self, kind, payload, i: int, draw: int = 0):
        """Item i's sample number ``draw`` and its signed distance function."""
        h = self.hparams
        seed = h.seed * 1_000_003 + i + draw * 1_000_000_007  # draw 0: the seed of one draw per item
        gen = torch.Generator().manual_seed(seed)
        rotation = _rotation(gen).numpy() if h.rotate else None
        if kind == "mesh":
            import trimesh

            mesh = payload[1].copy()
            if rotation is not None:
                mesh.vertices = mesh.vertices @ rotation.T
            centre, scale = _normalise(np.asarray(mesh.vertices))
            mesh.apply_translation(-centre)
            mesh.apply_scale(1.0 / scale)
            points, faces = trimesh.sample.sample_surface(mesh, h.n_points, seed=seed)
            points = torch.from_numpy(np.asarray(points, dtype=np.float64))
            normals = torch.from_numpy(np.asarray(mesh.face_normals[faces], dtype=np.float64))
            sdf = mesh_sdf(mesh.vertices, mesh.faces)
        else:
            cloud, cloud_normals = payload
            if rotation is not None:
                cloud = cloud @ rotation.T
                cloud_normals = None if cloud_normals is None else cloud_normals @ rotation.T
            centre, scale = _normalise(cloud)
            all_points = torch.from_numpy((cloud - centre) / scale)
            if cloud_normals is None:
                all_normals = estimate_normals(all_points)
            else:
                all_normals = torch.nn.functional.normalize(torch.from_numpy(cloud_normals), dim=-1)
            pick = torch.randint(all_points.shape[0], (h.n_points,), generator=gen)
            points, normals = all_points[pick], all_normals[pick]
            sdf = cloud_sdf(all_points, all_normals)
        queries, target = sdf_queries(sdf, points, h.n_queries, gen, h.near_std, h.grid_resolution)
        return {"points": points, "normals": normals, "queries": queries, "target": target}, (sdf if kind == "mesh" else None)

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        h, items = self.hparams, self.items
        order = torch.randperm(len(items), generator=torch.Generator().manual_seed(h.seed)).tolist()
        n = len(order)
        if n < 3:
            warnings.warn(f"only {n} item(s) in data.paths: train, val and test all use them")
            n_val = n_test = 0
        else:
            n_val = max(1, round(h.val_fraction * n))
            n_test = max(1, round(h.test_fraction * n))
        first_test = n_val if n >= 3 else 0  # the item whose first sample the figure shows
        progress = Progress(n * h.draws, "samples", f"from {len(self.files)} file(s)" + (f", {h.draws} per item" if h.draws > 1 else ""))
        samples = []
        for position, j in enumerate(order):
            for draw in range(h.draws):
                sample, sdf = self._sample(*items[j], j, draw)
                samples.append(sample)
                if position == first_test and draw == 0:
                    self._figure_sdf = sdf
                progress.step()
        progress.done()
        if n < 3:
            parts = {"train": samples, "val": samples, "test": samples}
        else:
            val, test = n_val * h.draws, (n_val + n_test) * h.draws
            parts = {"val": samples[:val], "test": samples[val:test], "train": samples[test:]}
        for split, part in parts.items():
            self.splits[split] = TensorDictDataset.stack(part)

    def figure_sample(self, resolution: int = 64) -> dict[str, torch.Tensor]:
        """The first test sample's cloud with queries on the z = 0 slice; targets: the mesh's
        signed distance for a mesh, the nearest-point SDF of the sample's cloud for a cloud."""
        self.setup()
        sample = self.splits["test"][0]
        queries = slice_grid(resolution)
        if self._figure_sdf is not None:
            target = self._figure_sdf(queries.double()).float()
        else:
            target = cloud_sdf(sample["points"].double(), sample["normals"].double())(queries.double()).float()
        return {"points": sample["points"][None], "normals": sample["normals"][None], "queries": queries[None], "target": target[None]}
