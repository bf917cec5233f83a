"""The GPU check script: refuses at once without CUDA; its parity part is sound (run
here on the CPU for Llama); on CUDA, the whole check passes."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu

ROOT = Path(__file__).resolve().parents[2]  # benchmarks/ runs from the repository's root


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_without_cuda_it_exits_at_once_saying_why(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--json",
                           str(tmp_path / "out.json")], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "ran nothing" in proc.stderr
    assert not (tmp_path / "out.json").exists()


def test_parity_part_on_cpu(tmp_path):
    rows = gpu.parity(tmp_path, 0, torch.float32, device="cpu", families=False)
    assert [r["family"] for r in rows] == ["llama"]
    assert rows[0]["ok"] and rows[0]["max_abs_diff"] <= gpu.FP32_TOL
    assert rows[0]["logit_range"] > 1.0  # the logits are not all ~0: the check has teeth


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_check_passes(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--tokens", "4096",
                           "--repeats", "1", "--json", str(tmp_path / "gpu.json")],
                          capture_output=True, text=True, cwd=ROOT, timeout=1800)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
