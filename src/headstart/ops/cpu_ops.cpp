// The CPU kernels of quant_matmul/int4_f32.c and attention/decode_f32.c as the CPU kernels of
// their torch operators (headstart::int4_matmul_f32, headstart::decode_attention_cpu), so
// that a traced decode step calls them without entering Python: through the Python
// implementations each call cost about 8 us more, some 30 calls a step (see native.py).
// fp32 only; the operators' schemas and their PyTorch implementations are in Python.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

extern "C" {
int int4_matmul_f32(const float* x, int M, int K, const uint32_t* packed, const float* scales,
                    const float* biases, int N, int G, float* y, int n0, int n1);
int decode_attention_f32(const float* q, const float* k, const float* v, float* keys,
                         float* values, const int64_t* slots, const int64_t* positions, int n,
                         int nh, int nkv, int hd, int64_t slot_stride, int64_t head_stride,
                         int64_t row_stride, float scale, float* out);
}

namespace {

at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& biases, int64_t group) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "int4_matmul_f32: x is [M, K] fp32");
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.is_contiguous(), "packed: int32 codes");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  biases.scalar_type() == at::kFloat && biases.is_contiguous(),
              "scales and biases: contiguous fp32");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), n = packed.size(0);
  TORCH_CHECK(packed.size(1) * 8 == k, "int4_matmul_f32: x has ", k, " features");
  at::Tensor y = at::empty({m, n}, xc.options());
  const int rc = int4_matmul_f32(xc.data_ptr<float>(), (int)m, (int)k,
                                 reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>()),
                                 scales.data_ptr<float>(), biases.data_ptr<float>(), (int)n,
                                 (int)group, y.data_ptr<float>(), 0, (int)n);
  TORCH_CHECK(rc == 0, "the 4-bit CPU kernel could not allocate its scratch");
  return y;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            at::Tensor& keys, at::Tensor& values, int64_t layer,
                            const at::Tensor& slots, const at::Tensor& positions) {
  at::Tensor kl = keys.select(0, layer), vl = values.select(0, layer);
  for (const at::Tensor* t : {&q, &k, &v, static_cast<const at::Tensor*>(&keys), static_cast<const at::Tensor*>(&values)})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "decode_attention_cpu: fp32 only here");
  TORCH_CHECK(slots.scalar_type() == at::kLong && positions.scalar_type() == at::kLong,
              "decode_attention_cpu: int64 slots and positions");
  TORCH_CHECK(kl.strides() == vl.strides() && kl.stride(3) == 1,
              "decode_attention_cpu: keys and values laid out alike, rows contiguous");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor sc = slots.contiguous(), pc = positions.contiguous();
  at::Tensor out = at::empty_like(qc);
  const int64_t hd = qc.size(2);
  const int rc = decode_attention_f32(
      qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), kl.data_ptr<float>(),
      vl.data_ptr<float>(), sc.data_ptr<int64_t>(), pc.data_ptr<int64_t>(), (int)qc.size(0),
      (int)qc.size(1), (int)kc.size(1), (int)hd, kl.stride(0), kl.stride(1), kl.stride(2),
      (float)std::pow((double)hd, -0.5), out.data_ptr<float>());
  TORCH_CHECK(rc == 0, "the CPU decode attention could not allocate its scratch");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(headstart, CPU, m) {
  m.impl("int4_matmul_f32", int4_matmul);
  m.impl("decode_attention_cpu", decode_attention);
}
