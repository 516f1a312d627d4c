"""Canonical JSON (agentgate's "Canonical JSON"), request keys ("Framing"), durations ("Durations
and times") and the sanitizer ("Text safe to show").

Specification: reference sections 3.1-3.3 (the boundary check, the canonical encoding, the
request key), 13 (durations) and 8.3 (sanitizing). Ported from the reference suite:
canonical_test.go's TestCanonicalJSON_IsTheHashedForm, proxy/config_test.go's
TestRequestKey_CanonicalByLiteral and TestRequestKey_NoCollisions, and TestCapText_* (as the
byte-limit properties of `cut`). Not ported here: the legacy schema canonicalizer tests of
mcp/listing_test.go (agentgate pins over the section-3 encoding, SPEC "differs on purpose").
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
from decimal import Decimal
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402

parse, canonical, policy_json, request_key = (
    agentgate.parse, agentgate.canonical, agentgate.policy_json, agentgate.request_key)
CanonicalError = agentgate.CanonicalError


def refusal(data) -> str:
    """The reason parse gives for refusing `data` (a failure if it accepts it)."""
    with pytest.raises(CanonicalError) as caught:
        parse(data)
    return str(caught.value)


def roundtrip(data) -> bytes:
    return canonical(parse(data))


def nested(depth: int, inner: bytes = b"") -> bytes:
    return b"[" * depth + inner + b"]" * depth


# ---------------------------------------------------------------- 3.1 each refusal, its reason


DEPTH = "nested deeper than 256 levels"
UTF8 = "not valid UTF-8"
JSON = "not valid JSON"


@pytest.mark.parametrize(
    "data, reason",
    [
        (nested(257), DEPTH),
        (b"{" + b'"a":{' * 256 + b"}" * 257, DEPTH),
        (b'"\xff"', UTF8),
        (b'"\xfe"', UTF8),
        (b'"\xc0\xaf"', UTF8),  # an overlong encoding of "/"
        (b'"\xed\xa0\x80"', UTF8),  # a surrogate encoded directly in UTF-8
        (b'{"a":"\xe2\x82"}', UTF8),  # a truncated sequence
        (b"", JSON),
        (b" \t\r\n", JSON),
        (b"NaN", JSON),
        (b"Infinity", JSON),
        (b"-Infinity", JSON),
        (b"[NaN]", JSON),
        (b"01", JSON),
        (b'{"n":00}', JSON),
        (b"{} x", JSON),
        (b"{} {}", JSON),
        (b"1 2", JSON),
        (b"\xef\xbb\xbf{}", JSON),  # a byte-order mark is not JSON whitespace
        (b"\x0c{}", JSON),  # nor is a form feed
        (b"[1,]", JSON),
        (b'{"a":1,}', JSON),
        (b"{'a':1}", JSON),
        (b'"\x01"', JSON),  # a raw control character inside a string
        (b'"\\x41"', JSON),
        (b'"\\u12"', JSON),
        (b"+1", JSON),
        (b".5", JSON),
        (b"1.", JSON),
        (b"1e", JSON),
        (b"0x10", JSON),
        ("\u0661".encode(), JSON),  # a non-ASCII digit is not a JSON number
        (b"[1\xd9\xa1]", JSON),
        (b"tru", JSON),
        (b'"\\ud800"', "unpaired surrogate \\ud800"),
        (b'"\\udc00"', "unpaired surrogate \\udc00"),
        (b'["\\udc00\\ud800"]', "unpaired surrogate \\udc00"),
        (b'"\\ud800\\u0041"', "unpaired surrogate \\ud800"),
        (b'{"\\udbff":1}', "unpaired surrogate \\udbff"),
        (b'{"a":1,"a":2}', 'duplicate key "a"'),
        (b'{"a":1,"\\u0061":2}', 'duplicate key "a"'),
        (b'{"a":1,"a":1000}', 'duplicate key "a"'),
        (b'{"":1,"":2,"b":1,"b":2}', 'duplicate key ""'),  # the first repeated key, even the empty one
        (b'{"x":{"k":1,"\\u006b":2}}', 'duplicate key "k"'),
        (b'[{"k":[1,{"k":1,"k":1}]}]', 'duplicate key "k"'),
        (b"1" * 10001, "number " + "1" * 24 + "... is longer than 10000 characters"),
        (b"[" + b"1" * 10001 + b"]", "is longer than 10000 characters"),
        (b"1e10001", "number 1e10001 has an exponent beyond \u00b110000"),
        (b"-1E+10001", "has an exponent beyond \u00b110000"),
        (b'{"n":1e-10000000}', "number 1e-10000000 has an exponent beyond \u00b110000"),
        (b"1e-10001", "has an exponent beyond \u00b110000"),
        (b"1e9223372036854775807", "has an exponent beyond \u00b110000"),
        (b"0.1e-9223372036854775808", "has an exponent beyond \u00b110000"),
    ],
)
def test_the_boundary_check_refuses_with_its_reason(data, reason):
    assert reason in refusal(data)


def test_the_reasons_are_exactly_the_references():
    assert refusal(nested(300)) == DEPTH
    assert refusal(b'"\xff"') == UTF8
    assert refusal(b"{} {}") == JSON
    assert refusal(b'{"s":"\\ud800"}') == "unpaired surrogate \\ud800"
    assert refusal(b'{"a":1,"\\u0061":2}') == 'duplicate key "a"'


@pytest.mark.parametrize(
    "data",
    [
        nested(256),
        b"{" + b'"a":{' * 255 + b"}" * 256,
        nested(200, b'"' + b"[" * 100 + b'"'),  # brackets inside a string are not depth
        b'"\\ud83d\\ude00"',  # a proper pair
        b'{"\\ud800\\udc00":1}',
        b'"\\u0000"',
        b"1e10000",
        b"-1e10000",
        b"1E+10000",
        b"1e-10000",
        b"1e0000010000",  # leading zeros of the exponent do not count
        b"1" * 10000,
        b"1e400",  # float64 overflow as the whole document is accepted
        b"-1e400",
        b"[1e-400]",  # underflow is accepted anywhere
        b"[1.7976931348623157e308]",
        b'"<>&\xe2\x80\xa8\xe2\x80\xa9"',
        b" \t\r\n{} \t\r\n",
        b'"\\/"',
        b"-0",
    ],
)
def test_the_boundary_check_accepts(data):
    parse(data)


def test_depth_256_is_fine_and_257_is_not():
    parse(nested(256))
    assert refusal(nested(257)) == DEPTH
    parse(nested(255, b'{"a":1}'))
    assert refusal(nested(256, b'{"a":1}')) == DEPTH


def test_brackets_inside_strings_do_not_count_as_depth():
    parse(b'["' + b"[" * 300 + b'"]')
    parse(b'{"' + b"{" * 300 + b'":"\\"' + b"[" * 300 + b'"}')


def test_brackets_of_an_unterminated_string_do_not_count_as_depth():
    # Reference 3.1: the depth is the count of [ and { outside strings. Everything after an
    # opening quote is inside that string, closed or not, so this is merely not JSON.
    assert refusal(b'"' + b"[" * 300) == JSON
    assert refusal(b'["\\"' + b"{" * 300) == JSON


@pytest.mark.parametrize("container", [b"[1e400]", b'{"n":1e400}', b"[0,[-1e400]]", b'{"a":{"b":[1e309]}}'])
def test_a_float64_overflow_inside_a_container_is_refused(container):
    refusal(container)


def test_a_float64_overflow_is_judged_as_float64_rounds():
    # 1.7976931348623158e308 rounds to the largest float64 (it is within half an ulp), so
    # Go's decoder takes it; 1.7976931348623159e308 rounds past it and overflows.
    parse(b"[1.7976931348623158e308]")
    refusal(b"[1.7976931348623159e308]")
    refusal(b"[1e10000]")


# ---------------------------------------------------------------- 3.1 the order of the checks


@pytest.mark.parametrize(
    "data, reason",
    [
        (nested(257, b'"\xff"'), DEPTH),  # depth before UTF-8
        (nested(300, b"\xff x y"), DEPTH),  # depth before UTF-8 and validity
        (b'{"a":"\xff",}', UTF8),  # UTF-8 before validity
        (b'["\xff", NaN', UTF8),
        (b'["\\ud800"', JSON),  # validity before surrogates
        (b'{"a":"\\ud800","a":1} x', JSON),
        (b'{"a":1,"a":2,"b":"\\udc00"}', "unpaired surrogate \\udc00"),  # surrogates before keys
        (b'{"a":"\\ud800","a":2}', "unpaired surrogate \\ud800"),
        (b'{"x":{"k":"\\udc00"},"x":1}', "unpaired surrogate \\udc00"),
        (b'["\\ud800", 1e10001]', "unpaired surrogate \\ud800"),  # surrogates before the bound
        (b'{"a":1,"a":1e10001}', 'duplicate key "a"'),  # keys before the bound
        (b'{"a":1,"a":' + b"1" * 10001 + b"}", 'duplicate key "a"'),
        (b'{"a":1,"a":2,"b":[1e400]}', 'duplicate key "a"'),
    ],
)
def test_a_document_with_two_faults_gets_the_earlier_reason(data, reason):
    assert reason in refusal(data)


def test_an_overflow_inside_a_container_is_reported_before_the_number_bound():
    reason = refusal(b"[1e400, 1e-10001]")
    assert "1e400" in reason and "exponent" not in reason


# ---------------------------------------------------------------- 3.2 the canonical encoding


def test_keys_are_sorted_by_their_utf8_bytes_without_whitespace():
    doc = '{ "\uffff":1, "\U0001F600":2, "a":3, "B":4, "\u00e9":5, "":6 }'
    assert roundtrip(doc.encode()) == '{"":6,"B":4,"a":3,"\u00e9":5,"\uffff":1,"\U0001F600":2}'.encode()


@pytest.mark.parametrize(
    "literal",
    ["10", "10.0", "1e1", "1E1", "1e+1", "-0", "-0.0", "0e5", "1250.50", "9007199254740993",
     "123456789012345678901234567890", "0.1000000000000000000001", "1e-400", "5e-324", "1.7976931348623157e308"],
)
def test_numbers_keep_their_literal(literal):
    assert roundtrip(literal.encode()) == literal.encode()
    assert roundtrip(f'{{"n":[ {literal} ]}}'.encode()) == f'{{"n":[{literal}]}}'.encode()
    assert policy_json(parse(literal)) == literal


def test_an_overflowing_literal_as_the_whole_document_keeps_its_literal():
    assert roundtrip(b"1e400") == b"1e400"
    assert roundtrip(b" -1E+400 ") == b"-1E+400"


def test_strings_are_escaped_in_one_fixed_way():
    doc = '"\\"\\\\\\/\\b\\f\\n\\r\\t\\u0000\\u001F\\u001f\x7f<>&\u2028\u2029\u00e9\U0001F600\\u0064"'
    expected = ('"\\"\\\\/\\b\\f\\n\\r\\t\\u0000\\u001f\\u001f\x7f\\u003c\\u003e\\u0026'
                '\\u2028\\u2029\u00e9\U0001F600d"')
    assert roundtrip(doc.encode()) == expected.encode()


def test_the_policy_form_is_the_same_without_the_html_escapes():
    value = parse('{"b":"<b>&amp;</b>\u2028\u2029\\u0001\\n","a":[1.50,true,false,null]}'.encode())
    assert policy_json(value) == '{"a":[1.50,true,false,null],"b":"<b>&amp;</b>\u2028\u2029\\u0001\\n"}'
    assert canonical(value) == (
        '{"a":[1.50,true,false,null],"b":"\\u003cb\\u003e\\u0026amp;\\u003c/b\\u003e'
        '\\u2028\\u2029\\u0001\\n"}').encode()


def test_order_whitespace_and_escapes_never_matter():
    assert roundtrip(b'{"b":1,"a":"x"}') == roundtrip(b' { "a" : "x", "b" : 1 } ')
    assert roundtrip(b'"\\u0064an"') == roundtrip(b'"dan"')
    assert roundtrip(b'"\\u003c"') == roundtrip(b'"<"') == b'"\\u003c"'
    assert roundtrip('{"s":"\u00e9"}'.encode()) == roundtrip(b'{"s":"\\u00e9"}')


@pytest.mark.parametrize("a, b", [("10", "10.0"), ("10", "1e1"), ("1250.5", "1250.50"), ("0", "-0"), ('"A"', '"a"')])
def test_different_literals_are_different_forms(a, b):
    assert roundtrip(a.encode()) != roundtrip(b.encode())


def test_a_str_document_is_the_same_as_its_utf8_bytes():
    doc = '{"s":"\u00e9\U0001F600<"}'
    assert roundtrip(doc) == roundtrip(doc.encode())


# ---------------------------------------------------------------- differential: a generated corpus

# The oracle below is written from reference 3.2 alone; the documents are serialized with
# random whitespace and random \u escapes, so the parser sees many spellings of one value.

CHARS = ['a', 'Z', '0', ' ', '"', '\\', '/', '\b', '\f', '\n', '\r', '\t', '\x00', '\x1f', '\x7f',
         '<', '>', '&', '\u2028', '\u2029', '\u00e9', '\u4e16', '\U0001F600', '\ufeff', '\u0301',
         '\uffff', '\U0010FFFF']


class Lit(str):
    """A number as its literal, in the generated model."""


def gen_number(rng: random.Random) -> Lit:
    text = rng.choice(["", "-"])
    text += rng.choice(["0", str(rng.randint(1, 9)) + "".join(rng.choices("0123456789", k=rng.randint(0, 25)))])
    if rng.random() < 0.4:
        text += "." + "".join(rng.choices("0123456789", k=rng.randint(1, 20)))
    if rng.random() < 0.3:
        text += rng.choice("eE") + rng.choice(["", "+", "-"]) + str(rng.randint(0, 250)).zfill(rng.randint(1, 4))
    return Lit(text)


def gen_string(rng: random.Random) -> str:
    return "".join(rng.choices(CHARS, k=rng.randint(0, 8)))


def gen_value(rng: random.Random, depth: int = 0):
    kinds = ["str", "num", "true", "false", "null"] + (["list", "dict"] * 2 if depth < 5 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return gen_string(rng)
    if kind == "num":
        return gen_number(rng)
    if kind in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[kind]
    if kind == "list":
        return [gen_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {gen_string(rng): gen_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def spell_string(rng: random.Random, s: str) -> str:
    out = []
    for ch in s:
        code = ord(ch)
        if ch in '"\\' or code < 0x20 or rng.random() < 0.3:
            if code > 0xFFFF:
                high, low = 0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF)
                out.append(f"\\u{high:04x}\\u{low:04X}")
            elif ch in "\b\f\n\r\t\"\\/" and rng.random() < 0.5:
                out.append({"\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t",
                            '"': '\\"', "\\": "\\\\", "/": "\\/"}[ch])
            else:
                out.append(f"\\u{code:04x}" if rng.random() < 0.5 else f"\\u{code:04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def spell(rng: random.Random, value) -> str:
    ws = lambda: "".join(rng.choices(" \t\r\n", k=rng.choice([0, 0, 1, 2])))  # noqa: E731
    if isinstance(value, Lit):
        return str(value)
    if isinstance(value, str):
        return spell_string(rng, value)
    if value is True or value is False or value is None:
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ws() + ("," + ws()).join(spell(rng, v) + ws() for v in value) + "]"
    items = list(value.items())
    rng.shuffle(items)
    return "{" + ws() + ",".join(ws() + spell_string(rng, k) + ws() + ":" + ws() + spell(rng, v) + ws()
                                 for k, v in items) + "}"


def oracle_string(s: str, html: bool = True) -> str:
    short = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    out = []
    for ch in s:
        if ch in short:
            out.append(short[ch])
        elif ord(ch) < 0x20 or (html and ch in "<>&\u2028\u2029"):
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def oracle(value, html: bool = True) -> str:
    """The canonical form; without html, the policy form (no HTML escapes)."""
    if isinstance(value, Lit):
        return str(value)
    if isinstance(value, str):
        return oracle_string(value, html)
    if value is True or value is False or value is None:
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ",".join(oracle(v, html) for v in value) + "]"
    keys = sorted(value, key=lambda k: k.encode("utf-8"))
    return "{" + ",".join(oracle_string(k, html) + ":" + oracle(value[k], html) for k in keys) + "}"


def as_decimals(text):
    return json.loads(text, parse_float=Decimal, parse_int=Decimal)


def corpus(seed: int, count: int):
    rng = random.Random(seed)
    return [(value, spell(rng, value)) for value in (gen_value(rng) for _ in range(count))]


@pytest.mark.parametrize("seed", range(8))
def test_canonical_agrees_with_the_json_module_and_the_spec_on_valid_documents(seed):
    for value, doc in corpus(seed, 150):
        encoded = doc.encode("utf-8")
        form = canonical(parse(encoded))
        assert as_decimals(form) == as_decimals(doc), doc
        assert form == oracle(value).encode("utf-8"), doc
        assert canonical(parse(form)) == form  # the form is a fixed point
        assert as_decimals(policy_json(parse(encoded))) == as_decimals(doc)
        assert policy_json(parse(encoded)) == oracle(value, html=False), doc
        assert agentgate.content_hash(parse(encoded)) == hashlib.sha256(form).hexdigest()


def test_what_json_cannot_write_is_written_as_before():
    assert canonical([float("nan"), float("inf"), 1.5, 2, (3, "4")]) == b'[null,null,1.5,2,[3,"4"]]'
    with pytest.raises(TypeError):
        canonical({"a": object()})


# ---------------------------------------------------------------- differential: node's JSON.parse

# Which bytes are a JSON document is judged by another implementation: node's TextDecoder
# (fatal, the byte-order mark kept) and JSON.parse, over corpus documents mutated byte by byte.
# Where node accepts, the anchor's further refusals are worked out here from the spec
# (node keeps neither repeated keys nor literals): an unpaired surrogate, then a repeated key,
# then a float64 overflow inside a container (node reads it as Infinity), then the bound.

JSON_PARSE_SCRIPT = r"""
const fs = require('fs');
const docs = JSON.parse(fs.readFileSync(process.argv[1], 'utf8'));
const decoder = new TextDecoder('utf-8', {fatal: true, ignoreBOM: true});
function lone(v) {
  if (typeof v === 'string') return !v.isWellFormed();
  if (v && typeof v === 'object')
    return Object.entries(v).some(([k, x]) => !k.isWellFormed() || lone(x));
  return false;
}
function overflow(v) {
  if (typeof v === 'number') return !isFinite(v);
  if (v && typeof v === 'object') return Object.values(v).some(overflow);
  return false;
}
const out = docs.map(b64 => {
  let text;
  try { text = decoder.decode(Buffer.from(b64, 'base64')); } catch (e) { return 'utf8'; }
  let value;
  try { value = JSON.parse(text); } catch (e) { return 'json'; }
  return {lone: lone(value), overflow: typeof value === 'object' && overflow(value)};
});
fs.writeFileSync(process.argv[2], JSON.stringify(out));
"""

MUTATION_PIECES = [bytes([b]) for b in b'[]{},:"\\ 0123456789eE.+-tfnu\x00\x7f\xc3\xa9\xff']
MUTATION_PIECES += [b"\\ud800", b"\\udc00", b"\\ud83d\\ude00", b"e999", b"1e400", b'"":0,']
PLANTED = {b'"': b"\\udc00", b"[": b"1e400,", b"{": b'"":0,"":1,'}


def mutate(rng: random.Random, data: bytes) -> bytes:
    for _ in range(rng.randint(1, 2)):
        at = rng.randint(0, len(data))
        how = rng.choice(["delete", "insert", "replace", "repeat", "plant"])
        opening = [i + 1 for i, byte in enumerate(data) if byte in b'"[{']
        if how == "plant" and opening:
            # what only the anchor refuses, where it keeps the document JSON
            at = rng.choice(opening)
            data = data[:at] + PLANTED[data[at - 1:at]] + data[at:]
        elif how == "delete":
            data = data[:at] + data[at + 1:]
        elif how == "insert":
            data = data[:at] + rng.choice(MUTATION_PIECES) + data[at:]
        elif how == "replace":
            data = data[:at] + rng.choice(MUTATION_PIECES) + data[at + 1:]
        else:
            end = rng.randint(at, min(len(data), at + 12))
            data = data[:end] + data[at:end] + data[end:]
    return data


def node_verdicts(documents):
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = f"{tmp}/in.json", f"{tmp}/out.json"
        with open(src, "w") as f:
            json.dump([base64.b64encode(d).decode() for d in documents], f)
        subprocess.run(["node", "-e", JSON_PARSE_SCRIPT, src, dst], check=True, timeout=60)
        with open(dst) as f:
            return json.load(f)


def further_refusal(data: bytes, node_says) -> str:
    """For a document node accepts, the anchor's first further refusal, or ''."""
    if node_says["lone"]:
        return "unpaired surrogate"
    repeated, literals = [], []

    def pairs(items):
        keys = [k for k, _ in items]
        repeated.extend(k for i, k in enumerate(keys) if k in keys[:i])
        return dict(items)

    def literal(text):
        literals.append(text)
        return 0
    value = json.loads(data, object_pairs_hook=pairs, parse_int=literal, parse_float=literal)
    if repeated:
        return "duplicate key"

    def past_bound(text):
        exponent = re.search(r"[eE]([+-]?\d+)$", text)
        return len(text) > 10000 or bool(exponent and abs(int(exponent.group(1))) > 10000)
    overflowing = [x for x in literals if isinstance(value, (dict, list)) and float(x) in
                   (float("inf"), float("-inf"))]
    assert node_says["overflow"] == bool(overflowing)
    # A literal past the bound is refused for the bound, even where it overflows a float64.
    if any(not past_bound(x) for x in overflowing):
        return "beyond the range of a float64"
    return "number " if any(map(past_bound, literals)) else ""


