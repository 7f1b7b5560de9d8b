"""Inputs beyond what the model or the machine can do are refused at once, in one line: windows longer than
the model's context (read from its files, before torch loads), and runs whose estimated peak memory exceeds
what the machine has. Query blocks are sized from a memory budget."""

import json
import subprocess
import sys
import time

import pytest
import torch

from diffquant import DiffquantError
from diffquant.models.context import context_length


def test_over_long_window_refused_in_one_line_before_torch_loads():
    code = ("import sys, time; t = time.time()\n"
            "from diffquant_cli import main\n"  # the installed command's entry point
            "rc = main(['profile', '--model', 'tiny:diff', '--data', 'kjv', '--tokens', '64', '--seq-len', '100000',"
            " '--out', 'unused'])\n"
            "print(rc, 'torch' in sys.modules, round(time.time() - t, 3))")
    start = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    rc, torch_loaded, seconds = out.stdout.split()
    assert rc == "2" and torch_loaded == "False"
    assert float(seconds) < 5.0, seconds  # measured inside the process: no model, no torch (5 s: a loaded machine)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "context of 2,048 positions" in lines[0] and "--allow-long-context" in lines[0]
    assert time.time() - start < 30


def test_context_read_from_each_kind_of_source(tmp_path):
    assert context_length("micro:baseline") == (2048, "the micro preset's max_position_embeddings")
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 1024}))
    assert context_length(str(folder)) == (1024, "config.json's n_positions")
    scheme = tmp_path / "q"
    scheme.mkdir()
    (scheme / "diffquant_scheme.json").write_text(json.dumps({"source": str(folder)}))
    assert context_length(str(scheme))[0] == 1024
    assert context_length("some/hub-id") == (None, "")


def test_allow_long_context_skips_the_refusal():
    import argparse

    from diffquant.commands import _check_context

    args = argparse.Namespace(model=["tiny:baseline"], seq_len=4096, allow_long_context=False)
    with pytest.raises(DiffquantError, match="4,096 is longer than tiny:baseline's context of 2,048"):
        _check_context(args)
    args.allow_long_context = True
    _check_context(args)
    _check_context(argparse.Namespace(model=["x=tiny:baseline"], seq_len=2048, allow_long_context=False))


def test_query_block_from_the_memory_budget(monkeypatch):
    from diffquant.taps import attention as A

    monkeypatch.delenv("DIFFQUANT_ATTN_BLOCK", raising=False)
    monkeypatch.setenv("DIFFQUANT_ATTN_MEMORY", "2048")
    # 2 GiB / (1 × 9 heads × 8192 keys × 160 B) = 182.04 rows -> 128 (a multiple of 64)
    assert A.query_block(1, 9, 8192, cache=False) == 128
    assert A.query_block(8, 8, 256, cache=False) == 768  # 2 GiB / (8 × 8 × 256 × 160 B) = 819.2 rows
    assert A.query_block(1, 64, 10**6, cache=False) == 64  # never fewer than 64 rows
    monkeypatch.setattr(A, "CPU_BLOCK_BYTES", 4 << 20)  # on CPU a block's fp32 logits stay within the cache size
    assert A.query_block(1, 9, 2048) == 48  # 4 MiB / (9 × 2048 × 4 B) = 56.9 rows -> 48 (a multiple of 16)
    assert A.query_block(1, 9, 8192) == 16  # never fewer than 16 rows
    assert A.query_block(8, 4, 64) == 512  # 4 MiB / (8 × 4 × 64 × 4 B)
    monkeypatch.setenv("DIFFQUANT_ATTN_BLOCK", "7")
    assert A.query_block(1, 9, 8192) == 7  # $DIFFQUANT_ATTN_BLOCK overrides


def test_query_block_from_the_device_memory(monkeypatch):
    """Without $DIFFQUANT_ATTN_MEMORY: on CUDA an eighth of the device or half of what is free, whichever is less,
    read once per device (reading syncs it); on CPU the measured 2 GiB."""
    from diffquant.taps import attention as A

    monkeypatch.delenv("DIFFQUANT_ATTN_BLOCK", raising=False)
    monkeypatch.delenv("DIFFQUANT_ATTN_MEMORY", raising=False)
    monkeypatch.setattr(A, "_budgets", {})
    reads = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: reads.append(d) or (60 << 30, 80 << 30))
    h100 = torch.device("cuda", 0)
    assert A.memory_budget(h100) == 10 << 30  # 80 GiB / 8 < 60 GiB free / 2
    # 10 GiB / (1 × 9 heads × 8192 keys × 160 B) = 910.2 rows -> 896
    assert A.query_block(1, 9, 8192, h100) == 896 and A.query_block(1, 9, 8192, cache=False) == 128  # CPU: 2 GiB
    assert len(reads) == 1
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (4 << 30, 80 << 30))
    assert A.memory_budget(torch.device("cuda", 1)) == 2 << 30  # a busy device: half its free 4 GiB


def test_memory_estimate_and_refusal(micro_pair, monkeypatch):
    from diffquant import memory
    from diffquant.taps import attention as A

    monkeypatch.delenv("DIFFQUANT_ATTN_BLOCK", raising=False)
    monkeypatch.setenv("DIFFQUANT_ATTN_MEMORY", "2048")
    model = micro_pair[0]  # width 64, SwiGLU 176, 4 heads, fp32
    est = memory.estimate(model, 2, 512)
    params = sum(p.numel() for p in model.parameters())
    assert est.weights == 4 * params
    assert est.activations == 12 * 2 * 512 * 176 * 4
    assert est.attention == 512 * 2 * 4 * 512 * 160  # 512 rows fit the budget: the whole window is one block
    assert est.mask == 512 * 512  # one boolean [1, 1, T, T] mask, broadcast over the batch
    asked = []

    def free(device):
        asked.append(device)
        return est.activations + est.attention + est.mask - 1  # one byte short
    with pytest.raises(DiffquantError, match=r"profiling m on \[2 × 512\] tokens needs about .* attention mask "
                                             r".* GiB are available: lower --batch-size or --seq-len"):
        memory.check_fits(model, 2, 512, "profiling m", free_bytes=free)
    assert asked == [torch.device("cpu")]  # where the model's inputs go
    assert memory.check_fits(model, 2, 512, "profiling m", free_bytes=lambda d: est.running) == est


def test_memory_check_reads_the_gpu_for_a_cuda_model(micro_pair):
    """On CUDA the free memory is the device's (torch.cuda.mem_get_info, here a fake reader given as a
    parameter), never the host's MemAvailable; bf16 activations count 2 bytes."""
    from diffquant import memory

    model = micro_pair[0]
    read = []

    def mem_get_info(device):
        read.append(device)
        return 3 * 2**30, 80 * 2**30  # (free, total)
    assert memory.available_bytes("cuda:1", cuda_free=mem_get_info) == 3 * 2**30
    assert read == [torch.device("cuda:1")]
    with pytest.raises(DiffquantError, match=r"3\.0 GiB are free on cuda:1"):
        memory.check_fits(model, 8, 32_768, "profiling m", device="cuda:1",
                          free_bytes=lambda d: memory.available_bytes(d, cuda_free=mem_get_info))
    assert memory.available_bytes("cpu") == memory.host_available_bytes()
    assert memory.available_bytes("mps") is None  # not measured: not refused
    import copy

    assert memory.estimate(copy.deepcopy(model).to(torch.bfloat16), 2, 64).activations == 12 * 2 * 64 * 176 * 2