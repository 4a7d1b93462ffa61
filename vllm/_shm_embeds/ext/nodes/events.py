# SPDX-License-Identifier: Apache-2.0
"""The ``nodes`` extension's counted events (``EXTENSION.events``)."""

from vllm._shm_embeds.counters import EventKind


class NodeEvent(EventKind):
    """Events of the ``nodes`` extension (``counters.EventKind``)."""

    NODE_SENT_TENSORS = ("node_sent_tensors", None,
                         "tensors TP rank 0 sent to another node's first rank (per node)")
    NODE_SENT_BYTES = ("node_sent_bytes", None, "their bytes")
    NODE_RECEIVED_TENSORS = ("node_received_tensors", None,
                             "tensors a node's first rank received from TP rank 0")
    NODE_RECEIVED_BYTES = ("node_received_bytes", None, "their bytes")
    NODE_SEGMENT_TENSORS = ("node_segment_tensors", None,
                            "received into a segment of the node, handed to its other ranks")
    NODE_MAPPED_TENSORS = ("node_mapped_tensors", None,
                           "node segments another rank of the node mapped")
    NODE_PEER_BYTES = ("node_peer_bytes", None,
                       "bytes a node's first rank sent its other ranks (no segment there)")
