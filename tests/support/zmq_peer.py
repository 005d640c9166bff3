"""A libzmq peer for eventplane's interop tests, driven over stdin/stdout lines.

pub mode: binds a PUB, prints "port N", sends [topic, b"warmup"] on every topic
every 20 ms until stdin says "go", optionally stays quiet (heartbeats still flow),
then sends COUNT messages per topic as [topic, seq u64be, payload] (with --parts P
> 3: P - 2 payload frames, payload frame k built from seq + k) and one
[topic, b"end"] per topic, prints "done", and waits for "exit" or EOF.

sub mode: connects a SUB, subscribes to TOPICS, prints "warm T" the first time a
warmup arrives on T, prints "msg <hex frames>" for every other message (a frame
from an unsubscribed topic prints "LEAK ..."), and exits after COUNT messages.
"""
import argparse
import select
import struct
import sys
import time

import zmq


def payload(seq, size):
    return bytes((seq + i) % 251 for i in range(size))


def stdin_line(timeout):
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    if not ready:
        return None
    line = sys.stdin.readline()
    return line.strip() if line else "EOF"


def run_pub(args):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 2000)
    if args.heartbeat_ivl:
        sock.setsockopt(zmq.HEARTBEAT_IVL, args.heartbeat_ivl)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, args.heartbeat_timeout)
        sock.setsockopt(zmq.HEARTBEAT_TTL, args.heartbeat_ttl)
    if args.port:
        sock.bind("tcp://127.0.0.1:%d" % args.port)
        port = args.port
    else:
        port = sock.bind_to_random_port("tcp://127.0.0.1")
    print("port %d" % port, flush=True)
    topics = [t.encode() for t in args.topics.split(",")]
    while True:
        for t in topics:
            sock.send_multipart([t, b"warmup"])
        line = stdin_line(0.02)
        if line == "go":
            break
        if line == "EOF":
            return
    if args.quiet_ms:
        time.sleep(args.quiet_ms / 1000.0)
    seq = 0
    while args.count < 0 or seq < args.count:
        for t in topics:
            frames = [t, struct.pack(">Q", seq)]
            frames += [payload(seq + k, args.size) for k in range(max(args.parts - 2, 1))]
            sock.send_multipart(frames)
        seq += 1
        if args.count < 0 and seq % 100 == 0:
            time.sleep(0.001)
    for t in topics:
        sock.send_multipart([t, b"end"])
    print("done", flush=True)
    while stdin_line(1.0) not in ("exit", "EOF"):
        pass
    sock.close()
    ctx.term()


def run_sub(args):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 0)
    topics = [t.encode() for t in args.topics.split(",")]
    for t in topics:
        sock.setsockopt(zmq.SUBSCRIBE, t)
    sock.connect(args.endpoint)
    warm = set()
    got = 0
    while got < args.count:
        frames = sock.recv_multipart()
        hexed = " ".join(f.hex() if f else "-" for f in frames)
        if not any(frames[0].startswith(t) for t in topics):
            print("LEAK " + hexed, flush=True)
            continue
        if len(frames) == 2 and frames[1] == b"warmup":
            if frames[0] not in warm:
                warm.add(frames[0])
                print("warm " + frames[0].decode(), flush=True)
            continue
        print("msg " + hexed, flush=True)
        got += 1
    print("done", flush=True)
    sock.close(linger=0)
    ctx.term()


def run_kvpub(args):
    """An engine: waits for a subscription (XPUB), then publishes each --file as
    [topic, seq u64be, payload] with the --seqs given, prints "done", waits for exit."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.LINGER, 2000)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print("port %d" % port, flush=True)
    sub = sock.recv()
    assert sub[:1] == b"\x01", sub
    seqs = [int(s) for s in args.seqs.split(",")]
    for path, seq in zip(args.files.split(","), seqs):
        with open(path, "rb") as f:
            payload = f.read()
        sock.send_multipart([args.topics.encode(), struct.pack(">Q", seq), payload])
    print("done", flush=True)
    while stdin_line(1.0) not in ("exit", "EOF"):
        pass
    sock.close()
    ctx.term()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["pub", "sub", "kvpub"])
    p.add_argument("--topics", required=True)
    p.add_argument("--count", type=int, default=10)
    p.add_argument("--size", type=int, default=16)
    p.add_argument("--parts", type=int, default=3)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--endpoint")
    p.add_argument("--heartbeat-ivl", type=int, default=0)
    p.add_argument("--heartbeat-timeout", type=int, default=300)
    p.add_argument("--heartbeat-ttl", type=int, default=2000)
    p.add_argument("--quiet-ms", type=int, default=0)
    p.add_argument("--files", default="")
    p.add_argument("--seqs", default="")
    args = p.parse_args()
    if args.mode == "kvpub":
        run_kvpub(args)
    elif args.mode == "pub":
        run_pub(args)
    else:
        run_sub(args)


if __name__ == "__main__":
    main()
