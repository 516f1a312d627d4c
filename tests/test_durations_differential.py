"""Durations and times (agentgate section 16) against independent readers and writers.

Durations. parse_duration reads the whole-number subset of Go's syntax: a fraction (".5s",
"5.s", "1.5h") is refused, and every text it reads Go reads alike. A seeded corpus of texts
in Go's duration syntax (signs, "0", fractions, every unit spelling) and of garbage near it
goes to parse_duration and to the durationpy package, a separate reader of the same syntax:
outside fractions both accept or both refuse, and the values agree. format_duration's output
on generated int64s is read back by durationpy.
durationpy answers in datetime.timedelta, so whole microseconds, and sums its terms in float64:
values are compared where that suffices (see value_comparable). Where durationpy reads more
than Go does, Go is the oracle, written out in go_refuses: durationpy
- also knows the units d, w, mm and y;
- skips whatever lies between two terms ("1h 30m", "1h-5m", "1hX5m"), since it only checks
  that its first term starts the text and its last one ends it;
- reads any Unicode digit (its pattern's \\d), and float() then reads "\u0663" as 3;
- has timedelta's range (about 2.7 million years), not int64 nanoseconds.
What a microsecond cannot show (nanoseconds, the ends of int64) is in GO_READS and GO_WRITES: facts of Go's
time.ParseDuration and Duration.String from its documentation, checked by hand, and by a Go
1.19 toolchain when the table was written.

Times. format_time on generated floats (years 1000 to 9999, before and after 1970, exact ties
at half a microsecond, fractions that carry into the next second) against
datetime.fromtimestamp(t, timezone.utc), which rounds the same way; parse_time against the
double nearest the instant; later against datetime's own arithmetic; and that the written
times, which the store compares as strings, sort as the instants do.
"""

from __future__ import annotations

import datetime
import random
import re
import sys
from fractions import Fraction
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402

durationpy = pytest.importorskip("durationpy")

UTC = datetime.timezone.utc
EPOCH = datetime.datetime(1970, 1, 1, tzinfo=UTC)
MICRO = datetime.timedelta(microseconds=1)
INT64 = 2**63
GO_UNITS = ["ns", "us", "\u00b5s", "\u03bcs", "ms", "s", "m", "h"]
# Each unit with the most integer digits a generated term has, so that four terms stay under
# 10^15 ns (see value_comparable; a term in ns gets three more zeros), and the most fraction
# digits that keep a term a whole number of microseconds (an hour is 3.6e12 ns: nine digits
# leave 3600 ns steps).
TERM_SHAPE = {"ns": (11, 0), "us": (11, 0), "\u00b5s": (11, 0), "\u03bcs": (11, 0),
              "ms": (8, 3), "s": (5, 6), "m": (3, 7), "h": (1, 9)}
# Nothing but these can sit between a durationpy term and the next.
DURATIONPY_TERMS = re.compile(r"(?:[\d.]+[a-z\u00b5\u03bc]+)+")


def go_parse(text):
    """agentgate's answer as nanoseconds, or None where it refuses."""
    try:
        return agentgate.parse_duration(text)
    except ValueError:
        return None


def durationpy_parse(text):
    """durationpy's answer as whole microseconds, or None where it refuses."""
    try:
        return durationpy.from_str(text) // MICRO
    except ValueError:  # its DurationError is a ValueError
        return None


def go_refuses(text):
    """Where durationpy is looser than Go: Go refuses each of these, durationpy need not."""
    body = text[1:] if text[:1] in "+-" else text
    if body == "0":
        return False
    if "." in body:
        return True  # a fraction: refused by the whole-number subset
    if not DURATIONPY_TERMS.fullmatch(body):
        return True  # something between terms
    if any(c.isdigit() and not "0" <= c <= "9" for c in body):
        return True
    units = re.findall(r"[a-z\u00b5\u03bc]+", body)
    return any(unit not in GO_UNITS for unit in units)


