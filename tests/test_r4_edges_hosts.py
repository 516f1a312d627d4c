"""A URL with an empty label names no host, and reading a URL never raises (issue 28, item 15).

Specification: section 14's contract and SPEC "Policy on what a call does": a URL whose host
cannot be read makes host_in and host_not_in not hold, and the call gets the policy's answer;
a condition that raises would make the gate answer that it cannot say whether the call
executed, though nothing ran.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from conftest import AGENTGATE, Host  # noqa: E402
from kit import expect, pin, result_text, rule, scripted_server, tool, write_config  # noqa: E402
from test_edges_paths import read_as_another  # noqa: E402

EMPTY_LABELS = ["http://\u00e9..com/", "https://a.tru\u034fsted.org..:443/", "http://..\u00e9/",
                "http://\u00e9.com../", "http://.\u00e9.com/", "http://\u0301..a/",
                "ws://a..\u00fc/", "http://\u00e9..com./", "http://a..b/"]


@pytest.mark.parametrize("url", EMPTY_LABELS)
def test_a_url_with_an_empty_label_names_no_host(url):
    assert agentgate.url_place(url) is None


# What generated hosts are made of: ASCII, letters IDNA maps or refuses, combining marks,
# joiners, dots of other scripts, digits, right-to-left letters, and nothing at all.
PIECES = ["a", "b", "com", "xn--", "xn--9ca", "-", "_", "0", "1", "0x7f", "\u00e9", "\u00df",
          "\u0130", "\u0301", "\u034f", "\u200d", "\u00ad", "\u3002", "\uff0e", "\u0660",
          "\u05d0", "\u1d43", "\u2665", "\U0001f600", "\u17b4", "\uff41", "%41", "[", "]",
          ":", "@", "", "."]


def generated_urls(count: int, seed: int) -> list[str]:
    chance = random.Random(seed)
    urls = []
    for _ in range(count):
        labels = ["".join(chance.choices(PIECES, k=chance.randint(0, 3)))
                  for _ in range(chance.randint(1, 4))]
        host = ".".join(labels) + chance.choice(["", ".", ".."])
        scheme = chance.choice(["http", "https", "ws", "foo", "file"])
        # node refuses a file URL with userinfo or a port, where agentgate reads its host.
        if scheme == "file" and ("@" in host or ":" in host):
            scheme = "http"
        user = chance.choice(["", "u@", "u:p@"]) if scheme != "file" else ""
        port = chance.choice(["", ":443", ":", ":x"]) if scheme != "file" else ""
        urls.append(f"{scheme}://{user}{host}{port}/p")
    return urls


def test_no_generated_url_makes_reading_it_raise_and_none_is_read_as_another():
    urls = generated_urls(20_000, 28)
    raised = []
    for url in urls:
        try:
            agentgate.url_place(url)
        except Exception as err:  # what the gate would answer -32603 for
            raised.append((url, repr(err)))
    assert raised == []
    assert read_as_another(urls) == []


# ---------------------------------------------------------------- through a real gate


def test_a_call_with_such_a_url_gets_the_policys_answer(workdir):
    allow = {"if": {"/url": {"host_in": ["xn--9ca.com", "trusted.org"]}}, "outcome": "allow"}
    deny = {"if": {"/url": {"host_not_in": ["xn--9ca.com"]}}, "outcome": "deny",
            "reason": "not a known host"}
    spec = {"tools": [tool("fetch", {"type": "object", "properties": {"url": {"type": "string"}}}),
                      tool("post", {"type": "object", "properties": {"url": {"type": "string"}}})]}
    config = write_config(workdir, [scripted_server(workdir, spec, name="web", rules={
        "fetch": rule("remote_mutation", when=[allow], outcome="deny"),
        "post": rule("remote_mutation", when=[deny], outcome="allow")})])
    pin(config)
    with Host([sys.executable, str(AGENTGATE), "-config", str(config)]) as host:
        for url in EMPTY_LABELS[:2]:
            text = expect(host.call("web_fetch", {"url": url}), "DENIED", True)
            assert "Nothing was executed" in text, text
            # host_not_in does not hold either: the deny entry is passed, the rule allows.
            assert result_text(host.call("web_post", {"url": url})) == "called post"
        assert result_text(host.call("web_fetch", {"url": "http://xn--9ca.com/"})) == \
            "called fetch"
        # A host not in ASCII holds for neither list, as an unreadable one.
        expect(host.call("web_fetch", {"url": "http://\u00e9.com/"}), "DENIED", True)
        assert result_text(host.call("web_post", {"url": "http://\u00e9.com/"})) == "called post"
