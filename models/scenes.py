"""Procedural point-cloud classification and segmentation (offline, deterministic from a seed).

Every batch is a dict of padded tensors:

    points (B, N, 3)  float32, each cloud centred and scaled into the unit ball
    label  (B,)       int64 class of the shape (classification)
    labels (B, N)     int64 class of the primitive each point lies on (segmentation)

* :class:`ShapesClassDataModule` - one primitive per cloud; the class is its family (``CLASSES``:
  sphere, ellipsoid, box, rounded box, torus, capsule, cylinder, cone, prism). Every shape has
  random parameters, a random non-uniform scale per axis (``anisotropy``) and a random rotation,
  so size, proportions and pose carry no label: a sphere squashed by the scale looks like a mild
  ellipsoid, a rounded box like a box, a short capsule like a cylinder. Options: Gaussian
  ``jitter``, partial ``occlusion`` (a random plane cuts away up to that fraction of the surface)
  and non-uniform ``density`` (points drawn with weight exp(density * s), s the coordinate
  along a random direction).
  With ``augment`` every training batch is rescaled and rotated afresh (see :func:`augment`).
* :class:`ShapesSegDataModule` - scenes of 2 to 4 overlapping primitives; a point's label is the
  family of the primitive whose surface it lies on (parts inside another primitive are removed,
  so the cloud is the surface of the union).

Surface points come from :meth:`models.shapes.Shape.sample_surface` in each primitive's own
frame (exact SDFs), then go through the primitive's linear map; whether a point lies inside
another primitive is the sign of that primitive's SDF in its own frame (a linear map keeps the
sign).
"""

from __future__ import annotations

import torch

from .data import TensorDictDataset, _Module
from .shapes import Shape, _rotation

CLASSES = ("sphere", "ellipsoid", "box", "rounded_box", "torus", "capsule", "cylinder", "cone", "prism")
ROTATIONS = ("so3", "z", "none")
SPLITS = {"train": 0, "val": 1, "test": 2}


def _uniform(gen: torch.Generator, low: float, high: float, *shape: int) -> torch.Tensor:
    return low + (high - low) * torch.rand(shape or (1,), generator=gen, dtype=torch.float64)


def _z_rotation(gen: torch.Generator) -> torch.Tensor:
    c, s = torch.cos(a := _uniform(gen, 0, 2 * torch.pi)[0]), torch.sin(a)
    return torch.tensor([[c, -s, 0], [s, c, 0], [0, 0, 1]], dtype=torch.float64)


class Primitive:
    """A primitive of family ``name`` under x -> R diag(axes) x + shift (R a rotation)."""

    def __init__(self, name: str, gen: torch.Generator, anisotropy: float, rotation: str, size=(1.0, 1.0), spread: float = 0.0):
        self.name = name
        self.kind = "sphere" if name == "ellipsoid" else name
        self.params = _uniform(gen, 0.3, 0.8, 3)
        stretch = torch.exp(_uniform(gen, -1, 1, 3) * torch.log1p(torch.tensor(anisotropy, dtype=torch.float64)))
        if name == "ellipsoid":  # clearly unequal axes: 1, 1.5-2.2, 0.45-0.7 (before the common stretch)
            stretch = stretch * torch.cat([torch.ones(1, dtype=torch.float64), _uniform(gen, 1.5, 2.2), _uniform(gen, 0.45, 0.7)])
        self.axes = stretch * _uniform(gen, *size)
        self.rotation = {"so3": _rotation, "z": _z_rotation, "none": lambda g: torch.eye(3, dtype=torch.float64)}[rotation](gen)
        self.shift = spread * (2 * torch.rand(3, generator=gen, dtype=torch.float64) - 1)

    def sample(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """n surface points (n, 3) in world coordinates, float64."""
        local = Shape(self.kind, self.params, torch.eye(3, dtype=torch.float64), 1.0, torch.zeros(3, dtype=torch.float64))
        points, _ = local.sample_surface(n, gen)
        return (points * self.axes) @ self.rotation.T + self.shift

    def inside(self, x: torch.Tensor) -> torch.Tensor:
        """Whether world points x (P, 3) lie strictly inside (bool (P,))."""
        local = ((x - self.shift) @ self.rotation) / self.axes
        return Shape(self.kind, self.params, torch.eye(3, dtype=torch.float64), 1.0, torch.zeros(3, dtype=torch.float64)).sdf(local) < 0


def _normalise(points: torch.Tensor) -> torch.Tensor:
    points = points - points.mean(0)
    return points / points.norm(dim=-1).max().clamp_min(1e-12)


def _direction(gen: torch.Generator) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(3, generator=gen, dtype=torch.float64), dim=0)


