"""The decode step of a dense fp32 decoder as kernels compiled by numba for the CPU they run on: one call a step,
``step``, for ``kvlab.model.numba_step``.

Every product reads its weight ``[out, in]``, one row at a time against the activation: the matrix streams front to
back, and LLVM vectorises the dot products for the instruction set it finds (AVX2, AVX-512). Keys are read key-major,
values token-major, as ``kvlab.cache.ContiguousKVCache`` stores them. Compiled at the first call, then cached on
disk beside this file (``cache=True``). Importing this module needs numba: ``pip install -e .[numba]``.
"""

from __future__ import annotations

import numba
import numpy as np

# Every fast-math flag but "no NaN" and "no inf": a NaN or an inf in the weights or the cache still shows in the
# logits, as it does under eager.
FAST = {"reassoc", "contract", "arcp", "nsz", "afn"}
jit = numba.njit(fastmath=FAST, cache=True, nogil=True, boundscheck=False)


@jit
def matvec(w, x, out, add):
    """``out[b] (+)= w @ x[b]`` for ``w`` ``[n, k]`` (``[out, in]``), ``x`` ``[B, k]``, ``out`` ``[B, n]``: one
    pass over ``w``'s rows, each read once for the whole batch. Four sequences at a time share each load of a row's
    weights: from batch 4 on the products are bound by arithmetic, not memory, and one sequence at a time took
    17-21% longer at batch 8, 0-22% at batch 4 (docs/cpu_performance.md, section Q)."""
    n, k = w.shape
    batch = x.shape[0]
    for i in range(n):
        b = 0
        while b + 4 <= batch:
            a0, a1, a2, a3 = np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0)
            for j in range(k):
                wij = w[i, j]
                a0 += wij * x[b, j]
                a1 += wij * x[b + 1, j]
                a2 += wij * x[b + 2, j]
                a3 += wij * x[b + 3, j]
            for r, acc in enumerate((a0, a1, a2, a3)):
                out[b + r, i] = out[b + r, i] + acc if add else acc
            b += 4
        while b < batch:
            acc = np.float32(0.0)
            for j in range(k):
                acc += w[i, j] * x[b, j]
            out[b, i] = out[b, i] + acc if add else acc
            b += 1


