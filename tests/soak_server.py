#!/usr/bin/env python3
"""A bounded soak of `cascade serve`: many streaming clients, cuts and bad
requests for a fixed time, then nothing may be left behind.

Starts `build/cascade serve` on the default model (the start-up of
check_server.py: a free port on 127.0.0.1, an API key, 1 MiB bodies) with a
small KV pool (--kv-cache-mb 64 --max-context 2048, so requests queue and are
preempted) and --threads 2. Then N clients (default 256) on loopback, each a
loop of requests over raw sockets (asyncio, one connection per request), run
for a fixed time (default 120 s):

- valid requests: chat and completions, streaming (3 in 4) and not; short
  prompts, long ones (200-500 words), and 4 in 10 behind one shared system
  prompt (prefix cache); greedy and sampled;
- cuts: a quarter of the streams close their socket after a random number of
  events (0 = while queued), by FIN or by RST; a few non-streaming requests
  close before their answer;
- bad requests, about 1 in 7: malformed JSON, wrong types, max_tokens beyond
  int32, an unknown model, invalid UTF-8, a body over the 1 MiB limit, no API
  key, and half a header followed by a close.

Clients come from 127.0.0.2-127.0.0.5 (64 each, under the default per-address
limit), the monitor from 127.0.0.1. When the time is up no new request starts;
requests in flight get --grace seconds (default 30) to end, then are cut.

Asserts:
- every valid request either ended properly (a stream: status 200, a
  finish_reason, data: [DONE] and the end of the chunked body; otherwise a
  200 JSON with a finish_reason) or was cut by its client;
- every bad request got a 4xx with an OpenAI JSON error (half headers: no
  answer is expected);
- the server is alive and /health answers 200 at the end;
- after a settle, /metrics shows 0 running, 0 waiting and 0 KV pages used
  (pages that only hold a cached prefix count as free; shown as cached);
- the server's RSS (VmRSS, sampled every second) at the end of the load is
  within 5% of the sample at the start of the second minute; a run shorter
  than 120 s compares the first sample of its second half instead, and says so;
- SIGTERM then stops it with exit status 0.

Prints a summary (requests by outcome, tokens streamed, RSS samples) and
"N passed, N failed"; exits non-zero on any failure.

Usage: python3 tests/soak_server.py [--seconds N] [--clients N] [--grace S] [--seed N]
(`make soak`, SOAK_SECONDS=N to shorten). Environment as check_server.py.
"""
import argparse
import asyncio
import collections
import json
import os
import random
import socket
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_server as cs  # noqa: E402
from check_server import KEY, Server, http, metrics, report  # noqa: E402

# The soak measures nothing but memory: let idle OpenMP threads sleep rather
# than spin (as tests/run_all.sh does), or a busy machine stalls every barrier.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
ENGINE = ["--threads", "2", "--kv-cache-mb", "64", "--max-context", "2048"]
CLIENT_ADDRS = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]
REQUEST_TIMEOUT = 300  # seconds one valid request may take before it counts as hung

SYSTEM = ("You are the help desk of a small public library. You answer questions about opening hours, "
          "borrowing rules, events and the catalogue. The library opens at nine in the morning and closes "
          "at six in the evening on weekdays, and opens from ten to four on Saturdays; it is closed on "
          "Sundays and public holidays. Members may borrow up to twelve items for three weeks and renew "
          "them twice online or at the desk, unless another member has reserved them. Answer briefly.")
QUESTIONS = ["When do you open on Saturday?", "How many books can I borrow?", "Can I renew a book twice?",
             "Are you open on Sunday?", "What is a library?", "Name three colors.", "Hi", "Tell me a joke.",
             "Write one sentence about the sea.", "What is two plus two?", "Who writes novels?"]
WORDS = ("the river runs past old stone houses where people keep bread cheese and apples for winter while "
         "children read stories about ships mountains stars and quiet forests under a grey northern sky").split()


def long_text(rng):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(200, 500)))


