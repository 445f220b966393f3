"""ckptfs's own writer on every rank (issue 14): ``store.writer(model, group=...)`` and
``store.load(model, group=..., into=...)``, on real gloo process groups (one process per rank),
with FSDP2 (``fully_shard``) of a small transformer (GPT-2 from a config) + AdamW: saves every
step with N in flight while training goes on, loads at other world sizes bit-exact against the
unsharded state, the mount's whole files; a rank that never comes to a save is named, and ranks
saving different keys commit nothing."""
import io
import json
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

import ckptfs
from ckptfs.errors import CkptfsError
from ckptfs.testing.ranks import run_ranks, sharded_gpt2, tiny_gpt2, train_gpt2
from conftest_mount import mounted, requires_fuse

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def test_a_job_of_one_rank_saves_and_loads_at_other_sizes(tmp_path):
    """A group of one rank (no exchange, no marks in the store: nothing to agree with) saves
    every step as a multi-rank job does; its checkpoint loads at 1 and 2 ranks."""
    _saved_every_step_then_loaded_at_1_and_2(tmp_path, 1)


def test_a_plan_matches_only_a_state_of_exactly_its_structure():
    """ckptfs.dist.structure: the check that lets a save reuse a DCP plan. Every change a plan
    depends on is a mismatch; the same structure with new values (a training step's) matches."""
    from ckptfs.dist.structure import describe, matches

    def state(**change):
        s = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)},
             "optim": {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4, 3)}},
                       "param_groups": [{"lr": 0.1, "params": [0]}]}, "epoch": 3}
        for path, value in change.items():
            *outer, last = path.split("__")
            d = s
            for k in outer:
                d = d[int(k)] if isinstance(d, list) else d[int(k) if k.isdigit() else k]
            if value is KeyError:
                del d[last]
            else:
                d[int(last) if last.isdigit() else last] = value
        return s

    described = describe(state())
    assert matches(state(), described)
    assert matches(state(model__w=torch.ones(4, 3), epoch=4), described)  # new values, same structure
    changes = {
        "a new shape": dict(model__w=torch.zeros(3, 4)),
        "a new dtype": dict(model__b=torch.zeros(3, dtype=torch.float16)),
        "a parameter for a tensor": dict(model__b=torch.nn.Parameter(torch.zeros(3))),
        "a key more": dict(model__extra=torch.zeros(1)),
        "a key less": dict(model__b=KeyError),
        "an int key for a str key": dict(optim__state={"0": {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4, 3)}}),
        "a plain value's type": dict(epoch=3.0),
        "a tensor for a plain value": dict(epoch=torch.tensor(3)),
        "a tuple for a list": dict(optim__param_groups=({"lr": 0.1, "params": [0]},)),
        "a list longer": dict(optim__param_groups=[{"lr": 0.1, "params": [0]}, {"lr": 0.1, "params": [1]}]),
        "keys in another order": dict(model={"b": torch.zeros(3), "w": torch.zeros(4, 3)}),
    }
    for what, change in changes.items():
        assert not matches(state(**change), described), what
    assert not matches({"model": {}}, described) and not matches([], described)


def _new_region(tmp_path, size_bytes: int = 64 << 20) -> str:
    """The path of a new region in ``tmp_path`` (closed: the ranks open it)."""
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=size_bytes).close()
    return region


def _train_and_save(rank, world, region, out, device="cpu"):
    """Train 4 steps on ``device``, saving every step with async_snapshot (2 in flight); rank 0
    writes the unsharded model and optimizer state of the last step to ``out``."""
    from torch.distributed.checkpoint import utils as dcp_utils

    model = sharded_gpt2(world, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    store = ckptfs.Store(region)
    futures = []
    wrappers, real_init = [], dcp_utils._DistWrapper.__init__

    def recorded(self, group, use_dist, coordinator_rank):  # DCP's collectives, on or off
        wrappers.append(use_dist)
        real_init(self, group, use_dist, coordinator_rank)
    dcp_utils._DistWrapper.__init__ = recorded
    with store.writer("gpt2", group=dist.group.WORLD, max_inflight=2, keep_every=2) as w:
        for step in range(1, 5):
            train_gpt2(model, opt, 1, seed=step, device=device)
            msd, osd = get_state_dict(model, opt)
            futures.append(w.save({"model": msd, "optim": osd, "step": step}, step=step, async_snapshot=True))
            if step % 2:  # before the next optimizer step changes the state: either way, as with Writer
                futures[-1].snapshotted.result()
            else:
                w.wait_snapshot()
                assert futures[-1].snapshotted.done()
        results = [f.result() for f in futures]
    assert [r.step for r in results] == [1, 2, 3, 4] and all(r.durable_s > 0 for r in results)
    # closed, the writer leaves no writer of its parts open in this process (they held the rank's
    # last saved tensors, their threads and the model, which `ckptfs rm --all` refused, until
    # the store closed)
    from ckptfs.dist import storage
    assert not [key for key, kept in storage._writers.items() if key[0] == store.path and not kept._closed]
    dcp_utils._DistWrapper.__init__ = real_init
    # one dcp.save planned (the later saves reuse its plan); a group of one rank plans without
    # collectives: DCP pickling its plans to gather them from itself was half of a first save
    # at 40,000 tensors
    assert wrappers == [world > 1], wrappers
    full = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, out)
    store.close()


def _saved_every_step_then_loaded_at_1_and_2(tmp_path, world: int) -> tuple[str, str]:
    """``_train_and_save`` at ``world`` ranks, its versions checked, then ``_load_and_compare``
    at 1 and 2 ranks; returns the region and the reference state's path."""
    region = _new_region(tmp_path, 256 << 20)
    out = str(tmp_path / "full.pt")
    run_ranks(_train_and_save, world, region, out)
    with ckptfs.Store(region) as store:
        versions = store.versions("gpt2")
        assert versions[-1].step == 4 and versions[-1].latest
        assert {v.step for v in versions if v.kept} == {2, 4}  # keep_every=2: the global versions kept
    run_ranks(_load_and_compare, 1, region, out)
    run_ranks(_load_and_compare, 2, region, out)
    return region, out


def _load_and_compare(rank, world, region, out, device="cpu"):
    model = sharded_gpt2(world, seed=1, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_gpt2(model, opt, 1, seed=99, device=device)  # other values and optimizer state, to be overwritten
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 0}
    with ckptfs.Store(region) as store:
        assert store.load("gpt2", group=dist.group.WORLD, into=state) is state
    assert state["step"] == 4
    compare_full(rank, model, opt, state, out)


def compare_full(rank, model, opt, state, out) -> None:
    """Set the loaded ``state`` into ``model`` / ``opt`` and compare their unsharded state (on
    rank 0, where it is gathered) with the reference ``out`` that the saving job wrote."""
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got_model, got_optim = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                               cpu_offload=True))
    if rank == 0:
        ref_model, ref_optim = torch.load(out, weights_only=False)
        assert set(got_model) == set(ref_model)
        assert all(torch.equal(got_model[k], ref_model[k]) for k in ref_model)
        assert set(got_optim["state"]) == set(ref_optim["state"])
        for key, entry in ref_optim["state"].items():
            assert all(torch.equal(got_optim["state"][key][n], v) for n, v in entry.items()), key


