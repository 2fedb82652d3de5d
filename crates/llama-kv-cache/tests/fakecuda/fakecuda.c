// A fake libcuda.so for testing the Rust CUDA backend's host-side logic without a GPU.
// "Device" memory is host memory; every async op runs immediately. Every device access is
// bounds-checked against live allocations and device-to-device copies abort on overlap
// (real cuMemcpy does not support overlapping ranges).
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
#define OK 0

static int fail(const char *msg, unsigned long long a, unsigned long long b) {
    fprintf(stderr, "FAKECUDA VIOLATION: %s (%llx, %llx)\n", msg, a, b);
    abort();
}

#define MAXA 100000
static struct { uintptr_t p; size_t n; } allocs[MAXA];
static int n_allocs;
static long long live_bytes;

static void check_dev(CUdeviceptr p, size_t n, const char *what) {
    if (n == 0) return;
    for (int i = 0; i < n_allocs; i++)
        if (p >= allocs[i].p && p + n <= allocs[i].p + allocs[i].n) return;
    fail(what, p, n);
}

CUresult cuInit(unsigned f) { (void)f; return getenv("FAKECUDA_FAIL_INIT") ? 100 : OK; }
CUresult cuDeviceGetCount(int *n) { *n = getenv("FAKECUDA_NO_DEVICES") ? 0 : 1; return OK; }
CUresult cuDeviceGet(int *d, int o) { if (o != 0) return 101; *d = 0; return OK; }
CUresult cuDeviceGetName(char *name, int len, int d) { (void)d; snprintf(name, len, "Fake GPU"); return OK; }
CUresult cuDeviceTotalMem_v2(size_t *b, int d) { (void)d; *b = (size_t)8 << 30; return OK; }
CUresult cuDeviceGetAttribute(int *v, int attr, int d) {
    (void)d;
    switch (attr) {
    case 11: *v = 2147483647; break;       // MAX_PITCH
    case 75: *v = 9; break;                // CC major
    case 76: *v = 0; break;                // CC minor
    default: *v = 0;
    }
    return OK;
}
static int the_ctx;
static __thread void *current;
CUresult cuDevicePrimaryCtxRetain(void **c, int d) { (void)d; *c = &the_ctx; return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(int d) { (void)d; return OK; }
CUresult cuDevicePrimaryCtxRelease(int d) { (void)d; return OK; }
CUresult cuCtxGetCurrent(void **c) { *c = current; return OK; }
CUresult cuCtxSetCurrent(void *c) { current = c; return OK; }
static void need_ctx(const char *what) { if (current != &the_ctx) fail(what, 0, 0); }
CUresult cuCtxSynchronize(void) { return OK; }
CUresult cuCtxSynchronize_v2(void) { return OK; }
static int the_stream;
CUresult cuStreamCreate(void **s, unsigned f) { (void)f; *s = &the_stream; return OK; }
CUresult cuStreamSynchronize(void *s) { (void)s; need_ctx("stream sync without context"); return OK; }
CUresult cuStreamDestroy_v2(void *s) { (void)s; return OK; }

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    need_ctx("alloc without context");
    if (n == 0) return 1;
    void *m = malloc(n);
    if (!m) return 2;
    memset(m, 0xAB, n);  // device memory is not zeroed
    allocs[n_allocs].p = (uintptr_t)m;
    allocs[n_allocs].n = n;
    n_allocs++;
    live_bytes += n;
    *p = (uintptr_t)m;
    return OK;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
    need_ctx("free without context");
    for (int i = 0; i < n_allocs; i++)
        if (allocs[i].p == p) {
            live_bytes -= allocs[i].n;
            free((void *)p);
            allocs[i] = allocs[--n_allocs];
            return OK;
        }
    fail("free of unknown pointer", p, 0);
    return 1;
}
CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, void *s) {
    (void)s; need_ctx("memset"); check_dev(p, n, "memset out of bounds");
    memset((void *)p, v, n); return OK;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *h, size_t n, void *s) {
    (void)s; need_ctx("htod"); check_dev(d, n, "htod out of bounds"); memcpy((void *)d, h, n); return OK;
}
CUresult cuMemcpyDtoHAsync_v2(void *h, CUdeviceptr d, size_t n, void *s) {
    (void)s; need_ctx("dtoh"); check_dev(d, n, "dtoh out of bounds"); memcpy(h, (void *)d, n); return OK;
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s_, size_t n, void *s) {
    (void)s; need_ctx("dtod");
    check_dev(d, n, "dtod dst out of bounds"); check_dev(s_, n, "dtod src out of bounds");
    if (n && d < s_ + n && s_ < d + n) fail("dtod overlap", d, s_);
    memcpy((void *)d, (void *)s_, n); return OK;
}
typedef struct {
    size_t srcXInBytes, srcY; int srcMemoryType; const void *srcHost; CUdeviceptr srcDevice; void *srcArray; size_t srcPitch;
    size_t dstXInBytes, dstY; int dstMemoryType; void *dstHost; CUdeviceptr dstDevice; void *dstArray; size_t dstPitch;
    size_t WidthInBytes, Height;
} CUDA_MEMCPY2D;
long long n_2d;
CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *c, void *s) {
    (void)s; need_ctx("2d");
    n_2d++;
    if (c->srcXInBytes || c->srcY || c->dstXInBytes || c->dstY) fail("2d offsets", 0, 0);
    if (c->WidthInBytes > c->srcPitch || c->WidthInBytes > c->dstPitch) fail("2d pitch < width", c->WidthInBytes, c->srcPitch);
    uintptr_t sb = c->srcMemoryType == 2 ? (uintptr_t)c->srcDevice : (uintptr_t)c->srcHost;
    uintptr_t db = c->dstMemoryType == 2 ? (uintptr_t)c->dstDevice : (uintptr_t)c->dstHost;
    size_t w = c->WidthInBytes;
    for (size_t r = 0; r < c->Height; r++) {
        if (c->srcMemoryType == 2) check_dev(sb + r * c->srcPitch, w, "2d src out of bounds");
        if (c->dstMemoryType == 2) check_dev(db + r * c->dstPitch, w, "2d dst out of bounds");
    }
    if (c->srcMemoryType == 2 && c->dstMemoryType == 2)
        for (size_t r = 0; r < c->Height; r++)
            for (size_t q = 0; q < c->Height; q++) {
                uintptr_t a = sb + r * c->srcPitch, b = db + q * c->dstPitch;
                if (a < b + w && b < a + w) fail("2d overlap", a, b);
            }
    for (size_t r = 0; r < c->Height; r++)
        memcpy((void *)(db + r * c->dstPitch), (const void *)(sb + r * c->srcPitch), w);
    return OK;
}
CUresult cuMemHostAlloc(void **p, size_t n, unsigned f) { (void)f; *p = malloc(n); return *p ? OK : 2; }
CUresult cuMemFreeHost(void *p) { free(p); return OK; }
static int an_event;
CUresult cuEventCreate(void **e, unsigned f) { (void)f; *e = &an_event; return OK; }
CUresult cuEventRecord(void *e, void *s) { (void)e; (void)s; return OK; }
CUresult cuEventSynchronize(void *e) { (void)e; return OK; }
CUresult cuEventDestroy_v2(void *e) { (void)e; return OK; }
CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; *s = "fake error"; return OK; }
CUresult cuGetErrorName(CUresult e, const char **s) { (void)e; *s = "FAKE_ERROR"; return OK; }

