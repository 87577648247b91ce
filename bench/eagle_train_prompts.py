"""Write a chat prompt set for ``lmkit spec train-eagle --prompts`` that is disjoint from
the chat prompts the benchmarks measure with (so a head's acceptance is measured on
prompts it was not trained on).

    python bench/eagle_train_prompts.py OUT.jsonl [--n 600] [--seed 0]

Prompts are instructions built from task templates and topics (explain, list, compare,
write a short poem/story/email, give steps, answer a factual question, summarize, ...),
shuffled with ``--seed``; none equals a prompt of ``lmkit.benchmarking.prompts``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

TEMPLATES = (
    "Explain {t} to a ten-year-old.",
    "What are the main advantages and drawbacks of {t}?",
    "Give me five facts about {t}.",
    "Write a short poem about {t}.",
    "Write a two-paragraph story that involves {t}.",
    "How would you describe {t} in one sentence?",
    "List the steps someone should follow to learn about {t}.",
    "Write a polite email asking a colleague for advice on {t}.",
    "What is a common misconception about {t}?",
    "Compare {t} with something similar and explain the difference.",
    "Summarize the history of {t} briefly.",
    "Why do people care about {t}?",
)
TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "black holes", "the Roman Empire",
    "electric cars", "machine learning", "recycling", "the human heart", "coffee",
    "the stock market", "bees", "the moon landing", "vaccines", "renewable energy",
    "chess", "jazz music", "the internet", "sleep", "the Great Wall of China",
    "climate change", "bicycles", "rainforests", "the printing press", "gravity",
    "earthquakes", "democracy", "the Olympic Games", "penguins", "solar panels",
    "bread baking", "public libraries", "the immune system", "trains", "glaciers",
    "prime numbers", "social media", "ancient Egypt", "tea", "the ocean tides",
    "compilers", "databases", "the violin", "desert animals", "time zones",
    "origami", "submarines", "rainbows", "the periodic table", "mountain climbing",
)


def prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct instruction prompts (at most templates x topics), shuffled."""
    from lmkit.benchmarking.prompts import CHAT_PROMPTS

    pool = [tpl.format(t=topic) for tpl, topic in itertools.product(TEMPLATES, TOPICS)]
    pool = [p for p in pool if p not in set(CHAT_PROMPTS)]
    if n > len(pool):
        raise ValueError(f"at most {len(pool)} prompts can be made (asked for {n})")
    random.Random(seed).shuffle(pool)
    return pool[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--n", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = prompts(args.n, args.seed)
    args.out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()
