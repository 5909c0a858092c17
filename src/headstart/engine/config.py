"""The engine's settings, one frozen value per concern, composed into :class:`EngineConfig`.

Every field has the default the server uses unless told otherwise, so a caller names only what
it changes: ``EngineConfig(4, 256, cache=CacheConfig(bytes=64 << 20))``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Dense bf16 tensor-core FLOPs per SM per clock, by compute capability major (A100: 2048,
# H100/H200: 4096, B200: 8192; consumer parts of a major have fewer, 8.6/8.9: 512).
_FLOPS_PER_SM_CLOCK = {8: 2048, 9: 4096, 10: 8192}
_CLOCK = 1.7e9  # a typical sustained tensor-core clock; the estimate needs no more precision
_STEP_SECONDS = 0.2  # a step's compute at the default budget: the worst decode gap it causes


def default_step_tokens(parameters: int | None, device: str, compute: tuple[int, int, int]) -> int:
    """The step token budget for a model of ``parameters`` weights on ``device`` ("cuda" with
    ``compute`` = (major, minor, SM count), or "cpu"): the most tokens whose prefill compute
    (2 FLOPs per weight per token, at 80% of the device's dense bf16 peak) fits in about 0.2 s,
    so a long prompt goes in the largest chunks that still let decoding streams emit a token
    every ~0.2 s; a power of two in 512 .. 8192. The CPU keeps 512 (llama.cpp's micro-batch):
    its chunks are compute-bound from the first tokens."""
    if device != "cuda" or not parameters:
        return 512
    major, minor, sms = compute
    per_clock = _FLOPS_PER_SM_CLOCK.get(major, 1024)
    if (major, minor) in ((8, 6), (8, 7), (8, 9)):
        per_clock = 512
    peak = 0.8 * sms * per_clock * _CLOCK
    tokens = _STEP_SECONDS * peak / (2 * parameters)
    budget = 512
    while budget * 2 <= min(tokens, 8192):
        budget *= 2
    return budget


@dataclass(frozen=True)
class SchedulingConfig:
    """``prefill_chunk``: the most prompt tokens of one stream in a step; ``step_tokens``: the
    most rows of a step (decode rows first, then prompt chunks). ``gather_gap_s`` /
    ``gather_max_s``: an idle engine woken by a request waits until no other request has
    arrived for ``gather_gap_s`` (at most ``gather_max_s`` in all) before its first step, so
    that requests sent together start in one step instead of the first alone and the rest one
    step later (0: no wait)."""

    prefill_chunk: int = 512
    step_tokens: int = 2048
    gather_gap_s: float = 0.0005
    gather_max_s: float = 0.004


@dataclass(frozen=True)
class CacheConfig:
    """The prompt-state cache. ``bytes``: the device tier's budget (0 turns the cache off);
    ``host_bytes``: a second tier in host memory for snapshots the first evicts; ``max_tokens``:
    the longest prefix worth an entry (0: no cap); ``interval``: long prompts are also
    snapshotted every ``interval`` tokens (0: only at the end and the requested boundaries);
    ``max_snapshots``: the most device snapshots (rows of preallocated fixed-size storage)."""

    bytes: int = 0
    host_bytes: int = 0
    # Demotions to the host tier copied by a worker thread, off the engine's steps (None: on
    # CUDA; on a CPU the "host copy" is a memcpy in the same memory, done in place).
    async_demotion: bool | None = None
    max_tokens: int = 0
    interval: int = 1024
    max_snapshots: int = 256


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding, used when the engine has a drafter. ``draft_block``: the rows of a
    verify window (default: the drafter's block size); ``draft_window``: context rows per
    stream in the drafter's ring; ``mode``: "chain", "tree" or "auto" (the planner picks per
    round, and whether to draft at all, from measured costs); ``tree_width``: children per
    tree node; ``tree_budget``: tree nodes (default: twice the drafts of a chain)."""

    draft_block: int | None = None
    draft_window: int = 4096
    mode: str = "auto"
    tree_width: int = 4
    tree_budget: int | None = None


@dataclass(frozen=True)
class GraphConfig:
    """CUDA graphs. ``enabled``: replay decode steps and new prompts of up to
    ``prefill_tokens`` tokens from graphs (None: when the kernels allow it, on a GPU), several
    prompts in one replay up to ``prefill_rows`` padded rows; ``capture=False`` keeps every
    graph's bookkeeping but runs eagerly (tests on a CPU); ``windows``: with a drafter, also
    proposals, chain verify windows and rollbacks; ``rounds``: with those, also whole greedy
    rounds (proposal, window, verdict and commit in one replay: engine/spec/round.py);
    ``continuations``: continued prefill chunks of up to ``continuation_tokens`` tokens.
    ``shard`` (i, n): warm up and capture only every n-th shape from the i-th, in the order
    the start-up takes them (a compile-ahead process, one of n that share the work; its engine
    never serves)."""

    enabled: bool | None = None
    capture: bool = True
    prefill_tokens: int = 1024
    prefill_rows: int = 2048
    windows: bool = True
    rounds: bool = True
    continuations: bool = True
    continuation_tokens: int = 1024
    shard: tuple[int, int] | None = None


@dataclass(frozen=True)
class ThreadConfig:
    """Intra-op threads of the engine's forwards on a CPU. ``decode``: steps of decode rows
    only (short operations, where one thread descheduled by the HTTP loop stalls the step);
    ``prefill``: steps that run prompt tokens (a chunk of more than one row: long,
    compute-bound operations that every core shortens); ``wide_rows``: decode steps of at
    least this many rows take the prefill count too (None: never)."""

    decode: int
    prefill: int
    wide_rows: int | None = None


@dataclass(frozen=True)
class EngineConfig:
    """``num_slots`` streams run at once, each up to ``context`` tokens (prompt and output);
    beyond the slots, at most ``max_queue`` requests wait."""

    num_slots: int
    context: int
    max_queue: int = 256
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    graphs: GraphConfig = field(default_factory=GraphConfig)
    # Compiled decode steps on the CPU (engine/cpu_programs.py), compiled at start-up: None:
    # when the model offers a traceable decode step there (``serve``'s default); off by
    # default here, so that engines made in process (tests) compile nothing unasked.
    cpu_programs: bool | None = False
    # None: the forwards run with torch's thread setting as it is.
    threads: ThreadConfig | None = None
