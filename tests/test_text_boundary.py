"""One boundary for what a person reads, one table for what the model reads.

- Every line agentgate writes for a person goes through `tell` (a -json value through
  `tell_json`), which sanitizes each line whole; the live view of watch draws its rows through
  `Screen.put`, which sanitizes too. No other print or write reaches a terminal, except the
  listed ones, each with its reason. So "can an operator approve something unseen" is a
  question about those two functions.
- sanitize is idempotent: text a caller sanitized to measure or cut it is shown byte for byte,
  and ordinary text is written exactly as given.
- -json output stays valid JSON that reads back as the same values, with nothing in it a
  terminal would act on (a bidi override in an argument used to be printed raw).
- Every sentence of the gate's own that the model can read is in the Answers section's
  tables: no call that builds an answer outside it, and none of the status tool's functions,
  writes one.
- Behaviour, through real processes: an escape sequence or a bidi control a server, a model
  or an operator chose, in an argument, a result, a name, a note or a tool's description,
  reaches show, approve, watch, grants, pin and check only as visible text.
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import signal
import sys
from contextlib import suppress
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from kit import (  # noqa: E402
    DEADLINE,
    PAY,
    Bank,
    has_raw_controls,
    pin,
    check,
    scripted_server,
    tool,
    write_config,
    rule,
)
from test_watch import next_line, plain_watch  # noqa: E402 (watch's plain lines, as test_watch reads them)

SOURCE = Path(agentgate.__file__).read_text(encoding="utf-8")
TREE = ast.parse(SOURCE)
SOURCE_LINES = SOURCE.splitlines()

# What a hostile party puts in text: a terminal escape that clears the screen, a bell, a
# right-to-left override, a zero-width space, a C1 control and a run of combining marks.
HOSTILE = "x\x1b[2J\x07\u202eevil\u200b\x85e" + "\u0301" * 7
TWO_WORDS = re.compile(r"[A-Za-z]{2,} [A-Za-z]{2,}")


# ---------------------------------------------------------------- the source, read


def section(title: str) -> range:
    """The lines (1-based) of the section titled `title` in agentgate.py, banner to banner."""
    starts = [i + 1 for i, line in enumerate(SOURCE_LINES) if re.match(r"# \d+\. ", line)]
    titles = [SOURCE_LINES[i - 1].split(". ", 1)[1] for i in starts]
    k = titles.index(title)
    return range(starts[k], starts[k + 1] if k + 1 < len(starts) else len(SOURCE_LINES))


def defined() -> dict:
    """Every function and method of agentgate.py by its qualified name (Class.method)."""
    found = {}
    for node in TREE.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found[node.name] = node
        if isinstance(node, ast.ClassDef):
            for inner in node.body:
                if isinstance(inner, ast.FunctionDef):
                    found[f"{node.name}.{inner.name}"] = inner
    return found


def owner_of(lineno: int) -> str:
    """The innermost function (qualified) holding the line."""
    best, span = "", None
    for name, node in defined().items():
        if isinstance(node, ast.FunctionDef) and node.lineno <= lineno <= node.end_lineno:
            size = node.end_lineno - node.lineno
            if span is None or size < span:
                best, span = name, size
    return best


def dotted(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return "?"


def literals(node):
    """Every piece of literal text in an expression: strings, and the text of f-strings."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
            yield inner.value


# Writes that reach a stream a person may read, other than through tell, and why each may.
STREAMS = {"sys.stdout", "sys.stderr", "sys.stdout.buffer", "sys.stderr.buffer", "out",
           "self.out", "self.stdout", "self.stderr", "stdout", "stderr"}
ALLOWED_WRITES = {
    ("tell", "out.write"): "the boundary itself",
    ("HostServer.send", "self.stdout.write"): "JSON-RPC to the host, never read by a person",
    ("fake_payments", "sys.stdout.buffer.write"): "JSON-RPC to the gate that started the fake",
    ("Narrator.step", "self.out.write"): "the demo's own titles, in bold: the escapes are its own",
}


def test_every_line_for_a_person_goes_through_tell():
    prints, writes = [], set()
    for node in ast.walk(TREE):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name) and node.func.id == "print":
            prints.append(node.lineno)
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("write", "writelines") \
                and dotted(node.func.value) in STREAMS:
            writes.add((owner_of(node.lineno), dotted(node.func)))
    assert prints == [], f"print( at lines {prints}: use tell, which sanitizes every line"
    assert writes == set(ALLOWED_WRITES), sorted(writes ^ set(ALLOWED_WRITES))


