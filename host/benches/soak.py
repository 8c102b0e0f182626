#!/usr/bin/env python3
"""Soak: `airlock serve --http` under sustained use by many MCP clients, with faults.

    python3 host/benches/soak.py [--airlock BIN] [--workers N] [--minutes M] [--faults]
                                 [--era legacy|stateless] [--retain DURATION] [--json]

Starts `airlock serve --http 127.0.0.1:0` over the bundled notes server and the
`source-library` adapter (reviewed in a temporary state folder), then runs N worker threads
for M minutes. Each worker repeats what an MCP client doing research does: with `--era
legacy` (2025-11-25, the default) it opens a session (`initialize`), lists the tools, then
five times searches and retrieves the first hit of the search, searches again and retrieves
the first hit of the *earlier* search (a reference must survive a second search), and
closes the session (`DELETE`); with `--era stateless` (2026-07-28) it does the same in
stateless requests. Every request carries an id and must get its answer.

`--faults` adds, at a quarter, half and three quarters of the run: the notes server frozen
(SIGSTOP) for 8 s, then killed (SIGKILL, the host restarts it), then a burst of 200
legacy sessions opened and never closed.

`--retain 2m` serves with `[trace] retain = "2m"`: old events are archived into segment
files (the state folder's `trace-archive`), so the store should stop growing.

Every 10 s it samples the host: RSS, open file descriptors, threads, the state folder's
bytes (the store, its WAL and the trace journals, not the archive) and the archive's. At the end it prints calls/s, p50 and p99 per method,
answers by outcome (ok, each refusal category, transport errors, requests left
unanswered), the samples per minute, and whether RSS, descriptors and threads plateau
after warm-up (from minute 3 on, within 5 % of their mean; with shorter runs, from half
way), the store's too, and the trace's bytes per tools/call (what the store and the archive
gained, over the calls). `--json` prints the same as one JSON document.

BIN defaults to target/release/airlock when it exists, else target/debug/airlock; the
pinned adapter comes from the build's bundle, target/airlock/adapters. This is a benchmark,
not a test: it never fails the build. BENCHMARKS.md ("Sustained use") has its runs.
"""

import argparse
import collections
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUNDLE = os.path.join(ROOT, "target/airlock/adapters")
WORDS = ["checkpoint", "wal", "replica", "vacuum", "index", "lock", "page", "journal"]
REFUSALS = [
    "rate limited",
    "interrupted",
    "unavailable",
    "unknown",
    "invalid request",
    "forbidden",
    "state changed",
    "result exceeds budget",
]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = os.path.join(ROOT, "target/release/airlock")
    if not os.path.exists(default):
        default = os.path.join(ROOT, "target/debug/airlock")
    p.add_argument("--airlock", default=default, help="the airlock binary (default: %(default)s)")
    p.add_argument("--workers", type=int, default=4, help="client threads (default 4)")
    p.add_argument("--minutes", type=float, default=1.0, help="how long (default 1)")
    p.add_argument("--faults", action="store_true", help="freeze, kill, and a burst of unclosed sessions")
    p.add_argument("--era", choices=["legacy", "stateless"], default="legacy")
    p.add_argument("--retain", metavar="DURATION", help='serve with [trace] retain = DURATION (e.g. "2m")')
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (state, serve.log)")
    return p.parse_args()


