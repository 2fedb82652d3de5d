#!/usr/bin/env python3
"""Write tiny random-weight GGUF models that real llama.cpp builds load on CPU.

Deterministic: fixed seeds, fixed metadata, F32 weights. Output goes to
interop/models/ (gitignored). Run:  python interop/make_models.py [out_dir]

Models
  llama-h16.gguf  llama, 2 layers, n_embd 64,  n_head 4, n_head_kv 2 (head_dim 16), n_ff 128
  llama-h32.gguf  llama, 2 layers, n_embd 128, n_head 4, n_head_kv 2 (head_dim 32), n_ff 128
  mamba.gguf      mamba, 2 layers, n_embd 64, d_inner 128, d_state 16, d_conv 4, dt_rank 4
  llama-l64.gguf  llama, 64 layers, n_embd 64, n_head 4, n_head_kv 2 (head_dim 16), n_ff 32: the
                  seed's defrag move cap (170 moves) is reached with few cells
  llama-h64.gguf  llama, 2 layers, n_embd 128, n_head 2, n_head_kv 1 (head_dim 64): quantized
                  K/V of llama.cpp 0.1.161 are Hadamard-rotated (n_rot 64)
  gemma3-swa.gguf gemma3, 2 layers, n_embd 128, n_head 2, n_head_kv 1 (head_dim 64), window 4,
                  pattern 2 (layer 0 SWA, layer 1 full): an iSWA memory (base + SWA caches)
  jamba.gguf      jamba, 2 layers, n_embd 64: layer 0 Mamba (d_inner 128, d_state 16), layer 1
                  attention (n_head 4, n_head_kv 2): a hybrid memory (attention + recurrent)
  qwen2-h64.gguf  qwen2 (NeoX RoPE), shaped like llama-h64 (head_dim 64) with Q/K/V biases:
                  the K-shift of a rotated quantized K with NeoX pairing
  qwen2-h64-yarn.gguf   as qwen2-h64, plus YaRN scaling (factor 4, original context 64)
  llama-h64-yarn.gguf   as llama-h64 (norm RoPE), plus YaRN scaling (factor 12, original context
                  64; 12 is a factor whose YaRN attention factor llama.cpp 0.1.161 computes as
                  1 - 2^-24, not 1)
  llama4-chunked.gguf   llama4, 4 layers, n_embd 32, n_head 2, n_head_kv 1 (head_dim 16): chunked
                  attention (chunks of 8192, layers 0-2; layer 3 full), one expert that no layer
                  uses (MoE every 1000th layer): today's llama.cpp gives it an iSWA memory whose
                  window rule is the chunk
  lfm2.gguf       lfm2, 4 layers, n_embd 32: layers 0 and 2 short convolutions (l_cache 3: a
                  recurrent state of R rows only), 1 and 3 attention (n_head 2, n_head_kv 1)
  lfm2-swa.gguf   as lfm2, with a window of 4 on every attention layer: a hybrid-iSWA memory
                  (its base cache holds no layer)

Tokenizer (all models): SentencePiece-style ("llama") vocab of 320 tokens:
  0 <unk>, 1 <s>, 2 </s>, 3..258 byte tokens <0x00>..<0xFF>, then 61 pieces:
  34 word pieces (16 words with the \u2581 space marker, plus their prefixes) and 27 letters.
The output rows of tokens 0..258 are zero, so greedy decoding always picks a
word/letter piece (never EOS or a raw byte), which keeps the next-token checks readable.
The byte tokens make byte fallback work for any input text (llama.cpp's SPM
tokenizer throws on a missing byte token), so the peers can tokenize anything.
"""
import os
import sys

import numpy as np
import gguf

HERE = os.path.dirname(os.path.abspath(__file__))
CTX = 256

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "big",
         "red", "and", "is", "it", "in", "of"]
LETTERS = list("abcdefghijklmnopqrstuvwxyz") + ["\u2581"]  # 27
N_SPECIAL = 3 + 256  # <unk> <s> </s> + byte tokens


def word_pieces():
    """'\u2581'+word and every prefix of it (>= 2 chars): llama.cpp's SPM tokenizer
    merges adjacent pairs only into pieces that exist, so the prefixes must exist."""
    out = []
    for w in WORDS:
        full = "\u2581" + w
        for n in range(2, len(full) + 1):
            if full[:n] not in out:
                out.append(full[:n])
    return out


def build_vocab():
    tokens, scores, types = [], [], []
    T = gguf.TokenType

    def add(text, score, ttype):
        tokens.append(text.encode("utf-8"))
        scores.append(float(score))
        types.append(int(ttype))

    add("<unk>", 0.0, T.UNKNOWN)
    add("<s>", 0.0, T.CONTROL)
    add("</s>", 0.0, T.CONTROL)
    for b in range(256):
        add("<0x%02X>" % b, 0.0, T.BYTE)
    # whole words with the SPM space marker: high scores so they win merges
    for i, p in enumerate(word_pieces()):
        add(p, -1.0 - 0.01 * i, T.NORMAL)
    for i, c in enumerate(LETTERS):
        add(c, -10.0 - 0.01 * i, T.NORMAL)
    assert len(tokens) == len(set(tokens))
    return tokens, scores, types


