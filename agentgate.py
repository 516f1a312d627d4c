#!/usr/bin/env python3
"""agentgate: a gate between an MCP host and the MCP servers it uses.

agentgate is one standard-library Python file. An MCP host (Claude Desktop, Claude Code,
Cursor, ...) starts it as a stdio MCP server. agentgate starts the real servers the person
configured, offers the host only the tools the person pinned and classified, and puts a gate
in front of every `tools/call`:

    record it -> check its arguments against the tool's pinned schema -> evaluate the policy
    -> if the policy asks, wait for an operator's approval bound by hash to this exact request
    -> execute the upstream call itself -> record the outcome.

Everything is recorded in one SQLite file. Approvals are decided outside the host, in a
terminal, with `agentgate.py approve RUN -approval ID` (or reject / cancel).

Scope. agentgate governs only the calls that go through it. It is a guard for one person who
is both the host's user and the operator; it does not separate them, and a model that can run
commands can approve its own request with the operator command or by editing the database.
Its policy reads each call's arguments, its time and the host's self-reported name, and its
limits count a tool's executions; it reads nothing of the conversation. It refuses a
deliberate identical repeat of a mutating call within the repeat window, as it refuses a blind
retry. The pin covers what a server presents, not what it does.

Sections (3167 lines of decision core, read first; then the libraries it relies on, each
behind a contract its header states; then what surrounds the core, each naming in its header
the core functions it calls, beyond the framing, ids and deadlines of sections 1 and 2,
constants and exception classes). A section of the core uses only the sections above it and
the libraries, so the core reads top to bottom: the policy comes before the configuration
because the configuration is read with its parser.

                                                                     lines    chars
     1. Framing                                      decision core      137    4,411
     2. Classes, ids and deadlines                   decision core       34    1,117
     3. Policy on what a call does                   decision core      464   19,087
     4. Configuration and its trust                  decision core      234    9,972
     5. Tools, as pinned                             decision core      296   12,438
     6. Answers                                      decision core      356   17,388
     7. The record                                   decision core      724   32,946
     8. The gate                                     decision core      622   27,961
     9. The host side                                decision core      300   10,803
    10. Canonical JSON                               library            315   11,509
    11. Text safe to show                            library            114    4,121
    12. ECMA-262 patterns                            library            443   17,185
    13. JSON Schema                                  library            436   17,779
    14. Hosts in URLs                                library            140    5,890
    15. Paths as the kernel resolves them            library            109    4,423
    16. Durations and times                          library            124    5,076
    17. Fields of a configuration                    library            118    4,449
    18. Days and hours in a time zone                library             95    4,633
    19. What a result's record keeps                 library            140    5,688
    20. The lint                                     around the core    247   10,745
    21. Upstream servers                             around the core   1308   49,331
    22. Reading the record                           around the core    180    8,675
    23. Tool changes while serving                   around the core    190    8,030
    24. The status tool                              around the core    120    5,035
    25. The host's other requests                    around the core    162    5,863
    26. Notify                                       around the core    119    4,400
    27. Pins and load reports                        around the core    199    7,523
    28. The command line's flags                     around the core    125    5,956
    29. Operator commands                            around the core   1441   58,407
    30. Setup                                        around the core    748   31,400
    31. Pin and check                                around the core    182    7,569
    32. Fake payment server                          around the core    117    4,191
    33. Demonstration                                around the core    265    8,898
    34. Main                                         around the core    131    4,474

One tools/call through the core, with the section of each step (10, 13, 19: libraries):

    HostServer._read_loop    read_frames: one frame per newline byte off stdin           1
      HostServer._frame      parse: the boundary check, number literals kept as written 10
      HostServer._message    a worker thread, at most MAX_IN_FLIGHT calls at once        9
        HostServer._call     the tool the name offers, as pinned (Tool, load)          9, 5
          Gate.call          canonical, request_key: the request's identity        8, 10, 1
          Gate._judge        judged_request: check_arguments (validate) and the
                             policy's conditions, judged once, before the lock  8, 6, 13, 3
          Gate._decide       under the gate's lock, rules 1 to 7 over the request's
                             earlier runs (Store.key_runs), each rule a verdict         8, 7
          Gate._begin        rule 8: policy_decision in the write transaction that
                             records the run (Tx.begin_run ... Tx.start_execution)   8, 3, 7
          Gate._hold         a Wait: an operator decides elsewhere, bound by hash          8
          Gate._execute      call_upstream with the rule's timeout; passed_result and
                             result_record: what the host gets, and what is kept    8, 6, 19
                             Tx.finish_execution, committed before the answer is sent     7
        passed_answer        the server's result as it sent it, or answer() from PROSE    6
      HostServer.send        one JSON-RPC line on stdout, written as bytes                9
"""

import argparse
import base64
import bisect
import collections
import contextlib
import ctypes
import datetime
import decimal
import errno
import functools
import hashlib
import json
import math
import os
import queue
import re
import secrets
import select
import shlex
import signal
import sqlite3
import stat
import subprocess
import sys
import tempfile
import threading
import time
import unicodedata

PROGRAM = "agentgate"
VERSION = "0.2.0"


# =============================================================================================
# 1. Framing
#
# Reads as: decision core
#
# Owns: both sides' byte streams cut into frames, whom to answer when a frame is refused, and
# the hashes of a request's identity (over section 10's encoding).
# Promises: a frame is split on `\n` bytes only (never on U+2028/U+2029) and never held past
# its cap; the id read from a refused frame is only ever its own top-level one, found
# wherever it stands in the frame.
# =============================================================================================

def read_frames(fd, cap):
    """Newline-delimited frames off `fd`: (frame, None) up to `cap` bytes, else (None, its own
    top-level integer id or None) with the rest read only for that id. os.read, unbuffered: a
    reader thread holds no lock at exit."""
    pending, refused = bytearray(), None
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            if pending and refused is None:
                yield bytes(pending), None
            return
        for piece in re.findall(rb"[^\n]*\n|[^\n]+", chunk):
            if refused is None and len(pending) + len(piece) > cap + 1:
                refused, pending = FrameId(), pending + piece
                refused.feed(bytes(pending))
                pending = bytearray()
            elif refused is not None:
                refused.feed(piece)
            else:
                pending += piece
            if piece.endswith(b"\n"):
                yield (None, refused.ident) if refused else (bytes(pending), None)
                pending, refused = bytearray(), None


def parse_loosely(data):
    """A refused message read leniently, only for whom to answer (never what is sent or
    recorded); None if even that fails."""
    try:
        return json.loads(data.decode("utf-8", "replace"), parse_int=Number, parse_float=Number,
                          parse_constant=Number)
    except (ValueError, RecursionError):
        return None


_HEAD_ID_RE = re.compile(rb"\s*:\s*(-?(?:0|[1-9][0-9]{0,17}))[\s,}]")
# The rest of a string up to its closing quote (or a lone backslash, or the piece's end).
_STRING_REST_RE = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.S)
_TOKEN_STOP_RE = re.compile(rb'["{}\[\]]')


class FrameId:
    """A refused message's own top-level integer "id", read from pieces of any size wherever
    it stands: a nested one could name another request. Strings are passed over by one
    regular expression each and nothing else is read but brackets, at C speed."""

    def __init__(self):
        self.depth, self.string, self.escaped = 0, False, False
        self.key = None    # the first bytes of a depth-1 string while it is read
        self.after = None  # what follows a depth-1 "id" key while it is read
        self.ident = None

    def feed(self, data):
        if self.after is not None:
            self._read_value(data)
        pos = 1 if self.escaped and data else 0
        self.escaped = self.escaped and not data
        while pos < len(data) and self.ident is None:
            if not self.string:
                stop = _TOKEN_STOP_RE.search(data, pos)
                if not stop:
                    return
                byte, pos = stop.group(), stop.end()
                if byte == b'"':
                    self.string, self.key = True, b"" if self.depth == 1 else None
                else:
                    self.depth += 1 if byte in b"{[" else -1
                continue
            end = _STRING_REST_RE.match(data, pos).end()
            if self.key is not None:
                self.key = (self.key + data[pos:min(end, pos + 3)])[:3]
            if end == len(data) or data[end] == 0x5C:  # a backslash whose escape is next
                self.escaped = end < len(data)
                return
            self.string, pos = False, end + 1
            if self.key == b"id":
                self.after = b""
                self._read_value(data[pos:])
            self.key = None

    def _read_value(self, data):
        self.after += data[:64 - len(self.after)]
        value = _HEAD_ID_RE.match(self.after)
        if value:
            self.ident = int(value.group(1))
        if value or len(self.after) >= 64:
            self.after = None


def frame_id(data):
    """A refused message's own top-level integer "id", or None."""
    reading = FrameId()
    reading.feed(data)
    return reading.ident


def echoable_id(ident):
    """Whether an id can be echoed as JSON (lone surrogates, NaN and the like cannot)."""
    if isinstance(ident, str):
        return not SURROGATE_RE.search(ident)
    return isinstance(ident, Number) and bool(JSON_NUMBER_RE.fullmatch(ident.literal))


def sha256_hex(data):
    return hashlib.sha256(data if isinstance(data, bytes) else data.encode("utf-8")).hexdigest()


def value_digest(data):
    """A value too large to keep again, as its size and hash."""
    return f"[{len(data)} bytes, sha256 {sha256_hex(data)}]"


def content_hash(value):
    return sha256_hex(canonical(value))


def request_key(tool_name, args):
    """A request's identity: the tool's name and canonical arguments (value or bytes)."""
    encoded = args if isinstance(args, bytes) else canonical(args)
    return sha256_hex(tool_name.encode("utf-8") + b"\x00" + encoded)


# =============================================================================================
# 2. Classes, ids and deadlines
#
# Reads as: decision core
#
# Owns: the side-effect classes and outcomes, the error a configuration is refused with, ids
# and deadlines. A duration is whole nanoseconds, as Go's (section 16 reads and writes them).
# =============================================================================================

SECOND = 10**9
SIDE_EFFECTS = ("read_only", "local_mutation", "remote_mutation", "destructive")
OUTCOMES = ("allow", "require_approval", "deny")


class ConfigError(Exception):
    """A configuration the gate will not run with; the message says what to change."""


def new_id(size):
    """Milliseconds, then randomness: ids land at their indexes' right edge, so a
    write touches the same pages however large the database; a clash is decided again."""
    stamp = (time.time_ns() // 1_000_000) & 0xFFFFFFFFFF
    return f"{stamp:010x}" + secrets.token_hex(size - 5)


class Deadline:
    def __init__(self, ns):
        self.ns = ns
        self.at = time.monotonic() + ns / SECOND

    def left(self):
        return max(0.0, self.at - time.monotonic())


# =============================================================================================
# 3. Policy on what a call does
#
# Reads as: decision core
#
# Owns: conditions, `when` entries, limits and grants, and the one decision they make with the
# class map (policy_decision), from the call, its Judgement (once per request) and the Facts
# of its moment (decision_facts, for the gate and recheck alike; `rows` is its only SQL).
# Promises: a condition that cannot be evaluated does not hold, and an entry other than allow
# that cannot be judged denies; numbers compare exactly, never through a float; a limit never
# loosens; a grant answers only what would wait for an operator (never a deny, never a re-run
# of an unknown outcome); a policy mistake is refused at load naming the tool, the entry and
# the fix. A pointer reads an omitted argument at its pinned schema's default, as the server
# does. A limit counts each execution by its recorded arguments, so a limit added within its
# window counts what ran before it.
# =============================================================================================

GRANT_COLUMNS = ("id", "session", "tool", "name", "conditions_json", "created_at", "expires_at",
                 "by", "note", "revoked_at", "revoked_by", "revoke_note")


def tool_spec(rows, spec_hash):
    found = rows("SELECT spec_json FROM tool_specs WHERE hash=?", (spec_hash,))
    return parse(found[0][0]) if found else None


CONDITIONS = {  # and how Condition.text reads each
    "equals": "equals {}", "in": "is one of {}", "not_in": "is none of {}",
    "pattern": "matches {}", "min": "is at least {}", "max": "is at most {}",
    "max_length": "is at most {} long", "present": "present is {}", "under": "lies under {}",
    "host_in": "has a host in {}", "host_not_in": "has a host not in {}",
}
NEGATED = {"is": "is not", "equals": "does not equal", "matches": "does not match",
           "lies": "does not lie", "has": "does not have"}
NEVER = math.inf  # when a limit frees up for a call that is alone above it

# What a decision depends on beyond the call. at: seconds since the epoch; client: the host's
# name from initialize; grants(): the Grants in force (read only when a decision would wait);
# uses(since): the tool's executions after `since`, as (seconds, {sum pointer: amount}), or
# None when no limit is counted (the decision only steers the rules, or an operator decided).
Facts = collections.namedtuple("Facts", "at client grants uses")


def number_text(value):
    """An exact decimal as people write it: 50.00 stays 50.00, 1E+2 reads 100."""
    text = format(value, "f")
    return text if len(text) <= 40 else str(value)


class Condition:
    """`resolved`: the directories of `under` are a grant's, resolved when it was confirmed."""

    def __init__(self, pointer, raw, where, resolved=False):
        self.pointer, self.tokens = pointer, parse_pointer(pointer, where)
        where = f"{where} {quote(pointer)}"
        if not isinstance(raw, dict) or not raw:
            raise ConfigError(f"{where} must be an object with one or more of "
                              f"{', '.join(CONDITIONS)}")
        refuse_unknown(raw, CONDITIONS, where)
        self.raw = raw
        self.tests = [(name, self._read(name, value, f"{where}.{name}", resolved))
                      for name, value in raw.items()]
        bounds = dict(self.tests)
        if "min" in bounds and "max" in bounds and bounds["min"] > bounds["max"]:
            raise ConfigError(f"{where}: min {number_text(bounds['min'])} is above max "
                              f"{number_text(bounds['max'])}, so it never holds; swap them")
        if raw.get("present") is False and len(raw) > 1:
            raise ConfigError(f"{where}: present false holds only when there is no value, so "
                              f"nothing else can be asked of it; give it its own entry")

    @staticmethod
    def _read(name, value, where, resolved):
        if name in ("in", "not_in", "under", "host_in", "host_not_in"):
            if not isinstance(value, list) or not value:
                kind = "JSON values" if name in ("in", "not_in") else "strings"
                raise ConfigError(f"{where} must be a non-empty list of {kind}")
            if name == "under":
                return list(value) if resolved else [resolved_root(r, where) for r in value]
            if name in ("host_in", "host_not_in"):
                return [host_entry(entry, name == "host_in", where) for entry in value]
            return value
        if name == "pattern":
            if not isinstance(value, str):
                raise ConfigError(f"{where} must be a string, an ECMA-262 pattern")
            try:
                compile_pattern(value)
            except PatternError as err:
                raise ConfigError(f"{where} cannot be used ({err}): write an ECMA-262 pattern "
                                  f"without backreferences, lookaround or \\p{{...}}") from None
            return value
        if name in ("min", "max"):
            return parse_decimal(value, where)
        if name == "max_length":
            return whole_number(value, where, 0)
        if name == "present" and not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false")
        return value  # present: true or false; equals: any JSON value

    def holds(self, args, work=None, schema=None):
        """True, False, or None when no test is false but a pattern search costs more than
        `work` can pay: then it does not hold."""
        return all_judged(verdict for verdict, _ in self._verdicts(args, work, schema))

    def _verdicts(self, args, work, schema):
        value, node = pointed(args, self.tokens, schema)
        work = PatternWork() if work is None else work
        for name, expected in self.tests:
            seen = exact_number(value, node) if name in ("min", "max") and \
                value is not MISSING else value  # a Decimal, or None
            yield self._test(name, expected, seen, work), (name, expected, seen)

    def miss(self, args, work, schema):
        """Why it does not hold, as the operator reads it ('' when it holds)."""
        for verdict, (name, expected, value) in self._verdicts(args, work, schema):
            if verdict is None:
                return f"{self.pointer} is too long to be checked"
            if verdict is False:
                if value is MISSING or name == "present":
                    return f"{self.pointer} is {'absent' if value is MISSING else 'present'}"
                if value is None:
                    return f"{self.pointer} is not a number"
                verb, _, rest = self._words(name, expected).partition(" ")
                return f"{self.pointer} {NEGATED[verb]} {rest}"
        return ""

    @staticmethod
    def _test(name, expected, value, work):
        if name == "present" and not expected:
            return value is MISSING
        if value is MISSING:
            return False
        if name == "pattern":  # the one test that draws on the call's pattern work
            try:
                return isinstance(value, str) and work.search(expected, value, "")
            except PatternCost:
                return None
        return CHECKS[name](value, expected)

    @staticmethod
    def _words(name, expected):
        return CONDITIONS[name].format(number_text(expected) if name in ("min", "max") else
                                       policy_json(expected))

    def text(self):
        return f"{self.pointer} " + " and ".join(self._words(*test) for test in self.tests)


def all_judged(verdicts):
    """False at the first false verdict (the rest are not judged: no pattern work is spent on
    them), else None if one was not judged, else True."""
    judged = True
    for verdict in verdicts:
        if verdict is None:
            judged = None
        elif not verdict:
            return False
    return judged


def _host_holds(value, hosts, listed):
    """Never for a URL whose host cannot be read: neither host_in nor host_not_in allows it,
    nor does a deny on host_in catch it, so a host policy is safest written as what it allows."""
    place = url_place(value)
    return place is not None and host_matches(*place, hosts) == listed


CHECKS = {
    "equals": lambda value, expected: json_equal(value, expected),
    "in": lambda value, options: any(json_equal(value, o) for o in options),
    "not_in": lambda value, options: not any(json_equal(value, o) for o in options),
    "min": lambda value, bound: value is not None and value >= bound,
    "max": lambda value, bound: value is not None and value <= bound,
    "max_length": lambda value, bound: isinstance(value, (str, list)) and len(value) <= bound,
    "present": lambda value, expected: True,
    "under": lambda value, roots: path_under(value, roots),
    "host_in": lambda value, hosts: _host_holds(value, hosts, True),
    "host_not_in": lambda value, hosts: _host_holds(value, hosts, False),
}


def parse_conditions(raw, where, resolved=False):
    if not isinstance(raw, dict):
        raise ConfigError(f'{where} must be an object of JSON Pointer to condition, such as '
                          f'{{"/amount": {{"max": "50.00"}}}}')
    return [Condition(pointer, condition, where, resolved) for pointer, condition in
            raw.items()]


class Judgement:
    """A request's schema problem and each entry's and grant's verdict, judged once per pass
    through the gate: a decision made again reads afresh only the moment, grants, uses and a
    re-run. Its pattern work outlives it: after a hold, a call searches nothing twice."""

    def __init__(self, problem="", work=None):
        self.problem, self.held = problem, {}
        self.work = PatternWork() if work is None else work

    def holds(self, key, conditions, args, schema):
        if key not in self.held:
            self.held[key] = all_judged(c.holds(args, self.work, schema) for c in conditions)
        return self.held[key]


class Entry:
    def __init__(self, raw, where, label):
        self.label = label
        if not isinstance(raw, dict):
            raise ConfigError(f"{where} must be an object with if, during or client, and an "
                              f"outcome")
        refuse_unknown(raw, ("if", "during", "client", "outcome", "reason"), where)
        self.outcome = one_of(field_string(raw, "outcome", where, required=True), OUTCOMES,
                              f"{where}.outcome")
        self.conditions = parse_conditions(raw.get("if", {}), f"{where}.if")
        self.during = During(raw["during"], f"{where}.during") if "during" in raw else None
        self.clients = field_names(raw, "client", where) if "client" in raw else None
        if self.clients == []:
            raise ConfigError(f"{where}.client must list at least one host name")
        if not self.conditions and self.during is None and self.clients is None:
            raise ConfigError(f"{where} has no if, during or client, so it always holds: give "
                              f"the rule this outcome instead")
        # The reason is model input: by default it names the entry, never what it compares.
        self.reason = field_string(raw, "reason", where) or f"the operator's rule {label}"

    def holds(self, args, facts, judged=None, schema=None):
        if (self.clients is not None and facts.client not in self.clients) or \
                (self.during is not None and not self.during.holds(facts.at)):
            return False
        return (judged or Judgement()).holds(self.label, self.conditions, args, schema)

    def miss(self, args, facts, judged, schema):
        """Why it did not hold, for the operator."""
        if self.clients is not None and facts.client not in self.clients:
            why = f"the host {quote(facts.client)} is not one of {policy_json(self.clients)}"
        elif self.during is not None and not self.during.holds(facts.at):
            why = "it is outside its days and hours"
        else:
            why = next(filter(None, (c.miss(args, judged.work, schema)
                                     for c in self.conditions)), "")
        return f"{self.label}: {why}"


class Limit:
    """At most `calls` executions of one tool, or a `sum` up to `max`, within `per` and across
    sessions; past it, `then`."""

    def __init__(self, raw, where, label):
        self.label = label
        if not isinstance(raw, dict):
            raise ConfigError(f'{where} must be an object such as {{"calls": 5, "per": "1h"}}')
        refuse_unknown(raw, ("calls", "sum", "max", "per", "then"), where)
        if ("calls" in raw) == ("sum" in raw):
            raise ConfigError(f'{where} needs exactly one of calls (a count) or sum (a JSON '
                              f'Pointer to a number, with max)')
        self.calls = self.sum = self.tokens = self.max = None
        if "calls" in raw:
            self.calls = whole_number(raw["calls"], f"{where}.calls", 1, 10**9)
            if "max" in raw:
                raise ConfigError(f"{where}: max goes with sum; a calls limit is its own count")
        else:
            self.sum = raw["sum"]
            self.tokens = parse_pointer(self.sum, f"{where}.sum")
            if "max" not in raw:
                raise ConfigError(f"{where} needs max, the most the sum may reach")
            self.max = parse_decimal(raw["max"], f"{where}.max")
            if self.max < 0:
                raise ConfigError(f"{where}.max must not be negative")
        self.per = field_duration(raw, "per", where, None)
        if not self.per:
            raise ConfigError(f'{where} needs per, a window such as "1h" or "24h"')
        self.then = field_string(raw, "then", where) or "require_approval"
        if self.then not in ("require_approval", "deny"):
            raise ConfigError(f"{where}.then is {quote(self.then)}; a limit never loosens, so "
                              f"use require_approval or deny")

    def amount(self, args, schema=None):
        """What a call adds to the sum: the size of its number (a negative amount is no
        credit), 0 when there is none, None when it is not a number."""
        value, node = pointed(args, self.tokens, schema)
        if value is MISSING:
            return decimal.Decimal(0)
        value = exact_number(value, node)
        return None if value is None else value.copy_abs()  # never rounds

    def frees(self, args, uses, at, schema=None):
        """None when this call stays within the limit, else when it would, in epoch seconds."""
        window = self.per / SECOND
        rows = uses(at - window)
        if self.calls is not None:
            if len(rows) < self.calls:
                return None
            return rows[-self.calls][0] + window
        this = self.amount(args, schema)
        if this is None or this > self.max:
            return NEVER
        try:
            with decimal.localcontext(EXACT):
                sizes = [amounts.get(self.sum, decimal.Decimal(0)).copy_abs()
                         for _, amounts in rows]
                total = sum(sizes, this)
                if total <= self.max:
                    return None
                for (moment, _), size in zip(rows, sizes):
                    total -= size
                    if total <= self.max:
                        return moment + window
        except decimal.DecimalException:  # cannot be summed exactly: cannot be passed
            pass
        return NEVER

    def text(self, tool_name):
        span = format_duration(self.per)
        if self.calls is not None:
            return f"at most {self.calls} call{'s' if self.calls != 1 else ''} to {tool_name} " \
                   f"per {span}"
        return f"a sum of {self.sum} of at most {number_text(self.max)} for {tool_name} per " \
               f"{span}"


class Grant:
    def __init__(self, stored):
        self.id, self.by = stored["id"], stored["by"]
        self.conditions = parse_conditions(parse(stored["conditions_json"]), f"grant {self.id}",
                                           resolved=True)


def counted_uses(rows, tool, before):
    """Facts.uses for a decision on `tool` at the stored time `before`: each execution's
    recorded arguments, read under the schema it was decided under."""
    sums = [limit for limit in tool.rule.limits if limit.sum]
    schemas = {tool.spec_hash: tool.schema}

    def uses(since):
        found = []
        for moment, decision, spec_hash in rows(
                "SELECT e.at, s.decision_json, s.spec_hash FROM executions e JOIN steps s ON "
                "s.id=e.step_id WHERE e.tool=? AND e.at>? AND e.at<? ORDER BY e.at, e.id",
                (tool.target, format_time(since), before)):
            amounts = {}
            if sums:  # a calls limit needs no arguments: they are not read
                args = parse(decision)["args"]
                if spec_hash not in schemas:
                    spec = tool_spec(rows, spec_hash)
                    schemas[spec_hash] = spec["input_schema"] if spec else None
                for limit in sums:
                    amount = limit.amount(args, schemas[spec_hash])
                    if amount is not None:
                        amounts[limit.sum] = amount
            found.append((parse_time(moment), amounts))
        return found
    return uses


def decision_facts(rows, session, tool, stamp, client, count):
    """The Facts of the stored time `stamp`; the uses are counted only when `count`."""
    def grants():
        return [Grant(dict(zip(GRANT_COLUMNS, row))) for row in rows(
            f"SELECT {', '.join(GRANT_COLUMNS)} FROM grants WHERE session=? AND tool=? AND "
            f"expires_at>? AND created_at<=? AND (revoked_at='' OR revoked_at>?) ORDER BY "
            f"created_at, id", (session, tool.target, stamp, stamp, stamp))]
    return Facts(parse_time(stamp), client, grants,
                 counted_uses(rows, tool, stamp) if count else None)


def policy_decision(config, tool, args, facts, rerun=False, approved=False, judged=None):
    """{outcome, reason, by} (by: the `when` entry, limit, grant, "rule outcome" or "class"
    that decided), with `limit` and `frees` when a limit decided, `grant` when a grant did.
    The first `when` entry that holds decides, else the class map. Then, in order: a deny, a
    re-run of an unknown outcome (it always needs an operator) and a call an operator
    `approved` (not counted again) stand; a grant may answer what would wait; a limit may turn
    an allow into its `then` (it counts what grants let through, so a budget holds under a
    grant); with no operator at hand, what would wait is denied."""
    rule = tool.rule
    judged = Judgement() if judged is None else judged
    for entry in rule.when:
        held = entry.holds(args, facts, judged, tool.schema)
        if held is None and entry.outcome != "allow":
            # Not judged (too costly): passed over, a long value could slip past a deny or a
            # question. An allow entry passed over only makes it stricter.
            decision = {"outcome": "deny", "by": entry.label,
                        "reason": f"the arguments are too long to be checked against the "
                                  f"operator's rule {entry.label}"}
            break
        if held:
            decision = {"outcome": entry.outcome, "reason": entry.reason, "by": entry.label}
            break
    else:
        outcome = rule_outcome(config, rule)
        reason = (f"tool {tool.name} is {outcome} by the operator's rule" if rule.outcome else
                  f"side effect {tool.side_effect} is {outcome} by policy")
        decision = {"outcome": outcome, "reason": reason,
                    "by": "rule outcome" if rule.outcome else "class"}
        if rule.when:
            decision["tried"] = [entry.miss(args, facts, judged, tool.schema)
                                 for entry in rule.when]
    if decision["outcome"] == "deny" or rerun or approved:
        return decision
    if decision["outcome"] == "require_approval":
        for grant in facts.grants():
            # A condition that could not be judged does not hold: a grant only loosens.
            if judged.holds(f"grant {grant.id}", grant.conditions, args, tool.schema) is True:
                decision = {"outcome": "allow", "by": f"grant {grant.id}", "grant": grant.id,
                            "reason": f"standing approval {grant.id} by {grant.by}"}
                break
    if decision["outcome"] == "allow" and facts.uses is not None:
        for limit in rule.limits:
            frees = limit.frees(args, facts.uses, facts.at, tool.schema)
            if frees is not None:
                text = limit.text(tool.name)
                decision = {"outcome": limit.then, "by": limit.label, "limit": text,
                            "frees": frees, "reason": f"a limit is reached: {text}"}
                break
    if decision["outcome"] == "require_approval" and config.operator == "none":
        decision = {**decision, "outcome": "deny",
                    "reason": f"{decision['reason']}; no operator is at hand to approve it"}
    return decision


def frees_text(decision):
    """When the limit that decided frees up ('' when none did), rounded up to the second so
    a call made then is within it."""
    if "frees" not in decision:
        return ""
    if decision["frees"] is NEVER:
        return "this call alone is above it"
    return f"it frees up at {prose_time(format_time(math.ceil(decision['frees'])))}"


def rule_outcome(config, rule):
    """Config.policy maps every class."""
    return rule.outcome or config.policy[rule.side_effect]


def pointer_problem(schema, tokens, hidden):
    """Why a pointer names no property the model can send under this schema, or ''."""
    node = schema
    for depth, token in enumerate(tokens):
        if depth == 0 and token in hidden:
            return f"the rule hides {quote(token)}, so the model never sends it"
        try:
            node = schema_child(schema, node, token)
        except SchemaError:
            return "it passes through a $ref that points at nothing"
        if node is None:
            return "the schema has no such property"
    return ""


def policy_pointer_problem(schema, rule, tool_name):
    """The sentence refusing the tool for the first `when` condition or sum limit whose
    pointer misses the pinned schema, or ''."""
    hidden = set(rule.deny) | set(rule.fixed)
    pointers = [(entry.label, c.pointer, c.tokens) for entry in rule.when
                for c in entry.conditions]
    pointers += [(limit.label, limit.sum, limit.tokens) for limit in rule.limits if limit.sum]
    for label, pointer, tokens in pointers:
        problem = pointer_problem(schema, tokens, hidden)
        if problem:
            properties = schema.get("properties")
            names = sorted(set(properties if isinstance(properties, dict) else ()) - hidden)
            return (f"{label} of {tool_name} points at {quote(pointer)}, but {problem}; point "
                    f"at one of: {', '.join('/' + sanitize(n) for n in names) or 'nothing'}")
    return ""


# =============================================================================================
# 4. Configuration and its trust
#
# Reads as: decision core
#
# Owns: reading the config file and the files it trusts (manifests, the database), the fields
# that decide and their defaults, and the policy identity. How a server is reached decides
# nothing: section 21's read_transport reads it, in the same pass.
# Promises: a config is used only if it is a regular file owned by this user that nobody else
# can write; it passes the canonical boundary check (so a repeated key cannot be read two
# ways); every unknown field anywhere is refused with its path. Every refusal is one sentence
# naming the field and what to do.
# =============================================================================================

DEFAULT_POLICY = {"read_only": "allow", "local_mutation": "allow",
                  "remote_mutation": "require_approval", "destructive": "deny"}
NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MIN_LEASE_TTL = 3 * SECOND
# Long enough for a slow search or a build, short enough that a hung server is noticed.
DEFAULT_TOOL_TIMEOUT = 60 * SECOND
# What one call may bring in and one result take out, canonically encoded.
DEFAULT_ARGUMENT_BYTES = 1 << 20
MAX_ARGUMENT_BYTES = 8 << 20
DEFAULT_RESULT_BYTES = 8 << 20
MAX_RESULT_BYTES = 16 << 20


def read_owned(path, what):
    """The bytes of a file only this user can change, or ConfigError saying how to fix it."""
    try:
        # O_NONBLOCK: a FIFO planted at the path must not hang the open before it is refused.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        if err.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
            raise ConfigError(f"{what} {path} is a symbolic link; name the file itself") from None
        raise ConfigError(f"{what} {path} cannot be read: {err.strerror}") from None
    try:
        _check_owned(path, what, os.fstat(fd))
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def _check_owned(path, what, st):
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} {path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"{what} {path} ({stat.filemode(st.st_mode)}) is owned by uid "
                          f"{st.st_uid}, not by the current user: chown it or use your own copy")
    if st.st_mode & 0o022:
        raise ConfigError(f"{what} {path} has mode {stat.filemode(st.st_mode)}, which lets its "
                          f"group or others write it: chmod go-w it")


class Rule:
    """The operator's classification of one upstream tool."""

    FIELDS = ("side_effect", "timeout", "description", "deny", "fixed", "rename",
              "allow_hint_mismatch", "outcome", "repeat_window", "when", "limits", "proposed",
              "accepted_description")

    def __init__(self, tool, raw, where):
        refuse_unknown(raw, self.FIELDS, where)
        self.tool = tool
        self.side_effect = one_of(field_string(raw, "side_effect", where, required=True),
                                  SIDE_EFFECTS, f"{where}.side_effect")
        self.timeout = field_duration(raw, "timeout", where, None)
        self.description = field_string(raw, "description", where)
        self.deny = field_names(raw, "deny", where)
        self.fixed = raw.get("fixed", {})
        if not isinstance(self.fixed, dict):
            raise ConfigError(f"{where}.fixed must be an object of parameter name to JSON value")
        self.rename = field_string(raw, "rename", where)
        self.allow_hint_mismatch = field_bool(raw, "allow_hint_mismatch", where)
        self.outcome = field_string(raw, "outcome", where)
        if self.outcome:
            one_of(self.outcome, OUTCOMES, f"{where}.outcome")
        self.repeat_window = field_duration(raw, "repeat_window", where, None)
        # Set by init from the server's own hints: nothing is offered on a rule nobody reviewed.
        self.proposed = field_bool(raw, "proposed", where)
        # The hash of texts the lint finds something high in, which the operator accepted.
        self.accepted_description = field_string(raw, "accepted_description", where)
        self.when = [Entry(entry, f"{where}.when[{i}]", f"when[{i}]")
                     for i, entry in enumerate(self._list(raw, "when", where))]
        self.limits = [Limit(limit, f"{where}.limits[{i}]", f"limits[{i}]")
                       for i, limit in enumerate(self._list(raw, "limits", where))]
        # What the policy decides from, as given: the rule's part of policy_id.
        self.policy = {k: raw[k] for k in ("side_effect", "outcome", "fixed", "rename", "when",
                                           "limits") if raw.get(k)}

    @staticmethod
    def _list(raw, field, where):
        value = raw.get(field, [])
        if not isinstance(value, list):
            raise ConfigError(f"{where}.{field} must be a list")
        return value


class Server:
    FIELDS = ("name", "command", "url", "headers", "oauth", "env", "inherit_env",
              "connect_timeout", "default_timeout", "manifest", "rules", "skip_path_check", "cwd")

    def __init__(self, raw, where, path, transport=None):
        refuse_unknown(raw, self.FIELDS, where)
        self.config_path, base = path, os.path.dirname(path)  # the config it is in
        self.name = field_string(raw, "name", where, required=True)
        _check_name(self.name, f"{where}.name")
        where = f'server "{self.name}"'
        if transport:
            transport(self, raw, where, base)
        self.default_timeout = field_duration(raw, "default_timeout", where, None)
        manifest = field_string(raw, "manifest", where, required=True)
        self.manifest = os.path.join(base, os.path.expanduser(manifest))
        rules = raw.get("rules", {})
        if not isinstance(rules, dict):
            raise ConfigError(f"{where}.rules must be an object of upstream tool name to rule")
        self.rules = {tool: Rule(tool, rule, f"{where}.rules.{tool}")
                      for tool, rule in rules.items()}
        self.skip_path_check = field_bool(raw, "skip_path_check", where)


class Config:
    FIELDS = ("database", "session", "servers", "policy", "hold", "repeat_window",
              "max_pending", "approval_ttl", "grant_ttl", "status_tool", "lease_ttl",
              "max_argument_bytes", "max_result_bytes", "operator", "notify")

    def __init__(self, raw, path, transport=None):
        self.path = path
        base = os.path.dirname(path)
        if not isinstance(raw, dict):
            raise ConfigError("the configuration must be a JSON object")
        where = "the configuration"
        refuse_unknown(raw, self.FIELDS, where)
        self.database = os.path.join(base, os.path.expanduser(
            field_string(raw, "database", where, required=True)))
        self.session = field_string(raw, "session", where, required=True)
        _check_name(self.session, "session")
        servers = raw.get("servers")
        if not isinstance(servers, list) or not servers:
            raise ConfigError("servers must be a list of at least one server")
        self.servers = [Server(s, f"servers[{i}]", path, transport)
                        for i, s in enumerate(servers)]
        names = [s.name for s in self.servers]
        for name in names:
            if names.count(name) > 1:
                raise ConfigError(f'two servers are named "{name}"; give each its own name')
        policy = raw.get("policy", {})
        if not isinstance(policy, dict):
            raise ConfigError("policy must be an object of side-effect class to outcome")
        for cls, outcome in policy.items():
            if cls not in SIDE_EFFECTS:
                raise ConfigError(f"policy names {quote(cls)}; the classes are "
                                  f"{', '.join(SIDE_EFFECTS)}")
            one_of(outcome, OUTCOMES, f"policy.{cls}")
        self.policy = {**DEFAULT_POLICY, **policy}
        self.hold, self.host_holds = _holds(raw, where)
        self.repeat_window = field_duration(raw, "repeat_window", where, 600 * SECOND)
        self.max_pending = whole_number(raw.get("max_pending", Number("5")), "max_pending", 0,
                                        10**6, " (0 means 5)") or 5
        self.approval_ttl = field_duration(raw, "approval_ttl", where, 86400 * SECOND)
        self.grant_ttl = field_duration(raw, "grant_ttl", where, 86400 * SECOND)
        self.status_tool = field_string(raw, "status_tool", where) or "gate_status"
        _check_name(self.status_tool, "status_tool")
        self.max_argument_bytes = field_byte_cap(raw, "max_argument_bytes", DEFAULT_ARGUMENT_BYTES,
                                                 MAX_ARGUMENT_BYTES)
        self.max_result_bytes = field_byte_cap(raw, "max_result_bytes", DEFAULT_RESULT_BYTES,
                                               MAX_RESULT_BYTES)
        self.operator = field_string(raw, "operator", where)
        if self.operator not in ("", "none"):
            raise ConfigError(f'operator is {quote(self.operator)}; write "none" when no one is '
                              f'at hand to approve (what would wait is then denied), or leave '
                              f'it out')
        self.notify = field_names(raw, "notify", where)
        if "notify" in raw and not self.notify:
            raise ConfigError('notify must be a program and its arguments, such as '
                              '["notify-send", "agentgate", "an approval waits"], or left out')
        self.lease_ttl = field_duration(raw, "lease_ttl", where, 30 * SECOND)
        if self.lease_ttl < MIN_LEASE_TTL:
            raise ConfigError(f"lease_ttl {format_duration(self.lease_ttl)} is shorter than "
                              f"{format_duration(MIN_LEASE_TTL)}; give it at least 3s")

    def hold_for(self, client):
        """Hosts give up on a call after different times; a call held past that is lost to
        the conversation."""
        return self.host_holds.get(client, self.hold)

    def policy_id(self):
        """The identity of exactly what the policy decides from (Rule.policy, the classes'
        outcomes, the absence of an operator), not of hold, windows, TTLs or timeouts."""
        servers = [{"name": s.name, "rules": {tool: r.policy for tool, r in s.rules.items()}}
                   for s in sorted(self.servers, key=lambda s: s.name)]
        identity = {"policy": self.policy, "servers": servers}
        if self.operator:
            identity["operator"] = self.operator
        return f"{PROGRAM}/sha256:" + content_hash(identity)


def _check_name(value, what):
    if not NAME_RE.fullmatch(value):
        raise ConfigError(f"{what} {quote(value)} must be 1 to 64 letters, digits, '_' or '-'")


def _holds(raw, where):
    """(any host's hold, {a host's name in initialize: its hold}), "*" naming the rest."""
    given = raw.get("hold")
    if not isinstance(given, dict):
        return field_duration(raw, "hold", where, 15 * SECOND), {}
    holds = {host: field_duration(given, host, "hold", 15 * SECOND) for host in given}
    return holds.pop("*", 15 * SECOND), holds


def read_config(path, transport):
    path = os.path.abspath(path)
    try:
        raw = parse(read_owned(path, "config"))
    except CanonicalError as err:
        raise ConfigError(f"config {path} is not usable JSON: {err.placed()}") from None
    try:
        return Config(raw, path, transport)
    except ConfigError as err:
        raise ConfigError(f"config {path}: {err}") from None


def check_database_path(path):
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"database {path} is a symbolic link; name the database file itself")
    _check_owned(path, "database", st)


# =============================================================================================
# 5. Tools, as pinned
#
# Reads as: decision core
#
# Owns: which tool a call names: a tool's manifest entry (what it presented at its pin), what
# differs from it now (changed_parts: the one definition), and which tools are offered (load).
# Promises: a tool is offered, as pinned, only if pinned, classified by a reviewed rule, and
# presenting exactly what it did at the pin; its annotations do not contradict its class (unless
# allowed); a high lint finding is accepted for exactly that text; its name is usable; its schema
# is self-contained, usable, and soundly hides what the rule hides. A refusal refuses only that
# tool, an UpstreamError that server, a ConfigError all; hiding lets no refused call through.
# =============================================================================================

class UpstreamError(Exception):
    """A request upstream failed. `outcome`, set by the transport where it writes the bytes:
    'not_sent' (no byte reached the server: nothing executed), 'answered' (a refusal the
    server answered; `rpc`: its code, message and data, when well formed), 'unusable' (an
    answer that cannot be read), 'no_answer', 'timed_out'."""

    def __init__(self, message, outcome="no_answer", rpc=None):
        super().__init__(message)
        self.outcome = outcome
        self.rpc = rpc


ANNOTATION_KEYS = ("title", "readOnlyHint", "destructiveHint", "idempotentHint", "openWorldHint")
# A pin's parts, as (a person's word, the manifest key). Not `execution`: the gate offers no tasks.
PINNED_PARTS = (("input schema", "schema_hash"), ("description", "description_hash"),
                ("title", "title"), ("output schema", "output_schema"),
                ("annotations", "annotations"), ("icons", "icons"), ("_meta", "_meta"))
# What a pin of 0.2.0 or older covers (of annotations, ANNOTATION_KEYS).
EARLY_PARTS = ("input schema", "description", "annotations")


def offered_name(server, tool, rule):
    """The rule's rename, else server_tool, so servers' tools never clash (never prefixed twice)."""
    if rule.rename:
        return rule.rename
    if tool == server.name or tool.startswith((f"{server.name}_", f"{server.name}-")):
        return tool
    return f"{server.name}_{tool}"


class Tool:
    def __init__(self, server, upstream, entry, rule):
        self.server = server
        self.upstream = upstream
        self.upstream_name = entry["name"]
        self.rule = rule
        self.name = offered_name(server, entry["name"], rule)
        # Keyed by what the tool is, not its name: a rename neither lifts an unknown outcome
        # nor lets a repeat through the window.
        self.target = f"{server.name}/{entry['name']}"
        self.description = rule.description or entry.get("description", "")
        self.side_effect = rule.side_effect
        self.read_only = rule.side_effect == "read_only"
        # Unset, the default applies, and check says so.
        self.timeout_given = rule.timeout or server.default_timeout
        self.timeout = self.timeout_given or DEFAULT_TOOL_TIMEOUT
        self.schema = restrict_schema(entry["input_schema"], rule.deny + list(rule.fixed))
        # Offered as pinned, as the rule shows it; a part not presented is left out.
        offered = {"name": self.name, "title": entry.get("title"),
                   "description": self.description or None, "inputSchema": self.schema,
                   "outputSchema": entry.get("output_schema"),
                   "annotations": entry.get("annotations"), "icons": entry.get("icons"),
                   "_meta": entry.get("_meta")}
        self.listing = {key: value for key, value in offered.items() if value is not None}
        self.spec = {"name": self.name, "description": self.description,
                     "input_schema": self.schema, "side_effect": self.side_effect,
                     "timeout": self.timeout}
        self.spec_json = dumps(self.spec)  # encoded once; a step names it by hash
        self.spec_hash = sha256_hex(self.spec_json)


def restrict_schema(schema, hidden):
    if not hidden:
        return schema
    restricted = {k: v for k, v in schema.items() if k != "required"}
    restricted["properties"] = {k: v for k, v in schema.get("properties", {}).items()
                                if k not in hidden}
    required = [r for r in schema.get("required", []) if r not in hidden]
    if required:
        restricted["required"] = required
    return restricted


def manifest_entry(tool):
    """A listed tool as a manifest keeps it (PINNED_PARTS): a part absent or of the wrong
    kind (a host would refuse the listing) is null; such annotations are left out."""
    def kept(field, kind):
        return tool.get(field) if isinstance(tool.get(field), kind) else None
    schema = tool.get("inputSchema")
    description = kept("description", str) or ""
    entry = {"name": tool["name"], "description": description, "input_schema": schema,
             "schema_hash": content_hash(schema),
             "description_hash": sha256_hex(encode_string(description)),
             "title": kept("title", str), "output_schema": kept("outputSchema", dict),
             "icons": kept("icons", list), "_meta": kept("_meta", dict)}
    if kept("annotations", dict):
        entry["annotations"] = tool["annotations"]
    return entry


def changed_parts(pinned, live):
    """Which PINNED_PARTS of `live` differ from `pinned` (manifest entries): the one definition
    of a change. A pin of 0.2.0 or older (no "title") is compared on EARLY_PARTS only."""
    early = "title" not in pinned
    return [part for part, key in PINNED_PARTS if (not early or part in EARLY_PARTS)
            and compared_part(pinned, key, pinned) != compared_part(live, key, pinned)]


def compared_part(entry, key, pinned):
    value = entry.get(key)
    if "title" not in pinned and key == "annotations" and isinstance(value, dict):
        value = {k: value[k] for k in ANNOTATION_KEYS if k in value} or None
    return value


# Lint severities (section 20): a high finding refuses a tool unless its rule's
# accepted_description is the lint_hash of exactly the texts the lint read.
LINT_HIGH, LINT_MEDIUM = "high", "medium"


def tool_titles(entry):
    """(where, text) of a tool's titles: its own and its annotations' (the older place)."""
    annotations = entry.get("annotations") if isinstance(entry.get("annotations"), dict) else {}
    return [(where, title) for where, title in (("title", entry.get("title")), (
        "annotations title", annotations.get("title"))) if isinstance(title, str)]


def lint_hash(entry):
    """Every text the lint reads, by hash; without a title, as before titles were read, so
    what was accepted stays so."""
    texts = {"description": entry.get("description") or "",
             "input_schema": entry.get("input_schema")}
    titles = dict(tool_titles(entry))
    return content_hash({**texts, "titles": titles} if titles else texts)


STATUS_CLASH = "the status tool"


def load(server, manifest, upstream, live, deadline, taken, findings, report):
    """A connected server's offered tools; `taken` maps the names already offered to holders."""
    pinned = manifest["tools"]
    for name in sorted(set(live) - set(pinned)):
        report.unpinned(name)
    tools = []
    for name in sorted(pinned):
        found = findings.get(name, [])
        tool = _load_tool(server, upstream, pinned[name], live.get(name), deadline, taken,
                          report, found)
        if tool:
            tools.append(tool)
        report.lint(found)
    return tools


def _load_tool(server, upstream, entry, live, deadline, taken, report, found):
    """One pinned tool: registered (returned, `taken` updated) or reported why not."""
    name = entry["name"]
    rule = server.rules.get(name)
    if rule is None:
        report.unclassified(name)
        return None
    if rule.proposed:
        report.unreviewed(entry, rule)
        return None
    if deadline.left() <= 0:
        raise UpstreamError(upstream.describe("load", "timed out after " +
                                              format_duration(deadline.ns)))
    live_entry = None if live is None else manifest_entry(live)
    mismatch = hint_mismatch(rule.side_effect, entry, live_entry) if live_entry else ""
    reason = refusal(server, entry, live_entry, rule, found, mismatch)
    if not reason:
        tool = Tool(server, upstream, entry, rule)
        if tool.name in taken:
            if taken[tool.name] is STATUS_CLASH:
                raise ConfigError(f"server {quote(server.name)}: tool {quote(name)} "
                                  f"registers as {tool.name}, the status tool's name: rename "
                                  f"one (status_tool or the rule's rename)")
            reason = f"the name {quote(tool.name)} is already taken by {taken[tool.name]}"
    if reason:
        report.refused(name, reason)
        return None
    taken[tool.name] = f"tool {quote(name)} of server {quote(server.name)}"
    report.registered(tool, mismatch)
    return tool


def refusal(server, entry, live_entry, rule, found, mismatch):
    """Why a classified tool is not offered, or ''; `found`: the lint's findings."""
    if live_entry is None:
        return "the server no longer offers it"
    changed = changed_parts(entry, live_entry)
    if "input schema" in changed:
        return "the input schema changed since the pin"
    if "description" in changed:
        return "the description changed since the pin, and a description is model input"
    if mismatch and not rule.allow_hint_mismatch:
        return mismatch
    if changed:
        return f"its {', '.join(changed)} changed since the pin (pin -diff shows how)"
    name = offered_name(server, entry["name"], rule)
    if not NAME_RE.fullmatch(name):
        return f"the name {quote(name)} does not match ^[a-zA-Z0-9_-]{{1,64}}$: set rename"
    schema = entry.get("input_schema")
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return 'its input schema is not an object schema ("type": "object")'
    outside = reaches_outside(schema)
    if outside:
        return outside
    high = [f"{what} in the {where}" for severity, what, where in found if severity == LINT_HIGH]
    if high and rule.accepted_description != lint_hash(entry):
        return (f"the lint finds what may be instructions hidden from you ({sanitize(high[0])}"
                f"{f', and {len(high) - 1} more' if len(high) > 1 else ''}); read the whole text "
                f"pin printed, and if the model may read it, set the rule's accepted_description "
                f"to \"{lint_hash(entry)}\"")
    try:
        hiding = hiding_problem(schema, rule)
        if hiding:
            return hiding
        problem = schema_problem(schema) or schema_problem(
            restrict_schema(schema, rule.deny + list(rule.fixed)))
    except Exception as err:  # a shape no check foresaw: refuse the tool, never the gate
        problem = f"it could not be read ({type(err).__name__})"
    if problem:
        return f"the validator refuses its input schema: {sanitize(problem)}"
    return policy_pointer_problem(schema, rule, name)


def hint_mismatch(side_effect, entry, live_entry):
    annotations, prefix = entry.get("annotations"), ""
    if annotations is None and live_entry.get("annotations") is not None:
        annotations, prefix = live_entry["annotations"], "the server now says: "
    if annotations is None:
        return ""
    if side_effect == "read_only" and annotations.get("readOnlyHint") is not True:
        return f"{prefix}classified read_only, but the server does not claim readOnlyHint"
    if side_effect != "destructive" and annotations.get("readOnlyHint") is not True \
            and annotations.get("destructiveHint") is True:
        return f"{prefix}classified {side_effect}, but the server claims destructiveHint"
    return ""


_DRAFT_RE = re.compile(r"https?://json-schema\.org/(draft-0[467]/schema|draft/2019-09/schema|"
                       r"draft/2020-12/schema|schema)#?")


def _members(value, pointer=""):
    """(container, key, member, container's pointer) of each member of a JSON value, in
    document order; a list's key is its index, no keyword."""
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for key, member in items:
        yield value, key, member, pointer
        yield from _members(member, f"{pointer}/{key}")


def reaches_outside(schema):
    """Why the schema could make a validator read outside it, or ''."""
    for parent, key, value, pointer in _members(schema):
        bad = isinstance(value, str) and (
            (key in ("$ref", "$dynamicRef", "$recursiveRef") and not value.startswith("#"))
            or (key == "$id" and not value.startswith("#") and not _DRAFT_RE.fullmatch(value))
            or (key == "$schema" and not _DRAFT_RE.fullmatch(value))
            or (key == "id" and isinstance(parent.get("$schema"), str)
                and "draft-04" in parent["$schema"] and (":" in value or value.startswith("//"))))
        if bad:
            return (f"the input schema's {key} at {pointer or '/'} is {quote(value)}, which "
                    f"could make a validator read outside it")
    return ""


_HIDING_KEYWORDS = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentRequired",
                    "dependentSchemas", "dependencies", "$defs", "definitions")


def hiding_problem(schema, rule):
    hidden = rule.deny + list(rule.fixed)
    properties = schema.get("properties", {})
    for name in hidden:
        if not isinstance(properties, dict) or name not in properties:
            return f"the rule hides {quote(name)}, which is not a top-level property of the " \
                   f"input schema"
        if "patternProperties" in schema:
            return f"the rule hides {quote(name)}, but the input schema has patternProperties"
        for keyword in _HIDING_KEYWORDS:
            if keyword in schema and (schema[keyword] == name or any(
                    name in (key, member) for _, key, member, _ in _members(schema[keyword]))):
                return f"the rule hides {quote(name)} and the input schema's {keyword} " \
                       f"mentions it"
    return ""


# =============================================================================================
# 6. Answers
#
# Reads as: decision core
#
# Owns: every sentence of the gate's the model can read (the tables), a call's evaluation with
# its approval and hash, the check of its arguments, and what of a result is passed on.
# Promises: an approval's hash covers exactly what it binds and shows; re-running an unknown
# outcome always needs an operator. A result reaches the host as the server answered it (told
# again, sanitized), and section 19 records exactly what the model got. Nothing the model sees
# names the operator command, the database, the config or a run id.
# =============================================================================================

APPROVAL_COLUMNS = ("id", "run_id", "step_id", "kind", "capability_json", "presentation_json",
                    "request_json", "hash", "status", "created_at", "expires_at", "decided_at",
                    "decided_by", "note")

# What of a tools/call result reaches the host: every field MCP gives one.
RESULT_FIELDS = ("content", "structuredContent", "isError", "_meta")

# How both answers on an unknown outcome end.
_RERUN_DECIDED = (
    " whether it runs again (approval {approval}). Nothing further was executed. Do not call "
    "again until you are told it was approved, and do not use another tool to do the same "
    "thing; tell the user. If it is approved, call again with exactly the same arguments.")
# The gate's answers to a call; what others chose is cleaned before it fills a slot.
PROSE = {
    "PENDING_APPROVAL": (
        "This request is waiting for an operator's approval (approval {approval}). Nothing has "
        "been executed. Do not call this tool again until you are told the request was "
        "approved, and do not try another tool to do the same thing. Tell the user it is "
        "waiting, with its approval id: it is approved or refused outside this conversation, "
        "by the user or whoever else operates the tools. Once it is approved, call the tool "
        "again with exactly the same arguments to run it and get the result.{limit}"),
    "DENIED": "The policy does not allow this request: {reason}. Nothing was executed.",
    "TOOL_CHANGED": (
        "Its server now presents this tool differently from when it was reviewed (its "
        "description, input schema or annotations changed, or it is gone), or said it changed "
        "and could not be asked how, so it is not offered until it is again as it was "
        "reviewed. Nothing was executed. Tell the user."),
    "INVALID": "The arguments do not match the tool's input schema: {reason}. Nothing was "
               "executed. Correct the arguments and call again.",
    "REJECTED": (
        "An operator rejected this exact request (approval {approval}){note}. It was not "
        "executed. An identical request is refused until {until}. Do not ask again; tell the "
        "user."),
    "CANCELLED": "An operator cancelled this exact request{note}. Nothing further was executed. An "
                 "identical request is refused until {until}. Tell the user.",
    "EXPIRED": (
        "The approval for this exact request (approval {approval}) expired before it was used. "
        "It was not executed. An identical request is refused until {until}. Tell the user."),
    "DUPLICATE": (
        "This exact request already executed at {at} and is not executed again: an identical "
        "call to this tool within {window} of an earlier one is refused, whether or not it is a "
        "retry. Its outcome was: {outcome}"),
    "IN_PROGRESS": (
        "This exact request is already executing, or the outcome of an attempt is not yet "
        "known. Nothing new was started. Wait a little, then call again with exactly the same "
        "arguments."),
    "BLOCKED_PENDING": (
        "{waiting} for an operator's approval, the most this session allows. Nothing was "
        "executed and no approval was requested. Tell the user and wait for the operator."),
    "UNKNOWN_OUTCOME": (
        "An attempt of this exact request {how}{error}, so whether it took effect is unknown: "
        "it may have. An operator must decide" + _RERUN_DECIDED),
    "INTERRUPTED": (
        "An earlier attempt of this exact request was cut off while it was executing, and its "
        "outcome is unknown: it may have taken effect. An operator decides" + _RERUN_DECIDED),
    "BLOCKED_UNKNOWN": (
        "An earlier call to {tool} may have taken effect and its outcome is unknown (approval "
        "{approval}), so no other call to {tool} that changes anything runs until an operator "
        "decides. Nothing was executed. Tell the user."),
    "UNRECORDED": (
        "The server answered this request, so it executed, but its answer could not be "
        "recorded ({reason}). What it did is unknown here and it may have taken effect. Do not "
        "call again to retry{window}. Tell the user."),
    "UNAVAILABLE": "The gate could not read or write its records: {what}. Tell the user.",
    "HOST_CANCELLED": "The call was cancelled before it was executed. Nothing was executed.",
    # An error result, so the model never takes it for what the tool returns.
    "RESULT_TOO_LARGE": (
        "The server answered this request with {what} of {size} bytes ({blocks}), more than "
        "the {cap} bytes that are passed on, so it is not shown. {then} Tell the user."),
}
TOO_LARGE_THEN = {
    "read": "A read changes nothing: asking for less (a smaller range, page or size) may fit.",
    "mutating": "It was executed and is not executed again: do not call again to retry{window}.",
}
HOW = {"timed_out": "timed out before the server answered",
       "no_answer": "failed without an answer from the server",
       "cut_off": "was cut off before its outcome was recorded"}
DUPLICATE_OUTCOME = {
    "ok": "it succeeded, with this result: {text}",
    "unrecorded": "the server answered, but its result could not be recorded: {text}",
    "error": "it failed, with this error: {text}",
}
SLOT_PROSE = {
    "limit": " It waits because a limit is reached: {limit}; {frees}.",
    "refused_for": "; an identical call within {window} is refused as a duplicate",
    "sent_unrecorded": "the request was sent to the server, but what came of it could not be "
                       "recorded",
    "nothing_executed": "nothing was executed",
    "host_cancelled": "the host cancelled the call before it was sent",
    "unreadable": "the gate could not read its records; nothing was executed",
    "altered": "its approval record was altered after it was made",
    "one_waits": "1 request already waits",
    "some_wait": "{count} requests already wait",
    "an_error": "an error",
    "a_result": "a result",
    "status_arguments": "the only argument is approval_id, a string",
    "arguments_too_large": "the arguments are {size} bytes, more than the {cap} this gate accepts",
    "unusable_arguments": "the arguments are not usable JSON: {error}",
    "unreadable_result": "the server's result could not be read: {error}",
    "holding": "waiting for an operator's approval",
}

# The status tool's words (section 24 picks among them).
STATUS_DESCRIPTION = (
    "Reports which requests of this session wait for an operator's approval, or, given the "
    "approval id a pending answer named, what became of that request: pending, approved, "
    "executed, rejected or expired. It only reads; it never runs or approves anything.")
STATUS_ARGUMENT = "The approval id a pending result named."
# How many servers are unserved, never which nor why (the operator's to know).
UNSERVED_NOTE = ("Also, {count} of the servers behind this gate could not be served, so "
                 "their tools are not offered; the person running the gate has been told why.")
DOWN_NOTE = ("Server {server} is down: {down}. Calls to its tools fail without executing "
             "until it is back.")
STATUS_PROSE = {
    "unknown_id": "no approval {approval} is known in this session from the last hour.",
    "none_waiting": "no request in this session is waiting for an operator's approval.",
    "one_waiting": "1 request in this session is waiting for an operator's approval:\n{lines}",
    "some_waiting": (
        "{count} requests in this session are waiting for an operator's approval:\n{lines}"),
    "head": "approval {approval} for {tool} {args}",
    "expired_undecided": "{head}: EXPIRED without a decision. It was not executed.",
    "outcome_unknown": (
        "{head}: OUTCOME UNKNOWN, waiting {age} for an operator to decide whether it runs "
        "again: an earlier attempt may have taken effect. Nothing further has been executed."),
    "pending": "{head}: PENDING for {age}. Nothing has been executed; an operator decides outside "
               "this conversation. Do not call again until it is approved.",
    "rejected": "{head}: REJECTED by the operator.{note} It was not executed; do not ask again.",
    "rejected_note": " The operator's note: {note}.",
    "expired": "{head}: EXPIRED. It was not executed.",
    "executing": "APPROVED and executing now.",
    "succeeded": "APPROVED and executed, and it succeeded.",
    "unrecorded": "APPROVED and executed, and the server answered, but its result could not be "
                  "recorded ({error}); it may have taken effect.",
    "failed": "APPROVED and executed, and the server reported a failure: {error}.",
    "unknown": "APPROVED and executed, but it {how}, so whether it took effect is unknown: it may "
               "have. {then}",
    "rerun_waits": "Approval {approval} now waits for an operator to decide whether it runs again.",
    "no_rerun": "No approval to run it again is waiting now.",
    "superseded": "APPROVED, and then a different approval was asked for the same call (approval "
                  "{approval}).",
    "uncollected": "APPROVED, awaiting collection. Call {tool} again with exactly the same "
                   "arguments to run it and get the result.",
    "not_executed": "APPROVED but not executed: {why}.",
}
NOT_EXECUTED_WHY = {
    "operator_cancelled": "an operator cancelled it",
    "approval_expired": "the approval expired before it was collected",
    "denied_on_resume": "the policy denied it when it was collected",
    "invalid_on_resume": "its arguments no longer matched the tool's schema when it was collected",
    "ended": "its run ended ({reason})",
}
# JSON-RPC errors to a tools/call: a host shows their message to the model.
CALL_ERRORS = {
    "failed": "the gate failed while handling this request and cannot say whether it executed; "
              "tell the user before calling again",
    "unknown_tool": "unknown tool {name}",
    "busy": "the gate is busy: {limit} requests are already in flight, and this one was not "
            "started; try again shortly",
    "stopping": "the gate is shutting down",
    "unloaded": "the gate's tools could not be loaded",
}
IS_ERROR = {"DENIED", "INVALID", "BLOCKED", "REJECTED", "EXPIRED", "DUPLICATE", "UNAVAILABLE",
            "RESULT_TOO_LARGE", "CANCELLED"}


GATE_MARK = "gate/answer"


class Answer:
    """A tools/call's answer: the gate's prose as one text block, or a server's result whole."""

    def __init__(self, text, is_error=False, passed=None, mark="FAILED"):
        self.text, self.is_error, self.passed = text, is_error, passed
        self.mark = mark  # its prefix; FAILED: a call that came to no result

    def result(self):
        if self.passed is not None:
            return self.passed
        # The mark a host may read to tell the gate's answer from a server's result, which
        # may hold the same words; it names neither the program nor its commands.
        result = {"content": [{"type": "text", "text": self.text}],
                  "_meta": {GATE_MARK: self.mark}}
        if self.is_error:
            result["isError"] = True
        return result


def answer(prefix, key=None, **slots):
    text = PROSE[key or prefix].format(**slots)
    return Answer(f"{prefix}: {text}", prefix in IS_ERROR, mark=prefix)


def gate_status(key, **slots):
    return Answer("GATE_STATUS: " + STATUS_PROSE[key].format(**slots),
                  mark="GATE_STATUS")


def passed_answer(passed):
    """A server's result, or its JSON-RPC error ({"error": ...}), as it came."""
    if "error" in passed:
        return Answer(passed["error"]["message"], True, passed)
    return Answer("\n".join(b["text"] for b in passed["content"] if b["type"] == "text" and
                            isinstance(b.get("text"), str)), passed.get("isError") is True, passed)


def note_text(note):
    return f", with this note: {cut(quote(note), 500)}" if note else ""


def waiting_answer(approval):
    """What a call is told while its request waits on an approval."""
    if approval["kind"] != "interrupted_side_effect":
        presentation = parse(approval["presentation_json"])
        limit = SLOT_PROSE["limit"].format(limit=clean(presentation["limit"], 300),
                                           frees=presentation["frees"]) \
            if "limit" in presentation else ""
        return answer("PENDING_APPROVAL", approval=approval["id"], limit=limit)
    ended = parse(approval["capability_json"]).get("interrupted", {}).get("ended", "cut_off")
    if ended == "cut_off":
        return answer("INTERRUPTED", approval=approval["id"])
    return answer("UNKNOWN_OUTCOME", how=HOW[ended], error="", approval=approval["id"])


def refused_for(window):
    return SLOT_PROSE["refused_for"].format(window=format_duration(window)) if window \
        else ""


def too_large_answer(tool, record, cap, window):
    then = TOO_LARGE_THEN["read"] if tool.read_only else \
        TOO_LARGE_THEN["mutating"].format(window=refused_for(window))
    what = SLOT_PROSE["an_error" if record.get("is_error") else "a_result"]
    return answer("RESULT_TOO_LARGE", what=what, size=record["bytes"], cap=cap,
                  blocks=clean(", ".join(block_labels(record)), 500), then=then)


# A constant: the decision at the pause and at collection hash alike.
INTERRUPTED_REASON = "interrupted while executing; outcome unknown"


def evaluate(config, tool, args, facts, attempt=None, approved=False, judged=None):
    """The policy's decision (section 3), with what an approval binds (capability) and shows
    (presentation). Re-running an unknown outcome (`attempt`) always needs an operator."""
    decision = policy_decision(config, tool, args, facts, rerun=bool(attempt),
                               approved=approved, judged=judged)
    outcome = decision["outcome"]
    if outcome == "deny" or (outcome == "allow" and not attempt):
        return decision
    capability = {"server": tool.server.name, "tool": tool.upstream_name, "name": tool.name,
                  "side_effect": tool.side_effect, "args": args}
    if tool.rule.fixed:
        capability["fixed"] = tool.rule.fixed
    if attempt:
        capability["interrupted"] = attempt
        notice = (f"An earlier attempt started at {attempt['started_at']} in run "
                  f"{attempt['run_id']} {HOW[attempt['ended']]}, so it may have taken effect. "
                  f"Approving runs it again when the model calls again; rejecting ends this "
                  f"request, and a later identical call asks an operator again whatever the "
                  f"policy says.")
        question = f"Run {tool.upstream_name} on server {tool.server.name} again with these " \
                   f"arguments?"
        return {"outcome": "require_approval", "reason": INTERRUPTED_REASON,
                "by": decision["by"], "kind": "interrupted_side_effect", "capability": capability,
                "presentation": {**capability, "notice": notice, "reason": INTERRUPTED_REASON,
                                 "question": question}}
    question = (f"May the model call {tool.upstream_name} on server {tool.server.name} with "
                f"these arguments?")
    presentation = {**capability, "question": question, "reason": decision["reason"]}
    if decision["by"] not in ("class", "rule outcome"):
        # What decided is part of what is approved. When a limit frees up is fixed by the
        # history before the decision, so recheck, reading it, hashes alike.
        presentation["decided_by"] = decision["by"]
        if "limit" in decision:
            presentation.update(limit=decision["limit"], frees=frees_text(decision))
    decision.update(kind=tool.side_effect, capability=capability, presentation=presentation)
    return decision


def approval_hash(kind, capability, presentation, request):
    return content_hash({"kind": kind, "capability": capability, "presentation": presentation,
                         "request": request})


def new_approval(config, run_id, step_id, tool, args, decision):
    """A pending approval in its one shape, its row as Store.read_approvals reads it."""
    request = {"run_id": run_id, "step_id": step_id, "spec": tool.spec, "args": args}
    created = now()
    return dict(
        dict.fromkeys(APPROVAL_COLUMNS, ""), id=new_id(16), run_id=run_id, step_id=step_id,
        kind=decision["kind"], capability_json=dumps(decision["capability"]),
        presentation_json=dumps(decision["presentation"]), request_json=dumps(request),
        hash=approval_hash(decision["kind"], decision["capability"], decision["presentation"],
                           request),
        status="pending", created_at=created,
        expires_at=later(created, config.approval_ttl) if config.approval_ttl else "")


def stored_hash(row):
    """An approval row's hash from its stored fields; a tampered row differs."""
    try:
        return approval_hash(row["kind"], parse(row["capability_json"]),
                             parse(row["presentation_json"]), parse(row["request_json"]))
    except CanonicalError:
        return ""


def judged_request(tool, args, work=None):
    """A request's Judgement with its schema check made (on `work`, the call's PatternWork)."""
    work = PatternWork() if work is None else work
    return Judgement(check_arguments(tool, args, work), work)


def check_arguments(tool, args, work=None):
    """'' when the arguments may be sent, else why not (INVALID)."""
    if not isinstance(args, dict):
        return "the arguments are not a JSON object"
    for name in [*tool.rule.deny, *tool.rule.fixed]:
        if name in args:
            how = "denied" if name in tool.rule.deny else "fixed"
            return f'parameter "{name}" is {how} by the operator'
    try:
        validate(tool.schema, args, work=work)
    except (SchemaError, PatternCost) as err:
        return str(err)
    except Exception:  # a $ref loop, say: what cannot be checked is not sent
        return "the arguments cannot be checked against the schema"
    return ""


def passed_result(tool, result):
    """(what of a result is passed on, '') or (None, why it cannot be used)."""
    if not isinstance(result, dict):
        return None, "the server's result is not an object"
    if result.get("resultType") == "input_required" or "inputRequests" in result:
        return None, f"{tool.name}: the server asked for more input, which the gate does not " \
                     f"support"
    blocks = result.get("content")
    if not isinstance(blocks, list) or not all(
            isinstance(block, dict) and isinstance(block.get("type"), str) for block in blocks):
        return None, "the server's result has no list of content blocks, each with its type"
    return {k: result[k] for k in RESULT_FIELDS if k in result}, ""


# =============================================================================================
# 7. The record
#
# Reads as: decision core
#
# Owns: the SQLite file, every statement that changes it, and the reads the gate decides with
# (what people read besides is section 22's Ledger).
# Promises: WAL, synchronous=FULL, a busy timeout, trusted_schema off; files created 0600 and
# refused when others can write them; every state change commits with its events in one BEGIN
# IMMEDIATE transaction, hash-chained across all runs and processes; what one transaction
# changes in a run is one event. No statement here approves. A database migrated by a newer
# agentgate is refused; a new one is migrated from version 0 by the same SCHEMA as an old one.
# Versions 3 to 5 rewrite nothing (the chain binds the old rows).
# =============================================================================================

SCHEMA = [
    # Version 1. A run is one tools/call; a step is one proposal inside it (the model's call,
    # a re-run, the closing decision). The calls table indexes runs by request: truth is read
    # from the run and its steps. (Runs before version 5 also have an unread result_json.)
    """
    CREATE TABLE runs(id TEXT PRIMARY KEY, session TEXT NOT NULL, tool TEXT NOT NULL,
        status TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '', detail TEXT NOT NULL DEFAULT '',
        step_count INTEGER NOT NULL DEFAULT 0, created_at TEXT NOT NULL,
        finished_at TEXT NOT NULL DEFAULT '', lease_owner TEXT NOT NULL DEFAULT '',
        lease_expires_at TEXT NOT NULL DEFAULT '');
    CREATE TABLE steps(id TEXT PRIMARY KEY, run_id TEXT NOT NULL REFERENCES runs(id),
        idx INTEGER NOT NULL, status TEXT NOT NULL, decision_json TEXT NOT NULL,
        policy_json TEXT NOT NULL DEFAULT '', observation_json TEXT NOT NULL DEFAULT '',
        spec_hash TEXT NOT NULL DEFAULT '', policy_id TEXT NOT NULL DEFAULT '',
        started_at TEXT NOT NULL, finished_at TEXT NOT NULL DEFAULT '', UNIQUE(run_id, idx));
    CREATE TABLE approvals(id TEXT PRIMARY KEY, run_id TEXT NOT NULL REFERENCES runs(id),
        step_id TEXT NOT NULL, kind TEXT NOT NULL, capability_json TEXT NOT NULL,
        presentation_json TEXT NOT NULL, request_json TEXT NOT NULL, hash TEXT NOT NULL,
        status TEXT NOT NULL, created_at TEXT NOT NULL, expires_at TEXT NOT NULL DEFAULT '',
        decided_at TEXT NOT NULL DEFAULT '', decided_by TEXT NOT NULL DEFAULT '',
        note TEXT NOT NULL DEFAULT '');
    CREATE INDEX approvals_run ON approvals(run_id);
    CREATE TABLE tool_specs(hash TEXT PRIMARY KEY, spec_json TEXT NOT NULL);
    CREATE TABLE calls(id INTEGER PRIMARY KEY AUTOINCREMENT, session TEXT NOT NULL,
        request_key TEXT NOT NULL, tool TEXT NOT NULL, side_effect TEXT NOT NULL,
        run_id TEXT NOT NULL UNIQUE, created_at TEXT NOT NULL, open INTEGER NOT NULL DEFAULT 1,
        closed_at TEXT NOT NULL DEFAULT '', settled_at TEXT NOT NULL DEFAULT '',
        outcome INTEGER NOT NULL DEFAULT 0);
    CREATE UNIQUE INDEX calls_open ON calls(session, request_key) WHERE open = 1;
    CREATE INDEX calls_key ON calls(session, request_key, id);
    CREATE INDEX calls_unsettled ON calls(session, settled_at, id);
    CREATE INDEX calls_tool ON calls(session, tool, outcome, id);
    CREATE TABLE events(seq INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL,
        step_id TEXT NOT NULL DEFAULT '', at TEXT NOT NULL, type TEXT NOT NULL,
        payload_json TEXT NOT NULL, hash TEXT NOT NULL);
    CREATE INDEX events_run ON events(run_id, seq);
    """,
    # Version 2. What the limits count (a row per execution; amounts_json is no longer
    # written: a sum reads the step's arguments), and the operators' standing approvals.
    # Version 1's executions are its step.tool_started events, under their calls' tools.
    """
    CREATE TABLE executions(id INTEGER PRIMARY KEY, tool TEXT NOT NULL, at TEXT NOT NULL,
        run_id TEXT NOT NULL, step_id TEXT NOT NULL, amounts_json TEXT NOT NULL DEFAULT '{}');
    INSERT INTO executions(tool, at, run_id, step_id) SELECT c.tool, e.at, e.run_id,
        e.step_id FROM events e JOIN calls c ON c.run_id=e.run_id
        WHERE e.type='step.tool_started' ORDER BY e.seq;
    CREATE INDEX executions_tool ON executions(tool, at);
    CREATE TABLE grants(id TEXT PRIMARY KEY, session TEXT NOT NULL, tool TEXT NOT NULL,
        name TEXT NOT NULL, conditions_json TEXT NOT NULL, created_at TEXT NOT NULL,
        expires_at TEXT NOT NULL, by TEXT NOT NULL, note TEXT NOT NULL DEFAULT '',
        revoked_at TEXT NOT NULL DEFAULT '', revoked_by TEXT NOT NULL DEFAULT '',
        revoke_note TEXT NOT NULL DEFAULT '');
    CREATE INDEX grants_tool ON grants(session, tool, expires_at);
    """,
    "",  # 3: an allowed read is its run and one run.read event: no step row, no calls row
    "",  # 4: an answer is kept as its result_record; older records are read as they are
    "",  # 5: one event per run per transaction (Tx.flush); older events read the same
    # Version 6. The rules across calls read every session's calls of a request or tool.
    """
    DROP INDEX calls_key;
    DROP INDEX calls_tool;
    CREATE INDEX calls_request ON calls(request_key, id);
    CREATE INDEX calls_target ON calls(tool, outcome, id);
    """,
]

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED")
# What a settled calls row says its run's last attempt came to (0 while it is not settled).
OUTCOME_NONE, OUTCOME_KNOWN, OUTCOME_UNKNOWN = 1, 2, 3


class StoreError(Exception):
    """The records could not be read or written (the message says why)."""


class Race(Exception):
    """Another caller changed these records since they were read; decide again."""


ANY_ROW = "any open row"  # a read replaces whatever row is open: reads never race for a key
KeyRun = collections.namedtuple("KeyRun", "run_id status reason detail finished owner expires open")
UNKNOWN_ENDINGS = ("timed_out", "no_answer", "cut_off")
CALL_ENDINGS = ("ok", "error", "unsent", "unrecorded", "timed_out", "no_answer")
LARGE_VALUE_BYTES = 4096

# A run's newest attempt; `attempt` is it as an interruption approval names it.
Attempt = collections.namedtuple("Attempt", "ending observed finished attempt")


def step_outcome(observed):
    """What a recorded step came to, read from its fields in every version, never its prose."""
    kind, content = observed["kind"], observed.get("content", {})
    if kind == "tool_result":
        return "ok"
    if kind == "tool_error":
        return content["ending"]
    if kind == "interrupted":
        return "cut_off" if content.get("previous_status") == "executing" else "interrupted"
    if kind == "policy_denied":
        return "rejected" if "approval_id" in content else "denied"
    return "invalid" if kind == "invalid_decision" else ""


def last_attempt(rows, run_id):
    """The newest attempt of a run's tool call, read through `rows`, or None. A re-run asked
    of an operator and not carried out stands for the attempt its approval names."""
    for step_id, status, observation, started, finished in rows(
            "SELECT id, status, observation_json, started_at, finished_at FROM steps WHERE "
            "run_id=? AND json_extract(decision_json, '$.kind')='tool_call' ORDER BY idx DESC",
            (run_id,)):
        attempt = {"run_id": run_id, "step_id": step_id, "started_at": started}
        observed = parse(observation) if observation else None
        ending = step_outcome(observed) if observed else ""
        if status == "executing" or ending == "cut_off":
            return Attempt("cut_off", None, finished, {**attempt, "ended": "cut_off"})
        if ending == "unsent":  # no byte reached the server: no attempt
            continue
        if ending in CALL_ENDINGS:
            return Attempt(ending, observed, finished, {**attempt, "ended": ending})
        asked = rows("SELECT capability_json FROM approvals WHERE step_id=? AND "
                     "kind='interrupted_side_effect' ORDER BY rowid DESC LIMIT 1", (step_id,))
        if asked:
            prior = parse(asked[0][0])["interrupted"]
            return Attempt(prior["ended"], None, finished, prior)
    return None


def kept_once(value):
    """A value as an event carries it: a string past LARGE_VALUE_BYTES as its size and hash,
    since its step or approval row keeps it whole; the chain still binds every byte."""
    if isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        return value_digest(data) if len(data) > LARGE_VALUE_BYTES else value
    if isinstance(value, dict):
        return {key: kept_once(item) for key, item in value.items()}
    if isinstance(value, list):
        return [kept_once(item) for item in value]
    return value


def event_hash(prev, seq, run_id, step_id, at, type_, payload):
    """Each event's hash covers the previous one's and its own fields as stored, as netstrings."""
    fields = (prev, str(seq), run_id, step_id, at, type_, payload)
    data = [field.encode("utf-8", "surrogatepass") for field in fields]
    return sha256_hex(b"".join(b"%d:%s," % (len(field), field) for field in data))


class Tx:
    """One write transaction: statements, and the events that commit with them."""

    def __init__(self, db):
        self.db = db
        self.execute = db.execute  # inside the writer's open transaction
        self.parts = {}  # run id -> its parts of the record so far
        # Read under the write lock, so two processes extend one chain. The next seq follows
        # every seq ever used (a deleted tail leaves a gap verify reports).
        used, newest, digest = db.execute(
            "SELECT (SELECT seq FROM sqlite_sequence WHERE name='events'), "
            "(SELECT seq FROM events ORDER BY seq DESC LIMIT 1), "
            "(SELECT hash FROM events ORDER BY seq DESC LIMIT 1)").fetchone()
        self.head = (max(used or 0, newest or 0), digest or "")

    def rows(self, sql, args=()):
        return self.db.execute(sql, args).fetchall()

    def event(self, run_id, type_, payload, step_id=""):
        seq, prev = self.head[0] + 1, self.head[1]
        at, body = now(), dumps(payload)
        digest = event_hash(prev, seq, run_id, step_id, at, type_, body)
        self.db.execute("INSERT INTO events(seq, run_id, step_id, at, type, payload_json, hash)"
                        " VALUES(?,?,?,?,?,?,?)", (seq, run_id, step_id, at, type_, body, digest))
        self.head = (seq, digest)

    def part(self, run_id, type_, payload, step_id=""):
        self.parts.setdefault(run_id, []).append([type_, step_id, payload])

    def flush(self):
        """Chain each run's parts as one event: a part alone as itself, several as one
        call.began, call.changed or call.ended event (event_parts, section 22, reads both)."""
        for run_id, parts in self.parts.items():
            if len(parts) == 1:
                type_, step_id, payload = parts[0]
                self.event(run_id, type_, payload, step_id)
                continue
            types = [part[0] for part in parts]
            type_ = ("call.began" if types[0] == "run.created" else "call.ended"
                     if "run.finished" in types or "step.tool_finished" in types else
                     "call.changed")
            self.event(run_id, type_, {"parts": parts},
                       next((part[1] for part in parts if part[1]), ""))

    # -- state changes: each writes its rows and its events, inside the caller's transaction --

    def begin_run(self, run_id, session, tool, target, key, side_effect, tool_hashes, lease,
                  seen):
        """Claim the request's calls row and begin its run, both or neither. Race unless the open
        row, in any session, is still `seen` and its run ended: a run of the key begun since,
        anywhere, wins."""
        at = now()
        row = self.execute("SELECT c.run_id, r.status FROM calls c JOIN runs r ON r.id = "
                           "c.run_id WHERE c.request_key=? AND c.open=1 ORDER BY c.id DESC",
                           (key,)).fetchone()
        if seen is not ANY_ROW and ((row[0] if row else None) != seen
                                    or (row and row[1] not in TERMINAL)):
            raise Race()
        self.execute("UPDATE calls SET open=0, closed_at=? WHERE request_key=? AND open=1",
                     (at, key))
        self.execute("INSERT INTO calls(session, request_key, tool, side_effect, run_id, "
                     "created_at) VALUES(?,?,?,?,?,?)", (session, key, target, side_effect,
                                                          run_id, at))
        self.execute("INSERT INTO runs(id, session, tool, status, created_at, lease_owner, "
                     "lease_expires_at) VALUES(?,?,?,?,?,?,?)",
                     (run_id, session, tool, "RUNNING", at, lease[0], lease[1]))
        self.part(run_id, "run.created", {"goal": f"call {tool}", "tools": tool_hashes})
        self.part(run_id, "run.started", {})

    def keep_spec(self, tool):
        self.execute("INSERT OR IGNORE INTO tool_specs(hash, spec_json) VALUES(?,?)",
                     (tool.spec_hash, tool.spec_json))
        return tool.spec_hash

    def start_step(self, run_id, decision, tool=None):
        step_id = new_id(16)
        index = self.execute("SELECT step_count FROM runs WHERE id=?", (run_id,)).fetchone()[0]
        self.execute("UPDATE runs SET step_count=step_count+1 WHERE id=?", (run_id,))
        spec_hash = self.keep_spec(tool) if tool is not None else ""
        self.execute("INSERT INTO steps(id, run_id, idx, status, decision_json, spec_hash, "
                     "started_at) VALUES(?,?,?,?,?,?,?)", (step_id, run_id, index, "deciding",
                                                          dumps(decision), spec_hash, now()))
        self.part(run_id, "step.started", {"index": index}, step_id)
        self.part(run_id, "step.decided", kept_once(decision), step_id)
        return step_id

    def record_policy(self, run_id, step_id, policy, policy_id):
        self.execute("UPDATE steps SET policy_json=?, policy_id=? WHERE id=?",
                     (dumps(policy), policy_id, step_id))
        spec_hash = self.execute("SELECT spec_hash FROM steps WHERE id=?",
                                 (step_id,)).fetchone()[0]
        self.part(run_id, "step.policy", {**policy, "policy_id": policy_id,
                                          "spec_hash": spec_hash}, step_id)

    def end_step(self, step_id, status, observation=None):
        self.execute("UPDATE steps SET status=?, observation_json=?, finished_at=? WHERE id=?",
                     (status, dumps(observation) if observation else "", now(), step_id))

    def fail_step(self, run_id, step_id, observation, detail):
        self.end_step(step_id, "failed", observation)
        self.part(run_id, "step.failed", {"detail": detail, "observation": observation},
                  step_id)

    def finish_run(self, run_id, status, reason, detail, extra=None, outcome=None):
        """End a run (a closing step first unless it completed) and settle its calls row.
        Without `outcome` nothing executed: it is the last attempt's, so a rejected or expired
        re-run leaves an unknown outcome open. A run already ended (a cancel) raises Race."""
        current, steps = self.execute("SELECT status, step_count FROM runs WHERE id=?",
                                      (run_id,)).fetchone()
        if current in TERMINAL:
            raise Race()
        if outcome is None:
            attempt = last_attempt(self.rows, run_id)
            outcome = (OUTCOME_NONE if attempt is None else OUTCOME_UNKNOWN
                       if attempt.ending in UNKNOWN_ENDINGS else OUTCOME_KNOWN)
        if status != "COMPLETED":
            step_id = self.start_step(run_id, {"kind": "fail", "message": detail,
                                               "origin": "operator"})
            self.end_step(step_id, "done")
            steps += 1
        self.execute("UPDATE runs SET status=?, reason=?, detail=?, finished_at=?, "
                     "lease_owner='', lease_expires_at='' WHERE id=?",
                     (status, reason, detail, now(), run_id))
        self.part(run_id, "run.finished", {"status": status, "reason": reason,
                                           "detail": detail, "steps": steps, **(extra or {})})
        self.execute("UPDATE calls SET settled_at=?, outcome=? WHERE run_id=?",
                     (now(), outcome, run_id))

    def pause(self, run_id, step_id, approval):
        """Wait for an operator: the run without a lease, the approval row with its hash. A
        run an operator ended meanwhile stays ended (Race)."""
        waits = self.execute("UPDATE runs SET status='WAITING_FOR_APPROVAL', lease_owner='', "
                             "lease_expires_at='' WHERE id=? AND status IN ('RUNNING', "
                             "'WAITING_FOR_APPROVAL')", (run_id,))
        if waits.rowcount != 1:
            raise Race()
        self.execute("UPDATE steps SET status='awaiting_approval' WHERE id=?", (step_id,))
        self.execute(f"INSERT INTO approvals({', '.join(APPROVAL_COLUMNS)}) VALUES("
                     f"{', '.join('?' * len(APPROVAL_COLUMNS))})",
                     tuple(approval[c] for c in APPROVAL_COLUMNS))
        presentation = parse(approval["presentation_json"])
        self.part(run_id, "approval.requested", {
            "approval_id": approval["id"], "kind": approval["kind"],
            "reason": presentation.get("reason", ""),
            "capability": kept_once(parse(approval["capability_json"])),
            "presentation": kept_once(presentation), "hash": approval["hash"]}, step_id)

    def resume(self, run_id, approval_id, lease):
        """A run whose newest approval was granted runs again, under this process's lease."""
        changed = self.execute(
            "UPDATE runs SET status='RUNNING', lease_owner=?, lease_expires_at=? "
            "WHERE id=? AND status='WAITING_FOR_APPROVAL' AND (SELECT id, status FROM approvals "
            "WHERE run_id=? ORDER BY rowid DESC LIMIT 1) = (?, 'approved')",
            (*lease, run_id, run_id, approval_id))
        if changed.rowcount != 1:
            raise Race()
        self.part(run_id, "run.resumed", {"approval_id": approval_id})

    def start_execution(self, run_id, step_id, tool, args, target, approval_id=""):
        """From here the step's outcome may be unknown; the execution row makes every
        process's limits count it (as `target`) from this commit on."""
        self.execute("UPDATE steps SET status='executing' WHERE id=?", (step_id,))
        self.execute("INSERT INTO executions(tool, at, run_id, step_id) VALUES(?,?,?,?)",
                     (target, now(), run_id, step_id))
        payload = {"tool": tool, "args": kept_once(args)}
        if approval_id:
            payload["approval_id"] = approval_id
        self.part(run_id, "step.tool_started", payload, step_id)

    def finish_execution(self, run_id, step_id, tool, observation, duration_ms):
        # The event names the outcome; the step row keeps it whole.
        record = observation.get("result")
        said = ({"summary": observation["summary"], "bytes": record["bytes"],
                 "sha256": record["sha256"]} if record else
                {"error": observation["content"]["error"]})
        self.part(run_id, "step.tool_finished", {"tool": tool, "duration_ms": duration_ms,
                                                 **said}, step_id)
        if observation["kind"] != "tool_result":
            self.fail_step(run_id, step_id, observation, observation["summary"])
            return
        self.end_step(step_id, "done", observation)
        self.finish_run(run_id, "COMPLETED", "goal_completed", f"terminal tool {tool}",
                        outcome=OUTCOME_KNOWN)

    def waiting(self, session):
        """How many of the session's questions wait for an operator, unexpired."""
        return self.execute(
            "SELECT count(*) FROM calls c JOIN runs r ON r.id = c.run_id JOIN approvals a ON "
            "a.run_id = r.id WHERE c.session=? AND c.settled_at='' AND "
            "r.status='WAITING_FOR_APPROVAL' AND a.status='pending' AND (a.expires_at='' OR "
            "a.expires_at>?) AND a.rowid = (SELECT max(rowid) FROM approvals b WHERE "
            "b.run_id=r.id)", (session, now())).fetchone()[0]

    def run_holder(self, run_id):
        """(status, lease owner) of a run, read inside the transaction that acts on it."""
        return self.execute("SELECT status, lease_owner FROM runs WHERE id=?",
                            (run_id,)).fetchone()

    def step_started(self, step_id):
        return self.execute("SELECT started_at FROM steps WHERE id=?", (step_id,)).fetchone()[0]

    def take_over(self, run_id, lease):
        """Take the lease of a run whose owner stopped renewing it, every step it cut off
        marked interrupted; (step_id, started_at) of one cut off executing, or None."""
        row = self.execute("SELECT lease_owner, lease_expires_at FROM runs WHERE id=? AND "
                           "status='RUNNING'", (run_id,)).fetchone()
        # Another process's live lease is refused, not this one's: it takes over only runs it
        # is not executing (Gate.active), so its own lease means a failed write stranded it.
        if row is None or (row[0] and row[1] > now() and row[0] != lease[0]):
            raise Race()
        self.execute("UPDATE runs SET lease_owner=?, lease_expires_at=? WHERE id=?",
                     (lease[0], lease[1], run_id))
        if row[0]:
            self.part(run_id, "lease.taken_over", {
                "previous_owner": row[0], "previous_expires_at": row[1], "owner": lease[0]})
        cut_step = None
        for step_id, status, started in self.execute(
                "SELECT id, status, started_at FROM steps WHERE run_id=? AND status IN "
                "('deciding', 'executing') ORDER BY idx", (run_id,)).fetchall():
            observation = {"kind": "interrupted", "content": {"previous_status": status},
                           "summary": f"step interrupted while {status}"}
            self.end_step(step_id, "interrupted", observation)
            self.part(run_id, "step.interrupted", {"previous_status": status}, step_id)
            if status == "executing":
                cut_step = (step_id, started)
        return cut_step

    def decide_approval(self, approval_id, shown_hash, status, by, note):
        """An operator's decision, bound to the hash of exactly what they were shown:
        'decided', 'changed' (not pending, or not what was shown) or 'expired'."""
        row = self.execute("SELECT a.run_id, a.step_id, a.expires_at FROM approvals a JOIN "
                           "runs r ON r.id = a.run_id WHERE a.id=? AND a.status='pending' AND "
                           "a.hash=? AND r.status='WAITING_FOR_APPROVAL'",
                           (approval_id, shown_hash)).fetchone()
        if row is None:
            return "changed"
        if row[2] and row[2] <= now():
            self.expire_approval(approval_id, row[0], row[1])
            return "expired"
        self._close_approval(row[0], row[1], approval_id, status, by, note)
        if status == "rejected":
            self.fail_step(row[0], row[1], {"kind": "policy_denied", "content": {
                "approval_id": approval_id, "note": note}}, f"rejected by {by}")
            self.finish_run(row[0], "CANCELLED", "approval_rejected", note)
        return "decided"

    def _close_approval(self, run_id, step_id, approval_id, status, by, note):
        self.execute("UPDATE approvals SET status=?, decided_at=?, decided_by=?, note=? "
                     "WHERE id=?", (status, now(), by, note, approval_id))
        self.part(run_id, "approval.decided", {"approval_id": approval_id, "status": status,
                                               "by": by, "note": note}, step_id)

    def expire_approval(self, approval_id, run_id, step_id):
        """A question nobody answered, or a grant nobody collected, in time."""
        changed = self.execute(
            "UPDATE approvals SET status='expired', decided_at=coalesce(nullif(decided_at, ''), ?),"
            " note=coalesce(nullif(note, ''), 'expired') "
            "WHERE id=? AND status IN ('pending', 'approved')", (now(), approval_id))
        if changed.rowcount != 1:
            raise Race()
        self.part(run_id, "approval.decided", {"approval_id": approval_id,
                                               "status": "expired"}, step_id)
        self.execute("UPDATE steps SET status='failed', finished_at=? WHERE id=? AND status="
                     "'awaiting_approval'", (now(), step_id))
        self.finish_run(run_id, "CANCELLED", "approval_expired",
                        f"approval {approval_id} expired")

    def record_read(self, run_id, session, tool, decision, policy, policy_id, started,
                    observation, ended, duration_ms):
        """An allowed read, recorded once it answered as its run and one run.read event: a crash
        leaves nothing of it unknown (no calls row); its tool has no limit (no execution row)."""
        status, reason, detail = ended
        self.execute("INSERT INTO runs(id, session, tool, status, reason, detail, step_count, "
                     "created_at, finished_at) VALUES(?,?,?,?,?,?,1,?,?)",
                     (run_id, session, tool.name, status, reason, detail, started, now()))
        self.part(run_id, "run.read", {
            "decision": decision, "duration_ms": duration_ms, "status": status,
            "policy": {**policy, "policy_id": policy_id, "spec_hash": self.keep_spec(tool)},
            "started_at": started, "observation": observation}, new_id(16))

    def create_grant(self, grant):
        self.execute(f"INSERT INTO grants({', '.join(GRANT_COLUMNS[:9])}) VALUES(?,?,?,?,?,?,?,"
                     f"?,?)", tuple(grant[c] for c in GRANT_COLUMNS[:9]))
        self.part(grant["id"], "grant.created", {
            **{c: grant[c] for c in GRANT_COLUMNS[1:9] if c != "conditions_json"},
            "conditions": parse(grant["conditions_json"])})

    def revoke_grant(self, grant_id, by, note):
        """End a grant now; False when it was not in force."""
        at = now()
        changed = self.execute("UPDATE grants SET revoked_at=?, revoked_by=?, revoke_note=? "
                               "WHERE id=? AND revoked_at='' AND expires_at>?",
                               (at, by, note, grant_id, at))
        if changed.rowcount != 1:
            return False
        self.part(grant_id, "grant.revoked", {"by": by, "note": note})
        return True

    def cancel_run(self, run_id, by, note):
        """An operator ends a run. A step cancelled while executing keeps that it was (its
        outcome stays unknown); a pending question is closed as rejected."""
        for (approval_id, step_id) in self.rows("SELECT id, step_id FROM approvals WHERE "
                                                "run_id=? AND status='pending'", (run_id,)):
            self._close_approval(run_id, step_id, approval_id, "rejected", by, note)
        for (step_id, status) in self.rows("SELECT id, status FROM steps WHERE run_id=? AND "
                                           "status IN ('deciding', 'awaiting_approval', "
                                           "'executing')", (run_id,)):
            self.fail_step(run_id, step_id, {"kind": "interrupted", "content": {
                "by": by, "note": note, "previous_status": status}}, f"cancelled by {by}")
        self.finish_run(run_id, "CANCELLED", "operator_cancelled", note, extra={"by": by})


class Store:
    """The record as one process writes it: a writer, a reader and the heartbeat's
    connection, each under a lock of its own."""

    def __init__(self, path, readonly=False, create=True):
        self.path = path
        self.lock = threading.RLock()
        self.jobs, self.jobs_lock = [], threading.Lock()
        self._check_files(tighten=not readonly)
        if create and not readonly and not os.path.exists(path):
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            except FileExistsError:
                pass
            except OSError as err:
                raise StoreError(f"database {path} cannot be created: {err.strerror}") from None
        elif not os.path.exists(path):
            raise StoreError(f"database {path} does not exist; start the gate once to create it,"
                             f" or name the right file with -db")
        uri = "file:" + path.replace("?", "%3f").replace("#", "%23") + ("?mode=ro" if readonly
                                                                        else "")
        try:
            self.db = self._connect(uri)
            if not readonly:
                self._wal()
                self.db.execute("PRAGMA synchronous=FULL")
            self._check_schema(migrate=create and not readonly)
            # Reads never wait on a writer's sync: a stale read is caught by its write's checks.
            self.reader = self.db if readonly else self._connect(uri)
            self.read_lock = self.lock if readonly else threading.Lock()
            # The heartbeat writes on a third: a live call's lease is renewed while commits stall.
            self.lease_db = None if readonly else self._connect(uri)
            self.lease_lock = threading.Lock()
        except sqlite3.Error as err:
            raise StoreError(f"database {path} cannot be opened: {err}") from None
        # Checked again once open, so a file swapped in meanwhile is refused.
        self._check_files(tighten=not readonly)

    @staticmethod
    def _connect(uri):
        db = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=5.0,
                             check_same_thread=False)
        db.execute("PRAGMA trusted_schema=OFF")
        db.execute("PRAGMA foreign_keys=ON")
        if hasattr(db, "setconfig"):
            db.setconfig(sqlite3.SQLITE_DBCONFIG_DEFENSIVE, True)
        return db

    def _wal(self):
        deadline = time.monotonic() + 5
        while True:
            try:
                return self.db.execute("PRAGMA journal_mode=WAL")
            except sqlite3.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _check_files(self, tighten):
        check_database_path(self.path)
        owner = os.lstat(self.path).st_uid if os.path.exists(self.path) else os.geteuid()
        for path in (self.path, self.path + "-wal", self.path + "-shm"):
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_uid != owner:
                raise StoreError(f"database file {path} is not a regular file of the database's"
                                 f" owner; remove it or fix its ownership")
            if st.st_mode & 0o022:
                raise StoreError(f"database file {path} has mode {stat.filemode(st.st_mode)}, "
                                 f"which lets its group or others write it: chmod 600 it")
            if st.st_mode & 0o044 and tighten and st.st_uid == os.geteuid():
                os.chmod(path, 0o600)

    def _check_schema(self, migrate):
        unsafe = self.db.execute("SELECT name FROM sqlite_master WHERE type IN ('trigger',"
                                 " 'view') LIMIT 1").fetchone()
        if unsafe:
            raise StoreError(f"database {self.path} holds a trigger or view ({unsafe[0]}), which "
                             f"agentgate never creates; it will not use this file")
        has = self.db.execute("SELECT 1 FROM sqlite_master WHERE name='schema_migrations'"
                              ).fetchone()
        version = self.db.execute("SELECT max(version) FROM schema_migrations"
                                  ).fetchone()[0] or 0 if has else 0
        if version > len(SCHEMA):
            raise StoreError(f"database {self.path} was migrated by a newer agentgate (schema "
                             f"version {version}, this one knows {len(SCHEMA)}); use the newer "
                             f"agentgate")
        if version == len(SCHEMA):
            return
        if not migrate:
            raise StoreError(f"database {self.path} has schema version {version}, older than "
                             f"this agentgate's {len(SCHEMA)}; start the gate once to migrate it")
        self.db.execute("BEGIN IMMEDIATE")
        with self.db:  # commits, or rolls back whatever stops it
            # Read again under the write lock: another process may have migrated meanwhile.
            self.db.execute("CREATE TABLE IF NOT EXISTS schema_migrations(version INTEGER "
                            "PRIMARY KEY, applied_at TEXT NOT NULL)")
            current = self.db.execute("SELECT max(version) FROM schema_migrations"
                                      ).fetchone()[0] or 0
            for number in range(current + 1, len(SCHEMA) + 1):
                for statement in filter(str.strip, SCHEMA[number - 1].split(";")):
                    self.db.execute(statement)
                self.db.execute("INSERT INTO schema_migrations VALUES(?, ?)", (number, now()))

    def close(self):
        with self.lock, self.read_lock, self.lease_lock:
            self.reader.close()
            self.db.close()
            if self.lease_db is not None:
                self.lease_db.close()

    # -- the one place transactions are opened --------------------------------------------

    def write(self, fn):
        """Run fn(tx) in a BEGIN IMMEDIATE transaction; return its result once durable (nothing
        is answered unrecorded). Changes queued meanwhile commit together, each in a savepoint
        so one that fails rolls back alone (13-39% more calls/s at 16 in flight)."""
        job = {"fn": fn, "done": False, "result": None, "error": None}
        with self.jobs_lock:
            self.jobs.append(job)
        with self.lock:
            if not job["done"]:
                with self.jobs_lock:
                    batch, self.jobs = self.jobs, []
                self._commit(batch)
        if job["error"] is not None:
            raise job["error"]
        return job["result"]

    def _commit(self, batch):
        try:
            self.db.execute("BEGIN IMMEDIATE")
            for job in batch:
                self.db.execute("SAVEPOINT change")
                try:
                    tx = Tx(self.db)
                    job["result"] = job["fn"](tx)
                    tx.flush()
                except Exception as err:
                    self.db.execute("ROLLBACK TO change")
                    # A unique index refusing a row is a lost race (by message: 3.9 has no code).
                    lost = (isinstance(err, sqlite3.IntegrityError)
                            and str(err).startswith("UNIQUE constraint failed"))
                    job["error"] = (Race() if lost else
                                    StoreError(f"the records could not be written: {err}")
                                    if isinstance(err, sqlite3.Error) else err)
                self.db.execute("RELEASE change")
            self.db.execute("COMMIT")
        except BaseException as err:
            # Nothing of the batch committed: every caller in it hears so, whatever stopped it.
            with contextlib.suppress(sqlite3.Error):
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
            failure = StoreError(f"the records could not be written: {err}" if isinstance(
                err, sqlite3.Error) else "the write was interrupted before it was committed")
            for job in batch:
                job["error"] = failure
            if not isinstance(err, sqlite3.Error):
                raise
        finally:
            for job in batch:
                job["done"] = True

    def renew_leases(self, owner, until, run_ids):
        """The heartbeat (no event: a renewal changes no decision)."""
        if not run_ids:
            return
        with self.lease_lock:
            try:  # one statement, so its own transaction
                self.lease_db.execute(
                    f"UPDATE runs SET lease_expires_at=? WHERE lease_owner=? AND status='RUNNING'"
                    f" AND id IN ({', '.join('?' * len(run_ids))})", (until, owner, *run_ids))
            except sqlite3.Error as err:
                raise StoreError(f"the leases could not be renewed: {err}") from None

    # -- the reads the gate decides with -----------------------------------------------------
    # They span every session: each host's gate (init) has its own session on one database.
    # "The same server and request" is the request key: the server's name in the config, the
    # upstream tool's name and the canonical arguments (init names a server alike in every
    # host's config). Two servers given one name share their rules: refused, never run twice.

    def key_runs(self, key, since, newest_only):
        """Newest first, in one statement: its open row is the newest as of every row read."""
        return [KeyRun(*row) for row in self.read(
            "SELECT r.id, r.status, r.reason, r.detail, r.finished_at, r.lease_owner, "
            "r.lease_expires_at, c.open FROM calls c JOIN runs r ON r.id = c.run_id WHERE "
            "c.request_key=? AND (c.open=1 OR c.settled_at='' OR c.settled_at>=?) "
            "ORDER BY c.id DESC" + (" LIMIT 1" if newest_only else ""), (key, since))]

    def open_run(self, key):
        row = self.read_one("SELECT run_id FROM calls WHERE request_key=? AND open=1 "
                            "ORDER BY id DESC", (key,))
        return row[0] if row else None

    def attempt_runs(self, key):
        return self.read("SELECT r.id, r.status FROM calls c JOIN runs r ON r.id = c.run_id "
                         "WHERE c.request_key=? AND c.outcome!=? ORDER BY c.id DESC",
                         (key, OUTCOME_NONE))

    def unsettled_runs(self, targets, key):
        """The tool's unsettled runs of other requests (`targets` as unknown_for_tool's)."""
        return self.read("SELECT r.id, r.status, r.lease_owner, r.lease_expires_at "
                         "FROM calls c JOIN runs r ON r.id = c.run_id WHERE c.tool IN (?, ?) "
                         "AND c.outcome=0 AND c.settled_at='' AND c.request_key!=? "
                         "ORDER BY c.id", (*targets, key))

    def unknown_for_tool(self, targets, key):
        """Other requests of the tool whose newest attempt's outcome is unknown; `targets`:
        its "server/tool" and the name databases before 0.2 hold."""
        return self.read(
            "SELECT c.request_key, c.run_id, r.reason FROM calls c JOIN runs r ON r.id = "
            "c.run_id WHERE c.tool IN (?, ?) AND c.request_key!=? AND "
            "c.outcome=? AND c.id = (SELECT max(id) FROM calls d WHERE "
            "d.request_key=c.request_key AND d.outcome!=?) "
            "ORDER BY c.id", (*targets, key, OUTCOME_UNKNOWN, OUTCOME_NONE))

    def read_approvals(self, joined, args, extra=()):
        """The one reader of approvals, as dicts of APPROVAL_COLUMNS and `extra`'s (name,
        expression) pairs; `joined` follows the select list, approvals named a."""
        select = ", ".join([f"a.{c}" for c in APPROVAL_COLUMNS] + [e for _, e in extra])
        names = APPROVAL_COLUMNS + tuple(name for name, _ in extra)
        return [dict(zip(names, row)) for row in self.read(f"SELECT {select} {joined}", args)]

    def latest_approval(self, run_id):
        rows = self.read_approvals("FROM approvals a WHERE a.run_id=? ORDER BY a.rowid DESC "
                                   "LIMIT 1", (run_id,))
        return rows[0] if rows else None

    def approval(self, approval_id):
        rows = self.read_approvals("FROM approvals a JOIN runs r ON r.id = a.run_id WHERE "
                                   "a.id=?", (approval_id,), (("run_status", "r.status"),))
        return rows[0] if rows else None

    def step_decision(self, step_id):
        return parse(self.read_one("SELECT decision_json FROM steps WHERE id=?",
                                   (step_id,))[0])

    def read(self, sql, args=()):
        with self.read_lock:
            try:
                return self.reader.execute(sql, args).fetchall()
            except sqlite3.Error as err:
                raise StoreError(f"the records could not be read: {err}") from None

    def read_one(self, sql, args=()):
        return next(iter(self.read(sql, args)), None)


# =============================================================================================
# 8. The gate
#
# Reads as: decision core
#
# Owns: one call's passage (judge, decide, begin and record, hold, execute, record the
# outcome) and the rules across calls over the earlier runs, in every session, of the same
# request (same server and upstream tool, same canonical arguments) and of the same tool.
# Promises: nothing runs that the policy did not allow or an operator did not approve by
# hash; an approval binds exactly the recorded request, never a later call's bytes; the
# outcome is recorded even when the host has gone.
# Deciding happens under one lock, so two threads never both begin the same request; across
# processes the unique open-row index does, and a lost race is decided again. Judging happens
# before the lock, executing and holding after it. An executing run holds a lease its process
# renews; one whose lease ran out is taken over. Everything is recorded before it is sent,
# except a read allowed outright (see _begin). It reaches out only through seams: the
# upstream's `request` (section 21), `announce` and `duplicate` (section 26).
# =============================================================================================

TOOL_CALL = "tool_call"

# The verdicts besides an Answer. An Execute's `step_id` is None for a read recorded whole
# after it answers (`record`: its policy record and start); `work` spares a re-run a search.
Wait = collections.namedtuple("Wait", "approval")
Execute = collections.namedtuple("Execute", "run_id step_id args record work",
                                 defaults=(None, None))

# What a rule says when it does not answer the call itself:
NEXT = "next"    # this rule, or this earlier run, decides nothing: the next one does
STOP = "stop"    # rule 5 met an unknown outcome: look no further back, let rule 6 decide
AGAIN = "again"  # a rule ended a run or approval, or a write lost a race: decide again


def file_stamp(path):
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return st.st_mtime_ns, st.st_size, st.st_ino


class Gate:
    """The gate of one serving process."""

    def __init__(self, config, store, tools):
        self.config, self.store = config, store
        self.tools = {tool.name: tool for tool in tools}
        self.policy_id = config.policy_id()
        self.tool_hashes = [tool.spec_hash for tool in sorted(tools, key=lambda t: t.name)]
        self.owner = f"{PROGRAM}:{config.session}/{secrets.token_hex(6)}"
        self.lock = threading.Lock()
        # The runs this process executes: only these are renewed, and it never takes one over.
        self.active = set()
        self.stopping = threading.Event()
        self.announce = lambda approval, tool, run_id: None
        self.duplicate = lambda tool, run_id, executed_at, window: None
        # Tools changed while serving (ToolWatch): not offered, refused; replaced whole only.
        self.quarantined = frozenset()
        self.client = ""  # set by the host side from initialize
        self.config_read = file_stamp(config.path)
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def lease(self):
        return self.owner, later(now(), self.config.lease_ttl)

    def quarantine(self, names):
        """From now on `names` (offered names) are the tools not offered
        and refused; the set is replaced whole, never edited in place."""
        self.quarantined = frozenset(names)

    def _heartbeat(self):
        """Renew this process's leases every third of their life. A run stranded by a failed
        write is not renewed, so the next identical call takes it over."""
        while not self.stopping.wait(self.config.lease_ttl / SECOND / 3):
            if self.config_read and file_stamp(self.config.path) != self.config_read:
                self.config_read = None  # said once
                log(f"config {self.config.path} changed since this gate started; it goes on "
                    f"serving the one it read: restart the host to serve the new one")
            try:
                # set.copy is atomic: no call changes the set while it is iterated.
                self.store.renew_leases(*self.lease(), sorted(self.active.copy()))
            except Exception as err:  # the heartbeat outlives any one failure
                log(f"could not renew leases: {err}")

    def window(self, tool):
        rule = tool.rule.repeat_window
        return self.config.repeat_window if rule is None else rule

    def _facts(self, tool, rows=None):
        """The facts of now. Limits are counted only through `rows` of the write transaction
        that acts on the decision, so racing calls in any process never pass a limit together."""
        return decision_facts(rows or self.store.read, self.config.session, tool,
                              format_time(time.time()), self.client,
                              rows is not None and bool(tool.rule.limits))

    # -- one call ------------------------------------------------------------------------------

    def call(self, tool, args, invalid="", progress=None, cancelled=None):
        """Decide, then execute, hold or refuse one tools/call; always an Answer. `invalid`:
        (why, the frame as received) when the arguments are not usable JSON."""
        cancelled = cancelled or threading.Event()
        executing = False
        try:
            args = {} if args is None else args
            encoded = None if invalid else canonical(args)  # once per call: its size, its key
            if encoded is not None and len(encoded) > self.config.max_argument_bytes:
                invalid = (SLOT_PROSE["arguments_too_large"].format(
                    size=len(encoded), cap=self.config.max_argument_bytes),
                    recorded_frame(encoded))
            if invalid:
                with self.lock:
                    return self._begin(tool, None, f"invalid:{new_id(8)}", None, None,
                                       invalid=invalid, cancelled=cancelled)
            key = request_key(tool.target, encoded)
            judged = self._judge(tool, args)
            held, races = False, 0
            while True:
                try:
                    with self.lock:
                        verdict = self._decide(tool, args, key, judged, cancelled)
                except Race:  # a write lost its race at the store: decided again
                    verdict = AGAIN
                if verdict is AGAIN:
                    races += 1
                    if races > 5:
                        return answer("IN_PROGRESS")
                    continue
                if isinstance(verdict, Answer):
                    return verdict
                if isinstance(verdict, Execute):
                    executing = True
                    return self._execute(tool, verdict, progress, cancelled)
                if held or not self._hold(verdict.approval, progress, cancelled):
                    return waiting_answer(verdict.approval)
                held = True
                # The operator decided meanwhile: judged again, as a path's links may have moved.
                judged = self._judge(tool, args, judged.work)
        except (StoreError, Race) as err:
            log(str(err) or "the records could not be written: a race was lost")
            return answer("UNAVAILABLE", what=SLOT_PROSE["sent_unrecorded" if executing else
                                                         "nothing_executed"])

    def _judge(self, tool, args, work=None):
        """The schema check and the policy's conditions, before the lock; later steps reuse
        the Judgement, reading afresh only facts that may change."""
        judged = judged_request(tool, args, work)
        policy_decision(self.config, tool, args, self._facts(tool), judged=judged)
        return judged

    def _hold(self, approval, progress, cancelled):
        """Wait up to `hold` for the operator: True once the approval is decided, expired or
        its run ended (decide again); else False (the hold ran out, cancelled, stopping)."""
        started = time.monotonic()
        total = self.config.hold_for(self.client) / SECOND
        while not cancelled.is_set() and not self.stopping.is_set():
            waited = time.monotonic() - started
            if waited >= total:
                return False
            cancelled.wait(min(0.2, total - waited))
            row = self.store.approval(approval["id"])
            waits = row and row["status"] == "pending" and live_approval(self.config, row)
            if not waits or row["run_status"] in TERMINAL:
                return not (cancelled.is_set() or self.stopping.is_set())
            if progress:  # told at most once a second (Progress.holding)
                progress.holding(round(waited, 3), total, SLOT_PROSE["holding"])
        return False

    # -- the rules, under the lock -------------------------------------------------------------

    def _decide(self, tool, args, key, judged, cancelled):
        """The rules in order, as one verdict: an Answer, a Wait, an Execute, or AGAIN. A call
        the host cancelled while it was judged or waited for the lock is not decided."""
        if cancelled.is_set():
            return answer("CANCELLED", "HOST_CANCELLED")
        window = self.window(tool)
        since = format_time(time.time() - max(window, self.config.repeat_window) / SECOND)
        # A read needs only its newest row: identical reads never refuse one another, and a wait
        # or refusal on the newest stops them all. The begin refuses unless `seen` is still the
        # key's open row, so no identical run, in any process, begins and ends in between.
        rows = self.store.key_runs(key, since, newest_only=tool.read_only)
        seen = next((row.run_id for row in rows if row.open), None)
        for row in rows:
            if row.status == "WAITING_FOR_APPROVAL":                        # rule 1
                approval = self.store.latest_approval(row.run_id)
                if approval is None or approval["status"] not in ("pending", "approved"):
                    return answer("IN_PROGRESS")
                if approval["status"] == "approved":
                    return self._collect(tool, approval, judged)
                if live_approval(self.config, approval):
                    return Wait(approval)
                return self._expire(approval)
            if row.status == "RUNNING":
                if row.run_id in self.active or (row.owner != self.owner and row.expires > now()):
                    return answer("IN_PROGRESS")                            # rule 2
                return self._take_over(tool, row.run_id, judged)            # rule 3
            if row.finished >= since:                                       # rules 4, 5
                verdict = self._closed(tool, row, window)
                if verdict is STOP:
                    break
                if verdict is not NEXT:
                    return verdict
        attempt = None
        if not tool.read_only:
            attempt = self._unknown_attempt(key)                            # rule 6
            verdict = self._tool_rules(tool, key)                           # rule 7
            if verdict is not NEXT:
                return verdict
        return self._begin(tool, args, key, seen, judged, attempt=attempt,  # rule 8
                           cancelled=cancelled)

    def _expire(self, approval):
        self.store.write(lambda tx: tx.expire_approval(approval["id"], approval["run_id"],
                                                       approval["step_id"]))
        return AGAIN  # the run has ended: decided again, with rules 4 to 6 on it

    def _collect(self, tool, approval, judged):
        """An approved request, checked again, executes as recorded, never as this call's
        bytes (the same request key, so the call's judgement is the request's)."""
        run_id, step_id = approval["run_id"], approval["step_id"]
        if tool.name in self.quarantined:
            # Its server changed it while the call was held: the approval stays for its return.
            return answer("DENIED", "TOOL_CHANGED")
        if stored_hash(approval) != approval["hash"]:
            log(f"approval {approval['id']} does not match its hash; it was altered after it "
                f"was made and will not be used")
            return answer("DENIED", reason=SLOT_PROSE["altered"])
        if not live_approval(self.config, approval):  # its grant_ttl ran out
            return self._expire(approval)
        if judged.problem:
            self.store.write(lambda tx: self._refuse(
                tx, run_id, step_id, "invalid_decision",
                f"invalid decision on resume: {judged.problem}"))
            return answer("INVALID", reason=clean(judged.problem, 1000))
        args = parse(approval["request_json"])["args"]
        attempt = parse(approval["capability_json"]).get("interrupted")
        facts = self._facts(tool)
        decision = evaluate(self.config, tool, args, facts, attempt, approved=True,
                            judged=judged)
        record = _policy_record(decision, facts, True)
        if decision["outcome"] == "deny":
            def deny(tx):
                tx.record_policy(run_id, step_id, record, self.policy_id)
                self._refuse(tx, run_id, step_id, "policy_denied",
                             f"denied on resume: {decision['reason']}")
            self.store.write(deny)
            return answer("DENIED", reason=clean(decision["reason"], 500))
        if decision["outcome"] == "require_approval":
            # The policy may ask another question (a limit reached since, say).
            fresh = new_approval(self.config, run_id, step_id, tool, args, decision)
            if fresh["hash"] != approval["hash"]:
                return self._pause(tool, fresh, record, self.policy_id)

        def resume(tx):
            tx.resume(run_id, approval["id"], self.lease())
            tx.record_policy(run_id, step_id, record, self.policy_id)
            tx.start_execution(run_id, step_id, tool.name, args, tool.target, approval["id"])
        self._write_active(run_id, resume)
        return Execute(run_id, step_id, args, work=judged.work)

    def _take_over(self, tool, run_id, judged):
        """Rule 3: take over a run whose lease ran out. A mutating call it cut off may have
        taken effect: Wait on asking to run it again. Anything else is ended: AGAIN."""
        cut_step = self.store.write(lambda tx: tx.take_over(run_id, self.lease()))
        if cut_step and not tool.read_only:
            step_id, started = cut_step
            attempt = {"run_id": run_id, "step_id": step_id, "started_at": started,
                       "ended": "cut_off"}
            args = self.store.step_decision(step_id)["args"]
            facts = self._facts(tool)
            decision = evaluate(self.config, tool, args, facts, attempt, judged=judged)
            if decision["outcome"] == "require_approval":
                log(f"a call to {tool.name} was cut off while executing; its outcome is unknown")
                approval = new_approval(self.config, run_id, step_id, tool, args, decision)
                return self._pause(tool, approval, _policy_record(decision, facts), "")
        self.store.write(lambda tx: tx.finish_run(
            run_id, "FAILED", "goal_failed", "one call per run: taken over after an "
            "interruption, with nothing left in it to execute"))
        return AGAIN

    def _pause(self, tool, approval, record, policy_id):
        run_id, step_id = approval["run_id"], approval["step_id"]
        def pause(tx):
            tx.record_policy(run_id, step_id, record, policy_id)
            tx.pause(run_id, step_id, approval)
        self.store.write(pause)
        self.announce(approval, tool, run_id)
        return Wait(approval)

    def _refuse(self, tx, run_id, step_id, kind, detail):
        tx.fail_step(run_id, step_id, {"kind": kind, "content": {"error": detail}}, detail)
        tx.finish_run(run_id, "FAILED", "goal_failed", CLOSING[kind])

    def _closed(self, tool, row, window):
        """Rules 4 and 5: a finished run of this request within the window: the tool's for a
        duplicate; for the operator's no (a rejection, cancellation, expiry) at least the
        config's, whatever the tool's."""
        refusals = max(window, self.config.repeat_window)
        def within(span):
            return span and row.finished >= format_time(time.time() - span / SECOND)
        def until():
            return prose_time(later(row.finished, refusals))
        refused = within(refusals)
        if row.reason == "approval_rejected" and refused:
            approval = self.store.latest_approval(row.run_id)
            return answer("REJECTED", approval=approval["id"],
                          note=note_text(approval["note"]), until=until())
        attempt = None if tool.read_only else last_attempt(self.store.read, row.run_id)
        unknown = attempt is not None and attempt.ending in UNKNOWN_ENDINGS
        if row.reason == "approval_expired" and not unknown and refused:
            return answer("EXPIRED", approval=self.store.latest_approval(row.run_id)["id"],
                          until=until())
        if row.reason == "operator_cancelled" and refused:
            return answer("REJECTED", "CANCELLED", note=note_text(row.detail), until=until())
        if unknown:
            return STOP
        if attempt is None or not within(window):
            return NEXT
        cap = 500 if attempt.ending == "unrecorded" else CONTENT_CAP
        text = clean(outcome_text(attempt.observed), cap)
        outcome = DUPLICATE_OUTCOME[attempt.ending].format(text=text)
        self.duplicate(tool, row.run_id, attempt.finished, window)
        return answer("DUPLICATE", at=prose_time(attempt.finished),
                      window=format_duration(window), outcome=outcome)

    def _unknown_attempt(self, key):
        """Rule 6: the attempt to run again if this request's newest finished run left its
        outcome unknown; only an approved re-run that comes to a known outcome resolves it."""
        for run_id, status in self.store.attempt_runs(key):
            attempt = status in TERMINAL and last_attempt(self.store.read, run_id)
            if attempt:
                return attempt.attempt if attempt.ending in UNKNOWN_ENDINGS else None
        return None

    def _tool_rules(self, tool, key):
        """Rule 7: what other requests of a mutating tool say about this one: BLOCKED, or NEXT.
        It acts on what it meets, so a tool is never blocked by what nobody will settle: a dead
        run is taken over, an expired question ended, an unasked one asked again."""
        targets = (tool.target, tool.name)
        for run_id, status, owner, expires in self.store.unsettled_runs(targets, key):
            if status == "RUNNING" and not (
                    owner != self.owner and expires > now()) and run_id not in self.active:
                # Another request's arguments, judged on a pattern budget of their own.
                verdict = self._take_over(tool, run_id, Judgement())
                if isinstance(verdict, Wait):
                    return answer("BLOCKED", "BLOCKED_UNKNOWN", tool=tool.name,
                                  approval=verdict.approval["id"])
                continue
            approval = status == "WAITING_FOR_APPROVAL" and self.store.latest_approval(run_id)
            if approval and approval["kind"] == "interrupted_side_effect":
                if live_approval(self.config, approval):
                    return answer("BLOCKED", "BLOCKED_UNKNOWN", tool=tool.name,
                                  approval=approval["id"])
                self._expire(approval)
        return self._unknown_block(tool, key)

    def _unknown_block(self, tool, key):
        """Another request of this tool left an outcome unknown, unasked: ask it again in a
        fresh run and answer BLOCKED; else NEXT."""
        for other_key, run_id, reason in self.store.unknown_for_tool(
                (tool.target, tool.name), key):
            if reason in ("approval_rejected", "operator_cancelled"):
                continue
            # The open row first, then the attempt: a re-run that begins and settles the
            # question after this read makes the begin below refuse, so it is not asked again.
            seen = self.store.open_run(other_key)
            attempt = self._unknown_attempt(other_key)
            if attempt is None:
                continue
            args = self.store.step_decision(attempt["step_id"])["args"]
            verdict = self._begin(tool, args, other_key, seen, judged_request(tool, args),
                                  attempt=attempt, origin="operator")
            if isinstance(verdict, Wait):
                return answer("BLOCKED", "BLOCKED_UNKNOWN", tool=tool.name,
                              approval=verdict.approval["id"])
            # Anything else (its arguments now invalid, say) ended that run unexecuted.
        return NEXT

    # -- beginning and executing a run ---------------------------------------------------------

    def _begin(self, tool, args, key, seen, judged, invalid=None, attempt=None, origin="model",
               cancelled=None):
        """Rule 8: decide once and begin the run in one write transaction, then act on it.
        `invalid` (why, frame): arguments not usable JSON (`judged` None)."""
        run_id = f"{self.config.session}.{new_id(8)}"
        problem = invalid[0] if invalid else judged.problem
        if not (problem or attempt) and tool.read_only and not tool.rule.limits:
            # A read allowed outright, with no limit to count and no grant to be revoked
            # meanwhile, leaves nothing unknown after a crash: recorded whole after it answers.
            facts = self._facts(tool)
            decision = evaluate(self.config, tool, args, facts, judged=judged)
            if decision["outcome"] == "allow" and "grant" not in decision:
                self.active.add(run_id)
                return Execute(run_id, None, args, (_policy_record(decision, facts), now()))
        recorded = {"invalid_args": invalid[1]} if invalid else {"args": args}

        def begin(tx):
            if cancelled and cancelled.is_set():  # by the host, before the run began
                return answer("CANCELLED", "HOST_CANCELLED")
            if not problem:
                # Decided here, where limits see every execution any process committed before,
                # and the waits that bound what may be asked are counted.
                facts = self._facts(tool, tx.rows)
                decision = evaluate(self.config, tool, args, facts, attempt, judged=judged)
                asks = decision["outcome"] == "require_approval" and origin == "model"
                waiting = tx.waiting(self.config.session) if asks else 0
                if asks and waiting >= self.config.max_pending:
                    return answer("BLOCKED", "BLOCKED_PENDING", waiting=SLOT_PROSE[
                        "one_waits" if waiting == 1 else "some_wait"].format(count=waiting))
            tx.begin_run(run_id, self.config.session, tool.name, tool.target, key,
                         tool.side_effect, self.tool_hashes, self.lease(),
                         ANY_ROW if tool.read_only else seen)
            step_id = tx.start_step(run_id, {**recorded, "kind": TOOL_CALL, "origin": origin,
                                             "tool": tool.name}, tool)
            if problem:
                self._refuse(tx, run_id, step_id, "invalid_decision",
                             f"invalid decision: {problem}")
                return step_id, None, None
            tx.record_policy(run_id, step_id, _policy_record(decision, facts), self.policy_id)
            approval = None
            if decision["outcome"] == "deny":
                self._refuse(tx, run_id, step_id, "policy_denied",
                             f"denied: {decision['reason']}")
            elif decision["outcome"] == "require_approval":
                approval = new_approval(self.config, run_id, step_id, tool, args, decision)
                tx.pause(run_id, step_id, approval)
            else:
                tx.start_execution(run_id, step_id, tool.name, args, tool.target)
            return step_id, decision, approval
        begun = self._write_active(run_id, begin)
        if isinstance(begun, Answer):
            self.active.discard(run_id)
            return begun
        step_id, decision, approval = begun
        if decision and decision["outcome"] == "allow":
            return Execute(run_id, step_id, args, work=judged.work)
        self.active.discard(run_id)  # nothing of this run executes
        if problem:
            return answer("INVALID", reason=clean(problem, 1000))
        if decision["outcome"] == "deny":
            frees = frees_text(decision)
            reason = decision["reason"] + (f"; {frees}" if frees else "")
            return answer("DENIED", reason=clean(reason, 500))
        self.announce(approval, tool, run_id)
        return Wait(approval)

    def _write_active(self, run_id, fn):
        """The write that starts a run executing: the run is this process's own from before
        it, so no identical call takes it over in between."""
        self.active.add(run_id)
        try:
            return self.store.write(fn)
        except BaseException:
            self.active.discard(run_id)
            raise

    def _execute(self, tool, verdict, progress=None, cancelled=None):
        """Send the request upstream and record what came of it, even if the host cancels
        once it is sent; cancelled before, it is not sent."""
        run_id, step_id, args = verdict.run_id, verdict.step_id, verdict.args
        try:
            started = time.monotonic()
            if cancelled and cancelled.is_set():
                observation, ending, passed = failed_call(
                    tool, SLOT_PROSE["host_cancelled"], "unsent")
            else:
                observation, ending, passed = call_upstream(
                    tool, args, self.config.max_result_bytes, progress and progress.server)
            elapsed = int((time.monotonic() - started) * 1000)

            def record(tx):  # the approval a re-run waits on, when the outcome is unknown
                if step_id is None:  # a read allowed outright: its run recorded whole
                    policy, started_at = verdict.record
                    ended = ("COMPLETED", "goal_completed", f"terminal tool {tool.name}") \
                        if ending == "ok" else ("FAILED", "goal_failed", CLOSING[ending])
                    tx.record_read(run_id, self.config.session, tool, {
                        "args": args, "kind": TOOL_CALL, "origin": "model", "tool": tool.name},
                        policy, self.policy_id, started_at, observation, ended, elapsed)
                    return None
                if tx.run_holder(run_id) != ("RUNNING", self.owner):
                    # Cancelled, or taken over after this process lost its lease: a late
                    # event keeps the outcome; the run stays as its new owner has it.
                    late = {"tool": tool.name, "late": True, "observation": observation}
                    tx.event(run_id, "step.tool_finished", late, step_id)
                    return None
                tx.finish_execution(run_id, step_id, tool.name, observation, elapsed)
                if ending in UNKNOWN_ENDINGS:
                    return self._pause_rerun(tx, tool, run_id, step_id, args, ending,
                                             verdict.work)
                if ending == "unsent":  # executed nothing: no limit counts it
                    tx.execute("DELETE FROM executions WHERE step_id=?", (step_id,))
                if ending != "ok":  # unsent: the outcome of the attempt before, if any
                    tx.finish_run(run_id, "FAILED", "goal_failed", CLOSING[ending],
                                  outcome=None if ending == "unsent" else OUTCOME_KNOWN)
            rerun = self.store.write(record)
        finally:
            self.active.discard(run_id)
        if passed is not None:
            return passed_answer(passed)
        if observation.get("withheld"):
            return too_large_answer(tool, observation["result"], self.config.max_result_bytes,
                                    self.window(tool))
        error = observation["content"]["error"]
        if rerun:
            log(f"a call to {tool.name} {HOW[ending]}; its outcome is unknown")
            self.announce(rerun, tool, run_id)
            return answer("UNKNOWN_OUTCOME", how=HOW[ending], error=f" ({clean(error, 500)})",
                          approval=rerun["id"])
        if ending == "unrecorded":
            return answer("UNRECORDED", reason=clean(error, 500),
                          window=refused_for(self.window(tool)))
        return Answer(clean(error, CONTENT_CAP), True)

    def _pause_rerun(self, tx, tool, run_id, step_id, args, ending, work):
        """An unknown outcome asked again in the transaction that records the attempt: the
        approval, or None. Judged again (on `work`): the call may have moved a path's links."""
        attempt = {"run_id": run_id, "step_id": step_id, "started_at": tx.step_started(step_id),
                   "ended": ending}
        facts = self._facts(tool, tx.rows)
        decision = evaluate(self.config, tool, args, facts, attempt, judged=Judgement(work=work))
        if decision["outcome"] == "deny":
            # Denied outright now (an entry for other hours, say): nothing is asked, the run
            # ends with its outcome unknown, and rule 6 decides the next identical call.
            tx.finish_run(run_id, "FAILED", "goal_failed", CLOSING[ending])
            return None
        rerun_step = tx.start_step(run_id, {"args": args, "kind": TOOL_CALL,
                                            "origin": "operator", "tool": tool.name}, tool)
        tx.record_policy(run_id, rerun_step, _policy_record(decision, facts), self.policy_id)
        approval = new_approval(self.config, run_id, rerun_step, tool, args, decision)
        tx.pause(run_id, rerun_step, approval)
        return approval


def call_upstream(tool, args, cap, progress=None):
    """Send one call upstream: (observation, ending, passed), `passed` the server's result as
    it came, or None (none, or past `cap` bytes: withheld). The one place an outcome is
    classified: 'ok'; 'error' (an error answer: known); 'unsent' (no byte reached the server:
    nothing executed); 'unrecorded' (executed, answer unusable: known, never run again);
    'timed_out' or 'no_answer' (it may have taken effect: unknown). A read's other failures
    are 'error': it has no effect to vouch for."""
    passed = rpc = None
    try:
        result = tool.upstream.request(
            "tools/call", {"name": tool.upstream_name, "arguments": {**args, **tool.rule.fixed}},
            Deadline(tool.timeout), f"tool {quote(tool.upstream_name)}", progress)
        passed, error = passed_result(tool, result)
        try:
            record = result_record(passed) if passed is not None else None
        except Exception as err:  # a result shaped in a way no server should send
            passed, error = None, SLOT_PROSE["unreadable_result"].format(error=err)
        ending = "unrecorded" if passed is None else "error" if record.get("is_error") \
            else "ok"
    except UpstreamError as err:
        error, rpc = str(err), err.rpc
        ending = {"unusable": "unrecorded", "answered": "error",
                  "not_sent": "unsent"}.get(err.outcome, err.outcome)
    if tool.read_only and ending not in ("ok", "unsent"):
        ending = "error"
    if passed is None:
        return failed_call(tool, error, ending, rpc, cap)
    withheld = record["bytes"] > cap
    observation = {"kind": "tool_result" if ending == "ok" else "tool_error",
                   "summary": result_summary(tool, record, cap if withheld else 0),
                   "result": record}
    if ending != "ok":
        observation["content"] = {"tool": tool.name, "ending": ending}
    if withheld:
        observation["withheld"] = True
    return observation, ending, None if withheld else passed


def failed_call(tool, error, ending, rpc=None, cap=0):
    """A call that came to no result, as call_upstream answers it; a
    server's JSON-RPC error (`rpc`) is passed on as it came while it fits
    the cap, and recorded by its size and hash."""
    content = {"tool": tool.name, "error": error, "ending": ending}
    if rpc is not None:
        sent = canonical(rpc)
        content["rpc_error"] = value_digest(sent)
        rpc = {"error": rpc} if len(sent) <= cap else None
    summary = cut(f"{tool.name} {ending}: {sanitize(error)}", 1000)
    return {"kind": "tool_error", "summary": summary,
            "content": content}, ending, rpc


RECORDED_FRAME_BYTES = 65536


def recorded_frame(data):
    """What an INVALID run keeps of arguments it refused: the bytes as received, or, past
    RECORDED_FRAME_BYTES, their size and hash, so a hostile frame cannot fill the database."""
    if len(data) <= RECORDED_FRAME_BYTES:
        return data.decode("utf-8", "backslashreplace")
    return value_digest(data)


def live_approval(config, approval):
    """Pending and unexpired, or granted and still collectable."""
    if approval["status"] == "pending":
        return not approval["expires_at"] or approval["expires_at"] > now()
    if approval["status"] == "approved":
        return not config.grant_ttl or later(approval["decided_at"], config.grant_ttl) > now()
    return False


CLOSING = {  # why a run ended, by its refused step's kind or its call's ending
    "policy_denied": "one call per run: the request was denied",
    "invalid_decision": "one call per run: the request was invalid",
    "error": "one call per run: the tool call returned an error",
    "unsent": "one call per run: the tool call was not sent, so nothing executed",
    "unrecorded": "one call per run: the tool call executed and its result could not be "
                  "recorded",
    "timed_out": "one call per run: the tool call timed out; its outcome is unknown",
    "no_answer": "one call per run: the tool call failed without an answer; its outcome is "
                 "unknown",
}


def _policy_record(decision, facts, approved=False):
    """A decision as the record keeps it, with the facts recheck needs to make it again
    (`approved`: made when collecting an operator's approval, so no limit counted it)."""
    record = {k: decision[k] for k in ("outcome", "reason", "by", "grant", "limit", "tried",
                                       "kind", "capability", "presentation") if k in decision}
    record["facts"] = {"at": format_time(facts.at), "client": facts.client,
                       "approved": approved}
    return record


# =============================================================================================
# 9. The host side
#
# Reads as: decision core
#
# Owns: the host's conversation on stdin and stdout as far as it decides calls: framing,
# batches, tools/list, tools/call (at most MAX_IN_FLIGHT at once), cancellation and shutdown;
# the rest (initialize's answer, ping, progress, the status tool, threads) is section 25's.
# Promises: stdout carries only protocol, one JSON-RPC message per line, written under one
# lock; the first request is answered at once, even while the servers start; every request
# gets exactly one well-formed answer (a malformed or oversized line, a batch member that is
# not a request or an id that cannot be echoed gets a JSON-RPC error, id null then; past the
# bound, busy; an unknown method, -32601) and the session goes on; each tool is offered as
# pinned, never once its server changed it while serving, and the status tool always; on
# stdin closing, SIGINT or SIGTERM no new call starts, holds end, calls in flight finish and
# are recorded, then the process exits 0.
# =============================================================================================

# The protocol versions spoken, oldest first; each side negotiates on its own.
PROTOCOL_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
BATCH_VERSIONS = ("2024-11-05", "2025-03-26")
MAX_HOST_LINE = 16 * 1024 * 1024
MAX_IN_FLIGHT = 64  # requests handled at once


class HostServer:
    """One host session; `around` is section 25's HostAround."""

    def __init__(self, stdin, stdout, around):
        self.stdin, self.stdout, self.around = stdin, stdout, around
        self.write_lock = threading.Lock()
        self.ready = threading.Event()
        self.done = threading.Event()
        self.gate = None
        self.protocol = PROTOCOL_VERSIONS[-1]
        self.client = ""  # self-reported in initialize; the policy's `client`
        self.calls = {}
        self.calls_lock = threading.Lock()
        self.running = 0  # accepted requests not yet answered
        self.stopping = False
        self.failed = ""

    def start(self):
        self.frames = read_frames(self.stdin.fileno(), MAX_HOST_LINE)
        threading.Thread(target=self._read_loop, daemon=True).start()

    def serve_with(self, gate, status):
        # `gate` is stored before `client` is read, and _initialize stores `client` before it
        # reads `gate`: either way the gate gets the host's name.
        self.gate, self.status, self.status_tool = gate, status, status.listing["name"]
        gate.client = self.client
        self.ready.set()

    def fail(self, reason):
        self.failed = reason
        self.ready.set()

    def send(self, message):
        """Write one message, or a batch's list of answers, as one line."""
        if not message:
            return
        try:
            data = canonical(message) + b"\n"
        except (UnicodeEncodeError, TypeError) as err:  # never expected: ids are checked
            log(f"internal error: an answer could not be encoded ({err})")
            data = canonical(rpc_error(None, -32600, "the answer could not be encoded")) + b"\n"
        with self.write_lock:
            try:
                self.stdout.write(data)
                self.stdout.flush()
            except (OSError, ValueError):
                self.done.set()

    def _read_loop(self):
        """Read frames until one is a request: run it here while a worker reads on. The next
        reader resumes the generator only after it yielded: never two threads in it at once."""
        for frame, ident in self.frames:
            # No frame ends the reader: what follows would go unanswered, and closing stdin
            # would no longer stop the gate.
            try:
                if frame is None:
                    self.send(rpc_error(None if ident is None else Number(str(ident)), -32600,
                                        f"the message is larger than {MAX_HOST_LINE} bytes"))
                    continue
                request = self._frame(frame) if frame.strip() else None
            except Exception as err:
                log(f"internal error: a message could not be handled ({type(err).__name__}: "
                    f"{err})")
                self.send(rpc_error(None, -32603, "the message could not be handled"))
                continue
            if callable(request):
                self.around.workers.submit(self._read_loop)
                request()
                return
            self.send(request)
        self.done.set()

    def _frame(self, line):
        """A frame's answer, or the work it asks (a call, a batch)."""
        invalid = None
        try:
            message = parse(line)
        except CanonicalError as err:
            # A tools/call whose arguments the boundary check refuses still gets a run and an
            # INVALID answer, with the frame recorded as it came; anything else gets -32700.
            message = parse_loosely(line)
            message = message if isinstance(message, dict) else {}
            invalid = (SLOT_PROSE["unusable_arguments"].format(error=err), recorded_frame(line))
            ident = message.get("id")
            if message.get("method") != "tools/call" or "id" not in message:
                return rpc_error(ident if echoable_id(ident) else None, -32700,
                                 f"the message is not usable JSON: {err}")
        if isinstance(message, list):
            return self._batch(message)
        if isinstance(message, dict):
            return self._message(message, invalid)
        return rpc_error(None, -32600, "a message must be a JSON-RPC object")

    def _batch(self, messages):
        if self.protocol not in BATCH_VERSIONS or not messages:
            return rpc_error(None, -32600,
                             f"batches are not part of protocol version {self.protocol}")
        # A batch is one request in flight, its members handled in order on one thread.
        if not self._admit():
            return [busy_error(m.get("id") if isinstance(m, dict) and echoable_id(m.get("id"))
                               else None) for m in messages]

        def run():
            try:
                answers = [self._message(m, None, batch=True) if isinstance(m, dict) else
                           rpc_error(None, -32600, "a batch member must be a JSON-RPC object")
                           for m in messages]
                self.send([a for a in answers if a])
            finally:
                self._release()
        return run

    def _admit(self):
        with self.calls_lock:
            if self.running >= MAX_IN_FLIGHT:
                return False
            self.running += 1
            return True

    def _release(self):
        with self.calls_lock:
            self.running -= 1

    def _message(self, message, invalid, batch=False):
        """A request's answer (None to a notification), or the work that sends it."""
        method, ident = message.get("method"), message.get("id")
        params = message.get("params") if isinstance(message.get("params"), dict) else {}
        if not isinstance(method, str):
            if "id" in message and ("result" in message or "error" in message):
                return None  # a response to a request agentgate never sends
            return rpc_error(ident if echoable_id(ident) else None, -32600,
                             "a request needs a method")
        if "id" not in message:
            if method == "notifications/cancelled":
                with self.calls_lock:
                    cancelled = self.calls.get(_id_key(params.get("requestId")))
                if cancelled:
                    cancelled.set()
            elif method in self.around.notifications:
                self.around.notifications[method](self, params)
            return None
        if not echoable_id(ident):
            # Checked before anything is recorded: no run for an id that cannot be echoed.
            return rpc_error(None, -32600,
                             "the id must be a string or a number that can be written as JSON")
        if method == "tools/call":
            # Known as it is read, so a cancellation read after it finds it.
            cancelled, id_key = threading.Event(), _id_key(ident)
            with self.calls_lock:
                self.calls[id_key] = cancelled

            def call():
                try:
                    return self._call(params, invalid, batch, cancelled)
                finally:
                    self._forget(id_key, cancelled)
            work = self._after_ready(ident, call, batch)
            if isinstance(work, dict) and not batch:  # refused busy: never runs
                self._forget(id_key, cancelled)
            return work
        if method == "tools/list":
            return self._after_ready(ident, self._tool_list, batch)
        if method == "initialize":
            self._initialize(params)
        handler = self.around.requests.get(method)
        if handler is None:
            return rpc_error(ident, -32601, f"method {quote(method)} is not offered")
        return {"jsonrpc": "2.0", "id": ident, "result": handler(self, params)}

    def _initialize(self, params):
        requested = params.get("protocolVersion")
        self.protocol = requested if requested in PROTOCOL_VERSIONS else PROTOCOL_VERSIONS[-1]
        info = params.get("clientInfo")
        name = info.get("name") if isinstance(info, dict) else None
        self.client = name[:200] if isinstance(name, str) else ""
        if self.gate is not None:
            self.gate.client = self.client

    def _after_ready(self, ident, work, batch):
        """`work` once the servers are ready, at most MAX_IN_FLIGHT at once (a flood grows no
        threads): a batch member's answer, else the work that sends it."""
        accepted = not self.stopping  # on the reader: a call read before stdin closed runs
        if accepted and not batch and not self._admit():
            return busy_error(ident)

        def run():
            try:
                self.ready.wait()
                if self.failed or not accepted:
                    reason = CALL_ERRORS["stopping" if not accepted else "unloaded"]
                    response = rpc_error(ident, -32603, reason)
                else:
                    try:
                        result = work()
                    except ToolNotOffered as err:
                        response = rpc_error(ident, -32602, str(err))
                    except PassedError as err:
                        response = {"jsonrpc": "2.0", "id": ident, "error": err.error}
                    except Exception as err:  # a bug: say so plainly, keep the session
                        log(f"internal error: {type(err).__name__}: {err}")
                        response = rpc_error(ident, -32603, CALL_ERRORS["failed"])
                    else:
                        if result is None:  # a call the host cancelled: no answer
                            return None
                        response = {"jsonrpc": "2.0", "id": ident, "result": result}
                if batch:
                    return response
                self.send(response)  # before the release: shutdown waits for every answer
            finally:
                if accepted and not batch:
                    self._release()
        return run() if batch else run

    def _tool_list(self):
        quarantined = self.gate.quarantined  # replaced whole: read once
        return {"tools": [t.listing for t in self.gate.tools.values()
                          if t.name not in quarantined] + [self.status.listing]}

    def _forget(self, id_key, cancelled):
        with self.calls_lock:
            if self.calls.get(id_key) is cancelled:
                del self.calls[id_key]

    def _call(self, params, invalid, batch, cancelled):
        name = params.get("name")
        args = params.get("arguments")
        if name == self.status_tool:
            return self.status.call(args, invalid)
        tool = self.gate.tools.get(name) if isinstance(name, str) else None
        if tool is None:
            raise ToolNotOffered(CALL_ERRORS["unknown_tool"].format(name=quote(str(name))))
        if tool.name in self.gate.quarantined:
            return answer("DENIED", "TOOL_CHANGED").result()
        meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else {}
        token = meta.get("progressToken")
        progress = self.around.progress(self, token, cancelled) \
            if not batch and echoable_id(token) else None
        answered = self.gate.call(tool, args, invalid, progress, cancelled)
        if cancelled.is_set() and not batch:
            return None
        result = answered.result()
        if "error" in result:
            raise PassedError(result["error"])
        if answered.passed is None and "outputSchema" in tool.listing:
            # A host refuses a result lacking the structured content an output schema promises;
            # the gate's own answers carry none, so they go as errors.
            result["isError"] = True
        return result


class ToolNotOffered(Exception):
    """A tools/call naming a tool the gate does not offer."""


class PassedError(Exception):
    """A server's JSON-RPC error to a tools/call, to be answered as it came."""

    def __init__(self, error):
        super().__init__(error["message"])
        self.error = error


def _id_key(ident):
    return canonical(ident) if echoable_id(ident) else None


def rpc_error(ident, code, message):
    """Every JSON-RPC error answer the host is sent."""
    return {"jsonrpc": "2.0", "id": ident, "error": {"code": code, "message": message}}


def busy_error(ident):
    return rpc_error(ident, -32000, CALL_ERRORS["busy"].format(limit=MAX_IN_FLIGHT))


# =============================================================================================
# 9b. What an operator decides on
#
# Reads as: decision core
#
# Owns: the printout of every operator decision, and its yes.
# Promises: a decision binds only what was shown whole. A value
# over SHOWN_WHOLE bytes is shown as its head, size and tail, and
# then nothing is agreed to until every byte was shown (-full; f in
# watch). An approval is shown only while its row hashes to its
# hash. Every line is sanitized (tell, or watch's Screen.put).
# Refuses nothing itself: a refusal is a value its caller raises.
# =============================================================================================

SHOWN_WHOLE = 480  # bytes of a value printed whole without -full


def shown_text(text, full):
    """(text, its bytes, whether it was cut)."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size <= SHOWN_WHOLE or full:
        return text, size, False
    head = cut(text, SHOWN_WHOLE // 2)
    tail = text[-SHOWN_WHOLE // 4:]
    return f"{head} [... {size} bytes in all ...] {tail}", size, True


def intact(approval):
    """The approval, if its fields still hash to its hash: only
    then is what it shows what it binds."""
    if stored_hash(approval) != approval["hash"]:
        raise StoreError(
            f"approval {approval['id']} does not match its hash: its "
            f"record was altered after it was made, and it cannot be "
            f"decided")
    return approval


def approval_printout(store, approval, full, cautions):
    """approval_shown, and why the policy asked: what approve,
    reject, watch and grant show."""
    late = store.late_outcomes(approval["run_id"])
    lines, shortened = approval_shown(intact(approval), full, late,
                                      cautions)
    step = next(s for s in store.steps(approval["run_id"])
                if s["id"] == approval["step_id"])
    tried = sanitize(tried_text(step))
    return lines + [tried] * bool(tried), shortened


def approval_shown(approval, full, late, cautions):
    """(sanitized lines, whether a value was shortened). `late`:
    outcomes of cut-off attempts that came after a takeover;
    `cautions(name, text)`: what in a value reads as it is not."""
    shown = parse(approval["presentation_json"])
    request = parse(approval["request_json"])
    tool = request["spec"]["name"]
    lines = [f"APPROVAL WAITING  {approval['id']}"]
    for label, value in (
            ("kind", approval["kind"]), ("tool", tool),
            ("run", approval["run_id"]),
            ("created", approval["created_at"]),
            ("expires", approval["expires_at"] or "never"),
            ("server", shown.get("server", "")),
            ("upstream tool", shown.get("tool", ""))):
        lines.append(f"  {label:<14} {value}")
    args = request["args"]
    args = args if isinstance(args, dict) else {}
    lines.append("  arguments:" + ("" if args else " (none)"))
    shortened = _value_lines(lines, args, full, cautions)
    if shown.get("fixed"):
        lines.append("  fixed values (set by the configuration, "
                     "sent with the arguments):")
        shortened |= _value_lines(lines, shown["fixed"], full,
                                  cautions)
    for label in ("question", "reason", "decided_by", "limit",
                  "frees", "notice"):
        if shown.get(label):
            name = label.replace("_", " ")
            lines.append(f"  {name:<14} {shown[label]}")
    cut_off = parse(approval["capability_json"]).get("interrupted")
    for step_id, observation in late:
        if step_id == (cut_off or {}).get("step_id"):
            text, _, cut_here = shown_text(
                outcome_text(observation), full)
            shortened |= cut_here
            said = late_text(observation, text)
            lines.append(f"  LATE OUTCOME   {said}")
    lines.append(f"----- end of approval {approval['id']} for "
                 f"tool {tool} -----")
    return [sanitize(line) for line in lines], shortened


def _value_lines(lines, values, full, cautions):
    shortened = False
    for name, value in values.items():
        raw = value if isinstance(value, str) else policy_json(value)
        shown, size, cut_here = shown_text(raw, full)
        # A string shows as its JSON string: a newline or a control
        # is seen as its escape, never as layout.
        if isinstance(value, str):
            shown = policy_json(shown)
        shortened |= cut_here
        lines.append(f"    {name} = {shown}   ({size} bytes)")
        lines += [f"      CAUTION  {note}"
                  for note in cautions(name, raw)]
    return shortened


def late_text(observation, text=None):
    """A late outcome as a sentence; its text whole unless given."""
    text = outcome_text(observation) if text is None else text
    if step_outcome(observation) == "ok":
        what = f"it succeeded, with this result: {text}"
    else:
        what = f"it failed: {text}"
    return ("the attempt that was cut off did finish after all, "
            f"after its run was taken over: {what}")


def tried_text(step):
    """Why no `when` entry of the rule decided the step."""
    record = parse(step["policy"]) if step["policy"] else {}
    tried = record.get("tried")
    return f"no when entry held: {'; '.join(tried)}" if tried else ""


def unshown(shortened, what, verb, how):
    """'' if a printout showed every byte, else why it decides
    nothing until `how` shows them."""
    if not shortened:
        return ""
    return (f"{how} to show every byte before you {verb}: {what} has "
            f"a value too long to print whole, so it was shown "
            f"shortened")


def confirmed(lines, out, shortened=False, what="", verb="",
              agreed=True):
    """Print every line; then True for a yes to exactly them (the
    flag `agreed`, or typed at a terminal), False for a no, or why
    nothing may be decided: a sentence, or '' with no terminal."""
    tell(*lines, out=out, flush=True)
    why = unshown(shortened, what, verb,
                  "run the command again with -full")
    if why or agreed:
        return why or True
    if not sys.stdin.isatty():
        return ""
    tell(f"{verb} {what}? type yes to {verb}: ", end="", out=out,
         flush=True)
    return input().strip().lower() in ("y", "yes")


# =============================================================================================
# 10. Canonical JSON
#
# Reads as: library
#
# Contract: parse(data), bytes or text, returns one JSON value: objects as dicts, arrays as
# lists, each number a Number holding its literal as written (`10`, `10.0` and `1e1` stay three
# values; no float rounds an amount). It raises CanonicalError with the first reason, in this
# order, unless the document is nested at most 256 deep, valid UTF-8, one RFC 8259 value, and
# free of unpaired surrogate escapes, repeated keys, float64 overflow inside a container and
# number literals over 10,000 characters or with an exponent past ±10,000. canonical(value),
# the form hashes and request keys are taken over, has no whitespace, keys sorted by code
# point, each Number as its literal, and in strings `"`, `\`, control characters (\n, \t, ...
# or lower-case \u00xx), `<`, `>`, `&`, U+2028 and U+2029 escaped, the rest as itself;
# policy_json is it without the last five escapes, pretty_json that indented for people.
# Differential test: tests/test_canonical.py encodes a generated corpus, spelled with random
# whitespace and escapes, and compares each form with an encoder written from the reference in
# the test; it mutates the corpus byte by byte and finds parse refusing as not UTF-8 or not
# JSON exactly what node's TextDecoder and JSON.parse refuse.
# =============================================================================================

MAX_DEPTH = 256
MAX_NUMBER_CHARS = 10000
MAX_EXPONENT = 10000
# Sums are exact: the precision spans any literal the parser admits (its digits, exponents to
# ±MAX_EXPONENT), and a result that would still round raises rather than rounds.
EXACT = decimal.Context(prec=2 * MAX_EXPONENT + MAX_NUMBER_CHARS + 64, Emax=10 * MAX_EXPONENT,
                        Emin=-10 * MAX_EXPONENT, traps=[decimal.Inexact, decimal.Overflow,
                                                        decimal.InvalidOperation])


class CanonicalError(ValueError):
    """A document parse refuses; `place` ("line 3 column 14", or '') is where one that is not
    JSON stops being so, for placed() to name in a file a person edits."""

    def __init__(self, message, place=""):
        super().__init__(message)
        self.place = place

    def placed(self):
        return f"{self} at {self.place}" if self.place else str(self)


class Number:
    __slots__ = ("literal",)

    def __init__(self, literal):
        self.literal = literal

    def __eq__(self, other):
        return isinstance(other, Number) and other.literal == self.literal

    def __hash__(self):
        return hash(self.literal)

    def __repr__(self):
        return self.literal

    def exact(self):
        return decimal.Decimal(self.literal)

    def is_integer(self):
        value = self.exact()
        return value == value.to_integral_value()


# A string once its escapes are gone (an unclosed one runs to the end); brackets of either
# kind as one kind, and every other byte dropped.
_STRING_RE = re.compile(rb'"[^"]*"?')
_ONE_KIND = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


def _too_deep(data):
    """Whether the document nests past MAX_DEPTH, counting brackets outside strings. Each step
    is a C scan or one turn of a Python loop over what is left, so a hostile 16 MB frame costs
    time in proportion to its size and never holds the interpreter's lock from the heartbeat.

    Why the answer is exact for a valid document (the direction that matters: a document this
    passes goes to a decoder that would accept nesting past the bound; one that is not JSON is
    refused either way, only its reason varies):
    1. A document's depth is at most its count of opening brackets, strings included.
    2. Outside strings valid JSON has no backslash, and inside one, the first backslash of a
       run begins an escape. replace() pairs a run's backslashes from its start, as escapes
       pair them, so removing `\\\\` removes exactly the escaped backslashes; every backslash
       left then begins an escape, and removing `\\"` removes exactly the escaped quotes.
    3. Every quote left opens or closes a string, so _STRING_RE, matching from the first,
       removes exactly the strings; what is left are the structural brackets, properly nested,
       and folding `{}` into `[]` keeps each one's depth.
    4. Each `[]` holds nothing and no two overlap, so a pass removes all of them and changes no
       other pair's depth; every deepest pair is one, and each holder of one remains, so a pass
       lowers the depth by exactly one. After `passes` passes the document is too deep exactly
       when what is left is deeper than MAX_DEPTH - passes.
    """
    if data.count(b"[") + data.count(b"{") <= MAX_DEPTH:
        return False  # too few openings to be too deep (1): the common case
    data = data.replace(b"\\\\", b"").replace(b'\\"', b"")  # (2)
    data = _STRING_RE.sub(b"", data).translate(_ONE_KIND, _NOT_BRACKETS)  # (3)
    # (4) An unbalanced sequence (not JSON) is counted as it is.
    passes = 0
    while passes < 8 and data.count(b"[") * 2 == len(data):
        shorter = data.replace(b"[]", b"")
        if shorter == data:
            break
        data, passes = shorter, passes + 1
    depth, limit = 0, MAX_DEPTH - passes
    for byte in data:
        depth += 1 if byte == 0x5B else -1
        if depth > limit:
            return True
    return False


def number_bound(literal):
    """The reason a number literal is past the bound, or ''."""
    if len(literal) > MAX_NUMBER_CHARS:
        return f"number {literal[:24]}... is longer than {MAX_NUMBER_CHARS} characters"
    mantissa, e, exponent = literal.lower().partition("e")
    if e:
        digits = exponent.lstrip("+-").lstrip("0")
        if len(digits) > 5 or (digits and int(digits) > MAX_EXPONENT):
            return f"number {literal[:24]} has an exponent beyond ±{MAX_EXPONENT}"
    return ""


# A number literal as RFC 8259 writes one.
JSON_NUMBER_RE = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
SURROGATE_RE = re.compile("[\ud800-\udfff]")


def _first_surrogate(value, objects=True):
    """The first lone surrogate in a value; with objects=False, objects are not entered
    (the parser's pairs hook has already looked inside each of them)."""
    if isinstance(value, str):
        match = SURROGATE_RE.search(value)
        return match.group() if match else ""
    if isinstance(value, list):
        for item in value:
            found = _first_surrogate(item, objects)
            if found:
                return found
    elif isinstance(value, dict) and objects:
        for key, item in value.items():
            found = _first_surrogate(key) or _first_surrogate(item)
            if found:
                return found
    return ""


class _Reading:
    """What the decoder's hooks found in one document: the first repeated key, float64
    overflow, number past the bound and lone surrogate. Each document has its own record and
    decoder, so a fault is never reported for another document read at the same time."""

    def __init__(self):
        self.repeated = self.overflow = self.bound = self.surrogate = None

    def decode(self, text):
        # Not kept: the decoder holds this record's hooks, a cycle only the collector frees.
        return json.JSONDecoder(object_pairs_hook=self.pairs, parse_int=self.number,
                                parse_float=self.number,
                                parse_constant=_read_constant).decode(text)

    def number(self, literal):
        reason = number_bound(literal)
        if reason and not self.bound:
            self.bound = reason
        if not reason and not self.overflow and math.isinf(float(literal)):
            self.overflow = literal
        return Number(literal)

    def pairs(self, items):
        # Every pair is seen, even one a repeated key replaces: its surrogate is reported first.
        obj = {}
        for key, value in items:
            if not self.surrogate:
                self.surrogate = _first_surrogate(key) or _first_surrogate(value, objects=False)
            if key in obj and self.repeated is None:
                self.repeated = key
            obj[key] = value
        return obj


def _read_constant(name):
    raise ValueError(name)


def parse(data):
    """One document through the boundary check. The first failing check, in the contract's
    order, gives the reason, so a document with two faults always gets the same one."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    if _too_deep(data):
        raise CanonicalError(f"nested deeper than {MAX_DEPTH} levels")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CanonicalError("not valid UTF-8") from None
    reading = _Reading()
    try:
        value = reading.decode(text)
    except (ValueError, RecursionError) as err:
        place = f"line {err.lineno} column {err.colno}" \
            if isinstance(err, json.JSONDecodeError) else ""
        raise CanonicalError("not valid JSON", place) from None
    surrogate = reading.surrogate or _first_surrogate(value, objects=False)
    if surrogate:
        raise CanonicalError(f"unpaired surrogate \\u{ord(surrogate):04x}")
    if reading.repeated is not None:
        raise CanonicalError(f"duplicate key {json.dumps(reading.repeated, ensure_ascii=False)}")
    # The anchor's decoder fails on a float64 overflow inside a container, not on a whole one.
    if reading.overflow and not isinstance(value, Number):
        raise CanonicalError(f"number {reading.overflow[:24]} is beyond the range of a float64")
    if reading.bound:
        raise CanonicalError(reading.bound)
    return value


_HTML_ESCAPES = (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                 ("\u2029", "\\u2029"))
# The contract's escaping short of _HTML_ESCAPES: json.dumps(s, ensure_ascii=False)'s, in C.
encode_string = json.encoder.encode_basestring


def _html(text):
    """_HTML_ESCAPES applied to an encoding: those characters stand only inside strings and no
    escape writes one, so this escapes exactly the strings'."""
    for ch, escape in _HTML_ESCAPES:
        if ch in text:
            text = text.replace(ch, escape)
    return text


def _encode(value, out):
    """The encoding, in pieces appended to `out`. Measured no slower than the standard
    library's C encoder with each Number marked and replaced, so it is the only encoder."""
    if isinstance(value, str):
        out.append(encode_string(value))
    elif isinstance(value, Number):
        out.append(value.literal)
    elif isinstance(value, dict):
        out.append("{")
        comma = ""
        for key in sorted(value):
            out.append(comma + encode_string(key) + ":")
            _encode(value[key], out)
            comma = ","
        out.append("}")
    elif isinstance(value, (list, tuple)):
        out.append("[")
        comma = ""
        for item in value:
            out.append(comma)
            _encode(item, out)
            comma = ","
        out.append("]")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif value is None:
        out.append("null")
    elif isinstance(value, int):
        out.append(str(value))
    elif isinstance(value, float):
        out.append(repr(value) if value == value and abs(value) != float("inf") else "null")
    else:
        raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def _encoded(value, html):
    out = []
    _encode(value, out)
    text = "".join(out)
    return _html(text) if html else text


def canonical(value):
    """_HTML_ESCAPES keep these bytes the same whatever tool embeds them in HTML or
    JavaScript."""
    return _encoded(value, True).encode("utf-8")


def dumps(value):
    """The canonical form as text, for the store."""
    return canonical(value).decode("utf-8")


def policy_json(value):
    """The canonical form without _HTML_ESCAPES: what people and the policy read."""
    return _encoded(value, False)


FLAT_WIDTH = 72


def pretty_json(value, indent="  ", level=0, flat=None, ordered=False):
    """The policy form indented for people; values nested `flat` levels deep stay on one line
    when it is short. `ordered` keeps the keys in the order read (a host's own file)."""
    if flat is not None and level >= flat and len(policy_json(value)) <= FLAT_WIDTH:
        return policy_json(value)
    if isinstance(value, dict) and value:
        inner = indent * (level + 1)
        items = [f"{inner}{encode_string(k)}: "
                 f"{pretty_json(value[k], indent, level + 1, flat, ordered)}"
                 for k in (value if ordered else sorted(
                     value, key=lambda k: k.encode("utf-8", "surrogatepass")))]
        return "{\n" + ",\n".join(items) + "\n" + indent * level + "}"
    if isinstance(value, list) and value:
        inner = indent * (level + 1)
        items = [inner + pretty_json(v, indent, level + 1, flat, ordered) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + indent * level + "]"
    return policy_json(value)


# =============================================================================================
# 11. Text safe to show
#
# Reads as: library
#
# Contract: sanitize(text or UTF-8 bytes) shows as ASCII what could move the cursor, reorder
# or hide text, or draw a line: \r and \n as a space, other C0/C1 controls and DEL as \xNN,
# a lone surrogate (or invalid byte) as U+FFFD, the INVISIBLE characters (bidi controls,
# zero-width, soft hyphen, U+180E, U+FEFF, U+2028/9, tags, every other format character a
# terminal draws as nothing, and the interlinear annotation marks, which hide the text between
# them where they are honoured) as \u{XXXX}; past MAX_COMBINING
# combining marks in a row, the rest are counted, not kept. Nothing else changes, and a second
# pass changes nothing. cut keeps at most `limit` UTF-8 bytes, on a character boundary, marked
# '…'; clean is both; quote puts sanitized text in double quotes, `"` and `\` escaped.
# tell is the one way a line reaches a person: each argument one line, sanitized whole; log is
# a line of it to stderr. A result passed back to the host is the server's, never sanitized.
# Differential test: tests/test_sanitize_differential.py finds every code point assigned in
# Python's and node's Unicode kept, escaped or counted as node's Unicode properties say.
# =============================================================================================

INVISIBLE = (set(range(0x202A, 0x202F)) | set(range(0x2066, 0x2070)) | {0x061C, 0x200E, 0x200F}
             | set(range(0x200B, 0x200E)) | set(range(0x2060, 0x2065)) | {0xFFF9, 0xFFFA, 0xFFFB}
             | {0xFEFF, 0x00AD, 0x180E, 0x2028, 0x2029} | set(range(0xE0000, 0xE0080))
             | set(range(0x1BCA0, 0x1BCA4)) | set(range(0x1D173, 0x1D17B)))
# The same table as one character class, so text with nothing to change costs one scan in C.
_NEEDS_CARE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff%s]"
                         % "".join(map(chr, sorted(INVISIBLE))))
MAX_COMBINING = 4


def sanitize(text):
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if not _NEEDS_CARE.search(text) and not _has_long_combining_run(text):
        return text
    out, marks, dropped = [], 0, 0
    for ch in text:
        code = ord(ch)
        if unicodedata.category(ch).startswith("M"):
            marks += 1
            if marks > MAX_COMBINING:
                dropped += 1
                continue
            out.append(ch)
            continue
        if dropped:
            out.append(f"[+{dropped} combining marks dropped]")
        marks, dropped = 0, 0
        if ch in "\r\n":
            out.append(" ")
        elif code < 0x20 or 0x7F <= code <= 0x9F:
            out.append(f"\\x{code:02x}")
        elif 0xD800 <= code <= 0xDFFF:
            out.append("\ufffd")
        elif code in INVISIBLE:
            out.append(f"\\u{{{code:04x}}}")
        else:
            out.append(ch)
    if dropped:
        out.append(f"[+{dropped} combining marks dropped]")
    return "".join(out)


# Every combining mark is at or above U+0300: only runs of such characters are looked at one
# by one, so plain text costs one scan in C.
_MAYBE_MARKS = re.compile("[\u0300-\U0010ffff]{%d,}" % (MAX_COMBINING + 1))


def _has_long_combining_run(text):
    for candidate in _MAYBE_MARKS.finditer(text):
        run = 0
        for ch in candidate.group():
            run = run + 1 if unicodedata.category(ch).startswith("M") else 0
            if run > MAX_COMBINING:
                return True
    return False


def cut(text, limit):
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return text
    marker = "…".encode("utf-8")
    room = limit - len(marker) if limit >= len(marker) else limit
    head = data[:room].decode("utf-8", "ignore")
    return head + ("…" if limit >= len(marker) else "")


def clean(text, limit):
    """Cut before it is sanitized too: a long string costs no more than its first `limit`."""
    return cut(sanitize(cut(text[:limit + 1], limit)), limit)


def quote(text):
    return '"' + sanitize(text).replace("\\", "\\\\").replace('"', '\\"') + '"'


def tell(*lines, out=None, end="\n", flush=False):
    """The one way text reaches a person: each argument one line, sanitized whole, so no value
    draws a line of its own (sanitizing twice changes nothing)."""
    out = sys.stdout if out is None else out
    out.write("\n".join(sanitize(line) for line in lines or ("",)) + end)
    if flush:
        out.flush()


def log(message):
    """One line to stderr; stdout carries only protocol."""
    try:
        tell(f"{PROGRAM}: {message}", out=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


# =============================================================================================
# 12. ECMA-262 patterns
#
# Reads as: library
#
# Contract: compile_pattern(text) accepts the ECMA-262 (u-mode) patterns JSON Schema's `pattern`
# and `patternProperties` are written in, or raises PatternError naming why; Pattern.search
# answers as a JavaScript engine's RegExp.prototype.test would, in time linear in the text (a
# lazily built DFA over an NFA, no backtracking), and PatternWork bounds the work of one call's
# searches in characters x pattern size. Differential test: tests/test_patterns.py gives every
# text the answer node's RegExp gives, and refuses what node rejects.
# =============================================================================================

# Not Python's re: its dialect differs (\s, ., $, {,2}), so a verdict could pass what the
# server's validator refuses, and it backtracks (^(a+)+$ doubles its work per character,
# holding the interpreter's lock). A pattern is parsed to a tree of tuples, compiled to a
# Thompson NFA and run as a DFA built lazily, one cached transition per (state, character),
# over code points as the u flag reads them. Refused besides ECMA-262's SyntaxErrors, as a
# DFA cannot run or bound them: backreferences, lookaround, \p{..}, escaped group names,
# counts above 1000, groups nested over 100 deep, more than 10,000 NFA states.

_MAX_CODE_POINT = 0x10FFFF
_MAX_COUNT = 1000       # largest n or m accepted in {n,m}
_MAX_STATES = 10000     # largest NFA accepted: bounds compile time and the cost of one DFA step
_PATTERN_DEPTH = 100    # deepest group nesting accepted: keeps recursion far from Python's limit
_CACHE_BUDGET = 50000   # cached NFA positions + transitions per pattern before the DFA is dropped

# A character set is a tuple of sorted, disjoint, non-adjacent (lo, hi) code point ranges.
_DIGIT = ((0x30, 0x39),)
_WORD_RANGES = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
          (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))
_LINE_TERMINATORS = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))
_WORD_CHARS = frozenset("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz")
_ASSERTIONS = (("^", "^"), ("$", "$"), ("\\b", "b"), ("\\B", "B"))
_LOOKAROUND = (("(?=", "lookahead"), ("(?!", "lookahead"),
               ("(?<=", "lookbehind"), ("(?<!", "lookbehind"))
_QUANTIFIER = re.compile(r"(?:([*+?])|\{([0-9]+)(,([0-9]*))?\})\??")   # a lazy ? changes nothing
_SURROGATE_PAIR = re.compile(r"\\u([dD][89abAB][0-9a-fA-F]{2})\\u([dD][c-fC-F][0-9a-fA-F]{2})")
_HEX_ESCAPE = re.compile(r"\\(?:x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|u\{([0-9a-fA-F]+)\})")


class PatternError(ValueError):
    """A pattern refused at compile; the message is one sentence saying what is wrong."""


def _negate(ranges):
    out, lo = [], 0
    for a, b in ranges:
        if a > lo:
            out.append((lo, a - 1))
        lo = b + 1
    return tuple(out + [(lo, _MAX_CODE_POINT)] if lo <= _MAX_CODE_POINT else out)


def _normalize(ranges):
    out = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(hi, out[-1][1]))
        else:
            out.append((lo, hi))
    return tuple(out)


def _contains(ranges, cp):
    i = bisect.bisect_right(ranges, (cp, _MAX_CODE_POINT)) - 1   # the last range starting <= cp
    return i >= 0 and cp <= ranges[i][1]


def _as_ranges(member):   # a code point (int) or already a set
    return ((member, member),) if isinstance(member, int) else member


_DOT = _negate(_LINE_TERMINATORS)
# What a backslash and one character stand for: a code point, or a set (\d \D \s \S \w \W).
# Of the punctuation, u mode lets a backslash make only the syntax characters and / literal.
_ESCAPES = {"t": 0x09, "n": 0x0A, "v": 0x0B, "f": 0x0C, "r": 0x0D, "d": _DIGIT,
            "D": _negate(_DIGIT), "w": _WORD_RANGES, "W": _negate(_WORD_RANGES), "s": _SPACE,
            "S": _negate(_SPACE)}
_ESCAPES.update((c, ord(c)) for c in "^$\\.*+?()[]{}|/")
_CLASS_ESCAPES = {**_ESCAPES, "b": 0x08, "-": 0x2D}   # inside [...], \b is a backspace


# ---- Parsing: ECMA-262 Pattern[+UnicodeMode] to a tree ---------------------------------------
# ('set', ranges) one character in ranges        ('assert', '^' or '$' or 'b' or 'B')
# ('cat', [node, ...]) a sequence, maybe empty   ('alt', [node, ...]) alternatives
# ('rep', node, lo, hi) lo to hi copies, hi None for no bound. Groups leave no node of their
# own, and lazy quantifiers read like greedy ones: a yes/no search cannot tell them apart.

class _Parser:
    def __init__(self, source):
        self.src, self.pos, self.depth, self.names = source, 0, 0, set()

    def peek(self, ahead=0):   # "" past the end
        return self.src[self.pos + ahead:self.pos + ahead + 1]

    def take(self, text):
        if self.src.startswith(text, self.pos):
            self.pos += len(text)
            return True
        return False

    def disjunction(self):
        alternatives = [[]]
        while self.peek() not in ("", ")"):
            if self.take("|"):
                alternatives.append([])
            else:
                alternatives[-1].append(self.term())
        nodes = [("cat", terms) for terms in alternatives]
        return nodes[0] if len(nodes) == 1 else ("alt", nodes)

    def term(self):
        for text, kind in _ASSERTIONS:
            if self.take(text):
                if _QUANTIFIER.match(self.src, self.pos):   # u mode: assertions cannot repeat
                    raise PatternError(f"nothing to repeat at offset {self.pos}")
                return ("assert", kind)
        atom = self.atom()
        bounds = self.quantifier()
        return ("rep", atom) + bounds if bounds else atom

    def quantifier(self):
        """Consume * + ? {n} {n,} {n,m} if next; return (lo, hi), hi None when unbounded."""
        m = _QUANTIFIER.match(self.src, self.pos)
        if not m:
            return None
        simple, lo, comma, hi = m.groups()
        if simple:
            self.pos = m.end()
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[simple]
        hi = lo if comma is None else hi or None
        if len(lo) > 4 or int(lo) > _MAX_COUNT or (hi and (len(hi) > 4 or int(hi) > _MAX_COUNT)):
            raise PatternError(f"repetition counts above {_MAX_COUNT} are not supported")
        if hi and int(hi) < int(lo):
            raise PatternError(f"the numbers in the quantifier at offset {self.pos} are out "
                               f"of order")
        self.pos = m.end()
        return int(lo), None if hi is None else int(hi)

    def atom(self):
        c, at = self.peek(), self.pos
        if c == "(":
            return self.group()
        if c == "\\":
            return ("set", _as_ranges(self.escape(in_class=False)))
        if _QUANTIFIER.match(self.src, at):
            raise PatternError(f"nothing to repeat at offset {at}")
        if c in ("{", "}", "]"):
            raise PatternError(f"a lone {c} is not allowed (write \\{c})")
        self.pos += 1
        if c == "[":
            return ("set", self.character_class(at))
        return ("set", _DOT if c == "." else ((ord(c), ord(c)),))

    def group(self):
        at = self.pos
        for text, kind in _LOOKAROUND:
            if self.src.startswith(text, at):
                raise PatternError(f"{kind} {text} is not supported")
        self.pos += 1
        if self.take("?<"):
            self.group_name()
        elif self.take("?") and not self.take(":"):
            raise PatternError(f"the group at offset {at} has an unknown (? form")
        self.depth += 1
        if self.depth > _PATTERN_DEPTH:
            raise PatternError(f"groups nested more than {_PATTERN_DEPTH} deep are not supported")
        node = self.disjunction()
        self.depth -= 1
        if not self.take(")"):
            raise PatternError(f"unbalanced parenthesis at offset {at}")
        return node

    def group_name(self):
        end = self.src.find(">", self.pos)
        name = self.src[self.pos:end] if end >= 0 else ""
        if not name.replace("$", "_").isidentifier():   # so escapes like \u0061 are refused
            raise PatternError(f"the group name at offset {self.pos} is not a plain identifier")
        if name in self.names:
            raise PatternError(f"the group name {name} is used twice")
        self.names.add(name)
        self.pos = end + 1

    def character_class(self, at):
        negated, ranges = self.take("^"), []
        while not self.take("]"):
            if self.pos >= len(self.src):
                raise PatternError(f"the character class at offset {at} is not closed")
            first = self.class_member()
            if self.peek() == "-" and self.peek(1) not in ("", "]"):   # a range first-last
                self.pos += 1
                last = self.class_member()
                if not (isinstance(first, int) and isinstance(last, int)):
                    raise PatternError(f"a range in the class at offset {at} uses \\d, \\s or \\w")
                if first > last:
                    raise PatternError(f"a range in the class at offset {at} is out of order")
                ranges.append((first, last))
            else:
                ranges.extend(_as_ranges(first))
        ranges = _normalize(ranges)
        return _negate(ranges) if negated else ranges

    def class_member(self):
        if self.peek() == "\\":
            return self.escape(in_class=True)
        self.pos += 1
        return ord(self.src[self.pos - 1])

    def escape(self, in_class):
        """Consume a backslash escape; return its code point (int), or the ranges of \\d etc."""
        at, c, after = self.pos, self.peek(1), self.peek(2)
        pair, number = _SURROGATE_PAIR.match(self.src, at), _HEX_ESCAPE.match(self.src, at)
        self.pos += 2
        if pair:   # \uD83D\uDE00 is one code point in u mode
            self.pos = pair.end()
            return 0x10000 + ((int(pair[1], 16) - 0xD800) << 10) + int(pair[2], 16) - 0xDC00
        if number and int(number[number.lastindex], 16) <= _MAX_CODE_POINT:
            self.pos = number.end()   # lastindex: the one group that matched
            return int(number[number.lastindex], 16)
        if c == "":
            raise PatternError("the pattern ends with a lone backslash")
        if c in "123456789k":
            raise PatternError("backreferences are not supported")
        if c in "pP":
            raise PatternError("Unicode property escapes \\p{...} are not supported")
        if c in (_CLASS_ESCAPES if in_class else _ESCAPES):
            return _CLASS_ESCAPES[c]
        if c == "0" and not ("0" <= after <= "9"):
            return 0
        if c == "c" and after.isascii() and after.isalpha():
            self.pos += 1
            return ord(after) % 32
        raise PatternError(f"the escape \\{c} at offset {at} is not allowed")


# ---- Compiling: tree to Thompson NFA ---------------------------------------------------------
# The program is a list of states (kind, arg, out): ('set', ranges, out) consumes a character
# in ranges; ('assert', kind, out) and ('split', [targets], None) consume nothing. State 0 is
# the match. Every _compile call emits at least one state, so expanding counted repeats
# ((a{1000}){1000}) stops at the cap instead of running on.

def _emit(program, state):
    if len(program) >= _MAX_STATES:
        raise PatternError(f"the pattern is too large (more than {_MAX_STATES} states)")
    program.append(state)
    return len(program) - 1


def _compile(node, out, program):
    """Emit the states for node, continuing to state out; return node's entry state."""
    kind = node[0]
    if kind in ("set", "assert"):
        return _emit(program, (kind, node[1], out))
    if kind == "alt":
        return _emit(program, ("split", [_compile(n, out, program) for n in node[1]], None))
    if kind == "cat":
        if not node[1]:
            return _emit(program, ("split", [out], None))
        for child in reversed(node[1]):
            out = _compile(child, out, program)
        return out
    _, body, lo, hi = node
    if hi == 0:
        return _emit(program, ("split", [out], None))
    if hi is None:   # a loop: the split enters the body, which comes back to it, or leaves
        entry = _emit(program, ("split", [], None))
        program[entry][1].extend([_compile(body, entry, program), out])
    else:            # hi - lo optional copies, nested: (body (body)?)?
        entry = out
        for _ in range(hi - lo):
            entry = _emit(program, ("split", [_compile(body, entry, program), out], None))
    for _ in range(lo):
        entry = _compile(body, entry, program)
    return entry


@functools.lru_cache(maxsize=512)
def compile_pattern(pattern):
    """Compile a JSON Schema pattern, or raise PatternError."""
    if not isinstance(pattern, str):
        raise PatternError("a pattern must be a string")
    parsing = _Parser(pattern)
    tree = parsing.disjunction()
    if parsing.pos < len(pattern):   # the top-level disjunction stops only at a stray ')'
        raise PatternError(f"unbalanced parenthesis at offset {parsing.pos}")
    program = [("match", None, None)]
    return Pattern(program, _compile(tree, 0, program))


# ---- Matching: a lazily built DFA ------------------------------------------------------------
# A DFA state holds the NFA states that the characters read so far lead to, before their
# epsilon edges are followed, and what assertions need: whether the previous character was a
# word character, and whether nothing has been read yet. Epsilon edges are followed only once
# the next character (or the end) is known, because only then are ^ $ \b \B decided. Once
# cached, a character costs one dict lookup; uncached, one pass over at most _MAX_STATES NFA
# states. Either way the time is linear in the text, and the cache is bounded.

class _DFAState:
    __slots__ = ("nfa", "prev_word", "at_start", "moves")

    def __init__(self, nfa, prev_word, at_start):
        self.nfa, self.prev_word, self.at_start = nfa, prev_word, at_start
        self.moves = {}   # character (None for the end) -> _DFAState, or True/False if decided


class Pattern:
    """A compiled pattern. Its caches hold only derived data, so threads may share it."""

    def __init__(self, program, start):
        self._program, self._start = program, start
        self.size = len(program)  # the most work one character can cost, in NFA states
        self._states, self._cached = {}, 0
        self._initial = self._state(frozenset([start]), False, True)
        # A search restarts the pattern at every position, unless the start state reaches
        # nothing away from the text's start (the pattern begins with ^): then an empty NFA
        # set can never match and the search stops there.
        sets, matched = self._closure([start], {"^": False, "$": True, "b": True, "B": True})
        self._restart = bool(sets) or matched

    def search(self, text):
        """True iff the pattern matches somewhere in text, like ECMA's RegExp test()."""
        state = self._initial
        for ch in text:
            move = state.moves.get(ch)
            if move is None:
                move = self._move(state, ch)
            if move is True or move is False:
                return move
            state = move
        move = state.moves.get(None)
        return self._move(state, None) if move is None else move

    def _move(self, state, ch):
        """Build and cache the move from state on ch (None: the end of the text)."""
        if self._cached > _CACHE_BUDGET:
            self._forget()
        next_word = ch in _WORD_CHARS
        truth = {"^": state.at_start, "$": ch is None,
                 "b": state.prev_word != next_word, "B": state.prev_word == next_word}
        sets, matched = self._closure(state.nfa, truth)
        if matched or ch is None:
            move = matched
        else:
            cp = ord(ch)
            nfa = {self._program[s][2] for s in sets if _contains(self._program[s][1], cp)}
            if self._restart:
                nfa.add(self._start)
            move = self._state(frozenset(nfa), next_word, False) if nfa else False
        state.moves[ch] = move   # True and False are final: search returns them
        self._cached += 1
        return move

    def _closure(self, pending, truth):
        """Follow epsilon edges from pending, crossing an assertion only if truth says it holds;
        return the 'set' states reached and whether the match state was reached."""
        seen, stack, sets, matched = set(), list(pending), [], False
        while stack:
            s = stack.pop()
            if s not in seen:
                seen.add(s)
                kind, arg, out = self._program[s]
                if kind == "split":
                    stack.extend(arg)
                elif kind == "assert" and truth[arg]:
                    stack.append(out)
                elif kind == "set":
                    sets.append(s)
                matched = matched or kind == "match"
        return sets, matched

    def _state(self, nfa, prev_word, at_start):
        # The table is read once: calls are judged outside the gate's lock, so another
        # thread's search may drop it (_forget) between a store and a second read.
        key = (nfa, prev_word, at_start)
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = _DFAState(nfa, prev_word, at_start)
            self._cached += len(nfa) + 1
        return state

    def _forget(self):
        """Drop all cached states and moves. A state a running search still holds stays
        correct: it only loses its cached moves, which are rebuilt on demand."""
        for state in list(self._states.values()):
            state.moves.clear()
        self._states.clear()
        self._cached = 0


# Characters times NFA states that all the pattern searches of one call may cost together.
# The worst patterns meet a new DFA state at nearly every character, which costs a pass over
# the NFA (about 0.1 microsecond per NFA state), so this is about half a second of one core.
PATTERN_WORK = 5_000_000


# What one step of a schema check costs in those units (a subschema applied to a value, about
# 5 microseconds), and one value read for equality (uniqueItems, const, enum).
SCHEMA_STEP = 50
EQUALITY_STEP = 5


class PatternCost(Exception):
    """A check the call's work cannot pay for; the message names the value's place."""


class PatternWork:
    """What the pattern searches and schema steps of one call may still cost, and what the
    searches found.

    The bound is per call, not per value: an array of long values, or one value read by many
    patterns or subschemas, draws on the same PATTERN_WORK, so a call cannot multiply it. A
    search is charged before it starts, at its most (characters times NFA states): what
    cannot be paid is refused without being started, and the charge depends on the call
    alone, never on what the DFA caches happen to hold. What a search found is kept: the gate
    judges a call before its lock and reads the call again under it and in the write
    transaction, at no cost.
    """

    def __init__(self):
        self.left, self.found = PATTERN_WORK, {}

    def search(self, pattern, text, at):
        """Whether the pattern matches somewhere in text, or PatternCost naming `at`."""
        key = (pattern, text)
        if key not in self.found:
            compiled = compile_pattern(pattern)
            cost = len(text) * compiled.size
            if cost > self.left:
                raise PatternCost(f"{at}: too long ({len(text)} characters) to be checked "
                                  f"against the pattern {quote(pattern)}")
            self.left -= cost
            self.found[key] = compiled.search(text)
        return self.found[key]

    def pay(self, cost, at):
        """Take a schema step's cost, or raise PatternCost naming `at`."""
        if cost > self.left:
            raise PatternCost(f"{at}: too large to be checked against the schema")
        self.left -= cost


# =============================================================================================
# 13. JSON Schema
#
# Reads as: library
#
# Contract: validate(schema, value) raises SchemaError naming the first failing property path
# and what was expected. It checks draft 2020-12's applicator and validation vocabularies,
# `$ref` to a JSON Pointer inside the schema (applied beside its sibling keywords), and the
# older spellings (items as a list, additionalItems, dependencies, draft-04's boolean
# exclusiveMinimum/Maximum); `format` and unknown keywords are ignored. schema_problem(schema)
# says why validate cannot use a schema, or '': a keyword of the wrong shape, a pattern
# section 12 refuses, a $ref that finds nothing, or unevaluatedProperties, unevaluatedItems,
# $dynamicRef or $recursiveRef. Numbers compare as exact decimals of their literals (an
# integer is a number with no fraction); enum, const and uniqueItems compare JSON values by
# json_key, so uniqueItems is one pass. `pattern` searches as ECMA-262 does (section 12); one
# call's searches, its schema check's and its policy's, share one PatternWork, which also pays
# for every subschema applied and every value compared; what it cannot pay for raises
# PatternCost, which passes through anyOf, oneOf, not and if: a value too costly to check is
# never taken for one that does not match. A $ref cycle that reads no deeper into the value raises
# RecursionError.
# JSON Pointers (RFC 6901): parse_pointer reads one into tokens or raises ConfigError;
# resolve_pointer finds a member, or an item at an index with no leading zero, else (under an
# object) the default schema_child finds for it, else MISSING.
# Differential tests: tests/test_schema_differential.py finds validate accepting and refusing
# a seeded corpus as the jsonschema package's Draft202012Validator does (what differs on
# purpose is kept out and said there); tests/test_pointer_differential.py finds pointers and
# $refs resolved as the referencing package resolves them.
# =============================================================================================

JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties",
                   "maxProperties", "minContains", "maxContains")
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "additionalItems")
_UNCHECKED = ("unevaluatedProperties", "unevaluatedItems", "$dynamicRef", "$recursiveRef")


class SchemaError(Exception):
    """A value that does not match its schema, or a $ref that points nowhere."""


def schema_problem(schema, root=None, where="#"):
    """Why validate cannot use this schema, or ''. Every keyword validate reads is checked for
    its shape here, once, so validating a call never meets a shape it cannot read."""
    root = schema if root is None else root
    if isinstance(schema, bool):
        return ""
    if not isinstance(schema, dict):
        return f"{where} is not a schema (an object or a boolean)"
    return _keyword_problem(schema, root, where) or _subschema_problem(schema, root, where)


def _is_count(value):
    return isinstance(value, Number) and value.is_integer() and value.exact() >= 0


def _is_names(value):
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _keyword_problem(schema, root, where):
    """The keywords that hold values."""
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if any(not isinstance(k, str) or k not in JSON_TYPES for k in kinds) or kind == []:
        return f"{where}/type names an unknown type"
    for key in _UNCHECKED:
        if key in schema:
            return f"{where} uses {key}, which this validator does not check"
    for key in _COUNT_KEYWORDS:
        if key in schema and not _is_count(schema[key]):
            return f"{where}/{key} must be a non-negative integer"
    for key in _NUMBER_KEYWORDS:
        value = schema.get(key)
        if key in schema and not isinstance(value, Number) and not (
                key.startswith("exclusive") and isinstance(value, bool)):
            return f"{where}/{key} must be a number"
    if "multipleOf" in schema and schema["multipleOf"].exact() <= 0:
        return f"{where}/multipleOf must be greater than 0"
    if "required" in schema and not _is_names(schema["required"]):
        return f"{where}/required must be a list of strings"
    if "enum" in schema and not isinstance(schema["enum"], list):
        return f"{where}/enum must be a list"
    if "uniqueItems" in schema and not isinstance(schema["uniqueItems"], bool):
        return f"{where}/uniqueItems must be true or false"
    for key in ("dependentRequired", "dependencies"):
        if key in schema and not isinstance(schema[key], dict):
            return f"{where}/{key} must be an object"
    for name, needed in schema.get("dependentRequired", {}).items():
        if not _is_names(needed):
            return f"{where}/dependentRequired/{name} must be a list of strings"
    patterns = [("pattern", schema["pattern"])] if "pattern" in schema else []
    if isinstance(schema.get("patternProperties"), dict):
        patterns += [("patternProperties key", key) for key in schema["patternProperties"]]
    for what, pattern in patterns:
        if not isinstance(pattern, str):
            return f"{where}/{what} must be a string"
        try:
            compile_pattern(pattern)
        except PatternError as err:
            return f"{where}/{what} {quote(pattern)} cannot be used: {err}"
    if "$ref" in schema:
        try:
            target = resolve_ref(root, schema["$ref"])
        except SchemaError as err:
            return str(err)
        if not isinstance(target, (dict, bool)):
            return f"{where}/$ref points at something that is not a schema"
    return ""


def _subschema_problem(schema, root, where):
    """The keywords that hold schemas."""
    subschemas = []
    for key in _SCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list) or (key != "prefixItems" and not schema[key]):
                return f"{where}/{key} must be a non-empty list of schemas"
            subschemas += [(f"{where}/{key}/{i}", sub) for i, sub in enumerate(schema[key])]
    for key in SCHEMA_MAPS:
        if key in schema:
            if not isinstance(schema[key], dict):
                return f"{where}/{key} must be an object of schemas"
            subschemas += [(f"{where}/{key}/{name}", sub) for name, sub in schema[key].items()]
    subschemas += [(f"{where}/{key}", schema[key]) for key in _SCHEMA_ONE if key in schema]
    items = schema.get("items")
    if isinstance(items, list):
        subschemas += [(f"{where}/items/{i}", sub) for i, sub in enumerate(items)]
    elif "items" in schema:
        subschemas.append((f"{where}/items", items))
    subschemas += [(f"{where}/dependencies/{name}", needed)
                   for name, needed in schema.get("dependencies", {}).items()
                   if not _is_names(needed)]
    for at, sub in subschemas:
        problem = schema_problem(sub, root, at)
        if problem:
            return problem
    return ""


def resolve_ref(root, ref):
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise SchemaError(f"$ref {quote(str(ref))} does not point inside the schema")
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise SchemaError(f"$ref {quote(ref)} points at nothing in the schema")
    return node


MISSING = object()  # what a pointer finds where the arguments have nothing
_INDEX_RE = re.compile(r"0|[1-9][0-9]{0,8}")


def parse_pointer(text, where):
    """A JSON Pointer (RFC 6901) into the arguments, as its unescaped tokens."""
    if not isinstance(text, str) or not text.startswith("/"):
        raise ConfigError(f'{where}: {quote(str(text))} is not a JSON Pointer into the '
                          f'arguments; write it like "/amount" or "/payee/name"')
    if re.search("~(?![01])", text):
        raise ConfigError(f"{where}: {quote(text)} has a '~' that is not ~0 or ~1; write ~0 "
                          f"for '~' and ~1 for '/'")
    return tuple(t.replace("~1", "/").replace("~0", "~") for t in text[1:].split("/"))


def resolve_pointer(args, tokens, schema):
    """The value at a pointer as the server reads it (an omitted amount is paid at its
    default)."""
    return pointed(args, tokens, schema)[0]


def pointed(args, tokens, schema):
    """The value at a pointer, and the part of the schema describing it (or None)."""
    value, node = args, schema
    for token in tokens:
        parent = value
        if isinstance(value, dict) and token in value:
            value = value[token]
        elif isinstance(value, list) and _INDEX_RE.fullmatch(token) and int(token) < len(value):
            value = value[int(token)]
        else:
            value = MISSING
        try:
            node = schema_child(schema, node, token)
        except SchemaError:  # a default behind a $ref that points at nothing is no default
            node = None
        if value is MISSING:
            if not isinstance(parent, dict) or not isinstance(node, dict) or \
                    "default" not in node:
                return MISSING, node
            value = node["default"]
    return value, node


def exact_number(value, node):
    """A number's exact value; a string's where the schema types it a string and it spells a
    decimal ("20.00"), as payment APIs send amounts: the server reads it so. Else None."""
    if isinstance(value, Number):
        return value.exact()
    if isinstance(value, str) and isinstance(node, dict) and node.get("type") == "string":
        return decimal_text(value)
    return None


def schema_child(schema, node, token):
    """The part of `schema` describing `token` inside what `node` describes, or None; raises
    SchemaError for a $ref that points at nothing."""
    if isinstance(node, dict) and isinstance(node.get("$ref"), str):
        node = resolve_ref(schema, node["$ref"])
    if not isinstance(node, dict):
        return None
    properties = node.get("properties")
    if isinstance(properties, dict) and token in properties:
        return properties[token]
    return node["items"] if "items" in node and _INDEX_RE.fullmatch(token) else None


def _type_of(value):
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, Number):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _has_type(value, kind):
    actual = _type_of(value)
    if kind == "integer":
        return actual == "number" and value.is_integer()
    return actual == kind


def json_key(value, work=None, at=""):
    """A hashable form two JSON values share exactly when JSON Schema calls them equal: 1 and
    1.0 alike, an object's keys in any order. Each value read is paid from `work`, if given."""
    if work is not None:
        work.pay(EQUALITY_STEP, at)
    if isinstance(value, str):
        return value
    if isinstance(value, Number):
        return "n", value.exact()
    if isinstance(value, list):
        return ("a", *(json_key(item, work, at) for item in value))
    if isinstance(value, dict):
        return "o", frozenset((k, json_key(v, work, at)) for k, v in value.items())
    return "c", value  # true, false, null: tagged, as True == 1 in Python


def json_equal(a, b):
    return json_key(a) == json_key(b)


def _show(value):
    return cut(policy_json(value), 80)


def _path(where, part):
    return f"{where}/{part}" if where else f"/{part}"


def validate(schema, value, root=None, where="", work=None):
    """Raise SchemaError naming the first place `value` does not match `schema`, or
    PatternCost when `work` (the call's, else a fresh one) cannot pay for a search."""
    root = schema if root is None else root
    work = PatternWork() if work is None else work
    at = where or "the arguments"
    if schema is True or schema == {}:
        return
    if schema is False:
        raise SchemaError(f"{at}: no value is allowed here")
    work.pay(SCHEMA_STEP, at)
    if "$ref" in schema:
        validate(resolve_ref(root, schema["$ref"]), value, root, where, work)
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not any(_has_type(value, k) for k in kinds):
            raise SchemaError(f"{at}: expected {' or '.join(kinds)}, got {_type_of(value)}")
    if "const" in schema or "enum" in schema:
        key = json_key(value, work, at)
        if "const" in schema and json_key(schema["const"], work, at) != key:
            raise SchemaError(f"{at}: expected exactly {_show(schema['const'])}")
        if "enum" in schema and key not in [json_key(o, work, at) for o in schema["enum"]]:
            raise SchemaError(f"{at}: expected one of {_show(schema['enum'])}")
    if isinstance(value, Number):
        _validate_number(schema, value, at)
    elif isinstance(value, str):
        _validate_string(schema, value, at, work)
    elif isinstance(value, list):
        _validate_array(schema, value, root, where, work)
    elif isinstance(value, dict):
        _validate_object(schema, value, root, where, work)
    for sub in schema.get("allOf", []):
        validate(sub, value, root, where, work)
    if "anyOf" in schema and not any(_matches(s, value, root, where, work)
                                     for s in schema["anyOf"]):
        raise SchemaError(f"{at}: matches none of the allowed shapes (anyOf)")
    if "oneOf" in schema and sum(_matches(s, value, root, where, work)
                                 for s in schema["oneOf"]) != 1:
        raise SchemaError(f"{at}: must match exactly one of the allowed shapes (oneOf)")
    if "not" in schema and _matches(schema["not"], value, root, where, work):
        raise SchemaError(f"{at}: matches a shape that is not allowed (not)")
    if "if" in schema:
        branch = "then" if _matches(schema["if"], value, root, where, work) else "else"
        if branch in schema:
            validate(schema[branch], value, root, where, work)


def _matches(schema, value, root, where, work):
    try:
        validate(schema, value, root, where, work)
        return True
    except SchemaError:
        return False


def _validate_number(schema, value, at):
    exact = value.exact()
    for key, fails, word in (("minimum", lambda b: exact < b, "at least"),
                             ("maximum", lambda b: exact > b, "at most"),
                             ("exclusiveMinimum", lambda b: exact <= b, "greater than"),
                             ("exclusiveMaximum", lambda b: exact >= b, "less than")):
        bound = schema.get(key)
        if isinstance(bound, bool):  # draft-04: exclusiveMinimum true tightens minimum
            other = schema.get("minimum" if key == "exclusiveMinimum" else "maximum")
            if bound and isinstance(other, Number) and exact == other.exact():
                raise SchemaError(f"{at}: expected a number {word} {other.literal}")
        elif isinstance(bound, Number) and fails(bound.exact()):
            raise SchemaError(f"{at}: expected a number {word} {bound.literal}")
    step = schema.get("multipleOf")
    if isinstance(step, Number):
        try:
            remainder = exact % step.exact()
        except decimal.InvalidOperation:
            remainder = 1  # too far apart to divide exactly: not a multiple we can vouch for
        if remainder != 0:
            raise SchemaError(f"{at}: expected a multiple of {step.literal}")


def _validate_string(schema, value, at, work):
    if "minLength" in schema and len(value) < schema["minLength"].exact():
        raise SchemaError(f"{at}: expected at least {schema['minLength'].literal} characters")
    if "maxLength" in schema and len(value) > schema["maxLength"].exact():
        raise SchemaError(f"{at}: expected at most {schema['maxLength'].literal} characters")
    if "pattern" in schema and not work.search(schema["pattern"], value, at):
        raise SchemaError(f"{at}: expected text matching the pattern "
                          f"{quote(schema['pattern'])}")


def _validate_array(schema, value, root, where, work):
    at = where or "the arguments"
    if "minItems" in schema and len(value) < schema["minItems"].exact():
        raise SchemaError(f"{at}: expected at least {schema['minItems'].literal} items")
    if "maxItems" in schema and len(value) > schema["maxItems"].exact():
        raise SchemaError(f"{at}: expected at most {schema['maxItems'].literal} items")
    if schema.get("uniqueItems") is True:
        keys = {json_key(item, work, at) for item in value}
        if len(keys) < len(value):
            raise SchemaError(f"{at}: expected items that are all different")
    prefix = schema.get("prefixItems")
    items = schema.get("items")
    if isinstance(items, list):  # draft-07 tuple form
        prefix, items = items, schema.get("additionalItems")
    prefix = prefix or []
    for i, item in enumerate(value):
        sub = prefix[i] if i < len(prefix) else items
        if sub is not None:
            validate(sub, item, root, _path(where, i), work)
    if "contains" in schema:
        found = sum(_matches(schema["contains"], item, root, where, work)
                    for item in value)
        least = schema["minContains"].exact() if "minContains" in schema else 1
        if found < least:
            raise SchemaError(f"{at}: expected at least {least} item(s) of the required shape "
                              f"(contains)")
        if "maxContains" in schema and found > schema["maxContains"].exact():
            raise SchemaError(f"{at}: expected at most {schema['maxContains'].literal} item(s) "
                              f"of that shape (contains)")


def _validate_object(schema, value, root, where, work):
    at = where or "the arguments"
    for name in schema.get("required", []):
        if name not in value:
            raise SchemaError(f"{_path(where, name)}: this property is required")
    if "minProperties" in schema and len(value) < schema["minProperties"].exact():
        raise SchemaError(f"{at}: expected at least {schema['minProperties'].literal} "
                          f"properties")
    if "maxProperties" in schema and len(value) > schema["maxProperties"].exact():
        raise SchemaError(f"{at}: expected at most {schema['maxProperties'].literal} properties")
    properties = schema.get("properties", {})
    patterns = schema.get("patternProperties", {})
    extra = schema.get("additionalProperties")
    for name, item in value.items():
        matched = False
        if name in properties:
            validate(properties[name], item, root, _path(where, name), work)
            matched = True
        for pattern, sub in patterns.items():
            if work.search(pattern, name, _path(where, name)):
                validate(sub, item, root, _path(where, name), work)
                matched = True
        if not matched and extra is False:
            allowed = ", ".join(sorted(properties)) or "none"
            raise SchemaError(f"{_path(where, name)}: this property is not allowed "
                              f"(allowed: {allowed})")
        if not matched and isinstance(extra, dict):
            validate(extra, item, root, _path(where, name), work)
    if "propertyNames" in schema:
        for name in value:
            validate(schema["propertyNames"], name, root, _path(where, name), work)
    dependencies = {**schema.get("dependencies", {}), **schema.get("dependentRequired", {}),
                    **schema.get("dependentSchemas", {})}
    for name, needed in dependencies.items():
        if name not in value:
            continue
        if isinstance(needed, list):
            for other in needed:
                if other not in value:
                    raise SchemaError(f"{_path(where, other)}: required when {name} is given")
        else:
            validate(needed, value, root, where, work)


# =============================================================================================
# 14. Hosts in URLs
#
# Reads as: library
#
# Contract: url_place(value) reads a URL as a WHATWG parser (browsers, node) would, and returns
# its scheme and host, or nothing where the host could be read two ways (one_reading: a
# non-ASCII host that is not stable under case folding and NFKC, letters outside Unicode 3.2,
# right-to-left letters, a leading combining mark, the letters node ignores). host_entry
# reads an entry ("example.com", ".example.com", "https://example.com") so, or raises
# ConfigError; host_matches: the host is an entry or under a dotted one, in its scheme if any.
# Differential test: tests/test_edges_paths.py reads every code point of planes 0, 1 and 14
# in a host as node's URL does, finds no host read as another, and host_matches agreeing
# with node's readings of generated URLs and entries.
# =============================================================================================

_LABEL_RE = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")
_NUMERIC_LABEL_RE = re.compile(r"0x[0-9a-f]*|[0-9]+")
_URL_UNSAFE_RE = re.compile(r"[\x00-\x20\x7f\\]")


def normal_host(host):
    """A host as compared (lower-case, IDNA-encoded, one trailing dot dropped, an IP address
    in its standard form), or None if a client could reach another: a numeric label must
    make a whole dotted quad (no octal, hex or short forms), and a name must read one way
    through IDNA 2003 and UTS #46 (one_reading)."""
    import ipaddress
    if not isinstance(host, str) or not host or "%" in host:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if ":" in host:
        try:
            address = ipaddress.IPv6Address(host)
        except ValueError:
            return None
        # An IPv4 address written as IPv6 reaches the IPv4 host: it is compared as that one.
        return str(address.ipv4_mapped) if address.ipv4_mapped else address.compressed
    host = host[:-1] if host.endswith(".") else host
    if "" in host.split("."):  # "a..b": an empty label names no host
        return None
    lowered = host.lower()
    try:
        # An xn-- label is read as the name it encodes, and that name must read one way too.
        name = lowered.encode("ascii").decode("idna") if lowered.isascii() else lowered
        if not (name.isascii() or one_reading(host, name)):
            return None
        encoded = name.encode("idna").decode("ascii")
        if not name.isascii() and encoded.encode("ascii").decode("idna") != name:
            return None
    except UnicodeError:
        return None
    labels = encoded.split(".")
    if not all(_LABEL_RE.fullmatch(label) for label in labels):
        return None
    if _NUMERIC_LABEL_RE.fullmatch(labels[-1]):
        try:
            return str(ipaddress.IPv4Address(encoded))
        except ValueError:
            return None
    return encoded


def one_reading(written, name):
    """Whether a non-ASCII host name (`written`; `name`, lower-cased or decoded from xn--)
    reads as one name to every client. Python's IDNA 2003 codec knows Unicode 3.2 and maps
    little; UTS #46 (node, browsers) maps every compatibility form (`loc\u1d43lhost` is
    localhost). So: assigned in Unicode 3.2, its own case fold and NFKC form, no label led
    by a combining mark, nothing right-to-left or an Arabic digit (read differently)."""
    if unicodedata.normalize("NFKC", name.casefold()) != name or \
            unicodedata.normalize("NFKC", written.casefold()) != written.lower():
        return False
    return all(char.isascii() or (unicodedata.ucd_3_2_0.category(char) != "Cn"
                                  and unicodedata.bidirectional(char) not in ("R", "AL", "AN")
                                  and char not in _IGNORED_LETTERS)
               for char in name) and \
        not any(unicodedata.category(label[:1]).startswith("M") for label in name.split("."))


# Letters Unicode says to ignore, which UTS #46 refuses and IDNA 2003 keeps.
_IGNORED_LETTERS = "\u115f\u1160\u17b4\u17b5"


# The schemes whose host URL parsers read as a domain (WHATWG's special schemes); in any
# other a parser keeps the host as opaque text, percent-encoding what is not ASCII.
DOMAIN_SCHEMES = ("http", "https", "ws", "wss", "ftp", "file")


def url_place(value):
    """(scheme, host) of a URL, its host normalised (userinfo and port aside), or None when
    it names no host a client would read one way."""
    from urllib.parse import urlsplit
    if not isinstance(value, str) or len(value) > 8192 or _URL_UNSAFE_RE.search(value):
        return None
    try:
        parts = urlsplit(value)
        parts.port  # a port that is not a number makes the URL unusable
    except ValueError:
        return None
    if not parts.scheme or not parts.netloc:
        return None
    written = parts.netloc.rpartition("@")[2]
    written = written[:written.find("]") + 1] if written.startswith("[") else \
        written.partition(":")[0]
    if not written.isascii() and parts.scheme not in DOMAIN_SCHEMES:
        return None
    host = normal_host(written)
    return None if host is None else (parts.scheme, host)


_SCHEME_RE = re.compile(r"[a-z][a-z0-9+.-]*")


def host_matches(scheme, host, entries):
    for entry in entries:
        wanted, sep, name = entry.partition("://")
        if not sep:
            wanted, name = scheme, entry
        if wanted == scheme and (host.endswith(name) if name.startswith(".") else host == name):
            return True
    return False


def host_entry(entry, with_scheme, where):
    """A host_in or host_not_in entry as it is compared. Only host_in takes a scheme: in
    host_not_in it would let the same host through under every other scheme."""
    scheme, sep, name = entry.partition("://") if isinstance(entry, str) else ("", "", entry)
    scheme, name = (scheme.lower(), name) if sep else ("", entry)
    dot = "." if isinstance(name, str) and name.startswith(".") else ""
    host = normal_host(name[1:] if dot else name) if isinstance(name, str) else None
    if host is None or (dot and ":" in host) or (scheme and not _SCHEME_RE.fullmatch(scheme)):
        raise ConfigError(f"{where}: {quote(str(entry))} is not a host name; write it like "
                          f'"example.com", or ".example.com" for its subdomains')
    if scheme and not with_scheme:
        raise ConfigError(f"{where}: {quote(entry)} names a scheme, which only host_in may "
                          f'require (as "https://example.com"); write host_not_in entries like '
                          f'"example.com"')
    return scheme + sep + dot + host


# =============================================================================================
# 15. Paths as the kernel resolves them
#
# Reads as: library
#
# Contract: resolved_path(path) resolves a path as the kernel would for a server, following
# links one component at a time (at most MAX_LINKS), without realpath; /proc, a loop, too many
# links, a file used as a directory, and a name another entry of its directory equals under
# NFKC resolve to nothing, and such a path lies under no directory (path_under);
# resolved_root reads an `under` root so, normalised as written, or raises ConfigError.
# Differential test: tests/test_edges_paths.py writes generated paths through the kernel and
# the npm filesystem server, none landing outside what path_under allowed, and finds each
# generated root resolved where the kernel resolves it, or refused.
# =============================================================================================

PATH_MAX = 4096  # the longest path the kernel opens; no server reaches a longer one
MAX_LINKS = 40   # links followed in one lookup, as the kernel bounds them


def path_under(value, roots):
    """Whether a path lies inside one of the resolved roots both as written (normalised,
    `~` expanded) and as resolved_path reads it. A relative path, or one a server may read
    otherwise, could land anywhere: it lies under none."""
    if not isinstance(value, str) or not value or "\x00" in value:
        return False
    if value == "~" or value.startswith("~/"):
        value = os.path.expanduser("~") + value[1:]
    if not value.startswith("/") or len(value.encode("utf-8", "surrogatepass")) > PATH_MAX:
        return False
    places = {resolved_path(os.path.normpath(value)), resolved_path(value)}
    return None not in places and all(
        any(place == root or place.startswith(root.rstrip("/") + "/") for root in roots)
        for place in places)


def resolved_path(path):
    """Where an absolute path leads here, links followed one component at a time (`..` after
    the link before it, as the kernel does), or None when a server may read it otherwise:
    - through /proc: its self, cwd and fd links are the opening process's, the server's;
    - past MAX_LINKS links, which is also how a loop ends (the kernel's ELOOP);
    - through a file as a directory, or a directory the gate may not read;
    - with a component that is not ASCII or not there byte for byte, and another entry of
      its directory equal to it under NFKC: servers match names normalised (the filesystem
      server finds `li\u0308nk` as the link `l\u00efnk`).
    Not os.path.realpath: its reading of a loop changed between versions, and it recurses."""
    resolved, pending, links = [], path.split("/")[::-1], 0
    while pending:
        name = pending.pop()
        if name in ("", "."):
            continue
        if name == "..":
            del resolved[-1:]
            continue
        if not resolved and name == "proc":
            return None
        here = "/" + "/".join(resolved + [name])
        try:
            mode = os.lstat(here).st_mode
        except FileNotFoundError:
            mode = None
        except (OSError, ValueError):
            return None
        if (mode is None or not name.isascii()) and _named_two_ways(resolved, name):
            return None
        if mode is not None and stat.S_ISLNK(mode):
            links += 1
            if links > MAX_LINKS:
                return None
            try:
                target = os.readlink(here)
            except OSError:
                return None
            if target.startswith("/"):
                resolved = []
            pending.extend(target.split("/")[::-1])
            continue
        resolved.append(name)
    return "/" + "/".join(resolved)


def _named_two_ways(parents, name):
    """Whether another entry of the directory `parents` names could be taken for `name`."""
    try:
        entries = os.listdir("/" + "/".join(parents))
    except FileNotFoundError:
        return False  # nothing there yet, so nothing to mistake it for
    except OSError:
        return True
    key = unicodedata.normalize("NFKC", name)
    return any(entry != name and unicodedata.normalize("NFKC", entry) == key
               for entry in entries)


def resolved_root(text, where):
    """A directory an `under` condition names, resolved once, at load."""
    if not isinstance(text, str) or not text or "\x00" in text:
        raise ConfigError(f"{where}: under lists directories as non-empty strings")
    path = os.path.expanduser("~") + text[1:] if text == "~" or text.startswith("~/") else text
    if not path.startswith("/"):
        raise ConfigError(f"{where}: {quote(text)} is relative; write the directory as an "
                          f"absolute path or one starting with ~/")
    root = resolved_path(os.path.normpath(path))
    if root is None:
        raise ConfigError(f"{where}: {quote(text)} cannot be resolved as a server would (it "
                          f"goes through /proc, a loop or too many links, or is named two "
                          f"ways); name the directory itself")
    return root


# =============================================================================================
# 16. Durations and times
#
# Reads as: library
#
# Contract: parse_duration returns what Go's time.ParseDuration returns, as int nanoseconds,
# and raises ValueError where Go errs. Its syntax: an optional sign, then "0" alone or terms
# back to back, each a decimal number ("5", "5.", ".5") and a unit (ns, us, µs U+00B5, μs
# U+03BC, ms, s, m, h): "+5s", ".5s", "5.s" and "1m30s1m" are read; "1h-5m", "1h 30m", "5",
# "00", "1d", "1S", "1e3s" and non-ASCII digits are not. Each term is truncated to whole
# nanoseconds on its own ("0.5ns0.5ns" is 0), its fraction scaled in float64 from the
# leading digits that fit in 2^63, as Go does (so a long fraction can end a nanosecond off
# the exact value); the sum must fit int64 (-2^63 ns is read, 2^63 ns is not).
# format_duration(ns) writes an int64 as Go's Duration.String does ("0s", "1.5µs", "300ms",
# "1m0s", "24h0m0s"); parse_duration reads each back to itself. format_time writes seconds
# since the epoch as UTC "YYYY-MM-DDTHH:MM:SS.ffffffZ", rounded to the microsecond as
# datetime.fromtimestamp rounds (half to even on the double), the one writer later shares;
# for years 1000 to 9999 it is fixed width (past 9999 both raise), so stored times compare as
# strings in the order of their instants; now() is
# format_time(time.time()). parse_time reads such a time as the double nearest its instant,
# which format_time writes back unchanged within 2^33 s of 1970 (1697 to 2242). later(text,
# ns) writes the instant ns after text exactly, rounded half to even to the microsecond, in
# years 1000 to 9999. prose_time(text) is text to the
# second, truncated: "YYYY-MM-DDTHH:MM:SSZ".
# Differential test: tests/test_durations_differential.py (against durationpy, datetime, and
# a table of Go's own answers).
# =============================================================================================

_DURATION_UNITS = {"ns": 1, "us": 1000, "µs": 1000, "μs": 1000, "ms": 10**6, "s": 10**9,
                   "m": 60 * 10**9, "h": 3600 * 10**9}
_DURATION_RE = re.compile(r"([0-9]*(?:\.[0-9]*)?)([a-zµμ]+)")


def parse_duration(text):
    """Nanoseconds from Go's duration syntax ("15s", "1h30m", "300ms", "0"); ValueError else."""
    sign = -1 if text.startswith("-") else 1
    body = text[1:] if text.startswith(("+", "-")) else text
    if body == "0":
        return 0
    if not body:
        raise ValueError(f'invalid duration "{text}"')
    total, pos = 0, 0
    while pos < len(body):
        match = _DURATION_RE.match(body, pos)
        if not match or match.group(1) in ("", ".") or match.group(2) not in _DURATION_UNITS:
            raise ValueError(f'invalid duration "{text}"')
        whole, _, fraction = match.group(1).partition(".")
        whole, unit = whole.lstrip("0"), _DURATION_UNITS[match.group(2)]
        if len(whole) > 19:
            raise ValueError(f'duration "{text}" is too long')
        total += int(whole or 0) * unit + _go_fraction(fraction, unit)
        pos = match.end()
    if total > 2**63 - (sign > 0):  # Go's int64: -2^63 ns is a duration, 2^63 ns is not
        raise ValueError(f'duration "{text}" is too long')
    return sign * total


def _go_fraction(digits, unit):
    # Go truncates each term on its own, and computes a fraction in float64 from its leading
    # digits that fit in 2^63; a long fraction of an hour can so be a nanosecond off the exact
    # value, and Go's answer is the one a Go program given the same text would act on.
    zeros = len(digits) - len(digits.lstrip("0"))
    kept = digits[zeros:zeros + 19]
    if kept and int(kept) > 2**63:
        kept = kept[:18]
    if not kept:
        return 0
    scale = 1.0
    for _ in range(zeros + len(kept)):
        scale *= 10
    return int(float(int(kept)) * (float(unit) / scale))


def format_duration(ns):
    """Go's Duration.String: 0s, 300ms, 2s, 1m30s, 10m0s, 24h0m0s."""
    sign, ns = ("-" if ns < 0 else ""), abs(ns)
    for unit, size in (("ns", 1), ("µs", 1000), ("ms", 10**6)):
        if 0 < ns < size * 1000:
            return f"{sign}{decimal.Decimal(ns) / size:f}{unit}"  # exact: under 28 digits
    hours, rest = divmod(ns, 3600 * SECOND)
    minutes, rest = divmod(rest, 60 * SECOND)
    seconds = f"{decimal.Decimal(rest) / SECOND:f}s"
    if hours:
        return f"{sign}{hours}h{minutes}m{seconds}"
    if minutes:
        return f"{sign}{minutes}m{seconds}"
    return sign + seconds


def now():
    """Fixed-width UTC with microseconds: leases and windows compare as strings."""
    return format_time(time.time())


def format_time(seconds):
    """Microseconds rounded as datetime rounds them (half to even on the double)."""
    return _written(datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc))


def parse_time(text):
    return _moment(text).timestamp()


def later(text, ns):
    # On integers, not float seconds: a double near 2026 holds a quarter of a microsecond, so a
    # float sum can round a sub-microsecond duration to the wrong side, and past 2106 a whole one.
    micros, rest = divmod(ns, 1000)
    micros += rest > 500 or (rest == 500 and micros % 2)
    return _written(_moment(text) + datetime.timedelta(microseconds=micros))


def _moment(text):
    return datetime.datetime.fromisoformat(text[:-1] + "+00:00")


def _written(moment):
    """The one way a stored time is written."""
    return moment.isoformat(timespec="microseconds")[:-6] + "Z"


def prose_time(text):
    return text[:19] + "Z"


# =============================================================================================
# 17. Fields of a configuration
#
# Reads as: library
#
# Contract: each reader takes a JSON value read by section 10's parse, a field of an object
# (the value itself for parse_decimal, whole_number and one_of), and returns it exactly when
# the JSON Schema its docstring names accepts it, its parameters standing for the caller's
# arguments and numbers read exactly as written. A number comes back as an int or Decimal, a
# duration as its nanoseconds, an absent field as the docstring's `absent:` says (`absent or
# null:` where a null reads as absent, as Go's decoder reads one). Otherwise it raises
# ConfigError, one sentence naming the field (as `where` places it; field_byte_cap's are
# top-level) and what to write instead. refuse_unknown reads the object itself.
# Differential test: tests/test_fields_differential.py, against the jsonschema package.
# =============================================================================================

def refuse_unknown(raw, fields, where):
    """{"type": "object", "propertyNames": {"enum": fields}}, on raw itself."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be an object")
    for key in raw:
        if key not in fields:
            raise ConfigError(f"{where} has an unknown field {quote(key)}; the fields are "
                              f"{', '.join(fields)}")


def field_string(raw, field, where, required=False):
    """{"type": "string"}; absent or null: "";
    if required, {"type": "string", "minLength": 1}; absent or null: refused."""
    value = raw.get(field)
    if value is None:
        if required:
            raise ConfigError(f"{where} needs {field}")
        return ""
    if not isinstance(value, str):
        raise ConfigError(f"{where}.{field} must be a string")
    if required and not value:
        raise ConfigError(f"{where}.{field} must not be empty")
    return value


def field_bool(raw, field, where):
    """{"type": "boolean"}; absent: false."""
    value = raw.get(field, False)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{field} must be true or false")
    return value


def field_names(raw, field, where):
    """{"type": "array", "items": {"type": "string"}}; absent: []."""
    value = raw.get(field, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}.{field} must be a list of strings")
    return value


def field_byte_cap(raw, field, default, most):
    """{"type": "integer", "minimum": 1024, "maximum": most}, as an int; absent: default."""
    cap = raw.get(field, Number(str(default)))
    if not isinstance(cap, Number) or not cap.is_integer() or not 1024 <= cap.exact() <= most:
        raise ConfigError(f"{field} must be a whole number of bytes from 1024 to {most}")
    return int(cap.exact())


def field_duration(raw, field, where, default):
    """{"type": "string"} that parse_duration reads as 0 or more, as its ns; absent or null:
    default."""
    value = raw.get(field)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ConfigError(f'{where}.{field}: a duration is a string such as "15s"')
    try:
        ns = parse_duration(value)
    except ValueError:
        raise ConfigError(f'{where}.{field} {quote(value)} is not a duration; write it like '
                          f'"15s", "300ms" or "1h30m"') from None
    if ns < 0:
        raise ConfigError(f"{where}.{field} must not be negative")
    return ns


def parse_decimal(value, where):
    """{"type": ["number", "string"], "maxLength": 10000,
    "pattern": "^-?(0|[1-9][0-9]*)([.][0-9]+)?([eE][+-]?0*([0-9]{1,4}|10000))?$"}, as a Decimal."""
    if isinstance(value, Number):
        return value.exact()
    found = decimal_text(value) if isinstance(value, str) else None
    if found is not None:
        return found
    raise ConfigError(f'{where} must be a number or a decimal string such as "50.00"')


def decimal_text(text):
    """A JSON number's spelling as an exact Decimal, or None."""
    if JSON_NUMBER_RE.fullmatch(text) and not number_bound(text):
        return decimal.Decimal(text)
    return None


def whole_number(value, where, least, most=math.inf, note=""):
    """{"type": "integer", "minimum": least, "maximum": most}, as an int."""
    if not isinstance(value, Number) or not value.is_integer() \
            or not least <= value.exact() <= most:
        upto = "" if most == math.inf else f" and at most {most}"
        raise ConfigError(f"{where} must be a whole number of at least {least}{upto}{note}")
    return int(value.exact())


def one_of(value, choices, where):
    """{"enum": choices}."""
    if value not in choices:
        shown = value if isinstance(value, str) else policy_json(value)
        raise ConfigError(f"{where} is {quote(shown)}; use one of {', '.join(choices)}")
    return value


# =============================================================================================
# 18. Days and hours in a time zone
#
# Reads as: library
#
# Contract: During(raw, where) reads a `during` object. zone, required: a zone the machine's
# time zone database holds, named as tz names zones (ASCII letters, digits and _+.- in at
# most four parts split by /), and not a file beside the zones there (localtime, posixrules,
# the posix/ and right/ copies). days: days or ranges of days, comma-separated, with white space
# around each, as mon, tue, ... sun in any case; "mon-fri", "fri-mon" (past Sunday) or
# "sat,sun". hours: "HH:MM-HH:MM", white space around the dash allowed, 00:00 to 23:59 or an
# end of 24:00, start and end different; the range runs past midnight when the end comes
# first, as in "22:00-06:00". At least one of days and hours, and no other field. Anything
# else raises ConfigError, one sentence naming the field as `where` places it.
# holds(at) tells whether the instant `at` (seconds since the epoch, read to the microsecond)
# shows, on a wall clock in that zone, one of the days (any day without days) and a minute
# from the start up to, not including, the end (any minute without hours). The day is always
# the instant's own, also in a range past midnight: "fri" with "22:00-06:00" holds early and
# late on Friday, not early on Saturday. A change of the clocks moves the window with the
# wall clock: a minute the clock skips never holds, one it shows twice holds twice.
# Differential test: tests/test_days_differential.py (against node's Intl, which reads ICU's
# own copy of the time zone database).
# =============================================================================================

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_CLOCK_RE = re.compile(r"([01][0-9]|2[0-3]):([0-5][0-9])|24:00")
_ZONE_RE = re.compile(r"[A-Za-z0-9_+.-]+(/[A-Za-z0-9_+.-]+){0,3}")


def _zone(name):
    """The zone tz names `name`, or None. Only a name as tz spells zones (zoneinfo recurses once
    a level, and would fail on a deep one), and never a file beside the zones: the machine's
    own zone, or a copy (right/ counts leap seconds, so its wall clock is off after a change)."""
    import zoneinfo  # only a policy with `during` needs the time zone database
    if not isinstance(name, str) or not _ZONE_RE.fullmatch(name) \
            or name.lower() in ("localtime", "posixrules") \
            or name.lower().startswith(("posix/", "right/")):
        return None
    try:
        return zoneinfo.ZoneInfo(name)
    except (ValueError, zoneinfo.ZoneInfoNotFoundError):
        return None


class During:
    def __init__(self, raw, where):
        if not isinstance(raw, dict) or not raw:
            raise ConfigError(f'{where} must be an object such as {{"days": "mon-fri", '
                              f'"hours": "09:00-18:00", "zone": "Europe/Paris"}}')
        refuse_unknown(raw, ("days", "hours", "zone"), where)
        zone = raw.get("zone")
        if zone is None:
            raise ConfigError(f'{where} needs zone, the time zone its days and hours are read '
                              f'in, such as "Europe/Paris" or "UTC"')
        self.zone = _zone(zone)
        if self.zone is None:
            raise ConfigError(f'{where}.zone {quote(str(zone))} is not a time zone this machine '
                              f'knows; name one such as "Europe/Paris" or "UTC"')
        if "days" not in raw and "hours" not in raw:
            raise ConfigError(f"{where} needs days, hours or both")
        self.raw = raw  # for the load report
        self.days = self._days(raw["days"], f"{where}.days") if "days" in raw else set(range(7))
        self.hours = self._hours(raw["hours"], f"{where}.hours") if "hours" in raw else None

    @staticmethod
    def _days(text, where):
        days = set()
        for part in text.split(",") if isinstance(text, str) else [None]:
            first, dash, last = (part or "").strip().lower().partition("-")
            if first not in DAYS or (dash and last not in DAYS):
                raise ConfigError(f'{where} must read like "mon-fri" or "sat,sun"')
            start, end = DAYS.index(first), DAYS.index(last or first)
            days.update(d % 7 for d in range(start, end + (7 if end < start else 0) + 1))
        return days

    @staticmethod
    def _hours(text, where):
        first, _, last = text.partition("-") if isinstance(text, str) else ("", "", "")
        first, last = first.strip(), last.strip()
        if not _CLOCK_RE.fullmatch(first) or not _CLOCK_RE.fullmatch(last) or first == last \
                or first == "24:00":
            raise ConfigError(f'{where} must read like "09:00-18:00" (a range past midnight, '
                              f'like "22:00-06:00", is allowed)')
        return tuple(int(t[:2]) * 60 + int(t[3:5]) for t in (first, last))

    def holds(self, at):
        local = datetime.datetime.fromtimestamp(at, self.zone)
        if local.weekday() not in self.days:
            return False
        if self.hours is None:
            return True
        minute, (start, end) = local.hour * 60 + local.minute, self.hours
        return start <= minute < end if start < end else minute >= start or minute < end


# =============================================================================================
# 19. What a result's record keeps
#
# Reads as: library
#
# Contract: result_record(passed) identifies exactly the result passed_result passed on,
# without keeping all of it: the size and sha256 of canonical(passed); its first
# RECORDED_BLOCKS blocks, and the count past them; structuredContent's size and sha256, with
# its value while it fits; is_error when isError is true. A block (a resource block: its
# resource) keeps its type (cut at 100 bytes), its mimeType, uri and name where they are
# strings, then its text; else the size and sha256 of the bytes its data or blob is the RFC
# 4648 base64 of (padded, pad bits zero; anything else: of its UTF-8, marked base64 false);
# else those of its canonical encoding. The kept strings share CONTENT_CAP UTF-8 bytes in
# block order: whole while they fit, then cut to whole characters, then ""; a cut text keeps
# the size and sha256 of all of it. block_labels, outcome_text (records before schema 4 too)
# and result_summary read a record back as text.
# Differential test: tests/test_result_record_differential.py (node's Buffer and crypto).
# =============================================================================================

CONTENT_CAP = 65536  # bytes of result text the record keeps, and of recorded text in prose
RECORDED_BLOCKS = 512  # blocks a record describes one by one; the rest it counts


def result_record(passed):
    """What the record keeps of a result, identifying exactly what the model got: canonical
    size and hash; each block, its text while texts total at most CONTENT_CAP bytes (else size
    and hash); structured content whole if it fits what is left."""
    room = [CONTENT_CAP]

    def keep(text):
        data = text.encode("utf-8", "surrogatepass")
        kept = data[:room[0]]
        room[0] -= len(kept)
        return text if len(kept) == len(data) else kept.decode("utf-8", "ignore")

    blocks = passed["content"]
    record = {**_size_and_hash(canonical(passed)),
              "blocks": [recorded_block(block, keep) for block in blocks[:RECORDED_BLOCKS]]}
    if len(blocks) > RECORDED_BLOCKS:
        record["more_blocks"] = len(blocks) - RECORDED_BLOCKS
    if "structuredContent" in passed:
        structured = canonical(passed["structuredContent"])
        record["structured"] = _size_and_hash(structured)
        if len(structured) <= room[0]:
            record["structured"]["value"] = passed["structuredContent"]
    if passed.get("isError") is True:
        record["is_error"] = True
    return record


def recorded_block(block, keep):
    """One block as recorded: data or a blob as the size and hash of the bytes it encodes (a
    file can be matched); a block with neither text nor data, as its canonical form's."""
    kind = block["type"]
    entry = {"type": cut(kind, 100)}
    source = block.get("resource") if kind == "resource" and isinstance(
        block.get("resource"), dict) else block
    for label in ("mimeType", "uri", "name"):
        if isinstance(source.get(label), str):
            entry[label] = keep(source[label])
    text = source.get("text") if kind in ("text", "resource") else None
    data = source.get({"resource": "blob", "image": "data", "audio": "data"}.get(kind))
    if isinstance(text, str):
        entry["text"] = keep(text)
        if entry["text"] != text:
            entry.update(_size_and_hash(text.encode("utf-8", "surrogatepass")))
    elif isinstance(data, str):
        decoded = _base64_bytes(data)
        if decoded is None:  # not base64: what was sent is what is identified
            entry.update(_size_and_hash(data.encode("utf-8", "surrogatepass")), base64=False)
        else:
            entry.update(_size_and_hash(decoded))
    else:
        entry.update(_size_and_hash(canonical(block)))
    return entry


def _base64_bytes(text):
    """The bytes `text` is the base64 of, when it is their one spelling, else None: "QQ==" is,
    "QR==" (pad bits set) and "QUJD=" ("=" past a whole quantum) are not."""
    try:
        decoded = base64.b64decode(text, validate=True)
    except ValueError:
        return None
    return decoded if base64.b64encode(decoded).decode() == text else None


def _size_and_hash(data):
    return {"bytes": len(data), "sha256": sha256_hex(data)}


def block_bytes(entry):
    if "bytes" in entry:
        return entry["bytes"]
    return len(entry["text"].encode("utf-8", "surrogatepass"))


def block_labels(record):
    labels = []
    for entry in record["blocks"]:
        label = entry.get("mimeType") or entry.get("uri")
        label = f"{entry['type']} {label}" if label else entry["type"]
        labels.append(f"[{label}, {block_bytes(entry)} bytes]")
    if record.get("more_blocks"):
        labels.append(f"[{record['more_blocks']} more blocks]")
    return labels


def outcome_text(observed):
    """A recorded outcome as text: a result's text blocks and other blocks' labels (withheld:
    only labels; structured content alone: its JSON), the error instead, or, recorded before
    schema 4, its content."""
    if "result" not in observed:
        content = observed["content"]
        if observed["kind"] != "tool_result":
            return content["error"]
        return content if isinstance(content, str) else policy_json(content)
    record, withheld = observed["result"], observed.get("withheld", False)
    blocks, labels = record["blocks"], block_labels(record)
    parts = [entry["text"] if entry["type"] == "text" and "text" in entry and not withheld
             else label for entry, label in zip(blocks, labels)] + labels[len(blocks):]
    structured = record.get("structured", {})
    if not blocks and "value" in structured and not withheld:
        parts.append(policy_json(structured["value"]))
    return "\n".join(parts)


def result_summary(tool, record, withheld_over=0):
    count = len(record["blocks"]) + record.get("more_blocks", 0)
    parts = [f"{tool.server.name}/{tool.upstream_name}: {record['bytes']} bytes, {count} "
             f"block{'s' if count != 1 else ''}"]
    if "structured" in record:
        parts.append("structured content")
    if record.get("is_error"):
        parts.append("an error")
    if withheld_over:
        parts.append(f"withheld: more than {withheld_over} bytes")
    return ", ".join(parts)


# =============================================================================================
# 20. The lint
#
# Reads as: around the core
#
# Owns: the lint of the texts a model reads of a tool (description, titles, the schema's
# texts and names): the findings load_all hands the load check, which refuses a tool with a
# high finding unless its rule accepts exactly that text (lint_hash, section 5).
# Promises: a finding names what it found and where, sanitized; it never changes what a tool
# presents.
# Core it calls: tool_titles.
# =============================================================================================

# A tool's description, its schema's texts and its parameters' names are read by the model on
# every tools/list, so they are where tool poisoning hides instructions. The lint finds the
# tricks known to be used; it cannot find them all, and says so in the README. Advice to call
# a tool of the same server first is how public servers sequence their tools: it stays medium.
LINT_LONG = 1024  # a description is far longer than its peers past this and four times theirs

_LINT_PHRASES = [(re.compile(pattern, re.I | re.S), severity, what)
                 for pattern, severity, what in (
    (r"<\s*/?\s*(important|system|instructions?|secret|hidden|admin|context|critical)\b[^>]*>",
     LINT_HIGH, "a tag-like block"),
    (r"<!--", LINT_HIGH, "an HTML comment, which rendered text hides"),
    (r"\b(ignore|disregard|forget|override)\b.{0,40}\b(instructions?|prompts?|rules|guidelines|"
     r"guidance|directions|directives)\b", LINT_HIGH,
     "text telling the model to ignore its instructions"),
    (r"\b(system prompt|(previous|earlier|prior) instructions|you are now|new instructions|"
     r"as an ai)\b", LINT_HIGH, "text aimed at the model's instructions"),
    (r"\b(do not|don't|never|without)\b.{0,40}\b(tell|telling|inform|informing|mention|"
     r"mentioning|reveal|revealing|alert|alerting|notify|notifying|let|letting)\b.{0,40}"
     r"\b(user|human|operator|person|people|anyone)|\b(hide|hiding|conceal|concealing|keep|"
     r"keeping)\b.{0,40}\bfrom\b.{0,20}\b(user|human|operator|person|people|anyone)|\bwithout\b"
     r".{0,20}\b(user|human|operator|person)('s)?\s+(knowing|knowledge|noticing|consent)",
     LINT_HIGH, "text telling the model to keep something from the user"),
    (r"\b(when|whenever|every time)\b.{0,60}\b(any|every|all|other|another)\b"
     r".{0,20}\b(tools?|commands?|calls?|requests?)\b.{0,80}\b(must|always|never)\b", LINT_HIGH,
     "instructions for the model's other calls"),
    (r"((?<![\w.])\.ssh\b|\bid[_ ](rsa|dsa|ecdsa|ed25519)\b|\.aws/credentials|/etc/(passwd|"
     r"shadow)|(^|[\s/'\"`])\.env\b|\.netrc\b|\.pgpass\b|\.git-credentials|\.npmrc\b|"
     r"\.pypirc\b|\.kube/config|\.docker/config\.json|\bmcp\.json\b|"
     r"claude_desktop_config\.json)", LINT_HIGH, "the place of a secret"),
    # Case matters: AWS_SECRET_ACCESS_KEY names a secret, an access_token parameter does not.
    (r"(?-i:\b[A-Z][A-Z0-9_]*_(SECRET|TOKEN|PASSWORD|PASSWD|API_KEY|APIKEY|ACCESS_KEY|"
     r"PRIVATE_KEY|CREDENTIALS?)[A-Z0-9_]*\b)", LINT_HIGH, "a secret named by its variable"),
    (r"[\x1b\x9b]", LINT_HIGH, "terminal escape sequences, which can hide text on a screen"),
    (r"\b(other|another|different)\s+(tools?|servers?|functions?)\b", LINT_MEDIUM,
     "a reference to other tools or servers"),
    (r"\b[a-z][a-z0-9+.-]*://\S+", LINT_MEDIUM, "a URL"),
    (r"(^|[\s'\"`(=])(~/|/(etc|home|root|users|var|tmp|usr|opt)/|[a-z]:\\)\S*", LINT_MEDIUM,
     "a file path"),
)]
_FIRST_STEP = re.compile(r"\bbefore\b.{0,30}\b(using|calling|invoking|you use|you call)\b.{0,120}"
                         r"\b(read|call|send|run|fetch|open|pass|include|upload)\b", re.I | re.S)
# Words that make a mention of another tool an instruction about it (shadowing).
_DIRECTIVE = re.compile(r"\b(must|always|never|instead|do not|don't)\b", re.I)
_SENTENCE_END = re.compile(r"[.!?](\s|$)")
_LETTERS_RE = re.compile(r"[^\W\d_]+")
# Each selector hides one byte (U+FE00-FE0F: 0-15, U+E0100-E01EF: 16-255); emoji take one.
_SELECTOR_RUN = re.compile("[\ufe00-\ufe0f\U000e0100-\U000e01ef]{2,}")
_READ_KEYWORDS = ("description", "title", "default", "examples", "enum", "const", "$comment")


def lint_texts(entry):
    """(where, text) of everything the model reads of a tool but its names: its description,
    titles, and anywhere in its input schema the _READ_KEYWORDS' values and x- extensions."""
    texts = [("description", entry.get("description") or ""), *tool_titles(entry)]

    def walk(node, where):
        if isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}/{i}")
        if not isinstance(node, dict):
            return
        for key, value in node.items():
            at = f"{where}/{key}"
            if key in SCHEMA_MAPS and isinstance(value, dict):  # names here are not keywords
                for name, schema in value.items():
                    walk(schema, f"{at}/{name}")
            elif key in _READ_KEYWORDS or key.startswith("x-"):
                texts.extend((f"input schema {at}", text) for text in _strings(value))
            else:
                walk(value, at)
    walk(entry.get("input_schema"), "")
    return texts


def _strings(value):
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    if isinstance(value, dict):
        return [s for item in value.values() for s in _strings(item)]
    return []


def scripts_of(word):
    return {unicodedata.name(ch, "?").split()[0] for ch in word if ch.isalpha()}


# Cyrillic and Greek letters that read as Latin ones, after UTS #39's confusables.
LATIN_LOOKALIKES = dict(zip(
    "аеіјорсухѕԁӏһԛԝАВЕКМНОРСТХІЈЅУҮԚԜӀαονιρυχΑΒΕΖΗΙΚΜΝΟΡΤΥΧ",
    "aeijopcyxsdlhqwABEKMHOPCTXIJSYYQWlaovipuxABEZHIKMNOPTYX"))


def latin_lookalike(word):
    """The Latin word that `word`, written wholly in another script's lookalike letters
    (раураӏ), reads as; '' for any other word. Three letters at least: short words of
    those scripts (а, с, о) are common and imitate nothing."""
    if len(word) < 3 or scripts_of(word) & {"LATIN"} or \
            not all(ch in LATIN_LOOKALIKES for ch in word):
        return ""
    return "".join(LATIN_LOOKALIKES[ch] for ch in word)


def lookalike_words(text):
    """The words of `text` made to be read as others: whose letters come from more than one
    script (a Cyrillic а among Latin letters), or that are written wholly in letters that
    read as Latin ones (a whole-script confusable, as UTS #39 calls it)."""
    return sorted({word for word in _LETTERS_RE.findall(text)
                   if len(scripts_of(word)) > 1 or latin_lookalike(word)})


def invisible_codes(text):
    return sorted({ord(ch) for ch in text if ord(ch) in INVISIBLE})


def _schema_names(schema):
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "properties" and isinstance(value, dict):
                yield from value
            yield from _schema_names(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _schema_names(value)


def _name_words(name):
    """A name as the model reads it: content_from_reading_ssh_id_rsa, readSshKey -> words."""
    return re.sub(r"[_.-]+|(?<=[a-z0-9])(?=[A-Z])", " ", name)


def _named(names, text):
    return sorted(name for name in names if re.search(
        rf"(?<![\w-]){re.escape(name)}(?![\w-])", text))


def _sentence_from(text, start):
    end = _SENTENCE_END.search(text, start)
    return text[start:end.end() if end else len(text)]


def _smuggled(text):
    """What runs of variation selectors spell, decoded as bytes ('' when there are none)."""
    spelled = bytearray()
    for run in _SELECTOR_RUN.findall(text):
        spelled += bytes(ord(ch) - 0xFE00 if ord(ch) < 0xFF00 else ord(ch) - 0xE0100 + 16
                         for ch in run)
    return spelled.decode("utf-8", "replace")


def lint_tool(entry, others, siblings, peer_length):
    """A tool's findings as (severity, what, where), the high ones first. `others`: names of
    other servers' tools; `siblings`: of its own server's; `peer_length`: the median
    description length of its server."""
    findings = []
    for name in (entry["name"], *_schema_names(entry.get("input_schema"))):
        scripts = scripts_of(name)
        if len(scripts) > 1:
            findings.append((LINT_HIGH, "a name that mixes scripts (" +
                             ", ".join(sorted(scripts)) + ")", f"name {quote(name)}"))
        elif lookalike_words(name):
            findings.append((LINT_HIGH, "a name in letters that read as Latin ones",
                             f"name {quote(name)}"))
        words = _name_words(name)
        findings += [(severity, what, f"name {quote(name)}")
                     for pattern, severity, what in _LINT_PHRASES if pattern.search(words)]
    for where, text in lint_texts(entry):
        findings += [(severity, what, where) for severity, what in _text_findings(
            text, others, set(siblings) - {entry["name"]})]
    length = len(entry.get("description") or "")
    if length > max(LINT_LONG, 4 * peer_length):
        findings.append((LINT_MEDIUM, f"{length} characters long, far longer than its peers",
                         "description"))
    return sorted(findings, key=lambda f: f[0] != LINT_HIGH)


def _text_findings(text, others, siblings):
    """(severity, what) of one text the model reads."""
    found = []
    hidden = invisible_codes(text)
    if hidden:
        # Tag characters mirror ASCII: what they spell is what the model may read.
        spelled = "".join(chr(ord(ch) - 0xE0000) for ch in text if 0xE0020 <= ord(ch) < 0xE007F)
        found.append((LINT_HIGH, "invisible, bidirectional or tag characters (" +
                      ", ".join(f"U+{code:04X}" for code in hidden[:5]) + ")" +
                      (f" spelling {quote(cut(spelled, 200))}" if spelled else "")))
    smuggled = _smuggled(text)
    if smuggled:
        found.append((LINT_HIGH, f"variation selectors hiding bytes that spell "
                                 f"{quote(cut(smuggled, 200))}"))
    found += [(severity, what) for pattern, severity, what in _LINT_PHRASES
              if pattern.search(text)]
    step = _FIRST_STEP.search(text)
    if step and _named(siblings, _sentence_from(text, step.start())):
        found.append((LINT_MEDIUM, "a step the model is told to take first, with a tool of "
                                   "its own server"))
    elif step:
        found.append((LINT_HIGH, "a step the model is told to take first"))
    mixed = lookalike_words(text)
    if mixed:
        found.append((LINT_HIGH, f"words that mix scripts or imitate Latin ones "
                                 f"({', '.join(mixed[:3])})"))
    named = _named(others, text)
    if named and _DIRECTIVE.search(text):
        found.append((LINT_HIGH, f"instructions about other servers' tools "
                                 f"({', '.join(named[:3])})"))
    elif named:
        found.append((LINT_MEDIUM, f"names other servers' tools ({', '.join(named[:3])})"))
    return found


def lint_lines(findings):
    return [f"  lint {severity}: {what} (in the {sanitize(where)})"
            for severity, what, where in findings]


def lint_manifests(manifests):
    """{server name: {tool: findings}} over pinned manifests, each tool read among its peers."""
    # A short plain name (add, search) is an ordinary word in prose, not a mention of a tool.
    names = {server: {name for name in manifest["tools"]
                      if len(name) >= 8 or "_" in name or "-" in name}
             for server, manifest in manifests.items()}
    found = {}
    for server, manifest in manifests.items():
        others = {name for other, tools in names.items() if other != server
                  for name in tools} - set(manifest["tools"])
        lengths = sorted(len(e.get("description") or "") for e in manifest["tools"].values())
        median = lengths[len(lengths) // 2] if lengths else 0
        found[server] = {tool: lint_tool(entry, others, names[server], median)
                         for tool, entry in manifest["tools"].items()}
    return found


# =============================================================================================
# 21. Upstream servers
#
# Reads as: around the core
#
# Owns: how the config says a server is reached (read_transport) and whether that reaches
# what the gate depends on (check_reach); a server as a child process speaking
# newline-delimited JSON-RPC (Upstream), or reached by url over Streamable HTTP through the
# standard library's client (HttpUpstream), the requests agentgate sends it; its manifest.
# Core it calls: read_config (load_config hands it read_transport), read_frames, read_owned;
# and, for load_all, load, which tells each server's Report.
# Promises: the child gets only PATH, HOME, TMPDIR and what the operator names; it runs in its
# own process group and, on Linux, dies with agentgate even when agentgate is killed with
# SIGKILL; connecting, listing and loading share one deadline and a timeout names its step;
# every request the server sends agentgate gets an answer, never silence; its progress reaches
# only the request whose token agentgate gave it; an oversized or unusable message fails only
# the request it answers, and none ends the reading thread; only an integer id agentgate
# wrote matches an answer; a server that does not take in a message by its write's deadline
# is stopped (the error says whether any byte reached it); a server that exits fails every
# later call at once, as not sent, until it is started again (section 23), a url server
# that cannot be reached or forgot its session until it is connected again. Closing is
# idempotent and never waits on a server. Every failure names one outcome
# (UpstreamError.outcome), set where the bytes are written. Over HTTP the same holds, and:
# each message goes on its own connection, so no call waits for another's answer; no
# byte of a request is written after its deadline; no redirect is followed; a refused
# connection sent nothing, a connection lost after sending or HTTP 500 or more may have
# executed; a stream closed after naming an event is resumed within the request's deadline;
# the server's own stream is listened to. The newest protocol version both sides speak is
# asked for. A server asking for OAuth is sent the tokens `login` kept for this config and
# url, renewed at the token endpoint login found; the serving gate never asks a person, so a
# server refusing what it holds is not served until login (LOGIN_NEEDED).
# =============================================================================================

# ---- Reaching a server: the config's transport fields ---------------------------------------
#
# A url server's header values come from the 0600 config or agentgate's environment (`${NAME}`);
# no message shows one, nor more of its url than shown_url.

_HEADER_NAME_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
ENV_REFERENCE_RE = re.compile(r"\$\{([^}]*)\}")
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
OAUTH_FIELDS = ("client_id", "client_secret", "scope")


def load_config(path):
    return read_config(path, read_transport)


def read_transport(server, raw, where, base):
    server.command = raw.get("command")
    server.url = field_string(raw, "url", where)
    server.headers, server.oauth = {}, {}
    # Why this sound config's server cannot start (''): it is not served, the others are.
    server.unavailable = ""
    if (server.command is None) == (not server.url):
        raise ConfigError(f"{where} needs exactly one of command (an argv list) or url (an "
                          f"http:// or https:// address)")
    if server.url:
        server.headers, server.unavailable = _url_server(raw, where, server.url)
        server.oauth = _oauth_client(raw, where)
    elif (not isinstance(server.command, list) or not server.command
            or not all(isinstance(a, str) for a in server.command)):
        raise ConfigError(f'{where}.command must be a non-empty list of strings, such as '
                          f'["node", "server.js"]')
    elif "headers" in raw or "oauth" in raw:
        field = "headers" if "headers" in raw else "oauth"
        raise ConfigError(f"{where}.{field} is sent only to a server reached by url; give "
                          f"a command server its secrets through env")
    server.env = field_names(raw, "env", where)
    for entry in server.env:
        if "=" not in entry or entry.startswith("="):
            raise ConfigError(f'{where}.env entry {quote(entry)} must read NAME=value')
    server.inherit_env = field_names(raw, "inherit_env", where)
    for name in server.inherit_env:
        if not name or "=" in name:
            raise ConfigError(f"{where}.inherit_env entry {quote(name)} must be a variable "
                              f"name without '='")
    server.connect_timeout = field_duration(raw, "connect_timeout", where, 30 * SECOND)
    # What login obtained, for this config's server of this name (TokenFile binds the url).
    stem = os.path.splitext(os.path.basename(server.config_path))[0]
    server.tokens = os.path.join(base, f"{stem}.{server.name}.tokens.json")
    # A server runs in the user's home, not beside the config and database: writing a relative
    # path must not edit its own policy. A configured cwd is reach-checked (check_reach).
    server.cwd_given = field_string(raw, "cwd", where)
    server.cwd = os.path.join(base, os.path.expanduser(server.cwd_given)) if server.cwd_given \
        else os.path.expanduser("~")


def _file_identity(path):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _protected(config):
    identities, missing = set(), set()
    for path in (config.path, config.database, *(s.manifest for s in config.servers)):
        for current in (os.path.abspath(path), os.path.realpath(path)):
            while current:
                identity = _file_identity(current)
                if identity:
                    identities.add(identity)
                else:
                    missing.add(os.path.realpath(current))
                current = os.path.dirname(current) if current != "/" else ""
    return identities, missing


def _reach_candidates(arg):
    from urllib.parse import unquote
    candidates = [arg] + [arg.split(sep, 1)[1] for sep in "=:" if sep in arg]
    if arg.startswith("-") and not arg.startswith("--") and len(arg) > 2:
        candidates.append(arg[2:])
    candidates += [unquote(re.sub(r"^file:(//[^/]*)?", "", c)) or "/" for c in candidates
                   if c.startswith("file:")]
    home = os.path.expanduser("~")
    return [home + c[1:] if c == "~" or c.startswith("~/") else c for c in candidates if c]


def check_reach(config):
    """Refuse a server whose cwd or arguments name a file its policy depends on, or a directory
    above one: a guard against a plain mistake, not a boundary (a server can reach anything
    its user can)."""
    identities, missing = _protected(config)
    for server in config.servers:
        if server.skip_path_check:
            continue
        named = [(f"cwd {quote(server.cwd_given)}", server.cwd)] if server.cwd_given else []
        named += [(f"argument {quote(arg)}", os.path.join(server.cwd, candidate))
                  for arg in (server.command or [])[1:]  # a url server has no arguments
                  for candidate in _reach_candidates(arg)]
        for what, path in named:
            identity = _file_identity(path)
            if (identity and identity in identities) or os.path.realpath(path) in missing:
                raise ConfigError(
                    f"server {quote(server.name)}: its {what} reaches {os.path.realpath(path)}, "
                    f"which the gate's policy and approvals depend on: point the server "
                    f"elsewhere, or set skip_path_check on it if it cannot write there")


def child_env(server):
    """PATH, HOME, TMPDIR, inherit_env, env: a secret of ours reaches only a server named."""
    env = {}
    for name in ("PATH", "HOME", "TMPDIR", *server.inherit_env):
        if name in os.environ:
            env[name] = os.environ[name]
    for entry in server.env:
        name, _, value = entry.partition("=")
        env[name] = value
    return env


def _url_server(raw, where, url):
    """Its headers, each `${NAME}` replaced from our environment, and why it cannot start (an
    unset variable is a problem of where agentgate runs, not of the config). No value shown."""
    from urllib.parse import urlsplit
    for field in ("env", "inherit_env", "cwd"):
        if field in raw:
            raise ConfigError(f"{where}.{field} means nothing for a server reached by url (no "
                              f"process is started); remove it, and send secrets as headers")
    try:
        parts = urlsplit(url)
    except ValueError:
        parts = None
    if not parts or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}.url must be an http:// or https:// address, such as "
                          f'"http://127.0.0.1:8000/mcp"')
    if "@" in parts.netloc:  # the url is shown in messages; a password in it would be too
        raise ConfigError(f"{where}.url must not carry a user or password; send credentials "
                          f"as a header whose value names an environment variable")
    given = raw.get("headers", {})
    if not isinstance(given, dict) or not all(isinstance(v, str) for v in given.values()):
        raise ConfigError(f'{where}.headers must be an object of header name to string, such as '
                          f'{{"Authorization": "Bearer ${{TOKEN}}"}}')
    headers, unset = {}, ""
    for name, value in given.items():
        if not _HEADER_NAME_RE.fullmatch(name):
            raise ConfigError(f"{where}.headers: {quote(name)} is not a header name")
        for variable in ENV_REFERENCE_RE.findall(value):
            if not ENV_NAME_RE.fullmatch(variable):
                raise ConfigError(f"{where}.headers.{name} names {quote('${' + variable + '}')}"
                                  f"; a variable is written ${{NAME}} with letters, digits and "
                                  f"'_'")
            if variable not in os.environ and not unset:
                unset = (f"{where}.headers.{name} names the environment variable {variable}, "
                         f"which is not set: set it where agentgate runs")
        headers[name] = ENV_REFERENCE_RE.sub(lambda m: os.environ.get(m.group(1), ""), value)
        if re.search(r"[\x00-\x08\x0a-\x1f\x7f]", headers[name]):
            raise ConfigError(f"{where}.headers.{name} holds a control character (a line "
                              f"break, say), which no header may carry; fix its value")
    return headers, unset


def _oauth_client(raw, where):
    """A pre-registered OAuth client, for a server that does not register clients itself."""
    given = raw.get("oauth", {})
    if not isinstance(given, dict):
        raise ConfigError(f'{where}.oauth must be an object such as {{"client_id": "...", '
                          f'"client_secret": "...", "scope": "..."}}')
    refuse_unknown(given, OAUTH_FIELDS, f"{where}.oauth")
    for field in OAUTH_FIELDS:
        if field in given and (not isinstance(given[field], str) or not given[field]):
            raise ConfigError(f"{where}.oauth.{field} must be a non-empty string")
    if "client_secret" in given and "client_id" not in given:
        raise ConfigError(f"{where}.oauth has a client_secret but no client_id; give both")
    return dict(given)


def shown_url(url):
    """Scheme, host and port only: a hosted server often carries its key in path or query."""
    from urllib.parse import urlsplit
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return "an address that cannot be read"
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}" + (f":{port}" if port else "")


def write_private(path, text):
    directory = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(prefix=".agentgate-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temp, 0o600)
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise


_INT_ID_RE = re.compile(r"-?(?:0|[1-9][0-9]{0,17})")


def int_id(value):
    """An id as agentgate writes its own requests' ids: an integer literal of at most 18
    digits, or None. No other value (3.9, 1e1000000, Infinity) can name one of them."""
    if isinstance(value, Number) and _INT_ID_RE.fullmatch(value.literal):
        return int(value.literal)
    return None


CLIENT_INFO = {"name": "agentgate", "version": VERSION}

STDERR_TAIL_BYTES = 4096
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_TOOL_PAGES = 100
MAX_TOOLS = 1000
PR_SET_PDEATHSIG = 1
# How long a message agentgate writes on its own (an answer to the server's ping, a cancel
# notice) may wait for the server to read it; a request waits as long as its own deadline.
OWN_WRITE_SECONDS = 5


@functools.lru_cache(maxsize=1)
def _parent_death_request():
    """prctl(PR_SET_PDEATHSIG, SIGKILL), for a child to call between fork and exec on Linux.
    Looked up here, in the parent: a forked child must load no library."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return functools.partial(prctl, PR_SET_PDEATHSIG, signal.SIGKILL)


class Upstream:
    """A connected stdio MCP server."""

    def __init__(self, server):
        self.server = server
        self.name = server.name
        self.proc = None
        self.next_id = 0
        self.slots = {}
        self.lock = threading.Lock()
        self.write_lock = threading.Lock()
        self.closed = None
        self.stderr_tail = b""
        self.stderr_done = threading.Event()
        self.protocol = None
        # Called (on the reading thread, so it must not block) when the server says its
        # tools changed; set by watch_tools once the gate serves. `heard_list_changed`: such
        # a notice came before that. `pinned`: its manifest's tools, from load.
        self.on_list_changed = None
        self.heard_list_changed = False
        self.pinned = {}
        # While the gate serves, on_exit(why) is called when the server goes away on its
        # own, so it is started again; `down` is then (since, next try), epoch seconds,
        # until it serves again: what calls and the status tool read, of any transport.
        self.on_exit = None
        self.down = None

    AGAIN = "started again"  # what ToolWatch does once it went away

    def describe(self, step, detail):
        return f"server {quote(self.name)}: {step}: {detail}"

    # -- process ---------------------------------------------------------------------------

    def spawn(self):
        """Start the child. On Linux its parent-death signal fires when the spawning thread
        ends, so this runs on a thread that lives as long as agentgate (the main thread)."""
        try:
            # bufsize=0: nothing is buffered on the way to the child, so closing its input
            # never waits to flush into a pipe nobody reads.
            proc = subprocess.Popen(
                self.server.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, env=child_env(self.server), start_new_session=True,
                cwd=self.server.cwd, bufsize=0, preexec_fn=_parent_death_request())
        except OSError as err:
            raise UpstreamError(self.describe("connect", f"cannot start "
                                              f"{quote(self.server.command[0])}: {err.strerror}"),
                                "not_sent")
        os.set_blocking(proc.stdin.fileno(), False)  # writes wait in poll, with a deadline
        self.stderr_tail, self.stderr_done = b"", threading.Event()
        with self.lock:
            self.proc, self.closed = proc, None
        threading.Thread(target=self._read_stdout, args=(proc,), daemon=True).start()
        threading.Thread(target=self._read_stderr, args=(proc.stderr, self.stderr_done),
                         daemon=True).start()

    def protocol_versions(self):
        return PROTOCOL_VERSIONS

    def handshake(self, deadline):
        versions = self.protocol_versions()
        result = self.request("initialize", {
            "protocolVersion": versions[-1], "capabilities": {}, "clientInfo": CLIENT_INFO},
            deadline, "connect")
        if not isinstance(result, dict):
            raise UpstreamError(self.describe("connect", "the server's initialize answer is "
                                              "not an object"))
        chosen = result.get("protocolVersion")
        if chosen not in versions:
            raise UpstreamError(self.describe("connect", f"the server answered protocol version "
                                              f"{quote(str(chosen)[:40])}; this client "
                                              f"speaks {', '.join(versions)}"))
        self.protocol = chosen  # HTTP names it on every later message
        self.notify("notifications/initialized", {})

    def close(self):
        with self.lock:
            proc, self.proc = self.proc, None
            self.closed = self.closed or "the connection was closed"
            self._fail_all(self.closed)
        if proc is None:
            return
        # The input is closed only while no write is under way, so a writer never writes to
        # a descriptor number the process has reused; a write stuck on a server that does not
        # read is ended by killing the server, which breaks its pipe.
        if not self.write_lock.acquire(timeout=1):
            signal_group(proc.pid, signal.SIGKILL)
            self.write_lock.acquire()
        try:
            proc.stdin.close()
        except OSError:
            pass
        finally:
            self.write_lock.release()
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        # The group may hold descendants (a server started through npx, say) that outlive
        # their parent; they are killed even when the server itself exited politely.
        signal_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def _read_stderr(self, stream, done):
        try:
            for chunk in iter(lambda: os.read(stream.fileno(), 4096), b""):
                self.stderr_tail = (self.stderr_tail + chunk)[-STDERR_TAIL_BYTES:]
        except (OSError, ValueError):
            pass
        finally:
            done.set()

    def tail(self):
        self.stderr_done.wait(timeout=2 if self.closed else 0.2)
        text = self.stderr_tail.decode("utf-8", "replace").strip()
        return f'; stderr: "{clean(text, STDERR_TAIL_BYTES)}"' if text else ""

    # -- messages --------------------------------------------------------------------------

    def _read_stdout(self, proc):
        try:
            for frame, ident in read_frames(proc.stdout.fileno(), MAX_MESSAGE_BYTES):
                # One frame, however it is shaped, never ends the reader: every later answer
                # would wait for its timeout and be recorded as unknown.
                try:
                    if frame is None:
                        self._deliver(ident, error=UpstreamError(
                            f"the server's answer is larger than {MAX_MESSAGE_BYTES} bytes",
                            "unusable"))
                    elif frame.strip():
                        self._dispatch(frame)
                except Exception as err:
                    log(self.describe("read", f"a message could not be handled "
                                              f"({type(err).__name__}: {err})"))
        finally:
            with self.lock:
                self.closed = self.closed or "the server closed its output"
                self._fail_all(self.closed)
                on_exit = self.proc is proc and self.on_exit  # not closed by agentgate
            if on_exit:
                on_exit(exit_text(proc))

    def _dispatch(self, line):
        try:
            message = parse(line)
        except CanonicalError as err:
            loose = parse_loosely(line)
            self._deliver(int_id(loose.get("id")) if isinstance(loose, dict) else None,
                          error=UpstreamError(f"the server's answer is not usable JSON: {err}",
                                              "unusable"))
            return
        if not isinstance(message, dict):
            return
        if "method" in message and "id" in message:
            self._answer_server_request(message)
        elif "method" in message:
            if message["method"] == "notifications/progress":
                self._progress(message.get("params"))
            elif message["method"] == "notifications/tools/list_changed":
                with self.lock:
                    self.heard_list_changed = True
                    on_list_changed = self.on_list_changed
                if on_list_changed:
                    on_list_changed()
        elif "error" in message:
            error = message["error"] if isinstance(message["error"], dict) else {}
            text, code = error.get("message"), error.get("code")
            rpc = {k: error[k] for k in ("code", "message", "data") if k in error} \
                if isinstance(text, str) and int_id(code) is not None else None
            self._deliver(int_id(message.get("id")), error=UpstreamError(
                f"the server answered with an error: {clean(str(text or ''), 1000)}",
                "answered", rpc))
        else:
            self._deliver(int_id(message.get("id")), result=message.get("result"))

    def _progress(self, params):
        """Hand a server's progress to the request it names by id, a token only agentgate
        wrote (any other is dropped). On the reading thread, before the server's next message
        is read, so a request's progress reaches its caller before its answer."""
        params = params if isinstance(params, dict) else {}
        with self.lock:
            slot = self.slots.get(int_id(params.get("progressToken")))
        if slot and slot["progress"]:
            slot["progress"](params.get("progress"), params.get("total"), params.get("message"))

    def _answer_server_request(self, message):
        if message.get("method") == "ping":
            reply = {"jsonrpc": "2.0", "id": message["id"], "result": {}}
        else:
            # agentgate offers no roots, sampling or elicitation: a server asking for one gets
            # a clear refusal rather than a request left hanging.
            reply = {"jsonrpc": "2.0", "id": message["id"], "error": {
                "code": -32601, "message": "this client does not offer that method"}}
        try:
            self._send(reply, Deadline(OWN_WRITE_SECONDS * SECOND))
        except UpstreamError:
            pass  # the server is gone or was stopped for not reading: nothing to answer

    def _deliver(self, ident, result=None, error=None):
        # The answer is filled in under the lock that removes the slot, so a request whose
        # wait ends at this moment sees either its answer or no slot, never half of one.
        with self.lock:
            slot = self.slots.pop(ident, None) if ident is not None else None
            if slot:
                slot["result"], slot["error"], slot["answered"] = result, error, True
                slot["done"].release()

    def _fail_all(self, reason):
        for slot in self.slots.values():
            slot["error"], slot["answered"] = UpstreamError(reason), True
            slot["done"].release()
        self.slots.clear()

    def _send(self, message, deadline):
        """Write one message by `deadline`. A server that does not take it in time is not
        reading: it is stopped, so nothing waits on it forever. The error says whether any
        byte of the message reached it."""
        data = canonical(message) + b"\n"
        if not self.write_lock.acquire(timeout=deadline.left()):
            raise UpstreamError("the server is not reading its input (an earlier message to "
                                "it is still being written)", "not_sent")
        written, view = 0, memoryview(data)
        try:
            proc = self.proc
            if proc is None:
                raise UpstreamError("the connection is closed", "not_sent")
            poller = None
            while written < len(data):
                try:
                    written += os.write(proc.stdin.fileno(), view[written:])
                    continue
                except BlockingIOError:
                    pass  # the pipe is full: wait until the server reads, or the deadline
                except (OSError, ValueError):
                    raise UpstreamError("the server is not reading its input (it may have "
                                        "exited)", "no_answer" if written else "not_sent") \
                        from None
                if poller is None:
                    poller = select.poll()
                    poller.register(proc.stdin.fileno(), select.POLLOUT)
                if deadline.left() <= 0 or not poller.poll(deadline.left() * 1000 + 1):
                    break
        finally:
            self.write_lock.release()
        if written < len(data):
            reason = (f"the server did not take in the message within "
                      f"{format_duration(deadline.ns)}, so it was stopped")
            self._stop(proc, reason)
            raise UpstreamError(reason, "timed_out" if written else "not_sent")

    def _stop(self, proc, reason):
        with self.lock:
            self.closed = self.closed or reason
            self._fail_all(reason)
        signal_group(proc.pid, signal.SIGKILL)

    def notify(self, method, params):
        try:
            self._send({"jsonrpc": "2.0", "method": method, "params": params},
                       Deadline(OWN_WRITE_SECONDS * SECOND))
        except UpstreamError:
            pass

    def request(self, method, params, deadline, step, progress=None):
        """Send one request and wait for its answer until `deadline`. Given `progress`, each
        progress notice is handed to progress(value, total, message) as the server wrote it.
        While connecting and listing, a failure carries the end of the server's stderr; while
        the server is down, only those are sent."""
        try:
            down = self.down_text()
            if down and step not in OPENING_STEPS:
                raise UpstreamError(down + "; nothing was sent", "not_sent")
            return self._request(method, params, deadline, progress)
        except UpstreamError as err:
            tail = self.tail() if step in OPENING_STEPS and \
                err.outcome != "timed_out" else ""
            raise UpstreamError(self.describe(step, str(err)) + tail, err.outcome,
                                err.rpc) from None

    def _request(self, method, params, deadline, progress):
        with self.lock:
            if self.closed:
                raise UpstreamError(self.closed, "not_sent")
            self.next_id += 1
            ident = self.next_id
            # `done` is held until the answer (or a failure) is filled in, then released: a
            # wait on a bare lock, the cheapest hand-over between two threads.
            slot = {"done": threading.Lock(), "answered": False, "result": None, "error": None,
                    "progress": progress}
            slot["done"].acquire()
            self.slots[ident] = slot
        if progress:
            # The gate's own token, the request's id: unique among its requests in flight, as
            # the protocol asks, whatever tokens hosts choose. The caller maps it back.
            params = {**params, "_meta": {"progressToken": ident}}
        try:
            self._send({"jsonrpc": "2.0", "id": ident, "method": method, "params": params},
                       deadline)
        except UpstreamError:
            with self.lock:
                self.slots.pop(ident, None)
            raise
        if not slot["done"].acquire(timeout=deadline.left()):
            with self.lock:
                self.slots.pop(ident, None)
            if not slot["answered"]:  # an answer that came as the wait ended still counts
                self.notify("notifications/cancelled", {"requestId": ident,
                                                        "reason": "the deadline passed"})
                raise UpstreamError("timed out after " + format_duration(deadline.ns),
                                    "timed_out")
        if slot["error"]:
            raise slot["error"]
        return slot["result"]

    def down_text(self):
        """'' while the server serves; else since when it is down and its next start."""
        if not self.down:
            return ""
        since, next_try = (format_duration(max(0, int(t)) * SECOND)
                           for t in (time.time() - self.down[0], self.down[1] - time.time()))
        return (f"the server stopped {since} ago and is being {self.AGAIN} (next try in "
                f"{next_try})")

    def watch_tools(self, on_list_changed):
        """Call `on_list_changed` at every notice that the server's tools changed, and now if
        one came since the start-up listing (lost, it would leave a changed tool offered all
        session). Flag and callback change under one lock: no notice is missed by both."""
        with self.lock:
            self.on_list_changed = on_list_changed
            heard = self.heard_list_changed
        if heard:
            on_list_changed()

    def list_tools(self, deadline):
        tools, seen_cursors, cursor = {}, set(), None
        for _ in range(MAX_TOOL_PAGES):
            result = self.request("tools/list", {"cursor": cursor} if cursor is not None else {},
                                  deadline, "list tools")
            page = result.get("tools") if isinstance(result, dict) else None
            if not isinstance(page, list):
                raise UpstreamError(self.describe("list tools", "the answer has no tools list"))
            for tool in page:
                name = tool.get("name") if isinstance(tool, dict) else None
                if not isinstance(name, str) or not name:
                    raise UpstreamError(self.describe("list tools", "a tool has no name"))
                if name in tools:
                    raise UpstreamError(self.describe("list tools", f"the server lists "
                                                      f"{quote(name)} twice"))
                tools[name] = tool
                if len(tools) > MAX_TOOLS:
                    raise UpstreamError(self.describe("list tools", f"the server lists more "
                                                      f"than {MAX_TOOLS} tools"))
            cursor = result.get("nextCursor")
            if cursor is None:
                return tools
            if not isinstance(cursor, str) or cursor in seen_cursors:
                raise UpstreamError(self.describe("list tools", "the server's nextCursor "
                                                  "repeats or is not a string"))
            seen_cursors.add(cursor)
        raise UpstreamError(self.describe("list tools", f"the listing runs past "
                                          f"{MAX_TOOL_PAGES} pages"))


OPENING_STEPS = ("connect", "list tools")


def exit_text(proc):
    try:
        code = proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        return "closed its output"
    return f"exited (killed by signal {-code})" if code < 0 else f"exited (status {code})"


def new_upstream(server):
    return HttpUpstream(server) if server.url else Upstream(server)


# OAuth. Only `login` asks a person (section 30); the serving gate attaches the access token
# login kept and refreshes it where login found it can, or does not serve the server.
LOGIN_NEEDED = "the server asks for an authorization the gate does not hold, or holds no longer"
# Pauses between attempts to open a server's own stream that was refused for a while (seconds).
OWN_STREAM_FIRST_PAUSE, OWN_STREAM_LAST_PAUSE = 0.25, 30
READ_BYTES = 65536


def login_hint(server):
    """What the operator runs so a server asking for OAuth is served (operator text only)."""
    return f"run: {PROGRAM}.py login {server.name}"


def union_scope(*scopes):
    """Space-separated scopes, each once, in the order first given."""
    return " ".join(dict.fromkeys(" ".join(scope or "" for scope in scopes).split()))


class TokenFile:
    """What login obtained for one server of one config, 0600 in Server.tokens beside it: the
    tokens, the client they were issued to, and the authorization server's issuer and token
    endpoint. Bound to that config and url: a file kept for another is refused, so no other
    server is sent them. Not in the database: the record is shown and copied for audits, and
    a credential is no fact about a call. A pre-registered client stays in the config."""

    def __init__(self, server, fresh=False):
        self.server = server
        self.kept = {"config": server.config_path, "url": server.url}
        if fresh or not os.path.exists(server.tokens):
            return
        these = f"the tokens of server {quote(server.name)} in {server.tokens}"
        mode = os.stat(server.tokens).st_mode
        if mode & 0o077:
            raise ConfigError(f"{these} have mode {stat.filemode(mode)}, which lets others "
                              f"read them: chmod 600 it")
        try:
            kept = json.loads(read_owned(server.tokens, "token file"))
            usable = isinstance(kept["tokens"]["access_token"], str)
        except (ValueError, KeyError, TypeError):
            usable = False
        if not usable:
            raise ConfigError(f"{these} cannot be read; {login_hint(server)}")
        if (kept.get("config"), kept.get("url")) != (server.config_path, server.url):
            raise ConfigError(f"{these} were kept for another config or url; "
                              f"{login_hint(server)}")
        self.kept = kept

    def client(self):
        """The client the tokens were issued to: the config's, else the one login registered."""
        given = self.server.oauth
        if not given.get("client_id"):
            return self.kept.get("client") or {}
        secret = given.get("client_secret")
        return {"client_id": given["client_id"], "client_secret": secret,
                "token_endpoint_auth_method": "client_secret_basic" if secret else "none"}

    def bearer(self):
        return "Bearer " + self.kept["tokens"]["access_token"]

    def expired(self):
        at = self.kept.get("expires_at")
        return isinstance(at, (int, float)) and at <= time.time()

    def obtained(self, tokens):
        """Keep new tokens; a refresh that names no new refresh token or scope keeps the old."""
        old = self.kept.get("tokens", {})
        self.kept["tokens"] = {**{k: old[k] for k in ("refresh_token", "scope") if k in old},
                               **tokens}
        lasts = tokens.get("expires_in")
        self.kept["expires_at"] = time.time() + lasts if isinstance(lasts, (int, float)) \
            else None
        self.write()

    def want(self, scope):
        """Keep the scope a server refused a call for, so the next login asks for it too."""
        self.kept["wanted_scope"] = union_scope(self.kept.get("wanted_scope"), scope)
        self.write()

    def write(self):
        if self.server.oauth.get("client_id"):
            self.kept.pop("client", None)
        write_private(self.server.tokens, json.dumps(self.kept, indent=2) + "\n")

    def refresh(self, deadline):
        """A refresh-token grant to the token endpoint login found: the refresh token and the
        client's secret go there and nowhere else. False when the tokens were not renewed."""
        from urllib.parse import urlencode, quote as escape
        refresh, endpoint = self.kept["tokens"].get("refresh_token"), self.kept.get(
            "token_endpoint")
        client = self.client()
        if not (refresh and endpoint and client.get("client_id")):
            return False
        form = {"grant_type": "refresh_token", "refresh_token": refresh,
                "client_id": client["client_id"]}
        if self.kept.get("resource"):
            form["resource"] = self.kept["resource"]
        headers = {"Content-Type": "application/x-www-form-urlencoded",
                   "Accept": "application/json"}
        secret = client.get("client_secret")
        method = client.get("token_endpoint_auth_method") or "client_secret_basic"
        if secret and method == "client_secret_post":
            form["client_secret"] = secret
        elif secret and method == "client_secret_basic":
            pair = f"{escape(client['client_id'], safe='')}:{escape(secret, safe='')}"
            headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        conn = None
        try:
            conn = http_connection(endpoint, deadline)
            conn.request("POST", url_target(endpoint), urlencode(form), headers)
            response = conn.getresponse()
            tokens = json.loads(response.read(MAX_MESSAGE_BYTES)) \
                if response.status == 200 else None
        except (OSError, ValueError, http_client().HTTPException):
            tokens = None
        finally:
            if conn:
                conn.close()
        if not isinstance(tokens, dict) or not isinstance(tokens.get("access_token"), str) \
                or str(tokens.get("token_type")).lower() != "bearer":
            return False
        self.obtained(tokens)
        return True


@functools.lru_cache(maxsize=1)
def http_client():
    import http.client  # only when a url server starts
    return http.client


def http_connection(url, deadline):
    """A connection to `url`'s host, connected by `deadline` (None: within 30s)."""
    from urllib.parse import urlsplit
    parts, client = urlsplit(url), http_client()
    seconds = max(deadline.left(), 0.001) if deadline else 30
    if parts.scheme == "https":
        import ssl
        conn = client.HTTPSConnection(parts.hostname, parts.port, timeout=seconds,
                                      context=ssl.create_default_context())
    else:
        conn = client.HTTPConnection(parts.hostname, parts.port, timeout=seconds)
    conn.connect()
    return conn


def url_target(url):
    from urllib.parse import urlsplit
    parts = urlsplit(url)
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


class HttpUpstream(Upstream):
    """A connected MCP server over Streamable HTTP, through the standard library's client.
    Only the way a message travels differs from Upstream. Each message is POSTed on its own
    connection, written by the caller by its deadline (_post, the one place its bytes are
    written), so no call waits for another's answer; a request's answer is read on a thread
    of its own and reaches _dispatch as the bytes the server sent."""

    AGAIN = "connected again"

    def __init__(self, server):
        super().__init__(server)
        self.session = None  # Mcp-Session-Id, from the initialize answer
        self.tokens = None  # what login kept, unless the config gives an Authorization header
        self.unauthorized = False  # the server refused agentgate's authorization (or none)
        self.refreshing = threading.Lock()
        self.connections = set()  # open ones, each ended by close
        self.ended = threading.Event()

    def spawn(self):
        if self.server.unavailable:
            raise UpstreamError(self.server.unavailable, "not_sent")
        # Connected again after it went away (section 23):
        # a new session, its listener apart from the old.
        with self.lock:
            self.closed = self.session = self.protocol = None
            self.ended = threading.Event()
        if os.path.exists(self.server.tokens) and not any(
                name.lower() == "authorization" for name in self.server.headers):
            try:
                self.tokens = TokenFile(self.server)
            except ConfigError as err:  # a problem of this server only: the others are served
                raise UpstreamError(str(err), "not_sent") from None

    def handshake(self, deadline):
        try:
            super().handshake(deadline)
        except UpstreamError as err:
            if not self.unauthorized:
                raise
            # Only the operator reads a start's failure: it may name the command.
            raise UpstreamError(f"{err}; {login_hint(self.server)}", "answered") from None
        threading.Thread(target=self._listen, args=(self.ended,),
                         daemon=True).start()

    def close(self):
        """Fail what waits and end every connection; nothing waits on the server."""
        with self.lock:
            self.closed = self.closed or "the connection was closed"
            self._fail_all(self.closed)
            self.ended.set()
            connections = list(self.connections)
        for conn in connections:  # each read under way ends, and its thread closes it
            self._shut(conn)

    def tail(self):
        return ""

    def _gone(self, why):
        """While serving, the server went away: it is
        connected again (section 23)."""
        if self.on_exit and not self.closed:
            self.on_exit(why)

    # -- sending ---------------------------------------------------------------------------

    def _send(self, message, deadline):
        body = canonical(message)
        conn = self._post(body, deadline)
        if "method" in message and "id" in message:
            threading.Thread(target=self._answer, args=(conn, message["id"], body, deadline),
                             daemon=True).start()
            return
        try:  # a notice or an answer: the server takes it in at once (202)
            conn.getresponse().read(MAX_MESSAGE_BYTES)
        except (OSError, http_client().HTTPException):
            pass
        finally:
            self._end(conn)

    def _headers(self, deadline, accept, refused=None):
        headers = {**self.server.headers, "Accept": accept}
        if self.session:
            headers["Mcp-Session-Id"] = self.session
        if self.protocol:
            headers["MCP-Protocol-Version"] = self.protocol
        if self.tokens:
            headers["Authorization"] = self._bearer(deadline, refused)
        return headers

    def _bearer(self, deadline, refused):
        """The access token to send, renewed first when it expired or is `refused` (the one a
        401 answered), by one caller at a time."""
        if not self.refreshing.acquire(timeout=max(deadline.left(), 0) if deadline else -1):
            raise UpstreamError(f"timed out after {format_duration(deadline.ns)}, before the "
                                f"message was sent", "not_sent")
        try:
            stale = self.tokens.expired() or self.tokens.bearer() == refused
            if stale and not self.tokens.refresh(deadline):
                raise self._login_needed("the token could not be renewed")
            return self.tokens.bearer()
        finally:
            self.refreshing.release()

    def _login_needed(self, why):
        self.unauthorized = True
        if self.tokens:
            # The serving gate opens no browser and no port: the server is not served until
            # the operator runs login again, and every later call fails at once saying so.
            with self.lock:
                self.closed = self.closed or LOGIN_NEEDED
            log(f"server {self.name}: {LOGIN_NEEDED}; {login_hint(self.server)}")
        return UpstreamError(f"{LOGIN_NEEDED} ({why})", "answered")

    def _open(self, deadline):
        try:
            conn = http_connection(self.server.url, deadline)
        except (OSError, http_client().HTTPException) as err:
            if isinstance(err, ConnectionError):
                self._gone("cannot be reached")
            raise UpstreamError(f"cannot reach {shown_url(self.server.url)} ("
                                f"{clean(str(err), 200) or type(err).__name__}), so nothing "
                                f"was sent", "not_sent") from None
        with self.lock:
            if self.closed:
                conn.close()
                raise UpstreamError(self.closed, "not_sent")
            self.connections.add(conn)
        return conn

    @staticmethod
    def _shut(conn):
        try:
            conn.sock.shutdown(2)  # SHUT_RDWR
        except (OSError, AttributeError):  # closed already
            pass

    def _end(self, conn):
        with self.lock:
            self.connections.discard(conn)
        self._shut(conn)
        conn.close()

    def _post(self, body, deadline, refused=None):
        """POST one message's bytes by `deadline`, or raise saying they were not sent. No byte
        is written once the deadline has passed; a write that fails midway may have landed."""
        headers = self._headers(deadline, "application/json, text/event-stream", refused)
        headers["Content-Type"] = "application/json"
        conn = self._open(deadline) if deadline.left() > 0 else None
        if conn is None or deadline.left() <= 0:
            if conn:
                self._end(conn)
            raise UpstreamError(f"timed out after {format_duration(deadline.ns)}, before the "
                                f"message was sent", "not_sent")
        try:
            conn.request("POST", url_target(self.server.url), body, headers)
        except (OSError, http_client().HTTPException) as err:
            self._end(conn)
            raise self._lost(err) from None
        return conn

    @staticmethod
    def _lost(err):
        return UpstreamError(f"the connection was lost before the server answered "
                             f"({type(err).__name__})")

    # -- answers ---------------------------------------------------------------------------

    def _waiting(self, ident, deadline):
        with self.lock:
            return ident in self.slots and deadline.left() > 0

    def _answer(self, conn, ident, body, deadline):
        """Read request `ident`'s answer and hand over what it holds; a stream the server
        closed after naming an event is resumed within the deadline. A request a 401 refused
        (it ran nothing) is sent once more, with a renewed token."""
        error = UpstreamError("the server ended its HTTP answer without a result")
        try:
            response = conn.getresponse()
            if response.status == 401 and self.tokens and not self.unauthorized:
                self._end(conn)
                conn = self._post(body, deadline, self.tokens.bearer())
                response = conn.getresponse()
            failed = self._refusal(response)
            if failed:
                error = failed
            elif not self._event_stream(response):
                data = response.read(MAX_MESSAGE_BYTES + 1)
                if len(data) > MAX_MESSAGE_BYTES:
                    error = UpstreamError(f"the server's answer is larger than "
                                          f"{MAX_MESSAGE_BYTES} bytes", "unusable")
                elif data.strip():
                    self._dispatch(data)
            else:
                events = self._read_events(response, ident, deadline)
                while events.last_id and self._waiting(ident, deadline):
                    error = UpstreamError("the server closed its answer's event stream before "
                                          "the result, and resuming it failed")
                    self._end(conn)
                    if self.ended.wait(min(events.retry / 1000, deadline.left())):
                        break
                    try:  # whatever fails here, the request was sent: it may have executed
                        conn, response = self._get(deadline, events.last_id)
                    except (UpstreamError, OSError, http_client().HTTPException):
                        break
                    if not self._event_stream(response):
                        break
                    events = self._read_events(response, ident, deadline, events)
        except UpstreamError as err:
            error = err
        except (OSError, ValueError, http_client().HTTPException) as err:
            error = self._lost(err)
        finally:
            self._end(conn)
        self._deliver(ident, error=error)

    def _refusal(self, response):
        status = response.status
        if status >= 500:
            # A proxy's 502 or 504, or a server that failed mid-call, answers after the request
            # was delivered: whatever its body says, the request may have executed. Decided
            # before the body is read, so no message in it can make the outcome known.
            return UpstreamError(f"the server answered HTTP {status} after the request "
                                 f"reached it")
        if 300 <= status < 400:
            from urllib.parse import urljoin
            target = urljoin(self.server.url, response.getheader("Location", ""))
            return UpstreamError(f"the server answered with a redirect (HTTP {status}) to "
                                 f"{clean(shown_url(target), 200)}, which is not followed: if "
                                 f"that is the server, make it the url", "answered")
        challenge = response.getheader("WWW-Authenticate", "")
        if status == 401 or (status == 403 and "insufficient_scope" in challenge):
            scope = re.search(r'scope="([^"]*)"', challenge)
            if status == 403 and self.tokens and scope:
                self.tokens.want(scope.group(1))
            return self._login_needed(f"HTTP {status}")
        if status == 404 and self.session:
            # The server no longer knows the session (it was
            # started again): it took nothing in, ran nothing.
            self._gone("forgot its session")
            return UpstreamError(
                "the server no longer knows the session "
                "(HTTP 404), so nothing ran", "not_sent")
        if status >= 400:
            return UpstreamError(f"the server answered HTTP {status}", "answered")
        self.session = response.getheader("Mcp-Session-Id") or self.session
        return None

    @staticmethod
    def _event_stream(response):
        return response.status == 200 and response.getheader(
            "Content-Type", "").lower().startswith("text/event-stream")

    def _get(self, deadline, last_id):
        """A GET for an event stream: the server's own (deadline None), or a request's resumed
        after the event `last_id`: (conn, response)."""
        headers = self._headers(deadline, "text/event-stream")
        if last_id:
            headers["Last-Event-ID"] = last_id.decode("utf-8", "replace")
        conn = self._open(deadline)
        if deadline is None:
            conn.sock.settimeout(None)  # the server's own stream may be quiet for hours
        try:
            conn.request("GET", url_target(self.server.url), headers=headers)
            return conn, conn.getresponse()
        except BaseException:
            self._end(conn)
            raise

    def _read_events(self, response, ident, deadline, after=None):
        """Hand over each message of an event stream as its event completes, until it ends or
        request `ident` (None: none, the server's own stream) is answered; the stream's state.
        A connection lost after an event id leaves the stream to resume."""
        events = _EventStream(after)
        try:
            while ident is None or self._waiting(ident, deadline):
                chunk = response.read1(READ_BYTES)
                for message in events.feed(chunk, final=not chunk):
                    self._dispatch(message)
                if events.buffered() > MAX_MESSAGE_BYTES:
                    raise UpstreamError(f"the server's answer is larger than "
                                        f"{MAX_MESSAGE_BYTES} bytes", "unusable")
                if not chunk:
                    break
        except (OSError, ValueError, http_client().HTTPException):
            if not events.last_id:
                raise
        return events

    def _listen(self, ended):
        """The server's own stream, held open all session and opened again when it ends. A
        refusal that may pass (a lost connection, 409, 429, 5xx) is met with growing pauses;
        any other (405 or 404: it has none) ends the listening, as `ended` does; a server
        that cannot be reached is connected again (_open)."""
        pause, last_id = OWN_STREAM_FIRST_PAUSE, None
        while not ended.is_set():
            conn = None
            try:
                conn, response = self._get(None, last_id)
                if self._event_stream(response):
                    events = self._read_events(response, None, None)
                    last_id = events.last_id or last_id
                    if events.heard:  # it was open: opened again as the server asked
                        pause = max(events.retry / 1000, OWN_STREAM_FIRST_PAUSE)
                elif not (response.status in (409, 429) or response.status >= 500):
                    return
            except (UpstreamError, OSError, ValueError, http_client().HTTPException):
                pass
            finally:
                if conn:
                    self._end(conn)
            if ended.wait(pause):
                return
            pause = min(2 * pause, OWN_STREAM_LAST_PAUSE)


class _EventStream:
    """Server-sent events fed in chunks of any size: the data of each event named `message` or
    unnamed, as bytes (data lines joined by \\n, comments skipped); an event the stream ends
    inside still counts. `last_id`: the last event id the server named, from which the stream
    can be resumed; `retry`: the milliseconds it asked a client to wait before it does. Given
    `after`, a stream resumed from it: its id and retry carry on."""

    _LINE_END = re.compile(rb"\r\n|\r|\n")

    def __init__(self, after=None):
        self.partial, self.after_cr, self.data, self.event = [], False, [], b""
        self.last_id, self.retry = (after.last_id, after.retry) if after else (b"", 0)
        self.heard = False  # an event came

    def buffered(self):
        return sum(map(len, self.partial)) + sum(map(len, self.data))

    def feed(self, chunk, final=False):
        # Only the new chunk is searched for line ends, so a long line costs its length once.
        if self.after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]  # the second half of a \r\n split between chunks
            self.after_cr = False
        if chunk:
            self.after_cr = chunk.endswith(b"\r")
        pieces = self._LINE_END.split(chunk)
        self.partial.append(pieces[0])
        lines = []
        if len(pieces) > 1:
            lines = [b"".join(self.partial), *pieces[1:-1]]
            self.partial = [pieces[-1]]
        if final:
            lines += [b"".join(self.partial), b""]
            self.partial = []
        messages = []
        for line in lines:
            if not line:
                if self.data and self.event in (b"", b"message"):
                    messages.append(b"\n".join(self.data))
                self.heard = self.heard or bool(self.data)
                self.data, self.event = [], b""
                continue
            field, _, value = line.partition(b":")
            value = value[1:] if value.startswith(b" ") else value
            if field == b"data":
                self.data.append(value)
            elif field == b"event":
                self.event = value.strip()
            elif field == b"id" and b"\0" not in value:
                self.last_id = value
            elif field == b"retry" and value.isdigit():
                self.retry = int(value)
        return messages


def signal_group(pid, sig):
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class LoadError(Exception):
    """A server that cannot be used at all."""


# What each part of a manifest entry is, as manifest_entry writes it: a manifest edited by hand
# is refused by its part rather than read by code that trusts the shape.
ENTRY_KINDS = {"name": str, "description": str, "description_hash": str, "schema_hash": str,
               "title": (str, type(None)), "output_schema": (dict, type(None)),
               "icons": (list, type(None)), "_meta": (dict, type(None)), "annotations": dict}


def read_manifest(server):
    """A server's manifest: missing or unusable, that server's LoadError; open to others'
    changes, the config's ConfigError (read_owned)."""
    where = f"server {quote(server.name)}: manifest {server.manifest}"
    if not os.path.lexists(server.manifest):
        raise LoadError(f"{where} does not exist; run pin")
    try:
        manifest = parse(read_owned(server.manifest, "manifest"))
    except CanonicalError as err:
        raise LoadError(f"{where} is not usable JSON: {err.placed()}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("tools"), dict):
        raise LoadError(f"{where} has no tools; run pin again")
    if manifest.get("server") != server.name:
        raise LoadError(f"{where} is for server {quote(str(manifest.get('server')))}, not "
                        f"{quote(server.name)}; run pin again or name the right manifest")
    for name, entry in manifest["tools"].items():
        wrong = "entry" if not isinstance(entry, dict) else next(
            (part for part, kind in ENTRY_KINDS.items()
             if part in entry and not isinstance(entry[part], kind)), None)
        if wrong:
            raise LoadError(f"{where}: the {wrong} of tool {quote(name)} is not what pin "
                            "writes; run pin again")
    return manifest


def pinned_for(server):
    manifest = read_manifest(server)
    stray = sorted(set(server.rules) - set(manifest["tools"]))
    if stray:
        raise LoadError(f"server {quote(server.name)}: rules name tools the manifest does not "
                        f"pin: {', '.join(sanitize(s) for s in stray)}; pin again or fix the "
                        f"rules")
    return manifest


def load_all(config, while_starting=None):
    """Start every server at once, then decide, in the config's order, what each offers.
    `while_starting` runs once all are spawned (on this thread: Upstream.spawn says why).
    Returns (served upstreams, tools, a report for every server); a server not served is
    closed, its report's `unserved` says why; a ConfigError closes every server."""
    upstreams = [new_upstream(server) for server in config.servers]
    reports = [Report(server.name) for server in config.servers]
    try:
        for upstream, report in zip(upstreams, reports):
            _unless_unserved(report, upstream.spawn)
        if while_starting:
            while_starting()
        # The manifests are read while the servers start.
        manifests = [_unless_unserved(report, pinned_for, server)
                     for server, report in zip(config.servers, reports)]
        findings = lint_manifests({s.name: m for s, m in zip(config.servers, manifests) if m})
        listings = [None] * len(upstreams)
        deadlines = [Deadline(server.connect_timeout) for server in config.servers]

        def connect_one(i):
            listings[i] = _unless_unserved(reports[i], handshake_and_list, upstreams[i],
                                           deadlines[i])
        workers = [threading.Thread(target=connect_one, args=(i,), daemon=True)
                   for i, report in enumerate(reports) if not report.unserved]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        taken, tools = {config.status_tool: STATUS_CLASH}, []
        for i, server in enumerate(config.servers):
            if reports[i].unserved:
                continue
            upstreams[i].pinned = manifests[i]["tools"]
            # The names a server takes are kept only if it is served.
            names = dict(taken)
            offered = _unless_unserved(reports[i], load, server, manifests[i], upstreams[i],
                                       listings[i], deadlines[i], names, findings[server.name],
                                       reports[i])
            if offered:
                taken = names
                tools.extend(offered)
            elif not reports[i].unserved:
                reports[i].unserved = f"server {quote(server.name)}: no tool registered; " + (
                    "its rules are proposals nobody reviewed: read them, then run check "
                    "-accept" if reports[i].count("unreviewed") else
                    "it offered none when it was pinned" if not manifests[i]["tools"] else
                    "classify at least one pinned tool with a rule")
    except BaseException:
        for upstream in upstreams:
            upstream.close()
        raise
    served = []
    for upstream, report in zip(upstreams, reports):
        if report.unserved:
            upstream.close()
        else:
            served.append(upstream)
    return served, tools, reports


def _unless_unserved(report, step, *args):
    if report.unserved:
        return None
    try:
        return step(*args)
    except (UpstreamError, LoadError) as err:
        report.unserved = str(err)
        return None


def handshake_and_list(upstream, deadline):
    upstream.handshake(deadline)
    return upstream.list_tools(deadline)


# =============================================================================================
# 22. Reading the record
#
# Reads as: around the core
#
# Owns: the reads people make of the record (Ledger): the runs, steps and approvals the
# operator commands and the status tool list, the grants, the tool changes, the event chain.
# Core it calls: Store, whose read connection it reads through, and tool_spec; it writes
# nothing.
# Promises: only SELECTs: every statement that changes the record is section 7's, and an
# approval's row is read by Store itself. A run's events read the same in either shape Tx.flush
# has written (event_parts). The status tool reads through the Ledger serve opens.
# =============================================================================================

COMBINED_EVENTS = ("call.began", "call.changed", "call.ended")  # Tx.flush's events of parts


def event_parts(type_, step_id, payload_json):
    """A stored event as the parts it records, each (type, step id, payload): a combined event
    as its parts in order, any other as itself."""
    payload = parse(payload_json)
    if type_ in COMBINED_EVENTS:
        return [tuple(part) for part in payload["parts"]]
    return [(type_, step_id, payload)]


class Ledger(Store):
    """The record as people read it."""

    def approvals(self, run_id):
        return self.read_approvals("FROM approvals a WHERE a.run_id=? ORDER BY a.rowid",
                                   (run_id,))

    def recent_approvals(self, session, since, limit):
        """Every approval of the session's newest `limit` calls that are unsettled or settled
        since `since`, with its run's tool, status and reason and its request key."""
        return self.read_approvals(
            "FROM calls c JOIN runs r ON r.id = c.run_id JOIN approvals a ON a.run_id = r.id "
            "WHERE c.id IN (SELECT id FROM calls WHERE session=? AND (settled_at='' OR "
            "settled_at>=?) ORDER BY id DESC LIMIT ?) ORDER BY c.id DESC, a.rowid",
            (session, since, limit), (("tool", "r.tool"), ("run_status", "r.status"),
                                      ("run_reason", "r.reason"),
                                      ("request_key", "c.request_key")))

    def executed_under(self, approval):
        return any(type_ == "step.tool_started" and step_id == approval["step_id"] and
                   payload.get("approval_id") == approval["id"]
                   for _, _, type_, step_id, payload in self.run_parts(approval["run_id"]))

    def step_observation(self, step_id):
        row = self.read_one("SELECT observation_json FROM steps WHERE id=?", (step_id,))
        return parse(row[0]) if row and row[0] else None

    def run_events(self, run_id):
        return self.read("SELECT seq, at, type, step_id, payload_json FROM events WHERE "
                         "run_id=? ORDER BY seq", (run_id,))

    def run_parts(self, run_id):
        """What a run's events record, as (seq, at, type, step id, payload): each part of a
        combined event as an event of its own, under the seq of the event that holds it."""
        return [(seq, at, *part) for seq, at, type_, step_id, payload in self.run_events(run_id)
                for part in event_parts(type_, step_id, payload)]

    def late_outcomes(self, run_id):
        """Outcomes of a run's cut-off attempts that came after a takeover: (step, observation)."""
        return [(step_id, payload["observation"]) for _, _, type_, step_id, payload
                in self.run_parts(run_id) if type_ == "step.tool_finished" and payload.get("late")]

    def waiting_approvals(self, session):
        """The approvals an operator may decide now (of one session, or all with session ''),
        oldest first, each with its run's tool. A waiting run's call is unsettled, so the
        calls index finds them without reading the history of approvals."""
        where = "c.settled_at=''" + (" AND c.session=?" if session else "")
        return self.read_approvals(
            f"FROM calls c JOIN runs r ON r.id = c.run_id JOIN approvals a ON a.run_id = r.id "
            f"WHERE {where} AND r.status='WAITING_FOR_APPROVAL' AND a.status='pending' AND "
            f"(a.expires_at='' OR a.expires_at>?) ORDER BY a.created_at, a.id",
            (*([session] if session else []), now()), (("tool", "r.tool"),))

    def steps(self, run_id):
        """A run's steps, oldest first; an allowed read's one step is read out of its run.read
        event (Tx.record_read)."""
        names = ("id", "index", "status", "decision", "policy", "observation", "spec_hash")
        rows = self.read("SELECT id, idx, status, decision_json, policy_json, observation_json,"
                         " spec_hash FROM steps WHERE run_id=? ORDER BY idx", (run_id,))
        if not rows:
            for step_id, payload in self.read("SELECT step_id, payload_json FROM events WHERE "
                                              "run_id=? AND type='run.read'", (run_id,)):
                read = parse(payload)
                if "observation" in read:  # before schema version 3 a read kept a step row
                    policy = {k: v for k, v in read["policy"].items()
                              if k not in ("policy_id", "spec_hash")}
                    rows.append((step_id, 0, "done" if read["status"] == "COMPLETED" else
                                 "failed", dumps(read["decision"]), dumps(policy),
                                 dumps(read["observation"]), read["policy"]["spec_hash"]))
        return [dict(zip(names, row)) for row in rows]

    def run(self, run_id):
        row = self.read_one("SELECT id, session, tool, status, reason, detail, step_count, "
                            "created_at, finished_at, lease_owner, lease_expires_at FROM runs "
                            "WHERE id=?", (run_id,))
        names = ("run", "session", "tool", "status", "reason", "detail", "steps", "created",
                 "finished", "lease_owner", "lease_expires_at")
        return dict(zip(names, row)) if row else None

    def runs_page(self, session, limit):
        """Runs newest first (of one session, or all with session ''), with the approval each
        waits on and the host's name as the policy's first decision recorded it ('' before the
        policy; a call's first decision is a part of the event that began it)."""
        names = ("run", "status", "reason", "detail", "steps", "created", "tool",
                 "pending_approval", "host")
        return [dict(zip(names, row)) for row in self.read(
            "SELECT r.id, r.status, r.reason, r.detail, r.step_count, r.created_at, r.tool, "
            "(SELECT a.id FROM approvals a WHERE a.run_id = r.id AND a.status='pending' ORDER "
            "BY a.rowid DESC LIMIT 1), COALESCE((SELECT COALESCE(json_extract(e.payload_json, "
            "'$.facts.client'), json_extract(e.payload_json, '$.policy.facts.client'), (SELECT "
            "json_extract(p.value, '$[2].facts.client') FROM json_each(e.payload_json, "
            "'$.parts') p WHERE json_extract(p.value, '$[0]')='step.policy' LIMIT 1)) FROM "
            "events e WHERE e.run_id = r.id AND e.type IN ('step.policy', 'run.read', "
            "'call.began') ORDER BY e.seq LIMIT 1), '') FROM runs r WHERE ?='' OR r.session=? "
            "ORDER BY r.rowid DESC LIMIT ?", (session, session, limit))]

    def session_runs(self, session, limit):
        return [row[0] for row in self.read(
            "SELECT id FROM runs WHERE session=? ORDER BY rowid DESC LIMIT ?",
            (session, limit))]

    def policy_events(self, run_id):
        """A run's decisions of the policy as (seq, step id, the recorded policy, at): the
        step.policy parts, or the policy a read's one run.read event carries."""
        return [(seq, step_id, payload if type_ == "step.policy" else payload["policy"], at)
                for seq, at, type_, step_id, payload in self.run_parts(run_id)
                if type_ in ("step.policy", "run.read")]

    def tool_spec(self, spec_hash):
        return tool_spec(self.read, spec_hash)

    def grants(self, session, since):
        return [dict(zip(GRANT_COLUMNS, row)) for row in self.read(
            f"SELECT {', '.join(GRANT_COLUMNS)} FROM grants WHERE (?='' OR session=?) AND "
            f"(CASE WHEN revoked_at='' THEN expires_at ELSE min(revoked_at, expires_at) END)>=?"
            f" ORDER BY created_at DESC, id DESC", (session, session, since))]

    def grant(self, grant_id):
        row = self.read_one(f"SELECT {', '.join(GRANT_COLUMNS)} FROM grants WHERE id=?",
                            (grant_id,))
        return dict(zip(GRANT_COLUMNS, row)) if row else None

    def ids_starting(self, table, prefix, limit):
        """Up to `limit` ids of `table` (runs, approvals or grants) that start with `prefix`
        (ASCII), in order: a range of the primary key."""
        return [row[0] for row in self.read(
            f"SELECT id FROM {table} WHERE id>=? AND id<? ORDER BY id LIMIT ?",
            (prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1), limit))]

    def run_ids_after_session(self, prefix, limit):
        """Up to `limit` run ids whose part after the session starts with `prefix` (letters
        and digits only), in any session: a scan, for an operator who gave no session."""
        return [row[0] for row in self.read(
            "SELECT id FROM runs WHERE substr(id, instr(id, '.') + 1) GLOB ? ORDER BY id "
            "LIMIT ?", (prefix + "*", limit))]

    def tool_changes(self, session, limit):
        return [(at, parse(payload)) for at, payload in self.read(
            "SELECT at, payload_json FROM events WHERE run_id=? AND type='tools.changed' "
            "ORDER BY seq DESC LIMIT ?", (f"{session}.tools", limit))]

    def chain_head(self):
        return self.read_one("SELECT seq, hash FROM events ORDER BY seq DESC LIMIT 1")

    def event_hash_at(self, seq):
        row = self.read_one("SELECT hash FROM events WHERE seq=?", (seq,))
        return row[0] if row else None

    def events_after(self, seq, last, limit):
        return self.read("SELECT seq, run_id, step_id, at, type, payload_json, hash FROM "
                         "events WHERE seq>? AND seq<=? ORDER BY seq LIMIT ?",
                         (seq, last if last is not None else 2**62, limit))


# =============================================================================================
# 23. Tool changes while serving
#
# Reads as: around the core
#
# Owns: a server's change of its tools while the gate serves (notifications/tools/list_changed):
# the tools are listed again and compared with the pin by changed_parts (section 5).
# Core it calls: manifest_entry, changed_parts, Gate.quarantine (its only write to the gate) and
# calls the host's tools_changed notice, both handed to it by serve.
# Promises: a tool whose server changed it is no longer offered and a call to it is refused
# TOOL_CHANGED; a listing that fails quarantines the server's tools and is retried at 4, 8, 16,
# 32 s, then every 60 s. A server that goes away is said so on stderr and started again at 1,
# 2, 4 ... s, then every 60 s; it serves again once connected and listed as a change is.
# =============================================================================================

def tool_changes(pinned, live):
    """How what a server presents now (`live`, manifest entries) differs from what it pinned,
    per tool: ("added", None, now), ("removed", pinned, None) or ("changed", pinned, now)."""
    changes = {}
    for name in sorted(set(pinned) | set(live)):
        old, new = pinned.get(name), live.get(name)
        if old is None or new is None or changed_parts(old, new):
            kind = "added" if old is None else "removed" if new is None else "changed"
            changes[name] = (kind, old, new)
    return changes


LIST_CHANGED_INTERVAL = 2.0  # seconds: the least time between two listings of one server
RELIST_RETRY_MAX = 60.0  # seconds: the longest wait between two tries of a failing listing


class ToolWatch:
    """Acts on a server's notifications/tools/list_changed while the gate serves.

    The server is listed again on a thread of its own, never on a call's path. A tool that
    changed or is gone is quarantined, a new one is not offered, one back to its pin is
    offered again; calls in flight are not touched. Notices that flood in come to one listing
    every LIST_CHANGED_INTERVAL. A failed listing quarantines all the server's tools (they
    said they changed, and are unchecked) until a listing succeeds.
    """

    def __init__(self, gate, upstreams, announce):
        self.gate, self.announce = gate, announce
        self.upstreams = {upstream.name: upstream for upstream in upstreams}
        self.pending = {}  # server name -> notifications not yet acted on
        self.failures = {}  # server name -> listings failed in a row since the last success
        self.held = {}  # server name -> the registered names it has quarantined
        self.seen = {}  # server name -> the differences last recorded
        self.starts = {}  # server name -> starts failed in a row while it is down
        self.cond = threading.Condition()
        threading.Thread(target=self._run, daemon=True).start()
        threading.Thread(target=self._revive, daemon=True).start()
        for upstream in upstreams:
            upstream.on_exit = functools.partial(self.exited, upstream)
            upstream.watch_tools(functools.partial(self.changed, upstream.name))

    def changed(self, server):
        with self.cond:
            self.pending[server] = self.pending.get(server, 0) + 1
            self.cond.notify_all()

    def _run(self):
        listed = {}  # server name -> when it was last listed (monotonic)
        while not self.gate.stopping.is_set():
            with self.cond:
                due = {name: listed.get(name, -math.inf) + relist_wait(self.failures.get(name, 0))
                       for name in self.pending}
                ready = [name for name, at in due.items() if at <= time.monotonic()]
                if not ready:
                    self.cond.wait(min(due.values(), default=time.monotonic() + 1)
                                   - time.monotonic())
                    continue
                server, count = ready[0], self.pending.pop(ready[0])
            listed[server] = time.monotonic()
            if count > 1:
                log(f"server {server} said {count} times that its tools changed; it is listed "
                    f"again at most every {LIST_CHANGED_INTERVAL:g}s")
            try:
                self._relist(server)
            except UpstreamError as err:
                self._failed(server, err)
            except StoreError as err:
                log(f"server {server} changed its tools, but the change could not be recorded: "
                    f"{err}")

    def _failed(self, server, err):
        self.failures[server] = self.failures.get(server, 0) + 1
        with self.cond:  # tried again without a new notice
            self.pending.setdefault(server, 0)
        held = sorted(tool.name for tool in self.gate.tools.values()
                      if tool.server.name == server)
        log(f"server {server} said its tools changed, but listing them again failed: {err}; "
            f"not offered until a listing succeeds (next try in "
            f"{relist_wait(self.failures[server]):g}s): {', '.join(held) or 'none'}")
        self._hold(server, held)

    def _relist(self, server):
        upstream = self.upstreams[server]
        listed = upstream.list_tools(Deadline(upstream.server.connect_timeout))
        changes = tool_changes(upstream.pinned, {name: manifest_entry(tool)
                                                 for name, tool in listed.items()})
        differences = {kind: sorted(name for name, (k, _, _) in changes.items() if k == kind)
                       for kind in ("changed", "removed", "added")}
        offered = {tool.upstream_name: tool.name for tool in self.gate.tools.values()
                   if tool.server.name == server}
        held = sorted(offered[name] for name in differences["changed"] + differences["removed"]
                      if name in offered)
        if self.failures.pop(server, 0):
            log(f"server {server}: its tools were listed again; not offered now: "
                f"{', '.join(held) or 'none'}")
        try:
            if differences != self.seen.get(server, {"changed": [], "removed": [], "added": []}):
                self.seen[server] = differences
                payload = {"server": server, **differences, "not_offered": held}
                self.gate.store.write(lambda tx: tx.event(f"{self.gate.config.session}.tools",
                                                          "tools.changed", payload))
                log(tools_changed_text(payload) + " (pin -diff shows how)")
        finally:  # what is offered follows the listing even when the record cannot be written
            self._hold(server, held)

    def _hold(self, server, held):
        if held != self.held.get(server, []):
            self.held[server] = held
            self.gate.quarantine(name for names in self.held.values()
                                 for name in names)
            self.announce()

    def exited(self, upstream, why):
        """`upstream`'s server went away while serving: down until started again."""
        with self.cond:
            if upstream.down:
                return  # it died while being started again: that start fails
            upstream.down = (time.time(), time.time() + restart_wait(0))
            self.cond.notify_all()
        log(f"server {upstream.name} {why}; calls to its tools fail without executing "
            f"until it is {upstream.AGAIN} (next try in {restart_wait(0)}s)")

    def _revive(self):
        # Never returns: a server started here dies with the thread that started it (spawn).
        while True:
            with self.cond:
                down = [u for u in self.upstreams.values() if u.down]
                due = [u for u in down if u.down[1] <= time.time()]
                if not due or self.gate.stopping.is_set():
                    self.cond.wait(None if self.gate.stopping.is_set() else
                                   min(u.down[1] for u in down) - time.time() if down else 60)
                    continue
            self._start_again(due[0])

    def _start_again(self, upstream):
        name = upstream.name
        try:
            upstream.close()  # the old process's group, reaped
            upstream.spawn()
            upstream.handshake(Deadline(upstream.server.connect_timeout))
            self._relist(name)
            with upstream.lock:  # an exit after this is an exit while serving
                if upstream.closed:
                    raise UpstreamError(upstream.describe("connect", upstream.closed))
                upstream.down = None
        except Exception as err:  # this thread must live on: its servers die with it
            self.starts[name] = self.starts.get(name, 0) + 1
            wait = restart_wait(self.starts[name])
            upstream.down = (upstream.down[0], time.time() + wait)
            upstream.close()
            log(f"server {name} could not be {upstream.AGAIN}: {err}; next try in "
                f"{wait}s")
            return
        self.starts.pop(name, None)
        log(f"server {name} was {upstream.AGAIN} and serves its tools")


def restart_wait(failures):
    return min(2 ** min(failures, 6), 60)


def relist_wait(failures):
    """Seconds from a listing to the next after `failures` in a row (the exponent is bounded,
    so a server failing for days cannot overflow it)."""
    return min(LIST_CHANGED_INTERVAL * 2 ** min(failures, 16), RELIST_RETRY_MAX)


def tools_changed_text(payload):
    parts = [f"{kind} {', '.join(map(sanitize, payload[kind]))}"
             for kind in ("changed", "removed", "added") if payload[kind]]
    held = ", ".join(payload["not_offered"]) or "none"
    return (f"server {payload['server']} changed its tools while serving: "
            f"{'; '.join(parts) or 'back to what was pinned'}; not offered now: {held}")


# =============================================================================================
# 24. The status tool
#
# Reads as: around the core
#
# Owns: the status tool's answer: the approvals of this session and what became of them.
# Core it calls: Store.latest_approval, step_outcome, and Answer, answer and gate_status to
# build its answer from section 6's tables; it reads the rest through the Ledger (section 22)
# serve opens.
# Promises: it tells the model what waits and what was decided, never a command, the database,
# the config or a run id; recorded text from servers is sanitized.
# =============================================================================================

def time_since(text):
    return format_duration(int(time.time() - parse_time(text)) * SECOND)


STATUS_LOOKBACK = 3600
STATUS_ROWS = 200


def status_answer(gate, args):
    """The status tool: what waits for an operator, or what became of one approval. It reads
    only, is not recorded as a run, and never executes or decides anything."""
    if args is None:
        args = {}
    if not isinstance(args, dict) or set(args) - {"approval_id"} or \
            not isinstance(args.get("approval_id", ""), str):
        return answer("INVALID", reason=SLOT_PROSE["status_arguments"])
    try:
        approvals = status_approvals(gate.store, gate.config.session)
    except StoreError as err:
        log(str(err))
        return answer("UNAVAILABLE", what=SLOT_PROSE["unreadable"])
    wanted = args.get("approval_id", "").strip()
    if wanted:
        for approval in approvals:
            if approval["id"] == wanted:
                return Answer(f"GATE_STATUS: {describe_approval(gate, approval)}",
                              mark="GATE_STATUS")
        return gate_status("unknown_id", approval=clean(wanted, 100))
    waiting = [a for a in approvals if a["status"] == "pending" and
               (not a["expires_at"] or a["expires_at"] > now())]
    if not waiting:
        return gate_status("none_waiting")
    lines = "\n".join(f"- {describe_approval(gate, a)}" for a in waiting)
    return gate_status("one_waiting" if len(waiting) == 1 else "some_waiting",
                       count=len(waiting), lines=lines)


def status_approvals(store, session):
    return store.recent_approvals(session, format_time(time.time() - STATUS_LOOKBACK),
                                  STATUS_ROWS)


def describe_approval(gate, approval):
    """One approval as the model may read it: what it asked, and what became of it."""
    capability = parse(approval["capability_json"])
    head = STATUS_PROSE["head"].format(approval=approval["id"], tool=clean(approval["tool"], 64),
                                       args=clean(policy_json(capability.get("args", {})), 200))
    age = time_since(approval["created_at"])
    status = approval["status"]
    if status == "pending":
        if approval["expires_at"] and approval["expires_at"] <= now():
            return STATUS_PROSE["expired_undecided"].format(head=head)
        if approval["kind"] == "interrupted_side_effect":
            return STATUS_PROSE["outcome_unknown"].format(head=head, age=age)
        return STATUS_PROSE["pending"].format(head=head, age=age)
    if status == "rejected":
        note = STATUS_PROSE["rejected_note"].format(note=cut(quote(approval["note"]), 500)) \
            if approval["note"] else ""
        return STATUS_PROSE["rejected"].format(head=head, note=note)
    if status == "expired":
        return STATUS_PROSE["expired"].format(head=head)
    return f"{head}: {approved_fate(gate, approval)}"


def approved_fate(gate, approval):
    store, step_id = gate.store, approval["step_id"]
    if store.executed_under(approval):
        observed = store.step_observation(step_id)
        if not observed:
            return STATUS_PROSE["executing"]
        ending = step_outcome(observed)
        if ending == "ok":
            return STATUS_PROSE["succeeded"]
        if ending not in CALL_ENDINGS:  # taken over or cancelled while executing
            ending = "cut_off"
        error = clean(outcome_text(observed), 500) if ending != "cut_off" else ""
        if ending == "unrecorded":
            return STATUS_PROSE["unrecorded"].format(error=error)
        if ending in ("error", "unsent"):
            return STATUS_PROSE["failed"].format(error=error)
        waiting = [a for a in status_approvals(store, gate.config.session)
                   if a["request_key"] == approval["request_key"] and a["status"] == "pending"
                   and a["kind"] == "interrupted_side_effect" and a["id"] != approval["id"]]
        then = STATUS_PROSE["rerun_waits"].format(approval=waiting[0]["id"]) if waiting else \
            STATUS_PROSE["no_rerun"]
        return STATUS_PROSE["unknown"].format(how=HOW[ending], then=then)
    newer = store.latest_approval(approval["run_id"])
    if newer and newer["step_id"] == step_id and newer["id"] != approval["id"]:
        return STATUS_PROSE["superseded"].format(approval=newer["id"])
    if approval["run_status"] == "WAITING_FOR_APPROVAL":
        return STATUS_PROSE["uncollected"].format(tool=approval["tool"])
    if approval["run_status"] not in TERMINAL:
        return STATUS_PROSE["executing"]
    # An approved step refused was refused when collected: its first decision asked.
    observed = store.step_observation(step_id)
    refused = step_outcome(observed) if observed else ""
    if approval["run_reason"] in ("operator_cancelled", "approval_expired"):
        why = NOT_EXECUTED_WHY[approval["run_reason"]]
    elif refused == "denied":
        why = NOT_EXECUTED_WHY["denied_on_resume"]
    elif refused == "invalid":
        why = NOT_EXECUTED_WHY["invalid_on_resume"]
    else:
        why = NOT_EXECUTED_WHY["ended"].format(reason=approval["run_reason"])
    return STATUS_PROSE["not_executed"].format(why=why)


# =============================================================================================
# 25. The host's other requests
#
# Reads as: around the core
#
# Owns: what the host side hands on because it decides no call: initialize's answer, ping,
# notifications/initialized and the tools-changed notice it allows, a call's progress as the
# host hears it, the threads requests run on, and the status tool. Serve hands HostServer a
# HostAround at start and a StatusTool once serving.
# Core it calls: answer, and HostServer's send and protocol.
# Promises: a call's progress (the gate's while it holds the call, then the server's) reaches
# the host under the host's token, only increasing, and nothing more once the host cancelled
# the call; the host is told once of a tool its server changed while serving (section 23), and
# only after it said notifications/initialized (before, its first tools/list sees the change).
# =============================================================================================

SERVER_INFO = {"name": "gated-tools", "version": VERSION}
PROGRESS_MESSAGE_BYTES = 1000


class Progress:
    """One call's progress as its host hears it: the hold's seconds, one a second at most, then
    the server's values after them. Only a value above the last one told is sent, as the
    protocol asks."""

    def __init__(self, send):
        self.send = send  # send(value, total, message); total and message None when absent
        self.lock = threading.Lock()
        self.held = decimal.Decimal(0)  # the hold's last value told: the server's start
        self.last = None

    def holding(self, waited, total, message):
        exact = decimal.Decimal(repr(waited))
        if exact - self.held >= 1 and self._tell(waited, exact, total, message):
            self.held = exact

    def server(self, value, total, message):
        if not isinstance(value, Number):
            return
        exact = self.held + value.exact()
        shown = value if not self.held else Number(str(exact))
        if isinstance(total, Number) and self.held:
            total = Number(str(self.held + total.exact()))
        self._tell(shown, exact, total if isinstance(total, Number) else None,
                   clean(message, PROGRESS_MESSAGE_BYTES) if isinstance(message, str) else None)

    def _tell(self, value, exact, total, message):
        with self.lock:  # told under the lock, so two values never reach the host out of order
            if self.last is not None and exact <= self.last:
                return False
            self.last = exact
            self.send(value, total, message)
            return True


class Workers:
    """Threads for requests: an idle one takes the next task and a new one starts only when
    none is idle, so threads never outnumber the requests once in flight together, plus the
    reader. One idle for IDLE_SECONDS ends."""

    IDLE_SECONDS = 2.0

    def __init__(self):
        self.tasks = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.idle = 0

    def submit(self, task):
        # Under the lock each task claims an idle thread or starts one, so every queued task
        # has a thread that will take it; `idle` counts the waiting threads no task claimed.
        with self.lock:
            claimed = self.idle > 0
            if claimed:
                self.idle -= 1
        self.tasks.put(task)
        if not claimed:
            threading.Thread(target=self._work, daemon=True).start()

    def _work(self):
        while True:
            try:
                task = self.tasks.get(timeout=self.IDLE_SECONDS)
            except queue.Empty:
                with self.lock:
                    # Only an unclaimed thread may end: with none left, a task is on its
                    # way to this one.
                    if self.idle > 0:
                        self.idle -= 1
                        return
                continue
            try:
                task()
            except BaseException as err:  # a task handles its own errors; this is a bug
                log(f"internal error in a worker: {type(err).__name__}: {err}")
            with self.lock:
                self.idle += 1


class HostAround:
    """The seam HostServer reaches this section by: `requests` and `notifications` map a
    method to its handler(host, params); a request's handler returns its result. `workers`
    runs the reader's next turn and each request; `progress` relays a call's progress."""

    def __init__(self):
        self.initialized = False
        self.workers = Workers()
        self.requests = {"initialize": self.initialize, "ping": lambda host, params: {}}
        self.notifications = {"notifications/initialized": self._initialized}

    @staticmethod
    def initialize(host, params):
        return {"protocolVersion": host.protocol, "capabilities": {"tools": {"listChanged": True}},
                "serverInfo": SERVER_INFO}

    def _initialized(self, host, params):
        self.initialized = True

    def tools_changed(self, host):
        if self.initialized:
            host.send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})

    @staticmethod
    def progress(host, token, cancelled):
        def send(value, total, message):
            # Written on the thread that reads the server: a host that stops reading holds up
            # that server's answers, as it holds up every answer it is sent.
            if cancelled.is_set():
                return
            told = {"progressToken": token, "progress": value, "total": total,
                    "message": message}
            host.send({"jsonrpc": "2.0", "method": "notifications/progress",
                       "params": {k: v for k, v in told.items() if v is not None}})
        return Progress(send)


STATUS_SCHEMA = {"type": "object", "additionalProperties": False, "properties": {
    "approval_id": {"type": "string", "description": STATUS_ARGUMENT}}}


class StatusTool:
    """The status tool as the host side offers and calls it; `unserved` servers of the config
    could not be served, which the model is told (the reasons are the operator's, on stderr)."""

    def __init__(self, gate, name, unserved):
        self.gate, self.unserved = gate, unserved
        self.listing = {"name": name, "description": STATUS_DESCRIPTION,
                        "inputSchema": STATUS_SCHEMA}

    def call(self, args, invalid):
        if invalid:
            return answer("INVALID", reason=clean(invalid[0], 1000)).result()
        status = status_answer(self.gate, args)
        if self.unserved and status.text.startswith("GATE_STATUS:"):
            status.text += " " + UNSERVED_NOTE.format(count=self.unserved)
        upstreams = {t.upstream.name: t.upstream for t in self.gate.tools.values()}
        for name, upstream in sorted(upstreams.items()):
            down = upstream.down_text()
            if down and status.text.startswith("GATE_STATUS:"):
                status.text += " " + DOWN_NOTE.format(server=clean(name, 64), down=down)
        return status.result()


# =============================================================================================
# 26. Notify
#
# Reads as: around the core
#
# Owns: telling the operator an approval starts waiting (the lines on stderr with the command
# that decides it, and the operator's notify program) and what to change to let a call
# refused as a duplicate through.
# Promises: the program runs in its own process group with a deadline, never blocks a call, and
# past a backlog the oldest announcement is dropped and said so.
# Core it calls: nothing; the gate calls announce_waiting's announce and
# duplicate_refused's duplicate through the seams serve registers.
# =============================================================================================


VENV = "~/.agentgate-venv"  # where the README has the mcp package installed


def python_path():
    """The one interpreter every printed command and host entry names: this one, unless it
    lacks the mcp package (login needs it) and the venv the README installs it in has it."""
    import glob
    import importlib.util
    venv = os.path.expanduser(VENV)
    if importlib.util.find_spec("mcp") is None and glob.glob(
            os.path.join(venv, "lib", "python3*", "site-packages", "mcp")):
        return os.path.join(venv, "bin", "python")
    return sys.executable


def python_command():
    """`python3` when that name finds python_path() on PATH, else its path: a virtual
    environment's python (which has the mcp package) is not the python3 a terminal finds."""
    import shutil
    found, chosen = shutil.which("python3"), python_path()
    if found and os.path.abspath(found) == os.path.abspath(chosen):
        return "python3"
    return shlex.quote(chosen)


def operator_hint(config_file, database=""):
    command = f"{python_command()} {shlex.quote(os.path.abspath(sys.argv[0]))}"
    if database:
        command += f" -db {shlex.quote(os.path.abspath(database))}"
    elif os.path.abspath(config_path(None)) != os.path.abspath(config_file):
        command += f" -config {shlex.quote(os.path.abspath(config_file))}"
    return command


def announce_waiting(config, notifier=None):
    hint = operator_hint(config.path)

    def announce(approval, tool, run_id):
        command = f"{hint} approve {run_id} -approval {approval['id']}"
        log(f"approval {approval['id']} ({approval['kind']}) for {tool.name} waits for an "
            f"operator: run {run_id}")
        log(f"  decide with: {command}   (or reject)")
        if notifier:
            # Names only: an argument's value never leaves the gate this way.
            notifier.announce({"AGENTGATE_APPROVAL": approval["id"],
                               "AGENTGATE_RUN": run_id, "AGENTGATE_TOOL": tool.name,
                               "AGENTGATE_COMMAND": command})
    return announce


def duplicate_refused(config):
    """The gate's duplicate, as serve registers it: it names the config, never model text."""
    def duplicate(tool, run_id, executed_at, window):
        log(f"a call to {tool.name} was refused as a duplicate of run {run_id}, which executed "
            f"the same request at {prose_time(executed_at)}: identical calls to {tool.name} "
            f"are refused for {format_duration(window)} after one executes; to allow them, set "
            f"\"repeat_window\": \"0s\" (or a shorter time) in the rule for "
            f"{tool.upstream_name} of server {tool.server.name} in {config.path}")
    return duplicate


NOTIFY_TIMEOUT = 10  # seconds a notify program may run before its process group is killed
NOTIFY_BACKLOG = 32  # announcements waiting for the notify program; past it, one is dropped


class Notifier:
    """Runs the operator's notify program when an approval starts waiting, one at a time on a
    thread of its own: a failing, missing or hanging program costs a call nothing (it is
    stopped after NOTIFY_TIMEOUT)."""

    def __init__(self, argv):
        self.argv = argv
        self.backlog = queue.Queue(NOTIFY_BACKLOG)
        threading.Thread(target=self._run, daemon=True).start()

    def announce(self, names):
        try:
            self.backlog.put_nowait(names)
        except queue.Full:
            log(f"notify is {NOTIFY_BACKLOG} approvals behind; approval "
                f"{names['AGENTGATE_APPROVAL']} is not announced")

    def _run(self):
        program = self.argv[0]
        while True:
            names = self.backlog.get()
            try:
                proc = subprocess.Popen(self.argv, env={**os.environ, **names},
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
            except OSError as err:
                log(f"notify could not run {program}: {err.strerror}")
                continue
            try:
                status = proc.wait(NOTIFY_TIMEOUT)
            except subprocess.TimeoutExpired:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
                log(f"notify {program} was stopped after {NOTIFY_TIMEOUT}s")
                continue
            if status:
                log(f"notify {program} exited with status {status}")


# =============================================================================================
# 27. Pins and load reports
#
# Reads as: around the core
#
# Owns: writing a server's manifest (pin), and the lines of a load report (Report, which load
# tells what became of each tool) and of a change.
# Core it calls: manifest_entry, changed_parts, compared_part, rule_outcome;
# section 21's write_private.
# Promises: server-chosen names are sanitized in every report line.
# =============================================================================================

def settings_text(config, rule, when=""):
    """What a rule decides of a call as `check` shows it, as a person relies on it: what may
    decide otherwise, and how long an identical call after one that changed something is
    refused (the repeat window)."""
    outcome = rule_outcome(config, rule)
    others = [f"{len(rule.when)} when entr{'y' if len(rule.when) == 1 else 'ies'}"] * bool(
        rule.when) + [f"{len(rule.limits)} limit{'s' * (len(rule.limits) > 1)}"] * bool(
        rule.limits and (rule.when or outcome == "allow"))
    notes = [f"{' and '.join(others)} may decide otherwise"] * bool(others)
    if outcome == "require_approval" and config.operator == "none":
        outcome = "deny"
        notes.insert(0, "no operator is at hand to ask")
    window = config.repeat_window if rule.repeat_window is None else rule.repeat_window
    notes += [f"repeat window {format_duration(window)}"] * (rule.side_effect != "read_only")
    word = {"allow": "allow", "require_approval": "ask"}.get(outcome, "deny")
    return "; ".join([word + when, *notes])


def rule_lines(rule, tool_name):
    lines = []
    for entry in rule.when:
        held = [condition.text() for condition in entry.conditions]
        during = entry.during and entry.during.raw
        if during:
            spans = [f"{word} {during[key]}" for word, key in (("on", "days"), ("from", "hours"))
                     if key in during]
            held.append(f"{' '.join(spans)} ({during['zone']})")
        if entry.clients is not None:
            held.append(f"the host is one of {policy_json(entry.clients)}")
        lines.append(f"{entry.label}: if {' and '.join(held)} -> {entry.outcome} "
                     f"({cut(sanitize(entry.reason), 120)})")
    return lines + [f"{limit.label}: {limit.text(tool_name)}, then {limit.then}"
                    for limit in rule.limits]


def connect(server):
    """Start one server within its connect_timeout (load_all starts many at once). Returns
    (upstream, tools); the caller closes it."""
    upstream = new_upstream(server)
    try:
        upstream.spawn()
        return upstream, handshake_and_list(upstream, Deadline(server.connect_timeout))
    except BaseException:
        upstream.close()
        raise


def presented(server):
    upstream, live = connect(server)
    upstream.close()
    return {name: manifest_entry(tool) for name, tool in sorted(live.items())}


def pin(server):
    manifest = {"server": server.name, "pinned_at": now(), "tools": presented(server)}
    write_private(server.manifest, pretty_json(manifest) + "\n")
    return manifest


def change_lines(old, new):
    """A changed tool as a person compares it: a unified diff of each part that differs."""
    import difflib
    import textwrap

    def lines(entry, part, key):
        if part == "description":
            return textwrap.wrap(entry["description"], 88) or [""]
        value = entry["input_schema"] if part == "input schema" else compared_part(entry, key, old)
        return pretty_json(value).splitlines()
    changed, out = changed_parts(old, new), []
    for part, key in PINNED_PARTS:
        if part not in changed:
            continue
        before, after = lines(old, part, key), lines(new, part, key)
        if before == after:  # the texts differ only in their spacing
            out.append(f"{part}: only its spacing differs")
            continue
        out.append(f"{part}:")
        out += list(difflib.unified_diff(before, after, "pinned", "now", n=2, lineterm=""))
    return [sanitize(line) for line in out]


HINT_NAMES = (("readOnlyHint", "readOnly"), ("destructiveHint", "destructive"),
              ("idempotentHint", "idempotent"), ("openWorldHint", "openWorld"))


def hints_text(entry):
    annotations = entry.get("annotations")
    if annotations is None:
        return "no annotations"
    claimed = [word for key, word in HINT_NAMES if annotations.get(key) is True]
    return ", ".join(claimed) or "claims nothing"


class Report:
    """What loading one server decided (load tells it, tool by tool), as lines an operator
    reads, one per tool and its rule's entries and limits and lint findings under it;
    `unserved` says why the server is not served ('' while it is), `kinds` what became of
    each tool, in order, `at` which line is each tool's, and `review` why a proposal deserves a
    careful read."""

    def __init__(self, server):
        self.server = server
        self.lines = []
        self.unserved = ""
        self.kinds, self.review, self.at = {}, {}, {}

    def add(self, kind, tool, text):
        self.kinds[tool], self.at[len(self.lines)] = kind, tool
        self.lines.append(f"{sanitize(self.server)}: {text}")

    def count(self, kind):
        return sum(1 for each in self.kinds.values() if each == kind)

    def unpinned(self, name):
        self.add("unpinned", name, f"unpinned {sanitize(name)}: not in the manifest")

    def unclassified(self, name):
        self.add("unclassified", name, f"unclassified {sanitize(name)}: no rule")

    def unreviewed(self, entry, rule):
        name = entry["name"]
        self.add("unreviewed", name, f"unreviewed {sanitize(name)}: its rule "
                 f"({rule.side_effect}) was proposed from the server's own hints; read it, "
                 f"then run check -accept")
        if rule.side_effect == "read_only" and _SECRETS_WORDS.search(entry["description"]):
            self.review[name] = "a read that may return secrets"

    def refused(self, name, reason):
        self.add("refused", name, f"refused {sanitize(name)}: {reason}")

    def registered(self, tool, mismatch):
        extra = f" [hint mismatch allowed: {mismatch}]" if mismatch else ""
        if not tool.timeout_given:
            extra += (f" [no timeout set: the default {format_duration(DEFAULT_TOOL_TIMEOUT)} "
                      f"applies]")
        name = tool.upstream_name
        self.add("registered", name, f"registered {sanitize(name)} as {tool.name} "
                                     f"({tool.side_effect}){extra}")
        self.lines += [f"{sanitize(self.server)}:   {sanitize(line)}"
                       for line in rule_lines(tool.rule, tool.name)]

    def lint(self, found):
        self.lines += [f"{sanitize(self.server)}: {line}" for line in lint_lines(found)]


# A read whose description speaks of these may hand the model what the person protects (an
# environment with the tokens init just moved into the config, say): proposed read_only, it
# would run unasked once accepted.
_SECRETS_WORDS = re.compile(r"\b(environment|env|secrets?|credentials?|passwords?|keys?|"
                            r"tokens?)\b", re.I)


def served_lines(config, server, report, tools):
    """A server as check shows it: whether it is served, then its report, one line per tool
    with what an offered tool decides after `->`, and what a proposal would once accepted."""
    name = quote(server.name)
    offered = {tool.upstream_name: tool for tool in tools if tool.server is server}
    if report.unserved:
        why = report.unserved.removeprefix(f"server {name}: ")
        lines = [f"server {name} is not served: {sanitize(why)}"]
    else:
        lines = [f"server {name} is served: {len(offered)} tool(s) offered"]
    for at, line in enumerate(report.lines):
        tool = report.at.get(at)
        if tool in offered:
            line += f" -> {settings_text(config, offered[tool].rule)}"
        elif report.kinds.get(tool) == "registered":  # before its server failed to load
            line += " -> not offered: its server is not served"
        elif report.kinds.get(tool) == "unreviewed":
            rule = server.rules[tool]
            line = (f"{sanitize(server.name)}: unreviewed {sanitize(tool)}: proposed "
                    f"{rule.side_effect} -> would {settings_text(config, rule, ' once accepted')}")
        lines.append(line)
        if tool in report.review:
            lines.append(f"    review: {report.review[tool]}")
    return lines


def log_reports(reports):
    for report in reports:
        for line in report.lines:
            log(line)
        if report.unserved:
            log(f"not served: {report.unserved}")


# =============================================================================================
# 28. The command line's flags
#
# Reads as: around the core
#
# Owns: the single-dash flags every command shares, their help, where the config is found,
# and the reading of a text argument (UTF-8 only).
# Core it calls: nothing but the text helpers.
# =============================================================================================

def config_path(given):
    xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    default = os.path.join(xdg, PROGRAM, "config.json")
    return given or os.environ.get("AGENTGATE_CONFIG") or default


USAGE = f"""usage: agentgate.py [serve] [-config FILE]
       agentgate.py init [-from FILE] [-config FILE] [-write]
       agentgate.py login SERVER [-config FILE]   OAuth with a url server, in a browser
       agentgate.py pin|check [-config FILE]      check -accept [-yes]: accept init's proposals
       agentgate.py pin -diff [-tool SERVER/TOOL ... | -all [-yes]] [-config FILE]
       agentgate.py runs|show|approve|reject|cancel|verify|recheck ... (-h for each)
       agentgate.py watch [-config FILE] [-db FILE] [-by WHO]
       agentgate.py grant|grants|revoke ... (-h for each)
       agentgate.py demo
       agentgate.py -version

{__doc__.split("Scope.")[1].split(chr(10) + "Sections (")[0].strip()}

Where the config comes from: -config FILE, else $AGENTGATE_CONFIG, else
$XDG_CONFIG_HOME/agentgate/config.json (default ~/.config/agentgate/config.json).
"""


class Usage(Exception):
    """A command line that cannot be carried out as written (exit 2)."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise Usage(message)


# What each flag does, as -h prints it: "command -flag" where the meaning is the command's own,
# else the flag's name. parser() takes no flag without an entry here, so -h never lists a
# flag without saying what it does.
FLAG_HELP = {
    "config": "the config file (else $AGENTGATE_CONFIG, else the default config.json)",
    "db": "open this database directly instead of the config's",
    "json": "print JSON and nothing else",
    "full": "print every byte of a long value instead of its head and tail",
    "by": "who decides, as recorded (default: your user name)",
    "approval": "the approval to decide; naming it is your confirmation",
    "approve -yes": "approve without asking (needed without a terminal, unless -approval)",
    "reject -yes": "reject without asking (needed without a terminal, unless -approval)",
    "approve -note": "a note kept with the decision",
    "reject -note": "why (required): the model is shown it",
    "cancel -note": "why, kept with the run",
    "revoke -note": "why, kept with the grant",
    "grant -note": "why, kept with the grant and listed by grants",
    "grant -by": "who grants, as recorded (default: your user name)",
    "revoke -by": "who revokes, as recorded (default: your user name)",
    "revoke -yes": "revoke without asking (needed without a terminal, unless the id is whole)",
    "cancel -by": "who cancels, as recorded (default: your user name)",
    "grant -yes": "grant without asking (needed without a terminal)",
    "grant -if": 'conditions the arguments must meet, as JSON: \'{"/amount": {"max": 20}}\'',
    "grant -for": "how long it lasts, such as 30m or 8h (default 1h, at most grant_ttl)",
    "grants -days": "list grants that ended in the last N days too (default 7)",
    "runs -limit": "show at most N runs, newest first (default 100)",
    "recheck -limit": "re-check at most N of the session's newest runs (default 50)",
    "recheck -run": "re-check this run only (its id or a prefix)",
    "recheck -session": "re-check this session's runs instead of the config's session",
    "recheck -current-tools": "start the servers and re-check against the tools they present "
                              "now, instead of the specs recorded",
    "verify -from": "the first sequence number to check (default 1)",
    "verify -to": "the last sequence number to check (default the chain's end)",
    "verify -head": "a head kept from an earlier verify (SEQ:HASH): say whether it still matches",
    "pin -diff": "show what each server presents now against its manifest",
    "pin -tool": "with -diff: pin this difference again (SERVER/TOOL or TOOL; repeatable)",
    "pin -all": "with -diff: pin every difference again",
    "pin -yes": "with -diff -all: pin again without asking",
    "check -accept": "print init's proposed rules, mark them reviewed once you type yes, then "
                     "check",
    "check -yes": "with -accept: accept without asking (needed without a terminal)",
    "init -from": "read this host file (or a project's .mcp.json) instead of the hosts' own",
    "init -write": "edit each host's file to start the gate instead (a backup is kept)",
}


# What -h shows a flag's value as, where its name does not say it.
FLAG_VALUE = {"config": "FILE", "db": "FILE", "init -from": "FILE", "verify -from": "SEQ",
              "to": "SEQ", "limit": "N", "days": "N", "note": "TEXT", "by": "WHO",
              "approval": "ID", "run": "ID", "session": "NAME", "if": "JSON",
              "for": "DURATION", "head": "SEQ:HASH", "tool": "SERVER/TOOL"}


def parser(command, *flags):
    p = Parser(prog=f"agentgate.py {command}", allow_abbrev=False, add_help=True)
    for flag in flags:
        name, kind = flag if isinstance(flag, tuple) else (flag, str)
        about = FLAG_HELP.get(f"{command} -{name}") or FLAG_HELP[name]
        if kind is bool:
            p.add_argument(f"-{name}", f"--{name}", action="store_true", help=about)
        else:
            # Paths are the system's own (any bytes); every other text must be UTF-8.
            text = kind is str and name not in ("config", "db")
            value = FLAG_VALUE.get(f"{command} -{name}") or FLAG_VALUE.get(name, name.upper())
            p.add_argument(f"-{name}", f"--{name}", type=text_argument if text else kind,
                           metavar=value, help=about)
    return p


NAMED_RUN = "a run's id or an approval's, or a prefix of either (6 characters or more)"


def text_argument(value):
    """A text flag as given: it must be UTF-8, since it is recorded and may be shown to the
    model (the system hands bytes that are not UTF-8 over as lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("is not valid UTF-8 text") from None
    return value


# =============================================================================================
# 29. Operator commands
#
# Reads as: around the core
#
# Owns: what an operator does in a terminal: list runs, show one, approve, reject, cancel,
# watch what waits, grant, verify the event chain, re-check recorded decisions under today's
# policy. The database is found from the config (-config, $AGENTGATE_CONFIG, the default path)
# or named with -db; it is opened as it is, never created or migrated, and read-only where
# nothing is decided.
# Core it calls: Store (its reads, and decide_approval, cancel_run, create_grant,
# revoke_grant), check_database_path, Tool, check_arguments, evaluate, approval_hash,
# decision_facts, policy_decision, Grant, last_attempt, confirmed_conditions,
# parse_conditions, pointer_problem, step_outcome, stored_hash, event_hash; section 21's
# load_config, check_reach and read_manifest.
# Promises: approve, reject and grant print what is decided in full (agreed_on) and decide
# bound to the hash of exactly what they printed, so a row that changed after it was shown is
# refused; a grant releases only the waiting approvals its printout listed; a printout
# that shortened a long value decides nothing until -full shows every byte; the late outcome
# of an attempt cut off while its process lived is printed beside the question it bears on;
# they decide without asking only with -approval or -yes, and otherwise only after a "yes"
# typed at a terminal; watch shows the same printout and decides through the same write.
# An id, whole or a prefix, names one run or approval among all of them whatever their state.
# A value that mixes scripts or holds invisible characters is marked where it is printed.
# -json prints one JSON value on stdout and nothing else. Every line is written by tell
# (tell_json), which sanitizes it, so nothing chosen by a server, a model or an operator
# reaches the terminal raw; text given on the command line must be UTF-8.
# =============================================================================================

def tell_json(value, out=None):
    """A -json value through tell, valid JSON that reads back the same: each character
    sanitize would change is written as its JSON escape, so tell finds nothing to change."""
    tell(*map(_json_for_terminal, pretty_json(value).split("\n")), out=out)


def _json_for_terminal(line):
    if sanitize(line) == line:
        return line
    return "".join(json.dumps(ch)[1:-1] if sanitize(ch) != ch or
                   unicodedata.category(ch)[0] == "M" else ch for ch in line)


def confirmed_conditions(conditions):
    """A grant's conditions as it keeps them: each `under` with its directories as resolved and
    shown at confirmation; resolved again later, a link put in since would move the grant."""
    return {c.pointer: {name: expected if name == "under" else c.raw[name]
                        for name, expected in c.tests} for c in conditions}


ARG_SHOWN = 240


def operator_store(opts, readonly):
    """The store an operator command works on, and the session it is about ('' with -db)."""
    path = config_path(opts.config)
    database = opts.db or (not opts.config and not os.path.lexists(path) and
                           shared_database(os.path.dirname(path)))
    if database:
        return Ledger(os.path.abspath(database), readonly=readonly, create=False), ""
    config = load_config(path)
    return Ledger(config.database, readonly=readonly, create=False), config.session


def shared_database(directory):
    """The one database in the config directory, which init's configs, one per host, share:
    every host's runs are the operator's to decide. More than one is refused."""
    try:
        found = sorted(name for name in os.listdir(directory) if name.endswith(".db"))
    except OSError:
        return None
    if len(found) > 1:
        raise ConfigError(f"{directory} holds {len(found)} databases ({', '.join(found)}) and "
                          f"no config.json: name one with -db, or a config with -config")
    return os.path.join(directory, found[0]) if found else None


def operator_parser(command, *flags):
    p = parser(command, "config", "db", ("json", bool), *flags)
    return p


def current_user():
    try:
        import pwd
        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return os.environ.get("USER") or os.environ.get("USERNAME") or ""


def cmd_runs(argv):
    opts = operator_parser("runs", ("limit", int)).parse_args(argv)
    limit = 100 if opts.limit is None else opts.limit
    if limit <= 0:
        raise Usage("-limit must be at least 1")
    store, session = operator_store(opts, readonly=True)
    rows = store.runs_page(session, limit + 1)
    runs = rows[:limit]
    if opts.json:
        tell_json(runs)
        return 0
    if not runs:
        tell("no runs")
        return 0
    table = [("RUN", "STATE", "STEPS", "CREATED", "HOST", "WAITING APPROVAL", "TOOL")]
    for r in runs:
        table.append((r["run"], run_state(store, r), str(r["steps"]), prose_time(r["created"]),
                      cut(sanitize(r["host"]), 24) or "-", r["pending_approval"] or "",
                      sanitize(r["tool"])))
    print_table(table)
    if len(rows) > limit:
        tell("... more runs; use -limit to see them")
    print_tool_changes(store, session)
    return 0


FAILED_STATE = {"denied": "DENIED", "invalid": "INVALID", "error": "TOOL_ERROR",
                "unsent": "TOOL_ERROR", "timed_out": "UNKNOWN_OUTCOME",
                "no_answer": "UNKNOWN_OUTCOME"}


def run_state(store, run):
    """How a run stands, in the word its call's answer began with where there is one (a
    denied call is DENIED, not FAILED for a goal), else its status."""
    status, reason = run["status"], run["reason"]
    if status == "CANCELLED":
        return {"approval_rejected": "REJECTED", "approval_expired": "EXPIRED"}.get(reason,
                                                                                   status)
    if status == "FAILED":
        observed = [s["observation"] for s in store.steps(run["run"]) if s["observation"]]
        return FAILED_STATE.get(step_outcome(parse(observed[-1])), status) if observed \
            else status
    return status


TOOL_CHANGES_SHOWN = 5


def print_tool_changes(store, session):
    for at, payload in store.tool_changes(session, TOOL_CHANGES_SHOWN) if session else []:
        tell(f"{prose_time(at)}  {tools_changed_text(payload)}")


def print_table(rows):
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        tell("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def load_run(store, run_id):
    run = store.run(run_id)
    if run is None:
        raise StoreError(f"run {quote(run_id)} not found")
    return run


MIN_PREFIX = 6
ID_TEXT = re.compile(r"[A-Za-z0-9_.-]+")
ID_CANDIDATES = 200  # how many ids one prefix is looked up among; ten of them are listed


def id_candidates(store, kind, given, session=""):
    """Every id of a run, an approval or a grant that `given` may name: the id itself when it
    is whole, else every id it starts (MIN_PREFIX characters or more; a run's with or without
    its session), whatever its state: a prefix narrowed to the runs still waiting would move
    on, once the run it named was decided, to another run made the same minute."""
    table = {"run": "runs", "approval": "approvals", "grant": "grants"}[kind]
    if not ID_TEXT.fullmatch(given):
        return []
    if store.ids_starting(table, given, 1) == [given]:
        return [given]
    if len(given) < MIN_PREFIX:
        return []
    found = store.ids_starting(table, given, ID_CANDIDATES)
    if kind == "run" and "." not in given:
        found += (store.ids_starting(table, f"{session}.{given}", ID_CANDIDATES) if session
                  else store.run_ids_after_session(given, ID_CANDIDATES))
    return sorted(set(found))


def resolve_id(store, kind, given, session=""):
    """The one id of `kind` that `given` names (id_candidates). An id that is not found, or a
    prefix that several share, is refused with the candidates listed: nothing is guessed."""
    return only_one(kind, given, id_candidates(store, kind, given, session))


def only_one(kind, given, found):
    if len(found) == 1:
        return found[0]
    if not found:
        short = ID_TEXT.match(given) and len(given) < MIN_PREFIX
        raise StoreError(f"{kind} {quote(given)} not found" + (
            f" (a shortened id needs at least {MIN_PREFIX} characters)" if short else ""))
    listed = ", ".join(found[:10]) + (f" and {len(found) - 10} more" if len(found) > 10 else "")
    raise StoreError(f"{kind} {quote(given)} is ambiguous: it starts {listed}; give more of "
                     f"its characters")


def resolve_named(store, given, session, approval=None):
    """What an operator names with a command's ID (a run's or an approval's, whole or a
    prefix), and with -approval: (run id, approval id or None). An approval names its run
    too; -approval keeps, of the approvals it starts, those of what ID names. Several are
    refused, listed; whether what is named can still be acted on is for the command to say,
    never a reason to choose another."""
    named = [(run_id, None) for run_id in id_candidates(store, "run", given, session)]
    named += [(store.approval(a)["run_id"], a) for a in id_candidates(store, "approval", given)]
    if not named:
        only_one("run or approval", given, [])
    if approval is not None:
        wanted = [(store.approval(a)["run_id"], a) for a in id_candidates(
            store, "approval", approval)]
        if not wanted:
            only_one("approval", approval, [])
        named = [(run_id, a) for run_id, a in wanted if (run_id, None) in named or
                 (run_id, a) in named]
        if not named:
            raise StoreError(f"approval {quote(approval)} is no approval of {quote(given)}")
    runs = collections.defaultdict(set)  # a run and its approvals are one candidate
    for run_id, a in named:
        runs[run_id].update({a} - {None})
    if approval is not None:
        listed = sorted(f"{a} (approval of run {run_id})" for run_id, a in named)
    else:
        listed = sorted(run_id + (f" (and its approval {', '.join(sorted(its))})" if its else "")
                        for run_id, its in runs.items())
    if len(listed) > 1:
        kind = "approval" if approval is not None else "run or approval" if any(
            runs.values()) else "run"
        only_one(kind, given if approval is None else approval, listed)
    (run_id, its), = runs.items()
    return run_id, (min(its) if len(its) == 1 else None)


def cmd_show(argv):
    p = operator_parser("show", ("full", bool))
    p.add_argument("run", type=text_argument, metavar="ID", help=NAMED_RUN)
    opts = p.parse_args(argv)
    store, session = operator_store(opts, readonly=True)
    opts.run = resolve_named(store, opts.run, session)[0]
    run = load_run(store, opts.run)
    steps, approvals = store.steps(opts.run), store.approvals(opts.run)
    if opts.json:
        # Events as what they record: a combined event's parts each as the event it was before
        # schema version 5, so a script reads old and new records alike.
        tell_json({"run": run, "steps": [{k: parse(v) if k in ("decision", "policy",
                                                                "observation") and v else v
                                           for k, v in s.items()} for s in steps],
                    "approvals": [{k: v for k, v in a.items()} for a in approvals],
                    "events": [{"seq": e[0], "at": e[1], "type": e[2], "step_id": e[3],
                                "payload": e[4]} for e in store.run_parts(opts.run)]})
        return 0
    tell(f"run       {run['run']}")
    tell(f"tool      {run['tool']}")
    detail = f": {run['detail']}" if run["detail"] else ""
    reason = f" ({run['reason']})" if run["reason"] else ""
    tell(f"status    {run['status']}{reason}{detail}")
    tell(f"steps     {run['steps']}")
    tell(f"created   {run['created']}")
    if run["finished"]:
        tell(f"finished  {run['finished']}")
    if repeats_refused(store, run["run"], steps):
        tell(f"repeats   {REPEATS_REFUSED}")
    # A summary first: what was asked and what came of it; the detail and the chain after.
    if steps and "args" in parse(steps[0]["decision"]):
        tell(f"arguments {clean(policy_json(parse(steps[0]['decision'])['args']), 300)}")
    tell(*result_lines(steps))
    late = store.late_outcomes(opts.run)
    for _, observation in late:
        tell(f"LATE OUTCOME  {late_text(observation)}")
    for approval in approvals:
        if approval["status"] == "pending":
            tell()
            tell(*approval_lines(approval, opts.full, late)[0])
    tell()
    table = [("STEP", "DECISION", "STATUS", "POLICY", "OBSERVATION")]
    granted = []
    for s in steps:
        decision = parse(s["decision"])
        record = parse(s["policy"]) if s["policy"] else {}
        policy = record.get("outcome", "") + (f" ({record['by']})" if record.get("by") not in (
            None, "class", "rule outcome") else "")
        if record.get("grant"):
            granted.append((s["index"], store.grant(record["grant"])))
        observed = parse(s["observation"]) if s["observation"] else None
        summary = ""
        if observed:
            summary = observed["kind"] + (": " + clean(observed.get("summary", ""), 100)
                                          if observed.get("summary") else "")
        table.append((str(s["index"]), f"{decision['kind']} ({decision.get('origin', '')})",
                      s["status"], policy, summary))
    print_table(table)
    for s in steps:
        if tried_text(s):
            tell(f"step {s['index']}: {tried_text(s)}")
    for index, grant in granted:
        if grant:
            note = f": {grant['note']}" if grant["note"] else ""
            tell(f"step {index} ran under grant {grant['id']} by {grant['by']}, "
                 f"{grant['created_at']} to {grant['expires_at']}{note}")
    for s in steps:
        observed = parse(s["observation"]) if s["observation"] else {}
        if "result" in observed:
            tell()
            head, rows = result_rows(s["index"], observed)
            tell(head)
            if rows:
                print_table(rows)
    tell()
    tell("events, whole as the chain holds them (show -json lists them as values):")
    for seq, at, type_, _, payload in store.run_events(opts.run):  # whole, as verify hashes them
        tell(f"  {seq:>6}  {at}  {type_}")
        tell(*(f"          {piece}" for piece in wrap_columns(sanitize(payload),
                                                                    SHOW_WIDTH)))
    return 0


REPEATS_REFUSED = ("an identical call within the tool's repeat window after this one is "
                   "refused as DUPLICATE; to allow it, set \"repeat_window\": \"0s\" (or a "
                   "shorter time) in the tool's rule")


def repeats_refused(store, run_id, steps):
    """Whether identical calls after this run are refused as duplicates: it executed a tool
    that changes something, to a known end (an unknown one asks an operator instead)."""
    attempt = last_attempt(store.read, run_id)
    if attempt is None or attempt.ending in UNKNOWN_ENDINGS:
        return False
    step = next(s for s in steps if s["id"] == attempt.attempt["step_id"])
    spec = store.tool_spec(step["spec_hash"]) or {}
    return spec.get("side_effect", "read_only") != "read_only"


SHOW_WIDTH = 100  # columns of a wrapped line in show: events and the result are shown whole


def result_lines(steps):
    """The run's result as its last step with one recorded it, whole and sanitized: what the
    tool answered or its call's error (outcome_text), or how the gate ended the step."""
    observed = [parse(s["observation"]) for s in steps if s["observation"]]
    if not observed:
        return ["result    none recorded"]
    last = observed[-1]
    summary = last.get("summary", "")
    if step_outcome(last) in CALL_ENDINGS:
        text = outcome_text(last)
    else:  # the gate's own ending of the step: a denial, a cut-off, a failure
        text = last.get("message") or policy_json(last.get("content", {}))
    text = text if isinstance(text, str) else policy_json(text)
    # A server may answer with the gate's own words (DENIED: ...): the record says whose.
    whose = "   (the server's answer)" if step_outcome(last) in ("ok", "error", "unrecorded") \
        and not last.get("withheld") else "   (the gate's own answer, not a server's)"
    return [f"result    {last['kind']}" + (f": {sanitize(summary)}" if summary else "") +
            whose] + [
        f"          {piece}" for line in text.split("\n")
        for piece in wrap_columns(sanitize(line), SHOW_WIDTH)]


def result_rows(index, observed):
    """A recorded result: a head line, then per block a row and its hash, whole (its identity)."""
    record = observed["result"]
    how = (", withheld: too large to pass on" if observed.get("withheld") else "") + (
        ", an error result" if record.get("is_error") else "")
    head = f"result of step {index}: {record['bytes']} bytes, sha256 {record['sha256']}{how}"
    rows = []
    for entry in record["blocks"]:
        digest = entry.get("sha256") or sha256_hex(entry["text"].encode("utf-8",
                                                                        "surrogatepass"))
        shown = quote(cut(entry["text"], 60)) if "text" in entry else sanitize(
            cut(entry.get("mimeType") or entry.get("uri") or "", 60))
        kept = " (first part kept)" if "text" in entry and "sha256" in entry else ""
        rows += [(f"  {sanitize(entry['type'])}", f"{block_bytes(entry)} bytes", shown + kept),
                 ("", "", f"sha256 {digest}")]
    structured = record.get("structured")
    if structured:
        rows += [("  structured content", f"{structured['bytes']} bytes",
                  "" if "value" in structured else "(not kept: too large)"),
                 ("", "", f"sha256 {structured['sha256']}")]
    if record.get("more_blocks"):
        rows.append((f"  and {record['more_blocks']} more blocks", "", ""))
    return head, rows


def approval_lines(approval, full=False, late=()):
    """approval_shown, marked where a value reads as it is not."""
    return approval_shown(approval, full, late, lookalike_notes)


def agreed_on(lines, shortened, what, verb, agreed, out,
              without_terminal):
    """confirmed: True for a yes, False for a no; Usage when nothing
    may be decided (`without_terminal` says why with no terminal)."""
    verdict = confirmed(lines, out, shortened, what, verb, agreed)
    if isinstance(verdict, str):
        raise Usage(verdict or without_terminal)
    return verdict


def lookalike_notes(*texts):
    """What in the texts reads as what it is not: words that mix
    scripts or are wholly lookalikes, and invisible characters."""
    notes = []
    for text in texts:
        notes += map(_lookalike_note, lookalike_words(text)[:3])
        hidden = [f"U+{code:04X} {unicodedata.name(chr(code), '')}"
                  for code in invisible_codes(text)[:5]]
        if hidden:
            notes.append("holds invisible characters: " +
                         ", ".join(h.rstrip() for h in hidden))
    return notes


def _lookalike_note(word):
    latin = latin_lookalike(word)
    if latin:
        script = scripts_of(word).pop()
        return (f"{quote(word)} reads as the Latin {quote(latin)} "
                f"but is written wholly in {script} letters")
    script = {ch: scripts_of(ch).pop() for ch in word if ch.isalpha()}
    usual = collections.Counter(script.values()).most_common(1)[0][0]
    foreign = [f"U+{ord(ch):04X} {unicodedata.name(ch, '?')}"
               for ch in script if script[ch] != usual]
    return (f"{quote(word)} mixes scripts: {', '.join(foreign[:3])} "
            f"among {usual} letters")


# ---- approve, reject, cancel ----------------------------------------------------------------

def refused_unasked(done, other, act):
    """Why nothing was `done` with neither a yes flag nor a terminal."""
    return (f"refusing without -yes or a terminal to type yes at: "
            f"nothing was {done}; add -yes{other} to {act} printed above")


def who(opts, verb="decides"):
    by = opts.by or current_user()
    if not by:
        raise Usage(f"say who {verb} with -by; the current user has "
                    f"no name")
    return by


def operator_decision(command, argv, *flags):
    """What approve, reject and cancel share: (flags, who decides,
    the store, the run named, the approval named or None)."""
    p = operator_parser(command, *flags, ("note", str), ("by", str))
    p.add_argument("run", type=text_argument, metavar="ID",
                   help=NAMED_RUN)
    opts = p.parse_args(argv)
    by = who(opts)
    store, session = operator_store(opts, readonly=False)
    named = getattr(opts, "approval", None)
    run_id, named = resolve_named(store, opts.run, session, named)
    return opts, by, store, run_id, named


def run_line(run):
    reason = f" ({run['reason']})" if run["reason"] else ""
    return f"run {run['run']}: {run['status']}{reason}"


def decide(argv, command):
    opts, by, store, run_id, named = operator_decision(
        command, argv, ("approval", str), ("yes", bool), ("full", bool))
    status = "approved" if command == "approve" else "rejected"
    note = opts.note or ""
    if status == "rejected" and not note:
        raise Usage("reject needs -note: the model is shown it, so say "
                    "why")
    approval = select_approval(store, run_id, named)
    lines, shortened = approval_printout(store, approval, opts.full,
                                          lookalike_notes)
    # With -json stdout carries the one JSON value.
    out = sys.stderr if opts.json else sys.stdout
    what = f"approval {approval['id']}"
    other = f" (or -approval {approval['id']})"
    unasked = refused_unasked("decided", other, f"{command} the approval")
    if not agreed_on(lines, shortened, what, command,
                     opts.approval or opts.yes, out, unasked):
        tell("nothing decided", out=out)
        return 1
    run, then = settle(store, approval, status, by, note, hold_of(opts))
    if opts.json:
        decided = {"id": approval["id"], "status": status, "by": by,
                   "note": note, "hash": approval["hash"]}
        tell_json({"run": run, "approval": decided})
    else:
        tell(f"{what}: {status} by {by}", run_line(run), *then)
    return 0


cmd_approve = functools.partial(decide, command="approve")
cmd_reject = functools.partial(decide, command="reject")


def cmd_cancel(argv):
    opts, by, store, run_id, _ = operator_decision("cancel", argv)
    status = load_run(store, run_id)["status"]
    if status in TERMINAL:
        raise StoreError(f"run {run_id} already ended ({status}); "
                         f"there is nothing to cancel")

    def cancel(tx):
        current = tx.run_holder(run_id)[0]
        if current in TERMINAL:
            raise StoreError(f"run {run_id} ended meanwhile ({current})")
        tx.cancel_run(run_id, by, opts.note or "")
    store.write(cancel)
    run = load_run(store, run_id)
    if opts.json:
        tell_json({"run": run})
    else:
        tell(run_line(run))
    return 0


def select_approval(store, run_id, approval_id):
    """The approval named, or the one its run waits on. One decided
    already is said so; nothing is decided in its place."""
    approvals = store.approvals(run_id)
    if approval_id:
        approval = next(a for a in approvals if a["id"] == approval_id)
        if approval["status"] != "pending":
            raise StoreError(f"approval {approval_id} was already "
                             f"{decision_text(approval)}; nothing was "
                             f"decided")
        return approval
    pending = [a for a in approvals if a["status"] == "pending"]
    if len(pending) > 1:
        ids = ", ".join(a["id"] for a in pending)
        raise StoreError(f"run {quote(run_id)} has {len(pending)} "
                         f"pending approvals; name one of {ids} with "
                         f"-approval")
    if pending:
        return pending[0]
    load_run(store, run_id)
    last = ""
    if approvals:
        last = (f": approval {approvals[-1]['id']} was already "
                f"{decision_text(approvals[-1])}")
    raise StoreError(f"run {quote(run_id)} has no pending approval"
                     f"{last}; nothing was decided")


def decision_text(approval):
    text = approval["status"]
    if approval["decided_by"]:
        text += f" by {sanitize(approval['decided_by'])}"
    if approval["decided_at"]:
        text += f" at {prose_time(approval['decided_at'])}"
    return text


def settle(store, approval, status, by, note, hold):
    """Decide the approval bound to the hash of the row shown (one
    expired, changed or decided since is refused); what_runs."""
    decided = store.write(lambda tx: tx.decide_approval(
        approval["id"], approval["hash"], status, by, note))
    if decided == "expired":
        raise StoreError(f"approval {approval['id']} expired at "
                         f"{approval['expires_at']}; it can no longer "
                         f"be decided, and its request was not "
                         f"executed")
    if decided == "changed":
        raise StoreError(f"approval {approval['id']} changed after it "
                         f"was shown, or was decided meanwhile; nothing "
                         f"was decided: look at it again as it is now")
    return what_runs(store, approval, status == "approved", hold)


# Seconds a held call may take to take up its approval, on a
# loaded machine.
HELD_SEEN = 20.0
TAKEN_UP = ("The call the model is waiting on took it up and runs it "
            "now: its result is that call's answer, and the model "
            "need not call again.")
APPROVED_NEXT = ("No call waits on it any more (its hold ended): it "
                 "runs when the model calls the tool again with "
                 "exactly the same arguments.")


def what_runs(store, approval, approved, hold):
    """The run as a decision left it, and what runs an approval: the
    call held for it (`hold` s) takes it up within moments, seen as
    its run leaving the wait; otherwise the model's identical call."""
    started = parse_time(approval["created_at"])
    ends = min(started + hold, time.time() + HELD_SEEN)
    run = load_run(store, approval["run_id"])
    if not approved:
        return run, ()
    while run["status"] == "WAITING_FOR_APPROVAL" and time.time() < ends:
        time.sleep(0.1)
        run = load_run(store, approval["run_id"])
    if run["status"] == "WAITING_FOR_APPROVAL":
        return run, (APPROVED_NEXT,)
    return run, (TAKEN_UP,)


def longest_hold(config):
    """The longest a gate of the config holds a call, in seconds."""
    return max([config.hold, *config.host_holds.values()]) / SECOND


def hold_of(opts):
    """longest_hold of the config given; 15 (the default's) with -db."""
    path = config_path(opts.config)
    if opts.db or not os.path.exists(path):
        return 15
    return longest_hold(load_config(path))


# ---- watch: what waits, live ----------------------------------------------------------------
# watch polls a read-only store, never the gate, so a serving gate
# never waits on it; it decides through settle, as approve does.

WATCH_EVERY = 1.0  # seconds between two reads of what waits
WATCH_KEYS = "up/down or j/k select   Enter open   q quit"
OPEN_KEYS = ("a approve   r reject   f show every byte   "
             "up/down, j/k, space scroll   q back")


def cmd_watch(argv):
    opts = parser("watch", "config", "db", "by").parse_args(argv)
    store, session = operator_store(opts, readonly=True)
    hint = operator_hint(config_path(opts.config), opts.db)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    try:
        if sys.stdin.isatty() and sys.stdout.isatty():
            by = who(opts)
            if watch_terminal(store, session, by, hold_of(opts), stop):
                return 0
            log("this terminal cannot show the live view; plain lines "
                "follow, and nothing is decided from them")
        watch_lines(store, session, hint, stop)
        return 0
    finally:
        store.close()


def waiting_cells(approval, limit):
    text = policy_json(parse(approval["request_json"])["args"])
    caution = "CAUTION " if lookalike_notes(text) else ""
    return (approval["id"], approval["run_id"],
            clean(approval["tool"], 64), time_since(approval["created_at"]),
            clean(caution + text, limit))


def ended_text(store, approval):
    row = store.approval(approval["id"]) or approval
    run = store.run(approval["run_id"])
    status = row["status"]
    if status == "pending":
        expired = row["expires_at"] and row["expires_at"] <= now()
        status = "expired" if expired else "no longer waited on"
    elif row["decided_by"]:
        status += f" by {clean(row['decided_by'], 64)}"
    if row["note"] and row["note"] != "expired":
        status += f": {clean(row['note'], 200)}"
    # An approved run waits on until it is called again.
    if run and run["status"] in TERMINAL:
        reason = f" ({run['reason']})" if run["reason"] else ""
        status += f"; run {run['status']}{reason}"
    return (f"run {approval['run_id']}  approval {approval['id']}  "
            f"tool {clean(approval['tool'], 64)}  {status}")


def watch_lines(store, session, hint, stop):
    """A line when an approval starts waiting (with the command that
    decides it), one when it stops; nothing is decided here."""
    shown = {}
    while not stop.is_set():
        waiting = {a["id"]: a for a in store.waiting_approvals(session)}
        for approval_id, approval in waiting.items():
            if approval_id in shown:
                continue
            _, run_id, tool, age, args = waiting_cells(approval, 200)
            tell(f"waiting  run {run_id}  approval {approval_id}  tool "
                 f"{tool}  age {age}  {args}  decide with: {hint} "
                 f"approve {run_id} -approval {approval_id}   "
                 f"(or reject)", flush=True)
        for approval_id, approval in shown.items():
            if approval_id not in waiting:
                ended = ended_text(store, approval)
                tell(f"ended    {ended}", flush=True)
        shown = waiting
        stop.wait(WATCH_EVERY)


def watch_terminal(store, session, by, hold, stop):
    """Run the live view; False if this terminal cannot show it."""
    try:
        import curses  # only here: nothing else pays for loading it
        import locale
    except ImportError:
        return False
    try:
        locale.setlocale(locale.LC_ALL, "")
        curses.setupterm()
        if not curses.tigetstr("cup"):  # cannot place the cursor
            return False
    except (locale.Error, curses.error):
        return False
    curses.wrapper(lambda window: watch_list(
        Screen(curses, window), store, session, by, hold, stop))
    return True


class Screen:
    """Where watch touches curses: sanitized rows, keys by name."""

    KEYS = {"KEY_UP": "up", "KEY_DOWN": "down",
            "KEY_NPAGE": "page down", "KEY_PPAGE": "page up",
            "KEY_ENTER": "enter", "KEY_BACKSPACE": "backspace"}
    CHARACTERS = {"\n": "enter", "\r": "enter", "\x1b": "esc",
                  "\x7f": "backspace", "\b": "backspace"}

    def __init__(self, curses, window):
        self.curses, self.window = curses, window
        self.codes = {getattr(curses, name): key
                      for name, key in self.KEYS.items()}
        try:
            curses.curs_set(0)
        except curses.error:
            pass
        if hasattr(curses, "set_escdelay"):
            curses.set_escdelay(25)
        window.timeout(int(WATCH_EVERY * 1000))

    def size(self):
        return self.window.getmaxyx()

    def begin(self):
        self.window.erase()

    def put(self, row, text, bold=False, reverse=False):
        height, width = self.window.getmaxyx()
        attr = (self.curses.A_BOLD if bold else 0) | (
            self.curses.A_REVERSE if reverse else 0)
        if 0 <= row < height and width > 1:
            try:
                self.window.move(row, 0)
                self.window.clrtoeol()
                self.window.addstr(row, 0, wrap_columns(
                    sanitize(text), width - 1)[0], attr)
            except self.curses.error:  # text reaching the last cell
                pass

    def key(self):
        """A character, a key's name, or None: time to refresh."""
        self.window.refresh()
        try:
            key = self.window.get_wch()
        except self.curses.error:
            return None
        if isinstance(key, int):
            return self.codes.get(key, "")
        return self.CHARACTERS.get(key, key)


def watch_list(screen, store, session, by, hold, stop):
    """What waits, read each second; the selection stays on its
    approval while others come and go."""
    selected, chosen, message = 0, None, ""
    while not stop.is_set():
        waiting = store.waiting_approvals(session)
        ids = [approval["id"] for approval in waiting]
        if chosen in ids:
            selected = ids.index(chosen)
        selected = max(0, min(selected, len(ids) - 1))
        height, width = screen.size()
        screen.begin()
        where = f"in session {session}" if session else "in every session"
        screen.put(0, f"agentgate watch: {len(waiting)} waiting for an "
                      f"operator {where}, deciding as {by}", bold=True)
        # Whole ids: they begin with the time they were made.
        table = [("APPROVAL", "RUN", "TOOL", "AGE", "ARGUMENTS")] + [
            waiting_cells(approval, 4 * width) for approval in waiting]
        widths = [max(len(row[i]) for row in table) for i in range(4)]
        lines = ["  ".join(cell.ljust(size) for cell, size in
                           zip(row, widths + [0])) for row in table]
        screen.put(1, lines[0])
        first = max(0, selected - (height - 5))
        shown = lines[1 + first:1 + first + max(0, height - 4)]
        for row, line in enumerate(shown):
            screen.put(2 + row, line, reverse=first + row == selected)
        if not waiting:
            screen.put(2, "nothing waits")
        screen.put(height - 2, message, bold=True)
        screen.put(height - 1, WATCH_KEYS)
        key = screen.key()
        if key in ("up", "k"):
            selected -= 1
        elif key in ("down", "j"):
            selected += 1
        elif key == "enter" and waiting:
            message = watch_approval(screen, store, ids[selected], by,
                                     hold, stop)
        elif key in ("q", "esc"):
            return
        if ids:
            chosen = ids[max(0, min(selected, len(ids) - 1))]


def watch_approval(screen, store, approval_id, by, hold, stop):
    """One approval as approve prints it, decided with a key: the
    line the list shows next."""
    approval = store.approval(approval_id)
    if approval is None or approval["status"] != "pending":
        return f"approval {approval_id} no longer waits"
    try:
        printouts = [approval_printout(store, approval, full,
                                       lookalike_notes)
                     for full in (False, True)]
    except StoreError as err:
        return str(err)
    full, top, seen_end, message = False, 0, False, ""
    while not stop.is_set():
        lines, shortened = printouts[full]
        height, width = screen.size()
        rows = [piece for line in lines
                for piece in wrap_columns(line, max(1, width - 1))]
        body = max(1, height - 2)
        top = max(0, min(top, len(rows) - body))
        seen_end = seen_end or top + body >= len(rows)
        screen.begin()
        for row, text in enumerate(rows[top:top + body]):
            screen.put(row, text)
        screen.put(height - 2, message, bold=True)
        screen.put(height - 1, OPEN_KEYS)
        key = screen.key()
        moves = {"up": -1, "k": -1, "down": 1, "j": 1, " ": body,
                 "page down": body, "page up": -body, "b": -body}
        why = unshown(shortened, "this approval", "decide", "press f")
        if key in moves:
            top += moves[key]
        elif key == "f":  # more rows: the end is to be reached again
            full, message, seen_end = True, "", False
        elif key in ("q", "esc"):
            return ""
        elif key in ("a", "r") and why:
            message = why
        elif key in ("a", "r") and not seen_end:
            message = "scroll to the end of the approval before you decide"
        elif key == "a":
            return watch_decide(store, approval, "approved", by, "", hold)
        elif key == "r":
            note = prompt(screen, "note for the model (required; Enter "
                                  "rejects, Esc cancels): ", stop)
            if note:
                return watch_decide(store, approval, "rejected", by,
                                    note, hold)
            message = "nothing decided"
    return ""


def watch_decide(store, approval, status, by, note, hold):
    try:
        writer = Ledger(store.path, readonly=False, create=False)
        try:
            then = settle(writer, approval, status, by, note, hold)[1]
        finally:
            writer.close()
    except StoreError as err:
        return str(err)
    return ". ".join((f"approval {approval['id']}: {status} by {by}",
                      *then))


def prompt(screen, question, stop):
    text = ""
    while not stop.is_set():
        height, width = screen.size()
        shown = question + sanitize(text) + "_"
        # The row shows a long answer's last columns.
        tail = wrap_columns(shown[::-1], max(1, width - 1))[0]
        screen.put(height - 1, tail[::-1])
        key = screen.key()
        if key == "enter" and text.strip():
            return text
        if key == "esc":
            return None
        if key == "backspace":
            text = text[:-1]
        elif key and len(key) == 1 and key.isprintable():
            text += key
    return None


def wrap_columns(text, width):
    """`text` in pieces of at most `width` terminal columns: a wide
    character takes two, a combining mark none."""
    pieces, piece, used = [], "", 0
    for ch in text:
        wide = unicodedata.east_asian_width(ch) in "WF"
        size = 0 if unicodedata.combining(ch) else 2 if wide else 1
        if used + size > width and piece:
            pieces.append(piece)
            piece, used = "", 0
        piece, used = piece + ch, used + size
    return pieces + [piece]


# ---- grant, grants, revoke ------------------------------------------------------------------

GRANT_PROMISE = ("A call this grant covers runs without asking while "
                 "it is in force. It never turns a deny into anything "
                 "else, never re-runs a call whose outcome is unknown, "
                 "and the tool's limits still count the calls it lets "
                 "through.")
GRANT_NEEDS_YES = refused_unasked("granted", "", "grant what is")


def cmd_grant(argv):
    p = parser("grant", "config", "if", "for", "note", "by",
               ("yes", bool), ("full", bool), ("json", bool))
    p.add_argument("tool", type=text_argument, metavar="TOOL",
                   help="the tool as the host is offered it (check "
                        "lists them)")
    opts = p.parse_args(argv)
    by = who(opts, "grants")
    config, tool = granted_tool(opts.config, opts.tool)
    parsed = grant_conditions(getattr(opts, "if"), tool)
    span = grant_span(getattr(opts, "for"), config)
    grant = {"id": new_id(8), "session": config.session,
             "tool": tool.target, "name": tool.name,
             "conditions_json": dumps(confirmed_conditions(parsed)),
             "by": by, "note": opts.note or ""}
    waits = covered_waits(config, tool, grant, opts.full)
    lines, shortened = grant_printout(config, tool, grant, parsed, span,
                                      waits, opts.full)
    out = sys.stderr if opts.json else sys.stdout
    if not agreed_on(lines, shortened, "this grant", "grant", opts.yes,
                     out, GRANT_NEEDS_YES):
        tell("nothing granted", out=out)
        return 1
    store = Ledger(config.database, readonly=False)  # may be new

    def create(tx):
        # It starts in the transaction that records it, so no call
        # decided before, nor recheck of one, finds it in force.
        grant["created_at"] = now()
        grant["expires_at"] = later(grant["created_at"], span)
        tx.create_grant(grant)
        return [(a, tx.decide_approval(
            a["id"], a["hash"], "approved", f"grant {grant['id']}",
            f"released by grant {grant['id']}, granted by {by}"))
            for a, _, _ in waits]
    released = store.write(create)
    told = [f"grant {grant['id']}: in force from {grant['created_at']} "
            f"until {grant['expires_at']}"]
    hold = longest_hold(config)
    for approval, decided in released:
        then = ["not released: it changed, was decided or expired "
                "after it was printed"]
        if decided == "decided":
            then = what_runs(store, approval, True, hold)[1]
        told.append(f"approval {approval['id']}: " + " ".join(then))
    if opts.json:
        ids = [a["id"] for a, decided in released if decided == "decided"]
        tell_json({**grant_view(grant), "released": ids})
    else:
        tell(*told)
    return 0


def grant_printout(config, tool, grant, parsed, span, waits, full):
    """(lines, shortened). No id: an id printed before a refusal
    would name a grant that does not exist."""
    covers = ", and whose arguments:" if parsed else \
        ", whatever their arguments"
    lines = ["GRANT (not created until confirmed)",
             f"  tool           {tool.name} (server {tool.server.name}, "
             f"upstream tool {tool.upstream_name})",
             f"  session        {config.session}",
             "  covers         calls that would wait for an operator" +
             covers]
    shortened = False
    for condition in parsed:
        text, _, cut_here = shown_text(condition.text(), full)
        lines.append(f"    {text}")
        shortened |= cut_here
    lines += [f"  in force       for {format_duration(span)} from when "
              f"it is confirmed", f"  by             {grant['by']}"]
    if grant["note"]:
        lines.append(f"  note           {grant['note']}")
    lines.append(f"  {GRANT_PROMISE}")
    if waits:
        lines.append(f"  releases       {len(waits)} calls waiting now, "
                     f"each approved by the grant as printed here:")
    else:
        lines.append("  releases       no call: none that waits now is "
                     "one it covers")
    for _, printed, cut_here in waits:
        lines += [f"    {line}" for line in printed]
        shortened |= cut_here
    return lines, shortened


def granted_tool(path, name):
    """(config, tool) a grant is for. Given no config where init
    wrote one per host, the one that offers the tool: a grant is for
    one host's session, so a tool several offer needs -config."""
    hosts = [] if path else host_configs(config_path(None))
    configs = map(load_config, hosts) if hosts else \
        [load_config(config_path(path))]
    offered = {}
    for config in configs:
        for tool_name, tool in configured_tools(config).items():
            offered.setdefault(tool_name, []).append((config, tool))
    if name not in offered:
        raise Usage(f"no configured tool is named {quote(name)}; the "
                    f"tools are {', '.join(sorted(offered)) or 'none'}")
    if len(offered[name]) > 1:
        paths = ", ".join(shlex.quote(c.path) for c, _ in offered[name])
        raise Usage(f"{quote(name)} is offered in {paths}; add -config "
                    f"naming the config of the host the grant is for")
    return offered[name][0]


def grant_conditions(text, tool):
    """-if as conditions, each on an argument of the pinned schema
    that the model sets."""
    try:
        conditions = parse(text or "{}")
    except CanonicalError as err:
        raise Usage(f"-if is not usable JSON ({err}); write it like "
                    f"'{{\"/amount\": {{\"max\": 20}}}}'") from None
    parsed = parse_conditions(conditions, "-if")
    entry = read_manifest(tool.server)["tools"].get(tool.upstream_name)
    schema = (entry or {}).get("input_schema") or {}
    hidden = set(tool.rule.deny) | set(tool.rule.fixed)
    for condition in parsed:
        problem = pointer_problem(schema, condition.tokens, hidden)
        if problem:
            raise Usage(f"-if points at {quote(condition.pointer)}, but "
                        f"{problem} in the pinned schema of {tool.name}")
    return parsed


def grant_span(text, config):
    try:
        span = parse_duration(text or "1h")
    except ValueError:
        raise Usage('-for is a duration such as "30m" or "8h"') from None
    most = config.grant_ttl
    if span > 0 and not (most and span > most):
        return span
    if most:
        raise Usage(f"-for must be more than 0 and at most grant_ttl "
                    f"({format_duration(most)})")
    raise Usage("-for must be more than 0")


def covered_waits(config, tool, grant, full):
    """The waits `grant` would answer, as (approval, its printout):
    each call decided again as the gate would, limits counted, and
    covered only if the grant is what allows it."""
    if not os.path.exists(config.database):
        return []
    store = Ledger(config.database, readonly=True, create=False)
    try:
        return [(approval, *approval_printout(store, approval, full,
                                              lookalike_notes))
                for approval in store.waiting_approvals(config.session)
                if _covers(store, config, tool, grant, approval)]
    finally:
        store.close()


def _covers(store, config, tool, grant, approval):
    capability = parse(approval["capability_json"])
    where = (capability.get("server"), capability.get("name"))
    if where != (tool.server.name, tool.name) or \
            approval["kind"] == "interrupted_side_effect":
        return False
    facts = decision_facts(store.read, config.session, tool, now(),
                           decided_client(store, approval), True)
    facts = facts._replace(grants=lambda: [Grant(grant)])
    args = parse(approval["request_json"])["args"]
    decision = policy_decision(config, tool, args, facts)
    return decision["outcome"] == "allow" and \
        decision.get("grant") == grant["id"]


def decided_client(store, approval):
    """The host's name as the policy's decision to ask recorded it."""
    step = next(s for s in store.steps(approval["run_id"])
                if s["id"] == approval["step_id"])
    record = parse(step["policy"]) if step["policy"] else {}
    return (record.get("facts") or {}).get("client", "")


def grant_view(grant):
    if grant.get("revoked_at"):
        state = (f"revoked at {grant['revoked_at']} by "
                 f"{grant['revoked_by']}")
    else:
        state = "in force" if grant["expires_at"] > now() else "expired"
    view = {k: grant.get(k, "") for k in GRANT_COLUMNS
            if k != "conditions_json"}
    conditions = parse(grant["conditions_json"])
    return {**view, "conditions": conditions, "state": state}


def cmd_grants(argv):
    opts = operator_parser("grants", ("days", int)).parse_args(argv)
    store, session = operator_store(opts, readonly=True)
    days = 7 if opts.days is None else opts.days
    since = format_time(time.time() - days * 86400)
    views = [grant_view(g) for g in store.grants(session, since)]
    if opts.json:
        tell_json(views)
        return 0
    if not views:
        tell(f"no grant in force or ended in the last {days} days")
        return 0
    table = [("GRANT", "TOOL", "UNTIL", "STATE", "BY", "COVERS")]
    for view in views:
        conditions = parse_conditions(view["conditions"], "grant",
                                      resolved=True)
        covers = " and ".join(c.text() for c in conditions)
        table.append((view["id"], sanitize(view["name"]),
                      view["expires_at"], view["state"],
                      sanitize(view["by"]),
                      cut(sanitize(covers or "every call"), 120)))
    print_table(table)
    return 0


def cmd_revoke(argv):
    p = operator_parser("revoke", ("note", str), ("by", str),
                        ("yes", bool))
    p.add_argument("grant", type=text_argument, metavar="GRANT",
                   help="the grant's id, or a prefix of it (6 "
                        "characters or more)")
    opts = p.parse_args(argv)
    by = who(opts, "revokes")
    store, _ = operator_store(opts, readonly=False)
    grant_id = resolve_id(store, "grant", opts.grant)
    grant = store.grant(grant_id)
    if grant is None:
        raise StoreError(f"there is no grant {quote(grant_id)}; "
                         f"`grants` lists them")
    state = grant_view(grant)["state"]
    if state != "in force":
        raise StoreError(f"grant {grant_id} is not in force ({state}); "
                         f"nothing changed")
    conditions = Grant(grant).conditions
    covers = " and ".join(c.text() for c in conditions) or "every call"
    lines = [f"GRANT TO REVOKE  {grant_id}",
             f"  tool           {grant['name']}",
             f"  covers         {covers}",
             f"  until          {grant['expires_at']}",
             f"  by             {grant['by']}"]
    out = sys.stderr if opts.json else sys.stdout
    # The grant named whole confirms, as approve -approval does.
    agreed = opts.yes or opts.grant == grant_id
    unasked = refused_unasked("revoked", " (or name the grant whole)",
                              "revoke the grant")
    if not agreed_on(lines, False, f"grant {grant_id}", "revoke",
                     agreed, out, unasked):
        tell("nothing revoked", out=out)
        return 1
    note = opts.note or ""
    if not store.write(lambda tx: tx.revoke_grant(grant_id, by, note)):
        raise StoreError(f"grant {grant_id} is not in force (it expired "
                         f"or was revoked); nothing changed")
    if opts.json:
        tell_json(grant_view(store.grant(grant_id)))
    else:
        tell(f"grant {grant_id}: revoked by {by}")
    return 0


VERIFY_PAGE = 128


def cmd_verify(argv):
    opts = operator_parser("verify", ("from", int), ("to", int), ("head", str)).parse_args(argv)
    first, last = getattr(opts, "from") or 1, opts.to
    if first < 1 or (last is not None and last < first):
        raise Usage("-from and -to must be sequence numbers with -from <= -to")
    kept = None
    if opts.head:
        match = re.fullmatch(r"(\d+):([0-9a-f]{64})", opts.head)
        if not match:
            raise Usage("-head must read SEQ:HASH, as verify printed it")
        kept = (int(match.group(1)), match.group(2))
    store, _ = operator_store(opts, readonly=True)
    report = verify_chain(store, first, last)
    head, broken = store.chain_head(), report["break"]
    short = last is not None and not broken and report["to"] < last
    held = None  # the kept head: matches, changed, or removed
    if kept:
        found = store.event_hash_at(kept[0])
        held = "removed" if found is None else "changed" if found != kept[1] or (
            broken and broken[0] <= kept[0]) else "matches"
    failed = bool(broken) or short or held not in (None, "matches")
    if opts.json:
        tell_json({"head": head and {"seq": head[0], "hash": head[1]}, "intact": not broken,
                   "checked": report["checked"], "from": report["from"], "to": report["to"],
                   "last_hash": report["hash"] if report["checked"] else None,
                   "break": broken and dict(zip(("seq", "detail", "expected", "found"), broken)),
                   "ends_before_to": short, "kept_head": kept and {"seq": kept[0], "is": held}})
        return 1 if failed else 0
    tell(f"head: seq {head[0]} {head[1]}" if head else "head: no events")
    if broken:
        seq, detail, expected, found = broken
        tell(f"broken at seq {seq}: {detail}")
        tell(f"  expected: {expected}")
        tell(f"  found:    {cut(sanitize(found), 128)}")
    else:
        tell(f"intact: {report['checked']} event(s)" + (
            f", seq {report['from']} to {report['to']}" if report["checked"] else ""))
        if report["checked"]:
            tell(f"last checked: seq {report['to']} {report['hash']}")
    if short:
        tell(f"the chain ends at seq {report['to']}, before -to {last}")
    if held:
        tell(f"kept head: seq {kept[0]} " + {
            "removed": "is not in the chain: events were removed",
            "changed": "does not match: the record was changed", "matches": "matches"}[held])
    return 1 if failed else 0


def verify_chain(store, first, last):
    """A range that does not start at 1 trusts the stored hash of the event before it."""
    prev_seq, prev_hash = first - 1, ""
    if first > 1:
        prev_hash = store.event_hash_at(first - 1) or ""
    report = {"from": first, "to": first - 1, "checked": 0, "hash": prev_hash, "break": None}
    while last is None or prev_seq < last:
        rows = store.events_after(prev_seq, last, VERIFY_PAGE)
        if not rows:
            break
        for seq, run_id, step_id, at, type_, payload, stored in rows:
            if seq != prev_seq + 1:
                detail = (f"the first event is seq {seq}" if prev_seq == 0 else
                          f"seq {seq} follows {prev_seq}: an event is missing")
                report["break"] = (seq, detail, f"seq {prev_seq + 1}", f"seq {seq}")
                report["to"] = seq
                return report
            expected = event_hash(prev_hash, seq, run_id, step_id, at, type_, payload)
            if expected != stored:
                report["break"] = (seq, "the stored hash is not the one the event's fields and "
                                        "the previous event's hash give", expected, stored)
                report["to"] = seq
                return report
            prev_seq, prev_hash = seq, stored
            report.update(to=seq, checked=report["checked"] + 1, hash=stored)
    return report


RECHECK_SCOPE = (
    "A re-check covers the gate's policy: the class map, each rule's outcome, fixed values and "
    "renames. It does not cover the rules before the policy (duplicates and the repeat window, "
    "max_pending, rejected or expired approvals, calls refused before the gate), nor, without "
    "-current-tools, any change to a tool's schema or denied parameters.")


def cmd_recheck(argv):
    opts = parser("recheck", "config", "run", "session", ("limit", int),
                  ("current-tools", bool), ("json", bool)).parse_args(argv)
    if opts.run and opts.session:
        raise Usage("give -run or -session, not both")
    limit = 50 if opts.limit is None else opts.limit
    if limit <= 0:
        raise Usage("-limit must be at least 1")
    hosts = [] if opts.config else host_configs(config_path(None))
    if hosts and opts.json and len(hosts) > 1:
        # -json prints one JSON value, so one config.
        raise Usage("recheck -json reads one config; add "
                    "-config naming one of " +
                    ", ".join(map(shlex.quote, hosts)))
    if hosts:
        return each_config(cmd_recheck, argv, hosts)
    config = load_config(config_path(opts.config))
    check_database_path(config.database)
    store = Ledger(config.database, readonly=True, create=False)
    upstreams = []
    try:
        if opts.current_tools:
            check_reach(config)
            upstreams, loaded, reports = load_all(config)
            log_reports(reports)
            tools = {tool.name: tool for tool in loaded}
        else:
            tools = configured_tools(config)
        session = opts.session or config.session
        if opts.run:
            opts.run = resolve_id(store, "run", opts.run, config.session)
            load_run(store, opts.run)
            run_ids = [opts.run]
        else:
            run_ids = store.session_runs(session, limit)
        reports = [recheck_run(store, config, tools, run_id, opts.current_tools)
                   for run_id in run_ids]
    finally:
        for upstream in upstreams:
            upstream.close()
    return print_recheck(config, reports, opts.json, session if not opts.run else "")


def configured_tools(config):
    """Tools as the configuration names and classifies them, without starting any server."""
    tools = {}
    for server in config.servers:
        for name, rule in server.rules.items():
            entry = {"name": name, "description": "", "input_schema": {"type": "object"}}
            tool = Tool(server, None, entry, rule)
            tools[tool.name] = tool
    return tools


def recheck_run(store, config, tools, run_id, current):
    run = load_run(store, run_id)
    policy_id = config.policy_id()
    evaluations, notes, recorded_ids, seen_steps = [], [], set(), set()
    steps = {step["id"]: step for step in store.steps(run_id)}
    for seq, step_id, recorded, at in store.policy_events(run_id):
        step = steps[step_id]
        on_resume = step_id in seen_steps
        seen_steps.add(step_id)
        decision = parse(step["decision"])
        evaluation = {"seq": seq, "step_index": step["index"], "step_id": step_id,
                      "tool": run["tool"], "on_resume": on_resume,
                      "recorded": recorded["outcome"], "rechecked": "", "detail": "",
                      "recorded_hash": "", "rechecked_hash": "",
                      "policy_id": recorded.get("policy_id", ""),
                      "spec_source": "current" if current else "recorded"}
        evaluations.append(evaluation)
        if not recorded.get("policy_id"):
            evaluation.update(result="not_a_policy_evaluation",
                              detail="a pause after an interruption, not a policy evaluation")
            continue
        recorded_ids.add(recorded["policy_id"])
        spec = store.tool_spec(step["spec_hash"])
        if spec is None or "args" not in decision:
            evaluation.update(result="not_recheckable", detail="the recorded request is missing")
            continue
        args = decision["args"]
        attempt = recorded.get("capability", {}).get("interrupted")
        request = {"run_id": run_id, "step_id": step_id, "spec": spec, "args": args}
        if recorded["outcome"] == "require_approval":
            evaluation["recorded_hash"] = approval_hash(
                recorded["kind"], recorded["capability"], recorded["presentation"], request)
        tool = tools.get(run["tool"])
        if tool is None:
            evaluation.update(result="different", rechecked="deny",
                              detail="the tool is not among the current tools")
            continue
        if current:
            request = {**request, "spec": tool.spec}
            problem = check_arguments(tool, args)
            if problem:
                evaluation.update(result="different", rechecked="invalid",
                                  detail=f"the arguments fail the current schema: {problem}")
                continue
        else:  # the defaults the policy reads come from the schema the decision was made under
            tool = Tool(tool.server, None, {"name": tool.upstream_name,
                                            "input_schema": spec["input_schema"]}, tool.rule)
        moment = recorded.get("facts") or {"at": at, "client": "", "approved": on_resume}
        # The facts of the moment it was made, the executions before it counted as the gate
        # counts them, unless an operator had decided it (then no limit counted it).
        facts = decision_facts(store.read, run["session"], tool, moment["at"],
                               moment.get("client", ""), not moment["approved"])
        now_decision = evaluate(config, tool, args, facts, attempt, approved=moment["approved"])
        evaluation["rechecked"] = now_decision["outcome"]
        same = now_decision["outcome"] == recorded["outcome"]
        if same and now_decision["outcome"] == "require_approval":
            evaluation["rechecked_hash"] = approval_hash(
                now_decision["kind"], now_decision["capability"], now_decision["presentation"],
                request)
            if evaluation["rechecked_hash"] != evaluation["recorded_hash"]:
                same = False
                evaluation["detail"] = ("asks for another approval: its capability, "
                                        "presentation, or tool spec changed")
        if not same and not evaluation["detail"]:
            evaluation["detail"] = now_decision["reason"]
        evaluation["result"] = "same" if same else "different"
    if len(recorded_ids) > 1:
        notes.append("the run's decisions were made under more than one policy identity")
    recorded_id = next(iter(recorded_ids)) if len(recorded_ids) == 1 else ""
    identity = ("unknown" if not recorded_id else
                "unchanged" if recorded_id == policy_id else "changed")
    differences = sum(e["result"] == "different" for e in evaluations)
    rechecked = sum(e["result"] in ("same", "different") for e in evaluations)
    return {"run_id": run_id, "run_status": run["status"], "policy_id": recorded_id,
            "identity": identity, "spec_source": "current" if current else "recorded",
            "notes": notes, "evaluations": evaluations, "same": differences == 0,
            "differences": differences, "rechecked": rechecked,
            "not_recheckable": len(evaluations) - rechecked, "complete": True}


def print_recheck(config, reports, as_json, session):
    """Differences first: each run where a decision differs or could not be re-checked, in
    full; runs where every decision is the same are counted per policy identity, unless there
    is one run (-json lists them all). One difference must not hide among fifty runs' lines."""
    policy_id = config.policy_id()
    rechecked = sum(r["rechecked"] for r in reports)
    skipped = sum(r["not_recheckable"] for r in reports)
    different = sum(r["differences"] for r in reports)
    differ = sum(not r["same"] for r in reports)
    if as_json:
        tell_json(reports)
    else:
        tell(f"{len(reports)} run(s) re-checked under {policy_id}: {rechecked} decision(s) "
             f"re-checked, {different} differ, {skipped} not re-checkable and skipped; "
             f"{differ} run(s) differ")
        same = collections.defaultdict(lambda: [0, 0])  # identity -> [runs, decisions]
        for r in reports:
            identity = {"unchanged": f'policy unchanged: "{policy_id}"',
                        "changed": f'policy changed: recorded "{r["policy_id"]}", given '
                                   f'"{policy_id}"',
                        "unknown": "policy identity unknown"}[r["identity"]]
            if r["same"] and not r["not_recheckable"] and not r["notes"] and len(reports) > 1:
                same[identity][0] += 1
                same[identity][1] += r["rechecked"]
                continue
            tell(f"run {r['run_id']} {r['run_status']}: {r['differences']} of {r['rechecked']} "
                 f"re-checked evaluations differ; {identity}; {r['spec_source']} specs")
            for e in sorted(r["evaluations"], key=lambda e: {"different": 0, "same": 2}.get(
                    e["result"], 1)):
                tell(cut(recheck_line(e), 240))
            for note in r["notes"]:
                tell(f"note: {note}")
        for identity, (runs, decisions) in same.items():
            tell(f"the same today: every decision of {runs} run(s) ({decisions} in all); "
                 f"{identity}")
        tell(RECHECK_SCOPE)
    if not reports:
        log(f'no run of session "{session}" was found, so nothing was re-checked')
        return 1
    if not rechecked:
        log(f"no decision of the policy was re-checked ({skipped} not re-checkable)")
        return 1
    return 1 if differ else 0


def recheck_line(e):
    mark = {"same": "same     ", "different": "DIFFERENT"}.get(e["result"], "skipped  ")
    where = f" step {e['step_index']} seq {e['seq']} {sanitize(e['tool'])}" + (
        " (on resume)" if e["on_resume"] else "")
    if e["result"] == "same":
        body = e["recorded"]
    elif e["result"] == "different":
        body = f"{e['recorded']} -> {e['rechecked'] or '?'}" + (
            f": {e['detail']}" if e["detail"] else "")
    else:
        body = e["detail"]
    return f"{mark}{where}: {sanitize(body)}"


# =============================================================================================
# 30. Setup
#
# Reads as: around the core
#
# Owns: `init`, which reads the MCP servers a person gave their hosts, writes a config for
# each host with its servers (one database for all), pins them and proposes a rule per tool
# from its own hints; the acceptance of those proposals; `login`, the OAuth authorization of
# a url server: the only command that opens a port (on 127.0.0.1, while it waits).
# Core it calls: Server, read_owned; section 21's load_config, check_reach, read_transport,
# shown_url and write_private; section 26's operator_hint; section 27's pin.
# Promises: a config is written 0600; run again, init adds the servers new in its host's file
# and changes no other byte; a secret in a server's env or headers goes into the config and into
# no output; a tool is offered only once its proposed rule was accepted; a project's servers
# are started only when -from names their file; a host's file is changed only with -write, from
# a backup kept beside it, only if it is as init read it, and only to replace the servers that
# were gated by the one entry that gates them.
# =============================================================================================

HOST_ENTRY_NAME = "gated"  # model-visible in some hosts' tool names: it names no program
HOST_FILE_BYTES = 64 << 20  # ~/.claude.json keeps a history and grows
SHARED_DATABASE = "agentgate.db"  # every host's config names it: limits, grants are one record

# Each host is gated on a config of its own, named for it, with its name as the session. A
# call held past the time its host waits is lost to the conversation, so each host's hold is
# proposed below that, keyed by the name it gives in initialize ("*": another host started on
# the same config). Claude Desktop gives a call about a minute whatever progress it is sent:
# 50s. Claude Code waits minutes: 10m. Cursor documents no limit; the TypeScript SDK's default
# is 60 s, reset by progress only where a host asks for that: 50s.
HOSTS = {"Claude Desktop": ("claude-desktop", {"claude-ai": "50s", "*": "15s"}),
         "Claude Code": ("claude-code", {"claude-code": "10m", "*": "15s"}),
         "Cursor": ("cursor", {"cursor-vscode": "50s", "*": "15s"})}


def host_config_files():
    home = os.path.expanduser("~")
    if sys.platform == "darwin":
        desktop = os.path.join(home, "Library", "Application Support", "Claude")
    elif sys.platform == "win32":
        desktop = os.path.join(os.environ.get("APPDATA", home), "Claude")
    else:
        desktop = os.path.join(os.environ.get("XDG_CONFIG_HOME") or
                               os.path.join(home, ".config"), "Claude")
    places = [("Claude Desktop", os.path.join(desktop, "claude_desktop_config.json"), False),
              ("Claude Code", os.path.join(home, ".claude.json"), False),
              ("Claude Code project", os.path.abspath(".mcp.json"), True),
              ("Cursor", os.path.join(home, ".cursor", "mcp.json"), False),
              ("Cursor project", os.path.abspath(os.path.join(".cursor", "mcp.json")), True)]
    seen, found = set(), []
    for host, path, project in places:
        if os.path.isfile(path) and os.path.realpath(path) not in seen:
            seen.add(os.path.realpath(path))
            found.append(HostFile(host, path, project=project))
    return found


class HostFile:
    """One host's configuration file and its maps of MCP servers (Claude Code keeps one per
    project beside the user's own; the current directory's is read too). A project's servers
    came with the directory, perhaps cloned a minute ago, and init would run them as it pins:
    they are listed, and started only when -from named the file (`named`)."""

    def __init__(self, host, path, project=False, named=False):
        self.host, self.path = host, os.path.abspath(path)
        self.data = self.read()  # as read: -write edits this, and nothing the host wrote since
        try:
            self.raw = parse(self.data)
        except CanonicalError as err:
            raise ConfigError(f"{host} configuration {path} is not usable JSON: "
                              f"{err.placed()}") from None
        if not isinstance(self.raw, dict):
            raise ConfigError(f"{host} configuration {path} is not a JSON object")
        # (where, servers, started): `where` names the map in what init prints, and keys its
        # servers, since the same name may be in the user's map and a project's. A project's
        # servers run in its directory, as the host runs them: `folders`, by `where`.
        self.maps, self.folders = [], {host: project_directory(self.path)}
        if isinstance(self.raw.get("mcpServers"), dict):
            self.maps.append((host, self.raw["mcpServers"], named or not project))
        projects = self.raw.get("projects", {})
        mine = projects.get(os.getcwd()) if isinstance(projects, dict) else None
        if isinstance(mine, dict) and isinstance(mine.get("mcpServers"), dict):
            where = f"{host} project {os.getcwd()}"
            self.maps.append((where, mine["mcpServers"], named))
            self.folders[where] = os.getcwd()

    def read(self):
        try:
            with open(self.path, "rb") as f:
                data = f.read(HOST_FILE_BYTES + 1)
        except OSError as err:
            raise ConfigError(f"{self.host} configuration {self.path} cannot be read: "
                              f"{err.strerror}") from None
        if len(data) > HOST_FILE_BYTES:
            raise ConfigError(f"{self.host} configuration {self.path} is larger than "
                              f"{HOST_FILE_BYTES >> 20} MiB; name a smaller file with -from")
        return data

    def servers(self):
        return [(where, name, entry, started) for where, servers, started in self.maps
                for name, entry in servers.items()]


# What a host passes its servers that reaching a network may need: init proposes the names
# set where it runs (never their values) as each command server's inherit_env.
NETWORK_VARIABLES = ("SSL_CERT_FILE", "SSL_CERT_DIR", "NODE_EXTRA_CA_CERTS",
                     "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "HTTPS_PROXY", "HTTP_PROXY",
                     "ALL_PROXY", "NO_PROXY", "https_proxy", "http_proxy", "all_proxy",
                     "no_proxy")


def project_directory(path):
    """The project whose `.mcp.json` or `.cursor/mcp.json` this is; None for the user's own."""
    folder, name = os.path.split(path)
    if name == "mcp.json" and os.path.basename(folder) == ".cursor":
        folder = os.path.dirname(folder)
    elif name != ".mcp.json":
        return None
    return None if folder == os.path.expanduser("~") else folder


def server_from_host(entry):
    """A host's server entry as agentgate's (without name, manifest or rules), or the reason
    it cannot be gated."""
    if not isinstance(entry, dict):
        return None, "its entry is not an object"
    if entry.get("disabled") is True:
        return None, "the host has it disabled"
    kind = entry.get("type") if isinstance(entry.get("type"), str) else ""
    if kind == "sse":
        return None, "it uses the older SSE transport, which agentgate does not speak"
    if isinstance(entry.get("url"), str):
        server = {"url": entry["url"]}
        headers = entry.get("headers") or {}
        if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
            return None, "its headers are not a map of names to strings"
        if headers:
            # A value written in the host's file moves into the 0600 config, as env does: a
            # variable made up for it would be set by nobody, and the host's gate would stop.
            server["headers"] = dict(headers)
        return server, ""
    command, args = entry.get("command"), entry.get("args", [])
    if not isinstance(command, str) or not command:
        return None, "it has neither a command nor a url"
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        return None, "its args are not a list of strings"
    if is_the_gate([command, *args]):
        return None, "it is agentgate itself"
    server = {"command": [command, *args]}
    env = entry.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        return None, "its env is not a map of names to strings"
    if env:
        server["env"] = [f"{k}={v}" for k, v in env.items()]
    if isinstance(entry.get("cwd"), str) and entry["cwd"]:
        server["cwd"] = entry["cwd"]
    return server, ""


def is_the_gate(argv):
    """Whether a host's command line starts agentgate serving (not, say, the demo's server)."""
    for i, part in enumerate(argv):
        if os.path.basename(part) in (f"{PROGRAM}.py", PROGRAM):
            rest = argv[i + 1:]
            return not rest or rest[0] == "serve" or rest[0].startswith("-")
    return False


def server_name(given, taken):
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", given).strip("-")[:60] or "server"
    unique, n = name, 1
    while unique in taken:
        n += 1
        unique = f"{name}-{n}"
    return unique


def proposed_rule(entry):
    """The rule a tool's own hints suggest, deciding nothing until accepted. A destructive tool
    is proposed to ask, not denied (the class's default): DENIED on every call teaches the
    model only to stop asking. An idempotent one is proposed no repeat window, so an ordinary
    repeat (the same write after a move) is not refused as a duplicate."""
    annotations = entry.get("annotations") or {}
    rule = {"side_effect": "remote_mutation"}
    if annotations.get("readOnlyHint") is True:
        rule["side_effect"] = "read_only"
    elif annotations.get("destructiveHint") is True:
        rule = {"side_effect": "destructive", "outcome": "require_approval"}
    if annotations.get("idempotentHint") is True and rule["side_effect"] != "read_only":
        rule["repeat_window"] = "0s"
    return {**rule, "proposed": True}


def config_text(raw):
    """A config as people read it: one line per rule, so a server's tools fit a screen."""
    return pretty_json(raw, flat=4) + "\n"


def cmd_init(argv):
    opts = parser("init", "from", "config", ("write", bool)).parse_args(argv)
    path = os.path.abspath(config_path(opts.config))
    if getattr(opts, "from"):
        plans = [(path, "default", None, [HostFile("host", getattr(opts, "from"), named=True)])]
    else:
        files = host_config_files()
        if not files:
            raise ConfigError("no host configuration was found (Claude Desktop, Claude Code, "
                              "Cursor); name one with -from FILE")
        plans = [(os.path.join(os.path.dirname(path), f"{name}.json"), name, hold,
                  [f for f in files if f.host.removesuffix(" project") == host])
                 for host, (name, hold) in HOSTS.items()]
        plans = [plan for plan in plans if plan[3]]
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    # A default config written now is what every command and gate given no -config reads.
    becomes_default = not os.path.lexists(path) and path == os.path.abspath(config_path(None))
    hosts = host_configs(path)
    for file in [file for plan in plans for file in plan[3]]:
        tell(f"read {file.host} configuration {file.path}: {len(file.servers())} server(s)")
    needs, done = set(), []
    for config_file, session, hold, files in plans:
        gated, left = init_host(config_file, session, hold, files, needs)
        for where, given, why in left:
            tell(f"not gated, left in {where} as it is: {given}: {why}")
        if os.path.lexists(config_file):
            done.append((config_file, files, gated))
    if needs:
        tell(f"To gate the rest, init needs {needs_text(needs)}; then run init again: it adds "
             f"them, and changes nothing else.")
    if not done:
        raise ConfigError("no server could be gated, so no config was written")
    if becomes_default and os.path.lexists(path):
        tell(f"{path} is the default config: a command or gate given no -config reads it now"
             + (f", and no longer each host's ({', '.join(map(os.path.basename, hosts))}): "
                f"name those with -config" if hosts else ""))
    # What is left to do, and only that: run again, init repeats none of what is done.
    proposing = [config_file for config_file, _, _ in done if any(
        rule.proposed for server in load_config(config_file).servers
        for rule in server.rules.values())]
    if proposing:
        tell("Every rule init proposed is a proposal, and nothing is offered until you have "
             "read them, changed what you disagree with, and run:")
    elif not any(gated for _, _, gated in done):
        tell("Nothing is left to do: every rule is accepted, and each host starts the gate.")
    for config_file in proposing:
        tell(f"    {operator_hint(config_file)} check -accept")
        try:
            check_reach(load_config(config_file))
        except ConfigError as err:
            tell(f"      before serving, fix this: {err}")
    entries = {config_file: {"command": python_path(),
                             "args": [os.path.abspath(sys.argv[0]), "-config", config_file]}
               for config_file, _, _ in done}
    changed = None
    if opts.write:
        edits = [(file, {(where, given) for where, given, _, _ in file.servers()
                         if (file.path, where, given) in gated}, entries[config_file])
                 for config_file, files, gated in done for file in files]
        edits = [edit for edit in edits if edit[1]]
        # The hosts may have written their files while the servers were pinned: a file changed
        # since init read it is left to its host. (A write between this reading and the rename
        # below is still lost: a window of one file's write, not of every pin.)
        changed = next((file for file, _, _ in edits if file.read() != file.data), None)
        if not changed:
            for file, taken, entry in edits:
                written, backup = replace_in_host(file, taken, entry)
                tell(f"wrote {written}; it was kept as {backup}")
            return 0
    for config_file, files, gated in done:
        sources = [f.path for f in files if any(key[0] == f.path for key in gated)]
        if not sources:
            tell(f"nothing of {' or '.join(f.path for f in files)} was gated, so it stays as "
                 f"it is")
            continue
        tell(f"Then replace the gated servers in {' and '.join(sources)} with "
             f"this one entry (or run init with -write to have it done, keeping a backup):")
        tell_json({"mcpServers": {HOST_ENTRY_NAME: entries[config_file]}})
        argv = shlex.join([entries[config_file]["command"], *entries[config_file]["args"]])
        if any(f.host.startswith("Claude Code") for f in files):
            tell(f"    or: claude mcp add -s user {HOST_ENTRY_NAME} -- {argv}")
        if any(map(project_directory, sources)):
            tell(f"    A project's file may be shared, and this entry names files of your own: "
                 f"keep it out of a commit (claude mcp add -s local {HOST_ENTRY_NAME} -- "
                 f"{argv} keeps it to you in Claude Code)")
    if changed:
        raise ConfigError(f"{changed.host} configuration {changed.path} changed while init "
                          f"ran, so no host's file was edited: put the entry above in by hand")
    return 0


def init_host(path, session, hold, files, needs):
    """Gate the servers of one host's `files` in the config at `path`: a new config, or the
    servers new since added as proposals, every other byte as it was (a person's edits are
    theirs). What a server needs first goes to `needs`, asked for once. Returns (gated: (file,
    map, name) -> the server that gates it, left: (map, name, why) of each left in its host)."""
    text = read_owned(path, "config").decode("utf-8") if os.path.lexists(path) else ""
    try:
        existing = parse(text)["servers"] if text else []
    except (CanonicalError, KeyError, TypeError):
        raise ConfigError(f"config {path} has no list of servers that init can add to; fix "
                          f"it, or name another with -config") from None
    known = [definition(s) for s in existing if isinstance(s, dict)]
    taken = {s.get("name") for s in existing if isinstance(s, dict)}
    servers, gated, left = [], {}, []
    for file in files:
        for where, given, entry, started in file.servers():
            server, why = server_from_host(entry)
            if not started:
                left.append((where, given, project_server_text(file, server, why)))
                continue
            if server is None:
                left.append((where, given, why))
                continue
            if file.folders.get(where) and "command" in server:
                server["cwd"] = os.path.normpath(os.path.join(file.folders[where],
                                                              server.get("cwd", ".")))
            inherited = [name for name in NETWORK_VARIABLES if name in os.environ]
            if inherited and "command" in server:
                server["inherit_env"] = inherited
            same = next((s for s in servers if definition(s) == definition(server)), None)
            if same or definition(server) in known:  # the same server twice is gated once
                gated[(file.path, where, given)] = same or server
                continue
            missing = needs_of(server)
            if missing:
                needs.update(missing)
                left.append((where, given, f"it needs {needs_text(missing)} first"))
                continue
            name = server_name(given, taken)
            server.update(name=name, manifest=f"{session}.{name}.manifest.json")
            try:
                Server(server, f"server {quote(name)}", path, read_transport)
            except ConfigError as err:
                left.append((where, given, str(err)))
                continue
            taken.add(name)
            servers.append(server)
            gated[(file.path, where, given)] = server
    pinned = []
    for server in servers:
        if server.get("command") and os.path.basename(server["command"][0]) == "npx" and \
                {"-y", "--yes"} & set(server["command"]):
            tell(f"server {server['name']}: npx may download its package before the server "
                 f"starts, which can take a minute", flush=True)
        try:
            manifest = pin(Server(server, f"server {quote(server['name'])}", path,
                                  read_transport))
        except (UpstreamError, LoadError, ConfigError) as err:
            if LOGIN_NEEDED in str(err):  # written, so login finds it; served once pinned
                server["rules"] = {}
                pinned.append((server, None))
                continue
            for key in [key for key, gating in gated.items() if gating is server]:
                gated.pop(key)
                left.append((*key[1:], f"it could not be pinned: {err}"))
            continue
        server["rules"] = {tool: proposed_rule(entry) for tool, entry in
                           manifest["tools"].items()}
        pinned.append((server, manifest))
    if not pinned:
        if text:
            tell(f"{path}: no server is new in {' or '.join(f.path for f in files)}; nothing "
                 f"was added")
        return gated, left
    added = [server for server, _ in pinned]
    if text:
        write_private(path, servers_appended(text, added))
    else:
        raw = {"database": SHARED_DATABASE, "session": session, "servers": added}
        if hold:
            raw["hold"] = hold
        write_private(path, config_text(raw))
    policy = {**DEFAULT_POLICY, **(parse(text).get("policy") or {} if text else {})}
    for server, manifest in pinned:
        if manifest is None:
            tell(f"server {server['name']} asks for OAuth; it is not served until you run: "
                 f"{operator_hint(path)} login {server['name']}, then pin, and classify its "
                 f"tools")
            continue
        tell(f"server {server['name']}: {len(manifest['tools'])} tool(s) pinned; proposed "
             f"from the server's own hints (class, then what the policy would decide):")
        for tool, entry in manifest["tools"].items():
            rule = server["rules"][tool]
            decided = rule.get("outcome") or policy[rule["side_effect"]]
            tell(f"  {sanitize(tool):<28} {rule['side_effect']:<16} {decided:<17} "
                 f"({hints_text(entry)})")
    tell(f"{'added to' if text else 'wrote'} {path} (0600): "
         f"{', '.join(server['name'] for server in added)}")
    inheriting = [server for server in added if "inherit_env" in server]
    if inheriting:
        tell(f"  {', '.join(s['name'] for s in inheriting)} inherit "
             f"{', '.join(inheriting[0]['inherit_env'])} from the gate's environment, as "
             f"the host passes them (inherit_env)")
    return gated, left


def definition(server):
    """What makes a server the one it is, as a host's entry gives it (not its name)."""
    return {k: server[k] for k in ("command", "url", "headers", "env", "cwd") if k in server}


def needs_of(server):
    """What a url server needs before init can pin it, asked for once for every server."""
    needs = {("variable", name) for value in server.get("headers", {}).values()
             for name in ENV_REFERENCE_RE.findall(value) if name not in os.environ}
    return needs


def needs_text(needs):
    variables = sorted(name for _, name in needs)
    return (f"the environment variable{'s' * (len(variables) > 1)} {', '.join(variables)} set "
            f"where agentgate runs")


def servers_appended(text, servers):
    """A config's text with `servers` added at the end of its list of servers, and every other
    byte as it was. The text was parsed through the boundary check already."""
    decoder, space = json.JSONDecoder(), re.compile(r"\s*")
    at = space.match(text, text.index("{") + 1).end()
    while True:
        key, at = json.decoder.scanstring(text, at + 1)
        at = space.match(text, space.match(text, at).end() + 1).end()  # past ':'
        _, end = decoder.raw_decode(text, at)
        if key == "servers":
            break
        at = space.match(text, space.match(text, end).end() + 1).end()  # past ','
    last = len(text[:end - 1].rstrip())  # the end of the list's last server
    added = "".join(",\n    " + pretty_json(server, level=2, flat=4) for server in servers)
    return text[:last] + added + text[last:]


def host_configs(default):
    """The configs init wrote, one per host, beside the default config when there is none:
    a command given no -config then works on each of them."""
    directory = os.path.dirname(os.path.abspath(default))
    paths = [os.path.join(directory, f"{name}.json") for name, _ in HOSTS.values()]
    return [] if os.path.lexists(default) else [p for p in paths if os.path.lexists(p)]


def one_config(given):
    """The config a command that needs exactly one reads; where there are only init's, one
    per host, the error names them."""
    path = config_path(given)
    hosts = [] if given else host_configs(path)
    if hosts:
        raise ConfigError(f"there is no {path}, and init wrote one config per host: name "
                          f"one with -config ({', '.join(map(shlex.quote, hosts))}); the "
                          f"entry init printed for a host names its own")
    return load_config(path)


def each_config(command, argv, paths):
    status = 0
    for path in paths:
        tell(f"== {path}", flush=True)
        try:
            status = max(status, command([*argv, "-config", path]))
        except (ConfigError, LoadError, StoreError, UpstreamError) as err:
            sys.stdout.flush()
            tell(f"{PROGRAM}: error: {err}", out=sys.stderr)
            status = 1
    return status


def project_server_text(file, server, why):
    if server is None:
        runs = why
    elif "url" in server:
        runs = f"it would be reached at {shown_url(server['url'])}"
    else:
        runs = f"it would run {shlex.join(server['command'])}"
    return (f"a project's server is started only when init is given -from "
            f"{shlex.quote(file.path)}; {runs}")


def replace_in_host(file, taken, entry):
    """Replace the servers `taken` ((map, name) pairs) in a host's file by the one entry that
    gates them, once a backup as read is kept beside it (beside the link, if it is one). A
    link is written where it leads, so it stays. Returns the path written and the backup's."""
    backup = f"{file.path}.agentgate-backup"
    n = 1
    while os.path.lexists(backup):
        n += 1
        backup = f"{file.path}.agentgate-backup-{n}"
    write_private(backup, file.data.decode("utf-8", "surrogateescape"))
    for where, servers, _ in file.maps:
        for given in [given for place, given in taken if place == where]:
            servers.pop(given)
    target = file.maps[0][1] if file.maps else file.raw.setdefault("mcpServers", {})
    if entry not in target.values():  # init run again: the entry is there already
        target[server_name(HOST_ENTRY_NAME, set(target))] = entry
    written = os.path.realpath(file.path)
    mode = stat.S_IMODE(os.stat(written).st_mode)
    write_private(written, pretty_json(file.raw, ordered=True) + "\n")
    os.chmod(written, mode)
    return written, backup


def accept_proposals(path, agreed):
    """Accept the proposed rules once the operator has read each and typed yes (or -yes);
    False when nothing was accepted for want of it."""
    config = load_config(path)  # a config that would not load is refused as it is, unchanged
    raw = parse(read_owned(path, "config"))
    accepted = []
    for server, given in zip(config.servers, raw["servers"]):
        for tool, rule in given.get("rules", {}).items():
            if rule.pop("proposed", False):
                accepted.append(f"  {server.name}/{tool} ({rule['side_effect']}): would "
                                f"{settings_text(config, server.rules[tool])}")
    if not accepted:
        tell("no proposed rule to accept")
        return True
    what = f"these {len(accepted)} proposed rule(s)"
    head = f"{what}, each as it would decide once accepted:"
    if not agreed_on(
            [head, *accepted], False, what, "accept", agreed,
            sys.stdout,
            "refusing to accept without -yes or a terminal "
            "to type yes at: nothing was accepted; add -yes "
            "to accept the rules printed above"):
        tell("nothing accepted")
        return False
    write_private(path, config_text(raw))
    tell(f"accepted {len(accepted)} proposed rule(s)")
    return True


# ---- login: OAuth with a url server ---------------------------------------------------------

LOGIN_WAIT_SECONDS = 600  # how long a person has to consent in the browser
LOGIN_PAGE = b"agentgate has the answer of the authorization; this page may be closed.\n"


@functools.lru_cache(maxsize=1)
def mcp_install_text():
    if python_path() != sys.executable:
        return f"{VENV}/bin/python has it: run agentgate with that"
    made = "" if os.path.isdir(os.path.expanduser(VENV)) else f"python3 -m venv {VENV} && "
    return (f"{python_command()} -m pip install --upgrade mcp, or where pip refuses to install "
            f"into the system's Python: {made}{VENV}/bin/pip install mcp, and run agentgate "
            f"with {VENV}/bin/python")


def mcp_sdk(server):
    """The optional mcp package's OAuth client and its pieces, imported by login only, or
    ConfigError saying how to install it (version 2 or later: built on httpx2)."""
    try:
        import mcp.client.streamable_http as transport
        import mcp.client.session as session
        import mcp.client.auth as auth
        import mcp.shared.auth as records
        import httpx2
        import asyncio
        import logging
    except ImportError:
        raise ConfigError(f"login with server {quote(server.name)} needs the optional mcp "
                          f"package, version 2 or later: "
                          f"{mcp_install_text()}") from None
    # The SDK reports what it survives through logging, which would print tracebacks.
    for name in ("mcp", "httpx2"):
        logging.getLogger(name).addHandler(logging.NullHandler())
        logging.getLogger(name).propagate = False
    return {"client": transport.streamable_http_client, "session": session.ClientSession,
            "auth": auth, "records": records, "httpx": httpx2, "asyncio": asyncio}


OAUTH_EXCHANGES = 20  # requests one OAuth flow may make (discovery tries several addresses)


class LoginStore:
    """The mcp package's token storage while login runs: what the flow obtains, for the
    TokenFile to keep once it ends. A pre-registered client (the server's `oauth`) is given."""

    def __init__(self, sdk, file):
        self.tokens = self.client = None
        if file.server.oauth.get("client_id"):
            self.client = sdk["records"].OAuthClientInformationFull(**file.client())

    async def get_tokens(self):
        return self.tokens

    async def set_tokens(self, tokens):
        self.tokens = tokens

    async def get_client_info(self):
        return self.client

    async def set_client_info(self, client):
        self.client = client


def cmd_login(argv):
    p = parser("login", "config")
    p.description = ("Authorize agentgate with a url server that asks for OAuth: the browser "
                     "opens on the server's consent page (the address is printed too), the "
                     "answer comes back to a port on 127.0.0.1 open only while this runs, and "
                     "the tokens are kept 0600 beside the config (-config FILE, else "
                     "$AGENTGATE_CONFIG, else the XDG path), as CONFIG.SERVER.tokens.json, "
                     "for that config's server at that url only.")
    p.add_argument("server", type=text_argument, help="the server's name in the config")
    opts = p.parse_args(argv)
    config = one_config(opts.config)
    server = next((s for s in config.servers if s.name == opts.server), None)
    if server is None or not server.url:
        names = ", ".join(s.name for s in config.servers if s.url) or "none"
        raise Usage(f"{quote(opts.server)} names no server reached by url in the config; those "
                    f"are: {sanitize(names)}")
    sdk = mcp_sdk(server)
    try:
        wanted = TokenFile(server).kept.get("wanted_scope")
    except ConfigError:
        wanted = ""  # what cannot be read is replaced
    file = TokenFile(server, fresh=True)
    store = LoginStore(sdk, file)
    with LoopbackRedirect() as redirect:

        async def ask(url):
            url = _with_scope(url, server.oauth.get("scope"), wanted)
            tell(f"Open this address to authorize agentgate with server {server.name} (a "
                 f"browser is being opened on it):", f"  {url}", flush=True)
            await sdk["asyncio"].to_thread(_open_browser, url)

        async def redirected():
            return await sdk["asyncio"].to_thread(redirect.answer, sdk)

        metadata = sdk["records"].OAuthClientMetadata(client_name=PROGRAM,
                                                      redirect_uris=[redirect.uri])
        client = sdk["auth"].OAuthClientProvider(server.url, metadata, store, ask, redirected)
        try:
            sdk["asyncio"].run(_initialize_with(sdk, server, client))
        except BaseException as err:
            while isinstance(err, BaseExceptionGroup):  # the SDK's task groups wrap it
                err = err.exceptions[0]
            if isinstance(err, (KeyboardInterrupt, Usage, UpstreamError)):
                raise err from None
            raise UpstreamError(f"login with server {quote(server.name)} failed: "
                                f"{clean(str(err), 500) or type(err).__name__}") from None
    if store.tokens is None:
        tell(f"server {server.name} asked for no authorization; nothing was kept")
        return 0
    keep_discovered(file, client.context, store.client)
    file.obtained(store.tokens.model_dump(mode="json", exclude_none=True))
    tell(f"agentgate is authorized with server {server.name}; its tokens are kept in "
         f"{server.tokens} (0600), and refreshed as they expire")
    return 0


def keep_discovered(file, context, client):
    """Where the tokens are refreshed, as the flow found it: the authorization server's
    metadata, else (a server of protocol 2025-03-26) its own origin's /token, as used."""
    from urllib.parse import urljoin
    metadata, origin = context.oauth_metadata, context.get_authorization_base_url(file.server.url)
    file.kept["issuer"] = str(metadata.issuer) if metadata else origin
    file.kept["token_endpoint"] = str(metadata.token_endpoint) if metadata and \
        metadata.token_endpoint else urljoin(origin, "/token")
    if context.should_include_resource_param(context.protocol_version):
        file.kept["resource"] = context.get_resource_url()
    if client:
        file.kept["client"] = client.model_dump(mode="json", exclude_none=True)


async def _initialize_with(sdk, server, client):
    """Initialize a session through the OAuth client, which asks for consent on the server's
    first 401; what it obtains is kept by its storage."""
    httpx = sdk["httpx"]
    async with httpx.AsyncClient(auth=client, headers=server.headers,
                                 max_redirects=OAUTH_EXCHANGES,
                                 timeout=httpx.Timeout(server.connect_timeout / SECOND)) as http, \
            sdk["client"](server.url, http_client=http) as (reader, writer), \
            sdk["session"](reader, writer) as session:
        await session.initialize()
        # Some servers let initialize through and ask for authorization on the next request.
        await session.list_tools()


def _with_scope(url, configured, wanted):
    """The authorization address asking for the operator's `oauth.scope` in place of the one
    the client chose from the server's metadata (a pre-registered client knows its scope),
    and for what the server refused a call for since the last login (a step-up)."""
    if not configured and not wanted:
        return url
    from urllib.parse import urlsplit, urlunsplit, parse_qsl, urlencode
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    chosen = configured or " ".join(v for k, v in query if k == "scope")
    query = [(k, v) for k, v in query if k != "scope"]
    query.append(("scope", union_scope(chosen, wanted)))
    return urlunsplit(parts._replace(query=urlencode(query)))


def _open_browser(url):
    import webbrowser  # honours $BROWSER
    try:
        webbrowser.open(url)
    except Exception:
        pass  # the address is printed: a person can open it by hand


class LoopbackRedirect:
    """A port on 127.0.0.1, open only while login runs, where the browser brings the answer
    of the authorization (RFC 8252's loopback redirect). Nothing it receives is printed."""

    def __init__(self):
        import http.server
        answers = self.answers = queue.Queue()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                from urllib.parse import urlsplit, parse_qs
                parts = urlsplit(self.path)
                if parts.path != "/callback":
                    self.send_error(404)
                    return
                answers.put({k: v[0] for k, v in parse_qs(parts.query).items()})
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(LOGIN_PAGE)))
                self.end_headers()
                self.wfile.write(LOGIN_PAGE)

            def log_message(self, *args):
                pass  # the query carries the code

        # One thread a connection: an idle local connection holds nobody up.
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}/callback"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def answer(self, sdk):
        try:
            got = self.answers.get(timeout=LOGIN_WAIT_SECONDS)
        except queue.Empty:
            raise UpstreamError(f"no answer came from the browser within "
                                f"{format_duration(LOGIN_WAIT_SECONDS * SECOND)}") from None
        if "error" in got:
            raise UpstreamError(f"the authorization was refused: {clean(got['error'], 100)}"
                                + (f" ({clean(got['error_description'], 300)})"
                                   if "error_description" in got else ""))
        return sdk["auth"].AuthorizationCodeResult(code=got.get("code", ""),
                                                   state=got.get("state"), iss=got.get("iss"))


# =============================================================================================
# 31. Pin and check
#
# Reads as: around the core
#
# Owns: `pin`, `pin -diff` and `check`: what a server presents now
# against its pin, and each server's and tool's standing.
# Core it calls: check_database_path, Store, lint_hash, confirmed;
# section 29's agreed_on; section 21's load_config, check_reach, load_all,
# read_manifest, write_private; lint_lines (20), tool_changes (23).
# Promises: pin prints the texts a tool is classified from whole;
# pin -diff changes a manifest only after a yes; check exits 1 while
# anything is refused, unreviewed or unserved.
# =============================================================================================

def cmd_pin(argv):
    p = parser("pin", "config", ("diff", bool), ("all", bool),
               ("yes", bool))
    p.add_argument("-tool", "--tool", action="append", type=text_argument,
                   default=[], metavar=FLAG_VALUE["tool"],
                   help=FLAG_HELP["pin -tool"])
    opts = p.parse_args(argv)
    hosts = [] if opts.config else host_configs(config_path(None))
    if hosts:
        return each_config(cmd_pin, argv, hosts)
    config = load_config(config_path(opts.config))
    if opts.diff:
        return pin_diff(config, opts.tool, opts.all, opts.yes)
    if opts.tool or opts.all:
        raise Usage("-tool and -all choose what pin -diff pins again; "
                    "give -diff too")
    manifests = {}
    for server in config.servers:
        try:
            manifests[server.name] = pin(server)
        except UpstreamError as err:
            raise LoadError(str(err)) from None
    findings = lint_manifests(manifests)
    lines = []
    for server in config.servers:
        tools = manifests[server.name]["tools"]
        lines.append(f"server {server.name}: {len(tools)} tools pinned in "
                     f"{server.manifest}, with the server's own hints, "
                     f"which classify nothing:")
        for name, entry in tools.items():
            lines += pinned_lines(name, entry, findings[server.name][name])
    lines.append("Classify each tool you want offered with a rule "
                 "(side_effect), then run check. The lint finds the "
                 "tricks known to hide instructions in a tool's texts, "
                 "not all of them.")
    confirmed(lines, sys.stdout)
    return 0


def pinned_lines(name, entry, found):
    """A tool as it is classified: its description whole (the model
    reads all of it), and what the lint found."""
    description = " ".join(entry["description"].split())
    lines = [f"  {sanitize(name):<28} {hints_text(entry):<26} "
             f"{description}"]
    lines += [f"  {line}" for line in lint_lines(found)]
    if any(severity == LINT_HIGH for severity, _, _ in found):
        lines.append(f"    the whole text the model would read of {name} "
                     f"(accepted_description {lint_hash(entry)}):")
        lines += [f"      {where}: {text}"
                  for where, text in lint_texts(entry)]
    return lines


def pin_diff(config, named, everything, agreed):
    """Print each server's differences from its pin; pin again those
    named (server/tool, or tool), or all once confirmed. A serving
    gate keeps what it loaded: nothing changes under a call."""
    manifests, lives = {}, {}
    for server in config.servers:
        manifests[server.name] = read_manifest(server)
        try:
            lives[server.name] = presented(server)
        except UpstreamError as err:
            raise LoadError(str(err)) from None
    findings = lint_manifests({name: {"tools": live}
                               for name, live in lives.items()})
    differences, lines = {}, []
    for server in config.servers:
        changes = tool_changes(manifests[server.name]["tools"],
                               lives[server.name])
        differ = f"{len(changes)} tool(s) differ from {server.manifest}"
        lines.append(f"server {server.name}: " +
                     (differ if changes else "as pinned"))
        for tool, (kind, old, new) in changes.items():
            differences[(server.name, tool)] = (kind, new)
            lines += change_text(kind, tool, old, new,
                                 findings[server.name].get(tool))
    chosen = set(differences) if everything else set()
    chosen |= {chosen_difference(differences, given) for given in named}
    if not (everything and chosen):
        confirmed(lines, sys.stdout)
    elif not agreed_on(lines, False, "every difference above", "pin",
                       agreed, sys.stdout, "refusing to pin every "
                       "difference again without -yes or an interactive "
                       "terminal"):
        tell("nothing pinned")
        return 1
    if not chosen:
        return 0
    for server in config.servers:
        mine = sorted(tool for name, tool in chosen if name == server.name)
        if mine:
            pin_again(server, manifests[server.name], mine, [
                differences[(server.name, tool)] for tool in mine])
    tell("A gate that is serving keeps the tools it loaded; restart it "
         "(restart its host) to offer what was pinned again, after "
         "check.")
    return 0


def change_text(kind, tool, old, new, found):
    lines = [f"  {kind} {tool}" + (f" ({hints_text(new)})" if new else "")]
    if kind == "added":
        lines.append(f"    description: {new['description']}")
    elif kind == "changed":
        lines += [f"    {line}" for line in change_lines(old, new)]
    if new:
        lines += [f"  {line}" for line in lint_lines(found)]
    return lines


def chosen_difference(differences, given):
    """The one difference -tool names."""
    server, _, tool = given.rpartition("/")
    matches = [key for key in differences
               if key[1] == tool and server in ("", key[0])]
    if len(matches) == 1:
        return matches[0]
    listed = ", ".join(f"{s}/{t}" for s, t in differences) or "none"
    how_many = "no" if not matches else "more than one"
    raise Usage(f"-tool {quote(given)} names {how_many} difference; the "
                f"differences are: {sanitize(listed)}")


def pin_again(server, manifest, tools, changes):
    for tool, (kind, new) in zip(tools, changes):
        if kind == "removed":
            del manifest["tools"][tool]
        else:
            manifest["tools"][tool] = new
    manifest["pinned_at"] = now()
    write_private(server.manifest, pretty_json(manifest) + "\n")
    tell(f"pinned again in {server.manifest}: {', '.join(tools)}")


def serving_config(path):
    config = one_config(path)
    check_database_path(config.database)
    check_reach(config)
    return config


def cmd_check(argv):
    opts = parser("check", "config", ("accept", bool),
                  ("yes", bool)).parse_args(argv)
    hosts = [] if opts.config else host_configs(config_path(None))
    if hosts:
        return each_config(cmd_check, argv, hosts)
    if opts.yes and not opts.accept:
        raise Usage("-yes goes with -accept: it accepts the proposed "
                    "rules unasked")
    path = os.path.abspath(config_path(opts.config))
    if opts.accept and not accept_proposals(path, opts.yes):
        return 1
    config = serving_config(opts.config)
    upstreams, tools, reports = load_all(config)
    for upstream in upstreams:
        upstream.close()
    for server, report in zip(config.servers, reports):
        tell(*served_lines(config, server, report, tools))
    if os.path.exists(config.database):
        print_tool_changes(Ledger(config.database, readonly=True,
                                  create=False), config.session)
    holds = "".join(f", {sanitize(h)} {format_duration(t)}"
                    for h, t in config.host_holds.items())
    notify = shlex.join(config.notify) if config.notify else \
        "nothing is run"
    tell(f"hold: a call that asks waits {format_duration(config.hold)} "
         f"for your decision before the model is answered{holds}",
         f"notify: {notify}", f"status tool: {config.status_tool}",
         f"session: {config.session}", f"database: {config.database}")
    # What fails check goes to stderr too, a line each.
    for report in reports:
        if report.unserved:
            log(f"not served: {report.unserved}")
    refused = sum(report.count("refused") for report in reports)
    unreviewed = sum(report.count("unreviewed") for report in reports)
    problems = []
    if refused:
        problems.append(f"{refused} tool(s) refused, each line says why")
    if unreviewed:
        problems.append(f"{unreviewed} tool(s) unreviewed: read their "
                        f"proposed rules, then run check -accept")
    if problems:
        log(f"not offered: {'; '.join(problems)}")
    unserved = any(report.unserved for report in reports)
    return 1 if problems or unserved else 0


def load_warnings(reports):
    """The report lines a starting gate logs: what is amiss and why
    a server is not served. An offered tool's lines are check's:
    fifty would bury the approval lines in the host's log."""
    lines = []
    for report in reports:
        for line in report.lines:
            # Left to check: a registered tool's line and its rule
            # lines (indented); a lint line is indented too, and kept.
            said = line[len(sanitize(report.server)) + 2:]
            lint = said.lstrip().startswith("lint ")
            if not said.startswith("registered ") and (
                    not said.startswith("  ") or lint):
                lines.append(line)
        if report.unserved:
            lines.append(f"not served: {report.unserved}")
    return lines


# =============================================================================================
# 32. Fake payment server
#
# Reads as: around the core
#
# Owns: `fake-payments`, a small stdio MCP server that the demonstration, the example config
# and the tests put behind the gate, to see it work with nothing installed. Every payment is
# appended, as its raw arguments, to the file FAKE_PAYMENTS_LEDGER names (if set) and synced to
# disk before the answer is sent: the ledger's lines count the payments made.
# Core it calls: nothing: it is a server of its own, run as a child process.
# =============================================================================================

FAKE_TOOLS = [
    {"name": "balance", "description": "Read the balance of an account.",
     "inputSchema": {"type": "object", "additionalProperties": False, "required": ["account"],
                     "properties": {"account": {"type": "string"}}},
     "annotations": {"readOnlyHint": True}},
    {"name": "pay", "description": "Pay an amount to someone.",
     "inputSchema": {"type": "object", "additionalProperties": False,
                     "required": ["to", "amount"],
                     "properties": {"to": {"type": "string"}, "amount": {"type": "number"},
                                    "currency": {"type": "string"},
                                    "mode": {"enum": ["slow", "block", "error", "structured",
                                                      "deep"]}}},
     "annotations": {"destructiveHint": False}},
    {"name": "refund", "description": "Refund a payment.",
     "inputSchema": {"type": "object", "additionalProperties": False, "required": ["payment"],
                     "properties": {"payment": {"type": "string"}}}},
]


def fake_payments():
    ledger = os.environ.get("FAKE_PAYMENTS_LEDGER")
    tools = json.loads(json.dumps(FAKE_TOOLS))
    if os.environ.get("FAKE_PAYMENTS_DESCRIPTION"):
        tools[0]["description"] = os.environ["FAKE_PAYMENTS_DESCRIPTION"]
    out_lock = threading.Lock()
    cancelled = {}

    def send(message):
        with out_lock:
            sys.stdout.buffer.write(json.dumps(message).encode() + b"\n")
            sys.stdout.buffer.flush()

    def text(s, is_error=False, structured=None):
        result = {"content": [{"type": "text", "text": s}]}
        if is_error:
            result["isError"] = True
        if structured is not None:
            result["structuredContent"] = structured
        return result

    def pay(ident, args, stop):
        if ledger:
            with open(ledger, "a", encoding="utf-8") as f:
                f.write(json.dumps(args, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
        mode, to, amount = args.get("mode"), args.get("to"), args.get("amount", 0)
        if mode == "slow":
            stop.wait(2)
        if mode == "block":
            while not (ledger and os.path.exists(ledger + ".release")) and not stop.wait(0.02):
                pass
        if mode == "error":
            return text(f"card declined for {to}", is_error=True)
        if mode == "structured":
            return text(f"paid {amount} to {to}", structured={"paid": amount, "to": to})
        if mode == "deep":
            deep = []
            for _ in range(300):
                deep = [deep]
            return text("deep", structured={"deep": deep})
        return text(f"paid {float(amount):.2f} to {to}")

    def call(ident, params):
        stop = cancelled.setdefault(ident, threading.Event())
        name, args = params.get("name"), params.get("arguments") or {}
        if name == "balance":
            result = text(f"account {args.get('account')} holds 120.00 EUR")
        elif name == "pay":
            result = pay(ident, args, stop)
        elif name == "refund":
            result = text("refunded")
        else:
            send({"jsonrpc": "2.0", "id": ident, "error": {"code": -32602,
                                                           "message": f"no tool {name}"}})
            return
        cancelled.pop(ident, None)
        send({"jsonrpc": "2.0", "id": ident, "result": result})

    for line in sys.stdin.buffer:
        try:
            message = json.loads(line)
        except ValueError:
            continue
        method, ident = message.get("method"), message.get("id")
        params = message.get("params") or {}
        if method == "initialize":
            send({"jsonrpc": "2.0", "id": ident, "result": {
                "protocolVersion": params.get("protocolVersion", "2025-06-18"),
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "fake-payments", "version": "1.0.0"}}})
        elif method == "tools/list":
            send({"jsonrpc": "2.0", "id": ident, "result": {"tools": tools}})
        elif method == "tools/call":
            threading.Thread(target=call, args=(ident, params), daemon=True).start()
        elif method == "notifications/cancelled":
            cancelled.setdefault(params.get("requestId"), threading.Event()).set()
        elif method == "ping":
            send({"jsonrpc": "2.0", "id": ident, "result": {}})
        elif ident is not None:
            send({"jsonrpc": "2.0", "id": ident, "error": {"code": -32601,
                                                           "message": "method not found"}})
    return 0


# =============================================================================================
# 33. Demonstration
#
# Reads as: around the core
#
# Owns: `agentgate.py demo`, a scripted session with no model, no network and nothing
# installed. This process plays the host; the gate, the fake payment server and the operator
# run as separate processes in a temporary directory, as they would for a person.
# Promises: every step says what the model sees; the demo exits non-zero if any step did not
# behave as narrated, and it ends only after every process it started has exited.
# Core it calls: nothing: it writes with section 21's write_private and runs everything else
# as agentgate's own commands, in processes.
# =============================================================================================

class DemoFailure(Exception):
    """A step of the demonstration did not behave as narrated."""


class LineClient:
    def __init__(self, argv, cwd, env, stderr):
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=stderr)
        self.answers = queue.Queue()
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            message = json.loads(line)
            if "id" in message:
                self.answers.put(message)
        self.answers.put(None)

    def send(self, method, params):
        self.next_id += 1
        line = json.dumps({"jsonrpc": "2.0", "id": self.next_id, "method": method,
                           "params": params}) + "\n"
        self.proc.stdin.write(line.encode())
        self.proc.stdin.flush()
        return self.next_id

    def request(self, method, params, timeout=60):
        ident = self.send(method, params)
        while True:
            try:
                message = self.answers.get(timeout=timeout)
            except queue.Empty:
                raise DemoFailure(f"no answer to {method} within {timeout}s") from None
            if message is None:
                raise DemoFailure(f"the process exited before answering {method}")
            if message.get("id") == ident:
                if "error" in message:
                    raise DemoFailure(f"{method} failed: {message['error'].get('message')}")
                return message["result"]

    def call(self, tool, args):
        result = self.request("tools/call", {"name": tool, "arguments": args})
        return result["content"][0]["text"], bool(result.get("isError"))

    def close(self):
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Narrator:
    def __init__(self, out):
        self.out = out
        color = out.isatty() and not os.environ.get("NO_COLOR")
        self.bold = (lambda s: f"\033[1m{s}\033[0m") if color else (lambda s: s)

    def step(self, title):
        self.out.write(f"\n{self.bold(title)}\n")
        self.out.flush()

    def say(self, text):
        tell(f"  {text}", out=self.out, flush=True)

    def sees(self, text, is_error):
        label = "model sees (isError)" if is_error else "model sees"
        self.say(f"{label}: {cut(text.split('. ')[0], 76 - len(label))}")


def expect(text, prefix):
    if not text.startswith(prefix):
        raise DemoFailure(f"expected an answer starting {prefix!r}, got {text[:120]!r}")


def cmd_demo(argv):
    parser("demo").parse_args(argv)
    narrator = Narrator(sys.stdout)
    with tempfile.TemporaryDirectory(prefix="agentgate-demo-") as directory:
        try:
            run_demo(directory, narrator)
        except DemoFailure as err:
            narrator.say(f"DEMO FAILED: {err}")
            return 1
    return 0


def run_demo(directory, narrator):
    me = os.path.abspath(__file__)
    ledger = os.path.join(directory, "ledger")
    config = {"database": "demo.db", "session": "demo", "hold": "0s", "lease_ttl": "3s",
              "servers": [{"name": "bank", "command": [sys.executable, me, "fake-payments"],
                           "env": [f"FAKE_PAYMENTS_LEDGER={ledger}"],
                           "manifest": "bank.manifest.json", "rules": {
                               "balance": {"side_effect": "read_only", "timeout": "5s"},
                               "pay": {"side_effect": "remote_mutation", "timeout": "30s"}}}]}
    config_file = os.path.join(directory, "agentgate.json")
    write_private(config_file, json.dumps(config, indent=2))
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTGATE_CONFIG",)}
    started = []

    def run(*args):
        return subprocess.run([sys.executable, me, *args, "-config", config_file], cwd=directory,
                              env=env, capture_output=True, text=True, timeout=60)

    def gate():
        log_file = open(os.path.join(directory, "gate.log"), "ab")
        client = LineClient([sys.executable, me, "-config", config_file], directory, env,
                            log_file)
        log_file.close()
        started.append(client.proc)
        client.request("initialize", {"protocolVersion": PROTOCOL_VERSIONS[-1],
                                      "capabilities": {}, "clientInfo": {"name": "demo-host",
                                                                         "version": "1"}})
        return client

    def waiting_approval():
        with open(os.path.join(directory, "gate.log"), encoding="utf-8") as f:
            found = re.findall(r"approve (\S+) -approval ([0-9a-f]+)", f.read())
        if not found:
            raise DemoFailure("the gate named no approval on its stderr")
        return found[-1]

    def payments(path=ledger):
        if not os.path.exists(path):
            return 0
        with open(path, encoding="utf-8") as f:
            return len(f.read().splitlines())

    def operator(verb, note):
        run_id, approval = waiting_approval()
        done = run(verb, run_id, "-approval", approval, "-note", note, "-by", "operator")
        if done.returncode != 0:
            raise DemoFailure(f"the operator's {verb} failed: {done.stderr.strip()}")
        narrator.say(f"operator, in another process: {verb} …{approval[-8:]}, {note!r}")

    def see(tool, args, prefix):
        text, is_error = host.call(tool, args)
        narrator.sees(text.split("\n")[0], is_error)
        expect(text, prefix)

    host = None
    try:
        narrator.step("0. Pin the fake payment server and classify its tools")
        pinned = run("pin")
        if pinned.returncode != 0:
            raise DemoFailure(f"pin failed: {pinned.stderr.strip()}")
        narrator.say("balance is read_only; pay is remote_mutation (the policy asks an operator)")

        host = gate()
        narrator.step("1. A read runs at once")
        see("bank_balance", {"account": "household"}, "account household holds")

        narrator.step("2. A payment waits for an operator, and is collected once")
        rent = {"to": "landlord", "amount": 950}
        see("bank_pay", rent, "PENDING_APPROVAL")
        operator("approve", "rent for October")
        see("bank_pay", rent, "paid 950.00 to landlord")

        narrator.step("3. A payment cut off by a crash is not run again without an operator")
        repair = {"to": "plumber", "amount": 180, "mode": "block"}
        text, is_error = host.call("bank_pay", repair)
        expect(text, "PENDING_APPROVAL")
        operator("approve", "the boiler repair")
        before = payments()
        host.send("tools/call", {"name": "bank_pay", "arguments": repair})
        deadline = time.monotonic() + 30
        while payments() == before:
            if time.monotonic() > deadline:
                raise DemoFailure("the payment never reached the server")
            time.sleep(0.02)
        host.proc.kill()
        host.proc.wait()
        narrator.say("the gate was killed with SIGKILL while the server was inside the payment")
        host = gate()
        deadline = time.monotonic() + 30
        while True:
            text, is_error = host.call("bank_pay", repair)
            if not text.startswith("IN_PROGRESS") or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        narrator.say("after a restart, once the dead gate's lease expired:")
        narrator.sees(text, is_error)
        expect(text, "INTERRUPTED")
        see("gate_status", {}, "GATE_STATUS")
        operator("reject", "it went through; do not pay twice")
        see("bank_pay", repair, "REJECTED")

        narrator.step("4. A host that lost a response and retries pays once")
        groceries = {"to": "grocer", "amount": 42}
        host.call("bank_pay", groceries)
        operator("approve", "groceries")
        see("bank_pay", groceries, "paid 42.00 to grocer")
        narrator.say("the host never saw that answer and retries the same call:")
        see("bank_pay", groceries, "DUPLICATE")
        through = sum(1 for line in open(ledger, encoding="utf-8") if "grocer" in line)
        straight_ledger = os.path.join(directory, "straight-ledger")
        server = LineClient([sys.executable, me, "fake-payments"], directory,
                            {**env, "FAKE_PAYMENTS_LEDGER": straight_ledger}, subprocess.DEVNULL)
        started.append(server.proc)
        server.request("initialize", {"protocolVersion": PROTOCOL_VERSIONS[-1], "capabilities": {},
                                      "clientInfo": {"name": "demo-host", "version": "1"}})
        server.call("pay", groceries)
        server.call("pay", groceries)
        server.close()
        straight = payments(straight_ledger)
        narrator.say(f"through the gate the server made {through} payment"
                     f"{'s' if through != 1 else ''}")
        narrator.say(f"without the gate the server made {straight} payments")
        if (through, straight) != (1, 2):
            raise DemoFailure("the payment counts are not 1 and 2")
        host.close()
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        _reap_fake_servers(directory)
    narrator.step("Done")
    narrator.say("every process the demo started has exited")


def _reap_fake_servers(directory):
    """Wait until no fake payment server of this demo is left (a killed gate's child dies
    with it on Linux; elsewhere it is told to stop when its input closes)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not _processes_mentioning(directory):
            return
        time.sleep(0.05)
    raise DemoFailure("a process the demo started is still running")


def _processes_mentioning(text):
    found = []
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if text.encode() in f.read():
                        found.append(pid)
            except OSError:
                pass
    return found


# =============================================================================================
# 34. Main
#
# Reads as: around the core
#
# Owns: the command line and `serve`, which puts the sections together: the config, the store,
# the upstreams, the gate, the host side and the seams around them. Go-style single-dash long
# flags (-config, -approval); the double-dash spelling works too. Exit codes: 0 ok, 1 failure,
# 2 usage. No traceback reaches a user: every expected failure is one sentence on stderr.
# Core it calls: Store (opened as section 22's Ledger, which the status tool reads), Gate,
# HostServer, and the seams: the gate's `announce` and `duplicate` (section 26's
# announce_waiting and duplicate_refused) and the host's `around` and `status` (section 25's
# HostAround and StatusTool).
# =============================================================================================

class Shutdown(Exception):
    """Raised in the main thread by SIGINT or SIGTERM before serving began."""


def cmd_serve(argv):
    config = serving_config(parser("serve", "config").parse_args(argv).config)
    around = HostAround()
    host = HostServer(sys.stdin.buffer, sys.stdout.buffer, around)
    serving = []

    def stop(signum, frame):
        if not serving:
            raise Shutdown()
        host.stopping = True
        host.done.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    host.start()
    upstreams, store, gate = [], None, None
    # The database opens while the servers start: neither waits for the other.
    opened = []
    opener = threading.Thread(target=lambda: opened.append(_open_store(config.database)),
                              daemon=True)
    try:
        try:
            upstreams, tools, reports = load_all(config, opener.start)
            for line in load_warnings(reports):
                log(line)
            opener.join()
            store = opened[0]
            if isinstance(store, Exception):
                raise store
        except (StoreError, ConfigError) as err:
            host.fail(str(err))
            raise
        gate = Gate(config, store, tools)
        gate.announce = announce_waiting(config, config.notify and Notifier(config.notify))
        gate.duplicate = duplicate_refused(config)
        ToolWatch(gate, upstreams, functools.partial(around.tools_changed, host))
        host.serve_with(gate, StatusTool(gate, config.status_tool,
                                         sum(bool(r.unserved) for r in reports)))
        serving.append(True)
        log(f"serving session {config.session} on database {config.database}: {len(tools)} "
            f"tool(s) from {len(reports)} server(s) "
            f"({', '.join(sanitize(r.server) for r in reports)}); check lists each tool")
        while not host.done.wait(1):
            pass
        # Shutting down: no new call starts, holds end, calls in flight finish and are
        # recorded before the servers they talk to are closed.
        host.stopping = True
        gate.stopping.set()
        deadline = time.monotonic() + max((t.timeout for t in tools), default=0) / SECOND + 5
        while host.running and time.monotonic() < deadline:
            time.sleep(0.02)
        return 0
    except Shutdown:
        return 0
    finally:
        if gate:
            gate.stopping.set()
        for upstream in upstreams:
            upstream.close()
        if opener.is_alive():
            opener.join()
        if opened and isinstance(opened[0], Store):
            opened[0].close()


def _open_store(path):
    try:
        return Ledger(path)
    except (StoreError, ConfigError) as err:
        return err


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    commands = {"serve": cmd_serve, "pin": cmd_pin, "check": cmd_check, "runs": cmd_runs,
                "show": cmd_show, "approve": cmd_approve, "reject": cmd_reject,
                "cancel": cmd_cancel, "watch": cmd_watch, "verify": cmd_verify,
                "recheck": cmd_recheck,
                "grant": cmd_grant, "grants": cmd_grants, "revoke": cmd_revoke,
                "init": cmd_init, "login": cmd_login, "demo": cmd_demo,
                "fake-payments": lambda a: fake_payments()}
    if argv and argv[0] in ("-h", "--help", "help"):
        tell(*USAGE.splitlines(), out=sys.stderr)
        return 0
    if argv and argv[0] in ("-version", "--version"):
        tell(f"{PROGRAM} {VERSION}")
        return 0
    if len(argv) > 2 and argv[0].lstrip("-") in ("config", "db") and argv[2] in commands:
        argv = [argv[2], *argv[:2], *argv[3:]]  # `-config FILE approve ...` reads as written
    command = argv[0] if argv and not argv[0].startswith("-") else "serve"
    rest = argv[1:] if argv and not argv[0].startswith("-") else argv
    if command not in commands:
        tell(f"{PROGRAM}: unknown command {quote(command)}", *USAGE.splitlines(), out=sys.stderr)
        return 2
    try:
        return commands[command](rest)
    except Usage as err:
        tell(f"{PROGRAM}: {err}", out=sys.stderr)
        return 2
    except (ConfigError, LoadError, StoreError, UpstreamError) as err:
        tell(f"{PROGRAM}: error: {err}", out=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 1
    except BrokenPipeError:
        # The reader went away (a pager closed, `| head`): say nothing more, leave quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
