#!/usr/bin/env python3
"""Serving benchmark for `cascade serve`, in the manner of vLLM's benchmark_serving.

Replays a shared-prefix workload against a running server (or one it starts):
every request is a completion whose prompt is one shared prefix of
--prefix-tokens token ids followed by --suffix-tokens ids of its own, asking
for exactly --output-tokens tokens (ignore_eos), streamed. Requests arrive as
a Poisson process at --request-rate per second ("inf": all at once), capped
at --max-concurrency in flight. Prompts are token ids (random ids from a
fixed seed), so the lengths are exact and the workload is the one
`cascade bench` runs offline. Each rate gets a prefix of its own, so every
rate starts with a cold prefix cache, as the offline run does.

With --offline (the default with --launch) it also runs `cascade bench` on the
same workload with the same engine options, in the same session, and reports
the server's output throughput at rate inf as a fraction of the offline one.

Per request it records the time to the first token (TTFT), the time per
output token after the first (TPOT), the gaps between streamed chunks (ITL)
and the end-to-end latency, and reports throughput and their mean, median
and percentiles. It scrapes /metrics before and after for prefix-cache hits
and cascade steps. Results go to bench/results/cpu-serve.json (one entry per
rate), a plot to bench/results/cpu-serve.png, and a Markdown table to stdout,
bench/results/cpu-serve.md and the cpu-serve block of bench/RESULTS.md.

    python3 bench/serve_bench.py --launch --request-rate inf,8,2
    python3 bench/serve_bench.py --url http://127.0.0.1:8000 --num-prompts 128

--workload mixed measures head-of-line blocking instead: short requests
(--num-short of them, prompts of --short-prompt-tokens ids, --short-output-tokens
tokens each, Poisson arrivals at --short-rate per second) stream while long
prompts (--long-tokens ids, arriving --long-at seconds after the first short
one) are prefilled. It launches one server per --run (LABEL|BINARY|SERVE ARGS;
an empty BINARY is --cascade), replays the same requests against each, and
reports per run the short requests' TTFT, the inter-token latency of every
stream (overall, while a long prompt is being prefilled, and with none), and
the long prompts' TTFT. Results go to bench/results/cpu-serve-mixed.json,
.md and .png and the cpu-serve-mixed block of bench/RESULTS.md.

    python3 bench/serve_bench.py --workload mixed \
        --run "before|/tmp/old/build/cascade|--threads 2" --run "after||--threads 2"
"""
import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import threading
import time
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))


def scrape(url, key):
    req = urllib.request.Request(url + "/metrics")
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            out[k] = float(v)
    return out


def model_id(url, key):
    req = urllib.request.Request(url + "/v1/models")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


