#!/usr/bin/env bash
# `pip install .` as a new user runs it: into a fresh venv that sees the machine's torch (and
# nothing of dcplan), then, from another directory, the `dcplan` command, `import dcplan` from
# the venv (not the checkout), and a short 2-rank training run on the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
venv=${1:-build/venv-install}

rm -rf "$venv"
# --system-site-packages: the torch already installed, exactly (pip would resolve another build).
python3 -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q .
venv=$(cd "$venv" && pwd)

cd "$(mktemp -d)"
"$venv/bin/dcplan" --version
"$venv/bin/python" - "$venv" <<'PY'
import os, sys
import dcplan
where = os.path.dirname(dcplan.__file__)
assert where.startswith(sys.argv[1]), f"dcplan imported from {where}, not from the venv {sys.argv[1]}"
print(f"import dcplan: {where} (torch {dcplan._build_info.TORCH_VERSION})")
PY
# The README's pipeline with the installed command and package: record, plan, replay with the log, and
# `dcplan check`, which finds the venv's python3 beside itself (no DCPLAN_PYTHON, no checkout on the path).
train=("$venv/bin/python" -m torch.distributed.run --standalone --nproc-per-node 2 "$repo/examples/train_llama.py")
unset PYTHONPATH DCPLAN_BUILD_DIR DCPLAN_PYTHON
export OMP_NUM_THREADS=1
"${train[@]}" --steps 2 | tail -2
"$venv/bin/dcplan" record -o trace.json --steps 2 --warmup 1 -- "${train[@]}" --steps 4 2>/dev/null | tail -1
"$venv/bin/dcplan" plan trace.json -o plan.json > /dev/null
DCPLAN_PLAN=plan.json DCPLAN_REPLAY_LOG="replay.{rank}.jsonl" "${train[@]}" --steps 4 > /dev/null
"$venv/bin/dcplan" check plan.json replay.0.jsonl replay.1.jsonl --trace trace.json | grep "follows\|host time per op"
echo "check_install: ok"
