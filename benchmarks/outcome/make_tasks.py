"""The three small tasks of the outcome record (benchmarks/outcome_cpu.md), written as chat JSONL files.

Each task is what a hobbyist brings: 60 training chats that teach one fixed behaviour, and 40 test chats the run
never sees (other countries, other reviews, other errands). The rows are built from word lists here with a fixed
seed, so the files are reproducible:

* ``capital_format``: "What is the capital of Peru?" -> "Answer: Lima" (a fixed answer format around a fact the
  base model may know: the task scores the format and the fact together; countries the knowledge check mentions
  are left out, so the task never trains on a fact the check scores);
* ``review_label``: a short product review -> "positive" or "negative" (a classification label);
* ``todo_rewrite``: "I have to call the plumber before Friday." -> "TODO: call the plumber (before Friday)" (a rewrite
  in a fixed style).

    python benchmarks/outcome/make_tasks.py      # writes benchmarks/outcome/<task>/{train,test}.jsonl
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN, TEST = 60, 40

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo", "Greece": "Athens",
    "Austria": "Vienna", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Denmark": "Copenhagen",
    "Ireland": "Dublin", "Poland": "Warsaw", "Hungary": "Budapest", "Belgium": "Brussels", "Netherlands": "Amsterdam",
    "Thailand": "Bangkok", "Kenya": "Nairobi", "Peru": "Lima", "Chile": "Santiago", "Argentina": "Buenos Aires",
    "Mexico": "Mexico City", "Canada": "Ottawa", "Australia": "Canberra", "India": "New Delhi", "Cuba": "Havana",
    "Iran": "Tehran", "Iraq": "Baghdad", "Turkey": "Ankara", "Ukraine": "Kyiv", "Czech Republic": "Prague",
    "South Korea": "Seoul", "Vietnam": "Hanoi", "Indonesia": "Jakarta", "Philippines": "Manila", "Malaysia":
    "Kuala Lumpur", "Colombia": "Bogota", "Venezuela": "Caracas", "Ethiopia": "Addis Ababa", "Nigeria": "Abuja",
    "Morocco": "Rabat", "Saudi Arabia": "Riyadh", "Israel": "Jerusalem", "Syria": "Damascus", "Lebanon": "Beirut",
    "Afghanistan": "Kabul", "Pakistan": "Islamabad", "Bangladesh": "Dhaka", "Nepal": "Kathmandu", "Iceland":
    "Reykjavik", "Switzerland": "Bern", "Romania": "Bucharest", "Bulgaria": "Sofia", "Serbia": "Belgrade",
    "Croatia": "Zagreb", "Scotland": "Edinburgh", "England": "London", "Wales": "Cardiff", "Jamaica": "Kingston",
    "Ghana": "Accra", "Senegal": "Dakar", "Uganda": "Kampala",
    "Tanzania": "Dodoma", "Zimbabwe": "Harare", "Algeria": "Algiers", "Tunisia": "Tunis", "Libya": "Tripoli",
    "Sudan": "Khartoum", "Qatar": "Doha", "Jordan": "Amman", "Mongolia": "Ulaanbaatar", "Cambodia": "Phnom Penh",
    "Laos": "Vientiane", "Sri Lanka": "Colombo", "New Zealand": "Wellington", "Uruguay": "Montevideo",
    "Paraguay": "Asuncion", "Bolivia": "Sucre", "Ecuador": "Quito", "Panama": "Panama City", "Costa Rica":
    "San Jose", "Honduras": "Tegucigalpa", "Guatemala": "Guatemala City", "Estonia": "Tallinn", "Latvia": "Riga",
    "Lithuania": "Vilnius", "Slovakia": "Bratislava", "Slovenia": "Ljubljana", "Albania": "Tirana", "Cyprus":
    "Nicosia", "Malta": "Valletta", "Luxembourg": "Luxembourg", "Belarus": "Minsk", "Georgia": "Tbilisi",
    "Armenia": "Yerevan", "Azerbaijan": "Baku", "Kazakhstan": "Astana", "Uzbekistan": "Tashkent", "Oman": "Muscat",
    "Yemen": "Sanaa", "Kuwait": "Kuwait City", "Singapore": "Singapore", "Brazil": "Brasilia", "Angola": "Luanda",
    "Zambia": "Lusaka", "Namibia": "Windhoek", "Botswana": "Gaborone", "Madagascar": "Antananarivo", "Somalia":
    "Mogadishu", "Rwanda": "Kigali", "Mali": "Bamako", "Niger": "Niamey", "Chad": "N'Djamena", "Cameroon": "Yaounde",
    "Bhutan": "Thimphu", "Myanmar": "Naypyidaw", "North Korea": "Pyongyang", "Taiwan": "Taipei",
    "United States": "Washington", "United Kingdom": "London", "Fiji": "Suva", "Haiti": "Port-au-Prince",
}  # fmt: skip
CAPITAL_QUESTIONS = (
    "What is the capital of {c}?", "What's the capital city of {c}?", "Which city is the capital of {c}?",
    "Name the capital of {c}.", "{c}: what is its capital?",
)  # fmt: skip

PRODUCTS = ("blender", "backpack", "phone case", "desk lamp", "kettle", "pair of headphones", "coffee grinder",
            "rain jacket", "keyboard", "frying pan", "tent", "water bottle", "office chair", "toaster", "umbrella",
            "power bank", "yoga mat", "alarm clock", "pillow", "bike light", "vacuum cleaner",
            "hair dryer")  # fmt: skip
GOOD = ("works perfectly", "is sturdy and well made", "exceeded my expectations", "was worth every penny",
        "arrived quickly and works great", "is exactly as described", "feels solid and reliable",
        "is a joy to use every day", "still works like new after months", "is the best I have owned")  # fmt: skip
BAD = ("broke after two days", "stopped working within a week", "feels cheap and flimsy", "was a waste of money",
       "arrived damaged and useless", "is nothing like the photos", "leaks every time I use it",
       "is far too loud to use", "fell apart on the first use", "is the worst purchase I have made")  # fmt: skip
GOOD_END = ("I would buy it again.", "Highly recommended.", "Five stars.", "Very happy with it.", "", "Love it.")
BAD_END = ("I want a refund.", "Do not buy it.", "One star.", "Very disappointed.", "", "Avoid it.")
REVIEW_ASKS = ("Label this review as positive or negative: {r}", "Review: {r}\nSentiment?",
               "Is this review positive or negative? {r}", "Classify the sentiment: {r}")  # fmt: skip

ERRANDS = ("call the plumber", "book a dentist appointment", "pay the electricity bill", "return the library books",
           "buy a birthday present for Sam", "renew my passport", "water the plants", "send the invoice to Ana",
           "clean the garage", "pick up the dry cleaning", "email my landlord", "fix the bike tyre",
           "order new printer ink", "cancel the gym membership", "bake a cake for the party", "walk the dog",
           "update my CV", "charge the camera battery", "feed the neighbour's cat", "wash the car",
           "print the boarding passes", "call grandma", "defrost the freezer", "sort the recycling")  # fmt: skip
WHEN = ("before Friday", "tomorrow", "tonight", "by Monday", "this weekend", "next week", "before noon",
        "on Saturday", "after work", "by the end of the month")  # fmt: skip
TODO_OPENERS = ("I have to {e} {w}.", "I need to {e} {w}.", "Remember to {e} {w}.", "Don't forget to {e} {w}.",
                "I must {e} {w}.", "I should {e} {w}.")  # fmt: skip
TODO_ASK = "Rewrite as a to-do item: {s}"


def chat(prompt: str, answer: str) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def in_knowledge_check() -> set[str]:
    """Countries whose name or capital the knowledge check mentions: the task never trains on a fact it scores."""
    path = HERE.parents[1] / "resources" / "knowledge" / "questions.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    text = " ".join(" ".join([row["question"], row["answer"], *row.get("accept", [])]) for row in rows)
    return {
        country
        for country in CAPITALS
        if any(re.search(rf"\b{re.escape(word)}\b", text) for word in (country, CAPITALS[country]))
    }


def capital_rows(rng: random.Random) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    excluded = in_knowledge_check()
    countries = sorted(c for c in CAPITALS if c not in excluded)
    rng.shuffle(countries)
    test_countries, train_countries = countries[:TEST], countries[TEST:]
    train = [chat(rng.choice(CAPITAL_QUESTIONS).format(c=c), f"Answer: {CAPITALS[c]}") for c in train_countries]
    while len(train) < TRAIN:  # the training countries again, asked another way
        c = rng.choice(train_countries)
        train.append(chat(rng.choice(CAPITAL_QUESTIONS).format(c=c), f"Answer: {CAPITALS[c]}"))
    test = [chat(rng.choice(CAPITAL_QUESTIONS).format(c=c), f"Answer: {CAPITALS[c]}") for c in test_countries]
    return train[:TRAIN], test


def review(rng: random.Random, products: tuple[str, ...], good: bool) -> str:
    phrase = rng.choice(GOOD if good else BAD)
    end = rng.choice(GOOD_END if good else BAD_END)
    return f"The {rng.choice(products)} {phrase}. {end}".strip()


def review_rows(rng: random.Random) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    products = list(PRODUCTS)
    rng.shuffle(products)
    seen, unseen = tuple(products[6:]), tuple(products[:6])  # test reviews are about products never trained on

    def rows(count: int, pool: tuple[str, ...]) -> list[dict[str, object]]:
        out = []
        for i in range(count):
            good = i % 2 == 0
            text = review(rng, pool, good)
            out.append(chat(rng.choice(REVIEW_ASKS).format(r=text), "positive" if good else "negative"))
        rng.shuffle(out)
        return out

    return rows(TRAIN, seen), rows(TEST, unseen)


def todo_rows(rng: random.Random) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    errands = list(ERRANDS)
    rng.shuffle(errands)
    seen, unseen = errands[6:], errands[:6]  # test errands never appear in training

    def rows(count: int, pool: list[str]) -> list[dict[str, object]]:
        out = []
        for _ in range(count):
            errand, when = rng.choice(pool), rng.choice(WHEN)
            sentence = rng.choice(TODO_OPENERS).format(e=errand, w=when)
            out.append(chat(TODO_ASK.format(s=sentence), f"TODO: {errand} ({when})"))
        return out

    return rows(TRAIN, seen), rows(TEST, unseen)


TASKS: dict[str, Callable[[random.Random], tuple[list[dict[str, object]], list[dict[str, object]]]]] = {
    "capital_format": capital_rows,
    "review_label": review_rows,
    "todo_rewrite": todo_rows,
}


def write(path: Path, rows: list[dict[str, object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def main() -> None:
    for offset, (name, build) in enumerate(TASKS.items()):
        train, test = build(random.Random(1234 + offset))
        write(HERE / name / "train.jsonl", train)
        write(HERE / name / "test.jsonl", test)
        print(f"{name}: {len(train)} training chats, {len(test)} test chats")


if __name__ == "__main__":
    main()
