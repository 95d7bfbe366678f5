/* fak's CPU kernels: the decode attention over the paged KV cache and the few-row linear
 * (GEMV), for bf16 and float32 data. Built at run time for the machine it runs on
 * (native_engine/kernels/cpu_native.py: -O3 -march=native -fopenmp) and called through ctypes
 * with the tensors' data pointers; the Python side checks shapes, dtypes, contiguity and
 * every block id before a call, so nothing here bounds-checks.
 *
 * Numerics: bf16 products are exact in float32 (AVX512-BF16's dot-product instruction, or
 * the values widened by a 16-bit shift), sums are float32, and each result is rounded once
 * to its output dtype (round to nearest even), as torch's bf16 kernels accumulate. Every
 * request's rows are computed on their own in a fixed order, so a result does not depend on
 * what else is in the batch.
 *
 * Threads: OpenMP over requests x KV heads (attention) or output rows (linear). Loaded after
 * torch, the library binds to the libgomp torch already loaded (one soname): one pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef uint16_t bf16;
#define INLINE static inline __attribute__((always_inline))
#define MAX_HEAD_DIM 512
#define MAX_GROUP 16

INLINE float bf16_to_f32(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE bf16 f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u); /* quiet NaN */
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

INLINE float load_f32(const float *p) { return *p; }
INLINE float load_bf16(const bf16 *p) { return bf16_to_f32(*p); }
INLINE void put_f32(float *p, float v) { *p = v; }
INLINE void put_bf16(bf16 *p, float v) { *p = f32_to_bf16(v); }

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vf;
INLINE vf vzero(void) { return _mm512_setzero_ps(); }
INLINE vf vset1(float a) { return _mm512_set1_ps(a); }
INLINE vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
INLINE float vsum(vf a) { return _mm512_reduce_add_ps(a); }
INLINE vf vload_f32(const float *p) { return _mm512_loadu_ps(p); }
INLINE vf vload_bf16(const bf16 *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
INLINE void vstore(float *p, vf a) { _mm512_storeu_ps(p, a); }
/* Round to nearest even, as f32_to_bf16 (a NaN stays a quiet NaN). */
INLINE void vstore_bf16(bf16 *p, vf a) {
    const __m512i u = _mm512_castps_si512(a);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q),
                              _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}
#elif defined(__AVX2__)
#define LANES 8
typedef __m256 vf;
INLINE vf vzero(void) { return _mm256_setzero_ps(); }
INLINE vf vset1(float a) { return _mm256_set1_ps(a); }
INLINE vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
INLINE float vsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
INLINE vf vload_f32(const float *p) { return _mm256_loadu_ps(p); }
INLINE vf vload_bf16(const bf16 *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
INLINE void vstore(float *p, vf a) { _mm256_storeu_ps(p, a); }
INLINE void vstore_bf16(bf16 *p, vf a) {
    const __m256i u = _mm256_castps_si256(a);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
#else
#define LANES 1
typedef float vf;
INLINE vf vzero(void) { return 0.0f; }
INLINE vf vset1(float a) { return a; }
INLINE vf vfma(vf a, vf b, vf c) { return a * b + c; }
INLINE float vsum(vf a) { return a; }
INLINE vf vload_f32(const float *p) { return *p; }
INLINE vf vload_bf16(const bf16 *p) { return bf16_to_f32(*p); }
INLINE void vstore(float *p, vf a) { *p = a; }
INLINE void vstore_bf16(bf16 *p, vf a) { *p = f32_to_bf16(a); }
#endif

/* e^x, vectorised: Cephes' expf polynomial after reducing x by a whole number of ln 2
 * (relative error about 1e-7); x is clamped to [-87.3, 88] (below, about 1e-38 instead of 0,
 * which neither a softmax nor SiLU can tell apart; above, 1.7e38 instead of more). */
#if defined(__AVX512F__)
INLINE vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
INLINE vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
INLINE vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
INLINE vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
INLINE float vhmax(vf a) { return _mm512_reduce_max_ps(a); }
INLINE vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
INLINE vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
INLINE vf vfloor(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF); }
INLINE vf vpow2(vf n) { /* 2^n for whole n in [-126, 127] */
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#elif defined(__AVX2__)
INLINE vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
INLINE vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
INLINE vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
INLINE vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
INLINE float vhmax(vf a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
INLINE vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
INLINE vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
INLINE vf vfloor(vf a) { return _mm256_floor_ps(a); }
INLINE vf vpow2(vf n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#else
INLINE vf vmax(vf a, vf b) { return a > b ? a : b; }
INLINE vf vmin(vf a, vf b) { return a < b ? a : b; }
INLINE vf vsub(vf a, vf b) { return a - b; }
INLINE vf vdiv(vf a, vf b) { return a / b; }
INLINE float vhmax(vf a) { return a; }
INLINE vf vmul(vf a, vf b) { return a * b; }
INLINE vf vadd(vf a, vf b) { return a + b; }
INLINE vf vfloor(vf a) { return floorf(a); }
INLINE vf vpow2(vf n) { return ldexpf(1.0f, (int)n); }
#endif

INLINE vf vexp(vf x) {
    x = vmin(vmax(x, vset1(-87.3f)), vset1(88.0f));
    const vf n = vfloor(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)));
    x = vfma(n, vset1(-0.693359375f), x);
    x = vfma(n, vset1(2.12194440e-4f), x);
    vf y = vset1(1.9875691500e-4f);
    y = vfma(y, x, vset1(1.3981999507e-3f));
    y = vfma(y, x, vset1(8.3334519073e-3f));
    y = vfma(y, x, vset1(4.1665795894e-2f));
    y = vfma(y, x, vset1(1.6666665459e-1f));
    y = vfma(y, x, vset1(5.0000001201e-1f));
    y = vfma(y, vmul(x, x), vadd(x, vset1(1.0f)));
    return vmul(y, vpow2(n));
}

/* s[0..n) = softmax(s[0..n)), n >= 1: the weights of one query row, summed in a fixed
 * order that depends on n alone. */
INLINE void softmax_row(float *s, int64_t n) {
    int64_t i = 0;
    vf vm = vset1(-INFINITY);
    for (; i + LANES <= n; i += LANES) vm = vmax(vm, vload_f32(s + i));
    float m = vhmax(vm);
    for (; i < n; i++) m = s[i] > m ? s[i] : m;
    vf vsum_ = vzero(), vmx = vset1(-m);
    for (i = 0; i + LANES <= n; i += LANES) {
        vf e = vexp(vadd(vload_f32(s + i), vmx));
        vstore(s + i, e);
        vsum_ = vadd(vsum_, e);
    }
    float total = vsum(vsum_);
    for (; i < n; i++) {
        s[i] = expf(s[i] - m);
        total += s[i];
    }
    const float inv = 1.0f / total;
    const vf vinv = vset1(inv);
    for (i = 0; i + LANES <= n; i += LANES) vstore(s + i, vmul(vload_f32(s + i), vinv));
    for (; i < n; i++) s[i] *= inv;
}

/* ---- whole rows between T and float32, vectorised ---- */

#define DEFINE_ROWS(SUFFIX, T, LOAD, PUT, VLOAD, VSTORE)                                       \
    INLINE void widen_row_##SUFFIX(float *dst, const T *src, int64_t n) {                      \
        int64_t i = 0;                                                                         \
        for (; i + LANES <= n; i += LANES) vstore(dst + i, VLOAD(src + i));                    \
        for (; i < n; i++) dst[i] = LOAD(src + i);                                             \
    }                                                                                          \
    INLINE void round_row_##SUFFIX(T *dst, const float *src, int64_t n) {                      \
        int64_t i = 0;                                                                         \
        for (; i + LANES <= n; i += LANES) VSTORE(dst + i, vload_f32(src + i));                \
        for (; i < n; i++) PUT(dst + i, src[i]);                                               \
    }
