"""The policy on what a call does, as pure functions (agentgate's policy section), under hostile input.

Specification: SPEC "Policy on what a call does" and the promises of that section: a condition
that cannot be evaluated does not hold; numbers compare as exact decimals from their literals,
never through a float; a path lies under a directory only if it does so both as written and
as this machine resolves its links; a URL's host is the one a client would connect to, and a
host that could be read two ways is no host; a limit never loosens; every mistake in a policy
is refused at load with one sentence naming the tool, the entry and the fix.

Covered, condition by condition: equals / in / not_in (canonical comparison, lookalike
payees, numbers by value, strings that look like numbers), min / max (exact decimals, huge
exponents, numbers sent as strings, booleans), max_length and present, pattern (ECMA-262
semantics, refusals at load, the work budget), under (traversal, symbolic links in and out,
relative paths, NUL bytes, `~`, sibling prefixes, a root that is a link), host_in /
host_not_in (userinfo, ports, IPv6 literals, case, trailing dots, punycode and IDNA, lookalike
and full-width hosts, backslashes, numeric IPv4 forms, subdomain entries, values that are no
URL), during (days, hours past midnight, zones), Entry and its clients with the first-match
rule of policy_decision, Limit.frees (counts, exact sums, when a limit frees up, NEVER), the
refusals of a whole config, and the schema checks of pointers (pointer_problem,
policy_pointer_problem).

Every value the policy reads is parsed with agentgate.parse, as the gate parses the config
and the arguments, so numbers are agentgate.Number literals. Hostile inputs come in tables;
a table test checks every row and reports all the rows that go wrong at once. Each
file-system fixture lives in the test's own tmp_path; nothing sleeps or reads the clock.
"""

from __future__ import annotations

import datetime
import json
import re
import sys
import types
import zoneinfo
from decimal import Decimal
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402

ConfigError = agentgate.ConfigError
NEVER = agentgate.NEVER
HOUR = 3600


def P(text: str):
    return agentgate.parse(text.encode("utf-8"))


def J(value):
    """A Python value as the gate would have parsed it (numbers become Number)."""
    return P(json.dumps(value, ensure_ascii=False))


def condition(text: str, pointer: str = "/v") -> agentgate.Condition:
    return agentgate.Condition(pointer, P(text), "where")


def holds(condition_text: str, value_json: str) -> bool:
    """Whether the condition holds of the arguments {"v": value}, both given as JSON text."""
    return condition(condition_text).holds(P('{"v": %s}' % value_json))


def holds_of(cond: agentgate.Condition, value) -> bool:
    return cond.holds(J({"v": value}))


def wrong(rows, verdict):
    """The rows (case..., expected) whose verdict is not the expected one."""
    return [row for row in rows if verdict(*row[:-1]) is not row[-1]]


