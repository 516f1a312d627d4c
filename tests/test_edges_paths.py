"""Where a write lands and which host a URL names, judged as the consumers judge them
(issue 19, items 5 and 6).

`under` holds only of a path that lands inside, whatever reads it: the kernel, and the
filesystem server, which matches a name by its Unicode normalisation. A path the gate cannot
judge the way the server will (a name that matches an entry only after normalisation,
anything through /proc, a loop, too many links) lies under nothing, and no such path is ever
answered "cannot say whether it executed". `host_in` and `host_not_in` hold only of a host
node's WHATWG URL reads as the same host: a name that UTS #46 reads otherwise is no host for
either, so a deny list cannot be walked around. `host_in` may require a scheme.

The differential checks build their own trees and inputs from a fixed seed: every path the
gate allows is written through the kernel (in a directory the gate does not run in) and
through the filesystem server, and must land inside; every code point in host position is
read by agentgate and, in one batch, by node.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from conftest import Host, filesystem_server_argv  # noqa: E402
from kit import result_text, wait_no_process  # noqa: E402
from test_readme import (PLACEHOLDER_HOME, Quickstart, readme_host_snippets,  # noqa: E402
                         readme_rules)

NFC_LINK, NFD_LINK = "l\u00efnk", "li\u0308nk"
KELVIN = "\u212a"  # NFC and NFKC read it as the letter K


def P(text: str):
    return agentgate.parse(text.encode("utf-8"))


def condition(raw: dict) -> agentgate.Condition:
    return agentgate.Condition("/v", P(json.dumps(raw, ensure_ascii=False)), "where")


def holds(cond: agentgate.Condition, value) -> bool:
    return cond.holds(P(json.dumps({"v": value}, ensure_ascii=False)))


def under(*roots) -> agentgate.Condition:
    return condition({"under": [str(root) for root in roots]})


# ---------------------------------------------------------------- under: the cases


@pytest.fixture
def projects(tmp_path):
    """projects/drafts (the allowed directory) and projects/other beside it, as in the
    README's filesystem setup; drafts/lïnk (its name stored in NFC) leads to other."""
    top = tmp_path / "projects"
    (top / "drafts").mkdir(parents=True)
    (top / "other").mkdir()
    (top / "drafts" / NFC_LINK).symlink_to("../other")
    return top


def test_a_name_that_matches_a_link_only_after_normalisation_lies_under_nothing(projects):
    drafts = projects / "drafts"
    cond = under(drafts)
    assert not os.path.lexists(f"{drafts}/{NFD_LINK}")  # the NFD spelling is no entry itself
    assert not holds(cond, f"{drafts}/{NFD_LINK}/pwned.txt")
    assert not holds(cond, f"{drafts}/{NFC_LINK}/pwned.txt")
    assert not holds(under("/"), f"{drafts}/{NFD_LINK}/pwned.txt")
    # The Kelvin sign is K after NFC: a new name K beside it could be taken for that link.
    (drafts / KELVIN).symlink_to("../other")
    assert not holds(cond, f"{drafts}/K/pwned.txt")
    # A new name no entry could be taken for holds, accented or not.
    assert holds(cond, f"{drafts}/caf\u00e9.txt") and holds(cond, f"{drafts}/notes.txt")
    (drafts / "cafe\u0301").mkdir()          # an entry with the other spelling beside it
    assert holds(cond, f"{drafts}/cafe\u0301/x")   # the entry itself, byte for byte
    assert not holds(cond, f"{drafts}/caf\u00e9/x")  # a new name a server could take for it
    assert not holds(cond, f"{drafts}/caf\u00e9")


def test_a_path_through_proc_lies_under_nothing_wherever_the_gate_runs(projects, monkeypatch):
    drafts = projects / "drafts"
    monkeypatch.chdir(drafts)  # hosts often start the gate in the directory the model works in
    (projects / "other" / "self").symlink_to("/proc/self")
    (projects / "other" / "cwd").symlink_to("/proc/thread-self/cwd")
    for path in ("/proc/self/cwd/pwned.txt", "/proc/thread-self/cwd/pwned.txt",
                 f"/proc/{os.getpid()}/cwd/pwned.txt", "/proc/self/root" + str(drafts) + "/x",
                 f"{projects}/other/self/cwd/pwned.txt", f"{projects}/other/cwd/pwned.txt",
                 "/dev/fd/0", "//proc/self/cwd/x", "/proc/../proc/self/cwd/x"):
        assert not holds(under(drafts), path), path
        assert not holds(under("/"), path), path


