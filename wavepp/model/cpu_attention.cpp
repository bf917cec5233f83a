/* Paged causal attention for a whole wave, fp32 or bf16, AVX-512: the PyTorch op
   wavepp::paged_attention (built and loaded by wavepp.model.cpu_kernel).

   Every new token of a sequence attends to the keys at positions 0..its own, read from
   the paged pool through the sequence's block table: the cached prefix and the chunk's
   own keys (written to the pool before the call) alike, in one online-softmax pass.
   No mask is built, nothing above the diagonal is computed beyond the tile that holds
   it, and grouped query heads share one pass over their KV head's keys.

   Work items: (sequence, KV head, tile of QT query positions). An item packs its query
   rows (the g heads of the group times QT positions), then walks the keys in tiles of
   KT: packs K transposed and V, then for each block of RB rows S = Q K^T, the online
   softmax per row, O += P V (a block's S and P, 48 KiB, stay near the core between
   the three, where a whole tile's 384 KiB would not).
   The items run on torch's intra-op threads (at::parallel_for, at::get_num_threads()
   of them: torch's own OpenMP pool, which is why the library is built with -fopenmp),
   each thread taking the next item until none is left, the costliest first.

   Element types (one per call: q, pools and out all fp32 or all bf16; every sum fp32):
   - fp32: the query rows are packed scaled, the products are fp32 FMAs (qk, pv).
   - bf16, three paths (the caller picks one; one this build lacks becomes CONVERT):
     AMX (tiles: tdpbf16ps; built where the compiler targets AMX, the process having
     asked Linux for the tile state, wavepp::amx_init) and DOT (AVX-512 BF16:
     vdpbf16ps) pack Q and K as pairs of bf16 along d, one 32-bit word a pair (K
     transposed by the same 16 x 16 transpose, of words: the panels are AMX's B
     layout), so S = Q K^T takes pairs of dims; the scale multiplies S in fp32. P is
     rounded to bf16 (as FlashAttention rounds it for its second product) and V packed
     as pairs of keys, so O += P V takes pairs of keys; each row's sum l is taken over
     the rounded P, the weights O is made of (their exponential by a degree-4
     polynomial, exact to well under bf16's rounding). CONVERT converts Q, K and V to
     fp32 as it packs them, then runs the fp32 products.
   The output is written in the inputs' type (bf16 rounded to nearest even).
*/
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#ifndef __AVX512F__
#error "wavepp's CPU attention kernel needs AVX-512F"
#endif

#define KT 256     /* keys per tile (a multiple of 32) */
#define ROWS 256   /* query rows (heads of a group x positions) per item, at most */
#define RB 32      /* rows a key tile's products and softmax take at a time (a multiple of 16) */

#include "cpu_simd.h" /* bf16, exp512, the bf16 conversions */

typedef struct {
    int64_t q_offset;   /* first new token of the sequence in q/out */
    int64_t num_new;    /* new tokens */
    int64_t start;      /* cached tokens before them (the first new token's position) */
    int64_t table_at;   /* the sequence's block table in the flat table array */
} Seq;


/* 2^t for weights rounded to bf16 next (2^-9 of relative error there): 2^f (f = t -
   round(t) in [-0.5, 0.5]) by a polynomial of degree 4 fitted for relative error
   (< 1e-5, 2^-16.6), scaled by 2^round(t) (vscalefps: 0 far below the max, no clamp
   needed). */
static inline __m512 exp2_bf16(__m512 t) {
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(9.630151093006134e-03f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5818647146224976e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402241975069046e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931350231170654e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000004768371582f));
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

#ifdef __AVX512BF16__
#define HAS_DOT 1
/* qk over bf16 pairs: S[r][j] = sum_p Q[r][p] . K[j][p] for rows 0..rows-1 (a multiple
   of 8) and keys 0..kpad-1 (a multiple of 32), where word p of a row holds dims 2p and
   2p+1; Kt is [kpad / 32][dp][32] words, as qk's panels. */
