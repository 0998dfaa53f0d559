"""Turning a model file into a loaded model: the GGUF header and tensor readers (`gguf_file`), the
GGUF and safetensors loaders (`loader`), a GGUF file's own blocks in place (`gguf_in_place`), the
converted-weights cache (`converted`), the one entry point `loaded_model.load_model`, loading off the
engine thread (`load_thread`), file identity (`file_identity`) and per-layer digests (`digests`)."""
