/*
 * server_engine.c: binds the server to the real engine. cas_server_create
 * fills the server's engine table (cas_srv_engine_ops) with the engine.h
 * functions. It is the only server file that calls the engine, so the unit
 * test, which brings its own test double of the table, links without it.
 */
#include "server_impl.h"

static cas_status e_submit(void *ctx, const cas_engine_request *req, uint64_t *id) {
    return cas_engine_submit(ctx, req, id);
}
static cas_status e_abort(void *ctx, uint64_t id) { return cas_engine_abort(ctx, id); }
static void e_stats(void *ctx, cas_engine_stats *st) { cas_engine_get_stats(ctx, st); }
static const char *e_name(void *ctx) { return cas_engine_model_name(ctx); }
static int32_t e_ctx(void *ctx) { return cas_engine_context_length(ctx); }
static cas_status e_chat(void *ctx, const cas_engine_msg *msgs, int32_t n, char **out) {
    return cas_engine_apply_chat(ctx, msgs, n, out);
}
static cas_status e_chat_json(void *ctx, const char *context_json, char **out) {
    return cas_engine_apply_chat_json(ctx, context_json, out);
}
static int e_chat_tools(void *ctx) { return cas_engine_chat_tools(ctx); }
static cas_status e_count(void *ctx, const char *text, int32_t *n) { return cas_engine_count_tokens(ctx, text, n); }
static const char *e_tok(void *ctx, int32_t id, size_t *len) { return cas_engine_token_text(ctx, id, len); }

cas_status cas_server_create(cas_server **out, cas_engine *e, const cas_server_opts *opts) {
    if (!out || !e) return cas_error(CAS_ERR_INVALID, "server: no engine");
    cas_srv_engine_ops ops = {
        .ctx = e,
        .submit = e_submit,
        .abort = e_abort,
        .get_stats = e_stats,
        .model_name = e_name,
        .context_length = e_ctx,
        .apply_chat = e_chat,
        .apply_chat_json = e_chat_json,
        .chat_tools = e_chat_tools,
        .count_tokens = e_count,
        .token_text = e_tok,
    };
    return cas_srv_create_with_ops(out, &ops, opts);
}
