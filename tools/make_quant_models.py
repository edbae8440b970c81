#!/usr/bin/env python3
"""make_quant_models.py: the source model of tests/fixtures/quants/, files
that llama.cpp's own quantizer (llama-quantize) writes, for checking that
cascade reads and computes every weight type the way llama.cpp does.

The source is a tiny random-weight Llama model (tools/make_arch_models.py's
writer and vocabulary, cut to VOCAB tokens) whose matrices are all 256 or a
multiple of 256 wide, so that llama-quantize gives every matrix the type its
recipe names instead of a fallback for rows that are not whole super-blocks.
The weights are f32, so each quantized file is one rounding away from them.
One layer (and a vocabulary of VOCAB tokens, and the first two of
make_arch_models's prompts) keeps the eleven quantized files and their
references near 4 MB in all; the recipes
still mix types per tensor in that layer (the _M recipes give attn_v and
ffn_down more bits than the other matrices, and the tied embedding, which is
also the output matrix, Q6_K in most of them). Mixes across layers (attn_v
upgraded on some layers only) need more layers than fit here; tests/
test_quants.c checks the forward on such a file separately.

tools/make_reference_logits.sh (WHAT=quants) runs this, quantizes the source
to each type in TYPES, runs llama.cpp on each file and completes the manifest
(OUTDIR/manifest.json) with the tensor types each file holds.

usage: python3 tools/make_quant_models.py OUTDIR SOURCE.gguf
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_arch_models as arch  # noqa: E402

VOCAB = 384
SEED = 20251
SPEC = dict(name="quant", arch="llama", layers=1, embd=256, ff=256, heads=4, kv_heads=2, head_dim=64, pre="smollm",
            general_name="tiny-quant")
# llama-quantize's names of the file types made from the source
TYPES = ["Q2_K", "Q3_K_M", "Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS"]


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    out, src = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    arch.write_model(src, SPEC, ("bpe",) + arch.read_vocab(VOCAB), np.random.default_rng(SEED), dtype=np.float32)
    manifest = {"source": "random-weight llama (tools/make_quant_models.py), f32, quantized by llama-quantize",
                "vocab": VOCAB, "seed": SEED, "spec": SPEC, "tricky": arch.TRICKY, "prompts": arch.PROMPTS[:2],
                "models": [{"name": t.lower(), "ftype": t, "file": os.path.join(out, f"tiny-quant-{t.lower()}.gguf"),
                            "reference": os.path.join(out, f"tiny-quant-{t.lower()}-reference.json")} for t in TYPES]}
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {src} ({os.path.getsize(src)} bytes) and {out}/manifest.json")


if __name__ == "__main__":
    main()
