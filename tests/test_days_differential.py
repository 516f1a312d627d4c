"""Days and hours in a time zone (agentgate's library During) against node's Intl.

The wall clock an instant shows in a zone is read independently, by node's ICU and its own
copy of the time zone database, not by Python's zoneinfo: Intl.DateTimeFormat gives the
weekday, hour and minute (hourCycle h23). From those three, each window's answer follows:

- days: the weekday the wall clock shows at the instant is one of the days ("fri-mon" runs
  past Sunday; "tue-mon" is every day); a window without days is every day;
- hours "HH:MM-HH:MM": the wall-clock minute is in [start, end); when end comes before start
  the range runs past midnight; "24:00" is the end of the day and may only end a range;
  a window without hours is the whole day; seconds do not matter;
- an overnight range and a day list: the day is the instant's own, never the day its range
  began on ("fri" with "22:00-06:00" holds Friday 02:00 and Friday 23:00, not Saturday 02:00).

Compared: a few thousand instants, to the millisecond, at and around each change of offset
from 1970 to 2025 in Europe/Paris, America/New_York, Australia/Lord_Howe (a half-hour shift),
Asia/Kathmandu (+05:45), UTC, Pacific/Apia (it skipped Friday 30 December 2011) and
America/Sao_Paulo, plus instants anywhere in those years (4,202 in all); each against three
windows, each of them random, or with an edge at the instant's own wall minute or the minute
after, or overnight on the instant's day or the day before. Then every zone both databases
name, at three instants each and two windows.

Left out, and why: years before 1970, where many zones' histories differ between copies of
the database on purpose (tz keeps the pre-1970 history of zones it merged in a "backzone" file
that some builds use and others do not), and years after 2025, which the databases forecast
and a new tz release may change on one side only (as when a country stops changing its
clocks). In the comparison of every zone, an instant whose wall clock the machine's zoneinfo
and node already read apart is a difference of data, not of During, and is left out; with
the machine's tzdata 2025b and node's 2025c that was America/Tijuana and its links in
1970-1975, WET in 1970-1996 and EET in 1975-1980 (ICU reads them as Europe/Lisbon and
Europe/Athens). The seven zones above agreed hourly from 1890 to 2039 and are compared
without that allowance. Names only one side knows (ICU reads names without regard to case and
keeps links tz has dropped; tz has Factory) are left out of the comparison of wall clocks; the
refusals below pin what During accepts.

Found by this test, and fixed: the machine's database also holds files that are no zone
(localtime, the machine's own zone; posixrules; and the posix/ and right/ copies, right/
counting leap seconds), which ICU refuses and During took as zones; and a name nested a few
hundred levels deep made zoneinfo fail with RecursionError instead of a refusal.
"""

from __future__ import annotations

import datetime
import json
import random
import shutil
import subprocess
import sys
import zoneinfo
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402

ConfigError = agentgate.ConfigError
During = agentgate.During
UTC = datetime.timezone.utc
WHERE = "rules.pay.when[0].during"
NAMES = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")  # Monday is 0, as in datetime
DAY_MINUTES = 24 * 60

# Each case is [zone, milliseconds since the epoch]; the answer is [weekday, hour, minute] as
# the zone's wall clock shows it, or null when ICU knows no such zone.
NODE_WALL_CLOCK = r"""
const cases = JSON.parse(require("fs").readFileSync(0, "utf8"));
const formats = new Map();
function format(zone) {
  if (!formats.has(zone)) {
    let f = null;
    try {
      f = new Intl.DateTimeFormat("en-US", {timeZone: zone, weekday: "short", hour: "2-digit",
                                            minute: "2-digit", hourCycle: "h23"});
    } catch (e) {
      if (!(e instanceof RangeError)) throw e;
    }
    formats.set(zone, f);
  }
  return formats.get(zone);
}
const answers = cases.map(([zone, ms]) => {
  const f = format(zone);
  if (f === null) return null;
  const p = {};
  for (const {type, value} of f.formatToParts(new Date(ms))) p[type] = value;
  return [p.weekday, Number(p.hour), Number(p.minute)];
});
process.stdout.write(JSON.stringify({tz: process.versions.tz, answers}));
"""

