// today-driver: llama.cpp 0.1.161 (crates.io llama-cpp-sys-2) as a peer for the llama-kv-cache crate.
//
// One action per run, options as key=value arguments; prints one JSON line on stdout.
//
//   today-driver gen  model=M [context options] prompts=1,2,3[;4,5] [session=F] [seq_file=F seq=S]
//                     [shift=P0:P1:D] [post_session=F]
//       decodes prompt i into sequence i (all in one batch), takes the greedy next token of each
//       sequence (`next`), saves the requested files, then decodes `next` of every sequence at
//       its next position and reports the greedy token after it (`next2`).
//       shift=P0:P1:D (after saving): seq_rm(0, P0, P1), seq_add(0, P1, -1, -D), then the
//       decode of `next` at the shifted position applies the K-shift; post_session= saves after it.
//   today-driver cont model=M [context options] (session=F | seq_file=F) [dest=S] token=T pos=P
//       loads the file (a session into the whole context, a sequence file into sequence `dest`),
//       decodes token T at position P of sequence `dest` (default 0) and reports the greedy
//       next token (`next`). `pos_max` is the sequence's largest position after the load.
//
//   today-driver turns model=M [context options] tokens=1,2,3 turns=N1,N2 out=PREFIX
//       decodes the conversation `tokens` turn by turn (each turn in batches of n_batch) and
//       after the turn ending at token Ni saves PREFIX-Ni.ggsn (session) and PREFIX-Ni.ggsq
//       (sequence 0), as an app that saves after every turn does.
//   today-driver branches model=M [context options] tokens=1,2,3 tails=4,5;6,7 out=PREFIX
//       decodes the shared prefix `tokens` once, then for each tail k: removes the previous
//       tail (seq_rm), decodes tail k after the prefix and saves the session PREFIX-k.ggsn:
//       many conversations that share a prefix, as a server's slots have them.
//   today-driver resume model=M [context options] (session=F | seq_file=F) tokens=1,2,3
//       loads the file into a fresh context (a sequence file into sequence 0), checks that its
//       tokens begin `tokens`, evaluates only the rest and reports how many tokens it loaded
//       and evaluated, and the logits after the last one. Without a file: a cold run of all.
//
//   today-driver trace model=M [context options]
//       the differential oracle of the live caches: reads one operation per line on stdin and
//       answers each with one JSON line of the memory's cells (every non-empty cell of every
//       stream of every part, read through the internal headers) and seq_pos_min/max:
//         decode S:P:N[,S:P:N...]   a batch of N tokens of sequence S at positions P.. per group
//         rm S P0 P1 | cp S D P0 P1 | keep S | add S P0 P1 D | div S P0 P1 D   sequence ops
//         save S | load S           state of sequence S into a buffer / the buffer into S
//         clear                     llama_memory_clear(data)
//       `ret` is llama_decode's result (decode), or 1/0 for the others.
//
//   today-driver bench model=M [context options] dir=D
//       llama.cpp's side of the live-cache benchmark (`cargo run --release -p conformance --bin
//       bench-live`): loads the sequence states D/seq-<s>.bin into sequences 0.. (written by
//       our core), keeps the filled state, then answers `time <op>` with {"ns": ...}: the
//       filled state restored (untimed), the op timed once. `quit` ends it.
//
//   today-driver hparams model=M
//       the hyper-parameters llama.cpp derives from the GGUF (`llama_model::hparams`, read
//       through the internal headers), per layer where they can differ; no context is made.
//
//   today-driver memory model=M [context options]
//       makes the context and reports the line llama.cpp logs for each cache it builds
//       ("llama_kv_cache: size = ... MiB (N cells, L layers, S/T seqs), K (...)", and
//       "llama_memory_recurrent: size = ..."), each attention cache's rotation after it
//       ("llama_kv_cache: n_rot_k = 64, n_embd_head_k_all = 64", n_rot_v alike), in the order
//       they are built: {"lines": [...]}.
//
// context options: ctx=N ubatch=N seqs=N fa=0|1 type_k=ID type_v=ID unified=0|1 swa_full=0|1
// Failures print {"error": "..."} and exit 1.

