"""``headstart serve``: load the model, start the engine, run the HTTP server until a signal.

Start-up refuses an unsafe API key file before loading anything. SIGHUP rereads the key file.
SIGTERM/SIGINT stop accepting requests (``/health`` turns 503, new requests get 503), give running
streams ``--shutdown-timeout`` seconds to finish, then end the rest with a final chunk
(finish_reason "abort"), and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import threading
from pathlib import Path

import uvicorn

from headstart.errors import HeadstartError

log = logging.getLogger("headstart.serve")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8888)
    p.add_argument("--parallel", type=int, default=None,
                   help="concurrent streams (slots); default 16 (on CPU too: measured best, see BENCHMARKS.md)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens per stream, prompt included (default: min(32768, model max))")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait for a slot before new ones get 429")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="cap on tokens generated per request (default: the context)")
    p.add_argument("--api-key-file", default=None,
                   help="file with one API key per line (mode 600); required on /v1/*")
    p.add_argument("--request-log", default=None, help="append one JSON line per request here")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the model folder's name)")
    p.add_argument("--prompt-cache-mib", type=int, default=2048,
                   help="byte budget of the prompt-state cache in MiB (0 disables it)")
    p.add_argument("--prompt-cache-host-mib", type=int, default=0,
                   help="second prompt-cache tier in host RAM for snapshots evicted from the "
                        "first (MiB; 0: none)")
    p.add_argument("--prompt-cache-max-tokens", type=int, default=0,
                   help="longest prefix one snapshot may hold (0: no cap)")
    p.add_argument("--prompt-cache-interval", type=int, default=1024,
                   help="also snapshot long prompts every N tokens (0: only at turn ends)")
    p.add_argument("--drafter", default=None,
                   help="DFlash drafter checkpoint folder: speculative decoding on")
    p.add_argument("--no-drafter", action="store_true",
                   help="do not use the drafter shipped with the embedded default model")
    p.add_argument("--draft-block", type=int, default=None,
                   help="tokens per verify window, anchor included (default: the drafter's)")
    p.add_argument("--draft-window", type=int, default=4096,
                   help="target rows of context the drafter keeps per stream")
    p.add_argument("--kernels", default="auto", choices=["auto", "reference", "gpu"],
                   help="GPU kernels on CUDA (auto), or the pure-PyTorch reference everywhere")
    p.add_argument("--no-graphs", action="store_true", help="never capture CUDA graphs")
    p.add_argument("--window-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="with a drafter, replay its proposals, chain verify windows and "
                        "rollbacks from CUDA graphs (27B on an H200: an 8-row window costs 1.35 "
                        "decode steps instead of 6.6)")
    p.add_argument("--continuation-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="replay continued prefill chunks of up to --prefill-graph-tokens tokens "
                        "(a new turn after a prompt-cache hit) from CUDA graphs (27B on an "
                        "H200: 21 ms instead of 167; costs start-up time)")
    p.add_argument("--prefill-graph-tokens", type=int, default=64,
                   help="capture fresh prefills of 2..N tokens in CUDA graphs at start-up "
                        "(one graph per length; 0 or 1: none)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds running streams get to finish on SIGTERM")


class _Server(uvicorn.Server):
    """uvicorn, plus: a signal first drains the engine (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, on_exit) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame) -> None:  # type: ignore[override]
        self._on_exit()
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals after shutdown so the process dies of them; a
        # drained shutdown is a normal exit (status 0) for us.
        self._captured_signals.clear()


