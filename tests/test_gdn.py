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
    o, s, _ = chunk_gated_delta_rule(q, k, v, g, beta, s0.clone(), chunk=chunk)
    torch.testing.assert_close(o, o_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s, s_ref, rtol=1e-9, atol=1e-9)


def test_chunked_in_pieces_equals_whole():
    """Chunked prefill split across steps (state carried over) equals one pass."""
    q, k, v, g, beta, s0 = _inputs(2, 90, 8, 8, seed=7)
    o_all, s_all, _ = chunk_gated_delta_rule(q, k, v, g, beta, s0.clone(), chunk=16)
    o1, s1, _ = chunk_gated_delta_rule(q[:, :33], k[:, :33], v[:, :33], g[:, :33], beta[:, :33], s0.clone(), chunk=16)
    o2, s2, _ = chunk_gated_delta_rule(q[:, 33:], k[:, 33:], v[:, 33:], g[:, 33:], beta[:, 33:], s1, chunk=16)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o_all, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s2, s_all, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("L,chunk,at", [(37, 8, [1, 8, 13, 36, 37]), (100, 64, [28, 64, 65, 99]), (5, 64, [3])])
def test_states_inside_a_chunk_equal_the_state_after_that_prefix(L, chunk, at):
    """states_at: the state after e tokens, taken inside the chunked scan, equals a scan of exactly e tokens."""
    q, k, v, g, beta, s0 = _inputs(3, L, 16, 8, seed=L + chunk)
    o, s, mids = chunk_gated_delta_rule(q, k, v, g, beta, s0.clone(), chunk=chunk, states_at=at)
    o_ref, s_ref, _ = chunk_gated_delta_rule(q, k, v, g, beta, s0.clone(), chunk=chunk)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)  # asking for states changes nothing else
    for e, m in zip(at, mids):
        _, s_e = _recurrence(q[:, :e], k[:, :e], v[:, :e], g[:, :e], beta[:, :e], s0)
        torch.testing.assert_close(m, s_e, rtol=1e-9, atol=1e-9)


def test_layer_snapshot_equals_prefilling_up_to_the_boundary():
    """GatedDeltaNet._prefill_one with snapshots: the conv window and recurrent state written to a snapshot
    slot after e tokens of a chunk equal those of a slot that prefilled exactly those e tokens (float32)."""
    from moestream.layers.gdn import GatedDeltaNet

    torch.manual_seed(0)
    m = GatedDeltaNet(hidden=32, num_k_heads=2, num_v_heads=4, k_dim=8, v_dim=8, conv_kernel=4, eps=1e-6)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    L, e = 90, 68  # the boundary inside the scan's second 64-token chunk
    mixed, g, beta = torch.randn(L, m.conv_dim), -torch.rand(L, m.hv), torch.rand(L, m.hv)
    conv = torch.randn(4, m.conv_dim, 3)
    rec = torch.randn(4, m.hv, m.dk, m.dv)
    conv[1], rec[1] = conv[0], rec[0]
    with torch.no_grad():
        whole = m._prefill_one(mixed, g, beta, 0, conv, rec, snapshots=[(e, 2)])
        head = m._prefill_one(mixed[:e], g[:e], beta[:e], 1, conv, rec)  # slot 1: exactly e tokens
        assert torch.equal(conv[2], conv[1])
        torch.testing.assert_close(rec[2], rec[1], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(rec[2], rec[0], atol=1e-3)  # not the state after all L tokens
        tail = m._prefill_one(mixed[e:], g[e:], beta[e:], 2, conv, rec)  # resumed from the snapshot
    torch.testing.assert_close(torch.cat([head, tail]), whole, rtol=1e-5, atol=1e-5)
    assert torch.equal(conv[2], conv[0])
    torch.testing.assert_close(rec[2], rec[0], rtol=1e-5, atol=1e-5)


def test_layer_forward_routes_prefill_sequences_through_the_front(monkeypatch):
    """GatedDeltaNet.forward with the one-launch front on (MOESTREAM_GDN_FRONT=1 where the kernels run): each prefill
    sequence without verify checkpoints goes through _prefill_front, a verify sequence keeps _prefill_one, and the
    output and states equal the torch front's. The kernel is stood in for by a torch front here (its own numerics:
    tests/test_triton_fused.py's interpreter cases)."""
    from moestream.batch import ForwardBatch, SeqMeta
    from moestream.layers import triton_ops
    from moestream.layers.gdn import GatedDeltaNet

    torch.manual_seed(0)
    m = GatedDeltaNet(hidden=32, num_k_heads=2, num_v_heads=4, k_dim=8, v_dim=8, conv_kernel=4, eps=1e-6)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)

    def torch_front(mixed, conv_old, conv_w, b, a, a_log, dt_bias, key_dim, hk, hv, dk, dv):
        window = torch.cat([conv_old.to(mixed.dtype), mixed.t()], dim=-1)
        conv_out = torch.nn.functional.silu(torch.nn.functional.conv1d(window.unsqueeze(0), conv_w.unsqueeze(1),
                                                                       groups=conv_w.shape[0]))[0].t()
        q, k, v = m._split(conv_out)
        g, beta = m._gates(b, a)
        calls.append(mixed.shape[0])
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.t(), beta.t()

    calls = []
    monkeypatch.setattr(triton_ops, "gdn_prefill_front", torch_front)
    lens = (5, 2, 70)  # the second shorter than the conv's 3 kept inputs; the third past a 64-token chunk
    x = torch.randn(sum(lens), 32)
    starts = [0, 5, 7]
    seqs = [SeqMeta(start=s, length=n, cached=0, state_slot=slot, kv_index=torch.zeros(0, dtype=torch.long))
            for s, n, slot in zip(starts, lens, (0, 2, 3))]
    seqs[2].snapshots = [(40, 5)]
    seqs[1].checkpoints = [1, 4]  # a verify sequence: the step recurrence, not the front
    batch = ForwardBatch(torch.zeros(sum(lens), dtype=torch.long), torch.zeros(sum(lens), dtype=torch.long), seqs,
                         torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    conv0, rec0 = torch.randn(6, m.conv_dim, 3), torch.randn(6, m.hv, m.dk, m.dv) * 0.1
    outs = {}
    for front in (False, True):
        monkeypatch.setattr(m, "_triton_front", lambda mixed, conv_state, on=front: on)
        conv, rec = conv0.clone(), rec0.clone()
        with torch.no_grad():
            outs[front] = (m(x, batch, conv, rec), conv, rec)
    assert calls == [5, 70]
    torch.testing.assert_close(outs[True][0], outs[False][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(outs[True][1], outs[False][1])  # conv windows (and the snapshot's) cut alike
    torch.testing.assert_close(outs[True][2], outs[False][2], rtol=1e-5, atol=1e-5)
    assert not torch.equal(outs[True][1][5], conv0[5])  # the snapshot slot was written
