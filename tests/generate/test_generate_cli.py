"""`python -m jaxrl.generate` on a tiny checkpoint."""

import pytest

from jaxrl.generate.__main__ import main
from jaxrl.testing import make_hf_model


@pytest.mark.slow
def test_cli_prints_completions(tmp_path, capsys):
    make_hf_model("qwen2", tmp_path, vocab_size=128)
    assert main(["--model", str(tmp_path), "--prompt", "hello", "--tokenizer", "char",
                 "--max-tokens", "5", "--temperature", "1.0", "-n", "2", "--logprobs"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- prompt 0 sample") == 2 and "logprobs:" in out
    assert "tokens in" in out
