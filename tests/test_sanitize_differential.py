"""The sanitizer (agentgate's library "Text safe to show") against node's Unicode properties.

Which code points sanitize must show as visible ASCII is classified independently, by node's
RegExp property escapes (node's ICU, a Unicode version of its own), not by the tables in
agentgate.py:

- \\r and \\n become a space; the rest of \\p{Cc} (C0, DEL, C1) reads \\xNN;
- \\p{Cs} (a lone surrogate) reads U+FFFD;
- \\p{Zl}, \\p{Zp}, \\p{Bidi_Control}, every \\p{Cf} that is also
  \\p{Default_Ignorable_Code_Point} (zero-width, joiners, soft hyphen, U+FEFF, tags, the
  deprecated, shorthand and musical format controls, ...) and the interlinear annotation marks
  U+FFF9-U+FFFB (they hide the text between them where a renderer honours them) read
  \\u{XXXX}; the other \\p{Cf} draw something (U+0600, the Arabic number sign) and are kept;
- \\p{M}: five in a row keep four, and the fifth is counted as dropped;
- everything else, private use included, is kept as it is.

Compared: every code point that both Python's unicodedata and node call assigned (an
unassigned one is judged by each side's own Unicode version, so it is left out), alone and
five in a row; and that sanitizing what sanitize gave changes nothing.

What differs on purpose: the tag block U+E0000-U+E007F is escaped whole, unassigned ones
too (left out here, as every unassigned code point is).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402

sanitize = agentgate.sanitize

# Each code point's classes as node reads them, written as runs: [first code point, bits] for
# each place the bits change. Bits: 1 assigned, 2 Cc, 4 Cs, 8 shown escaped, 16 a mark.
NODE_CLASSES = r"""
const assigned = /\P{Cn}/u, cc = /\p{Cc}/u, cs = /\p{Cs}/u, mark = /\p{M}/u;
const escaped =
  /[\p{Zl}\p{Zp}\p{Bidi_Control}\uFFF9-\uFFFB]|(?=\p{Cf})\p{Default_Ignorable_Code_Point}/u;
const runs = [];
let last = -1;
for (let cp = 0; cp <= 0x10ffff; cp++) {
  const ch = String.fromCodePoint(cp);
  const bits = (assigned.test(ch) ? 1 : 0) | (cc.test(ch) ? 2 : 0) | (cs.test(ch) ? 4 : 0) |
    (escaped.test(ch) ? 8 : 0) | (mark.test(ch) ? 16 : 0);
  if (bits !== last) { runs.push([cp, bits]); last = bits; }
}
process.stdout.write(JSON.stringify({unicode: process.versions.unicode, runs}));
"""

ASSIGNED, CC, CS, ESCAPED, MARK = 1, 2, 4, 8, 16


@pytest.fixture(scope="module")
def node_classes():
    if not shutil.which("node"):
        pytest.skip("node is not installed")
    out = subprocess.run(["node", "-e", NODE_CLASSES], capture_output=True, check=True,
                         timeout=60).stdout
    said = json.loads(out)
    classes = []
    runs = said["runs"] + [[0x110000, 0]]
    for (first, bits), (after, _) in zip(runs, runs[1:]):
        classes += [bits] * (after - first)
    return classes


def expected(code, bits):
    """What sanitize must make of one code point alone, by node's classes."""
    ch = chr(code)
    if bits & CC:
        return " " if ch in "\r\n" else f"\\x{code:02x}"
    if bits & CS:
        return "\ufffd"
    if bits & ESCAPED:
        return f"\\u{{{code:04x}}}"
    return ch


def compared(classes):
    """The code points assigned in both Unicode versions."""
    return [code for code in range(0x110000)
            if classes[code] & ASSIGNED and unicodedata.category(chr(code)) != "Cn"]


def test_each_code_point_is_kept_or_escaped_as_node_classifies_it(node_classes):
    codes = compared(node_classes)
    assert len(codes) > 280000  # planes 0-3, 14, and private use: nothing left out by mistake
    wrong = [(hex(code), sanitize(chr(code)), expected(code, node_classes[code]))
             for code in codes if sanitize(chr(code)) != expected(code, node_classes[code])]
    assert wrong == []


def test_a_run_of_marks_keeps_four_as_node_counts_marks(node_classes):
    wrong = []
    for code in compared(node_classes):
        ch = chr(code)
        five = sanitize(ch * 5)
        if node_classes[code] & MARK:
            want = ch * 4 + "[+1 combining marks dropped]"
        else:
            want = expected(code, node_classes[code]) * 5
        if five != want:
            wrong.append((hex(code), five, want))
    assert wrong == []


def test_sanitizing_twice_changes_nothing(node_classes):
    text = "".join(chr(code) for code in compared(node_classes))
    once = sanitize(text)
    assert sanitize(once) == once
    # a run after a base letter, broken by a character that is no mark, starts again
    assert sanitize("a" + "\u0301" * 6 + "b" + "\u0301" * 5) == \
        "a" + "\u0301" * 4 + "[+2 combining marks dropped]b" + "\u0301" * 4 + \
        "[+1 combining marks dropped]"


def test_the_tag_block_is_escaped_whole_assigned_or_not():
    for code in range(0xE0000, 0xE0080):
        assert sanitize(chr(code)) == f"\\u{{{code:04x}}}"


def test_invalid_utf8_reads_as_replacement_characters():
    assert sanitize(b"ok \xff\xfe\n") == "ok \ufffd\ufffd "


def test_format_characters_a_terminal_draws_as_nothing_are_shown():
    """Found by the comparison above: these were kept, and hid text from an operator."""
    hidden = "pay\ufff9 to mallory\ufffb bob \u206a\U0001bca0\U0001d173"
    assert sanitize(hidden) == ("pay\\u{fff9} to mallory\\u{fffb} bob \\u{206a}\\u{1bca0}"
                                "\\u{1d173}")
