"""Media-fault injection: flipped bits and zeroed blocks at rest, and what ckptfs must make of them.

:func:`make_fault_region` writes a small region with two models and known content;
:func:`fault_sites` lists where its bytes are and what each byte range means; :func:`inject`
damages a copy; :func:`check_fault` opens the damaged copy with the real code and checks the
contract of docs/PERSISTENCE.md ("Media faults"):

* nothing ever loads to wrong bytes: ``load`` of a version returns exactly what was saved, or
  raises CorruptionError (or NotFoundError for a version whose header is gone);
* ``verify`` reports the damage -- the version and, for tensor bytes, the tensor names -- and
  reports nothing when the fault hit bytes that carry no meaning (padding);
* damage to one version never hides another: every other version still loads;
* ``load(model)`` falls back to the newest intact version when the latest is damaged;
* the model still takes new saves, and the new save becomes latest.

:func:`run_campaign` draws random faults over all sites (tools/reliability.py, tests/test_faults.py).
"""
from __future__ import annotations

import logging
import os
import random
import tempfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ckptfs.errors import CorruptionError, NotFoundError, RegionFormatError
from ckptfs.region.format import (COUNTER_WORD_OFFSET, ENTRY_BYTES, ENTRY_COPY_OFFSET, HEADER_COPY_OFFSETS,
                                  LATEST_WORD_OFFSET, PAGE_BYTES, SUPERBLOCK_BYTES, ModelEntry, SlotHeader,
                                  Superblock, backup_superblock_offset)
from ckptfs.store import Store
from ckptfs.testing.crashcheck import same
from ckptfs.testing.recording import copy_sparse

MODELS = {"m": (10, 20, 30, 40), "other": (1, 2)}
SUPERBLOCK_FIELDS = Superblock._FMT.size      # bytes of the superblock that mean something
HEADER_FIELDS = SlotHeader._FMT.size          # bytes of a slot header that mean something
ENTRY_COPY_END = ENTRY_COPY_OFFSET + ModelEntry._FMT.size  # magic .. CRC of a copy of a model table entry
MIRRORED = ("entry", "entry-mirror", "header", "header-mirror")  # one of two copies: repaired from the other


def fault_state(model: str, step: int):
    g = torch.Generator().manual_seed(zlib.crc32(f"fault:{model}:{step}".encode()))
    return {
        "model": OrderedDict(w=torch.randn(3000, generator=g), b=torch.randn(100, generator=g).half(),
                             ids=torch.randint(0, 1 << 40, (5, 3), generator=g)),
        "optim": {"step": torch.tensor(float(step)), "lr": 0.5 / step, "betas": (0.9, 0.99)},
        "step": step,
    }


def make_fault_region(path: str) -> None:
    """Two models: ``m`` with four versions (one slot left empty), ``other`` with two."""
    with Store.create(path, size_bytes=64 << 20) as store:
        for model, steps in MODELS.items():
            with store.writer(model, max_inflight=1, slots=len(steps) + 1, chunk_bytes=16 << 10) as w:
                for s in steps:
                    w.save(fault_state(model, s), s).result()


@dataclass(frozen=True)
class Site:
    """A byte range of the region and what lives there."""

    kind: str          # tensor, tensor-pad, index, index-pad, header, header-mirror, header-pad, entry,
    #                    entry-mirror, entry-pad, latest-word, counter-word, superblock, superblock-pad, backup
    offset: int
    length: int
    model: str | None = None
    step: int | None = None
    tensor: str | None = None
    slot: int | None = None


