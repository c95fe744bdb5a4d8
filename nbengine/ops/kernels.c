/*
 * nbengine's native CPU kernels (x86-64 with AVX-512 BF16), called from Python through
 * ctypes by nbengine/ops/native.py; nbengine/ops/native_build.py compiles this file on
 * first use.
 *
 * Conventions: every tensor is contiguous and row-major; bf16 values are passed as
 * uint16_t; arithmetic is float32 and results are rounded to bf16 to nearest-even, as
 * torch rounds. Each kernel takes the thread count to use (OpenMP; the library shares the
 * libgomp that torch loaded, so both use one thread pool).
 */
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* ---- linear: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) ---------------------------------
 *
 * W is prepacked ("VNNI" layout) as [ceil(N/64), K/2, 64, 2]: for every tile of 64 output
 * features, the pairs (W[n, 2p], W[n, 2p+1]) of all 64 features for one p lie in 256
 * contiguous bytes, tile after tile. One _mm512_dpbf16_ps then multiplies a broadcast pair
 * of x by 16 features' pairs and accumulates 16 outputs (an outer product: no horizontal
 * sums), and the kernel reads the weights front to back as one sequential stream, which
 * is what a decode step (M = 1, memory bound) needs. Rows of x are taken four at a time so
 * that every weight load feeds four products, which makes large M compute bound at close
 * to the machine's peak. N is padded to 64 with zero features; K must be even.
 */
#define NB_TILE 64
/* Fewer than four rows (decode) read each weight once: the kernels then prefetch the
 * weight stream this far ahead of their loads. The hardware prefetcher alone left one
 * core at about 70% of its read bandwidth here; measured 2026-12-01 on 30 layers of the
 * bench model's shape at one row, interleaved A/B: bf16 13.6 -> 10.0 ms on two threads
 * (1, 2, 4 and 8 KiB ahead: 11.9, 10.3, 10.0, 9.8). */
#define NB_PREFETCH_BYTES 4096
/* Those prefetches of weight streams fill the L2, not the L1: an L1 prefetch holds one
 * of the core's few line-fill buffers until its line comes from memory, which caps the
 * lines in flight, while an L2 prefetch queues at the L2 (more of them) and the loads
 * then hit the L2. Measured 2026-12-03 on the Intel host, 1-row products over 0.4-0.8 GB
 * of 16384x2048 weights (best of 3, 4 interleaved rounds), GB/s read, T0 -> T1: bf16
 * 11.8 -> 12.5 (one thread), 23.8 -> 25.4 (two); int8 10.9 -> 13.2, 21.3 -> 25.2; int4
 * 10.8 -> 12.2, 20.1 -> 22.9 (docs/benchmarks.md, "Prefetching weights into the L2"). */
#define NB_STREAM_HINT _MM_HINT_T1

static inline void nb_store16(void *y, int64_t off, int64_t nvalid, __m512 v,
                              const uint16_t *bias, int out_f32) {
    if (nvalid <= 0) return;
    const __mmask16 mk = nvalid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nvalid) - 1);
    if (bias) {
        __m512i b32 = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, bias));
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(b32, 16)));
    }
    if (out_f32)
        _mm512_mask_storeu_ps((float *)y + off, mk, v);
    else
        _mm256_mask_storeu_epi16((uint16_t *)y + off, mk, (__m256i)_mm512_cvtneps_pbh(v));
}

/* Output tile t (64 features) for input rows 4 mt .. 4 mt + 3; `wt` is that tile's packed
 * weights ([K/2, 64, 2]: inside a whole packed matrix, or a tile dequantized on the fly). */
static void nb_linear_tile(const uint16_t *x, const uint16_t *wt, const uint16_t *bias,
                           void *y, int64_t M, int64_t N, int64_t K, int out_f32, int64_t t,
                           int64_t mt) {
    const int64_t pairs = K / 2;
    const int64_t n0 = t * NB_TILE, m0 = mt * 4;
    const int64_t rows = M - m0 < 4 ? M - m0 : 4;
    const uint16_t *bt = bias ? bias + n0 : 0;
    if (rows == 4) {
        /* Each row's sums run in exactly the order of the one-row path below (even and
         * odd pairs in two chains, added at the end), so a row's result never depends on
         * which rows share its tile: a request's greedy tokens are the same alone, in a
         * batch, or with speculative drafts beside it (docs/speculative-decoding.md). Two
         * halves of 32 features keep the 16 accumulators in registers. */
        const uint32_t *xp[4];
        for (int i = 0; i < 4; i++) xp[i] = (const uint32_t *)(x + (m0 + i) * K);
        for (int jo = 0; jo < 4; jo += 2) {
            __m512 acc[4][2][2];
            for (int i = 0; i < 4; i++)
                for (int h = 0; h < 2; h++)
                    for (int j = 0; j < 2; j++) acc[i][h][j] = _mm512_setzero_ps();
            int64_t p = 0;
            for (; p + 2 <= pairs; p += 2) {
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const uint16_t *wp = wt + (p + h) * NB_TILE * 2 + 32 * jo;
                    const __m512bh w0 = (__m512bh)_mm512_load_si512(wp);
                    const __m512bh w1 = (__m512bh)_mm512_load_si512(wp + 32);
#pragma GCC unroll 4
                    for (int i = 0; i < 4; i++) {
                        const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[i][p + h]);
                        acc[i][h][0] = _mm512_dpbf16_ps(acc[i][h][0], w0, xb);
                        acc[i][h][1] = _mm512_dpbf16_ps(acc[i][h][1], w1, xb);
                    }
                }
            }
            for (; p < pairs; p++) {
                const uint16_t *wp = wt + p * NB_TILE * 2 + 32 * jo;
                const __m512bh w0 = (__m512bh)_mm512_load_si512(wp);
                const __m512bh w1 = (__m512bh)_mm512_load_si512(wp + 32);
                for (int i = 0; i < 4; i++) {
                    const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[i][p]);
                    acc[i][0][0] = _mm512_dpbf16_ps(acc[i][0][0], w0, xb);
                    acc[i][0][1] = _mm512_dpbf16_ps(acc[i][0][1], w1, xb);
                }
            }
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 2; j++) {
                    const int64_t f = 16 * (jo + j);
                    nb_store16(y, (m0 + i) * N + n0 + f, N - n0 - f,
                               _mm512_add_ps(acc[i][0][j], acc[i][1][j]), bt ? bt + f : 0,
                               out_f32);
                }
        }
    } else {
        /* One row at a time; even and odd pairs accumulate separately so that two
         * independent chains hide the latency of the dot-product instruction. */
        for (int64_t i = 0; i < rows; i++) {
            const uint32_t *xr = (const uint32_t *)(x + (m0 + i) * K);
            __m512 acc[2][4];
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 4; j++) acc[h][j] = _mm512_setzero_ps();
            int64_t p = 0;
            for (; p + 2 <= pairs; p += 2) {
                if (i == 0) {  /* M < 4 streams the weights once: fetch ahead of the loads */
                    const char *ahead = (const char *)(wt + p * NB_TILE * 2) + NB_PREFETCH_BYTES;
                    for (int c = 0; c < 8; c++) _mm_prefetch(ahead + 64 * c, NB_STREAM_HINT);
                }
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const uint16_t *wp = wt + (p + h) * NB_TILE * 2;
                    const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xr[p + h]);
#pragma GCC unroll 4
                    for (int j = 0; j < 4; j++)
                        acc[h][j] = _mm512_dpbf16_ps(
                            acc[h][j], (__m512bh)_mm512_load_si512(wp + 32 * j), xb);
                }
            }
            for (; p < pairs; p++) {
                const uint16_t *wp = wt + p * NB_TILE * 2;
                const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xr[p]);
                for (int j = 0; j < 4; j++)
                    acc[0][j] = _mm512_dpbf16_ps(
                        acc[0][j], (__m512bh)_mm512_load_si512(wp + 32 * j), xb);
            }
            for (int j = 0; j < 4; j++)
                nb_store16(y, (m0 + i) * N + n0 + 16 * j, N - n0 - 16 * j,
                           _mm512_add_ps(acc[0][j], acc[1][j]), bt ? bt + 16 * j : 0,
                           out_f32);
        }
    }
}

/* Products of many rows on AMX tiles, reading the same packed weights (defined with the
 * quantized ones below, "bfloat16 weights on AMX tiles"). */
static int nb_bf16_amx_fits(int64_t M, int64_t K);
static void nb_linear_bf16_amx(const uint16_t *x, const uint16_t *w_packed, const uint16_t *bias,
                               void *y, int64_t M, int64_t N, int64_t K, int out_f32,
                               int nthreads);

/* amx: products of NB_BF16_AMX_ROWS rows or more run on AMX tiles where they are usable
 * (nb_bf16_amx_fits); else, and below that, the dpbf16 tiles above. */
void nb_linear_bf16(const uint16_t *x, const uint16_t *w_packed, const uint16_t *bias, void *y,
                    int64_t M, int64_t N, int64_t K, int out_f32, int nthreads, int amx) {
    if (amx && nb_bf16_amx_fits(M, K)) {
        nb_linear_bf16_amx(x, w_packed, bias, y, M, N, K, out_f32, nthreads);
        return;
    }
    const int64_t ntiles = (N + NB_TILE - 1) / NB_TILE, mtiles = (M + 3) / 4;
#pragma omp parallel for collapse(2) num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < ntiles; t++)
        for (int64_t mt = 0; mt < mtiles; mt++)
            nb_linear_tile(x, w_packed + t * (K / 2) * NB_TILE * 2, bias, y, M, N, K, out_f32, t, mt);
}

/* This thread's share (of `nt`) of the output tiles, for every row: used inside a
 * parallel region that the caller already runs (see nb_decoder_decode). */
static void nb_linear_share(const uint16_t *x, const uint16_t *w_packed, const uint16_t *bias,
                            void *y, int64_t M, int64_t N, int64_t K, int out_f32, int tid, int nt) {
    const int64_t ntiles = (N + NB_TILE - 1) / NB_TILE, mtiles = (M + 3) / 4;
    const int64_t begin = ntiles * tid / nt, end = ntiles * (tid + 1) / nt;
    for (int64_t t = begin; t < end; t++)
        for (int64_t mt = 0; mt < mtiles; mt++)
            nb_linear_tile(x, w_packed + t * (K / 2) * NB_TILE * 2, bias, y, M, N, K, out_f32, t, mt);
}

/* ---- small helpers ------------------------------------------------------------------ */

static inline float nb_bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)v << 16};
    return c.f;
}

static inline uint16_t nb_f32_to_bf16(float f) {  /* round to nearest even, as torch */
    union { float f; uint32_t u; } c = {.f = f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40);  /* NaN */
    c.u += 0x7fffu + ((c.u >> 16) & 1u);
    return (uint16_t)(c.u >> 16);
}

static inline float nb_round_bf16(float f) { return nb_bf16_to_f32(nb_f32_to_bf16(f)); }

/* Vector helpers: 16 bf16 <-> 16 float32 lanes (masked for row tails). */
static inline __m512 nb_load16(const uint16_t *p, __mmask16 mk) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, p)), 16));
}
static inline void nb_store16_bf16(uint16_t *p, __mmask16 mk, __m512 v) {
    _mm256_mask_storeu_epi16(p, mk, (__m256i)_mm512_cvtneps_pbh(v));
}
static inline __m512 nb_round16(__m512 v) {  /* round every lane to the nearest bf16 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
static inline __mmask16 nb_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

/* exp(x) for 16 lanes: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, and a degree-6
 * polynomial for e^r (relative error ~2e-7, below bf16's resolution by far). */
static inline __m512 nb_exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365478515625f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* ---- RMSNorm, optionally fused with the residual add ----------------------------------
 *
 * For each row: r = bf16(x + add) when add is given (written to residual_out), else r = x;
 * out = bf16(w * bf16(r / sqrt(mean(r^2) + eps))): the same roundings as the model's
 * torch path (normalise in float32, cast, scale in bfloat16).
 */
void nb_rms_norm_bf16(const uint16_t *x, const uint16_t *add, const uint16_t *w, uint16_t *out,
                      uint16_t *residual_out, int64_t M, int64_t H, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xr = x + m * H;
        const uint16_t *src = xr;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < H; i += 16) {
            const __mmask16 mk = nb_mask(H - i);
            __m512 v = nb_load16(xr + i, mk);
            if (add) {
                v = nb_round16(_mm512_add_ps(v, nb_load16(add + m * H + i, mk)));
                nb_store16_bf16(residual_out + m * H + i, mk, v);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        if (add) src = residual_out + m * H;
        const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps);
        const __m512 vinv = _mm512_set1_ps(inv);
        for (int64_t i = 0; i < H; i += 16) {
            const __mmask16 mk = nb_mask(H - i);
            const __m512 n = nb_round16(_mm512_mul_ps(nb_load16(src + i, mk), vinv));
            nb_store16_bf16(out + m * H + i, mk, _mm512_mul_ps(nb_load16(w + i, mk), n));
        }
    }
}

/* ---- SwiGLU activation: out[m, i] = bf16(bf16(silu(g)) * u) for gate_up = [g | u] ------- */
void nb_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t M, int64_t I, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *g = gate_up + m * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I; i += 16) {
            const __mmask16 mk = nb_mask(I - i);
            const __m512 gv = nb_load16(g + i, mk);
            const __m512 e = nb_exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            const __m512 s = nb_round16(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            nb_store16_bf16(out + m * I + i, mk, _mm512_mul_ps(s, nb_load16(u + i, mk)));
        }
    }
}

/* ---- Rotary embedding, in place -------------------------------------------------------
 *
 * x: T rows (row stride `stride` elements) of H heads of D values ("rotate half" layout);
 * row t is rotated by the angle table row positions[t]: cos/sin [*, D/2] float32.
 * Computed in float32, rounded to bf16: x1' = x1 c - x2 s, x2' = x2 c + x1 s.
 */
void nb_rotary_bf16(uint16_t *x, const int64_t *positions, const float *cos_t, const float *sin_t,
                    int64_t T, int64_t H, int64_t D, int64_t stride, int nthreads) {
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + positions[t] * half, *s = sin_t + positions[t] * half;
        for (int64_t h = 0; h < H; h++) {
            uint16_t *v = x + t * stride + h * D;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = nb_bf16_to_f32(v[i]), x2 = nb_bf16_to_f32(v[i + half]);
                v[i] = nb_f32_to_bf16(x1 * c[i] - x2 * s[i]);
                v[i + half] = nb_f32_to_bf16(x2 * c[i] + x1 * s[i]);
            }
        }
    }
}

/* ---- Attention over the paged KV cache, reading blocks in place ----------------------
 *
 * Row b of q is one query token that attends to keys 0 .. seq_lens[b] - 1 of the sequence
 * whose blocks block_tables[b] lists: a decode, or one token of a prefill chunk (whose own
 * K/V are already in the cache; its seq_len is its position + 1, which makes it causal).
 * window > 0 limits it to the last `window` of those keys (sliding-window attention): the
 * blocks wholly before them are never read, so they may have been reused.
 * q: [B, Hq, D] with row stride q_stride; caches: [num_blocks, block_size, Hkv, D];
 * block_tables: [B, max_blocks] int32; seq_lens: [B] int32. The G = Hq / Hkv query heads
 * of one KV head are done together, so each key and value row is read once per row and KV
 * head. Scores and softmax in float32 (two passes over the keys), output rounded to bf16.
 * D % 32 == 0, D <= 128, G <= 8.
 */
/* Ask for one head's rows of a whole KV block ahead of use: blocks lie anywhere in the
 * cache, so the hardware prefetcher cannot guess the next one. */
static inline void nb_prefetch_block(const uint16_t *cache, int32_t block, int64_t block_size,
                                     int64_t row, int64_t off, int64_t D) {
    const char *base = (const char *)(cache + (int64_t)block * block_size * row + off);
    for (int64_t o = 0; o < block_size; o++)
        for (int64_t c = 0; c < D * 2; c += 64) _mm_prefetch(base + o * row * 2 + c, _MM_HINT_T0);
}

/* Transpose-and-add trees: the sums of several vectors' lanes in one pass, where separate
 * horizontal reductions take about three times the instructions.
 *
 * nb_sum4_by_lane: 128-bit lane j of the result holds the sums of lane j's four floats
 * of v[0], v[1], v[2], v[3], in that order. */
static inline __m512 nb_sum4_by_lane(const __m512 v[4]) {
    /* per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3 (and the same for c, d) */
    const __m512d ab = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]),
                                                      _mm512_unpackhi_ps(v[0], v[1])));
    const __m512d cd = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]),
                                                      _mm512_unpackhi_ps(v[2], v[3])));
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(ab, cd)));
}

