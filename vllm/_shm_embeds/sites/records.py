# SPDX-License-Identifier: Apache-2.0
"""What the sites keep on vLLM's objects: one typed record per object.

Every piece of state of ours on an object of vLLM's is a field of that
object's record, under the one attribute :data:`ATTR` of the object's own
``__dict__`` (never a class attribute, never inherited by a subclass
instance, never seen by vLLM's code). :func:`record` gives an object's record
of a kind, made on first use; :func:`peek` gives it or None, and makes nothing.

| record | object (vLLM 0.32) | kept by |
|---|---|---|
| :class:`ClientRecord` | ``MPClient`` (``v1/engine/core_client.py``) | ``core_client.py`` |
| :class:`EngineCoreRecord` | ``EngineCoreProc`` (``v1/engine/core.py``) | ``engine_core.py`` |
| :class:`ExecutorRecord` | ``MultiprocExecutor`` (``v1/executor/multiproc_executor.py``) | ``multiproc_executor.py`` |
| :class:`WorkerRecord` | ``WorkerProc`` (same file) | ``multiproc_executor.py`` |
| :class:`QueueRecord` | ``MessageQueue`` (``distributed/device_communicators/shm_broadcast.py``) | ``multiproc_executor.py`` sets, ``shm_broadcast.py`` reads |
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

ATTR = "_shm_embeds"

R = TypeVar("R")


@dataclasses.dataclass
class ClientRecord:
    """The API server's engine client: ``consumer``, the hop-1 sender
    (``hop1.HandleOOBConsumer``) in its encoder."""

    consumer: Any = None


@dataclasses.dataclass
class EngineCoreRecord:
    """The EngineCore: ``provider``, the hop-1 receiver (``hop1.HandleOOBProvider``)."""

    provider: Any = None


@dataclasses.dataclass
class ExecutorRecord:
    """The hop-2 sender's executor.

    Attributes:
        mq: the broadcast queue the plan was made for; a queue rebuilt since
            (another object at ``rpc_broadcast_mq``) gets a plan of its own.
        plan: what each reader gets (``hop2.ReaderPlan``), or None for the stock path.
        stock_remote: the stock path because readers are on other nodes
            (tensors are then counted stock with reason ``remote``).
    """

    mq: Any = None
    plan: Any = None
    stock_remote: bool = False


@dataclasses.dataclass
class WorkerRecord:
    """A TP/PP worker: ``first_stage``, whether it is on the first pipeline
    stage (asked once), or None before the first step with embeds."""

    first_stage: bool | None = None


@dataclasses.dataclass
class QueueRecord:
    """The broadcast queue: ``remote``, for the one ``enqueue`` of a step,
    ``(request, form)`` pairs of what the readers on other nodes get instead
    of each request's handle (``hop2.remote_form``); None otherwise."""

    remote: list | None = None


def peek(obj: Any, kind: type[R]) -> R | None:
    """``obj``'s record of ``kind``, or None (nothing made)."""
    found = getattr(obj, "__dict__", {}).get(ATTR)
    return found if isinstance(found, kind) else None


def record(obj: Any, kind: type[R]) -> R:
    """``obj``'s record of ``kind``, made (empty) on first use."""
    found = peek(obj, kind)
    if found is None:
        found = obj.__dict__[ATTR] = kind()
    return found
