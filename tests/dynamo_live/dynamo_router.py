#!/usr/bin/env python3
"""A real Dynamo 1.6.1 KV router following a component's KV events (interop tests).

Runs ai-dynamo-runtime==1.6.1's own KvRouter (etcd discovery, ZMQ event plane,
no NATS) on NAMESPACE.COMPONENT.ENDPOINT. The router finds publishers through
etcd (v1/event_channels + v1/event_sources), subscribes to their ZMQ PUBs,
decodes Dynamo's frames and applies the router events to its radix-tree
indexer. This script samples that indexer and prints what changed.

Admission: Dynamo's router only indexes a worker's events when the worker is
also a *serving member* of the endpoint: an instance record (v1/instances/...)
and a model card (v1/mdc/...) whose instance_id is the events' worker_id. A
publisher-only worker (like the capture's, or a relay writing only
event_channels/event_sources) is ignored. So for each id given with --admit
(default 77) this script writes those two records itself, under its own etcd
lease, and revokes the lease on exit; the router is otherwise untouched. Use
--admit none when the workers register themselves (register_model).

Usage:
  dynamo_router.py [--etcd URL] [--namespace NS] [--component C]
                   [--endpoint E] [--block-size N] [--admit ID[:DP],...|none]
                   [--probe TOKENS]... [--poll SECS] [--no-index] [--timeout SECS]
                   [--no-stdin]
  (env fallbacks: ETCD_ENDPOINTS, DYN_NAMESPACE, DYN_COMPONENT, DYN_ENDPOINT,
   DYN_KV_BLOCK_SIZE, DYN_ADMIT_WORKERS; defaults capns/kvworker/generate, 4, 77)

stdout, one line each:
  ready                       router built, admission records written (always
                              the first line; the others may come in any order)
  {"kind":"source_live","worker_id":77,"dp_rank":0,"publisher_id":N}
        the router activated a publisher (its SUB is connected); taken from
        Dynamo's own WARN log line "KV source is live-only", best effort
  {"kind":"indexer_warning","target":T,"message":M}
        a WARN/ERROR line of Dynamo's indexer (e.g. "Failed to apply event:
        Some(ParentBlockNotFound)"), best effort likewise
  {"kind":"index","t":secs,"added":[B...],"removed":[B...],"counts":{...},
   "probes":[...]}            the indexer changed (sampled every --poll s, so
        changes closer together than that arrive merged). B is
        {"worker_id","dp_rank","tier","block_hash","parent_hash","tokens_hash"}
        (tier: device|host_pinned|disk|...), counts is
        {"<worker>:<dp>": {"<tier>": n}}, probes the overlap rows of each
        --probe sequence (see below)
  {"kind":"overlap","tokens":[...],"workers":[...]}   answer to a stdin query
  {"kind":"state","blocks":[B...],"counts":{...}}     answer to "dump"
  bye
stdin, one command a line: a JSON list of token ids (overlap query, through
  KvRouter.get_overlap_scores: per-worker device/host/disk matched blocks),
  or "dump". EOF, SIGTERM or SIGINT (or --timeout) ends the script cleanly;
  with --no-stdin, stdin is not read (use it under `< /dev/null` or `&`).
Dynamo's logs go to stderr (DYN_LOG=warn quietens them but keeps source_live).
"""
import argparse
import asyncio
import base64
import json
import os
import re
import signal
import sys
import threading
import time
import urllib.request


def parse_args():
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--etcd", default=env("ETCD_ENDPOINTS", "http://127.0.0.1:2379"))
    p.add_argument("--discovery", choices=["etcd", "kubernetes"], default="etcd",
                   help="kubernetes: Dynamo's kube discovery (the API server from "
                        "KUBECONFIG, the pod from POD_NAME/POD_UID/POD_NAMESPACE); "
                        "admission is then the caller's (--admit none)")
    p.add_argument("--namespace", default=env("DYN_NAMESPACE", "capns"))
    p.add_argument("--component", default=env("DYN_COMPONENT", "kvworker"))
    p.add_argument("--endpoint", default=env("DYN_ENDPOINT", "generate"))
    p.add_argument("--block-size", type=int, default=int(env("DYN_KV_BLOCK_SIZE", "4")))
    p.add_argument("--admit", default=env("DYN_ADMIT_WORKERS", "77"),
                   help="worker ids to admit as serving members: ID[:DP_SIZE],... or none")
    p.add_argument("--probe", action="append", default=[],
                   help="comma-separated token ids; overlap printed with each change")
    p.add_argument("--poll", type=float, default=0.05)
    p.add_argument("--no-index", action="store_true",
                   help="print no index lines (a big index sampled every --poll s costs "
                        "a core); commands are still answered")
    p.add_argument("--timeout", type=float, default=0, help="exit after SECS (0: never)")
    p.add_argument("--no-stdin", action="store_true",
                   help="ignore stdin (end only by signal or --timeout)")
    return p.parse_args()


