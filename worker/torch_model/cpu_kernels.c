/* Fused CPU kernels for the torch backend's layers, float32 and bfloat16 (see cpu_kernels.py).
 *
 * Built at run time with the system C compiler (-O3 -march=native -fopenmp) and called through
 * ctypes with raw pointers. The OpenMP pragmas bind to the libgomp that torch already loaded
 * (same soname), so these kernels share torch's thread pool instead of starting a second one.
 * Every kernel takes the thread count to use; small inputs run on the calling thread only.
 *
 * Vectors are GCC vector extensions of one register of floats (VL: 16 with AVX-512, else 8), so
 * the code stays portable C.
 *
 * Storage type: every exported kernel takes `bf` (0: float32, 1: bfloat16 as uint16 bits) and
 * runs a body inlined for that type, so the type checks fold away. Arithmetic is float32 either
 * way; bfloat16 results are rounded (to nearest even) where the torch ops they replace round:
 * after each elementwise op, and once at the end of attention.
 *
 * Layouts (row-major, int64 indices, offsets counted in elements):
 *   qkv    [T, stride]: per token q heads, then k heads, then v heads, each `d` elements
 *   kc, vc [n_cells, kvh, d]: one layer of the cell-major KV cache
 *   cos, sin [n_pos, d]: RoPE tables (HF "rotate half" layout)
 *
 * Numerics follow the torch ops they replace (no FMA contraction); sums (squares, dot products,
 * softmax denominators) are reordered, and exp is a Cephes-style polynomial (~1 ulp). Attention
 * is the exception: it has an order of its own (see omni_attn), the same for every row, and uses
 * FMA where the CPU has it.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One vector register of floats: 16 lanes with AVX-512, else 8 (GCC lowers wider vector types
 * through the stack, several times slower). Sums reduce lane-wise, so results differ between the
 * two, never between runs on one machine. */
#ifdef __AVX512F__
#define VL 16
#else
#define VL 8
#endif
#define PAR_MIN_WORK 65536 /* elements below which a kernel stays on the calling thread */
#define INLINE static inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(VL * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(VL * sizeof(uint16_t))));

static inline vf vsplat(float x) { return (vf){0} + x; }
static inline vf vsel(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

static inline float hsum(vf v) { /* pairwise: log2(VL) shuffle-adds */
#if VL == 16
    v += __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#else
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6});
#endif
    return v[0];
}

/* -- element access: bf selects the storage type ------------------------------------------- */