DEFINE_ROWS(f32, float, load_f32, put_f32, vload_f32, vstore)
DEFINE_ROWS(bf16, bf16, load_bf16, put_bf16, vload_bf16, vstore_bf16)

/* ---- dot products of `n` elements, vectorised over whole lanes, the rest scalar ---- */

#define DEFINE_DOT(NAME, TA, TB, LOADA, LOADB, SCALARA, SCALARB)                               \
    INLINE float NAME(const TA *a, const TB *b, int64_t n) {                                   \
        vf acc = vzero();                                                                      \
        int64_t i = 0;                                                                         \
        for (; i + LANES <= n; i += LANES) acc = vfma(LOADA(a + i), LOADB(b + i), acc);        \
        float s = vsum(acc);                                                                   \
        for (; i < n; i++) s += SCALARA(a + i) * SCALARB(b + i);                               \
        return s;                                                                              \
    }
DEFINE_DOT(dot_f32_f32, float, float, vload_f32, vload_f32, load_f32, load_f32)
DEFINE_DOT(dot_f32_bf16, float, bf16, vload_f32, vload_bf16, load_f32, load_bf16)

#if defined(__AVX512BF16__)
/* bf16 . bf16 with AVX512-BF16's dot-product instruction, two products per lane. */
INLINE float dot_bf16_bf16(const bf16 *a, const bf16 *b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + i),
                               (__m512bh)_mm512_loadu_si512(b + i));
    if (i < n) {
        __mmask32 m = (__mmask32)((1ull << (n - i)) - 1);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(m, a + i),
                               (__m512bh)_mm512_maskz_loadu_epi16(m, b + i));
    }
    return _mm512_reduce_add_ps(acc);
}
#define HAVE_DOT_BF16 1
#endif

/* acc[0..n) += a * x[0..n) */
#define DEFINE_AXPY(NAME, T, LOAD, SCALAR)                                                     \
    INLINE void NAME(float *acc, float a, const T *x, int64_t n) {                             \
        vf va = vset1(a);                                                                      \
        int64_t i = 0;                                                                         \
        for (; i + LANES <= n; i += LANES) vstore(acc + i, vfma(va, LOAD(x + i), vload_f32(acc + i))); \
        for (; i < n; i++) acc[i] += a * SCALAR(x + i);                                        \
    }
DEFINE_AXPY(axpy_f32, float, vload_f32, load_f32)
DEFINE_AXPY(axpy_bf16, bf16, vload_bf16, load_bf16)

/* ---- decode attention: one query row per request over its paged context ----
 * q [R, Hq, D]; caches [NB, BS, Hkv, D]; tables [R, table_stride] block ids; ctx [R].
 * Query head hq reads KV head hq / G (G = Hq / Hkv). */

/* Scores of KV head h of request r: out[j * lpad + p] = scale * q[h*G + j] . K[p], p < n. */
#define DEFINE_SCORES_RH(NAME, T, DOT)                                                         \
    INLINE void NAME(const T *q, const T *k_cache, const int64_t *table, int64_t n,            \
                     int64_t hkv, int64_t h, int64_t d, int64_t bs, int64_t g, float scale,    \
                     float *out, int64_t lpad) {                                               \
        for (int64_t start = 0; start < n; start += bs) {                                      \
            const T *row = k_cache + (table[start / bs] * bs * hkv + h) * d;                   \
            const int64_t stop = start + bs < n ? start + bs : n;                              \
            for (int64_t p = start; p < stop; p++, row += hkv * d)                             \
                for (int64_t j = 0; j < g; j++) out[j * lpad + p] = scale * DOT(q + j * d, row, d); \
        }                                                                                      \
    }

INLINE float dot_f32_same(const float *a, const float *b, int64_t n) { return dot_f32_f32(a, b, n); }
#if defined(HAVE_DOT_BF16)
INLINE float dot_bf16_same(const bf16 *a, const bf16 *b, int64_t n) { return dot_bf16_bf16(a, b, n); }
#else
INLINE float dot_bf16_same(const bf16 *a, const bf16 *b, int64_t n) {
    float qa[MAX_HEAD_DIM];
    for (int64_t i = 0; i < n; i++) qa[i] = bf16_to_f32(a[i]);
    return dot_f32_bf16(qa, b, n);
}
#endif
DEFINE_SCORES_RH(scores_rh_f32, float, dot_f32_same)
DEFINE_SCORES_RH(scores_rh_bf16, bf16, dot_bf16_same)

