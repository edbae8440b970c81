/*
 * main.c: the `cascade` command. Each subcommand lives in its own file
 * (cmd_*.c) and is listed in the table below; this file only dispatches.
 */
#include <stdio.h>
#include <string.h>

#include "tools.h"

static const struct {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *help;
} commands[] = {
    {"attn-bench", cmd_attn_bench, "benchmark flat vs cascade paged attention on a random batch"},
    {"bench", cmd_bench, "offline serving benchmark: synthetic shared-prefix requests through the engine"},
    {"generate", cmd_generate, "generate text for one or several prompts (batched, shared prefix pages)"},
    {"serve", cmd_serve, "OpenAI-compatible HTTP server (completions, chat, streaming, metrics)"},
    {"template", cmd_template, "render a chat template (the model's or a Jinja file) over a JSON conversation"},
    {"tokenize", cmd_tokenize, "print the token ids of a text as a JSON array"},
};

static void usage(FILE *f) {
    fprintf(f, "usage: cascade COMMAND [options]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-12s %s\n", commands[i].name, commands[i].help);
    fprintf(f, "\n`cascade COMMAND --help` describes a command's options.\n");
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (!strcmp(argv[1], commands[i].name)) return commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "cascade: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
