"""One model call, from the agent's request to its durable record. Nothing here knows HTTP.

- `pipeline.py`: `CallPipeline`: validate, render, apply the sampling policy, generate,
  parse, record; each open session's next call index and last turn
- `completions.py`: `/v1/completions`, a raw prompt through the same pipeline
- `bodies.py`: request bodies parsed and validated, failures as OpenAI-shaped 400s
- `bounds.py`: bounds on one call's work (list lengths, prompt characters, OpenAI's own
  rules), each checked before the work it bounds
- `rendering.py`: chat <-> token ids through `renderers`, bridging the previous call's tokens
- `tokenizer.py`: the Rust tokenizer in the shape `renderers` takes
- `constraints.py`: `tool_choice` required / named, as xgrammar structural tags
  (`forced_formats.py`: the formats constrained; `forced_budget.py`: fitted to `max_tokens`;
  `forced_tags.py`: the tags lockgate writes itself)
- `stops.py`: `stop` strings, watched by the gateway

May import: replicas (generation across segments), store (the records) and the foundation.
"""
