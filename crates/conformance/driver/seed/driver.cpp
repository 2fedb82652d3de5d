// kv-driver: llama.cpp 0.1.103 as a differential oracle for the llama-kv-cache crate.
//
// Reads one op per line on stdin, applies it to a real llama_context through the public API and
// prints one JSON line: the op's return value plus everything the public API shows of the KV
// cache (n_tokens, used cells, seq_pos_max of every sequence, the full cache view, and the KV
// bytes of state blobs). The protocol is described in crates/conformance/src/seed/oracle.rs.

#include "llama.h"
// internal headers (the driver is built from llama.cpp's source): `hparams` reads what the
// loader derived from the GGUF, which the public API does not show
#include "llama-arch.h"
#include "llama-model.h"
#include "llama-model-loader.h"

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

static llama_model   * g_model   = nullptr;
static llama_context * g_ctx     = nullptr;
static std::string     g_model_path;
static int32_t         g_n_seq_max = 1;
static std::map<int, std::vector<uint8_t>> g_slots;

static void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR && getenv("KV_DRIVER_VERBOSE")) {
        fputs(text, stderr);
    }
}

static void fail(const std::string & msg) {
    printf("{\"error\":\"%s\"}\n", msg.c_str());
    fflush(stdout);
}

static std::string hex(const uint8_t * p, size_t n) {
    static const char * digits = "0123456789abcdef";
    std::string out;
    out.resize(2 * n);
    for (size_t i = 0; i < n; i++) {
        out[2 * i]     = digits[p[i] >> 4];
        out[2 * i + 1] = digits[p[i] & 15];
    }
    return out;
}

// offset of the KV part in a whole-context state: arch string, output ids, logits, embeddings
static size_t kv_offset(const std::vector<uint8_t> & b) {
    size_t o = 0;
    auto u32 = [&](void) { uint32_t v; memcpy(&v, b.data() + o, 4); o += 4; return v; };
    auto u64 = [&](void) { uint64_t v; memcpy(&v, b.data() + o, 8); o += 8; return v; };
    uint32_t arch_len = u32();
    o += arch_len;
    int32_t n_outputs = (int32_t) u32();
    o += 4 * (size_t) n_outputs;
    uint64_t logits = u64();
    o += 4 * logits;
    uint64_t embd = u64();
    o += 4 * embd;
    return o;
}

static void report(long long ret, const std::string & blob_hex, bool has_blob) {
    std::ostringstream js;
    js << "{\"ret\":" << ret;
    js << ",\"n_tokens\":" << llama_kv_self_n_tokens(g_ctx);
    js << ",\"used\":" << llama_kv_self_used_cells(g_ctx);
    js << ",\"pos_max\":[";
    for (int s = 0; s < g_n_seq_max; s++) {
        js << (s ? "," : "") << llama_kv_self_seq_pos_max(g_ctx, s);
    }
    js << "]";
    llama_kv_cache_view view = llama_kv_cache_view_init(g_ctx, g_n_seq_max);
    llama_kv_cache_view_update(g_ctx, &view);
    js << ",\"view_used\":" << view.used_cells << ",\"token_count\":" << view.token_count;
    js << ",\"max_contig\":" << view.max_contiguous << ",\"max_contig_idx\":" << view.max_contiguous_idx;
    js << ",\"pos\":[";
    for (int i = 0; i < view.n_cells; i++) {
        js << (i ? "," : "") << view.cells[i].pos;
    }
    js << "],\"seqs\":[";
    for (int i = 0; i < view.n_cells; i++) {
        js << (i ? ",[" : "[");
        bool first = true;
        for (int j = 0; j < view.n_seq_max; j++) {
            llama_seq_id s = view.cells_sequences[i * view.n_seq_max + j];
            if (s >= 0) {
                js << (first ? "" : ",") << s;
                first = false;
            }
        }
        js << "]";
    }
    js << "]";
    llama_kv_cache_view_free(&view);
    if (has_blob) {
        js << ",\"blob\":\"" << blob_hex << "\"";
    }
    js << "}";
    printf("%s\n", js.str().c_str());
    fflush(stdout);
}