/* Lane i = the sum of v[i]'s 16 lanes. */
static inline __m512 nb_sum16x16(const __m512 v[16]) {
    __m512 s[4];
    for (int i = 0; i < 4; i++) s[i] = nb_sum4_by_lane(v + 4 * i);
    /* Add each s[i]'s four 128-bit lanes, keeping the four sums of s[i] in lane i. */
    const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], 0x88),
                                    _mm512_shuffle_f32x4(s[0], s[1], 0xDD));
    const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(s[2], s[3], 0x88),
                                    _mm512_shuffle_f32x4(s[2], s[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
}

/* Lane i = the sum of v[i]'s 16 lanes, for four vectors. */
static inline __m128 nb_sum4x16(const __m512 v[4]) {
    const __m512 s = nb_sum4_by_lane(v);
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Query heads h G + g0 .. h G + g1 - 1 (those of KV head h) of row b: the work item of
 * the attention kernels below. Every head's output is computed alone, the same way
 * whichever item holds it. */
static void nb_attend(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                      const uint16_t *v_cache, const int32_t *block_tables, const int32_t *seq_lens,
                      uint16_t *out, int64_t b, int64_t h, int64_t g0, int64_t g1, int64_t Hq,
                      int64_t Hkv, int64_t D, int64_t block_size, int64_t max_blocks, float scale,
                      int64_t window) {
    const int64_t G = Hq / Hkv, dv = D / 16, dk = D / 32, ng = g1 - g0;
    const int64_t row = Hkv * D;  /* elements between consecutive positions of a block */
    const int64_t L = seq_lens[b];
    const int64_t S = window > 0 && L > window ? L - window : 0;  /* first key */
    const int64_t J0 = S / block_size * block_size;  /* its block's first position */
    const int32_t *table = block_tables + b * max_blocks;
    /* Room for 16-wide stores from any start S (the tail lanes are masked off). */
    const int64_t Lp = (L + 15) / 16 * 16 + 16;
    float *scores = (float *)malloc(sizeof(float) * ng * Lp);
    __m512bh qv[8][4];  /* [g][d / 32]: G <= 8 and D <= 128 on this path */
    for (int64_t g = 0; g < ng; g++)
        for (int64_t c = 0; c < dk; c++)
            qv[g][c] = (__m512bh)_mm512_loadu_si512(q + b * q_stride + (h * G + g0 + g) * D + 32 * c);
    /* Pass 1: scores, 16 keys at a time (the last group's missing keys repeat its last
     * key, and their lanes are not stored). */
    const __m512 vscale = _mm512_set1_ps(scale);
    int64_t blk = S / block_size, off = S % block_size;  /* where key j lies */
    for (int64_t j = S; j < L; j += 16) {
        const int64_t n = L - j < 16 ? L - j : 16;
        const uint16_t *kr[16];
        for (int64_t i = 0; i < 16; i++) {  /* key j + i (past the end: the last key again) */
            kr[i] = k_cache + ((int64_t)table[blk] * block_size + off) * row + h * D;
            if ((n == 16 || i < n - 1) && ++off == block_size) { off = 0; blk++; }
        }
        /* The next 16 keys' rows (in whichever blocks they lie): ask for them now. */
        if (j + 16 < L) {
            int64_t pb = blk, po = off;
            for (int64_t i = 0; i < 16 && j + 16 + i < L; i++) {
                const char *r = (const char *)(k_cache + ((int64_t)table[pb] * block_size + po) * row + h * D);
                for (int64_t c = 0; c < D * 2; c += 64) _mm_prefetch(r + c, _MM_HINT_T0);
                if (++po == block_size) { po = 0; pb++; }
            }
        }
        for (int64_t g = 0; g < ng; g++) {
            __m512 acc[16];
            for (int64_t i = 0; i < 16; i++) {
                acc[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(kr[i]), qv[g][0]);
                for (int64_t c = 1; c < dk; c++)
                    acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(kr[i] + 32 * c), qv[g][c]);
            }
            _mm512_mask_storeu_ps(scores + g * Lp + j, nb_mask(n), _mm512_mul_ps(nb_sum16x16(acc), vscale));
        }
    }
    /* Softmax per query head, 16 keys at a time. */
    for (int64_t g = 0; g < ng; g++) {
        float *sc = scores + g * Lp;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t j = S; j < L; j += 16)
            mx = _mm512_mask_max_ps(mx, nb_mask(L - j), mx, _mm512_loadu_ps(sc + j));
        const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = S; j < L; j += 16) {
            const __mmask16 mk = nb_mask(L - j);
            const __m512 e = nb_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sc + j), vmax));
            sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mk, e));
            _mm512_mask_storeu_ps(sc + j, mk, e);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
        for (int64_t j = S; j < L; j += 16)
            _mm512_mask_storeu_ps(sc + j, nb_mask(L - j), _mm512_mul_ps(_mm512_loadu_ps(sc + j), inv));
    }
    /* Pass 2: probabilities times values. */
    __m512 acc[8][8];  /* [g][d / 16] */
    for (int64_t g = 0; g < ng; g++)
        for (int64_t c = 0; c < dv; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j0 = J0; j0 < L; j0 += block_size) {
        const uint16_t *vb = v_cache + (int64_t)table[j0 / block_size] * block_size * row + h * D;
        const int64_t n = L - j0 < block_size ? L - j0 : block_size;
        if (j0 + block_size < L) nb_prefetch_block(v_cache, table[j0 / block_size + 1], block_size, row, h * D, D);
        for (int64_t o = j0 < S ? S - j0 : 0; o < n; o++) {
            const uint16_t *vr = vb + o * row;
            __m512 vv[8];
            for (int64_t c = 0; c < dv; c++) vv[c] = nb_load16(vr + 16 * c, 0xffff);
            for (int64_t g = 0; g < ng; g++) {
                const __m512 p = _mm512_set1_ps(scores[g * Lp + j0 + o]);
                for (int64_t c = 0; c < dv; c++) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
            }
        }
    }
    for (int64_t g = 0; g < ng; g++) {
        uint16_t *o = out + (b * Hq + h * G + g0 + g) * D;
        for (int64_t c = 0; c < dv; c++) nb_store16_bf16(o + 16 * c, 0xffff, acc[g][c]);
    }
    free(scores);
}

void nb_cached_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                              const uint16_t *v_cache, const int32_t *block_tables,
                              const int32_t *seq_lens, uint16_t *out, int64_t B, int64_t Hq,
                              int64_t Hkv, int64_t D, int64_t block_size, int64_t max_blocks,
                              float scale, int nthreads, int64_t window) {
#pragma omp parallel for collapse(2) num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hkv; h++)
            nb_attend(q, q_stride, k_cache, v_cache, block_tables, seq_lens, out, b, h, 0,
                      Hq / Hkv, Hq, Hkv, D, block_size, max_blocks, scale, window);
}

/* This thread's share (of `nt`) of the query heads of every row, inside a parallel region
 * the caller runs (the decode plan's one or two rows): thread tid takes the heads
 * [Hq tid / nt, Hq (tid + 1) / nt), in items of one KV head each. */
static void nb_cached_attention_share(const uint16_t *q, int64_t q_stride,
                                      const uint16_t *k_cache, const uint16_t *v_cache,
                                      const int32_t *block_tables, const int32_t *seq_lens,
                                      uint16_t *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                                      int64_t block_size, int64_t max_blocks, float scale,
                                      int64_t window, int tid, int nt) {
    const int64_t G = Hq / Hkv, first = Hq * tid / nt, last = Hq * (tid + 1) / nt;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = first / G; h * G < last; h++) {
            const int64_t g0 = first > h * G ? first - h * G : 0;
            const int64_t g1 = last < (h + 1) * G ? last - h * G : G;
            nb_attend(q, q_stride, k_cache, v_cache, block_tables, seq_lens, out, b, h, g0, g1,
                      Hq, Hkv, D, block_size, max_blocks, scale, window);
        }
}

/* The first half of nb_rope_attention_bf16: q and k rotated, each token's K/V stored. */
static void nb_rope_store(uint16_t *qkv, int64_t qkv_stride, const int64_t *positions,
                          const float *cos_t, const float *sin_t, const int64_t *slots,
                          uint16_t *k_cache, uint16_t *v_cache, int64_t T, int64_t Hq,
                          int64_t Hkv, int64_t D, int row_threads) {
    nb_rotary_bf16(qkv, positions, cos_t, sin_t, T, Hq + Hkv, D, qkv_stride, row_threads);
    for (int64_t t = 0; t < T; t++) {
        memcpy(k_cache + slots[t] * Hkv * D, qkv + t * qkv_stride + Hq * D, (size_t)(Hkv * D * 2));
        memcpy(v_cache + slots[t] * Hkv * D, qkv + t * qkv_stride + (Hq + Hkv) * D,
               (size_t)(Hkv * D * 2));
    }
}

/* The attention half of a layer after its qkv projection, for T tokens (decodes and
 * prefill tokens alike): rotate q and k in place in `qkv` (rows of `qkv_stride` values:
 * Hq query heads, Hkv key heads, Hkv value heads), store each token's new K/V in its
 * cache slot, then attend every token over the cache (a prefill token sees its chunk's
 * keys up to itself, written just before) into `out [T, Hq, D]`. The module path
 * (ops/attention_kernels.py, rope_paged_attention) and the decode plan both run this, so they
 * stay identical. */
void nb_rope_attention_bf16(uint16_t *qkv, int64_t qkv_stride, const int64_t *positions,
                            const float *cos_t, const float *sin_t, const int64_t *slots,
                            uint16_t *k_cache, uint16_t *v_cache, const int32_t *block_tables,
                            const int32_t *seq_lens, uint16_t *out, int64_t T, int64_t Hq,
                            int64_t Hkv, int64_t D, int64_t block_size, int64_t max_blocks,
                            float scale, int64_t window, int row_threads, int attn_threads) {
    nb_rope_store(qkv, qkv_stride, positions, cos_t, sin_t, slots, k_cache, v_cache, T, Hq, Hkv,
                  D, row_threads);
    nb_cached_attention_bf16(qkv, qkv_stride, k_cache, v_cache, block_tables, seq_lens, out, T,
                             Hq, Hkv, D, block_size, max_blocks, scale, attn_threads, window);
}

/* Quantized linears (defined at the end of this file). */
static void nb_linear_q(int bits, const uint16_t *x, const void *w, const void *scales,
                        const uint16_t *bias, void *y, int64_t M, int64_t N, int64_t K,
                        int64_t Kp, int64_t G, int out_f32, int nthreads, int amx);
static void nb_linear_q_share(int bits, const uint16_t *x, const void *w, const void *scales,
                              const uint16_t *bias, void *y, int64_t M, int64_t N, int64_t K,
                              int64_t Kp, int64_t G, int out_f32, int tid, int nt);

/* ---- A whole Llama-family decoder stack for a decode-only step -------------------------
 *
 * One call runs every layer for B single-token sequences, chaining the kernels above in
 * exactly the order (and with exactly the roundings) of the module path in
 * model/llama.py, so its results are identical; what it saves is the Python between the
 * kernels, which is a third of a batch-1 decode step of a small model.
 *
 * In: x = the token embeddings [B, H] (or the token ids, whose embeddings the call looks
 * up into x). Out: x and residual such that the final hidden state is norm(x + residual).
 * With `logits` given, the call goes on to that norm and the language-model head, writing
 * float32 logits [B, vocab] (residual then holds x + residual), and, with `argmax` too,
 * each row's greedy token: then a greedy decode step is this one call.
 */
typedef struct {
    const uint16_t *input_norm, *post_norm;  /* [H] */
    /* The weights: packed bf16, or quantized (then *_scales point to their scales). */
    const void *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    uint16_t *k_cache, *v_cache;  /* [num_blocks, block_size, Hkv, D] */
    int64_t window;  /* sliding-window attention over this many keys; 0: full attention */
    const void *qkv_scales, *o_scales, *gate_up_scales, *down_scales;
} nb_layer;

typedef struct {
    int64_t num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim, block_size;
    float eps, scale;
    const float *cos, *sin;  /* [max_positions, D / 2] */
    const nb_layer *layers;
    const uint16_t *final_norm;  /* [H] */
    const void *lm_head;  /* packed (or quantized) [vocab, H], no bias */
    int64_t vocab;
    /* Weight-only quantization of every linear (the head's too): 0 (bf16), 8 or 4 bits,
     * the int4 group size, and the head's scales. */
    int64_t qbits, qgroup;
    const void *lm_head_scales;
    const uint16_t *embed;  /* [vocab, H]: the token embeddings (for calls given token ids) */
} nb_decoder;

/* Kp of a quantized row of K inputs (ops/quant.py pads int8 to 16, int4 to the group). */
static inline int64_t nb_q_padded(int64_t bits, int64_t group, int64_t K) {
    const int64_t a = bits == 8 ? 32 : group;
    return (K + a - 1) / a * a;
}

/* A spinning barrier for the threads of one parallel region. libgomp's own barrier
 * sleeps at once under OMP_WAIT_POLICY=PASSIVE (which nbengine sets), and a futex
 * wake-up costs tens of microseconds here: too much eight times per layer. Spinning is
 * cheap while the team is busy; after a while a waiter yields the core, so a
 * descheduled partner on a loaded machine costs a time slice, not a livelock. */
typedef struct {
    atomic_int arrived;
    atomic_int phase;
    int n;
} nb_barrier;

static void nb_barrier_wait(nb_barrier *b) {
    const int phase = atomic_load_explicit(&b->phase, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == b->n - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->phase, phase + 1, memory_order_release);
        return;
    }
    for (long spins = 0; atomic_load_explicit(&b->phase, memory_order_acquire) == phase; spins++) {
        _mm_pause();
        if (spins > 20000) { sched_yield(); spins = 0; }
    }
}

/* The layers, as run by thread `tid` of a team of `nt`. nt == 1: one thread runs every
 * step and each kernel uses the thread counts given. nt > 1 (inside a parallel region of
 * nt threads): the linears, which stream the weights, are split by output tiles across
 * the team, the attention by query heads, the small steps run on thread 0, and barriers
 * order them. */
static void nb_decoder_layers(const nb_decoder *m, uint16_t *x, uint16_t *residual,
                              const int64_t *positions, const int64_t *slots,
                              const int32_t *block_tables, const int32_t *seq_lens, int64_t B,
                              int64_t max_blocks, uint16_t *h, uint16_t *qkv, uint16_t *attn,
                              uint16_t *gu, uint16_t *act, float *logits, int tid, int nt,
                              nb_barrier *bar, int lin_threads, int row_threads, int attn_threads) {
    const int64_t H = m->hidden, I = m->intermediate, D = m->head_dim;
    const int64_t Hq = m->num_heads, Hkv = m->num_kv_heads;
    const int64_t nqkv = (Hq + 2 * Hkv) * D;
#define NB_SYNC() do { if (nt > 1) nb_barrier_wait(bar); } while (0)
    const int qb = (int)m->qbits;
    const int64_t G = m->qgroup;
#define NB_LINEAR(in, w, sc, b, out, N, K)                                                \
    do {                                                                                  \
        if (qb) {                                                                         \
            const int64_t kp_ = nb_q_padded(qb, G, K);                                    \
            if (nt > 1) nb_linear_q_share(qb, in, w, sc, b, out, B, N, K, kp_, G, 0, tid, nt); \
            else nb_linear_q(qb, in, w, sc, b, out, B, N, K, kp_, G, 0, lin_threads, 1);   \
        } else if (nt > 1) nb_linear_share(in, w, b, out, B, N, K, 0, tid, nt);            \
        else nb_linear_bf16(in, w, b, out, B, N, K, 0, lin_threads, 1);                    \
    } while (0)
    for (int64_t l = 0; l < m->num_layers; l++) {
        const nb_layer *L = m->layers + l;
        if (tid == 0) {
            if (l == 0) {
                memcpy(residual, x, (size_t)(B * H * 2));
                nb_rms_norm_bf16(x, 0, L->input_norm, h, 0, B, H, m->eps, row_threads);
            } else {
                nb_rms_norm_bf16(x, residual, L->input_norm, h, residual, B, H, m->eps, row_threads);
            }
        }
        NB_SYNC();
        NB_LINEAR(h, L->qkv, L->qkv_scales, L->qkv_bias, qkv, nqkv, H);
        NB_SYNC();
        if (nt == 1) {
            nb_rope_attention_bf16(qkv, nqkv, positions, m->cos, m->sin, slots, L->k_cache,
                                   L->v_cache, block_tables, seq_lens, attn, B, Hq, Hkv, D,
                                   m->block_size, max_blocks, m->scale, L->window, row_threads,
                                   attn_threads);
        } else {  /* the same two steps, the attention split between the team by heads */
            if (tid == 0)
                nb_rope_store(qkv, nqkv, positions, m->cos, m->sin, slots, L->k_cache,
                              L->v_cache, B, Hq, Hkv, D, row_threads);
            NB_SYNC();
            nb_cached_attention_share(qkv, nqkv, L->k_cache, L->v_cache, block_tables, seq_lens,
                                      attn, B, Hq, Hkv, D, m->block_size, max_blocks, m->scale,
                                      L->window, tid, nt);
        }
        NB_SYNC();
        NB_LINEAR(attn, L->o, L->o_scales, L->o_bias, x, H, Hq * D);
        NB_SYNC();
        if (tid == 0)
            nb_rms_norm_bf16(x, residual, L->post_norm, h, residual, B, H, m->eps, row_threads);
        NB_SYNC();
        NB_LINEAR(h, L->gate_up, L->gate_up_scales, L->gate_up_bias, gu, 2 * I, H);
        NB_SYNC();
        if (tid == 0) nb_silu_mul_bf16(gu, act, B, I, row_threads);
        NB_SYNC();
        NB_LINEAR(act, L->down, L->down_scales, L->down_bias, x, H, I);
        NB_SYNC();
    }
    if (logits) {
        if (tid == 0) nb_rms_norm_bf16(x, residual, m->final_norm, h, residual, B, H, m->eps, row_threads);
        NB_SYNC();
        if (qb && nt > 1)
            nb_linear_q_share(qb, h, m->lm_head, m->lm_head_scales, 0, logits, B, m->vocab, H,
                              nb_q_padded(qb, G, H), G, 1, tid, nt);
        else if (qb)
            nb_linear_q(qb, h, m->lm_head, m->lm_head_scales, 0, logits, B, m->vocab, H,
                        nb_q_padded(qb, G, H), G, 1, lin_threads, 1);
        else if (nt > 1) nb_linear_share(h, m->lm_head, 0, logits, B, m->vocab, H, 1, tid, nt);
        else nb_linear_bf16(h, m->lm_head, 0, logits, B, m->vocab, H, 1, lin_threads, 1);
    }
#undef NB_LINEAR
#undef NB_SYNC
}