static void qk_dot(const uint32_t *Q, int dp, const uint32_t *Kt, int kpad, int rows, float *S) {
    for (int j = 0; j < kpad; j += 32) {
        const uint32_t *panel = Kt + (int64_t)j * dp;
        for (int r0 = 0; r0 < rows; r0 += 8) {
            const uint32_t *q = Q + (int64_t)r0 * dp;
            __m512 c[8][2];
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) c[r][0] = c[r][1] = _mm512_setzero_ps();
            for (int d = 0; d < dp; d++) {
                __m512bh b0 = (__m512bh)_mm512_load_si512(panel + d * 32);
                __m512bh b1 = (__m512bh)_mm512_load_si512(panel + d * 32 + 16);
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++) {
                    __m512bh a = (__m512bh)_mm512_set1_epi32((int)q[r * dp + d]);
                    c[r][0] = _mm512_dpbf16_ps(c[r][0], a, b0);
                    c[r][1] = _mm512_dpbf16_ps(c[r][1], a, b1);
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

/* pv over bf16 pairs of keys: O[r] = alpha[r] O[r] + sum_j<kn P[r][j] V[j], where P is
   [rows][KT] bf16 (a word holds keys 2p and 2p+1) and V2 [ceil(kn / 2)][d_v] words
   (word c of pair p holds V[2p][c] and V[2p+1][c]); d_v a multiple of 16. */
static void pv_dot(const bf16 *P, const uint32_t *V2, int kn, int d_v, int rows,
                   const float *alpha, float *O) {
    const uint32_t *Pw = (const uint32_t *)P;
    const int pairs = (kn + 1) / 2;
    for (int r = 0; r < rows; r++) {
        __m512 a = _mm512_set1_ps(alpha[r]);
        float *o = O + (int64_t)r * d_v;
        for (int c = 0; c < d_v; c += 16) _mm512_store_ps(o + c, _mm512_mul_ps(a, _mm512_load_ps(o + c)));
    }
    for (int p0 = 0; p0 < pairs; p0 += PV_KEYS / 2) {
        const int p1 = p0 + PV_KEYS / 2 < pairs ? p0 + PV_KEYS / 2 : pairs;
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
                for (int p = p0; p < p1; p++) {
                    const uint32_t *vr = V2 + (int64_t)p * d_v + c0;
                    __m512bh w0 = (__m512bh)_mm512_loadu_si512(vr);
                    __m512bh w1 = wide ? (__m512bh)_mm512_loadu_si512(vr + 16)
                                       : (__m512bh)_mm512_setzero_si512();
#pragma GCC unroll 8
                    for (int r = 0; r < 8; r++) {
                        __m512bh x = (__m512bh)_mm512_set1_epi32((int)Pw[(int64_t)(r0 + r) * (KT / 2) + p]);
                        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, w0);
                        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, w1);
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
#else
#define HAS_DOT 0
#endif

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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAS_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux: ask for a state component */
#define XFEATURE_XTILEDATA 18      /* the tiles' data */

/* Linux lends the AMX tiles to a process that asks (once, for all its threads): the op
   wavepp::amx_init, true when lent. */
static bool amx_init() {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* every tile 16 rows of 64 bytes: 16 x 32 bf16 (A, or B as pairs) or 16 x 16 fp32 (C) */
static void amx_configure(void) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
}

/* qk by tiles: S[r][j] = Q[r] . K[j] for rows 0..rows-1 (a multiple of 16) and keys
   0..kpad-1 (a multiple of 32). Q is [rows][kw] words of bf16 pairs (kw a multiple of
   16: 32 dims a tile), Kt the panels [kpad / 32][kw][32] words: a panel's 16 keys of
   16 words are a B tile. Tiles 0-3: S for 2 row blocks x 2 key halves; 4-5: Q; 6-7: K. */
static void qk_amx(const uint32_t *Q, int kw, const uint32_t *Kt, int kpad, int rows, float *S) {
    for (int j = 0; j < kpad; j += 32) {
        const uint32_t *panel = Kt + (int64_t)j * kw;
        int r0 = 0;
        for (; r0 + 32 <= rows; r0 += 32) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int p = 0; p < kw; p += 16) {
                _tile_loadd(4, Q + (int64_t)r0 * kw + p, kw * 4);
                _tile_loadd(5, Q + (int64_t)(r0 + 16) * kw + p, kw * 4);
                _tile_loadd(6, panel + p * 32, 128);
                _tile_loadd(7, panel + p * 32 + 16, 128);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, S + (int64_t)r0 * KT + j, KT * 4);
            _tile_stored(1, S + (int64_t)r0 * KT + j + 16, KT * 4);
            _tile_stored(2, S + (int64_t)(r0 + 16) * KT + j, KT * 4);
            _tile_stored(3, S + (int64_t)(r0 + 16) * KT + j + 16, KT * 4);
        }
        for (; r0 < rows; r0 += 16) {
            _tile_zero(0);
            _tile_zero(1);
            for (int p = 0; p < kw; p += 16) {
                _tile_loadd(4, Q + (int64_t)r0 * kw + p, kw * 4);
                _tile_loadd(6, panel + p * 32, 128);
                _tile_loadd(7, panel + p * 32 + 16, 128);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
            }
            _tile_stored(0, S + (int64_t)r0 * KT + j, KT * 4);
            _tile_stored(1, S + (int64_t)r0 * KT + j + 16, KT * 4);
        }
    }
}

/* pv by tiles: O[r] = alpha[r] O[r] + sum_j<kpad P[r][j] V[j] for rows 0..rows-1 (a
   multiple of 16); P is [rows][KT] bf16 (32 keys an A tile), V2 [kpad / 2][d_v] words
   (16 pairs of keys by 16 columns a B tile), d_v a multiple of 16; P is 0 past each
   row's keys and V2 0 past the tile's. Tiles 0-3: O, 2 row blocks x 2 column blocks. */
static void pv_amx(const bf16 *P, const uint32_t *V2, int kpad, int d_v, int rows,
                   const float *alpha, float *O) {
    for (int r = 0; r < rows; r++) {
        __m512 a = _mm512_set1_ps(alpha[r]);
        float *o = O + (int64_t)r * d_v;
        for (int c = 0; c < d_v; c += 16) _mm512_store_ps(o + c, _mm512_mul_ps(a, _mm512_load_ps(o + c)));
    }
    const int64_t ld = (int64_t)d_v * 4;
    for (int r0 = 0; r0 < rows; r0 += 16) {
        const int two_rows = r0 + 32 <= rows;
        int c0 = 0;
        for (; c0 + 32 <= d_v; c0 += 32) {
            float *o = O + (int64_t)r0 * d_v + c0;
            _tile_loadd(0, o, ld);
            _tile_loadd(1, o + 16, ld);
            if (two_rows) {
                _tile_loadd(2, o + 16 * d_v, ld);
                _tile_loadd(3, o + 16 * d_v + 16, ld);
            }
            for (int k = 0; k < kpad; k += 32) {
                const uint32_t *v = V2 + (int64_t)(k / 2) * d_v + c0;
                _tile_loadd(4, P + (int64_t)r0 * KT + k, KT * 2);
                _tile_loadd(6, v, ld);
                _tile_loadd(7, v + 16, ld);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (two_rows) {
                    _tile_loadd(5, P + (int64_t)(r0 + 16) * KT + k, KT * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, o, ld);
            _tile_stored(1, o + 16, ld);
            if (two_rows) {
                _tile_stored(2, o + 16 * d_v, ld);
                _tile_stored(3, o + 16 * d_v + 16, ld);
            }
        }
        for (; c0 < d_v; c0 += 16) { /* a last block of 16 columns */
            float *o = O + (int64_t)r0 * d_v + c0;
            _tile_loadd(0, o, ld);
            if (two_rows) _tile_loadd(2, o + 16 * d_v, ld);
            for (int k = 0; k < kpad; k += 32) {
                _tile_loadd(4, P + (int64_t)r0 * KT + k, KT * 2);
                _tile_loadd(6, V2 + (int64_t)(k / 2) * d_v + c0, ld);
                _tile_dpbf16ps(0, 4, 6);
                if (two_rows) {
                    _tile_loadd(5, P + (int64_t)(r0 + 16) * KT + k, KT * 2);
                    _tile_dpbf16ps(2, 5, 6);
                }
            }
            _tile_stored(0, o, ld);
            if (two_rows) _tile_stored(2, o + 16 * d_v, ld);
        }
        if (two_rows) r0 += 16;
    }
}
#else
#define HAS_AMX 0
static bool amx_init() { return false; }
#endif

enum { CONVERT = 0, DOT = 1, AMX = 2 }; /* how bf16 is multiplied (the path of paged_attention) */

/* stands in for the keys past a tile's last: d_k <= 1024 fp32 or 2048 bf16 */
alignas(64) static const float zeros[1024] = {};

typedef struct {
    const void *q, *k_pool, *v_pool;
    void *out;
    const Seq *seqs;
    const int64_t *tables;
    int64_t block_size, heads, kv_heads, d_k, d_v;
    int64_t k_row, k_head, v_row, v_head; /* pool strides, in elements */
    float scale;
    int positions; /* query positions per item */
    int bf16;      /* q, pools and out in bf16 (else fp32) */
    int path;      /* bf16: CONVERT, DOT or AMX, one this build has; fp32: CONVERT */
    int64_t kw;    /* DOT, AMX: 32-bit words of a packed Q or K row (pairs of dims) */
} Wave;

typedef struct {
    float *Q, *Kt, *V, *S, *O, *m, *l, *alpha;
    float *P;  /* DOT, AMX: P in bf16, [RB][KT] (S is [RB][KT] fp32: a block's rows) */
    float *Kc; /* CONVERT in bf16: 16 key rows in fp32, [16][d_k] */
} Scratch;

static int64_t pool_row(const Wave *w, const Seq *s, int64_t pos) {
    int64_t slot = w->tables[s->table_at + pos / w->block_size];
    return slot * w->block_size + pos % w->block_size;
}

/* element `index` of `base`, elements of `size` bytes */
static inline const void *element(const void *base, int64_t index, int size) {
    return (const char *)base + index * size;
}

/* Q rows r = hg * nq + (i - i0) (head kh * g + hg, position start + i), zero past
   `rows`: fp32, scaled, for the fp32 products; for DOT and AMX, kw words of bf16 pairs,
   unscaled (the scale multiplies S), zero past d_k. */
static void pack_q(const Wave *w, const Seq *s, int64_t kh, int64_t i0, int64_t nq,
                   int64_t rows, int64_t rpad, Scratch *x) {
    const int64_t g = w->heads / w->kv_heads, d_k = w->d_k;
    const int64_t width = w->path == CONVERT ? d_k : w->kw; /* a row, in 32-bit elements */
    for (int64_t r = 0; r < rpad; r++) {
        if (r >= rows) {
            memset(x->Q + r * width, 0, width * sizeof(float));
            continue;
        }
        int64_t h = kh * g + r / nq, i = i0 + r % nq;
        int64_t src = ((s->q_offset + i) * w->heads + h) * d_k;
        if (!w->bf16) {
            const float *q = (const float *)w->q + src;
            float *dst = x->Q + r * width;
            for (int64_t d = 0; d < d_k; d++) dst[d] = q[d] * w->scale;
        } else if (w->path == CONVERT) {
            const bf16 *q = (const bf16 *)w->q + src;
            float *dst = x->Q + r * width;
            for (int64_t d = 0; d < d_k; d++) dst[d] = bf16_to_f32(q[d]) * w->scale;
        } else {
            bf16 *dst = (bf16 *)(x->Q + r * width);
            memcpy(dst, (const bf16 *)w->q + src, d_k * sizeof(bf16));
            memset(dst + d_k, 0, (2 * width - d_k) * sizeof(bf16));
        }
    }
}

/* K^T in panels of 32 keys and V, for keys k0..k0+kn-1 of the tile (zeros up to kpad):
   fp32 panels [kpad / 32][d_k][32] and V [kpad][d_v] for the fp32 products; for DOT and
   AMX, panels of words [kpad / 32][kw][32] (word p of a key: its dims 2p and 2p + 1)
   and V2 [kpad / 2][d_v] words (word c of pair p: V[2p][c] and V[2p + 1][c]). */
static void pack_kv(const Wave *w, const Seq *s, int64_t kh, int64_t k0, int kn, int kpad,
                    Scratch *x) {
    const int64_t d_k = w->d_k, d_v = w->d_v, kw = w->kw;
    const int size = w->bf16 ? 2 : 4;
    for (int j0 = 0; j0 < kpad; j0 += 16) {
        const void *kr[16], *vr[16];
        for (int j = 0; j < 16; j++) {
            if (j0 + j >= kn) {
                kr[j] = vr[j] = zeros;
                continue;
            }
            int64_t row = pool_row(w, s, k0 + j0 + j);
            kr[j] = element(w->k_pool, row * w->k_row + kh * w->k_head, size);
            vr[j] = element(w->v_pool, row * w->v_row + kh * w->v_head, size);
        }
        if (w->path != CONVERT) {
            uint32_t *panel = (uint32_t *)x->Kt + (j0 & ~31) * kw + (j0 & 31);
            int64_t p = 0;
            for (; p + 16 <= d_k / 2; p += 16) { /* whole words: a transpose of words */
                const float *cols[16];
                for (int j = 0; j < 16; j++) cols[j] = (const float *)((const bf16 *)kr[j] + 2 * p);
                transpose16(cols, (float *)(panel + p * 32), 32);
            }
            for (; p < kw; p++)
                for (int j = 0; j < 16; j++) {
                    const bf16 *k = (const bf16 *)kr[j];
                    uint32_t lo = 2 * p < d_k ? k[2 * p] : 0, hi = 2 * p + 1 < d_k ? k[2 * p + 1] : 0;
                    panel[p * 32 + j] = lo | hi << 16;
                }
            uint32_t *v2 = (uint32_t *)x->V + (int64_t)(j0 / 2) * d_v;
            for (int j = 0; j < 16; j += 2, v2 += d_v)
                for (int64_t c = 0; c < d_v; c += 16) {
                    __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const bf16 *)vr[j] + c)));
                    __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const bf16 *)vr[j + 1] + c)));
                    _mm512_storeu_si512(v2 + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
                }
            continue;
        }
        if (w->bf16) { /* converted: K rows into Kc, V rows into V */
            for (int j = 0; j < 16; j++) {
                float *kc = x->Kc + j * d_k, *v = x->V + (int64_t)(j0 + j) * d_v;
                const bf16 *k = (const bf16 *)kr[j], *vs = (const bf16 *)vr[j];
                for (int64_t d = 0; d < d_k; d++) kc[d] = bf16_to_f32(k[d]);
                for (int64_t c = 0; c < d_v; c += 16)
                    _mm512_store_ps(v + c, bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(vs + c))));
                kr[j] = kc;
            }
        } else {
            for (int j = 0; j < 16; j++)
                memcpy(x->V + (int64_t)(j0 + j) * d_v, vr[j], d_v * sizeof(float));
        }
        float *panel = x->Kt + (j0 & ~31) * d_k + (j0 & 31);
        int64_t d = 0;
        for (; d + 16 <= d_k; d += 16) {
            const float *cols[16];
            for (int j = 0; j < 16; j++) cols[j] = (const float *)kr[j] + d;
            transpose16(cols, panel + d * 32, 32);
        }
        for (; d < d_k; d++)
            for (int j = 0; j < 16; j++) panel[d * 32 + j] = ((const float *)kr[j])[d];
    }
}