def test_a_loop_lies_under_nothing_whatever_follows_it(projects):
    drafts = projects / "drafts"
    (drafts / "loop").symlink_to("loop")
    (drafts / "ping").symlink_to("pong")
    (drafts / "pong").symlink_to("ping")
    for path in ("loop", "loop/", "loop//", "loop//x", "loop/x", "loop/../x", "loop//..//x",
                 "ping//pong", "pong/x"):
        assert not holds(under(drafts), f"{drafts}/{path}"), path
        assert not holds(under("/"), f"{drafts}/{path}"), path


def test_a_chain_of_links_longer_than_the_kernel_follows_lies_under_nothing(projects):
    drafts = projects / "drafts"
    (drafts / "sub").mkdir()
    for i in range(1000):
        (drafts / f"c{i}").symlink_to(f"c{i + 1}" if i < 999 else "sub")
    assert not holds(under(drafts), f"{drafts}/c0/x")          # no RecursionError: no hold
    assert not holds(under(drafts), f"{drafts}/c{1000 - 41}/x")  # 41 links, one past the bound
    assert holds(under(drafts), f"{drafts}/c{1000 - 40}/x")      # 40 links, as the kernel follows
    assert holds(under(drafts), f"{drafts}/sub/x")
    # The kernel draws the line at the same place.
    assert kernel_lands(f"{drafts}/c{1000 - 41}/x") is None
    assert kernel_lands(f"{drafts}/c{1000 - 40}/x") == str((drafts / "sub" / "x").resolve())


def test_a_root_the_gate_cannot_resolve_is_refused_at_load(projects):
    (projects / "loop").symlink_to("loop")
    for root in (f"{projects}/loop", "/proc/self/cwd"):
        with pytest.raises(agentgate.ConfigError) as caught:
            under(root)
        assert "cannot be resolved as a server would" in str(caught.value)


# ---------------------------------------------------------------- under: the differential check


LINKS = {  # name in drafts -> target; the outside directory is `other`
    "out": "../other", "abs_out": "{top}/other", "in": "sub", "up": "..", "dot": ".",
    "loop": "loop", "ping": "pong", "pong": "ping", "dangling": "../other/made-by-a-link",
    "proc": "/proc/self/cwd", "thread": "/proc/thread-self", "fd": "/dev/fd",
    NFC_LINK: "../other", KELVIN: "../other", "deep_in": "sub/deep",
    "long_out": "chain0", "too_long": "chain0x",
}
NAMES = ["sub", "deep", "f.txt", "new", "n\u00e9w", "cafe\u0301", "caf\u00e9", NFD_LINK,
         NFC_LINK, "K", KELVIN, "..", ".", "", "drafts", "other", "back", "o.txt", *LINKS]
PREFIXES = ["{top}/drafts/", "{top}/drafts//", "//{top}/drafts/", "{top}/to_drafts/",
            "{top}/other/back/", "{top}/drafts/sub/../", "/proc/self/cwd/",
            "/proc/thread-self/cwd/", "{top}/drafts/sub/deep/../../"]


def generated_tree(top: Path) -> None:
    """drafts (allowed) and other (outside), with every kind of link between them."""
    (top / "drafts" / "sub" / "deep").mkdir(parents=True)
    (top / "drafts" / "cafe\u0301").mkdir()
    (top / "other").mkdir()
    (top / "drafts" / "f.txt").write_text("f")
    (top / "other" / "o.txt").write_text("o")
    (top / "other" / "back").symlink_to("../drafts")
    (top / "to_drafts").symlink_to("drafts")
    for name, target in LINKS.items():
        (top / "drafts" / name).symlink_to(target.format(top=top))
    for i in range(30):  # 30 links to the outside: within the kernel's bound of 40
        (top / "drafts" / f"chain{i}").symlink_to(f"chain{i + 1}" if i < 29 else "../other")
    for i in range(45):  # past the bound, ending inside
        (top / "drafts" / f"chain{i}x").symlink_to(f"chain{i + 1}x" if i < 44 else "sub")