static int64_t nb_argmax_row(const float *r, int64_t V);

/* token_ids given: x is filled with their embeddings first. argmax given (with logits):
 * each row's greedy token, as nb_argmax_f32 picks it. Returns 0, or -1 (and runs nothing)
 * if a token id is outside the vocabulary. */
int nb_decoder_decode(const nb_decoder *m, uint16_t *x, uint16_t *residual, float *logits,
                      const int64_t *positions, const int64_t *slots, const int32_t *block_tables,
                      const int32_t *seq_lens, int64_t B, int64_t max_blocks, int nthreads,
                      const int64_t *token_ids, int64_t *argmax) {
    const int64_t H = m->hidden, I = m->intermediate, D = m->head_dim;
    if (token_ids) {
        for (int64_t b = 0; b < B; b++)
            if (token_ids[b] < 0 || token_ids[b] >= m->vocab) return -1;
        for (int64_t b = 0; b < B; b++)
            memcpy(x + b * H, m->embed + token_ids[b] * H, (size_t)(H * 2));
    }
    const int64_t nqkv = (m->num_heads + 2 * m->num_kv_heads) * D;
    uint16_t *h = (uint16_t *)aligned_alloc(64, ((B * H * 2 + 63) / 64) * 64);
    uint16_t *qkv = (uint16_t *)aligned_alloc(64, ((B * nqkv * 2 + 63) / 64) * 64);
    uint16_t *attn = (uint16_t *)aligned_alloc(64, ((B * m->num_heads * D * 2 + 63) / 64) * 64);
    uint16_t *gu = (uint16_t *)aligned_alloc(64, ((B * 2 * I * 2 + 63) / 64) * 64);
    uint16_t *act = (uint16_t *)aligned_alloc(64, ((B * I * 2 + 63) / 64) * 64);
    if (B <= 2 && nthreads > 1) {
        /* One or two rows: every linear is a stream of weights that one core cannot read
         * at the memory's full speed. One parallel region for the whole stack (a single
         * wake-up of the team), the weights split between its threads. */
        nb_barrier bar;
        atomic_init(&bar.arrived, 0);
        atomic_init(&bar.phase, 0);
#pragma omp parallel num_threads(nthreads)
        {
#pragma omp single
            bar.n = omp_get_num_threads();  /* the implicit barrier publishes it */
            nb_decoder_layers(m, x, residual, positions, slots, block_tables, seq_lens, B,
                              max_blocks, h, qkv, attn, gu, act, logits, omp_get_thread_num(),
                              bar.n, &bar, 1, 1, 1);
        }
    } else {
        const int row_threads = B < 16 ? 1 : nthreads;  /* as NativeKernels._threads */
        const int attn_threads = max_blocks * m->block_size * B * m->num_kv_heads < 8192 ? 1 : nthreads;
        nb_decoder_layers(m, x, residual, positions, slots, block_tables, seq_lens, B,
                          max_blocks, h, qkv, attn, gu, act, logits, 0, 1, 0,
                          B <= 2 ? 1 : nthreads, row_threads, attn_threads);
    }
    free(h); free(qkv); free(attn); free(gu); free(act);
    if (argmax && logits)
        for (int64_t b = 0; b < B; b++) argmax[b] = nb_argmax_row(logits + b * m->vocab, m->vocab);
    return 0;
}

/* ---- Greedy sampling: the index of each row's maximum --------------------------------
 *
 * As torch.argmax: the first index of the maximum, and a NaN counts as the maximum (the
 * first NaN wins). x: [N, V] float32.
 */
static int64_t nb_argmax_row(const float *r, int64_t V) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int64_t i = 0; i < V; i += 16) {
        const __mmask16 mk = nb_mask(V - i);
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), mk, r + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, v);
    }
    if (nan) {
        for (int64_t i = 0; i < V; i++)
            if (r[i] != r[i]) return i;
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    for (int64_t i = 0; i < V; i += 16) {
        const __mmask16 hit = _mm512_mask_cmp_ps_mask(nb_mask(V - i), _mm512_loadu_ps(r + i), m, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
    return 0;
}

void nb_argmax_f32(const float *x, int64_t N, int64_t V, int64_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) out[n] = nb_argmax_row(x + n * V, V);
}

/* ---- LoRA deltas: y[r] += B_s (A_s x[r]) for the adapter slot s = slot[r] of each row ---
 *
 * x bf16 [M, K], y bf16 [M, N] updated in place; slot int32 [M], -1 for a row without
 * adapter (left untouched). A layer's output is P parts (one for a plain linear; q/k/v or
 * gate/up for a fused one, model/weight_map.py): parts int64 [P, 4] holds each part's
 * (first rank column c, rank r, first output o, outputs n). Each slot's shrink A [R, K]
 * holds the parts' A stacked (rank columns c .. c + r - 1 for part p, zero rows where a
 * slot's rank is lower), and its expands B_p [r, n] (transposed, the scale folded in)
 * follow one another, part after part. So part p's outputs get B_p^T h[c .. c + r - 1]
 * only: no block-diagonal zeros are read, and a fused layer's shrink is one pass over x
 * for all its parts.
 *
 * Layout (ops/native.py, pack_lora_factors, writes it): A is [S, R16 / 16, K32 / 32, 16,
 * 16, 2] (R and K zero-padded to multiples of 16 and 32): each 1 KiB block holds 16 ranks
 * by 32 inputs as 16 rows of input pairs, (A[r, 2i], A[r, 2i + 1]) for the 16 ranks r of
 * row i. B is [S, BS], each part as [ceil(n / 16), r2 / 2, 16, 2] (r2: r rounded up to
 * even, outputs zero-padded to 16): a block of 16 outputs holds rank pairs, (B[2j, o],
 * B[2j + 1, o]) for its 16 outputs o. Both are the "VNNI" layout of an AMX B tile and of
 * a dpbf16 outer product (a row times a broadcast pair gives 16 sums: no horizontal
 * sums). The expand prefetches the B stream NB_PREFETCH_BYTES ahead, as the linear
 * kernels do.
 *
 * Rows are sorted by slot and taken up to 16 of one slot at a time (a tile), copied into
 * a zero-padded buffer. The shrink h = A_s x multiplies bf16 pairs (each product exact
 * in float32) into float32 sums; the expand adds B_p^T h to y's value in float32, and y
 * is rounded to bf16 once (nbengine/lora/layers.py is the caller; its bmm path the
 * reference). With `amx` set, where the CPU and the OS allow AMX tiles, both run on them
 * (TDPBF16PS: 16 rows by 16 outputs by up to 32 inputs per instruction), h entering the
 * expand as three bf16 terms whose sum is h to float32 precision (nb_lora_split3); else
 * the shrink is dpbf16 outer products and the expand float32 FMAs, four rows at a time.
 * The two differ in float32 rounding order only. A row's sums depend on neither the
 * other rows of its tile nor the thread count (AMX computes each row of a tile on its
 * own). One call does a whole hooked linear; with nthreads > 1 the tiles are split
 * between threads. Returns 0, or -1 (and changes nothing) if a slot is outside -1 ..
 * S-1, R16 not a multiple of 16, a part outside R16 or N, or BS not the parts' size. */
#define NB_LORA_ROWS 16 /* rows of a tile: an AMX tile's */

static inline __mmask32 nb_mask32(int64_t left) {
    return left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1);
}

/* Whether AMX bf16 tiles can be used: the CPU has them (CPUID.7.0:EDX bits 22 and 24)
 * and Linux grants this process their state (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA; a process must ask before its first tile instruction). Asked once;
 * two threads asking at once both get the same answer. */
int nb_amx_usable(void) {
    static _Atomic int state = 0; /* 0: not asked yet, 1: usable, -1: not */
    int s = atomic_load(&state);
    if (s == 0) {
        unsigned a, b, c, d;
        int ok = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) && (d >> 24 & 1);
        if (ok) ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
        s = ok ? 1 : -1;
        atomic_store(&state, s);
    }
    return s > 0;
}

/* nb_amx_usable, and the CPU has AMX int8 tiles too (CPUID.7.0:EDX bit 25). */
static int nb_amx_int8_usable(void) {
    unsigned a, b, c, d;
    return nb_amx_usable() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 25 & 1);
}

/* The LDTILECFG operand: palette 1, every tile used here 16 rows of 64 bytes. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} nb_tile_config;

/* LDTILECFG of the whole 64-byte operand. GCC 12's _tile_loadconfig tells the compiler
 * that it reads only 8 bytes, so the stores that fill the rest of the configuration may
 * be dropped as dead (seen: a config of zero-width tiles, and a fault, once inlined). */
__attribute__((target("amx-tile"))) static inline void nb_tile_load_config(
    const nb_tile_config *cfg) {
    __asm__ volatile("ldtilecfg %0" ::"m"(*cfg) : "memory");
}

/* Palette 1 with tiles 0-7 all 16 rows of 64 bytes (callers narrow some after). */
static void nb_tile_config_full(nb_tile_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg->colsb[t] = 64;
        cfg->rows[t] = 16;
    }
}

/* h[i, g * 16 + j] = sum over k of xb[i, k] a[g's rank j, k], for the tile's 16 rows
 * (xb [16, kc * 32], zero-padded; rows past the tile's hold stale values, whose sums are
 * not used) and the G rank groups: four groups' sums in tiles 0-3 at a time, tile 4 the
 * rows' 32 inputs, tiles 5-7 the groups' blocks. */
__attribute__((target("amx-tile,amx-bf16"))) static void nb_lora_shrink_amx(
    const uint16_t *xb, const uint16_t *a, int64_t kc, int64_t G, float *h, int64_t R16) {
    nb_tile_config cfg;
    nb_tile_config_full(&cfg);
    nb_tile_load_config(&cfg);
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t ng = G - g0 < 4 ? G - g0 : 4;
        const uint16_t *ag = a + g0 * kc * 512; /* block (g0, 0); a group is kc blocks */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < kc; c++) {
            _tile_loadd(4, xb + c * 32, kc * 64);
            _tile_loadd(5, ag + c * 512, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (ng > 1) {
                _tile_loadd(6, ag + (kc + c) * 512, 64);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (ng > 2) {
                _tile_loadd(7, ag + (2 * kc + c) * 512, 64);
                _tile_dpbf16ps(2, 4, 7);
            }
            if (ng > 3) {
                _tile_loadd(5, ag + (3 * kc + c) * 512, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        float *hg = h + g0 * 16;
        _tile_stored(0, hg, R16 * 4);
        if (ng > 1) _tile_stored(1, hg + 16, R16 * 4);
        if (ng > 2) _tile_stored(2, hg + 32, R16 * 4);
        if (ng > 3) _tile_stored(3, hg + 48, R16 * 4);
    }
    _tile_release();
}

/* Rows i0 .. i0 + NR - 1 of the dpbf16 shrink, rank groups g and g + 1 (NG of them);
 * NR and NG are constants where inlined (NR * NG independent sums cover dpbf16's
 * latency). */
static inline __attribute__((always_inline)) void nb_lora_shrink_dp_rows(
    const uint16_t *xr, int64_t k32, const uint16_t *a0, const uint16_t *a1, float *h,
    int64_t R16, const int NR, const int NG) {
    __m512 acc[2][8];
    for (int u = 0; u < NG; u++)
        for (int i = 0; i < NR; i++) acc[u][i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k32 / 2; p++) { /* input pair p: row p % 16 of block p / 16 */
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(a0 + p * 32);
        const __m512bh b1 = NG > 1 ? (__m512bh)_mm512_loadu_si512(a1 + p * 32) : b0;
#pragma GCC unroll 8
        for (int i = 0; i < NR; i++) {
            int32_t pair;
            memcpy(&pair, xr + i * k32 + 2 * p, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            acc[0][i] = _mm512_dpbf16_ps(acc[0][i], b0, xv);
            if (NG > 1) acc[1][i] = _mm512_dpbf16_ps(acc[1][i], b1, xv);
        }
    }
    for (int u = 0; u < NG; u++)
        for (int i = 0; i < NR; i++) _mm512_storeu_ps(h + i * R16 + 16 * u, acc[u][i]);
}

/* The same sums by dpbf16 outer products, for the tile's nr rows eight (or, for the last
 * four or fewer, four) at a time (rows past nr are stale, their sums not used) and two
 * rank groups at a time. */
static void nb_lora_shrink_dp(const uint16_t *xb, int nr, const uint16_t *a, int64_t kc,
                              int64_t G, float *h, int64_t R16) {
    const int64_t k32 = kc * 32;
    for (int64_t i0 = 0; i0 < nr;) {
        const int eight = nr - i0 > 4;
        const uint16_t *xr = xb + i0 * k32;
        for (int64_t g = 0; g < G; g += 2) {
            const uint16_t *a0 = a + g * kc * 512, *a1 = a0 + kc * 512;
            float *hg = h + i0 * R16 + g * 16;
            if (g + 1 < G) {
                if (eight)
                    nb_lora_shrink_dp_rows(xr, k32, a0, a1, hg, R16, 8, 2);
                else
                    nb_lora_shrink_dp_rows(xr, k32, a0, a1, hg, R16, 4, 2);
            } else if (eight) {
                nb_lora_shrink_dp_rows(xr, k32, a0, a0, hg, R16, 8, 1);
            } else {
                nb_lora_shrink_dp_rows(xr, k32, a0, a0, hg, R16, 4, 1);
            }
        }
        i0 += eight ? 8 : 4;
    }
}

/* The float32 expand of `nb` (1 or 2, a constant where inlined) consecutive blocks of 16
 * outputs of one part, for up to four rows: bb is the first block ([pr2 / 2, 16, 2] bf16
 * each: rank pairs), `left` the part's outputs from the first block on, h the rows' sums
 * (row stride R16). Each block's sums are the same whatever nb. */
static inline __attribute__((always_inline)) void nb_lora_expand(
    const uint16_t *bb, const float *h, int64_t c, int64_t pr, int64_t R16, uint16_t *const *yr,
    int nr, int64_t o, int64_t left, const int nb) {
    const int64_t pr2 = pr + (pr & 1);
    const char *ahead = (const char *)bb + NB_PREFETCH_BYTES;
    for (int64_t l = 0; l < (nb * pr2 * 32 + 63) / 64; l++) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    __m512 even[2][4], odd[2][4];
    for (int u = 0; u < nb; u++)
        for (int i = 0; i < 4; i++) even[u][i] = odd[u][i] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 2 <= pr; j += 2) {
#pragma GCC unroll 2
        for (int u = 0; u < nb; u++) {
            const __m512i w = _mm512_loadu_si512(bb + u * pr2 * 16 + j * 16);
            const __m512 b0 = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));   /* rank j */
            const __m512 b1 = _mm512_castsi512_ps(_mm512_and_si512(w, high));  /* j + 1 */
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                even[u][i] = _mm512_fmadd_ps(b0, _mm512_set1_ps(h[i * R16 + c + j]), even[u][i]);
                odd[u][i] = _mm512_fmadd_ps(b1, _mm512_set1_ps(h[i * R16 + c + j + 1]), odd[u][i]);
            }
        }
    }
    if (j < pr) { /* an odd rank: the last pair's second rank is padding */
        for (int u = 0; u < nb; u++) {
            const __m512i w = _mm512_loadu_si512(bb + u * pr2 * 16 + j * 16);
            const __m512 b0 = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
            for (int i = 0; i < 4; i++)
                even[u][i] = _mm512_fmadd_ps(b0, _mm512_set1_ps(h[i * R16 + c + j]), even[u][i]);
        }
    }
    for (int u = 0; u < nb; u++) {
        const __mmask16 mk = nb_mask(left - 16 * u);
        for (int i = 0; i < nr; i++) { /* rows past the tile's: not stored */
            const __m512 d = _mm512_add_ps(even[u][i], odd[u][i]);
            uint16_t *yo = yr[i] + o + 16 * u;
            nb_store16_bf16(yo, mk, _mm512_add_ps(nb_load16(yo, mk), d));
        }
    }
}

