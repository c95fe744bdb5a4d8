/*
 * nbengine's native CPU kernels (x86-64 with AVX-512 BF16), called from Python through
 * ctypes by nbengine/ops/native.py, which compiles this file on first use.
 *
 * Conventions: every tensor is contiguous and row-major; bf16 values are passed as
 * uint16_t; arithmetic is float32 and results are rounded to bf16 to nearest-even, as
 * torch rounds. Each kernel takes the thread count to use (OpenMP; the library shares the
 * libgomp that torch loaded, so both use one thread pool).
 */
#include <immintrin.h>
#include <stdint.h>

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

void nb_linear_bf16(const uint16_t *x, const uint16_t *w_packed, const uint16_t *bias, void *y,
                    int64_t M, int64_t N, int64_t K, int out_f32, int nthreads) {
    const int64_t pairs = K / 2;
    const int64_t ntiles = (N + NB_TILE - 1) / NB_TILE;
    const int64_t mtiles = (M + 3) / 4;
#pragma omp parallel for collapse(2) num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < ntiles; t++) {
        for (int64_t mt = 0; mt < mtiles; mt++) {
            const uint16_t *wt = w_packed + t * pairs * NB_TILE * 2;
            const int64_t n0 = t * NB_TILE, m0 = mt * 4;
            const int64_t rows = M - m0 < 4 ? M - m0 : 4;
            const uint16_t *bt = bias ? bias + n0 : 0;
            if (rows == 4) {
                __m512 acc[4][4];
                const uint32_t *xp[4];
                for (int i = 0; i < 4; i++) {
                    xp[i] = (const uint32_t *)(x + (m0 + i) * K);
                    for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
                }
                for (int64_t p = 0; p < pairs; p++) {
                    const uint16_t *wp = wt + p * NB_TILE * 2;
                    const __m512bh w0 = (__m512bh)_mm512_load_si512(wp);
                    const __m512bh w1 = (__m512bh)_mm512_load_si512(wp + 32);
                    const __m512bh w2 = (__m512bh)_mm512_load_si512(wp + 64);
                    const __m512bh w3 = (__m512bh)_mm512_load_si512(wp + 96);
#pragma GCC unroll 4
                    for (int i = 0; i < 4; i++) {
                        const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[i][p]);
                        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w0, xb);
                        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w1, xb);
                        acc[i][2] = _mm512_dpbf16_ps(acc[i][2], w2, xb);
                        acc[i][3] = _mm512_dpbf16_ps(acc[i][3], w3, xb);
                    }
                }
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 4; j++)
                        nb_store16(y, (m0 + i) * N + n0 + 16 * j, N - n0 - 16 * j, acc[i][j],
                                   bt ? bt + 16 * j : 0, out_f32);
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
    }
}

/* ---- small helpers ------------------------------------------------------------------ */
#include <math.h>
#include <stdlib.h>

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
        float buf_small[1024];
        float *r = H <= 1024 ? buf_small : (float *)malloc(sizeof(float) * H);
        double ss = 0.0;
        for (int64_t i = 0; i < H; i++) {
            float v = nb_bf16_to_f32(xr[i]);
            if (add) {
                v = nb_round_bf16(v + nb_bf16_to_f32(add[m * H + i]));
                residual_out[m * H + i] = nb_f32_to_bf16(v);
            }
            r[i] = v;
            ss += (double)v * v;
        }
        const float inv = 1.0f / sqrtf((float)(ss / (double)H) + eps);
        for (int64_t i = 0; i < H; i++)
            out[m * H + i] = nb_f32_to_bf16(nb_bf16_to_f32(w[i]) * nb_round_bf16(r[i] * inv));
        if (r != buf_small) free(r);
    }
}

/* ---- SwiGLU activation: out[m, i] = bf16(bf16(silu(g)) * u) for gate_up = [g | u] ------- */
void nb_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t M, int64_t I, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *g = gate_up + m * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I; i++) {
            const float gv = nb_bf16_to_f32(g[i]);
            const float s = nb_round_bf16(gv / (1.0f + expf(-gv)));
            out[m * I + i] = nb_f32_to_bf16(s * nb_bf16_to_f32(u[i]));
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

/* ---- Decode attention over the paged KV cache, reading blocks in place ----------------
 *
 * One query token per sequence. q: [B, Hq, D] with row stride q_stride; caches:
 * [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks] int32; seq_lens: [B]
 * (keys 0..len-1 are attended). The G = Hq / Hkv query heads of one KV head are done
 * together, so each key and value row is read once per sequence and KV head. Scores and
 * softmax in float32 (two passes over the keys), output rounded to bf16. D % 32 == 0.
 */
void nb_decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                              const uint16_t *v_cache, const int32_t *block_tables,
                              const int32_t *seq_lens, uint16_t *out, int64_t B, int64_t Hq,
                              int64_t Hkv, int64_t D, int64_t block_size, int64_t max_blocks,
                              float scale, int nthreads) {
    const int64_t G = Hq / Hkv, dv = D / 16, dk = D / 32;
#pragma omp parallel for collapse(2) num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t L = seq_lens[b];
            const int32_t *table = block_tables + b * max_blocks;
            float *scores = (float *)malloc(sizeof(float) * G * L);
            for (int64_t j = 0; j < L; j++) {
                const uint16_t *kr = k_cache + ((int64_t)table[j / block_size] * block_size
                                                + j % block_size) * Hkv * D + h * D;
                for (int64_t g = 0; g < G; g++) {
                    const uint16_t *qr = q + b * q_stride + (h * G + g) * D;
                    __m512 acc = _mm512_setzero_ps();
                    for (int64_t c = 0; c < dk; c++)
                        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(kr + 32 * c),
                                               (__m512bh)_mm512_loadu_si512(qr + 32 * c));
                    scores[g * L + j] = _mm512_reduce_add_ps(acc) * scale;
                }
            }
            for (int64_t g = 0; g < G; g++) {
                float *s = scores + g * L, mx = -INFINITY, sum = 0.0f;
                for (int64_t j = 0; j < L; j++) mx = s[j] > mx ? s[j] : mx;
                for (int64_t j = 0; j < L; j++) { s[j] = expf(s[j] - mx); sum += s[j]; }
                const float inv = 1.0f / sum;
                for (int64_t j = 0; j < L; j++) s[j] *= inv;
            }
            __m512 acc[8][8];  /* [g][d / 16]: G <= 8 and D <= 128 on this path */
            for (int64_t g = 0; g < G; g++)
                for (int64_t c = 0; c < dv; c++) acc[g][c] = _mm512_setzero_ps();
            for (int64_t j = 0; j < L; j++) {
                const uint16_t *vr = v_cache + ((int64_t)table[j / block_size] * block_size
                                                + j % block_size) * Hkv * D + h * D;
                __m512 vv[8];
                for (int64_t c = 0; c < dv; c++)
                    vv[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
                        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vr + 16 * c))), 16));
                for (int64_t g = 0; g < G; g++) {
                    const __m512 p = _mm512_set1_ps(scores[g * L + j]);
                    for (int64_t c = 0; c < dv; c++) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
                }
            }
            for (int64_t g = 0; g < G; g++) {
                uint16_t *o = out + (b * Hq + h * G + g) * D;
                for (int64_t c = 0; c < dv; c++)
                    _mm256_storeu_si256((__m256i *)(o + 16 * c), (__m256i)_mm512_cvtneps_pbh(acc[g][c]));
            }
            free(scores);
        }
    }
}