static inline float bf16_to_f(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline uint16_t f_to_bf16(float f) { /* round to nearest even, NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline vu vround_bits(vu u) { return u + 0x7fffu + ((u >> 16) & 1u); } /* finite lanes */

INLINE float ld(const void *p, int64_t i, const int bf) {
    return bf ? bf16_to_f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
INLINE void st(void *p, int64_t i, float v, const int bf) {
    if (bf)
        ((uint16_t *)p)[i] = f_to_bf16(v);
    else
        ((float *)p)[i] = v;
}
/* v rounded to the storage precision (what a torch op producing that dtype would keep). */
INLINE float rnd(float v, const int bf) { return bf ? bf16_to_f(f_to_bf16(v)) : v; }
INLINE vf vld(const void *p, int64_t i, const int bf) {
    vf v;
    if (!bf) {
        memcpy(&v, (const float *)p + i, sizeof v);
        return v;
    }
    vh h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}
INLINE void vst(void *p, int64_t i, vf v, const int bf) {
    if (!bf) {
        memcpy((float *)p + i, &v, sizeof v);
        return;
    }
    const vh h = __builtin_convertvector(vround_bits((vu)v) >> 16, vh);
    memcpy((uint16_t *)p + i, &h, sizeof h);
}
INLINE vf vrnd(vf v, const int bf) { return bf ? (vf)(vround_bits((vu)v) & 0xffff0000u) : v; }

/* exp(x) for float32 lanes: Cephes expf (range reduction by ln 2, degree-6 polynomial). */
static inline vf vexp(vf x) {
    x = vsel(x > vsplat(88.3762626647949f), vsplat(88.3762626647949f), x);
    x = vsel(x < vsplat(-87.3365478515625f), vsplat(-87.3365478515625f), x);
    const vf magic = vsplat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const vf n = (x * vsplat(1.44269504088896341f) + magic) - magic;
    const vf r = x - n * vsplat(0.693359375f) - n * vsplat(-2.12194440e-4f);
    vf p = vsplat(1.9875691500e-4f);
    p = p * r + vsplat(1.3981999507e-3f);
    p = p * r + vsplat(8.3334519073e-3f);
    p = p * r + vsplat(4.1665795894e-2f);
    p = p * r + vsplat(1.6666665459e-1f);
    p = p * r + vsplat(5.0000001201e-1f);
    p = p * (r * r) + r + vsplat(1.0f);
    const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)e;
}

/* Cells are scattered through the pool: fetch the row PREFETCH_AHEAD cells ahead. */
#define PREFETCH_AHEAD 4
static inline void prefetch_bytes(const char *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(p + i);
}

INLINE float sumsq(const void *x, int64_t off, int64_t n, const int bf) {
    vf acc = vsplat(0.f);
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        const vf v = vld(x, off + i, bf);
        acc += v * v;
    }
    float s = hsum(acc);
    for (; i < n; i++) s += ld(x, off + i, bf) * ld(x, off + i, bf);
    return s;
}

/* -- RMSNorm ----------------------------------------------------------------------------------- */

INLINE void rms_norm_body(void *out, int64_t out_stride, const void *x, int64_t x_stride, const void *w, int64_t T,
                          int64_t n, float eps, int nt, const int bf) {
#pragma omp parallel for num_threads(nt) if (T * n >= PAR_MIN_WORK) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const int64_t xo = t * x_stride, oo = t * out_stride;
        const float r = 1.0f / sqrtf(sumsq(x, xo, n, bf) / (float)n + eps);
        int64_t i = 0;
        for (; i + VL <= n; i += VL)
            vst(out, oo + i, vld(w, i, bf) * vrnd(vld(x, xo + i, bf) * vsplat(r), bf), bf);
        for (; i < n; i++) st(out, oo + i, ld(w, i, bf) * rnd(ld(x, xo + i, bf) * r, bf), bf);
    }
}

/* out[t] = w * (x[t] * rsqrt(mean(x[t]^2) + eps)) for T rows of width n. */
void omni_rms_norm(void *out, int64_t out_stride, const void *x, int64_t x_stride, const void *w, int64_t T,
                   int64_t n, float eps, int nt, int bf) {
    if (bf)
        rms_norm_body(out, out_stride, x, x_stride, w, T, n, eps, nt, 1);
    else
        rms_norm_body(out, out_stride, x, x_stride, w, T, n, eps, nt, 0);
}

/* -- RoPE + KV store --------------------------------------------------------------------------- */

INLINE void rope_store_body(void *qkv, int64_t T, int64_t stride, int64_t h, int64_t kvh, int64_t d,
                            const void *cos_t, const void *sin_t, const int64_t *pos, const int64_t *cells,
                            void *kc, void *vc, const void *qn, const void *kn, float eps, int nt, const int bf) {
    const int64_t half = d / 2, esz = bf ? 2 : 4;
#pragma omp parallel for num_threads(nt) if (T * stride >= PAR_MIN_WORK) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const int64_t row = t * stride, co = pos[t] * d, ko = cells[t] * kvh * d;
        for (int64_t head = 0; head < h + kvh; head++) {
            const void *nw = head < h ? qn : kn;
            float y[512], z[512];
            for (int64_t i = 0; i < d; i++) y[i] = ld(qkv, row + head * d + i, bf);
            if (nw != NULL) {
                float ss = 0.f;
                for (int64_t i = 0; i < d; i++) ss += y[i] * y[i];
                const float r = 1.0f / sqrtf(ss / (float)d + eps);
                for (int64_t i = 0; i < d; i++) y[i] = rnd(ld(nw, i, bf) * rnd(y[i] * r, bf), bf);
            }
            for (int64_t i = 0; i < half; i++) {
                const float x1 = y[i], x2 = y[i + half];
                z[i] = rnd(ld(cos_t, co + i, bf) * x1, bf) + rnd(-x2 * ld(sin_t, co + i, bf), bf);
                z[i + half] = rnd(x2 * ld(cos_t, co + i + half, bf), bf) + rnd(x1 * ld(sin_t, co + i + half, bf), bf);
            }
            if (head < h)
                for (int64_t i = 0; i < d; i++) st(qkv, row + head * d + i, z[i], bf);
            else
                for (int64_t i = 0; i < d; i++) st(kc, ko + (head - h) * d + i, z[i], bf);
        }
        memcpy((char *)vc + ko * esz, (const char *)qkv + (row + (h + kvh) * d) * esz, (size_t)(kvh * d * esz));
    }
}