// `hparams <path> <full>`: the hyper-parameters llama.cpp derives from a GGUF, as one JSON line.
// full = 1 loads the whole model (tensors too) like llama_model_load_from_file; full = 0 runs only
// the loader's load_arch + load_hparams, so a GGUF with metadata and no tensors is enough.
static void do_hparams(std::istringstream & in) {
    std::string path;
    int full = 0;
    if (!(in >> path >> full)) {
        fail("hparams: expected path full");
        return;
    }
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * loaded = nullptr;
    std::unique_ptr<llama_model> own;
    const llama_model * m = nullptr;
    try {
        if (full) {
            loaded = llama_model_load_from_file(path.c_str(), mp);
            if (!loaded) {
                fail("hparams: cannot load model " + path);
                return;
            }
            m = loaded;
        } else {
            std::vector<std::string> splits;
            llama_model_loader ml(path, splits, false, false, nullptr, nullptr);
            own.reset(new llama_model(mp));
            own->load_arch(ml);
            own->load_hparams(ml);
            m = own.get();
        }
    } catch (const std::exception & e) {
        std::string msg = e.what();
        for (auto & c : msg) {
            if (c == '"' || c == '\\' || c == '\n') c = ' ';
        }
        fail("hparams: " + msg);
        return;
    }
    const auto & h = m->hparams;
    std::ostringstream js;
    js.precision(9);
    auto arr = [&](const char * name, auto f) {
        js << ",\"" << name << "\":[";
        for (uint32_t il = 0; il < h.n_layer; il++) {
            js << (il ? "," : "") << f(il);
        }
        js << "]";
    };
    js << "{\"arch\":\"" << llm_arch_name(m->arch) << "\"";
    js << ",\"n_layer\":" << h.n_layer << ",\"n_ctx_train\":" << h.n_ctx_train << ",\"n_embd\":" << h.n_embd;
    js << ",\"n_embd_head_k\":" << h.n_embd_head_k << ",\"n_embd_head_v\":" << h.n_embd_head_v << ",\"n_rot\":" << h.n_rot;
    arr("n_head", [&](uint32_t il) { return h.n_head(il); });
    arr("n_head_kv", [&](uint32_t il) { return h.n_head_kv(il); });
    arr("n_embd_k_gqa", [&](uint32_t il) { return h.n_embd_k_gqa(il); });
    arr("n_embd_v_gqa", [&](uint32_t il) { return h.n_embd_v_gqa(il); });
    arr("is_swa", [&](uint32_t il) { return h.is_swa(il) ? 1 : 0; });
    js << ",\"rope_type\":" << (int) h.rope_type << ",\"rope_freq_base\":" << h.rope_freq_base_train;
    js << ",\"rope_freq_scale\":" << h.rope_freq_scale_train << ",\"rope_freq_base_swa\":" << h.rope_freq_base_train_swa;
    js << ",\"rope_freq_scale_swa\":" << h.rope_freq_scale_train_swa << ",\"n_ctx_orig_yarn\":" << h.n_ctx_orig_yarn;
    js << ",\"rope_attn_factor\":" << h.rope_attn_factor << ",\"rope_yarn_log_mul\":" << h.rope_yarn_log_mul;
    js << ",\"rope_finetuned\":" << (h.rope_finetuned ? 1 : 0) << ",\"rope_scaling_type\":" << (int) h.rope_scaling_type_train;
    js << ",\"n_swa\":" << h.n_swa << ",\"n_swa_pattern\":" << h.n_swa_pattern;
    js << ",\"ssm_d_conv\":" << h.ssm_d_conv << ",\"ssm_d_inner\":" << h.ssm_d_inner << ",\"ssm_d_state\":" << h.ssm_d_state;
    js << ",\"ssm_dt_rank\":" << h.ssm_dt_rank << ",\"wkv_head_size\":" << h.wkv_head_size;
    js << ",\"token_shift_count\":" << h.token_shift_count;
    js << ",\"n_embd_k_s\":" << h.n_embd_k_s() << ",\"n_embd_v_s\":" << h.n_embd_v_s();
    js << ",\"recurrent\":" << (llama_model_is_recurrent(m) ? 1 : 0) << "}";
    printf("%s\n", js.str().c_str());
    fflush(stdout);
    if (loaded) {
        llama_model_free(loaded);
    }
}