/* Weighted values of KV head h of request r: out[h*G + j] = sum_p probs[j * lpad + p] V[p]. */
#define DEFINE_VALUES_RH(NAME, T, AXPY, PUT)                                                   \
    INLINE void NAME(const float *probs, const T *v_cache, const int64_t *table, int64_t n,    \
                     int64_t hkv, int64_t h, int64_t d, int64_t bs, int64_t g, int64_t lpad,   \
                     T *out) {                                                                 \
        float acc[MAX_GROUP * MAX_HEAD_DIM];                                                   \
        memset(acc, 0, (size_t)(g * d) * sizeof(float));                                       \
        for (int64_t start = 0; start < n; start += bs) {                                      \
            const T *row = v_cache + (table[start / bs] * bs * hkv + h) * d;                   \
            const int64_t stop = start + bs < n ? start + bs : n;                              \
            for (int64_t p = start; p < stop; p++, row += hkv * d)                             \
                for (int64_t j = 0; j < g; j++) AXPY(acc + j * d, probs[j * lpad + p], row, d); \
        }                                                                                      \
        for (int64_t i = 0; i < g * d; i++) PUT(out + i, acc[i]);                              \
    }
DEFINE_VALUES_RH(values_rh_f32, float, axpy_f32, put_f32)
DEFINE_VALUES_RH(values_rh_bf16, bf16, axpy_bf16, put_bf16)

/* The same, 16 keys at a time (AVX-512; a block size a multiple of 16, so 16 keys from a
 * multiple of 16 share a block): each key's products stay a vector of partial sums, and one
 * transposing reduction turns 16 of them into 16 scores, instead of one reduction per key.
 * Keys past n in the last 16 are computed from their (allocated) rows and not stored. */
#if defined(__AVX512F__)
INLINE __m512 hsum16(const __m512 *a) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                         _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

INLINE __m512 partial_f32(const float *q, const float *k, int64_t d) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(k + c), acc);
    return acc;
}
#if defined(HAVE_DOT_BF16)
typedef bf16 qbf16_t;
#define SCORES16_bf16_STEP 32
INLINE void prep_q_bf16(qbf16_t *dst, const bf16 *q, int64_t n) { memcpy(dst, q, (size_t)n * sizeof(bf16)); }
INLINE __m512 partial_bf16(const qbf16_t *q, const bf16 *k, int64_t d) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + c), (__m512bh)_mm512_loadu_si512(k + c));
    return acc;
}
#else
typedef float qbf16_t;
#define SCORES16_bf16_STEP 16
INLINE void prep_q_bf16(qbf16_t *dst, const bf16 *q, int64_t n) { widen_row_bf16(dst, q, n); }
INLINE __m512 partial_bf16(const qbf16_t *q, const bf16 *k, int64_t d) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), vload_bf16(k + c), acc);
    return acc;
}
#endif
INLINE void prep_q_f32(float *dst, const float *q, int64_t n) { memcpy(dst, q, (size_t)n * sizeof(float)); }
#define SCORES16_f32_STEP 16

#define DEFINE_SCORES16(SUFFIX, T, QT)                                                         \
    INLINE int scores16_ok_##SUFFIX(int64_t d, int64_t bs) {                                   \
        return bs % 16 == 0 && d % SCORES16_##SUFFIX##_STEP == 0;                              \
    }                                                                                          \
    INLINE void scores16_##SUFFIX(const T *q, const T *k_cache, const int64_t *table,          \
                                  int64_t n, int64_t hkv, int64_t h, int64_t d, int64_t bs,    \
                                  int64_t g, float scale, float *out, int64_t lpad) {          \
        QT qp[MAX_GROUP * MAX_HEAD_DIM];                                                       \
        prep_q_##SUFFIX(qp, q, g * d);                                                         \
        const __m512 vs = _mm512_set1_ps(scale);                                               \
        for (int64_t start = 0; start < n; start += 16) {                                      \
            const T *row = k_cache + ((table[start / bs] * bs + start % bs) * hkv + h) * d;    \
            const __mmask16 valid = n - start >= 16 ? 0xffff : (__mmask16)((1u << (n - start)) - 1); \
            for (int64_t j = 0; j < g; j++) {                                                  \
                __m512 acc[16];                                                                \
                for (int i = 0; i < 16; i++) acc[i] = partial_##SUFFIX(qp + j * d, row + i * hkv * d, d); \
                _mm512_mask_storeu_ps(out + j * lpad + start, valid, _mm512_mul_ps(hsum16(acc), vs)); \
            }                                                                                  \
        }                                                                                      \
    }
DEFINE_SCORES16(f32, float, float)
DEFINE_SCORES16(bf16, bf16, qbf16_t)
#endif

/* Weighted values with the accumulators in registers (d a whole number of lanes, at most 8
 * vectors, G <= 4): each V row is read and widened once for the G heads. */