#include "llama.h"
// internal: `hparams` reads llama_model::hparams, which the public API does not show per layer
#include "llama-model.h"
// internal: `trace` reads the cells of the memory's caches
#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"
#include "llama-kv-cells.h"
#include "llama-memory-hybrid.h"
#include "llama-memory-hybrid-iswa.h"
#include "llama-memory-recurrent.h"

#include <iostream>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

static std::map<std::string, std::string> g_args;

static void quiet_log(ggml_log_level level, const char * text, void *) {
    if (getenv("TODAY_DRIVER_VERBOSE") || level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

// the lines in which llama.cpp reports each memory it builds ("llama_kv_cache: size = ...",
// and an attention cache's rotation: "llama_kv_cache: n_rot_k = 64, ...")
static std::vector<std::string> g_memory_lines;

static void memory_log(ggml_log_level level, const char * text, void *) {
    if (strstr(text, ": size = ") || strstr(text, ": n_rot_k = ") || strstr(text, ": n_rot_v = ")) {
        std::string line(text);
        while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) {
            line.pop_back();
        }
        g_memory_lines.push_back(line);
    }
    quiet_log(level, text, nullptr);
}

[[noreturn]] static void die(const std::string & msg) {
    printf("{\"error\":\"%s\"}\n", msg.c_str());
    exit(1);
}

static std::string arg(const char * key, const char * def = nullptr) {
    auto it = g_args.find(key);
    if (it != g_args.end()) {
        return it->second;
    }
    if (!def) {
        die(std::string("missing argument ") + key);
    }
    return def;
}

static int iarg(const char * key, const char * def = nullptr) { return atoi(arg(key, def).c_str()); }

static std::vector<int> ints(const std::string & s, char sep) {
    std::vector<int> out;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, sep)) {
        if (!item.empty()) {
            out.push_back(atoi(item.c_str()));
        }
    }
    return out;
}

static void print_hparams(const llama_model * m) {
    const auto & h = m->hparams;
    std::ostringstream js;
    js.precision(9);
    auto arr = [&](const char * name, auto f) {
        js << ",\"" << name << "\":[";
        for (uint32_t il = 0; il < h.n_layer(); il++) {
            js << (il ? "," : "") << f(il);
        }
        js << "]";
    };
    js << "{\"n_layer\":" << h.n_layer() << ",\"n_ctx_train\":" << h.n_ctx_train;
    arr("n_head_kv", [&](uint32_t il) { return h.n_head_kv(il); });
    arr("n_embd_head_k", [&](uint32_t il) { return h.n_embd_head_k(il); });
    arr("n_embd_head_v", [&](uint32_t il) { return h.n_embd_head_v(il); });
    arr("n_embd_k_gqa", [&](uint32_t il) { return h.n_embd_k_gqa(il); });
    arr("n_embd_v_gqa", [&](uint32_t il) { return h.n_embd_v_gqa(il); });
    arr("n_rot", [&](uint32_t il) { return h.n_rot(il); });
    arr("is_swa", [&](uint32_t il) { return h.is_swa(il) ? 1 : 0; });
    arr("is_recr", [&](uint32_t il) { return h.is_recr(il) ? 1 : 0; });
    js << ",\"rope_type\":" << (int) h.rope_type << ",\"rope_freq_base\":" << h.rope_freq_base_train;
    js << ",\"rope_freq_scale\":" << h.rope_freq_scale_train << ",\"n_ctx_orig_yarn\":" << h.n_ctx_orig_yarn;
    js << ",\"n_swa\":" << h.n_swa << ",\"n_embd_r\":" << h.n_embd_r() << ",\"n_embd_s\":" << h.n_embd_s();
    // what has_cell_ext() decides by: M-RoPE positions or PLE heads
    js << ",\"n_pos_per_embd\":" << h.n_pos_per_embd() << ",\"ple_n_heads\":" << h.ple_n_heads;
    js << ",\"recurrent\":" << (llama_model_is_recurrent(m) ? 1 : 0);
    js << ",\"hybrid\":" << (llama_model_is_hybrid(m) ? 1 : 0) << "}";
    printf("%s\n", js.str().c_str());
}