// kernels
static int a_module;
CUresult cuModuleLoadData(void **m, const void *image) { (void)image; *m = &a_module; return OK; }
CUresult cuModuleUnload(void *m) { (void)m; return OK; }
static char names[3][32] = {"kv_rope_f32", "kv_rope_f16", "kv_rope_bf16"};
CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
    (void)m;
    for (int i = 0; i < 3; i++) if (!strcmp(name, names[i])) { *f = names[i]; return OK; }
    return 500;
}
static float ld(int ty, const void *p) {
    if (ty == 0) return *(const float *)p;
    if (ty == 1) return (float)*(const _Float16 *)p;
    uint32_t u = (uint32_t)*(const uint16_t *)p << 16; float f; memcpy(&f, &u, 4); return f;
}
static void st(int ty, void *p, float v) {
    if (ty == 0) { *(float *)p = v; return; }
    if (ty == 1) { *(_Float16 *)p = (_Float16)v; return; }
    uint32_t u; memcpy(&u, &v, 4);
    uint16_t h = ((u & 0x7fffffffu) > 0x7f800000u) ? (uint16_t)((u >> 16) | 64u)
                                                   : (uint16_t)((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
    *(uint16_t *)p = h;
}
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, void *s, void **params, void **extra) {
    (void)gy; (void)gz; (void)by; (void)bz; (void)shmem; (void)s; (void)extra; (void)gx; (void)bx;
    need_ctx("launch");
    int ty = (char *)f == names[0] ? 0 : (char *)f == names[1] ? 1 : 2;
    size_t el = ty == 0 ? 4 : 2;
    CUdeviceptr k = *(CUdeviceptr *)params[0];
    unsigned long long row = *(unsigned long long *)params[1];
    const uint32_t *cells = (const uint32_t *)*(CUdeviceptr *)params[2];
    const uint32_t *tabs = (const uint32_t *)*(CUdeviceptr *)params[3];
    uint32_t n_cells = *(uint32_t *)params[4];
    const float *cs = (const float *)*(CUdeviceptr *)params[5];
    const float *sn = (const float *)*(CUdeviceptr *)params[6];
    uint32_t n_pairs = *(uint32_t *)params[7], head_dim = *(uint32_t *)params[8], n_head = *(uint32_t *)params[9];
    int neox = *(int *)params[10];
    check_dev((CUdeviceptr)cells, 4 * (size_t)n_cells, "kernel cells");
    check_dev((CUdeviceptr)tabs, 4 * (size_t)n_cells, "kernel tabs");
    for (uint32_t ci = 0; ci < n_cells; ci++) {
        check_dev(k + (CUdeviceptr)cells[ci] * row * el, row * el, "kernel row");
        for (uint32_t h = 0; h < n_head; h++)
            for (uint32_t i = 0; i < n_pairs; i++) {
                size_t t = (size_t)tabs[ci] * n_pairs + i;
                check_dev((CUdeviceptr)(cs + t), 4, "kernel cos");
                check_dev((CUdeviceptr)(sn + t), 4, "kernel sin");
                float c = cs[t], s_ = sn[t];
                char *head = (char *)(uintptr_t)k + ((size_t)cells[ci] * row + (size_t)h * head_dim) * el;
                uint32_t a = neox ? i : 2 * i, b = neox ? i + n_pairs : 2 * i + 1;
                float x0 = ld(ty, head + a * el), x1 = ld(ty, head + b * el);
                float p0 = x0 * c, p1 = x1 * s_, p2 = x0 * s_, p3 = x1 * c;
                st(ty, head + a * el, p0 - p1);
                st(ty, head + b * el, p2 + p3);
            }
    }
    return OK;
}
