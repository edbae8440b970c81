#!/usr/bin/env bash
# A batch demo: set up a fresh machine (packages, the default model, the
# build; tools/setup.sh does only what is missing), then run the default model
# on five questions that share one long system prompt, generated together in
# one batch. The shared prompt's KV pages are computed once and read once per
# step for all five (cascade attention); the answers print as they finish,
# then prompt and generation tokens/s.
#   usage: bash tools/demo_generate.sh [extra cascade generate options]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh >&2
SYSTEM="You are Cascade Guide, a patient and precise assistant for a public science museum. \
Visitors of every age ask you questions at an information desk. Always answer in plain English, \
in two or three short sentences, without lists or headings. Prefer concrete numbers and everyday \
comparisons over jargon. If a question is about safety, say clearly what to do first. If you do not \
know something, say so instead of guessing. Never invent exhibits, opening hours or prices: the museum \
is open every day from nine to five, entry is free for children under twelve, and the planetarium show \
starts on the hour. Be warm and encouraging, and keep every answer short enough to read aloud in \
twenty seconds."
exec "${BUILD:-build}/cascade" generate --chat --system "$SYSTEM" --threads 2 -n 96 --temperature 0.3 --seed 7 \
  -p "Why is the sky blue?" \
  -p "How far away is the Moon?" \
  -p "When does the planetarium show start?" \
  -p "What should I do if I smell smoke in the museum?" \
  -p "How do bees make honey?" \
  "$@"
