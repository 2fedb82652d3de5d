// kv-bench: times llama.cpp 0.1.103's own KV cache operations through its C API, for the
// same-run comparison in bench/llama.mjs (which drives this process, our Rust core and our JS
// binding in interleaved rounds).
//
// Protocol, one command per line on stdin, one JSON line back:
//   setup <model> <n_ctx> <n_seq> <dir> <bytes>
//                                         creates a context (f16 K/V, V transposed, one thread)
//                                         and fills it with the sequence states <dir>/seq-<s>.bin
//                                         (written by our core in llama.cpp's format), one
//                                         contiguous block per sequence; <bytes> (the size of the
//                                         K/V tensors) sizes the memcpy/memset baselines;
//                                         answers {kv_size, whole_bytes}
//   time <op>                             restores the filled cache (untimed), runs the op's
//                                         untimed preparation, times the op once; answers {ns}
//   quit
// A command that fails answers {"error": "..."}.

#include "line-protocol.h"
#include "llama.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

static llama_model   * g_model = nullptr;
static llama_context * g_ctx   = nullptr;
static int             g_n_seq = 0;
static int             g_len   = 0;  // cells per sequence
static std::vector<std::vector<uint8_t>> g_seq_blobs;
static std::vector<uint8_t> g_whole;  // llama_state_get_data of the filled context
static std::vector<uint8_t> g_src, g_dst;  // memcpy / memset baselines, the size of the tensors
static std::vector<uint8_t> g_out;  // a reused output buffer, as large as the whole state

static void quiet_log(ggml_log_level, const char *, void *) {}

static bool read_file(const std::string & path, std::vector<uint8_t> & out) {
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        return false;
    }
    out.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    return true;
}

