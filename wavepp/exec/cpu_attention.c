/* Paged causal attention for a whole wave, fp32, AVX-512 (wavepp.exec.cpu_kernel).

   Every new token of a sequence attends to the keys at positions 0..its own, read from
   the paged pool through the sequence's block table: the cached prefix and the chunk's
   own keys (written to the pool before the call) alike, in one online-softmax pass.
   No mask is built, nothing above the diagonal is computed beyond the tile that holds
   it, and grouped query heads share one pass over their KV head's keys.

   Work items: (sequence, KV head, tile of QT query positions). An item packs its query
   rows (the g heads of the group times QT positions, scaled), then walks the keys in
   tiles of KT: packs K transposed and V, S = Q K^T, the online softmax per row, O += P V.
   The items are spread over the calling process's OpenMP threads (torch's own pool:
   the same libgomp is loaded first by torch).
*/
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef __AVX512F__
#error "wavepp's CPU attention kernel needs AVX-512F"
#endif

#define KT 256     /* keys per tile */
#define ROWS 256   /* query rows (heads of a group x positions) per item, at most */

typedef struct {
    int64_t q_offset;   /* first new token of the sequence in q/out */
    int64_t num_new;    /* new tokens */
    int64_t start;      /* cached tokens before them (the first new token's position) */
    int64_t table_at;   /* the sequence's block table in the flat table array */
} Seq;

static inline __m512 exp512(__m512 x) {
    /* e^x = 2^n * 2^f with t = x log2(e), n = round(t), f = t - n in [-0.5, 0.5];
       2^f by its Taylor series to degree 7 (relative error < 1e-8 before rounding). */
    x = _mm512_max_ps(x, _mm512_set1_ps(-100.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* S[r][j] = Q[r] . K[j] for rows 0..rows-1 (a multiple of 8) and keys 0..kpad-1 (a
   multiple of 32); Kt is K transposed in panels of 32 keys, [kpad / 32][d][32], so a
   panel is contiguous (a [d][kpad] layout's stride maps a panel onto few cache sets).
   Panels outer: one panel stays in L1 while every row block passes over it. */
static void qk(const float *Q, int d_k, const float *Kt, int kpad, int rows, float *S) {
    for (int j = 0; j < kpad; j += 32) {
        const float *panel = Kt + (int64_t)j * d_k;
        for (int r0 = 0; r0 < rows; r0 += 8) {
            const float *q = Q + (int64_t)r0 * d_k;
            __m512 c[8][2];
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) c[r][0] = c[r][1] = _mm512_setzero_ps();
            for (int d = 0; d < d_k; d++) {
                __m512 b0 = _mm512_load_ps(panel + d * 32);
                __m512 b1 = _mm512_load_ps(panel + d * 32 + 16);
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++) {
                    __m512 a = _mm512_set1_ps(q[r * d_k + d]);
                    c[r][0] = _mm512_fmadd_ps(a, b0, c[r][0]);
                    c[r][1] = _mm512_fmadd_ps(a, b1, c[r][1]);
                }
            }
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) {
                _mm512_store_ps(S + (int64_t)(r0 + r) * KT + j, c[r][0]);
                _mm512_store_ps(S + (int64_t)(r0 + r) * KT + j + 16, c[r][1]);
            }
        }
    }
}

#define PV_KEYS 64 /* keys of V (16 KiB at d_v = 64) kept in L1 while every row passes */

/* O[r] = alpha[r] O[r] + sum_j<kn P[r][j] V[j] for rows 0..rows-1 (a multiple of 8);
   V is [kn][d_v], d_v a multiple of 16. Rows are scaled by alpha first. */
static void pv(const float *P, const float *V, int kn, int d_v, int rows, const float *alpha,
               float *O) {
    for (int r = 0; r < rows; r++) {
        __m512 a = _mm512_set1_ps(alpha[r]);
        float *o = O + (int64_t)r * d_v;
        for (int c = 0; c < d_v; c += 16) _mm512_store_ps(o + c, _mm512_mul_ps(a, _mm512_load_ps(o + c)));
    }
    for (int j0 = 0; j0 < kn; j0 += PV_KEYS) {
        const int j1 = j0 + PV_KEYS < kn ? j0 + PV_KEYS : kn;
        for (int c0 = 0; c0 < d_v; c0 += 32) {
            const int wide = c0 + 32 <= d_v; /* else one vector of 16 columns */
            for (int r0 = 0; r0 < rows; r0 += 8) {
                __m512 acc[8][2];
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++) {
                    const float *o = O + (int64_t)(r0 + r) * d_v + c0;
                    acc[r][0] = _mm512_load_ps(o);
                    acc[r][1] = wide ? _mm512_load_ps(o + 16) : _mm512_setzero_ps();
                }
                for (int j = j0; j < j1; j++) {
                    const float *vr = V + (int64_t)j * d_v + c0;
                    __m512 w0 = _mm512_load_ps(vr);
                    __m512 w1 = wide ? _mm512_load_ps(vr + 16) : _mm512_setzero_ps();
#pragma GCC unroll 8
                    for (int r = 0; r < 8; r++) {
                        __m512 p = _mm512_set1_ps(P[(int64_t)(r0 + r) * KT + j]);
                        acc[r][0] = _mm512_fmadd_ps(p, w0, acc[r][0]);
                        acc[r][1] = _mm512_fmadd_ps(p, w1, acc[r][1]);
                    }
                }
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++) {
                    float *o = O + (int64_t)(r0 + r) * d_v + c0;
                    _mm512_store_ps(o, acc[r][0]);
                    if (wide) _mm512_store_ps(o + 16, acc[r][1]);
                }
            }
        }
    }
}

