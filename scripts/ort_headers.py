"""Put ONNX Runtime's C and C++ API headers where v4engine's CPU kernels are compiled from (runtime/sessions/
stored_weights.py): PREFIX/include/onnxruntime, PREFIX the virtual environment.

The onnxruntime wheels carry the library only. Debian's libonnxruntime-dev carries the headers; the package of
Debian 13 (trixie), 1.21.0, is fetched from Debian's mirror and checked against its SHA-256 below (should the mirror
have moved on to a newer build, the one trixie's package index names, checked against the index). Headers of C API
version 21 build a library that ONNX Runtime 1.21 and every later release load (ONNX Runtime keeps its C API
backwards compatible). Nothing is installed into the system: the package's headers are unpacked, nothing else.

    python scripts/ort_headers.py [--prefix .venv]
"""
from __future__ import annotations

import argparse
import hashlib
import io
import lzma
import sys
import tarfile
import urllib.request
from pathlib import Path

MIRROR = "http://deb.debian.org/debian/"
PACKAGE = "libonnxruntime-dev"
PINNED = ("pool/main/o/onnxruntime/libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb",
          "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08")
INDEX = "dists/trixie/main/binary-amd64/Packages.xz"
INSIDE = "./usr/include/onnxruntime/"


def fetch(path: str) -> bytes:
    with urllib.request.urlopen(MIRROR + path, timeout=120) as response:
        return response.read()


def indexed() -> tuple[str, str]:
    """(path, sha256) of the package as trixie's package index names it now."""
    fields: dict[str, str] = {}
    for line in lzma.decompress(fetch(INDEX)).decode().splitlines() + [""]:
        if not line:
            if fields.get("Package") == PACKAGE:
                return fields["Filename"], fields["SHA256"]
            fields = {}
        elif ": " in line and not line.startswith(" "):
            key, value = line.split(": ", 1)
            fields[key] = value
    raise SystemExit(f"{MIRROR}{INDEX}: no {PACKAGE} in it")


def package() -> bytes:
    """The .deb's bytes, checked against its SHA-256."""
    for where in (lambda: PINNED, indexed):
        path, digest = where()
        try:
            data = fetch(path)
        except OSError as e:
            print(f"{MIRROR}{path}: {e}", file=sys.stderr)
            continue
        if hashlib.sha256(data).hexdigest() != digest:
            raise SystemExit(f"{MIRROR}{path}: its SHA-256 is not {digest}; refused")
        return data
    raise SystemExit(f"{PACKAGE}: not fetched from {MIRROR}")


def headers(deb: bytes) -> dict[str, bytes]:
    """The header files of a .deb (an ar archive holding data.tar.*), by file name."""
    if not deb.startswith(b"!<arch>\n"):
        raise SystemExit(f"{PACKAGE}: not a Debian package (no ar header)")
    at = 8
    while at + 60 <= len(deb):
        name, size = deb[at:at + 16].decode().strip().rstrip("/"), int(deb[at + 48:at + 58])
        body = deb[at + 60:at + 60 + size]
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body)) as tar:
                return {Path(m.name).name: tar.extractfile(m).read() for m in tar.getmembers()
                        if m.isfile() and m.name.startswith(INSIDE) and m.name.endswith(".h")
                        and "/" not in m.name[len(INSIDE):]}
        at += 60 + size + size % 2
    raise SystemExit(f"{PACKAGE}: no data.tar in it")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix", type=Path, default=Path(sys.prefix),
                   help="the environment whose include/onnxruntime receives the headers (default: this Python's)")
    args = p.parse_args()
    target = args.prefix / "include" / "onnxruntime"
    if (target / "onnxruntime_cxx_api.h").is_file():
        return
    files = headers(package())
    if "onnxruntime_cxx_api.h" not in files:
        raise SystemExit(f"{PACKAGE}: no onnxruntime_cxx_api.h in it")
    staging = target.with_name("onnxruntime.partial")
    staging.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (staging / name).write_bytes(data)
    staging.rename(target)
    print(f"ONNX Runtime headers: {len(files)} files in {target}")


if __name__ == "__main__":
    main()
