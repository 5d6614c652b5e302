"""The viewer in a real headless browser (Playwright over Debian's chromium)."""
