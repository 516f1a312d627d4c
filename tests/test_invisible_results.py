"""A gate that is invisible when it allows (issue 20, items 1 and 2; SPEC "A gate that is
invisible when it allows"): a result the gate lets through reaches the host as the server
answered it (every block in its order, structuredContent beside content, isError, _meta), a
server's error result reaches the model as the server wrote it, `max_result_bytes` caps what
is passed on with a clear answer, and the record identifies exactly what the model was given
(the hash and size of the whole result, its text up to 64 KiB, a binary block as its type,
size and hash), which `show` prints block by block and DUPLICATE, `recheck` and `verify`
read, in the new form and the old.

Real parts: the SDK host in front of agentgate, the npm `server-everything`, the scripted
server, the fake bank, and the operator commands.
"""

import base64
import hashlib
import json
import sys
from pathlib import Path

from conftest import Host, everything_server_argv
from kit import (
    HINT_RE,
    Bank,
    approval_in,
    approve,
    bank,
    check,
    db_path,
    expect,
    gate_host,
    has_raw_controls,
    operator,
    pin,
    query,
    records,
    result_text,
    rule,
    scripted_server,
    tool,
    write_config,
)
from kit import bankdir  # noqa: F401 (fixture)
from test_migration import old_database

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import agentgate  # noqa: E402

CAP = 65536
PNG = bytes.fromhex("89504e470d0a1a0a") + b"not really a picture"
WAV = b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(range(40))
BLOB = bytes(range(256))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def dumped(result) -> dict:
    """An SDK CallToolResult as the JSON it was read from: absent fields left out, and the
    defaults the SDK fills in for a result that does not say (isError false, resultType)."""
    got = result.model_dump(mode="json", by_alias=True, exclude_none=True)
    if got.get("isError") is False:
        del got["isError"]
    if got.get("resultType") == "complete":
        del got["resultType"]
    return got


def result_hash(result: dict) -> tuple[int, str]:
    """(size, sha256) of a result's canonical form, as the record must say."""
    encoded = agentgate.canonical(agentgate.parse(json.dumps(result).encode()))
    return len(encoded), sha(encoded)


def read_runs(workdir) -> dict:
    """The allowed reads' observations by their tool, from their run.read events."""
    found = {}
    for run_id, payload in query(db_path(workdir), "SELECT run_id, payload_json FROM events "
                                                   "WHERE type='run.read' ORDER BY seq"):
        read = json.loads(payload)
        found[read["decision"]["tool"]] = (run_id, read["observation"])
    return found


MIXED = {
    "content": [
        {"type": "text", "text": "before"},
        {"type": "image", "data": b64(PNG), "mimeType": "image/png",
         "annotations": {"audience": ["user"], "priority": 0.5}},
        {"type": "audio", "data": b64(WAV), "mimeType": "audio/wav"},
        {"type": "resource_link", "uri": "file:///srv/report.pdf", "name": "report",
         "mimeType": "application/pdf"},
        {"type": "resource", "resource": {"uri": "file:///srv/a.bin", "mimeType": "application/octet-stream",
                                          "blob": b64(BLOB)}},
        {"type": "resource", "resource": {"uri": "file:///srv/a.txt", "mimeType": "text/plain",
                                          "text": "inside the resource"}},
        {"type": "text", "text": "after", "_meta": {"block": "meta"}},
    ],
    "structuredContent": {"pages": 2, "ok": True},
    "_meta": {"trace": "t-1"},
}
TWO_ERRORS = {"content": [{"type": "text", "text": "This tool intentionally returns an error"},
                          {"type": "text", "text": "and says why in a second block\x1b[2J"}],
              "isError": True}
SNAPSHOT = {"content": [{"type": "text", "text": "here it is"},
                        {"type": "image", "data": b64(PNG), "mimeType": "image/png"}]}


def scripted(workdir, calls: dict, rules: dict, **top):
    spec = {"tools": [tool(name) for name in calls], "calls": calls,
            "record": str(workdir / "calls.jsonl")}
    config = write_config(workdir, [scripted_server(workdir, spec, name="up", rules=rules)], **top)
    pin(config)
    return config


