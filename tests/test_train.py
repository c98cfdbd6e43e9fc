"""scripts/train.py with every config, checkpoints, resume, DDP on CPU, and bad configs."""

import json
import math
import pathlib
import subprocess
import sys
import traceback
import types

import pytest
import torch
import trimesh
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import train  # noqa: E402

from models import SDFModel  # noqa: E402

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
TINY_SHAPES = ["--data.init_args.train_size", "8", "--data.init_args.val_size", "4", "--data.init_args.test_size", "4",
               "--data.init_args.n_points", "128", "--data.init_args.n_queries", "128", "--data.init_args.batch_size", "4"]


def overrides(config: pathlib.Path, files: list[str]) -> list[str]:
    """Small data and CPU-only settings for a config, keeping what it tests (model, compile, ...)."""
    data = yaml.safe_load(config.read_text())["data"]["class_path"]
    args = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.precision", "32-true", "--rmm_pool", "false"]
    if data.endswith("ShapesSDFDataModule"):
        args += TINY_SHAPES
    elif data.endswith("TutorialCloudDataModule"):
        args += ["--data.init_args.n_points", "2000", "--data.init_args.grid_resolution", "8", "--data.init_args.samples", "2"]
    elif data.endswith(("ShapesClassDataModule", "ShapesSegDataModule", "ModelNetDataModule")):
        pytest.skip("the point-network configs run in tests/test_models.py (tiny data, a synthetic ModelNet tree)")
    elif data.endswith("FileSDFDataModule"):
        args += ["--data.init_args.paths", str(files), "--data.init_args.n_points", "128", "--data.init_args.n_queries", "128",
                 "--data.init_args.draws", "2"]
    if "backend: cuml" in config.read_text():
        args += ["--model.init_args.backend", "auto"]  # cuML needs a GPU; the rest of the config is tested as is
    return args


