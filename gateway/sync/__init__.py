"""Weight sync, the gateway's side.

- `controller.py`: `SyncController`: (stage,) pause (abort | keep | drain), load + verify,
  resume
- `adapter_sync.py`: `AdapterSyncController`: the same in adapter mode (a LoRA adapter per
  version, on replicas other runs may share): cut only this gateway's calls, load, resume,
  unload the old adapter; no engine is paused
- `weights.py`: the transports behind one interface: `disk` snapshots (loaded directly by the
  worker extension, else by vLLM's `reload_weights`), `collective` (trainer rank 0 streams
  them over a torch.distributed group the replicas' workers join) and `nccl`

May import: replicas, the foundation, and of vllm_ext only `snapshot_header` (torch-free).
"""