def calls_made(workdir, name: str) -> int:
    return sum(1 for entry in records(workdir / "calls.jsonl") if entry.get("call") == name)


# ---------------------------------------------------------------- the npm everything server

EVERY_TOOLS = ("get-tiny-image", "get-resource-links", "get-resource-reference", "get-structured-content")


def test_everything_servers_blocks_reach_the_host_as_the_server_sent_them(workdir):
    server = {"name": "every", "command": everything_server_argv(), "manifest": "every.manifest.json",
              "rules": {name: rule("read_only") for name in EVERY_TOOLS}}
    config = write_config(workdir, [server])
    pin(config)
    asked = [("get-tiny-image", {}), ("get-resource-links", {"count": 4}),
             ("get-resource-reference", {"resourceType": "Blob", "resourceId": 3}),
             ("get-resource-reference", {"resourceType": "Text", "resourceId": 2}),
             ("get-structured-content", {"location": "Chicago"})]
    with Host(everything_server_argv()) as direct, gate_host(config) as gated:
        pairs = [(name, dumped(direct.call(name, args)), dumped(gated.call(f"every_{name}", args)))
                 for name, args in asked]

    def stamped(result):
        """A result without its resources' text and blob: the server stamps them with the time."""
        for block in result["content"]:
            if block["type"] == "resource":
                block["resource"].pop("text", None)
                block["resource"].pop("blob", None)
        return result

    for name, straight, through in pairs:
        assert stamped(json.loads(json.dumps(through))) == stamped(json.loads(json.dumps(straight))), name

    (_, straight, image), (_, _, links), (_, _, blob), (_, _, text), (_, _, weather) = pairs
    assert image == straight  # byte for byte: the image's base64 as the server sent it
    assert [b["type"] for b in image["content"]] == ["text", "image", "text"]
    png = base64.b64decode(image["content"][1]["data"])
    assert png.startswith(b"\x89PNG") and image["content"][1]["mimeType"] == "image/png"

    assert [b["type"] for b in links["content"]] == ["text"] + ["resource_link"] * 4
    assert links["content"][2]["uri"].endswith("/text/2") and links["content"][2]["name"] == "Text Resource 2"

    assert [b["type"] for b in blob["content"]] == ["text", "resource", "text"]
    assert base64.b64decode(blob["content"][1]["resource"]["blob"]).startswith(b"Resource 3: This is a base64 blob")
    assert text["content"][1]["resource"]["text"].startswith("Resource 2: This is a plaintext resource")

    assert weather["structuredContent"] == {"temperature": 36, "conditions": "Light rain / drizzle", "humidity": 82}
    assert json.loads(weather["content"][0]["text"]) == weather["structuredContent"]
    assert not weather.get("isError")

    # The record: the image as its type, size and the hash of its bytes; show prints it so.
    reads = read_runs(workdir)
    run_id, observed = reads["every_get-tiny-image"]
    record = observed["result"]
    assert (record["bytes"], record["sha256"]) == result_hash(image)
    assert record["blocks"][1] == {"type": "image", "mimeType": "image/png", "bytes": len(png), "sha256": sha(png)}
    assert record["blocks"][0] == {"type": "text", "text": "Here's the image you requested:"}
    shown = operator(config, "show", run_id).stdout
    assert f"result of step 0: {record['bytes']} bytes, sha256 {record['sha256']}" in shown, shown
    lines = shown.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.strip().startswith("image ")]
    image_row, hash_row = lines[at], lines[at + 1]  # a block's row, and its hash under it
    assert image_row.split() == ["image", str(len(png)), "bytes", "image/png"], image_row
    assert hash_row.split() == ["sha256", sha(png)], hash_row
    embedded = reads["every_get-resource-reference"][1]["result"]["blocks"][1]  # the text one
    assert embedded["type"] == "resource" and embedded["uri"].endswith("/text/2")
    assert embedded["text"] == text["content"][1]["resource"]["text"]


# ---------------------------------------------------------------- our scripted server