static llama_context * make_context(llama_model * model) {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx           = iarg("ctx", "64");
    cp.n_batch         = cp.n_ctx;
    cp.n_ubatch        = iarg("ubatch", "0") > 0 ? iarg("ubatch", "0") : cp.n_ctx;
    cp.n_batch         = cp.n_ubatch;
    cp.n_seq_max       = iarg("seqs", "1");
    cp.n_threads       = 1;
    cp.n_threads_batch = 1;
    cp.flash_attn_type = iarg("fa", "0") ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k          = (ggml_type) iarg("type_k", "1");
    cp.type_v          = (ggml_type) iarg("type_v", "1");
    cp.kv_unified      = iarg("unified", "1") != 0;
    cp.swa_full        = iarg("swa_full", "0") != 0;
    cp.no_perf         = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        die("cannot create the context");
    }
    return ctx;
}

static int argmax(llama_context * ctx, int i, int n_vocab) {
    const float * logits = llama_get_logits_ith(ctx, i);
    if (!logits) {
        die("no logits");
    }
    int best = 0;
    for (int t = 1; t < n_vocab; t++) {
        if (logits[t] > logits[best]) {
            best = t;
        }
    }
    return best;
}

// decodes one token per entry (token, pos, seq); returns the greedy next token of each entry
static std::vector<int> decode(llama_context * ctx, int n_vocab, const std::vector<int> & tok,
                               const std::vector<int> & pos, const std::vector<int> & seq) {
    llama_batch b = llama_batch_init((int32_t) tok.size(), 0, 1);
    for (size_t i = 0; i < tok.size(); i++) {
        b.token[i]     = tok[i];
        b.pos[i]       = pos[i];
        b.n_seq_id[i]  = 1;
        b.seq_id[i][0] = seq[i];
        b.logits[i]    = 1;
    }
    b.n_tokens = (int32_t) tok.size();
    if (llama_decode(ctx, b) != 0) {
        llama_batch_free(b);
        die("llama_decode failed");
    }
    std::vector<int> out;
    for (size_t i = 0; i < tok.size(); i++) {
        out.push_back(argmax(ctx, (int) i, n_vocab));
    }
    llama_batch_free(b);
    return out;
}

static std::string json_list(const std::vector<int> & v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); i++) {
        s += (i ? "," : "") + std::to_string(v[i]);
    }
    return s + "]";
}

