# SPDX-License-Identifier: Apache-2.0
"""Compare prefill latency of text prompts and ``prompt_embeds`` on a vLLM server.

Runs against a running OpenAI-compatible vLLM server started with
``--enable-prompt-embeds``. For each prompt length L (tokens):

* Text prompt: a *text* string whose tokenization on the server (with special
  tokens, e.g. BOS) is exactly L tokens. It is built from random English words
  (fixed seed), then trimmed with the server's ``/tokenize`` and
  ``/detokenize`` until re-tokenizing gives exactly L ids. If that does not
  converge (rare; tokenizer-dependent) the sample is sent as a token-id prompt
  instead and marked ``token_ids`` in the output.
* Embeds prompt: the rows of the model's input embedding matrix for the SAME L
  token ids (BOS included), read from safetensors on disk
  (``model.embed_tokens.weight``), sent as vLLM's online format: ``/v1/completions``
  with ``prompt_embeds`` = base64 of the ``torch.save`` bytes of an
  ``(L, hidden_size)`` tensor. With ``--input binary``: the same tensor as a
  binary body (shm-embeds: the JSON, then the raw bytes; needs the
  plugin with ``VLLM_SHM_EMBEDS=1`` on the server). With ``--input region``:
  the tensor registered as a sealed memfd on the server's region socket
  (``--regions``, the server's ``VLLM_SHM_EMBEDS_REGIONS``; same host) and
  named in a small JSON body; the registration is the client's "encoding".

Latency is measured as the wall time of one non-streaming ``/v1/completions``
request with ``max_tokens=1`` (send until full response): prefill plus one
sampled token. For embeds it adds what the client itself does to send them
(``torch.save`` + base64 + ``json.dumps`` for JSON; framing, without a copy,
for binary), timed before the pair's requests, to the upload and the
server's decode; ``--exclude-encode`` leaves the client's encoding out.
Every sample uses fresh random token ids, so prefix caching never hits.
Text and embeds samples alternate, and which goes first alternates too.

Usage::

    python prof_embeds.py --url http://localhost:8000 --lengths 256,1024,4096 \\
        --repeats 5 --warmup 2 [--embeddings MODEL_DIR] [--json out.json] [--check-outputs]
    python prof_embeds.py --compare stock.json arena.json shm.json

Exit codes: 0 ok, 1 HTTP/connection error, 2 bad arguments or setup,
3 ``--check-outputs`` found a text/embeds mismatch.
"""

import argparse
import base64
import glob
import io
import json
import os
import random
import statistics
import sys
import threading
import time

import requests

WORDS = (
    "the of and to in is was for on that with as by at from his her they this "
    "have had not are but were which one all their there been has when who will "
    "more would out some into them time only other new about could then than "
    "first people may like over such after most also made many before must "
    "through back years where much your way well down should because each just "
    "those great little world still long good under never while last might "
    "house small found part place city water river train window garden report "
    "number story morning evening engineer letter market bread music teacher "
    "mountain island bridge captain history question answer machine weather"
).split()


class ShmWatcher:
    """Samples how much of one tmpfs shm-embeds holds, in bytes.

    A daemon thread reads the filesystem's used bytes (``statvfs``) every
    ``interval`` seconds, minus what was used when the watcher started. It
    counts segment memory that is still mapped after its name was unlinked
    (the EngineCore and the TP workers keep their mappings until the request
    ends), which a listing of files would miss. :meth:`reset` starts a new
    peak. Only meaningful when the server runs on this host and nothing else
    allocates on that filesystem meanwhile.
    """

    def __init__(self, path, interval=0.002):
        self.path, self.interval = path, interval
        self.base = self._used()
        self.peak = self.start = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True, name="shm-watch").start()

    def _used(self):
        st = os.statvfs(self.path)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def held(self):
        """Bytes used on the filesystem beyond what was used at start."""
        return max(0, self._used() - self.base)

    def _run(self):
        while True:
            now = self.held()
            with self._lock:
                self.peak = max(self.peak, now)
            time.sleep(self.interval)

    def reset(self):
        """Start a new interval; returns how far usage rose in the last one.

        The rise is measured from the usage when that interval started, so a
        previous request whose memory is still mapped (vLLM's TP workers drop
        a finished request at their next step) is not counted again.
        """
        with self._lock:
            rise = self.peak - self.start
            self.peak = self.start = self.held()
        return rise

    def settle(self, timeout=5.0):
        """Bytes still held once usage is back to the start or ``timeout`` s pass."""
        deadline = time.monotonic() + timeout
        while (held := self.held()) and time.monotonic() < deadline:
            time.sleep(0.01)
        return held


