#!/usr/bin/env bash
# The README's test command: installs what is missing, builds, and runs every test:
# the CPU build (unit, golden and multi-process tests) and the planner/CLI under
# AddressSanitizer + UBSan, the CUDA compile check, and `pip install .` into a fresh venv.
# Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
jobs=$(nproc)
# ccache keys leave out the build directory (debug info would name it otherwise) and the
# checkout's own path (CCACHE_BASEDIR: a clone at another path compiles nothing twice), and both the
# CPU build and the pip install at the end call the compiler by one name (pip's build would pick
# g++ where CMake picks c++; ccache keys on the name), so that the pip install reuses what the
# CPU build compiled. Each step says when it starts.
export CCACHE_NOHASHDIR=true CCACHE_BASEDIR=${CCACHE_BASEDIR:-$(pwd -P)} CXX=${CXX:-g++} CC=${CC:-gcc}
step() { echo "== $* ($(date +%T))"; }

step "CPU build (preset cpu)"
cmake --preset cpu
cmake --build --preset cpu -j "$jobs"
step "tests (preset cpu)"
ctest --preset cpu -j "$jobs"

step "AddressSanitizer build (preset asan: schemas, planner, CLI)"
cmake --preset asan
cmake --build --preset asan -j "$jobs"
step "tests (preset asan)"
ctest --preset asan -j "$jobs"

# The CUDA path compiles (no GPU here to run it): against the CUDA torch wheel that this
# machine keeps offline, in a venv of its own so the CPU torch above stays as it is. The venv is
# the wheel's, not the checkout's: made once per machine (a clone at another path reuses it; a lock
# keeps two runs from making it at once), and made again where it does not import that torch.
wheels=/opt/pypi-more/files
cuda_version=2.14.1
cuda_torch=$wheels/torch-$cuda_version-cp311-cp311-manylinux_2_28_x86_64.whl
cuda_venv=${XDG_CACHE_HOME:-${HOME:-$PWD/build}/.cache}/dcplan/venv-cuda-torch-$cuda_version
# The venv takes 4.3 GiB (torch 1.2, its NVIDIA libraries 3.1: importing torch loads them all) and
# the build 0.3: a disk without room for them skips the check, saying so, rather than failing midway.
free_gib() { mkdir -p "$1" && df -Pk "$1" | awk 'NR == 2 { printf "%.1f", $4 / 1048576 }'; }
have_cuda_venv() {
  "$cuda_venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__ != '$cuda_version+cu130')" >/dev/null 2>&1
}
if have_cuda_venv; then cuda_need_gib=0; else cuda_need_gib=5; fi
if [ ! -f "$cuda_torch" ] || [ ! -x /usr/local/cuda-13.0/bin/nvcc ]; then
  step "SKIPPED: CUDA compile check (no CUDA torch wheel at $cuda_torch or no nvcc 13.0)"
elif awk -v f="$(free_gib "$(dirname "$cuda_venv")")" -v n="$cuda_need_gib" 'BEGIN { exit !(f < n) }' \
  || awk -v f="$(free_gib .)" 'BEGIN { exit !(f < 0.5) }'; then
  step "SKIPPED: CUDA compile check (needs ${cuda_need_gib} GiB free for $cuda_venv and 0.5 GiB in $PWD, \
$(free_gib "$(dirname "$cuda_venv")") and $(free_gib .) GiB available)"
else
  step "CUDA compile check (torch $cuda_version+cu130 in $cuda_venv, no GPU: compile only)"
  (
    flock 9
    if ! have_cuda_venv; then
      rm -rf "$cuda_venv"
      python3 -m venv --system-site-packages "$cuda_venv"
      "$cuda_venv/bin/pip" install -q --no-cache-dir --no-index --no-deps --find-links "$wheels" "$cuda_torch" \
        "$wheels"/nvidia_*.whl
    fi
  ) 9> "$cuda_venv.lock"
  (
    flock -s 9  # shared: another run may build against the venv too, but not make it again meanwhile
    TORCH_CUDA_ARCH_LIST=9.0 cmake -S . -B build/cuda-compile -G Ninja -DDCPLAN_WITH_CUDA=ON -DDCPLAN_BUILD_TESTS=OFF \
      -DPython3_EXECUTABLE="$cuda_venv/bin/python" -DCUDAToolkit_ROOT=/usr/local/cuda-13.0 \
      -DCUDA_TOOLKIT_ROOT_DIR=/usr/local/cuda-13.0 -DCMAKE_CUDA_COMPILER=/usr/local/cuda-13.0/bin/nvcc
    cmake --build build/cuda-compile --target dcplan_python -j "$jobs"
  ) 9> "$cuda_venv.lock"
fi

step "pip install . into a fresh venv (scripts/check_install.sh)"
bash scripts/check_install.sh
