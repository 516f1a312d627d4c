#!/usr/bin/env python3
"""Benchmark agentgate's own cost, run by hand: python3 tests/bench.py [-n CALLS]

It prints a table and asserts nothing. Every figure is measured side by side in one run
(straight to the fake payment server, then through agentgate), because the machines these run
on are shared and noisy: read the ratios and differences, not the absolute numbers. A lean
JSON-RPC driver is used instead of an SDK so that the figures are agentgate's own.

To compare versions: python3 tests/bench.py --side-by-side A/agentgate.py B/agentgate.py
runs the per-call figures of each file in turns, round after round, and prints their medians.
python3 tests/bench.py --floor sets an allowed read beside bare relays (tests/bench_relay.py)
that decide and record nothing but one durable commit: the floor of a gate of this shape.
"""

import argparse
import json
import os
import queue
import secrets
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
AGENTGATE = os.path.join(os.path.dirname(HERE), "agentgate.py")
# Issue 11's targets, as ratios to figures measured in the same run where a ratio travels
# between machines: one durable SQLite commit on the same disk, the straight throughput, the
# slowest upstream's start plus agentgate's own interpreter start (`-version`).
TARGETS = {"read p50 / commit": 2.5, "read p99 / commit": 5.0, "mutation p50 / commit": 4.0,
           "throughput share": 0.30, "startup added": 60, "history ratio": 1.2,
           "bytes/call": 2048, "rss MB": 40}


class Driver:
    """JSON-RPC lines to a child process; answers matched by id on a reader thread."""

    def __init__(self, argv, cwd, env=None):
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.waiting, self.lock, self.next_id = {}, threading.Lock(), 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.lock:
                slot = self.waiting.pop(message.get("id"), None)
            if slot:
                slot.put(message)

    def send(self, method, params):
        with self.lock:
            self.next_id += 1
            ident = self.next_id
            slot = queue.Queue()
            self.waiting[ident] = slot
            self.proc.stdin.write(json.dumps({"jsonrpc": "2.0", "id": ident, "method": method,
                                              "params": params}).encode() + b"\n")
            self.proc.stdin.flush()
        return slot

    def request(self, method, params):
        message = self.send(method, params).get(timeout=60)
        if "error" in message:
            raise RuntimeError(message["error"])
        return message["result"]

    def initialize(self):
        self.request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                    "clientInfo": {"name": "bench", "version": "1"}})

    def rss_peak_mb(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def reset_rss_peak(self):
        """Start the peak RSS count over (Linux: 5 to clear_refs resets VmHWM to VmRSS)."""
        with open(f"/proc/{self.proc.pid}/clear_refs", "w") as f:
            f.write("5")

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def sequential(driver, tool, n, mutating=False):
    """p50 and p99 (ms) of `n` calls one after another; a mutating call pays a new amount each
    time, so no two are the same request."""
    def args(i):
        return {"name": tool, "arguments": {"to": "bench", "amount": i + 1} if mutating
                else {"account": "bench"}}
    for i in range(20):
        driver.request("tools/call", args(n + i))
    times = []
    for i in range(n):
        start = time.perf_counter()
        result = driver.request("tools/call", args(i))
        times.append((time.perf_counter() - start) * 1000)
        assert ("paid" if mutating else "holds") in result["content"][0]["text"], result
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.99) - 1]


def durable_commit(directory, n=300):
    """p50 (ms) of one small durable commit on this disk, as agentgate's store makes them (WAL,
    synchronous=FULL, BEGIN IMMEDIATE): the unit the gate's added latency is measured in."""
    db = sqlite3.connect(os.path.join(directory, "commit.db"), isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT)")
    times = []
    for _ in range(n):
        start = time.perf_counter()
        db.execute("BEGIN IMMEDIATE")
        db.execute("INSERT INTO t(v) VALUES(?)", ("x" * 200,))
        db.execute("COMMIT")
        times.append((time.perf_counter() - start) * 1000)
    db.close()
    return statistics.median(times)


