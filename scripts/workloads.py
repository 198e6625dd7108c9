"""Chat workloads for the benchmarks: open chat, and input-grounded requests whose answers
copy much of their input (rewrite, extract, quote, edit code), where vLLM reports n-gram
speculation paying off. Prompts are the model's chat template applied to each message."""

from __future__ import annotations

from typing import Any

PASSAGE = (
    "The city council met on Tuesday evening to discuss the new budget. Councillor Maria Lopez proposed "
    "moving two million dollars from road repairs to the public library, arguing that the library had not "
    "been renovated since 1987. Councillor James Okafor disagreed, saying that the roads on the north side "
    "were dangerous after the winter storms. After two hours of debate, the council voted five to four to "
    "split the money evenly between the two projects. The mayor, Helen Brandt, said she was pleased with "
    "the compromise and thanked residents for attending."
)
CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age, email = line.strip().split(",")
            users.append({"name": name, "age": int(age), "email": email})
    return users


def adults(users):
    result = []
    for user in users:
        if user["age"] >= 18:
            result.append(user)
    return result
'''
EMAIL = (
    "Hi team, quick update on the release. The build for version 2.4.1 passed all tests on Monday. "
    "Priya fixed the login timeout bug, Tom updated the payment page, and Chen wrote the migration "
    "script for the new database. We plan to ship on Thursday at 10am. Please review the release notes "
    "before Wednesday noon. Thanks, Alex"
)

GROUNDED = [
    f"Rewrite the following paragraph in the past perfect tense, changing nothing else:\n\n{PASSAGE}",
    f"Add type hints to every function in this Python code and return the whole file:\n\n{CODE}",
    f"Copy the following email exactly, but replace every person's name with [NAME]:\n\n{EMAIL}",
    f"Quote, word for word, the sentences of this paragraph that mention a councillor:\n\n{PASSAGE}",
    f"Rename the function `adults` to `filter_adults` in this code and return the full code:\n\n{CODE}",
    f"Rewrite this email as a numbered list of its facts, keeping the original wording:\n\n{EMAIL}",
    f"Correct any errors and return the corrected text in full:\n\n{PASSAGE.replace('council', 'counsil')}",
    f"Add a docstring to each function and return the whole file unchanged otherwise:\n\n{CODE}",
]

CHAT = [
    "Write a short story about a robot who learns to paint.",
    "What are three tips for staying focused while studying?",
    "Explain how a rainbow forms, in simple words.",
    "Suggest a name and a menu for a small Italian restaurant.",
    "Describe your ideal weekend in the mountains.",
    "Why do cats purr? Give a few possible reasons.",
    "Write a friendly message inviting a neighbour to a barbecue.",
    "What should I pack for a week-long trip to the beach?",
]

# Short questions with short answers, for beam search against transformers (tests/engine/test_beam.py).
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three primary colors.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for 'happy'.",
    "What is the boiling point of water in Fahrenheit?",
    "Name a planet with rings.",
    "Summarize the plot of Cinderella in two sentences.",
    "What does a CPU do?",
    "Suggest a name for a pet goldfish.",
    "How many days are in a leap year?",
    "What is the opposite of 'ancient'?",
    "Write a one-line slogan for a coffee shop.",
    "Why is the sky blue?",
    "What language is spoken in Brazil?",
    "Give an example of a mammal that lays eggs.",
    "What is the square root of 81?",
    "Describe a rainbow in five words.",
    "What is the largest ocean on Earth?",
    "Recommend a book for a long flight.",
    "How do you say 'thank you' in Japanese?",
]

WORKLOADS = {"grounded": GROUNDED, "chat": CHAT, "questions": QUESTIONS}


def prompts(tokenizer: Any, name: str) -> list[list[int]]:
    """The workload's messages as prompt token ids, through the model's chat template."""
    from engine.prompts import apply_chat_template

    return [apply_chat_template(tokenizer, [{"role": "user", "content": m}]) for m in WORKLOADS[name]]