def value_comparable(ns):
    # durationpy sums float(number) * unit in float64 and rounds the sum to a microsecond.
    # Under 10^15 ns a double's step is at most 1/8 ns, so its sum is within a few ns of the
    # exact one; on a whole number of microseconds that cannot round to the wrong microsecond.
    # Off whole microseconds the two differ by design (truncated ns here, rounded us there).
    return ns % 1000 == 0 and abs(ns) < 10**15


def go_text(chance):
    terms = []
    for _ in range(chance.randint(1, 4)):
        unit = chance.choice(GO_UNITS)
        most_whole, most_fraction = TERM_SHAPE[unit]
        whole = "".join(chance.choice("0123456789")
                        for _ in range(chance.randint(0, most_whole)))
        if unit == "ns" and whole:
            whole += "000"  # whole microseconds
        fraction = "".join(chance.choice("0123456789")
                           for _ in range(chance.randint(0, most_fraction)))
        # mostly whole numbers, the subset read; sometimes a fraction, refused
        number = chance.choice([whole or "0"] * 6 + [f"{whole}.{fraction}", f"{whole}.",
                                                     f".{fraction}"])
        terms.append(number + unit)
    return chance.choice(["", "", "-", "+"]) + "".join(terms)


def garbage(chance):
    alphabet = "0123456789..+-hmsnuµμdwyS \u0663x"
    return "".join(chance.choice(alphabet) for _ in range(chance.randint(0, 7)))


def mutated(chance):
    text = list(go_text(chance))
    at = chance.randrange(len(text) + 1)
    move = chance.choice(["insert", "delete", "swap"])
    if move == "insert" or not text:
        text.insert(at, chance.choice(".+- 0hmsu\u00b5dw\u0663"))
    elif move == "delete":
        del text[min(at, len(text) - 1)]
    else:
        at = min(at, len(text) - 2)
        text[at:at + 2] = text[at:at + 2][::-1]
    return "".join(text)


def corpus():
    chance = random.Random(1616)
    texts = ["0", "+0", "-0", "00", "", "+", "-", "--0", ".s", "s", "5", ".", "..5s", "5..s"]
    texts += [go_text(chance) for _ in range(1500)]
    texts += [garbage(chance) for _ in range(800)]
    texts += [mutated(chance) for _ in range(800)]
    return texts


def test_durations_are_read_as_durationpy_reads_them_where_it_reads_go_syntax():
    refused = valued = 0
    for text in corpus():
        ours, theirs = go_parse(text), durationpy_parse(text)
        shown = f"{text!r}: agentgate {ours}, durationpy {theirs} us"
        refused += ours is None
        if go_refuses(text):
            assert ours is None, shown
            continue
        assert (ours is None) == (theirs is None), shown
        if ours is not None and value_comparable(ours):
            valued += 1
            assert ours == theirs * 1000, shown
    # The corpus must reach both answers, or the comparison proves nothing.
    assert refused > 500 and valued > 600, (refused, valued)


def test_durationpy_is_looser_than_go_only_where_go_refuses_says():
    # The mapping above is itself checked: each class it names is one durationpy accepts.
    for text in ["1h 30m", "1h-5m", "1hX5m", "1d", "2w", "1y", "\u0663s", "1h+5m", "1.5h"]:
        assert go_refuses(text) and durationpy_parse(text) is not None, text
        assert go_parse(text) is None, text