/* h [16, R16] float32 as three bf16 terms, hs [3, 16, R16 + 2] (the last two columns
 * stay zero: an odd part's padding rank reads them): hi = h rounded, mid = (h - hi)
 * rounded, lo = (h - hi - mid) rounded, so hi + mid + lo is h to about 2^-24 of it and
 * three bf16 products give the float32 expand's precision. Rows 0 .. nr - 1. */
static void nb_lora_split3(const float *h, int nr, int64_t R16, uint16_t *hs) {
    const int64_t RP = R16 + 2;
    for (int i = 0; i < nr; i++)
        for (int64_t j = 0; j < R16; j += 16) {
            const __m512 v = _mm512_loadu_ps(h + i * R16 + j);
            const __m256bh hi = _mm512_cvtneps_pbh(v);
            const __m512 r1 = _mm512_sub_ps(v, _mm512_cvtpbh_ps(hi));
            const __m256bh mid = _mm512_cvtneps_pbh(r1);
            const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(r1, _mm512_cvtpbh_ps(mid)));
            _mm256_storeu_si256((__m256i *)(hs + i * RP + j), (__m256i)hi);
            _mm256_storeu_si256((__m256i *)(hs + (16 + i) * RP + j), (__m256i)mid);
            _mm256_storeu_si256((__m256i *)(hs + (32 + i) * RP + j), (__m256i)lo);
        }
}

/* Whether a part's expand runs on AMX: its padded rank pr2 is one K step of TDPBF16PS
 * (<= 32) or whole ones (vLLM's ranks 8 .. 512 all are). */
static inline int nb_lora_amx_rank(int64_t pr2) { return pr2 <= 32 || pr2 % 32 == 0; }

/* One part's expand on AMX tiles for the tile's rows: C[16, 16 outputs] = sum of the
 * three terms of hs (tiles 3-5: rank columns c .. c + pc - 1, pc <= 32 per K step) by
 * the block's rank pairs (tiles 6-7), two blocks at a time in tiles 0-1; then each row's
 * y += C, rounded to bf16 once. cs [2, 16, 16] float32 is scratch. */
__attribute__((target("amx-tile,amx-bf16"))) static void nb_lora_expand_amx(
    const uint16_t *bp, const uint16_t *hs, int64_t R16, int64_t c, int64_t pr2,
    uint16_t *const *yr, int nr, int64_t o, int64_t pn, float *cs) {
    const int64_t RP = R16 + 2, pc = pr2 < 32 ? pr2 : 32, steps = pr2 / pc;
    const int64_t bblock = pr2 * 16, blocks = (pn + 15) / 16; /* elements of one block */
    nb_tile_config cfg;
    nb_tile_config_full(&cfg);
    for (int t = 3; t < 6; t++) cfg.colsb[t] = (uint16_t)(pc * 2);
    cfg.rows[6] = cfg.rows[7] = (uint8_t)(pc / 2);
    nb_tile_load_config(&cfg);
    const uint16_t *h0 = hs + c, *h1 = hs + 16 * RP + c, *h2 = hs + 32 * RP + c;
    if (steps == 1) {
        _tile_loadd(3, h0, RP * 2);
        _tile_loadd(4, h1, RP * 2);
        _tile_loadd(5, h2, RP * 2);
    }
    for (int64_t t = 0; t < blocks; t += 2) {
        const int two = t + 1 < blocks;
        const uint16_t *b0 = bp + t * bblock;
        for (int l = 0; l < (int)((2 * bblock * 2) / 64); l++)
            _mm_prefetch((const char *)b0 + NB_PREFETCH_BYTES + 64 * l, _MM_HINT_T0);
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t q = 0; q < steps; q++) {
            if (steps > 1) {
                _tile_loadd(3, h0 + 32 * q, RP * 2);
                _tile_loadd(4, h1 + 32 * q, RP * 2);
                _tile_loadd(5, h2 + 32 * q, RP * 2);
            }
            _tile_loadd(6, b0 + q * 512, 64);
            if (two) _tile_loadd(7, b0 + bblock + q * 512, 64);
            _tile_dpbf16ps(0, 3, 6);
            if (two) _tile_dpbf16ps(1, 3, 7);
            _tile_dpbf16ps(0, 4, 6);
            if (two) _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(0, 5, 6);
            if (two) _tile_dpbf16ps(1, 5, 7);
        }
        _tile_stored(0, cs, 64);
        if (two) _tile_stored(1, cs + 256, 64);
        for (int u = 0; u <= two; u++) {
            const __mmask16 mk = nb_mask(pn - 16 * (t + u));
            for (int i = 0; i < nr; i++) {
                uint16_t *yo = yr[i] + o + 16 * (t + u);
                const __m512 d = _mm512_loadu_ps(cs + u * 256 + i * 16);
                nb_store16_bf16(yo, mk, _mm512_add_ps(nb_load16(yo, mk), d));
            }
        }
    }
    _tile_release();
}

/* One tile: `nr` (1 .. 16) rows of one slot, whose factors are a and b. The calling
 * thread's scratch: xb [16, K32], h [16, R16], hs [3, 16, R16 + 2], cs [2, 16, 16]. */
static void nb_lora_tile(const uint16_t *x, uint16_t *y, const int32_t *rows, int nr,
                         const uint16_t *a, const uint16_t *b, const int64_t *parts,
                         int64_t P, int64_t K, int64_t N, int64_t R16, int amx, uint16_t *xb,
                         float *h, uint16_t *hs, float *cs) {
    const int64_t kc = (K + 31) / 32, k32 = kc * 32;
    for (int i = 0; i < nr; i++) {
        memcpy(xb + i * k32, x + rows[i] * K, sizeof(uint16_t) * (size_t)K);
        memset(xb + i * k32 + K, 0, sizeof(uint16_t) * (size_t)(k32 - K));
    }
    if (amx) {
        nb_lora_shrink_amx(xb, a, kc, R16 / 16, h, R16);
        nb_lora_split3(h, nr, R16, hs);
    } else {
        nb_lora_shrink_dp(xb, nr, a, kc, R16 / 16, h, R16);
    }
    uint16_t *yr[NB_LORA_ROWS];
    for (int i = 0; i < nr; i++) yr[i] = y + rows[i] * N;
    const uint16_t *bp = b;
    for (int64_t p = 0; p < P; p++) {
        const int64_t c = parts[4 * p], pr = parts[4 * p + 1], o = parts[4 * p + 2];
        const int64_t pn = parts[4 * p + 3], blocks = (pn + 15) / 16, pr2 = pr + (pr & 1);
        if (pr == 0) continue;
        if (amx && nb_lora_amx_rank(pr2)) {
            nb_lora_expand_amx(bp, hs, R16, c, pr2, yr, nr, o, pn, cs);
        } else {
            for (int i0 = 0; i0 < nr; i0 += 4) {
                const int n4 = nr - i0 < 4 ? nr - i0 : 4;
                uint16_t *y4[4];
                for (int i = 0; i < 4; i++) y4[i] = yr[i0 + (i < n4 ? i : n4 - 1)];
                const float *h4 = h + i0 * R16;
                int64_t t = 0;
                for (; t + 2 <= blocks; t += 2) /* two blocks at a time: sixteen sums */
                    nb_lora_expand(bp + t * pr2 * 16, h4, c, pr, R16, y4, n4, o + t * 16,
                                   pn - t * 16, 2);
                if (t < blocks)
                    nb_lora_expand(bp + t * pr2 * 16, h4, c, pr, R16, y4, n4, o + t * 16,
                                   pn - t * 16, 1);
            }
        }
        bp += blocks * pr2 * 16;
    }
}

int nb_lora_bf16(const uint16_t *x, uint16_t *y, const int32_t *slot, const uint16_t *A,
                 const uint16_t *B, const int64_t *parts, int64_t M, int64_t K, int64_t N,
                 int64_t S, int64_t R16, int64_t P, int64_t BS, int nthreads, int amx) {
    for (int64_t m = 0; m < M; m++)
        if (slot[m] < -1 || slot[m] >= S) return -1;
    if (R16 % 16) return -1;
    int64_t bs = 0;
    for (int64_t p = 0; p < P; p++) {
        const int64_t c = parts[4 * p], pr = parts[4 * p + 1], o = parts[4 * p + 2];
        const int64_t pn = parts[4 * p + 3];
        if (c < 0 || pr < 0 || c + pr > R16 || o < 0 || pn < 0 || o + pn > N) return -1;
        bs += (pr + (pr & 1)) * ((pn + 15) / 16) * 16;
    }
    if (bs != BS) return -1;
    if (M == 0 || R16 == 0) return 0;
    amx = amx && nb_amx_usable();
    /* rows with an adapter, by slot (a counting sort), then tiles of <= 16 rows of one slot */
    int32_t *order = (int32_t *)malloc(sizeof(int32_t) * (size_t)M);
    int64_t *tiles = (int64_t *)malloc(sizeof(int64_t) * (size_t)(M + S)); /* first of each */
    int64_t used = 0, ntiles = 0;
    for (int64_t s = 0; s < S; s++) {
        int64_t in_slot = 0;
        for (int64_t m = 0; m < M; m++)
            if (slot[m] == s) {
                if (in_slot++ % NB_LORA_ROWS == 0) tiles[ntiles++] = used;
                order[used++] = (int32_t)m;
            }
    }
    const int64_t a_slot = R16 * ((K + 31) / 32) * 32;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && ntiles > 1)
    {
        uint16_t *xb = (uint16_t *)calloc((size_t)(NB_LORA_ROWS * ((K + 31) / 32) * 32), 2);
        float *h = (float *)malloc(sizeof(float) * (size_t)(NB_LORA_ROWS * R16));
        /* the AMX expand's operands: h as three bf16 terms, and a tile's sums */
        uint16_t *hs = amx ? (uint16_t *)calloc((size_t)(3 * NB_LORA_ROWS * (R16 + 2)), 2) : 0;
        float *cs = amx ? (float *)malloc(sizeof(float) * 2 * NB_LORA_ROWS * 16) : 0;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < ntiles; t++) {
            const int64_t first = tiles[t];
            const int32_t s = slot[order[first]];
            int nr = 1;
            while (nr < NB_LORA_ROWS && first + nr < used && slot[order[first + nr]] == s) nr++;
            nb_lora_tile(x, y, order + first, nr, A + (int64_t)s * a_slot, B + (int64_t)s * BS,
                         parts, P, K, N, R16, amx, xb, h, hs, cs);
        }
        free(xb);
        free(h);
        free(hs);
        free(cs);
    }
    free(order);
    free(tiles);
    return 0;
}

/* ---- Weight-only quantized linears: y[M, N] = x[M, K] @ dequant(W)^T (+ bias) ----------
 *
 * The weights stay quantized in memory and are dequantized in registers (ops/quant.py
 * holds the torch reference of both formats and of these products):
 *
 * int8: W ~ q[n, k] * scale[n]; q int8 [N, Kp] (rows zero-padded to Kp, a multiple of
 *   32), scale float32 [N].
 * int4: W ~ q[n, k] * s[n, g] + z[n, g] for the group g = k / G of G consecutive inputs;
 *   q in 0..15, two per byte: byte b of a group's G/2 holds element b in its low nibble
 *   and element G/2 + b in its high nibble, so G/2 bytes give G consecutive values with
 *   no shuffle. Rows [Kp / 2] bytes (Kp: K rounded up to G), in windows of 16 groups
 *   and by blocks of four rows (ops/quant.py; nb_q4_rows_mb below); (s, z) float16
 *   pairs [N, Kp / G, 2].
 *
 * Rows of x, int8 weights: each row of x is scaled to int16 (per row: xq = round(x *
 * 32767 / max|x|), an error of at most 1/65534 of the row's largest value: far below
 * bfloat16's own rounding of x, whose 8 significant bits it keeps exactly) once per
 * call, and the products are integer dot products (AVX-512 VNNI vpdpwssd: 32 int16
 * products summed into 16 int32 lanes by one instruction), exact, then scaled in
 * float32: y = sx * scale[n] * sum_k q xq (int32 lanes flushed to float32 every 2048
 * inputs, before they could overflow). Per 32 weights that is one widening load and one
 * vpdpwssd, few enough that one core streams weights at memory speed for a row or two;
 * with more rows each widened weight serves four rows of x, one vpdpwssd per row. The
 * cost grows with the rows, so from NB_Q_AMX_ROWS rows on, where AMX tiles are
 * usable, the same integer sums run on AMX int8 tiles (below, nb_linear_q8_amx), and
 * elsewhere from NB_Q8_TILE_ROWS rows on the bf16 tiles described last.
 *
 * Rows of x, int4 weights, at any number of rows where AMX tiles are not usable (below
 * NB_Q_AMX_ROWS where they are): each group of G inputs is scaled to
 * int8 on its own (x8 = round(x * 127 / max|x| over the group), sx_g = max / 127), and
 * the products are vpdpbusd (64 unsigned nibble by signed int8 products per
 * instruction), exact, then y = sum_g sx_g (s * sum_{k in g} q x8 + z * sum_{k in g} x8).
 * With int16 inputs (two vpdpwssd, a widening and a shift per 64 weights) int4 was
 * compute bound at about 60% of int8's weights per second; this is 1.4x faster (30
 * layers of the bench shape, one row, two threads, interleaved: 4.85 -> 3.53 ms), and
 * the held-out perplexity moved by less than 0.03% (docs/quantization.md).
 *
 * Either way each weight row is read once for all M rows, four output rows together,
 * and each row's result depends on that row alone, whatever M is.
 *
 * int4 from NB_Q_AMX_ROWS rows on, where AMX tiles are usable: the weights dequantized
 * to bf16 for AMX bf16 tiles (below, nb_linear_q4_amx).
 *
 * Many rows of int8 without AMX (batched decode, prefill: M >= NB_Q8_TILE_ROWS): each
 * thread dequantizes one tile of 64 output features at a time to bfloat16 in the VNNI
 * layout of nb_linear_bf16, into a buffer of 64 x K values, and runs the bf16 tile
 * kernel on it for every row: the full bf16 weight never exists. Those products see the
 * weights rounded to bfloat16 (as a bf16 model's) and x as it is. The int8 row kernel
 * multiplies int16 at the rate the tiles multiply bf16 (32 products per instruction)
 * and widens each weight once per four rows, so the two are level at 64 rows and the
 * tiles ahead from about 96 (the AMD host, 2026-12-06, the 1B shape's four linears,
 * two threads: 11.3 / 16.8 / 22.4 / 33.3 ms at 32 / 48 / 64 / 96 rows on the row
 * kernel against 13.9 / 18.1 / 22.7 / 31.3 on the tiles). int4 never takes the tiles:
 * its row kernel's vpdpbusd makes 64 products per instruction on weights unpacked once
 * for two rows, scaled once per window of 16 groups, and it stays ahead of the tiles at
 * every row count measured, 32 to 1024 (9.0 against 14.1 ms at 32 rows, 16.2 / 21.3
 * at 64, 62.4 / 74.0 at 256, 271 / 301 at 1024), and of an unquantized bf16 product
 * (21.1 ms at 64 rows, 74.5 at 256; docs/quantization.md, "Kernels"). So without AMX
 * each row's int4 product is that of one row alone, whatever the batch.
 */
