"""GGUF in and out: the file a checkpoint came from (``source``) and its blocks as MatMulNBits
(``blocks``); a checkpoint (``model_file``) or LoRA adapter (``adapter_file``) as a llama.cpp
file, with llama.cpp's tensor layout (``layout``) and metadata (``metadata``)."""
