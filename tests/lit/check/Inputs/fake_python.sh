#!/bin/sh
# Stands in for the checker's Python in tests/lit/check: prints the arguments dcplan check passes
# and the predicted step of the curve it simulated (which must exist while the checker runs);
# FAKE_MODE=no-package prints what Python prints without the dcplan package, FAKE_MODE=depart
# ends as the checker does for a departure (exit 1).
echo "checker args: $*"
curve=""
prev=""
for a in "$@"; do
  [ "$prev" = "--curve" ] && curve=$a
  prev=$a
done
if [ -n "$curve" ]; then
  echo "curve: $(grep -o '"step_us": [0-9.]*' "$curve")"
  echo "$curve" > "$FAKE_CURVE_PATH_FILE"
fi
case "${FAKE_MODE:-}" in
  no-package) echo "/usr/bin/python3: Error while finding module specification for 'dcplan.check_replay' (ModuleNotFoundError: No module named 'dcplan')"; exit 1;;
  depart) echo "replay.0.jsonl: departs from the plan (1 differences)"; exit 1;;
esac
exit 0
