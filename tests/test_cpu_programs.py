"""The CPU decode path: our fp32 4-bit kernel (ops/quant_matmul/cpu_f32.py) against the reference
on fresh random weights; a small 4-bit fp32 model keeping its codes for decode against the same
model unpacked; and compiled decode programs (engine/cpu_programs.py) against the eager forward
(logits and every state the step writes), with padding rows, fresh streams and through the
engine (greedy tokens equal)."""

from __future__ import annotations

import pytest
import tiny
import torch
from engine_helpers import Collector, PartOracle

from headstart.batch import ForwardBatch, SeqChunk
from headstart.engine.config import EngineConfig, SchedulingConfig
from headstart.engine.cpu_programs import DecodePrograms
from headstart.engine.engine import EngineRequest, Finish, Piece
from headstart.models.qwen35.model import Qwen35Model
from headstart.ops.quant_matmul import cpu_f32
from headstart.ops.quant_matmul.reference import quant_matmul
from headstart.quant import QuantizedTensor, quantize
from headstart.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_f32.available(), reason="no C compiler")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


# (n, k, group): whole 16-word blocks (the AVX-512 loop where the CPU has it) and not (the
# portable loop), every group size the kernel takes.
SHAPES = [(64, 128, 32), (48, 256, 64), (32, 512, 128), (16, 512, 256), (40, 96, 32), (24, 64, 8)]


@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9])
def test_int4_f32_matmul_matches_the_reference(n, k, group, rows):
    g = torch.Generator().manual_seed(n * k + group + rows)
    w = quantize(torch.randn(n, k, generator=g) * 0.05, 4, group)
    x = torch.randn(rows, k, generator=g)
    got = cpu_f32.matmul(x, cpu_f32.prepare(w))
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # fp32: summation order, and scale and bias applied per group (cancellation in big groups)
    assert rel_err(got, quant_matmul(x, w)) <= 1e-5


def test_the_operators_cpp_kernels_serve_them_with_the_same_results():
    """Once loaded, the C++ kernels are what the dispatcher runs for CPU tensors, and give
    the Python implementations' results (the same C code behind both)."""
    from headstart.ops import native

    if not native.load():
        pytest.skip("no C++ compiler here")
    for op in ("int4_matmul_f32", "decode_attention_cpu"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"headstart::{op}", "CPU")
    g = torch.Generator().manual_seed(5)
    w = cpu_f32.prepare(quantize(torch.randn(48, 256, generator=g) * 0.05, 4, 64))
    for rows in (1, 3, 8):
        x = torch.randn(rows, 256, generator=g)
        args = (w.packed, w.scales, w.biases, w.group_size)
        got = torch.ops.headstart.int4_matmul_f32(x, *args)
        assert torch.equal(got, cpu_f32._int4_matmul(x, *args))
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.headstart.int4_matmul_f32(torch.randn(1, 128), *args)


def test_what_the_f32_kernel_takes():
    assert cpu_f32.fits(quantize(torch.randn(40, 96), 4, 32))
    assert not cpu_f32.fits(quantize(torch.randn(48, 128), 8, 64))
    w = quantize(torch.randn(48, 128), 4, 64)
    with pytest.raises(ValueError, match="features"):
        cpu_f32.matmul(torch.randn(1, 64), cpu_f32.prepare(w))
    meta = cpu_f32.prepare(
        QuantizedTensor(*(t.to("meta") for t in (w.packed, w.scales, w.biases)), 4, 64)
    )
    real = cpu_f32.prepare(w)
    for a, b in ((meta.packed, real.packed), (meta.dense, real.dense)):
        assert a.is_meta and (a.shape, a.dtype) == (b.shape, b.dtype)


