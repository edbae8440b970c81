/*
 * test_jinja.c: the Jinja interpreter's contract beyond rendering (which
 * tests/check_jinja.py compares with jinja2): every limit stops a runaway
 * template with its own error and no crash, errors name their line and
 * column and carry the documented status, bad arguments are refused, and
 * one compiled template renders on several threads at once.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/model/model.h"
#include "check.h"

/* Compiles and renders src with ctx; returns the status, *out the text (or NULL). */
static cas_status render(const char *src, const char *ctx, const cas_jinja_limits *lim, char **out) {
    cas_jinja *t = NULL;
    *out = NULL;
    cas_status st = cas_jinja_compile(src, strlen(src), &t);
    if (st) return st;
    st = cas_jinja_render(t, ctx, ctx ? strlen(ctx) : 0, lim, out, NULL);
    cas_jinja_destroy(t);
    return st;
}

static int renders_to(const char *src, const char *ctx, const char *want) {
    char *out;
    cas_status st = render(src, ctx, NULL, &out);
    int ok = st == CAS_OK && !strcmp(out, want);
    if (!ok) printf("  %s -> %s\n", src, st ? cas_last_error() : out);
    free(out);
    return ok;
}

static void test_basics(void) {
    CHECK(renders_to("Hi {{ name }}!", "{\"name\": \"Ann\"}", "Hi Ann!"));
    CHECK(renders_to("", NULL, ""));
    CHECK(renders_to("{% for m in messages %}{{ m.role }}{% endfor %}",
                     "{\"messages\": [{\"role\": \"a\"}, {\"role\": \"b\"}]}", "ab"));
    /* JSON escapes and surrogate pairs in the context */
    CHECK(renders_to("{{ s }}", "{\"s\": \"\\u00e9\\ud83d\\ude00\\n\"}", "\xc3\xa9\xf0\x9f\x98\x80\n"));
    /* a NUL byte in the source is text like any other */
    cas_jinja *t;
    REQUIRE(cas_jinja_compile("a\0b{{ 1 }}", 10, &t) == CAS_OK);
    char *out;
    size_t n;
    REQUIRE(cas_jinja_render(t, NULL, 0, NULL, &out, &n) == CAS_OK);
    CHECK(n == 4 && !memcmp(out, "a\0b1", 4));
    free(out);
    cas_jinja_destroy(t);
}

static void test_errors(void) {
    char *out;
    cas_jinja *t = NULL;
    /* syntax: the status, the line and column of the cause */
    CHECK(render("ok\n{% if x %}\n{{ 1 + }}", NULL, NULL, &out) == CAS_ERR_UNSUPPORTED);
    CHECKF(strstr(cas_last_error(), "line 3 column 8"), "%s", cas_last_error());
    CHECK(render("{% for x in y %}", NULL, NULL, &out) == CAS_ERR_UNSUPPORTED);
    CHECKF(strstr(cas_last_error(), "expected 'endfor'"), "%s", cas_last_error());
    CHECK(render("{{ (1 }}", NULL, NULL, &out) == CAS_ERR_UNSUPPORTED);
    CHECKF(strstr(cas_last_error(), "unexpected '}', expected ')'"), "%s", cas_last_error());
    /* runtime: raise_exception is the conversation's fault, other failures unsupported */
    CHECK(render("\n  {{ raise_exception('no system role') }}", NULL, NULL, &out) == CAS_ERR_INVALID);
    CHECKF(strstr(cas_last_error(), "line 2 column 6") && strstr(cas_last_error(), "no system role"), "%s",
           cas_last_error());
    CHECK(render("{{ x.y }}", NULL, NULL, &out) == CAS_ERR_UNSUPPORTED);
    CHECKF(strstr(cas_last_error(), "'x' is undefined"), "%s", cas_last_error());
    CHECK(render("{% if false %}{{ 1 | nope }}{% endif %}ok", NULL, NULL, &out) == CAS_OK && !strcmp(out, "ok"));
    free(out);
    CHECK(render("{{ 1 | nope }}", NULL, NULL, &out) == CAS_ERR_UNSUPPORTED);
    /* the context */
    CHECK(render("x", "[1, 2]", NULL, &out) == CAS_ERR_INVALID);
    CHECK(render("x", "{\"a\": }", NULL, &out) == CAS_ERR_INVALID);
    CHECKF(strstr(cas_last_error(), "context JSON"), "%s", cas_last_error());
    CHECK(render("x", "{\"a\": 1} trailing", NULL, &out) == CAS_ERR_INVALID);
    CHECK(render("x", "{\"a\": \"\\ud800\"}", NULL, &out) == CAS_OK);
    free(out);
    /* arguments */
    CHECK(cas_jinja_compile(NULL, 0, &t) == CAS_ERR_INVALID);
    CHECK(cas_jinja_compile("x", 1, NULL) == CAS_ERR_INVALID);
    REQUIRE(cas_jinja_compile("x", 1, &t) == CAS_OK);
    CHECK(cas_jinja_render(t, NULL, 0, NULL, NULL, NULL) == CAS_ERR_INVALID);
    CHECK(cas_jinja_render(NULL, NULL, 0, NULL, &out, NULL) == CAS_ERR_INVALID);
    cas_jinja_destroy(t);
    cas_jinja_destroy(NULL);
}