class Host:
    """A running `airlock serve --http` in a temporary folder."""

    def __init__(self, airlock, retain=None):
        self.dir = tempfile.mkdtemp(prefix="airlock-soak-")
        self.state = os.path.join(self.dir, "state")
        mappings = os.path.join(self.dir, "mappings", "source-library")
        shutil.copytree(os.path.join(BUNDLE, "source-library"), mappings)
        self.config = os.path.join(self.dir, "airlock.toml")
        with open(self.config, "w") as f:
            f.write(
                f"state_dir = {json.dumps(self.state)}\n"
                f'[[connection]]\nname = "notes"\ncommand = "@airlock"\nargs = ["fixture", "notes-server"]\n'
                f'[[mapping]]\nmanifest = {json.dumps(os.path.join(mappings, "mapping.toml"))}\n'
            )
            if retain:
                f.write(f"[trace]\nretain = {json.dumps(retain)}\n")
        env = dict(os.environ, AIRLOCK_STATE_DIR=self.state, AIRLOCK_LOG="warn")
        for args in (
            ["discover", "notes", "--config", self.config],
            ["review", "approve", "source-library", "--config", self.config, "--reviewer", "soak"],
        ):
            subprocess.run([airlock, *args], env=env, check=True, capture_output=True)
        self.log = open(os.path.join(self.dir, "serve.log"), "w+")
        self.proc = subprocess.Popen(
            [airlock, "serve", "--config", self.config, "--http", "127.0.0.1:0"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )
        deadline = time.time() + 120
        self.port = None
        while self.port is None:
            if time.time() > deadline or self.proc.poll() is not None:
                self.log.seek(0)
                sys.exit("airlock serve --http did not start:\n" + self.log.read())
            time.sleep(0.1)
            self.log.seek(0)
            m = re.search(r"serving MCP over HTTP at http://127\.0\.0\.1:(\d+)/mcp", self.log.read())
            if m:
                self.port = int(m.group(1))

    def notes_server(self):
        """The pid of the notes fixture server (a descendant of the host)."""
        for _ in range(100):
            for pid in descendants(self.proc.pid):
                try:
                    cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
                except OSError:
                    continue
                if b"notes-server" in cmd and b"__airlock-confine" not in cmd:
                    return pid
            time.sleep(0.1)
        return None

    def sample(self):
        status = open(f"/proc/{self.proc.pid}/status").read()
        rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) * 1024
        threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))
        fds = len(os.listdir(f"/proc/{self.proc.pid}/fd"))
        archive_dir = os.path.join(self.state, "trace-archive")

        def size(top, skip=None):
            total = 0
            for d, dirs, fs in os.walk(top):
                if skip:
                    dirs[:] = [x for x in dirs if os.path.join(d, x) != skip]
                for f in fs:
                    try:
                        total += os.path.getsize(os.path.join(d, f))
                    except OSError:
                        pass
            return total

        return {
            "rss": rss,
            "fds": fds,
            "threads": threads,
            "store": size(self.state, archive_dir),
            "archive": size(archive_dir),
        }

    def stop(self, keep=False):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if keep:
            print(f"kept {self.dir}", file=sys.stderr)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


def descendants(pid):
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                kids = open(f"/proc/{p}/task/{task}/children").read().split()
                found += [int(k) for k in kids]
                todo += [int(k) for k in kids]
        except OSError:
            pass
    return found


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.began = time.monotonic()
        self.latency = collections.defaultdict(list)
        self.outcomes = collections.Counter()
        # The first answers that are not an answer (unanswered, transport errors, HTTP
        # errors): when, to what, and what came back, to explain them.
        self.anomalies = []

    def record(self, method, seconds, outcome, detail=None):
        with self.lock:
            self.latency[method].append(seconds)
            self.outcomes[outcome] += 1
            if detail is not None and len(self.anomalies) < 20:
                self.anomalies.append({
                    "t": round(time.monotonic() - self.began, 1),
                    "method": method,
                    "outcome": outcome,
                    "detail": detail[:300],
                })


