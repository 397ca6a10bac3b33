#!/usr/bin/env python3
"""onnxruntime-gpu to the lent GPU machine, which has no network: the wheel in parts small enough to travel beside
the working tree, one part a device call, joined there.

A device call carries the working tree (tracked files and those git does not ignore) and at most 64 MiB in all;
parts left by earlier calls stay on the machine while it is warm (30 s between calls). So:

    python3 scripts/ort_gpu_wheel.py split              # here: download the wheel (Python 3.12, the GPU machine's)
                                                        # into .whl/ and cut it into parts that fit beside the tree
    # device calls, one per part, each carrying .whl/ort-part-N and running:
    python3 scripts/ort_gpu_wheel.py keep N             # there: move the part out of the tree into /tmp/ort-parts
    # then, in the call that uses it (scripts/gpu_first_tokens.py does this itself):
    python3 scripts/ort_gpu_wheel.py join --target /tmp/site      # there: join, check the SHA-256, pip install

`split` prints how many calls the parts take and the carry list of each. The wheel's digest is written beside the
parts (.whl/ort-wheel.json) and checked after the join, so a part lost or cut short fails there in one line. `.whl/`
must be ignored by git (`echo /.whl/ >> .git/info/exclude`), or the parts would travel with every call.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDER = REPO / ".whl"
PARTS = Path("/tmp/ort-parts")                      # where parts wait on the GPU machine, out of the next call's way
WHEEL = "onnxruntime-gpu==1.31.1"                   # CUDA 13; its CUDA provider needs cuBLAS, cudart, curand
CALL_BYTES = 64 << 20                               # what one device call carries
MARGIN = 2 << 20


def tree_bytes() -> int:
    """The bytes a device call carries of the working tree: tracked files and those git does not ignore."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((REPO / name.decode()).stat().st_size for name in listed if name and (REPO / name.decode()).is_file())


def split() -> None:
    FOLDER.mkdir(exist_ok=True)
    for old in FOLDER.glob("ort-part-*"):
        old.unlink()
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                    "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "-d", str(FOLDER), WHEEL],
                   check=True)
    wheel = next(FOLDER.glob("onnxruntime_gpu-*.whl"))
    room = CALL_BYTES - tree_bytes() - MARGIN
    if room < (4 << 20):
        sys.exit(f"ort_gpu_wheel: the working tree leaves {room} bytes a call; make it smaller first")
    data = wheel.read_bytes()
    parts = [data[i: i + room] for i in range(0, len(data), room)]
    for n, part in enumerate(parts):
        (FOLDER / f"ort-part-{n}").write_bytes(part)
    (FOLDER / "ort-wheel.json").write_text(json.dumps({"wheel": wheel.name, "parts": len(parts),
                                                       "sha256": hashlib.sha256(data).hexdigest()}))
    print(f"{wheel.name}: {len(data)} bytes in {len(parts)} parts of at most {room} bytes (the tree takes "
          f"{tree_bytes()} of a call's {CALL_BYTES}); one device call per part, each carrying "
          f"['.whl/ort-part-N', '.whl/ort-wheel.json'] and running: python3 scripts/ort_gpu_wheel.py keep N")


def keep(n: int) -> None:
    PARTS.mkdir(exist_ok=True)
    shutil.copyfile(FOLDER / f"ort-part-{n}", PARTS / f"ort-part-{n}")
    shutil.copyfile(FOLDER / "ort-wheel.json", PARTS / "ort-wheel.json")
    print(f"kept part {n}: {sorted(p.name for p in PARTS.glob('ort-part-*'))}")


def join(target: Path) -> Path:
    """Join the parts, check the wheel's digest and install it into `target` (no dependencies, no index)."""
    record = json.loads((PARTS / "ort-wheel.json").read_text())
    missing = [n for n in range(record["parts"]) if not (PARTS / f"ort-part-{n}").is_file()]
    if missing:
        sys.exit(f"ort_gpu_wheel: parts {missing} never arrived (the machine went cold between calls?)")
    wheel = PARTS / record["wheel"]
    with open(wheel, "wb") as out:
        for n in range(record["parts"]):
            out.write((PARTS / f"ort-part-{n}").read_bytes())
    if hashlib.sha256(wheel.read_bytes()).hexdigest() != record["sha256"]:
        sys.exit(f"ort_gpu_wheel: {wheel.name} joined from {record['parts']} parts does not match its SHA-256")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--target", str(target), str(wheel)], check=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("split", help="download the wheel and cut it into parts that fit a device call beside the tree")
    kept = sub.add_parser("keep", help="(on the GPU machine) keep part N out of the tree until the join")
    kept.add_argument("n", type=int, help="the part's number, as split printed it")
    joined = sub.add_parser("join", help="(on the GPU machine) join the parts, check, pip install into --target")
    joined.add_argument("--target", type=Path, default=Path("/tmp/site"), help="where pip installs the wheel "
                        "(default /tmp/site; put it first on PYTHONPATH)")
    args = parser.parse_args()
    if args.command == "split":
        split()
    elif args.command == "keep":
        keep(args.n)
    else:
        print(f"installed into {join(args.target)}")


if __name__ == "__main__":
    main()