#define NB_Q8_TILE_ROWS 64
/* The row kernels below walk four output rows at a time (four short streams, which the
 * hardware prefetcher follows poorly; int8's one-row kernel reads them in order
 * instead, and int4's rows are laid out so that the four are one stream), so they
 * prefetch the block of four rows this many blocks ahead, linearly, while computing the
 * current one (at one row of x on AMD CPUs, not those two: nb_prefetch_rows_ahead).
 * Same A/B as NB_PREFETCH_BYTES, two threads, rows side by side: int8 10.3 -> 5.0 ms,
 * int4 7.5 -> 4.8 ms (2 to 6 blocks ahead within 10%).
 * int4 rows are half as long, so int4 looks twice as many blocks ahead, the same bytes:
 * 2-3% faster than 4 blocks on the Intel host (docs/benchmarks.md, "int4 in windows of
 * 16 groups"). */
#define NB_Q_PREFETCH_BLOCKS 4
#define NB_Q4_PREFETCH_BLOCKS 8
#define NB_Q8_FLUSH 64  /* 32-input steps between int32 -> float32 flushes (int8) */

/* Whether the kernels that read their weights as one stream in address order at one row
 * of x prefetch the block ahead: not on AMD CPUs. Those are int8's one-row kernel
 * (nb_q8_row1, decode), which reads its four rows one after another, and int4's row
 * kernel (nb_q4_rows), whose four rows' chunks take turns in memory (ops/quant.py). On
 * the AMD host (Zen 4) the hardware prefetcher alone reads such a stream faster than with
 * the software prefetches besides (below; int4: 28-30 against 20 GB/s on one core). On
 * the Intel host the prefetches doubled the row kernels' speed when they walked four rows
 * side by side; they are kept there, not yet measured with the rows in order. */
static int nb_prefetch_rows_ahead(void) {
    static _Atomic int state = 0; /* 0: not asked yet, 1: prefetch, -1: not */
    int s = atomic_load(&state);
    if (s == 0) {
        unsigned a, b, c, d;
        char vendor[13] = {0};
        if (__get_cpuid(0, &a, &b, &c, &d)) {
            memcpy(vendor, &b, 4);
            memcpy(vendor + 4, &d, 4);
            memcpy(vendor + 8, &c, 4);
        }
        s = strcmp(vendor, "AuthenticAMD") == 0 ? -1 : 1;
        atomic_store(&state, s);
    }
    return s > 0;
}

static inline float nb_f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

/* The rows of x, converted once per call for the row kernels below.
 *
 * int8 weights: each row of x as int16 with one scale per row.
 * int4 weights: each row of x as int8 with one scale per group of G inputs (the groups
 * of the weights), laid out for vpdpbusd against the weights' windows of 16 groups: chunk
 * j of window w (the 64 weight bytes whose lane l is dword j of group 16 w + l) is 64
 * bytes "lo" then 64 bytes "hi", where lane l of lo and of hi holds the four inputs that
 * the low and the high nibbles of that dword multiply. */
typedef struct {
    int16_t *xq;    /* int8: [M, Kp], zero-padded, 64-byte aligned */
    float *sx;      /* int8: [M]: x ~ xq * sx */
    int8_t *x8;     /* int4: [M, kc] in chunk order (kc = windows * 16 G; zero past the groups) */
    /* int4: [M, windows, 2, 16]: per window, sx_g then sx_g * sum_{k in g} x8 for its 16
     * groups (zeros past the last group): x ~ x8 * sx_g over group g. */
    float *xv;
    int64_t kc, nv;  /* int4: bytes of x8 and floats of xv per row */
} nb_qx;

static void nb_q_inputs_int16(nb_qx *in, const uint16_t *x, int64_t M, int64_t K, int64_t Kp) {
    in->xq = (int16_t *)aligned_alloc(64, (size_t)((M * Kp * 2 + 63) / 64 * 64));
    in->sx = (float *)malloc(sizeof(float) * (size_t)M);
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xr = x + m * K;
        __m512 mx = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16)
            mx = _mm512_max_ps(mx, _mm512_abs_ps(nb_load16(xr + k, nb_mask(K - k))));
        const float amax = _mm512_reduce_max_ps(mx);
        /* As ops/quant.py: inv = 32767 / amax and sx = amax / 32767, both float32. */
        const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        in->sx[m] = amax / 32767.0f;
        const __m512 vinv = _mm512_set1_ps(inv);
        int16_t *q = in->xq + m * Kp;
        for (int64_t k = 0; k < Kp; k += 16) {
            __m256i v = _mm256_setzero_si256();
            if (k < K) {  /* round to nearest even, as torch.round */
                const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(nb_load16(xr + k, nb_mask(K - k)), vinv));
                v = _mm512_cvtsepi32_epi16(r);
            }
            _mm256_store_si256((__m256i *)(q + k), v);
        }
    }
}

static void nb_q_inputs_int8_groups(nb_qx *in, const uint16_t *x, int64_t M, int64_t K,
                                    int64_t Kp, int64_t G) {
    const int64_t ng = Kp / G, half = G / 2, D = G / 8, windows = (ng + 15) / 16;
    in->kc = windows * 16 * G;
    in->nv = windows * 32;
    in->x8 = (int8_t *)aligned_alloc(64, (size_t)(M * in->kc));
    in->xv = (float *)aligned_alloc(64, (size_t)(M * in->nv * 4));
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xr = x + m * K;
        int8_t *x8 = in->x8 + m * in->kc;
        float *xv = in->xv + m * in->nv;
        /* Every lane of a group is written below; those of a partial last window past its
         * groups meet zero weight bytes (masked loads) and zero (s, z) pairs, zeroed all
         * the same. */
        if (ng % 16) {
            memset(x8 + (windows - 1) * D * 128, 0, (size_t)(D * 128));
            memset(xv + (windows - 1) * 32, 0, 32 * 4);
        }
        for (int64_t g = 0; g < ng; g++) {
            const int64_t w = g / 16, l = g % 16;
            __m512 mx = _mm512_setzero_ps();
            for (int64_t k = g * G; k < g * G + G && k < K; k += 16)
                mx = _mm512_max_ps(mx, _mm512_abs_ps(nb_load16(xr + k, nb_mask(K - k))));
            const float amax = _mm512_reduce_max_ps(mx);
            /* As ops/quant.py: inv = 127 / amax and sx = amax / 127, both float32. */
            const __m512 vinv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            __m512i sum = _mm512_setzero_si512();
            for (int64_t c = 0; c < G; c += 16) {  /* 16 inputs: four dwords of weight bytes */
                const int64_t k = g * G + c;
                __m512i r = _mm512_setzero_si512();
                if (k < K)  /* round to nearest even, as torch.round */
                    r = _mm512_cvtps_epi32(_mm512_mul_ps(nb_load16(xr + k, nb_mask(K - k)), vinv));
                sum = _mm512_add_epi32(sum, r);
                /* Input c of the group is the low nibble of the group's byte c (c < half)
                 * or the high nibble of byte c - half: dword j = byte / 4, lane l. */
                const int64_t byte = c < half ? c : c - half;
                int32_t d[4];
                _mm_storeu_si128((__m128i *)d, _mm512_cvtsepi32_epi8(r));
                for (int64_t t = 0; t < 4; t++)
                    memcpy(x8 + (w * D + byte / 4 + t) * 128 + (c < half ? 0 : 64) + 4 * l, &d[t], 4);
            }
            const float sx = amax / 127.0f;
            xv[32 * w + l] = sx;
            xv[32 * w + 16 + l] = sx * (float)_mm512_reduce_add_epi32(sum);
        }
    }
}

static nb_qx nb_q_inputs(int bits, const uint16_t *x, int64_t M, int64_t K, int64_t Kp,
                         int64_t G) {
    nb_qx in;
    memset(&in, 0, sizeof in);
    if (bits == 8) nb_q_inputs_int16(&in, x, M, K, Kp);
    else nb_q_inputs_int8_groups(&in, x, M, K, Kp, G);
    return in;
}

static void nb_q_inputs_free(nb_qx *in) {
    free(in->xq);
    free(in->sx);
    free(in->x8);
    free(in->xv);
}

static inline void nb_store1(void *y, int64_t off, float v, const uint16_t *bias, int64_t n,
                             int out_f32) {
    if (bias) v += nb_bf16_to_f32(bias[n]);
    if (out_f32) ((float *)y)[off] = v;
    else ((uint16_t *)y)[off] = nb_f32_to_bf16(v);
}

/* int8, output rows [n0, n0 + 4) (fewer at the end: n1), one row of x (m): decode.
 *
 * The weight rows are read one after another, each front to back, so a thread's share of
 * the weights is one stream in address order, which the hardware prefetcher follows
 * (nb_q8_rows_mb walks the four rows side by side, four streams 2-8 KiB apart, to widen
 * each weight once for several rows of x). Each 128 inputs load and widen their four
 * chunks of weights before the four vpdpwssd (four chains of sums, which cover its
 * latency). On the AMD host, 16 layers of the 1B shape's linears on one core read 27-28
 * GB/s so against 21 with the rows side by side, 22-26 with each chunk's vpdpwssd right
 * after its load, and 17-22 with the prefetch branch left in the loop, not taken; the
 * 1B shape's int8 decode step took 37.4 against 42.0 ms p50 in a slow spell of the host
 * and 26.5 against 33 ms p10 in a fast one (docs/benchmarks.md, "The int8 decode rows
 * read in order"). PF (a constant where inlined, so the loop without it has no prefetch
 * code): prefetch the same bytes of the block NB_Q_PREFETCH_BLOCKS ahead, where
 * nb_prefetch_rows_ahead says so. The chains' int32 lanes are added exactly before each
 * flush, so the sums are those of nb_q8_rows_mb: the same lanes flushed to float32 at
 * the same inputs, in the same order. */
static inline __attribute__((always_inline)) void nb_q8_row1(
    const nb_qx *in, const int8_t *const wr[4], const char *pf, const float *scales,
    const uint16_t *bias, void *y, int64_t N, int64_t Kp, int out_f32, int64_t n0, int64_t n1,
    int64_t m, const int PF) {
    __m512 accf[4];
    for (int i = 0; i < 4; i++) {
        const int8_t *w = wr[i];
        accf[i] = _mm512_setzero_ps();
        if (n0 + i >= n1) continue; /* past the last row: no sum stored */
        for (int64_t k0 = 0; k0 < Kp; k0 += 32 * NB_Q8_FLUSH) {
            const int64_t k1 = k0 + 32 * NB_Q8_FLUSH < Kp ? k0 + 32 * NB_Q8_FLUSH : Kp;
            __m512i acc[4];
            for (int u = 0; u < 4; u++) acc[u] = _mm512_setzero_si512();
            int64_t k = k0;
            for (; k + 128 <= k1; k += 128) {
                if (PF) {
                    _mm_prefetch(pf + i * Kp + k, NB_STREAM_HINT);
                    _mm_prefetch(pf + i * Kp + k + 64, NB_STREAM_HINT);
                }
                __m512i q[4];
#pragma GCC unroll 4
                for (int u = 0; u < 4; u++)
                    q[u] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + k + 32 * u)));
#pragma GCC unroll 4
                for (int u = 0; u < 4; u++)
                    acc[u] = _mm512_dpwssd_epi32(acc[u], q[u], _mm512_load_si512(in->xq + m * Kp + k + 32 * u));
            }
            for (; k < k1; k += 32) {
                const __m512i q = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + k)));
                acc[0] = _mm512_dpwssd_epi32(acc[0], q, _mm512_load_si512(in->xq + m * Kp + k));
            }
            __m512i t = acc[0];
            for (int u = 1; u < 4; u++) t = _mm512_add_epi32(t, acc[u]);
            accf[i] = _mm512_add_ps(accf[i], _mm512_cvtepi32_ps(t));
        }
    }
    float sums[4];
    _mm_storeu_ps(sums, nb_sum4x16(accf));
    for (int i = 0; i < 4 && n0 + i < n1; i++)
        nb_store1(y, m * N + n0 + i, sums[i] * (scales[n0 + i] * in->sx[m]), bias, n0 + i, out_f32);
}

/* int8, output rows [n0, n0 + 4) (fewer at the end: n1), input rows [m0, m0 + MB), MB
 * 2 to 4 (one row: nb_q8_row1).
 *
 * The four weight rows are widened to int16 once per 32 inputs for all MB rows of x, so
 * each further row of x costs one vpdpwssd per weight row and 32 inputs: against a
 * widening per row as well, 12-31 rows (batched decode) went from slower than the bf16
 * tiles to faster (docs/quantization.md, "Kernels"). Each row's sums are those of
 * nb_q8_row1: the same lanes flushed to float32 at the same inputs, in the same order. */
static inline __attribute__((always_inline)) void nb_q8_rows_mb(
    const nb_qx *in, const int8_t *const wr[4], const char *pf, const float *scales,
    const uint16_t *bias, void *y, int64_t N, int64_t Kp, int out_f32, int64_t n0, int64_t n1,
    int64_t m0, const int MB) {
    __m512 accf[4][4];
    for (int r = 0; r < MB; r++)
        for (int i = 0; i < 4; i++) accf[r][i] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < Kp; k0 += 32 * NB_Q8_FLUSH) {
        const int64_t k1 = k0 + 32 * NB_Q8_FLUSH < Kp ? k0 + 32 * NB_Q8_FLUSH : Kp;
        __m512i acc[4][4];
        for (int r = 0; r < MB; r++)
            for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_si512();
        for (int64_t k = k0; k < k1; k += 32) {
            if (pf) {
                _mm_prefetch(pf + 4 * k, NB_STREAM_HINT);
                _mm_prefetch(pf + 4 * k + 64, NB_STREAM_HINT);
            }
            __m512i q[4];
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
                q[i] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wr[i] + k)));
#pragma GCC unroll 4
            for (int r = 0; r < MB; r++) {
                const __m512i xv = _mm512_load_si512(in->xq + (m0 + r) * Kp + k);
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) acc[r][i] = _mm512_dpwssd_epi32(acc[r][i], q[i], xv);
            }
        }
        for (int r = 0; r < MB; r++)
            for (int i = 0; i < 4; i++) accf[r][i] = _mm512_add_ps(accf[r][i], _mm512_cvtepi32_ps(acc[r][i]));
    }
    for (int r = 0; r < MB; r++) {
        const int64_t m = m0 + r;
        float sums[4];
        _mm_storeu_ps(sums, nb_sum4x16(accf[r]));
        for (int i = 0; i < 4 && n0 + i < n1; i++)
            nb_store1(y, m * N + n0 + i, sums[i] * (scales[n0 + i] * in->sx[m]), bias, n0 + i, out_f32);
    }
}

/* int8, output rows [n0, n0 + 4) (fewer at the end: n1), every input row: four rows of
 * x at a time. */
static void nb_q8_rows(const nb_qx *in, const int8_t *w, const float *scales,
                       const uint16_t *bias, void *y, int64_t M, int64_t N, int64_t Kp,
                       int out_f32, int64_t n0, int64_t n1) {
    const int8_t *wr[4];
    for (int i = 0; i < 4; i++) wr[i] = w + (n0 + i < n1 ? n0 + i : n1 - 1) * Kp;
    /* The first pass over the four rows prefetches the next blocks' (NB_Q_PREFETCH_BLOCKS). */
    const char *pf = (const char *)(w + (n0 + 4 * NB_Q_PREFETCH_BLOCKS) * Kp);
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4, pf = 0)
        nb_q8_rows_mb(in, wr, pf, scales, bias, y, N, Kp, out_f32, n0, n1, m0, 4);
    switch (M - m0) {
    case 3: nb_q8_rows_mb(in, wr, pf, scales, bias, y, N, Kp, out_f32, n0, n1, m0, 3); break;
    case 2: nb_q8_rows_mb(in, wr, pf, scales, bias, y, N, Kp, out_f32, n0, n1, m0, 2); break;
    case 1:  /* decode: the rows in order, prefetched only where that helps. (The test is
              * m0 == 0, not pf, which is the same: testing pf here, GCC laid the one-row
              * loop out so that one core of the AMD host read 16-17 GB/s against 20-26.) */
        if (m0 == 0 && nb_prefetch_rows_ahead())
            nb_q8_row1(in, wr, pf, scales, bias, y, N, Kp, out_f32, n0, n1, m0, 1);
        else
            nb_q8_row1(in, wr, 0, scales, bias, y, N, Kp, out_f32, n0, n1, m0, 0);
        break;
    default: break;
    }
}

