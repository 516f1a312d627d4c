"""A configuration's fields (agentgate's library "Fields of a configuration") against the
jsonschema package.

Each reader's docstring names the JSON Schema its field's value must meet and what an absent
field reads as, with the reader's own parameters (`most`, `choices`, ...) standing for what the
caller passes. The test takes its schemas from those docstrings, so a docstring that drifts
from the code fails here. A seeded corpus of documents, {"some_field": VALUE} or {} (edge
numbers such as 1023, 1024, 1e3, 1024.0, -0, 1E+3 and beyond any cap; strings with odd
Unicode; every JSON type; decimal strings near the grammar and its bounds; durations), is read
by agentgate.parse for the reader and by json.loads for Draft202012Validator. The reader must
return exactly when the schema accepts: the JSON value (a Decimal or int for a number), or what
the docstring says an absent field reads as; otherwise a ConfigError whose one sentence names
the field.

Numbers go to two oracles. The stock validator sees the floats json.loads makes, so it judges
only documents whose every number a float64 holds exactly. The exact one sees Decimals
(json.loads with parse_float=Decimal) and reads "integer" as 2020-12 defines it, a number
whose fractional part is zero, since jsonschema's checker knows no Decimal: it judges every
document, including 1024.0000000000000001 and 1e-400, which the floats round to integers
and agentgate, keeping each literal exactly (section 10), does not.

Left to others, on purpose:
- A duration's syntax is parse_duration's (section 16, its own differential test against Go's
  rules in tests/test_durations_differential.py); here the schema judges the type and
  parse_duration the text, and the reader must add only absence and the sign.
- jsonschema matches a pattern with Python's re, whose `$` also matches before a final
  newline, where ECMA-262's (the dialect JSON Schema names) does not: decimal strings ending
  in a newline are left out of the jsonschema comparison, and node's RegExp judges every
  decimal string against the docstring's pattern instead.
- Documents parse refuses (a float64 overflow inside an object) reach no reader: the corpus's
  numbers stay below a float64's overflow.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import random
import re
import shutil
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator, validators

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from agentgate import ConfigError, Number  # noqa: E402

FIELD = "some_field"
WHERES = ['server "bank".tools.pay', "policy", 'server "é"']
REFUSED = object()  # what "absent: refused" reads as


class OrNull:
    """What "absent or null: VALUE" reads as: a field written null reads as absent too."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return self.value == other
SEED = 20261201

# -------------------------------------------------------------------------- the docstrings


def contract(fn, **slots) -> dict:
    """The docstring of `fn` with `slots` filled in, read as clauses separated by "; ":
    a schema (with prose after it), "absent: VALUE" or "absent: refused", and
    "if required, SCHEMA", after which the clauses describe a required field."""
    text = re.sub(r"\s*\n\s*", " ", inspect.getdoc(fn)).rstrip(".")
    filled = []
    for token in re.findall(r'"(?:[^"\\]|\\.)*"|\w+|\W', text):
        filled.append(json.dumps(list(slots[token]) if isinstance(slots[token], tuple)
                                 else slots[token]) if token in slots else token)
    text, decoder = "".join(filled), json.JSONDecoder()
    found, mode, pos = {}, "", 0
    while pos < len(text):
        if text.startswith("if required, ", pos):
            mode, pos = "required ", pos + len("if required, ")
        if text.startswith(("absent: ", "absent or null: "), pos):
            null_too = text.startswith("absent or null: ", pos)
            pos += len("absent or null: " if null_too else "absent: ")
            absent, pos = (REFUSED, pos + len("refused")) \
                if text.startswith("refused", pos) else decoder.raw_decode(text, pos)
            found[mode + "absent"] = OrNull(absent) if null_too else absent
            assert text.startswith("; ", pos) or pos == len(text), f"{fn.__name__}: {text}"
        else:
            assert text[pos] == "{", f"{fn.__name__}'s docstring: no schema at {text[pos:]!r}"
            found[mode + "schema"], pos = decoder.raw_decode(text, pos)
            Draft202012Validator.check_schema(found[mode + "schema"])
        end = text.find("; ", pos)  # prose may follow a schema
        pos = len(text) if end == -1 else end + 2
    return found


