#!/usr/bin/env python3
"""`cascade serve` under hostile connections and at shutdown, end to end.

Connections (one server, --max-connections 16 --max-connections-per-ip 8
--header-timeout 3 --idle-timeout 1 --max-seqs 1):
- per_ip_limit: 20 connections from 127.0.0.2 that send half a header and
  wait; at most 8 stay open (the others get a JSON 503 and are closed), and
  a client from 127.0.0.1 is served within a second. (Linux routes all of 127/8 to the loopback device, so a socket bound
  to 127.0.0.2 is another client address: the per-address limit is tested as
  it works, not disabled for the test.)
- total_limit_evicts_waiting: slow connections from three more addresses
  fill every connection; a normal client is still served within a second
  because the oldest connection waiting for its headers is closed to make
  room (the metric of evictions moves).
- header_deadline: a client that sends a header byte every 0.3 s (which
  defeats an inactivity timeout) is closed at the 3 s header deadline.
- stream_gap_longer_than_idle_timeout: a stream queued behind another
  (--max-seqs 1) waits longer than the 1 s inactivity timeout for its first
  token and still ends with finish_reason and [DONE]; a non-streaming
  request queued the same way gets its 200.
- half_close_stream: a client that shuts its sending side after the request
  still gets the whole stream.
- protocol_errors_are_json: malformed request lines and headers, a negative
  Content-Length, HTTP/2.0, an unknown transfer coding and a 200 KB header
  get OpenAI JSON errors (400, 505, 501, 431) with one status line each, not
  libmicrohttpd's HTML pages; pipelined requests on one connection still work.
- tokenize routes, /version, /v1/models/{id}, ids and JSON errors (431, 404,
  405) on the same server; /tokenize's
  count equals the prompt_tokens the engine reports for the same prompt.
- kv_pages_free_from_start: before any request every KV page reads free.

Shutdown (a server each):
- drain: 8 streams (max_tokens 64) and one non-streaming request run; SIGTERM
  after the first tokens; /health and new requests get 503 JSON while they
  finish; every stream ends with a finish_reason chunk, [DONE] and the end of
  the chunked body; the non-streaming one gets 200; exit status 0.
- second_signal: long streams, SIGTERM then SIGTERM: exits within a few
  seconds, every stream ends with finish_reason "abort" and [DONE].
- shutdown_timeout: --shutdown-timeout 1 with long streams: the same, after
  about a second, on one signal.

Uses the helpers of check_server.py (server start-up, http, checks). Prints
"N passed, N failed"; skips like it when serve or the model is missing.
"""
import http.client as httpclient
import json
import os
import re
import signal
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_server as cs  # noqa: E402
from check_server import KEY, Server, check, http, metrics  # noqa: E402

ENGINE = ["--threads", "1", "--kv-cache-mb", "64", "--max-context", "2048"]


