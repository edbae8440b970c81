#!/usr/bin/env python3
"""The sampling fields of `cascade serve`, end to end: each one is either
honoured or refused with a 400 whose error.param names it.

Starts `build/cascade serve` on the default model (a free port on 127.0.0.1)
and talks to it with urllib only. Honoured fields are checked by their
effect, greedy, against the same request without them: stop_token_ids,
min_tokens, include_stop_str_in_output, presence/frequency/repetition
penalties, logit_bias, completions' echo (text and token-id prompts,
streaming), chat content given as a list of text parts, and logprobs'
"bytes" (a token holding part of a UTF-8 character included). Refused
fields (guided decoding, prompt_logprobs, beam search, ...), out-of-range
values (top_p 1e-300 among them) and bad content lists must come back as
400 with the field in error.param. Prints "N passed, N failed"
like the C tests; when `serve` or the model is missing it prints a skip line
and "0 passed, 0 failed".

Uses check_server.py's server start-up and checks (and so its environment:
BUILD, CASCADE_BIN, CASCADE_MODEL, and its API key).
"""
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_server as cs  # noqa: E402
from check_server import CASCADE, KEY, MODEL, Server, check, report, skip  # noqa: E402

TIMEOUT = 300

SRV = None


def post(path, body):
    """(status, parsed JSON body) of a POST; the body of an SSE answer is the list of its events."""
    req = urllib.request.Request(SRV.url + path, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {KEY}")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            text = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())
    if body.get("stream"):
        events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
        return status, [json.loads(e) for e in events if e != "[DONE]"]
    return status, json.loads(text)


def complete(**kw):
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    body.update(kw)
    st, j = post("/v1/completions", body)
    assert st == 200, (st, j)
    return j["choices"][0], j["usage"]


def chat(messages, **kw):
    body = {"messages": messages, "max_tokens": 12, "temperature": 0}
    body.update(kw)
    st, j = post("/v1/chat/completions", body)
    assert st == 200, (st, j)
    return j["choices"][0]


def refused(route, body, param):
    st, j = post(route, body)
    assert st == 400, (body, st, j)
    assert j["error"]["param"] == param, (body, j)


def token_ids(text):
    out = subprocess.run([CASCADE, "tokenize", "-m", MODEL, "--no-add-special", text], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


PROMPT = "<|im_start|>user\nWrite a short story about a cat.<|im_end|>\n<|im_start|>assistant\n"
CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"


def run_all():
    banana = token_ids(" banana")[0]
    eos = token_ids("<|im_end|>")[0]
    banana_text = " banana"

    @check("logit_bias")
    def _():
        base, _ = complete(max_tokens=6)
        c, u = complete(max_tokens=6, logit_bias={str(banana): 100})
        assert c["text"] == banana_text * 6, c
        c, _ = complete(max_tokens=6, temperature=1.0, seed=3, logit_bias={str(banana): 100})
        assert c["text"] == banana_text * 6, c
        first = token_ids(base["text"])[0]
        c, _ = complete(max_tokens=6, logit_bias={str(first): -100})
        assert c["text"] != base["text"], (c, base)

    @check("stop_token_ids")
    def _():
        # the forced token is sampled first and ends the output; its text is not in it
        c, u = complete(logit_bias={str(banana): 100}, stop_token_ids=[banana])
        assert c["text"] == "" and c["finish_reason"] == "stop" and u["completion_tokens"] == 1, (c, u)
        # a word token of the greedy text (its first occurrence) stops it right there
        base, _ = complete(max_tokens=12, ignore_eos=True, logprobs=1)
        toks = base["logprobs"]["tokens"]
        k = next(i for i in range(3, len(toks))
                 if re.fullmatch(r" [a-z]+", toks[i]) and toks[i] not in toks[:i] and len(token_ids(toks[i])) == 1)
        c, u = complete(max_tokens=12, ignore_eos=True, stop_token_ids=[token_ids(toks[k])[0]])
        assert c["finish_reason"] == "stop" and u["completion_tokens"] == k + 1, (c, u, toks, k)
        assert c["text"] == "".join(toks[:k]), (c, toks, k)

    @check("include_stop_str_in_output")
    def _():
        c, _ = complete(logit_bias={str(banana): 100}, stop_token_ids=[banana], include_stop_str_in_output=True)
        assert c["text"] == banana_text and c["finish_reason"] == "stop", c
        base, _ = complete(max_tokens=16, ignore_eos=True)
        text = base["text"]
        word = text[len(text) // 2:].split(" ")[1]
        stop = " " + word
        at = text.index(stop)
        c, _ = complete(max_tokens=16, ignore_eos=True, stop=[stop])
        assert c["text"] == text[:at] and c["finish_reason"] == "stop", (c, stop)
        c, _ = complete(max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
        assert c["text"] == text[:at + len(stop)] and c["finish_reason"] == "stop", (c, stop)

    @check("min_tokens")
    def _():
        c, u = complete(logit_bias={str(eos): 100})
        assert u["completion_tokens"] == 1 and c["finish_reason"] == "stop" and c["text"] == "", (c, u)
        c, u = complete(logit_bias={str(eos): 100}, min_tokens=5)
        assert u["completion_tokens"] == 6 and c["finish_reason"] == "stop" and c["text"], (c, u)
        c, u = complete(logit_bias={str(banana): 100}, stop_token_ids=[banana], min_tokens=3)
        assert u["completion_tokens"] == 4 and banana_text not in c["text"], (c, u)
        refused(COMPL, {"prompt": "a", "max_tokens": 4, "min_tokens": 5}, "min_tokens")

    @check("penalties")
    def _():
        rep = "one two one two one two one two one two one two one two"
        base, _ = complete(prompt=rep, max_tokens=24, ignore_eos=True)
        words = len(set(base["text"].split()))
        for field, v in (("repetition_penalty", 1.8), ("frequency_penalty", 1.5), ("presence_penalty", 2.0)):
            c, _ = complete(prompt=rep, max_tokens=24, ignore_eos=True, **{field: v})
            assert c["text"] != base["text"] and len(set(c["text"].split())) > words, (field, c["text"], base["text"])
            # the same on chat, greedy
            msgs = [{"role": "user", "content": "Repeat: " + rep}]
            a = chat(msgs, max_tokens=24)
            b = chat(msgs, max_tokens=24, **{field: v})
            assert a["message"]["content"] != b["message"]["content"], (field, a, b)
        for field, v in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0)):
            refused(COMPL, {"prompt": "a", field: v}, field)

    @check("echo")
    def _():
        p = "The capital of France is"
        plain, _ = complete(prompt=p, max_tokens=5)
        c, u = complete(prompt=p, max_tokens=5, echo=True)
        assert c["text"] == p + plain["text"] and u["completion_tokens"] == 5, (c, plain)
        c, _ = complete(prompt=token_ids(p), max_tokens=5, echo=True)
        assert c["text"] == p + plain["text"], c
        st, events = post(COMPL, {"prompt": p, "max_tokens": 5, "temperature": 0, "echo": True, "stream": True})
        texts = [e["choices"][0]["text"] for e in events if e.get("choices")]
        assert st == 200 and texts[0] == p and "".join(texts) == p + plain["text"], texts
        refused(COMPL, {"prompt": p, "echo": True, "logprobs": 1}, "echo")
        refused(CHAT, {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo")

    @check("chat_content_parts")
    def _():
        a = chat([{"role": "user", "content": "Say hello to Ann."}])
        b = chat([{"role": "user", "content": [{"type": "text", "text": "Say hello"},
                                                {"type": "text", "text": " to Ann."}]}])
        assert a["message"]["content"] == b["message"]["content"], (a, b)
        refused(CHAT, {"messages": [{"role": "user", "content": []}]}, "messages[0].content")
        refused(CHAT, {"messages": [{"role": "system", "content": "s"},
                                    {"role": "user", "content": [{"type": "image_url",
                                                                   "image_url": {"url": "http://x/y.png"}}]}]},
                "messages[1].content")
        refused(CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content")

    @check("logprobs_bytes")
    def _():
        c = chat([{"role": "user", "content": "Hi"}], max_tokens=4, logprobs=True, top_logprobs=2)
        for t in c["logprobs"]["content"]:
            assert bytes(t["bytes"]) == t["token"].encode(), t
            for alt in t["top_logprobs"]:
                assert bytes(alt["bytes"]) == alt["token"].encode(), alt

    # a token that is the first bytes of a 4-byte character: its "bytes" must be those bytes
    try:
        llama = "\U0001F999"
        part = token_ids(llama)[0]
        c = chat([{"role": "user", "content": "Hi"}], max_tokens=1, logprobs=True, logit_bias={str(part): 100})
        b = bytes(c["logprobs"]["content"][0]["bytes"])
        # the token's string shows U+FFFD for the partial character; its bytes are the raw ones
        report("logprobs_bytes_partial_utf8", 0 < len(b) < 4 and llama.encode().startswith(b),
               f"token {part} gives bytes {list(b)}, want a prefix of {list(llama.encode())}")
    except Exception as e:  # noqa: BLE001 - any failure is a failed check
        report("logprobs_bytes_partial_utf8", False, f"{type(e).__name__}: {e}")

    @check("top_p_tiny")
    def _():
        refused(COMPL, {"prompt": "a", "top_p": 1e-300}, "top_p")
        refused(CHAT, {"messages": [{"role": "user", "content": "x"}], "top_p": 1e-300}, "top_p")
        refused(COMPL, {"prompt": "a", "top_p": 0}, "top_p")
        refused(COMPL, {"prompt": "a", "temperature": 2.5}, "temperature")

    @check("bad_values_name_their_field")
    def _():
        for field, v in (("logit_bias", {"1": 101}), ("logit_bias", {"x": 1}), ("logit_bias", [1]),
                         ("stop_token_ids", ["a"]), ("stop_token_ids", [-1]), ("min_tokens", -1),
                         ("include_stop_str_in_output", "yes")):
            refused(COMPL, {"prompt": "a", field: v}, field)

    @check("unsupported_fields_refused")
    def _():
        msgs = [{"role": "user", "content": "x"}]
        fields = {
            "guided_json": {"type": "object"},
            "guided_regex": "a+",
            "guided_choice": ["a", "b"],
            "guided_grammar": "root ::= \"a\"",
            "structured_outputs": {"json": {"type": "object"}},
            "prompt_logprobs": 1,
            "allowed_token_ids": [1, 2],
            "bad_words": ["cat"],
            "logits_processors": ["x"],
            "use_beam_search": True,
            "truncate_prompt_tokens": 4,
            "skip_special_tokens": False,
            "return_tokens_as_token_ids": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
        }
        for route, base in ((COMPL, {"prompt": "a"}), (CHAT, {"messages": msgs})):
            for field, v in fields.items():
                refused(route, {**base, field: v}, field)
            refused(route, {**base, "best_of": 2}, "best_of")
        for field, v in (("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "required"),
                         ("chat_template", "{{ messages }}"), ("continue_final_message", True),
                         ("add_generation_prompt", False), ("audio", {"voice": "x"}), ("modalities", ["audio"])):
            refused(CHAT, {"messages": msgs, field: v}, field)
        refused(COMPL, {"prompt": "a", "suffix": "b"}, "suffix")

    @check("accepted_defaults_change_nothing")
    def _():
        a, _ = complete(max_tokens=8)
        b, _ = complete(max_tokens=8, presence_penalty=0, frequency_penalty=0, repetition_penalty=1.0, logit_bias={},
                        stop_token_ids=[], min_tokens=0, include_stop_str_in_output=False, echo=False,
                        use_beam_search=False, skip_special_tokens=True, bad_words=[], best_of=1)
        assert a["text"] == b["text"], (a, b)


def main():
    global SRV
    if not os.path.exists(CASCADE):
        skip(f"{CASCADE} not built")
    if subprocess.run([CASCADE, "serve", "--help"], capture_output=True).returncode != 0:
        skip("`cascade serve` not available")
    if not os.path.exists(MODEL):
        skip(f"{MODEL} missing (make model)")
    SRV = Server()
    try:
        run_all()
    finally:
        rc = SRV.stop()
        report("shutdown_clean", rc == 0, SRV.exit_detail(rc))
    print(f"{cs.passed} passed, {cs.failed} failed")
    return 1 if cs.failed else 0


if __name__ == "__main__":
    sys.exit(main())
