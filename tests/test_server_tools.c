/*
 * test_server_tools.c: the reader of Hermes-style tool calls in generated
 * text (src/server/server_tools.c, cas_srv_tools_*), on its own.
 *
 * Each case gives a text and the content and calls expected of it: one
 * call, several, text before, between and after them, arguments absent,
 * null, encoded as a string, with nested braces and strings that hold
 * "</tool_call>", braces and escaped quotes, huge integers, repeated and
 * escaped keys, UTF-8; and every malformed kind (no object, bad JSON, no
 * name, arguments of the wrong type, text before the closing tag, a
 * misspelled or missing closing tag, a '<' outside the object's strings),
 * which must stay content while a good block after it is still found.
 *
 * The same text is then fed as a stream: cut once at every byte, one byte
 * at a time, and in random pieces; each way must give exactly the whole
 * text's content and calls, and what a stream has decided at any moment
 * must be a prefix of the end result (a stream never takes back what it
 * sent). Also: what a stream holds back (a possible tag, whitespace that may
 * precede a call) and what it must not (plain text).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/server/server_impl.h"
#include "check.h"

#define MAX_CALLS 4

typedef struct {
    const char *text;
    const char *content; /* "" for none */
    int n_calls;
    const char *name[MAX_CALLS];
    const char *args[MAX_CALLS];
} tcase;

#define CALL "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>"
#define CALL_ARGS "{\"city\": \"Paris\", \"days\": 3}"

