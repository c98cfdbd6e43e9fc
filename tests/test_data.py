"""The data modules of models/: exact shapes, determinism, and every file format."""

import numpy as np
import pytest
import torch

from models import FileSDFDataModule, ShapesSDFDataModule, TutorialCloudDataModule
from models.shapes import PRIMITIVES, Shape, primitive_sdf


@pytest.mark.parametrize("kind", PRIMITIVES)
def test_primitive_sdf_is_a_distance(kind):
    """Surface samples have sdf 0, unit normals, and the distance grows by t along the normal."""
    gen = torch.Generator().manual_seed(1)
    shape = Shape.random(gen, (kind,))
    points, normals = shape.sample_surface(500, gen)
    assert shape.sdf(points).abs().max() < 1e-9
    torch.testing.assert_close(normals.norm(dim=-1), torch.ones(500, dtype=torch.float64))
    t = 0.01
    torch.testing.assert_close(shape.sdf(points + t * normals), torch.full((500,), t, dtype=torch.float64))
    inside = shape.sdf(points - t * normals)
    assert (inside >= -t - 1e-9).all()  # never deeper than t (another face can be nearer)
    assert ((inside + t).abs() < 1e-9).float().mean() > 0.8  # mostly exactly -t: samples lie on faces, not edges


def test_sphere_sdf_against_the_formula():
    p = torch.tensor([[0.0, 0, 0], [1, 0, 0], [0, 0.2, 0]], dtype=torch.float64)
    torch.testing.assert_close(primitive_sdf("sphere", p, torch.tensor([0.5, 0.5, 0.5])), torch.tensor([-0.5, 0.5, -0.3], dtype=torch.float64))


def test_shapes_are_deterministic_from_the_seed_and_splits_differ():
    kwargs = dict(train_size=3, val_size=2, test_size=2, n_points=64, n_queries=64)
    a, b, c = ShapesSDFDataModule(**kwargs), ShapesSDFDataModule(**kwargs), ShapesSDFDataModule(seed=1, **kwargs)
    for m in (a, b, c):
        m.setup()
    for key in ("points", "normals", "queries", "target"):
        assert torch.equal(a.splits["train"].tensors[key], b.splits["train"].tensors[key])
    assert not torch.equal(a.splits["train"].tensors["points"], c.splits["train"].tensors["points"])
    assert not torch.equal(a.splits["train"].tensors["points"][:2], a.splits["val"].tensors["points"])


def test_targets_are_the_shapes_signed_distance():
    data = ShapesSDFDataModule(train_size=2, val_size=1, test_size=1, n_points=64, n_queries=64)
    data.setup()
    shape, _ = data.make_shape("train", 1)
    sample = data.splits["train"][1]
    torch.testing.assert_close(sample["target"].double(), shape.sdf(sample["queries"].double()), atol=1e-6, rtol=1e-5)
    assert (sample["target"] < 0).any() and (sample["target"] > 0).any()


def test_tutorial_cloud_is_the_tutorial_setup():
    data = TutorialCloudDataModule(n_points=1000, grid_resolution=30, samples=2)
    data.setup()
    batch = next(iter(data.train_dataloader()))
    assert batch["points"].shape == (1, 1000, 3) and batch["queries"].shape == (1, 27000, 3)


def _write_files(tmp_path):
    import h5py
    import trimesh

    sphere = trimesh.creation.icosphere(3, radius=1.0)
    paths = {}
    for suffix in (".off", ".ply", ".obj", ".stl"):
        paths[suffix] = tmp_path / f"sphere{suffix}"
        sphere.export(paths[suffix])
    gen = np.random.default_rng(0)
    direction = gen.normal(size=(2000, 3))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    np.save(tmp_path / "sphere.npy", np.hstack([direction, direction]))  # points + normals
    np.savez(tmp_path / "sphere.npz", points=2 * direction)
    np.savetxt(tmp_path / "sphere.xyz", direction)
    with h5py.File(tmp_path / "spheres.h5", "w") as f:
        f["data"] = np.stack([direction, 3 * direction]).astype(np.float32)
        f["label"] = np.array([0, 1])
    paths.update({s: tmp_path / f"sphere{s}" for s in (".npy", ".npz", ".xyz")})
    paths[".h5"] = tmp_path / "spheres.h5"
    return paths


