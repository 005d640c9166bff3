#!/usr/bin/env python3
"""Checks the library's minimum supported Rust version (its `rust-version`) as far as
a machine without that toolchain can.

    tools/msrv.py [--msrv X.Y]

Every crate the library builds with (normal and build dependencies, all features, as
Cargo.lock resolves them) must declare a `rust-version` no newer than the library's,
and the services' and the library's manifests must state the same one. Clippy's
`incompatible_msrv` lint (on in `cargo clippy -D warnings`) covers our own use of the
standard library. Exits 1 listing each crate that needs a newer compiler.
"""
import json, pathlib, subprocess, sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def version(s):
    parts = [int(x) for x in s.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def main():
    meta = json.loads(subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--locked", "--all-features"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    packages = {p["id"]: p for p in meta["packages"]}
    nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
    ours = {p["name"]: p for p in meta["packages"] if p["source"] is None}
    msrv = ours["eventplane"]["rust_version"]
    if "--msrv" in sys.argv:
        msrv = sys.argv[sys.argv.index("--msrv") + 1]
    bad = [f"{name} states rust-version {p['rust_version']}, the library {msrv}"
           for name, p in ours.items()
           if name == "eventplane-services" and p["rust_version"] != msrv]
    seen, stack = set(), [ours["eventplane"]["id"]]
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        for dep in nodes[pid]["deps"]:
            if any(k["kind"] in (None, "build") for k in dep["dep_kinds"]):
                stack.append(dep["pkg"])
    for pid in sorted(seen):
        p = packages[pid]
        if p.get("rust_version") and version(p["rust_version"]) > version(msrv):
            bad.append(f"{p['name']} {p['version']} needs Rust {p['rust_version']}")
    for b in bad:
        print(f"msrv: {b}", file=sys.stderr)
    print(f"msrv: {len(seen)} crates checked against Rust {msrv}, {len(bad)} too new", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
