#!/usr/bin/env bash
# Builds the CUDA path, runs the GPU tests and the FSDP2 comparison on a 2-GPU machine.
#   bash bench/gpu/run_on_box.sh tests               # GPU tests + plan replay tests on NCCL
#   bash bench/gpu/run_on_box.sh build               # only build (a fresh machine has no build)
#   bash bench/gpu/run_on_box.sh bench [args]         # fsdp_vs_dcplan.py with these arguments only
#   bash bench/gpu/run_on_box.sh train [args]         # transformers Llama with a checkpoint; pip install .
#   bash bench/gpu/run_on_box.sh predict [budget]     # record, plan at $BUDGETS, replay, check_replay --curve;
#       $ROUNDS: timed again without the replay log, interleaved; GRAPHED=1: the step in one CUDA graph
#       (--cuda-graph: recorded uncaptured, planned with the device's own times, replayed captured)
#   bash bench/gpu/run_on_box.sh hostvar            # CPUs' and GPU clocks' share in one plan's step varying from
#       process to process: each CPU probed alone, the default plan replayed on the fastest, slowest and all
#   FROM=M NPROC=N bash bench/gpu/run_on_box.sh whatif  # the predict model recorded on M GPUs (default 1) and
#       planned for N (M=1: --network, measured on N; else --world-size), beside a trace of N's plan; both
#       replayed on N, checked, timed over $ROUNDS (GRAPHED=1 as in predict)
#   bash bench/gpu/run_on_box.sh calibrate          # the closed loop: the predict model recorded, planned ($BUDGET:
#       --memory-budget), replayed with the log and checked; planned again with --calibrate on those logs, the
#       calibrated plan replayed and checked (its prediction against the next replay); both timed over $ROUNDS
#   bash bench/gpu/run_on_box.sh compiled comm|compute [args]  # compiled replay: GPU tests, then a
#       trace of the compiled model, its plan, and fsdp2, fsdp2-compiled, dcplan, dcplan-compiled
#       (default schedule and the plan) and the bound in one process, interleaved over rounds
#   bash bench/gpu/run_on_box.sh graphed comm|compute [args]  # a step in one CUDA graph, predicted against
#       measured: the bench's model recorded with $GMODE (dcplan-graphed or dcplan-compiled-graphed), planned
#       for the hooks (hooks.json, --no-cuda-graph) and for the graph (graph.json), each replayed the way it
#       was planned for, in one process, interleaved over $ROUNDS rounds, with the bound
#   bash bench/gpu/run_on_box.sh offload comm|compute  # planned offload at $BUDGETS of the on-device floor
#       against fsdp2 and fsdp2-offload (CPUOffloadPolicy), in one process
#   bash bench/gpu/run_on_box.sh breakdown comm|compute [args]  # the graphed step's device time by category
#       against the device's own bounds (bench/gpu/device_breakdown.py); NOPLAN=1: default schedule;
#       ADAMW="fused": only the fused AdamW's step (default "foreach fused")
#   bash bench/gpu/run_on_box.sh deepspeed comm|compute [args]  # DeepSpeed ZeRO-3 eager and DeepCompile
#       (wheels from .whl, carried) against $MODES (default fsdp2,dcplan-compiled,bound; $PLAN: a
#       compiled plan), separate processes in turn over $ROUNDS rounds, merged into one table
#   bash bench/gpu/run_on_box.sh comm|compute [args]  # one shape, everything in order (BENCH_MODEL=transformers
#       in any of the bench's targets: a transformers LlamaForCausalLM of the same sizes, recorded too):
#       1. fsdp2, dcplan (default schedule) and the compute-only bound;
#       2. dcplan record of the default schedule;
#       3. dcplan plan: heuristic, optimized, and optimized with FSDP2's measured peak as budget
#          (where the planner finds that below what any schedule needs: dcplan default's peak);
#       4. fsdp2 and the three plans again, in one process (same machine state).
# Logs, JSON results, traces and plans go to $OUT (default: build/cuda/bench-out).
set -euo pipefail
cd "$(dirname "$0")/../.."
what=${1:-tests}
shift || true
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} PYTHONUNBUFFERED=1
PY=${PY:-$(command -v python3)}
[ -x /opt/torch/.venv/bin/python3 ] && PY=${PY_OVERRIDE:-/opt/torch/.venv/bin/python3}
OUT=${OUT:-build/cuda/bench-out}
mkdir -p "$OUT"
nvidia-smi -L || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())"
start=$(date +%s)
# The system compiler: its libstdc++ is the one Python loads (the machine's CXX,
# /opt/gcc/bin/g++, is newer and its code crashes in that libstdc++; docs/gpu.md).
CXX=${DCPLAN_CXX:-$( [ -x /usr/bin/g++ ] && echo /usr/bin/g++ || command -v g++ )}
CC=${DCPLAN_CC:-$( [ -x /usr/bin/gcc ] && echo /usr/bin/gcc || command -v gcc )}
export CXX CC
# A build dir configured with another compiler keeps objects built by it: start over.
if [ -f build/cuda/CMakeCache.txt ] && ! grep -q "CMAKE_CXX_COMPILER:.*=$CXX\$" build/cuda/CMakeCache.txt; then
  rm -rf build/cuda