static void gen(llama_model * model, llama_context * ctx, int n_vocab) {
    std::vector<std::vector<int>> prompts;
    std::stringstream ss(arg("prompts"));
    std::string item;
    while (std::getline(ss, item, ';')) {
        prompts.push_back(ints(item, ','));
    }
    std::vector<int> tok, pos, seq, last;
    std::vector<int> all_tokens;
    for (size_t s = 0; s < prompts.size(); s++) {
        for (size_t i = 0; i < prompts[s].size(); i++) {
            tok.push_back(prompts[s][i]);
            pos.push_back((int) i);
            seq.push_back((int) s);
            all_tokens.push_back(prompts[s][i]);
        }
        last.push_back((int) tok.size() - 1);
    }
    std::vector<int> greedy = decode(ctx, n_vocab, tok, pos, seq);
    std::vector<int> next;
    for (int i : last) {
        next.push_back(greedy[i]);
    }
    if (g_args.count("session")) {
        if (!llama_state_save_file(ctx, arg("session").c_str(), all_tokens.data(), all_tokens.size())) {
            die("llama_state_save_file failed");
        }
    }
    if (g_args.count("seq_file")) {
        const int s = iarg("seq");
        const auto & p = prompts.at(s);
        if (!llama_state_seq_save_file(ctx, arg("seq_file").c_str(), s, p.data(), p.size())) {
            die("llama_state_seq_save_file failed");
        }
    }
    llama_memory_t mem = llama_get_memory(ctx);
    std::vector<int> next_pos;
    for (size_t s = 0; s < prompts.size(); s++) {
        next_pos.push_back((int) prompts[s].size());
    }
    if (g_args.count("shift")) {
        std::vector<int> sh = ints(arg("shift"), ':');
        if (sh.size() != 3) {
            die("shift=P0:P1:D");
        }
        llama_memory_seq_rm(mem, 0, sh[0], sh[1]);
        llama_memory_seq_add(mem, 0, sh[1], -1, -sh[2]);
        next_pos[0] -= sh[2];
    }
    std::vector<int> s_ids;
    for (size_t s = 0; s < prompts.size(); s++) {
        s_ids.push_back((int) s);
    }
    std::vector<int> next2 = decode(ctx, n_vocab, next, next_pos, s_ids);
    if (g_args.count("post_session")) {
        std::vector<int> t = all_tokens;
        if (!llama_state_save_file(ctx, arg("post_session").c_str(), t.data(), t.size())) {
            die("llama_state_save_file (post) failed");
        }
    }
    printf("{\"next\":%s,\"next2\":%s,\"n_vocab\":%d,\"arch_swa\":%d}\n", json_list(next).c_str(),
           json_list(next2).c_str(), n_vocab, (int) llama_model_n_swa(model));
}

static void cont(llama_context * ctx, int n_vocab) {
    std::vector<llama_token> tokens(65536);
    size_t n = 0;
    const int dest = iarg("dest", "0");
    if (g_args.count("session")) {
        if (!llama_state_load_file(ctx, arg("session").c_str(), tokens.data(), tokens.size(), &n)) {
            die("llama_state_load_file failed");
        }
    } else {
        if (!llama_state_seq_load_file(ctx, arg("seq_file").c_str(), dest, tokens.data(), tokens.size(), &n)) {
            die("llama_state_seq_load_file failed");
        }
    }
    const int pos_max = llama_memory_seq_pos_max(llama_get_memory(ctx), dest);
    std::vector<int> next = decode(ctx, n_vocab, {iarg("token")}, {iarg("pos")}, {dest});
    printf("{\"next\":%d,\"pos_max\":%d,\"n_tokens\":%zu}\n", next[0], pos_max, n);
}

// decodes tokens[from, to) of sequence 0 at their positions, n_batch at a time; returns the
// logits after the last one
static std::vector<float> eval_range(llama_context * ctx, int n_vocab, const std::vector<int> & tokens, size_t from,
                                     size_t to) {
    const size_t step = llama_n_batch(ctx);
    std::vector<float> last;
    for (size_t at = from; at < to; at += step) {
        const size_t n = std::min(step, to - at);
        llama_batch b = llama_batch_init((int32_t) n, 0, 1);
        for (size_t i = 0; i < n; i++) {
            b.token[i]     = tokens[at + i];
            b.pos[i]       = (int) (at + i);
            b.n_seq_id[i]  = 1;
            b.seq_id[i][0] = 0;
            b.logits[i]    = at + i + 1 == to;
        }
        b.n_tokens = (int32_t) n;
        if (llama_decode(ctx, b) != 0) {
            llama_batch_free(b);
            die("llama_decode failed");
        }
        if (at + n == to) {
            const float * l = llama_get_logits_ith(ctx, (int) n - 1);
            last.assign(l, l + n_vocab);
        }
        llama_batch_free(b);
    }
    return last;
}

