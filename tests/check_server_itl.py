#!/usr/bin/env python3
"""`cascade serve` keeps streams flowing while a long prompt is prefilled.

One server (--max-itl-ms 100 --max-batch-tokens 256, 2 threads): a warm-up
request (so the scheduler's cost model has seen prefill and decode steps),
then two streams (8-token prompts, ignore_eos) start; once both have streamed
10 tokens (their gaps: decode-only steps), a 2000-token prompt (token ids,
max_tokens 1) is sent, and right after it a 6-token one.
- short_not_stuck: the short prompt's answer comes back in less than a third
  of the time the long prompt takes to its first token. (Under plain FCFS
  chunks it waits for the whole long prefill.)
- streams_flow: while the long prompt is prefilled (from its send to its
  answer) each stream gets at least 12 tokens, and the median gap is at most
  twice the longer of the target and the decode-only gap (the scheduler aims
  at the target, or at 1.5 times the decodes' own time where they alone take
  longer). With whole 256-token chunks a stream gets one token per chunk, 8
  or 9 in all, and waits for each chunk's whole prefill. (The prompt was
  1000 tokens until the kernels got faster: its prefill then took too few
  100 ms steps for 12 tokens.)
- itl_limited_steps: cascade_itl_limited_steps_total moved.
- long_answered: the long prompt's answer counts its 2000 prompt tokens.
Then the streams are closed and the server must end clean.

Counts and ratios to the same run's decode-only steps decide the checks, not
absolute times: on a loaded machine (or under AddressSanitizer) steps get
slower, the cost model learns it and cuts the chunks smaller, so the number
of steps (tokens per stream) holds up. Under AddressSanitizer (BUILD names
build-asan) prompt tokens cost far more, so the step budget shrinks 16-fold
(a 256-token long prompt, 16 tokens a step, a 32-token warm-up, a 512-token
context): the long prompt takes 16 chunks of about a decode step's time.
There the gaps are not bounded, and with chunks that small the checks pass
without the feature too except itl_limited_steps: the plain build's run is
the one that tells the feature apart.
CASCADE_ITL_ARGS replaces the server's ITL options (e.g. "--max-itl-ms 0" to
see the checks fail). Prints "N passed, N failed"; skips like check_server.py.
"""
import http.client as httpclient
import json
import os
import random
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_server as cs  # noqa: E402
from check_server import KEY, Server, check, http, metrics  # noqa: E402

TARGET_MS = 100
ITL_ARGS = os.environ.get("CASCADE_ITL_ARGS", f"--max-itl-ms {TARGET_MS}").split()
SLOW = "asan" in cs.BUILD
WARM, LONG, BATCH, CONTEXT = (32, 256, 16, 512) if SLOW else (300, 2000, 256, 4096)
ENGINE = ["--threads", "2", "--kv-cache-mb", "96", "--max-context", str(CONTEXT), "--max-batch-tokens", str(BATCH),
          *ITL_ARGS]


MODEL_ID = None


