//! bench-core: our Rust core's side of the same-run benchmark against llama.cpp
//! (`bench/llama.mjs`, `npm run bench:llama`). It speaks the protocol of llama.cpp's side,
//! `driver/seed/kv-bench.cpp`, so the script can time both (and the JS binding) in interleaved
//! rounds.
//!
//! `paths` answers `{bench}`: the path of llama.cpp's side, built by build.rs.
//! `setup <n_ctx> <n_seq> <dir>` takes the tiny model (`llama-h16.gguf` of
//! `interop/make_models.py`: 2 layers, 32-wide f16 K/V rows), fills a cache of `n_ctx` cells with `n_seq` sequences of `n_ctx / n_seq` tokens, one
//! contiguous block each, and writes their states as `<dir>/seq-<s>.bin` (llama.cpp's format,
//! which the other two sides load) and the whole cache as `<dir>/whole.bin`; answers
//! `{model, bytes}` (model: its path; bytes: the size of the K/V tensors).
//! `time <op>` restores the filled cache (untimed), runs the op's untimed preparation and times
//! the op once; answers `{ns}`.

use std::io::{BufRead, Write};
use std::path::Path;
use std::time::Instant;

use conformance::driver::Driver;
use conformance::seed::model::ModelKind;
use llama_kv_cache::{
    CacheParams, Layout, ReadOptions, RopeParams, RopeType, SeedCache, ShiftParams, Tensor, UBatch,
};

const MODEL: ModelKind = ModelKind::LlamaH16;

struct Bench {
    cache: SeedCache,
    n_seq: i32,
    len: i32,
    seq_blobs: Vec<Vec<u8>>,
    whole: Vec<u8>,
    shift: ShiftParams,
    src: Vec<u8>,
    dst: Vec<u8>,
    /// A reused output buffer, as large as the whole state.
    out: Vec<u8>,
}

fn read_opts() -> ReadOptions {
    ReadOptions {
        layout: Some(Layout::Seed),
        ..ReadOptions::default()
    }
}

fn setup(n_ctx: u32, n_seq: u32, dir: &Path) -> Result<(Bench, String), String> {
    let e = |e: llama_kv_cache::KvError| e.to_string();
    let model = MODEL.path()?;
    let (k, v) = MODEL.kv_widths();
    let mut params = CacheParams::new(n_ctx, MODEL.n_layer(), k, v);
    params.n_seq_max = n_seq;
    let mut cache = SeedCache::new(params).map_err(e)?;
    let len = n_ctx / n_seq;
    for s in 0..n_seq {
        for p0 in (0..len).step_by(512) {
            let n = (len - p0).min(512);
            cache
                .find_slot(&UBatch::sequence(s as i32, p0 as i32, n))
                .map_err(e)?
                .ok_or("the fill does not fit")?;
        }
    }
    // deterministic values in [-1, 1): finite f16, as a model would write
    let mut x = 0x2545_f491_u32;
    for il in 0..MODEL.n_layer() {
        for (which, width) in [(Tensor::K, k), (Tensor::V, v)] {
            let values: Vec<f32> = (0..n_ctx as usize * width as usize)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    (x >> 8) as f32 / (1u32 << 23) as f32 - 1.0
                })
                .collect();
            cache.write_rows_f32(il, which, 0, &values).map_err(e)?;
        }
    }
    let mut seq_blobs = Vec::new();
    for s in 0..n_seq as i32 {
        let blob = cache.state_write(s, Layout::Seed, 1, None).map_err(e)?;
        std::fs::write(dir.join(format!("seq-{s}.bin")), &blob).map_err(|e| e.to_string())?;
        seq_blobs.push(blob);
    }
    let whole = cache.state_write(-1, Layout::Seed, 1, None).map_err(e)?;
    std::fs::write(dir.join("whole.bin"), &whole).map_err(|e| e.to_string())?;
    let bytes = cache.total_size();
    let dim = MODEL.head_dim();
    let whole_len = whole.len();
    let bench = Bench {
        cache,
        n_seq: n_seq as i32,
        len: len as i32,
        seq_blobs,
        whole,
        shift: ShiftParams {
            rope: RopeParams::new(dim, dim, MODEL.n_head_kv(), RopeType::Norm),
            per_layer: Vec::new(),
        },
        out: vec![0; whole_len],
        src: vec![1; bytes],
        dst: vec![0; bytes],
    };
    let answer = format!(
        "{{\"model\":{},\"bytes\":{bytes}}}",
        serde_json::Value::from(model.display().to_string())
    );
    Ok((bench, answer))
}

