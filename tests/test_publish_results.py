"""scripts/publish_results.py's multi-GPU section (issue 15) from tiny synthetic device outputs: CPU only."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "publish_results.py"


@pytest.fixture(scope="module")
def pr():
    spec = importlib.util.spec_from_file_location("publish_results", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tune_report(devices, timing_s, compiled=0, busy=None):
    per_gpu = [{"device": d, "gpu": "GPU X (sm_90)", "problems": 2, "busy_s": b, "restarts": 0}
               for d, b in zip(devices, busy or [])]
    scaling = None
    if len(per_gpu) > 1:
        s = sum(busy)
        scaling = {"gpus": len(per_gpu), "timing_s": timing_s, "busy_s": list(busy), "busy_s_sum": s,
                   "busy_s_max": max(busy), "balance": s / max(busy), "outside_busy_s": timing_s - max(busy),
                   "problems_per_gpu": [2] * len(per_gpu)}
    return {"timed": True, "kernels_planned": 4, "kernels_compiled": compiled, "kernels_failed": 0,
            "launches_timed": 12, "compile_s": 30.0 if compiled else 0.5, "timing_s": timing_s,
            "total_s": timing_s + (30.0 if compiled else 0.5), "gpu": "GPU X (sm_90)", "devices": list(devices),
            "per_gpu": per_gpu, "scaling": scaling, "outcomes": []}


def ddp_run(label, world, local, losses, step_ms, mode="cutlass_byoc", select="cached", tuned=None, compiled=0):
    ranks = [str(r) for r in range(world)]
    return {"label": label, "mode": mode, "select": select, "world_size": world, "local_batch": local,
            "micro_batch": local, "accum": 1, "global_batch": world * local, "steps": len(losses), "image": 8,
            "amp": "fp16", "bn": "frozen", "gpu": "GPU X", "torch": "2.x", "losses": losses, "step_ms": step_ms,
            "first_step_s": 3.0,
            "kernels_per_host": {"h": {"ranks": list(range(world)), "kernels_compiled": compiled,
                                       "distinct_kernels": compiled, "compiled_twice": 0}},
            "tuning_per_rank": {r: {"tuned": (tuned or {}).get(r, 0), "waited": 0} for r in ranks},
            "same_launches": {"problems_compared": 3 if mode == "cutlass_byoc" else 0, "same": True},
            "offload": {"fallbacks": {"fprop": 1}} if mode == "cutlass_byoc" else {}}


def test_multigpu_tables_from_device_folders(pr, tmp_path):
    a, b, results = tmp_path / "a", tmp_path / "b", tmp_path / "results"
    a.mkdir(), b.mkdir(), results.mkdir()
    (results / "bench.json").write_text('{"kept": true}')  # no folder has it: left as it is
    (a / "tune-gpus-cold.json").write_text(json.dumps(tune_report([0, 1], 5.0, compiled=4, busy=[4.0, 4.0])))
    (a / "tune-gpus-1.json").write_text(json.dumps(tune_report([0], 9.0)))
    (a / "tune-gpus-n.json").write_text(json.dumps(tune_report([0, 1], 6.0, busy=[3.0, 3.0])))
    (a / "ddp.jsonl").write_text(json.dumps(ddp_run("byoc tune 2x4 cold", 2, 4, [2.0, 1.0], 10.0, select="tune",
                                                    tuned={"1": 3}, compiled=4)) + "\n")
    (b / "ddp.jsonl").write_text("\n".join(json.dumps(r) for r in (
        ddp_run("byoc 2x16", 2, 4, [2.0, 1.0], 8.0),  # the reference, though not the first run
        ddp_run("byoc 1x32", 1, 8, [2.0, 1.01], 9.0),
        ddp_run("inductor 2x16", 2, 4, [2.02, 1.0], 6.0, mode="inductor"))) + "\n")
    (b / "fleet.log").write_text("exported 3 decisions and 2 kernels to /x.tar.gz\nimported 3 decisions\n")

    pr.publish([a, b], results)
    assert (results / "bench.json").read_text() == '{"kept": true}'
    mg = results / "multigpu"
    assert sorted(p.name for p in mg.iterdir()) == ["ddp.jsonl", "fleet.log", "tune-gpus-1.json",
                                                    "tune-gpus-cold.json", "tune-gpus-n.json"]
    labels = [json.loads(ln)["label"] for ln in (mg / "ddp.jsonl").read_text().splitlines()]
    assert labels == ["byoc tune 2x4 cold", "byoc 2x16", "byoc 1x32", "inductor 2x16"]  # the given order

    text = pr.multigpu_tables(mg)
    md = "\n".join(text)
    # tuning: rows in the order cold, 1, n, each GPU's busy time; measured 9.0 / 6.0 = 1.50x
    rows = [ln for ln in text if ln.startswith("| tune-gpus-")]
    assert [r.split(" | ")[0] for r in rows] == ["| tune-gpus-cold.json", "| tune-gpus-1.json", "| tune-gpus-n.json"]
    assert "| 0,1 | 4 | 30.0 | 5.0 | 12 | 35.0 | 4.0 / 4.0 |" in rows[0]
    assert rows[1].endswith("| - |")
    assert "2 GPUs vs 1" in md and "1.50x (75% of 2x)." in md

    # DDP: loss diff against `byoc 2x16` (max over steps of |a - b| / |b|)
    cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in text if ln.startswith("| ")]
    header = next(c for c in cells if c[0] == "run")
    ddp = {c[0]: c for c in cells if len(c) == len(header)}
    col = header.index("loss diff")
    assert ddp["byoc 2x16"][col] == "(reference)"
    assert ddp["byoc tune 2x4 cold"][col] == "0.00e+00"
    assert ddp["byoc 1x32"][col] == "1.00e-02"
    assert ddp["inductor 2x16"][col] == "1.00e-02"
    assert "reference run, `byoc 2x16`" in md
    assert ddp["byoc tune 2x4 cold"][header.index("tuned/waited per rank")] == "0: 0/0, 1: 3/0"
    assert ddp["byoc tune 2x4 cold"][header.index("kernels compiled")] == "4"
    assert ddp["byoc 2x16"][header.index("fallbacks")] == "1"
    assert ddp["inductor 2x16"][header.index("fallbacks")] == "-"
    # 6.0 ms (Inductor) / 8.0 ms (ours)
    assert "(`inductor 2x16` step ms / `byoc 2x16` step ms; above 1 means faster than Inductor): 0.750." in md
    assert "`exported 3 decisions and 2 kernels to /x.tar.gz`" in md

    # render(): the multi-GPU section after the others, only where benchmarks/h200/multigpu/ exists
    (results / "bench.json").unlink()
    assert "Tuning on several GPUs" in pr.render(results)
    assert pr.render(tmp_path / "a").strip() == ""


def offload_row(model, batch, training, mode, step_ms):
    return {"model": model, "batch": batch, "training": training, "mode": mode, "step_ms": step_ms,
            "speedup_vs_inductor_same_mode": 1.0}


def offload_file(rows, host, steps=20):
    return {"device": "GPU X", "torch": "2.x", "cudnn": 1, "image": 224, "steps": steps, "rounds": 3, "dtype": "fp16",
            "rows": rows, "host_overhead": host}


def test_merge_offload_replaces_only_the_rerun_cases(pr, tmp_path):
    """--merge-offload: a rerun of one model's modes replaces those rows; the other model's rows and the published
    host overheads stay, the new run's host overheads numbered after them."""
    results = tmp_path / "h200"
    old = [offload_row("resnet50", 32, True, "inductor", 9.8), offload_row("resnet50", 32, True, "cutlass_byoc", 9.7),
           offload_row("mobilenet_v2", 32, True, "inductor", 7.4),
           offload_row("mobilenet_v2", 32, True, "cutlass_byoc", 6.8)]
    first = tmp_path / "call1"
    first.mkdir()
    (first / "offload.json").write_text(json.dumps(offload_file(old, [{"pass": "fprop", "us_per_call": 20.0}])))
    pr.publish([first], results)
    rerun = tmp_path / "call2"
    rerun.mkdir()
    new = [offload_row("mobilenet_v2", 32, True, "inductor", 7.5), offload_row("mobilenet_v2", 32, True,
                                                                               "cutlass_byoc", 6.1)]
    (rerun / "offload.json").write_text(json.dumps(offload_file(new, [{"pass": "fprop", "us_per_call": 18.0}])))
    pr.publish([rerun], results, merge_offload_rows=True)
    merged = json.loads((results / "offload.json").read_text())
    assert [(r["model"], r["mode"], r["step_ms"]) for r in merged["rows"]] == [
        ("resnet50", "inductor", 9.8), ("resnet50", "cutlass_byoc", 9.7),
        ("mobilenet_v2", "inductor", 7.5), ("mobilenet_v2", "cutlass_byoc", 6.1)]
    assert [(h["us_per_call"], h["run"]) for h in merged["host_overhead"]] == [(20.0, 1), (18.0, 2)]
    assert merged["runs"] == 2
    # without the flag the given folders' rows alone are published, as before
    pr.publish([rerun], results)
    assert len(json.loads((results / "offload.json").read_text())["rows"]) == 2


