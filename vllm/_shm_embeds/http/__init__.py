# SPDX-License-Identifier: Apache-2.0
"""The API server's HTTP side: binary and base64 JSON ``prompt_embeds`` bodies
into shared memory, and ``/metrics``. Only this package knows HTTP."""