static bool do_init(std::istringstream & in) {
    std::string path;
    int n_ctx, n_seq_max, flash_attn, type_k, type_v, n_batch, n_ubatch;
    float defrag_thold;
    if (!(in >> path >> n_ctx >> n_seq_max >> flash_attn >> type_k >> type_v >> n_batch >> n_ubatch >> defrag_thold)) {
        fail("init: expected model n_ctx n_seq_max flash_attn type_k type_v n_batch n_ubatch defrag_thold");
        return false;
    }
    if (g_ctx) {
        llama_free(g_ctx);
        g_ctx = nullptr;
    }
    g_slots.clear();
    if (!g_model || path != g_model_path) {
        if (g_model) {
            llama_model_free(g_model);
        }
        llama_model_params mp = llama_model_default_params();
        mp.n_gpu_layers = 0;
        g_model = llama_model_load_from_file(path.c_str(), mp);
        if (!g_model) {
            fail("init: cannot load model " + path);
            return false;
        }
        g_model_path = path;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx           = n_ctx;
    cp.n_seq_max       = n_seq_max;
    cp.flash_attn      = flash_attn != 0;
    cp.type_k          = (ggml_type) type_k;
    cp.type_v          = (ggml_type) type_v;
    cp.n_batch         = n_batch;
    cp.n_ubatch        = n_ubatch;
    cp.defrag_thold    = defrag_thold;
    cp.n_threads       = 1;
    cp.n_threads_batch = 1;
    cp.no_perf         = true;
    g_ctx = llama_init_from_model(g_model, cp);
    if (!g_ctx) {
        fail("init: cannot create context");
        return false;
    }
    g_n_seq_max = n_seq_max;
    llama_kv_cache_view view = llama_kv_cache_view_init(g_ctx, 1);
    llama_kv_cache_view_update(g_ctx, &view);
    printf("{\"kv_size\":%d,\"n_ctx\":%u,\"n_batch\":%u,\"n_ubatch\":%u,\"n_layer\":%d}\n", view.n_cells,
           llama_n_ctx(g_ctx), llama_n_batch(g_ctx), llama_n_ubatch(g_ctx), llama_model_n_layer(g_model));
    llama_kv_cache_view_free(&view);
    fflush(stdout);
    return true;
}

static void do_decode(std::istringstream & in) {
    int n;
    in >> n;
    llama_batch batch = llama_batch_init(n, 0, g_n_seq_max);
    batch.n_tokens = n;
    for (int i = 0; i < n; i++) {
        int tok, pos, k;
        in >> tok >> pos >> k;
        batch.token[i]    = tok;
        batch.pos[i]      = pos;
        batch.n_seq_id[i] = k;
        for (int j = 0; j < k; j++) {
            in >> batch.seq_id[i][j];
        }
        batch.logits[i] = i == n - 1;
    }
    int ret = llama_decode(g_ctx, batch);
    llama_batch_free(batch);
    report(ret, "", false);
}

int main() {
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream in(line);
        std::string op;
        if (!(in >> op)) {
            continue;
        }
        if (op == "quit") {
            break;
        }
        if (op == "init") {
            do_init(in);
            continue;
        }
        if (op == "hparams") {
            do_hparams(in);
            continue;
        }
        if (!g_ctx) {
            fail("no context: send init first");
            continue;
        }
        if (op == "decode") {
            do_decode(in);
        } else if (op == "seq_rm") {
            int s, p0, p1;
            in >> s >> p0 >> p1;
            report(llama_kv_self_seq_rm(g_ctx, s, p0, p1) ? 1 : 0, "", false);
        } else if (op == "seq_cp") {
            int a, b, p0, p1;
            in >> a >> b >> p0 >> p1;
            llama_kv_self_seq_cp(g_ctx, a, b, p0, p1);
            report(0, "", false);
        } else if (op == "seq_keep") {
            int s;
            in >> s;
            llama_kv_self_seq_keep(g_ctx, s);
            report(0, "", false);
        } else if (op == "seq_add") {
            int s, p0, p1, d;
            in >> s >> p0 >> p1 >> d;
            llama_kv_self_seq_add(g_ctx, s, p0, p1, d);
            report(0, "", false);
        } else if (op == "seq_div") {
            int s, p0, p1, d;
            in >> s >> p0 >> p1 >> d;
            llama_kv_self_seq_div(g_ctx, s, p0, p1, d);
            report(0, "", false);
        } else if (op == "update") {
            llama_kv_self_update(g_ctx);
            report(0, "", false);
        } else if (op == "defrag") {
            llama_kv_self_defrag(g_ctx);
            report(0, "", false);
        } else if (op == "clear") {
            llama_kv_self_clear(g_ctx);
            report(0, "", false);
        } else if (op == "seq_get") {
            int s, slot;
            in >> s >> slot;
            std::vector<uint8_t> buf(llama_state_seq_get_size(g_ctx, s));
            size_t n = llama_state_seq_get_data(g_ctx, buf.data(), buf.size(), s);
            buf.resize(n);
            g_slots[slot] = buf;
            report((long long) n, hex(buf.data(), buf.size()), true);
        } else if (op == "seq_set") {
            int slot, dst;
            in >> slot >> dst;
            const auto & buf = g_slots[slot];
            size_t n = llama_state_seq_set_data(g_ctx, buf.data(), buf.size(), dst);
            report((long long) n, "", false);
        } else if (op == "state_get") {
            int slot;
            in >> slot;
            std::vector<uint8_t> buf(llama_state_get_size(g_ctx));
            size_t n = llama_state_get_data(g_ctx, buf.data(), buf.size());
            buf.resize(n);
            g_slots[slot] = buf;
            size_t o = kv_offset(buf);
            report((long long) (n - o), hex(buf.data() + o, n - o), true);
        } else if (op == "state_set") {
            int slot;
            in >> slot;
            const auto & buf = g_slots[slot];
            size_t n = llama_state_set_data(g_ctx, buf.data(), buf.size());
            // report the KV part's size, as for state_get
            report(n == 0 ? 0 : (long long) (n - kv_offset(buf)), "", false);
        } else {
            fail("unknown op " + op);
        }
    }
    if (g_ctx) {
        llama_free(g_ctx);
    }
    if (g_model) {
        llama_model_free(g_model);
    }
    llama_backend_free();
    return 0;
}
