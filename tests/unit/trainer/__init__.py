"""The trainer's unit tests (loss, schedule, packing, the tiny model, SFT's pure parts)."""