def bench_row(layer, kind, ours, cudnn):
    return {"layer": layer, "kind": kind, "problem": f"{layer}-{kind}", "resnet50": False, "bound": "memory",
            "launch": f"k_{layer}_{kind}", "chosen_by": "decision", "ours_us": ours, "cudnn_us": cudnn,
            "ours_tflops": None, "cudnn_tflops": None, "ours_gbs": 1000.0 / ours, "cudnn_gbs": 1000.0 / cudnn,
            "ratio": cudnn / ours, "max_error": 0.0, "status": "ok", "depthwise": True}


def bench_file(rows, torch_version):
    return {"gpu": "GPU X", "torch": torch_version, "cudnn": 1, "summary": {}, "rows": rows}


def test_merge_bench_replaces_only_the_remeasured_cells(pr, tmp_path):
    """--merge-bench: a wgrad-only bench replaces the wgrad rows in place; the fprop rows stay, each row says its
    run, the runs are listed, and the summary is recomputed over the merged rows."""
    results = tmp_path / "h200"
    first = tmp_path / "call1"
    first.mkdir()
    old = [bench_row("a", "fprop", 10.0, 10.0), bench_row("a", "wgrad", 20.0, 10.0), bench_row("b", "fprop", 5.0, 10.0),
           bench_row("b", "wgrad", 10.0, 10.0)]
    (first / "bench-depthwise.json").write_text(json.dumps(bench_file(old, "2.10")))
    pr.publish([first], results)
    rerun = tmp_path / "call2"
    rerun.mkdir()
    new = [bench_row("a", "wgrad", 5.0, 10.0), bench_row("b", "wgrad", 8.0, 12.0), bench_row("c", "wgrad", 4.0, 4.0)]
    (rerun / "bench-depthwise.json").write_text(json.dumps(bench_file(new, "2.11")))
    pr.publish([rerun], results, merge_bench_rows=True, note="call 2")
    merged = json.loads((results / "bench-depthwise.json").read_text())
    assert [(r["layer"], r["kind"], r["ours_us"], r["run"]) for r in merged["rows"]] == [
        ("a", "fprop", 10.0, 1), ("a", "wgrad", 5.0, 2), ("b", "fprop", 5.0, 1), ("b", "wgrad", 8.0, 2),
        ("c", "wgrad", 4.0, 2)]
    assert [r["torch"] for r in merged["runs"]] == ["2.10", "2.11"] and merged["runs"][1]["note"] == "call 2"
    s = merged["summary"]
    assert s["geomean_by_kind"]["fprop"] == pytest.approx(2 ** 0.5)  # 1.0 and 2.0
    assert s["geomean_by_kind"]["wgrad"] == pytest.approx((2.0 * 1.5 * 1.0) ** (1 / 3))
    assert s["worst"]["layer"] == "a" and s["worst"]["kind"] == "fprop"
    text = "\n".join(pr.bench_tables(merged))
    assert "Rows from 2 bench runs" in text and "run 1 (torch 2.10): 2 cells (fprop)" in text
    assert "run 2 (call 2): 3 cells (wgrad)" in text
    # a second merge re-measures every cell of run 1, which is dropped: runs 2 and 3 become 1 and 2
    pr.publish([first], results, merge_bench_rows=True, note="call 3")
    again = json.loads((results / "bench-depthwise.json").read_text())
    assert [r["run"] for r in again["rows"]] == [2, 2, 2, 2, 1]
    assert [r.get("note") for r in again["runs"]] == ["call 2", "call 3"]
    # a merge that re-measures every cell leaves one run, and its note heads the table
    fresh = tmp_path / "h200-fresh"
    pr.publish([first], fresh)
    pr.publish([first], fresh, merge_bench_rows=True, note="call 5, every cell")
    single = json.loads((fresh / "bench-depthwise.json").read_text())
    assert [r.get("note") for r in single["runs"]] == ["call 5, every cell"]
    assert "All rows from one bench run, each row's two times from one process: call 5, every cell." in \
        "\n".join(pr.bench_tables(single))
    # without the flag the file is copied as it is
    pr.publish([rerun], results)
    assert json.loads((results / "bench-depthwise.json").read_text())["rows"] == new


