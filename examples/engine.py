#!/usr/bin/env python3
"""An inference engine's KV-event publisher, as vLLM publishes them: a ZMQ PUB sending
[topic, seq u64be, msgpack batch] — what `kv_listen`, `kv_relay` and
`eventplane::kv::EngineListener` read. Copy it to feed a worker without an engine.

The batch is [ts, events, dp_rank] (vLLM's KVEventBatch as an array); each event a
tagged array in vLLM's field order:

  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
  ["BlockRemoved", block_hashes, medium]
  ["AllBlocksCleared"]

token_ids holds block_size tokens per stored hash. The format, with the map forms of
vLLM >= 0.24 and SGLang, is in the `eventplane::kv` docs ("The engine's format").

Usage:
  engine.py --bind tcp://127.0.0.1:5557 [--topic kv-events] [--block-size 4]
            [--dp-rank 0] [--no-wait]

Prints "bound ENDPOINT", then (unless --no-wait) waits for the first subscriber:
a PUB drops what it sends while nobody subscribes. Then reads commands from stdin,
one a line, and prints "ok SEQ" after each (the sequence number it used):

  [EVENT, ...]        one batch of events as JSON (the tagged arrays above)
  store H [H ...]     one BlockStored of these hashes, chained on the previous
                      store's last hash, with made-up tokens
  root H [H ...]      the same, starting a new chain (no parent)
  remove H [H ...]    one BlockRemoved
  clear               one AllBlocksCleared
  skip                use up a sequence number without sending (a dropped batch)

Needs pyzmq and msgpack (Debian: python3-zmq python3-msgpack).
"""
import argparse
import json
import struct
import sys
import time

import msgpack
import zmq


class Engine:
    """A KV-event PUB with the engine's batch sequence."""

    def __init__(self, endpoint, topic="kv-events", dp_rank=0, wait=True):
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self.seq = 0
        ctx = zmq.Context.instance()
        # XPUB: a PUB that also hands us the subscriptions, to wait for the first.
        self.sock = ctx.socket(zmq.XPUB if wait else zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.waiting = wait

    def wait_for_subscriber(self):
        while self.waiting:
            if self.sock.recv()[:1] == b"\x01":  # 0x01 + topic: a subscription
                self.waiting = False

    def publish(self, events):
        """Sends one batch [ts, events, dp_rank] with the next sequence number."""
        batch = msgpack.packb([time.time(), events, self.dp_rank])
        self.sock.send_multipart([self.topic, struct.pack(">Q", self.seq), batch])
        self.seq += 1
        return self.seq - 1

    def skip(self):
        """A batch the subscriber never gets (what a PUB's high-water mark drops)."""
        self.seq += 1
        return self.seq - 1


def stored(hashes, parent, block_size, medium=None):
    tokens = [h % 50000 for h in hashes for _ in range(block_size)]
    return ["BlockStored", hashes, parent, tokens, block_size, None, medium, None]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bind", required=True, help="tcp://host:port (port 0: any)")
    p.add_argument("--topic", default="kv-events")
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--no-wait", action="store_true", help="publish without waiting for a subscriber")
    args = p.parse_args()
    engine = Engine(args.bind, args.topic, args.dp_rank, wait=not args.no_wait)
    print("bound", engine.endpoint, flush=True)
    engine.wait_for_subscriber()
    parent = None
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if line.lstrip().startswith("["):
            seq = engine.publish(json.loads(line))
        elif words[0] in ("store", "root"):
            hashes = [int(h) for h in words[1:]]
            after = parent if words[0] == "store" else None
            seq = engine.publish([stored(hashes, after, args.block_size)])
            parent = hashes[-1]
        elif words[0] == "remove":
            seq = engine.publish([["BlockRemoved", [int(h) for h in words[1:]], None]])
        elif words[0] == "clear":
            seq = engine.publish([["AllBlocksCleared"]])
            parent = None
        elif words[0] == "skip":
            seq = engine.skip()
        else:
            print("unknown command:", line.strip(), file=sys.stderr, flush=True)
            continue
        print("ok", seq, flush=True)


if __name__ == "__main__":
    main()
