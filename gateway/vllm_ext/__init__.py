"""Code that runs inside the vLLM replicas' own processes, not in the gateway's.

vLLM imports these from the dotted paths the launcher passes (coordinator/launch/replicas.py):

- `snapshot_load.py`: the worker extension
  (`--worker-extension-cls lockgate.gateway.vllm_ext.snapshot_load.SnapshotLoad`), which loads
  a disk snapshot into the model in place, reading each tensor once
- `collective_load.py`: the worker extension the launcher passes
  (`--worker-extension-cls lockgate.gateway.vllm_ext.collective_load.CollectiveLoad`): the
  snapshot load, plus the `collective` transport's receive over a torch.distributed group
- `routes.py`: the pause route (`--middleware lockgate.gateway.vllm_ext.routes.ReplicaRoutes`),
  vLLM's engine pause without its 20 ms sleep
- `snapshot_file.py`: safetensors snapshots as zero-copy views of the file (torch)
- `snapshot_header.py`: what a snapshot's headers say about its layout (no torch)

Imports nothing of lockgate outside this room: it runs beside torch and vLLM in their
processes, under their rules. The gateway process reads two of its torch-free modules, `routes`
(the pause path) and `snapshot_header`, and nothing else.
"""