@requires_fuse
def test_a_transformer_saved_every_step_at_2_ranks_loads_at_1_and_2_and_mounts_whole(tmp_path):
    region, out = _saved_every_step_then_loaded_at_1_and_2(tmp_path, 2)
    ref_model, ref_optim = torch.load(out, weights_only=False)
    with mounted(region, str(tmp_path / "mnt")) as m:
        state = torch.load(m / "gpt2/latest/checkpoint.pt", weights_only=True, mmap=True)
        whole = state["model"]
        assert set(whole) == set(ref_model) and all(torch.equal(whole[k], ref_model[k]) for k in ref_model)
        # the plain values too (DCP's byte items, stored by the parts as plain data): a single
        # process resumes the model and its optimizer from the mounted file alone
        assert state["step"] == 4 and state["optim"]["param_groups"] == ref_optim["param_groups"]
        assert json.load(open(m / "gpt2/latest/dcp-parts.json"))["not_shown"] == []
        plain = tiny_gpt2(seed=5)
        opt = torch.optim.AdamW(plain.parameters(), lr=0.5, weight_decay=0.0)
        set_state_dict(plain, opt, model_state_dict=whole, optim_state_dict=state["optim"])
        assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["weight_decay"] == 0.01
        got = get_state_dict(plain, opt, options=StateDictOptions(full_state_dict=True))[1]
        assert got["param_groups"] == ref_optim["param_groups"] and set(got["state"]) == set(ref_optim["state"])
        for key, entry in ref_optim["state"].items():
            assert all(torch.equal(got["state"][key][n], v) for n, v in entry.items()), key
        # tied weights (GPT-2's embedding and head): stored once, shared in checkpoint.pt, and
        # model.safetensors loads strict-clean, as a single process's save does
        assert whole["lm_head.weight"].data_ptr() == whole["transformer.wte.weight"].data_ptr()
        from safetensors.torch import load_model

        plain = tiny_gpt2(seed=5)
        assert load_model(plain, m / "gpt2/latest/model.safetensors") == (set(), [])
        assert all(torch.equal(v, ref_model[k]) for k, v in plain.state_dict().items())


def _plans_once_per_structure(rank, world, region):
    """Saves of one structure plan through dcp.save once; a new structure plans again; every
    step loads back as saved (through the reused plan too)."""
    import torch.distributed.checkpoint as dcp

    planned, real_save = [], dcp.save

    def counting_save(*args, **kwargs):
        planned.append(1)
        return real_save(*args, **kwargs)

    dcp.save = counting_save

    def state(step):
        out = {"w": torch.full((8,), float(step)), "step": step}
        if step >= 4:  # a new key and a new shape: a new structure
            out.update(w=torch.full((6,), float(step)), b=torch.arange(3.0) + step)
        return out

    with ckptfs.Store(region) as store:
        with store.writer("m", group=dist.group.WORLD, max_inflight=2) as w:
            futures = [w.save(state(step), step=step) for step in (1, 2, 3)]
            assert len(planned) == 1
            futures += [w.save(state(step), step=step, async_snapshot=step == 5) for step in (4, 5)]
            assert [f.result().step for f in futures] == [1, 2, 3, 4, 5]
            assert len(planned) == 2
        for step in (3, 4, 5):  # the ring still holds these: a reused plan, a new one, it reused
            back = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in state(step).items()}
            dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "m", step=step))
            want = state(step)
            assert back["step"] == step and all(torch.equal(back[k], want[k]) for k in want if k != "step")


def test_a_plan_is_made_once_per_structure_and_reused_exactly(tmp_path):
    region = _new_region(tmp_path)
    run_ranks(_plans_once_per_structure, 2, region)
    with ckptfs.Store(region) as store:
        assert store.latest("m").step == 5


def _resolves_as_dcp(rank, world, out):
    """A reused plan's items resolve, in a new state dict of the same structure (made again after
    a training step, as a job does before each save), to exactly what DCP's DefaultSavePlanner
    set up with that state gives: the same memory for each shard, the same bytes for the rest."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    from ckptfs.dist.resolve import ItemResolver, resolve_items

    model = sharded_gpt2(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_gpt2(model, opt, 1, seed=rank)
    first = DefaultSavePlanner()
    first.set_up_planner(dict(zip(("model", "optim"), get_state_dict(model, opt))), None, rank == 0)
    items = first.create_local_plan().items
    resolver = ItemResolver(items, first)
    assert resolver.paths is not None  # the fast path, not the fallback
    train_gpt2(model, opt, 1, seed=rank + 7)
    state = dict(zip(("model", "optim"), get_state_dict(model, opt)))
    dcp_planner = DefaultSavePlanner()
    dcp_planner.set_up_planner(state, None, rank == 0)
    want, got = resolve_items(items, dcp_planner), resolver.resolve(state)
    # the plain values of the byte items, by position, are the objects DCP's planner looks up
    assert got.values.keys() == want.values.keys() and all(got.values[i] is want.values[i] for i in got.values)
    named = {items[i].index.fqn: v for i, v in got.values.items()}
    assert named["optim.param_groups.0.lr"] == 1e-3 and named["optim.param_groups.0.betas"] == (0.9, 0.999)
    want, got = want.tensors, got.tensors
    kinds = {type(v).__name__ for v in state["model"].values()}
    assert "DTensor" in kinds and len(got) == len(want) == len(items)
    for item, a, b in zip(items, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), item.index.fqn
        if item.type.name != "BYTE_IO":
            assert a.data_ptr() == b.data_ptr(), item.index.fqn  # the shard itself, not a copy
    # plain values (the learning rate, betas...) resolve to the last save's bytes, the same
    # tensor, while they pickle the same; a changed one to its new bytes, as DCP's
    byte_io = [i for i, item in enumerate(items) if item.type.name == "BYTE_IO"]
    assert byte_io
    again = resolver.resolve(dict(zip(("model", "optim"), get_state_dict(model, opt)))).tensors
    assert all(again[i] is got[i] for i in byte_io)
    opt.param_groups[0]["lr"] = 5e-4
    state = dict(zip(("model", "optim"), get_state_dict(model, opt)))
    dcp_planner = DefaultSavePlanner()
    dcp_planner.set_up_planner(state, None, rank == 0)
    want, changed = resolve_items(items, dcp_planner), resolver.resolve(state)
    assert changed.values == want.values and changed.values[[i for i in byte_io if items[i].index.fqn ==
                                                             "optim.param_groups.0.lr"][0]] == 5e-4
    want, changed = want.tensors, changed.tensors
    assert all(torch.equal(changed[i], want[i]) for i in byte_io)
    moved = [items[i].index.fqn for i in byte_io if not torch.equal(changed[i], got[i])]
    assert moved and all("lr" in fqn for fqn in moved), moved
    # a planner of its own, or a state the default planner does not flatten, is left to DCP
    assert ItemResolver(items, type("Mine", (DefaultSavePlanner,), {})()).paths is None
    assert ItemResolver(items, DefaultSavePlanner(flatten_state_dict=False)).paths is None
    # a planner whose bytes are not torch.save of the value it looks up: its values are not taken
    mine = type("Mine", (DefaultSavePlanner,), {"transform_object": lambda self, item, obj: io.BytesIO(b"x") if
                                                item.type.name == "BYTE_IO" else obj})()
    mine.set_up_planner(state, None, rank == 0)
    assert resolve_items(items, mine).values == {}
    if rank == 0:
        out.put(len(items))


def test_a_reused_plan_resolves_its_items_as_dcp_does(tmp_path):
    from ckptfs.testing.load import mp_context

    out = mp_context().Queue()
    run_ranks(_resolves_as_dcp, 2, out)
    assert out.get(timeout=5) > 20


def _one_rank_skips_a_step(rank, world, region):
    """Both ranks save step 1; rank 1 never comes to step 2: rank 0's save fails after
    timeout_s naming it, and step 1 stays the global latest."""
    store = ckptfs.Store(region)
    w = store.writer("m", group=dist.group.WORLD, timeout_s=4)
    state = {"w": torch.full((8,), float(rank)), "b": torch.ones(2)}
    w.save(state, step=1).result()
    if rank == 0:
        started = time.monotonic()
        with pytest.raises(CkptfsError, match=r"rank\(s\) 1 did not come within timeout_s=4"):
            w.save(state, step=2).result()
        assert time.monotonic() - started >= 3
        assert store.latest("m").step == 1
    else:
        time.sleep(8)  # alive, but not saving: the others must not wait for it longer than timeout_s
    w.close()
    store.close()


def test_a_rank_that_never_comes_to_a_save_is_named_and_the_last_step_stays(tmp_path):
    region = _new_region(tmp_path)
    run_ranks(_one_rank_skips_a_step, 2, region)
    with ckptfs.Store(region) as store:
        assert store.latest("m").step == 1


def _one_rank_trains_on_past_a_save(rank, world, region):
    """Synchronous saves with training collectives between them; rank 1 skips the save of step
    2 and goes on into the next all_reduce: rank 0's save fails after timeout_s naming it, and
    the saves after that commit (the timed-out gloo all-gather had left ckptfs's group unusable,
    and every later save failed)."""
    store = ckptfs.Store(region)
    with store.writer("m", group=dist.group.WORLD, timeout_s=3) as w:
        state = {"w": torch.full((8,), float(rank)), "b": torch.ones(2)}
        w.save(state, step=1).result()
        if rank == 0:
            with pytest.raises(CkptfsError, match=r"rank\(s\) 1 did not come within timeout_s=3"):
                w.save(state, step=2)
        for step in (3, 4):
            grad = torch.ones(4)
            dist.all_reduce(grad)  # the training's own collective
            assert grad.tolist() == [2.0] * 4
            assert w.save(state, step=step).result().step == step
    assert [v.step for v in store.versions("m")] == [1, 3, 4]
    store.close()


def test_a_rank_that_trains_on_past_a_save_fails_only_that_step(tmp_path):
    run_ranks(_one_rank_trains_on_past_a_save, 2, _new_region(tmp_path))


def _one_rank_never_opens_the_writer(rank, world, region):
    """A rank that never comes to the first save or load of a model (stuck in its data loader):
    the others fail after timeout_s naming it. ckptfs's groups are made at the first one, and
    dist.new_group waited there, then failed with the store's timeout naming a key, not a rank."""
    store = ckptfs.Store(region)
    if rank == 1:
        time.sleep(8)  # past both timeouts below, then gone without a collective
        return
    with pytest.raises(CkptfsError, match=r"^the first load of 'm': rank\(s\) 1 did not come within timeout_s=3 "
                                          r"\(stopped, or not loading it\); nothing was read$"):
        store.load("m", group=dist.group.WORLD, into={"w": torch.zeros(2)}, timeout_s=3)
    with pytest.raises(CkptfsError, match=r"^the first save of 'm': rank\(s\) 1 did not come within timeout_s=3 "):
        store.writer("m", group=dist.group.WORLD, timeout_s=3)
    store.close()


