"""The darcy section of ``converge report``: tables of ``darcy.json`` (benchmark) or an ``evaluation.json``."""
from __future__ import annotations

from typing import Any, Mapping

from converge.contract import Table
from converge.tables import fmt

from .timing import SOLVER_LABELS


def accuracy_table(result: Mapping[str, Any]) -> Table:
    """Relative L2 error of u on the test fields, with the training set it came from."""
    rows = [[label, fmt(result.get(key))] for key, label in (
        ("relative_l2", "test relative L2 error of u, mean"), ("relative_l2_median", "median"),
        ("relative_l2_p90", "90th percentile"), ("relative_l2_max", "maximum"),
        ("n_train_solves", "training solves (train + validation)"), ("n_test", "test fields"),
        ("resolution", "nodes per side"))]
    return Table("FNO accuracy against the sparse solver", ["", ""], rows)


def speed_rows(resolution: Any, entry: Mapping[str, Any]) -> list[Any]:
    seconds = entry["seconds_per_field"]
    ms = [fmt(1e3 * seconds[k]) if k in seconds else None for k in (*SOLVER_LABELS, "fno_single", "fno_batched")]
    return [resolution, *ms, entry["fastest_classical"], fmt(entry["speedup"]["single"]),
            fmt(entry["speedup"]["batched"])]


def speed_table(result: Mapping[str, Any]) -> Table:
    """Milliseconds per field of each classical solver and the FNO, by resolution, and the FNO's speed-ups."""
    header = ["nodes per side", "direct LU [ms]", "AMG Ruge-Stuben [ms]", "AMG smoothed aggr. [ms]",
              "FNO single [ms]", f"FNO batch {result.get('fno_batch', '')} [ms/field]", "fastest classical",
              "speed-up single", "speed-up batched"]
    by_resolution = result.get("speed_table") or {str(result.get("resolution")): result}
    rows = [speed_rows(res, entry) for res, entry in by_resolution.items() if "seconds_per_field" in entry]
    threads = result.get("threads")
    return Table(f"Seconds per field, same CPU and process, {threads} thread(s); classical times count assembly "
                 "and setup", header, rows)


def darcy_tables(result: dict) -> list[Table]:
    """The report's tables for one darcy result file."""
    tables = [accuracy_table(result)]
    if "seconds_per_field" in result or result.get("speed_table"):
        tables.append(speed_table(result))
    walls = result.get("wall_seconds")
    if walls:
        tables.append(Table("Wall time of the benchmark's stages [s]", ["stage", "seconds"],
                            [[k, fmt(float(v))] for k, v in walls.items()]))
    return tables