def condition_refusal(text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        condition(text)
    return str(caught.value)


def refusals_missing(texts, fragment):
    """The condition texts whose refusal at load does not say `fragment`."""
    missing = []
    for text in texts:
        try:
            condition(text)
            missing.append((text, "accepted"))
        except ConfigError as err:
            if fragment not in str(err):
                missing.append((text, str(err)))
    return missing


def assert_one_sentence_naming(message: str, *names: str) -> None:
    assert "\n" not in message, message
    assert not re.search(r"[.!?]\s+[A-Z]", message), f"more than one sentence: {message}"
    for name in names:
        assert name in message, f"{name!r} not named in: {message}"


# ---------------------------------------------------------------- equals, in, not_in


EQUAL = [  # (expected, value): the same JSON value, however written
    ("100", "1e2"), ("100", "100.0"), ("100", "1E+2"), ("0", "-0"), ("0.5", "5e-1"),
    ('{"a": [1, 2.0], "b": null}', '{"b": null, "a": [1.0, 2e0]}'),
    ('[{"x": "y"}]', '[{"x": "y"}]'), ("null", "null"), ('""', '""'),
]
ONLY_ALIKE = [  # (expected, value): two values that only look or round alike
    ("10", '"10"'), ('"10"', "10"),
    ("1", "true"), ("0", "false"), ("0", "null"), ('""', "null"), ("false", "null"),
    ("100", "100.000000000000000000000000000001"),   # equal as floats, not as decimals
    ("[1, 2]", "[2, 1]"), ('{"a": 1}', '{"a": 1, "b": 2}'), ('{"a": [1]}', '{"a": 1}'),
    ('"caf\\u00e9"', '"cafe\\u0301"'),               # NFC and NFD are two strings
    ('"landlord"', '"l\\u0430ndlord"'),              # a Cyrillic a
]


def test_equals_compares_canonically_and_numbers_by_exact_value():
    assert not wrong([(e, v, True) for e, v in EQUAL],
                     lambda e, v: holds('{"equals": %s}' % e, v))


def test_equals_refuses_values_that_are_only_alike():
    assert not wrong([(e, v, False) for e, v in ONLY_ALIKE],
                     lambda e, v: holds('{"equals": %s}' % e, v))


def test_a_lookalike_payee_is_not_in_the_list():
    known = condition('{"in": ["landlord", "grocer"]}', "/to")
    assert known.holds({"to": "landlord"})
    lookalikes = ["l\u0430ndlord",                                          # Cyrillic a
                  "\uff4c\uff41\uff4e\uff44\uff4c\uff4f\uff52\uff44",      # full-width
                  "land\u200blord", "landlord\u200d",                        # zero-width
                  "landlord ", "Landlord", "LANDLORD", "landlord\x00", "landlord\n"]
    assert [p for p in lookalikes if known.holds({"to": p})] == []


def test_in_and_not_in_compare_numbers_by_value_and_never_strings_with_numbers():
    assert holds('{"in": [1e2, "x"]}', "100.00")
    assert not holds('{"in": ["10"]}', "10")
    assert not holds('{"in": [10]}', '"10"')
    assert holds('{"not_in": ["10"]}', "10")
    assert not holds('{"not_in": [0.1]}', "1e-1")
    assert holds('{"in": [{"k": [1]}]}', '{"k": [1.0]}')
    assert not holds('{"in": [true]}', "1")


def test_in_and_not_in_do_not_hold_of_an_absent_value():
    assert not condition('{"in": [null]}').holds({})
    assert not condition('{"not_in": ["evil"]}').holds({})
    assert not condition('{"not_in": ["evil"]}', "/v/0").holds(J({"v": []}))
    assert not condition('{"not_in": ["evil"]}', "/v/w").holds(J({"v": "w"}))


def test_in_and_not_in_need_a_non_empty_list():
    assert refusals_missing(['{"in": []}', '{"in": "landlord"}', '{"not_in": {}}',
                             '{"not_in": null}'], "non-empty list") == []


# ---------------------------------------------------------------- min, max


EXACT_BOUNDS = [  # (condition, value, holds)
    ('{"max": "50.00"}', "50", True),
    ('{"max": "50.00"}', "50.000", True),
    ('{"max": "50.00"}', "5e1", True),
    ('{"max": "50.00"}', "500e-1", True),
    ('{"max": "50.00"}', "50.000000000000001", False),
    ('{"max": "50.00"}', "50.0000000000000000000000000000000000001", False),
    ('{"max": 50}', "-1e308", True),
    ('{"min": "1e2"}', "100", True),
    ('{"min": 100}', "1e2", True),
    ('{"min": 100}', "99.99999999999999999999", False),
    ('{"min": "0.1", "max": "0.3"}', "0.3", True),
    ('{"min": "0.1", "max": "0.3"}', "0.30000000000000004", False),
]
HUGE_BOUNDS = [
    ('{"max": "1e9999"}', "1e308", True),
    ('{"min": "1e9999"}', "1e308", False),
    ('{"min": "-1e9999"}', "-1e308", True),
    ('{"max": "-1e9999"}', "-1e308", False),
    ('{"min": "1e-9999"}', "0", False),
    ('{"min": "1e-9999"}', "1e-9999", True),
    ('{"min": "1e-9999"}', "1e-10000", False),
    ('{"max": "-1e-9999"}', "-0", False),
    ('{"max": 1e308}', "1e-9999", True),
]


def test_min_and_max_compare_exact_decimals_from_the_literal():
    assert not wrong(EXACT_BOUNDS, holds)


def test_min_and_max_with_huge_and_tiny_exponents():
    assert not wrong(HUGE_BOUNDS, holds)


def test_a_number_past_a_float_never_reaches_a_condition_and_would_compare_exactly():
    # The boundary refuses a float64 overflow inside the arguments...
    with pytest.raises(agentgate.CanonicalError):
        P('{"v": 1e9999}')
    # ...and a Number that got here anyway (read back from a record, say) still compares
    # exactly, without an overflow.
    assert not condition('{"max": "1e9998"}').holds({"v": agentgate.Number("1e9999")})
    assert condition('{"min": "1e9998"}').holds({"v": agentgate.Number("1e9999")})
    assert condition('{"max": "-1e9998"}').holds({"v": agentgate.Number("-1e9999")})


def test_min_and_max_hold_only_of_a_number():
    for value in ('"10"', '"1e2"', "true", "false", "null", "[10]", '{"n": 10}'):
        assert not holds('{"min": 0}', value), value
        assert not holds('{"max": 100}', value), value
    assert not condition('{"min": 0}').holds({})


def test_min_equal_to_max_holds_at_exactly_that_value():
    exact = condition('{"min": "50.00", "max": 50}')
    assert holds_of(exact, 50) and holds_of(exact, 50.0)
    assert not exact.holds(P('{"v": 50.0000000000000001}'))


def test_a_bound_that_is_no_decimal_is_refused():
    bounds = ['"ten"', '" 10"', '"10 "', '"+10"', '".5"', '"1."', '"0x10"', '"NaN"',
              '"Infinity"', '"1e10001"', "true", "null", "[1]", '""', '"1,5"']
    assert refusals_missing(['{"max": %s}' % b for b in bounds] +
                            ['{"min": %s}' % b for b in bounds],
                            "must be a number or a decimal string") == []


def test_min_above_max_is_refused_at_load():
    texts = ['{"min": "10", "max": 5}', '{"min": 1e2, "max": "99.99"}',
             '{"min": "1e-9999", "max": 0}', '{"max": "-1e9999", "min": "1e9999"}']
    assert refusals_missing(texts, "swap them") == []


# ---------------------------------------------------------------- max_length, present


LENGTHS = [  # (value, holds for max_length 3)
    ('"abc"', True), ('"abcd"', False), ('""', True),
    ('"\U0001F600\U0001F600\U0001F600"', True),   # three code points, six UTF-16 units
    ('"e\\u0301e\\u0301"', False),                 # four code points, two as displayed
    ("[1, 2, 3]", True), ("[1, 2, 3, 4]", False), ("[]", True),
    ("123", False), ('{"a": 1}', False), ("null", False), ("true", False),
]


def test_max_length_counts_code_points_and_items_only():
    assert not wrong(LENGTHS, lambda value: holds('{"max_length": 3}', value))
    assert not condition('{"max_length": 3}').holds({})


def test_max_length_is_a_whole_number_however_written():
    assert holds('{"max_length": 2.0}', '"ab"')
    assert not holds('{"max_length": 1e0}', '"ab"')
    assert refusals_missing(['{"max_length": %s}' % b for b in ("1.5", "-1", '"3"', "true")],
                            "whole number of at least 0") == []


def test_present_true_holds_of_any_value_even_null_and_false_only_of_none():
    present, absent = condition('{"present": true}'), condition('{"present": false}')
    for value in ("null", "false", '""', "[]", "0"):
        args = P('{"v": %s}' % value)
        assert present.holds(args) and not absent.holds(args), value
    assert absent.holds({}) and not present.holds({})
    assert condition('{"present": false}', "/v/3").holds(J({"v": [1, 2]}))
    assert condition('{"present": false}', "/v/01").holds(J({"v": [1, 2]}))


def test_present_false_with_another_test_is_refused():
    texts = ['{"present": false, "equals": 1}', '{"max": 5, "present": false}',
             '{"present": false, "in": [1], "max_length": 2}']
    assert refusals_missing(texts, "give it its own entry") == []
    assert "true or false" in condition_refusal('{"present": "yes"}')


# ---------------------------------------------------------------- pattern


PATTERNS = [  # (pattern as JSON string content, value, holds)
    ("b", '"abc"', True),                     # searched, not matched whole
    ("^b", '"abc"', False),
    ("^abc$", '"abc"', True),
    ("^abc$", '"abc\\n"', False),             # ECMA's $ is the end, not before a last newline
    ("^\\\\d+$", '"123"', True),
    ("^\\\\d+$", '"\\u0661\\u0662"', False),  # Arabic-Indic digits are no \d in ECMA
    ("^.$", '"\\n"', False),
    ("^.$", '"\U0001F600"', True),            # one code point (the u flag)
    ("^[a-z]+$", '"l\\u0430ndlord"', False),
    ("1", "1", False),                        # a pattern tests strings only
    ("null", "null", False),
]


def test_pattern_searches_with_ecma_semantics():
    assert not wrong(PATTERNS, lambda p, v: holds('{"pattern": "%s"}' % p, v))


def test_a_pattern_ecma_rejects_or_agentgate_refuses_is_refused_at_load():
    patterns = ["(a", "[z-a]", "a{2,1}", "(?P<n>a)", "\\\\Z", "*a", "a(?=b)"]
    assert refusals_missing(['{"pattern": "%s"}' % p for p in patterns],
                            "cannot be used") == []


def test_a_refused_pattern_is_told_the_subset_it_may_use():
    # The libraries read a strict subset of ECMA-262: the sentence names all of it.
    for pattern in ["(?<n>a)", "\\\\ca", "(a)\\\\1"]:
        assert refusals_missing(['{"pattern": "%s"}' % pattern],
                                "named groups, \\p{...} or \\cX") == [], pattern


def test_a_pattern_that_is_a_number_or_null_is_refused_at_load():
    assert refusals_missing(['{"pattern": 5}', '{"pattern": null}'], "ECMA-262") == []


def test_a_pattern_that_is_a_list_or_an_object_is_refused_at_load():
    # A list or an object must not reach compile_pattern's lru_cache (TypeError, unhashable)
    # but get the ConfigError every mistake gets.
    for text in ('{"pattern": ["a"]}', '{"pattern": {"a": 1}}'):
        assert "ECMA-262" in condition_refusal(text), text


def test_a_value_too_long_for_the_work_budget_does_not_hold():
    pattern = "[a-z]{1000}"
    size = agentgate.compile_pattern(pattern).size
    cond = condition(json.dumps({"pattern": pattern}))
    assert holds_of(cond, "a" * 1000)
    assert not holds_of(cond, "a" * (agentgate.PATTERN_WORK // size + 1))


# ---------------------------------------------------------------- under


@pytest.fixture
def tree(tmp_path):
    """root/sub/file, outside/file, root2 beside root, and links: root/out -> outside,
    outside/in -> root/sub, root/dangling -> outside/nothing, link_to_root -> root."""
    for d in ("root/sub", "outside", "root2"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "root/sub/file").write_text("x")
    (tmp_path / "outside/file").write_text("x")
    (tmp_path / "root/out").symlink_to(tmp_path / "outside")
    (tmp_path / "outside/in").symlink_to(tmp_path / "root/sub")
    (tmp_path / "root/dangling").symlink_to(tmp_path / "outside/nothing")
    (tmp_path / "link_to_root").symlink_to(tmp_path / "root")
    return tmp_path


def under(*roots) -> agentgate.Condition:
    return condition(json.dumps({"under": [str(r) for r in roots]}))


def under_root(tree, rows):
    """The rows (path relative to the tree, holds) that go wrong for under [tree/root]."""
    cond = under(tree / "root")
    return wrong(rows, lambda relative: holds_of(cond, f"{tree}/{relative}"))


def test_under_normalises_dots_and_slashes_and_compares_whole_components(tree):
    assert under_root(tree, [
        ("root", True), ("root/", True), ("root/x", True), ("root/sub/file", True),
        ("root/./x", True), ("root//sub///file", True), ("root/sub/../x", True),
        ("root/sub/../../root/x", True),
        ("root/..", False), ("root/../x", False), ("root/../outside/file", False),
        ("root/sub/../../x", False),
        ("root2", False), ("root2/x", False), ("root.txt", False),   # a shared prefix only
    ]) == []


def test_a_link_inside_the_root_pointing_out_is_outside(tree):
    assert under_root(tree, [
        ("root/out", False), ("root/out/file", False),
        ("root/out/new-file", False),        # through the link to a leaf that does not exist
        ("root/dangling", False),            # a dangling link whose target is outside
    ]) == []


def test_a_link_pointing_in_from_outside_is_inside_once_resolved(tree):
    assert under_root(tree, [("outside/in/file", True), ("outside/in/new-file", True),
                             ("link_to_root/x", True)]) == []


def test_a_path_must_be_inside_both_as_written_and_as_resolved(tree):
    assert under_root(tree, [
        ("root/out/../x", False),            # inside as written, outside as resolved
        ("outside/in/../x", False),          # inside as resolved, outside as written
    ]) == []


def test_repeated_leading_slashes_are_one(tree):
    assert holds_of(under(tree / "root"), f"//{tree}//root//x")
    assert holds_of(under(tree / "root"), f"///{tree}/root/x/")
    assert not holds_of(under(tree / "root"), f"//{tree}//root//..//x")


def test_a_relative_path_never_holds_wherever_the_gate_runs(tree, monkeypatch):
    monkeypatch.chdir(tree / "root")  # where each of them would land inside
    for value in ("x", "sub/file", "./x", ".", "", "../root/x", "x\\..\\y"):
        assert not holds_of(under(tree / "root"), value), value
        assert not holds_of(under("/"), value), value


def test_a_nul_byte_never_holds(tree):
    for suffix in ("/x\x00", "\x00/../../etc", "/\x00", "\x00"):
        assert not holds_of(under(tree / "root"), f"{tree}/root{suffix}"), suffix


def test_a_path_that_is_no_string_does_not_hold():
    for value in ("5", "null", "true", '["/"]', '{"p": "/"}'):
        assert not under("/").holds(P('{"v": %s}' % value)), value
    assert not under("/").holds({})


def test_tilde_is_the_home_directory_in_roots_and_in_values(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "sandbox").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    sandbox = condition('{"under": ["~/sandbox"]}')
    assert sandbox.tests[0][1] == [str((home / "sandbox").resolve())]
    assert holds_of(sandbox, "~/sandbox/notes.txt")
    assert holds_of(sandbox, f"{home}/sandbox/notes.txt")
    assert not holds_of(sandbox, "~")
    assert not holds_of(sandbox, "~/sandbox/../x")
    assert not holds_of(sandbox, "~root/sandbox/x")     # another user's home is not expanded
    assert not holds_of(sandbox, "~sandbox/x")
    assert holds_of(condition('{"under": ["~"]}'), "~")


def test_a_root_that_is_a_link_is_resolved_once_at_load(tree):
    link = tree / "link_to_root"
    cond = under(link)
    assert cond.tests[0][1] == [str((tree / "root").resolve())]
    assert holds_of(cond, f"{tree}/root/x") and holds_of(cond, f"{link}/x")
    link.unlink()
    link.symlink_to(tree / "outside")  # re-pointed after load: the root stays where it was
    assert not holds_of(cond, f"{tree}/outside/x")
    assert not holds_of(cond, f"{link}/x")
    assert holds_of(cond, f"{tree}/root/x")


def test_a_root_with_a_trailing_slash_and_several_roots(tree):
    cond = under(f"{tree}/root/", tree / "outside")
    assert holds_of(cond, f"{tree}/root/x") and holds_of(cond, f"{tree}/outside/x")
    assert not holds_of(cond, f"{tree}/root2/x")


def test_sandbox2_is_not_under_sandbox(tmp_path):
    (tmp_path / "home/me/sandbox").mkdir(parents=True)
    (tmp_path / "home/me/sandbox2").mkdir()
    cond = under(tmp_path / "home/me/sandbox")
    assert holds_of(cond, f"{tmp_path}/home/me/sandbox/x")
    assert not holds_of(cond, f"{tmp_path}/home/me/sandbox2")
    assert not holds_of(cond, f"{tmp_path}/home/me/sandbox2/x")
    assert not holds_of(cond, f"{tmp_path}/home/me/sandbox.txt")


def test_a_root_that_is_not_an_absolute_directory_is_refused():
    assert refusals_missing(['{"under": [%s]}' % r for r in
                             ('"sandbox"', '"./sandbox"', '"~user/sandbox"')],
                            "is relative; write the directory as an absolute path") == []
    assert refusals_missing(['{"under": [%s]}' % r for r in ('""', '"/tmp/\\u0000"', "5",
                                                              "null")],
                            "non-empty strings") == []
    assert refusals_missing(['{"under": []}', '{"under": "/tmp"}'], "non-empty list") == []


# ---------------------------------------------------------------- host_in, host_not_in


IN, NOT_IN, NEITHER = (True, False), (False, True), (False, False)


def host_verdicts(url, entries):
    """Whether host_in and host_not_in hold of `url`, given the same list of entries."""
    listed = json.dumps(entries, ensure_ascii=False)
    return (holds_of(condition('{"host_in": %s}' % listed), url),
            holds_of(condition('{"host_not_in": %s}' % listed), url))


def hosts_wrong(rows):
    return [(url, entries, verdict, host_verdicts(url, entries))
            for url, entries, verdict in rows if host_verdicts(url, entries) != verdict]


def test_userinfo_is_no_host():
    assert hosts_wrong([
        ("https://good.com/", ["good.com"], IN),
        ("https://good.com@evil.com/", ["good.com"], NOT_IN),
        ("https://good.com:pw@evil.com/", ["good.com"], NOT_IN),
        ("https://a@b@evil.com/", ["evil.com"], IN),
        ("https://user:pw@good.com:8443/pay?x=1", ["good.com"], IN),
        ("https://good.com#@evil.com/", ["good.com"], IN),      # the rest is a fragment
        ("https://good.com?@evil.com/", ["good.com"], IN),      # ... or a query
        ("https://evil.com%2f@good.com/", ["good.com"], IN),
    ]) == []


def test_ports_are_set_aside_and_a_port_that_is_no_port_spoils_the_url():
    assert hosts_wrong([
        ("https://good.com:443/", ["good.com"], IN),
        ("https://good.com:/", ["good.com"], IN),
        ("https://good.com:99999/", ["good.com"], NEITHER),
        ("https://good.com:http/", ["good.com"], NEITHER),
        ("https://good.com:-1/", ["good.com"], NEITHER),
    ]) == []


def test_ipv6_literals_compare_in_their_standard_form():
    assert hosts_wrong([
        ("http://[::1]:8080/", ["::1"], IN),
        ("http://[::1]:8080/", ["[::1]"], IN),
        ("http://[0:0::1]/", ["0:0:0:0:0:0:0:1"], IN),
        ("http://[::2]/", ["::1"], NOT_IN),
        ("http://[::1/", ["::1"], NEITHER),
        ("http://[fe80::1%25eth0]/", ["fe80::1"], NEITHER),     # a zone id
        ("http://[evil.com]/", ["evil.com"], NEITHER),
    ]) == []


def test_case_and_one_trailing_dot_do_not_change_the_host():
    assert hosts_wrong([
        ("HTTPS://GOOD.COM/", ["good.com"], IN),
        ("https://good.com/", ["GOOD.com."], IN),
        ("https://evil.com./", ["evil.com"], IN),               # caught by host_not_in too
        ("https://evil.com../", ["evil.com"], NEITHER),
        ("https://evil..com/", ["evil.com"], NEITHER),
    ]) == []


def test_hosts_are_read_in_ascii_and_a_name_in_another_script_holds_for_neither():
    assert hosts_wrong([
        ("https://xn--bcher-kva.de/", ["xn--bcher-kva.de"], IN),
        ("https://XN--BCHER-KVA.DE./", ["xn--bcher-kva.de"], IN),
        ("https://bücher.de/", ["xn--bcher-kva.de"], NEITHER),
        ("https://BÜCHER.de/", ["evil.com"], NEITHER),
    ]) == []


def test_lookalike_hosts_are_other_hosts_and_ambiguous_ones_are_none():
    assert hosts_wrong([
        ("https://g\u043e\u043egle.com/", ["google.com"], NEITHER),    # Cyrillic o
        ("https://\uff47\uff4f\uff4f\uff47\uff4c\uff45.com/", ["google.com"], NEITHER),
        ("https://google\uff0ecom/", ["google.com"], NEITHER),        # full-width full stop
        ("https://google\u3002com/", ["google.com"], NEITHER),        # ideographic full stop
        ("https://stra\u00dfe.de/", ["strasse.de"], NEITHER),         # IDNA 2003 and 2008 differ
        ("https://ev%69l.com/", ["evil.com"], NEITHER),               # percent-encoded
        ("https://-evil.com/", ["evil.com"], NEITHER),
    ]) == []


def test_backslashes_and_whitespace_spoil_the_url():
    assert hosts_wrong([
        ("https://evil.com\\@good.com/", ["good.com"], NEITHER),
        ("https://evil.com\\@good.com/", ["evil.com"], NEITHER),
        ("https://good.com\\.evil.com/", ["good.com"], NEITHER),
        (" https://evil.com/", ["evil.com"], NEITHER),
        ("https://evil.com\t/", ["evil.com"], NEITHER),
        ("https://evil\n.com/", ["evil.com"], NEITHER),
        ("https://evil.com\x00.good.com/", ["good.com"], NEITHER),
    ]) == []


def test_numeric_ipv4_forms_other_than_the_dotted_quad_are_no_host():
    assert hosts_wrong([
        ("http://127.0.0.1:80/", ["127.0.0.1"], IN),
        ("http://0x7f.1/", ["127.0.0.1"], NEITHER),
        ("http://2130706433/", ["127.0.0.1"], NEITHER),
        ("http://127.1/", ["127.0.0.1"], NEITHER),
        ("http://0177.0.0.1/", ["127.0.0.1"], NEITHER),
        ("http://127.0.0.01/", ["127.0.0.1"], NEITHER),
        ("http://1.2.3.0x4/", ["1.2.3.4"], NEITHER),
        ("http://1.2.3.4.5/", ["1.2.3.4"], NEITHER),
    ]) == []


def test_a_dotted_entry_means_strict_subdomains():
    assert hosts_wrong([
        ("https://a.example.com/", [".example.com"], IN),
        ("https://a.b.example.com./", [".example.com"], IN),
        ("https://example.com/", [".example.com"], NOT_IN),
        ("https://badexample.com/", [".example.com"], NOT_IN),
        ("https://example.com.evil.com/", [".example.com", "example.com"], NOT_IN),
    ]) == []


def test_a_value_that_is_no_url_with_a_host_holds_for_neither():
    assert hosts_wrong([(url, ["good.com"], NEITHER) for url in (
        "good.com", "//good.com/", "https:good.com", "mailto:x@good.com", "https://", "",
        "file:///etc/passwd", "https://good.com/" + "a" * 9000)]) == []
    for value in ("5", "null", "true", '["https://good.com/"]', '{"url": "https://good.com/"}'):
        assert not holds('{"host_in": ["good.com"]}', value), value
        assert not holds('{"host_not_in": ["good.com"]}', value), value
    assert not condition('{"host_not_in": ["good.com"]}').holds({})


def test_an_ipv4_mapped_ipv6_literal_does_not_slip_past_host_not_in():
    # [::ffff:127.0.0.1] is 127.0.0.1 to a dual-stack client, so it is compared as that, not
    # as the IPv6 address ::ffff:7f00:1 (which host_not_in ["127.0.0.1"] would let through).
    for url in ("http://[::ffff:127.0.0.1]/", "http://[::ffff:7f00:1]:8080/"):
        assert not holds_of(condition('{"host_not_in": ["127.0.0.1"]}'), url), url


def test_a_host_entry_that_is_no_host_name_is_refused():
    entries = ["https://good.com/", "good.com/", "good.com:443", "[::1]:80", "*.example.com",
               "..example.com", ".::1", "", "0x7f.1", "2130706433", 5, None]
    assert refusals_missing([json.dumps({"host_in": [e]}) for e in entries] +
                            [json.dumps({"host_not_in": ["ok.com", e]}) for e in entries],
                            'is not a host name; write it like "example.com"') == []
    foreign = ["\uff47\uff4f\uff4f\uff47\uff4c\uff45.com", "stra\u00dfe.de", "b\u00fccher.de",
               "https://.b\u00fccher.de"]
    assert refusals_missing([json.dumps({"host_in": [e]}) for e in foreign] +
                            [json.dumps({"host_not_in": [e]}) for e in foreign[:3]],
                            "is not ASCII; write a host name in another script in its "
                            'punycode form, as "xn--bcher-kva.de"') == []
    assert refusals_missing(['{"host_in": []}', '{"host_not_in": "evil.com"}'],
                            "non-empty list") == []


# ---------------------------------------------------------------- during


PARIS = zoneinfo.ZoneInfo("Europe/Paris")
UTC = datetime.timezone.utc


def at(month, day, hour, minute=0, zone=PARIS) -> float:
    """Seconds since the epoch of a wall-clock moment of 2024 in `zone` (1 January was a
    Monday)."""
    return datetime.datetime(2024, month, day, hour, minute, tzinfo=zone).timestamp()


def during(raw) -> agentgate.During:
    return agentgate.During(J(raw), "rules.pay.when[0].during")


def test_during_reads_days_and_hours_in_the_zone_it_names():
    office = during({"days": "mon-fri", "hours": "09:00-18:00", "zone": "Europe/Paris"})
    assert office.holds(at(1, 1, 9))
    assert office.holds(at(1, 5, 17, 59))                   # Friday
    assert not office.holds(at(1, 1, 8, 59))
    assert not office.holds(at(1, 1, 18))                   # the end is excluded
    assert not office.holds(at(1, 6, 10))                   # Saturday
    assert office.holds(at(1, 1, 8, 30, UTC))               # 09:30 in Paris
    assert not office.holds(at(1, 1, 17, 30, UTC))          # 18:30 in Paris
    assert not office.holds(at(1, 5, 23, 30, UTC))          # Saturday 00:30 in Paris


def test_an_hour_range_may_run_past_midnight():
    night = during({"hours": "22:00-06:00", "zone": "UTC"})
    assert wrong([(22, 0, True), (23, 59, True), (0, 0, True), (5, 59, True), (6, 0, False),
                  (12, 0, False), (21, 59, False)],
                 lambda h, m: night.holds(at(1, 1, h, m, UTC))) == []
    assert during({"hours": "00:00-24:00", "zone": "UTC"}).holds(at(1, 1, 23, 59, UTC))


def test_a_day_range_may_wrap_past_sunday():
    weekend = during({"days": "fri-mon", "zone": "Europe/Paris"})
    assert [weekend.holds(at(1, day, 12)) for day in range(1, 8)] == \
        [True, False, False, False, True, True, True]
    assert during({"days": "sat, SUN", "zone": "UTC"}).days == {5, 6}


@pytest.mark.parametrize("raw, named", [
    ({"hours": "09:00-18:00"}, "zone"),
    ({"hours": "09:00-18:00", "zone": "Mars/Olympus"}, "zone"),
    ({"hours": "09:00-18:00", "zone": "../../etc/passwd"}, "zone"),
    ({"hours": "09:00-18:00", "zone": 5}, "zone"),
    ({"zone": "UTC"}, "needs days, hours or both"),
    ({}, "must be an object"),
    ({"days": "mon", "zone": "UTC", "timezone": "UTC"}, 'unknown field "timezone"'),
])
def test_a_during_without_a_usable_zone_or_range_is_refused(raw, named):
    with pytest.raises(ConfigError) as caught:
        during(raw)
    assert_one_sentence_naming(str(caught.value), "rules.pay.when[0].during", named)


def test_days_and_hours_that_cannot_be_read_are_refused():
    accepted = []
    for field, text in [("hours", "9-18"), ("hours", "09:00-09:00"), ("hours", "24:00-06:00"),
                        ("hours", "09:00-25:00"), ("hours", "09:60-10:00"), ("hours", "09:00"),
                        ("hours", 9), ("days", "monday"), ("days", "mon-xyz"), ("days", ""),
                        ("days", "mon,,fri"), ("days", 1)]:
        try:
            during({field: text, "zone": "UTC"})
            accepted.append((field, text))
        except ConfigError as err:
            assert f"during.{field} must read like" in str(err)
    assert accepted == []


# ---------------------------------------------------------------- Entry and first match


def entry(raw) -> agentgate.Entry:
    return agentgate.Entry(J(raw), "rules.pay.when[0]", "when[0]")


def facts(client="claude-desktop", moment=None):
    return agentgate.Facts(at(1, 1, 10) if moment is None else moment, client, lambda: [], None)


def test_an_entry_with_a_client_list_holds_only_for_those_exact_names():
    desktop = entry({"client": ["claude-desktop", "cursor"], "outcome": "allow"})
    assert desktop.holds({}, facts("claude-desktop")) and desktop.holds({}, facts("cursor"))
    for other in ("Claude-Desktop", "claude-desktop ", "claude\u2010desktop", "", None):
        assert not desktop.holds({}, facts(other)), other


def test_an_entry_holds_only_when_its_conditions_during_and_client_all_hold():
    both = entry({"if": {"/amount": {"max": "50.00"}}, "client": ["cli"],
                  "during": {"days": "mon-fri", "zone": "Europe/Paris"}, "outcome": "allow"})
    small, large = J({"amount": 10}), J({"amount": 60})
    assert both.holds(small, facts("cli"))
    assert not both.holds(large, facts("cli"))
    assert not both.holds(small, facts("ide"))
    assert not both.holds(small, facts("cli", at(1, 6, 10)))


def test_the_first_entry_that_holds_decides_and_else_the_class():
    config = agentgate.Config(J(config_doc({"side_effect": "remote_mutation", "when": [
        {"if": {"/amount": {"max": 10}}, "outcome": "allow", "reason": "small"},
        {"if": {"/amount": {"max": 100}}, "outcome": "deny", "reason": "medium"},
    ]})), "/tmp/x/config.json")
    rule = config.servers[0].rules["pay"]
    tool = types.SimpleNamespace(name="pay", rule=rule, side_effect=rule.side_effect,
                                 schema={"type": "object"})

    def decided(amount):
        decision = agentgate.policy_decision(config, tool, J({"amount": amount}), facts())
        return decision["outcome"], decision["by"]

    assert decided(5) == ("allow", "when[0]")
    assert decided(50) == ("deny", "when[1]")
    assert decided(500) == ("require_approval", "class")
    assert decided("5") == ("require_approval", "class")  # a string is no amount


@pytest.mark.parametrize("raw, fragment", [
    ({"outcome": "deny"}, "always holds"),
    ({"if": {}, "outcome": "deny"}, "always holds"),
    ({"client": [], "outcome": "allow"}, "at least one host name"),
    ({"client": "cli", "outcome": "allow"}, "list of strings"),
    ({"iff": {}, "outcome": "allow"}, 'unknown field "iff"'),
    ({"if": {"/a": {"present": True}}}, "needs outcome"),
    ({"if": [], "outcome": "allow"}, "must be an object of JSON Pointer"),
])
def test_an_entry_that_cannot_be_what_it_says_is_refused(raw, fragment):
    with pytest.raises(ConfigError) as caught:
        entry(raw)
    assert_one_sentence_naming(str(caught.value), "rules.pay.when[0]", fragment)


# ---------------------------------------------------------------- Limit


def limit(raw) -> agentgate.Limit:
    return agentgate.Limit(P(raw) if isinstance(raw, str) else J(raw),
                           "rules.pay.limits[0]", "limits[0]")


class History:
    """A fake `uses`: the executions after `since`, oldest first; it records what it was
    asked."""

    def __init__(self, *rows):
        self.rows, self.asked = list(rows), []

    def __call__(self, since):
        self.asked.append(since)
        return [row for row in self.rows if row[0] > since]


def paid(moment, amount) -> tuple:
    return (moment, {"/amount": Decimal(amount)})


SUM_100 = '{"sum": "/amount", "max": "100.00", "per": "1h"}'


def test_a_calls_limit_counts_the_window_and_frees_when_the_oldest_counted_leaves():
    two = limit({"calls": 2, "per": "1h"})
    now = 10_000
    history = History((now - 4000, {}), (now - 300, {}))
    assert two.frees({}, history, now) is None
    assert history.asked == [now - HOUR]
    history.rows.append((now - 100, {}))
    assert two.frees({}, history, now) == now - 300 + HOUR
    history.rows.append((now - 50, {}))
    assert two.frees({}, history, now) == now - 100 + HOUR


def test_ten_payments_of_ten_fill_a_hundred_and_the_eleventh_waits():
    history = History(*[paid(1000 + i, "10.00") for i in range(9)])
    budget = limit(SUM_100)
    assert budget.frees(J({"amount": 10}), history, 2000) is None          # 100.00 exactly
    history.rows.append(paid(1009, "10.00"))
    assert budget.frees(J({"amount": 0}), history, 2000) is None
    assert budget.frees(J({"amount": 10}), history, 2000) == 1000 + HOUR
    assert budget.frees(P('{"amount": 1e-9999}'), history, 2000) == 1000 + HOUR


def test_sums_are_exact_where_floats_would_round():
    tenths = limit('{"sum": "/amount", "max": "0.3", "per": "1h"}')
    history = History(paid(1, "0.1"), paid(2, "0.2"))
    assert tenths.frees({}, history, 10) is None          # 0.1 + 0.2 is 0.3, not above it
    assert tenths.frees(P('{"amount": 1e-30}'), history, 10) == 1 + HOUR


def test_a_sum_frees_up_when_enough_of_the_oldest_leave_the_window():
    history = History(paid(100, "60"), paid(200, "30"), paid(300, "10"))
    budget = limit(SUM_100)
    assert budget.frees(J({"amount": 20}), history, 400) == 100 + HOUR
    assert budget.frees(J({"amount": 95}), history, 400) == 300 + HOUR


def test_a_call_alone_above_the_max_never_frees_up():
    budget = limit(SUM_100)
    assert budget.frees(J({"amount": 100.01}), History(), 10) is NEVER
    assert budget.frees(J({"amount": -100.01}), History(), 10) is NEVER
    assert budget.frees({"amount": agentgate.Number("1e9999")}, History(), 10) is NEVER


def test_a_call_above_the_max_past_28_digits_is_still_above_it():
    # abs() in the default decimal context rounds to 28 significant digits, which would land
    # this amount exactly on the max: the size must be taken without rounding.
    budget = limit(SUM_100)
    for amount in ("100.00000000000000000000000000001", "-100.00000000000000000000000000001"):
        assert budget.frees(P('{"amount": %s}' % amount), History(), 10) is NEVER, amount


def test_negative_amounts_count_by_their_size():
    budget = limit(SUM_100)
    assert budget.frees(J({"amount": -5}), History(paid(1, "-96")), 10) == 1 + HOUR
    refund = History(paid(1, "60"), paid(2, "-60"))      # a refund is no credit
    assert budget.frees(J({"amount": 50}), refund, 10) == 2 + HOUR


def test_an_amount_that_is_no_number_never_passes_and_an_absent_one_adds_nothing():
    budget = limit(SUM_100)
    for amount in ('"5"', "true", "null", "[5]", '{"n": 5}'):
        assert budget.frees(P('{"amount": %s}' % amount), History(), 10) is NEVER, amount
    assert budget.frees({}, History(paid(1, "100.00")), 10) is None
    assert budget.frees({}, History(paid(1, "100.01")), 10) == 1 + HOUR


def test_huge_exponents_are_summed_exactly_without_a_crash():
    vast = limit('{"sum": "/amount", "max": "1e9999", "per": "1h"}')
    assert vast.frees(P('{"amount": 1e-9999}'), History(paid(1, "1e9999")), 10) == 1 + HOUR
    assert vast.frees(P('{"amount": 1e-9999}'), History(paid(1, "9e9998")), 10) is None
    spread = History(paid(1, "1e10000"), paid(2, "-1e10000"))
    assert vast.frees(P('{"amount": 1e-10000}'), spread, 10) == 2 + HOUR


@pytest.mark.parametrize("raw, fragment", [
    ({"calls": 1, "per": "1h", "then": "allow"}, "never loosens"),
    ({"calls": 1, "per": "1h", "then": "warn"}, "never loosens"),
    ({"calls": 1, "sum": "/amount", "max": 1, "per": "1h"}, "exactly one of calls"),
    ({"per": "1h"}, "exactly one of calls"),
    ({"calls": 0, "per": "1h"}, "at least 1"),
    ({"calls": 1.5, "per": "1h"}, "at least 1"),
    ({"calls": "5", "per": "1h"}, "at least 1"),
    ({"calls": 1, "max": 3, "per": "1h"}, "max goes with sum"),
    ({"sum": "amount", "max": 1, "per": "1h"}, 'write it like "/amount"'),
    ({"sum": "/amount", "per": "1h"}, "needs max"),
    ({"sum": "/amount", "max": -1, "per": "1h"}, "must not be negative"),
    ({"sum": "/amount", "max": "ten", "per": "1h"}, "decimal string"),
    ({"calls": 1}, "needs per"),
    ({"calls": 1, "per": "0s"}, "needs per"),
    ({"calls": 1, "per": "1 hour"}, "is not a duration"),
    ({"calls": 1, "per": "1h", "window": "1h"}, 'unknown field "window"'),
])
def test_a_limit_that_cannot_be_what_it_says_is_refused(raw, fragment):
    with pytest.raises(ConfigError) as caught:
        limit(raw)
    assert_one_sentence_naming(str(caught.value), "rules.pay.limits[0]", fragment)


# ---------------------------------------------------------------- mistakes in a whole config


def config_doc(rule, **extra) -> dict:
    return {"database": "runs.db", "session": "s", **extra,
            "servers": [{"name": "bank", "command": ["x"], "manifest": "m.json",
                         "rules": {"pay": rule}}]}


def config_refusal(rule=None, **extra) -> str:
    rule = rule or {"side_effect": "remote_mutation"}
    with pytest.raises(ConfigError) as caught:
        agentgate.Config(J(config_doc(rule, **extra)), "/tmp/x/config.json")
    return str(caught.value)


def second_entry(condition_raw, outcome="allow"):
    """A rule whose when[1] has the given `if` (when[0] is fine, so the index must be right)."""
    return {"side_effect": "remote_mutation",
            "when": [{"if": {"/to": {"present": True}}, "outcome": "deny"},
                     {"if": condition_raw, "outcome": outcome}]}


@pytest.mark.parametrize("rule, names", [
    (second_entry({"amount": {"max": 1}}), ['"amount" is not a JSON Pointer', 'like "/amount"']),
    (second_entry({"/amount": {"maximum": 1}}), ['unknown field "maximum"', "min, max"]),
    (second_entry({"/amount": {"min": "10", "max": 5}}), ["min 10 is above max 5", "swap them"]),
    (second_entry({"/to": {"pattern": "(a"}}), ["cannot be used",
                                                "write an ECMA-262 pattern"]),
    (second_entry({"/a~2b": {"present": True}}), ["'~' that is not ~0 or ~1", "write ~0"]),
    (second_entry({"/to": {"present": True}}, "alow"), ['outcome is "alow"', "use one of allow"]),
    (second_entry({"/p": {"under": ["sandbox"]}}), ['"sandbox" is relative', "absolute path"]),
    (second_entry({"/u": {"host_in": ["https://x.com/"]}}), ["is not a host name",
                                                            '"example.com"']),
])
def test_a_mistake_in_an_entry_is_one_sentence_naming_the_tool_the_entry_and_the_fix(rule,
                                                                                     names):
    assert_one_sentence_naming(config_refusal(rule), "rules.pay.when[1]", *names)


def test_a_mistake_in_a_limit_names_the_tool_and_the_limit():
    rule = {"side_effect": "remote_mutation",
            "limits": [{"calls": 5, "per": "1h"}, {"calls": 1, "per": "1h", "then": "allow"}]}
    assert_one_sentence_naming(config_refusal(rule), "rules.pay.limits[1]", 'then is "allow"',
                               "require_approval or deny")


def test_an_operator_other_than_none_is_refused():
    assert_one_sentence_naming(config_refusal(operator="nobody"), 'operator is "nobody"',
                               'write "none"')


def write_config(tmp_path, doc) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    path.chmod(0o600)
    return str(path)


def test_load_config_names_the_file_the_tool_and_the_entry(tmp_path):
    path = write_config(tmp_path, config_doc(second_entry({"/amount": {"maximum": 1}})))
    with pytest.raises(ConfigError) as caught:
        agentgate.load_config(path)
    assert_one_sentence_naming(str(caught.value), path, "rules.pay.when[1]",
                               'unknown field "maximum"')


def test_a_pattern_that_is_a_list_is_refused_by_load_config(tmp_path):
    # Not a TypeError escaping load_config: a ConfigError, as for every mistake.
    path = write_config(tmp_path, config_doc(second_entry({"/to": {"pattern": ["a"]}})))
    with pytest.raises(ConfigError) as caught:
        agentgate.load_config(path)
    assert "rules.pay.when[1]" in str(caught.value)


# ---------------------------------------------------------------- pointers against the schema


SCHEMA = {
    "type": "object",
    "properties": {
        "amount": {"type": "number"},
        "account": {"type": "string"},
        "memo": {"type": "string"},
        "payee": {"type": "object", "properties": {"name": {"type": "string"},
                                                    "a/b": {"type": "string"}}},
        "lines": {"type": "array",
                  "items": {"type": "object", "properties": {"sum": {"type": "number"}}}},
        "card": {"$ref": "#/$defs/Card"},
        "broken": {"$ref": "#/$defs/Nothing"},
    },
    "$defs": {"Card": {"type": "object", "properties": {"last4": {"type": "string"}}}},
}
POINTERS = [  # (pointer, what pointer_problem says, '' when nothing), hiding account and memo
    ("/amount", ""), ("/payee/name", ""), ("/payee/a~1b", ""), ("/lines/0/sum", ""),
    ("/lines/12/sum", ""), ("/card/last4", ""),
    ("/amunt", "no such property"), ("/Amount", "no such property"),
    ("/payee/nam", "no such property"), ("/amount/x", "no such property"),
    ("/lines/x/sum", "no such property"), ("/lines/01/sum", "no such property"),
    ("/lines/-/sum", "no such property"), ("/card/number", "no such property"),
    ("/broken/x", "$ref that points at nothing"),
    ("/account", 'the rule hides "account"'), ("/memo", 'the rule hides "memo"'),
]


def test_pointer_problem_follows_properties_items_and_refs():
    schema = J(SCHEMA)

    def problem(pointer):
        return agentgate.pointer_problem(schema, agentgate.parse_pointer(pointer, "w"),
                                         {"account", "memo"})

    assert [(p, said, problem(p)) for p, said in POINTERS
            if (said not in problem(p) if said else problem(p) != "")] == []


def test_a_schema_whose_root_is_a_ref_is_followed():
    schema = J({"$ref": "#/$defs/A", "$defs": {"A": {"type": "object",
                                                     "properties": {"x": {}}}}})
    assert agentgate.pointer_problem(schema, ("x",), set()) == ""
    assert "no such property" in agentgate.pointer_problem(schema, ("y",), set())


def rule_of(raw) -> agentgate.Rule:
    return agentgate.Rule("pay", J({"side_effect": "remote_mutation", **raw}), "rules.pay")


def test_policy_pointer_problem_names_the_entry_and_the_properties():
    rule = rule_of({"when": [{"if": {"/amount": {"max": 5}}, "outcome": "allow"},
                             {"if": {"/amont": {"min": 1}}, "outcome": "deny"}]})
    problem = agentgate.policy_pointer_problem(J(SCHEMA), rule, "bank_pay")
    assert_one_sentence_naming(problem, "when[1] of bank_pay", '"/amont"', "no such property",
                               "point at one of", "/amount")
    assert agentgate.policy_pointer_problem(J(SCHEMA), rule_of({}), "bank_pay") == ""


def test_policy_pointer_problem_checks_sum_limits_and_hidden_parameters():
    limits = rule_of({"limits": [{"calls": 3, "per": "1h"},
                                 {"sum": "/lines/0/total", "max": 5, "per": "1h"}]})
    assert "limits[1] of bank_pay" in agentgate.policy_pointer_problem(J(SCHEMA), limits,
                                                                      "bank_pay")
    fixed = rule_of({"fixed": {"account": "A1"},
                     "when": [{"if": {"/account": {"equals": "A2"}}, "outcome": "deny"}]})
    problem = agentgate.policy_pointer_problem(J(SCHEMA), fixed, "bank_pay")
    assert 'when[0] of bank_pay points at "/account"' in problem
    assert 'hides "account"' in problem


def test_the_fix_offered_for_a_pointer_names_no_hidden_parameter():
    # The properties offered to point at leave out those the rule hides (fixed or denied),
    # whose pointers would be refused in their turn.
    rule = rule_of({"deny": ["memo"], "fixed": {"account": "A1"},
                    "when": [{"if": {"/amont": {"max": 5}}, "outcome": "allow"}]})
    problem = agentgate.policy_pointer_problem(J(SCHEMA), rule, "bank_pay")
    offered = problem.split("point at one of: ", 1)[1]
    assert "/amount" in offered
    assert "/account" not in offered and "/memo" not in offered
