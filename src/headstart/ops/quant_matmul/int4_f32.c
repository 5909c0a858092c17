/* y = x @ W^T for an MLX affine 4-bit weight and fp32 activations (see cpu_f32.py).
 *
 * W[n, k] = scales[n, g] * q[n, k] + biases[n, g] with g = k / group. Per output row n:
 *   y[m, n] = sum_g scales[n, g] * (x[m, g] . q[n, g]) + biases[n, g] * sum(x[m, g])
 * so the codes are multiplied as small integers converted to fp32 and the scale and bias are
 * applied once per group. Built at first use with the machine's compiler (-march=native):
 * AVX-512 where the CPU has it, else the portable loop (which the compiler vectorizes). */
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Every code of word w at bits 4b..4b+3 pairs with x[w * 8 + b]: x is first laid out as
 * xp[m][b][w] = x[m][w * 8 + b] * 2^-4b, so that 16 consecutive words masked to nibble b
 * (not shifted: the masked word is q * 2^4b, exact as a float) multiply 16 consecutive
 * floats, and the powers of two cancel exactly. */
static void permute(const float* x, int M, int K, float* xp) {
  const int W = K / 8;
  for (int m = 0; m < M; m++)
    for (int w = 0; w < W; w++)
      for (int b = 0; b < 8; b++)
        xp[((size_t)m * 8 + b) * W + w] = x[(size_t)m * K + w * 8 + b] / (float)(1u << (4 * b));
}

static void group_sums(const float* x, int M, int K, int G, float* xs) {
  const int ng = K / G;
  for (int m = 0; m < M; m++)
    for (int g = 0; g < ng; g++) {
      float t = 0.f;
      for (int j = 0; j < G; j++) t += x[(size_t)m * K + g * G + j];
      xs[m * ng + g] = t;
    }
}

static void rows_portable(int M, const float* x, const float* xs, int K, const uint32_t* packed,
                          const float* scales, const float* biases, int N, int G, float* y,
                          int n0, int n1) {
  const int ng = K / G, wpg = G / 8;
  float codes[256];
  for (int n = n0; n < n1; n++) {
    const uint32_t* row = packed + (size_t)n * (K / 8);
    for (int m = 0; m < M; m++) y[(size_t)m * N + n] = 0.f;
    for (int g = 0; g < ng; g++) {
      for (int j = 0; j < wpg; j++) {
        const uint32_t w = row[g * wpg + j];
        for (int b = 0; b < 8; b++) codes[j * 8 + b] = (float)((w >> (4 * b)) & 15u);
      }
      const float s = scales[(size_t)n * ng + g], c = biases[(size_t)n * ng + g];
      for (int m = 0; m < M; m++) {
        const float* xm = x + (size_t)m * K + g * G;
        float d = 0.f;
        for (int j = 0; j < G; j++) d += xm[j] * codes[j];
        y[(size_t)m * N + n] += s * d + c * xs[m * ng + g];
      }
    }
  }
}

#if defined(__AVX512F__)
/* R rows of x and NR output rows at once (constants after inlining: the accumulators stay in
 * registers). R * NR independent accumulator chains hide the FMA latency: with one row of x
 * and one output row, each row's 16 dependent FMAs made the kernel latency-bound. */
