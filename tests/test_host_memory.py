"""Host RAM: GGUF expert banks are the checkpoint file's mapped pages (not a copy), host RSS at load is
measured next to the bank bytes, and a plan that host RAM cannot hold is refused in one line before
anything large is allocated."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

import gguf_writer
from moestream import LLM, SamplingParams
from moestream.config import EngineConfig
from moestream.core import ConfigError
from moestream.models.gguf_loader import open_gguf
from moestream.moe import hardware
from moestream.moe.planner import Hardware, plan_memory
from moestream.moe.store import ExpertStore
from test_moe_planner import BIG, GiB, gpu

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SP = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf_path(tiny_checkpoint, tmp_path_factory):
    path, _ = gguf_writer.write_gguf(tiny_checkpoint("qwen3"), tmp_path_factory.mktemp("gguf") / "m.gguf", Q.Q8_0)
    return path


def test_gguf_banks_are_the_file_mapping(gguf_path, monkeypatch):
    llm = LLM(gguf_path, device="cpu", dtype="float32")
    store = llm.engine.runtime.store
    assert store.fmt.quantized and store.total_bytes() > 0
    assert store.mapped_bytes == store.total_bytes()
    buf = open_gguf(gguf_path).reader.buf
    lo, hi = buf.ctypes.data, buf.ctypes.data + len(buf)
    for per_layer in store.banks.values():
        for bank in per_layer.values():  # inside the file's mapping: no second copy of the bytes
            assert lo <= bank.data_ptr() and bank.data_ptr() + bank.numel() <= hi
    mem = llm.stats()["host_memory"]
    assert mem["bank_bytes"] == mem["mapped_bank_bytes"] == store.total_bytes()
    assert mem["rss"] > 0 and mem["peak_rss"] >= mem["rss"]
    prompts = [[5, 6, 7, 8], list(range(20, 45))]
    mapped = [o.token_ids for o in llm.generate(prompts, SP)]

    # the same checkpoint with the bytes copied into banks of their own: the same tokens
    put_raw = ExpertStore.put_raw
    monkeypatch.setattr(ExpertStore, "put_raw", lambda self, *a, mapped=False, **k: put_raw(self, *a, **k))
    copied = LLM(gguf_path, device="cpu", dtype="float32")
    assert copied.engine.runtime.store.mapped_bytes == 0
    assert [o.token_ids for o in copied.generate(prompts, SP)] == mapped


@pytest.mark.cuda
def test_mapped_banks_pinned_for_a_gpu_are_copies_with_the_same_tokens(gguf_path, monkeypatch):
    llm = LLM(gguf_path, device="cuda", moe_backend="offload", moe_cache_size=6)
    store = llm.engine.runtime.store
    assert llm.engine.pinning["pinned_bytes"] == store.total_bytes()  # every layer page-locked...
    assert store.mapped_bytes == 0  # ...as a copy: cudaHostRegister needs writable pages
    # exact-size copies registered in place, not blocks of torch's pinned host allocator (power-of-two sizes:
    # 30 GiB page-locked for the 18.2 GiB of banks of the Qwen3.6-shaped Q4_K_M GGUF)
    registered = set(store._registered)
    for per_layer in store.banks.values():
        for bank in per_layer.values():
            assert bank.is_pinned() and bank.data_ptr() in registered
    prompts = [[5, 6, 7, 8], list(range(20, 45))]
    mapped = [o.token_ids for o in llm.generate(prompts, SP)]
    put_raw = ExpertStore.put_raw
    monkeypatch.setattr(ExpertStore, "put_raw", lambda self, *a, mapped=False, **k: put_raw(self, *a, **k))
    copied = LLM(gguf_path, device="cuda", moe_backend="offload", moe_cache_size=6)
    assert [o.token_ids for o in copied.generate(prompts, SP)] == mapped


def test_writing_a_mapped_bank_gives_it_its_own_memory(gguf_path):
    llm = LLM(gguf_path, device="cpu", dtype="float32")
    store = llm.engine.runtime.store
    layer = store.moe_layers[0]
    bank = store.banks["down"][layer]
    row = bank[1].clone()
    store.put_raw(layer, "down", torch.zeros_like(row), "test", expert=0)  # the file mapping is read-only
    assert store.banks["down"][layer].data_ptr() != bank.data_ptr()
    assert store.mapped_bytes == store.total_bytes() - bank.numel()
    assert not store.banks["down"][layer][0].any()
    assert torch.equal(store.banks["down"][layer][1], row)  # the other experts' bytes came along
    assert torch.equal(bank[1], row) and bank[0].any()  # the file's pages are untouched


def test_too_little_host_ram_is_one_line_before_allocating(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(hardware, "host_memory", lambda: (8 * GiB, 100 << 10))

    def heavy(*_, **__):
        raise AssertionError("allocated before the host RAM check")

    monkeypatch.setattr(torch.nn.Module, "to_empty", heavy)
    monkeypatch.setattr(ExpertStore, "__init__", heavy)
    with pytest.raises(ConfigError) as e:
        LLM(tiny_checkpoint("qwen3"), device="cpu", dtype="float32")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("host RAM cannot hold this model: it needs ")
    assert "dense weights" in msg and "expert banks" in msg and "but 0.1 MiB of 8.00 GiB is available" in msg


def test_host_need_follows_where_the_banks_live():
    # 60 GiB of experts + 1.5 GiB dense, 40 GiB of host RAM available
    small_host = Hardware("cuda", "Test GPU", 139 * GiB, 64 * GiB, 40 * GiB, 16)
    p = plan_memory(BIG, small_host, EngineConfig())  # fused on the GPU: only the dense weights pass through
    assert p.backend == "fused"
    with pytest.raises(ConfigError, match=r"needs 61.50 GiB \(dense weights 1.50 GiB \+ expert banks 60.00 GiB\) "
                                          r"but 40.00 GiB of 64.00 GiB is available"):
        plan_memory(BIG, small_host, EngineConfig(moe_backend="offload"))
    assert plan_memory(BIG, gpu(8), EngineConfig()).backend == "offload"  # 126 GiB available: fine


def test_release_pages_drops_a_file_mapping_from_rss(tmp_path):
    import numpy as np

    path = tmp_path / "blob"
    path.write_bytes(np.arange(32 << 20, dtype=np.uint64).astype(np.uint8).tobytes())  # 32 MiB, not all zero
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    total = int(buf[::4096].astype(np.int64).sum())  # one byte a page: every page resident
    touched = hardware.process_memory()["rss_file"]
    released = hardware.release_pages(buf.ctypes.data, len(buf))
    after = hardware.process_memory()["rss_file"]
    assert released >= (32 << 20) - 8192
    assert touched - after > 24 << 20  # most of the 32 MiB left RSS
    assert int(buf[::4096].astype(np.int64).sum()) == total  # and reads still see the file


def test_safetensors_pages_leave_rss_once_copied(tmp_path):
    from safetensors.torch import save_file

    from moestream.models.safetensors_shards import ShardTensors

    w = torch.randn(8 << 20)  # 32 MiB
    save_file({"w": w, "small": torch.ones(3)}, str(tmp_path / "m.safetensors"))
    with ShardTensors([tmp_path / "m.safetensors"]) as tensors:
        t = tensors.get_tensor("w")
        copy = t.clone()  # what loading does: read every page
        touched = hardware.process_memory()["rss_file"]
        released = tensors.release("w")
        after = hardware.process_memory()["rss_file"]
        if released == 0:
            pytest.skip("this safetensors copies tensors instead of mapping the file: nothing to release")
        assert released >= (32 << 20) - 8192 and touched - after > 24 << 20
        assert torch.equal(tensors.get_tensor("w"), copy) and torch.equal(copy, w)  # read again from the file
        assert tensors.release("small") == 0  # no whole page inside it



@pytest.mark.cuda
def test_page_locked_zeros_are_exact_size_registered_memory():
    """The prefix cache's pinned host tier: zeros page-locked in place, not a block of torch's pinned host allocator
    (power-of-two blocks: up to twice the bytes asked)."""
    from moestream.moe.store import page_locked_zeros

    before = torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0)
    t = page_locked_zeros((3, 1000, 7), torch.float16)
    assert t.shape == (3, 1000, 7) and t.is_pinned() and not t.any()
    assert torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0) == before
    d = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert not d.any()
