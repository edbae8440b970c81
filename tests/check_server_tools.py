#!/usr/bin/env python3
"""Tool calling in `cascade serve`, end to end on real model files.

The prompt: for a request with tools, an assistant turn with tool_calls (its
arguments a JSON string, as OpenAI sends them) and tool results, the server
must render exactly what Python's jinja2 renders from the same template and
the context vLLM and transformers build (messages with the arguments decoded
into objects, tools as sent, add_generation_prompt, the file's BOS and EOS
texts; tools/jinja_reference.py sets jinja2 up as transformers does). The
comparison is by token ids: the server's /tokenize of the messages against
its /tokenize of jinja2's text as a plain prompt, and usage.prompt_tokens of a
chat completion against the same text's count, so any difference in the
rendered text shows. To show the comparison has teeth, the text rendered
with the arguments left as a string (the mistake a server makes when it
passes OpenAI's messages through unchanged) must tokenize differently.

On tests/fixtures/arch/tiny-qwen2.gguf (Qwen2.5's template with its tools
branch; its assistant and tool turns are cut down) and on the same file
served with the whole Qwen2.5 template (--chat-template
tests/fixtures/templates/qwen2.5.jinja: tool calls as <tool_call> blocks, tool
results as <tool_response>). Also: tool_choice "none" renders as if no tools
were sent; a plain chat renders as before, and the same chat through the
JSON context (an unused chat_template_kwargs key) renders identically;
chat_template_kwargs reaches the template (tiny-qwen3.gguf's enable_thinking);
the refusals, each a 400 naming its field (tools for a template that never
uses them, tiny-qwen3 and the default model; malformed tools, tool_choice
"required" and a named function, bad tool_calls and tool messages), and
/tokenize refusing the same.

The output side: these models have random weights and cannot be steered into
writing a tool call, so the tool_calls of a response are checked in C
(tests/test_server_tools.c: the reader; tests/test_server.c: whole and
streamed responses through the HTTP layer). Here: with tools offered, a
text without calls comes back as the same content, whole and streamed alike,
with no tool_calls and the engine's finish_reason.

Prints "N passed, N failed" like the C tests; skips (0 passed, 0 failed)
when the binary, the fixtures, jinja2 or the gguf package are missing.
"""
import copy
import json
import os
import sys
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
import check_server as cs  # noqa: E402
from checklib import check, summary  # noqa: E402

QWEN2 = os.path.join(HERE, "fixtures", "arch", "tiny-qwen2.gguf")
QWEN3 = os.path.join(HERE, "fixtures", "arch", "tiny-qwen3.gguf")
QWEN25_TEMPLATE = os.path.join(HERE, "fixtures", "templates", "qwen2.5.jinja")
ENGINE = ["--threads", "1", "--kv-cache-mb", "32"]
TIMEOUT = 300

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Météo — the weather in a city, \"now\".",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7.5}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}
SMALL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

