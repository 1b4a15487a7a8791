"""A ring all-reduce model of data-parallel scaling on GPU clusters (NVLink in a node, InfiniBand across).

``efficiency(t_compute, t_allreduce, overlap)`` is what one data-parallel step keeps of
perfect scaling: t_compute / t_step, where the step either waits for the all-reduce
(no overlap) or hides it behind the backward pass. The all-reduce time is NCCL's
hierarchical ring (:func:`cluster_allreduce_seconds`); the cluster's bandwidths and
latencies are :class:`Cluster`. Both ``converge bench ddp`` and
``benchmarks/scale_ddp.py`` predict 8 to 512 GPUs with it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

PREDICTED_GPUS = (8, 64, 512)
BACKWARD_SHARE = 2 / 3  # of a step's compute: the backward costs about twice the forward


@dataclass(frozen=True)
class Cluster:
    """Interconnect assumptions (H100/H200 class nodes of 8 GPUs)."""

    gpus_per_node: int = 8
    nvlink_bytes_per_s: float = 450e9  # NVLink 4: 900 GB/s per GPU counts both directions; a ring uses one
    nvlink_alpha_s: float = 3e-6  # per ring step within a node
    ib_bytes_per_s: float = 50e9  # InfiniBand NDR, 400 Gb/s per GPU
    ib_alpha_s: float = 8e-6  # per ring step across nodes


def ring_allreduce_seconds(n: int, nbytes: float, bytes_per_s: float, alpha_s: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` ranks: 2(n-1)/n * bytes / bw + 2(n-1) * alpha."""
    return 2 * (n - 1) / n * nbytes / bytes_per_s + 2 * (n - 1) * alpha_s


def cluster_allreduce_seconds(n: int, nbytes: float, cluster: Cluster) -> float:
    """Hierarchical (2D) ring, as NCCL does across nodes of ``gpus_per_node`` GPUs.

    Within a node a ring reduce-scatter over NVLink leaves each GPU 1/g of the
    gradients; the n/g nodes all-reduce those slices over InfiniBand (one ring per
    GPU position, in parallel); a ring all-gather over NVLink finishes. Time:
    (g-1)/g * B / bw_nvl + 2(g-1) alpha_nvl (both intra-node halves) plus the
    ring all-reduce of B/g bytes over n/g nodes.
    """
    g = min(n, cluster.gpus_per_node)
    intra = 2 * (g - 1) / g * nbytes / cluster.nvlink_bytes_per_s + 2 * (g - 1) * cluster.nvlink_alpha_s
    if n <= g:
        return intra
    return intra + ring_allreduce_seconds(n // g, nbytes / g, cluster.ib_bytes_per_s, cluster.ib_alpha_s)


def efficiency(t_compute: float, t_comm: float, overlap: bool) -> float:
    """t_compute / t_step; with overlap the all-reduce hides behind the backward (2/3 of the compute)."""
    hidden = BACKWARD_SHARE * t_compute
    t_step = t_compute - hidden + max(hidden, t_comm) if overlap else t_compute + t_comm
    return t_compute / t_step


def predict(step_s: float, grad_bytes: float, cluster: Cluster = Cluster(),
            gpus: Sequence[int] = PREDICTED_GPUS) -> dict[str, dict[str, float]]:
    """By GPU count: the all-reduce time (ms) and the efficiency without and with overlap."""
    out = {}
    for n in gpus:
        t_ar = cluster_allreduce_seconds(n, grad_bytes, cluster)
        out[str(n)] = {"allreduce_ms": 1e3 * t_ar, "efficiency_no_overlap": efficiency(step_s, t_ar, False),
                       "efficiency_overlap": efficiency(step_s, t_ar, True)}
    return out


def assumptions(cluster: Cluster, gpu_step: str, per_gpu_batch: Mapping[str, int]) -> dict[str, Any]:
    return {**asdict(cluster), "gradient_dtype": "float32", "per_gpu_batch": dict(per_gpu_batch),
            "topology": "one flat ring; across nodes bandwidth and latency are InfiniBand's "
                        "(NCCL's tree and NVLS algorithms would shorten the latency term)",
            "overlap": "all-reduce hidden behind the backward, taken as 2/3 of the compute",
            "gpu_step": gpu_step}