/* Rotates the q heads of every token in place, rotates its k heads into kc[cells[t]] and copies
 * its v heads into vc[cells[t]]: the RoPE and KV-store part of a layer in one pass. With qn/kn
 * (Qwen3's per-head q/k RMSNorm weights, else NULL) each q/k head is normalised first. */
void omni_rope_store(void *qkv, int64_t T, int64_t stride, int64_t h, int64_t kvh, int64_t d, const void *cos_t,
                     const void *sin_t, const int64_t *pos, const int64_t *cells, void *kc, void *vc, const void *qn,
                     const void *kn, float eps, int nt, int bf) {
    if (bf)
        rope_store_body(qkv, T, stride, h, kvh, d, cos_t, sin_t, pos, cells, kc, vc, qn, kn, eps, nt, 1);
    else
        rope_store_body(qkv, T, stride, h, kvh, d, cos_t, sin_t, pos, cells, kc, vc, qn, kn, eps, nt, 0);
}

/* -- SiLU * up --------------------------------------------------------------------------------- */

INLINE void silu_mul_body(void *out, const void *gu, int64_t T, int64_t n, int nt, const int bf) {
#pragma omp parallel for num_threads(nt) if (T * n >= PAR_MIN_WORK) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const int64_t go = t * 2 * n, uo = go + n, oo = t * n;
        int64_t i = 0;
        for (; i + VL <= n; i += VL) {
            const vf x = vld(gu, go + i, bf);
            vst(out, oo + i, vrnd(x / (vsplat(1.0f) + vexp(-x)), bf) * vld(gu, uo + i, bf), bf);
        }
        for (; i < n; i++) {
            const float x = ld(gu, go + i, bf);
            st(out, oo + i, rnd(x / (1.0f + expf(-x)), bf) * ld(gu, uo + i, bf), bf);
        }
    }
}

/* out[t, i] = silu(gu[t, i]) * gu[t, n + i] for T rows (gate and up halves of one matmul). */
void omni_silu_mul(void *out, const void *gu, int64_t T, int64_t n, int nt, int bf) {
    if (bf)
        silu_mul_body(out, gu, T, n, nt, 1);
    else
        silu_mul_body(out, gu, T, n, nt, 0);
}

/* -- attention --------------------------------------------------------------------------------- */

/* Every query row of a step goes through `omni_attn`, prompt rows and decode rows alike. A row at
 * position p of sequence s reads s's table (entry j: the cell holding position j) over entries
 * [0, p] (the last `window` of them with a sliding window) in position order, and its
 * arithmetic is a function of p alone, never of the batch around it:
 *   - each score is one dot product of VL-lane partial sums reduced by one fixed tree (reduce4);
 *   - the softmax sum runs over the lanes of entries [0, ROUND16(p + 1)) (entries that do not
 *     count add exact zeros; no scalar tail), then the same tree for every row;
 *   - V rows are accumulated in position order.
 * So a row's result depends only on its q and its sequence's cells 0..p: not on the other rows
 * of the batch, on how its prompt was cut into pieces, or on whose cells they are (a prefix shared
 * with another sequence reads the very same cells). Tiling rows, blocking keys and the thread that
 * runs a tile change the order of memory accesses only. */

#define ROUND16(n) (((n) + 15) & ~(int64_t)15)
#define TILE_ROWS 8           /* consecutive query rows of one sequence sharing a pass over K/V */
#define SCORE_BYTES (2 << 20) /* a tile's scores at most (long contexts get fewer rows) */
#define BLOCK_KEYS 16         /* keys per block (a multiple of 4) */
#define BLOCK_FLOATS 4096     /* a packed block (its keys' rows for a few KV heads): 16 KiB, in L1 */
#define HEADS_AT_ONCE (VL == 16 ? 4 : 2) /* query heads per K/V load (32 or 16 vector registers) */

/* a * b + c: one rounding where the CPU has FMA (attention only: its order of operations is its
 * own, not a torch op's), else two. */
#ifdef __FMA__
#include <immintrin.h>
static inline vf vfma(vf a, vf b, vf c) {
#if VL == 16
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
}
#else
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
#endif

