"""JSON Schema patterns read as ECMA-262 reads them (the u flag), in linear time: differential
against node's own RegExp, the refusals, and patterns that make backtracking engines blow up."""
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import agentgate as ecma_pattern  # noqa: E402
from agentgate import PatternError, compile_pattern  # noqa: E402

NBSP, BOM, EM_SPACE, LS, PS, OGHAM = "\u00a0", "\ufeff", "\u2003", "\u2028", "\u2029", "\u1680"
EMOJI, EMOJI2 = "\U0001F600", "\U0001F64F"
WHITESPACE_TEXTS = ["", " ", "\t", "\n", "\r", "\v", "\f", NBSP, BOM, EM_SPACE, LS, PS, OGHAM,
                    "\u200b", "\u0085", "\u180e", "\u3000", "\u202f", "\u205f", "x", "_"]
TEXTS = ["", "a", "ab", "abc", "aab", "ba", "A", "a\n", "\na", "a\nb", "a\rb", "a b", "a_b", "0",
         "09", "a1", "-", "x-y", EMOJI, "a" + EMOJI, EMOJI + EMOJI, "\ud83d", "\ude00", "\ud83d!",
         "é", "ÿ", "foo@bar.com", "abcabc", "aaa", "bbb", "{", "}", "]", "a{2}", "\\", "/", "$", "^"]