async def one_request(url, key, body, rec):
    """Streams one completion over one HTTP/1.1 connection; fills rec with
    timings (seconds) and counts. All clients run in one asyncio thread, as
    vLLM's benchmark does: a decode step's tokens for every stream wake that
    one thread once, not one thread per stream."""
    u = urllib.parse.urlparse(url)
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n")
    if key:
        head += f"Authorization: Bearer {key}\r\n"
    t0 = time.perf_counter()
    rec["start"] = t0
    writer = None
    try:
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        writer.write(head.encode() + b"\r\n" + payload)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        chunked = False
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            if k.strip().lower() == "transfer-encoding" and "chunked" in v.lower():
                chunked = True
        if status != 200:
            rec["error"] = f"HTTP {status}: {(await reader.read(200))!r}"
            return
        chunks = []
        buf = b""
        done = False
        while not done:
            if chunked:
                n = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
                if n == 0:
                    break
                data = (await reader.readexactly(n + 2))[:-2]
            else:
                data = await reader.read(65536)
                if not data:
                    break
            buf += data
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                if not ev.startswith(b"data: "):
                    continue
                payload = ev[6:]
                if payload == b"[DONE]":
                    done = True
                    break
                j = json.loads(payload)
                now = time.perf_counter()
                if j.get("usage"):
                    rec["output_tokens"] = j["usage"]["completion_tokens"]
                    rec["prompt_tokens"] = j["usage"]["prompt_tokens"]
                    rec["cached_tokens"] = (j["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for c in j.get("choices", []):
                    if c.get("text"):
                        chunks.append(now)
        rec["end"] = time.perf_counter()
        if not done:
            rec["error"] = "stream ended without [DONE]"
            return
        rec["chunks"] = chunks
        rec["ttft"] = chunks[0] - t0 if chunks else None
    except Exception as e:  # noqa: BLE001 - a failed request is recorded, not fatal
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.close()


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    f = int(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def summarize(name, xs, percentiles):
    ms = [x * 1000.0 for x in xs]
    out = {f"mean_{name}_ms": statistics.fmean(ms) if ms else float("nan"),
           f"median_{name}_ms": statistics.median(ms) if ms else float("nan"),
           f"std_{name}_ms": statistics.pstdev(ms) if ms else float("nan")}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = pct(ms, p)
    return out


def run_rate(args, url, model, rate, prompts):
    recs = [dict() for _ in prompts]
    rng = random.Random(args.seed + 1)
    m0 = scrape(url, args.api_key)

    async def all_requests():
        sem = asyncio.Semaphore(args.max_concurrency if args.max_concurrency > 0 else len(prompts))

        async def go(i):
            async with sem:
                body = {"model": model, "prompt": prompts[i], "max_tokens": args.output_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                await one_request(url, args.api_key, body, recs[i])

        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.create_task(go(i)))
            if rate != float("inf") and i + 1 < len(prompts):
                await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)

    t_start = time.perf_counter()
    asyncio.run(all_requests())
    duration = time.perf_counter() - t_start
    m1 = scrape(url, args.api_key)

    ok = [r for r in recs if "error" not in r and r.get("chunks")]
    errors = [r["error"] for r in recs if "error" in r]
    ttft = [r["ttft"] for r in ok]
    tpot = [(r["end"] - r["start"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r.get("output_tokens", 0) > 1]
    itl = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    e2el = [r["end"] - r["start"] for r in ok]
    out_tok = sum(r.get("output_tokens", 0) for r in ok)
    in_tok = sum(r.get("prompt_tokens", 0) for r in ok)

    def delta(k):
        return m1.get(k, 0) - m0.get(k, 0)

    res = {
        "request_rate": "inf" if rate == float("inf") else rate,
        "max_concurrency": args.max_concurrency or None,
        "num_prompts": len(prompts),
        "completed": len(ok),
        "failed": len(errors),
        "errors": errors[:5],
        "duration_s": duration,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tok / duration,
        "total_token_throughput": (in_tok + out_tok) / duration,
        "prefix_cache_hit_tokens": delta("cascade_prefix_cache_hits_total"),
        "prefix_cache_query_tokens": delta("cascade_prefix_cache_queries_total"),
        "prompt_tokens_computed": delta("cascade_prompt_tokens_computed_total"),
        "engine_steps": delta("cascade_steps_total"),
        "cascade_steps": delta("cascade_cascade_steps_total"),
        "preemptions": delta("cascade_preemptions_total"),
        "engine_busy_s": delta("cascade_engine_busy_seconds_total"),
    }
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        res.update(summarize(name, xs, args.percentiles))
    res["_ttft_s"] = ttft
    res["_tpot_s"] = tpot
    return res


def print_result(r, percentiles):
    print(f"============ Serving Benchmark Result (rate {r['request_rate']}) ============")
    rows = [("Successful requests", r["completed"]), ("Failed requests", r["failed"]),
            ("Benchmark duration (s)", f"{r['duration_s']:.2f}"),
            ("Total input tokens", r["total_input_tokens"]), ("Total generated tokens", r["total_output_tokens"]),
            ("Request throughput (req/s)", f"{r['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{r['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{r['total_token_throughput']:.2f}"),
            ("Prefix-cache hit tokens", f"{r['prefix_cache_hit_tokens']:.0f} of {r['prefix_cache_query_tokens']:.0f}"),
            ("Steps with cascade", f"{r['cascade_steps']:.0f} of {r['engine_steps']:.0f}")]
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        rows.append((f"---- {title} ----", ""))
        rows.append((f"Mean {name.upper()} (ms)", f"{r[f'mean_{name}_ms']:.2f}"))
        rows.append((f"Median {name.upper()} (ms)", f"{r[f'median_{name}_ms']:.2f}"))
        for p in percentiles:
            rows.append((f"P{p:g} {name.upper()} (ms)", f"{r[f'p{p:g}_{name}_ms']:.2f}"))
    for k, v in rows:
        print(f"{k:<42}{v:>14}")
    if r["errors"]:
        print("errors:", r["errors"])


def markdown(results, args, offline=None):
    lines = [f"Shared-prefix workload: {args.num_prompts} requests, {args.prefix_tokens}-token shared prefix + "
             f"{args.suffix_tokens} own tokens, {args.output_tokens} output tokens each (greedy, ignore_eos).", "",
             "| rate (req/s) | done | duration (s) | output tok/s | total tok/s | TTFT p50 / p99 (ms) | "
             "TPOT p50 / p99 (ms) | ITL p50 (ms) | prefix hits | cascade steps |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['request_rate']} | {r['completed']}/{r['num_prompts']} | {r['duration_s']:.1f} | "
                     f"{r['output_throughput']:.1f} | {r['total_token_throughput']:.1f} | "
                     f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                     f"{r['median_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f} | {r['median_itl_ms']:.1f} | "
                     f"{r['prefix_cache_hit_tokens']:.0f}/{r['prefix_cache_query_tokens']:.0f} | "
                     f"{r['cascade_steps']:.0f}/{r['engine_steps']:.0f} |")
    if offline:
        lines += ["", f"Offline `cascade bench` on the same workload and engine options, same session: "
                      f"{offline['output_tok_per_s']:.1f} output tok/s in {offline['elapsed_s']:.1f} s "
                      f"(TTFT p50 {offline['ttft_ms_p50']:.0f} ms, TPOT p50 {offline['tpot_ms_p50']:.1f} ms)."]
        for r in results:
            if "vs_offline" in r:
                lines.append(f"The server at rate inf reaches {100 * r['vs_offline']:.1f}% of it.")
    return "\n".join(lines) + "\n"


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        for a, key, title in ((ax[0], "_ttft_s", "time to first token"), (ax[1], "_tpot_s", "time per output token")):
            xs = sorted(x * 1000 for x in r[key])
            if xs:
                a.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"rate {r['request_rate']}")
            a.set_title(title)
            a.set_xlabel("ms")
            a.set_ylabel("fraction of requests")
            a.grid(alpha=0.3)
    ax[0].legend()
    fig.suptitle("cascade serve, shared-prefix workload (CDF per request rate)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def update_results(md, meta, name="cpu-serve", head=None):
    """Rewrites the table between the `name` markers of bench/RESULTS.md, under `head`
    (default: the machine and the time)."""
    path = os.path.join(HERE, "RESULTS.md")
    s = open(path).read()
    m0, m1 = f"<!-- {name}-table -->", f"<!-- /{name}-table -->"
    if m0 not in s or m1 not in s:
        return
    if head is None:
        head = f"Measured on {meta['cpu_model'] or 'an unknown CPU'} ({meta['cpus']} cores), {meta['time']}.\n\n"
    s = s[:s.index(m0) + len(m0)] + "\n" + head + md + s[s.index(m1):]
    with open(path, "w") as f:
        f.write(s)
    print(f"rewrote the table in {path}")


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def run_offline(args):
    """`cascade bench` on the same workload (all requests at once) and engine options."""
    cmd = [args.cascade, "bench", "-m", args.model, "--requests", str(args.num_prompts),
           "--prefix", str(args.prefix_tokens), "--suffix", str(args.suffix_tokens),
           "--output", str(args.output_tokens), "--seed", str(args.seed), "--json", *engine_args(args.serve_args)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    print(f"offline `cascade bench`: {res['output_tok_per_s']:.1f} output tok/s in {res['elapsed_s']:.1f} s")
    return res


def engine_args(serve_args):
    """The engine options of a `cascade serve` command line (those `cascade bench` takes too)."""
    keep = {"--threads", "--kv-cache-mb", "--max-batch-tokens", "--max-itl-ms"}
    flags = {"--no-cascade", "--no-prefix-cache"}
    a, out, i = serve_args.split(), [], 0
    while i < len(a):
        if a[i] in keep and i + 1 < len(a):
            out += a[i:i + 2]
            i += 2
            continue
        if a[i] in flags:
            out.append(a[i])
        i += 1
    return out


def launch(args, binary=None, serve_args=None):
    cmd = [binary or args.cascade, "serve", "-m", args.model, "--port", "0",
           *(args.serve_args if serve_args is None else serve_args).split()]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        line = p.stderr.readline()
        if not line:
            break
        m = re.search(r"listening on (http://\S+?:\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
            return p, m.group(1)
    p.kill()
    raise SystemExit("server did not start")


# ---- the mixed workload: short streams beside long prefills -----------------------------------

def mixed_requests(args):
    """[(arrival s, kind, prompt ids, max_tokens)], sorted: the same for every run."""
    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.short_prompt_tokens.split(","))
    reqs, t = [], 0.0
    for _ in range(args.num_short):
        reqs.append((t, "short", [rng.randrange(1000, 40000) for _ in range(rng.randint(lo, hi))],
                     args.short_output_tokens))
        t += rng.expovariate(args.short_rate)
    for at in (float(x) for x in args.long_at.split(",") if x.strip()):
        reqs.append((at, "long", [rng.randrange(1000, 40000) for _ in range(args.long_tokens)],
                     args.long_output_tokens))
    return sorted(reqs, key=lambda r: r[0])


def warm_up(url, model):
    """A prefill and a few decode steps before the measured requests, so that the engine
    starts as a server that has been running does (pages touched, step cost model fitted)."""
    rng = random.Random(12345)
    body = {"model": model, "prompt": [rng.randrange(1000, 40000) for _ in range(512)], "max_tokens": 16,
            "temperature": 0, "ignore_eos": True, "stream": True}
    asyncio.run(one_request(url, None, body, {}))


def run_mixed_once(args, url, model, reqs):
    recs = [dict(kind=k, prompt_len=len(p)) for _, k, p, _ in reqs]
    m0 = scrape(url, args.api_key)

    async def all_requests():
        t0 = time.perf_counter()

        async def go(i):
            at, _, prompt, n = reqs[i]
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            await one_request(url, args.api_key, body, recs[i])

        await asyncio.gather(*(go(i) for i in range(len(reqs))))

    t_start = time.perf_counter()
    asyncio.run(all_requests())
    duration = time.perf_counter() - t_start
    m1 = scrape(url, args.api_key)
    ok = [r for r in recs if "error" not in r and r.get("chunks")]
    errors = [r["error"] for r in recs if "error" in r]
    longs = [r for r in ok if r["kind"] == "long"]
    shorts = [r for r in ok if r["kind"] == "short"]
    windows = [(r["start"], r["chunks"][0]) for r in longs]  # each long prompt's prefill

    def during(a, b):
        return any(b > w0 and a < w1 for w0, w1 in windows)

    gaps = [(a, b) for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    itl = [b - a for a, b in gaps]
    itl_in = [b - a for a, b in gaps if during(a, b)]
    itl_out = [b - a for a, b in gaps if not during(a, b)]
    out_tok = sum(r.get("output_tokens", 0) for r in ok)

    def delta(k):
        return m1.get(k, 0) - m0.get(k, 0)

    res = {"completed": len(ok), "requests": len(reqs), "failed": len(errors), "errors": errors[:5],
           "duration_s": duration, "output_tokens": out_tok, "output_throughput": out_tok / duration,
           "engine_steps": delta("cascade_steps_total"), "preemptions": delta("cascade_preemptions_total"),
           "itl_limited_steps": (delta("cascade_itl_limited_steps_total")
                                 if "cascade_itl_limited_steps_total" in m1 else None),  # older servers: none
           "long_ttft_s": [r["ttft"] for r in longs],
           "itl_count": len(itl), "itl_during_long_prefill_count": len(itl_in),
           "max_itl_ms": max(itl) * 1e3 if itl else float("nan")}
    pcts = args.percentiles
    res.update(summarize("short_ttft", [r["ttft"] for r in shorts], pcts))
    res.update(summarize("itl", itl, pcts))
    res.update(summarize("itl_during_long_prefill", itl_in, pcts))
    res.update(summarize("itl_without_long_prefill", itl_out, pcts))
    res["_itl_s"] = itl
    res["_short_ttft_s"] = [r["ttft"] for r in shorts]
    t0 = min(r["start"] for r in recs if "start" in r)
    res["per_request"] = [{"kind": r["kind"], "prompt_tokens": r["prompt_len"],
                        "arrival_s": round(r["start"] - t0, 3) if "start" in r else None,
                        "ttft_s": round(r["ttft"], 3) if r.get("ttft") is not None else None,
                        "tokens": len(r.get("chunks", [])),
                        "max_gap_ms": round(max((b - a for a, b in zip(r["chunks"], r["chunks"][1:])), default=0) * 1e3, 1)
                        if r.get("chunks") else None, "error": r.get("error")} for r in recs]
    return res


def mixed_markdown(runs, args):
    lines = [f"Mixed workload: {args.num_short} short requests ({args.short_prompt_tokens.replace(',', '-')} prompt "
             f"tokens, {args.short_output_tokens} output tokens, Poisson arrivals at {args.short_rate:g}/s) "
             f"streaming while {len(args.long_at.split(','))} prompts of {args.long_tokens} tokens "
             f"({args.long_output_tokens} output tokens) arrive at {args.long_at.replace(',', ', ')} s; "
             "greedy, ignore_eos, every request streamed.", "",
             "| run | server options | short TTFT p50 / p99 (ms) | ITL p50 / p99 / max (ms) | "
             "ITL p99 while a long prompt prefills (ms) | ITL p50 / p99 with none (ms) | long TTFT (s) | "
             "output tok/s | duration (s) | steps cut to the target | machine load before / after |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        lt = ", ".join(f"{x:.1f}" for x in r["long_ttft_s"])
        cut = "-" if r["itl_limited_steps"] is None else f"{r['itl_limited_steps']:.0f}"
        lines.append(f"| {r['label']} | `{r['serve_args'].strip() or '(defaults)'}` | "
                     f"{r['p50_short_ttft_ms']:.0f} / {r['p99_short_ttft_ms']:.0f} | "
                     f"{r['p50_itl_ms']:.0f} / {r['p99_itl_ms']:.0f} / {r['max_itl_ms']:.0f} | "
                     f"{r['p99_itl_during_long_prefill_ms']:.0f} | "
                     f"{r['p50_itl_without_long_prefill_ms']:.0f} / {r['p99_itl_without_long_prefill_ms']:.0f} | "
                     f"{lt} | {r['output_throughput']:.1f} | {r['duration_s']:.1f} | "
                     f"{cut} of {r['engine_steps']:.0f} | {r['loadavg_before']:.1f} / {r['loadavg_after']:.1f} |")
    return "\n".join(lines) + "\n"


def mixed_plot(runs, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        for a, key, title in ((ax[0], "_itl_s", "inter-token latency, every stream"),
                              (ax[1], "_short_ttft_s", "time to first token, short requests")):
            xs = sorted(x * 1000 for x in r[key])
            if xs:
                a.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r["label"])
            a.set_title(title)
            a.set_xlabel("ms")
            a.set_xscale("log")
            a.set_ylabel("fraction")
            a.grid(alpha=0.3)
    ax[0].legend()
    fig.suptitle("cascade serve: short streams beside long prefills (CDF per run)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def run_mixed(args):
    reqs = mixed_requests(args)
    specs = args.run or ["itl off||--max-itl-ms 0", "itl 100 ms||--max-itl-ms 100"]
    runs = []
    for spec in specs:
        parts = spec.split("|")
        if len(parts) != 3:
            raise SystemExit(f"--run takes LABEL|BINARY|SERVE ARGS, got {spec!r}")
        label, binary, serve_args = parts
        serve_args = (args.serve_args + " " + serve_args).strip()
        proc, url = launch(args, binary or None, serve_args)
        try:
            model = model_id(url, args.api_key)
            warm_up(url, model)
            print(f"run {label!r}: {binary or args.cascade} serve {serve_args}")
            load0 = os.getloadavg()[0]
            r = run_mixed_once(args, url, model, reqs)
            load1 = os.getloadavg()[0]
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        # the machine is shared: its 1-minute load average before and after says how quiet it was
        r.update(label=label, binary=binary or args.cascade, serve_args=serve_args, loadavg_before=load0,
                 loadavg_after=load1)
        print(f"  {r['completed']}/{r['requests']} done in {r['duration_s']:.1f} s; short TTFT p50 "
              f"{r['p50_short_ttft_ms']:.0f} ms p99 {r['p99_short_ttft_ms']:.0f} ms; ITL p50 {r['p50_itl_ms']:.0f} "
              f"p99 {r['p99_itl_ms']:.0f} max {r['max_itl_ms']:.0f} ms; during long prefills p99 "
              f"{r['p99_itl_during_long_prefill_ms']:.0f} ms; long TTFT {r['long_ttft_s']}")
        if r["errors"]:
            print("  errors:", r["errors"])
        runs.append(r)
    meta = {"workload": {"name": "mixed", "num_short": args.num_short, "short_rate": args.short_rate,
                         "short_prompt_tokens": args.short_prompt_tokens,
                         "short_output_tokens": args.short_output_tokens, "long_tokens": args.long_tokens,
                         "long_at_s": args.long_at, "long_output_tokens": args.long_output_tokens, "seed": args.seed},
            "model": args.model, "cpus": os.cpu_count(), "cpu_model": cpu_model(),
            "reference": "itl_without_long_prefill: the gaps of the same run while no long prompt is "
                         "prefilled (decode-only steps), the floor any policy starts from",
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "runs": [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs]},
                  f, indent=1)
    print(f"wrote {args.out}")
    md = mixed_markdown(runs, args)
    print(md)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(md)
    if args.results_md:
        update_results(md, meta, "cpu-serve-mixed")
    mixed_plot(runs, args.plot)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--launch", action="store_true", help="start `cascade serve` on a free port for the run")
    ap.add_argument("--cascade", default=os.path.join(os.environ.get("BUILD", "build"), "cascade"))
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--serve-args", default="", help="extra options for `cascade serve` with --launch")
    ap.add_argument("--api-key", default=os.environ.get("CASCADE_API_KEY"))
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--request-rate", default="inf", help="requests per second, comma-separated list; inf = all at once")
    ap.add_argument("--max-concurrency", type=int, default=0)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--suffix-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--percentiles", default="50,90,99")
    ap.add_argument("--results-md", action=argparse.BooleanOptionalAction, default=None,
                    help="rewrite the table in bench/RESULTS.md (default: when writing the default --out)")
    ap.add_argument("--offline", action=argparse.BooleanOptionalAction, default=None,
                    help="also run offline `cascade bench` on the same workload (default: with --launch)")
    ap.add_argument("--workload", choices=("shared-prefix", "mixed"), default="shared-prefix")
    ap.add_argument("--num-short", type=int, default=100, help="mixed: short requests")
    ap.add_argument("--short-rate", type=float, default=2.0, help="mixed: short requests per second (Poisson)")
    ap.add_argument("--short-prompt-tokens", default="8,64", help="mixed: MIN,MAX prompt ids of a short request")
    ap.add_argument("--short-output-tokens", type=int, default=64)
    ap.add_argument("--long-tokens", type=int, default=6000, help="mixed: prompt ids of a long request")
    ap.add_argument("--long-at", default="3,10", help="mixed: arrival of each long request, seconds")
    ap.add_argument("--long-output-tokens", type=int, default=16)
    ap.add_argument("--run", action="append", metavar="LABEL|BINARY|SERVE ARGS",
                    help="mixed: a server to measure (repeat; default: --max-itl-ms 0, then 100)")
    ap.add_argument("--out", default=None, help="JSON (default bench/results/cpu-serve.json, "
                                                "or cpu-serve-mixed.json for --workload mixed)")
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    args.percentiles = [float(p) for p in args.percentiles.split(",")]
    name = "cpu-serve-mixed" if args.workload == "mixed" else "cpu-serve"
    default_out = os.path.join(HERE, "results", name + ".json")
    args.out = args.out or default_out
    args.plot = args.plot or os.path.splitext(args.out)[0] + ".png"
    if args.offline is None:
        args.offline = args.launch
    if args.results_md is None:
        args.results_md = os.path.abspath(args.out) == default_out
    if args.workload == "mixed":
        run_mixed(args)
        return

    def make_prompts(seed):
        rng = random.Random(seed)
        prefix = [rng.randrange(1000, 40000) for _ in range(args.prefix_tokens)]
        return [prefix + [rng.randrange(1000, 40000) for _ in range(args.suffix_tokens)]
                for _ in range(args.num_prompts)]

    proc = None
    url = args.url.rstrip("/")
    if args.launch:
        proc, url = launch(args)
    try:
        model = model_id(url, args.api_key)
        # warm-up: one short request (page faults, thread start), not measured
        asyncio.run(one_request(url, args.api_key, {"model": model, "prompt": [1000, 1001, 1002],
                                                    "max_tokens": 2, "stream": True}, {}))
        results = []
        for k, rate_s in enumerate(args.request_rate.split(",")):
            rate = float("inf") if rate_s.strip() == "inf" else float(rate_s)
            r = run_rate(args, url, model, rate, make_prompts(args.seed + 1000 * k))
            print_result(r, args.percentiles)
            results.append(r)
    finally:
        if proc:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)

    offline = run_offline(args) if args.offline else None
    if offline:
        for r in results:
            if r["request_rate"] == "inf":
                r["offline_output_throughput"] = offline["output_tok_per_s"]
                r["vs_offline"] = r["output_throughput"] / offline["output_tok_per_s"]
                print(f"server at rate inf: {r['output_throughput']:.1f} output tok/s = {100 * r['vs_offline']:.1f}% "
                      f"of offline `cascade bench` ({offline['output_tok_per_s']:.1f} tok/s)")

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    meta = {"workload": {"num_prompts": args.num_prompts, "prefix_tokens": args.prefix_tokens,
                         "suffix_tokens": args.suffix_tokens, "output_tokens": args.output_tokens, "seed": args.seed},
            "model": args.model, "url": url, "cpus": os.cpu_count(), "cpu_model": cpu_model(),
            "serve_args": args.serve_args, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "offline": offline, "results": [{k: v for k, v in r.items() if not k.startswith("_")} for r in results]},
                  f, indent=1)
    print(f"wrote {args.out}")
    md = markdown(results, args, offline)
    print(md)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(md)
    if args.results_md:
        update_results(md, meta)
    plot(results, args.plot)


if __name__ == "__main__":
    main()