def valid_body(rng, model):
    """(path, body dict, kind) of a random well-formed request."""
    chat = rng.random() < 0.5
    r = rng.random()
    shape = "shared" if r < 0.4 else "long" if r < 0.55 else "short"
    q = rng.choice(QUESTIONS)
    body = {"model": model, "max_tokens": rng.randint(4, 48), "stream": rng.random() < 0.75}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, seed=rng.randint(0, 1 << 30))
    if body["stream"] and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    if chat:
        msgs = [{"role": "user", "content": long_text(rng) + "\n\n" + q if shape == "long" else q}]
        if shape == "shared":
            msgs.insert(0, {"role": "system", "content": SYSTEM})
        body["messages"] = msgs
        path = "/v1/chat/completions"
    else:
        body["prompt"] = (SYSTEM + "\n\nQuestion: " + q + "\nAnswer:" if shape == "shared"
                          else long_text(rng) + "\n\n" + q if shape == "long" else q)
        path = "/v1/completions"
    return path, body, ("chat" if chat else "compl") + ("_stream" if body["stream"] else "") + "/" + shape


BAD_KINDS = ["malformed_json", "wrong_type", "huge_max_tokens", "unknown_model", "invalid_utf8", "oversize_body",
             "no_api_key", "half_header"]


def bad_request(rng, model):
    """(kind, raw request bytes, expected status or None when no answer is expected)."""
    kind = rng.choice(BAD_KINDS)
    path = rng.choice(["/v1/completions", "/v1/chat/completions"])
    chat = path.endswith("chat/completions")
    base = {"model": model, "max_tokens": 4}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    key, status = KEY, 400
    if kind == "malformed_json":
        body = rng.choice([b'{"prompt": "hi", ', b'{"messages": [}', b"not json", b"{}}", b"[1, 2",
                           b'{"prompt": "a" "b"}'])
    elif kind == "wrong_type":
        field, val = rng.choice([("max_tokens", "ten"), ("temperature", "hot"), ("stream", "yes"),
                                 ("n", [1]), ("stop", 5), ("prompt" if not chat else "messages", 5)])
        base[field] = val
        body = json.dumps(base).encode()
    elif kind == "huge_max_tokens":
        base["max_tokens"] = rng.choice([1 << 40, 10 ** 18])
        body = json.dumps(base).encode()
    elif kind == "unknown_model":
        base["model"] = "no-such-model-" + str(rng.randint(0, 999))
        body = json.dumps(base).encode()
        status = 404
    elif kind == "invalid_utf8":
        body = json.dumps(base).encode().replace(b'"hi"', b'"h\xff\xfei \xc3("')
    elif kind == "oversize_body":
        body = json.dumps(dict(base, prompt="a" * (1200 * 1024))).encode()
        status = 413
    elif kind == "no_api_key":
        body = json.dumps(base).encode()
        key, status = None, 401
    else:  # half_header
        return kind, f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl".encode(), None
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    if key:
        head += f"Authorization: Bearer {key}\r\n"
    head += f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    return kind, head.encode() + body, status


def raw_request(path, body):
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nConnection: close\r\nContent-Length: {len(data)}\r\n\r\n"
            ).encode() + data


class Cut(Exception):
    """The client closes its socket on purpose."""


class Stats:
    def __init__(self):
        self.outcomes = collections.Counter()  # "class: outcome" -> count
        self.failures = []  # (what, detail), the first ones kept
        self.nfail = 0
        self.tokens = 0  # content chunks streamed
        self.usage_tokens = 0  # completion tokens reported by non-streaming answers
        self.latency = []  # seconds, valid requests that completed
        self.cut_age = []  # seconds, requests in flight when the grace ended

    def fail(self, what, detail):
        self.nfail += 1
        self.outcomes["FAILED: " + what] += 1
        if len(self.failures) < 20:
            self.failures.append((what, detail[:300]))


async def read_head(reader):
    line = await reader.readline()
    if not line:
        raise ConnectionError("closed before the status line")
    parts = line.split(None, 2)
    status = int(parts[1])
    hdr = {}
    while True:
        h = await reader.readline()
        if h in (b"\r\n", b"\n", b""):
            break
        k, _, v = h.decode("latin-1").partition(":")
        hdr[k.strip().lower()] = v.strip()
    return status, hdr


async def read_body(reader, hdr):
    if hdr.get("transfer-encoding", "").lower() == "chunked":
        out = b""
        async for piece in chunks(reader):
            out += piece
        return out
    if "content-length" in hdr:
        return await reader.readexactly(int(hdr["content-length"]))
    return await reader.read()


async def chunks(reader):
    """Yields the chunks of a chunked body; raises unless it ends with the last chunk."""
    while True:
        line = await reader.readline()
        if not line.endswith(b"\n"):
            raise ConnectionError("chunked body ended without its last chunk")
        n = int(line.split(b";")[0].strip(), 16)
        if n == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n"):
                pass  # trailers
            return
        data = await reader.readexactly(n + 2)
        yield data[:-2]


