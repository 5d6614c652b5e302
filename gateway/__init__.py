"""The OpenAI-compatible gateway: sessions, rendering, routing, recording, pause/resume."""