def generated_paths(top: Path, count: int) -> list[str]:
    chance = random.Random(19)
    paths = []
    for i in range(count):
        parts = [chance.choice(NAMES) for _ in range(chance.randint(0, 4))]
        last = chance.choice(["", "/"]) + f"w{i}.txt" if chance.random() < 0.7 else ""
        paths.append(chance.choice(PREFIXES).format(top=top) + "/".join(parts) + last)
    return paths


def kernel_lands(path: str) -> str | None:
    """Where a write to `path` lands when the kernel resolves it, in this process's working
    directory (None: nowhere). A file it creates is removed, so the tree stays as judged."""
    existed = os.path.exists(path)
    try:
        fd = os.open(path, os.O_PATH if existed else os.O_WRONLY | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        place = os.readlink(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    if not existed:
        os.unlink(place)
    return place


def files_holding(top: Path, token: str) -> list[str]:
    found = []
    for folder, _, files in os.walk(top):
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path) and Path(path).read_bytes() == token.encode():
                found.append(path)
    return found


def inside(place: str, root: Path) -> bool:
    return place == str(root) or place.startswith(f"{root}/")


def test_no_path_under_allows_lands_outside_by_the_kernel_or_the_filesystem_server(
        tmp_path, monkeypatch):
    top = (tmp_path / "projects").resolve()
    generated_tree(top)
    drafts, other = top / "drafts", top / "other"
    cond = under(drafts)
    monkeypatch.chdir(drafts)  # the gate runs in the allowed directory; the server does not
    paths = generated_paths(top, 600)
    allowed = [path for path in paths if holds(cond, path)]
    assert 150 <= len(allowed) < len(paths) - 150, len(allowed)  # both kinds, many of each

    monkeypatch.chdir(other)
    by_kernel = {path: kernel_lands(path) for path in allowed}
    assert [(p, at) for p, at in by_kernel.items() if at and not inside(at, drafts)] == []
    assert sum(bool(at) for at in by_kernel.values()) >= 100

    with Host(filesystem_server_argv(top), cwd=other) as server:
        before = {os.path.join(f, n) for f, _, names in os.walk(top) for n in names}
        outside, landed = [], 0
        for i, path in enumerate(allowed):
            token = f"token {i}"
            answer = server.call("write_file", {"path": path, "content": token})
            places = files_holding(top, token)
            if answer.is_error:
                assert places == [], (path, result_text(answer), places)
                continue
            landed += 1
            if len(places) != 1 or not inside(places[0], drafts):
                outside.append((path, places))
            for place in places:
                if place not in before:
                    os.unlink(place)
    assert outside == []
    assert landed >= 100
    # What the gate refused includes each kind of path it cannot judge.
    refused = set(paths) - set(allowed)
    for kind in ("/proc/", NFD_LINK, "loop", "too_long"):
        assert any(kind in path for path in refused), kind


# ---------------------------------------------------------------- under: through the real gate


def test_the_readme_filesystem_setup_denies_what_it_cannot_judge(tmp_path):
    """The README's filesystem rules, served by the real gate started in ~/projects/drafts:
    the NFD spelling of a link's name, /proc/self/cwd, a loop followed by `//` and a chain of
    1,000 links are each denied (write_file's class), none answered -32603, nothing written."""
    qs = Quickstart(tmp_path)
    projects = qs.home / "projects"
    drafts, other = projects / "drafts", projects / "other"
    drafts.mkdir(parents=True)
    other.mkdir()
    (drafts / NFC_LINK).symlink_to("../other")
    (drafts / "loop").symlink_to("loop")
    for i in range(1000):
        (drafts / f"c{i}").symlink_to(f"c{i + 1}" if i < 999 else ".")
    fs = {**qs.config["servers"][0], "command": filesystem_server_argv(projects),
          "rules": readme_rules("filesystem")}
    qs.config_path.write_text(json.dumps({**qs.config, "servers": [fs]}), encoding="utf-8")
    qs.operator("pin")
    (entry,) = readme_host_snippets()["Claude Desktop"]["mcpServers"].values()
    argv = [entry["command"], *[a.replace(PLACEHOLDER_HOME, str(qs.home)) for a in entry["args"]]]
    env = {"HOME": qs.env["HOME"], "XDG_CONFIG_HOME": qs.env["XDG_CONFIG_HOME"]}
    with Host(argv, env=env, cwd=drafts) as host:
        def write(path):
            return result_text(host.call("fs_write_file", {"path": path, "content": "pwned"}))
        assert not write(f"{drafts}/a.txt").startswith(("DENIED", "PENDING"))
        for path in (f"{drafts}/{NFD_LINK}/pwned.txt", "/proc/self/cwd/pwned.txt",
                     f"{drafts}/loop//pwned.txt", f"{drafts}/c0/pwned.txt"):
            answer = write(path)
            assert answer.startswith("DENIED:"), (path, answer)
    assert sorted(p.name for p in other.iterdir()) == []
    assert not (drafts / "pwned.txt").exists()
    wait_no_process(tmp_path)


# ---------------------------------------------------------------- host_in, host_not_in


IN, NOT_IN, NEITHER = (True, False), (False, True), (False, False)

# Reads one JSON string a line (a URL); prints, a line each, the hostname node's WHATWG URL
# reads in it as JSON, or null where it reads none.
NODE_HOSTNAMES = """
const lines = require("fs").readFileSync(0, "utf8").split("\\n").filter(Boolean);
const names = lines.map(line => {
  try { return JSON.stringify(new URL(JSON.parse(line)).hostname); } catch { return "null"; }
});
process.stdout.write(names.join("\\n") + "\\n");
"""


def node_hostnames(urls: list[str]) -> list[str | None]:
    text = "".join(json.dumps(url) + "\n" for url in urls)
    done = subprocess.run(["node", "-e", NODE_HOSTNAMES], input=text.encode(),
                          capture_output=True, check=True, timeout=300)
    names = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert len(names) == len(urls)
    return names


# The schemes whose host a URL parser reads as a domain (WHATWG's special schemes); in any
# other it keeps the host as opaque text.
DOMAIN_SCHEMES = ("http", "https", "ws", "wss", "ftp", "file")


def as_node_reads(name: str | None, url: str) -> str | None:
    """node's hostname in agentgate's form: an IPv6 address in its standard form, a name
    without the one trailing dot agentgate drops (the same name to DNS), case-folded where
    the scheme's host is opaque text (node keeps its case; DNS does not)."""
    if name is None:
        return None
    if name.startswith("["):  # an IPv4 address written as IPv6 is that IPv4 host
        address = ipaddress.IPv6Address(name[1:-1])
        return str(address.ipv4_mapped or address.compressed)
    name = name[:-1] if name.endswith(".") else name
    return name if url.split(":", 1)[0] in DOMAIN_SCHEMES else name.lower()


def read_as_another(urls) -> list:
    """(url, agentgate's host, node's) for each url agentgate reads a host in that node reads
    otherwise, or not at all. A host is read in ASCII, as written: where node refuses an xn--
    label it cannot decode, it reaches no host, and agentgate may read the name as written."""
    read = [(url, agentgate.url_place(url)) for url in urls]
    read = [(url, place[1]) for url, place in read if place is not None]
    theirs = node_hostnames([url for url, _ in read])
    return [(url, ours, name) for (url, ours), name in zip(read, theirs)
            if as_node_reads(name, url) != ours and not (name is None and "xn--" in ours)]


def code_points(*ranges: range):
    return (chr(cp) for span in ranges for cp in span if not 0xD800 <= cp <= 0xDFFF)


def test_every_code_point_in_a_host_is_read_as_node_reads_it_or_not_at_all():
    # Every code point inside a label; and alone as a host, where the rule on a label's first
    # character applies, over the planes that hold combining marks (0, 1 and 14): a character
    # of any other kind is read alike wherever it stands.
    urls = [f"http://a{char}b.com/" for char in code_points(range(0x110000))]
    urls += [f"http://{char}/" for char in code_points(range(0x20000), range(0xE0000, 0xE1000))]
    assert read_as_another(urls) == []


def test_tricky_urls_are_read_as_node_reads_them_or_not_at_all():
    urls = ["http://loc\u1d43lhost/", "http://\u1d49vil.com/", "http://127.0.0.\U0001fbf1/",
            "http://%6c%6fcalhost/", "http://evil.com\\@good.com/", "http://ev\til.com/",
            "http://evil.c\nom/", "http://2130706433/", "http://0x7f.1/", "http://127.1/",
            "http://evil.com./", "http://EVIL.com/", "http://xn--a/", "http://xn--ksa/",
            "http://xn--bcher-kva.de/", "http://B\u00dcCHER.de/", "http://stra\u00dfe.de/",
            "http://\u0130stanbul.tr/", "http://\u1e9e.de/", "http://a\u200db.com/",
            "http://a\u00adb.com/", "http://\u0660.com/", "http://\u05d0\u05d1.com/",
            "http://[::ffff:127.0.0.1]/", "http://[::1]/", "http://good.com@evil.com/",
            "foo://EVIL.com/", "foo://b\u00fccher.de/", "foo://loc\u1d43lhost/",
            "file://evil.com/x", "ws://evil.com:80/", "http://xn--ls8h.la/",
            "http://\u2665.com/", "http://a\u3002b.com/", "http://\uff41.com/"]
    assert read_as_another(urls) == []


def host_verdicts(url: str, entries: list) -> tuple[bool, bool]:
    return (holds(condition({"host_in": entries}), url),
            holds(condition({"host_not_in": entries}), url))


def test_a_name_node_reads_as_another_host_holds_for_neither_list():
    rows = [("http://loc\u1d43lhost/", ["localhost"]), ("http://\u1d49vil.com/", ["evil.com"]),
            ("http://127.0.0.\U0001fbf1/", ["127.0.0.1"]), ("http://%6c%6fcalhost/", ["localhost"]),
            ("http://\uff45vil.com/", ["evil.com"]), ("http://e\u17b4vil.com/", ["evil.com"]),
            ("http://evil.com\\/", ["evil.com"]), ("http://2130706433/", ["127.0.0.1"]),
            ("http://\u1e9e.de/", ["ss.de"]), ("foo://loc\u1d43lhost/", ["localhost"]),
            ("foo://b\u00fccher.de/", ["xn--bcher-kva.de"]),
            ("http://B\u00dcCHER.de/", ["xn--bcher-kva.de"])]
    assert [(url, host_verdicts(url, entries)) for url, entries in rows
            if host_verdicts(url, entries) != NEITHER] == []
    assert host_verdicts("http://XN--BCHER-KVA.de/", ["xn--bcher-kva.de"]) == IN
    assert host_verdicts("http://xn--ksa/", ["evil.com"]) == NOT_IN  # read as written
    assert host_verdicts("foo://EVIL.com/", ["evil.com"]) == IN


def test_host_in_may_require_a_scheme():
    secure = condition({"host_in": ["https://example.com", "HTTPS://.Example.org"]})
    assert holds(secure, "https://example.com/pay") and holds(secure, "https://a.example.org/")
    for url in ("http://example.com/", "file://example.com/etc/passwd", "ws://example.com/",
                "https://example.org/", "foo://example.com/"):
        assert not holds(secure, url), url
    assert host_verdicts("file://example.com/x", ["example.com"]) == IN  # any scheme
    assert condition({"host_in": ["https://example.com"]}).text() == \
        '/v has a host in ["https://example.com"]'


def test_a_scheme_in_host_not_in_is_refused():
    for entries in (["https://evil.com"], ["evil.com", "http://.evil.com"]):
        with pytest.raises(agentgate.ConfigError) as caught:
            condition({"host_not_in": entries})
        assert "names a scheme, which only host_in may require" in str(caught.value)
    for entry in ("https://evil.com/", "1https://evil.com", "https://"):
        with pytest.raises(agentgate.ConfigError) as caught:
            condition({"host_in": [entry]})
        assert "is not a host name" in str(caught.value)


# ---------------------------------------------------------------- host_in entries, against node

HOSTS = ["example.com", "Example.COM", "a.example.com", "b.A.example.com", "example.com.",
         "notexample.com", "example.co", "com", "xn--bcher-kva.de",
         "WWW.XN--bcher-kva.de", "www.xn--bcher-kva.de", "127.0.0.1", "[::1]",
         "[::ffff:127.0.0.1]", "[0:0:0:0:0:0:0:1]", "a.b.c.d.example.com"]
URL_SCHEMES = ["http", "https", "ws", "wss", "ftp"]


def entries_of(host: str) -> list[tuple[str, str, bool, str]]:
    """(entry, its scheme or '', dotted, the host name it names) in every form."""
    forms = [(host, "", False, host), ("https://" + host, "https", False, host),
             ("HTTP://" + host, "http", False, host)]
    if not host.startswith("[") and not host[-1].isdigit():
        forms += [("." + host, "", True, host), ("wss://." + host, "wss", True, host)]
    return forms


def test_host_matches_answers_as_comparing_node_readings_does():
    urls = [f"{scheme}://{host}/x" for scheme in URL_SCHEMES for host in HOSTS]
    entries = [form for host in HOSTS for form in entries_of(host)]
    url_hosts = node_hostnames(urls)
    entry_hosts = node_hostnames([f"http://{name}/" for _, _, _, name in entries])
    verdicts, wrong = [], []
    for url, url_host in zip(urls, url_hosts):
        scheme, theirs_host = url.split("://")[0], as_node_reads(url_host, url)
        place = agentgate.url_place(url)
        assert place is not None and theirs_host is not None, url
        for (entry, wanted, dotted, _), entry_host in zip(entries, entry_hosts):
            name = as_node_reads(entry_host, "http:")
            theirs = (not wanted or wanted == scheme) and (
                theirs_host.endswith("." + name) if dotted else theirs_host == name)
            ours = agentgate.host_matches(*place, [agentgate.host_entry(entry, True, "w")])
            verdicts.append(ours)
            if ours != theirs:
                wrong.append((url, entry, ours, theirs))
    assert wrong == []
    assert 200 <= sum(verdicts) <= len(verdicts) - 2000  # many of each


# ---------------------------------------------------------------- under's roots, against the kernel


def kernel_dir(path: str) -> str | None:
    """The directory the kernel opens at `path`, or None."""
    try:
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def test_a_root_resolves_where_the_kernel_resolves_it_or_is_refused(tmp_path, monkeypatch):
    """A root is normalised as written (SPEC), then its links are followed: where the kernel
    opens that directory, resolved_root names the same one; what it cannot judge is refused."""
    top = (tmp_path / "projects").resolve()
    generated_tree(top)
    monkeypatch.chdir(top / "other")
    monkeypatch.setenv("HOME", str(top))
    chance = random.Random(22)
    prefixes = PREFIXES + ["~/drafts/", "~/"]
    roots = [chance.choice(prefixes).format(top=top) +
             "/".join(chance.choice(NAMES) for _ in range(chance.randint(0, 3)))
             for _ in range(500)]
    agree, refused, wrong = 0, [], []
    for root in roots:
        try:
            ours = agentgate.resolved_root(root, "w")
        except agentgate.ConfigError:
            refused.append(root)
            continue
        theirs = kernel_dir(os.path.normpath(str(top) + root[1:] if root[0] == "~" else root))
        if theirs is not None:
            agree += ours == theirs
            if ours != theirs:
                wrong.append((root, ours, theirs))
    assert wrong == []
    assert agree >= 100
    for kind in ("/proc/", NFD_LINK, "loop", "too_long"):
        assert any(kind in root for root in refused), kind
