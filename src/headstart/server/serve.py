"""``headstart serve``: load the model, start the engine, run the HTTP server until a signal.

Start-up refuses a bad or busy ``--host``/``--port`` and an unsafe API key file before loading
anything: the listening socket is bound first and handed to uvicorn. SIGHUP rereads the key file.

The first SIGTERM/SIGINT starts a drain: the listener stays open, ``/health`` answers 503
(``"status": "draining"``) and new requests get 503 (both from the app, which reads
``ServerState.draining``), while running streams get ``--shutdown-timeout`` seconds to finish;
the rest are then ended with a final chunk (finish_reason "abort"). Only when no request is left
in the engine (or a short grace after ending them has passed) does uvicorn close the listener,
let responses flush, and exit; the status is 0. A second signal exits at once.

Connections are bounded by :mod:`headstart.server.connection` (``--header-timeout``,
``--keep-alive-timeout``, a 64 KiB request head).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import gc
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import anyio
import uvicorn

from headstart.errors import HeadstartError
from headstart.server.connection import parser_names, uvicorn_connection_options

if TYPE_CHECKING:
    from headstart.engine.config import ThreadConfig
    from headstart.loading import LoadedModel
    from headstart.server.api import ServerState
    from headstart.server.auth import ApiKeys
    from headstart.server.compile_ahead import CompileAhead

log = logging.getLogger("headstart.serve")


def _auto_or_off(p: argparse.ArgumentParser, flag: str, env: str, help: str) -> None:
    """A flag of "auto" or "off", its default from the environment variable ``env``."""
    p.add_argument(flag, choices=["auto", "off"], default=os.environ.get(env, "auto"), help=help)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    p.add_argument(
        "--port",
        type=int,
        default=8888,
        help="TCP port to listen on, 1..65535 (default: %(default)s)",
    )
    p.add_argument(
        "--parallel",
        type=int,
        default=None,
        help="concurrent streams (slots); default 16 (on CPU too: measured best, "
        "see BENCHMARKS.md)",
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="tokens per stream, prompt included (default: min(32768, model max))",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests that may wait for a slot before new ones get 429",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="cap on tokens generated per request (default: the context)",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        help="file with one API key per line (mode 600); required on /v1/*",
    )
    p.add_argument("--request-log", default=None, help="append one JSON line per request here")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send (default: the model folder's name)",
    )
    p.add_argument(
        "--prompt-cache-mib",
        type=int,
        default=2048,
        help="byte budget of the prompt-state cache in MiB (0 disables it)",
    )
    p.add_argument(
        "--prompt-cache-host-mib",
        type=int,
        default=0,
        help="second prompt-cache tier in host RAM for snapshots evicted from the "
        "first (MiB; 0: none)",
    )
    p.add_argument(
        "--prompt-cache-max-tokens",
        type=int,
        default=0,
        help="longest prefix one snapshot may hold (0: no cap)",
    )
    p.add_argument(
        "--prompt-cache-interval",
        type=int,
        default=None,
        help="also snapshot long prompts every N tokens (0: only at turn ends; default: "
        "--max-batched-tokens, so snapshots fall where chunks end anyway)",
    )
    p.add_argument(
        "--burst-gather-ms",
        type=float,
        default=4.0,
        metavar="MS",
        help="an idle server woken by a request waits until no other request has arrived for "
        "0.5 ms, at most this long, so that requests sent together start in one engine step "
        "(0: start at once)",
    )
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        metavar="MS",
        help="how long a thread waiting for the interpreter waits before it asks the running "
        "one to let go (sys.setswitchinterval; default: Python's 5 ms). The event loop, the "
        "engine thread and the body parsers take turns: a shorter interval hands a burst's "
        "requests over sooner",
    )
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        metavar="N",
        help="the most tokens one engine step runs (decode rows, then prompt chunks of up to "
        "N tokens; vLLM's max_num_batched_tokens). Default: sized to the model and device, "
        "the most tokens whose prefill takes about 0.2 s at the GPU's peak (27B on an "
        "H200: 2048; 2B: 8192); 512 on a CPU",
    )
    p.add_argument(
        "--drafter", default=None, help="DFlash drafter checkpoint folder: speculative decoding on"
    )
    p.add_argument(
        "--no-drafter",
        action="store_true",
        help="never use the drafter shipped with the embedded default model (without this flag "
        "it is used only on the device types its headstart.json lists: the GPU today); serve "
        "drafts only with --drafter or that shipped drafter",
    )
    p.add_argument(
        "--spec-mode",
        default="auto",
        choices=["auto", "chain", "tree"],
        help="with a drafter: auto (each step drafts a chain or a tree, or not at all, as the "
        "measured costs and running acceptance say), chain (every step drafts a chain: greedy "
        "streams then run whole rounds on a GPU; the default model there: 1.6x plain decode "
        "against auto's 1.04x, BENCHMARKS.md) or tree",
    )
    p.add_argument(
        "--draft-block",
        type=int,
        default=None,
        help="tokens per verify window, anchor included (default: the drafter's)",
    )
    p.add_argument(
        "--draft-window",
        type=int,
        default=4096,
        help="target rows of context the drafter keeps per stream",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights at the checkpoint's shapes, from its config.json alone "
        "(speed measurements without the weights, as vLLM's --load-format dummy)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="debug also logs every engine step's shape and times",
    )
    p.add_argument(
        "--prefill-weights",
        default="auto",
        choices=["auto", "dense", "packed"],
        help="4-bit checkpoints on the GPU: dense keeps a 16-bit copy of each layer weight for "
        "prefill matmuls (faster prompts, 4x the weights' memory more); packed unpacks per "
        "prefill step; auto: dense when the copies fit 40%% of the GPU's memory, else copies of "
        "the first layers that fit beside the state pool",
    )
    p.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "reference", "cpu", "gpu"],
        help="auto: GPU kernels on CUDA, the CPU set (the reference with SDPA prefill "
        "attention and a C convolution kernel) elsewhere; or one set by name",
    )
    p.add_argument("--no-graphs", action="store_true", help="never capture CUDA graphs")
    _auto_or_off(
        p,
        "--cpu-compile",
        "HEADSTART_CPU_COMPILE",
        "on a CPU, run fp32 decode steps compiled per stream bucket (auto: for models that "
        "offer it; the first start serves eagerly while a low-priority process compiles them, "
        "a few minutes on 2 cores for the default model; later starts load them from the "
        "compiler's cache, about 15 s); default from HEADSTART_CPU_COMPILE, else auto",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="CPU threads of the engine's decode steps (torch intra-op) on a CPU device; "
        "default: the usable cores less one, left to the HTTP loop, at least 1, and "
        "--threads-batch for a model of 256 MiB of weights or more, whose steps read them all "
        "(see BENCHMARKS.md); with --tensor-parallel the cores are shared out instead",
    )
    _auto_or_off(
        p,
        "--compile-ahead",
        "HEADSTART_COMPILE_AHEAD",
        "on a GPU, compile the kernels in a second process (the model cut to its first "
        "layers, random weights) while the weights load, so a first start on a fresh machine "
        "waits less (auto: for Qwen3.5 models of more layers than that); default from "
        "HEADSTART_COMPILE_AHEAD, else auto",
    )
    # The compile-ahead process: start up (load, warm-up, graph captures), then exit.
    p.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)
    # One of several compile-ahead processes: I/N, its share of the shapes.
    p.add_argument("--warm-shard", type=_shard, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--threads-batch",
        type=int,
        default=None,
        metavar="N",
        help="CPU threads of the steps that run prompt tokens (llama.cpp's --threads-batch): "
        "long, compute-bound operations that every core shortens; default: all usable cores",
    )
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N processes, one GPU each (NCCL; on a CPU: gloo, the "
        "cores shared out): attention, GDN heads and the MLP per rank, embedding and head by "
        "vocabulary; N must divide the head counts. Qwen3.5 only; no CUDA graphs when N > 1 "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--window-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with a drafter, replay its proposals, chain verify windows and "
        "rollbacks from CUDA graphs (27B on an H200: an 8-row window costs 1.35 "
        "decode steps instead of 6.6)",
    )
    p.add_argument(
        "--round-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with window graphs, run a greedy stream's whole round (proposal, window, "
        "verdict, rollback) as one CUDA graph replay, the next launched before this one's "
        "tokens are delivered (the default model on an H200: 1.22 ms a round instead of "
        "several replays and read-backs)",
    )
    p.add_argument(
        "--continuation-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replay continued prefill chunks (a new turn after a prompt-cache hit) from "
        "CUDA graphs, each padded to the next of a few widths (27B on an H200: 21 ms instead "
        "of 167 for 30 tokens; costs start-up time)",
    )
    p.add_argument(
        "--continuation-graph-tokens",
        type=int,
        default=1024,
        metavar="N",
        help="the longest continued chunk replayed from a graph: an agent's tool result or a "
        "pasted file appended to a cached conversation (default: %(default)s)",
    )
    p.add_argument(
        "--prefill-graph-tokens",
        type=int,
        default=1024,
        help="replay new prompts of up to N tokens from CUDA graphs captured at start-up, "
        "several prompts per replay, each padded to 16, 32, ... tokens (0: none)",
    )
    p.add_argument(
        "--prefill-graph-rows",
        type=int,
        default=None,
        metavar="N",
        help="the most padded rows (prompts x width) of one prompt graph (default: "
        "--max-batched-tokens)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds running streams get to finish on SIGTERM/SIGINT before they are "
        "ended; a second signal exits at once (default: %(default)s)",
    )
    p.add_argument(
        "--max-body-mib",
        type=float,
        default=8.0,
        help="larger request bodies get 413, in MiB (default: %(default)s)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request body may take to arrive before 408 (default: %(default)s)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a request's headers may take to arrive, from the connection's "
        "start or a kept-alive request's first byte; then the connection is "
        "closed (0: no limit; default: %(default)s)",
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        help="seconds an idle kept-alive connection stays open after a response "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--http-parser",
        choices=parser_names(),
        default=parser_names()[0],
        help="how request heads are parsed: httptools (llhttp, in C) or h11 (pure Python); "
        "both apply the same timeouts and bounds (default: %(default)s)",
    )
    p.add_argument(
        "--metrics-open",
        action="store_true",
        help="serve /metrics without an API key even with --api-key-file (default: off)",
    )


def _check_args(args: argparse.Namespace) -> None:
    """Raise HeadstartError naming the first flag out of range (nothing has been loaded yet)."""
    if not 1 <= args.port <= 65535:
        raise HeadstartError(f"--port {args.port} is out of range (1..65535)")
    if not args.max_body_mib > 0:
        raise HeadstartError(f"--max-body-mib must be > 0, not {args.max_body_mib:g}")
    if not args.body_timeout > 0:
        raise HeadstartError(f"--body-timeout must be > 0, not {args.body_timeout:g}")
    if args.tensor_parallel < 1:
        raise HeadstartError(f"--tensor-parallel must be >= 1, not {args.tensor_parallel}")
    if getattr(args, "threads", None) is not None and args.threads < 1:
        raise HeadstartError(f"--threads must be >= 1, not {args.threads}")
    ms = getattr(args, "switch_interval_ms", None)
    if ms is not None and not 0 < ms <= 1000:  # also refuses nan
        raise HeadstartError(f"--switch-interval-ms must be in (0, 1000], not {ms:g}")
    for flag in ("header_timeout", "keep_alive_timeout", "shutdown_timeout"):
        value = getattr(args, flag)
        if not value >= 0:  # also refuses nan
            raise HeadstartError(f"--{flag.replace('_', '-')} must be >= 0, not {value:g}")


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound (not yet listening) to every address ``host`` resolves to, at ``port``.

    Binds as asyncio's ``create_server`` would (SO_REUSEADDR, IPv6 sockets IPv6-only, addresses
    of a family the machine lacks skipped), so that uvicorn can listen on them later through
    ``Server.run(sockets=...)``. Until then connections are refused rather than queued, so a
    client cannot mistake a server still loading for a hung one. Raises HeadstartError, in one
    line naming the address, when the host does not resolve or an address cannot be bound
    (typically: the port is in use).
    """
    where = _address(host, port)
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise HeadstartError(f"cannot listen on {where}: {e.strerror}") from None
    socks: list[socket.socket] = []
    seen: set[tuple] = set()
    try:
        for family, kind, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL and len(infos) > 1:
                    socks.pop().close()  # e.g. "localhost" resolving to ::1 without IPv6
                    continue
                hint = "; is another server running?" if e.errno == errno.EADDRINUSE else ""
                raise HeadstartError(f"cannot listen on {where}: {e.strerror}{hint}") from None
        if not socks:
            raise HeadstartError(f"cannot listen on {where}: no usable address")
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


