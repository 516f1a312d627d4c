"""Issue 28, items 1, 4 and 5: a url server's calls through the standard library's transport,
with the OAuth tokens `login` kept.

The servers are small standard-library ones in this process (kit.loopback_http): an MCP
server that accepts one Bearer token and pays (its ledger is what executed; `in_flight` the
most calls it held at once), and an authorization server elsewhere whose token endpoint
renews that token. The token file is the one login leaves (tests/test_oauth_login.py runs the
real login); here it names the authorization server the person's login found.
"""

from __future__ import annotations

import base64
import http.server
import json
import os
import sys
import threading
from pathlib import Path
from urllib.parse import parse_qs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conftest import wait_for  # noqa: E402
from kit import DEADLINE, agentgate, approvals, gate_host, loopback_http, pin, rule, said, write_config  # noqa: E402
from test_oauth_login import browser_env, login, oauth_server  # noqa: E402,F401

PAY = {"name": "pay", "inputSchema": {"type": "object", "properties": {
    "to": {"type": "string"}, "amount": {"type": "integer"}, "hold": {"type": "boolean"}}}}
CLIENT = {"client_id": "agentgate-client", "client_secret": "client-secret-never-elsewhere",
          "token_endpoint_auth_method": "client_secret_basic"}


class Bank:
    """An MCP server on 127.0.0.1 taking `Bearer <bearer>` only. A pay with `hold` waits (up
    to DEADLINE) until `release` is set or another pay is in flight with it."""

    def __init__(self, bearer: str | None):
        self.bearer, self.ledger, self.authorizations = bearer, [], []
        self.active, self.in_flight, self.release = 0, 0, threading.Event()
        self.lock, self.changed = threading.Lock(), threading.Condition()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                outer.authorizations.append(self.headers.get("Authorization"))
                if outer.bearer and self.headers.get("Authorization") != f"Bearer {outer.bearer}":
                    return self.reply(401, b"", [("WWW-Authenticate", 'Bearer error="invalid_token"')])
                message = json.loads(body)
                if "id" not in message:
                    return self.reply(202, b"")
                result = outer.answer(message)
                self.reply(200, json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}).encode())

            def do_GET(self):
                self.reply(405, b"")

            def reply(self, status, body, headers=()):
                self.send_response(status)
                for name, value in [("Content-Type", "application/json"), *headers]:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server, self.url = loopback_http(Handler)

    def answer(self, message: dict) -> dict:
        if message["method"] == "initialize":
            return {"protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                    "serverInfo": {"name": "bank", "version": "1"}}
        if message["method"] == "tools/list":
            return {"tools": [PAY, {**PAY, "name": "transfer"}]}
        args = message["params"]["arguments"]
        with self.changed:
            self.active += 1
            self.in_flight = max(self.in_flight, self.active)
            self.ledger.append(args)
            self.changed.notify_all()
            if args.get("hold"):
                self.changed.wait_for(lambda: self.release.is_set() or self.in_flight > 1, DEADLINE)
            self.active -= 1
        return {"content": [{"type": "text", "text": f"paid {args['amount']} to {args['to']}"}]}

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class TokenEndpoint:
    """An authorization server's token endpoint on 127.0.0.1: each refresh-token grant it is
    sent is kept (form and Authorization header), and renews `bank`'s token. With `hold` set,
    a grant waits until it is released."""

    def __init__(self, bank: Bank):
        self.grants, self.hold, self.release = [], False, threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                form = parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
                outer.grants.append(({k: v[0] for k, v in form.items()}, self.headers.get("Authorization"),
                                     self.headers.get("Content-Type")))
                if outer.hold:
                    outer.release.wait(DEADLINE)
                bank.bearer = f"renewed-{len(outer.grants)}"
                body = json.dumps({"access_token": bank.bearer, "token_type": "Bearer",
                                   "expires_in": 3600}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server, base = loopback_http(Handler)
        self.url = base.removesuffix("/mcp") + "/oauth/token"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def config_for(dir: Path, url: str, name: str = "agentgate.json", timeout: str = "30s") -> Path:
    return write_config(dir, [{"name": "bank", "url": url, "manifest": f"{name}.bank.manifest.json",
                               "rules": {"pay": rule("remote_mutation", timeout, outcome="allow"),
                                         "transfer": rule("remote_mutation", "30s", outcome="allow")}}], name)


def keep_tokens(config: Path, url: str, endpoint: str, access: str, expired: bool = False) -> Path:
    """The token file login leaves for `config`'s server bank at `url`."""
    path = config.parent / f"{config.stem}.bank.tokens.json"
    path.write_text(json.dumps({
        "config": os.path.abspath(config), "url": url, "issuer": endpoint.rsplit("/oauth", 1)[0],
        "token_endpoint": endpoint, "client": CLIENT, "expires_at": 1.0 if expired else None,
        "tokens": {"access_token": access, "token_type": "Bearer", "refresh_token": "refresh-1"}}))
    path.chmod(0o600)
    return path


def served(workdir, expired=False, timeout="30s"):
    bank = Bank("first")
    endpoint = TokenEndpoint(bank)
    config = config_for(workdir, bank.url, timeout=timeout)
    keep_tokens(config, bank.url, endpoint.url, "first", expired)
    return bank, endpoint, config


# ---------------------------------------------------------------- item 1


def test_two_calls_to_an_oauth_server_are_in_flight_at_once(workdir):
    bank, endpoint, config = served(workdir)
    try:
        pin(config)
        gate = gate_host(config)
        slow = gate.submit("bank_pay", {"to": "kim", "amount": 3, "hold": True})
        with bank.changed:
            assert bank.changed.wait_for(lambda: bank.active == 1, DEADLINE)
        text, error = said(gate.call("bank_pay", {"to": "lou", "amount": 4}))
        assert not error and text == "paid 4 to lou", text
        text, error = said(slow.result())
        assert not error and text == "paid 3 to kim", text
        gate.close()
        assert bank.in_flight == 2 and len(bank.ledger) == 2, (bank.in_flight, bank.ledger)
        assert approvals(workdir) == []  # no unknown outcome
    finally:
        bank.close()
        endpoint.close()


def test_a_call_whose_deadline_passes_before_it_is_written_never_executes(workdir):
    # A transfer is refused its token (401) and renews it at an endpoint that holds the
    # renewal; a payment waits for the renewed token and its 2s pass: it was never written,
    # is known not to have executed, and is never sent later.
    bank, endpoint, config = served(workdir, timeout="2s")
    payment = {"to": "lou", "amount": 4}
    try:
        pin(config)
        gate = gate_host(config)
        assert "bank_pay" in {t.name for t in gate.list_tools()}  # served, with the first token
        bank.bearer, endpoint.hold = "rotated", True
        transfer = gate.submit("bank_transfer", {"to": "kim", "amount": 3})
        wait_for(lambda: endpoint.grants, DEADLINE, message="the renewal to begin")
        text, error = said(gate.call("bank_pay", payment))
        assert error and not text.startswith("UNKNOWN_OUTCOME"), text
        assert "before the message was sent" in text, text
        endpoint.release.set()
        text, error = said(transfer.result())
        assert not error and text == "paid 3 to kim", text
        gate.close()
        assert bank.ledger == [{"to": "kim", "amount": 3}], bank.ledger
        assert approvals(workdir) == []
    finally:
        bank.close()
        endpoint.close()


# ---------------------------------------------------------------- item 4


def test_an_expired_token_is_renewed_at_the_token_endpoint_login_found(workdir):
    bank, endpoint, config = served(workdir)
    try:
        pin(config)
        keep_tokens(config, bank.url, endpoint.url, "first", expired=True)
        gate = gate_host(config)
        text, error = said(gate.call("bank_pay", {"to": "kim", "amount": 3}))
        assert not error and text == "paid 3 to kim", text
        gate.close()
        (form, authorization, kind), = endpoint.grants
        assert form == {"grant_type": "refresh_token", "refresh_token": "refresh-1",
                        "client_id": CLIENT["client_id"]}
        assert kind == "application/x-www-form-urlencoded"
        pair = f"{CLIENT['client_id']}:{CLIENT['client_secret']}".encode()
        assert authorization == "Basic " + base64.b64encode(pair).decode()
        # The resource server was sent the access tokens only, never the refresh token or secret.
        assert set(bank.authorizations) <= {"Bearer first", "Bearer renewed-1"}, bank.authorizations
        kept = json.loads((workdir / "agentgate.bank.tokens.json").read_text())
        assert kept["tokens"]["access_token"] == "renewed-1" and kept["tokens"]["refresh_token"] == "refresh-1"
        assert oct(os.stat(workdir / "agentgate.bank.tokens.json").st_mode & 0o777) == "0o600"
    finally:
        bank.close()
        endpoint.close()


def test_a_401_renews_the_token_and_the_refused_request_is_sent_once_more(workdir):
    bank, endpoint, config = served(workdir)
    try:
        pin(config)
        bank.bearer = "rotated"  # the server takes "first" no longer
        gate = gate_host(config)
        text, error = said(gate.call("bank_pay", {"to": "kim", "amount": 3}))
        assert not error and text == "paid 3 to kim", text
        gate.close()
        assert len(endpoint.grants) == 1 and len(bank.ledger) == 1
        assert "Bearer first" in bank.authorizations and bank.authorizations[-1] == "Bearer renewed-1"
    finally:
        bank.close()
        endpoint.close()


# ---------------------------------------------------------------- item 5


def test_tokens_go_only_to_the_config_and_url_they_were_kept_for(workdir, oauth_server):
    # Two hosts' configs in one directory, each with a server named bank at another url: the
    # one logged in keeps its tokens; the other's server is never sent them.
    server = oauth_server()
    desktop = write_config(workdir, [{"name": "bank", "url": server.url, "manifest": "desktop.bank.json",
                                      "rules": {"balance": rule("read_only")}}], "claude-desktop.json")
    login(desktop, browser_env(workdir))
    other = Bank(None)
    try:
        cursor = config_for(workdir, other.url, "cursor.json")
        pin(cursor)
        gate = gate_host(cursor)
        text, error = said(gate.call("bank_pay", {"to": "kim", "amount": 3}))
        assert not error, text
        gate.close()
        assert other.authorizations and set(other.authorizations) == {None}, other.authorizations
        # A token file copied to the other's name is refused: it was kept for another config.
        kept = workdir / "claude-desktop.bank.tokens.json"
        (workdir / "cursor.bank.tokens.json").write_bytes(kept.read_bytes())
        (workdir / "cursor.bank.tokens.json").chmod(0o600)
        done = agentgate("check", "-config", str(cursor))
        assert "kept for another config or url" in done.stdout + done.stderr, done
        assert "run: agentgate.py login bank" in done.stdout + done.stderr, done
        assert set(other.authorizations) == {None}
    finally:
        other.close()
