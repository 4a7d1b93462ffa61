# SPDX-License-Identifier: Apache-2.0
"""Site in ``vllm/distributed/device_communicators/shm_broadcast.py`` (0.32/0.33): hop 2
with readers on other nodes, ``MessageQueue.enqueue`` split by reader kind (group ``remote``)."""

from __future__ import annotations

from collections.abc import Callable

from vllm._shm_embeds.sites.records import QueueRecord, peek
from vllm._shm_embeds.sites.site import Site

MODULE = "vllm.distributed.device_communicators.shm_broadcast"


def wrap_enqueue(orig: Callable) -> Callable:
    def enqueue(self, obj, *args, **kwargs):
        plan = getattr(peek(self, QueueRecord), "remote", None)
        n_local, n_remote = self.n_local_reader, self.n_remote_reader
        if not plan or n_local <= 0 or n_remote <= 0:  # every other enqueue: vLLM's, untouched
            return orig(self, obj, *args, **kwargs)
        handles = [(req, req.prompt_embeds) for req, _ in plan]
        try:
            self.n_remote_reader = 0
            orig(self, obj, *args, **kwargs)  # local readers: the handles
            self.n_remote_reader, self.n_local_reader = n_remote, 0
            for req, form in plan:
                req.prompt_embeds = form
            return orig(self, obj, *args, **kwargs)  # remote readers: their form
        finally:
            self.n_local_reader, self.n_remote_reader = n_local, n_remote
            for req, handle in handles:
                req.prompt_embeds = handle

    return enqueue


SITES = (
    Site(key="mq_enqueue", group="remote", module=MODULE, qualname="MessageQueue.enqueue",
         params=("obj",),
         marks=("if self.n_local_reader > 0:", "if self.n_remote_reader > 0:",
                "self.remote_socket.send_multipart("),
         wrap=wrap_enqueue,
         what="while collective_rpc has a plan for the queue: enqueue to the local readers "
              "alone (handles), then to the remote readers alone (a placeholder, or the "
              "tensor with a first-stage reader among them); all restored in finally",
         why="enqueue sends the same buffers to the ring and the remote socket, and a remote "
             "reader cannot map a local file: without the split hop 2 goes stock for every "
             "reader and each remote rank gets the full tensor over TCP",
         retire="a per-reader-kind serialization hook in MessageQueue, or vLLM stripping "
                "prompt_embeds for non-first PP ranks itself"),
)
