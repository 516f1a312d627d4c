"""What a result's record keeps (agentgate's library of that name) against node.

Each generated tools/call result goes through the gate's own reading (parse, passed_result)
and result_record; ONE node process computes, from the section's contract alone, the record
it must give: every UTF-8 size and cut with node's Buffer, every base64 decoding with node's
Buffer, every sha256 with node's crypto. Whether a string is base64 is decided by a strict
check of the test's own (node's decoder is lenient: it reads "QQ" or "-_" as well), and node
decodes only the strings that pass it. The result's canonical encoding, and that of a block
the contract records whole, are agentgate.canonical's: section 10 is a library with its own
differential test (tests/test_canonical.py); node hashes the bytes it gives.

Generated: text, image, audio, resource (text, blob, both, neither, no resource object),
resource_link and unknown blocks, with mimeType, uri and name present, absent or of the wrong
type; texts of astral, combining and control characters; base64 valid, and not (no padding,
padding past the end, pad bits set, white space, the URL alphabet, non-ASCII); results whose
strings cross CONTENT_CAP over several blocks so that a cut falls inside a character, inside a
label or exactly at its end; structured content that fits what the strings leave and that does
not; isError true, false, truthy and absent; a few results of more than RECORDED_BLOCKS blocks.
block_labels, outcome_text (on each record, passed on and withheld, and on the shapes recorded
before schema 4) and result_summary are checked against what the contract says of them.

Left out on purpose: strings with an unpaired surrogate. parse refuses the escape, so none
reaches result_record from a server, and node's Buffer would write U+FFFD for one where
Python's "surrogatepass" writes its three bytes; the last tests pin that such a result is
refused. Found by the comparison: Python's strict base64 decoder read "QUJD=" (a "=" past a
whole quantum) and "QR==" (a pad bit set), so two strings were recorded as one; fixed, and
kept as a named test.
"""

from __future__ import annotations

import base64
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402

CAP, RECORDED = agentgate.CONTENT_CAP, agentgate.RECORDED_BLOCKS
TOOL = SimpleNamespace(name="srv_up", server=SimpleNamespace(name="srv"), upstream_name="up")

# The contract, computed by node. Input: {cap, recorded, cases: [{canonical: of the result,
# blocks: [canonical of each recorded block, null past 1,000 bytes], structured: canonical or
# null}]}. A long block is always a text (the fillers), whose canonical form is not needed.
NODE_RECORD = r"""
const crypto = require('crypto');
const input = JSON.parse(require('fs').readFileSync(0, 'utf8'));
const digest = (buf) => ({bytes: buf.length,
                          sha256: crypto.createHash('sha256').update(buf).digest('hex')});
const utf8 = (s) => Buffer.from(s, 'utf8');
const isObject = (v) => v !== null && typeof v === 'object' && !Array.isArray(v);
// The longest run of whole characters (code points) of s that fits in n UTF-8 bytes.
function prefix(s, n) {
  let used = 0, end = 0;
  for (const ch of s) {
    const size = Buffer.byteLength(ch, 'utf8');
    if (used + size > n) break;
    used += size; end += ch.length;
  }
  return [s.slice(0, end), used];
}
// RFC 4648 base64, padded, nothing else, and the pad bits zero: the one spelling of its bytes.
const ALPHABET = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/';
function strictBase64(s) {
  if (!/^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$/.test(s)) return false;
  if (s.endsWith('==')) return (ALPHABET.indexOf(s[s.length - 3]) & 15) === 0;
  if (s.endsWith('=')) return (ALPHABET.indexOf(s[s.length - 2]) & 3) === 0;
  return true;
}
const out = input.cases.map((c) => {
  const result = JSON.parse(c.canonical);
  let room = input.cap, cut = null;
  const keep = (s, field) => {
    const size = utf8(s).length;
    if (size <= room) { room -= size; return s; }
    const [kept, used] = prefix(s, room);
    if (cut === null && room > 0) cut = {field, inside: used < room, kept: kept.length};
    room = 0;
    return kept;
  };
  const record = {...digest(utf8(c.canonical)), blocks: []};
  const sizes = [], valid = [];
  result.content.slice(0, input.recorded).forEach((block, i) => {
    const type = block.type;
    const entry = {type: utf8(type).length <= 100 ? type : prefix(type, 97)[0] + '\u2026'};
    const source = type === 'resource' && isObject(block.resource) ? block.resource : block;
    for (const label of ['mimeType', 'uri', 'name']) {
      if (typeof source[label] === 'string') entry[label] = keep(source[label], label);
    }
    const text = type === 'text' || type === 'resource' ? source.text : undefined;
    const data = type === 'resource' ? source.blob
      : type === 'image' || type === 'audio' ? source.data : undefined;
    let whole;
    if (typeof text === 'string') {
      whole = digest(utf8(text));
      entry.text = keep(text, 'text');
      if (entry.text !== text) Object.assign(entry, whole);
    } else if (typeof data === 'string' && strictBase64(data)) {
      whole = digest(Buffer.from(data, 'base64'));
      Object.assign(entry, whole);
      valid.push(data);
    } else if (typeof data === 'string') {
      whole = digest(utf8(data));
      Object.assign(entry, whole, {base64: false});
    } else {
      if (c.blocks[i] === null) throw new Error('no canonical form was sent for ' + i);
      whole = digest(utf8(c.blocks[i]));
      Object.assign(entry, whole);
    }
    sizes.push(whole.bytes);
    record.blocks.push(entry);
  });
  if (result.content.length > input.recorded) {
    record.more_blocks = result.content.length - input.recorded;
  }
  let valueKept = false;
  if ('structuredContent' in result) {
    const encoded = utf8(c.structured);
    record.structured = digest(encoded);
    valueKept = encoded.length <= room;
  }
  if (result.isError === true) record.is_error = true;
  return {record, sizes, valueKept, cut, valid, room};
});
process.stdout.write(JSON.stringify(out));
"""

