"""The serving benchmark: an OpenAI-compatible server (engc run, LMDeploy's api_server, ...) driven over HTTP
the way users drive it: streaming chat completions, sampled, prompts and outputs of a realistic length mix.

    python bench/serve_bench.py run --url http://127.0.0.1:23333 --model NAME --label engc \\
        --concurrency 1,16,64,256 --rates 2,8,32 --requests 200 --out bench/results/serve_engc.json
    python bench/serve_bench.py plot bench/results/serve_engc.json bench/results/serve_lmdeploy.json \\
        -o bench/results/serve.png          # output tok/s against ITL p99, one line a server

Workloads (--workload): "mix" draws prompt and output lengths from lognormal distributions shaped like
chat traffic (median prompt ~250 words, output ~180 tokens, long tails, clipped), seeded so both servers get
the same requests; "fixed" sends --input-words words and asks --output-len tokens of every request. Prompts are
random English words (their token count depends on the tokenizer; the usage the server reports is recorded).
Every request asks exactly its output length (ignore_eos where the server takes it: engc, LMDeploy, vLLM), so
two servers produce the same number of tokens.

Per level: output tok/s (tokens the server reported, over the level's wall time), TTFT p50/p99 (request sent to
first content), ITL p50/p99 (gaps between content chunks of a request), errors. A concurrency level keeps N
requests in flight; a rate level sends Poisson arrivals at that many requests a second. A level's requests are
shared among client processes (--procs; by default one per 64 streams), so the client is not what is measured.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import random
import time
from pathlib import Path

import httpx

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact water room mother area money story month lot right "
         "study book job word business issue side kind head house service friend father power hour game line "
         "end member law car city community name president team minute idea kid body information back parent "
         "face others level office door health art war history party result change morning reason research "
         "girl guy moment air teacher force education").split()


def workload(kind: str, n: int, seed: int, input_words: int, output_len: int) -> list[tuple[str, int]]:
    """(prompt, output tokens) of n requests, the same for the same arguments."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if kind == "fixed":
            words, tokens = input_words, output_len
        else:   # chat-like: lognormal lengths, clipped to what an 8k context holds
            words = int(min(max(rng.lognormvariate(5.5, 0.9), 8), 3000))
            tokens = int(min(max(rng.lognormvariate(5.2, 0.7), 8), 1024))
        out.append((" ".join(rng.choice(WORDS) for _ in range(words)), tokens))
    return out


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                      sampling: dict) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, **sampling}
    sent = time.perf_counter()
    stamps, usage, error = [], None, None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        stamps.append(time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        error = f"{type(e).__name__}: {e}"
    if error or not stamps:
        return {"error": error or "no content streamed"}
    return {"ttft": stamps[0] - sent, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "output_tokens": (usage or {}).get("completion_tokens", len(stamps)),
            "prompt_tokens": (usage or {}).get("prompt_tokens")}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def summarize(level: dict, results: list[dict], seconds: float) -> dict:
    ok = [r for r in results if "error" not in r]
    itl = [x for r in ok for x in r["itl"]]
    ttft = [r["ttft"] for r in ok]
    ms = lambda v: None if v is None else round(1000 * v, 2)
    return {**level, "requests": len(results), "errors": len(results) - len(ok),
            "first_errors": sorted({r["error"] for r in results if "error" in r})[:3],
            "seconds": round(seconds, 3), "output_tok_s": round(sum(r["output_tokens"] for r in ok) / seconds, 1),
            "prompt_tokens_mean": round(sum(r["prompt_tokens"] or 0 for r in ok) / max(len(ok), 1), 1),
            "ttft_ms_p50": ms(percentile(ttft, 50)), "ttft_ms_p99": ms(percentile(ttft, 99)),
            "itl_ms_p50": ms(percentile(itl, 50)), "itl_ms_p99": ms(percentile(itl, 99))}


async def run_part(url: str, model: str, requests: list[tuple[str, int]], sampling: dict,
                   concurrency: int | None = None, rate: float | None = None, seed: int = 0) -> list[dict]:
    """One process's share of a level: at most `concurrency` requests in flight, or Poisson arrivals at `rate`
    a second; each request's result (one_request's)."""
    limits = httpx.Limits(max_connections=max(concurrency or 0, 1024), max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        gate = asyncio.Semaphore(concurrency) if concurrency else None
        rng = random.Random(seed)

        async def send(prompt, tokens):
            if gate is None:
                return await one_request(client, url, model, prompt, tokens, sampling)
            async with gate:
                return await one_request(client, url, model, prompt, tokens, sampling)

        tasks = []
        for prompt, tokens in requests:
            tasks.append(asyncio.create_task(send(prompt, tokens)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


def _ready(_: int) -> bool:
    """A no-op each worker runs once, so the pool's processes have started before a level is timed."""
    return True


def _part(args: tuple) -> list[dict]:
    """A worker process's share of a level (a top-level function: the spawn context pickles it by name)."""
    return asyncio.run(run_part(*args))


# streams in flight a client process drives: one Python process parsing every streamed event of 256 streams is
# itself the limit (it held a server's 256-stream figure to about half of what two processes measured)
PER_PROC = 64


def procs_for(concurrency: int | None, rate: float | None, procs: int) -> int:
    """Client processes for a level: `procs` where given (> 0), else one per PER_PROC streams in flight, one for
    a rate level."""
    if procs > 0:
        return procs
    return -(-concurrency // PER_PROC) if concurrency else 1


def run_level(url: str, model: str, requests: list[tuple[str, int]], sampling: dict, concurrency: int | None = None,
              rate: float | None = None, seed: int = 0, procs: int = 0) -> dict:
    """One level over procs_for() client processes, each with its share of the requests and of the concurrency
    (or of the rate: Poisson arrivals split over processes stay Poisson), timed from the first send to the
    last answer of all of them."""
    n = min(procs_for(concurrency, rate, procs), len(requests))
    if n <= 1:
        started = time.perf_counter()
        results = asyncio.run(run_part(url, model, requests, sampling, concurrency, rate, seed))
    else:
        shares = [requests[i::n] for i in range(n)]
        parts = [(url, model, share, sampling, concurrency and (concurrency // n + (i < concurrency % n)),
                  rate and rate / n, seed + i) for i, share in enumerate(shares)]
        with concurrent.futures.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_ready, range(n)))
            started = time.perf_counter()
            results = [r for part in pool.map(_part, parts) for r in part]
    seconds = time.perf_counter() - started
    level = {"concurrency": concurrency} if concurrency else {"rate": rate}
    return {**summarize(level, results, seconds), "client_processes": n}


def run(args) -> dict:
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    levels = [("concurrency", int(c)) for c in args.concurrency.split(",") if c] + \
             [("rate", float(r)) for r in args.rates.split(",") if r]
    report = {"label": args.label, "url": args.url, "model": args.model, "workload": args.workload,
              "sampling": sampling, "levels": []}
    warm = workload("fixed", 2, args.seed + 1, 16, 8)
    run_level(args.url, args.model, warm, sampling, concurrency=2, procs=1)
    for kind, value in levels:
        # a level sends at least 4 rounds of its concurrency, so the tail of a batch is not all it measures
        n = max(args.requests, 4 * value) if kind == "concurrency" else args.requests
        reqs = workload(args.workload, n, args.seed, args.input_words, args.output_len)
        result = run_level(args.url, args.model, reqs, sampling, seed=args.seed, procs=args.procs, **{kind: value})
        print(json.dumps(result), flush=True)
        report["levels"].append(result)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


def plot(files: list[str], out: str) -> None:
    """Output tok/s against ITL p99 over the concurrency levels, one line a report (server)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for f in files:
        report = json.loads(Path(f).read_text())
        levels = [lv for lv in report["levels"] if lv.get("concurrency") and lv["itl_ms_p99"] is not None]
        ax.plot([lv["itl_ms_p99"] for lv in levels], [lv["output_tok_s"] for lv in levels], marker="o",
                label=report["label"])
        for lv in levels:
            ax.annotate(str(lv["concurrency"]), (lv["itl_ms_p99"], lv["output_tok_s"]), fontsize=8,
                        textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("ITL p99 (ms)")
    ax.set_ylabel("output tokens / s")
    ax.set_title("streaming chat, sampled; labels: concurrency")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="drive one server and write its JSON")
    r.add_argument("--url", required=True)
    r.add_argument("--model", required=True, help="the model name the server answers to")
    r.add_argument("--label", default="server")
    r.add_argument("--workload", choices=("mix", "fixed"), default="mix")
    r.add_argument("--input-words", type=int, default=750, help="fixed: prompt words (~1000 tokens)")
    r.add_argument("--output-len", type=int, default=200, help="fixed: output tokens")
    r.add_argument("--concurrency", default="1,16,64,256")
    r.add_argument("--rates", default="", help="requests a second, comma list (Poisson arrivals)")
    r.add_argument("--requests", type=int, default=200, help="requests a level (concurrency levels: >= 4x it)")
    r.add_argument("--temperature", type=float, default=0.8)
    r.add_argument("--top-p", type=float, default=0.95)
    r.add_argument("--top-k", type=int, default=50)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--procs", type=int, default=0,
                   help=f"client processes a level (default: one per {PER_PROC} streams in flight, one for a rate "
                        "level)")
    r.add_argument("--out")
    p = sub.add_parser("plot", help="output tok/s against ITL p99 of several runs, as a PNG")
    p.add_argument("files", nargs="+")
    p.add_argument("-o", "--out", required=True)
    args = ap.parse_args(argv)
    run(args) if args.cmd == "run" else plot(args.files, args.out)


if __name__ == "__main__":
    main()
