//! The CUDA backend (feature `cuda`).
//!
//! The first group runs everywhere and checks the behaviour without a driver (clean errors, no
//! panic). The GPU group runs only where `cuda_status()` is `Ok` and otherwise returns early
//! printing "skipped: no GPU": byte-for-byte parity with the host backend, the rope kernel
//! against the host rotation, and bandwidth figures. Run it on a GPU machine with
//! `scripts/gpu-check.sh` (`--nocapture --test-threads=1` to see the figures).
#![cfg(feature = "cuda")]

use std::time::Instant;

use llama_kv_cache::tensors::cuda::{
    copy_2d_fallbacks, cuda_allocator, cuda_devices, cuda_status, cuda_synchronize,
    layer_allocator, nvrtc_check, nvrtc_version, set_staging_threshold, staging_threshold,
    CudaBuffer, RopeJob, DEFAULT_STAGING_THRESHOLD, STAGING_CHUNK,
};
use llama_kv_cache::tensors::quant::{dequantize_row, quantize_row};
use llama_kv_cache::tensors::storage::{HostBuffer, KvBuffer};
use llama_kv_cache::{
    CacheParams, Device, GgmlType, KvError, RopeParams, RopeTable, RopeType, SeedCache,
    ShiftParams, Tensor, UBatch, DEFAULT_MAX_NODES,
};

// ---------------------------------------------------------------------------------------------
// helpers

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn f32(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n + 8);
        while out.len() < n {
            out.extend_from_slice(&self.next().to_le_bytes());
        }
        out.truncate(n);
        out
    }
}

/// True when a GPU is usable; otherwise prints why the test is skipped.
fn gpu(test: &str) -> bool {
    match cuda_status() {
        Ok(()) => true,
        Err(reason) => {
            println!("{test}: skipped: no GPU ({reason})");
            false
        }
    }
}

