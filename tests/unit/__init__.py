"""Fast tests, no vLLM, no torchrun, no server processes: `pytest tests/unit`."""
