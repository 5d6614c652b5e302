"""Tiny offline models for tests, examples and the CPU demo; not part of the trainer's core
(nothing in trainer/ imports it)."""