/* Lanes 0..3: the sums of a0..a3, each by the same tree (neighbouring lanes first). */
static inline vf reduce4(vf a0, vf a1, vf a2, vf a3) {
#if VL == 16
    const vi ev = {0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30};
    const vi od = {1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31};
#else
    const vi ev = {0, 2, 8, 10, 4, 6, 12, 14};
    const vi od = {1, 3, 9, 11, 5, 7, 13, 15};
#endif
    const vf t0 = __builtin_shuffle(a0, a1, ev) + __builtin_shuffle(a0, a1, od);
    const vf t1 = __builtin_shuffle(a2, a3, ev) + __builtin_shuffle(a2, a3, od);
    vf u = __builtin_shuffle(t0, t1, ev) + __builtin_shuffle(t0, t1, od); /* 4 sums per 4 lanes */
#if VL == 16
    u += __builtin_shuffle(u, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    return u + __builtin_shuffle(u, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
#else
    return u + __builtin_shuffle(u, (vi){4, 5, 6, 7, 0, 1, 2, 3});
#endif
}

static inline float hmax(vf v) {
    for (int i = 1; i < VL; i++) v[0] = v[i] > v[0] ? v[i] : v[0];
    return v[0];
}

/* Pack a key block: dst[(kh - kh0) * BLOCK_KEYS + j - a] = KV head kh of the K or V row of table
 * entry j, as float, for j in [a, b) and kh in [kh0, kh1). Each key's rows are read in one
 * contiguous run (in pool order the rows of a sequence are scattered, and each head's part of a
 * row is at a power-of-two stride: a cache-set conflict if read in place, head by head), and
 * bfloat16 is converted once instead of once per query head. */
INLINE void pack_block(float *dst, const void *src, const int64_t *tab, int64_t a, int64_t b, int64_t kvh,
                       int64_t kh0, int64_t kh1, int64_t d, int64_t lim, const int bf) {
    const int64_t esz = bf ? 2 : 4, run = (kh1 - kh0) * d * esz;
    for (int64_t j = a; j < b; j++) {
        if (j + PREFETCH_AHEAD < lim)
            prefetch_bytes((const char *)src + (tab[j + PREFETCH_AHEAD] * kvh + kh0) * d * esz, run);
        for (int64_t kh = kh0; kh < kh1; kh++) {
            const int64_t o = (tab[j] * kvh + kh) * d;
            float *row = dst + ((kh - kh0) * BLOCK_KEYS + j - a) * d;
            for (int64_t c = 0; c < d; c += VL) {
                const vf v = vld(src, o + c, bf);
                memcpy(row + c, &v, sizeof v);
            }
        }
    }
}

/* M query heads of one row against the keys j in [a, b) (multiples of 4) of a packed block
 * (kp: key j at kp + j * d): sc[m * ls + j] = (q_m . k_j) * scale, q_m at qf + m * d. Each K
 * vector is loaded once for the M heads; each dot is d / VL lane-wise multiply-adds reduced by
 * reduce4, whichever M and a. */
INLINE void qk_heads(const int M, const float *qf, const float *kp, int64_t a, int64_t b, int64_t d, float scale,
                     float *sc, int64_t ls) {
    for (int64_t j = a; j < b; j += 4) {
        const float *k0 = kp + j * d, *k1 = k0 + d, *k2 = k1 + d, *k3 = k2 + d;
        vf acc[HEADS_AT_ONCE][4]; /* fixed size, constant indices: kept in registers */
#pragma GCC unroll 4
        for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = vsplat(0.f);
        for (int64_t c = 0; c < d; c += VL) {
            vf x0, x1, x2, x3;
            memcpy(&x0, k0 + c, sizeof x0);
            memcpy(&x1, k1 + c, sizeof x1);
            memcpy(&x2, k2 + c, sizeof x2);
            memcpy(&x3, k3 + c, sizeof x3);
#pragma GCC unroll 4
            for (int m = 0; m < M; m++) {
                vf qv;
                memcpy(&qv, qf + m * d + c, sizeof qv);
                acc[m][0] = vfma(qv, x0, acc[m][0]);
                acc[m][1] = vfma(qv, x1, acc[m][1]);
                acc[m][2] = vfma(qv, x2, acc[m][2]);
                acc[m][3] = vfma(qv, x3, acc[m][3]);
            }
        }
#pragma GCC unroll 4
        for (int m = 0; m < M; m++) {
            const vf r = reduce4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]) * vsplat(scale);
            memcpy(sc + m * ls + j, &r, 4 * sizeof(float));
        }
    }
}

