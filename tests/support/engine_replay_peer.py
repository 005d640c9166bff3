"""An engine's own KV-event publisher, unmodified, for tests/kv_engine_replay.rs.

    python engine_replay_peer.py MODULE FLAVOR TOPIC BLOCK_SIZE PUB_PORT REPLAY_PORT

MODULE is the engine's kv_events.py as its release ships it (tools/engine_sources.py
fetches vLLM's and SGLang's); FLAVOR is `vllm` or `sglang`. The module's imports of the
rest of the engine (its config class, logger, network helpers) are satisfied by small
stand-ins; its publisher, its replay ROUTER and its events are the engine's own code.
Needs pyzmq, msgspec (and pydantic for SGLang): the Dynamo virtualenv .ci/run makes.

Commands on stdin, one per line, each answered on stdout:
  burst N        publish N batches of stored and removed blocks -> "ok LAST_SEQ"
                 (once the publisher thread has sent them all)
  clear          publish AllBlocksCleared (the engine reset its cache) -> "ok LAST_SEQ"
  remove N       publish one batch removing the N newest blocks (children first) ->
                 "ok LAST_SEQ" (the count then differs from what bursts settle at, so a
                 router holding that count has applied this batch)
  restart        shut the publisher down and start a new one on the same ports (a new
                 engine: its sequence starts at 0 and it holds nothing) -> "ok"
  truth          -> "truth H H ..." the block hashes the engine holds now
  evict chains   from now on, evict whole batches past the pinned blocks (the oldest
                 first, each batch's blocks children before parents), so that no held
                 block is ever under an evicted one (a router that drops what sits under
                 a removed block, as Dynamo's does, can then equal the engine) -> "ok"
  quit
Prints "ready" once the first publisher is bound.
"""
import importlib.util
import logging
import random
import sys
import time
import types

MODULE, FLAVOR, TOPIC, BLOCK_SIZE, PUB_PORT, REPLAY_PORT = sys.argv[1:7]
BLOCK_SIZE = int(BLOCK_SIZE)


def stand_in(name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        if parent not in sys.modules:
            stand_in(parent)
        setattr(sys.modules[parent], child, module)
    return module


class Config:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


if FLAVOR == "vllm":
    stand_in("vllm.config.kv_events", KVEventsConfig=Config)
    stand_in("vllm.logger", init_logger=logging.getLogger)
    stand_in(
        "vllm.utils.network_utils",
        get_ip=lambda: "127.0.0.1",
        get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
        is_valid_ipv6_address=lambda ip: ":" in ip,
        split_zmq_path=lambda p: tuple(p.replace("tcp://", "tcp:").split(":")),
    )
    stand_in("vllm.v1.core.kv_cache_utils", ExternalBlockHash=int)
else:
    stand_in("sglang.srt.runtime_context", get_parallel=lambda: None)
    stand_in("sglang.srt.utils.network", NetworkAddress=object)

spec = importlib.util.spec_from_file_location("engine_kv_events", MODULE)
kv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kv)


def publisher():
    if FLAVOR == "vllm":
        return kv.ZmqEventPublisher(
            0,
            endpoint=f"tcp://*:{PUB_PORT}",
            replay_endpoint=f"tcp://*:{REPLAY_PORT}",
            hwm=1,
            topic=TOPIC,
        )
    return kv.ZmqEventPublisher(
        0,
        endpoint=f"tcp://127.0.0.1:{PUB_PORT}",
        replay_endpoint=f"tcp://127.0.0.1:{REPLAY_PORT}",
        hwm=1,
        topic=TOPIC,
        bind=True,
    )


def start():
    # The previous engine's ports are released by libzmq's I/O thread: retry briefly.
    deadline = time.time() + 10
    while True:
        try:
            return publisher()
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(0.05)


def event_kwargs(cls, given):
    """Every field the engine's struct has: the given ones, None for the others
    without a default."""
    names = cls.__struct_fields__
    defaults = len(cls.__struct_defaults__)
    required = names[: len(names) - defaults]
    out = {n: None for n in required}
    out.update({k: v for k, v in given.items() if k in names})
    return out


random.seed(7)
pub = start()
held = {}  # the block hashes this engine holds, oldest first (a dict as an ordered set)
MAX_HELD = 4000
PINNED = 500
next_hash = 1 << 40
FIRST = next_hash
seq = -1
evict_chains = False
batches = []  # with evict_chains: each burst batch's new hashes, oldest first
print("ready", flush=True)

for line in sys.stdin:
    words = line.split()
    if not words:
        continue
    if words[0] == "burst":
        for _ in range(int(words[1])):
            events = []
            parent = None
            batch = []
            for _ in range(24):
                n = random.randrange(1, 9)
                hashes = list(range(next_hash, next_hash + n))
                next_hash += n
                given = {
                    "block_hashes": hashes,
                    "parent_block_hash": parent,
                    "token_ids": [(hashes[0] + i) & 0xFFFF for i in range(BLOCK_SIZE * n)],
                    "block_size": BLOCK_SIZE,
                }
                events.append(kv.BlockStored(**event_kwargs(kv.BlockStored, given)))
                held.update(dict.fromkeys(hashes))
                batch.extend(hashes)
                parent = hashes[-1] if random.random() < 0.5 else None
            batches.append(batch)
            if evict_chains and len(held) > MAX_HELD:
                gone = []
                while len(held) - len(gone) > MAX_HELD and len(batches) > 1:
                    old = [h for h in batches.pop(0) if h in held and h >= FIRST + PINNED]
                    gone.extend(reversed(old))
                for h in gone:
                    del held[h]
                if gone:
                    events.append(kv.BlockRemoved(**event_kwargs(kv.BlockRemoved, {"block_hashes": gone})))
            elif len(held) > MAX_HELD:
                # The oldest PINNED blocks stay (a shared prompt prefix): a router that
                # wiped this worker and rebuilt it from later batches misses them.
                gone = list(held)[PINNED : PINNED + len(held) - MAX_HELD]
                for h in gone:
                    del held[h]
                events.append(kv.BlockRemoved(**event_kwargs(kv.BlockRemoved, {"block_hashes": gone})))
            pub.publish(kv.KVEventBatch(ts=time.time(), events=events))
            seq += 1
        pub._event_queue.join()
        print(f"ok {seq}", flush=True)
    elif words[0] == "remove":
        gone = list(held)[-int(words[1]):][::-1]
        for h in gone:
            del held[h]
        pub.publish(kv.KVEventBatch(ts=time.time(), events=[kv.BlockRemoved(**event_kwargs(kv.BlockRemoved, {"block_hashes": gone}))]))
        seq += 1
        pub._event_queue.join()
        print(f"ok {seq}", flush=True)
    elif words[0] == "clear":
        pub.publish(kv.KVEventBatch(ts=time.time(), events=[kv.AllBlocksCleared()]))
        seq += 1
        held = {}
        batches = []
        pub._event_queue.join()
        print(f"ok {seq}", flush=True)
    elif words[0] == "restart":
        pub.shutdown()
        pub = start()
        held = {}
        batches = []
        seq = -1
        print("ok", flush=True)
    elif words[:2] == ["evict", "chains"]:
        evict_chains = True
        print("ok", flush=True)
    elif words[0] == "truth":
        print("truth " + " ".join(str(h) for h in held), flush=True)
    elif words[0] == "quit":
        break
pub.shutdown()
