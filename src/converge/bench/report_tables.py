"""The tables of the report: one function per kind of result file, each returning :class:`Table` s.

A function reads the layout its benchmark writes; :func:`scalar_table` is the
fallback for a file whose layout it does not know (or no longer matches), so a
changed benchmark degrades to a plain key/value table instead of a broken page.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..tables import Table, fmt, percent


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def flatten(obj: Any, prefix: str = "", depth: int = 3) -> Iterable[tuple[str, Any]]:
    """(dotted key, scalar) pairs of nested dicts, ``depth`` levels down; lists are summarised by length."""
    if isinstance(obj, Mapping) and depth > 0:
        for key, value in obj.items():
            yield from flatten(value, f"{prefix}.{key}" if prefix else str(key), depth - 1)
    elif isinstance(obj, list):
        yield prefix, f"[{len(obj)} items]"
    elif not isinstance(obj, Mapping):
        yield prefix, obj


def scalar_table(result: Mapping[str, Any], caption: str = "values", limit: int = 60) -> list[Table]:
    """Fallback: the first ``limit`` scalar values of any result, by dotted key."""
    pairs = [(k, v) for k, v in flatten(result) if not k.startswith("machine.") and k != "machine"][:limit]
    return [Table(caption, ("key", "value"), [(k, fmt(v)) for k, v in pairs])]


def gemm_tables(r: Mapping[str, Any]) -> list[Table]:
    precisions = list(dict.fromkeys(row["precision"] for row in r["rows"]))
    sizes = sorted({row["size"] for row in r["rows"]})
    cells = {(row["size"], row["precision"]): row for row in r["rows"]}

    def cell(row: Mapping[str, Any] | None) -> str:
        if row is None:
            return "\u2013"
        if "skipped" in row:
            return f"skipped ({row['skipped']})"
        rel = row.get("relative_to_fp32")
        return f"{row['tflops']:.3g} ({percent(row.get('fraction_of_peak'))} of peak" + (
            f", {rel:.2f}x fp32)" if rel is not None else ")")

    main = Table(f"{r['device_name']}, {r['threads']} thread(s): TFLOP/s (fraction of peak, speed-up over fp32)",
                 ["M = N = K", *precisions], [[s, *(cell(cells.get((s, p))) for p in precisions)] for s in sizes])
    peaks = r.get("peaks") or {}
    peak_rows = [[p, fmt(v.get("tflops")), fmt(v.get("flops_per_cycle_per_core")), v.get("unit") or v.get("source"),
                  fmt(v.get("cores")), fmt(v.get("clock_ghz")), v.get("clock_source") or v.get("matched", "")]
                 for p, v in peaks.items()]
    return [main, Table("theoretical peaks", ["precision", "TFLOP/s", "FLOP/cycle/core", "unit or source", "cores",
                                              "clock GHz", "clock source or match"], peak_rows)]


def collectives_tables(r: Mapping[str, Any]) -> list[Table]:
    summary = [[op, fmt(s["latency_us"]), fmt(s["best_busbw_GBps"]), fmt(s["best_algbw_GBps"]),
                human_bytes(s["at_bytes"]), fmt(s["all_correct"])] for op, s in r["summary"].items()]
    ops = list(r["summary"])
    by = {(row["op"], row["bytes"]): row for row in r["rows"]}
    sizes = sorted({row["bytes"] for row in r["rows"]})

    def cell(row: Mapping[str, Any] | None) -> str:
        if row is None:
            return "\u2013"
        mark = "" if row["correct"] else " WRONG"
        return f"{row['busbw_GBps']:.3g} GB/s, {row['seconds'] * 1e6:.3g} us{mark}"

    head = f"{r['backend']}, {r['world']} ranks on {r['device']}"
    return [Table(f"{head}: summary", ["op", "latency (smallest) us", "best busbw GB/s", "best algbw GB/s",
                                       "at size", "all checks passed"], summary),
            Table(f"{head}: bus bandwidth and time per call, by message size S", ["S", *ops],
                  [[human_bytes(s), *(cell(by.get((op, s))) for op in ops)] for s in sizes])]


def ddp_tables(r: Mapping[str, Any]) -> list[Table]:
    """converge bench ddp (rows by model and process count); scale.json's 2-process measurement otherwise."""
    if "rows" not in r:
        return scale_tables(r)
    rows = [[row["model"], row["precision"], row["processes"], row["per_rank_batch"], fmt(row["step_ms"]),
             fmt(row["samples_per_s"]), percent(row["efficiency"]), percent(row["efficiency_vs_ceiling"]),
             fmt(row["in_sync"])] for row in r["rows"]]
    out = [Table(f"{r['backend']} DDP on {r['device']}: weak scaling (per-rank batch fixed)",
                 ["model", "precision", "processes", "batch per rank", "step ms", "samples/s",
                  "efficiency vs 1 process", "vs no-communication ceiling", "replicas identical"], rows)]
    model = r["scaling_model"]
    gpus = sorted({n for m in model["models"].values() for n in m["predictions"]}, key=int)
    out.append(Table("ring all-reduce model, efficiency no overlap / overlap; GPU step "
                     f"{model['assumptions']['gpu_step']}",
                     ["model", "GPU step ms", "gradient bytes", *(f"{n} GPUs" for n in gpus)],
                     [[name, fmt(m["gpu_step_ms"]), human_bytes(m["grad_bytes"]),
                       *(f"{percent(m['predictions'][n]['efficiency_no_overlap'])} / "
                         f"{percent(m['predictions'][n]['efficiency_overlap'])}" for n in gpus)]
                      for name, m in model["models"].items()]))
    return out


