/* Causal depthwise convolution of one sequence, fp32, [T, C] rows (see cpu.py).
 *
 * e is the tail's K-1 rows (tail [C, K-1], oldest first) followed by x's T rows; then
 *   y[t, c] = sum_k w[c, k] * e[t + k, c]     (w [C, K]: w[:, K-1] hits the current row)
 * and new_tail [C, K-1] holds e's last K-1 rows. Rows of x are contiguous in C, so every tap is
 * one multiply-add over a row, which the compiler vectorizes (-O3 -march=native). */
#include <stddef.h>
#include <stdlib.h>

/* Returns 0, or -1 when the scratch for the transposed weight could not be allocated. */
int causal_conv_f32(const float* x, int T, int C, const float* tail, const float* w, int K,
                    float* y, float* new_tail) {
  const int k1 = K - 1;
  float* wt = (float*)malloc(sizeof(float) * (size_t)K * C); /* [K][C] */
  float* tr = (float*)malloc(sizeof(float) * (size_t)(k1 > 0 ? k1 : 1) * C); /* tail rows */
  if (!wt || !tr) { free(wt); free(tr); return -1; }
  for (int c = 0; c < C; c++) {
    for (int k = 0; k < K; k++) wt[(size_t)k * C + c] = w[(size_t)c * K + k];
    for (int i = 0; i < k1; i++) tr[(size_t)i * C + c] = tail[(size_t)c * k1 + i];
  }
  for (int t = 0; t < T; t++) {
    float* yr = y + (size_t)t * C;
    for (int c = 0; c < C; c++) yr[c] = 0.f;
    for (int k = 0; k < K; k++) {
      const int j = t + k - k1; /* row of e: a tail row when j < 0 */
      const float* er = j >= 0 ? x + (size_t)j * C : tr + (size_t)(k1 + j) * C;
      const float* wk = wt + (size_t)k * C;
      for (int c = 0; c < C; c++) yr[c] += wk[c] * er[c];
    }
  }
  for (int i = 0; i < k1; i++) { /* e's last K-1 rows */
    const int j = T - k1 + i;
    const float* er = j >= 0 ? x + (size_t)j * C : tr + (size_t)(k1 + j) * C;
    for (int c = 0; c < C; c++) new_tail[(size_t)c * k1 + i] = er[c];
  }
  free(wt);
  free(tr);
  return 0;
}
