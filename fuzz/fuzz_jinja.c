/*
 * fuzz_jinja.c: libFuzzer harness for the Jinja interpreter, which runs the
 * chat template of any model file a user loads. An input is template
 * source, optionally followed by a NUL byte and a JSON context; without
 * one, a chat context (messages with a system turn, content parts and a
 * tool call, tools, bos/eos) is used. Whatever compiles is rendered under
 * small limits, so that a hostile template can only end in an error: no
 * crash, no read outside the source or the context, no unbounded time or
 * memory. Build and run with `make fuzz-jinja` (see README.md).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../src/model/model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char CHAT[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"},"
    " {\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"Hi \\u00e9\"}]},"
    " {\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"id\": \"call12345\", \"type\": \"function\","
    " \"function\": {\"name\": \"f\", \"arguments\": {\"x\": [1, 2.5, null, true]}}}]},"
    " {\"role\": \"tool\", \"content\": \"42\"}, {\"role\": \"user\", \"content\": \"<think>a</think>b\"}],"
    " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {}}}],"
    " \"add_generation_prompt\": true, \"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *nul = memchr(data, 0, size);
    size_t tlen = nul ? (size_t)(nul - data) : size;
    /* exact-size copies: ASan sees a read one byte past either end */
    char *src = malloc(tlen ? tlen : 1);
    size_t clen = nul ? size - tlen - 1 : sizeof CHAT - 1;
    char *ctx = malloc(clen ? clen : 1);
    if (!src || !ctx) {
        free(src);
        free(ctx);
        return 0;
    }
    memcpy(src, data, tlen);
    memcpy(ctx, nul ? (const char *)nul + 1 : CHAT, clen);
    cas_jinja *t = NULL;
    if (cas_jinja_compile(src, tlen, &t) == CAS_OK) {
        cas_jinja_limits lim = {1 << 20, 64u << 20, 20000, 1736942400};
        char *out = NULL;
        size_t n = 0;
        if (cas_jinja_render(t, ctx, clen, &lim, &out, &n) == CAS_OK) {
            if (n != strlen(out) && !memchr(out, 0, n)) abort(); /* the length must describe the text */
            free(out);
        }
        cas_jinja_destroy(t);
    }
    free(src);
    free(ctx);
    return 0;
}