def close(writer, rst):
    if rst:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
    writer.close()


async def valid_one(port, src, rng, model, st):
    path, body, kind = valid_body(rng, model)
    cut_after = None  # stream events before the client closes; 0 = before the answer
    if body["stream"] and rng.random() < 0.25:
        cut_after = rng.choice([0, 1, 1, 2, 3, 5, 8, 13])
    elif not body["stream"] and rng.random() < 0.05:
        cut_after = 0
    rst = rng.random() < 0.5
    t0 = time.time()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(src, 0))
    try:
        writer.write(raw_request(path, body))
        await writer.drain()
        if cut_after == 0:
            # close while queued or prefilling: before the first byte of the answer
            try:
                first = await asyncio.wait_for(reader.read(1), timeout=rng.uniform(0.05, 3.0))
            except asyncio.TimeoutError:
                raise Cut()
            if not first:
                raise ConnectionError("closed before the answer")
            raise Cut()  # the answer began: still cut, right after its first byte
        status, hdr = await asyncio.wait_for(read_head(reader), REQUEST_TIMEOUT)
        if status != 200:
            text = await read_body(reader, hdr)
            return st.fail(kind + f" got {status}", text.decode(errors="replace"))
        if not body["stream"]:
            data = json.loads(await asyncio.wait_for(read_body(reader, hdr), REQUEST_TIMEOUT))
            fr = data["choices"][0].get("finish_reason")
            if fr not in ("stop", "length"):
                return st.fail(kind + " finish_reason", json.dumps(data))
            st.usage_tokens += data["usage"]["completion_tokens"]
            st.outcomes[f"valid {kind.split('/')[0]}: completed"] += 1
            st.latency.append(time.time() - t0)
            return
        if "text/event-stream" not in hdr.get("content-type", ""):
            return st.fail(kind + " content-type", str(hdr))
        buf, events, finish, done, usage = b"", 0, None, False, None
        gen = chunks(reader)
        while True:
            try:
                piece = await asyncio.wait_for(gen.__anext__(), REQUEST_TIMEOUT)
            except StopAsyncIteration:
                break
            buf += piece
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                if not ev.startswith(b"data: "):
                    return st.fail(kind + " SSE framing", ev.decode(errors="replace"))
                d = ev[6:]
                if done:
                    return st.fail(kind + " data after [DONE]", d.decode(errors="replace"))
                if d == b"[DONE]":
                    done = True
                    continue
                j = json.loads(d)
                if "error" in j:
                    return st.fail(kind + " error event", d.decode(errors="replace"))
                if j.get("usage"):
                    usage = j["usage"]
                for ch in j.get("choices", []):
                    delta = ch.get("delta", {}).get("content") if "delta" in ch else ch.get("text")
                    if delta:
                        st.tokens += 1
                    if ch.get("finish_reason"):
                        finish = ch["finish_reason"]
                events += 1
                if cut_after is not None and events >= cut_after and not done:
                    raise Cut()
        if not done or finish not in ("stop", "length"):
            return st.fail(kind + " stream end", f"done={done} finish={finish} events={events}")
        if body.get("stream_options") and not usage:
            return st.fail(kind + " usage chunk", f"events={events}")
        st.outcomes[f"valid {kind.split('/')[0]}: completed"] += 1
        st.latency.append(time.time() - t0)
    except Cut:
        st.outcomes[f"valid {kind.split('/')[0]}: cut by client" + (" (RST)" if rst else " (FIN)")] += 1
        close(writer, rst)
        return
    except asyncio.CancelledError:
        st.outcomes[f"valid {kind.split('/')[0]}: cut at the end of the grace"] += 1
        st.cut_age.append(time.time() - t0)
        close(writer, True)
        raise
    except asyncio.TimeoutError:
        st.fail(kind + " timed out", f"no progress for {REQUEST_TIMEOUT} s")
    except (ConnectionError, OSError, ValueError, KeyError, asyncio.IncompleteReadError) as e:
        st.fail(kind + " " + type(e).__name__, str(e))
    finally:
        if not writer.is_closing():
            close(writer, False)