# -------------------------------------------------------------------------- the oracles

_TYPES = Draft202012Validator.TYPE_CHECKER
ExactValidator = validators.extend(Draft202012Validator, type_checker=_TYPES.redefine(
    "integer", lambda checker, value: _TYPES.is_type(value, "integer")
    or (isinstance(value, Decimal) and value == value.to_integral_value())))


@functools.lru_cache(maxsize=None)
def _validators(schema_json: str):
    schema = json.loads(schema_json)
    return Draft202012Validator(schema), ExactValidator(schema)


def numbers_in(value):
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return [n for item in value for n in numbers_in(item)]
    return [value] if isinstance(value, (int, Decimal)) and not isinstance(value, bool) else []


def schema_says(schema, text, pick):
    """Whether the schema accepts what `pick` takes from the document `text`: the exact
    oracle's answer, checked against the stock one's wherever floats hold the numbers."""
    stock, exact = _validators(json.dumps(schema))
    instance = pick(json.loads(text, parse_float=Decimal))
    answer = exact.is_valid(instance)
    if all(Decimal(float(n)) == n for n in numbers_in(instance)):
        assert stock.is_valid(pick(json.loads(text))) == answer, (schema, text)
    return answer, instance


# -------------------------------------------------------------------------- the corpus

EDGE_NUMBERS = ["0", "-0", "0.0", "-0.0", "1", "-1", "5", "1023", "1024", "1025", "1e3",
                "1E+3", "1e+3", "1.024e3", "1024.0", "1024.00", "10240e-1", "0.1024e4",
                "1023.5", "1023.9999999", "1024.5", "-1024", "65536", "1048576", "8388608",
                "8388609", "16777216", "16777217", "1.6777216e7", "1000000", "1000001",
                "1000000000", "1000000001", "1e9", "1e300", "-1e300", "1e308", "5e-324",
                "1e-400", "0.1", "1024.0000000000000001", "9007199254740993",
                "123456789012345678901234567890", "1E+300"]
ODD_STRINGS = ["", " ", "a", "\u00e9", "e\u0301", "\u0000", "\u001f", "\u007f", "\u2028",
               "\u2029", "\ufeff", "\u200b", "\u202e", "\U0001f600", "\U000e0041", "\ufb01",
               "\uff21", "\u00df", "\u0130", "true", "null", "[]", "{}", "1024", "1e3", "-0",
               "\U0001d7cf\U0001d7ce", "\u0661\u0660", "allow", "Allow", "allow ",
               "allow\u0000", "a\nb", 'say "hi". Then go', "\\"]
DECIMAL_STRINGS = ["0", "-0", "50.00", "0.5", "1e3", "1E-3", "1e+0010000", "1e10000",
                   "1e-10000", "1E00010000", "1e10001", "1e-10001", "1e99999", "1e100000",
                   "1e0000000000000", "1e0000010000", "+1", "01", "-01", ".5", "5.", "1e",
                   "1e+", "-", "--1", " 1", "1 ", "1\n", "50.00\n", "\n1", "1\r", "1\u2028",
                   "1_0", "0x1", "Infinity", "-Infinity", "NaN", "1.5.5", "\uff11",
                   "\u0661", "1e1.5", "1.e1", "9" * 10000, "9" * 10001,
                   "0." + "0" * 9997 + "1", "0." + "0" * 9998 + "1", "1" * 9996 + "e100",
                   "1" * 9995 + "e10000", "-" + "1" * 9999, "-" + "1" * 10000]
DURATIONS = ["15s", "1h30m", "300ms", "0", "-0", "+0", "-0s", "+0s", "-1ns", "-0.1ns",
             "-0.9ns", "0.9ns", "1.5h", ".5s", "5.s", ".s", "1\u00b5s", "1\u03bcs", "1us",
             "1ns", "2562047h47m16.854775807s", "2562047h47m16.854775808s",
             "-2562047h47m16.854775808s", "-2562047h", "15", "15 s", "15S", "1d", "", "+",
             "-", "1h-1m", "\uff19s", "1h 30m", " 1s", "1s\n", "0.000000001s", "1e3s"]


