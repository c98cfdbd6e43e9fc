"""ModelNet10/40 classification from a local copy (nothing is downloaded).

Get the data once (about 0.5 GB for ModelNet40, 0.5 GB for ModelNet10; Princeton's ModelNet
page, https://modelnet.cs.princeton.edu/):

    wget http://modelnet.cs.princeton.edu/ModelNet40.zip && unzip ModelNet40.zip

and point ``root`` at the unzipped directory, whose layout is ``<root>/<class>/{train,test}/*.off``.
Each mesh is read with trimesh, ``n_points`` points are sampled area-uniformly on its surface,
centred and scaled into the unit ball, and cached beside the mesh as ``<name>.<n_points>.npz``
(later runs read only the caches; delete them to resample). A few ModelNet files have the
header run into the counts (``OFF490 518 0``): they are read as if the line break were there.

Batches are dicts: ``points`` (B, N, 3) float32 and ``label`` (B,) int64 (the class's position
in the sorted class directories). The standard train/test split is kept; ``val_fraction`` of
each class's training meshes (a seeded choice) is held out for validation.
"""

from __future__ import annotations

import io
import pathlib

import numpy as np
import torch

from .data import Progress, TensorDictDataset, _Module, say


def read_off(path: pathlib.Path):
    """A trimesh mesh from an .off file, tolerating ModelNet's merged ``OFF<counts>`` header."""
    import trimesh

    text = path.read_text()
    if text.startswith("OFF") and not text[3:4].isspace():
        text = "OFF\n" + text[3:]
    return trimesh.load(io.StringIO(text), file_type="off", force="mesh")


def sample_mesh(path: pathlib.Path, n_points: int, seed: int) -> np.ndarray:
    """n_points surface points (n_points, 3) float32, centred and scaled into the unit ball."""
    import trimesh

    mesh = read_off(path)
    if len(mesh.faces) == 0 or mesh.area <= 0:
        raise ValueError(f"{path}: the mesh has no faces with area to sample")
    points, _ = trimesh.sample.sample_surface(mesh, n_points, seed=seed)
    points = points - points.mean(0)
    return (points / max(float(np.linalg.norm(points, axis=1).max()), 1e-12)).astype(np.float32)


def cache_path(path: pathlib.Path, n_points: int) -> pathlib.Path:
    """Where the sampled points of the mesh at ``path`` are cached: ``<name>.<n_points>.npz`` beside it."""
    return path.with_name(f"{path.stem}.{n_points}.npz")


def cached_points(path: pathlib.Path, n_points: int, seed: int) -> np.ndarray:
    """``sample_mesh`` through the ``<name>.<n_points>.npz`` cache beside the mesh."""
    cache = cache_path(path, n_points)
    if cache.exists():
        with np.load(cache) as f:
            return f["points"]
    points = sample_mesh(path, n_points, seed)
    np.savez(cache, points=points)
    return points


def find_classes(root: pathlib.Path) -> list[str]:
    """Sorted class directories under root that hold train/*.off; clear errors for a wrong root."""
    if not root.is_dir():
        raise FileNotFoundError(
            f"data.root: no directory {root}; download ModelNet40.zip (or ModelNet10.zip) from "
            "https://modelnet.cs.princeton.edu/, unzip it and set data.root to the unzipped folder (see models/modelnet.py)"
        )
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and any((d / "train").glob("*.off")))
    if not classes:
        raise ValueError(f"data.root: {root} has no <class>/train/*.off meshes; it must be the folder holding ModelNet's class directories")
    return classes


class ModelNetDataModule(_Module):
    """ModelNet10/40 point clouds: ``n_points`` surface samples per mesh (see the module docs).

    Args:
        root: the unzipped ModelNet10 or ModelNet40 folder.
        n_points: points per cloud.
        classes: a subset of the class names (default: every class directory under root).
        val_fraction: share of each class's training meshes held out for validation.
        jitter: std of Gaussian noise added to training clouds each time they are drawn.
        seed: the surface sampling and the validation choice depend only on it.
    """

    def __init__(
        self,
        root: str,
        n_points: int = 1024,
        classes: list[str] | None = None,
        val_fraction: float = 0.1,
        jitter: float = 0.0,
        batch_size: int = 32,
        seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__(batch_size, seed, num_workers)
        self.root = pathlib.Path(root).expanduser()
        found = find_classes(self.root)  # fails here, before any work, for a wrong root
        if classes is not None:
            missing = sorted(set(classes) - set(found))
            if missing:
                raise ValueError(f"data.classes: {missing} not found under {self.root} (found {found})")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.classes = list(classes) if classes is not None else found
        self.save_hyperparameters()

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def files(self, split: str) -> list[tuple[pathlib.Path, int]]:
        """(mesh, label) of a directory split ("train" or "test"), sorted."""
        return [(path, label) for label, name in enumerate(self.classes) for path in sorted((self.root / name / split).glob("*.off"))]

    def prepare_data(self) -> None:
        """Sample and cache every mesh once (rank 0 only under DDP), saying where the caches go."""
        n = self.hparams.n_points
        todo = [path for split in ("train", "test") for path, _ in self.files(split) if not cache_path(path, n).exists()]
        if not todo:
            return
        progress = Progress(len(todo), "point caches", f"{n} points per mesh, beside the meshes under {self.root}")
        for path in todo:
            cached_points(path, n, self.hparams.seed)
            progress.step()
        progress.done()
        say(f"wrote {len(todo)} point caches: {self.root}/<class>/<split>/<mesh>.{n}.npz (delete them to resample)")

    def _load(self, files: list[tuple[pathlib.Path, int]]) -> TensorDictDataset:
        h = self.hparams
        points = np.stack([cached_points(path, h.n_points, h.seed) for path, _ in files]) if files else np.zeros((0, h.n_points, 3), np.float32)
        labels = torch.tensor([label for _, label in files], dtype=torch.int64)
        return TensorDictDataset({"points": torch.from_numpy(points), "label": labels})

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        train = self.files("train")
        gen = torch.Generator().manual_seed(self.hparams.seed)
        held = set()
        for label in range(len(self.classes)):
            members = [i for i, (_, lab) in enumerate(train) if lab == label]
            count = int(round(self.hparams.val_fraction * len(members)))
            held |= {members[int(j)] for j in torch.randperm(len(members), generator=gen)[:count]}
        self.splits["train"] = self._load([f for i, f in enumerate(train) if i not in held])
        self.splits["val"] = self._load([f for i, f in enumerate(train) if i in held])
        self.splits["test"] = self._load(self.files("test"))

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        if self.hparams.jitter > 0 and self.trainer is not None and self.trainer.training:
            batch["points"] = batch["points"] + self.hparams.jitter * torch.randn_like(batch["points"])
        return batch