async def bad_one(port, src, rng, model, st):
    kind, data, expect = bad_request(rng, model)
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(src, 0))
    try:
        if expect is None:  # half a header, then close
            writer.write(data)
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.5))
            st.outcomes[f"bad {kind}: closed by client"] += 1
            close(writer, rng.random() < 0.5)
            return
        try:
            writer.write(data)
            await writer.drain()
        except (ConnectionError, OSError):
            pass  # the server may answer an oversize body before reading it: read its answer
        status, hdr = await asyncio.wait_for(read_head(reader), 60)
        text = (await asyncio.wait_for(read_body(reader, hdr), 60)).decode(errors="replace")
        try:
            err = json.loads(text)["error"]
            is_json = isinstance(err, dict) and isinstance(err.get("message"), str)
        except (ValueError, KeyError, TypeError):
            is_json = False
        if status != expect or not is_json or "application/json" not in hdr.get("content-type", ""):
            st.fail(f"bad {kind} expected {expect} JSON", f"got {status}: {text}")
        else:
            st.outcomes[f"bad {kind}: {status} JSON error"] += 1
    except asyncio.CancelledError:
        st.outcomes[f"bad {kind}: cut at the end of the grace"] += 1
        close(writer, True)
        raise
    except (asyncio.TimeoutError, ConnectionError, OSError, ValueError, asyncio.IncompleteReadError) as e:
        st.fail(f"bad {kind} {type(e).__name__}", str(e))
    finally:
        if not writer.is_closing():
            close(writer, False)


async def client(i, port, model, deadline, st, seed):
    rng = random.Random(seed * 1000003 + i)
    src = CLIENT_ADDRS[i % len(CLIENT_ADDRS)]
    await asyncio.sleep(rng.uniform(0, 2.0))  # stagger the first connections
    while time.time() < deadline:
        try:
            if rng.random() < 0.14:
                await bad_one(port, src, rng, model, st)
            else:
                await valid_one(port, src, rng, model, st)
        except (ConnectionError, OSError) as e:  # connect() failed
            st.fail("connect " + type(e).__name__, str(e))
            await asyncio.sleep(0.5)


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


async def sample_rss(pid, t0, samples, stop):
    while not stop.is_set():
        try:
            samples.append((time.time() - t0, rss_kb(pid)))
        except OSError:
            samples.append((time.time() - t0, None))
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


