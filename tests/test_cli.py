"""The command line runs the bundled model end to end."""

from __future__ import annotations

import re

from cbgen.cli import main


def test_generate_prints_completions_and_throughput(smollm2, capsys):
    code = main(
        [
            "generate",
            "--model",
            "smollm2",
            "--prompt",
            "What is 2+2?",
            "--prompt",
            "Say hi.",
            "--max-new-tokens",
            "8",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "### What is 2+2?" in out and "### Say hi." in out
    assert re.search(r"2 requests \| prompt \d+ tok .* output \d+ tok \(.* tok/s\) \| wall", out)


def test_generate_without_prompts_fails_cleanly(capsys):
    assert main(["generate"]) == 2
    assert "at least one --prompt" in capsys.readouterr().err


def test_generate_with_quantization(smollm2, capsys):
    code = main(
        ["generate", "--quantization", "int8", "--prompt", "Say hi.", "--max-new-tokens", "4"]
    )
    assert code == 0
    assert "### Say hi." in capsys.readouterr().out