class HttpError(RuntimeError):
    """A request to the server failed (non-2xx status or no connection)."""


class Client:
    """Thin JSON client for one vLLM server.

    ``timeout`` is in seconds and applies to each request.
    """

    def __init__(self, url, model, timeout):
        self.url = url.rstrip("/")
        self.model = model
        self.timeout = timeout
        self.session = requests.Session()

    def post(self, path, body):
        """POST ``body`` (a dict, pre-encoded JSON bytes, or a :class:`BinaryBody`);
        return the parsed reply."""
        if isinstance(body, BinaryBody):
            return self._post_binary(path, body)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            r = self.session.post(self.url + path, data=data, timeout=self.timeout,
                                  headers={"Content-Type": "application/json"})
        except requests.RequestException as e:
            raise HttpError(f"POST {path}: {e}") from e
        if r.status_code // 100 != 2:
            raise HttpError(f"POST {path}: HTTP {r.status_code}: {r.text[:500]}")
        return r.json()

    def _post_binary(self, path, body):
        import httpx

        from shm_embeds_client._framing import _chunks

        if getattr(self, "_http", None) is None:
            self._http = httpx.Client(timeout=self.timeout)
        try:
            r = self._http.post(self.url + path, content=_chunks(body.pieces),
                                headers=body.headers)
        except httpx.HTTPError as e:
            raise HttpError(f"POST {path}: {e}") from e
        if r.status_code // 100 != 2:
            raise HttpError(f"POST {path}: HTTP {r.status_code}: {r.text[:500]}")
        return r.json()

    def tokenize(self, text):
        """Token ids of ``text`` as the server encodes a completion prompt."""
        return self.post("/tokenize", {"model": self.model, "prompt": text,
                                       "add_special_tokens": True})["tokens"]

    def detokenize(self, ids):
        """Text of ``ids`` as decoded by the server."""
        return self.post("/detokenize", {"model": self.model, "tokens": ids})["prompt"]


def list_models(url, timeout):
    """Return the ``data`` list of ``GET /v1/models``."""
    try:
        r = requests.get(url.rstrip("/") + "/v1/models", timeout=timeout)
    except requests.RequestException as e:
        raise HttpError(f"GET /v1/models: {e}") from e
    if r.status_code != 200:
        raise HttpError(f"GET /v1/models: HTTP {r.status_code}: {r.text[:500]}")
    return r.json()["data"]


def load_embedding_matrix(model_dir):
    """Read the ``(vocab, hidden_size)`` input embedding matrix from safetensors."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                if key.endswith("embed_tokens.weight"):
                    return f.get_tensor(key)
    raise SystemExit(f"no *embed_tokens.weight in safetensors under {model_dir}")


def make_prompt(client, length, rng, n_special):
    """Return ``(text, ids)``: a text prompt that tokenizes to exactly ``length`` ids.

    ``text`` is None when no exact text was found; then ``ids`` (random word
    tokens, ``length`` long) must be sent as a token-id prompt.
    """
    text = " ".join(rng.choice(WORDS) for _ in range(length))
    ids = client.tokenize(text)
    for _ in range(12):
        if len(ids) == length:
            return text, ids
        if len(ids) > length:
            text = client.detokenize(ids[n_special:length])
        else:
            text += " " + " ".join(rng.choice(WORDS) for _ in range(length - len(ids)))
        ids = client.tokenize(text)
    more = " ".join(rng.choice(WORDS) for _ in range(length))
    return None, client.tokenize(text + " " + more)[:length]


def embeds_b64(weights, ids):
    """Base64 text of the ``torch.save`` bytes of ``weights[ids]``, and its size in MB."""
    import torch

    tensor = weights[torch.tensor(ids)].contiguous()
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode(), tensor.numel() * tensor.element_size() / 1e6


class BinaryBody:
    """A framed binary ``/v1/completions`` body (``--input binary``).

    ``pieces``: the JSON header bytes, then memoryviews of the tensor's own
    memory (no base64, no ``torch.save``); ``headers``: the framing headers.
    """

    def __init__(self, headers, pieces):
        self.headers, self.pieces = headers, pieces


def embeds_payload(weights, ids, mode):
    """``(payload for completion_body(embeds=...), MB)`` for ``--input json|binary``."""
    if mode == "json":
        return embeds_b64(weights, ids)
    import torch

    tensor = weights[torch.tensor(ids)].contiguous()
    return tensor, tensor.numel() * tensor.element_size() / 1e6


def region_of(regions, weights, ids):
    """A registered region holding ``weights[ids]``, gathered straight into a
    fresh memfd (``RegionClient.empty``), sealed and registered."""
    import torch

    out = regions.empty((len(ids), weights.shape[1]), weights.dtype)
    torch.index_select(weights, 0, torch.tensor(ids), out=out)
    return regions.seal(out)


def completion_body(model, prompt=None, embeds=None, max_tokens=1):
    """Pre-encoded JSON (or a :class:`BinaryBody` when ``embeds`` is a tensor) for a
    greedy ``/v1/completions`` request."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True}
    if isinstance(embeds, dict):  # a registered region's reference
        body.update(prompt="", prompt_embeds=embeds)
        return json.dumps(body).encode()
    if embeds is not None and not isinstance(embeds, str):
        from shm_embeds_client import frame

        headers, pieces, _ = frame({**body, "prompt": "", "prompt_embeds": embeds})
        return BinaryBody(headers, pieces)
    if embeds is not None:
        body["prompt_embeds"] = embeds
    else:
        body["prompt"] = prompt
    return json.dumps(body).encode()


