# SPDX-License-Identifier: Apache-2.0
"""The API server's body formats: the one registry (``gate.BodyGate`` offers a
request to them in this order; the first that claims it takes it).

A new input format is a file of ``http/`` with a class implementing
``gate.BodyFormat``, and an entry here: its module and class, the
``sites`` group whose sites it needs, and the setting that turns it on.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

from vllm._shm_embeds import config


@dataclasses.dataclass(frozen=True, kw_only=True)
class Format:
    """One body format.

    Attributes:
        name: as in logs and ``BodyFormat.name``.
        target: ``"<module of http/>:<class>"``, loaded when the gate is built.
        group: the ``sites`` group whose sites it needs (its placeholders
            resolved, its metrics): off when that group is.
        enabled: whether the configuration turns it on.
        what: a line for the start-up log.
    """

    name: str
    target: str
    group: str
    enabled: Callable[[], bool]
    what: str

    def load(self):
        module, _, cls = self.target.partition(":")
        return getattr(importlib.import_module(f"vllm._shm_embeds.http.{module}"), cls)()


FORMATS = (
    Format(name="binary", target="binary:BinaryFormat", group="binary",
           enabled=lambda: True,
           what="binary prompt_embeds bodies (application/octet-stream, "
                "Inference-Header-Content-Length)"),
    # Before the JSON format: a small JSON body that names no region is offered on.
    Format(name="regions", target="region_refs:RegionRefsFormat", group="regions",
           enabled=lambda: bool(config.regions_path()),
           what="registered regions named in JSON bodies (VLLM_SHM_EMBEDS_REGIONS)"),
    Format(name="json", target="json_body:JsonFormat", group="json",
           enabled=lambda: config.settings().json,
           what="base64 JSON prompt_embeds decoded off the event loop into shared memory"),
)