/* int4, output rows [n0, n0 + 4) (fewer at the end: n1), input rows [m0, m0 + MB).
 *
 * The block's four rows are one stream: chunk j of a window (64 bytes) of each row in
 * turn, then chunk j + 1 (ops/quant.py lays them out so). The same four rows side by
 * side, four streams a row apart, read 19-20 GB/s from memory on one core of the AMD
 * host with the software prefetches (10 without them); one stream reads 28-30 without
 * them, and on two threads it took the 1B shape's 16 layers from 14.6-15.7 to 9.7-10.6
 * ms (interleaved runs; docs/benchmarks.md, "int4 rows by blocks of four").
 *
 * A window of 16 groups at a time (ops/quant.py lays each row out so): lane l of every
 * 64-byte chunk of the window is a dword of group l, so the int32 lanes of vpdpbusd (64
 * unsigned nibble by signed int8 products each) sum one group each across the whole
 * window, exactly. Per chunk and weight row that is a load and two ANDs (once for all MB
 * rows of x) and two vpdpbusd per row of x; per window, one conversion and two FMAs
 * scale the 16 groups' sums by s_g sx_g and add their zero terms z_g sx_g sum x8. At one
 * row of x the high nibbles stay in place (16 times their value, summed apart and
 * shifted back once per window: exact); at two, registers are short and each chunk
 * shifts them down. Against the layout of eight groups' scales permuted per chunk
 * this reads the 1B shape's int4 decode step 4% faster (29.4-30.1 against 30.5-31.3 ms
 * p50; docs/benchmarks.md, "int4 in windows of 16 groups"). Each row's sums are those of
 * MB = 1, in the same order. */
static inline __attribute__((always_inline)) void nb_q4_rows_mb(
    const nb_qx *in, const uint8_t *blk, const uint16_t *const sr[4], const char *pf,
    const char *pfs, const uint16_t *bias, void *y, int64_t N, int64_t Kp, int64_t G,
    int out_f32, int64_t n0, int64_t n1, int64_t m0, const int MB) {
    const int64_t R = n1 - n0;  /* rows in the block: 4, fewer in the last one */
    const int64_t ng = Kp / G, half = G / 2, D = G / 8;
    const __m512i low4 = _mm512_set1_epi8(15), high4 = _mm512_set1_epi8((char)0xF0);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    __m512 acc[2][4];  /* MB <= 2 */
    for (int r = 0; r < MB; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t g0 = 0, w = 0; g0 < ng; g0 += 16, w++) {
        const int64_t cnt = ng - g0 < 16 ? ng - g0 : 16, base = g0 * half, cs = 4 * cnt;
        const __mmask64 wm = cnt == 16 ? ~(__mmask64)0 : (((__mmask64)1 << (4 * cnt)) - 1);
        /* Chunk j (cs bytes) of the block's row i lies at R (base + j cs) + i cs of the
         * block (ops/quant.py): the four rows' chunks one after another. Rows past R (a
         * last block of fewer rows) read row R - 1 again, their sums unused. */
        const uint8_t *cw = blk + R * base;
        int64_t ro[4];
        for (int i = 0; i < 4; i++) ro[i] = (i < R ? i : R - 1) * cs;
        /* Two sums per row of x at one row (eight chains of vpdpbusd), one at two. */
        __m512i sa[2][4], sb[4];
        for (int i = 0; i < 4; i++) {
            sb[i] = _mm512_setzero_si512();
            for (int r = 0; r < MB; r++) sa[r][i] = _mm512_setzero_si512();
        }
        if (pfs) {  /* the scales 4 row blocks ahead: 4 rows x 16 groups x 4 bytes */
            for (int c = 0; c < 4; c++) _mm_prefetch(pfs + 16 * g0 + 64 * c, NB_STREAM_HINT);
        }
        for (int64_t j = 0; j < D; j++) {
            const uint8_t *cj = cw + j * R * cs;
            if (pf) {  /* the same bytes of the block NB_Q4_PREFETCH_BLOCKS ahead */
                for (int c = 0; c < 4; c++) _mm_prefetch(pf + (cj - blk) + 64 * c, NB_STREAM_HINT);
            }
            __m512i lo[4], hi[4];
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                const __m512i b = _mm512_maskz_loadu_epi8(wm, cj + ro[i]);
                lo[i] = _mm512_and_si512(b, low4);
                hi[i] = MB == 1 ? _mm512_and_si512(b, high4) : _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
            }
#pragma GCC unroll 2
            for (int r = 0; r < MB; r++) {
                const int8_t *xc = in->x8 + (m0 + r) * in->kc + (w * D + j) * 128;
                const __m512i xlo = _mm512_load_si512(xc), xhi = _mm512_load_si512(xc + 64);
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    sa[r][i] = _mm512_dpbusd_epi32(sa[r][i], lo[i], xlo);
                    if (MB == 1) sb[i] = _mm512_dpbusd_epi32(sb[i], hi[i], xhi);
                    else sa[r][i] = _mm512_dpbusd_epi32(sa[r][i], hi[i], xhi);
                }
            }
        }
        /* The window's (s, z) pairs: 32 float16, split into the 16 scales and 16 zeros. */
        const __mmask32 sm = cnt == 16 ? ~(__mmask32)0 : (((__mmask32)1 << (2 * cnt)) - 1);
        __m512 s[4], z[4];
        for (int i = 0; i < 4; i++) {
            const __m512i p = _mm512_maskz_loadu_epi16(sm, sr[i] + 2 * g0);
            const __m512 a = _mm512_cvtph_ps(_mm512_castsi512_si256(p));
            const __m512 b = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(p, 1));
            s[i] = _mm512_permutex2var_ps(a, even, b);
            z[i] = _mm512_permutex2var_ps(a, odd, b);
        }
        for (int r = 0; r < MB; r++) {
            const float *xv = in->xv + (m0 + r) * in->nv + 32 * w;
            const __m512 vs = _mm512_load_ps(xv), vz = _mm512_load_ps(xv + 16);
            for (int i = 0; i < 4; i++) {
                const __m512i t = MB == 1 ? _mm512_add_epi32(sa[r][i], _mm512_srai_epi32(sb[i], 4)) : sa[r][i];
                acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(s[i], vs), acc[r][i]);
                acc[r][i] = _mm512_fmadd_ps(z[i], vz, acc[r][i]);
            }
        }
    }
    for (int r = 0; r < MB; r++) {
        float sums[4];
        _mm_storeu_ps(sums, nb_sum4x16(acc[r]));
        for (int i = 0; i < 4 && n0 + i < n1; i++)
            nb_store1(y, (m0 + r) * N + n0 + i, sums[i], bias, n0 + i, out_f32);
    }
}

/* int4, output rows [n0, n0 + 4) (fewer at the end: n1), every input row: two rows of
 * x at a time (four spilled registers and ran slower at 16-32 rows). */
static void nb_q4_rows(const nb_qx *in, const uint8_t *w, const uint16_t *sz,
                       const uint16_t *bias, void *y, int64_t M, int64_t N, int64_t Kp,
                       int64_t G, int out_f32, int64_t n0, int64_t n1) {
    const int64_t ng = Kp / G, rowb = Kp / 2;
    const uint8_t *blk = w + n0 * rowb;  /* the block's rows, their chunks interleaved */
    const uint16_t *sr[4];
    for (int i = 0; i < 4; i++) sr[i] = sz + (n0 + i < n1 ? n0 + i : n1 - 1) * ng * 2;
    /* The first pass over the block prefetches its scales and the block
     * NB_Q4_PREFETCH_BLOCKS on: always for more than one row of x, and for one where
     * nb_prefetch_rows_ahead says so. (On the AMD host, with two rows or more each block computes long
     * enough that the hardware prefetcher alone falls behind: four 1B layers on two
     * threads took 3.4 ms at 2 rows and 55-57 at 64 without, 2.7-3.0 and 53.5-54 with, as
     * with the rows side by side; at one row, no prefetch reads 28-30 GB/s against 20.) */
    const char *pf = M > 1 || nb_prefetch_rows_ahead()
                         ? (const char *)(w + (n0 + 4 * NB_Q4_PREFETCH_BLOCKS) * rowb)
                         : 0;
    const char *pfs = (const char *)(sz + (n0 + 4 * NB_Q4_PREFETCH_BLOCKS) * ng * 2);
    int64_t m0 = 0;
    for (; m0 + 2 <= M; m0 += 2, pf = pfs = 0)
        nb_q4_rows_mb(in, blk, sr, pf, pfs, bias, y, N, Kp, G, out_f32, n0, n1, m0, 2);
    if (m0 < M)
        nb_q4_rows_mb(in, blk, sr, pf, pfs, bias, y, N, Kp, G, out_f32, n0, n1, m0, 1);
}

/* 16 vectors of 16 32-bit lanes transposed in place: r[i][j] <-> r[j][i]. */
static inline void nb_transpose16_epi32(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 16; i += 2) {
        a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* b[4g + j], lane L: rows 4g .. 4g + 3, element 4L + j */
    for (int g = 0; g < 16; g += 4) {
        b[g] = _mm512_unpacklo_epi64(a[g], a[g + 2]);
        b[g + 1] = _mm512_unpackhi_epi64(a[g], a[g + 2]);
        b[g + 2] = _mm512_unpacklo_epi64(a[g + 1], a[g + 3]);
        b[g + 3] = _mm512_unpackhi_epi64(a[g + 1], a[g + 3]);
    }
    for (int j = 0; j < 4; j++) { /* a 4 x 4 transpose of 128-bit lanes */
        const __m512i c0 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x44);
        const __m512i c1 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xEE);
        const __m512i c2 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x44);
        const __m512i c3 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xEE);
        r[j] = _mm512_shuffle_i32x4(c0, c2, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
        r[8 + j] = _mm512_shuffle_i32x4(c1, c3, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
    }
}

/* One window of 16 groups of int4 weights (G = 64) put back in order: in, dword j of
 * group l at dword l of chunk j (64 bytes at in + stride j); out, group l's 32 bytes at
 * 32 l. A transpose of 32-bit lanes, in two steps of in-lane unpacks that leave 128-bit
 * lane q of v[x] (of v[4 + x]) with dwords 0-3 (4-7) of group 4 q + x, then one permute
 * per two groups. */
static inline void nb_q4_window_g64(const uint8_t *in, int64_t stride, uint8_t *out) {
    __m512i c[8], u[8], v[8];
    for (int j = 0; j < 8; j++) c[j] = _mm512_loadu_si512(in + stride * j);
    for (int j = 0; j < 8; j += 2) {
        u[j] = _mm512_unpacklo_epi32(c[j], c[j + 1]);
        u[j + 1] = _mm512_unpackhi_epi32(c[j], c[j + 1]);
    }
    for (int h = 0; h < 8; h += 4) {  /* h = 0: dwords 0-3 (v[0..3]), h = 4: 4-7 (v[4..7]) */
        v[h] = _mm512_unpacklo_epi64(u[h], u[h + 2]);
        v[h + 1] = _mm512_unpackhi_epi64(u[h], u[h + 2]);
        v[h + 2] = _mm512_unpacklo_epi64(u[h + 1], u[h + 3]);
        v[h + 3] = _mm512_unpackhi_epi64(u[h + 1], u[h + 3]);
    }
    const __m512i lanes01 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i lanes23 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int x = 0; x < 4; x++) {  /* groups x, 4 + x, then 8 + x, 12 + x */
        const __m512i a = _mm512_permutex2var_epi64(v[x], lanes01, v[4 + x]);
        const __m512i b = _mm512_permutex2var_epi64(v[x], lanes23, v[4 + x]);
        _mm256_storeu_si256((__m256i *)(out + 32 * x), _mm512_castsi512_si256(a));
        _mm256_storeu_si256((__m256i *)(out + 32 * (4 + x)), _mm512_extracti64x4_epi64(a, 1));
        _mm256_storeu_si256((__m256i *)(out + 32 * (8 + x)), _mm512_castsi512_si256(b));
        _mm256_storeu_si256((__m256i *)(out + 32 * (12 + x)), _mm512_extracti64x4_epi64(b, 1));
    }
}

/* As nb_q4_window_g64 for G = 32: four chunks, v[x] lane q = group 4 q + x, and a 4 x 4
 * transpose of 128-bit lanes puts groups 4 q .. 4 q + 3 in one vector. */
static inline void nb_q4_window_g32(const uint8_t *in, int64_t stride, uint8_t *out) {
    __m512i c[4], u[4], v[4];
    for (int j = 0; j < 4; j++) c[j] = _mm512_loadu_si512(in + stride * j);
    u[0] = _mm512_unpacklo_epi32(c[0], c[1]);
    u[1] = _mm512_unpackhi_epi32(c[0], c[1]);
    u[2] = _mm512_unpacklo_epi32(c[2], c[3]);
    u[3] = _mm512_unpackhi_epi32(c[2], c[3]);
    v[0] = _mm512_unpacklo_epi64(u[0], u[2]);
    v[1] = _mm512_unpackhi_epi64(u[0], u[2]);
    v[2] = _mm512_unpacklo_epi64(u[1], u[3]);
    v[3] = _mm512_unpackhi_epi64(u[1], u[3]);
    const __m512i t0 = _mm512_shuffle_i32x4(v[0], v[1], 0x44), t1 = _mm512_shuffle_i32x4(v[0], v[1], 0xEE);
    const __m512i t2 = _mm512_shuffle_i32x4(v[2], v[3], 0x44), t3 = _mm512_shuffle_i32x4(v[2], v[3], 0xEE);
    _mm512_storeu_si512(out, _mm512_shuffle_i32x4(t0, t2, 0x88));
    _mm512_storeu_si512(out + 64, _mm512_shuffle_i32x4(t0, t2, 0xDD));
    _mm512_storeu_si512(out + 128, _mm512_shuffle_i32x4(t1, t3, 0x88));
    _mm512_storeu_si512(out + 192, _mm512_shuffle_i32x4(t1, t3, 0xDD));
}

/* Row i of a block of R int4 rows (blk: Kp / 2 bytes a row, in windows of 16 groups and
 * by blocks of four rows, ops/quant.py) with its groups' bytes put back in order into
 * out: group g's G / 2 bytes at g G / 2, what the dequantizing loops below read. Dword j
 * of group l of a window of cnt groups lies at dword l of the row's chunk j, and that
 * chunk (4 cnt bytes) at R (g0 G / 2 + 4 cnt j) + 4 cnt i of the block. Full windows of
 * G = 64 and 32 (the modes') take the transposes above; others, and the last window when
 * partial, a 16 x 16 transpose. On the Intel host this costs the AMX int4 product 4% of
 * its time at 16 rows and 7% at 64 (docs/benchmarks.md, "int4 in windows of 16 groups").
 * `ahead`: prefetch each chunk this many bytes on (0: none). */
static void nb_q4_row_bytes(const uint8_t *blk, int64_t R, int64_t i, int64_t Kp, int64_t G,
                            uint8_t *out, int64_t ahead) {
    const int64_t ng = Kp / G, half = G / 2, dwords = half / 4;
    for (int64_t g0 = 0; g0 < ng; g0 += 16) {
        const int64_t cnt = ng - g0 < 16 ? ng - g0 : 16, cs = 4 * cnt;
        const uint8_t *row = blk + R * g0 * half + i * cs;  /* chunk j at row + R cs j */
        if (ahead)
            for (int64_t j = 0; j < dwords; j++)
                _mm_prefetch((const char *)(row + R * cs * j + ahead), _MM_HINT_T0);
        if (cnt == 16 && G == 64) {
            nb_q4_window_g64(row, R * cs, out + g0 * half);
            continue;
        }
        if (cnt == 16 && G == 32) {
            nb_q4_window_g32(row, R * cs, out + g0 * half);
            continue;
        }
        const __mmask16 lanes = nb_mask(cnt);
        for (int64_t j0 = 0; j0 < dwords; j0 += 16) {
            const int64_t nd = dwords - j0 < 16 ? dwords - j0 : 16;
            __m512i r[16];
            for (int64_t j = 0; j < 16; j++)
                r[j] = j < nd ? _mm512_maskz_loadu_epi32(lanes, row + R * cs * (j0 + j))
                              : _mm512_setzero_si512();
            nb_transpose16_epi32(r);
            for (int64_t l = 0; l < cnt; l++)
                _mm512_mask_storeu_epi32(out + (g0 + l) * half + 4 * j0, nb_mask(nd), r[l]);
        }
    }
}

/* Row n of int4 weights dequantized to bf16 into `row` (Kp values; float32 arithmetic as
 * ops/quant.py's dequantize, u s + z, rounded to nearest even), by table: a group's 16
 * possible values are made once, in one vector, and each nibble picks its value with a
 * word permute: per 64 weights a widening load, two masks and two permutes, where
 * converting each weight on its own costs twice as many instructions. The row's bytes
 * are first put back in group order (nb_q4_row_bytes). */