def version_start(cwd):
    """ms for `agentgate.py -version`: the interpreter's start and the compile of the file."""
    start = time.perf_counter()
    subprocess.run([sys.executable, AGENTGATE, "-version"], cwd=cwd, check=True,
                   stdout=subprocess.DEVNULL)
    return (time.perf_counter() - start) * 1000


def throughput(driver, tool, n, in_flight=16):
    args = {"name": tool, "arguments": {"account": "bench"}}
    start = time.perf_counter()
    pending = [driver.send("tools/call", args) for _ in range(in_flight)]
    sent = in_flight
    while pending:
        pending.pop(0).get(timeout=60)
        if sent < n:
            pending.append(driver.send("tools/call", args))
            sent += 1
    return n / (time.perf_counter() - start)


def startup(argv, cwd, env=None):
    driver = Driver(argv, cwd, env)
    driver.initialize()
    driver.request("tools/list", {})
    elapsed = (time.perf_counter() - driver.started) * 1000
    driver.close()
    return elapsed


def startup_of_several(argv, cwd, count):
    """Spawn `count` copies at once; the time until the slowest has answered tools/list."""
    drivers = [Driver(argv, cwd) for _ in range(count)]
    for driver in drivers:
        driver.initialize()
        driver.request("tools/list", {})
    elapsed = (time.perf_counter() - drivers[0].started) * 1000
    for driver in drivers:
        driver.close()
    return elapsed


