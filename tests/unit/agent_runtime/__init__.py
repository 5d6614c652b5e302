"""The agent runtime's unit tests."""
