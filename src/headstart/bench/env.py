"""The environment a bench run measured: machine, software, code and model identities.

Job: collect what someone needs to trust or reproduce a receipt: GPU, driver and CUDA
(``nvidia-smi`` when present), torch and other package versions, the git commit of the
checkout (read from ``.git`` files; no git process is run), a hash of the headstart sources,
the bench client's own hash, and sha256 of every file of each arm's model folder.

Non-goals: anything about the arms' remote machines (a URL arm's environment is only what
its ``/v1/models`` and ``/health`` say, recorded by the runner).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata as md
import os
import platform
import shlex
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

#: Packages whose versions are worth knowing when comparing numbers (absent ones are skipped).
PACKAGES = (
    "headstart",
    "torch",
    "triton",
    "fla-core",
    "flash-linear-attention",
    "numpy",
    "tokenizers",
    "safetensors",
    "fastapi",
    "uvicorn",
    "aiohttp",
    "openai",
    "vllm",
    "sglang",
    "transformers",
    "matplotlib",
    "tqdm",
)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tree_hashes(root: Path, pattern: str = "*") -> dict[str, str]:
    """sha256 of every file under ``root`` matching ``pattern``, by relative path."""
    return {
        str(p.relative_to(root)): sha256_file(p)
        for p in sorted(root.rglob(pattern))
        if p.is_file() and "__pycache__" not in p.parts
    }


def combined(hashes: dict[str, str]) -> str:
    """One hash for a set of files: sha256 over sorted "path sha" lines."""
    return hashlib.sha256(
        "".join(f"{k} {v}\n" for k, v in sorted(hashes.items())).encode()
    ).hexdigest()


def client_hash() -> dict[str, Any]:
    """The bench client's identity: sha256 of each source file of ``headstart.bench``."""
    root = Path(str(resources.files("headstart.bench")))
    files = {**tree_hashes(root, "*.py"), **tree_hashes(root, "*.json")}
    return {"sha256": combined(files), "files": files}


def model_dir_of(command: str | None) -> Path | None:
    """The local model folder an arm command serves: its ``--model`` value when that is a
    folder; the embedded default for a ``headstart serve`` without ``--model``; else None."""
    if command is None:
        return None
    argv = shlex.split(command)
    for i, a in enumerate(argv):
        value = (
            argv[i + 1]
            if a == "--model" and i + 1 < len(argv)
            else (a.split("=", 1)[1] if a.startswith("--model=") else None)
        )
        if value is not None:
            path = Path(value).expanduser()
            return path if path.is_dir() else None
    is_headstart = any(Path(a).name == "headstart" for a in argv) and "serve" in argv
    if is_headstart:
        from headstart.loading import default_model_dir  # imports torch: only when needed

        return default_model_dir()
    return None


def git_commit(start: Path) -> dict[str, Any] | None:
    """The commit checked out in the repository holding ``start``, read from ``.git``."""
    for d in (start, *start.parents):
        git = d / ".git"
        if git.is_file():  # a worktree: "gitdir: PATH"
            git = (d / git.read_text().split(":", 1)[1].strip()).resolve()
        if not git.is_dir():
            continue
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return {"repo": str(d), "commit": head, "ref": None}
        ref = head[4:].strip()
        common = git / "commondir"
        gits = [git] + ([(git / common.read_text().strip()).resolve()] if common.exists() else [])
        for g in gits:
            if (g / ref).is_file():
                return {"repo": str(d), "commit": (g / ref).read_text().strip(), "ref": ref}
            packed = g / "packed-refs"
            if packed.is_file():
                for line in packed.read_text().splitlines():
                    if line.endswith(" " + ref):
                        return {"repo": str(d), "commit": line.split()[0], "ref": ref}
        return {"repo": str(d), "commit": None, "ref": ref}
    return None


def _run(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None


def gpu_info() -> dict[str, Any] | None:
    """GPUs, driver and CUDA version from ``nvidia-smi``; None without it."""
    query = _run(
        [
            "nvidia-smi",
            "--query-gpu=index,name,driver_version,memory.total,pci.bus_id",
            "--format=csv,noheader",
        ]
    )
    if query is None:
        return None
    header = _run(["nvidia-smi"]) or ""
    cuda = next(
        (
            line.split("CUDA Version:")[1].split()[0]
            for line in header.splitlines()
            if "CUDA Version:" in line
        ),
        None,
    )
    return {
        "gpus": [line.strip() for line in query.splitlines() if line.strip()],
        "driver_cuda": cuda,
    }


def torch_info() -> dict[str, Any] | None:
    try:
        import torch
    except ImportError:
        return None
    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    }


def packages() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        with contextlib.suppress(md.PackageNotFoundError):
            out[name] = md.version(name)
    return out


def collect(commands: dict[str, str | None], hash_models: bool = True) -> dict[str, Any]:
    """The whole environment record; ``commands`` maps arm name to its command (or None)."""
    import headstart

    pkg_root = Path(headstart.__file__).resolve().parent
    models: dict[str, Any] = {}
    cache: dict[Path, dict[str, Any]] = {}
    for arm, command in commands.items():
        folder = model_dir_of(command)
        if folder is None:
            models[arm] = None
            continue
        folder = folder.resolve()
        if folder not in cache:
            files = tree_hashes(folder) if hash_models else {}
            cache[folder] = {
                "dir": str(folder),
                "files": files,
                "sha256": combined(files) if files else None,
            }
        models[arm] = cache[folder]
    return {
        "python": sys.version,
        "executable": sys.executable,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "gpu": gpu_info(),
        "torch": torch_info(),
        "packages": packages(),
        "git": git_commit(pkg_root) or git_commit(Path.cwd()),
        "headstart_source_sha256": combined(tree_hashes(pkg_root, "*.py")),
        "client": client_hash(),
        "models": models,
        "argv": sys.argv,
        "cwd": os.getcwd(),
    }
