import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to torch here (run `pytest -m cuda` on a GPU machine)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # a marker, not a keyword (a directory may be named cuda)
            item.add_marker(skip)


@pytest.fixture
def gen():
    """A seeded generator: every test draws its own reproducible data."""
    return torch.Generator().manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_kept():
    """Every test starts with the calling thread's kept launches and plans dropped
    (pcops._warp.KEPT): a test's first calls of a shape take the general path whatever ran
    before it in the worker, so no test depends on the order tests run in."""
    from pcops import _warp

    _warp.KEPT.clear()
    yield
