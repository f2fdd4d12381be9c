"""The hand-crafted hostile corpus (tests/compress/hostile/corpus.json, from make_corpus.py): every
entry must raise WireFormatError, or decode within what the receiver allows, in a process
whose address space is capped at 2.5 GB, so a decompression or allocation bomb fails the
test instead of swapping the machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gradwire

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "hostile" / "corpus.json"
RUNNER = HERE / "hostile" / "run_corpus.py"
ROOT = HERE.parent


def _entries() -> list[dict]:
    return json.loads(CORPUS.read_text())["entries"]


def test_corpus_covers_every_class_and_codec():
    entries = _entries()
    assert {e["class"] for e in entries} == set(range(1, 11))
    packets = [e for e in entries if e["kind"] == "packet"]
    codecs = {gradwire.compressor(e["spec"]).name for e in packets}
    assert set(gradwire.available()) <= codecs | {"chain"}, set(gradwire.available()) - codecs
    for name in gradwire.available():
        # classes 1 (zero dims) and 6 (flag bits) are generated for every codec
        assert any(e["class"] == 1 and e["spec"].split(":")[0] == name for e in packets), name
        assert any(e["class"] == 6 and e["spec"].split(":")[0] == name for e in packets), name
    assert max(len(e["hex"]) // 2 for e in entries) < 1024  # every entry is under 1 KB
    assert {"message", "sparse", "artopk"} <= {e["kind"] for e in entries}


def test_every_hostile_packet_fails_cleanly_under_an_address_space_limit():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(RUNNER), "--limit-gb", "2.5"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == len(_entries())
    bad = [f"class {r['class']} {r['name']}: {r['result']}" for r in rows if r["result"] != "ok"]
    assert not bad, "\n".join(bad)
