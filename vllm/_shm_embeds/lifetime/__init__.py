# SPDX-License-Identifier: Apache-2.0
"""lifetime: who owns a segment, and when it goes. Of vLLM only ``vllm.logger``.

May import: base, files.
"""
