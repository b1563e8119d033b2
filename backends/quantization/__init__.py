"""Weight-only quantization for the torch backend: int8 per output channel,
int4 in groups, and GGUF's Q8_0 / Q4_0 / Q4_1 blocks kept as loaded.

A state-dict transform plus a swap of each decoder layer's linear modules;
the model file never knows (see apply.py). Embeddings, norms and the output
layer stay in the serving dtype. docs/quantization.md says which kernel runs
where.
"""

from backends.quantization.spec import (DEFAULT_GROUP_SIZE, GGUF_KEPT_TYPES, GROUP_SIZES,
                                        MODES, QuantizationError, QuantizationSpec,
                                        check_spec, gguf_block_types, projection_formats,
                                        resolve_group_size)

__all__ = ["DEFAULT_GROUP_SIZE", "GGUF_KEPT_TYPES", "GROUP_SIZES", "MODES",
           "QuantizationError", "QuantizationSpec", "check_spec", "gguf_block_types",
           "projection_formats", "resolve_group_size", "load_quantized",
           "resident_weight_bytes"]


def __getattr__(name: str):
    # torch-heavy parts load on first use, so service/ can import the spec
    # (and its error type) without paying for torch.
    if name in ("load_quantized", "resident_weight_bytes"):
        from backends.quantization import apply
        return getattr(apply, name)
    raise AttributeError(name)
