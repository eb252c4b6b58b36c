"""The prompts of bench.speculation, written for it: code editing (a function rewritten with one
small change), grounded answers that quote a given passage, and open chat."""

from __future__ import annotations

_FUNCTIONS = [
    ('''def moving_average(values, window):
    """Return the averages of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = sum(values[:window])
    averages.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages
''', "Rename the parameter `values` to `samples` everywhere"),
    ('''def parse_config(lines):
    """Read `key = value` lines into a dictionary, skipping comments and blank lines."""
    config = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        config[key.strip()] = value.strip()
    return config
''', "Make comments start with `;` instead of `#`"),
    ('''class Stack:
    """A last-in, first-out stack."""

    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        if not self.items:
            raise IndexError("peek at an empty stack")
        return self.items[-1]
''', "Add a `__len__` method that returns the number of items"),
    ('''def binary_search(items, target):
    """Return the index of `target` in the sorted list `items`, or -1."""
    low, high = 0, len(items) - 1
    while low <= high:
        middle = (low + high) // 2
        if items[middle] == target:
            return middle
        if items[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1
''', "Return None instead of -1 when the target is missing"),
]

CODE = [f"{change} in the code below. Reply with the whole rewritten code only.\n\n```python\n"
        f"{code}```" for code, change in _FUNCTIONS]

_PASSAGES = [
    ("The lighthouse on Skerry Point was built in 1871 from granite quarried on the island "
     "itself. Its lamp burned paraffin until 1952, when it was converted to electricity, and the "
     "last keeper left in 1987, after which the light was operated automatically from the "
     "mainland. The tower is 31 metres tall and its light can be seen from 22 nautical miles "
     "away.", "When was the lamp converted to electricity, and what did it burn before?"),
    ("Honeybees communicate the location of food through the waggle dance. A forager that has "
     "found a good source of nectar returns to the hive and runs in a figure-of-eight pattern. "
     "The angle of the straight waggle run relative to vertical shows the direction of the food "
     "relative to the sun, and the duration of the run shows the distance.",
     "How does the dance show the direction and the distance of the food?"),
    ("The city council approved the new cycling plan on Tuesday. Under the plan, 40 kilometres "
     "of protected bike lanes will be built over the next five years, starting with the river "
     "corridor in the spring. The plan also lowers the speed limit on residential streets to 30 "
     "kilometres per hour and adds 2,000 bicycle parking spaces near train stations.",
     "What does the plan change about speed limits and parking?"),
    ("Sourdough bread rises because of a culture of wild yeast and lactic acid bacteria. The "
     "yeast produces carbon dioxide, which is trapped by the gluten network and makes the dough "
     "expand, while the bacteria produce lactic and acetic acids that give the bread its sour "
     "taste. A starter must be fed regularly with flour and water to keep the culture active.",
     "Why does sourdough taste sour?"),
]

QUOTE = [f"Read the passage and answer the question by quoting the exact sentences from the "
         f"passage that answer it.\n\nPassage: {passage}\n\nQuestion: {question}"
         for passage, question in _PASSAGES]

CHAT = [
    "Write a short story about a robot who learns to paint.",
    "What are some good habits for staying healthy while working from home?",
    "Explain how a rainbow forms, in simple words.",
    "Give me three ideas for a weekend trip with friends, and say why each is fun.",
]

WORKLOADS = {"code": CODE, "quote": QUOTE, "chat": CHAT}