def timed(client, make_body):
    """Build (``make_body()``) and send one completion request; return its
    latency in milliseconds, the build included."""
    t0 = time.perf_counter()
    client.post("/v1/completions", make_body())
    return (time.perf_counter() - t0) * 1000.0


class PeakRss:
    """Peak resident memory a process adds during one request, in bytes.

    Linux keeps each process's peak RSS (``VmHWM`` in ``/proc/<pid>/status``);
    writing ``5`` to ``/proc/<pid>/clear_refs`` resets it to the current RSS
    (root or the process's owner). :meth:`start` resets it and notes the RSS,
    :meth:`stop` returns the peak minus that.
    """

    def __init__(self, pid):
        self.pid, self.base = pid, 0

    def _kb(self, key):
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"no {key} for pid {self.pid}")

    def start(self):
        with open(f"/proc/{self.pid}/clear_refs", "w") as f:
            f.write("5")
        self.base = self._kb("VmRSS:")

    def stop(self):
        return max(0, self._kb("VmHWM:") - self.base)


def profile_length(client, weights, length, args, n_special, watcher=None, rss=None):
    """Measure one prompt length; return a result dict (latencies in ms).

    With a :class:`ShmWatcher`, also the peak bytes of shm-embeds segments
    during each embeds request (``shm_peak_bytes``: the largest) and what is
    still held once the last request has returned (``shm_after_bytes``).
    With a :class:`PeakRss` of the API server, the most memory it added during
    one embeds request (``api_peak_rss_bytes``).
    """
    text_ms, embeds_ms, kinds, mb, peaks, rss_peaks = [], [], set(), 0.0, [], []
    starts = []  # shared memory still held when an embeds request started
    encodes = []  # the client's own encoding per sample (ms), inside embeds_ms
    for i in range(args.warmup + args.repeats):
        rng = random.Random(f"{args.seed}-{length}-{i}")
        text, ids = make_prompt(client, length, rng, n_special)
        kinds.add("text" if text is not None else "token_ids")
        text_body = completion_body(client.model, text if text is not None else ids)
        # The client's own encoding is timed here, before either request of the
        # pair: right after a step, vLLM's CPU workers spin on both cores for
        # about a second, and a client sharing those cores would be timed
        # waiting for them (a real client runs on a machine of its own).
        if not args.exclude_encode:
            time.sleep(1.2)  # past the workers' spin window (measured: ~1 s)
        t0 = time.perf_counter()
        region = None
        if args.input == "region":
            # A producer fills the region in place (no copy of its own), then
            # seals and registers it: the server checks and hashes it.
            region = region_of(args.region_client, weights, ids)
            payload = region.to_json()
        else:
            payload, _ = embeds_payload(weights, ids, args.input)
        embeds_body = completion_body(client.model, embeds=payload)
        encode_ms = 0.0 if args.exclude_encode else (time.perf_counter() - t0) * 1e3
        del payload
        mb = len(ids) * weights.shape[1] * weights.element_size() / 1e6
        bodies = [("text", lambda b=text_body: b), ("embeds", lambda b=embeds_body: b)]
        if i % 2:
            bodies.reverse()
        for kind, body in bodies:
            if watcher and kind == "embeds":
                # From the idle level: what the last request held must be back
                # first (the TP workers drop a request at the step after it),
                # or a new segment replacing an old one would read as no rise.
                starts.append(watcher.settle(timeout=2.0))
                watcher.reset()  # the new request's rise is measured from here
            if rss and kind == "embeds":
                rss.start()
            ms = timed(client, body) + (encode_ms if kind == "embeds" else 0.0)
            if watcher and kind == "embeds":
                # A region's bytes are the producer's memfd, not in --shm-dir:
                # they are shared memory this request uses all the same.
                peaks.append(watcher.reset() + (region.byte_size if region else 0))
            if rss and kind == "embeds":
                rss_peaks.append(rss.stop())
            if i >= args.warmup:
                (text_ms if kind == "text" else embeds_ms).append(ms)
        if region is not None:
            args.region_client.unregister(region)
        if i >= args.warmup:
            encodes.append(encode_ms)
    t_med, e_med = statistics.median(text_ms), statistics.median(embeds_ms)
    out = {"length": length, "embeds_mb": mb, "prompt_kind": "+".join(sorted(kinds)),
           "text_ms": text_ms, "embeds_ms": embeds_ms,
           "text_median_ms": t_med, "embeds_median_ms": e_med,
           "ratio": e_med / t_med, "embeds_minus_text_ms": e_med - t_med,
           "client_encode_ms": encodes, "client_encode_median_ms": statistics.median(encodes)}
    if rss_peaks:
        out["api_peak_rss_bytes"] = max(rss_peaks)
    if watcher:
        out["shm_peak_bytes"] = max(peaks)
        out["shm_start_bytes"] = max(starts)
        out["shm_after_bytes"] = watcher.settle()
    return out