def _q4(tmp_path_factory, tied: bool):
    """A 4-bit checkpoint (groups of 32) with whole 16-word blocks in every projection, and two
    attention layers (their steps write two layers of one pool tensor: a trace once got the
    second wrong)."""
    ref = tiny.causal_lm(
        seed=31,
        tie_word_embeddings=tied,
        hidden_size=128,
        intermediate_size=256,
        layer_types=["linear_attention", "full_attention"] * 2,
    )
    deq, packed = tiny.dequantized_copy(ref, 4, 32)
    return tiny.save_mlx(deq, packed, tmp_path_factory.mktemp("q4") / "m", 4, 32)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def q4(request, tmp_path_factory):
    return _q4(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def q4_tied(tmp_path_factory):
    """The checkpoint the compiled tests share (one compilation per bucket for all of them,
    through inductor's cache)."""
    return _q4(tmp_path_factory, True)


@pytest.fixture(scope="module")
def f32_untied(tmp_path_factory):
    """An unquantized fp32 checkpoint with its own head, attention first (plain weights)."""
    ref = tiny.causal_lm(
        seed=37,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        layer_types=["full_attention", "linear_attention", "full_attention"],
    )
    return tiny.save_text_only(ref, tmp_path_factory.mktemp("f32") / "m")


def _decode_logits(model: Qwen35Model, prompts: list[list[int]], token: int) -> torch.Tensor:
    pool = model.new_state_pool(len(prompts), 64)
    for s, ids in enumerate(prompts):
        model.forward(ForwardBatch.build([SeqChunk(s, 0, tuple(ids))]), pool)
    chunks = [SeqChunk(s, len(ids), (token + s,)) for s, ids in enumerate(prompts)]
    return model.forward(ForwardBatch.build(chunks), pool)


def test_a_small_4bit_model_decodes_from_its_codes(q4, monkeypatch):
    """fp32 on the CPU: decode rows read the 4-bit codes, prefill the unpacked copy; the same
    logits as the model unpacked at load, as the reference path always did."""
    fast = Qwen35Model.load(q4)
    assert all(
        isinstance(w, cpu_f32.CpuPacked)
        for k, w in (*fast.w.items(), ("head", fast.head))
        if k.endswith("proj.weight") or k == "head"
    )
    monkeypatch.setattr(cpu_f32, "takes", lambda dtype, device: False)
    plain = Qwen35Model.load(q4)
    assert isinstance(plain.head, torch.Tensor)
    prompts = [[3, 9, 27, 81, 5], [7] * 12, [11, 13]]
    assert rel_err(_decode_logits(fast, prompts, 40), _decode_logits(plain, prompts, 40)) < 1e-5


def _prefilled(model: Qwen35Model, slots: int, max_tokens: int = 64):
    """A pool (plus a scratch slot) whose slots hold prompts of different lengths."""
    pool = model.new_state_pool(slots + 1, max_tokens)
    g = torch.Generator().manual_seed(5)
    lengths = [3 + 4 * s for s in range(slots)]
    for s, n in enumerate(lengths):
        ids = torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist()
        model.forward(ForwardBatch.build([SeqChunk(s, 0, tuple(ids))]), pool)
    return pool, lengths


# The drafter's target layers a program returns features of (the 4-bit model's programs are
# shared with the engine test below through inductor's cache, so they tap nothing).
TAPS = {"q4_tied": (), "f32_untied": (0, 2)}


@pytest.mark.parametrize("ckpt", ["q4_tied", "f32_untied"])
def test_compiled_decode_equals_the_eager_forward(ckpt, request):
    """A 4-bit tied model and an unquantized one with its own head: a step of 1 and of 2
    streams from their compiled buckets, and of 1 stream padded into the 2-stream bucket (its
    padding row on the scratch slot), one of them a fresh stream at position 0: logits and
    every state of the real slots as the eager forward leaves them; and no program once none
    is ready (the runner then steps eagerly)."""
    model = Qwen35Model.load(request.getfixturevalue(ckpt))
    pool, lengths = _prefilled(model, 3)
    taps = TAPS[ckpt]
    progs = DecodePrograms(model, pool, 2, scratch_slot=3, widths=(), taps=taps)
    assert sorted(progs.ready) == [1, 2]
    start = {k: t.clone() for k, t in pool.tensors.items()}
    cases = [([0], [lengths[0]]), ([1, 2], [lengths[1], 0]), ([2], [lengths[2]])]
    for case, (slots, positions) in enumerate(cases):
        if case == 2:
            progs.ready.pop(1)  # one stream in the 2-stream bucket: a padding row
        tokens = [17 + s for s in slots]
        for k, t in pool.tensors.items():
            t.copy_(start[k])
        chunks = [SeqChunk(s, p, (t,)) for s, p, t in zip(slots, positions, tokens, strict=True)]
        ref = model.forward_ex(ForwardBatch.build(chunks), pool, taps)
        want = ref.logits
        after = {k: t[:, :3].clone() for k, t in pool.tensors.items()}
        for k, t in pool.tensors.items():
            t.copy_(start[k])
        got = progs.run(tokens, positions, slots)
        assert got is not None and got.logits.shape == want.shape
        assert rel_err(got.logits, want) < 1e-5, case
        if taps:  # the drafter's features of the rows, as the eager forward gives them
            assert got.taps.shape == ref.taps.shape and rel_err(got.taps, ref.taps) < 1e-5
        else:
            assert got.taps is None
        for k, t in pool.tensors.items():
            assert rel_err(t[:, :3], after[k]) < 1e-5, (case, k)
    progs.ready.clear()
    assert progs.run([5], [3], [0]) is None


@pytest.mark.parametrize("ckpt", ["q4_tied", "f32_untied"])
def test_compiled_windows_equal_the_eager_forward(ckpt, request):
    """A short prompt chunk of one stream from a compiled window (the next width up, its
    padding rows past the chunk): after a history and fresh at position 0, a chunk as wide as
    its window and narrower ones: the last row's logits, the slot's conv tails and recurrent
    states, and its keys and values at the chunk's rows as the eager forward leaves them; a
    chunk whose padding would pass the slot's rows gets no window."""
    model = Qwen35Model.load(request.getfixturevalue(ckpt))
    pool, lengths = _prefilled(model, 2)
    taps = TAPS[ckpt]
    progs = DecodePrograms(model, pool, 1, scratch_slot=2, widths=(4, 8), taps=taps)
    assert progs.complete and sorted(progs.windows) == [4, 8]
    start = {k: t.clone() for k, t in pool.tensors.items()}
    per_token = {g.name for g in pool.groups if g.per_token}
    cases = [(0, lengths[0], 3), (1, lengths[1], 4), (1, 0, 6), (0, 0, 2), (0, lengths[0], 8)]
    for slot, at, n in cases:
        tokens = tuple(range(20 + n, 20 + 2 * n))
        for k, t in pool.tensors.items():
            t.copy_(start[k])
        ref = model.forward_ex(ForwardBatch.build([SeqChunk(slot, at, tokens, 1)]), pool, taps)
        want = ref.logits
        after = {k: t[:, slot].clone() for k, t in pool.tensors.items()}
        for k, t in pool.tensors.items():
            t.copy_(start[k])
        got = progs.run_window(tokens, at, slot)
        case = (slot, at, n)
        assert got is not None and got.logits.shape == want.shape == (1, model.cfg.vocab_size)
        assert rel_err(got.logits, want) < 1e-5, case
        if taps:  # every row of the chunk, none of its padding
            assert got.taps.shape == ref.taps.shape == (n, len(taps) * model.cfg.hidden_size)
            assert rel_err(got.taps, ref.taps) < 1e-5, case
        for k, t in pool.tensors.items():
            mine, ref = t[:, slot], after[k]
            if k in per_token:  # the chunk's rows (padding wrote past them)
                mine, ref = mine[:, :, : at + n], ref[:, :, : at + n]
            assert rel_err(mine, ref) < 1e-5, (case, k)
    assert progs.run_window((1, 2, 3), pool.max_tokens - 3, 0) is None  # 4 rows would pass it
    assert progs.run_window(tuple(range(9)), 0, 0) is None  # wider than every window


@pytest.mark.parametrize("ckpt", ["q4_tied", "f32_untied"])
def test_compiled_verify_windows_equal_the_eager_window_and_its_rollback(ckpt, request):
    """A chain verify window of one stream from a compiled verify program (its padding rows
    past the window), committed to each kept length: every row's logits and taps as the eager
    recorded window gives them, and the slot's state (conv tails, recurrent states, keys and
    values of the kept rows) as the eager window rolled back to that length leaves it; the
    fixed-size state is untouched until the commit, and a new step forgets an uncommitted
    window."""
    model = Qwen35Model.load(request.getfixturevalue(ckpt))
    pool, lengths = _prefilled(model, 2)
    taps = TAPS[ckpt]
    progs = DecodePrograms(model, pool, 1, scratch_slot=2, widths=(), taps=taps, verify=(4,))
    assert progs.complete and sorted(progs.verifiers) == [4]
    start = {k: t.clone() for k, t in pool.tensors.items()}
    per_token = {g.name for g in pool.groups if g.per_token}
    for slot, n, keep in [(0, 4, 1), (0, 4, 3), (1, 4, 4), (1, 2, 2), (0, 3, 1), (1, 3, 2)]:
        at = lengths[slot]
        tokens = tuple(range(30 + n, 30 + 2 * n))
        for k, t in pool.tensors.items():
            t.copy_(start[k])
        ref = model.forward_ex(
            ForwardBatch.build([SeqChunk(slot, at, tokens, n, record=True)]), pool, taps
        )
        if keep < n:
            model.rollback(pool, slot, ref.records[slot], keep)
        after = {k: t[:, slot].clone() for k, t in pool.tensors.items()}
        for k, t in pool.tensors.items():
            t.copy_(start[k])
        got = progs.run_verify(tokens, at, slot)
        case = (slot, n, keep)
        assert got is not None and got.logits.shape == ref.logits.shape == (n, model.cfg.vocab_size)
        assert rel_err(got.logits, ref.logits) < 1e-5, case
        if taps:
            assert got.taps.shape == ref.taps.shape and rel_err(got.taps, ref.taps) < 1e-5, case
        for k in set(start) - per_token:  # nothing committed yet
            assert torch.equal(pool[k], start[k]), (case, k)
        assert progs.verified(slot) and not progs.verified(1 - slot)
        progs.commit(slot, keep)
        assert not progs.verified(slot)
        for k, t in pool.tensors.items():
            mine, want = t[:, slot], after[k]
            if k in per_token:  # the kept rows (the others are never read)
                mine, want = mine[:, :, : at + keep], want[:, :, : at + keep]
            assert rel_err(mine, want) < 1e-5, (case, k)
    progs.run_verify((1, 2), lengths[0], 0)
    progs.forget()
    assert not progs.verified(0)
    assert progs.run_verify((1, 2, 3), pool.max_tokens - 3, 0) is None  # 4 rows would pass it
    assert progs.run_verify(tuple(range(5)), 0, 0) is None  # wider than every program


def test_the_engine_decodes_from_compiled_programs_as_eagerly(q4_tied, engines):
    """Greedy tokens of three requests on two slots, with compiled decode steps and without."""
    model = Qwen35Model.load(q4_tied)
    tokenizer = tiny.small_tokenizer(model.cfg.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[3, 9, 27], [5, 6, 7, 8, 9, 10], [40]]

    def tokens(compiled: bool) -> list[list[int]]:
        config = EngineConfig(2, 64, scheduling=SchedulingConfig(16, 64), cpu_programs=compiled)
        engine = engines(model, tokenizer, (1,), config)
        if compiled:
            assert sorted(engine.runner.cpu_programs.ready) == [1, 2]
            assert sorted(engine.runner.cpu_programs.windows) == [4, 8, 16, 32]
        collectors = [Collector() for _ in prompts]
        for i, (ids, c) in enumerate(zip(prompts, collectors, strict=True)):
            engine.submit(EngineRequest(f"r{i}", ids, params, 1, c))
        for c in collectors:
            assert c.done.wait(120) and isinstance(c.events[-1], Finish)
        return [[e.token_id for e in c.events if isinstance(e, Piece)] for c in collectors]

    assert tokens(True) == tokens(False)


def test_a_first_start_warms_the_cache_for_the_next(q4_tied, tmp_path, monkeypatch):
    """serve's rule: not compiled here before, the steps are compiled in a separate process,
    which leaves the marker that makes the next start compile them at once."""
    import argparse
    import shutil

    from headstart.engine import cpu_programs
    from headstart.loading import default_model_dir, load
    from headstart.server import serve

    ckpt = tmp_path / "model"
    shutil.copytree(q4_tied, ckpt)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # load() reads a tokenizer too
        shutil.copy(default_model_dir() / name, ckpt / name)
    monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path / "cache"))
    loaded = load(str(ckpt))
    args = argparse.Namespace(
        cpu_compile="auto", tensor_parallel=1, kernels="auto", load_format="auto"
    )
    compile_now, warming = serve._cpu_programs(args, loaded, 1, 64)
    assert not compile_now and warming is not None
    assert warming.wait(300) == 0
    assert serve._cpu_programs(args, loaded, 1, 64) == (True, None)
    assert serve._cpu_programs(argparse.Namespace(**{**vars(args), "cpu_compile": "off"}),
                               loaded, 1, 64) == (False, None)  # fmt: skip
    assert list((tmp_path / "cache" / "programs").iterdir())
    assert not cpu_programs.warm("another-key")


