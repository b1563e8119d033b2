"""`baton export`: the embedded GGUF written as a Hugging Face folder loads in
Baton and in transformers and gives the same greedy tokens as the GGUF."""

from __future__ import annotations

import pytest
import torch

from backends.interface import SamplingParams
from service.cli import main
from tests.engine_helpers import make_engine, run_all


@pytest.mark.slow
def test_export_round_trip(tmp_path):
    out = tmp_path / "smollm2-hf"
    assert main(["export", "--dtype", "float32", str(out)]) == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "generation_config.json"):
        assert (out / name).is_file(), name
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    gguf_core = make_engine(None, num_kv_blocks=32)
    prompt = gguf_core.tokenizer.encode("The quick brown fox")
    from_gguf = run_all(gguf_core, {"a": prompt}, params)["a"]
    hf_core = make_engine(out, num_kv_blocks=32)
    assert hf_core.tokenizer.encode("The quick brown fox") == prompt
    assert hf_core.tokenizer.chat_template == gguf_core.tokenizer.chat_template
    from_folder = run_all(hf_core, {"a": prompt}, params)["a"]
    assert from_folder.token_ids == from_gguf.token_ids

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                         eos_token_id=None, pad_token_id=2)[0, len(prompt):].tolist()
    assert ref == from_gguf.token_ids
    assert AutoTokenizer.from_pretrained(out)("The quick brown fox")["input_ids"] == prompt


def test_export_refuses_a_family_it_cannot_write(new_arch_dirs):
    """The export writes the families GGUF files bring (Llama, Mistral,
    Qwen2, Qwen3); Gemma and the others come as Hugging Face folders already,
    and asking to export one is a clear error, not a wrong config.json."""
    from backends.errors import ModelLoadError
    from backends.loader import load_model
    from backends.loader.export import hf_config
    loaded = load_model(new_arch_dirs("gemma2"))
    with pytest.raises(ModelLoadError, match="writes llama, mistral, qwen2, qwen3 models, "
                                             "not gemma2"):
        hf_config(loaded, torch.float32)