ZONES = ["Europe/Paris", "America/New_York", "Australia/Lord_Howe", "Asia/Kathmandu", "UTC",
         "Pacific/Apia", "America/Sao_Paulo"]
FIRST = int(datetime.datetime(1970, 1, 1, tzinfo=UTC).timestamp())
AFTER = int(datetime.datetime(2026, 1, 1, tzinfo=UTC).timestamp())
WEEK = 7 * 86400
# Around a change: the change itself, a second, a minute, half an hour and an hour either side
EDGES = (0, -1, 1, -60, 59, 60, -1800, 1799, 1800, -3600, 3599, 3600, -3601)


def offset(zone, t):
    return datetime.datetime.fromtimestamp(t, zone).utcoffset()


def changes(name):
    """The seconds at which the zone's offset changes, as zoneinfo places them (the instants
    are only chosen this way; the answers for them come from node). No zone here changes
    twice within a week."""
    zone = zoneinfo.ZoneInfo(name)
    found = []
    for t in range(FIRST, AFTER - WEEK, WEEK):
        if offset(zone, t) != offset(zone, t + WEEK):
            low, high = t, t + WEEK  # offset(low) is the old one, offset(high) the new one
            while high - low > 1:
                middle = (low + high) // 2
                low, high = (middle, high) if offset(zone, middle) == offset(zone, t) \
                    else (low, middle)
            found.append(high)
    return found


def instants(rng):
    """[zone, milliseconds] for the seven zones, near their changes and anywhere."""
    cases = []
    for name in ZONES:
        for change in changes(name):
            for edge in rng.sample(EDGES, 6):
                cases.append([name, (change + edge) * 1000 + rng.choice((0, 0, 999, 500))])
            for _ in range(2):
                cases.append([name, change * 1000 + rng.randrange(-2 * 86400000, 2 * 86400000)])
        cases += [[name, rng.randrange(FIRST * 1000, AFTER * 1000)] for _ in range(150)]
    return cases


def every_zone(rng):
    """A few instants in each zone the machine's database names (ICU's refusals drop out)."""
    names = sorted(zoneinfo.available_timezones() - {"localtime"})
    return [[name, rng.randrange(FIRST * 1000, AFTER * 1000)] for name in names
            for _ in range(3)]


RNG = random.Random(20261201)
CASES = instants(RNG)
ZONE_CASES = every_zone(RNG)


@pytest.fixture(scope="module")
def node():
    """node's wall clock for every case above, from one node process."""
    if not shutil.which("node"):
        pytest.skip("node is not installed")
    said = json.loads(subprocess.run(
        ["node", "-e", NODE_WALL_CLOCK], input=json.dumps(CASES + ZONE_CASES).encode(),
        capture_output=True, check=True, timeout=120).stdout)
    answers = said["answers"]
    tz = f"node's tz {said['tz']}, the machine's {machine_tz_version()}"
    return answers[:len(CASES)], answers[len(CASES):], tz


def machine_tz_version():
    for root in zoneinfo.TZPATH:
        try:
            with open(Path(root) / "tzdata.zi", encoding="ascii") as f:
                return f.readline().strip("# \n")
        except OSError:
            pass
    return "version unknown"


# ---------------------------------------------------------------- windows


def day_set(first, last):
    """The days from first to last, running past Sunday when last comes before first."""
    return {(first + k) % 7 for k in range((last - first) % 7 + 1)}


def window_minutes(start, end):
    """The minutes of the day a range from start up to (not including) end covers."""
    return {(start + k) % DAY_MINUTES for k in range((end - start) % DAY_MINUTES or DAY_MINUTES)}


