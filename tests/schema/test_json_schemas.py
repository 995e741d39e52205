"""The published JSON Schemas agree with dcplan's validator: the good files pass
both; the broken files that break the structure fail both; the broken files that
break a cross-field rule (docs/formats.md, "rule") pass the schema and are caught
by `dcplan validate` (tests/lit/validate/errors.test)."""
import json
import pathlib

import jsonschema
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BROKEN = ROOT / "tests/lit/validate/Inputs"
SCHEMAS = {
    "dcplan.trace/v1": json.loads((ROOT / "schemas/trace.v1.schema.json").read_text()),
    "dcplan.plan/v1": json.loads((ROOT / "schemas/plan.v1.schema.json").read_text()),
    "dcplan.network/v1": json.loads((ROOT / "schemas/network.v1.schema.json").read_text()),
}
TRACE_SCHEMA = SCHEMAS["dcplan.trace/v1"]
PLAN_SCHEMA = SCHEMAS["dcplan.plan/v1"]

STRUCTURAL = [
    "no-schema", "wrong-version", "unknown-schema", "missing-field", "wrong-type", "zero-world-size",
    "bad-stage", "negative-numel", "negative-bytes", "unknown-op", "unknown-dtype", "unknown-field",
    "no-steps", "top-level-array", "plan-wrong-signature", "plan-bad-strategy",
]
CROSS_FIELD = [
    "bad-shard-numel", "numel-not-shape", "duplicate-id", "dangling-id", "seq-out-of-order",
    "end-before-start", "time-backwards", "calibration-unsorted", "plan-persistent-unsorted",
    "plan-bucket-overlap",
]


def schema_for(doc, default):
    if isinstance(doc, dict) and doc.get("schema") in SCHEMAS:
        return SCHEMAS[doc["schema"]]
    return default


@pytest.mark.parametrize("schema", list(SCHEMAS.values()), ids=["trace", "plan", "network"])
def test_schemas_are_valid_draft_2020_12(schema):
    jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("path", [
    ROOT / "tests/lit/Inputs/minimal.trace.json",
    ROOT / "tests/lit/Inputs/minimal.plan.json",
    ROOT / "tests/lit/Inputs/two-ranks.network.json",
    *sorted((ROOT / "examples").glob("*.json")),
], ids=lambda p: p.name)
def test_good_files_match_their_schema(path):
    doc = json.loads(path.read_text())
    jsonschema.Draft202012Validator(SCHEMAS[doc["schema"]]).validate(doc)


def test_offload_fields_match_their_schema():
    """A trace with each shard's optimizer state and a plan that offloads it, as the recorder and
    the planner write them (docs/formats.md)."""
    trace = json.loads((ROOT / "tests/lit/Inputs/minimal.trace.json").read_text())
    for p in trace["params"]:
        p["optimizer_state_bytes"] = 8 * p["shard_numel"]
        p["optimizer_impl"] = "foreach"
        p["optimizer_group"] = 0
    plan = json.loads((ROOT / "tests/lit/Inputs/minimal.plan.json").read_text())
    plan["offload"] = {"optimizer_state": [{"ds_ids": [0], "bytes": 64}]}
    plan["predicted"].update(offload_bytes=64, reload_us=1.5, offload_us=2.5, exposed_copy_us=0.5)
    for doc in (trace, plan):
        jsonschema.Draft202012Validator(SCHEMAS[doc["schema"]]).validate(doc)


def test_a_plans_network_matches_its_schema():
    """A plan made with dcplan plan --network carries the network file's fields (docs/formats.md)."""
    network = json.loads((ROOT / "tests/lit/Inputs/two-ranks.network.json").read_text())
    plan = json.loads((ROOT / "tests/lit/Inputs/minimal.plan.json").read_text())
    plan["options"]["network"] = {"file": "two-ranks.network.json",
                                  **{k: v for k, v in network.items() if k not in ("schema", "created_by")}}
    jsonschema.Draft202012Validator(PLAN_SCHEMA).validate(plan)
    network["world_size"] = 1
    assert not jsonschema.Draft202012Validator(SCHEMAS["dcplan.network/v1"]).is_valid(network)


def test_the_calibration_is_defined_alike_in_every_schema():
    """A trace's calibration, a network file's and a plan's options.network are one object: each schema
    spells it out (a schema here refers to no other file), so they must not drift apart. Only a trace
    has graph_step_us: a network file times collectives alone, with no step to capture."""
    trace = dict(TRACE_SCHEMA["properties"]["calibration"])
    trace["properties"] = dict(trace["properties"])
    assert trace["properties"].pop("graph_step_us")["exclusiveMinimum"] == 0
    network = SCHEMAS["dcplan.network/v1"]["$defs"]["calibration"]
    in_plan = PLAN_SCHEMA["properties"]["options"]["properties"]["network"]["properties"]["calibration"]
    assert trace == network == in_plan
    curves = [TRACE_SCHEMA["$defs"]["curve"], SCHEMAS["dcplan.network/v1"]["$defs"]["curve"],
              PLAN_SCHEMA["$defs"]["curve"]]
    def resolved(curve):  # the trace's curve names its bytes and us by $ref
        text = json.dumps(curve)
        for name in ("bytes", "us"):
            text = text.replace(json.dumps({"$ref": f"#/$defs/{name}"}), json.dumps(TRACE_SCHEMA["$defs"][name]))
        return json.loads(text)

    assert resolved(curves[0]) == resolved(curves[1]) == resolved(curves[2])


@pytest.mark.parametrize("name", STRUCTURAL)
def test_structural_breakage_fails_the_schema(name):
    doc = json.loads((BROKEN / f"{name}.json").read_text())
    default = PLAN_SCHEMA if name.startswith("plan-") else TRACE_SCHEMA
    assert not jsonschema.Draft202012Validator(schema_for(doc, default)).is_valid(doc)


@pytest.mark.parametrize("name", CROSS_FIELD)
def test_cross_field_rules_are_beyond_the_schema(name):
    doc = json.loads((BROKEN / f"{name}.json").read_text())
    jsonschema.Draft202012Validator(SCHEMAS[doc["schema"]]).validate(doc)


def test_every_broken_input_is_classified():
    raw_text = {"empty", "not-json", "truncated", "duplicate-key"}
    names = {p.stem for p in BROKEN.glob("*.json")}
    assert names == set(STRUCTURAL) | set(CROSS_FIELD) | raw_text
