"""Real processes without vLLM: torchrun trainer ranks, SFT runs, gateway processes, Ray,
compose services run locally."""