static const tcase cases[] = {
    {"Hello, world.", "Hello, world.", 0, {0}, {0}},
    {"", "", 0, {0}, {0}},
    {"\n\n", "\n\n", 0, {0}, {0}},
    {"Hi  \n", "Hi  \n", 0, {0}, {0}},
    {"a <b> <tool> </tool_call> text <tool_call", "a <b> <tool> </tool_call> text <tool_call", 0, {0}, {0}},
    /* one call, as Qwen2.5 writes it */
    {CALL, "", 1, {"get_weather"}, {CALL_ARGS}},
    /* several, with the newlines between and after them */
    {CALL "\n" CALL "\n", "", 2, {"get_weather", "get_weather"}, {CALL_ARGS, CALL_ARGS}},
    {"<tool_call>{\"name\":\"a\",\"arguments\":{\"x\":1}}</tool_call><tool_call>{\"name\":\"b\",\"arguments\":{}}"
     "</tool_call>\n\n<tool_call>\n{\"name\": \"c\", \"arguments\": {\"y\": [true, null]}}\n</tool_call>",
     "", 3, {"a", "b", "c"}, {"{\"x\":1}", "{}", "{\"y\": [true, null]}"}},
    /* text before, between and after: kept byte for byte */
    {"Let me look.\n\n<tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call>\nDone.", "Let me look.\n\n\nDone.", 1,
     {"f"}, {"{}"}},
    {"A " CALL " B " CALL, "A  B ", 2, {"get_weather", "get_weather"}, {CALL_ARGS, CALL_ARGS}},
    /* whitespace alone around the calls is not content */
    {"  \n<tool_call>  {\"name\":\"f\"}  \n</tool_call>  \n", "", 1, {"f"}, {"{}"}},
    /* arguments absent, null, a string holding an object */
    {"<tool_call>{\"name\": \"ping\"}</tool_call>", "", 1, {"ping"}, {"{}"}},
    {"<tool_call>{\"name\": \"ping\", \"arguments\": null}</tool_call>", "", 1, {"ping"}, {"{}"}},
    {"<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>", "", 1, {"f"}, {"{\"a\": 1}"}},
    /* nested braces, and strings holding the closing tag, braces and quotes */
    {"<tool_call>{\"name\": \"echo\", \"arguments\": {\"text\": \"a </tool_call> b } { \\\" c\", "
     "\"deep\": {\"x\": [1, {\"y\": []}]}}}</tool_call>",
     "", 1, {"echo"}, {"{\"text\": \"a </tool_call> b } { \\\" c\", \"deep\": {\"x\": [1, {\"y\": []}]}}"}},
    /* numbers beyond 64 bits, repeated keys (the last counts), an escaped key, UTF-8 */
    {"<tool_call>{\"name\": \"f\", \"arguments\": {\"n\": 123456789012345678901234567890, \"r\": 1.10}}</tool_call>", "",
     1, {"f"}, {"{\"n\": 123456789012345678901234567890, \"r\": 1.10}"}},
    {"<tool_call>{\"name\":\"f\",\"arguments\":{\"a\":1},\"arguments\":{\"b\":2}}</tool_call>", "", 1, {"f"},
     {"{\"b\":2}"}},
    {"<tool_call>{\"name\":\"f\",\"argu\\u006dents\":{\"c\":3}}</tool_call>", "", 1, {"f"}, {"{\"c\":3}"}},
    {"<tool_call>{\"name\": \"m\xc3\xa9t\xc3\xa9o\", \"arguments\": {\"ville\": \"\xe6\x97\xa5\xe6\x9c\xac\"}}</tool_call>", "",
     1, {"m\xc3\xa9t\xc3\xa9o"}, {"{\"ville\": \"\xe6\x97\xa5\xe6\x9c\xac\"}"}},
    /* malformed blocks stay content */
    {"<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": }}</tool_call>",
     "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": }}</tool_call>", 0, {0}, {0}},
    {"<tool_call>{\"arguments\": {}}</tool_call>", "<tool_call>{\"arguments\": {}}</tool_call>", 0, {0}, {0}},
    {"<tool_call>{\"name\": 5}</tool_call>", "<tool_call>{\"name\": 5}</tool_call>", 0, {0}, {0}},
    {"<tool_call>{\"name\": \"\"}</tool_call>", "<tool_call>{\"name\": \"\"}</tool_call>", 0, {0}, {0}},
    {"<tool_call>{\"name\": \"f\", \"arguments\": \"x\"}</tool_call>",
     "<tool_call>{\"name\": \"f\", \"arguments\": \"x\"}</tool_call>", 0, {0}, {0}},
    {"<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",
     "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>", 0, {0}, {0}},
    {"<tool_call>[1]</tool_call>", "<tool_call>[1]</tool_call>", 0, {0}, {0}},
    {"<tool_call>{\"name\": \"f\"} trailing</tool_call>", "<tool_call>{\"name\": \"f\"} trailing</tool_call>", 0, {0},
     {0}},
    {"<tool_call>{\"name\": \"f\"}</tool_cal>", "<tool_call>{\"name\": \"f\"}</tool_cal>", 0, {0}, {0}},
    {"  <tool_call>x", "  <tool_call>x", 0, {0}, {0}},
    /* unterminated: the text ends inside the block or inside its tags */
    {"Sure <tool_call>{\"name\": \"f\", \"arguments\": {}}", "Sure <tool_call>{\"name\": \"f\", \"arguments\": {}}", 0,
     {0}, {0}},
    {"Sure <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_", "Sure <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_",
     0, {0}, {0}},
    {"<tool_call>{\"name\": \"f\", \"arguments\": {\"s\": \"open string}}</tool_call>",
     "<tool_call>{\"name\": \"f\", \"arguments\": {\"s\": \"open string}}</tool_call>", 0, {0}, {0}},
    {"abc <tool_ca", "abc <tool_ca", 0, {0}, {0}},
    /* a malformed block does not hide a good one after it */
    {"<tool_call>oops</tool_call>\n<tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>",
     "<tool_call>oops</tool_call>\n", 1, {"g"}, {"{}"}},
    {"<tool_call>{\"name\": \"a\", <tool_call>{\"name\": \"b\", \"arguments\": {\"k\": \"v\"}}</tool_call>",
     "<tool_call>{\"name\": \"a\", ", 1, {"b"}, {"{\"k\": \"v\"}"}},
    {"<tool_call><tool_call>{\"name\":\"f\"}</tool_call>", "<tool_call>", 1, {"f"}, {"{}"}},
    {CALL "\n<tool_call>{\"name\": 1}</tool_call>\n" CALL,
     "\n<tool_call>{\"name\": 1}</tool_call>\n", 2, {"get_weather", "get_weather"}, {CALL_ARGS, CALL_ARGS}},
};

/* The result of one way of feeding, as one comparable record. */
typedef struct {
    char *content;
    int n_calls;
    char *name[MAX_CALLS + 4], *args[MAX_CALLS + 4];
} result;

static void result_free(result *r) {
    free(r->content);
    for (int i = 0; i < r->n_calls && i < MAX_CALLS + 4; i++) {
        free(r->name[i]);
        free(r->args[i]);
    }
    memset(r, 0, sizeof *r);
}