/* The online softmax of one tile for rows r0..r1-1, row by row, zero past each row's
   keys up to kpad: P overwrites S (fp32), or for DOT and AMX goes to P in bf16, each
   row's sum taken over the rounded weights. S and P hold the block's rows only (row r at
   r - r0); S holds the scores divided by `mul` (1 where Q was packed scaled). */
static void softmax_tile(const Wave *w, const Seq *s, int64_t i0, int64_t nq, int64_t rows,
                         int64_t r0, int64_t r1, int64_t k0, int kn, int kpad, float mul,
                         Scratch *x) {
    const __m512 mulv = _mm512_set1_ps(mul);
    const int rounded = w->path != CONVERT;
    for (int64_t r = r0; r < r1; r++) {
        float *srow = x->S + (r - r0) * KT;
        bf16 *prow = (bf16 *)x->P + (r - r0) * KT;
        int64_t valid = r < rows ? s->start + i0 + r % nq - k0 + 1 : 0;
        if (valid > kn) valid = kn;
        if (valid <= 0) {
            if (rounded) memset(prow, 0, kpad * sizeof(bf16));
            else memset(srow, 0, kpad * sizeof(float));
            x->alpha[r] = 1.0f;
            continue;
        }
        __m512 mx = _mm512_set1_ps(-INFINITY);
        int64_t j = 0;
        for (; j + 16 <= valid; j += 16) mx = _mm512_max_ps(mx, _mm512_load_ps(srow + j));
        __mmask16 tail = (__mmask16)((1u << (valid - j)) - 1u);
        if (j < valid) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_load_ps(srow + j));
        float m_new = _mm512_reduce_max_ps(mx);
        if (x->m[r] >= m_new) m_new = x->m[r];
        /* 1 where the max stands (no exp to take), 0 on the first tile (m = -inf) */
        const float a = m_new == x->m[r] ? 1.0f : expf((x->m[r] - m_new) * mul);
        /* two sums (fp32, and bf16 without vdpbf16ps), so that one add's latency does
           not pace the loop */
        __m512 sum = _mm512_setzero_ps(), sum2 = _mm512_setzero_ps();
        if (rounded) { /* 2^(s c - m c), c = mul log2(e): one FMA, then exp2_bf16 */
            const __m512 c = _mm512_set1_ps(mul * 1.4426950408889634f);
            const __m512 mc = _mm512_set1_ps(m_new * mul * 1.4426950408889634f);
#ifdef __AVX512BF16__
            /* 32 weights rounded by one instruction, summed by one dot product with ones
               (each rounded weight times 1, pairs added in fp32) */
            const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
            for (j = 0; j + 32 <= valid; j += 32) {
                __m512bh h = _mm512_cvtne2ps_pbh(
                    exp2_bf16(_mm512_fmsub_ps(_mm512_load_ps(srow + j + 16), c, mc)),
                    exp2_bf16(_mm512_fmsub_ps(_mm512_load_ps(srow + j), c, mc)));
                _mm512_store_si512(prow + j, (__m512i)h);
                sum2 = _mm512_dpbf16_ps(sum2, h, ones);
            }
#else
            for (j = 0; j + 32 <= valid; j += 32) {
                __m256i h0 = to_bf16(exp2_bf16(_mm512_fmsub_ps(_mm512_load_ps(srow + j), c, mc)));
                __m256i h1 = to_bf16(exp2_bf16(_mm512_fmsub_ps(_mm512_load_ps(srow + j + 16), c, mc)));
                _mm256_store_si256((__m256i *)(prow + j), h0);
                _mm256_store_si256((__m256i *)(prow + j + 16), h1);
                sum = _mm512_add_ps(sum, bf16x16_to_f32(h0));
                sum2 = _mm512_add_ps(sum2, bf16x16_to_f32(h1));
            }
#endif
            for (; j < kpad; j += 16) {
                __m512 p = _mm512_setzero_ps();
                if (j < valid) {
                    p = exp2_bf16(_mm512_fmsub_ps(_mm512_load_ps(srow + j), c, mc));
                    if (j + 16 > valid) p = _mm512_maskz_mov_ps(tail, p);
                }
                __m256i h = to_bf16(p);
                _mm256_store_si256((__m256i *)(prow + j), h);
                sum = _mm512_add_ps(sum, bf16x16_to_f32(h));
            }
        } else {
            const __m512 mv = _mm512_set1_ps(m_new);
            for (j = 0; j + 32 <= valid; j += 32) {
                __m512 p0 = exp512(_mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(srow + j), mv), mulv));
                __m512 p1 = exp512(_mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(srow + j + 16), mv), mulv));
                _mm512_store_ps(srow + j, p0);
                _mm512_store_ps(srow + j + 16, p1);
                sum = _mm512_add_ps(sum, p0);
                sum2 = _mm512_add_ps(sum2, p1);
            }
            for (; j < kpad; j += 16) {
                __m512 p = _mm512_setzero_ps();
                if (j < valid) {
                    p = exp512(_mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(srow + j), mv), mulv));
                    if (j + 16 > valid) p = _mm512_maskz_mov_ps(tail, p);
                }
                _mm512_store_ps(srow + j, p);
                sum = _mm512_add_ps(sum, p);
            }
        }
        x->l[r] = x->l[r] * a + _mm512_reduce_add_ps(_mm512_add_ps(sum, sum2));
        x->m[r] = m_new;
        x->alpha[r] = a;
    }
}

