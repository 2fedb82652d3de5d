#!/usr/bin/env python3
"""The random-weight models of the time-to-first-token bench (bench/ttft.mjs), one per memory kind,
at a realistic small-model geometry with f16 weights, so that a cold 4,096-token prefill on 2 CPU
cores takes seconds (>= ~10 s) as a real model's would:

  kv         llama, 12 layers, 768 wide, 12 heads, 4 KV heads (head_dim 64), FFN 2048
  iswa       gemma3, 12 layers as kv's, window 1024, every 6th layer global (gemma3-4b's rule)
  hybrid     jamba, 16 layers, 768 wide: Mamba layers (d_inner 1536, d_state 16, dt_rank 48) and
             attention at layers 4 and 12 (Jamba's period 8, offset 4), dense FFN 1536
  recurrent  mamba, 24 layers, 768 wide, d_inner 1536, d_state 16, dt_rank 48 (mamba-130m's)

They reuse interop/make_models.py's writers and tokenizer (the tiny models' 320-token vocabulary),
with two changes: matrices are written as f16 (norms, convolution kernels, A and D stay f32, as
llama.cpp's CPU kernels want), and random weights are scaled by sqrt(128 / n_embd) so activations
stay in f16's range at 768 wide.

Writes bench/models/<kind>.gguf and bench/models/ttft-models.json (geometry, parameters, bytes and
a stamp of this script and make_models.py) only when a file is missing or the stamp changed; prints
that JSON. Run: interop/.venv/bin/python bench/ttft_models.py [--force]
"""
import hashlib
import json
import os
import sys

import numpy as np

sys.dont_write_bytecode = True  # no __pycache__ beside interop/make_models.py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(HERE, "models")
MAKE_MODELS = os.path.join(ROOT, "interop", "make_models.py")
sys.path.insert(0, os.path.dirname(MAKE_MODELS))
import make_models as mm  # noqa: E402
import gguf  # noqa: E402

CTX = 16384  # trained context in the metadata: room for 4,096 + 64 and more
F32_NAMES = ("_norm.weight", "norm.weight", "ssm_conv1d.weight", "ssm_a", "ssm_d")

KINDS = {
    "kv": dict(arch="llama", n_layer=12, n_embd=768, n_head=12, n_head_kv=4, n_ff=2048, seed=761),
    "iswa": dict(arch="gemma3", n_layer=12, n_embd=768, n_head=12, n_head_kv=4, n_ff=2048, window=1024,
                 pattern=6, seed=762),
    "hybrid": dict(arch="jamba", n_layer=16, n_embd=768, n_head=12, n_head_kv=4, n_ff=1536, d_inner=1536,
                   d_state=16, d_conv=4, dt_rank=48, attn_period=8, attn_offset=4, seed=763),
    "recurrent": dict(arch="mamba", n_layer=24, n_embd=768, d_inner=1536, d_state=16, d_conv=4, dt_rank=48,
                      seed=764),
}


def stamp():
    h = hashlib.sha256()
    for f in (os.path.abspath(__file__), MAKE_MODELS):
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:16]


class Counter:
    params = 0


class F16Writer(gguf.GGUFWriter):
    """Matrices as f16; counts parameters."""

    def add_tensor(self, name, tensor, *args, **kwargs):
        Counter.params += int(tensor.size)
        if tensor.ndim >= 2 and tensor.dtype == np.float32 and not name.endswith(F32_NAMES):
            tensor = tensor.astype(np.float16)
        super().add_tensor(name, tensor, *args, **kwargs)


def patch(n_embd):
    """make_models' writers, with an f16 writer, a long context and weights scaled for n_embd."""
    scale = float(np.sqrt(128.0 / n_embd))

    def rnd(rng, shape, std):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std * scale)

    def begin(path, arch, name, n_embd_, n_layer, n_ff, n_head):
        w = F16Writer(path, arch)
        w.add_name(name)
        w.add_context_length(CTX)
        w.add_embedding_length(n_embd_)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        return w

    mm.rnd = rnd
    mm.begin = begin
    mm.CTX = CTX


