#!/usr/bin/env python3
"""Checks cascade's Jinja interpreter (src/model/jinja.c) against Python's
jinja2, an independent implementation, set up as transformers sets it up
for chat templates (tools/jinja_reference.py). Our own templates in
tests/fixtures/jinja/ exercise every construct the interpreter supports
(whitespace control, expressions, loops, filters, tests, string methods,
macros, undefined values, a chat template with tools); each is rendered by
both over one or more contexts through `cascade template` and must agree
byte for byte. Bad templates must be refused by both, cascade with a
message naming the line and column, never a crash. Prints "N passed, N
failed" like the C tests.
"""
import glob
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))

BUILD = os.environ.get("BUILD", "build")
CASCADE = os.path.join(BUILD, "cascade")
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "jinja")

from checklib import check, summary


TOOL = {"type": "function", "function": {"name": "lookup", "description": "Looks a word up.",
                                         "parameters": {"type": "object",
                                                        "properties": {"word": {"type": "string"}},
                                                        "required": ["word"]}}}

# the chat template's conversations; the plain fixtures get the first
CHATS = {
    "user": {"messages": [{"role": "user", "content": "  What does 'ubiquitous' mean?  "}],
             "add_generation_prompt": True, "tools": None},
    "system_parts": {"messages": [{"role": "system", "content": [{"type": "text", "text": "Be "},
                                                                 {"type": "text", "text": "brief."}]},
                                  {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                               {"type": "image"},
                                                               {"type": "text", "text": "there"}]},
                                  {"role": "assistant", "content": "Hello."},
                                  {"role": "user", "content": "Bye"}],
                     "add_generation_prompt": False, "tools": None},
    "tools": {"messages": [{"role": "system", "content": "Use tools. "},
                           {"role": "user", "content": "Define 'moot'."},
                           {"role": "assistant", "content": "", "tool_calls": [
                               {"id": "c1", "type": "function",
                                "function": {"name": "lookup", "arguments": {"word": "moot"}}},
                               {"type": "function", "function": {"name": "lookup", "arguments": "{\"word\": \"mute\"}"}}]},
                           {"role": "tool", "content": {"definition": "open to debate", "ok": True}},
                           {"role": "tool", "content": "plain result"}],
              "add_generation_prompt": True, "tools": [TOOL], "enable_thinking": False},
    "bad_role": {"messages": [{"role": "narrator", "content": "Once upon a time"}],
                 "add_generation_prompt": True, "tools": None},
}

INLINE = {
    "crlf_newlines": ("line one\r\n{% if true %}\r\n  yes\r\n{% endif %}\r\nlast\r\n", {}),
    "trailing_newline_dropped": ("text\n", {}),
    "two_trailing_newlines": ("text\n\n", {}),
    "empty": ("", {}),
    "only_tags": ("{% if false %}x{% endif %}", {}),
    "context_types": ("{{ n }} {{ f }} {{ b }} {{ z }} {{ l }} {{ d }} {{ s }} {{ d.k.x }} {{ u }}",
                      {"n": -12, "f": 2.5, "b": False, "z": None, "l": [1, "a", None], "d": {"k": {"x": "y"}},
                       "s": "quote ' and \" and \\ and \u00e9 and \u4e16", "u": "\U0001F600"}),
    "lstrip_at_start": ("   {% if true %}x{% endif %}", {}),
    "tag_in_text": ("{ { not a tag } } {% raw_looking %}" if False else "{ {not a tag} } }} %} #}", {}),
    "dict_literal_in_output": ("{{ {'a': {'b': 1}} }}", {}),
    "tojson_nested_indent": ("{{ x | tojson(indent=3) }}", {"x": {"a": [1, {"b": []}, {}], "c": "d"}}),
    "loop_over_context_list": ("{% for m in messages %}{{ loop.index }}:{{ m.role }} {% endfor %}",
                               {"messages": [{"role": "a"}, {"role": "b"}]}),
}