def check_outputs(client, weights, length, args, n_special):
    """Greedy-generate from text and from embeds of the same ids; return a result dict."""
    rng = random.Random(f"{args.seed}-{length}-check")
    text, ids = make_prompt(client, length, rng, n_special)
    region = region_of(args.region_client, weights, ids) if args.input == "region" else None
    b64 = region.to_json() if region is not None else embeds_payload(weights, ids, args.input)[0]
    n = args.check_tokens
    a = client.post("/v1/completions", completion_body(
        client.model, text if text is not None else ids, max_tokens=n))["choices"][0]
    b = client.post("/v1/completions", completion_body(
        client.model, embeds=b64, max_tokens=n))["choices"][0]
    if region is not None:
        args.region_client.unregister(region)
    prompt_ok = a.get("prompt_token_ids") in (None, ids)
    match = prompt_ok and a.get("token_ids") == b.get("token_ids") and a["text"] == b["text"]
    return {"length": length, "match": match, "text_prompt_ids_ok": prompt_ok,
            "text_output": a["text"], "embeds_output": b["text"],
            "text_token_ids": a.get("token_ids"), "embeds_token_ids": b.get("token_ids")}


def print_table(results):
    """Print the per-length medians (ms) of one run."""
    print(f"{'length':>7} {'embeds MB':>10} {'text ms':>9} {'embeds ms':>10} "
          f"{'ratio':>6} {'emb-text ms':>12} {'encode ms':>10}  prompt")
    for r in results:
        print(f"{r['length']:>7} {r['embeds_mb']:>10.2f} {r['text_median_ms']:>9.1f} "
              f"{r['embeds_median_ms']:>10.1f} {r['ratio']:>6.2f} "
              f"{r['embeds_minus_text_ms']:>12.1f} {r['client_encode_median_ms']:>10.1f}"
              f"  {r['prompt_kind']}")
    for r in results:
        if "shm_peak_bytes" in r:
            print(f"length {r['length']}: each embeds request added at most "
                  f"{r['shm_peak_bytes'] / 1e6:.2f} MB of shared memory "
                  f"({r['shm_peak_bytes'] / (r['embeds_mb'] * 1e6):.3f}x the embeds), "
                  f"{r['shm_after_bytes']} bytes after the last one")


