"""OAuth with a url server (issue 20, item 7): `agentgate.py login SERVER`, then a gate that
serves the server with what login kept, refreshes it, and says to run login when it cannot.

The server is the official SDK's own MCP server with its own OAuth authorization server
(discovery, dynamic client registration, PKCE, refresh), run by this file as a child:

    python3 test_oauth_login.py serve DIR [preregistered]

It binds 127.0.0.1 on a port the system picks and prints `port N`. Its consent is automatic,
and it appends what it was asked to DIR/oauth.log (one word a line: register, authorize,
code, refresh, refused-refresh); a file DIR/revoked makes it refuse every token it issued.
`preregistered` turns registration off and knows one client, PRE_ID with PRE_SECRET, which
may redirect to any port of 127.0.0.1 (RFC 8252). The browser is a small script named by
$BROWSER, which fetches the authorization address and follows its redirect to login's
loopback port, as a browser would once a person consents.
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

SCOPE, WRITE_SCOPE = "bank", "bank:write"
PRE_ID, PRE_SECRET = "pre-registered-client", "pre-secret-3f9a-never-shown"
TOKENS = "agentgate.bank.tokens.json"  # the config's stem, then the server's name


# ---------------------------------------------------------------- the server, as a child


def serve(dir: Path, preregistered: bool, step_up: bool, split: bool = False) -> None:
    import secrets
    import socket

    import uvicorn
    from pydantic import AnyUrl

    from mcp.server.auth.provider import (AccessToken, AuthorizationCode, RefreshToken,
                                          construct_redirect_uri)
    from mcp.server.auth.settings import AuthSettings, ClientRegistrationOptions
    from mcp.server.mcpserver import MCPServer
    from mcp.shared.auth import OAuthClientInformationFull, OAuthToken

    def log(word: str) -> None:
        with open(dir / "oauth.log", "a") as f:
            f.write(word + "\n")

    def revoked() -> bool:
        return (dir / "revoked").exists()

    class LoopbackClient(OAuthClientInformationFull):
        def validate_redirect_uri(self, redirect_uri):
            if redirect_uri is None or redirect_uri.host != "127.0.0.1":
                return super().validate_redirect_uri(redirect_uri)
            return redirect_uri

    class Provider:
        def __init__(self):
            self.clients, self.codes, self.access, self.refresh = {}, {}, {}, {}
            if preregistered:
                self.clients[PRE_ID] = LoopbackClient(
                    client_id=PRE_ID, client_secret=PRE_SECRET, redirect_uris=[AnyUrl("http://127.0.0.1/")],
                    token_endpoint_auth_method="client_secret_basic", scope=SCOPE)

        async def get_client(self, client_id):
            return self.clients.get(client_id)

        async def register_client(self, client_info):
            # A client may later ask for any scope this server has (a step-up), as with
            # most authorization servers; the SDK's own would hold it to the registered one.
            log("register")
            client_info.scope = f"{SCOPE} {WRITE_SCOPE}"
            self.clients[client_info.client_id] = client_info

        async def authorize(self, client, params):
            log("authorize " + " ".join(params.scopes or []))
            code = secrets.token_urlsafe(16)
            self.codes[code] = AuthorizationCode(
                code=code, scopes=params.scopes or [], expires_at=time.time() + 300, client_id=client.client_id,
                code_challenge=params.code_challenge, redirect_uri=params.redirect_uri,
                redirect_uri_provided_explicitly=params.redirect_uri_provided_explicitly, resource=params.resource)
            return construct_redirect_uri(str(params.redirect_uri), code=code, state=params.state)

        async def load_authorization_code(self, client, code):
            return self.codes.get(code)

        async def exchange_authorization_code(self, client, code):
            log("code")
            del self.codes[code.code]
            return self._issue(client.client_id, code.scopes)

        async def load_refresh_token(self, client, token):
            if revoked() or token not in self.refresh:
                log("refused-refresh")
                return None
            return self.refresh[token]

        async def exchange_refresh_token(self, client, refresh_token, scopes):
            log("refresh")
            del self.refresh[refresh_token.token]
            return self._issue(client.client_id, scopes or refresh_token.scopes)

        async def load_access_token(self, token):
            return None if revoked() else self.access.get(token)

        async def revoke_token(self, token):
            pass

        def _issue(self, client_id, scopes):
            access, refresh = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
            self.access[access] = AccessToken(token=access, client_id=client_id, scopes=scopes,
                                              expires_at=int(time.time()) + 3600)
            self.refresh[refresh] = RefreshToken(token=refresh, client_id=client_id, scopes=scopes)
            return OAuthToken(access_token=access, expires_in=3600, refresh_token=refresh,
                              scope=" ".join(scopes))

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    # split: the MCP server is reached as localhost, its authorization server as 127.0.0.1:
    # two origins, as when a third party authorizes.
    resource = base.replace("127.0.0.1", "localhost") if split else base
    auth = AuthSettings(issuer_url=base, resource_server_url=f"{resource}/mcp", required_scopes=[SCOPE],
                        validate_token_resource=False,
                        client_registration_options=ClientRegistrationOptions(
                            enabled=not preregistered, valid_scopes=[SCOPE, WRITE_SCOPE],
                            default_scopes=[SCOPE]))
    provider = Provider()
    server = MCPServer("oauth-bank", auth_server_provider=provider, auth=auth)

    @server.tool()
    def balance(account: str) -> str:
        """The balance of an account."""
        return f"{account}: 120 EUR"

    @server.tool()
    def pay(to: str, amount: int) -> str:
        """Pay someone."""
        return f"paid {amount} to {to}"

    def pay_needs_write(app):
        """With step_up, a call to pay with a token that lacks WRITE_SCOPE is refused 403."""

        async def wrapped(scope, receive, send):
            if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != "/mcp" \
                    or not step_up:
                return await app(scope, receive, send)
            messages, body = [], b""
            while True:
                message = await receive()
                messages.append(message)
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            bearer = dict(scope["headers"]).get(b"authorization", b"").decode()[len("Bearer "):]
            token = provider.access.get(bearer)
            call = json.loads(body or b"{}")
            if token and call.get("method") == "tools/call" and call["params"]["name"] == "pay" \
                    and WRITE_SCOPE not in token.scopes:
                challenge = f'Bearer error="insufficient_scope", scope="{SCOPE} {WRITE_SCOPE}"'
                await send({"type": "http.response.start", "status": 403,
                            "headers": [(b"www-authenticate", challenge.encode()),
                                        (b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": b'{"error": "insufficient_scope"}'})
                return

            async def replay():
                return messages.pop(0) if messages else await receive()

            await app(scope, replay, send)

        return wrapped

    def record_headers(app):
        """DIR/requests.log: each HTTP request's host, path and X-Api-Key (or -)."""

        async def wrapped(scope, receive, send):
            if scope["type"] == "http":
                headers = dict(scope["headers"])
                key = headers.get(b"x-api-key", b"-").decode()
                with open(dir / "requests.log", "a") as f:
                    f.write(f"{headers.get(b'host', b'').decode()} {scope['path']} {key}\n")
            return await app(scope, receive, send)

        return wrapped

    print(f"port {sock.getsockname()[1]}", flush=True)
    app = record_headers(pay_needs_write(server.streamable_http_app()))
    uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on")).run(sockets=[sock])


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve(Path(sys.argv[2]), "preregistered" in sys.argv[3:], "step-up" in sys.argv[3:],
          "split" in sys.argv[3:])
    sys.exit(0)


