/* A layer's token-wise work in one pass each, fp32 or bf16, AVX-512: the PyTorch ops
   wavepp::rms_norm, wavepp::rope_ and wavepp::silu_mul(_) (built with the attention kernel
   into one library, loaded by wavepp.model.cpu_kernel).

   PyTorch runs each of these as several element-wise kernels, each reading and writing
   a [tokens, width] tensor (RMSNorm: square, mean, rsqrt, two products; rotary: two
   products, a negation, a concatenation, a sum; SwiGLU: SiLU, then the product), which
   on a CPU whose memory the cores share costs more than the arithmetic. Here each reads
   its inputs once and writes its output once, a row at a time.

   Every intermediate value is rounded to the tensors' type where PyTorch's sequence of
   kernels rounds it (bf16: each product and sum rounded to nearest even before the next
   step; fp32: none), so the results are PyTorch's up to the order of a sum of squares,
   the exponential's last bit, and products and sums the compiler may contract into one
   FMA in fp32.

   - rms_norm(x [rows, d], weight [d], eps, offset) -> [rows, d]: each row times
     1 / sqrt(mean(x^2) + eps) (fp32), rounded, times the weight (Llama's; rounded);
     with offset, the fp32 normed row times (1 + weight), rounded once (Qwen3-Next's).
   - rope_(x [tokens, heads, d], cos [tokens, w], sin [tokens, w]): in place,
     rotate-half rotary embedding of each head's leading w dims (x1 cos - x2 sin,
     x2 cos + x1 sin, each product and the sum rounded); the rest untouched.
   - silu_mul(gate_up [rows, 2 f]) -> [rows, f]: silu(gate) (rounded) times up, the gate
     the row's first f elements and up the next f; silu_mul_(gate_up) writes it over the
     gate half, in place.
   Rows may be strided (the last dimension contiguous); the rows run on torch's
   intra-op threads (at::parallel_for). */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#ifndef __AVX512F__
#error "wavepp's fused CPU ops need AVX-512F"
#endif

#include "cpu_simd.h" /* bf16, exp512, the bf16 conversions */

/* -- the ops -- */

static inline bf16 f32_to_bf16(float f) { /* to nearest even; a NaN stays a NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Loads and stores 16 elements (or one) as fp32; `round` rounds fp32 to the type. */
template <typename T> struct Io;

template <> struct Io<float> {
    static __m512 load(const float *p) { return _mm512_loadu_ps(p); }
    static void store(float *p, __m512 v) { _mm512_storeu_ps(p, v); }
    static __m512 round(__m512 v) { return v; }
    static float get(const float *p) { return *p; }
    static void put(float *p, float v) { *p = v; }
    static float round1(float v) { return v; }
};

template <> struct Io<bf16> {
    static __m512 load(const bf16 *p) {
        return bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)p));
    }
    static void store(bf16 *p, __m512 v) { _mm256_storeu_si256((__m256i *)p, to_bf16(v)); }
    static __m512 round(__m512 v) { return bf16x16_to_f32(to_bf16(v)); }
    static float get(const bf16 *p) { return bf16_to_f32(*p); }
    static void put(bf16 *p, float v) { *p = f32_to_bf16(v); }
    static float round1(float v) { return bf16_to_f32(f32_to_bf16(v)); }
};

/* rows of work an at::parallel_for chunk takes at least: ~16K elements */
static inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