def write_jamba(path, g):
    """Jamba with n_layer layers: attention where i % period == offset, Mamba elsewhere, dense FFN
    on every layer (llama.cpp's jamba takes a dense FFN where a layer has no router)."""
    rng = np.random.default_rng(g["seed"])
    n_embd, n_head, n_head_kv, n_layer = g["n_embd"], g["n_head"], g["n_head_kv"], g["n_layer"]
    n_embd_gqa = n_embd // n_head * n_head_kv
    attn = [i % g["attn_period"] == g["attn_offset"] for i in range(n_layer)]
    w = mm.begin(path, "jamba", "ttft-hybrid", n_embd, n_layer, g["n_ff"], n_head)
    w.add_head_count_kv([n_head_kv if a else 0 for a in attn])
    mm.add_ssm_hparams(w, g["d_conv"], g["d_inner"], g["d_state"], g["dt_rank"])
    w.add_layer_norm_rms_eps(1e-5)
    mm.add_vocab_and_io(w, rng, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        if attn[i]:
            mm.add_attention(w, rng, p, n_embd, n_embd_gqa)
        else:
            mm.add_mamba_mixer(w, rng, p, n_embd, g["d_inner"], g["d_state"], g["d_conv"], g["dt_rank"],
                               jamba_norms=True)
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        mm.add_ffn(w, rng, p, n_embd, g["n_ff"])
    g["attention_layers"] = [i for i in range(n_layer) if attn[i]]
    mm.finish(w)


def write(kind, path):
    g = dict(KINDS[kind])
    patch(g["n_embd"])
    Counter.params = 0
    if kind == "kv":
        mm.write_llama(path, g["n_embd"], g["n_head"], g["n_head_kv"], g["n_ff"], g["n_layer"], seed=g["seed"])
    elif kind == "iswa":
        mm.write_gemma3_swa(path, g["n_embd"], g["n_head"], g["n_head_kv"], g["n_ff"], g["n_layer"], g["window"],
                            g["pattern"], seed=g["seed"])
        g["global_layers"] = [i for i in range(g["n_layer"]) if (i + 1) % g["pattern"] == 0]
    elif kind == "hybrid":
        write_jamba(path, g)
    elif kind == "recurrent":
        mm.write_mamba(path, g["n_embd"], g["d_inner"], g["d_state"], g["d_conv"], g["dt_rank"], g["n_layer"],
                       seed=g["seed"])
    g["params"] = Counter.params
    g["bytes"] = os.path.getsize(path)
    g["file"] = os.path.relpath(path, ROOT)
    return g


def main():
    force = "--force" in sys.argv[1:]
    os.makedirs(OUT, exist_ok=True)
    meta_path = os.path.join(OUT, "ttft-models.json")
    s = stamp()
    meta = None
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
    paths = {k: os.path.join(OUT, f"{k}.gguf") for k in KINDS}
    fresh = (not force and meta is not None and meta.get("stamp") == s
             and all(os.path.exists(p) and os.path.getsize(p) == meta["models"][k]["bytes"]
                     for k, p in paths.items() if k in meta.get("models", {}))
             and set(meta.get("models", {})) == set(KINDS))
    if not fresh:
        models = {}
        for kind, path in paths.items():
            print(f"ttft_models: writing {os.path.relpath(path, ROOT)}", file=sys.stderr, flush=True)
            tmp = path + ".tmp"
            g = write(kind, tmp)
            os.replace(tmp, path)
            g["file"] = os.path.relpath(path, ROOT)
            models[kind] = g
        meta = {"stamp": s, "vocab": len(mm.build_vocab()[0]), "models": models}
        with open(meta_path + ".tmp", "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(meta_path + ".tmp", meta_path)
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