def test_a_rank_that_never_comes_to_the_first_save_or_load_is_named(tmp_path):
    run_ranks(_one_rank_never_opens_the_writer, 2, _new_region(tmp_path))


def _one_rank_skips_one_save(rank, world, region):
    """Rank 1's state-dict code raised at step 2 and its loop went on to step 3: rank 0's step 2
    fails at once, naming it, and rank 1's step 3 waits for rank 0's; from then on the steps
    commit (every later save paired rank 0's step N with rank 1's N+1, and none committed)."""
    store = ckptfs.Store(region)
    with store.writer("m", group=dist.group.WORLD, timeout_s=30) as w:
        state = {"w": torch.full((8,), float(rank)), "b": torch.ones(2)}
        # ranks that count steps differently (no step agreed on yet) fail at once, every time
        for step in (0, 1):
            started = time.monotonic()
            with pytest.raises(CkptfsError, match=r"do not save the same step.*pass the same step to "
                                                  r"store.writer \(the model\) and Writer.save"):
                w.save(state, step=step + rank).result()
            assert time.monotonic() - started < 10
        w.save(state, step=1).result()
        if rank == 0:
            started = time.monotonic()
            with pytest.raises(CkptfsError, match=r"step 2 of 'm' was skipped by rank\(s\) 1, which save step 3"):
                w.save(state, step=2).result()
            assert time.monotonic() - started < 10
        for step in (3, 4):
            assert w.save(state, step=step).result().step == step
    assert [v.step for v in store.versions("m")] == [1, 3, 4]
    store.close()


def test_a_rank_that_skips_one_save_fails_only_that_step(tmp_path):
    run_ranks(_one_rank_skips_one_save, 2, _new_region(tmp_path))


def _one_rank_never_calls_dcp_save(rank, world, region):
    """Rank 1 never calls dcp.save (nor async_save, nor load): rank 0's save fails after
    timeout_s with an error naming it, before DCP's own planning gather (which would wait for its
    group's timeout, 8 s here, and name no one); an async_save returns at once all the same, and
    its upload fails the same way; a load fails alike. Nothing is committed or half-visible."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=8))
    if rank == 0:
        with ckptfs.Store(region) as store:
            started = time.monotonic()
            with pytest.raises(CkptfsError, match=r"dcp.save of step 1 of 'm': rank\(s\) 1 did not come within "
                                                  r"timeout_s=3"):
                dcp.save({"w": torch.ones(4)}, process_group=group,
                         storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=1, group=group, timeout_s=3))
            assert 3 <= time.monotonic() - started < 6
            started = time.monotonic()
            response = dcp.async_save({"w": torch.ones(4)}, process_group=group,
                                      storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=2, group=group,
                                                                              timeout_s=3))
            assert time.monotonic() - started < 1.5  # the calling thread does not wait for the others
            upload = getattr(response, "upload_completion", response)
            with pytest.raises(CkptfsError, match=r"step 2 of 'm': rank\(s\) 1 did not come"):
                upload.result()
            assert store.models() == []  # nothing committed, nothing half-visible
            started = time.monotonic()
            with pytest.raises(CkptfsError, match=r"dcp.load of 'm': rank\(s\) 1 did not come within timeout_s=3 "
                                                  r"\(stopped, or not loading\); nothing was read"):
                dcp.load({"w": torch.zeros(4)}, process_group=group,
                         storage_reader=ckptfs.dcp.StorageReader(store, "m", group=group, timeout_s=3))
            assert 3 <= time.monotonic() - started < 6
    else:
        time.sleep(15)  # alive, but neither saving nor loading


def test_a_rank_that_never_calls_dcp_save_or_load_fails_the_others_naming_it(tmp_path):
    region = _new_region(tmp_path)
    run_ranks(_one_rank_never_calls_dcp_save, 2, region)


def _one_rank_saves_alone(rank, world, region):
    import torch.distributed.checkpoint as dcp

    store = ckptfs.Store(region)
    only_0 = dist.new_group([0])  # made by every rank, as new_group asks; used by rank 0 alone
    dist.barrier()
    if rank == 0:  # as a DDP job saves: one rank, with DCP's no_dist or a group of its own
        t0 = time.monotonic()
        state = {"w": torch.arange(6.0), "n": 3}
        dcp.save(state, no_dist=True, storage_writer=ckptfs.dcp.StorageWriter(store, "alone", step=1, timeout_s=20))
        dcp.save({"w": torch.arange(6.0) * 2, "n": 4}, process_group=only_0,
                 storage_writer=ckptfs.dcp.StorageWriter(store, "alone", step=2, timeout_s=20))
        back = {"w": torch.zeros(6), "n": 0}
        dcp.load(back, no_dist=True, storage_reader=ckptfs.dcp.StorageReader(store, "alone", step=1, timeout_s=20))
        assert torch.equal(back["w"], torch.arange(6.0)) and back["n"] == 3
        dcp.load(back, process_group=only_0, storage_reader=ckptfs.dcp.StorageReader(store, "alone", timeout_s=20))
        assert torch.equal(back["w"], torch.arange(6.0) * 2) and back["n"] == 4
        assert time.monotonic() - t0 < 15  # no wait for rank 1, which never comes
    dist.barrier()
    assert [v.step for v in store.versions("alone")] == [1, 2]
    store.close()


def test_one_rank_saves_and_loads_alone_with_dcps_no_dist_or_a_process_group_of_its_own(tmp_path):
    """DCP's no_dist=True and process_group= were not consulted: a rank saving alone (as a DDP
    job's rank 0 does) waited timeout_s for the others, then failed naming them."""
    run_ranks(_one_rank_saves_alone, 2, _new_region(tmp_path))


