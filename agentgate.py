#!/usr/bin/env python3
"""agentgate: a gate between an MCP host and the MCP servers it uses.

agentgate is one standard-library Python file. An MCP host (Claude Desktop, Claude Code,
Cursor, ...) starts it as a stdio MCP server; it starts the servers the person configured,
offers only the tools the person pinned and classified, and gates every `tools/call`:

    record it -> check its arguments against the pinned schema -> evaluate the policy
    -> if it asks, wait for an operator's approval bound by hash to this exact request
    -> execute the upstream call itself -> record the outcome.

All is recorded in one SQLite file. An operator decides in a terminal:
`agentgate.py approve RUN -approval ID` (or reject / cancel).

Scope. agentgate governs only the calls that go through it. It guards one person who is
both the host's user and the operator; it does not separate them: a model that can run
commands can approve its own request with the operator command or by editing the database.
Its policy reads a call's arguments, its time and the host's self-reported name, and its
limits count a tool's executions; it reads nothing of the conversation. It refuses a
deliberate identical repeat of a mutating call within the repeat window, as it refuses a
blind retry. The pin covers what a server presents, not what it does.

Sections (3863 lines of decision core, read first; then the libraries, each behind the
contract its header states; then what surrounds the core, each header naming the core
functions it calls beyond sections 1 and 2, constants and exceptions). A core section uses
only those above it and the libraries: the policy precedes the configuration, read with it.

                                                                     lines    chars
     1. Framing                                      decision core      117    3,594
     2. Classes, ids and deadlines                   decision core       34    1,106
     3. Policy on what a call does                   decision core      482   17,915
     4. Configuration and its trust                  decision core      314   12,139
     5. Tools, as pinned                             decision core      303   11,819
     6. Answers                                      decision core      382   16,890
     7. The record                                   decision core      750   30,235
     8. The gate                                     decision core      655   26,544
     9. The host side                                decision core      626   22,265
    10. What an operator decides on                  decision core      200    8,003
    11. Canonical JSON                               library            224    8,152
    12. Text safe to show                            library             93    2,965
    13. ECMA-262 patterns                            library            354   13,301
    14. JSON Schema                                  library            372   14,431
    15. Hosts in URLs                                library             97    3,548
    16. Paths as the kernel resolves them            library             96    3,178
    17. Durations and times                          library             72    2,526
    18. Fields of a configuration                    library            107    3,995
    19. Days and hours in a time zone                library             84    3,305
    20. What a result's record keeps                 library            121    4,506
    21. The lint                                     around the core    223    9,717
    22. Upstream servers                             around the core   1080   41,014
    23. Reading the record                           around the core    210    8,615
    24. Tool changes while serving                   around the core    168    6,367
    25. The status tool                              around the core    113    4,413
    26. The host's other requests                    around the core    128    4,877
    27. Notify                                       around the core    112    4,092
    28. Pins and load reports                        around the core    196    7,164
    29. The command line's flags                     around the core    143    5,666
    30. Operator commands                            around the core   1268   47,352
    31. Setup                                        around the core    793   29,863
    32. Pin and check                                around the core    194    7,896
    33. Fake payment server                          around the core     88    3,084
    34. Demonstration                                around the core    243    8,380
    35. Main                                         around the core    140    4,537

One tools/call through the core, with the section of each step (11, 14, 20: libraries):

    HostServer._read_loop    read_frames: one frame per newline byte off stdin           1
      HostServer._frame      parse: the boundary check, number literals kept as written 11
      HostServer._message    a request thread, kept; at most MAX_IN_FLIGHT calls at once  9
        HostServer._call     the tool the name offers, as pinned (Tool, load)          9, 5
          Gate.call          canonical, request_key: the request's identity        8, 11, 1
          Gate._judge        judged_request: check_arguments (validate) and the
                             policy's conditions, judged once, before the lock  8, 6, 14, 3
          Gate._decide       under the gate's lock, the rules over the request's
                             earlier runs (Store.key_runs), each rule a verdict         8, 7
          Gate._begin        policy_decision in the write transaction that
                             records the run (Tx.begin_run ... Tx.start_execution)   8, 3, 7
          Gate._hold         a Wait: an operator decides elsewhere, bound by hash          8
                             (Tasks.call: a task's is answered at once, held on)          9
          Gate._execute      call_upstream with the rule's timeout; passed_result and
                             result_record: what the host gets, and what is kept    8, 6, 20
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
# Owns: frames cut from byte streams, whom a refused frame answers, a request's identity
# hashes. Promises: a frame splits on `\n` bytes only (not U+2028/U+2029) and is never
# held past its cap; a refused frame's id is only its top-level one.
# =============================================================================================

def read_frames(fd, cap):
    """(frame, None) per line up to `cap` bytes, else (None, its top-level integer id
    or None). Unbuffered: no lock held at exit."""
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
                refused, piece, pending = FrameId(), bytes(pending + piece), bytearray()
            if refused is None:
                pending += piece
            else:
                refused.feed(piece)
            if piece.endswith(b"\n"):
                yield (None, refused.ident) if refused else (bytes(pending), None)
                pending, refused = bytearray(), None

def parse_loosely(data):
    """Leniently parsed, only for whom to answer; None if even that fails."""
    try:
        return json.loads(data.decode("utf-8", "replace"), parse_int=Number,
                          parse_float=Number, parse_constant=Number)
    except (ValueError, RecursionError):
        return None

_HEAD_ID_RE = re.compile(rb"\s*:\s*(-?(?:0|[1-9][0-9]{0,17}))[\s,}]")
_STRING_REST_RE = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.S)  # up to a quote or \
_TOKEN_STOP_RE = re.compile(rb'["{}\[\]]')

class FrameId:
    """A refused message's top-level integer "id" (a nested one could name another
    request), fed in pieces of any size."""

    def __init__(self):
        self.depth = 0
        self.string = self.escaped = False
        self.key = None    # a depth-1 string's first bytes
        self.after = None  # what follows a depth-1 "id" key
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
                    self.string = True
                    self.key = b"" if self.depth == 1 else None
                else:
                    self.depth += 1 if byte in b"{[" else -1
                continue
            end = _STRING_REST_RE.match(data, pos).end()
            if self.key is not None:
                self.key = (self.key + data[pos:min(end, pos + 3)])[:3]
            # A backslash ends the piece: its escape comes next.
            if end == len(data) or data[end] == 0x5C:
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

def echoable_id(ident):
    """Whether an id can be echoed as JSON (not a lone surrogate, NaN, ...)."""
    if isinstance(ident, str):
        return not SURROGATE_RE.search(ident)
    return isinstance(ident, Number) and bool(JSON_NUMBER_RE.fullmatch(ident.literal))

def sha256_hex(data):
    if isinstance(data, str):
        data = data.encode("utf-8")
    return hashlib.sha256(data).hexdigest()

def value_digest(data):
    return f"[{len(data)} bytes, sha256 {sha256_hex(data)}]"

def content_hash(value):
    return sha256_hex(canonical(value))

def request_key(tool_name, args):
    encoded = args if isinstance(args, bytes) else canonical(args)
    return sha256_hex(tool_name.encode("utf-8") + b"\x00" + encoded)


# =============================================================================================
# 2. Classes, ids and deadlines
#
# Reads as: decision core
#
# Owns: side-effect classes, outcomes, ConfigError, Usage, ids and deadlines. A duration is
# whole nanoseconds, as Go's.
# =============================================================================================

SECOND = 10**9
SIDE_EFFECTS = ("read_only", "local_mutation", "remote_mutation", "destructive")
OUTCOMES = ("allow", "require_approval", "deny")

class ConfigError(Exception):
    """A config the gate will not run with; the message says what to do."""

class Usage(Exception):
    """A command line that cannot be carried out as written (exit 2)."""

def new_id(size):
    """Milliseconds, then randomness: ids land at their indexes' right edge, so a
    write touches the same pages however large the database."""
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
# Owns: conditions, `when` entries, limits, grants, and the one decision
# (policy_decision) from a call, its Judgement and its moment's Facts
# (decision_facts; `rows` is its only SQL).
# Promises: what cannot be evaluated does not hold, and an entry other than allow that
# cannot be judged denies; numbers compare exactly; a limit never loosens and counts
# executions by their recorded arguments; a grant answers only what would wait; an omitted
# argument reads at its schema's default; a mistake is refused at load naming tool, entry
# and fix.
# =============================================================================================

GRANT_COLUMNS = ("id", "session", "tool", "name", "conditions_json", "created_at",
                 "expires_at", "by", "note", "revoked_at", "revoked_by", "revoke_note")

def tool_spec(rows, spec_hash):
    found = rows("SELECT spec_json FROM tool_specs WHERE hash=?", (spec_hash,))
    return parse(found[0][0]) if found else None

CONDITIONS = {  # and how Condition.text reads each
    "equals": "equals {}", "in": "is one of {}", "not_in": "is none of {}",
    "pattern": "matches {}", "min": "is at least {}", "max": "is at most {}",
    "max_length": "is at most {} long", "present": "present is {}",
    "under": "lies under {}", "host_in": "has a host in {}",
    "host_not_in": "has a host not in {}",
}
NEGATED = {"is": "is not", "equals": "does not equal", "matches": "does not match",
           "lies": "does not lie", "has": "does not have"}
LISTS = ("in", "not_in", "under", "host_in", "host_not_in")
NEVER = math.inf  # when a limit frees up for a call alone above it
# A decision's moment: at (epoch seconds), client (host name), grants() (read only if it
# would wait), uses(since): executions after `since` as (seconds, {sum pointer: amount}),
# None when no limit is counted.
Facts = collections.namedtuple("Facts", "at client grants uses")

def number_text(value):
    """An exact decimal as people write it: 50.00 stays 50.00."""
    text = format(value, "f")
    return text if len(text) <= 40 else str(value)

class Condition:
    """`resolved`: `under` holds a grant's directories, resolved already."""

    def __init__(self, pointer, raw, where, resolved=False):
        self.pointer, self.raw = pointer, raw
        self.tokens = parse_pointer(pointer, where)
        where = f"{where} {quote(pointer)}"
        if not isinstance(raw, dict) or not raw:
            raise ConfigError(f"{where} must be an object with one or more of "
                              f"{', '.join(CONDITIONS)}")
        refuse_unknown(raw, CONDITIONS, where)
        self.tests = [(name, self._read(name, value, f"{where}.{name}", resolved))
                      for name, value in raw.items()]
        bounds = dict(self.tests)
        low, high = bounds.get("min"), bounds.get("max")
        if None not in (low, high) and low > high:
            raise ConfigError(f"{where}: min {number_text(low)} is above max "
                              f"{number_text(high)}, so it never holds; swap them")
        if raw.get("present") is False and len(raw) > 1:
            raise ConfigError(
                f"{where}: present false holds only when there is no value, "
                f"so nothing else can be asked of it; give it its own entry")

    @staticmethod
    def _read(name, value, where, resolved):
        if name in LISTS:
            if not isinstance(value, list) or not value:
                kind = "JSON values" if name in ("in", "not_in") else "strings"
                raise ConfigError(f"{where} must be a non-empty list of {kind}")
            if name == "under" and not resolved:
                return [resolved_root(r, where) for r in value]
            if name in ("host_in", "host_not_in"):
                return [host_entry(entry, name == "host_in", where) for entry in value]
            return list(value)
        if name == "pattern":
            if not isinstance(value, str):
                raise ConfigError(f"{where} must be a string, an ECMA-262 pattern")
            try:
                compile_pattern(value)
            except PatternError as err:
                raise ConfigError(
                    f"{where} cannot be used ({err}): write an ECMA-262 pattern "
                    f"without backreferences, lookaround, named groups, "
                    f"\\p{{...}} or \\cX") from None
        if name in ("min", "max"):
            return parse_decimal(value, where)
        if name == "max_length":
            return whole_number(value, where, 0)
        if name == "present" and not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false")
        return value

    def holds(self, args, work=None, schema=None):
        """True, False, or None when a pattern costs more than `work`."""
        return all_judged(verdict for verdict, _ in self._verdicts(args, work, schema))

    def _verdicts(self, args, work, schema):
        value, node = pointed(args, self.tokens, schema)
        work = PatternWork() if work is None else work
        for name, expected in self.tests:
            seen = value
            if name in ("min", "max") and value is not MISSING:
                seen = exact_number(value, node)  # a Decimal, or None
            yield self._test(name, expected, seen, work), (name, expected, seen)

    def miss(self, args, work, schema):
        """Why it does not hold ('' when it holds)."""
        for verdict, (name, expected, value) in self._verdicts(args, work, schema):
            if verdict is None:
                return f"{self.pointer} is too long to be checked"
            if verdict is not False:
                continue
            if value is MISSING or name == "present":
                state = "absent" if value is MISSING else "present"
                return f"{self.pointer} is {state}"
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
        if name == "pattern":
            try:
                return isinstance(value, str) and work.search(expected, value, "")
            except PatternCost:
                return None
        return CHECKS[name](value, expected)

    @staticmethod
    def _words(name, expected):
        shown = number_text if name in ("min", "max") else policy_json
        return CONDITIONS[name].format(shown(expected))

    def text(self):
        words = (self._words(*test) for test in self.tests)
        return f"{self.pointer} " + " and ".join(words)

def all_judged(verdicts):
    """False at the first false verdict (sparing later pattern work), else None if one
    was not judged, else True."""
    judged = True
    for verdict in verdicts:
        if verdict is None:
            judged = None
        elif not verdict:
            return False
    return judged

def _host_holds(value, hosts, listed):
    """Never for an unreadable host: no host_in nor host_not_in allows it, nor does a
    deny on host_in catch it (write what a policy allows)."""
    place = url_place(value)
    return place is not None and host_matches(*place, hosts) == listed

def _in(value, options):
    return any(json_equal(value, o) for o in options)

CHECKS = {
    "equals": lambda value, expected: json_equal(value, expected),
    "in": _in,
    "not_in": lambda value, options: not _in(value, options),
    "min": lambda value, bound: value is not None and value >= bound,
    "max": lambda value, bound: value is not None and value <= bound,
    "max_length": lambda value, bound:
        isinstance(value, (str, list)) and len(value) <= bound,
    "present": lambda value, expected: True,
    "under": lambda value, roots: path_under(value, roots),
    "host_in": lambda value, hosts: _host_holds(value, hosts, True),
    "host_not_in": lambda value, hosts: _host_holds(value, hosts, False),
}

def parse_conditions(raw, where, resolved=False):
    if not isinstance(raw, dict):
        raise ConfigError(f'{where} must be an object of JSON Pointer to condition, '
                          f'such as {{"/amount": {{"max": "50.00"}}}}')
    return [Condition(pointer, condition, where, resolved)
            for pointer, condition in raw.items()]

class Judgement:
    """A request's schema problem and each entry's and grant's verdict, judged once; its
    pattern work outlives a hold."""

    def __init__(self, problem="", work=None):
        self.problem, self.held = problem, {}
        self.work = PatternWork() if work is None else work

    def holds(self, key, conditions, args, schema):
        if key not in self.held:
            self.held[key] = all_judged(
                c.holds(args, self.work, schema) for c in conditions)
        return self.held[key]

class Entry:
    FIELDS = ("if", "during", "client", "outcome", "reason")

    def __init__(self, raw, where, label):
        self.label = label
        if not isinstance(raw, dict):
            raise ConfigError(f"{where} must be an object with if, during or client, "
                              f"and an outcome")
        refuse_unknown(raw, self.FIELDS, where)
        outcome = field_string(raw, "outcome", where, required=True)
        self.outcome = one_of(outcome, OUTCOMES, f"{where}.outcome")
        self.conditions = parse_conditions(raw.get("if", {}), f"{where}.if")
        self.during = None
        if "during" in raw:
            self.during = During(raw["during"], f"{where}.during")
        self.clients = None
        if "client" in raw:
            self.clients = field_names(raw, "client", where)
        if self.clients == []:
            raise ConfigError(f"{where}.client must list at least one host name")
        if not self.conditions and self.during is None and self.clients is None:
            raise ConfigError(f"{where} has no if, during or client, so it always "
                              f"holds: give the rule this outcome instead")
        # Model input: by default it names the entry, never what it compares.
        self.reason = field_string(
            raw, "reason", where) or f"the operator's rule {label}"

    def _client_holds(self, facts):
        return self.clients is None or facts.client in self.clients

    def holds(self, args, facts, judged=None, schema=None):
        if not self._client_holds(facts) or (
                self.during and not self.during.holds(facts.at)):
            return False
        return (judged or Judgement()).holds(self.label, self.conditions, args, schema)

    def miss(self, args, facts, judged, schema):
        """Why it did not hold, for the operator."""
        if not self._client_holds(facts):
            why = (f"the host {quote(facts.client)} is not one of "
                   f"{policy_json(self.clients)}")
        elif self.during and not self.during.holds(facts.at):
            why = "it is outside its days and hours"
        else:
            why = next(filter(None, (c.miss(args, judged.work, schema)
                                     for c in self.conditions)), "")
        return f"{self.label}: {why}"

class Limit:
    """At most `calls` executions of a tool, or a `sum` up to `max`, per `per` across
    sessions; past it, `then`."""

    FIELDS = ("calls", "sum", "max", "per", "then")

    def __init__(self, raw, where, label):
        self.label = label
        if not isinstance(raw, dict):
            raise ConfigError(
                f'{where} must be an object such as {{"calls": 5, "per": "1h"}}')
        refuse_unknown(raw, self.FIELDS, where)
        if ("calls" in raw) == ("sum" in raw):
            raise ConfigError(f'{where} needs exactly one of calls (a count) or sum '
                              f'(a JSON Pointer to a number, with max)')
        self.calls = self.sum = self.tokens = self.max = None
        if "calls" in raw:
            self.calls = whole_number(raw["calls"], f"{where}.calls", 1, 10**9)
            if "max" in raw:
                raise ConfigError(
                    f"{where}: max goes with sum; a calls limit is its own count")
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
            raise ConfigError(f"{where}.then is {quote(self.then)}; a limit never "
                              f"loosens, so use require_approval or deny")

    def amount(self, args, schema=None):
        """What a call adds to the sum: its number's size (a negative is no credit), 0
        when absent, None when no number."""
        value, node = pointed(args, self.tokens, schema)
        if value is MISSING:
            return decimal.Decimal(0)
        value = exact_number(value, node)
        return None if value is None else value.copy_abs()

    def frees(self, args, uses, at, schema=None):
        """None if this call is within the limit, else when it would be."""
        window = self.per / SECOND
        rows = uses(at - window)
        if self.calls is not None:
            if len(rows) < self.calls:
                return None
            return rows[-self.calls][0] + window
        this = self.amount(args, schema)
        if this is None or this > self.max:
            return NEVER
        zero = decimal.Decimal(0)
        try:
            with decimal.localcontext(EXACT):
                sizes = [amounts.get(self.sum, zero).copy_abs() for _, amounts in rows]
                total = sum(sizes, this)
                if total <= self.max:
                    return None
                for (moment, _), size in zip(rows, sizes):
                    total -= size
                    if total <= self.max:
                        return moment + window
        except decimal.DecimalException:  # not exact: never passes
            pass
        return NEVER

    def text(self, tool_name):
        span = format_duration(self.per)
        if self.calls is not None:
            s = "s" if self.calls != 1 else ""
            return f"at most {self.calls} call{s} to {tool_name} per {span}"
        return (f"a sum of {self.sum} of at most {number_text(self.max)} for {tool_name} "
                f"per {span}")

class Grant:
    def __init__(self, stored):
        self.id, self.by = stored["id"], stored["by"]
        raw = parse(stored["conditions_json"])
        self.conditions = parse_conditions(raw, f"grant {self.id}", True)

USES_SQL = ("SELECT e.at, s.decision_json, s.spec_hash FROM executions e JOIN steps s "
            "ON s.id=e.step_id WHERE e.tool=? AND e.at>? AND e.at<? ORDER BY e.at, e.id")

def counted_uses(rows, tool, before):
    """Facts.uses at stored time `before`: arguments read under the schema each
    execution was decided under."""
    sums = [limit for limit in tool.rule.limits if limit.sum]
    schemas = {tool.spec_hash: tool.schema}

    def schema_of(spec_hash):
        if spec_hash not in schemas:
            spec = tool_spec(rows, spec_hash)
            schemas[spec_hash] = spec["input_schema"] if spec else None
        return schemas[spec_hash]

    def uses(since):
        found = []
        for moment, decision, spec_hash in rows(
                USES_SQL, (tool.target, format_time(since), before)):
            amounts = {}
            if sums:
                args, schema = parse(decision)["args"], schema_of(spec_hash)
                for limit in sums:
                    amount = limit.amount(args, schema)
                    if amount is not None:
                        amounts[limit.sum] = amount
            found.append((parse_time(moment), amounts))
        return found
    return uses

GRANTS_SQL = (f"SELECT {', '.join(GRANT_COLUMNS)} FROM grants WHERE session=? AND tool=? "
              f"AND expires_at>? AND created_at<=? AND (revoked_at='' OR revoked_at>?) "
              f"ORDER BY created_at, id")

def decision_facts(rows, session, tool, stamp, client, count):
    """The Facts of the stored time `stamp`; uses only when `count`."""
    def grants():
        found = rows(GRANTS_SQL, (session, tool.target, stamp, stamp, stamp))
        return [Grant(dict(zip(GRANT_COLUMNS, row))) for row in found]
    uses = counted_uses(rows, tool, stamp) if count else None
    return Facts(parse_time(stamp), client, grants, uses)

def policy_decision(config, tool, args, facts, rerun=False, approved=False, judged=None):
    """{outcome, reason, by: what decided}, `limit` and `frees` from a limit, `grant` from
    a grant."""
    judged = Judgement() if judged is None else judged
    decision = _first_decision(config, tool, args, facts, judged)
    if decision["outcome"] == "deny" or rerun or approved:
        return decision
    if decision["outcome"] == "require_approval":
        decision = _granted(tool, args, facts, judged) or decision
    if decision["outcome"] == "allow" and facts.uses is not None:
        decision = _limited(tool, args, facts) or decision
    if decision["outcome"] == "require_approval" and config.operator == "none":
        reason = f"{decision['reason']}; no operator is at hand to approve it"
        decision = {**decision, "outcome": "deny", "reason": reason}
    return decision

def _first_decision(config, tool, args, facts, judged):
    """The first `when` entry that holds, else the class map."""
    rule = tool.rule
    for entry in rule.when:
        held = entry.holds(args, facts, judged, tool.schema)
        if held is None and entry.outcome != "allow":
            # Passed over, a long value could slip past a deny or a question; an allow
            # passed over only makes it stricter.
            reason = (f"the arguments are too long to be checked against the operator's "
                      f"rule {entry.label}")
            return {"outcome": "deny", "by": entry.label, "reason": reason}
        if held:
            return {"outcome": entry.outcome, "reason": entry.reason,
                    "by": entry.label}
    outcome = rule_outcome(config, rule)
    if rule.outcome:
        reason = f"tool {tool.name} is {outcome} by the operator's rule"
        by = "rule outcome"
    else:
        reason, by = f"side effect {tool.side_effect} is {outcome} by policy", "class"
    decision = {"outcome": outcome, "reason": reason, "by": by}
    if rule.when:
        decision["tried"] = [entry.miss(args, facts, judged, tool.schema)
                             for entry in rule.when]
    return decision

def _granted(tool, args, facts, judged):
    for grant in facts.grants():
        # Not judged does not hold: a grant only loosens.
        key = f"grant {grant.id}"
        if judged.holds(key, grant.conditions, args, tool.schema) is True:
            return {"outcome": "allow", "by": key, "grant": grant.id,
                    "reason": f"standing approval {grant.id} by {grant.by}"}
    return None

def _limited(tool, args, facts):
    for limit in tool.rule.limits:
        frees = limit.frees(args, facts.uses, facts.at, tool.schema)
        if frees is not None:
            text = limit.text(tool.name)
            return {"outcome": limit.then, "by": limit.label, "limit": text,
                    "frees": frees, "reason": f"a limit is reached: {text}"}
    return None

def frees_text(decision):
    """When the deciding limit frees up ('' if none), rounded up."""
    if "frees" not in decision:
        return ""
    if decision["frees"] is NEVER:
        return "this call alone is above it"
    return f"it frees up at {prose_time(format_time(math.ceil(decision['frees'])))}"

def rule_outcome(config, rule):
    return rule.outcome or config.policy[rule.side_effect]

def pointer_problem(schema, tokens, hidden):
    """Why a pointer names no property the model can send, or ''."""
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
    """Why the tool is refused: the first condition or sum pointer the pinned schema
    lacks, or ''."""
    hidden = set(rule.hidden)
    pointers = [(entry.label, c.pointer, c.tokens)
                for entry in rule.when for c in entry.conditions]
    pointers += [(limit.label, limit.sum, limit.tokens)
                 for limit in rule.limits if limit.sum]
    for label, pointer, tokens in pointers:
        problem = pointer_problem(schema, tokens, hidden)
        if problem:
            properties = schema.get("properties")
            if not isinstance(properties, dict):
                properties = ()
            names = sorted(set(properties) - hidden)
            some = ", ".join("/" + sanitize(n) for n in names)
            return (f"{label} of {tool_name} points at {quote(pointer)}, "
                    f"but {problem}; point at one of: {some or 'nothing'}")
    return ""

# =============================================================================================
# 4. Configuration and its trust
#
# Reads as: decision core
#
# Owns: the config file and the files it trusts (manifests, the database), the deciding
# fields and their defaults, the policy identity, the files no server may be
# pointed at (check_reach); the transport fields decide nothing (section 22's
# read_transport, same pass). Promises: a config is used only if
# a regular file of this user's nobody else can write; a repeated key or an unknown
# field is refused; a refusal names the field and the fix.
# =============================================================================================

DEFAULT_POLICY = {"read_only": "allow", "local_mutation": "allow",
                  "remote_mutation": "require_approval", "destructive": "deny"}
NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MIN_LEASE_TTL = 3 * SECOND
DEFAULT_TOOL_TIMEOUT = 60 * SECOND  # a slow build fits; a hung server shows
# What one call may bring in and one result take out, canonically.
DEFAULT_ARGUMENT_BYTES = 1 << 20
MAX_ARGUMENT_BYTES = 8 << 20
DEFAULT_RESULT_BYTES = 8 << 20
MAX_RESULT_BYTES = 16 << 20
DAY = 86400 * SECOND

def read_owned(path, what, private=False):
    """A file's bytes if check_owned passes, else ConfigError saying how to fix it."""
    try:  # O_NONBLOCK: a FIFO planted at the path must not hang the open.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        if err.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise ConfigError(f"{what} {path} is a symbolic link; name the file itself") \
                from None
        raise ConfigError(
            f"{what} {path} cannot be read: {err.strerror}") from None
    try:
        check_owned(path, what, os.fstat(fd), private)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)

def check_owned(path, what, st, private=False, error=ConfigError):
    """The one ownership check: `error` unless a regular file of this user's that its
    group or others cannot write (`private`: nor read)."""
    mode = stat.filemode(st.st_mode)
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} {path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise error(f"{what} {path} ({mode}) is owned by uid {st.st_uid}, "
                    f"not by the current user: chown it or use your own copy")
    if st.st_mode & (0o077 if private else 0o022):
        fix = ("lets others read them: chmod 600 it" if private else
               "lets its group or others write it: chmod go-w it")
        raise error(f"{what} {path} has mode {mode}, which {fix}")

def _each(raw, field, where, kind):
    items = raw.get(field, [])
    if not isinstance(items, list):
        raise ConfigError(f"{where}.{field} must be a list")
    return [kind(item, f"{where}.{field}[{i}]", f"{field}[{i}]")
            for i, item in enumerate(items)]

class Rule:
    """The operator's classification of one upstream tool."""

    FIELDS = ("side_effect", "timeout", "description", "deny", "fixed", "rename",
              "allow_hint_mismatch", "outcome", "repeat_window", "when", "limits",
              "proposed", "accepted_description")
    # What the policy decides from: the rule's part of policy_id.
    DECIDING = ("side_effect", "outcome", "fixed", "rename", "when", "limits")

    def __init__(self, tool, raw, where):
        refuse_unknown(raw, self.FIELDS, where)
        self.tool = tool
        self.side_effect = one_of(
            field_string(raw, "side_effect", where, required=True),
            SIDE_EFFECTS, f"{where}.side_effect")
        self.timeout = field_duration(raw, "timeout", where, None)
        self.description = field_string(raw, "description", where)
        self.deny = field_names(raw, "deny", where)
        self.fixed = raw.get("fixed", {})
        if not isinstance(self.fixed, dict):
            raise ConfigError(f"{where}.fixed must be an object of "
                              f"parameter name to JSON value")
        self.hidden = self.deny + list(self.fixed)  # never offered to the model
        self.rename = field_string(raw, "rename", where)
        self.allow_hint_mismatch = field_bool(
            raw, "allow_hint_mismatch", where)
        self.outcome = field_string(raw, "outcome", where)
        if self.outcome:
            one_of(self.outcome, OUTCOMES, f"{where}.outcome")
        self.repeat_window = field_duration(raw, "repeat_window", where, None)
        # Set by init from the server's own hints: nothing is offered on a rule nobody
        # reviewed.
        self.proposed = field_bool(raw, "proposed", where)
        # The lint_hash of texts with a high finding, accepted.
        self.accepted_description = field_string(
            raw, "accepted_description", where)
        self.when = _each(raw, "when", where, Entry)
        self.limits = _each(raw, "limits", where, Limit)
        self.policy = {k: raw[k] for k in self.DECIDING if raw.get(k)}

class Server:
    FIELDS = ("name", "command", "url", "headers", "oauth", "env", "inherit_env",
              "connect_timeout", "default_timeout", "manifest", "rules",
              "skip_path_check", "cwd")

    def __init__(self, raw, where, path, transport=None):
        refuse_unknown(raw, self.FIELDS, where)
        self.config_path, base = path, os.path.dirname(path)
        self.name = field_string(raw, "name", where, required=True)
        _check_name(self.name, f"{where}.name")
        where = f'server "{self.name}"'
        if transport:
            transport(self, raw, where, base)
        self.default_timeout = field_duration(
            raw, "default_timeout", where, None)
        manifest = field_string(raw, "manifest", where, required=True)
        self.manifest = os.path.join(base, os.path.expanduser(manifest))
        rules = raw.get("rules", {})
        if not isinstance(rules, dict):
            raise ConfigError(f"{where}.rules must be an object of "
                              f"upstream tool name to rule")
        self.rules = {tool: Rule(tool, rule, f"{where}.rules.{tool}")
                      for tool, rule in rules.items()}
        self.skip_path_check = field_bool(raw, "skip_path_check", where)

class Config:
    FIELDS = ("database", "session", "servers", "policy", "hold", "repeat_window",
              "max_pending", "approval_ttl", "grant_ttl", "status_tool", "lease_ttl",
              "max_argument_bytes", "max_result_bytes", "operator", "notify",
              "task_after")

    def __init__(self, raw, path, transport=None):
        self.path = path
        if not isinstance(raw, dict):
            raise ConfigError("the configuration must be a JSON object")
        where = "the configuration"
        refuse_unknown(raw, self.FIELDS, where)
        database = field_string(raw, "database", where, required=True)
        self.database = os.path.join(
            os.path.dirname(path), os.path.expanduser(database))
        self.session = field_string(raw, "session", where, required=True)
        _check_name(self.session, "session")
        self.servers = self._servers(raw, path, transport)
        self.policy = {**DEFAULT_POLICY, **self._policy(raw)}
        self.hold, self.host_holds = _holds(raw, where)
        self.repeat_window = field_duration(
            raw, "repeat_window", where, 600 * SECOND)
        self.max_pending = whole_number(
            raw.get("max_pending", Number("5")), "max_pending", 0, 10**6,
            " (0 means 5)") or 5
        self.approval_ttl = field_duration(raw, "approval_ttl", where, DAY)
        self.task_after = field_duration(raw, "task_after", where, 10 * SECOND)
        self.grant_ttl = field_duration(raw, "grant_ttl", where, DAY)
        self.status_tool = field_string(
            raw, "status_tool", where) or "gate_status"
        _check_name(self.status_tool, "status_tool")
        self.max_argument_bytes = field_byte_cap(
            raw, "max_argument_bytes", DEFAULT_ARGUMENT_BYTES, MAX_ARGUMENT_BYTES)
        self.max_result_bytes = field_byte_cap(
            raw, "max_result_bytes", DEFAULT_RESULT_BYTES, MAX_RESULT_BYTES)
        self.operator = field_string(raw, "operator", where)
        if self.operator not in ("", "none"):
            raise ConfigError(f'operator is {quote(self.operator)}; write "none" when '
                              f'no one is at hand to approve (what would wait is then '
                              f'denied), or leave it out')
        self.notify = field_names(raw, "notify", where)
        if "notify" in raw and not self.notify:
            raise ConfigError('notify must be a program and its arguments, such as '
                              '["notify-send", "agentgate", "an approval waits"], or '
                              'left out')
        self.lease_ttl = field_duration(
            raw, "lease_ttl", where, 30 * SECOND)
        if self.lease_ttl < MIN_LEASE_TTL:
            raise ConfigError(
                f"lease_ttl {format_duration(self.lease_ttl)} is shorter than "
                f"{format_duration(MIN_LEASE_TTL)}; give it at least 3s")

    @staticmethod
    def _servers(raw, path, transport):
        servers = raw.get("servers")
        if not isinstance(servers, list) or not servers:
            raise ConfigError("servers must be a list of at least one server")
        servers = [Server(s, f"servers[{i}]", path, transport)
                   for i, s in enumerate(servers)]
        names = [s.name for s in servers]
        for name in names:
            if names.count(name) > 1:
                raise ConfigError(
                    f'two servers are named "{name}"; give each its own name')
        return servers

    @staticmethod
    def _policy(raw):
        policy = raw.get("policy", {})
        if not isinstance(policy, dict):
            raise ConfigError("policy must be an object of side-effect class to outcome")
        for cls, outcome in policy.items():
            if cls not in SIDE_EFFECTS:
                raise ConfigError(f"policy names {quote(cls)}; the classes are "
                                  f"{', '.join(SIDE_EFFECTS)}")
            one_of(outcome, OUTCOMES, f"policy.{cls}")
        return policy

    def hold_for(self, client):
        """A host's hold: hosts give up on a call after different times."""
        return self.host_holds.get(client, self.hold)

    def policy_id(self):
        """The identity of what the policy decides from (Rule.policy, the classes'
        outcomes, no operator), not hold, windows, TTLs, timeouts."""
        servers = [{"name": s.name,
                    "rules": {t: r.policy for t, r in s.rules.items()}}
                   for s in sorted(self.servers, key=lambda s: s.name)]
        identity = {"policy": self.policy, "servers": servers}
        if self.operator:
            identity["operator"] = self.operator
        return f"{PROGRAM}/sha256:" + content_hash(identity)

def _check_name(value, what):
    if not NAME_RE.fullmatch(value):
        raise ConfigError(f"{what} {quote(value)} must be 1 to 64 "
                          f"letters, digits, '_' or '-'")

def _holds(raw, where):
    """(any host's hold, {a host's name: its hold}), "*" the rest."""
    given, default = raw.get("hold"), 15 * SECOND
    if not isinstance(given, dict):
        return field_duration(raw, "hold", where, default), {}
    holds = {host: field_duration(given, host, "hold", default)
             for host in given}
    return holds.pop("*", default), holds

def read_config(path, transport):
    path = os.path.abspath(path)
    try:
        raw = parse(read_owned(path, "config"))
    except CanonicalError as err:
        raise ConfigError(
            f"config {path} is not usable JSON: {err.placed()}") from None
    try:
        return Config(raw, path, transport)
    except ConfigError as err:
        raise ConfigError(f"config {path}: {err}") from None

def _file_identity(path):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)

DATABASE_COMPANIONS = ("-wal", "-shm", "-journal")  # hold its record as surely as it does

def _protected(config):
    db = config.database
    paths = [config.path, db, *(db + s for s in DATABASE_COMPANIONS),
             *(s.manifest for s in config.servers)]
    identities, missing = set(), set()
    for path in paths:
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
    found = [arg] + [arg.split(sep, 1)[1] for sep in "=:" if sep in arg]
    if arg.startswith("-") and not arg.startswith("--") and len(arg) > 2:
        found.append(arg[2:])
    for c in list(found):
        if c.startswith("file:"):
            found.append(unquote(re.sub(r"^file:(//[^/]*)?", "", c)) or "/")
    home = os.path.expanduser("~")
    return [home + c[1:] if c == "~" or c.startswith("~/") else c for c in found if c]

def check_reach(config):
    """Refuse a server whose cwd or argument names a file the policy depends on or a
    directory above one: a guard, not a boundary."""
    identities, missing = _protected(config)
    for server in config.servers:
        if server.skip_path_check:
            continue
        given = server.cwd_given
        named = [(f"cwd {quote(given)}", server.cwd)] if given else []
        named += [(f"argument {quote(arg)}", os.path.join(server.cwd, candidate))
                  for arg in (server.command or [])[1:]  # none for a url server
                  for candidate in _reach_candidates(arg)]
        for what, path in named:
            identity, real = _file_identity(path), os.path.realpath(path)
            if (identity and identity in identities) or real in missing:
                raise ConfigError(
                    f"server {quote(server.name)}: its {what} reaches {real}, which the "
                    f"gate's policy and approvals depend on: point the server elsewhere, "
                    f"or set skip_path_check on it if it cannot write there")

def check_database_path(path):
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"database {path} is a symbolic link; name "
                          f"the database file itself")
    check_owned(path, "database", st)


# =============================================================================================
# 5. Tools, as pinned
#
# Reads as: decision core
#
# Owns: a tool's manifest entry, what differs from its pin (changed_parts, the
# one definition; tool_changes), which tools are offered (load).
# Promises: a tool is offered, as pinned, only if pinned, classified by a reviewed
# rule and presenting what it did at the pin; its annotations fit its class
# (unless allowed); a high lint finding is accepted for exactly that text; its
# name is usable; its schema is self-contained, usable, and soundly hides what
# the rule hides. A refusal refuses that tool, an UpstreamError that server, a
# ConfigError all.
# =============================================================================================

class UpstreamError(Exception):
    """A request upstream failed. `outcome`, set where the transport writes the
    bytes: 'not_sent' (no byte reached the server: nothing executed), 'answered'
    (a refusal it answered; `rpc`: its code, message and data, if well formed),
    'unusable' (an unreadable answer), 'no_answer', 'timed_out'."""

    def __init__(self, message, outcome="no_answer", rpc=None):
        super().__init__(message)
        self.outcome, self.rpc = outcome, rpc

# A pin's parts: (a person's word, the manifest key). Not `execution`: no tasks.
PINNED_PARTS = (
    ("input schema", "schema_hash"), ("description", "description_hash"),
    ("title", "title"), ("output schema", "output_schema"),
    ("annotations", "annotations"), ("icons", "icons"), ("_meta", "_meta"))

def offered_name(server, tool, rule):
    """The rule's rename, else server_tool (never prefixed twice)."""
    if rule.rename:
        return rule.rename
    if tool == server.name or tool.startswith((f"{server.name}_", f"{server.name}-")):
        return tool
    return f"{server.name}_{tool}"

class Tool:
    def __init__(self, server, upstream, entry, rule):
        self.server, self.upstream, self.rule = server, upstream, rule
        self.upstream_name = entry["name"]
        self.name = offered_name(server, entry["name"], rule)
        # By what the tool is, not its name: a rename neither lifts an
        # unknown outcome nor lets a repeat through.
        self.target = f"{server.name}/{entry['name']}"
        self.description = rule.description or entry.get("description", "")
        self.side_effect = rule.side_effect
        self.read_only = rule.side_effect == "read_only"
        self.timeout_given = rule.timeout or server.default_timeout  # check says if unset
        self.timeout = self.timeout_given or DEFAULT_TOOL_TIMEOUT
        self.schema = restrict_schema(entry["input_schema"], rule.hidden)
        # Offered as pinned, as the rule shows it; no part not presented.
        offered = {
            "name": self.name, "title": entry.get("title"),
            "description": self.description or None, "inputSchema": self.schema,
            "outputSchema": entry.get("output_schema"),
            "annotations": entry.get("annotations"),
            "icons": entry.get("icons"), "_meta": entry.get("_meta")}
        self.listing = {k: v for k, v in offered.items() if v is not None}
        self.spec = {"name": self.name, "description": self.description,
                     "input_schema": self.schema,
                     "side_effect": self.side_effect, "timeout": self.timeout}
        self.spec_json = dumps(self.spec)  # a step names it by hash
        self.spec_hash = sha256_hex(self.spec_json)

def restrict_schema(schema, hidden):
    if not hidden:
        return schema
    restricted = {k: v for k, v in schema.items() if k != "required"}
    restricted["properties"] = {
        k: v for k, v in schema.get("properties", {}).items() if k not in hidden}
    required = [r for r in schema.get("required", []) if r not in hidden]
    if required:
        restricted["required"] = required
    return restricted

def manifest_entry(tool):
    """A listed tool as a manifest keeps it (PINNED_PARTS): a part absent or
    of the wrong kind is null; such annotations are left out."""
    def kept(field, kind):
        value = tool.get(field)
        return value if isinstance(value, kind) else None
    schema = tool.get("inputSchema")
    description = kept("description", str) or ""
    entry = {
        "name": tool["name"], "description": description,
        "input_schema": schema, "schema_hash": content_hash(schema),
        "description_hash": sha256_hex(encode_string(description)),
        "title": kept("title", str), "output_schema": kept("outputSchema", dict),
        "icons": kept("icons", list), "_meta": kept("_meta", dict)}
    if kept("annotations", dict):
        entry["annotations"] = tool["annotations"]
    return entry

def changed_parts(pinned, live):
    return [part for part, key in PINNED_PARTS if pinned.get(key) != live.get(key)]

CHANGE_KINDS = ("changed", "removed", "added")

def tool_changes(pinned, live):
    """Per tool, how `live` (manifest entries) differs from the pin: ("added", None,
    now), ("removed", pinned, None) or ("changed", pinned, now)."""
    changes = {}
    for name in sorted(set(pinned) | set(live)):
        old, new = pinned.get(name), live.get(name)
        if old is None:
            changes[name] = ("added", old, new)
        elif new is None:
            changes[name] = ("removed", old, new)
        elif changed_parts(old, new):
            changes[name] = ("changed", old, new)
    return changes

# Lint severities (section 21).
LINT_HIGH, LINT_MEDIUM = "high", "medium"

def tool_titles(entry):
    """(where, text) of a tool's own title and its annotations'."""
    annotations = entry.get("annotations")
    if not isinstance(annotations, dict):
        annotations = {}
    titles = (("title", entry.get("title")),
              ("annotations title", annotations.get("title")))
    return [(where, title) for where, title in titles if isinstance(title, str)]

def lint_hash(entry):
    """Every text the lint reads, by hash."""
    return content_hash({"description": entry.get("description") or "",
                         "input_schema": entry.get("input_schema"),
                         "titles": dict(tool_titles(entry))})

STATUS_CLASH = "the status tool"

def load(server, manifest, upstream, live, deadline, taken, findings, report):
    """A connected server's offered tools; `taken`: names offered, holders."""
    pinned = manifest["tools"]
    for name in sorted(set(live) - set(pinned)):
        report.unpinned(name)
    tools = []
    for name in sorted(pinned):
        found = findings.get(name, [])
        tools.append(_load_tool(server, upstream, pinned[name], live.get(name),
                                deadline, taken, report, found))
        report.lint(found)
    return [tool for tool in tools if tool]

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
        late = "timed out after " + format_duration(deadline.ns)
        raise UpstreamError(upstream.describe("load", late))
    live_entry = None if live is None else manifest_entry(live)
    mismatch = hint_mismatch(rule.side_effect, entry, live_entry) if live_entry else ""
    reason = refusal(server, entry, live_entry, rule, found, mismatch)
    if not reason:
        tool = Tool(server, upstream, entry, rule)
        holder = taken.get(tool.name)
        if holder is STATUS_CLASH:
            raise ConfigError(
                f"server {quote(server.name)}: tool {quote(name)} registers as "
                f"{tool.name}, the status tool's name: rename one (status_tool or "
                f"the rule's rename)")
        if holder:
            reason = f"the name {quote(tool.name)} is already taken by {holder}"
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
        return (f"the name {quote(name)} does not match "
                f"^[a-zA-Z0-9_-]{{1,64}}$: set rename")
    schema = entry.get("input_schema")
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return 'its input schema is not an object schema ("type": "object")'
    return (reaches_outside(schema) or _lint_refusal(entry, rule, found) or
            _schema_refusal(schema, rule) or policy_pointer_problem(schema, rule, name))

def _lint_refusal(entry, rule, found):
    high = [f"{what} in the {where}" for severity, what, where in found
            if severity == LINT_HIGH]
    accepted = lint_hash(entry) if high else ""
    if not high or rule.accepted_description == accepted:
        return ""
    more = f", and {len(high) - 1} more" if len(high) > 1 else ""
    return (f"the lint finds what may be instructions hidden from you "
            f"({sanitize(high[0])}{more}); read the whole text pin printed, and "
            f"if the model may read it, set the rule's accepted_description to "
            f"\"{accepted}\"")

def _schema_refusal(schema, rule):
    try:
        problem = hiding_problem(schema, rule)
        if problem:
            return problem
        problem = schema_problem(schema) or \
            schema_problem(restrict_schema(schema, rule.hidden))
    except Exception as err:  # refuse the tool, never the gate
        problem = f"it could not be read ({type(err).__name__})"
    if problem:
        return f"the validator refuses its input schema: {sanitize(problem)}"
    return ""

def hint_mismatch(side_effect, entry, live_entry):
    annotations, prefix = entry.get("annotations"), ""
    if annotations is None and live_entry.get("annotations") is not None:
        annotations, prefix = live_entry["annotations"], "the server now says: "
    if annotations is None:
        return ""
    read_only = annotations.get("readOnlyHint") is True
    if side_effect == "read_only" and not read_only:
        return (f"{prefix}classified read_only, but the server does "
                f"not claim readOnlyHint")
    if side_effect != "destructive" and not read_only and \
            annotations.get("destructiveHint") is True:
        return f"{prefix}classified {side_effect}, but the server claims destructiveHint"
    return ""

_DRAFT_RE = re.compile(
    r"https?://json-schema\.org/(draft-0[467]/schema|"
    r"draft/2019-09/schema|draft/2020-12/schema|schema)#?")

def _members(value, pointer=""):
    """(container, key, member, container's pointer) of each member of a
    JSON value, in document order; a list's key is its index."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        items = ()
    for key, member in items:
        yield value, key, member, pointer
        yield from _members(member, f"{pointer}/{key}")

def _reaches(parent, key, value):
    if key in ("$ref", "$dynamicRef", "$recursiveRef"):
        return not value.startswith("#")
    if key == "$id":
        return not value.startswith("#") and not _DRAFT_RE.fullmatch(value)
    if key == "$schema":
        return not _DRAFT_RE.fullmatch(value)
    if key != "id" or not isinstance(parent.get("$schema"), str):
        return False
    return "draft-04" in parent["$schema"] and \
        (":" in value or value.startswith("//"))

def reaches_outside(schema):
    """Why the schema could make a validator read outside it, or ''."""
    for parent, key, value, pointer in _members(schema):
        if isinstance(value, str) and _reaches(parent, key, value):
            return (f"the input schema's {key} at {pointer or '/'} is {quote(value)}, "
                    f"which could make a validator read outside it")
    return ""

_HIDING_KEYWORDS = (
    "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentRequired",
    "dependentSchemas", "dependencies", "$defs", "definitions")

def hiding_problem(schema, rule):
    properties = schema.get("properties", {})
    for name in rule.hidden:
        hides = f"the rule hides {quote(name)}"
        if not isinstance(properties, dict) or name not in properties:
            return f"{hides}, which is not a top-level property of the input schema"
        if "patternProperties" in schema:
            return f"{hides}, but the input schema has patternProperties"
        for keyword in _HIDING_KEYWORDS:
            if keyword in schema and _mentions(schema[keyword], name):
                return f"{hides} and the input schema's {keyword} mentions it"
    return ""

def _mentions(value, name):
    return value == name or any(name in (key, member)
                                for _, key, member, _ in _members(value))


# =============================================================================================
# 6. Answers
#
# Reads as: decision core
#
# Owns: every sentence the model can read (the tables), a call's evaluation
# with its approval and hash, its arguments' check, what of a result passes.
# Promises: an approval's hash covers exactly what it binds and shows; a
# re-run of an unknown outcome needs an operator. A result reaches the host
# as the server sent it, and section 20 records what the model got. Nothing
# the model sees names the operator command, database, config or a run id.
# =============================================================================================

APPROVAL_COLUMNS = (
    "id", "run_id", "step_id", "kind", "capability_json",
    "presentation_json", "request_json", "hash", "status",
    "created_at", "expires_at", "decided_at", "decided_by", "note")
# What of a tools/call result reaches the host: every MCP field.
RESULT_FIELDS = ("content", "structuredContent", "isError", "_meta")
# How both answers on an unknown outcome end.
_RERUN_DECIDED = (
    " whether it runs again (approval {approval}). Nothing further was "
    "executed. Do not call again until you are told it was approved, and do "
    "not use another tool to do the same thing; tell the user. If it is "
    "approved, call again with exactly the same arguments.")
# The gate's answers to a call; what others chose is cleaned before a slot.
PROSE = {
    "PENDING_APPROVAL": "This request is waiting for an operator's approval "
        "(approval {approval}). Nothing has been executed. Do not call this "
        "tool again until you are told the request was approved, and do not "
        "try another tool to do the same thing. Tell the user it is waiting, "
        "with its approval id: it is approved or refused outside this "
        "conversation, by the user or whoever else operates the tools. Once "
        "it is approved, call the tool again with exactly the same arguments "
        "to run it and get the result.{limit}",
    "DENIED": "The policy does not allow this request: {reason}. Nothing was "
        "executed.",
    "TOOL_CHANGED": "Its server now presents this tool differently from when "
        "it was reviewed (its description, input schema or annotations "
        "changed, or it is gone), or said it changed and could not be asked "
        "how, so it is not offered until it is again as it was reviewed. "
        "Nothing was executed. Tell the user.",
    "INVALID": "The arguments do not match the tool's input schema: {reason}. "
        "Nothing was executed. Correct the arguments and call again.",
    "REJECTED": "An operator rejected this exact request (approval "
        "{approval}){note}. It was not executed. An identical request is "
        "refused until {until}. Do not ask again; tell the user.",
    "CANCELLED": "An operator cancelled this exact request{note}. Nothing "
        "further was executed. An identical request is refused until {until}. "
        "Tell the user.",
    "EXPIRED": "The approval for this exact request (approval {approval}) "
        "expired before it was used. It was not executed. An identical "
        "request is refused until {until}. Tell the user.",
    "DUPLICATE": "This exact request already executed at {at} and is not "
        "executed again: an identical call to this tool within {window} of an "
        "earlier one is refused, whether or not it is a retry. Its outcome "
        "was: {outcome}",
    "IN_PROGRESS": "This exact request is already executing, or the outcome "
        "of an attempt is not yet known. Nothing new was started. Wait a "
        "little, then call again with exactly the same arguments.",
    "BLOCKED_PENDING": "{waiting} for an operator's approval, the most this "
        "session allows. Nothing was executed and no approval was requested. "
        "Tell the user and wait for the operator.",
    "UNKNOWN_OUTCOME": "An attempt of this exact request {how}{error}, so "
        "whether it took effect is unknown: it may have. An operator must "
        "decide" + _RERUN_DECIDED,
    "INTERRUPTED": "An earlier attempt of this exact request was cut off "
        "while it was executing, and its outcome is unknown: it may have "
        "taken effect. An operator decides" + _RERUN_DECIDED,
    "BLOCKED_UNKNOWN": "An earlier call to {tool} may have taken effect and "
        "its outcome is unknown (approval {approval}), so no other call to "
        "{tool} that changes anything runs until an operator decides. Nothing "
        "was executed. Tell the user.",
    "UNRECORDED": "The server answered this request, so it executed, but its "
        "answer could not be recorded ({reason}). What it did is unknown here "
        "and it may have taken effect. Do not call again to retry{window}. "
        "Tell the user.",
    "UNAVAILABLE": "The gate could not read or write its records: {what}. "
        "Tell the user.",
    "HOST_CANCELLED": "The call was cancelled before it was executed. Nothing "
        "was executed.",
    # An error, so the model never takes it for the tool's result.
    "RESULT_TOO_LARGE": "The server answered this request with {what} of "
        "{size} bytes ({blocks}), more than the {cap} bytes that are passed "
        "on, so it is not shown. {then} Tell the user.",
}
TOO_LARGE_THEN = {
    "read": "A read changes nothing: asking for less (a smaller range, page "
        "or size) may fit.",
    "mutating": "It was executed and is not executed again: do not call again "
        "to retry{window}.",
}
HOW = {
    "timed_out": "timed out before the server answered",
    "no_answer": "failed without an answer from the server",
    "cut_off": "was cut off before its outcome was recorded",
}
DUPLICATE_OUTCOME = {
    "ok": "it succeeded, with this result: {text}",
    "unrecorded": "the server answered, but its result could not be recorded: "
        "{text}",
    "error": "it failed, with this error: {text}",
}
SLOT_PROSE = {
    "limit": " It waits because a limit is reached: {limit}; {frees}.",
    "refused_for": "; an identical call within {window} is refused as a "
        "duplicate",
    "sent_unrecorded": "the request was sent to the server, but what came of "
        "it could not be recorded",
    "nothing_executed": "nothing was executed",
    "host_cancelled": "the host cancelled the call before it was sent",
    "unreadable": "the gate could not read its records; nothing was executed",
    "altered": "its approval record was altered after it was made",
    "one_waits": "1 request already waits",
    "some_wait": "{count} requests already wait",
    "an_error": "an error",
    "a_result": "a result",
    "status_arguments": "the only argument is approval_id, a string",
    "arguments_too_large": "the arguments are {size} bytes, more than the "
        "{cap} this gate accepts",
    "unusable_arguments": "the arguments are not usable JSON: {error}",
    "unreadable_result": "the server's result could not be read: {error}",
    "holding": "waiting for an operator's approval",
}
# The status tool's words (section 25 picks among them).
STATUS_DESCRIPTION = (
    "Reports which requests of this session wait for an operator's approval, "
    "or, given the approval id a pending answer named, what became of that "
    "request: pending, approved, executed, rejected or expired. It only "
    "reads; it never runs or approves anything.")
STATUS_ARGUMENT = "The approval id a pending result named."
# How many servers are unserved, never which nor why.
UNSERVED_NOTE = (
    "Also, {count} of the servers behind this gate could not "
    "be served, so their tools are not offered; the person "
    "running the gate has been told why.")
DOWN_NOTE = (
    "Server {server} is down: {down}. Calls to its tools fail "
    "without executing until it is back.")
STATUS_PROSE = {
    "unknown_id": "no approval {approval} is known in this session from the "
        "last hour.",
    "none_waiting": "no request in this session is waiting for an operator's "
        "approval.",
    "one_waiting": "1 request in this session is waiting for an operator's "
        "approval:\n{lines}",
    "some_waiting": "{count} requests in this session are waiting for an "
        "operator's approval:\n{lines}",
    "head": "approval {approval} for {tool} {args}",
    "outcome_unknown": "{head}: OUTCOME UNKNOWN, waiting {age} for an "
        "operator to decide whether it runs again: an earlier attempt may "
        "have taken effect. Nothing further has been executed.",
    "pending": "{head}: PENDING for {age}. Nothing has been executed; an "
        "operator decides outside this conversation. Do not call again until "
        "it is approved.",
    "rejected": "{head}: REJECTED by the operator.{note} It was not executed; "
        "do not ask again.",
    "rejected_note": " The operator's note: {note}.",
    "expired": "{head}: EXPIRED. It was not executed.",
    "executing": "APPROVED and executing now.",
    "succeeded": "APPROVED and executed, and it succeeded.",
    "unrecorded": "APPROVED and executed, and the server answered, but its "
        "result could not be recorded ({error}); it may have taken effect.",
    "failed": "APPROVED and executed, and the server reported a failure: "
        "{error}.",
    "unknown": "APPROVED and executed, but it {how}, so whether it took "
        "effect is unknown: it may have.",
    "superseded": "APPROVED, and then a different approval was asked for the "
        "same call (approval {approval}).",
    "uncollected": "APPROVED, awaiting collection. Call {tool} again with "
        "exactly the same arguments to run it and get the result.",
    "not_executed": "APPROVED but not executed: {why}.",
}
NOT_EXECUTED_WHY = {
    "operator_cancelled": "an operator cancelled it",
    "approval_expired": "the approval expired before it was collected",
    "denied_on_resume": "the policy denied it when it was collected",
    "invalid_on_resume": "its arguments no longer matched the tool's schema "
        "when it was collected",
    "ended": "its run ended ({reason})",
}
# JSON-RPC errors to a tools/call: a host shows their message to the model.
CALL_ERRORS = {
    "failed": "the gate failed while handling this request and cannot say "
        "whether it executed; tell the user before calling again",
    "unknown_tool": "unknown tool {name}",
    "busy": "the gate is busy: {limit} requests are already in flight, and "
        "this one was not started; try again shortly",
    "stopping": "the gate is shutting down",
    "unloaded": "the gate's tools could not be loaded",
}
IS_ERROR = {"DENIED", "INVALID", "BLOCKED", "REJECTED", "EXPIRED",
            "DUPLICATE", "UNAVAILABLE", "RESULT_TOO_LARGE", "CANCELLED"}

GATE_MARK = "gate/answer"

class Answer:
    """A tools/call's answer: the gate's prose, or a server's result whole."""

    def __init__(self, text, is_error=False, passed=None, mark="FAILED"):
        self.text, self.is_error, self.passed = text, is_error, passed
        self.mark = mark  # its prefix; FAILED: a call with no result

    def result(self):
        if self.passed is not None:
            return self.passed
        # The mark tells the gate's answer from a server's result with the
        # same words; it names neither the program nor its commands.
        result = {"content": [{"type": "text", "text": self.text}],
                  "_meta": {GATE_MARK: self.mark}}
        if self.is_error:
            result["isError"] = True
        return result

def answer(prefix, key=None, **slots):
    text = PROSE[key or prefix].format(**slots)
    return Answer(f"{prefix}: {text}", prefix in IS_ERROR, mark=prefix)

def gate_status(key, **slots):
    text = STATUS_PROSE[key].format(**slots)
    return Answer("GATE_STATUS: " + text, mark="GATE_STATUS")

def passed_answer(passed):
    """A server's result, or its JSON-RPC error ({"error": ...})."""
    if "error" in passed:
        return Answer(passed["error"]["message"], True, passed)
    texts = [b["text"] for b in passed["content"]
             if b["type"] == "text" and isinstance(b.get("text"), str)]
    return Answer("\n".join(texts), passed.get("isError") is True, passed)

def note_text(note):
    if not note:
        return ""
    return f", with this note: {cut(quote(note), 500)}"

def waiting_answer(approval):
    """What a call is told while its request waits on an approval."""
    ident = approval["id"]
    if approval["kind"] != "interrupted_side_effect":
        shown = parse(approval["presentation_json"])
        limit = ""
        if "limit" in shown:
            limit = SLOT_PROSE["limit"].format(
                limit=clean(shown["limit"], 300), frees=shown["frees"])
        return answer("PENDING_APPROVAL", approval=ident, limit=limit)
    bound = parse(approval["capability_json"])
    ended = bound.get("interrupted", {}).get("ended", "cut_off")
    if ended == "cut_off":
        return answer("INTERRUPTED", approval=ident)
    return answer("UNKNOWN_OUTCOME", how=HOW[ended], error="", approval=ident)

def refused_for(window):
    """The repeat window's clause ('' without a window)."""
    if not window:
        return ""
    return SLOT_PROSE["refused_for"].format(window=format_duration(window))

def too_large_answer(tool, record, cap, window):
    then = TOO_LARGE_THEN["read"]
    if not tool.read_only:
        then = TOO_LARGE_THEN["mutating"].format(window=refused_for(window))
    what = SLOT_PROSE["an_error" if record.get("is_error") else "a_result"]
    blocks = clean(", ".join(block_labels(record)), 500)
    return answer("RESULT_TOO_LARGE", what=what, size=record["bytes"],
                  cap=cap, blocks=blocks, then=then)

# A constant: the decision at the pause and at collection hash alike.
INTERRUPTED_REASON = "interrupted while executing; outcome unknown"

def evaluate(config, tool, args, facts, attempt=None, approved=False,
             judged=None):
    """The policy's decision, with what an approval binds (capability) and
    shows (presentation). A re-run (`attempt`) always needs an operator."""
    decision = policy_decision(config, tool, args, facts,
                               rerun=bool(attempt), approved=approved,
                               judged=judged)
    outcome = decision["outcome"]
    if outcome == "deny" or (outcome == "allow" and not attempt):
        return decision
    where = f"{tool.upstream_name} on server {tool.server.name}"
    capability = {"server": tool.server.name,
                  "tool": tool.upstream_name, "name": tool.name,
                  "side_effect": tool.side_effect, "args": args}
    if tool.rule.fixed:
        capability["fixed"] = tool.rule.fixed
    if attempt:
        capability["interrupted"] = attempt
        notice = (
            f"An earlier attempt started at {attempt['started_at']} in run "
            f"{attempt['run_id']} {HOW[attempt['ended']]}, so it may have "
            f"taken effect. Approving runs it again when the model calls "
            f"again; rejecting ends this request, and a later identical call "
            f"asks an operator again whatever the policy says.")
        shown = {**capability, "notice": notice,
                 "reason": INTERRUPTED_REASON,
                 "question": f"Run {where} again with these arguments?"}
        return {"outcome": "require_approval",
                "reason": INTERRUPTED_REASON, "by": decision["by"],
                "kind": "interrupted_side_effect",
                "capability": capability, "presentation": shown}
    question = f"May the model call {where} with these arguments?"
    shown = {**capability, "question": question, "reason": decision["reason"]}
    if decision["by"] not in ("class", "rule outcome"):
        # What decided is part of what is approved. When a limit frees up
        # is fixed by the history before the decision: recheck hashes alike.
        shown["decided_by"] = decision["by"]
        if "limit" in decision:
            shown.update(limit=decision["limit"], frees=frees_text(decision))
    decision.update(kind=tool.side_effect, capability=capability,
                    presentation=shown)
    return decision

def approval_hash(kind, capability, presentation, request):
    return content_hash({"kind": kind, "capability": capability,
                         "presentation": presentation,
                         "request": request})

def new_approval(config, run_id, step_id, tool, args, decision):
    """A pending approval, its row as Store.read_approvals reads it."""
    request = {"run_id": run_id, "step_id": step_id, "spec": tool.spec,
               "args": args}
    kind, capability = decision["kind"], decision["capability"]
    shown = decision["presentation"]
    created = now()
    expires = ""
    if config.approval_ttl:
        expires = later(created, config.approval_ttl)
    return dict(
        dict.fromkeys(APPROVAL_COLUMNS, ""), id=new_id(16),
        run_id=run_id, step_id=step_id, kind=kind,
        capability_json=dumps(capability),
        presentation_json=dumps(shown), request_json=dumps(request),
        hash=approval_hash(kind, capability, shown, request),
        status="pending", created_at=created, expires_at=expires)

def stored_hash(row):
    """A row's hash from its stored fields; a tampered row differs."""
    try:
        return approval_hash(
            row["kind"], parse(row["capability_json"]),
            parse(row["presentation_json"]), parse(row["request_json"]))
    except CanonicalError:
        return ""

def judged_request(tool, args, work=None):
    """A request's Judgement, its schema check made on `work`."""
    work = PatternWork() if work is None else work
    return Judgement(check_arguments(tool, args, work), work)

def check_arguments(tool, args, work=None):
    """'' when the arguments may be sent, else why not (INVALID)."""
    if not isinstance(args, dict):
        return "the arguments are not a JSON object"
    for name in tool.rule.hidden:
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
    """(what of a result is passed on, '') or (None, why not)."""
    if not isinstance(result, dict):
        return None, "the server's result is not an object"
    if result.get("resultType") == "input_required" or \
            "inputRequests" in result:
        return None, (f"{tool.name}: the server asked for more input, "
                      f"which the gate does not support")
    blocks = result.get("content")
    if not isinstance(blocks, list) or not all(
            isinstance(block, dict) and isinstance(block.get("type"), str)
            for block in blocks):
        return None, ("the server's result has no list of content "
                      "blocks, each with its type")
    return {k: result[k] for k in RESULT_FIELDS if k in result}, ""


# =============================================================================================
# 7. The record
#
# Reads as: decision core
#
# Owns: the SQLite file, every statement that changes it, the reads the gate
# decides with (section 23 reads the rest). Promises: WAL, synchronous=FULL,
# a busy timeout, trusted_schema off; files 0600, refused when others can
# write them; a change and its events commit in one BEGIN IMMEDIATE, one event
# per run, hash-chained across processes. Nothing here approves. A newer
# agentgate's database is refused; older ones migrate.
# =============================================================================================

SCHEMA = [
    # 1. A run per tools/call, a step per proposal; calls index runs by request.
    """
    CREATE TABLE runs(id TEXT PRIMARY KEY, session TEXT NOT NULL,
        tool TEXT NOT NULL, status TEXT NOT NULL,
        reason TEXT NOT NULL DEFAULT '',
        detail TEXT NOT NULL DEFAULT '',
        step_count INTEGER NOT NULL DEFAULT 0,
        created_at TEXT NOT NULL,
        finished_at TEXT NOT NULL DEFAULT '',
        lease_owner TEXT NOT NULL DEFAULT '',
        lease_expires_at TEXT NOT NULL DEFAULT '');
    CREATE TABLE steps(id TEXT PRIMARY KEY,
        run_id TEXT NOT NULL REFERENCES runs(id),
        idx INTEGER NOT NULL, status TEXT NOT NULL,
        decision_json TEXT NOT NULL,
        policy_json TEXT NOT NULL DEFAULT '',
        observation_json TEXT NOT NULL DEFAULT '',
        spec_hash TEXT NOT NULL DEFAULT '',
        policy_id TEXT NOT NULL DEFAULT '',
        started_at TEXT NOT NULL,
        finished_at TEXT NOT NULL DEFAULT '', UNIQUE(run_id, idx));
    CREATE TABLE approvals(id TEXT PRIMARY KEY,
        run_id TEXT NOT NULL REFERENCES runs(id),
        step_id TEXT NOT NULL, kind TEXT NOT NULL,
        capability_json TEXT NOT NULL,
        presentation_json TEXT NOT NULL,
        request_json TEXT NOT NULL, hash TEXT NOT NULL,
        status TEXT NOT NULL, created_at TEXT NOT NULL,
        expires_at TEXT NOT NULL DEFAULT '',
        decided_at TEXT NOT NULL DEFAULT '',
        decided_by TEXT NOT NULL DEFAULT '',
        note TEXT NOT NULL DEFAULT '');
    CREATE INDEX approvals_run ON approvals(run_id);
    CREATE TABLE tool_specs(hash TEXT PRIMARY KEY,
        spec_json TEXT NOT NULL);
    CREATE TABLE calls(id INTEGER PRIMARY KEY AUTOINCREMENT,
        session TEXT NOT NULL, request_key TEXT NOT NULL,
        tool TEXT NOT NULL, side_effect TEXT NOT NULL,
        run_id TEXT NOT NULL UNIQUE, created_at TEXT NOT NULL,
        open INTEGER NOT NULL DEFAULT 1,
        closed_at TEXT NOT NULL DEFAULT '',
        settled_at TEXT NOT NULL DEFAULT '',
        outcome INTEGER NOT NULL DEFAULT 0);
    CREATE UNIQUE INDEX calls_open ON calls(session, request_key)
        WHERE open = 1;
    CREATE INDEX calls_key ON calls(session, request_key, id);
    CREATE INDEX calls_unsettled ON calls(session, settled_at, id);
    CREATE INDEX calls_tool ON calls(session, tool, outcome, id);
    CREATE TABLE events(seq INTEGER PRIMARY KEY AUTOINCREMENT,
        run_id TEXT NOT NULL, step_id TEXT NOT NULL DEFAULT '',
        at TEXT NOT NULL, type TEXT NOT NULL,
        payload_json TEXT NOT NULL, hash TEXT NOT NULL);
    CREATE INDEX events_run ON events(run_id, seq);
    """,
    # 2. What limits count (amounts_json unused), and the grants.
    """
    CREATE TABLE executions(id INTEGER PRIMARY KEY,
        tool TEXT NOT NULL, at TEXT NOT NULL, run_id TEXT NOT NULL,
        step_id TEXT NOT NULL,
        amounts_json TEXT NOT NULL DEFAULT '{}');
    INSERT INTO executions(tool, at, run_id, step_id)
        SELECT c.tool, e.at, e.run_id, e.step_id FROM events e
        JOIN calls c ON c.run_id=e.run_id
        WHERE e.type='step.tool_started' ORDER BY e.seq;
    CREATE INDEX executions_tool ON executions(tool, at);
    CREATE TABLE grants(id TEXT PRIMARY KEY, session TEXT NOT NULL,
        tool TEXT NOT NULL, name TEXT NOT NULL,
        conditions_json TEXT NOT NULL, created_at TEXT NOT NULL,
        expires_at TEXT NOT NULL, by TEXT NOT NULL,
        note TEXT NOT NULL DEFAULT '',
        revoked_at TEXT NOT NULL DEFAULT '',
        revoked_by TEXT NOT NULL DEFAULT '',
        revoke_note TEXT NOT NULL DEFAULT '');
    CREATE INDEX grants_tool ON grants(session, tool, expires_at);
    """,
    "", "", "",  # 3 to 5 rewrite nothing (the chain binds the old rows)
    # 6. The rules across calls read every session's calls.
    """
    DROP INDEX calls_key;
    DROP INDEX calls_tool;
    CREATE INDEX calls_request ON calls(request_key, id);
    CREATE INDEX calls_target ON calls(tool, outcome, id);
    """,
    # 7. Calls answered as tasks (section 9): what the host is told of each.
    """
    CREATE TABLE tasks(id TEXT PRIMARY KEY, tool TEXT NOT NULL,
        args_json TEXT NOT NULL, client TEXT NOT NULL,
        status TEXT NOT NULL, approval_id TEXT NOT NULL DEFAULT '',
        answer_json TEXT NOT NULL DEFAULT '',
        created_at TEXT NOT NULL, updated_at TEXT NOT NULL,
        cancel_asked INTEGER NOT NULL DEFAULT 0,
        lease_owner TEXT NOT NULL DEFAULT '',
        lease_expires_at TEXT NOT NULL DEFAULT '');
    """,
]

class StoreError(Exception):
    """The records could not be read or written."""

class Race(Exception):
    """A write's records changed since read: Gate._decide says AGAIN.
    Raised, not returned: Store._commit undoes the job's savepoint."""

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED")
# What a settled call's last attempt came to (0: unsettled).
OUTCOME_NONE, OUTCOME_KNOWN, OUTCOME_UNKNOWN = 1, 2, 3
# A read replaces any open row: reads never race for a key.
ANY_ROW = "any open row"
KeyRun = collections.namedtuple(
    "KeyRun", "run_id status reason detail finished owner expires open")
UNKNOWN_ENDINGS = ("timed_out", "no_answer", "cut_off")
CALL_ENDINGS = ("ok", "error", "unsent", "unrecorded", "timed_out",
                "no_answer")
LARGE_VALUE_BYTES = 4096
# A run's newest attempt; `attempt` as an approval names it.
Attempt = collections.namedtuple("Attempt", "ending observed finished attempt")

def attempt_of(run_id, step_id, started, ended):
    """An attempt as an approval names it."""
    return {"run_id": run_id, "step_id": step_id, "started_at": started,
            "ended": ended}
ATTEMPT_STEPS = ("SELECT id, status, observation_json, started_at, finished_at"
                 " FROM steps WHERE run_id=? AND json_extract(decision_json,"
                 " '$.kind')='tool_call' ORDER BY idx DESC")
ASKED_AGAIN = ("SELECT capability_json FROM approvals WHERE step_id=? AND"
               " kind='interrupted_side_effect' ORDER BY rowid DESC LIMIT 1")
CALL_RUN = "FROM calls c JOIN runs r ON r.id=c.run_id"
CHAIN_HEAD = ("SELECT (SELECT seq FROM sqlite_sequence WHERE name='events'),"
              " (SELECT seq FROM events ORDER BY seq DESC LIMIT 1),"
              " (SELECT hash FROM events ORDER BY seq DESC LIMIT 1)")
OPEN_ROW = (f"SELECT c.run_id, r.status {CALL_RUN} WHERE c.request_key=? AND"
            " c.open=1 ORDER BY c.id DESC")
WAITING = (f"SELECT count(*) {CALL_RUN} JOIN approvals a ON a.run_id = r.id"
           " WHERE c.session=? AND c.settled_at='' AND"
           " r.status='WAITING_FOR_APPROVAL' AND a.status='pending' AND"
           " (a.expires_at='' OR a.expires_at>?) AND a.rowid = (SELECT"
           " max(rowid) FROM approvals b WHERE b.run_id=r.id)")
NO_LEASE = "lease_owner='', lease_expires_at=''"
TASK_COLUMNS = ("id", "tool", "args_json", "client", "status", "approval_id",
                "answer_json", "created_at", "updated_at", "cancel_asked",
                "lease_expires_at")

def step_outcome(observed):
    """What a step came to, from its fields, never its prose."""
    kind, content = observed["kind"], observed.get("content", {})
    if kind == "tool_error":
        return content["ending"]
    if kind == "interrupted":
        cut = content.get("previous_status") == "executing"
        return "cut_off" if cut else "interrupted"
    if kind == "policy_denied":
        return "rejected" if "approval_id" in content else "denied"
    return {"tool_result": "ok", "invalid_decision": "invalid"}.get(kind, "")

def last_attempt(rows, run_id):
    """A run's newest attempt, or None; a re-run asked, not run,
    stands for the attempt its approval names."""
    for row in rows(ATTEMPT_STEPS, (run_id,)):
        step_id, status, kept, started, finished = row
        observed = parse(kept) if kept else None
        ending = step_outcome(observed) if observed else ""
        if status == "executing" or ending == "cut_off":
            ending, observed = "cut_off", None
        if ending == "unsent":  # no byte reached the server
            continue
        if ending == "cut_off" or ending in CALL_ENDINGS:
            attempt = attempt_of(run_id, step_id, started, ending)
            return Attempt(ending, observed, finished, attempt)
        asked = rows(ASKED_AGAIN, (step_id,))
        if asked:
            prior = parse(asked[0][0])["interrupted"]
            return Attempt(prior["ended"], None, finished, prior)
    return None

def kept_once(value):
    """A value in an event: a long string as its size and hash
    (its row keeps it whole; the chain binds every byte)."""
    if isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        return value_digest(data) if len(data) > LARGE_VALUE_BYTES else value
    if isinstance(value, dict):
        return {k: kept_once(v) for k, v in value.items()}
    if isinstance(value, list):
        return [kept_once(v) for v in value]
    return value

def event_hash(prev, seq, run_id, step_id, at, type_, payload):
    fields = (prev, str(seq), run_id, step_id, at, type_, payload)
    data = [f.encode("utf-8", "surrogatepass") for f in fields]
    return sha256_hex(b"".join(b"%d:%s," % (len(f), f) for f in data))

class Tx:
    """One write transaction: its rows and the events that
    commit with them."""
    def __init__(self, db):
        self.execute = db.execute
        self.parts = {}
        # Read under the write lock: processes extend one chain. The next seq
        # follows every seq used (a deleted tail leaves a gap verify reports).
        used, newest, digest = db.execute(CHAIN_HEAD).fetchone()
        self.head = (max(used or 0, newest or 0), digest or "")
    def rows(self, sql, args=()):
        return self.execute(sql, args).fetchall()
    def one(self, sql, *args):
        return self.execute(sql, args).fetchone()
    def event(self, run_id, type_, payload, step_id=""):
        seq, at, body = self.head[0] + 1, now(), dumps(payload)
        digest = event_hash(self.head[1], seq, run_id, step_id, at, type_,
                            body)
        self.execute("INSERT INTO events(seq, run_id, step_id, at, type,"
                     " payload_json, hash) VALUES(?,?,?,?,?,?,?)",
                     (seq, run_id, step_id, at, type_, body, digest))
        self.head = (seq, digest)
    def part(self, run_id, type_, payload, step_id=""):
        self.parts.setdefault(run_id, []).append([type_, step_id, payload])
    def flush(self):
        """One event per run: its one part, else call.began,
        call.changed or call.ended."""
        for run_id, parts in self.parts.items():
            if len(parts) == 1:
                type_, step_id, payload = parts[0]
                self.event(run_id, type_, payload, step_id)
                continue
            types = [p[0] for p in parts]
            ends = "run.finished" in types or "step.tool_finished" in types
            type_ = ("call.began" if types[0] == "run.created"
                     else "call.ended" if ends else "call.changed")
            step_id = next((p[1] for p in parts if p[1]), "")
            self.event(run_id, type_, {"parts": parts}, step_id)
    def insert(self, table, columns, row):
        marks = ", ".join("?" * len(columns))
        self.execute(f"INSERT INTO {table}({', '.join(columns)})"
                     f" VALUES({marks})", tuple(row[c] for c in columns))
    def changed(self, sql, args):
        """Change one row, or raise Race: it changed since read."""
        if self.execute(sql, args).rowcount != 1:
            raise Race()
    def begin_run(self, run_id, session, tool, target, key,
                  side_effect, tool_hashes, lease, seen):
        """Claim the request's calls row and begin its run. Race unless the
        open row is still `seen` and ended: a run of the key begun since wins."""
        at = now()
        row = self.one(OPEN_ROW, key)
        if seen is not ANY_ROW:
            moved = (row[0] if row else None) != seen
            if moved or (row and row[1] not in TERMINAL):
                raise Race()
        self.execute("UPDATE calls SET open=0, closed_at=? WHERE request_key=?"
                     " AND open=1", (at, key))
        self.execute("INSERT INTO calls(session, request_key, tool,"
                     " side_effect, run_id, created_at) VALUES(?,?,?,?,?,?)",
                     (session, key, target, side_effect, run_id, at))
        self.execute("INSERT INTO runs(id, session, tool, status, created_at,"
                     " lease_owner, lease_expires_at) VALUES(?,?,?,?,?,?,?)",
                     (run_id, session, tool, "RUNNING", at, *lease))
        self.part(run_id, "run.created",
                  {"goal": f"call {tool}", "tools": tool_hashes})
        self.part(run_id, "run.started", {})
    def keep_spec(self, tool):
        self.execute("INSERT OR IGNORE INTO tool_specs(hash, spec_json)"
                     " VALUES(?,?)", (tool.spec_hash, tool.spec_json))
        return tool.spec_hash
    def start_step(self, run_id, decision, tool=None):
        step_id = new_id(16)
        index = self.one("SELECT step_count FROM runs WHERE id=?", run_id)[0]
        self.execute("UPDATE runs SET step_count=step_count+1 WHERE id=?",
                     (run_id,))
        spec_hash = self.keep_spec(tool) if tool is not None else ""
        self.execute("INSERT INTO steps(id, run_id, idx, status, decision_json,"
                     " spec_hash, started_at) VALUES(?,?,?,?,?,?,?)",
                     (step_id, run_id, index, "deciding", dumps(decision),
                      spec_hash, now()))
        self.part(run_id, "step.started", {"index": index}, step_id)
        self.part(run_id, "step.decided", kept_once(decision), step_id)
        return step_id
    def record_policy(self, run_id, step_id, policy, policy_id):
        self.execute("UPDATE steps SET policy_json=?, policy_id=? WHERE id=?",
                     (dumps(policy), policy_id, step_id))
        spec_hash = self.one("SELECT spec_hash FROM steps WHERE id=?",
                             step_id)[0]
        self.part(run_id, "step.policy", {
            **policy, "policy_id": policy_id, "spec_hash": spec_hash}, step_id)
    def end_step(self, step_id, status, observation=None):
        kept = dumps(observation) if observation else ""
        self.execute("UPDATE steps SET status=?, observation_json=?,"
                     " finished_at=? WHERE id=?",
                     (status, kept, now(), step_id))
    def fail_step(self, run_id, step_id, observation, detail):
        self.end_step(step_id, "failed", observation)
        self.part(run_id, "step.failed",
                  {"detail": detail, "observation": observation}, step_id)
    def finish_run(self, run_id, status, reason, detail,
                   extra=None, outcome=None):
        """End a run and settle its calls row; Race if it ended. Without `outcome`
        the last attempt's stands (a refused re-run leaves an unknown open)."""
        current, steps = self.one(
            "SELECT status, step_count FROM runs WHERE id=?", run_id)
        if current in TERMINAL:
            raise Race()
        if outcome is None:
            attempt = last_attempt(self.rows, run_id)
            unknown = attempt and attempt.ending in UNKNOWN_ENDINGS
            outcome = (OUTCOME_NONE if attempt is None
                       else OUTCOME_UNKNOWN if unknown else OUTCOME_KNOWN)
        if status != "COMPLETED":
            closing = {"kind": "fail", "message": detail, "origin": "operator"}
            self.end_step(self.start_step(run_id, closing), "done")
            steps += 1
        self.execute(f"UPDATE runs SET status=?, reason=?, detail=?,"
                     f" finished_at=?, {NO_LEASE} WHERE id=?",
                     (status, reason, detail, now(), run_id))
        self.part(run_id, "run.finished", {
            "status": status, "reason": reason, "detail": detail,
            "steps": steps, **(extra or {})})
        self.execute("UPDATE calls SET settled_at=?, outcome=? WHERE run_id=?",
                     (now(), outcome, run_id))
    def pause(self, run_id, step_id, approval):
        """Wait for an operator; a run ended meanwhile: Race."""
        self.changed(f"UPDATE runs SET status='WAITING_FOR_APPROVAL',"
                     f" {NO_LEASE} WHERE id=? AND status IN ('RUNNING',"
                     " 'WAITING_FOR_APPROVAL')", (run_id,))
        self.execute("UPDATE steps SET status='awaiting_approval' WHERE id=?",
                     (step_id,))
        self.insert("approvals", APPROVAL_COLUMNS, approval)
        shown = parse(approval["presentation_json"])
        self.part(run_id, "approval.requested", {
            "approval_id": approval["id"], "kind": approval["kind"],
            "reason": shown.get("reason", ""),
            "capability": kept_once(parse(approval["capability_json"])),
            "presentation": kept_once(shown), "hash": approval["hash"]},
            step_id)
    def resume(self, run_id, approval_id, lease):
        """Run again on its newest approval, granted; else Race."""
        self.changed("UPDATE runs SET status='RUNNING', lease_owner=?,"
                     " lease_expires_at=? WHERE id=? AND"
                     " status='WAITING_FOR_APPROVAL' AND (SELECT id, status"
                     " FROM approvals WHERE run_id=? ORDER BY rowid DESC"
                     " LIMIT 1) = (?, 'approved')",
                     (*lease, run_id, run_id, approval_id))
        self.part(run_id, "run.resumed", {"approval_id": approval_id})
    def start_execution(self, run_id, step_id, tool, args, target,
                        approval_id=""):
        """From here its outcome may be unknown; every process's
        limits count it from this commit on."""
        self.execute("UPDATE steps SET status='executing' WHERE id=?",
                     (step_id,))
        self.execute("INSERT INTO executions(tool, at, run_id, step_id)"
                     " VALUES(?,?,?,?)", (target, now(), run_id, step_id))
        said = {"tool": tool, "args": kept_once(args)}
        if approval_id:
            said["approval_id"] = approval_id
        self.part(run_id, "step.tool_started", said, step_id)
    def finish_execution(self, run_id, step_id, tool, observation,
                         duration_ms):
        record = observation.get("result")
        said = ({"summary": observation["summary"], "bytes": record["bytes"],
                 "sha256": record["sha256"]} if record
                else {"error": observation["content"]["error"]})
        self.part(run_id, "step.tool_finished",
                  {"tool": tool, "duration_ms": duration_ms, **said}, step_id)
        if observation["kind"] != "tool_result":
            self.fail_step(run_id, step_id, observation,
                           observation["summary"])
            return
        self.end_step(step_id, "done", observation)
        self.finish_run(run_id, "COMPLETED", "goal_completed",
                        f"terminal tool {tool}", outcome=OUTCOME_KNOWN)
    def waiting(self, session):
        """The session's questions that wait, unexpired."""
        return self.one(WAITING, session, now())[0]
    def run_holder(self, run_id):
        return self.one("SELECT status, lease_owner FROM runs WHERE id=?",
                        run_id)
    def step_started(self, step_id):
        return self.one("SELECT started_at FROM steps WHERE id=?",
                        step_id)[0]
    def take_over(self, run_id, lease):
        """Take a lease left to run out, its steps marked interrupted:
        (step_id, started_at) of one cut off while executing, or None."""
        row = self.one("SELECT lease_owner, lease_expires_at FROM runs"
                       " WHERE id=? AND status='RUNNING'", run_id)
        # Not another process's live lease; this one's own means a
        # failed write (it never takes over what it executes).
        owner, expires = row or (None, None)
        if row is None or owner and expires > now() and owner != lease[0]:
            raise Race()
        self.execute("UPDATE runs SET lease_owner=?, lease_expires_at=?"
                     " WHERE id=?", (*lease, run_id))
        if owner:
            self.part(run_id, "lease.taken_over", {
                "previous_owner": owner, "previous_expires_at": expires,
                "owner": lease[0]})
        cut_step = None
        for step_id, status, started in self.rows(
                "SELECT id, status, started_at FROM steps WHERE run_id=? AND"
                " status IN ('deciding', 'executing') ORDER BY idx",
                (run_id,)):
            was = {"previous_status": status}
            self.end_step(step_id, "interrupted", {
                "kind": "interrupted", "content": was,
                "summary": f"step interrupted while {status}"})
            self.part(run_id, "step.interrupted", was, step_id)
            if status == "executing":
                cut_step = (step_id, started)
        return cut_step
    def decide_approval(self, approval_id, shown_hash, status, by, note):
        """Decide on the hash shown: 'decided', 'changed' or 'expired'."""
        row = self.one("SELECT a.run_id, a.step_id, a.expires_at FROM"
                       " approvals a JOIN runs r ON r.id = a.run_id WHERE"
                       " a.id=? AND a.status='pending' AND a.hash=? AND"
                       " r.status='WAITING_FOR_APPROVAL'",
                       approval_id, shown_hash)
        if row is None:
            return "changed"
        run_id, step_id, expires = row
        if expires and expires <= now():
            self.expire_approval(approval_id, run_id, step_id)
            return "expired"
        self._close_approval(run_id, step_id, approval_id, status, by, note)
        if status == "rejected":
            denied = {"approval_id": approval_id, "note": note}
            self.fail_step(run_id, step_id, {"kind": "policy_denied",
                           "content": denied}, f"rejected by {by}")
            self.finish_run(run_id, "CANCELLED", "approval_rejected", note)
        return "decided"
    def _close_approval(self, run_id, step_id, approval_id, status, by, note):
        self.execute("UPDATE approvals SET status=?, decided_at=?,"
                     " decided_by=?, note=? WHERE id=?",
                     (status, now(), by, note, approval_id))
        self.part(run_id, "approval.decided", {"approval_id": approval_id,
                  "status": status, "by": by, "note": note}, step_id)
    def expire_approval(self, approval_id, run_id, step_id):
        """A question not answered, or a grant not collected."""
        self.changed("UPDATE approvals SET status='expired',"
                     " decided_at=coalesce(nullif(decided_at, ''), ?),"
                     " note=coalesce(nullif(note, ''), 'expired') WHERE id=?"
                     " AND status IN ('pending', 'approved')",
                     (now(), approval_id))
        self.part(run_id, "approval.decided",
                  {"approval_id": approval_id, "status": "expired"}, step_id)
        self.execute("UPDATE steps SET status='failed', finished_at=? WHERE"
                     " id=? AND status='awaiting_approval'", (now(), step_id))
        self.finish_run(run_id, "CANCELLED", "approval_expired",
                        f"approval {approval_id} expired")
    def record_read(self, run_id, session, tool, decision, policy,
                    policy_id, started, observation, ended, duration_ms):
        """An allowed read once answered: its run and a run.read
        event (no calls row, no execution row)."""
        status, reason, detail = ended
        self.execute("INSERT INTO runs(id, session, tool, status, reason,"
                     " detail, step_count, created_at, finished_at)"
                     " VALUES(?,?,?,?,?,?,1,?,?)", (run_id, session, tool.name,
                     status, reason, detail, started, now()))
        policy = {**policy, "policy_id": policy_id,
                  "spec_hash": self.keep_spec(tool)}
        self.part(run_id, "run.read", {
            "decision": decision, "duration_ms": duration_ms,
            "status": status, "policy": policy,
            "started_at": started, "observation": observation}, new_id(16))
    def create_grant(self, grant):
        columns = GRANT_COLUMNS[:9]
        self.insert("grants", columns, grant)
        said = {c: grant[c] for c in columns[1:] if c != "conditions_json"}
        said["conditions"] = parse(grant["conditions_json"])
        self.part(grant["id"], "grant.created", said)
    def revoke_grant(self, grant_id, by, note):
        """End a grant now; False when it was not in force."""
        at = now()
        if self.execute("UPDATE grants SET revoked_at=?, revoked_by=?,"
                        " revoke_note=? WHERE id=? AND revoked_at='' AND"
                        " expires_at>?", (at, by, note, grant_id, at)
                        ).rowcount != 1:
            return False
        self.part(grant_id, "grant.revoked", {"by": by, "note": note})
        return True
    def cancel_run(self, run_id, by, note):
        """An operator ends a run: a pending question is rejected;
        a cut execution's outcome stays unknown."""
        for approval_id, step_id in self.rows(
                "SELECT id, step_id FROM approvals WHERE run_id=? AND"
                " status='pending'", (run_id,)):
            self._close_approval(run_id, step_id, approval_id, "rejected",
                                 by, note)
        for step_id, status in self.rows(
                "SELECT id, status FROM steps WHERE run_id=? AND status IN"
                " ('deciding', 'awaiting_approval', 'executing')", (run_id,)):
            content = {"by": by, "note": note, "previous_status": status}
            self.fail_step(run_id, step_id, {"kind": "interrupted",
                           "content": content}, f"cancelled by {by}")
        self.finish_run(run_id, "CANCELLED", "operator_cancelled", note,
                        extra={"by": by})

class Store:
    """The record: a writer, a reader and the heartbeat's
    connection, each with its own lock."""
    def __init__(self, path, readonly=False, create=True):
        self.path, writes = path, not readonly
        self.lock = threading.RLock()
        self.jobs, self.jobs_lock = [], threading.Lock()
        self._check_files(tighten=writes)
        if create and writes and not os.path.exists(path):
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                 0o600))
            except FileExistsError:
                pass
            except OSError as err:
                raise StoreError(f"database {path} cannot be created:"
                                 f" {err.strerror}") from None
        elif not os.path.exists(path):
            raise StoreError(f"database {path} does not exist; start the gate"
                             " once to create it, or name the right file with"
                             " -db")
        uri = "file:" + path.replace("?", "%3f").replace("#", "%23")
        uri += "" if writes else "?mode=ro"
        try:
            self.db = self._connect(uri)
            if writes:
                self._wal()
                self.db.execute("PRAGMA synchronous=FULL")
            self._check_schema(migrate=create and writes)
            # A reader of its own never waits on a sync; writes catch stale reads.
            self.reader = self._connect(uri) if writes else self.db
            self.read_lock = threading.Lock() if writes else self.lock
            # The heartbeat's own: leases renew while commits stall.
            self.lease_db = self._connect(uri) if writes else None
            self.lease_lock = threading.Lock()
        except sqlite3.Error as err:
            raise StoreError(f"database {path} cannot be opened: {err}"
                             ) from None
        self._check_files(tighten=writes)  # refuses a file swapped in
    @staticmethod
    def _connect(uri):
        db = sqlite3.connect(uri, uri=True, isolation_level=None,
                             timeout=5.0, check_same_thread=False)
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
        for path in (self.path, self.path + "-wal", self.path + "-shm"):
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            check_owned(path, "database file", st, error=StoreError)
            if st.st_mode & 0o044 and tighten:
                os.chmod(path, 0o600)
    def _version(self):
        return self.db.execute("SELECT max(version) FROM schema_migrations"
        ).fetchone()[0] or 0
    def _check_schema(self, migrate):
        db, path, known = self.db, self.path, len(SCHEMA)
        unsafe = db.execute("SELECT name FROM sqlite_master WHERE type IN"
                            " ('trigger', 'view') LIMIT 1").fetchone()
        if unsafe:
            raise StoreError(f"database {path} holds a trigger or view"
                             f" ({unsafe[0]}), which agentgate never creates;"
                             " it will not use this file")
        has = db.execute("SELECT 1 FROM sqlite_master"
                         " WHERE name='schema_migrations'").fetchone()
        version = self._version() if has else 0
        if version > known:
            raise StoreError(f"database {path} was migrated by a newer"
                             f" agentgate (schema version {version}, this one"
                             f" knows {known}); use the newer agentgate")
        if version == known:
            return
        if not migrate:
            raise StoreError(f"database {path} has schema version {version},"
                             f" older than this agentgate's {known}; start the"
                             " gate once to migrate it")
        db.execute("BEGIN IMMEDIATE")
        with db:  # commits, or rolls back what stops it
            # Read again, locked: another process may have migrated.
            db.execute("CREATE TABLE IF NOT EXISTS schema_migrations("
                       "version INTEGER PRIMARY KEY,"
                       " applied_at TEXT NOT NULL)")
            for number in range(self._version() + 1, known + 1):
                for statement in SCHEMA[number - 1].split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute("INSERT INTO schema_migrations VALUES(?, ?)",
                           (number, now()))
    def close(self):
        with self.lock, self.read_lock, self.lease_lock:
            for db in (self.reader, self.db, self.lease_db):
                if db is not None:
                    db.close()
    def write(self, fn):
        """fn(tx) in BEGIN IMMEDIATE (only here), its result once durable; writes
        queued meanwhile commit with it, each in a savepoint of its own."""
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
        db = self.db
        try:
            db.execute("BEGIN IMMEDIATE")
            for job in batch:
                db.execute("SAVEPOINT change")
                try:
                    tx = Tx(db)
                    job["result"] = job["fn"](tx)
                    tx.flush()
                except Exception as err:
                    db.execute("ROLLBACK TO change")
                    job["error"] = write_error(err)
                db.execute("RELEASE change")
            db.execute("COMMIT")
        except BaseException as err:
            # Nothing committed: every caller in the batch hears so.
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            stored = isinstance(err, sqlite3.Error)
            failure = StoreError(f"the records could not be written: {err}"
                if stored else "the write was interrupted before it was committed")
            for job in batch:
                job["error"] = failure
            if not stored:
                raise
        finally:
            for job in batch:
                job["done"] = True
    def renew_leases(self, owner, until, run_ids, task_ids=()):
        """The heartbeat's write (no event: it decides nothing)."""
        with self.lease_lock:
            try:  # each statement its own transaction
                for table, ids in (("runs", run_ids), ("tasks", task_ids)):
                    if not ids:
                        continue
                    marks = ", ".join("?" * len(ids))
                    self.lease_db.execute(
                        f"UPDATE {table} SET lease_expires_at=? WHERE"
                        f" lease_owner=? AND status IN ('RUNNING',"
                        f" 'working') AND id IN ({marks})",
                        (until, owner, *ids))
            except sqlite3.Error as err:
                raise StoreError(f"the leases could not be renewed: {err}"
                ) from None
    # Reads span every session (init gives each host a gate on one database):
    # two servers given one name share a key's rules (refused, never run twice).
    def key_runs(self, key, since, newest_only):
        """Newest first, in one statement: the open row is the
        newest as of every row read."""
        limit = " LIMIT 1" if newest_only else ""
        return [KeyRun(*row) for row in self.read(
            "SELECT r.id, r.status, r.reason, r.detail, r.finished_at,"
            f" r.lease_owner, r.lease_expires_at, c.open {CALL_RUN} WHERE"
            " c.request_key=? AND (c.open=1 OR c.settled_at='' OR"
            " c.settled_at>=?) ORDER BY c.id DESC" + limit, (key, since))]
    def open_run(self, key):
        row = self.read_one(OPEN_ROW, (key,))
        return row[0] if row else None
    def attempt_runs(self, key):
        return self.read(f"SELECT r.id, r.status {CALL_RUN} WHERE"
                         " c.request_key=? AND c.outcome!=? ORDER BY c.id"
                         " DESC", (key, OUTCOME_NONE))
    def unsettled_runs(self, target, key):
        """The tool's unsettled runs of other requests."""
        return self.read("SELECT r.id, r.status, r.lease_owner,"
                         f" r.lease_expires_at {CALL_RUN} WHERE c.tool=? AND"
                         " c.outcome=0 AND c.settled_at='' AND"
                         " c.request_key!=? ORDER BY c.id", (target, key))
    def unknown_for_tool(self, target, key):
        """Other requests of the tool whose newest attempt is unknown."""
        return self.read(f"SELECT c.request_key, c.run_id, r.reason {CALL_RUN}"
                         " WHERE c.tool=? AND c.request_key!=? AND c.outcome=?"
                         " AND c.id = (SELECT max(id) FROM calls d WHERE"
                         " d.request_key=c.request_key AND d.outcome!=?)"
                         " ORDER BY c.id",
                         (target, key, OUTCOME_UNKNOWN, OUTCOME_NONE))
    def read_approvals(self, joined, args, extra=()):
        """Approvals as dicts of APPROVAL_COLUMNS and of `extra`,
        (name, expression) pairs."""
        chosen = [f"a.{c}" for c in APPROVAL_COLUMNS] + [e for _, e in extra]
        names = APPROVAL_COLUMNS + tuple(n for n, _ in extra)
        rows = self.read(f"SELECT {', '.join(chosen)} {joined}", args)
        return [dict(zip(names, row)) for row in rows]
    def latest_approval(self, run_id):
        rows = self.read_approvals("FROM approvals a WHERE a.run_id=? ORDER BY"
                                   " a.rowid DESC LIMIT 1", (run_id,))
        return rows[0] if rows else None
    def approval(self, approval_id):
        rows = self.read_approvals("FROM approvals a JOIN runs r ON r.id ="
                                   " a.run_id WHERE a.id=?", (approval_id,),
                                   (("run_status", "r.status"),))
        return rows[0] if rows else None
    def task(self, task_id):
        row = self.read_one(f"SELECT {', '.join(TASK_COLUMNS)} FROM tasks"
                            " WHERE id=?", (task_id,))
        return row and dict(zip(TASK_COLUMNS, row))
    def step_decision(self, step_id):
        row = self.read_one("SELECT decision_json FROM steps WHERE id=?",
                            (step_id,))
        return parse(row[0])
    def read(self, sql, args=()):
        with self.read_lock:
            try:
                return self.reader.execute(sql, args).fetchall()
            except sqlite3.Error as err:
                raise StoreError(f"the records could not be read: {err}"
                ) from None
    def read_one(self, sql, args=()):
        return next(iter(self.read(sql, args)), None)

def write_error(err):
    """What a write's caller hears of a failed statement; a unique
    index refusing a row is a lost race (3.9 has no error code)."""
    if not isinstance(err, sqlite3.Error):
        return err
    if isinstance(err, sqlite3.IntegrityError) and str(err).startswith(
            "UNIQUE constraint failed"):
        return Race()
    return StoreError(f"the records could not be written: {err}")


# =============================================================================================
# 8. The gate
#
# Reads as: decision core
#
# Owns: one call's passage (judge, decide, begin, hold, execute, record) and
# the rules over earlier runs, in any session, of the same request and tool.
# Promises: nothing runs that the policy did not allow or an operator did not
# approve by hash; an approval binds the recorded request, never a later
# call's bytes; the outcome is recorded even when the host has gone.
# One lock: two threads never both begin a request; across processes the
# unique open-row index does, and a lost race is decided again. Judging comes
# before the lock, executing and holding after it. An executing run holds a
# lease its process renews; one whose lease ran out is taken over. All is
# recorded before it is sent, but a read allowed outright (_begin). A write
# acting on a decision makes it once, with all the facts: a verdict.
# Seams: the upstream's `request` (21), `announce` and `duplicate` (26).
# =============================================================================================

TOOL_CALL = "tool_call"

def tool_step(tool, args, origin="model", invalid=None):
    """A call's step as recorded: its arguments, or the refused frame."""
    kept = {"invalid_args": invalid[1]} if invalid else {"args": args}
    return {**kept, "kind": TOOL_CALL, "origin": origin, "tool": tool.name}

# Verdicts besides an Answer. A read recorded once it answers has no
# `step_id`, but `record` (policy, start).
Wait = collections.namedtuple("Wait", "approval")
Execute = collections.namedtuple("Execute", "run_id step_id args record work",
                                 defaults=(None, None))
NEXT = "next"    # a rule decides nothing: the next rule or run does
STOP = "stop"    # rule 5 met an unknown outcome: rule 6 decides
AGAIN = "again"  # a run or approval ended, or a race was lost

def file_stamp(path):
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return st.st_mtime_ns, st.st_size, st.st_ino

class Caller(threading.local):
    client = ""  # the host a call names, on the thread that calls

class Gate:
    """The gate of one serving process."""

    def __init__(self, config, store, tools):
        self.config, self.store = config, store
        self.tools = {tool.name: tool for tool in tools}
        self.policy_id = config.policy_id()
        named = sorted(tools, key=lambda t: t.name)
        self.tool_hashes = [tool.spec_hash for tool in named]
        self.owner = f"{PROGRAM}:{config.session}/{secrets.token_hex(6)}"
        self.lock = threading.Lock()
        self.active = set()  # what this process executes: never taken over
        self.stopping = threading.Event()
        self.announce = lambda approval, tool, run_id: None
        self.duplicate = lambda tool, run_id, at, window: None
        self.quarantined = frozenset()  # see quarantine
        self.held = {}  # server -> the names it holds
        self.caller = Caller()
        self.driving = set()  # the tasks this process drives (section 9)
        self.config_read = file_stamp(config.path)
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def lease(self):
        return self.owner, later(now(), self.config.lease_ttl)

    def quarantine(self, server, pinned, live):
        """(changes by kind, names held, whether what is offered moved).
        From now on a tool `server` changed or removed since its pin is
        not offered, and refused; all of them while `live` is None (it
        cannot be listed). The other servers' stay as they are."""
        changes = tool_changes(pinned, live or {})
        found = {kind: sorted(n for n, c in changes.items() if c[0] == kind)
                 for kind in CHANGE_KINDS}
        offered = {t.upstream_name: t.name for t in self.tools.values()
                   if t.server.name == server}
        held = sorted(offered[n] for n in found["changed"] + found["removed"]
                      if n in offered)
        with self.lock:
            moved = held != self.held.get(server, [])
            self.held[server] = held
            self.quarantined = frozenset(
                n for names in self.held.values() for n in names)
        return found, held, moved

    def _heartbeat(self):
        """Renew leases; a run stranded by a failed write is taken over."""
        path, third = self.config.path, self.config.lease_ttl / 3
        while not self.stopping.wait(third / SECOND):
            if self.config_read and file_stamp(path) != self.config_read:
                self.config_read = None  # said once
                log(f"config {path} changed since this gate started; it goes"
                    " on serving the one it read: restart the host to serve"
                    " the new one")
            try:
                active = sorted(self.active.copy())  # atomic
                driving = sorted(self.driving.copy())
                self.store.renew_leases(*self.lease(), active, driving)
            except Exception as err:  # outlives any one failure
                log(f"could not renew leases: {err}")

    def window(self, tool):
        rule = tool.rule.repeat_window
        return self.config.repeat_window if rule is None else rule

    def _decision(self, tool, args, judged, rows=None, attempt=None,
                  approved=False):
        """(decision, facts). Limits count only through the `rows` of the
        write acting on it: racing calls never pass one."""
        counts = rows is not None and bool(tool.rule.limits)
        facts = decision_facts(rows or self.store.read, self.config.session, tool,
                               format_time(time.time()), self.caller.client, counts)
        return evaluate(self.config, tool, args, facts, attempt, approved, judged), facts

    def call(self, tool, args, invalid="", progress=None, cancelled=None,
             client="", asked=None):
        """A tools/call's Answer. `invalid`: (why, frame) of unusable arguments;
        `client`: the host's name; `asked(approval)`: a task's, see _hold."""
        cancelled = cancelled or threading.Event()
        self.caller.client = client
        executing = False
        try:
            args = {} if args is None else args
            encoded = None if invalid else canonical(args)
            cap = self.config.max_argument_bytes
            if encoded is not None and len(encoded) > cap:
                why = SLOT_PROSE["arguments_too_large"].format(size=len(encoded), cap=cap)
                invalid = (why, recorded_frame(encoded))
            if invalid:
                with self.lock:
                    return self._begin(tool, None, f"invalid:{new_id(8)}", None, None,
                                       invalid=invalid, cancelled=cancelled)
            key = request_key(tool.target, encoded)
            judged, early = self._judge(tool, args)
            held, races = False, 0
            while races <= 5:
                with self.lock:
                    verdict = self._decide(tool, args, key, judged, early, cancelled)
                if verdict is AGAIN:
                    races += 1
                    continue
                if isinstance(verdict, Answer):
                    return verdict
                if isinstance(verdict, Execute):
                    executing = True
                    return self._execute(tool, verdict, progress, cancelled)
                approval = verdict.approval
                again = held and not asked
                if again or not self._hold(approval, progress, cancelled, asked):
                    return waiting_answer(approval)
                held = True
                judged, early = self._judge(tool, args, judged.work)  # links may move
            return answer("IN_PROGRESS")
        except StoreError as err:
            log(str(err))
            what = "sent_unrecorded" if executing else "nothing_executed"
            return answer("UNAVAILABLE", what=SLOT_PROSE[what])

    def _judge(self, tool, args, work=None):
        """(Judgement, early decision or None), judged before the lock:
        decided early only where rule 8 may act on it (a read, no limit)."""
        judged = judged_request(tool, args, work)
        if tool.read_only and not tool.rule.limits:
            return judged, self._decision(tool, args, judged)
        return judged, None

    def _hold(self, approval, progress, cancelled, asked=None):
        """Wait up to `hold`: True once the question is settled, else False.
        A task's call (`asked`) waits until it is, but never on whether to
        run again: its answer is that the outcome is unknown."""
        if asked:
            if approval["kind"] == "interrupted_side_effect":
                return False
            asked(approval)
        started = time.monotonic()
        total = self.config.hold_for(self.caller.client) / SECOND
        total = math.inf if asked else total
        while not (cancelled.is_set() or self.stopping.is_set()):
            waited = time.monotonic() - started
            if waited >= total:
                return False
            cancelled.wait(min(0.2, total - waited))
            row = self.store.approval(approval["id"])
            waits = row and row["status"] == "pending" and live_approval(self.config, row)
            if not waits or row["run_status"] in TERMINAL:
                return not (cancelled.is_set() or self.stopping.is_set())
            if progress:  # at most once a second (Progress.holding)
                progress.holding(round(waited, 3), total, SLOT_PROSE["holding"])
        return False

    def _decide(self, tool, args, key, judged, early, cancelled):
        """The rules in order: an Answer, a Wait, an Execute or AGAIN."""
        try:
            return self._rules(tool, args, key, judged, early, cancelled)
        except Race:
            return AGAIN

    def _rules(self, tool, args, key, judged, early, cancelled):
        if cancelled.is_set():  # while judged or waiting
            return answer("CANCELLED", "HOST_CANCELLED")
        window = self.window(tool)
        since = format_time(time.time() - max(window, self.config.repeat_window) / SECOND)
        # A read needs only its newest row: identical reads never refuse one
        # another. The begin refuses unless `seen` is still the open row: no
        # identical run, in any process, begins and ends in between.
        rows = self.store.key_runs(key, since, newest_only=tool.read_only)
        seen = next((row.run_id for row in rows if row.open), None)
        for row in rows:
            if row.status == "WAITING_FOR_APPROVAL":       # rule 1
                return self._asked(tool, row.run_id, judged)
            if row.status == "RUNNING":
                live = row.owner != self.owner and row.expires > now()
                if row.run_id in self.active or live:
                    return answer("IN_PROGRESS")           # rule 2
                return self._take_over(tool, row.run_id, judged)  # rule 3
            if row.finished >= since:                  # rules 4, 5
                verdict = self._closed(tool, row, window)
                if verdict is STOP:
                    break
                if verdict is not NEXT:
                    return verdict
        attempt = None
        if not tool.read_only:
            attempt = self._unknown_attempt(key)           # rule 6
            question = self._settle_others(tool, key)
            if question:                                   # rule 7
                return answer("BLOCKED", "BLOCKED_UNKNOWN", tool=tool.name,
                              approval=question["id"])
        return self._begin(tool, args, key, seen, judged, early, attempt,  # rule 8
                           cancelled=cancelled)

    def _asked(self, tool, run_id, judged):
        """Rule 1: the run waits on its newest approval."""
        approval = self.store.latest_approval(run_id)
        status = approval and approval["status"]
        if status == "approved":
            return self._collect(tool, approval, judged)
        if status != "pending":
            return answer("IN_PROGRESS")
        if live_approval(self.config, approval):
            return Wait(approval)
        return self._expire(approval)

    def _expire(self, approval):
        self.store.write(lambda tx: tx.expire_approval(
            approval["id"], approval["run_id"], approval["step_id"]))
        return AGAIN  # the run ended: rules 4 to 6 decide

    def _collect(self, tool, approval, judged):
        """An approved request runs as recorded, never as this call's bytes."""
        run_id, step_id = approval["run_id"], approval["step_id"]
        if tool.name in self.quarantined:  # the approval stays for its return
            return answer("DENIED", "TOOL_CHANGED")
        if stored_hash(approval) != approval["hash"]:
            log(f"approval {approval['id']} does not match its hash; it was"
                " altered after it was made and will not be used")
            return answer("DENIED", reason=SLOT_PROSE["altered"])
        if not live_approval(self.config, approval):  # grant_ttl
            return self._expire(approval)
        if judged.problem:
            why = f"invalid decision on resume: {judged.problem}"
            self.store.write(lambda tx: self._refuse(tx, run_id, step_id,
                                                     "invalid_decision", why))
            return answer("INVALID", reason=clean(judged.problem, 1000))
        args = parse(approval["request_json"])["args"]
        attempt = parse(approval["capability_json"]).get("interrupted")
        def collect(tx):
            # Approved: no limit counts it again, no grant applies. It
            # may ask another question (another entry holds now).
            decision, facts = self._decision(tool, args, judged, tx.rows, attempt,
                                             approved=True)
            act = decision["outcome"] == "deny"
            if decision["outcome"] == "require_approval":
                fresh = new_approval(self.config, run_id, step_id, tool, args, decision)
                act = fresh["hash"] != approval["hash"]
            if act:
                return self._act(tx, tool, run_id, step_id, args, decision, facts,
                                 judged.work, approved=True, resumed=True)
            tx.resume(run_id, approval["id"], self.lease())
            record = _policy_record(decision, facts, True)
            tx.record_policy(run_id, step_id, record, self.policy_id)
            tx.start_execution(run_id, step_id, tool.name, args, tool.target,
                               approval["id"])
            return Execute(run_id, step_id, args, work=judged.work)
        return self._begun(tool, run_id, collect)

    def _take_over(self, tool, run_id, judged):
        """Rule 3: take over a run whose lease ran out: Wait on asking to
        run again a mutation it cut off, else it ends: AGAIN."""
        cut_step = self.store.write(lambda tx: tx.take_over(run_id, self.lease()))
        asks = cut_step and not tool.read_only
        if asks:
            step_id, started = cut_step
            attempt = attempt_of(run_id, step_id, started, "cut_off")
            args = self.store.step_decision(step_id)["args"]
        def taken_over(tx):
            if asks:
                decision, facts = self._decision(tool, args, judged, tx.rows, attempt)
                if decision["outcome"] == "require_approval":
                    approval = new_approval(self.config, run_id, step_id, tool, args,
                                            decision)
                    tx.record_policy(run_id, step_id, _policy_record(decision, facts), "")
                    tx.pause(run_id, step_id, approval)
                    return Wait(approval)
            tx.finish_run(run_id, "FAILED", "goal_failed",
                          "one call per run: taken over after an"
                          " interruption, with nothing left in it to execute")
            return AGAIN
        verdict = self.store.write(taken_over)
        if isinstance(verdict, Wait):
            log(f"a call to {tool.name} was cut off while executing; its outcome"
                " is unknown")
            self.announce(verdict.approval, tool, run_id)
        return verdict

    def _refuse(self, tx, run_id, step_id, kind, detail):
        observation = {"kind": kind, "content": {"error": detail}}
        tx.fail_step(run_id, step_id, observation, detail)
        tx.finish_run(run_id, "FAILED", "goal_failed", CLOSING[kind])

    def _closed(self, tool, row, window):
        """Rules 4 and 5: a finished run within the window: the tool's for a
        duplicate, at least the config's for the operator's no."""
        refusals = max(window, self.config.repeat_window)
        def within(span):
            start = format_time(time.time() - span / SECOND)
            return span and row.finished >= start
        def until():
            return prose_time(later(row.finished, refusals))
        refused = within(refusals)
        if row.reason == "approval_rejected" and refused:
            approval = self.store.latest_approval(row.run_id)
            return answer("REJECTED", approval=approval["id"],
                          note=note_text(approval["note"]), until=until())
        attempt = None if tool.read_only else last_attempt(self.store.read, row.run_id)
        unknown = attempt and attempt.ending in UNKNOWN_ENDINGS
        if row.reason == "approval_expired" and not unknown and refused:
            approval = self.store.latest_approval(row.run_id)
            return answer("EXPIRED", approval=approval["id"], until=until())
        if row.reason == "operator_cancelled" and refused:
            return answer("REJECTED", "CANCELLED",
                          note=note_text(row.detail), until=until())
        if unknown:
            return STOP
        if attempt is None or not within(window):
            return NEXT
        cap = 500 if attempt.ending == "unrecorded" else CONTENT_CAP
        text = clean(outcome_text(attempt.observed), cap)
        said = DUPLICATE_OUTCOME[attempt.ending].format(text=text)
        self.duplicate(tool, row.run_id, attempt.finished, window)
        return answer("DUPLICATE", at=prose_time(attempt.finished),
                      window=format_duration(window), outcome=said)

    def _unknown_attempt(self, key):
        """Rule 6: the attempt of the newest finished run, if unknown."""
        for run_id, status in self.store.attempt_runs(key):
            attempt = status in TERMINAL and last_attempt(self.store.read, run_id)
            if attempt:
                unknown = attempt.ending in UNKNOWN_ENDINGS
                return attempt.attempt if unknown else None
        return None

    def _settle_others(self, tool, key):
        """The one place other requests' runs of the tool are settled, so
        rule 7 never blocks on what nobody settles: the question standing."""
        for run_id, status, owner, expires in self.store.unsettled_runs(tool.target, key):
            live = owner != self.owner and expires > now()
            if status == "RUNNING":
                if live or run_id in self.active:
                    continue
                # Another request's arguments: a budget of their own.
                verdict = self._take_over(tool, run_id, Judgement())
                if isinstance(verdict, Wait):
                    return verdict.approval
                continue
            waiting = status == "WAITING_FOR_APPROVAL"
            approval = waiting and self.store.latest_approval(run_id)
            if not approval or approval["kind"] != "interrupted_side_effect":
                continue
            if live_approval(self.config, approval):
                return approval
            self._expire(approval)
        return self._ask_unknown(tool, key)

    def _ask_unknown(self, tool, key):
        """Another request's unknown outcome asked in a fresh run, or None."""
        for other, run_id, reason in self.store.unknown_for_tool(tool.target, key):
            if reason in ("approval_rejected", "operator_cancelled"):
                continue
            # The open row before the attempt: a re-run settling it after
            # this read makes the begin refuse (asked once).
            seen = self.store.open_run(other)
            attempt = self._unknown_attempt(other)
            if attempt is None:
                continue
            args = self.store.step_decision(attempt["step_id"])["args"]
            verdict = self._begin(tool, args, other, seen, judged_request(tool, args),
                                  attempt=attempt, origin="operator")
            if isinstance(verdict, Wait):
                return verdict.approval
        return None

    def _begin(self, tool, args, key, seen, judged, early=None, attempt=None,
               origin="model", cancelled=None, invalid=None):
        """Rule 8: decide and begin the run in one write: its verdict."""
        run_id = f"{self.config.session}.{new_id(8)}"
        problem = invalid[0] if invalid else judged.problem
        outright = early and not (problem or attempt)
        if outright and early[0]["outcome"] == "allow" and "grant" not in early[0]:
            # No limit, no grant to be revoked: nothing unknown after a
            # crash, so it is recorded whole once it answers. The same
            # write path, one commit not two: half the added latency
            # (tests/bench.py, 0.75 ms against 1.40 side by side).
            self.active.add(run_id)
            return Execute(run_id, None, args, (_policy_record(*early), now()))
        step = tool_step(tool, args, origin, invalid)
        opened = ANY_ROW if tool.read_only else seen
        def begin(tx):
            if cancelled and cancelled.is_set():  # by the host
                return answer("CANCELLED", "HOST_CANCELLED")
            if not problem:
                decision, facts = self._decision(tool, args, judged, tx.rows, attempt)
                full = self._too_many(tx, decision, origin)
                if full:
                    return full
            tx.begin_run(run_id, self.config.session, tool.name, tool.target, key,
                         tool.side_effect, self.tool_hashes, self.lease(), opened)
            step_id = tx.start_step(run_id, step, tool)
            if problem:
                self._refuse(tx, run_id, step_id, "invalid_decision",
                             f"invalid decision: {problem}")
                return answer("INVALID", reason=clean(problem, 1000))
            return self._act(tx, tool, run_id, step_id, args, decision, facts,
                             judged.work)
        return self._begun(tool, run_id, begin)

    def _too_many(self, tx, decision, origin):
        """BLOCKED when the model's question passes max_pending."""
        if decision["outcome"] != "require_approval" or origin != "model":
            return None
        waiting = tx.waiting(self.config.session)
        if waiting < self.config.max_pending:
            return None
        said = "one_waits" if waiting == 1 else "some_wait"
        return answer("BLOCKED", "BLOCKED_PENDING",
                      waiting=SLOT_PROSE[said].format(count=waiting))

    def _act(self, tx, tool, run_id, step_id, args, decision, facts, work,
             approved=False, resumed=False):
        """Record a decision on its step and act on it: the verdict."""
        record = _policy_record(decision, facts, approved)
        tx.record_policy(run_id, step_id, record, self.policy_id)
        outcome, reason = decision["outcome"], decision["reason"]
        if outcome == "deny":
            how = "denied on resume" if resumed else "denied"
            self._refuse(tx, run_id, step_id, "policy_denied", f"{how}: {reason}")
            frees = frees_text(decision)
            said = reason + (f"; {frees}" if frees else "")
            return answer("DENIED", reason=clean(said, 500))
        if outcome == "require_approval":
            approval = new_approval(self.config, run_id, step_id, tool, args, decision)
            tx.pause(run_id, step_id, approval)
            return Wait(approval)
        tx.start_execution(run_id, step_id, tool.name, args, tool.target)
        return Execute(run_id, step_id, args, work=work)

    def _begun(self, tool, run_id, fn):
        """Commit fn: the run is this process's own from before, never
        taken over between."""
        self.active.add(run_id)
        verdict = None
        try:
            verdict = self.store.write(fn)
        finally:
            if not isinstance(verdict, Execute):
                self.active.discard(run_id)
        if isinstance(verdict, Wait):
            self.announce(verdict.approval, tool, run_id)
        return verdict

    def _execute(self, tool, verdict, progress=None, cancelled=None):
        """Send the request upstream (unless cancelled) and record what came of it."""
        run_id, step_id, args = verdict[:3]
        try:
            started = time.monotonic()
            if cancelled and cancelled.is_set():
                observation, ending, passed = failed_call(
                    tool, SLOT_PROSE["host_cancelled"], "unsent")
            else:
                observation, ending, passed = call_upstream(
                    tool, args, self.config.max_result_bytes,
                    progress and progress.server)
            elapsed = int((time.monotonic() - started) * 1000)
            def record(tx):  # the approval a re-run waits on, or None
                how = self._record_outcome if step_id else self._record_read
                return how(tx, tool, verdict, observation, ending, elapsed)
            rerun = self.store.write(record)
        finally:
            self.active.discard(run_id)
        if passed is not None:
            return passed_answer(passed)
        if observation.get("withheld"):
            cap = self.config.max_result_bytes
            return too_large_answer(tool, observation["result"], cap, self.window(tool))
        error = observation["content"]["error"]
        if rerun:
            how = HOW[ending]
            log(f"a call to {tool.name} {how}; its outcome is unknown")
            self.announce(rerun, tool, run_id)
            return answer("UNKNOWN_OUTCOME", how=how, error=f" ({clean(error, 500)})",
                          approval=rerun["id"])
        if ending == "unrecorded":
            return answer("UNRECORDED", reason=clean(error, 500),
                          window=refused_for(self.window(tool)))
        return Answer(clean(error, CONTENT_CAP), True)

    def _record_read(self, tx, tool, verdict, observation, ending, elapsed):
        policy, started = verdict.record
        if ending == "ok":
            ended = ("COMPLETED", "goal_completed", f"terminal tool {tool.name}")
        else:
            ended = ("FAILED", "goal_failed", CLOSING[ending])
        step = tool_step(tool, verdict.args)
        tx.record_read(verdict.run_id, self.config.session, tool, step, policy,
                       self.policy_id, started, observation, ended, elapsed)

    def _record_outcome(self, tx, tool, verdict, observation, ending, elapsed):
        """An executed run's outcome: a re-run's approval or None."""
        run_id, step_id = verdict[:2]
        if tx.run_holder(run_id) != ("RUNNING", self.owner):
            # Cancelled or taken over: a late event keeps the outcome.
            late = {"tool": tool.name, "late": True, "observation": observation}
            tx.event(run_id, "step.tool_finished", late, step_id)
            return None
        tx.finish_execution(run_id, step_id, tool.name, observation, elapsed)
        if ending in UNKNOWN_ENDINGS:
            return self._pause_rerun(tx, tool, verdict, ending)
        if ending == "unsent":  # executed nothing: no limit counts it
            tx.execute("DELETE FROM executions WHERE step_id=?", (step_id,))
        if ending != "ok":
            # Unsent: the outcome of the attempt before, if any.
            known = None if ending == "unsent" else OUTCOME_KNOWN
            tx.finish_run(run_id, "FAILED", "goal_failed", CLOSING[ending], outcome=known)
        return None

    def _pause_rerun(self, tx, tool, verdict, ending):
        """An unknown outcome asked again: the approval or None."""
        run_id, step_id, args = verdict[:3]
        started = tx.step_started(step_id)
        attempt = attempt_of(run_id, step_id, started, ending)
        judged = Judgement(work=verdict.work)
        decision, facts = self._decision(tool, args, judged, tx.rows, attempt)
        if decision["outcome"] == "deny":
            # Denied now: the run ends unknown; rule 6 decides the next.
            tx.finish_run(run_id, "FAILED", "goal_failed", CLOSING[ending])
            return None
        rerun = tx.start_step(run_id, tool_step(tool, args, "operator"), tool)
        return self._act(tx, tool, run_id, rerun, args, decision, facts,
                         verdict.work).approval

def call_upstream(tool, args, cap, progress=None):
    """(observation, ending, the result as it came or None past `cap`). The
    one place an outcome is classified: 'ok'; 'error' (known); 'unsent';
    'unrecorded' (executed, answer unusable: never run again); 'timed_out' or
    'no_answer' (unknown). A read's other failures are 'error'."""
    passed = rpc = None
    sent = {"name": tool.upstream_name, "arguments": {**args, **tool.rule.fixed}}
    try:
        result = tool.upstream.request("tools/call", sent, Deadline(tool.timeout),
                                       f"tool {quote(tool.upstream_name)}", progress)
        passed, error = passed_result(tool, result)
        try:
            record = None if passed is None else result_record(passed)
        except Exception as err:  # shaped as no server should send
            passed = None
            error = SLOT_PROSE["unreadable_result"].format(error=err)
        ending = ("unrecorded" if passed is None
                  else "error" if record.get("is_error") else "ok")
    except UpstreamError as err:
        error, rpc = str(err), err.rpc
        ending = UPSTREAM_ENDINGS.get(err.outcome, err.outcome)
    if tool.read_only and ending not in ("ok", "unsent"):
        ending = "error"
    if passed is None:
        return failed_call(tool, error, ending, rpc, cap)
    withheld = record["bytes"] > cap
    summary = result_summary(tool, record, cap if withheld else 0)
    kind = "tool_result" if ending == "ok" else "tool_error"
    observation = {"kind": kind, "summary": summary, "result": record}
    if ending != "ok":
        observation["content"] = {"tool": tool.name, "ending": ending}
    if withheld:
        observation["withheld"] = True
    return observation, ending, None if withheld else passed

UPSTREAM_ENDINGS = {"unusable": "unrecorded", "answered": "error", "not_sent": "unsent"}

def failed_call(tool, error, ending, rpc=None, cap=0):
    """No result, as call_upstream answers; `rpc` passes while it fits `cap`."""
    content = {"tool": tool.name, "error": error, "ending": ending}
    if rpc is not None:
        sent = canonical(rpc)
        content["rpc_error"] = value_digest(sent)
        rpc = {"error": rpc} if len(sent) <= cap else None
    said = f"{tool.name} {ending}: {sanitize(error)}"
    observation = {"kind": "tool_error", "summary": cut(said, 1000), "content": content}
    return observation, ending, rpc

RECORDED_FRAME_BYTES = 65536

def recorded_frame(data):
    """Refused arguments as kept: past RECORDED_FRAME_BYTES their digest,
    so a hostile frame cannot fill the database."""
    if len(data) <= RECORDED_FRAME_BYTES:
        return data.decode("utf-8", "backslashreplace")
    return value_digest(data)

def live_approval(config, approval):
    """Pending and unexpired, or granted and still collectable."""
    status, ttl = approval["status"], config.grant_ttl
    if status == "pending":
        expires = approval["expires_at"]
        return not expires or expires > now()
    if status == "approved":
        return not ttl or later(approval["decided_at"], ttl) > now()
    return False

# Why a run ended, by its refused step's kind or its call's ending.
CLOSING = {
    "policy_denied": "one call per run: the request was denied",
    "invalid_decision": "one call per run: the request was invalid",
    "error": "one call per run: the tool call returned an error",
    "unsent": "one call per run: the tool call was not sent, so nothing"
              " executed",
    "unrecorded": "one call per run: the tool call executed and its result"
                  " could not be recorded",
    "timed_out": "one call per run: the tool call timed out; its outcome is"
                 " unknown",
    "no_answer": "one call per run: the tool call failed without an answer;"
                 " its outcome is unknown",}
POLICY_KEPT = ("outcome", "reason", "by", "grant", "limit",
               "tried", "kind", "capability", "presentation")

def _policy_record(decision, facts, approved=False):
    """A decision as kept, with the facts recheck needs to make it again."""
    record = {k: decision[k] for k in POLICY_KEPT if k in decision}
    record["facts"] = {"at": format_time(facts.at), "client": facts.client,
                       "approved": approved}
    return record


# =============================================================================================
# 9. The host side
#
# Reads as: decision core
#
# Owns: the host's stdin and stdout as far as they decide calls: framing,
# batches, both eras (the first request's: initialize, or the 2026-07-28
# envelope), tools/list, tools/call (at most MAX_IN_FLIGHT at once), tasks,
# cancellation and shutdown; section 26 has the rest.
# Promises: stdout carries only protocol, one JSON-RPC message per line, under
# one lock; the first request is answered at once, even while servers start,
# and server/discover starts none; a task is recorded before it is answered,
# and its call is driven to its end once, by one gate at a time;
# every request gets exactly one well-formed answer (a malformed or oversized
# line, a batch member not a request or an id that cannot be echoed: an error
# with id null; past the bound, busy; an unknown method, -32601) and the
# session goes on; a tool is offered as pinned, never once its server changed
# it, the status tool always; on stdin closing, SIGINT or SIGTERM no new call
# starts, holds end, calls in flight finish and are recorded, then exit 0.
# =============================================================================================

# The protocol versions spoken, oldest first; each side negotiates on its own.
PROTOCOL_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
# The revision without a handshake: each request carries an envelope.
MODERN, META = "2026-07-28", "io.modelcontextprotocol/"
TASKS = META + "tasks"  # the Tasks extension (SEP-2663)
TASK_METHODS = ("tasks/get", "tasks/update", "tasks/cancel")
BATCH_VERSIONS = ("2024-11-05", "2025-03-26")
MAX_HOST_LINE = 16 * 1024 * 1024
MAX_IN_FLIGHT = 64  # requests handled at once
IDLE_THREAD = 2  # seconds a request thread waits for the next

class HostServer:
    """One host session; `around` is section 26's HostAround."""

    def __init__(self, stdin, stdout, around):
        self.stdin, self.stdout, self.around = stdin, stdout, around
        self.write_lock = threading.Lock()
        self.ready = threading.Event()
        self.done = threading.Event()
        self.gate = None
        self.protocol = PROTOCOL_VERSIONS[-1]
        self.client = ""  # from initialize: the policy's `client`
        self.era = None  # "handshake" or "modern": its first request's
        self.wanted = threading.Event()  # a request needs the servers
        self.listeners = {}  # subscriptions/listen: id key -> (id, tools)
        self.tasks = Tasks(self)
        self.calls = {}  # a call's id -> its cancel event
        self.calls_lock = threading.Lock()
        self.running = 0  # requests admitted, not yet answered
        self.work = queue.SimpleQueue()
        self.idle = 0  # request threads waiting for work
        self.stopping = False
        self.failed = ""

    def start(self):
        self.frames = read_frames(self.stdin.fileno(), MAX_HOST_LINE)
        threading.Thread(target=self._read_loop, daemon=True).start()

    def serve_with(self, gate, status):
        self.gate, self.status = gate, status
        self.status_tool = status.listing["name"]
        self.ready.set()

    def fail(self, reason):
        self.failed = reason
        self.ready.set()

    def send(self, message):
        """Write one message, or a batch's answers, as one line."""
        if not message:
            return
        try:
            data = canonical(message) + b"\n"
        except (UnicodeEncodeError, TypeError) as err:  # ids are checked
            log(f"internal error: an answer could not be encoded ({err})")
            failed = rpc_error(None, -32600, "the answer could not be encoded")
            data = canonical(failed) + b"\n"
        with self.write_lock:
            try:
                self.stdout.write(data)
                self.stdout.flush()
            except (OSError, ValueError):
                self.done.set()

    def _read_loop(self):
        for frame, ident in self.frames:
            # No frame ends the reader: what follows would go unanswered,
            # and closing stdin would not stop the gate.
            try:
                work = self._frame(frame, ident)
            except Exception as err:
                log("internal error: a message could not be handled"
                    f" ({type(err).__name__}: {err})")
                work = rpc_error(None, -32603, "the message could not be handled")
            if callable(work):
                self._hand(work)
            else:
                self.send(work)
        self.done.set()

    def _hand(self, work):
        """Run `work` on an idle request thread, or a new one (a start stalls
        the reader: a fifth of the throughput in tests/bench.py)."""
        with self.calls_lock:
            idle = self.idle > 0
            self.idle -= idle
        if not idle:
            threading.Thread(target=self._serve, daemon=True).start()
        self.work.put(work)

    def _serve(self):
        while True:
            try:
                work = self.work.get(timeout=IDLE_THREAD)
            except queue.Empty:
                with self.calls_lock:  # only while no work claims it
                    if self.idle > 0:
                        self.idle -= 1
                        return
                continue
            try:
                work()
            except Exception as err:  # a bug: said, the thread kept
                log(f"internal error: {type(err).__name__}: {err}")
            with self.calls_lock:
                self.idle += 1

    def _frame(self, line, ident):
        """A frame's answer, or the work it asks (a call, a batch)."""
        if line is None:
            if ident is not None:
                ident = Number(str(ident))
            return rpc_error(ident, -32600,
                             f"the message is larger than {MAX_HOST_LINE} bytes")
        if not line.strip():
            return None
        invalid = None
        try:
            message = parse(line)
        except CanonicalError as err:
            # A tools/call refused here still gets a run and an INVALID
            # answer, the frame recorded as it came; anything else -32700.
            message = parse_loosely(line)
            if not isinstance(message, dict):
                message = {}
            why = SLOT_PROSE["unusable_arguments"].format(error=err)
            invalid = (why, recorded_frame(line))
            if message.get("method") != "tools/call" or "id" not in message:
                return rpc_error(echoed_id(message), -32700,
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
        # One request in flight: its members answered in order.
        if not self._admit():
            return [busy_error(echoed_id(m)) for m in messages]
        def run():
            try:
                answers = [self._member(m) for m in messages]
                self.send([a for a in answers if a])
            finally:
                self._release()
        return run

    def _member(self, message):
        if isinstance(message, dict):
            return self._message(message, None, batch=True)
        return rpc_error(None, -32600, "a batch member must be a JSON-RPC object")

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
        """A request's answer (None to a notification), or the work sending it."""
        method, ident = message.get("method"), message.get("id")
        params = message.get("params")
        params = params if isinstance(params, dict) else {}
        if not isinstance(method, str):
            if "id" in message and ("result" in message or "error" in message):
                return None  # agentgate sends no request
            return rpc_error(echoed_id(message), -32600, "a request needs a method")
        if method != "server/discover" and not self.wanted.is_set():
            self.wanted.set()  # the servers start (a probe starts none)
        if "id" not in message:
            self._notified(method, params)
            return None
        if not echoable_id(ident):
            # Checked before anything is recorded: no run for it.
            return rpc_error(None, -32600, "the id must be a string or a number that"
                             " can be written as JSON")
        if self.era == "modern" or self.era is None and enveloped(method, params):
            return self._modern(method, ident, params, invalid, batch)
        self.era = "handshake"
        if method == "tools/call":
            return self._tools_call(ident, params, invalid, batch)
        if method == "tools/list":
            return self._after_ready(ident, self._tool_list, batch)
        if method == "initialize":
            self._initialize(params)
        handler = self.around.requests.get(method)
        if handler is None:
            return rpc_error(ident, -32601, f"method {quote(method)} is not offered")
        return {"jsonrpc": "2.0", "id": ident, "result": handler(self, params)}

    def _modern(self, method, ident, params, invalid, batch):
        """A 2026-07-28 request: its envelope checked, then answered
        as the handshake era's are, each result with its resultType."""
        meta = params.get("_meta")
        refused = envelope_refused(meta)
        if refused:  # the era is still open to initialize
            return {"jsonrpc": "2.0", "id": ident, "error": refused}
        self.era = "modern"
        extensions = meta[META + "clientCapabilities"].get("extensions")
        tasks = isinstance(extensions, dict) and TASKS in extensions
        client = client_name(meta.get(META + "clientInfo"))
        if method == "server/discover":
            return {"jsonrpc": "2.0", "id": ident,
                    "result": self.around.discover()}
        if method == "tools/list":
            def listed():
                return {**self._tool_list(), "ttlMs": 0, "cacheScope": "private"}
            return self._after_ready(ident, listed, batch, modern=True)
        if method == "tools/call":
            return self._tools_call(ident, params, invalid, batch, client, tasks)
        if method == "subscriptions/listen":
            return self._listen(ident, params)
        if method in TASK_METHODS and not tasks:
            return {"jsonrpc": "2.0", "id": ident, "error": TASKS_NEEDED}
        if method in TASK_METHODS:
            def answered():
                return self.tasks.answer(method, params)
            return self._after_ready(ident, answered, batch, modern=True)
        return rpc_error(ident, -32601, f"method {quote(method)} is not offered")

    def _listen(self, ident, params):
        """subscriptions/listen: open until the host cancels it. Of what it
        may ask, the gate has only a change of its tool list to tell."""
        asked = params.get("notifications")
        tools = isinstance(asked, dict) and asked.get("toolsListChanged") is True
        with self.calls_lock:
            if len(self.listeners) >= MAX_IN_FLIGHT:
                return busy_error(ident)
            self.listeners[_id_key(ident)] = (ident, tools)
        agreed = {"toolsListChanged": True} if tools else {}
        self.send(listened(ident, "notifications/subscriptions/acknowledged",
                           notifications=agreed))

    def _notified(self, method, params):
        if method == "notifications/cancelled":
            key = _id_key(params.get("requestId"))
            with self.calls_lock:
                self.listeners.pop(key, None)
                cancelled = self.calls.get(key)
            if cancelled:
                cancelled.set()
        elif method in self.around.notifications:
            self.around.notifications[method](self, params)

    def _tools_call(self, ident, params, invalid, batch, client=None,
                    tasks=False):
        # Known as it is read, so a cancellation read after it finds it.
        cancelled = TaskCancel() if tasks else threading.Event()
        key = _id_key(ident)
        with self.calls_lock:
            self.calls[key] = cancelled
        def call():
            try:
                return self._call(params, invalid, batch, cancelled, client)
            finally:
                self._forget(key, cancelled)
        work = self._after_ready(ident, call, batch, modern=client is not None)
        if isinstance(work, dict) and not batch:  # busy: never runs
            self._forget(key, cancelled)
        return work

    def _initialize(self, params):
        asked = params.get("protocolVersion")
        known = asked in PROTOCOL_VERSIONS
        self.protocol = asked if known else PROTOCOL_VERSIONS[-1]
        self.client = client_name(params.get("clientInfo"))

    def _after_ready(self, ident, work, batch, modern=False):
        """`work`'s answer once servers are ready: a batch member's, else the
        work that sends it."""
        # Read on the reader: a call read before stdin closed runs.
        accepted = not self.stopping
        admitted = accepted and not batch
        if admitted and not self._admit():
            return busy_error(ident)
        def run():
            try:
                self.ready.wait()
                answer = self._answer(ident, work, accepted, modern)
                if batch:
                    return answer
                # Before the release: shutdown waits for every answer.
                self.send(answer)
            finally:
                if admitted:
                    self._release()
        return run() if batch else run

    def _answer(self, ident, work, accepted, modern):
        if self.failed or not accepted:
            why = "unloaded" if accepted else "stopping"
            return rpc_error(ident, -32603, CALL_ERRORS[why])
        try:
            result = work()
        except Refused as err:
            return rpc_error(ident, -32602, str(err))
        except PassedError as err:
            return {"jsonrpc": "2.0", "id": ident, "error": err.error}
        except Exception as err:  # a bug: say so, keep the session
            log(f"internal error: {type(err).__name__}: {err}")
            return rpc_error(ident, -32603, CALL_ERRORS["failed"])
        if result is None:  # a call the host cancelled: no answer
            return None
        if modern:  # a task's stays "task"
            result = {"resultType": "complete", **result}
        return {"jsonrpc": "2.0", "id": ident, "result": result}

    def _tool_list(self):
        held = self.gate.quarantined  # replaced whole: read once
        tools = [t.listing for t in self.gate.tools.values() if t.name not in held]
        return {"tools": tools + [self.status.listing]}

    def _forget(self, key, cancelled):
        with self.calls_lock:
            if self.calls.get(key) is cancelled:
                del self.calls[key]

    def _call(self, params, invalid, batch, cancelled, client=None):
        name, args = params.get("name"), params.get("arguments")
        if name == self.status_tool:
            return self.status.call(args, invalid)
        tool = self.gate.tools.get(name) if isinstance(name, str) else None
        if tool is None:
            said = CALL_ERRORS["unknown_tool"].format(name=quote(str(name)))
            raise Refused(said)
        if tool.name in self.gate.quarantined:
            return answer("DENIED", "TOOL_CHANGED").result()
        client = self.client if client is None else client
        if isinstance(cancelled, TaskCancel):
            return self.tasks.call(tool, args, invalid, client, cancelled)
        meta = params.get("_meta")
        meta = meta if isinstance(meta, dict) else {}
        token, progress = meta.get("progressToken"), None
        if not batch and echoable_id(token):
            progress = self.around.progress(self, token, cancelled)
        answered = self.gate.call(tool, args, invalid, progress, cancelled,
                                  client)
        if cancelled.is_set() and not batch:
            return None
        return self._result(tool, answered)

    @staticmethod
    def _result(tool, answered):
        result = answered.result()
        if "error" in result:
            raise PassedError(result["error"])
        if answered.passed is None and "outputSchema" in tool.listing:
            # A host refuses a result lacking the structured content an
            # output schema promises: the gate's own answers go as errors.
            result["isError"] = True
        return result

class Refused(Exception):
    """Invalid params (-32602): a tool not offered, a task not known."""

class PassedError(Exception):
    """A server's JSON-RPC error to a tools/call, answered as it came."""

    def __init__(self, error):
        super().__init__(error["message"])
        self.error = error

def echoed_id(message):
    """A message's id if it can be echoed, else None."""
    ident = message.get("id") if isinstance(message, dict) else None
    return ident if echoable_id(ident) else None

def _id_key(ident):
    return canonical(ident) if echoable_id(ident) else None

def rpc_error(ident, code, message):
    """Every JSON-RPC error answer the host is sent."""
    return {"jsonrpc": "2.0", "id": ident, "error": {"code": code, "message": message}}

def busy_error(ident):
    return rpc_error(ident, -32000, CALL_ERRORS["busy"].format(limit=MAX_IN_FLIGHT))

def client_name(info):
    """The host's name as it gives it: the policy's `client`."""
    name = info.get("name") if isinstance(info, dict) else None
    return name[:200] if isinstance(name, str) else ""

def enveloped(method, params):
    """Whether a host's first request opens the 2026-07-28 era."""
    meta = params.get("_meta")
    keys = ("protocolVersion", "clientCapabilities")
    marked = isinstance(meta, dict) and any(META + k in meta for k in keys)
    return method == "server/discover" or marked

def envelope_refused(meta):
    """The error a 2026-07-28 request's _meta earns, or None."""
    meta = meta if isinstance(meta, dict) else {}
    version = meta.get(META + "protocolVersion")
    if not isinstance(version, str):
        missing = "protocolVersion"
    elif not isinstance(meta.get(META + "clientCapabilities"), dict):
        missing = "clientCapabilities"
    elif version != MODERN:
        return {"code": -32022, "message": f"protocol version"
                f" {quote(version[:100])} is not supported; use {MODERN}",
                "data": {"supported": [MODERN], "requested": version}}
    else:
        return None
    return {"code": -32602, "message": f"the request's _meta needs"
            f" {META}{missing}"}

TASKS_NEEDED = {
    "code": -32021, "message": "tasks/* needs the tasks extension in the"
    " request's client capabilities",
    "data": {"requiredCapabilities": {"extensions": {TASKS: {}}}}}

def listened(ident, method, **params):
    """A notification on the subscriptions/listen stream `ident`."""
    meta = {"_meta": {META + "subscriptionId": ident}}
    return {"jsonrpc": "2.0", "method": method, "params": {**params, **meta}}

TASK_POLL_MS = 1000  # how often a host is asked to look
TASK_SAYS = {
    "asked": "Waiting for an operator's approval (approval {approval}): it"
             " is decided outside this conversation.",
    "running": "The call is running.",
}

class TaskCancel(threading.Event):
    """A task call's cancellation: the host's notice while it is answered,
    then tasks/cancel, from any gate on the database."""
    def __init__(self, task_id=None):
        super().__init__()
        self.task_id = task_id or secrets.token_hex(16)  # not a run id
        self.store = None  # once the task is recorded
    def is_set(self):
        if super().is_set() or self.store is None:
            return super().is_set()
        row = self.store.read_one("SELECT cancel_asked FROM tasks WHERE"
                                  " id=?", (self.task_id,))
        return bool(row and row[0])

class Tasks:
    """Calls answered as tasks, for requests that declare the extension: a
    call that would wait for an operator, or runs past task_after, is
    answered with a task recorded first. The gate drives it to its end once,
    under the rules across calls; tasks/get then gives what the call would
    have returned. A task no live gate drives is driven by the next asked."""
    def __init__(self, host):
        self.host = host

    def call(self, tool, args, invalid, client, cancel):
        """The call's result, or once it waits or runs long, its task's."""
        gate = self.host.gate
        if len(gate.driving) >= MAX_IN_FLIGHT:  # bounded: held as before
            return self.host._result(tool, gate.call(
                tool, args, invalid, None, cancel, client))
        lock, settled, box = threading.Lock(), threading.Event(), {}
        def asked(approval):
            box.setdefault("approval", approval["id"])
            settled.set()
        def drive():
            ended = self._outcome(tool, args, invalid, client, cancel, asked)
            with lock:
                box["ended"] = ended
                tasked = "task" in box
            settled.set()
            if tasked:
                self._end(cancel, *ended)
        threading.Thread(target=drive, daemon=True).start()
        settled.wait(gate.config.task_after / SECOND)
        with lock:
            try:
                if "ended" not in box:
                    box["task"] = self._create(tool, args, client, cancel,
                                               box.get("approval", ""))
            except StoreError as err:  # unrecorded, its wait ends
                log(str(err))
                cancel.set()
                what = "nothing_executed" if "approval" in box else "sent_unrecorded"
                return answer("UNAVAILABLE", what=SLOT_PROSE[what]).result()
        if "task" in box:
            return {**self._view(box["task"]), "resultType": "task"}
        body = box["ended"][0]
        if "error" in body:
            raise PassedError(body["error"])
        return body["result"]

    def _outcome(self, tool, args, invalid, client, cancel, asked):
        """(the answer's body, the gate's mark or '' for a server's)."""
        gate = self.host.gate
        try:
            while True:  # an identical run executing: its end is awaited
                answered = gate.call(tool, args, invalid, None, cancel,
                                     client, asked)
                if answered.mark != "IN_PROGRESS" or gate.stopping.wait(1) \
                        or cancel.is_set():
                    break
            result = self.host._result(tool, answered)
            mark = answered.mark if answered.passed is None else ""
            return {"result": {"resultType": "complete", **result}}, mark
        except PassedError as err:
            return {"error": err.error}, ""
        except Exception as err:  # a bug: the task says so
            log(f"internal error: {type(err).__name__}: {err}")
            return {"error": {"code": -32603,
                              "message": CALL_ERRORS["failed"]}}, ""

    def _create(self, tool, args, client, cancel, approval):
        gate, at = self.host.gate, now()
        owner, until = gate.lease()
        row = {"id": cancel.task_id, "tool": tool.name, "args_json":
               dumps({} if args is None else args), "client": client,
               "status": "working", "approval_id": approval,
               "created_at": at, "updated_at": at, "lease_owner": owner,
               "lease_expires_at": until}
        gate.store.write(lambda tx: tx.insert("tasks", tuple(row), row))
        cancel.store = gate.store
        gate.driving.add(cancel.task_id)
        return row

    def _end(self, cancel, body, mark):
        """Keep what the call came to. One cut off by the gate stopping is
        left to the next gate; one cancelled while it waited is cancelled."""
        gate = self.host.gate
        status = "failed" if "error" in body else "completed"
        waits = mark in ("PENDING_APPROVAL", "IN_PROGRESS")
        if waits and gate.stopping.is_set():
            status = "working"
        elif (waits or mark == "CANCELLED") and cancel.is_set():
            status = "cancelled"
        if mark and "result" in body:  # a task's end is no tool's result
            body["result"]["isError"] = True
        kept = dumps(body) if status in ("completed", "failed") else ""
        def end(tx):
            tx.execute("UPDATE tasks SET status=?, answer_json=?,"
                       f" updated_at=?, {NO_LEASE} WHERE id=? AND"
                       " status='working'",
                       (status, kept, now(), cancel.task_id))
        try:
            gate.store.write(end)
        except StoreError as err:
            log(f"a task's end could not be kept: {err}")
        finally:
            gate.driving.discard(cancel.task_id)

    def answer(self, method, params):
        """tasks/get, tasks/cancel or tasks/update, of any task recorded."""
        store, task_id = self.host.gate.store, params.get("taskId")
        row = isinstance(task_id, str) and store.task(task_id)
        if not row:
            raise Refused(f"no task {quote(str(task_id)[:100])} is known")
        if method == "tasks/cancel":  # a wait ends; an execution runs on
            store.write(lambda tx: tx.execute(
                "UPDATE tasks SET cancel_asked=1, updated_at=? WHERE id=?"
                " AND status='working'", (now(), task_id)))
        if method != "tasks/get":
            return {}  # tasks/update: the gate asks the host nothing
        self._adopt(row)
        return self._view(store.task(task_id))

    def _adopt(self, row):
        """Drive a working task whose gate is gone (its lease ran out)."""
        gate = self.host.gate
        tool = gate.tools.get(row["tool"])
        if row["status"] != "working" or row["lease_expires_at"] > now() \
                or tool is None or len(gate.driving) >= MAX_IN_FLIGHT:
            return
        owner, until = gate.lease()
        claimed = gate.store.write(lambda tx: tx.execute(
            "UPDATE tasks SET lease_owner=?, lease_expires_at=? WHERE id=?"
            " AND status='working' AND lease_expires_at<=?",
            (owner, until, row["id"], now())).rowcount)
        if not claimed:
            return
        cancel = TaskCancel(row["id"])
        cancel.store = gate.store
        gate.driving.add(row["id"])
        args = parse(row["args_json"])
        def drive():
            self._end(cancel, *self._outcome(tool, args, None, row["client"],
                                             cancel, lambda approval: None))
        threading.Thread(target=drive, daemon=True).start()

    def _view(self, row):
        """A task as tasks/get and the CreateTaskResult show it."""
        view = {"taskId": row["id"], "status": row["status"],
                "createdAt": row["created_at"],
                "lastUpdatedAt": row["updated_at"], "ttlMs": None,
                "pollIntervalMs": TASK_POLL_MS}
        if row.get("answer_json"):  # not in a row just made
            view.update(parse(row["answer_json"]))
        if row["status"] == "working":
            asked = row["approval_id"] and self.host.gate.store.approval(
                row["approval_id"])
            waits = asked and asked["status"] == "pending"
            view["statusMessage"] = TASK_SAYS["asked"].format(
                approval=row["approval_id"]) if waits else TASK_SAYS["running"]
        return view


# =============================================================================================
# 10. What an operator decides on
#
# Reads as: decision core
#
# Owns: the printout of every operator decision, and its yes; a
# grant as printed, created with the waits it releases.
# Promises: a decision binds only what was shown whole: a
# value over SHOWN_WHOLE bytes shows cut, and nothing is agreed
# to until every byte was shown (-full; f in watch). An approval
# shows only while it hashes to its hash. Lines are sanitized.
# What may not be decided raises Usage, saying why.
# =============================================================================================

SHOWN_WHOLE = 480  # bytes shown whole without -full

def shown_text(text, full):
    """(text, bytes, whether cut)."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size <= SHOWN_WHOLE or full:
        return text, size, False
    head = cut(text, SHOWN_WHOLE // 2)
    tail = text[-SHOWN_WHOLE // 4:]
    return f"{head} [... {size} bytes in all ...] {tail}", size, True

def intact(approval):
    """The approval, if it still hashes to its hash."""
    if stored_hash(approval) != approval["hash"]:
        raise StoreError(
            f"approval {approval['id']} does not match its hash: its record"
            " was altered after it was made, and it cannot be decided")
    return approval

def approval_printout(store, approval, full, cautions):
    """approval_shown, and why the policy asked."""
    late = store.late_outcomes(approval["run_id"])
    lines, short = approval_shown(intact(approval), full, late, cautions)
    steps = store.steps(approval["run_id"])
    step = next(s for s in steps if s["id"] == approval["step_id"])
    tried = sanitize(tried_text(step))
    return lines + [tried] * bool(tried), short

def approval_shown(approval, full, late, cautions):
    """(sanitized lines, whether short)."""
    shown = parse(approval["presentation_json"])
    request = parse(approval["request_json"])
    tool = request["spec"]["name"]
    lines = [f"APPROVAL WAITING  {approval['id']}"]
    for label, value in (
            ("kind", approval["kind"]), ("tool", tool),
            ("run", approval["run_id"]), ("created", approval["created_at"]),
            ("expires", approval["expires_at"] or "never"),
            ("server", shown.get("server", "")),
            ("upstream tool", shown.get("tool", ""))):
        lines.append(f"  {label:<14} {value}")
    args = request["args"]
    args = args if isinstance(args, dict) else {}
    lines.append("  arguments:" + ("" if args else " (none)"))
    short = _value_lines(lines, args, full, cautions)
    if shown.get("fixed"):
        lines.append("  fixed values (set by the configuration, sent with the"
                     " arguments):")
        short |= _value_lines(lines, shown["fixed"], full, cautions)
    for label in ("question", "reason", "decided_by", "limit", "frees",
                  "notice"):
        if shown.get(label):
            name = label.replace("_", " ")
            lines.append(f"  {name:<14} {shown[label]}")
    cut_off = parse(approval["capability_json"]).get("interrupted") or {}
    for step_id, observation in late:
        if step_id == cut_off.get("step_id"):
            text, _, cut_here = shown_text(outcome_text(observation), full)
            short |= cut_here
            lines.append(f"  LATE OUTCOME   {late_text(observation, text)}")
    lines.append(f"----- end of approval {approval['id']} for tool {tool}"
                 " -----")
    return [sanitize(line) for line in lines], short

def _value_lines(lines, values, full, cautions):
    short = False
    for name, value in values.items():
        raw = value if isinstance(value, str) else policy_json(value)
        shown, size, cut_here = shown_text(raw, full)
        # A string shows as JSON: a control is escaped.
        if isinstance(value, str):
            shown = policy_json(shown)
        short |= cut_here
        lines.append(f"    {name} = {shown}   ({size} bytes)")
        lines += [f"      CAUTION  {note}" for note in cautions(name, raw)]
    return short

def late_text(observation, text=None):
    """A late outcome as a sentence."""
    text = outcome_text(observation) if text is None else text
    if step_outcome(observation) == "ok":
        what = f"it succeeded, with this result: {text}"
    else:
        what = f"it failed: {text}"
    return ("the attempt that was cut off did finish after all, after its"
            f" run was taken over: {what}")

def tried_text(step):
    """Why no `when` entry decided the step."""
    record = parse(step["policy"]) if step["policy"] else {}
    tried = record.get("tried")
    return f"no when entry held: {'; '.join(tried)}" if tried else ""

def unshown(short, what, verb, how):
    """'' if every byte was shown, else why nothing is decided."""
    if not short:
        return ""
    return (f"{how} to show every byte before you {verb}: {what} has a value"
            " too long to print whole, so it was shown short")

def undecided(short, seen_end):
    """watch's rule: '' once every byte was shown and the end of the
    approval reached, else why a key decides nothing."""
    return unshown(short, "this approval", "decide", "press f") or (
        "" if seen_end else "scroll to the end of the approval before you decide")

def confirmed(lines, out, shortened=False, what="", verb="", agreed=True,
              no_terminal=""):
    """Print; True for a yes to them, False for a no. Usage when
    nothing may be decided: a value shown short, or no terminal to
    type yes at (`no_terminal` says what was not done)."""
    tell(*lines, out=out, flush=True)
    why = unshown(shortened, what, verb, "run the command again with -full")
    if why:
        raise Usage(why)
    if agreed:
        return True
    if not sys.stdin.isatty():
        raise Usage(no_terminal)
    tell(f"{verb} {what}? type yes to {verb}: ", end="", out=out, flush=True)
    return input().strip().lower() in ("y", "yes")

def consents(opts, lines, shortened, what, verb, agreed, done, how):
    """Asks as confirmed does (on stderr under -json): True to go on,
    False once "nothing {done}" is said. `how` ends the hint to add -yes."""
    out = sys.stderr if opts.json else sys.stdout
    no_terminal = ("refusing without -yes or a terminal to type yes at: nothing was"
                   f" {done}; add -yes{how} printed above")
    if confirmed(lines, out, shortened, what, verb, agreed, no_terminal):
        return True
    tell(f"nothing {done}", out=out)
    return False

GRANT_PROMISE = ("A call this grant covers runs without asking while it is in force."
                 " It never turns a deny into anything else, never re-runs a call whose"
                 " outcome is unknown, and the tool's limits still count the calls it"
                 " lets through.")

def grant_printout(config, tool, grant, parsed, span, waits, full):
    """(lines, shortened). No id: an id printed before a no_terminal would
    name a grant that does not exist."""
    covers = ", and whose arguments:" if parsed else ", whatever their arguments"
    lines = ["GRANT (not created until confirmed)",
             f"  tool           {tool.name} (server {tool.server.name}, upstream tool"
             f" {tool.upstream_name})", f"  session        {config.session}",
             "  covers         calls that would wait for an operator" + covers]
    shortened = False
    for condition in parsed:
        text, _, cut_here = shown_text(condition.text(), full)
        lines.append(f"    {text}")
        shortened |= cut_here
    lines += [f"  in force       for {format_duration(span)} from when it is confirmed",
              f"  by             {grant['by']}"]
    if grant["note"]:
        lines.append(f"  note           {grant['note']}")
    lines.append(f"  {GRANT_PROMISE}")
    if waits:
        lines.append(f"  releases       {len(waits)} calls waiting now, each approved by"
                     " the grant as printed here:")
    else:
        lines.append("  releases       no call: none that waits now is one it covers")
    for _, printed, cut_here in waits:
        lines += [f"    {line}" for line in printed]
        shortened |= cut_here
    return lines, shortened

def confirmed_conditions(conditions):
    """Each `under` kept as resolved when shown: resolved later, a
    link put in since would move the grant."""
    return {c.pointer: {name: want if name == "under" else c.raw[name]
                        for name, want in c.tests} for c in conditions}

def grant_releasing(tx, grant, span, waits, by):
    """Create `grant` and approve each wait it printed, bound to the
    hash shown: [(approval, decide_approval's word)]."""
    # It starts in the transaction that records it, so no call
    # decided before, nor recheck of one, finds it in force.
    grant["created_at"] = now()
    grant["expires_at"] = later(grant["created_at"], span)
    tx.create_grant(grant)
    released = f"released by grant {grant['id']}, granted by {by}"
    return [(a, tx.decide_approval(a["id"], a["hash"], "approved",
                                   f"grant {grant['id']}", released))
            for a, _, _ in waits]


# =============================================================================================
# 11. Canonical JSON
#
# Reads as: library
#
# Contract: parse(data) returns one JSON value, each number a Number keeping its literal,
# or raises CanonicalError with the first reason: nesting past 256, invalid UTF-8, not one
# RFC 8259 value, an unpaired surrogate escape, a repeated key, a float64 overflow in a
# container, a literal past the bound. canonical: no whitespace, keys sorted, Numbers as
# written, and `<>&`, U+2028/9 escaped besides JSON's own; policy_json without those five;
# pretty_json indented. Differential test: tests/test_canonical.py (a reference encoder;
# node's TextDecoder and JSON.parse).
# =============================================================================================

MAX_DEPTH = 256
MAX_NUMBER_CHARS = 10000
MAX_EXPONENT = 10000
FLAT_WIDTH = 72
# Sums are exact: the precision spans any literal parse admits; a sum that rounds raises.
EXACT = decimal.Context(
    prec=2 * MAX_EXPONENT + MAX_NUMBER_CHARS + 64,
    Emax=10 * MAX_EXPONENT, Emin=-10 * MAX_EXPONENT,
    traps=[decimal.Inexact, decimal.Overflow, decimal.InvalidOperation])

class CanonicalError(ValueError):
    """`place`: where a text stops being JSON, or ''."""
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

_STRING_RE = re.compile(rb'"[^"]*"?')
_ONE_KIND = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))

def _too_deep(data):
    """Whether it nests past MAX_DEPTH, in linear time; exact for valid JSON: (1) depth is
    at most the count of openings; (2) outside strings is no backslash: removing `\\\\`
    then `\\"` removes exactly the escaped ones; (3) every quote left bounds a string, so
    _STRING_RE removes them; (4) a pass removing every `[]` lowers the depth by one."""
    if data.count(b"[") + data.count(b"{") <= MAX_DEPTH:
        return False  # (1)
    data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    data = _STRING_RE.sub(b"", data).translate(_ONE_KIND, _NOT_BRACKETS)  # (3)
    passes = 0  # (4); an unbalanced one is counted as it is
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
    head = literal[:24]
    if len(literal) > MAX_NUMBER_CHARS:
        return f"number {head}... is longer than {MAX_NUMBER_CHARS} characters"
    _, e, exponent = literal.lower().partition("e")
    digits = exponent.lstrip("+-").lstrip("0")
    if e and (len(digits) > 5 or (digits and int(digits) > MAX_EXPONENT)):
        return f"number {head} has an exponent beyond ±{MAX_EXPONENT}"
    return ""

JSON_NUMBER_RE = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
SURROGATE_RE = re.compile("[\ud800-\udfff]")

def _first_surrogate(value, objects=True):
    """objects=False: the pairs hook looked inside those."""
    if isinstance(value, str):
        match = SURROGATE_RE.search(value)
        return match.group() if match else ""
    items = value if isinstance(value, list) else []
    if isinstance(value, dict) and objects:
        items = [x for pair in value.items() for x in pair]
    return next(filter(None, (_first_surrogate(x, objects) for x in items)), "")

class _Reading:
    """The first faults the hooks found in one document."""
    def __init__(self):
        self.repeated = self.overflow = self.bound = self.surrogate = None
    def number(self, literal):
        reason = number_bound(literal)
        self.bound = self.bound or reason
        if not reason and not self.overflow and math.isinf(float(literal)):
            self.overflow = literal
        return Number(literal)
    def pairs(self, items):
        # Every pair is seen, a replaced one too: its surrogate is reported first.
        obj = {}
        for key, value in items:
            if not self.surrogate:
                self.surrogate = _first_surrogate(key) or \
                    _first_surrogate(value, objects=False)
            if key in obj and self.repeated is None:
                self.repeated = key
            obj[key] = value
        return obj
    def constant(self, name):
        raise ValueError(name)

def parse(data):
    """One document, its first fault in the contract's order."""
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
        value = json.JSONDecoder(
            object_pairs_hook=reading.pairs, parse_int=reading.number,
            parse_float=reading.number, parse_constant=reading.constant).decode(text)
    except (ValueError, RecursionError) as err:  # colno: a json.JSONDecodeError
        place = f"line {err.lineno} column {err.colno}" if hasattr(err, "colno") else ""
        raise CanonicalError("not valid JSON", place) from None
    surrogate = reading.surrogate or _first_surrogate(value, objects=False)
    if surrogate:
        raise CanonicalError(f"unpaired surrogate \\u{ord(surrogate):04x}")
    if reading.repeated is not None:
        key = json.dumps(reading.repeated, ensure_ascii=False)
        raise CanonicalError(f"duplicate key {key}")
    # As the anchor: an overflow inside a container fails.
    if reading.overflow and not isinstance(value, Number):
        raise CanonicalError(
            f"number {reading.overflow[:24]} is beyond the range of a float64")
    if reading.bound:
        raise CanonicalError(reading.bound)
    return value

_HTML_ESCAPES = (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                 ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))
# The contract's escaping short of _HTML_ESCAPES, in C.
encode_string = json.encoder.encode_basestring
_CONSTANTS = {True: "true", False: "false", None: "null"}

def _encode(value, out):
    """Measured no slower than the C encoder."""
    if isinstance(value, str):
        out.append(encode_string(value))
    elif isinstance(value, Number):
        out.append(value.literal)
    elif isinstance(value, dict):
        for i, key in enumerate(sorted(value)):
            out.append(("," if i else "{") + encode_string(key) + ":")
            _encode(value[key], out)
        out.append("}" if value else "{}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            out.append("," if i else "[")
            _encode(item, out)
        out.append("]" if value else "[]")
    elif isinstance(value, bool) or value is None:
        out.append(_CONSTANTS[value])
    elif isinstance(value, int):
        out.append(str(value))
    elif isinstance(value, float):
        out.append(repr(value) if math.isfinite(value) else "null")
    else:
        raise TypeError(f"cannot encode {type(value).__name__} as JSON")

def _encoded(value, html):
    out = []
    _encode(value, out)
    text = "".join(out)
    # These characters stand only inside strings, and no escape writes one: this escapes
    # exactly the strings'.
    for ch, escape in _HTML_ESCAPES if html else ():
        text = text.replace(ch, escape)
    return text

def canonical(value):
    """The same bytes whatever embeds them in HTML or JS."""
    return _encoded(value, True).encode("utf-8")

def dumps(value):
    return canonical(value).decode("utf-8")

def policy_json(value):
    """Without _HTML_ESCAPES: what people and the policy read."""
    return _encoded(value, False)

def pretty_json(value, indent="  ", level=0, flat=None, ordered=False):
    """From level `flat` down a short value keeps one line."""
    if flat is not None and level >= flat and len(policy_json(value)) <= FLAT_WIDTH:
        return policy_json(value)
    if not value or not isinstance(value, (dict, list)):
        return policy_json(value)
    inner = indent * (level + 1)
    def shown(item):
        return pretty_json(item, indent, level + 1, flat, ordered)
    if isinstance(value, dict):
        keys = value if ordered else sorted(
            value, key=lambda k: k.encode("utf-8", "surrogatepass"))
        items = [f"{inner}{encode_string(k)}: {shown(value[k])}" for k in keys]
        ends = "{}"
    else:
        items, ends = [inner + shown(v) for v in value], "[]"
    return ends[0] + "\n" + ",\n".join(items) + "\n" + indent * level + ends[1]

# =============================================================================================
# 12. Text safe to show
#
# Reads as: library
#
# Contract: sanitize shows as ASCII what could move the cursor, reorder or hide text, or
# draw a line; nothing else changes, and a second pass changes nothing. cut keeps at most
# `limit` UTF-8 bytes, marked '…'. tell is the one way a line reaches a person; a result
# passed on is never sanitized.
# Differential test: tests/test_sanitize_differential.py (node's Unicode properties).
# =============================================================================================

INVISIBLE = {0x00AD, 0x061C, 0x180E, 0xFEFF}.union(
    range(0x200B, 0x2010), range(0x2028, 0x202F), range(0x2060, 0x2065),
    range(0x2066, 0x2070), range(0xFFF9, 0xFFFC), range(0xE0000, 0xE0080),
    range(0x1BCA0, 0x1BCA4), range(0x1D173, 0x1D17B))
# The table as one class: text with nothing to change costs one scan in C.
_NEEDS_CARE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff%s]"
                         % "".join(map(chr, sorted(INVISIBLE))))
MAX_COMBINING = 4

def _is_mark(ch):
    return unicodedata.category(ch).startswith("M")

def _shown(ch):
    code = ord(ch)
    if ch in "\r\n":
        return " "
    if code < 0x20 or 0x7F <= code <= 0x9F:
        return f"\\x{code:02x}"
    if 0xD800 <= code <= 0xDFFF:
        return "\ufffd"
    if code in INVISIBLE:
        return f"\\u{{{code:04x}}}"
    return ch

def sanitize(text):
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if not _NEEDS_CARE.search(text) and not _has_long_combining_run(text):
        return text
    out, run = [], 0
    for ch in list(text) + [""]:
        if ch and _is_mark(ch):
            run += 1
            out.append(ch if run <= MAX_COMBINING else "")
            continue
        if run > MAX_COMBINING:
            out.append(f"[+{run - MAX_COMBINING} combining marks dropped]")
        run = 0
        out.append(_shown(ch) if ch else "")
    return "".join(out)

# Every combining mark is at or above U+0300: only runs of those are read one by one.
_MAYBE_MARKS = re.compile("[\u0300-\U0010ffff]{%d,}" % (MAX_COMBINING + 1))

def _has_long_combining_run(text):
    for candidate in _MAYBE_MARKS.finditer(text):
        run = 0
        for ch in candidate.group():
            run = run + 1 if _is_mark(ch) else 0
            if run > MAX_COMBINING:
                return True
    return False

def cut(text, limit):
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return text
    mark = "…" if limit >= 3 else ""  # "…" is 3 bytes
    return data[:limit - len(mark.encode())].decode("utf-8", "ignore") + mark

def clean(text, limit):
    """Cut first: a long text costs only its first `limit`."""
    return cut(sanitize(cut(text[:limit + 1], limit)), limit)

def quote(text):
    return '"' + sanitize(text).replace("\\", "\\\\").replace('"', '\\"') + '"'

def tell(*lines, out=None, end="\n", flush=False):
    """Each argument one line, sanitized whole."""
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
# 13. ECMA-262 patterns
#
# Reads as: library
#
# Contract: compile_pattern accepts a subset of ECMA-262 u-mode patterns, or raises
# PatternError saying why and what to write: no backreferences, lookaround, named groups,
# \p{..}, \cX, escaped surrogates, counts over 1000, nesting over 100, NFAs over 10,000
# states. Pattern.search answers as RegExp's test, in time linear in the text; PatternWork
# bounds one call's work. Differential test: tests/test_patterns.py (node's RegExp).
# =============================================================================================

# Not Python's re: its dialect differs (\s, ., $), and it backtracks (^(a+)+$ doubles its
# work per character). A tree, then a Thompson NFA, run as a DFA built lazily.
_MAX_CODE_POINT = 0x10FFFF
_MAX_COUNT = 1000       # largest n or m in {n,m}
_MAX_STATES = 10000     # bounds compile time and one DFA step
_PATTERN_DEPTH = 100    # far from Python's recursion limit
_CACHE_BUDGET = 50000   # cached states + moves, then dropped
# A set is a tuple of sorted, disjoint, non-adjacent (lo, hi) code point ranges.
_DIGIT = ((0x30, 0x39),)
_WORD_RANGES = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
          (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
          (0xFEFF, 0xFEFF))
_WORD_CHARS = frozenset(chr(c) for lo, hi in _WORD_RANGES for c in range(lo, hi + 1))
_ASSERTIONS = (("^", "^"), ("$", "$"), ("\\b", "b"), ("\\B", "B"))
_LOOKAROUND = (("(?=", "lookahead"), ("(?!", "lookahead"),
               ("(?<=", "lookbehind"), ("(?<!", "lookbehind"))
# A lazy ? changes nothing for a yes/no search.
_QUANTIFIER = re.compile(r"(?:([*+?])|\{([0-9]+)(,([0-9]*))?\})\??")
_HEX_ESCAPE = re.compile(r"\\(?:x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|u\{([0-9a-fA-F]+)\})")

class PatternError(ValueError):
    """One sentence: why a pattern is refused."""

def _negate(ranges):
    """The gaps around a set's ranges."""
    edges = [(-1, -1), *ranges, (_MAX_CODE_POINT + 1, 0)]
    return tuple((a + 1, b - 1) for (_, a), (b, _) in zip(edges, edges[1:]) if a + 1 < b)

def _normalize(ranges):
    out = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(hi, out[-1][1]))
        else:
            out.append((lo, hi))
    return tuple(out)

def _contains(ranges, cp):
    # the last range starting at or before cp
    i = bisect.bisect_right(ranges, (cp, _MAX_CODE_POINT)) - 1
    return i >= 0 and cp <= ranges[i][1]

def _as_ranges(member):
    return ((member, member),) if isinstance(member, int) else member

_DOT = _negate(((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)))  # line terminators
# A backslash and one character: a code point, or a set. Of the punctuation, u mode
# escapes only syntax characters and /.
_ESCAPES = {"t": 0x09, "n": 0x0A, "v": 0x0B, "f": 0x0C, "r": 0x0D, "d": _DIGIT,
            "D": _negate(_DIGIT), "w": _WORD_RANGES, "W": _negate(_WORD_RANGES),
            "s": _SPACE, "S": _negate(_SPACE), **{c: ord(c) for c in "^$\\.*+?()[]{}|/"}}
_CLASS_ESCAPES = {**_ESCAPES, "b": 0x08, "-": 0x2D}  # inside [...], \b is a backspace
_UNSUPPORTED_ESCAPES = {
    **dict.fromkeys("k123456789", "backreferences are not supported"),
    **dict.fromkeys("pP", "Unicode property escapes \\p{...} are not supported"),
    "c": "control escapes \\cX are not supported; write \\xNN"}

# ---- Parsing: a u-mode Pattern to a tree. ('set', ranges) one character in ranges;
# ('assert', kind) kind one of ^ $ b B; ('cat', [nodes]) a sequence, maybe empty;
# ('alt', [nodes]) alternatives; ('rep', node, lo, hi) lo to hi copies, hi None: no bound.
class _Parser:
    def __init__(self, source):
        self.src, self.pos, self.depth = source, 0, 0
    def peek(self, ahead=0):   # "" past the end
        return self.src[self.pos + ahead:self.pos + ahead + 1]
    def take(self, text):
        found = self.src.startswith(text, self.pos)
        self.pos += len(text) if found else 0
        return found
    def fail(self, message):
        raise PatternError(message)
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
        # An assertion cannot repeat (u mode): a quantifier after one fails as an atom.
        for text, kind in _ASSERTIONS:
            if self.take(text):
                return ("assert", kind)
        atom, bounds = self.atom(), self.quantifier()
        return ("rep", atom) + bounds if bounds else atom
    def quantifier(self):
        """(lo, hi) of a quantifier next, hi None for no bound."""
        m = _QUANTIFIER.match(self.src, self.pos)
        if not m:
            return None
        self.pos = m.end()
        simple, lo, comma, hi = m.groups()
        if simple:
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[simple]
        hi = lo if comma is None else hi or None
        if any(len(count) > 4 or int(count) > _MAX_COUNT for count in (lo, hi or "0")):
            self.fail(f"repetition counts above {_MAX_COUNT} are not supported")
        if hi and int(hi) < int(lo):
            self.fail(f"the numbers in the quantifier at offset "
                      f"{m.start()} are out of order")
        return int(lo), None if hi is None else int(hi)
    def atom(self):
        c, at = self.peek(), self.pos
        if c == "(":
            return self.group()
        if c == "\\":
            return ("set", _as_ranges(self.escape(False)))
        if _QUANTIFIER.match(self.src, at):
            self.fail(f"nothing to repeat at offset {at}")
        if c in ("{", "}", "]"):
            self.fail(f"a lone {c} is not allowed (write \\{c})")
        self.pos += 1
        if c == "[":
            return ("set", self.character_class(at))
        return ("set", _DOT if c == "." else ((ord(c), ord(c)),))
    def group(self):
        at = self.pos
        for text, kind in _LOOKAROUND:
            if self.src.startswith(text, at):
                self.fail(f"{kind} {text} is not supported")
        self.pos += 1
        if self.take("?<"):
            self.fail(f"the named group at offset {at} is not "
                      f"supported; write (?:...) instead")
        if self.take("?") and not self.take(":"):
            self.fail(f"the group at offset {at} has an unknown (? form")
        self.depth += 1
        if self.depth > _PATTERN_DEPTH:
            self.fail(f"groups nested more than {_PATTERN_DEPTH} deep are not supported")
        node = self.disjunction()
        self.depth -= 1
        if not self.take(")"):
            self.fail(f"unbalanced parenthesis at offset {at}")
        return node
    def character_class(self, at):
        negated, ranges = self.take("^"), []
        while not self.take("]"):
            if self.pos >= len(self.src):
                self.fail(f"the character class at offset {at} is not closed")
            first = self.class_member()
            if self.peek(1) not in ("", "]") and self.take("-"):
                last = self.class_member()
                if not isinstance(first, int) or not isinstance(last, int):
                    self.fail(f"a range in the class at offset {at} uses \\d, \\s or \\w")
                if first > last:
                    self.fail(f"a range in the class at offset {at} is out of order")
                ranges.append((first, last))
            else:
                ranges.extend(_as_ranges(first))
        ranges = _normalize(ranges)
        return _negate(ranges) if negated else ranges
    def class_member(self):
        if self.peek() == "\\":
            return self.escape(True)
        self.pos += 1
        return ord(self.src[self.pos - 1])
    def escape(self, in_class):
        """A backslash escape's code point, or the set of \\d etc."""
        at, c = self.pos, self.peek(1)
        number = _HEX_ESCAPE.match(self.src, at)
        value = number and int(number[number.lastindex], 16)
        self.pos += 2
        if number and 0xD800 <= value <= 0xDFFF:
            self.fail(f"the escaped surrogate at offset {at} is not "
                      f"supported; write the character itself or \\u{{...}}")
        if number and value <= _MAX_CODE_POINT:
            self.pos = number.end()
            return value
        if c == "":
            self.fail("the pattern ends with a lone backslash")
        if c in _UNSUPPORTED_ESCAPES:
            self.fail(_UNSUPPORTED_ESCAPES[c])
        if c in (_CLASS_ESCAPES if in_class else _ESCAPES):
            return _CLASS_ESCAPES[c]
        if c == "0" and not "0" <= self.peek() <= "9":
            return 0
        self.fail(f"the escape \\{c} at offset {at} is not allowed")

# ---- Compiling: tree to Thompson NFA. A state is (kind, arg, out); only 'set' consumes a
# character; state 0 is the match. Every _compile call emits a state, so expanding
# (a{1000}){1000} stops at the cap.
def _emit(program, state):
    if len(program) >= _MAX_STATES:
        raise PatternError(f"the pattern is too large (more than {_MAX_STATES} states)")
    program.append(state)
    return len(program) - 1

def _compile(node, out, program):
    """Node's entry state; it continues to `out`."""
    kind = node[0]
    if kind in ("set", "assert"):
        return _emit(program, (kind, node[1], out))
    if kind == "alt":
        entries = [_compile(n, out, program) for n in node[1]]
        return _emit(program, ("split", entries, None))
    if kind == "cat" and node[1]:
        for child in reversed(node[1]):
            out = _compile(child, out, program)
        return out
    if kind == "cat" or node[3] == 0:  # nothing, or no copies
        return _emit(program, ("split", [out], None))
    _, body, lo, hi = node
    if hi is None:  # a loop: enter the body, back here, or leave
        entry = _emit(program, ("split", [], None))
        loop = _compile(body, entry, program)
        program[entry][1].extend([loop, out])
    else:  # hi - lo optional copies, nested: (body (body)?)?
        entry = out
        for _ in range(hi - lo):
            copy = _compile(body, entry, program)
            entry = _emit(program, ("split", [copy, out], None))
    for _ in range(lo):
        entry = _compile(body, entry, program)
    return entry

@functools.lru_cache(maxsize=512)
def compile_pattern(pattern):
    if not isinstance(pattern, str):
        raise PatternError("a pattern must be a string")
    parsing = _Parser(pattern)
    tree = parsing.disjunction()
    if parsing.pos < len(pattern):  # the top level stops only at a stray ')'
        raise PatternError(f"unbalanced parenthesis at offset {parsing.pos}")
    program = [("match", None, None)]
    return Pattern(program, _compile(tree, 0, program))

# ---- Matching: a lazily built DFA. A DFA state: the NFA states the text leads to before
# epsilon edges (followed once the next character is known: only then are ^ $ \b \B
# decided), and its moves: character (None: the end) -> _DFAState, True or False. A
# character costs a dict lookup, or one pass over at most _MAX_STATES states: linear.
class _DFAState:
    __slots__ = ("nfa", "prev_word", "at_start", "moves")
    def __init__(self, nfa, prev_word, at_start):
        self.nfa, self.prev_word, self.at_start = nfa, prev_word, at_start
        self.moves = {}

class Pattern:
    """Its caches hold derived data only: threads share it."""
    def __init__(self, program, start):
        self._program, self._start = program, start
        self.size = len(program)  # the most one character can cost, in NFA states
        self._states, self._cached = {}, 0
        self._initial = self._state(frozenset([start]), False, True)
        # A search restarts at every position unless nothing is reached off the start (^).
        away = {"^": False, "$": True, "b": True, "B": True}
        self._restart = any(self._closure([start], away))  # a state or a match
    def search(self, text):
        """Whether it matches somewhere in text, as test()."""
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
        if self._cached > _CACHE_BUDGET:
            self._forget()
        next_word = ch in _WORD_CHARS
        edge = state.prev_word != next_word
        truth = {"^": state.at_start, "$": ch is None, "b": edge, "B": not edge}
        sets, matched = self._closure(state.nfa, truth)
        if matched or ch is None:
            move = matched
        else:
            cp, program = ord(ch), self._program
            nfa = {program[s][2] for s in sets if _contains(program[s][1], cp)}
            if self._restart:
                nfa.add(self._start)
            move = self._state(frozenset(nfa), next_word, False) if nfa else False
        state.moves[ch] = move  # True and False end a search
        self._cached += 1
        return move
    def _closure(self, pending, truth):
        """The 'set' states epsilon edges reach, and a match."""
        seen, stack, sets, matched = set(), list(pending), [], False
        while stack:
            s = stack.pop()
            if s in seen:
                continue
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
        # Read the table once: another thread may _forget it between a store and a reread.
        key = (nfa, prev_word, at_start)
        state = self._states.get(key)
        if state is None:
            self._states[key] = state = _DFAState(*key)
            self._cached += len(nfa) + 1
        return state
    def _forget(self):
        """A state a search still holds stays correct."""
        for state in list(self._states.values()):
            state.moves.clear()
        self._states.clear()
        self._cached = 0

# Characters x NFA states one call's searches may cost: at 0.1 us a state, half a second.
PATTERN_WORK = 5_000_000
# In those units: one schema step (a subschema on a value, ~5 us) and one equality read.
SCHEMA_STEP = 50
EQUALITY_STEP = 5

class PatternCost(Exception):
    """A check the call's work cannot pay for."""

class PatternWork:
    """One call's budget, shared by all its values. A search is charged its most
    (characters x states) before it starts, so the charge depends on the call alone; what
    it found is kept, so reading the call again costs nothing."""
    def __init__(self):
        self.left, self.found = PATTERN_WORK, {}
    def search(self, pattern, text, at):
        key = (pattern, text)
        if key not in self.found:
            compiled = compile_pattern(pattern)
            cost = len(text) * compiled.size
            if cost > self.left:
                raise PatternCost(f"{at}: too long ({len(text)} characters) to be "
                                  f"checked against the pattern {quote(pattern)}")
            self.left -= cost
            self.found[key] = compiled.search(text)
        return self.found[key]
    def pay(self, cost, at):
        if cost > self.left:
            raise PatternCost(f"{at}: too large to be checked against the schema")
        self.left -= cost

# =============================================================================================
# 14. JSON Schema
#
# Reads as: library
#
# Contract: validate(schema, value) raises SchemaError naming the first failing
# path and what was expected (draft 2020-12, the older spellings, `$ref` inside
# the schema; unknown keywords ignored; numbers exact). schema_problem says why
# a schema cannot be used, or ''. What one call's PatternWork cannot pay raises
# PatternCost, never taken for a mismatch. pointed finds a value or its default.
# Differential tests: tests/test_schema_differential.py (jsonschema),
# tests/test_pointer_differential.py (referencing).
# =============================================================================================

JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
               "dependentSchemas")
_SCHEMA_ONE = ("additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "additionalItems")
_UNCHECKED = ("unevaluatedProperties", "unevaluatedItems", "$dynamicRef", "$recursiveRef")

class SchemaError(Exception):
    """A value that does not match, or a $ref to nothing."""

def _is_count(value):
    return isinstance(value, Number) and value.is_integer() and value.exact() >= 0

def _is_names(value):
    return isinstance(value, list) and all(isinstance(v, str) for v in value)

def _is(kind):
    return lambda value: isinstance(value, kind)

def _is_positive(number):
    return number.exact() > 0

_SHAPES = (*((key, _is_count, "a non-negative integer") for key in (
    "minLength", "maxLength", "minItems", "maxItems", "minProperties",
    "maxProperties", "minContains", "maxContains")),
    ("minimum", _is(Number), "a number"), ("maximum", _is(Number), "a number"),
    ("exclusiveMinimum", _is((Number, bool)), "a number"),
    ("exclusiveMaximum", _is((Number, bool)), "a number"),
    ("multipleOf", _is(Number), "a number"),
    ("multipleOf", _is_positive, "greater than 0"),
    ("required", _is_names, "a list of strings"), ("enum", _is(list), "a list"),
    ("uniqueItems", _is(bool), "true or false"),
    ("dependentRequired", _is(dict), "an object"),
    ("dependencies", _is(dict), "an object"))

def schema_problem(schema, root=None, where="#"):
    """Every keyword validate reads has its shape checked here."""
    root = schema if root is None else root
    if isinstance(schema, bool):
        return ""
    if not isinstance(schema, dict):
        return f"{where} is not a schema (an object or a boolean)"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind == [] or kind is not None and any(k not in JSON_TYPES for k in kinds):
        return f"{where}/type names an unknown type"
    for key in _UNCHECKED:
        if key in schema:
            return f"{where} uses {key}, which this validator does not check"
    for key, test, shape in _SHAPES:
        if key in schema and not test(schema[key]):
            return f"{where}/{key} must be {shape}"
    for name, needed in schema.get("dependentRequired", {}).items():
        if not _is_names(needed):
            return f"{where}/dependentRequired/{name} must be a list of strings"
    patterns = [("pattern", schema["pattern"])] if "pattern" in schema else []
    if isinstance(schema.get("patternProperties"), dict):
        patterns += [("patternProperties key", k) for k in schema["patternProperties"]]
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
    return _subschema_problem(schema, root, where)

def _subschema_problem(schema, root, where):
    subs = []
    for key in [key for key in _SCHEMA_LISTS if key in schema]:
        listed = schema[key]
        if not isinstance(listed, list) or (key != "prefixItems" and not listed):
            return f"{where}/{key} must be a non-empty list of schemas"
        subs += [(f"{where}/{key}/{i}", sub) for i, sub in enumerate(listed)]
    for key in [key for key in SCHEMA_MAPS if key in schema]:
        if not isinstance(schema[key], dict):
            return f"{where}/{key} must be an object of schemas"
        subs += [(f"{where}/{key}/{name}", sub) for name, sub in schema[key].items()]
    subs += [(f"{where}/{key}", schema[key]) for key in _SCHEMA_ONE if key in schema]
    items = schema.get("items")
    if isinstance(items, list):
        subs += [(f"{where}/items/{i}", sub) for i, sub in enumerate(items)]
    elif "items" in schema:
        subs.append((f"{where}/items", items))
    for name, needed in schema.get("dependencies", {}).items():
        if not _is_names(needed):
            subs.append((f"{where}/dependencies/{name}", needed))
    for at, sub in subs:
        problem = schema_problem(sub, root, at)
        if problem:
            return problem
    return ""

def resolve_ref(root, ref):
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise SchemaError(f"$ref {quote(str(ref))} does not point inside the schema")
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        node = _item(node, part.replace("~1", "/").replace("~0", "~"))
        if node is MISSING:
            raise SchemaError(f"$ref {quote(ref)} points at nothing in the schema")
    return node

MISSING = object()  # what a pointer finds where there is nothing
_INDEX_RE = re.compile(r"0|[1-9][0-9]{0,8}")

def parse_pointer(text, where):
    """A JSON Pointer into the arguments, as unescaped tokens."""
    if not isinstance(text, str) or not text.startswith("/"):
        raise ConfigError(f"{where}: {quote(str(text))} is not a JSON Pointer into the "
                          'arguments; write it like "/amount" or "/payee/name"')
    if re.search("~(?![01])", text):
        raise ConfigError(f"{where}: {quote(text)} has a '~' that is not ~0 or ~1; "
                          "write ~0 for '~' and ~1 for '/'")
    return tuple(t.replace("~1", "/").replace("~0", "~") for t in text[1:].split("/"))

def _item(value, token):
    if isinstance(value, dict) and token in value:
        return value[token]
    if isinstance(value, list) and _INDEX_RE.fullmatch(token) and int(token) < len(value):
        return value[int(token)]
    return MISSING

def pointed(args, tokens, schema):
    """The value at a pointer (absent: the default the server uses) and its schema."""
    value, node = args, schema
    for token in tokens:
        parent, value = value, _item(value, token)
        try:
            node = schema_child(schema, node, token)
        except SchemaError:  # a $ref to nothing has no default
            node = None
        if value is MISSING:
            if not isinstance(parent, dict) or not isinstance(node, dict) or \
                    "default" not in node:
                return MISSING, node
            value = node["default"]
    return value, node

def exact_number(value, node):
    """Also a string typed so, spelling a decimal ("20.00") as payment APIs do."""
    if isinstance(value, Number):
        return value.exact()
    if isinstance(value, str) and isinstance(node, dict) and node.get("type") == "string":
        return decimal_text(value)
    return None

def schema_child(schema, node, token):
    """The part of `schema` describing `token` inside `node`."""
    if isinstance(node, dict) and isinstance(node.get("$ref"), str):
        node = resolve_ref(schema, node["$ref"])
    if not isinstance(node, dict):
        return None
    properties = node.get("properties")
    if isinstance(properties, dict) and token in properties:
        return properties[token]
    if "items" in node and _INDEX_RE.fullmatch(token):
        return node["items"]
    return None

_TYPE_NAMES = ((type(None), "null"), (bool, "boolean"), (Number, "number"),
               (str, "string"), (list, "array"))

def _type_of(value):
    return next((name for kind, name in _TYPE_NAMES if isinstance(value, kind)), "object")

def _has_type(value, kind):
    if kind == "integer":
        return isinstance(value, Number) and value.is_integer()
    return _type_of(value) == kind

def json_key(value, work=None, at=""):
    """Equal exactly when JSON Schema calls two values equal."""
    if work is not None:
        work.pay(EQUALITY_STEP, at)
    if isinstance(value, str):
        return value
    if isinstance(value, Number):
        return "n", value.exact()
    if isinstance(value, list):
        return ("a", *(json_key(v, work, at) for v in value))
    if isinstance(value, dict):
        return "o", frozenset((k, json_key(v, work, at)) for k, v in value.items())
    return "c", value  # tagged, as True == 1 in Python

def json_equal(a, b):
    return json_key(a) == json_key(b)

def _path(where, part):
    return f"{where}/{part}" if where else f"/{part}"

def validate(schema, value, root=None, where="", work=None):
    """SchemaError at the first place `value` does not match."""
    root = schema if root is None else root
    work = PatternWork() if work is None else work
    at = where or "the arguments"
    if schema is True or schema == {}:
        return
    if schema is False:
        raise SchemaError(f"{at}: no value is allowed here")
    work.pay(SCHEMA_STEP, at)
    def check(sub):
        validate(sub, value, root, where, work)
    def matches(sub):
        return _matches(sub, value, root, where, work)
    if "$ref" in schema:
        check(resolve_ref(root, schema["$ref"]))
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is not None and not any(_has_type(value, k) for k in kinds):
        raise SchemaError(f"{at}: expected {' or '.join(kinds)}, got {_type_of(value)}")
    _validate_value(schema, value, at, work)
    if isinstance(value, list):
        _validate_array(schema, value, root, where, work, at)
    elif isinstance(value, dict):
        _validate_object(schema, value, root, where, work, at)
    for sub in schema.get("allOf", []):
        check(sub)
    if "anyOf" in schema and not any(matches(s) for s in schema["anyOf"]):
        raise SchemaError(f"{at}: matches none of the allowed shapes (anyOf)")
    if "oneOf" in schema and sum(matches(s) for s in schema["oneOf"]) != 1:
        raise SchemaError(f"{at}: must match exactly one of the allowed shapes (oneOf)")
    if "not" in schema and matches(schema["not"]):
        raise SchemaError(f"{at}: matches a shape that is not allowed (not)")
    if "if" in schema:
        branch = "then" if matches(schema["if"]) else "else"
        if branch in schema:
            check(schema[branch])

def _validate_value(schema, value, at, work):
    if "const" in schema or "enum" in schema:
        key = json_key(value, work, at)
        const = schema.get("const")
        if "const" in schema and json_key(const, work, at) != key:
            raise SchemaError(f"{at}: expected exactly {cut(policy_json(const), 80)}")
        options = schema.get("enum", [])
        if "enum" in schema and key not in [json_key(o, work, at) for o in options]:
            raise SchemaError(f"{at}: expected one of {cut(policy_json(options), 80)}")
    if isinstance(value, Number):
        _validate_number(schema, value.exact(), at)
    if not isinstance(value, str):
        return
    _check_count(schema, len(value), "Length", "characters", at)
    pattern = schema.get("pattern")
    if pattern is not None and not work.search(pattern, value, at):
        raise SchemaError(f"{at}: expected text matching the pattern {quote(pattern)}")

def _check_count(schema, count, keyword, things, at):
    least = schema.get("min" + keyword)
    if least is not None and count < least.exact():
        raise SchemaError(f"{at}: expected at least {least.literal} {things}")
    most = schema.get("max" + keyword)
    if most is not None and count > most.exact():
        raise SchemaError(f"{at}: expected at most {most.literal} {things}")

_BOUNDS = (("minimum", lambda v, b: v < b, "at least"),
           ("maximum", lambda v, b: v > b, "at most"),
           ("exclusiveMinimum", lambda v, b: v <= b, "greater than"),
           ("exclusiveMaximum", lambda v, b: v >= b, "less than"))

def _validate_number(schema, exact, at):
    for key, fails, word in _BOUNDS:
        bound = schema.get(key)
        if isinstance(bound, bool):  # draft-04: exclusiveMinimum true tightens minimum
            other = schema.get("minimum" if key == "exclusiveMinimum" else "maximum")
            if not (bound and isinstance(other, Number) and exact == other.exact()):
                continue
            bound = other
        elif not isinstance(bound, Number) or not fails(exact, bound.exact()):
            continue
        raise SchemaError(f"{at}: expected a number {word} {bound.literal}")
    step = schema.get("multipleOf")
    if isinstance(step, Number):
        try:
            remainder = exact % step.exact()
        except decimal.InvalidOperation:
            remainder = 1  # too far apart to divide exactly
        if remainder != 0:
            raise SchemaError(f"{at}: expected a multiple of {step.literal}")

def _matches(schema, value, root, where, work):
    try:
        validate(schema, value, root, where, work)
        return True
    except SchemaError:
        return False

def _validate_array(schema, value, root, where, work, at):
    _check_count(schema, len(value), "Items", "items", at)
    if schema.get("uniqueItems") is True:
        if len({json_key(item, work, at) for item in value}) < len(value):
            raise SchemaError(f"{at}: expected items that are all different")
    prefix, items = schema.get("prefixItems"), schema.get("items")
    if isinstance(items, list):  # draft-07's tuple form
        prefix, items = items, schema.get("additionalItems")
    prefix = prefix or []
    for i, item in enumerate(value):
        sub = prefix[i] if i < len(prefix) else items
        if sub is not None:
            validate(sub, item, root, _path(where, i), work)
    if "contains" not in schema:
        return
    found = sum(_matches(schema["contains"], item, root, where, work) for item in value)
    least = schema.get("minContains", Number("1")).exact()
    if found < least:
        raise SchemaError(f"{at}: expected at least {least} item(s) of the "
                          f"required shape (contains)")
    most = schema.get("maxContains")
    if most is not None and found > most.exact():
        raise SchemaError(f"{at}: expected at most {most.literal} item(s) of "
                          f"that shape (contains)")

def _validate_object(schema, value, root, where, work, at):
    for name in schema.get("required", []):
        if name not in value:
            raise SchemaError(f"{_path(where, name)}: this property is required")
    _check_count(schema, len(value), "Properties", "properties", at)
    properties = schema.get("properties", {})
    patterns = schema.get("patternProperties", {})
    extra = schema.get("additionalProperties")
    for name, item in value.items():
        place = _path(where, name)
        matched = name in properties
        if matched:
            validate(properties[name], item, root, place, work)
        for pattern, sub in patterns.items():
            if work.search(pattern, name, place):
                validate(sub, item, root, place, work)
                matched = True
        if not matched and extra is False:
            allowed = ", ".join(sorted(properties)) or "none"
            raise SchemaError(f"{place}: this property is not "
                              f"allowed (allowed: {allowed})")
        if not matched and isinstance(extra, dict):
            validate(extra, item, root, place, work)
    for name in value if "propertyNames" in schema else ():
        validate(schema["propertyNames"], name, root, _path(where, name), work)
    dependencies = {**schema.get("dependencies", {}),
                    **schema.get("dependentRequired", {}),
                    **schema.get("dependentSchemas", {})}
    for name, needed in dependencies.items():
        if name not in value:
            continue
        if not isinstance(needed, list):
            validate(needed, value, root, where, work)
            continue
        for other in needed:
            if other not in value:
                raise SchemaError(f"{_path(where, other)}: required when {name} is given")

# =============================================================================================
# 15. Hosts in URLs
#
# Reads as: library
#
# Contract: hosts are ASCII (another script in punycode, xn--). url_place(value)
# is a URL's (scheme, host) as a WHATWG parser reads them, or None where a client
# could reach another host or the host is not ASCII: then neither host_in nor
# host_not_in holds. host_entry reads an entry or raises ConfigError.
# Differential test: tests/test_edges_paths.py (node's URL).
# =============================================================================================

_LABEL_RE = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")
_NUMERIC_LABEL_RE = re.compile(r"0x[0-9a-f]*|[0-9]+")
_URL_UNSAFE_RE = re.compile(r"[\x00-\x20\x7f\\]")
_SCHEME_RE = re.compile(r"[a-z][a-z0-9+.-]*")

def normal_host(host):
    """Lower-cased, one trailing dot dropped, an IP address in its standard form;
    None where a client could reach another: not ASCII, an empty label, a
    numeric form not a dotted quad."""
    import ipaddress
    if not isinstance(host, str) or not host.isascii() or not host or "%" in host:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if ":" in host:
        try:
            address = ipaddress.IPv6Address(host)
        except ValueError:
            return None
        mapped = address.ipv4_mapped  # reaches the IPv4 host
        return str(mapped) if mapped else address.compressed
    host = host[:-1].lower() if host.endswith(".") else host.lower()
    labels = host.split(".")
    if not all(_LABEL_RE.fullmatch(label) for label in labels):
        return None
    if _NUMERIC_LABEL_RE.fullmatch(labels[-1]):
        try:
            return str(ipaddress.IPv4Address(host))
        except ValueError:
            return None
    return host

def url_place(value):
    from urllib.parse import urlsplit
    if not isinstance(value, str) or len(value) > 8192 or _URL_UNSAFE_RE.search(value):
        return None
    try:
        parts = urlsplit(value)
        parts.port  # a port that is not a number spoils the URL
    except ValueError:
        return None
    if not parts.scheme or not parts.netloc:
        return None
    written = parts.netloc.rpartition("@")[2]
    if written.startswith("["):
        written = written[:written.find("]") + 1]
    else:
        written = written.partition(":")[0]
    host = normal_host(written)
    return None if host is None else (parts.scheme, host)

def host_matches(scheme, host, entries):
    for entry in entries:
        wanted, sep, name = entry.partition("://")
        if not sep:
            wanted, name = scheme, entry
        dotted = name.startswith(".") and host.endswith(name)
        if wanted == scheme and (dotted or host == name):
            return True
    return False

def host_entry(entry, with_scheme, where):
    """Only host_in takes a scheme: in host_not_in it would let the host
    through under every other scheme."""
    scheme, sep, name = "", "", None
    if isinstance(entry, str):
        scheme, sep, name = entry.partition("://")
        scheme, name = (scheme.lower(), name) if sep else ("", entry)
    entry = str(entry)
    if isinstance(name, str) and not name.isascii():
        raise ConfigError(f"{where}: {quote(entry)} is not ASCII; write a host name in "
                          'another script in its punycode form, as "xn--bcher-kva.de" '
                          "for bücher.de")
    dot = "." if name and name.startswith(".") else ""
    host = normal_host(name[len(dot):]) if name else None
    if host is None or (dot and ":" in host) or \
            (scheme and not _SCHEME_RE.fullmatch(scheme)):
        raise ConfigError(f"{where}: {quote(entry)} is not a host name; write it like "
                          '"example.com", or ".example.com" for its subdomains')
    if scheme and not with_scheme:
        raise ConfigError(f"{where}: {quote(entry)} names a scheme, which only host_in "
                          'may require (as "https://example.com"); write host_not_in '
                          'entries like "example.com"')
    return scheme + sep + dot + host

# =============================================================================================
# 16. Paths as the kernel resolves them
#
# Reads as: library
#
# Contract: resolved_path resolves a path as the kernel would for a server, or to nothing
# where a server may read it otherwise; such a path lies under no directory (path_under).
# Differential test: tests/test_edges_paths.py (the kernel and the npm filesystem server).
# =============================================================================================

PATH_MAX = 4096  # the longest path the kernel opens
MAX_LINKS = 40   # links followed in one lookup, as the kernel

def _home(path):
    if path == "~" or path.startswith("~/"):
        return os.path.expanduser("~") + path[1:]
    return path

def path_under(value, roots):
    """Inside a root both as written and as resolved."""
    if not isinstance(value, str) or not value or "\x00" in value:
        return False
    value = _home(value)
    size = len(value.encode("utf-8", "surrogatepass"))
    if not value.startswith("/") or size > PATH_MAX:
        return False
    places = {resolved_path(os.path.normpath(value)), resolved_path(value)}
    return None not in places and all(
        any(place == root or place.startswith(root.rstrip("/") + "/") for root in roots)
        for place in places)

def resolved_path(path):
    """None where a server may read it otherwise: through /proc (its self links are the
    server's), past MAX_LINKS (a loop), through a file or an unreadable directory, or a
    name another entry equals under NFKC (servers match names normalised). Not
    realpath: its reading of a loop changed, and it recurses."""
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
        if mode is None or not stat.S_ISLNK(mode):
            resolved.append(name)
            continue
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
    return "/" + "/".join(resolved)

def _named_two_ways(parents, name):
    try:
        entries = os.listdir("/" + "/".join(parents))
    except FileNotFoundError:
        return False  # nothing there to mistake it for
    except OSError:
        return True
    key = unicodedata.normalize("NFKC", name)
    return any(entry != name and unicodedata.normalize("NFKC", entry) == key
               for entry in entries)

def resolved_root(text, where):
    if not isinstance(text, str) or not text or "\x00" in text:
        raise ConfigError(f"{where}: under lists directories as non-empty strings")
    path = _home(text)
    if not path.startswith("/"):
        raise ConfigError(f"{where}: {quote(text)} is relative; write the directory as "
                          "an absolute path or one starting with ~/")
    root = resolved_path(os.path.normpath(path))
    if root is None:
        raise ConfigError(
            f"{where}: {quote(text)} cannot be resolved as a server would (it goes "
            "through /proc, a loop or too many links, or is named two ways); name "
            "the directory itself")
    return root

# =============================================================================================
# 17. Durations and times
#
# Reads as: library
#
# Contract: parse_duration reads Go's syntax in whole-number terms ("15s", "1h30m",
# "0") as int64 ns; ValueError for the rest, fractions too. format_duration is Go's
# String. format_time writes UTC "YYYY-MM-DDTHH:MM:SS.ffffffZ", fixed width, so stored
# times compare as strings.
# Differential test: tests/test_durations_differential.py (durationpy, datetime, Go).
# =============================================================================================

_DURATION_UNITS = {"ns": 1, "us": 1000, "µs": 1000, "μs": 1000, "ms": 10**6,
                   "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9}
_DURATION_RE = re.compile(r"([0-9]{1,20})(ns|us|µs|μs|ms|s|m|h)")

def parse_duration(text):
    sign = -1 if text.startswith("-") else 1
    body = text[1:] if text.startswith(("+", "-")) else text
    if body == "0":
        return 0
    total, pos = 0, 0
    while pos < len(body) or not pos:
        match = _DURATION_RE.match(body, pos)
        if not match:
            raise ValueError(f'invalid duration "{text}"')
        total += int(match[1]) * _DURATION_UNITS[match[2]]
        pos = match.end()
    if total > 2**63 - (sign > 0):  # Go's int64: -2^63 ns is a duration, 2^63 not
        raise ValueError(f'duration "{text}" is too long')
    return sign * total

def format_duration(ns):
    """Go's Duration.String: 0s, 300ms, 2s, 1m30s, 24h0m0s."""
    sign, ns = ("-" if ns < 0 else ""), abs(ns)
    for unit, size in (("ns", 1), ("µs", 1000), ("ms", 10**6)):
        if 0 < ns < size * 1000:  # exact: under 28 digits
            return f"{sign}{decimal.Decimal(ns) / size:f}{unit}"
    hours, rest = divmod(ns, 3600 * SECOND)
    minutes, rest = divmod(rest, 60 * SECOND)
    seconds = f"{decimal.Decimal(rest) / SECOND:f}s"
    if hours:
        return f"{sign}{hours}h{minutes}m{seconds}"
    if minutes:
        return f"{sign}{minutes}m{seconds}"
    return sign + seconds

def now():
    return format_time(time.time())

def format_time(seconds):
    return _written(datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc))

def parse_time(text):
    return _moment(text).timestamp()

def later(text, ns):
    # Integers: floats can round a sub-µs duration the wrong way, past 2106 a whole one
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
# 18. Fields of a configuration
#
# Reads as: library
#
# Contract: each reader returns a field exactly when the JSON Schema its docstring names
# accepts it (a number as int or Decimal, a duration in ns, absent as its `absent:`
# says), else raises ConfigError naming the field and what to write.
# Differential test: tests/test_fields_differential.py (jsonschema).
# =============================================================================================

def refuse_unknown(raw, fields, where):
    """{"type": "object", "propertyNames": {"enum": fields}}."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be an object")
    for key in raw:
        if key not in fields:
            raise ConfigError(f"{where} has an unknown field {quote(key)}; the "
                              f"fields are {', '.join(fields)}")

def field_string(raw, field, where, required=False):
    """{"type": "string"}; absent or null: ""; if required, {"type": "string",
    "minLength": 1}; absent or null: refused."""
    value = raw.get(field)
    if value is None and required:
        raise ConfigError(f"{where} needs {field}")
    if value is None:
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
    """{"type": "integer", "minimum": 1024, "maximum": most}, an int; absent: default."""
    cap = raw.get(field, Number(str(default)))
    if not isinstance(cap, Number) or not cap.is_integer() or \
            not 1024 <= cap.exact() <= most:
        raise ConfigError(f"{field} must be a whole number of bytes from 1024 to {most}")
    return int(cap.exact())

def field_duration(raw, field, where, default):
    """{"type": "string"} that parse_duration reads as 0 or more, as its ns;
    absent or null: default."""
    value = raw.get(field)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ConfigError(f'{where}.{field}: a duration is a string such as "15s"')
    try:
        ns = parse_duration(value)
    except ValueError:
        raise ConfigError(f"{where}.{field} {quote(value)} is not a duration; write "
                          'whole numbers with units, like "15s", "300ms" or "1h30m" '
                          '(not "1.5h")') from None
    if ns < 0:
        raise ConfigError(f"{where}.{field} must not be negative")
    return ns

def parse_decimal(value, where):
    """{"type": ["number", "string"], "maxLength": 10000, "pattern":
    "^-?(0|[1-9][0-9]*)([.][0-9]+)?([eE][+-]?0*([0-9]{1,4}|10000))?$"}, as a
    Decimal."""
    if isinstance(value, Number):
        return value.exact()
    found = decimal_text(value) if isinstance(value, str) else None
    if found is None:
        raise ConfigError(f'{where} must be a number or a decimal string such as "50.00"')
    return found

def decimal_text(text):
    """A JSON number's spelling as an exact Decimal, or None."""
    if JSON_NUMBER_RE.fullmatch(text) and not number_bound(text):
        return decimal.Decimal(text)
    return None

def whole_number(value, where, least, most=math.inf, note=""):
    """{"type": "integer", "minimum": least, "maximum": most}, as an int."""
    if not isinstance(value, Number) or not value.is_integer() or \
            not least <= value.exact() <= most:
        upto = "" if most == math.inf else f" and at most {most}"
        raise ConfigError(f"{where} must be a whole number of at "
                          f"least {least}{upto}{note}")
    return int(value.exact())

def one_of(value, choices, where):
    """{"enum": choices}."""
    if value not in choices:
        shown = value if isinstance(value, str) else policy_json(value)
        raise ConfigError(f"{where} is {quote(shown)}; use one of {', '.join(choices)}")
    return value

# =============================================================================================
# 19. Days and hours in a time zone
#
# Reads as: library
#
# Contract: During(raw, where) reads a `during` object (a `zone`, `days`, `hours`) or
# raises ConfigError. holds(at): on the zone's wall clock the instant's own day is listed
# and its minute in [start, end), which runs past midnight when end comes first.
# Differential test: tests/test_days_differential.py (node's Intl).
# =============================================================================================

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_CLOCK_RE = re.compile(r"([01][0-9]|2[0-3]):([0-5][0-9])|24:00")
_ZONE_RE = re.compile(r"[A-Za-z0-9_+.-]+(/[A-Za-z0-9_+.-]+){0,3}")

def _zone(name):
    """Only a name spelled as tz spells zones (zoneinfo recurses a level a
    part); no file beside them (right/ counts leap seconds)."""
    import zoneinfo  # only `during` needs the tz database
    if not isinstance(name, str) or not _ZONE_RE.fullmatch(name):
        return None
    lower = name.lower()
    if lower in ("localtime", "posixrules") or lower.startswith(("posix/", "right/")):
        return None
    try:
        return zoneinfo.ZoneInfo(name)
    except (ValueError, zoneinfo.ZoneInfoNotFoundError):
        return None

class During:
    def __init__(self, raw, where):
        if not isinstance(raw, dict) or not raw:
            raise ConfigError(f'{where} must be an object such as {{"days": "mon-fri", '
                              '"hours": "09:00-18:00", "zone": "Europe/Paris"}')
        refuse_unknown(raw, ("days", "hours", "zone"), where)
        zone = raw.get("zone")
        if zone is None:
            raise ConfigError(f"{where} needs zone, the time zone its days and hours are "
                              'read in, such as "Europe/Paris" or "UTC"')
        self.zone = _zone(zone)
        if self.zone is None:
            raise ConfigError(f"{where}.zone {quote(str(zone))} is not a time zone this "
                              'machine knows; name one such as "Europe/Paris" or "UTC"')
        if "days" not in raw and "hours" not in raw:
            raise ConfigError(f"{where} needs days, hours or both")
        self.raw = raw  # for the load report
        self.days, self.hours = set(range(7)), None
        if "days" in raw:
            self.days = self._days(raw["days"], f"{where}.days")
        if "hours" in raw:
            self.hours = self._hours(raw["hours"], f"{where}.hours")
    @staticmethod
    def _days(text, where):
        days = set()
        for part in text.split(",") if isinstance(text, str) else [""]:
            first, dash, last = part.strip().lower().partition("-")
            if first not in DAYS or (dash and last not in DAYS):
                raise ConfigError(f'{where} must read like "mon-fri" or "sat,sun"')
            start, end = DAYS.index(first), DAYS.index(last or first)
            if end < start:
                end += 7
            days.update(d % 7 for d in range(start, end + 1))
        return days
    @staticmethod
    def _hours(text, where):
        text = text if isinstance(text, str) else ""
        first, _, last = (t.strip() for t in text.partition("-"))
        if not _CLOCK_RE.fullmatch(first) or first == last or \
                not _CLOCK_RE.fullmatch(last) or first == "24:00":
            raise ConfigError(f'{where} must read like "09:00-18:00" (a range past '
                              'midnight, like "22:00-06:00", is allowed)')
        return tuple(int(t[:2]) * 60 + int(t[3:5]) for t in (first, last))
    def holds(self, at):
        local = datetime.datetime.fromtimestamp(at, self.zone)
        if local.weekday() not in self.days:
            return False
        if self.hours is None:
            return True
        minute = local.hour * 60 + local.minute
        start, end = self.hours
        if start < end:
            return start <= minute < end
        return minute >= start or minute < end

# =============================================================================================
# 20. What a result's record keeps
#
# Reads as: library
#
# Contract: result_record(passed) identifies exactly the result passed on: its size and
# sha256, and per block (up to RECORDED_BLOCKS) its labels and text, or the size and hash
# of its data; kept strings share CONTENT_CAP bytes, and a cut text keeps the size and
# hash of all of it. block_labels, outcome_text and result_summary read it back.
# Differential test: tests/test_result_record_differential.py (node's Buffer, crypto).
# =============================================================================================

CONTENT_CAP = 65536  # bytes of result text kept, and in prose
RECORDED_BLOCKS = 512  # blocks described one by one; the rest counted
_DATA_FIELD = {"resource": "blob", "image": "data", "audio": "data"}

def result_record(passed):
    room = [CONTENT_CAP]
    def keep(text):
        data = text.encode("utf-8", "surrogatepass")
        kept = data[:room[0]]
        room[0] -= len(kept)
        return text if len(kept) == len(data) else kept.decode("utf-8", "ignore")
    blocks = passed["content"]
    record = _size_and_hash(canonical(passed))
    record["blocks"] = [recorded_block(block, keep) for block in blocks[:RECORDED_BLOCKS]]
    if len(blocks) > RECORDED_BLOCKS:
        record["more_blocks"] = len(blocks) - RECORDED_BLOCKS
    if "structuredContent" in passed:
        value = passed["structuredContent"]
        structured = canonical(value)
        record["structured"] = _size_and_hash(structured)
        if len(structured) <= room[0]:
            record["structured"]["value"] = value
    if passed.get("isError") is True:
        record["is_error"] = True
    return record

def recorded_block(block, keep):
    kind = block["type"]
    entry = {"type": cut(kind, 100)}
    resource = block.get("resource") if kind == "resource" else None
    source = resource if isinstance(resource, dict) else block
    for label in ("mimeType", "uri", "name"):
        if isinstance(source.get(label), str):
            entry[label] = keep(source[label])
    text = source.get("text") if kind in ("text", "resource") else None
    data = source.get(_DATA_FIELD.get(kind))
    if isinstance(text, str):
        entry["text"] = keep(text)
        if entry["text"] != text:
            entry.update(_size_and_hash(text.encode("utf-8", "surrogatepass")))
    elif isinstance(data, str):
        decoded = _base64_bytes(data)
        if decoded is None:  # what was sent is what is identified
            sent = data.encode("utf-8", "surrogatepass")
            entry.update(_size_and_hash(sent), base64=False)
        else:
            entry.update(_size_and_hash(decoded))
    else:
        entry.update(_size_and_hash(canonical(block)))
    return entry

def _base64_bytes(text):
    """Its bytes if it is their one spelling: not "QR=="."""
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
    """Text blocks and the others' labels (withheld: labels), or the error;
    before schema 4, the content."""
    if "result" not in observed:
        content = observed["content"]
        if observed["kind"] != "tool_result":
            return content["error"]
        return content if isinstance(content, str) else policy_json(content)
    record = observed["result"]
    withheld = observed.get("withheld", False)
    parts, blocks, labels = [], record["blocks"], block_labels(record)
    for entry, label in zip(blocks, labels):
        text = entry.get("text") if entry["type"] == "text" and not withheld else None
        parts.append(label if text is None else text)
    parts += labels[len(blocks):]
    structured = record.get("structured", {})
    if not blocks and "value" in structured and not withheld:
        parts.append(policy_json(structured["value"]))
    return "\n".join(parts)

def result_summary(tool, record, withheld_over=0):
    count = len(record["blocks"]) + record.get("more_blocks", 0)
    parts = [f"{tool.server.name}/{tool.upstream_name}: {record['bytes']} bytes, "
             f"{count} block{'s' if count != 1 else ''}"]
    if "structured" in record:
        parts.append("structured content")
    if record.get("is_error"):
        parts.append("an error")
    if withheld_over:
        parts.append(f"withheld: more than {withheld_over} bytes")
    return ", ".join(parts)

# =============================================================================================
# 21. The lint
#
# Reads as: around the core
#
# Owns: the lint of what a model reads of a tool (description, titles, the schema's
# texts and names), where tool poisoning hides: findings the load check refuses a tool
# for unless its rule accepts exactly that text (lint_hash, section 5). It finds known
# tricks, not all.
# Promises: a finding names what and where, sanitized; it never changes a tool.
# Core it calls: tool_titles.
# =============================================================================================

LINT_LONG = 1024  # past this and 4 times its peers: far longer
_WHO = r"(user|human|operator|person|people|anyone)"
_PHRASES = (
    (r"<\s*/?\s*(important|system|instructions?|secret|hidden|admin|context|critical)\b"
     r"[^>]*>", LINT_HIGH, "a tag-like block"),
    (r"<!--", LINT_HIGH, "an HTML comment, which rendered text hides"),
    (r"\b(ignore|disregard|forget|override)\b.{0,40}\b(instructions?|prompts?|rules"
     r"|guidelines|guidance|directions|directives)\b",
     LINT_HIGH, "text telling the model to ignore its instructions"),
    (r"\b(system prompt|(previous|earlier|prior) instructions|you are now"
     r"|new instructions|as an ai)\b", LINT_HIGH,
     "text aimed at the model's instructions"),
    (r"\b(do not|don't|never|without)\b.{0,40}\b(tell|telling|inform|informing|mention"
     r"|mentioning|reveal|revealing|alert|alerting|notify|notifying|let|letting)\b"
     r".{0,40}\b" + _WHO + r"|\b(hide|hiding|conceal|concealing|keep|keeping)\b.{0,40}"
     r"\bfrom\b.{0,20}\b" + _WHO + r"|\bwithout\b.{0,20}\b(user|human|operator"
     r"|person)('s)?\s+(knowing|knowledge|noticing|consent)",
     LINT_HIGH, "text telling the model to keep something from the user"),
    (r"\b(when|whenever|every time)\b.{0,60}\b(any|every|all|other|another)\b.{0,20}"
     r"\b(tools?|commands?|calls?|requests?)\b.{0,80}\b(must|always|never)\b",
     LINT_HIGH, "instructions for the model's other calls"),
    (r"((?<![\w.])\.ssh\b|\bid[_ ](rsa|dsa|ecdsa|ed25519)\b|\.aws/credentials"
     r"|/etc/(passwd|shadow)|(^|[\s/'\"`])\.env\b|\.netrc\b|\.pgpass\b|\.git-credentials"
     r"|\.npmrc\b|\.pypirc\b|\.kube/config|\.docker/config\.json|\bmcp\.json\b"
     r"|claude_desktop_config\.json)", LINT_HIGH, "the place of a secret"),
    # Case matters: AWS_SECRET_ACCESS_KEY names a secret, an access_token parameter not.
    (r"(?-i:\b[A-Z][A-Z0-9_]*_(SECRET|TOKEN|PASSWORD|PASSWD|API_KEY|APIKEY|ACCESS_KEY"
     r"|PRIVATE_KEY|CREDENTIALS?)[A-Z0-9_]*\b)", LINT_HIGH,
     "a secret named by its variable"),
    (r"[\x1b\x9b]", LINT_HIGH,
     "terminal escape sequences, which can hide text on a screen"),
    (r"\b(other|another|different)\s+(tools?|servers?|functions?)\b",
     LINT_MEDIUM, "a reference to other tools or servers"),
    (r"\b[a-z][a-z0-9+.-]*://\S+", LINT_MEDIUM, "a URL"),
    (r"(^|[\s'\"`(=])(~/|/(etc|home|root|users|var|tmp|usr|opt)/|[a-z]:\\)\S*",
     LINT_MEDIUM, "a file path"))
_LINT_PHRASES = [(re.compile(pattern, re.I | re.S), severity, what)
                 for pattern, severity, what in _PHRASES]
# Advice to call a tool of its own server first is how servers sequence theirs: medium.
_FIRST_STEP = re.compile(r"\bbefore\b.{0,30}\b(using|calling|invoking|you use|you call)\b"
                         r".{0,120}\b(read|call|send|run|fetch|open|pass|include"
                         r"|upload)\b", re.I | re.S)
# Words that make a mention of another tool an instruction (shadowing).
_DIRECTIVE = re.compile(r"\b(must|always|never|instead|do not|don't)\b", re.I)
_SENTENCE_END = re.compile(r"[.!?](\s|$)")
_LETTERS_RE = re.compile(r"[^\W\d_]+")
# A selector hides a byte (U+FE00-FE0F: 0-15, U+E0100-E01EF: 16-255); an emoji takes one.
_SELECTOR_RUN = re.compile("[\ufe00-\ufe0f\U000e0100-\U000e01ef]{2,}")
_READ_KEYWORDS = ("description", "title", "default", "examples", "enum", "const",
                  "$comment")

def lint_texts(entry):
    """(where, text) the model reads of a tool but names: description, titles, schema."""
    texts = [("description", entry.get("description") or ""), *tool_titles(entry)]

    def walk(node, where):
        if isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}/{i}")
        if not isinstance(node, dict):
            return
        for key, value in node.items():
            at = f"{where}/{key}"
            if key in SCHEMA_MAPS and isinstance(value, dict):  # names, not keywords
                for name, schema in value.items():
                    walk(schema, f"{at}/{name}")
            elif key in _READ_KEYWORDS or key.startswith("x-"):
                texts.extend((f"input schema {at}", text) for text in _strings(value))
            else:
                walk(value, at)
    walk(entry.get("input_schema"), "")
    return texts

def _strings(value):
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    return [value] if isinstance(value, str) else []

def scripts_of(word):
    return {unicodedata.name(ch, "?").split()[0] for ch in word if ch.isalpha()}

# Cyrillic and Greek letters read as Latin (UTS #39's confusables).
LATIN_LOOKALIKES = dict(zip(
    "аеіјорсухѕԁӏһԛԝАВЕКМНОРСТХІЈЅУҮԚԜӀαονιρυχΑΒΕΖΗΙΚΜΝΟΡΤΥΧ",
    "aeijopcyxsdlhqwABEKMHOPCTXIJSYYQWlaovipuxABEZHIKMNOPTYX"))

def latin_lookalike(word):
    """What `word`, all lookalikes of another script (раураӏ), reads as in Latin or ''."""
    if (len(word) < 3 or "LATIN" in scripts_of(word)  # а, с, о imitate nothing
            or not all(ch in LATIN_LOOKALIKES for ch in word)):
        return ""
    return "".join(LATIN_LOOKALIKES[ch] for ch in word)

def lookalike_words(text):
    """Words of `text` mixing scripts (a Cyrillic а among Latin) or all lookalikes."""
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

def _named(names, text):
    return sorted(name for name in names
                  if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text))

def _smuggled(text):
    """What runs of variation selectors spell, decoded as bytes."""
    codes = [ord(ch) for run in _SELECTOR_RUN.findall(text) for ch in run]
    spelled = bytes(c - 0xFE00 if c < 0xFF00 else c - 0xE0100 + 16 for c in codes)
    return spelled.decode("utf-8", "replace")

def lint_tool(entry, others, siblings, peer_length):
    """A tool's findings as (severity, what, where), the high ones first. `others`,
    `siblings`: tool names of other servers, of its own; `peer_length`: their median."""
    findings = []
    for name in (entry["name"], *_schema_names(entry.get("input_schema"))):
        where = f"name {quote(name)}"
        scripts = scripts_of(name)
        if len(scripts) > 1:
            mixed = ", ".join(sorted(scripts))
            findings.append((LINT_HIGH, f"a name that mixes scripts ({mixed})", where))
        elif lookalike_words(name):
            findings.append((LINT_HIGH, "a name in letters that read as Latin ones",
                             where))
        words = re.sub(r"[_.-]+|(?<=[a-z0-9])(?=[A-Z])", " ", name)  # readSshKey: words
        findings += [(severity, what, where) for pattern, severity, what in _LINT_PHRASES
                     if pattern.search(words)]
    mine = set(siblings) - {entry["name"]}
    for where, text in lint_texts(entry):
        findings += [(severity, what, where)
                     for severity, what in _text_findings(text, others, mine)]
    length = len(entry.get("description") or "")
    if length > max(LINT_LONG, 4 * peer_length):
        findings.append((LINT_MEDIUM, f"{length} characters long, far longer than its "
                         f"peers", "description"))
    return sorted(findings, key=lambda f: f[0] != LINT_HIGH)

def _text_findings(text, others, siblings):
    """(severity, what) of one text the model reads."""
    found = []
    hidden = invisible_codes(text)
    if hidden:
        # Tag characters mirror ASCII: the model may read what they spell.
        spelled = "".join(chr(ord(ch) - 0xE0000) for ch in text
                          if 0xE0020 <= ord(ch) < 0xE007F)
        codes = ", ".join(f"U+{code:04X}" for code in hidden[:5])
        what = f"invisible, bidirectional or tag characters ({codes})"
        if spelled:
            what += f" spelling {quote(cut(spelled, 200))}"
        found.append((LINT_HIGH, what))
    smuggled = _smuggled(text)
    if smuggled:
        found.append((LINT_HIGH, "variation selectors hiding bytes that spell "
                      + quote(cut(smuggled, 200))))
    found += [(severity, what) for pattern, severity, what in _LINT_PHRASES
              if pattern.search(text)]
    step = _FIRST_STEP.search(text)
    if step:
        end = _SENTENCE_END.search(text, step.start())
        sentence = text[step.start():end.end() if end else len(text)]
        if _named(siblings, sentence):
            found.append((LINT_MEDIUM, "a step the model is told to take first, with a "
                          "tool of its own server"))
        else:
            found.append((LINT_HIGH, "a step the model is told to take first"))
    mixed = lookalike_words(text)
    if mixed:
        found.append((LINT_HIGH, f"words that mix scripts or imitate Latin ones "
                      f"({', '.join(mixed[:3])})"))
    named = ", ".join(_named(others, text)[:3])
    if named and _DIRECTIVE.search(text):
        found.append((LINT_HIGH, f"instructions about other servers' tools ({named})"))
    elif named:
        found.append((LINT_MEDIUM, f"names other servers' tools ({named})"))
    return found

def lint_lines(findings):
    return [f"  lint {severity}: {what} (in the {sanitize(where)})"
            for severity, what, where in findings]

def lint_manifests(manifests):
    """{server: {tool: findings}} of pinned manifests, each tool read among its peers."""
    # A short plain name (add, search) is a word, not a tool's mention.
    names = {server: {name for name in manifest["tools"]
                      if len(name) >= 8 or "_" in name or "-" in name}
             for server, manifest in manifests.items()}
    found = {}
    for server, manifest in manifests.items():
        tools = manifest["tools"]
        others = {name for other, theirs in names.items()
                  if other != server for name in theirs} - set(tools)
        lengths = sorted(len(e.get("description") or "") for e in tools.values())
        median = lengths[len(lengths) // 2] if lengths else 0
        found[server] = {tool: lint_tool(entry, others, names[server], median)
                         for tool, entry in tools.items()}
    return found


# =============================================================================================
# 22. Upstream servers
#
# Reads as: around the core
#
# Owns: the transport fields (read_transport), a server as a child on
# JSON-RPC lines (Upstream) or Streamable HTTP (HttpUpstream), its manifest, load_all.
# Core it calls: read_config, read_frames, read_owned; load.
# Promises: a child gets PATH, HOME, TMPDIR and what the operator names, in its own
# process group, and on Linux dies with agentgate. One deadline covers connecting,
# listing, loading. Every request from the server is answered. Only an integer id
# agentgate wrote matches an answer or progress notice; a bad message fails only its
# request. A server gone fails later calls at once, not sent, until section 24 brings it
# back. Closing waits on no server.
# A failure's outcome: 'not_sent' only where no byte was written (request's refusals,
# _send, _write); 'no_answer' or 'timed_out' once one may have been; 'answered' or
# 'unusable' from an answer. Over HTTP: a connection per message; no byte after its
# deadline; no redirect followed; HTTP 500 or more may have executed; a broken stream is
# resumed in the deadline. OAuth: only `login` asks a person (section 31); the gate sends
# the tokens login kept for this config and url, renewed where login found, or does not
# serve the server (LOGIN_NEEDED).
# =============================================================================================

# A url server's header values come from the 0600 config or our environment (`${NAME}`);
# no message shows one, nor more than shown_url.
ENV_REFERENCE_RE = re.compile(r"\$\{([^}]*)\}")
OAUTH_FIELDS = ("client_id", "client_secret", "scope")

def load_config(path):
    return read_config(path, read_transport)

def read_transport(server, raw, where, base):
    server.command, server.url = raw.get("command"), field_string(raw, "url", where)
    server.headers, server.oauth = {}, {}
    server.unavailable = ""  # why this server cannot start: the others are served
    argv = server.command
    if (argv is None) == (not server.url):
        raise ConfigError(f"{where} needs exactly one of command (an argv list) or url "
                          f"(an http:// or https:// address)")
    if server.url:
        server.headers, server.unavailable = _url_server(raw, where, server.url)
        server.oauth = _oauth_client(raw, where)
    elif (not isinstance(argv, list) or not argv
          or not all(isinstance(a, str) for a in argv)):
        raise ConfigError(f'{where}.command must be a non-empty list of strings, such as '
                          f'["node", "server.js"]')
    elif "headers" in raw or "oauth" in raw:
        field = "headers" if "headers" in raw else "oauth"
        raise ConfigError(f"{where}.{field} is sent only to a server reached by url; "
                          f"use env")
    server.env = field_names(raw, "env", where)
    for entry in server.env:
        if "=" not in entry or entry.startswith("="):
            raise ConfigError(f"{where}.env entry {quote(entry)} must read NAME=value")
    server.inherit_env = field_names(raw, "inherit_env", where)
    for name in server.inherit_env:
        if not name or "=" in name:
            raise ConfigError(f"{where}.inherit_env entry {quote(name)} must be a "
                              f"variable name without '='")
    server.connect_timeout = field_duration(raw, "connect_timeout", where, 30 * SECOND)
    stem = os.path.splitext(os.path.basename(server.config_path))[0]
    server.tokens = os.path.join(base, f"{stem}.{server.name}.tokens.json")
    # A server runs in the user's home, not beside the config: a relative path it writes
    # cannot edit its own policy.
    server.cwd_given = field_string(raw, "cwd", where)
    server.cwd = os.path.join(base, os.path.expanduser(server.cwd_given or "~"))

def child_env(server):
    """PATH, HOME, TMPDIR, inherit_env, env: our secrets reach no other."""
    names = ("PATH", "HOME", "TMPDIR", *server.inherit_env)
    env = {name: os.environ[name] for name in names if name in os.environ}
    env.update(entry.split("=", 1) for entry in server.env)
    return env

def _url_server(raw, where, url):
    """(headers, `${NAME}` filled in; why it cannot start: a variable unset is a problem
    of where agentgate runs, not of the config)."""
    from urllib.parse import urlsplit
    for field in ("env", "inherit_env", "cwd"):
        if field in raw:
            raise ConfigError(f"{where}.{field} means nothing for a server reached by "
                              f"url; remove it")
    try:
        parts = urlsplit(url)
    except ValueError:
        parts = None
    if not parts or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}.url must be an http:// or https:// address, such as "
                          f'"http://127.0.0.1:8000/mcp"')
    if "@" in parts.netloc:  # messages show the url
        raise ConfigError(f"{where}.url must not carry a user or password; send them "
                          f"as a header")
    given = raw.get("headers", {})
    if not isinstance(given, dict) or not all(isinstance(v, str) for v in given.values()):
        raise ConfigError(f"{where}.headers must be an object of header name to string, "
                          f'such as {{"Authorization": "Bearer ${{TOKEN}}"}}')
    headers, unset = {}, ""
    for name, value in given.items():
        if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name):
            raise ConfigError(f"{where}.headers: {quote(name)} is not a header name")
        for variable in ENV_REFERENCE_RE.findall(value):
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", variable):
                written = quote("${" + variable + "}")
                raise ConfigError(f"{where}.headers.{name} names {written}; a variable "
                                  f"is written ${{NAME}} with letters, digits and '_'")
            if variable not in os.environ and not unset:
                unset = (f"{where}.headers.{name} names the environment variable "
                         f"{variable}, which is not set: set it where agentgate runs")
        headers[name] = ENV_REFERENCE_RE.sub(lambda m: os.environ.get(m.group(1), ""),
                                             value)
        if re.search(r"[\x00-\x08\x0a-\x1f\x7f]", headers[name]):
            raise ConfigError(f"{where}.headers.{name} holds a control character, which "
                              f"no header may carry")
    return headers, unset

def _oauth_client(raw, where):
    """A pre-registered client, for a server that registers none."""
    given = raw.get("oauth", {})
    if not isinstance(given, dict):
        raise ConfigError(f'{where}.oauth must be an object such as {{"client_id": '
                          f'"...", "client_secret": "...", "scope": "..."}}')
    refuse_unknown(given, OAUTH_FIELDS, f"{where}.oauth")
    for field in OAUTH_FIELDS:
        value = given.get(field, "x")
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}.oauth.{field} must be a non-empty string")
    if "client_secret" in given and "client_id" not in given:
        raise ConfigError(f"{where}.oauth has a client_secret but no client_id; "
                          f"give both")
    return dict(given)

def shown_url(url):
    """Scheme, host, port: a server's key is often in path or query."""
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
    """An integer literal of at most 18 digits, or None: no other value (3.9, 1e1000000,
    Infinity) names one of agentgate's requests."""
    if isinstance(value, Number) and _INT_ID_RE.fullmatch(value.literal):
        return int(value.literal)
    return None

STDERR_TAIL_BYTES = 4096
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_TOOL_PAGES = 100
MAX_TOOLS = 1000
# How long a message of our own (a ping's answer, a cancel notice) may wait for the server
# to read it; a request waits until its deadline.
OWN_WRITE_SECONDS = 5
OPENING_STEPS = ("connect", "list tools")

def too_large():
    return UpstreamError(f"the server's answer is larger than {MAX_MESSAGE_BYTES} bytes",
                         "unusable")

def error_answer(error):
    """A server's error answer: known; `rpc` kept when well formed."""
    error = error if isinstance(error, dict) else {}
    text, code = error.get("message"), error.get("code")
    rpc = None
    if isinstance(text, str) and int_id(code) is not None:
        rpc = {k: error[k] for k in ("code", "message", "data") if k in error}
    said = clean(str(text or ""), 1000)
    return UpstreamError(f"the server answered with an error: {said}", "answered", rpc)

@functools.lru_cache(maxsize=1)
def _parent_death_request():
    """prctl(PR_SET_PDEATHSIG, SIGKILL) for a child to call before exec on Linux; looked
    up in the parent: a forked child loads nothing."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return functools.partial(prctl, 1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG

def _exit_code(proc, seconds):
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None

def exit_text(proc):
    code = _exit_code(proc, 2)
    if code is None:
        return "closed its output"
    if code < 0:
        return f"exited (killed by signal {-code})"
    return f"exited (status {code})"

def signal_group(pid, sig):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)

class Upstream:
    """A connected stdio MCP server."""

    AGAIN = "started again"  # what section 24 does once it went away

    def __init__(self, server):
        self.server, self.name = server, server.name
        self.proc = self.closed = self.protocol = None
        self.next_id, self.slots = 0, {}
        self.lock, self.write_lock = threading.Lock(), threading.Lock()
        self.stderr_tail, self.stderr_done = b"", threading.Event()
        # Set by section 24 while serving: on_list_changed (called on the reading thread:
        # must not block), on_exit(why) when the server goes away on its own, and `down`,
        # (since, next try) in epoch seconds until it serves. `pinned`: from load_all.
        self.on_list_changed = self.on_exit = self.down = None
        self.heard_list_changed, self.pinned = False, {}
    def describe(self, step, detail):
        return f"server {quote(self.name)}: {step}: {detail}"
    def failed(self, detail, step="list tools"):
        return UpstreamError(self.describe(step, detail))
    def spawn(self):
        """Start the child, on a thread as long-lived as agentgate (the main one): its
        parent-death signal fires when that thread ends."""
        command = self.server.command
        try:  # bufsize=0: closing its input never waits to flush
            proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, env=child_env(self.server), cwd=self.server.cwd,
                start_new_session=True, bufsize=0, preexec_fn=_parent_death_request())
        except OSError as err:
            why = f"cannot start {quote(command[0])}: {err.strerror}"
            raise UpstreamError(self.describe("connect", why), "not_sent")
        os.set_blocking(proc.stdin.fileno(), False)  # writes wait in poll, to a deadline
        self.stderr_tail, self.stderr_done = b"", threading.Event()
        with self.lock:
            self.proc, self.closed = proc, None
        threading.Thread(target=self._read_stdout, args=(proc,), daemon=True).start()
        threading.Thread(target=self._read_stderr, args=(proc.stderr, self.stderr_done),
                         daemon=True).start()
    def handshake(self, deadline):
        params = {"protocolVersion": PROTOCOL_VERSIONS[-1], "capabilities": {},
                  "clientInfo": {"name": "agentgate", "version": VERSION}}
        result = self.request("initialize", params, deadline, "connect")
        if not isinstance(result, dict):
            raise self.failed("the server's initialize answer is not an object",
                              "connect")
        chosen = result.get("protocolVersion")
        if chosen not in PROTOCOL_VERSIONS:
            raise self.failed(f"the server answered protocol version "
                              f"{quote(str(chosen)[:40])}; this client speaks "
                              f"{', '.join(PROTOCOL_VERSIONS)}", "connect")
        self.protocol = chosen  # HTTP names it on every later message
        self.notify("notifications/initialized", {})
    def close(self):
        with self.lock:
            proc, self.proc = self.proc, None
            self.closed = self.closed or "the connection was closed"
            self._fail_all(self.closed)
        if proc is None:
            return
        # Input is closed only while no write is under way, so no write lands on a reused
        # descriptor; a stuck write ends by the kill.
        if not self.write_lock.acquire(timeout=1):
            signal_group(proc.pid, signal.SIGKILL)
            self.write_lock.acquire()
        try:
            proc.stdin.close()
        except OSError:
            pass
        finally:
            self.write_lock.release()
        if _exit_code(proc, 2) is None:
            signal_group(proc.pid, signal.SIGTERM)
            _exit_code(proc, 2)
        signal_group(proc.pid, signal.SIGKILL)  # its descendants (npx's server) die too
        _exit_code(proc, 5)
    def _read_stderr(self, stream, done):
        try:
            for chunk in iter(functools.partial(os.read, stream.fileno(), 4096), b""):
                self.stderr_tail = (self.stderr_tail + chunk)[-STDERR_TAIL_BYTES:]
        except (OSError, ValueError):
            pass
        finally:
            done.set()
    def tail(self):
        self.stderr_done.wait(timeout=2 if self.closed else 0.2)
        text = self.stderr_tail.decode("utf-8", "replace").strip()
        return f'; stderr: "{clean(text, STDERR_TAIL_BYTES)}"' if text else ""
    def _read_stdout(self, proc):
        try:
            for frame, ident in read_frames(proc.stdout.fileno(), MAX_MESSAGE_BYTES):
                # No frame ends the reader: every later answer would time out as unknown.
                try:
                    if frame is None:
                        self._deliver(ident, error=too_large())
                    elif frame.strip():
                        self._dispatch(frame)
                except Exception as err:
                    log(self.describe("read", f"a message could not be handled "
                                      f"({type(err).__name__}: {err})"))
        finally:
            with self.lock:
                self.closed = self.closed or "the server closed its output"
                self._fail_all(self.closed)
                on_exit = self.proc is proc and self.on_exit  # not if agentgate closed it
            if on_exit:
                on_exit(exit_text(proc))
    def _dispatch(self, line):
        try:
            message = parse(line)
        except CanonicalError as err:
            loose = parse_loosely(line)
            ident = loose.get("id") if isinstance(loose, dict) else None
            self._deliver(int_id(ident), error=UpstreamError(
                f"the server's answer is not usable JSON: {err}", "unusable"))
            return
        if not isinstance(message, dict):
            return
        ident = int_id(message.get("id"))
        if "method" in message and "id" in message:
            self._answer_server_request(message)
        elif "method" in message:
            self._notice(message["method"], message.get("params"))
        elif "error" in message:
            self._deliver(ident, error=error_answer(message["error"]))
        else:
            self._deliver(ident, result=message.get("result"))
    def _notice(self, method, params):
        if method == "notifications/tools/list_changed":
            with self.lock:
                self.heard_list_changed = True
                on_list_changed = self.on_list_changed
            if on_list_changed:
                on_list_changed()
        elif method == "notifications/progress":
            # To the request of a token only we wrote; read before its answer.
            params = params if isinstance(params, dict) else {}
            with self.lock:
                slot = self.slots.get(int_id(params.get("progressToken")))
            if slot and slot["progress"]:
                slot["progress"](params.get("progress"), params.get("total"),
                                 params.get("message"))
    def _answer_server_request(self, message):
        reply = {"jsonrpc": "2.0", "id": message["id"]}
        if message.get("method") == "ping":
            reply["result"] = {}
        else:  # no roots, sampling or elicitation: refused, not ignored
            reply["error"] = {"code": -32601,
                              "message": "this client does not offer that method"}
        self._send_own(reply)
    def notify(self, method, params):
        self._send_own({"jsonrpc": "2.0", "method": method, "params": params})
    def _send_own(self, message):
        with contextlib.suppress(UpstreamError):  # gone, or stopped for not reading
            self._send(message, Deadline(OWN_WRITE_SECONDS * SECOND))
    def _deliver(self, ident, result=None, error=None):
        # Filled in under the lock that removes the slot: a wait ending now sees its whole
        # answer or no slot, never half of one.
        with self.lock:
            slot = self.slots.pop(ident, None)  # None, no key: no slot
            if slot:
                slot.update(result=result, error=error, answered=True)
                slot["done"].release()
    def _fail_all(self, reason):
        for slot in self.slots.values():
            slot["error"], slot["answered"] = UpstreamError(reason), True
            slot["done"].release()
        self.slots.clear()
    def _send(self, message, deadline):
        """Write one message by `deadline`, the one place that says if any byte did go; a
        server not taking it in time is stopped."""
        data = canonical(message) + b"\n"
        if not self.write_lock.acquire(timeout=deadline.left()):
            raise UpstreamError("the server is not reading its input (an earlier message "
                                "to it is still being written)", "not_sent")
        written, view, poller = 0, memoryview(data), None
        try:
            proc = self.proc
            if proc is None:
                raise UpstreamError("the connection is closed", "not_sent")
            while written < len(data):
                try:
                    written += os.write(proc.stdin.fileno(), view[written:])
                    continue
                except BlockingIOError:
                    pass  # the pipe is full: wait for a read, or the end
                except (OSError, ValueError):
                    outcome = "no_answer" if written else "not_sent"
                    raise UpstreamError("the server is not reading its input (it may "
                                        "have exited)", outcome) from None
                if poller is None:
                    poller = select.poll()
                    poller.register(proc.stdin.fileno(), select.POLLOUT)
                left = deadline.left()
                if left <= 0 or not poller.poll(left * 1000 + 1):
                    break
        finally:
            self.write_lock.release()
        if written < len(data):
            reason = (f"the server did not take in the message within "
                      f"{format_duration(deadline.ns)}, so it was stopped")
            with self.lock:
                self.closed = self.closed or reason
                self._fail_all(reason)
            signal_group(proc.pid, signal.SIGKILL)
            raise UpstreamError(reason, "timed_out" if written else "not_sent")
    def request(self, method, params, deadline, step, progress=None):
        """Its answer by `deadline`; progress(value, total, message) at each notice."""
        try:
            return self._request(method, params, deadline, step, progress)
        except UpstreamError as err:
            opening = step in OPENING_STEPS and err.outcome != "timed_out"
            said = self.describe(step, str(err)) + (self.tail() if opening else "")
            raise UpstreamError(said, err.outcome, err.rpc) from None
    def _request(self, method, params, deadline, step, progress):
        # Down, only opening steps go: refused before a byte is written, known not sent.
        down = self.down_text()
        if down and step not in OPENING_STEPS:
            raise UpstreamError(down + "; nothing was sent", "not_sent")
        with self.lock:
            if self.closed:
                raise UpstreamError(self.closed, "not_sent")
            self.next_id += 1
            ident = self.next_id
            # `done` is held until the answer is in: the cheapest hand-over.
            slot = {"done": threading.Lock(), "answered": False, "result": None,
                    "error": None, "progress": progress}
            slot["done"].acquire()
            self.slots[ident] = slot
        if progress:  # its id as our token: unique in flight, whatever hosts chose
            params = {**params, "_meta": {"progressToken": ident}}
        message = {"jsonrpc": "2.0", "id": ident, "method": method, "params": params}
        try:
            self._send(message, deadline)
        except UpstreamError:
            with self.lock:
                self.slots.pop(ident, None)
            raise
        if not slot["done"].acquire(timeout=deadline.left()):
            with self.lock:
                self.slots.pop(ident, None)
            if not slot["answered"]:  # one as the wait ended still counts
                self.notify("notifications/cancelled",
                            {"requestId": ident, "reason": "the deadline passed"})
                raise UpstreamError("timed out after " + format_duration(deadline.ns),
                                    "timed_out")
        if slot["error"]:
            raise slot["error"]
        return slot["result"]
    def down_text(self):
        """'' while it serves; else since when it is down, and its next try."""
        if not self.down:
            return ""
        since = format_duration(max(0, int(time.time() - self.down[0])) * SECOND)
        wait = format_duration(max(0, int(self.down[1] - time.time())) * SECOND)
        return (f"the server stopped {since} ago and is being {self.AGAIN} "
                f"(next try in {wait})")
    def watch_tools(self, on_list_changed):
        """Call `on_list_changed` at each tools notice, now if one came: none missed."""
        with self.lock:
            self.on_list_changed = on_list_changed
            heard = self.heard_list_changed
        if heard:
            on_list_changed()
    def list_tools(self, deadline):
        tools, cursors, cursor = {}, set(), None
        for _ in range(MAX_TOOL_PAGES):
            params = {} if cursor is None else {"cursor": cursor}
            result = self.request("tools/list", params, deadline, "list tools")
            page = result.get("tools") if isinstance(result, dict) else None
            if not isinstance(page, list):
                raise self.failed("the answer has no tools list")
            for tool in page:
                name = tool.get("name") if isinstance(tool, dict) else None
                if not isinstance(name, str) or not name:
                    raise self.failed("a tool has no name")
                if name in tools:
                    raise self.failed(f"the server lists {quote(name)} twice")
                tools[name] = tool
                if len(tools) > MAX_TOOLS:
                    raise self.failed(f"the server lists more than {MAX_TOOLS} tools")
            cursor = result.get("nextCursor")
            if cursor is None:
                return tools
            if not isinstance(cursor, str) or cursor in cursors:
                raise self.failed("the server's nextCursor repeats or is not a string")
            cursors.add(cursor)
        raise self.failed(f"the listing runs past {MAX_TOOL_PAGES} pages")

def new_upstream(server):
    return HttpUpstream(server) if server.url else Upstream(server)

LOGIN_NEEDED = ("the server asks for an authorization the gate does not hold, or holds "
                "no longer")
# Pauses between tries at a server's own stream while refused (seconds).
OWN_STREAM_FIRST_PAUSE, OWN_STREAM_LAST_PAUSE = 0.25, 30

def login_hint(server):
    return f"run: {PROGRAM}.py login {server.name}"

def union_scope(*scopes):
    """Space-separated scopes, each once, in the order first given."""
    return " ".join(dict.fromkeys(" ".join(scope or "" for scope in scopes).split()))

class TokenFile:
    """What login obtained (tokens, client, issuer, token endpoint), 0600 at Server.tokens,
    bound to one config and url; not in the database: a credential is no fact of calls."""

    def __init__(self, server, fresh=False):
        self.server = server
        self.kept = {"config": server.config_path, "url": server.url}
        if fresh or not os.path.exists(server.tokens):
            return
        these = f"the tokens of server {quote(server.name)} in {server.tokens}"
        raw = read_owned(server.tokens, "token file", private=True)
        try:
            kept = json.loads(raw)
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
        """Their client: the config's, else the one login registered."""
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
        """Keep new tokens; a refresh naming no refresh token or scope keeps the old."""
        old = self.kept.get("tokens", {})
        kept = {k: old[k] for k in ("refresh_token", "scope") if k in old}
        self.kept["tokens"] = {**kept, **tokens}
        lasts = tokens.get("expires_in")
        self.kept["expires_at"] = time.time() + lasts \
            if isinstance(lasts, (int, float)) else None
        self.write()
    def want(self, scope):
        """Keep a scope a call was refused for: the next login asks it."""
        self.kept["wanted_scope"] = union_scope(self.kept.get("wanted_scope"), scope)
        self.write()
    def write(self):
        if self.server.oauth.get("client_id"):
            self.kept.pop("client", None)
        write_private(self.server.tokens, json.dumps(self.kept, indent=2) + "\n")
    def refresh(self, deadline):
        """A refresh-token grant to the endpoint login found, the one place the refresh
        token and secret go. False: not renewed."""
        from urllib.parse import urlencode, quote as escape
        refresh = self.kept["tokens"].get("refresh_token")
        endpoint = self.kept.get("token_endpoint")
        client = self.client()
        client_id = client.get("client_id")
        if not (refresh and endpoint and client_id):
            return False
        form = {"grant_type": "refresh_token", "refresh_token": refresh,
                "client_id": client_id}
        if self.kept.get("resource"):
            form["resource"] = self.kept["resource"]
        headers = {"Content-Type": "application/x-www-form-urlencoded",
                   "Accept": "application/json"}
        secret = client.get("client_secret")
        method = client.get("token_endpoint_auth_method") or "client_secret_basic"
        if secret and method == "client_secret_post":
            form["client_secret"] = secret
        elif secret and method == "client_secret_basic":
            pair = f"{escape(client_id, safe='')}:{escape(secret, safe='')}"
            headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        tokens, conn = None, None
        try:
            conn = http_connection(endpoint, deadline)
            conn.request("POST", url_target(endpoint), urlencode(form), headers)
            response = conn.getresponse()
            if response.status == 200:
                tokens = json.loads(response.read(MAX_MESSAGE_BYTES))
        except (OSError, ValueError, http_client().HTTPException):
            tokens = None
        finally:
            if conn:
                conn.close()
        if not isinstance(tokens, dict) \
                or not isinstance(tokens.get("access_token"), str) \
                or str(tokens.get("token_type")).lower() != "bearer":
            return False
        self.obtained(tokens)
        return True

def http_client():
    import http.client  # only when a url server starts
    return http.client

def http_connection(url, deadline):
    """A connection to `url`'s host by `deadline` (None: within 30s)."""
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

def connection_lost(err):
    return UpstreamError(f"the connection was lost before the server answered "
                         f"({type(err).__name__})")

def too_late(deadline):
    return UpstreamError(f"timed out after {format_duration(deadline.ns)}, before the "
                         f"message was sent", "not_sent")

def is_event_stream(response):
    kind = response.getheader("Content-Type", "").lower()
    return response.status == 200 and kind.startswith("text/event-stream")

class HttpUpstream(Upstream):
    """Over Streamable HTTP: only transport differs; each answer read on a thread."""

    AGAIN = "connected again"

    def __init__(self, server):
        super().__init__(server)
        self.session = None  # Mcp-Session-Id, from the initialize answer
        self.tokens = None  # login's, unless the config sends Authorization
        self.unauthorized = False  # the server refused what we hold
        self.refreshing = threading.Lock()
        self.connections = set()  # open ones, each ended by close
        self.ended = threading.Event()
        self.stderr_done.set()  # it has none: tail() is ''
    def spawn(self):
        if self.server.unavailable:
            raise UpstreamError(self.server.unavailable, "not_sent")
        with self.lock:  # connected again (section 24): a new session
            self.closed = self.session = self.protocol = None
            self.ended = threading.Event()
        own = any(name.lower() == "authorization" for name in self.server.headers)
        if os.path.exists(self.server.tokens) and not own:
            try:
                self.tokens = TokenFile(self.server)
            except ConfigError as err:  # this server's problem only
                raise UpstreamError(str(err), "not_sent") from None
    def handshake(self, deadline):
        try:
            super().handshake(deadline)
        except UpstreamError as err:
            if not self.unauthorized:
                raise
            # Only the operator reads a start's failure.
            raise UpstreamError(f"{err}; {login_hint(self.server)}", "answered") from None
        threading.Thread(target=self._listen, args=(self.ended,), daemon=True).start()
    def close(self):
        """Fail what waits, end every connection; never wait on it."""
        with self.lock:
            self.closed = self.closed or "the connection was closed"
            self._fail_all(self.closed)
            self.ended.set()
            connections = list(self.connections)
        for conn in connections:  # each read ends; its thread closes it
            self._shut(conn)
    def _gone(self, why):
        if self.on_exit and not self.closed:
            self.on_exit(why)  # connected again (section 24)
    def _send(self, message, deadline):
        body = canonical(message)
        conn = self._write("POST", body, deadline)
        if "method" in message and "id" in message:
            args = (conn, message["id"], body, deadline)
            threading.Thread(target=self._answer, args=args, daemon=True).start()
            return
        try:  # a notice or an answer: taken in at once (202)
            conn.getresponse().read(MAX_MESSAGE_BYTES)
        except (OSError, http_client().HTTPException):
            pass
        finally:
            self._end(conn)
    def _write(self, verb, body, deadline, refused=None, last_id=None):
        """Connect, write one request by `deadline` (None: the server's own stream): the
        one place that says if any byte went out."""
        accept = "application/json, text/event-stream" if body else "text/event-stream"
        headers = {**self.server.headers, "Accept": accept}
        if self.session:
            headers["Mcp-Session-Id"] = self.session
        if self.protocol:
            headers["MCP-Protocol-Version"] = self.protocol
        if self.tokens:
            headers["Authorization"] = self._bearer(deadline, refused)
        if body:
            headers["Content-Type"] = "application/json"
        if last_id:
            headers["Last-Event-ID"] = last_id.decode("utf-8", "replace")
        if deadline and deadline.left() <= 0:
            raise too_late(deadline)
        try:
            conn = http_connection(self.server.url, deadline)
        except (OSError, http_client().HTTPException) as err:
            if isinstance(err, ConnectionError):
                self._gone("cannot be reached")
            why = clean(str(err), 200) or type(err).__name__
            raise UpstreamError(f"cannot reach {shown_url(self.server.url)} ({why}), so "
                                f"nothing was sent", "not_sent") from None
        with self.lock:
            if self.closed:
                conn.close()
                raise UpstreamError(self.closed, "not_sent")
            self.connections.add(conn)
        if deadline and deadline.left() <= 0:
            self._end(conn)
            raise too_late(deadline)
        if deadline is None:
            conn.sock.settimeout(None)  # its own stream: quiet for hours
        try:
            conn.request(verb, url_target(self.server.url), body, headers)
        except (OSError, http_client().HTTPException) as err:
            self._end(conn)
            raise connection_lost(err) from None
        return conn
    def _bearer(self, deadline, refused):
        """The token to send, renewed if expired or `refused` (by a 401), 1 at a time."""
        wait = max(deadline.left(), 0) if deadline else -1
        if not self.refreshing.acquire(timeout=wait):
            raise too_late(deadline)
        try:
            tokens = self.tokens
            stale = tokens.expired() or tokens.bearer() == refused
            if stale and not tokens.refresh(deadline):
                raise self._login_needed("the token could not be renewed")
            return tokens.bearer()
        finally:
            self.refreshing.release()
    def _login_needed(self, why):
        self.unauthorized = True
        if self.tokens:
            # No browser, no port: not served until the operator runs login, and every
            # later call fails at once saying so.
            with self.lock:
                self.closed = self.closed or LOGIN_NEEDED
            log(f"server {self.name}: {LOGIN_NEEDED}; {login_hint(self.server)}")
        return UpstreamError(f"{LOGIN_NEEDED} ({why})", "answered")
    @staticmethod
    def _shut(conn):
        with contextlib.suppress(OSError, AttributeError):  # closed already
            conn.sock.shutdown(2)  # SHUT_RDWR
    def _end(self, conn):
        with self.lock:
            self.connections.discard(conn)
        self._shut(conn)
        conn.close()
    def _waiting(self, ident, deadline):
        with self.lock:
            return ident in self.slots and deadline.left() > 0
    def _answer(self, conn, ident, body, deadline):
        """Hand over request `ident`'s answer, resuming a broken stream; one a 401 refused
        (it ran nothing) goes once more, renewed."""
        error = UpstreamError("the server ended its HTTP answer without a result")
        try:
            response = conn.getresponse()
            if response.status == 401 and self.tokens and not self.unauthorized:
                self._end(conn)
                conn = self._write("POST", body, deadline, self.tokens.bearer())
                response = conn.getresponse()
            failed = self._refusal(response)
            if failed:
                error = failed
            elif not is_event_stream(response):
                data = response.read(MAX_MESSAGE_BYTES + 1)
                if len(data) > MAX_MESSAGE_BYTES:
                    error = too_large()
                elif data.strip():
                    self._dispatch(data)
            else:
                events = self._read_events(response, ident, deadline)
                while events.last_id and self._waiting(ident, deadline):
                    error = UpstreamError("the server closed its answer's event stream "
                                          "before the result, and resuming it failed")
                    self._end(conn)
                    if self.ended.wait(min(events.retry / 1000, deadline.left())):
                        break
                    try:  # sent already, whatever fails: it may have run
                        conn, response = self._get(deadline, events.last_id)
                    except (UpstreamError, OSError, http_client().HTTPException):
                        break
                    if not is_event_stream(response):
                        break
                    events = self._read_events(response, ident, deadline, events)
        except UpstreamError as err:
            error = err
        except (OSError, ValueError, http_client().HTTPException) as err:
            error = connection_lost(err)
        finally:
            self._end(conn)
        self._deliver(ident, error=error)
    def _refusal(self, response):
        status = response.status
        if status >= 500:
            # A proxy's 502 or a server failing mid-call answers after the request was
            # delivered: it may have executed, whatever the body (unread) says.
            return UpstreamError(f"the server answered HTTP {status} after the request "
                                 f"reached it")
        if 300 <= status < 400:
            from urllib.parse import urljoin
            location = response.getheader("Location", "")
            target = clean(shown_url(urljoin(self.server.url, location)), 200)
            return UpstreamError(f"the server answered with a redirect (HTTP {status}) "
                                 f"to {target}, which is not followed: if that is the "
                                 f"server, make it the url", "answered")
        challenge = response.getheader("WWW-Authenticate", "")
        if status == 401 or (status == 403 and "insufficient_scope" in challenge):
            scope = re.search(r'scope="([^"]*)"', challenge)
            if status == 403 and self.tokens and scope:
                self.tokens.want(scope.group(1))
            return self._login_needed(f"HTTP {status}")
        if status == 404 and self.session:
            # It forgot the session (started again): it took nothing in.
            self._gone("forgot its session")
            return UpstreamError("the server no longer knows the session (HTTP 404), so "
                                 "nothing ran", "not_sent")
        if status >= 400:
            return UpstreamError(f"the server answered HTTP {status}", "answered")
        self.session = response.getheader("Mcp-Session-Id") or self.session
        return None
    def _get(self, deadline, last_id=None):
        """(conn, response): the server's own stream (deadline None) or one resumed."""
        conn = self._write("GET", None, deadline, last_id=last_id)
        try:
            return conn, conn.getresponse()
        except BaseException:
            self._end(conn)
            raise
    def _read_events(self, response, ident, deadline, after=None):
        """Hand over each message until the stream ends or `ident` (None: the server's own
        stream) is answered; the stream's state."""
        events = _EventStream(after)
        try:
            while ident is None or self._waiting(ident, deadline):
                chunk = response.read1(65536)
                for message in events.feed(chunk, final=not chunk):
                    self._dispatch(message)
                if events.buffered() > MAX_MESSAGE_BYTES:
                    raise too_large()
                if not chunk:
                    break
        except (OSError, ValueError, http_client().HTTPException):
            if not events.last_id:  # else it is resumed from there
                raise
        return events
    def _listen(self, ended):
        """The server's own stream, all session. A refusal that may pass (lost, 409, 429,
        5xx) meets growing pauses; others end it."""
        pause, last_id = OWN_STREAM_FIRST_PAUSE, None
        while not ended.is_set():
            conn = None
            try:
                conn, response = self._get(None, last_id)
                status = response.status
                if is_event_stream(response):
                    events = self._read_events(response, None, None)
                    last_id = events.last_id or last_id
                    if events.heard:  # it was open: reopened as asked
                        pause = max(events.retry / 1000, OWN_STREAM_FIRST_PAUSE)
                elif not (status in (409, 429) or status >= 500):
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
    """Server-sent events fed in chunks of any size: the data (lines joined by \\n) of
    each event named `message` or unnamed, one the stream ends inside too. `last_id`: to
    resume from; `retry`: the wait asked, in ms; both go on from `after`, if resumed."""

    _LINE_END = re.compile(rb"\r\n|\r|\n")

    def __init__(self, after=None):
        self.partial, self.after_cr = [], False
        self.data, self.event = [], b""
        self.last_id, self.retry = (after.last_id, after.retry) if after else (b"", 0)
        self.heard = False  # an event came
    def buffered(self):
        return sum(map(len, self.partial)) + sum(map(len, self.data))
    def feed(self, chunk, final=False):
        # Only the new chunk is searched: a long line costs its length once.
        if self.after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]  # the rest of a \r\n split between chunks
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
        return [m for m in map(self._line, lines) if m is not None]
    def _line(self, line):
        """One line's effect; the data of an event this line ends."""
        if not line:
            ended = None
            if self.data and self.event in (b"", b"message"):
                ended = b"\n".join(self.data)
            self.heard = self.heard or bool(self.data)
            self.data, self.event = [], b""
            return ended
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
        return None

class LoadError(Exception):
    """A server that cannot be used at all."""

# Each part of a manifest entry as manifest_entry writes it: a manifest edited by hand is
# refused by its part, not read by code trusting it.
ENTRY_KINDS = {
    "name": str, "description": str, "description_hash": str, "schema_hash": str,
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
    tools = manifest.get("tools") if isinstance(manifest, dict) else None
    if not isinstance(tools, dict):
        raise LoadError(f"{where} has no tools; run pin again")
    named = manifest.get("server")
    if named != server.name:
        raise LoadError(f"{where} is for server {quote(str(named))}, not "
                        f"{quote(server.name)}; run pin again or name the right manifest")
    for name, entry in tools.items():
        wrong = "entry" if not isinstance(entry, dict) else next(
            (part for part, kind in ENTRY_KINDS.items()
             if part in entry and not isinstance(entry[part], kind)), None)
        if wrong:
            raise LoadError(f"{where}: the {wrong} of tool {quote(name)} is not what pin "
                            f"writes; run pin again")
    return manifest

def pinned_for(server):
    manifest = read_manifest(server)
    stray = sorted(set(server.rules) - set(manifest["tools"]))
    if stray:
        names = ", ".join(sanitize(s) for s in stray)
        raise LoadError(f"server {quote(server.name)}: rules name tools the manifest "
                        f"does not pin: {names}; pin again or fix the rules")
    return manifest

def load_all(config, while_starting=None):
    """Start all servers, then decide in order what each offers: (served upstreams, tools,
    a Report each). One not served is closed, its report's `unserved` says why; a
    ConfigError closes all. `while_starting` runs once all are spawned, on this thread."""
    servers = config.servers
    upstreams = [new_upstream(server) for server in servers]
    reports = [Report(server.name) for server in servers]
    try:
        for upstream, report in zip(upstreams, reports):
            _unless_unserved(report, upstream.spawn)
        if while_starting:
            while_starting()
        # The manifests are read while the servers start.
        manifests = [_unless_unserved(report, pinned_for, server)
                     for server, report in zip(servers, reports)]
        findings = lint_manifests({s.name: m for s, m in zip(servers, manifests) if m})
        listings = [None] * len(upstreams)
        deadlines = [Deadline(s.connect_timeout) for s in servers]

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
        for i, server in enumerate(servers):
            report = reports[i]
            if report.unserved:
                continue
            upstreams[i].pinned = manifests[i]["tools"]
            names = dict(taken)  # kept only if the server is served
            offered = _unless_unserved(report, load, server, manifests[i], upstreams[i],
                                       listings[i], deadlines[i], names,
                                       findings[server.name], report)
            if offered:
                taken = names
                tools.extend(offered)
            elif not report.unserved:
                report.unserved = _why_none(server, report, manifests[i])
    except BaseException:
        for upstream in upstreams:
            upstream.close()
        raise
    for upstream, report in zip(upstreams, reports):
        if report.unserved:
            upstream.close()
    return [up for up, r in zip(upstreams, reports) if not r.unserved], tools, reports

def _why_none(server, report, manifest):
    if report.count("unreviewed"):
        why = "its rules are proposals nobody reviewed: read them, then run check -accept"
    elif not manifest["tools"]:
        why = "it offered none when it was pinned"
    else:
        why = "classify at least one pinned tool with a rule"
    return f"server {quote(server.name)}: no tool registered; {why}"

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
# 23. Reading the record
#
# Reads as: around the core
#
# Owns: the record as people read it (Ledger): runs, steps and approvals for the operator
# commands and the status tool, grants, tool changes, the event chain.
# Core it calls: Store (through its read connection) and tool_spec; it writes nothing.
# Promises: only SELECTs (every change is section 7's; Store reads an approval's row). A
# run's events read the same in either shape Tx.flush writes (event_parts).
# =============================================================================================

# Tx.flush's events made of parts.
COMBINED_EVENTS = ("call.began", "call.changed", "call.ended")

def event_parts(type_, step_id, payload_json):
    """A stored event as its (type, step id, payload) parts: a combined one's in
    order, any other itself."""
    payload = parse(payload_json)
    if type_ in COMBINED_EVENTS:
        return [tuple(part) for part in payload["parts"]]
    return [(type_, step_id, payload)]

def ids_of(rows):
    return [row[0] for row in rows]

RECENT_CALLS = (
    "FROM calls c JOIN runs r ON r.id = c.run_id"
    " JOIN approvals a ON a.run_id = r.id"
    " WHERE c.id IN (SELECT id FROM calls"
    " WHERE session=? AND (settled_at=''"
    " OR settled_at>=?) ORDER BY id DESC LIMIT ?)"
    " ORDER BY c.id DESC, a.rowid")
WAITING_ROWS = (
    "FROM calls c JOIN runs r ON r.id = c.run_id"
    " JOIN approvals a ON a.run_id = r.id"
    " WHERE c.settled_at='' {session}"
    " AND r.status='WAITING_FOR_APPROVAL'"
    " AND a.status='pending'"
    " AND (a.expires_at='' OR a.expires_at>?)"
    " ORDER BY a.created_at, a.id")
RUN_COLUMNS = ("run", "session", "tool", "status", "reason",
               "detail", "steps", "created", "finished",
               "lease_owner", "lease_expires_at")
STEP_COLUMNS = ("id", "index", "status", "decision", "policy",
                "observation", "spec_hash")
PAGE_COLUMNS = ("run", "status", "reason", "detail", "steps",
                "created", "tool", "pending_approval", "host")
# The host's name as the policy's first decision recorded it: a
# step.policy event's, a run.read's, or a step.policy part of the
# call.began that holds it.
RUNS_PAGE = (
    "SELECT r.id, r.status, r.reason, r.detail,"
    " r.step_count, r.created_at, r.tool,"
    " (SELECT a.id FROM approvals a WHERE a.run_id = r.id"
    " AND a.status='pending' ORDER BY a.rowid DESC LIMIT 1),"
    " COALESCE((SELECT COALESCE("
    "json_extract(e.payload_json, '$.facts.client'),"
    " json_extract(e.payload_json, '$.policy.facts.client'),"
    " (SELECT json_extract(p.value, '$[2].facts.client')"
    " FROM json_each(e.payload_json, '$.parts') p"
    " WHERE json_extract(p.value, '$[0]')='step.policy'"
    " LIMIT 1))"
    " FROM events e WHERE e.run_id = r.id AND e.type IN"
    " ('step.policy', 'run.read', 'call.began')"
    " ORDER BY e.seq LIMIT 1), '')"
    " FROM runs r WHERE ?='' OR r.session=?"
    " ORDER BY r.rowid DESC LIMIT ?")
GRANTS = (
    "SELECT {columns} FROM grants WHERE (?='' OR session=?)"
    " AND (CASE WHEN revoked_at='' THEN expires_at"
    " ELSE min(revoked_at, expires_at) END)>=? ORDER BY created_at DESC, id DESC")

class Ledger(Store):
    """The record as people read it."""
    def approvals(self, run_id):
        return self.read_approvals(
            "FROM approvals a WHERE a.run_id=? ORDER BY a.rowid", (run_id,))
    def recent_approvals(self, session, since, limit):
        """Every approval of the session's newest `limit` calls unsettled or settled since
        `since`, with its run's tool, status and reason and its request key."""
        return self.read_approvals(
            RECENT_CALLS, (session, since, limit),
            (("tool", "r.tool"), ("run_status", "r.status"),
             ("run_reason", "r.reason"), ("request_key", "c.request_key")))
    def executed_under(self, approval):
        return any(
            type_ == "step.tool_started"
            and step_id == approval["step_id"]
            and payload.get("approval_id") == approval["id"]
            for _, _, type_, step_id, payload
            in self.run_parts(approval["run_id"]))
    def step_observation(self, step_id):
        row = self.read_one(
            "SELECT observation_json FROM steps WHERE id=?",
            (step_id,))
        return parse(row[0]) if row and row[0] else None
    def run_events(self, run_id):
        return self.read(
            "SELECT seq, at, type, step_id, payload_json"
            " FROM events WHERE run_id=? ORDER BY seq", (run_id,))
    def run_parts(self, run_id):
        """(seq, at, type, step id, payload) of each part, under its event's seq."""
        return [(seq, at, *part) for seq, at, type_, step_id, payload
                in self.run_events(run_id)
                for part in event_parts(type_, step_id, payload)]
    def late_outcomes(self, run_id):
        """(step, observation) of each outcome that came after a takeover."""
        return [(step_id, payload["observation"])
                for _, _, type_, step_id, payload in self.run_parts(run_id)
                if type_ == "step.tool_finished" and payload.get("late")]
    def waiting_approvals(self, session):
        """The approvals an operator may decide now (of one session, or all with session
        ''), oldest first, with their run's tool. A waiting run's call is unsettled, so
        the calls index finds them."""
        args = [session] if session else []
        where = "AND c.session=?" if session else ""
        return self.read_approvals(WAITING_ROWS.format(session=where),
                                   (*args, now()), (("tool", "r.tool"),))
    def steps(self, run_id):
        """A run's steps, oldest first; an allowed read's one step is read out of its
        run.read event (Tx.record_read)."""
        rows = self.read(
            "SELECT id, idx, status, decision_json, policy_json,"
            " observation_json, spec_hash FROM steps"
            " WHERE run_id=? ORDER BY idx", (run_id,))
        if not rows:
            rows = [self._read_step(step_id, parse(payload))
                    for step_id, payload in self.read(
                        "SELECT step_id, payload_json FROM events"
                        " WHERE run_id=? AND type='run.read'",
                        (run_id,))]
        return [dict(zip(STEP_COLUMNS, row)) for row in rows if row]
    @staticmethod
    def _read_step(step_id, read):
        if "observation" not in read:
            return None
        policy = {k: v for k, v in read["policy"].items()
                  if k not in ("policy_id", "spec_hash")}
        ok = read["status"] == "COMPLETED"
        return (step_id, 0, "done" if ok else "failed",
                dumps(read["decision"]), dumps(policy),
                dumps(read["observation"]),
                read["policy"]["spec_hash"])
    def run(self, run_id):
        row = self.read_one(
            "SELECT id, session, tool, status, reason, detail,"
            " step_count, created_at, finished_at, lease_owner,"
            " lease_expires_at FROM runs WHERE id=?", (run_id,))
        return dict(zip(RUN_COLUMNS, row)) if row else None
    def runs_page(self, session, limit):
        """Runs newest first (of one session, or all with session ''), with the approval
        each waits on and the host's name ('' before the policy decided)."""
        rows = self.read(RUNS_PAGE, (session, session, limit))
        return [dict(zip(PAGE_COLUMNS, row)) for row in rows]
    def session_runs(self, session, limit):
        return ids_of(self.read(
            "SELECT id FROM runs WHERE session=?"
            " ORDER BY rowid DESC LIMIT ?", (session, limit)))
    def policy_events(self, run_id):
        """A run's policy decisions as (seq, step id, the recorded policy, at): the
        step.policy parts, or the policy a read's one run.read event carries."""
        return [(seq, step_id,
                 payload["policy"] if type_ == "run.read" else payload, at)
                for seq, at, type_, step_id, payload in self.run_parts(run_id)
                if type_ in ("step.policy", "run.read")]
    def tool_spec(self, spec_hash):
        return tool_spec(self.read, spec_hash)
    def grants(self, session, since):
        sql = GRANTS.format(columns=", ".join(GRANT_COLUMNS))
        rows = self.read(sql, (session, session, since))
        return [dict(zip(GRANT_COLUMNS, row)) for row in rows]
    def grant(self, grant_id):
        row = self.read_one(
            f"SELECT {', '.join(GRANT_COLUMNS)} FROM grants"
            " WHERE id=?", (grant_id,))
        return dict(zip(GRANT_COLUMNS, row)) if row else None
    def ids_starting(self, table, prefix, limit):
        """Up to `limit` ids of `table` starting with `prefix`, in order."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        return ids_of(self.read(
            f"SELECT id FROM {table} WHERE id>=? AND id<?"
            " ORDER BY id LIMIT ?", (prefix, end, limit)))
    def run_ids_after_session(self, prefix, limit):
        """Up to `limit` run ids whose part after the session starts
        with `prefix` (letters and digits), in any session: a scan."""
        return ids_of(self.read(
            "SELECT id FROM runs"
            " WHERE substr(id, instr(id, '.') + 1) GLOB ?"
            " ORDER BY id LIMIT ?", (prefix + "*", limit)))
    def tool_changes(self, session, limit):
        rows = self.read(
            "SELECT at, payload_json FROM events WHERE run_id=?"
            " AND type='tools.changed' ORDER BY seq DESC LIMIT ?",
            (f"{session}.tools", limit))
        return [(at, parse(payload)) for at, payload in rows]
    def chain_head(self):
        return self.read_one(
            "SELECT seq, hash FROM events ORDER BY seq DESC LIMIT 1")
    def event_hash_at(self, seq):
        row = self.read_one("SELECT hash FROM events WHERE seq=?",
                            (seq,))
        return row[0] if row else None
    def events_after(self, seq, last, limit):
        last = 2**62 if last is None else last
        return self.read(
            "SELECT seq, run_id, step_id, at, type, payload_json, hash"
            " FROM events WHERE seq>? AND seq<=? ORDER BY seq LIMIT ?",
            (seq, last, limit))

# =============================================================================================
# 24. Tool changes while serving
#
# Reads as: around the core
#
# Owns: a server's change of its tools while serving (notifications/tools/list_changed):
# when they are listed again, and what is said and recorded of it; Gate.quarantine
# decides what is held.
# Core it calls: manifest_entry, Gate.quarantine (its only write to the gate), and the
# host's tools_changed notice that serve hands it.
# Promises: a tool its server changed is no longer offered and a call to it is refused
# TOOL_CHANGED; a failed listing quarantines the server's tools, retried at 4, 8, 16, 32
# s, then every 60 s. A server that goes away is said so on stderr and started again at
# 1, 2, 4 ... s, then every 60 s; it serves again once connected and listed as a change
# is.
# =============================================================================================

LIST_CHANGED_INTERVAL = 2  # seconds at least between two listings

class ToolWatch:
    """Lists a server again on its own thread when it says its tools changed: a changed
    or gone tool is held, one back to its pin offered again, a new one not; calls in
    flight are not touched. A failed listing holds all its tools."""
    def __init__(self, gate, upstreams, announce):
        self.gate, self.announce = gate, announce
        self.upstreams = {u.name: u for u in upstreams}
        # Per server: notices not acted on, listings failed in a row,
        # differences recorded, starts failed while down.
        self.pending, self.failures = {}, {}
        self.seen, self.starts = {}, {}
        self.cond = threading.Condition()
        for loop in (self._run, self._revive):
            threading.Thread(target=loop, daemon=True).start()
        for upstream in upstreams:
            upstream.on_exit = functools.partial(self.exited, upstream)
            upstream.watch_tools(
                functools.partial(self.changed, upstream.name))
    def changed(self, server):
        with self.cond:
            self.pending[server] = self.pending.get(server, 0) + 1
            self.cond.notify_all()
    def _run(self):
        listed = {}  # server name -> when last listed (monotonic)
        while not self.gate.stopping.is_set():
            with self.cond:
                due = {name: listed.get(name, -math.inf) +
                       relist_wait(self.failures.get(name, 0))
                       for name in self.pending}
                clock = time.monotonic()
                ready = [name for name, at in due.items() if at <= clock]
                if not ready:
                    soonest = min(due.values(), default=clock + 1)
                    self.cond.wait(soonest - clock)
                    continue
                server = ready[0]
                count = self.pending.pop(server)
            listed[server] = time.monotonic()
            if count > 1:
                log(f"server {server} said {count} times that its tools "
                    f"changed; it is listed again at most every "
                    f"{LIST_CHANGED_INTERVAL:g}s")
            try:
                self._relist(server)
            except UpstreamError as err:
                self._failed(server, err)
            except StoreError as err:
                log(f"server {server} changed its tools, but the change "
                    f"could not be recorded: {err}")
    def _failed(self, server, err):
        failures = self.failures.get(server, 0) + 1
        self.failures[server] = failures
        with self.cond:  # tried again without a new notice
            self.pending.setdefault(server, 0)
        pinned = self.upstreams[server].pinned
        _, held, moved = self.gate.quarantine(server, pinned, None)
        log(f"server {server} said its tools changed, but listing them "
            f"again failed: {err}; not offered until a listing "
            f"succeeds (next try in {relist_wait(failures):g}s): "
            f"{', '.join(held) or 'none'}")
        if moved:
            self.announce()
    def _relist(self, server):
        upstream = self.upstreams[server]
        deadline = Deadline(upstream.server.connect_timeout)
        live = {name: manifest_entry(tool) for name, tool
                in upstream.list_tools(deadline).items()}
        found, held, moved = self.gate.quarantine(server, upstream.pinned, live)
        if self.failures.pop(server, 0):
            log(f"server {server}: its tools were listed again; not "
                f"offered now: {', '.join(held) or 'none'}")
        try:
            if found != self.seen.get(server, {k: [] for k in CHANGE_KINDS}):
                self.seen[server] = found
                self._record({"server": server, **found,
                              "not_offered": held})
        finally:  # held already: the host hears of it even unrecorded
            if moved:
                self.announce()
    def _record(self, payload):
        run_id = f"{self.gate.config.session}.tools"
        self.gate.store.write(
            lambda tx: tx.event(run_id, "tools.changed", payload))
        log(tools_changed_text(payload) + " (pin -diff shows how)")
    def exited(self, upstream, why):
        """`upstream`'s server went away while serving: down until started again."""
        with self.cond:
            if upstream.down:
                return  # it died while being started again: that fails
            upstream.down = (time.time(), time.time() + restart_wait(0))
            self.cond.notify_all()
        log(f"server {upstream.name} {why}; calls to its tools fail "
            f"without executing until it is {upstream.AGAIN} (next try "
            f"in {restart_wait(0)}s)")
    def _revive(self):
        # Never returns: a server started here dies with the thread
        # that started it (spawn).
        while True:
            with self.cond:
                down = [u for u in self.upstreams.values() if u.down]
                due = [u for u in down if u.down[1] <= time.time()]
                if self.gate.stopping.is_set():
                    self.cond.wait()
                    continue
                if not due:
                    soonest = min((u.down[1] for u in down),
                                  default=time.time() + 60)
                    self.cond.wait(soonest - time.time())
                    continue
            self._start_again(due[0])
    def _start_again(self, upstream):
        name = upstream.name
        try:
            upstream.close()  # the old process's group, reaped
            upstream.spawn()
            upstream.handshake(Deadline(upstream.server.connect_timeout))
            self._relist(name)
            with upstream.lock:  # an exit after this is while serving
                if upstream.closed:
                    raise UpstreamError(
                        upstream.describe("connect", upstream.closed))
                upstream.down = None
        except Exception as err:  # this thread must live: see _revive
            self.starts[name] = self.starts.get(name, 0) + 1
            wait = restart_wait(self.starts[name])
            upstream.down = (upstream.down[0], time.time() + wait)
            upstream.close()
            log(f"server {name} could not be {upstream.AGAIN}: {err}; "
                f"next try in {wait}s")
            return
        self.starts.pop(name, None)
        log(f"server {name} was {upstream.AGAIN} and serves its tools")

def restart_wait(failures):
    """Seconds to the next try after `failures` in a row: 1, 2, 4 ... 32, then 60."""
    return min(2 ** min(failures, 6), 60)

def relist_wait(failures):
    # From LIST_CHANGED_INTERVAL (2 s) on: one doubling ahead.
    return restart_wait(failures + 1)

def tools_changed_text(payload):
    parts = [f"{kind} {', '.join(map(sanitize, payload[kind]))}"
             for kind in CHANGE_KINDS if payload[kind]]
    held = ", ".join(payload["not_offered"]) or "none"
    change = "; ".join(parts) or "back to what was pinned"
    return (f"server {payload['server']} changed its tools while "
            f"serving: {change}; not offered now: {held}")

# =============================================================================================
# 25. The status tool
#
# Reads as: around the core
#
# Owns: the status tool's answer: this session's approvals and what became of them, each
# in one of a few phrasings.
# Core it calls: Store.latest_approval, step_outcome, and Answer, answer and gate_status
# (section 6's tables); the rest it reads through the Ledger (section 23).
# Promises: it tells the model what waits and what was decided, never a command, the
# database, the config or a run id; servers' recorded text is sanitized.
# =============================================================================================

def time_since(text):
    elapsed = int(time.time() - parse_time(text))
    return format_duration(elapsed * SECOND)

STATUS_LOOKBACK = 3600
STATUS_ROWS = 200

def status_answer(gate, args):
    """What waits for an operator, or what became of one approval; it only reads."""
    args = {} if args is None else args
    if not isinstance(args, dict) or set(args) - {"approval_id"} or \
            not isinstance(args.get("approval_id", ""), str):
        return answer("INVALID", reason=SLOT_PROSE["status_arguments"])
    since = format_time(time.time() - STATUS_LOOKBACK)
    try:
        approvals = gate.store.recent_approvals(
            gate.config.session, since, STATUS_ROWS)
    except StoreError as err:
        log(str(err))
        return answer("UNAVAILABLE", what=SLOT_PROSE["unreadable"])
    wanted = args.get("approval_id", "").strip()
    if wanted:
        for approval in approvals:
            if approval["id"] == wanted:
                text = describe_approval(gate, approval)
                return Answer(f"GATE_STATUS: {text}",
                              mark="GATE_STATUS")
        return gate_status("unknown_id", approval=clean(wanted, 100))
    waiting = [a for a in approvals if a["status"] == "pending" and
               not lapsed(a)]
    if not waiting:
        return gate_status("none_waiting")
    lines = "\n".join(f"- {describe_approval(gate, a)}"
                      for a in waiting)
    key = "one_waiting" if len(waiting) == 1 else "some_waiting"
    return gate_status(key, count=len(waiting), lines=lines)

def lapsed(approval):
    return approval["expires_at"] and approval["expires_at"] <= now()

def describe_approval(gate, approval):
    """One approval as the model may read it: what it asked, and what became of it."""
    capability = parse(approval["capability_json"])
    args = policy_json(capability.get("args", {}))
    head = STATUS_PROSE["head"].format(
        approval=approval["id"], tool=clean(approval["tool"], 64),
        args=clean(args, 200))
    age = time_since(approval["created_at"])
    status = approval["status"]
    if status == "pending" and not lapsed(approval):
        key = "pending"
        if approval["kind"] == "interrupted_side_effect":
            key = "outcome_unknown"
        return STATUS_PROSE[key].format(head=head, age=age)
    if status == "rejected":
        note = ""
        if approval["note"]:
            note = STATUS_PROSE["rejected_note"].format(
                note=cut(quote(approval["note"]), 500))
        return STATUS_PROSE["rejected"].format(head=head, note=note)
    if status != "approved":  # expired, decided or not
        return STATUS_PROSE["expired"].format(head=head)
    return f"{head}: {approved_fate(gate, approval)}"

# An executed step's ending (CALL_ENDINGS) -> how the status tells
# it; any other ending: unknown (taken over or cancelled meanwhile).
FATE_OF_ENDING = {"ok": "succeeded", "error": "failed",
                  "unsent": "failed", "unrecorded": "unrecorded"}

def approved_fate(gate, approval):
    store, step_id = gate.store, approval["step_id"]
    observed = store.step_observation(step_id)
    ending = step_outcome(observed) if observed else ""
    if store.executed_under(approval):
        if not observed:
            return STATUS_PROSE["executing"]
        key = FATE_OF_ENDING.get(ending, "unknown")
        how = HOW[ending if ending in HOW else "cut_off"]
        error = ""
        if ending in CALL_ENDINGS:
            error = clean(outcome_text(observed), 500)
        return STATUS_PROSE[key].format(error=error, how=how)
    newer = store.latest_approval(approval["run_id"])
    if newer and newer["step_id"] == step_id and \
            newer["id"] != approval["id"]:
        return STATUS_PROSE["superseded"].format(approval=newer["id"])
    if approval["run_status"] == "WAITING_FOR_APPROVAL":
        return STATUS_PROSE["uncollected"].format(tool=approval["tool"])
    if approval["run_status"] not in TERMINAL:
        return STATUS_PROSE["executing"]
    # An approved step refused was refused when collected.
    reason = approval["run_reason"]
    if reason in ("operator_cancelled", "approval_expired"):
        why = NOT_EXECUTED_WHY[reason]
    elif ending in ("denied", "invalid"):
        why = NOT_EXECUTED_WHY[f"{ending}_on_resume"]
    else:
        why = NOT_EXECUTED_WHY["ended"].format(reason=reason)
    return STATUS_PROSE["not_executed"].format(why=why)

# =============================================================================================
# 26. The host's other requests
#
# Reads as: around the core
#
# Owns: what the host side hands on, deciding no call: initialize, ping, server/discover,
# notifications/initialized and the tools-changed notice it allows (to listen streams too),
# a call's progress, the status tool (serve hands HostServer a HostAround, then a
# StatusTool). Core it calls: answer, listened, and HostServer's send and protocol.
# Promises: a call's progress (the gate's while it holds the call, then the server's)
# reaches the host under its token, only increasing, and nothing once the host cancelled
# the call; the host is told once of a tool its server changed while serving, only after
# notifications/initialized (before, its first tools/list sees the change).
# =============================================================================================

SERVER_INFO = {"name": "gated-tools", "version": VERSION}
PROGRESS_MESSAGE_BYTES = 1000

class Progress:
    """One call's progress: the hold's seconds (one a second at
    most), then the server's values after them, only increasing."""
    def __init__(self, send):
        self.send = send  # send(value, total or None, message or None)
        self.lock = threading.Lock()
        self.held = decimal.Decimal(0)  # the hold's last value told
        self.last = None
    def holding(self, waited, total, message):
        exact = decimal.Decimal(repr(waited))
        if exact - self.held >= 1 and \
                self._tell(waited, exact, total, message):
            self.held = exact
    def server(self, value, total, message):
        if not isinstance(value, Number):
            return
        exact = self.held + value.exact()
        shown = Number(str(exact)) if self.held else value
        if not isinstance(total, Number):
            total = None
        elif self.held:
            total = Number(str(self.held + total.exact()))
        text = isinstance(message, str)
        message = clean(message, PROGRESS_MESSAGE_BYTES) if text else None
        self._tell(shown, exact, total, message)
    def _tell(self, value, exact, total, message):
        with self.lock:  # so two values never reach the host out of order
            if self.last is not None and exact <= self.last:
                return False
            self.last = exact
            self.send(value, total, message)
            return True

class HostAround:
    """HostServer's seam to this section: `requests` and `notifications` map a method to
    its handler(host, params), a request's returning its result; `progress` relays."""
    def __init__(self):
        self.initialized = False
        self.requests = {"initialize": self.initialize,
                         "ping": lambda host, params: {}}
        self.notifications = {"notifications/initialized": self._initialized}
    @staticmethod
    def initialize(host, params):
        tools = {"tools": {"listChanged": True}}
        return {"protocolVersion": host.protocol,
                "capabilities": tools, "serverInfo": SERVER_INFO}
    @staticmethod
    def discover():
        """server/discover's result: nothing started, nothing read."""
        capabilities = {"tools": {"listChanged": True},
                        "extensions": {TASKS: {}}}
        return {"resultType": "complete", "supportedVersions": [MODERN],
                "capabilities": capabilities, "ttlMs": 0,
                "cacheScope": "private",
                "_meta": {META + "serverInfo": SERVER_INFO}}
    def _initialized(self, host, params):
        self.initialized = True
    def tools_changed(self, host):
        changed = "notifications/tools/list_changed"
        if self.initialized:
            host.send({"jsonrpc": "2.0", "method": changed})
        with host.calls_lock:
            listening = list(host.listeners.values())
        for ident, tools in listening:
            if tools:
                host.send(listened(ident, changed))
    @staticmethod
    def progress(host, token, cancelled):
        def send(value, total, message):
            # On the thread that reads the server: a host that stops reading holds up
            # that server's answers, as it holds up every answer it is sent.
            if cancelled.is_set():
                return
            told = {"progressToken": token, "progress": value,
                    "total": total, "message": message}
            params = {k: v for k, v in told.items() if v is not None}
            host.send({"jsonrpc": "2.0", "params": params,
                       "method": "notifications/progress"})
        return Progress(send)

STATUS_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "properties": {"approval_id": {
        "type": "string", "description": STATUS_ARGUMENT}}}

class StatusTool:
    """The status tool as the host side offers and calls it; the
    model is told how many servers are `unserved` (never why)."""
    def __init__(self, gate, name, unserved):
        self.gate, self.unserved = gate, unserved
        self.listing = {"name": name, "inputSchema": STATUS_SCHEMA,
                        "description": STATUS_DESCRIPTION}
    def call(self, args, invalid):
        if invalid:
            return answer("INVALID", reason=clean(invalid[0], 1000)).result()
        status = status_answer(self.gate, args)
        if not status.text.startswith("GATE_STATUS:"):
            return status.result()
        if self.unserved:
            status.text += " " + UNSERVED_NOTE.format(count=self.unserved)
        upstreams = {t.upstream.name: t.upstream
                     for t in self.gate.tools.values()}
        for name, upstream in sorted(upstreams.items()):
            down = upstream.down_text()
            if down:
                note = DOWN_NOTE.format(server=clean(name, 64), down=down)
                status.text += " " + note
        return status.result()


# =============================================================================================
# 27. Notify
#
# Reads as: around the core
#
# Owns: telling the operator an approval waits (stderr lines with the command
# that decides it; the notify program) and how to let a duplicate through.
# Promises: the program runs in its own process group with a deadline, off the
# call's path; past NOTIFY_AT_ONCE at once, one is dropped and said so.
# Core it calls: nothing; the gate calls announce_waiting's announce and
# duplicate_refused's duplicate through the seams serve registers.
# =============================================================================================

VENV = "~/.agentgate-venv"  # where the README installs the mcp package

def python_path():
    """The interpreter every printed command and host entry names: this one,
    unless it lacks the mcp package and the README's venv has it."""
    import glob
    import importlib.util
    venv = os.path.expanduser(VENV)
    where = os.path.join(venv, "lib", "python3*", "site-packages", "mcp")
    if glob.glob(where) and importlib.util.find_spec("mcp") is None:
        return os.path.join(venv, "bin", "python")
    return sys.executable

def python_command():
    """`python3` when that name finds python_path() on PATH, else its path."""
    import shutil
    found, chosen = shutil.which("python3"), python_path()
    if found and os.path.abspath(found) == os.path.abspath(chosen):
        return "python3"
    return shlex.quote(chosen)

def operator_hint(config_file, database=""):
    def path(name):
        return shlex.quote(os.path.abspath(name))
    command = f"{python_command()} {path(sys.argv[0])}"
    if database:
        return command + f" -db {path(database)}"
    if path(config_path(None)) != path(config_file):
        return command + f" -config {path(config_file)}"
    return command

def announce_waiting(config, notifier=None):
    hint = operator_hint(config.path)
    def announce(approval, tool, run_id):
        command = f"{hint} approve {run_id} -approval {approval['id']}"
        log(f"approval {approval['id']} ({approval['kind']}) for "
            f"{tool.name} waits for an operator: run {run_id}")
        log(f"  decide with: {command}   (or reject)")
        if notifier:  # names only, never an argument's value
            notifier.announce({"AGENTGATE_APPROVAL": approval["id"],
                               "AGENTGATE_RUN": run_id,
                               "AGENTGATE_TOOL": tool.name,
                               "AGENTGATE_COMMAND": command})
    return announce

def duplicate_refused(config):
    """The gate's duplicate: it names the config, never model text."""
    def duplicate(tool, run_id, executed_at, window):
        name = tool.name
        log(f"a call to {name} was refused as a duplicate of run "
            f"{run_id}, which executed the same request at "
            f"{prose_time(executed_at)}: identical calls to {name} are "
            f"refused for {format_duration(window)} after one executes;"
            f" to allow them, set \"repeat_window\": \"0s\" (or a "
            f"shorter time) in the rule for {tool.upstream_name} of "
            f"server {tool.server.name} in {config.path}")
    return duplicate

NOTIFY_TIMEOUT = 10  # seconds before its process group is killed
NOTIFY_AT_ONCE = 4  # programs running at once

class Notifier:
    """Runs the operator's notify program on a thread of its own: a failing,
    missing or hanging program costs a call nothing (stopped after NOTIFY_TIMEOUT)."""
    def __init__(self, argv):
        self.argv = argv
        self.slots = threading.BoundedSemaphore(NOTIFY_AT_ONCE)
    def announce(self, names):
        if not self.slots.acquire(blocking=False):
            approval = names["AGENTGATE_APPROVAL"]
            log(f"notify has {NOTIFY_AT_ONCE} programs running; "
                f"approval {approval} is not announced")
            return
        threading.Thread(target=self._run, args=(names,), daemon=True).start()
    def _run(self, names):
        try:
            self._notify(names)
        finally:
            self.slots.release()
    def _notify(self, names):
        program, quiet = self.argv[0], subprocess.DEVNULL
        try:
            proc = subprocess.Popen(
                self.argv, env={**os.environ, **names}, stdin=quiet,
                stdout=quiet, stderr=quiet, start_new_session=True)
        except OSError as err:
            log(f"notify could not run {program}: {err.strerror}")
            return
        try:
            status = proc.wait(NOTIFY_TIMEOUT)
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
            log(f"notify {program} was stopped after {NOTIFY_TIMEOUT}s")
            return
        if status:
            log(f"notify {program} exited with status {status}")


# =============================================================================================
# 28. Pins and load reports
#
# Reads as: around the core
#
# Owns: writing a server's manifest (pin), and the lines of a load
# report (Report) and of a change.
# Core it calls: manifest_entry, changed_parts,
# rule_outcome; section 22's write_private.
# Promises: server-chosen names are sanitized in every report line.
# =============================================================================================

def settings_text(config, rule, when=""):
    """What a rule decides of a call as `check` shows it: what may decide
    otherwise, and the repeat window of a call that changes something."""
    outcome = rule_outcome(config, rule)
    others, notes = [], []
    if rule.when:
        n = len(rule.when)
        others.append(f"{n} when entr{'y' if n == 1 else 'ies'}")
    if rule.limits and (rule.when or outcome == "allow"):
        n = len(rule.limits)
        others.append(f"{n} limit{'s' * (n > 1)}")
    if others:
        notes.append(f"{' and '.join(others)} may decide otherwise")
    if outcome == "require_approval" and config.operator == "none":
        outcome = "deny"
        notes.insert(0, "no operator is at hand to ask")
    window = rule.repeat_window
    if window is None:
        window = config.repeat_window
    if rule.side_effect != "read_only":
        notes.append(f"repeat window {format_duration(window)}")
    word = {"allow": "allow", "require_approval": "ask"}.get(outcome, "deny")
    return "; ".join([word + when, *notes])

def rule_lines(rule, tool_name):
    lines = []
    for entry in rule.when:
        held = [condition.text() for condition in entry.conditions]
        during = entry.during and entry.during.raw
        if during:
            spans = [f"{word} {during[key]}" for word, key
                     in (("on", "days"), ("from", "hours"))
                     if key in during]
            held.append(f"{' '.join(spans)} ({during['zone']})")
        if entry.clients is not None:
            held.append(f"the host is one of {policy_json(entry.clients)}")
        reason = cut(sanitize(entry.reason), 120)
        lines.append(f"{entry.label}: if {' and '.join(held)} -> "
                     f"{entry.outcome} ({reason})")
    return lines + [f"{limit.label}: {limit.text(tool_name)}, "
                    f"then {limit.then}" for limit in rule.limits]

def connect(server):
    """(upstream, tools) of one server started within its connect_timeout;
    the caller closes it."""
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
    return {name: manifest_entry(t) for name, t in sorted(live.items())}

def pin(server):
    tools = presented(server)
    manifest = {"server": server.name, "pinned_at": now(), "tools": tools}
    write_private(server.manifest, pretty_json(manifest) + "\n")
    return manifest

def change_lines(old, new):
    """A changed tool as a person compares it: a unified diff of each part
    that differs."""
    import difflib
    import textwrap
    def lines(entry, part, key):
        if part == "description":
            return textwrap.wrap(entry["description"], 88) or [""]
        value = entry["input_schema"] if part == "input schema" else entry.get(key)
        return pretty_json(value).splitlines()
    changed, out = changed_parts(old, new), []
    for part, key in PINNED_PARTS:
        if part not in changed:
            continue
        before, after = lines(old, part, key), lines(new, part, key)
        if before == after:  # the texts differ only in spacing
            out.append(f"{part}: only its spacing differs")
            continue
        out.append(f"{part}:")
        out += difflib.unified_diff(before, after, "pinned", "now", n=2,
                                    lineterm="")
    return [sanitize(line) for line in out]

HINT_NAMES = (("readOnlyHint", "readOnly"),
              ("destructiveHint", "destructive"),
              ("idempotentHint", "idempotent"),
              ("openWorldHint", "openWorld"))

def hints_text(entry):
    annotations = entry.get("annotations")
    if annotations is None:
        return "no annotations"
    claimed = [w for key, w in HINT_NAMES if annotations.get(key) is True]
    return ", ".join(claimed) or "claims nothing"

class Report:
    """What loading one server decided, as lines an operator reads. `unserved`:
    why the server is not served ('' while it is); `kinds`: what became of each
    tool; `at`: which line is each tool's; `review`: why a proposal needs a
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
        self.add("unreviewed", name, f"unreviewed {sanitize(name)}: "
                 f"its rule ({rule.side_effect}) was proposed from the "
                 "server's own hints; read it, then run check -accept")
        if rule.side_effect == "read_only" and \
                _SECRETS_WORDS.search(entry["description"]):
            self.review[name] = "a read that may return secrets"
    def refused(self, name, reason):
        self.add("refused", name, f"refused {sanitize(name)}: {reason}")
    def registered(self, tool, mismatch):
        extra = f" [hint mismatch allowed: {mismatch}]" if mismatch else ""
        if not tool.timeout_given:
            default = format_duration(DEFAULT_TOOL_TIMEOUT)
            extra += f" [no timeout set: the default {default} applies]"
        name = tool.upstream_name
        self.add("registered", name, f"registered {sanitize(name)} as "
                 f"{tool.name} ({tool.side_effect}){extra}")
        self.lines += [f"{sanitize(self.server)}:   {sanitize(line)}"
                       for line in rule_lines(tool.rule, tool.name)]
    def lint(self, found):
        self.lines += [f"{sanitize(self.server)}: {line}"
                       for line in lint_lines(found)]

# A read whose description speaks of these may hand the model what the person
# protects (the tokens init moved into the config): proposed read_only, it runs unasked.
_SECRETS_WORDS = re.compile(
    r"\b(environment|env|secrets?|credentials?|passwords?|keys?|"
    r"tokens?)\b", re.I)

def served_lines(config, server, report, tools):
    """A server as check shows it: served or not, then its report, with what an
    offered tool decides after `->` (a proposal: what it would once accepted)."""
    name = quote(server.name)
    offered = {t.upstream_name: t for t in tools if t.server is server}
    if report.unserved:
        why = report.unserved.removeprefix(f"server {name}: ")
        lines = [f"server {name} is not served: {sanitize(why)}"]
    else:
        lines = [f"server {name} is served: {len(offered)} tool(s) offered"]
    for at, line in enumerate(report.lines):
        tool = report.at.get(at)
        kind = report.kinds.get(tool)
        if tool in offered:
            line += f" -> {settings_text(config, offered[tool].rule)}"
        elif kind == "registered":  # before its server failed to load
            line += " -> not offered: its server is not served"
        elif kind == "unreviewed":
            rule = server.rules[tool]
            would = settings_text(config, rule, " once accepted")
            line = (f"{sanitize(server.name)}: unreviewed "
                    f"{sanitize(tool)}: proposed {rule.side_effect} "
                    f"-> would {would}")
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
# 29. The command line's flags
#
# Reads as: around the core
#
# Owns: the single-dash flags every command shares, their help, where
# the config is found, and the reading of a text argument (UTF-8).
# Core it calls: nothing but the text helpers.
# =============================================================================================

def config_path(given):
    home = os.path.join(os.path.expanduser("~"), ".config")
    xdg = os.environ.get("XDG_CONFIG_HOME") or home
    default = os.path.join(xdg, PROGRAM, "config.json")
    return given or os.environ.get("AGENTGATE_CONFIG") or default

SCOPE = __doc__.split("Scope.")[1].split("\nSections (")[0].strip()
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

{SCOPE}

Where the config comes from: -config FILE, else $AGENTGATE_CONFIG, else
$XDG_CONFIG_HOME/agentgate/config.json (default ~/.config/agentgate/config.json).
"""

class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise Usage(message)

def unasked(verb, unless=""):
    return f"{verb} without asking (needed without a terminal{unless})"

def as_recorded(who):
    return f"who {who}, as recorded (default: your user name)"

# -h's text of each flag: "command -flag" where the command gives it a
# meaning of its own, else the flag's name; parser() takes no flag without one.
FLAG_HELP = {
    "config": "the config file (else $AGENTGATE_CONFIG,"
              " else the default config.json)",
    "db": "open this database directly instead of the config's",
    "json": "print JSON and nothing else",
    "full": "print every byte of a long value instead of"
            " its head and tail",
    "by": as_recorded("decides"),
    "approval": "the approval to decide; naming it is your"
                " confirmation",
    "approve -yes": unasked("approve", ", unless -approval"),
    "reject -yes": unasked("reject", ", unless -approval"),
    "approve -note": "a note kept with the decision",
    "reject -note": "why (required): the model is shown it",
    "cancel -note": "why, kept with the run",
    "revoke -note": "why, kept with the grant",
    "grant -note": "why, kept with the grant and listed by grants",
    "grant -by": as_recorded("grants"),
    "revoke -by": as_recorded("revokes"),
    "revoke -yes": unasked("revoke",
                           ", unless the id is whole"),
    "cancel -by": as_recorded("cancels"),
    "grant -yes": unasked("grant"),
    "grant -if": "conditions the arguments must meet, as JSON:"
                 " '{\"/amount\": {\"max\": 20}}'",
    "grant -for": "how long it lasts, such as 30m or 8h"
                  " (default 1h, at most grant_ttl)",
    "grants -days": "list grants that ended in the last N days"
                    " too (default 7)",
    "runs -limit": "show at most N runs, newest first"
                   " (default 100)",
    "recheck -limit": "re-check at most N of the session's newest"
                      " runs (default 50)",
    "recheck -run": "re-check this run only (its id or a prefix)",
    "recheck -session": "re-check this session's runs instead of"
                        " the config's session",
    "recheck -current-tools": "start the servers and re-check"
                              " against the tools they present now,"
                              " instead of the specs recorded",
    "verify -from": "the first sequence number to check (default 1)",
    "verify -to": "the last sequence number to check"
                  " (default the chain's end)",
    "verify -head": "a head kept from an earlier verify (SEQ:HASH):"
                    " say whether it still matches",
    "pin -diff": "show what each server presents now against its"
                 " manifest",
    "pin -tool": "with -diff: pin this difference again"
                 " (SERVER/TOOL or TOOL; repeatable)",
    "pin -all": "with -diff: pin every difference again",
    "pin -yes": "with -diff -all: pin again without asking",
    "check -accept": "print init's proposed rules, mark them"
                     " reviewed once you type yes, then check",
    "check -yes": unasked("with -accept: accept"),
    "init -from": "read this host file (or a project's .mcp.json)"
                  " instead of the hosts' own",
    "init -write": "edit each host's file to start the gate instead"
                   " (a backup is kept)",
}

# -h's name for a flag's value, where not the flag's own.
FLAG_VALUE = {"config": "FILE", "db": "FILE", "init -from": "FILE",
              "verify -from": "SEQ", "to": "SEQ", "limit": "N",
              "days": "N", "note": "TEXT", "by": "WHO",
              "approval": "ID", "run": "ID", "session": "NAME",
              "if": "JSON", "for": "DURATION", "head": "SEQ:HASH",
              "tool": "SERVER/TOOL"}

def parser(command, *flags):
    p = Parser(prog=f"agentgate.py {command}", allow_abbrev=False)
    for flag in flags:
        name, kind = flag if isinstance(flag, tuple) else (flag, str)
        own = f"{command} -{name}"
        about = FLAG_HELP.get(own) or FLAG_HELP[name]
        spelled = (f"-{name}", f"--{name}")
        if kind is bool:
            p.add_argument(*spelled, action="store_true", help=about)
            continue
        # Paths are the system's own (any bytes); other text is UTF-8.
        if kind is str and name not in ("config", "db"):
            kind = text_argument
        value = FLAG_VALUE.get(own) or FLAG_VALUE.get(name, name.upper())
        p.add_argument(*spelled, type=kind, metavar=value, help=about)
    return p

NAMED_RUN = ("a run's id or an approval's, or a prefix of either"
             " (6 characters or more)")

def text_argument(value):
    """A text flag must be UTF-8: it is recorded and may be shown to the
    model (the system hands bytes not UTF-8 over as lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("is not valid UTF-8 text") from None
    return value


# =============================================================================================
# 30. Operator commands
#
# Reads as: around the core
#
# Owns: runs, show, approve, reject, cancel, watch, grant, grants,
# revoke, verify, recheck, on the config's database or -db's,
# read-only where nothing is decided.
# Core it calls: Store (decide_approval, cancel_run, revoke_grant),
# Grant, Tool, approval_hash, approval_printout, approval_shown,
# check_arguments, check_database_path, check_reach, confirmed_conditions,
# consents, decision_facts, evaluate, event_hash, grant_printout,
# grant_releasing, last_attempt, late_text, parse_conditions,
# pointer_problem, policy_decision, step_outcome, tried_text,
# undecided.
# Promises: approve, reject, grant and watch decide on the hash of
# exactly what they printed in full: a row changed since is refused,
# a shortened printout decides nothing until -full, a grant releases
# only the waits it listed; without -approval or -yes only a "yes"
# typed at a terminal decides. An id or its prefix names one run or
# approval, whatever its state. Lookalikes and invisible characters
# are marked; -json prints one JSON value only.
# =============================================================================================

def tell_json(value, out=None):
    """A -json value through tell, each character sanitize would
    change escaped: it reads back the same."""
    tell(*map(_json_for_terminal, pretty_json(value).split("\n")), out=out)

def _json_for_terminal(line):
    if sanitize(line) == line:
        return line
    return "".join(json.dumps(ch)[1:-1] if sanitize(ch) != ch or
                   unicodedata.category(ch)[0] == "M" else ch for ch in line)

def operator_store(opts, readonly):
    """The store, and the session ('' with -db)."""
    path = config_path(opts.config)
    database = opts.db
    if not (database or opts.config or os.path.lexists(path)):
        database = shared_database(os.path.dirname(path))
    if database:
        return open_ledger(os.path.abspath(database), readonly), ""
    config = load_config(path)
    return open_ledger(config.database, readonly), config.session

def open_ledger(path, readonly=True):
    return Ledger(path, readonly=readonly, create=False)

def shared_database(directory):
    """The one database init's configs (one per host) share."""
    try:
        found = sorted(n for n in os.listdir(directory) if n.endswith(".db"))
    except OSError:
        return None
    if len(found) > 1:
        raise ConfigError(f"{directory} holds {len(found)} databases"
                          f" ({', '.join(found)}) and no config.json: name one with -db,"
                          " or a config with -config")
    if found:
        return os.path.join(directory, found[0])

def operator_parser(command, *flags):
    return parser(command, "config", "db", ("json", bool), *flags)

def with_id(p, name="run", metavar="ID", help=NAMED_RUN):
    p.add_argument(name, type=text_argument, metavar=metavar, help=help)
    return p

def current_user():
    try:
        import pwd
        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return os.environ.get("USER") or os.environ.get("USERNAME") or ""

def positive_limit(given, default):
    limit = default if given is None else given
    if limit <= 0:
        raise Usage("-limit must be at least 1")
    return limit

def reply(opts, value, *lines):
    """-json's one value, or the lines; 0."""
    if opts.json:
        tell_json(value)
    else:
        tell(*lines)
    return 0

def cmd_runs(argv):
    opts = operator_parser("runs", ("limit", int)).parse_args(argv)
    limit = positive_limit(opts.limit, 100)
    store, session = operator_store(opts, True)
    rows = store.runs_page(session, limit + 1)
    runs = rows[:limit]
    if opts.json or not runs:
        return reply(opts, runs, "no runs")
    head = ("RUN", "STATE", "STEPS", "CREATED", "HOST", "WAITING APPROVAL", "TOOL")
    print_table([head] + [
        (r["run"], run_state(store, r), str(r["steps"]),
         prose_time(r["created"]), cut(sanitize(r["host"]), 24) or "-",
         r["pending_approval"] or "", sanitize(r["tool"])) for r in runs])
    if len(rows) > limit:
        tell("... more runs; use -limit to see them")
    print_tool_changes(store, session)
    return 0

FAILED_STATE = dict(denied="DENIED", invalid="INVALID", error="TOOL_ERROR",
                    unsent="TOOL_ERROR", timed_out="UNKNOWN_OUTCOME",
                    no_answer="UNKNOWN_OUTCOME")
CANCELLED_STATE = dict(approval_rejected="REJECTED", approval_expired="EXPIRED")

def run_state(store, run):
    """As its call's answer began (DENIED, not FAILED)."""
    status = run["status"]
    if status == "CANCELLED":
        return CANCELLED_STATE.get(run["reason"], status)
    seen = status == "FAILED" and observations(store.steps(run["run"]))
    return FAILED_STATE.get(step_outcome(seen[-1]), status) if seen else status

def observations(steps):
    return [parse(s["observation"]) for s in steps if s["observation"]]

def step_json(step, field):
    return parse(step[field]) if step[field] else {}

def print_tool_changes(store, session):
    if session:
        for at, payload in store.tool_changes(session, 5):
            tell(f"{prose_time(at)}  {tools_changed_text(payload)}")

def print_table(rows):
    widths = [max(map(len, col)) for col in zip(*rows)]
    for row in rows:
        tell("  ".join(map(str.ljust, row, widths)).rstrip())

def load_run(store, run_id):
    run = store.run(run_id)
    if run is None:
        raise StoreError(f"run {quote(run_id)} not found")
    return run

MIN_PREFIX = 6
ID_TEXT = re.compile(r"[A-Za-z0-9_.-]+")
ID_CANDIDATES = 200  # ids one prefix is sought among

def id_candidates(store, kind, given, session=""):
    """Each id `given` may name, in any state: narrowed to waiting runs,
    a prefix would move on, once its run was decided, to another made
    the same minute."""
    table, most = kind + "s", ID_CANDIDATES
    if not ID_TEXT.fullmatch(given):
        return []
    if store.ids_starting(table, given, 1) == [given]:
        return [given]
    if len(given) < MIN_PREFIX:
        return []
    found = store.ids_starting(table, given, most)
    if kind == "run" and "." not in given:  # no session given
        found += store.ids_starting(table, f"{session}.{given}", most) if session \
            else store.run_ids_after_session(given, most)
    return sorted(set(found))

def resolve_id(store, kind, given, session=""):
    """The one id `given` names: nothing is guessed."""
    return only_one(kind, given, id_candidates(store, kind, given, session))

def only_one(kind, given, found):
    if len(found) == 1:
        return found[0]
    name = f"{kind} {quote(given)}"
    if not found:
        short = ID_TEXT.match(given) and len(given) < MIN_PREFIX
        need = f" (a shortened id needs at least {MIN_PREFIX} characters)"
        raise StoreError(f"{name} not found" + (need if short else ""))
    listed = ", ".join(found[:10])
    if len(found) > 10:
        listed += f" and {len(found) - 10} more"
    raise StoreError(f"{name} is ambiguous: it starts {listed}; give more of its"
                     " characters")

def approvals_named(store, given):
    found = id_candidates(store, "approval", given)
    return [(store.approval(a)["run_id"], a) for a in found]

def resolve_named(store, given, session, approval=None):
    """(run id, approval id or None) that ID and -approval name: several
    are refused; one no longer acted on never yields another."""
    named = [(r, None) for r in id_candidates(store, "run", given, session)]
    named += approvals_named(store, given)
    if not named:
        only_one("run or approval", given, [])
    if approval is not None:
        return named_approval(store, given, named, approval)
    runs = collections.defaultdict(set)  # a run and its approvals are one candidate
    for run_id, a in named:
        runs[run_id].update({a} - {None})
    if len(runs) > 1:
        listed = sorted(r + its_approvals(its) for r, its in runs.items())
        only_one("run or approval" if any(runs.values()) else "run", given, listed)
    (run_id, its), = runs.items()
    return run_id, (min(its) if len(its) == 1 else None)

def its_approvals(its):
    return f" (and its approval {', '.join(sorted(its))})" if its else ""

def named_approval(store, given, named, approval):
    wanted = approvals_named(store, approval)
    if not wanted:
        only_one("approval", approval, [])
    kept = [(r, a) for r, a in wanted if (r, None) in named or (r, a) in named]
    if not kept:
        raise StoreError(f"approval {quote(approval)} is no approval of {quote(given)}")
    listed = sorted(f"{a} (approval of run {r})" for r, a in kept)
    if len(listed) > 1:
        only_one("approval", approval, listed)
    return kept[0]

def cmd_show(argv):
    opts = with_id(operator_parser("show", ("full", bool))).parse_args(argv)
    store, session = operator_store(opts, True)
    run_id = resolve_named(store, opts.run, session)[0]
    run = load_run(store, run_id)
    steps = store.steps(run_id)
    if opts.json:
        return reply(opts, show_json(store, run, steps))
    late = store.late_outcomes(run_id)
    tell(*run_lines(store, run, steps), *result_lines(steps),
         *(f"LATE OUTCOME  {late_text(seen)}" for _, seen in late))
    for approval in store.approvals(run_id):
        if approval["status"] == "pending":
            tell("", *approval_lines(approval, opts.full, late)[0])
    tell()
    print_steps(store, steps)
    tell("", "events, whole as the chain holds them (show -json lists them as values):")
    # Whole, as verify hashes them.
    for seq, at, type_, _, payload in store.run_events(run_id):
        tell(f"  {seq:>6}  {at}  {type_}", *indented(payload))
    return 0

EVENT_KEYS = ("seq", "at", "type", "step_id", "payload")
STEP_JSON = ("decision", "policy", "observation")

def show_json(store, run, steps):
    """A combined event's parts each as an event."""
    steps = [{k: step_json(s, k) if k in STEP_JSON and v else v
              for k, v in s.items()} for s in steps]
    return dict(run=run, steps=steps, approvals=store.approvals(run["run"]),
                events=[dict(zip(EVENT_KEYS, e)) for e in store.run_parts(run["run"])])

def reason_text(run):
    return f" ({run['reason']})" if run["reason"] else ""

def run_lines(store, run, steps):
    status = run["status"] + reason_text(run)
    if run["detail"]:
        status += f": {run['detail']}"
    lines = [f"run       {run['run']}", f"tool      {run['tool']}",
             f"status    {status}", f"steps     {run['steps']}",
             f"created   {run['created']}"]
    if run["finished"]:
        lines.append(f"finished  {run['finished']}")
    if repeats_refused(store, run["run"], steps):
        lines.append(f"repeats   {REPEATS_REFUSED}")
    asked = steps and step_json(steps[0], "decision")
    if asked and "args" in asked:
        lines.append(f"arguments {clean(policy_json(asked['args']), 300)}")
    return lines

def print_steps(store, steps):
    print_table([("STEP", "DECISION", "STATUS", "POLICY", "OBSERVATION"),
                 *map(step_row, steps)])
    for s in steps:
        if tried_text(s):
            tell(f"step {s['index']}: {tried_text(s)}")
    for s in steps:
        grant = step_json(s, "policy").get("grant")
        grant = grant and store.grant(grant)
        if grant:
            note = f": {grant['note']}" if grant["note"] else ""
            tell(f"step {s['index']} ran under grant {grant['id']} by {grant['by']},"
                 f" {grant['created_at']} to {grant['expires_at']}{note}")
    for s in steps:
        seen = step_json(s, "observation")
        if "result" in seen:
            head, rows = result_rows(s["index"], seen)
            tell("", head)
            if rows:
                print_table(rows)

def step_row(s):
    decision = step_json(s, "decision")
    record = step_json(s, "policy")
    policy = record.get("outcome", "")
    if record.get("by") not in (None, "class", "rule outcome"):
        policy += f" ({record['by']})"
    seen = step_json(s, "observation")
    summary = seen.get("kind", "")
    if seen.get("summary"):
        summary += ": " + clean(seen["summary"], 100)
    return (str(s["index"]), f"{decision['kind']} ({decision.get('origin', '')})",
            s["status"], policy, summary)

REPEATS_REFUSED = ("an identical call within the tool's repeat window after this one is"
                   ' refused as DUPLICATE; to allow it, set "repeat_window": "0s" (or a'
                   " shorter time) in the tool's rule")

def repeats_refused(store, run_id, steps):
    """Whether identical calls are refused: the run ended a mutation
    known (an unknown one asks an operator)."""
    attempt = last_attempt(store.read, run_id)
    if attempt is None or attempt.ending in UNKNOWN_ENDINGS:
        return False
    step_id = attempt.attempt["step_id"]
    step = next(s for s in steps if s["id"] == step_id)
    spec = store.tool_spec(step["spec_hash"]) or {}
    return spec.get("side_effect", "read_only") != "read_only"

def indented(line):
    """In 100-column pieces: show prints events and results whole."""
    return [" " * 10 + piece for piece in wrap_columns(sanitize(line), 100)]

def result_lines(steps):
    """The last recorded result, whole and sanitized."""
    seen = observations(steps)
    if not seen:
        return ["result    none recorded"]
    last = seen[-1]
    outcome = step_outcome(last)
    if outcome in CALL_ENDINGS:
        text = outcome_text(last)
    else:
        text = last.get("message") or policy_json(last.get("content", {}))
    if not isinstance(text, str):
        text = policy_json(text)
    head = f"result    {last['kind']}"
    if last.get("summary"):
        head += f": {sanitize(last['summary'])}"
    # A server may answer in the gate's own words (DENIED: ...): the record says whose.
    if outcome in ("ok", "error", "unrecorded") and not last.get("withheld"):
        head += "   (the server's answer)"
    else:
        head += "   (the gate's own answer, not a server's)"
    return [head] + [piece for line in text.split("\n") for piece in indented(line)]

def result_rows(index, observed):
    """A head line, then each block and its whole hash."""
    record = observed["result"]
    how = ", withheld: too large to pass on" if observed.get("withheld") else ""
    if record.get("is_error"):
        how += ", an error result"
    head = (f"result of step {index}: {record['bytes']} bytes, sha256"
            f" {record['sha256']}{how}")
    rows = [r for b in record["blocks"] for r in block_rows(b)]
    value = record.get("structured")
    if value:
        kept = "" if "value" in value else "(not kept: too large)"
        rows += [("  structured content", f"{value['bytes']} bytes", kept),
                 ("", "", f"sha256 {value['sha256']}")]
    if record.get("more_blocks"):
        rows.append((f"  and {record['more_blocks']} more blocks", "", ""))
    return head, rows

def block_rows(entry):
    text = entry.get("text")
    if "text" in entry:
        shown = quote(cut(text, 60)) + (" (first part kept)" if "sha256" in entry else "")
    else:
        shown = sanitize(cut(entry.get("mimeType") or entry.get("uri") or "", 60))
    digest = entry.get("sha256") or sha256_hex(
        text.encode("utf-8", "surrogatepass"))
    return [(f"  {sanitize(entry['type'])}", f"{block_bytes(entry)} bytes", shown),
            ("", "", f"sha256 {digest}")]

def approval_lines(approval, full=False, late=()):
    """approval_shown, marked where a value reads as it is not."""
    return approval_shown(approval, full, late, lookalike_notes)

def lookalike_notes(*texts):
    """Words in the texts that mix scripts or are wholly lookalikes,
    and invisible characters."""
    notes = []
    for text in texts:
        notes += map(_lookalike_note, lookalike_words(text)[:3])
        hidden = [f"U+{code:04X} {unicodedata.name(chr(code), '')}".rstrip()
                  for code in invisible_codes(text)[:5]]
        if hidden:
            notes.append("holds invisible characters: " + ", ".join(hidden))
    return notes

def _lookalike_note(word):
    latin = latin_lookalike(word)
    if latin:
        return (f"{quote(word)} reads as the Latin {quote(latin)} but is written"
                f" wholly in {scripts_of(word).pop()} letters")
    script = {ch: scripts_of(ch).pop() for ch in word if ch.isalpha()}
    usual = collections.Counter(script.values()).most_common(1)[0][0]
    foreign = [f"U+{ord(ch):04X} {unicodedata.name(ch, '?')}"
               for ch in script if script[ch] != usual]
    return f"{quote(word)} mixes scripts: {', '.join(foreign[:3])} among {usual} letters"

# ---- approve, reject, cancel ----------------------------------------------------------------

def who(opts, verb="decides"):
    by = opts.by or current_user()
    if not by:
        raise Usage(f"say who {verb} with -by; the current user has no name")
    return by

def operator_decision(command, argv, *flags):
    """(opts, who decides, store, run id, approval id or None) for
    approve, reject and cancel."""
    p = operator_parser(command, *flags, ("note", str), ("by", str))
    opts = with_id(p).parse_args(argv)
    by = who(opts)
    store, session = operator_store(opts, False)
    named = getattr(opts, "approval", None)
    return (opts, by, store, *resolve_named(store, opts.run, session, named))

def run_line(run):
    return f"run {run['run']}: {run['status']}{reason_text(run)}"

def decide(argv, command):
    opts, by, store, run_id, named = operator_decision(
        command, argv, ("approval", str), ("yes", bool), ("full", bool))
    status = "approved" if command == "approve" else "rejected"
    note = opts.note or ""
    if status == "rejected" and not note:
        raise Usage("reject needs -note: the model is shown it, so say why")
    approval = select_approval(store, run_id, named)
    lines, shortened = approval_printout(store, approval, opts.full,
                                         lookalike_notes)
    what = f"approval {approval['id']}"
    how = f" (or -approval {approval['id']}) to {command} the approval"
    if not consents(opts, lines, shortened, what, command, opts.approval or opts.yes,
                    "decided", how):
        return 1
    run, then = settle(store, approval, status, by, note, hold_of(opts))
    decided = dict(id=approval["id"], status=status, by=by, note=note,
                   hash=approval["hash"])
    return reply(opts, dict(run=run, approval=decided), f"{what}: {status} by {by}",
                 run_line(run), *then)

cmd_approve = functools.partial(decide, command="approve")
cmd_reject = functools.partial(decide, command="reject")

def cmd_cancel(argv):
    opts, by, store, run_id, _ = operator_decision("cancel", argv)
    status = load_run(store, run_id)["status"]
    if status in TERMINAL:
        raise StoreError(f"run {run_id} already ended ({status}); there is nothing to"
                         " cancel")
    def cancel(tx):
        current = tx.run_holder(run_id)[0]
        if current in TERMINAL:
            raise StoreError(f"run {run_id} ended meanwhile ({current})")
        tx.cancel_run(run_id, by, opts.note or "")
    store.write(cancel)
    run = load_run(store, run_id)
    return reply(opts, dict(run=run), run_line(run))

def select_approval(store, run_id, approval_id):
    """The approval named, or the one its run waits on; one decided
    already is refused."""
    approvals = store.approvals(run_id)
    if approval_id:
        approval = next(a for a in approvals if a["id"] == approval_id)
        if approval["status"] != "pending":
            raise StoreError(f"approval {approval_id} was already"
                             f" {decision_text(approval)}; nothing was decided")
        return approval
    pending = [a for a in approvals if a["status"] == "pending"]
    if len(pending) > 1:
        ids = ", ".join(a["id"] for a in pending)
        raise StoreError(f"run {quote(run_id)} has {len(pending)} pending approvals;"
                         f" name one of {ids} with -approval")
    if pending:
        return pending[0]
    last = ""
    if approvals:
        last = (f": approval {approvals[-1]['id']} was already"
                f" {decision_text(approvals[-1])}")
    raise StoreError(f"run {quote(run_id)} has no pending approval{last}; nothing was"
                     " decided")

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
        raise StoreError(f"approval {approval['id']} expired at {approval['expires_at']};"
                         " it can no longer be decided, and its request was not executed")
    if decided == "changed":
        raise StoreError(f"approval {approval['id']} changed after it was shown, or was"
                         " decided meanwhile; nothing was decided: look at it again as it"
                         " is now")
    return what_runs(store, approval, status == "approved", hold)

# Seconds a held call may take to take up its approval, on a loaded machine.
HELD_SEEN = 20.0
TAKEN_UP = ("The call the model is waiting on took it up and runs it now: its result is"
            " that call's answer, and the model need not call again.")
APPROVED_NEXT = ("No call waits on it any more (its hold ended): it runs when the model"
                 " calls the tool again with exactly the same arguments.")
TASK_NEXT = ("A task waits on it, and no gate drives that task now: it runs when a gate"
             " on this database is next asked how the task stands.")

def what_runs(store, approval, approved, hold):
    """The run as decided, and what runs the approval: its held call (for
    `hold` s) or its task, seen as the run leaving the wait; else an
    identical call."""
    tasked = store.read_one("SELECT lease_expires_at FROM tasks WHERE"
                            " approval_id=? AND status='working'", (approval["id"],))
    ends = min(parse_time(approval["created_at"]) + hold, time.time() + HELD_SEEN)
    if tasked:  # driven (its lease lives), or left for the next gate
        ends = time.time() + HELD_SEEN if tasked[0] > now() else 0
    run = load_run(store, approval["run_id"])
    if not approved:
        return run, ()
    while run["status"] == "WAITING_FOR_APPROVAL" and time.time() < ends:
        time.sleep(0.1)
        run = load_run(store, approval["run_id"])
    waiting = run["status"] == "WAITING_FOR_APPROVAL"
    after = TASK_NEXT if tasked else APPROVED_NEXT
    return run, (after if waiting else TAKEN_UP,)

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
    store, session = operator_store(opts, True)
    hint = operator_hint(config_path(opts.config), opts.db)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    with contextlib.closing(store):
        if sys.stdin.isatty() and sys.stdout.isatty():
            if watch_terminal(store, session, who(opts), hold_of(opts), stop):
                return 0
            log("this terminal cannot show the live view; plain lines follow, and nothing"
                " is decided from them")
        watch_lines(store, session, hint, stop)
        return 0

def waiting_cells(approval, limit):
    text = policy_json(parse(approval["request_json"])["args"])
    caution = "CAUTION " if lookalike_notes(text) else ""
    return (approval["id"], approval["run_id"], clean(approval["tool"], 64),
            time_since(approval["created_at"]), clean(caution + text, limit))

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
    if run and run["status"] in TERMINAL:  # an approved run waits until called again
        status += f"; run {run['status']}{reason_text(run)}"
    return (f"run {approval['run_id']}  approval {approval['id']}  tool"
            f" {clean(approval['tool'], 64)}  {status}")

def watch_lines(store, session, hint, stop):
    """A line when an approval starts waiting (with the command that
    decides it), one when it stops; nothing is decided here."""
    shown = {}
    while not stop.is_set():
        waiting = {a["id"]: a for a in store.waiting_approvals(session)}
        for a in waiting.values():
            if a["id"] not in shown:
                a_id, run_id, tool, age, args = waiting_cells(a, 200)
                tell(f"waiting  run {run_id}  approval {a_id}  tool {tool}  age {age}"
                     f"  {args}  decide with: {hint} approve {run_id} -approval {a_id}"
                     "   (or reject)", flush=True)
        for a in shown.values():
            if a["id"] not in waiting:
                tell(f"ended    {ended_text(store, a)}", flush=True)
        shown = waiting
        stop.wait(WATCH_EVERY)

def watch_terminal(store, session, by, hold, stop):
    """Run the live view; False if this terminal cannot show it."""
    try:
        import curses  # only here: nothing else pays for loading it
        import locale
        locale.setlocale(locale.LC_ALL, "")
        curses.setupterm()
        if not curses.tigetstr("cup"):  # cannot place the cursor
            return False
    except ImportError:
        return False
    except (locale.Error, curses.error):
        return False
    curses.wrapper(lambda window: watch_list(
        Screen(curses, window), store, session, by, hold, stop))
    return True

class Screen:
    """Where watch touches curses: sanitized rows, keys by name."""

    KEYS = dict(KEY_UP="up", KEY_DOWN="down", KEY_NPAGE="page down",
                KEY_PPAGE="page up", KEY_ENTER="enter",
                KEY_BACKSPACE="backspace")
    CHARACTERS = {"\n": "enter", "\r": "enter", "\x1b": "esc", "\x7f": "backspace",
                  "\b": "backspace"}

    def __init__(self, curses, window):
        self.curses, self.window = curses, window
        self.codes = {getattr(curses, name): key for name, key in self.KEYS.items()}
        with contextlib.suppress(curses.error):
            curses.curs_set(0)
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
            with contextlib.suppress(self.curses.error):  # text reaching the last cell
                self.window.move(row, 0)
                self.window.clrtoeol()
                self.window.addstr(row, 0, wrap_columns(
                    sanitize(text), width - 1)[0], attr)

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
        ids = [a["id"] for a in waiting]
        if chosen in ids:
            selected = ids.index(chosen)
        selected = max(0, min(selected, len(ids) - 1))
        height, width = screen.size()
        screen.begin()
        where = f"in session {session}" if session else "in every session"
        screen.put(0, f"agentgate watch: {len(waiting)} waiting for an operator {where},"
                      f" deciding as {by}", bold=True)
        # Whole ids: they begin with the time they were made.
        table = [("APPROVAL", "RUN", "TOOL", "AGE", "ARGUMENTS")] + [
            waiting_cells(a, 4 * width) for a in waiting]
        widths = [max(len(row[i]) for row in table) for i in range(4)] + [0]
        lines = ["  ".join(map(str.ljust, row, widths)) for row in table]
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
            message = watch_approval(screen, store, ids[selected], by, hold, stop)
        elif key in ("q", "esc"):
            return
        if ids:
            chosen = ids[max(0, min(selected, len(ids) - 1))]

def watch_approval(screen, store, approval_id, by, hold, stop):
    """One approval as approve prints it, decided with a key: the line
    the list shows next."""
    approval = store.approval(approval_id)
    if approval is None or approval["status"] != "pending":
        return f"approval {approval_id} no longer waits"
    try:
        printouts = [approval_printout(store, approval, full, lookalike_notes)
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
        moves = {"up": -1, "k": -1, "down": 1, "j": 1, " ": body, "page down": body,
                 "page up": -body, "b": -body}
        why = undecided(shortened, seen_end)
        if key in moves:
            top += moves[key]
        elif key == "f":  # more rows: the end is to be reached again
            full, message, seen_end = True, "", False
        elif key in ("q", "esc"):
            return ""
        elif key in ("a", "r") and why:
            message = why
        elif key == "a":
            return watch_decide(store, approval, "approved", by, "", hold)
        elif key == "r":
            note = prompt(screen, "note for the model (required; Enter rejects, Esc"
                                  " cancels): ", stop)
            if note:
                return watch_decide(store, approval, "rejected", by, note, hold)
            message = "nothing decided"
    return ""

def watch_decide(store, approval, status, by, note, hold):
    try:
        with contextlib.closing(open_ledger(store.path, False)) as writer:
            then = settle(writer, approval, status, by, note, hold)[1]
    except StoreError as err:
        return str(err)
    return ". ".join((f"approval {approval['id']}: {status} by {by}", *then))

def prompt(screen, question, stop):
    text = ""
    while not stop.is_set():
        height, width = screen.size()
        # The row shows a long answer's last columns.
        shown = (question + sanitize(text) + "_")[::-1]
        screen.put(height - 1, wrap_columns(shown, max(1, width - 1))[0][::-1])
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

def cmd_grant(argv):
    p = parser("grant", "config", "if", "for", "note", "by", ("yes", bool),
               ("full", bool), ("json", bool))
    opts = with_id(p, "tool", "TOOL", "the tool as the host is offered it (check lists"
                   " them)").parse_args(argv)
    by = who(opts, "grants")
    config, tool = granted_tool(opts.config, opts.tool)
    parsed = grant_conditions(getattr(opts, "if"), tool)
    span = grant_span(getattr(opts, "for"), config)
    grant = dict(id=new_id(8), session=config.session, tool=tool.target,
                 name=tool.name, conditions_json=dumps(confirmed_conditions(parsed)),
                 by=by, note=opts.note or "")
    waits = covered_waits(config, tool, grant, opts.full)
    lines, shortened = grant_printout(config, tool, grant, parsed, span, waits,
                                      opts.full)
    if not consents(opts, lines, shortened, "this grant", "grant", opts.yes, "granted",
                    " to grant what is"):
        return 1
    store = Ledger(config.database, readonly=False)  # may be new
    released = store.write(
        lambda tx: grant_releasing(tx, grant, span, waits, by))
    told = [f"grant {grant['id']}: in force from {grant['created_at']} until"
            f" {grant['expires_at']}"]
    hold = longest_hold(config)
    for approval, decided in released:
        then = ["not released: it changed, was decided or expired after it was printed"]
        if decided == "decided":
            then = what_runs(store, approval, True, hold)[1]
        told.append(f"approval {approval['id']}: " + " ".join(then))
    ids = [a["id"] for a, decided in released if decided == "decided"]
    return reply(opts, {**grant_view(grant), "released": ids}, *told)

def granted_tool(path, name):
    """(config, tool) a grant is for; without -config, the one of
    init's per-host configs that offers the tool (a grant is for one
    host's session)."""
    hosts = [] if path else host_configs(config_path(None))
    offered = {}
    for config in map(load_config, hosts or [config_path(path)]):
        for tool_name, tool in configured_tools(config).items():
            offered.setdefault(tool_name, []).append((config, tool))
    if name not in offered:
        raise Usage(f"no configured tool is named {quote(name)}; the tools are"
                    f" {', '.join(sorted(offered)) or 'none'}")
    if len(offered[name]) > 1:
        paths = ", ".join(shlex.quote(c.path) for c, _ in offered[name])
        raise Usage(f"{quote(name)} is offered in {paths}; add -config naming the"
                    " config of the host the grant is for")
    return offered[name][0]

def grant_conditions(text, tool):
    """-if as conditions, each on an argument of the pinned schema that
    the model sets."""
    try:
        conditions = parse(text or "{}")
    except CanonicalError as err:
        raise Usage(f"-if is not usable JSON ({err}); write it like"
                    f" '{{\"/amount\": {{\"max\": 20}}}}'") from None
    parsed = parse_conditions(conditions, "-if")
    entry = read_manifest(tool.server)["tools"].get(tool.upstream_name)
    schema = (entry or {}).get("input_schema") or {}
    for condition in parsed:
        problem = pointer_problem(schema, condition.tokens, set(tool.rule.hidden))
        if problem:
            raise Usage(f"-if points at {quote(condition.pointer)}, but {problem} in the"
                        f" pinned schema of {tool.name}")
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
        raise Usage("-for must be more than 0 and at most grant_ttl"
                    f" ({format_duration(most)})")
    raise Usage("-for must be more than 0")

def covered_waits(config, tool, grant, full):
    """(approval, printout) of each wait decided again as the gate would,
    limits counted, that it is `grant` that allows."""
    if not os.path.exists(config.database):
        return []
    with contextlib.closing(open_ledger(config.database)) as store:
        return [(a, *approval_printout(store, a, full, lookalike_notes))
                for a in store.waiting_approvals(config.session)
                if _covers(store, config, tool, grant, a)]

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
    return decision["outcome"] == "allow" and decision.get("grant") == grant["id"]

def decided_client(store, approval):
    """The host's name as the policy's decision to ask recorded it."""
    step = next(s for s in store.steps(approval["run_id"])
                if s["id"] == approval["step_id"])
    return (step_json(step, "policy").get("facts") or {}).get("client", "")

def grant_view(grant):
    if grant.get("revoked_at"):
        state = f"revoked at {grant['revoked_at']} by {grant['revoked_by']}"
    else:
        state = "in force" if grant["expires_at"] > now() else "expired"
    view = {k: grant.get(k, "") for k in GRANT_COLUMNS if k != "conditions_json"}
    return {**view, "conditions": parse(grant["conditions_json"]), "state": state}

def covers_text(conditions):
    return " and ".join(c.text() for c in conditions) or "every call"

def cmd_grants(argv):
    opts = operator_parser("grants", ("days", int)).parse_args(argv)
    store, session = operator_store(opts, True)
    days = 7 if opts.days is None else opts.days
    since = format_time(time.time() - days * 86400)
    views = [grant_view(g) for g in store.grants(session, since)]
    if opts.json or not views:
        return reply(opts, views, f"no grant in force or ended in the last {days} days")
    table = [("GRANT", "TOOL", "UNTIL", "STATE", "BY", "COVERS")]
    for v in views:
        covers = covers_text(parse_conditions(v["conditions"], "grant", resolved=True))
        table.append((v["id"], sanitize(v["name"]), v["expires_at"], v["state"],
                      sanitize(v["by"]), cut(sanitize(covers), 120)))
    print_table(table)
    return 0

def cmd_revoke(argv):
    p = operator_parser("revoke", ("note", str), ("by", str), ("yes", bool))
    opts = with_id(p, "grant", "GRANT", "the grant's id, or a prefix of it (6"
                   " characters or more)").parse_args(argv)
    by = who(opts, "revokes")
    store, _ = operator_store(opts, False)
    grant_id = resolve_id(store, "grant", opts.grant)
    grant = store.grant(grant_id)
    state = grant_view(grant)["state"]
    if state != "in force":
        raise StoreError(f"grant {grant_id} is not in force ({state}); nothing changed")
    lines = [f"GRANT TO REVOKE  {grant_id}",
             f"  tool           {grant['name']}",
             f"  covers         {covers_text(Grant(grant).conditions)}",
             f"  until          {grant['expires_at']}",
             f"  by             {grant['by']}"]
    # The grant named whole confirms, as approve -approval does.
    if not consents(opts, lines, False, f"grant {grant_id}", "revoke",
                    opts.yes or opts.grant == grant_id, "revoked",
                    " (or name the grant whole) to revoke the grant"):
        return 1
    note = opts.note or ""
    if not store.write(lambda tx: tx.revoke_grant(grant_id, by, note)):
        raise StoreError(f"grant {grant_id} is not in force (it expired or was revoked);"
                         " nothing changed")
    return reply(opts, grant_view(store.grant(grant_id)),
                 f"grant {grant_id}: revoked by {by}")

VERIFY_PAGE = 128

def cmd_verify(argv):
    p = operator_parser("verify", ("from", int), ("to", int), ("head", str))
    opts = p.parse_args(argv)
    first, last = getattr(opts, "from") or 1, opts.to
    if first < 1 or (last is not None and last < first):
        raise Usage("-from and -to must be sequence numbers with -from <= -to")
    kept = kept_head(opts.head) if opts.head else None
    store, _ = operator_store(opts, True)
    report = verify_chain(store, first, last)
    broken, to, checked = report["break"], report["to"], report["checked"]
    short = last is not None and not broken and to < last
    held = kept and held_state(store, kept, broken)
    failed = 1 if broken or short or held not in (None, "matches") else 0
    head = store.chain_head()
    if opts.json:
        tell_json({"head": head and {"seq": head[0], "hash": head[1]},
                   "intact": not broken, "checked": checked,
                   "from": first, "to": to,
                   "last_hash": report["hash"] if checked else None,
                   "break": broken and dict(zip(BREAK_KEYS, broken)),
                   "ends_before_to": short,
                   "kept_head": kept and {"seq": kept[0], "is": held}})
        return failed
    tell(f"head: seq {head[0]} {head[1]}" if head else "head: no events")
    if broken:
        seq, detail, expected, found = broken
        tell(f"broken at seq {seq}: {detail}", f"  expected: {expected}",
             f"  found:    {cut(sanitize(found), 128)}")
    else:
        span = f", seq {first} to {to}" if checked else ""
        tell(f"intact: {checked} event(s){span}")
        if checked:
            tell(f"last checked: seq {to} {report['hash']}")
    if short:
        tell(f"the chain ends at seq {to}, before -to {last}")
    if held:
        tell(f"kept head: seq {kept[0]} {KEPT_HEAD[held]}")
    return failed

def kept_head(text):
    match = re.fullmatch(r"(\d+):([0-9a-f]{64})", text)
    if not match:
        raise Usage("-head must read SEQ:HASH, as verify printed it")
    return int(match[1]), match[2]

def held_state(store, kept, broken):
    """The kept head: removed, changed or matches."""
    found = store.event_hash_at(kept[0])
    if found is None:
        return "removed"
    if found != kept[1] or broken and broken[0] <= kept[0]:
        return "changed"
    return "matches"

KEPT_HEAD = dict(removed="is not in the chain: events were removed",
                 changed="does not match: the record was changed", matches="matches")
BREAK_KEYS = ("seq", "detail", "expected", "found")
HASH_BROKEN = ("the stored hash is not the one the event's fields and the previous"
               " event's hash give")

def verify_chain(store, first, last):
    """The chain from `first` to `last` (None: its end); a range past 1
    trusts the stored hash before it."""
    prev_seq, prev_hash = first - 1, ""
    if first > 1:
        prev_hash = store.event_hash_at(prev_seq) or ""
    report = {"to": prev_seq, "checked": 0, "hash": prev_hash, "break": None}
    while last is None or prev_seq < last:
        rows = store.events_after(prev_seq, last, VERIFY_PAGE)
        if not rows:
            break
        for seq, *fields, stored in rows:
            if seq != prev_seq + 1:
                detail = f"the first event is seq {seq}"
                if prev_seq:
                    detail = f"seq {seq} follows {prev_seq}: an event is missing"
                report["break"] = (seq, detail, f"seq {prev_seq + 1}", f"seq {seq}")
            else:
                expected = event_hash(prev_hash, seq, *fields)
                if expected != stored:
                    report["break"] = (seq, HASH_BROKEN, expected, stored)
            report["to"] = seq
            if report["break"]:
                return report
            prev_seq, prev_hash = seq, stored
            report.update(checked=report["checked"] + 1, hash=stored)
    return report

RECHECK_SCOPE = (
    "A re-check covers the gate's policy: the class map, each rule's outcome, fixed"
    " values and renames. It does not cover the rules before the policy (duplicates and"
    " the repeat window, max_pending, rejected or expired approvals, calls refused"
    " before the gate), nor, without -current-tools, any change to a tool's schema or"
    " denied parameters.")

def cmd_recheck(argv):
    p = parser("recheck", "config", "run", "session", ("limit", int),
               ("current-tools", bool), ("json", bool))
    opts = p.parse_args(argv)
    if opts.run and opts.session:
        raise Usage("give -run or -session, not both")
    limit = positive_limit(opts.limit, 50)
    hosts = [] if opts.config else host_configs(config_path(None))
    if opts.json and len(hosts) > 1:  # one JSON value
        raise Usage("recheck -json reads one config; add -config naming one of "
                    + ", ".join(map(shlex.quote, hosts)))
    if hosts:
        return each_config(cmd_recheck, argv, hosts)
    config = load_config(config_path(opts.config))
    check_database_path(config.database)
    store = open_ledger(config.database)
    session = opts.session or config.session
    upstreams = []
    try:
        if opts.current_tools:
            check_reach(config)
            upstreams, loaded, found = load_all(config)
            log_reports(found)
            tools = {tool.name: tool for tool in loaded}
        else:
            tools = configured_tools(config)
        if opts.run:
            run_ids = [resolve_id(store, "run", opts.run, config.session)]
            session = ""
        else:
            run_ids = store.session_runs(session, limit)
        reports = [recheck_run(store, config, tools, r, opts.current_tools)
                   for r in run_ids]
    finally:
        for upstream in upstreams:
            upstream.close()
    return print_recheck(config, reports, opts.json, session)

def configured_tools(config):
    """Tools as the config classifies them, unstarted."""
    tools = [Tool(server, None, {"name": name, "description": "",
                                 "input_schema": {"type": "object"}}, rule)
             for server in config.servers for name, rule in server.rules.items()]
    return {tool.name: tool for tool in tools}

def recheck_run(store, config, tools, run_id, current):
    run = load_run(store, run_id)
    source = "current" if current else "recorded"
    steps = {s["id"]: s for s in store.steps(run_id)}
    evaluations, seen = [], set()
    for seq, step_id, recorded, at in store.policy_events(run_id):
        step = steps[step_id]
        e = dict(seq=seq, step_index=step["index"], step_id=step_id,
                 tool=run["tool"], on_resume=step_id in seen,
                 recorded=recorded["outcome"], rechecked="", detail="",
                 recorded_hash="", rechecked_hash="",
                 policy_id=recorded.get("policy_id", ""), spec_source=source)
        seen.add(step_id)
        evaluations.append(e)
        recheck_one(store, config, tools, run, step, recorded, at, e)
    ids = {e["policy_id"] for e in evaluations if e["policy_id"]}
    notes = []
    if len(ids) > 1:
        notes.append("the run's decisions were made under more than one policy identity")
    recorded_id = ids.pop() if len(ids) == 1 else ""
    identity = "unknown"
    if recorded_id:
        identity = "unchanged" if recorded_id == config.policy_id() else "changed"
    results = [e["result"] for e in evaluations]
    differences = results.count("different")
    rechecked = differences + results.count("same")
    return dict(run_id=run_id, run_status=run["status"], policy_id=recorded_id,
                identity=identity, spec_source=source, notes=notes,
                evaluations=evaluations, same=differences == 0,
                differences=differences, rechecked=rechecked,
                not_recheckable=len(results) - rechecked, complete=True)

def recheck_one(store, config, tools, run, step, recorded, at, e):
    """Fills in evaluation `e` of a recorded decision."""
    if not e["policy_id"]:
        e.update(result="not_a_policy_evaluation",
                 detail="a pause after an interruption, not a policy evaluation")
        return
    spec = store.tool_spec(step["spec_hash"])
    decision = parse(step["decision"])
    if spec is None or "args" not in decision:
        e.update(result="not_recheckable", detail="the recorded request is missing")
        return
    args = decision["args"]
    request = {"run_id": run["run"], "step_id": step["id"], "spec": spec,
               "args": args}
    if recorded["outcome"] == "require_approval":
        e["recorded_hash"] = asked_hash(recorded, request)
    tool = tools.get(run["tool"])
    if tool is None:
        e.update(result="different", rechecked="deny",
                 detail="the tool is not among the current tools")
        return
    if e["spec_source"] == "current":
        request["spec"] = tool.spec
        problem = check_arguments(tool, args)
        if problem:
            e.update(result="different", rechecked="invalid",
                     detail=f"the arguments fail the current schema: {problem}")
            return
    else:  # the defaults come from the schema decided under
        entry = {"name": tool.upstream_name, "input_schema": spec["input_schema"]}
        tool = Tool(tool.server, None, entry, tool.rule)
    # The facts of its moment, executions before it counted as the
    # gate counts them, none if an operator decided.
    moment = recorded.get("facts") or {
        "at": at, "client": "", "approved": e["on_resume"]}
    approved = moment["approved"]
    facts = decision_facts(store.read, run["session"], tool, moment["at"],
                           moment.get("client", ""), not approved)
    attempt = recorded.get("capability", {}).get("interrupted")
    today = evaluate(config, tool, args, facts, attempt, approved=approved)
    e["rechecked"] = today["outcome"]
    same = today["outcome"] == recorded["outcome"]
    if same and today["outcome"] == "require_approval":
        e["rechecked_hash"] = asked_hash(today, request)
        if e["rechecked_hash"] != e["recorded_hash"]:
            same = False
            e["detail"] = ("asks for another approval: its capability, presentation,"
                           " or tool spec changed")
    if not same and not e["detail"]:
        e["detail"] = today["reason"]
    e["result"] = "same" if same else "different"

def asked_hash(decision, request):
    return approval_hash(decision["kind"], decision["capability"],
                         decision["presentation"], request)

def print_recheck(config, reports, as_json, session):
    """Differences in full; runs all the same are counted per policy
    identity (unless there is one run): no difference hides among fifty
    runs' lines."""
    rechecked = sum(r["rechecked"] for r in reports)
    skipped = sum(r["not_recheckable"] for r in reports)
    differ = sum(not r["same"] for r in reports)
    if as_json:
        tell_json(reports)
    else:
        tell_recheck(config.policy_id(), reports, rechecked, skipped, differ)
    if not reports:
        log(f'no run of session "{session}" was found, so nothing was re-checked')
        return 1
    if not rechecked:
        log(f"no decision of the policy was re-checked ({skipped} not re-checkable)")
        return 1
    return 1 if differ else 0

def tell_recheck(policy_id, reports, rechecked, skipped, differ):
    different = sum(r["differences"] for r in reports)
    tell(f"{len(reports)} run(s) re-checked under {policy_id}: {rechecked} decision(s)"
         f" re-checked, {different} differ, {skipped} not re-checkable and skipped;"
         f" {differ} run(s) differ")
    same = collections.defaultdict(lambda: [0, 0])  # identity -> [runs, decisions]
    for r in reports:
        identity = identity_text(r, policy_id)
        if r["same"] and not r["not_recheckable"] and not r["notes"] \
                and len(reports) > 1:
            same[identity][0] += 1
            same[identity][1] += r["rechecked"]
            continue
        tell(f"run {r['run_id']} {r['run_status']}: {r['differences']} of"
             f" {r['rechecked']} re-checked evaluations differ; {identity};"
             f" {r['spec_source']} specs")
        rank = {"different": 0, "same": 2}
        for e in sorted(r["evaluations"], key=lambda e: rank.get(e["result"], 1)):
            tell(cut(recheck_line(e), 240))
        for note in r["notes"]:
            tell(f"note: {note}")
    for identity, (runs, decisions) in same.items():
        tell(f"the same today: every decision of {runs} run(s) ({decisions} in all);"
             f" {identity}")
    tell(RECHECK_SCOPE)

def identity_text(report, policy_id):
    if report["identity"] == "unchanged":
        return f'policy unchanged: "{policy_id}"'
    if report["identity"] == "changed":
        return f'policy changed: recorded "{report["policy_id"]}", given "{policy_id}"'
    return "policy identity unknown"

RECHECK_MARK = {"same": "same     ", "different": "DIFFERENT"}

def recheck_line(e):
    mark = RECHECK_MARK.get(e["result"], "skipped  ")
    where = f" step {e['step_index']} seq {e['seq']} {sanitize(e['tool'])}"
    if e["on_resume"]:
        where += " (on resume)"
    body = e["detail"]
    if e["result"] == "same":
        body = e["recorded"]
    elif e["result"] == "different":
        body = f"{e['recorded']} -> {e['rechecked'] or '?'}"
        if e["detail"]:
            body += f": {e['detail']}"
    return f"{mark}{where}: {sanitize(body)}"


# =============================================================================================
# 31. Setup
#
# Reads as: around the core
#
# Owns: `init`, which writes a config per host with the servers of its files (one
# database for all), pins them and proposes a rule per tool from its own hints; the
# acceptance of those proposals; `login`, OAuth with a url server: the one command that
# opens a port (on 127.0.0.1, while it waits).
# Core it calls: Server, read_owned, confirmed, check_reach; section 22's load_config,
# read_transport, shown_url and write_private; section 27's operator_hint; section 28's pin.
# Promises: a config is written 0600; run again, init adds the servers new in its host's
# file and changes no other byte; a secret in a server's env or headers goes into the
# config and into no output; a tool is offered only once its proposed rule was accepted;
# a project's servers start only when -from names their file; a host's file changes only
# with -write, from a backup kept beside it, only if it is as init read it, and only to
# replace the gated servers by the one entry.
# =============================================================================================

HOST_ENTRY_NAME = "gated"  # some hosts show it in tool names
HOST_FILE_BYTES = 64 << 20  # ~/.claude.json keeps a history
SHARED_DATABASE = "agentgate.db"  # one record for every host

# A config per host, named for it; its name is the session. A call held past its host's
# wait is lost to the conversation, so each hold is proposed below it, keyed by the name
# a host gives in initialize ("*": any other). Claude Desktop waits about a minute,
# progress or not: 50s; Claude Code minutes: 10m; Cursor as the TypeScript SDK (60 s): 50s.
HOSTS = {
    "Claude Desktop": ("claude-desktop", {"claude-ai": "50s", "*": "15s"}),
    "Claude Code": ("claude-code", {"claude-code": "10m", "*": "15s"}),
    "Cursor": ("cursor", {"cursor-vscode": "50s", "*": "15s"})}

def host_config_files():
    home = os.path.expanduser("~")
    if sys.platform == "darwin":
        apps = os.path.join(home, "Library", "Application Support")
    elif sys.platform == "win32":
        apps = os.environ.get("APPDATA", home)
    else:
        apps = os.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
    desktop = os.path.join(apps, "Claude", "claude_desktop_config.json")
    places = [
        ("Claude Desktop", desktop),
        ("Claude Code", os.path.join(home, ".claude.json")),
        ("Claude Code project", ".mcp.json"),
        ("Cursor", os.path.join(home, ".cursor", "mcp.json")),
        ("Cursor project", os.path.join(".cursor", "mcp.json"))]
    seen, found = set(), []
    for host, path in places:
        real = os.path.realpath(path)
        if os.path.isfile(path) and real not in seen:
            seen.add(real)
            found.append(HostFile(host, path, project=host.endswith(" project")))
    return found

class HostFile:
    """A host's file and its maps of servers (Claude Code's has one for the current
    directory too). A project's servers came with the directory, perhaps cloned a minute
    ago: they start only when -from named the file (`named`)."""

    def __init__(self, host, path, project=False, named=False):
        self.host, self.path = host, os.path.abspath(path)
        self.data = self.read()  # -write edits this, not a later write
        try:
            self.raw = parse(self.data)
        except CanonicalError as err:
            raise ConfigError(f"{host} configuration {path} is not usable JSON: "
                              f"{err.placed()}") from None
        if not isinstance(self.raw, dict):
            raise ConfigError(f"{host} configuration {path} is not a JSON object")
        # (where, servers, started): `where` keys a map's servers (a
        # name may be in two maps); folders[where]: where they run.
        self.maps = []
        self.folders = {host: project_directory(self.path)}
        if isinstance(self.raw.get("mcpServers"), dict):
            self.maps.append((host, self.raw["mcpServers"], named or not project))
        here = os.getcwd()
        projects = self.raw.get("projects", {})
        mine = projects.get(here) if isinstance(projects, dict) else None
        if isinstance(mine, dict) and isinstance(mine.get("mcpServers"), dict):
            where = f"{host} project {here}"
            self.maps.append((where, mine["mcpServers"], named))
            self.folders[where] = here

    def read(self):
        where = f"{self.host} configuration {self.path}"
        try:
            with open(self.path, "rb") as f:
                data = f.read(HOST_FILE_BYTES + 1)
        except OSError as err:
            raise ConfigError(f"{where} cannot be read: {err.strerror}") from None
        if len(data) > HOST_FILE_BYTES:
            raise ConfigError(f"{where} is larger than {HOST_FILE_BYTES >> 20} MiB; "
                              "name a smaller file with -from")
        return data

    def servers(self):
        return [(where, name, entry, started)
                for where, servers, started in self.maps
                for name, entry in servers.items()]

# What reaching a network may need of the host's environment: those set
# are proposed by name (never value) as a command server's inherit_env.
NETWORK_VARIABLES = (
    "SSL_CERT_FILE", "SSL_CERT_DIR", "NODE_EXTRA_CA_CERTS", "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE", "HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "NO_PROXY",
    "https_proxy", "http_proxy", "all_proxy", "no_proxy")

def project_directory(path):
    """The project of a `.mcp.json`; None for the user's own."""
    folder, name = os.path.split(path)
    if name == "mcp.json" and os.path.basename(folder) == ".cursor":
        folder = os.path.dirname(folder)
    elif name != ".mcp.json":
        return None
    if folder == os.path.expanduser("~"):
        return None
    return folder

def _strings_map(value):
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())

def server_from_host(entry):
    """(a host's entry as agentgate's, sans name, manifest, rules,
    ""), or (None, why it cannot be gated)."""
    if not isinstance(entry, dict):
        return None, "its entry is not an object"
    if entry.get("disabled") is True:
        return None, "the host has it disabled"
    if entry.get("type") == "sse":
        return None, "it uses the older SSE transport, which agentgate does not speak"
    if isinstance(entry.get("url"), str):
        server = {"url": entry["url"]}
        headers = entry.get("headers") or {}
        if not _strings_map(headers):
            return None, "its headers are not a map of names to strings"
        # Values move into the 0600 config, as env's do: a variable
        # made up for one would be set by nobody.
        if headers:
            server["headers"] = dict(headers)
        return server, ""
    command = entry.get("command")
    args = entry.get("args", [])
    if not isinstance(command, str) or not command:
        return None, "it has neither a command nor a url"
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        return None, "its args are not a list of strings"
    if is_the_gate([command, *args]):
        return None, "it is agentgate itself"
    server = {"command": [command, *args]}
    env = entry.get("env") or {}
    if not _strings_map(env):
        return None, "its env is not a map of names to strings"
    if env:
        server["env"] = [f"{k}={v}" for k, v in env.items()]
    if isinstance(entry.get("cwd"), str) and entry["cwd"]:
        server["cwd"] = entry["cwd"]
    return server, ""

def is_the_gate(argv):
    """Whether argv serves agentgate (not, say, the demo's server)."""
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
    """The rule a tool's hints suggest, deciding nothing until accepted. Destructive
    asks, not denies: DENIED every time teaches the model only to stop asking.
    Idempotent has no repeat window: the same write after a move is no duplicate."""
    hints = entry.get("annotations") or {}
    rule = {"side_effect": "remote_mutation"}
    if hints.get("readOnlyHint") is True:
        rule["side_effect"] = "read_only"
    elif hints.get("destructiveHint") is True:
        rule = {"side_effect": "destructive", "outcome": "require_approval"}
    if hints.get("idempotentHint") is True and rule["side_effect"] != "read_only":
        rule["repeat_window"] = "0s"
    return {**rule, "proposed": True}

def config_text(raw):
    """A config with one line per rule: a server fits a screen."""
    return pretty_json(raw, flat=4) + "\n"

def init_plans(opts, path):
    """(config, session, hold, host files) of each config to write."""
    given = getattr(opts, "from")
    if given:
        return [(path, "default", None, [HostFile("host", given, named=True)])]
    files = host_config_files()
    if not files:
        raise ConfigError(
            "no host configuration was found (Claude Desktop, Claude Code, "
            "Cursor); name one with -from FILE")
    plans = []
    folder = os.path.dirname(path)
    for host, (name, hold) in HOSTS.items():
        mine = [f for f in files if f.host.removesuffix(" project") == host]
        if mine:
            plans.append((os.path.join(folder, f"{name}.json"), name, hold, mine))
    return plans

def cmd_init(argv):
    opts = parser("init", "from", "config", ("write", bool)).parse_args(argv)
    path = os.path.abspath(config_path(opts.config))
    plans = init_plans(opts, path)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    default = os.path.abspath(config_path(None))
    becomes_default = not os.path.lexists(path) and path == default
    hosts = host_configs(path)
    for file in [file for plan in plans for file in plan[3]]:
        tell(f"read {file.host} configuration {file.path}: "
             f"{len(file.servers())} server(s)")
    needs, done = set(), []
    for config_file, session, hold, files in plans:
        gated, left = init_host(config_file, session, hold, files, needs)
        for where, given, why in left:
            tell(f"not gated, left in {where} as it is: {given}: {why}")
        if os.path.lexists(config_file):
            done.append((config_file, files, gated))
    if needs:
        tell(f"To gate the rest, init needs {needs_text(needs)}; then run "
             "init again: it adds them, and changes nothing else.")
    if not done:
        raise ConfigError("no server could be gated, so no config was written")
    if becomes_default and os.path.lexists(path):
        names = ", ".join(map(os.path.basename, hosts))
        tell(f"{path} is the default config: a command or gate given no "
             "-config reads it now"
             + (f", and no longer each host's ({names}): name those with "
                "-config" if hosts else ""))
    tell_what_is_left(done)
    entries = {config_file: {"command": python_path(), "args": [
        os.path.abspath(sys.argv[0]), "-config", config_file]}
        for config_file, _, _ in done}
    if opts.write:
        changed = write_hosts(done, entries)
        if not changed:
            return 0
    for config_file, files, gated in done:
        tell_host_entry(files, gated, entries[config_file])
    if opts.write:
        raise ConfigError(
            f"{changed.host} configuration {changed.path} changed while init "
            "ran, so no host's file was edited: put the entry above in by hand")
    return 0

def tell_what_is_left(done):
    """What is left to do: run again, init repeats none of the rest."""
    proposing = [config_file for config_file, _, _ in done if any(
        rule.proposed for server in load_config(config_file).servers
        for rule in server.rules.values())]
    if proposing:
        tell("Every rule init proposed is a proposal, and nothing is offered "
             "until you have read them, changed what you disagree with, and "
             "run:")
    elif not any(gated for _, _, gated in done):
        tell("Nothing is left to do: every rule is accepted, and each host "
             "starts the gate.")
    for config_file in proposing:
        tell(f"    {operator_hint(config_file)} check -accept")
        try:
            check_reach(load_config(config_file))
        except ConfigError as err:
            tell(f"      before serving, fix this: {err}")

def write_hosts(done, entries):
    """Put each entry in its hosts' files, or return the first file
    changed since init read it, and write none."""
    edits = []
    for config_file, files, gated in done:
        for file in files:
            taken = {(where, given) for where, given, _, _ in file.servers()
                     if (file.path, where, given) in gated}
            if taken:
                edits.append((file, taken, entries[config_file]))
    # A file its host wrote while init pinned is left to it. (A write
    # between this read and the rename is lost: one write's window.)
    for file, _, _ in edits:
        if file.read() != file.data:
            return file
    for file, taken, entry in edits:
        written, backup = replace_in_host(file, taken, entry)
        tell(f"wrote {written}; it was kept as {backup}")
    return None

def tell_host_entry(files, gated, entry):
    sources = [f.path for f in files if any(key[0] == f.path for key in gated)]
    if not sources:
        tell(f"nothing of {' or '.join(f.path for f in files)} was gated, so "
             "it stays as it is")
        return
    tell(f"Then replace the gated servers in {' and '.join(sources)} with "
         "this one entry (or run init with -write to have it done, keeping a "
         "backup):")
    tell_json({"mcpServers": {HOST_ENTRY_NAME: entry}})
    add = f"{HOST_ENTRY_NAME} -- {shlex.join([entry['command'], *entry['args']])}"
    if any(f.host.startswith("Claude Code") for f in files):
        tell(f"    or: claude mcp add -s user {add}")
    if any(map(project_directory, sources)):
        tell("    A project's file may be shared, and this entry names files "
             "of your own: keep it out of a commit (claude mcp add -s local "
             f"{add} keeps it to you in Claude Code)")

def gate_host_servers(path, session, files, known, needs):
    """(servers new to the config at `path`, gated: (file, map, name)
    -> the server gating it, left: (map, name, why))."""
    taken = {s.get("name") for s in known}
    known = [definition(s) for s in known]
    servers, gated, left = [], {}, []
    inherited = [name for name in NETWORK_VARIABLES if name in os.environ]
    for file in files:
        for where, given, entry, started in file.servers():
            key = (file.path, where, given)
            server, why = server_from_host(entry)
            if not started:
                why = project_server_text(file, server, why)
            if not started or server is None:
                left.append((where, given, why))
                continue
            folder = file.folders.get(where)
            if folder and "command" in server:
                cwd = os.path.join(folder, server.get("cwd", "."))
                server["cwd"] = os.path.normpath(cwd)
            if inherited and "command" in server:
                server["inherit_env"] = list(inherited)
            same = next((s for s in servers if definition(s) == definition(server)), None)
            if same or definition(server) in known:
                gated[key] = same or server  # the same, gated once
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
            gated[key] = server
    return servers, gated, left

def init_host(path, session, hold, files, needs):
    """Write the config at `path` with its host's servers, or add those
    new since, every other byte as it was (a person's edits are theirs).
    What a server needs first goes to `needs`. Returns (gated, left)."""
    text = read_owned(path, "config").decode("utf-8") if os.path.lexists(path) else ""
    try:
        existing = parse(text)["servers"] if text else []
        known = [s for s in existing if isinstance(s, dict)]
    except (CanonicalError, KeyError, TypeError):
        raise ConfigError(
            f"config {path} has no list of servers that init can add to; fix "
            "it, or name another with -config") from None
    servers, gated, left = gate_host_servers(path, session, files, known, needs)
    pinned = []
    for server in servers:
        command = server.get("command") or [""]
        if os.path.basename(command[0]) == "npx" and {"-y", "--yes"} & set(command):
            tell(f"server {server['name']}: npx may download its package "
                 "before the server starts, which can take a minute", flush=True)
        try:
            manifest = pin(Server(server, f"server {quote(server['name'])}", path,
                                  read_transport))
        except (UpstreamError, LoadError, ConfigError) as err:
            if LOGIN_NEEDED in str(err):
                server["rules"] = {}  # written, so login finds it
                pinned.append((server, None))
                continue
            for key, gating in list(gated.items()):
                if gating is server:
                    gated.pop(key)
                    left.append((*key[1:], f"it could not be pinned: {err}"))
            continue
        server["rules"] = {tool: proposed_rule(entry)
                           for tool, entry in manifest["tools"].items()}
        pinned.append((server, manifest))
    if not pinned:
        if text:
            tell(f"{path}: no server is new in "
                 f"{' or '.join(f.path for f in files)}; nothing was added")
        return gated, left
    added = [server for server, _ in pinned]
    if text:
        write_private(path, servers_appended(text, added))
    else:
        raw = {"database": SHARED_DATABASE, "session": session, "servers": added}
        if hold:
            raw["hold"] = hold
        write_private(path, config_text(raw))
    policy = parse(text).get("policy") or {} if text else {}
    tell_pinned(path, pinned, {**DEFAULT_POLICY, **policy})
    tell(f"{'added to' if text else 'wrote'} {path} (0600): "
         f"{', '.join(server['name'] for server in added)}")
    inheriting = [s for s in added if "inherit_env" in s]
    if inheriting:
        names = ", ".join(s["name"] for s in inheriting)
        variables = ", ".join(inheriting[0]["inherit_env"])
        tell(f"  {names} inherit {variables} from the gate's environment, as "
             "the host passes them (inherit_env)")
    return gated, left

def tell_pinned(path, pinned, policy):
    for server, manifest in pinned:
        name = server["name"]
        if manifest is None:
            tell(f"server {name} asks for OAuth; it is not served until you "
                 f"run: {operator_hint(path)} login {name}, then pin, and "
                 "classify its tools")
            continue
        tell(f"server {name}: {len(manifest['tools'])} tool(s) pinned; "
             "proposed from the server's own hints (class, then what the "
             "policy would decide):")
        for tool, entry in manifest["tools"].items():
            rule = server["rules"][tool]
            side = rule["side_effect"]
            decided = rule.get("outcome") or policy[side]
            tell(f"  {sanitize(tool):<28} {side:<16} {decided:<17} "
                 f"({hints_text(entry)})")

def definition(server):
    """What makes a server the one it is, as a host gives it."""
    keys = ("command", "url", "headers", "env", "cwd")
    return {k: server[k] for k in keys if k in server}

def needs_of(server):
    """The variables a url server's headers name that are unset."""
    headers = server.get("headers", {}).values()
    return {("variable", name) for value in headers
            for name in ENV_REFERENCE_RE.findall(value)
            if name not in os.environ}

def needs_text(needs):
    variables = sorted(name for _, name in needs)
    plural = "s" * (len(variables) > 1)
    return (f"the environment variable{plural} {', '.join(variables)} set "
            "where agentgate runs")

def servers_appended(text, servers):
    """A parsed config's text with `servers` appended to its list."""
    decoder, space = json.JSONDecoder(), re.compile(r"\s*")

    def past(at):  # past the ':' or ',' after `at`
        return space.match(text, space.match(text, at).end() + 1).end()
    at = space.match(text, text.index("{") + 1).end()
    while True:
        key, at = json.decoder.scanstring(text, at + 1)
        _, end = decoder.raw_decode(text, past(at))
        if key == "servers":
            break
        at = past(end)
    last = len(text[:end - 1].rstrip())  # end of the last server
    added = "".join(",\n    " + pretty_json(server, level=2, flat=4)
                    for server in servers)
    return text[:last] + added + text[last:]

def host_configs(default):
    """Init's configs, one per host, if there is no default one: a
    command given no -config works on each."""
    if os.path.lexists(default):
        return []
    folder = os.path.dirname(os.path.abspath(default))
    paths = [os.path.join(folder, f"{name}.json") for name, _ in HOSTS.values()]
    return [p for p in paths if os.path.lexists(p)]

def one_config(given):
    """The one config a command reads; where there are only init's,
    one per host, the error names them."""
    path = config_path(given)
    hosts = [] if given else host_configs(path)
    if hosts:
        names = ", ".join(map(shlex.quote, hosts))
        raise ConfigError(
            f"there is no {path}, and init wrote one config per host: name "
            f"one with -config ({names}); the entry init printed for a host "
            "names its own")
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
    return ("a project's server is started only when init is given -from "
            f"{shlex.quote(file.path)}; {runs}")

def replace_in_host(file, taken, entry):
    """Replace the servers `taken` ((map, name)) in a host's file by
    the entry gating them, after a backup as read beside it (a link is
    written where it leads). Returns the paths written and backed up."""
    backup = f"{file.path}.agentgate-backup"
    n = 1
    while os.path.lexists(backup):
        n += 1
        backup = f"{file.path}.agentgate-backup-{n}"
    write_private(backup, file.data.decode("utf-8", "surrogateescape"))
    for where, servers, _ in file.maps:
        for place, given in taken:
            if place == where:
                servers.pop(given)
    target = file.maps[0][1] if file.maps else file.raw.setdefault("mcpServers", {})
    if entry not in target.values():  # not there from a run before
        target[server_name(HOST_ENTRY_NAME, set(target))] = entry
    written = os.path.realpath(file.path)
    mode = stat.S_IMODE(os.stat(written).st_mode)
    write_private(written, pretty_json(file.raw, ordered=True) + "\n")
    os.chmod(written, mode)
    return written, backup

def accept_proposals(path, agreed):
    """Accept the proposed rules once read and agreed to (yes or
    -yes); False when nothing was accepted for want of it."""
    config = load_config(path)  # refused as it is, unchanged
    raw = parse(read_owned(path, "config"))
    accepted = []
    for server, given in zip(config.servers, raw["servers"]):
        for tool, rule in given.get("rules", {}).items():
            if rule.pop("proposed", False):
                would = settings_text(config, server.rules[tool])
                accepted.append(f"  {server.name}/{tool} ({rule['side_effect']}): would "
                                f"{would}")
    if not accepted:
        tell("no proposed rule to accept")
        return True
    what = f"these {len(accepted)} proposed rule(s)"
    head = f"{what}, each as it would decide once accepted:"
    no_yes = ("refusing to accept without -yes or a terminal to type yes at: "
              "nothing was accepted; add -yes to accept the rules printed "
              "above")
    if not confirmed([head, *accepted], sys.stdout, False, what, "accept", agreed,
                     no_yes):
        tell("nothing accepted")
        return False
    write_private(path, config_text(raw))
    tell(f"accepted {len(accepted)} proposed rule(s)")
    return True

# ---- login: OAuth with a url server ---------------------------------------------------------

LOGIN_WAIT_SECONDS = 600  # a person's time to consent
LOGIN_PAGE = (b"agentgate has the answer of the authorization; "
              b"this page may be closed.\n")
OAUTH_EXCHANGES = 20  # requests of one flow (discovery tries several)

@functools.lru_cache(maxsize=1)
def mcp_install_text():
    if python_path() != sys.executable:
        return f"{VENV}/bin/python has it: run agentgate with that"
    made = ""
    if not os.path.isdir(os.path.expanduser(VENV)):
        made = f"python3 -m venv {VENV} && "
    return (f"{python_command()} -m pip install --upgrade mcp, or where pip "
            "refuses to install into the system's Python: "
            f"{made}{VENV}/bin/pip install mcp, and run agentgate with "
            f"{VENV}/bin/python")

def mcp_sdk(server):
    """OAuth pieces of the mcp package (2 or later), or ConfigError on how to get it."""
    try:
        import mcp.client.streamable_http as transport
        import mcp.client.session as session
        import mcp.client.auth as auth
        import mcp.shared.auth as records
        import httpx2
        import asyncio
        import logging
    except ImportError:
        raise ConfigError(
            f"login with server {quote(server.name)} needs the optional mcp "
            f"package, version 2 or later: {mcp_install_text()}") from None
    # The SDK logs what it survives, which would print tracebacks.
    for name in ("mcp", "httpx2"):
        logging.getLogger(name).addHandler(logging.NullHandler())
        logging.getLogger(name).propagate = False
    return {"client": transport.streamable_http_client, "session": session.ClientSession,
            "auth": auth, "records": records, "httpx": httpx2, "asyncio": asyncio}

class LoginStore:
    """The SDK's token storage in login; a pre-registered client (`oauth`) is given."""

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

LOGIN_TEXT = (
    "Authorize agentgate with a url server that asks for OAuth: the browser "
    "opens on the server's consent page (the address is printed too), the "
    "answer comes back to a port on 127.0.0.1 open only while this runs, and "
    "the tokens are kept 0600 beside the config (-config FILE, else "
    "$AGENTGATE_CONFIG, else the XDG path), as CONFIG.SERVER.tokens.json, for "
    "that config's server at that url only.")

def cmd_login(argv):
    p = parser("login", "config")
    p.description = LOGIN_TEXT
    p.add_argument("server", type=text_argument, help="the server's name in the config")
    opts = p.parse_args(argv)
    config = one_config(opts.config)
    server = next((s for s in config.servers if s.name == opts.server), None)
    if server is None or not server.url:
        names = ", ".join(s.name for s in config.servers if s.url) or "none"
        raise Usage(f"{quote(opts.server)} names no server reached by url in "
                    f"the config; those are: {sanitize(names)}")
    sdk = mcp_sdk(server)
    try:
        wanted = TokenFile(server).kept.get("wanted_scope")
    except ConfigError:
        wanted = ""  # what cannot be read is replaced
    file = TokenFile(server, fresh=True)
    store = LoginStore(sdk, file)
    run = sdk["asyncio"].to_thread
    with LoopbackRedirect() as redirect:

        async def ask(url):
            url = _with_scope(url, server.oauth.get("scope"), wanted)
            tell("Open this address to authorize agentgate with server "
                 f"{server.name} (a browser is being opened on it):", f"  {url}", flush=True)
            await run(_open_browser, url)

        async def redirected():
            return await run(redirect.answer, sdk)

        metadata = sdk["records"].OAuthClientMetadata(
            client_name=PROGRAM, redirect_uris=[redirect.uri])
        client = sdk["auth"].OAuthClientProvider(
            server.url, metadata, store, ask, redirected)
        try:
            sdk["asyncio"].run(_initialize_with(sdk, server, client))
        except BaseException as err:
            while isinstance(err, BaseExceptionGroup):  # task groups
                err = err.exceptions[0]
            if isinstance(err, (KeyboardInterrupt, Usage, UpstreamError)):
                raise err from None
            why = clean(str(err), 500) or type(err).__name__
            raise UpstreamError(f"login with server {quote(server.name)} "
                                f"failed: {why}") from None
    if store.tokens is None:
        tell(f"server {server.name} asked for no authorization; nothing was kept")
        return 0
    keep_discovered(file, client.context, store.client)
    file.obtained(store.tokens.model_dump(mode="json", exclude_none=True))
    tell(f"agentgate is authorized with server {server.name}; its tokens are "
         f"kept in {server.tokens} (0600), and refreshed as they expire")
    return 0

def keep_discovered(file, context, client):
    """Keep where tokens are refreshed: the metadata's endpoint, else
    (protocol 2025-03-26) the origin's /token."""
    from urllib.parse import urljoin
    metadata = context.oauth_metadata
    origin = context.get_authorization_base_url(file.server.url)
    kept = file.kept
    kept["issuer"] = str(metadata.issuer) if metadata else origin
    if metadata and metadata.token_endpoint:
        kept["token_endpoint"] = str(metadata.token_endpoint)
    else:
        kept["token_endpoint"] = urljoin(origin, "/token")
    if context.should_include_resource_param(context.protocol_version):
        kept["resource"] = context.get_resource_url()
    if client:
        kept["client"] = client.model_dump(mode="json", exclude_none=True)

async def _initialize_with(sdk, server, client):
    """A session through the OAuth client: consent on the first 401."""
    httpx = sdk["httpx"]
    timeout = httpx.Timeout(server.connect_timeout / SECOND)
    async with httpx.AsyncClient(
            auth=client, headers=server.headers, timeout=timeout,
            max_redirects=OAUTH_EXCHANGES) as http, \
            sdk["client"](server.url, http_client=http) as (
                reader, writer), \
            sdk["session"](reader, writer) as session:
        await session.initialize()
        # Some servers ask for authorization on the next request.
        await session.list_tools()

def _with_scope(url, configured, wanted):
    """The address asking for `oauth.scope` over the client's choice
    (a pre-registered client knows its scope), and for what the server
    refused a call for since the last login (a step-up)."""
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
    with contextlib.suppress(Exception):  # the address is printed
        webbrowser.open(url)

class LoopbackRedirect:
    """A port on 127.0.0.1 while login runs, for the browser's answer
    (RFC 8252's loopback redirect). Nothing it receives is printed."""

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
                query = parse_qs(parts.query)
                answers.put({k: v[0] for k, v in query.items()})
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(LOGIN_PAGE)))
                self.end_headers()
                self.wfile.write(LOGIN_PAGE)

            def log_message(self, *args):
                pass  # the query carries the code

        # A thread a connection: an idle one holds nobody up.
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        port = self.server.server_address[1]
        self.uri = f"http://127.0.0.1:{port}/callback"

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
            wait = format_duration(LOGIN_WAIT_SECONDS * SECOND)
            raise UpstreamError("no answer came from the browser within "
                                f"{wait}") from None
        if "error" in got:
            more = ""
            if "error_description" in got:
                more = f" ({clean(got['error_description'], 300)})"
            raise UpstreamError("the authorization was refused: "
                                f"{clean(got['error'], 100)}{more}")
        return sdk["auth"].AuthorizationCodeResult(
            code=got.get("code", ""), state=got.get("state"), iss=got.get("iss"))


# =============================================================================================
# 32. Pin and check
#
# Reads as: around the core
#
# Owns: `pin`, `pin -diff` and `check`: what a server presents now against its pin,
# and each server's and tool's standing. Core it calls: check_database_path, Store,
# lint_hash, confirmed, check_reach; section 22's load_config,
# load_all, read_manifest, write_private, tool_changes; lint_lines (21).
# Promises: pin prints the texts a tool is classified from whole; pin -diff changes
# a manifest only after a yes; check exits 1 while anything is refused, unreviewed
# or unserved.
# =============================================================================================

def cmd_pin(argv):
    p = parser("pin", "config", ("diff", bool), ("all", bool), ("yes", bool))
    p.add_argument("-tool", "--tool", action="append", type=text_argument, default=[],
                   metavar=FLAG_VALUE["tool"], help=FLAG_HELP["pin -tool"])
    opts = p.parse_args(argv)
    hosts = [] if opts.config else host_configs(config_path(None))
    if hosts:
        return each_config(cmd_pin, argv, hosts)
    config = load_config(config_path(opts.config))
    if opts.diff:
        return pin_diff(config, opts.tool, opts.all, opts.yes)
    if opts.tool or opts.all:
        raise Usage("-tool and -all choose what pin -diff pins again; give -diff too")
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
                     f"{server.manifest}, with the server's own hints, which "
                     f"classify nothing:")
        for name, entry in tools.items():
            lines += pinned_lines(name, entry, findings[server.name][name])
    lines.append("Classify each tool you want offered with a rule (side_effect), "
                 "then run check. The lint finds the tricks known to hide "
                 "instructions in a tool's texts, not all of them.")
    confirmed(lines, sys.stdout)
    return 0

def pinned_lines(name, entry, found):
    """A tool as classified: its whole description (the model reads it all), linted."""
    description = " ".join(entry["description"].split())
    lines = [f"  {sanitize(name):<28} {hints_text(entry):<26} {description}"]
    lines += [f"  {line}" for line in lint_lines(found)]
    if any(severity == LINT_HIGH for severity, _, _ in found):
        lines.append(f"    the whole text the model would read of {name} "
                     f"(accepted_description {lint_hash(entry)}):")
        lines += [f"      {where}: {text}" for where, text in lint_texts(entry)]
    return lines

def pin_diff(config, named, everything, agreed):
    """Print each server's differences from its pin; pin again those named (server/tool,
    or tool), or all once confirmed. A serving gate keeps what it loaded."""
    manifests, lives = {}, {}
    for server in config.servers:
        manifests[server.name] = read_manifest(server)
        try:
            lives[server.name] = presented(server)
        except UpstreamError as err:
            raise LoadError(str(err)) from None
    findings = lint_manifests({name: {"tools": live} for name, live in lives.items()})
    differences, lines = {}, []
    for server in config.servers:
        changes = tool_changes(manifests[server.name]["tools"], lives[server.name])
        differ = f"{len(changes)} tool(s) differ from {server.manifest}"
        lines.append(f"server {server.name}: " + (differ if changes else "as pinned"))
        for tool, (kind, old, new) in changes.items():
            differences[(server.name, tool)] = (kind, new)
            lines += change_text(kind, tool, old, new, findings[server.name].get(tool))
    chosen = set(differences) if everything else set()
    chosen |= {chosen_difference(differences, given) for given in named}
    if not (everything and chosen):
        confirmed(lines, sys.stdout)
    elif not confirmed(lines, sys.stdout, False, "every difference above", "pin", agreed,
                       "refusing to pin every difference again without -yes or an "
                       "interactive terminal"):
        tell("nothing pinned")
        return 1
    if not chosen:
        return 0
    for server in config.servers:
        mine = sorted(tool for name, tool in chosen if name == server.name)
        if mine:
            pin_again(server, manifests[server.name], mine,
                      [differences[(server.name, tool)] for tool in mine])
    tell("A gate that is serving keeps the tools it loaded; restart it (restart "
         "its host) to offer what was pinned again, after check.")
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
    matches = [key for key in differences if key[1] == tool and server in ("", key[0])]
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
    opts = parser("check", "config", ("accept", bool), ("yes", bool)).parse_args(argv)
    hosts = [] if opts.config else host_configs(config_path(None))
    if hosts:
        return each_config(cmd_check, argv, hosts)
    if opts.yes and not opts.accept:
        raise Usage("-yes goes with -accept: it accepts the proposed rules unasked")
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
        print_tool_changes(Ledger(config.database, readonly=True, create=False),
                           config.session)
    holds = "".join(f", {sanitize(h)} {format_duration(t)}"
                    for h, t in config.host_holds.items())
    notify = shlex.join(config.notify) if config.notify else "nothing is run"
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
    return 1 if problems or any(report.unserved for report in reports) else 0

def load_warnings(reports):
    """The report lines a starting gate logs: what is amiss, why a server is not served.
    An offered tool's lines are check's: fifty would bury the approvals in the log."""
    lines = []
    for report in reports:
        for line in report.lines:
            # Left to check: a registered tool's line and its rule lines
            # (indented); a lint line is indented too, and kept.
            said = line[len(sanitize(report.server)) + 2:]
            lint = said.lstrip().startswith("lint ")
            if not said.startswith("registered ") and (not said.startswith("  ") or lint):
                lines.append(line)
        if report.unserved:
            lines.append(f"not served: {report.unserved}")
    return lines


# =============================================================================================
# 33. Fake payment server
#
# Reads as: around the core
#
# Owns: `fake-payments`, the stdio MCP server the demo and example.json put behind
# the gate. Each payment is appended, as its arguments, to the file
# FAKE_PAYMENTS_LEDGER names (if set), synced before the answer is sent: the ledger's
# lines count the payments made. `pay` with mode "block" never answers. The tests'
# modes are in tests/fake_modes.py.
# Core it calls: nothing: it is a server of its own.
# =============================================================================================

def _fake_schema(required, **properties):
    return {"type": "object", "additionalProperties": False,
            "required": required, "properties": properties}

_TEXT = {"type": "string"}
FAKE_TOOLS = [
    {"name": "balance", "description": "Read the balance of an account.",
     "inputSchema": _fake_schema(["account"], account=_TEXT),
     "annotations": {"readOnlyHint": True}},
    {"name": "pay", "description": "Pay an amount to someone.",
     "inputSchema": _fake_schema(["to", "amount"], to=_TEXT, amount={"type": "number"},
                                 currency=_TEXT, mode={"enum": ["block"]}),
     "annotations": {"destructiveHint": False}},
    {"name": "refund", "description": "Refund a payment.",
     "inputSchema": _fake_schema(["payment"], payment=_TEXT)},
]

def fake_pay(ledger, args):
    if ledger:
        with open(ledger, "a", encoding="utf-8") as f:
            f.write(json.dumps(args, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
    if args.get("mode") == "block":
        threading.Event().wait()
    amount = float(args.get("amount", 0))
    return f"paid {amount:.2f} to {args.get('to')}"

def fake_payments():
    ledger = os.environ.get("FAKE_PAYMENTS_LEDGER")
    lock = threading.Lock()

    def send(ident, key, value):
        line = json.dumps({"jsonrpc": "2.0", "id": ident, key: value})
        with lock:
            sys.stdout.buffer.write(line.encode() + b"\n")
            sys.stdout.buffer.flush()
    def call(ident, params):
        name = params.get("name")
        args = params.get("arguments") or {}
        if name == "pay":
            text = fake_pay(ledger, args)
        elif name == "balance":
            text = f"account {args.get('account')} holds 120.00 EUR"
        elif name == "refund":
            text = "refunded"
        else:
            return send(ident, "error", {"code": -32602, "message": f"no tool {name}"})
        send(ident, "result", {"content": [{"type": "text", "text": text}]})

    for line in sys.stdin.buffer:
        try:
            message = json.loads(line)
        except ValueError:
            continue
        method = message.get("method")
        ident = message.get("id")
        params = message.get("params") or {}
        if method == "tools/call":
            # A thread a call: a blocked payment holds up no other; end of input ends all.
            threading.Thread(target=call, args=(ident, params), daemon=True).start()
        elif method == "initialize":
            version = params.get("protocolVersion", "2025-06-18")
            send(ident, "result", {
                "protocolVersion": version, "capabilities": {"tools": {}},
                "serverInfo": {"name": "fake-payments", "version": "1.0.0"}})
        elif method == "tools/list":
            send(ident, "result", {"tools": FAKE_TOOLS})
        elif method == "ping":
            send(ident, "result", {})
        elif ident is not None:
            send(ident, "error", {"code": -32601, "message": "method not found"})
    return 0


# =============================================================================================
# 34. Demonstration
#
# Reads as: around the core
#
# Owns: `agentgate.py demo`, a scripted session with no model, no network and nothing
# installed. This process plays the host; the gate, the fake payment server and the
# operator run as processes of their own in a temporary directory, as for a person.
# Promises: each step shows what the model sees; the demo exits 1 if a step did not
# behave as narrated, and ends once every process it started has exited.
# Core it calls: nothing: it writes with write_private and runs agentgate's commands.
# =============================================================================================

class DemoFailure(Exception):
    """A step did not behave as narrated."""

DEMO_HELLO = {"protocolVersion": PROTOCOL_VERSIONS[-1], "capabilities": {},
              "clientInfo": {"name": "demo-host", "version": "1"}}

class LineClient:
    """JSON-RPC over a child process's stdin and stdout."""
    def __init__(self, argv, cwd, env, stderr):
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stderr=stderr,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
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
        message = {"jsonrpc": "2.0", "id": self.next_id, "method": method,
                   "params": params}
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()
        return self.next_id
    def request(self, method, params, timeout=60):
        ident = self.send(method, params)
        while True:
            try:
                got = self.answers.get(timeout=timeout)
            except queue.Empty:
                raise DemoFailure(f"no answer to {method} within {timeout}s") from None
            if got is None:
                raise DemoFailure(f"the process exited before answering {method}")
            if got.get("id") != ident:
                continue
            if "error" in got:
                raise DemoFailure(f"{method} failed: {got['error'].get('message')}")
            return got["result"]
    def call(self, tool, args):
        result = self.request("tools/call", {"name": tool, "arguments": args})
        return result["content"][0]["text"], bool(result.get("isError"))
    def close(self):
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

class Narrator:
    def __init__(self, out):
        self.out = out
        color = out.isatty() and not os.environ.get("NO_COLOR")
        self.bold = "\033[1m%s\033[0m" if color else "%s"
    def step(self, title):
        self.out.write("\n" + self.bold % title + "\n")
        self.out.flush()
    def say(self, text):
        tell(f"  {text}", out=self.out, flush=True)
    def sees(self, text, is_error):
        label = "model sees (isError)" if is_error else "model sees"
        first = text.split("\n")[0].split(". ")[0]
        self.say(f"{label}: {cut(first, 76 - len(label))}")

def expect(text, prefix):
    if not text.startswith(prefix):
        raise DemoFailure(f"expected an answer starting {prefix!r}, got {text[:120]!r}")

def cmd_demo(argv):
    parser("demo").parse_args(argv)
    narrator = Narrator(sys.stdout)
    with tempfile.TemporaryDirectory(prefix="agentgate-demo-") as folder:
        try:
            run_demo(folder, narrator)
        except DemoFailure as err:
            narrator.say(f"DEMO FAILED: {err}")
            return 1
    return 0

def demo_config(folder, me):
    ledger = os.path.join(folder, "ledger")
    rules = {"balance": {"side_effect": "read_only", "timeout": "5s"},
             "pay": {"side_effect": "remote_mutation", "timeout": "30s"}}
    bank = {"name": "bank", "command": [sys.executable, me, "fake-payments"],
            "env": [f"FAKE_PAYMENTS_LEDGER={ledger}"],
            "manifest": "bank.manifest.json", "rules": rules}
    config = {"database": "demo.db", "session": "demo", "hold": "0s",
              "lease_ttl": "3s", "servers": [bank]}
    path = os.path.join(folder, "agentgate.json")
    write_private(path, json.dumps(config, indent=2))
    return path, ledger

def payments(path):
    """The lines of a fake server's ledger."""
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as f:
        return len(f.read().splitlines())

def run_demo(folder, narrator):
    me = os.path.abspath(__file__)
    config, ledger = demo_config(folder, me)
    log_path = os.path.join(folder, "gate.log")
    env = dict(os.environ)
    env.pop("AGENTGATE_CONFIG", None)
    started = []

    def start(argv, stderr, extra=None):
        client = LineClient(argv, folder, {**env, **(extra or {})}, stderr)
        started.append(client.proc)
        client.request("initialize", DEMO_HELLO)
        return client
    def gate():
        with open(log_path, "ab") as log_file:
            return start([sys.executable, me, "-config", config], log_file)
    def run(*args):
        argv = [sys.executable, me, *args, "-config", config]
        return subprocess.run(argv, cwd=folder, env=env, timeout=60,
                              capture_output=True, text=True)
    def operator(verb, note):
        with open(log_path, encoding="utf-8") as f:
            found = re.findall(r"approve (\S+) -approval ([0-9a-f]+)", f.read())
        if not found:
            raise DemoFailure("the gate named no approval")
        run_id, approval = found[-1]
        done = run(verb, run_id, "-approval", approval, "-note", note, "-by", "operator")
        if done.returncode != 0:
            raise DemoFailure(f"the operator's {verb} failed: {done.stderr.strip()}")
        narrator.say(f"operator: {verb} …{approval[-8:]}, {note!r}")
    def see(tool, args, prefix):
        text, is_error = host.call(tool, args)
        narrator.sees(text, is_error)
        expect(text, prefix)

    host = None
    try:
        narrator.step("0. Pin the server: a read runs, a payment asks an operator")
        pinned = run("pin")
        if pinned.returncode != 0:
            raise DemoFailure(f"pin failed: {pinned.stderr.strip()}")
        host = gate()
        narrator.step("1. A read runs at once")
        see("bank_balance", {"account": "household"}, "account household holds")
        narrator.step("2. A payment waits for an operator")
        rent = {"to": "landlord", "amount": 950}
        see("bank_pay", rent, "PENDING_APPROVAL")
        operator("approve", "rent for October")
        see("bank_pay", rent, "paid 950.00 to landlord")
        narrator.step("3. A payment cut off by a crash is not run again")
        repair = {"to": "plumber", "amount": 180, "mode": "block"}
        expect(host.call("bank_pay", repair)[0], "PENDING_APPROVAL")
        operator("approve", "the boiler repair")
        before = payments(ledger)
        host.send("tools/call", {"name": "bank_pay", "arguments": repair})
        deadline = time.monotonic() + 30
        while payments(ledger) == before:
            if time.monotonic() > deadline:
                raise DemoFailure("the payment never reached the server")
            time.sleep(0.02)
        host.proc.kill()
        host.proc.wait()
        narrator.say("the gate is killed inside the payment, and started again")
        host = gate()
        deadline = time.monotonic() + 30
        text = "IN_PROGRESS"  # till the dead gate's lease expires
        while text.startswith("IN_PROGRESS") and time.monotonic() < deadline:
            time.sleep(0.25)
            text, is_error = host.call("bank_pay", repair)
        narrator.sees(text, is_error)
        expect(text, "INTERRUPTED")
        see("gate_status", {}, "GATE_STATUS")
        operator("reject", "it went through; do not pay twice")
        see("bank_pay", repair, "REJECTED")
        narrator.step("4. A retry of a lost answer pays once")
        groceries = {"to": "grocer", "amount": 42}
        host.call("bank_pay", groceries)
        operator("approve", "groceries")
        see("bank_pay", groceries, "paid 42.00 to grocer")
        see("bank_pay", groceries, "DUPLICATE")
        with open(ledger, encoding="utf-8") as f:
            through = f.read().count("grocer")
        alone = os.path.join(folder, "straight-ledger")
        server = start([sys.executable, me, "fake-payments"], subprocess.DEVNULL,
                       {"FAKE_PAYMENTS_LEDGER": alone})
        server.call("pay", groceries)
        server.call("pay", groceries)
        server.close()
        straight = payments(alone)
        narrator.say(f"through the gate the server made {through} "
                     f"payment{'s' * (through != 1)}")
        narrator.say(f"without the gate the server made {straight} payments")
        if (through, straight) != (1, 2):
            raise DemoFailure("the payments are not 1 and 2")
        host.close()
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        _reap(folder)
    narrator.step("Done")
    narrator.say("every process the demo started has exited")

def _reap(folder):
    """Wait till no process whose environment names the folder is left (a killed
    gate's server dies with it on Linux; elsewhere once its input closes)."""
    deadline = time.monotonic() + 10
    while _mentioning(folder.encode()):
        if time.monotonic() > deadline:
            raise DemoFailure("a process the demo started is still running")
        time.sleep(0.05)

def _mentioning(mark):
    found = []
    if not os.path.isdir("/proc"):
        return found
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found


# =============================================================================================
# 35. Main
#
# Reads as: around the core
#
# Owns: the command line and `serve`, which puts the sections together: the config,
# the store, the upstreams, the gate, the host side and the seams around them. Exit
# codes: 0 ok, 1 failure, 2 usage. No traceback reaches a user: an expected failure
# is one sentence on stderr. Core it calls: Store (opened as section 23's Ledger),
# Gate, HostServer, and the seams: the gate's `announce` and `duplicate` (section
# 27's announce_waiting and duplicate_refused) and the host's `around` and `status`
# (section 26's HostAround and StatusTool).
# =============================================================================================

class Shutdown(Exception):
    """SIGINT or SIGTERM before serving began."""

def cmd_serve(argv):
    opts = parser("serve", "config").parse_args(argv)
    config = serving_config(opts.config)
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
    upstreams, gate = [], None
    # The database opens while the servers start.
    opened = []
    opener = threading.Thread(daemon=True, target=lambda: (
        opened.append(_open_store(config.database))))
    try:
        # Nothing starts until a request needs it: a host may probe with
        # server/discover from a process it ends at once.
        while not (host.wanted.wait(0.5) or host.done.is_set()):
            pass
        if not host.wanted.is_set():
            return 0
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
        notifier = config.notify and Notifier(config.notify)
        gate.announce = announce_waiting(config, notifier)
        gate.duplicate = duplicate_refused(config)
        ToolWatch(gate, upstreams, functools.partial(around.tools_changed, host))
        unserved = sum(bool(r.unserved) for r in reports)
        host.serve_with(gate, StatusTool(gate, config.status_tool, unserved))
        serving.append(True)
        names = ", ".join(sanitize(r.server) for r in reports)
        log(f"serving session {config.session} on database {config.database}: "
            f"{len(tools)} tool(s) from {len(reports)} server(s) ({names}); "
            f"check lists each tool")
        while not host.done.wait(1):
            pass
        # No new call starts, holds end, and calls in flight (a task's too)
        # finish and are recorded before their servers are closed.
        host.stopping = True
        gate.stopping.set()
        longest = max((t.timeout for t in tools), default=0)
        deadline = time.monotonic() + longest / SECOND + 5
        while (host.running or gate.driving) and time.monotonic() < deadline:
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

COMMANDS = {
    "serve": cmd_serve, "pin": cmd_pin, "check": cmd_check, "runs": cmd_runs,
    "show": cmd_show, "approve": cmd_approve, "reject": cmd_reject, "cancel": cmd_cancel,
    "watch": cmd_watch, "verify": cmd_verify, "recheck": cmd_recheck, "grant": cmd_grant,
    "grants": cmd_grants, "revoke": cmd_revoke, "init": cmd_init, "login": cmd_login,
    "demo": cmd_demo, "fake-payments": lambda argv: fake_payments()}

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    usage = USAGE.splitlines()
    if argv and argv[0] in ("-h", "--help", "help"):
        tell(*usage, out=sys.stderr)
        return 0
    if argv and argv[0] in ("-version", "--version"):
        tell(f"{PROGRAM} {VERSION}")
        return 0
    # `-config FILE approve ...` reads as written.
    if len(argv) > 2 and argv[2] in COMMANDS and argv[0].lstrip("-") in ("config", "db"):
        argv = [argv[2], *argv[:2], *argv[3:]]
    command, rest = "serve", argv
    if argv and not argv[0].startswith("-"):
        command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        tell(f"{PROGRAM}: unknown command {quote(command)}", *usage, out=sys.stderr)
        return 2
    try:
        return COMMANDS[command](rest)
    except Usage as err:
        tell(f"{PROGRAM}: {err}", out=sys.stderr)
        return 2
    except (ConfigError, LoadError, StoreError, UpstreamError) as err:
        tell(f"{PROGRAM}: error: {err}", out=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 1
    except BrokenPipeError:
        # The reader went away (`| head`): leave quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1

if __name__ == "__main__":
    sys.exit(main())