static void turns(llama_context * ctx, int n_vocab) {
    const std::vector<int> tokens = ints(arg("tokens"), ',');
    size_t done = 0;
    for (int end : ints(arg("turns"), ',')) {
        if (end <= (int) done || end > (int) tokens.size()) {
            die("turns must ascend within the tokens");
        }
        eval_range(ctx, n_vocab, tokens, done, end);
        done = end;
        const std::string base = arg("out") + "-" + std::to_string(end);
        if (!llama_state_save_file(ctx, (base + ".ggsn").c_str(), tokens.data(), end)) {
            die("llama_state_save_file failed");
        }
        if (!llama_state_seq_save_file(ctx, (base + ".ggsq").c_str(), 0, tokens.data(), end)) {
            die("llama_state_seq_save_file failed");
        }
    }
    printf("{\"saved\":%zu}\n", done);
}

static void branches(llama_context * ctx, int n_vocab) {
    const std::vector<int> prefix = ints(arg("tokens"), ',');
    eval_range(ctx, n_vocab, prefix, 0, prefix.size());
    std::stringstream ss(arg("tails"));
    std::string item;
    int k = 0;
    while (std::getline(ss, item, ';')) {
        llama_memory_seq_rm(llama_get_memory(ctx), 0, (llama_pos) prefix.size(), -1);
        std::vector<int> all = prefix;
        for (int t : ints(item, ',')) {
            all.push_back(t);
        }
        eval_range(ctx, n_vocab, all, prefix.size(), all.size());
        const std::string out = arg("out") + "-" + std::to_string(k++) + ".ggsn";
        if (!llama_state_save_file(ctx, out.c_str(), all.data(), all.size())) {
            die("llama_state_save_file failed");
        }
    }
    printf("{\"saved\":%d}\n", k);
}

static void resume(llama_context * ctx, int n_vocab) {
    const std::vector<int> tokens = ints(arg("tokens"), ',');
    std::vector<llama_token> file_tokens(tokens.size() + 1);
    size_t n = 0;
    if (g_args.count("session")) {
        if (!llama_state_load_file(ctx, arg("session").c_str(), file_tokens.data(), file_tokens.size(), &n)) {
            die("llama_state_load_file failed");
        }
    } else if (g_args.count("seq_file")) {
        if (!llama_state_seq_load_file(ctx, arg("seq_file").c_str(), 0, file_tokens.data(), file_tokens.size(), &n)) {
            die("llama_state_seq_load_file failed");
        }
    }
    for (size_t i = 0; i < n; i++) {
        if (i >= tokens.size() || file_tokens[i] != tokens[i]) {
            die("the file's tokens are not a prefix of the conversation");
        }
    }
    if (n >= tokens.size()) {
        die("the file holds the whole conversation: nothing to evaluate");
    }
    const int pos_max = llama_memory_seq_pos_max(llama_get_memory(ctx), 0);
    const std::vector<float> logits = eval_range(ctx, n_vocab, tokens, n, tokens.size());
    std::ostringstream js;
    js.precision(9);
    js << "{\"loaded\":" << n << ",\"pos_max\":" << pos_max << ",\"evaluated\":" << tokens.size() - n
       << ",\"logits\":[";
    for (size_t i = 0; i < logits.size(); i++) {
        js << (i ? "," : "") << logits[i];
    }
    js << "]}";
    printf("%s\n", js.str().c_str());
}

// the non-empty cells of every stream of one cache: "i:pos:shift:s.s.s" joined by spaces
static std::string cells_json(const llama_kv_cache * kv, int n_seq_max) {
    std::ostringstream js;
    js << "{\"size\":" << kv->get_size() << ",\"streams\":[";
    const int n_stream = (int) kv->get_n_stream();
    for (int s = 0; s < n_stream; s++) {
        // a unified cache has one stream; otherwise sequence s has stream s
        const llama_kv_cells & cells = kv->get_cells(n_stream == 1 ? 0 : s);
        js << (s ? "," : "") << "\"";
        bool first = true;
        for (uint32_t i = 0; i < cells.size(); i++) {
            if (cells.is_empty(i)) {
                continue;
            }
            js << (first ? "" : " ") << i << ":" << cells.pos_get(i) << ":" << cells.get_shift(i) << ":";
            first = false;
            bool first_seq = true;
            for (int q = 0; q < n_seq_max; q++) {
                if (cells.seq_has(i, q)) {
                    js << (first_seq ? "" : ".") << q;
                    first_seq = false;
                }
            }
        }
        js << "\"";
    }
    js << "]}";
    return js.str();
}