# pattern -> texts it is tested against
CORPUS = {
    r"\s": WHITESPACE_TEXTS, r"\S": WHITESPACE_TEXTS, r"^\s*$": WHITESPACE_TEXTS,
    r"^[\s]$": WHITESPACE_TEXTS, r"^[^\s]$": WHITESPACE_TEXTS, r"[\S\s]": WHITESPACE_TEXTS,
    ".": ["\n", "\r", LS, PS, "\u0085", EMOJI, "\ud83d", "a", "", NBSP],
    "^.$": ["\n", "\r", LS, PS, EMOJI, "\ud83d", "\ude00", "a", "ab", EMOJI + "a"],
    "^..$": [EMOJI, EMOJI + "a", "ab", "\ude00\ud83d"],
    "^[^a]$": [EMOJI, "\n", "a", "b", "\ud83d", ""],
    r"^\u{1F600}+$": [EMOJI, EMOJI * 3, EMOJI + "a", ""],
    r"^\u{0000000041}$": ["A", "a"],
    r"^[😀-🙏]$": [EMOJI, EMOJI2, "\U0001F5FF", "\U0001F650"],
    "^😀{2}$": [EMOJI, EMOJI * 2, EMOJI * 3],
    r"[\u{10000}-\u{10FFFF}]": [EMOJI, "a", "\uffff", "\U0010FFFF"],
    r"\x41\u0042\t\n\v\f\r\0": ["AB\t\n\v\f\r\0", "AB"],
    r"^\/\^\$\\\.\*\+\?\(\)\[\]\{\}\|$": ["/^$\\.*+?()[]{}|", "x"],
    r"^[\-\]\\\^]+$": ["-]\\^", "a"], r"^[\b]$": ["\b", "b", "\\"],
    "^[a-z]+$": ["abc", "ABC", "", "a-z", "é"], "^[^a-z]+$": ["ABC", "abc", "A" + EMOJI],
    "^[a-]$": ["a", "-", "b"], "^[-a]$": ["a", "-", "b"], "^[-]$": ["-", "a"],
    "^[a-z-0]+$": ["a-0", "1"], "^[a-z-0-9]+$": ["a-5", "A"], "^[--0]+$": ["-./0", "1", ","],
    r"^[\w-]+$": ["a-b", "a b"], r"^[\d-]+$": ["1-2", "a"], r"^[^\d\s]+$": ["ab", "a1", "a b", NBSP],
    r"^[\W\d]+$": ["!1", "a"], r"^[^\W]+$": ["abc_1", "a-b"], r"^[\D]+$": ["ab", "a1"],
    "^[]$": ["", "a", "[]"], "^[^]$": ["a", "\n", EMOJI, ""], "[]": ["", "a"], "[^]": ["", "a"],
    "^[[]$": ["[", "]"], r"^[a\]]+$": ["a]", "]"], "^[{}()|*+?.]+$": ["{}()|*+?.", "a"],
    r"\bfoo\b": ["foo", "a foo b", "foobar", "_foo", "é" + "foo", "foo" + EMOJI, "foo\n"],
    r"\Bfoo": ["foo", "afoo", " foo"], r"foo\B": ["foo", "foob", "foo "],
    r"^\b$": ["", "a"], r"^\B$": ["", "a"], r"\b": ["", " ", "a", "é"], r"\B": ["", " ", "a", "ab"],
    r"a\b\Bb": ["ab", "a b"], r"\w\b\W": ["a!", "ab", "a é"], r"\b\w+\b": ["  x  ", "!!"],
    r"^\w+$": ["abc_123", "é", "abc-"], r"^\W+$": ["!@#", "é", "a"],
    r"^\d+$": ["0123456789", "١٢٣", "12a"], r"^\D$": ["a", "1", "٣"],
    "^abc$": ["abc", "abc\n", "\nabc", "xabc", "abcx"], "abc$": ["abc\n", "xxabc"],
    "^$": ["", "\n", " "], "$": ["", "a"], "^": ["", "a"], "a$": ["a\n", "ba"], "^a": ["\na", "ab"],
    "a^": ["a", ""], "$a": ["a", ""], "a$|^b": ["xa", "bx", "xb"], "(^a|b$)": ["ab", "ba", "xa"],
    "^a*$": ["", "a", "aaaa", "ab"], "^a+$": ["", "a", "aaa"], "^a?$": ["", "a", "aa"],
    "^a{2}$": ["a", "aa", "aaa"], "^a{2,}$": ["a", "aa", "aaaaa"], "^a{2,3}$": ["a", "aa", "aaa", "aaaa"],
    "^a{0}$": ["", "a"], "^a{0,0}b$": ["b", "ab"], "^a{0,1}$": ["", "a", "aa"],
    "^a{01,02}$": ["", "a", "aa", "aaa"], "^a*?$": ["", "aa"], "^a+?b$": ["aab", "b"],
    "^a??$": ["", "a", "aa"], "^a{2}?$": ["aa", "a"], "^a{2,}?$": ["aaa", "a"],
    "^a{1,2}?b$": ["ab", "aab", "aaab"], "^(ab)+$": ["ab", "abab", "aba", ""],
    "^(?:ab|cd)*$": ["", "abcd", "abc"], "^(a|ab)(c|bcd)(d*)$": ["abcd", "abcdd", "abc"],
    "^(((a)))$": ["a", "aa"], "^((a|b)(c|d))+$": ["ac", "bdad", "ab"], "^(?:(?:a)?b)?c$": ["c", "bc", "abc", "ac"],
    "a|b": ["a", "b", "c"], "^(a|)$": ["", "a", "b"], "^(|a)$": ["", "a"], "^a||b$": ["a", "b", "", "ab"],
    "|": ["", "x"], "^(?:)$": ["", "x"], "^()$": ["", "x"], "(|)+": ["", "x"],
    "^(a*)*$": ["", "aaa", "aab"], "^(a*)+b$": ["b", "aab", "aa"], "^(a?){3}$": ["", "a", "aaa", "aaaa"],
    "^(a|b)*c$": ["c", "ababc", "abab"], "^(?:a+|b+)*$": ["aabba", "abc"],
    "^(?:\\b|a)+$": ["", "a"], "(?:^|,)x(?:,|$)": ["x", "a,x", "a,x,b", "ax", "xa"],
    "^(?:a{2}){2}$": ["aaaa", "aaa", "aaaaa"], "^(?:a{1,2}){2,3}$": ["a", "aa", "aaaaaa", "aaaaaaa"],
    "^[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\\.[A-Za-z]{2,}$": ["foo@bar.com", "foo@bar", "a b@c.de", "x@y.zz"],
    "^\\d{4}-\\d{2}-\\d{2}$": ["2024-01-31", "2024-1-31", "٢٠٢٤-01-31"],
    "^[a-zA-Z0-9_-]{1,64}$": ["tool_name-1", "", "a" * 65, "a" * 64, "tool name"],
    "^(\\([0-9]{3}\\))?[0-9]{3}-[0-9]{4}$": ["(555)555-1234", "555-1234", "(55)555-1234"],
    "^[^<>]*$": ["hello", "<script>", "a\nb"], "^\\S+$": ["abc", "a" + NBSP + "b", "a" + BOM],
    "^.*$": ["abc", "a\nb", "a" + LS + "b", "a\rb", ""], "^[^\\n]*$": ["a\rb", "a\nb"],
    "x*": ["", "y"], "a/b": ["a/b", "ab"], "^\\u00e9$": ["é", "e\u0301"],
    "^\\u0041\\u{42}$": ["AB"], "\\u{FEFF}": [BOM, ""], "^\\x7f$": ["\x7f"],
    "^\\0$": ["\0", "0"], "^[\\0-\\x1f]+$": ["\x01\x02", "a"], "^\\\\$": ["\\"],
    "^(?:[a-z]+://)?[^\\s/]+(?:/\\S*)?$": ["https://x.org/a", "x.org", "a b"],
    "[a-c][x-z]": ["by", "bb", "cz"], "^\\s+\\S+\\s+$": [" a ", NBSP + "a" + PS, EM_SPACE + "a" + OGHAM],
    "^.{3}$": ["abc", EMOJI * 3, "ab\n"], "\n": ["a\nb", "a"], "^\r\n$": ["\r\n"],
    "^" + LS + "$": [LS], "[" + PS + "]": [PS, LS],
}