def test_what_is_json_is_what_node_reads_as_json():
    if not shutil.which("node"):
        pytest.skip("node is not installed")
    rng = random.Random(2026)
    documents = []
    for seed in range(8):
        for _, doc in corpus(seed, 150):
            data = doc.encode("utf-8")
            documents += [data, mutate(rng, data), mutate(rng, data)]
    mismatches, refused = [], {"utf8": 0, "json": 0, "further": 0}
    for data, node_says in zip(documents, node_verdicts(documents)):
        try:
            parse(data)
            ours = ""
        except CanonicalError as err:
            ours = str(err)
        if node_says in ("utf8", "json"):
            refused[node_says] += 1
            expected = {"utf8": UTF8, "json": JSON}[node_says]
            if ours != expected:
                mismatches.append((data, node_says, ours))
            continue
        expected = further_refusal(data, node_says)
        refused["further"] += bool(expected)
        if (expected == "") != (ours == "") or expected not in ours:
            mismatches.append((data, expected, ours))
    assert mismatches == [], mismatches[:5]
    assert len(documents) == 3600 and min(refused.values()) >= 100, refused


@pytest.mark.parametrize("seed", range(4))
def test_hostile_variants_of_valid_documents_are_refused(seed):
    rng = random.Random(1000 + seed)
    for value, doc in corpus(1000 + seed, 100):
        encoded = doc.encode("utf-8")
        assert refusal(encoded + b" x") == JSON
        assert refusal(encoded + b"\xff") in (UTF8,)
        assert refusal(b"\xef\xbb\xbf" + encoded) == JSON
        if isinstance(value, dict) and value:
            key = rng.choice(list(value))
            escaped = "".join(f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else c for c in key)
            twice = "{" + f'"{escaped}":0,' + doc.strip()[1:]
            assert refusal(twice.encode()).startswith("duplicate key "), twice
        lone = rng.choice(["\\ud800", "\\udc00", "\\udbff", "\\udfff"])
        assert refusal(f'[{doc},"{lone}"]'.encode()) == f"unpaired surrogate {lone}"


