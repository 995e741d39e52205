#!/usr/bin/env bash
# The README's demo: installs what is missing, builds dcplan, and runs it on the
# example trace of a small Llama-style model on 2 ranks (validate, then inspect).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
cmake --preset cpu >/dev/null
cmake --build --preset cpu -j "$(nproc)" --target dcplan_cli
dcplan=build/cpu/bin/dcplan
trace=examples/llama-tiny.trace.json

echo
echo "\$ dcplan validate $trace"
"$dcplan" validate "$trace"
echo
echo "\$ dcplan inspect $trace"
"$dcplan" inspect "$trace"
