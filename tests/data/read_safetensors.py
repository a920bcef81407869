#!/usr/bin/python3
"""An independent safetensors reader: parses a file with nothing but Python's standard library and
checks it against expected tensors given on the command line.

    read_safetensors.py FILE NAME=DTYPE:SHAPE:V1,V2,... [KEY=VALUE for metadata] ...
SHAPE is extents joined by 'x'. Exits 0 when everything matches, 1 otherwise (saying what differs).
"""
import json
import struct
import sys

FORMATS = {"F32": ("f", 4), "F64": ("d", 8), "I64": ("q", 8)}


def main():
    path = sys.argv[1]
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    ok = True
    for spec in sys.argv[2:]:
        name, _, rest = spec.partition("=")
        if ":" not in rest:  # metadata
            got = header.get("__metadata__", {}).get(name)
            if got != rest:
                print(f"metadata {name}: {got!r} != {rest!r}")
                ok = False
            continue
        dtype, shape, values = rest.split(":")
        entry = header[name]
        want_shape = [int(s) for s in shape.split("x")]
        if entry["dtype"] != dtype or entry["shape"] != want_shape:
            print(f"{name}: {entry['dtype']} {entry['shape']} != {dtype} {want_shape}")
            ok = False
            continue
        code, size = FORMATS[dtype]
        begin, end = entry["data_offsets"]
        count = (end - begin) // size
        got = struct.unpack("<" + code * count, data[base + begin:base + end])
        want = [float(v) for v in values.split(",")]
        if any(abs(a - b) > 1e-6 * max(1.0, abs(b)) for a, b in zip(got, want)) or len(got) != len(want):
            print(f"{name}: {got} != {want}")
            ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
