"""The test suite, in tiers (tests/conftest.py marks each test with its folder's tier)."""
