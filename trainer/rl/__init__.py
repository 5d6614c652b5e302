"""The RL rank program (`main.py`): serves training steps through the file protocol of the
trainer's core (`trainer/protocol.py`)."""