impl Bench {
    /// Times `op` on the restored cache, in ns; `Ok(None)` for an unknown op.
    fn time(&mut self, op: &str) -> Result<Option<u128>, String> {
        let e = |e: llama_kv_cache::KvError| e.to_string();
        self.cache
            .state_read(&self.whole, -1, read_opts(), None)
            .map_err(e)?;
        let c = &mut self.cache;
        // as the other sides: a few O(1) calls after the restore
        std::hint::black_box((c.used_cells(), c.seq_pos_max(0).ok(), c.seq_pos_max(1).ok()));
        let s = 3 % self.n_seq;
        let len = self.len;
        // a payload made by the op, freed after the timer (as the other sides free theirs)
        let mut made: Option<Vec<u8>> = None;
        let mut t0 = Instant::now();
        match op {
            "seq_rm_mid" => {
                c.seq_rm(s, len / 4, len / 2).map_err(e)?;
            }
            "seq_rm_tail" => {
                c.seq_rm(s, len - 16, -1).map_err(e)?;
            }
            "seq_add" => c.seq_add(s, len / 2, -1, -(len / 4)).map_err(e)?,
            "seq_div" => c.seq_div(s, 0, -1, 2).map_err(e)?,
            "seq_cp" => c.seq_cp(s, (s + 1) % self.n_seq, 0, -1).map_err(e)?,
            "seq_rm_short" => {
                c.seq_rm(s, len / 2, len / 2 + 16).map_err(e)?;
            }
            "seq_add_short" => c.seq_add(s, len - 16, -1, 16).map_err(e)?,
            "seq_div_short" => c.seq_div(s, len - 16, -1, 2).map_err(e)?,
            "seq_cp_short" => c
                .seq_cp(s, (s + 1) % self.n_seq, len / 2, len / 2 + 16)
                .map_err(e)?,
            "seq_keep" => c.seq_keep(s).map_err(e)?,
            "seq_pos_max" => {
                std::hint::black_box(c.seq_pos_max(s).map_err(e)?);
            }
            "clear" => c.clear().map_err(e)?,
            "defrag_update" => {
                for q in (1..self.n_seq).step_by(2) {
                    c.seq_rm(q, -1, -1).map_err(e)?;
                }
                t0 = Instant::now();
                c.defrag();
                c.update(Some(&self.shift), None).map_err(e)?;
            }
            "defrag_scattered" => {
                for q in 0..self.n_seq {
                    for p in (0..len).step_by(64) {
                        c.seq_rm(q, p, p + 1).map_err(e)?;
                    }
                }
                t0 = Instant::now();
                c.defrag();
                c.update(Some(&self.shift), None).map_err(e)?;
            }
            "kshift_all" => {
                for q in 0..self.n_seq {
                    c.seq_add(q, 0, -1, 1).map_err(e)?;
                }
                t0 = Instant::now();
                c.update(Some(&self.shift), None).map_err(e)?;
            }
            "seq_get" => made = Some(c.state_write(s, Layout::Seed, 1, None).map_err(e)?),
            "seq_set" => {
                c.seq_rm(s, -1, -1).map_err(e)?;
                t0 = Instant::now();
                c.state_read(&self.seq_blobs[s as usize], s, read_opts(), None)
                    .map_err(e)?;
            }
            "seq_get_into" => {
                let out = &mut self.out;
                std::hint::black_box(
                    c.state_write_into(out, s, Layout::Seed, 1, None)
                        .map_err(e)?,
                );
            }
            "state_get_into" => {
                let out = &mut self.out;
                std::hint::black_box(
                    c.state_write_into(out, -1, Layout::Seed, 1, None)
                        .map_err(e)?,
                );
            }
            "state_get" => made = Some(c.state_write(-1, Layout::Seed, 1, None).map_err(e)?),
            // the baselines of a state get: the same bytes copied into a fresh allocation
            "copy_new_seq" => made = Some(self.seq_blobs[s as usize].to_vec()),
            "copy_new_whole" => made = Some(self.whole.to_vec()),
            "state_set" => {
                c.state_read(&self.whole, -1, read_opts(), None)
                    .map_err(e)?;
            }
            "set_all" => {
                c.clear().map_err(e)?;
                for (q, blob) in self.seq_blobs.iter().enumerate() {
                    c.state_read(blob, q as i32, read_opts(), None).map_err(e)?;
                }
            }
            "memcpy_seq" => {
                let blob = &self.seq_blobs[s as usize];
                self.out[..blob.len()].copy_from_slice(blob);
                std::hint::black_box(&mut self.out);
            }
            "memcpy" => {
                self.dst.copy_from_slice(&self.src);
                std::hint::black_box(&mut self.dst);
            }
            "memset" => {
                self.dst.fill(0);
                std::hint::black_box(&mut self.dst);
            }
            _ => return Ok(None),
        }
        let ns = t0.elapsed().as_nanos();
        drop(std::hint::black_box(made));
        // a pending K-shift of seq_add / seq_div must not leak into the next op's timing
        self.cache.update(Some(&self.shift), None).map_err(e)?;
        Ok(Some(ns))
    }
}

fn error(msg: &str) -> String {
    format!("{{\"error\":{}}}", serde_json::Value::from(msg))
}

fn main() {
    let mut bench: Option<Bench> = None;
    let stdin = std::io::stdin();
    let mut out = std::io::stdout().lock();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        let answer = match words.as_slice() {
            ["quit"] => break,
            ["paths"] => match Driver::SeedBench.path() {
                Ok(p) => format!(
                    "{{\"bench\":{}}}",
                    serde_json::Value::from(p.display().to_string())
                ),
                Err(msg) => error(&msg),
            },
            ["setup", n_ctx, n_seq, dir] => match (n_ctx.parse(), n_seq.parse()) {
                (Ok(n_ctx), Ok(n_seq)) => match setup(n_ctx, n_seq, Path::new(dir)) {
                    Ok((b, answer)) => {
                        bench = Some(b);
                        answer
                    }
                    Err(msg) => error(&format!("setup: {msg}")),
                },
                _ => error("setup: expected <n_ctx> <n_seq> <dir>"),
            },
            ["time", op] => match bench.as_mut().map(|b| b.time(op)) {
                None => error("no cache: send setup first"),
                Some(Ok(Some(ns))) => format!("{{\"ns\":{ns}}}"),
                Some(Ok(None)) => error(&format!("unknown op {op}")),
                Some(Err(msg)) => error(&format!("{op}: {msg}")),
            },
            _ => error(&format!("unknown command: {line}")),
        };
        if writeln!(out, "{answer}").and_then(|_| out.flush()).is_err() {
            break;
        }
    }
}