static bool setup(std::istringstream & in) {
    std::string model, dir;
    int n_ctx;
    size_t bytes;
    if (!(in >> model >> n_ctx >> g_n_seq >> dir >> bytes)) {
        answer_error("setup: expected <model> <n_ctx> <n_seq> <dir> <bytes>");
        return false;
    }
    if (g_ctx) {
        llama_free(g_ctx);
    }
    if (!g_model) {
        llama_model_params mp = llama_model_default_params();
        mp.n_gpu_layers = 0;
        g_model = llama_model_load_from_file(model.c_str(), mp);
        if (!g_model) {
            answer_error("setup: cannot load model " + model);
            return false;
        }
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx           = n_ctx;
    cp.n_seq_max       = g_n_seq;
    cp.flash_attn      = false;
    cp.type_k          = GGML_TYPE_F16;
    cp.type_v          = GGML_TYPE_F16;
    // the graphs timed here (K-shift, defrag) do not depend on the batch; a small ubatch keeps
    // the worst-case compute buffer llama.cpp reserves at creation small
    cp.n_batch         = 32;
    cp.n_ubatch        = 32;
    cp.defrag_thold    = -1.0f;
    cp.n_threads       = 1;
    cp.n_threads_batch = 1;
    cp.no_perf         = true;
    g_ctx = llama_init_from_model(g_model, cp);
    if (!g_ctx) {
        answer_error("setup: cannot create context");
        return false;
    }
    g_len = n_ctx / g_n_seq;
    g_seq_blobs.assign(g_n_seq, {});
    for (int s = 0; s < g_n_seq; s++) {
        std::string path = dir + "/seq-" + std::to_string(s) + ".bin";
        if (!read_file(path, g_seq_blobs[s])) {
            answer_error("setup: cannot read " + path);
            return false;
        }
        if (llama_state_seq_set_data(g_ctx, g_seq_blobs[s].data(), g_seq_blobs[s].size(), s) == 0) {
            answer_error("setup: llama.cpp rejected " + path);
            return false;
        }
    }
    if (llama_kv_self_used_cells(g_ctx) != n_ctx) {
        answer_error("setup: the cache is not full after the sequence loads");
        return false;
    }
    g_whole.resize(llama_state_get_size(g_ctx));
    g_whole.resize(llama_state_get_data(g_ctx, g_whole.data(), g_whole.size()));
    g_out.assign(g_whole.size(), 0);
    g_src.assign(bytes, 1);
    g_dst.assign(bytes, 0);
    printf("{\"kv_size\":%d,\"whole_bytes\":%zu}\n", n_ctx, g_whole.size());
    fflush(stdout);
    return true;
}

using clock_type = std::chrono::steady_clock;

static volatile size_t g_sink;

// Restores the filled cache, then makes a few O(1) calls, as the other two sides do after theirs.
static void restore() {
    llama_state_set_data(g_ctx, g_whole.data(), g_whole.size());
    llama_kv_self_update(g_ctx);
    for (int k = 0; k < 3; k++) {
        g_sink = llama_kv_self_used_cells(g_ctx);
    }
}

// Runs `op` on the restored cache and returns its time in ns, or -1 for an unknown op.
static long long time_op(const std::string & op) {
    restore();
    const int s = 3 % g_n_seq;
    const int L = g_len;
    auto t0 = clock_type::now();
    auto since = [&]() {
        return (long long) std::chrono::duration_cast<std::chrono::nanoseconds>(clock_type::now() - t0).count();
    };
    long long ns = -1;
    if (op == "seq_rm_mid") {
        t0 = clock_type::now();
        llama_kv_self_seq_rm(g_ctx, s, L / 4, L / 2);
        ns = since();
    } else if (op == "seq_rm_tail") {
        t0 = clock_type::now();
        llama_kv_self_seq_rm(g_ctx, s, L - 16, -1);
        ns = since();
    } else if (op == "seq_add") {
        t0 = clock_type::now();
        llama_kv_self_seq_add(g_ctx, s, L / 2, -1, -(L / 4));
        ns = since();
    } else if (op == "seq_div") {
        t0 = clock_type::now();
        llama_kv_self_seq_div(g_ctx, s, 0, -1, 2);
        ns = since();
    } else if (op == "seq_cp") {
        t0 = clock_type::now();
        llama_kv_self_seq_cp(g_ctx, s, (s + 1) % g_n_seq, 0, -1);
        ns = since();
    } else if (op == "seq_rm_short") {
        t0 = clock_type::now();
        llama_kv_self_seq_rm(g_ctx, s, L / 2, L / 2 + 16);
        ns = since();
    } else if (op == "seq_add_short") {
        t0 = clock_type::now();
        llama_kv_self_seq_add(g_ctx, s, L - 16, -1, 16);
        ns = since();
    } else if (op == "seq_div_short") {
        t0 = clock_type::now();
        llama_kv_self_seq_div(g_ctx, s, L - 16, -1, 2);
        ns = since();
    } else if (op == "seq_cp_short") {
        t0 = clock_type::now();
        llama_kv_self_seq_cp(g_ctx, s, (s + 1) % g_n_seq, L / 2, L / 2 + 16);
        ns = since();
    } else if (op == "seq_keep") {
        t0 = clock_type::now();
        llama_kv_self_seq_keep(g_ctx, s);
        ns = since();
    } else if (op == "seq_pos_max") {
        t0 = clock_type::now();
        g_sink = llama_kv_self_seq_pos_max(g_ctx, s);
        ns = since();
    } else if (op == "clear") {
        t0 = clock_type::now();
        llama_kv_self_clear(g_ctx);
        ns = since();
    } else if (op == "defrag_update") {
        for (int q = 1; q < g_n_seq; q += 2) {
            llama_kv_self_seq_rm(g_ctx, q, -1, -1);
        }
        t0 = clock_type::now();
        llama_kv_self_defrag(g_ctx);
        llama_kv_self_update(g_ctx);
        ns = since();
    } else if (op == "defrag_scattered") {
        // a hole of one cell every 64 positions of every sequence: the defrag fills each with
        // one of the last cells, 1,024 moves of one cell at 65,536 cells
        for (int q = 0; q < g_n_seq; q++) {
            for (int p = 0; p < g_len; p += 64) {
                llama_kv_self_seq_rm(g_ctx, q, p, p + 1);
            }
        }
        t0 = clock_type::now();
        llama_kv_self_defrag(g_ctx);
        llama_kv_self_update(g_ctx);
        ns = since();
    } else if (op == "kshift_all") {
        for (int q = 0; q < g_n_seq; q++) {
            llama_kv_self_seq_add(g_ctx, q, 0, -1, 1);
        }
        t0 = clock_type::now();
        llama_kv_self_update(g_ctx);
        ns = since();
    } else if (op == "seq_get") {
        t0 = clock_type::now();
        std::vector<uint8_t> buf(llama_state_seq_get_size(g_ctx, s));
        g_sink = llama_state_seq_get_data(g_ctx, buf.data(), buf.size(), s);
        ns = since();
    } else if (op == "seq_set") {
        llama_kv_self_seq_rm(g_ctx, s, -1, -1);
        t0 = clock_type::now();
        g_sink = llama_state_seq_set_data(g_ctx, g_seq_blobs[s].data(), g_seq_blobs[s].size(), s);
        ns = since();
    } else if (op == "seq_get_into") {
        t0 = clock_type::now();
        g_sink = llama_state_seq_get_data(g_ctx, g_out.data(), g_out.size(), s);
        ns = since();
    } else if (op == "state_get_into") {
        t0 = clock_type::now();
        g_sink = llama_state_get_data(g_ctx, g_out.data(), g_out.size());
        ns = since();
    } else if (op == "state_get") {
        t0 = clock_type::now();
        std::vector<uint8_t> buf(llama_state_get_size(g_ctx));
        g_sink = llama_state_get_data(g_ctx, buf.data(), buf.size());
        ns = since();
    } else if (op == "state_set") {
        t0 = clock_type::now();
        g_sink = llama_state_set_data(g_ctx, g_whole.data(), g_whole.size());
        ns = since();
    } else if (op == "set_all") {
        t0 = clock_type::now();
        llama_kv_self_clear(g_ctx);
        for (int q = 0; q < g_n_seq; q++) {
            g_sink = llama_state_seq_set_data(g_ctx, g_seq_blobs[q].data(), g_seq_blobs[q].size(), q);
        }
        ns = since();
    } else if (op == "memcpy") {
        t0 = clock_type::now();
        memcpy(g_dst.data(), g_src.data(), g_src.size());
        ns = since();
        g_sink = g_dst[g_dst.size() / 2];
    } else if (op == "copy_new_seq" || op == "copy_new_whole") {
        // the baseline of a state get into new memory: a copy of the same bytes into a fresh
        // allocation (freed after the timer, as the state gets' buffers are)
        const std::vector<uint8_t> & from = op == "copy_new_seq" ? g_seq_blobs[s] : g_whole;
        t0 = clock_type::now();
        uint8_t * p = static_cast<uint8_t *>(malloc(from.size()));
        memcpy(p, from.data(), from.size());
        ns = since();
        g_sink = p[from.size() / 2];
        free(p);
    } else if (op == "memcpy_seq") {
        // memcpy of exactly one sequence's state bytes into the reused buffer: a 2 MiB copy
        // is not a scaled-down 16 MiB one (the C library streams large copies past the cache)
        const std::vector<uint8_t> & from = g_seq_blobs[s];
        t0 = clock_type::now();
        memcpy(g_out.data(), from.data(), from.size());
        ns = since();
        g_sink = g_out[from.size() / 2];
    } else if (op == "memset") {
        t0 = clock_type::now();
        memset(g_dst.data(), 0, g_dst.size());
        ns = since();
        g_sink = g_dst[g_dst.size() / 2];
    }
    // a pending K-shift of seq_add / seq_div must not leak into the next op's timing
    llama_kv_self_update(g_ctx);
    return ns;
}

int main() {
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    serve_lines([](const std::string & cmd, std::istringstream & in) {
        if (cmd == "setup") {
            setup(in);
            return;
        }
        if (cmd != "time") {
            answer_error("unknown command " + cmd);
            return;
        }
        std::string op;
        in >> op;
        if (!g_ctx) {
            answer_error("no context: send setup first");
            return;
        }
        long long ns = time_op(op);
        if (ns < 0) {
            answer_error("unknown op " + op);
            return;
        }
        printf("{\"ns\":%lld}\n", ns);
        fflush(stdout);
    });
    return 0;  // the process ends here: the OS frees the context and the model
}
