# SPDX-License-Identifier: Apache-2.0
"""Extension ``nodes``: one copy per node when tensor parallelism spans nodes.

``node_copy.py``: the readers on other nodes get a description
(``handle.StepEmbeds``); inside the step TP rank 0 sends each node's first rank
the bytes over the TP CPU group, which writes them into a segment of its node
and hands its node's other ranks the handle. Without it each remote reader gets
the bytes in vLLM's broadcast.
May import: the core.
"""

from typing import Any

from vllm._shm_embeds.ext.nodes.events import NodeEvent
from vllm._shm_embeds.extensions import Extension

EXTENSION = Extension(
    what="one copy of prompt_embeds per node when TP spans nodes",
    events=NodeEvent,
    api=("node_copy",),
)


def tp_group() -> Any:
    """Worker: vLLM's TP ``GroupCoordinator`` (``vllm/distributed/parallel_state.py`` 0.32)."""
    from vllm.distributed import parallel_state as ps

    return ps.get_tp_group()
