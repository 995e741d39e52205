"""python -m dcplan.check_replay PLAN REPLAY_LOG...: did each rank follow the plan? (exit 0 yes, 1 no, 2 usage)

The replay logs come from DCPLAN_REPLAY_LOG (docs/replay.md); the comparison is
dcplan.replay_differences: prefetch groups, buckets, the kept set, one gather per
persistent parameter and step, departures.
"""
from ._plan import main

if __name__ == "__main__":
    raise SystemExit(main())