def clock(minute):
    return f"{minute // 60:02d}:{minute % 60:02d}"


def any_case(rng, text):
    return "".join(c.upper() if rng.random() < 0.3 else c for c in text)


def days_text(rng, parts):
    """Parts (first, last) written as days are: case and spaces around each part vary."""
    written = []
    for first, last in parts:
        part = NAMES[first] if first == last and rng.random() < 0.7 else \
            f"{NAMES[first]}-{NAMES[last]}"
        written.append(rng.choice(("", " ", "  ")) + any_case(rng, part) + rng.choice(("", " ")))
    return ",".join(written)


def random_days(rng, around=None):
    """(text, set of days), a part of it near the day `around` when given."""
    parts = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        first = rng.randrange(7) if around is None else (around + rng.choice((-1, 0, 1))) % 7
        last = first if rng.random() < 0.4 else rng.randrange(7)
        parts.append((first, last))
    days = set().union(*(day_set(first, last) for first, last in parts))
    return days_text(rng, parts), days


def hours_text(rng, start, end):
    space = rng.choice(("", "", " "))
    return f"{clock(start)}{space}-{space}{clock(end)}"


def window(rng, wall):
    """(raw during without its zone, expected days or None, expected minutes or None)."""
    weekday, minute = wall
    kind = rng.randrange(3)
    if kind == 0:  # anything
        start = rng.choice((rng.randrange(DAY_MINUTES), rng.randrange(96) * 15))
        end = rng.choice((rng.randrange(DAY_MINUTES + 1), rng.randrange(97) * 15))
    elif kind == 1:  # an edge at the instant's own minute or the next one
        edge = (minute + rng.choice((0, 1))) % DAY_MINUTES
        if rng.random() < 0.5:
            start, end = edge, rng.randrange(DAY_MINUTES + 1)
        else:
            start, end = rng.randrange(DAY_MINUTES), edge or DAY_MINUTES
    else:  # overnight, so the day of the range's start and of the instant differ
        start, end = rng.randrange(12 * 60, DAY_MINUTES), rng.randrange(1, 12 * 60)
    if start == end:
        end = (end + 1) % DAY_MINUTES or DAY_MINUTES
    raw = {}
    days = minutes = None
    if kind == 2 and rng.random() < 0.7:  # the instant's day, or the day before it, alone
        day = (weekday - rng.choice((0, 1))) % 7
        raw["days"], days = any_case(rng, NAMES[day]), {day}
    elif rng.random() < 0.8:
        raw["days"], days = random_days(rng, weekday if rng.random() < 0.5 else None)
    if rng.random() < 0.85 or "days" not in raw:
        raw["hours"], minutes = hours_text(rng, start, end), window_minutes(start, end)
    return raw, days, minutes


def expected(days, minutes, wall):
    weekday, minute = wall
    return (days is None or weekday in days) and (minutes is None or minute in minutes)


def wall_of(answer):
    weekday, hour, minute = answer
    return [name.title() for name in NAMES].index(weekday), hour * 60 + minute


def compare(cases, answers, rng, per_case):
    wrong = []
    for (zone, ms), answer in zip(cases, answers):
        wall = wall_of(answer)
        for _ in range(per_case):
            raw, days, minutes = window(rng, wall)
            want = expected(days, minutes, wall)
            got = During({**raw, "zone": zone}, WHERE).holds(ms / 1000)
            if got is not want:
                wrong.append(f"{zone} at {ms} ms ({answer[0]} {clock(wall[1])} by node), "
                             f"{raw}: During says {got}, node's wall clock says {want}")
    return wrong


def test_each_window_holds_as_node_reads_the_wall_clock(node):
    answers, _, tz = node
    assert len(CASES) > 2500 and None not in answers
    wrong = compare(CASES, answers, random.Random(1), 3)
    assert wrong == [], f"{len(wrong)} of {3 * len(CASES)} differ ({tz}):\n" + \
        "\n".join(wrong[:20])


