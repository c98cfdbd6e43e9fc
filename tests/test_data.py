"""The data modules of models/: exact shapes, determinism, and every file format."""

import warnings

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


def _one_mesh_sample(path, **kwargs):
    """The one sample of a one-mesh FileSDFDataModule as the module makes it (float64, before the
    splits store it in float32), and the mesh scaled as the module scales it."""
    import trimesh

    from models.files import _normalise

    data = FileSDFDataModule([str(path)], **kwargs)
    sample, _ = data._sample(*data.items[0], 0)
    mesh = trimesh.load(path, force="mesh")
    centre, scale = _normalise(np.asarray(mesh.vertices))
    mesh.apply_translation(-centre)
    mesh.apply_scale(1.0 / scale)
    return sample, mesh


def _winding_number(queries: np.ndarray, vertices: np.ndarray, faces: np.ndarray) -> np.ndarray:
    """The exact generalised winding number (float64, every face's solid angle)."""
    d = vertices[faces][None] - queries[:, None, None]  # (Q, F, 3, 3)
    a, b, c = d[..., 0, :], d[..., 1, :], d[..., 2, :]
    la, lb, lc = (np.linalg.norm(x, axis=-1) for x in (a, b, c))
    det = (a * np.cross(b, c)).sum(-1)
    den = la * lb * lc + (a * b).sum(-1) * lc + (b * c).sum(-1) * la + (c * a).sum(-1) * lb
    return np.arctan2(det, den).sum(-1) / (2 * np.pi)


def test_mesh_targets_are_the_exact_signed_distance_on_a_closed_mesh(tmp_path):
    import trimesh

    trimesh.creation.icosphere(2).export(tmp_path / "ball.ply")
    sample, mesh = _one_mesh_sample(tmp_path / "ball.ply", n_points=256, n_queries=1024)
    queries, target = sample["queries"].double().numpy(), sample["target"].double().numpy()
    assert sample["target"].dtype == torch.float64
    _, distance, _ = trimesh.proximity.closest_point(mesh, queries)  # float64 brute force
    np.testing.assert_allclose(np.abs(target), distance, rtol=0, atol=1e-12)
    # inside a convex mesh: behind every face's plane
    inside = (np.einsum("qfi,fi->qf", queries[:, None] - mesh.triangles[None, :, 0], mesh.face_normals) < 0).all(1)
    assert 100 < inside.sum() < len(queries) - 100
    clear = distance > 1e-9
    assert ((target < 0) == inside)[clear].all()


def test_mesh_targets_on_an_open_mesh_take_the_sign_of_the_winding_number(tmp_path):
    import trimesh

    ball = trimesh.creation.icosphere(2)
    keep = ball.triangles_center[:, 2] < 0.6  # a hole: the cap above z = 0.6 cut away
    open_ball = trimesh.Trimesh(ball.vertices, ball.faces[keep])
    assert not open_ball.is_watertight
    open_ball.export(tmp_path / "bowl.ply")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(sign|orient|watertight)")  # no warning about the sign
        sample, mesh = _one_mesh_sample(tmp_path / "bowl.ply", n_points=256, n_queries=1024)
    queries, target = sample["queries"].double().numpy(), sample["target"].double().numpy()
    _, distance, _ = trimesh.proximity.closest_point(mesh, queries)
    np.testing.assert_allclose(np.abs(target), distance, rtol=0, atol=1e-12)
    w = _winding_number(queries, np.asarray(mesh.vertices), np.asarray(mesh.faces))
    clear = np.abs(w - 0.5) >= 0.1  # the sign's promise (a fast winding number within that)
    assert ((target < 0) == (w >= 0.5))[clear].all()
    assert 100 < (w >= 0.6).sum() and 100 < (w <= 0.4).sum()
    assert ((w > 0.1) & (w < 0.9)).sum() > 10  # queries near the hole, neither clearly in nor out


