"""Many libzmq publishers in one process, for eventplane's fan-in tests and benches.

Binds COUNT PUB sockets on 127.0.0.1 (random ports), prints one "tcp://..." line
per socket and then "END". Then reads stdin lines:
- "send TOPIC K": sends K messages [TOPIC, seq u64be, 100 bytes] on every socket and
  prints "sent";
- EOF: exits.

The process raises its own descriptor limit to the hard limit (a socket costs a
listener, a mailbox and the accepted connection: three descriptors). Whether a
subscriber has connected is for the caller to see on its side.
"""
import argparse
import resource
import struct
import sys

import zmq


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("count", type=int)
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, args.count + 64)
    sockets = []
    out = sys.stdout
    for _ in range(args.count):
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        sockets.append(sock)
        out.write(f"tcp://127.0.0.1:{port}\n")
    out.write("END\n")
    out.flush()
    seq = 0
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "send":
            topic, k = words[1].encode(), int(words[2])
            for _ in range(k):
                frame = struct.pack(">Q", seq)
                for sock in sockets:
                    sock.send_multipart([topic, frame, b"\xab" * 100])
                seq += 1
            out.write("sent\n")
            out.flush()
    for sock in sockets:
        sock.close(0)
    ctx.term()


if __name__ == "__main__":
    main()
