"""The mesh axes, named once: every rule table, parallel mode and planner refers to them from here.

A mesh (`sharding.mesh`, ``--config.mesh=data:2,fsdp:4``) may hold any of these; the rules
(`sharding.rules`) map the model's logical axes onto them, and a mesh axis the mesh lacks is dropped.

- ``data``: data parallelism (the batch); parameters replicated over it.
- ``fsdp``: the batch, and parameters / gradients / optimizer state along ``embed`` (ZeRO-3).
- ``tensor``: Megatron tensor parallelism (heads, MLP width, vocabulary).
- ``seq``: sequence parallelism of the ``sp`` rules (activations along ``seq`` between the tensor-parallel matmuls).
- ``expert``: the routed experts (`lm.moe`, all-to-all dispatch); data-parallel for everything else.
- ``context``: sequence shards that attention runs over explicitly (`lm.parallel.context_attention`).
- ``stage``: pipeline stages over the scanned block stack's ``layers`` (`lm.parallel.pipeline`).
"""

from __future__ import annotations

DATA = "data"
FSDP = "fsdp"
TENSOR = "tensor"
SEQ = "seq"
EXPERT = "expert"
CONTEXT = "context"
STAGE = "stage"