@pytest.fixture
def meshes(tmp_path):
    import trimesh

    paths = []
    for i, mesh in enumerate([trimesh.creation.icosphere(2), trimesh.creation.box(), trimesh.creation.capsule()]):
        path = tmp_path / f"mesh{i}.off"
        mesh.export(path)
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_config_runs_with_fast_dev_run(config, meshes, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = train.main(["--config", str(config), "--trainer.fast_dev_run", "true", *overrides(config, meshes)])
    assert results and all(k.startswith("test/") for k in results), results  # one test batch ran and logged
    assert all(math.isfinite(v) for v in results.values()), results
    assert not (tmp_path / "runs").exists()  # fast_dev_run writes no run directory


def _fit(tmp_path, name, *extra):
    args = ["--config", str(ROOT / "configs/sdf.yaml"), *TINY_SHAPES, "--trainer.logger.init_args.name", name,
            "--figure", "false", *extra]
    train.main(args)
    runs = sorted((tmp_path / "runs" / name).glob("version_*"))
    return runs[-1]


def test_a_full_run_writes_config_logs_checkpoints_and_figure(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    results = train.main(["--config", str(ROOT / "configs/sdf.yaml"), *TINY_SHAPES, "--trainer.max_epochs", "1"])
    run = tmp_path / "runs/sdf/version_0"
    assert {"config.yaml", "metrics.csv", "field_slice.png"} <= {p.name for p in run.iterdir()}
    assert (run / "checkpoints/last.ckpt").exists() and list((run / "checkpoints").glob("best-*.ckpt"))
    assert results["test/mae"] > 0 and results["test/mean_baseline_mae"] > 0
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["data"]["init_args"]["train_size"] == 8  # the resolved config, overrides included
    out, err = capsys.readouterr()
    assert "writing to runs/sdf/version_0 " in out  # where to look, when training starts
    written = sorted(str(p.relative_to(tmp_path)) for p in run.rglob("*") if p.is_file())
    listed = out[out.index("run directory: runs/sdf/version_0"):].splitlines()[1:]
    assert [line.strip() for line in listed] == written  # every file the run wrote, by its path
    assert "making 16 shapes (train 8, val 4, test 4) ..." in err and "made 16 shapes in " in err
    # the learnt surfaces of three test shapes (pcops.marching_cubes), and the true field's on the same grid
    assert {"surface_0.ply", "surface_1.ply", "surface_2.ply", "surfaces.png", "surfaces.json"} <= {p.name for p in run.iterdir()}
    metrics = json.loads((run / "surfaces.json").read_text())
    assert len(metrics) == 3 and all(f"test shape {i}: learnt surface (" in out for i in range(3))
    for m in metrics:  # the true field's mesh lies on the true surface: what the pipeline measures is right
        assert m["floor_chamfer_l1"] < 0.02 and m["floor_normal_consistency"] > 0.98, m
    mesh = trimesh.load(run / "surface_0.ply", force="mesh")  # after one epoch: closed, or cut by the grid's box
    assert len(mesh.faces) == 0 or mesh.is_watertight or abs(mesh.bounds).max() > 0.99


def test_the_baseline_ratio_reads_right():
    assert train.baseline_words(3.21) == "3.2x higher"
    assert train.baseline_words(1 / 1.5) == "1.5x lower: the model does worse than the mean"  # never "0.8x higher"


def test_fast_dev_run_writes_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train.main(["--config", str(ROOT / "configs/sdf.yaml"), *TINY_SHAPES, "--trainer.fast_dev_run", "true"])
    assert not list(tmp_path.iterdir())  # no run directory, and no figure in the working directory


def test_resuming_from_a_checkpoint_continues_identically(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    straight = _fit(tmp_path, "straight", "--trainer.max_epochs", "2")
    first = _fit(tmp_path, "resumed", "--trainer.max_epochs", "1")
    resumed = _fit(tmp_path, "resumed", "--trainer.max_epochs", "2", "--ckpt_path", str(first / "checkpoints/last.ckpt"))
    a = torch.load(straight / "checkpoints/last.ckpt", weights_only=False)["state_dict"]
    b = torch.load(resumed / "checkpoints/last.ckpt", weights_only=False)["state_dict"]
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_compiled_model_checkpoints_load_into_an_uncompiled_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = _fit(tmp_path, "compiled", "--trainer.max_epochs", "1", "--model.init_args.compile", "true")
    state = torch.load(run / "checkpoints/last.ckpt", weights_only=False)["state_dict"]
    assert not any("_orig_mod" in key for key in state)
    model = SDFModel(hidden=32, scales=[(8, 0.02), (24, 0.1)])
    model.load_state_dict(state, strict=True)


def test_ddp_on_two_cpu_processes(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts/train.py"), "--config", str(ROOT / "configs/sdf.yaml"), *TINY_SHAPES,
           "--trainer.max_epochs", "1", "--trainer.devices", "2", "--trainer.strategy", "ddp", "--figure", "false"]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test/mae" in result.stdout
    assert (tmp_path / "runs/sdf/version_0/checkpoints/last.ckpt").exists()


def _run_script(tmp_path, *args):
    """``python scripts/train.py ARGS`` in ``tmp_path``: a process of its own (the entry point itself)."""
    return subprocess.run([sys.executable, str(ROOT / "scripts/train.py"), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)


@pytest.fixture
def run_cli(tmp_path, monkeypatch, capsys):
    """The command line of scripts/train.py with ARGS in ``tmp_path``, run in this process
    (``train.run``, as its ``__main__`` runs it, without a new interpreter's start): its exit
    status, stdout and stderr, as ``subprocess.run`` gives them (an uncaught exception: its
    traceback and status 1, as the interpreter ends)."""

    def call(*args):
        monkeypatch.chdir(tmp_path)
        capsys.readouterr()
        try:
            code = train.run(list(args))
        except SystemExit as exit:  # (the parser's errors, --print_config)
            code = exit.code or 0
        except Exception:  # noqa: BLE001 (uncaught: the interpreter prints the traceback, status 1)
            traceback.print_exc()
            code = 1
        out = capsys.readouterr()
        return types.SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return call


@pytest.mark.parametrize(
    "args,message",
    [
        (["--config", "configs/sdf.yaml", "--model.init_args.not_a_key", "1"], "not_a_key"),
        (["--config", "configs/sdf.yaml", "--trainer.max_epochs", "many"], "max_epochs"),
        (["--config", "configs/no_such_file.yaml"], "no_such_file.yaml"),
        (["--config", "configs/sdf_files.yaml", "--data.init_args.paths", "[missing/*.off]"], "no file matches"),
        (["--config", "configs/sdf.yaml", "--ckpt_path", "missing.ckpt"], "no checkpoint at missing.ckpt"),
    ],
)
def test_bad_config_fails_before_any_work(tmp_path, run_cli, args, message):
    args = [str(ROOT / a) if a.startswith("configs/") else a for a in args]
    result = run_cli(*args)
    assert result.returncode != 0
    assert message in result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_config_typo_is_one_error_line_and_a_hint_not_the_usage(tmp_path):
    result = _run_script(tmp_path, "--config", str(ROOT / "configs/sdf.yaml"), "--trainer.max_epohs", "3")
    lines = result.stderr.splitlines()
    assert result.returncode == 2
    assert lines[0] == "error: unknown option --trainer.max_epohs; did you mean --trainer.max_epochs?", result.stderr
    assert "--help" in lines[1] and len(lines) == 2, result.stderr  # no usage summary
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "args,first",
    [
        (["--trainer.acelerator", "cpu"], "error: unknown option --trainer.acelerator; did you mean --trainer.accelerator?"),
        (["--data.init_args.batch_sise", "3"], "error: unknown key 'data.init_args.batch_sise' (models.ShapesSDFDataModule has no "
                                                "argument 'batch_sise'); did you mean 'data.init_args.batch_size'?"),
        (["--model.init_args.optimizer.init_args.lrr", "1"], "error: unknown key 'model.init_args.optimizer.init_args.lrr' "
                                                            "(torch.optim.AdamW has no argument 'lrr'); did you mean "
                                                            "'model.init_args.optimizer.init_args.lr'?"),
        (["--trainer.max_epochs", "many"], "error: trainer.max_epochs: expected int, got many"),
        (["--data.init_args.batch_size", "many"], "error: data.init_args.batch_size: expected int, got many"),
        (["--seed_everything", "x"], "error: seed_everything: expected bool or int, got x"),
        (["--model.class_path", "models.NoSuch"], "error: model: class_path 'models.NoSuch': module 'models' has no attribute 'NoSuch'"),
        (["--config", "trainer: {max_epoch: 3}"], "error: unknown key 'trainer.max_epoch'; did you mean 'trainer.max_epochs'?"),
        (["--config", "model: {init_args: {hiden: 32}}"], "error: unknown key 'model.init_args.hiden' (models.SDFModel has no "
                                                          "argument 'hiden'); did you mean 'model.init_args.hidden'?"),
    ],
    ids=["option", "data-key", "nested-key", "type", "data-type", "union-type", "class-path", "yaml-trainer-key", "yaml-model-key"],
)
def test_config_errors_lead_with_the_useful_line(tmp_path, monkeypatch, capsys, args, first):
    if args[0] == "--config":  # a second config file (YAML text here) over configs/sdf.yaml
        (tmp_path / "typo.yaml").write_text(args[1] + "\n")
        args = ["--config", str(tmp_path / "typo.yaml")]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit:
        train.main(["--config", str(ROOT / "configs/sdf.yaml"), *args])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err[err.index("error: "):].splitlines() == [first, train.HINT]  # (before it, at most a warning of pytest's argv)
    assert not (tmp_path / "runs").exists()


def test_a_gpu_config_without_a_gpu_says_how_to_run_it_on_the_cpu(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    result = _run_script(tmp_path, "--config", str(ROOT / "configs/sdf_gpu.yaml"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    error = result.stderr[result.stderr.index("error: "):]
    assert len(error.splitlines()) <= 3, error
    assert error.startswith("error: this config needs a CUDA GPU (trainer.accelerator: gpu, rmm_pool: true, "
                            "model.init_args.backend: cuml), but torch sees none")
    command = error.splitlines()[1].split()
    assert command[:4] == ["python", str(ROOT / "scripts/train.py"), "--config", str(ROOT / "configs/sdf_gpu.yaml")]
    assert command[4:] == ["--trainer.accelerator", "cpu", "--rmm_pool", "false", "--model.init_args.backend", "auto",
                           "--trainer.precision", "32"]
    assert not (tmp_path / "runs").exists()
    # the command runs (tiny data, one batch; uncompiled, which the fast_dev_run of every config tests compiled)
    monkeypatch.chdir(tmp_path)
    results = train.main([*command[2:], *TINY_SHAPES, "--trainer.fast_dev_run", "true", "--model.init_args.compile", "false"])
    assert math.isfinite(results["test/mae"])


@pytest.mark.parametrize("corrupt", ["empty", "truncated", "text"])
def test_a_corrupt_checkpoint_fails_before_any_work_naming_the_file(tmp_path, run_cli, corrupt):
    path = tmp_path / f"{corrupt}.ckpt"
    if corrupt == "truncated":
        torch.save({"state_dict": {"w": torch.zeros(1000)}, "epoch": 1}, path)
        path.write_bytes(path.read_bytes()[:700])
    else:
        path.write_text("" if corrupt == "empty" else "not a checkpoint\n")
    result = run_cli("--config", str(ROOT / "configs/sdf.yaml"), "--ckpt_path", str(path), "--figure", "false")
    assert result.returncode != 0
    assert f"ckpt_path: {path} is not a readable checkpoint" in result.stderr
    assert not (tmp_path / "runs").exists()
    assert "Epoch" not in result.stdout + result.stderr  # no data generated, no training started


def test_another_models_checkpoint_fails_before_any_work_naming_the_file(tmp_path, run_cli):
    path = tmp_path / "other.ckpt"
    torch.save({"state_dict": {"net.other.weight": torch.zeros(4, 3)}, "epoch": 1}, path)  # loads, but is not SDFModel's
    result = run_cli("--config", str(ROOT / "configs/sdf.yaml"), "--ckpt_path", str(path), "--figure", "false",
                      *TINY_SHAPES)
    assert result.returncode != 0
    assert f"ckpt_path: {path} holds another model's weights" in result.stderr
    assert "unexpected: net.other.weight" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_malformed_data_file_fails_before_any_work_naming_it(tmp_path, run_cli):
    import numpy as np

    bad = tmp_path / "one_point.npy"
    np.save(bad, np.zeros((1, 3)))  # one point: must not train "successfully"
    result = run_cli("--config", str(ROOT / "configs/sdf_files.yaml"), "--data.init_args.paths", f"[{bad}]")
    assert result.returncode != 0
    assert f"data.paths: {bad}: 1 distinct point(s)" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_an_existing_run_directory_is_not_overwritten(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pinned = ["--trainer.logger.init_args.version", "0", "--trainer.max_epochs", "1"]
    run = _fit(tmp_path, "pinned", *pinned)
    before = (run / "config.yaml").read_text()
    with pytest.raises(RuntimeError, match="to NOT exist. Aborting to avoid overwriting"):
        _fit(tmp_path, "pinned", *pinned, "--data.init_args.seed", "5")
    assert (run / "config.yaml").read_text() == before


def test_print_config_prints_the_resolved_config(tmp_path, run_cli):
    result = run_cli("--config", str(ROOT / "configs/sdf.yaml"), "--print_config")
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["model"]["class_path"] == "models.SDFModel" and printed["trainer"]["max_epochs"] == 12


def test_rmm_pool_flag_sets_up_the_pool_before_the_model(tmp_path, monkeypatch):
    import pcops.memory

    from models import nets

    order = []
    monkeypatch.setattr(pcops.memory, "use_rmm_pool", lambda: order.append("pool"))
    monkeypatch.setattr(train, "check_cuda", lambda config, args: None)  # no GPU needed: the order is what is tested
    original = nets.SDFNet.__init__

    def init(self, *args, **kwargs):
        order.append("model")
        original(self, *args, **kwargs)

    monkeypatch.setattr(nets.SDFNet, "__init__", init)
    monkeypatch.chdir(tmp_path)
    train.main(["--config", str(ROOT / "configs/sdf.yaml"), *TINY_SHAPES, "--rmm_pool", "true", "--trainer.fast_dev_run", "true"])
    assert order[:2] == ["pool", "model"]


def test_rmm_pool_flag_without_cuda_fails_before_any_work(tmp_path, run_cli):
    result = run_cli("--config", str(ROOT / "configs/sdf.yaml"), "--rmm_pool", "true")
    assert result.returncode != 0 and "needs a CUDA GPU" in result.stderr
    assert not (tmp_path / "runs").exists()
