#!/usr/bin/env python3
"""expect_exit.py CODE COMMAND...: runs COMMAND, passing its output through, and
succeeds only when it exits with CODE (so a test pins the exact exit code)."""
import subprocess
import sys

expected = int(sys.argv[1])
code = subprocess.call(sys.argv[2:])
if code != expected:
    print(f"expect_exit: {sys.argv[2]} exited with {code}, expected {expected}", file=sys.stderr)
    sys.exit(1)
