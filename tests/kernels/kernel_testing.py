"""Shared helpers for the kernel tests: tolerances per dtype and a comparison."""

import numpy as np

# Tolerances per dtype, against the f32 jnp reference on the same (rounded) inputs. bf16: the
# kernels feed bf16 probabilities to the P @ V matmul and round the output to bf16 (eps 2^-8).
TOLERANCES = {"float32": dict(atol=2e-5, rtol=2e-5), "bfloat16": dict(atol=3e-2, rtol=3e-2)}
GRAD_TOLERANCES = {"float32": dict(atol=1e-4, rtol=1e-4), "bfloat16": dict(atol=6e-2, rtol=6e-2)}


def assert_close(actual, expected, dtype_name, tolerances=TOLERANCES):
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(expected, np.float32), **tolerances[dtype_name]
    )


def sliding_window_visible(q_positions, k_positions, window, segment_ids=None):
    """[B, T, S] bool, element by element: key position k is visible to the query at position p
    iff p - window < k <= p (transformers' sliding-window causal mask: kv_idx <= q_idx and
    kv_idx > q_idx - window; window None: causal only) and, with segment ids [B, T] (T == S),
    both carry the same id. q_positions [B, T], k_positions [S]."""
    q_positions = np.asarray(q_positions)
    B, T = q_positions.shape
    visible = np.zeros((B, T, len(k_positions)), bool)
    for b in range(B):
        for i in range(T):
            p = int(q_positions[b, i])
            for j, kpos in enumerate(k_positions):
                ok = kpos <= p and (window is None or kpos > p - window)
                if segment_ids is not None:
                    ok = ok and segment_ids[b, i] == segment_ids[b, j]
                visible[b, i, j] = ok
    return visible


def _probs_f64(q_TD, k_SD, visible_TS, scale, softcap):
    """Softmax probabilities [T, S] and the soft cap's slope d capped / d scaled (1 without)."""
    s = q_TD @ k_SD.T * scale
    slope = np.ones_like(s)
    if softcap is not None:  # Gemma 2: softcap * tanh(s / softcap), before the mask
        t = np.tanh(s / softcap)
        s, slope = softcap * t, 1.0 - t * t
    s = np.where(visible_TS, s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.where(visible_TS, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    denom = p.sum(-1, keepdims=True)
    return p / np.where(denom == 0, 1.0, denom), slope


def attention_f64(q, k, v, visible, sm_scale=None, softcap=None):
    """Float64 numpy attention: q [B, T, Hq, D], k/v [B, S, Hkv, D], visible [B, T, S]; query
    head n uses kv head n // (Hq // Hkv); rows with no visible key give 0. ``softcap``: scaled
    scores s -> softcap * tanh(s / softcap) before the mask (Gemma 2)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    scale = D**-0.5 if sm_scale is None else sm_scale
    out = np.zeros((B, T, Hq, D))
    for b in range(B):
        for n in range(Hq):
            p, _ = _probs_f64(q[b, :, n], k[b, :, n // G], visible[b], scale, softcap)
            out[b, :, n] = p @ v[b, :, n // G]
    return out


def attention_grad_f64(q, k, v, visible, do, sm_scale=None, softcap=None):
    """Float64 numpy dq, dk, dv of sum(do * attention_f64(q, k, v, ...)), derived by hand:
    dv = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dP * P)) (softmax), times the cap's slope
    1 - tanh(s / softcap)^2, then dq = dS K * scale and dk = dS^T Q * scale (GQA heads summed)."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    scale = D**-0.5 if sm_scale is None else sm_scale
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(B):
        for n in range(Hq):
            kv = n // G
            p, slope = _probs_f64(q[b, :, n], k[b, :, kv], visible[b], scale, softcap)
            dv[b, :, kv] += p.T @ do[b, :, n]
            dp = do[b, :, n] @ v[b, :, kv].T
            ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * slope * scale
            dq[b, :, n] = ds @ k[b, :, kv]
            dk[b, :, kv] += ds.T @ q[b, :, n]
    return dq, dk, dv


def pallas_grids(fn, *args):
    """The grid of every ``pallas_call`` in ``fn``'s jaxpr (nested jaxprs included), in order."""
    import jax

    grids = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                grids.append(tuple(eqn.params["grid_mapping"].grid))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        visit(inner)

    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return grids