def fault_sites(path: str) -> list[Site]:
    sites = []
    with Store(path, writable=False) as store:
        region = store.region
        sites.append(Site("superblock", 0, SUPERBLOCK_FIELDS))
        sites.append(Site("superblock-pad", SUPERBLOCK_FIELDS, SUPERBLOCK_BYTES - SUPERBLOCK_FIELDS))
        sites.append(Site("backup", backup_superblock_offset(region.backend.size_bytes), SUPERBLOCK_FIELDS))
        for entry in region.entries():
            copy_a, copy_b = region.entry_copy_offsets(entry.index)
            base = copy_a - ENTRY_COPY_OFFSET  # the table's entry: the words, then copy A
            sites.append(Site("latest-word", base + LATEST_WORD_OFFSET, 8, entry.name))
            sites.append(Site("counter-word", base + COUNTER_WORD_OFFSET, 8, entry.name))
            for kind, at in (("entry", copy_a), ("entry-mirror", copy_b)):
                sites.append(Site(kind, at, ENTRY_COPY_END - ENTRY_COPY_OFFSET, entry.name))
                sites.append(Site("entry-pad", at - ENTRY_COPY_OFFSET + ENTRY_COPY_END, ENTRY_BYTES - ENTRY_COPY_END,
                                  entry.name))
            for v in region.committed(entry):
                h, slot_base = v.header, entry.slot_offset(v.slot)
                step = h.step
                kw = dict(model=entry.name, step=step, slot=v.slot)
                for kind, at in zip(("header", "header-mirror"), HEADER_COPY_OFFSETS):
                    sites.append(Site(kind, slot_base + at, HEADER_FIELDS, **kw))
                    sites.append(Site("header-pad", slot_base + at + HEADER_FIELDS, PAGE_BYTES - HEADER_FIELDS, **kw))
                sites.append(Site("index", slot_base + h.manifest_offset, h.manifest_bytes, **kw))
                pad = h.data_offset - h.manifest_offset - h.manifest_bytes
                sites.append(Site("index-pad", slot_base + h.manifest_offset + h.manifest_bytes, pad, **kw))
                manifest = region.read_manifest(v)
                end = 0
                for r in manifest.tensors:
                    if r.offset > end:
                        sites.append(Site("tensor-pad", v.data_base + end, r.offset - end, **kw))
                    if r.nbytes:
                        sites.append(Site("tensor", v.data_base + r.offset, r.nbytes, tensor=r.name, **kw))
                    end = r.offset + r.nbytes
    return sites


@dataclass(frozen=True)
class Fault:
    site: Site
    how: str       # "bit" or "zero"
    offset: int    # absolute
    length: int    # bytes changed (1 for a bit flip)
    bit: int = 0

    def describe(self) -> str:
        s = self.site
        what = f"{s.kind}" + (f" of {s.model}" if s.model else "") + (f" step {s.step}" if s.step is not None else "")
        what += f" tensor {s.tensor}" if s.tensor else ""
        how = f"bit {self.bit} flipped" if self.how == "bit" else f"{self.length} bytes zeroed"
        return f"{what} at {self.offset}: {how}"


def pick_fault(site: Site, rng: random.Random, how: str | None = None) -> Fault:
    how = how or rng.choice(("bit", "bit", "zero"))
    if how == "bit":
        return Fault(site, "bit", site.offset + rng.randrange(site.length), 1, rng.randrange(8))
    # a zeroed block: a 512-byte sector (a whole 4 KiB page for headers and superblocks, the way
    # a device loses them), cut to the site so that the expectation stays precise
    if site.kind in ("header", "header-mirror", "superblock", "backup"):
        return Fault(site, "zero", site.offset, PAGE_BYTES)  # the whole page, padding included
    if site.kind in ("entry", "entry-mirror", "entry-pad", "latest-word", "counter-word"):
        # a model table entry (1 KiB, two sectors): lost as a whole, or only the site's bytes
        if site.kind in ("entry", "entry-mirror") or rng.random() < 0.5:
            return Fault(site, "zero", site.offset - site.offset % ENTRY_BYTES, ENTRY_BYTES)
        return Fault(site, "zero", site.offset, site.length)
    block = 512
    start = max(site.offset, (site.offset + rng.randrange(site.length)) // block * block)
    return Fault(site, "zero", start, min(block, site.offset + site.length - start))


def inject(path: str, fault: Fault) -> bool:
    """Apply ``fault`` to the file; False if it changed nothing (the bytes were already that)."""
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, fault.length, fault.offset)
        if fault.how == "bit":
            new = bytes([old[0] ^ (1 << fault.bit)])
        else:
            new = bytes(fault.length)
        os.pwrite(fd, new, fault.offset)
        os.fsync(fd)
        return new != old
    finally:
        os.close(fd)