def scale_tables(r: Mapping[str, Any]) -> list[Table]:
    """benchmarks/scale_ddp.py's 2-process Gloo measurement and its model, beside the ensemble scale-out."""
    ddp = r["ddp"]["models"]
    out = [Table("2 Gloo processes: samples/s (benchmarks/scale_ddp.py)",
                 ["model", "1 process", "2 DDP", "2 without communication", "exposed all-reduce share"],
                 [[name, fmt(m["samples_per_s"]["1"]), fmt(m["samples_per_s"]["2"]),
                   fmt(m["samples_per_s"]["2_ceiling"]), percent(m["allreduce_share"]["exposed"])]
                  for name, m in ddp.items()])]
    if "ensemble" in r:
        summary = {k: v for k, v in r["ensemble"].items() if k != "raw"}
        out += scalar_table(summary, "ensemble scale-out (benchmarks/scale_ensemble.py)", limit=30)
    return out


def serve_tables(r: Mapping[str, Any]) -> list[Table]:
    rows = []
    for app, rep in r.items():
        best = rep["model_only_best"]
        rows.append([app, rep["precision"], rep["device"], f"{best['samples_per_s']:.4g} (batch {best['batch_size']})",
                     fmt(rep.get("throughput_single_unbatched")), fmt(rep.get("throughput_batched_best")),
                     fmt(rep.get("concurrency_batched_best")), fmt(rep.get("p99_ms_batched_best")),
                     fmt(rep.get("gain_vs_single_unbatched")), percent(rep.get("fraction_of_model_best"))])
    out = [Table("converge serve: samples/s", ["app", "precision", "device", "model alone, best",
                                               "1 client, unbatched", "batched, best", "at concurrency",
                                               "p99 ms there", "gain", "of model alone"], rows)]
    peers = [peer_row(app, name, peer) for app, rep in r.items() for name, peer in (rep.get("peers") or {}).items()]
    if peers:
        out.append(Table("each peer at its best settings beside ours in its format at equal or lower p99 (targets: "
                         "1.0x Triton, 1.3x the others)",
                         ["app", "peer", "format", "its settings", "peer samples/s", "its p99 ms",
                          "converge samples/s", "p99 ms", "our settings", "gain", "target met"], peers))
    return out


def peer_row(app: str, name: str, peer: Mapping[str, Any]) -> list[str]:
    """One peer of ``serve.json`` beside ours (``ours_at_equal_p99``), or the reason it is missing."""
    if peer.get("error"):
        return [app, name, "\u2013", "\u2013", f"not measured: {peer['error']}", *["\u2013"] * 6]
    ours = peer.get("ours_at_equal_p99") or {}
    settings = lambda d: ", ".join(f"{k} {v}" for k, v in (d or {}).items()) or "\u2013"  # noqa: E731
    met = ours.get("meets_target")
    return [app, name, peer.get("format", "\u2013"), settings(peer.get("settings_best")), fmt(peer.get("throughput_best")),
            fmt(peer.get("p99_ms_best")), fmt(ours.get("throughput")), fmt(ours.get("p99_ms")),
            settings(ours.get("settings")), fmt(ours.get("gain")), "\u2013" if met is None else ("yes" if met else "no")]