#define DEFINE_VALUES_VEC(SUFFIX, T, VLOAD, VPUT)                                              \
    INLINE int values_vec_ok_##SUFFIX(int64_t d, int64_t g) {                                  \
        return d % LANES == 0 && d / LANES <= 8 && g <= 4;                                     \
    }                                                                                          \
    INLINE void values_vec_##SUFFIX(const float *probs, const T *v_cache, const int64_t *table, \
                                    int64_t n, int64_t hkv, int64_t h, int64_t d, int64_t bs,  \
                                    int64_t g, int64_t lpad, T *out) {                         \
        vf acc[4][8];                                                                          \
        const int64_t dv = d / LANES;                                                          \
        for (int64_t j = 0; j < g; j++)                                                        \
            for (int64_t c = 0; c < dv; c++) acc[j][c] = vzero();                              \
        for (int64_t start = 0; start < n; start += bs) {                                      \
            const T *row = v_cache + (table[start / bs] * bs * hkv + h) * d;                   \
            const int64_t stop = start + bs < n ? start + bs : n;                              \
            for (int64_t p = start; p < stop; p++, row += hkv * d) {                           \
                vf v[8];                                                                       \
                for (int64_t c = 0; c < dv; c++) v[c] = VLOAD(row + c * LANES);                \
                for (int64_t j = 0; j < g; j++) {                                              \
                    const vf pj = vset1(probs[j * lpad + p]);                                  \
                    for (int64_t c = 0; c < dv; c++) acc[j][c] = vfma(pj, v[c], acc[j][c]);    \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int64_t j = 0; j < g; j++)                                                        \
            for (int64_t c = 0; c < dv; c++) VPUT(out + j * d + c * LANES, acc[j][c]);         \
    }
DEFINE_VALUES_VEC(f32, float, vload_f32, vstore)
DEFINE_VALUES_VEC(bf16, bf16, vload_bf16, vstore_bf16)

/* The (d, g) of common models get their own compiled copy (constants unroll the loops and
 * keep the accumulators in registers); others take the general one. */
#define DISPATCH_DG(CALL)                                                                      \
    if (d == 64 && g == 3) { CALL(64, 3); }                                                    \
    else if (d == 64 && g == 4) { CALL(64, 4); }                                               \
    else if (d == 128 && g == 4) { CALL(128, 4); }                                             \
    else if (d == 128 && g == 8) { CALL(128, 8); }                                             \
    else { CALL(d, g); }

/* The whole attention of one decode row per request: scores (scratch [R, Hq, lpad], lpad
 * >= every ctx), their softmax, the weighted values into out [R, Hq, D]. */
#define DEFINE_DECODE(SUFFIX, T)                                                               \
    void fak_decode_attention_##SUFFIX(const T *q, const T *k_cache, const T *v_cache,         \
                                       const int64_t *tables, int64_t table_stride,            \
                                       const int64_t *ctx, int64_t num_reqs, int64_t hq,       \
                                       int64_t hkv, int64_t d, int64_t bs, int64_t lpad,       \
                                       float scale, float *scratch, T *out, int nthreads) {    \
        const int64_t g = hq / hkv;                                                            \
        _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)") \
        for (int64_t r = 0; r < num_reqs; r++)                                                 \
            for (int64_t h = 0; h < hkv; h++) {                                                \
                const T *qh = q + (r * hq + h * g) * d;                                        \
                float *pr = scratch + (r * hq + h * g) * lpad;                                 \
                T *oh = out + (r * hq + h * g) * d;                                            \
                const int64_t *table = tables + r * table_stride;                              \
                DISPATCH_DG(SCORES_CALL_##SUFFIX)                                              \
                for (int64_t j = 0; j < g; j++) softmax_row(pr + j * lpad, ctx[r]);            \
                DISPATCH_DG(VALUES_CALL_##SUFFIX)                                              \
            }                                                                                  \
    }

#if defined(__AVX512F__)
#define SCORES_WITH(SUFFIX, D, G)                                                              \
    if (scores16_ok_##SUFFIX(D, bs))                                                           \
        scores16_##SUFFIX(qh, k_cache, table, ctx[r], hkv, h, D, bs, G, scale, pr, lpad);      \
    else                                                                                       \
        scores_rh_##SUFFIX(qh, k_cache, table, ctx[r], hkv, h, D, bs, G, scale, pr, lpad)
#else
#define SCORES_WITH(SUFFIX, D, G)                                                              \
    scores_rh_##SUFFIX(qh, k_cache, table, ctx[r], hkv, h, D, bs, G, scale, pr, lpad)
#endif
#define VALUES_WITH(SUFFIX, D, G)                                                              \
    if (values_vec_ok_##SUFFIX(D, G))                                                          \
        values_vec_##SUFFIX(pr, v_cache, table, ctx[r], hkv, h, D, bs, G, lpad, oh);           \
    else                                                                                       \
        values_rh_##SUFFIX(pr, v_cache, table, ctx[r], hkv, h, D, bs, G, lpad, oh)
#define SCORES_CALL_f32(D, G) SCORES_WITH(f32, D, G)
#define SCORES_CALL_bf16(D, G) SCORES_WITH(bf16, D, G)
#define VALUES_CALL_f32(D, G) VALUES_WITH(f32, D, G)
#define VALUES_CALL_bf16(D, G) VALUES_WITH(bf16, D, G)
DEFINE_DECODE(f32, float)
DEFINE_DECODE(bf16, bf16)

/* ---- prefill attention: a chunk of n new tokens of one request over its paged context ----
 * The chunk's tokens are the context's last n positions (ctx - n .. ctx - 1); token i attends
 * to keys 0 .. ctx - n + i (causal). K is widened once per KV head into float32 tiles of
 * LANES keys, transposed ([tile][D][LANES]), so a tile's scores for a query row are D FMAs
 * with no horizontal sums; V is widened once into float32 rows. Query rows go through in
 * blocks: the G heads of up to PREFILL_POSITIONS positions share each K tile they read. */

#define PREFILL_POSITIONS 4
#define PREFILL_ROWS (MAX_GROUP * PREFILL_POSITIONS)

/* acc[m] over one tile for m < M rows of qf [M][d]: scores = sum_d qf[m][d] * kt[d][lane]. */
INLINE void qk_tile(const float *qf, const float *kt, int64_t d, int64_t M, vf *acc) {
    for (int64_t m = 0; m < M; m++) acc[m] = vzero();
    for (int64_t e = 0; e < d; e++) {
        const vf k = vload_f32(kt + e * LANES);
        for (int64_t m = 0; m < M; m++) acc[m] = vfma(vset1(qf[m * d + e]), k, acc[m]);
    }
}

/* Scores of M query rows over `tiles` tiles, stored [M][tiles * LANES] scaled. The (d, M) of
 * common models get their own compiled copy, so the accumulators stay in registers. */
INLINE void qk_rows(const float *qf, const float *kt, int64_t d, int64_t M, int64_t tiles,
                    float scale, float *scores, int64_t stride) {
    vf acc[PREFILL_ROWS];
    const vf vs = vset1(scale);
#define QK_CASE(D, MM)                                                                         \
    for (int64_t t = 0; t < tiles; t++) {                                                      \
        qk_tile(qf, kt + t * (D) * LANES, D, MM, acc);                                          \
        for (int64_t m = 0; m < (MM); m++) vstore(scores + m * stride + t * LANES, vmul(acc[m], vs)); \
    }
    if (d == 64 && M == 12) { QK_CASE(64, 12) }
    else if (d == 64 && M == 16) { QK_CASE(64, 16) }
    else if (d == 128 && M == 16) { QK_CASE(128, 16) }
    else { QK_CASE(d, M) }
#undef QK_CASE
}

/* out[m][0..d) = sum_{k < len} p[m][k] * v[k][0..d) for m < rows (p rows `pstride` apart,
 * zero past each row's own length; v float32 rows of d). With d a whole number of lanes, a
 * tile of rows keeps its accumulators in registers and reads each V row once for all. */
#if LANES == 16
#define VREGS 32
#elif LANES == 8
#define VREGS 16
#else
#define VREGS 8
#endif
#define PV_MAX_ROWS 8
#define PV_MAX_CHUNKS (MAX_HEAD_DIM / LANES)

INLINE void pv_tiles(const float *p, int64_t pstride, const float *v, int64_t len, int64_t d,
                     int64_t rows, float *out) {
    const int64_t dv = d / LANES;
    int64_t mb = (VREGS - dv - 2) / dv;
    mb = mb < 1 ? 1 : mb > PV_MAX_ROWS ? PV_MAX_ROWS : mb;
    for (int64_t m0 = 0; m0 < rows; m0 += mb) {
        const int64_t mm = rows - m0 < mb ? rows - m0 : mb;
        vf acc[PV_MAX_ROWS][PV_MAX_CHUNKS];
        for (int64_t m = 0; m < mb; m++)
            for (int64_t c = 0; c < dv; c++) acc[m][c] = vzero();
        for (int64_t k = 0; k < len; k++) {
            vf vk[PV_MAX_CHUNKS];
            for (int64_t c = 0; c < dv; c++) vk[c] = vload_f32(v + k * d + c * LANES);
            for (int64_t m = 0; m < mb; m++) {
                if (m >= mm) break;
                const vf pm = vset1(p[(m0 + m) * pstride + k]);
                for (int64_t c = 0; c < dv; c++) acc[m][c] = vfma(pm, vk[c], acc[m][c]);
            }
        }
        for (int64_t m = 0; m < mm; m++)
            for (int64_t c = 0; c < dv; c++) vstore(out + (m0 + m) * d + c * LANES, acc[m][c]);
    }
}

INLINE void pv_rows(const float *p, int64_t pstride, const float *v, int64_t len, int64_t d,
                    int64_t rows, float *out) {
    if (d == 64) pv_tiles(p, pstride, v, len, 64, rows, out);
    else if (d == 128) pv_tiles(p, pstride, v, len, 128, rows, out);
    else if (d % LANES == 0) pv_tiles(p, pstride, v, len, d, rows, out);
    else
        for (int64_t m = 0; m < rows; m++) {
            float *o = out + m * d;
            memset(o, 0, (size_t)d * sizeof(float));
            for (int64_t k = 0; k < len; k++) axpy_f32(o, p[m * pstride + k], v + k * d, d);
        }
}

/* How a path holds K and q for the scores. Widened: K as float32 tiles [D][LANES] per tile
 * of keys, q rows widened to float32, scores by FMA (qk_rows). Pairs (bf16 on AVX512-BF16):
 * K as tiles [D / 2][16] of adjacent-dimension bf16 pairs, q rows as they are, scores by the
 * dot-product instruction, two products per lane (qk_pairs); half the instructions. */
#define KT_WIDE_PER_KEY(d) (d)
#define DEFINE_WIDE_PATH(SUFFIX, T, LOAD)                                                      \
    INLINE void pack_key_##SUFFIX(float *tile, const T *row, int64_t lane, int64_t d) {        \
        for (int64_t e = 0; e < d; e++) tile[e * LANES + lane] = LOAD(row + e);                \
    }                                                                                          \
    INLINE void qk_##SUFFIX(const T *q, int64_t q_stride, int64_t rows, int64_t g,            \
                            const float *kt, int64_t d, int64_t tiles, float scale,           \
                            float *scores, int64_t stride) {                                   \
        float qf[PREFILL_ROWS * MAX_HEAD_DIM];                                                 \
        for (int64_t i = 0; i < rows; i++) widen_row_##SUFFIX(qf + i * g * d, q + i * q_stride, g * d); \
        qk_rows(qf, kt, d, rows * g, tiles, scale, scores, stride);                            \
    }
DEFINE_WIDE_PATH(f32, float, load_f32)

#if defined(HAVE_DOT_BF16)
#define KT_BF16 uint32_t
#define KT_BF16_PER_KEY(d) ((d) / 2)
INLINE void pack_key_bf16(uint32_t *tile, const bf16 *row, int64_t lane, int64_t d) {
    for (int64_t e = 0; e < d / 2; e++) {
        uint32_t pair;
        memcpy(&pair, row + 2 * e, sizeof pair);
        tile[e * 16 + lane] = pair;
    }
}

INLINE void qk_pair_tile(const uint32_t *qp, const uint32_t *kt, int64_t pairs, int64_t M,
                         __m512 *acc) {
    for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t e = 0; e < pairs; e++) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(kt + e * 16);
        for (int64_t m = 0; m < M; m++)
            acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32((int)qp[m * pairs + e]), k);
    }
}