def test_written_durations_are_read_back_by_durationpy():
    chance = random.Random(4716)
    values = [0, 1000, -1000, 999_000, 10**6, 10**9, 60 * 10**9, 3600 * 10**9, 86400 * 10**9]
    for _ in range(1500):
        size = chance.choice([10**3, 10**6, 10**9, 60 * 10**9, 3600 * 10**9])
        value = chance.randint(0, 10**15 // size) * size // 1000 * 1000
        value += chance.choice([0, chance.randrange(0, 10**15, 1000)]) if value < 10**14 else 0
        values.append(value if chance.random() < 0.7 else -value)
    for ns in values:
        if not value_comparable(ns):
            continue
        text = agentgate.format_duration(ns)
        assert durationpy_parse(text) == ns // 1000, f"{ns}: agentgate wrote {text!r}"
        if "." not in text:
            assert agentgate.parse_duration(text) == ns, f"{ns}: {text!r}"


def test_what_durationpy_writes_is_read_as_durationpy_reads_it():
    # durationpy writes its own forms ("1ms500us", "2h30.5s", "1e+06h" for a million hours);
    # a Go-syntax text among them must read alike, and its exponent form is refused by both.
    chance = random.Random(2716)
    for _ in range(800):
        delta = datetime.timedelta(microseconds=chance.choice(
            [chance.randrange(10**6), chance.randrange(10**12), chance.randrange(10**16)]))
        text = durationpy.to_str(delta * chance.choice([1, -1]))
        ours, theirs = go_parse(text), durationpy_parse(text)
        shown = f"{text!r}: agentgate {ours}, durationpy {theirs} us"
        if text == "0" or go_refuses(text):  # durationpy writes zero as "0", which Go reads
            assert ours == (0 if text == "0" else None), shown
            continue
        assert (ours is None) == (theirs is None), shown
        if ours is not None and value_comparable(ours):
            assert ours == theirs * 1000, shown


# Go's time.ParseDuration: a text and the nanoseconds it reads, or None where it errs.
GO_READS = [
    ("300ms", 300 * 10**6), ("2h45m", 9900 * 10**9), ("1h15m30s", 4530 * 10**9),
    ("1\u00b5s", 1000), ("1\u03bcs", 1000), ("1us", 1000), ("0", 0), ("+0", 0), ("-0", 0),
    ("+5s", 5 * 10**9), ("-90m", -5400 * 10**9), ("0s", 0), ("00s", 0), ("1h0m0s", 3600 * 10**9),
    ("1m30s1m", 150 * 10**9), ("9223372036854775807ns", INT64 - 1),
    ("2562047h47m16s854775807ns", INT64 - 1),
    # int64's least value is a duration; its negation is not.
    ("-9223372036854775808ns", -INT64), ("-2562047h47m16s854775808ns", -INT64),
    ("9223372036854775808ns", None), ("2562047h47m16s854775808ns", None),
    ("-9223372036854775809ns", None), ("2562048h", None), ("99999999999999999999999s", None),
    ("1h-5m", None), ("1h 30m", None), ("+-5s", None), ("--5s", None), ("5", None),
    ("00", None), ("", None), ("+", None), ("-", None), (".s", None), ("s", None),
    ("1.2.3s", None), ("1d", None), ("1S", None), ("1H", None), ("1e3s", None),
    ("\u0663s", None), (" 1s", None), ("1s ", None), ("1sec", None), ("1ns1", None),
]

# Go reads these; the whole-number subset refuses them, with a sentence saying to write whole
# numbers ("1h30m" for "1.5h").
FRACTIONS = ["-1.5h", "1h15m30.918273645s", ".5s", "5.s", "0.0s", "0.5ns0.5ns",
             ".73811063747583332810h", "2562047h47m16.854775807s"]

# Go's Duration.String: nanoseconds and the text written for them.
GO_WRITES = [
    (4530918273645, "1h15m30.918273645s"), (300 * 10**6, "300ms"), (0, "0s"),
    (1000, "1\u00b5s"), (60 * 10**9, "1m0s"), (86400 * 10**9, "24h0m0s"),
    (9900 * 10**9, "2h45m0s"), (-5400 * 10**9, "-1h30m0s"), (1, "1ns"), (-1, "-1ns"),
    (999, "999ns"), (1500, "1.5\u00b5s"), (999_999_999, "999.999999ms"), (10**9, "1s"),
    (3600 * 10**9 + 1, "1h0m0.000000001s"), (3723 * 10**9 + 5 * 10**8, "1h2m3.5s"),
    (INT64 - 1, "2562047h47m16.854775807s"), (-INT64, "-2562047h47m16.854775808s"),
]


@pytest.mark.parametrize("text, ns", GO_READS)
def test_durations_read_as_go_reads_them(text, ns):
    assert go_parse(text) == ns, f"{text!r}: agentgate {go_parse(text)}, Go {ns}"


@pytest.mark.parametrize("text", FRACTIONS)
def test_a_fraction_is_refused(text):
    assert go_parse(text) is None


@pytest.mark.parametrize("ns, text", GO_WRITES)
def test_durations_are_written_as_go_writes_them(ns, text):
    assert agentgate.format_duration(ns) == text
    if "." not in text:
        assert agentgate.parse_duration(text) == ns


def test_the_least_int64_duration_is_read_as_go_reads_it():
    # Regression: -2^63 ns was refused as too long; Go reads it (and only it at that size).
    assert agentgate.parse_duration("-9223372036854775808ns") == -INT64
    with pytest.raises(ValueError):
        agentgate.parse_duration("9223372036854775808ns")


def test_every_whole_duration_written_reads_back_to_itself():
    chance = random.Random(1661)
    values = [0, 60 * 10**9, -3600 * 10**9, 10**9, 2 * 10**6]
    values += [chance.randrange(-(10**7), 10**7) * chance.choice([10**6, 10**9, 60 * 10**9])
               for _ in range(1500)]
    for ns in values:
        text = agentgate.format_duration(ns)
        if "." not in text:
            assert agentgate.parse_duration(text) == ns, f"{ns}: {text!r}"


# ---------------------------------------------------------------- times

FIRST = datetime.datetime(1000, 1, 1, tzinfo=UTC).timestamp()
PAST_LAST = datetime.datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC).timestamp()