def _subgroups_load_apart(rank, world, region):
    import torch.distributed.checkpoint as dcp

    store = ckptfs.Store(region)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # made by every rank, in one order
    mine = pairs[rank // 2]
    if rank == 0:
        dcp.save({"w": torch.arange(6.0)}, no_dist=True, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=1))
    dist.barrier()
    with pytest.raises(CkptfsError, match=r"process_group= holds ranks (0, 1|2, 3) of the job's 4: pass a gloo group"):
        dcp.load({"w": torch.zeros(6)}, process_group=mine,
                 storage_reader=ckptfs.dcp.StorageReader(store, "m", timeout_s=10))
    t0 = time.monotonic()
    back = {"w": torch.zeros(6)}
    if rank == 0:  # its partner, rank 1, never loads: named, not passed by ranks 2 and 3
        with pytest.raises(BaseException, match=r"rank\(s\) 1 did not come within timeout_s=3"):
            dcp.load(back, process_group=mine, storage_reader=ckptfs.dcp.StorageReader(store, "m", timeout_s=3, group=mine))
    elif rank > 1:
        time.sleep(0.3)  # rank 0 waits already
        dcp.load(back, process_group=mine, storage_reader=ckptfs.dcp.StorageReader(store, "m", timeout_s=3, group=mine))
        assert torch.equal(back["w"], torch.arange(6.0)) and time.monotonic() - t0 < 3
    dist.barrier()
    store.close()


def test_two_subgroups_loading_one_model_meet_apart(tmp_path):
    """The meetings of two subgroups at the same load were one (their names did not hold the
    group): a rank passed with the other group's, and the rest waited past timeout_s. A
    process_group= of some ranks needs their gloo group as group= too, and says so at once."""
    run_ranks(_subgroups_load_apart, 4, _new_region(tmp_path))


def _goes_back_a_step(rank, world, region):
    store = ckptfs.Store(region)
    with store.writer("back", group=dist.group.WORLD, timeout_s=20) as w:
        w.save({"w": torch.full((8,), 10.0)}, step=10).result()
        later = w.save({"w": torch.full((8,), 20.0)}, step=20, async_snapshot=True)
        older = w.save({"w": torch.full((8,), 11.0)}, step=11, async_snapshot=True)
        with pytest.raises(CkptfsError, match=r"step 11 of 'back' is older than step 20, which this writer saved"):
            older.result()
        later.result()
        w.save({"w": torch.full((8,), 21.0)}, step=21).result()
        # a step whose commit failed (a full region) holds nothing back: the job saves on below it
        from ckptfs.dist import writer as dist_writer
        for cls in {dist_writer.StorageWriter, dist_writer._PartOnly}:
            def failing(self, *args, _real=cls.commit, **kwargs):
                if self.step == 30:
                    raise CkptfsError("injected: step 30's commit failed")
                return _real(self, *args, **kwargs)
            cls.commit = failing
        with pytest.raises(CkptfsError, match="injected"):
            w.save({"w": torch.full((8,), 30.0)}, step=30).result()
        w.save({"w": torch.full((8,), 25.0)}, step=25).result()
    assert store.latest("back").step == 25 and 30 not in [v.step for v in store.versions("back")]
    store.close()


def test_a_writer_of_many_ranks_refuses_a_step_older_than_its_last(tmp_path):
    """Its commits come in the order of its saves: an older step after a newer one is the job
    gone back, which would never become latest; its future succeeded, nothing recorded."""
    run_ranks(_goes_back_a_step, 2, _new_region(tmp_path))


def _one_rank_skips_a_load(rank, world, region):
    import torch.distributed.checkpoint as dcp

    store = ckptfs.Store(region)
    dcp.save({"w": torch.arange(4.0)}, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=1))
    back = {"w": torch.zeros(4)}
    if rank == 0:  # rank 1 skips this load (its evaluation was skipped)
        with pytest.raises(BaseException, match=r"rank\(s\) 1 did not come within timeout_s=2"):
            dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "m", timeout_s=2))
    dist.barrier()
    for _ in range(2):  # then both load, together: they meet again
        back = {"w": torch.zeros(4)}
        dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "m", timeout_s=10))
        assert torch.equal(back["w"], torch.arange(4.0))
    store.close()


def test_ranks_meet_again_after_one_skipped_a_load(tmp_path):
    """Each process counted its own rounds of a meeting: after one rank skipped a load, its n-th
    load met the others' (n+1)-th, and every later load failed on both, each naming the other."""
    run_ranks(_one_rank_skips_a_load, 2, _new_region(tmp_path))


def _the_last_comes_as_the_first_leaves(rank, world, region):
    from ckptfs.dist import group as G

    kv = G._kv_store()
    dist.barrier()
    if rank == 0:  # past its deadline it has found rank 1 missing, and rank 1 comes just now
        real, t0 = G._raise_if_elsewhere, time.monotonic()

        def at_the_deadline(*args, **kwargs):
            real(*args, **kwargs)
            if time.monotonic() - t0 >= 1.0:
                kv.set("go", "1")
                time.sleep(0.3)
        G._raise_if_elsewhere = at_the_deadline
    else:
        kv.wait(["go"])
    G.meet(dist.group.WORLD, {"model": "m", "step": 5}, 1.0, "the meeting")  # both pass, or neither
    dist.barrier()


def test_a_rank_leaving_a_meeting_as_the_last_comes_passes_with_it(tmp_path):
    """The last rank came as the first, past its timeout_s, was leaving: the last passed alone
    into DCP's planning gather (and waited there, named by no one, until the group's timeout),
    while the first raised that it never came."""
    run_ranks(_the_last_comes_as_the_first_leaves, 2, _new_region(tmp_path))


def _a_save_tried_again(rank, world, region):
    import torch.distributed.checkpoint as dcp

    store = ckptfs.Store(region)
    if rank == 1:
        time.sleep(1.5)  # late for rank 0's first try
    for attempt in range(3):
        try:
            dcp.save({"w": torch.arange(4.0)}, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=10, timeout_s=1))
            break
        except BaseException as e:  # noqa: BLE001 - tried again, as a job's retry wrapper does
            assert rank == 0 and attempt == 0 and "rank(s) 1 did not come" in str(e), str(e)
    assert store.latest("m").step == 10
    store.close()


def test_a_save_tried_again_after_a_rank_came_late_meets_it(tmp_path):
    """Each process counted its own rounds of a save's meeting: rank 0's second try was its round
    2, rank 1's first its round 1, and no try met again, each naming the other."""
    run_ranks(_a_save_tried_again, 2, _new_region(tmp_path))


def _two_models_commit_in_crossed_order(rank, world, region):
    """A model's writer and its EMA's in one process: rank 0 commits the EMA's step first,
    rank 1 the model's (a slower commit on each); with one group for both their exchanges met
    each other's ("the ranks do not save the same model", or gloo's abort of the process)."""
    from ckptfs.dist import storage

    real = storage.StorageWriter._commit

    def slower(self, *args, **kwargs):
        if (rank, self.model) in ((0, "model"), (1, "ema")):
            time.sleep(0.5)
        return real(self, *args, **kwargs)
    storage.StorageWriter._commit = slower
    store = ckptfs.Store(region)
    with store.writer("model", group=dist.group.WORLD, timeout_s=20) as w, \
            store.writer("ema", group=dist.group.WORLD, timeout_s=20) as e:
        saves = []
        for step in (1, 2, 3):
            saves.append(w.save({"w": torch.full((1000,), float(rank + step))}, step=step))
            saves.append(e.save({"ema": {"w": torch.full((10,), float(step))}}, step=step))
        assert [f.result().step for f in saves] == [1, 1, 2, 2, 3, 3]
    assert store.latest("model").step == store.latest("ema").step == 3
    store.close()


def test_the_writers_of_two_models_in_one_process_commit_apart(tmp_path):
    region = _new_region(tmp_path)
    run_ranks(_two_models_commit_in_crossed_order, 2, region)
    with ckptfs.Store(region) as store:
        assert torch.equal(store.load("ema")["ema"]["w"], torch.full((10,), 3.0))
        # a plain tensor is replicated state to DCP: one rank's bytes are written
        assert store.load("model")["w"][0].item() in (3.0, 4.0)


_ENDS_DURING_A_SNAPSHOT = r"""
import os, sys, time, torch, torch.distributed as dist, ckptfs
from ckptfs.dist import writer as W
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
w = ckptfs.Store(sys.argv[1]).writer("m", group=dist.group.WORLD)
w.save({"x": torch.ones(10)}, step=1).result()
real = W.DistWriter._snapshot
W.DistWriter._snapshot = lambda self, *a: (time.sleep(0.5), real(self, *a))[1]
w.save({"x": torch.full((10,), 2.0)}, step=2, async_snapshot=True)
print("the script ends with step 2 in flight", flush=True)
"""