class Etcd:
    """Tiny client for etcd's v3 JSON gateway (no extra packages)."""

    def __init__(self, url):
        url = url.split(",")[0].strip().rstrip("/")
        self.url = url if "://" in url else "http://" + url

    def call(self, path, body):
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.load(r)

    def grant(self, ttl):
        return self.call("/v3/lease/grant", {"TTL": ttl})["ID"]

    def put(self, key, value, lease):
        b64 = lambda s: base64.b64encode(s.encode()).decode()
        self.call("/v3/kv/put", {"key": b64(key), "value": b64(value), "lease": lease})

    def keepalive(self, lease):
        self.call("/v3/lease/keepalive", {"ID": lease})

    def revoke(self, lease):
        self.call("/v3/lease/revoke", {"ID": lease})


def admit(etcd, args, stop_flag):
    """Write an instance record and a model card per admitted worker, as
    serve_endpoint + register_model would; all under one lease, kept alive by
    a daemon thread. (In 1.6.1 the card alone is enough for admission; its
    runtime_config.data_parallel_size gives the worker's dp ranks.)"""
    if args.admit.strip().lower() in ("", "none"):
        return None
    ns, comp, ep = args.namespace, args.component, args.endpoint
    lease = etcd.grant(10)
    for item in args.admit.split(","):
        wid, _, dp = item.strip().partition(":")
        wid, dp_size = int(wid), int(dp or 1)
        hexid = format(wid, "x")
        instance = {"type": "Endpoint", "component": comp, "endpoint": ep, "namespace": ns,
                    "instance_id": wid,
                    # never dialled: this script sends no requests
                    "transport": {"tcp": f"127.0.0.1:9/{hexid}/{ns}/{comp}/{ep}"},
                    "device_type": "cuda", "request_plane_codec": "msgpack"}
        card = {"type": "Model", "namespace": ns, "component": comp, "endpoint": ep,
                "instance_id": wid,
                "card_json": {"display_name": "eventplane-probe", "slug": "eventplane-probe",
                              "model_info": None, "tokenizer": None, "context_length": 0,
                              "kv_cache_block_size": args.block_size, "migration_limit": 0,
                              "model_type": "Chat", "model_input": "Tokens",
                              "worker_type": "aggregated", "needs": [],
                              "runtime_config": {"data_parallel_start_rank": 0,
                                                 "data_parallel_size": dp_size,
                                                 "enable_local_indexer": False,
                                                 "enable_eagle": False},
                              "media_decoder": None, "media_fetcher": None}}
        etcd.put(f"v1/instances/{ns}/{comp}/{ep}/{hexid}", json.dumps(instance), lease)
        etcd.put(f"v1/mdc/{ns}/{comp}/{ep}/{hexid}", json.dumps(card), lease)

    def keep():
        while not stop_flag.wait(3):
            try:
                etcd.keepalive(lease)
            except Exception as e:  # etcd gone: nothing left to keep
                print(f"lease keepalive failed: {e}", file=sys.stderr)
    threading.Thread(target=keep, daemon=True).start()
    return lease


