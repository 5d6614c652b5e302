// An agent that runs as an HTTP service, in Node.js with no packages: lockgate's coordinator
// POSTs one request per rollout to /rollout, this service asks the model through the session's
// OpenAI-compatible endpoint (fetch) and answers {"reward": x}, the share of the answer's
// non-space characters that are digits (the toy task: "answer in numbers").
//
//   node examples/service_agent/agent.mjs --port 8765 [--host 127.0.0.1] [--post-reward]
//
// With --post-reward it posts the reward to the session's reward URL itself and answers {}
// (how a service reports a reward that is only known later, e.g. from a judge).
// If AGENT_SERVICE_TOKEN is set, requests must carry "Authorization: Bearer <that token>"
// (the config's environment.args.headers sends it, read from the coordinator's environment).
// The request and answer are documented in docs/bring-your-agent.md.

import http from "node:http";
import { parseArgs } from "node:util";

const { values: options } = parseArgs({
  options: {
    port: { type: "string", default: "8765" },
    host: { type: "string", default: "127.0.0.1" },
    "post-reward": { type: "boolean", default: false },
  },
});
const TOKEN = process.env.AGENT_SERVICE_TOKEN;
const MAX_BODY = 1 << 20; // a rollout request is small; refuse anything larger

function log(message) {
  process.stderr.write(`[service_agent] ${message}\n`);
}

function score(answer) {
  const chars = [...answer].filter((c) => !/\s/.test(c));
  return chars.length ? chars.filter((c) => /[0-9]/.test(c)).length / chars.length : 0;
}

class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function postJson(url, apiKey, body, signal) {
  const response = await fetch(url, {
    method: "POST",
    headers: { Authorization: `Bearer ${apiKey}`, "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal,
  });
  const text = await response.text();
  if (!response.ok) {
    // The gateway explains refusals in OpenAI's error format: pass the reason on.
    throw new HttpError(502, `${url} answered HTTP ${response.status}: ${text.slice(0, 300)}`);
  }
  return JSON.parse(text);
}

async function rollout(request) {
  const { task, base_url: baseUrl, api_key: apiKey, model, reward_url: rewardUrl } = request;
  if (!task || typeof task.data?.prompt !== "string" || !baseUrl || !apiKey) {
    throw new HttpError(400, "expected {task: {id, data: {prompt}}, base_url, api_key, ...}");
  }
  // Stop working when the coordinator stops waiting: past the deadline the rollout has failed.
  const signal = AbortSignal.timeout(Math.max(Math.floor(request.seconds_left * 1000), 0));
  const completion = await postJson(
    `${baseUrl}/chat/completions`,
    apiKey,
    {
      model,
      messages: [{ role: "user", content: task.data.prompt }],
      max_tokens: task.data.max_tokens ?? 24,
    },
    signal,
  );
  const answer = completion.choices?.[0]?.message?.content ?? "";
  const reward = score(answer);
  log(`task ${task.id} attempt ${request.attempt}: ${JSON.stringify(answer)} -> ${reward.toFixed(3)}`);
  if (options["post-reward"]) {
    await postJson(rewardUrl, apiKey, { reward }, signal);
    return {};
  }
  return { reward };
}

function readBody(req) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    let size = 0;
    req.on("data", (chunk) => {
      size += chunk.length;
      if (size > MAX_BODY) {
        reject(new HttpError(413, `request body over ${MAX_BODY} bytes`));
        req.destroy();
      } else {
        chunks.push(chunk);
      }
    });
    req.on("end", () => resolve(Buffer.concat(chunks).toString("utf8")));
    req.on("error", reject);
  });
}

function send(res, status, body) {
  res.writeHead(status, { "Content-Type": "application/json" });
  res.end(JSON.stringify(body));
}

const server = http.createServer(async (req, res) => {
  try {
    if (req.method === "GET" && req.url === "/health") {
      return send(res, 200, { ok: true });
    }
    if (req.method !== "POST" || req.url !== "/rollout") {
      throw new HttpError(404, "POST /rollout or GET /health");
    }
    if (TOKEN && req.headers.authorization !== `Bearer ${TOKEN}`) {
      throw new HttpError(401, "missing or wrong bearer token");
    }
    let request;
    try {
      request = JSON.parse(await readBody(req));
    } catch (err) {
      throw err instanceof HttpError ? err : new HttpError(400, `not JSON: ${err.message}`);
    }
    send(res, 200, await rollout(request));
  } catch (err) {
    const status = err instanceof HttpError ? err.status : 500;
    log(`${req.method} ${req.url} -> ${status}: ${err.message}`);
    if (!res.headersSent) send(res, status, { error: err.message });
  }
});

server.listen(Number(options.port), options.host, () => {
  const { address, port } = server.address();
  // The line a supervisor (or a test) waits for.
  console.log(`listening on http://${address}:${port}/rollout`);
});

for (const signal of ["SIGTERM", "SIGINT"]) {
  process.on(signal, () => {
    server.close();
    server.closeAllConnections();
    process.exit(0);
  });
}