# ---------------------------------------------------------------- 3.3 request keys


def key(tool: str, args: str) -> str:
    return request_key(tool, parse(args.encode("utf-8")))


BASE = '{"to":"a","amount":10,"tags":["x",1.50]}'


def test_request_key_is_sha256_of_name_nul_canonical_arguments():
    expected = hashlib.sha256(b"bank_pay\x00" + canonical(parse(BASE))).hexdigest()
    assert key("bank_pay", BASE) == expected
    assert re.fullmatch(r"[0-9a-f]{64}", expected)


@pytest.mark.parametrize(
    "same", [' { "tags" : [ "x" , 1.50 ] , "amount" : 10 , "to" : "a" } ',
             '{"to":"\\u0061","amount":10,"tags":["\\u0078",1.50]}']
)
def test_request_key_is_the_same_for_the_same_literals(same):
    assert key("bank_pay", same) == key("bank_pay", BASE)


@pytest.mark.parametrize(
    "other",
    ['{"to":"A","amount":10,"tags":["x",1.50]}', '{"to":"a ","amount":10,"tags":["x",1.50]}',
     '{"to":"a","amount":10.0,"tags":["x",1.50]}', '{"to":"a","amount":1e1,"tags":["x",1.50]}',
     '{"to":"a","amount":10,"tags":["x",1.5]}', '{"to":"a","amount":"10","tags":["x",1.50]}',
     '{"to":"a","amount":10,"tags":[1.50,"x"]}', '{"to":"a","amount":-10,"tags":["x",1.50]}'],
)
def test_request_key_differs_for_a_different_literal(other):
    assert key("bank_pay", other) != key("bank_pay", BASE)