fi
cmake -S . -B build/cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DDCPLAN_WITH_CUDA=ON -DPython3_EXECUTABLE="$PY" \
  -DCMAKE_C_COMPILER="$CC" -DCMAKE_CXX_COMPILER="$CXX" -DCMAKE_CUDA_HOST_COMPILER="$CXX" -DDCPLAN_BUILD_TESTS=OFF > /tmp/dcplan-configure.log 2>&1 || { tail -40 /tmp/dcplan-configure.log; exit 1; }
cmake --build build/cuda --target dcplan_python dcplan_cli -j "$(nproc)" > build/cuda/build.log 2>&1 \
  || { grep -E "error|FAILED" build/cuda/build.log | head -40; exit 1; }
echo "built in $(( $(date +%s) - start )) s"
export DCPLAN_BUILD_DIR=$PWD/build/cuda PYTHONPATH=$PWD/python
bench() { "$PY" -m torch.distributed.run --nproc-per-node "${NPROC:-2}" bench/gpu/fsdp_vs_dcplan.py "$@"; }
# The two benchmark shapes: shape_args comm|compute MODE sets $args (the bench's shape arguments, and
# --model $BENCH_MODEL where set: transformers, a LlamaForCausalLM of the same sizes).
shape_args() {
  case $1 in
    comm) args="--batch 1 --seq 1024 --label comm-heavy";;
    compute) args="--batch 4 --seq 2048 --label compute-heavy";;
    *) echo "run_on_box.sh $2: expected comm or compute, got '$1'" >&2; exit 2;;
  esac
  args="$args ${BENCH_MODEL:+--model $BENCH_MODEL}"
}
# record_bench TRACE MODE WARMUP TIMEOUT: `dcplan record` (3 steps after WARMUP) of the bench's model run in
# MODE on $NPROC GPUs (default 2) with the shape's $args.
record_bench() {
  build/cuda/bin/dcplan record -o "$1" --steps 3 --warmup "$3" --timeout "$4" -- "$PY" -m torch.distributed.run \
    --nproc-per-node "${NPROC:-2}" bench/gpu/fsdp_vs_dcplan.py --modes "$2" $args --warmup 3 --steps 10
}
report() { "$PY" bench/gpu/predict_report.py "$@"; }
quiet() { grep -v "^\[\|UserWarning\|_warn_once\|^W1\|^\*\*\*\|OMP_NUM_THREADS" || true; }

