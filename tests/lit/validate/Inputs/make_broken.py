#!/usr/bin/env python3
"""Writes the broken inputs of validate-errors.test from the minimal valid files.

Each case is one mistake a user or a buggy recorder can make. Run it again after
changing the minimal files: python3 make_broken.py (from this folder).
"""
import copy
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
INPUTS = os.path.join(HERE, "..", "..", "Inputs")
trace = json.load(open(os.path.join(INPUTS, "minimal.trace.json")))
plan = json.load(open(os.path.join(INPUTS, "minimal.plan.json")))


def fwd(t):
    return t["steps"][0]["graphs"][0]["events"]


def bwd(t):
    return t["steps"][0]["graphs"][1]["events"]


def edit(doc, fn):
    doc = copy.deepcopy(doc)
    fn(doc)
    return doc


def set_(path, value):
    def fn(doc):
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return fn


def delete(path):
    def fn(doc):
        node = doc
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return fn


CASES = {
    # Raw text cases: not JSON documents at all.
    "empty.json": "",
    "not-json.json": '{"schema": "dcplan.trace/v1",\n  "meta": [1, 2,,]\n}\n',
    "truncated.json": json.dumps(trace)[:200],
    "duplicate-key.json": '{"schema": "dcplan.trace/v1", "meta": {"world_size": 2, "world_size": 4}}\n',
    "top-level-array.json": "[1, 2, 3]\n",
    # Documents with one mistake each.
    "no-schema.json": edit(trace, delete(["schema"])),
    "wrong-version.json": edit(trace, set_(["schema"], "dcplan.trace/v2")),
    "unknown-schema.json": edit(trace, set_(["schema"], "chakra.et/v1")),
    "missing-field.json": edit(trace, delete(["meta", "world_size"])),
    "wrong-type.json": edit(trace, set_(["meta", "world_size"], "2")),
    "zero-world-size.json": edit(trace, set_(["meta", "world_size"], 0)),
    "bad-stage.json": edit(trace, set_(["meta", "stage"], 4)),
    "negative-numel.json": edit(trace, set_(["params", 1, "numel"], -3)),
    "negative-bytes.json": edit(trace, lambda t: fwd(t)[0].update(bytes=-48)),
    "numel-not-shape.json": edit(trace, set_(["params", 0, "numel"], 13)),
    "bad-shard-numel.json": edit(trace, set_(["params", 1, "shard_numel"], 1)),
    "duplicate-id.json": edit(trace, set_(["params", 1, "id"], 0)),
    "dangling-id.json": edit(trace, lambda t: bwd(t)[3].update(ds_id=7)),
    "unknown-op.json": edit(trace, lambda t: fwd(t)[1].update(op="wait_gather")),
    "unknown-dtype.json": edit(trace, set_(["meta", "param_dtype"], "fp8")),
    "unknown-field.json": edit(trace, lambda t: fwd(t)[2].update(durations=[1])),
    "seq-out-of-order.json": edit(trace, lambda t: fwd(t)[2].update(seq=5)),
    "end-before-start.json": edit(trace, lambda t: fwd(t)[0].update(start_us=5.0, end_us=2.5)),
    "time-backwards.json": edit(trace, lambda t: bwd(t)[3].update(start_us=10.0, end_us=30.0)),
    "calibration-unsorted.json": edit(trace, lambda t: t["calibration"]["all_gather"].reverse()),
    "no-steps.json": edit(trace, set_(["steps"], [])),
    "plan-wrong-signature.json": edit(plan, set_(["source", "param_signature"], "md5:1234")),
    "plan-persistent-unsorted.json": edit(plan, set_(["persistent"], [3, 1])),
    "plan-bucket-overlap.json": edit(plan, lambda p: p["graphs"][1]["buckets"].append(
        {"ds_ids": [1], "bytes": 16, "dtype": "float32"})),
    "plan-bad-strategy.json": edit(plan, set_(["options", "strategy"], "fastest")),
}

for name, doc in CASES.items():
    text = doc if isinstance(doc, str) else json.dumps(doc, indent=2) + "\n"
    with open(os.path.join(HERE, name), "w") as f:
        f.write(text)
print(f"wrote {len(CASES)} files")
