#!/usr/bin/env python3
"""Checks the command line of `cascade generate` and `cascade bench`: options
that take no value do not swallow the next argument wherever they stand, an
option missing its value or an unknown one is an error, and --mmap (the
weights left in the file's mapping) gives the same greedy text as the default
(the file read into memory). Prints "N passed, N failed" like the C tests.
"""
import os
import subprocess
import sys

BUILD = os.environ.get("BUILD", "build")
CASCADE = os.path.join(BUILD, "cascade")
PROMPT = "The capital of France is"

from checklib import check, summary


def run(*args, timeout=300):
    return subprocess.run([CASCADE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=timeout)


def generate(*extra):
    return run("generate", "-q", "-n", "12", "--temperature", "0", "-p", PROMPT, *extra)


base = generate()
check(base.returncode == 0 and base.stdout.strip(), "generate runs greedy")
# every flag last (nothing after it to swallow) and first (the prompt option after it)
for flag in ("--mmap", "--no-batch-invariance", "--no-amx", "--no-cascade", "--no-prefix-cache", "--debug-checks"):
    last = generate(flag)
    check(last.returncode == 0 and last.stdout.strip(), f"generate {flag} as the last argument: {last.stderr[-200:]!r}")
    first = run("generate", flag, "-q", "-n", "12", "--temperature", "0", "-p", PROMPT)
    check(first.returncode == 0 and first.stdout == last.stdout, f"generate {flag} before other options")
    if flag in ("--mmap", "--no-amx", "--debug-checks", "--no-prefix-cache"):
        # the same kernels and arithmetic: the greedy text of the default
        check(last.stdout == base.stdout, f"generate {flag}: the default's greedy text")
bad = run("generate", "-p")
check(bad.returncode != 0 and "needs a value" in bad.stderr, "generate -p without its value is an error")
bad = run("generate", "--no-such-option", "-p", PROMPT)
check(bad.returncode != 0 and "unknown option" in bad.stderr, "generate: an unknown option is an error")
b = run("bench", "--requests", "4", "--prefix", "32", "--suffix", "8", "--output", "4", "--mmap")
check(b.returncode == 0, f"bench --mmap runs: {b.stderr[-300:]!r}")

sys.exit(summary())
