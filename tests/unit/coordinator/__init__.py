"""The coordinator's unit tests (config, loop, metrics, launch logic, CLI)."""
