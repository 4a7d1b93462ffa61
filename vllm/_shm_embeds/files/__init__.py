# SPDX-License-Identifier: Apache-2.0
"""files: segments and their files, all file I/O on the segment directory; the
sibling sockets' descriptors (``sockets.py``).
Of vLLM only ``vllm.logger``; "base" below is the package's top modules.

May import: base.
"""
