#!/usr/bin/env python3
"""make_arch_models.py: tiny random-weight GGUF files of each architecture
cascade runs, for checking its forward pass against llama.cpp.

No other model files can be downloaded here, so these are made: each file is a
real model of its architecture (the tensors, keys and tokenizer that
llama.cpp's converter would write for it) with few layers, a narrow residual
stream and random weights from a fixed seed. The vocabularies are made from a
real one, the default model's GPT-2 byte-level BPE
(models/SmolLM2-135M-Instruct.Q4_1.gguf):
  - BPE files: its first VOCAB tokens and the merges among them, so that
    tokenization exercises the pre-tokenizer each file names;
  - SentencePiece files (tokenizer.ggml.model "llama": Llama 2, Mistral,
    Gemma): the same tokens turned into pieces as SentencePiece writes them
    (a space as U+2581, whole UTF-8 characters only), scored by their merge
    order, behind the special tokens of the family and the 256 byte-fallback
    tokens <0x00>..<0xFF>, with a few single characters of other scripts at
    the end (spm_vocab). Weights are f16 (the 1-D ones
f32), one output matrix q8_0, so that the files stay small enough to commit
(tests/fixtures/arch/, each under 1 MB).

Besides the .gguf files it writes tests/fixtures/arch/manifest.json: per model
the prompts and tricky strings that tools/make_reference_logits.sh gives
llama.cpp, and, where the file has a chat template, a conversation rendered
by Jinja2 from that template (the reference for cascade's chat rendering).

usage: python3 tools/make_arch_models.py [OUTDIR]   (default tests/fixtures/arch)
"""
import json
import math
import os
import sys

import numpy as np
import gguf
from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType

SRC_MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB = 1024
SEED = 20250

# Strings whose token ids must equal llama.cpp's: spaces, digits, contractions,
# punctuation runs, newlines and tabs, accents and other scripts (bytes), and
# special tokens inside text.
TRICKY = [
    "Hello world",
    "  two leading spaces and trailing  ",
    "tabs\tand\nnewlines\n\n\nthree",
    "numbers 1234567 and 3.14159, 2024-01-31",
    "don't I'LL we've they'RE it's",
    "émigré naïve café Ünïcödé",
    "日本語のテキストと中文",
    "emoji 🤖🚀 and ©®™",
    "<|im_start|>user\nhi there<|im_end|>",
    "a  b   c    d     e",
    "!!!???...;;; --- ***",
    "CamelCaseWords and snake_case_words",
    "x",
    # SentencePiece: its special tokens (plain text in the BPE files), the escaped space typed in
    # the text, a byte token's name typed in the text, a non-breaking space, the empty string
    "[INST] Hi there [/INST] <s>x</s><unk>y <mask> z",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "x\u2581y \u2581 z <0x41>",
    "\n leading newline and\u00a0nbsp",
    "",
]

PROMPTS = [
    "The capital of France is",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "What is the boiling point of water at sea level?<|im_end|>\n<|im_start|>assistant\n",
    "In the beginning of the twentieth century, the small harbour town was known for its fishing fleet, "
    "its lighthouse and a bakery whose bread was carried by train to the capital every morning.",
]

# The second prompt as each family's chat turns look (special tokens parsed).
PROMPTS_LLAMA2 = [PROMPTS[0], "[INST] What is the boiling point of water at sea level? [/INST]", PROMPTS[2]]
PROMPTS_GEMMA = [PROMPTS[0], "<start_of_turn>user\nWhat is the boiling point of water at sea level?<end_of_turn>\n"
                 "<start_of_turn>model\n", PROMPTS[2]]

# The chat template of Qwen2.5 files (the tools branch included: cascade must
# find the default system message in the plain branch).
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)

# A Qwen3-style template: no default system message, a thinking switch.
QWEN3_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}\n"
)