REFUSED_AS_SYNTAX_ERRORS = [
    "{", "}", "]", "a{", "a{,2}", "a{2,1}", "{2}", "*", "a**", "+a", "?", "a{2}{3}", "a{ 2}",
    "(", ")", "a)", "(a", "((a)", "[", "[a", "[^", "[a-", "\\", "a\\", "[\\", "(?", "(?a)", "(?i:a)",
    "\\a", "\\Z", "\\z", "\\A", "\\e", "\\-", "\\ ", "\\_", "\\=", "\\'", "\\\"", "\\@", "\\<", "\\é",
    "\\c", "\\c1", "\\x", "\\x1", "\\xg0", "\\u", "\\u12", "\\u{}", "\\u{110000}", "\\u{12", "\\00",
    "\\01", "[z-a]", "[\\d-z]", "[a-\\w]", "[\\s-\\S]", "[\\B]", "[\\c]", "[\\a]", "[\\1]", "[\\k]",
    "^*", "$+", "\\b*", "\\B{2}", "(?<1>a)", "(?<a b>a)", "(?<>a)", "(?<a>a)(?<a>b)", "(?<a",
    "\\1", "\\k", "\\k<a>", "a{1,2}{3}", "x{3,2}?", "\\p", "\\P", "\\p{Foo}",
]

# valid ECMAScript that is refused on purpose, with the sentence's key words
UNSUPPORTED = {
    "(a)\\1": "backreferences",
    "a(?=b)": "lookahead", "a(?!b)": "lookahead", "(?<=a)b": "lookbehind", "(?<!a)b": "lookbehind",
    "\\p{L}": "property", "\\P{Lu}": "property", "[\\p{N}]": "property",
    "a{1001}": "above 1000", "a{0,5000}": "above 1000", "a{99999999999999999999}": "above 1000",
    "(?:a{1000}){1000}": "too large", "(?:(?:){1000}){1000}": "too large",
    "(" * 101 + ")" * 101: "nested", "(?<\\u0061>x)": "named group",
    "^(?<year>[0-9]{4})$": "named group", "^\\cJ$": "control escapes",
    "[\\cA-\\cZ]": "control escapes", "^\\uD83D\\uDE00$": "escaped surrogate",
    "\\uDE00": "escaped surrogate", "[\\uD83D\\uDE00-\\uD83D\\uDE4F]": "escaped surrogate",
}
UNSUPPORTED_WORDS = ("backreferences", "lookahead", "lookbehind", "property", "above 1000",
                     "too large", "nested", "named group", "control escapes",
                     "escaped surrogate")

NODE_SCRIPT = r"""
const fs = require('fs');
const cases = JSON.parse(fs.readFileSync(process.argv[1], 'utf8'));
const out = cases.map(([pattern, texts]) => {
  let re;
  try { re = new RegExp(pattern, 'u'); } catch (e) { return {error: e.name + ': ' + e.message}; }
  return {results: texts.map(t => re.test(t))};
});
fs.writeFileSync(process.argv[2], JSON.stringify(out));
"""