def slow_conn(port, src):
    """A connection from address src that sends half a request header."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(src, 0))
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    except OSError:
        pass
    return s


def is_open(s, wait=0.0):
    """True when the server has not closed s (no EOF or reset within wait; an
    answer before the close, such as the 503 of a refused connection, counts
    as closed)."""
    s.settimeout(wait if wait > 0 else 0.001)
    try:
        while s.recv(65536) != b"":
            pass
        return False
    except (socket.timeout, BlockingIOError):
        return True
    except OSError:
        return False


def read_all(s):
    """Everything s receives until the server closes it; s is closed."""
    got = b""
    while True:
        d = s.recv(65536)
        if not d:
            break
        got += d
    s.close()
    return got


def timed_health(srv):
    t = time.time()
    st, _, body = http(srv, "GET", "/health", key=None)
    return st, time.time() - t, body


def stream_request(port, body, key=KEY, started=None, timeout=120):
    """Runs one streaming completion; returns a dict with the SSE data lines,
    the finish reasons, whether [DONE] came and whether the chunked body
    ended properly (http.client raises IncompleteRead otherwise)."""
    out = {"data": [], "finish": [], "done": False, "complete": False, "status": None, "error": None,
           "first_gap": None, "t_end": None}
    try:
        conn = httpclient.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        t_head = None
        resp = conn.getresponse()
        t_head = time.time()
        out["status"] = resp.status
        buf = b""
        while True:
            chunk = resp.read1(65536)
            if not chunk:
                break
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                for line in ev.split(b"\n"):
                    if not line.startswith(b"data: "):
                        continue
                    if out["first_gap"] is None:
                        out["first_gap"] = time.time() - t_head
                    d = line[6:]
                    if d == b"[DONE]":
                        out["done"] = True
                        continue
                    j = json.loads(d)
                    out["data"].append(j)
                    for ch in j.get("choices", []):
                        if ch.get("finish_reason"):
                            out["finish"].append(ch["finish_reason"])
                    if started is not None:
                        started.set()
        out["complete"] = True
        out["t_end"] = time.time()
        conn.close()
    except Exception as e:  # noqa: BLE001 - reported by the caller
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def run_streams(port, n, body):
    results = [None] * n
    firsts = [threading.Event() for _ in range(n)]

    def one(i):
        results[i] = stream_request(port, body, started=firsts[i])
        firsts[i].set()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results, firsts


def connections_checks():
    srv = Server(ENGINE + ["--max-connections", "16", "--max-connections-per-ip", "8", "--header-timeout", "3",
                           "--idle-timeout", "1", "--max-seqs", "1"])
    model = None
    try:
        st, _, body = http(srv, "GET", "/v1/models")
        model = json.loads(body)["data"][0]["id"]

        @check("kv_pages_free_from_start")
        def _():
            m = metrics(srv)  # before any request: every page is free
            assert m["cascade_kv_pages_total"] > 0 and m["cascade_kv_pages_free"] == m["cascade_kv_pages_total"], m

        @check("per_ip_limit")
        def _():
            slow = [slow_conn(srv.port, "127.0.0.2") for _ in range(20)]
            time.sleep(0.3)
            held = sum(is_open(s) for s in slow)
            extra = slow_conn(srv.port, "127.0.0.2")  # over the limit: a JSON 503, then the close
            head, _, body = read_all(extra).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503"), head
            assert json.loads(body)["error"]["code"] == "too_many_connections", body
            st, dt, _ = timed_health(srv)
            for s in slow:
                s.close()
            assert held <= 8, f"{held} connections from one address held"
            assert held >= 4, f"only {held} slow connections held: the test did not load the server"
            assert st == 200 and dt < 1.0, (st, dt)

        @check("total_limit_evicts_waiting")
        def _():
            m0 = metrics(srv)
            slow = [slow_conn(srv.port, f"127.0.0.{a}") for a in (3, 4, 5) for _ in range(8)]
            time.sleep(0.3)
            st, dt, _ = timed_health(srv)
            held = sum(is_open(s) for s in slow)
            m1 = metrics(srv)
            for s in slow:
                s.close()
            assert st == 200 and dt < 1.0, (st, dt)
            ev = m1['cascade_http_connections_closed_total{reason="evicted"}'] - \
                m0['cascade_http_connections_closed_total{reason="evicted"}']
            assert held <= 16 and ev >= 1, f"{held} slow connections held, {ev} evicted"

        @check("header_deadline")
        def _():
            m0 = metrics(srv)
            s = slow_conn(srv.port, "127.0.0.6")
            t = time.time()
            closed_at = None
            while time.time() - t < 8:
                try:
                    s.sendall(b"X")
                except OSError:
                    closed_at = time.time() - t
                    break
                if not is_open(s, 0.3):
                    closed_at = time.time() - t
                    break
            s.close()
            m1 = metrics(srv)
            assert closed_at is not None and 2.5 < closed_at < 4.5, closed_at
            key = 'cascade_http_connections_closed_total{reason="header_timeout"}'
            assert m1[key] >= m0[key] + 1, (m0[key], m1[key])

        @check("stream_gap_longer_than_idle_timeout")
        def _():
            long_body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 400,
                         "ignore_eos": True, "temperature": 0, "stream": True}
            threads, results, firsts = run_streams(srv.port, 1, long_body)
            assert firsts[0].wait(60), "no first token"
            # --max-seqs 1: these wait for the first to end
            plain = {}
            pt = threading.Thread(target=lambda: plain.update(zip(("status", "headers", "body"), http(
                srv, "POST", "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 4}))))
            pt.start()
            second = stream_request(srv.port, {"model": model, "prompt": "Hi", "max_tokens": 4, "stream": True})
            for t in threads + [pt]:
                t.join()
            first = results[0]
            assert first["done"] and first["finish"] == ["length"], first
            assert second["status"] == 200 and second["done"] and second["complete"], second
            assert second["finish"] and second["finish"][-1] in ("length", "stop"), second
            assert second["first_gap"] > 1.2, f"the gap ({second['first_gap']:.2f} s) did not pass the idle timeout"
            assert plain.get("status") == 200, plain

        @check("half_close_stream")
        def _():
            body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
                               "ignore_eos": True, "stream": True}).encode()
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            s.shutdown(socket.SHUT_WR)
            got = read_all(s)
            assert b"data: [DONE]" in got and got.endswith(b"0\r\n\r\n"), got[-200:]
            assert got.count(b'"finish_reason":"length"') == 1, got[-400:]

        @check("tokenize_detokenize")
        def _():
            prompt = "The capital of France is"
            st, _, body = http(srv, "POST", "/tokenize", {"model": model, "prompt": prompt, "return_token_strs": True})
            assert st == 200, body
            tk = json.loads(body)
            assert tk["count"] == len(tk["tokens"]) > 0 and tk["max_model_len"] == 2048, tk
            assert "".join(tk["token_strs"]) == prompt, tk
            st, _, body = http(srv, "POST", "/detokenize", {"model": model, "tokens": tk["tokens"]})
            assert st == 200 and json.loads(body) == {"prompt": prompt}, body
            # the count is the engine's: a completion reports the same prompt_tokens
            st, _, body = http(srv, "POST", "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1})
            assert st == 200 and json.loads(body)["usage"]["prompt_tokens"] == tk["count"], body
            msgs = [{"role": "user", "content": "Hello there"}]
            st, _, body = http(srv, "POST", "/tokenize", {"model": model, "messages": msgs})
            assert st == 200, body
            chat_count = json.loads(body)["count"]
            st, _, body = http(srv, "POST", "/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 1})
            assert st == 200 and json.loads(body)["usage"]["prompt_tokens"] == chat_count, (chat_count, body)
            for bad, param in (({"prompt": 3}, "prompt"), ({"messages": [{"role": "user"}]}, "messages"),
                               ({"prompt": "a", "model": "nope"}, "model"),
                               ({"messages": msgs, "add_generation_prompt": False}, "add_generation_prompt")):
                st, _, body = http(srv, "POST", "/tokenize", bad)
                err = json.loads(body)["error"]
                assert st in (400, 404) and (err["param"] or "").startswith(param), (bad, st, body)
            st, _, body = http(srv, "POST", "/detokenize", {"tokens": [1, -5]})
            assert st == 400 and json.loads(body)["error"]["param"] == "tokens", body

        @check("version_and_model_routes")
        def _():
            st, _, body = http(srv, "GET", "/version", key=None)
            assert st == 200 and re.match(r"^\d+\.\d+\.\d+", json.loads(body)["version"]), body
            st, _, body = http(srv, "GET", f"/v1/models/{model}")
            assert st == 200 and json.loads(body)["id"] == model and json.loads(body)["object"] == "model", body
            st, _, body = http(srv, "GET", "/v1/models/no-such-model")
            assert st == 404 and json.loads(body)["error"]["code"] == "model_not_found", body
            st, _, body = http(srv, "GET", f"/v1/models/{model}", key=None)
            assert st == 401 and "error" in json.loads(body), body
            st, hdr, body = http(srv, "GET", "/tokenize", key=None)
            assert st == 405 and json.loads(body)["error"]["code"] == "method_not_allowed", body

        @check("ids_random_and_distinct")
        def _():
            ids = set()
            for i in range(20):
                st, _, body = http(srv, "POST", "/v1/completions", {"model": model, "prompt": "a", "max_tokens": 1})
                rid = json.loads(body)["id"]
                assert re.fullmatch(r"cmpl-[0-9a-f]{32}", rid), rid
                ids.add(rid)
            assert len(ids) == 20

        @check("protocol_errors_are_json")
        def _():
            # answered by the connection gate before libmicrohttpd, which would send HTML
            cases = [(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
                     (b"HELLO\r\n\r\n", 400),
                     (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", 400),
                     (b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505),
                     (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
                     (b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 200000 + b"\r\n\r\n", 431)]
            for raw, status in cases:
                s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
                try:
                    s.sendall(raw)
                except OSError:
                    pass  # the answer may come before the whole of a huge head was sent
                got = read_all(s)
                head, _, body = got.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 %d " % status) and head.count(b"HTTP/1.1") == 1, (raw[:40], head)
                err = json.loads(body)["error"]
                assert err["message"] and err["type"], body
            # a kept-alive connection with two pipelined requests still gets both answers
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            got = read_all(s)
            assert got.count(b"HTTP/1.1 200") == 2, got

        @check("header_too_large_is_json")
        def _():
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40000 + b"\r\n\r\n")
            got = read_all(s)
            head, _, body = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 431"), head
            assert json.loads(body)["error"]["code"] == "request_header_too_large", body

    finally:
        rc = srv.stop()
        cs.report("limits_server_exit", rc == 0, f"exit status {rc}")


def health_503(srv):
    st, hdr, body = http(srv, "GET", "/health", key=None)
    return st == 503 and json.loads(body)["error"]["type"] == "server_error"


def drain_check():
    @check("drain_on_sigterm")
    def _():
        srv = Server(ENGINE + ["--max-seqs", "16", "--shutdown-timeout", "120"])
        try:
            body = {"prompt": "Write a poem about the sea.", "max_tokens": 96, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            threads, results, firsts = run_streams(srv.port, 8, body)
            plain = {}
            pt = threading.Thread(target=lambda: plain.update(
                zip(("status", "headers", "body"),
                    http(srv, "POST", "/v1/completions", {"prompt": "Count to ten:", "max_tokens": 48,
                                                          "ignore_eos": True}))))
            pt.start()
            for f in firsts:
                assert f.wait(120), "a stream got no token"
            t0 = time.time()
            srv.p.send_signal(signal.SIGTERM)
            saw_503 = False
            while time.time() - t0 < 20 and not saw_503:
                try:
                    saw_503 = health_503(srv)
                except OSError:
                    break
                if not saw_503:
                    time.sleep(0.02)
            t_503 = time.time()
            new_st = None
            if saw_503:
                try:
                    st, _, b = http(srv, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
                    new_st = (st, json.loads(b)["error"]["code"])
                except OSError as e:
                    new_st = str(e)
            for t in threads:
                t.join(120)
            pt.join(120)
            rc = srv.p.wait(timeout=120)
            elapsed = time.time() - t0
            ends = [r["t_end"] - t0 for r in results if r["t_end"]]
            assert saw_503 and max(ends) > t_503 - t0, \
                f"/health 503 ({saw_503}) at {t_503 - t0:.2f} s while streams ran (they ended at {ends})"
            assert new_st == (503, "server_shutting_down"), new_st
            for r in results:
                assert r["error"] is None and r["complete"], r["error"]
                assert r["done"] and r["finish"] == ["length"], (r["finish"], r["done"])
                assert sum(len(c["choices"][0]["text"]) for c in r["data"] if c["choices"]) > 0
            assert plain.get("status") == 200, plain
            assert json.loads(plain["body"])["choices"][0]["finish_reason"] == "length", plain
            assert rc == 0 and elapsed < 120, (rc, elapsed)
        finally:
            if srv.p.poll() is None:
                srv.p.kill()


def abort_check(name, extra, second_signal):
    @check(name)
    def _():
        srv = Server(ENGINE + ["--max-seqs", "16"] + extra)
        try:
            body = {"prompt": "Tell me everything you know.", "max_tokens": 1800, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            threads, results, firsts = run_streams(srv.port, 4, body)
            for f in firsts:
                assert f.wait(120), "a stream got no token"
            t0 = time.time()
            srv.p.send_signal(signal.SIGTERM)
            if second_signal:
                time.sleep(0.3)
                srv.p.send_signal(signal.SIGTERM)
            rc = srv.p.wait(timeout=30)
            elapsed = time.time() - t0
            for t in threads:
                t.join(30)
            limit = 3.5 if second_signal else 4.5
            assert rc == 0 and elapsed < limit, (rc, elapsed)
            for r in results:
                assert r["error"] is None and r["complete"], r["error"]
                assert r["done"] and r["finish"] == ["abort"], (r["finish"], r["done"])
        finally:
            if srv.p.poll() is None:
                srv.p.kill()


def main():
    if not os.path.exists(cs.CASCADE):
        cs.skip(f"{cs.CASCADE} not built")
    if not os.path.exists(cs.MODEL):
        cs.skip(f"{cs.MODEL} missing (make model)")
    try:
        socket.create_connection(("127.0.0.1", 9), timeout=1, source_address=("127.0.0.2", 0)).close()
    except ConnectionRefusedError:
        pass
    except OSError as e:
        cs.skip(f"cannot bind a client to 127.0.0.2 ({e})")
    connections_checks()
    drain_check()
    abort_check("second_signal_stops_at_once", [], True)
    abort_check("shutdown_timeout_aborts", ["--shutdown-timeout", "1"], False)
    print(f"{cs.passed} passed, {cs.failed} failed")
    return 1 if cs.failed else 0


if __name__ == "__main__":
    sys.exit(main())