@pytest.mark.parametrize("suffix", [".off", ".ply", ".obj", ".stl", ".npy", ".npz", ".xyz", ".h5"])
def test_every_file_format_gives_a_sphere_sdf(tmp_path, suffix):
    path = _write_files(tmp_path)[suffix]
    data = FileSDFDataModule([str(path)], n_points=256, n_queries=256)
    with pytest.warns(UserWarning, match="item"):
        data.setup()
    sample = data.splits["train"][0]
    radius = 0.9  # everything is scaled into [-0.9, 0.9]^3
    assert sample["points"].norm(dim=-1).sub(radius).abs().max() < 0.02
    expected = sample["queries"].norm(dim=-1) - radius  # the sphere's exact SDF
    near = expected.abs() < 0.3
    # meshes: exact distance to a fine icosphere; clouds: nearest of 2,000 points (spacing ~0.07)
    tolerance = 0.06 if suffix in (".off", ".ply", ".obj", ".stl") else 0.1
    assert (sample["target"][near] - expected[near]).abs().max() < tolerance
    assert (sample["normals"] * sample["points"]).sum(-1).min() > 0.9 * radius  # outward unit normals


def test_file_paths_are_checked_up_front(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file matches"):
        FileSDFDataModule([str(tmp_path / "*.off")])
    (tmp_path / "cloud.txt").write_text("1 2 3\n")
    with pytest.raises(ValueError, match="unsupported suffix"):
        FileSDFDataModule([str(tmp_path / "cloud.txt")])
    np.save(tmp_path / "bad.npy", np.zeros((5, 4)))
    with pytest.raises(ValueError, match="3 \\(xyz\\) or 6"):
        FileSDFDataModule([str(tmp_path / "bad.npy")])


def test_files_split_into_train_val_test(tmp_path):
    import trimesh

    for i in range(6):
        trimesh.creation.box(extents=(1, 1 + 0.1 * i, 1)).export(tmp_path / f"box{i}.stl")
    data = FileSDFDataModule([str(tmp_path / "*.stl")], n_points=64, n_queries=64, val_fraction=0.2, test_fraction=0.2)
    data.setup()
    assert [len(data.splits[s]) for s in ("train", "val", "test")] == [4, 1, 1]


def _malformed(tmp_path, kind):
    """Write one malformed data file; returns (path, the problem its error must state)."""
    import h5py
    import trimesh

    gen = np.random.default_rng(0)
    cloud = gen.normal(size=(200, 3))
    path = tmp_path / {"garbage_off": "a.off", "empty_off": "a.off", "garbage_stl": "a.stl", "no_faces_obj": "a.obj",
                       "flat_mesh": "a.ply", "nan_npy": "a.npy", "inf_npy": "a.npy", "one_point": "a.npy",
                       "few_points": "a.npy", "same_point": "a.npy", "text_npy": "a.npy", "zero_normals": "a.npy",
                       "words_xyz": "a.xyz", "no_points_npz": "a.npz", "nan_normals_npz": "a.npz",
                       "garbage_h5": "a.h5", "nan_second_h5": "a.h5", "empty_h5": "a.h5"}[kind]
    if kind == "garbage_off":
        path.write_text("OFF\nfile is not a mesh\n")
        return path, "cannot be read"
    if kind == "empty_off":
        path.write_text("")
        return path, "cannot be read|no faces"
    if kind == "garbage_stl":
        path.write_bytes(b"\x00\x01garbage" * 10)
        return path, "cannot be read|no faces"
    if kind == "no_faces_obj":
        path.write_text("v 0 0 0\nv 1 0 0\nv 0 1 0\n")
        return path, "no faces"
    if kind == "flat_mesh":
        trimesh.Trimesh(vertices=[[0, 0, 0], [1, 0, 0], [2, 0, 0]], faces=[[0, 1, 2]], process=False).export(path)
        return path, "zero surface area"
    if kind in ("nan_npy", "inf_npy"):
        cloud[7, 2] = np.nan if kind == "nan_npy" else np.inf
        np.save(path, cloud)
        return path, "NaN or inf"
    if kind in ("one_point", "few_points", "same_point"):
        np.save(path, {"one_point": cloud[:1], "few_points": cloud[:5], "same_point": np.ones((300, 3))}[kind])
        return path, "distinct point"
    if kind == "text_npy":
        path.write_text("1 2 3\n")
        return path, "cannot be read"
    if kind == "zero_normals":
        np.save(path, np.hstack([cloud, np.zeros_like(cloud)]))
        return path, "normals contain NaN, inf or zero"
    if kind == "words_xyz":
        path.write_text("x y z\nfile 1 2\n")
        return path, "cannot be read"
    if kind == "no_points_npz":
        np.savez(path, xyz=cloud)
        return path, "needs a 'points' array"
    if kind == "nan_normals_npz":
        normals = cloud.copy()
        normals[3, 0] = np.nan
        np.savez(path, points=cloud, normals=normals)
        return path, "normals contain NaN"
    if kind == "garbage_h5":
        path.write_bytes(b"not hdf5" * 20)
        return path, "cannot be read"
    with h5py.File(path, "w") as f:
        f["data"] = np.zeros((0, 200, 3)) if kind == "empty_h5" else np.stack([cloud, np.full((200, 3), np.nan)])
    return path, "no clouds" if kind == "empty_h5" else "cloud 1: points contain NaN"


MALFORMED = ["garbage_off", "empty_off", "garbage_stl", "no_faces_obj", "flat_mesh", "nan_npy", "inf_npy", "one_point",
             "few_points", "same_point", "text_npy", "zero_normals", "words_xyz", "no_points_npz", "nan_normals_npz",
             "garbage_h5", "nan_second_h5", "empty_h5"]


@pytest.mark.parametrize("kind", MALFORMED)
def test_malformed_files_fail_up_front_naming_the_file_and_problem(tmp_path, kind):
    import re

    path, problem = _malformed(tmp_path, kind)
    good = tmp_path / "good.npy"
    np.save(good, np.random.default_rng(1).normal(size=(300, 3)))
    with pytest.raises(ValueError, match=f"data.paths: {re.escape(str(path))}: .*({problem})"):
        FileSDFDataModule([str(good), str(path)])  # checked when made: before setup, before any trainer


def test_min_points_is_the_fewest_distinct_points_of_a_cloud(tmp_path):
    np.save(tmp_path / "c.npy", np.random.default_rng(0).normal(size=(40, 3)))
    FileSDFDataModule([str(tmp_path / "c.npy")], min_points=40)
    with pytest.raises(ValueError, match="40 distinct point\\(s\\); at least min_points=41"):
        FileSDFDataModule([str(tmp_path / "c.npy")], min_points=41)


def _lines(text):
    return [line for line in text.splitlines() if line.strip()]


def test_making_the_shapes_tells_its_progress_on_stderr(monkeypatch, capsys):
    import models.data

    monkeypatch.setattr(models.data, "PROGRESS_EVERY", 0.0)  # a line after every sample
    data = ShapesSDFDataModule(train_size=3, val_size=1, test_size=1, n_points=32, n_queries=32)
    data.setup()
    lines = _lines(capsys.readouterr().err)
    assert lines[0] == "making 5 shapes (train 3, val 1, test 1) ..."
    assert [line.split(" (")[0] for line in lines[1:-1]] == [f"making shapes: {i}/5" for i in range(1, 5)]
    assert "left)" in lines[1]
    assert lines[-1].startswith("made 5 shapes in ") and lines[-1].endswith(" s")
    data.setup("test")  # made already: nothing to say
    assert capsys.readouterr().err == ""


def test_progress_is_two_lines_when_quick(capsys):
    from models import ShapesSegDataModule

    ShapesSegDataModule(train_size=2, val_size=1, test_size=1, n_points=64).setup()
    lines = _lines(capsys.readouterr().err)
    assert len(lines) == 2 and lines[0].startswith("making 4 scenes") and lines[1].startswith("made 4 scenes")


def test_file_data_tells_its_progress(tmp_path, capsys):
    np.save(tmp_path / "c.npy", np.random.default_rng(0).normal(size=(100, 3)))
    data = FileSDFDataModule([str(tmp_path / "c.npy")], n_points=32, n_queries=32)
    with pytest.warns(UserWarning, match="item"):
        data.setup()
    lines = _lines(capsys.readouterr().err)
    assert lines[0] == "making 1 samples (from 1 file(s)) ..." and lines[-1].startswith("made 1 samples in ")


def test_modelnet_caches_are_announced_with_their_paths(tmp_path, capsys):
    import trimesh

    from models import ModelNetDataModule

    for name in ("box", "ball"):
        for split in ("train", "test"):
            (tmp_path / name / split).mkdir(parents=True)
            mesh = trimesh.creation.box() if name == "box" else trimesh.creation.icosphere(1)
            mesh.export(tmp_path / name / split / f"{name}_0001.off")
    data = ModelNetDataModule(root=str(tmp_path), n_points=32)
    data.prepare_data()
    lines = _lines(capsys.readouterr().err)
    assert lines[0].startswith(f"making 4 point caches (32 points per mesh, beside the meshes under {tmp_path})")
    assert lines[-1].startswith(f"wrote 4 point caches: {tmp_path}/<class>/<split>/<mesh>.32.npz")
    assert len(list(tmp_path.rglob("*.32.npz"))) == 4
    data.prepare_data()  # cached: nothing to make, nothing to say
    assert capsys.readouterr().err == ""
