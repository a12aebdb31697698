/* Fused float32 CPU kernels for the torch backend's decode step (see cpu_kernels.py).
 *
 * Built at run time with the system C compiler (-O3 -march=native -fopenmp) and called through
 * ctypes with raw pointers. The OpenMP pragmas bind to the libgomp that torch already loaded
 * (same soname), so these kernels share torch's thread pool instead of starting a second one.
 * Every kernel takes the thread count to use; small inputs run on the calling thread only.
 *
 * Vectors are GCC vector extensions of 16 floats (one AVX-512 register; the compiler splits
 * them on narrower ISAs), so the code stays portable C.
 *
 * Layouts (all row-major, int64 indices):
 *   qkv    [T, stride]: per token q heads, then k heads, then v heads, each `d` floats
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

typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t))));

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf vsplat(float x) { return (vf){0} + x; }
static inline vf vsel(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

static inline float hsum(vf v) { /* pairwise: log2(VL) shuffle-adds */
    v += __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return v[0];
}

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
static inline void prefetch_row(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64 / sizeof(float)) __builtin_prefetch(p + i);
}

static inline float sumsq(const float *x, int64_t n) {
    vf acc = vsplat(0.f);
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        const vf v = vload(x + i);
        acc += v * v;
    }
    float s = hsum(acc);
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

/* out[t] = w * (x[t] * rsqrt(mean(x[t]^2) + eps)) for T rows of width n. */
void omni_rms_norm(float *out, int64_t out_stride, const float *x, int64_t x_stride, const float *w,
                   int64_t T, int64_t n, float eps, int nt) {
#pragma omp parallel for num_threads(nt) if (T * n >= PAR_MIN_WORK) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * x_stride;
        float *o = out + t * out_stride;
        const float r = 1.0f / sqrtf(sumsq(xr, n) / (float)n + eps);
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (xr[i] * r);
    }
}

/* Rotates the q heads of every token in place, rotates its k heads into kc[cells[t]] and copies
 * its v heads into vc[cells[t]]: the RoPE and KV-store part of a layer in one pass. With qn/kn
 * (Qwen3's per-head q/k RMSNorm weights, else NULL) each q/k head is normalised first. */
