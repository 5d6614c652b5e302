"""`launcher: ray`: the cluster (`cluster.py`), the run on it (`launch.py`), replicas and
trainer ranks as actors (`replicas.py`, `trainer.py`)."""