def test_bench_gives_each_cells_lower_ratio_of_its_two_processes(pr):
    """A row carries the tune's times of the same launch and cuDNN (the decision's record); the summary and the README
    table give the geomean of each cell's lower ratio, and count the cells whose cuDNN time differed by over 10%."""
    from cutlass_byoc.bench import BenchReport, BenchRow

    rows = [dict(bench_row("a", "wgrad", 10.0, 20.0), tune_us=10.0, tune_cudnn_us=15.0, tune_ratio=1.5),
            dict(bench_row("b", "wgrad", 10.0, 10.0), tune_us=8.0, tune_cudnn_us=10.0, tune_ratio=1.25),
            bench_row("c", "fprop", 10.0, 12.0)]  # no tune record: its own ratio
    report = BenchReport(tuple(BenchRow(**r) for r in rows), "GPU X", "2.x", 1)
    assert [r.min_ratio for r in report.rows] == [1.5, 1.0, 1.2]
    s = report.summary()
    assert s["geomean_min_ratio_by_kind"]["wgrad"] == pytest.approx(1.5 ** 0.5)
    assert s["geomean_min_ratio_all"] == pytest.approx((1.5 * 1.0 * 1.2) ** (1 / 3))
    assert "lower ratio of this run and its tune's" in report.table()
    text = "\n".join(pr.bench_tables(bench_file(rows, "2.x")))
    assert "more than 10% in 1 of 3 cells): geomean 1.216 (fprop 1.200, dgrad nan, wgrad 1.225)" in text