class _Drain:
    """The shutdown sequence a first signal starts (see the module docstring).

    ``begin`` only sets attributes, so it is safe to call from a signal handler; ``poll`` does
    the rest (logging, ending streams) on the event loop and says when uvicorn may exit.
    """

    GRACE_S = 2.0  # after ending the streams, how long the engine gets to report them ended

    def __init__(self, state: ServerState, timeout_s: float) -> None:
        self.state = state
        self.timeout_s = timeout_s
        self.started_at: float | None = None
        self._ended_at: float | None = None  # when engine.end_all was sent
        self._announced = False

    @property
    def started(self) -> bool:
        return self.started_at is not None

    def begin(self) -> None:
        """Start draining: from now on /health answers 503 and new requests get 503."""
        if self.started_at is None:
            self.state.draining = True
            self.started_at = time.monotonic()

    def poll(self) -> bool:
        """Advance the drain; True once no request is left in the engine (or the grace is over).

        Requests the engine has ended may still be sending their last chunks: uvicorn's graceful
        shutdown, which follows, waits for those responses.
        """
        assert self.started_at is not None
        engine, now = self.state.engine, time.monotonic()
        active = engine.active
        if not self._announced:
            self._announced = True
            log.info("draining: %d requests active, %gs to finish", active, self.timeout_s)
        if active == 0:
            from headstart.engine.runner import gpu_memory_note

            note = gpu_memory_note(engine.model.device)
            log.info("drained after %.1fs%s", now - self.started_at, note)
            return True
        if self._ended_at is None:
            if now - self.started_at >= self.timeout_s:
                log.info("shutdown timeout: ending %d requests", active)
                engine.end_all(reason="abort")
                self._ended_at = now
            return False
        if now - self._ended_at >= self.GRACE_S:
            log.warning(
                "%d requests still active %gs after ending them; exiting anyway",
                active,
                self.GRACE_S,
            )
            return True
        return False


