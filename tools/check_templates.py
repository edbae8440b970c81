#!/usr/bin/env python3
"""Renders real chat templates with cascade's Jinja interpreter and with
Python's jinja2 (tools/jinja_reference.py) over a set of conversations and
records, per template and conversation, whether the two agree byte for byte.

The templates are llama.cpp's collection (models/templates/ in the
llama-cpp-python sdist that `make reference` unpacks; nothing of them is
committed): Llama 3.x, Qwen2.5, Qwen3, Mistral, Gemma, Phi-3 and many more.
A conversation counts as agreeing when both render the same bytes or both
refuse it (the template's raise_exception, or an error in jinja2 too).

  python3 tools/check_templates.py [--templates DIR] [--out bench/results/chat-templates.json]
"""
import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jinja2  # noqa: E402
from jinja_reference import NOW, render_cascade, render_jinja2  # noqa: E402

REF_DIR = os.environ.get("REF_DIR", "/tmp/cascade-ref")
VER = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
DEFAULT_DIR = f"{REF_DIR}/llama_cpp_python-{VER}/vendor/llama.cpp/models/templates"

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}

SYSTEM = {"role": "system", "content": "You are a concise assistant."}


def conv(messages, agp=True, tools=None, **extra):
    return {"messages": messages, "add_generation_prompt": agp, "tools": tools, **extra}


CONVERSATIONS = {
    "user": conv([{"role": "user", "content": "Hello! How are you?"}]),
    "system_user": conv([SYSTEM, {"role": "user", "content": "What is the capital of France?"}]),
    "multi_turn": conv([SYSTEM, {"role": "user", "content": "What is the capital of France?"},
                        {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]),
    "no_system_multi_turn": conv([{"role": "user", "content": "Name a colour."},
                                  {"role": "assistant", "content": "Blue."},
                                  {"role": "user", "content": "Another one?"}]),
    "no_generation_prompt": conv([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}],
                                 agp=False),
    "content_parts": conv([{"role": "user", "content": [{"type": "text", "text": "Describe "},
                                                        {"type": "text", "text": "this sentence."}]}]),
    "tool_call": conv([{"role": "user", "content": "What is the weather in Paris?"},
                       {"role": "assistant", "content": "", "tool_calls": [
                           {"id": "call12345", "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                       {"role": "tool", "tool_call_id": "call12345", "name": "get_weather",
                        "content": "{\"temperature\": 21, \"unit\": \"celsius\"}"}],
                      tools=[WEATHER_TOOL]),
    "reasoning": conv([{"role": "user", "content": "What is 2+2?"},
                       {"role": "assistant", "content": "<think>\nTwo and two make four.\n</think>\n\n4"},
                       {"role": "user", "content": "And 3+3?"}]),
    "unicode_whitespace": conv([{"role": "user", "content": "  Grüße, 世界! \n\t"}]),
}

BOS, EOS = "<s>", "</s>"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--templates", default=DEFAULT_DIR)
    ap.add_argument("--out", default="bench/results/chat-templates.json")
    ap.add_argument("--cascade", default=os.path.join(os.environ.get("BUILD", "build"), "cascade"))
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    files = sorted(glob.glob(os.path.join(args.templates, "*.jinja")))
    if not files:
        sys.exit(f"no templates in {args.templates}: run `make reference` (it unpacks the sdist) or pass --templates")
    out = {"source": f"llama-cpp-python {VER} sdist, vendor/llama.cpp/models/templates",
           "reference": f"jinja2 {jinja2.__version__} (tools/jinja_reference.py: transformers' chat environment)",
           "now": NOW, "bos_token": BOS, "eos_token": EOS, "conversations": list(CONVERSATIONS), "templates": {}}
    n_match = 0
    for path in files:
        name = os.path.basename(path)
        with open(path, encoding="utf-8") as f:
            src = f.read()
        res, errs = {}, {}
        for cname, ctx in CONVERSATIONS.items():
            ctx = dict(ctx, bos_token=BOS, eos_token=EOS)
            jok, jout = render_jinja2(src, ctx)
            cok, cout = render_cascade(args.cascade, src, ctx)
            if jok and cok:
                res[cname] = "same" if jout == cout else "differ"
                if jout != cout and args.verbose:
                    print(f"--- {name} {cname}\njinja2:  {jout!r}\ncascade: {cout!r}")
            elif not jok and not cok:
                res[cname] = "both refuse"
            elif not cok:
                res[cname] = "cascade error"
                errs[cname] = cout
            else:
                res[cname] = "jinja2 error"
                errs[cname] = jout
        ok = all(v in ("same", "both refuse") for v in res.values())
        n_match += ok
        entry = {"match": ok, "same": sum(v == "same" for v in res.values()), "results": res}
        if errs:
            entry["errors"] = errs
        out["templates"][name] = entry
        print(f"{'ok  ' if ok else 'FAIL'} {name}: " + ", ".join(f"{k}={v}" for k, v in res.items() if v != "same"))
    out["summary"] = {"templates": len(files), "match": n_match}
    print(f"{n_match} of {len(files)} templates agree on every conversation")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