def test_audio_mixed_blocks_structured_content_and_meta_pass_in_their_order(workdir):
    config = scripted(workdir, {"mixed": {"result": MIXED}}, {"mixed": rule("read_only")})
    with gate_host(config) as host:
        result = host.call("up_mixed", {})
    assert dumped(result) == MIXED
    assert result.content[2].type == "audio" and base64.b64decode(result.content[2].data) == WAV


def test_show_prints_a_results_blocks_by_type_with_sizes_and_hashes(workdir):
    config = scripted(workdir, {"mixed": {"result": MIXED}}, {"mixed": rule("read_only")})
    with gate_host(config) as host:
        assert not host.call("up_mixed", {}).is_error
    run_id, observed = read_runs(workdir)["up_mixed"]
    size, digest = result_hash(MIXED)
    assert (observed["result"]["bytes"], observed["result"]["sha256"]) == (size, digest)
    shown = operator(config, "show", run_id).stdout
    assert f"result of step 0: {size} bytes, sha256 {digest}" in shown, shown
    table = shown.split(f"result of step 0: {size} bytes, sha256 {digest}\n", 1)[1].split("\n\n", 1)[0]
    # Each block is a row (type, size, label) with its hash on the line under it.
    lines = [line.split() for line in table.splitlines()]
    rows = [first[:first.index("bytes") + 1] + second + first[first.index("bytes") + 1:]
            for first, second in zip(lines[::2], lines[1::2])]
    assert all(second[0] == "sha256" for second in lines[1::2]), table
    link = agentgate.canonical(agentgate.parse(json.dumps(MIXED["content"][3]).encode()))
    assert rows == [
        ["text", "6", "bytes", "sha256", sha(b"before"), '"before"'],
        ["image", str(len(PNG)), "bytes", "sha256", sha(PNG), "image/png"],
        ["audio", str(len(WAV)), "bytes", "sha256", sha(WAV), "audio/wav"],
        ["resource_link", str(len(link)), "bytes", "sha256", sha(link), "application/pdf"],
        ["resource", "256", "bytes", "sha256", sha(BLOB), "application/octet-stream"],
        ["resource", "19", "bytes", "sha256", sha(b"inside the resource"), '"inside', 'the', 'resource"'],
        ["text", "5", "bytes", "sha256", sha(b"after"), '"after"'],
        ["structured", "content", str(len(b'{"ok":true,"pages":2}')), "bytes", "sha256",
         sha(b'{"ok":true,"pages":2}')],
    ], shown
    as_json = json.loads(operator(config, "show", run_id, "-json").stdout)
    assert as_json["steps"][0]["observation"]["result"] == observed["result"]


def test_a_servers_error_result_reaches_the_model_as_the_server_wrote_it(workdir):
    config = scripted(workdir, {"broken": {"result": TWO_ERRORS}, "undo": {"result": TWO_ERRORS}},
                      {"broken": rule("read_only"), "undo": rule("remote_mutation", outcome="allow")})
    with gate_host(config) as host:
        for name in ("up_broken", "up_undo"):
            result = host.call(name, {})
            assert result.is_error
            got = dumped(result)
            assert got == TWO_ERRORS, got  # both blocks, no server name, no byte count
        again = expect(host.call("up_undo", {}), "DUPLICATE", is_error=True)
    # A duplicate's prose carries the recorded error, sanitized: it is the gate's prose now.
    assert "it failed, with this error: This tool intentionally returns an error and says why in a second " \
           "block" in again, again
    assert not has_raw_controls(again) and "up/undo" not in again
    assert calls_made(workdir, "undo") == 1
    (observation,) = [json.loads(o) for (o,) in query(db_path(workdir), "SELECT observation_json FROM "
                                                                      "steps WHERE idx=0")]
    assert observation["kind"] == "tool_error" and observation["result"]["is_error"]
    assert [b["text"] for b in observation["result"]["blocks"]] == [b["text"] for b in TWO_ERRORS["content"]]


