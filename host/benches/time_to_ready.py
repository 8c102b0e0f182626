#!/usr/bin/env python3
"""Time to ready of `airlock serve`: from spawning it to the answer of the first
`tools/list` that offers the notes capabilities, with three connections (notes, outbox,
documents), all healthy or with `documents` silent (`sleep 1000`: it never answers).

    python3 host/benches/time_to_ready.py [AIRLOCK_BINARY] [ROUNDS]

AIRLOCK_BINARY defaults to target/debug/airlock; the pinned adapters come from the build's
bundle, target/airlock/adapters (the workspace's, whatever CARGO_TARGET_DIR is). Prints p50 / max per setup, in milliseconds.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AIRLOCK = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target/debug/airlock"))
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
BUNDLE = os.path.join(ROOT, "target/airlock/adapters")
FS_SERVER = os.path.join(ROOT, "fixtures/npm/node_modules/@modelcontextprotocol/server-filesystem/dist/index.js")


def config(dir, silent):
    documents = (
        'command = "sleep"\nargs = ["1000"]\n'
        if silent
        else f'command = "node"\nargs = [{json.dumps(FS_SERVER)}, {json.dumps(os.path.join(ROOT, "fixtures/documents"))}]\n'
    )
    text = f"""state_dir = {json.dumps(os.path.join(dir, "state"))}
start_timeout = "30s"
[[connection]]
name = "notes"
command = "@airlock"
args = ["fixture", "notes-server"]
[[connection]]
name = "outbox"
command = "@airlock"
args = ["fixture", "delivery-server", "--outbox", {json.dumps(os.path.join(dir, "outbox"))}]
[[connection]]
name = "documents"
{documents}"""
    for m in ["source-library", "outbox-delivery", "fs-documents"]:
        text += f'[[mapping]]\nmanifest = {json.dumps(os.path.join(dir, m, "mapping.toml"))}\n'
    path = os.path.join(dir, "airlock.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def run(*args):
    subprocess.run([AIRLOCK, *args], check=True, capture_output=True)


def ready_ms(cfg):
    env = dict(os.environ, AIRLOCK_LOG="airlock=warn")
    started = time.monotonic()
    p = subprocess.Popen(
        [AIRLOCK, "serve", "--config", cfg],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )

    def send(msg):
        p.stdin.write((json.dumps(msg) + "\n").encode())
        p.stdin.flush()

    def answer(id):
        while True:
            msg = json.loads(p.stdout.readline())
            if msg.get("id") == id:
                return msg

    send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "time-to-ready", "version": "0"}}})
    answer(1)
    send({"jsonrpc": "2.0", "method": "notifications/initialized"})
    send({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
    names = [t["name"] for t in answer(2)["result"]["tools"]]
    elapsed = (time.monotonic() - started) * 1000
    assert "search_sources" in names, names
    p.stdin.close()
    p.wait(timeout=30)
    return elapsed


def main():
    for silent in [False, True]:
        dir = tempfile.mkdtemp(prefix="airlock-ttr-")
        try:
            for m in ["source-library", "outbox-delivery", "fs-documents"]:
                shutil.copytree(os.path.join(BUNDLE, m), os.path.join(dir, m))
            cfg = config(dir, silent)
            os.environ["AIRLOCK_STATE_DIR"] = os.path.join(dir, "state")
            for c in ["notes", "outbox"]:
                run("discover", c, "--config", cfg)
            for m in ["source-library", "outbox-delivery"]:
                run("review", "approve", m, "--config", cfg, "--reviewer", "bench")
            ready_ms(cfg)  # warm the compiled-component cache
            samples = sorted(ready_ms(cfg) for _ in range(ROUNDS))
            label = "documents silent" if silent else "all healthy"
            print(f"{label:>18}: p50 {samples[len(samples) // 2]:.0f} ms, max {samples[-1]:.0f} ms ({ROUNDS} rounds)")
        finally:
            shutil.rmtree(dir, ignore_errors=True)


if __name__ == "__main__":
    main()