def surrogate_tables(r: Mapping[str, Any]) -> list[Table]:
    speed, accuracy = [], []
    for app, e in r["apps"].items():
        sim, sur = e["simulator_seconds_per_sample"], e["surrogate_seconds_per_sample"]
        speed.append([app, e["simulator"], fmt(sim["single"]), fmt(sim["batched"]), e["surrogate"],
                      fmt(sur["single"]), fmt(sur["batched"]), fmt(e["speedup"]["single"]),
                      fmt(e["speedup"]["batched"])])
        accuracy += accuracy_rows(app, e["accuracy"])
    return [Table(f"seconds per sample on {r['device']}, {r['threads']} thread(s)",
                  ["app", "simulator", "single", "batched", "surrogate", "single", "batched", "speed-up single",
                   "speed-up batched"], speed),
            Table("accuracy alongside", ["app", "metric", "value", "source"], accuracy)]


def accuracy_rows(app: str, acc: Mapping[str, Any]) -> list[list[str]]:
    """[app, metric, value, source] rows of a surrogate entry's accuracy; a nested entry (gw: method -> FAP -> SNR ->
    efficiency) gives a row per inner mapping, its cells joined."""
    source = acc.get("source")
    if source is None:
        return [[app, "\u2013", "\u2013", acc.get("note", "")]]
    rows = []
    for key, value in acc.items():
        if key in ("source", "note", "metric", "headline"):
            continue
        if isinstance(value, Mapping) and all(isinstance(v, Mapping) for v in value.values()):
            for sub, inner in value.items():
                rows.append([app, f"{key}, {sub}", ", ".join(f"{k}: {fmt(v)}" for k, v in inner.items()), source])
        else:
            rows.append([app, key, fmt(value), source])
    return rows


def headline_table(r: Mapping[str, Any]) -> Table:
    """One row per app of ``surrogate.json``: the surrogate against its classical method, accuracy and speed."""
    rows = [[app, e["surrogate"], e["simulator"], e["accuracy"].get("headline") or e["accuracy"].get("note", "\u2013"),
             fmt(e["speedup"]["single"]), fmt(e["speedup"]["batched"])] for app, e in r["apps"].items()]
    return Table(f"each app's surrogate against its classical method ({r['device']}, {r['threads']} thread(s), one run)",
                 ["app", "surrogate", "classical method", "accuracy", "speed-up single", "speed-up batched"], rows)


def precision_tables(r: Mapping[str, Any]) -> list[Table]:
    rows = []
    for app, rep in r.items():
        for precision in ("fp32", "bf16", "fp16"):
            if precision in rep:
                values = rep[precision]
                rows.append([app, precision, *(fmt(values.get(k)) for k in ("samples_per_s", "val_loss", "accuracy",
                                                                             "efficiency_fap_1e-2", "seconds"))])
        rows.append([app, "bf16 speed-up", fmt(rep.get("speedup_bf16")), "", "", "", ""])
    return [Table("training throughput and final validation metrics", ["app", "precision", "samples/s", "val loss",
                                                                       "accuracy", "efficiency (FAP 1e-2)",
                                                                       "seconds"], rows)]


def machine_table(machine: Mapping[str, Any]) -> Table:
    """The machine description of :func:`converge.bench.machine.describe_machine` as rows."""
    cpu = machine.get("cpu", {})
    rows = [["date (UTC)", machine.get("date")], ["host", machine.get("hostname")], ["OS", machine.get("os")],
            ["CPU", f"{cpu.get('model_name')} ({cpu.get('vendor')}, family {cpu.get('family')}, "
                    f"model {cpu.get('model')})"],
            ["CPU features", ", ".join(cpu.get("flags", [])) or "\u2013"],
            ["logical CPUs", machine.get("logical_cpus")], ["torch threads", machine.get("torch_threads")],
            ["clock", f"{fmt(cpu.get('clock_ghz'))} GHz from {cpu.get('clock_source')}"],
            ["memory", f"{fmt(machine.get('memory_gib'))} GiB"]]
    for gpu in machine.get("gpus", []) or [None]:
        rows.append(["GPU", "none (no CUDA device visible)" if gpu is None else
                     f"{gpu['name']}, {gpu['memory_gib']} GiB, capability {gpu['capability']}, driver "
                     f"{gpu.get('driver') or '?'}, CUDA {gpu.get('cuda_runtime')}"])
    rows.append(["Python", machine.get("python")])
    rows += [[name, version] for name, version in machine.get("versions", {}).items()]
    return Table("machine", ("", ""), [[k, fmt(v)] for k, v in rows])
