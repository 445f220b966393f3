"""Extra files saved with a version (``save(..., extra=...)``) and the Hugging Face directory
``hf/`` they enable: ``from_pretrained`` on a version, through a real mount and through export."""
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_model

import ckptfs
from ckptfs.cli import main as cli_main
from ckptfs.errors import MalformedInputError
from ckptfs.manifest import Manifest, encode_files
from ckptfs.views import files_for
from conftest_mount import mounted, requires_fuse


def tiny_gpt2(seed: int = 0):
    """A GPT-2 built from its config (no download): 2 layers, 32 wide, lm_head tied to wte.
    (transformers is imported here: it takes seconds, and only the slow tests need it.)"""
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=32)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture
def saved_gpt2(tmp_path):
    model = tiny_gpt2()
    path = str(tmp_path / "hf.region")
    with ckptfs.Store.create(path, size_bytes=64 << 20) as store, store.writer("gpt2") as w:
        optim = torch.optim.AdamW(model.parameters())
        w.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": 7}, step=7,
               extra={"config.json": model.config.to_dict(), "README.md": "tiny gpt2\n"}).result()
    return path, model


def saved_and_exported(tmp_path, name: str, weights: dict, config) -> tuple[str, object]:
    """(region, export directory) of ``{"model": weights}`` saved with ``config`` as its
    config.json extra, then exported whole by the CLI."""
    path = str(tmp_path / "r.region")
    with ckptfs.Store.create(path, size_bytes=64 << 20) as store, store.writer(name) as w:
        w.save({"model": weights}, step=1, extra={"config.json": config.to_dict()}).result()
    out = tmp_path / "export"
    with pytest.raises(SystemExit) as e:
        cli_main(["export", "--region", path, name, f"{out}/"])
    assert e.value.code == 0
    return path, out


def same_model(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    ids = torch.arange(16).reshape(2, 8)
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


@pytest.mark.slow
def test_a_version_lists_its_extra_files_and_an_hf_directory(saved_gpt2):
    path, model = saved_gpt2
    with ckptfs.Store(path) as store, store.open_version("gpt2") as v:
        files = files_for(v.manifest)
        assert dict(v.manifest.files)["README.md"] == "tiny gpt2\n"
        config = json.loads(dict(v.manifest.files)["config.json"])
    assert {"config.json", "README.md", "hf/config.json", "hf/README.md", "hf/model.safetensors"} <= set(files)
    assert config["n_embd"] == 32 and config["model_type"] == "gpt2"
    with ckptfs.Store(path) as store:
        assert store.load("gpt2")["step"] == 7  # the object itself is unchanged by its extras


@pytest.mark.slow
def test_from_pretrained_of_an_exported_version(saved_gpt2, tmp_path, capsys):
    import transformers

    path, model = saved_gpt2
    out = tmp_path / "export"
    with pytest.raises(SystemExit) as e:
        cli_main(["export", "--region", path, "gpt2", f"{out}/"])
    assert e.value.code == 0
    back = transformers.GPT2LMHeadModel.from_pretrained(out / "hf")
    same_model(model, back)
    assert back.lm_head.weight.data_ptr() == back.transformer.wte.weight.data_ptr()  # the tie is kept
    # hf/ holds the tied tensor under each name, as torch.save of the state dict does (for the
    # classes that have only one of them); the version's model.safetensors once, for load_model
    with safe_open(out / "hf" / "model.safetensors", "pt") as f:
        assert {"transformer.wte.weight", "lm_head.weight"} <= set(f.keys())
        assert json.loads(f.metadata()["ckptfs.tied"]) == {"lm_head.weight": "transformer.wte.weight"}
    fresh = tiny_gpt2(seed=1)
    missing, unexpected = load_model(fresh, out / "model.safetensors")  # strict: no unexpected key
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    same_model(model, fresh)


@pytest.mark.slow
def test_hf_holds_a_tied_tensor_under_each_name_for_the_base_model(tmp_path):
    """XLM-R's masked LM names the head's copy of its word embeddings first in its state dict:
    hf/ held the tensor under that name alone, and AutoModel.from_pretrained (the encoder, to
    fine-tune for classification) started from random embeddings, with only a load report to
    say so. An import of hf/ ties the names again (ckptfs.tied)."""
    import transformers

    from ckptfs import importer

    torch.manual_seed(0)
    mlm = transformers.XLMRobertaForMaskedLM(transformers.XLMRobertaConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100,
        max_position_embeddings=70))
    state = mlm.state_dict()
    names = [k for k in state if k in ("lm_head.decoder.weight", "roberta.embeddings.word_embeddings.weight")]
    assert names[0] == "lm_head.decoder.weight"  # the head's name first
    path, out = saved_and_exported(tmp_path, "xlmr", state, mlm.config)
    encoder = transformers.AutoModel.from_pretrained(out / "hf")
    assert torch.equal(encoder.embeddings.word_embeddings.weight, mlm.roberta.embeddings.word_embeddings.weight)
    with ckptfs.Store(path) as store:
        importer.import_file(store, "back", str(out / "hf"))
        back = store.load("back")  # flat, as an HF directory holds it
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert back[names[0]].data_ptr() == back[names[1]].data_ptr()  # one tensor, as saved