def test_an_inside_out_mesh_is_flipped_and_an_inconsistent_one_warned_about(tmp_path):
    import trimesh

    ball = trimesh.creation.icosphere(2)
    ball.export(tmp_path / "ball.ply")
    inverted = ball.copy()
    inverted.invert()
    inverted.export(tmp_path / "inverted.ply")
    sample, _ = _one_mesh_sample(tmp_path / "ball.ply", n_points=64, n_queries=256)
    flipped, _ = _one_mesh_sample(tmp_path / "inverted.ply", n_points=64, n_queries=256)
    torch.testing.assert_close(flipped["target"], sample["target"], rtol=0, atol=1e-12)
    assert (sample["target"] < 0).any()
    mixed = ball.faces.copy()
    mixed[::3] = mixed[::3, ::-1]
    trimesh.Trimesh(ball.vertices, mixed, process=False).export(tmp_path / "mixed.ply")
    with pytest.warns(UserWarning, match="not consistently oriented"):
        FileSDFDataModule([str(tmp_path / "mixed.ply")])


def test_draws_give_each_item_several_samples_in_its_own_split(tmp_path):
    import trimesh

    for i in range(4):
        trimesh.creation.box(extents=(1, 1 + 0.2 * i, 1)).export(tmp_path / f"box{i}.stl")
    one = FileSDFDataModule([str(tmp_path / "*.stl")], n_points=32, n_queries=32, val_fraction=0.25, test_fraction=0.25)
    three = FileSDFDataModule([str(tmp_path / "*.stl")], n_points=32, n_queries=32, val_fraction=0.25, test_fraction=0.25,
                              draws=3)
    one.setup()
    three.setup()
    assert [len(three.splits[s]) for s in ("train", "val", "test")] == [6, 3, 3]
    for split in ("train", "val", "test"):  # draw 0 is the sample of one draw; the others are new
        for j in range(len(one.splits[split])):
            torch.testing.assert_close(three.splits[split][3 * j], one.splits[split][j], rtol=0, atol=0)
            assert not torch.equal(three.splits[split][3 * j + 1]["points"], three.splits[split][3 * j]["points"])
    # an item's draws share its split: the same box (extents) in every draw of a test item
    extents = [three.splits["test"][k]["points"].abs().amax(0) for k in range(3)]
    torch.testing.assert_close(extents[1], extents[0], rtol=0, atol=0.05)
    with pytest.raises(ValueError, match="draws must be a positive integer"):
        FileSDFDataModule([str(tmp_path / "*.stl")], draws=0)


def test_rotated_draws_have_the_rotated_meshes_signed_distance(tmp_path):
    import trimesh

    trimesh.creation.box(extents=(1.0, 1.6, 0.6)).export(tmp_path / "box.stl")
    data = FileSDFDataModule([str(tmp_path / "box.stl")], n_points=512, n_queries=512, draws=2, rotate=True)
    for k in range(2):
        sample, _ = data._sample(*data.items[0], 0, k)
        # the box's axes are its face normals (up to sign): a random rotation, not the file's axes
        axes = torch.unique(torch.round(sample["normals"].abs(), decimals=6), dim=0)
        axes = torch.stack([sample["normals"][(sample["normals"].abs() - a).abs().sum(-1) < 1e-5][0] for a in axes])
        assert axes.shape == (3, 3) and (axes.abs().amax(-1) < 0.999).any()
        torch.testing.assert_close(axes @ axes.T, torch.eye(3, dtype=torch.float64), rtol=0, atol=1e-9)
        local = sample["points"] @ axes.T  # the box's frame (centred by the scaling)
        half = local.abs().amax(0)
        q = (sample["queries"] @ axes.T).abs() - half
        box_sdf = q.clamp_min(0).norm(dim=-1) + q.amax(-1).clamp_max(0)
        torch.testing.assert_close(sample["target"], box_sdf, rtol=0, atol=1e-12)


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
