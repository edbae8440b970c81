#!/usr/bin/env python3
"""Replicas behind HAProxy (deploy/replicas.sh, deploy/haproxy.cfg), end to end
on loopback, with faults.

Starts 3 `cascade serve` replicas (1 thread each, a small KV pool) and the
balancer with a 500 ms health-check interval, then:
- prefix_routing: requests that share a system prompt longer than the routing
  key land on one replica, whatever their own question; so do requests that
  name the same X-Prefix-Key; eight different system prompts spread over
  more than one replica.
- kill_replica: streams and non-streaming requests run on every replica;
  replica K (one holding streams) gets SIGKILL. The balancer marks it down
  within its health-check interval (two checks, plus slack for a busy
  machine); every request that was not on K succeeds, non-streaming ones that
  were on K too (replayed on another replica, since K never answered), and
  the only failures are streams whose headers named K; new requests sent
  from the kill on, K's prefixes among them, all succeed, on other replicas.
- rejoin: K restarts, the balancer takes it back, and its prefixes route to it
  again (consistent hashing).
- drain: `replicas.sh drain J` while streams run on J: they all finish with
  [DONE]; new requests meanwhile succeed elsewhere; J ends in maintenance,
  and comes back with `replicas.sh restart J`.
- sigterm_replica: a replica stopped from outside (SIGTERM, as an
  orchestrator stops it) finishes its streams; new requests for its prefixes,
  which it answers 503, are retried on the others and all succeed; the
  balancer marks it down at its health checks.

Bounded in time (about 25 s on 2 busy cores; every wait has a deadline).
Skipped for a sanitizer build (make asan), whose model runs ten times slower.
Prints "N passed, N failed" like the C tests; prints a skip line and
"0 passed, 0 failed" when haproxy, `cascade serve` or the model is missing.
Environment: BUILD (default build), CASCADE_BIN, CASCADE_MODEL as for
check_server.py.
"""
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_server as cs  # noqa: E402
from check_server import CASCADE, MODEL  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "deploy", "replicas.sh")
N = 3
CHECK_MS = 500
SERVE = ["--kv-cache-mb", "48", "--max-context", "1024", "--shutdown-timeout", "60"]
WORDS = ("river stone cloud lamp garden window letter market violin harbor meadow candle forest "
         "engine ladder mirror pocket rabbit saddle tunnel velvet wagon yellow zebra anchor basket").split()


def check(name):
    """check_server.py's check, timed."""
    def wrap(fn):
        t0 = time.time()
        cs.check(name)(fn)
        print(f"  ({name}: {time.time() - t0:.1f} s)")
        return fn
    return wrap


def skip(reason):
    print(f"skip check_replicas: {reason}")
    print("0 passed, 0 failed")
    sys.exit(0)


def free_base(n):
    """A port P such that P..P+n are free on 127.0.0.1 (the balancer and n replicas)."""
    rng = random.Random()
    for _ in range(50):
        base = rng.randrange(20000, 60000)
        socks = []
        try:
            for p in range(base, base + n + 1):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def system_prompt(i):
    """About 700 bytes of text (more than the 512-byte routing key), different for each i."""
    rng = random.Random(1000 + i)
    return f"Instructions set {i}: " + " ".join(rng.choice(WORDS) for _ in range(110))


class Deployment:
    def __init__(self):
        self.base = free_base(N)
        self.run_dir = tempfile.mkdtemp(prefix="cascade-replicas-test-")
        self.url_host, self.port = "127.0.0.1", self.base

    def sh(self, *args, timeout=120):
        r = subprocess.run(["bash", SCRIPT, args[0], "--run-dir", self.run_dir, *args[1:]], capture_output=True, text=True,
                           timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"replicas.sh {' '.join(args)}: {r.stderr.strip()[-600:]}")
        return r.stdout

    def start(self):
        self.sh("start", "-n", str(N), "--port", str(self.base), "--threads", "1", "--check-ms", str(CHECK_MS),
                "--cascade", CASCADE, "--model", MODEL, "--", *SERVE, timeout=300)

    def lb(self, command):
        """One command to the balancer's admin socket (HAProxy's runtime API)."""
        with socket.socket(socket.AF_UNIX) as so:
            so.settimeout(5)
            so.connect(os.path.join(self.run_dir, "haproxy.sock"))
            so.sendall(command.encode() + b"\n")
            out = b""
            while True:
                b = so.recv(65536)
                if not b:
                    return out.decode()
                out += b

    def state(self):
        """{replica: 'up', 'down', 'up, maintenance', ...} from the runtime API's server states
        (as replicas.sh status reads them)."""
        out = {}
        for line in self.lb("show servers state replicas").splitlines():
            f = line.split()
            if len(f) > 7 and not line.startswith("#"):
                op, adm = int(f[5]), int(f[6])
                st = {0: "down", 1: "starting", 2: "up", 3: "stopping"}.get(op, "?")
                out[f[3]] = st + (", maintenance" if adm & 0x67 else ", draining" if adm & 0x18 else "")
        return out

    def in_flight(self):
        """{replica: requests in flight} from the balancer's statistics."""
        return {f[1]: int(f[4] or 0) for f in (l.split(",") for l in self.lb("show stat").splitlines())
                if len(f) > 5 and f[0] == "replicas" and f[1].startswith("r")}

    def idle(self):
        """Waits (up to 5 s) until the balancer counts no request in flight: its bounded
        load counts a request until it has released it, a moment after the client
        read the last byte, and with one request in flight any replica holding it is
        over twice the average."""
        return wait_for(lambda: not any(self.in_flight().values()), 5, 0.01) is not None

    def stop(self):
        try:
            self.sh("stop", timeout=120)
        finally:
            shutil.rmtree(self.run_dir, ignore_errors=True)