async def soak(srv, model, args, st, samples):
    t0 = time.time()
    deadline = t0 + args.seconds
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(srv.p.pid, t0, samples, stop))
    tasks = [asyncio.create_task(client(i, srv.port, model, deadline, st, args.seed)) for i in range(args.clients)]
    await asyncio.sleep(max(0.0, deadline - time.time()))
    load_end = len(samples)
    print(f"soak: {args.seconds} s of load done; in flight now: {sum(not t.done() for t in tasks)} clients; "
          f"waiting up to {args.grace} s for them", flush=True)
    done, pending = await asyncio.wait(tasks, timeout=args.grace)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for t in done:
        if t.exception():
            st.fail("client crashed", repr(t.exception()))
    stop.set()
    await sampler
    return load_end, time.time() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=float(os.environ.get("SOAK_SECONDS") or 120))
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--grace", type=float, default=30)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if not os.path.exists(cs.CASCADE):
        cs.skip(f"{cs.CASCADE} not built")
    if not os.path.exists(cs.MODEL):
        cs.skip(f"{cs.MODEL} missing (make model)")
    for a in CLIENT_ADDRS:
        try:
            socket.create_connection(("127.0.0.1", 9), timeout=1, source_address=(a, 0)).close()
        except ConnectionRefusedError:
            pass
        except OSError as e:
            cs.skip(f"cannot bind a client to {a} ({e})")

    srv = Server(ENGINE)
    model = json.loads(http(srv, "GET", "/v1/models")[2])["data"][0]["id"]
    print(f"soak: server pid {srv.p.pid} on port {srv.port}; {args.clients} clients for {args.seconds:g} s "
          f"(seed {args.seed}; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f})", flush=True)
    st = Stats()
    samples = []  # (seconds since the start, VmRSS in kB)
    try:
        load_end, wall = asyncio.run(soak(srv, model, args, st, samples))
        alive = srv.p.poll() is None
        report("server_alive", alive, f"exited with {srv.p.returncode}")
        if alive:
            hst, _, hbody = http(srv, "GET", "/health", key=None)
            report("health_200_at_end", hst == 200, f"{hst} {hbody}")
        report("every_request_accounted_for", st.nfail == 0, f"{st.nfail} failures, first: {st.failures[:3]}")

        # settle: the server notices the last cuts and frees their pages
        m, idle = {}, False
        if alive:
            settle = time.time() + 15
            while True:
                m = metrics(srv)
                idle = (m["cascade_num_requests_running"] == 0 and m["cascade_num_requests_waiting"] == 0
                        and m["cascade_kv_pages_used"] == 0)
                if idle or time.time() > settle:
                    break
                time.sleep(0.2)
            keys = ["cascade_num_requests_running", "cascade_num_requests_waiting", "cascade_kv_pages_used",
                    "cascade_kv_pages_cached", "cascade_kv_pages_free", "cascade_kv_pages_total",
                    "cascade_http_connections"]
            report("metrics_idle_after_settle", idle, {k: m.get(k) for k in keys})

        # RSS: the second minute's start (or the second half's first sample) against the end of the load
        load = [(t, kb) for t, kb in samples[:load_end] if kb]
        start_t = 60.0 if args.seconds >= 120 else args.seconds / 2
        window = [(t, kb) for t, kb in load if t >= start_t]
        rss_ok, rss_msg = False, "too few RSS samples"
        if len(window) >= 2:
            (ta, a), (tb, b) = window[0], window[-1]
            lo, hi = min(kb for _, kb in window), max(kb for _, kb in window)
            change = (b - a) / a
            rss_ok = abs(change) <= 0.05
            rss_msg = (f"RSS {a / 1024:.1f} MiB at {ta:.0f} s -> {b / 1024:.1f} MiB at {tb:.0f} s "
                       f"({100 * change:+.2f}%; window min {lo / 1024:.1f}, max {hi / 1024:.1f} MiB)")
        what = "second minute's start" if args.seconds >= 120 else \
            f"second half's first sample (run shorter than 120 s: t >= {start_t:g} s)"
        report("rss_flat_within_5pct", rss_ok, rss_msg)

        # summary
        print(f"\nsoak summary: {args.clients} clients, {args.seconds:g} s of load, {wall:.0f} s with the grace")
        valid = sum(v for k, v in st.outcomes.items() if k.startswith("valid"))
        bad = sum(v for k, v in st.outcomes.items() if k.startswith("bad"))
        print(f"  requests: {valid} valid, {bad} bad, {st.nfail} failed")
        for k in sorted(st.outcomes):
            print(f"    {st.outcomes[k]:6d}  {k}")
        lat = sorted(st.latency)
        if lat:
            print(f"  completed valid requests: latency p50 {lat[len(lat) // 2]:.1f} s, "
                  f"p99 {lat[min(len(lat) - 1, int(len(lat) * 0.99))]:.1f} s, max {lat[-1]:.1f} s")
        if st.cut_age:
            print(f"  requests cut at the end of the grace had run for at most {max(st.cut_age):.1f} s")
        print(f"  tokens: {st.tokens} streamed (content chunks), {st.usage_tokens} in non-streaming answers; "
              f"server generated {m.get('cascade_generation_tokens_total', 0):.0f}, "
              f"aborted {m.get('cascade_requests_aborted_total', 0):.0f}, "
              f"preempted {m.get('cascade_preemptions_total', 0):.0f}, "
              f"prefix-cache hit rate {m.get('cascade_prefix_cache_hit_rate', 0):.2f}")
        print("  /metrics after the settle: " + ", ".join(
            f"{k.replace('cascade_', '')} {m[k]:.0f}" for k in ["cascade_num_requests_running",
            "cascade_num_requests_waiting", "cascade_kv_pages_used", "cascade_kv_pages_cached",
            "cascade_kv_pages_free", "cascade_kv_pages_total", "cascade_http_connections"] if k in m))
        print("  RSS samples (MiB, every 10 s): " + ", ".join(
            f"{t:.0f}s {kb / 1024:.1f}" for i, (t, kb) in enumerate(load) if i % 10 == 0 or i == len(load) - 1))
        print(f"  RSS compared from the {what} to the end of the load: {rss_msg}")
        for what_, detail in st.failures:
            print(f"  failure: {what_}: {detail}")
    finally:
        rc = srv.stop()
    report("sigterm_exits_0", rc == 0, srv.exit_detail(rc, 5))
    print(f"{cs.passed} passed, {cs.failed} failed")
    return 1 if cs.failed else 0


if __name__ == "__main__":
    sys.exit(main())
