"""Tensor parallelism on the CPU: two processes over gloo give the single-process model's logits.

This test process is rank 0 of a group of two (the worker is a real spawned process, as under
``serve --tensor-parallel 2``); every comparison runs the same steps through a one-process model
of the same checkpoint and a model split over the group, and compares their logits (float32,
within 1e-4): prefill, decode, a prompt-cache hit (restored from either tier, then continued) and
speculative rounds (a chain window rolled back, a tree window committed), plus greedy tokens
through the engine with a drafter on rank 0 and through a real server. Refused splits are checked
without starting anything.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import openai
import pytest
import tiny
import torch
from engine_helpers import Collector
from server_proc import ServerProcess

from headstart.batch import SeqChunk
from headstart.engine.config import CacheConfig, EngineConfig, SchedulingConfig, SpecConfig
from headstart.engine.engine import EngineRequest, Finish
from headstart.engine.prompt_cache_tiers import PromptCache
from headstart.engine.runner import ModelRunner, Step
from headstart.engine.spec.drafter import DFlashDrafter
from headstart.errors import HeadstartError
from headstart.loading import check_tensor_parallel
from headstart.models import family_for
from headstart.models.qwen35 import FAMILY
from headstart.models.qwen35.config import load_config
from headstart.models.qwen35.model import Qwen35Model
from headstart.models.qwen35.shard import check_split, shard, valid_sizes
from headstart.parallel import launch
from headstart.quant import quantize
from headstart.sampling import SamplingParams

TOL = 1e-4


# -- checkpoints -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny random checkpoints: GQA with more GDN value than key heads (untied); tied with an
    odd vocabulary (its last rank's rows padded) and as many key/value as query heads; MLX
    4-bit with every row-parallel input split in whole groups."""
    tmp = tmp_path_factory.mktemp("tp")
    gqa = tiny.save_text_only(tiny.causal_lm(seed=5), tmp / "gqa")
    tied = tiny.causal_lm(
        seed=6,
        vocab_size=161,
        tie_word_embeddings=True,
        num_key_value_heads=4,
        linear_num_key_heads=4,
        linear_num_value_heads=4,
    )
    tied = tiny.save_text_only(tied, tmp / "tied")
    model = tiny.causal_lm(seed=7, intermediate_size=256, linear_value_head_dim=32)
    ref, packed = tiny.dequantized_copy(model, 4, 64)
    mlx = tiny.save_mlx(ref, packed, tmp / "mlx", 4, 64)
    return {"gqa": gqa, "tied": tied, "mlx": mlx}


@pytest.fixture(scope="module")
def peers():
    """Rank 0 of a group of two processes over gloo (for the whole module)."""
    threads = torch.get_num_threads()
    group = launch.start(2, "cpu")
    yield group
    group.close()
    torch.set_num_threads(threads)


def models(peers, path: Path, dummy: bool = False):
    """(the one-process model of ``path``, rank 0 of it split over ``peers``); ``dummy``:
    random weights at its shapes (each rank makes them all, with the same seed, and keeps its
    part)."""
    extra = {"dummy": True} if dummy else {}
    tp = launch.load_shards(peers, FAMILY, path, torch.float32, "cpu", "auto", extra)
    return Qwen35Model.load(path, dummy=dummy), tp


def runners(peers, path: Path, slots: int = 4, context: int = 128, dummy: bool = False):
    ref, tp = models(peers, path, dummy)
    config = EngineConfig(slots, context)
    return ModelRunner(ref, config), ModelRunner(tp, config)


def same(a: ModelRunner, b: ModelRunner, *chunks: SeqChunk) -> torch.Tensor:
    """Run the step on both runners; their logits agree. The one-process logits."""
    step = Step(tuple(chunks))
    want, got = a.run(step).logits, b.run(step).logits
    assert want.shape == got.shape
    assert (want - got).abs().max().item() <= TOL
    return want


def prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple((seed * 7 + 13 * j) % 150 + 5 for j in range(n))


# -- splits (no processes) ---------------------------------------------------------------------
def test_refused_splits_name_the_counts(checkpoints):
    cfg = load_config(checkpoints["gqa"])  # 4 heads, 2 key/value heads, 2 GDN key heads
    with pytest.raises(HeadstartError, match=r"num_key_value_heads 2.*sizes that split it: 1, 2"):
        check_split(cfg, 4)
    with pytest.raises(HeadstartError, match="num_attention_heads 4"):
        check_tensor_parallel(FAMILY, checkpoints["gqa"], 3)
    # Heads that divide, but 4-bit groups of 64 that a split would cut (o_proj: 4 x 32 inputs).
    mlx = load_config(checkpoints["mlx"])
    wide = dataclasses.replace(mlx, num_key_value_heads=4, linear_num_key_heads=4)
    assert valid_sizes(wide) == [1, 2]
    with pytest.raises(HeadstartError, match="self_attn.o_proj input 128 in 4-bit groups of 64"):
        check_split(wide, 4)