def _check_memory(model, parallel: int, context: int, cache_bytes: int) -> None:
    """Refuse to start, with the numbers, when the state pool cannot fit; log what it takes."""
    import torch

    from headstart.state import StatePool

    if model.arena is not None:
        log.info("weights: %.2f GiB in one allocation (%d tensors)", model.arena.nbytes / 2**30,
                 len(model.arena))
    need = StatePool.bytes_for(model.cfg, parallel + 1, context, model.dtype)
    log.info("state pool: %d streams x %d tokens = %.2f GiB (+ up to %.2f GiB prompt cache)",
             parallel, context, need / 2**30, cache_bytes / 2**30)
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        if need > 0.95 * free:
            raise HeadstartError(
                f"the state pool for {parallel} streams x {context} tokens needs "
                f"{need / 2**30:.1f} GiB but {free / 2**30:.1f} GiB of GPU memory is free; "
                "lower --parallel or --context")


def serve(args: argparse.Namespace) -> int:
    from headstart.engine.engine import Engine
    from headstart.loading import load
    from headstart.server.api import ServerState, create_app
    from headstart.server.auth import ApiKeys
    from headstart.server.metrics import Metrics
    from headstart.server.request_log import RequestLog

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    keys = ApiKeys(args.api_key_file) if args.api_key_file else None  # refuse before loading
    loaded = load(args.model, args.device, args.dtype, args.kernels)
    cfg = loaded.model.cfg
    parallel = args.parallel or 16
    context = args.context or min(32768, cfg.max_position_embeddings)
    if parallel < 1 or context < 2:
        raise HeadstartError("--parallel must be >= 1 and --context >= 2")
    _check_memory(loaded.model, parallel, context, max(0, args.prompt_cache_mib) << 20)
    drafter = None
    if args.drafter is None and args.model is None and not args.no_drafter:
        from headstart.loading import default_drafter

        # The default model ships its own drafter, used where it was measured to pay.
        shipped = default_drafter(loaded.model.device.type)
        if shipped is not None:
            args.drafter = str(shipped)
    if args.drafter:
        from headstart.drafter import DFlashDrafter

        drafter = DFlashDrafter.load(args.drafter, loaded.model)
    engine = Engine(loaded.model, loaded.tokenizer, loaded.eos_token_ids, num_slots=parallel,
                    context=context, max_queue=args.max_queue,
                    cache_bytes=max(0, args.prompt_cache_mib) << 20,
                    cache_max_tokens=args.prompt_cache_max_tokens,
                    cache_interval=args.prompt_cache_interval, drafter=drafter,
                    host_cache_bytes=max(0, args.prompt_cache_host_mib) << 20,
                    draft_block=args.draft_block, draft_window=args.draft_window,
                    graphs=False if args.no_graphs else None,
                    prefill_graph_tokens=args.prefill_graph_tokens,
                    window_graphs=args.window_graphs,
                    continuation_graphs=args.continuation_graphs)
    metrics = Metrics(slots=parallel)
    metrics.watch_prompt_cache(engine.stats)
    name = args.served_model_name or (args.model.rstrip("/") if args.model and "/" in args.model
                                      and not Path(args.model).exists() else
                                      (Path(args.model).name if args.model else "headstart-default"))
    state = ServerState(engine=engine, tokenizer=loaded.tokenizer, model_name=name,
                        context=context, generation_defaults=dict(cfg.generation_defaults),
                        metrics=metrics, keys=keys,
                        request_log=RequestLog(args.request_log) if args.request_log else None,
                        max_tokens_cap=args.max_tokens)

    def begin_drain() -> None:
        if state.draining:
            return
        state.draining = True
        log.info("draining: %d requests active, %.0fs to finish", engine.active,
                 args.shutdown_timeout)
        timer = threading.Timer(args.shutdown_timeout, engine.end_all, kwargs={"reason": "abort"})
        timer.daemon = True
        timer.start()

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
        yield

    app = create_app(state, lifespan)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=int(args.shutdown_timeout) + 5,
                            access_log=False)
    engine.start()
    log.info("serving %s on http://%s:%d (%d streams x %d tokens, %s)", name, args.host,
             args.port, parallel, context, args.device)
    try:
        _Server(config, begin_drain).run()
    finally:
        engine.stop()
        if state.request_log is not None:
            state.request_log.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(1)