def test_request_key_differs_for_another_tool():
    assert key("bank_refund", BASE) != key("bank_pay", BASE)


@pytest.mark.parametrize(
    "a, b",
    [("-0", "0"), ("-0.0", "0e5"), ("1.0", "1"), ("0.10", "0.1"), ("1e+2", "100"), ("1E2", "100"),
     ("9007199254740993", "9007199254740992"), ("1250.5", "1250.50")],
)
def test_request_keys_do_not_collide_for_numbers(a, b):
    assert key("t", f'{{"n":{a}}}') != key("t", f'{{"n":{b}}}')
    assert key("t", a) != key("t", b)


@pytest.mark.parametrize("a, b", [('{"x":null}', "{}"), ("[1,2]", "[2,1]")])
def test_request_keys_do_not_collide_for_shapes(a, b):
    assert key("t", a) != key("t", b)


@pytest.mark.parametrize(
    "args",
    [b'{"n":1e9223372036854775807}', b'{"n":0.1e-9223372036854775808}', b'{"n":1e-9223372036854775808}',
     b'{"n":10e9223372036854775807}', b"1e9223372036854775807", b'{"a":1,"a":1000}', b'{"s":"\\ud800"}',
     b'"\\udc00"', b'{"s":"\xff"}', b'{"s":"\xfe"}', b"{} x", b'{"n":00}'],
)
def test_arguments_the_boundary_check_refuses_get_no_key(args):
    refusal(args)