static void nb_q4_dequant_row_lut(const uint8_t *w, const uint16_t *sz, int64_t N, int64_t Kp,
                                  int64_t G, int64_t n, uint16_t *row) {
    const int64_t b0 = n - n % 4, R = N - b0 < 4 ? N - b0 : 4;
    uint8_t wr[Kp / 2];
    /* Prefetching the row 16 on, which the AMX path's thread dequantizes next (its blocks
     * are consecutive): 74-78 against 85-90 ms at 16 rows of the 1B shape, interleaved
     * A/B. (Elsewhere rows go one by one: 16 rows ahead.) Its chunks lie 16 rows of bytes
     * after this row's, four blocks on. */
    nb_q4_row_bytes(w + b0 * (Kp / 2), R, n - b0, Kp, G, wr, 16 * (Kp / 2));
    const uint16_t *p = sz + n * (Kp / G) * 2;
    const int64_t half = G / 2;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i low4 = _mm512_set1_epi16(15);
    for (int64_t g = 0; g < Kp / G; g++) {
        const __m512 v = _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(nb_f16_to_f32(p[2 * g]))),
                                       _mm512_set1_ps(nb_f16_to_f32(p[2 * g + 1])));
        const __m512i lut = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(v));
        for (int64_t c = 0; c < half; c += 32) {
            const __mmask32 mk = nb_mask32(half - c);
            const __m512i b = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mk, wr + g * half + c));
            _mm512_mask_storeu_epi16(row + g * G + c, mk,
                                     _mm512_permutexvar_epi16(_mm512_and_si512(b, low4), lut));
            _mm512_mask_storeu_epi16(row + g * G + half + c, mk,
                                     _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), lut));
        }
    }
}

/* Dequantize weight row n to bf16 into `row` (Kp values; float32 arithmetic as
 * ops/quant.py's dequantize, rounded to nearest even; int4 by table, above). */
static void nb_q_dequant_row(int bits, const void *w, const void *scales, int64_t N, int64_t Kp,
                             int64_t G, int64_t n, uint16_t *row) {
    if (bits == 8) {
        const int8_t *wr = (const int8_t *)w + n * Kp;
        const __m512 s = _mm512_set1_ps(((const float *)scales)[n]);
        for (int64_t k = 0; k < Kp; k += 16) {
            const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wr + k))));
            _mm256_storeu_si256((__m256i *)(row + k), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(q, s)));
        }
        return;
    }
    nb_q4_dequant_row_lut((const uint8_t *)w, (const uint16_t *)scales, N, Kp, G, n, row);
}

/* Dequantize output tile t (64 features, zero past N) to bf16 in the VNNI layout, 16
 * features at a time: their rows into `rows` (NB_Q_TILE_ROW_BUF: 16 rows of Kp values),
 * then each 16 x 16 block of (2p, 2p + 1) pairs transposed into place. Placing the pairs
 * one 4-byte store at a time took as long as the products themselves below about 64 rows
 * of x (2026-12-04, the AMD host: 5.7 ms a 16384 x 2048 weight on two threads). */
#define NB_Q_TILE_ROW_BUF(Kp) ((size_t)(16 * (Kp) * 2))
static void nb_q_dequant_tile(int bits, const void *w, const void *scales, int64_t N, int64_t K,
                              int64_t Kp, int64_t G, int64_t t, uint16_t *buf, uint16_t *rows) {
    uint32_t *b32 = (uint32_t *)buf;
    const uint32_t *r32 = (const uint32_t *)rows;
    const int64_t pairs = K / 2, stride = Kp / 2;  /* Kp is even: a multiple of 32 or G */
    for (int64_t j0 = 0; j0 < NB_TILE; j0 += 16) {
        for (int64_t i = 0; i < 16; i++) {
            const int64_t n = t * NB_TILE + j0 + i;
            if (n < N) nb_q_dequant_row(bits, w, scales, N, Kp, G, n, rows + i * Kp);
            else memset(rows + i * Kp, 0, (size_t)(K * 2));
        }
        int64_t p = 0;
        for (; p + 16 <= pairs; p += 16) {
            __m512i r[16];
            for (int64_t i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(r32 + i * stride + p);
            nb_transpose16_epi32(r);
            for (int64_t c = 0; c < 16; c++) _mm512_store_si512(b32 + (p + c) * NB_TILE + j0, r[c]);
        }
        for (; p < pairs; p++)
            for (int64_t i = 0; i < 16; i++) b32[p * NB_TILE + j0 + i] = r32[i * stride + p];
    }
}

/* Rows [n0, n1) of the weight (N rows) dequantized to a plain bf16 matrix out [n1 - n0, K]:
 * what products of many rows multiply (ops/quant.py, QuantLinear: in oneDNN on AMX CPUs). */
void nb_dequantize_bf16(int bits, const void *w, const void *scales, uint16_t *out, int64_t n0,
                        int64_t n1, int64_t N, int64_t K, int64_t Kp, int64_t G, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        uint16_t *row = (uint16_t *)aligned_alloc(64, (size_t)((Kp * 2 + 63) / 64 * 64));
#pragma omp for schedule(static)
        for (int64_t n = n0; n < n1; n++) {
            nb_q_dequant_row(bits, w, scales, N, Kp, G, n, row);
            memcpy(out + (n - n0) * K, row, (size_t)(K * 2));
        }
        free(row);
    }
}

/* ---- Quantized products of many rows on AMX tiles ----
 *
 * The row kernels above cost in proportion to the rows: at 16 rows a 1B model's linears
 * are compute bound at several times the weights' read time. From NB_Q_AMX_ROWS rows of
 * x on, where AMX tiles are usable and the caller asks (`amx`), the products run on
 * tiles instead, 16 output features by 16 rows of x per instruction, and each further
 * 16 rows cost one or two tile products per block of weights:
 *
 * int8 (nb_linear_q8_amx): the weights as they lie in memory are the tiles' A operand
 * and the sums are the row kernels' exact integer sums (details there).
 *
 * int4 (nb_linear_q4_amx): multiplied as the dense path of ops/quant.py multiplies
 * them (x as it is, the weights dequantized to bf16, float32 sums), but without ever
 * writing the bf16 weight to memory: each thread dequantizes 16 output features at a
 * time (nb_q4_dequant_row_lut: the values of nb_dequantize_bf16) into a buffer that
 * stays in its cache, and multiplies them by every row of x with TDPBF16PS (16 by 16 by
 * 32 inputs). The dequantized block is the A operand as it lies (16 rows of 32 inputs),
 * so x goes in as B: transposed once per call into pairs, for each tile of 16 rows of x
 * and each 32 inputs, 16 pairs of inputs by 16 rows (the VNNI layout).
 *
 * Either way the sums are y^T tiles [16 features, 16 rows], transposed back as they are
 * stored, and a row's result depends on that row alone (AMX sums each row of a tile on
 * its own, in a fixed order), whatever M is and however the features are split between
 * threads. */
#define NB_Q_AMX_ROWS 16
#define NB_Q_AMX_GROUP 4 /* row tiles whose sums stay in tile registers at once */

/* x [M, K] as B operands: xt [ceil(M / 16), Kp / 2, 16] pairs (uint32), zero past M and
 * K; the block of row tile t and inputs 32 s .. 32 s + 31 is 1 KiB at
 * xt + (t * Kp / 2 + 16 s) * 16. Blocks [b0, b1) of the ceil(M / 16) * Kp / 32. */
static void nb_q_amx_inputs(const uint16_t *x, int64_t M, int64_t K, int64_t Kp, uint32_t *xt,
                            int64_t b0, int64_t b1) {
    const int64_t ks = Kp / 32;
    for (int64_t blk = b0; blk < b1; blk++) {
        const int64_t t = blk / ks, s = blk % ks, k = 32 * s;
        const __mmask32 mk = k < K ? nb_mask32(K - k) : 0;
        __m512i r[16];
        for (int i = 0; i < 16; i++)
            r[i] = 16 * t + i < M ? _mm512_maskz_loadu_epi16(mk, x + (16 * t + i) * K + k)
                                  : _mm512_setzero_si512();
        nb_transpose16_epi32(r);
        uint32_t *o = xt + (t * Kp / 2 + 16 * s) * 16;
        for (int p = 0; p < 16; p++) _mm512_store_si512(o + 16 * p, r[p]);
    }
}

/* y[rows 16 t .., features n0 ..] from r, a y^T tile [16 features, 16 rows] of float32
 * (transposed in place). */
static void nb_q_amx_store_rows(__m512i r[16], void *y, const uint16_t *bias, int64_t M,
                                int64_t N, int64_t t, int64_t n0, int out_f32) {
    nb_transpose16_epi32(r);
    for (int i = 0; i < 16 && 16 * t + i < M; i++)
        nb_store16(y, (16 * t + i) * N + n0, N - n0, _mm512_castsi512_ps(r[i]),
                   bias ? bias + n0 : 0, out_f32);
}

/* y[rows 16 t .., features n0 ..] from the y^T tile `c` [16 features, 16 rows]. */
static void nb_q_amx_store(const float *c, void *y, const uint16_t *bias, int64_t M, int64_t N,
                           int64_t t, int64_t n0, int out_f32) {
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(c + 16 * i);
    nb_q_amx_store_rows(r, y, bias, M, N, t, n0, out_f32);
}

/* Row tiles g0 .. g0 + ng - 1 (ng <= NB_Q_AMX_GROUP) times the dequantized block `a`
 * [16, Kp] (row stride `lda` values): sums in tiles 0-3, the block's 32 inputs in tile
 * 4, the rows' pairs in tiles 5-7 (in turn). */
__attribute__((target("amx-tile,amx-bf16"))) static void nb_q_amx_group(
    const uint16_t *a, int64_t lda, const uint32_t *xt, int64_t Kp, int64_t g0, int64_t ng,
    float *c) {
    const int64_t ks = Kp / 32, tile = Kp / 2 * 16; /* uint32 of one row tile's pairs */
    const uint32_t *x0 = xt + g0 * tile;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < ks; s++) {
        _tile_loadd(4, a + 32 * s, lda * 2);
        _tile_loadd(5, x0 + 256 * s, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (ng > 1) {
            _tile_loadd(6, x0 + tile + 256 * s, 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (ng > 2) {
            _tile_loadd(7, x0 + 2 * tile + 256 * s, 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (ng > 3) {
            _tile_loadd(5, x0 + 3 * tile + 256 * s, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, c, 64);
    if (ng > 1) _tile_stored(1, c + 256, 64);
    if (ng > 2) _tile_stored(2, c + 512, 64);
    if (ng > 3) _tile_stored(3, c + 768, 64);
}

__attribute__((target("amx-tile"))) static void nb_q_amx_tiles(int on) {
    if (on) {
        nb_tile_config cfg;
        nb_tile_config_full(&cfg);
        nb_tile_load_config(&cfg);
    } else {
        _tile_release();
    }
}

/* Scratch that lives from call to call (fresh memory is slow to first touch on this
 * project's VMs; ops/quant.py, _DenseScratch): one buffer per thread, grown as needed. */
static void *nb_scratch(void **buf, size_t *cap, size_t need) {
    if (*cap < need) {
        free(*buf);
        *cap = (need + 4095) / 4096 * 4096;
        *buf = aligned_alloc(64, *cap);
    }
    return *buf;
}

/* ---- bfloat16 weights on AMX tiles ----
 *
 * The packed layout of nb_linear_bf16 ([N / 64, K / 2, 64, 2]) is, read 16 features at a
 * time, already the B operand of TDPBF16PS: a B tile is 16 pairs of inputs (its rows) by
 * 16 features' pairs (64 bytes), and those 64 bytes lie at 256-byte strides. So the
 * weights are multiplied where they lie, with no second copy in another layout (what
 * the oneDNN twin of ops/linear.py is). x is copied once per call into A tiles of 16
 * rows by 32 inputs (nb_bf16_amx_inputs), and the sums come out as y tiles [16 rows,
 * 16 features].
 *
 * Work items are (a tile of 64 features, up to NB_BF16_AMX_GROUP row tiles); a static
 * schedule gives each thread consecutive feature tiles with all their rows, so a thread
 * reads its weights from memory once, and its 64-feature tile (128 K bytes) from its L2
 * cache for every further row tile. Each step of 32 inputs multiplies one row tile by
 * the four feature tiles. Measured over the 1B shape's linears (2 threads, interleaved,
 * ms per pass at 16 / 32 / 128 / 512 rows): 102 / 131 / 263 / 883, against 101 / 139 /
 * 306 / 906 with two row tiles by two feature tiles per step, worse still with the sums
 * kept across chunks of 256 inputs (to keep the weights' chunk in L1).
 *
 * Sums are float32, each row's in a fixed order that does not depend on M or on the
 * threads (AMX sums each row of a tile on its own), as the quantized tiles above; but
 * not the order of the dpbf16 kernels above, which take fewer rows. So the caller's
 * NB_BF16_AMX_ROWS is where a row's rounding may change (ops/native.py, BF16_AMX_ROWS). */
#define NB_BF16_AMX_ROWS 12
#define NB_BF16_AMX_GROUP 8

static int nb_bf16_amx_fits(int64_t M, int64_t K) {
    return M >= NB_BF16_AMX_ROWS && K % 32 == 0 && nb_amx_usable();
}

/* One row tile a0 (nb_bf16_amx_inputs' layout) times the four feature tiles of the
 * 64-feature tile b over ks steps of 32 inputs: the sums c [4][16][16], one y tile per 16
 * features. Sums in tiles 0-3, A in 4, B in 5-7 (the fourth feature tile's in 5 again). */
__attribute__((target("amx-tile,amx-bf16"))) static void nb_bf16_amx_row_tile(
    const uint16_t *a0, const uint16_t *b, int64_t ks, float *c) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < ks; s++) {
        const uint16_t *bs = b + s * 16 * NB_TILE * 2;
        _tile_loadd(4, a0 + 512 * s, 64);
        _tile_loadd(5, bs, NB_TILE * 4);
        _tile_loadd(6, bs + 32, NB_TILE * 4);
        _tile_loadd(7, bs + 64, NB_TILE * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, bs + 96, NB_TILE * 4);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
}

/* y[rows r0 .. r0 + 15 (those below M), features n0 .. n0 + 15] from the y tile c. */
static inline void nb_bf16_amx_store(const float *c, void *y, const uint16_t *bias, int64_t M,
                                     int64_t N, int64_t r0, int64_t n0, int out_f32) {
    for (int64_t i = 0; i < 16 && r0 + i < M; i++)
        nb_store16(y, (r0 + i) * N + n0, N - n0, _mm512_load_ps(c + 16 * i),
                   bias ? bias + n0 : 0, out_f32);
}

/* x [M, K] as A operands: xa [ceil(M / 16), K / 32, 16 rows, 32 inputs], zero past M: each
 * tile a contiguous 1 KiB (x's own rows are K * 2 bytes apart, which for K a multiple of
 * 2048 puts a tile's 16 rows in one set of the L1 cache). Blocks [b0, b1) of the
 * ceil(M / 16) * K / 32. */
static void nb_bf16_amx_inputs(const uint16_t *x, int64_t M, int64_t K, uint16_t *xa, int64_t b0,
                               int64_t b1) {
    const int64_t ks = K / 32;
    for (int64_t blk = b0; blk < b1; blk++) {
        const int64_t t = blk / ks, s = blk % ks;
        uint16_t *o = xa + blk * 512;
        for (int64_t i = 0; i < 16; i++) {
            const __m512i v = 16 * t + i < M ? _mm512_loadu_si512(x + (16 * t + i) * K + 32 * s)
                                             : _mm512_setzero_si512();
            _mm512_store_si512(o + 32 * i, v);
        }
    }
}

static void nb_linear_bf16_amx(const uint16_t *x, const uint16_t *w_packed, const uint16_t *bias,
                               void *y, int64_t M, int64_t N, int64_t K, int out_f32,
                               int nthreads) {
    static __thread void *xa_buf;
    static __thread size_t xa_cap;
    const int64_t ntiles = (N + NB_TILE - 1) / NB_TILE, mt = (M + 15) / 16;
    const int64_t groups = (mt + NB_BF16_AMX_GROUP - 1) / NB_BF16_AMX_GROUP, ks = K / 32;
    uint16_t *xa = (uint16_t *)nb_scratch(&xa_buf, &xa_cap, (size_t)(mt * 16 * K * 2));
#pragma omp parallel num_threads(nthreads)
    {
        float c[1024] __attribute__((aligned(64)));
        const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        nb_bf16_amx_inputs(x, M, K, xa, mt * ks * tid / nt, mt * ks * (tid + 1) / nt);
#pragma omp barrier
        nb_q_amx_tiles(1);
#pragma omp for collapse(2) schedule(static)
        for (int64_t t = 0; t < ntiles; t++) {
            for (int64_t g = 0; g < groups; g++) {
                const uint16_t *wt = w_packed + t * (K / 2) * NB_TILE * 2;
                const int64_t i0 = g * NB_BF16_AMX_GROUP;
                const int64_t i1 = i0 + NB_BF16_AMX_GROUP < mt ? i0 + NB_BF16_AMX_GROUP : mt;
                for (int64_t i = i0; i < i1; i++) {
                    nb_bf16_amx_row_tile(xa + i * 16 * K, wt, ks, c);
                    for (int64_t j = 0; j < 4; j++)
                        nb_bf16_amx_store(c + 256 * j, y, bias, M, N, 16 * i,
                                          t * NB_TILE + 16 * j, out_f32);
                }
            }
        }
        nb_q_amx_tiles(0);
    }
}

/* ---- int8 weights on AMX int8 tiles ----
 *
 * int8 weights need no dequantization at all: the tiles' A operand is the weight block
 * as it lies in memory (16 output features by 64 int8 inputs, TDPBSSD multiplying int8
 * pairs of four into int32 sums). x is scaled to int16 per row as for the row kernels
 * (nb_q_inputs_int16) and split into a signed high and an unsigned low byte, xq = 256 hi
 * + lo, so each 64 inputs of a row tile cost two tile products (TDPBSSD for hi, TDPBSUD
 * for lo) and the integer sums are exact, as the row kernels' are: y = s[n] sx[m] (256
 * sum(q hi) + sum(q lo)), the two int32 sums (each below 2^31 up to K = 65536) converted
 * to float32. Only the conversion differs from the row kernels (one rounding of each
 * sum, where those flush to float32 every 2048 inputs), so the values are theirs to
 * float32 rounding, from 16 rows on as below. */

/* Bytes of x's B operands: [ceil(M / 16), K64 / 64, 16 quads, 16 rows, 4] for the high
 * and the low bytes (K64: Kp rounded up to 64). Blocks [b0, b1). */
static void nb_q8_amx_inputs(const nb_qx *in, int64_t M, int64_t Kp, int64_t K64, uint8_t *hi,
                             uint8_t *lo, int64_t b0, int64_t b1) {
    const int64_t ks = K64 / 64;
    for (int64_t blk = b0; blk < b1; blk++) {
        const int64_t t = blk / ks, k = 64 * (blk % ks);
        const __mmask32 m0 = k < Kp ? nb_mask32(Kp - k) : 0;
        const __mmask32 m1 = k + 32 < Kp ? nb_mask32(Kp - k - 32) : 0;
        __m512i h[16], l[16];
        for (int i = 0; i < 16; i++) {
            __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
            if (16 * t + i < M) {
                const int16_t *r = in->xq + (16 * t + i) * Kp + k;
                a = _mm512_maskz_loadu_epi16(m0, r);
                b = _mm512_maskz_loadu_epi16(m1, r + 32);
            }
            h[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srai_epi16(a, 8))),
                                      _mm512_cvtepi16_epi8(_mm512_srai_epi16(b, 8)), 1);
            l[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(a)),
                                      _mm512_cvtepi16_epi8(b), 1);
        }
        nb_transpose16_epi32(h);
        nb_transpose16_epi32(l);
        for (int p = 0; p < 16; p++) {
            _mm512_store_si512(hi + blk * 1024 + 64 * p, h[p]);
            _mm512_store_si512(lo + blk * 1024 + 64 * p, l[p]);
        }
    }
}

/* Row tiles g0, g0 + 1 (ng of them) times the weight block `a` [16, K64] (row stride
 * `lda` bytes): tiles 0-3 the (hi, lo) sums of each row tile, tile 4 the block's 64
 * inputs, tiles 5-7 the rows' bytes (in turn). */
__attribute__((target("amx-tile,amx-int8"))) static void nb_q8_amx_group(
    const int8_t *a, int64_t lda, const uint8_t *hi, const uint8_t *lo, int64_t K64, int64_t g0,
    int64_t ng, int32_t *c) {
    const int64_t ks = K64 / 64, tile = ks * 1024;
    const uint8_t *h0 = hi + g0 * tile, *l0 = lo + g0 * tile;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < ks; s++) {
        _tile_loadd(4, a + 64 * s, lda);
        _tile_loadd(5, h0 + 1024 * s, 64);
        _tile_dpbssd(0, 4, 5);
        _tile_loadd(6, l0 + 1024 * s, 64);
        _tile_dpbsud(1, 4, 6);
        if (ng > 1) {
            _tile_loadd(7, h0 + tile + 1024 * s, 64);
            _tile_dpbssd(2, 4, 7);
            _tile_loadd(5, l0 + tile + 1024 * s, 64);
            _tile_dpbsud(3, 4, 5);
        }
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    if (ng > 1) {
        _tile_stored(2, c + 512, 64);
        _tile_stored(3, c + 768, 64);
    }
}

/* y[rows 16 t .., features n0 ..] from the tile's (hi, lo) sums [16 features, 16 rows]. */
static void nb_q8_amx_store(const int32_t *c, const float *scales, const float *sx, void *y,
                            const uint16_t *bias, int64_t M, int64_t N, int64_t t, int64_t n0,
                            int out_f32) {
    const __m512 sxv = _mm512_maskz_loadu_ps(nb_mask(M - 16 * t), sx + 16 * t);
    __m512i r[16];
    for (int j = 0; j < 16; j++) {
        const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * j)),
                                         _mm512_set1_ps(256.0f),
                                         _mm512_cvtepi32_ps(_mm512_load_si512(c + 256 + 16 * j)));
        const float sn = n0 + j < N ? scales[n0 + j] : 0.0f;
        r[j] = _mm512_castps_si512(_mm512_mul_ps(v, _mm512_mul_ps(_mm512_set1_ps(sn), sxv)));
    }
    nb_q_amx_store_rows(r, y, bias, M, N, t, n0, out_f32);
}

