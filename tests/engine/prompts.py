"""Prompts shared by the tests: short and long, chat-templated and plain."""

# About 500 tokens of plain English, written for these tests.
LONG_TEXT = " ".join([
    "The river town woke slowly. Fishermen pulled their boats onto the gravel, counted the night's catch and argued",
    "about the weather, as they had every morning for forty years. The baker opened her shutters at six; the smell",
    "of bread drifted across the square to the school, where the teacher was already writing sums on the board.",
    "Nobody in the town owned a computer that could run a language model, yet everybody had heard of them.",
] * 5)

PLAIN_PROMPTS = [
    "Hello",
    "The three primary colours are",
    "def fibonacci(n):\n    ",
    LONG_TEXT,
]

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about a kettle.",
]
