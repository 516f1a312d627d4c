"""The official Python SDK's own OAuth client, as a conformance client: the yardstick for which
of the suite's auth scenarios agentgate's `login` must pass (those this client passes).

    python3 conformance_sdk_client.py URL

It connects with the SDK's OAuthClientProvider (discovery, registration or the pre-registered
client in MCP_CONFORMANCE_CONTEXT, PKCE, tokens in memory), consents as a headless browser
would (the authorization endpoint redirects at once with a code), lists the tools and calls
`test-tool`, as a host would after logging in.
"""

import json
import os
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import anyio
import httpx2

from mcp import Client
from mcp.client.auth import OAuthClientProvider
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.auth import AuthorizationCodeResult, OAuthClientInformationFull, OAuthClientMetadata

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from agentgate import LoginStore  # noqa: E402

REDIRECT = "http://127.0.0.1:9/callback"  # never reached: the redirect is read, not followed
CIMD_URL = "https://conformance-test.local/client-metadata.json"  # the id basic-cimd expects


class Memory(LoginStore):
    """Tokens in memory, as agentgate's login keeps them; `client` pre-registered."""

    def __init__(self, client=None):
        self.tokens, self.client = None, client


async def main(url: str) -> None:
    context = json.loads(os.environ.get("MCP_CONFORMANCE_CONTEXT") or "{}")
    metadata = OAuthClientMetadata(redirect_uris=[REDIRECT], client_name="sdk-conformance",
                                   grant_types=["authorization_code", "refresh_token"],
                                   response_types=["code"])
    registered = None
    if "client_id" in context:
        registered = OAuthClientInformationFull(
            client_id=context["client_id"], client_secret=context.get("client_secret"),
            redirect_uris=[REDIRECT], token_endpoint_auth_method="client_secret_basic")
    codes = []

    async def consent(authorization_url: str) -> None:
        async with httpx2.AsyncClient() as http:
            answer = await http.get(authorization_url, follow_redirects=False)
        query = parse_qs(urlsplit(answer.headers["location"]).query)
        state = query.get("state", [None])[0]
        codes.append(AuthorizationCodeResult(code=query["code"][0], state=state))

    async def callback() -> AuthorizationCodeResult:
        return codes.pop()

    auth = OAuthClientProvider(url, metadata, Memory(registered), consent, callback,
                               client_metadata_url=CIMD_URL)
    async with httpx2.AsyncClient(auth=auth) as http:
        async with Client(streamable_http_client(url, http_client=http)) as client:
            await client.list_tools()
            await client.call_tool("test-tool", {})


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