def _pick(points: torch.Tensor, n: int, gen: torch.Generator, occlusion: float, density: float) -> torch.Tensor:
    """Indices of n of the candidate points after an occluding cut and with non-uniform density."""
    keep = torch.arange(points.shape[0])
    if occlusion > 0:  # drop the points beyond a random plane: a random fraction up to ``occlusion``
        s = points @ _direction(gen)
        cut = float(_uniform(gen, 0, occlusion))
        keep = keep[s <= torch.quantile(s, 1 - cut)]
    weights = torch.ones(keep.shape[0], dtype=torch.float64)
    if density > 0:
        s = points[keep] @ _direction(gen)
        weights = torch.exp(density * (s - s.max()) / (s.max() - s.min()).clamp_min(1e-12))
    return keep[torch.multinomial(weights, n, replacement=keep.shape[0] < n, generator=gen)]


def random_rotations(b: int, kind: str, device=None) -> torch.Tensor:
    """b random rotation matrices (b, 3, 3): uniform on SO(3) ("so3"), about z ("z") or identities ("none")."""
    if kind == "none":
        return torch.eye(3, device=device).expand(b, 3, 3)
    if kind == "z":
        angle = 2 * torch.pi * torch.rand(b, device=device)
        c, s, zero, one = torch.cos(angle), torch.sin(angle), torch.zeros(b, device=device), torch.ones(b, device=device)
        return torch.stack([c, -s, zero, s, c, zero, zero, zero, one], 1).view(b, 3, 3)
    w, x, y, z = torch.nn.functional.normalize(torch.randn(b, 4, device=device), dim=1).unbind(1)
    return torch.stack([
        1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w),
        2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w),
        2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y),
    ], 1).view(b, 3, 3)


def augment(points: torch.Tensor, rotation: str, anisotropy: float) -> torch.Tensor:
    """A fresh random per-axis scale and rotation of every cloud of a batch (B, N, 3), renormalised."""
    b = points.shape[0]
    stretch = torch.exp((2 * torch.rand(b, 1, 3, device=points.device) - 1) * torch.log1p(torch.tensor(anisotropy)))
    points = (points * stretch) @ random_rotations(b, rotation, points.device).transpose(1, 2)
    points = points - points.mean(1, keepdim=True)
    return points / points.norm(dim=-1).amax(1).clamp_min(1e-12)[:, None, None]


def _finish(points: torch.Tensor, gen: torch.Generator, jitter: float) -> torch.Tensor:
    points = _normalise(points)
    if jitter > 0:
        points = points + (jitter * torch.randn(points.shape, generator=gen, dtype=points.dtype)).clamp(-5 * jitter, 5 * jitter)
    return points.float()


class _PointModule(_Module):
    """Common options and checks of the procedural point tasks."""

    def __init__(self, classes, rotation: str, occlusion: float, density: float, batch_size: int, seed: int, num_workers: int):
        super().__init__(batch_size, seed, num_workers)
        unknown = set(classes) - set(CLASSES)
        if unknown or len(set(classes)) != len(classes) or len(classes) < 2:
            raise ValueError(f"classes must be 2 or more distinct names among {CLASSES}, got {list(classes)}")
        if rotation not in ROTATIONS:
            raise ValueError(f"rotation must be one of {ROTATIONS}, got {rotation!r}")
        if not 0 <= occlusion <= 0.5:
            raise ValueError(f"occlusion must be in [0, 0.5], got {occlusion}")
        if density < 0:
            raise ValueError(f"density must be >= 0, got {density}")

    @property
    def classes(self) -> list[str]:
        return list(self.hparams.classes)

    @property
    def num_classes(self) -> int:
        return len(self.hparams.classes)

    def _generator(self, split: str, i: int) -> torch.Generator:
        return torch.Generator().manual_seed((self.hparams.seed * 3 + SPLITS[split]) * 1_000_003 + i)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        """With ``augment``, every training batch gets a fresh random scale and rotation (label-preserving)."""
        if self.hparams.augment and self.trainer is not None and self.trainer.training:
            batch["points"] = augment(batch["points"], self.hparams.rotation, self.hparams.anisotropy)
        return batch

    what = "clouds"  # the samples' name in the progress lines

    def setup(self, stage: str | None = None) -> None:
        h = self.hparams
        made = self._make_splits({"train": h.train_size, "val": h.val_size, "test": h.test_size}, self.what)
        for split, samples in made.items():
            self.splits[split] = TensorDictDataset({key: torch.stack([s[key] for s in samples]) for key in samples[0]})