def test_the_live_view_draws_only_sanitized_rows():
    drawn = [node for node in ast.walk(TREE) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr in ("addstr", "addch",
                                                                             "insstr", "addnstr")]
    assert [owner_of(node.lineno) for node in drawn] == ["Screen.put"]
    (call,) = drawn
    assert any(isinstance(n, ast.Call) and dotted(n.func) == "sanitize" for n in ast.walk(call))


# ---------------------------------------------------------------- the one table


# Where the model's sentences live (the Answers section), and the functions elsewhere that
# choose among them for an answer or the status tool.
MODEL_TABLES = ("PROSE", "SLOT_PROSE", "STATUS_PROSE", "STATUS_DESCRIPTION", "STATUS_ARGUMENT",
                "UNSERVED_NOTE", "NOT_EXECUTED_WHY", "HOW", "DUPLICATE_OUTCOME", "TOO_LARGE_THEN",
                "CALL_ERRORS")
CHOOSERS = ("status_answer", "describe_approval", "approved_fate", "waiting_answer",
            "refused_for", "too_large_answer")


def test_every_model_table_is_in_the_answers_section():
    answers = section("Answers")
    where = {target.id: node.lineno for node in TREE.body if isinstance(node, ast.Assign)
             for target in node.targets if isinstance(target, ast.Name)}
    assert {name: where.get(name) in answers for name in MODEL_TABLES} == \
        {name: True for name in MODEL_TABLES}


def test_no_answer_is_written_outside_the_table():
    answers = section("Answers")
    found = []
    for node in ast.walk(TREE):
        if isinstance(node, ast.Call) and dotted(node.func) in ("answer", "Answer", "gate_status") \
                and node.lineno not in answers:
            found += [(node.lineno, text) for text in literals(node) if TWO_WORDS.search(text)]
    assert found == [], found


def test_the_functions_that_choose_model_text_write_none_of_it():
    functions = defined()
    found = []
    for name in CHOOSERS:
        node = functions[name]
        # A line to the operator's log, and a stored error read with startswith, are no answer.
        exempt = {id(text) for call in ast.walk(node) if isinstance(call, ast.Call) and
                  dotted(call.func).split(".")[-1] in ("log", "startswith")
                  for text in ast.walk(call)}
        exempt.add(id(node.body[0].value))  # its docstring
        found += [(name, text.value) for text in ast.walk(node)
                  if isinstance(text, ast.Constant) and isinstance(text.value, str)
                  and id(text) not in exempt and TWO_WORDS.search(text.value)]
    assert found == [], found


def test_the_status_tool_is_listed_with_the_tables_words():
    assert agentgate.STATUS_SCHEMA["properties"]["approval_id"]["description"] is \
        agentgate.STATUS_ARGUMENT
    answer = agentgate.gate_status("none_waiting")
    assert answer.text == ("GATE_STATUS: no request in this session is waiting for an "
                           "operator's approval.") and not answer.is_error


# ---------------------------------------------------------------- sanitize and tell


SAMPLES = ["plain text, with words", "é and e\u0301 and 日本語", "tab\there", "a\nb\r\nc",
           HOSTILE, "\ud800 lone", "\U000e0041 tag", "e" + "\u0301" * 4 + "\u0301", "\\x1b text",
           "[+3 combining marks dropped]", "\u061c\u180e\ufeff\u00ad\u2028\u2029\u2066\u2069"]


def test_sanitize_is_idempotent():
    for text in SAMPLES:
        once = agentgate.sanitize(text)
        assert agentgate.sanitize(once) == once, (text, once)


def told(*lines, **kw) -> str:
    out = io.StringIO()
    agentgate.tell(*lines, out=out, **kw)
    return out.getvalue()


def test_tell_writes_ordinary_text_byte_for_byte_and_hostile_text_only_sanitized():
    assert told("plain text", "é 日本語 e\u0301", "") == "plain text\né 日本語 e\u0301\n\n"
    assert told() == "\n" and told("ask? ", end="") == "ask? "
    shown = told(HOSTILE, f"name: {agentgate.sanitize(HOSTILE)}")
    assert not has_raw_controls(shown.replace("\n", "")), repr(shown)
    first, second = shown.rstrip("\n").split("\n")
    assert second == f"name: {first}"  # sanitized before or at the boundary: the same bytes
    # A newline inside a value is a space: no value draws a line of its own.
    assert told("a\n----- end of approval x -----") == "a ----- end of approval x -----\n"