# The predict and whatif targets' model: examples/train_llama.py at the reference size (hidden 2048,
# 16 layers, $BATCH x $SEQ tokens per GPU, default 1x1024, bf16 gathers, fp32 reduce; $PREDICT_ARGS:
# more of its arguments, e.g. --compile). GRAPHED=1: its --cuda-graph, and plans made --cuda-graph.
# --lr 1e-4, the bench's: the example's default 1e-2 made this size diverge (losses 10.5 to 26).
graphed=${GRAPHED:-0}
# fastest_cpus N PROBE: the N CPUs a host_probe.py JSON found launching kernels fastest, comma-separated
# (-N: the N slowest).
fastest_cpus() {
  "$PY" -c "import json,sys; n=int(sys.argv[1]); o=json.load(open(sys.argv[2]))['order']; \
print(','.join(map(str, o[:n] if n > 0 else o[n:])))" "$1" "$2"
}
# PIN=fast: every process of the predict target's model (the recording and the replays) runs
# on the 4 CPUs a GPU that launch kernels fastest (bench/gpu/host_probe.py, at the start; probed again
# at the end, to see whether the same CPUs stayed fast): this machine's CPUs differ up to 2x in speed
# (docs/benchmarks.md, "Host CPUs"), and a host-bound step follows the CPUs its process lands on. Measured
# there: which CPUs are fast changes within minutes, so pinning did not steady the step.
pin=()
pin_cpus() {
  [ "${PIN:-}" = fast ] || return 0
  "$PY" bench/gpu/host_probe.py --json "$1" | tail -3
  local cpus; cpus=$(fastest_cpus $((4 * $2)) "$1")
  pin=(taskset -c "$cpus")
  echo "PIN=fast: the model's processes run on CPUs $cpus"
}
plan_args=(); [ "$graphed" = 1 ] && plan_args=(--cuda-graph)
# llama_on N: the torchrun arguments of that model on N GPUs, in $T.
llama_on() {
  T=(-m torch.distributed.run --nproc-per-node "$1" examples/train_llama.py --device cuda --hidden 2048
     --layers 16 --heads 16 --vocab 32000 --seq "${SEQ:-1024}" --batch "${BATCH:-1}" --param-dtype bfloat16
     --reduce-dtype float32 --lr 1e-4 ${PREDICT_ARGS:-} "${plan_args[@]}")
}
# record_llama TRACE N: `dcplan record` of the model on N GPUs (3 steps after 2), its log beside TRACE.
# 12 steps: GRAPHED=1 captures the step after the recorded ones and times 4 replays (graph_step_us: the
# median of the 3 after the first).
record_llama() {
  llama_on "$2"
  "${pin[@]}" build/cuda/bin/dcplan record -o "$1" --steps 3 --warmup 2 --timeout 240 -- "$PY" "${T[@]}" --steps 12 \
    2>&1 | tee "${1%.json}.record.log" | quiet | tail -4
  grep -h "Warning: record" "${1%.json}.record.log" | sort -u || true
}
# replay_llama DIR NAME N TRACE: the plan DIR/NAME.json (of TRACE) replayed on N GPUs with a replay log
# and checked against its memory curve (DIR/NAME.check; GRAPHED=1: its graph replays' device times and
# peak, without the curve, which a captured step's log has no ops for), then timed without the log,
# whose own host work lies inside a logged step (rank 0's step lines, DIR/NAME.steps, median of steps
# 4-11).
replay_llama() {
  local d=$1 name=$2 curve=()
  llama_on "$3"
  build/cuda/bin/dcplan inspect "$d/$name.json" --trace "$4" --memory-curve "$d/$name.curve.json" > /dev/null
  [ "$graphed" != 1 ] && curve=(--curve "$d/$name.curve.json")
  DCPLAN_PLAN="$d/$name.json" DCPLAN_REPLAY_LOG="$d/$name.{rank}.jsonl" "${pin[@]}" "$PY" "${T[@]}" --steps 12 2>&1 \
    | quiet \
    | tail -1
  "$PY" -m dcplan.check_replay "$d/$name.json" "$d/$name".[0-9]*.jsonl "${curve[@]}" > "$d/$name.check" || true
  # GRAPHED=1: the replays' device times are the step (the script's host loop, which reads each
  # loss, paces its step lines: 40.8 ms a step where the graph replayed in 23.5, 1xH200).
  if [ "$graphed" != 1 ]; then
    # --line-buffered: a run that never ends (4d2fae4) still leaves the steps it made.
    DCPLAN_PLAN="$d/$name.json" "${pin[@]}" "$PY" "${T[@]}" --steps 12 2>&1 | grep --line-buffered "^step \|^peak memory" \
      > "$d/$name.steps" || true
    report one-run "$d/$name.steps" "$d/$name.json" >> "$d/$name.check" || true
  fi
  echo "== $name"; grep -v "^  graph\|follows" "$d/$name.check" | head -14
}
# timed_rounds DIR N "NAMES": $ROUNDS > 1: the plans again on N GPUs without the log, interleaved (one
# machine's host drifts from run to run); then each plan's predicted step against its rounds' median.
timed_rounds() {
  local d=$1 r name
  llama_on "$2"
  for r in $(seq 2 "${ROUNDS:-1}"); do
    for name in $3; do
      DCPLAN_PLAN="$d/$name.json" "${pin[@]}" "$PY" "${T[@]}" --steps 12 2>&1 | grep --line-buffered "^step \|^peak memory" \
        > "$d/$name.steps.$r" || true
    done
  done
  echo "== predicted against measured without the log, ${ROUNDS:-1} round(s) interleaved"
  for name in $3; do
    report rounds "$name" "$d/$name.json" "$d/$name".steps* || true
  done
}