# ---------------------------------------------------------------- durations (Go syntax)


@pytest.mark.parametrize(
    "text, ns",
    [("15s", 15 * 10**9), ("1h30m", 5400 * 10**9), ("300ms", 300 * 10**6), ("0", 0), ("0s", 0),
     ("1s500ms", 1500 * 10**6), ("+5s", 5 * 10**9), ("-1s", -(10**9)),
     ("1h0m30s", 3630 * 10**9), ("2h45m30s500ms", (2 * 3600 + 45 * 60 + 30) * 10**9 + 5 * 10**8),
     ("1us", 1000), ("1\u00b5s", 1000), ("1\u03bcs", 1000), ("7ns", 7), ("24h", 86400 * 10**9),
     ("10m", 600 * 10**9), ("9223372036854775807ns", 9223372036854775807)],
)
def test_durations_read_go_syntax(text, ns):
    assert agentgate.parse_duration(text) == ns


@pytest.mark.parametrize("text", ["5", "", "1d", "1H", "1h 30m", " 1s", "s", ".s", "1.5.5s", "-", "+", "1s5", "1e3s", "\u0661s",
                                  "1.5s", ".5s", "1.s"])
def test_durations_refuse_what_go_refuses(text):
    with pytest.raises(ValueError):
        agentgate.parse_duration(text)


