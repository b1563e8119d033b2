"""The embedded SmolLM2-135M-Instruct GGUF: transformers loads the same file on
its own, and Baton's greedy tokens equal its tokens for the same prompt ids."""

from __future__ import annotations

import pytest
import torch

from backends.interface import SamplingParams
from backends.loader.embedded import embedded_model_path
from tests.engine_helpers import make_engine, run_all

MAX_NEW = 16


@pytest.fixture(scope="module")
def hf_gguf_model():
    from transformers import AutoModelForCausalLM
    path = embedded_model_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                dtype=torch.float32).eval()


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_on_embedded_gguf(hf_gguf_model):
    core = make_engine(None, max_num_batched_tokens=64, num_kv_blocks=64)
    tok = core.tokenizer
    texts = ["def fibonacci(n):\n    ",
             "Once upon a time, in a land far away, there lived a dragon who loved numbers "
             "like 12345 and 3.14159."]
    prompts = {f"t{i}": tok.encode(t) for i, t in enumerate(texts)}
    got = run_all(core, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                                ignore_eos=True, logprobs=1))
    for rid, ids in prompts.items():
        out = hf_gguf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW,
                                     do_sample=False, eos_token_id=None, pad_token_id=2,
                                     output_logits=True, return_dict_in_generate=True)
        expected = out.sequences[0, len(ids):].tolist()
        assert got[rid].token_ids == expected, rid
        for lp, logits in zip(got[rid].logprobs, out.logits):
            ref = torch.log_softmax(logits[0].float(), -1)[lp.token_id].item()
            assert abs(lp.logprob - ref) < 1e-3


def test_chat_generation_is_sensible():
    from service.chat_template import render_chat
    core = make_engine(None, dtype="auto", num_kv_blocks=64)
    tok = core.tokenizer
    text = render_chat(tok.chat_template,
                       [{"role": "user", "content": "What is the capital of France?"}],
                       bos_token=tok.spec.bos_token, eos_token=tok.spec.eos_token)
    assert text.endswith("<|im_start|>assistant\n")
    res = run_all(core, {"c": tok.encode(text, add_special_tokens=False)},
                  SamplingParams(temperature=0.0, max_tokens=40))["c"]
    assert "Paris" in res.text
    assert res.finish_reason == "stop"  # <|im_end|> ends the turn