def test_a_script_that_ends_during_an_async_snapshot_still_commits_it(tmp_path):
    """As Writer's: a job's script that ends with a save in flight, its writer not closed, gets
    it committed. The commit executor was stopped by concurrent.futures' exit hook while the
    snapshot still ran; the step stayed a part, uncommitted, and nobody was told."""
    import subprocess
    import sys

    from ckptfs.testing.ranks import free_port

    region = _new_region(tmp_path)
    done = subprocess.run([sys.executable, "-c", _ENDS_DURING_A_SNAPSHOT, region, str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ends with step 2" in done.stdout, done.stderr[-2000:]
    with ckptfs.Store(region) as store:
        assert [v.step for v in store.versions("m")] == [1, 2]
        assert torch.equal(store.load("m")["x"], torch.full((10,), 2.0))


def test_a_forked_child_does_not_wait_at_exit_for_its_parents_saves():
    """A DataLoader worker forked while a save is in flight ends with a copy of the writer: the
    exit hook that commits a script's saves waits only for the saves of its own process (the
    child waited for good on the copy of the parent's future)."""
    import multiprocessing
    from concurrent.futures import Future

    from ckptfs.dist.writer import DistWriter

    w = DistWriter(None, "m")
    in_flight = Future()
    w._pending.add(in_flight)
    try:
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0.1,))
        child.start()
        child.join(timeout=30)
        assert child.exitcode == 0, "the child did not end"
    finally:
        if child.is_alive():
            child.kill()
        in_flight.set_result(None)
        w.close()


def _different_keys(rank, world, region):
    with ckptfs.Store(region) as store, store.writer("m", group=dist.group.WORLD, timeout_s=30) as w:
        w.save({"w": torch.ones(4)}, step=1).result()
        state = {"w": torch.ones(4), **({"extra.bias": torch.zeros(2)} if rank == 1 else {})}
        with pytest.raises(CkptfsError, match="rank 1 also has 'extra.bias'"):
            w.save(state, step=2).result()
        assert store.latest("m").step == 1


def test_ranks_saving_different_keys_commit_nothing(tmp_path):
    region = _new_region(tmp_path)
    run_ranks(_different_keys, 2, region)
    with ckptfs.Store(region) as store:
        assert [v.step for v in store.versions("m")] == [1]


def test_a_load_of_many_ranks_needs_into(store):
    with pytest.raises(ValueError, match="into="):
        store.load("m", group=object())


def test_a_job_whose_steps_are_behind_the_models_latest_is_told_not_lost(store):
    """Another job's (or a further run's) model in the region: this job's steps would never
    become latest, so its save fails saying what to do, rather than "succeeding" invisibly."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(4)}, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=1000))
    with pytest.raises(BaseException, match=r"already at step 1000 .*`ckptfs rm --allow-latest m STEP\.\.\.`"):
        dcp.save({"w": torch.zeros(4)}, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=10))
    assert [v.step for v in store.versions("m")] == [1000]


def _load_across(rank, world, regions):
    import torch.distributed.checkpoint as dcp

    with ckptfs.Store(regions[rank]) as mine:
        back = {"w": torch.zeros(4)}
        with pytest.raises(BaseException, match="belongs to another job"):
            dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(mine, "m"))
        assert torch.equal(back["w"], torch.zeros(4))


def test_nodes_whose_regions_hold_different_jobs_at_the_same_step_load_nothing(tmp_path):
    import torch.distributed.checkpoint as dcp

    regions = [str(tmp_path / "a.region"), str(tmp_path / "b.region")]
    for value, region in enumerate(regions):  # two single-node jobs, each at step 5
        with ckptfs.Store.create(region, size_bytes=64 << 20) as store:
            dcp.save({"w": torch.full((4,), float(value))}, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=5))
    run_ranks(_load_across, 2, regions)


def _save_sharded(rank, world, region):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    with ckptfs.Store(region) as store:
        with store.writer("m", group=dist.group.WORLD) as w:
            w.save({"w": distribute_tensor(torch.arange(4096.0), mesh, [Shard(0)])}, step=1).result()


def _load_damaged(rank, world, region):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptfs.errors import CorruptionError

    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(torch.zeros(4096), mesh, [Shard(0)])}
    with ckptfs.Store(region) as store:
        # each rank reads its own part; rank 1's is damaged: it fails there, and rank 0, whose
        # own reads were fine, fails too, naming rank 1
        expected = (CkptfsError, "failed on rank 1 .*checksum") if rank == 0 else (CorruptionError, "checksum")
        with pytest.raises(expected[0], match=expected[1]):
            store.load("m", group=dist.group.WORLD, into=state)


def test_a_load_that_fails_on_one_rank_fails_on_every_rank(tmp_path):
    from test_cli import flip_a_tensor_byte

    region = _new_region(tmp_path)
    run_ranks(_save_sharded, 2, region)
    flip_a_tensor_byte(region, ".m.rank1", 1, "items.0")
    run_ranks(_load_damaged, 2, region)


def _a_refused_state(rank, world, region):
    """A state ckptfs refuses (a sparse tensor) at a multi-rank save: the rank that holds it says
    ckptfs's own error, naming the state's key, and the others name that rank; the save came as
    DCP's CheckpointException (a BaseException: `except Exception` missed it), 2.8 KB of
    tracebacks naming the part's path items.0. The writer goes on saving."""
    store = ckptfs.Store(region)
    state = {"model": {"w": torch.ones(2), "emb": torch.ones(4, 2).to_sparse()}}
    with store.writer("m", group=dist.group.WORLD, timeout_s=30) as w:
        try:
            w.save(state, step=1)
        except Exception as e:  # noqa: BLE001 - the point: an Exception, worded as ckptfs's
            error = e
        said = "model.emb: torch.sparse_coo tensors are not supported; use .to_dense()"
        if isinstance(error, ckptfs.errors.UnsupportedObjectError):  # the rank DCP gave the tensor to write
            assert str(error) == said
        else:
            assert str(error) == f"step 1 of 'm' failed on rank {1 - rank} (UnsupportedObjectError: {said}); " \
                                 "nothing of it is committed", error
        w.save({"model": {"w": torch.ones(2), "emb": torch.ones(4, 2)}}, step=2).result()
    assert [v.step for v in store.versions("m")] == [2]
    store.close()


def test_a_refused_state_says_the_state_s_key_on_every_rank(tmp_path):
    run_ranks(_a_refused_state, 2, _new_region(tmp_path))


def _first_start_and_a_rank_that_cannot_list(rank, world, region):
    """A job's first start: every rank's load says NotFoundError (it was DCP's AssertionError,
    'metadata is None; ...', which a resume-or-start loop could not tell from a failure). Then
    one rank whose listing of the region fails: every rank fails at once (DCP called that rank's
    read_metadata again, whose collectives met the others' next ones: 300 s, then a bare gloo
    timeout naming no one)."""
    import logging

    store = ckptfs.Store(region)
    state = {"w": torch.zeros(4)}
    logged = []
    handler = logging.Handler()
    handler.emit = logged.append
    logging.getLogger().addHandler(handler)
    with pytest.raises(ckptfs.errors.NotFoundError, match="'m' has no committed version yet"):
        store.load("m", group=dist.group.WORLD, into=state, timeout_s=20)
    logging.getLogger().removeHandler(handler)
    # said once, by the error: DCP logged two tracebacks of it on each rank first
    assert [r.getMessage() for r in logged if r.exc_info] == []
    # (dcp.load says it in its own CheckpointException, as of any storage)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match="'m' has no committed version yet"):
        dcp.load(state, storage_reader=ckptfs.dcp.StorageReader(store, "m", timeout_s=20))
    with store.writer("m", group=dist.group.WORLD) as w:
        w.save({"w": torch.ones(4)}, step=1).result()
    if rank == 1:
        store.versions = lambda *a, **k: (_ for _ in ()).throw(OSError(5, "Input/output error"))
    started = time.monotonic()
    with pytest.raises((OSError, CkptfsError), match="Input/output error"):
        store.load("m", group=dist.group.WORLD, into=state, timeout_s=20)
    assert time.monotonic() - started < 10
    store.__dict__.pop("versions", None)
    store.load("m", group=dist.group.WORLD, into=state, timeout_s=20)  # the ranks still meet in step
    assert torch.equal(state["w"], torch.ones(4))
    store.close()


