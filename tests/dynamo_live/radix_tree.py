"""Dynamo 1.6.1's own KV index (`dynamo._core.RadixTree`), driven line by line.

Reads JSON lines from stdin and answers each with one JSON line on stdout:
  {"op": "event", "worker": W, "event": {"event_id", "dp_rank", "data"}}
      -> {"ok": true} or {"err": "..."} (Dynamo raised; it may have applied part)
  {"op": "query", "hashes": [local block hash, ...]}
      -> {"scores": [[worker, dp_rank, blocks], ...]} (sorted)
  {"op": "remove_worker", "worker": W} -> {"ok": true}
  {"op": "hashes", "tokens": [...], "block_size": N}
      -> {"hashes": compute_block_hash_for_seq(tokens, N)}
Used by tests/router_index_dynamo.rs to hold eventplane's RouterIndex to Dynamo's.
"""
import json
import sys

from dynamo._core import RadixTree, compute_block_hash_for_seq

tree = RadixTree()
out = sys.stdout
for line in sys.stdin:
    req = json.loads(line)
    op = req["op"]
    try:
        if op == "event":
            tree.apply_event(req["worker"], json.dumps(req["event"]).encode())
            answer = {"ok": True}
        elif op == "query":
            scores = tree.find_matches(req["hashes"], False).scores
            answer = {"scores": sorted([w, r, n] for (w, r), n in scores.items())}
        elif op == "remove_worker":
            tree.remove_worker(req["worker"])
            answer = {"ok": True}
        elif op == "hashes":
            answer = {"hashes": compute_block_hash_for_seq(req["tokens"], req["block_size"])}
        else:
            answer = {"err": f"unknown op {op}"}
    except Exception as e:  # Dynamo's refusals surface as exceptions
        answer = {"err": f"{type(e).__name__}: {e}"}
    out.write(json.dumps(answer) + "\n")
    out.flush()
