"""Store.load(into=) against random nested states: into= is matched to the saved tensors by key
path, whatever the order of its keys, with ties kept or broken, keys of different types that read
alike told apart; a state that lacks a saved key path is refused before anything is written."""
import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import ckptfs

# leaves: the id of a tensor in a pool (an id at two places: tied weights); keys of two types
# that read alike ("1" and 1) and list indexes (a list's 0 and a dict's key 0)
_keys = st.one_of(st.sampled_from(["a", "b", "1", "0", "a.b"]), st.integers(0, 2))
_states = st.dictionaries(_keys, st.recursive(
    st.integers(0, 5),
    lambda inner: st.one_of(st.dictionaries(_keys, inner, max_size=3), st.lists(inner, max_size=3)),
    max_leaves=10), min_size=1, max_size=4)
_steps = itertools.count(1)


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    s = ckptfs.Store.create(str(tmp_path_factory.mktemp("into") / "r.region"), size_bytes=64 << 20)
    yield s
    s.close()


def _pool(tensor_id: int) -> torch.Tensor:
    return torch.arange(tensor_id + 1, dtype=torch.float32) + 100 * tensor_id + 1  # no zeros


def _build(shape, make):
    """The object of ``shape`` with each leaf ``make(path, tensor id)``."""
    def walk(node, path):
        if isinstance(node, dict):
            return {k: walk(v, path + ((type(k), k),)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, path + ((list, i),)) for i, v in enumerate(node)]
        return make(path, node)
    return walk(shape, ())


def _leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, path + ((type(k), k),))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, path + ((list, i),))
    else:
        yield path, obj


def _shuffled(obj, rnd):
    """``obj`` with the keys of every dict in another order (the same tensors)."""
    if isinstance(obj, dict):
        items = list(obj.items())
        rnd.shuffle(items)
        return {k: _shuffled(v, rnd) for k, v in items}
    if isinstance(obj, list):
        return [_shuffled(v, rnd) for v in obj]
    return obj


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=_states, untie=st.sets(st.integers(0, 5)), rnd=st.randoms(use_true_random=False), data=st.data())
def test_into_is_matched_by_key_path(shared_store, shape, untie, rnd, data):
    tensors = {i: _pool(i) for i in range(6)}
    saved = _build(shape, lambda path, i: tensors[i])
    step = next(_steps)
    with shared_store.writer("m") as w:
        w.save(saved, step).result()
    # into=: the saved tensors' ids tied as saved, except those in ``untie`` (a tensor per place)
    tied_targets = {}

    def target(path, i):
        if i in untie:
            return torch.zeros_like(tensors[i])
        return tied_targets.setdefault(i, torch.zeros_like(tensors[i]))
    into = _shuffled(_build(shape, target), rnd)
    got = shared_store.load("m", step=step, into=into)
    for path, t in _leaves(into):
        i = dict(_leaves(shape))[path]
        assert torch.equal(t, tensors[i]), path
    assert dict((p, id(t)) for p, t in _leaves(got)) == dict((p, id(t)) for p, t in _leaves(into))
    # a saved key path that into= lacks: refused, nothing written
    places = [p for p, _ in _leaves(shape)]
    if places:
        drop = data.draw(st.sampled_from(places))
        fresh = {}
        lacking = _build(shape, lambda path, i: fresh.setdefault(path, torch.zeros_like(tensors[i])))
        node = lacking
        for _, key in drop[:-1]:
            node = node[key]
        node[drop[-1][1]] = "not a tensor"
        with pytest.raises(ValueError, match="only the checkpoint has"):
            shared_store.load("m", step=step, into=lacking)
        assert not any(t.any() for t in fresh.values() if isinstance(t, torch.Tensor))