// a recurrent memory: its head, used counter, non-empty cells "i:pos:s.s" and each
// sequence's tail cell
static std::string recurrent_json(const llama_memory_recurrent * r) {
    std::ostringstream js;
    js << "{\"size\":" << r->size << ",\"head\":" << r->head << ",\"used\":" << r->used << ",\"cells\":\"";
    bool first = true;
    for (uint32_t i = 0; i < r->size; i++) {
        const auto & c = r->cells[i];
        if (c.is_empty()) {
            continue;
        }
        js << (first ? "" : " ") << i << ":" << c.pos << ":";
        first = false;
        bool first_seq = true;
        for (llama_seq_id q : c.seq_id) {
            js << (first_seq ? "" : ".") << q;
            first_seq = false;
        }
    }
    js << "\",\"tails\":\"";
    for (uint32_t i = 0; i < r->size; i++) {
        js << (i ? "," : "") << r->cells[i].tail;
    }
    js << "\"}";
    return js.str();
}

static void trace(llama_context * ctx, int n_vocab) {
    llama_memory_t mem = llama_get_memory(ctx);
    const int n_seq_max = (int) llama_n_seq_max(ctx);
    std::vector<const llama_kv_cache *> parts;
    const llama_memory_recurrent * recr = nullptr;
    if (auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem)) {
        parts = {iswa->get_base(), iswa->get_swa()};
    } else if (auto * kv = dynamic_cast<llama_kv_cache *>(mem)) {
        parts = {kv};
    } else if (auto * hybrid_iswa = dynamic_cast<llama_memory_hybrid_iswa *>(mem)) {
        parts = {hybrid_iswa->get_mem_attn()->get_base(), hybrid_iswa->get_mem_attn()->get_swa()};
        recr  = hybrid_iswa->get_mem_recr();
    } else if (auto * hybrid = dynamic_cast<llama_memory_hybrid *>(mem)) {
        parts = {hybrid->get_mem_attn()};
        recr  = hybrid->get_mem_recr();
    } else if (auto * r = dynamic_cast<llama_memory_recurrent *>(mem)) {
        recr = r;
    } else {
        die("trace: the memory is none of attention, iSWA, hybrid (-iSWA) and recurrent");
    }
    std::vector<uint8_t> saved;
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream in(line);
        std::string op;
        in >> op;
        int ret = 1;
        int a = 0, b = 0, c = 0, d = 0;
        if (op == "decode") {
            std::string groups;
            in >> groups;
            std::vector<int> tok, pos, seq;
            std::stringstream gs(groups);
            std::string g;
            while (std::getline(gs, g, ',')) {
                std::vector<int> v = ints(g, ':');
                for (int k = 0; k < v.at(2); k++) {
                    pos.push_back(v[1] + k);
                    seq.push_back(v[0]);
                    tok.push_back((v[1] + k) * 7 % n_vocab);
                }
            }
            llama_batch bt = llama_batch_init((int32_t) tok.size(), 0, 1);
            for (size_t i = 0; i < tok.size(); i++) {
                bt.token[i]     = tok[i];
                bt.pos[i]       = pos[i];
                bt.n_seq_id[i]  = 1;
                bt.seq_id[i][0] = seq[i];
                bt.logits[i]    = i + 1 == tok.size();
            }
            bt.n_tokens = (int32_t) tok.size();
            ret = llama_decode(ctx, bt);
            llama_batch_free(bt);
        } else if (op == "rm") {
            in >> a >> b >> c;
            ret = llama_memory_seq_rm(mem, a, b, c) ? 1 : 0;
        } else if (op == "cp") {
            in >> a >> b >> c >> d;
            llama_memory_seq_cp(mem, a, b, c, d);
        } else if (op == "keep") {
            in >> a;
            llama_memory_seq_keep(mem, a);
        } else if (op == "add") {
            in >> a >> b >> c >> d;
            llama_memory_seq_add(mem, a, b, c, d);
        } else if (op == "div") {
            in >> a >> b >> c >> d;
            llama_memory_seq_div(mem, a, b, c, d);
        } else if (op == "save") {
            in >> a;
            saved.resize(llama_state_seq_get_size(ctx, a));
            ret = llama_state_seq_get_data(ctx, saved.data(), saved.size(), a) == saved.size() ? 1 : 0;
        } else if (op == "load") {
            in >> a;
            ret = llama_state_seq_set_data(ctx, saved.data(), saved.size(), a) == saved.size() ? 1 : 0;
        } else if (op == "savep") {
            // PARTIAL_ONLY: what llama-server keeps as a context checkpoint
            in >> a;
            saved.resize(llama_state_seq_get_size_ext(ctx, a, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY));
            ret = llama_state_seq_get_data_ext(ctx, saved.data(), saved.size(), a, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) == saved.size() ? 1 : 0;
        } else if (op == "loadp") {
            in >> a;
            ret = llama_state_seq_set_data_ext(ctx, saved.data(), saved.size(), a, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) == saved.size() ? 1 : 0;
        } else if (op == "dump") {
            std::string path;
            in >> path;
            std::ofstream f(path, std::ios::binary);
            f.write((const char *) saved.data(), (std::streamsize) saved.size());
            ret = f.good() ? 1 : 0;
        } else if (op == "undump") {
            std::string path;
            in >> path;
            std::ifstream f(path, std::ios::binary);
            saved.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
            ret = f.good() || f.eof() ? 1 : 0;
        } else if (op == "clear") {
            llama_memory_clear(mem, true);
        } else {
            die("trace: unknown op " + op);
        }
        std::ostringstream js;
        js << "{\"ret\":" << ret << ",\"parts\":[";
        for (size_t k = 0; k < parts.size(); k++) {
            js << (k ? "," : "") << cells_json(parts[k], n_seq_max);
        }
        js << "]";
        if (recr) {
            js << ",\"recr\":" << recurrent_json(recr);
        }
        js << ",\"pos\":[";
        for (int q = 0; q < n_seq_max; q++) {
            js << (q ? "," : "") << "[" << llama_memory_seq_pos_min(mem, q) << "," << llama_memory_seq_pos_max(mem, q)
               << "]";
        }
        js << "]}";
        printf("%s\n", js.str().c_str());
        fflush(stdout);
    }
}

