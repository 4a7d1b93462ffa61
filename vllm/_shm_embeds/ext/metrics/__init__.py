# SPDX-License-Identifier: Apache-2.0
"""Extension ``metrics``: the ``vllm:shm_embeds_*`` families on vLLM's ``/metrics``.

``metrics.py`` (the families, read from every process's counters),
``site_instrumentator.py`` (vLLM's ``/metrics`` route).
May import: the core.
"""

from vllm._shm_embeds.extensions import Extension, Group


def _ensure_stats_dir() -> None:
    from vllm._shm_embeds.ext.metrics.metrics import ensure_stats_dir

    ensure_stats_dir()


EXTENSION = Extension(
    what="the vllm:shm_embeds_* families on /metrics",
    api=("metrics",),
    sites=("site_instrumentator",),
    groups={"metrics": Group((), True, "shm-embeds: metrics not on /metrics in pid %d: %s",
                             "the vllm:shm_embeds_* families on /metrics",
                             before_patch=_ensure_stats_dir)},
)
