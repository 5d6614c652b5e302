"""The gateway's unit tests (fake replicas, in-process apps, real SQLite)."""