# Characters of every UTF-8 length, the ones canonical escapes, a combining mark, the largest
# code point. No lone surrogate: parse refuses one (see the test at the end).
CHARS = ["a", "Z", "0", " ", "\n", "\t", "\x00", "\x1f", "\x7f", '"', "\\", "/", "<", ">", "&",
         "=", "+", "é", "ß", "\u0301", "€", "中", "\u2028", "\ufeff", "\uffff", "😀", "𝄞",
         "\U0010ffff"]
WRONG = [5, 1.5, None, True, False, [], {}, ["text/plain"], {"uri": "x"}]
KINDS = ["text", "image", "audio", "resource", "resource_link"]


def text(rng, most=40):
    return "".join(rng.choice(CHARS) for _ in range(rng.randrange(most + 1)))


def label(rng):
    """A mimeType, uri or name as a server may send it: absent (None), or a value."""
    roll = rng.random()
    if roll < 0.4:
        return None
    if roll < 0.55:
        return [rng.choice(WRONG)]
    if roll < 0.65:
        return [""]
    return [rng.choice(["text/plain", "image/png", "file:///a/b.txt", "Résumé 😀"]) +
            text(rng, 8)]


def b64(rng):
    """A string sent as base64 data: valid, or not in one of the ways a decoder may forgive."""
    raw = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
    good = base64.b64encode(raw).decode()
    roll = rng.randrange(9)
    if roll < 3:
        return good
    if roll == 3:
        return good.rstrip("=") or "QQ"
    if roll == 4:  # padding past the end, or after a whole quantum
        return good + "=" * rng.randrange(1, 4)
    if roll == 5 and good.endswith("="):  # a pad bit set: decodes, but is not how it encodes
        last = good.rstrip("=")
        return last[:-1] + chr(ord(last[-1]) + 1) + good[len(last):]
    if roll == 6:
        at = rng.randrange(len(good) + 1)
        return good[:at] + rng.choice([" ", "\n", "\r\n", "é", "\u2028"]) + good[at:]
    if roll == 7:
        return good.replace("+", "-").replace("/", "_") + rng.choice(["", "-_"])
    return text(rng, 12)


def block(rng):
    """One content block, of a known type or not, its fields right or wrong."""
    kind = rng.choice(KINDS + ["x-" + text(rng, 6), "", "resource " * 12 + "€中😀" * 3])
    found = {"type": kind}
    where = found
    if kind == "resource":
        roll = rng.random()
        if roll < 0.8:
            where = found["resource"] = {}
        elif roll < 0.9:
            found["resource"] = rng.choice(WRONG[:4] + ["file:///x"])
    for field in ("mimeType", "uri", "name"):
        value = label(rng)
        if value is not None:
            where[field] = value[0]
    for field, chance in (("text", 0.5), ("data", 0.5), ("blob", 0.4)):
        if rng.random() < chance:
            where[field] = text(rng) if field == "text" and rng.random() < 0.85 else \
                b64(rng) if rng.random() < 0.85 else rng.choice(WRONG)
    if rng.random() < 0.2:
        found["annotations"] = {"audience": ["user"], "priority": 0.5}
    if rng.random() < 0.1:
        found["_meta"] = {"k": text(rng, 5)}
    return found