def random_cases(count=400, seed=20240601):
    """Small random patterns over a tiny alphabet, each with random texts over the same."""
    rng = random.Random(seed)
    atoms = ["a", "b", ".", "\\w", "\\W", "\\s", "\\d", "[ab]", "[^a]", "[a-c]", " ", "\\n"]
    anchors = ["^", "$", "\\b", "\\B"]

    def node(depth):
        roll = rng.random()
        if depth > 2 or roll < 0.35:
            return rng.choice(atoms + anchors if rng.random() < 0.2 else atoms)
        if roll < 0.55:
            return node(depth + 1) + node(depth + 1)
        if roll < 0.7:
            return "(?:" + node(depth + 1) + "|" + node(depth + 1) + ")"
        body = "(?:" + node(depth + 1) + ")"
        return body + rng.choice(["*", "+", "?", "{2}", "{0,2}", "{1,}", "*?", "{2,3}?"])

    chars = ["a", "b", "c", " ", "\n", "1", "!", NBSP, EMOJI]
    return [(node(0), ["".join(rng.choice(chars) for _ in range(rng.randint(0, 6)))
                       for _ in range(6)]) for _ in range(count)]


def run_node(cases):
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
        with open(src, "w", encoding="ascii") as f:
            json.dump(cases, f)   # ensure_ascii: lone surrogates travel as \udXXX escapes
        subprocess.run(["node", "-e", NODE_SCRIPT, src, dst], check=True, timeout=60)
        with open(dst, encoding="utf-8") as f:
            return json.load(f)


def ours(pattern, texts):
    try:
        compiled = compile_pattern(pattern)
    except PatternError as err:
        return {"error": str(err)}
    return {"results": [compiled.search(t) for t in texts]}


@pytest.fixture(scope="module")
def verdicts():
    """One node process judges every case; returns [(pattern, texts, node's, ours)]."""
    if not shutil.which("node"):
        pytest.skip("node is not installed")
    cases = list(CORPUS.items()) + random_cases()
    cases += [(p, []) for p in REFUSED_AS_SYNTAX_ERRORS + list(UNSUPPORTED)]
    return [(p, texts, theirs, ours(p, texts))
            for (p, texts), theirs in zip(cases, run_node(cases))]


def test_every_text_gets_the_same_answer_as_node(verdicts):
    checked, mismatches = 0, []
    for pattern, texts, theirs, mine in verdicts:
        if "results" in theirs and "results" in mine:
            checked += len(texts)
            mismatches += [(pattern, t, node_says) for t, node_says, we_say
                           in zip(texts, theirs["results"], mine["results"]) if node_says != we_say]
    assert not mismatches
    assert checked > 2500
    print(f"{checked} (pattern, text) pairs agree with node")


def test_corpus_patterns_all_compile(verdicts):
    refused = [(p, mine["error"]) for p, _, _, mine in verdicts[:len(CORPUS)] if "error" in mine]
    assert not refused


def test_what_node_rejects_we_refuse(verdicts):
    accepted = [p for p, _, theirs, mine in verdicts if "error" in theirs and "error" not in mine]
    assert not accepted
    for pattern in REFUSED_AS_SYNTAX_ERRORS:
        theirs = next(t for p, _, t, _ in verdicts if p == pattern)
        assert theirs.get("error", "").startswith("SyntaxError"), pattern


def test_what_we_refuse_but_node_accepts_is_a_documented_unsupported_form(verdicts):
    for pattern, _, theirs, mine in verdicts:
        if "error" in mine and "error" not in theirs:
            assert any(word in mine["error"] for word in UNSUPPORTED_WORDS), (pattern, mine)
    for pattern, word in UNSUPPORTED.items():
        theirs = next(t for p, _, t, _ in verdicts if p == pattern)
        assert "error" not in theirs, pattern
        assert word in ours(pattern, [])["error"], pattern