def test_each_zone_both_databases_name_holds_as_node_reads_it(node):
    _, answers, tz = node
    known, data_differ = [], set()
    for (zone, ms), answer in zip(ZONE_CASES, answers):
        if answer is None:
            continue  # a name ICU does not know
        local = datetime.datetime.fromtimestamp(ms / 1000, zoneinfo.ZoneInfo(zone))
        if (local.weekday(), local.hour * 60 + local.minute) != wall_of(answer):
            data_differ.add(zone)  # the two copies of the database, not During, differ
            continue
        known.append(([zone, ms], answer))
    assert len(data_differ) <= 12, f"the two copies differ on many zones ({tz}): {data_differ}"
    assert len(known) > 3 * 400  # ICU knows nearly every name tz does
    wrong = compare(*zip(*known), random.Random(2), 2)
    assert wrong == [], f"{len(wrong)} differ ({tz}):\n" + "\n".join(wrong[:20])


def test_the_instants_reach_each_kind_of_change():
    """The generator reaches what the comparison is for, so it cannot pass by missing it."""
    def steps(name):
        zone = zoneinfo.ZoneInfo(name)
        return {offset(zone, t) - offset(zone, t - 1) for t in changes(name)}

    hour, half = datetime.timedelta(hours=1), datetime.timedelta(minutes=30)
    assert {half, -half} <= steps("Australia/Lord_Howe")  # (a whole hour until 1985)
    assert steps("Europe/Paris") == steps("America/New_York") == {hour, -hour}
    assert datetime.timedelta(hours=24) in steps("Pacific/Apia")  # the skipped Friday
    assert len(changes("Europe/Paris")) > 90 and changes("UTC") == []
    zones = [zone for zone, _ in CASES]
    assert all(zones.count(zone) >= 150 for zone in ZONES)


# ---------------------------------------------------------------- the edges, as specifications


def during(raw):
    return During(raw, WHERE)


def minutes_holding(window, zone, first, last):
    """How many whole minutes from first to last (UTC datetimes) the window holds at."""
    during_ = during({**window, "zone": zone})
    start, end = int(first.timestamp()), int(last.timestamp())
    return sum(during_.holds(t) for t in range(start, end, 60))


def test_an_hour_the_clock_skips_never_holds_and_one_it_repeats_holds_twice():
    sunday = {"days": "sun", "hours": "02:00-03:00"}
    day = datetime.timedelta(days=1)
    spring = datetime.datetime(2024, 3, 31, tzinfo=UTC)   # Paris: 02:00 became 03:00
    autumn = datetime.datetime(2024, 10, 27, tzinfo=UTC)  # Paris: 03:00 became 02:00 again
    assert minutes_holding(sunday, "Europe/Paris", spring - day, spring + day) == 0
    assert minutes_holding(sunday, "Europe/Paris", autumn - day, autumn + day) == 120
    # Lord Howe moves half an hour: 02:00 became 02:30 on 6 October 2024, and 02:00 became
    # 01:30 on 7 April 2024
    october = datetime.datetime(2024, 10, 6, tzinfo=UTC)
    april = datetime.datetime(2024, 4, 7, tzinfo=UTC)
    lord_howe = "Australia/Lord_Howe"
    assert minutes_holding({"hours": "02:00-02:30"}, lord_howe, october - day, october) == 0
    assert minutes_holding({"hours": "02:00-02:31"}, lord_howe, october - day, october) == 1
    assert minutes_holding({"hours": "01:30-02:00"}, lord_howe, april - day, april) == 60


def test_the_friday_samoa_skipped_never_holds():
    friday = {"days": "fri", "zone": "Pacific/Apia"}
    # UTC weeks: Apia was 10 hours behind UTC until the jump, 14 hours ahead after it
    week = [datetime.datetime(2011, 12, 25, tzinfo=UTC), datetime.datetime(2012, 1, 1, tzinfo=UTC)]
    assert minutes_holding(friday, "Pacific/Apia", *week) == 0
    before = [datetime.datetime(2011, 12, day, tzinfo=UTC) for day in (18, 25)]
    assert minutes_holding(friday, "Pacific/Apia", *before) == 24 * 60


