"""The OpenAI-compatible gateway: sessions, rendering, routing, recording, pause/resume.

Its public surface, what the rest of lockgate and its users import, is three modules at this
top level, and they stay where they are:

- `lockgate.gateway.client`: `GatewayClient` (the typed admin client), `GatewayClientError`,
  and `AiohttpTransport`, the connection pool under it;
- `lockgate.gateway.config`: `GatewayConfig`, `SamplingPolicy`, `RequestLimits`;
- `lockgate.gateway.schema`: the wire types (`CallRecord`, `PauseMode`, the OpenAI subset the
  gateway serves, the admin API's bodies and answers).

Beside them, the foundation every room may import: `config`, `schema`, `errors` (one exception
type in OpenAI's error shape), `metrics` (Prometheus) and `aiohttp_transport`. These import no
room. `python -m lockgate.gateway` runs the app (`__main__.py`).

The rooms, each a sub-package whose door says what it holds; each imports the foundation, its
own modules and only the rooms listed after it:

- `api/`: the HTTP app, its routes, the answers (JSON, SSE): calls, dialects, sync, replicas,
  store, viewer, records
- `viewer/`: the trajectory viewer and run dashboard (`/ui/`), reading the store's file on
  its own read-only connections: records
- `calls/`: one call from request to durable record, no HTTP: replicas, store, records
- `dialects/`: the Responses and Messages APIs translated to and from chat completions, pure:
  nothing more
- `sync/`: weight sync, the gateway's side, and the transports: replicas
- `store/`: the SQLite trajectory store: records
- `records/`: the pure formats and arithmetic of what a run records (a call's row, calls
  merged into samples, advantages, metrics.jsonl), shared by the store, the viewer and the
  coordinator: nothing more (`config` takes `AdvantageSpec` from it)
- `replicas/`: reaching the replicas: HTTP clients, pool, routing, pause gate, generation
- `vllm_ext/`: code vLLM loads into the replicas' own processes (worker extension, pause
  route): nothing of the gateway process's. The gateway process reads two torch-free modules
  of it, the pause route's path (replicas) and the snapshot header (sync).

`tests/unit/project/test_import_directions.py` holds these rules and fails on an import that breaks them.
"""
