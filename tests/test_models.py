"""Point networks (PointNet, PointNet++, DGCNN), their data (procedural shapes, ModelNet files) and configs."""

import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

import pcops

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import train  # noqa: E402

from models import ModelNetDataModule, ShapesClassDataModule, ShapesSegDataModule  # noqa: E402
from models.scenes import CLASSES, Primitive  # noqa: E402
from models.shapes import primitive_sdf  # noqa: E402

POINT_CONFIGS = ["pointnet_cls", "pointnet2_cls", "dgcnn_cls", "pointnet_seg", "pointnet2_seg", "modelnet40"]
HAS_GROUPING = all(hasattr(pcops, name) for name in ("farthest_point_sample", "ball_query", "knn_interpolate"))
needs_grouping = pytest.mark.skipif(not HAS_GROUPING, reason="needs pcops.farthest_point_sample, ball_query and knn_interpolate")
TINY = ["--data.init_args.train_size", "18", "--data.init_args.val_size", "9", "--data.init_args.test_size", "9",
        "--data.init_args.n_points", "128", "--data.init_args.batch_size", "9"]
CPU = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.precision", "32-true"]


# ---------------------------------------------------------------- primitives and procedural data


@pytest.mark.parametrize("kind", ["cone", "prism"])
def test_new_primitives_have_exact_signed_distances(gen, kind):
    import trimesh

    a = torch.tensor([0.5, 0.6, 0.4], dtype=torch.float64)
    if kind == "cone":  # a fine polygonal cone: base radius 0.5 at z = -0.6, apex at z = 0.6
        t = np.linspace(0, 2 * np.pi, 4000, endpoint=False)
        vertices = np.vstack([np.stack([0.5 * np.cos(t), 0.5 * np.sin(t), -0.6 * np.ones_like(t)], 1), [[0, 0, 0.6]]])
        tolerance = 1e-6
    else:  # the triangle (+-0.5, -0.3), (0, 0.3) extruded over z in [-0.4, 0.4]
        vertices = np.array([[x, y, z] for z in (-0.4, 0.4) for x, y in ((-0.5, -0.3), (0.5, -0.3), (0.0, 0.3))])
        tolerance = 1e-12
    mesh = trimesh.convex.convex_hull(vertices)
    x = torch.rand(1500, 3, generator=gen, dtype=torch.float64) * 2 - 1
    expected = -trimesh.proximity.signed_distance(mesh, x.numpy())  # trimesh: positive inside
    np.testing.assert_allclose(primitive_sdf(kind, x, a).numpy(), expected, atol=tolerance)


@pytest.mark.parametrize("name", CLASSES)
def test_primitive_samples_lie_on_the_surface(gen, name):
    shape = Primitive(name, gen, anisotropy=0.25, rotation="so3", spread=0.3)
    points = shape.sample(400, gen)
    assert torch.isfinite(points).all()
    local = ((points - shape.shift) @ shape.rotation) / shape.axes
    from models.shapes import Shape

    sdf = Shape(shape.kind, shape.params, torch.eye(3, dtype=torch.float64), 1.0, torch.zeros(3, dtype=torch.float64)).sdf(local)
    assert sdf.abs().max() < 1e-6


def tiny_class_data(**kwargs):
    args = dict(train_size=18, val_size=9, test_size=9, n_points=128, batch_size=9) | kwargs
    data = ShapesClassDataModule(**args)
    data.setup()
    return data


def test_classification_data_is_balanced_normalised_and_deterministic():
    data = tiny_class_data(occlusion=0.3, density=2.0, jitter=0.01)
    train = data.splits["train"].tensors
    assert train["points"].shape == (18, 128, 3) and train["points"].dtype == torch.float32
    assert train["label"].dtype == torch.int64
    assert torch.bincount(train["label"], minlength=9).tolist() == [2] * 9
    radius = train["points"].norm(dim=-1).amax(1)
    assert torch.all(radius < 1.06) and torch.all(radius > 0.94)  # the unit ball, up to the jitter
    again = tiny_class_data(occlusion=0.3, density=2.0, jitter=0.01).splits["train"].tensors
    assert torch.equal(again["points"], train["points"])
    other = tiny_class_data(occlusion=0.3, density=2.0, jitter=0.01, seed=1).splits["train"].tensors
    assert not torch.equal(other["points"], train["points"])
    assert not torch.equal(data.splits["test"].tensors["points"], train["points"][:9])  # splits differ


