#!/usr/bin/env python3
"""Asks a running `cascade serve` five questions at once through the official
`openai` client, all under one system prompt. The server batches the five
streams in one engine: the system prompt's KV pages are computed once (the
prefix cache) and read once per decode step for all five (cascade attention).
Prints each answer and the prompt tokens the server took from its cache.

    python3 tools/ask.py [--url http://127.0.0.1:8000/v1] [--api-key KEY]
"""
import argparse
import concurrent.futures
import os

from openai import OpenAI

SYSTEM = ("You are Cascade Guide, a patient and precise assistant for a public science museum. Visitors of "
          "every age ask you questions at an information desk. Answer in plain English, in two or three short "
          "sentences, without lists or headings. Prefer concrete numbers and everyday comparisons over jargon. "
          "If a question is about safety, say first what to do. If you do not know something, say so. The "
          "museum is open every day from nine to five, entry is free for children under twelve, and the "
          "planetarium show starts on the hour.")
QUESTIONS = ["Why is the sky blue?", "How far away is the Moon?", "When does the planetarium show start?",
             "What should I do if I smell smoke in the museum?", "How do bees make honey?"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default=os.environ.get("CASCADE_API_KEY", "none"))
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    client = OpenAI(base_url=args.url, api_key=args.api_key)
    model = client.models.list().data[0].id

    def ask(q):
        r = client.chat.completions.create(model=model, max_tokens=args.max_tokens, temperature=0.3, seed=7,
                                           messages=[{"role": "system", "content": SYSTEM},
                                                     {"role": "user", "content": q}])
        details = r.usage.prompt_tokens_details
        return q, r.choices[0].message.content, r.usage.prompt_tokens, details.cached_tokens if details else 0

    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        for q, answer, prompt_tokens, cached in pool.map(ask, QUESTIONS):
            print(f"Q: {q}\nA: {answer.strip()}\n   ({prompt_tokens} prompt tokens, {cached} from the prefix cache)\n")


if __name__ == "__main__":
    main()