class Client:
    """One MCP client over HTTP: a legacy session or stateless requests."""

    META = {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": {"name": "soak", "version": "1"},
    }

    def __init__(self, port, era, stats):
        self.port, self.era, self.stats = port, era, stats
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.session = None
        self.next_id = 0

    def post(self, method, params, notification=False):
        """Sends one message; returns its answer (None for a notification or on failure)."""
        if self.era == "legacy" and self.session is None and method != "initialize":
            return None  # the session ended: the next round initializes again
        self.next_id += 1
        message = {"jsonrpc": "2.0", "method": method}
        if not notification:
            message["id"] = self.next_id
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.era == "stateless":
            params = dict(params, _meta=self.META)
            headers["MCP-Protocol-Version"] = "2026-07-28"
            headers["Mcp-Method"] = method
            if "name" in params:
                headers["Mcp-Name"] = params["name"]
        elif self.session:
            headers["Mcp-Session-Id"] = self.session
            headers["MCP-Protocol-Version"] = "2025-11-25"
        message["params"] = params
        started = time.monotonic()
        try:
            self.conn.request("POST", "/mcp", json.dumps(message), headers)
            reply = self.conn.getresponse()
            body = reply.read().decode("utf-8", "replace")
        except (OSError, http.client.HTTPException) as e:
            self.conn.close()
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            self.stats.record(method, time.monotonic() - started, f"transport error: {type(e).__name__}", str(e))
            return None
        took = time.monotonic() - started
        if method == "initialize":
            self.session = reply.getheader("Mcp-Session-Id")
        if notification:
            return None
        if reply.status == 404 and self.session:
            # The session ended (idle, or evicted past max_sessions_per_principal): a client
            # initializes again.
            self.stats.record(method, took, "session ended (404)")
            self.session = None
            return None
        answer = None
        try:
            if reply.getheader("Content-Type", "").startswith("text/event-stream"):
                for line in body.splitlines():
                    if line.startswith("data:") and line[5:].strip():
                        data = json.loads(line[5:])
                        if data.get("id") == message["id"]:
                            answer = data
            elif body.strip():
                answer = json.loads(body)
        except ValueError:
            answer = None
        if answer is None:
            self.stats.record(method, took, f"unanswered (HTTP {reply.status})",
                              f"{reply.getheader('Content-Type', '')}: {body}")
        elif "error" in answer:
            self.stats.record(method, took, f"JSON-RPC error {answer['error'].get('code')}")
        elif answer["result"].get("isError"):
            text = " ".join(c.get("text", "") for c in answer["result"].get("content", []))
            category = next((c for c in REFUSALS if text.startswith(c)), "other refusal")
            if "not valid in this session" in text:
                category = "invalid reference"
            self.stats.record(method, took, category)
        else:
            self.stats.record(method, took, "ok")
        return answer

    def call(self, name, arguments):
        answer = self.post("tools/call", {"name": name, "arguments": arguments})
        if answer and "result" in answer and not answer["result"].get("isError"):
            return answer["result"].get("structuredContent", {}).get("result")
        return None

    def first_reference(self, query):
        hits = self.call("search_sources", {"query": query}) or []
        return hits[0]["reference"] if hits else None

    def research(self, round_):
        if self.era == "legacy":
            self.session = None
            self.post("initialize", {
                "protocolVersion": "2025-11-25", "capabilities": {},
                "clientInfo": {"name": "soak", "version": "1"}})
            self.post("notifications/initialized", {}, notification=True)
        self.post("tools/list", {})
        for i in range(5):
            if self.era == "legacy" and self.session is None:
                return
            word = WORDS[(round_ + i) % len(WORDS)]
            first = self.first_reference(word)
            if first:
                self.call("retrieve_source", {"reference": first})
            # A second search, then the first search's hit: its reference must still hold.
            self.first_reference(WORDS[(round_ + i + 3) % len(WORDS)])
            if first:
                self.call("retrieve_source", {"reference": first})
        if self.era == "legacy" and self.session:
            try:
                self.conn.request("DELETE", "/mcp", headers={
                    "Mcp-Session-Id": self.session, "MCP-Protocol-Version": "2025-11-25"})
                self.conn.getresponse().read()
            except (OSError, http.client.HTTPException):
                self.conn.close()
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)


def percentile(values, p):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))]


def plateau(samples, key, minutes):
    """Whether `key` stays within 5 % of its mean from minute 3 on (half way if shorter)."""
    start = 180 if minutes >= 4 else minutes * 30
    tail = [s[key] for s in samples if s["t"] >= start]
    if len(tail) < 2:
        return None
    mean = sum(tail) / len(tail)
    return all(abs(v - mean) <= 0.05 * mean for v in tail)