# templates both renderers must refuse; (source, context, substring of cascade's message)
ERRORS = {
    "unclosed_if": ("{% if x %}never closed", {}, "line 1 column 23"),
    "unclosed_for": ("{% for x in y %}\n{{ x }}", {}, "expected 'endfor'"),
    "dangling_operator": ("line\n{{ 1 + }}", {}, "line 2 column 8"),
    "stray_endfor": ("{% endfor %}", {}, "without a block"),
    "unterminated_string": ("{{ 'abc }}", {}, "not closed"),
    "unclosed_comment": ("{# comment", {}, "comment"),
    "unclosed_variable": ("{{ x ", {}, "not closed"),
    "missing_in": ("{% for x y %}{% endfor %}", {}, "expected 'in'"),
    "bad_paren": ("{{ (1, 2 }}", {}, "')'"),
    "bad_list": ("{{ [1, 2 }}", {}, "']'"),
    "unknown_tag": ("{% include 'x.jinja' %}", {}, "unsupported tag 'include'"),
    "break_outside_loop": ("{% break %}", {}, "outside a loop"),
    "raise_exception": ("a{{ raise_exception('Roles must alternate') }}", {}, "Roles must alternate"),
    "undefined_attribute": ("{{ missing.attr }}", {}, "'missing' is undefined"),
    "str_plus_int": ("{{ 'a' + 1 }}", {}, "unsupported operand"),
    "division_by_zero": ("{{ 1 / 0 }}", {}, "division by zero"),
    "none_length": ("{{ none | length }}", {}, "has no len"),
    "sandbox_append": ("{% set l = [] %}{{ l.append(1) }}", {}, "modify"),
    "call_undefined": ("{{ nothing() }}", {}, "undefined"),
    "set_attr_on_dict": ("{% set d = {} %}{% set d.x = 1 %}", {}, "non-namespace"),
    "unknown_filter_reached": ("{{ 1 | no_such_filter }}", {}, "unsupported filter"),
    "generator_length": ("{{ [1, 2] | map('string') | length }}", {}, "generator"),
    "generator_tojson": ("{{ [1, 2] | select | tojson }}", {}, "not JSON serializable"),
    "iterate_int": ("{% for x in 5 %}{% endfor %}", {}, "not iterable"),
    "unpack_mismatch": ("{% for a, b in [[1, 2, 3]] %}{% endfor %}", {}, "unpack"),
    "compare_none": ("{{ none < 1 }}", {}, "not supported"),
}


def main():
    try:
        import jinja2  # noqa: F401
        from jinja_reference import render_cascade, render_jinja2
    except ImportError:
        print("FAIL check_jinja needs the jinja2 package (tools/setup.sh installs it)")
        print("0 passed, 1 failed")
        return 1
    if not os.path.exists(CASCADE):
        print(f"FAIL {CASCADE} is missing: run make")
        print("0 passed, 1 failed")
        return 1

    def compare(name, src, ctx, refuse=False):
        jok, jout = render_jinja2(src, ctx)
        cok, cout = render_cascade(CASCADE, src, ctx)
        if refuse or not jok:
            # only the cases meant to be refused may be: a fixture that fails in jinja2 checks nothing
            check(refuse and not jok and not cok, f"{name}: both refuse",
                  f"jinja2: {jout if not jok else 'rendered'}; cascade: {cout if not cok else 'rendered'}")
            return
        check(cok and cout == jout, f"{name}: same bytes as jinja2",
              f"\n  jinja2:  {jout!r}\n  cascade: {cout if not cok else cout!r}")

    for path in sorted(glob.glob(os.path.join(FIXTURES, "*.jinja"))):
        with open(path, encoding="utf-8", newline="") as f:
            src = f.read()
        base = os.path.basename(path)
        ctxs = CHATS if base == "chat.jinja" else {"default": CHATS["user"]}
        for cname, ctx in ctxs.items():
            ctx = dict(ctx, bos_token="<s>", eos_token="</s>")
            compare(f"{base} {cname}", src, ctx, refuse=cname == "bad_role")
    for name, (src, ctx) in INLINE.items():
        compare(name, src, ctx)

    for name, (src, ctx, want) in ERRORS.items():
        jok, jout = render_jinja2(src, ctx)
        cok, cout = render_cascade(CASCADE, src, ctx)
        msg = cout if isinstance(cout, str) else ""
        check(not jok, f"error {name}: jinja2 refuses", "jinja2 rendered it")
        check(not cok and msg.startswith("template: ") and want in msg and "line " in msg,
              f"error {name}: cascade refuses with a clear message", msg or repr(cout))
    return summary()


if __name__ == "__main__":
    sys.exit(main())