def completion(srv, prompt, max_tokens):
    st, _, body = http(srv, "POST", "/v1/completions",
                       {"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert st == 200, (st, body[:200])
    return json.loads(body)


class Stream(threading.Thread):
    """A streaming completion that records the arrival time of each token
    chunk until stop is set (then it closes the connection: the server aborts
    the request)."""

    def __init__(self, srv, prompt):
        super().__init__(daemon=True)
        self.srv, self.prompt = srv, prompt
        self.times = []
        self.stop = threading.Event()
        self.error = None

    def run(self):
        conn = httpclient.HTTPConnection("127.0.0.1", self.srv.port, timeout=60)
        try:
            # as long as the context allows (prompt + max_tokens past it is a 400)
            body = json.dumps({"model": MODEL_ID, "prompt": self.prompt, "max_tokens": CONTEXT - len(self.prompt),
                               "temperature": 0,
                               "ignore_eos": True, "stream": True})
            conn.request("POST", "/v1/completions", body=body,
                         headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
            r = conn.getresponse()
            if r.status != 200:
                self.error = f"HTTP {r.status}"
                return
            while not self.stop.is_set():
                line = r.fp.readline()
                if not line:
                    break
                if line.startswith(b"data: {") and b'"text"' in line:
                    self.times.append(time.perf_counter())
        except OSError as e:
            if not self.stop.is_set():
                self.error = f"{type(e).__name__}: {e}"
        finally:
            conn.close()


def run_all(srv):
    global MODEL_ID
    st, _, body = http(srv, "GET", "/v1/models")
    assert st == 200, st
    MODEL_ID = json.loads(body)["data"][0]["id"]
    rng = random.Random(7)
    completion(srv, [rng.randrange(1000, 40000) for _ in range(WARM)], 4)  # warm-up
    m0 = metrics(srv)
    streams = [Stream(srv, [rng.randrange(1000, 40000) for _ in range(8)]) for _ in range(2)]
    for s in streams:
        s.start()
    deadline = time.time() + 30
    while any(len(s.times) < 10 for s in streams) and time.time() < deadline:
        time.sleep(0.01)
    base = statistics.median([b - a for s in streams for a, b in zip(s.times, s.times[1:])] or [0.0])
    res = {}

    def send(name, prompt):
        t0 = time.perf_counter()
        res[name] = (t0, completion(srv, prompt, 1), time.perf_counter())

    long_prompt = [rng.randrange(1000, 40000) for _ in range(LONG)]
    short_prompt = [rng.randrange(1000, 40000) for _ in range(6)]
    tl = threading.Thread(target=send, args=("long", long_prompt))
    tl.start()
    time.sleep(0.05)
    ts = threading.Thread(target=send, args=("short", short_prompt))
    ts.start()
    tl.join(300)
    ts.join(300)
    for s in streams:
        s.stop.set()
    m1 = metrics(srv)

    @check("long_answered")
    def _():
        assert "long" in res and "short" in res, res.keys()
        assert res["long"][1]["usage"]["prompt_tokens"] == LONG, res["long"][1]["usage"]
        assert res["short"][1]["usage"]["prompt_tokens"] == 6

    if "long" not in res or "short" not in res:
        return
    t_long0, _, t_long1 = res["long"]
    t_short0, _, t_short1 = res["short"]
    long_s, short_s = t_long1 - t_long0, t_short1 - t_short0

    @check("short_not_stuck")
    def _():
        assert short_s < long_s / 3, f"short prompt answered in {short_s:.2f} s, the long one in {long_s:.2f} s"

    @check("streams_flow")
    def _():
        for s in streams:
            assert s.error is None, s.error
        during = [[t for t in s.times if t_long0 <= t <= t_long1] for s in streams]
        counts = [len(d) for d in during]
        gaps = [b - a for d in during for a, b in zip(d, d[1:])]
        med = statistics.median(gaps) * 1e3 if gaps else float("inf")
        bound = 2 * max(TARGET_MS, base * 1e3)
        print(f"  long prompt: {long_s:.2f} s to its answer, short: {short_s:.2f} s; tokens per stream meanwhile "
              f"{counts}, gaps median {med:.0f} ms (decode-only {base * 1e3:.0f} ms), "
              f"max {max(gaps) * 1e3 if gaps else 0:.0f} ms")
        assert min(counts) >= 12, f"streams got {counts} tokens while {LONG} prompt tokens were prefilled"
        assert SLOW or med <= bound, f"median gap {med:.0f} ms > {bound:.0f} ms"

    @check("itl_limited_steps")
    def _():
        k = "cascade_itl_limited_steps_total"
        assert m1.get(k, 0) > m0.get(k, 0), (m0.get(k), m1.get(k))


def main():
    if not os.path.exists(cs.CASCADE):
        cs.skip(f"{cs.CASCADE} not built")
    if not os.path.exists(cs.MODEL):
        cs.skip(f"{cs.MODEL} missing (make model)")
    srv = Server(ENGINE)
    try:
        run_all(srv)
    finally:
        rc = srv.stop()
        cs.report("shutdown_clean", rc == 0, srv.exit_detail(rc))
    print(f"{cs.passed} passed, {cs.failed} failed")
    return 1 if cs.failed else 0


if __name__ == "__main__":
    sys.exit(main())
