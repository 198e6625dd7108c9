"""Prompts the tests share: varied English and code sentences, cut to exact lengths."""

from __future__ import annotations

SENTENCES = [
    "The old lighthouse keeper climbed the stairs every evening to light the lamp.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "In 1969, astronauts walked on the Moon for the first time.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The recipe calls for two cups of flour, one egg, and a pinch of salt.",
    "Quantum computers use qubits, which can exist in superpositions of states.",
    "She opened the letter slowly, afraid of what it might say.",
    "The stock market fell sharply after the central bank raised interest rates.",
    "Mount Everest is the highest mountain above sea level, at 8,849 metres.",
    "To install the package, run pip install followed by its name.",
    "The committee will meet on Tuesday to discuss the new budget proposal.",
    "Dolphins are highly intelligent marine mammals known for their playful behaviour.",
    "Once upon a time, in a kingdom far away, there lived a curious young princess.",
    "The French Revolution began in 1789 and transformed European politics.",
    "Water boils at 100 degrees Celsius at sea level.",
    "Please summarize the following article in three sentences.",
    "The train to Berlin departs from platform nine at half past seven.",
    "Machine learning models learn patterns from large amounts of data.",
    "He played the violin every morning before breakfast.",
    "The Amazon rainforest produces a significant share of the world's oxygen.",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY name;",
    "Jupiter is the largest planet in our solar system.",
    "The museum's new exhibit features paintings from the Renaissance.",
    "Regular exercise improves both physical and mental health.",
    "Translate the following sentence into Spanish: the cat is on the table.",
    "The bridge was closed for repairs after the storm damaged its supports.",
    "Shakespeare wrote Hamlet around the year 1600.",
    "A balanced diet includes fruits, vegetables, proteins and whole grains.",
    "The detective examined the footprints near the window.",
    "Electric cars are becoming more popular as battery prices fall.",
    "What are the main differences between TCP and UDP?",
    "The orchestra tuned their instruments before the concert began.",
]


def make_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """count varied prompts of exactly `length` tokens, built from rotating sentences."""
    prompts = []
    for i in range(count):
        ids: list[int] = []
        j = 0
        while len(ids) < length:
            ids += tokenizer.encode(SENTENCES[(i + j) % len(SENTENCES)] + " ", add_special_tokens=False)
            j += 1
        prompts.append(ids[:length])
    return prompts