INLINE void qk_bf16(const bf16 *q, int64_t q_stride, int64_t rows, int64_t g, const uint32_t *kt,
                    int64_t d, int64_t tiles, float scale, float *scores, int64_t stride) {
    uint32_t qp[PREFILL_ROWS * MAX_HEAD_DIM / 2];
    for (int64_t i = 0; i < rows; i++) memcpy(qp + i * g * d / 2, q + i * q_stride, (size_t)(g * d) * sizeof(bf16));
    const int64_t M = rows * g, pairs = d / 2;
    __m512 acc[PREFILL_ROWS];
    const __m512 vs = _mm512_set1_ps(scale);
#define QKP_CASE(P, MM)                                                                        \
    for (int64_t t = 0; t < tiles; t++) {                                                      \
        qk_pair_tile(qp, kt + t * (P) * 16, P, MM, acc);                                        \
        for (int64_t m = 0; m < (MM); m++) _mm512_storeu_ps(scores + m * stride + t * 16, _mm512_mul_ps(acc[m], vs)); \
    }
    if (pairs == 32 && M == 12) { QKP_CASE(32, 12) }
    else if (pairs == 32 && M == 16) { QKP_CASE(32, 16) }
    else if (pairs == 64 && M == 16) { QKP_CASE(64, 16) }
    else { QKP_CASE(pairs, M) }
#undef QKP_CASE
}
#else
#define KT_BF16 float
#define KT_BF16_PER_KEY(d) (d)
DEFINE_WIDE_PATH(bf16, bf16, load_bf16)
#endif

