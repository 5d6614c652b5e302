"""The HTTP API: everything an agent or an admin talks to.

- `app.py`: `create_app`, errors in OpenAI's shape, the route groups wired together
- `gateway.py`: `Gateway`, the gateway's parts held together; sessions by id and by key
- `chat_routes.py`: the chat-completion routes, answered as plain ASGI ahead of FastAPI
- `body_limit.py`: request bodies over the size limit refused (413) before anything reads them
- `chat.py`: a chat call's answer, one JSON body or an SSE stream
- `streaming.py`: content and reasoning deltas from the tokens received so far
- `agent_routes.py`: `/v1/completions`, an agent's reward and metadata, the models,
  `/health`, `/metrics`
- `admin_routes.py`: `/admin/...`: sessions and their records, weight sync, replicas
- `responses.py`: JSON bodies encoded by orjson, errors as responses
- `loop_lag.py`: how late the event loop runs, into `/metrics` and the log

May import: calls, sync, replicas, store and the foundation (config, schema, errors, metrics,
aiohttp_transport); not vllm_ext.
"""
