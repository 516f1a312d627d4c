#!/usr/bin/env python3
"""A bare stdio relay in front of one MCP server, for tests/bench.py --floor: what any gate of
this shape pays before it decides anything. Run as: bench_relay.py MODE DATABASE -- SERVER...

MODE inline: each request relayed on the reading thread, nothing recorded. durable: and one
durable commit per tools/call (WAL, synchronous=FULL, BEGIN IMMEDIATE) before its answer, as
agentgate's store makes them (what an allowed read needs). twice: and another before it is
sent (what a mutation needs: nothing executes unrecorded). pooled: durable, each request
handed to a waiting worker thread, as agentgate hands one so that it reads on while a call
runs.
"""

import json
import os
import queue
import sqlite3
import subprocess
import sys
import threading

MODE, DATABASE = sys.argv[1], sys.argv[2]
server = subprocess.Popen(sys.argv[sys.argv.index("--") + 1:], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE)
waiting, waiting_lock = {}, threading.Lock()  # answers awaited, by the id sent upstream
write_lock, record_lock = threading.Lock(), threading.Lock()
record = None
if MODE != "inline":
    record = sqlite3.connect(DATABASE, isolation_level=None, check_same_thread=False)
    record.execute("PRAGMA journal_mode=WAL")
    record.execute("PRAGMA synchronous=FULL")
    record.execute("CREATE TABLE IF NOT EXISTS calls(id INTEGER PRIMARY KEY, answer TEXT)")


def read_answers():
    for line in server.stdout:
        with waiting_lock:
            slot = waiting.pop(json.loads(line).get("id"), None)
        if slot is not None:
            slot.put(line)


def commit(text):
    with record_lock:
        record.execute("BEGIN IMMEDIATE")
        record.execute("INSERT INTO calls(answer) VALUES(?)", (text[:200],))
        record.execute("COMMIT")


def relay(message, ident):
    if MODE == "twice" and message.get("method") == "tools/call":
        commit(json.dumps(message))
    slot = queue.Queue(1)
    with waiting_lock:
        waiting[ident] = slot
    server.stdin.write(json.dumps({**message, "id": ident}).encode() + b"\n")
    server.stdin.flush()
    answer = json.loads(slot.get())
    if record is not None and message.get("method") == "tools/call":
        commit(json.dumps(answer))
    data = json.dumps({**answer, "id": message["id"]}).encode() + b"\n"
    with write_lock:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()


def work(jobs):
    while True:
        relay(*jobs.get())


jobs = queue.Queue()
threading.Thread(target=read_answers, daemon=True).start()
for _ in range(4 if MODE == "pooled" else 0):
    threading.Thread(target=work, args=(jobs,), daemon=True).start()
pending, count = b"", 0
while chunk := os.read(0, 1 << 16):
    pending += chunk
    *lines, pending = pending.split(b"\n")
    for line in lines:
        message = json.loads(line)
        if "id" not in message:  # a notification: passed on as it is
            server.stdin.write(line + b"\n")
            server.stdin.flush()
            continue
        count += 1
        if MODE == "pooled":
            jobs.put((message, count))
        else:
            relay(message, count)
server.stdin.close()
server.wait()
