"""A Streamable HTTP front of the 2026-07-28 revision for a stdio MCP server, so the MCP
conformance suite's stateless scenarios reach agentgate, which a host reaches over stdio.

    python3 conformance_modern_bridge.py STDERR_FILE -- COMMAND [ARG...]

It binds 127.0.0.1 on a port the system picks and prints `port N` once the socket listens.
Stateless HTTP has no session, so one COMMAND (its stderr appended to STDERR_FILE) serves
every request. Each POST is one JSON-RPC message. A request goes to COMMAND under an id of the
bridge's own (clients reuse ids across requests) and is answered with its response as JSON,
or, once something belongs to it before its response (progress under its token; for
subscriptions/listen, notifications tagged with its subscription), as an event stream ending
with its response. A stream the client closes is cancelled. What only the HTTP front can
check, it does: the MCP-Protocol-Version, Mcp-Method and Mcp-Name headers must match the body
(else -32020); and an error's code gives the status (400 for invalid params, an unsupported
version, a missing capability or header; 404 for a method not found).
"""

import itertools
import json
import queue
import select
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

META = "io.modelcontextprotocol/"
STATUS = {-32602: 400, -32022: 400, -32021: 400, -32020: 400, -32601: 404}


class Command:
    """COMMAND, and which waiting request each line it writes belongs to."""

    def __init__(self, argv, stderr_file):
        with open(stderr_file, "ab") as errors:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=errors)
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.waiting = {}  # our id -> (the client's id, its queue)
        self.tokens = {}  # progress token (as JSON) -> queue
        threading.Thread(target=self.read, daemon=True).start()

    def send(self, message):
        with self.lock:
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")
            self.proc.stdin.flush()

    def request(self, message):
        """(our id, a queue of what belongs to it: notifications, then its response)."""
        ours, answers = next(self.ids), queue.Queue()
        self.waiting[ours] = (message["id"], answers)
        token = ((message.get("params") or {}).get("_meta") or {}).get("progressToken")
        if token is not None:
            self.tokens[json.dumps(token)] = answers
        self.send({**message, "id": ours})
        return ours, answers

    def forget(self, ours):
        self.waiting.pop(ours, None)

    def read(self):
        for line in self.proc.stdout:
            message = json.loads(line)
            if "method" not in message:
                theirs, answers = self.waiting.pop(message.get("id"), (None, None))
                if answers is not None:
                    answers.put({**message, "id": theirs})
                continue
            params = message.get("params") or {}
            meta = params.get("_meta") or {}
            stream = meta.get(META + "subscriptionId")
            if stream in self.waiting:
                theirs, answers = self.waiting[stream]
                meta = {**meta, META + "subscriptionId": theirs}
                answers.put({**message, "params": {**params, "_meta": meta}})
            elif json.dumps(params.get("progressToken")) in self.tokens:
                self.tokens[json.dumps(params["progressToken"])].put(message)


def named(message):
    """The body field Mcp-Name mirrors, or None."""
    params = message.get("params") or {}
    for field in ("name", "taskId", "uri"):
        if isinstance(params.get(field), str):
            return params[field]
    return None


def mismatch(headers, message):
    """Why the headers do not match the body, or None."""
    version = headers.get("MCP-Protocol-Version")
    meta = (message.get("params") or {}).get("_meta") or {}
    body_version = meta.get(META + "protocolVersion")
    if version is None:
        return "Missing MCP-Protocol-Version header"
    if body_version is not None and body_version != version:
        return "MCP-Protocol-Version header does not match _meta"
    method = headers.get("Mcp-Method")
    if method is not None and method != message.get("method"):
        return "Mcp-Method header does not match the body's method"
    name = headers.get("Mcp-Name")
    if name is not None and name != named(message):
        return "Mcp-Name header does not match the body"
    return None


class Handler(BaseHTTPRequestHandler):
    gate = None  # the Command, set by main

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.plain(405, b"no server stream in the 2026-07-28 revision")

    do_DELETE = do_GET

    def plain(self, status, body):
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def json(self, message):
        code = (message.get("error") or {}).get("code")
        body = json.dumps(message).encode()
        self.send_response(STATUS.get(code, 200))
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        try:
            message = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        except ValueError:
            return self.json({"jsonrpc": "2.0", "id": None,
                              "error": {"code": -32700, "message": "Parse error"}})
        if not isinstance(message, dict) or "method" not in message or "id" not in message:
            if isinstance(message, dict) and "method" in message:
                self.gate.send(message)
            return self.plain(202, b"")
        why = mismatch(self.headers, message)
        if why:
            return self.json({"jsonrpc": "2.0", "id": message["id"],
                              "error": {"code": -32020, "message": why}})
        ours, answers = self.gate.request(message)
        try:
            self.answer(ours, answers)
        except OSError:
            pass  # the client went away: cancelled below
        finally:
            if ours in self.gate.waiting:
                self.gate.forget(ours)
                self.gate.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                                   "params": {"requestId": ours}})

    def answer(self, ours, answers):
        first = self.next(answers)
        if first is None:
            return
        if "method" not in first:
            return self.json(first)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        message = first
        while message is not None:
            self.wfile.write(b"data: " + json.dumps(message).encode() + b"\n\n")
            self.wfile.flush()
            if "method" not in message:
                return
            message = self.next(answers)

    def next(self, answers):
        """What comes next for this request, or None once its client has gone."""
        while True:
            try:
                return answers.get(timeout=0.2)
            except queue.Empty:
                readable, _, _ = select.select([self.connection], [], [], 0)
                if readable and not self.connection.recv(1, 2):  # MSG_PEEK: closed
                    return None


def main():
    stderr_file, command = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    Handler.gate = Command(command, stderr_file)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(f"port {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    finally:
        Handler.gate.proc.kill()


if __name__ == "__main__":
    main()
