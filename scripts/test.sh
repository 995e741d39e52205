#!/usr/bin/env bash
# The README's test command: installs what is missing, builds, and runs every test:
# the CPU build (unit, golden and multi-process tests) and the planner/CLI under
# AddressSanitizer + UBSan. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
jobs=$(nproc)

echo "== CPU build (preset cpu)"
cmake --preset cpu
cmake --build --preset cpu -j "$jobs"
echo "== tests (preset cpu)"
ctest --preset cpu -j "$jobs"

echo "== AddressSanitizer build (preset asan: schemas, planner, CLI)"
cmake --preset asan
cmake --build --preset asan -j "$jobs"
echo "== tests (preset asan)"
ctest --preset asan -j "$jobs"
