#!/usr/bin/env python3
"""Parse a llama.cpp state file ('ggsn' session or 'ggsq' sequence) written by a
current llama.cpp (n_stream layout) and print its structure.

Usage: python interop/inspect_state.py FILE [--layout attn|recurrent] [--json]

Layouts tried (the file is accepted only if it is consumed exactly to EOF):
  attn       u32 n_stream; per stream: u32 cell_count; META; DATA   (KV cache)
  recurrent  u32 cell_count; META; u32 s_trans; u32 n_layer; R rows; S rows (Mamba)
Session files ('ggsn') hold  str arch  before the memory payload.
"""
import json
import struct
import sys

TYPES = {0: ("f32", 1, 4), 1: ("f16", 1, 2), 2: ("q4_0", 32, 18), 3: ("q4_1", 32, 20),
         6: ("q5_0", 32, 22), 7: ("q5_1", 32, 24), 8: ("q8_0", 32, 34),
         20: ("iq4_nl", 32, 18), 30: ("bf16", 1, 2)}
MAGIC = {0x6767736E: "ggsn", 0x67677371: "ggsq"}


class R:
    def __init__(self, b):
        self.b, self.o = b, 0

    def take(self, n):
        if self.o + n > len(self.b):
            raise ValueError(f"short read at {self.o} (+{n}, size {len(self.b)})")
        v = self.b[self.o:self.o + n]
        self.o += n
        return v

    def u32(self):
        return struct.unpack("<I", self.take(4))[0]

    def i32(self):
        return struct.unpack("<i", self.take(4))[0]

    def u64(self):
        return struct.unpack("<Q", self.take(8))[0]


def row_ok(t, size):
    if t not in TYPES:
        raise ValueError(f"bad ggml type {t}")
    name, blk, bs = TYPES[t]
    if (size % bs) != 0:
        raise ValueError(f"row size {size} not a multiple of {name} block bytes {bs}")
    return name, size // bs * blk  # elements per row


def read_meta(r, n, ext=0):
    cells = []
    for _ in range(n):
        pos = r.i32()
        nseq = r.u32()
        if nseq > 64:
            raise ValueError(f"implausible n_seq_id {nseq}")
        if ext:
            r.take(ext)
        seqs = [r.i32() for _ in range(nseq)]
        cells.append((pos, seqs))
    return cells


def read_kv_stream(r):
    cc = r.u32()
    out = {"cell_count": cc}
    if cc == 0:
        return out
    cells = read_meta(r, cc)
    out["positions"] = [c[0] for c in cells]
    out["seq_ids"] = sorted({s for c in cells for s in c[1]})
    out["n_seq_id_per_cell"] = sorted({len(c[1]) for c in cells})
    v_trans = r.u32()
    if v_trans not in (0, 1):
        raise ValueError(f"v_trans {v_trans}")
    n_layer = r.u32()
    if not 0 < n_layer < 1000:
        raise ValueError(f"n_layer {n_layer}")
    out["v_trans"], out["n_layer"] = v_trans, n_layer
    k = []
    for _ in range(n_layer):
        t = r.i32(); rs = r.u64(); name, width = row_ok(t, rs)
        r.take(rs * cc)
        k.append({"type": name, "row_size": rs, "width": width})
    v = []
    for _ in range(n_layer):
        t = r.i32()
        if v_trans:
            el = r.u32(); n_embd = r.u32()
            name, blk, bs = TYPES[t]
            if blk != 1 or el != bs:
                raise ValueError(f"transposed V with type {name} size_el {el}")
            r.take(el * n_embd * cc)
            v.append({"type": name, "size_el": el, "n_embd_v_gqa": n_embd})
        else:
            rs = r.u64(); name, width = row_ok(t, rs)
            r.take(rs * cc)
            v.append({"type": name, "row_size": rs, "width": width})
    out["k"], out["v"] = k, v
    return out


def read_attn(r):
    n_stream = r.u32()
    if not 0 < n_stream <= 256:
        raise ValueError(f"n_stream {n_stream}")
    return {"layout": "attn", "n_stream": n_stream,
            "streams": [read_kv_stream(r) for _ in range(n_stream)]}


def read_recurrent(r):
    cc = r.u32()
    out = {"layout": "recurrent", "cell_count": cc}
    if cc == 0:
        return out
    cells = read_meta(r, cc)
    out["positions"] = [c[0] for c in cells]
    out["seq_ids"] = sorted({s for c in cells for s in c[1]})
    out["n_seq_id_per_cell"] = sorted({len(c[1]) for c in cells})
    s_trans = r.u32(); n_layer = r.u32()
    if s_trans not in (0, 1) or not 0 < n_layer < 1000:
        raise ValueError(f"s_trans {s_trans} n_layer {n_layer}")
    out["s_trans"], out["n_layer"] = s_trans, n_layer
    for key in ("r", "s"):
        rows = []
        for _ in range(n_layer):
            t = r.i32(); rs = r.u64(); name, width = row_ok(t, rs)
            r.take(rs * cc)
            rows.append({"type": name, "row_size": rs, "width": width})
        out[key] = rows
    return out


def parse(path, layouts=("attn", "recurrent")):
    b = open(path, "rb").read()
    errors = {}
    results = []
    for lay in layouts:
        r = R(b)
        try:
            magic = r.u32()
            if magic not in MAGIC:
                raise ValueError(f"bad magic {magic:#x}")
            hdr = {"file": path, "size": len(b), "magic": MAGIC[magic], "version": r.u32()}
            n = r.u32()
            hdr["n_tokens"] = n
            hdr["tokens"] = [r.i32() for _ in range(n)]
            if hdr["magic"] == "ggsn":
                ln = r.u32()
                hdr["arch"] = r.take(ln).decode()
            body = read_attn(r) if lay == "attn" else read_recurrent(r)
            if r.o != len(b):
                raise ValueError(f"{len(b) - r.o} trailing bytes")
            hdr.update(body)
            results.append(hdr)
        except Exception as e:  # noqa: BLE001
            errors[lay] = str(e)
    if len(results) != 1:
        raise SystemExit(f"{path}: {len(results)} layouts match; errors: {errors}")
    return results[0]


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    as_json = "--json" in sys.argv
    for p in args:
        d = parse(p)
        if as_json:
            print(json.dumps(d))
            continue
        head = open(p, "rb").read(64)
        print(f"== {p}  ({d['size']} bytes)")
        for i in range(0, len(head), 16):
            print(f"  {i:08x}: " + " ".join(f"{x:02x}" for x in head[i:i + 16]))
        summary = {k: v for k, v in d.items() if k not in ("file", "streams", "positions", "r", "s")}
        print("  " + json.dumps(summary))
        for i, s in enumerate(d.get("streams", [])):
            s2 = dict(s)
            if "positions" in s2:
                s2["positions"] = f"{s2['positions'][0]}..{s2['positions'][-1]}"
            print(f"  stream {i}: " + json.dumps(s2))
        if d["layout"] == "recurrent" and d["cell_count"]:
            print(f"  positions {d['positions']}  r: {json.dumps(d['r'])}  s: {json.dumps(d['s'])}")


if __name__ == "__main__":
    main()