def _sphere_coverage_bias(points: torch.Tensor) -> torch.Tensor:
    """|mean unit direction| from the least-squares sphere centre: ~0 for an evenly covered sphere."""
    p = points.double()
    a = torch.cat([2 * p, torch.ones(p.shape[0], 1, dtype=p.dtype)], 1)  # |p|^2 = 2 c.p + (r^2 - |c|^2)
    centre = torch.linalg.lstsq(a, p.square().sum(1, keepdim=True)).solution[:3, 0]
    return torch.nn.functional.normalize(p - centre, dim=1).mean(0).norm()


def test_occlusion_removes_a_side_and_density_skews_the_sampling():
    options = dict(classes=("sphere", "box"), anisotropy=0.0, rotation="none", jitter=0.0)
    spheres = slice(0, None, 2)  # class 0: round spheres
    bias = {}
    for name, extra in (("full", {}), ("cut", dict(occlusion=0.5)), ("skew", dict(density=6.0))):
        clouds = tiny_class_data(**options, **extra).splits["train"].tensors["points"][spheres]
        bias[name] = torch.stack([_sphere_coverage_bias(c) for c in clouds])
    assert bias["full"].max() < 0.16  # 128 random points on the whole sphere: about 1 / sqrt(128)
    assert (bias["cut"] > 0.16).sum() >= 5  # a cap of a random size up to half the sphere is gone
    assert (bias["skew"] > 0.35).all()  # denser towards one side


def test_training_augmentation_rotates_and_rescales_each_cloud(gen):
    from models.scenes import augment

    points = tiny_class_data(jitter=0.0).splits["train"].tensors["points"][:4]
    torch.manual_seed(0)
    same = augment(points, "none", 0.0)  # already centred-by-mean and unit: unchanged
    torch.testing.assert_close(same, (points - points.mean(1, keepdim=True)) / (points - points.mean(1, keepdim=True)).norm(dim=-1).amax(1)[:, None, None])
    def pairwise(p):  # direct differences (cdist's matmul form is off by ~1e-4 near 0)
        return (p[:, :, None] - p[:, None]).norm(dim=-1)

    rotated = augment(points, "so3", 0.0)
    torch.testing.assert_close(pairwise(rotated), pairwise(same), rtol=1e-4, atol=1e-5)  # rigid
    assert not torch.allclose(rotated, same, atol=1e-2)
    stretched = augment(points, "none", 0.5)
    assert not torch.allclose(pairwise(stretched), pairwise(same), atol=1e-2)
    torch.testing.assert_close(stretched.norm(dim=-1).amax(1), torch.ones(4))


def test_segmentation_labels_name_the_primitive_each_point_lies_on():
    data = ShapesSegDataModule(train_size=6, val_size=2, test_size=2, n_points=256, batch_size=2, jitter=0.0)
    data.setup()
    train = data.splits["train"].tensors
    assert train["points"].shape == (6, 256, 3) and train["labels"].shape == (6, 256)
    assert train["labels"].dtype == torch.int64 and 0 <= int(train["labels"].min()) and int(train["labels"].max()) < 9
    assert sum(len(torch.unique(labels)) > 1 for labels in train["labels"]) >= 3  # most scenes mix families


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(classes=("sphere", "blob")), "classes must be"),
        (dict(classes=("sphere",)), "classes must be"),
        (dict(rotation="random"), "rotation must be"),
        (dict(occlusion=0.9), "occlusion must be"),
        (dict(density=-1.0), "density must be"),
    ],
)
def test_bad_data_options_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShapesClassDataModule(**kwargs)


# ---------------------------------------------------------------- ModelNet from files