MODEL_ID = None  # the id the replicas serve, from /v1/models


def body(sp, question, max_tokens=8, stream=False):
    return {"model": MODEL_ID, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream,
            "messages": [{"role": "system", "content": sp}, {"role": "user", "content": question}]}


class Call:
    """One chat request through the balancer, on a thread; records its replica and outcome."""

    def __init__(self, dep, b, headers=None):
        self.dep, self.b, self.headers = dep, b, headers or {}
        self.replica = None   # from the response's X-Cascade-Replica
        self.status = None
        self.ok = False
        self.err = None
        self.first = threading.Event()  # headers and the first chunk came
        self.done = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self.t.start()
        return self

    def _run(self):
        try:
            c = http.client.HTTPConnection(self.dep.url_host, self.dep.port, timeout=90)
            h = {"Content-Type": "application/json", **self.headers}
            c.request("POST", "/v1/chat/completions", json.dumps(self.b), h)
            r = c.getresponse()
            self.status = r.status
            self.replica = r.getheader("X-Cascade-Replica")
            if not self.b.get("stream"):
                j = json.loads(r.read())
                self.first.set()
                self.ok = r.status == 200 and j["choices"][0]["finish_reason"] == "length"
                if not self.ok:
                    self.err = f"HTTP {r.status}: {j}"
                return
            saw_done = finish = False
            while True:
                line = r.readline()
                if not line:
                    break
                if line.startswith(b"data: "):
                    self.first.set()
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        saw_done = True
                        break
                    for ch in json.loads(data).get("choices", []):
                        finish = finish or ch.get("finish_reason") == "length"
            self.ok = r.status == 200 and saw_done and finish
            if not self.ok:
                self.err = f"HTTP {r.status}, [DONE] {saw_done}, finish {finish}"
        except Exception as e:  # noqa: BLE001 - a failed request is an outcome to check
            self.err = f"{type(e).__name__}: {e}"
        finally:
            self.first.set()
            self.done.set()

    def wait(self, timeout=90):
        self.t.join(timeout)
        return self


def call(dep, b, headers=None):
    return Call(dep, b, headers).start().wait()


def call_alone(dep, b, headers=None):
    """A request with nothing else in flight: it goes to its key's first replica."""
    dep.idle()
    return call(dep, b, headers)


def wait_for(pred, timeout, step=0.05):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return time.time() - t0
        time.sleep(step)
    return None