LIVE = re.compile(r"KV source is live-only.*?worker_id=(\d+) dp_rank=(\d+) publisher_id=(\d+)")
# e.g. "WARN dynamo_kv_router::indexer::...: Failed to apply event: Some(ParentBlockNotFound)"
WARN = re.compile(r"\b(WARN|ERROR)\s+(\S*indexer\S*?):\s(.*)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def tee_stderr(on_line):
    """Route fd 2 (where the Rust runtime logs) through a pipe: forward every
    line to the real stderr and hand it to on_line. Must run before import."""
    real = os.dup(2)
    r, w = os.pipe()
    os.dup2(w, 2)
    os.close(w)
    sys.stderr = os.fdopen(os.dup(real), "w", buffering=1)

    def pump():
        with os.fdopen(r, "rb") as pipe:
            for raw in pipe:
                os.write(real, raw)
                on_line(ANSI.sub("", raw.decode("utf-8", "replace")))
    threading.Thread(target=pump, daemon=True).start()


def say(obj):
    print(obj if isinstance(obj, str) else json.dumps(obj), flush=True)


def flatten(dump_json):
    """KvRouter.dump_events() (chains of stored blocks) -> set of blocks."""
    out = set()
    for ev in json.loads(dump_json):
        stored = ev["event"]["data"].get("stored") if isinstance(ev["event"]["data"], dict) else None
        if not stored:
            continue
        parent = stored.get("parent_hash")
        for b in stored["blocks"]:
            out.add((ev["worker_id"], ev["event"].get("dp_rank", 0), ev.get("storage_tier", "device"),
                     b["block_hash"], parent, b["tokens_hash"]))
            parent = b["block_hash"]
    return out


def as_dicts(blocks):
    keys = ("worker_id", "dp_rank", "tier", "block_hash", "parent_hash", "tokens_hash")
    return [dict(zip(keys, b)) for b in sorted(blocks, key=lambda b: tuple(str(x) for x in b))]


def counts(blocks):
    c = {}
    for w, dp, tier, *_ in blocks:
        d = c.setdefault(f"{w}:{dp}", {})
        d[tier] = d.get(tier, 0) + 1
    return c


async def main():
    args = parse_args()
    os.environ["ETCD_ENDPOINTS"] = args.etcd
    for k, v in {"DYN_DISCOVERY_BACKEND": args.discovery, "DYN_EVENT_PLANE": "zmq",
                 "DYN_REQUEST_PLANE": "tcp", "DYN_LOG": "info",
                 "ETCD_STARTUP_CONNECT_TIMEOUT_SECONDS": "10"}.items():  # default 120
        os.environ.setdefault(k, v)

    loop = asyncio.get_running_loop()

    # Lines scraped from Dynamo's log; held back until "ready" has been printed.
    held, held_lock = [], threading.Lock()

    def emit(obj):
        with held_lock:
            if held is not None:
                held.append(obj)
                return
        say(obj)

    def on_log(line):
        m = LIVE.search(line)
        if m:
            w, dp, pid = map(int, m.groups())
            emit({"kind": "source_live", "worker_id": w, "dp_rank": dp, "publisher_id": pid})
            return
        m = WARN.search(line)
        if m:
            emit({"kind": "indexer_warning", "target": m.group(2), "message": m.group(3).strip()})
    tee_stderr(on_log)

    from dynamo.llm import KvRouter, KvRouterConfig
    from dynamo.runtime import DistributedRuntime

    etcd = Etcd(args.etcd)
    keep_stop = threading.Event()
    lease = admit(etcd, args, keep_stop)

    # Blocks until etcd answers (ETCD_STARTUP_CONNECT_TIMEOUT_SECONDS); signals
    # keep their default action until it returns.
    runtime = DistributedRuntime(loop, args.discovery, "tcp", event_plane="zmq")
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    endpoint = runtime.endpoint(f"{args.namespace}.{args.component}.{args.endpoint}")
    router = KvRouter(endpoint, args.block_size, KvRouterConfig(use_kv_events=True))
    probes = [[int(t) for t in p.split(",") if t.strip()] for p in args.probe]
    with held_lock:
        say("ready")
        for obj in held:
            say(obj)
        held = None

    queue = asyncio.Queue()

    def read_stdin():
        for line in sys.stdin:
            loop.call_soon_threadsafe(queue.put_nowait, line)
        loop.call_soon_threadsafe(queue.put_nowait, None)
    if not args.no_stdin:
        threading.Thread(target=read_stdin, daemon=True).start()

    async def overlap(tokens):
        return (await router.get_overlap_scores(tokens))["workers"]

    t0 = time.monotonic()
    deadline = t0 + args.timeout if args.timeout > 0 else None
    seen = set()
    while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
        # commands first
        eof = False
        while not queue.empty():
            line = queue.get_nowait()
            if line is None:
                eof = True
                break
            line = line.strip()
            if not line:
                continue
            try:
                if line == "dump":
                    blocks = flatten(await router.dump_events())
                    say({"kind": "state", "blocks": as_dicts(blocks), "counts": counts(blocks)})
                else:
                    tokens = [int(t) for t in json.loads(line)]
                    say({"kind": "overlap", "tokens": tokens, "workers": await overlap(tokens)})
            except Exception as e:
                print(f"bad command {line[:200]!r}: {e}", file=sys.stderr)
        if eof:
            break
        # then the indexer
        now = seen if args.no_index else flatten(await router.dump_events())
        if now != seen:
            say({"kind": "index", "t": round(time.monotonic() - t0, 3),
                 "added": as_dicts(now - seen), "removed": as_dicts(seen - now),
                 "counts": counts(now),
                 "probes": [{"tokens": p, "workers": await overlap(p)} for p in probes]})
            seen = now
        try:
            await asyncio.wait_for(stop.wait(), args.poll)
        except asyncio.TimeoutError:
            pass

    keep_stop.set()
    if lease is not None:
        try:
            etcd.revoke(lease)  # deletes the admission records
        except Exception as e:
            print(f"lease revoke failed: {e}", file=sys.stderr)
    runtime.shutdown()
    await asyncio.sleep(0.3)
    say("bye")
    return 0


if __name__ == "__main__":
    rc = asyncio.run(main())
    sys.stdout.flush()
    os._exit(rc)  # skip the runtime's native-thread teardown: never hang on exit