void omni_rope_store(float *qkv, int64_t T, int64_t stride, int64_t h, int64_t kvh, int64_t d,
                     const float *cos_t, const float *sin_t, const int64_t *pos, const int64_t *cells,
                     float *kc, float *vc, const float *qn, const float *kn, float eps, int nt) {
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(nt) if (T * stride >= PAR_MIN_WORK) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * stride;
        const float *c = cos_t + pos[t] * d;
        const float *s = sin_t + pos[t] * d;
        float *kdst = kc + cells[t] * kvh * d;
        for (int64_t head = 0; head < h + kvh; head++) {
            const float *x = row + head * d;
            float *dst = head < h ? row + head * d : kdst + (head - h) * d;
            const float *nw = head < h ? qn : kn;
            float y[512], z[512];
            if (nw != NULL) {
                const float r = 1.0f / sqrtf(sumsq(x, d) / (float)d + eps);
                for (int64_t i = 0; i < d; i++) y[i] = nw[i] * (x[i] * r);
                x = y;
            }
            for (int64_t i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                z[i] = x1 * c[i] + (-x2) * s[i];
                z[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
            memcpy(dst, z, (size_t)d * sizeof(float));
        }
        memcpy(vc + cells[t] * kvh * d, row + (h + kvh) * d, (size_t)(kvh * d) * sizeof(float));
    }
}

/* out[t, i] = silu(gu[t, i]) * gu[t, n + i] for T rows (gate and up halves of one matmul). */
void omni_silu_mul(float *out, const float *gu, int64_t T, int64_t n, int nt) {
#pragma omp parallel for num_threads(nt) if (T * n >= PAR_MIN_WORK) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * n;
        const float *u = g + n;
        float *o = out + t * n;
        int64_t i = 0;
        for (; i + VL <= n; i += VL) {
            const vf x = vload(g + i);
            vstore(o + i, (x / (vsplat(1.0f) + vexp(-x))) * vload(u + i));
        }
        for (; i < n; i++) o[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
    }
}

/* One row of single-token attention: h = kvh * G query heads at qr (d floats each). Scores go
 * to sc [h, L] (masked cells hold -FLT_MAX), then exp in place, then the weighted sum of V is
 * accumulated in acc [h, d] (L1-resident). A cell's K (and V) row holds all KV heads: reading
 * it whole, once, keeps the accesses sequential. Inlined with G constant. Needs d % VL == 0. */
static inline __attribute__((always_inline)) void attn_row(
    const int64_t G, float *orow, const float *qr, const float *kc, const float *vc, const int64_t *bc,
    const int64_t *bp, int64_t L, int64_t qp, int64_t window, int64_t kvh, int64_t d, float scale,
    float *sc, float *acc) {
    const int64_t nc = d / VL, h = kvh * G;
    float m[h], inv[h];
    for (int64_t hq = 0; hq < h; hq++) m[hq] = -FLT_MAX;
    int any = 0;
    for (int64_t j = 0; j < L; j++) {
        if (bp[j] > qp || (window > 0 && bp[j] <= qp - window)) {
            for (int64_t hq = 0; hq < h; hq++) sc[hq * L + j] = -FLT_MAX;
            continue;
        }
        any = 1;
        if (j + PREFETCH_AHEAD < L) prefetch_row(kc + bc[j + PREFETCH_AHEAD] * kvh * d, kvh * d);
        for (int64_t kh = 0; kh < kvh; kh++) {
            const float *kr = kc + (bc[j] * kvh + kh) * d;
            for (int64_t g = 0; g < G; g++) {
                const int64_t hq = kh * G + g;
                vf a = vsplat(0.f);
                for (int64_t c = 0; c < nc; c++) a += vload(qr + hq * d + c * VL) * vload(kr + c * VL);
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
            const vf s = vload(row + j);
            const vf e = vsel(s > vsplat(-FLT_MAX), vexp(s - mv), vsplat(0.f));
            vstore(row + j, e);
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
        if (bp[j] > qp || (window > 0 && bp[j] <= qp - window)) continue;
        if (j + PREFETCH_AHEAD < L) prefetch_row(vc + bc[j + PREFETCH_AHEAD] * kvh * d, kvh * d);
        for (int64_t kh = 0; kh < kvh; kh++) {
            const float *vr = vc + (bc[j] * kvh + kh) * d;
            for (int64_t g = 0; g < G; g++) {
                const int64_t hq = kh * G + g;
                const vf p = vsplat(sc[hq * L + j]);
                float *a = acc + hq * d;
                for (int64_t c = 0; c < nc; c++) vstore(a + c * VL, vload(a + c * VL) + p * vload(vr + c * VL));
            }
        }
    }
    for (int64_t hq = 0; hq < h; hq++) {
        const vf iv = vsplat(inv[hq]);
        for (int64_t c = 0; c < nc; c++) vstore(orow + hq * d + c * VL, vload(acc + hq * d + c * VL) * iv);
    }
}

/* Attention for B single-token rows, each over its own cells (read in place, no gather copy).
 *
 * Row b is token rows[b] of q (q heads at q + rows[b] * q_stride) at position qpos[b]; its keys
 * are cells[b, :L] with positions cpos[b, :L] (padding has a position past every query). A cell
 * counts when its position is <= qpos[b] (and > qpos[b] - window when window > 0). Query head
 * j uses KV head j / (h / kvh). One task per row; K and V are each read once.
 * Output rows go to out + rows[b] * out_stride. Needs d % 16 == 0. */
void omni_decode_attn(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                      const int64_t *rows, int64_t B, int64_t h, int64_t kvh, int64_t d,
                      const float *kc, const float *vc, const int64_t *cells, const int64_t *cpos,
                      int64_t L, const int64_t *qpos, int64_t window, float scale, int nt) {
    const int64_t G = h / kvh;
#pragma omp parallel num_threads(nt) if (B > 1)
    {
        float *sc = (float *)malloc((size_t)(h * L + h * d) * sizeof(float));
        float *acc = sc + h * L;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            float *orow = out + rows[b] * out_stride;
            const float *qr = q + rows[b] * q_stride;
            const int64_t *bc = cells + b * L, *bp = cpos + b * L;
#define ROW(g) attn_row(g, orow, qr, kc, vc, bc, bp, L, qpos[b], window, kvh, d, scale, sc, acc)
            switch (G) {
            case 1: ROW(1); break;
            case 2: ROW(2); break;
            case 3: ROW(3); break;
            case 4: ROW(4); break;
            case 5: ROW(5); break;
            case 6: ROW(6); break;
            case 7: ROW(7); break;
            case 8: ROW(8); break;
            default: ROW(G); break;
            }
#undef ROW
        }
        free(sc);
    }
}