def main():
    args = parse_args()
    host = Host(args.airlock, args.retain)
    stats = Stats()
    stop = threading.Event()
    samples, faults = [], []
    began = time.monotonic()
    duration = args.minutes * 60

    def worker():
        client = Client(host.port, args.era, stats)
        n = 0
        while not stop.is_set():
            try:
                client.research(n)
            except Exception as e:  # a bench keeps going; the failure is counted
                stats.record("worker", 0.0, f"worker error: {type(e).__name__}")
                client = Client(host.port, args.era, stats)
            n += 1

    def sampler():
        while not stop.wait(10):
            s = host.sample()
            s["t"] = round(time.monotonic() - began)
            s["answers"] = sum(stats.outcomes.values())
            samples.append(s)

    def faulter():
        if stop.wait(duration / 4):
            return
        pid = host.notes_server()
        if pid:
            os.kill(pid, signal.SIGSTOP)
            faults.append(("frozen 8 s", round(time.monotonic() - began)))
            stop.wait(8)
            os.kill(pid, signal.SIGCONT)
        if stop.wait(max(0, duration / 2 - (time.monotonic() - began))):
            return
        pid = host.notes_server()
        if pid:
            os.kill(pid, signal.SIGKILL)
            faults.append(("killed", round(time.monotonic() - began)))
        if stop.wait(max(0, duration * 3 / 4 - (time.monotonic() - began))):
            return
        burst = Stats()
        for _ in range(200):
            c = Client(host.port, "legacy", burst)
            c.post("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                  "clientInfo": {"name": "burst", "version": "1"}})
        faults.append(("200 unclosed sessions", round(time.monotonic() - began)))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.workers)]
    threads.append(threading.Thread(target=sampler, daemon=True))
    if args.faults:
        threads.append(threading.Thread(target=faulter, daemon=True))
    for t in threads:
        t.start()
    time.sleep(duration)
    stop.set()
    for t in threads:
        t.join(60)
    elapsed = time.monotonic() - began
    log = open(host.log.name).read()
    host.stop(args.keep)

    answers = sum(stats.outcomes.values())
    report = {
        "airlock": args.airlock,
        "era": args.era,
        "workers": args.workers,
        "seconds": round(elapsed, 1),
        "requests_per_second": round(answers / elapsed, 1),
        "calls_per_second": round(len(stats.latency["tools/call"]) / elapsed, 1),
        "latency_ms": {
            m: {"n": len(v), "p50": round(percentile(v, 0.5) * 1000, 2), "p99": round(percentile(v, 0.99) * 1000, 2)}
            for m, v in sorted(stats.latency.items())
        },
        "outcomes": dict(stats.outcomes.most_common()),
        "faults": faults,
        "samples": samples,
        "retain": args.retain,
        "plateau": {k: plateau(samples, k, args.minutes) for k in ("rss", "fds", "threads", "store")},
        "trace_bytes_per_call": (
            round((samples[-1]["store"] + samples[-1]["archive"] - samples[0]["store"] - samples[0]["archive"])
                  / len(stats.latency["tools/call"]))
            if len(samples) > 1 and stats.latency["tools/call"] else None
        ),
        "store_bytes_per_minute": (
            round((samples[-1]["store"] - samples[0]["store"]) / ((samples[-1]["t"] - samples[0]["t"]) / 60))
            if len(samples) > 1 and samples[-1]["t"] > samples[0]["t"] else None
        ),
        "log_lines_call_refused": log.count("call refused:"),
        "anomalies": stats.anomalies,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{args.airlock}: {args.workers} workers, {args.era}, {report['seconds']} s: "
          f"{report['requests_per_second']} requests/s, {report['calls_per_second']} tools/call/s")
    for m, l in report["latency_ms"].items():
        print(f"  {m:<28} n={l['n']:<7} p50 {l['p50']:>8} ms  p99 {l['p99']:>8} ms")
    print("answers: " + ", ".join(f"{k} {v}" for k, v in report["outcomes"].items()))
    if faults:
        print("faults: " + ", ".join(f"{what} at {t} s" for what, t in faults))
    for a in stats.anomalies:
        print(f"  at {a['t']} s, {a['method']}: {a['outcome']}: {a['detail']!r}")
    print("  t(s)   RSS(MiB)  fds  threads  store(MiB)  archive(MiB)  answers")
    for s in samples:
        print(f"  {s['t']:>4}   {s['rss'] / 2**20:>8.1f}  {s['fds']:>3}  {s['threads']:>7}  "
              f"{s['store'] / 2**20:>10.2f}  {s['archive'] / 2**20:>12.2f}  {s['answers']:>7}")
    print(f"plateau (within 5 % after warm-up): {report['plateau']}; "
          f"store {report['store_bytes_per_minute']} bytes/min; "
          f"trace {report['trace_bytes_per_call']} bytes per tools/call; "
          f"`call refused` log lines {report['log_lines_call_refused']}")


if __name__ == "__main__":
    main()
