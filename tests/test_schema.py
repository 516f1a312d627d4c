"""The schema validator: the subset of JSON Schema real servers use (agentgate's "JSON Schema").

Specification: reference sections 12.4/12.5 and 19 (the validator subset), SPEC ("an INVALID
answer names the failing property path and what was expected"). Schemas and values are
parsed with agentgate.parse, as the gate parses them, so numbers are literals compared as
exact decimals. TestObjectSchema_RefusesAnythingElse is a load-time check of "Tools, as pinned" (an
input schema must be an object schema) and is tested with loading, not here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402

SchemaError = agentgate.SchemaError


def P(text: str):
    return agentgate.parse(text.encode("utf-8"))


def problem(schema: str) -> str:
    return agentgate.schema_problem(P(schema))


def passes(schema: str, value: str) -> None:
    assert problem(schema) == "", problem(schema)
    agentgate.validate(P(schema), P(value))


def fails(schema: str, value: str, *fragments: str) -> str:
    assert problem(schema) == "", problem(schema)
    with pytest.raises(SchemaError) as caught:
        agentgate.validate(P(schema), P(value))
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


PAYMENT = """{
  "type": "object",
  "properties": {
    "to": {"type": "string", "minLength": 1, "maxLength": 34},
    "amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
    "currency": {"enum": ["EUR", "USD"]},
    "mode": {"type": "string"},
    "payee": {"type": "object", "properties": {"iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}"}},
              "required": ["iban"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}
  },
  "required": ["to", "amount"],
  "additionalProperties": false
}"""


# ---------------------------------------------------------------- a realistic schema


def test_valid_arguments_pass():
    passes(PAYMENT, '{"to":"alice","amount":12.50,"currency":"EUR","tags":["rent"],"payee":{"iban":"DE12x"}}')


@pytest.mark.parametrize(
    "value, path, expected",
    [
        ('{"to":"a"}', "/amount", "required"),
        ('{"to":"a","amount":"12"}', "/amount", "expected number"),
        ('{"to":"a","amount":0}', "/amount", "greater than 0"),
        ('{"to":"a","amount":10000.01}', "/amount", "at most 10000"),
        ('{"to":"","amount":1}', "/to", "at least 1"),
        ('{"to":"a","amount":1,"currency":"GBP"}', "/currency", "one of"),
        ('{"to":"a","amount":1,"memo":"x"}', "/memo", "not allowed"),
        ('{"to":"a","amount":1,"payee":{}}', "/payee/iban", "required"),
        ('{"to":"a","amount":1,"payee":{"iban":"de12"}}', "/payee/iban", "pattern"),
        ('{"to":"a","amount":1,"tags":["x",2]}', "/tags/1", "expected string"),
        ('{"to":"a","amount":1,"tags":["a","b","c","d"]}', "/tags", "at most 3"),
    ],
)
def test_a_failure_names_the_property_path_and_what_was_expected(value, path, expected):
    message = fails(PAYMENT, value, expected)
    assert message.startswith(path + ":") or f"{path}:" in message, message


def test_a_failure_at_the_top_says_so():
    fails(PAYMENT, "[1,2]", "expected object", "array")


# ---------------------------------------------------------------- type


@pytest.mark.parametrize(
    "kind, good, bad",
    [
        ("object", "{}", "[]"),
        ("array", "[]", "{}"),
        ("string", '""', "1"),
        ("number", "1.5", '"1.5"'),
        ("integer", "1", "1.5"),
        ("boolean", "false", "0"),
        ("null", "null", "false"),
    ],
)
def test_type(kind, good, bad):
    passes(f'{{"type":"{kind}"}}', good)
    fails(f'{{"type":"{kind}"}}', bad, f"expected {kind}")


@pytest.mark.parametrize("value", ["1", "1.0", "1e2", "-0", "1.50e1", "100000000000000000000000"])
def test_an_integer_is_a_number_with_no_fraction(value):
    passes('{"type":"integer"}', value)


@pytest.mark.parametrize("value", ["1.5", "1e-1", "0.000000000000000000001"])
def test_a_fraction_is_not_an_integer(value):
    fails('{"type":"integer"}', value, "integer")


def test_an_integer_is_also_a_number_and_a_boolean_is_neither():
    passes('{"type":"number"}', "7")
    fails('{"type":"integer"}', "true", "integer")
    fails('{"type":"number"}', "false", "number")


def test_a_list_of_types():
    passes('{"type":["string","null"]}', "null")
    passes('{"type":["string","null"]}', '"x"')
    fails('{"type":["string","null"]}', "1", "string or null")


# ---------------------------------------------------------------- objects


def test_properties_and_required():
    schema = '{"properties":{"a":{"type":"string"}},"required":["a","b"]}'
    passes(schema, '{"a":"x","b":null}')
    fails(schema, '{"a":"x"}', "/b", "required")
    fails(schema, '{"a":1,"b":1}', "/a", "string")
    passes(schema, '"not an object"')  # object keywords apply to objects only


def test_additional_properties_false_lists_what_is_allowed():
    message = fails('{"properties":{"a":{},"b":{}},"additionalProperties":false}', '{"a":1,"c":2}', "/c", "not allowed")
    assert "a, b" in message


def test_additional_properties_as_a_schema():
    schema = '{"properties":{"a":{}},"additionalProperties":{"type":"string"}}'
    passes(schema, '{"a":1,"b":"x"}')
    fails(schema, '{"a":1,"b":2}', "/b", "expected string")


def test_pattern_properties():
    schema = '{"patternProperties":{"^x_":{"type":"integer"}},"additionalProperties":false}'
    passes(schema, '{"x_a":1}')
    fails(schema, '{"x_a":1.5}', "/x_a", "integer")
    fails(schema, '{"y":1}', "/y", "not allowed")


def test_min_and_max_properties_and_dependent_required():
    fails('{"minProperties":1}', "{}", "at least 1")
    fails('{"maxProperties":1}', '{"a":1,"b":2}', "at most 1")
    fails('{"dependentRequired":{"card":["cvc"]}}', '{"card":"x"}', "/cvc")
    passes('{"dependentRequired":{"card":["cvc"]}}', '{"iban":"x"}')


def test_a_boolean_schema():
    passes("true", '{"anything":[1]}')
    fails("false", "1", "no value")
    fails('{"properties":{"a":false}}', '{"a":1}', "/a")


# ---------------------------------------------------------------- enum and const


def test_enum_and_const_compare_json_values():
    passes('{"enum":[1,"a",null]}', "1.0")  # 1 and 1.0 are the same JSON number
    passes('{"enum":[1,"a",null]}', "null")
    fails('{"enum":[1,"a",null]}', "true", "one of")
    fails('{"enum":[1,"a",null]}', '"A"', "one of")
    passes('{"const":{"a":[1,2]}}', '{"a":[1,2.0]}')
    fails('{"const":{"a":[1,2]}}', '{"a":[2,1]}', "exactly")
    fails('{"const":false}', "0", "exactly")
    fails('{"const":0}', "false", "exactly")
    fails('{"const":null}', "false", "exactly")


def test_enum_compares_numbers_exactly():
    fails('{"enum":[9007199254740993]}', "9007199254740992", "one of")
    passes('{"enum":[9007199254740993]}', "9007199254740993.0")


# ---------------------------------------------------------------- arrays


def test_items_as_one_schema():
    passes('{"items":{"type":"integer"}}', "[1,2,3]")
    fails('{"items":{"type":"integer"}}', "[1,2.5]", "/1", "integer")


def test_prefix_items_then_items():
    schema = '{"prefixItems":[{"type":"string"},{"type":"integer"}],"items":false}'
    passes(schema, '["a",1]')
    passes(schema, '["a"]')
    fails(schema, '[1,1]', "/0", "string")
    fails(schema, '["a",1,true]', "/2")


def test_draft07_tuple_items_and_additional_items():
    schema = '{"items":[{"type":"string"},{"type":"integer"}],"additionalItems":{"type":"boolean"}}'
    passes(schema, '["a",1,true,false]')
    fails(schema, '["a","b"]', "/1", "integer")
    fails(schema, '["a",1,"x"]', "/2", "boolean")
    fails('{"items":[{"type":"string"}],"additionalItems":false}', '["a",1]', "/1")
    passes('{"items":[{"type":"string"}]}', '["a",1]')  # no additionalItems: anything goes


def test_min_max_and_unique_items():
    fails('{"minItems":2}', "[1]", "at least 2")
    fails('{"maxItems":1}', "[1,2]", "at most 1")
    fails('{"uniqueItems":true}', "[1,1.0]", "different")
    passes('{"uniqueItems":true}', '[1,"1",[1],{"a":1}]')


# ---------------------------------------------------------------- numbers


def test_minimum_maximum_and_the_exclusive_ones():
    passes('{"minimum":1,"maximum":2}', "1")
    passes('{"minimum":1,"maximum":2}', "2")
    fails('{"minimum":1}', "0.999", "at least 1")
    fails('{"maximum":2}', "2.0001", "at most 2")
    fails('{"exclusiveMinimum":1}', "1", "greater than 1")
    fails('{"exclusiveMaximum":2}', "2.0", "less than 2")
    passes('{"exclusiveMaximum":2}', "1.999")


def test_draft04_boolean_exclusive_bounds():
    fails('{"minimum":1,"exclusiveMinimum":true}', "1", "greater than 1")
    passes('{"minimum":1,"exclusiveMinimum":true}', "1.5")
    fails('{"maximum":2,"exclusiveMaximum":true}', "2", "less than 2")
    passes('{"maximum":2,"exclusiveMaximum":false}', "2")


def test_bounds_compare_as_exact_decimals():
    fails('{"maximum":9007199254740993}', "9007199254740994", "at most 9007199254740993")
    passes('{"maximum":9007199254740993}', "9007199254740993")
    fails('{"minimum":0.1000000000000000000001}', "0.1", "at least")
    fails('{"exclusiveMaximum":1e300}', "10e299", "less than")
    passes('{"minimum":-1e300}', "-0.99999999999999999999e300")


def test_multiple_of_is_exact():
    passes('{"multipleOf":0.1}', "0.3")
    passes('{"multipleOf":0.01}', "19.99")
    fails('{"multipleOf":0.01}', "19.999", "multiple of 0.01")
    fails('{"multipleOf":2}', "3", "multiple of 2")


# ---------------------------------------------------------------- strings


def test_lengths_count_code_points():
    passes('{"maxLength":1}', '"\U0001F600"')  # one code point, two UTF-16 units, four bytes
    fails('{"minLength":2}', '"\U0001F600"', "at least 2")
    passes('{"minLength":2,"maxLength":2}', '"\u00e9\u00e9"')
    passes('{"maxLength":3}', '"a\\u00e9\\ud83d\\ude00"')
    fails('{"maxLength":2}', '"abc"', "at most 2")


def test_pattern_searches_the_text():
    passes('{"pattern":"[0-9]"}', '"abc1"')  # unanchored, as ECMA-262 search
    fails('{"pattern":"^[a-z]+$"}', '"ABC"', "pattern", "^[a-z]+$")


def test_pattern_end_anchor_does_not_match_before_a_final_newline():
    # ECMA-262 (and Go's RE2, the reference's engine) match $ only at the very end: a
    # trailing newline must not slip past a pattern that forbids it.
    fails('{"pattern":"^[a-z]+$"}', '"abc\\n"', "pattern")


def test_pattern_digit_class_is_ascii():
    # \\d is [0-9] in ECMA-262 and RE2; Arabic-Indic digits are not digits there.
    fails('{"pattern":"^\\\\d+$"}', '"\u0661\u0662\u0663"', "pattern")


def test_format_is_ignored():
    passes('{"format":"email"}', '"not an email"')
    passes('{"format":"date-time","type":"string"}', '"yesterday"')


# ---------------------------------------------------------------- combinators and conditionals


def test_any_of():
    schema = '{"anyOf":[{"type":"string"},{"type":"integer"}]}'
    passes(schema, '"a"')
    passes(schema, "1")
    fails(schema, "1.5", "anyOf")


def test_one_of_needs_exactly_one():
    schema = '{"oneOf":[{"type":"number"},{"type":"integer"}]}'
    passes(schema, "1.5")
    fails(schema, "1", "oneOf")
    fails(schema, '"x"', "oneOf")


def test_all_of():
    schema = '{"allOf":[{"minimum":1},{"maximum":2}]}'
    passes(schema, "1.5")
    fails(schema, "3", "at most 2")
    fails(schema, "0", "at least 1")


def test_not():
    passes('{"not":{"type":"string"}}', "1")
    fails('{"not":{"type":"string"}}', '"x"', "not")


def test_if_then_else():
    schema = ('{"if":{"properties":{"method":{"const":"card"}},"required":["method"]},'
              '"then":{"required":["number"]},"else":{"required":["iban"]}}')
    passes(schema, '{"method":"card","number":"4111"}')
    fails(schema, '{"method":"card"}', "/number", "required")
    passes(schema, '{"method":"sepa","iban":"DE12"}')
    fails(schema, '{"method":"sepa"}', "/iban", "required")
    passes('{"if":{"type":"string"},"then":{"minLength":2}}', "1")


def test_combinators_report_the_path_they_apply_at():
    schema = '{"properties":{"amount":{"anyOf":[{"type":"integer"},{"type":"string"}]}}}'
    fails(schema, '{"amount":1.5}', "/amount", "anyOf")


# ---------------------------------------------------------------- $ref


def test_ref_to_defs():
    schema = '{"properties":{"to":{"$ref":"#/$defs/account"}},"$defs":{"account":{"type":"string","minLength":3}}}'
    passes(schema, '{"to":"abc"}')
    fails(schema, '{"to":"ab"}', "/to", "at least 3")


def test_ref_to_definitions():
    schema = '{"properties":{"to":{"$ref":"#/definitions/account"}},"definitions":{"account":{"type":"string"}}}'
    passes(schema, '{"to":"abc"}')
    fails(schema, '{"to":1}', "/to", "expected string")


def test_ref_to_the_root_recurses():
    schema = '{"type":"object","properties":{"child":{"$ref":"#"}},"additionalProperties":false}'
    passes(schema, '{"child":{"child":{}}}')
    fails(schema, '{"child":{"child":{"x":1}}}', "/child/child/x", "not allowed")


def test_ref_pointer_escapes():
    schema = '{"$defs":{"a/b":{"type":"string"},"c~d":{"type":"integer"}},"properties":{"x":{"$ref":"#/$defs/a~1b"},"y":{"$ref":"#/$defs/c~0d"}}}'
    passes(schema, '{"x":"s","y":1}')
    fails(schema, '{"x":1}', "/x", "string")
    fails(schema, '{"y":"s"}', "/y", "integer")


# ---------------------------------------------------------------- schemas the validator refuses


@pytest.mark.parametrize(
    "schema, fragment",
    [
        ('{"minLength":"two"}', "minLength"),
        ('{"minLength":-1}', "minLength"),
        ('{"minLength":1.5}', "minLength"),
        ('{"properties":{"a":{"maxItems":"3"}}}', "/properties/a/maxItems"),
        ('{"maximum":"5"}', "maximum"),
        ('{"multipleOf":0}', "multipleOf"),
        ('{"type":"strnig"}', "type"),
        ('{"required":"a"}', "required"),
        ('{"enum":"a"}', "enum"),
        ('{"pattern":"("}', "pattern"),
        ('{"pattern":1}', "pattern"),
        ('{"patternProperties":{"(":{}}}', "patternProperties"),
        ('{"anyOf":[]}', "anyOf"),
        ('{"properties":{"a":"x"}}', "/properties/a"),
        ('{"items":[{"type":1}]}', "items"),
        ('{"$ref":"http://example.com/schema.json"}', "$ref"),
        ('{"$ref":"file:///etc/passwd"}', "$ref"),
        ('{"$ref":"other.json#/x"}', "$ref"),
        ('{"$ref":"#/$defs/missing"}', "missing"),
        ('{"properties":{"a":{"$ref":"#/definitions/nothing"}},"definitions":{}}', "nothing"),
    ],
)
def test_schema_problem_refuses_what_the_validator_cannot_use(schema, fragment):
    reason = problem(schema)
    assert reason, schema
    assert fragment in reason


@pytest.mark.parametrize(
    "schema",
    [PAYMENT, "true", "false", "{}", '{"$ref":"#/$defs/a","$defs":{"a":{}}}', '{"$ref":"#"}',
     '{"minLength":2.0}', '{"exclusiveMinimum":true,"minimum":0}', '{"format":"uri"}',
     '{"items":[{"type":"string"}],"additionalItems":false}', '{"x-vendor":{"anything":[1]}}'],
)
def test_schema_problem_accepts_usable_schemas(schema):
    assert problem(schema) == ""


@pytest.mark.parametrize(
    "schema, value",
    [
        ('{"contains":{"const":1}}', "[2,3]"),
        ('{"contains":{"const":1},"minContains":2}', "[1]"),
        ('{"propertyNames":{"maxLength":1}}', '{"ab":1}'),
        ('{"dependentSchemas":{"card":{"required":["cvc"]}}}', '{"card":"x"}'),
        ('{"dependencies":{"card":["cvc"]}}', '{"card":"x"}'),
        ('{"properties":{"a":{}},"unevaluatedProperties":false}', '{"a":1,"b":2}'),
    ],
)
def test_a_keyword_is_enforced_or_its_schema_refused(schema, value):
    # A validator subset may refuse a schema it cannot honour, but it must never accept a
    # schema and then let through arguments that schema forbids.
    if problem(schema):
        return
    with pytest.raises(SchemaError):
        agentgate.validate(P(schema), P(value))
