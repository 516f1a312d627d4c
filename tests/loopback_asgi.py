"""What the HTTP test servers share (each runs as a child process of its test): an event store
in memory, so a stream can be resumed with Last-Event-ID, and serving an ASGI app on a port of
127.0.0.1 the system picks, announced as `port N` once the socket listens."""

import itertools
import os
import socket

import uvicorn
from mcp.server.streamable_http import EventMessage, EventStore


class MemoryEvents(EventStore):
    """Every event of every stream, in order, so a stream resumes after any event it sent."""

    def __init__(self):
        self.events = []  # (event id, stream id, message or None)
        self.ids = itertools.count(1)

    async def store_event(self, stream_id, message):
        event_id = str(next(self.ids))
        self.events.append((event_id, stream_id, message))
        return event_id

    async def replay_events_after(self, last_event_id, send_callback):
        stream = next((s for e, s, _ in self.events if e == last_event_id), None)
        if stream is None:
            return None
        after = False
        for event_id, stream_id, message in list(self.events):
            if after and stream_id == stream and message is not None:
                await send_callback(EventMessage(message, event_id))
            after = after or event_id == last_event_id
        return stream


def serve_on_loopback(app):
    """Serve `app` until the process is stopped; `port N` goes to stdout once it listens."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # LOOPBACK_PORT: the port of a server started again where it was.
    sock.bind(("127.0.0.1", int(os.environ.get("LOOPBACK_PORT", "0"))))
    sock.listen(64)
    print(f"port {sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on")).run(sockets=[sock])