static result take(const cas_srv_tools *t) {
    result r;
    memset(&r, 0, sizeof r);
    r.content = strdup(t->content ? t->content : "");
    r.n_calls = t->n_calls;
    for (int i = 0; i < t->n_calls && i < MAX_CALLS + 4; i++) {
        r.name[i] = strdup(t->calls[i].name);
        r.args[i] = strdup(t->calls[i].arguments);
    }
    return r;
}

static int same(const result *a, const result *b) {
    if (strcmp(a->content, b->content) || a->n_calls != b->n_calls) return 0;
    for (int i = 0; i < a->n_calls && i < MAX_CALLS + 4; i++)
        if (strcmp(a->name[i], b->name[i]) || strcmp(a->args[i], b->args[i])) return 0;
    return 1;
}

/* What is decided so far must be a prefix of the end result. */
static int prefix_of(const cas_srv_tools *t, const result *end) {
    size_t n = t->content_len;
    if (n > strlen(end->content) || (n && memcmp(t->content, end->content, n))) return 0;
    if (t->n_calls > end->n_calls) return 0;
    for (int i = 0; i < t->n_calls; i++)
        if (strcmp(t->calls[i].name, end->name[i]) || strcmp(t->calls[i].arguments, end->args[i])) return 0;
    return 1;
}

/* Feeds text in the pieces cuts[] marks (sorted offsets, n_cuts of them). */
static result feed_cut(const char *text, const size_t *cuts, int n_cuts, const result *end, int *monotone) {
    cas_srv_tools t;
    memset(&t, 0, sizeof t);
    size_t len = strlen(text), at = 0;
    for (int i = 0; i <= n_cuts; i++) {
        size_t to = i < n_cuts ? cuts[i] : len;
        /* each piece in its own exact-size buffer, so ASan sees a read past it */
        char *piece = malloc(to - at + 1);
        memcpy(piece, text + at, to - at);
        cas_srv_tools_feed(&t, piece, to - at);
        free(piece);
        at = to;
        if (end && !prefix_of(&t, end)) *monotone = 0;
    }
    cas_srv_tools_finish(&t);
    result r = take(&t);
    cas_srv_tools_free(&t);
    return r;
}

static void test_cases(void) {
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const tcase *k = &cases[c];
        result whole = feed_cut(k->text, NULL, 0, NULL, NULL);
        int ok = !strcmp(whole.content, k->content) && whole.n_calls == k->n_calls;
        for (int i = 0; ok && i < k->n_calls; i++)
            ok = !strcmp(whole.name[i], k->name[i]) && !strcmp(whole.args[i], k->args[i]);
        CHECKF(ok, "case %zu: content '%s', %d calls (want '%s', %d); first call %s %s", c, whole.content,
               whole.n_calls, k->content, k->n_calls, whole.n_calls ? whole.name[0] : "-",
               whole.n_calls ? whole.args[0] : "-");
        result_free(&whole);
    }
}

static void test_stream_equals_whole(void) {
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const char *text = cases[c].text;
        size_t len = strlen(text);
        result whole = feed_cut(text, NULL, 0, NULL, NULL);
        int bad_cut = -1, monotone = 1;
        /* one cut at every byte */
        for (size_t at = 0; at <= len; at++) {
            result r = feed_cut(text, &at, 1, &whole, &monotone);
            if (!same(&r, &whole) && bad_cut < 0) bad_cut = (int)at;
            result_free(&r);
        }
        CHECKF(bad_cut < 0, "case %zu cut at %d differs from the whole", c, bad_cut);
        /* one byte at a time */
        size_t *cuts = malloc((len + 1) * sizeof *cuts);
        for (size_t i = 0; i < len; i++) cuts[i] = i + 1;
        result r = feed_cut(text, cuts, len ? (int)len - 1 : 0, &whole, &monotone);
        CHECKF(same(&r, &whole), "case %zu byte by byte: '%s' %d calls", c, r.content, r.n_calls);
        result_free(&r);
        /* random pieces */
        int bad_random = 0;
        for (int round = 0; round < 50; round++) {
            int n = 0;
            for (size_t i = 1; i < len; i++) {
                rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
                if (rng % 4 == 0) cuts[n++] = i;
            }
            r = feed_cut(text, cuts, n, &whole, &monotone);
            bad_random += !same(&r, &whole);
            result_free(&r);
        }
        CHECKF(bad_random == 0, "case %zu: %d random cuttings differ", c, bad_random);
        CHECKF(monotone, "case %zu: a stream took back what it had decided", c);
        free(cuts);
        result_free(&whole);
    }
}