static void nb_linear_q8_amx(const uint16_t *x, const int8_t *w, const float *scales,
                             const uint16_t *bias, void *y, int64_t M, int64_t N, int64_t K,
                             int64_t Kp, int out_f32, int nthreads) {
    static __thread void *x_buf;
    static __thread size_t x_cap;
    const int64_t mt = (M + 15) / 16, nblocks = (N + 15) / 16, K64 = (Kp + 63) / 64 * 64;
    const int64_t xbytes = mt * K64 * 16;
    uint8_t *hi = (uint8_t *)nb_scratch(&x_buf, &x_cap, (size_t)(2 * xbytes)), *lo = hi + xbytes;
    nb_qx in = nb_q_inputs(8, x, M, K, Kp, 0);
    /* Blocks whose rows the tiles cannot read in place (past N, or a last 32 inputs past
     * the rows' end when Kp is not a multiple of 64) are copied, zero-padded. */
    const int staged_all = K64 != Kp;
#pragma omp parallel num_threads(nthreads)
    {
        static __thread void *a_buf, *c_buf;
        static __thread size_t a_cap, c_cap;
        int8_t *stage = (int8_t *)nb_scratch(&a_buf, &a_cap, (size_t)(16 * K64));
        int32_t *c = (int32_t *)nb_scratch(&c_buf, &c_cap, sizeof(int32_t) * 4 * 256);
        const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t xb = mt * (K64 / 64);
        nb_q8_amx_inputs(&in, M, Kp, K64, hi, lo, xb * tid / nt, xb * (tid + 1) / nt);
#pragma omp barrier
        nb_q_amx_tiles(1);
        /* Beyond 64 rows, chunks of nbc blocks (about 512 KiB of weights, which stay in
         * L2 while every pair of row tiles passes over them): the rows' bytes are then
         * read once per chunk, not once per block (at 512 rows and K = 2048 they are 2
         * MiB). At the 1B shape, 2 threads: 1058 -> 812 ms at 512 rows, 489 -> 409 at
         * 256; at 64 rows block by block was faster (111 against 124). At least one
         * chunk per thread. */
        int64_t nbc = mt > 4 && 512 * 1024 / (16 * K64) > 1 ? 512 * 1024 / (16 * K64) : 1;
        if (nbc > (nblocks + nt - 1) / nt) nbc = (nblocks + nt - 1) / nt;
#pragma omp for schedule(static)
        for (int64_t ch = 0; ch < (nblocks + nbc - 1) / nbc; ch++) {
            const int64_t b1 = (ch + 1) * nbc < nblocks ? (ch + 1) * nbc : nblocks;
            for (int64_t g0 = 0; g0 < mt; g0 += 2) {
                const int64_t ng = mt - g0 < 2 ? mt - g0 : 2;
                for (int64_t nb = ch * nbc; nb < b1; nb++) {
                    const int64_t n0 = 16 * nb;
                    const int8_t *a = w + n0 * Kp;
                    int64_t lda = Kp;
                    if (staged_all || n0 + 16 > N) {
                        for (int64_t j = 0; j < 16; j++) {
                            int8_t *r = stage + j * K64;
                            memset(r, 0, (size_t)K64);
                            if (n0 + j < N) memcpy(r, w + (n0 + j) * Kp, (size_t)Kp);
                        }
                        a = stage;
                        lda = K64;
                    }
                    nb_q8_amx_group(a, lda, hi, lo, K64, g0, ng, c);
                    for (int64_t t = 0; t < ng; t++)
                        nb_q8_amx_store(c + 512 * t, scales, in.sx, y, bias, M, N, g0 + t, n0,
                                        out_f32);
                }
            }
        }
        nb_q_amx_tiles(0);
    }
    nb_q_inputs_free(&in);
}

static void nb_linear_q4_amx(const uint16_t *x, const uint8_t *w, const uint16_t *sz,
                             const uint16_t *bias, void *y, int64_t M, int64_t N, int64_t K,
                             int64_t Kp, int64_t G, int out_f32, int nthreads) {
    static __thread void *xt_buf;
    static __thread size_t xt_cap;
    const int64_t mt = (M + 15) / 16, nblocks = (N + 15) / 16;
    /* The block's rows are dequantized whole, each one stream the hardware prefetcher
     * follows (dequantizing 512 inputs of the 16 rows at a time, for L1, was 10% slower
     * at 16 rows of the 1B shape), Kp + 32 values apart: Kp * 2 bytes is often a multiple
     * of 4 KiB, which would put the 16 rows in one set of the L1 cache. */
    const int64_t lda = Kp + 32;
    uint32_t *xt = (uint32_t *)nb_scratch(&xt_buf, &xt_cap, (size_t)(mt * Kp / 2 * 16 * 4));
#pragma omp parallel num_threads(nthreads)
    {
        static __thread void *a_buf, *c_buf;
        static __thread size_t a_cap, c_cap;
        uint16_t *a = (uint16_t *)nb_scratch(&a_buf, &a_cap, (size_t)(16 * lda * 2));
        float *c = (float *)nb_scratch(&c_buf, &c_cap, sizeof(float) * NB_Q_AMX_GROUP * 256);
        const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t xb = mt * (Kp / 32);
        nb_q_amx_inputs(x, M, K, Kp, xt, xb * tid / nt, xb * (tid + 1) / nt);
#pragma omp barrier
        nb_q_amx_tiles(1);
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nblocks; nb++) {
            const int64_t n0 = 16 * nb;
            for (int64_t j = 0; j < 16; j++) {
                if (n0 + j < N) nb_q4_dequant_row_lut(w, sz, N, Kp, G, n0 + j, a + j * lda);
                else memset(a + j * lda, 0, (size_t)(Kp * 2));
            }
            for (int64_t g0 = 0; g0 < mt; g0 += NB_Q_AMX_GROUP) {
                const int64_t ng = mt - g0 < NB_Q_AMX_GROUP ? mt - g0 : NB_Q_AMX_GROUP;
                nb_q_amx_group(a, lda, xt, Kp, g0, ng, c);
                for (int64_t t = 0; t < ng; t++)
                    nb_q_amx_store(c + 256 * t, y, bias, M, N, g0 + t, n0, out_f32);
            }
        }
        nb_q_amx_tiles(0);
    }
}

/* Output rows 4 blk .. 4 blk + 3 (fewer at the end), every row of x. */
static inline void nb_q_block(int bits, const nb_qx *in, const void *w, const void *scales,
                              const uint16_t *bias, void *y, int64_t M, int64_t N, int64_t Kp,
                              int64_t G, int out_f32, int64_t blk) {
    const int64_t n0 = blk * 4, n1 = n0 + 4 < N ? n0 + 4 : N;
    if (bits == 8)
        nb_q8_rows(in, (const int8_t *)w, (const float *)scales, bias, y, M, N, Kp, out_f32, n0, n1);
    else
        nb_q4_rows(in, (const uint8_t *)w, (const uint16_t *)scales, bias, y, M, N, Kp, G,
                   out_f32, n0, n1);
}

static void nb_linear_q(int bits, const uint16_t *x, const void *w, const void *scales,
                        const uint16_t *bias, void *y, int64_t M, int64_t N, int64_t K,
                        int64_t Kp, int64_t G, int out_f32, int nthreads, int amx) {
    /* (int8 on tiles: its int32 sums are exact up to 65536 inputs) */
    if (amx && bits == 8 && M >= NB_Q_AMX_ROWS && Kp <= 65536 && nb_amx_int8_usable()) {
        nb_linear_q8_amx(x, (const int8_t *)w, (const float *)scales, bias, y, M, N, K, Kp,
                         out_f32, nthreads);
        return;
    }
    if (amx && bits == 4 && M >= NB_Q_AMX_ROWS && nb_amx_usable()) {
        nb_linear_q4_amx(x, (const uint8_t *)w, (const uint16_t *)scales, bias, y, M, N, K, Kp,
                         G, out_f32, nthreads);
        return;
    }
    if (bits == 8 && M >= NB_Q8_TILE_ROWS && K % 2 == 0) {
        const int64_t ntiles = (N + NB_TILE - 1) / NB_TILE, mtiles = (M + 3) / 4;
#pragma omp parallel num_threads(nthreads)
        {
            uint16_t *buf = (uint16_t *)aligned_alloc(64, (size_t)(K * NB_TILE * 2));
            uint16_t *rows = (uint16_t *)aligned_alloc(64, (NB_Q_TILE_ROW_BUF(Kp) + 63) / 64 * 64);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < ntiles; t++) {
                nb_q_dequant_tile(bits, w, scales, N, K, Kp, G, t, buf, rows);
                for (int64_t mt = 0; mt < mtiles; mt++)
                    nb_linear_tile(x, buf, bias, y, M, N, K, out_f32, t, mt);
            }
            free(buf);
            free(rows);
        }
        return;
    }
    nb_qx in = nb_q_inputs(bits, x, M, K, Kp, G);
    const int64_t blocks = (N + 3) / 4;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++)
        nb_q_block(bits, &in, w, scales, bias, y, M, N, Kp, G, out_f32, blk);
    nb_q_inputs_free(&in);
}

/* This thread's share (of `nt`) of the output rows, for every row of x: inside a parallel
 * region the caller runs (nb_decoder_decode, one or two rows). Each thread converts x on
 * its own (a few KiB); the values are those of nb_linear_q's row path. */
static void nb_linear_q_share(int bits, const uint16_t *x, const void *w, const void *scales,
                              const uint16_t *bias, void *y, int64_t M, int64_t N, int64_t K,
                              int64_t Kp, int64_t G, int out_f32, int tid, int nt) {
    nb_qx in = nb_q_inputs(bits, x, M, K, Kp, G);
    const int64_t blocks = (N + 3) / 4;
    for (int64_t blk = blocks * tid / nt; blk < blocks * (tid + 1) / nt; blk++)
        nb_q_block(bits, &in, w, scales, bias, y, M, N, Kp, G, out_f32, blk);
    nb_q_inputs_free(&in);
}

void nb_linear_q8(const uint16_t *x, const int8_t *w, const float *scales, const uint16_t *bias,
                  void *y, int64_t M, int64_t N, int64_t K, int64_t Kp, int out_f32, int nthreads,
                  int amx) {
    nb_linear_q(8, x, w, scales, bias, y, M, N, K, Kp, 0, out_f32, nthreads, amx);
}

void nb_linear_q4(const uint16_t *x, const uint8_t *w, const uint16_t *scales_zeros,
                  const uint16_t *bias, void *y, int64_t M, int64_t N, int64_t K, int64_t Kp,
                  int64_t G, int out_f32, int nthreads, int amx) {
    nb_linear_q(4, x, w, scales_zeros, bias, y, M, N, K, Kp, G, out_f32, nthreads, amx);
}