static void run_item(const Wave *w, const Seq *s, int64_t kh, int64_t i0, Scratch *x) {
    const int64_t g = w->heads / w->kv_heads, d_k = w->d_k, d_v = w->d_v;
    const int64_t i1 = i0 + w->positions < s->num_new ? i0 + w->positions : s->num_new;
    const int64_t nq = i1 - i0, rows = g * nq;
    const int64_t rpad = w->path == AMX ? (rows + 15) & ~(int64_t)15 : (rows + 7) & ~(int64_t)7;
    pack_q(w, s, kh, i0, nq, rows, rpad, x);
    memset(x->O, 0, rpad * d_v * sizeof(float));
    for (int64_t r = 0; r < rpad; r++) x->m[r] = -INFINITY, x->l[r] = 0.0f, x->alpha[r] = 1.0f;

    const int64_t keys = s->start + i1; /* keys 0..keys-1 are seen by some row */
    const int64_t width = w->path == CONVERT ? d_k : w->kw; /* a packed Q row, 32-bit words */
    for (int64_t k0 = 0; k0 < keys; k0 += KT) {
        const int kn = (int)(keys - k0 < KT ? keys - k0 : KT), kpad = (kn + 31) & ~31;
        pack_kv(w, s, kh, k0, kn, kpad, x);
        /* a block of rows at a time: its scores and weights stay near the core from one
           product to the next (the whole tile's would not) */
        for (int64_t r0 = 0; r0 < rpad; r0 += RB) {
            const int64_t r1 = r0 + RB < rpad ? r0 + RB : rpad;
            const int rb = (int)(r1 - r0);
            float *O = x->O + r0 * d_v, *alpha = x->alpha + r0;
            if (w->path == CONVERT) {
                qk(x->Q + r0 * width, (int)d_k, x->Kt, kpad, rb, x->S);
                softmax_tile(w, s, i0, nq, rows, r0, r1, k0, kn, kpad, 1.0f, x);
                pv(x->S, x->V, kn, (int)d_v, rb, alpha, O);
                continue;
            }
#if HAS_AMX || HAS_DOT
            const uint32_t *Q = (const uint32_t *)x->Q + r0 * width, *Kt = (const uint32_t *)x->Kt;
            const uint32_t *V2 = (const uint32_t *)x->V;
#endif
#if HAS_AMX
            if (w->path == AMX) {
                qk_amx(Q, (int)w->kw, Kt, kpad, rb, x->S);
                softmax_tile(w, s, i0, nq, rows, r0, r1, k0, kn, kpad, w->scale, x);
                pv_amx((const bf16 *)x->P, V2, kpad, (int)d_v, rb, alpha, O);
                continue;
            }
#endif
#if HAS_DOT
            qk_dot(Q, (int)w->kw, Kt, kpad, rb, x->S);
            softmax_tile(w, s, i0, nq, rows, r0, r1, k0, kn, kpad, w->scale, x);
            pv_dot((const bf16 *)x->P, V2, kn, (int)d_v, rb, alpha, O);
#endif
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t h = kh * g + r / nq, i = i0 + r % nq;
        int64_t dst = ((s->q_offset + i) * w->heads + h) * d_v;
        const __m512 inv = _mm512_set1_ps(1.0f / x->l[r]);
        for (int64_t c = 0; c < d_v; c += 16) {
            __m512 o = _mm512_mul_ps(_mm512_load_ps(x->O + r * d_v + c), inv);
            if (w->bf16) _mm256_storeu_si256((__m256i *)((bf16 *)w->out + dst + c), f32_to_bf16x16(o));
            else _mm512_storeu_ps((float *)w->out + dst + c, o);
        }
    }
}

static float *aligned(size_t n) {
    return static_cast<float *>(aligned_alloc(64, (n * sizeof(float) + 63) & ~(size_t)63));
}

/* The bf16 paths this build has: bit DOT (vdpbf16ps: the compiler targeted AVX-512
   BF16), bit AMX (the AMX tiles; usable once amx_init has succeeded). */
static int64_t bf16_paths() { return HAS_DOT << DOT | HAS_AMX << AMX; }

/* One thread's share of a wave: it takes the next item until none is left (the
   costliest first, so that the last items taken are short). A thread that cannot have
   its scratch memory takes none; the others do its share. */
static void run_items(const Wave &w, const std::vector<int64_t> &work,
                      std::atomic<int64_t> &next) {
    const int64_t g = w.heads / w.kv_heads, items = (int64_t)work.size() / 3;
    const int64_t rpad = ((g * w.positions) + 15) & ~(int64_t)15;
    const int64_t width = w.d_k > w.kw ? w.d_k : w.kw; /* a packed Q or K row, 32-bit words */
    Scratch x = {aligned(rpad * width), aligned(width * KT), aligned(KT * w.d_v),
                 aligned(RB * KT), aligned(rpad * w.d_v), aligned(rpad), aligned(rpad),
                 aligned(rpad), aligned(RB * KT / 2), aligned(16 * w.d_k)};
    if (x.Q && x.Kt && x.V && x.S && x.O && x.m && x.l && x.alpha && x.P && x.Kc) {
#if HAS_AMX
        if (w.path == AMX) amx_configure();
#endif
        for (int64_t it; (it = next.fetch_add(1)) < items;)
            run_item(&w, &w.seqs[work[3 * it]], work[3 * it + 1], work[3 * it + 2], &x);
#if HAS_AMX
        if (w.path == AMX) _tile_release();
#endif
    }
    free(x.Q), free(x.Kt), free(x.V), free(x.S), free(x.O), free(x.m), free(x.l),
        free(x.alpha), free(x.P), free(x.Kc);
}

/* The op wavepp::paged_attention: every new token of every sequence -> out [T, heads,
   d_v] in q's dtype. q [T, heads, d_k]; pools [rows, kv_heads, d] addressed by row and
   head strides, each row contiguous; seqs [num_seqs, 4] (Seq) and the flat block tables,
   int64. fp32 or bf16 alike for q and both pools; bf16 is multiplied by `path` (CONVERT,
   DOT or AMX; one this build lacks becomes CONVERT). The arguments are checked here
   (a bad one raises in Python: ValueError for a slot outside the pool), the items run
   on torch's intra-op threads (at::parallel_for: OpenMP, at::get_num_threads() of
   them), and the call fails (torch.OutOfMemoryError) only if no thread had scratch. */
static at::Tensor paged_attention(const at::Tensor &q_in, const at::Tensor &k_pool,
                                  const at::Tensor &v_pool, const at::Tensor &seqs,
                                  const at::Tensor &tables, int64_t block_size, double scale,
                                  int64_t path) {
    const auto dtype = q_in.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "q must be fp32 or bf16, not ",
                dtype);
    TORCH_CHECK(k_pool.scalar_type() == dtype && v_pool.scalar_type() == dtype,
                "q and the pools must share one dtype");
    TORCH_CHECK(q_in.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3,
                "q [T, H, D] and pools [rows, KV, D] are 3-D");
    TORCH_CHECK(k_pool.stride(2) == 1 && v_pool.stride(2) == 1, "pool rows must be contiguous");
    const at::Tensor q = q_in.contiguous();
    const int64_t heads = q.size(1), kv_heads = k_pool.size(1), d_k = k_pool.size(2),
                  d_v = v_pool.size(2);
    TORCH_CHECK(q.size(2) == d_k, "q's head size ", q.size(2), " is not the keys' ", d_k);
    TORCH_CHECK(v_pool.size(1) == kv_heads && kv_heads > 0 && heads % kv_heads == 0,
                heads, " query heads do not group over ", kv_heads, " KV heads");
    TORCH_CHECK(d_v % 16 == 0 && d_v <= 1024 && d_k <= 1024,
                "value width must be a multiple of 16 and widths at most 1024");
    TORCH_CHECK(block_size > 0, "block_size must be positive");
    TORCH_CHECK(path >= CONVERT && path <= AMX, "path must be 0 (CONVERT), 1 (DOT) or 2 (AMX)");
    TORCH_CHECK(seqs.scalar_type() == at::kLong && tables.scalar_type() == at::kLong &&
                    seqs.is_contiguous() && tables.is_contiguous() && seqs.dim() == 2 &&
                    seqs.size(1) == 4 && tables.dim() == 1,
                "seqs [n, 4] and tables [m] are contiguous int64");
    const int64_t total = q.size(0), num_seqs = seqs.size(0), entries = tables.size(0);
    const int64_t slots = std::min(k_pool.size(0), v_pool.size(0)) / block_size;
    const int64_t *table = tables.data_ptr<int64_t>();
    for (int64_t i = 0; i < entries; i++)
        TORCH_CHECK_VALUE(table[i] >= 0 && table[i] < slots,
                          "a block table names a slot outside the pool of ", slots, " slots");
    const Seq *seq = reinterpret_cast<const Seq *>(seqs.data_ptr<int64_t>());
    for (int64_t s = 0; s < num_seqs; s++) {
        const Seq &x = seq[s];
        TORCH_CHECK(x.q_offset >= 0 && x.num_new >= 0 && x.start >= 0 &&
                        x.q_offset + x.num_new <= total,
                    "sequence ", s, " reads queries outside q");
        const int64_t blocks = (x.start + x.num_new + block_size - 1) / block_size;
        TORCH_CHECK(x.table_at >= 0 && x.table_at + blocks <= entries,
                    "sequence ", s, " reads past the block tables");
    }
    at::Tensor out = at::empty({total, heads, d_v}, q.options());
    const int bf16 = dtype == at::kBFloat16;
    const int code = bf16 && (bf16_paths() >> path & 1) ? (int)path : CONVERT;
    const int64_t dp = (d_k + 1) / 2; /* words of bf16 pairs in a K row */
    Wave w = {q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), out.data_ptr(), seq, table,
              block_size, heads, kv_heads, d_k, d_v, k_pool.stride(0), k_pool.stride(1),
              v_pool.stride(0), v_pool.stride(1), (float)scale, 0, bf16, code,
              code == AMX ? (dp + 15) & ~(int64_t)15 : dp};
    const int64_t g = heads / kv_heads;
    w.positions = (int)(ROWS / g > 0 ? ROWS / g : 1);
    /* the costliest items (most keys: the last tiles of each sequence) first */
    std::vector<int64_t> work;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t tiles = (seq[s].num_new + w.positions - 1) / w.positions;
        for (int64_t t = tiles - 1; t >= 0; t--)
            for (int64_t kh = 0; kh < kv_heads; kh++) work.insert(work.end(), {s, kh, t * w.positions});
    }
    const int64_t items = (int64_t)work.size() / 3;
    std::atomic<int64_t> next{0};
    /* one task a thread; each takes items as it goes (a static split of the items
       would leave the threads with the short ones idle) */
    at::parallel_for(0, std::min<int64_t>(items, at::get_num_threads()), 1,
                     [&](int64_t, int64_t) { run_items(w, work, next); });
    TORCH_CHECK_WITH(OutOfMemoryError, next.load() >= items,
                     "WavePP's CPU attention kernel could not allocate its scratch memory");
    return out;
}

TORCH_LIBRARY(wavepp, m) {
    m.def("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor seqs, Tensor tables,"
          " int block_size, float scale, int path) -> Tensor");
    m.def("bf16_paths() -> int", &bf16_paths);
    m.def("amx_init() -> bool", &amx_init);
}

TORCH_LIBRARY_IMPL(wavepp, CPU, m) { m.impl("paged_attention", &paged_attention); }