def test_an_overnight_range_is_read_on_the_instants_own_day():
    friday_nights = during({"days": "fri", "hours": "22:00-06:00", "zone": "UTC"})

    def at(day, hour):  # 1 March 2024 was a Friday
        return datetime.datetime(2024, 3, day, hour, tzinfo=UTC).timestamp()

    assert friday_nights.holds(at(1, 23))
    assert friday_nights.holds(at(1, 2))      # Friday's early hours
    assert not friday_nights.holds(at(2, 2))  # the night that began on Friday, now Saturday
    assert not friday_nights.holds(at(1, 12))


def test_the_end_minute_is_excluded_and_24_00_ends_the_day():
    def at(hour, minute, second=0.0):  # Monday 4 March 2024
        return datetime.datetime(2024, 3, 4, hour, minute, tzinfo=UTC).timestamp() + second

    office = during({"hours": "09:00-18:00", "zone": "UTC"})
    assert [office.holds(at(8, 59, 59.999)), office.holds(at(9, 0)),
            office.holds(at(17, 59, 59.999)), office.holds(at(18, 0))] == \
        [False, True, True, False]
    late = during({"hours": "22:00-24:00", "zone": "UTC"})
    assert [late.holds(at(21, 59, 59.5)), late.holds(at(23, 59, 59.999)), late.holds(at(0, 0))] \
        == [False, True, False]
    whole = during({"hours": "00:00-24:00", "zone": "UTC"})
    assert all(whole.holds(at(0, 0) + 60 * k) for k in range(DAY_MINUTES))


def test_an_instant_is_read_to_the_microsecond():
    """As datetime rounds it, half to even: the gate's instants are whole microseconds."""
    end = datetime.datetime(2024, 3, 4, 18, tzinfo=UTC).timestamp()
    office = during({"hours": "09:00-18:00", "zone": "UTC"})
    assert office.holds(end - 0.000001)
    assert not office.holds(end - 0.0000004)


def test_days_read_without_regard_to_case_or_spaces_around_a_part():
    sets = {text: during({"days": text, "zone": "UTC"}).days
            for text in ("MON-Fri", "mon-fri", " Mon-FRI ", "sat,SUN", " sat , sun\t",
                         "Fri-Mon", "tue-MON", "wed-wed")}
    assert sets == {"MON-Fri": {0, 1, 2, 3, 4}, "mon-fri": {0, 1, 2, 3, 4},
                    " Mon-FRI ": {0, 1, 2, 3, 4}, "sat,SUN": {5, 6}, " sat , sun\t": {5, 6},
                    "Fri-Mon": {4, 5, 6, 0}, "tue-MON": set(range(7)), "wed-wed": {2}}


def test_a_window_with_days_only_or_hours_only_leaves_the_other_open():
    def at(day, hour):  # 4 March 2024 was a Monday
        return datetime.datetime(2024, 3, day, hour, tzinfo=UTC).timestamp()

    weekend = during({"days": "sat-sun", "zone": "UTC"})
    assert [weekend.holds(at(d, h)) for d in (8, 9, 10, 11) for h in (0, 23)] == \
        [False, False, True, True, True, True, False, False]
    mornings = during({"hours": "06:00-09:00", "zone": "UTC"})
    assert all(mornings.holds(at(d, 7)) for d in range(4, 11))


# ---------------------------------------------------------------- refusals