# ---------------------------------------------------------------- the tests

from conftest import wait_for  # noqa: E402
from kit import (  # noqa: E402
    CONFIG,
    DEADLINE,
    Listening,
    agentgate,
    check,
    db_path,
    gate_host,
    pin,
    rule,
    said,
    write_config,
)

BROWSER = f"""#!{sys.executable}
# A person who consents: open the address and follow its redirect to login's loopback port.
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=60) as answer:
    answer.read()
"""


class OAuthServer(Listening):
    """This file's server in its own process group; `url` once it listens."""

    def __init__(self, dir: Path, preregistered: bool, step_up: bool, split: bool = False):
        self.dir = dir
        super().__init__([sys.executable, __file__, "serve", str(dir)] + (["preregistered"] if preregistered else [])
                         + (["step-up"] if step_up else []) + (["split"] if split else []),
                         dir / "oauth_server.stderr")

    def log(self) -> list[str]:
        path = self.dir / "oauth.log"
        return path.read_text().split("\n")[:-1] if path.exists() else []


@pytest.fixture
def oauth_server(workdir):
    started = []

    def start(preregistered: bool = False, step_up: bool = False, split: bool = False) -> OAuthServer:
        started.append(OAuthServer(workdir, preregistered, step_up, split))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def config_for(dir: Path, url: str, **fields) -> Path:
    return write_config(dir, [{"name": "bank", "url": url, "manifest": "bank.manifest.json",
                               "rules": {"balance": rule("read_only"), "pay": rule("local_mutation")},
                               **fields}])


def browser_env(dir: Path) -> dict:
    script = dir / "browser"
    script.write_text(BROWSER)
    script.chmod(0o700)
    return {"BROWSER": str(script)}


def login(config: Path, env: dict) -> subprocess.CompletedProcess:
    done = agentgate("login", "bank", "-config", str(config), env=env)
    assert done.returncode == 0, f"login exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def kept(dir: Path) -> dict:
    return json.loads((dir / TOKENS).read_text())


