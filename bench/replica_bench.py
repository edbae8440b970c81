#!/usr/bin/env python3
"""Replicas behind HAProxy: prefix-affinity routing against round-robin and
least-connections, on loopback.

For each policy it starts fresh replicas and the balancer with
deploy/replicas.sh (`--balance prefix|roundrobin|leastconn`; every replica
starts with an empty prefix cache), replays one workload through the balancer
and stops them. The workload: --prompts system prompts of exactly
--prefix-tokens tokens each (text of words the model's tokenizer keeps whole,
counted with the replicas' /tokenize), --requests-per-prompt chat requests
each with a question of its own, in a shuffled order, arriving as a Poisson
process at --rate requests per second, each streaming exactly
--output-tokens tokens (greedy, ignore_eos). The same seed gives every policy
the same requests at the same times.

Per policy: throughput (requests and output tokens per second over the run),
TTFT and TPOT p50/p99 from the client's side, the prompt tokens the replicas
computed and their aggregate prefix-cache hit rate (each replica's /metrics
before and after), and for every system prompt the replicas that served it
and the replicas that computed it (a request whose usage reports fewer cached
tokens than the system prompt's whole pages computed at least part of it
there). Writes bench/results/cpu-replicas.json, a plot
bench/results/cpu-replicas.png and the table between the cpu-replicas markers
of bench/RESULTS.md.

    python3 bench/replica_bench.py                     # the measured run (a few minutes)
    python3 bench/replica_bench.py --requests-per-prompt 8 --out /tmp/r.json   # a quick look
"""
import argparse
import asyncio
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_bench import cpu_model, pct  # noqa: E402
from serve_bench import update_results as update_table  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "bench")
SCRIPT = os.path.join(ROOT, "deploy", "replicas.sh")
# common English words; the workload keeps those the tokenizer makes one token of, with a space before
WORDS = """time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government number night
point home water room mother area money story fact month lot right study book eye job word business issue
side kind head house service friend father power hour game line end member law car city community name
president team minute idea kid body information back parent face others level office door health person
art war history party result change morning reason research girl guy moment air teacher force education
foot boy age policy music market sense nation plan college interest death experience effect class control
care field development role effort rate heart drug show leader light voice wife police mind price report
decision son view relationship town road arm difference value building action model season society tax
director position player record paper space ground form event official matter center couple site project
activity star table need court oil situation cost industry figure street image phone data picture practice
piece land product doctor wall patient worker news test movie north love support technology step baby
computer type attention film tree source organization hair window evidence population site blood""".split()


def get(url, timeout=30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def post(url, body, timeout=60):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def scrape(url):
    out = {}
    for line in get(url + "/metrics").splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            out[k] = float(v)
    return out


def ntok(url, text):
    return len(post(url + "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"])


def make_system_prompts(url, n, length, seed):
    """n texts of exactly `length` tokens: words that are one token each with a space
    before them, after a first word that is one token alone."""
    single = [w for w in WORDS if ntok(url, " " + w) == 1 and ntok(url, w) == 1]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(single) for _ in range(length)]
        text = " ".join(words)
        got = ntok(url, text)
        # whole words are whole tokens, so this is exact; trim or pad if a merge surprised us
        while got != length:
            words = words[:-1] if got > length else words + [rng.choice(single)]
            text = " ".join(words)
            got = ntok(url, text)
        out.append(text)
    return out


def make_requests(args, prompts):
    rng = random.Random(args.seed)
    reqs = []
    for p in range(len(prompts)):
        for q in range(args.requests_per_prompt):
            a, b, c = (rng.choice(WORDS) for _ in range(3))
            reqs.append({"prompt": p, "question": f"Question {q} of set {p}: how do the {a}, the {b} and the "
                                                  f"{c} relate? Answer briefly."})
    rng.shuffle(reqs)
    t = 0.0
    for r in reqs:
        r["at"] = t
        t += rng.expovariate(args.rate)
    return reqs