@dataclass
class FaultOutcome:
    detected: bool = False       # verify (or opening) reported it
    harmless: bool = False       # the bytes mean nothing: nothing must be reported
    undetectable: bool = False   # damage that loses data without a report (the target: never)
    repaired: bool = False       # one copy of a mirrored structure: reported, then rewritten from the other
    failures: list = field(default_factory=list)


def _expectation(fault: Fault) -> tuple[str, set]:
    """('harmless' | 'version' | 'mirror' | 'region' | 'pointer' | ..., the (model, step) made unreadable)."""
    s = fault.site
    if fault.how == "zero" and fault.length == ENTRY_BYTES:
        # a whole entry of the table (its words and copy A) or of the mirror (copy B): the other
        # copy holds the model; a zeroed latest word reads as "none yet" (newest intact is latest)
        return "mirror", set()
    if s.kind in MIRRORED:
        return "mirror", set()
    if s.kind in ("tensor-pad", "index-pad", "header-pad", "entry-pad", "superblock-pad"):
        return "harmless", set()
    if s.kind == "counter-word":
        # a counter only has to grow: writers re-raise it past every header when they open; it
        # breaks only when it no longer fits a latest pointer (bits 48..63)
        bit = (fault.offset - s.offset) * 8 + fault.bit
        return ("model-save" if fault.how == "bit" and bit >= 48 else "harmless"), set()
    if s.kind in ("superblock", "backup"):
        return "region", set()
    if s.kind == "latest-word":
        return ("pointer" if fault.how == "bit" else "pointer-zero"), set()
    return "version", {(s.model, s.step)}


