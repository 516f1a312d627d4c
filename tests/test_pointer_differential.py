"""JSON Pointers (agentgate's JSON Schema library) against the referencing package.

A seeded corpus of JSON documents (keys such as "", "~", "a/b", "~1", "%", "0", "01", "é";
arrays; numbers, strings, null) and of pointers into them: every path that exists, spelled
with ~0 and ~1, and paths that do not (a key one off, an index past the end, "-", an index with
a leading zero, a step past a leaf). Each pointer is read by parse_pointer and pointed
(with no schema, so no default fills in), and looked up in the same document, registered as
a resource, by referencing's Resolver (the package jsonschema resolves $ref with); the values
found, or that nothing is found, must agree. $refs are compared too: resolve_ref on a schema
with the same pointers.

Where referencing is looser than RFC 6901, RFC 6901 is the oracle, written out here (rfc_says):
- a step into a string is no step (referencing indexes a string's characters);
- an array index is `0` or digits without a leading zero (referencing reads anything int()
  reads: "01", " 1", "+1", "-1", "1_0").
Known and kept: resolve_ref reads an empty token as no token ("#/a//b" as "#/a/b") and an index
with leading zeros as its number; a schema's $ref is written by its server, whose validator
reads it as it reads it, so such pointers are left out of the $ref comparison.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path
from urllib.parse import quote

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402

referencing = pytest.importorskip("referencing")
from referencing.jsonschema import DRAFT202012  # noqa: E402

KEYS = ["a", "b", "", "~", "~0", "~1", "a/b", "/", "a~b", "%", "%25", "0", "1", "01", "-",
        "\u00e9", " "]
RFC_INDEX = re.compile(r"0|[1-9][0-9]*")
NOWHERE = "nowhere"


def document(chance: random.Random, depth: int = 0):
    roll = chance.random()
    if depth < 4 and roll < 0.45:
        return {key: document(chance, depth + 1) for key in chance.sample(KEYS, chance.randint(
            0, 5))}
    if depth < 4 and roll < 0.7:
        return [document(chance, depth + 1) for _ in range(chance.randint(0, 4))]
    return chance.choice([0, 7, -3, 10**20, "s", "xyz", "", None, True, False])


def paths(value, tokens=()):
    yield tokens
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, tokens + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from paths(item, tokens + (str(i),))


def spelled(tokens) -> str:
    return "".join("/" + t.replace("~", "~0").replace("/", "~1") for t in tokens)


def pointers(chance: random.Random, doc) -> list[str]:
    found = [spelled(t) for t in paths(doc) if t]
    missing = []
    for text in found:
        tokens = text.split("/")
        missing.append(text + "/" + chance.choice(KEYS + ["2", "00"]).replace("~", "~0"))
        tokens[-1] = chance.choice(["x", "-", "9", "01", "~1", "~0~1", ""])
        missing.append("/".join(tokens))
    missing.append("/" + chance.choice(["nope", "0", "-"]))
    return found + missing


def resolver(doc):
    registry = referencing.Registry().with_resource("urn:doc",
                                                    DRAFT202012.create_resource(doc))
    return registry.resolver()


def looked_up(found, text):
    try:
        return found.lookup("urn:doc#" + quote(text, safe="/")).contents
    except (referencing.exceptions.Unresolvable, LookupError, ValueError, TypeError):
        return NOWHERE


def rfc_says(found, text):
    """What referencing finds, where each step is one RFC 6901 takes."""
    steps = text.split("/")[1:]
    for k, token in enumerate(steps):
        parent = looked_up(found, "".join("/" + s for s in steps[:k]))
        if isinstance(parent, str) or (isinstance(parent, list) and not RFC_INDEX.fullmatch(
                token.replace("~1", "/").replace("~0", "~"))):
            return NOWHERE
    return looked_up(found, text)


def same(ours, theirs) -> bool:
    if ours is agentgate.MISSING or theirs is NOWHERE:
        return ours is agentgate.MISSING and theirs is NOWHERE
    return agentgate.canonical(ours) == agentgate.canonical(agentgate.parse(json.dumps(theirs)))


def corpus():
    chance = random.Random(2022)
    for _ in range(300):
        doc = {"root": document(chance)}
        yield doc, pointers(chance, doc)


def test_a_pointer_finds_what_referencing_finds_in_a_generated_corpus():
    wrong, found_some, missed_some = [], 0, 0
    for doc, texts in corpus():
        ours_doc, theirs = agentgate.parse(json.dumps(doc)), resolver(doc)
        for text in texts:
            tokens = agentgate.parse_pointer(text, "w")
            ours = agentgate.pointed(ours_doc, tokens, None)[0]
            expected = rfc_says(theirs, text)
            found_some += expected is not NOWHERE
            missed_some += expected is NOWHERE
            if not same(ours, expected):
                wrong.append((doc, text, ours, expected))
    assert wrong == []
    assert found_some > 2000 and missed_some > 2000


def test_a_ref_finds_what_referencing_finds():
    wrong, compared = [], 0
    for doc, texts in corpus():
        theirs = resolver(doc)
        schema = agentgate.parse(json.dumps(doc))
        for text in texts:
            if re.search(r"/(/|$)|/0[0-9]", text):  # resolve_ref's own reading: see above
                continue
            try:
                ours = agentgate.resolve_ref(schema, "#" + text)
            except agentgate.SchemaError:
                ours = agentgate.MISSING
            compared += 1
            if not same(ours, rfc_says(theirs, text)):
                wrong.append((doc, text, ours))
    assert wrong == []
    assert compared > 3000


def test_a_pointer_that_is_not_one_is_refused():
    for text in ("amount", "", "/a~2", "/a~", "/~x"):
        with pytest.raises(agentgate.ConfigError):
            agentgate.parse_pointer(text, "w")
    assert agentgate.parse_pointer("/~01/~10/", "w") == ("~1", "/0", "")