@jit
def rms_norm(x, weight, eps, out):
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last axis of ``x`` ``[B, d]``, into ``out``."""
    d = x.shape[1]
    for b in range(x.shape[0]):
        ss = np.float32(0.0)
        for j in range(d):
            ss += x[b, j] * x[b, j]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(d) + np.float32(eps))
        for j in range(d):
            out[b, j] = x[b, j] * inv * weight[j]


@jit
def rope(x, cos, sin):
    """Rotate-half RoPE in place on ``x`` ``[heads, D]`` (``sin`` carries the sign: ``RotaryEmbedding``)."""
    half = x.shape[1] // 2
    for h in range(x.shape[0]):
        for i in range(half):
            a, c = x[h, i], x[h, i + half]
            x[h, i] = a * cos[i] + c * sin[i]
            x[h, i + half] = c * cos[i + half] + a * sin[i + half]


@jit
def scores_of(q, k, n, s):
    """``s[h, t] = q[h] . k[:, t]`` for the G heads of ``q`` ``[G, D]`` and tokens ``t < n`` of ``k``, key-major
    ``[D, capacity]``. Eight key rows per pass over the scores: each pass streams eight contiguous runs of keys for
    one read and write of the scores (one row a pass read them at about 0.8 of the speed; chunks of tokens small
    enough for the L2 cache at about 0.65: short runs defeat the prefetcher). The G heads of a group take turns
    over the same eight rows, read again from the cache."""
    d = k.shape[0]
    s[:, :n] = 0.0
    j = 0
    while j + 8 <= d:
        r0, r1, r2, r3, r4, r5, r6, r7 = k[j], k[j + 1], k[j + 2], k[j + 3], k[j + 4], k[j + 5], k[j + 6], k[j + 7]
        for h in range(q.shape[0]):
            q0, q1, q2, q3 = q[h, j], q[h, j + 1], q[h, j + 2], q[h, j + 3]
            q4, q5, q6, q7 = q[h, j + 4], q[h, j + 5], q[h, j + 6], q[h, j + 7]
            sh = s[h]
            for t in range(n):
                lo = (q0 * r0[t] + q1 * r1[t]) + (q2 * r2[t] + q3 * r3[t])
                sh[t] += lo + ((q4 * r4[t] + q5 * r5[t]) + (q6 * r6[t] + q7 * r7[t]))
        j += 8
    while j < d:
        row = k[j]
        for h in range(q.shape[0]):
            qj, sh = q[h, j], s[h]
            for t in range(n):
                sh[t] += qj * row[t]
        j += 1


# 2**f for f in [0, 1): exp(f ln 2)'s Taylor series to degree 7, relative error below 2e-6 (highest power first).
EXP2_TAYLOR = (1.5252734e-05, 1.5403530e-04, 1.3333558e-03, 9.6181291e-03, 5.5504109e-02, 2.4022651e-01, 6.9314718e-01)
LOG2_E = 1.4426950408889634


@jit
def softmax(s, n):
    """``s[:n]`` -> its softmax, in place.

    ``exp`` is written out as 2**whole * 2**fraction, a polynomial and an exponent's bits, so that LLVM vectorises
    it: libm's ``expf``, called once a score, took 4 times as long, 15% of a step at 8,192 tokens. A NaN score still
    gives NaN (no clamp swallows it)."""
    top = s[0]
    for t in range(1, n):
        top = max(top, s[t])
    bits = np.empty(n, np.int32)
    for t in range(n):
        y = (s[t] - top) * np.float32(LOG2_E)
        y = np.float32(-126.0) if y < -126.0 else y  # below, 2**y is under fp32's smallest normal: as good as 0
        whole = np.floor(y)
        f = y - whole
        p = np.float32(EXP2_TAYLOR[0])
        for c in EXP2_TAYLOR[1:]:
            p = p * f + np.float32(c)
        s[t] = p * f + np.float32(1.0)
        bits[t] = (np.int32(whole) + np.int32(127)) << 23  # 2**whole as an fp32's bits
    scale = bits.view(np.float32)
    total = np.float32(0.0)
    for t in range(n):
        s[t] *= scale[t]
        total += s[t]
    inv = np.float32(1.0) / total
    for t in range(n):
        s[t] *= inv


@jit
def weigh_values(p, v, n, o):
    """``o[h] = sum_t p[h, t] v[t]`` over tokens ``t < n`` of ``v`` ``[capacity, D]``, for the G heads of ``p``
    ``[G, capacity]`` and ``o`` ``[G, D]``: four value rows at a time, each read once for the G heads."""
    o[:] = 0.0
    t = 0
    while t + 4 <= n:
        v0, v1, v2, v3 = v[t], v[t + 1], v[t + 2], v[t + 3]
        for h in range(p.shape[0]):
            p0, p1, p2, p3, oh = p[h, t], p[h, t + 1], p[h, t + 2], p[h, t + 3], o[h]
            for j in range(oh.shape[0]):
                oh[j] += (p0 * v0[j] + p1 * v1[j]) + (p2 * v2[j] + p3 * v3[j])
        t += 4
    while t < n:
        row = v[t]
        for h in range(p.shape[0]):
            pt, oh = p[h, t], o[h]
            for j in range(oh.shape[0]):
                oh[j] += pt * row[j]
        t += 1


@jit
def attend(q, keys, values, n, scale, out, scores):
    """One sequence's attention over its first ``n`` slots: ``q`` ``[H, D]`` (scaled in place), ``keys``
    ``[Hkv, D, capacity]`` (key-major), ``values`` ``[Hkv, capacity, D]``, into ``out`` ``[H, D]``; ``scores``
    ``[G, >= n]`` scratch. Query head ``h`` reads KV head ``h // G`` (``kvlab.model.attention.group_queries``),
    and each group's keys and values stream from memory once."""
    hkv = keys.shape[0]
    g_size = q.shape[0] // hkv
    q *= scale
    for g in range(hkv):
        heads = slice(g * g_size, (g + 1) * g_size)
        scores_of(q[heads], keys[g], n, scores)
        for h in range(g_size):
            softmax(scores[h], n)
        weigh_values(scores, values[g], n, out[heads])


