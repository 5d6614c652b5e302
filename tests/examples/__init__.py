"""Tests of examples/ (deepresearch, toy, command_agent); those that need vLLM carry the
vllm mark too."""
