"""The decision cache: every key field matters, stale formats are ignored, writers race safely, select uses it."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp

import pytest

from cutlass_byoc import decisions as dec_mod
from cutlass_byoc.decisions import (
    DECISIONS_FORMAT, Decision, DecisionKey, DecisionStore, GpuInfo, lookup_decision, record_decision,
)
from cutlass_byoc.heuristics import default_launch
from cutlass_byoc.problem import Conv2dProblem, Epilogue
from cutlass_byoc.types import Activation, DType, SourceKind

GPU = GpuInfo("NVIDIA H200", 90)
PROBLEM = Conv2dProblem.make("fprop", 32, 64, 56, 56, 64, 3, padding=1)


@pytest.fixture
def store(tmp_cache):
    return DecisionStore(tmp_cache.root)


@pytest.fixture(scope="module")
def launch():
    return default_launch(PROBLEM)


def test_roundtrip(store, launch):
    record_decision(PROBLEM, launch, 12.5, gpu=GPU, store=store, candidates_timed=7, runner_up="x", runner_up_us=13.0)
    assert lookup_decision(PROBLEM, gpu=GPU, store=store) == launch
    d = dec_mod.lookup(PROBLEM, gpu=GPU, store=store)
    assert d.time_us == 12.5 and d.candidates_timed == 7 and d.runner_up == "x"
    assert lookup_decision(PROBLEM, gpu=GPU, store=DecisionStore(store.root)) == launch  # another process's view


PROBLEM_CHANGES = [
    dict(n=16), dict(h=57), dict(w=55), dict(c=128), dict(k=32), dict(r=1, s=1, pad_h=0, pad_w=0), dict(s=1, pad_w=0),
    dict(pad_h=2), dict(pad_w=0), dict(stride_h=2), dict(stride_w=2), dict(dilation_h=2), dict(dilation_w=2),
    dict(element_a=DType.BF16, element_b=DType.BF16, element_out=DType.BF16), dict(element_out=DType.F32),
    dict(element_acc=DType.F16), dict(epilogue=Epilogue(Activation.RELU)), dict(epilogue=Epilogue(source=SourceKind.BIAS)),
]


@pytest.mark.parametrize("change", PROBLEM_CHANGES, ids=lambda c: ",".join(c))
def test_changing_a_problem_field_misses(store, launch, change):
    record_decision(PROBLEM, launch, 10.0, gpu=GPU, store=store)
    other = PROBLEM.replace(**change)
    assert DecisionKey.for_problem(other, GPU).digest != DecisionKey.for_problem(PROBLEM, GPU).digest
    assert lookup_decision(other, gpu=GPU, store=store) is None
    assert lookup_decision(PROBLEM, gpu=GPU, store=store) == launch


def test_kind_changes_the_key():
    a = DecisionKey.for_problem(PROBLEM, GPU).digest
    b = DecisionKey.for_problem(PROBLEM.replace(kind="dgrad"), GPU).digest
    assert a != b


@pytest.mark.parametrize("field,value", [
    ("gpu_name", "NVIDIA H100 80GB HBM3"), ("gpu_arch", 100), ("cutlass_version", "4.3.0 (wheel 4.3.0.0)"),
    ("template_hash", "0" * 64), ("format", DECISIONS_FORMAT + 1),
])
def test_changing_an_environment_field_misses(store, launch, field, value):
    record_decision(PROBLEM, launch, 10.0, gpu=GPU, store=store)
    key = DecisionKey.for_problem(PROBLEM, GPU)
    other = dataclasses.replace(key, **{field: value})
    assert other.digest != key.digest
    assert store.lookup(other) is None
    assert store.lookup(key) is not None


def test_template_and_cutlass_version_come_from_the_environment(store, launch, monkeypatch):
    record_decision(PROBLEM, launch, 10.0, gpu=GPU, store=store)
    monkeypatch.setattr(dec_mod, "template_hash", lambda depthwise=False: "f" * 64)
    assert lookup_decision(PROBLEM, gpu=GPU, store=store) is None
    monkeypatch.undo()
    monkeypatch.setattr(dec_mod, "_cutlass_version", lambda: "9.9.9")
    assert lookup_decision(PROBLEM, gpu=GPU, store=store) is None


def test_template_hash_covers_the_templates():
    h = dec_mod.template_hash()
    assert len(h) == 64 and h == dec_mod.template_hash()
    assert dec_mod.template_hash(True) != h


def test_a_template_edit_invalidates_the_decisions_of_its_own_family_only(monkeypatch, tmp_path):
    import importlib.resources as resources  # noqa: PLC0415

    from cutlass_byoc.profiler.plan import enumerate_kernels  # noqa: PLC0415
    from cutlass_byoc.types import KernelFamily  # noqa: PLC0415

    dw = Conv2dProblem.make("wgrad", 8, 32, 14, 14, 32, 3, padding=1, groups=32)
    assert {k.family for k in enumerate_kernels(dw, 90)[0]} == {KernelFamily.DEPTHWISE_DIRECT}
    assert KernelFamily.DEPTHWISE_DIRECT not in {k.family for k in enumerate_kernels(PROBLEM, 90)[0]}
    before = (dec_mod.template_hash(False), dec_mod.template_hash(True))
    src = resources.files("cutlass_byoc.templates")
    for entry in src.iterdir():
        if entry.name.endswith(".j2"):
            (tmp_path / entry.name).write_bytes(entry.read_bytes())

    def rehash(edit: str) -> tuple[str, str]:
        (tmp_path / edit).write_text((tmp_path / edit).read_text() + "// edited\n")
        dec_mod.template_hash.cache_clear()
        monkeypatch.setattr(resources, "files", lambda pkg: tmp_path)
        try:
            return dec_mod.template_hash(False), dec_mod.template_hash(True)
        finally:
            monkeypatch.undo()
            dec_mod.template_hash.cache_clear()

    dense, depthwise = rehash(dec_mod.DEPTHWISE_TEMPLATE)
    assert dense == before[0] and depthwise != before[1]
    dense, depthwise = rehash("conv2d_sm80_implicit_gemm.cu.j2")
    assert dense != before[0] and depthwise != before[1]  # (the depthwise edit above is still in tmp_path)
    dense2, depthwise2 = rehash("conv2d_sm90_tma_wgmma.cu.j2")
    assert dense2 != dense and depthwise2 == depthwise
    dense3, depthwise3 = rehash("conv2d_api.h.j2")  # the shared include: both
    assert dense3 != dense2 and depthwise3 != depthwise2
    dense4, depthwise4 = rehash("launch_memo.h.j2")  # included by the dense families only
    assert dense4 != dense3 and depthwise4 == depthwise3
    dense5, depthwise5 = rehash("dependent_launch.j2")  # included by sm90 and depthwise
    assert dense5 != dense4 and depthwise5 != depthwise4
    (tmp_path / "unused.j2").write_text("{# no template includes this #}\n")
    assert rehash("unused.j2") == (dense5, depthwise5)


def test_stale_format_and_garbage_are_ignored(store, launch):
    record_decision(PROBLEM, launch, 10.0, gpu=GPU, store=store)
    key = DecisionKey.for_problem(PROBLEM, GPU)
    path = store.path(key.digest)
    d = json.loads(path.read_text())
    d["format"] = DECISIONS_FORMAT - 1
    path.write_text(json.dumps(d))
    assert DecisionStore(store.root).lookup(key) is None
    path.write_text("{not json")
    assert DecisionStore(store.root).lookup(key) is None
    # a file whose fields do not match its key (hand-edited) is not trusted
    other = Decision(DecisionKey.for_problem(PROBLEM.replace(n=8), GPU), launch, 1.0)
    path.write_text(json.dumps(other.to_dict()))
    assert DecisionStore(store.root).lookup(key) is None


def test_no_gpu_means_no_decision(store, launch, monkeypatch):
    monkeypatch.setattr(dec_mod, "current_gpu", lambda: None)
    assert lookup_decision(PROBLEM, store=store) is None
    with pytest.raises(RuntimeError, match="no CUDA device"):
        record_decision(PROBLEM, launch, 1.0, store=store)


def test_record_refuses_a_launch_that_cannot_compute_the_problem(store, launch):
    with pytest.raises(ValueError, match="cannot compute"):
        record_decision(PROBLEM.replace(c=7), launch, 1.0, gpu=GPU, store=store)


def _writer(root: str, worker: int, n: int) -> None:
    st = DecisionStore(root)
    launch = default_launch(PROBLEM)
    for i in range(n):
        record_decision(PROBLEM, launch, float(worker * 1000 + i + 1), gpu=GPU, store=st)  # one shared key
        p = PROBLEM.replace(n=100 + worker * n + i)  # and keys of its own
        record_decision(p, default_launch(p), 1.0, gpu=GPU, store=st)


def _reader(root: str, n: int, q) -> None:
    st = DecisionStore(root)
    key = DecisionKey.for_problem(PROBLEM, GPU)
    bad = 0
    for _ in range(n):
        try:
            raw = st.path(key.digest).read_text()
        except FileNotFoundError:
            continue
        try:
            json.loads(raw)
        except ValueError:
            bad += 1
    q.put(bad)


def test_concurrent_writers(tmp_cache):
    root = str(tmp_cache.root)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(root, w, 15)) for w in range(4)]
    procs.append(ctx.Process(target=_reader, args=(root, 400, q)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert q.get(timeout=5) == 0  # a reader never saw a torn file
    st = DecisionStore(root)
    d = dec_mod.lookup(PROBLEM, gpu=GPU, store=st)
    assert d is not None and d.time_us % 1000 in set(range(1, 16))  # one writer's decision, whole
    assert sum(1 for _ in st.iter_files()) == 1 + 4 * 15
    assert all(d is not None for _, d, _ in st.entries())
    assert not list(st.dir.glob("*/*.tmp"))  # no leftovers


def test_select_uses_the_decision(tmp_cache, monkeypatch):
    from cutlass_byoc.select import SelectMode, choose

    monkeypatch.setattr(dec_mod, "current_gpu", lambda: GPU)
    monkeypatch.setattr("cutlass_byoc.decisions.current_gpu", lambda: GPU)
    default = default_launch(PROBLEM)
    assert choose(PROBLEM) == default  # nothing recorded: the model's pick
    other = [l for _, l in __import__("cutlass_byoc.heuristics", fromlist=["rank"]).rank(
        PROBLEM, __import__("cutlass_byoc.candidates", fromlist=["x"]).sm80_candidates(PROBLEM)) if l != default][0]
    record_decision(PROBLEM, other, 3.0, gpu=GPU)
    assert choose(PROBLEM) == other
    assert choose(PROBLEM, SelectMode.HEURISTIC) == default


def test_choice_is_remembered_until_a_decision_is_written_or_cleared(tmp_cache):
    from cutlass_byoc import decisions, select
    from cutlass_byoc.problem import Conv2dProblem as _P

    p = _P.make("fprop", 8, 64, 28, 28, 64, 3, padding=1)
    first = select.choose(p)
    assert first is not None and select.choose(p) is first  # remembered: no re-ranking per call
    keys = len(select._chosen)
    g = decisions.generation()
    decisions.DecisionStore(tmp_cache.root).clear()
    assert decisions.generation() == g + 1
    assert select.choose(p) == first and len(select._chosen) == keys + 1  # asked again after the write


def test_decisions_made_elsewhere_are_named_not_used(store, launch):
    """A cache copied from another GPU, or holding decisions from other templates: lookup finds nothing for this
    GPU, and decisions_elsewhere says which problems have decisions only elsewhere, grouped by what differs."""
    h100 = GpuInfo("NVIDIA H100 80GB HBM3", 90)
    other = PROBLEM.replace(c=128)
    record_decision(PROBLEM, launch, 10.0, gpu=GPU, store=store)
    assert lookup_decision(PROBLEM, gpu=h100, store=store) is None
    elsewhere = dec_mod.decisions_elsewhere([PROBLEM, other], gpu=h100, store=store)
    assert elsewhere == {"tuned on NVIDIA H200 (sm_90)": [PROBLEM]}
    # an old template set: same GPU, another template hash
    key = dec_mod.DecisionKey.for_problem(other, h100)
    old = dec_mod.Decision(dataclasses.replace(key, template_hash="0" * 64), default_launch(other), 5.0)
    store.record(old)
    elsewhere = dec_mod.decisions_elsewhere([PROBLEM, other], gpu=h100, store=store)
    assert elsewhere == {"tuned on NVIDIA H200 (sm_90)": [PROBLEM], "other kernel templates": [other]}
    # decided here: nothing is reported for it
    record_decision(PROBLEM, launch, 9.0, gpu=h100, store=store)
    assert dec_mod.decisions_elsewhere([PROBLEM], gpu=h100, store=store) == {}
