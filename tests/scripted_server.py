#!/usr/bin/env python3
"""A scripted stdio MCP server for agentgate's tests: an upstream that can misbehave on purpose.

Run as `python3 scripted_server.py SPEC.json`. The spec is read once at start, so a test can
pin over one process, rewrite the spec (change what the server presents) and load over the
next. Every key is optional:

  stderr            text written to stderr at start
  grandchild        path: start a grandchild that ignores SIGTERM/SIGINT/SIGHUP and stdin EOF
                    and writes its pid to this file (atomically)
  record            path: JSON lines of what happened (tools/list params, answers to the
                    server's own requests, calls received)
  garbage           raw lines written to stdout before every answer
  initialize        "never": never answer initialize
  initialize_after  path: answer initialize only once this file exists
  list              "never" | "die" (write list_stderr, exit 3) | "error" (list_error message)
  server_requests   methods sent to the client before the first tools/list is answered;
                    each answer (or its absence after 10 s) is recorded
  tools             the tools of a single listing page
  tools_from        path: a JSON list of tools read at every tools/list, so a test can change
                    what the server presents while it serves (instead of tools)
  notify_after_list true: send one notifications/tools/list_changed right after the answer to
                    the first tools/list (the listing a gate makes as it starts)
  pages             list of tools/list results, the n-th request gets the n-th (the last repeats)
  endless           true: every page is empty and names a fresh nextCursor
  list_raw          raw JSON text of the whole tools/list result
  calls             tool name -> action; an action is an object with one of
                      text, error, result (object), raw_result (JSON text), huge (bytes of text),
                      die, env, echo, never
                    and optionally delay (seconds before answering), notify_list_changed
                    (that many notifications/tools/list_changed sent before the answer) and
                    progress (params of notifications/progress sent before the answer, each
                    under the call's own progressToken unless it names one). A tool without an
                    action answers "called <name>". A call's _meta is recorded with it.
"""

import json
import os
import subprocess
import sys
import threading
import time

GRANDCHILD = """
import os, signal, sys, time
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
while True:
    time.sleep(3600)
"""