template <typename T>
static void rms_norm_rows(const T *x, int64_t x_row, const T *w, T *out, int64_t rows,
                          int64_t d, float eps, bool offset) {
    using IO = Io<T>;
    at::parallel_for(0, rows, grain(d), [&](int64_t a, int64_t b) {
        for (int64_t r = a; r < b; r++) {
            const T *xr = x + r * x_row;
            T *o = out + r * d;
            __m512 acc = _mm512_setzero_ps();
            int64_t i = 0;
            for (; i + 16 <= d; i += 16) {
                const __m512 v = IO::load(xr + i);
                acc = _mm512_fmadd_ps(v, v, acc);
            }
            float ss = _mm512_reduce_add_ps(acc);
            for (; i < d; i++) ss += IO::get(xr + i) * IO::get(xr + i);
            const float inv = 1.0f / std::sqrt(ss / (float)d + eps);
            const __m512 vinv = _mm512_set1_ps(inv), one = _mm512_set1_ps(1.0f);
            for (i = 0; i + 16 <= d; i += 16) {
                const __m512 n = _mm512_mul_ps(IO::load(xr + i), vinv);
                const __m512 y = offset ? _mm512_mul_ps(n, _mm512_add_ps(one, IO::load(w + i)))
                                        : _mm512_mul_ps(IO::load(w + i), IO::round(n));
                IO::store(o + i, y);
            }
            for (; i < d; i++) {
                const float n = IO::get(xr + i) * inv;
                IO::put(o + i, offset ? n * (1.0f + IO::get(w + i)) : IO::get(w + i) * IO::round1(n));
            }
        }
    });
}

template <typename T>
static void rope_rows(T *x, int64_t tokens, int64_t heads, int64_t x_tok, int64_t x_head,
                      const T *cos, const T *sin, int64_t c_tok, int64_t s_tok, int64_t width) {
    using IO = Io<T>;
    const int64_t half = width / 2;
    at::parallel_for(0, tokens, grain(heads * width), [&](int64_t a, int64_t b) {
        for (int64_t t = a; t < b; t++) {
            const T *c = cos + t * c_tok, *s = sin + t * s_tok;
            for (int64_t h = 0; h < heads; h++) {
                T *p = x + t * x_tok + h * x_head;
                int64_t i = 0;
                for (; i + 16 <= half; i += 16) {
                    const __m512 x1 = IO::load(p + i), x2 = IO::load(p + half + i);
                    const __m512 a1 = IO::round(_mm512_mul_ps(x1, IO::load(c + i)));
                    const __m512 b1 = IO::round(_mm512_mul_ps(x2, IO::load(s + i)));
                    const __m512 a2 = IO::round(_mm512_mul_ps(x2, IO::load(c + half + i)));
                    const __m512 b2 = IO::round(_mm512_mul_ps(x1, IO::load(s + half + i)));
                    IO::store(p + i, _mm512_sub_ps(a1, b1));
                    IO::store(p + half + i, _mm512_add_ps(a2, b2));
                }
                for (; i < half; i++) {
                    const float x1 = IO::get(p + i), x2 = IO::get(p + half + i);
                    const float a1 = IO::round1(x1 * IO::get(c + i));
                    const float b1 = IO::round1(x2 * IO::get(s + i));
                    const float a2 = IO::round1(x2 * IO::get(c + half + i));
                    const float b2 = IO::round1(x1 * IO::get(s + half + i));
                    IO::put(p + i, a1 - b1);
                    IO::put(p + half + i, a2 + b2);
                }
            }
        }
    });
}

template <typename T>
static void silu_mul_rows(const T *gu, int64_t gu_row, T *out, int64_t out_row, int64_t rows,
                          int64_t f) {
    using IO = Io<T>;
    at::parallel_for(0, rows, grain(f), [&](int64_t a, int64_t b) {
        const __m512 one = _mm512_set1_ps(1.0f);
        for (int64_t r = a; r < b; r++) {
            const T *g = gu + r * gu_row, *u = g + f;
            T *o = out + r * out_row; /* may be g itself: element i read before it is written */
            int64_t i = 0;
            for (; i + 16 <= f; i += 16) {
                const __m512 v = IO::load(g + i);
                const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), v));
                const __m512 silu = IO::round(_mm512_div_ps(v, _mm512_add_ps(one, e)));
                IO::store(o + i, _mm512_mul_ps(silu, IO::load(u + i)));
            }
            for (; i < f; i++) {
                const float v = IO::get(g + i);
                IO::put(o + i, IO::round1(v / (1.0f + std::exp(-v))) * IO::get(u + i));
            }
        }
    });
}

