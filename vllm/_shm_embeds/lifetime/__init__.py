# SPDX-License-Identifier: Apache-2.0
"""lifetime: who owns a segment, and when it goes.

May import: base, files.

Of vLLM only ``vllm.logger``.
"""