class Script:
    def __init__(self, spec):
        self.spec = spec
        self.out_lock = threading.Lock()
        self.state_lock = threading.Lock()
        self.lists = 0
        self.asked = False
        self.waiting = {}  # id of a request we sent -> [Event, answer]

    # -- output -------------------------------------------------------------------------------

    def write(self, data):
        with self.out_lock:
            for line in self.spec.get("garbage", []):
                sys.stdout.buffer.write(line.encode("utf-8", "surrogatepass") + b"\n")
            sys.stdout.buffer.write(data + b"\n")
            sys.stdout.buffer.flush()

    def send(self, message):
        self.write(json.dumps(message).encode())

    def answer(self, ident, result):
        self.send({"jsonrpc": "2.0", "id": ident, "result": result})

    def record(self, entry):
        path = self.spec.get("record")
        if path:
            with self.state_lock, open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")

    # -- requests the server sends ----------------------------------------------------------------

    def ask(self, index, method):
        ident = f"srv-{index}"
        slot = [threading.Event(), None]
        self.waiting[ident] = slot
        params = {"messages": [], "maxTokens": 1} if method == "sampling/createMessage" else \
            {"message": "which?", "requestedSchema": {"type": "object", "properties": {}}} \
            if method == "elicitation/create" else {}
        self.send({"jsonrpc": "2.0", "id": ident, "method": method, "params": params})
        slot[0].wait(10)
        self.record({"method": method, "answer": slot[1]})

    # -- handlers ---------------------------------------------------------------------------------

    def initialize(self, ident, params):
        if self.spec.get("initialize") == "never":
            return
        gate = self.spec.get("initialize_after")
        while gate and not os.path.exists(gate):
            time.sleep(0.02)
        self.answer(ident, {"protocolVersion": params.get("protocolVersion", "2025-06-18"),
                            "capabilities": {"tools": {}},
                            "serverInfo": {"name": "scripted", "version": "0"}})

    def tools_list(self, ident, params):
        spec = self.spec
        self.record({"list": params})
        mode = spec.get("list")
        if mode == "never":
            return
        if mode == "die":
            sys.stderr.write(spec.get("list_stderr", ""))
            sys.stderr.flush()
            os._exit(3)
        if mode == "error":
            self.send({"jsonrpc": "2.0", "id": ident,
                       "error": {"code": -32603, "message": spec.get("list_error", "no")}})
            return
        with self.state_lock:
            n, self.lists = self.lists, self.lists + 1
            ask, self.asked = not self.asked, True
        if ask:
            for i, method in enumerate(spec.get("server_requests", [])):
                self.ask(i, method)
        if "list_raw" in spec:
            self.write(b'{"jsonrpc":"2.0","id":' + json.dumps(ident).encode() + b',"result":'
                       + spec["list_raw"].encode("utf-8", "surrogatepass") + b"}")
        elif spec.get("endless"):
            self.answer(ident, {"tools": [], "nextCursor": f"page-{n + 1}"})
        elif "pages" in spec:
            self.answer(ident, spec["pages"][min(n, len(spec["pages"]) - 1)])
        elif "tools_from" in spec:
            with open(spec["tools_from"], encoding="utf-8") as f:
                self.answer(ident, {"tools": json.load(f)})
        else:
            self.answer(ident, {"tools": spec.get("tools", [])})
        if n == 0 and spec.get("notify_after_list"):
            self.send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})

    def tools_call(self, ident, params):
        name, args = params.get("name"), params.get("arguments")
        self.record({"call": name, "arguments": args, **(
            {"_meta": params["_meta"]} if "_meta" in params else {})})
        action = self.spec.get("calls", {}).get(name, {"text": f"called {name}"})
        token = (params.get("_meta") or {}).get("progressToken")
        for step in action.get("progress", []):
            self.send({"jsonrpc": "2.0", "method": "notifications/progress",
                       "params": {"progressToken": token, **step}})
        if action.get("delay"):
            time.sleep(action["delay"])
        for _ in range(action.get("notify_list_changed", 0)):
            self.send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        if action.get("never"):
            return
        if action.get("die"):
            sys.stderr.write("scripted server: dying mid-call\n")
            sys.stderr.flush()
            os._exit(1)
        if "raw_result" in action:
            self.write(b'{"jsonrpc":"2.0","id":' + json.dumps(ident).encode() + b',"result":'
                       + action["raw_result"].encode("utf-8", "surrogatepass") + b"}")
            return
        if "result" in action:
            result = action["result"]
        elif "error" in action:
            result = {"content": [{"type": "text", "text": action["error"]}], "isError": True}
        elif "huge" in action:
            result = {"content": [{"type": "text", "text": "x" * action["huge"]}]}
        elif action.get("env"):
            with open("/proc/self/environ", "rb") as f:
                entries = [e.decode("utf-8", "replace") for e in f.read().split(b"\0") if e]
            result = {"content": [{"type": "text", "text": "\n".join(entries)}]}
        elif action.get("echo"):
            result = {"content": [{"type": "text", "text": json.dumps(args, sort_keys=True)}]}
        else:
            result = {"content": [{"type": "text", "text": action.get("text", "")}]}
        self.answer(ident, result)

    def serve(self):
        for line in sys.stdin.buffer:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if not isinstance(message, dict):
                continue
            method, ident = message.get("method"), message.get("id")
            if method is None:
                slot = self.waiting.get(ident)
                if slot:
                    slot[1] = message
                    slot[0].set()
                continue
            params = message.get("params") or {}
            handler = {"initialize": self.initialize, "tools/list": self.tools_list,
                       "tools/call": self.tools_call}.get(method)
            if handler:
                threading.Thread(target=handler, args=(ident, params), daemon=True).start()
            elif method == "ping" and ident is not None:
                self.answer(ident, {})
            elif ident is not None:
                self.send({"jsonrpc": "2.0", "id": ident,
                           "error": {"code": -32601, "message": "method not found"}})


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    if spec.get("stderr"):
        sys.stderr.write(spec["stderr"])
        sys.stderr.flush()
    if spec.get("grandchild"):
        subprocess.Popen([sys.executable, "-c", GRANDCHILD, spec["grandchild"]],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
        while not os.path.exists(spec["grandchild"]):  # answer nothing before it is in place
            time.sleep(0.01)
    Script(spec).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