@jit
def step(tokens, pos, cos_table, sin_table, weights, keys, values, n_heads, logits):
    """One decode step of ``tokens`` ``[B]`` at position ``pos``: writes their K/V into slot ``pos`` of ``keys``
    and ``values`` (per layer ``[B, Hkv, D, capacity]`` and ``[B, Hkv, capacity, D]``), logits into ``logits``
    ``[B, V]``. False, with nothing written, if an id lies outside the vocabulary. ``cos_table``, ``sin_table``:
    RoPE's ``[positions, D]`` (``RotaryEmbedding``'s table, its sign in ``sin``), read at ``pos``. ``weights``: the
    embedding ``[V, d]``; the norms' weights ``[L, 2, d]`` and epsilons ``[L, 2]`` (before attention, before the
    MLP); the projections ``[L, out, in]`` (QKV, output, gate and up, down); the softmax scales ``[L]``; the final
    norm's weight and epsilon; the head ``[V, d]``."""
    embed, norms, eps, wqkv, wo, wgu, wdown, scales, final_norm, final_eps, head = weights
    for b in range(tokens.shape[0]):
        if tokens[b] < 0 or tokens[b] >= embed.shape[0]:
            return False
    cos, sin = cos_table[pos], sin_table[pos]
    b_size, d_model = tokens.shape[0], embed.shape[1]
    n_layers = wqkv.shape[0]
    hkv, head_dim = values[0].shape[1], values[0].shape[3]
    qk_heads = n_heads + hkv
    d_ff = wdown.shape[2]
    x = np.empty((b_size, d_model), np.float32)
    xn = np.empty((b_size, d_model), np.float32)
    qkv = np.empty((b_size, wqkv.shape[1]), np.float32)
    attended = np.empty((b_size, n_heads * head_dim), np.float32)
    gu = np.empty((b_size, 2 * d_ff), np.float32)
    act = np.empty((b_size, d_ff), np.float32)
    scores = np.empty((n_heads // hkv, pos + 1), np.float32)
    for b in range(b_size):
        x[b] = embed[tokens[b]]
    for layer in range(n_layers):
        rms_norm(x, norms[layer, 0], eps[layer, 0], xn)
        matvec(wqkv[layer], xn, qkv, False)
        for b in range(b_size):
            heads = qkv[b].reshape((qk_heads + hkv, head_dim))
            rope(heads[:qk_heads], cos, sin)
            keys[layer][b, :, :, pos] = heads[n_heads:qk_heads]
            values[layer][b, :, pos, :] = heads[qk_heads:]
            attend(
                heads[:n_heads],
                keys[layer][b],
                values[layer][b],
                pos + 1,
                scales[layer],
                attended[b].reshape((n_heads, head_dim)),
                scores,
            )
        matvec(wo[layer], attended, x, True)
        rms_norm(x, norms[layer, 1], eps[layer, 1], xn)
        matvec(wgu[layer], xn, gu, False)
        for b in range(b_size):
            for j in range(d_ff):
                gate = gu[b, j]
                act[b, j] = gate / (np.float32(1.0) + np.exp(-gate)) * gu[b, d_ff + j]
        matvec(wdown[layer], act, x, True)
    rms_norm(x, final_norm, final_eps, xn)
    matvec(head, xn, logits, False)
    return True