/* The G query heads of one row (qf: head 0 of them) that share a KV head, HEADS_AT_ONCE at a time. */
static inline void qk_group(int64_t G, const float *qf, const float *kp, int64_t a, int64_t b, int64_t d,
                            float scale, float *sc, int64_t ls) {
    for (int64_t g = 0; g < G; g += HEADS_AT_ONCE) {
        const float *q = qf + g * d;
        float *o = sc + g * ls;
        switch (G - g < HEADS_AT_ONCE ? G - g : HEADS_AT_ONCE) {
        case 1: qk_heads(1, q, kp, a, b, d, scale, o, ls); break;
        case 2: qk_heads(2, q, kp, a, b, d, scale, o, ls); break;
#if HEADS_AT_ONCE > 2
        case 3: qk_heads(3, q, kp, a, b, d, scale, o, ls); break;
        case 4: qk_heads(4, q, kp, a, b, d, scale, o, ls); break;
#endif
        }
    }
}

/* Softmax weights in place: sc[j] = exp(sc[j] - max) for j in [lo, p], 0 for the other entries of
 * [lo & -VL, ROUND16(p + 1)) (whatever they held); returns 1 / the sum of the weights. */
static inline float softmax_row(float *sc, int64_t lo, int64_t p) {
    vi lane;
    for (int i = 0; i < VL; i++) lane[i] = i;
    const int64_t j0 = lo & -(int64_t)VL, j1 = ROUND16(p + 1);
    vf mv = vsplat(-FLT_MAX);
    for (int64_t j = j0; j < j1; j += VL) {
        vf s;
        memcpy(&s, sc + j, sizeof s);
        const vi idx = lane + (int32_t)j;
        const vi vis = (idx >= (int32_t)lo) & (idx <= (int32_t)p);
        mv = vsel(vis & (s > mv), s, mv);
    }
    mv = vsplat(hmax(mv));
    vf sum = vsplat(0.f);
    for (int64_t j = j0; j < j1; j += VL) {
        vf s;
        memcpy(&s, sc + j, sizeof s);
        const vi idx = lane + (int32_t)j;
        const vf e = vsel((idx >= (int32_t)lo) & (idx <= (int32_t)p), vexp(s - mv), vsplat(0.f));
        memcpy(sc + j, &e, sizeof e);
        sum += e;
    }
    return 1.0f / hsum(sum);
}

/* M query heads of one row: acc[m * d + off, + NV * VL) += w[m * ls + j] * v_j[off, + NV * VL) for
 * keys j in [a, b) of a packed block (vp: key j at vp + j * d), in key order. Each V vector is
 * loaded once for the M heads, and the M * NV accumulators are independent chains. */
