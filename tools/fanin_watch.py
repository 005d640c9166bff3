#!/usr/bin/env python3
"""Fan-in as a user runs it: N real libzmq publishers (Debian's python3-zmq, spread
over processes of 2,048 so each stays under its descriptor limit) followed by the
`watch` CLI with `--static` endpoints.

    tools/fanin_watch.py [--publishers N] [--watch PATH]

Builds nothing: pass the `watch` binary (default target/release/examples/watch, from
`cargo build --release --example watch`). Every 250 ms each publisher sends one
message [kvev, seq, 100 bytes] until `watch` has printed a delivery from every one of
them; then they go quiet, and after a second the script reads `watch`'s RSS and open
descriptors from /proc. With FANIN_PROGRESS=1 in the environment it also prints, on
stderr, how many publishers have been seen every 250 ms. Prints one line:

    fanin_watch: N publishers, all seen in S s, RSS R MiB (K KiB per publisher), fds F (publishers + E)
"""

import argparse
import os
import pathlib
import resource
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
FLEET = ROOT / "tests" / "support" / "zmq_fleet.py"
PER_PROCESS = 2048


def status_kib(pid, key):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(key):
            return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--publishers", type=int, default=16384)
    ap.add_argument("--watch", default=str(ROOT / "target/release/examples/watch"))
    args = ap.parse_args()
    n = args.publishers
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    fleets, endpoints = [], []
    left = n
    while left > 0:
        k = min(left, PER_PROCESS)
        left -= k
        p = subprocess.Popen(["/usr/bin/python3", str(FLEET), str(k)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        for line in p.stdout:
            line = line.strip()
            if line == "END":
                break
            endpoints.append(line)
        fleets.append(p)
    assert len(endpoints) == n, f"{len(endpoints)} of {n} publishers bound"
    watch = subprocess.Popen(
        [args.watch, "--namespace", "fanin", "--topic", "kvev", "--layout", "topic-seq",
         "--max-publishers", str(n), "--static", *endpoints],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1 << 16)
    seen = set()
    drained = threading.Event()

    def read_watch():
        for line in watch.stdout:
            seen.add(line.split(" ", 1)[0])
        drained.set()

    def drain(stream):
        for _ in stream:
            pass

    threading.Thread(target=read_watch, daemon=True).start()
    for f in fleets:
        threading.Thread(target=drain, args=(f.stdout,), daemon=True).start()
    start = time.monotonic()
    while len(seen) < n:
        if time.monotonic() - start > 120:
            sys.exit(f"fanin_watch: only {len(seen)} of {n} publishers seen in 120 s")
        if watch.poll() is not None:
            sys.exit(f"fanin_watch: watch exited with {watch.returncode}")
        # One message per publisher per round: a round lost to a subscription not yet
        # in place is made up by the next.
        for f in fleets:
            f.stdin.write("send kvev 1\n")
            f.stdin.flush()
        until = time.monotonic() + 0.25
        if os.environ.get("FANIN_PROGRESS"):
            print(f"{time.monotonic() - start:.2f} s: {len(seen)} seen", file=sys.stderr)
        while len(seen) < n and time.monotonic() < until:
            time.sleep(0.005)
    took = time.monotonic() - start
    time.sleep(1.0)
    rss = status_kib(watch.pid, "VmRSS:")
    fds = len(os.listdir(f"/proc/{watch.pid}/fd"))
    print(f"fanin_watch: {n} publishers, all seen in {took:.2f} s, RSS {rss / 1024:.0f} MiB "
          f"({rss / n:.1f} KiB per publisher), fds {fds} (publishers + {fds - n})")
    watch.terminate()
    watch.wait()
    for f in fleets:
        f.stdin.close()
        f.wait()


if __name__ == "__main__":
    main()
