"""Reading llama.cpp's GGUF files: metadata and weights (``reader``), blocks as MatMulNBits
codes (``codes``), the tokenizer (``vocab``), and ``attnserve import --gguf``
(``to_checkpoint``)."""