@pytest.mark.fuse
@pytest.mark.slow
@requires_fuse
def test_auto_model_from_pretrained_on_the_mount(saved_gpt2, tmp_path):
    import transformers

    path, model = saved_gpt2
    with mounted(path, str(tmp_path / "mnt")) as m:
        hf_dir = os.path.join(m.path, "gpt2", "latest", "hf")
        assert sorted(os.listdir(hf_dir)) == ["README.md", "config.json", "model.safetensors"]
        back = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
        same_model(model, back)


def test_extra_is_checked_when_save_is_called(tmp_path):
    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as store, store.writer("m") as w:
        for bad, error in [({"../config.json": "x"}, ValueError), ({".hidden": "x"}, ValueError),
                           ({"a/b": "x"}, ValueError), ({"x.json": object()}, TypeError),
                           ({"x.json": float("nan")}, TypeError), ({1: "x"}, TypeError), (["x"], TypeError)]:
            with pytest.raises(error):
                w.save({"w": torch.ones(1)}, step=1, extra=bad, async_snapshot=True)
        with pytest.raises(ValueError, match=r"at most 16777216 \(16.0 MiB\)"):
            w.save({"w": torch.ones(1)}, step=1, extra={"big.txt": "x" * (17 << 20)})
        # counted as the index holds it: 3 MiB of NULs are 18 MiB of JSON escapes there
        with pytest.raises(ValueError, match=rf"extra files take {6 * (3 << 20) + 2} bytes in the version's index "
                                             r"\(its ASCII JSON text: a character past ASCII takes 6, past U\+FFFF 12\); at most "
                                             r"16777216 \(16.0 MiB\)"):
            w.save({"w": torch.ones(1)}, step=1, extra={"nul.txt": "\0" * (3 << 20)})
        # exactly over by the 2 quotes: it said "take 16.0 MiB ...; at most 16.0 MiB"
        with pytest.raises(ValueError, match=r"take 16777218 bytes"):
            w.save({"w": torch.ones(1)}, step=1, extra={"edge.txt": "x" * (16 << 20)})
        # a name the views take: it hid their file (metadata.json) or their directory (hf/) in silence
        for own in ("metadata.json", "checkpoint.pt", "state.safetensors", "hf", "model.safetensors"):
            with pytest.raises(ValueError, match=rf"extra: '{own}' is a name ckptfs gives its own files"):
                w.save({"w": torch.ones(1)}, step=1, extra={"config.json": "{}", own: "x"}, async_snapshot=True)
        # text UTF-8 cannot encode (a lone surrogate): stored, then unreadable in the mount
        # (from_pretrained's json.load) and refused by the import of its export
        with pytest.raises(ValueError, match=r"extra\['s.txt'\] is not valid text: '\\udcff' at character 1 is a "
                                             r"surrogate code point"):
            w.save({"w": torch.ones(1)}, step=1, extra={"s.txt": "x\udcff"})
        # in a JSON value it is written as JSON's escape, which reads back to it
        assert json.loads(dict(encode_files({"config.json": {"name": "x\ud800"}}))["config.json"]) == {"name": "x\ud800"}
        # a multi-rank version's records: one alone made this version read as one, unreadable
        for record in ("dcp-metadata.json", "dcp-parts.json"):
            with pytest.raises(ValueError, match=rf"extra: '{record}' is a name ckptfs gives the records of a "
                                                 "checkpoint of many ranks"):
                w.save({"w": torch.ones(1)}, step=1, extra={record: "{}"})
        w.save({"w": torch.ones(1)}, step=1).result()  # nothing of the refusals was written
    with ckptfs.Store(str(tmp_path / "r.region")) as store:
        assert [v.step for v in store.versions("m")] == [1]


