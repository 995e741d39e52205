import sys
sys.path[:0] = ["tests/gpu", "tests/python", "tests/train"]
import graphed_cases as gc
from mp_harness import run_ranks

if __name__ == "__main__":
    res = run_ranks(gc.worker, 1, [("compiled", 3, 1)], "cuda")
    for k, v in res[0].items():
        print(k, v.get("error", "")[-5000:] if "error" in v else "ok")