static char *repeat(const char *unit, int n, const char *tail) {
    size_t u = strlen(unit), tl = strlen(tail);
    char *s = malloc(u * (size_t)n + tl + 1);
    for (int i = 0; i < n; i++) memcpy(s + u * (size_t)i, unit, u);
    memcpy(s + u * (size_t)n, tail, tl + 1);
    return s;
}

static void test_limits(void) {
    char *out;
    cas_jinja_limits lim = {0, 0, 0, -1};
    /* steps: a huge range is refused before it is built, a long loop when it runs long */
    CHECK(render("{% for i in range(1000000000) %}x{% endfor %}", NULL, NULL, &out) == CAS_ERR_UNSUPPORTED);
    CHECKF(strstr(cas_last_error(), "steps"), "%s", cas_last_error());
    lim.max_steps = 1000;
    CHECK(render("{% for i in range(600) %}{% for j in range(2) %}{% endfor %}{% endfor %}", NULL, &lim, &out) ==
          CAS_ERR_UNSUPPORTED);
    lim.max_steps = 0;
    /* output */
    lim.max_output = 10000;
    CHECK(render("{% for i in range(100) %}{{ 'x' * 1000 }}{% endfor %}", NULL, &lim, &out) == CAS_ERR_NOMEM);
    CHECKF(strstr(cas_last_error(), "exceeds 10000 bytes"), "%s", cas_last_error());
    CHECK(render("{% macro m() %}{{ 'y' * 20000 }}{% endmacro %}{{ m() }}", NULL, &lim, &out) == CAS_ERR_NOMEM);
    lim.max_output = 0;
    /* memory */
    lim.max_memory = 1 << 20;
    CHECK(render("{{ ('x' * 100000000) | length }}", NULL, &lim, &out) == CAS_ERR_NOMEM);
    CHECK(render("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
                 NULL, &lim, &out) == CAS_ERR_NOMEM);
    CHECK(render("{{ [[1] * 1000000] }}", NULL, &lim, &out) == CAS_ERR_NOMEM);
    lim.max_memory = 0;
    /* nesting in the source: bounded depth, an error instead of a deep stack */
    char *deep = repeat("(", 10000, "1");
    char *src = malloc(strlen(deep) + 16);
    sprintf(src, "{{ %s }}", deep);
    CHECK(render(src, NULL, NULL, &out) == CAS_ERR_UNSUPPORTED);
    CHECKF(strstr(cas_last_error(), "nested"), "%s", cas_last_error());
    free(src);
    free(deep);
    deep = repeat("{% if true %}", 5000, "x");
    CHECK(render(deep, NULL, NULL, &out) == CAS_ERR_UNSUPPORTED);
    free(deep);
    deep = repeat("not ", 5000, "x");
    src = malloc(strlen(deep) + 16);
    sprintf(src, "{{ %s }}", deep);
    CHECK(render(src, NULL, NULL, &out) == CAS_ERR_UNSUPPORTED);
    free(src);
    free(deep);
    deep = repeat("-", 5000, "1");
    src = malloc(strlen(deep) + 16);
    sprintf(src, "{{ %s }}", deep);
    CHECK(render(src, NULL, NULL, &out) == CAS_ERR_UNSUPPORTED);
    free(src);
    free(deep);
    /* nesting in the context and in values built at run time */
    deep = repeat("[", 5000, "");
    src = malloc(strlen(deep) + 16);
    sprintf(src, "{\"a\": %s", deep);
    CHECK(render("{{ a }}", src, NULL, &out) == CAS_ERR_INVALID);
    free(src);
    free(deep);
    CHECK(render("{% set ns = namespace(x=[]) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}"
                 "{{ ns.x | tojson }}", NULL, NULL, &out) == CAS_ERR_UNSUPPORTED);
    CHECKF(strstr(cas_last_error(), "nested more than"), "%s", cas_last_error());
    CHECK(render("{% set ns = namespace(x=[]) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}"
                 "{{ ns.x }}{{ ns.x == ns.x }}", NULL, NULL, &out) == CAS_ERR_UNSUPPORTED);
    /* repeating nothing many times is quick */
    CHECK(render("{{ ('' * 4611686018427387904) | length }}{{ ([] * 4611686018427387904) | length }}", NULL, NULL,
                 &out) == CAS_OK && !strcmp(out, "00"));
    free(out);
    /* macro recursion */
    CHECK(render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", NULL, NULL, &out) == CAS_ERR_UNSUPPORTED);
    CHECKF(strstr(cas_last_error(), "deep"), "%s", cas_last_error());
    /* integer overflow is an error, not undefined behaviour */
    CHECK(render("{{ 9223372036854775807 + 1 }}", NULL, NULL, &out) == CAS_ERR_UNSUPPORTED);
    CHECK(render("{{ 2 ** 64 }}", NULL, NULL, &out) == CAS_ERR_UNSUPPORTED);
    CHECK(render("{{ -9223372036854775807 - 1 }}", NULL, NULL, &out) == CAS_OK);
    free(out);
    CHECK(render("{{ (-9223372036854775807 - 1) // -1 }}", NULL, NULL, &out) == CAS_ERR_UNSUPPORTED);
    CHECK(render("{{ range(-9223372036854775807, 9223372036854775807, 4611686018427387904) | length }}", NULL, NULL,
                 &out) == CAS_OK);
    free(out);
}

/* the fixed clock strftime_now reads */
static void test_time(void) {
    char *out;
    cas_jinja_limits lim = {0, 0, 0, 1736942400};
    REQUIRE(render("{{ strftime_now('%Y-%m-%d %H:%M %b') }}", NULL, &lim, &out) == CAS_OK);
    CHECKF(!strcmp(out, "2025-01-15 12:00 Jan"), "%s", out);
    free(out);
}

typedef struct {
    const cas_jinja *t;
    int ok;
} thread_arg;

static void *render_many(void *p) {
    thread_arg *a = p;
    const char *ctx = "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}";
    a->ok = 1;
    for (int i = 0; i < 200; i++) {
        char *out;
        if (cas_jinja_render(a->t, ctx, strlen(ctx), NULL, &out, NULL) != CAS_OK) {
            a->ok = 0;
            return NULL;
        }
        a->ok &= !strcmp(out, "[1:user=hi][2:assistant=yo]");
        free(out);
    }
    return NULL;
}

static void test_threads(void) {
    const char *src = "{% for m in messages %}[{{ loop.index }}:{{ m.role }}={{ m.content | trim }}]{% endfor %}";
    cas_jinja *t;
    REQUIRE(cas_jinja_compile(src, strlen(src), &t) == CAS_OK);
    pthread_t th[4];
    thread_arg a[4];
    for (int i = 0; i < 4; i++) {
        a[i].t = t;
        pthread_create(&th[i], NULL, render_many, &a[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        CHECK(a[i].ok);
    }
    cas_jinja_destroy(t);
}

/* cas_jinja_reads: a variable named anywhere in the tree (deep in an
 * expression, a filter's argument, a macro's default, a later statement),
 * never a string, an attribute or a filter that happens to share the name. */
static int reads(const char *src, const char *name) {
    cas_jinja *t = NULL;
    if (cas_jinja_compile(src, strlen(src), &t) != CAS_OK) return -1;
    int r = cas_jinja_reads(t, name);
    cas_jinja_destroy(t);
    return r;
}

static void test_reads(void) {
    CHECK(reads("{% if tools %}x{% endif %}", "tools") == 1);
    CHECK(reads("a{{ 1 }}b\n{% for m in messages %}{{ m.content }}{% endfor %}{{ (tools or [])|length }}", "tools") == 1);
    CHECK(reads("{{ x|default(tools) }}", "tools") == 1);
    CHECK(reads("{% macro f(a=tools) %}{% endmacro %}", "tools") == 1);
    CHECK(reads("{% for t in [1] %}{% if loop.first %}{% set ns = namespace(v=[t, {'k': tools}]) %}{% endif %}{% endfor %}",
                "tools") == 1);
    CHECK(reads("{% if enable_thinking is defined and enable_thinking is false %}x{% endif %}", "enable_thinking") == 1);
    CHECK(reads("{{ 'tools' }}{{ message.tools }}{{ m['tools'] }}", "tools") == 0);
    CHECK(reads("{% for message in messages %}{{ message.content }}{% endfor %}", "tools") == 0);
    CHECK(reads("{{ toolsx }}{{ xtools }}", "tools") == 0);
    CHECK(reads("", "tools") == 0);
    CHECK(cas_jinja_reads(NULL, "tools") == 0);
}

/* cas_chat_template_tools: how a template asks for tool calls. */
static int tools_of(const char *src) {
    cas_chat_template tpl;
    if (cas_chat_template_parse(src, &tpl) != CAS_OK) return -9;
    int r = cas_chat_template_tools(&tpl);
    cas_chat_template_free(&tpl);
    return r;
}

static void test_chat_tools(void) {
    CHECK(tools_of("{% if tools %}Call <tool_call>{...}</tool_call>{% endif %}{% for m in messages %}{{ m.content }}"
                   "{% endfor %}") == CAS_CHAT_TOOLS_HERMES);
    CHECK(tools_of("{% for t in tools or [] %}{{ t | tojson }}{% endfor %}Respond with {\"name\": ...}") ==
          CAS_CHAT_TOOLS_OTHER);
    CHECK(tools_of("{% for m in messages %}<tool_call>{{ m.content }}{% endfor %}") == CAS_CHAT_TOOLS_NONE);
    /* a ChatML template the interpreter cannot compile: the built-in routine, no variables */
    CHECK(tools_of("{% if tools %}{% frobnicate %}{% endif %}<|im_start|>user\n<|im_end|>") == -1);
}

int main(void) {
    RUN(test_reads);
    RUN(test_chat_tools);
    RUN(test_basics);
    RUN(test_errors);
    RUN(test_limits);
    RUN(test_time);
    RUN(test_threads);
    return check_summary();
}