@pytest.mark.parametrize("hd", [16, 40])
@pytest.mark.parametrize("path", ["operator", "c", "stream-by-stream", "gathered"])
def test_cpu_decode_attention_matches_the_reference(path, hd, monkeypatch):
    """Every way the op attends (its C++ kernel; the Python implementation through the C
    kernel; in PyTorch each stream over its slot's rows, or the histories gathered into one
    batch) writes the rows and attends as the reference does, GQA and a fresh row included, a
    head size that is not a multiple of 16 too; rows past a stream's length (here NaN) are
    never read."""
    from headstart.ops import native
    from headstart.ops.attention import cpu as cpu_attention
    from headstart.ops.attention.reference import attend_decode

    if path == "operator" and not native.load():
        pytest.skip("no C++ compiler here")
    if path == "c" and cpu_attention._kernel() is None:
        pytest.skip("no C compiler here")
    if path in ("stream-by-stream", "gathered"):
        monkeypatch.setattr(cpu_attention, "_kernel", lambda: None)
        rows = 0 if path == "stream-by-stream" else 1 << 20
        monkeypatch.setattr(cpu_attention, "GATHER_ROWS", rows)
    attend = (
        cpu_attention.decode_attention if path == "operator" else cpu_attention._decode_attention
    )
    g = torch.Generator().manual_seed(9 + hd)
    layers, slots_n, nkv, nh, max_tokens = 2, 5, 2, 4, 40
    keys = torch.randn(layers, slots_n, nkv, max_tokens, hd, generator=g)
    values = torch.randn(layers, slots_n, nkv, max_tokens, hd, generator=g)
    slots, positions = torch.tensor([3, 0, 4]), torch.tensor([17, 0, 33])
    for s, p in zip(slots.tolist(), positions.tolist(), strict=True):
        keys[:, s, :, p + 1 :] = float("nan")
        values[:, s, :, p + 1 :] = float("nan")
    q = torch.randn(3, nh, hd, generator=g) * 3  # peaked softmaxes as well as flat ones
    k, v = torch.randn(3, nkv, hd, generator=g), torch.randn(3, nkv, hd, generator=g)
    want_keys, want_values = keys.clone(), values.clone()
    want_keys[1, slots, :, positions], want_values[1, slots, :, positions] = k, v
    longest = int(positions.max()) + 1
    want = attend_decode(
        q, want_keys[1, slots, :, :longest], want_values[1, slots, :, :longest], positions + 1
    )
    got = attend(q, k, v, keys, values, 1, slots, positions)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(keys.nan_to_num(), want_keys.nan_to_num())
    assert torch.equal(values.nan_to_num(), want_values.nan_to_num())