INLINE void pv_heads(const int M, const int NV, float *acc, const float *w, int64_t ls, const float *vp, int64_t a,
                     int64_t b, int64_t d, int64_t off) {
    vf r[HEADS_AT_ONCE][4], wj[HEADS_AT_ONCE]; /* fixed size, constant indices: kept in registers */
#pragma GCC unroll 4
    for (int m = 0; m < M; m++)
#pragma GCC unroll 4
        for (int c = 0; c < NV; c++) memcpy(&r[m][c], acc + m * d + off + c * VL, sizeof(vf));
    for (int64_t j = a; j < b; j++) {
#pragma GCC unroll 4
        for (int m = 0; m < M; m++) wj[m] = vsplat(w[m * ls + j]);
#pragma GCC unroll 4
        for (int c = 0; c < NV; c++) {
            vf x;
            memcpy(&x, vp + j * d + off + c * VL, sizeof x);
#pragma GCC unroll 4
            for (int m = 0; m < M; m++) r[m][c] = vfma(wj[m], x, r[m][c]);
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < M; m++)
#pragma GCC unroll 4
        for (int c = 0; c < NV; c++) memcpy(acc + m * d + off + c * VL, &r[m][c], sizeof(vf));
}

#define PV_M(m)                                                                                              \
    switch (nv) {                                                                                            \
    case 1: pv_heads(m, 1, acc, w, ls, vp, a, b, d, off); break;                                             \
    case 2: pv_heads(m, 2, acc, w, ls, vp, a, b, d, off); break;                                             \
    case 3: pv_heads(m, 3, acc, w, ls, vp, a, b, d, off); break;                                             \
    default: pv_heads(m, 4, acc, w, ls, vp, a, b, d, off); break;                                            \
    }

/* The G query heads of one row that share a KV head (acc, w: head 0 of them), HEADS_AT_ONCE heads
 * and 4 vectors of the head dimension at a time. */
static inline void pv_group(int64_t G, float *acc0, const float *w0, int64_t ls, const float *vp, int64_t a,
                            int64_t b, int64_t d) {
    for (int64_t g = 0; g < G; g += HEADS_AT_ONCE) {
        float *acc = acc0 + g * d;
        const float *w = w0 + g * ls;
        for (int64_t off = 0; off < d; off += 4 * VL) {
            const int64_t nv = (d - off) / VL;
            switch (G - g < HEADS_AT_ONCE ? G - g : HEADS_AT_ONCE) {
            case 1: PV_M(1) break;
            case 2: PV_M(2) break;
#if HEADS_AT_ONCE > 2
            case 3: PV_M(3) break;
            case 4: PV_M(4) break;
#endif
            }
        }
    }
}
#undef PV_M

static inline int64_t first_visible(int64_t p, int64_t window) {
    return window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
}

/* R consecutive query rows t0.. of one sequence (table tab) at positions p0..p0+R-1. Scores go to
 * sc (row stride ls), q as float to qf, outputs accumulate in acc, each [R * h] rows; kvp holds
 * one packed key block. Two passes over the keys, in blocks of BLOCK_KEYS: scores (q . k), then,
 * after the softmax, the weighted sum of V. A block is read from the pool once per tile, packed,
 * and reused from L1 by every query head and row of the tile. */
INLINE void attn_tile(void *out, int64_t out_stride, const void *q, int64_t q_stride, int64_t t0, int64_t R,
                      int64_t p0, const int64_t *tab, const void *kc, const void *vc, int64_t h, int64_t kvh,
                      int64_t d, int64_t window, float scale, int64_t ls, float *sc, float *qf, float *acc,
                      float *inv, float *kvp, const int bf) {
    const int64_t G = h / kvh, p1 = p0 + R - 1, kb = BLOCK_KEYS;
    int64_t khn = BLOCK_FLOATS / (BLOCK_KEYS * d); /* KV heads packed at once */
    khn = khn < 1 ? 1 : khn > kvh ? kvh : khn;
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < h * d; i += VL) {
            const vf v = vld(q, (t0 + r) * q_stride + i, bf);
            memcpy(qf + r * h * d + i, &v, sizeof v);
        }
    const int64_t lo0 = first_visible(p0, window), hi = (p1 + 4) & ~(int64_t)3;
    for (int64_t jb = lo0 & ~(int64_t)3; jb < hi; jb += kb) {
        const int64_t je = jb + kb < hi ? jb + kb : hi;
        for (int64_t kh0 = 0; kh0 < kvh; kh0 += khn) {
            const int64_t kh1 = kh0 + khn < kvh ? kh0 + khn : kvh;
            pack_block(kvp, kc, tab, jb, je, kvh, kh0, kh1, d, hi, bf);
            for (int64_t kh = kh0; kh < kh1; kh++) {
                const float *kp = kvp + ((kh - kh0) * BLOCK_KEYS - jb) * d; /* key j at kp + j * d */
                for (int64_t r = 0; r < R; r++) {
                    const int64_t lo4 = first_visible(p0 + r, window) & ~(int64_t)3;
                    const int64_t hi4 = (p0 + r + 4) & ~(int64_t)3;
                    const int64_t a = jb > lo4 ? jb : lo4, b = je < hi4 ? je : hi4;
                    const int64_t hq = r * h + kh * G; /* the first of the G query heads */
                    if (a < b) qk_group(G, qf + hq * d, kp, a, b, d, scale, sc + hq * ls, ls);
                }
            }
        }
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t hq = 0; hq < h; hq++)
            inv[r * h + hq] = softmax_row(sc + (r * h + hq) * ls, first_visible(p0 + r, window), p0 + r);
    memset(acc, 0, (size_t)(R * h * d) * sizeof(float));
    for (int64_t jb = lo0; jb <= p1; jb += kb) {
        const int64_t je = jb + kb < p1 + 1 ? jb + kb : p1 + 1;
        for (int64_t kh0 = 0; kh0 < kvh; kh0 += khn) {
            const int64_t kh1 = kh0 + khn < kvh ? kh0 + khn : kvh;
            pack_block(kvp, vc, tab, jb, je, kvh, kh0, kh1, d, p1 + 1, bf);
            for (int64_t kh = kh0; kh < kh1; kh++) {
                const float *vp = kvp + ((kh - kh0) * BLOCK_KEYS - jb) * d;
                for (int64_t r = 0; r < R; r++) {
                    const int64_t lo = first_visible(p0 + r, window), hi1 = p0 + r + 1;
                    const int64_t a = jb > lo ? jb : lo, b = je < hi1 ? je : hi1;
                    const int64_t hq = r * h + kh * G;
                    if (a < b) pv_group(G, acc + hq * d, sc + hq * ls, ls, vp, a, b, d);
                }
            }
        }
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t hq = 0; hq < h; hq++) {
            const vf iv = vsplat(inv[r * h + hq]);
            for (int64_t c = 0; c < d; c += VL) {
                vf v;
                memcpy(&v, acc + (r * h + hq) * d + c, sizeof v);
                vst(out, (t0 + r) * out_stride + hq * d + c, v * iv, bf);
            }
        }
}