def _side_table(runs, key, title, cols):
    """Print one markdown table of the runs that recorded ``key``: a row per
    length, for each such run the columns ``cols`` (``(name, fmt(result, length))``)."""
    have = [(i, res) for i, (_, res) in enumerate(runs) if any(key in r for r in res.values())]
    if not have:
        return
    lengths = sorted(runs[0][1])
    print(f"\n{title}")
    print("| tokens | embeds MB |" + "".join(f" [{i}] {name} |" for i, _ in have
                                            for name, _ in cols))
    print("|" + "---|" * (2 + len(cols) * len(have)))
    for n in lengths:
        row = f"| {n} | {runs[0][1][n]['embeds_mb']:.1f} |"
        for _, res in have:
            r = res.get(n, {})
            row += "".join(f" {fmt(r, n) if key in r else '-'} |" for _, fmt in cols)
        print(row)


def compare(paths):
    """Print the medians (ms) of several ``--json`` runs side by side.

    The first run is the baseline (e.g. stock vLLM): for every other run the
    last column is its host tax (embeds minus text) divided by the baseline's.
    """
    runs = []
    for p in paths:
        with open(p) as f:
            run = json.load(f)
        runs.append((run.get("label") or p, {r["length"]: r for r in run["results"]}))
    print("medians in ms; tax = embeds - text; tax/base = tax / tax of the first run")
    for label, _ in runs:
        print(f"  {label}")
    head = "| tokens | embeds MB |"
    for i, _ in enumerate(runs):
        head += f" [{i}] text | [{i}] embeds | [{i}] tax |" + (" tax/base |" if i else "")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    base = runs[0][1]
    for length in sorted(base):
        row = f"| {length} | {base[length]['embeds_mb']:.1f} |"
        for i, (_, res) in enumerate(runs):
            r = res.get(length)
            if r is None:
                row += " - | - | - |" + (" - |" if i else "")
                continue
            tax = r["embeds_minus_text_ms"]
            row += f" {r['text_median_ms']:.0f} | {r['embeds_median_ms']:.0f} | {tax:.0f} |"
            if i:
                base_tax = base[length]["embeds_minus_text_ms"]
                row += f" {tax / base_tax:.2f} |" if base_tax > 0 else " - |"
        print(row)
    base_tax = {n: r["embeds_minus_text_ms"] for n, r in base.items()}
    _side_table(
        runs, "client_encode_median_ms",
        "the client's own encoding, inside each embeds time: median ms, and that over the "
        "first run's tax (the least tax/base any server can reach with this client)",
        [("encode ms", lambda r, n: f"{r['client_encode_median_ms']:.0f}"),
         ("encode / base tax", lambda r, n: f"{r['client_encode_median_ms'] / base_tax[n]:.2f}"
          if base_tax.get(n, 0) > 0 else "-")])
    _side_table(
        runs, "api_peak_rss_bytes",
        "memory the API server process added during one embeds request (peak RSS, "
        "VmHWM): the largest over the samples",
        [("API peak MB", lambda r, n: f"{r['api_peak_rss_bytes'] / 1e6:.1f}"),
         ("/ embeds", lambda r, n: f"{r['api_peak_rss_bytes'] / (r['embeds_mb'] * 1e6):.2f}")])
    _side_table(
        runs, "shm_peak_bytes",
        "shared memory used on the segments' tmpfs beyond the idle server's (statvfs, "
        "sampled every 2 ms): peak during one embeds request, measured from what was "
        "held when it started (after up to 2 s for the previous one's to come back), "
        "and what is left once the last has returned",
        [("peak MB", lambda r, n: f"{r['shm_peak_bytes'] / 1e6:.1f}"),
         ("peak / embeds", lambda r, n: f"{r['shm_peak_bytes'] / (r['embeds_mb'] * 1e6):.3f}"),
         ("held at start (bytes)", lambda r, n: f"{r.get('shm_start_bytes', 0)}"),
         ("left (bytes)", lambda r, n: f"{r['shm_after_bytes']}")])
    return 0


