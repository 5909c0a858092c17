"""FLA's tuned configs: read from a start-up log (benchmarks/fla_configs.py) into the files FLA
looks up by key hash, and used for the GPU they were recorded on (ops/gated_delta/fla.py)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from headstart.ops.gated_delta import fla

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import fla_configs

LOG = """noise
Triton autotuning for function chunk_fwd_kernel_o,
with key as (16, 48, 128, 128, 64, True, 'torch.bfloat16', 'torch.float32'),
finished after 2.51s,
best config selected: BK: 64, BV: 32, num_warps: 4, num_ctas: 1, num_stages: 3, maxnreg: None;
Triton autotuning for function chunk_fwd_kernel_o,
with key as (16, 16, 128, 128, 64, False, 'torch.bfloat16', 'torch.float32'),
finished after 1.50s,
best config selected: BK: 32, BV: 64, num_warps: 8, num_ctas: 1, num_stages: 2, maxnreg: 128;
"""


def test_a_log_becomes_fla_config_entries_keyed_as_fla_hashes_them():
    files, seconds, count = fla_configs.parse(LOG)
    assert count == 2 and abs(seconds - 4.01) < 1e-9
    entries = files["chunk_fwd_kernel_o"]
    key = [16, 48, 128, 128, 64, True, "torch.bfloat16", "torch.float32"]
    # FLA's AutotuneKey.key_hash: md5 of the compact, sorted JSON of the key as a list.
    want = hashlib.md5(json.dumps(key, separators=(",", ":")).encode()).hexdigest()
    assert entries[want]["autotune_key"] == key
    assert entries[want]["config"] == {
        "kwargs": {"BK": 64, "BV": 32},
        "num_warps": 4,
        "num_ctas": 1,
        "num_stages": 3,
        "maxnreg": None,
    }
    assert len(entries) == 2


def test_a_gpus_folder_is_filled_with_the_keys_another_holds_its_own_entries_kept(tmp_path):
    files, _, _ = fla_configs.parse(LOG)
    (h_plain, plain), (h_varlen, varlen) = sorted(files["chunk_fwd_kernel_o"].items())

    def write(folder, kernel, entries):
        folder.mkdir(exist_ok=True)
        body = {"kernel_name": kernel, "triton_version": "3.6.0", "autotune_entries": entries}
        (folder / f"{kernel}.json").write_text(json.dumps(body))

    own = {**plain, "config": {**plain["config"], "num_warps": 2}}  # tuned here: stays
    write(tmp_path / "h100", "chunk_fwd_kernel_o", {h_plain: own})
    write(tmp_path / "h200", "chunk_fwd_kernel_o", {h_plain: plain, h_varlen: varlen})
    write(tmp_path / "h200", "l2norm_fwd_kernel", {h_varlen: varlen})
    added = fla_configs.fill(tmp_path / "h100", tmp_path / "h200")
    assert added == {"chunk_fwd_kernel_o": 1, "l2norm_fwd_kernel": 1}
    got = json.loads((tmp_path / "h100" / "chunk_fwd_kernel_o.json").read_text())
    assert got["autotune_entries"] == {h_plain: own, h_varlen: varlen}
    l2 = json.loads((tmp_path / "h100" / "l2norm_fwd_kernel.json").read_text())
    assert l2["kernel_name"] == "l2norm_fwd_kernel" and list(l2["autotune_entries"]) == [h_varlen]
    assert fla_configs.fill(tmp_path / "h100", tmp_path / "h200")["chunk_fwd_kernel_o"] == 0


def test_shipped_configs_are_used_for_their_gpu_only(tmp_path, monkeypatch):
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    monkeypatch.delitem(sys.modules, "fla", raising=False)
    monkeypatch.setattr(fla, "SHIPPED_CONFIGS", tmp_path)
    (tmp_path / "NVIDIA_H200").mkdir()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    assert fla.use_shipped_configs(torch.device("cuda")) is None
    assert "FLA_CONFIG_DIR" not in os.environ
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    assert fla.use_shipped_configs(torch.device("cuda")) == tmp_path / "NVIDIA_H200"
    env = os.environ
    assert env["FLA_CONFIG_DIR"] == str(tmp_path / "NVIDIA_H200")
    assert env["FLA_CACHE_MODE"] == "strict"


def test_a_users_fla_settings_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("FLA_CACHE_MODE", "disabled")
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    monkeypatch.setattr(fla, "SHIPPED_CONFIGS", tmp_path)
    (tmp_path / "NVIDIA_H200").mkdir()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    assert fla.use_shipped_configs(torch.device("cuda")) is None
    assert "FLA_CONFIG_DIR" not in os.environ


def test_every_shipped_config_file_reads_as_fla_reads_it():
    """FLA's KernelConfigFile.from_dict checks: a dict of entries, each with a config dict;
    and each entry's hash is its key's."""
    for path in fla.SHIPPED_CONFIGS.glob("*/*.json"):
        data = json.loads(path.read_text())
        assert data["kernel_name"] == path.stem
        for h, entry in data["autotune_entries"].items():
            assert isinstance(entry["config"], dict)
            assert fla_configs._key_hash(entry["autotune_key"]) == h


def test_kernel_modules_import_in_the_background(monkeypatch):
    """import_in_background imports its modules in a daemon thread (the weights load meanwhile)
    and stops quietly at one that fails to import (it fails again, with its error, where the
    kernels first import it); what it imports by default is FLA's kernels."""
    for name in ("colorsys", "wave"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    thread = fla.import_in_background(("colorsys", "no_such_module_here", "wave"))
    assert thread.daemon
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert "colorsys" in sys.modules
    assert "no_such_module_here" not in sys.modules and "wave" not in sys.modules
    assert fla.KERNEL_MODULES == ("fla.ops.gated_delta_rule",)
