"""``x @ W^T`` from MLX affine-quantized weights: :mod:`.reference` (dequantize + matmul in
PyTorch, the spec) and :mod:`.triton` (the fused kernel and the weight layouts it reads). Import
them explicitly; nothing is re-exported here."""
