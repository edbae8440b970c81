"""The independent renderer cascade's Jinja interpreter is checked against:
Python's jinja2, set up the way Hugging Face's apply_chat_template sets it
up (the environment chat templates are written for): an immutable sandbox,
trim_blocks and lstrip_blocks, the loop-control extension, a `generation`
block that renders its body, tojson as json.dumps without ASCII escaping,
and the globals raise_exception and strftime_now (here at a fixed time, in
UTC, so that both renderers print the same date).

Also runs cascade's side: `cascade template -t FILE -c - --now SECONDS`.
Used by tools/check_templates.py and tests/check_jinja.py.
"""
import datetime
import json
import os
import subprocess
import tempfile

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

NOW = 1736942400  # 2025-01-15 12:00:00 UTC


class GenerationBlock(Extension):
    """{% generation %}...{% endgeneration %}: marks assistant text for
    training masks; rendering leaves the body unchanged."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def environment(now=NOW):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, GenerationBlock])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt):
        return datetime.datetime.fromtimestamp(now, datetime.timezone.utc).strftime(fmt)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def render_jinja2(source, context, now=NOW):
    """(True, bytes) or (False, error message)"""
    try:
        return True, environment(now).from_string(source).render(**context).encode("utf-8")
    except Exception as e:  # the template's own errors and jinja2's alike
        return False, f"{type(e).__name__}: {e}"


def render_cascade(cascade, source, context, now=NOW, extra=()):
    """(True, bytes) or (False, cascade's error message)"""
    with tempfile.NamedTemporaryFile("w", suffix=".jinja", delete=False, encoding="utf-8") as f:
        f.write(source)
        path = f.name
    try:
        p = subprocess.run([cascade, "template", "-t", path, "-c", "-", "--now", str(now), *extra],
                           input=json.dumps(context).encode("utf-8"), capture_output=True, timeout=60)
    finally:
        os.unlink(path)
    if p.returncode == 0:
        return True, p.stdout
    return False, p.stderr.decode("utf-8", "replace").strip() or f"exit {p.returncode}"
