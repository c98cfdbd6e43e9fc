"""PyTorch3D's CPU marching cubes as a benchmark peer, where PyPI has no pytorch3d wheel for this torch.

The peer is PyTorch3D's own C++ (``MarchingCubesCpu``, which ``pytorch3d.ops.marching_cubes``
calls on a CPU volume; its Python wrapper adds only a per-volume loop and an optional change of
coordinates), from one of:

* an installed ``pytorch3d`` (its compiled ``pytorch3d._C.marching_cubes``), or
* a PyTorch3D source tree named by ``PCOPS_PYTORCH3D_SRC`` (a clone or an unpacked archive of
  github.com/facebookresearch/pytorch3d): ``csrc/marching_cubes/marching_cubes_cpu.cpp`` is
  compiled with ``torch.utils.cpp_extension.load`` (g++ -O3, cached in torch's extensions
  folder), with a two-line binding of that one function; nothing else of PyTorch3D is built.

    PCOPS_PYTORCH3D_SRC=~/src/pytorch3d python scripts/benchmark.py --only mesh

:func:`marching_cubes` returns ``f(volume (D, H, W) float32, isolevel) -> (verts, faces, ids)``
in PyTorch3D's grid coordinates, or None (with :data:`REASON`) where neither is found (looked
for once).
"""

from __future__ import annotations

import functools
import os
import pathlib
import tempfile
from typing import Callable, Optional

REASON = ["not looked for yet"]

_BINDING = """
#include <torch/extension.h>
#include "marching_cubes/marching_cubes.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("marching_cubes", &MarchingCubesCpu); }
"""


@functools.cache
def marching_cubes() -> Optional[Callable]:
    try:
        from pytorch3d import _C  # type: ignore[import-not-found]

        REASON[0] = "pytorch3d installed"
        return _C.marching_cubes
    except ImportError:
        pass
    src = os.environ.get("PCOPS_PYTORCH3D_SRC")
    if not src:
        REASON[0] = "PyPI has no pytorch3d wheel for this torch and PCOPS_PYTORCH3D_SRC (a PyTorch3D source tree) is unset"
        return None
    csrc = pathlib.Path(src).expanduser() / "pytorch3d" / "csrc"
    cpu = csrc / "marching_cubes" / "marching_cubes_cpu.cpp"
    if not cpu.is_file():
        REASON[0] = f"PCOPS_PYTORCH3D_SRC has no {cpu.relative_to(pathlib.Path(src).expanduser())}"
        return None
    from torch.utils import cpp_extension

    binding = pathlib.Path(tempfile.gettempdir()) / "pcops_bench_pytorch3d_binding.cpp"
    binding.write_text(_BINDING)
    try:
        module = cpp_extension.load(name="pcops_bench_pytorch3d_marching_cubes", sources=[str(binding), str(cpu)],
                                    extra_include_paths=[str(csrc)], extra_cflags=["-O3"], verbose=False)
    except Exception as err:  # noqa: BLE001 (no compiler, no ninja: the row is left out, saying why)
        REASON[0] = f"building PyTorch3D's marching_cubes_cpu.cpp failed: {type(err).__name__}: {str(err)[:200]}"
        return None
    REASON[0] = f"built from {cpu}"
    return module.marching_cubes
