// A host built as Claude Code's runtime is: the TypeScript SDK v2 client
// (@modelcontextprotocol/client) in `auto` mode, with @modelcontextprotocol/ext-tasks calling
// the tool, so a call answered with a task is followed to its end. It starts COMMAND over stdio
// (in auto mode the SDK first probes with server/discover from a sibling process it ends at
// once), calls TOOL with ARGS, and prints JSON lines on stdout: {"era", "version"} once
// connected, {"started": kind, "taskId"} once the call is answered, and {"outcome", "result"}
// once it settled.
//
//     node ts_tasks_host.mjs TOOL ARGS -- COMMAND [ARG...]
import { Client } from "@modelcontextprotocol/client";
import { StdioClientTransport } from "@modelcontextprotocol/client/stdio";
import { createTaskSessionFromClient, resultFromTaskOutcome } from "@modelcontextprotocol/ext-tasks/client";

const [tool, args] = process.argv.slice(2, 4);
const command = process.argv.slice(process.argv.indexOf("--") + 1);
const info = { name: "ts-tasks-host", version: "1.0.0" };
const say = (line) => process.stdout.write(JSON.stringify(line) + "\n");

const client = new Client(info, { versionNegotiation: { mode: "auto" } });
const transport = new StdioClientTransport({ command: command[0], args: command.slice(1), stderr: "inherit" });
await client.connect(transport);
say({ era: client.getProtocolEra(), version: client.getNegotiatedProtocolVersion?.() });

// The host's own request path, which the task session needs for tools/call and tasks/* of the
// 2026-07-28 revision (the SDK's codecs take a result's `resultType` for their own): the
// request as the session frames it, on the wire, under ids of its own.
const pending = new Map();
const sdkReceives = transport.onmessage;
transport.onmessage = (message, extra) => {
  if (!("method" in message) && pending.has(message.id)) {
    pending.get(message.id)(message);
    pending.delete(message.id);
    return;
  }
  sdkReceives?.(message, extra);
};
let sent = 0;
async function rawDispatch(request) {
  const id = `raw-${++sent}`;
  const answered = new Promise((resolve) => pending.set(id, resolve));
  await transport.send({ jsonrpc: "2.0", id, method: request.method, params: request.params });
  const message = await answered;
  return "error" in message ? { kind: "error", error: message.error }
    : { kind: "result", result: message.result };
}

const session = createTaskSessionFromClient(client, {
  endpointId: "agentgate-under-test",
  rawDispatch,
  v2RequestFraming: { protocolVersion: "2026-07-28", clientInfo: info, clientCapabilities: {} },
});
try {
  const execution = await session.callTool(tool, JSON.parse(args));
  say({ started: execution.kind, taskId: execution.handle?.taskId ?? null });
  const { outcome } = await execution.settle();
  const result = outcome.status === "completed" ? resultFromTaskOutcome(outcome) : null;
  say({ outcome: outcome.status, result });
} finally {
  await session.close();
  await client.close();
}