def test_profile_table_lists_the_sources_in_the_headers_order(pr):
    """gpu_ms_by_source is rendered as the header names it (ours, cuDNN+cuBLAS, Triton, aten, other), whatever order
    the file's dict has (the bench classifies Triton first)."""
    row = offload_row("resnet50", 32, True, "cutlass_byoc-cudagraphs", 10.0)
    row["profile"] = {"wall_ms": 11.0, "gpu_kernel_ms": 6.5, "offloaded_calls": 0, "offloaded_cpu_ms": 0.0,
                      "offloaded_gpu_ms": 0.0, "aten_conv_calls": 0, "aten_conv_cpu_ms": 0.0, "aten_conv_gpu_ms": 0.0,
                      "gpu_ms_by_source": {"triton": 3.0, "cutlass_byoc": 1.5, "cudnn/cublas": 0.5, "aten": 0.25,
                                           "other": 0.125}}
    lines = pr.offload_tables(offload_file([row], []))
    header = next(line for line in lines if "GPU ms: ours, cuDNN+cuBLAS, Triton, aten, other" in line)
    body = next(line for line in lines if line.startswith("| - | resnet50 | 32 | cutlass_byoc-cudagraphs | 11.00"))
    assert header and "| 1.50, 0.50, 3.00, 0.25, 0.12 |" in body, body


def test_offload_table_names_the_offloaded_passes_of_training_and_inference(pr):
    """The "offloaded" column: a training graph's three passes, an inference graph's fprop alone."""
    train = offload_row("resnet50", 32, True, "cutlass_byoc", 10.0)
    train["offload"] = ("cutlass_byoc offload report for all graphs+graph0(joint): fprop 26/53, dgrad 21/52, wgrad 52/53 "
                        "offloaded (63 left to cuDNN, measured faster); 0 channels_last conversions")
    infer = offload_row("resnet50", 1, False, "cutlass_byoc", 4.5)
    infer["offload"] = ("cutlass_byoc offload report for all graphs+graph0(forward): fprop 32/53 offloaded (21 left to "
                        "cuDNN, measured faster); 0 channels_last conversions")
    text = "\n".join(pr.offload_tables(offload_file([train, infer], [])))
    assert "| 0 | fprop 26/53, dgrad 21/52, wgrad 52/53 | - |" in text and "| 0 | fprop 32/53 | - |" in text, text


