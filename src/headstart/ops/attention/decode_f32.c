/* Decode attention over an fp32 pool on the CPU, one query row per stream (see cpu.py).
 *
 * For stream i at position p of slot s: its key and value rows are written into the pool at
 * (s, p), then each query head attends over rows 0..p of its kv head:
 *   out = sum_t softmax_t(q . K[t] * scale) V[t]
 * Scores and the softmax are fp32, as the reference's. The pool is addressed by element
 * strides (slot, kv head, row); a row's head_dim values are contiguous. Built at first use
 * with the machine's compiler (-march=native), which vectorizes the loops below. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 16 partial sums, so that the compiler keeps them in one vector without reassociating a
 * single running sum (which it may not do without -ffast-math). */
static inline float dot(const float* a, const float* b, int d) {
  float part[16] = {0};
  int j = 0;
  for (; j + 16 <= d; j += 16)
    for (int l = 0; l < 16; l++) part[l] += a[j + l] * b[j + l];
  float s = 0.f;
  for (; j < d; j++) s += a[j] * b[j];
  for (int l = 0; l < 16; l++) s += part[l];
  return s;
}

/* q [n, nh, hd], k and v [n, nkv, hd] contiguous; keys and values the pool of one layer;
 * slots and positions [n]; out [n, nh, hd]. Returns 0, or -1 when the scores' scratch could
 * not be allocated. */
int decode_attention_f32(const float* q, const float* k, const float* v, float* keys,
                         float* values, const int64_t* slots, const int64_t* positions, int n,
                         int nh, int nkv, int hd, int64_t slot_stride, int64_t head_stride,
                         int64_t row_stride, float scale, float* out) {
  int64_t longest = 0;
  for (int i = 0; i < n; i++)
    if (positions[i] + 1 > longest) longest = positions[i] + 1;
  const int group = nh / nkv;
  float* scores = (float*)malloc(sizeof(float) * (size_t)longest * group);
  if (!scores) return -1;
  /* every row first: a padding row may share a slot with another stream's row */
  for (int i = 0; i < n; i++)
    for (int h = 0; h < nkv; h++) {
      const int64_t at = slots[i] * slot_stride + h * head_stride + positions[i] * row_stride;
      memcpy(keys + at, k + ((size_t)i * nkv + h) * hd, sizeof(float) * hd);
      memcpy(values + at, v + ((size_t)i * nkv + h) * hd, sizeof(float) * hd);
    }
  for (int i = 0; i < n; i++) {
    const int64_t rows = positions[i] + 1;
    for (int h = 0; h < nkv; h++) {
      const float* kh = keys + slots[i] * slot_stride + h * head_stride;
      const float* vh = values + slots[i] * slot_stride + h * head_stride;
      const float* qg = q + ((size_t)i * nh + (size_t)h * group) * hd;
      float* og = out + ((size_t)i * nh + (size_t)h * group) * hd;
      for (int64_t t = 0; t < rows; t++)
        for (int j = 0; j < group; j++)
          scores[(size_t)j * longest + t] = dot(qg + (size_t)j * hd, kh + t * row_stride, hd) * scale;
      for (int j = 0; j < group; j++) {
        float* sj = scores + (size_t)j * longest;
        float top = sj[0];
        for (int64_t t = 1; t < rows; t++) top = sj[t] > top ? sj[t] : top;
        float total = 0.f;
        for (int64_t t = 0; t < rows; t++) {
          sj[t] = expf(sj[t] - top);
          total += sj[t];
        }
        const float inv = 1.f / total;
        for (int64_t t = 0; t < rows; t++) sj[t] *= inv;
        float* o = og + (size_t)j * hd;
        for (int d = 0; d < hd; d++) o[d] = 0.f;
        for (int64_t t = 0; t < rows; t++) {
          const float w = sj[t];
          const float* vt = vh + t * row_stride;
          for (int d = 0; d < hd; d++) o[d] += w * vt[d];
        }
      }
    }
  }
  free(scores);
  return 0;
}