def number_literal(rng: random.Random) -> str:
    whole = rng.choice(["0", str(rng.randint(1, 9)), str(rng.randint(1000, 1100)),
                        str(rng.randint(1, 10**20)), str(rng.choice([1023, 1024, 1 << 20,
                                                                       8 << 20, 16 << 20]))])
    frac = rng.choice(["", "", "." + "0" * rng.randint(1, 3),
                       "." + str(rng.randint(0, 10**6)).zfill(rng.randint(1, 7))])
    exp = rng.choice(["", "", rng.choice("eE") + rng.choice(["", "+", "-"])
                      + str(rng.randint(0, 25)).zfill(rng.randint(1, 3))])
    return rng.choice(["", "", "-"]) + whole + frac + exp


def decimal_string(rng: random.Random) -> str:
    literal = number_literal(rng)
    cut = rng.randint(0, len(literal))
    return rng.choice([literal, literal, literal[:cut] + rng.choice(
        ["+", "0", ".", "e", " ", "\n", "_", "\u0660", ""]) + literal[cut:]])


def string_text(text: str, rng: random.Random) -> str:
    return json.dumps(text, ensure_ascii=rng.random() < 0.5)


def value_text(rng: random.Random, strings, depth: int = 0) -> str:
    """JSON text of one value, weighted to what the readers are asked to tell apart."""
    kind = rng.choice(["number", "edge", "string", "string", "pool", "pool", "true", "false",
                       "null"] + (["array", "array", "object"] if depth < 2 else []))
    if kind == "number":
        return number_literal(rng)
    if kind == "edge":
        return rng.choice(EDGE_NUMBERS)
    if kind == "string":
        return string_text(rng.choice(ODD_STRINGS), rng)
    if kind == "pool":
        return string_text(rng.choice(strings), rng)
    if kind in ("true", "false", "null"):
        return kind
    if kind == "array":
        items = [value_text(rng, strings, depth + 1) if rng.random() < 0.3
                 else string_text(rng.choice(strings + ODD_STRINGS), rng)
                 for _ in range(rng.randint(0, 3))]
        return "[" + ", ".join(items) + "]"
    keys = rng.sample(["a", "b", FIELD], rng.randint(0, 2))
    return "{" + ", ".join(f'"{k}": {value_text(rng, strings, depth + 1)}' for k in keys) + "}"


def documents(rng: random.Random, strings, count: int):
    """{} and {FIELD: v}, with a neighbour now and then, for the edges and `count` more."""
    texts = ["{}"] + [f'{{"{FIELD}": {n}}}' for n in EDGE_NUMBERS] \
        + [f'{{"{FIELD}": {string_text(s, rng)}}}' for s in strings + ODD_STRINGS]
    for _ in range(count):
        body = [] if rng.random() < 0.1 else [f'"{FIELD}": {value_text(rng, strings)}']
        if rng.random() < 0.2:
            body.insert(rng.randint(0, len(body)), '"other": 1')
        texts.append("{" + ", ".join(body) + "}")
    return texts


# -------------------------------------------------------------------------- the comparison


def assert_one_sentence_naming(message: str, *names: str) -> None:
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', message)  # a quoted value may hold anything
    assert "\n" not in message and not re.search(r"[.!?]\s+[A-Z]", bare), message
    for name in names:
        assert name in message, f"{name!r} not named in: {message}"


def compare(text, read, wanted, pick, named, same=lambda got, value: got == value):
    """read(agentgate's document) against `wanted` = (schema, absent), where absent is what
    the docstring says an absent field reads as (None when the reader takes a value)."""
    schema, absent = wanted
    document = agentgate.parse(text.encode("utf-8", "surrogatepass"))
    try:
        got, refusal = read(document), None
    except ConfigError as err:
        got, refusal = None, str(err)
    loaded = json.loads(text)
    null_too = isinstance(absent, OrNull)
    absent = absent.value if null_too else absent
    if absent is not None and (FIELD not in loaded or null_too and loaded[FIELD] is None):
        accepts, expected = absent is not REFUSED, absent
    else:
        accepts, expected = schema_says(schema, text, pick)
    ours = f"refused: {refusal}" if refusal is not None else f"returned {got!r}"
    assert (refusal is None) == accepts, \
        f"{text!r}: agentgate {ours}; the schema {json.dumps(schema)} {accepts=}"
    if accepts:
        assert same(got, expected), f"{text!r}: agentgate {ours}; the JSON value {expected!r}"
    else:
        assert_one_sentence_naming(refusal, *named)


