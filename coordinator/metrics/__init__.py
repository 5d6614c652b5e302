"""What a run reports: the step log (`log.py`), dashboards (`sinks.py`) and `lockgate report`
(`report.py`)."""
