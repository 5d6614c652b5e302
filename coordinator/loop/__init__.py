"""The training loop's room: dispatch under the staleness bound (`staleness.py`), a finished
group into samples (`groups.py`, with the advantages of gateway/records/advantages.py), the
loop itself (`training.py`), validation rounds (`validation.py`) and the resumable cursor
(`state.py`)."""