def secrets_of(dir: Path) -> list[str]:
    tokens = kept(dir)["tokens"]
    return [tokens["access_token"], tokens["refresh_token"]]


def assert_never_shown(dir: Path, secrets: list[str], *texts: str) -> None:
    for secret in secrets:
        for text in texts:
            assert secret not in text
        for path in dir.iterdir():
            if path.is_file() and path.name not in (TOKENS, CONFIG, "oauth_server.stderr"):
                assert secret.encode() not in path.read_bytes(), path.name


def expire(dir: Path) -> None:
    """Time passes for the kept access token: its expiry is now behind it."""
    path = dir / TOKENS
    state = kept(dir)
    state["expires_at"] = time.time() - 1
    path.write_text(json.dumps(state))
    path.chmod(0o600)


def offered(gate) -> list[str]:
    """The tools the gate offers; none when it could not load them at all."""
    try:
        return sorted(t.name for t in gate.list_tools())
    except Exception:
        return []


def test_pin_before_login_says_to_run_login(workdir, oauth_server):
    server = oauth_server()
    config = config_for(workdir, server.url)
    done = agentgate("pin", "-config", str(config))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "HTTP 401" in done.stderr and "run: agentgate.py login bank" in done.stderr, done.stderr
    assert not (workdir / TOKENS).exists()


def test_login_keeps_tokens_0600_and_the_gate_serves_the_server(workdir, oauth_server):
    server = oauth_server()
    config = config_for(workdir, server.url)
    env = browser_env(workdir)

    done = login(config, env)
    assert "authorize" in done.stdout and "http://127.0.0.1:" in done.stdout, done.stdout
    assert stat.S_IMODE((workdir / TOKENS).stat().st_mode) == 0o600
    assert server.log() == ["register", "authorize bank", "code"]
    outputs = [done, pin(config), check(config)]
    assert outputs[2].returncode == 0, outputs[2].stderr

    gate = gate_host(config)
    assert offered(gate) == ["bank_balance", "bank_pay", "gate_status"]
    text, error = said(gate.call("bank_balance", {"account": "A-1"}))
    assert not error and "A-1: 120 EUR" in text, text
    gate.close()
    assert server.log() == ["register", "authorize bank", "code"]  # no second consent, no refresh
    assert db_path(workdir).exists()
    assert_never_shown(workdir, secrets_of(workdir), gate.stderr_text(),
                       *(o.stdout + o.stderr for o in outputs))


def test_login_sends_the_servers_headers_to_the_server_alone(workdir, oauth_server):
    # The config's headers are for the MCP server's url: discovery, registration and the
    # token exchange at an authorization server of another origin never see them.
    server = oauth_server(split=True)
    url = server.url.replace("127.0.0.1", "localhost")
    config = config_for(workdir, url, headers={"X-Api-Key": "key-for-the-bank-only"})
    login(config, browser_env(workdir))
    assert server.log() == ["register", "authorize bank", "code"]
    port = url.split(":")[2].split("/")[0]
    seen = [line.split(" ") for line in (workdir / "requests.log").read_text().splitlines()]
    mcp = [key for host, path, key in seen if (host, path) == (f"localhost:{port}", "/mcp")]
    assert mcp and set(mcp) == {"key-for-the-bank-only"}, seen
    elsewhere = [(host, path, key) for host, path, key in seen if host != f"localhost:{port}"]
    assert elsewhere and all(key == "-" for host, path, key in elsewhere), seen
    assert any(path == "/token" for host, path, key in seen if host == f"127.0.0.1:{port}"), seen


def test_an_expired_access_token_is_refreshed_and_kept(workdir, oauth_server):
    server = oauth_server()
    config = config_for(workdir, server.url)
    login(config, browser_env(workdir))
    first = secrets_of(workdir)
    pin(config)
    expire(workdir)

    gate = gate_host(config)
    text, error = said(gate.call("bank_balance", {"account": "A-2"}))
    assert not error and "A-2: 120 EUR" in text, text
    gate.close()
    assert server.log().count("refresh") == 1, server.log()
    assert "authorize bank" not in server.log()[3:]
    now = secrets_of(workdir)
    assert now[0] != first[0] and kept(workdir)["expires_at"] > time.time()
    assert stat.S_IMODE((workdir / TOKENS).stat().st_mode) == 0o600
    assert_never_shown(workdir, first + now, gate.stderr_text())