static void bench(llama_context * ctx) {
    llama_memory_t mem = llama_get_memory(ctx);
    const int n_seq = (int) llama_n_seq_max(ctx);
    std::vector<std::vector<uint8_t>> blobs(n_seq);
    for (int s = 0; s < n_seq; s++) {
        const std::string path = arg("dir") + "/seq-" + std::to_string(s) + ".bin";
        std::ifstream f(path, std::ios::binary);
        // 0.1.161's in-memory sequence state starts with its magic and the sequence id
        const uint32_t magic = 0xaf143cd8;
        blobs[s].resize(8);
        memcpy(blobs[s].data(), &magic, 4);
        memcpy(blobs[s].data() + 4, &s, 4);
        blobs[s].insert(blobs[s].end(), std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
        if (blobs[s].size() == 8 || llama_state_seq_set_data(ctx, blobs[s].data(), blobs[s].size(), s) == 0) {
            die("bench: cannot load " + path);
        }
    }
    std::vector<uint8_t> whole(llama_state_get_size(ctx));
    whole.resize(llama_state_get_data(ctx, whole.data(), whole.size()));
    std::vector<uint8_t> out(blobs[0].size() * 2);
    std::vector<uint8_t> src(blobs[0].size(), 1), dst(blobs[0].size());
    const int L = llama_memory_seq_pos_max(mem, 0) + 1;
    printf("{\"len\":%d,\"whole_bytes\":%zu,\"seq_bytes\":%zu}\n", L, whole.size(), blobs[0].size() - 8);
    fflush(stdout);
    static volatile size_t sink;
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream in(line);
        std::string cmd, op;
        in >> cmd >> op;
        if (cmd == "quit") {
            break;
        }
        llama_state_set_data(ctx, whole.data(), whole.size());
        for (int k = 0; k < 3; k++) {
            sink = llama_memory_seq_pos_max(mem, k % n_seq);
        }
        const int s = 3 % n_seq;
        const auto t0 = std::chrono::steady_clock::now();
        if (op == "seq_rm_tail") {
            llama_memory_seq_rm(mem, s, L - 16, -1);
        } else if (op == "seq_rm_mid") {
            llama_memory_seq_rm(mem, s, L / 4, L / 2);
        } else if (op == "seq_cp") {
            llama_memory_seq_cp(mem, s, (s + 1) % n_seq, -1, -1);
        } else if (op == "seq_keep") {
            llama_memory_seq_keep(mem, s);
        } else if (op == "seq_add") {
            llama_memory_seq_add(mem, s, L / 2, -1, -(L / 4));
        } else if (op == "seq_div") {
            llama_memory_seq_div(mem, s, 0, -1, 2);
        } else if (op == "seq_pos_max") {
            sink = llama_memory_seq_pos_max(mem, s);
        } else if (op == "seq_get") {
            sink = llama_state_seq_get_data(ctx, out.data(), out.size(), 0);
        } else if (op == "seq_set") {
            sink = llama_state_seq_set_data(ctx, blobs[0].data(), blobs[0].size(), 0);
        } else if (op == "memcpy") {
            memcpy(dst.data(), src.data(), src.size());
            sink = dst[dst.size() / 2];
        } else {
            die("bench: unknown op " + op);
        }
        const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0);
        printf("{\"ns\":%lld}\n", (long long) ns.count());
        fflush(stdout);
    }
}

