"""Quantised graphs: int8 / int4 MatMulNBits, int8-dynamic (its activations per row:
``dynamic_rows``) and GGUF blocks (export/gguf/blocks.py), and the figures that judge them
(``weights``)."""
