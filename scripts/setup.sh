#!/usr/bin/env bash
# Installs what dcplan needs to build and test, only what is missing:
# Debian packages (compiler tools, CLI11, nlohmann-json, GoogleTest, FileCheck/lit)
# and Python packages (torch 2.13.0 CPU if no torch is importable, pytest, jsonschema, transformers,
# lightning).
set -euo pipefail

need_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

debian_packages=(cmake ninja-build ccache g++ libcli11-dev nlohmann-json3-dev libgtest-dev libgmock-dev
                 pybind11-dev llvm-14-tools procps)
missing=()
for p in "${debian_packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  need_root apt-get update -q
  need_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi

PYTHON=${PYTHON:-python3}
# A torch that is already there (2.11 to 2.14, CPU or CUDA) is used as it is; otherwise
# the pinned CPU build. Never let pip resolve an unpinned torch: several GB of CUDA wheels.
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing torch==2.13.0"
  "$PYTHON" -m pip install -q torch==2.13.0
fi
py_missing=()
for m in pytest jsonschema; do
  "$PYTHON" -c "import $m" >/dev/null 2>&1 || py_missing+=("$m")
done
# The transformers models of tests/train and examples/train_transformers.py (the version the
# tests were written against; it does not depend on torch, so pip leaves torch as it is).
"$PYTHON" -c "import transformers" >/dev/null 2>&1 || py_missing+=("transformers==5.23.0")
# The Lightning strategy's test (tests/train/test_lightning.py); lightning needs torch>=2.1, which
# the torch above satisfies, so pip leaves it as it is.
"$PYTHON" -c "import lightning" >/dev/null 2>&1 || py_missing+=("lightning==2.6.6")
if [ ${#py_missing[@]} -gt 0 ]; then
  echo "setup: installing Python packages: ${py_missing[*]}"
  "$PYTHON" -m pip install -q "${py_missing[@]}"
fi
