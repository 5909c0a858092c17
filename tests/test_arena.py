"""Weights in one arena: planning, views, the model built into it, and lazy checkpoint loading."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import replace

import pytest
import tiny
import torch
from safetensors.torch import load_file, save_file

from headstart.arena import (
    ALIGN,
    ArenaMismatch,
    ArenaPlan,
    Slot,
    WeightArena,
    layout,
    leaves,
    rebuild,
    to_meta,
)
from headstart.batch import ForwardBatch, SeqChunk
from headstart.errors import CheckpointError
from headstart.kernels import REFERENCE
from headstart.models.qwen35.config import load_config
from headstart.models.qwen35.model import Qwen35Model
from headstart.models.qwen35.weights import LazyWeights, load_weights, stand_ins
from headstart.ops.quant_matmul import triton as quant_matmul
from headstart.ops.quant_matmul.triton import PreparedQuant
from headstart.quant import QuantizedTensor, quantize

# --- the arena itself -------------------------------------------------------------------------

SLOTS = [
    Slot("a", (3,), torch.int8),
    Slot("b", (5, 3), torch.float32),
    Slot("c", (0, 4), torch.float32),
    Slot("d", (7,), torch.bfloat16),
    Slot("e", (2, 2), torch.int64),
    Slot("f", (1,), torch.bool),
]


def test_layout_aligns_every_slot():
    offsets, total = layout(SLOTS)
    assert all(o % ALIGN == 0 for o in offsets)
    assert total % ALIGN == 0
    ends = [o + s.nbytes for o, s in zip(offsets, SLOTS, strict=True)]
    assert all(e <= o for e, o in zip(ends, offsets[1:], strict=False))  # no overlap
    assert [s.nbytes for s in SLOTS] == [3, 60, 0, 14, 32, 1]
    assert total == offsets[-1] + ALIGN


def test_views_are_typed_disjoint_and_share_one_storage():
    arena = WeightArena(SLOTS, "cpu")
    assert len(arena) == len(SLOTS) and arena.nbytes == layout(SLOTS)[1]
    views = {s.key: arena.view(s.key) for s in SLOTS}
    for s in SLOTS:
        v = views[s.key]
        assert (tuple(v.shape), v.dtype) == (s.shape, s.dtype) and v.is_contiguous()
        assert v.untyped_storage().data_ptr() == arena.data_ptr() and arena.holds(v)
        assert v.numel() == 0 or v.data_ptr() % ALIGN == 0
    for i, s in enumerate(SLOTS):  # writing one slot leaves the others as they were
        views[s.key].fill_(i + 1)
    for i, s in enumerate(SLOTS):
        assert torch.all(views[s.key] == (True if s.dtype == torch.bool else i + 1))
    assert not arena.holds(torch.zeros(3))


def test_fill_copies_and_checks_against_the_plan():
    plan = ArenaPlan()
    qt = quantize(torch.randn(8, 64), 4, 32)
    plan.add("q", to_meta(qt))
    plan.add("t", torch.empty(4, 2, device="meta"))
    assert [s.key for s in plan.slots] == ["q.packed", "q.scales", "q.biases", "t"]
    arena = plan.allocate("cpu")
    with pytest.raises(ArenaMismatch, match="never loaded: q.packed, q.scales, q.biases, t"):
        arena.check_complete()
    placed = arena.fill("q", qt)
    assert isinstance(placed, QuantizedTensor) and (placed.bits, placed.group_size) == (4, 32)
    for field, t in leaves(placed):
        assert arena.holds(t) and torch.equal(t, getattr(qt, field))
    with pytest.raises(
        ArenaMismatch,
        match=r"'t' is float64 \(4, 2\), the arena planned "
        r"float32 \(4, 2\)",
    ):
        arena.fill("t", torch.zeros(4, 2, dtype=torch.float64))
    with pytest.raises(ArenaMismatch, match="'t' is float32 \\(2, 4\\)"):
        arena.fill("t", torch.zeros(2, 4))
    with pytest.raises(ArenaMismatch, match="'u' .* not in the arena's plan"):
        arena.fill("u", torch.zeros(4, 2))
    src = torch.arange(8.0).view(2, 4).t()  # not contiguous: copied in as values
    assert torch.equal(arena.fill("t", src), src)
    arena.check_complete()
    with pytest.raises(ArenaMismatch, match="twice"):
        arena.fill("t", src)
    # A value made of tensors already in the arena shares their slots (e.g. a tied head).
    again = arena.fill("head", placed)
    assert all(a is b for (_, a), (_, b) in zip(leaves(again), leaves(placed), strict=True))


def test_leaves_and_rebuild_keep_non_tensor_fields():
    qt = quantize(torch.randn(128, 128), 4, 64)
    p = quant_matmul.prepare(qt)
    assert [f for f, _ in leaves(p)] == ["words", "sb", "counters"]
    m = to_meta(p)
    assert isinstance(m, PreparedQuant) and m.words.is_meta and m.config is p.config
    assert (m.layout, m.block_n, m.n, m.k, m.sb_bf16) == (p.layout, p.block_n, p.n, p.k, p.sb_bf16)
    assert rebuild(torch.zeros(2), {"": torch.ones(3)}).shape == (3,)
    with pytest.raises(TypeError):
        leaves(3)


# --- the GPU prepare on meta tensors ----------------------------------------------------------


@pytest.mark.parametrize(
    "bits,group,shape",
    [
        (4, 64, (300, 320)),  # mma, rows padded to the tile, an odd number of chunks
        (4, 128, (130, 384)),  # mma, groups of two chunks
        (4, 32, (96, 64)),  # tiled
        (8, 64, (70, 128)),
        (2, 32, (40, 96)),
    ],
)
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quant_prepare_on_meta_matches_a_real_run(bits, group, shape, scale_dtype):
    """The meta result is made from shapes alone (no repacking on the meta device): each
    tensor's shape, dtype and strides, and every other field, are a real run's."""
    qt = quantize(torch.randn(*shape), bits, group, scale_dtype)
    real, meta = quant_matmul.prepare(qt), quant_matmul.prepare(to_meta(qt))
    for (field, r), (_, m) in zip(leaves(real), leaves(meta), strict=True):
        assert m.is_meta, field
        assert (r.shape, r.dtype, r.stride()) == (m.shape, m.dtype, m.stride()), field
    for f in dataclasses.fields(PreparedQuant):
        if not isinstance(getattr(real, f.name), torch.Tensor):
            assert getattr(real, f.name) == getattr(meta, f.name), f.name


# --- the model in its arena -------------------------------------------------------------------


def logits(model: Qwen35Model) -> torch.Tensor:
    """A 9-token prefill (all rows' logits) then three decode steps."""
    pool = model.new_state_pool(2, 32)
    ids = [5, 17, 3, 99, 42, 8, 150, 1, 77]
    out = [model.forward(ForwardBatch.build([SeqChunk(1, 0, ids, len(ids))]), pool)]
    for i, t in enumerate((11, 12, 13)):
        out.append(model.forward(ForwardBatch.build([SeqChunk(1, len(ids) + i, (t,))]), pool))
    return torch.cat(out)


def realigned(model: Qwen35Model) -> Qwen35Model:
    """``model`` with every weight tensor copied to a fresh allocation. safetensors hands out
    tensors at 8-byte offsets in its buffer and CPU BLAS rounds differently at different
    alignments, so a model straight from the files is not bit-comparable to one whose weights
    are 64-byte aligned (an arena's, or this copy's). A tied head stays the table itself."""
    copies: dict[int, torch.Tensor] = {}

    def copy(v):
        return rebuild(v, {f: copies.setdefault(id(t), t.clone()) for f, t in leaves(v)})

    model.w = {k: copy(v) for k, v in model.w.items()}
    model.head = copy(model.head)
    return model


def weight_tensors(model: Qwen35Model) -> list[tuple[str, torch.Tensor]]:
    out = [(f"{k}.{f}", t) for k, v in model.w.items() for f, t in leaves(v)]
    return out + [(f"head.{f}", t) for f, t in leaves(model.head)]


def assert_all_in_arena(model: Qwen35Model) -> None:
    arena = model.arena
    assert arena is not None
    ptr = arena.data_ptr()
    for name, t in weight_tensors(model):
        assert t.untyped_storage().data_ptr() == ptr, name
    # one slot per distinct tensor, nothing planned left over
    distinct = {id(t): t for _, t in weight_tensors(model)}
    assert len(distinct) == len(arena)
    assert sum(t.numel() * t.element_size() for t in distinct.values()) <= arena.nbytes


def real_specs(model: Qwen35Model) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The slots the finished model's weights would need (what the real run produced)."""
    plan = ArenaPlan()
    for k, v in model.w.items():
        plan.add(k, v)
    plan.add("head", model.head)
    return {s.key: (s.shape, s.dtype) for s in plan.slots}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny random checkpoints: float (untied, tied), and MLX-quantized (untied, tied)."""
    root = tmp_path_factory.mktemp("arena")
    out = {}
    for tied in (False, True):
        ref = tiny.causal_lm(seed=4, tie_word_embeddings=tied)
        out["float-tied" if tied else "float"] = tiny.save_text_only(ref, root / f"float-{tied}")
        deq, packed = tiny.dequantized_copy(ref, 4, 32)
        out["q4-tied" if tied else "q4"] = tiny.save_mlx(deq, packed, root / f"q4-{tied}", 4, 32)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,unpack",
    [
        ("float", 0),
        ("float-tied", 0),
        ("q4", 0),
        ("q4", 1 << 30),
        ("q4-tied", 0),
        ("q4-tied", 1 << 30),
    ],
)
def test_arena_model_is_bit_identical(ckpts, name, unpack):
    plain = realigned(Qwen35Model.load(ckpts[name], unpack_bytes=unpack, arena=False))
    model = Qwen35Model.load(ckpts[name], unpack_bytes=unpack)
    assert plain.arena is None
    assert_all_in_arena(model)
    assert model.w.keys() == plain.w.keys()
    for k, v in plain.w.items():
        for (f, a), (_, b) in zip(leaves(v), leaves(model.w[k]), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), (k, f)
    assert torch.equal(logits(model), logits(plain))
    tied = "tied" in name
    assert (model.head is model.w["embed_tokens.weight"]) == (tied and "float" in name)
    if not tied:
        assert model.head is model.w["lm_head.weight"]
    if name.startswith("q4"):  # packed where asked, and the tied unpacked head has its own slot
        assert isinstance(model.w["embed_tokens.weight"], QuantizedTensor)
        assert isinstance(model.head, QuantizedTensor) == (unpack == 0)
        if tied and unpack:  # a tensor, or a dataclass of them (cpu_f32.CpuPacked)
            assert any(k == "head" or k.startswith("head.") for k in model.arena.slots)


def test_planned_slots_are_what_the_real_run_made(ckpts):
    cfg = load_config(ckpts["q4-tied"])
    model = Qwen35Model.load(ckpts["q4-tied"], unpack_bytes=1 << 30)
    planned = {k: (s.shape, s.dtype) for k, (s, _) in model.arena.slots.items()}
    assert planned == real_specs(model)
    assert len(planned) > 4 * cfg.num_hidden_layers
    assert all(off % ALIGN == 0 for _, off in model.arena.slots.values())


def test_a_real_run_that_differs_from_the_plan_fails_clearly(ckpts):
    """A prepare whose result depends on more than shapes and dtypes breaks the plan."""

    def prepare(w, dense=None):
        if isinstance(w, torch.Tensor) and w.ndim == 2 and not w.is_meta:
            return w[:-1]
        return w

    with pytest.raises(
        ArenaMismatch,
        match=r"'layers\.0\.[a-z_.]+' is float32 .* the arena "
        r"planned float32",
    ):
        Qwen35Model.load(ckpts["float"], kernels=replace(REFERENCE, prepare=prepare))
    Qwen35Model.load(ckpts["float"], kernels=replace(REFERENCE, prepare=prepare), arena=False)


@pytest.mark.parametrize("group", [64, 32])  # mma and tiled layouts
@pytest.mark.parametrize("tied", [False, True])
def test_gpu_prepare_through_the_arena(tmp_path, group, tied):
    """The GPU kernels' prepare (plain torch ops) planned on meta and run on the CPU: every
    repacked tensor lands in the arena, equal to a prepare outside it; the tied head gets its
    own repacked slots."""
    ref = tiny.causal_lm(seed=6, tie_word_embeddings=tied)
    deq, packed = tiny.dequantized_copy(ref, 4, group)
    ckpt = tiny.save_mlx(deq, packed, tmp_path / "q", 4, group)

    def prepare(w, dense=None):
        return quant_matmul.prepare(w, dense=dense) if isinstance(w, QuantizedTensor) else w

    kernels = replace(REFERENCE, name="gpu-like", prepare=prepare, fused_matmul=True)
    plain = Qwen35Model.load(ckpt, kernels=kernels, arena=False)
    model = Qwen35Model.load(ckpt, kernels=kernels)
    assert_all_in_arena(model)
    assert isinstance(model.w["layers.0.mlp.gate_up_proj.weight"], PreparedQuant)
    assert isinstance(model.head, PreparedQuant)
    if tied:
        assert {"head.words", "head.sb", "head.counters"} <= model.arena.slots.keys()
    for k, v in [*plain.w.items(), ("head", plain.head)]:
        got = model.head if k == "head" else model.w[k]
        assert type(got) is type(v), k
        for (f, a), (_, b) in zip(leaves(v), leaves(got), strict=True):
            assert torch.equal(a, b), (k, f)
        if isinstance(v, PreparedQuant):
            assert (got.layout, got.block_n, got.n, got.k) == (v.layout, v.block_n, v.n, v.k)


@pytest.mark.slow
def test_a_model_from_a_dict_goes_into_an_arena_too(ckpts):
    """Tests and benchmarks build models from plain dicts, including already fused ones."""
    cfg = load_config(ckpts["float-tied"])
    weights = load_weights(ckpts["float-tied"], cfg)
    assert isinstance(weights, dict)
    model = Qwen35Model(cfg, weights)
    assert weights == {}
    assert_all_in_arena(model)
    again = Qwen35Model(cfg, dict(model.w))  # fused names, already final
    assert_all_in_arena(again)
    assert again.arena.data_ptr() != model.arena.data_ptr()
    assert torch.equal(logits(again), logits(model))


@pytest.mark.slow
def test_the_default_model_loads_into_an_arena():
    from headstart.loading import default_model_dir

    model = Qwen35Model.load(default_model_dir())
    assert_all_in_arena(model)
    plain = realigned(Qwen35Model.load(default_model_dir(), arena=False))
    assert torch.equal(logits(model), logits(plain))


# --- lazy loading -----------------------------------------------------------------------------


@pytest.fixture
def reads(monkeypatch):
    """Names of the stored tensors read from files, in order."""
    from headstart.models.qwen35 import weights

    log: list[str] = []
    real = weights._Source.read

    def read(self):
        log.append(self.name)
        return real(self)

    monkeypatch.setattr(weights._Source, "read", read)
    return log


def test_lazy_weights_read_only_what_is_taken(ckpts, reads):
    ckpt = ckpts["q4"]
    cfg = load_config(ckpt)
    lazy = load_weights(ckpt, cfg, lazy=True)
    assert isinstance(lazy, LazyWeights) and reads == []
    eager = load_weights(ckpt, cfg)
    reads.clear()
    assert list(lazy) == list(eager) and len(lazy) == len(eager)
    assert "layers.0.mlp.up_proj.weight" in lazy and "nope" not in lazy
    metas = stand_ins(lazy)
    assert reads == []
    for k, v in eager.items():  # meta stand-ins from headers alone are what a read gives
        assert [(f, t.shape, t.dtype) for f, t in leaves(v)] == [
            (f, t.shape, t.dtype) for f, t in leaves(metas[k])
        ], k
        assert all(t.is_meta for _, t in leaves(metas[k]))
    q = lazy.pop("layers.0.mlp.up_proj.weight")
    assert len(reads) == 3 and reads[0].endswith("up_proj.weight")  # words, scales, biases
    assert torch.equal(q.packed, eager["layers.0.mlp.up_proj.weight"].packed)
    assert "layers.0.mlp.up_proj.weight" not in lazy and len(lazy) == len(eager) - 1
    n = lazy.pop("norm.weight")
    assert torch.equal(n, eager["norm.weight"]) and n.dtype == torch.float32
    lazy["x"] = torch.ones(2)  # held as given
    assert lazy["x"] is lazy["x"] and list(lazy)[-1] == "x"
    assert stand_ins(lazy)["x"].is_meta
    with pytest.raises(KeyError):
        lazy.pop("norm.weight")


def test_loading_streams_layer_by_layer(ckpts, reads, monkeypatch):
    """The model reads a layer's tensors only once the layers before it are in the arena: the
    device never holds much more than the arena and one layer in flight."""
    real_fill = WeightArena.fill

    def fill(self, name, value):
        reads.append("placed:" + name)  # one timeline of reads and placements
        return real_fill(self, name, value)

    monkeypatch.setattr(WeightArena, "fill", fill)
    model = Qwen35Model.load(ckpts["float"])
    layer = re.compile(r"layers\.(\d+)\.")

    def index(name: str) -> int:
        m = layer.search(name)
        return int(m.group(1)) if m else model.cfg.num_hidden_layers

    read = [e for e in reads if not e.startswith("placed:")]
    assert len(read) == len(set(read)) and len(read) > 8 * model.cfg.num_hidden_layers
    done = -1  # the highest layer with something placed so far
    for event in reads:
        if event.startswith("placed:"):
            done = max(done, index(event))
        else:
            assert index(event) <= done + 1, event


@pytest.mark.slow
def test_lazy_and_eager_models_are_equal(ckpts):
    for name in ("float", "q4-tied"):
        ckpt = ckpts[name]
        cfg = load_config(ckpt)
        lazy = Qwen35Model(cfg, load_weights(ckpt, cfg, lazy=True))
        eager = realigned(Qwen35Model(cfg, load_weights(ckpt, cfg), arena=False))
        for k, v in eager.w.items():
            for (f, a), (_, b) in zip(leaves(v), leaves(lazy.w[k]), strict=True):
                assert torch.equal(a, b), (k, f)
        assert torch.equal(logits(lazy), logits(eager))


def _rewrite(src, dst, change):
    import shutil

    d = shutil.copytree(src, dst)
    tensors = load_file(d / "model.safetensors")
    change(tensors)
    save_file(tensors, d / "model.safetensors")
    return d


@pytest.mark.parametrize(
    "ckpt,change,match",
    [
        (
            "float",
            lambda t: t.__setitem__("model.layers.1.linear_attn.dt_bias", torch.zeros(3)),
            r"'layers\.1\.linear_attn\.dt_bias' has shape \(3,\)",
        ),
        (
            "float",
            lambda t: t.__setitem__("model.norm.weight", torch.zeros(64, dtype=torch.int32)),
            r"'norm\.weight' has non-float dtype torch\.int32",
        ),
        (
            "float",
            lambda t: t.pop("model.layers.3.mlp.up_proj.weight"),
            r"'layers\.3\.mlp\.up_proj\.weight' is missing",
        ),
        (
            "q4",
            lambda t: t.__setitem__(
                "language_model.model.layers.0.mlp.up_proj.scales", torch.zeros(96, 3)
            ),
            r"'layers\.0\.mlp\.up_proj\.scales' is torch\.float32 \(96, 3\), "
            r"expected float \(96, 2\)",
        ),
        (
            "q4",
            lambda t: t.pop("language_model.model.layers.2.mlp.down_proj.biases"),
            r"'layers\.2\.mlp\.down_proj' has scales but no biases",
        ),
        (
            "q4",
            lambda t: t.__setitem__(
                "language_model.model.layers.2.mlp.down_proj.weight",
                torch.zeros(64, 12, dtype=torch.int16),
            ),
            r"'layers\.2\.mlp\.down_proj\.weight' is torch\.int16 \(64, 12\), expected uint32",
        ),
    ],
)
def test_bad_checkpoints_fail_before_any_read(ckpts, tmp_path, reads, ckpt, change, match):
    d = _rewrite(ckpts[ckpt], tmp_path / "bad", change)
    reads.clear()
    with pytest.raises(CheckpointError, match=match):
        Qwen35Model.load(d)
    with pytest.raises(CheckpointError, match=match):
        load_weights(d, load_config(d), lazy=True)
    assert reads == []


def test_a_file_damaged_after_the_check_fails_naming_the_tensor(ckpts, tmp_path):
    import shutil

    d = shutil.copytree(ckpts["float"], tmp_path / "ckpt")
    lazy = load_weights(d, load_config(d), lazy=True)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: cannot read tensor "
        r"'model\.layers\.0\.[a-z_.]+'",
    ):
        lazy.pop("layers.0.input_layernorm.weight")