int main(int argc, char ** argv) {
    if (argc < 2) {
        die("usage: today-driver gen|cont|turns|branches|resume|trace|bench|hparams|memory key=value...");
    }
    for (int i = 2; i < argc; i++) {
        const char * eq = strchr(argv[i], '=');
        if (!eq) {
            die(std::string("not key=value: ") + argv[i]);
        }
        g_args[std::string(argv[i], eq - argv[i])] = eq + 1;
    }
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(arg("model").c_str(), mp);
    if (!model) {
        die("cannot load the model");
    }
    const std::string action = argv[1];
    if (action == "hparams") {
        print_hparams(model);
        fflush(stdout);
        llama_model_free(model);
        return 0;
    }
    if (action == "memory") {
        // the memory the context builds, as llama.cpp's own log lines report it (one per
        // cache, in the order they are built); the lines hold no quote or backslash
        llama_log_set(memory_log, nullptr);
        llama_context * ctx = make_context(model);
        printf("{\"lines\":[");
        for (size_t i = 0; i < g_memory_lines.size(); i++) {
            printf("%s\"%s\"", i ? "," : "", g_memory_lines[i].c_str());
        }
        printf("]}\n");
        fflush(stdout);
        llama_free(ctx);
        llama_model_free(model);
        return 0;
    }
    llama_context * ctx = make_context(model);
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    if (action == "gen") {
        gen(model, ctx, n_vocab);
    } else if (action == "cont") {
        cont(ctx, n_vocab);
    } else if (action == "turns") {
        turns(ctx, n_vocab);
    } else if (action == "branches") {
        branches(ctx, n_vocab);
    } else if (action == "resume") {
        resume(ctx, n_vocab);
    } else if (action == "trace") {
        trace(ctx, n_vocab);
    } else if (action == "bench") {
        bench(ctx);
    } else {
        die("unknown action " + action);
    }
    fflush(stdout);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