async def one_request(host, port, body, rec):
    """Streams one chat completion; fills rec with the replica, timings and usage."""
    payload = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    t0 = time.perf_counter()
    rec["start"] = t0
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(head + payload)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        chunked = False
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            k = k.strip().lower()
            if k == "transfer-encoding" and "chunked" in v.lower():
                chunked = True
            if k == "x-cascade-replica":
                rec["replica"] = v.strip()
        if status != 200:
            rec["error"] = f"HTTP {status}: {(await reader.read(300))!r}"
            return
        buf, done, first = b"", False, None
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
                if ev[6:] == b"[DONE]":
                    done = True
                    break
                j = json.loads(ev[6:])
                if j.get("usage"):
                    u = j["usage"]
                    rec["output_tokens"] = u["completion_tokens"]
                    rec["prompt_tokens"] = u["prompt_tokens"]
                    rec["cached_tokens"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for c in j.get("choices", []):
                    if first is None and (c.get("delta") or {}).get("content"):
                        first = time.perf_counter()
        rec["end"] = time.perf_counter()
        if not done:
            rec["error"] = "stream ended without [DONE]"
        elif first is None:
            rec["error"] = "no content"
        else:
            rec["ttft"] = first - t0
    except Exception as e:  # noqa: BLE001 - a failed request is recorded
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.close()


def run_workload(host, port, model, prompts, reqs, output_tokens):
    recs = [dict() for _ in reqs]

    async def go():
        t_start = time.perf_counter()
        tasks = []
        for r, rec in zip(reqs, recs):
            delay = t_start + r["at"] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = {"model": model, "max_tokens": output_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True},
                    "messages": [{"role": "system", "content": prompts[r["prompt"]]},
                                 {"role": "user", "content": r["question"]}]}
            tasks.append(asyncio.create_task(one_request(host, port, body, rec)))
        await asyncio.gather(*tasks)
        return time.perf_counter() - t_start

    duration = asyncio.run(go())
    return recs, duration


