"""`python -m jaxrl.generate` on a tiny checkpoint."""

import pytest

from jaxrl.generate.__main__ import main
from jaxrl.testing import make_hf_model


@pytest.mark.slow
def test_cli_prints_completions(tmp_path, capsys):
    make_hf_model("qwen2", tmp_path, vocab_size=128)
    assert main(["--model", str(tmp_path), "--prompt", "hello", "--tokenizer", "char",
                 "--max-tokens", "5", "--temperature", "1.0", "-n", "2", "--logprobs"]) == 0
    out, err = capsys.readouterr()
    assert out.count("--- prompt 0 sample") == 2 and "logprobs:" in out
    assert "tokens in" in out
    assert "no tokenizer.json" not in err  # --tokenizer given: no note


def test_a_model_without_tokenizer_says_which_it_uses(tmp_path, capsys):
    make_hf_model("llama", tmp_path, vocab_size=128)
    assert main(["--model", str(tmp_path), "--prompt", "hi", "--max-tokens", "2"]) == 0
    assert "has no tokenizer.json: using jaxrl's character tokenizer" in capsys.readouterr().err