@pytest.mark.slow
def test_hf_names_a_wrapped_models_weights_as_the_model_itself(tmp_path):
    """A state dict of a compiled and DDP-wrapped model (``module._orig_mod.transformer...``):
    hf/ names its weights as save_pretrained of the model itself does, so that from_pretrained
    loads them (with the prefix it found none and started from random weights, a load report
    its only word); the version's own files keep the names as saved."""
    import transformers

    model = tiny_gpt2()
    state = {"module._orig_mod." + k: v for k, v in model.state_dict().items()}
    _, out = saved_and_exported(tmp_path, "gpt2", state, model.config)
    same_model(model, transformers.GPT2LMHeadModel.from_pretrained(out / "hf"))
    with safe_open(out / "model.safetensors", "pt") as f:
        assert all(k.startswith("module._orig_mod.") for k in f.keys())


def test_hf_shows_no_weight_index_of_the_extras(tmp_path):
    """The extras of a save_pretrained directory, its weight index among them: hf/ holds its own
    model.safetensors and not the index, which named shards hf/ does not have (accelerate's
    loader, which prefers an index, went after them); the version's root keeps the file."""
    index = json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors"}})
    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as store:
        with store.writer("m") as w:
            w.save({"model": {"w": torch.ones(2)}}, step=1,
                   extra={"config.json": {"n": 1}, "model.safetensors.index.json": index}).result()
        with store.open_version("m") as v:
            files = files_for(v.manifest)
    assert "model.safetensors.index.json" in files and "hf/model.safetensors.index.json" not in files
    assert {"hf/config.json", "hf/model.safetensors"} <= set(files)


def test_an_import_of_hf_gives_back_the_object_without_a_model_key(tmp_path, capsys):
    """hf/model.safetensors of an object without a ``model`` key is the whole state: with its
    tied tensor under each name it kept its skeleton, so that an import of it rebuilds the
    nesting, the plain values and the tie (without it, they came back flat, in silence)."""
    from ckptfs import importer

    path = str(tmp_path / "r.region")
    w = torch.arange(3.0)
    with ckptfs.Store.create(path, size_bytes=64 << 20) as store, store.writer("m") as wr:
        wr.save({"enc": {"w": w, "tied": w}, "step": 3}, step=1, extra={"config.json": {"n": 1}}).result()
    with pytest.raises(SystemExit) as e:
        cli_main(["export", "--region", path, "m", "--file", "hf/model.safetensors", str(tmp_path / "hf.safetensors")])
    assert e.value.code == 0
    with safe_open(tmp_path / "hf.safetensors", "pt") as f:
        assert list(f.keys()) == ["enc.tied", "enc.w"] and "ckptfs.skeleton" in f.metadata()
    with ckptfs.Store(path) as store:
        importer.import_file(store, "back", str(tmp_path / "hf.safetensors"))
        back = store.load("back")
    assert back["step"] == 3 and torch.equal(back["enc"]["w"], w)
    assert back["enc"]["w"].data_ptr() == back["enc"]["tied"].data_ptr()


def test_manifest_files_round_trip_and_are_absent_from_the_bytes_when_none():
    base = dict(model="m", step=1, counter=2, time_ns=3, tensors=(), skeleton={"none": None}, data_bytes=0)
    plain = Manifest(**base)
    assert b'"files"' not in plain.encode()  # manifests without files keep their bytes
    files = encode_files({"config.json": {"a": [1, 2]}, "notes.txt": "h\u00e9"})
    assert files == (("config.json", '{\n  "a": [\n    1,\n    2\n  ]\n}\n'), ("notes.txt", "h\u00e9"))
    with_files = Manifest(**base, files=files)
    raw = with_files.encode()
    assert raw.startswith(b'{"format":1,"model":"m","step":1,"counter":2,"time_ns":3,"data_bytes":0,'
                          b'"files":{"config.json":"{\\n  \\"a\\": [\\n    1,\\n    2\\n  ]\\n}\\n","notes.txt":"h\\u00e9"},'
                          b'"tensors":[],"skeleton":{"none":null}}')
    assert len(raw) == with_files.encoded_length()
    assert Manifest.decode(raw) == with_files
    for bad in (b'"files":[]', b'"files":{"a/b":"x"}', b'"files":{"x":1}', b'"files":{"":"x"}'):
        doc = raw.replace(raw[raw.index(b'"files"'):raw.index(b',"tensors"')], bad)
        with pytest.raises(MalformedInputError):
            Manifest.decode(doc)
