#!/usr/bin/env bash
# Builds the CUDA path, runs the GPU tests and the FSDP2 comparison on a 2-GPU machine.
#   bash bench/gpu/run_on_box.sh [tests|bench|all] [extra args for the benchmark]
# Logs and JSON results go to $OUT (default: build/cuda/bench-out).
set -euo pipefail
cd "$(dirname "$0")/../.."
what=${1:-all}
shift || true
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} PYTHONUNBUFFERED=1
PY=${PY:-$(command -v python3)}
[ -x /opt/torch/.venv/bin/python3 ] && PY=${PY_OVERRIDE:-/opt/torch/.venv/bin/python3}
OUT=${OUT:-build/cuda/bench-out}
mkdir -p "$OUT"
nvidia-smi -L || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version(), 'cxx11 abi', torch._C._GLIBCXX_USE_CXX11_ABI)"
start=$(date +%s)
cmake -S . -B build/cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DDCPLAN_WITH_CUDA=ON -DPython3_EXECUTABLE="$PY" \
  -DDCPLAN_BUILD_TESTS=OFF > /tmp/dcplan-configure.log 2>&1 || { tail -40 /tmp/dcplan-configure.log; exit 1; }
cmake --build build/cuda --target dcplan_python -j "$(nproc)" > build/cuda/build.log 2>&1 || { grep -E "error|FAILED" build/cuda/build.log | head -40; exit 1; }
echo "built in $(( $(date +%s) - start )) s"
export DCPLAN_BUILD_DIR=$PWD/build/cuda PYTHONPATH=$PWD/python
if [ "$what" = tests ] || [ "$what" = all ]; then
  "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/tests.log" | tail -30 || true
  # The plan replay cases of tests/replay on 2 GPUs (NCCL transport).
  (cd tests/replay && "$PY" -m pytest -q -rs -p no:cacheprovider -k nccl . 2>&1) | tee "$OUT/replay-tests.log" | tail -30 || true
fi
run() { "$PY" -m torch.distributed.run --nproc-per-node 2 bench/gpu/fsdp_vs_dcplan.py "$@"; }
if [ "$what" = bench ] || [ "$what" = all ]; then
  run --label comm-heavy --batch 1 --seq 1024 --json "$OUT/comm.json" "$@" 2>&1 | tee "$OUT/comm.log" | grep -v "^\[" || true
  run --label compute-heavy --batch 4 --seq 2048 --json "$OUT/compute.json" "$@" 2>&1 | tee "$OUT/compute.log" | grep -v "^\[" || true
fi
if [ "$what" = plan ] || [ "$what" = all ]; then
  # Record a trace of the default schedule, plan it three ways (unconstrained and at FSDP2's
  # peak memory), and replay the plans.
  cmake --build build/cuda --target dcplan_cli -j "$(nproc)" >> build/cuda/build.log 2>&1 || { grep -E "error|FAILED" build/cuda/build.log | head; exit 1; }
  D=build/cuda/bin/dcplan
  P=build/cuda/plans
  mkdir -p "$P"
  shape() { case $1 in comm) echo "--batch 1 --seq 1024";; compute) echo "--batch 4 --seq 2048";; esac; }
  for sh in ${PLAN_SHAPES:-comm compute}; do
    rec="$P/trace-$sh.json"
    $D record -o "$rec" --steps 3 --warmup 2 --timeout 240 -- "$PY" -m torch.distributed.run --nproc-per-node 2 \
      bench/gpu/fsdp_vs_dcplan.py --modes dcplan $(shape $sh) --warmup 2 --steps 10 2>&1 | grep -v "^\[\|UserWarning\|_warn_once" | tail -60 || continue
    budget=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['results']['fsdp2']['peak_bytes'])" "$OUT/$sh.json" 2>/dev/null || true)
    plans=""
    for st in ${PLAN_STRATEGIES:-heuristic optimized}; do
      $D plan "$rec" -o "$P/plan-$sh-$st.json" --strategy $st | tail -4 && plans="$plans $P/plan-$sh-$st.json"
      if [ -n "$budget" ]; then
        $D plan "$rec" -o "$P/plan-$sh-$st-fsdpmem.json" --strategy $st --memory-budget "$budget" | tail -4 \
          && plans="$plans $P/plan-$sh-$st-fsdpmem.json"
      fi
    done
    for p in $plans; do
      echo "== replay $p"
      run --label "$sh $(basename "$p" .json)" --modes dcplan --plan "$p" $(shape $sh) "$@" 2>&1 | grep -v "^\[" | tail -6 || true
    done
  done
fi
[ -d build/cuda/plans ] && tar czf "$OUT/plans.tgz" -C build/cuda plans
echo "total $(( $(date +%s) - start )) s"
