"""The trajectory store: sessions and calls in one SQLite file.

- `trajectories.py`: `TrajectoryStore` (group-committed, durable before the answer), `SessionRow`
- `thread.py`: `StoreThread`, the one thread that owns the SQLite connection

May import: the foundation (schema) and records (a call's row layout, `records/codecs.py`).
"""
