#!/usr/bin/env python3
"""Checks the links between the repository's Markdown files.

    tools/doclinks.py [FILE.md ...]

For every Markdown file git tracks (or those named), each relative link must name a
file or folder that exists, and a `#fragment` a heading of the target file (GitHub's
anchors: lower case, punctuation dropped, spaces as dashes, `-1`, `-2` for repeats).
Links inside code blocks and inline code are not links. Web links are not fetched (CI
has no network). Exits 1 listing every broken link.
"""
import pathlib, re, subprocess, sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"(?<!\!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(text):
    """The text outside fenced code blocks and inline code spans."""
    out, fence = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fence = not fence
            out.append("")
            continue
        out.append("" if fence else re.sub(r"`[^`]*`", "``", line))
    return "\n".join(out)


def anchors(path, cache={}):
    if path not in cache:
        seen, found, fence = {}, set(), False
        for line in path.read_text().split("\n"):
            if line.lstrip().startswith("```"):
                fence = not fence
            m = None if fence else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if not m:
                continue
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
        found |= set(re.findall(r'<a (?:name|id)="([^"]+)"', path.read_text()))
        cache[path] = found
    return cache[path]


def check(md):
    bad = []
    for m in LINK.finditer(prose(md.read_text())):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, …
            continue
        file, _, frag = target.partition("#")
        dest = (md.parent / file).resolve() if file else md
        if not dest.exists():
            bad.append(f"{md.relative_to(ROOT)}: {target}: no such file")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            bad.append(f"{md.relative_to(ROOT)}: {target}: no heading #{frag} in {dest.relative_to(ROOT)}")
    return bad


def main():
    names = sys.argv[1:] or subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    files = [ROOT / n for n in names if (ROOT / n).exists()]
    bad = [b for f in files for b in check(f)]
    for b in bad:
        print(f"doclinks: {b}", file=sys.stderr)
    print(f"doclinks: {len(files)} files, {len(bad)} broken links", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
