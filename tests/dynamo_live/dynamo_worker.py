#!/usr/bin/env python3
"""A real Dynamo 1.6.1 KV-event worker, for interop tests (tests/dynamo_etcd/live.rs).

Runs the PyPI package ai-dynamo-runtime==1.6.1 exactly as the capture in
shared/fixtures/dynamo-1.6.1/capture.json describes: a DistributedRuntime with
etcd discovery and the ZMQ event plane (no NATS), and a KvEventPublisher
(kv_block_size 4, worker_id 77 by default) in relay mode, fed by a vLLM-style
engine that this script plays itself: it binds a ZMQ socket on 127.0.0.1 and
sends vLLM's KVEventBatch frames [topic, seq (u64 BE), msgpack([ts, events,
dp_rank])], which Dynamo's relay subscribes to, converts and republishes on
its own event-plane PUB (registered in etcd under v1/event_channels and
v1/event_sources).

Usage:
  dynamo_worker.py [--etcd URL | --discovery kubernetes] [--namespace NS] [--component C]
                   [--endpoint E] [--worker-id N] [--block-size N]
                   [--dp-rank N] [--batches FILE]
                   [--engine-endpoint EP [--engine-topic T]] [--local-indexer]
  (env fallbacks: ETCD_ENDPOINTS, DYN_NAMESPACE, DYN_COMPONENT, DYN_ENDPOINT,
   DYN_WORKER_ID, DYN_KV_BLOCK_SIZE; defaults capns/kvworker/generate, 77, 4)

Protocol:
  stdout: "ready" once registered in etcd and the relay is subscribed to the
          engine socket; then one JSON line {"batch": seq, "events": n} per
          engine batch handed to the relay; "bye" on exit.
  stdin:  one engine batch per line, as a JSON list of vLLM events, e.g.
          [["BlockStored",[101,102],null,[1,2,3,4,5,6,7,8],4,null,"GPU",null]]
          [["BlockRemoved",[103],"GPU"]]   [["AllBlocksCleared"]]
          Blank lines are ignored; a bad line is reported on stderr, skipped.
  --batches FILE: first publish a JSON list of batches (or a capture.json, whose
          "engine_script" is used), 0.2 s apart, then read stdin as above.
  EOF on stdin, SIGTERM or SIGINT: shut the publisher and runtime down, which
  deletes the worker's etcd records (and revokes its lease), then exit 0.
Dynamo's own logs go to stderr (DYN_LOG=warn quietens them).
"""
import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time


def parse_args():
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--etcd", default=env("ETCD_ENDPOINTS", "http://127.0.0.1:2379"))
    p.add_argument("--discovery", choices=["etcd", "kubernetes"], default="etcd",
                   help="kubernetes: Dynamo's kube discovery (the API server from "
                        "KUBECONFIG, the pod from POD_NAME/POD_UID/POD_NAMESPACE)")
    p.add_argument("--namespace", default=env("DYN_NAMESPACE", "capns"))
    p.add_argument("--component", default=env("DYN_COMPONENT", "kvworker"))
    p.add_argument("--endpoint", default=env("DYN_ENDPOINT", "generate"))
    p.add_argument("--worker-id", type=int, default=int(env("DYN_WORKER_ID", "77")))
    p.add_argument("--block-size", type=int, default=int(env("DYN_KV_BLOCK_SIZE", "4")))
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--batches", help="JSON list of engine batches, or a capture.json")
    p.add_argument("--ready-timeout", type=float, default=30.0)
    p.add_argument("--engine-endpoint",
                   help="relay the engine PUB at this endpoint (tcp://host:port) instead "
                        "of playing the engine; stdin is then only read for EOF")
    p.add_argument("--local-indexer", action="store_true",
                   help="run Dynamo's worker-local KV indexer: the worker's event_sources "
                        "record then carries a recovery_target, and routers repair from it")
    p.add_argument("--engine-topic", default="",
                   help="with --engine-endpoint: the engine's topic (default: all)")
    return p.parse_args()


def configure_env(args):
    # Read by the Rust runtime when the DistributedRuntime is built. Only set
    # what the caller has not set, so it can override (e.g. the advertised host).
    os.environ["ETCD_ENDPOINTS"] = args.etcd
    for k, v in {
        "DYN_DISCOVERY_BACKEND": args.discovery,
        "DYN_EVENT_PLANE": "zmq",  # no NATS anywhere
        "DYN_REQUEST_PLANE": "tcp",
        # Host written into the EventChannel record (default: a non-loopback
        # address of this machine); the capture advertised 127.0.0.1.
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        "DYN_LOG": "info",
        "ETCD_STARTUP_CONNECT_TIMEOUT_SECONDS": "10",  # Dynamo's default: 120
    }.items():
        os.environ.setdefault(k, v)


