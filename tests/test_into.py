"""Store.load(into=) against random nested states: into= is matched to the saved tensors by key
path, whatever the order of its keys, with ties kept or broken, keys of different types that read
alike told apart; a state that lacks a saved key path is refused before anything is written.
Store.load(keys=): a part of a checkpoint (its weights, without the optimizer), read alone."""
import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import ckptfs
from conftest import assert_same
from test_cli import flip_a_tensor_byte

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


def test_a_tied_alias_only_into_has_is_filled_with_the_name_it_shares(tmp_path):
    """save_pretrained stores a tied lm_head.weight once (as transformer.wte.weight): loading
    such a checkpoint into the model's state dict, which names the tensor twice, fills both
    names; a name only into= has that is a tensor of its own stays refused, nothing written."""
    wte = torch.arange(12.0).reshape(4, 3)
    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as store:
        with store.writer("hf") as w:
            w.save({"transformer.wte.weight": wte, "ln.bias": torch.ones(3)}, 1).result()
        model = {"transformer.wte.weight": torch.zeros(4, 3), "ln.bias": torch.zeros(3)}
        model["lm_head.weight"] = model["transformer.wte.weight"]  # tied, as the model holds it
        store.load("hf", into=model)
        assert torch.equal(model["lm_head.weight"], wte) and model["lm_head.weight"] is model["transformer.wte.weight"]
        untied = {"transformer.wte.weight": torch.zeros(4, 3), "ln.bias": torch.zeros(3),
                  "lm_head.weight": torch.zeros(4, 3)}
        with pytest.raises(ValueError, match="only into= has 'lm_head.weight'"):
            store.load("hf", into=untied)
        assert not any(t.any() for t in untied.values())


def _training_checkpoint():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    return model, {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 7}


def test_keys_loads_the_weights_alone_and_reads_nothing_else(tmp_path):
    """keys=["model"]: the weights of a training checkpoint, for evaluation or fine-tuning with a
    fresh optimizer. Only their bytes are read and checked: a damaged optimizer tensor does not
    stop it (the whole load says it is damaged); it used to take loading all of it, twice the
    memory of the weights for AdamW's moments."""
    region = str(tmp_path / "r.region")
    model, state = _training_checkpoint()
    with ckptfs.Store.create(region, size_bytes=64 << 20) as store:
        with store.writer("m") as w:
            w.save(state, 1).result()
    flip_a_tensor_byte(region, "m", 1, "optim.state.0.exp_avg_sq")
    with ckptfs.Store(region) as store:
        with pytest.raises(ckptfs.errors.CorruptionError, match="optim.state.0.exp_avg_sq"):
            store.load("m", step=1)
        got = store.load("m", keys=["model"])
        assert list(got) == ["model"]
        assert_same(got["model"], state["model"])
        assert_same(store.load("m", keys="model"), got)  # a str for one key
        # in place, into a fresh model's state dict of that part alone, in any key order
        fresh = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 2))
        into = {"model": dict(reversed(list(fresh.state_dict().items())))}
        assert store.load("m", keys=["model"], into=into)["model"]["0.weight"] is into["model"]["0.weight"]
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())
        # plain values come along, in the saved order
        assert list(store.load("m", keys=["epoch", "model"])) == ["model", "epoch"]
        assert store.load("m", keys=["epoch"]) == {"epoch": 7}
        # a key it lacks, or a saved object that is not a dict: one line, in the argument's words
        with pytest.raises(ValueError, match=r"keys=: m step 1 has no top-level key 'weights'; it has 'model', "
                                             r"'optim', 'epoch'"):
            store.load("m", keys=["weights"])
        with pytest.raises(ValueError, match="pass top-level keys of the saved dict"):
            store.load("m", keys=3)
        for nothing in ([], ()):  # an empty selection is a mistake, even with into= of no tensors
            with pytest.raises(ValueError, match=r"selects nothing: .* or keys=None for the whole object"):
                store.load("m", keys=nothing, into={"ema": {}})
        # into= of another part than keys= names: refused before anything is written
        zeros = {"optim": {"w": torch.zeros(2)}}
        with pytest.raises(ValueError, match=r"only into= has 'optim.w'"):
            store.load("m", keys=["model"], into=zeros)
        with store.writer("list") as w:
            w.save([torch.ones(2)], 1).result()
        with pytest.raises(ValueError, match=r"list step 1 is not a dict \(its saved object is a list\)"):
            store.load("list", keys=["model"])


