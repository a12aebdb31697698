/* Fused CPU kernels for the torch backend's layers, float32 and bfloat16 (see cpu_kernels.py).
 *
 * Built at run time with the system C compiler (-O3 -march=native -fopenmp) and called through
 * ctypes with raw pointers. The OpenMP pragmas bind to the libgomp that torch already loaded
 * (same soname), so these kernels share torch's thread pool instead of starting a second one.
 * Every kernel takes the thread count to use; small inputs run on the calling thread only.
 *
 * Vectors are GCC vector extensions of 16 floats (one AVX-512 register; the compiler splits
 * them on narrower ISAs), so the code stays portable C.
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
 * softmax denominators) are reordered, and exp is a Cephes-style polynomial (~1 ulp).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define VL 16
#define PAR_MIN_WORK 65536 /* elements below which a kernel stays on the calling thread */
#define INLINE static inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(VL * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(VL * sizeof(uint16_t))));

static inline vf vsplat(float x) { return (vf){0} + x; }
static inline vf vsel(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

static inline float hsum(vf v) { /* pairwise: log2(VL) shuffle-adds */
    v += __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
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

/* -- single-token attention -------------------------------------------------------------------- */

/* A key at position p counts for a query at qp: not after it, and inside the window if any. */
static inline int visible(int64_t p, int64_t qp, int64_t window) { return p <= qp && (window <= 0 || p > qp - window); }

/* One row of single-token attention: h = kvh * G query heads at q[qo:] (d elements each). Scores
 * go to sc [h, L] (masked cells hold -FLT_MAX), then exp in place, then the weighted sum of V is
 * accumulated in acc [h, d] (float, L1-resident). A cell's K (and V) row holds all KV heads:
 * reading it whole, once, keeps the accesses sequential. Inlined with G and bf constant. Needs
 * d % VL == 0. */
INLINE void attn_row(const int64_t G, void *out, int64_t oo, const void *q, int64_t qo, const void *kc,
                     const void *vc, const int64_t *bc, const int64_t *bp, int64_t L, int64_t qp, int64_t window,
                     int64_t kvh, int64_t d, float scale, float *sc, float *acc, const int bf) {
    const int64_t nc = d / VL, h = kvh * G, row_bytes = kvh * d * (bf ? 2 : 4);
    float m[h], inv[h];
    float *qf = acc; /* q as float, converted once (acc is not needed until the V pass) */
    for (int64_t i = 0; i < h * d; i += VL) {
        const vf v = vld(q, qo + i, bf);
        memcpy(qf + i, &v, sizeof v);
    }
    for (int64_t hq = 0; hq < h; hq++) m[hq] = -FLT_MAX;
    int any = 0;
    for (int64_t j = 0; j < L; j++) {
        if (!visible(bp[j], qp, window)) {
            for (int64_t hq = 0; hq < h; hq++) sc[hq * L + j] = -FLT_MAX;
            continue;
        }
        any = 1;
        if (j + PREFETCH_AHEAD < L) prefetch_bytes((const char *)kc + bc[j + PREFETCH_AHEAD] * row_bytes, row_bytes);
        for (int64_t kh = 0; kh < kvh; kh++) {
            const int64_t ko = (bc[j] * kvh + kh) * d;
            for (int64_t g = 0; g < G; g++) {
                const int64_t hq = kh * G + g;
                vf a = vsplat(0.f);
                for (int64_t c = 0; c < nc; c++) {
                    vf qv;
                    memcpy(&qv, qf + hq * d + c * VL, sizeof qv);
                    a += qv * vld(kc, ko + c * VL, bf);
                }
                const float s = hsum(a) * scale;
                sc[hq * L + j] = s;
                m[hq] = s > m[hq] ? s : m[hq];
            }
        }
    }
    for (int64_t hq = 0; hq < h; hq++) {
        float *row = sc + hq * L;
        const vf mv = vsplat(m[hq]);
        vf sum = vsplat(0.f);
        int64_t j = 0;
        for (; j + VL <= L; j += VL) {
            vf s;
            memcpy(&s, row + j, sizeof s);
            const vf e = vsel(s > vsplat(-FLT_MAX), vexp(s - mv), vsplat(0.f));
            memcpy(row + j, &e, sizeof e);
            sum += e;
        }
        float total = hsum(sum);
        for (; j < L; j++) {
            row[j] = row[j] > -FLT_MAX ? expf(row[j] - m[hq]) : 0.f;
            total += row[j];
        }
        inv[hq] = any ? 1.0f / total : 0.f;
    }
    memset(acc, 0, (size_t)(h * d) * sizeof(float));
    for (int64_t j = 0; j < L; j++) {
        if (!visible(bp[j], qp, window)) continue;
        if (j + PREFETCH_AHEAD < L) prefetch_bytes((const char *)vc + bc[j + PREFETCH_AHEAD] * row_bytes, row_bytes);
        for (int64_t kh = 0; kh < kvh; kh++) {
            const int64_t vo = (bc[j] * kvh + kh) * d;
            for (int64_t g = 0; g < G; g++) {
                const int64_t hq = kh * G + g;
                const vf p = vsplat(sc[hq * L + j]);
                float *a = acc + hq * d;
                for (int64_t c = 0; c < nc; c++) {
                    vf v;
                    memcpy(&v, a + c * VL, sizeof v);
                    v += p * vld(vc, vo + c * VL, bf);
                    memcpy(a + c * VL, &v, sizeof v);
                }
            }
        }
    }
    for (int64_t hq = 0; hq < h; hq++) {
        const vf iv = vsplat(inv[hq]);
        for (int64_t c = 0; c < nc; c++) {
            vf v;
            memcpy(&v, acc + hq * d + c * VL, sizeof v);
            vst(out, oo + hq * d + c * VL, v * iv, bf);
        }
    }
}

/* Attention for B single-token rows, each over its own cells (read in place, no gather copy).
 *
 * Row b is token rows[b] of q (q heads at q + rows[b] * q_stride) at position qpos[b]; its keys
 * are cells[b, :L] with positions cpos[b, :L] (padding has a position past every query). A cell
 * counts when its position is <= qpos[b] (and > qpos[b] - window when window > 0). Query head
 * j uses KV head j / (h / kvh). One task per row; K and V are each read once.
 * Output rows go to out + rows[b] * out_stride. Needs d % 16 == 0. */
void omni_decode_attn(void *out, int64_t out_stride, const void *q, int64_t q_stride, const int64_t *rows, int64_t B,
                      int64_t h, int64_t kvh, int64_t d, const void *kc, const void *vc, const int64_t *cells,
                      const int64_t *cpos, int64_t L, const int64_t *qpos, int64_t window, float scale, int nt,
                      int bf) {
    const int64_t G = h / kvh;
#pragma omp parallel num_threads(nt) if (B > 1)
    {
        float *sc = (float *)malloc((size_t)(h * L + h * d) * sizeof(float));
        float *acc = sc + h * L;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            const int64_t oo = rows[b] * out_stride, qo = rows[b] * q_stride;
            const int64_t *bc = cells + b * L, *bp = cpos + b * L;
#define ROW(g, t) attn_row(g, out, oo, q, qo, kc, vc, bc, bp, L, qpos[b], window, kvh, d, scale, sc, acc, t)
#define ROWS(t)                                                                                              \
    switch (G) {                                                                                             \
    case 1: ROW(1, t); break;                                                                                \
    case 2: ROW(2, t); break;                                                                                \
    case 3: ROW(3, t); break;                                                                                \
    case 4: ROW(4, t); break;                                                                                \
    case 5: ROW(5, t); break;                                                                                \
    case 6: ROW(6, t); break;                                                                                \
    case 7: ROW(7, t); break;                                                                                \
    case 8: ROW(8, t); break;                                                                                \
    default: ROW(G, t); break;                                                                               \
    }
            if (bf) {
                ROWS(1)
            } else {
                ROWS(0)
            }
#undef ROWS
#undef ROW
        }
        free(sc);
    }
}
