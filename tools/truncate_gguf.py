#!/usr/bin/env python3
"""truncate_gguf.py: a smaller copy of a Llama-family GGUF file that cascade
and Hugging Face transformers both read as a model of its own: the first
--layers blocks, the same tokenizer and metadata (block_count set to the
layers kept), and, with --embd-type, the token embedding requantized (for
instance Q8_0 to Q4_0, about half the bytes). The device machine takes 64 MiB
a call; the default model is 98 MB, so its tests there run on such a copy.

    python3 tools/truncate_gguf.py IN.gguf OUT.gguf --layers 8 [--embd-type Q4_0]

Needs `gguf` from PyPI (tools/setup.sh installs it).
"""
import argparse
import re
import sys

import numpy as np

try:
    import gguf
    from gguf import quants
except ImportError:
    sys.exit("truncate_gguf.py needs the gguf package: pip install gguf")


def copy_field(w, key, field):
    """Copies one metadata key-value of the reader to the writer."""
    vtype = field.types[0]
    val = field.contents()
    sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
    w.add_key_value(key, val, vtype, sub_type=sub)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--layers", type=int, required=True, help="blocks to keep (the first N)")
    ap.add_argument("--embd-type", default=None, help="requantize token_embd.weight to this type (Q4_0, Q8_0, F16...)")
    a = ap.parse_args()

    r = gguf.GGUFReader(a.src)
    arch = r.fields["general.architecture"].contents()
    n_old = r.fields[f"{arch}.block_count"].contents()
    if not 1 <= a.layers <= n_old:
        sys.exit(f"--layers must be 1..{n_old}")
    w = gguf.GGUFWriter(a.dst, arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == f"{arch}.block_count":
            w.add_key_value(key, a.layers, field.types[0])
        else:
            copy_field(w, key, field)

    blk = re.compile(r"^blk\.(\d+)\.")
    kept = 0
    for t in r.tensors:
        m = blk.match(t.name)
        if m and int(m.group(1)) >= a.layers:
            continue
        data, qtype = t.data, t.tensor_type
        shape = [int(x) for x in reversed(t.shape)]  # numpy order: rows, columns
        if t.name == "token_embd.weight" and a.embd_type:
            to = gguf.GGMLQuantizationType[a.embd_type]
            f32 = quants.dequantize(np.asarray(data), qtype).reshape(shape).astype(np.float32)
            if to == gguf.GGMLQuantizationType.F32:
                data = f32
            elif to == gguf.GGMLQuantizationType.F16:
                data = f32.astype(np.float16)
            else:
                data = quants.quantize(f32, to)
            qtype = to
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(t.name, np.asarray(data).reshape(shape), raw_dtype=qtype)
        else:
            byte_shape = quants.quant_shape_to_byte_shape(shape, qtype)
            w.add_tensor(t.name, np.asarray(data, dtype=np.uint8).reshape(byte_shape), raw_dtype=qtype)
        kept += 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{a.dst}: {a.layers} of {n_old} blocks, {kept} tensors")


if __name__ == "__main__":
    main()