def test_keys_are_compared_as_stored_and_a_damaged_latest_falls_back_only_to_a_version_that_fits(tmp_path):
    """keys= tells apart keys that Python finds equal (0 and False); two NaN keys are two
    tensors of into=. With the latest damaged, a load of step None goes back to an older version
    only where that one has the keys (an older one without them was a ValueError that hid the
    damage), and says that into= holds some of the damaged bytes where none fits."""
    region = str(tmp_path / "r.region")
    nan1, nan2 = float("nan"), float("nan")
    with ckptfs.Store.create(region, size_bytes=64 << 20) as store:
        with store.writer("k") as w:
            w.save({0: torch.ones(2), nan1: torch.full((2,), 2.0), nan2: torch.full((2,), 3.0)}, 1).result()
        assert list(store.load("k", keys=[0])) == [0]
        with pytest.raises(ValueError, match="has no top-level key False; it has 0, nan, nan"):
            store.load("k", keys=[False])
        into = {0: torch.zeros(2), nan1: torch.zeros(2), nan2: torch.zeros(2)}
        store.load("k", into=into)
        assert [t[0].item() for t in into.values()] == [1.0, 2.0, 3.0]
        with store.writer("m") as w:
            w.save({"model": {"w": torch.ones(1000)}}, 1).result()
            w.save({"model": {"w": torch.full((1000,), 2.0)}, "ema": {"w": torch.full((1000,), 3.0)}}, 2).result()
    flip_a_tensor_byte(region, "m", 2, "ema.w")
    with ckptfs.Store(region) as store:
        target = {"ema": {"w": torch.zeros(1000)}}
        with pytest.raises(ckptfs.errors.CorruptionError, match=r"'ema.w' of m step 2 fails its checksum.*; into= holds "
                                                                 r"some of its bytes now: load an intact version"):
            store.load("m", keys="ema", into=target)
        # a step asked for by number does not fall back, and says the same
        target = {"ema": {"w": torch.zeros(1000)}}
        with pytest.raises(ckptfs.errors.CorruptionError, match=r"fails its checksum.*; into= holds some of its bytes "
                                                                 r"now: load an intact version"):
            store.load("m", step=2, keys="ema", into=target)
        with pytest.raises(ckptfs.errors.CorruptionError) as no_into:
            store.load("m", step=2, keys="ema")
        assert "into=" not in str(no_into.value)
        # the weights alone are intact in step 2: no fall back
        assert store.load("m", keys="model")["model"]["w"].eq(2.0).all()
    flip_a_tensor_byte(region, "m", 2, "model.w")
    with ckptfs.Store(region) as store:  # now they are not: step 1's, which has them
        assert store.load("m", keys="model")["model"]["w"].eq(1.0).all()


def test_keys_of_a_version_saved_through_dcp(store):
    """keys= of a multi-rank version (here DCP's save in one process): its whole tensors of those
    keys alone; with into=, DCP loads the keys into= holds, which must be those."""
    import torch.distributed.checkpoint as dcp

    _, state = _training_checkpoint()
    state = {"model": state["model"], "ema": {k: v + 1 for k, v in state["model"].items()}, "step": 3}
    dcp.save(state, storage_writer=ckptfs.dcp.StorageWriter(store, "d", step=1))
    got = store.load("d", keys=["ema"])
    assert list(got) == ["ema"]
    assert_same(dict(sorted(got["ema"].items())), dict(sorted(state["ema"].items())))  # DCP's order of keys
    into = {"ema": {k: torch.zeros_like(v) for k, v in state["ema"].items()}}
    store.load("d", keys=["ema"], into=into)
    assert_same(into["ema"], state["ema"])
    with pytest.raises(ValueError, match=r"keys=\['model'\] with into= of a multi-rank version: DCP loads the keys "
                                         r"into= holds, and into= holds \['ema'\]"):
        store.load("d", keys=["model"], into=into)