static inline __attribute__((always_inline)) void rows_avx512(
    const int R, const int NR, const float* xp, const float* xs, int K, const uint32_t* packed,
    const float* scales, const float* biases, int N, int G, float* y, int n0, int n1) {
  const int W = K / 8, ng = K / G, wpg = G / 8;
  int lane_group[16];
  for (int i = 0; i < 16; i++) lane_group[i] = i / wpg;
  const __m512i lanes = _mm512_loadu_si512((const void*)lane_group);
  const int per_block = wpg >= 16 ? 1 : 16 / wpg; /* groups in a block of 16 words */
  const __mmask16 load = (__mmask16)((1u << per_block) - 1u);
  for (int n = n0; n < n1; n += NR) {
    __m512 acc[R][NR];
    for (int r = 0; r < R; r++)
      for (int j = 0; j < NR; j++) acc[r][j] = _mm512_setzero_ps();
    for (int w0 = 0; w0 < W; w0 += 16) {
      __m512i words[NR];
      __m512 s[NR], part[R][NR];
      for (int j = 0; j < NR; j++) {
        words[j] = _mm512_loadu_si512((const void*)(packed + (size_t)(n + j) * W + w0));
        s[j] = _mm512_permutexvar_ps(
            lanes, _mm512_maskz_loadu_ps(load, scales + (size_t)(n + j) * ng + w0 / wpg));
        for (int r = 0; r < R; r++) part[r][j] = _mm512_setzero_ps();
      }
#pragma GCC unroll 8
      for (int b = 0; b < 8; b++) {
        const __m512i nibble = _mm512_set1_epi32((int)(15u << (4 * b)));
        for (int j = 0; j < NR; j++) {
          const __m512 q = _mm512_cvtepu32_ps(_mm512_and_si512(words[j], nibble));
          for (int r = 0; r < R; r++)
            part[r][j] = _mm512_fmadd_ps(
                q, _mm512_loadu_ps(xp + ((size_t)r * 8 + b) * W + w0), part[r][j]);
        }
      }
      for (int r = 0; r < R; r++)
        for (int j = 0; j < NR; j++) acc[r][j] = _mm512_fmadd_ps(part[r][j], s[j], acc[r][j]);
    }
    for (int j = 0; j < NR; j++) {
      const float* brow = biases + (size_t)(n + j) * ng;
      for (int r = 0; r < R; r++) {
        float t = _mm512_reduce_add_ps(acc[r][j]);
        for (int g = 0; g < ng; g++) t += brow[g] * xs[r * ng + g];
        y[(size_t)r * N + n + j] = t;
      }
    }
  }
}

/* Output rows n0..n1 for R rows of x: NR = 4 / R output rows at a time, then one at a time. */
static inline __attribute__((always_inline)) void block_avx512(
    const int R, const float* xp, const float* xs, int K, const uint32_t* packed,
    const float* scales, const float* biases, int N, int G, float* y, int n0, int n1) {
  const int NR = 4 / R;
  const int split = n0 + (n1 - n0) / NR * NR;
  if (NR > 1) rows_avx512(R, NR, xp, xs, K, packed, scales, biases, N, G, y, n0, split);
  rows_avx512(R, 1, xp, xs, K, packed, scales, biases, N, G, y, NR > 1 ? split : n0, n1);
}
#endif

/* x [M, K], packed [N, K / 8], scales and biases [N, K / group], y [M, N]; output rows n0..n1.
 * Returns 0, or -1 when a scratch buffer could not be allocated. */
int int4_matmul_f32(const float* x, int M, int K, const uint32_t* packed, const float* scales,
                    const float* biases, int N, int G, float* y, int n0, int n1) {
  float* xs = (float*)malloc(sizeof(float) * (size_t)M * (K / G));
  if (!xs) return -1;
  group_sums(x, M, K, G, xs);
#if defined(__AVX512F__)
  if ((K / 8) % 16 == 0 && G >= 8 && G % 8 == 0 && (16 % (G / 8) == 0 || (G / 8) % 16 == 0)) {
    float* xp = (float*)malloc(sizeof(float) * (size_t)M * K);
    if (!xp) { free(xs); return -1; }
    permute(x, M, K, xp);
    for (int m0 = 0; m0 < M;) {
      const int left = M - m0;
      const float* xpm = xp + (size_t)m0 * K;
      const float* xsm = xs + (size_t)m0 * (K / G);
      float* ym = y + (size_t)m0 * N;
      if (left >= 4) { block_avx512(4, xpm, xsm, K, packed, scales, biases, N, G, ym, n0, n1); m0 += 4; }
      else if (left >= 2) { block_avx512(2, xpm, xsm, K, packed, scales, biases, N, G, ym, n0, n1); m0 += 2; }
      else { block_avx512(1, xpm, xsm, K, packed, scales, biases, N, G, ym, n0, n1); m0 += 1; }
    }
    free(xp);
    free(xs);
    return 0;
  }
#endif
  if (G > 256) { free(xs); return -2; }
  rows_portable(M, x, xs, K, packed, scales, biases, N, G, y, n0, n1);
  free(xs);
  return 0;
}