HISTORY = [
    {"role": "system", "content": "You answer with tools."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2, \"note\": \"été\"}"}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{\"tz\": \"CET\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21.5, \"sky\": \"clear\"}"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    {"role": "user", "content": "Thanks. And tomorrow?"},
]

SRV = None


def post(path, body):
    """(status, parsed body); a stream's body is the list of its events."""
    req = urllib.request.Request(SRV.url + path, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {cs.KEY}")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            text = r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())
    if body.get("stream"):
        return 200, [json.loads(line[6:]) for line in text.split("\n")
                     if line.startswith("data: ") and line != "data: [DONE]"]
    return 200, json.loads(text)


def tokens(body):
    st, j = post("/tokenize", body)
    assert st == 200, (st, j)
    return j["tokens"]


def text_tokens(text, special=False):
    return tokens({"prompt": text, "add_special_tokens": special})


def gguf_facts(path):
    """(chat template source, BOS text, EOS text) of a GGUF file."""
    from gguf import GGUFReader
    r = GGUFReader(path)

    def s(key):
        f = r.fields[key]
        return bytes(f.parts[f.data[0]]).decode("utf-8")

    toks = r.fields["tokenizer.ggml.tokens"]

    def tok(key):
        if key not in r.fields:
            return ""
        i = int(r.fields[key].parts[r.fields[key].data[0]][0])
        return bytes(toks.parts[toks.data[i]]).decode("utf-8")

    return s("tokenizer.chat_template"), tok("tokenizer.ggml.bos_token_id"), tok("tokenizer.ggml.eos_token_id")


def template_message(m, decode_arguments=True):
    """An OpenAI message as vLLM gives it to a template."""
    out = {"role": "system" if m["role"] == "developer" else m["role"]}
    c = m.get("content")
    out["content"] = "" if c is None else c if isinstance(c, str) else "".join(p["text"] for p in c)
    if "name" in m:
        out["name"] = m["name"]
    if m.get("tool_calls"):
        out["tool_calls"] = []
        for tc in m["tool_calls"]:
            tc = copy.deepcopy(tc)
            if decode_arguments:
                tc["function"]["arguments"] = json.loads(tc["function"]["arguments"])
            out["tool_calls"].append(tc)
    if m["role"] == "tool":
        out["tool_call_id"] = m["tool_call_id"]
    return out


def reference(source, bos, eos, messages, tools=None, decode_arguments=True, **kwargs):
    from jinja_reference import render_jinja2
    ctx = {"messages": [template_message(m, decode_arguments) for m in messages], "add_generation_prompt": True,
           "tools": tools, "bos_token": bos, "eos_token": eos, **kwargs}
    ok, out = render_jinja2(source, ctx)
    assert ok, out
    return out.decode("utf-8")


def refused(path, body, param, words=None):
    st, j = post(path, body)
    err = j.get("error", {}) if isinstance(j, dict) else {}
    ok = st == 400 and err.get("param") == param and (words is None or words in err.get("message", ""))
    return ok, f"{st} {j}"


def same_prompt(source, bos, eos, what, messages, tools, max_tokens=None, teeth=True):
    """The server's rendering of (messages, tools) against jinja2's, by tokens;
    teeth: the template prints tool calls, so their arguments' form must show."""
    ref = reference(source, bos, eos, messages, tools)
    srv = tokens({"messages": messages, "tools": tools} if tools else {"messages": messages})
    want = text_tokens(ref)
    check(srv == want and len(srv) > 20, f"{what}: the prompt is jinja2's ({len(srv)} tokens)",
          f"server {len(srv)} tokens, jinja2 {len(want)}")
    if teeth and any(m.get("tool_calls") for m in messages):
        wrong = text_tokens(reference(source, bos, eos, messages, tools, decode_arguments=False))
        check(wrong != srv, f"{what}: arguments left a string render differently (the comparison can fail)")
    if max_tokens:
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
        if tools:
            body["tools"] = tools
        st, j = post("/v1/chat/completions", body)
        n = len(text_tokens(ref, special=True))
        check(st == 200 and j["usage"]["prompt_tokens"] == n,
              f"{what}: a chat completion's prompt_tokens is jinja2's text's count ({n})",
              f"{st} {j.get('usage') if st == 200 else j}")
    return ref


def qwen2_own_template():
    source, bos, eos = gguf_facts(QWEN2)
    # this file's template prints no tool calls (the Qwen2.5 template below does)
    ref = same_prompt(source, bos, eos, "qwen2 tools and history", HISTORY, [WEATHER, TIME], teeth=False)
    check("get_time" in ref and "# Tools" in ref, "qwen2: the reference shows the tools")
    same_prompt(source, bos, eos, "qwen2 one small tool", HISTORY[1:2], [SMALL], max_tokens=4)
    same_prompt(source, bos, eos, "qwen2 plain chat", HISTORY[:2], None, max_tokens=4)

    # the same plain chat through the JSON context: identical
    plain = tokens({"messages": HISTORY[:2]})
    via_json = tokens({"messages": HISTORY[:2], "chat_template_kwargs": {"unused_variable": [1, 2]}})
    check(plain == via_json, "qwen2: a plain chat renders the same through the template's JSON context")
    # tool_choice none: the tools are not shown
    none = tokens({"messages": HISTORY[:2], "tools": [WEATHER], "tool_choice": "none"})
    check(none == plain, "qwen2: tool_choice \"none\" renders as if no tools were sent")
    auto = tokens({"messages": HISTORY[:2], "tools": [WEATHER], "tool_choice": "auto"})
    check(auto != plain and len(auto) > len(plain), "qwen2: tool_choice \"auto\" shows the tools")

    # the output side with the real engine: no call in the text, nothing taken from it
    body = {"messages": HISTORY[1:2], "tools": [SMALL], "max_tokens": 12, "temperature": 0}
    st, whole = post("/v1/chat/completions", body)
    st2, events = post("/v1/chat/completions", {**body, "stream": True})
    msg = whole["choices"][0]["message"] if st == 200 else {}
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")) \
        if st2 == 200 else None
    finishes = [e["choices"][0]["finish_reason"] for e in events if e.get("choices") and
                e["choices"][0]["finish_reason"]] if st2 == 200 else []
    check(st == 200 and "<tool_call>" not in msg.get("content", "") and "tool_calls" not in msg and
          whole["choices"][0]["finish_reason"] == "length" and streamed == msg["content"] and finishes == ["length"]
          and not any("tool_calls" in e["choices"][0]["delta"] for e in events if e.get("choices")),
          "qwen2: with tools offered, a text without calls is the content, whole and streamed alike",
          f"{whole} / {streamed!r} {finishes}")
    st3, nt = post("/v1/chat/completions", {**body, "tool_choice": "none"})
    check(st3 == 200 and "tool_calls" not in nt["choices"][0]["message"], "qwen2: tool_choice none answers plainly")

    # refusals
    def bad(body, param, what, words=None):
        ok, detail = refused("/v1/chat/completions", {"messages": HISTORY[1:2], "max_tokens": 2, **body}, param, words)
        check(ok, f"qwen2: {what} -> 400 naming {param}", detail)

    bad({"tools": {"type": "function"}}, "tools", "tools not a list")
    bad({"tools": [{"type": "function"}]}, "tools[0]", "a tool without its function")
    bad({"tools": [SMALL, {"type": "retrieval", "function": {"name": "x"}}]}, "tools[1]", "a tool of another type")
    bad({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0]", "an empty tool name")
    bad({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0]",
        "parameters not an object")
    bad({"tools": [SMALL], "tool_choice": "required"}, "tool_choice", "tool_choice required", "not supported")
    bad({"tools": [SMALL], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
        "a named tool_choice", "not supported")
    bad({"tools": [SMALL], "tool_choice": "maybe"}, "tool_choice", "an unknown tool_choice")
    bad({"parallel_tool_calls": 1}, "parallel_tool_calls", "parallel_tool_calls not a boolean")
    bad({"chat_template_kwargs": "x"}, "chat_template_kwargs", "chat_template_kwargs not an object")
    bad({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "chat_template_kwargs setting tools")
    ok, detail = refused("/v1/chat/completions", {"messages": HISTORY[1:2] + [{"role": "tool", "content": "1"}]},
                         "messages[1].tool_call_id")
    check(ok, "qwen2: a tool message without tool_call_id -> 400", detail)
    broken = copy.deepcopy(HISTORY[1:4])
    broken[1]["tool_calls"][0]["function"]["arguments"] = "{\"city\": "
    ok, detail = refused("/v1/chat/completions", {"messages": broken}, "messages[1].tool_calls[0]")
    check(ok, "qwen2: tool_calls arguments that are not JSON -> 400", detail)
    ok, detail = refused("/tokenize", {"messages": HISTORY[1:2], "tools": [{"type": "function"}]}, "tools[0]")
    check(ok, "qwen2: /tokenize validates tools as chat completions do", detail)


def qwen25_full_template():
    _, bos, eos = gguf_facts(QWEN2)
    with open(QWEN25_TEMPLATE, encoding="utf-8") as f:
        source = f.read()
    ref = same_prompt(source, bos, eos, "qwen2.5 template tools, calls and results", HISTORY, [WEATHER, TIME])
    check("<tool_response>\n14:05\n</tool_response>" in ref and
          "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2, \"note\": \"été\"}}" in ref,
          "qwen2.5 template: the reference shows the calls as objects and the results")
    same_prompt(source, bos, eos, "qwen2.5 template one call and result", HISTORY[1:4], [SMALL], max_tokens=4)
    # an assistant message whose arguments come as an object, and content given as text parts
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "c9", "type": "function", "function": {"name": "f", "arguments": {"k": [1, 2]}}}]},
            {"role": "tool", "tool_call_id": "c9", "content": "done"}]
    srv = tokens({"messages": msgs, "tools": [SMALL]})
    msgs_str = copy.deepcopy(msgs)
    msgs_str[1]["tool_calls"][0]["function"]["arguments"] = json.dumps({"k": [1, 2]})
    check(srv == text_tokens(reference(source, bos, eos, msgs_str, [SMALL])),
          "qwen2.5 template: arguments given as an object render as the string form does")


def qwen3_kwargs():
    source, bos, eos = gguf_facts(QWEN3)
    msgs = [{"role": "user", "content": "Think about it."}]
    plain = tokens({"messages": msgs})
    off = tokens({"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}})
    on = tokens({"messages": msgs, "chat_template_kwargs": {"enable_thinking": True}})
    ref_off = reference(source, bos, eos, msgs, None, enable_thinking=False)
    check("<think>" in ref_off and off == text_tokens(ref_off) and off != plain,
          "qwen3: chat_template_kwargs enable_thinking false reaches the template (jinja2's prompt)")
    check(on == plain, "qwen3: enable_thinking true renders as the default")
    st, j = post("/v1/chat/completions", {"messages": msgs, "max_tokens": 2,
                                          "chat_template_kwargs": {"enable_thinking": False}})
    check(st == 200 and j["usage"]["prompt_tokens"] == len(text_tokens(ref_off, special=True)),
          "qwen3: the chat completion's prompt is the kwargs' rendering", f"{st} {j}")
    ok, detail = refused("/v1/chat/completions", {"messages": msgs, "tools": [SMALL]}, "tools", "never uses 'tools'")
    check(ok, "qwen3: tools for a template without them -> 400 naming tools", detail)
    ok, detail = refused("/tokenize", {"messages": msgs, "tools": [SMALL]}, "tools", "never uses 'tools'")
    check(ok, "qwen3: /tokenize refuses them alike", detail)
    st, j = post("/v1/chat/completions", {"messages": msgs, "tools": [SMALL], "tool_choice": "none", "max_tokens": 2})
    check(st == 200, "qwen3: tools with tool_choice none are accepted (never shown)", f"{st} {j}")
    # tool results on a template without a tool branch: the template decides (this one prints the role)
    hist = [msgs[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "a", "content": "42"}]
    check(tokens({"messages": hist}) == text_tokens(reference(source, bos, eos, hist)),
          "qwen3: tool results render as jinja2 renders them")


def default_model():
    msgs = [{"role": "user", "content": "Hi"}]
    ok, detail = refused("/v1/chat/completions", {"messages": msgs, "tools": [SMALL]}, "tools", "never uses 'tools'")
    check(ok, "default model: tools -> 400 naming tools", detail)
    st, j = post("/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "temperature": 0})
    check(st == 200, "default model: a plain chat still answers", f"{st} {j}")


def main():
    global SRV
    if not os.path.exists(cs.CASCADE):
        return skip(f"{cs.CASCADE} not built")
    for path in (QWEN2, QWEN3, QWEN25_TEMPLATE):
        if not os.path.exists(path):
            return skip(f"{path} missing")
    try:
        import gguf  # noqa: F401
        import jinja2  # noqa: F401
    except ImportError as e:
        return skip(f"{e} (tools/setup.sh installs gguf and jinja2)")
    for what, model, extra, fn in (("qwen2", QWEN2, [], qwen2_own_template),
                                   ("qwen2.5 template", QWEN2, ["--chat-template", QWEN25_TEMPLATE], qwen25_full_template),
                                   ("qwen3", QWEN3, [], qwen3_kwargs),
                                   ("default model", cs.MODEL, ["--max-context", "256"], default_model)):
        if not os.path.exists(model):
            print(f"skip {what}: {model} missing")
            continue
        try:
            SRV = cs.Server(ENGINE + extra, model=model)
        except RuntimeError as e:
            check(False, f"{what}: the server starts", str(e))
            continue
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a failed check, not a crash of the script
            check(False, f"{what}: ran to the end", f"{type(e).__name__}: {e}")
        finally:
            rc = SRV.stop()
            check(rc == 0, f"{what}: the server shut down cleanly", SRV.exit_detail(rc))
    return summary()


def skip(reason):
    print(f"skip check_server_tools: {reason}")
    print("0 passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
