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
/* The 16 sums of v[0..15], in order, in one vector: a tree of shuffles and adds (about 3
 * operations a row, against about 8 for a reduction of each vector alone). */
static inline __m512 reduce16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; i++)
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; i++)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; i++)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88),
                                 _mm512_shuffle_ps(c[0], c[1], 0xDD));
  /* the tree leaves row 4i + j in lane 4j + i: a 4 x 4 transpose, its own inverse */
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, t);
}

/* Output rows n .. n+NR-1 for R rows of x, as vectors whose lanes sum to y (R * NR
 * independent accumulator chains hide the FMA latency: with one row of x and one output row,
 * each row's 16 dependent FMAs made the kernel latency-bound). The bias term is folded in:
 * xsl holds, per row of x and block of 16 words, each lane's group sum of x divided by the
 * words in a group, so the lanes of a group add up to b * sum(x). */
static inline __attribute__((always_inline)) void accumulate(
    const int R, const int NR, const float* xp, const float* xsl, int K, const uint32_t* packed,
    const float* scales, const float* biases, int G, int n, __m512i lanes, __mmask16 load,
    __m512 acc[][4]) {
  const int W = K / 8, ng = K / G, wpg = G / 8, blocks = W / 16;
  for (int r = 0; r < R; r++)
    for (int j = 0; j < NR; j++) acc[r][j] = _mm512_setzero_ps();
  for (int w0 = 0; w0 < W; w0 += 16) {
    __m512i words[4];
    __m512 s[4], bias[4], part[4][4];
    for (int j = 0; j < NR; j++) {
      const size_t row = (size_t)(n + j);
      words[j] = _mm512_loadu_si512((const void*)(packed + row * W + w0));
      s[j] = _mm512_permutexvar_ps(lanes, _mm512_maskz_loadu_ps(load, scales + row * ng + w0 / wpg));
      bias[j] = _mm512_permutexvar_ps(lanes, _mm512_maskz_loadu_ps(load, biases + row * ng + w0 / wpg));
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
    for (int r = 0; r < R; r++) {
      const __m512 xs = _mm512_loadu_ps(xsl + ((size_t)r * blocks + w0 / 16) * 16);
      for (int j = 0; j < NR; j++)
        acc[r][j] = _mm512_fmadd_ps(bias[j], xs, _mm512_fmadd_ps(part[r][j], s[j], acc[r][j]));
    }
  }
}

/* Output rows n0..n1 for R rows of x: tiles of 16 rows (NR = 4 / R at a time, reduced
 * together), then the rest one at a time. */
static inline __attribute__((always_inline)) void block_avx512(
    const int R, const float* xp, const float* xsl, int K, const uint32_t* packed,
    const float* scales, const float* biases, int N, int G, float* y, int n0, int n1) {
  const int NR = 4 / R, wpg = G / 8;
  int lane_group[16];
  for (int i = 0; i < 16; i++) lane_group[i] = i / wpg;
  const __m512i lanes = _mm512_loadu_si512((const void*)lane_group);
  const int per_block = wpg >= 16 ? 1 : 16 / wpg; /* groups in a block of 16 words */
  const __mmask16 load = (__mmask16)((1u << per_block) - 1u);
  __m512 acc[4][4], tile[4][16];
  int n = n0;
  for (; n + 16 <= n1; n += 16) {
    for (int t = 0; t < 16; t += NR) {
      accumulate(R, NR, xp, xsl, K, packed, scales, biases, G, n + t, lanes, load, acc);
      for (int r = 0; r < R; r++)
        for (int j = 0; j < NR; j++) tile[r][t + j] = acc[r][j];
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (size_t)r * N + n, reduce16(tile[r]));
  }
  for (; n < n1; n++) {
    accumulate(R, 1, xp, xsl, K, packed, scales, biases, G, n, lanes, load, acc);
    for (int r = 0; r < R; r++) y[(size_t)r * N + n] = _mm512_reduce_add_ps(acc[r][0]);
  }
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
    const int blocks = K / 128; /* blocks of 16 words */
    float* xsl = (float*)malloc(sizeof(float) * (size_t)M * blocks * 16);
    if (!xp || !xsl) { free(xp); free(xsl); free(xs); return -1; }
    permute(x, M, K, xp);
    const int wpg = G / 8, ng = K / G;
    for (int m = 0; m < M; m++)
      for (int w = 0; w < K / 8; w++) xsl[(size_t)m * blocks * 16 + w] = xs[m * ng + w / wpg] / wpg;
    for (int m0 = 0; m0 < M;) {
      const int left = M - m0;
      const float* xpm = xp + (size_t)m0 * K;
      const float* xsm = xsl + (size_t)m0 * blocks * 16;
      float* ym = y + (size_t)m0 * N;
      if (left >= 4) { block_avx512(4, xpm, xsm, K, packed, scales, biases, N, G, ym, n0, n1); m0 += 4; }
      else if (left >= 2) { block_avx512(2, xpm, xsm, K, packed, scales, biases, N, G, ym, n0, n1); m0 += 2; }
      else { block_avx512(1, xpm, xsm, K, packed, scales, biases, N, G, ym, n0, n1); m0 += 1; }
    }
    free(xp);
    free(xsl);
    free(xs);
    return 0;
  }
#endif
  if (G > 256) { free(xs); return -2; }
  rows_portable(M, x, xs, K, packed, scales, biases, N, G, y, n0, n1);
  free(xs);
  return 0;
}
