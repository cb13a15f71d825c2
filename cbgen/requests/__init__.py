"""The values a step speaks: requests and their text, the scheduler's output (what the executor runs)."""
