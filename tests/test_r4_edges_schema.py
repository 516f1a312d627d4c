"""uniqueItems is one pass, and every kind of schema work is paid from the call's budget
(issue 28, item 14).

Specification: section 13's contract: enum, const and uniqueItems compare JSON values (1 and
1.0 alike, an object's keys in any order); one call's PatternWork pays for every pattern
searched, every subschema applied and every value compared, and what it cannot pay for makes
the call INVALID at once, never a stall.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from conftest import AGENTGATE, Host  # noqa: E402
from kit import expect, pin, result_text, rule, scripted_server, tool, write_config  # noqa: E402

TAGS = {"type": "object", "properties": {
    "tags": {"type": "array", "uniqueItems": True, "items": {"type": ["string", "integer"]}},
    "codes": {"type": "array", "items": {"allOf": [{"type": "integer"}] * 10}}}}


def P(value):
    """A Python value as the gate would have parsed it (numbers become Number)."""
    return agentgate.parse(json.dumps(value).encode())


def spent(schema, value) -> int:
    work = agentgate.PatternWork()
    agentgate.validate(P(schema), P(value), work=work)
    return agentgate.PATTERN_WORK - work.left


def test_the_work_of_unique_items_grows_with_the_array_not_its_square():
    schema = {"type": "array", "uniqueItems": True}
    costs = [spent(schema, [f"tag-{i}" for i in range(n)]) for n in (0, 1000, 2000, 4000)]
    step = costs[1] - costs[0]
    assert step > 0
    assert costs == [costs[0], costs[0] + step, costs[0] + 2 * step, costs[0] + 4 * step]


@pytest.mark.parametrize("items", [
    "[1, 1.0]", "[0, -0]", "[1e300, 10e299]", "[[1], [1.0]]", "[2, 1, 0.2e1]",
    '[{"a": 1, "b": [2]}, {"b": [2.0], "a": 1}]', '["x", "y", "x"]', "[null, null]"])
def test_items_json_schema_calls_equal_are_found_repeated(items):
    with pytest.raises(agentgate.SchemaError, match="all different"):
        agentgate.validate(P({"uniqueItems": True}), agentgate.parse(items))


def test_items_of_different_kinds_are_different():
    agentgate.validate(P({"uniqueItems": True}), P(
        [1, True, "1", [1], {"a": 1}, None, False, 0, "", [], {}, {"a": True}, [[]]]))
    agentgate.validate(P({"uniqueItems": True}), agentgate.parse("[1e300, 1e299, 1.5, 15e-2]"))


def test_a_schema_that_applies_itself_exponentially_is_refused_not_run():
    defs = {"d0": {"type": "string"}}
    for level in range(1, 19):
        defs[f"d{level}"] = {"allOf": [{"$ref": f"#/$defs/d{level - 1}"}] * 2}
    schema = P({"$defs": defs, "$ref": "#/$defs/d18"})
    assert agentgate.schema_problem(schema) == ""
    with pytest.raises(agentgate.PatternCost, match="too large to be checked"):
        agentgate.validate(schema, "tag")


def test_enum_and_const_are_paid_for_too():
    items = 1000 // agentgate.EQUALITY_STEP
    for schema, value in (({"const": list(range(items))}, list(range(items))),
                          ({"enum": [[1]] * items}, [2])):
        work = agentgate.PatternWork()
        work.left = 1000
        with pytest.raises(agentgate.PatternCost, match="too large to be checked"):
            agentgate.validate(P(schema), P(value), work=work)


# ---------------------------------------------------------------- through a real gate


def tagger(workdir) -> Path:
    spec = {"tools": [tool("tag", TAGS, "Tag a thing.")]}
    config = write_config(workdir, [scripted_server(workdir, spec, name="svc", rules={
        "tag": rule("read_only")})])
    pin(config)
    return config


def test_a_large_array_of_distinct_tags_is_judged_and_a_repeat_found(workdir):
    tags = [f"tag-{i:07d}" for i in range(13_000)]
    assert len(json.dumps(tags)) > 160_000
    with Host([sys.executable, str(AGENTGATE), "-config", str(tagger(workdir))]) as host:
        assert result_text(host.call("svc_tag", {"tags": tags})) == "called tag"
        text = expect(host.call("svc_tag", {"tags": [*tags, 7, tags[6000]]}), "INVALID", True)
        assert "/tags: expected items that are all different" in text, text
        text = expect(host.call("svc_tag", {"tags": [*tags, 7, 7.0]}), "INVALID", True)
        assert "/tags: expected items that are all different" in text, text


def test_an_array_past_the_budget_is_refused_with_a_clear_answer(workdir):
    many = list(range(agentgate.PATTERN_WORK // agentgate.SCHEMA_STEP // 10))
    with Host([sys.executable, str(AGENTGATE), "-config", str(tagger(workdir))]) as host:
        text = expect(host.call("svc_tag", {"codes": many}), "INVALID", True)
        assert "/codes/" in text and "too large to be checked against the schema" in text, text
        assert result_text(host.call("svc_tag", {"codes": many[:1000]})) == "called tag"


@pytest.mark.parametrize("index", ["²", "١", "0x1", "-1"])
def test_a_ref_whose_index_is_not_an_ascii_number_points_at_nothing(index):
    # "²".isdigit() holds, and int("²") raised: the tool was refused as
    # "could not be read (ValueError)" instead of saying where the $ref points.
    schema = {"type": "object", "allOf": [{}, {}],
              "properties": {"a": {"$ref": f"#/allOf/{index}"}}}
    said = agentgate.schema_problem(schema)
    assert said == f'$ref "#/allOf/{index}" points at nothing in the schema'
    with pytest.raises(agentgate.SchemaError, match="points at nothing"):
        agentgate.validate(schema, {"a": 1})
