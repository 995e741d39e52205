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
env -u PYTHONPATH -u DCPLAN_BUILD_DIR OMP_NUM_THREADS=1 "$venv/bin/python" -m torch.distributed.run --standalone \
  --nproc-per-node 2 "$repo/examples/train_llama.py" --steps 2 | tail -2
echo "check_install: ok"
