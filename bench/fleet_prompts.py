"""The fleet benchmark's workload (bench/fleet.py): six long system prompts, each the handbook of a
made-up service (about 400 tokens), and six user questions for each; every request is one system
prompt and one question, so what a replica's prefix cache can reuse is the system prompt.

The texts are built from fixed word lists by a seeded generator: the same on every run, distinct
from each other from their first tokens on, and written for this benchmark."""

from __future__ import annotations

import random

TOPICS = {
    "Harbour Line ferries": ("ferry", ["ticket", "cabin", "vehicle deck", "pet", "bicycle",
                                       "luggage", "timetable", "refund", "storm warning"]),
    "Northwind Library": ("library", ["loan", "reading room", "rare book", "late fee",
                                      "membership card", "printer", "study carrel", "archive"]),
    "Copperfield Clinic": ("clinic", ["appointment", "prescription", "vaccination", "referral",
                                      "test result", "waiting room", "insurance form"]),
    "Lumen Solar installers": ("installer", ["roof survey", "panel", "inverter", "battery",
                                             "warranty", "grid connection", "permit"]),
    "Greenway Bike rental": ("rental", ["helmet", "e-bike", "deposit", "child seat", "route map",
                                        "puncture", "lock", "late return"]),
    "Atlas Language school": ("school", ["course level", "placement test", "homework",
                                         "certificate", "tutor", "exam fee", "class size"]),
}

_OPENINGS = ["Staff must", "Every assistant should", "Customers may ask you to", "Never",
             "Always remember to", "When in doubt,", "Our policy is to", "It is fine to"]
_ACTIONS = ["explain the rules for the {x} in plain words", "check the {x} before promising "
            "anything", "offer a written summary of the {x}", "point to the desk that handles the "
            "{x}", "mention the fee for the {x} only when asked", "apologise once if the {x} is "
            "delayed", "keep the {x} details private", "confirm the date of the {x}",
            "describe how long the {x} usually takes", "escalate a complaint about the {x}"]
_CLOSINGS = ["between nine and five", "on weekdays", "during the busy season",
             "for members and guests alike", "unless a manager says otherwise",
             "in every reply", "with a friendly tone", "as the handbook says"]
_QUESTIONS = ["What are the rules for the {x}?", "How much does the {x} cost?",
              "Can I change my {x} online?", "Who do I talk to about a {x} problem?",
              "How long does the {x} take?", "Is the {x} available on weekends?"]


def system_prompt(name: str, sentences: int = 20) -> str:
    kind, things = TOPICS[name]
    rng = random.Random(name)
    lines = [f"You are the assistant of {name}, a {kind}. Answer briefly and politely, using "
             f"only the handbook below.", f"Handbook of {name}:"]
    for i in range(sentences):
        action = rng.choice(_ACTIONS).format(x=rng.choice(things))
        lines.append(f"{i + 1}. {rng.choice(_OPENINGS)} {action} {rng.choice(_CLOSINGS)}.")
    return "\n".join(lines)


def questions(name: str, count: int = 6) -> list[str]:
    _kind, things = TOPICS[name]
    return [_QUESTIONS[i % len(_QUESTIONS)].format(x=things[i % len(things)])
            for i in range(count)]


def workload(seed: int = 0, turns: int = 6) -> list[tuple[str, str]]:
    """(system prompt, question) for every topic and turn, shuffled."""
    requests = [(system_prompt(name), q) for name in TOPICS for q in questions(name, turns)]
    random.Random(seed).shuffle(requests)
    return requests