def field_of(document):
    return document[FIELD]


def same_typed(got, value):
    return type(got) is type(value) and got == value


def same_int(got, value):
    return type(got) is int and got == value


def test_field_string_takes_what_its_docstring_schema_takes():
    rng = random.Random(SEED)
    for required in (False, True):
        spec = contract(agentgate.field_string)
        mode = "required " if required else ""
        for text in documents(rng, ["x", "0", ""], 300):
            where = rng.choice(WHERES)
            compare(text, lambda d: agentgate.field_string(d, FIELD, where, required),
                    (spec[mode + "schema"], spec[mode + "absent"]), field_of,
                    (where, FIELD), same_typed)


def test_field_bool_takes_what_its_docstring_schema_takes():
    rng = random.Random(SEED + 1)
    spec = contract(agentgate.field_bool)
    for text in documents(rng, ["true", "false"], 300):
        where = rng.choice(WHERES)
        compare(text, lambda d: agentgate.field_bool(d, FIELD, where),
                (spec["schema"], spec["absent"]), field_of, (f"{where}.{FIELD}",),
                lambda got, value: got is value)


def test_field_names_takes_what_its_docstring_schema_takes():
    rng = random.Random(SEED + 2)
    spec = contract(agentgate.field_names)
    for text in documents(rng, ["notify-send", "A=1", "", "\u00e9"], 400):
        where = rng.choice(WHERES)
        compare(text, lambda d: agentgate.field_names(d, FIELD, where),
                (spec["schema"], spec["absent"]), field_of, (f"{where}.{FIELD}",), same_typed)


@pytest.mark.parametrize("default, most", [
    (agentgate.DEFAULT_ARGUMENT_BYTES, agentgate.MAX_ARGUMENT_BYTES),
    (agentgate.DEFAULT_RESULT_BYTES, agentgate.MAX_RESULT_BYTES), (1024, 1024), (2048, 65536)])
def test_field_byte_cap_takes_what_its_docstring_schema_takes(default, most):
    rng = random.Random(SEED + most)
    spec = contract(agentgate.field_byte_cap, default=default, most=most)
    near = [str(n) for n in (most - 1, most, most + 1, default)]
    texts = documents(rng, ["1024"], 150) + [f'{{"{FIELD}": {n}}}' for n in near]
    for text in texts:
        compare(text, lambda d: agentgate.field_byte_cap(d, FIELD, default, most),
                (spec["schema"], spec["absent"]), field_of, (FIELD, str(most)), same_int)


def duration_says(schema, default):
    """The docstring's schema for the type, parse_duration for the text, then the sign."""
    def read(document):
        if document.get(FIELD) is None:  # absent or null: the docstring's default
            return default
        value = document[FIELD]
        if not schema_says(schema, json.dumps({FIELD: value}), field_of)[0]:
            raise ConfigError("not a string")
        try:
            ns = agentgate.parse_duration(value)
        except ValueError:
            raise ConfigError("not a duration") from None
        if ns < 0:
            raise ConfigError("negative")
        return ns
    return read


@pytest.mark.parametrize("default", [None, 15 * agentgate.SECOND])
def test_field_duration_takes_a_string_parse_duration_reads_as_not_negative(default):
    rng = random.Random(SEED + 3)
    spec = contract(agentgate.field_duration, default=default)
    assert spec["absent"] == default
    oracle = duration_says(spec["schema"], default)
    for text in documents(rng, DURATIONS, 400):
        where = rng.choice(WHERES)
        document = json.loads(text)  # what the oracle reads: no number is looked at
        try:
            expected, refused = oracle(document), False
        except ConfigError:
            expected, refused = None, True
        try:
            got = agentgate.field_duration(agentgate.parse(text), FIELD, where, default)
        except ConfigError as err:
            assert refused, f"{text!r}: agentgate refused ({err}), the oracle {expected!r}"
            assert_one_sentence_naming(str(err), f"{where}.{FIELD}")
            continue
        assert not refused and got == expected and type(got) is type(expected), \
            f"{text!r}: agentgate returned {got!r}, the oracle {'refuses' if refused else expected}"