def test_offload_table_says_how_many_timed_updates_were_skipped(pr):
    """The "skipped updates" column: a training row's count of updates GradScaler skipped (the bench's
    skipped_updates), `-` where the row did not count them (inference, rows published before the count)."""
    healthy = dict(offload_row("resnet50", 32, True, "inductor-cudagraphs", 8.0), skipped_updates=0)
    skipping = dict(offload_row("resnet50", 64, True, "inductor-cudagraphs", 13.0), skipped_updates=57)
    old = offload_row("resnet50", 64, True, "cutlass_byoc", 12.0)
    lines = pr.offload_tables(offload_file([healthy, skipping, old], []))
    header = next(line for line in lines if line.startswith("| run |"))
    assert header.rstrip(" |").endswith("skipped updates")
    rows = [line for line in lines if line.startswith("| - | resnet50")]
    assert [r.rsplit("|", 2)[1].strip() for r in rows] == ["0", "57", "-"], rows


def test_merge_offload_twice_adds_no_host_run_again(pr, tmp_path):
    """Merging a folder that is already published (e.g. several calls merged again with one more) replaces its rows
    and does not add its host-overhead run a second time; a new run is numbered after the published ones."""
    results = tmp_path / "h200"
    call1, call2 = tmp_path / "call1", tmp_path / "call2"
    call1.mkdir()
    call2.mkdir()
    (call1 / "offload.json").write_text(json.dumps(offload_file(
        [offload_row("resnet50", 32, True, "inductor", 9.8)], [{"pass": "fprop", "path": "aten", "us_per_call": 20.0},
                                                               {"pass": "dgrad", "path": "aten", "us_per_call": 21.0}])))
    (call2 / "offload.json").write_text(json.dumps(offload_file(
        [offload_row("resnet50", 64, True, "inductor", 14.0)], [{"pass": "fprop", "path": "aten", "us_per_call": 30.0}])))
    pr.publish([call1], results, merge_offload_rows=True)
    first = json.loads((results / "offload.json").read_text())
    pr.publish([call1, call2], results, merge_offload_rows=True)
    merged = json.loads((results / "offload.json").read_text())
    assert [(r["batch"], r["step_ms"]) for r in merged["rows"]] == [(32, 9.8), (64, 14.0)]
    runs = first["runs"]
    assert [(h["us_per_call"], h["run"]) for h in merged["host_overhead"]] == [
        (h["us_per_call"], h["run"]) for h in first["host_overhead"]] + [(30.0, runs + 1)]
    assert merged["runs"] == runs + 1
    # each row says which run measured it, call1's keeping its number, and the tables show it
    assert [r["run"] for r in merged["rows"]] == [first["rows"][0]["run"], runs + 1]
    lines = pr.offload_tables(merged)
    assert any(line.startswith(f"| {runs + 1} | resnet50 | 64 | True | inductor | 14.00") for line in lines)