def test_a_first_start_and_a_rank_that_cannot_list_fail_at_once_on_every_rank(tmp_path):
    run_ranks(_first_start_and_a_rank_that_cannot_list, 2, _new_region(tmp_path))


def _nodes_on_copies_of_one_region(rank, world, regions):
    """Two nodes whose regions are copies of one (a template image, a cloned disk: one uuid).
    They counted as one node: one leader recorded each step, naming the other node's part in its
    own region; every save was reported committed, and no load found anything."""
    store = ckptfs.Store(regions[rank])
    for how in ("writer", "dcp"):
        with pytest.raises(CkptfsError, match=r"the regions of ranks 0 and 1 are copies of one region"):
            if how == "writer":
                with store.writer("m", group=dist.group.WORLD, timeout_s=30) as w:
                    w.save({"w": torch.full((4,), float(rank))}, step=1).result()
            else:
                try:
                    dcp.save({"w": torch.full((4,), float(rank))},
                             storage_writer=ckptfs.dcp.StorageWriter(store, "d", step=1, timeout_s=30))
                except BaseException as e:  # DCP's CheckpointException: the ranks' errors inside
                    raise CkptfsError(str(e)) from None
    assert store.versions("m", missing_ok=True) == [] and store.versions("d", missing_ok=True) == []
    store.close()


def test_nodes_on_copies_of_one_region_commit_nothing_and_say_so(tmp_path):
    import shutil

    regions = [str(tmp_path / "a.region"), str(tmp_path / "b.region")]
    ckptfs.Store.create(regions[0], size_bytes=64 << 20).close()
    shutil.copyfile(regions[0], regions[1])
    run_ranks(_nodes_on_copies_of_one_region, 2, regions)


def _save_steps(rank, world, regions, steps):
    store = ckptfs.Store(regions[rank])
    with store.writer("m", group=dist.group.WORLD, timeout_s=30) as w:
        for step in steps:
            w.save({"w": torch.full((4,), float(step))}, step=step).result()
    store.close()


def _resume_behind_one_node(rank, world, regions):
    store = ckptfs.Store(regions[rank])
    with store.writer("m", group=dist.group.WORLD, timeout_s=30) as w:
        with pytest.raises(CkptfsError, match=r"step 3 of 'm' was not committed on any node: 'm' in region .*a.region "
                                              r"is already at step 5"):
            w.save({"w": torch.full((4,), 3.0)}, step=3).result()
    store.close()


def test_a_step_one_nodes_leader_refuses_is_recorded_by_none(tmp_path):
    """Node A's region is at step 5 (a run without node B got further), node B's at step 2: the
    job resumed at 2 saves step 3. A's leader refused it, B's recorded it, and from then on the
    nodes' regions held different steps and every load failed. Now no leader records it."""
    regions = [str(tmp_path / "a.region"), str(tmp_path / "b.region")]
    for r in regions:
        ckptfs.Store.create(r, size_bytes=64 << 20).close()
    run_ranks(_save_steps, 2, regions, [1, 2])
    run_ranks(_save_steps, 1, regions[:1], [5])
    run_ranks(_resume_behind_one_node, 2, regions)
    with ckptfs.Store(regions[1]) as b:
        assert [v.step for v in b.versions("m")] == [1, 2]


def _load_after_a_run_without_one_node(rank, world, regions, older):
    store, peer = ckptfs.Store(regions[rank]), ckptfs.Store(regions[1 - rank])
    state = {"w": torch.zeros(4)}
    said = (r"step 4 of 'm', the newest, is recorded in the region of rank\(s\) 0 only, and was saved without the "
            r"region of rank\(s\) 1 .*" + (r"or load step=2, the newest every node records" if older
                                             else r"no step is recorded by every node"))
    with pytest.raises(CkptfsError, match=said):
        store.load("m", group=dist.group.WORLD, into=state, peers=[peer], timeout_s=30)
    if older:
        store.load("m", group=dist.group.WORLD, into=state, step=2, peers=[peer], timeout_s=30)
        assert torch.equal(state["w"], torch.full((4,), 2.0))
    store.close()
    peer.close()


def test_a_load_does_not_silently_fall_back_behind_a_run_without_one_node(tmp_path):
    """Two nodes saved steps 1 and 2; a run on node A alone went on to steps 3 and 4. The job
    back on both nodes loaded step 2 without a word, and its next save told it to remove steps
    3 and 4, the newest good checkpoints; with node B's region replaced (a fresh machine) the
    load said 'no committed version yet', and a resume-or-start job began again from step 0."""
    regions = [str(tmp_path / "a.region"), str(tmp_path / "b.region")]
    for r in regions:
        ckptfs.Store.create(r, size_bytes=64 << 20).close()
    run_ranks(_save_steps, 2, regions, [1, 2])
    run_ranks(_save_steps, 1, regions[:1], [3, 4])
    run_ranks(_load_after_a_run_without_one_node, 2, regions, True)
    ckptfs.Store.create(regions[1], size_bytes=64 << 20, force=True).close()  # node B's region replaced
    run_ranks(_load_after_a_run_without_one_node, 2, regions, False)


def _one_leader_fails_to_record(rank, world, regions):
    """Node A's leader records step 3, node B's fails to (a commit cut between the leaders'
    records); then the load takes step 2, the newest both record, without an error: step 3's
    metadata names B's region, which lacks it."""
    import ckptfs.dist.storage as storage

    store, peer = ckptfs.Store(regions[rank]), ckptfs.Store(regions[1 - rank])
    if rank == 1:
        storage._record_here = lambda *a, **k: (_ for _ in ()).throw(OSError(5, "injected: B's record failed"))
    with store.writer("m", group=dist.group.WORLD, timeout_s=30) as w:
        with pytest.raises(CkptfsError, match="is not recorded on every node"):
            w.save({"w": torch.full((4,), 3.0)}, step=3).result()
    state = {"w": torch.zeros(4)}
    store.load("m", group=dist.group.WORLD, into=state, peers=[peer], timeout_s=30)
    assert torch.equal(state["w"], torch.full((4,), 2.0))
    store.close()
    peer.close()


def test_a_commit_cut_between_the_leaders_records_loads_the_step_before(tmp_path):
    regions = [str(tmp_path / "a.region"), str(tmp_path / "b.region")]
    for r in regions:
        ckptfs.Store.create(r, size_bytes=64 << 20).close()
    run_ranks(_save_steps, 2, regions, [1, 2])
    run_ranks(_one_leader_fails_to_record, 2, regions)
    with ckptfs.Store(regions[0]) as a, ckptfs.Store(regions[1]) as b:
        assert [v.step for v in a.versions("m")] == [1, 2, 3] and [v.step for v in b.versions("m")] == [1, 2]


def _a_commit_check_fails_on_one_rank(rank, world, region):
    """The leader's look at its region's latest fails (an EIO reading a header) at a commit: the
    error was raised on that rank alone before the exchange of parts, the other waited timeout_s,
    and every later save failed. Now both fail at once, and the next save commits."""
    import errno

    store = ckptfs.Store(region)
    real, armed = ckptfs.Store.latest, [False]

    def latest(self, model, **kw):
        if armed[0] and rank == 0:
            raise OSError(errno.EIO, "injected: a header unreadable")
        return real(self, model, **kw)

    ckptfs.Store.latest = latest
    with store.writer("m", group=dist.group.WORLD, timeout_s=20) as w:
        w.save({"w": torch.ones(4)}, step=1).result()
        armed[0] = True
        started = time.monotonic()
        with pytest.raises(CkptfsError, match="step 2 of 'm' was not committed: rank 0: .*injected"):
            w.save({"w": torch.ones(4)}, step=2).result()
        assert time.monotonic() - started < 10
        armed[0] = False
        assert w.save({"w": torch.ones(4)}, step=3).result().step == 3
    ckptfs.Store.latest = real
    assert [v.step for v in store.versions("m")] == [1, 3]
    # a StorageReader used again after a load that failed (nothing saved yet) loads what is there
    reader = ckptfs.dcp.StorageReader(store, "fresh", timeout_s=20)
    state = {"w": torch.zeros(4)}
    with pytest.raises(BaseException, match="has no committed version yet"):
        dcp.load(state, storage_reader=reader)
    dcp.save({"w": torch.full((4,), 7.0)}, storage_writer=ckptfs.dcp.StorageWriter(store, "fresh", step=1))
    dcp.load(state, storage_reader=reader)
    assert torch.equal(state["w"], torch.full((4,), 7.0))
    store.close()


