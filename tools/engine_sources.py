"""Fetches the engines' own KV-event publisher modules for tests/kv_engine_replay.rs.

    python3 tools/engine_sources.py [DEST]      (default target/engines)

Each module is taken unmodified from the release PyPI serves (an sdist or a wheel) and
written to DEST/<name>-<version>/kv_events.py; files already there are kept. Only the
standard library is used: .ci/run runs it before the tests, with network access to the
package registry only.
"""
import io
import json
import os
import sys
import tarfile
import urllib.parse
import urllib.request
import zipfile

# (project, version, file to pick from the release, member inside it)
ENGINES = [
    # vLLM <= 0.25: replies [seq, payload] after the delimiter.
    ("vllm", "0.25.1", ".tar.gz", "vllm-0.25.1/vllm/distributed/kv_events.py"),
    # vLLM >= 0.26: replies [topic, seq, payload].
    ("vllm", "0.34.0", ".tar.gz", "vllm-0.34.0/vllm/distributed/kv_events.py"),
    ("sglang", "0.5.23", "cp311-cp311-manylinux_2_34_x86_64.whl", "sglang/srt/disaggregation/kv_events.py"),
]

INDEX = "https://pypi.org/pypi/{}/json"


def fetch(url):
    with urllib.request.urlopen(url, timeout=300) as r:
        return r.read()


def main():
    dest = sys.argv[1] if len(sys.argv) > 1 else "target/engines"
    indexes = {}
    for project, version, suffix, member in ENGINES:
        out = os.path.join(dest, f"{project}-{version}", "kv_events.py")
        if os.path.exists(out):
            continue
        index_url = INDEX.format(project)
        if project not in indexes:
            indexes[project] = json.loads(fetch(index_url))
        files = [f for f in indexes[project]["releases"].get(version, []) if f["filename"].endswith(suffix)]
        if not files:
            sys.exit(f"{project} {version}: no release file ending in {suffix}")
        url = urllib.parse.urljoin(index_url, files[0]["url"])
        print(f"fetching {files[0]['filename']} ({files[0]['size'] >> 20} MiB)", flush=True)
        blob = fetch(url)
        if suffix.endswith(".whl"):
            text = zipfile.ZipFile(io.BytesIO(blob)).read(member)
        else:
            with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
                text = tar.extractfile(member).read()
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out + ".part", "wb") as f:
            f.write(text)
        os.replace(out + ".part", out)


if __name__ == "__main__":
    main()