def test_goals_table_reads_the_published_files(pr, tmp_path):
    """The goals summary: every figure computed from the published files (the latest run of a case and mode, with the
    others' ratios), nothing for files that are not there."""
    results = tmp_path / "h200"
    results.mkdir()
    assert pr.goals_table(results) == []
    rows = [dict(offload_row("resnet50", 32, True, "cutlass_byoc", 9.0), speedup_vs_inductor_same_mode=1.05, run=1),
            dict(offload_row("resnet50", 32, True, "cutlass_byoc", 8.0), speedup_vs_inductor_same_mode=1.15, run=2),
            dict(offload_row("resnet50", 64, True, "cutlass_byoc-cudagraphs", 8.0), speedup_vs_inductor_same_mode=1.02)]
    host = [{"pass": "fprop", "path": "cutlass_byoc call site (C++)", "us_per_call": 30.0, "run": 1},
            {"pass": "fprop", "path": "cutlass_byoc call site (C++)", "us_per_call": 12.0, "run": 2},
            {"pass": "fprop", "path": "aten (cuDNN)", "us_per_call": 25.0, "run": 2}]
    (results / "offload.json").write_text(json.dumps(offload_file(rows, host)))
    dense = [dict(bench_row(f"l{i}", kind, 10.0, 10.0 * r), resnet50=True, depthwise=False)
             for i, (kind, r) in enumerate([("fprop", 1.2), ("wgrad", 0.8), ("wgrad", 1.25)])]
    (results / "bench.json").write_text(json.dumps(bench_file(dense, "2.x")))
    dw = [bench_row("dw", "fprop", 10.0, 9.0), bench_row("dw", "dgrad", 10.0, 25.0), bench_row("dw", "wgrad", 10.0, 15.0)]
    (results / "bench-depthwise.json").write_text(json.dumps(bench_file(dw, "2.x")))
    text = "\n".join(pr.goals_table(results))
    assert "geomean 1.063 over 3 cells; 1 below 0.9 (worst l1 wgrad 0.80)" in text
    assert "| ResNet-50 wgrad geomean >= 1.0 | 1.000 over 2 cells |" in text
    assert "fprop 0.900, dgrad 2.500, wgrad 1.500 (geomeans; cells below the goal: 1 of 1 fprop, 0 of 1 dgrad, " \
           "1 of 1 wgrad)" in text
    assert "| resnet50 b32 training step >= 1.10x Inductor, without CUDA graphs | 1.150 (run 2; other runs 1.050) |" \
        in text
    assert "| resnet50 b64 training step >= 1.10x Inductor, with CUDA graphs | 1.020 (an earlier run) |" in text
    assert "run 2, ours vs aten µs: fprop 12.0 vs 25.0 |" in text
    assert "mobilenet_v2" not in text and "copy speed" not in text
    (results / "copy-floor.json").write_text(json.dumps({"summary": {"depthwise dgrad": {
        "cells": 19, "goal_ratio": 2.0, "geomean_max_ratio": 2.2, "cells_max_ratio_below_goal": 10,
        "geomean_ours_of_floor": 0.79}}}))
    assert ("depthwise dgrad: 2.20 (goal 2; 10 of 19 cells below it even at copy speed; ours at 0.79 of copy speed)"
            in "\n".join(pr.goals_table(results)))
    assert pr.render(results).startswith("Against the goals of the open issues")


def test_bench_json_takes_the_depthwise_rows(pr, tmp_path):
    """bench.json is the file both issues name: publishing either bench file puts bench-depthwise.json's rows into it
    (after its own dense rows, each part's runs numbered on), and the README renders them once, from bench.json."""
    dense = [dict(bench_row("l1", "fprop", 10.0, 12.0), resnet50=True, depthwise=False)]
    dw = [bench_row("dw1", k, 10.0, 10.0 * r) for k, r in (("fprop", 1.1), ("dgrad", 2.0), ("wgrad", 1.5))]
    dev, results = tmp_path / "dev", tmp_path / "results"
    dev.mkdir(), results.mkdir()
    (results / "bench.json").write_text(json.dumps(bench_file(dense, "2.x")))
    (dev / "bench-depthwise.json").write_text(json.dumps(bench_file(dw, "2.y")))
    pr.publish([dev], results, merge_bench_rows=True, note="the depthwise run")
    bench = json.loads((results / "bench.json").read_text())
    assert [(r["layer"], r["kind"], r["run"]) for r in bench["rows"]] == [
        ("l1", "fprop", 1), ("dw1", "fprop", 2), ("dw1", "dgrad", 2), ("dw1", "wgrad", 2)]
    assert [run["torch"] for run in bench["runs"]] == ["2.x", "2.y"]  # each part's run, in order
    assert bench["summary"]["geomean_depthwise_by_kind"]["dgrad"] == pytest.approx(2.0)
    assert bench["summary"]["geomean_cudnn_over_ours_resnet50"] == pytest.approx(1.2)
    # published again (a dense rerun): the depthwise rows stay, once
    (dev / "bench-depthwise.json").unlink()
    (dev / "bench.json").write_text(json.dumps(bench_file([dict(dense[0], cudnn_us=13.0, ratio=1.3)], "2.z")))
    pr.publish([dev], results, merge_bench_rows=True, note="a dense rerun")
    bench = json.loads((results / "bench.json").read_text())
    assert [r["layer"] for r in bench["rows"]] == ["l1", "dw1", "dw1", "dw1"] and bench["rows"][0]["ratio"] == 1.3
    text = pr.render(results)
    assert text.count("| dw1 (depthwise) | dgrad |") == 1 and "bench-depthwise.json`)" not in text