#define DEFINE_PREFILL(SUFFIX, T, KT, PER_KEY)                                                 \
    int fak_prefill_attention_##SUFFIX(const T *q, int64_t q_stride, const T *k_cache,         \
                                       const T *v_cache, const int64_t *table, int64_t n,      \
                                       int64_t ctx, int64_t hq, int64_t hkv, int64_t d,        \
                                       int64_t bs, float scale, T *out, int nthreads) {        \
        const int64_t g = hq / hkv, tiles = (ctx + LANES - 1) / LANES, first = ctx - n;        \
        const int64_t blocks = (n + PREFILL_POSITIONS - 1) / PREFILL_POSITIONS;                \
        const int64_t tile_size = PER_KEY(d) * LANES, head_size = tiles * tile_size;           \
        KT *kt = calloc((size_t)(hkv * head_size), sizeof(KT));                                \
        float *vw = malloc((size_t)(hkv * ctx * d) * sizeof(float));                           \
        if (!kt || !vw) { free(kt); free(vw); return -1; }                                     \
        _Pragma("omp parallel for collapse(2) schedule(static) num_threads(nthreads) if (nthreads > 1)") \
        for (int64_t h = 0; h < hkv; h++)                                                      \
            for (int64_t k = 0; k < ctx; k++) {                                                \
                const int64_t slot = (table[k / bs] * bs + k % bs) * hkv + h;                  \
                pack_key_##SUFFIX(kt + h * head_size + (k / LANES) * tile_size,                \
                                  k_cache + slot * d, k % LANES, d);                           \
                widen_row_##SUFFIX(vw + (h * ctx + k) * d, v_cache + slot * d, d);             \
            }                                                                                  \
        int failed = 0;                                                                        \
        _Pragma("omp parallel for collapse(2) schedule(dynamic) num_threads(nthreads) if (nthreads > 1)") \
        for (int64_t h = 0; h < hkv; h++)                                                      \
            for (int64_t b = 0; b < blocks; b++) {                                             \
                const int64_t i0 = b * PREFILL_POSITIONS;                                      \
                const int64_t rows = n - i0 < PREFILL_POSITIONS ? n - i0 : PREFILL_POSITIONS;  \
                const int64_t M = rows * g, last = first + i0 + rows - 1;                      \
                const int64_t stride = (last / LANES + 1) * LANES;                             \
                float *scores = malloc((size_t)(M * stride) * sizeof(float));                  \
                if (!scores) {                                                                 \
                    _Pragma("omp atomic write")                                                \
                    failed = 1;                                                                \
                    continue;                                                                  \
                }                                                                              \
                qk_##SUFFIX(q + i0 * q_stride + h * g * d, q_stride, rows, g,                  \
                            kt + h * head_size, d, last / LANES + 1, scale, scores, stride);   \
                for (int64_t i = 0; i < rows; i++)                                             \
                    for (int64_t j = 0; j < g; j++) {                                          \
                        float *pr = scores + (i * g + j) * stride;                             \
                        const int64_t len = first + i0 + i + 1;                                \
                        softmax_row(pr, len);                                                  \
                        memset(pr + len, 0, (size_t)(last + 1 - len) * sizeof(float));         \
                    }                                                                          \
                float o[PREFILL_ROWS * MAX_HEAD_DIM];                                          \
                pv_rows(scores, stride, vw + h * ctx * d, last + 1, d, M, o);                  \
                for (int64_t i = 0; i < rows; i++)                                             \
                    round_row_##SUFFIX(out + ((i0 + i) * hq + h * g) * d, o + i * g * d, g * d); \
                free(scores);                                                                  \
            }                                                                                  \
        free(kt);                                                                              \
        free(vw);                                                                              \
        return failed ? -1 : 0;                                                                \
    }

DEFINE_PREFILL(f32, float, float, KT_WIDE_PER_KEY)
DEFINE_PREFILL(bf16, bf16, KT_BF16, KT_BF16_PER_KEY)

/* ---- few-row linear: y[m, o] = x[m] . W[o], W [out, in], x [rows, in] ----
 * Four weight rows at a time, each read from memory once for all rows of x (at a few rows
 * a linear is bound by the weight bytes); y [rows, out] in W's dtype. Chunks of blocks are
 * handed out as threads free up (a thread that loses its core does not hold the rest). */

#define GEMV_BLOCK 4
#define DEFINE_GEMV(SUFFIX, T, XT, DOT, PUT)                                                   \
    int fak_gemv_##SUFFIX(const T *x, const T *w, int64_t rows, int64_t in, int64_t out,      \
                           T *y, int nthreads) {                                               \
        XT *xw = NULL;                                                                         \
        const XT *xs = as_dot_input(x, rows * in, &xw);                                        \
        if (!xs) return -1;                                                                    \
        const int64_t blocks = (out + GEMV_BLOCK - 1) / GEMV_BLOCK;                            \
        _Pragma("omp parallel for schedule(dynamic, 16) num_threads(nthreads) if (nthreads > 1)")   \
        for (int64_t b = 0; b < blocks; b++) {                                                 \
            const int64_t lo = b * GEMV_BLOCK;                                                 \
            const int64_t hi = lo + GEMV_BLOCK < out ? lo + GEMV_BLOCK : out;                  \
            for (int64_t m = 0; m < rows; m++)                                                 \
                for (int64_t o = lo; o < hi; o++) {                                            \
                    PUT(y + m * out + o, DOT(xs + m * in, w + o * in, in));                    \
                }                                                                              \
        }                                                                                      \
        free(xw);                                                                              \
        return 0;                                                                              \
    }

/* x as the dot product takes it: as it is, or (bf16 without AVX512-BF16) widened once into
 * *owned (NULL when that allocation fails: the call then returns -1). */
INLINE const float *as_dot_input_f32(const float *x, int64_t n, float **owned) {
    (void)n; (void)owned;
    return x;
}
#define as_dot_input as_dot_input_f32
DEFINE_GEMV(f32, float, float, dot_f32_f32, put_f32)
#undef as_dot_input
#if defined(HAVE_DOT_BF16)
INLINE const bf16 *as_dot_input_bf16(const bf16 *x, int64_t n, bf16 **owned) {
    (void)n; (void)owned;
    return x;
}
#define as_dot_input as_dot_input_bf16
DEFINE_GEMV(bf16, bf16, bf16, dot_bf16_bf16, put_bf16)
#else
INLINE const float *as_dot_input_bf16(const bf16 *x, int64_t n, float **owned) {
    *owned = malloc((size_t)n * sizeof(float));
    if (*owned) for (int64_t i = 0; i < n; i++) (*owned)[i] = bf16_to_f32(x[i]);
    return *owned;
}
#define as_dot_input as_dot_input_bf16
DEFINE_GEMV(bf16, bf16, float, dot_f32_bf16, put_bf16)
#endif
#undef as_dot_input

/* ---- the model's elementwise steps, fused: each reads and writes its rows once ---- */

INLINE vf vload_as_f32(const float *p) { return vload_f32(p); }
INLINE vf vload_as_bf16(const bf16 *p) { return vload_bf16(p); }
INLINE void vput_f32(float *p, vf a) { vstore(p, a); }
INLINE void vput_bf16(bf16 *p, vf a) { vstore_bf16(p, a); }
INLINE vf vsilu(vf x) { return vdiv(x, vadd(vset1(1.0f), vexp(vmul(x, vset1(-1.0f))))); }

