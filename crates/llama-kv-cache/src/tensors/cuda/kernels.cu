// Device kernels of the llama-kv-cache CUDA backend, compiled at run time with NVRTC.
// No headers: the f16 conversions are single PTX instructions and bf16 is integer arithmetic,
// each written to give the same bits as the host code in `quant.rs`.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

// GGML_FP16_TO_FP32 (exact).
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// GGML_FP32_TO_FP16: round to nearest, ties to even.
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// GGML_BF16_TO_FP32 (exact).
__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}

// GGML_FP32_TO_BF16: NaN keeps its top bits plus the quiet bit, the rest rounds to nearest even.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((u >> 16) | 64u);
    }
    return (u16)((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

struct LoadF32 {
    static __device__ __forceinline__ float load(const float *p) { return *p; }
    static __device__ __forceinline__ void store(float *p, float v) { *p = v; }
};
struct LoadF16 {
    static __device__ __forceinline__ float load(const u16 *p) { return f16_to_f32(*p); }
    static __device__ __forceinline__ void store(u16 *p, float v) { *p = f32_to_f16(v); }
};
struct LoadBf16 {
    static __device__ __forceinline__ float load(const u16 *p) { return bf16_to_f32(*p); }
    static __device__ __forceinline__ void store(u16 *p, float v) { *p = f32_to_bf16(v); }
};

// Rotates pairs of K rows in place, as RopeTable::rotate does on the host:
// x0' = x0*c - x1*s, x1' = x0*s + x1*c, with no fused multiply-add (the __f*_rn intrinsics
// are never contracted), so the f32 results are bit-identical to the host's.
//
// k:        the K tensor, `row` elements per cell
// cells:    n_cells cell indices
// tabs:     n_cells table indices, one per listed cell
// cos, sin: n_tables * n_pairs values (table t at t * n_pairs)
// One thread per (listed cell, head, pair), grid-stride over the whole range.
template <typename T, typename Io>
__device__ __forceinline__ void rope_rows(T *k, u64 row, const u32 *cells, const u32 *tabs, u32 n_cells,
                                          const float *cos_t, const float *sin_t, u32 n_pairs, u32 head_dim,
                                          u32 n_head, int neox) {
    const u64 per_cell = (u64)n_head * n_pairs;
    const u64 total = per_cell * n_cells;
    const u64 stride = (u64)blockDim.x * gridDim.x;
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const u64 ci = idx / per_cell;
        const u64 rem = idx - ci * per_cell;
        const u32 h = (u32)(rem / n_pairs);
        const u32 i = (u32)(rem - (u64)h * n_pairs);
        const u64 t = (u64)tabs[ci] * n_pairs + i;
        const float c = cos_t[t];
        const float s = sin_t[t];
        T *head = k + (u64)cells[ci] * row + (u64)h * head_dim;
        const u32 a = neox ? i : 2 * i;
        const u32 b = neox ? i + n_pairs : 2 * i + 1;
        const float x0 = Io::load(head + a);
        const float x1 = Io::load(head + b);
        Io::store(head + a, __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)));
        Io::store(head + b, __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)));
    }
}

extern "C" __global__ void kv_rope_f32(float *k, u64 row, const u32 *cells, const u32 *tabs, u32 n_cells,
                                       const float *cos_t, const float *sin_t, u32 n_pairs, u32 head_dim,
                                       u32 n_head, int neox) {
    rope_rows<float, LoadF32>(k, row, cells, tabs, n_cells, cos_t, sin_t, n_pairs, head_dim, n_head, neox);
}

extern "C" __global__ void kv_rope_f16(u16 *k, u64 row, const u32 *cells, const u32 *tabs, u32 n_cells,
                                       const float *cos_t, const float *sin_t, u32 n_pairs, u32 head_dim,
                                       u32 n_head, int neox) {
    rope_rows<u16, LoadF16>(k, row, cells, tabs, n_cells, cos_t, sin_t, n_pairs, head_dim, n_head, neox);
}

extern "C" __global__ void kv_rope_bf16(u16 *k, u64 row, const u32 *cells, const u32 *tabs, u32 n_cells,
                                        const float *cos_t, const float *sin_t, u32 n_pairs, u32 head_dim,
                                        u32 n_head, int neox) {
    rope_rows<u16, LoadBf16>(k, row, cells, tabs, n_cells, cos_t, sin_t, n_pairs, head_dim, n_head, neox);
}
