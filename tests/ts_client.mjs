// A host built on the TypeScript MCP SDK, for tests/test_hosts.py.
//
// It starts a stdio MCP server the way a host does, connects, lists the tools, optionally
// calls one, and prints a single JSON line:
//   {"protocolVersion", "serverInfo", "tools": [names], "result", "progressCount"}
//
// usage: node ts_client.mjs [-tool NAME] [-args JSON] [-progress] [-expect-ok] [-timeout MS] -- COMMAND [ARG...]
// Without "-- COMMAND", the server's argv is read from $TS_CLIENT_SERVER (a JSON array).
// The server's stderr is passed through to ours, and each progress notification is noted there
// as it arrives ("ts_client: progress {...}"). Exit status: 0 on success, 1 on any failure
// (including a result with isError when -expect-ok is given), 2 on a usage error.

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";

function usage(message) {
  process.stderr.write(`ts_client: ${message}\n`);
  process.exit(2);
}

function parseArgv(argv) {
  const opts = { tool: null, args: {}, progress: false, timeout: 120000, expectOk: false, server: null };
  let i = 0;
  for (; i < argv.length; i++) {
    const flag = argv[i];
    if (flag === "--") {
      opts.server = argv.slice(i + 1);
      break;
    } else if (flag === "-tool") {
      opts.tool = argv[++i];
    } else if (flag === "-args") {
      try {
        opts.args = JSON.parse(argv[++i]);
      } catch (err) {
        usage(`-args is not JSON: ${err.message}`);
      }
    } else if (flag === "-progress") {
      opts.progress = true;
    } else if (flag === "-expect-ok") {
      opts.expectOk = true;
    } else if (flag === "-timeout") {
      opts.timeout = Number(argv[++i]);
    } else {
      usage(`unknown flag ${flag}`);
    }
  }
  if (!opts.server && process.env.TS_CLIENT_SERVER) {
    opts.server = JSON.parse(process.env.TS_CLIENT_SERVER);
  }
  if (!Array.isArray(opts.server) || opts.server.length === 0) {
    usage("name the server: -- COMMAND [ARG...] or $TS_CLIENT_SERVER");
  }
  return opts;
}

async function main() {
  const opts = parseArgv(process.argv.slice(2));
  const [command, ...args] = opts.server;
  const transport = new StdioClientTransport({ command, args, stderr: "inherit" });
  // The client hands the negotiated version to transports that want it (HTTP ones do);
  // offering the hook is the SDK's own way to learn what the server chose.
  let protocolVersion = null;
  transport.setProtocolVersion = (version) => {
    protocolVersion = version;
  };
  const client = new Client({ name: "agentgate-ts-test-host", version: "1.0.0" }, { capabilities: {} });
  let progressCount = 0;
  try {
    await client.connect(transport, { timeout: opts.timeout });
    const listed = await client.listTools(undefined, { timeout: opts.timeout });
    let result = null;
    if (opts.tool) {
      const options = { timeout: opts.timeout };
      if (opts.progress) {
        options.onprogress = (progress) => {
          progressCount += 1;
          process.stderr.write(`ts_client: progress ${JSON.stringify(progress)}\n`);
        };
      }
      result = await client.callTool({ name: opts.tool, arguments: opts.args }, undefined, options);
    }
    const out = {
      protocolVersion,
      serverInfo: client.getServerVersion() ?? null,
      tools: listed.tools.map((t) => t.name),
      result,
      progressCount,
    };
    process.stdout.write(JSON.stringify(out) + "\n");
    return opts.expectOk && result && result.isError ? 1 : 0;
  } finally {
    await client.close();
  }
}

main().then(
  (status) => {
    process.exitCode = status;
  },
  (err) => {
    process.stderr.write(`ts_client: ${err && err.stack ? err.stack : err}\n`);
    process.exitCode = 1;
  },
);