class _SlowCollections:
    """A ``gc.callbacks`` entry (debug): each garbage collection of 2 ms or more in the log,
    with its generation. A collection stops every thread; one inside a request's way in shows
    as TTFT that the request log's clock (which starts after parsing) does not see."""

    def __init__(self) -> None:
        self.since = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.since = time.perf_counter()
        elif (took := time.perf_counter() - self.since) >= 0.002:
            log.debug(
                "garbage collection of generation %d: %.1f ms, %d collected",
                info["generation"],
                1e3 * took,
                info["collected"],
            )


class _Server(uvicorn.Server):
    """uvicorn, plus: the first signal drains before uvicorn shuts down; a second exits at once."""

    def __init__(self, config: uvicorn.Config, drain: _Drain) -> None:
        super().__init__(config)
        self._drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A Python signal handler, run between two bytecodes of the event loop's thread: it only
        # sets flags. Logging here could re-enter a stream write the signal interrupted, and
        # taking the engine's lock (engine.end_all) could deadlock against the interrupted code.
        # Unlike uvicorn's, it does not record the signal: uvicorn re-raises recorded signals
        # after shutdown so that the process dies of them, and a drained exit is status 0.
        if self._drain.started:
            self.should_exit = self.force_exit = True
        else:
            self._drain.begin()

    async def on_tick(self, counter: int) -> bool:
        if self._drain.started and not self.should_exit and self._drain.poll():
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.force_exit:
            # uvicorn skips waiting for responses on a forced exit but, on Python >= 3.12, its
            # server.wait_closed() still waits for every connection to close: cut them now.
            for connection in list(self.server_state.connections):
                transport = getattr(connection, "transport", None)
                if transport is not None:
                    transport.abort()
        await super().shutdown(sockets)


