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


def test_generate_names_a_missing_file_cleanly(tmp_path, capsys):
    missing = str(tmp_path / "nope.txt")
    assert main(["generate", "--prompts-file", missing]) == 2
    assert "nope.txt" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--json-schema", missing]) == 2
    assert "nope.txt" in capsys.readouterr().err


def test_generate_with_quantization(smollm2, capsys):
    code = main(
        ["generate", "--quantization", "int8", "--prompt", "Say hi.", "--max-new-tokens", "4"]
    )
    assert code == 0
    assert "### Say hi." in capsys.readouterr().out


def test_generate_with_a_regex_logprobs_and_penalties(smollm2, capsys):
    args = ["generate", "--prompt", "Is the sea blue?", "--max-new-tokens", "12"]
    args += ["--regex", "(Yes|No), [a-z]+\\.", "--logprobs", "1", "--repetition-penalty", "1.2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    answer = out.split("\n")[1]
    assert re.fullmatch(r"(Yes|No), [a-z]+\.", answer), out
    assert "[eos," in out and re.search(r"'(Yes|No)'\s+-?\d+\.\d{3} \|", out)


def test_generate_refuses_a_bad_regex_cleanly(smollm2, capsys):
    assert main(["generate", "--prompt", "Hi", "--regex", "("]) == 2
    assert "invalid regex" in capsys.readouterr().err


def _completion(out: str) -> str:
    return out.split("\n[")[0]


def test_generate_with_speculation_prints_what_plain_decoding_does(smollm2, capsys):
    args = ["generate", "--prompt", "Repeat: the cat sat on the mat.", "--max-new-tokens", "16"]
    assert main(args) == 0
    plain = _completion(capsys.readouterr().out)
    for extra in (
        ["--speculative", "ngram"],
        ["--speculative", "draft", "--draft-quantization", "int4", "--num-speculative-tokens", "3"],
    ):
        assert main(args + extra) == 0
        assert _completion(capsys.readouterr().out) == plain


def test_generate_refuses_a_draft_without_a_model_cleanly(capsys):
    assert main(["generate", "--prompt", "Hi", "--speculative", "draft"]) == 2
    assert "--draft-model" in capsys.readouterr().err
