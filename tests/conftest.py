"""Shared fixtures. A thread that raises inside a test fails that test (see pytest.ini options)."""

import pytest
import torch

import ckptfs
from ckptfs.testing.crashcheck import same

try:
    from torch.utils.serialization import config as serialization_config
except ImportError:  # torch < 2.5 has no serialization config
    serialization_config = None


@pytest.fixture
def region_path(tmp_path):
    return str(tmp_path / "test.region")


@pytest.fixture
def store(region_path):
    s = ckptfs.Store.create(region_path, size_bytes=256 << 20)
    yield s
    s.close()


def serialization_settings() -> dict:
    """torch's serialization config, read the way torch reads it (an option deleted from the
    config object reads as missing, not as its default)."""
    if serialization_config is None:
        return {}
    settings = {}
    for key in serialization_config.get_config_copy():
        try:
            settings[key] = getattr(serialization_config, key)
        except AttributeError:
            settings[key] = "<deleted>"
    return settings


@pytest.fixture(scope="session")
def torch_baseline(tmp_path_factory):
    """A plain file saved by torch.save, and torch's serialization config at session start."""
    obj = {"t": torch.arange(4, dtype=torch.int16), "n": 1}
    path = tmp_path_factory.mktemp("torch-baseline") / "plain.pt"
    torch.save(obj, path)
    return path, obj, serialization_settings()


@pytest.fixture(autouse=True)
def torch_load_still_works(torch_baseline):
    """Fails a test (at teardown, after its own fixtures, monkeypatch included, have undone their
    changes) that leaves torch's serialization config changed or torch.load of a plain file
    broken. A test that changes torch's settings does it with torch's scoped patch,
    ``torch.utils.serialization.config.patch(...)``, not with monkeypatch. About 0.2 ms a test."""
    yield
    path, obj, before = torch_baseline
    problems = []
    after = serialization_settings()
    if after != before:
        changed = {k: (before.get(k), after.get(k)) for k in before.keys() | after.keys()
                   if before.get(k) != after.get(k)}
        problems.append(f"torch's serialization config changed (was, is): {changed}")
        for key, value in before.items():  # restored, so that the tests after this one run
            setattr(serialization_config, key, value)
    try:
        loaded = torch.load(path, weights_only=True)
        if not (loaded["n"] == 1 and torch.equal(loaded["t"], obj["t"])):
            problems.append(f"torch.load of a plain file returns {loaded!r}")
    except Exception as e:  # noqa: BLE001 - any failure is the finding
        problems.append(f"torch.load of a plain file raises {type(e).__name__}: {e}")
    if problems:
        pytest.fail("torch is broken after this test (the first test so reported broke it): "
                    + "; ".join(problems), pytrace=False)


def assert_same(a, b, path="obj"):
    """Exact structural equality (ckptfs.testing.crashcheck.same): types, key order, dtypes,
    shapes, bits."""
    differ = same(a, b, path)
    assert differ is None, differ


# Processes for multi-process tests: forked from a clean single-threaded server that has torch
# and ckptfs imported (fast like fork, without forking this threaded test process).
from ckptfs.testing.load import mp_context  # noqa: E402,F401 - re-exported for the tests


def fill_region(store, leave_bytes: int = 0) -> None:
    """Give every free byte of the region but ``leave_bytes`` to a model of its own ("filler"), so
    that no model can take more slots (the tests of a full region)."""
    region = store.region
    block = region.superblock.block_bytes
    free = region.data_area_bytes() - sum(e.nbytes for e in region.entries()) - leave_bytes
    region.create_model("filler", 1, free // block * block)


def staging_buffers_made(monkeypatch) -> list:
    """From now on (undone by ``monkeypatch``), every StagingBuffer made is appended to the
    returned list (whether it is pinned: ``.pinned``)."""
    import ckptfs.writer.staging as staging

    made = []
    real_init = staging.StagingBuffer.__init__

    def spy(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)
    monkeypatch.setattr(staging.StagingBuffer, "__init__", spy)
    return made

