# PyTorch's causal prefill on this GPU, for the same-call comparison with
# cascade's (bench/cuda/run_device.sh step prefill): one sequence of L tokens, Hq
# heads (K and V with Hq heads too, as in ../shared/anchors/torch_cascade_anchor.py),
# head dim 128, bf16; SDPA's default choice and each backend on its own.
# Medians of CUDA-event timings after warm-up (TORCH_PF_ITERS, default 20;
# TORCH_PF_BACKENDS picks backends); FLOPs counted causal
# (2 * 2 * L * L / 2 * D * Hq). Prints one JSON line per backend.
import json, os, sys
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

L = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
Hq, D = 32, 128
torch.manual_seed(0)
q = torch.randn(1, Hq, L, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn_like(q)
v = torch.randn_like(q)


ITERS = int(os.environ.get("TORCH_PF_ITERS", "20"))  # more: long enough to sample the clocks


def bench(fn, iters=ITERS, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


fl = 2 * 2 * L * L / 2 * D * Hq
backends = [("default", None), ("flash", SDPBackend.FLASH_ATTENTION),
            ("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
only = os.environ.get("TORCH_PF_BACKENDS")  # e.g. "default,cudnn"
for name, be in backends:
    if only and name not in only.split(","):
        continue
    try:
        if be is None:
            ms = bench(lambda: sdpa(q, k, v, is_causal=True))
        else:
            with sdpa_kernel(be):
                ms = bench(lambda: sdpa(q, k, v, is_causal=True))
        print(json.dumps(dict(backend=name, L=L, Hq=Hq, D=D, ms=ms, TFLOPs=fl / (ms * 1e-3) / 1e12,
                              torch=torch.__version__, device=torch.cuda.get_device_name())), flush=True)
    except Exception as e:  # a backend this build or GPU lacks
        print(json.dumps(dict(backend=name, error=str(e)[:200])), flush=True)