@pytest.fixture
def modelnet(tmp_path):
    """A tiny ModelNet-style tree: <root>/<class>/{train,test}/*.off, one file with the merged header."""
    import trimesh

    makers = {"bowl": lambda i: trimesh.creation.icosphere(1, radius=1 + i), "box": lambda i: trimesh.creation.box((1, 2 + i, 3))}
    for name, make in makers.items():
        for split, count in (("train", 5), ("test", 2)):
            folder = tmp_path / "ModelNet2" / name / split
            folder.mkdir(parents=True)
            for i in range(count):
                make(i).export(folder / f"{name}_{i:04d}.off")
    broken = tmp_path / "ModelNet2/box/train/box_0000.off"
    text = broken.read_text()
    broken.write_text("OFF" + text[4:] if text.startswith("OFF\n") else text)  # "OFF8 12 0" as in ModelNet
    return tmp_path / "ModelNet2"


def test_modelnet_loader_reads_samples_and_caches_the_tree(modelnet):
    data = ModelNetDataModule(root=str(modelnet), n_points=64, val_fraction=0.2, batch_size=4)
    assert data.classes == ["bowl", "box"] and data.num_classes == 2
    assert (modelnet / "box/train/box_0000.off").read_text().startswith("OFF8 ")
    data.prepare_data()
    data.setup()
    assert sorted(p.name for p in (modelnet / "box/train").glob("*.npz"))[0] == "box_0000.64.npz"
    sizes = {split: len(data.splits[split]) for split in ("train", "val", "test")}
    assert sizes == {"train": 8, "val": 2, "test": 4}
    assert torch.bincount(data.splits["val"].tensors["label"]).tolist() == [1, 1]  # held out per class
    test = data.splits["test"].tensors
    assert test["points"].shape == (4, 64, 3) and test["label"].tolist() == [0, 0, 1, 1]
    radius = test["points"].norm(dim=-1).amax(1)
    torch.testing.assert_close(radius, torch.ones(4), rtol=0, atol=1e-5)
    # the points lie on the meshes: a box of size (1, 2, 3), centred and scaled into the unit ball
    import trimesh

    box = trimesh.creation.box((1, 2, 3))
    cached = np.load(modelnet / "box/test/box_0000.64.npz")["points"].astype(np.float64)
    surface = box.sample(20000, seed=0)
    centred = surface - surface.mean(0)
    scale = np.linalg.norm(box.vertices - centred.mean(0), axis=1).max()
    distance = np.abs(trimesh.proximity.signed_distance(box, cached * scale))
    assert distance.max() < 0.05 * scale
    again = ModelNetDataModule(root=str(modelnet), n_points=64, val_fraction=0.2)
    again.setup()  # from the caches
    assert torch.equal(again.splits["test"].tensors["points"], test["points"])


def test_modelnet_bad_paths_fail_before_any_work(tmp_path, modelnet):
    with pytest.raises(FileNotFoundError, match="no directory .*modelnet.cs.princeton.edu"):
        ModelNetDataModule(root=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="has no <class>/train/\\*.off"):
        ModelNetDataModule(root=str(tmp_path / "ModelNet2" / "box"))
    with pytest.raises(ValueError, match="not found under"):
        ModelNetDataModule(root=str(modelnet), classes=["bowl", "chair"])
    assert not list(modelnet.rglob("*.npz"))


def test_modelnet_config_with_a_missing_root_fails_before_any_work(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts/train.py"), "--config", str(ROOT / "configs/modelnet40.yaml"),
           "--data.init_args.root", str(tmp_path / "nowhere")]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "no directory" in result.stderr
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- configs


def config_args(name: str, modelnet_root: pathlib.Path) -> list[str]:
    args = ["--config", str(ROOT / f"configs/{name}.yaml"), *CPU, "--rmm_pool", "false"]
    if name == "modelnet40":
        return args + ["--data.init_args.root", str(modelnet_root), "--data.init_args.n_points", "128",
                       "--data.init_args.batch_size", "4", "--model.init_args.num_classes", "2", "--model.init_args.compile", "false"]
    return args + TINY


@pytest.mark.parametrize("name", POINT_CONFIGS)
def test_every_point_config_runs_with_fast_dev_run(name, modelnet, tmp_path, monkeypatch):
    config = yaml.safe_load((ROOT / f"configs/{name}.yaml").read_text())
    if config["model"]["class_path"] not in ("models.PointNetClassifier", "models.PointNetSegmenter", "models.DGCNNClassifier") and not HAS_GROUPING:
        pytest.skip("needs pcops.farthest_point_sample, ball_query and knn_interpolate")
    monkeypatch.chdir(tmp_path)
    train.main([*config_args(name, modelnet), "--trainer.fast_dev_run", "true"])


