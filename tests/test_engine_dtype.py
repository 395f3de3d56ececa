"""The automatic compute dtype per device (no GPU needed: the capability query is replaced)."""
from __future__ import annotations

import torch

from moestream.engine import engine as eng


class Cfg:
    torch_dtype = "bfloat16"

    @staticmethod
    def approx_num_params():
        return 1000


def test_bf16_checkpoint_runs_fp16_on_gpus_without_bf16_tensor_cores(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # Turing
    assert eng.resolve_dtype("auto", Cfg, cuda) == torch.float16
    assert eng.resolve_dtype("bfloat16", Cfg, cuda) == torch.bfloat16  # an explicit choice is kept
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # Hopper
    assert eng.resolve_dtype("auto", Cfg, cuda) == torch.bfloat16
    assert eng.resolve_dtype("auto", Cfg, torch.device("cpu")) == torch.float32