def decimal_texts(rng: random.Random) -> list[str]:
    return DECIMAL_STRINGS + [decimal_string(rng) for _ in range(500)]


def same_decimal(got, value):
    return isinstance(got, Decimal) and got == (Decimal(value) if isinstance(value, str)
                                                 else value)


def test_parse_decimal_takes_what_its_docstring_schema_takes():
    rng = random.Random(SEED + 4)
    schema = contract(agentgate.parse_decimal)["schema"]
    # Left out: a final newline, which Python's `$` lets through and ECMA-262's does not (the
    # node test below judges those).
    strings = [s for s in decimal_texts(rng) if not s.endswith("\n")]
    texts = documents(rng, strings, 400) + [
        f'{{"{FIELD}": {number_literal(rng)}}}' for _ in range(200)]
    for text in texts:
        if FIELD not in json.loads(text):
            continue
        where = rng.choice(WHERES)
        compare(text, lambda d: agentgate.parse_decimal(d[FIELD], where), (schema, None),
                field_of, (where,), same_decimal)


def test_the_decimal_pattern_as_ecma262_reads_it_is_what_parse_decimal_takes():
    if not shutil.which("node"):
        pytest.skip("node is not installed")
    schema = contract(agentgate.parse_decimal)["schema"]
    pattern = schema["pattern"]
    strings = decimal_texts(random.Random(SEED + 5))
    script = ("const [p, texts] = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
              "const re = new RegExp(p, 'u');"
              "process.stdout.write(JSON.stringify(texts.map(t => re.test(t))));")
    done = subprocess.run(["node", "-e", script], input=json.dumps([pattern, strings]),
                          capture_output=True, text=True, check=True, timeout=60)
    for text, matches in zip(strings, json.loads(done.stdout), strict=True):
        try:
            got = agentgate.parse_decimal(text, "max")
        except ConfigError:
            got = None
        accepts = matches and len(text) <= schema["maxLength"]
        assert (got is not None) == accepts, \
            f"{text[:40]!r}: agentgate {got!r}, the pattern in node {matches}"


@pytest.mark.parametrize("least, most", [(0, math.inf), (1, 10**9), (0, 10**6), (1024, 1024),
                                         (-5, 5)])
def test_whole_number_takes_what_its_docstring_schema_takes(least, most):
    rng = random.Random(SEED + 6)
    schema = contract(agentgate.whole_number, least=least, most=most)["schema"]
    for text in documents(rng, ["5"], 150) + [f'{{"{FIELD}": {n}}}' for n in
                                              (least - 1, least, least + 1, most, most + 1)
                                              if n != math.inf]:
        if FIELD not in json.loads(text):
            continue
        where = rng.choice(WHERES)
        compare(text, lambda d: agentgate.whole_number(d[FIELD], where, least, most),
                (schema, None), field_of, (where,), same_int)


@pytest.mark.parametrize("choices", [agentgate.OUTCOMES, agentgate.SIDE_EFFECTS,
                                     ("\u00e9", "", "a b", "\U0001f600")])
def test_one_of_takes_what_its_docstring_enum_takes(choices):
    rng = random.Random(SEED + 7)
    schema = contract(agentgate.one_of, choices=choices)["schema"]
    near = list(choices) + [c.upper() for c in choices] + [c + " " for c in choices] \
        + ["e\u0301", "require-approval"]
    for text in documents(rng, near, 150):
        if FIELD not in json.loads(text):
            continue
        where = rng.choice(WHERES)
        compare(text, lambda d: agentgate.one_of(d[FIELD], choices, where), (schema, None),
                field_of, (where,), lambda got, value: got is not None and got == value)


