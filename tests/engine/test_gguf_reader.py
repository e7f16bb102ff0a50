"""engine/loading/gguf_reader.py: gguf-py's reader over plain views of the map, and one reader per file while a
conversion runs."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.loading.gguf_converter import convert_gguf
from engine.loading.gguf_reader import read_gguf, shared_readers
from tests.engine.factories import make_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama_dir, tmp_path_factory):
    """A GGUF with a tokenizer (arrays of strings, scores and types), scalars of several types, F32 and Q8_0
    tensors."""
    return make_tiny_gguf(tiny_llama_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf", "Q8_0")


def test_reads_what_gguf_py_reads(tiny_gguf):
    ours, theirs = read_gguf(tiny_gguf), gguf.GGUFReader(str(tiny_gguf))
    assert isinstance(ours, gguf.GGUFReader)
    assert list(ours.fields) == list(theirs.fields)
    assert "tokenizer.ggml.tokens" in ours.fields and "tokenizer.ggml.merges" in ours.fields
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), name
        assert len(mine.parts) == len(field.parts), name
        for part, expected in zip(mine.parts, field.parts):
            assert part.dtype == expected.dtype and np.array_equal(part, expected), name
            assert type(part) is np.ndarray and type(expected) is np.memmap  # what makes ours quicker
        assert mine.contents() == field.contents(), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    assert {t.tensor_type.name for t in ours.tensors} == {"F32", "Q8_0"}
    for tensor, expected in zip(ours.tensors, theirs.tensors):
        assert tensor.tensor_type == expected.tensor_type and np.array_equal(tensor.shape, expected.shape)
        assert tensor.data_offset == expected.data_offset and np.array_equal(tensor.data, expected.data)
    assert not ours.tensors[0].data.flags.writeable  # the file's map, read only


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="GGUF magic invalid"):
        read_gguf(path)


def test_shared_readers_give_one_reader_per_file_and_then_put_gguf_back(tiny_gguf, tiny_llama_dir, tmp_path):
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    other = make_tiny_gguf(tiny_llama_dir, tmp_path / "other.gguf")
    with shared_readers():
        first = gguf.GGUFReader(str(tiny_gguf))  # as transformers calls it
        assert (
            read_gguf(tiny_gguf) is first
            and gguf.GGUFReader(tiny_gguf.parent / ".." / tiny_gguf.parent.name / "tiny.gguf") is first
        )
        assert gguf.GGUFReader(str(other)) is not first
        table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is table
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3) is not table
        assert table.get_name("model.layers.1.self_attn.q_proj") == "blk.1.attn_q"
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)
    assert read_gguf(tiny_gguf) is not read_gguf(tiny_gguf)


def test_shared_readers_put_gguf_back_after_an_error(tmp_path):
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(FileNotFoundError), shared_readers():
        gguf.GGUFReader(str(tmp_path / "missing.gguf"))
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)


def test_shared_readers_share_read_only_readers_only(tiny_gguf):
    with shared_readers():
        assert gguf.GGUFReader(str(tiny_gguf), "c") is not gguf.GGUFReader(str(tiny_gguf), "c")
        assert gguf.GGUFReader(str(tiny_gguf), "c") is not gguf.GGUFReader(str(tiny_gguf))


def test_a_truncated_header_is_refused(tiny_gguf, tmp_path):
    whole = tiny_gguf.read_bytes()
    tokens = whole.index(b"tokenizer.ggml.tokens")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: tokens + 200])  # inside the vocabulary's array
    with pytest.raises(ValueError, match="truncated GGUF header"):
        read_gguf(cut, arrays=False)


def test_a_conversion_reads_the_file_once(tiny_gguf, tmp_path, monkeypatch):
    """transformers reads the file for the config, the weights and the tokenizer; the MoE check reads it too."""
    parses = []
    reader_class = gguf.GGUFReader  # PlainViewReader's __init__ is this one's: every parse, ours or not
    original = reader_class.__init__

    def counted(self, *args, **kwargs):
        parses.append(str(args[0]))
        original(self, *args, **kwargs)

    monkeypatch.setattr(reader_class, "__init__", counted)
    convert_gguf(tiny_gguf, tmp_path)
    assert parses == [str(tiny_gguf)]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in tmp_path.iterdir()}


@pytest.mark.parametrize("endianness", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_arrays_left_out_step_over_every_kind_of_array(tmp_path, endianness):
    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianness)
    writer.add_string("before", "a string")
    writer.add_array("strings", ["", "x", "héllo" * 40])
    writer.add_array("numbers", [1.5, -2.0, 3.25])
    writer.add_array("nested", [[1, 2, 3], ["a", "bc"]])
    writer.add_uint32("after", 7)
    writer.add_bool("flag", True)
    writer.add_tensor("t", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    full, scalars = gguf.GGUFReader(str(path)), read_gguf(path, arrays=False)
    arrays = {"strings", "numbers", "nested"}
    assert arrays <= set(full.fields) and not arrays & set(scalars.fields)
    assert list(scalars.fields) == [name for name in full.fields if name not in arrays]
    for name, field in scalars.fields.items():
        assert field.contents() == full.fields[name].contents(), name
    assert scalars.fields["after"].contents() == 7 and scalars.fields["before"].contents() == "a string"
    assert scalars.data_offset == full.data_offset
    (tensor,) = scalars.tensors
    assert tensor.name == "t" and np.array_equal(tensor.data, full.tensors[0].data)
    assert read_gguf(path).fields["nested"].contents() == full.fields["nested"].contents()
