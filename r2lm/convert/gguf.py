"""transformers' GGUF loading without its repeated work.

`AutoModelForCausalLM.from_pretrained(folder, gguf_file=F)` parses F's metadata twice, once for the config and once
for the weights (gguf-py's GGUFReader: every string of the vocabulary becomes numpy views), and `AutoTokenizer` a
third time; while it names the tensors it builds gguf-py's table of tensor names anew for every submodule of the
model (hundreds of tables, each over every tensor kind of every block). For SmolLM2-135M-Instruct that repeated
work is most of a load (docs/results.md, "Reading a GGUF file"). Inside `reading_gguf()` each file is parsed once
and each table built once; what transformers makes of them is unchanged, bit for bit (tests/convert/test_gguf.py).
"""

from __future__ import annotations

import contextlib
import functools
import os


@contextlib.contextmanager
def reading_gguf():
    """While it lasts, transformers' GGUF loaders share one read-only gguf.GGUFReader per file (a file replaced
    meanwhile is read anew) and one tensor-name table per (architecture, block count): it stands in for the two
    names of the gguf module that transformers looks up at each load, `GGUFReader` and `get_tensor_name_map`, and
    puts them back on leaving, however it is left. What they return are gguf-py's own objects, which the loaders
    only read. Without gguf installed it does nothing (transformers' loader then says what it needs)."""
    try:
        import gguf
    except ImportError:
        yield
        return
    reader_class, name_table = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def reader(path, mode="r"):
        if mode != "r":  # a writable map is its caller's own
            return reader_class(path, mode)
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_table)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_table