def cpu_seconds(pid):
    """User + system CPU time of a process, all its threads, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sh(run_dir, *args, timeout=600):
    r = subprocess.run(["bash", SCRIPT, args[0], "--run-dir", run_dir, *args[1:]], capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"replicas.sh {' '.join(args)} failed:\n{r.stderr}")
    return r.stderr


def run_policy(args, policy, prompts_cache):
    run_dir = tempfile.mkdtemp(prefix="cascade-replica-bench-")
    serve = ["--kv-cache-mb", str(args.kv_cache_mb), "--max-context", "2048"]
    log = sh(run_dir, "start", "-n", str(args.replicas), "--port", str(args.port), "--balance", policy,
             "--threads", str(args.threads), "--cascade", args.cascade, "--model", args.model,
             *(["--cpus", args.cpus] if args.cpus else []),
             *(["--balance-factor", str(args.balance_factor)] if args.balance_factor else []), "--", *serve)
    lb = f"http://127.0.0.1:{args.port}"
    reps = {f"r{k}": f"http://127.0.0.1:{args.port + 1 + k}" for k in range(args.replicas)}
    try:
        model = json.loads(get(lb + "/v1/models"))["data"][0]["id"]
        if "prompts" not in prompts_cache:
            prompts_cache["prompts"] = make_system_prompts(lb, args.prompts, args.prefix_tokens, args.seed)
            # the tokens every request of a system prompt shares: the chat prompt up to the user's text
            a = post(lb + "/tokenize", {"messages": [{"role": "system", "content": prompts_cache["prompts"][0]},
                                                     {"role": "user", "content": "x"}]})["tokens"]
            b = post(lb + "/tokenize", {"messages": [{"role": "system", "content": prompts_cache["prompts"][0]},
                                                     {"role": "user", "content": "y"}]})["tokens"]
            prompts_cache["shared_tokens"] = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        prompts = prompts_cache["prompts"]
        # warm-up on every replica, directly: weights paged in, threads started; no system prompt
        for url in reps.values():
            post(url + "/v1/chat/completions", {"model": model, "max_tokens": 2,
                                                "messages": [{"role": "user", "content": "Hello"}]})
        pids = {r: int(open(os.path.join(run_dir, f"{r}.pid")).read()) for r in reps}
        m0 = {r: scrape(u) for r, u in reps.items()}
        reqs = make_requests(args, prompts)
        load0 = os.getloadavg()[0]
        cpu0 = {r: cpu_seconds(p) for r, p in pids.items()}
        recs, duration = run_workload("127.0.0.1", args.port, model, prompts, reqs, args.output_tokens)
        cpu1 = {r: cpu_seconds(p) for r, p in pids.items()}
        load1 = os.getloadavg()[0]
        m1 = {r: scrape(u) for r, u in reps.items()}
    finally:
        sh(run_dir, "stop")
        shutil.rmtree(run_dir, ignore_errors=True)
    pinning = re.findall(r"(r\d+): (\S+), cores (\S+), (\d+) threads", log)
    res = summarize(args, policy, reqs, recs, duration, m0, m1, prompts_cache["shared_tokens"], pinning)
    # the machine is shared: its 1-minute load average before and after the run says how much
    # else ran beside the replicas
    res["loadavg_1m"] = [round(load0, 2), round(load1, 2)]
    # the replicas' own CPU time for the workload: the work each policy costs, which other
    # processes on the machine do not change (its wall-clock throughput they do)
    res["replica_cpu_s"] = {r: round(cpu1[r] - cpu0[r], 2) for r in sorted(cpu0)}
    res["cpu_s_per_request"] = sum(cpu1[r] - cpu0[r] for r in cpu0) / max(res["completed"], 1)
    return res


def summarize(args, policy, reqs, recs, duration, m0, m1, shared, pinning):
    ok = [(q, r) for q, r in zip(reqs, recs) if "error" not in r]
    errors = [r["error"] for r in recs if "error" in r]
    ttft = [r["ttft"] for _, r in ok]
    tpot = [(r["end"] - r["start"] - r["ttft"]) / (r["output_tokens"] - 1) for _, r in ok if r.get("output_tokens", 0) > 1]
    out_tok = sum(r.get("output_tokens", 0) for _, r in ok)
    in_tok = sum(r.get("prompt_tokens", 0) for _, r in ok)

    def delta(name):
        return sum(m1[k].get(name, 0) - m0[k].get(name, 0) for k in m0)

    whole = shared // 16 * 16  # the system prompt's whole pages: what a hit can serve
    served, computed, n_computed = {}, {}, {}
    for q, r in ok:
        p = q["prompt"]
        served.setdefault(p, set()).add(r.get("replica"))
        if r.get("cached_tokens", 0) < whole:
            computed.setdefault(p, set()).add(r.get("replica"))
            n_computed[p] = n_computed.get(p, 0) + 1
    per_replica = {}
    for _, r in ok:
        per_replica[r.get("replica")] = per_replica.get(r.get("replica"), 0) + 1
    hits, queries = delta("cascade_prefix_cache_hits_total"), delta("cascade_prefix_cache_queries_total")
    res = {
        "policy": policy,
        "requests": len(reqs), "completed": len(ok), "failed": len(errors), "errors": errors[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tok / duration,
        "total_token_throughput": (in_tok + out_tok) / duration,
        "prompt_tokens": delta("cascade_prompt_tokens_total"),
        "prompt_tokens_computed": delta("cascade_prompt_tokens_computed_total"),
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "preemptions": delta("cascade_preemptions_total"),
        "engine_steps": delta("cascade_steps_total"),
        "cascade_steps": delta("cascade_cascade_steps_total"),
        "ttft_ms_p50": 1000 * pct(ttft, 50), "ttft_ms_p99": 1000 * pct(ttft, 99),
        "tpot_ms_p50": 1000 * pct(tpot, 50), "tpot_ms_p99": 1000 * pct(tpot, 99),
        "e2e_ms_mean": 1000 * statistics.fmean([r["end"] - r["start"] for _, r in ok]) if ok else float("nan"),
        "requests_by_replica": dict(sorted(per_replica.items())),
        "replicas_serving_prompt": {p: sorted(v) for p, v in sorted(served.items())},
        "replicas_computing_prompt": {p: sorted(v) for p, v in sorted(computed.items())},
        "max_replicas_computing_a_prompt": max((len(v) for v in computed.values()), default=0),
        "times_prompt_computed": dict(sorted(n_computed.items())),
        "per_replica_metrics": {k: {n: m1[k].get(n, 0) - m0[k].get(n, 0) for n in (
            "cascade_prompt_tokens_computed_total", "cascade_prefix_cache_hits_total",
            "cascade_prefix_cache_queries_total", "cascade_generation_tokens_total", "cascade_engine_busy_seconds_total",
            "cascade_preemptions_total")} for k in sorted(m0)},
        "pinning": [{"replica": r, "address": a, "cores": c, "threads": int(t)} for r, a, c, t in pinning],
        "_ttft_s": ttft, "_tpot_s": tpot,
        "per_request": [{"prompt": q["prompt"], "at": round(q["at"], 4), "replica": r.get("replica"),
                         "cached_tokens": r.get("cached_tokens"), "ttft_ms": round(1000 * r["ttft"], 2),
                         "e2e_ms": round(1000 * (r["end"] - r["start"]), 2)} for q, r in ok],
    }
    print(f"{policy:>11}: {res['completed']}/{res['requests']} in {duration:.1f} s, "
          f"{res['request_throughput']:.2f} req/s, {res['output_throughput']:.1f} out tok/s; "
          f"computed {res['prompt_tokens_computed']:.0f} of {res['prompt_tokens']:.0f} prompt tokens "
          f"(hit rate {res['prefix_cache_hit_rate']:.3f}); TTFT p50/p99 {res['ttft_ms_p50']:.0f}/{res['ttft_ms_p99']:.0f} ms, "
          f"TPOT p50/p99 {res['tpot_ms_p50']:.1f}/{res['tpot_ms_p99']:.1f} ms; "
          f"replicas computing a prompt: at most {res['max_replicas_computing_a_prompt']}; by replica "
          f"{res['requests_by_replica']}", flush=True)
    if errors:
        print("  errors:", errors[:3])
    return res


NAMES = {"prefix": "prefix affinity", "roundrobin": "round-robin", "leastconn": "least-connections"}


def median_run(runs):
    """The run of median throughput (of an odd count; the lower middle of an even one), with
    every run's throughput and CPU time beside it."""
    ranked = sorted(runs, key=lambda r: r["request_throughput"])
    med = dict(ranked[(len(ranked) - 1) // 2])
    med["rounds"] = [{k: r[k] for k in ("round", "request_throughput", "output_throughput", "duration_s",
                                        "prompt_tokens_computed", "cpu_s_per_request", "ttft_ms_p50", "ttft_ms_p99",
                                        "tpot_ms_p50", "tpot_ms_p99", "loadavg_1m")} for r in runs]
    return med


def markdown(results, meta):
    w = meta["workload"]
    base = next((r for r in results if r["policy"] == "roundrobin"), None)
    lines = [f"{w['prompts']} system prompts of {w['prefix_tokens']} tokens ({w['shared_tokens']} shared tokens "
             f"with the chat template), {w['requests_per_prompt']} requests each ({w['prompts'] * w['requests_per_prompt']} "
             f"in all, shuffled) with a question of their own, Poisson arrivals at {w['rate']} requests/s, "
             f"{w['output_tokens']} output tokens each (greedy, ignore_eos, streamed); {meta['replicas']} replicas "
             f"with {meta['threads']} thread each and a {meta['kv_cache_mb']} MiB KV pool, behind HAProxy "
             f"{meta['haproxy']}.", "",
             "| routing | done | req/s (rounds) | output tok/s | vs round-robin | replica CPU s per request | "
             "prompt tokens computed | prefix-cache hit rate "
             "| replicas computing a prompt (max) | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        vs = f"{r['request_throughput'] / base['request_throughput']:.2f}x" if base else "-"
        rounds = ", ".join(f"{x['request_throughput']:.2f}" for x in sorted(r["rounds"], key=lambda x: x["round"]))
        cpu = "/".join(f"{x['cpu_s_per_request']:.2f}" for x in sorted(r["rounds"], key=lambda x: x["round"]))
        lines.append(f"| {NAMES.get(r['policy'], r['policy'])} | {r['completed']}/{r['requests']} | "
                     f"{r['request_throughput']:.2f} ({rounds}) | {r['output_throughput']:.1f} | {vs} | {cpu} | "
                     f"{r['prompt_tokens_computed']:.0f} of {r['prompt_tokens']:.0f} | {r['prefix_cache_hit_rate']:.3f} | "
                     f"{r['max_replicas_computing_a_prompt']} | {r['ttft_ms_p50']:.0f} / {r['ttft_ms_p99']:.0f} | "
                     f"{r['tpot_ms_p50']:.1f} / {r['tpot_ms_p99']:.1f} |")
    return "\n".join(lines) + "\n"


def update_results(md, meta):
    lo, hi = meta["loadavg_1m_range"]
    update_table(md, meta, "cpu-replicas",
                 f"Measured on {meta['cpu_model'] or 'an unknown CPU'}, {meta['cpus']} cores, {meta['time']}; "
                 f"{meta['pinning_note']}. The machine is shared: its 1-minute load average read {lo:.1f} to {hi:.1f} "
                 f"during the runs.\n\n")


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(1, 4, figsize=(17, 4))
    names = [NAMES.get(r["policy"], r["policy"]) for r in results]
    ax[0].bar(names, [r["request_throughput"] for r in results], color="tab:blue")
    ax[0].set_title("throughput (requests/s)")
    ax[1].bar(names, [r["prompt_tokens_computed"] / 1000 for r in results], color="tab:orange")
    ax[1].set_title("prompt tokens computed (thousands)")
    for a in ax[:2]:
        a.tick_params(axis="x", labelsize=8)
        a.grid(axis="y", alpha=0.3)
    for a, key, title in ((ax[2], "_ttft_s", "time to first token"), (ax[3], "_tpot_s", "time per output token")):
        for r, n in zip(results, names):
            xs = sorted(x * 1000 for x in r[key])
            if xs:
                a.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=n)
        a.set_xscale("log")
        a.set_title(title)
        a.set_xlabel("ms")
        a.set_ylabel("fraction of requests")
        a.grid(alpha=0.3)
    ax[2].legend(fontsize=8)
    fig.suptitle("cascade serve replicas behind HAProxy: routing policies on one shared-prefix workload")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="prefix,roundrobin,leastconn")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="threads per replica")
    ap.add_argument("--cpus", default="", help="cores for the replicas (replicas.sh --cpus)")
    ap.add_argument("--kv-cache-mb", type=int, default=144)
    ap.add_argument("--balance-factor", type=int, default=0,
                    help="HAProxy's hash-balance-factor for prefix routing (0: deploy/haproxy.cfg's)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--requests-per-prompt", type=int, default=16)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="runs of every policy (the table takes the median)")
    ap.add_argument("--port", type=int, default=18400)
    ap.add_argument("--cascade", default=os.path.join(os.environ.get("BUILD", "build"), "cascade"))
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu-replicas.json"))
    ap.add_argument("--plot", default=None)
    ap.add_argument("--results-md", action=argparse.BooleanOptionalAction, default=None)
    args = ap.parse_args()
    if args.plot is None:
        args.plot = os.path.splitext(args.out)[0] + ".png"
    if args.results_md is None:
        args.results_md = os.path.abspath(args.out) == os.path.join(HERE, "results", "cpu-replicas.json")
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")

    # Rounds: every policy once a round, in an order that rotates from round to round, so that
    # other work on a shared machine (which changes wall-clock times by tens of percent) falls
    # on every policy alike; the table takes each policy's median round.
    cache, runs = {}, []
    policies = args.policies.split(",")
    for rnd in range(args.rounds):
        order = policies[rnd % len(policies):] + policies[:rnd % len(policies)]
        for policy in order:
            r = run_policy(args, policy, cache)
            r["round"] = rnd
            runs.append(r)
    results = [median_run([r for r in runs if r["policy"] == p]) for p in policies]
    hv = subprocess.run(["haproxy", "-v"], capture_output=True, text=True).stdout.split()
    pin = results[0]["pinning"]
    shared_cores = len({p["cores"] for p in pin}) == 1 and len(pin) > 1
    meta = {
        "workload": {"prompts": args.prompts, "prefix_tokens": args.prefix_tokens, "shared_tokens": cache["shared_tokens"],
                     "requests_per_prompt": args.requests_per_prompt, "output_tokens": args.output_tokens,
                     "rate": args.rate, "seed": args.seed, "chat": True},
        "replicas": args.replicas, "threads": args.threads, "kv_cache_mb": args.kv_cache_mb,
        "balance_factor": args.balance_factor or "haproxy.cfg",
        "serve_args": f"--threads {args.threads} --kv-cache-mb {args.kv_cache_mb} --max-context 2048 "
                      f"--max-connections-per-ip 0",
        "model": args.model, "cpus": os.cpu_count(), "cpu_model": cpu_model(),
        "pinning": pin,
        "pinning_note": (f"{args.replicas} replicas of {args.threads} thread each, all on cores {pin[0]['cores']}: "
                         f"fewer cores than replicas, so they share them rather than one replica having a core "
                         f"to itself" if shared_cores else
                         f"replicas pinned to cores {', '.join(p['cores'] for p in pin)}"),
        "loadavg_1m_range": [min(min(r["loadavg_1m"]) for r in runs), max(max(r["loadavg_1m"]) for r in runs)],
        "haproxy": hv[2] if len(hv) > 2 else None,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": [{k: v for k, v in r.items() if not k.startswith("_")} for r in results],
                   "runs": [{k: v for k, v in r.items() if not k.startswith("_") and k != "per_request"} for r in runs]},
                  f, indent=1)
    print(f"wrote {args.out}")
    md = markdown(results, meta)
    print(md)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(md)
    if args.results_md:
        update_results(md, meta)
    plot(results, args.plot)


if __name__ == "__main__":
    main()