def main(argv=None):
    """CLI entry point; returns a process exit code."""
    import torch

    # One intra-op thread: the client shares this machine's cores with the
    # server's TP workers, which spin on them. A two-thread torch op (the row
    # gather, torch.save) then waits for the busy core, about 1 s here, and
    # that would be timed as the server's tax.
    torch.set_num_threads(1)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://localhost:8000")
    p.add_argument("--model", help="served model name (default: the first of /v1/models)")
    p.add_argument("--embeddings", help="model dir with safetensors (default: served path)")
    p.add_argument("--lengths", default="256,1024,4096", help="prompt lengths, tokens")
    p.add_argument("--repeats", type=int, default=5, help="timed samples per length and kind")
    p.add_argument("--warmup", type=int, default=2, help="untimed samples per length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input", choices=("json", "binary", "region"), default="json",
                   help="how embeds are sent: json (base64 of torch.save, vLLM's format), "
                        "binary (raw bytes after the JSON, shm-embeds' binary body) or "
                        "region (a sealed memfd registered on --regions, then named)")
    p.add_argument("--regions", metavar="SOCKET",
                   help="the server's VLLM_SHM_EMBEDS_REGIONS socket (--input region)")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--exclude-encode", action="store_true",
                   help="start the clock after the client's torch.save + base64 (or framing)")
    p.add_argument("--json", help="write all samples and medians here")
    p.add_argument("--label", help="name of this run in --json / --compare")
    p.add_argument("--check-outputs", action="store_true",
                   help="also compare greedy outputs of text vs embeds")
    p.add_argument("--check-tokens", type=int, default=8, help="tokens to generate for the check")
    p.add_argument("--shm-dir", metavar="DIR",
                   help="server on this host: also record the peak bytes of the tmpfs "
                        "holding DIR used per embeds request, mapped or named (e.g. /dev/shm)")
    p.add_argument("--api-pid", type=int, metavar="PID",
                   help="server on this host: also record the peak memory the API server "
                        "process PID adds during each embeds request (VmHWM; needs root)")
    p.add_argument("--compare", nargs="+", metavar="JSON",
                   help="print --json runs side by side (the first is the baseline)")
    args = p.parse_args(argv)
    if args.compare:
        return compare(args.compare)
    args.region_client = None
    if args.input == "region":
        if not args.regions:
            p.error("--input region needs --regions SOCKET")
        from shm_embeds_client import RegionClient

        args.region_client = RegionClient(args.regions)

    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        p.error("--lengths must be comma-separated integers")
    try:
        models = list_models(args.url, args.timeout)
        card = next((m for m in models if m["id"] == args.model), None) if args.model \
            else models[0]
        model = args.model or card["id"]
        candidates = [(card or {}).get("root"), model]
        emb_dir = args.embeddings or next(
            (c for c in candidates if c and os.path.isdir(c)), None)
        if emb_dir is None:
            print("cannot find the model on disk; pass --embeddings DIR", file=sys.stderr)
            return 2
        weights = load_embedding_matrix(emb_dir)
        client = Client(args.url, model, args.timeout)
        n_special = len(client.tokenize(""))
        print(f"model {model}  embeddings {emb_dir} {tuple(weights.shape)} {weights.dtype}  "
              f"lengths {lengths}  repeats {args.repeats}  warmup {args.warmup}", flush=True)

        results, checks = [], []
        watcher = ShmWatcher(args.shm_dir) if args.shm_dir else None
        for length in lengths:
            results.append(profile_length(client, weights, length, args, n_special, watcher,
                                          PeakRss(args.api_pid) if args.api_pid else None))
            print(f"  length {length}: text {results[-1]['text_median_ms']:.1f} ms, "
                  f"embeds {results[-1]['embeds_median_ms']:.1f} ms", flush=True)
        if args.check_outputs:
            checks = [check_outputs(client, weights, n, args, n_special) for n in lengths]
    except HttpError as e:
        print(f"HTTP error: {e}", file=sys.stderr)
        return 1

    print_table(results)
    for c in checks:
        print(f"check-outputs length {c['length']}: "
              f"{'MATCH' if c['match'] else 'MISMATCH'} {c['text_token_ids']} "
              f"vs {c['embeds_token_ids']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": args.label, "input": args.input, "url": args.url,
                       "client_encode_timed": not args.exclude_encode,
                       "model": model,
                       "embeddings": emb_dir, "repeats": args.repeats,
                       "warmup": args.warmup, "seed": args.seed,
                       "results": results, "checks": checks}, f, indent=1)
    return 3 if any(not c["match"] for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
