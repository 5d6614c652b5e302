"""Bringing a run's processes up and down: the local launch (`local.py`), each part's process
(`replicas.py`, `gateway.py`, `trainer.py`), their configs (`parts.py`), checks made before
anything starts (`deploy_checks.py`), process hygiene (`processes.py`, `orphan_guard.py`,
`cpu_priority.py`) and the Ray launcher (`ray/`)."""