def main():
    if not shutil.which("haproxy"):
        skip("haproxy not installed (tools/setup.sh installs it)")
    if not shutil.which("curl"):
        skip("curl missing")
    if not os.path.exists(CASCADE) or not os.path.exists(MODEL):
        skip(f"{CASCADE} or {MODEL} missing")
    with open(CASCADE, "rb") as f:
        sanitized = b"__asan_init" in f.read()
    if sanitized:
        # this test times a deployment (health checks, drains) with the real model, which a
        # sanitizer build runs ten times slower; the server code it drives is the same that
        # test_server and check_server run under the sanitizers
        skip(f"{CASCADE} is a sanitizer build (make asan): run with the plain build (make test)")
    t_all = time.time()
    dep = Deployment()
    try:
        dep.start()
    except Exception as e:  # noqa: BLE001
        cs.report("start", False, str(e))
        print(f"{cs.passed} passed, {cs.failed} failed")
        return 1
    global MODEL_ID
    with urllib.request.urlopen(f"http://127.0.0.1:{dep.port}/v1/models", timeout=30) as r:
        MODEL_ID = json.loads(r.read())["data"][0]["id"]
    print(f"  3 replicas and the balancer up in {time.time() - t_all:.1f} s")
    home = {}  # system prompt index -> its replica with no load

    try:
        @check("prefix_routing")
        def _():
            for i in range(8):
                got = {call_alone(dep, body(system_prompt(i), f"Question {q}?", 2)).replica for q in range(2)}
                assert len(got) == 1 and None not in got, (i, got)
                home[i] = got.pop()
            assert len(set(home.values())) > 1, f"8 system prompts all on one replica: {home}"
            got = {call_alone(dep, body(system_prompt(100 + q), "hi", 2), {"X-Prefix-Key": "tenant-7"}).replica
                   for q in range(3)}
            assert len(got) == 1 and None not in got, got
            print(f"  8 system prompts by replica: "
                  f"{ {r: sum(1 for v in home.values() if v == r) for r in sorted(set(home.values()))} }")

        @check("hot_prefix_spills")
        def _():
            # one hot key, many requests in flight at once: bounded load sends the overflow to
            # a second replica (the key's ring successor) and never to a third
            assert dep.idle(), f"requests still in flight: {dep.in_flight()}"
            hot = [Call(dep, body(system_prompt(200), f"Part {q}, in detail.", 40, True),
                        {"X-Prefix-Key": "hot-tenant"}).start() for q in range(9)]
            for c in hot:
                c.wait()
            got = {c.replica for c in hot}
            assert all(c.ok for c in hot), [(c.replica, c.err) for c in hot if not c.ok]
            assert len(got) == 2, f"9 concurrent requests of one key went to {got}"
            print(f"  9 concurrent requests of one key: {sorted(got)}")

        victim = {}

        @check("kill_replica")
        def _():
            assert home, "no routing table"
            # a stream of every system prompt (long outputs), and non-streaming requests, all at once
            streams = [Call(dep, body(system_prompt(i), "Tell me.", 120, True)).start() for i in range(8)]
            plain = [Call(dep, body(system_prompt(i), "Say more.", 24)).start() for i in range(0, 8, 2)]
            assert all(c.first.wait(60) for c in streams), "streams did not start"
            on = {}
            for c in streams:
                on.setdefault(c.replica, []).append(c)
            # K: a replica that is home to some system prompt (rejoin checks they come back)
            live = [r for r, cs_ in on.items() if r in set(home.values()) and any(not c.done.is_set() for c in cs_)]
            assert live, "every stream ended before the kill: outputs too short"
            k = max(live, key=lambda r: sum(not c.done.is_set() for c in on[r]))
            victim["k"] = k
            t_kill = time.time()
            dep.sh("kill", k[1:])
            t_kill_done = time.time()
            downs = []  # when the balancer first showed K down, polled from the kill on
            poller = threading.Thread(target=lambda: downs.append(wait_for(
                lambda: dep.state().get(k, "").startswith("down"), 10, 0.02)), daemon=True)
            poller.start()
            # new requests from the kill on: every system prompt, K's included, one every 50 ms
            after = []
            while time.time() - t_kill < 2.0:
                after.append(Call(dep, body(system_prompt(len(after) % 8), "And then?", 4)).start())
                time.sleep(0.05)
            poller.join(15)
            assert downs and downs[0] is not None, f"{k} not marked down: {dep.state()}"
            t_down = downs[0] + (t_kill_done - t_kill)
            for c in streams + plain + after:
                c.wait()
            failed = [c for c in streams + plain + after if not c.ok]
            bad = [c for c in failed if not (c in streams and c.replica == k)]
            assert not bad, f"{len(bad)} requests failed that were not streaming on {k}: " \
                            f"{[(c.replica, c.err) for c in bad[:4]]}"
            assert all(c.replica != k for c in after), "a request sent after the kill was answered by the killed replica"
            on_k = [c for c in streams if c.replica == k]
            print(f"  killed {k} with {sum(1 for c in on_k if not c.ok)} of its {len(on_k)} streams unfinished: "
                  f"down {t_down:.2f} s after the kill "
                  f"(checks every {CHECK_MS} ms, fall 2); {len(after)} new requests, all answered, "
                  f"{len(plain)} non-streaming ones all answered")
            limit = 2 * CHECK_MS / 1000 + 1.5
            assert t_down <= limit, f"marked down {t_down:.2f} s after the kill (limit {limit} s)"

        @check("rejoin")
        def _():
            k = victim["k"]
            dep.sh("restart", k[1:])
            t_up = wait_for(lambda: dep.state().get(k) == "up", 10)
            assert t_up is not None, dep.state()
            mine = [i for i, r in home.items() if r == k]
            assert mine, f"no system prompt had {k} as its home"
            got = [call_alone(dep, body(system_prompt(i), "Back?")).replica for i in mine]
            assert all(r == k for r in got), f"{k}'s prompts went to {got}"

        @check("drain")
        def _():
            j = next(r for r in sorted(set(home.values())))
            mine = [i for i, r in home.items() if r == j]
            streams = [Call(dep, body(system_prompt(i), "Go on.", 100, True)).start() for i in mine]
            assert all(c.first.wait(60) for c in streams), "streams did not start"
            on_j = [c for c in streams if c.replica == j and not c.done.is_set()]
            assert on_j, f"no stream running on {j}"
            drainer = threading.Thread(target=dep.sh, args=("drain", j[1:]), daemon=True)
            drainer.start()
            # new requests once the balancer has taken the drain (the script's start and its
            # admin-socket command take a moment, longer on a busy machine)
            assert wait_for(lambda: any(w in dep.state().get(j, "") for w in ("draining", "maintenance")),
                            30, 0.01) is not None, f"{j} not draining: {dep.state()}"
            during = [call(dep, body(system_prompt(i), "Meanwhile?", 4)) for i in mine]
            drainer.join(60)
            assert not drainer.is_alive(), "drain did not finish"
            for c in streams:
                c.wait()
            bad = [c for c in streams + during if not c.ok]
            assert not bad, f"{len(bad)} requests failed during the drain: {[(c.replica, c.err) for c in bad[:4]]}"
            assert all(c.replica != j for c in during), [c.replica for c in during]
            assert "maintenance" in dep.state().get(j, ""), dep.state()
            print(f"  drained {j}: its {len(on_j)} running streams finished, {len(during)} new requests "
                  f"went to {sorted({c.replica for c in during})}")
            dep.sh("restart", j[1:])
            assert wait_for(lambda: dep.state().get(j) == "up", 10) is not None, dep.state()
        @check("sigterm_replica")
        def _():
            # a replica stopped from outside (an orchestrator's SIGTERM): it answers /health and
            # new requests with 503 while its streams finish; the balancer retries those 503s
            # elsewhere and takes it out at its health checks
            j = sorted(set(home.values()))[-1]
            mine = [i for i, r in home.items() if r == j]
            streams = [Call(dep, body(system_prompt(i), "Go on.", 100, True)).start() for i in mine]
            assert all(c.first.wait(60) for c in streams), "streams did not start"
            on_j = [c for c in streams if c.replica == j and not c.done.is_set()]
            assert on_j, f"no stream running on {j}"
            with open(os.path.join(dep.run_dir, f"{j}.pid")) as f:
                pid = int(f.read())
            os.kill(pid, signal.SIGTERM)

            def draining():  # the replica has taken the signal: its /health says 503
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{dep.port + 1 + int(j[1:])}/health", timeout=2)
                    return False
                except urllib.error.HTTPError as e:
                    return e.code == 503
                except OSError:
                    return False
            # requests sent before the signal is handled are the replica's to answer
            assert wait_for(draining, 5, 0.01) is not None, f"{j} does not say draining"
            downs = []
            poller = threading.Thread(target=lambda: downs.append(wait_for(
                lambda: dep.state().get(j, "").startswith("down"), 10, 0.02)), daemon=True)
            poller.start()
            during = [call(dep, body(system_prompt(i), "Meanwhile?", 4)) for i in mine for _ in range(2)]
            poller.join(15)
            for c in streams:
                c.wait()
            bad = [c for c in streams + during if not c.ok]
            assert not bad, f"{len(bad)} requests failed: {[(c.replica, c.err) for c in bad[:4]]}"
            assert all(c.replica != j for c in during), [c.replica for c in during]
            assert downs and downs[0] is not None, dep.state()
            limit = 2 * CHECK_MS / 1000 + 1.5
            assert downs[0] <= limit, f"marked down {downs[0]:.2f} s after SIGTERM (limit {limit} s)"
            print(f"  SIGTERM to {j}: its {len(on_j)} streams finished, {len(during)} new requests answered by "
                  f"{sorted({c.replica for c in during})}; down at the balancer {downs[0]:.2f} s after the signal")

            def gone():  # exited (a zombie counts: where no init reaps orphans)
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        return f.read().rsplit(")", 1)[1].split()[0] == "Z"
                except OSError:
                    return True
            assert wait_for(gone, 25) is not None, f"{j} did not exit after its streams"
            dep.sh("restart", j[1:])
            assert wait_for(lambda: dep.state().get(j) == "up", 10) is not None, dep.state()
    finally:
        dep.stop()
    print(f"  {time.time() - t_all:.1f} s in all")
    print(f"{cs.passed} passed, {cs.failed} failed")
    return 1 if cs.failed else 0


if __name__ == "__main__":
    sys.exit(main())
