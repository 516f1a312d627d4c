"""The JSON Schema library (agentgate's "JSON Schema") against an independent validator.

A seeded corpus of schemas in the part of draft 2020-12 agentgate supports, each with values
near and far from it, goes to agentgate.validate and to the jsonschema package's
Draft202012Validator (a dependency of the mcp SDK the tests install): every value must be
accepted by both or refused by both.

What differs on purpose is kept out of the corpus:
- Numbers. agentgate compares the exact decimals of the literals; jsonschema compares the
  floats json.loads makes of them, so {"multipleOf": 0.1} refuses 0.3 there and takes it here.
  The corpus's literals are short enough for a float to tell any two apart, and its
  multipleOf steps are integers or halves and quarters, which a float divides exactly.
- Patterns. agentgate searches as ECMA-262 does ("ECMA-262 patterns"); jsonschema uses Python's re,
  whose \\d, \\w and \\s take non-ASCII characters and whose $ matches before a final newline.
  The corpus's patterns use only what both read alike: letters, digits, classes of ranges,
  `.`, anchors, groups, alternation and quantifiers, on texts with no line terminator.
- The older spellings agentgate reads too (items as a list, additionalItems, dependencies,
  draft-04's boolean exclusiveMinimum) mean something else or nothing in 2020-12.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402

NUMBERS = ["0", "1", "-1", "2", "3", "4", "7", "10", "100", "-0.5", "0.5", "1.5", "2.5",
           "1.0", "1e1", "2.50", "0.25", "-3"]
STEPS = ["1", "2", "3", "0.5", "0.25"]
NAMES = ["a", "b", "c", "ab", "\u00e9"]
TEXTS = ["", "a", "b", "ab", "abc", "ba", "AB", "a1", "10", "cab", "\u00e9t\u00e9", "a-b",
         "a c", "bbb", "A"]
PATTERNS = ["^a", "b$", "^[a-c]+$", "[0-9]", "^(ab|ba)", "a.c", "^.{2,3}$", "A?b", "^[^a]*$",
            "\u00e9", "^$", "(a|b){2}", "c+", "^[A-Z]"]
TYPES = ["object", "array", "string", "number", "integer", "boolean", "null"]


def gen_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["num", "num", "str", "str", "bool", "null"]
                      + (["list", "dict", "dict"] if depth < 2 else []))
    if kind == "num":
        return agentgate.Number(rng.choice(NUMBERS))
    if kind == "str":
        return rng.choice(TEXTS)
    if kind == "bool":
        return rng.choice([True, False])
    if kind == "null":
        return None
    if kind == "list":
        return [gen_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {name: gen_value(rng, depth + 1) for name in rng.sample(NAMES, rng.randint(0, 3))}


def number(rng):
    return agentgate.Number(rng.choice(NUMBERS))


def count(rng):
    return agentgate.Number(str(rng.randint(0, 3)))


def gen_schema(rng: random.Random, depth: int = 0, defs=()):
    """A schema of the supported 2020-12 subset, with a few keywords."""
    if rng.random() < 0.06:
        return rng.choice([True, False])
    schema = {}
    deeper = depth < 2

    def sub():
        return gen_schema(rng, depth + 1, defs)
    for _ in range(rng.randint(1, 3)):
        family = rng.choice(["type", "number", "string", "array", "object", "values",
                             "combine", "combine", "ref"])
        if family == "type":
            schema["type"] = rng.choice(TYPES) if rng.random() < 0.7 else rng.sample(TYPES, 2)
        elif family == "number":
            key = rng.choice(["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                              "multipleOf"])
            schema[key] = agentgate.Number(rng.choice(STEPS)) if key == "multipleOf" \
                else number(rng)
        elif family == "string":
            key = rng.choice(["minLength", "maxLength", "pattern", "format"])
            schema[key] = rng.choice(PATTERNS) if key == "pattern" else "date" \
                if key == "format" else count(rng)
        elif family == "array":
            key = rng.choice(["items", "prefixItems", "minItems", "maxItems", "uniqueItems",
                              "contains"])
            if key == "items" and deeper:
                schema["items"] = sub()
            elif key == "prefixItems" and deeper:
                schema["prefixItems"] = [sub() for _ in range(rng.randint(1, 2))]
            elif key == "contains" and deeper:
                schema["contains"] = sub()
                for bound in ("minContains", "maxContains"):
                    if rng.random() < 0.4:
                        schema[bound] = count(rng)
            elif key == "uniqueItems":
                schema["uniqueItems"] = rng.choice([True, False])
            elif key in ("minItems", "maxItems"):
                schema[key] = count(rng)
        elif family == "object":
            key = rng.choice(["properties", "required", "additionalProperties",
                              "patternProperties", "propertyNames", "minProperties",
                              "maxProperties", "dependentRequired", "dependentSchemas"])
            if key == "required":
                schema["required"] = rng.sample(NAMES, rng.randint(0, 2))
            elif key in ("minProperties", "maxProperties"):
                schema[key] = count(rng)
            elif key == "dependentRequired":
                schema[key] = {rng.choice(NAMES): rng.sample(NAMES, rng.randint(0, 2))}
            elif key == "additionalProperties" and (not deeper or rng.random() < 0.5):
                schema[key] = rng.choice([True, False])
            elif key == "propertyNames":
                schema[key] = {"pattern": rng.choice(PATTERNS)} if rng.random() < 0.5 \
                    else {"maxLength": count(rng)}
            elif deeper and key == "patternProperties":
                schema[key] = {rng.choice(PATTERNS): sub()}
            elif deeper and key == "dependentSchemas":
                schema[key] = {rng.choice(NAMES): sub()}
            elif deeper:
                schema[key if key != "patternProperties" else "properties"] = {
                    name: sub() for name in rng.sample(NAMES, rng.randint(1, 3))}
        elif family == "values":
            if rng.random() < 0.5:
                schema["const"] = gen_value(rng, 1)
            else:
                schema["enum"] = [gen_value(rng, 1) for _ in range(rng.randint(1, 3))]
        elif family == "combine" and deeper:
            key = rng.choice(["allOf", "anyOf", "oneOf", "not", "if"])
            if key == "not":
                schema["not"] = sub()
            elif key == "if":
                schema["if"] = sub()
                for branch in ("then", "else"):
                    if rng.random() < 0.7:
                        schema[branch] = sub()
            else:
                schema[key] = [sub() for _ in range(rng.randint(1, 3))]
        elif family == "ref" and defs:
            schema["$ref"] = "#/$defs/" + rng.choice(defs)
    return schema


def gen_case(rng: random.Random):
    """A root schema (with $defs its $refs point at, which hold no $ref) and its values."""
    names = ["d0", "d1"]
    defs = {name: gen_schema(rng, 1) for name in names}
    root = gen_schema(rng, 0, tuple(names))
    if isinstance(root, dict):
        root["$defs"] = defs
    values = [gen_value(rng) for _ in range(6)]
    values += [root.get("const", None) if isinstance(root, dict) else None]
    if isinstance(root, dict) and root.get("enum"):
        values.append(rng.choice(root["enum"]))
    if isinstance(root, dict) and "properties" in root:
        values.append({name: gen_value(rng, 1) for name in root["properties"]})
    return root, values


def ours(schema, value) -> bool:
    try:
        agentgate.validate(schema, value)
        return True
    except agentgate.SchemaError:
        return False


def theirs(schema_text: str, value_text: str) -> bool:
    return Draft202012Validator(json.loads(schema_text)).is_valid(json.loads(value_text))


def corpus(seed: int, size: int):
    rng = random.Random(seed)
    for _ in range(size):
        root, values = gen_case(rng)
        # Each side reads the same text: agentgate through its boundary check, jsonschema
        # through json.loads.
        schema_text = agentgate.policy_json(root)
        for value in values:
            yield schema_text, agentgate.policy_json(value)


SEEDS = range(8)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_validator_accepts_and_refuses_what_jsonschema_does(seed):
    disagreements = []
    for schema_text, value_text in corpus(seed, 60):
        schema = agentgate.parse(schema_text)
        assert agentgate.schema_problem(schema) == "", schema_text
        verdict = ours(schema, agentgate.parse(value_text))
        if verdict != theirs(schema_text, value_text):
            disagreements.append(f"{schema_text} {value_text}: agentgate says {verdict}")
    assert disagreements == [], "\n".join(disagreements[:10])


def test_the_corpus_is_large_mixed_and_uses_every_keyword():
    outcomes, keywords = [], set()

    def collect(node):
        if isinstance(node, dict):
            keywords.update(node)
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)
    for seed in SEEDS:
        for schema_text, value_text in corpus(seed, 60):
            collect(json.loads(schema_text))
            outcomes.append(theirs(schema_text, value_text))
    assert len(outcomes) >= 3000
    assert 0.25 < sum(outcomes) / len(outcomes) < 0.75
    supported = {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                 "multipleOf", "minLength", "maxLength", "pattern", "format", "items",
                 "prefixItems", "minItems", "maxItems", "uniqueItems", "contains",
                 "minContains", "maxContains", "properties", "required",
                 "additionalProperties", "patternProperties", "propertyNames", "minProperties",
                 "maxProperties", "dependentRequired", "dependentSchemas", "const", "enum",
                 "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$defs"}
    assert supported <= keywords, supported - keywords
