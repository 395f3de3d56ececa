"""Post-load fusion of the projections that read the same input (one GEMM instead of two to four).

A decode step is launch-bound (~1,500 small kernels for Qwen3.6-35B-A3B at batch 1), so each GEMV
saved is a few µs. After the checkpoint is loaded by its HF names (safetensors or GGUF), per layer:

- Gated DeltaNet: in_proj_qkv | in_proj_z | in_proj_b | in_proj_a  -> `in_proj` (rows concatenated);
- attention: q_proj (query and, Qwen3.5, its output gate) | k_proj | v_proj -> `qkv_proj`;
- MoE block: router (mlp.gate) | shared_expert.gate_proj | shared_expert.up_proj | shared_expert_gate (1 row)
  -> `shared_in`; the router keeps a view of its rows (the expert runtime calls it to prefetch).

The forward code splits the product by views (`FusedLinear.split`). A group is fused only when every
part is a plain `Linear` without bias whose weight is a dense tensor of one dtype and device; anything
else (a compressed-weight module, a tensor-parallel shard wrapper) keeps its modules as they are. The
unfused modules are deleted, so the weights are held once. Tensor-parallel ranks are not fused: the
engine calls this only with one rank (shard.py slices the unfused modules by heads).
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.linear import Linear


class FusedLinear(Linear):
    """Linear whose output rows are the concatenated outputs of `sizes[i]`-row projections."""

    def __init__(self, weight: torch.Tensor, sizes: tuple[int, ...]):
        nn.Module.__init__(self)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None
        self.sizes = tuple(sizes)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """y [..., sum(sizes)] -> views [..., sizes[i]] (no copies)."""
        return torch.split(y, self.sizes, dim=-1)


def _plain(m) -> bool:
    w = getattr(m, "weight", None)
    return (type(m) is Linear and m.bias is None and type(w) is nn.Parameter and type(w.data) is torch.Tensor
            and w.device.type != "meta" and w.dim() == 2 and w.is_contiguous())


def fusable(*mods) -> bool:
    """Every module a plain dense Linear of the same dtype, device and input width."""
    if not all(_plain(m) for m in mods):
        return False
    w0 = mods[0].weight
    return all(m.weight.dtype == w0.dtype and m.weight.device == w0.device and m.in_features == w0.shape[1]
               for m in mods)


def _quant_group(mods) -> str | None:
    """'same': every module a QuantLinear of one GGUF type and input width (fused by byte rows); 'types':
    QuantLinears only, of several types (left unfused: each stays compressed, as a Q4_K_M file's q/k (Q4_K)
    and v (Q6_K) do); 'mixed': QuantLinears with plain Linears (densified to their dtype, then fused as
    dense); None: no QuantLinear."""
    from ..layers.quant_linear import FusedQuantLinear, QuantLinear

    quant = [m for m in mods if isinstance(m, QuantLinear) and not isinstance(m, FusedQuantLinear)]
    if not quant:
        return None
    q0 = quant[0]
    if len(quant) == len(mods) and all(m.fmt.name == q0.fmt.name and m.in_features == q0.in_features
                                       and m.raw.device == q0.raw.device for m in quant):
        return "same"
    return "types" if len(quant) == len(mods) else "mixed"


def _compressed_rows(mods) -> int:
    from ..layers.quant_linear import QuantLinear

    return sum(m.out_features for m in mods if isinstance(m, QuantLinear))


@torch.no_grad()
def densify_quant(parts: list[tuple[nn.Module, str]], like: nn.Module | None = None) -> None:
    """Replace the QuantLinears among (parent, attribute) by plain Linears holding their dequantized weights
    (dtype and device of `like`'s weight, else bf16 on the bytes' device)."""
    from ..layers.quant_linear import QuantLinear

    ref = next((getattr(p, n).weight for p, n in parts if not isinstance(getattr(p, n), QuantLinear)), None)
    for parent, name in parts:
        m = getattr(parent, name)
        if isinstance(m, QuantLinear):
            dtype = ref.dtype if ref is not None else torch.bfloat16
            w = m.dense(dtype)
            lin = Linear(m.in_features, m.out_features, bias=False, device="meta")
            lin.weight = nn.Parameter(w.to(ref.device if ref is not None else w.device), requires_grad=False)
            setattr(parent, name, lin)


@torch.no_grad()
def _fuse(owner: nn.Module, names: list[tuple[nn.Module, str]], target: str) -> bool:
    """Replace the modules (parent, attribute) by one FusedLinear `owner.<target>` (FusedQuantLinear for
    QuantLinears of one type); False if not fusable. A group mixing compressed and dense modules is densified
    first where its compressed members are the smaller part (rows); where they are most of it (a Qwen3.6 GGUF's
    Gated DeltaNet: qkv and z Q4_K / Q6_K, the 32-row b and a F32) it stays unfused, each member as it is:
    densified, those layers held and read ~3.5x the bytes (1.45 GiB of bf16 on the GPU for 30 layers, 2.9 GiB
    of float32 on a CPU)."""
    mods = [getattr(parent, name) for parent, name in names]
    kind = _quant_group(mods)
    if kind == "mixed" and _compressed_rows(mods) * 2 > sum(m.out_features for m in mods):
        return False
    if kind == "same":
        from ..layers.quant_linear import FusedQuantLinear

        raw = torch.cat([m.raw for m in mods], dim=0)
        sizes = tuple(m.out_features for m in mods)
        k = mods[0].in_features
        type_name = mods[0].fmt.type_name
        for parent, name in names:
            delattr(parent, name)
        setattr(owner, target, FusedQuantLinear(type_name, raw, sizes, k))
        return True
    if kind == "types":
        return False
    if kind == "mixed":
        densify_quant(names)
        mods = [getattr(parent, name) for parent, name in names]
    if not fusable(*mods):
        return False
    weight = torch.cat([m.weight for m in mods], dim=0)
    sizes = tuple(m.out_features for m in mods)
    for parent, name in names:
        delattr(parent, name)  # frees the unfused weights
    setattr(owner, target, FusedLinear(weight, sizes))
    return True


def fuse_projections(model: nn.Module) -> dict[str, int]:
    """Fuse every eligible group of `model` (a QwenMoeModel) in place; returns how many of each kind."""
    from ..models.qwen_moe import SparseMoeBlock  # noqa: PLC0415 (qwen_moe imports this module's users)

    done = {"gdn": 0, "attention": 0, "shared_expert": 0}
    for layer in model.layers:
        if layer.kind == "linear_attention":
            g = layer.linear_attn
            names = [(g, n) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]
            done["gdn"] += _fuse(g, names, "in_proj")
        else:
            a = layer.self_attn
            done["attention"] += _fuse(a, [(a, "q_proj"), (a, "k_proj"), (a, "v_proj")], "qkv_proj")
        mlp = layer.mlp
        if isinstance(mlp, SparseMoeBlock) and mlp.shared_expert is not None:
            done["shared_expert"] += _fuse_moe_inputs(mlp)
    if hasattr(model, "cpu_decode"):
        model.cpu_decode = None  # its descriptions point at the unfused weights: made again at the next step
    return done


@torch.no_grad()
def _fuse_moe_inputs(mlp) -> bool:
    """[router | shared gate_proj | up_proj | shared_expert_gate] -> mlp.shared_in. The router module stays
    (the expert runtime calls it to prefetch) and reads its rows as a plain-tensor view of the fused weight,
    so they are held once; a router whose weight is not a plain dense tensor stays its own GEMM."""
    s, router = mlp.shared_expert, mlp.gate
    names = [(s, "gate_proj"), (s, "up_proj"), (mlp, "shared_expert_gate")]
    from ..layers.quant_linear import QuantLinear

    if all(isinstance(m, QuantLinear) for m in (s.gate_proj, s.up_proj, s.down_proj)):
        # a shared expert kept compressed stays so (a GGUF on a CPU: Q4_K gate / up read 1.1 MiB a layer, densified
        # to float32 8 MiB); the GPU's loader leaves gate / up 16-bit (gguf_loader.GPU_DENSE_PARTS) to fuse them
        # with its router
        return False
    if _quant_group([getattr(p, n) for p, n in names]) is not None:
        densify_quant(names)  # the router and the 1-row gate are dense: fused as dense (6 MB a layer)
    parts = [getattr(p, n) for p, n in names]
    if not fusable(*parts):
        return False
    rw, w0 = router.weight, parts[0].weight
    with_router = (type(rw) is nn.Parameter and type(rw.data) is torch.Tensor and rw.dtype == w0.dtype
                   and rw.device == w0.device and rw.dim() == 2 and rw.shape[1] == w0.shape[1])
    lead = [rw] if with_router else []
    weight = torch.cat(lead + [m.weight for m in parts], dim=0)
    sizes = tuple(w.shape[0] for w in lead) + tuple(m.out_features for m in parts)
    for parent, name in names:
        delattr(parent, name)
    mlp.shared_in = FusedLinear(weight, sizes)
    if with_router:
        del router.weight  # the Parameter; a plain attribute (no second copy, not in state_dict) replaces it
        router.weight = mlp.shared_in.weight.detach()[:rw.shape[0]]
        mlp.router_rows = rw.shape[0]
    mlp.takes_residual = True  # the fused combine also adds the decoder's residual
    return True