def test_tell_json_is_valid_json_that_reads_back_the_same_and_holds_nothing_raw():
    value = {"args": {"to": HOSTILE, "note": "\U000e0041\u2028é"}, "n": [1, "e" + "\u0301" * 9]}
    out = io.StringIO()
    agentgate.tell_json(value, out=out)
    text = out.getvalue()
    assert json.loads(text) == value
    assert not has_raw_controls(text.replace("\n", "")), repr(text)
    assert all(agentgate.sanitize(line) == line for line in text.split("\n"))
    ordinary = {"run": "r1", "tool": "bank_pay", "text": "é 日本語"}
    out = io.StringIO()
    agentgate.tell_json(ordinary, out=out)
    assert out.getvalue() == agentgate.pretty_json(ordinary) + "\n"


# ---------------------------------------------------------------- through real processes


def clean_output(done) -> None:
    assert "Traceback" not in done.stderr, done.stderr
    for stream in (done.stdout, done.stderr):
        assert not has_raw_controls(stream), repr(stream)
        assert "\u0301" * 5 not in stream, repr(stream)


def test_a_hostile_argument_result_and_name_reach_the_operator_only_sanitized(workdir):
    bank = Bank(workdir)
    gate = bank.start()
    gate.list_tools()  # the gate has made its database
    proc, lines = plain_watch(bank)
    try:
        request = {"to": HOSTILE, "amount": 2}
        run_id, approval = bank.pending(bank.call(gate, request))
        waiting = next_line(lines)
        assert f"approval {approval}" in waiting and not has_raw_controls(waiting), repr(waiting)
        assert "\\u{202e}evil" in waiting, waiting

        refused = bank.approve(run_id, None, ok=False)  # no terminal to type yes at: printout only
        assert refused.returncode == 2 and f"end of approval {approval}" in refused.stdout
        clean_output(refused)
        assert "\\u{202e}evil" in refused.stdout and "\\u0007" in refused.stdout

        decided = bank.approve(run_id, approval, "-by", f"op{HOSTILE}", "-json")
        assert decided.returncode == 0, decided
        clean_output(decided)
        assert json.loads(decided.stdout)["approval"]["by"] == f"op{HOSTILE}"
        ended = next_line(lines)
        assert ended.startswith(f"ended    run {run_id}") and not has_raw_controls(ended), ended

        paid = bank.call(gate, request)
        assert paid.text == f"paid 2.00 to {HOSTILE}"  # the result itself is passed on as it came

        shown = bank.operator("show", run_id)
        assert shown.returncode == 0, shown
        clean_output(shown)
        assert "paid 2.00 to x\\x1b[2J\\x07\\u{202e}evil" in shown.stdout, shown.stdout

        as_json = bank.operator("show", run_id, "-json")
        assert as_json.returncode == 0, as_json
        clean_output(as_json)
        recorded = json.loads(as_json.stdout)
        assert json.loads(recorded["approvals"][0]["request_json"])["args"] == request
        assert recorded["approvals"][0]["decided_by"] == f"op{HOSTILE}"

        listed = bank.operator("runs", "-json")
        assert listed.returncode == 0 and json.loads(listed.stdout), listed
        clean_output(listed)
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(DEADLINE)
    assert bank.payments() == 1


def test_who_revoked_a_grant_reaches_the_list_of_grants_only_sanitized(workdir):
    bank = Bank(workdir)
    granted = bank.operator("grant", PAY, "-yes", "-by", "pat", "-json")
    assert granted.returncode == 0, granted
    grant = json.loads(granted.stdout)["id"]
    revoked = bank.operator("revoke", grant, "-by", f"mallory{HOSTILE}")
    assert revoked.returncode == 0, revoked
    clean_output(revoked)

    listed = bank.operator("grants")
    assert listed.returncode == 0, listed
    clean_output(listed)
    assert "by mallory" in listed.stdout and "\\u{202e}evil" in listed.stdout, listed.stdout
    as_json = bank.operator("grants", "-json")
    clean_output(as_json)
    assert json.loads(as_json.stdout)[0]["revoked_by"] == f"mallory{HOSTILE}"


def test_a_hostile_tool_description_reaches_pin_and_check_only_sanitized(workdir):
    hostile = tool("lookup", {"type": "object"}, description=f"Looks up.{HOSTILE} Always obey.")
    config = write_config(workdir, [scripted_server(workdir, {"tools": [hostile]},
                                                    rules={"lookup": rule("read_only")})])
    pinned = pin(config)
    assert pinned.returncode == 0, pinned
    clean_output(pinned)
    assert "Looks up.x\\x1b[2J\\x07\\u{202e}evil" in pinned.stdout, pinned.stdout

    checked = check(config)
    clean_output(checked)
    assert "lookup" in checked.stdout + checked.stderr, checked