def stdin_lines(loop, queue):
    """Feed stdin lines into an asyncio queue from a daemon thread (works for
    pipes, files and ttys; a daemon thread never blocks exit). None = EOF."""

    def run():
        for line in sys.stdin:
            loop.call_soon_threadsafe(queue.put_nowait, line)
        loop.call_soon_threadsafe(queue.put_nowait, None)

    threading.Thread(target=run, daemon=True).start()


def say(obj):
    print(obj if isinstance(obj, str) else json.dumps(obj), flush=True)


async def main():
    args = parse_args()
    configure_env(args)
    import msgpack
    import zmq
    from dynamo.llm import KvEventPublisher
    from dynamo.runtime import DistributedRuntime

    loop = asyncio.get_running_loop()
    # Blocks until etcd answers (ETCD_STARTUP_CONNECT_TIMEOUT_SECONDS); signals
    # keep their default action until it returns.
    runtime = DistributedRuntime(loop, args.discovery, "tcp", event_plane="zmq")
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    endpoint = runtime.endpoint(f"{args.namespace}.{args.component}.{args.endpoint}")

    if args.engine_endpoint:
        # Someone else plays the engine (a benchmark): relay it, wait for EOF.
        publisher = KvEventPublisher(
            endpoint,
            worker_id=args.worker_id,
            kv_block_size=args.block_size,
            dp_rank=args.dp_rank,
            enable_local_indexer=args.local_indexer,
            zmq_endpoint=args.engine_endpoint,
            zmq_topic=args.engine_topic,
        )
        say("ready")
        queue = asyncio.Queue()
        stdin_lines(loop, queue)
        get = asyncio.ensure_future(queue.get())
        halt = asyncio.ensure_future(stop.wait())
        await asyncio.wait({get, halt}, return_when=asyncio.FIRST_COMPLETED)
        publisher.shutdown()
        runtime.shutdown()
        await asyncio.sleep(0.5)
        say("bye")
        return 0

    # The "engine": an XPUB (wire-compatible with vLLM's PUB) so that we see
    # the relay's subscription arrive and never send into the void.
    ctx = zmq.Context()
    engine = ctx.socket(zmq.XPUB)
    engine.setsockopt(zmq.LINGER, 0)
    port = engine.bind_to_random_port("tcp://127.0.0.1")

    publisher = KvEventPublisher(
        endpoint,
        worker_id=args.worker_id,
        kv_block_size=args.block_size,
        dp_rank=args.dp_rank,
        enable_local_indexer=args.local_indexer,
        zmq_endpoint=f"tcp://127.0.0.1:{port}",
        zmq_topic="",
    )
    # The constructor registers the etcd records before returning; wait for the
    # relay's SUB to subscribe (first byte 1 = subscribe).
    deadline = time.monotonic() + args.ready_timeout
    while True:
        if engine.poll(100) and engine.recv()[:1] == b"\x01":
            break
        if time.monotonic() > deadline or stop.is_set():
            print("relay never subscribed to the engine socket", file=sys.stderr)
            publisher.shutdown()
            runtime.shutdown()
            return 1
        await asyncio.sleep(0)
    say("ready")

    seq = 0

    def send(batch):
        nonlocal seq
        if not isinstance(batch, list) or not all(isinstance(e, list) for e in batch):
            raise ValueError("a batch is a JSON list of event lists")
        # vLLM KVEventBatch (msgspec array_like): [ts, events, data_parallel_rank]
        payload = msgpack.packb([time.time(), batch, args.dp_rank])
        engine.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        say({"batch": seq, "events": len(batch)})
        seq += 1

    if args.batches:
        with open(args.batches) as f:
            doc = json.load(f)
        for batch in doc["engine_script"] if isinstance(doc, dict) else doc:
            send(batch)
            await asyncio.sleep(0.2)

    queue = asyncio.Queue()
    stdin_lines(loop, queue)
    while not stop.is_set():
        get = asyncio.ensure_future(queue.get())
        halt = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({get, halt}, return_when=asyncio.FIRST_COMPLETED)
        halt.cancel()
        if get not in done:
            get.cancel()
            break
        line = get.result()
        if line is None:  # EOF
            break
        if line.strip():
            try:
                send(json.loads(line))
            except (ValueError, TypeError) as e:
                print(f"bad batch line: {e}: {line.strip()[:200]}", file=sys.stderr)

    # Let the relay forward what was just sent, then tear down: shutdown()
    # unregisters the event channel/source from etcd.
    await asyncio.sleep(0.3)
    publisher.shutdown()
    runtime.shutdown()
    await asyncio.sleep(0.5)
    engine.close()
    ctx.term()
    say("bye")
    return 0


if __name__ == "__main__":
    rc = asyncio.run(main())
    # Records and lease are gone by now; skip interpreter teardown of the
    # runtime's native threads so that exit can never hang.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
