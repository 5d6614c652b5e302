"""The RL rank program (`main.py`) and the file protocol it speaks with the coordinator
(`protocol.py`)."""