@pytest.mark.parametrize("text", ["9223372036854775808ns", "2562048h", "10000000000000000000s"])
def test_durations_past_go_range_are_refused(text):
    # Go's durations are int64 nanoseconds (at most about 2562047h); a longer one is refused.
    with pytest.raises(ValueError):
        agentgate.parse_duration(text)


@pytest.mark.parametrize(
    "ns, text",
    [(600 * 10**9, "10m0s"), (86400 * 10**9, "24h0m0s"), (300 * 10**6, "300ms"), (5400 * 10**9, "1h30m0s"),
     (0, "0s"), (1500 * 10**6, "1.5s"), (2 * 10**9, "2s"), (90 * 10**9, "1m30s"), (1500, "1.5\u00b5s"),
     (1, "1ns"), (-2 * 10**9, "-2s"), (1001 * 10**6, "1.001s"), (3600 * 10**9 + 1, "1h0m0.000000001s"),
     (15 * 10**9, "15s")],
)
def test_durations_print_as_go_prints_them(ns, text):
    assert agentgate.format_duration(ns) == text


@pytest.mark.parametrize("text", ["15s", "1h30m", "300ms", "0s", "24h", "1m30s", "90m"])
def test_a_printed_duration_reads_back(text):
    ns = agentgate.parse_duration(text)
    assert agentgate.parse_duration(agentgate.format_duration(ns)) == ns