case "$what" in
  build) ;;
  tests)
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/tests.log" | tail -5 || true
    # The plan replay cases of tests/replay on 2 GPUs (NCCL transport).
    (cd tests/replay && DCPLAN_TEST_VERBOSE=1 "$PY" -m pytest -q -rs -p no:cacheprovider -k nccl . 2>&1) \
      | tee "$OUT/replay-tests.log" | tail -5 || true
    ;;
  bench)
    bench "$@" 2>&1 | tee "$OUT/bench.log" | quiet
    ;;
  train)
    # A transformers Llama (0.3B, from a config) for 20 steps, bf16, with a DCP save at step 10,
    # a new model and optimizer loaded from it, and the losses compared with 20 steps straight;
    # sdpa, then eager attention with activation checkpointing and save_pretrained.
    gpus=${NPROC:-$(nvidia-smi -L | wc -l)}
    L=(examples/train_transformers.py --device cuda --hidden 1024 --layers 8 --heads 16 --kv-heads 4 --vocab 32000
       --seq 1024 --batch 2 --param-dtype bfloat16 --steps 20 --save-at 10 --check-resume)
    "$PY" -m torch.distributed.run --nproc-per-node "$gpus" "${L[@]}" "$@" 2>&1 | tee "$OUT/train-sdpa.log" | quiet \
      || echo "train_transformers (sdpa) FAILED: exit code 1 is also a resume that is not exact"
    "$PY" -m torch.distributed.run --nproc-per-node "$gpus" "${L[@]}" --attn eager --activation-checkpointing \
      --save-pretrained "$OUT/pretrained" "$@" 2>&1 | tee "$OUT/train-eager-ac.log" | quiet \
      || echo "train_transformers (eager, checkpointing) FAILED"
    # pip install . as on a machine without network, into the torch venv (the build backend from
    # there, or from wheels carried in .whl: scikit-build-core, pathspec).
    if ! "$PY" -c "import scikit_build_core" 2>/dev/null; then
      "$PY" -m pip install -q --no-index --no-deps .whl/scikit_build_core-*.whl .whl/pathspec-*.whl
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -Ccmake.define.DCPLAN_WITH_CUDA=ON \
      -Ccmake.define.CMAKE_CUDA_HOST_COMPILER="$CXX" . 2>&1 | tail -3
    bin=$(dirname "$PY")
    (cd /tmp && "$bin/dcplan" --version && env -u PYTHONPATH -u DCPLAN_BUILD_DIR \
      "$PY" -c "import dcplan; print('import dcplan:', dcplan.__file__, 'nccl', dcplan._C.has_nccl())")
    env -u PYTHONPATH -u DCPLAN_BUILD_DIR "$PY" -m torch.distributed.run --nproc-per-node "$gpus" \
      examples/train_llama.py --device cuda --steps 3 2>&1 | quiet | tail -3
    ;;
  predict)
    # The memory model and check_replay on GPUs: the predict model (llama_on) recorded, then planned
    # and replayed with a replay log for each of $BUDGETS (default "default 0.97 1.0 1.05": the default
    # schedule, and budgets at those fractions of its predicted peak; or "$1", one budget;
    # $PREDICT_ARGS: more arguments of the example, e.g. --compile); check_replay --curve compares each
    # plan's prediction, op by op, with every rank's allocation log. Ends with a table of all plans.
    # GRAPHED=1: the example's --cuda-graph and plans with --cuda-graph; a replay log cannot watch a
    # captured step, so each plan is only timed, with the peak the run reports; then each plan's
    # prediction from the same trace without op_device_us (what the ops' own device work adds).
    P=$OUT/predict
    mkdir -p "$P"
    gpus=${NPROC:-$(nvidia-smi -L | wc -l)}
    pin_cpus "$P/probe.json" "$gpus"
    record_llama "$P/trace.json" "$gpus"
    build/cuda/bin/dcplan inspect "$P/trace.json" | grep "per step:" || true
    build/cuda/bin/dcplan plan "$P/trace.json" -o "$P/default.json" --strategy default "${plan_args[@]}" > /dev/null
    names=""
    for b in ${1:-${BUDGETS:-default 0.97 1.0 1.05}}; do
      case $b in
        default) name=default;;
        0.*|1.*) name=budget-$b; budget=$(report budget "$b" "$P/default.json")
           build/cuda/bin/dcplan plan "$P/trace.json" -o "$P/$name.json" --memory-budget "$budget" "${plan_args[@]}" > /dev/null \
             || { echo "$name: refused"; continue; };;
        *) name=budget-$b; build/cuda/bin/dcplan plan "$P/trace.json" -o "$P/$name.json" --memory-budget "$b" \
             "${plan_args[@]}" > /dev/null || { echo "$name: refused"; continue; };;
      esac
      replay_llama "$P" "$name" "$gpus" "$P/trace.json"
      names="$names $name"
    done
    timed_rounds "$P" "$gpus" "$names"
    [ "${PIN:-}" = fast ] && { echo "== the CPUs probed again"; "$PY" bench/gpu/host_probe.py | tail -3; }
    if [ "$graphed" = 1 ]; then
      # What the ops' own device work (op_device_us) adds: each plan's options again, on the trace without it.
      report strip-op-device "$P/trace.json" "$P/trace.no-op-device.json"
      for name in $names; do
        # shellcheck disable=SC2046  # the options are words
        build/cuda/bin/dcplan plan "$P/trace.no-op-device.json" -o "$P/$name.no-op-device.json" --cuda-graph \
          $(report plan-args "$P/$name.json") > /dev/null \
          && report with-without "$name" "$P/$name.json" "$P/$name.no-op-device.json" || true
      done
    fi
    ;;
  hostvar)
    # Why one plan's eager step varies from process to process (issue 29): the machine's CPUs and
    # the GPU's clocks (nvidia-smi dmon beside the whole run, $P/dmon.txt), each CPU's speed alone
    # (bench/gpu/host_probe.py), then the predict model recorded once on one GPU and its default
    # plan replayed on the 4 CPUs that launch fastest, on the 4 slowest, and on all, and the script
    # without a plan on all, $ROUNDS rounds (default 2) interleaved.
    P=$OUT/hostvar
    mkdir -p "$P"
    lscpu | grep -E "Model name|^CPU\(s\)|NUMA|MHz|Thread|Socket" || true
    nvidia-smi -q -d PERFORMANCE,CLOCK | grep -vE "^$|^=|Timestamp|Driver|CUDA|Attached" | head -40 || true
    nvidia-smi dmon -s pc -d 1 -o T > "$P/dmon.txt" 2>&1 &
    dmon=$!
    trap 'kill "$dmon" 2>/dev/null || true' EXIT  # a run that fails early leaves no dmon behind
    "$PY" bench/gpu/host_probe.py --json "$P/probe.json"
    fast=$(fastest_cpus 4 "$P/probe.json") slow=$(fastest_cpus -4 "$P/probe.json") all=$(fastest_cpus 999 "$P/probe.json")
    echo "fastest CPUs $fast, slowest $slow"
    record_llama "$P/trace.json" 1
    build/cuda/bin/dcplan plan "$P/trace.json" -o "$P/default.json" --strategy default > /dev/null
    llama_on 1
    for r in $(seq 1 "${ROUNDS:-2}"); do
      for set in fast slow all noplan; do
        case $set in fast) c=$fast;; slow) c=$slow;; *) c=$all;; esac
        plan=("DCPLAN_PLAN=$P/default.json"); [ "$set" = noplan ] && plan=()
        env "${plan[@]}" taskset -c "$c" "$PY" "${T[@]}" --steps 12 2>&1 | grep --line-buffered "^step \|^peak memory" \
          > "$P/$set.steps.$r" || true
      done
    done
    kill "$dmon" 2>/dev/null || true
    build/cuda/bin/dcplan inspect "$P/trace.json" | grep "per step:" || true
    for set in fast slow all noplan; do report rounds "$set" "$P/default.json" "$P/$set".steps.* || true; done
    awk 'NR<=2 || NR%10==0' "$P/dmon.txt" | head -60 || true  # head's early exit is not a failure
    ;;
  whatif)
    # A plan for another world size against the measured step: the predict model (llama_on)
    # recorded on $FROM GPUs (default 1) and planned for $NPROC (default: all): from one GPU with
    # the collectives measured on $NPROC (torchrun -m dcplan.measure_network, dcplan plan
    # --network), from more with --world-size; beside it the plan of a trace recorded on $NPROC.
    # Both replayed on $NPROC with the log and checked, then timed without it over $ROUNDS rounds.
    gpus=${NPROC:-$(nvidia-smi -L | wc -l)}
    from=${FROM:-1}
    if [ "$from" = "$gpus" ]; then
      echo "run_on_box.sh whatif: FROM and NPROC are both $gpus: nothing to compare" >&2
      exit 2
    fi
    P=$OUT/whatif-$from-to-$gpus
    mkdir -p "$P"
    echo "== record on $from GPU(s), and on $gpus"
    record_llama "$P/trace-$from.json" "$from"
    record_llama "$P/trace-$gpus.json" "$gpus"
    if [ "$from" = 1 ]; then
      "$PY" -m torch.distributed.run --nproc-per-node "$gpus" -m dcplan.measure_network -o "$P/network.json" \
        --device cuda 2>&1 | quiet | tail -3
      whatif_args=(--network "$P/network.json")
    else
      whatif_args=(--world-size "$gpus")
    fi
    echo "== plan the $from-GPU trace for $gpus (${whatif_args[*]}), and the $gpus-GPU trace"
    build/cuda/bin/dcplan plan "$P/trace-$from.json" -o "$P/from-$from.json" "${whatif_args[@]}" "${plan_args[@]}" \
      | grep "predicted" || true
    build/cuda/bin/dcplan plan "$P/trace-$gpus.json" -o "$P/from-$gpus.json" "${plan_args[@]}" | grep "predicted" \
      || true
    replay_llama "$P" "from-$from" "$gpus" "$P/trace-$from.json"
    replay_llama "$P" "from-$gpus" "$gpus" "$P/trace-$gpus.json"
    timed_rounds "$P" "$gpus" "from-$from from-$gpus"
    ;;
  calibrate)
    # The closed loop of issue 29 (docs/planning.md, "Calibrated on a replay"): on $NPROC GPUs (default:
    # all), the predict model's plan (unconstrained, or under --memory-budget $BUDGET) replayed with the
    # log; planned again from those logs; the calibrated plan replayed with the log, which `dcplan check`
    # compares with its prediction; then both timed without the log, interleaved over $ROUNDS rounds.
    # GRAPHED=1: the step in one CUDA graph, calibrated on its replays' device times (options.device_scale).
    gpus=${NPROC:-$(nvidia-smi -L | wc -l)}
    P=$OUT/calibrate
    mkdir -p "$P"
    budget_args=()
    [ -n "${BUDGET:-}" ] && budget_args=(--memory-budget "$BUDGET")
    record_llama "$P/trace.json" "$gpus"
    build/cuda/bin/dcplan plan "$P/trace.json" -o "$P/first.json" "${budget_args[@]}" > /dev/null
    replay_llama "$P" first "$gpus" "$P/trace.json"
    names=first
    if build/cuda/bin/dcplan plan "$P/trace.json" -o "$P/calibrated.json" "${budget_args[@]}" \
         --calibrate "$P"/first.[0-9]*.jsonl > "$P/calibrate.log" 2>&1; then
      grep "calibrated on a replay\|captured:" "$P/calibrate.log" || true
      replay_llama "$P" calibrated "$gpus" "$P/trace.json"
      names="first calibrated"
    else
      cat "$P/calibrate.log"  # refused: says why
    fi
    [ "$graphed" = 1 ] || timed_rounds "$P" "$gpus" "$names"
    ;;
  offload)
    # Planned offload against FSDP2's CPUOffloadPolicy, one shape (comm|compute) on $NPROC GPUs
    # (default: all): the bench's model recorded (dcplan mode), planned without a budget and at
    # $BUDGETS (fractions of the least any schedule needs with the optimizer state on the device,
    # default "0.8 0.6 0.4"; "floor": just above the least with all of it offloaded); each plan's
    # offload as inspect shows it; then fsdp2, fsdp2-offload and dcplan with each plan in one
    # process, $ROUNDS rounds interleaved (default 1).
    sh=${1:-comm}
    shift || true
    shape_args "$sh" "$what"
    export NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
    P=$OUT/offload-$sh
    mkdir -p "$P"
    D=build/cuda/bin/dcplan
    record_bench "$P/trace.json" dcplan 2 240 2>&1 | quiet | tail -1
    $D plan "$P/trace.json" -o "$P/free.json" > /dev/null
    least=$( ($D plan "$P/trace.json" -o "$P/x.json" --memory-budget 1 2>&1 || true) \
      | sed -n 's/.*offloaded[^:]*: at least \([0-9.]* [KMG]*i*B\).*/\1/p' | tr -d ' ')
    # Sizes as dcplan prints them ("7.82 GiB", spaces dropped) to bytes: FRACTION of SIZE.
    bytes_of() { "$PY" -c "import re,sys; n,u=re.fullmatch(r'([0-9.]+)(B|KiB|MiB|GiB)',sys.argv[2]).groups(); \
print(int(float(sys.argv[1])*float(n)*{'B':1,'KiB':2**10,'MiB':2**20,'GiB':2**30}[u]))" "$1" "$2"; }
    ondevice=$( ($D plan "$P/trace.json" -o "$P/x.json" --memory-budget "$(bytes_of 1.01 "$least")B" --explain \
      2>/dev/null || true) | sed -n 's/.*on the device (they need at least \([^)]*\)).*/\1/p' | tr -d ' ')
    # The last floor the refusal names: with every master shard offloaded too where it names one (ZeRO-3).
    echo "least with the optimizer state on the device: $ondevice; with all of it (and the master shards) offloaded: $least"
    plans=$P/free.json
    for f in ${BUDGETS:-0.8 0.6 0.4}; do
      if [ "$f" = floor ]; then b=$(bytes_of 1.01 "$least"); else b=$(bytes_of "$f" "$ondevice"); fi
      if $D plan "$P/trace.json" -o "$P/budget-$f.json" --memory-budget "${b}B" > /dev/null 2> "$P/budget-$f.err"; then
        echo "== budget-$f: $b bytes"; $D inspect "$P/budget-$f.json" | grep -E "offload:|^  plan "
        plans="$plans,$P/budget-$f.json"
      else
        echo "== budget-$f: $b bytes refused: $(tail -1 "$P/budget-$f.err")"
      fi
    done
    bench --modes fsdp2,fsdp2-offload,dcplan --plan "$plans" $args --warmup 3 --steps 10 --rounds "${ROUNDS:-1}" \
      --json "$P/bench.json" 2>&1 | quiet | tail -25
    ;;
  breakdown)
    # The graphed step's device time by category, against the device's own bounds and the
    # arithmetic floor (bench/gpu/device_breakdown.py), on $NPROC GPUs (default: all): the bench's
    # model recorded as dcplan-compiled-graphed, planned with --cuda-graph, run with that plan and
    # profiled. NOPLAN=1: the default schedule, without recording.
    sh=${1:-comm}
    shift || true
    shape_args "$sh" "$what"
    export NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
    P=$OUT/breakdown-$sh
    mkdir -p "$P"
    planarg=()
    if [ "${NOPLAN:-0}" != 1 ]; then
      # Recorded with the fused AdamW: a slow optimizer lets the device catch up with the host in
      # the device-lead step, and the trace then lacks optimizer_device_us.
      args="$args --adamw fused"
      record_bench "$P/trace.json" dcplan-compiled-graphed 2 400 2>&1 | tee "$P/record.log" \
        | grep "per step:\|Warning: record\|error" || true
      build/cuda/bin/dcplan plan "$P/trace.json" -o "$P/graph.json" --cuda-graph > "$P/plan.log" 2>&1 \
        || { cat "$P/plan.log"; exit 1; }
      head -6 "$P/plan.log"
      planarg=(--compiled-plan "$P/graph.json")
    fi
    "$PY" -m torch.distributed.run --nproc-per-node "$NPROC" bench/gpu/device_breakdown.py $args "${planarg[@]}" \
      --warmup 8 --steps 20 --profile-steps 5 --json "$P/breakdown.json" "$@" 2>&1 | tee "$P/breakdown.log" | quiet
    ;;
  graphed)
    sh=${1:-comm}
    shift || true
    shape_args "$sh" "$what"
    mode=${GMODE:-dcplan-graphed}
    plain=${mode%-graphed}
    planflag=--plan
    [ "$mode" = dcplan-compiled-graphed ] && planflag=--compiled-plan
    P=$OUT/graphed-$sh
    mkdir -p "$P"
    echo "== record ($mode: the step runs uncaptured while recorded)"
    record_bench "$P/trace.json" "$mode" 2 400 2>&1 | tee "$P/record.log" | grep "per step:\|Warning: record\|error" || true
    echo "== plan for the hooks, and for the graph"
    build/cuda/bin/dcplan plan "$P/trace.json" -o "$P/hooks.json" --no-cuda-graph > /dev/null
    build/cuda/bin/dcplan plan "$P/trace.json" -o "$P/graph.json" --cuda-graph --explain | grep "^replay\|^predicted"
    bench $args --modes "$plain,$mode,bound" "$planflag" "$P/hooks.json,$P/graph.json" --warmup 8 --steps 20 \
      --rounds "${ROUNDS:-2}" --profile-steps 3 --json "$P/modes.json" "$@" 2>&1 | tee "$P/modes.log" | quiet
    ;;
  comm|compute)
    sh=$what
    shape_args "$sh" "$what"
    P=$OUT/$sh
    mkdir -p "$P"
    echo "== 1. fsdp2, dcplan default, bound"
    bench $args --json "$P/default.json" "$@" 2>&1 | tee "$P/default.log" | quiet
    echo "== 2. record"
    record_bench "$P/trace.json" dcplan 2 240 2>&1 | quiet | tail -25
    budget=$(report bench-peak "$P/default.json" fsdp2)
    echo "== 3. plan (FSDP2 peak: $budget bytes)"
    plans=""
    for st in heuristic optimized; do
      build/cuda/bin/dcplan plan "$P/trace.json" -o "$P/$st.json" --strategy $st | tail -5 && plans="$plans,$P/$st.json"
    done
    if build/cuda/bin/dcplan plan "$P/trace.json" -o "$P/optimized-fsdp2-memory.json" --memory-budget "$budget" 2>&1 \
      | tail -5; then
      plans="$plans,$P/optimized-fsdp2-memory.json"
    else
      # Below the least any schedule needs (the optimizer step's, say): plan for what the
      # planner predicts for the default schedule (gather on use) instead, plus the 0.5% the
      # planner keeps back (kUnseenReserveShare).
      own=$(report default-budget "$P/optimized.json")
      echo "== 3b. plan for the default schedule's predicted peak instead ($own bytes)"
      build/cuda/bin/dcplan plan "$P/trace.json" -o "$P/optimized-default-memory.json" --memory-budget "$own" 2>&1 \
        | tail -5 && plans="$plans,$P/optimized-default-memory.json"
    fi
    echo "== 4. fsdp2 and the plans"
    bench $args --modes fsdp2,dcplan --plan "${plans#,}" --json "$P/plans.json" "$@" 2>&1 | tee "$P/plans.log" | quiet
    ;;
  compiled)
    sh=${1:-comm}
    shift || true
    shape_args "$sh" "$what"
    P=$OUT/compiled-$sh
    mkdir -p "$P"
    if [ -z "${SKIP_TESTS:-}" ]; then
      echo "== 1. compiled replay on NCCL against one GPU"
      "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu/test_gpu_compiled.py 2>&1 | tee "$P/tests.log" | tail -4 || true
    fi
    echo "== 2. record the compiled model"
    record_bench "$P/trace.json" dcplan-compiled 3 400 2>&1 | quiet | tail -3
    echo "== 3. plan"
    build/cuda/bin/dcplan plan "$P/trace.json" -o "$P/plan.json" | tail -6
    echo "== 4. every mode, interleaved"
    bench $args --modes "${MODES:-fsdp2,fsdp2-compiled,dcplan,dcplan-compiled,bound}" --compiled-plan "$P/plan.json" \
      --warmup 8 --steps 15 --rounds "${ROUNDS:-2}" --json "$P/modes.json" "$@" 2>&1 | tee "$P/modes.log" | quiet
    ;;
  deepspeed)
    sh=${1:-comm}
    shift || true
    shape_args "$sh" "$what"
    # DeepSpeed 0.19.8 as a pure wheel (DS_BUILD_OPS=0: its ops, DeepCompile's included, are built
    # on first use) and the dependencies the machine lacks, carried in .whl (docs/benchmarks.md).
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/site
    P=$OUT/deepspeed-$sh
    mkdir -p "$P"
    # --warmup 14: DeepCompile profiles and runs its passes at step 5.
    common=($args --warmup 14 --steps 15)
    # A failed process is reported (its log's end) and the rounds go on.
    for r in $(seq "${ROUNDS:-2}"); do
      bench "${common[@]}" --modes "${MODES:-fsdp2,dcplan-compiled,bound}" ${PLAN:+--compiled-plan "$PLAN"} \
        --json "$P/round$r-torch.json" "$@" > "$P/round$r-torch.log" 2>&1 || tail -25 "$P/round$r-torch.log"
      # DeepSpeed's op builder parses TORCH_CUDA_ARCH_LIST as numbers (not the machine's "9.0a").
      TORCH_CUDA_ARCH_LIST=9.0 bench "${common[@]}" --modes deepspeed,deepcompile --json "$P/round$r-deepspeed.json" \
        "$@" > "$P/round$r-deepspeed.log" 2>&1 || tail -25 "$P/round$r-deepspeed.log"
    done
    "$PY" bench/gpu/fsdp_vs_dcplan.py --merge "$P"/round*.json | tee "$P/merged.log"
    ;;
  *) echo "run_on_box.sh: expected build, tests, bench, train, predict, hostvar, whatif, graphed, compiled, deepspeed, comm or compute, got '$what'" >&2; exit 2 ;;
esac
echo "total $(( $(date +%s) - start )) s"