def add_tokenizer(w):
    tokens, scores, types = build_vocab()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    return len(tokens)


def rnd(rng, shape, std):
    # numpy shape is (rows, cols) = ggml ne reversed
    return (rng.standard_normal(shape) * std).astype(np.float32)


def out_weight(rng, n_vocab, n_embd):
    o = rnd(rng, (n_vocab, n_embd), 0.5)
    o[:N_SPECIAL] = 0.0  # special + byte tokens never win greedy sampling
    return o


def begin(path, arch, name, n_embd, n_layer, n_ff, n_head):
    """A writer with the metadata every model starts with (in the order the first models were
    written with, so they stay byte-identical)."""
    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    w.add_context_length(CTX)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    return w


def add_ssm_hparams(w, d_conv, d_inner, d_state, dt_rank):
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)


def add_vocab_and_io(w, rng, n_embd):
    """File type, tokenizer, and the embedding and output tensors."""
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_vocab = add_tokenizer(w)
    w.add_vocab_size(n_vocab)
    w.add_tensor("token_embd.weight", rnd(rng, (n_vocab, n_embd), 0.5))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("output.weight", out_weight(rng, n_vocab, n_embd))


def write_qwen2(path, n_embd, n_head, n_head_kv, n_ff, n_layer, seed, yarn=None):
    """qwen2: llama's tensors plus Q/K/V biases (0.1.103 requires them), NeoX RoPE.
    `yarn`: (factor, original context) adds YaRN scaling metadata."""
    write_llama(path, n_embd, n_head, n_head_kv, n_ff, n_layer, seed, arch="qwen2", biases=True, yarn=yarn)