/* What a stream may hold back, and what it must send at once. */
static void test_holding_back(void) {
    cas_srv_tools t;
    memset(&t, 0, sizeof t);
    cas_srv_tools_feed(&t, "Hello wor", 9);
    CHECK(t.content_len == 9 && !strcmp(t.content, "Hello wor")); /* plain text: nothing held */
    cas_srv_tools_feed(&t, "ld. <tool", 9);
    CHECK(!strcmp(t.content, "Hello world. ")); /* a possible tag waits */
    cas_srv_tools_feed(&t, "_call>{\"name\": \"f\", \"arguments\": {\"a\": \"}\"}}", 44);
    CHECK(!strcmp(t.content, "Hello world. ") && t.n_calls == 0); /* the block waits for its closing tag */
    cas_srv_tools_feed(&t, "</tool_call>", 12);
    CHECK(t.n_calls == 1 && !strcmp(t.calls[0].name, "f") && !strcmp(t.calls[0].arguments, "{\"a\": \"}\"}"));
    cas_srv_tools_feed(&t, "\n", 1);
    CHECK(!strcmp(t.content, "Hello world. ")); /* whitespace after a call waits */
    cas_srv_tools_feed(&t, "ok", 2);
    CHECK(!strcmp(t.content, "Hello world. \nok")); /* and is content once text follows */
    cas_srv_tools_finish(&t);
    CHECK(t.finished && !strcmp(t.content, "Hello world. \nok") && t.n_calls == 1);
    cas_srv_tools_feed(&t, "more", 4); /* after finish: ignored */
    CHECK(!strcmp(t.content, "Hello world. \nok"));
    cas_srv_tools_free(&t);
    CHECK(t.content == NULL && t.n_calls == 0);
    cas_srv_tools_free(NULL);

    /* leading whitespace waits (it may precede a call) and comes out when the text has no call */
    memset(&t, 0, sizeof t);
    cas_srv_tools_feed(&t, "\n ", 2);
    CHECK(t.content_len == 0);
    cas_srv_tools_finish(&t);
    CHECK(t.content_len == 2 && !strcmp(t.content, "\n "));
    cas_srv_tools_free(&t);

    /* a '<' that cannot begin the tag goes out at once */
    memset(&t, 0, sizeof t);
    cas_srv_tools_feed(&t, "a<b", 3);
    CHECK(t.content_len == 3);
    cas_srv_tools_feed(&t, "<tool_call>oops", 15); /* known not to be a call at 'o' */
    CHECK(!strcmp(t.content, "a<b<tool_call>oops"));
    cas_srv_tools_free(&t);
}

/* A long text with many calls and a long argument: linear work, every call found. */
static void test_many(void) {
    size_t cap = 1 << 20, len = 0;
    char *text = malloc(cap);
    int want = 0;
    for (int i = 0; i < 500; i++) {
        len += (size_t)snprintf(text + len, cap - len, "<tool_call>\n{\"name\": \"f%d\", \"arguments\": {\"i\": %d}}\n</tool_call>\n",
                                i, i);
        want++;
    }
    len += (size_t)snprintf(text + len, cap - len, "<tool_call>{\"name\": \"long\", \"arguments\": {\"s\": \"");
    for (int i = 0; i < 100000; i++) text[len++] = "ab}{<>\\n"[i % 6];
    len += (size_t)snprintf(text + len, cap - len, "\"}}</tool_call>");
    want++;
    cas_srv_tools t;
    memset(&t, 0, sizeof t);
    for (size_t at = 0; at < len; at += 7) cas_srv_tools_feed(&t, text + at, len - at < 7 ? len - at : 7);
    cas_srv_tools_finish(&t);
    CHECKF(t.n_calls == want && t.content_len == 0 && !t.failed, "%d calls, content %zu bytes", (int)t.n_calls,
           t.content_len);
    CHECK(t.n_calls == want && !strcmp(t.calls[499].name, "f499") && !strcmp(t.calls[499].arguments, "{\"i\": 499}"));
    CHECK(t.n_calls == want && strlen(t.calls[500].arguments) == 100000 + 9);
    cas_srv_tools_free(&t);
    free(text);
}

int main(void) {
    RUN(test_cases);
    RUN(test_stream_equals_whole);
    RUN(test_holding_back);
    RUN(test_many);
    return check_summary();
}
