#!/usr/bin/env python3
"""make_seeds.py: writes the seed corpus for fuzz_gguf.c into the directory
given as the only argument. The seeds are small, well-formed GGUF files that
reach every part of the reader (each value type, arrays, string arrays,
tensors of several types, the K-quants among them, v2 and v3, a custom
alignment) and a tiny byte-level BPE vocabulary with merges, special tokens
and a chat template, so that the fuzzer starts from inputs the tokenizer also
accepts. Standard library only.
"""
import os
import struct
import sys

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
       BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}


def s(x):
    b = x.encode() if isinstance(x, str) else x
    return struct.pack("<Q", len(b)) + b


def value(t, v):
    if t == STR:
        return s(v)
    if t == ARR:
        et, items = v
        out = struct.pack("<IQ", et, len(items))
        return out + b"".join(value(et, x) for x in items)
    return struct.pack(FMT[t], v)


def gguf(kvs, tensors, version=3, alignment=32):
    """kvs: [(key, type, value)]; tensors: [(name, dims, ggml_type, bytes)]"""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for k, t, v in kvs:
        out += s(k) + struct.pack("<I", t) + value(t, v)
    off = 0
    offs = []
    for name, dims, tt, data in tensors:
        offs.append(off)
        out += s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", tt, off)
        off += len(data)
        off = (off + alignment - 1) // alignment * alignment
    out += b"\0" * ((-len(out)) % alignment)
    base = len(out)
    for (name, dims, tt, data), o in zip(tensors, offs):
        out += b"\0" * (base + o - len(out)) + data
    return out


def byte_alphabet():
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    m, n = {}, 0
    for b in range(256):
        if b in keep:
            m[b] = chr(b)
        else:
            m[b] = chr(256 + n)
            n += 1
    return m


def tiny_vocab(pre, template):
    alpha = byte_alphabet()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [alpha[b] for b in range(256)]
    types = [3, 3, 3] + [1] * 256
    merges = []
    for a, b in [("H", "e"), ("l", "l"), ("He", "ll"), ("Hell", "o"), ("\u0120", "w"), ("o", "r"),
                 ("\u0120w", "or"), ("l", "d"), ("\u0120wor", "ld")]:
        merges.append(a + " " + b)
        if a + b not in tokens:
            tokens.append(a + b)
            types.append(1)
    tokens.append("<tool>")
    types.append(4)
    return [
        ("general.architecture", STR, "llama"),
        ("tokenizer.ggml.model", STR, "gpt2"),
        ("tokenizer.ggml.pre", STR, pre),
        ("tokenizer.ggml.tokens", ARR, (STR, tokens)),
        ("tokenizer.ggml.token_type", ARR, (I32, types)),
        ("tokenizer.ggml.merges", ARR, (STR, merges)),
        ("tokenizer.ggml.bos_token_id", U32, 1),
        ("tokenizer.ggml.eos_token_id", U32, 2),
        ("tokenizer.ggml.unknown_token_id", U32, 0),
        ("tokenizer.ggml.add_bos_token", BOOL, True),
        ("tokenizer.chat_template", STR, template),
    ]


def tiny_spm_vocab():
    """A SentencePiece vocabulary: <unk> <s> </s>, the 256 byte tokens, a few pieces, scores."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = ["\u2581", "H", "e", "l", "o", "w", "r", "d", "\u2581H", "el", "lo", "\u2581Hel", "\u2581Hello",
              "\u2581w", "or", "\u2581wor", "ld", "\u2581world", "\u00e9"]
    tokens += pieces + ["<tool>"]
    types += [1] * len(pieces) + [4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0]
    return [
        ("general.architecture", STR, "llama"),
        ("tokenizer.ggml.model", STR, "llama"),
        ("tokenizer.ggml.tokens", ARR, (STR, tokens)),
        ("tokenizer.ggml.scores", ARR, (F32, scores)),
        ("tokenizer.ggml.token_type", ARR, (I32, types)),
        ("tokenizer.ggml.add_space_prefix", BOOL, True),
    ]


CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are tiny.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
          " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "corpus"
    os.makedirs(out, exist_ok=True)
    every = [("t.u8", U8, 200), ("t.i8", I8, -100), ("t.u16", U16, 60000), ("t.i16", I16, -30000),
             ("t.u32", U32, 4000000000), ("t.i32", I32, -2000000000), ("t.f32", F32, 1.5),
             ("t.bool", BOOL, True), ("t.str", STR, "hello"), ("t.u64", U64, 2**63 + 5),
             ("t.i64", I64, -2**62), ("t.f64", F64, -2.25),
             ("a.u8", ARR, (U8, [1, 2, 3])), ("a.i64", ARR, (I64, [-1, 0, 1])),
             ("a.f32", ARR, (F32, [0.5, 1.5])), ("a.str", ARR, (STR, ["x", "", "\u03b3"])),
             ("a.bool", ARR, (BOOL, [True, False]))]
    f32 = struct.pack("<6f", *range(6))
    q4 = bytes(range(36))
    q8 = bytes(34)
    tens = [("w.f32", [3, 2], 0, f32), ("w.q4_0", [64], 2, q4), ("w.q8_0", [32, 1], 8, q8),
            ("w.f16", [4], 1, struct.pack("<4H", 0, 0x3c00, 0x4000, 0x4200))]
    # two rows of one block of each K-quant, IQ4 and Q5 type (ggml ids, block bytes),
    # patterned bytes after an f16 1.0 (the scale d of the types that start with it)
    kq = []
    for name, tt, bb, bs in [("q2_k", 10, 84, 256), ("q3_k", 11, 110, 256), ("q4_k", 12, 144, 256),
                             ("q5_k", 13, 176, 256), ("q6_k", 14, 210, 256), ("iq4_nl", 20, 18, 32),
                             ("iq4_xs", 23, 136, 256), ("q5_0", 6, 22, 32), ("q5_1", 7, 24, 32)]:
        blk = b"\x00\x3c" + bytes((i * 37 + tt) % 256 for i in range(bb - 2))
        kq.append(("w." + name, [bs, 2], tt, blk * 2))
    seeds = {
        "empty_v3.gguf": gguf([], []),
        "empty_v2.gguf": gguf([], [], version=2),
        "every_type_v3.gguf": gguf(every, tens),
        "every_type_v2.gguf": gguf(every, tens, version=2),
        "align64.gguf": gguf(every[:3] + [("general.alignment", U32, 64)], tens, alignment=64),
        "tok_smollm_chatml.gguf": gguf(tiny_vocab("smollm", CHATML), []),
        "tok_llama3.gguf": gguf(tiny_vocab("llama3", LLAMA3), [("w", [32], 0, bytes(128))]),
        "tok_qwen2.gguf": gguf(tiny_vocab("qwen2", CHATML), [], version=2),
        "kquant_types.gguf": gguf(every[:2], kq),
        "tok_spm.gguf": gguf(tiny_spm_vocab(), []),
    }
    for name, data in seeds.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    print(f"make_seeds.py: wrote {len(seeds)} seeds to {out}")


if __name__ == "__main__":
    main()
