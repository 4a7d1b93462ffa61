# SPDX-License-Identifier: Apache-2.0
"""What the sites keep on vLLM's objects (vLLM 0.32): one typed record per object, under
:data:`ATTR` of the object's own ``__dict__``."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

ATTR = "_shm_embeds"

R = TypeVar("R")


@dataclasses.dataclass
class ClientRecord:
    """``MPClient``'s: ``consumer``, the hop-1 sender (``hop1.HandleOOBConsumer``)."""

    consumer: Any = None


@dataclasses.dataclass
class ExecutorRecord:
    """``MultiprocExecutor``'s (hop-2 sender): ``mq``, the broadcast queue ``plan``
    (``hop2.ReaderPlan``; None: stock) is for; ``stock_remote``: stock for remote readers."""

    mq: Any = None
    plan: Any = None
    stock_remote: bool = False


@dataclasses.dataclass
class QueueRecord:
    """``MessageQueue``'s: ``remote``, one step's ``(request, hop2.remote_form)`` pairs
    for readers on other nodes, else None."""

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