def test_a_duplicate_says_what_a_binary_result_was_by_its_blocks(workdir):
    config = scripted(workdir, {"snap": {"result": SNAPSHOT}},
                      {"snap": rule("remote_mutation", outcome="allow")})
    with gate_host(config) as host:
        first = host.call("up_snap", {"n": 1})
        assert not first.is_error and dumped(first)["content"] == SNAPSHOT["content"]
        again = expect(host.call("up_snap", {"n": 1}), "DUPLICATE", is_error=True)
    # In prose the server's line break is a space, as every chosen text in prose is sanitized.
    assert again.endswith(f"it succeeded, with this result: here it is [image image/png, {len(PNG)} bytes]"), again
    assert b64(PNG) not in again
    assert calls_made(workdir, "snap") == 1


def test_an_approved_call_the_server_failed_is_told_in_its_words(workdir):
    config = scripted(workdir, {"undo": {"result": TWO_ERRORS}}, {"undo": rule("remote_mutation")})
    with gate_host(config) as host:
        waiting = expect(host.call("up_undo", {}), "PENDING_APPROVAL", is_error=False)
        approval = approval_in(waiting)
        (run_id, named) = HINT_RE.search(host.stderr_text()).groups()
        assert named == approval
        approve(config, run_id, approval)
        assert dumped(host.call("up_undo", {})) == TWO_ERRORS
        status = result_text(host.call("gate_status", {"approval_id": approval}))
    assert "APPROVED and executed, and the server reported a failure: This tool intentionally returns " \
           "an error" in status, status
    assert "bytes, error" not in status and not has_raw_controls(status)


# ---------------------------------------------------------------- max_result_bytes


def test_a_result_over_max_result_bytes_is_withheld_with_a_clear_answer(workdir):
    big_image = {"content": [{"type": "text", "text": "the chart"},
                             {"type": "image", "data": b64(bytes(3000)), "mimeType": "image/png"}]}
    config = scripted(workdir, {"page": {"text": "y" * 5000}, "draw": {"result": big_image},
                                "fits": {"text": "z" * 900}},
                      {"page": rule("read_only"), "fits": rule("read_only"),
                       "draw": rule("remote_mutation", outcome="allow")}, max_result_bytes=1024)
    with gate_host(config) as host:
        assert result_text(host.call("up_fits", {})) == "z" * 900
        read = expect(host.call("up_page", {}), "RESULT_TOO_LARGE", is_error=True)
        drawn = expect(host.call("up_draw", {}), "RESULT_TOO_LARGE", is_error=True)
        again = expect(host.call("up_draw", {}), "DUPLICATE", is_error=True)
    size, _ = result_hash({"content": [{"type": "text", "text": "y" * 5000}]})
    assert read == (
        f"RESULT_TOO_LARGE: The server answered this request with a result of {size} bytes ([text, 5000 "
        f"bytes]), more than the 1024 bytes that are passed on, so it is not shown. A read changes "
        f"nothing: asking for less (a smaller range, page or size) may fit. Tell the user."), read
    assert "[text, 9 bytes], [image image/png, 3000 bytes]" in drawn, drawn
    assert "It was executed and is not executed again: do not call again to retry; an identical call " \
           "within 10m0s is refused as a duplicate." in drawn, drawn
    assert "max_result_bytes" not in drawn + read and "yyyy" not in read
    assert "[image image/png, 3000 bytes]" in again and calls_made(workdir, "draw") == 1
    (run_id,) = [r for (r,) in query(db_path(workdir), "SELECT run_id FROM steps WHERE idx=0")]
    shown = operator(config, "show", run_id).stdout
    assert "withheld: too large to pass on" in shown and "sha256 " + sha(bytes(3000)) in shown, shown


def test_max_result_bytes_is_checked_at_load(workdir):
    for bad in (10, "8MB", 1.5, 10**9):
        config = write_config(workdir, [scripted_server(workdir, {"tools": []})], max_result_bytes=bad)
        done = check(config)
        assert done.returncode == 1, done.stderr
        assert "max_result_bytes must be a whole number of bytes from 1024 to 16777216" in done.stderr
        assert "Traceback" not in done.stderr


# ---------------------------------------------------------------- the record, new and old


