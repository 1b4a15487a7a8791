#!/usr/bin/env bash
# The GPU benchmarks in one go, on a machine with CUDA. Installs nothing.
#
#   bash benchmarks/gpu_check.sh OUT_DIR [GW_RUN] [CHEM_RUN]
#
# Each step runs under its own time limit (together 8 minutes at most, on one GPU):
#   gemm on cuda: fp64, fp32, tf32, bf16, fp16 at 512..8192      -> OUT/gemm_gpu.{json,png}
#   collectives over NCCL, one rank per GPU (1 GPU: world 1)     -> OUT/allreduce_gpu.{json,png}
#   DDP training over NCCL on 1, 2, 4, ... GPUs, the reference
#   models whose packages import (mlp always)                    -> OUT/ddp_gpu.{json,png}
#   simulator vs surrogate on cuda, for the apps whose packages
#   import (gw: lalsuite; chem: pyscf, ase)                      -> OUT/surrogate_gpu.{json,png}
#   converge bench serve on cuda, when GW_RUN is given and
#   fastapi/uvicorn/httpx import                                 -> OUT/serve_gpu.{json,png}
# Everything said, and each step's output, goes to OUT/gpu_check.log. A step that fails or is
# skipped does not stop the others; the exit status is the number of failed steps.
# Copy OUT's files into benchmarks/results/ and `python -m converge.bench.report` shows them
# beside the CPU ones.
set -u
out=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR [GW_RUN] [CHEM_RUN]}
gw_run=${2:-}
chem_run=${3:-}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
log="$out/gpu_check.log"
: >"$log"
failed=0

say() { echo "$*" | tee -a "$log"; }

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    say "== $name (at most ${limit} s)"
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    say "== $name: exit $rc after $((SECONDS - t0)) s$([ $rc -eq 124 ] && echo ' (time limit)')"
    [ $rc -eq 0 ] || failed=$((failed + 1))
}

imports() { "$py" -c "import $1" >/dev/null 2>&1; }

if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >>"$log" 2>&1; then
    say "no CUDA device visible to $py: nothing to run"
    exit 2
fi
nvidia-smi >>"$log" 2>&1 || say "nvidia-smi did not run"
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
say "$gpus GPU(s); $("$py" -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))")"

step gemm 75 "$py" -m converge.bench.gemm --device cuda --target-s 0.3 --out "$out" --stem gemm_gpu

if [ "$gpus" -eq 1 ]; then
    say "collectives: one GPU, so one rank: each collective is a local copy (busbw 0 but for broadcast)"
fi
step allreduce 75 "$py" -m converge.bench.collectives --device cuda --world "$gpus" --max-bytes 1G --target-s 0.1 \
    --out "$out" --stem allreduce_gpu

models=mlp
imports "converge.apps.gw.app" && models=gw,$models
imports "converge.apps.chem" && models=$models,chem
step ddp 60 "$py" -m converge.bench.ddp --device cuda --models "$models" --steps 30 --out "$out" --stem ddp_gpu

apps=""
if imports "lal, lalsimulation"; then apps=gw; else say "surrogate gw skipped: lalsuite does not import"; fi
if imports "pyscf, ase"; then apps=${apps:+$apps,}chem; else say "surrogate chem skipped: pyscf or ase does not import"; fi
if [ -n "$apps" ]; then
    args=(--device cuda --apps "$apps" --threads "$(nproc)" --results-dir benchmarks/results --out "$out"
          --stem surrogate_gpu)
    [ -n "$gw_run" ] && [[ $apps == *gw* ]] && args+=(--run "gw=$gw_run")
    [ -n "$chem_run" ] && [[ $apps == *chem* ]] && args+=(--run "chem=$chem_run")
    step surrogate 180 "$py" -m converge.bench.surrogate "${args[@]}"
fi

if [ -z "$gw_run" ]; then
    say "serve skipped: give a trained run as GW_RUN"
elif ! imports "fastapi, uvicorn, httpx"; then
    say "serve skipped: fastapi, uvicorn or httpx does not import"
else
    step serve 90 "$py" -c "
import sys
from converge.bench.serve import ServeBenchConfig, run_serve_benchmark, write_results
cfg = ServeBenchConfig(concurrencies=(1, 8, 64), duration_s=2.0, device='cuda')
report = run_serve_benchmark(sys.argv[1], cfg, log_dir=sys.argv[2])
print(write_results({report['app']: report}, sys.argv[2], 'serve_gpu'))" "$gw_run" "$out"
fi

say "done: $failed step(s) failed; results in $out"
exit "$failed"