def _step_tokens(model) -> int:
    """The default step budget for ``model`` on its device (``default_step_tokens``)."""
    import torch

    from headstart.engine.config import default_step_tokens

    count = getattr(model, "num_parameters", None)
    compute = (0, 0, 0)
    if model.device.type == "cuda":
        props = torch.cuda.get_device_properties(model.device)
        compute = (props.major, props.minor, props.multi_processor_count)
    return default_step_tokens(count() if count else None, model.device.type, compute)


def _check_memory(model, parallel: int, context: int, cache_bytes: int) -> int:
    """Refuse to start, with the numbers, when the state pool cannot fit; log what it takes.
    Returns the pool's bytes."""
    import torch

    from headstart.state import StatePool

    if model.arena is not None:
        log.info(
            "weights: %.2f GiB in one allocation (%d tensors)",
            model.arena.nbytes / 2**30,
            len(model.arena),
        )
    need = StatePool.bytes_for(model.state_groups(), parallel + 1, context, model.dtype)
    log.info(
        "state pool: %d streams x %d tokens = %.2f GiB (+ up to %.2f GiB prompt cache)",
        parallel,
        context,
        need / 2**30,
        cache_bytes / 2**30,
    )
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        if need > 0.95 * free:
            raise HeadstartError(
                f"the state pool for {parallel} streams x {context} tokens needs "
                f"{need / 2**30:.1f} GiB but {free / 2**30:.1f} GiB of GPU memory is free; "
                "lower --parallel or --context"
            )
    return need