# pointnet2_seg (30 s) is pointnet2_cls's encoder plus feature propagation, whose ops compile
# whole in their own tests, and dgcnn_cls (40 s) compiles whole in test_compiled_network_matches_eager
# below (the config's compile flag is pointnet_seg's and pointnet2_cls's here): they run with `pytest -m slow`
@pytest.mark.parametrize("name", [pytest.param("dgcnn_cls", marks=pytest.mark.slow), "pointnet_seg",
                                  pytest.param("pointnet2_cls", marks=needs_grouping),
                                  pytest.param("pointnet2_seg", marks=[needs_grouping, pytest.mark.slow])])
def test_whole_networks_compile_with_fullgraph(name, tmp_path, monkeypatch):
    """compile: true compiles the network with fullgraph=True: a graph break would be an error here."""
    monkeypatch.chdir(tmp_path)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # (the counters are the process's: other tests' expected breaks stay out)
    train.main([*config_args(name, tmp_path), "--trainer.fast_dev_run", "true", "--model.init_args.compile", "true"])
    assert not torch._dynamo.utils.counters["graph_break"]


def test_compiled_network_matches_eager(gen):
    from models.dgcnn import DGCNN

    net = DGCNN(4, k=8, widths=[16, 16], embed=32, hidden=16).eval()
    points = torch.rand(3, 64, 3, generator=gen)
    compiled = torch.compile(net, fullgraph=True)
    torch.testing.assert_close(compiled(points), net(points), rtol=1e-4, atol=1e-5)


def test_pointnet_segmentation_baseline_labels_every_point_from_its_own_and_the_global_feature(gen):
    from models.pointnet2 import PointNetSeg

    net = PointNetSeg(5, widths=[16, 32], head_widths=[16]).eval()
    points = torch.rand(3, 50, 3, generator=gen)
    logits = net(points)
    assert logits.shape == (3, 50, 5)
    perm = torch.randperm(50, generator=gen)
    torch.testing.assert_close(net(points[:, perm]), logits[:, perm])  # no neighbourhoods: equivariant
    with torch.no_grad():  # the reference: the same layers applied by hand
        f = net.mlp(points)
        expected = net.classify(net.head(torch.cat([f, f.amax(1, keepdim=True).expand(-1, 50, -1)], -1)))
        alone = net.classify(net.head(torch.cat([f, f.amax(1, keepdim=True).expand(-1, 50, -1) * 0], -1)))
    torch.testing.assert_close(logits, expected)
    assert not torch.allclose(logits, alone)  # the global feature matters
    compiled = torch.compile(net, fullgraph=True)
    torch.testing.assert_close(compiled(points), logits, rtol=1e-4, atol=1e-5)


def test_a_full_classification_run_writes_the_confusion_matrix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = train.main([*config_args("pointnet_cls", tmp_path), "--trainer.max_epochs", "1"])
    run = tmp_path / "runs/pointnet_cls/version_0"
    assert (run / "confusion_matrix.png").stat().st_size > 1000
    per_class = [results[f"test/acc_{name}"] for name in CLASSES]
    assert all(value in (0.0, 1.0) for value in per_class)  # one test cloud per class
    assert results["test/mean_class_acc"] == pytest.approx(sum(per_class) / len(CLASSES))
    assert results["test/acc"] == pytest.approx(results["test/mean_class_acc"])  # balanced classes


@needs_grouping
def test_a_full_segmentation_run_writes_its_figures(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = train.main([*config_args("pointnet2_seg", tmp_path), "--trainer.max_epochs", "1"])
    run = tmp_path / "runs/pointnet2_seg/version_0"
    assert (run / "confusion_matrix.png").stat().st_size > 1000 and (run / "segmentation.png").stat().st_size > 1000
    assert 0 <= results["test/miou"] <= results["test/mean_class_acc"] <= 1  # IoU <= recall per class


def test_num_classes_must_match_the_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="model.num_classes is 5 but the data has 9 classes"):
        train.main([*config_args("pointnet_cls", tmp_path), "--model.init_args.num_classes", "5", "--trainer.fast_dev_run", "true"])