def test_a_refused_refresh_is_not_served_and_says_to_run_login(workdir, oauth_server):
    server = oauth_server()
    config = config_for(workdir, server.url)
    login(config, browser_env(workdir))
    pin(config)
    expire(workdir)
    (workdir / "revoked").write_text("")

    checked = check(config)
    assert checked.returncode == 1
    assert "run: agentgate.py login bank" in checked.stderr, checked.stderr
    gate = gate_host(config)
    assert "bank_balance" not in offered(gate)
    wait_for(lambda: "run: agentgate.py login bank" in gate.stderr_text(), timeout=DEADLINE,
             message="the gate's stderr never said to run login")
    gate.close()
    assert_never_shown(workdir, secrets_of(workdir), gate.stderr_text(), checked.stdout + checked.stderr)
    assert "refused-refresh" in server.log()
    assert server.log().count("authorize bank") == 1  # the serving gate never asks a person


def test_a_call_refused_for_scope_is_not_served_and_the_next_login_asks_for_it(workdir, oauth_server):
    server = oauth_server(step_up=True)
    config = config_for(workdir, server.url)
    env = browser_env(workdir)
    login(config, env)
    pin(config)

    gate = gate_host(config)
    text, error = said(gate.call("bank_pay", {"to": "kim", "amount": 3}))
    assert error and "HTTP 403" in text, text
    assert "login" not in text and "agentgate" not in text  # the model is not told the command
    wait_for(lambda: "run: agentgate.py login bank" in gate.stderr_text(), timeout=DEADLINE,
             message="the gate's stderr never said to run login")
    text, error = said(gate.call("bank_balance", {"account": "A-4"}))
    assert error and "120 EUR" not in text, text  # the server is not served until login
    gate.close()
    assert kept(workdir)["wanted_scope"] == f"{SCOPE} {WRITE_SCOPE}"

    login(config, env)
    assert server.log()[-2:] == [f"authorize {SCOPE} {WRITE_SCOPE}", "code"]
    gate = gate_host(config)
    text, error = said(gate.call("bank_pay", {"to": "kim", "amount": 4}))  # 3 failed: no repeat
    assert not error and "paid 4 to kim" in text, text
    gate.close()


def test_a_pre_registered_client_logs_in_with_its_secret(workdir, oauth_server):
    server = oauth_server(preregistered=True)
    config = config_for(workdir, server.url, oauth={"client_id": PRE_ID, "client_secret": PRE_SECRET,
                                                    "scope": SCOPE})
    done = login(config, browser_env(workdir))
    assert server.log() == ["authorize bank", "code"]  # no registration: the server has none
    assert "client" not in kept(workdir)  # the config holds it
    outputs = [done, pin(config)]
    gate = gate_host(config)
    text, error = said(gate.call("bank_balance", {"account": "A-3"}))
    assert not error and "A-3: 120 EUR" in text, text
    gate.close()
    assert_never_shown(workdir, [PRE_SECRET] + secrets_of(workdir), gate.stderr_text(),
                       *(o.stdout + o.stderr for o in outputs))


def test_the_oauth_field_is_checked_like_every_field(workdir):
    config = config_for(workdir, "http://127.0.0.1:9/mcp", oauth={"client_id": "x", "secret": PRE_SECRET})
    done = check(config)
    assert done.returncode == 1
    assert 'server "bank".oauth has an unknown field "secret"' in done.stderr, done.stderr
    assert PRE_SECRET not in done.stdout + done.stderr


def test_tokens_others_may_read_are_refused(workdir):
    config = config_for(workdir, "http://127.0.0.1:9/mcp")
    tokens = workdir / TOKENS
    tokens.write_text(json.dumps({"tokens": {"access_token": "a-token-never-shown", "token_type": "Bearer"},
                                  "client": {"client_id": "c"}}))
    tokens.chmod(0o644)
    done = check(config)
    assert done.returncode == 1 and "lets others read them: chmod 600 it" in done.stderr, done.stderr
    assert "a-token-never-shown" not in done.stdout + done.stderr


def test_login_without_the_mcp_package_says_how_to_install_it(workdir):
    fake = workdir / "fake"
    (fake / "mcp").mkdir(parents=True)
    (fake / "mcp" / "__init__.py").write_text('raise ImportError("this mcp is not installed")\n')
    config = config_for(workdir, "http://127.0.0.1:9/mcp")
    done = agentgate("login", "bank", "-config", str(config), env={"PYTHONPATH": str(fake)})
    assert done.returncode == 1 and done.stdout == "", done.stdout
    assert done.stderr == ('agentgate: error: login with server "bank" needs the optional mcp '
                           'package, version 2 or later: python3 -m pip install --upgrade mcp, or where pip '
                           "refuses to install into the system's Python: python3 -m venv ~/.agentgate-venv && "
                           '~/.agentgate-venv/bin/pip install mcp, and run agentgate with '
                           '~/.agentgate-venv/bin/python\n'), done.stderr


def test_login_names_only_url_servers(workdir):
    config = config_for(workdir, "http://127.0.0.1:9/mcp")
    done = agentgate("login", "nobody", "-config", str(config))
    assert done.returncode == 2 and '"nobody" names no server reached by url' in done.stderr, done.stderr