CHATS = [
    [{"role": "user", "content": "Hi! What is 2 + 2?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}],
]


def read_vocab(n=VOCAB):
    """The first n tokens of the default model, their types, and the merges among them."""
    r = GGUFReader(SRC_MODEL)
    f = r.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(f.parts[i]).decode("utf-8") for i in f.data][:n]
    f = r.fields["tokenizer.ggml.token_type"]
    types = [int(f.parts[i][0]) for i in f.data][:n]
    f = r.fields["tokenizer.ggml.merges"]
    have = set(tokens)
    merges = []
    for i in f.data:
        m = bytes(f.parts[i]).decode("utf-8")
        a, b = m.split(" ")
        if a in have and b in have and a + b in have:
            merges.append(m)
    return tokens, types, merges


def gpt2_byte_decoder():
    """GPT-2's byte-level alphabet reversed: printable code point -> byte."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cps, n = {}, 0
    for b in range(256):
        if b in keep:
            cps[b] = b
        else:
            cps[b] = 256 + n
            n += 1
    return {chr(c): b for b, c in cps.items()}


# Single characters a SentencePiece vocabulary keeps as pieces (the rest of the
# tricky strings' non-ASCII text goes through byte fallback).
SPM_EXTRA_CHARS = ["é", "è", "ï", "ü", "ç", "日", "本", "の", "中", "▁é"]
SPM_VOCAB = 1280


def spm_vocab(style):
    """A SentencePiece vocabulary as llama.cpp's converter writes one: tokens,
    scores, token types. style "llama" (Llama 2, Mistral): <unk> <s> </s>,
    Mistral's [INST] [/INST] control tokens, no newline or tab pieces (they
    become byte tokens), add_space_prefix left to its default (on). style
    "gemma": <pad> <eos> <bos> <unk> <mask> <start_of_turn> <end_of_turn>,
    newline, tab and whitespace-run pieces, add_space_prefix off; and two
    pieces share each score, so that equal scores are broken by position."""
    r = GGUFReader(SRC_MODEL)
    f = r.fields["tokenizer.ggml.tokens"]
    src = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
    f = r.fields["tokenizer.ggml.token_type"]
    src_types = [int(f.parts[i][0]) for i in f.data]
    UNK, CONTROL, USER, BYTE = 2, 3, 4, 6
    if style == "llama":
        special = [("<unk>", UNK), ("<s>", CONTROL), ("</s>", CONTROL), ("[INST]", CONTROL), ("[/INST]", CONTROL),
                   ("<mask>", USER)]
    else:
        special = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNK), ("<mask>", USER),
                   ("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL)]
    tokens = [t for t, _ in special] + [f"<0x{b:02X}>" for b in range(256)]
    types = [ty for _, ty in special] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    dec = gpt2_byte_decoder()
    have = set(tokens) | set(SPM_EXTRA_CHARS)
    pieces = []
    for t, ty in zip(src, src_types):
        if len(tokens) + len(pieces) + len(SPM_EXTRA_CHARS) >= SPM_VOCAB:
            break
        if ty != 1:
            continue
        try:
            text = bytes(dec[c] for c in t).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue  # part of a character: SentencePiece pieces are whole characters
        allowed = "\n\t" if style == "gemma" else ""
        if any((ord(c) < 32 and c not in allowed) or ord(c) == 127 for c in text):
            continue
        piece = text.replace(" ", "\u2581")
        if piece in have:
            continue
        have.add(piece)
        pieces.append(piece)
    pieces += SPM_EXTRA_CHARS
    for i, p in enumerate(pieces):
        tokens.append(p)
        types.append(1)
        scores.append(-float(i // 2 if style == "gemma" else i))
    return tokens, types, scores


def llama3_rope_factors(n_rot, base, factor=8.0, low=1.0, high=4.0, old_ctx=32):
    """Llama 3.1's frequency factors (as its converter computes them), with a
    short original context so that they matter within a few dozen tokens."""
    out = []
    for i in range(0, n_rot, 2):
        freq = 1.0 / (base ** (i / n_rot))
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_model(path, spec, vocab, rng, dtype=np.float16):
    """spec's model with random weights from rng; the matrices and the token
    embedding in dtype (np.float16 or np.float32), the 1-D weights f32."""
    arch = spec["arch"]
    gemma = arch in ("gemma2", "gemma3")
    E, F, L = spec["embd"], spec["ff"], spec["layers"]
    H, HKV, D = spec["heads"], spec["kv_heads"], spec["head_dim"]
    QD, KD = H * D, HKV * D
    w = GGUFWriter(path, arch)
    w.add_name(spec.get("general_name", "tiny-" + spec["name"]))
    w.add_block_count(L)
    w.add_context_length(512)
    w.add_embedding_length(E)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    if D * H != E or gemma:  # the Gemma converters always write them
        w.add_key_length(D)
        w.add_value_length(D)
    if arch != "gemma2":  # Gemma 2's converter writes no RoPE keys: the defaults apply
        w.add_rope_dimension_count(spec.get("n_rot", D))
        w.add_rope_freq_base(spec.get("rope_base", 10000.0))
    if "rope_base_swa" in spec:
        w.add_rope_freq_base_swa(spec["rope_base_swa"])
    w.add_layer_norm_rms_eps(1e-6 if arch != "llama" else 1e-5)
    if "rope_linear" in spec:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(spec["rope_linear"])
    if "window" in spec:
        w.add_sliding_window(spec["window"])
    if "attn_softcap" in spec:
        w.add_attn_logit_softcapping(spec["attn_softcap"])
    if "final_softcap" in spec:
        w.add_final_logit_softcapping(spec["final_softcap"])
    if vocab[0] == "bpe":
        _, tokens, types, merges = vocab
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(spec["pre"])
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(spec.get("bos", 0))
        w.add_eos_token_id(2)
        w.add_add_bos_token(spec.get("add_bos", False))
    else:
        _, tokens, types, scores, style = vocab
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        if style == "gemma":
            w.add_bos_token_id(2)
            w.add_eos_token_id(1)
            w.add_unk_token_id(3)
            w.add_pad_token_id(0)
            w.add_add_space_prefix(False)
        else:
            # ids 0 1 2 are the defaults, written as the converter does; add_space_prefix and
            # add_bos_token are left out: a SentencePiece vocabulary has both on by default
            w.add_bos_token_id(1)
            w.add_eos_token_id(2)
            w.add_unk_token_id(0)
        if style == "gemma":
            w.add_add_bos_token(True)
            w.add_add_eos_token(False)
    if "template" in spec:
        w.add_chat_template(spec["template"])
    n_vocab = len(tokens)

    def mat(rows, cols, scale=1.0):
        return (rng.standard_normal((rows, cols)) * (scale / math.sqrt(cols))).astype(dtype)

    def norm(n, spread=0.1):
        return (1.0 + spread * rng.standard_normal(n)).astype(np.float32)

    # embeddings of spread 0.3: the input is normed anyway; tied, they give logits of spread ~3
    w.add_tensor("token_embd.weight", (0.3 * rng.standard_normal((n_vocab, E))).astype(dtype))
    w.add_tensor("output_norm.weight", norm(E))
    if not spec.get("tied", True):
        out = (rng.standard_normal((n_vocab, E)) * (3.0 / math.sqrt(E))).astype(np.float32)
        q = gguf.quants.quantize(out, GGMLQuantizationType.Q8_0)
        w.add_tensor("output.weight", q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    if spec.get("rope_factors"):
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(D, spec.get("rope_base", 10000.0)))
    for l in range(L):
        p = f"blk.{l}."
        w.add_tensor(p + "attn_norm.weight", norm(E))
        wq, wk, wv = mat(QD, E, 2.0), mat(KD, E, 2.0), mat(KD, E)
        if spec.get("fused"):
            w.add_tensor(p + "attn_qkv.weight", np.concatenate([wq, wk, wv]))
        else:
            w.add_tensor(p + "attn_q.weight", wq)
            w.add_tensor(p + "attn_k.weight", wk)
            w.add_tensor(p + "attn_v.weight", wv)
        if spec.get("qkv_bias"):
            # large enough that dropping them moves every logit
            w.add_tensor(p + "attn_q.bias", (0.8 * rng.standard_normal(QD)).astype(np.float32))
            w.add_tensor(p + "attn_k.bias", (0.8 * rng.standard_normal(KD)).astype(np.float32))
            w.add_tensor(p + "attn_v.bias", (0.8 * rng.standard_normal(KD)).astype(np.float32))
        if spec.get("qk_norm"):
            w.add_tensor(p + "attn_q_norm.weight", norm(D, 0.5))
            w.add_tensor(p + "attn_k_norm.weight", norm(D, 0.5))
        w.add_tensor(p + "attn_output.weight", mat(E, QD))
        if gemma:  # RMSNorm of the attention's and the MLP's outputs before their residuals
            w.add_tensor(p + "post_attention_norm.weight", norm(E))
        w.add_tensor(p + "ffn_norm.weight", norm(E))
        gate, up = mat(F, E), mat(F, E)
        if spec.get("fused"):
            w.add_tensor(p + "ffn_up.weight", np.concatenate([gate, up]))  # gate rows first
        else:
            w.add_tensor(p + "ffn_gate.weight", gate)
            w.add_tensor(p + "ffn_up.weight", up)
        w.add_tensor(p + "ffn_down.weight", mat(E, F))
        if gemma:
            w.add_tensor(p + "post_ffw_norm.weight", norm(E))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


MODELS = [
    # Llama 3.x: RoPE frequency factors, its pre-tokenizer, BOS added, a separate q8_0 output
    dict(name="llama3", arch="llama", layers=2, embd=128, ff=128, heads=2, kv_heads=1, head_dim=64,
         pre="llama-bpe", rope_factors=True, tied=False, add_bos=True, bos=0),
    # Mistral-style: a sliding window (one layer, so that a window's logits can be checked
    # against the same keys run alone) and linear RoPE scaling
    dict(name="mistral", arch="llama", layers=1, embd=128, ff=128, heads=2, kv_heads=1, head_dim=64,
         pre="gpt-2", window=16, rope_linear=2.0),
    # Qwen2.5: biases on Q, K and V, RoPE on halves, its pre-tokenizer and template
    dict(name="qwen2", arch="qwen2", layers=2, embd=128, ff=128, heads=2, kv_heads=1, head_dim=64,
         pre="qwen2", qkv_bias=True, rope_base=1000000.0, template=QWEN25_TEMPLATE),
    # Qwen3: per-head Q/K RMSNorm, heads wider than embd / heads (key_length)
    dict(name="qwen3", arch="qwen3", layers=2, embd=128, ff=128, heads=4, kv_heads=2, head_dim=64,
         pre="qwen2", qk_norm=True, rope_base=1000000.0, template=QWEN3_TEMPLATE),
    # Phi-3 / Phi-4-mini: Q, K, V in one matrix and gate, up in one; RoPE on halves of part of
    # each head (Phi-4-mini rotates 96 of 128)
    dict(name="phi3", arch="phi3", layers=2, embd=128, ff=128, heads=2, kv_heads=1, head_dim=64, n_rot=32,
         pre="default", fused=True,
         # llama.cpp gives special tokens Phi-3's whitespace stripping (and then needs "</s>") when
         # general.name contains "phi3": a Phi-3 SentencePiece quirk that this BPE file does not have
         general_name="tiny-phi"),
    # Llama 2 / Mistral 7B: a SentencePiece vocabulary (Mistral's [INST] tokens), multi-head
    # attention, a separate q8_0 output
    dict(name="llama2", arch="llama", layers=2, embd=128, ff=128, heads=2, kv_heads=2, head_dim=64,
         vocab="spm-llama", tied=False, prompts=PROMPTS_LLAMA2),
    # Gemma 2: the window on every other layer (8 tokens, so that the prompts leave it), soft caps
    # small enough to bend these scores (~5) and logits (~3) as Gemma's 50 and 30 bend its own,
    # post-norms, GeGLU, tied embeddings, heads wider than embd / heads
    dict(name="gemma2", arch="gemma2", layers=4, embd=64, ff=128, heads=2, kv_heads=1, head_dim=64,
         vocab="spm-gemma", window=8, attn_softcap=6.0, final_softcap=4.0, prompts=PROMPTS_GEMMA),
    # Gemma 3: the window on five layers of six, whose RoPE keeps base 10000 and no scaling while
    # the global layer's has base 1e6 and linear scaling by 8 (Gemma 3 4B and up); Q/K norms
    dict(name="gemma3", arch="gemma3", layers=6, embd=64, ff=128, heads=2, kv_heads=1, head_dim=64,
         vocab="spm-gemma", window=8, rope_base=1000000.0, rope_base_swa=10000.0, rope_linear=8.0, qk_norm=True,
         prompts=PROMPTS_GEMMA),
]


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/arch"
    os.makedirs(out, exist_ok=True)
    bpe = ("bpe",) + read_vocab()
    manifest = {"source_vocab": SRC_MODEL, "vocab": VOCAB, "seed": SEED, "tricky": TRICKY, "prompts": PROMPTS,
                "models": []}
    for i, spec in enumerate(MODELS):
        rng = np.random.default_rng(SEED + i)
        path = os.path.join(out, f"tiny-{spec['name']}.gguf")
        kind = spec.get("vocab", "bpe")
        vocab = bpe if kind == "bpe" else ("spm",) + spm_vocab(kind[4:]) + (kind[4:],)
        write_model(path, spec, vocab, rng)
        entry = {"name": spec["name"], "file": path, "arch": spec["arch"], "vocab": kind, "reference": os.path.join(
            out, f"tiny-{spec['name']}-reference.json")}
        if "prompts" in spec:
            entry["prompts"] = spec["prompts"]
        if "template" in spec:
            import jinja2
            env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda x: json.dumps(x)
            t = env.from_string(spec["template"])
            entry["chats"] = [{"messages": msgs, "rendered": t.render(messages=msgs, add_generation_prompt=True,
                                                                         bos_token="<|endoftext|>")}
                              for msgs in CHATS]
        manifest["models"].append(entry)
        print(f"wrote {path} ({os.path.getsize(path)} bytes)")
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
