#!/usr/bin/env bash
# The README's demo: installs what is missing, installs dcplan (pip install .), then runs the whole
# pipeline on the example Llama-style model on 2 CPU ranks (Gloo):
# record a trace -> plan it -> inspect the plan -> train with the plan, and prints the
# losses next to those of the same training without a plan.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
# dcplan as a user installs it (pip install ., pyproject.toml), into the checkout's .venv, which
# sees the torch setup.sh found or installed.
[ -x .venv/bin/python ] || python3 -m venv --system-site-packages .venv
echo "\$ pip install .   # into .venv: builds the runtime against the installed torch (a few minutes, once)"
.venv/bin/pip install -q .
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1
unset PYTHONPATH DCPLAN_BUILD_DIR
work=$(mktemp -d)
train=(python -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_llama.py --steps 10)

run() { echo; echo "\$ $*"; "$@"; }
run dcplan record --steps 5 -o "$work/trace.json" -- "${train[@]}"   # 5 steps after 2 warm-up steps: the median of 5 is steadier than of 3
run dcplan plan "$work/trace.json" -o "$work/plan.json"
run dcplan inspect "$work/plan.json"
echo; echo "\$ ${train[*]}   # without a plan"
"${train[@]}" --losses "$work/no-plan.json" >/dev/null
echo "\$ DCPLAN_PLAN=plan.json DCPLAN_REPLAY_LOG=replay.{rank}.jsonl ${train[*]}"
DCPLAN_PLAN="$work/plan.json" DCPLAN_REPLAY_LOG="$work/replay.{rank}.jsonl" "${train[@]}" --losses "$work/plan.json.losses" >/dev/null
run dcplan check "$work/plan.json" "$work/replay.0.jsonl" "$work/replay.1.jsonl"
echo
python - "$work/no-plan.json" "$work/plan.json.losses" <<'PY'
import json, sys
a, b = (json.load(open(p))["losses"] for p in sys.argv[1:])
print("step   loss without plan   loss with plan")
for i, (x, y) in enumerate(zip(a, b)):
    print(f"{i:4d}   {x:17.6f}   {y:14.6f}")
print("identical" if a == b else "DIFFERENT")
sys.exit(0 if a == b else 1)
PY
rm -rf "$work"
