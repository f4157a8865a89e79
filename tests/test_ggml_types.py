"""catalog/ggml_types.py, the supervisor's copy of GGML's type tables, agrees with the `gguf` package."""

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from gpushare.catalog.ggml_types import BLOCK_SIZES, FILE_TYPE_NAMES, GGMLType


def test_tensor_types_and_block_sizes_are_gguf_s():
    assert {t.name: t.value for t in GGMLType} == {t.name: t.value for t in GGMLQuantizationType}
    assert {t.name: size for t, size in BLOCK_SIZES.items()} == {t.name: s for t, s in GGML_QUANT_SIZES.items()}


def test_file_type_names_are_gguf_s():
    assert FILE_TYPE_NAMES == {t.value: t.name.removeprefix("MOSTLY_") for t in LlamaFileType}