def _keep_dense_copies(model, pool_bytes: int, cache_bytes: int) -> None:
    """On CUDA, give the first layers' 4-bit weights dense prefill copies in what is left
    beside the state pool, the prompt cache and :func:`dense_margin` (a family without
    copies, or a load that kept them all, changes nothing). Why: at load the copies are kept
    only when all of them fit, since the pool's size is not known yet; on an 80 GB GPU the 27B
    copies do not, and each layer's copy saves its share of the weight unpacking that every
    prefill matmul above 64 rows pays (BENCHMARKS.md)."""
    import torch

    keep = getattr(model, "keep_dense_copies", None)
    if keep is None or model.device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(model.device)
    budget = free - pool_bytes - cache_bytes - dense_margin(total)
    before = torch.cuda.memory_allocated(model.device)
    kept = keep(max(0, budget))
    added = torch.cuda.memory_allocated(model.device) - before
    if added > 0:
        log.info(
            "dense prefill copies: the first %d of %d layers, %.2f GiB beside the state pool",
            kept,
            model.cfg.num_hidden_layers,
            added / 2**30,
        )


def dense_margin(total: int) -> int:
    """GPU memory left free beside the state pool and the prompt cache when dense prefill
    copies are added after the load: the engine's own (warm-up activations, CUDA graphs'
    memory pools, cuBLAS and FLA workspaces), a tenth of the device and at least 4 GiB;
    ``HEADSTART_DENSE_MARGIN_GIB`` sets it instead (to measure a smaller one)."""
    asked = os.environ.get("HEADSTART_DENSE_MARGIN_GIB", "")
    with contextlib.suppress(ValueError):
        return int(float(asked) * 2**30)
    return max(4 << 30, total // 10)


def _served_name(model: str | None) -> str:
    """The model id clients send: a hub name as given, else the folder's name."""
    if model is None:
        return "headstart-default"
    if "/" in model and not Path(model).exists():
        return model.rstrip("/")
    return Path(model).name


def serve(args: argparse.Namespace) -> int:
    """Run ``headstart serve`` until a signal; 0 after a drained (or forced) shutdown.

    Raises HeadstartError for what it refuses, before loading the model where it can.
    """
    from headstart.server.auth import ApiKeys

    logging.basicConfig(
        level=getattr(logging, getattr(args, "log_level", "info").upper()),
        format="%(asctime)s %(name)s: %(message)s",
    )
    asked = getattr(args, "device_asked", args.device)
    log.info("device: %s%s", args.device, " (auto)" if asked == "auto" else "")
    # Everything that can be refused without the model is, before the (long) load.
    _check_args(args)
    keys = ApiKeys(args.api_key_file) if args.api_key_file else None
    sockets = [] if getattr(args, "warm_only", False) else _bind(args.host, args.port)
    try:
        return _serve(args, sockets, keys)
    finally:
        for sock in sockets:  # uvicorn closes them on shutdown; this covers failed start-ups
            sock.close()


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def cpu_threads(cores: int) -> int:
    """The default intra-op thread count on a CPU: every core but one. The engine thread's
    operations otherwise share all cores with the HTTP loop (and, when measured, the client),
    and an OpenMP region waits for its slowest thread: one descheduled thread stalls the step."""
    return max(1, cores - 1)


#: A model with at least this many bytes of weights decodes on every core: its decode step
#: reads them all (tens of milliseconds and up), so the HTTP loop's share of a token is a
#: fraction of a percent and a descheduled OpenMP thread costs little beside the second core's
#: bandwidth (the 2B shape in MLX 4-bit decodes about 1.5x as fast on two cores as on one:
#: BENCHMARKS.md). The embedded default (0.04 GiB) keeps a core for the loop.
WIDE_DECODE_BYTES = 256 << 20


#: A smaller model's decode steps of at least this many rows run on every core: above the
#: fp32 4-bit kernel's rows (``cpu_f32.MAX_ROWS``, single-threaded) the matmuls run on the dense
#: copies through MKL, which splits each across the cores, and they dominate such a step. At
#: 16 streams of the embedded default the step took 13.4 ms on one core and 8.9 on two, and
#: `serve` gained in spite of the loop sharing a core (BENCHMARKS.md); at 8 rows two threads
#: were slower.
WIDE_DECODE_ROWS = 9


def decode_threads(threads: ThreadConfig, weight_bytes: int, asked: int | None) -> ThreadConfig:
    """``threads`` with decode steps on the prefill count (every core, by default) for a
    model of ``weight_bytes`` of at least :data:`WIDE_DECODE_BYTES`, and those of at least
    :data:`WIDE_DECODE_ROWS` rows for a smaller one; unchanged when the decode count was
    ``asked`` for (``--threads``) or is every core already."""
    if asked is not None or threads.decode >= threads.prefill:
        return threads
    if weight_bytes < WIDE_DECODE_BYTES:
        return replace(threads, wide_rows=WIDE_DECODE_ROWS)
    return replace(threads, decode=threads.prefill)


def _size_threads(args: argparse.Namespace) -> ThreadConfig | None:
    """Set torch's intra-op threads for a CPU device and return what the engine's steps use
    (tensor parallelism shares the cores out itself; GPU devices keep torch's default: None)."""
    import torch

    from headstart.engine.config import ThreadConfig

    if str(args.device).split(":")[0] != "cpu" or args.tensor_parallel > 1:
        return None
    cores = usable_cores()
    threads = getattr(args, "threads", None) or cpu_threads(cores)
    batch = getattr(args, "threads_batch", None) or cores
    torch.set_num_threads(threads)
    log.info("cpu threads: %d (steps with prompt tokens: %d)", threads, batch)
    return ThreadConfig(decode=threads, prefill=batch)


def _cpu_programs(
    args: argparse.Namespace,
    loaded: LoadedModel,
    parallel: int,
    context: int,
    taps: tuple[int, ...] = (),
    verify: tuple[int, ...] = (),
) -> tuple[bool, subprocess.Popen | None]:
    """Whether to compile the CPU decode steps at start-up (engine/cpu_programs.py): when
    they were compiled here before (seconds from inductor's cache). Else, the first time, the
    server starts eagerly at once and a low-priority process compiles them for the next start
    (returned, to be ended with the server)."""
    from headstart.engine import cpu_programs

    if args.cpu_compile == "off" or args.tensor_parallel > 1:
        return False, None
    if not cpu_programs.offered(loaded.model):
        return False, None
    load_args = {
        "model": str(loaded.path.resolve()),
        "dtype": str(loaded.model.dtype).removeprefix("torch."),
        "kernels": args.kernels,
        "load-format": args.load_format,
        "taps": ",".join(map(str, taps)),  # the drafter's: its steps return its features
        "verify": ",".join(map(str, verify)),  # the widths of its verify windows
    }
    key = cpu_programs.cache_key(load_args, parallel, context)
    if cpu_programs.warm(key):
        return True, None
    log.info("CPU decode steps: eager on this first start; compiling them for the next one")
    return False, cpu_programs.warm_in_background(load_args, parallel, context, key)


def _serve(args: argparse.Namespace, sockets: list[socket.socket], keys: ApiKeys | None) -> int:
    """serve() once the arguments are checked and the listening sockets bound."""
    started = time.monotonic()
    threads = _size_threads(args)
    if getattr(args, "warm_only", False):
        from headstart.server.compile_ahead import cap_memory

        cap_memory(str(args.device))
    ahead = _start_compile_ahead(args)
    try:
        return _serve_loaded(args, sockets, keys, started, threads, ahead)
    finally:
        if ahead is not None:
            ahead.stop()


def _shard(text: str) -> tuple[int, int]:
    """``I/N`` as (I, N), 0 <= I < N."""
    i, _, n = text.partition("/")
    try:
        shard = int(i), int(n)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not I/N: {text!r}") from None
    if not 0 <= shard[0] < shard[1]:
        raise argparse.ArgumentTypeError(f"not 0 <= I < N: {text!r}")
    return shard


def _start_compile_ahead(args: argparse.Namespace) -> CompileAhead | None:
    """The compile-ahead processes (server/compile_ahead.py), where they apply: a CUDA
    device, one serving process, graphs on, a step budget known before the load."""
    from headstart.server.compile_ahead import CompileAhead, gpu_plan, planned_step_tokens, shards

    if (
        getattr(args, "compile_ahead", "off") != "auto"
        or getattr(args, "warm_only", False)
        or not str(args.device).startswith("cuda")
        or args.tensor_parallel > 1
        or args.no_graphs
    ):
        return None
    from headstart.loading import resolve_model_dir

    try:
        path = resolve_model_dir(args.model)
        budget = args.max_batched_tokens or planned_step_tokens(path, str(args.device))
        if budget is None:
            return None
        load, n, cap = gpu_plan(path, str(args.device), shards())
    except Exception as e:  # an optimisation: the load itself reports real problems
        log.warning("compile-ahead process not started: %s", e)
        return None
    if args.prefill_weights == "auto":
        # Decided now, on the memory free before the processes take any: the loader would
        # otherwise decide on what they leave free, and the processes would compile the
        # prefill path of their own (small) model's decision, not the server's.
        args.prefill_weights = "dense" if load.dense else "packed"
        # Still the server's choice: copies of the first layers beside the state pool.
        args.dense_top_up = True
    if n == 0:
        log.info("compile-ahead: no process, too little GPU memory free beside the load")
        return None
    return CompileAhead.start(args, path, budget, n, cap)


def _serve_loaded(
    args: argparse.Namespace,
    sockets: list[socket.socket],
    keys: ApiKeys | None,
    started: float,
    threads: ThreadConfig | None,
    ahead: CompileAhead | None,
) -> int:
    from headstart.engine.engine import Engine
    from headstart.loading import load
    from headstart.server.api import ServerState, create_app, warm_request_path
    from headstart.server.metrics import Metrics
    from headstart.server.request_log import RequestLog

    if getattr(args, "switch_interval_ms", None) is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)

    log.info("loading %s ...", args.model or "the embedded default model")
    loaded = load(
        args.model,
        args.device,
        args.dtype,
        args.kernels,
        args.load_format,
        args.prefill_weights,
        args.tensor_parallel,
    )
    log.info(
        "loaded %s (%s) in %.1fs", loaded.path.name, loaded.family.name, time.monotonic() - started
    )
    cfg = loaded.model.cfg
    parallel = args.parallel or 16
    context = args.context or min(32768, cfg.max_position_embeddings)
    if parallel < 1 or context < 2:
        raise HeadstartError("--parallel must be >= 1 and --context >= 2")
    if ahead is not None:
        # Its kernels go to Triton's cache before this warm-up would compile them, and the
        # memory it holds is free again before the state pool is sized against what is free.
        ahead.wait()
    cache_bytes = max(0, args.prompt_cache_mib) << 20
    pool_bytes = _check_memory(loaded.model, parallel, context, cache_bytes)
    if getattr(args, "dense_top_up", args.prefill_weights == "auto") and args.tensor_parallel == 1:
        _keep_dense_copies(loaded.model, pool_bytes, cache_bytes)
    arena = loaded.model.arena
    if threads is not None and arena is not None:
        wide = decode_threads(threads, arena.nbytes, getattr(args, "threads", None))
        if wide.decode != threads.decode:
            log.info("cpu threads: %d for decode steps too (large weights)", wide.decode)
        elif wide.wide_rows is not None:
            log.info("cpu threads: %d for decode steps of %d rows or more", wide.prefill,
                     wide.wide_rows)  # fmt: skip
        threads = wide
    drafter = None
    if args.drafter is None and args.model is None and not args.no_drafter:
        from headstart.loading import default_drafter

        # The default model ships its own drafter, used where it was measured to pay.
        shipped = default_drafter(loaded.model.device.type)
        if shipped is not None:
            args.drafter = str(shipped)
    if args.drafter:
        from headstart.engine.spec.drafter import DFlashDrafter

        drafter = DFlashDrafter.load(args.drafter, loaded.model)
    from headstart.engine.config import (
        CacheConfig,
        EngineConfig,
        GraphConfig,
        SchedulingConfig,
        SpecConfig,
    )

    budget = args.max_batched_tokens or _step_tokens(loaded.model)
    if budget < 1:
        raise HeadstartError("--max-batched-tokens must be >= 1")
    log.info("step budget: %d tokens", budget)
    taps = tuple(drafter.cfg.target_layer_ids) if drafter is not None else ()
    verify = ()
    if drafter is not None:
        from headstart.engine.cpu_programs import verify_widths

        verify = verify_widths(args.draft_block or drafter.cfg.block_size)
    compile_now, warming = _cpu_programs(args, loaded, parallel, context, taps, verify)
    interval = budget if args.prompt_cache_interval is None else args.prompt_cache_interval
    config = EngineConfig(
        parallel,
        context,
        max_queue=args.max_queue,
        scheduling=SchedulingConfig(
            prefill_chunk=budget,
            step_tokens=budget,
            gather_max_s=max(0.0, args.burst_gather_ms) / 1e3,
        ),
        cache=CacheConfig(
            bytes=max(0, args.prompt_cache_mib) << 20,
            host_bytes=max(0, args.prompt_cache_host_mib) << 20,
            max_tokens=args.prompt_cache_max_tokens,
            interval=max(0, interval),
        ),
        spec=SpecConfig(
            mode=args.spec_mode, draft_block=args.draft_block, draft_window=args.draft_window
        ),
        cpu_programs=compile_now,
        threads=threads,
        graphs=GraphConfig(
            enabled=False if args.no_graphs else None,
            prefill_tokens=args.prefill_graph_tokens,
            prefill_rows=args.prefill_graph_rows or max(budget, args.prefill_graph_tokens),
            windows=args.window_graphs,
            rounds=args.round_graphs,
            continuations=args.continuation_graphs,
            continuation_tokens=args.continuation_graph_tokens,
            shard=getattr(args, "warm_shard", None),
        ),
    )
    phase = time.monotonic()
    log.info("engine: state pool, warm-up and graph capture ...")
    try:
        engine = Engine(
            loaded.model, loaded.tokenizer, loaded.eos_token_ids, config, drafter=drafter
        )
    except BaseException:
        if warming is not None:
            warming.terminate()
        raise
    # Start-up leaves millions of long-lived objects (weights, graphs, tokenizer tables); a
    # full collection over them stalls every thread, the first requests' included. Frozen,
    # they are never scanned again (vLLM does the same after capturing its graphs).
    gc.collect()
    gc.freeze()
    if log.isEnabledFor(logging.DEBUG):
        gc.callbacks.append(_SlowCollections())
    log.info(
        "engine ready in %.1fs (start-up %.1fs in all)",
        time.monotonic() - phase,
        time.monotonic() - started,
    )
    if getattr(args, "warm_only", False):  # the compile-ahead process: its work is done
        engine.cache.close()
        loaded.close()
        return 0
    if loaded.model.device.type == "cuda":
        from headstart.ops.triton_support import report_late_compiles

        report_late_compiles(log)
    metrics = Metrics(slots=parallel)
    metrics.watch_prompt_cache(engine.stats)
    name = args.served_model_name or _served_name(args.model)
    state = ServerState(
        engine=engine,
        tokenizer=loaded.tokenizer,
        model_name=name,
        chat=loaded.family.chat,
        template_defaults=loaded.template_defaults,
        context=context,
        generation_defaults=dict(cfg.generation_defaults),
        metrics=metrics,
        keys=keys,
        request_log=RequestLog(args.request_log) if args.request_log else None,
        max_tokens_cap=args.max_tokens,
        max_body_bytes=int(args.max_body_mib * 2**20),
        body_timeout_s=args.body_timeout,
        metrics_open=args.metrics_open,
    )

    def reload_keys() -> None:
        assert keys is not None
        try:
            log.info("reloaded %d API keys from %s", keys.reload(), keys.path)
        except HeadstartError as e:
            log.error("key file reload failed, keeping the old keys: %s", e)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if keys is not None:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_keys)
        # Loads anyio's asyncio backend now: Starlette imports it on first use, and the import
        # held the event loop for milliseconds in the first burst of requests after start-up.
        await anyio.sleep(0)
        await warm_request_path(state)
        yield

    app = create_app(state, lifespan)

    # host/port only label uvicorn's messages: it listens on the sockets bound above. By the
    # time uvicorn shuts down, the drain has ended every stream, so the graceful phase only has
    # final chunks to flush (or bodies of requests refused with 503 to read).
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=5,
        access_log=False,
        **uvicorn_connection_options(
            args.header_timeout, args.keep_alive_timeout, args.http_parser
        ),
    )
    engine.start()
    log.info(
        "serving %s on http://%s (%d streams x %d tokens, %s)",
        name,
        _address(args.host, args.port),
        parallel,
        context,
        args.device,
    )
    try:
        _Server(config, _Drain(state, args.shutdown_timeout)).run(sockets=sockets)
    finally:
        if warming is not None:  # its cache entries so far stay; the marker is not left
            warming.terminate()
        engine.stop()
        loaded.close()  # the other ranks of a tensor-parallel model
        if state.request_log is not None:
            state.request_log.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(1)