#define DEFINE_ELEMENTWISE(SUFFIX, T, LOAD, PUT, VLOAD, VPUT)                                  \
    /* h[r] += delta[r] (rounded to T; skipped when delta is NULL), then                        \
     * out[r] = h[r] / sqrt(mean(h[r]^2) + eps) * w, in float32, rounded once. */              \
    void fak_add_rms_norm_##SUFFIX(T *h, const T *delta, const T *w, T *out, int64_t rows,     \
                                   int64_t n, float eps, int nthreads) {                       \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)")   \
        for (int64_t r = 0; r < rows; r++) {                                                   \
            T *hr = h + r * n;                                                                 \
            T *o = out + r * n;                                                                \
            const T *dr = delta ? delta + r * n : NULL;                                        \
            vf vss = vzero();                                                                  \
            int64_t i = 0;                                                                     \
            for (; i + LANES <= n; i += LANES) {                                               \
                if (dr) VPUT(hr + i, vadd(VLOAD(hr + i), VLOAD(dr + i)));                      \
                const vf v = VLOAD(hr + i);                                                    \
                vss = vfma(v, v, vss);                                                         \
            }                                                                                  \
            float ss = vsum(vss);                                                              \
            for (; i < n; i++) {                                                               \
                if (dr) PUT(hr + i, LOAD(hr + i) + LOAD(dr + i));                              \
                ss += LOAD(hr + i) * LOAD(hr + i);                                             \
            }                                                                                  \
            const float inv = 1.0f / sqrtf(ss / (float)n + eps);                               \
            const vf vinv = vset1(inv);                                                        \
            for (i = 0; i + LANES <= n; i += LANES)                                            \
                VPUT(o + i, vmul(vmul(VLOAD(hr + i), vinv), VLOAD(w + i)));                    \
            for (; i < n; i++) PUT(o + i, LOAD(hr + i) * inv * LOAD(w + i));                   \
        }                                                                                      \
    }                                                                                          \
    /* out[r] = silu(gate_up[r, :n]) * gate_up[r, n:], in float32, rounded once. */            \
    void fak_silu_mul_##SUFFIX(const T *gate_up, T *out, int64_t rows, int64_t n,              \
                               int nthreads) {                                                 \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)")   \
        for (int64_t r = 0; r < rows; r++) {                                                   \
            const T *g = gate_up + r * 2 * n;                                                  \
            T *o = out + r * n;                                                                \
            int64_t i = 0;                                                                     \
            for (; i + LANES <= n; i += LANES)                                                 \
                VPUT(o + i, vmul(vsilu(VLOAD(g + i)), VLOAD(g + n + i)));                      \
            for (; i < n; i++) {                                                               \
                const float x = LOAD(g + i);                                                   \
                PUT(o + i, x / (1.0f + expf(-x)) * LOAD(g + n + i));                           \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    /* Rotate-half RoPE in place on `heads` heads of each of `tokens` rows (row stride        \
     * `stride` elements, heads of d contiguous from each row's start): x = x * cos +          \
     * rotate_half(x) * sin, cos and sin the float32 tables [max_pos, d / 2] at each token's   \
     * position, in float32, rounded once. */                                                  \
    void fak_rope_##SUFFIX(T *x, const int64_t *positions, const float *cos, const float *sin, \
                           int64_t tokens, int64_t heads, int64_t d, int64_t stride,           \
                           int nthreads) {                                                     \
        const int64_t half = d / 2;                                                            \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)")   \
        for (int64_t t = 0; t < tokens; t++) {                                                 \
            const float *c = cos + positions[t] * half, *s = sin + positions[t] * half;        \
            for (int64_t h = 0; h < heads; h++) {                                              \
                T *a = x + t * stride + h * d, *b = a + half;                                  \
                int64_t i = 0;                                                                 \
                for (; i + LANES <= half; i += LANES) {                                        \
                    const vf va = VLOAD(a + i), vb = VLOAD(b + i);                             \
                    const vf vc = vload_f32(c + i), vs = vload_f32(s + i);                     \
                    VPUT(a + i, vfma(va, vc, vmul(vb, vmul(vs, vset1(-1.0f)))));               \
                    VPUT(b + i, vfma(vb, vc, vmul(va, vs)));                                   \
                }                                                                              \
                for (; i < half; i++) {                                                        \
                    const float va = LOAD(a + i), vb = LOAD(b + i);                            \
                    PUT(a + i, va * c[i] - vb * s[i]);                                         \
                    PUT(b + i, vb * c[i] + va * s[i]);                                         \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }

DEFINE_ELEMENTWISE(f32, float, load_f32, put_f32, vload_as_f32, vput_f32)
DEFINE_ELEMENTWISE(bf16, bf16, load_bf16, put_bf16, vload_as_bf16, vput_bf16)

/* ---- greedy sampling: the first index of each row's largest value ---- */

#define DEFINE_ARGMAX(SUFFIX, T, LOAD, VLOAD)                                                  \
    /* index[r] = the first column holding row r's maximum; -1 where the row holds a NaN or  \
     * an infinity (the caller then takes its own path). x [rows, n], n >= 1. */               \
    void fak_argmax_##SUFFIX(const T *x, int64_t rows, int64_t n, int64_t *index,             \
                             int nthreads) {                                                   \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)")   \
        for (int64_t r = 0; r < rows; r++) {                                                   \
            const T *xr = x + r * n;                                                           \
            vf vm = vset1(-INFINITY), vnan = vzero();                                          \
            int64_t i = 0;                                                                     \
            for (; i + LANES <= n; i += LANES) {                                               \
                const vf v = VLOAD(xr + i);                                                    \
                vm = vmax(vm, v);                                                              \
                vnan = vadd(vnan, vsub(v, v)); /* 0, or NaN once a lane was NaN or inf */           \
            }                                                                                  \
            float m = vhmax(vm), nan = vsum(vnan);                                             \
            for (; i < n; i++) {                                                               \
                const float v = LOAD(xr + i);                                                  \
                m = v > m ? v : m;                                                             \
                nan += v - v;                                                                  \
            }                                                                                  \
            int64_t at = -1;                                                                   \
            if (nan == 0.0f)                                                                   \
                for (i = 0; i < n; i++)                                                        \
                    if (LOAD(xr + i) == m) { at = i; break; }                                  \
            index[r] = at;                                                                     \
        }                                                                                      \
    }

