"""`pdserve generate` (pdserve/commands/generate.py) prints the engine's text."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from pdserve.cli import main

pytestmark = pytest.mark.timeout(120)


def test_generate_prints_greedy_text(tiny_model_dir, capsys):
    rc = main(["generate", "--model", str(tiny_model_dir), "--prompt", "hello world",
               "--max-tokens", "6", "--ignore-eos"])
    assert rc == 0
    tokenizer = Tokenizer.from_pretrained(tiny_model_dir)
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir)))
    (expected,) = engine.generate([tokenizer.encode("hello world")],
                                  SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert capsys.readouterr().out == expected.text + "\n"


def test_generate_reports_bad_flags(tiny_model_dir, capsys):
    rc = main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--top-p", "0"])
    assert rc == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