/* Attention for all T query rows of a step. Row t: q heads at q + t * q_stride (h of them, d
 * elements each), position row_pos[t], table tab + row_seq[t] * tab_stride (entries 0..row_pos[t]
 * must hold the sequence's cells; the table is padded to a multiple of 16 entries, with valid
 * cells). A key counts when its position is <= the row's (and > it - window when window > 0);
 * query head j uses KV head j / (h / kvh). Output row t goes to out + t * out_stride.
 * Rows are cut into tiles (up to TILE_ROWS consecutive rows of one sequence at consecutive
 * positions), one task each. Needs d % 16 == 0. */
void omni_attn(void *out, int64_t out_stride, const void *q, int64_t q_stride, int64_t T, int64_t h, int64_t kvh,
               int64_t d, const void *kc, const void *vc, const int64_t *tab, int64_t tab_stride,
               const int64_t *row_seq, const int64_t *row_pos, int64_t window, float scale, int nt, int bf) {
    if (T <= 0) return;
    int64_t ls = 16;
    for (int64_t t = 0; t < T; t++) ls = ROUND16(row_pos[t] + 1) > ls ? ROUND16(row_pos[t] + 1) : ls;
    int64_t cap = SCORE_BYTES / (h * ls * (int64_t)sizeof(float));
    cap = cap < 1 ? 1 : cap > TILE_ROWS ? TILE_ROWS : cap;
    int64_t *start = (int64_t *)malloc((size_t)(T + 1) * sizeof(int64_t)), n = 0;
    for (int64_t t = 0; t < T; t++)
        if (t == 0 || row_seq[t] != row_seq[t - 1] || row_pos[t] != row_pos[t - 1] + 1 ||
            t - start[n - 1] >= cap)
            start[n++] = t;
    start[n] = T;
#pragma omp parallel num_threads(nt) if (n > 1)
    {
        const int64_t kvp_floats = (BLOCK_FLOATS > BLOCK_KEYS * d ? BLOCK_FLOATS : BLOCK_KEYS * d) + VL;
        float *sc = (float *)malloc((size_t)(cap * h * (ls + 2 * d + 1) + kvp_floats) * sizeof(float));
        float *qf = sc + cap * h * ls, *acc = qf + cap * h * d, *inv = acc + cap * h * d, *kvp = inv + cap * h;
#pragma omp for schedule(dynamic, 1) /* tiles differ in cost: a prompt's later rows see more keys */
        for (int64_t i = 0; i < n; i++) {
            const int64_t t0 = start[i], R = start[i + 1] - t0;
            const int64_t *tb = tab + row_seq[t0] * tab_stride;
            if (bf)
                attn_tile(out, out_stride, q, q_stride, t0, R, row_pos[t0], tb, kc, vc, h, kvh, d, window, scale, ls,
                          sc, qf, acc, inv, kvp, 1);
            else
                attn_tile(out, out_stride, q, q_stride, t0, R, row_pos[t0], tb, kc, vc, h, kvh, d, window, scale, ls,
                          sc, qf, acc, inv, kvp, 0);
        }
        free(sc);
    }
    free(start);
}