@pytest.mark.parametrize("pattern, expected", [
    (r"^(a+)+$", False), (r"(a|a)*b", False), (r"(a*)*$", True), (r"^(\w+\s?)*$", False),
    (r"^(a|aa)+$", False), (r"^([a-z]+)*[0-9]$", False), (r"(x+x+)+y", False),
])
def test_catastrophic_backtracking_patterns_run_in_linear_time(pattern, expected):
    assert compile_pattern(pattern).search("a" * 100000 + "!") is expected


def test_answers_stay_right_when_the_dfa_cache_is_dropped_mid_search(monkeypatch):
    monkeypatch.setattr(ecma_pattern, "_CACHE_BUDGET", 300)
    forgotten, real_forget = [], ecma_pattern.Pattern._forget

    def counting_forget(self):
        forgotten.append(self)
        real_forget(self)

    monkeypatch.setattr(ecma_pattern.Pattern, "_forget", counting_forget)
    compiled = compile_pattern(r"(?:a|b)*a(?:a|b){8}$")   # its DFA has 512+ states
    rng = random.Random(7)
    for _ in range(20):
        text = "".join(rng.choice("ab") for _ in range(3000))
        assert compiled.search(text) is (text[-9] == "a")
    assert compile_pattern(r"^[^x]*$").search("".join(map(chr, range(0x100, 0x3100))))
    assert len(forgotten) > 20


def test_zero_width_matches_never_split_a_surrogate_pair():
    # The standard reads u-mode input as code points; node 20's V8 also tries the position
    # inside a surrogate pair, so there /\B/u.test("a\u{1F600}b") comes out true.
    assert not compile_pattern(r"\B").search("a" + EMOJI + "b")
    assert compile_pattern(r"\B").search(EMOJI)   # at the start: neither side is a word


@pytest.mark.parametrize("pattern, sentence", [
    ("(a)\\1", "backreferences are not supported"),
    ("(a)\\k<x>", "backreferences are not supported"),
    ("(?<x>a)", "the named group at offset 0 is not supported; write (?:...) instead"),
    ("\\cJ", "control escapes \\cX are not supported; write \\xNN"),
    ("\\uD83D", "the escaped surrogate at offset 0 is not supported; write the character "
               "itself or \\u{...}"),
    ("a(?=b)", "lookahead (?= is not supported"),
    ("(?<!a)b", "lookbehind (?<! is not supported"),
    ("\\p{L}", "Unicode property escapes \\p{...} are not supported"),
    ("ab(c", "unbalanced parenthesis at offset 2"),
    ("abc)", "unbalanced parenthesis at offset 3"),
    ("a{", "a lone { is not allowed (write \\{)"),
    ("a}", "a lone } is not allowed (write \\})"),
    ("a]", "a lone ] is not allowed (write \\])"),
    ("a{,2}", "a lone { is not allowed (write \\{)"),
    ("*a", "nothing to repeat at offset 0"),
    ("a**", "nothing to repeat at offset 2"),
    ("^*", "nothing to repeat at offset 1"),
    ("\\a", "the escape \\a at offset 0 is not allowed"),
    ("x\\Z", "the escape \\Z at offset 1 is not allowed"),
    ("[z-a]", "a range in the class at offset 0 is out of order"),
    ("[a-\\d]", "a range in the class at offset 0 uses \\d, \\s or \\w"),
    ("[abc", "the character class at offset 0 is not closed"),
    ("abc\\", "the pattern ends with a lone backslash"),
    ("a{3,2}", "the numbers in the quantifier at offset 1 are out of order"),
    ("a{1001}", "repetition counts above 1000 are not supported"),
    ("(?:a{1000}){11}", "the pattern is too large (more than 10000 states)"),
    ("(?i:a)", "the group at offset 0 has an unknown (? form"),
])
def test_refusals_say_what_is_wrong(pattern, sentence):
    with pytest.raises(PatternError) as caught:
        compile_pattern(pattern)
    assert str(caught.value) == sentence


def test_python_re_differences_are_gone():
    assert compile_pattern(r"^\s$").search("\u2029")            # re.ASCII \s misses it
    assert not compile_pattern(r"^.$").search("\r")             # Python's . matches \r
    assert not compile_pattern(r"^abc$").search("abc\n")        # Python's $ matches before \n
    assert compile_pattern(r"^\w+$").search("abc") and not compile_pattern(r"^\w$").search("é")
