"""Write a chat prompt set for ``lmkit spec train-eagle --prompts`` that is disjoint from
the chat prompts the benchmarks measure with (so a head's acceptance is measured on
prompts it was not trained on).

    python bench/eagle_train_prompts.py OUT.jsonl [--count 600] [--seed 0]

Prompts are instructions built from task templates and topics (explain, list, compare,
write a short poem/story/email, give steps, answer a factual question, summarize, ...),
shuffled with ``--seed``; none equals a prompt of ``lmkit.benchmarking.prompts``. The
first 600 come from the original templates and topics (the same set as before for
``--count 600`` or less); larger sets (up to several thousand, e.g. ``--count 4000``)
add more templates, topics and answer styles.
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

MORE_TEMPLATES = (
    "What would happen if {t} suddenly disappeared?",
    "Write a short dialogue between two friends about {t}.",
    "Give three questions a student might ask about {t}, and answer them.",
    "Describe {t} as if you were a tour guide.",
    "What are some surprising numbers related to {t}?",
    "Explain how {t} works, step by step.",
    "Write a haiku about {t}.",
    "How has {t} changed over the last hundred years?",
)
MORE_TOPICS = (
    "lighthouses", "honey", "the Amazon river", "wind turbines", "fungi", "the Moon",
    "typewriters", "coral reefs", "bridges", "the Silk Road", "octopuses", "batteries",
    "maps", "clocks", "the blood cells", "snow", "paper", "elephants", "satellites",
    "soap", "pyramids", "volunteering", "kites", "the alphabet", "dinosaurs",
    "cheese making", "the metric system", "hurricanes", "magnets", "owls",
)
STYLES = ("", " Keep it short.", " Use simple words.", " Answer in a numbered list.",
          " Include one concrete example.")


def prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct instruction prompts, shuffled: first the original templates x
    topics, then the larger pool (more templates and topics, answer styles)."""
    from lmkit.benchmarking.prompts import CHAT_PROMPTS

    taken = set(CHAT_PROMPTS)
    base = [tpl.format(t=topic) for tpl, topic in itertools.product(TEMPLATES, TOPICS)]
    base = [p for p in base if p not in taken]
    taken |= set(base)
    extra = list(dict.fromkeys(
        tpl.format(t=topic) + style for tpl, topic, style in itertools.product(
            TEMPLATES + MORE_TEMPLATES, TOPICS + MORE_TOPICS, STYLES)))
    extra = [p for p in extra if p not in taken]
    if n > len(base) + len(extra):
        raise ValueError(f"at most {len(base) + len(extra)} prompts can be made "
                         f"(asked for {n})")
    rng = random.Random(seed)
    rng.shuffle(base)  # (the original set: the same prompts as before for n <= 600)
    rng.shuffle(extra)
    return (base + extra)[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--count", "--n", dest="n", type=int, default=600,
                    help="how many prompts (up to about 8000)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = prompts(args.n, args.seed)
    args.out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()