def datetime_writes(seconds):
    moment = datetime.datetime.fromtimestamp(seconds, UTC)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def moments():
    chance = random.Random(1970)
    found = [0.0, -0.0, 1.0, -1.0, 0.5e-6, -0.5e-6, 1.5e-6, -1.5e-6, 0.9999995, -0.9999995,
             1.7e9 + 0.9999995, 1.7e9 + 0.9999996, -1e9 - 0.9999996, FIRST, FIRST + 0.4e-6,
             2**31, 2**32, 2**33, -(2**33)]
    found += [chance.uniform(FIRST, PAST_LAST - 1) for _ in range(1500)]
    found += [chance.uniform(-2e9, 4e9) for _ in range(1500)]
    found += [chance.randint(-(10**9), 4 * 10**9) + chance.randint(0, 10**6) / 1e6
              for _ in range(1000)]
    # j/128 of a second is j * 7812.5 us, an exact tie in binary: half to even decides it.
    found += [chance.randint(-(10**10), 10**10) + chance.randrange(1, 128, 2) / 128
              for _ in range(800)]
    # Decimal halves are not ties in binary: the double decides which way they round.
    found += [base + k * 0.5e-6 for base in (0.0, 1.7e9, -86400.0, 12345.0)
              for k in range(-9, 10)]
    return found


def test_times_are_written_as_datetime_writes_them():
    for seconds in moments():
        ours, theirs = agentgate.format_time(seconds), datetime_writes(seconds)
        assert ours == theirs, f"{seconds!r}: agentgate {ours}, datetime {theirs}"
        assert len(ours) == 27, ours


def test_written_times_sort_as_the_instants_do():
    instants = sorted(moments())
    written = [agentgate.format_time(t) for t in instants]
    for (a, a_text), (b, b_text) in zip(zip(instants, written), zip(instants[1:], written[1:])):
        assert a_text <= b_text, f"{a!r} < {b!r} but {a_text} > {b_text}"
        same = datetime.datetime.fromtimestamp(a, UTC) == datetime.datetime.fromtimestamp(b, UTC)
        assert (a_text == b_text) == same, (a, b, a_text, b_text)


