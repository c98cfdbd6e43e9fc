"""Training throughput of the point networks, eager vs compiled, and the share of pcops ops.

    python scripts/profile_models.py                      # every point config, markdown table
    python scripts/profile_models.py --configs dgcnn_cls --steps 5

For each config the network and the batch size come from configs/<name>.yaml and the batch
from its data module (a small split). A step is forward, cross-entropy, backward and an Adam
step. Eager and compiled (``nn.Module.compile(fullgraph=True)``, as ``compile: true`` does)
are timed on the same batch, interleaved step by step after warm-up (compiling included in
the warm-up), and report the median step; samples/s = batch / median step. One more eager step
runs under ``torch.profiler``: "pcops share" is the CPU time inside ``pcops::`` custom ops
(the searches: FPS, ball query, kNN) over the step's wall time, and the op taking most of it
is named. On a shared machine compare the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

CONFIGS = ["pointnet_cls", "pointnet2_cls", "dgcnn_cls", "pointnet_seg", "pointnet2_seg"]


def _class(path: str):
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def load(name: str):
    """(LightningModule, one training batch) of a config."""
    config = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    model_args = {k: v for k, v in config["model"]["init_args"].items() if k not in ("optimizer", "scheduler", "compile")}
    model = _class(config["model"]["class_path"])(**model_args)
    data_args = dict(config["data"]["init_args"])
    batch = data_args["batch_size"]
    data_args.update(train_size=batch, val_size=1, test_size=1)
    data = _class(config["data"]["class_path"])(**data_args)
    data.setup()
    return model, next(iter(data.train_dataloader()))


def step(model, optimizer, batch) -> None:
    logits = model(batch)
    target = batch[model.target_key]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, model.num_classes), target.reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def pcops_share(model, optimizer, batch) -> tuple[float, str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step(model, optimizer, batch)
        wall = time.perf_counter() - start
    ops = {e.key: e.cpu_time_total / 1e6 for e in prof.key_averages() if e.key.startswith("pcops::")}
    top = max(ops, key=ops.get) if ops else "-"
    return sum(ops.values()) / wall, top


def measure(name: str, steps: int) -> dict:
    torch.manual_seed(0)
    model, batch = load(name)
    model.train()
    eager_opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    compiled, _ = load(name)
    compiled.load_state_dict(model.state_dict())
    compiled.train()
    compiled.net.compile(fullgraph=True)
    compiled_opt = torch.optim.Adam(compiled.parameters(), lr=1e-4)
    start = time.perf_counter()
    for _ in range(2):  # warm-up; the first compiled steps compile
        step(compiled, compiled_opt, batch)
    compile_s = time.perf_counter() - start
    step(model, eager_opt, batch)
    times = {"eager": [], "compiled": []}
    for _ in range(steps):  # interleaved, so that both see the same load
        for key, (m, opt) in (("eager", (model, eager_opt)), ("compiled", (compiled, compiled_opt))):
            start = time.perf_counter()
            step(m, opt, batch)
            times[key].append(time.perf_counter() - start)
    share, top = pcops_share(model, eager_opt, batch)
    size = batch["points"].shape[0]
    eager, comp = (statistics.median(times[k]) for k in ("eager", "compiled"))
    return {
        "config": name, "points": batch["points"].shape[1], "batch": size, "eager": size / eager, "compiled": size / comp,
        "compile_s": compile_s, "share": share, "top": top,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=CONFIGS)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| config | points | batch | eager samples/s | compiled samples/s | compiled / eager | warm-up incl. compile (s) | pcops share of an eager step | largest pcops op |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.configs:
        r = measure(name, args.steps)
        print(f"| {r['config']} | {r['points']} | {r['batch']} | {r['eager']:.1f} | {r['compiled']:.1f} | {r['compiled'] / r['eager']:.2f} | "
              f"{r['compile_s']:.0f} | {100 * r['share']:.0f}% | {r['top']} |", flush=True)


if __name__ == "__main__":
    main()
