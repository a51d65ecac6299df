"""Recipe that builds the embedded model `mtplx-tiny-coder` (not part of the wheel).

Run order (see training/README.md): corpus -> tokenizer -> pack -> train (on the H200) -> export.
"""