fn backend_message(e: KvError) -> String {
    match e {
        KvError::Backend(m) => m,
        other => panic!("expected KvError::Backend, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// everywhere

#[test]
fn status_explains_itself_and_never_panics() {
    match cuda_status() {
        Ok(()) => {
            let devices = cuda_devices();
            assert!(!devices.is_empty(), "status Ok but no device listed");
            for d in &devices {
                println!(
                    "cuda:{} {} ({} MiB)",
                    d.ordinal,
                    d.name,
                    d.total_memory >> 20
                );
                assert!(d.total_memory > 0);
            }
        }
        Err(reason) => {
            println!("CUDA unavailable: {reason}");
            assert!(reason.contains("CUDA"), "reason should name CUDA: {reason}");
            assert!(cuda_devices().is_empty());
            // probing again gives the same answer
            assert_eq!(cuda_status(), Err(reason));
        }
    }
}

#[test]
fn without_a_driver_allocation_fails_with_a_cuda_backend_error() {
    if cuda_status().is_ok() {
        println!("a driver is present: covered by the GPU tests");
        return;
    }
    let msg = backend_message(cuda_allocator(0).err().expect("allocator without a driver"));
    assert!(msg.starts_with("CUDA unavailable: "), "{msg}");

    let params = CacheParams::new(64, 2, 32, 32);
    let err =
        SeedCache::with_allocator(params.clone(), &mut layer_allocator(vec![Device::Cuda(0)]))
            .err()
            .expect("a CUDA cache without a driver");
    let msg = backend_message(err);
    assert!(msg.contains("CUDA"), "{msg}");

    // a cache whose only device layer comes second fails too, cleanly
    let err = SeedCache::with_allocator(
        params,
        &mut layer_allocator(vec![Device::Host, Device::Cuda(0)]),
    )
    .err()
    .expect("layer 1 on CUDA without a driver");
    assert!(backend_message(err).contains("CUDA"));

    let msg = backend_message(CudaBuffer::new(0, 16).unwrap_err());
    assert!(msg.contains("CUDA"), "{msg}");
    assert!(cuda_synchronize(0).is_err());
}

#[test]
fn layer_allocator_host_layers_need_no_gpu() {
    let params = CacheParams::new(64, 3, 32, 32);
    let c = SeedCache::with_allocator(params.clone(), &mut layer_allocator(vec![Device::Host]))
        .unwrap();
    assert_eq!(c.bytes_per_device().len(), 1);
    assert_eq!(c.bytes_per_device()[0].0, Device::Host);
    // one entry per layer, or one for all; anything else names the layer
    let err = SeedCache::with_allocator(
        params,
        &mut layer_allocator(vec![Device::Host, Device::Host]),
    )
    .err()
    .unwrap();
    assert!(
        matches!(&err, KvError::InvalidArg(m) if m.contains("layer 2")),
        "{err:?}"
    );
}

#[test]
fn nvrtc_compiles_the_kernels_or_says_why_not() {
    // needs libnvrtc but no GPU
    match nvrtc_version() {
        Some((major, minor)) => {
            let size = nvrtc_check(8, 0).expect("NVRTC compiles the kernels for sm_80");
            println!("NVRTC {major}.{minor}: sm_80 cubin of {size} bytes");
            assert!(size > 0);
            let err = nvrtc_check(1, 0).unwrap_err();
            assert!(err.contains("NVRTC"), "{err}");
        }
        None => {
            let err = nvrtc_check(8, 0).unwrap_err();
            println!("skipped compile: {err}");
            assert!(err.contains("NVRTC"), "{err}");
        }
    }
}

#[test]
fn staging_threshold_is_adjustable() {
    assert!(staging_threshold() > 0);
    assert_eq!(DEFAULT_STAGING_THRESHOLD, 1 << 20);
    const { assert!(STAGING_CHUNK >= DEFAULT_STAGING_THRESHOLD) };
}

// ---------------------------------------------------------------------------------------------
// GPU: buffer operations against the host buffer

fn same_contents(host: &HostBuffer, dev: &CudaBuffer, what: &str) {
    let mut got = vec![0u8; dev.len()];
    dev.read(0, &mut got).unwrap();
    let want = host.as_host().unwrap();
    if got != want {
        let first = got.iter().zip(want).position(|(a, b)| a != b).unwrap();
        panic!("{what}: device differs from host, first at byte {first}");
    }
}

#[test]
fn gpu_buffer_ops_match_the_host_buffer() {
    if !gpu("gpu_buffer_ops_match_the_host_buffer") {
        return;
    }
    // large enough for staged transfers spanning several pinned chunks
    let len = 3 * STAGING_CHUNK + 12_345;
    let mut host = HostBuffer::new(len).unwrap();
    let mut dev = CudaBuffer::new(0, len).unwrap();
    assert_eq!(dev.device(), Device::Cuda(0));
    same_contents(&host, &dev, "fresh buffers are zero");

    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // big staged write, small plain writes
    let data = rng.bytes(len - 7);
    for b in [&mut host as &mut dyn KvBuffer, &mut dev] {
        b.write(7, &data).unwrap();
    }
    same_contents(&host, &dev, "staged write");
    let mut back = vec![0u8; len - 7];
    dev.read(7, &mut back).unwrap();
    assert_eq!(back, data, "staged read");
    for _ in 0..50 {
        let n = 1 + rng.below(5000);
        let off = rng.below(len - n);
        let d = rng.bytes(n);
        host.write(off, &d).unwrap();
        dev.write(off, &d).unwrap();
    }
    same_contents(&host, &dev, "small writes");

    // copies: disjoint, overlapping near (temporary buffer) and far (chunked), both directions
    let cases = [
        (0, 5_000_000, 4_000_000),
        (1000, 1010, 3_000_000),
        (1010, 1000, 3_000_000),
        (100, 100 + (1 << 20), 5 << 20),
        (100 + (1 << 20), 100, 5 << 20),
        (17, 17, 1000),
        (3, 900, 0),
    ];
    for (src, dst, n) in cases {
        host.copy_within(src, dst, n).unwrap();
        dev.copy_within(src, dst, n).unwrap();
        same_contents(&host, &dev, &format!("copy_within({src}, {dst}, {n})"));
    }

    // 2D copies: transposed-V shaped, overlapping, and pitch == width
    let cases2d = [
        (10, 5000, 64, 4096, 300),
        (5000, 10, 64, 4096, 300),
        (0, 40, 100, 128, 1000),
        (40, 0, 100, 128, 1000),
        (0, 1 << 20, 4096, 4096, 64),
        (1, 2, 3, 1, 50), // pitch < width: the trait's row-by-row semantics
        (123, 77, 2, 1_000_000, 20),
    ];
    for (src, dst, w, p, rows) in cases2d {
        host.copy_within_2d(src, dst, w, p, rows).unwrap();
        dev.copy_within_2d(src, dst, w, p, rows).unwrap();
        same_contents(
            &host,
            &dev,
            &format!("copy_within_2d({src}, {dst}, {w}, {p}, {rows})"),
        );
    }

    // strided reads and writes, small (one 2D copy) and large (staged by rows)
    for (off, w, p, rows) in [
        (3, 6, 100, 50),
        (0, 2048, 4096, 3000),
        (11, 70_000, 80_000, 200),
    ] {
        let packed = rng.bytes(w * rows);
        host.write_2d(off, w, p, &packed).unwrap();
        dev.write_2d(off, w, p, &packed).unwrap();
        same_contents(&host, &dev, &format!("write_2d({off}, {w}, {p})"));
        let mut a = vec![0u8; w * rows];
        let mut b = vec![1u8; w * rows];
        host.read_2d(off, w, p, &mut a).unwrap();
        dev.read_2d(off, w, p, &mut b).unwrap();
        assert_eq!(a, b, "read_2d({off}, {w}, {p})");
        assert_eq!(a, packed);
    }

    // errors are errors, not panics
    assert!(matches!(
        dev.read(len - 1, &mut [0; 2]),
        Err(KvError::OutOfRange(_))
    ));
    assert!(matches!(
        dev.write(usize::MAX, &[0; 2]),
        Err(KvError::OutOfRange(_))
    ));
    assert!(dev.copy_within(0, len - 1, 2).is_err());
    assert!(dev.copy_within_2d(0, 0, 10, usize::MAX, 3).is_err());

    dev.fill_zero().unwrap();
    host.fill_zero().unwrap();
    same_contents(&host, &dev, "fill_zero");
    println!("2D copies done row by row: {}", copy_2d_fallbacks());
}

// ---------------------------------------------------------------------------------------------
// GPU: cache parity

fn assert_same_tensors(host: &SeedCache, dev: &SeedCache, what: &str) {
    for il in 0..host.n_layer() {
        for which in [Tensor::K, Tensor::V] {
            let a = host.read_rows(il, which, 0, host.size()).unwrap();
            let b = dev.read_rows(il, which, 0, dev.size()).unwrap();
            assert!(a == b, "{what}: layer {il} {which} differs");
        }
    }
}

fn parity(type_k: GgmlType, type_v: GgmlType, flash_attn: bool, devices: Vec<Device>) {
    let label = format!("K {type_k} V {type_v} fa {flash_attn} {devices:?}");
    let (head_dim, n_head) = (64usize, 4usize);
    let width = (head_dim * n_head) as u32;
    let mut p = CacheParams::new(512, 4, width, width);
    p.type_k = type_k;
    p.type_v = type_v;
    p.flash_attn = flash_attn;
    p.n_seq_max = 2;
    let mut host = SeedCache::new(p.clone()).unwrap();
    let mut dev = SeedCache::with_allocator(p.clone(), &mut layer_allocator(devices)).unwrap();
    assert!(dev
        .bytes_per_device()
        .iter()
        .any(|(d, _)| matches!(d, Device::Cuda(0))));
    assert_same_tensors(&host, &dev, &format!("{label}: fresh"));

    for c in [&mut host, &mut dev] {
        c.find_slot(&UBatch::sequence(0, 0, 300)).unwrap().unwrap();
        c.find_slot(&UBatch::sequence(1, 0, 200)).unwrap().unwrap();
    }
    let mut rng = Rng(42);
    for il in 0..p.n_layer {
        for which in [Tensor::K, Tensor::V] {
            let values: Vec<f32> = (0..500 * width as usize).map(|_| rng.f32()).collect();
            host.write_rows_f32(il, which, 0, &values).unwrap();
            dev.write_rows_f32(il, which, 0, &values).unwrap();
            let a = host.read_rows(il, which, 10, 37).unwrap();
            let b = dev.read_rows(il, which, 10, 37).unwrap();
            assert_eq!(a, b, "{label}: read back layer {il} {which}");
        }
    }
    assert_same_tensors(&host, &dev, &format!("{label}: written"));

    // fragment, then defrag
    for c in [&mut host, &mut dev] {
        c.seq_rm(0, 50, 150).unwrap();
        c.seq_rm(1, 0, 60).unwrap();
        c.seq_rm(0, 220, 230).unwrap();
    }
    let ra = host.defrag_now(DEFAULT_MAX_NODES).unwrap();
    let rb = dev.defrag_now(DEFAULT_MAX_NODES).unwrap();
    assert_eq!(ra, rb, "{label}: defrag reports");
    assert!(ra.cells_moved > 0);
    assert_same_tensors(&host, &dev, &format!("{label}: defragged"));

    // K-shift through `update`
    let shift = ShiftParams {
        rope: RopeParams::new(head_dim, head_dim, n_head, RopeType::Neox),
        per_layer: vec![(1, RopeParams::new(32, head_dim, n_head, RopeType::Norm))],
    };
    for c in [&mut host, &mut dev] {
        c.seq_add(0, 0, -1, -37).unwrap();
        c.seq_add(1, 100, -1, 11).unwrap();
        c.defrag();
    }
    let ua = host.update(Some(&shift), None).unwrap();
    let ub = dev.update(Some(&shift), None).unwrap();
    assert_eq!(ua, ub, "{label}: update reports");
    assert!(ua.shifted_cells > 0);
    assert_same_tensors(&host, &dev, &format!("{label}: shifted"));

    for c in [&mut host, &mut dev] {
        c.clear().unwrap();
    }
    assert_same_tensors(&host, &dev, &format!("{label}: cleared"));
    println!("{label}: parity ok ({} cells moved)", ra.cells_moved);
}

#[test]
fn gpu_cache_matches_host_cache_byte_for_byte() {
    if !gpu("gpu_cache_matches_host_cache_byte_for_byte") {
        return;
    }
    let cuda = vec![Device::Cuda(0)];
    parity(GgmlType::F16, GgmlType::F16, false, cuda.clone()); // transposed V
    parity(GgmlType::F16, GgmlType::F16, true, cuda.clone());
    parity(GgmlType::Q8_0, GgmlType::Q8_0, true, cuda.clone());
    parity(GgmlType::Q8_0, GgmlType::F16, false, cuda.clone());
    parity(GgmlType::Bf16, GgmlType::F32, false, cuda.clone());
    let mixed = vec![Device::Host, Device::Cuda(0), Device::Cuda(0), Device::Host];
    parity(GgmlType::F16, GgmlType::F16, false, mixed);
    let all = cuda_allocator(0).unwrap();
    let mut all = all;
    let c = SeedCache::with_allocator(CacheParams::new(64, 2, 32, 32), &mut all).unwrap();
    assert_eq!(
        c.bytes_per_device(),
        vec![(Device::Cuda(0), c.total_size())]
    );
}

// ---------------------------------------------------------------------------------------------
// GPU: the rope kernel against the host rotation

fn ulps_apart(ty: GgmlType, a: &[u8], b: &[u8]) -> u32 {
    let el = ty.type_size();
    a.chunks_exact(el)
        .zip(b.chunks_exact(el))
        .map(|(x, y)| {
            let (x, y) = match el {
                4 => (
                    i64::from(i32::from_le_bytes(x.try_into().unwrap())),
                    i64::from(i32::from_le_bytes(y.try_into().unwrap())),
                ),
                _ => (
                    i64::from(i16::from_le_bytes(x.try_into().unwrap())),
                    i64::from(i16::from_le_bytes(y.try_into().unwrap())),
                ),
            };
            (x - y).unsigned_abs() as u32
        })
        .max()
        .unwrap_or(0)
}

#[test]
fn gpu_rope_kernel_matches_the_host_rotation() {
    if !gpu("gpu_rope_kernel_matches_the_host_rotation") {
        return;
    }
    let probe = CudaBuffer::new(0, 4).unwrap();
    if let Err(why) = probe.kernels_available() {
        panic!("the GPU machine should have NVRTC (the CUDA toolkit): {why}");
    }
    println!("kernels: {}", probe.kernels_origin().unwrap());
    let size = 1000usize;
    let mut rng = Rng(7);
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::Bf16] {
        for rope_type in [RopeType::Norm, RopeType::Neox] {
            for (n_dims, yarn) in [(128, false), (64, true)] {
                let mut p = RopeParams::new(n_dims, 128, 8, rope_type);
                if yarn {
                    p.ext_factor = 1.0;
                    p.freq_scale = 0.25;
                    p.n_ctx_orig = 4096;
                    p.freq_base = 500_000.0;
                }
                let row = ty.row_size(p.row_len()).unwrap();
                let values: Vec<f32> = (0..size * p.row_len()).map(|_| rng.f32()).collect();
                let mut bytes = vec![0u8; size * row];
                for (v, b) in values
                    .chunks_exact(p.row_len())
                    .zip(bytes.chunks_exact_mut(row))
                {
                    quantize_row(ty, v, b).unwrap();
                }
                let deltas: Vec<i32> = (0..size).map(|c| (c as i32 % 23) * 7 - 80).collect();
                // every other cell, plus a run
                let cells: Vec<usize> = (0..size).filter(|c| c % 2 == 0 || *c > 900).collect();

                let mut want = bytes.clone();
                let mut f = vec![0f32; p.row_len()];
                for &c in &cells {
                    let r = &mut want[c * row..(c + 1) * row];
                    dequantize_row(ty, r, &mut f).unwrap();
                    RopeTable::new(&p, deltas[c]).rotate(&mut f);
                    quantize_row(ty, &f, r).unwrap();
                }

                let mut dev = CudaBuffer::new(0, bytes.len()).unwrap();
                dev.write(0, &bytes).unwrap();
                let job = RopeJob::new(&p, &cells, &deltas).unwrap();
                dev.rope(ty, row, &job).unwrap();
                let mut got = vec![0u8; bytes.len()];
                dev.read(0, &mut got).unwrap();
                let exact = got
                    .chunks_exact(row)
                    .zip(want.chunks_exact(row))
                    .filter(|(a, b)| a == b)
                    .count();
                let ulps = ulps_apart(ty, &got, &want);
                println!(
                    "rope {ty} {rope_type:?} n_dims {n_dims} yarn {yarn}: {exact}/{size} rows identical, max {ulps} ulp, {} tables",
                    job.n_tables()
                );
                assert!(ulps <= 1, "{ty} {rope_type:?}: {ulps} ulps apart");
            }
        }
    }
    // quantized K is refused (stage it through the host)
    let mut dev = CudaBuffer::new(0, 34 * 4).unwrap();
    let p = RopeParams::new(32, 32, 1, RopeType::Norm);
    let err = dev
        .rope_rows(GgmlType::Q8_0, 34, &[0], &[1], &p)
        .unwrap_err();
    assert!(matches!(err, KvError::Unsupported(_)));
    assert!(!CudaBuffer::rope_supported(GgmlType::Q4_0));
}

// ---------------------------------------------------------------------------------------------
// GPU: bandwidth

/// Best of `n` timings of `f` (seconds), after one warm-up.
fn best_of(n: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn verdict(ratio: f64) -> &'static str {
    if ratio >= 0.7 {
        "ok (target >= 0.7)"
    } else {
        "BELOW TARGET 0.7"
    }
}

/// Plain device memcpy of `bytes` (one driver copy) in GB/s.
fn memcpy_gbps(bytes: usize) -> f64 {
    let mut scratch = CudaBuffer::new(0, 2 * bytes).unwrap();
    let t = best_of(5, || {
        scratch.copy_within(0, bytes, bytes).unwrap();
        scratch.synchronize().unwrap();
    });
    bytes as f64 / t / 1e9
}

fn defrag_bandwidth(label: &str, flash_attn: bool, hole: impl Fn(&mut SeedCache)) {
    let mut p = CacheParams::new(16_384, 8, 1024, 1024);
    p.flash_attn = flash_attn;
    let mut best = f64::INFINITY;
    let mut bytes = 0u64;
    let mut moves = 0usize;
    for _ in 0..3 {
        let mut c = SeedCache::with_allocator(p.clone(), &mut cuda_allocator(0).unwrap()).unwrap();
        c.find_slot(&UBatch::sequence(0, 0, 16_384))
            .unwrap()
            .unwrap();
        hole(&mut c);
        cuda_synchronize(0).unwrap();
        let t = Instant::now();
        let r = c.defrag_now(DEFAULT_MAX_NODES).unwrap();
        cuda_synchronize(0).unwrap();
        best = best.min(t.elapsed().as_secs_f64());
        bytes = r.bytes_copied;
        moves = r.moves.len();
    }
    let gbps = bytes as f64 / best / 1e9;
    let base = memcpy_gbps(bytes as usize);
    let ratio = gbps / base;
    println!(
        "defrag {label}: {} MiB in {moves} runs x 8 layers, {gbps:.1} GB/s vs device memcpy {base:.1} GB/s: ratio {ratio:.2} {}",
        bytes >> 20,
        verdict(ratio)
    );
}

#[test]
fn gpu_bandwidth_figures() {
    if !gpu("gpu_bandwidth_figures") {
        return;
    }
    // defrag: one large run per layer (the second half moves down), V transposed or not
    for fa in [false, true] {
        defrag_bandwidth(
            &format!("one run, flash_attn {fa}"),
            fa,
            |c: &mut SeedCache| {
                c.seq_rm(0, 0, 8192).unwrap();
            },
        );
    }
    // informational: many short runs (per-call overhead dominates)
    defrag_bandwidth("holes every 256 cells", false, |c: &mut SeedCache| {
        for b in (0..16_384).step_by(512) {
            c.seq_rm(0, b, b + 256).unwrap();
        }
    });

    // host <-> device: staged through pinned memory vs a plain copy from pageable memory
    let bytes = 256usize << 20;
    let src = Rng(3).bytes(bytes);
    let mut dst = vec![0u8; bytes];
    let mut dev = CudaBuffer::new(0, bytes).unwrap();
    let saved = staging_threshold();
    let mut figures = Vec::new();
    for (name, threshold) in [("staged", DEFAULT_STAGING_THRESHOLD), ("plain", usize::MAX)] {
        set_staging_threshold(threshold);
        let up = best_of(3, || dev.write(0, &src).unwrap());
        let down = best_of(3, || dev.read(0, &mut dst).unwrap());
        assert!(dst == src, "{name} round trip");
        figures.push((bytes as f64 / up / 1e9, bytes as f64 / down / 1e9));
        println!(
            "host->device {name}: {:.1} GB/s, device->host {name}: {:.1} GB/s",
            figures.last().unwrap().0,
            figures.last().unwrap().1
        );
    }
    set_staging_threshold(saved);
    let (staged, plain) = (figures[0], figures[1]);
    let r_up = staged.0 / plain.0;
    let r_down = staged.1 / plain.1;
    println!(
        "staging vs plain cuMemcpy: upload ratio {r_up:.2} {}, download ratio {r_down:.2} {}",
        verdict(r_up),
        verdict(r_down)
    );
}
