#!/usr/bin/env python3
"""A deliberately misbehaving stdio MCP upstream for agentgate's tests.

Run as `python3 hostile_server.py SPEC.json`. It speaks newline-delimited JSON-RPC with raw
os.read/os.write on fds 0 and 1, and handles every message on its main thread, in order, so
"stop reading stdin" means exactly that: nothing reads fd 0 again. It answers initialize and
tools/list (the tools of the spec) whatever it is asked to do with calls, so `pin` works in
every mode. Keys of the spec (all optional):

  tools            the tools it lists
  record           path: one JSON line per tools/call received ({"call", "id", "arguments"}),
                   written (and flushed) before the call's act starts
  deaf_after_list  true: once the first tools/list is answered, never read stdin again (and
                   never answer anything); a call larger than a pipe buffer then blocks its writer
  calls            tool name -> act, or a list of acts (the n-th call of the tool gets the n-th
                   act; the last repeats). A tool without an act answers "called <name>".

An act is an object; its keys run in this order:

  before                  raw frames written before the answer; "{ID}" in them is replaced by
                          the request id as JSON (so "{ID}.9" is the id plus 0.9 as a literal)
  big                     {"bytes": N, "kind": "garbage" | "answer" | "nested" | "last"}: one
                          line of N bytes: garbage, a valid-looking answer carrying this
                          request's id, a valid-looking answer whose only id is nested
                          ({"x":{"id":ID}}) before the result, or an answer whose id comes
                          after the result (with an "id" inside the result's text)
  close_stdin_then_ping   true: os.close(0), then send the server request
                          {"jsonrpc":"2.0","id":"p1","method":"ping"}, then answer normally
                          (and never read again)
  deaf                    true: never read stdin again and never answer
  flood_pings             N: never read stdin again and send N ping requests (then nothing)
  flood_notifications     N: send N notifications (notifications/message and
                          notifications/tools/list_changed, alternating), then answer
  rpc_error               {"code", "message"}: answer with this JSON-RPC error object
  exit                    status: os._exit(status) without answering
  text                    the text of the normal answer (default "called <name>")
"""

import json
import os
import sys
import time


def write_all(data):
    view = memoryview(data)
    while view:
        done = os.write(1, view)
        view = view[done:]


def send(message):
    write_all(json.dumps(message).encode() + b"\n")


def answer(ident, result):
    send({"jsonrpc": "2.0", "id": ident, "result": result})


def text_result(text):
    return {"content": [{"type": "text", "text": text}]}


def hang():
    """Stay alive, reading nothing, until killed (the gate closes its servers with signals)."""
    while True:
        time.sleep(3600)


def frames():
    """Newline-delimited frames of stdin, read with os.read; stops at EOF."""
    pending = b""
    while True:
        try:
            chunk = os.read(0, 1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            yield line


class Hostile:
    def __init__(self, spec):
        self.spec = spec
        self.calls = {}  # tool name -> calls received

    def record(self, entry):
        path = self.spec.get("record")
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def act_for(self, name):
        acts = self.spec.get("calls", {}).get(name)
        n = self.calls.get(name, 0)
        self.calls[name] = n + 1
        if acts is None:
            return {}
        if isinstance(acts, list):
            return acts[min(n, len(acts) - 1)]
        return acts

    def big_line(self, ident, size, kind):
        """Write one line of about `size` bytes in pieces (no 50 MB string in memory twice)."""
        if kind == "garbage":
            head, tail = b"", b""
        else:
            where = b'"id":' + json.dumps(ident).encode()
            if kind == "nested":
                where = b'"x":{' + where + b"}"
            head = b'{"jsonrpc":"2.0",' + where + b',"result":{"content":[{"type":"text","text":"'
            tail = b'"}]}}'
            if kind == "last":
                head = b'{"jsonrpc":"2.0","result":{"content":[{"type":"text","text":"\\"id\\":0,'
                tail = b'"}]},' + where + b'}'
        write_all(head)
        left = max(0, size - len(head) - len(tail))
        piece = b"x" * (1 << 20)
        while left:
            n = min(left, len(piece))
            write_all(piece[:n])
            left -= n
        write_all(tail + b"\n")

    def call(self, ident, params):
        name, args = params.get("name"), params.get("arguments")
        self.record({"call": name, "id": ident, "arguments": args})
        act = self.act_for(name)
        for raw in act.get("before", []):
            write_all(raw.replace("{ID}", json.dumps(ident)).encode() + b"\n")
        if "big" in act:
            self.big_line(ident, act["big"]["bytes"], act["big"].get("kind", "garbage"))
        if act.get("close_stdin_then_ping"):
            os.close(0)
            send({"jsonrpc": "2.0", "id": "p1", "method": "ping"})
            answer(ident, text_result(act.get("text", f"called {name}")))
            hang()
        if act.get("deaf"):
            hang()
        if act.get("flood_pings"):
            for i in range(act["flood_pings"]):
                send({"jsonrpc": "2.0", "id": f"ping-{i}", "method": "ping"})
            hang()
        for i in range(act.get("flood_notifications", 0)):
            if i % 2:
                send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
            else:
                send({"jsonrpc": "2.0", "method": "notifications/message",
                      "params": {"level": "info", "logger": "hostile", "data": f"note {i}"}})
        if "exit" in act:
            os._exit(act["exit"])
        if "rpc_error" in act:
            send({"jsonrpc": "2.0", "id": ident, "error": act["rpc_error"]})
            return
        answer(ident, text_result(act.get("text", f"called {name}")))

    def serve(self):
        for line in frames():
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if not isinstance(message, dict):
                continue
            method, ident = message.get("method"), message.get("id")
            if method is None or ident is None:
                continue  # answers to our pings, notifications
            params = message.get("params") or {}
            if method == "initialize":
                answer(ident, {"protocolVersion": params.get("protocolVersion", "2025-06-18"),
                               "capabilities": {"tools": {}},
                               "serverInfo": {"name": "hostile", "version": "0"}})
            elif method == "tools/list":
                answer(ident, {"tools": self.spec.get("tools", [])})
                if self.spec.get("deaf_after_list"):
                    hang()
            elif method == "tools/call":
                self.call(ident, params)
            elif method == "ping":
                answer(ident, {})
            else:
                send({"jsonrpc": "2.0", "id": ident,
                      "error": {"code": -32601, "message": "method not found"}})


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    Hostile(spec).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