KEYS = ["a", "b", "", " a", "A", "\u00e9", "e\u0301", "\U0001f600", "a.b", "\u0000",
        "\u202e", "__proto__", "constructor", FIELD]


@pytest.mark.parametrize("fields", [("a", "b"), (), ("\u00e9", "", "__proto__"),
                                    tuple(agentgate.CONDITIONS)])
def test_refuse_unknown_takes_what_its_docstring_schema_takes(fields):
    rng = random.Random(SEED + 8)
    schema = contract(agentgate.refuse_unknown, fields=fields)["schema"]
    texts = ["[]", "null", '"a"', "1", "true", "{}"]
    for _ in range(200):
        keys = rng.sample(sorted(set(KEYS) | set(fields)), rng.randint(0, 4))
        texts.append("{" + ", ".join(f"{string_text(k, rng)}: {value_text(rng, KEYS)}"
                                     for k in keys) + "}")
    for text in texts:
        where = rng.choice(WHERES)
        loaded = json.loads(text)
        unknown = [k for k in loaded if k not in fields] if isinstance(loaded, dict) else []
        named = (where, agentgate.quote(unknown[0])) if unknown else (where,)
        compare(text, lambda d: agentgate.refuse_unknown(d, fields, where), (schema, None),
                lambda document: document, named, lambda got, value: got is None)


# -------------------------------------------------------------------------- named edges


def test_a_string_or_duration_field_written_null_reads_as_absent():
    """As Go's decoder reads a null (the anchor's configs load so), a string or duration field
    written null is its default; a null bool, list or byte cap is refused, as its schema says."""
    document = agentgate.parse(b'{"description": null, "timeout": null, "deny": null}')
    assert agentgate.field_string(document, "description", "tools") == ""
    with pytest.raises(ConfigError, match=r"^tools needs description$"):
        agentgate.field_string(document, "description", "tools", required=True)
    assert agentgate.field_duration(document, "timeout", "tools", 7) == 7
    with pytest.raises(ConfigError, match=r"^tools\.deny must be a list of strings$"):
        agentgate.field_names(document, "deny", "tools")


def test_a_whole_number_past_its_most_is_told_the_most():
    with pytest.raises(ConfigError) as caught:
        agentgate.whole_number(Number("2000000"), "max_pending", 0, 10**6, " (0 means 5)")
    assert str(caught.value) == "max_pending must be a whole number of at least 0 and at " \
        "most 1000000 (0 means 5)"
    with pytest.raises(ConfigError, match=r"^limit\.max_length must be a whole number of at "
                                          r"least 0$"):
        agentgate.whole_number(Number("-1"), "limit.max_length", 0)


def test_one_of_shows_a_refused_value_as_its_json():
    for text, shown in [("true", '"true"'), ("null", '"null"'), ("1.0", '"1.0"'),
                        ('["allow"]', '"[\\"allow\\"]"')]:
        with pytest.raises(ConfigError) as caught:
            agentgate.one_of(agentgate.parse(text), agentgate.OUTCOMES, "policy.read_only")
        assert str(caught.value) == f"policy.read_only is {shown}; use one of allow, " \
            "require_approval, deny"


def test_a_byte_cap_written_as_a_decimal_integer_is_that_integer():
    """2020-12 counts 1024.0 and 1.024e3 as integers; so does the reader, and returns an int."""
    for literal in ("1024.0", "1.024e3", "10240e-1", "1024"):
        document = agentgate.parse(f'{{"cap": {literal}}}')
        assert same_int(agentgate.field_byte_cap(document, "cap", 2048, 4096), 1024)
    document = agentgate.parse(b'{"cap": 1024.0000000000000001}')
    with pytest.raises(ConfigError, match="^cap must be a whole number of bytes from 1024"):
        agentgate.field_byte_cap(document, "cap", 2048, 4096)


def test_a_drifting_docstring_is_caught():
    """The docstring reader refuses what is not a schema, so a docstring edited into prose
    fails the comparison rather than being skipped."""
    def reader(raw, field, where):
        """A boolean; absent: false."""
    with pytest.raises(AssertionError):
        contract(reader)