DEFINE_ARGMAX(f32, float, load_f32, vload_f32)
DEFINE_ARGMAX(bf16, bf16, load_bf16, vload_bf16)

/* ---- GEMM on packed weights: y [M, N] = x [M, K] . W^T, W [N, K] (bf16, AVX512-BF16) ----
 * W is packed once into panels of GEMM_NR output columns, each [K / 2][GEMM_NR] pairs of
 * adjacent-K bf16 (K padded to even, N to whole panels, with zeros), so one k-pair of a panel
 * is GEMM_NV vectors. A tile of up to GEMM_MR rows of x keeps its GEMM_NV x GEMM_MR
 * accumulators in registers; each k-pair costs GEMM_NV loads of W, a broadcast of each row's
 * pair and GEMM_NV dot products per row (two products per lane). Panels go outermost, so a
 * panel stays in cache while every row tile passes over it; at one row this reads W once,
 * as a GEMV must. */

/* Measured (bf16, 1 thread, 2-core AVX512-BF16 EPYC, SmolLM2's shapes at 512 rows): panels
 * of 2 vectors with 14-row tiles 182-196 GFLOP/s, of 4 vectors with 6-row tiles 136-175;
 * a 2-vector panel row of K = 576 (37 KB) stays in L1. */
#define GEMM_NV 2
#define GEMM_MR 14
#define GEMM_NR (16 * GEMM_NV)

int fak_gemm_panel_columns(void) {
#if defined(HAVE_DOT_BF16)
    return GEMM_NR;
#else
    return 0;
#endif
}

#if defined(HAVE_DOT_BF16)
/* packed [panels][K/2][GEMM_NR] uint32 from w [N, K] bf16. */
void fak_gemm_pack_bf16(const bf16 *w, int64_t n, int64_t k, uint32_t *packed) {
    const int64_t pairs = (k + 1) / 2, panels = (n + GEMM_NR - 1) / GEMM_NR;
    memset(packed, 0, (size_t)(panels * pairs * GEMM_NR) * sizeof(uint32_t));
    for (int64_t o = 0; o < n; o++) {
        uint32_t *col = packed + (o / GEMM_NR) * pairs * GEMM_NR + o % GEMM_NR;
        const bf16 *row = w + o * k;
        for (int64_t e = 0; e < pairs; e++) {
            const uint32_t lo = row[2 * e], hi = 2 * e + 1 < k ? row[2 * e + 1] : 0;
            col[e * GEMM_NR] = lo | hi << 16;
        }
    }
}

/* Rows [0, MR) of x against one panel: k-pairs [0, full) read as pairs, an odd K's last value
 * alone (its partner 0). MR is a constant in every call, so the loops unroll. */
INLINE void gemm_tile(const bf16 *x, int64_t k, const uint32_t *panel, int64_t pairs,
                      const int64_t MR, int64_t cols, bf16 *y, int64_t ldy) {
    __m512 acc[GEMM_MR][GEMM_NV];
    for (int64_t m = 0; m < MR; m++)
        for (int c = 0; c < GEMM_NV; c++) acc[m][c] = _mm512_setzero_ps();
    const int64_t full = k / 2;
    for (int64_t e = 0; e < pairs; e++) {
        __m512bh b[GEMM_NV];
        for (int c = 0; c < GEMM_NV; c++)
            b[c] = (__m512bh)_mm512_loadu_si512(panel + e * GEMM_NR + c * 16);
        for (int64_t m = 0; m < MR; m++) {
            uint32_t pair;
            if (e < full) memcpy(&pair, x + m * k + 2 * e, sizeof pair);
            else pair = x[m * k + 2 * e];
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int c = 0; c < GEMM_NV; c++) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], a, b[c]);
        }
    }
    for (int64_t m = 0; m < MR; m++)
        for (int c = 0; c < GEMM_NV; c++) {
            const int64_t lo = c * 16;
            if (lo >= cols) break;
            if (cols - lo >= 16) vstore_bf16(y + m * ldy + lo, acc[m][c]);
            else {
                float tmp[16];
                _mm512_storeu_ps(tmp, acc[m][c]);
                for (int64_t i = 0; i < cols - lo; i++) y[m * ldy + lo + i] = f32_to_bf16(tmp[i]);
            }
        }
}

static void gemm_rows(const bf16 *x, int64_t k, const uint32_t *panel, int64_t pairs,
                      int64_t mr, int64_t cols, bf16 *y, int64_t ldy) {
#define GEMM_ROWS_CASE(R) case R: gemm_tile(x, k, panel, pairs, (R) < GEMM_MR ? (R) : GEMM_MR, cols, y, ldy); break;
    switch (mr) {
    GEMM_ROWS_CASE(14) GEMM_ROWS_CASE(13) GEMM_ROWS_CASE(12) GEMM_ROWS_CASE(11)
    GEMM_ROWS_CASE(10) GEMM_ROWS_CASE(9) GEMM_ROWS_CASE(8) GEMM_ROWS_CASE(7)
    GEMM_ROWS_CASE(6) GEMM_ROWS_CASE(5) GEMM_ROWS_CASE(4) GEMM_ROWS_CASE(3)
    GEMM_ROWS_CASE(2)
    default: gemm_tile(x, k, panel, pairs, 1, cols, y, ldy); break;
    }
#undef GEMM_ROWS_CASE
}

void fak_gemm_bf16(const bf16 *x, int64_t m, int64_t k, const uint32_t *packed, int64_t n,
                   bf16 *y, int nthreads) {
    const int64_t pairs = (k + 1) / 2, panels = (n + GEMM_NR - 1) / GEMM_NR;
    /* dynamic: a thread that gets no core for a while (another process on the machine)
     * leaves its panels to the others instead of holding the whole GEMM back */
    _Pragma("omp parallel for schedule(dynamic) num_threads(nthreads) if (nthreads > 1)")
    for (int64_t p = 0; p < panels; p++) {
        const int64_t cols = n - p * GEMM_NR < GEMM_NR ? n - p * GEMM_NR : GEMM_NR;
        for (int64_t m0 = 0; m0 < m; m0 += GEMM_MR)
            gemm_rows(x + m0 * k, k, packed + p * pairs * GEMM_NR, pairs,
                      m - m0 < GEMM_MR ? m - m0 : GEMM_MR, cols, y + m0 * n + p * GEMM_NR, n);
    }
}
#endif

int fak_kernels_abi(void) { return 1; }
