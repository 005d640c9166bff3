#!/usr/bin/env python3
"""The library's public API as one name per line, from rustdoc's JSON, so that the
surface changes only on purpose.

    tools/public_api.py [--json FILE] [--write FILE | --check FILE] [--counts]

Reads the rustdoc JSON of the library with every feature (build it with
`cargo +nightly rustdoc -p eventplane --all-features --lib -- -Z unstable-options
--output-format json`; default FILE target/doc/eventplane.json) and lists every item a
user can name from the crate root: modules, types, traits, free functions, constants,
statics, each public field, enum variant, inherent method and associated item, and each
trait a type implements by hand (`impl Trait for Type`; derived and auto traits
included when written, blanket ones not), at the path where rustdoc documents it.
`--check FILE` fails with the difference unless the list is FILE's; `--write FILE`
rewrites FILE (commit it with the change that meant it). `--counts` prints how many of
each kind.
"""
import argparse, collections, difflib, json, pathlib, sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def kind_of(item):
    return next(iter(item["inner"]))


def surface(doc):
    index = {int(k): v for k, v in doc["index"].items()}
    out = set()
    seen = set()

    def name_of(type_):
        # A trait path's name as written (`Debug`, `From<Bytes>` reads as `From`).
        return type_.get("path", "?").split("::")[-1]

    def visit(iid, path):
        if iid not in index or (iid, path) in seen:
            return
        seen.add((iid, path))
        item = index[iid]
        kind = kind_of(item)
        inner = item["inner"][kind]
        if kind == "module":
            out.add(f"mod {path}")
            for child in inner["items"]:
                c = index.get(child)
                if c is None or c.get("visibility") != "public":
                    continue
                if kind_of(c) == "use":
                    use = c["inner"]["use"]
                    if use["is_glob"]:
                        target = index.get(use["id"]) if use["id"] is not None else None
                        if target is not None and kind_of(target) == "module":
                            for g in target["inner"]["module"]["items"]:
                                gi = index.get(g)
                                if gi is not None and gi.get("visibility") == "public" and gi.get("name"):
                                    visit(g, f"{path}::{gi['name']}")
                        continue
                    if use["id"] is not None:
                        visit(use["id"], f"{path}::{use['name']}")
                    else:
                        out.add(f"use {path}::{use['name']} = {use['source']}")
                    continue
                visit(child, f"{path}::{c['name']}")
            return
        label = {"struct": "struct", "enum": "enum", "trait": "trait", "function": "fn",
                 "constant": "const", "static": "static", "type_alias": "type",
                 "macro": "macro", "union": "union"}.get(kind, kind)
        out.add(f"{label} {path}")
        impls = []
        if kind == "struct":
            shape = inner["kind"] if isinstance(inner["kind"], dict) else {}  # "unit"
            for f in shape.get("plain", {}).get("fields", []):
                fi = index.get(f)
                if fi is not None and fi.get("visibility") == "public":
                    out.add(f"field {path}::{fi['name']}")
            tup = shape.get("tuple")
            if tup:
                for n, f in enumerate(tup):
                    if f is not None and index.get(f, {}).get("visibility") == "public":
                        out.add(f"field {path}::{n}")
            impls = inner["impls"]
        elif kind == "enum":
            for v in inner["variants"]:
                out.add(f"variant {path}::{index[v]['name']}")
            impls = inner["impls"]
        elif kind == "trait":
            for m in inner["items"]:
                mi = index[m]
                out.add(f"trait-item {path}::{mi['name']}")
        for im in impls:
            imp = index.get(im)
            if imp is None:
                continue
            imp = imp["inner"]["impl"]
            if imp["is_synthetic"] or imp["blanket_impl"] is not None:
                continue
            if imp["trait"] is None:
                for m in imp["items"]:
                    mi = index.get(m)
                    if mi is not None and mi.get("visibility") == "public":
                        k = {"function": "method", "assoc_const": "assoc-const",
                             "assoc_type": "assoc-type"}.get(kind_of(mi), kind_of(mi))
                        out.add(f"{k} {path}::{mi['name']}")
            else:
                out.add(f"impl {name_of(imp['trait'])} for {path}")

    root = doc["root"]
    visit(root, index[root]["name"])
    return sorted(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=str(ROOT / "target/doc/eventplane.json"))
    ap.add_argument("--write", metavar="FILE")
    ap.add_argument("--check", metavar="FILE")
    ap.add_argument("--counts", action="store_true")
    args = ap.parse_args()
    lines = surface(json.loads(pathlib.Path(args.json).read_text()))
    if args.counts:
        c = collections.Counter(l.split(" ", 1)[0] for l in lines)
        types = c["struct"] + c["enum"] + c["trait"] + c["type"]
        print(f"types {types} (struct {c['struct']}, enum {c['enum']}, trait {c['trait']}, "
              f"alias {c['type']}); free fns {c['fn']}; methods {c['method']}; "
              f"constants {c['const'] + c['assoc-const']} (assoc {c['assoc-const']}); "
              f"modules {c['mod']}; fields {c['field']}; variants {c['variant']}; "
              f"trait impls {c['impl']}; lines {len(lines)}")
    text = "".join(l + "\n" for l in lines)
    if args.write:
        pathlib.Path(args.write).write_text(text)
    if args.check:
        want = pathlib.Path(args.check).read_text()
        if want != text:
            diff = difflib.unified_diff(want.splitlines(), text.splitlines(), args.check,
                                        "the library now", lineterm="", n=0)
            print("\n".join(diff), file=sys.stderr)
            print(f"public_api: the public API is not {args.check}: if the change is meant, "
                  f"run tools/public_api.py --write {args.check} and commit it", file=sys.stderr)
            return 1
        print(f"public_api: {len(lines)} items, as {args.check} says", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