def micros_of(text):
    return (datetime.datetime.fromisoformat(text.replace("Z", "+00:00")) - EPOCH) // MICRO


def test_a_written_time_is_read_as_the_double_nearest_its_instant():
    for seconds in moments():
        text = agentgate.format_time(seconds)
        nearest = float(Fraction(micros_of(text), 10**6))
        assert agentgate.parse_time(text) == nearest, f"{text}: {agentgate.parse_time(text)!r}"


def test_a_time_read_and_written_again_is_unchanged_within_2_to_the_33_seconds():
    # A double holds a microsecond's place up to 2^33 s from 1970 (1697 to 2242); further
    # out its step passes a microsecond and a time read as float seconds loses digits.
    chance = random.Random(2242)
    for _ in range(2000):
        micros = chance.randrange(-(2**33) * 10**6, 2**33 * 10**6)
        text = (EPOCH + micros * MICRO).isoformat(timespec="microseconds")
        text = text.replace("+00:00", "Z")
        assert agentgate.format_time(agentgate.parse_time(text)) == text, text


def datetime_adds(text, ns):
    moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    # Whole seconds as an integer, the rest as a float of microseconds under a million: such a
    # float holds each thousandth near enough to meet the true ties, and timedelta rounds what
    # is left of a microsecond half to even (on the microseconds within the second, whose
    # parity is the parity of the whole count, a second being an even number of them).
    step = datetime.timedelta(seconds=ns // 10**9, microseconds=ns % 10**9 / 1000)
    return (moment + step).isoformat(timespec="microseconds").replace("+00:00", "Z")


def test_later_adds_as_datetime_adds_rounding_half_to_even():
    chance = random.Random(2106)
    cases = [("2026-01-01T00:00:00.000000Z", 1500), ("2026-01-01T00:00:00.000000Z", 2500),
             ("2026-01-01T00:00:00.000000Z", -1500), ("1969-12-31T23:59:59.999999Z", 1000),
             ("2026-12-01T06:50:00.123456Z", INT64 - 1), ("2026-12-01T06:50:00.123456Z", 0)]
    for _ in range(2000):
        text = agentgate.format_time(chance.uniform(FIRST + 4e9, PAST_LAST - 1e10))
        ns = chance.choice([chance.randrange(10**13), chance.randrange(10**7) * 10**9,
                            chance.randrange(10**6) * 1000 + 500, chance.randrange(INT64 // 4)])
        cases.append((text, ns if chance.random() < 0.8 else -ns))
    for text, ns in cases:
        ours, theirs = agentgate.later(text, ns), datetime_adds(text, ns)
        assert ours == theirs, f"{text} + {ns} ns: agentgate {ours}, datetime {theirs}"


def test_later_rounds_a_sub_microsecond_part_half_to_even():
    # Regression: later added float seconds, and 1500 ns after a whole second came out as
    # 1.4999... us, so one microsecond.
    assert agentgate.later("2026-01-01T00:00:00.000000Z", 1500) == "2026-01-01T00:00:00.000002Z"
    assert agentgate.later("2026-01-01T00:00:00.000000Z", 2500) == "2026-01-01T00:00:00.000002Z"


def test_later_keeps_whole_microseconds_past_2106():
    # Regression: past 2^32 s a double's step is nearly a microsecond, and a float sum lost one.
    text = "2150-06-01T12:00:00.000005Z"
    assert agentgate.later(text, 7000) == "2150-06-01T12:00:00.000012Z"


def test_prose_shows_a_time_to_the_second_truncated():
    for seconds in moments():
        text = agentgate.format_time(seconds)
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
        assert agentgate.prose_time(text) == \
            moment.replace(microsecond=0).isoformat().replace("+00:00", "Z"), text


def test_now_is_a_written_time():
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", agentgate.now())