def test_a_commit_check_that_fails_on_one_rank_fails_every_rank_at_once(tmp_path):
    run_ranks(_a_commit_check_fails_on_one_rank, 2, _new_region(tmp_path))


def _late_and_disagreeing(rank, world, region):
    """Ranks that count steps differently, one coming 2.5 s after the other: the first failed
    only at timeout_s, saying the other never came (it looked for the others at intervals longer
    than the other stays visible once it has failed)."""
    store = ckptfs.Store(region)
    with store.writer("m", group=dist.group.WORLD, timeout_s=30) as w:
        if rank == 1:
            time.sleep(2.5)
        started = time.monotonic()
        with pytest.raises(CkptfsError, match="do not save the same step"):
            w.save({"w": torch.ones(4)}, step=5 + rank)
        assert time.monotonic() - started < (2 if rank else 5)
    store.close()


def test_a_late_rank_at_another_step_fails_both_at_once(tmp_path):
    run_ranks(_late_and_disagreeing, 2, _new_region(tmp_path))


def _a_planner_whose_data_cannot_be_stored(rank, world, region):
    import dataclasses

    from torch.distributed.checkpoint import DefaultSavePlanner

    class Planner(DefaultSavePlanner):
        def create_global_plan(self, plans):
            plans, md = super().create_global_plan(plans)
            self.metadata = md = dataclasses.replace(md, planner_data={"tags": {"a", "b"}})
            return plans, md

    store = ckptfs.Store(region)
    started = time.monotonic()
    with pytest.raises(BaseException, match="planner_data holds a set, which ckptfs cannot store"):
        dcp.save({f"w{rank}": torch.ones(3)}, planner=Planner(),
                 storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=1, timeout_s=20))
    assert time.monotonic() - started < 10  # the coordinator's failure told to every rank, not a timeout
    dcp.save({f"w{rank}": torch.ones(3)}, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=2, timeout_s=20))
    assert [v.step for v in store.versions("m")] == [2]
    store.close()


def test_a_planner_whose_data_cannot_be_stored_fails_every_rank_at_once(tmp_path):
    run_ranks(_a_planner_whose_data_cannot_be_stored, 2, _new_region(tmp_path))