def test_a_family_without_tensor_parallelism_is_refused(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NemotronHForCausalLM"]}))
    family = family_for(tmp_path)
    assert family.name == "nemotron_h"
    with pytest.raises(HeadstartError, match="nemotron_h family has no tensor-parallel support"):
        check_tensor_parallel(family, tmp_path, 2)
    check_tensor_parallel(family, tmp_path, 1)  # one process: nothing to refuse


def test_quantized_cuts_fall_on_groups(checkpoints):
    """A 4-bit weight cut as stored (rows, or whole groups of columns) dequantizes to the cut
    of its dequantized weight."""
    cfg = load_config(checkpoints["mlx"])
    hidden, inner = cfg.hidden_size, cfg.intermediate_size
    cut = {  # row-parallel (columns cut) and column-parallel (rows cut)
        "layers.0.mlp.down_proj.weight": quantize(torch.randn(hidden, inner), 4, 64),
        "layers.0.mlp.up_proj.weight": quantize(torch.randn(inner, hidden), 4, 64),
    }
    for name, q in cut.items():
        for rank in range(2):
            want = shard(name, q.dequantize(), cfg, rank, 2)
            assert torch.equal(shard(name, q, cfg, rank, 2).dequantize(), want)


# -- logits over gloo --------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gqa", "tied", "mlx", "mlx-dummy"])
def test_prefill_and_decode_logits_equal_one_process(peers, checkpoints, kind):
    name, _, dummy = kind.partition("-")
    a, b = runners(peers, checkpoints[name], dummy=bool(dummy))
    p0, p1, p2 = prompt(21, 1), prompt(9, 2), prompt(12, 3)
    same(a, b, SeqChunk(0, 0, p0), SeqChunk(1, 0, p1))  # two new prompts in one step
    same(a, b, SeqChunk(2, 0, p2[:5]))  # one alone
    lengths = [len(p0), len(p1), 5]
    logits = same(  # decode rows beside a continued chunk
        a, b, SeqChunk(0, lengths[0], (3,)), SeqChunk(1, lengths[1], (4,)), SeqChunk(2, 5, p2[5:])
    )
    lengths = [lengths[0] + 1, lengths[1] + 1, len(p2)]
    for _ in range(4):  # greedy decode of all three
        tokens = logits.argmax(-1).tolist()
        logits = same(a, b, *(SeqChunk(s, lengths[s], (tokens[s],)) for s in range(3)))
        lengths = [n + 1 for n in lengths]
    # Rank 0's pool holds the state of its own heads: the first half of each kind.
    n = lengths[0]
    for want, got in (
        (a.pool.keys[:, 0, :, :n], b.pool.keys[:, 0, :, :n]),  # [layers, heads, tokens, dim]
        (a.pool.recurrent[:, 0], b.pool.recurrent[:, 0]),  # [layers, heads, Dk, Dv]
    ):
        half = want.shape[1] // 2
        assert got.shape[1] == half and (got - want[:, :half]).abs().max() <= TOL


@pytest.mark.slow
def test_a_prompt_cache_hit_from_either_tier_continues_as_one_process(peers, checkpoints):
    a, b = runners(peers, checkpoints["gqa"])
    # One snapshot row: a second snapshot moves the first to the host tier.
    config = CacheConfig(bytes=4 << 20, host_bytes=16 << 20, max_snapshots=1)
    caches = [PromptCache(r.pool, config, 160, r.twins) for r in (a, b)]
    assert caches[0].twins is None and caches[1].twins is not None
    first, second, tail = prompt(30, 4), prompt(18, 5), (9, 8, 7)
    for tokens in (first, second):
        logits = same(a, b, SeqChunk(0, 0, tokens))
        for cache in caches:
            assert cache.insert(tokens, 0, logits[0], lambda: None)
    same(a, b, SeqChunk(0, 0, prompt(25, 6)))  # slot 0 now holds something else
    for tokens, slot, tier in ((first, 1, "host"), (second, 2, "device")):
        for cache in caches:
            match = cache.match_prefix(tokens + tail)
            assert match.entry.length == len(tokens)
            assert (match.index is cache.host) == (tier == "host")
            assert cache.restore(match, slot) is not None
        logits = same(a, b, SeqChunk(slot, len(tokens), tail))
        for t in range(3):
            token = (int(logits.argmax()),)
            logits = same(a, b, SeqChunk(slot, len(tokens) + len(tail) + t, token))


@pytest.mark.slow
def test_speculative_rounds_roll_back_and_commit_as_one_process(peers, checkpoints):
    a, b = runners(peers, checkpoints["gqa"])
    p = prompt(17, 7)
    same(a, b, SeqChunk(0, 0, p), SeqChunk(1, 0, p[:6]))
    n = len(p)
    window = (11, 22, 33, 44, 55)
    same(a, b, SeqChunk(0, n, window, len(window), record=True), SeqChunk(1, 6, (5,)))
    for r in (a, b):
        r.commit(0, [0, 1, 2])  # a chain: the anchor and two drafts kept, the rest rolled back
    n += 3
    same(a, b, SeqChunk(0, n, (66,)), SeqChunk(1, 7, (6,)))
    n += 1
    tokens, parents = (17, 40, 41, 50, 51, 52), (-1, 0, 0, 1, 1, 2)
    same(a, b, SeqChunk(0, n, tokens, len(tokens), parents=parents))
    for r in (a, b):
        r.commit(0, [0, 1, 4])
    n += 3
    logits = same(a, b, SeqChunk(0, n, (99,)), SeqChunk(1, 8, (7,)))
    same(a, b, SeqChunk(0, n + 1, (int(logits[0].argmax()),)))


@pytest.mark.slow
def test_engine_with_a_drafter_and_the_cache_gives_one_process_greedy_tokens(
    peers, checkpoints, engines, tmp_path
):
    """The drafter on rank 0 reads the target's embedding and head: those run on every rank."""
    ref, tp = models(peers, checkpoints["gqa"])
    hf = tiny.text_config()
    drafter_dir = tiny.save_drafter(tmp_path / "drafter", hf, taps=[0, 2], block=4)
    tokenizer = tiny.small_tokenizer()
    config = EngineConfig(
        4,
        256,
        scheduling=SchedulingConfig(16, 48),
        cache=CacheConfig(bytes=8 << 20),
        spec=SpecConfig(mode="chain"),
    )
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [list(prompt(n, n)) for n in (5, 23, 40)]
    prompts.append(prompts[1])  # a repeat: restored from the cache
    tokens = []
    for model in (ref, tp):
        drafter = DFlashDrafter.load(drafter_dir, model)
        engine = engines(model, tokenizer, (), config, drafter=drafter)
        got = []
        for i, ids in enumerate(prompts):  # one after another: the repeat finds the snapshot
            c = Collector()
            engine.submit(EngineRequest(f"r{i}", ids, greedy, 12, c))
            assert c.done.wait(60) and isinstance(c.finish, Finish)
            got.append(c.tokens)
        stats = engine.stats()
        assert stats["spec_rounds"] > 0 and stats["cache_hits"] >= 1
        engine.stop()
        tokens.append(got)
    assert tokens[0] == tokens[1]


# -- a real server -----------------------------------------------------------------------------
def _children(pid: int) -> set[int]:
    found = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found.update(int(c) for c in f.read().split())
    return found


@pytest.mark.slow
def test_serve_tensor_parallel_answers_as_one_process():
    """``serve --tensor-parallel 2`` (the embedded 4-bit model, gloo) answers the official
    client with one process's greedy tokens, a repeat from the cache; its worker exits with
    it."""
    args = ("--device", "cpu", "--parallel", "4", "--context", "512")
    servers = [ServerProcess(*args), ServerProcess(*args, "--tensor-parallel", "2")]
    answers = []
    try:
        for srv in servers:
            srv.wait_ready(120)
        workers = _children(servers[1].proc.pid)
        assert workers, "the tensor-parallel server has a worker process"
        for srv in servers:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0)
            got = []
            for text in ("hello there", "count to ten", "hello there"):
                r = client.completions.create(
                    model="headstart-default",
                    prompt=text,
                    max_tokens=16,
                    temperature=0,
                    logprobs=1,
                    extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
                )
                got.append(r.choices[0].logprobs.tokens)
            assert r.usage.prompt_tokens_details.cached_tokens > 0
            answers.append(got)
        assert answers[0] == answers[1]
        assert "tensor parallel: 2 ranks over gloo" in servers[1].output()
    finally:
        codes = [srv.stop() for srv in servers]
    assert codes == [0, 0], servers[1].output()
    # Rank 0 joins its worker before it exits; multiprocessing's resource tracker (a child too)
    # leaves once its pipe closes, a moment after: a few seconds' grace, then none may be left.
    deadline = time.monotonic() + 5
    while not all(_zombie(p) for p in workers):
        assert time.monotonic() < deadline, f"a child of rank 0 outlived it: {workers}"
        time.sleep(0.05)


def _zombie(pid: int) -> bool:
    """Whether ``pid`` is a zombie, or gone (it may exit between two looks)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# -- a worker that dies (last: the group is gone after it) -------------------------------------
@pytest.mark.slow
def test_a_dead_worker_fails_calls_at_once(peers, checkpoints):
    _, tp = models(peers, checkpoints["gqa"])
    runner = ModelRunner(tp, EngineConfig(2, 64))
    runner.run(Step((SeqChunk(0, 0, prompt(8, 1)),)))
    peers._processes[0].kill()
    peers._processes[0].join(10)
    with pytest.raises(RuntimeError, match="rank 1"):
        for _ in range(50):  # the watcher marks the group lost as the process goes
            runner.run(Step((SeqChunk(0, 0, prompt(8, 1)),)))
