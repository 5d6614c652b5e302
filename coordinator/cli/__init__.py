"""The `lockgate` command line: one module per command; `main.py` parses and dispatches."""