def test_bench_of_another_workload_is_published_under_its_own_name(pr, tmp_path):
    """--bench-as: a bench of another workload (ConvNeXt's 7x7 depthwise layers) goes into its own file and its own
    table; bench.json, and so the goals, stay as they are."""
    dense = [dict(bench_row("l1", "fprop", 10.0, 12.0), resnet50=True, depthwise=False)]
    cx = [bench_row("convnext_dw_96_56", k, 10.0, 10.0 * r) for k, r in (("fprop", 1.5), ("dgrad", 2.5), ("wgrad", 0.8))]
    dev, results = tmp_path / "dev", tmp_path / "results"
    dev.mkdir(), results.mkdir()
    (results / "bench.json").write_text(json.dumps(bench_file(dense, "2.x")))
    before = (results / "bench.json").read_text()
    (dev / "bench.json").write_text(json.dumps(bench_file(cx, "2.y")))
    pr.publish_bench_as(dev, "bench-convnext-dw.json", results)
    assert (results / "bench.json").read_text() == before
    assert json.loads((results / "bench-convnext-dw.json").read_text())["rows"][1]["ratio"] == pytest.approx(2.5)
    text = pr.render(results)
    assert "| convnext_dw_96_56 (depthwise) | dgrad |" in text and "bench-convnext-dw.json`)" in text
    with pytest.raises(SystemExit, match="bench-as"):
        pr.publish_bench_as(dev, "bench-other.json", results)
    # a wgrad-only rerun merged in: the fprop and dgrad rows stay, the wgrad row is the new one, each says its run
    (dev / "bench.json").write_text(json.dumps(bench_file([bench_row("convnext_dw_96_56", "wgrad", 8.0, 10.0)], "2.z")))
    pr.publish_bench_as(dev, "bench-convnext-dw.json", results, merge=True, note="wgrad rerun")
    rows = json.loads((results / "bench-convnext-dw.json").read_text())["rows"]
    assert [(r["kind"], r["run"]) for r in rows] == [("fprop", 1), ("dgrad", 1), ("wgrad", 2)]


def test_offload_rows_of_another_optimizer_are_their_own(pr, tmp_path):
    """The offload bench's --optimizers: a row's optimizer is part of what it measures (rows published without one
    ran the default SGD), so a run of sgd-fused steps adds rows beside the published sgd ones instead of replacing
    them; the tables label those rows, and the goals table gives them lines of their own."""
    results = tmp_path / "h200"
    first = tmp_path / "call1"
    first.mkdir()
    old = [offload_row("resnet50", 32, True, "inductor-cudagraphs", 9.4),
           dict(offload_row("resnet50", 32, True, "cutlass_byoc-cudagraphs", 8.9), speedup_vs_inductor_same_mode=1.055)]
    (first / "offload.json").write_text(json.dumps(offload_file(old, [])))
    pr.publish([first], results)
    second = tmp_path / "call2"
    second.mkdir()
    new = [dict(offload_row("resnet50", 32, True, "inductor-cudagraphs", 7.0), optimizer="sgd-fused"),
           dict(offload_row("resnet50", 32, True, "cutlass_byoc-cudagraphs", 6.5), optimizer="sgd-fused",
                speedup_vs_inductor_same_mode=1.077),
           dict(offload_row("resnet50", 32, True, "inductor-cudagraphs", 9.5), optimizer="sgd")]
    (second / "offload.json").write_text(json.dumps(offload_file(new, [])))
    pr.publish([second], results, merge_offload_rows=True)
    merged = json.loads((results / "offload.json").read_text())
    assert [(r["mode"], r.get("optimizer"), r["step_ms"]) for r in merged["rows"]] == [
        ("cutlass_byoc-cudagraphs", None, 8.9), ("inductor-cudagraphs", "sgd-fused", 7.0),
        ("cutlass_byoc-cudagraphs", "sgd-fused", 6.5), ("inductor-cudagraphs", "sgd", 9.5)]
    text = "\n".join(pr.offload_tables(merged))
    assert "| cutlass_byoc-cudagraphs [sgd-fused] | 6.50 |" in text and "| inductor-cudagraphs | 9.50 |" in text
    goals = "\n".join(pr.goals_table(results))
    assert "resnet50 b32 training step >= 1.10x Inductor, with CUDA graphs | 1.055" in goals
    assert "resnet50 b32 training step (sgd-fused steps) >= 1.10x Inductor, with CUDA graphs | 1.077" in goals


