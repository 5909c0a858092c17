"""Nemotron-H on the GPU: the decode step in CUDA graphs, with the flash-decoding attention
kernel, against transformers on the CPU (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from test_nemotron_h_model import assert_serves_transformers_tokens, hf_model


@pytest.mark.parametrize("head_dim", [16, 128])
def test_decode_graphs_give_the_cpu_references_greedy_tokens(tmp_path, engines, head_dim):
    """float32 on the GPU (decode rows replayed from captured graphs, prompts eager) against
    transformers in float32 on the CPU: the same greedy tokens for every stream."""
    import tiny

    from headstart.engine.config import EngineConfig, SchedulingConfig
    from headstart.models import family_for

    ref = hf_model("M*-M-", tmp_path, seed=9, head_dim=head_dim)
    model = family_for(tmp_path).load(tmp_path, torch.float32, "cuda", "auto")
    assert model.kernels.name == "gpu" and model.kernels.graphs
    e = engines(
        model, tiny.small_tokenizer(), (), EngineConfig(3, 256, scheduling=SchedulingConfig(16, 32))
    )
    assert e.runner.decode_graphs is not None and e.runner.prompt_graphs is None
    gen = torch.Generator().manual_seed(10)
    prompts = [torch.randint(2, 160, (n,), generator=gen).tolist() for n in (44, 7, 25)]
    assert_serves_transformers_tokens(e, ref, prompts, 12)