def _two_nodes_reuse_a_plan(rank, world, regions):
    """4 ranks on 2 simulated nodes save steps 1-3 through one writer (the plan made at step 1,
    reused by 2 and 3: each node's leader splices the counters into the metadata it kept), then
    every rank loads step 3 back (parts from both regions)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    mine = ckptfs.Store(regions[rank * len(regions) // world])
    with mine.writer("m", group=dist.group.WORLD, max_inflight=2) as w:
        futures = [w.save({"w": distribute_tensor(torch.arange(64.0) + step, mesh, [Shard(0)]),
                           "b": torch.full((3,), float(step))}, step=step) for step in (1, 2, 3)]
        assert [f.result().step for f in futures] == [1, 2, 3]
    assert mine.latest("m").step == 3
    peers = [ckptfs.Store(r) for r in regions if r != mine.path]
    state = {"w": distribute_tensor(torch.zeros(64), mesh, [Shard(0)]), "b": torch.zeros(3)}
    mine.load("m", group=dist.group.WORLD, into=state, peers=peers)
    assert torch.equal(state["w"].full_tensor(), torch.arange(64.0) + 3) and torch.equal(state["b"], torch.full((3,), 3.0))
    for store in (mine, *peers):
        store.close()


def test_two_nodes_reusing_a_plan_record_every_step_on_both(tmp_path):
    regions = [str(tmp_path / f"node{i}.region") for i in range(2)]
    for r in regions:
        ckptfs.Store.create(r, size_bytes=64 << 20).close()
    run_ranks(_two_nodes_reuse_a_plan, 4, regions)
    for r in regions:
        with ckptfs.Store(r) as store:
            assert [v.step for v in store.versions("m")][-1] == 3


def _dtensor_without_group(rank, world, region):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    w = distribute_tensor(torch.ones(4, 2), init_device_mesh("cpu", (world,)), [Shard(0)])
    with ckptfs.Store(region) as store, store.writer("m") as writer:
        with pytest.raises(ckptfs.errors.UnsupportedObjectError, match=r"^model\.w: a DTensor is sharded over ranks: "
                                                                       r"save it from every rank together, with "
                                                                       r"store\.writer\(model, group=\.\.\.\)"):
            writer.save({"model": {"w": w}}, step=1)
        assert store.models() == []


def test_a_dtensor_saved_without_group_is_refused_with_the_way(tmp_path):
    """A sharded job's state saved through a one-process writer (no group=) failed inside the
    snapshot with '.numpy() is not supported for tensor subclasses'; now the save is refused at
    once, naming the tensor and group=."""
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=64 << 20).close()
    run_ranks(_dtensor_without_group, 1, region)


def _load_one_process_version_sharded(rank, world, region, out, how):
    model = sharded_gpt2(world, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_gpt2(model, opt, 1, seed=99)  # other values and optimizer state, to be overwritten
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 0}
    with ckptfs.Store(region) as store:
        if how == "dcp":
            dcp.load(state, storage_reader=ckptfs.dcp.StorageReader(store, "gpt2"))
        else:
            assert store.load("gpt2", group=dist.group.WORLD, into=state) is state
    assert state["step"] == 3
    compare_full(rank, model, opt, state, out)


@pytest.mark.parametrize("how", ["store", "dcp"])
def test_a_version_saved_by_one_process_loads_sharded_at_2_ranks(tmp_path, how):
    """A job that saved from one process (store.writer without group=: one GPU, or rank 0 of
    DDP) resumes as FSDP2 at 2 ranks: its DCP metadata is made from its index, DCP reshards.
    Failed with 'step 3 of 'gpt2' is not a DCP checkpoint (it has no dcp-metadata.json)'."""
    region = _new_region(tmp_path, 256 << 20)
    out = str(tmp_path / "full.pt")
    model = tiny_gpt2(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with ckptfs.Store(region) as store, store.writer("gpt2") as w:
        for step in range(1, 4):
            train_gpt2(model, opt, 1, seed=step)
            full = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
            w.save({"model": full[0], "optim": full[1], "step": step}, step=step)
    torch.save(full, out)
    run_ranks(_load_one_process_version_sharded, 2, region, out, how)


def _load_where_one_node_cannot(rank, world, regions):
    import time

    with ckptfs.Store(regions[rank]) as mine:
        back = {"w": torch.zeros(4), "pair": None}
        started = time.monotonic()
        expected = r"holds tensors inside 'pair'" if rank == 1 else r"failed on another rank, reading .*b\.region"
        with pytest.raises(BaseException, match=expected):
            dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(mine, "m", timeout_s=60))
        assert time.monotonic() - started < 30  # not after timeout_s, waiting for the rank that failed
        assert torch.equal(back["w"], torch.zeros(4))


def test_a_node_that_cannot_read_the_step_fails_every_rank_at_once(tmp_path):
    """Two nodes at step 5; node b's version cannot be served to DCP (a tuple of tensors): its
    rank fails with that, the other at once with where and why (it waited for the comparison
    until timeout_s)."""
    regions = [str(tmp_path / "a.region"), str(tmp_path / "b.region")]
    for region, pair in zip(regions, [1, (torch.ones(1), torch.ones(1))]):
        with ckptfs.Store.create(region, size_bytes=64 << 20) as store, store.writer("m") as w:
            w.save({"w": torch.ones(4), "pair": pair}, step=5).result()
    run_ranks(_load_where_one_node_cannot, 2, regions)


def test_single_process_options_given_with_group_are_named(store):
    """store.writer(..., group=) with an option of the single-process writer (slots=, chunk_bytes=)
    says which options it takes (a bare TypeError from DistWriter's constructor before), and
    DistWriter's own list of them is its signature's."""
    import inspect

    from ckptfs.dist.writer import DIST_OPTIONS, DistWriter

    params = inspect.signature(DistWriter.__init__).parameters
    assert tuple(p for p in params if params[p].kind is inspect.Parameter.KEYWORD_ONLY and p != "group") == DIST_OPTIONS
    with pytest.raises(TypeError, match=r"takes max_inflight, timeout_s, keep_every, not chunk_bytes, slots"):
        store.writer("m", group=object(), slots=10, chunk_bytes=1 << 20)


def _keep_every_step_in_a_small_region(rank, world, region):
    """keep_every=1 in a region that fills: the parts' rings, waiting for parts that no commit
    gives back, fail after PARTS_STUCK_S (they waited the Writer's 120 s, whatever timeout_s the
    DistWriter had: its part writers did not get it)."""
    import ckptfs.region.ring as ring_module
    from ckptfs.dist import storage

    ring_module.PARTS_STUCK_S = 1.0
    store = ckptfs.Store(region)
    with store.writer("m", group=dist.group.WORLD, max_inflight=1, keep_every=1, timeout_s=60) as w:
        w.save({"w": torch.ones(1 << 20)}, step=0).result()
        part = storage._writers[(store.path, f".m.rank{rank}")]
        assert part.timeout_s == 60
        started, failed = time.monotonic(), None
        for step in range(1, 200):
            try:
                w.save({"w": torch.full((1 << 20,), float(step))}, step=step).result()
            except CkptfsError as e:  # the rank's RegionFullError, in the commit's words
                failed = e
                break
    assert failed is not None and "every slot of '.m.rank0' holds its latest or a kept version" in str(failed)
    assert time.monotonic() - started < 40
    assert store.latest("m").step == step - 1
    store.close()


def test_a_multi_rank_job_that_keeps_every_step_in_a_region_that_fills_fails_in_time(tmp_path):
    region = _new_region(tmp_path)
    run_ranks(_keep_every_step_in_a_small_region, 1, region)


class _CountingStore:
    """A real TCPStore on loopback whose ``check`` requests are counted."""

    def __init__(self):
        self.kv = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
        self.checks = 0

    def check(self, keys):
        self.checks += 1
        return self.kv.check(keys)


@pytest.mark.parametrize("missing", [set(), {517}, {0, 1023}, set(range(0, 1024, 3))])
def test_who_is_missing_of_many_ranks_takes_few_store_requests(missing):
    # a meeting's look for one straggler of 1024 ranks, made now and then by every waiting rank,
    # asked the store once per rank: a million requests a look
    from ckptfs.dist.group import present

    store = _CountingStore()
    keys = [f"arrivals/x/1/{r}" for r in range(1024)]
    for r in range(1024):
        if r not in missing:
            store.kv.set(keys[r], "1")
    found = present(store, keys)
    assert [r for r, here in enumerate(found) if not here] == sorted(missing)
    if len(missing) <= 2:
        assert store.checks <= 1 + 2 * max(len(missing), 1) * 10
    assert present(store, []) == []


def _three_steps(rank, world, region, first=1):
    store = ckptfs.Store(region)
    with store.writer("m", group=dist.group.WORLD, timeout_s=60) as w:
        for s in range(first, first + 3):
            w.save({"w": torch.full((2, 100), float(s))}, step=s).result()
    store.close()


def _part_kept(store, step) -> list[bool]:
    """Whether each part that global version ``step`` of "m" names is kept (rank 0's alone
    holds the replicated "w": DCP writes it once)."""
    from ckptfs.dist.parts import named_by

    counter = next(v.counter for v in store.versions("m") if v.step == step)
    named = named_by(store, "m", [(step, counter)])
    assert named
    return [v.kept for name, c in sorted(named) for v in store.versions(name, hidden=True) if v.counter == c]


@pytest.mark.parametrize("order", ["keep inside the reclaim", "reclaim inside the keep"])
def test_a_milestone_kept_beside_a_commit_keeps_its_parts(tmp_path, monkeypatch, order):
    """`ckptfs keep` of a step while the job's commit gives superseded parts back: the commit's
    reclaim read the milestones, the keep set the step's flag (its parts still kept, nothing to
    do), then the reclaim unkept the parts: the step was listed kept while its parts' slots were
    reused, and the milestone could not be loaded (6 of 7 runs). Each side checks again now."""
    from ckptfs.dist import parts

    region = _new_region(tmp_path)
    run_ranks(_three_steps, 2, region)
    store = ckptfs.Store(region)
    # step 2's parts kept again, its global version not: the state between step 3's commit and
    # its reclaim, where the keep comes
    assert store.keep("m", 2) and store.unkeep("m", 2) and all(_part_kept(store, 2))
    real_named, real_set_kept = parts.named_parts, ckptfs.Store._set_kept
    if order == "keep inside the reclaim":
        def named_then_kept(store_, model, *, kept_only=False):
            got = real_named(store_, model, kept_only=kept_only)
            if kept_only:
                monkeypatch.setattr(parts, "named_parts", real_named)
                assert store.keep("m", 2)  # after the reclaim's read of the milestones
            return got
        monkeypatch.setattr(parts, "named_parts", named_then_kept)
        parts.reclaim(store, "m", 3)
    else:
        def reclaim_then_set(self, model, step, kept, counter=None):
            if model == "m" and kept:
                monkeypatch.setattr(ckptfs.Store, "_set_kept", real_set_kept)
                parts.reclaim(store, "m", 3)  # all of it between the keep's check of the parts and its flag
            return real_set_kept(self, model, step, kept, counter)
        monkeypatch.setattr(ckptfs.Store, "_set_kept", reclaim_then_set)
        assert store.keep("m", 2)
    assert [v.step for v in store.versions("m") if v.kept] == [2]
    assert all(_part_kept(store, 2))
    store.close()
    run_ranks(_three_steps, 2, region, 4)  # 3 more saves: the unkept slots are reused
    with ckptfs.Store(region) as store:
        assert store.load("m", step=2)["w"].unique().tolist() == [2.0]


def test_open_version_of_a_multi_rank_step_pins_its_parts_and_loads_its_state(tmp_path):
    """store.open_version of a multi-rank step pinned its global record alone: `ckptfs status`
    listed it pinned while the ranks' next saves reused its parts' slots, and its load() gave
    the record ({"dcp": ...}), not the checkpoint."""
    region = _new_region(tmp_path)
    run_ranks(_three_steps, 2, region)
    with ckptfs.Store(region) as store:
        with store.open_version("m", 2) as v:
            got = v.load()
            assert set(got) == {"w"} and got["w"].unique().tolist() == [2.0]
            run_ranks(_three_steps, 2, region, 4)  # the ring turns over: step 2's parts stay pinned
            assert store.load("m", step=2)["w"].unique().tolist() == [2.0]
        with store.open_version("m", 2, whole=False) as raw:  # the record the mount and the parts read
            assert "dcp" in raw.load()


def _load_newest_into(rank, world, region, out):
    store = ckptfs.Store(region)
    into = {"w": torch.zeros(2, 100)}
    store.load("m", group=dist.group.WORLD, into=into, timeout_s=60)
    torch.save(into["w"], f"{out}.{rank}")
    store.close()


def test_a_multi_rank_load_whose_latest_record_is_damaged_falls_back_to_an_older_step(tmp_path):
    """A load with no step asked for, whose newest step's global record (its index) is damaged:
    every rank said "falling back to step 2" and then failed on step 3, where a load of one
    process loads step 2. Every rank now loads the newest step that every rank reads intact."""
    from ckptfs.testing.faults import Fault, fault_sites, inject

    region = _new_region(tmp_path)
    run_ranks(_three_steps, 2, region)
    site = next(s for s in fault_sites(region) if s.kind == "index" and s.model == "m" and s.step == 3)
    assert inject(region, Fault(site, "bit", site.offset + site.length // 2, 1, 2))
    with ckptfs.Store(region) as store:
        assert store.load("m")["w"].unique().tolist() == [2.0]  # one process: step 2
    out = str(tmp_path / "w")
    run_ranks(_load_newest_into, 2, region, out)
    for rank in range(2):
        assert torch.load(f"{out}.{rank}").unique().tolist() == [2.0]
