"""Gated DeltaNet: the chunked prefill form equals the token-by-token recurrence."""
import pytest
import torch

from moestream.layers.gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule


def _inputs(H, L, Dk, Dv, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(H, L, Dk, generator=g, dtype=torch.float64), dim=-1) * Dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(H, L, Dk, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(H, L, Dv, generator=g, dtype=torch.float64)
    logdecay = -torch.rand(H, L, generator=g, dtype=torch.float64) * 2
    beta = torch.rand(H, L, generator=g, dtype=torch.float64)
    s0 = torch.randn(H, Dk, Dv, generator=g, dtype=torch.float64)
    return q, k, v, logdecay, beta, s0


def _recurrence(q, k, v, logdecay, beta, s0):
    S = s0.unsqueeze(0)
    outs = []
    for t in range(q.shape[1]):
        o, S = recurrent_gated_delta_rule(q[None, :, t], k[None, :, t], v[None, :, t], logdecay[None, :, t],
                                          beta[None, :, t], S)
        outs.append(o[0])
    return torch.stack(outs, dim=1), S[0]


@pytest.mark.parametrize("L,chunk", [(1, 64), (5, 4), (64, 64), (100, 64), (37, 8)])
def test_chunked_equals_recurrence(L, chunk):
    q, k, v, g, beta, s0 = _inputs(3, L, 16, 8, seed=L)
    o_ref, s_ref = _recurrence(q, k, v, g, beta, s0)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0.clone(), chunk=chunk)
    torch.testing.assert_close(o, o_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s, s_ref, rtol=1e-9, atol=1e-9)


def test_chunked_in_pieces_equals_whole():
    """Chunked prefill split across steps (state carried over) equals one pass."""
    q, k, v, g, beta, s0 = _inputs(2, 90, 8, 8, seed=7)
    o_all, s_all = chunk_gated_delta_rule(q, k, v, g, beta, s0.clone(), chunk=16)
    o1, s1 = chunk_gated_delta_rule(q[:, :33], k[:, :33], v[:, :33], g[:, :33], beta[:, :33], s0.clone(), chunk=16)
    o2, s2 = chunk_gated_delta_rule(q[:, 33:], k[:, 33:], v[:, 33:], g[:, 33:], beta[:, 33:], s1, chunk=16)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o_all, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s2, s_all, rtol=1e-9, atol=1e-9)
