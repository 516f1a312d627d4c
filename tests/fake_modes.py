"""The fake payment server with the tests' modes: agentgate.py's `fake-payments` (the demo's)
plus what the tests need of a server that misbehaves. Run as
`python3 tests/fake_modes.py fake-payments` (conftest.fake_argv builds that command; the
trailing word lets the tests find its processes by name, as they find agentgate's).

`pay`'s `mode`: slow (answers after 2 s, or at once when cancelled), block (answers once
LEDGER.release exists or the call is cancelled), error (an error result), structured (with
structuredContent), deep (structuredContent nested 300 deep). FAKE_PAYMENTS_DESCRIPTION
replaces the description of `balance`. Every payment is appended to FAKE_PAYMENTS_LEDGER (if
set) and synced before the answer is sent."""
import json
import os
import sys
import threading

MODES = ["slow", "block", "error", "structured", "deep"]
TOOLS = [
    {"name": "balance", "description": "Read the balance of an account.",
     "inputSchema": {"type": "object", "additionalProperties": False, "required": ["account"],
                     "properties": {"account": {"type": "string"}}},
     "annotations": {"readOnlyHint": True}},
    {"name": "pay", "description": "Pay an amount to someone.",
     "inputSchema": {"type": "object", "additionalProperties": False,
                     "required": ["to", "amount"],
                     "properties": {"to": {"type": "string"}, "amount": {"type": "number"},
                                    "currency": {"type": "string"},
                                    "mode": {"enum": MODES}}},
     "annotations": {"destructiveHint": False}},
    {"name": "refund", "description": "Refund a payment.",
     "inputSchema": {"type": "object", "additionalProperties": False, "required": ["payment"],
                     "properties": {"payment": {"type": "string"}}}},
]


def main():
    ledger = os.environ.get("FAKE_PAYMENTS_LEDGER")
    tools = json.loads(json.dumps(TOOLS))
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

    def pay(args, stop):
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
            result = pay(args, stop)
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


if __name__ == "__main__":
    sys.exit(main())