static void check_type(const at::Tensor &x, const char *name) {
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
                " must be fp32 or bf16, not ", x.scalar_type());
    TORCH_CHECK(x.dim() >= 1 && (x.size(-1) <= 1 || x.stride(-1) == 1), name,
                "'s last dimension must be contiguous");
}

static at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps, bool offset) {
    check_type(x, "x");
    TORCH_CHECK(x.dim() == 2, "x must be [rows, d]");
    TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 &&
                    weight.size(0) == x.size(1) && weight.is_contiguous(),
                "weight must be [d], contiguous, of x's dtype");
    const int64_t rows = x.size(0), d = x.size(1);
    at::Tensor out = at::empty({rows, d}, x.options());
    if (x.scalar_type() == at::kFloat)
        rms_norm_rows<float>(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(),
                             out.data_ptr<float>(), rows, d, (float)eps, offset);
    else
        rms_norm_rows<bf16>((const bf16 *)x.data_ptr(), x.stride(0), (const bf16 *)weight.data_ptr(),
                            (bf16 *)out.data_ptr(), rows, d, (float)eps, offset);
    return out;
}

static void rope_(const at::Tensor &x, const at::Tensor &cos, const at::Tensor &sin) {
    check_type(x, "x");
    TORCH_CHECK(x.dim() == 3, "x must be [tokens, heads, d]");
    TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.sizes() == sin.sizes() &&
                    cos.size(0) == x.size(0) && cos.size(1) % 2 == 0 && cos.size(1) <= x.size(2),
                "cos and sin must be [tokens, w], w even and at most the head size");
    TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
                "cos and sin must be of x's dtype");
    TORCH_CHECK((cos.size(1) == 0 || (cos.stride(1) == 1 && sin.stride(1) == 1)),
                "cos and sin rows must be contiguous");
    const int64_t tokens = x.size(0), heads = x.size(1), width = cos.size(1);
    if (width == 0) return;
    if (x.scalar_type() == at::kFloat)
        rope_rows<float>(x.data_ptr<float>(), tokens, heads, x.stride(0), x.stride(1),
                         cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0), sin.stride(0),
                         width);
    else
        rope_rows<bf16>((bf16 *)x.data_ptr(), tokens, heads, x.stride(0), x.stride(1),
                        (const bf16 *)cos.data_ptr(), (const bf16 *)sin.data_ptr(), cos.stride(0),
                        sin.stride(0), width);
}

/* out: [rows, f] with its own row stride; gate_up's gate half itself (in place) or
   another tensor */
static void silu_mul_into(const at::Tensor &gate_up, const at::Tensor &out) {
    const int64_t rows = gate_up.size(0), f = gate_up.size(1) / 2;
    if (gate_up.scalar_type() == at::kFloat)
        silu_mul_rows<float>(gate_up.data_ptr<float>(), gate_up.stride(0), out.data_ptr<float>(),
                             out.stride(0), rows, f);
    else
        silu_mul_rows<bf16>((const bf16 *)gate_up.data_ptr(), gate_up.stride(0),
                            (bf16 *)out.data_ptr(), out.stride(0), rows, f);
}

static void check_gate_up(const at::Tensor &gate_up) {
    check_type(gate_up, "gate_up");
    TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [rows, 2 f]");
}

static at::Tensor silu_mul(const at::Tensor &gate_up) {
    check_gate_up(gate_up);
    at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
    silu_mul_into(gate_up, out);
    return out;
}

static void silu_mul_(const at::Tensor &gate_up) {
    check_gate_up(gate_up);
    silu_mul_into(gate_up, gate_up);
}

TORCH_LIBRARY_FRAGMENT(wavepp, m) {
    m.def("rms_norm(Tensor x, Tensor weight, float eps, bool offset) -> Tensor");
    m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
    m.def("silu_mul(Tensor gate_up) -> Tensor");
    m.def("silu_mul_(Tensor(a!) gate_up) -> ()");
}

TORCH_LIBRARY_IMPL(wavepp, CPU, m) {
    m.impl("rms_norm", &rms_norm);
    m.impl("rope_", &rope_);
    m.impl("silu_mul", &silu_mul);
    m.impl("silu_mul_", &silu_mul_);
}