def structured(rng, size):
    """A structured content value of about `size` bytes (or another JSON value)."""
    roll = rng.random()
    if roll < 0.1:
        return rng.choice([None, 0, -1.5e300, "s", [], [1, 2.0, True]])
    return {"n": rng.randrange(-10 ** 20, 10 ** 20), "f": rng.random(),
            "s": text(rng, 5) + "x" * max(0, size), "list": [text(rng, 3), None, False]}


def finish(rng, result):
    if rng.random() < 0.3:
        result["isError"] = rng.choice([True, True, False, 1, "true", None])
    if rng.random() < 0.1:
        result["_meta"] = {"progressToken": rng.randrange(100)}
    if rng.random() < 0.1:
        result["extra"] = "not passed on"  # passed_result drops it: no part of the record
    return result


def small(rng):
    result = {"content": [block(rng) for _ in range(rng.randrange(9))]}
    if rng.random() < 0.35:
        result["structuredContent"] = structured(rng, rng.randrange(50))
    return finish(rng, result)


def crossing(rng):
    """Strings that cross CONTENT_CAP: a filler, then short texts and labels of characters of
    every length, so the cut lands inside a character, inside a label or at a string's end."""
    unit = rng.choice(["a", "é", "€", "😀", "a€😀é"])
    filler = unit * ((CAP - rng.randrange(400)) // len(unit.encode()))
    pieces = rng.randrange(1, 4)
    step = len(filler) // pieces + 1
    blocks = [{"type": "text", "text": filler[i:i + step]} for i in range(0, len(filler), step)]
    for _ in range(rng.randrange(9)):
        roll = rng.random()
        if roll < 0.5:
            blocks.append({"type": "text", "text": text(rng, 60)})
        elif roll < 0.7:
            blocks.append({"type": "resource", "resource": {
                "uri": "file:///" + text(rng, 20), "mimeType": text(rng, 10),
                "text": text(rng, 30)}})
        elif roll < 0.85:
            blocks.append({"type": "image", "mimeType": "image/" + text(rng, 20),
                           "data": b64(rng)})
        else:
            blocks.append(block(rng))
    rng.shuffle(blocks[pieces - 1:])  # the filler stays first; one of its pieces may move
    result = {"content": blocks}
    if rng.random() < 0.6:
        result["structuredContent"] = structured(rng, rng.randrange(400))
    return finish(rng, result)


def many(count, size, rng):
    """More blocks than the record describes one by one."""
    return {"content": [{"type": "text", "text": "é" * size + str(i)} for i in range(count)],
            "structuredContent": structured(rng, 0)}


def cases():
    rng = random.Random(19)
    results = [small(rng) for _ in range(2000)] + [crossing(rng) for _ in range(240)]
    results += [many(RECORDED, 1, rng), many(RECORDED + 1, 1, rng), many(700, 0, rng),
                many(RECORDED + 88, 200, rng)]
    # The strings end exactly at the cap: a text after them, "" included, and a label.
    results.append({"content": [{"type": "text", "text": "a" * (CAP - 4) + "😀"},
                                {"type": "text", "text": ""},
                                {"type": "text", "text": "b", "mimeType": "text/plain"}],
                    "structuredContent": {}})
    # Structured content exactly as long as what the strings leave, and one byte longer.
    for over in (0, 1):
        results.append({"content": [{"type": "text", "text": "a" * (CAP - 108 + over)}],
                        "structuredContent": {"s": "x" * 100}})
    return results


def passed_on(result):
    """The result as the gate reads and passes it: through parse and passed_result."""
    parsed = agentgate.parse(json.dumps(result))
    passed, why = agentgate.passed_result(TOOL, parsed)
    assert passed is not None, why
    return passed


def short(value):
    """A case shown in a failure: long strings by their ends, so the cut can be seen."""
    if isinstance(value, str) and len(value) > 100:
        return f"{value[:30]!r}...({len(value)} characters)...{value[-50:]!r}"
    if isinstance(value, dict):
        return {k: short(v) for k, v in value.items()}
    if isinstance(value, list):
        return [short(v) for v in value]
    return value


@pytest.fixture(scope="module")
def compared():
    """[(passed, our record, node's expectation)] for every generated case."""
    if not shutil.which("node"):
        pytest.skip("node is not installed")
    passed = [passed_on(result) for result in cases()]
    sent = []
    for result in passed:
        encoded = agentgate.canonical(result).decode()
        described = [agentgate.canonical(b).decode() for b in result["content"][:RECORDED]]
        described = [d if len(d) <= 1000 else None for d in described]
        shaped = agentgate.canonical(result["structuredContent"]).decode() \
            if "structuredContent" in result else None
        sent.append({"canonical": encoded, "blocks": described, "structured": shaped})
    out = subprocess.run(["node", "-e", NODE_RECORD], input=json.dumps(
        {"cap": CAP, "recorded": RECORDED, "cases": sent}, ensure_ascii=False).encode(),
        capture_output=True,
        check=True, timeout=120).stdout
    return [(p, agentgate.result_record(p), want) for p, want in zip(passed, json.loads(out))]


def test_each_record_is_what_node_computes_from_the_contract(compared):
    wrong = []
    for index, (passed, record, want) in enumerate(compared):
        ours = {k: v for k, v in record.items() if k != "blocks"}
        if "structured" in ours:
            ours["structured"] = {k: v for k, v in ours["structured"].items() if k != "value"}
        theirs = {k: v for k, v in want["record"].items() if k != "blocks"}
        problems = [(field, ours.get(field), theirs.get(field)) for field in
                    sorted(set(ours) | set(theirs)) if ours.get(field) != theirs.get(field)]
        if len(record["blocks"]) != len(want["record"]["blocks"]):
            problems.append(("blocks", len(record["blocks"]), len(want["record"]["blocks"])))
        problems += [(f"block {i}", short(mine), short(node)) for i, (mine, node) in
                     enumerate(zip(record["blocks"], want["record"]["blocks"])) if mine != node]
        kept = "value" in record.get("structured", {})
        if kept != want["valueKept"] or kept and agentgate.canonical(
                record["structured"]["value"]) != agentgate.canonical(
                passed["structuredContent"]):
            problems.append(("structured value kept", kept, want["valueKept"]))
        if problems:
            wrong.append({"case": index, "ours, node's": problems, "result": short(passed)})
    assert wrong == [], json.dumps(wrong[:3], indent=1, ensure_ascii=False, default=str)


def test_the_generated_cases_reach_every_edge_the_contract_names(compared):
    """Nothing left out by mistake: each edge is met by enough cases to matter."""
    records = [want["record"] for _, _, want in compared]
    entries = [entry for record in records for entry in record["blocks"]]
    cuts = [want["cut"] for _, _, want in compared if want["cut"]]
    assert sum(cut["inside"] for cut in cuts) >= 25  # a character's bytes on both sides
    assert sum(cut["field"] == "text" and cut["kept"] > 0 for cut in cuts) >= 50
    assert sum(cut["field"] != "text" and cut["kept"] > 0 for cut in cuts) >= 15
    assert any(want["room"] == 0 and not want["cut"] for _, _, want in compared)  # at its end
    assert sum(1 for e in entries if "text" in e and "sha256" in e and not e["text"]) >= 300
    assert sum(1 for e in entries if e.get("base64") is False) >= 400
    assert sum(len(want["valid"]) for _, _, want in compared) >= 300
    assert sum(1 for e in entries if e["type"].endswith("\u2026")) >= 500
    assert sum(1 for e in entries for f in ("mimeType", "uri", "name") if e.get(f) == "") \
        >= 100  # past the cap, or sent empty
    near = [w["valueKept"] for _, _, w in compared if 0 < w["room"] < 400 and "structured" in
            w["record"]]
    assert near.count(True) >= 15 and near.count(False) >= 30
    assert sum(w["room"] == 0 and "structured" in w["record"] for _, _, w in compared) >= 30
    assert sum("more_blocks" in r for r in records) == 3
    assert {(r.get("is_error"), "isError" in p) for (p, _, _), r in zip(compared, records)} \
        == {(None, False), (None, True), (True, True)}


def labels_of(record, sizes):
    """block_labels by the contract: "[type label, N bytes]", the label the block's mimeType
    or else its uri when one is a non-empty string, N its whole size; then the count past."""
    labels = []
    for entry, size in zip(record["blocks"], sizes):
        name = entry.get("mimeType") or entry.get("uri") or ""
        labels.append(f"[{entry['type']}{' ' + name if name else ''}, {size} bytes]")
    if "more_blocks" in record:
        labels.append(f"[{record['more_blocks']} more blocks]")
    return labels


def test_labels_name_each_block_by_its_type_label_and_whole_size(compared):
    wrong = [(index, short(record), agentgate.block_labels(record),
              labels_of(want["record"], want["sizes"]))
             for index, (_, record, want) in enumerate(compared)
             if agentgate.block_labels(record) != labels_of(want["record"], want["sizes"])]
    assert wrong == [], wrong[:3]


def test_outcome_text_is_the_texts_kept_and_the_other_blocks_labels(compared):
    wrong = []
    for index, (passed, record, want) in enumerate(compared):
        labels = labels_of(want["record"], want["sizes"])
        for withheld in (False, True):
            parts = [entry["text"] if entry["type"] == "text" and "text" in entry and
                     not withheld else shown
                     for entry, shown in zip(want["record"]["blocks"], labels)]
            parts += labels[len(want["record"]["blocks"]):]
            if not passed["content"] and want["valueKept"] and not withheld:
                parts.append(agentgate.policy_json(passed["structuredContent"]))
            observed = {"kind": "tool_error" if record.get("is_error") else "tool_result",
                        "summary": "", "result": record}
            if record.get("is_error"):
                observed["content"] = {"tool": TOOL.name, "ending": "error"}
            if withheld:
                observed["withheld"] = True
            if agentgate.outcome_text(observed) != "\n".join(parts):
                wrong.append((index, withheld, short(record),
                              short(agentgate.outcome_text(observed)), short("\n".join(parts))))
    assert wrong == [], wrong[:3]


def test_outcome_text_reads_an_observation_recorded_before_schema_4():
    """Before schema 4 a result was recorded as its content: the text, or structured content;
    an error as the error, in the observation's content."""
    rng = random.Random(4)
    for _ in range(200):
        said = text(rng)
        value = structured(rng, rng.randrange(20))
        value = value if not isinstance(value, str) else [value]  # a text is the first case
        assert agentgate.outcome_text({"kind": "tool_result", "content": said,
                                       "content_hash": "0" * 64}) == said
        assert agentgate.outcome_text({"kind": "tool_result", "content": value}) == \
            agentgate.policy_json(value)
        assert agentgate.outcome_text({"kind": "tool_error", "summary": "s", "content": {
            "tool": "t", "error": said, "ending": rng.choice(agentgate.CALL_ENDINGS)}}) == said


def test_the_summary_says_size_blocks_structured_error_and_withheld(compared):
    wrong = []
    for index, (passed, record, want) in enumerate(compared):
        count = len(passed["content"])
        over = index % 3 * 1000
        said = [f"srv/up: {want['record']['bytes']} bytes, {count} "
                f"{'block' if count == 1 else 'blocks'}"]
        said += ["structured content"] * ("structuredContent" in passed)
        said += ["an error"] * (passed.get("isError") is True)
        said += [f"withheld: more than {over} bytes"] * bool(over)
        if agentgate.result_summary(TOOL, record, over) != ", ".join(said):
            wrong.append((index, agentgate.result_summary(TOOL, record, over), said))
    assert wrong == [], wrong[:3]


def test_a_result_with_an_unpaired_surrogate_is_refused_not_recorded():
    """parse refuses the escape, so no result the gate reads has one; result_record, given
    one anyway, raises (call_upstream then answers that the result is unreadable)."""
    with pytest.raises(agentgate.CanonicalError):
        agentgate.parse('{"content": [{"type": "text", "text": "\\ud800"}]}')
    for result in ({"content": [{"type": "text", "text": "a\ud800"}]},
                   {"content": [{"type": "image", "data": "\udfff"}]},
                   {"content": [], "structuredContent": {"k": "\ud83d"}}):
        with pytest.raises(ValueError):
            agentgate.result_record(result)


def test_base64_with_padding_past_a_whole_quantum_or_pad_bits_set_is_not_base64():
    """Found by the comparison above: Python's strict decoder reads "QUJD=" and "QR==" (the
    bytes "ABC" and "A"), so two spellings recorded as one; each is its own string, as sent."""
    for sent in ("QUJD=", "QUJD==", "QUJDRA===", "QR==", "QUJ="):
        (entry,) = agentgate.result_record(
            {"content": [{"type": "image", "data": sent, "mimeType": "image/png"}]})["blocks"]
        assert (entry["bytes"], entry["sha256"], entry.get("base64")) == (
            len(sent), agentgate.sha256_hex(sent.encode()), False), (sent, entry)
    for sent, data in (("QUI=", b"AB"), ("QQ==", b"A"), ("QUJD", b"ABC"), ("", b"")):
        (entry,) = agentgate.result_record({"content": [{"type": "audio", "data": sent}]})[
            "blocks"]
        assert entry == {"type": "audio", "bytes": len(data),
                         "sha256": agentgate.sha256_hex(data)}, (sent, entry)