/* dst[k * ld + i] = rows[i][k] for i, k in 0..15: a 16 x 16 transpose in registers */
static inline void transpose16(const float *const *rows, float *dst, long ld) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(rows[i]);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int i = 0; i < 16; i += 8)
        for (int k = 0; k < 4; k++) {
            t[i + k] = _mm512_shuffle_f32x4(r[i + k], r[i + 4 + k], 0x88);
            t[i + 4 + k] = _mm512_shuffle_f32x4(r[i + k], r[i + 4 + k], 0xdd);
        }
    for (int k = 0; k < 8; k++) {
        r[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
        r[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xdd);
    }
    for (int k = 0; k < 16; k++) _mm512_storeu_ps(dst + k * ld, r[k]);
}
static const float zeros[1024]; /* stands in for the keys past a tile's last (d_k <= 1024) */

typedef struct {
    const float *q, *k_pool, *v_pool;
    float *out;
    const Seq *seqs;
    const int64_t *tables;
    int64_t block_size, heads, kv_heads, d_k, d_v;
    int64_t k_row, k_head, v_row, v_head; /* pool strides, in floats */
    float scale;
    int positions; /* query positions per item */
} Wave;

typedef struct {
    float *Q, *Kt, *V, *S, *O, *m, *l, *alpha;
} Scratch;

static int64_t pool_row(const Wave *w, const Seq *s, int64_t pos) {
    int64_t slot = w->tables[s->table_at + pos / w->block_size];
    return slot * w->block_size + pos % w->block_size;
}

static void run_item(const Wave *w, const Seq *s, int64_t kh, int64_t i0, Scratch *x) {
    const int64_t g = w->heads / w->kv_heads, d_k = w->d_k, d_v = w->d_v;
    const int64_t i1 = i0 + w->positions < s->num_new ? i0 + w->positions : s->num_new;
    const int64_t nq = i1 - i0, rows = g * nq, rpad = (rows + 7) & ~(int64_t)7;
    /* rows r = hg * nq + (i - i0): head kh * g + hg, position start + i */
    for (int64_t r = 0; r < rpad; r++) {
        float *dst = x->Q + r * d_k;
        if (r >= rows) {
            memset(dst, 0, d_k * sizeof(float));
            continue;
        }
        int64_t h = kh * g + r / nq, i = i0 + r % nq;
        const float *src = w->q + ((s->q_offset + i) * w->heads + h) * d_k;
        for (int64_t d = 0; d < d_k; d++) dst[d] = src[d] * w->scale;
    }
    memset(x->O, 0, rpad * d_v * sizeof(float));
    for (int64_t r = 0; r < rpad; r++) x->m[r] = -INFINITY, x->l[r] = 0.0f, x->alpha[r] = 1.0f;

    const int64_t keys = s->start + i1; /* keys 0..keys-1 are seen by some row */
    for (int64_t k0 = 0; k0 < keys; k0 += KT) {
        const int kn = (int)(keys - k0 < KT ? keys - k0 : KT), kpad = (kn + 31) & ~31;
        /* pack K^T (panels of 32 keys) and V [kn][d_v], 16 keys at a time */
        for (int j0 = 0; j0 < kpad; j0 += 16) {
            const float *kr[16];
            for (int j = 0; j < 16; j++) {
                if (j0 + j >= kn) {
                    kr[j] = zeros;
                    continue;
                }
                int64_t row = pool_row(w, s, k0 + j0 + j);
                kr[j] = w->k_pool + row * w->k_row + kh * w->k_head;
                memcpy(x->V + (int64_t)(j0 + j) * d_v, w->v_pool + row * w->v_row + kh * w->v_head,
                       d_v * sizeof(float));
            }
            float *panel = x->Kt + (j0 & ~31) * d_k + (j0 & 31);
            int64_t d = 0;
            for (; d + 16 <= d_k; d += 16) {
                const float *at[16];
                for (int j = 0; j < 16; j++) at[j] = kr[j] + d;
                transpose16(at, panel + d * 32, 32);
            }
            for (; d < d_k; d++)
                for (int j = 0; j < 16; j++) panel[d * 32 + j] = kr[j][d];
        }
        qk(x->Q, (int)d_k, x->Kt, kpad, (int)rpad, x->S);
        /* the online softmax, row by row; P overwrites S, zero past each row's keys */
        for (int64_t r = 0; r < rpad; r++) {
            float *srow = x->S + r * KT;
            int64_t valid = r < rows ? s->start + i0 + r % nq - k0 + 1 : 0;
            if (valid > kn) valid = kn;
            if (valid <= 0) {
                memset(srow, 0, kpad * sizeof(float));
                x->alpha[r] = 1.0f;
                continue;
            }
            __m512 mx = _mm512_set1_ps(-INFINITY);
            int64_t j = 0;
            for (; j + 16 <= valid; j += 16) mx = _mm512_max_ps(mx, _mm512_load_ps(srow + j));
            __mmask16 tail = (__mmask16)((1u << (valid - j)) - 1u);
            if (j < valid) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_load_ps(srow + j));
            float m_new = _mm512_reduce_max_ps(mx);
            if (x->m[r] > m_new) m_new = x->m[r];
            const float a = expf(x->m[r] - m_new); /* 0 on the first tile (m = -inf) */
            const __m512 mv = _mm512_set1_ps(m_new);
            __m512 sum = _mm512_setzero_ps();
            for (j = 0; j + 16 <= valid; j += 16) {
                __m512 p = exp512(_mm512_sub_ps(_mm512_load_ps(srow + j), mv));
                _mm512_store_ps(srow + j, p);
                sum = _mm512_add_ps(sum, p);
            }
            if (j < valid) {
                __m512 p = _mm512_maskz_mov_ps(tail, exp512(_mm512_sub_ps(_mm512_load_ps(srow + j), mv)));
                _mm512_store_ps(srow + j, p);
                sum = _mm512_add_ps(sum, p);
                j += 16;
            }
            for (; j < kpad; j += 16) _mm512_store_ps(srow + j, _mm512_setzero_ps());
            x->l[r] = x->l[r] * a + _mm512_reduce_add_ps(sum);
            x->m[r] = m_new;
            x->alpha[r] = a;
        }
        pv(x->S, x->V, kn, (int)d_v, (int)rpad, x->alpha, x->O);
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t h = kh * g + r / nq, i = i0 + r % nq;
        float *dst = w->out + ((s->q_offset + i) * w->heads + h) * d_v;
        const float inv = 1.0f / x->l[r];
        for (int64_t c = 0; c < d_v; c++) dst[c] = x->O[r * d_v + c] * inv;
    }
}

