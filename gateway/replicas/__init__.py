"""Reaching the vLLM replicas from the gateway process.

- `upstream.py`: how a generate request reaches a replica (the interface, httpx behind it)
- `http1.py`: the minimal HTTP/1.1 client that sends generate requests (the hot path)
- `replica_client.py`: `ReplicaClient`: token-in/token-out generation and the admin calls
- `pool.py`: `ReplicaPool`: health checks, load accounting, replicas added and removed
- `routing.py`: which replica serves a call (sticky, least-loaded; pure policy)
- `pause.py`: `PauseGate`: the serving state and the segments in flight
- `adapters.py`: `AdapterSet`: adapter mode's name per weight version, and its load, unload
  and reload (a replica that answers 404 for it) on a replica
- `generation.py`: `CallGenerator`: one call across segments, weight syncs and failovers

May import: the foundation, and of vllm_ext only `routes` (the pause route's path).
"""