def test_a_drafting_engine_steps_from_compiled_programs(f32_untied, tmp_path, engines):
    """With a drafter the compiled programs return the tapped features too, so a drafting
    stream's plain steps and prompt chunks run compiled (before, any step that wanted taps ran
    eagerly), and its verify windows run from verify programs; greedy tokens with drafts
    equal those without, compiled or eager."""
    from transformers import Qwen3_5TextConfig

    from headstart.engine.config import SpecConfig
    from headstart.engine.spec.drafter import DFlashDrafter

    model = Qwen35Model.load(f32_untied)
    shape = Qwen3_5TextConfig.from_pretrained(f32_untied)
    drafter_dir = tiny.save_drafter(tmp_path / "d", shape, taps=[0, 2], block=5)
    tokenizer = tiny.small_tokenizer(model.cfg.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [[3, 9, 27, 8, 1], [5, 6, 7], [11, 2, 4, 9]]

    def tokens(compiled: bool, drafter: bool) -> list[list[int]]:
        config = EngineConfig(
            1, 48, cpu_programs=compiled, spec=SpecConfig(mode="chain" if drafter else "auto")
        )
        # Right for every length of prefix: rounds keep every length of window.
        d = PartOracle(DFlashDrafter.load(drafter_dir, model), salt=5) if drafter else None
        engine = engines(model, tokenizer, (), config, drafter=d)
        if d is not None:
            d.engine = engine
        programs = engine.runner.cpu_programs
        if compiled:
            assert programs is not None and programs.taps == ((0, 2) if drafter else ())
            assert sorted(programs.verifiers) == ([4, 5] if drafter else [])
            ran, kept = [], []
            run, run_window, commit = programs.run, programs.run_window, programs.commit
            programs.run = lambda *a: ran.append("decode") or run(*a)
            programs.run_window = lambda *a: ran.append("window") or run_window(*a)
            programs.commit = lambda slot, keep: kept.append(keep) or commit(slot, keep)
        out = []
        for i, ids in enumerate(prompts):
            c = Collector()
            engine.submit(EngineRequest(f"r{i}", ids, params, 30, c))
            assert c.done.wait(120) and isinstance(c.events[-1], Finish)
            out.append([e.token_id for e in c.events if isinstance(e, Piece)])
        if compiled and drafter:  # verify windows from programs, of every kept length
            assert "window" in ran and set(kept) == {1, 2, 3, 4, 5}
            assert engine.stats()["spec_rounds"] == len(kept)
        return out

    plain = tokens(False, False)
    assert tokens(True, True) == tokens(False, True) == plain
