"""CUDA-only tests: skipped on a machine without a GPU."""
