# SPDX-License-Identifier: Apache-2.0
"""files: segments and their files, all file I/O on the segment directory.

May import: base.

(base: the package's top modules.) Of vLLM only ``vllm.logger``.
"""