def write_qwen2vl(path, n_embd, n_head, n_head_kv, n_ff, n_layer, seed):
    """qwen2vl (Qwen2-VL's text model): qwen2's tensors, M-RoPE over four position sections
    (temporal, height, width, other) splitting head_dim/2 as Qwen2-VL does (16, 24, 24, 0 of 64).
    llama.cpp 0.1.161 saves every cell of such a model with its `llama_kv_cell_ext`."""
    head_dim = n_embd // n_head
    quarter = head_dim // 8
    sections = [quarter, (head_dim // 2 - quarter) // 2, (head_dim // 2 - quarter) // 2, 0]
    write_llama(path, n_embd, n_head, n_head_kv, n_ff, n_layer, seed, arch="qwen2vl", biases=True,
                rope_sections=sections)


def write_llama(path, n_embd, n_head, n_head_kv, n_ff, n_layer, seed, arch="llama", biases=False, yarn=None,
                rope_sections=None):
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    n_embd_gqa = head_dim * n_head_kv
    w = begin(path, arch, os.path.splitext(os.path.basename(path))[0], n_embd, n_layer, n_ff, n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    if rope_sections is not None:
        w.add_rope_dimension_sections(rope_sections)
    w.add_rope_freq_base(10000.0)
    if yarn is not None:
        factor, orig_ctx = yarn
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(orig_ctx)
    w.add_layer_norm_rms_eps(1e-5)
    add_vocab_and_io(w, rng, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        add_attention(w, rng, p, n_embd, n_embd_gqa)
        if biases:
            w.add_tensor(p + "attn_q.bias", rnd(rng, (n_embd,), 0.1))
            w.add_tensor(p + "attn_k.bias", rnd(rng, (n_embd_gqa,), 0.1))
            w.add_tensor(p + "attn_v.bias", rnd(rng, (n_embd_gqa,), 0.1))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        add_ffn(w, rng, p, n_embd, n_ff)
    finish(w)


def add_attention(w, rng, p, n_embd, n_embd_gqa):
    w.add_tensor(p + "attn_q.weight", rnd(rng, (n_embd, n_embd), 0.2))
    w.add_tensor(p + "attn_k.weight", rnd(rng, (n_embd_gqa, n_embd), 0.2))
    w.add_tensor(p + "attn_v.weight", rnd(rng, (n_embd_gqa, n_embd), 0.2))
    w.add_tensor(p + "attn_output.weight", rnd(rng, (n_embd, n_embd), 0.1))


def add_ffn(w, rng, p, n_embd, n_ff):
    w.add_tensor(p + "ffn_gate.weight", rnd(rng, (n_ff, n_embd), 0.1))
    w.add_tensor(p + "ffn_up.weight", rnd(rng, (n_ff, n_embd), 0.1))
    w.add_tensor(p + "ffn_down.weight", rnd(rng, (n_embd, n_ff), 0.1))


def write_mamba(path, n_embd, d_inner, d_state, d_conv, dt_rank, n_layer, seed):
    rng = np.random.default_rng(seed)
    w = begin(path, "mamba", "mamba", n_embd, n_layer, 0, 0)
    add_ssm_hparams(w, d_conv, d_inner, d_state, dt_rank)
    w.add_layer_norm_rms_eps(1e-5)
    add_vocab_and_io(w, rng, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        add_mamba_mixer(w, rng, p, n_embd, d_inner, d_state, d_conv, dt_rank)
    finish(w)


def add_mamba_mixer(w, rng, p, n_embd, d_inner, d_state, d_conv, dt_rank, jamba_norms=False):
    """One Mamba layer's mixer; jamba adds RMS norms of dt, B and C (no random draws, so the
    draws, and mamba.gguf, are the same either way)."""
    w.add_tensor(p + "ssm_in.weight", rnd(rng, (2 * d_inner, n_embd), 0.1))
    w.add_tensor(p + "ssm_conv1d.weight", rnd(rng, (d_inner, d_conv), 0.3))
    w.add_tensor(p + "ssm_conv1d.bias", rnd(rng, (d_inner,), 0.05))
    w.add_tensor(p + "ssm_x.weight", rnd(rng, (dt_rank + 2 * d_state, d_inner), 0.1))
    if jamba_norms:
        w.add_tensor(p + "ssm_dt_norm.weight", np.ones(dt_rank, dtype=np.float32))
    w.add_tensor(p + "ssm_dt.weight", rnd(rng, (d_inner, dt_rank), 0.3))
    w.add_tensor(p + "ssm_dt.bias", rnd(rng, (d_inner,), 0.1) - 2.0)
    if jamba_norms:
        w.add_tensor(p + "ssm_b_norm.weight", np.ones(d_state, dtype=np.float32))
        w.add_tensor(p + "ssm_c_norm.weight", np.ones(d_state, dtype=np.float32))
    # A = -exp(A_log), A_log = log(1..d_state) as in Mamba's init
    a = -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1))
    w.add_tensor(p + "ssm_a", a.astype(np.float32))
    w.add_tensor(p + "ssm_d", np.ones(d_inner, dtype=np.float32))
    w.add_tensor(p + "ssm_out.weight", rnd(rng, (n_embd, d_inner), 0.1))


def write_gemma3_swa(path, n_embd, n_head, n_head_kv, n_ff, n_layer, window, pattern, seed):
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    n_embd_gqa = head_dim * n_head_kv
    w = begin(path, "gemma3", "gemma3-swa", n_embd, n_layer, n_ff, n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(window)
    w.add_uint32("gemma3.attention.sliding_window_pattern", pattern)
    add_vocab_and_io(w, rng, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        # gemma's (1 + w) norm weights are stored with the 1 added, as convert_hf_to_gguf does
        for norm in ["attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"]:
            w.add_tensor(p + norm + ".weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
        w.add_tensor(p + "attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        add_attention(w, rng, p, n_embd, n_embd_gqa)
        add_ffn(w, rng, p, n_embd, n_ff)
    finish(w)


def write_llama4_chunked(path, n_embd, n_head, n_head_kv, n_ff, n_layer, seed):
    """Llama 4 without MoE layers (the interleave step exceeds the layer count; llama.cpp still
    wants an expert count): its chunked attention, as a tiny dense model."""
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    n_embd_gqa = head_dim * n_head_kv
    w = begin(path, "llama4", "llama4-chunked", n_embd, n_layer, n_ff, n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(1)
    w.add_expert_used_count(1)
    w.add_expert_feed_forward_length(n_ff)
    w.add_uint32("llama4.interleave_moe_layer_step", 1000)
    add_vocab_and_io(w, rng, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        add_attention(w, rng, p, n_embd, n_embd_gqa)
        add_ffn(w, rng, p, n_embd, n_ff)
    finish(w)


def write_lfm2(path, n_embd, n_head, n_head_kv, n_ff, l_cache, seed, window=None):
    """LFM2: short-convolution layers (no KV heads; their state keeps the last l_cache - 1
    inputs and nothing else) and attention layers."""
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    n_embd_gqa = head_dim * n_head_kv
    w = begin(path, "lfm2", "lfm2" if window is None else "lfm2-swa", n_embd, 4, n_ff, n_head)
    w.add_head_count_kv([0, n_head_kv, 0, n_head_kv])
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_uint32("lfm2.shortconv.l_cache", l_cache)
    if window is not None:
        w.add_sliding_window(window)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_vocab = add_tokenizer(w)
    w.add_vocab_size(n_vocab)
    w.add_tensor("token_embd.weight", rnd(rng, (n_vocab, n_embd), 0.5))
    w.add_tensor("token_embd_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("output.weight", out_weight(rng, n_vocab, n_embd))
    for i in range(4):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        add_ffn(w, rng, p, n_embd, n_ff)
        if i % 2 == 1:
            w.add_tensor(p + "attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
            w.add_tensor(p + "attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
            add_attention(w, rng, p, n_embd, n_embd_gqa)
        else:
            w.add_tensor(p + "shortconv.conv.weight", rnd(rng, (n_embd, l_cache), 0.2))
            w.add_tensor(p + "shortconv.in_proj.weight", rnd(rng, (3 * n_embd, n_embd), 0.2))
            w.add_tensor(p + "shortconv.out_proj.weight", rnd(rng, (n_embd, n_embd), 0.2))
    finish(w)


def write_jamba(path, n_embd, n_head, n_head_kv, n_ff, d_state, d_conv, dt_rank, seed):
    """Layer 0 is Mamba (n_head_kv 0), layer 1 attention: jamba's layer filter."""
    rng = np.random.default_rng(seed)
    d_inner = 2 * n_embd
    head_dim = n_embd // n_head
    n_embd_gqa = head_dim * n_head_kv
    w = begin(path, "jamba", "jamba", n_embd, 2, n_ff, n_head)
    w.add_head_count_kv([0, n_head_kv])
    add_ssm_hparams(w, d_conv, d_inner, d_state, dt_rank)
    w.add_layer_norm_rms_eps(1e-5)
    add_vocab_and_io(w, rng, n_embd)
    for i in range(2):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        if i == 0:
            add_mamba_mixer(w, rng, p, n_embd, d_inner, d_state, d_conv, dt_rank, jamba_norms=True)
        else:
            add_attention(w, rng, p, n_embd, n_embd_gqa)
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        add_ffn(w, rng, p, n_embd, n_ff)
    finish(w)


def write_deepseek2_mla(path, n_embd, n_head, n_ff, n_layer, q_lora, kv_lora, rope, nope, v_head, seed,
                        indexer=None):
    """deepseek2 with multi-head latent attention (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash): one
    KV "head" of kv_lora + rope latent values per token, and since llama.cpp's MLA cache (0.1.161)
    no V at all, so its state files carry K blocks only. Dense layers only (the leading dense
    block count covers them all), so no experts are needed. `indexer`: (heads, head size, top k)
    makes it deepseek32 (DeepSeek-V3.2's sparse attention: 0.1.161 gives it a 'dsa' memory, an
    indexer key cache of one head beside the latent one)."""
    rng = np.random.default_rng(seed)
    arch = "deepseek2" if indexer is None else "deepseek32"
    w = begin(path, arch, os.path.splitext(os.path.basename(path))[0], n_embd, n_layer, n_ff, n_head)
    w.add_head_count_kv(1)
    w.add_key_length(kv_lora + rope)
    w.add_value_length(kv_lora)
    w.add_uint32(f"{arch}.attention.key_length_mla", nope + rope)
    w.add_uint32(f"{arch}.attention.value_length_mla", v_head)
    w.add_uint32(f"{arch}.attention.q_lora_rank", q_lora)
    w.add_uint32(f"{arch}.attention.kv_lora_rank", kv_lora)
    w.add_rope_dimension_count(rope)
    w.add_rope_freq_base(10000.0)
    # without YaRN scaling it changes nothing, but the seed's llama.cpp requires the key
    w.add_float32(f"{arch}.rope.scaling.yarn_log_multiplier", 0.1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_uint32(f"{arch}.leading_dense_block_count", n_layer)
    w.add_uint32(f"{arch}.expert_feed_forward_length", n_ff)
    w.add_uint32(f"{arch}.expert_shared_count", 0)
    if indexer is not None:
        idx_heads, idx_size, top_k = indexer
        w.add_uint32(f"{arch}.attention.indexer.head_count", idx_heads)
        w.add_uint32(f"{arch}.attention.indexer.key_length", idx_size)
        w.add_uint32(f"{arch}.attention.indexer.top_k", top_k)
        w.add_uint32(f"{arch}.expert_gating_func", 2)
    add_vocab_and_io(w, rng, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "attn_q_a_norm.weight", np.ones(q_lora, dtype=np.float32))
        w.add_tensor(p + "attn_kv_a_norm.weight", np.ones(kv_lora, dtype=np.float32))
        w.add_tensor(p + "attn_q_a.weight", rnd(rng, (q_lora, n_embd), 0.2))
        w.add_tensor(p + "attn_q_b.weight", rnd(rng, (n_head * (nope + rope), q_lora), 0.2))
        w.add_tensor(p + "attn_kv_a_mqa.weight", rnd(rng, (kv_lora + rope, n_embd), 0.2))
        w.add_tensor(p + "attn_k_b.weight", rnd(rng, (n_head, kv_lora, nope), 0.2))
        w.add_tensor(p + "attn_v_b.weight", rnd(rng, (n_head, v_head, kv_lora), 0.2))
        w.add_tensor(p + "attn_output.weight", rnd(rng, (n_embd, n_head * v_head), 0.1))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        if indexer is not None:
            w.add_tensor(p + "indexer.k_norm.weight", np.ones(idx_size, dtype=np.float32))
            w.add_tensor(p + "indexer.k_norm.bias", np.zeros(idx_size, dtype=np.float32))
            w.add_tensor(p + "indexer.proj.weight", rnd(rng, (idx_heads, n_embd), 0.2))
            w.add_tensor(p + "indexer.attn_k.weight", rnd(rng, (idx_size, n_embd), 0.2))
            w.add_tensor(p + "indexer.attn_q_b.weight", rnd(rng, (idx_heads * idx_size, q_lora), 0.2))
        add_ffn(w, rng, p, n_embd, n_ff)
    finish(w)


def write_qwen35(path, n_embd, n_head, n_head_kv, n_ff, n_layer, interval, seed):
    """Qwen3.5 (dense): gated-delta-net layers (recurrent: a conv state of the Q, K and V
    channels and one head_dim^2 state per value head) and every `interval`-th layer a gated
    attention layer with interleaved M-RoPE. KV heads on every layer, as the real models say:
    only `full_attention_interval` tells the recurrent layers (llama.cpp 0.1.161's filter).
    Its attention cells carry 0.1.161's cell extension."""
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    n_embd_gqa = head_dim * n_head_kv
    d_conv, d_state, n_group, n_v_heads = 4, 8, 2, 2
    key_dim, value_dim = d_state * n_group, d_state * n_v_heads
    conv_dim = 2 * key_dim + value_dim
    w = begin(path, "qwen35", "qwen35", n_embd, n_layer, n_ff, n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_sections([3, 3, 2, 0])
    w.add_rope_freq_base(10000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    add_ssm_hparams(w, d_conv, value_dim, d_state, n_v_heads)
    w.add_uint32("qwen35.ssm.group_count", n_group)
    w.add_uint32("qwen35.full_attention_interval", interval)
    add_vocab_and_io(w, rng, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "post_attention_norm.weight", np.ones(n_embd, dtype=np.float32))
        if (i + 1) % interval == 0:
            w.add_tensor(p + "attn_q.weight", rnd(rng, (2 * n_embd, n_embd), 0.2))  # query + gate
            w.add_tensor(p + "attn_k.weight", rnd(rng, (n_embd_gqa, n_embd), 0.2))
            w.add_tensor(p + "attn_v.weight", rnd(rng, (n_embd_gqa, n_embd), 0.2))
            w.add_tensor(p + "attn_output.weight", rnd(rng, (n_embd, n_embd), 0.1))
            w.add_tensor(p + "attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
            w.add_tensor(p + "attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        else:
            w.add_tensor(p + "attn_qkv.weight", rnd(rng, (conv_dim, n_embd), 0.2))
            w.add_tensor(p + "attn_gate.weight", rnd(rng, (value_dim, n_embd), 0.2))
            w.add_tensor(p + "ssm_conv1d.weight", rnd(rng, (conv_dim, d_conv), 0.3))
            w.add_tensor(p + "ssm_dt.bias", rnd(rng, (n_v_heads,), 0.1))
            w.add_tensor(p + "ssm_a", -np.arange(1, n_v_heads + 1, dtype=np.float32))
            w.add_tensor(p + "ssm_beta.weight", rnd(rng, (n_v_heads, n_embd), 0.2))
            w.add_tensor(p + "ssm_alpha.weight", rnd(rng, (n_v_heads, n_embd), 0.2))
            w.add_tensor(p + "ssm_norm.weight", np.ones(d_state, dtype=np.float32))
            w.add_tensor(p + "ssm_out.weight", rnd(rng, (n_embd, value_dim), 0.1))
        add_ffn(w, rng, p, n_embd, n_ff)
    finish(w)


def mamba2_dims(n_embd):
    """The tiny Mamba-2 mixers' (d_conv, d_inner, d_state, heads, groups): d_inner is twice the
    embedding, as Granite 4 requires."""
    return 4, 2 * n_embd, 8, 4, 2


def add_mamba2_hparams(w, arch, d_conv, d_inner, d_state, n_ssm_head, n_group):
    add_ssm_hparams(w, d_conv, d_inner, d_state, n_ssm_head)
    w.add_uint32(f"{arch}.ssm.group_count", n_group)


def add_mamba2_mixer(w, rng, p, n_embd, d_inner, d_state, d_conv, n_ssm_head, n_group):
    """One Mamba-2 mixer (Nemotron-H, Falcon-H1, Granite 4): its in-projection gives x, z, B, C
    and dt; the convolution runs over x, B and C (d_inner + 2 x n_group x d_state channels)."""
    channels = d_inner + 2 * n_group * d_state
    w.add_tensor(p + "ssm_in.weight", rnd(rng, (2 * d_inner + 2 * n_group * d_state + n_ssm_head, n_embd), 0.1))
    w.add_tensor(p + "ssm_conv1d.weight", rnd(rng, (channels, d_conv), 0.3))
    w.add_tensor(p + "ssm_conv1d.bias", rnd(rng, (channels,), 0.05))
    w.add_tensor(p + "ssm_dt.bias", rnd(rng, (n_ssm_head,), 0.1) - 2.0)
    w.add_tensor(p + "ssm_a", -np.arange(1, n_ssm_head + 1, dtype=np.float32).reshape(n_ssm_head, 1))
    w.add_tensor(p + "ssm_d", np.ones((n_ssm_head, 1), dtype=np.float32))
    w.add_tensor(p + "ssm_norm.weight", np.ones((n_group, d_inner // n_group), dtype=np.float32))
    w.add_tensor(p + "ssm_out.weight", rnd(rng, (n_embd, d_inner), 0.1))


def write_nemotron_h(path, n_embd, n_head, n_head_kv, n_ff, seed):
    """Nemotron-H: a Mamba-2 layer (no KV heads, no FFN: recurrent), an attention layer (KV
    heads, no FFN) and an MLP-only layer (no KV heads, an FFN), which llama.cpp 0.1.161 puts in
    neither part of the hybrid memory. Mamba-2's groups convolve B and C beside x, so the conv
    state is (d_conv - 1) x (d_inner + 2 x n_group x d_state) wide."""
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    n_embd_gqa = head_dim * n_head_kv
    d_conv, d_inner, d_state, n_ssm_head, n_group = mamba2_dims(n_embd)
    w = begin(path, "nemotron_h", "nemotron_h", n_embd, 3, [0, 0, n_ff], n_head)
    w.add_head_count_kv([0, n_head_kv, 0])
    add_mamba2_hparams(w, "nemotron_h", d_conv, d_inner, d_state, n_ssm_head, n_group)
    w.add_float32("nemotron_h.attention.layer_norm_epsilon", 1e-5)
    w.add_layer_norm_rms_eps(1e-5)
    add_vocab_and_io(w, rng, n_embd)
    for i in range(3):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        if i == 0:
            add_mamba2_mixer(w, rng, p, n_embd, d_inner, d_state, d_conv, n_ssm_head, n_group)
        elif i == 1:
            add_attention(w, rng, p, n_embd, n_embd_gqa)
        else:
            w.add_tensor(p + "ffn_up.weight", rnd(rng, (n_ff, n_embd), 0.1))
            w.add_tensor(p + "ffn_down.weight", rnd(rng, (n_embd, n_ff), 0.1))
    finish(w)


def write_falcon_h1(path, n_embd, n_head, n_head_kv, n_ff, n_layer, seed):
    """Falcon-H1: attention and a Mamba-2 mixer side by side in every layer, so llama.cpp
    0.1.161's hybrid memory keeps every layer in both parts (K/V rows and conv/SSM states)."""
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    n_embd_gqa = head_dim * n_head_kv
    d_conv, d_inner, d_state, n_ssm_head, n_group = mamba2_dims(n_embd)
    w = begin(path, "falcon-h1", "falcon-h1", n_embd, n_layer, n_ff, n_head)
    w.add_head_count_kv(n_head_kv)
    add_mamba2_hparams(w, "falcon-h1", d_conv, d_inner, d_state, n_ssm_head, n_group)
    w.add_layer_norm_rms_eps(1e-5)
    add_vocab_and_io(w, rng, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        add_mamba2_mixer(w, rng, p, n_embd, d_inner, d_state, d_conv, n_ssm_head, n_group)
        add_attention(w, rng, p, n_embd, n_embd_gqa)
        w.add_tensor(p + "ffn_norm", np.ones(n_embd, dtype=np.float32))
        add_ffn(w, rng, p, n_embd, n_ff)
    finish(w)


def write_granite_hybrid(path, n_embd, n_head, n_head_kv, n_ff, seed):
    """Granite 4 (granitehybrid, dense): a Mamba-2 layer (no KV heads) and an attention layer,
    each with its FFN. Its recurrent layers are those without KV heads, as Jamba's; Mamba-2's
    groups widen the conv state to (d_conv - 1) x (d_inner + 2 x n_group x d_state)."""
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    n_embd_gqa = head_dim * n_head_kv
    d_conv, d_inner, d_state, n_ssm_head, n_group = mamba2_dims(n_embd)
    w = begin(path, "granitehybrid", "granitehybrid", n_embd, 2, n_ff, n_head)
    w.add_head_count_kv([0, n_head_kv])
    add_mamba2_hparams(w, "granitehybrid", d_conv, d_inner, d_state, n_ssm_head, n_group)
    w.add_layer_norm_rms_eps(1e-5)
    add_vocab_and_io(w, rng, n_embd)
    for i in range(2):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        if i == 0:
            add_mamba2_mixer(w, rng, p, n_embd, d_inner, d_state, d_conv, n_ssm_head, n_group)
        else:
            add_attention(w, rng, p, n_embd, n_embd_gqa)
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        add_ffn(w, rng, p, n_embd, n_ff)
    finish(w)


def write_deepseek4(path, n_embd, n_head, head_dim, rope, q_lora, o_groups, o_lora, ratios, window, n_expert,
                    n_expert_used, n_ff_exp, hc_mult, indexer, seed):
    """deepseek4 (DeepSeek-V4): one K "head" per token (K is V), every layer sliding-window
    attention over a raw cache, and per layer a compression ratio (`ratios`): 0 raw only, 4 (CSA)
    adds a cache of one compressed row per 4 tokens with its lightning indexer (a key cache of
    one head of the indexer's size, `indexer`: (heads, head size, top k)) and 128 (HCA) a cache of
    one row per 128 tokens; the compressors keep the not yet compressed tokens in states of their
    own. llama.cpp 0.1.161 gives it its 'dsv4' memory. The residual stream is `hc_mult` wide
    (hyper-connections: 0.1.161 requires 4); the FFN is MoE (sqrt-softplus routing, one shared
    expert), with no hash-routed layers and no MTP block."""
    rng = np.random.default_rng(seed)
    n_layer = len(ratios)
    idx_heads, idx_size, top_k = indexer
    hc_dim, hc_mix = hc_mult * n_embd, (2 + hc_mult) * hc_mult
    w = begin(path, "deepseek4", "deepseek4", n_embd, n_layer, n_ff_exp, n_head)
    w.add_head_count_kv(1)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(rope)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_uint32("deepseek4.attention.q_lora_rank", q_lora)
    w.add_sliding_window(window)
    w.add_array("deepseek4.attention.compress_ratios", list(ratios))
    w.add_float32("deepseek4.attention.compress_rope_freq_base", 160000.0)
    w.add_uint32("deepseek4.attention.output_group_count", o_groups)
    w.add_uint32("deepseek4.attention.output_lora_rank", o_lora)
    w.add_uint32("deepseek4.attention.indexer.head_count", idx_heads)
    w.add_uint32("deepseek4.attention.indexer.key_length", idx_size)
    w.add_uint32("deepseek4.attention.indexer.top_k", top_k)
    w.add_uint32("deepseek4.expert_count", n_expert)
    w.add_uint32("deepseek4.expert_used_count", n_expert_used)
    w.add_uint32("deepseek4.expert_feed_forward_length", n_ff_exp)
    w.add_uint32("deepseek4.expert_shared_count", 1)
    w.add_float32("deepseek4.expert_weights_scale", 1.5)
    w.add_bool("deepseek4.expert_weights_norm", True)
    w.add_uint32("deepseek4.expert_gating_func", 4)  # LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS
    w.add_float32("deepseek4.swiglu_clamp_exp", 10.0)
    w.add_uint32("deepseek4.hash_layer_count", 0)
    w.add_uint32("deepseek4.hyper_connection.count", hc_mult)
    w.add_uint32("deepseek4.hyper_connection.sinkhorn_iterations", 20)
    w.add_float32("deepseek4.hyper_connection.epsilon", 1e-6)
    add_vocab_and_io(w, rng, n_embd)
    w.add_tensor("output_hc_fn.weight", rnd(rng, (hc_mult, hc_dim), 0.1))
    w.add_tensor("output_hc_base.weight", rnd(rng, (hc_mult,), 0.1))
    w.add_tensor("output_hc_scale.weight", np.ones(1, dtype=np.float32))
    for i, ratio in enumerate(ratios):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "attn_sinks.weight", rnd(rng, (n_head,), 0.1))
        w.add_tensor(p + "attn_q_a.weight", rnd(rng, (q_lora, n_embd), 0.2))
        w.add_tensor(p + "attn_q_a_norm.weight", np.ones(q_lora, dtype=np.float32))
        w.add_tensor(p + "attn_q_b.weight", rnd(rng, (n_head * head_dim, q_lora), 0.2))
        w.add_tensor(p + "attn_kv.weight", rnd(rng, (head_dim, n_embd), 0.2))
        w.add_tensor(p + "attn_kv_a_norm.weight", np.ones(head_dim, dtype=np.float32))
        # stored (o_groups x o_lora, n_head x head_dim / o_groups); llama.cpp reshapes it per group
        w.add_tensor(p + "attn_output_a.weight", rnd(rng, (o_groups * o_lora, n_head * head_dim // o_groups), 0.1))
        w.add_tensor(p + "attn_output_b.weight", rnd(rng, (n_embd, o_groups * o_lora), 0.1))
        for part in ["attn", "ffn"]:
            w.add_tensor(p + f"hc_{part}_fn.weight", rnd(rng, (hc_mix, hc_dim), 0.1))
            w.add_tensor(p + f"hc_{part}_base.weight", rnd(rng, (hc_mix,), 0.1))
            w.add_tensor(p + f"hc_{part}_scale.weight", np.ones(3, dtype=np.float32))
        if ratio != 0:
            coff = 2 if ratio == 4 else 1  # CSA's compressor windows overlap: two halves per row
            w.add_tensor(p + "attn_compressor_kv.weight", rnd(rng, (coff * head_dim, n_embd), 0.2))
            w.add_tensor(p + "attn_compressor_gate.weight", rnd(rng, (coff * head_dim, n_embd), 0.2))
            w.add_tensor(p + "attn_compressor_ape.weight", rnd(rng, (ratio, coff * head_dim), 0.1))
            w.add_tensor(p + "attn_compressor_norm.weight", np.ones(head_dim, dtype=np.float32))
        if ratio == 4:
            w.add_tensor(p + "indexer.proj.weight", rnd(rng, (idx_heads, n_embd), 0.2))
            w.add_tensor(p + "indexer.attn_q_b.weight", rnd(rng, (idx_heads * idx_size, q_lora), 0.2))
            w.add_tensor(p + "indexer_compressor_kv.weight", rnd(rng, (2 * idx_size, n_embd), 0.2))
            w.add_tensor(p + "indexer_compressor_gate.weight", rnd(rng, (2 * idx_size, n_embd), 0.2))
            w.add_tensor(p + "indexer_compressor_ape.weight", rnd(rng, (ratio, 2 * idx_size), 0.1))
            w.add_tensor(p + "indexer_compressor_norm.weight", np.ones(idx_size, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "ffn_gate_inp.weight", rnd(rng, (n_expert, n_embd), 0.2))
        w.add_tensor(p + "exp_probs_b.bias", rnd(rng, (n_expert,), 0.1))
        w.add_tensor(p + "ffn_gate_exps.weight", rnd(rng, (n_expert, n_ff_exp, n_embd), 0.1))
        w.add_tensor(p + "ffn_up_exps.weight", rnd(rng, (n_expert, n_ff_exp, n_embd), 0.1))
        w.add_tensor(p + "ffn_down_exps.weight", rnd(rng, (n_expert, n_embd, n_ff_exp), 0.1))
        w.add_tensor(p + "ffn_gate_shexp.weight", rnd(rng, (n_ff_exp, n_embd), 0.1))
        w.add_tensor(p + "ffn_up_shexp.weight", rnd(rng, (n_ff_exp, n_embd), 0.1))
        w.add_tensor(p + "ffn_down_shexp.weight", rnd(rng, (n_embd, n_ff_exp), 0.1))
    finish(w)


def finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "models")
    os.makedirs(out, exist_ok=True)
    write_llama(os.path.join(out, "llama-h16.gguf"), 64, 4, 2, 128, 2, seed=16)
    write_llama(os.path.join(out, "llama-h32.gguf"), 128, 4, 2, 128, 2, seed=32)
    write_mamba(os.path.join(out, "mamba.gguf"), 64, 128, 16, 4, 4, 2, seed=64)
    write_llama(os.path.join(out, "llama-l64.gguf"), 64, 4, 2, 32, 64, seed=1664)
    write_llama(os.path.join(out, "llama-h64.gguf"), 128, 2, 1, 128, 2, seed=6464)
    write_gemma3_swa(os.path.join(out, "gemma3-swa.gguf"), 128, 2, 1, 128, 2, 4, 2, seed=3)
    write_jamba(os.path.join(out, "jamba.gguf"), 64, 4, 2, 128, 16, 4, 4, seed=1612)
    write_llama4_chunked(os.path.join(out, "llama4-chunked.gguf"), 32, 2, 1, 64, 4, seed=4)
    write_lfm2(os.path.join(out, "lfm2.gguf"), 32, 2, 1, 64, 3, seed=2)
    write_lfm2(os.path.join(out, "lfm2-swa.gguf"), 32, 2, 1, 64, 3, seed=2, window=4)
    write_qwen2(os.path.join(out, "qwen2-h64.gguf"), 128, 2, 1, 128, 2, seed=264)
    write_qwen2(os.path.join(out, "qwen2-h64-yarn.gguf"), 128, 2, 1, 128, 2, seed=265, yarn=(4.0, 64))
    write_llama(os.path.join(out, "llama-h64-yarn.gguf"), 128, 2, 1, 128, 2, seed=6412, yarn=(12.0, 64))
    write_qwen2vl(os.path.join(out, "qwen2vl.gguf"), 128, 2, 1, 128, 2, seed=2002)
    write_deepseek2_mla(os.path.join(out, "deepseek2-mla.gguf"), 64, 2, 64, 2, q_lora=32, kv_lora=32, rope=16,
                        nope=16, v_head=16, seed=2222)
    write_deepseek2_mla(os.path.join(out, "deepseek32-dsa.gguf"), 64, 2, 64, 2, q_lora=32, kv_lora=32, rope=16,
                        nope=16, v_head=16, seed=3232, indexer=(2, 64, 4))
    write_qwen35(os.path.join(out, "qwen35.gguf"), 32, 2, 1, 64, 4, interval=2, seed=35)
    write_nemotron_h(os.path.join(out, "nemotron-h.gguf"), 32, 2, 1, 64, seed=4242)
    write_falcon_h1(os.path.join(out, "falcon-h1.gguf"), 32, 2, 1, 64, 2, seed=1111)
    write_granite_hybrid(os.path.join(out, "granite-hybrid.gguf"), 32, 2, 1, 64, seed=4040)
    write_deepseek4(os.path.join(out, "deepseek4.gguf"), 64, 4, 32, 16, q_lora=32, o_groups=2, o_lora=16,
                    ratios=[0, 4, 128], window=8, n_expert=4, n_expert_used=2, n_ff_exp=32, hc_mult=4,
                    indexer=(2, 64, 8), seed=4444)
    # shared vocab, for mapping the peers' token strings back to ids
    import json
    tokens, _, types = build_vocab()
    with open(os.path.join(out, "vocab.json"), "w") as f:
        json.dump({"tokens": [t.decode("utf-8") for t in tokens], "types": types}, f)
    for f in sorted(os.listdir(out)):
        if f.endswith(".gguf"):
            print(f, os.path.getsize(os.path.join(out, f)))


if __name__ == "__main__":
    main()