# ---------------------------------------------------------------- the sanitizer (reference 8.3)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a\r\nb", "a  b"),
        ("a\nb", "a b"),
        ("\x1b[2K", "\\x1b[2K"),
        ("\t", "\\x09"),
        ("\x00", "\\x00"),
        ("\x7f", "\\x7f"),
        ("\x80", "\\x80"),
        ("\x9b", "\\x9b"),
        ("\u202a", "\\u{202a}"),
        ("\u202e", "\\u{202e}"),
        ("\u2066", "\\u{2066}"),
        ("\u2069", "\\u{2069}"),
        ("\u061c", "\\u{061c}"),
        ("\u200e", "\\u{200e}"),
        ("\u200f", "\\u{200f}"),
        ("\u200b", "\\u{200b}"),
        ("\u200d", "\\u{200d}"),
        ("\u2060", "\\u{2060}"),
        ("\u2064", "\\u{2064}"),
        ("\ufeff", "\\u{feff}"),
        ("\u00ad", "\\u{00ad}"),
        ("\u180e", "\\u{180e}"),
        ("\u2028", "\\u{2028}"),
        ("\u2029", "\\u{2029}"),
        ("\U000E0000", "\\u{e0000}"),
        ("\U000E0041", "\\u{e0041}"),
        ("\U000E007F", "\\u{e007f}"),
        ("h\u00e9llo \u4e16\u754c \U0001F600 \u0645\u0631\u062d\u0628\u0627", "h\u00e9llo \u4e16\u754c \U0001F600 \u0645\u0631\u062d\u0628\u0627"),
        ("e" + "\u0301" * 4, "e" + "\u0301" * 4),
        ("e" + "\u0301" * 6 + "x", "e" + "\u0301" * 4 + "[+2 combining marks dropped]x"),
        ("a" + "\u0300\u0301\u0302\u0303\u0304" + "b" + "\u0300" * 7,
         "a\u0300\u0301\u0302\u0303[+1 combining marks dropped]b" + "\u0300" * 4 + "[+3 combining marks dropped]"),
        (b"a\xffb", "a\ufffdb"),
        (b"\xc0\xaf", "\ufffd\ufffd"),
        ("\ud800", "\ufffd"),
        ("ok \u0007 \u202eevil\u202c", "ok \\x07 \\u{202e}evil\\u{202c}"),
    ],
)
def test_sanitize(text, expected):
    assert agentgate.sanitize(text) == expected