def test_the_record_keeps_64_kib_of_text_and_the_size_and_hash_of_the_rest(workdir):
    long = "ab" * 40000
    many = [{"type": "text", "text": str(i)} for i in range(600)]
    config = scripted(workdir, {"long": {"result": {"content": [
        {"type": "text", "text": long}, {"type": "text", "text": "tail"}]}}, "many": {"result": {"content": many}}},
        {"long": rule("read_only"), "many": rule("read_only")})
    with gate_host(config) as host:
        assert result_text(host.call("up_long", {})) == long + "\ntail"  # whole, to the model
        assert dumped(host.call("up_many", {}))["content"] == many
    reads = read_runs(workdir)
    first, second = reads["up_long"][1]["result"]["blocks"]
    assert first == {"type": "text", "text": long[:CAP], "bytes": 80000, "sha256": sha(long.encode())}
    assert second == {"type": "text", "text": "", "bytes": 4, "sha256": sha(b"tail")}
    # A record describes 512 blocks one by one and counts the rest; its hash binds them all.
    run_id, observed = reads["up_many"]
    record = observed["result"]
    assert record["blocks"] == many[:512] and record["more_blocks"] == 88
    assert (record["bytes"], record["sha256"]) == result_hash({"content": many})
    assert "  and 88 more blocks" in operator(config, "show", run_id).stdout


def test_an_old_record_still_answers_a_duplicate_and_shows(workdir):
    """A payment recorded as agentgate recorded results before (its content mapped to a text,
    with its hash) is still a duplicate that says what it paid."""
    config = bank(workdir, rules={"pay": {"outcome": "allow"}})
    with gate_host(config) as host:
        assert result_text(host.call("bank_pay", {"to": "kim", "amount": 1})) == "paid 1.00 to kim"
        db = agentgate.sqlite3.connect(db_path(workdir))
        with db:
            db.execute("UPDATE steps SET observation_json=? WHERE idx=0", (json.dumps({
                "content": "paid 1.00 to kim, as recorded before", "content_hash": sha(b"x"),
                "kind": "tool_result", "summary": "bank/pay: 38 bytes"}),))
        db.close()
        again = expect(host.call("bank_pay", {"to": "kim", "amount": 1}), "DUPLICATE", is_error=True)
    assert again.endswith("it succeeded, with this result: paid 1.00 to kim, as recorded before"), again
    (run_id,) = [r for (r,) in query(db_path(workdir), "SELECT run_id FROM steps WHERE idx=0")]
    shown = operator(config, "show", run_id).stdout
    assert "tool_result: bank/pay: 38 bytes" in shown and "result of step" not in shown, shown


def test_verify_recheck_and_show_read_old_and_new_records_after_migration(bankdir):
    path = old_database(bankdir)
    bank_ = Bank(bankdir, rules={"pay": {"timeout": "2s"}}, session="old", hold="0s")
    old_runs = [row[0] for row in bank_.query("SELECT id FROM runs ORDER BY rowid")]
    host = bank_.start()
    assert bank_.call(host, {"account": "N-1"}, tool="bank_balance").text == "account N-1 holds 120.00 EUR"
    assert [v for (v,) in query(path, "SELECT version FROM schema_migrations ORDER BY 1")] == [1, 2, 3, 4, 5, 6, 7]
    verified = operator(bank_.config, "verify")
    assert "intact:" in verified.stdout, verified.stdout
    rechecked = operator(bank_.config, "recheck", "-json", "-limit", "100", ok=False)
    assert rechecked.returncode == 0, rechecked.stdout + rechecked.stderr
    reports = json.loads(rechecked.stdout)
    assert {r["run_id"] for r in reports} >= set(old_runs) and all(r["same"] for r in reports)
    (new_run,) = [r for (r,) in query(path, "SELECT id FROM runs WHERE tool='bank_balance' ORDER BY rowid "
                                            "DESC LIMIT 1")]
    shown = operator(bank_.config, "show", new_run).stdout
    assert "result of step 0: " in shown and '"account N-1 holds 120.00 EUR"' in shown, shown
    for run in old_runs:
        old = operator(bank_.config, "show", run)
        assert f"run       {run}" in old.stdout and "result of step" not in old.stdout
        assert "Traceback" not in old.stderr