class ShapesClassDataModule(_PointModule):
    """Which primitive family is this cloud? Balanced classes (sample i has class i mod C).

    Args:
        train_size, val_size, test_size: clouds per split.
        n_points: points per cloud.
        classes: the families, a subset of ``CLASSES`` (label = position in this list).
        anisotropy: each axis is scaled by a factor in [1 / (1 + a), 1 + a] (log-uniform).
        rotation: "so3" (uniformly random), "z" (about the z axis) or "none".
        jitter: std of Gaussian noise on the normalised points (clipped at 5 std).
        occlusion: up to this fraction of the surface is cut away by a random plane (<= 0.5).
        density: strength of the non-uniform sampling density (0: uniform on the surface).
        augment: give every training batch a fresh random per-axis scale (``anisotropy``) and
            rotation (``rotation``), drawn from torch's global generator (``seed_everything``).
        seed: the clouds are a function of it.
    """

    def __init__(
        self,
        train_size: int = 1800,
        val_size: int = 270,
        test_size: int = 540,
        n_points: int = 512,
        classes: tuple[str, ...] = CLASSES,
        anisotropy: float = 0.25,
        rotation: str = "so3",
        jitter: float = 0.01,
        occlusion: float = 0.0,
        density: float = 0.0,
        augment: bool = True,
        batch_size: int = 32,
        seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__(classes, rotation, occlusion, density, batch_size, seed, num_workers)
        self.save_hyperparameters()

    def _sample(self, split: str, i: int) -> dict[str, torch.Tensor]:
        h = self.hparams
        gen = self._generator(split, i)
        label = i % len(h.classes)
        shape = Primitive(h.classes[label], gen, h.anisotropy, h.rotation)
        candidates = shape.sample(3 * h.n_points, gen)
        points = candidates[_pick(candidates, h.n_points, gen, h.occlusion, h.density)]
        return {"points": _finish(points, gen, h.jitter), "label": torch.tensor(label)}


class ShapesSegDataModule(_PointModule):
    """Which primitive family does each point lie on, in scenes of 2-4 overlapping primitives.

    Args as :class:`ShapesClassDataModule`, plus ``primitives``: (min, max) primitives per scene.
    Each primitive gets a size factor in [0.35, 0.6] and a shift within 0.35 of the origin, so
    they overlap; a point inside another primitive is dropped.
    """

    what = "scenes"

    def __init__(
        self,
        train_size: int = 1200,
        val_size: int = 128,
        test_size: int = 256,
        n_points: int = 1024,
        classes: tuple[str, ...] = CLASSES,
        primitives: tuple[int, int] = (2, 4),
        anisotropy: float = 0.25,
        rotation: str = "so3",
        jitter: float = 0.0,
        occlusion: float = 0.0,
        density: float = 0.0,
        augment: bool = True,
        batch_size: int = 16,
        seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__(classes, rotation, occlusion, density, batch_size, seed, num_workers)
        low, high = primitives
        if not 1 <= low <= high:
            raise ValueError(f"primitives must be (min, max) with 1 <= min <= max, got {tuple(primitives)}")
        self.save_hyperparameters()

    def _sample(self, split: str, i: int) -> dict[str, torch.Tensor]:
        h = self.hparams
        gen = self._generator(split, i)
        low, high = h.primitives
        count = int(torch.randint(low, high + 1, (1,), generator=gen))
        labels = torch.randint(len(h.classes), (count,), generator=gen).tolist()
        shapes = [Primitive(h.classes[c], gen, h.anisotropy, h.rotation, size=(0.35, 0.6), spread=0.35) for c in labels]
        points, point_labels = [], []
        for j, shape in enumerate(shapes):
            p = shape.sample(3 * h.n_points // count + 1, gen)
            for other in shapes[:j] + shapes[j + 1 :]:
                p = p[~other.inside(p)]
            points.append(p)
            point_labels.append(torch.full((p.shape[0],), labels[j]))
        points, point_labels = torch.cat(points), torch.cat(point_labels)
        pick = _pick(points, h.n_points, gen, h.occlusion, h.density)
        return {"points": _finish(points[pick], gen, h.jitter), "labels": point_labels[pick]}