def check_fault(path: str, fault: Fault) -> FaultOutcome:
    """Open the damaged region with the real code and check the contract (see the module doc)."""
    out = FaultOutcome()
    kind, unreadable = _expectation(fault)
    out.harmless = kind == "harmless"
    s = fault.site
    fail = out.failures.append
    logging.getLogger("ckptfs").disabled = True
    try:
        try:
            store = Store(path)
        except RegionFormatError as e:
            fail(f"the region no longer opens: {e}")
            return out
        with store:
            problems = store.verify()
            text = [str(p) for p in problems]
            if kind == "harmless":
                if problems:
                    fail(f"a fault in bytes that mean nothing was reported: {text}")
            elif kind == "version":
                if s.kind == "tensor":
                    hit = [p for p in problems if p.model == s.model and p.step == s.step and p.tensor == s.tensor]
                else:
                    hit = [p for p in problems if p.model == s.model and p.step == s.step]
                out.detected = bool(hit)
                if not hit:
                    fail(f"verify did not report it (it said {text})")
                strays = [p for p in problems if p.model != s.model or (p.step not in (s.step, -1))]
                if strays:
                    fail(f"verify blamed intact versions: {[str(p) for p in strays]}")
            elif kind == "mirror":
                hit = [p for p in problems if p.model == s.model and "copy" in p.message
                       and (s.step is None or p.step == s.step)]
                out.detected = bool(hit)
                if not hit:
                    fail(f"verify did not report the damaged copy (it said {text})")
            elif kind == "region":
                out.detected = any("superblock" in p.message for p in problems)
                if not out.detected:
                    fail(f"verify did not report the damaged superblock (it said {text})")
            elif kind == "pointer":
                out.detected = any(p.model == s.model and "latest pointer" in p.message for p in problems)
                if not out.detected:
                    fail(f"verify did not report the damaged latest pointer (it said {text})")
            elif kind == "pointer-zero":
                # an empty pointer is what a crash before the first publish leaves: the newest
                # intact version is taken as latest, nothing is lost, nothing to report
                out.harmless = True
            elif kind == "model-save":
                out.detected = any(p.model == s.model and "counter" in p.message for p in problems)
                if not out.detected:
                    fail(f"verify did not report the damaged counter (it said {text})")

            # never wrong bytes; nothing else hidden
            for model, steps in MODELS.items():
                for step in steps:
                    try:
                        got = store.load(model, step)
                    except (CorruptionError, NotFoundError) as e:
                        if (model, step) not in unreadable:
                            fail(f"{model} step {step} no longer loads: {type(e).__name__}: {e}")
                        continue
                    diff = same(fault_state(model, step), got)
                    if diff:
                        fail(f"WRONG BYTES: {model} step {step} loaded without error but {diff}")
                    elif (model, step) in unreadable:
                        fail(f"{model} step {step} loaded, but its damage should have been caught")
                intact = [st for st in steps if (model, st) not in unreadable]
                try:
                    got = store.load(model)
                    diff = same(fault_state(model, intact[-1]), got) if intact else "loaded something"
                    if diff:
                        fail(f"load({model!r}) did not give the newest intact version {intact[-1:]}: {diff}")
                except (CorruptionError, NotFoundError) as e:
                    if intact:
                        fail(f"load({model!r}) raised {type(e).__name__} with intact versions left: {e}")
            # the model still takes saves, and the new one is latest
            target = s.model or "m"
            try:
                with store.writer(target, max_inflight=1, chunk_bytes=16 << 10) as w:
                    w.save(fault_state(target, 99), 99).result()
                if kind == "model-save":
                    fail("a save with a counter word past any pointer did not refuse")
                diff = same(fault_state(target, 99), store.load(target))
                if diff:
                    fail(f"a new save after the fault did not load back as latest: {diff}")
            except CorruptionError as e:
                if kind != "model-save":
                    fail(f"a new save after the fault failed: {e}")
            if kind == "mirror":
                # the writer that opened the model rewrote the damaged copy from the intact one
                left = [str(p) for p in store.verify() if "copy" in p.message]
                out.repaired = not left
                if left:
                    fail(f"the damaged copy was not repaired by the model's next writer: {left}")
    finally:
        logging.getLogger("ckptfs").disabled = False
    return out


@dataclass
class CampaignReport:
    injected: int = 0
    detected: int = 0
    harmless: int = 0
    undetectable: int = 0
    repaired: int = 0
    by_kind: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)


def run_campaign(n: int, seed: int = 0, workdir: str | None = None) -> CampaignReport:
    """``n`` random faults, each in a fresh copy of the same region."""
    rng = random.Random(seed)
    report = CampaignReport()
    with tempfile.TemporaryDirectory(dir=workdir) as d:
        pristine = os.path.join(d, "pristine.region")
        make_fault_region(pristine)
        sites = fault_sites(pristine)
        # weigh the kinds evenly, not by their byte counts
        kinds: dict[str, list[Site]] = {}
        for site in sites:
            kinds.setdefault(site.kind, []).append(site)
        victim = os.path.join(d, "damaged.region")
        for _ in range(n):
            site = rng.choice(kinds[rng.choice(sorted(kinds))])
            fault = pick_fault(site, rng)
            copy_sparse(pristine, victim)
            if not inject(victim, fault):
                continue
            out = check_fault(victim, fault)
            report.injected += 1
            report.detected += out.detected
            report.harmless += out.harmless
            report.undetectable += out.undetectable
            report.repaired += out.repaired
            report.by_kind[site.kind] = report.by_kind.get(site.kind, 0) + 1
            for f in out.failures:
                report.failures.append(f"{fault.describe()}: {f}")
    return report
