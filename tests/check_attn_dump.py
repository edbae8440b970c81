#!/usr/bin/env python3
"""Checks `cascade attn-bench --dump` with an independent NumPy implementation.

attn-bench writes the batch it ran (q, K/V pages, the flat paged view) and its
flat and cascade outputs as .npy files. This script recomputes paged attention
from those files alone, in float64, exactly as the dump's meta.json describes
it (scale, causal alignment, soft cap, window), and compares. It prints
"N passed, N failed" like the C tests.
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

BUILD = os.environ.get("BUILD", "build")
CASCADE = os.path.join(BUILD, "cascade")


def attention(d):
    meta = d["meta"]
    q, kp, vp = d["q"].astype(np.float64), d["k_pages"].astype(np.float64), d["v_pages"].astype(np.float64)
    qo, kvp, idx, last = d["qo_indptr"], d["kv_indptr"], d["kv_indices"], d["kv_last_page_len"]
    P, Hq, Hkv = meta["page_size"], meta["num_qo_heads"], meta["num_kv_heads"]
    g = Hq // Hkv
    out = np.zeros_like(q)
    lse = np.full(q.shape[:2], -np.inf)
    for r in range(len(qo) - 1):
        pages = idx[kvp[r]:kvp[r + 1]]
        k = kp[pages].reshape(-1, Hkv, kp.shape[-1])  # [npages*P, Hkv, D]
        v = vp[pages].reshape(-1, Hkv, vp.shape[-1])
        kv_len = (len(pages) - 1) * P + last[r]
        k, v = k[:kv_len], v[:kv_len]
        k = np.repeat(k, g, axis=1)  # [L, Hq, D]
        v = np.repeat(v, g, axis=1)
        ql = qo[r + 1] - qo[r]
        qs = q[qo[r]:qo[r + 1]]  # [ql, Hq, D]
        s = np.einsum("qhd,khd->hqk", qs, k) * meta["sm_scale"]
        if "logits_soft_cap" in meta:
            c = meta["logits_soft_cap"]
            s = c * np.tanh(s / c)
        pos = kv_len - ql + np.arange(ql)[:, None]
        keys = np.arange(kv_len)[None, :]
        vis = np.ones((ql, kv_len), bool)
        if meta["causal"]:
            vis &= keys <= pos
        if "window_left" in meta:
            vis &= keys >= pos - meta["window_left"]
        s = np.where(vis[None], s, -np.inf)
        m = s.max(axis=2, keepdims=True)
        m_safe = np.where(np.isfinite(m), m, 0)
        e = np.exp(s - m_safe)
        tot = e.sum(axis=2, keepdims=True)
        o = np.einsum("hqk,khd->qhd", e / np.where(tot > 0, tot, 1), v)
        out[qo[r]:qo[r + 1]] = o
        lse[qo[r]:qo[r + 1]] = np.where(tot[..., 0] > 0, (m_safe + np.log(np.where(tot > 0, tot, 1)))[..., 0], -np.inf).T
    return out, lse


def run_case(args):
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [CASCADE, "attn-bench", "--repeats", "1", "--warmup", "0", "--json", "--dump", tmp] + args
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            return f"attn-bench failed: {res.stderr.strip()}"
        info = json.loads(res.stdout)
        d = {n[:-4]: np.load(os.path.join(tmp, n)) for n in os.listdir(tmp) if n.endswith(".npy")}
        d["meta"] = json.load(open(os.path.join(tmp, "meta.json")))
    ref, ref_lse = attention(d)
    errs = {
        "flat": np.abs(d["out_flat"] - ref).max(),
        "cascade": np.abs(d["out_cascade"] - ref).max(),
        "lse": np.abs(np.where(np.isfinite(ref_lse), d["lse"] - ref_lse, 0)).max(),
    }
    if not np.array_equal(np.isfinite(ref_lse), np.isfinite(d["lse"])):
        return "lse -inf pattern differs"
    bad = {k: v for k, v in errs.items() if not (v < 1e-4)}
    if bad:
        return f"errors {bad}"
    if info["shared_passes"] < 0:
        return "no plan info"
    return None


CASES = [
    ["--batch", "5", "--prefix", "100", "--suffix", "37", "--heads", "8:2", "--head-dim", "64", "--page-size", "16"],
    ["--tree", "6*70(3*40)+2*33", "--suffix", "20", "--qlen", "5", "--heads", "6:3", "--head-dim", "64",
     "--page-size", "8", "--dtype", "f16", "--soft-cap", "20"],
    ["--batch", "4", "--prefix", "64", "--suffix", "50", "--qlen", "30", "--heads", "4:1", "--head-dim", "128",
     "--page-size", "1", "--dtype", "bf16", "--window", "17"],
    ["--batch", "3", "--prefix", "32", "--suffix", "9", "--qlen", "4", "--heads", "4:4", "--head-dim", "64",
     "--page-size", "4", "--non-causal"],
]


def main():
    passed = failed = 0
    for c in CASES:
        err = run_case(c)
        name = " ".join(c)
        if err:
            failed += 1
            print(f"FAIL dump check [{name}]: {err}")
        else:
            passed += 1
            print(f"ok dump check [{name}]")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