# The characters a terminal or a reader could be fooled by (reference 8.3).
UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u2064"
                    "\u2066-\u2069\ufeff\U000E0000-\U000E007F\ud800-\udfff]")


def test_sanitized_text_never_holds_an_unsafe_character():
    rng = random.Random(7)
    pool = [chr(c) for c in range(0x00, 0xA0)] + list("\u00ad\u061c\u180e\u200b\u200c\u200d\u200e\u200f"
                                                       "\u2028\u2029\u202a\u202e\u2060\u2064\u2066\u2069\ufeff"
                                                       "\U000E0001\U000E007F\ud800\udfff\u0301\u00e9\U0001F600")
    for _ in range(500):
        text = "".join(rng.choices(pool, k=rng.randint(0, 40)))
        out = agentgate.sanitize(text)
        assert not UNSAFE.search(out), repr(out)
        out.encode("utf-8")  # valid UTF-8: no surrogate survives


def test_cut_never_exceeds_the_limit_nor_splits_a_character():
    samples = ["a" * 300, "\u00e9" * 300, "\u4e16" * 300, "\U0001F600a\x00" * 100, "\u2028" * 300,
               "mixed \u00e9\u4e16\U0001F600 text " * 20, "", "short"]
    for text in samples:
        size = len(text.encode("utf-8"))
        for limit in range(0, 200):
            out = agentgate.cut(text, limit)
            data = out.encode("utf-8")
            if size <= limit:
                assert out == text
                continue
            assert len(data) <= limit, (text[:10], limit)
            head = out[:-1] if out.endswith("\u2026") and limit >= 3 else out
            assert text.startswith(head)
            if limit >= 3:
                assert out.endswith("\u2026")
                # the longest prefix: one more character would not fit beside the marker
                nxt = text[len(head)]
                assert len(head.encode()) + len(nxt.encode()) + 3 > limit


def test_clean_sanitizes_then_cuts():
    out = agentgate.clean("line one\nline two \u202e" + "x" * 200, 40)
    assert len(out.encode()) <= 40
    assert out.startswith("line one line two \\u{202e}")
    assert "\n" not in out and out.endswith("\u2026")
    assert agentgate.clean("a\x1b", 100) == "a\\x1b"


# ---------------------------------------------------------------- stored times

def test_stored_times_are_formatted_as_datetime_formats_them():
    import datetime

    def reference(seconds):
        moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
        return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    rng = random.Random(7)
    moments = [rng.uniform(0, 4e9) for _ in range(20000)]
    moments += [rng.randint(0, 4 * 10**9) + rng.randint(0, 10**6) / 1e6 for _ in range(20000)]
    # Halves of a microsecond round to even, and a fraction that rounds up to a whole second
    # carries into the second.
    moments += [base + 0.5e-6 * k for base in (0.0, 1.7e9, 12345.0) for k in range(-5, 6) if base + 0.5e-6 * k >= 0]
    moments += [1.7e9 + 0.9999995, 1.7e9 + 0.9999996, 0.0000005, 1e9 + 0.9999999]
    for seconds in moments:
        assert agentgate.format_time(seconds) == reference(seconds), seconds
    assert agentgate.format_time(agentgate.parse_time("2026-12-01T06:50:00.123456Z")) == \
        "2026-12-01T06:50:00.123456Z"


def test_documents_read_on_many_threads_at_once_keep_their_own_reasons():
    # The parser's hooks keep what they find per thread: a fault found in one thread's
    # document must never be reported for, or hidden from, another's.
    import threading
    documents = [b'{"a":1,"a":2}', b'{"b":[1e999]}', b'{"c":"\\ud800"}', b'{"d":' + b"1" * 5000 + b"}",
                 b'{"e":{"f":[1,2,{"g":3}]}}', b'[1,2,3]']

    def reason(document):
        try:
            return canonical(parse(document))
        except CanonicalError as err:
            return str(err)
    expected = [reason(d) for d in documents]
    assert len(set(expected)) == len(expected)
    failures = []

    def read(offset):
        for i in range(300):
            k = (i + offset) % len(documents)
            if reason(documents[k]) != expected[k]:
                failures.append((k, reason(documents[k])))
    threads = [threading.Thread(target=read, args=(n,)) for n in range(6)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert failures == []