def write_config(directory, servers):
    config = {"database": "bench.db", "session": "bench", "hold": "0s", "servers": [
        {"name": f"bank{i}" if i else "bank", "command": [sys.executable, AGENTGATE,
                                                          "fake-payments"],
         "manifest": f"bank{i}.manifest.json",
         "env": [f"FAKE_PAYMENTS_LEDGER={os.path.join(directory, 'ledger')}"],
         "rules": {"balance": {"side_effect": "read_only", "timeout": "10s"},
                   "pay": {"side_effect": "remote_mutation", "outcome": "allow",
                           "timeout": "10s"}}}
        for i in range(servers)]}
    path = os.path.join(directory, f"config{servers}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    os.chmod(path, 0o600)
    subprocess.run([sys.executable, AGENTGATE, "pin", "-config", path], check=True,
                   stdout=subprocess.DEVNULL)
    return path


def db_bytes(directory):
    path = os.path.join(directory, "bench.db")
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    return sum(os.path.getsize(path + s) for s in ("", "-wal") if os.path.exists(path + s))


def add_earlier_runs(directory, count):
    """Copy one recorded allowed call `count` times under fresh ids: the rows a busy history
    leaves (runs, steps, events), without paying for `count` real calls. An allowed read
    leaves no row in the calls index; each copy gets one anyway, settled, as the mutations of
    a busy history would leave, so the index the rules read is as large as the history."""
    db = sqlite3.connect(os.path.join(directory, "bench.db"), isolation_level=None)
    run = db.execute("SELECT * FROM runs ORDER BY rowid DESC LIMIT 1").fetchone()
    steps = db.execute("SELECT * FROM steps WHERE run_id=?", (run[0],)).fetchall()
    events = db.execute("SELECT run_id, step_id, at, type, payload_json, hash FROM events "
                        "WHERE run_id=?", (run[0],)).fetchall()
    call = (run[1], "", run[2], "read_only", run[0], run[7], 0, run[8], run[8], 2)
    db.execute("BEGIN")
    db.execute("UPDATE calls SET open=0")
    # Earlier runs have earlier ids, as agentgate's time-first ids do.
    start = (time.time_ns() // 1_000_000 - 10 * count) & 0xFFFFFFFFFF
    ids = [f"{start + 10 * i:010x}{secrets.token_hex(3)}" for i in range(count)]
    for number in range(count):
        run_id = f"bench.{ids[number]}"
        db.execute(f"INSERT INTO runs VALUES({','.join('?' * len(run))})", (run_id, *run[1:]))
        for step in steps:
            step_id = ids[number] + secrets.token_hex(8)
            db.execute(f"INSERT INTO steps VALUES({','.join('?' * len(step))})",
                       (step_id, run_id, *step[2:]))
        db.executemany("INSERT INTO events(run_id, step_id, at, type, payload_json, hash) "
                       "VALUES(?,?,?,?,?,?)", [(run_id, *e[1:]) for e in events])
        db.execute("INSERT INTO calls(session, request_key, tool, side_effect, run_id, "
                   "created_at, open, closed_at, settled_at, outcome) VALUES(?,?,?,?,?,?,0,?,?,?)",
                   (call[0], secrets.token_hex(32), call[2], call[3], run_id, call[5], call[7],
                    call[8], call[9]))
    db.execute("COMMIT")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()


def hostile_figures():
    """Seconds (median of 3) that one hostile input holds the gate's parser, encoder and
    pattern matcher in-process: each must stay proportional to the input, never blow up."""
    sys.path.insert(0, os.path.dirname(AGENTGATE))
    import agentgate

    def median_of(fn):
        times = []
        for _ in range(3):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    escapes = b'{"a":"' + b'\\"' * (7 << 20) + b'"}'
    flat = b"[" + b"[],{}," * (2 << 20) + b"[]]"
    matcher = agentgate.compile_pattern("^(a+)+$")
    return [
        ("parse, 14 MB of escaped quotes (s)", median_of(lambda: agentgate.parse(escapes))),
        ("depth check, 12 MB of flat brackets (s)", median_of(lambda: agentgate._too_deep(flat))),
        ("canonical, 8 MB string of quotes (s)",
         median_of(lambda: agentgate.canonical('"' * (8 << 20)))),
        ("^(a+)+$ against 1 MB of a then ! (s)",
         median_of(lambda: matcher.search("a" * (1 << 20) + "!"))),
    ]


def policy_figures(history):
    """The policy engine in-process, medians of single evaluations (ms): what a rule of five
    conditions adds to a decision, and a limit check (the window's executions read through
    the index with their steps' recorded arguments, then summed) on an empty database and on
    one holding `history` earlier executions of the tool, all before the window, and as many
    of another tool."""
    sys.path.insert(0, os.path.dirname(AGENTGATE))
    import agentgate
    directory = tempfile.mkdtemp(prefix="agentgate-bench-policy-")
    try:
        config_path = os.path.join(directory, "policy.json")
        entry = {"if": {"/amount": {"max": "50.00"}, "/to": {"in": ["grocer", "landlord"]},
                        "/currency": {"equals": "EUR"}, "/memo": {"max_length": 200},
                        "/url": {"host_in": [".example.com"]}},
                 "outcome": "allow", "reason": "five conditions"}
        limit = {"sum": "/amount", "max": "100000", "per": "24h"}
        raw = {"database": "policy.db", "session": "bench", "servers": [{
            "name": "bank", "command": ["true"], "manifest": "m.json", "rules": {
                "plain": {"side_effect": "remote_mutation", "timeout": "5s"},
                "five": {"side_effect": "remote_mutation", "timeout": "5s", "when": [entry],
                         "limits": [limit]}}}]}
        config = agentgate.Config(agentgate.parse(json.dumps(raw)), config_path)
        server = config.servers[0]
        schema = {"type": "object"}
        plain, five = (agentgate.Tool(server, None, {"name": name, "input_schema": schema},
                                      server.rules[name]) for name in ("plain", "five"))
        args = agentgate.parse(json.dumps({"to": "landlord", "amount": 20, "currency": "EUR",
                                           "memo": "rent", "url": "https://pay.example.com/x"}))
        facts = agentgate.Facts(time.time(), "bench", lambda: [], None)

        def median_ms(fn, n):
            times = []
            for _ in range(n):
                started = time.perf_counter_ns()
                fn()
                times.append(time.perf_counter_ns() - started)
            return statistics.median(times) / 1e6
        bare = median_ms(lambda: agentgate.policy_decision(config, plain, args, facts), 20000)
        ruled = median_ms(lambda: agentgate.policy_decision(config, five, args, facts), 20000)
        assert agentgate.policy_decision(config, five, args, facts)["by"] == "when[0]"

        rule_limit = five.rule.limits[0]

        def limit_check(store):
            uses = agentgate.counted_uses(store.read, five, agentgate.now())
            return rule_limit.frees(args, uses, time.time(), five.schema)
        # Each execution with the step it ran, whose recorded arguments a sum reads.
        decision = json.dumps({"args": {"to": "grocer", "amount": 10}, "kind": "tool_call",
                               "origin": "model", "tool": "five"})

        def add(db, rows):
            """Executions (target, time, step id), each with its step, all in one run."""
            rows = list(rows)
            first = db.execute("SELECT count(*) FROM steps").fetchone()[0]
            db.executemany("INSERT INTO executions(tool, at, run_id, step_id) VALUES(?,?,?,?)",
                           [(target, at, "bench.run", step) for target, at, step in rows])
            db.executemany("INSERT INTO steps(id, run_id, idx, status, decision_json, spec_hash,"
                           " started_at) VALUES(?,'bench.run',?,'done',?,?,?)",
                           [(step, first + i, decision, five.spec_hash, at)
                            for i, (_, at, step) in enumerate(rows)])
        recent = [(five.target, agentgate.format_time(time.time() - 60 * i), f"recent{i}")
                  for i in range(1, 11)]
        week = time.time() - 7 * 86400
        stores = []
        for name, earlier in (("empty.db", 0), ("full.db", history)):
            store = agentgate.Store(os.path.join(directory, name))
            store.db.execute("BEGIN")
            store.db.execute("INSERT INTO runs(id, session, tool, status, created_at) "
                             "VALUES('bench.run', 'bench', 'five', 'COMPLETED', ?)",
                             (agentgate.now(),))
            add(store.db, recent)
            for target in (five.target, "bank/other"):
                add(store.db, ((target, agentgate.format_time(week - i * 0.5), f"{target}{i}")
                               for i in range(earlier)))
            store.db.execute("COMMIT")
            stores.append(store)
            window = agentgate.counted_uses(store.read, five, agentgate.now())(week + 86400)
            assert [amounts["/amount"] for _, amounts in window] == [10] * 10, window
        # Side by side: the two databases take turns, so load on the machine hits both alike.
        times = ([], [])
        for _ in range(3000):
            for store, kept in zip(stores, times):
                started = time.perf_counter_ns()
                limit_check(store)
                kept.append(time.perf_counter_ns() - started)
        empty, full = (statistics.median(kept) / 1e6 for kept in times)
        for store in stores:
            store.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return [
        ("policy: a decision, no entries (ms)", f"{bare:.4f}", ""),
        ("policy: a rule of 5 conditions, added (ms)", f"{ruled - bare:.4f}", "<= 0.1"),
        ("policy: a sum limit check, empty database (ms)", f"{empty:.4f}", ""),
        (f"policy: the same with {history} earlier executions (ms)", f"{full:.4f}",
         f"ratio {full / empty:.2f}"),
    ]


def slow_pattern_figures(n=10):
    """The delay a slow pattern on one call adds to an unrelated call (issue 19): the median
    (ms) of an allowed read's latency while another call is being checked against a pattern of
    the slowest kind (its lazy DFA meets a new state at nearly every character), against the
    same read with nothing else in flight. Each of `n` slow calls sends a fresh text that
    costs nearly all the pattern work one call may spend; reads follow one another from just
    after it is sent until it is answered."""
    sys.path.insert(0, os.path.dirname(AGENTGATE))
    import agentgate
    import random
    slow = "[ab]*a[ab]{400}c"
    length = agentgate.PATTERN_WORK // agentgate.compile_pattern(slow).size - 1
    directory = tempfile.mkdtemp(prefix="agentgate-bench-pattern-")
    try:
        spec = os.path.join(directory, "check.spec.json")
        with open(spec, "w") as f:
            json.dump({"tools": [{"name": "check", "description": "Check a code.", "inputSchema": {
                "type": "object", "properties": {"code": {"type": "string", "pattern": slow}}}}]},
                f)
        read_only = {"side_effect": "read_only", "timeout": "10s"}
        config = {"database": "bench.db", "session": "bench", "hold": "0s", "servers": [
            {"name": "bank", "command": [sys.executable, AGENTGATE, "fake-payments"],
             "manifest": "bank.manifest.json",
             "env": [f"FAKE_PAYMENTS_LEDGER={os.path.join(directory, 'ledger')}"],
             "rules": {"balance": read_only}},
            {"name": "svc", "command": [sys.executable, os.path.join(HERE, "scripted_server.py"),
                                        spec],
             "manifest": "svc.manifest.json", "rules": {"check": read_only}}]}
        path = os.path.join(directory, "config.json")
        with open(path, "w") as f:
            json.dump(config, f)
        os.chmod(path, 0o600)
        subprocess.run([sys.executable, AGENTGATE, "pin", "-config", path], check=True,
                       stdout=subprocess.DEVNULL)
        gate = Driver([sys.executable, AGENTGATE, "-config", path], directory)
        gate.initialize()
        read = {"name": "bank_balance", "arguments": {"account": "bench"}}

        def latency():
            start = time.perf_counter()
            gate.request("tools/call", read)
            return (time.perf_counter() - start) * 1000
        rng = random.Random(19)
        alone, beside = [], []
        for _ in range(n):
            alone += [latency() for _ in range(20)]
            code = "".join(rng.choice("ab") for _ in range(length))
            checking = gate.send("tools/call", {"name": "svc_check", "arguments": {"code": code}})
            while checking.empty():
                beside.append(latency())
            answer = checking.get()["result"]["content"][0]["text"]
            assert answer.startswith("INVALID"), answer
        gate.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    added = statistics.median(beside) - statistics.median(alone)
    return [
        ("slow pattern on one call: delay of an unrelated call (ms)", f"{added:.1f}",
         f"<= 100 ({len(beside)} reads beside {n} slow calls)"),
    ]


def both_ends(directory, config):
    """The fake payment server alone, and agentgate in front of it, both initialized."""
    ledger = {**os.environ, "FAKE_PAYMENTS_LEDGER": os.path.join(directory, "ledger")}
    straight = Driver([sys.executable, AGENTGATE, "fake-payments"], directory, ledger)
    straight.initialize()
    gate = Driver([sys.executable, AGENTGATE, "-config", config], directory)
    gate.initialize()
    return straight, gate


def per_call_figures(path, n):
    """The per-call ratios of the agentgate file at `path`, in a directory of their own: the
    added read and mutation p50 over one durable commit, and the share of the straight
    throughput with 16 calls in flight."""
    global AGENTGATE
    AGENTGATE = path
    directory = tempfile.mkdtemp(prefix="agentgate-bench-ab-")
    try:
        commit = durable_commit(directory)
        straight, gate = both_ends(directory, write_config(directory, 1))
        s50, _ = sequential(straight, "balance", n)
        g50, _ = sequential(gate, "bank_balance", n)
        sm50, _ = sequential(straight, "pay", n, mutating=True)
        gm50, _ = sequential(gate, "bank_pay", n, mutating=True)
        s_rate = throughput(straight, "balance", n)
        g_rate = throughput(gate, "bank_balance", n)
        gate.close()
        straight.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {"commit p50 (ms)": commit, "read added p50 (ms)": g50 - s50,
            "read p50 / commit": (g50 - s50) / commit,
            "mutation added p50 (ms)": gm50 - sm50, "mutation p50 / commit": (gm50 - sm50) / commit,
            "throughput share": g_rate / s_rate}


def floor_figures(n, rounds):
    """The added p50 over one durable commit of agentgate's allowed read and mutation, and of
    bare relays in front of the same server (tests/bench_relay.py: inline, + a durable commit,
    + a worker handoff, + two commits), measured in turns round after round; medians."""
    relay = os.path.join(HERE, "bench_relay.py")
    seen = {}
    for _ in range(rounds):
        directory = tempfile.mkdtemp(prefix="agentgate-bench-floor-")
        try:
            commit = durable_commit(directory)
            straight, gate = both_ends(directory, write_config(directory, 1))
            ledger = {**os.environ, "FAKE_PAYMENTS_LEDGER": os.path.join(directory, "ledger")}
            server = [sys.executable, AGENTGATE, "fake-payments"]
            ends = [("straight", straight, "balance")]
            for mode in ("inline", "durable", "pooled", "twice"):
                end = Driver([sys.executable, relay, mode, os.path.join(directory, mode + ".db"),
                              "--", *server], directory, ledger)
                end.initialize()
                ends.append((f"bare relay, {mode}", end, "balance"))
            ends.append(("agentgate", gate, "bank_balance"))
            p50 = {name: sequential(end, tool, n)[0] for name, end, tool in ends}
            p50["agentgate, mutation"] = sequential(gate, "bank_pay", n, mutating=True)[0]
            p50["straight, mutation"] = sequential(straight, "pay", n, mutating=True)[0]
            for _, end, _ in ends:
                end.close()
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        seen.setdefault("one durable commit p50 (ms)", []).append(commit)
        for name, _, _ in ends[1:]:
            seen.setdefault(f"{name}: read added / commit", []).append(
                (p50[name] - p50["straight"]) / commit)
        seen.setdefault("agentgate: mutation added / commit", []).append(
            (p50["agentgate, mutation"] - p50["straight, mutation"]) / commit)
    width = max(len(name) for name in seen)
    for name, values in seen.items():
        print(f"{name:<{width}}  {statistics.median(values):8.3f}   (rounds: "
              f"{' '.join(f'{v:.2f}' for v in values)})")
    print(f"(medians of {rounds} rounds of {n} sequential calls; targets: read added <= "
          f"{TARGETS['read p50 / commit']}x commit, mutation <= "
          f"{TARGETS['mutation p50 / commit']}x; a bare relay's calls are reads of the same "
          f"server, `twice` committing as a mutation must)")


def side_by_side(paths, n, rounds):
    """Each file's per-call figures, the files taking turns round after round so that a
    change in the machine's load falls on all of them alike; medians of the rounds."""
    seen = {path: {} for path in paths}
    for _ in range(rounds):
        for path in paths:
            for name, value in per_call_figures(path, n).items():
                seen[path].setdefault(name, []).append(value)
    names = list(seen[paths[0]])
    width = max(len(name) for name in names)
    print(f"{'':<{width}}  " + "  ".join(f"{os.path.basename(os.path.dirname(p)) or p:>14}"
                                           for p in paths))
    for name in names:
        print(f"{name:<{width}}  " + "  ".join(
            f"{statistics.median(seen[p][name]):>14.3f}" for p in paths))
    print(f"(medians of {rounds} rounds of {n} calls; each column is the directory of its "
          f"agentgate.py)")


def main():
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--side-by-side", nargs="+", metavar="AGENTGATE_PY",
                         help="only the per-call figures, of each file given, in turns")
    options.add_argument("--floor", action="store_true",
                         help="only a call's cost beside bare relays' (the floor)")
    options.add_argument("--rounds", type=int, default=5, help="rounds of --side-by-side")
    options.add_argument("-n", type=int, default=1000, help="sequential calls per figure")
    options.add_argument("--history", type=int, default=1000000, help="earlier runs to add")
    options.add_argument("--policy-history", type=int, default=1000000,
                         help="earlier executions for the limit check")
    opts = options.parse_args()
    if opts.floor:
        return floor_figures(opts.n, opts.rounds)
    if opts.side_by_side:
        return side_by_side([os.path.abspath(p) for p in opts.side_by_side], opts.n,
                            opts.rounds)
    directory = tempfile.mkdtemp(prefix="agentgate-bench-")
    try:
        config1 = write_config(directory, 1)
        config3 = write_config(directory, 3)
        commit = durable_commit(directory)
        straight, gate = both_ends(directory, config1)
        s50, s99 = sequential(straight, "balance", opts.n)
        size_before = db_bytes(directory)
        g50, g99 = sequential(gate, "bank_balance", opts.n)
        per_call = (db_bytes(directory) - size_before) / (opts.n + 20)
        sm50, _ = sequential(straight, "pay", opts.n, mutating=True)
        gm50, gm99 = sequential(gate, "bank_pay", opts.n, mutating=True)
        s_rate = throughput(straight, "balance", opts.n)
        gate.reset_rss_peak()  # the peak while serving, not the compile of the file at start
        g_rate = throughput(gate, "bank_balance", opts.n)
        rss = gate.rss_peak_mb()
        gate.close()
        straight.close()

        up_version = statistics.median(version_start(directory) for _ in range(5))
        up_straight = statistics.median(
            startup([sys.executable, AGENTGATE, "fake-payments"], directory) for _ in range(5))
        up_three_straight = statistics.median(
            startup_of_several([sys.executable, AGENTGATE, "fake-payments"], directory, 3)
            for _ in range(5))
        up_one = statistics.median(
            startup([sys.executable, AGENTGATE, "-config", config1], directory)
            for _ in range(5))
        up_three = statistics.median(
            startup([sys.executable, AGENTGATE, "-config", config3], directory)
            for _ in range(5))

        add_earlier_runs(directory, opts.history)
        gate = Driver([sys.executable, AGENTGATE, "-config", config1], directory)
        gate.initialize()
        h50, h99 = sequential(gate, "bank_balance", opts.n)
        gate.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    read, mutation = g50 - s50, gm50 - sm50
    rows = [
        ("one durable commit on this disk p50 (ms)", f"{commit:.3f}", ""),
        ("allowed read, straight p50 / p99 (ms)", f"{s50:.3f} / {s99:.3f}", ""),
        ("allowed read, through agentgate p50 / p99 (ms)", f"{g50:.3f} / {g99:.3f}", ""),
        ("allowed read, added p50 / p99 (ms)", f"{read:.3f} / {g99 - s99:.3f}",
         f"{read / commit:.1f}x / {(g99 - s99) / commit:.1f}x commit <= "
         f"{TARGETS['read p50 / commit']}x / {TARGETS['read p99 / commit']}x"),
        ("allowed mutation, added p50 / p99 (ms)", f"{mutation:.3f} / {gm99 - sm50:.3f}",
         f"{mutation / commit:.1f}x commit <= {TARGETS['mutation p50 / commit']}x"),
        ("calls/s with 16 in flight, straight", f"{s_rate:.0f}", ""),
        ("calls/s with 16 in flight, through agentgate", f"{g_rate:.0f}",
         f"{g_rate / s_rate:.0%} >= {TARGETS['throughput share']:.0%}"),
        ("agentgate.py -version (ms)", f"{up_version:.1f}", ""),
        ("spawn to tools/list, straight (ms)", f"{up_straight:.1f}", ""),
        ("spawn to tools/list, agentgate + 1 upstream (ms)", f"{up_one:.1f}",
         f"added {up_one - up_straight - up_version:.1f} over both <= "
         f"{TARGETS['startup added']}"),
        ("spawn to tools/list, 3 upstreams at once, slowest (ms)", f"{up_three_straight:.1f}",
         ""),
        ("spawn to tools/list, agentgate + 3 upstreams (ms)", f"{up_three:.1f}",
         f"added {up_three - up_three_straight - up_version:.1f} over both <= "
         f"{TARGETS['startup added']}"),
        (f"allowed read with {opts.history} earlier runs p50 / p99 (ms)",
         f"{h50:.3f} / {h99:.3f}", f"p50 ratio {h50 / g50:.2f} <= {TARGETS['history ratio']}"),
        ("database bytes per allowed read", f"{per_call:.0f}", f"<= {TARGETS['bytes/call']}"),
        ("agentgate peak RSS (MB)", f"{rss:.1f}", f"<= {TARGETS['rss MB']}"),
    ]
    rows += [(name, f"{seconds:.3f}", "") for name, seconds in hostile_figures()]
    rows += policy_figures(opts.policy_history)
    rows += slow_pattern_figures()
    width = max(len(r[0]) for r in rows)
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:>20}  {target}")


if __name__ == "__main__":
    main()
