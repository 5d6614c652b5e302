"""The trajectory viewer and run dashboard: `/ui/` on the gateway, or `lockgate view RUN_DIR`.

- `query.py`: the sessions list (filters, keyset paging), one session's tokens as the model saw
  them, the live feed's changes since a cursor (pure SQL over a connection)
- `routes.py`: `Viewer` (its own threads and read-only connections), admin-token auth (bearer
  header or cookie), the page and its data routes
- `run_metrics.py`: the run's metrics.jsonl shaped for the dashboard
- `tokens.py`: token texts from the model's tokenizer.json
- `serve.py`: `lockgate view`'s app on a run dir's store
- `static/`: the page, its styles and script (no build step)

May import: the foundation and records (it reads the store's file with its own SQL, through
the store's row layout, merging rule and the run's advantages in gateway/records, never the
store itself, which would open a writer); `api` mounts it.
docs/viewer.md describes what it shows and how it stays off the gateway's hot path.
"""
