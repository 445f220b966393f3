"""Shared fixtures. A thread that raises inside a test fails that test (see pytest.ini options)."""

import pytest
import torch

import ckptfs


@pytest.fixture
def region_path(tmp_path):
    return str(tmp_path / "test.region")


@pytest.fixture
def store(region_path):
    s = ckptfs.Store.create(region_path, size_bytes=256 << 20)
    yield s
    s.close()


def assert_same(a, b, path="obj"):
    """Exact structural equality: types, key order, dtypes, shapes, bits."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        if a.numel():
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"{path}: bytes differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, f"{path}: nan != {b}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


# Processes for multi-process tests: forked from a clean single-threaded server that has torch
# and ckptfs imported (fast like fork, without forking this threaded test process).
from ckptfs.testing.load import mp_context  # noqa: E402,F401 - re-exported for the tests
