"""Compile the GPU kernels in other processes while ``serve`` loads the weights.

A first start on a fresh machine spends most of its warm-up compiling Triton kernels: every
kernel, at every shape the warm-up and the graph captures run, once. The kernels depend on the
model's per-layer shapes, not on its depth, so a model cut to its first few layers (one of
each layer type) with random weights compiles the same kernels, and Triton's on-disk cache,
shared by every process of the machine, hands them to the server when it gets there. This
process starts before the server's own load and runs the server's own start-up (``headstart
serve --warm-only`` with the same engine settings) on the cut model; the server waits for it
before its warm-up, so nothing is compiled twice. On a machine of several cores the start-up's
shapes are dealt out to several such processes (:func:`shards`), since Triton compiles on one
core a process. Each process is held to a share of the GPU memory left beside the server's load
(:func:`memory_plan`), and there are fewer of them, or none, where little is left. Whatever goes
wrong here only costs the time it saves: the server compiles what is missing itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("headstart.serve")

# Files of a checkpoint folder the cut model does not take (random weights instead).
_WEIGHTS = (".safetensors", ".bin", ".pt", ".gguf")


def cut_layers(layer_types: list[str]) -> int:
    """The fewest leading layers that hold every layer type of the model."""
    return max(layer_types.index(t) for t in set(layer_types)) + 1


def cut_folder(path: Path, into: Path) -> Path | None:
    """A copy of the checkpoint folder ``path`` in ``into`` with config.json cut to the first
    layers that hold every layer type, weights left out (links for the other files); None when
    the config names no layer types or the model is already that short."""
    cfg = json.loads((path / "config.json").read_text())
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    layers = text.get("num_hidden_layers")
    types = text.get("layer_types")
    if not isinstance(types, list):
        interval = text.get("full_attention_interval")
        if not isinstance(layers, int) or not isinstance(interval, int) or interval < 1:
            return None
        types = ["full_attention" if (i + 1) % interval == 0 else "linear" for i in range(layers)]
    keep = cut_layers(types)
    if not isinstance(layers, int) or keep >= layers:
        return None
    text["num_hidden_layers"] = keep
    if "layer_types" in text:
        text["layer_types"] = types[:keep]
    into.mkdir(parents=True, exist_ok=True)
    for f in path.iterdir():
        if f.name != "config.json" and not f.name.endswith(_WEIGHTS) and "index" not in f.name:
            (into / f.name).symlink_to(f.resolve())
    (into / "config.json").write_text(json.dumps(cfg))
    return into


def command(args: argparse.Namespace, folder: Path, step_tokens: int) -> list[str]:
    """``headstart serve --warm-only`` on ``folder`` with the engine settings of ``args`` (the
    step budget given: the cut model's own would differ), no prompt cache, no drafter."""
    cmd = [sys.executable, "-m", "headstart", "serve", str(folder), "--warm-only"]
    cmd += ["--load-format", "dummy", "--device", str(args.device), "--kernels", args.kernels]
    cmd += ["--prefill-weights", args.prefill_weights, "--max-batched-tokens", str(step_tokens)]
    cmd += ["--prompt-cache-mib", "0", "--prompt-cache-host-mib", "0", "--no-drafter"]
    # Info: its phase timings go to its log, which the server sums up (phase_summary).
    cmd += ["--log-level", "info"]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    for flag in ("parallel", "context", "prefill_graph_rows"):
        if getattr(args, flag, None):
            cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    cmd += ["--prefill-graph-tokens", str(args.prefill_graph_tokens)]
    cmd += ["--continuation-graph-tokens", str(args.continuation_graph_tokens)]
    cmd += ["--continuation-graphs" if args.continuation_graphs else "--no-continuation-graphs"]
    return cmd


# Below this many weights the load takes seconds: the process's own start-up (CUDA, imports)
# would cost more than it overlaps.
MIN_PARAMETERS = 1_000_000_000


def planned_step_tokens(path: Path, device: str) -> int | None:
    """The step budget ``serve`` gives the full model at ``path`` (its default, from the
    weights a token multiplies by), known from config.json before any weight loads; None for
    a family that cannot say before loading or a model of fewer than ``MIN_PARAMETERS``
    weights (no process then)."""
    import torch

    from headstart.engine.config import default_step_tokens
    from headstart.loading import family_for

    plan = family_for(path).planned_parameters
    params = plan(path) if plan is not None else 0
    if params < MIN_PARAMETERS:
        return None
    props = torch.cuda.get_device_properties(torch.device(device))
    return default_step_tokens(
        params, "cuda", (props.major, props.minor, props.multi_processor_count)
    )


def shards(cores: int | None = None) -> int:
    """How many compile-ahead processes share the work: ``HEADSTART_COMPILE_AHEAD_PROCESSES``
    when set, else one per two cores, at most :data:`MAX_SHARDS`. Triton compiles on one
    core a process; the server's load and each process's own start-up need cores too."""
    asked = os.environ.get("HEADSTART_COMPILE_AHEAD_PROCESSES", "")
    if asked.isdigit() and int(asked) >= 1:
        return int(asked)
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1, min(MAX_SHARDS, cores // 2))


# On the 16-core H200 host, 27B, a fresh machine: 4 processes were done in 45.5 s, 8 in 41.1 s
# (BENCHMARKS.md); each process's own start-up (imports, CUDA context, the cut model) is most
# of that, so more would take little more off.
MAX_SHARDS = 8


# What each process is planned at: one 27B cut process (4 layers, dense prefill copies, a pool
# for 16 x 16384 tokens, its CUDA context) held 7.9-8.0 GB of an H100, where eight of them
# beside the server's load ran the GPU out of memory (BENCHMARKS.md, session 29).
PROCESS_BYTES = 8 << 30
#: The environment variable that tells a process the bytes its allocator may hold.
CAP_ENV = "HEADSTART_MEMORY_CAP_BYTES"


@dataclass(frozen=True)
class LoadPlan:
    """What the server's load will hold, known before it starts: ``nbytes`` of GPU memory at
    the most while the processes run, of which the dense prefill copies if ``dense``."""

    nbytes: int
    dense: bool


def load_plan(path: Path, params: int, free: int, total: int, dense_fraction: float) -> LoadPlan:
    """The checkpoint's weight files where it has them, else (random weights, ``--load-format
    dummy``) its ``params`` at the bits of its quantization block (scales and biases included)
    or two bytes each; plus, for quantized weights, the dense prefill copies (two bytes a
    weight) where they fit the loader's budget
    (:func:`~headstart.models.contract.dense_copy_budget`), applied to the memory free before
    the processes take any."""
    from headstart.models.contract import dense_copy_budget

    cfg = json.loads((path / "config.json").read_text())
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    q = next((c[k] for c in (cfg, text) for k in ("quantization", "quantization_config")
              if isinstance(c.get(k), dict)), {})  # fmt: skip
    bits, group = q.get("bits"), q.get("group_size")
    quantized = isinstance(bits, int) and isinstance(group, int) and group > 0
    files = [f for f in path.iterdir() if f.name.endswith(_WEIGHTS)]
    if files:
        held = sum(f.stat().st_size for f in files)
    else:
        held = int(params * (bits / 8 + 4 / group)) if quantized else 2 * params
    dense = quantized and 2 * params <= dense_copy_budget(dense_fraction, free, total)
    return LoadPlan(held + (2 * params if dense else 0), dense)


def memory_plan(n: int, free: int, total: int, load: int) -> tuple[int, int]:
    """(processes, bytes each may allocate): at most ``n`` processes of :data:`PROCESS_BYTES`
    in what is free beside the server's ``load`` bytes and a tenth of the device held back (the
    load's temporaries, CUDA contexts); (0, 0) where not one fits. Each gets an equal share as
    its cap, so that a process needing more fails alone, never the server's load."""
    spare = free - load - total // 10
    k = max(0, min(n, spare // PROCESS_BYTES))
    return (k, spare // k) if k else (0, 0)


def gpu_plan(path: Path, device: str, n: int) -> tuple[LoadPlan, int, int]:
    """The server's :class:`LoadPlan` and :func:`memory_plan` on the CUDA ``device`` as it is
    now, for the checkpoint at ``path``."""
    import torch

    from headstart.loading import family_for

    family = family_for(path)
    params = family.planned_parameters(path) if family.planned_parameters is not None else 0
    free, total = torch.cuda.mem_get_info(torch.device(device))
    load = load_plan(path, params, free, total, family.dense_fraction)
    return (load, *memory_plan(n, free, total, load.nbytes))


def cap_memory(device: str) -> None:
    """In a compile-ahead process: hold its allocator to the bytes the server gave it
    (:data:`CAP_ENV`), so that a process needing more fails alone, never the server's load."""
    cap = os.environ.get(CAP_ENV, "")
    if not cap.isdigit() or not device.startswith("cuda"):
        return
    import torch

    # set_per_process_memory_fraction takes no index-less "cuda": the device's index, resolved.
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    total = torch.cuda.mem_get_info(index)[1]
    torch.cuda.set_per_process_memory_fraction(min(1.0, int(cap) / total), index)


_PHASE = re.compile(r"^\S+ \S+ headstart\.\w+: (.+?) in ([0-9.]+)s\b", re.M)


def phase_summary(log_text: str) -> str:
    """The start-up phases a process logged ("<phase> in <x>s" lines), as one parenthesised
    list: where a compile-ahead process's time went (its shard's compiling lands in the phase
    that first runs each kernel); empty when it logged none."""
    phases = [f"{what} {float(secs):.1f}s" for what, secs in _PHASE.findall(log_text)]
    return f" ({'; '.join(phases)})" if phases else ""


class CompileAhead:
    """The compiling processes, started by :meth:`start` and waited for by :meth:`wait`: the
    same start-up of the cut model, its shapes dealt out among them (``--warm-shard``)."""

    def __init__(self, procs: list[subprocess.Popen], tmp: tempfile.TemporaryDirectory) -> None:
        self.procs, self.tmp, self.started = procs, tmp, time.monotonic()

    @property
    def proc(self) -> subprocess.Popen:
        """The first process (the only one, unsharded)."""
        return self.procs[0]

    @classmethod
    def start(
        cls,
        args: argparse.Namespace,
        path: Path,
        step_tokens: int,
        n: int = 1,
        cap_bytes: int | None = None,
    ) -> CompileAhead | None:
        """Start ``n`` of them for the checkpoint at ``path``, each allocating at most
        ``cap_bytes`` of GPU memory where given (None where it does not apply: a folder that
        cannot be cut, or a failure to start, which is logged)."""
        tmp = tempfile.TemporaryDirectory(prefix="headstart-ahead-")
        procs: list[subprocess.Popen] = []
        try:
            folder = cut_folder(path, Path(tmp.name) / path.name)
            if folder is None:
                tmp.cleanup()
                return None
            cmd = command(args, folder, step_tokens)
            env = {**os.environ, "HEADSTART_COMPILE_AHEAD": "0"}
            if cap_bytes is not None:
                env[CAP_ENV] = str(cap_bytes)
            for i in range(n):
                shard = [f"--warm-shard={i}/{n}"] if n > 1 else []
                # Its stderr to a file, not a pipe: nobody reads a pipe until the load is
                # done, and a full one would stop the process in the middle of its work.
                with open(Path(tmp.name) / f"stderr-{i}.log", "w") as err:
                    procs.append(
                        subprocess.Popen(
                            cmd + shard, env=env, stdout=subprocess.DEVNULL, stderr=err
                        )
                    )
        except (OSError, ValueError) as e:
            log.warning("compile-ahead process not started: %s", e)
            for proc in procs:
                proc.kill()
                proc.wait()
            tmp.cleanup()
            return None
        log.info(
            "compile-ahead processes started: %d (%s, cut to its first layers%s)",
            n,
            path.name,
            "" if cap_bytes is None else f", {cap_bytes / 2**30:.1f} GiB of GPU memory each",
        )
        return cls(procs, tmp)

    def wait(self, timeout: float = 600.0) -> None:
        """Wait for them (at most ``timeout`` s in all, then end them); log how it went."""
        for i, proc in enumerate(self.procs):
            try:
                proc.wait(timeout=max(0.0, timeout - (time.monotonic() - self.started)))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            took = time.monotonic() - self.started
            err = (Path(self.tmp.name) / f"stderr-{i}.log").read_text(errors="replace")
            if proc.returncode == 0:
                log.info("compile-ahead process %d done in %.1fs%s", i, took, phase_summary(err))
            else:
                tail = " | ".join(err.strip().splitlines()[-3:])
                log.warning(
                    "compile-ahead process %d ended %s after %.1fs: %s",
                    i, proc.returncode, took, tail,
                )  # fmt: skip
        self.tmp.cleanup()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.tmp.cleanup()
