"""Write a chat prompt set for ``lmkit spec train-eagle --prompts`` that is disjoint from
the chat prompts the benchmarks measure with (so a head's acceptance is measured on
prompts it was not trained on).

    python bench/eagle_train_prompts.py OUT.jsonl [--count 600] [--seed 0]

Prompts are instructions built from task templates and topics (explain, list, compare,
write a short poem/story/email, give steps, answer a factual question, summarize, ...),
shuffled with ``--seed``; none equals a prompt of ``lmkit.benchmarking.prompts``. The
first 600 come from the original templates and topics (the same set as before for
``--count 600`` or less); larger sets (up to several thousand, e.g. ``--count 4000``)
add more templates, topics and answer styles. ``--tasks`` puts everyday chat tasks
first (capitals, arithmetic, unit conversions, translations, small Python functions,
SQL, definitions, tips, plot summaries, lists, recipes, limericks, synonyms, HTTP codes,
JSON, regular expressions; ~580 prompts with the answer styles), a spread of requests
closer to real chat traffic than the topic templates alone.
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

# --tasks: everyday chat requests (short facts, arithmetic, conversions, code, SQL,
# translation, definitions, recipes, lists, small creative pieces), instantiated from
# the lists below; like all of this set, none is a prompt of lmkit bench's chat set
TASKS = (
    ("What is the capital of {x}?", ("Japan", "Canada", "Kenya", "Peru", "Norway",
                                    "Australia", "Egypt", "Vietnam", "Chile", "Poland")),
    ("What is {x}? Show your work.", ("48 multiplied by 12", "365 divided by 5",
                                      "1024 minus 389", "19 squared", "15% of 240",
                                      "the sum of the numbers from 1 to 20",
                                      "7 factorial", "3.5 times 8")),
    ("Convert {x}.", ("5 kilometers to miles", "30 degrees Celsius to Fahrenheit",
                      "2 hours and 15 minutes to seconds", "10 pounds to kilograms",
                      "1.5 liters to milliliters", "72 inches to feet")),
    ("Translate '{x}' into French.", ("Where is the train station?", "I would like a coffee",
                                      "Thank you for your help", "See you tomorrow")),
    ("Translate '{x}' into German.", ("The weather is nice today", "How much does it cost?",
                                      "I am learning to cook", "Good night")),
    ("Write a Python function that {x}.", (
        "checks whether a number is prime", "counts the vowels in a string",
        "returns the largest item of a list", "merges two sorted lists",
        "computes the factorial of n", "removes duplicates from a list",
        "converts Celsius to Fahrenheit", "checks whether a word is a palindrome")),
    ("Write a SQL query that {x}.", ("finds the ten most recent orders",
                                     "averages salaries by department",
                                     "lists customers who never ordered",
                                     "deletes rows older than a year")),
    ("Explain what {x} is in two sentences.", ("a linked list", "a compiler", "a neural network",
                                               "an operating system", "a blockchain",
                                               "a binary search", "a firewall", "a cache")),
    ("What is the difference between {x}?", ("a virus and a bacterium", "RAM and storage",
                                             "a stack and a queue", "HTTP and HTTPS",
                                             "speed and velocity", "a lake and a pond")),
    ("Give me three tips for {x}.", ("learning a new language", "saving money",
                                     "staying focused while studying", "running a first marathon",
                                     "keeping houseplants alive", "writing a resume")),
    ("Summarize the plot of {x} in one paragraph.", ("Hamlet", "The Odyssey",
                                                     "Pride and Prejudice", "Moby-Dick",
                                                     "Cinderella", "The Little Prince")),
    ("Name five {x}.", ("fruits that are red", "countries in South America", "musical instruments",
                       "programming languages", "birds that cannot fly", "famous painters")),
    ("How do I make {x}?", ("pancakes", "a cup of green tea", "guacamole", "a paper airplane",
                            "scrambled eggs", "a simple vinaigrette")),
    ("Write a limerick about {x}.", ("a sleepy cat", "a lost umbrella", "a dancing giraffe",
                                     "a chef who hates onions")),
    ("Give three synonyms for '{x}'.", ("sad", "fast", "big", "smart", "angry")),
    ("What does HTTP status code {x} mean?", ("200", "301", "403", "500", "503")),
    ("Write a JSON object describing {x}.", ("a movie with title, director and year",
                                             "a car with make, model and color",
                                             "a person with name, age and city")),
    ("Write a regular expression that matches {x}.", ("a US zip code", "a date like 2024-05-17",
                                                      "a hexadecimal color code")),
)


def task_prompts() -> list[str]:
    """Every instance of :data:`TASKS`."""
    return [tpl.format(x=x) for tpl, xs in TASKS for x in xs]


def prompts(n: int, seed: int = 0, tasks: bool = False) -> list[str]:
    """``n`` distinct instruction prompts, shuffled: first the original templates x
    topics, then the larger pool (more templates and topics, answer styles). With
    ``tasks``, every :data:`TASKS` instance (and each with each answer style) comes
    first, shuffled, then the rest."""
    from lmkit.benchmarking.prompts import CHAT_PROMPTS

    if tasks:
        found = [p for p in task_prompts() if p in CHAT_PROMPTS]
        assert not found, f"task prompts in lmkit bench's chat set: {found}"
        first = list(dict.fromkeys(p + style for p in task_prompts() for style in STYLES))
        random.Random(seed).shuffle(first)
        chosen = set(first)
        rest = [p for p in prompts(n, seed) if p not in chosen]
        return (first + rest)[:n]
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
    ap.add_argument("--tasks", action="store_true",
                    help="start with everyday chat tasks (facts, arithmetic, code, SQL, "
                         "translation, recipes, lists, ...) before the topic prompts")
    args = ap.parse_args()
    rows = prompts(args.n, args.seed, args.tasks)
    args.out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()
