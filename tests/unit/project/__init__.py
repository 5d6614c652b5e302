"""Checks of the repository as a whole (import directions, function length,
setup scripts, docker-compose.yml)."""