REFUSED = {
    "days": ["", " ", "monday", "mo", "mon-", "-fri", "mon-fri-sat", "mon,,fri", "mon,", ",mon",
             "mon - fri", "mon\u2013fri", "lun", "1-5", "m\u043en", "MON FRI", "mon;fri",
             "mon-*", "*", 1, None, True, ["mon"], {"mon": True}],
    "hours": ["", "9:00-18:00", "09:00-18:00-20:00", "09-18", "09:00", "09:00-", "-18:00",
              "24:00-06:00", "09:00-24:01", "25:00-26:00", "09:60-10:00", "09:00-09:00",
              "00:00-00:00", "24:00-24:00", "09.00-18.00", "09:00:00-18:00:00",
              "\uff10\uff19:00-18:00", "\u0660\u0669:\u0660\u0660-18:00", "9am-5pm",
              "09:00-18:00Z", "T09:00-18:00", 9, None, ["09:00-18:00"]],
    "zone": ["Mars/Olympus", "", " UTC", "UTC ", "Europe/", "Europe", "Europe//Paris",
             "../etc/passwd", "/etc/passwd", "zone.tab", "tzdata.zi", "Europe/Paris\x00",
             "+05:00", "GMT+5", "Europe/Par is", "\u00c9urope/Paris", "A/" * 300 + "x", 5,
             True, ["UTC"], {"UTC": 1},
             # the machine's database holds these files, but they name no zone of tz:
             # its own zone (it follows the machine), the rules for POSIX TZ strings, and
             # copies of the zones (right/ counts leap seconds, so it shows the wrong wall
             # clock for half a minute after each change)
             "localtime", "posixrules", "right/UTC", "right/Europe/Paris", "posix/UTC",
             "posix/Europe/Paris", "RIGHT/UTC", "LocalTime"],
}


def refusal(raw):
    try:
        During(raw, WHERE)
    except ConfigError as err:
        return str(err)
    return None


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_a_field_that_cannot_be_read_is_refused_naming_it(field):
    good = {"days": "mon-fri", "hours": "09:00-18:00", "zone": "UTC"}
    messages = {repr(value): refusal({**good, field: value}) for value in REFUSED[field]}
    accepted = [value for value, message in messages.items() if message is None]
    assert accepted == []
    unnamed = [(value, message) for value, message in messages.items()
               if f"{WHERE}.{field}" not in message or "\n" in message]
    assert unnamed == []


def test_a_during_missing_its_zone_or_its_range_is_refused_naming_what_is_missing():
    assert f"{WHERE} needs zone" in refusal({"days": "mon"})
    assert f"{WHERE} needs zone" in refusal({"days": "mon", "zone": None})
    assert f"{WHERE} needs days, hours or both" in refusal({"zone": "UTC"})
    assert f"{WHERE} must be an object" in refusal({})
    assert f"{WHERE} must be an object" in refusal("mon-fri")
    assert 'unknown field "tz"' in refusal({"days": "mon", "zone": "UTC", "tz": "UTC"})


def test_a_zone_named_as_tz_names_it_is_accepted():
    for zone in ("UTC", "Etc/GMT+5", "Europe/Kiev", "Europe/Kyiv", "Asia/Kathmandu",
                 "America/Argentina/Buenos_Aires", "EST5EDT"):
        assert refusal({"days": "mon", "zone": zone}) is None, zone


def test_a_file_beside_the_zones_that_names_no_zone_is_refused():
    """Found by the comparison: During took these for zones, and ICU knows none of them. At
    01:00:10 UTC on 31 March 2024 Paris showed 03:00:10, right/Europe/Paris 02:00:10."""
    for zone in ("localtime", "posixrules", "right/Europe/Paris", "posix/Europe/Paris"):
        message = refusal({"hours": "02:00-03:00", "zone": zone})
        assert message is not None and f"{WHERE}.zone" in message, zone


def test_a_zone_name_nested_deeper_than_any_zone_is_refused_not_a_crash():
    """Found by the refusals: zoneinfo looked a deep name up level by level, recursing, and
    raised RecursionError out of the configuration's load."""
    message = refusal({"days": "mon", "zone": "Europe/" * 300 + "Paris"})
    assert message is not None and f"{WHERE}.zone" in message