static void *aligned(size_t n) {
    return aligned_alloc(64, (n * sizeof(float) + 63) & ~(size_t)63);
}

/* The entry point: every new token of every sequence, over num_threads threads.
   q [T, heads, d_k] and out [T, heads, d_v] contiguous; pools addressed by row and head
   strides; d_v a multiple of 16 (checked by the caller). Returns 0, or -1 when scratch
   memory could not be had. */
int wavepp_paged_attention(const float *q, const float *k_pool, const float *v_pool, float *out,
                           const int64_t *seqs, int64_t num_seqs, const int64_t *tables,
                           int64_t block_size, int64_t heads, int64_t kv_heads, int64_t d_k,
                           int64_t d_v, int64_t k_row, int64_t k_head, int64_t v_row,
                           int64_t v_head, float scale, int num_threads) {
    Wave w = {q, k_pool, v_pool, out, (const Seq *)seqs, tables, block_size, heads, kv_heads,
              d_k, d_v, k_row, k_head, v_row, v_head, scale, 0};
    const int64_t g = heads / kv_heads;
    w.positions = (int)(ROWS / g > 0 ? ROWS / g : 1);
    int64_t items = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        items += kv_heads * ((w.seqs[s].num_new + w.positions - 1) / w.positions);
    int64_t *work = malloc((items > 0 ? items : 1) * 3 * sizeof(int64_t));
    if (!work) return -1;
    /* the costliest items (most keys: the last tiles of each sequence) first */
    int64_t n = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t tiles = (w.seqs[s].num_new + w.positions - 1) / w.positions;
        for (int64_t t = tiles - 1; t >= 0; t--)
            for (int64_t kh = 0; kh < kv_heads; kh++) {
                work[3 * n] = s, work[3 * n + 1] = kh, work[3 * n + 2] = t * w.positions;
                n++;
            }
    }
    const int64_t rpad = ((g * w.positions) + 7) & ~(int64_t)7;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        Scratch x = {aligned(rpad * d_k), aligned(d_k * KT), aligned(KT * d_v), aligned(rpad * KT),
                     aligned(rpad * d_v), aligned(rpad), aligned(rpad), aligned(rpad)};
        const int ok = x.Q && x.Kt && x.V && x.S && x.O && x.m && x.l && x.alpha;
        failed = !ok;
        /* every thread reaches the loop (its barrier); one without scratch skips its items,
           and the caller falls back on the whole call */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++)
            if (ok) run_item(&w, &w.seqs[work[3 * it]], work[3 * it + 1], work[3 * it + 2], &x);
        free(x.Q), free(x.Kt), free(x.V), free(x.S), free(x.O), free(x.m), free(x.l),
            free(x.alpha);
    }
    free(work);
    return failed ? -1 : 0;
}
