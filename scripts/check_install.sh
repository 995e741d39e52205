#!/usr/bin/env bash
# `pip install .` as a new user runs it: into a fresh venv that has only torch (the release the
# machine's Python has, pinned), then, from another directory, the `dcplan` command, `import
# dcplan` from the venv (not the checkout), and a short 2-rank training run on the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
venv=${1:-build/venv-install}
torch_version=$(python3 -c "import torch; print(torch.__version__.split('+')[0])")

rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install -q "torch==$torch_version" numpy
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
