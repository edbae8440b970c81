/*
 * tools.h: the subcommands of the `cascade` command, one function each,
 * called with argv[0] = the subcommand's name. They return the exit status.
 */
#ifndef CASCADE_TOOLS_H
#define CASCADE_TOOLS_H

int cmd_attn_bench(int argc, char **argv);
int cmd_generate(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_template(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);

/* A whole file ("-": standard input) as a NUL-terminated string the caller
 * frees, or NULL when it cannot be opened or read (errno says why). */
char *cas_tool_read_file(const char *path);

#endif
