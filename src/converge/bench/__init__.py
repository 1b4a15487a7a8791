"""Platform benchmarks: serving throughput and latency (:mod:`.serve`) and the load generator behind it
(:mod:`.loadgen`). Nothing is imported here, so the load generator's process stays lean."""
