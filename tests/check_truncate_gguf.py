#!/usr/bin/env python3
"""Checks tools/truncate_gguf.py, the writer of the model copies that the GPU
machine's tests run on: the copy of the default model cut to its first two
layers, its token embedding requantized Q8_0 -> Q4_0, read back by the `gguf`
package (an independent reader) and by cascade itself. Prints "N passed, N
failed" like the C tests.
"""
import os
import subprocess
import sys
import tempfile

import numpy as np

BUILD = os.environ.get("BUILD", "build")
CASCADE = os.path.join(BUILD, "cascade")
MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"

from checklib import check, summary


def main():
    try:
        import gguf
        from gguf import quants
    except ImportError:
        print("FAIL check_truncate_gguf needs the gguf package (tools/setup.sh installs it)")
        print("0 passed, 1 failed")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cut.gguf")
        r = subprocess.run([sys.executable, "tools/truncate_gguf.py", MODEL, out, "--layers", "2", "--embd-type", "Q4_0"],
                           capture_output=True, text=True)
        check(r.returncode == 0, f"truncate_gguf.py ran ({r.stderr.strip()[-200:]})")
        if r.returncode:
            return summary()
        src, cut = gguf.GGUFReader(MODEL), gguf.GGUFReader(out)
        check(cut.fields["llama.block_count"].contents() == 2, "block_count is 2")
        names = {t.name for t in cut.tensors}
        want = {t.name for t in src.tensors if not t.name.startswith("blk.") or t.name.split(".")[1] in ("0", "1")}
        check(names == want, f"the first two blocks' tensors and the others, nothing more ({len(names)})")
        same_kv = all(cut.fields[k].contents() == f.contents() for k, f in src.fields.items()
                      if not k.startswith("GGUF.") and k != "llama.block_count")
        check(same_kv, "every other metadata value as in the source (tokenizer, template, hyper-parameters)")
        by = {t.name: t for t in src.tensors}
        identical = all(np.array_equal(np.asarray(t.data), np.asarray(by[t.name].data)) and
                        t.tensor_type == by[t.name].tensor_type for t in cut.tensors if t.name != "token_embd.weight")
        check(identical, "the kept blocks' tensors byte for byte")
        te, te0 = [t for t in cut.tensors if t.name == "token_embd.weight"][0], by["token_embd.weight"]
        check(te.tensor_type == gguf.GGMLQuantizationType.Q4_0, "token_embd is Q4_0")
        a = quants.dequantize(np.asarray(te.data), te.tensor_type).reshape(-1, 32).astype(np.float64)
        b = quants.dequantize(np.asarray(te0.data), te0.tensor_type).reshape(-1, 32).astype(np.float64)
        # Q4_0: steps of d = max / -8 (the block's value of largest magnitude), half a step of
        # error, a whole one where -max clamps to level 15; d itself is rounded to f16 (the 1%)
        bound = np.abs(b).max(axis=1, keepdims=True) / 8 * 1.01 + 1e-6
        check(bool((np.abs(a - b) <= bound).all()), "token_embd within Q4_0's step of the source's values")
        # cascade reads it and runs it
        r = subprocess.run([CASCADE, "generate", "-m", out, "--device", "cpu", "--temperature", "0", "-n", "4", "-q",
                            "--threads", "2", "-p", "The capital of France is"], capture_output=True, text=True)
        check(r.returncode == 0, f"cascade generate runs the copy (rc {r.returncode}: {r.stderr.strip()[-200:]})")
        r = subprocess.run([sys.executable, "tools/truncate_gguf.py", MODEL, out, "--layers", "31"],
                           capture_output=True, text=True)
        check(r.returncode != 0 and "layers" in r.stderr, "more layers than the source: refused")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
