"""Supervised fine-tuning: its config (`config.py`), chat data with assistant-only loss masks
(`data.py`), early-stop rules (`stop.py`) and the rank program (`main.py`)."""