def test_optimizer_table_sets_a_runs_optimizers_side_by_side(pr):
    """The optimizer table: one line per run, case and mode measured with several optimizers, each optimizer's step
    time, ratio, rounds and busy time; modes measured with one optimizer only are left out."""
    def row(mode, opt, ms, ratio, busy=None):
        return dict(offload_row("resnet50", 32, True, mode, ms), run=35, optimizer=opt,
                    speedup_vs_inductor_same_mode=ratio, step_ms_rounds=[ms - 0.1, ms, ms + 0.2],
                    **({"profile": {"busy_ms": busy}} if busy else {}))

    rows = [row("inductor-cudagraphs", "sgd", 7.9, 1.0, 6.5), row("inductor-cudagraphs", "sgd-fused", 6.8, 1.0, 6.54),
            row("cutlass_byoc-cudagraphs", "sgd-fused", 6.5, 1.05), dict(offload_row("resnet50", 1, False, "eager", 3.0))]
    text = "\n".join(pr.optimizer_table(rows))
    assert "| run | model | batch | mode | sgd: step ms (vs Inductor) |" in text
    assert "| 35 | resnet50 | 32 | inductor-cudagraphs | 7.90 (1.000) | 7.80-8.10 | 6.50 | 6.80 (1.000) | 6.70-7.00 | 6.54 |" in text
    assert "cutlass_byoc-cudagraphs" not in text and "eager" not in text
    assert pr.optimizer_table(rows[2:]) == []


def test_files_of_another_gpu_are_refused_before_anything_is_written(pr, tmp_path):
    """A device call that named the H200 can run on an H100: with gpu="H200" (what the command line passes) a file
    naming another GPU stops the whole publication, the other folders' files included."""
    results = tmp_path / "h200"
    good, other = tmp_path / "call1", tmp_path / "call2"
    good.mkdir()
    other.mkdir()
    rows = [offload_row("resnet50", 32, True, "inductor", 9.8)]
    (good / "offload.json").write_text(json.dumps(dict(offload_file(rows, []), device="NVIDIA H200")))
    (other / "bench.json").write_text(json.dumps(bench_file([], "2.x") | {"gpu": "NVIDIA H100 80GB HBM3 (sm_90)"}))
    with pytest.raises(SystemExit, match="H100 80GB HBM3.*not an H200"):
        pr.publish([good, other], results, gpu="H200")
    assert not results.exists()
    pr.publish([good], results, gpu="H200")
    assert json.loads((results / "offload.json").read_text())["device"] == "NVIDIA H200"


def test_multi_gpu_files_of_another_gpu_are_refused_too(pr, tmp_path):
    """The multi-GPU round's tune reports and ddp.jsonl lines name their GPU as well: one that names another GPU stops
    the publication before anything is written; the H200's own are copied."""
    results = tmp_path / "h200"
    call = tmp_path / "call"
    call.mkdir()
    (call / "tune-gpus-1.json").write_text(json.dumps({"gpu": "NVIDIA H200 (sm_90)", "timed": True}))
    (call / "ddp.jsonl").write_text(json.dumps({"gpu": "NVIDIA H200", "label": "a"}) + "\n"
                                    + json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "label": "b"}) + "\n")
    with pytest.raises(SystemExit, match="ddp.jsonl was measured on 'NVIDIA H100 80GB HBM3', not an H200"):
        pr.publish([call], results, gpu="H200")
    assert not results.exists()
    (call / "tune-gpus-1.json").write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3 (sm_90)", "timed": True}))
    (call / "ddp.jsonl").write_text(json.dumps({"gpu": "NVIDIA H200", "label": "a"}) + "\n")
    with pytest.raises(SystemExit, match="tune-gpus-1.json was measured on"):
        pr.publish([call], results, gpu="H200")
    assert not results.exists()
    (call / "tune-gpus-1.json").write_text(json.dumps({"gpu": "NVIDIA H200 (sm_90)", "timed": True}))
    pr.publish([call], results, gpu="H200")
    assert json.loads((results / "multigpu" / "tune-gpus-1.json").read_text())["gpu"] == "NVIDIA H200 (sm_90)"
    assert (results / "multigpu" / "ddp.jsonl").read_text().count("\n") == 1
